"""A Ray node of a multi-node async GRPO job: the head on the first node, a worker on each generator node.

    python -m posttrain.rl.ray_node head   --address HOST:PORT --temp-dir DIR          (backgrounded)
    python -m posttrain.rl.ray_node worker --address HOST:PORT --temp-dir DIR --cpus C (blocks)

The launcher (`posttrain.workflow.launch`, `generator_nodes` > 0) runs one of these per node of the
Slurm allocation before the stage: the head holds no CPUs, so the generator actors (which ask for
CPUs) land on the worker nodes, and the trainer's torchrun runs on the other nodes and joins the
cluster through `RAY_ADDRESS`. A worker retries until the head answers, then stays until the head
goes away (the stage ended and the launcher stopped it), so the job step ends with the trainer.
Each node gets its own temporary directory, as two Ray nodes on one machine need (and the test
cluster runs every node on one machine). The cluster lives and dies with the job, like torchrun's
rendezvous, and runs without Ray's token authentication (the launcher exports RAY_AUTH_MODE=disabled).
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

JOIN_TIMEOUT_S = 300  # how long a worker waits for the head to come up
POLL_S = 2.0


def _ray(*args: str) -> list[str]:
    return [os.path.join(os.path.dirname(sys.executable), "ray"), *args]


def _reachable(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


def _common(address: str, temp_dir: str) -> list[str]:
    host = address.rsplit(":", 1)[0]
    return [f"--temp-dir={temp_dir}", f"--node-ip-address={host}", "--disable-usage-stats"]


def start_head(address: str, temp_dir: str) -> int:
    """`ray start --head` on `address`'s port with no CPUs (no actor lands on the trainer's node), until SIGTERM."""
    port = address.rsplit(":", 1)[1]
    head = subprocess.Popen(_ray("start", "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false",
                                 "--block", *_common(address, temp_dir)))
    signal.signal(signal.SIGTERM, lambda signum, frame: head.terminate())  # the launcher's stop: end the node too
    return head.wait()


def start_worker(address: str, temp_dir: str, cpus: int) -> int:
    """Join the head at `address` with `cpus` CPUs; return once the head has gone (0) or never came (1)."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not _reachable(address):
        if time.monotonic() > deadline:
            print(f"ray worker: no Ray head at {address} after {JOIN_TIMEOUT_S} s", file=sys.stderr, flush=True)
            return 1
        time.sleep(POLL_S)
    # A session of its own: once the head has gone there is nothing to drain, so the node's Ray
    # processes are killed together (SIGTERM would wait 30 s for a GCS that no longer answers).
    worker = subprocess.Popen(_ray("start", f"--address={address}", f"--num-cpus={cpus}", "--block",
                                   *_common(address, temp_dir)), start_new_session=True)
    try:
        while worker.poll() is None and _reachable(address):
            time.sleep(POLL_S)
    finally:
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        worker.wait(timeout=60)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("role", choices=("head", "worker"))
    parser.add_argument("--address", required=True, help="HOST:PORT of the head's GCS")
    parser.add_argument("--temp-dir", required=True, help="this node's Ray temporary directory")
    parser.add_argument("--cpus", type=int, default=1, help="worker: CPUs the node offers to generator actors")
    args = parser.parse_args(argv)
    os.makedirs(args.temp_dir, exist_ok=True)
    if args.role == "head":
        return start_head(args.address, args.temp_dir)
    return start_worker(args.address, args.temp_dir, args.cpus)


if __name__ == "__main__":
    sys.exit(main())
