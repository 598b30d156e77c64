"""torchrun's rendezvous endpoint, before and after the launch.

Before: :func:`check_endpoint` says whether ``--rdzv-endpoint`` can work from this node: its host
resolves (torchrun would otherwise retry for minutes and fail with ``RendezvousConnectionError
... See inner exception``), and, on the node that hosts the store (node 0 on the endpoint's host,
with a backend whose node 0 binds a TCPStore there), its port is free (a port another program
holds makes torchrun's store client wait on a peer that never answers). ``mlaunch train`` refuses
a problem before anything starts; ``mlaunch doctor`` reports the same verdict.

After: :func:`failure_cause` reads the cause of a failed rendezvous out of torchrun's log (the
exception torchrun chains under its own) as one line for the launcher's console.

Standard library only, and no torch: the launcher never imports it.
"""

from __future__ import annotations

import contextlib
import re
import socket
from dataclasses import dataclass
from pathlib import Path

from mlaunch.launcher.cluster_env import source_of

#: Backends whose node 0 binds a TCPStore on the endpoint's port (etcd's endpoint is the etcd
#: server: a port that must be taken, not free).
STORE_BACKENDS: frozenset[str] = frozenset({"c10d", "static"})


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """``(host, port)`` of a validated ``host:port`` (an IPv6 host may be in brackets)."""
    host, _, port = endpoint.rpartition(":")
    return host.strip("[]"), int(port)


def resolve_error(host: str) -> str | None:
    """Why ``host`` does not resolve (the resolver's words), or None when it does."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        return exc.strerror or str(exc)
    except UnicodeError as exc:  # a label over 63 characters, an empty label
        return f"not a valid host name ({exc})"
    return None


def is_this_host(host: str) -> bool:
    """Whether ``host`` is an address of this machine (one of its addresses can be bound): where
    torchrun's c10d backend hosts the store itself."""
    try:
        infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return False
    for family, _, _, _, addr in infos:
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind(addr)
            return True
    return False


def bind_error(port: int) -> OSError | None:
    """Why a TCPStore could not listen on ``port`` here, or None when it could. The store listens
    on every address (IPv6's ``::``, IPv4 too), so a program on any one address of the port
    blocks it; a port left only in TIME_WAIT does not (SO_REUSEADDR, as the store sets)."""
    for family, addr in ((socket.AF_INET6, ("::", port)), (socket.AF_INET, ("0.0.0.0", port))):
        try:
            s = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this machine: the store listens on IPv4 only
            continue
        with s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                with contextlib.suppress(OSError):
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
            try:
                s.bind(addr)
            except OSError as exc:
                if family == socket.AF_INET6 and exc.errno == 99:  # EADDRNOTAVAIL: IPv6 off
                    continue
                return exc
            return None
    return None


@dataclass(frozen=True)
class PortHolder:
    """The process listening on a port, as ``/proc`` shows it."""

    pid: int
    argv: list[str]

    def rendezvous_id(self) -> str | None:
        """The ``--rdzv-id`` of a torchrun command line, or None for any other program."""
        if not any(a.endswith("torch.distributed.run") or Path(a).name == "torchrun"
                   for a in self.argv[:4]):  # fmt: skip
            return None
        for i, arg in enumerate(self.argv):
            if arg in ("--rdzv-id", "--rdzv_id") and i + 1 < len(self.argv):
                return self.argv[i + 1]
            for flag in ("--rdzv-id=", "--rdzv_id="):
                if arg.startswith(flag):
                    return arg.removeprefix(flag)
        return None

    def __str__(self) -> str:
        rdzv_id = self.rendezvous_id()
        if rdzv_id is not None:  # another job's store: its id tells the user which job
            return f"pid {self.pid}, torchrun of rendezvous id {rdzv_id!r}"
        command = " ".join([Path(self.argv[0]).name, *self.argv[1:]]) if self.argv else "?"
        return f"pid {self.pid}: {command[:60] + '...' if len(command) > 60 else command}"


def port_holder(port: int, proc: Path = Path("/proc")) -> PortHolder | None:
    """The process (of this user: another's file descriptors are not readable) listening on TCP
    ``port`` here, from ``/proc/net/tcp{,6}`` and the processes' socket descriptors; None where
    ``/proc`` cannot tell (not Linux, another user's process, another network namespace)."""
    inodes: set[str] = set()
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local address "ADDR:PORT" in hex, state 0A = LISTEN, then the socket's inode.
            if (
                len(fields) > 9
                and fields[3] == "0A"
                and int(fields[1].rsplit(":", 1)[1], 16) == port
            ):
                inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for fd_dir in proc.glob("[0-9]*/fd"):
        with contextlib.suppress(OSError):
            for fd in fd_dir.iterdir():
                with contextlib.suppress(OSError):
                    if str(fd.readlink()) in inodes:
                        raw = (fd_dir.parent / "cmdline").read_bytes()
                        argv = [a.decode("utf-8", "replace") for a in raw.split(b"\0") if a]
                        return PortHolder(int(fd_dir.parent.name), argv)
    return None


