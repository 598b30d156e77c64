"""Doctor checks with real processes and sockets: the torch subprocess probe (healthy, missing
torch, hanging interpreter, the --deep gloo all-reduce) and the rendezvous port."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support.otlp import closed_port_endpoint
from support.peers import Listener

from mlaunch.doctor.host import check_rendezvous
from mlaunch.doctor.torch_probe import TorchProbe
from mlaunch.settings import load_settings


def names(results: list) -> list[str]:
    return [r.name for r in results]


def test_torch_probe_describes_this_cpu_install() -> None:
    results = TorchProbe([sys.executable], timeout_s=60, deep=False).results()
    assert names(results) == ["torch import", "cuda", "nccl", "gloo"]
    by = {r.name: r for r in results}
    assert by["torch import"].status == "pass" and "imports" in by["torch import"].message
    assert by["gloo"].status == "pass"
    import torch  # the test may import torch; doctor itself never does

    if not torch.cuda.is_available():
        assert by["cuda"].message.startswith("CUDA not available")
        assert by["nccl"].status == "pass"


def test_cuda_required_on_a_machine_without_it_fails() -> None:
    pytest.importorskip("torch")
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    results = TorchProbe([sys.executable], timeout_s=60, deep=False).results(device="cuda")
    cuda = next(r for r in results if r.name == "cuda")
    assert cuda.status == "fail" and "launch.device is cuda" in cuda.message


def test_missing_torch_fails_with_the_install_command() -> None:
    # -S: no site-packages, so torch cannot be imported (the probe itself is stdlib only).
    [result] = TorchProbe([sys.executable, "-S"], timeout_s=60, deep=False).results()
    assert result.status == "fail"
    assert "torch cannot be imported" in result.message and "ModuleNotFoundError" in result.message
    assert result.fix == "pip install 'torch==2.13.0'"


def test_hanging_torch_import_is_cut_off_by_the_timeout(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexec sleep 60\n")
    fake.chmod(0o755)
    probe = TorchProbe([str(fake)], timeout_s=0.5, deep=False)
    [result] = probe.results()
    assert result.status == "warn"  # unchecked, not known broken
    assert "did not finish within 0.5 s" in result.message
    assert probe.proc.popen is not None and probe.proc.popen.poll() is not None  # killed


@pytest.mark.slow
@pytest.mark.distributed
def test_deep_runs_a_real_two_process_gloo_all_reduce() -> None:
    results = TorchProbe([sys.executable], timeout_s=60, deep=True).results()
    gloo = next(r for r in results if r.name == "gloo all-reduce")
    assert gloo.status == "pass", gloo
    assert gloo.message == "2-process gloo all-reduce on 127.0.0.1 returned the right sum"


# --- rendezvous -----------------------------------------------------------------------------


def rdzv_settings(tmp_path: Path, endpoint: str, node_rank: int = 0):
    config = tmp_path / "rdzv.toml"
    config.write_text(
        f"[launch]\nnnodes = 2\nnode_rank = {node_rank}\nrdzv_endpoint = '{endpoint}'\n"
        "[training]\nglobal_batch_size = 16\n"
    )
    return load_settings(environ={}, config=config)


def test_without_an_endpoint_a_free_local_port_is_enough() -> None:
    [result] = check_rendezvous(load_settings(environ={}))
    assert result.status == "pass" and "free local port" in result.message


def test_busy_rendezvous_port_on_node_zero_fails(tmp_path: Path) -> None:
    with Listener() as busy:
        [result] = check_rendezvous(rdzv_settings(tmp_path, f"127.0.0.1:{busy.port}"))
    assert result.status == "fail"
    assert "in use on this host" in result.message
    assert "rdzv_endpoint" in result.fix  # names the config key that set it


def test_free_rendezvous_port_on_node_zero_passes(tmp_path: Path) -> None:
    port = int(closed_port_endpoint().rsplit(":", 1)[1])
    [result] = check_rendezvous(rdzv_settings(tmp_path, f"127.0.0.1:{port}"))
    assert result.status == "pass" and "is free on this host" in result.message


def test_other_nodes_check_that_the_rendezvous_is_reachable(tmp_path: Path) -> None:
    with Listener() as host:
        [result] = check_rendezvous(rdzv_settings(tmp_path, f"127.0.0.1:{host.port}", 1))
    assert result.status == "pass" and "reachable" in result.message
    port = int(closed_port_endpoint().rsplit(":", 1)[1])
    [result] = check_rendezvous(rdzv_settings(tmp_path, f"127.0.0.1:{port}", 1), timeout_s=1)
    assert result.status == "warn" and "start node 0 first" in result.fix


def test_unresolvable_rendezvous_host_fails(tmp_path: Path) -> None:
    [result] = check_rendezvous(rdzv_settings(tmp_path, "no-such-host.invalid:29500"))
    assert result.status == "fail" and "does not resolve" in result.message


def test_an_etcd_endpoint_is_a_server_to_reach_not_a_port_to_keep_free(tmp_path: Path) -> None:
    # etcd's endpoint is the etcd server: node 0 binds nothing there, so a listener is what it
    # needs, not a conflict.
    config = tmp_path / "etcd.toml"
    with Listener() as etcd:
        config.write_text(
            f"[launch]\nrdzv_backend = 'etcd-v2'\nrdzv_endpoint = '127.0.0.1:{etcd.port}'\n"
        )
        [result] = check_rendezvous(load_settings(environ={}, config=config))
    assert result.status == "pass" and "is reachable" in result.message
