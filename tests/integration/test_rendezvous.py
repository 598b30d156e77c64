"""The rendezvous with real torchrun: a rendezvous that fails shows its cause on the launcher's
console (not only in torchrun.log), and two nodes of one run on one machine start in either order
(node 1's torchrun may bind the store's port before node 0's launcher checks it).

torchrun's own timeouts are cut short through its own variable, ``PET_RDZV_CONF`` (what
``--rdzv-conf`` sets; mlaunch passes the environment on), so a failure takes seconds, not the
default minute or ten. The refusals before launch (an unresolvable host, a port another program
holds) are in ``test_badinput_noprocess.py``.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from support.launch_runs import TIMEOUT_S, clean_env, finish, free_port, mlaunch

from mlaunch.launcher.rendezvous import bind_error

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

#: An address reserved for documentation (TEST-NET-1, RFC 5737): never a host, never routed.
UNREACHABLE = "192.0.2.1"


def console_line(out: str, prefix: str) -> str:
    (line,) = [line for line in out.splitlines() if line.startswith(prefix)]
    return line


def test_a_store_that_cannot_be_reached_shows_the_inner_cause_on_the_console(tmp_path):
    endpoint = f"{UNREACHABLE}:29500"
    proc = mlaunch(
        "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--rdzv-id", "far",
        "--rdzv-endpoint", endpoint, "--global-batch-size", "4", "--train-iters", "1",
        cwd=tmp_path, env=clean_env(PET_RDZV_CONF="read_timeout=2"),
    )  # fmt: skip
    code, out = finish(proc)
    assert code == 1, out
    line = console_line(out, f"rendezvous at {endpoint} failed: ")
    cause = line.removeprefix(f"rendezvous at {endpoint} failed: ")
    # The store's own words, naming the address it could not reach; never torchrun's "See inner
    # exception for details" with the inner one left in the log.
    assert UNREACHABLE in cause and "inner exception" not in cause, line
    log = tmp_path / "runs" / "far" / "logs" / "node1" / "torchrun.log"
    assert f"torchrun's log: {log}" in out
    assert "Traceback" not in out


def test_a_rendezvous_that_times_out_says_so_on_the_console_and_in_status(tmp_path):
    endpoint = f"127.0.0.1:{free_port()}"
    proc = mlaunch(
        "--nnodes", "2", "--node-rank", "0", "--nproc-per-node", "1", "--rdzv-id", "alone",
        "--rdzv-endpoint", endpoint, "--global-batch-size", "4", "--train-iters", "1",
        cwd=tmp_path, env=clean_env(PET_RDZV_CONF="join_timeout=2"),
    )  # fmt: skip
    code, out = finish(proc)
    assert code == 1, out
    line = console_line(out, f"rendezvous at {endpoint} failed: ")
    assert line.endswith("RendezvousTimeoutError: not every node joined in time (torchrun's"
                         " join_timeout, 600 s by default)"), line  # fmt: skip
    status = subprocess.run(
        [sys.executable, "-m", "mlaunch", "status", str(tmp_path / "runs" / "alone")],
        cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert "rendezvous failed: RendezvousTimeoutError" in status.stdout, status.stdout


def test_two_nodes_on_one_machine_start_when_node_1_hosts_the_store_first(tmp_path):
    # On one machine every node's torchrun may host the c10d store (the endpoint is its own
    # address): node 1's, started first, holds the port when node 0's launcher checks it. That
    # is the run's own store (same rendezvous id), not another program: node 0 must go on.
    script = tmp_path / "worker.py"
    script.write_text("print('worker ran')\n")
    port = free_port()
    common = [
        "--script", str(script), "--no-megatron-args", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "samerun",
    ]  # fmt: skip
    node1 = mlaunch(*common, "--node-rank", "1", cwd=tmp_path)
    deadline = time.monotonic() + TIMEOUT_S
    while bind_error(port) is None:  # until node 1's torchrun listens on the port
        if node1.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"node 1's torchrun never hosted the store:\n{finish(node1)[1]}")
        time.sleep(0.1)
    node0 = mlaunch(*common, "--node-rank", "0", cwd=tmp_path)
    for code, out in (finish(node0), finish(node1)):
        assert code == 0, out
    run_dir = tmp_path / "runs" / "samerun"
    assert (run_dir / "logs" / "node0").is_dir() and (run_dir / "logs" / "node1").is_dir()


def test_another_rendezvous_holding_the_port_is_refused(tmp_path):
    # The same held port, but by a torchrun of another rendezvous id: another job's store.
    script = tmp_path / "worker.py"
    script.write_text("print('worker ran')\n")
    port = free_port()
    common = [
        "--script", str(script), "--no-megatron-args", "--nnodes", "2", "--nproc-per-node", "1",
        "--rdzv-endpoint", f"127.0.0.1:{port}",
    ]  # fmt: skip
    other = mlaunch(*common, "--node-rank", "1", "--rdzv-id", "otherjob", cwd=tmp_path)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while bind_error(port) is None:
            if other.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"the other job's torchrun never hosted the store:\n{finish(other)[1]}")
            time.sleep(0.1)
        code, out = finish(mlaunch(*common, "--node-rank", "0", "--rdzv-id", "mine", cwd=tmp_path))
    finally:
        other.terminate()
        finish(other)
    assert code == 2, out
    assert f"port {port} is in use on this host" in out
    assert "torchrun of rendezvous id 'otherjob'" in out
