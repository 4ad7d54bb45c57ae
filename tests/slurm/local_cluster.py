"""A Slurm cluster of one or more nodes on 127.0.0.1 for tests: Debian's packages, a private munged
socket, free ports, and state in a temporary directory.

`LocalSlurm.start()` launches munged, slurmctld and one slurmd per node (`slurmd -N n1`, `-N n2`,
each on its own port; every node is this machine) in the foreground and keeps their `Popen`
handles; `stop()` cancels this cluster's jobs and ends exactly those processes, by PID.
A system munged is left alone: ours has its own socket.

The config is also written to /etc/slurm/slurm.conf (and removed by `stop()`): the Snakemake
plugin's job step (snakemake-executor-plugin-slurm-jobstep) drops every `SLURM_*` variable,
`SLURM_CONF` included, before its nested `srun`, which then reads only the default path. A
/etc/slurm/slurm.conf that this module did not write (a real cluster's) is never touched.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import signal
import socket
import string
import subprocess
import tempfile
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("munged", "slurmctld", "slurmd", "sinfo", "sbatch", "squeue", "scancel")
TEMPLATE = Path(__file__).with_name("slurm.conf.in")
DEFAULT_CONF = Path("/etc/slurm/slurm.conf")
MARK = "# Written by posttrain's tests/slurm/local_cluster.py"
LOCK = Path("/tmp/posttrain-local-slurm.lock")


class ClusterBusy(RuntimeError):
    """Another test cluster of this module is running on the machine."""


def unavailable_reason() -> str | None:
    """Why a cluster cannot run here, or None (binaries present, or root on Debian with apt-get)."""
    if os.geteuid() != 0:
        return "a local Slurm cluster needs root (munged runs as the munge user, slurmd launches jobs)"
    if DEFAULT_CONF.exists() and not DEFAULT_CONF.read_text(errors="replace").startswith(MARK):
        return f"{DEFAULT_CONF} belongs to a real Slurm installation; the test cluster will not replace it"
    if all(shutil.which(b) for b in BINARIES):
        return None
    if not Path("/etc/debian_version").exists() or shutil.which("apt-get") is None:
        return f"Slurm is not installed and this is not Debian with apt-get to install {' '.join(PACKAGES)}"
    return None


def install() -> None:
    """apt-get install the Slurm and munge packages when a binary is missing (apt-get update only if needed)."""
    if all(shutil.which(b) for b in BINARIES):
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    command = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(command, env=env, capture_output=True, text=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True, capture_output=True)
        subprocess.run(command, env=env, check=True, capture_output=True)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def node_line() -> tuple[str, str]:
    """`slurmd -C`'s NodeName line (this machine's CPUs and memory) and the node's name."""
    out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, check=True).stdout
    line = next(line for line in out.splitlines() if line.startswith("NodeName="))
    return line, line.split()[0].removeprefix("NodeName=")


