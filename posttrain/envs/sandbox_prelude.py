"""The first code of a sandboxed interpreter: it confines its own process, then runs the model's code.

Started by `posttrain.envs.sandbox` as `python -S sandbox_prelude.py SETTINGS` (inside bubblewrap's namespaces
where the kernel allows them), with the seccomp program on fd `bpf_fd`, the code on stdin and `ready_fd` open for
one line. Before any of the model's code runs it sets the resource limits, restricts its filesystem access with
Landlock and loads the seccomp program; all three are kernel state that the code cannot lift. It then writes
`ok` on `ready_fd` and closes it, so the parent knows that what follows is the model's, or writes `error: ...`
and exits, so a host that cannot confine is never mistaken for a model's failure. Standard library only (and the
`landlock` binding, from the folder the settings name): site-packages are imported after the confinement.
"""

import ctypes
import json
import os
import resource
import sys

PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 38, 22, 2


class _SockFprog(ctypes.Structure):
    """`struct sock_fprog`: the compiled program as the kernel takes it (instructions of 8 bytes)."""

    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_char_p)]


def _limit(settings: dict) -> None:
    for name, value in settings["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))


def _landlock(settings: dict) -> None:
    """Read and execute the interpreter and its libraries; read and write (never execute) the folder."""
    sys.path.insert(0, settings["landlock_path"])
    import landlock

    del sys.path[0]
    read = landlock.FSAccess.READ_FILE | landlock.FSAccess.READ_DIR
    ruleset = landlock.Ruleset()
    ruleset.allow(*settings["read_exec"], rules=read | landlock.FSAccess.EXECUTE)
    ruleset.allow(*settings["read"], rules=landlock.FSAccess.READ_FILE)
    ruleset.allow(*settings["read_write"], rules=landlock.FSAccess.READ_FILE | landlock.FSAccess.WRITE_FILE)
    ruleset.allow(os.path.realpath("/proc/self"), rules=read)
    ruleset.allow(settings["folder"], rules=landlock.FSAccess.all() & ~landlock.FSAccess.EXECUTE)
    ruleset.apply()


def _seccomp(program: bytes) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    buffer = ctypes.create_string_buffer(program, len(program))
    fprog = _SockFprog(len(program) // 8, ctypes.cast(buffer, ctypes.c_char_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"seccomp: {os.strerror(ctypes.get_errno())}")


def main() -> None:
    settings = json.loads(sys.argv[1])
    ready = os.fdopen(settings["ready_fd"], "w")
    try:
        with os.fdopen(settings["bpf_fd"], "rb") as f:
            program = f.read()
        source = sys.stdin.buffer.read().decode("utf-8", errors="replace")
        with open("main.py", "w", encoding="utf-8") as f:
            f.write(source)
        _limit(settings)
        if settings["landlock_path"]:
            _landlock(settings)
        if program:
            _seccomp(program)
    except Exception as err:  # the host could not confine: the parent stops the run with this line
        ready.write(f"error: {type(err).__name__}: {err}".replace("\n", " "))
        ready.close()
        sys.exit(1)
    ready.write("ok")
    ready.close()
    os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # the ruleset's descriptor: stdio alone is left
    del settings, program, ready
    import site

    site.main()
    sys.argv = ["main.py"]
    code = compile(source, "main.py", "exec")
    del source
    exec(code, {"__name__": "__main__", "__builtins__": __builtins__})


if __name__ == "__main__":
    main()
