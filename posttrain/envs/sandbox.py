"""Run a model's Python code confined by the kernel; whatever the code does comes back as the result's text.

Each call is a fresh interpreter in a fresh folder, confined before the code's first line by the mechanisms of
`posttrain.envs.confinement` (namespaces, seccomp, Landlock) and by resource limits: address space, CPU time, file
size, open files, threads, no core files, and a wall-clock limit past which the whole sandbox is killed. Its
output is read up to a cap, so no amount of printing reaches the trainer's memory. docs/environments.md gives the
threat model.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from posttrain.envs import confinement
from posttrain.envs.confinement import SandboxUnavailable

__all__ = ["Limits", "SandboxUnavailable", "run_python"]


@dataclass(frozen=True)
class Limits:
    """The limits of one call. `allow_missing`: mechanisms (`confinement.MECHANISMS`) this machine may lack."""

    timeout_s: float = 5.0
    memory_mb: int = 512
    output_chars: int = 2000
    file_mb: int = 16
    folder_mb: int = 64
    threads: int = 16
    allow_missing: tuple[str, ...] = ()

    def rlimits(self, namespaces: bool) -> dict[str, int]:
        """The prelude's resource limits (soft = hard). The thread cap is the user's process count: in the
        sandbox's own user namespace it counts the sandbox's threads alone; outside one it would count every process
        of the user, so there (and for root, whom the kernel exempts) threads are bounded by memory alone."""
        memory, files, cpu = self.memory_mb << 20, self.file_mb << 20, math.ceil(self.timeout_s) + 1
        limits = {"RLIMIT_AS": memory, "RLIMIT_CPU": cpu, "RLIMIT_FSIZE": files, "RLIMIT_NOFILE": 64,
                  "RLIMIT_CORE": 0, "RLIMIT_MEMLOCK": 0, "RLIMIT_MSGQUEUE": 0, "RLIMIT_STACK": 8 << 20}
        if namespaces:
            limits["RLIMIT_NPROC"] = self.threads
        return limits


ENVIRONMENT = {"HOME": confinement.FOLDER, "LANG": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONUTF8": "1",
               "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "MKL_NUM_THREADS": "1"}  # the code's whole environment: nothing of the trainer's


def _command(limits: Limits, use: list[str], host_folder: str, bpf_fd: int, ready_fd: int) -> tuple[list[str], dict]:
    """The argv and environment that start the prelude, inside bubblewrap's namespaces where they are used."""
    namespaces = "namespaces" in use
    folder = confinement.FOLDER if namespaces else host_folder
    settings = {**confinement.prelude_settings(folder, use), "rlimits": limits.rlimits(namespaces),
                "bpf_fd": bpf_fd, "ready_fd": ready_fd}
    prelude = f"{confinement.LIB}/{confinement.PRELUDE.name}" if namespaces else str(confinement.PRELUDE)
    python = [sys.executable, "-S", prelude, json.dumps(settings)]
    if not namespaces:
        return python, {**ENVIRONMENT, "HOME": host_folder}
    args = confinement.bwrap_args(limits.folder_mb << 20)  # bwrap passes on the descriptors it inherits
    for name, value in ENVIRONMENT.items():
        args += ["--setenv", name, value]
    return [*args, "--", *python], {}


def _collect(proc: subprocess.Popen, deadline: float, cap: int) -> tuple[bytes, bytes, bool]:
    """stdout's first `cap` bytes and stderr's last `cap`, read until both close or the deadline (True: passed);
    the rest is read and dropped, so the pipes never fill and the trainer never holds more than this."""
    out, err = bytearray(), bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, out)
        sel.register(proc.stderr, selectors.EVENT_READ, err)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), bytes(err), True
            for key, _ in sel.select(timeout=left):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                elif key.data is out:
                    out += chunk[: max(0, cap - len(out))]
                else:
                    err += chunk
                    del err[:-cap]
    return bytes(out), bytes(err), False


def _kill(proc: subprocess.Popen) -> None:
    """The whole sandbox: bubblewrap's process group (its namespace dies with it) or the interpreter's."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _result(returncode: int, out: str, err: str, limits: Limits) -> str:
    if returncode != 0:
        lines = err.strip().splitlines()
        tail = lines[-1] if lines else ""  # the exception's own line
        if returncode in (-signal.SIGKILL, -signal.SIGXCPU) or "CPU time" in tail:
            tail = tail or f"the code used more than its CPU time limit ({limits.timeout_s:g} s)"
        if "MemoryError" in tail:
            tail = f"MemoryError: the code tried to use more than {limits.memory_mb} MB"
        out = (out + "\n" if out else "") + f"error: {tail or f'exit status {returncode}'}"
    if len(out) > limits.output_chars:
        out = out[: limits.output_chars] + f"\n... (output cut at {limits.output_chars} characters)"
    return out.strip()


def run_python(code: str, limits: Limits = Limits()) -> str:
    """The code's output (stdout, then stderr's last line if it failed), or an `error: ...` line saying which limit
    stopped it; never raises for anything the code does. Raises `SandboxUnavailable` where the machine cannot
    confine it as `limits.allow_missing` asks."""
    use = confinement.mechanisms(limits.allow_missing)
    program = confinement.seccomp_program() if "seccomp" in use else b""
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as host_folder:
        bpf_read, bpf_write = os.pipe()
        ready_read, ready_write = os.pipe()
        argv, env = _command(limits, use, host_folder, bpf_read, ready_write)
        try:
            proc = subprocess.Popen(argv, cwd=host_folder, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, pass_fds=(bpf_read, ready_write),
                                    start_new_session=True)
        finally:
            os.close(bpf_read)
            os.close(ready_write)
        with os.fdopen(bpf_write, "wb") as f:  # a few KB: below any pipe's buffer
            f.write(program)
        deadline = time.monotonic() + limits.timeout_s
        try:
            proc.stdin.write(code.encode("utf-8", errors="replace"))
            proc.stdin.close()
        except BrokenPipeError:  # the prelude stopped before reading: its ready line says why
            pass
        out, err, timed_out = _collect(proc, deadline, 4 * limits.output_chars + 4096)
        if not timed_out:
            try:  # the pipes can close before the code ends (it may close them itself)
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
        if timed_out:
            _kill(proc)
        with os.fdopen(ready_read, "r") as f:
            ready = f.read()
    if ready != "ok":  # the prelude could not confine: the host's problem, never the model's
        why = ready or (err.decode(errors="replace").strip().splitlines() or [f"exit status {proc.returncode}"])[-1]
        raise SandboxUnavailable(f"the Python sandbox could not start: {why}")
    if timed_out:
        return f"error: the code ran past its {limits.timeout_s:g} s limit and was stopped"
    return _result(proc.returncode, out.decode(errors="replace"), err.decode(errors="replace"), limits)
