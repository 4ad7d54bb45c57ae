#!/usr/bin/env bash
# Every GPU check of the project in one go, sized for a short lease on one H100/H200 (~8 minutes):
# the CUDA tests (bf16 FSDP2, compile, optimizer-in-backward, torchao low-bit, QLoRA, chunked losses,
# FlexAttention and varlen FlashAttention against the dense mask),
# the SFT and DPO memory benchmarks on CUDA, a profiled SFT step (benchmarks/speed/profile_step.py: where the
# time goes, MFU), then benchmarks/gpu/gpu_check.sh (NCCL, bf16, SFT throughput
# against TRL and the torchtune paper). Logs and JSON go to OUT_DIR; a part that fails or runs out of
# time is reported and the next one still runs.
#
#   benchmarks/gpu/gpu_all.sh OUT_DIR
#   PARTS="profile_packing gpu_check" benchmarks/gpu/gpu_all.sh OUT_DIR    # only these parts (a second lease call)
# The parts' limits add up to more than one 600 s device call: a call that runs out leaves the parts
# it finished in OUT_DIR, and PARTS runs the rest.
set -uo pipefail
[[ $# -eq 1 ]] || { echo "usage: $0 OUT_DIR" >&2; exit 2; }
OUT=$1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
mkdir -p "$OUT"
cd "$ROOT"

status=0
part() {  # part NAME LIMIT_S COMMAND...: run with a time limit, log to OUT/NAME.log (skipped when PARTS omits it)
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  if [[ -n "${PARTS:-}" && " $PARTS " != *" $name "* ]]; then echo "== $name: not in PARTS, skipped"; return; fi
  echo "== $name (limit ${limit} s)"
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$OUT/$name.log"
  echo "== $name: exit $rc after $((SECONDS - start)) s"
  [[ $rc -eq 0 ]] || status=1
}

nvidia-smi -L
"$PY" -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
part pytest_gpu 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts=-ra tests/parallel/test_parallel_gpu.py tests/losses/test_losses_gpu.py tests/models/test_attention.py
part sft_memory 75 "$PY" benchmarks/memory/sft_memory.py --device cuda --json "$OUT/sft_memory.json"
part dpo_memory 60 "$PY" benchmarks/memory/dpo_memory.py --device cuda --json "$OUT/dpo_memory.json"
part dpo_memory_4bit 60 "$PY" benchmarks/memory/dpo_memory.py --device cuda --low-bit adamw4bit --only on-precompute,on-online \
  --json "$OUT/dpo_memory_4bit.json"
for variant in packing eager; do
  part "profile_$variant" 75 "$PY" -m torch.distributed.run --standalone --nproc-per-node 1 benchmarks/speed/profile_step.py \
    --variant "$variant" --json "$OUT/profile_$variant.json" --work "$OUT/profile-work"
done
GPU_CHECK_LIMIT_OURS=${GPU_CHECK_LIMIT_OURS:-150} GPU_CHECK_LIMIT_TRL=${GPU_CHECK_LIMIT_TRL:-75} \
  part gpu_check 240 bash benchmarks/gpu/gpu_check.sh "$OUT"
exit $status
