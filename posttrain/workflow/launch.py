"""How a stage script starts, from its job's resources.

    gpus 0, procs 1, one node   ->  python
    gpus 0, procs P > 1         ->  torchrun --standalone --nnodes 1 --nproc-per-node P   (gloo)
    gpus G >= 1, one node       ->  torchrun --standalone --nnodes 1 --nproc-per-node G
    N > 1 nodes                 ->  srun (one task per node) torchrun --nnodes N --node-rank <node id> ...

`python` is the interpreter Snakemake runs in (a venv's, activated or not; under `--sdm conda` the env's
own `python`), and torchrun is `python -m torch.distributed.run`, the same program from that interpreter.
    N nodes, G generator nodes  ->  the same on the first N - G nodes; a Ray head beside the first
                                    torchrun, a Ray worker on each of the last G (async GRPO)

Every rule's shell line is `<prefix> stages/<stage>.py --config ... --out ...`. The prefix also puts
the checkout (so the scripts import the same `posttrain` as the workflow, also in a conda env without
it) and the working directory (a user's reward modules) on PYTHONPATH and OMP_NUM_THREADS to the job's CPUs divided among its processes.

`job_resources` maps a stage's `resources` config onto the Snakemake resources that
snakemake-executor-plugin-slurm 2.8 reads: one node asks `--gpus=G` and runs one task (the
plugin's jobstep wraps it in `srun -n1`, torchrun forks a process per GPU); several nodes set the
`mpi` resource (the jobstep then runs the shell line as is), `tasks` = nodes and a per-node
`gres` of `gpu:G`, and the shell line's own `srun` starts one torchrun per node.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

RDZV_PORT = 29500  # the master's port: this plus the job id modulo PORT_SPREAD
PORT_SPREAD = 10000
RAY_PORT = RDZV_PORT + PORT_SPREAD  # a multi-node job's Ray head: this plus the job id modulo PORT_SPREAD
_GRES_GPUS = re.compile(r"^gpu(?::[A-Za-z0-9_.]+)?:(\d+)$")


@dataclass(frozen=True)
class LaunchSpec:
    """The process layout of one job: nodes, GPUs per node, CPU processes per node, CPU threads."""

    nodes: int = 1
    gpus: int = 0
    procs: int = 1
    threads: int = 1
    rdzv_port: int = RDZV_PORT
    generator_nodes: int = 0  # the last nodes of the allocation run Ray workers for the generators

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            least = 0 if f.name in ("gpus", "generator_nodes") else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"launch: {f.name} must be an integer >= {least}, got {value!r}")
        if self.generator_nodes and self.generator_nodes >= self.nodes:
            raise ValueError(f"launch: generator_nodes={self.generator_nodes} leaves none of the {self.nodes} nodes to train on")
        if self.gpus and self.procs > 1:
            raise ValueError(f"launch: procs={self.procs} with gpus={self.gpus}; procs is for CPU runs (one process per GPU)")

    @property
    def procs_per_node(self) -> int:
        return self.gpus or self.procs


def spec_from_resources(resources: Mapping[str, Any], threads: int) -> LaunchSpec:
    """The layout a Snakemake job's resources describe (see `job_resources`)."""
    gpus = resources.get("gpu") or 0
    gres = resources.get("gres")
    if gres:
        match = _GRES_GPUS.match(str(gres))
        if not match:
            raise ValueError(f"launch: cannot read a GPU count from gres={gres!r} (expected gpu:N or gpu:model:N)")
        gpus = int(match.group(1))
    return LaunchSpec(
        nodes=resources.get("nodes") or 1, gpus=gpus, procs=resources.get("procs") or 1, threads=threads,
        generator_nodes=resources.get("generator_nodes") or 0,
    )


def job_resources(res: Mapping[str, Any]) -> dict[str, Any]:
    """A stage's `resources` config -> Snakemake resources (None leaves a resource unset)."""
    nodes, gpus = res["nodes"], res["gpus"]
    multi = nodes > 1
    return {
        "mem_mb": res["mem_mb"],
        "runtime": res["runtime"],
        "nodes": nodes,
        "procs": res["procs"],
        "gpu": gpus if gpus and not multi else None,
        "gres": f"gpu:{gpus}" if gpus and multi else None,
        "mpi": "srun" if multi else None,
        "tasks": nodes if multi else None,
        "tasks_per_gpu": 0 if gpus and multi else None,
        "generator_nodes": res.get("generator_nodes") or None,
    }


