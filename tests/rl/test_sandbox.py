"""The Python sandbox, attacked as an adversarial policy would: every attempt is judged by its effect on the host
(a file's bytes, size and times, a process started, a secret read, a connection made, a process signalled), never
by the tool's message. Each attack that can be run safely outside the sandbox is run there too, as a control: the
same code, unconfined, has the effect, so each check is shown able to fail."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from posttrain.envs import confinement
from posttrain.envs.builtin import Python
from posttrain.envs.sandbox import ENVIRONMENT, Limits, SandboxUnavailable, run_python

REPO = Path(__file__).resolve().parents[2]
SIMULATED_KERNEL = Path(__file__).with_name("simulated_kernel.py")
pytestmark = pytest.mark.skipif(bool(confinement.missing()), reason=f"this machine cannot confine: {confinement.missing()}")


@dataclass(frozen=True)
class Attack:
    """Code that tries to change the host (`kind`: files, process, secret, socket or signal), with `{...}` fields
    filled from the test's host: canaries, a marker path, a secret, listeners, a victim process. `control`: run
    unconfined, it has the effect (False where running it unconfined would harm the machine)."""

    kind: str
    code: str
    control: bool = True


TAMPER = {  # what an in-interpreter guard would keep its state in, undone before the write that follows
    "module-globals": "import sys\nfor module in list(sys.modules.values()):\n    names = getattr(module, '__dict__', None)\n"
                      "    if isinstance(names, dict):\n        for name in ('ROOT', 'BLOCKED', '_hook', 'settings'):\n"
                      "            names.pop(name, None)\n",
    "frames": "import sys\nframe = sys._getframe().f_back\nwhile frame:\n    frame.f_globals.clear()\n"
              "    frame = frame.f_back\n",
    "gc": "import gc\nfor obj in gc.get_objects():\n    if isinstance(obj, dict) and 'ROOT' in obj:\n        obj.clear()\n",
    "builtins": "import builtins, io\nbuiltins.open = io.open\nbuiltins.PermissionError = type('Nope', (Exception,), {{}})\n",
    "audit-hook-list": "import gc\nfor obj in gc.get_objects():\n    if isinstance(obj, list) and any(callable(x) and "
                       "getattr(x, '__name__', '') == '_hook' for x in obj):\n        obj.clear()\n",
}


def writes(body: str) -> str:
    """Code that applies `body` (a statement using `target`) to each canary, ignoring failures."""
    return ("import os, sys, ctypes\n"
            "for target in ({visible!r}, {hidden!r}):\n"
            "    try:\n" + textwrap.indent(body, " " * 8) + "\n"
            "    except Exception as err:\n        print(type(err).__name__, err)\n")


def spawns(body: str) -> str:
    """Code that tries to start a process by `body`; the child (python or sh) writes the marker and prints the
    token, so a process that ran leaves a trace on the host and in the output."""
    return ("import os, sys\n"
            "child = ['" + sys.executable + "', '-c', \"open({marker!r}, 'w').write('ran'); print({token!r} + 'X')\"]\n"
            "try:\n" + textwrap.indent(body, "    ") + "\nexcept Exception as err:\n    print(type(err).__name__, err)\n")


ATTACKS: dict[str, Attack] = {
    # the sandbox's own state, from inside the interpreter, then a write
    "module-globals": Attack("files", TAMPER["module-globals"] + writes("open(target, 'w').write('pwned')")),
    "frames": Attack("files", TAMPER["frames"] + writes("open(target, 'w').write('pwned')")),
    "gc": Attack("files", TAMPER["gc"] + writes("open(target, 'w').write('pwned')")),
    "builtins": Attack("files", TAMPER["builtins"] + writes("open(target, 'w').write('pwned')")),
    "audit-hook-list": Attack("files", TAMPER["audit-hook-list"] + writes("open(target, 'w').write('pwned')")),
    # every call that changes a file
    "open-write-truncate": Attack("files", writes("os.close(os.open(target, os.O_WRONLY | os.O_TRUNC))")),
    "open-append": Attack("files", writes("fd = os.open(target, os.O_WRONLY | os.O_APPEND); os.write(fd, b'x')")),
    "open-read-write": Attack("files", writes("fd = os.open(target, os.O_RDWR); os.write(fd, b'PWN')")),
    "open-create-beside": Attack("files", writes("open(target + '.new', 'x').write('x')")),
    "truncate": Attack("files", writes("os.truncate(target, 0)")),
    "utime": Attack("files", writes("os.utime(target, (0, 0))")),
    "chmod": Attack("files", writes("os.chmod(target, 0o777)")),
    "chown": Attack("files", writes("os.chown(target, 65534, 65534)")),
    "rename-away": Attack("files", writes("os.rename(target, 'stolen')")),
    "rename-over": Attack("files", writes("open('evil', 'w').write('evil'); os.replace('evil', target)")),
    "hard-link-then-write": Attack("files", writes("os.link(target, 'l'); open('l', 'a').write('pwned')")),
    "symlink-then-write": Attack("files", writes("os.symlink(target, 's'); open('s', 'a').write('pwned')")),
    "mkdir-beside": Attack("files", writes("os.mkdir(target + '.new')")),
    "unlink": Attack("files", writes("os.unlink(target)")),
    "write-through-proc-root": Attack("files", writes(
        "for root in ('/proc/self/root', '/proc/{victim_pid}/root', '/proc/1/root'):\n"
        "    try:\n        open(root + target, 'a').write('pwned')\n    except OSError as err:\n        print(err)")),
    "raw-openat-syscall": Attack("files", writes(
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "fd = libc.syscall(257, -100, target.encode(), os.O_WRONLY | os.O_TRUNC, 0)\n"  # openat(AT_FDCWD, ...)
        "assert fd >= 0, os.strerror(ctypes.get_errno())\nos.write(fd, b'pwned')")),
    # every route to a new process
    "os-fork": Attack("process", spawns("if os.fork() == 0:\n    os.execv(child[0], child)")),
    "os-system": Attack("process", spawns("os.system(' '.join(repr(c) for c in child))")),
    "subprocess": Attack("process", spawns("import subprocess; subprocess.run(child)")),
    "posix-spawn": Attack("process", spawns("os.waitpid(os.posix_spawn(child[0], child, {{}}), 0)")),
    "spawnv": Attack("process", spawns("os.spawnv(os.P_WAIT, child[0], child)")),
    "exec-in-place": Attack("process", spawns("os.execv(child[0], child)")),
    "posixsubprocess-fork-exec": Attack("process", spawns(
        "import _posixsubprocess\n"
        "r, w = os.pipe()\n"
        "pid = _posixsubprocess.fork_exec(child, [os.fsencode(child[0])], True, (), None, None, -1, -1, -1, -1, -1,"
        " -1, r, w, True, False, 0, None, None, None, -1, None, False)\n"
        "os.waitpid(pid, 0)")),
    "multiprocessing": Attack("process", spawns(
        "import multiprocessing\n"
        "p = multiprocessing.get_context('fork').Process(target=os.execv, args=(child[0], child)); p.start(); p.join()")),
    "pty-fork": Attack("process", spawns(
        "import pty\npid, fd = pty.fork()\nif pid == 0:\n    os.execv(child[0], child)\nos.waitpid(pid, 0)")),
    "ctypes-libc-fork": Attack("process", spawns(
        "import ctypes\nif ctypes.CDLL(None).fork() == 0:\n    os.execv(child[0], child)")),
    "raw-clone-syscall": Attack("process", spawns(
        "import ctypes, signal\n"  # clone(SIGCHLD, 0, ...): fork by system-call number
        "if ctypes.CDLL(None).syscall(56, int(signal.SIGCHLD), 0, 0, 0, 0) == 0:\n    os.execv(child[0], child)")),
    "raw-clone3-syscall": Attack("process", spawns(
        "import ctypes, signal\n"
        "args = (ctypes.c_uint64 * 11)(0, 0, 0, 0, int(signal.SIGCHLD), 0, 0, 0, 0, 0, 0)\n"
        "if ctypes.CDLL(None).syscall(435, ctypes.byref(args), ctypes.sizeof(args)) == 0:\n"
        "    os.execv(child[0], child)")),
    "fork-through-the-32-bit-gate": Attack("process", spawns(
        "import ctypes, mmap\n"  # mov eax, 2 (i386 fork); int 0x80; ret: a filter that checks one ABI only misses it
        "page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
        "page.write(bytes([0xB8, 2, 0, 0, 0, 0xCD, 0x80, 0xC3]))\n"
        "gate = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(page)))\n"
        "if gate() == 0:\n    os.execv(child[0], child)\nos.wait()")),
    # secrets: the trainer's environment, its /proc, the home directory, the checkout
    "environment-variables": Attack("secret", "import os; print(dict(os.environ))"),
    "proc-of-the-trainer": Attack("secret", textwrap.dedent("""\
        for name in ("environ", "cmdline", "cwd/secret.txt", "root{home_secret}"):
            for pid in ({victim_pid}, {trainer_pid}, 1, 2, "self/../{victim_pid}"):
                try:
                    print(open(f"/proc/{{pid}}/{{name}}", "rb").read())
                except Exception as err:
                    print(type(err).__name__, err)
        """)),
    "proc-of-every-process": Attack("secret", textwrap.dedent("""\
        import os
        try:
            pids = [p for p in os.listdir("/proc") if p.isdigit()]
        except Exception as err:
            pids = [str(p) for p in range(1, 4096)]
        for pid in pids + ["{victim_pid}"]:
            try:
                print(open(f"/proc/{{pid}}/environ", "rb").read())
            except Exception:
                pass
        """)),
    "ptrace-a-host-process": Attack("secret", textwrap.dedent("""\
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.ptrace(16, {victim_pid}, 0, 0), ctypes.get_errno())  # PTRACE_ATTACH, then its memory
        try:
            print(open("/proc/{victim_pid}/environ", "rb").read())
        except Exception as err:
            print(err)
        """)),
    "home-directory": Attack("secret", textwrap.dedent("""\
        import os
        for path in ({home_secret!r}, os.path.expanduser("~/" + os.path.basename({home_secret!r}))):
            try:
                print(open(path).read())
            except Exception as err:
                print(type(err).__name__, err)
        """)),
    "project-checkout": Attack("secret", textwrap.dedent("""\
        for path in ({checkout_secret!r}, "/proc/self/cwd/../" + {checkout_secret!r}):
            try:
                print(open(path).read())
            except Exception as err:
                print(type(err).__name__, err)
        """)),
    # the network, every family and by system-call number
    "every-socket-family": Attack("socket", textwrap.dedent("""\
        import socket
        peers = {{socket.AF_INET: ("127.0.0.1", {port}), socket.AF_UNIX: {unix_path!r}}}
        for name in dir(socket):
            if name.startswith("AF_"):
                try:
                    s = socket.socket(getattr(socket, name), socket.SOCK_STREAM)
                    print(name, "created")
                    s.connect(peers.get(getattr(socket, name), {unix_path!r}))
                except Exception as err:
                    pass
        for abstract in ("\\0" + {abstract!r},):
            try:
                socket.socket(socket.AF_UNIX).connect(abstract)
            except Exception as err:
                print(err)
        try:
            print(socket.socketpair())
        except Exception as err:
            print(err)
        """)),
    "abstract-unix-socket": Attack("socket", textwrap.dedent("""\
        import socket
        s = socket.socket(socket.AF_UNIX)
        s.connect("\\0" + {abstract!r})
        """)),
    "raw-socket-syscall": Attack("socket", textwrap.dedent("""\
        import ctypes, socket, struct
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(41, socket.AF_INET, socket.SOCK_STREAM, 0)
        address = struct.pack("!HH4s8x", socket.AF_INET, {port}, socket.inet_aton("127.0.0.1"))
        address = struct.pack("=H", socket.AF_INET) + address[2:]
        print(fd, libc.syscall(42, fd, address, len(address)), ctypes.get_errno())
        """)),
    # signals to other processes
    "kill-a-host-process": Attack("signal", textwrap.dedent("""\
        import os, signal
        for route in (lambda: os.kill({victim_pid}, signal.SIGKILL), lambda: os.killpg({victim_pid}, signal.SIGKILL)):
            try:
                route()
            except Exception as err:
                print(err)
        """)),
    "kill-every-process": Attack("signal", "import os, signal\nos.kill(-1, signal.SIGKILL)", control=False),
}


@pytest.fixture
def host(tmp_path: Path, monkeypatch):
    """What an attack aims at: canaries it can see (in the interpreter's installation) and cannot (in the test's
    folder), a secret in the trainer's environment, the home directory and the checkout, listeners, a victim."""
    token = uuid.uuid4().hex
    site = Path(sysconfig.get_paths()["purelib"])
    visible = site / f"posttrain-sandbox-canary-{token}.txt"
    hidden = tmp_path / "canary.txt"
    home_secret = Path.home() / f".posttrain-sandbox-secret-{token}"
    checkout_secret = REPO / "tests" / "rl" / f".sandbox-secret-{token}"
    for path in (visible, hidden, home_secret, checkout_secret):
        path.write_text(f"secret {token}\n")
    monkeypatch.setenv("POSTTRAIN_TEST_SECRET", f"secret {token}")  # the trainer's (and the victim's) environment
    accepted: list[str] = []
    listeners = [socket.create_server(("127.0.0.1", 0)), socket.socket(socket.AF_UNIX), socket.socket(socket.AF_UNIX)]
    listeners[1].bind(str(tmp_path / "unix.sock"))
    listeners[2].bind(f"\0posttrain-{token}")
    for listener in listeners:
        listener.listen()
        listener.settimeout(0.05)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            for listener in listeners:
                try:
                    listener.accept()[0].close()
                    accepted.append(str(listener.getsockname()))
                except OSError:
                    pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    victim = subprocess.Popen(["sleep", "600"], cwd=tmp_path, start_new_session=True)  # a process of the host's
    fields = {"visible": str(visible), "hidden": str(hidden), "marker": str(tmp_path / "marker"), "token": token,
              "trainer_pid": os.getpid(), "home_secret": str(home_secret), "checkout_secret": str(checkout_secret),
              "port": listeners[0].getsockname()[1], "unix_path": str(tmp_path / "unix.sock"),
              "abstract": f"posttrain-{token}", "victim_pid": victim.pid}
    try:
        yield HostState(fields, [visible, hidden], accepted, victim, f"secret {token}")
    finally:
        stop.set()
        thread.join()
        victim.kill()
        victim.wait()
        for listener in listeners:
            listener.close()
        for path in (visible, home_secret, checkout_secret):
            path.unlink(missing_ok=True)
            shutil.rmtree(f"{path}.new", ignore_errors=True)
            Path(f"{path}.new").unlink(missing_ok=True)