class LocalSlurm:
    """munged + slurmctld + a slurmd per node, all under `root`; clients find it through `env`."""

    def __init__(self, root: Path, nodes: int = 1):
        self.root = Path(root)
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self.conf = self.root / "slurm.conf"
        self.state = self.root / "state"
        self.processes: dict[str, subprocess.Popen] = {}
        self._munge_dir: Path | None = None
        self._lock: int | None = None

    @property
    def env(self) -> dict[str, str]:
        """The environment for sbatch/squeue/snakemake (and so for the jobs: sbatch --export=ALL)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout: float = 120) -> None:
        """Write slurm.conf, start the three daemons, and wait until the node is idle.

        Raises ClusterBusy while another LocalSlurm holds the machine's lock (one per machine:
        /etc/slurm/slurm.conf is shared).
        """
        self._lock = os.open(LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            self._lock = None
            raise ClusterBusy(f"another local test cluster holds {LOCK}") from None
        self.state.mkdir(parents=True)
        for sub in ("ctld", *(f"slurmd/{node}" for node in self.nodes)):
            (self.state / sub).mkdir(parents=True)
        socket_path = self._start_munged()
        line, name = node_line()
        hardware = line.removeprefix(f"NodeName={name}")  # CPUs=... RealMemory=...
        node_lines = "\n".join(f"NodeName={node} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 "
                               f"Port={_free_port()}{hardware} State=UNKNOWN" for node in self.nodes)
        text = MARK + "\n" + string.Template(TEMPLATE.read_text()).substitute(
            ctld_port=_free_port(), munge_socket=socket_path, state=self.state,
            node_lines=node_lines, node_names=",".join(self.nodes),
        )
        self.conf.write_text(text)
        DEFAULT_CONF.parent.mkdir(parents=True, exist_ok=True)
        DEFAULT_CONF.write_text(text)  # unavailable_reason() made sure it was absent or ours
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        self._wait(lambda: self.sinfo_states() == ["idle"] * len(self.nodes), timeout, "every node to be idle in sinfo")

    def _start_munged(self) -> Path:
        # Under /tmp (not pytest's root-only tmp dir): the munge user must reach its socket.
        munge = pwd.getpwnam("munge")
        self._munge_dir = Path(tempfile.mkdtemp(prefix="posttrain-munge-", dir="/tmp"))
        os.chown(self._munge_dir, munge.pw_uid, munge.pw_gid)
        self._munge_dir.chmod(0o755)  # munged wants its socket directory searchable by all
        sock = self._munge_dir / "munge.socket"
        self._spawn("munged", [
            "munged", "--foreground", f"--socket={sock}", f"--pid-file={self._munge_dir / 'munged.pid'}",
            f"--log-file={self._munge_dir / 'munged.log'}", f"--seed-file={self._munge_dir / 'munged.seed'}",
        ], user=munge.pw_uid, group=munge.pw_gid)
        self._wait(sock.exists, 30, f"munged's socket {sock}")
        return sock

    def _spawn(self, name: str, command: list[str], **kwargs) -> None:
        log = open(self.root / f"{name}.out", "wb")
        self.processes[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                                stdin=subprocess.DEVNULL, **kwargs)
        log.close()

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = {n: p.returncode for n, p in self.processes.items() if p.poll() is not None}
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"local Slurm: gave up waiting for {what} (exited: {dead})\n{self.logs()}")
            time.sleep(0.5)

    def sinfo_states(self) -> list[str]:
        proc = subprocess.run(["sinfo", "--noheader", "--Node", "--format=%t"], env=self.env,
                              capture_output=True, text=True)
        return proc.stdout.split() if proc.returncode == 0 else []

    def jobs(self) -> list[dict[str, str]]:
        """Every job slurmctld still remembers (MinJobAge keeps finished ones): id, comment, state."""
        out = subprocess.run(["squeue", "--states=all", "--noheader", "--format=%i|%k|%T"], env=self.env,
                             capture_output=True, text=True, check=True).stdout
        return [dict(zip(("id", "comment", "state"), line.split("|"))) for line in out.splitlines() if line]

    def job_processes(self, job: str) -> list[int]:
        """PIDs of every process of `job` on this machine: its slurmstepd and its tasks (SLURM_JOB_ID in their environment)."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                environ = (proc / "environ").read_bytes().split(b"\0")
            except OSError:  # gone, or not ours to read
                continue
            if cmdline.startswith(f"slurmstepd: [{job}.") or f"SLURM_JOB_ID={job}".encode() in environ:
                found.append(int(proc.name))
        return found

    def lose_node(self, node: str, job: str) -> list[int]:
        """Take `node` away as a crashed machine would, mid-`job`: SIGKILL its slurmd, then every process of
        the job; returns their PIDs."""
        daemon = self.processes[f"slurmd-{node}"]
        daemon.kill()
        daemon.wait(timeout=30)
        killed = []
        for pid in self.job_processes(job):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return killed

    def release_requeued(self, job: str, away_from: str, timeout: float = 300) -> None:
        """Start a requeued `job` now, on another node than `away_from`, instead of after the begin time Slurm
        gives a requeued job (about two minutes of an idle test). Only once its previous run is gone: the job
        pending again and none of its processes left (released while the first run was still ending, the
        launch on the same node was refused: "already killed"). A job that ended instead (failed for good, to be
        submitted again by Snakemake's restart) is not held: nothing to release."""
        deadline = time.monotonic() + timeout
        while True:
            state = subprocess.run(["squeue", "--states=all", "--noheader", "--jobs", job, "--format=%T"],
                                   env=self.env, capture_output=True, text=True).stdout.strip()
            if state in ("FAILED", "NODE_FAIL", "CANCELLED", "COMPLETED", "TIMEOUT", "BOOT_FAIL", "OUT_OF_MEMORY"):
                return
            if state == "PENDING" and not self.job_processes(job):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} did not come back to PENDING with its processes gone (state {state!r})")
            time.sleep(0.5)
        subprocess.run(["scontrol", "update", f"JobId={job}", f"ExcNodeList={away_from}", "StartTime=now"],
                       env=self.env, check=True, capture_output=True, timeout=30)

    def restart_node(self, node: str, timeout: float = 120) -> None:
        """Start `node`'s slurmd again and wait until every node is idle (ReturnToService=2 takes it back)."""
        self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-f", str(self.conf), "-N", node])
        self._wait(lambda: self.sinfo_states() == ["idle"] * len(self.nodes), timeout, f"{node} to be idle again")

    def logs(self, tail: int = 3000) -> str:
        files = sorted(self.root.glob("*.out")) + sorted(self.state.glob("*.log"))
        if self._munge_dir is not None:
            files.append(self._munge_dir / "munged.log")
        return "\n".join(f"--- {f}\n{f.read_text(errors='replace')[-tail:]}" for f in files if f.exists())

    def stop(self) -> None:
        """Cancel this cluster's jobs, then end the daemons this object started (slurmd first)."""
        if "slurmctld" in self.processes and self.processes["slurmctld"].poll() is None:
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env, capture_output=True, timeout=30)
        for name in (*(f"slurmd-{node}" for node in self.nodes), "slurmctld", "munged"):
            proc = self.processes.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
        if self._munge_dir is not None:
            shutil.rmtree(self._munge_dir, ignore_errors=True)
        if self.conf.exists() and DEFAULT_CONF.exists() and DEFAULT_CONF.read_text() == self.conf.read_text():
            DEFAULT_CONF.unlink()
        if self._lock is not None:
            os.close(self._lock)  # releases the flock
            self._lock = None
