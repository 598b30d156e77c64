"""A scheduler's variables -> the launch settings, through the one table of sources
(``mlaunch.launcher.cluster_env``): SLURM's and the Kubeflow Trainer torch runtime's (``PET_*``).
The same precedence for both (a flag or the user's config file wins; a shipped config's values
are defaults), each value's variable as its source in the summary and in errors, and bad values
refused before anything starts. No process is started; the real 2-node job of "pods" is in
tests/integration/test_pods.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from mlaunch.cli import build_app
from mlaunch.cli.train_view import summary
from mlaunch.configs import CONFIGS_DIR
from mlaunch.launcher import cluster_env as ce
from mlaunch.launcher import plan as lp
from mlaunch.launcher import run as lrun
from mlaunch.settings import SettingsError

CLEAN = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CUDA_VISIBLE_DEVICES": ""}

#: What the torch runtime sets in node 1's container of a 2-node TrainJob "job" (v2.3.0: the
#: rank from the Job's completion index, the address node 0's pod's DNS name), plus the run id
#: ``mlaunch trainjob``'s manifest sets in ``spec.trainer.env``.
PET = {
    "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": "1",
    "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29500",
    "MEGATRON_OTEL_RUN_ID": "job",
}  # fmt: skip
SLURM = {
    "SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
    "SLURM_JOB_NODELIST": "node[01-02]",
}  # fmt: skip


def build(env: dict, flags: dict | None = None, config: str | None = None, cwd: Path = Path("/x")):
    return lp.build_plan(
        flags=flags or {}, config=config, environ={**CLEAN, **env}, cwd=cwd
    )  # fmt: skip


def torchrun_launch(plan: lp.LaunchPlan) -> dict[str, str]:
    argv = plan.argv
    names = ("--nnodes", "--nproc-per-node", "--node-rank", "--rdzv-endpoint", "--rdzv-id")
    return {name: argv[argv.index(name) + 1] for name in names}


def summary_text(plan: lp.LaunchPlan) -> str:
    console = Console(record=True, width=400)
    console.print(summary(plan))
    return " ".join(console.export_text().split())


# ---- the table ------------------------------------------------------------------------------


def test_the_torch_runtime_variables_are_read_as_slurms_are():
    pet = ce.cluster_launch(PET)
    assert pet.source is ce.KUBEFLOW_TORCH and not pet.problems and pet.conflict is None
    assert pet.values == {
        "launch.nnodes": ("2", "PET_NNODES"),
        "launch.node_rank": ("1", "PET_NODE_RANK"),
        "launch.nproc_per_node": ("1", "PET_NPROC_PER_NODE"),
        "launch.rdzv_endpoint": ("job-node-0-0.job:29500", "PET_MASTER_ADDR"),
    }
    slurm = ce.cluster_launch(SLURM)
    assert slurm.source is ce.SLURM
    assert slurm.values == {
        "launch.nnodes": ("2", "SLURM_NNODES"),
        "launch.node_rank": ("1", "SLURM_NODEID"),
        "launch.rdzv_id": ("4242", "SLURM_JOB_ID"),
        "launch.rdzv_endpoint": ("node01:29500", "SLURM_JOB_NODELIST"),
    }
    assert ce.cluster_launch({"PATH": "/bin"}) == ce.ClusterLaunch()
    # Without PET_MASTER_PORT the port is the runtime's (and torchrun's) 29500.
    no_port = {k: v for k, v in PET.items() if k != "PET_MASTER_PORT"}
    assert ce.cluster_launch(no_port).values["launch.rdzv_endpoint"][0] == "job-node-0-0.job:29500"


def test_visible_gpus_are_counted_from_cuda_visible_devices_else_the_device_files(tmp_path):
    for name in ("nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"):
        (tmp_path / name).touch()
    assert ce.visible_gpu_count({}, tmp_path) == 2
    assert ce.visible_gpu_count({"CUDA_VISIBLE_DEVICES": "3,1,2"}, tmp_path) == 3
    assert ce.visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}, tmp_path) == 0
    assert ce.visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,-1,2"}, tmp_path) == 1
    assert ce.visible_gpu_count({}, tmp_path / "none") == 0


# ---- the plan -------------------------------------------------------------------------------


def test_a_pod_of_the_torch_runtime_launches_its_node_of_the_job():
    plan = build(PET)
    assert torchrun_launch(plan) == {
        "--nnodes": "2", "--nproc-per-node": "1", "--node-rank": "1",
        "--rdzv-endpoint": "job-node-0-0.job:29500", "--rdzv-id": "job",
    }  # fmt: skip
    assert plan.run_id == "job" and plan.cluster is ce.KUBEFLOW_TORCH and not plan.slurm
    assert plan.log_dir == Path("/x/runs/job/logs/node1")  # its own files in the shared run dir
    sources = {p: str(plan.settings.source(p)) for p in plan.cluster_vars}
    assert sources == {
        "launch.nnodes": "PET_NNODES", "launch.node_rank": "PET_NODE_RANK",
        "launch.nproc_per_node": "PET_NPROC_PER_NODE", "launch.rdzv_endpoint": "PET_MASTER_ADDR",
    }  # fmt: skip
    table = plan.resolved_json()["settings"]
    assert table["launch.node_rank"] == {"value": 1, "source": "PET_NODE_RANK"}


@pytest.mark.parametrize(
    ("env", "rank_var", "endpoint", "endpoint_var"),
    [
        (PET, "PET_NODE_RANK", "job-node-0-0.job:29500", "PET_MASTER_ADDR"),
        (SLURM, "SLURM_NODEID", "node01:29500", "SLURM_JOB_NODELIST"),
    ],
)
def test_the_summary_names_the_variable_of_each_value(env, rank_var, endpoint, endpoint_var):
    text = summary_text(build(env, {"launch.nproc_per_node": 1}))
    nnodes_var = "PET_NNODES" if rank_var.startswith("PET") else "SLURM_NNODES"
    assert f"2 node(s) (from {nnodes_var}) x 1 processes = 2 ranks" in text, text
    assert f"node rank 1 (from {rank_var}), c10d at {endpoint} (from {endpoint_var})" in text


def test_a_shipped_configs_processes_per_node_are_a_default_the_runtime_wins_over():
    # tiny.toml (the default config) says nproc_per_node = 2: mlaunch's default, not the user's.
    plan = build({**PET, "PET_NPROC_PER_NODE": "3"}, {"training.global_batch_size": 12})
    assert plan.settings.launch.nproc_per_node == 3
    text = summary_text(plan)
    assert "x 3 processes (from PET_NPROC_PER_NODE) = 6 ranks" in text, text


@pytest.mark.parametrize("env", [PET, SLURM], ids=["pet", "slurm"])
def test_a_flag_or_the_users_config_file_wins_over_the_scheduler(env, tmp_path):
    flags = {"launch.nnodes": 4, "launch.node_rank": 3, "launch.rdzv_endpoint": "head:1234"}
    flagged = build(env, {**flags, "launch.nproc_per_node": 1, "training.global_batch_size": 8})
    got = torchrun_launch(flagged)
    assert (got["--nnodes"], got["--node-rank"], got["--rdzv-endpoint"]) == ("4", "3", "head:1234")
    assert "node rank 3, c10d at head:1234, id" in summary_text(flagged)
    mine = tmp_path / "mine.toml"
    mine.write_text("[launch]\nnproc_per_node = 1\nnnodes = 3\nnode_rank = 2\n")
    flags = {"launch.rdzv_endpoint": "head:1234", "training.global_batch_size": 6}
    filed = build(env, flags, config=str(mine), cwd=tmp_path)
    got = torchrun_launch(filed)
    assert (got["--nnodes"], got["--node-rank"], got["--nproc-per-node"]) == ("3", "2", "1")
    assert str(filed.settings.source("launch.node_rank")) == f"{mine} [launch] node_rank"


@pytest.mark.parametrize(
    ("word", "env", "flags", "count", "shown"),
    [
        ("gpu", {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, {"launch.device": "cuda"}, 4,
         "PET_NPROC_PER_NODE=gpu: 4 visible GPU(s)"),
        ("auto", {"CUDA_VISIBLE_DEVICES": "0,1"}, {"launch.device": "auto"}, 2,
         "PET_NPROC_PER_NODE=auto: 2 visible GPU(s)"),
        ("auto", {}, {"launch.device": "cpu"}, os.cpu_count(),
         f"PET_NPROC_PER_NODE=auto: {os.cpu_count()} CPU(s)"),
        ("cpu", {}, {}, os.cpu_count(), f"PET_NPROC_PER_NODE=cpu: {os.cpu_count()} CPU(s)"),
    ],
)  # fmt: skip
def test_torchruns_words_count_processes_as_torchrun_does(word, env, flags, count, shown):
    gbs = {"training.global_batch_size": 2 * count, "training.micro_batch_size": 1}
    plan = build({**PET, "PET_NPROC_PER_NODE": word, **env}, {**flags, **gbs})
    assert plan.settings.launch.nproc_per_node == count
    assert plan.cluster_vars["launch.nproc_per_node"] == shown
    assert f"x {count} processes (from {shown})" in summary_text(plan)


def test_variables_a_flag_replaces_are_not_needed():
    # No PET_NODE_RANK, but --node-rank: what the flag gives is not asked of the runtime.
    plan = build({k: v for k, v in PET.items() if k != "PET_NODE_RANK"}, {"launch.node_rank": 0})
    assert torchrun_launch(plan)["--node-rank"] == "0"
    # A bad PET_NODE_RANK under a flag is not used, so not refused.
    plan = build({**PET, "PET_NODE_RANK": "x"}, {"launch.node_rank": 1})
    assert plan.settings.launch.node_rank == 1


# ---- bad values: exit 2, one line naming the variable, nothing created -------------------


@pytest.fixture
def cli(monkeypatch, tmp_path):
    """``mlaunch train`` through CliRunner in an empty directory, no scheduler variables from
    the machine, and a spawn function that records instead of starting torchrun."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "PET_", "MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "MLAUNCH_")):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    spawned: list = []
    monkeypatch.setattr(lrun, "spawn", lambda argv, env, log: spawned.append(argv))

    def invoke(env: dict[str, str], *args: str):
        env = {**PET, "PET_MASTER_ADDR": "127.0.0.1", "CUDA_VISIBLE_DEVICES": "", **env}
        return CliRunner().invoke(build_app("train"), ["train", *args], env=env), spawned

    return invoke