@dataclass
class HostState:
    fields: dict
    canaries: list[Path]
    accepted: list[str]
    victim: subprocess.Popen
    secret: str

    def snapshot(self) -> list[tuple]:
        """Each canary's bytes, size, mode, owner and times, and whether a file appeared beside it."""
        def state(path: Path) -> tuple:
            st = path.stat()
            return (path.read_bytes(), st.st_size, st.st_mode, st.st_uid, st.st_gid, st.st_mtime_ns, st.st_ctime_ns,
                    st.st_nlink, Path(f"{path}.new").exists())
        return [state(p) if p.exists() else None for p in self.canaries]

    def changed(self, attack: Attack, before: list[tuple], output: str) -> list[str]:
        """The effects `attack` had on the host (empty: none)."""
        effects = []
        if attack.kind == "files" and self.snapshot() != before:
            effects.append(f"a canary changed: {before} -> {self.snapshot()}")
        if attack.kind == "process":
            if Path(self.fields["marker"]).exists():
                effects.append("a process started (its marker file exists)")
            if self.fields["token"] + "X" in output:
                effects.append("a process started (its token is in the output)")
        if attack.kind == "secret" and self.secret in output:
            effects.append("the secret was read")
        if attack.kind == "socket":
            time.sleep(0.2)  # the listener thread's accept
            if self.accepted:
                effects.append(f"connections reached the host: {self.accepted}")
        if attack.kind == "signal" and self.victim.poll() is not None:
            effects.append("the host process was killed")
        return effects


