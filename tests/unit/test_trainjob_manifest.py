"""``mlaunch trainjob``'s manifest, without a cluster: every combination of its options written,
read back as YAML, and checked strictly against Kubeflow's own TrainJob models (Trainer v2.3.0,
``kubeflow-trainer-api``: unknown fields are errors, see ``support/trainjob_model.py``), with the
rules the CRD and the torch runtime impose; bad input refused before anything is written."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.trainjob_model import StrictModelError, strict_trainjob

from mlaunch import envcontract as ec
from mlaunch.kube.manifest import TrainJobOptions, manifest, plan_trainjob, render_yaml
from mlaunch.kube.names import NODE, QUEUE_LABEL, RFC1035, RUN_ID_ANNOTATION, trainjob_name
from mlaunch.settings import SettingsError

CLEAN = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "SLURM_", "MASTER_", "PET_"))
    and k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")
}
ENDPOINT = "http://otel-collector.monitoring:4317"


def _job(cwd: Path, flags=None, passthrough=(), env=None, **options):
    return plan_trainjob(
        flags=flags or {}, config=None, passthrough=list(passthrough),
        environ={**CLEAN, **(env or {})}, cwd=cwd, options=TrainJobOptions(**options),
    )  # fmt: skip


def _pod_spec(doc: dict) -> dict:
    (patch,) = doc["spec"]["runtimePatches"]
    jobs = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    (job,) = [j for j in jobs if j["name"] == NODE]
    return job["template"]["spec"]["template"]["spec"]


ENTRIES = ("trainer", "script", "module")
COMBINATIONS = list(
    itertools.product(
        (1, 3),  # nodes
        (None, 2),  # gpus per node
        (None, "team-a"),  # queue
        (None, "train-runs:/mnt/runs"),  # volume
        ("torch-distributed", "torch-cuda-251"),  # runtime
        (None, ENDPOINT),  # collector
        ENTRIES,
    )
)


def test_every_manifest_the_command_can_write_is_a_strict_trainjob(tmp_path, monkeypatch):
    """192 manifests: each one's YAML is the manifest, Kubeflow's models take it strictly, and
    it says what the options asked, never PET_* nor a node rank."""
    monkeypatch.chdir(tmp_path)  # --script is checked as train checks it, from here
    (tmp_path / "train.py").write_text("print('hi')\n")
    for nodes, gpus, queue, volume, runtime, endpoint, entry in COMBINATIONS:
        flags: dict = {}
        if gpus:
            flags["launch.device"] = "cuda"
            flags["training.global_batch_size"] = str(2 * gpus * nodes * 2)
        elif nodes > 1:
            flags["training.global_batch_size"] = str(2 * 2 * nodes)
        if endpoint:
            flags["telemetry.otel.base_endpoint"] = endpoint
        if entry == "script":
            flags["launch.script"] = "train.py"
        elif entry == "module":
            flags["launch.module"] = "json.tool"
        case = (nodes, gpus, queue, volume, runtime, endpoint, entry)
        job = _job(
            tmp_path, flags, passthrough=["--x", "1"] if entry != "trainer" else (),
            image="ghcr.io/me/train:1", nodes=nodes, gpus_per_node=gpus, queue=queue,
            volume=volume, runtime=runtime,
        )  # fmt: skip
        doc = manifest(job)
        assert yaml.safe_load(render_yaml(job)) == doc, case
        strict_trainjob(doc)  # raises on an unknown field or a wrong type
        trainer = doc["spec"]["trainer"]
        env = {e["name"]: e["value"] for e in trainer["env"]}
        args = trainer["args"]
        assert doc["spec"]["runtimeRef"] == {"name": runtime}, case
        assert trainer["command"] == ["mlaunch", "train"], case
        assert trainer["numNodes"] == nodes and trainer["numProcPerNode"] == (gpus or 2), case
        assert not [k for k in env if k.startswith("PET_")], case
        assert not {"--nnodes", "--node-rank", "--rdzv-endpoint"} & set(args), case
        assert env[ec.RUN_ID] == job.run_id == doc["metadata"]["annotations"][RUN_ID_ANNOTATION]
        name = doc["metadata"]["name"]
        assert RFC1035.fullmatch(name) and len(name) <= 63, case
        assert (QUEUE_LABEL in doc["metadata"]["labels"]) == bool(queue), case
        if queue:
            assert doc["metadata"]["labels"][QUEUE_LABEL] == queue
        limits = (trainer.get("resourcesPerNode") or {}).get("limits")
        assert limits == ({"nvidia.com/gpu": str(gpus)} if gpus else None), case
        assert env[ec.PRIMARY_PREFIX + "EXPORTER"] == ("otlp" if endpoint else "file"), case
        assert env.get(ec.OTLP_ENDPOINT) == endpoint, case
        pod = _pod_spec(doc)
        assert pod["terminationGracePeriodSeconds"] >= 60, case
        if volume:
            claim, mount = volume.split(":")
            (vol,) = pod["volumes"]
            assert vol["persistentVolumeClaim"] == {"claimName": claim}
            (container,) = pod["containers"]
            assert container["name"] == NODE
            assert container["volumeMounts"] == [{"name": vol["name"], "mountPath": mount}]
            assert args[args.index("--run-dir") + 1] == f"{mount}/runs/{job.run_id}"
            assert "--save-interval" in args
        else:
            assert "volumes" not in pod and "--run-dir" not in args, case
        if entry == "script":
            assert args[args.index("--script") + 1] == "train.py"  # the image's, as given
        if entry != "trainer":
            assert args[-3:] == ["--", "--x", "1"], case


def test_the_strict_check_refuses_what_the_models_would_drop(tmp_path):
    """The check itself: an unknown key anywhere, or a value of the wrong type, is an error
    (the generated models alone would ignore the key)."""
    doc = manifest(_job(tmp_path, image="img:1", volume="c:/m"))
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

    bad = yaml.safe_load(yaml.safe_dump(doc))
    _pod_spec(bad)["containers"][0]["volumeMount"] = []
    assert TrainerV1alpha1TrainJob.from_dict(bad) is not None  # the models alone: accepted
    with pytest.raises(StrictModelError, match=r"containers\[0\]\.volumeMount"):
        strict_trainjob(bad)
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["podTemplateOverrides"] = []  # v2.1's field, gone in v2.2+
    with pytest.raises(StrictModelError, match="spec.podTemplateOverrides"):
        strict_trainjob(bad)
    bad = yaml.safe_load(yaml.safe_dump(doc))
    bad["spec"]["trainer"]["numNodes"] = "2"
    with pytest.raises(StrictModelError):
        strict_trainjob(bad)


@pytest.mark.parametrize(
    "run_id",
    ["0123456789", "Run.A_b", "abc", "x" * 128, "9" + "-" * 10 + "a", "mlaunch-abc"],
)
def test_trainjob_names_are_rfc1035_labels_derived_deterministically(run_id):
    name = trainjob_name(run_id)
    assert RFC1035.fullmatch(name) and len(name) <= 63
    assert trainjob_name(run_id) == name
    if run_id == "abc":
        assert name == "mlaunch-abc"  # a run id that fits is kept as it is


def test_run_ids_that_fit_alike_get_different_names():
    assert len({trainjob_name(r) for r in ("a.b", "a_b", "a-b", "A-b", "a" * 100, "a" * 101)}) == 6


def test_the_run_id_given_is_the_pods_and_names_the_job(tmp_path):
    job = _job(tmp_path, {"telemetry.run_id": "0042"}, image="img:1", nodes=2,
               volume="runs:/r")  # fmt: skip
    doc = manifest(job)
    assert doc["metadata"]["name"] == trainjob_name("0042") != "0042"
    env = {e["name"]: e["value"] for e in doc["spec"]["trainer"]["env"]}
    assert env[ec.RUN_ID] == "0042"
    assert "--run-dir" in doc["spec"]["trainer"]["args"]
    assert doc["spec"]["trainer"]["args"][-1] == "/r/runs/0042"


def _problems(tmp_path, flags=None, **options) -> list[tuple[str, str]]:
    with pytest.raises(SettingsError) as exc:
        _job(tmp_path, flags, **options)
    return exc.value.problems


@pytest.mark.parametrize(
    ("flags", "options", "field"),
    [
        ({}, {"image": "my image:1"}, "--image"),
        ({}, {"image": " "}, "--image"),
        ({}, {"image": "img", "namespace": "Team_A"}, "--namespace"),
        ({}, {"image": "img", "namespace": "a" * 64}, "--namespace"),
        ({}, {"image": "img", "gpus_per_node": 2}, "--gpus-per-node"),
        ({}, {"image": "img", "volume": "claim"}, "--volume"),
        ({}, {"image": "img", "volume": "claim:relative/path"}, "--volume"),
        ({}, {"image": "img", "queue": "bad queue"}, "--queue"),
        ({}, {"image": "img", "runtime": "Torch Distributed"}, "--runtime"),
        ({"launch.node_rank": "1"}, {"image": "img"}, "--node-rank"),
        ({"launch.rdzv_endpoint": "h:1"}, {"image": "img"}, "--rdzv-endpoint"),
        ({"launch.run_dir": "/x"}, {"image": "img"}, "--run-dir"),
        ({"telemetry.otel.headers": "a=b"}, {"image": "img"}, "--otlp-headers"),
    ],
)
def test_bad_kubernetes_input_names_the_flag(tmp_path, flags, options, field):
    fields = [f for f, _ in _problems(tmp_path, flags, **options)]
    assert any(f.startswith(field) for f in fields), fields


@pytest.mark.parametrize("key", ["nnodes = 2", "node_rank = 1", 'rdzv_endpoint = "h:1"'])
def test_a_config_files_per_node_launch_values_are_refused(tmp_path, key):
    config = tmp_path / "c.toml"
    config.write_text(f"[launch]\n{key}\n")
    with pytest.raises(SettingsError) as exc:
        plan_trainjob(flags={}, config=str(config), passthrough=[], environ=CLEAN, cwd=tmp_path,
                      options=TrainJobOptions(image="img", nodes=2))  # fmt: skip
    assert any(f.endswith(f"[launch] {key.split()[0]}") for f, _ in exc.value.problems)


# ---- the command: exit 2, one line per problem, nothing written


def _cli(tmp_path: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlaunch", "trainjob", *args],
        cwd=tmp_path, env={**CLEAN, "HOME": str(tmp_path), **(env or {})},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--image", "img:1", "--nodes", "0"], "--nodes"),
        (["--nodes", "2"], "--image"),
        (["--image", "my image"], "--image"),
        (["--image", "img:1", "--namespace", "Not_A_Label"], "--namespace"),
        (["--image", "img:1", "--gpus-per-node", "2"], "--gpus-per-node"),
        # validated as train does: the same settings layer
        (["--image", "img:1", "--train-iters", "-3"], "--train-iters"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(tmp_path, args, needle):
    out = _cli(tmp_path, *args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr and out.stdout == ""
    assert not (tmp_path / "runs").exists()


def test_dry_run_prints_the_manifest_and_writes_nothing(tmp_path):
    out = _cli(tmp_path, "--image", "img:1", "--nodes", "2", "--volume", "runs:/r", "--dry-run",
               "--global-batch-size", "16")  # fmt: skip
    assert out.returncode == 0, out.stderr
    doc = yaml.safe_load(out.stdout)
    strict_trainjob(doc)
    assert out.stdout.startswith("# Written by mlaunch trainjob")
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("own_config", [False, True])
def test_what_the_pod_runs_is_what_was_validated(tmp_path, monkeypatch, own_config):
    """The pod's ``mlaunch train`` (its arguments parsed by train's own command line, its
    environment only the manifest's and the torch runtime's PET_*) plans the same settings as
    the validation did, but for what the runtime decides per pod; a config file of this machine
    (not in the image) included."""
    import typer

    from mlaunch.cli import build_app
    from mlaunch.cli.setting_flags import apply_negative_flags, given_settings
    from mlaunch.launcher.plan import build_plan, settings_table

    monkeypatch.chdir(tmp_path)
    config = None
    flags = {"training.train_iters": "11", "model.num_layers": "3",
             "training.global_batch_size": "12"}  # fmt: skip
    if own_config:
        config = str(tmp_path / "mine.toml")
        Path(config).write_text(
            "[launch]\nnproc_per_node = 1\n[training]\ntrain_iters = 7\nmicro_batch_size = 1\n"
            'global_batch_size = 3\n[telemetry]\nspan_groups = "default"\n'
        )
        flags = {"training.lr": "0.01"}
    job = plan_trainjob(
        flags=flags, config=config, passthrough=[], environ={**CLEAN, "OTEL_SERVICE_NAME": "svc"},
        cwd=tmp_path, options=TrainJobOptions(image="img:1", nodes=3, volume=f"c:{tmp_path}/vol"),
    )  # fmt: skip
    trainer = manifest(job)["spec"]["trainer"]
    env = {e["name"]: e["value"] for e in trainer["env"]}
    command = typer.main.get_command(build_app("train")).commands["train"]
    params = dict(command.make_context("train", list(trainer["args"])).params)
    pod_flags = given_settings(params)
    apply_negative_flags(params, pod_flags)
    # node 2's environment: the manifest's, and what the torch runtime adds (Trainer v2.3.0's
    # torch plugin: PET_NPROC_PER_NODE from numProcPerNode, the master at node 0's pod)
    name = manifest(job)["metadata"]["name"]
    pod_env = {
        **env, "PET_NNODES": str(trainer["numNodes"]), "PET_NODE_RANK": "2",
        "PET_NPROC_PER_NODE": str(trainer["numProcPerNode"]),
        "PET_MASTER_ADDR": f"{name}-node-0-0.{name}", "PET_MASTER_PORT": "29500",
    }  # fmt: skip
    elsewhere = tmp_path / "pod-workdir"
    elsewhere.mkdir()
    pod = build_plan(flags=pod_flags, config=params["config"], passthrough=[], environ=pod_env,
                     cwd=elsewhere)  # fmt: skip
    here, there = settings_table(job.plan.settings), settings_table(pod.settings)
    differ = {k for k in here if here[k]["value"] != there[k]["value"]}
    assert differ == {"launch.node_rank", "launch.rdzv_endpoint", "launch.run_dir"}
    assert there["launch.nnodes"]["value"] == 3 and there["launch.node_rank"]["value"] == 2
    assert there["launch.rdzv_endpoint"]["value"] == f"{name}-node-0-0.{name}:29500"
    assert str(pod.settings.source("launch.node_rank")).endswith("PET_NODE_RANK")
    assert pod.run_id == job.run_id
    assert str(pod.run_dir) == f"{tmp_path}/vol/runs/{job.run_id}"
    assert there["telemetry.service_name"]["value"] == "svc"