RESOURCE_NAMES = tuple(job_resources({"nodes": 1, "gpus": 0, "procs": 1, "mem_mb": 1, "runtime": 1}))


def _with_ray_nodes(torchrun: str, trainers: int, node_addr: str, cpus: int, python: str) -> str:
    """Node k >= `trainers` runs a Ray worker (`posttrain.rl.ray_node`) instead of torchrun; node 0 runs the
    Ray head beside its torchrun and stops it after; the trainer finds the head through RAY_ADDRESS. The
    cluster is the job's own, like torchrun's rendezvous: no Ray token authentication."""
    return (
        f'export RAY_ADDRESS={node_addr}:"$(({RAY_PORT} + $SLURM_JOB_ID % {PORT_SPREAD}))" RAY_AUTH_MODE=disabled; '
        'ray_tmp="/tmp/posttrain-ray-$SLURM_JOB_ID-$SLURM_NODEID"; '
        f'if [ "$SLURM_NODEID" -ge {trainers} ]; then exec {python} -m posttrain.rl.ray_node worker'
        f' --address "$RAY_ADDRESS" --temp-dir "$ray_tmp" --cpus {cpus}; fi; '
        'head=; if [ "$SLURM_NODEID" -eq 0 ]; then'
        f' {python} -m posttrain.rl.ray_node head --address "$RAY_ADDRESS" --temp-dir "$ray_tmp" & head=$!; fi; '
        f'{torchrun}; status=$?; '
        'if [ -n "$head" ]; then kill "$head"; wait "$head"; fi; exit $status'
    )


def command_prefix(spec: LaunchSpec, pythonpath: str, python: str = "python") -> str:
    """The shell words that precede `stages/<stage>.py <args>` (values are validated or quoted)."""
    omp = max(1, spec.threads // spec.procs_per_node)
    env = f"PYTHONPATH={shlex.quote(pythonpath)}${{PYTHONPATH:+:$PYTHONPATH}} OMP_NUM_THREADS={omp}"
    python = shlex.quote(python)
    if spec.nodes == 1 and spec.procs_per_node == 1 and spec.gpus == 0:
        return f"{env} {python}"
    if spec.nodes == 1:
        return f"{env} {python} -m torch.distributed.run --standalone --nnodes 1 --nproc-per-node {spec.procs_per_node}"
    # One torchrun per node, with a static rendezvous: node k of the allocation (SLURM_NODEID) is
    # node rank k, so global ranks, seeds and data shards follow the node order, not who joined
    # first (c10d would hand out node ranks by arrival). The master is the allocation's first node,
    # at its Slurm NodeAddr (a node's name need not resolve), read inside each task: the jobstep
    # strips SLURM_JOB_NODELIST from the job shell and srun sets it for its tasks. The port is offset
    # by the job id, so two multi-node jobs that share a first node do not collide.
    first_node = '"$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"'
    node_addr = f'"$(scontrol show node {first_node} -o | tr " " "\\n" | sed -n "s/^NodeAddr=//p")"'
    trainers = spec.nodes - spec.generator_nodes
    torchrun = (
        f"{python} -m torch.distributed.run --nnodes {trainers} --nproc-per-node {spec.procs_per_node}"
        ' --node-rank "$SLURM_NODEID"'
        f" --master-addr {node_addr}"
        f' --master-port "$(({spec.rdzv_port} + $SLURM_JOB_ID % {PORT_SPREAD}))"'
        ' "$@"'
    )
    if spec.generator_nodes:
        torchrun = _with_ray_nodes(torchrun, trainers, node_addr, spec.threads, python)
    else:
        torchrun = f"exec {torchrun}"
    gres = f" --gres=gpu:{spec.gpus}" if spec.gpus else ""
    return (
        f"{env} srun --nodes={spec.nodes} --ntasks={spec.nodes} --ntasks-per-node=1"
        f" --cpus-per-task={spec.threads}{gres} --kill-on-bad-exit=1"
        f" sh -c {shlex.quote(torchrun)} torchrun"
    )