@pytest.mark.parametrize(
    ("env", "args", "line"),
    [
        ({"PET_NODE_RANK": "x"}, [],
         "PET_NODE_RANK: Input should be a valid integer, unable to parse string as an integer,"
         " got 'x'"),
        ({"PET_NODE_RANK": "2"}, [],
         "PET_NODE_RANK: node rank 2 must be below the number of nodes 2 (0..1)"),
        ({"PET_NNODES": "0"}, [], "PET_NNODES: Input should be greater than or equal to 1, got '0'"),
        ({"PET_NODE_RANK": ""}, [],
         "PET_NODE_RANK: not set, while the Kubeflow torch runtime's other variables are (it sets"
         " PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR on every node); set it,"
         " or give --node-rank"),
        ({"PET_MASTER_PORT": "http"}, [], "PET_MASTER_PORT: 'http' is not a port number (1-65535)"),
        ({"PET_NPROC_PER_NODE": "xpu"}, [],
         "PET_NPROC_PER_NODE: 'xpu' is not a number of processes, nor auto, gpu, cpu"),
        ({"PET_NPROC_PER_NODE": "gpu"}, [],
         "PET_NPROC_PER_NODE: 'gpu' (a process per GPU) does not fit the device cpu (from"
         f" {CONFIGS_DIR / 'tiny.toml'} [launch] device); give a number of processes per node"
         " instead, or --device cuda|auto"),
        ({"PET_NPROC_PER_NODE": "auto"}, ["--device", "cuda"],
         "PET_NPROC_PER_NODE: 'auto' with the device cuda (from --device) counts the GPUs, and no"
         " GPU is visible here (no /dev/nvidiaN device, or CUDA_VISIBLE_DEVICES empty); give a"
         " number of processes per node instead"),
        ({"SLURM_JOB_ID": "77"}, [],
         "PET_NNODES: set together with SLURM_JOB_ID: this node is under SLURM and the Kubeflow"
         " torch runtime at once, and mlaunch will not guess whose node count, rank and rendezvous"
         " host to use; unset the variables of the one it is not under"),
        # SLURM's values are named by their variable too (they used to be named by the flag).
        ({**dict.fromkeys(PET, ""), **SLURM, "SLURM_NODEID": "x"}, [],
         "SLURM_NODEID: Input should be a valid integer, unable to parse string as an integer,"
         " got 'x'"),
        ({**dict.fromkeys(PET, ""), **SLURM, "MASTER_PORT": "0"}, [],
         "MASTER_PORT: '0' is not a port number (1-65535)"),
    ],
)  # fmt: skip
def test_a_bad_value_exits_2_naming_the_variable_and_starts_nothing(cli, tmp_path, env, args, line):
    result, spawned = cli(env, "--global-batch-size", "4", *args)
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [line]
    assert "Traceback" not in result.output
    assert not (tmp_path / "runs").exists() and spawned == []


