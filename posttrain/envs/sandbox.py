"""Run a model's Python code in a subprocess that cannot hang the run, exhaust its memory, write outside its own
folder, start processes or reach the network; whatever goes wrong comes back as the result's text.

Limits, each enforced in the child: wall time (killed past `timeout_s`), CPU time and address space
(`resource` limits), file size, and an audit hook installed before the code runs (`sys.addaudithook`, which code
cannot remove) that refuses sockets, process creation, `ctypes` and opening files for writing outside the
sandbox folder. Where the kernel allows an unprivileged network namespace, the child gets one too (no interface
but loopback), so even code that got past the hook has no network.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000

# Runs in the child before the user's code: the audit hook, then the code itself (read from main.py).
PRELUDE = r'''
import os, sys
ROOT = os.path.realpath(os.getcwd())
BLOCKED = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
           "os.forkpty", "pty.spawn", "ctypes.", "os.kill", "os.killpg", "signal.pthread_kill")
def _hook(event, args):
    if event.startswith(BLOCKED):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        mode, flags = (args[1] or "r"), (args[2] or 0)
        writing = any(c in str(mode) for c in "wax+") or flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        path = os.path.realpath(os.fsdecode(args[0]))
        if writing and not (path == ROOT or path.startswith(ROOT + os.sep)):
            raise PermissionError(f"sandbox: writing {path} is outside the sandbox folder")
    if event in ("os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree", "os.chmod", "os.symlink", "os.link"):
        path = os.path.realpath(os.fsdecode(args[0]))
        if not (path == ROOT or path.startswith(ROOT + os.sep)):
            raise PermissionError(f"sandbox: {event} of {path} is outside the sandbox folder")
source = open("main.py").read()
sys.addaudithook(_hook)
exec(compile(source, "main.py", "exec"), {"__name__": "__main__"})
'''


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 5.0
    memory_mb: int = 512
    output_chars: int = 2000
    file_mb: int = 16


def _isolate(limits: Limits) -> None:
    """In the child, before exec: resource limits, a new session, and a network namespace where allowed."""
    os.setsid()
    memory = limits.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = int(limits.timeout_s) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    files = limits.file_mb << 20
    resource.setrlimit(resource.RLIMIT_FSIZE, (files, files))
    libc = ctypes.CDLL(None, use_errno=True)
    flags = CLONE_NEWNET if os.geteuid() == 0 else CLONE_NEWUSER | CLONE_NEWNET
    libc.unshare(flags)  # best effort: the audit hook refuses sockets either way


def run_python(code: str, limits: Limits = Limits()) -> str:
    """The code's output (stdout, then stderr's last lines if it failed), or an `error: ...` line saying which
    limit stopped it; never raises for anything the code does."""
    with tempfile.TemporaryDirectory(prefix="posttrain-sandbox-") as folder:
        Path(folder, "main.py").write_text(code, encoding="utf-8")
        try:
            proc = subprocess.run([sys.executable, "-I", "-c", PRELUDE], cwd=folder, capture_output=True, text=True,
                                  timeout=limits.timeout_s, preexec_fn=lambda: _isolate(limits),
                                  env={"PATH": "/usr/bin:/bin", "PYTHONHASHSEED": "0"}, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return f"error: the code ran past its {limits.timeout_s:g} s limit and was stopped"
    out = proc.stdout
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines()
        tail = lines[-1] if lines else ""  # the exception's own line
        if proc.returncode in (-9, -24) or "CPU time" in tail:  # SIGKILL / SIGXCPU
            tail = tail or f"the code used more than its CPU time limit ({limits.timeout_s:g} s)"
        if "MemoryError" in tail:
            tail = f"MemoryError: the code tried to use more than {limits.memory_mb} MB"
        out = (out + "\n" if out else "") + f"error: {tail or f'exit status {proc.returncode}'}"
    if len(out) > limits.output_chars:
        out = out[: limits.output_chars] + f"\n... (output cut at {limits.output_chars} characters)"
    return out.strip()
