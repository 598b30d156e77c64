"""``mlaunch trainjob`` and ``status|logs|stop trainjob/NAME`` through the real ``kubernetes``
client against a loopback API server (``support/kube_api.py``: a real HTTP server that checks
each request's path, verb and body and answers as the API does; what it does not simulate is
listed there and in docs/kubernetes.md)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support.kube_api import kube_api, write_kubeconfig

from mlaunch.kube import client as kc
from mlaunch.kube.jobs import (
    TrainJobInputError,
    pod_view,
    stop_trainjob,
    trainjob_logs,
    trainjob_state,
    trainjob_status,
    wait_pods_gone,
)
from mlaunch.kube.manifest import TrainJobOptions, manifest, plan_trainjob
from mlaunch.kube.names import STOPPED_ANNOTATION, trainjob_name
from mlaunch.rundir import layout as lay

TJ = "/apis/trainer.kubeflow.org/v1alpha1/namespaces/team/trainjobs"
CLEAN = {
    k: v
    for k, v in os.environ.items()
    if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "SLURM_", "MASTER_", "PET_"))
    and k not in ("KUBECONFIG", "KUBERNETES_SERVICE_HOST")
}


def _mlaunch(cwd: Path, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlaunch", *args], cwd=cwd,
        env={**CLEAN, "HOME": str(cwd), **(env or {})}, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


@pytest.fixture
def api(tmp_path):
    with kube_api() as double:
        double.kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", double.port)
        yield double


@pytest.fixture
def kube(api, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return kc.connect()


def _create(kube, tmp_path: Path, **options) -> str:
    job = plan_trainjob(
        flags={"training.global_batch_size": "16"}, config=None, passthrough=[],
        environ=CLEAN, cwd=tmp_path,
        options=TrainJobOptions(image="img:1", nodes=2, volume="runs:/r", **options),
    )  # fmt: skip
    body = manifest(job)
    body["metadata"]["namespace"] = kube.namespace
    kc.create_trainjob(kube, body)
    return job.name


# ---- mlaunch trainjob


def test_trainjob_creates_what_it_wrote_into_the_run_directory(api, tmp_path):
    out = _mlaunch(
        tmp_path, "trainjob", "--image", "ghcr.io/me/train:1", "--nodes", "2", "--volume",
        "runs:/r", "--queue", "team-a", "--global-batch-size", "16", "--otel-run-id", "0042",
        env={"KUBECONFIG": str(api.kubeconfig)},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    name = trainjob_name("0042")
    assert f"created trainjob {name} in namespace team" in out.stdout
    # one look that the server serves TrainJobs, then the creation: nothing else
    assert api.calls() == [("GET", TJ), ("POST", TJ)]
    written = yaml.safe_load((tmp_path / "runs" / "0042" / lay.TRAINJOB_FILE).read_text())
    assert api.requests[1].body == {
        **written,
        "metadata": {**written["metadata"], "namespace": "team"},
    }
    assert api.requests[1].headers.get("content-type", "application/json") == "application/json"
    stored = api.trainjobs[("team", name)]
    assert stored["spec"]["suspend"] is False  # the CRD's default, as the server stores it
    record = json.loads((tmp_path / "runs" / "0042" / lay.TRAINJOB_RECORD_FILE).read_text())
    assert (record["name"], record["namespace"]) == (name, "team")

    # the run directory names the TrainJob for status, as trainjob/NAME does
    status = _mlaunch(tmp_path, "status", "runs/0042", env={"KUBECONFIG": str(api.kubeconfig)})
    assert status.returncode == 0, status.stderr
    assert status.stdout.splitlines()[0] == f"trainjob {name} (namespace team): queued (no pod yet)"

    # the same run id again: the API refuses (409) after validation: exit 1, its message
    again = _mlaunch(
        tmp_path, "trainjob", "--image", "img:1", "--otel-run-id", "0042",
        env={"KUBECONFIG": str(api.kubeconfig)},
    )  # fmt: skip
    assert again.returncode == 1, again.stderr
    assert "409" in again.stderr and "already exists" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_way_to_the_cluster_exits_2_and_writes_nothing(tmp_path, api):
    cases = {
        "no kubeconfig": ({"KUBECONFIG": str(tmp_path / "missing")}, "kubeconfig"),
        "unreachable": (
            {"KUBECONFIG": str(write_kubeconfig(tmp_path / "dead", _free_port()))},
            "cannot reach the Kubernetes API server",
        ),
    }
    shadow = tmp_path / "shadow" / "kubernetes"  # an install without the client
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no kubernetes here')\n")
    cases["no client"] = (
        {"KUBECONFIG": str(api.kubeconfig), "PYTHONPATH": f"{shadow.parent}{os.pathsep}"
         + os.environ.get("PYTHONPATH", "")},
        "pip install 'mlaunch[kubernetes]'",
    )  # fmt: skip
    api.serves_trainer = False
    cases["no Trainer"] = ({"KUBECONFIG": str(api.kubeconfig)}, "install Kubeflow Trainer v2")
    for what, (env, needle) in cases.items():
        out = _mlaunch(tmp_path, "trainjob", "--image", "img:1", env=env)
        assert out.returncode == 2, (what, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and needle in lines[0], (what, out.stderr)
        assert not (tmp_path / "runs").exists(), what
    assert not api.trainjobs and ("POST", TJ) not in api.calls()


# ---- status


def test_status_says_what_the_trainjob_and_its_pods_say(api, kube, tmp_path):
    name = _create(kube, tmp_path)
    assert trainjob_status(kube, name).state == "queued"  # no pod yet
    api.add_pod("team", name, 0, log="iteration 1\niteration 2 loss 5.1\n")
    api.add_pod("team", name, 1, phase="Pending",
                container_state={"waiting": {"reason": "ImagePullBackOff"}})  # fmt: skip
    out = _mlaunch(tmp_path, "status", f"trainjob/{name}", env={"KUBECONFIG": str(api.kubeconfig)})
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"trainjob {name} (namespace team): running"
    assert any("(node 1): Pending (ImagePullBackOff)" in ln for ln in lines)
    assert "node 0:   iteration 2 loss 5.1" in lines
    log_reads = [r for r in api.requests if r.path.endswith("/log")]
    assert [r.query for r in log_reads] == [{"container": ["node"], "tailLines": ["1"]}]

    api.set_condition("team", name, "Failed", "BackoffLimitExceeded", "node-0 failed: exit 1")
    js = _mlaunch(tmp_path, "status", f"trainjob/{name}", "--json",
                  env={"KUBECONFIG": str(api.kubeconfig)})  # fmt: skip
    data = json.loads(js.stdout)
    assert data["state"] == "failed" and data["cause"] == "node-0 failed: exit 1"
    assert data["trainjob"]["run_id"] and len(data["trainjob"]["pods"]) == 2


def _tj(spec=None, labels=None, annotations=None, conditions=None) -> dict:
    return {
        "metadata": {"labels": labels or {}, "annotations": annotations or {}},
        "spec": spec or {},
        "status": {"conditions": conditions or []},
    }


def _pod(phase: str, node: int = 0) -> dict:
    return {
        "metadata": {"name": f"p{node}", "labels": {
            "jobset.sigs.k8s.io/replicatedjob-name": "node",
            "batch.kubernetes.io/job-completion-index": str(node)}},
        "status": {"phase": phase},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("trainjob", "pods", "state"),
    [
        (_tj(), [], "queued"),
        (_tj(), [_pod("Pending")], "queued"),
        (_tj(), [_pod("Pending"), _pod("Running", 1)], "running"),
        (_tj(), [_pod("Succeeded"), _pod("Succeeded", 1)], "running"),  # no condition yet
        (_tj(conditions=[{"type": "Complete", "status": "True"}]), [], "completed"),
        (_tj(conditions=[{"type": "Failed", "status": "True", "message": "m"}]), [], "failed"),
        (_tj(conditions=[{"type": "Complete", "status": "False"}]), [_pod("Running")], "running"),
        (_tj({"suspend": True}, annotations={STOPPED_ANNOTATION: "t"}), [], "stopped"),
        (_tj({"suspend": True}, labels={"kueue.x-k8s.io/queue-name": "q"}), [], "queued"),
        (_tj({"suspend": True}), [], "suspended"),
    ],
)
def test_trainjob_states_in_mlaunchs_words(trainjob, pods, state):
    assert trainjob_state(trainjob, [pod_view(p) for p in pods])[0] == state


def test_status_of_an_unknown_trainjob_exits_2(api, tmp_path):
    env = {"KUBECONFIG": str(api.kubeconfig)}
    for args in (["trainjob/nope"], ["trainjob/Not_A_Name"], [str(tmp_path), "-n", "team"]):
        out = _mlaunch(tmp_path, "status", *args, env=env)
        assert out.returncode == 2, out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


# ---- logs and stop (the functions; the commands are wired where they exist)


def test_logs_read_every_pod_in_node_order_prefixed(api, kube, tmp_path):
    name = _create(kube, tmp_path)
    with pytest.raises(TrainJobInputError, match="no pod"):
        list(trainjob_logs(kube, name))
    api.add_pod("team", name, 1, log="b1\nb2\n")
    api.add_pod("team", name, 0, log="a1\na2\n")
    assert list(trainjob_logs(kube, name)) == [
        "[node 0] a1",
        "[node 0] a2",
        "[node 1] b1",
        "[node 1] b2",
    ]
    assert list(trainjob_logs(kube, name, node=1, tail=1)) == ["b2"]
    followed = list(trainjob_logs(kube, name, follow=True))
    assert sorted(followed) == ["[node 0] a1", "[node 0] a2", "[node 1] b1", "[node 1] b2"]
    assert followed.index("[node 0] a1") < followed.index("[node 0] a2")
    streams = [r for r in api.requests if r.query.get("follow") == ["true"]]
    assert len(streams) == 2


def test_stop_suspends_then_refuses_and_now_deletes(api, kube, tmp_path):
    name = _create(kube, tmp_path)
    api.add_pod("team", name, 0)
    said = stop_trainjob(kube, name)
    assert "suspended" in said and "--type merge" in said
    patch = [r for r in api.requests if r.method == "PATCH"]
    assert len(patch) == 1
    assert patch[0].headers["content-type"] == "application/merge-patch+json"
    assert patch[0].body["spec"] == {"suspend": True}
    assert STOPPED_ANNOTATION in patch[0].body["metadata"]["annotations"]
    assert trainjob_status(kube, name).state == "stopped"
    # the pods are still there (no controller here): waiting for them times out, naming them
    assert len(wait_pods_gone(kube, name, timeout_s=0.0)) == 1
    # the JobSet's Jobs deleting the suspended pods, as the cluster would
    for key in [k for k in api.pods if k[0] == "team"]:
        del api.pods[key]
    assert wait_pods_gone(kube, name, timeout_s=0.0) == []
    with pytest.raises(TrainJobInputError, match="already stopped"):
        stop_trainjob(kube, name)
    stop_trainjob(kube, name, now=True)
    (delete,) = [r for r in api.requests if r.method == "DELETE"]
    assert (
        delete.query.get("propagationPolicy") == ["Foreground"]
        or (delete.body or {}).get("propagationPolicy") == "Foreground"
    )
    assert not api.trainjobs and not api.pods


def test_stop_refuses_a_trainjob_that_ended_and_changes_nothing(api, kube, tmp_path):
    name = _create(kube, tmp_path)
    api.set_condition("team", name, "Complete", "JobsCompleted", "done")
    with pytest.raises(TrainJobInputError, match="completed: nothing to stop"):
        stop_trainjob(kube, name)
    assert not [r for r in api.requests if r.method in ("PATCH", "DELETE")]


# ---- what `mlaunch logs` and `mlaunch stop` run for trainjob/NAME


def test_stop_command_waits_for_the_pods_then_says_stopped(api, kube, tmp_path, capsys):
    from mlaunch.cli.trainjob_ops import trainjob_stop_command

    name = _create(kube, tmp_path)
    api.add_pod("team", name, 0)
    api.add_pod("team", name, 1)

    def controllers(verb, ns, job, obj):  # the JobSet's Jobs delete a suspended job's pods
        if verb == "PATCH" and obj["spec"].get("suspend"):
            for key in [k for k, p in api.pods.items() if k[0] == ns]:
                del api.pods[key]

    api.on_change = controllers
    code = trainjob_stop_command(f"trainjob/{name}", namespace=None, now=False, timeout_s=30)
    out = capsys.readouterr()
    assert code == 0, out.err
    assert f"TrainJob {name} has ended" in out.out
    assert f"trainjob {name} (namespace team): stopped" in out.out
    # a second stop: refused, nothing changed
    patches = len([r for r in api.requests if r.method == "PATCH"])
    code = trainjob_stop_command(f"trainjob/{name}", namespace=None, now=False, timeout_s=30)
    assert code == 2 and "already stopped" in capsys.readouterr().err
    assert len([r for r in api.requests if r.method == "PATCH"]) == patches


def test_stop_command_says_when_the_pods_do_not_go(api, kube, tmp_path, capsys):
    from mlaunch.cli.trainjob_ops import trainjob_stop_command

    name = _create(kube, tmp_path)
    pod = api.add_pod("team", name, 0)
    code = trainjob_stop_command(f"trainjob/{name}", namespace="team", now=False, timeout_s=0)
    err = capsys.readouterr().err
    assert code == 1 and "has not ended" in err and pod in err


def test_logs_command_prints_each_pods_lines(api, kube, tmp_path, capsys):
    from mlaunch.cli.trainjob_ops import trainjob_logs_command

    name = _create(kube, tmp_path)
    api.add_pod("team", name, 0, log="x\n")
    api.add_pod("team", name, 1, log="y\n")
    code = trainjob_logs_command(f"trainjob/{name}", namespace=None, node=None, tail=None,
                                 follow=False)  # fmt: skip
    assert code == 0 and capsys.readouterr().out == "[node 0] x\n[node 1] y\n"
    code = trainjob_logs_command(f"trainjob/{name}", namespace=None, node=None, tail=None,
                                 follow=False, rank=3)  # fmt: skip
    assert code == 2 and "--rank" in capsys.readouterr().err


def test_mlaunch_logs_of_a_trainjob_reads_its_pods(api, kube, tmp_path):
    name = _create(kube, tmp_path)
    api.add_pod("team", name, 0, log="first\nsecond\n")
    env = {"KUBECONFIG": str(api.kubeconfig)}
    out = _mlaunch(tmp_path, "logs", f"trainjob/{name}", "--tail", "1", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "second\n"
    bad = _mlaunch(tmp_path, "logs", f"trainjob/{name}", "--attempt", "1", env=env)
    assert bad.returncode == 2 and "--attempt" in bad.stderr


def test_runs_lists_a_trainjobs_run_directory_without_asking_the_api(api, tmp_path):
    out = _mlaunch(tmp_path, "trainjob", "--image", "img:1", "--otel-run-id", "r1",
                   env={"KUBECONFIG": str(api.kubeconfig)})  # fmt: skip
    assert out.returncode == 0, out.stderr
    asked = len(api.requests)
    listing = _mlaunch(tmp_path, "runs", "--json")
    assert listing.returncode == 0, listing.stderr
    (row,) = json.loads(listing.stdout)
    assert row["state"] == "on kubernetes" and "trainjob/mlaunch-r1" in row["note"]
    assert len(api.requests) == asked


def test_mlaunch_stop_of_a_trainjob_by_its_run_directory(api, tmp_path):
    env = {"KUBECONFIG": str(api.kubeconfig)}
    out = _mlaunch(tmp_path, "trainjob", "--image", "img:1", "--otel-run-id", "s1", env=env)
    assert out.returncode == 0, out.stderr
    name = trainjob_name("s1")
    api.add_pod("team", name, 0)

    def controllers(verb, ns, job, obj):  # the suspended JobSet's pods go, as on a cluster
        if verb == "PATCH" and obj["spec"].get("suspend"):
            api.pods.clear()

    api.on_change = controllers
    stop = _mlaunch(tmp_path, "stop", "runs/s1", "--timeout", "30", env=env)
    assert stop.returncode == 0, stop.stderr
    assert f"trainjob {name} (namespace team): stopped" in stop.stdout
    assert api.trainjobs[("team", name)]["spec"]["suspend"] is True
    again = _mlaunch(tmp_path, "stop", f"trainjob/{name}", env=env)
    assert again.returncode == 2 and "already stopped" in again.stderr
    now = _mlaunch(tmp_path, "stop", f"trainjob/{name}", "--now", env=env)
    assert now.returncode == 0, now.stderr
    assert not api.trainjobs