@dataclass(frozen=True)
class EndpointVerdict:
    """What :func:`check_endpoint` found."""

    problem: str | None = None
    """Why the rendezvous cannot work from this node (None: nothing known wrong)."""
    fix: str = ""
    """The one-line fix of :attr:`problem`."""
    hosts_store: bool = False
    """This node hosts the store: node 0, on the endpoint's host, with a store backend."""
    note: str = ""
    """What the node hosting the store found (the port free, or already this run's store)."""


def check_endpoint(
    endpoint: str, *, node_rank: int, nnodes: int, backend: str, rdzv_id: str | None, label: str
) -> EndpointVerdict:
    """Whether ``endpoint`` can work for this node. Every node needs the host to resolve. Node 0
    on the endpoint's host binds the store's port itself (c10d, static), so there the port must
    be free; a port held by a torchrun of the same rendezvous id is the run's own store (two nodes
    of one run on one machine, as tests and single-machine SLURM set-ups do: either may start it
    first). Other nodes only connect, and node 0 may not be up yet: nothing to refuse there.
    ``label`` names what set the endpoint (a flag, a variable, a config key) in the fix."""
    host, port = split_endpoint(endpoint)
    why = resolve_error(host)
    source = source_of(label)
    if why is not None and source is not None and source.host_is_pod_name:
        # Node 0's pod's DNS name exists only once that pod runs: not a mistake to refuse, a
        # wait torchrun's store client makes (it retries the name until its timeout).
        return EndpointVerdict(
            note=f"the rendezvous host {host!r} does not resolve yet ({why}); it is node 0's"
            f" pod's name under {source.name}, and torchrun retries it"
        )
    if why is not None:
        return EndpointVerdict(
            f"the rendezvous host {host!r} does not resolve ({why})",
            f"give node 0's host name or address in {label}",
        )
    if node_rank != 0 or backend not in STORE_BACKENDS or not is_this_host(host):
        return EndpointVerdict()
    busy = bind_error(port)
    if busy is None:
        return EndpointVerdict(hosts_store=True, note=f"{endpoint} is free on this host (node 0)")
    holder = port_holder(port)
    if holder is not None and rdzv_id is not None and holder.rendezvous_id() == rdzv_id:
        return EndpointVerdict(
            hosts_store=True,
            note=f"{endpoint} is already this run's rendezvous store (torchrun {holder.pid},"
            f" rendezvous id {rdzv_id})",
        )
    held = f"; held by {holder}" if holder is not None else ""
    if source is not None and source.port:
        fix = f"set {source.port[0]} to a free port (the rendezvous port under {source.name})"
    elif nnodes == 1:
        fix = f"pick another port in {label}, or omit it (a single node then picks a free port)"
    else:
        fix = f"pick another port in {label} (the same on every node)"
    return EndpointVerdict(
        f"{endpoint}: port {port} is in use on this host ({busy.strerror or busy}{held})", fix
    )


# --------------------------------------------------------------------------------------------
# After a failed launch

#: The last line of torchrun's traceback when the rendezvous failed.
_RDZV_ERROR = re.compile(
    r"^torch\.distributed\.elastic\.rendezvous\.(?:api\.)?(Rendezvous\w*Error)(?:: (.*))?$", re.M
)
#: Python's line between a chained exception and the one it caused.
_CAUSED = re.compile(
    r"^(?:The above exception was the direct cause of the following exception:"
    r"|During handling of the above exception, another exception occurred:)$",
    re.M,
)
#: A traceback's closing line: ``module.Name: message`` from the first column.
_EXC_LINE = re.compile(
    r"^([A-Za-z_][\w.]*(?:Error|Exception|Timeout|Interrupt)\w*)(?:: (.*))?$", re.M
)

#: What a rendezvous error means, where torchrun gives no message or only "see inner exception".
_MEANING = {
    "RendezvousTimeoutError": "not every node joined in time (torchrun's join_timeout, 600 s"
    " by default)",
    "RendezvousClosedError": "the rendezvous was closed (another node ended the job)",
    "RendezvousConnectionError": "the rendezvous store could not be reached",
}


def failure_cause(torchrun_text: str) -> str | None:
    """Why the rendezvous failed, as one line, from this launch's part of ``torchrun.log``: the
    inner exception torchrun's ``Rendezvous*Error`` was raised from (the store's own words: the
    address it could not reach, the timeout), else the error with what it means; None when the
    log holds no rendezvous failure."""
    found = list(_RDZV_ERROR.finditer(torchrun_text))
    if not found:
        return None
    last = found[-1]
    before = torchrun_text[: last.start()]
    markers = list(_CAUSED.finditer(before))
    if markers:
        # The exception line just above "The above exception was the direct cause": the inner one.
        lines = list(_EXC_LINE.finditer(before[: markers[-1].start()]))
        if lines:
            inner_name = lines[-1].group(1).rsplit(".", 1)[-1]
            return f"{inner_name}: {(lines[-1].group(2) or '').strip()}".rstrip(": ")
    name, message = last.group(1), (last.group(2) or "").strip()
    if "inner exception" in message or not message:
        message = _MEANING.get(name, message)
    return f"{name}: {message}".rstrip(": ")