def test_two_schedulers_at_once_are_refused_even_when_flags_give_every_value():
    # The rule is simple: never guess which scheduler this node is under.
    flags = {"launch.nnodes": 1, "launch.node_rank": 0, "launch.rdzv_endpoint": "h:1"}
    with pytest.raises(SettingsError) as err:
        build({**PET, **SLURM}, flags)
    assert [p.field for p in err.value.problems] == ["PET_NNODES"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_pod_name_that_does_not_resolve_yet_is_left_to_torchrun_not_refused(rank):
    # Node 0's pod's DNS name appears once that pod runs: a pod that starts first must not exit
    # 2 for it (torchrun's store client retries the name). A name SLURM or a flag gave that does
    # not resolve is a mistake, refused as before.
    from mlaunch.launcher.rendezvous import check_endpoint

    def verdict(label: str):
        return check_endpoint(
            "job-node-0-0.invalid:29500", node_rank=rank, nnodes=2, backend="c10d",
            rdzv_id="job", label=label,
        )  # fmt: skip

    pod = verdict("PET_MASTER_ADDR")
    assert pod.problem is None and "does not resolve yet" in pod.note, pod
    for label in ("SLURM_JOB_NODELIST", "--rdzv-endpoint"):
        assert "does not resolve" in (verdict(label).problem or ""), label


def test_the_node_rank_says_which_node_hosts_the_rendezvous_store():
    # torchrun guesses whether it hosts the c10d store from the endpoint's name being one of this
    # machine's; node 0's pod's DNS name is not its host name (and may not resolve yet), so the
    # guess can fail and no node hosts it. The runtime's node rank decides instead.
    def conf(env: dict, flags: dict | None = None) -> str | None:
        argv = build({**PET, **env}, flags).argv
        return argv[argv.index("--rdzv-conf") + 1] if "--rdzv-conf" in argv else None

    assert conf({}) == "is_host=false"
    assert conf({"PET_NODE_RANK": "0"}) == "is_host=true"
    # torchrun's own variable for --rdzv-conf (which the flag replaces) is kept...
    assert conf({"PET_RDZV_CONF": "join_timeout=5"}) == "join_timeout=5,is_host=false"
    # ...and an is_host given there wins.
    assert conf({"PET_RDZV_CONF": "is_host=true,read_timeout=3"}) == "is_host=true,read_timeout=3"
    # An endpoint from a flag: torchrun's guess stands.
    assert conf({}, {"launch.rdzv_endpoint": "head:1234"}) is None
    # SLURM's first node is node 0 (SLURM_NODEID 0): it hosts, and only it. Two nodes sharing a
    # machine would otherwise both guess they host and race for the port.
    slurm = build(SLURM, {"launch.nproc_per_node": 1}).argv
    assert slurm[slurm.index("--rdzv-conf") + 1] == "is_host=false"
    slurm = build({**SLURM, "SLURM_NODEID": "0"}, {"launch.nproc_per_node": 1}).argv
    assert slurm[slurm.index("--rdzv-conf") + 1] == "is_host=true"