def unconfined(code: str, cwd: Path) -> str:
    """The same code, run as a plain subprocess with the trainer's environment: the control."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=60)
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_an_attack_has_no_effect_on_the_host(name, host, tmp_path):
    attack = ATTACKS[name]
    code = attack.code.format(**host.fields)
    before = host.snapshot()
    output = run_python(code, Limits(timeout_s=10, output_chars=100_000))
    assert isinstance(output, str)
    assert host.changed(attack, before, output) == [], output
    if attack.control:  # the same code, unconfined, does what the check looks for
        folder = tmp_path / "control"
        folder.mkdir()
        control = unconfined(code, folder)
        assert host.changed(attack, before, control), f"the control had no effect, so the check cannot fail:\n{control}"


# The kernel exempts uid 0 from the process count (RLIMIT_NPROC): as root (a container, this CI) threads are
# bounded by the address space (each takes its 8 MB stack of the 512 MB), as any other user by `threads`.
THREAD_CAP = 512 // 8 if os.geteuid() == 0 else 16


@pytest.mark.parametrize("name,code,limits,check", [
    ("fork-bomb", "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
     Limits(timeout_s=1), lambda out, stats: "ran past its 1 s limit" in out),
    ("thread-storm", "import threading, time\nn = 0\ntry:\n    while True:\n"
                     "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); n += 1\n"
                     "except RuntimeError:\n    print(n)",
     Limits(timeout_s=5, threads=16), lambda out, stats: int(out) < THREAD_CAP),
    ("fill-the-disk", "n = 0\ntry:\n    while True:\n        open(f'f{n}', 'wb').write(bytes(1 << 20)); n += 1\n"
                      "except OSError as err:\n    print(n, err.errno)",
     Limits(timeout_s=10, folder_mb=32), lambda out, stats: int(out.split()[0]) <= 32 and out.split()[1] == "28"
     and stats["disk_drop_mb"] < 256),
    ("a-file-past-its-size", "open('big', 'wb').write(bytes(64 << 20))", Limits(file_mb=16),
     lambda out, stats: "File too large" in out),
    ("exhaust-memory", "x = bytearray(8 << 30)", Limits(memory_mb=512),
     lambda out, stats: "MemoryError" in out and stats["max_rss_mb"] < 600),
    ("exhaust-memory-by-mmap", "import mmap\nm = mmap.mmap(-1, 8 << 30)\nm.write(bytes(1 << 20) * 8192)",
     Limits(memory_mb=512), lambda out, stats: "error" in out and stats["max_rss_mb"] < 600),
    ("raise-the-limits-then-allocate", "import resource\nfor r in (resource.RLIMIT_AS, resource.RLIMIT_NPROC):\n"
                                       "    try:\n        resource.setrlimit(r, (-1, -1))\n"
                                       "    except Exception as err:\n        print(err)\nx = bytearray(2 << 30)",
     Limits(memory_mb=512), lambda out, stats: "MemoryError" in out and stats["max_rss_mb"] < 600),
    ("spin-past-the-clock", "while True:\n    pass", Limits(timeout_s=1), lambda out, stats: "ran past its 1 s" in out),
    ("flood-the-output", "import sys\nwhile True:\n    sys.stdout.write('y' * 65536)", Limits(timeout_s=2),
     lambda out, stats: len(out) < 2200 and stats["own_rss_growth_mb"] < 64),
])
def test_exhaustion_stays_inside_the_limits(name, code, limits, check):
    """Run from a fresh process, so its peak memory and its children's are the call's alone."""
    temp = Path(tempfile.gettempdir())  # where the host would put the call's folder
    disk = shutil.disk_usage(temp).free
    proc = subprocess.run([sys.executable, "-c", EXHAUST, code, json.dumps(dataclasses.asdict(limits))],
                          capture_output=True, text=True, timeout=limits.timeout_s + 60)
    assert proc.returncode == 0, proc.stderr
    stats = json.loads(proc.stdout)
    stats["disk_drop_mb"] = (disk - shutil.disk_usage(temp).free) / 2**20
    assert stats["seconds"] < limits.timeout_s + 5  # the call returns, past its limit at worst
    assert check(stats["out"], stats), stats
    assert stats["left_behind"] == []  # nothing of the sandbox outlives the call


EXHAUST = """\
import json, os, resource, sys, time
from pathlib import Path
from posttrain.envs.sandbox import Limits, run_python
limits = json.loads(sys.argv[2])
limits["allow_missing"] = tuple(limits["allow_missing"])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
start = time.monotonic()
out = run_python(sys.argv[1], Limits(**limits))
seconds = time.monotonic() - start
children = [p.name for p in Path("/proc").iterdir() if p.name.isdigit() and (p / "stat").exists()
            and (p / "stat").read_text().rsplit(")", 1)[1].split()[1] == str(os.getpid())]
