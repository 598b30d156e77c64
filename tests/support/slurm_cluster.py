"""A real SLURM cluster of two nodes on this one machine, for the ``slurm`` tests.

:func:`ensure_installed` installs Debian's ``slurm-wlm`` and ``munge`` with apt when they are
missing (CI starts from a clean machine; needs root). :func:`start_cluster` writes a
``slurm.conf`` into a temporary directory and starts, all from that directory:

- ``munged`` with a key generated there and its own socket (``AuthInfo=socket=...``), so the
  machine's own munge (if any) is neither used nor disturbed;
- one ``slurmctld`` and two ``slurmd -N n1|n2``, each on its own free port, spool and log files;
  ``proctrack/linuxproc`` and ``task/none`` (no cgroups needed), ``select/cons_tres``, no
  accounting (so ``mlaunch status`` falls back to ``scontrol show job``, as on many clusters).

The node names ``n1`` and ``n2`` must resolve to loopback for torchrun's rendezvous (mlaunch takes
the first node of the job as the rendezvous host, as on a real cluster): when they do not,
:func:`start_cluster` appends one marked line to ``/etc/hosts`` and :meth:`SlurmCluster.stop`
removes it again.

Client commands find the cluster through ``SLURM_CONF``: run them with :attr:`SlurmCluster.env`.
``python tests/support/slurm_cluster.py DIR`` starts a cluster by hand (Ctrl-C stops it).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from support.apt import apt_install

#: The Debian packages the cluster needs, and a binary of each that shows it is installed.
PACKAGES: dict[str, str] = {"slurm-wlm": "slurmctld", "munge": "munged"}
#: The two nodes (both this machine).
NODES: tuple[str, ...] = ("n1", "n2")
#: CPUs each node claims (``config_overrides``: more than the machine has is fine).
NODE_CPUS = 4
#: The marker of the /etc/hosts line this module adds (and removes).
HOSTS_MARK = "# mlaunch-test-slurm"
HOSTS_FILE = Path("/etc/hosts")
#: How long the cluster may take to come up.
START_TIMEOUT_S = 60.0


class SlurmUnavailable(RuntimeError):
    """SLURM cannot be installed or started here (not root, no apt, no network)."""


def ensure_installed() -> None:
    """Install ``slurm-wlm`` and ``munge`` with apt when a binary of theirs is missing."""
    present = lambda: all(_which(binary) for binary in PACKAGES.values())  # noqa: E731
    why = apt_install(list(PACKAGES), present, recommends=True)  # as the cluster was built with
    if why:
        raise SlurmUnavailable(why)


def _which(binary: str) -> str | None:
    """A binary on PATH or in the sbin folders (not on a plain user's PATH)."""
    return shutil.which(binary) or shutil.which(binary, path="/usr/sbin:/sbin")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class SlurmCluster:
    """A running test cluster: its directory, ``slurm.conf`` and client environment."""

    root: Path
    conf: Path
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    hosts_line_added: bool = False

    @property
    def env(self) -> dict[str, str]:
        """The environment client commands (sbatch, squeue, mlaunch sbatch) need."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(
        self, *argv: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster (text output)."""
        return subprocess.run(
            list(argv), env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def node_states(self) -> dict[str, str]:
        """``{node: state}`` as ``sinfo`` reports them (``idle``, ``alloc``, ``down*``, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False)
        states = {}
        for line in out.stdout.splitlines():
            name, _, state = line.partition(" ")
            states[name] = state.strip()
        return states

    def wait_idle(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until every node is idle (the cluster is up and nothing runs)."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if all(states.get(n) == "idle" for n in NODES):
                return
            for proc in self.procs:
                if proc.poll() is not None:
                    raise SlurmUnavailable(
                        f"{proc.args} exited ({proc.returncode}):\n{self.logs()}"
                    )
            time.sleep(0.5)
        raise SlurmUnavailable(f"nodes not idle after {timeout:.0f}s: {states}\n{self.logs()}")

    def queue(self) -> list[str]:
        """The job ids ``squeue`` lists (pending, running, completing)."""
        out = self.run("squeue", "-h", "-o", "%i")
        return out.stdout.split()

    def logs(self) -> str:
        """The tail of every daemon's log (for failure messages)."""
        parts = []
        for log in sorted(self.root.glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-15:]
            parts.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(parts)

    def stop(self) -> None:
        """Stop every daemon (SIGTERM, then SIGKILL) and undo the /etc/hosts line."""
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        # Job steps outlive a killed slurmd (slurmstepd is its own process): end this cluster's.
        _kill_stepds(self.root)
        if self.hosts_line_added:
            _remove_hosts_line()
            self.hosts_line_added = False


def _kill_stepds(root: Path) -> None:
    """SIGKILL slurmstepd processes started by this cluster (their command line names its conf
    or spool directory), by pid."""
    for proc_dir in Path("/proc").iterdir():
        if not proc_dir.name.isdigit():
            continue
        try:
            cmd = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "slurmstepd" in cmd and str(root) in cmd:
            with contextlib.suppress(OSError):
                os.kill(int(proc_dir.name), signal.SIGKILL)


def _resolves_to_loopback(name: str) -> bool:
    try:
        return socket.gethostbyname(name).startswith("127.")
    except OSError:
        return False


def _add_hosts_line() -> bool:
    """Make the node names resolve to 127.0.0.1 (one marked line in /etc/hosts) if needed."""
    if all(_resolves_to_loopback(n) for n in NODES):
        return False
    with HOSTS_FILE.open("a", encoding="utf-8") as fh:
        fh.write(f"127.0.0.1 {' '.join(NODES)} {HOSTS_MARK}\n")
    return True


def _remove_hosts_line() -> None:
    with contextlib.suppress(OSError):
        lines = HOSTS_FILE.read_text(encoding="utf-8").splitlines(keepends=True)
        HOSTS_FILE.write_text("".join(line for line in lines if HOSTS_MARK not in line))


def slurm_conf(root: Path, ctld_port: int, node_ports: dict[str, int]) -> str:
    """The cluster's ``slurm.conf``: every path inside ``root``."""
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(
        f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={NODE_CPUS}"
        " RealMemory=1000 State=UNKNOWN"
        for n, p in node_ports.items()
    )
    return f"""\
# A 2-node test cluster on one machine (tests/support/slurm_cluster.py).
ClusterName=mlaunchtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
MpiDefault=none
ReturnToService=2
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Short timers: tests wait on them.
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
MinJobAge=600
MessageTimeout=10
# A pending job whose begin time passes is started by the scheduler's periodic pass (every 60 s
# by default), not at once: a requeued job (held until a begin time) would idle that long.
SchedulerParameters=sched_interval=2
{nodes}
PartitionName=debug Nodes={",".join(node_ports)} Default=YES MaxTime=INFINITE State=UP
"""


def start_cluster(root: Path) -> SlurmCluster:
    """Install if needed, configure and start a 2-node cluster under ``root``; wait until both
    nodes are idle. The caller must :meth:`~SlurmCluster.stop` it."""
    ensure_installed()
    root = Path(root).resolve()
    for sub in ("munge", "state", *(f"spool/{n}" for n in NODES)):
        (root / sub).mkdir(parents=True, exist_ok=True)
    os.chmod(root / "munge", 0o700)
    key = root / "munge" / "munge.key"
    key.write_bytes(os.urandom(1024))
    os.chmod(key, 0o600)
    conf = root / "slurm.conf"
    node_ports = {n: _free_port() for n in NODES}
    conf.write_text(slurm_conf(root, _free_port(), node_ports), encoding="utf-8")
    cluster = SlurmCluster(root=root, conf=conf)
    try:
        cluster.hosts_line_added = _add_hosts_line()
        munge = root / "munge"
        cluster.procs.append(
            _daemon(
                [
                    _which("munged") or "munged",
                    "--foreground",
                    "--force",
                    f"--key-file={key}",
                    f"--socket={munge}/munge.socket",
                    f"--pid-file={munge}/munged.pid",
                    f"--log-file={root}/munged.log",
                    f"--seed-file={munge}/munged.seed",
                ],  # fmt: skip
                root / "munged.out",
            )
        )
        _wait_for(munge / "munge.socket", cluster)
        cluster.procs.append(
            _daemon(
                [_which("slurmctld") or "slurmctld", "-D", "-i", "-f", str(conf)],
                root / "slurmctld.out",
            )
        )
        for node in NODES:
            cluster.procs.append(
                _daemon(
                    [_which("slurmd") or "slurmd", "-D", "-N", node, "-f", str(conf)],
                    root / f"slurmd-{node}.out",
                )
            )
        cluster.wait_idle()
    except BaseException:
        cluster.stop()
        raise
    return cluster


def _daemon(argv: list[str], out: Path) -> subprocess.Popen[bytes]:
    with out.open("ab") as fh:
        return subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=fh, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _wait_for(path: Path, cluster: SlurmCluster, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline or any(p.poll() is not None for p in cluster.procs):
            raise SlurmUnavailable(f"{path} did not appear:\n{cluster.logs()}")
        time.sleep(0.1)


if __name__ == "__main__":
    where = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mlaunch-slurm")
    c = start_cluster(where)
    print(f"cluster up: export SLURM_CONF={c.conf}", flush=True)
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop the daemons on SIGTERM too
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
