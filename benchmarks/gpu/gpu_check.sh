#!/usr/bin/env bash
# One-GPU check for an NVIDIA H200/H100 machine, under 8 minutes: NCCL all_reduce (one process via
# torchrun), bf16 matmul, SFT throughput of a random-init Qwen3-0.6B-shaped model at 2 x 2048
# (eager, torch.compile, packing; chunked CE and optimizer-in-backward on) for posttrain and, when
# trl is installed, for TRL; the torchtune paper's anchors beside ours. Prints one table and writes
# the figures as JSON (gpu_check.json, plus each part's file) to OUT_DIR.
#
#   benchmarks/gpu/gpu_check.sh OUT_DIR [--dry]     # --dry: CPU, tiny shapes, end to end
#
# Exit status: 0 when every check that ran passed, 1 when one failed, 2 on bad usage / no GPU.
set -uo pipefail

usage() { echo "usage: $0 OUT_DIR [--dry]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
OUT=$1
shift
DRY=()
for arg in "$@"; do
  case $arg in
    --dry) DRY=(--dry) ;;
    *) usage ;;
  esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # posttrain importable without installing it
export TQDM_DISABLE=1
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT

if [[ ${#DRY[@]} -eq 0 ]] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device visible; use --dry on a machine without one" >&2
  exit 2
fi

start=$SECONDS
# Time limits keep the GPU check under 8 minutes; a part that runs out leaves what it had written.
# A dry run has none (0): on a loaded CPU its imports alone can take minutes.
LIMIT_OURS=${GPU_CHECK_LIMIT_OURS:-300} LIMIT_TRL=${GPU_CHECK_LIMIT_TRL:-150}  # seconds; env overrides for short leases
[[ ${#DRY[@]} -eq 1 ]] && LIMIT_OURS=0 LIMIT_TRL=0
timeout "$LIMIT_OURS" "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 \
  "$ROOT/benchmarks/gpu/gpu_check.py" ours --out "$OUT" --work "$WORK" "${DRY[@]}" \
  || echo "gpu_check: posttrain part exited with status $?" >&2
timeout "$LIMIT_TRL" "$PY" "$ROOT/benchmarks/gpu/gpu_check.py" trl --out "$OUT" --work "$WORK" "${DRY[@]}" \
  || echo "gpu_check: TRL part exited with status $?" >&2
"$PY" "$ROOT/benchmarks/gpu/gpu_check.py" report --out "$OUT" "${DRY[@]}"
status=$?
echo "gpu_check: $((SECONDS - start)) s"
exit $status