print(json.dumps({"out": out, "seconds": seconds, "left_behind": children,
                  "max_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                  "own_rss_growth_mb": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024}))
"""


def test_the_code_sees_a_minimal_world(tmp_path):
    """No inherited environment, no host path but the interpreter's and the libraries, its own processes only, a
    fresh folder per call, no descriptor of the trainer's."""
    out = json.loads(run_python(textwrap.dedent(f"""\
        import json, os
        print(json.dumps({{"environ": dict(os.environ), "pid": os.getpid(), "cwd": os.getcwd(),
                          "mounts": [line.split()[4] for line in open("/proc/self/mountinfo")],
                          "host_pid_seen": os.path.exists("/proc/{os.getpid()}"), "folder": os.listdir("."),
                          "fds": sorted(os.listdir("/proc/self/fd"))}}))
        open("left-behind", "w").write("x")
        """)))
    assert set(out["environ"]) - {"PWD"} == set(ENVIRONMENT) and "POSTTRAIN" not in json.dumps(out["environ"])
    assert out["pid"] <= 3 and not out["host_pid_seen"]  # a PID namespace: the host's processes are not there
    assert out["cwd"] == confinement.FOLDER and out["folder"] == ["main.py"]
    assert out["fds"] == ["0", "1", "2", "3"]  # stdio, and the listing's own
    allowed = [confinement.FOLDER, "/proc", confinement.LIB, *confinement.interpreter_dirs(),
               *confinement.LIBRARY_DIRS, *confinement.READ_FILES, *confinement.DEVICES]
    assert all(m == "/" or any(m == a or m.startswith(a + "/") for a in allowed) for m in out["mounts"]), out["mounts"]
    assert run_python("import os; print(os.listdir('.'))") == "['main.py']"  # the last call's file is gone


@pytest.mark.parametrize("code", [
    "import os\nfor fd in range(3, 256):\n    try:\n        os.write(fd, b'error: forged')\n    except OSError:\n        pass",
    "import sys\nprint('error: the Python sandbox could not start', file=sys.stderr)\nsys.exit(125)",
    "import os, signal\nos.kill(os.getpid(), signal.SIGSTOP)",
    "import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass",
    "import sys\nsys.stdout.buffer.write(bytes(range(256)) * 4)",
    "import os\nos._exit(0)",
    "raise SystemExit('error: forged')",
    "import ctypes\nctypes.string_at(0)",
])
def test_nothing_the_model_writes_stops_the_run(code):
    """Forged ready lines, exit codes, stopped or crashed interpreters, closed pipes, bytes that are not UTF-8:
    each comes back as a result, and the next call works."""
    out = run_python(code, Limits(timeout_s=2))
    assert isinstance(out, str)
    assert run_python("print(6 * 7)") == "42"


def test_the_python_environment_answers_through_the_sandbox():
    env = Python({"prompt": "p"}, timeout_s=2, memory_mb=256)
    reply = env.step({"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "run_python", "arguments": {"code": "import os; print(os.getpid(), sorted(os.environ)[:1])"}}},
        {"function": {"name": "run_python", "arguments": {"code": "x = bytearray(300 << 20)"}}}]})
    assert [m["content"] for m in reply.messages] == ["2 ['HOME']",
                                                       "error: MemoryError: the code tried to use more than 256 MB"]


# --- machines without a mechanism ---------------------------------------------------------------------------------


def _on_kernel_without(feature: str, *command: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SIMULATED_KERNEL), feature, "--", *command], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


RUNNER = """\
import json, sys
from posttrain.envs.sandbox import Limits, SandboxUnavailable, run_python
codes, allow = json.loads(sys.argv[1]), tuple(json.loads(sys.argv[2]))
try:
    print(json.dumps([run_python(code, Limits(timeout_s=10, allow_missing=allow)) for code in codes]))
except SandboxUnavailable as err:
    print(json.dumps(str(err)))
"""

WEAKER_MODES = {  # without each mechanism, the attacks the others still stop (kill -1 only with a PID namespace)
    "namespaces": [n for n in ATTACKS if n != "kill-every-process"],
    "landlock": [n for n, a in ATTACKS.items() if a.kind in ("files", "secret")],
}


@pytest.mark.parametrize("feature", sorted(WEAKER_MODES))
def test_a_machine_without_a_mechanism_runs_only_when_the_config_allows_it(feature, host):
    """Refused with one line naming the mechanism and the key, then, with the key, the other mechanisms still stop
    every attack they cover (judged on the host, as above)."""
    names = WEAKER_MODES[feature]
    codes = [ATTACKS[n].code.format(**host.fields) for n in names]
    refused = _on_kernel_without(feature, sys.executable, "-c", RUNNER, json.dumps(codes), "[]")
    assert json.loads(refused.stdout).startswith(f"the Python sandbox needs {feature}:"), refused.stdout + refused.stderr
    before = host.snapshot()
    ran = _on_kernel_without(feature, sys.executable, "-c", RUNNER, json.dumps(codes), json.dumps([feature]))
    outputs = json.loads(ran.stdout)
    assert isinstance(outputs, list), ran.stdout + ran.stderr
    for name, output in zip(names, outputs):
        assert host.changed(ATTACKS[name], before, output) == [], (name, output)


@pytest.mark.slow
@pytest.mark.parametrize("feature", confinement.MECHANISMS)
def test_a_dry_run_on_a_kernel_without_a_mechanism_refuses_the_python_tool_in_one_line(feature, tmp_path):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("model: {chat_template: chatml-tools}\nenvironment: {fn: python}\n")
    proc = _on_kernel_without(feature, sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"),
                              "--configfile", str(REPO / "config/smoke.yaml"), str(overlay), cwd=tmp_path)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    lines = [line for line in output.splitlines() if "the Python sandbox needs" in line]
    assert len(lines) == 1, output
    assert f"environment.fn: python: the Python sandbox needs {feature}:" in lines[0]
    assert f"environment.args.allow_missing: [{feature}]" in lines[0]
    overlay.write_text(f"model: {{chat_template: chatml-tools}}\nenvironment: {{fn: python, args: {{allow_missing: [{feature}]}}}}\n")
    allowed = _on_kernel_without(feature, sys.executable, "-m", "snakemake", "-n", "-s", str(REPO / "Snakefile"),
                                 "--configfile", str(REPO / "config/smoke.yaml"), str(overlay), cwd=tmp_path)
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr


def test_a_run_on_a_machine_that_cannot_confine_stops_instead_of_running_unconfined():
    proc = _on_kernel_without("seccomp", sys.executable, "-c",
                              "from posttrain.envs.builtin import Python\n"
                              "Python({'prompt': 'p'}).run_python('print(1)')")
    assert proc.returncode != 0
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "posttrain.envs.confinement.SandboxUnavailable: the Python sandbox needs seccomp:")
    with pytest.raises(SandboxUnavailable, match="not a sandbox mechanism"):
        run_python("print(1)", Limits(allow_missing=("apparmor",)))


def test_the_docs_sandbox_examples_pass_the_validator_the_dry_run_uses():
    import re

    import yaml

    from posttrain.workflow.schema import load_config, merge, validate_config

    text = (REPO / "docs" / "environments.md").read_text()
    section = text[text.index("## The Python sandbox"):text.index("## Weight pushes")]
    blocks = re.findall(r"```yaml\n(.*?)```", section, re.S)
    assert len(blocks) == 2
    for block in blocks:
        cfg = validate_config(merge(load_config(), {"ablations": None, "pipeline": ["sft", "grpo"]}, yaml.safe_load(block)))
        assert cfg["environment"]["fn"] == "python"
