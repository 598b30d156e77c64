"""``mlaunch sbatch`` and ``mlaunch status`` on a real 2-node SLURM cluster (this machine).

Each job runs the tiny built-in trainer on CPU, one worker per node, so the world (2 ranks) spans
both nodes and the rendezvous goes through node ``n1`` as on a real cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support.trainer_runs import IDLE_PAUSE_S

# One cluster per session fixture: under pytest-xdist (`-n 2 --dist loadgroup`) every SLURM test
# runs on one worker, so the machine never has two test clusters (and two /etc/hosts lines).
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.xdist_group("slurm")]

ROOT = Path(__file__).resolve().parents[2]
#: A whole job must end within this (start-up of torch on both nodes dominates).
JOB_TIMEOUT_S = 240.0
#: The tiny trainer, one worker per node: a 2-rank world across the two nodes.
SMALL = ["--nodes", "2", "--nproc-per-node", "1", "--log-interval", "1"]


def _env(cluster, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in cluster.env.items()
        if not k.startswith(("MEGATRON_OTEL_", "NEMO_LENS_", "OTEL_", "MLAUNCH_TEST_", "SLURM_JOB"))
    }
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def mlaunch(cluster, cwd: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlaunch", *args], cwd=cwd, env=_env(cluster, **extra),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def submit(cluster, cwd: Path, *args: str, **extra: str) -> tuple[str, Path]:
    out = mlaunch(cluster, cwd, "sbatch", *SMALL, *args, **extra)
    assert out.returncode == 0, out.stdout + out.stderr
    job_id = out.stdout.split("submitted job ", 1)[1].split(":", 1)[0]
    run_dir = cwd / "runs" / job_id
    assert (run_dir / "job.sbatch").is_file()
    return job_id, run_dir


def status(cluster, cwd: Path, target: str) -> dict:
    out = mlaunch(cluster, cwd, "status", target, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def status_text(cluster, cwd: Path, target: str) -> str:
    out = mlaunch(cluster, cwd, "status", target)
    assert out.returncode == 0, out.stderr
    return out.stdout


def wait_until(predicate, what: str, cluster, timeout: float = JOB_TIMEOUT_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}\n{cluster.logs()}")


def slurm_state(cluster, job_id: str) -> str:
    out = cluster.run("scontrol", "show", "job", "-o", job_id, check=False)
    for word in out.stdout.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return ""


#: The states of a job that has ended (this incarnation, at least).
FINISHED = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED"})


def wait_done(cluster, job_id: str) -> str:
    return wait_until(
        lambda: (s := slurm_state(cluster, job_id)) in FINISHED and s, f"job {job_id}", cluster
    )


def progress_iteration(run_dir: Path) -> int:
    try:
        lines = (run_dir / "progress.jsonl").read_text().splitlines()
    except OSError:
        return 0
    its = [json.loads(x).get("iteration", 0) for x in lines if x.strip() and '"loss"' in x]
    return max(its, default=0)


def resources(run_dir: Path) -> list[dict[str, str]]:
    """The resource attributes of every exported trace batch (every rank, every incarnation)."""
    out = []
    for path in sorted((run_dir / "telemetry").glob("traces-rank*.jsonl")):
        for line in path.read_text().splitlines():
            if not line.strip():
                continue
            for rs in json.loads(line).get("resourceSpans", []):
                attrs = rs.get("resource", {}).get("attributes", [])
                out.append({a["key"]: next(iter(a["value"].values())) for a in attrs})
    return out


def show(title: str, text: str) -> None:
    """Shown with ``pytest -s``: the outputs the issue's closing note quotes."""
    print(f"\n===== {title}\n{text}")


def test_two_node_job_runs_to_the_end_into_one_run_directory(slurm_cluster, tmp_path):
    job_id, run_dir = submit(slurm_cluster, tmp_path, "--train-iters", "30", "--time", "10")
    show("job.sbatch", (run_dir / "job.sbatch").read_text())
    wait_until(lambda: progress_iteration(run_dir) >= 2, "progress", slurm_cluster)
    running = status(slurm_cluster, tmp_path, job_id)
    show("mlaunch status (running)", status_text(slurm_cluster, tmp_path, job_id))
    assert running["state"] in ("running", "completed")
    assert wait_done(slurm_cluster, job_id) == "COMPLETED"
    after = status(slurm_cluster, tmp_path, str(run_dir))
    show("mlaunch status (after)", status_text(slurm_cluster, tmp_path, str(run_dir)))
    assert after["state"] == "completed", after
    assert after["progress"]["iteration"] == 30
    assert [n["node"] for n in after["nodes"]] == [0, 1]
    # Both nodes' logs and both ranks' spans in the one run directory.
    assert (run_dir / "logs" / "node0").is_dir() and (run_dir / "logs" / "node1").is_dir()
    attrs = resources(run_dir)
    assert {a.get("service.instance.id") for a in attrs} == {f"{job_id}-rank0", f"{job_id}-rank1"}
    assert {a.get("slurm.job.id") for a in attrs} == {job_id}
    # One progress view: node 1 points to its log instead of printing its own.
    out = (run_dir / f"slurm-{job_id}.out").read_text()
    assert "node 1 of 2: the progress view is node 0's" in out
    assert out.count("iteration 30/30") == 1
    assert "iteration" in (run_dir / "logs" / "node1" / "launcher.log").read_text()


#: A script whose rank prints 200 numbered lines (after a second: the launcher reads the
#: workers' ranks while they run) on stdout and one on stderr.
PRINTER = """\
import os, sys, time
time.sleep(1)
rank = int(os.environ["RANK"])
for i in range(200):
    print(f"r{rank}:{i:04d}:" + "x" * (i % 61) + ":end")
print(f"r{rank}:err::end", file=sys.stderr)
"""


def test_each_nodes_launcher_shows_its_own_ranks_in_the_job_output(slurm_cluster, tmp_path):
    """A --script job on two nodes: each node's launcher writes its own worker's lines, each
    whole and under the rank that worker has, into the job's one output file."""
    (tmp_path / "printer.py").write_text(PRINTER)
    job_id, run_dir = submit(
        slurm_cluster, tmp_path, "--script", str(tmp_path / "printer.py"), "--time", "10"
    )
    assert wait_done(slurm_cluster, job_id) == "COMPLETED"
    out = (run_dir / f"slurm-{job_id}.out").read_text()
    show("slurm output", out)
    seen: dict[int, list[str]] = {0: [], 1: []}
    for line in out.splitlines():
        if re.search(r"r\d:(\d{4}|err):", line):
            m = re.fullmatch(r"\[rank (\d)\] r(\d):(\d{4}|err):x*:end", line)
            assert m is not None, f"a broken line: {line!r}"
            assert m.group(1) == m.group(2), f"a line under another rank: {line!r}"
            seen[int(m.group(1))].append(m.group(3))
    for rank in (0, 1):
        assert sorted(seen[rank]) == sorted([f"{i:04d}" for i in range(200)] + ["err"])


def test_usr1_then_requeue_resumes_from_the_checkpoint_as_a_second_incarnation(
    slurm_cluster, tmp_path
):
    job_id, run_dir = submit(slurm_cluster, tmp_path, "--train-iters", "100", "--time", "10")
    wait_until(lambda: progress_iteration(run_dir) >= 3, "progress", slurm_cluster)
    slurm_cluster.run("scancel", "--signal=USR1", job_id)
    wait_done(slurm_cluster, job_id)
    stopped_at = progress_iteration(run_dir)
    first = status(slurm_cluster, tmp_path, job_id)
    show("mlaunch status (after USR1)", status_text(slurm_cluster, tmp_path, job_id))
    assert first["state"] == "preempted", first
    assert 3 <= stopped_at < 100
    assert list((run_dir / "checkpoints").glob("iter_*")), "the graceful stop saved nothing"

    slurm_cluster.run("scontrol", "requeue", job_id)
    # The controller may still report the first incarnation's end for a moment: wait until the
    # job is queued again, or wait_done below would read that stale state.
    wait_until(lambda: slurm_state(slurm_cluster, job_id) not in FINISHED, "requeue", slurm_cluster)
    # `mlaunch runs` asks SLURM's queue once: the job waiting again is queued, not the
    # preempted its run directory alone would say.
    listed = mlaunch(slurm_cluster, tmp_path, "runs", "--json")
    assert listed.returncode == 0, listed.stdout + listed.stderr
    (row,) = [r for r in json.loads(listed.stdout) if r["job_id"] == job_id]
    assert row["state"] == "queued", row
    # SLURM holds a requeued job for about two minutes before it may start again; skip most of
    # that, but not all: slurmd revokes the first incarnation's job credential with one-second
    # resolution, and a start within that second is killed as "Job credential revoked" (seen
    # once in CI). Two seconds is past it.
    slurm_cluster.run("scontrol", "update", f"jobid={job_id}", "starttime=now+2")
    assert wait_done(slurm_cluster, job_id) == "COMPLETED"
    final = status(slurm_cluster, tmp_path, job_id)
    show("mlaunch status (after requeue)", status_text(slurm_cluster, tmp_path, job_id))
    assert final["state"] == "completed" and final["incarnation"] == 2, final
    assert final["progress"]["iteration"] == 100
    # Resumed, not restarted: the records run 1..N, then N+1..100, each iteration once.
    its = [json.loads(x)["iteration"] for x in (run_dir / "progress.jsonl").read_text().splitlines()
           if '"loss"' in x and "eval_loss" not in x]  # fmt: skip
    assert its == list(range(1, 101)), its
    logs = "".join(p.read_text() for p in (run_dir / "logs").rglob("std*.log"))
    assert f"resuming from checkpoint {run_dir}/checkpoints/iter_{stopped_at:07d}" in logs

    attrs = resources(run_dir)
    # Two incarnations: SLURM_RESTART_COUNT is unset in the first, 1 in the second.
    assert {a.get("slurm.restart_count") for a in attrs} == {None, "1"}
    runs = {a.get("nemo.lens.run_uuid") for a in attrs}
    jobs = {a.get("nemo.lens.job_uuid") for a in attrs}
    assert len(runs) == 2 and len(jobs) == 1, (runs, jobs)
    goodput = mlaunch(slurm_cluster, tmp_path, "trace", "goodput", str(run_dir))
    show("mlaunch trace goodput", goodput.stdout + goodput.stderr)
    assert goodput.returncode == 0
    # The requeue is restart cost: the gap between the two launcher incarnations and the second
    # one's start-up before its workers run, on every rank.
    split = json.loads(
        mlaunch(slurm_cluster, tmp_path, "trace", "goodput", str(run_dir), "--json").stdout
    )
    for rank in split["ranks"]:
        assert rank["wall_source"] == "mlaunch.job", rank
        assert rank["restart_split_ms"]["requeue"] > 100, rank


def test_the_time_limit_warning_saves_and_requeues_the_job_itself(slurm_cluster, tmp_path):
    # --time 3 with a 90 s grace: SLURM warns the batch shell (USR1) 90 s before the limit, but
    # "may send it up to 60 s earlier" (sbatch(1), its timer's resolution): 30 s in at the
    # earliest, after training has started even on a loaded machine (with --time 1 or 2 the
    # warning could come in the first seconds, before any iteration, leaving nothing to save),
    # and long before the 50000 iterations are done.
    # The job only has to be training when the warning comes: each iteration pauses, so for that
    # minute or so it idles instead of taking the machine's cores.
    job_id, run_dir = submit(
        slurm_cluster, tmp_path, "--train-iters", "50000", "--time", "3", "--signal-grace", "90",
        MLAUNCH_TEST_ITERATION_PAUSE=IDLE_PAUSE_S,
    )  # fmt: skip
    # Restarts=1 shows while the first incarnation is still COMPLETING (its epilog and step
    # clean-up): wait until the requeue has settled before reading the state.
    info = wait_until(
        lambda: (
            "Restarts=1" in (o := slurm_cluster.run("scontrol", "show", "job", job_id).stdout)
            and "JobState=COMPLETING" not in o
            and o
        ),
        "the job to requeue itself",
        slurm_cluster,
    )
    slurm_cluster.run("scancel", job_id)  # the test ends here; the requeued job would resume
    settled = ("JobState=PENDING", "JobState=REQUEUED", "JobState=CONFIGURING", "JobState=RUNNING")
    assert any(s in info for s in settled), info
    # The batch shell's last words reach the output file as it exits: give them a moment.
    requeued = f"mlaunch: requeueing job {job_id}"
    out = wait_until(
        lambda: requeued in (o := (run_dir / f"slurm-{job_id}.out").read_text()) and o,
        "the requeue message", slurm_cluster, timeout=30,
    )  # fmt: skip
    assert "mlaunch: USR1: stopping the workers" in out
    stopped_at = progress_iteration(run_dir)
    assert 1 <= stopped_at < 50000
    assert (run_dir / "checkpoints" / f"iter_{stopped_at:07d}").is_dir()


def test_a_failing_rank_on_node_1_shows_in_status_with_its_exception(slurm_cluster, tmp_path):
    job_id, run_dir = submit(
        slurm_cluster, tmp_path, "--train-iters", "30",
        MLAUNCH_TEST_FAIL_AT_ITERATION="3", MLAUNCH_TEST_FAIL_RANK="1",
    )  # fmt: skip
    assert wait_done(slurm_cluster, job_id) == "FAILED"
    st = status(slurm_cluster, tmp_path, job_id)
    show("mlaunch status (failed rank)", status_text(slurm_cluster, tmp_path, job_id))
    assert st["state"] == "failed", st
    first = st["failures"][0]  # the first to fail: the root cause, before its peer's
    assert (first["rank"], first["exception_type"]) == (1, "RuntimeError")
    assert "injected failure at iteration 3 on rank 1" in first["message"]
    # torchrun numbers the nodes by rendezvous order: the node is where its log is.
    assert first["node"] in (0, 1) and f"/logs/node{first['node']}/" in first["log"]
    assert "injected failure" in Path(first["log"]).read_text()


def test_a_bad_configuration_is_refused_and_nothing_is_submitted(slurm_cluster, tmp_path):
    before = slurm_cluster.queue()
    for args, env, fields in (
        # every problem at once: the SLURM options' and the settings'
        (["--num-layers", "0", "--signal-grace", "0"], {}, ("--num-layers", "--signal-grace")),
        ([], {"MEGATRON_OTEL_SPAN_GRUPS": "per_step"}, ("MEGATRON_OTEL_SPAN_GRUPS",)),
        (["--time", "1:00:00", "--signal-grace", "7200"], {}, ("--signal-grace",)),
    ):
        out = mlaunch(slurm_cluster, tmp_path, "sbatch", *SMALL, *args, **env)
        assert out.returncode == 2, out.stdout + out.stderr
        lines = out.stderr.splitlines()
        assert all(any(ln.startswith(f + ":") for ln in lines) for f in fields), out.stderr
        assert "Traceback" not in out.stderr
    assert slurm_cluster.queue() == before
    assert not (tmp_path / "runs").exists()


#: Every worker says who and where it is, on stdout and on stderr.
HELLO = """
import os, socket, sys
rank, node = os.environ["RANK"], os.environ.get("SLURM_NODEID")
print(f"hello from rank {rank} on node {node}", flush=True)
print(f"stderr of rank {rank}", file=sys.stderr, flush=True)
"""


def test_logs_of_a_job_show_both_nodes_workers(slurm_cluster, tmp_path):
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    job_id, run_dir = submit(slurm_cluster, tmp_path, "--script", str(script), "--no-megatron-args")
    assert wait_done(slurm_cluster, job_id) == "COMPLETED"
    out = mlaunch(slurm_cluster, tmp_path, "logs", job_id)
    show("mlaunch logs JOB_ID", out.stdout + out.stderr)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    # Each rank's own lines under its rank, whichever node the rendezvous gave it.
    for rank in (0, 1):
        (hello,) = [ln for ln in lines if ln.startswith(f"[rank {rank}] hello from rank {rank} ")]
        assert f"[rank {rank}] stderr of rank {rank}" in lines
    nodes = {ln.rsplit(" ", 1)[1] for ln in lines if " hello from rank " in ln}
    assert nodes == {"0", "1"}, lines  # both nodes' logs, from the one run directory
    assert out.stderr.strip() == "== attempt 0 (launch 1 of 1, torchrun restart 0) =="
    one = mlaunch(slurm_cluster, tmp_path, "logs", str(run_dir), "--node", "1")
    assert one.returncode == 0 and one.stdout.splitlines()[0].endswith("on node 1"), one.stdout


def test_mlaunch_stop_sends_usr1_saves_and_the_job_is_not_requeued(slurm_cluster, tmp_path):
    # The job would requeue itself after a USR1 (#SBATCH --requeue, as the time-limit test shows):
    # a stop the user asked for must not. Each iteration idles while the test drives the job.
    job_id, run_dir = submit(
        slurm_cluster, tmp_path, "--train-iters", "50000", "--time", "10",
        MLAUNCH_TEST_ITERATION_PAUSE=IDLE_PAUSE_S,
    )  # fmt: skip
    wait_until(lambda: progress_iteration(run_dir) >= 3, "progress", slurm_cluster)
    out = mlaunch(slurm_cluster, tmp_path, "stop", job_id, "--timeout", "100")
    show("mlaunch stop", out.stdout + out.stderr)
    assert out.returncode == 0, out.stdout + out.stderr + slurm_cluster.logs()
    assert f"USR1 to its batch script (scancel --signal=USR1 --batch {job_id})" in out.stdout
    # Ended when stop returned, and not requeued: no restart, no incarnation queued again.
    info = slurm_cluster.run("scontrol", "show", "job", "-o", job_id).stdout
    assert "Restarts=0" in info and slurm_state(slurm_cluster, job_id) in FINISHED, info
    text = (run_dir / f"slurm-{job_id}.out").read_text()
    assert "mlaunch: USR1: stopping the workers" in text
    assert f"mlaunch: not requeueing job {job_id}: stopped by mlaunch stop" in text
    assert "requeueing job" not in text.replace("not requeueing job", "")
    stopped_at = progress_iteration(run_dir)
    assert 3 <= stopped_at < 50000
    assert (run_dir / "checkpoints" / f"iter_{stopped_at:07d}").is_dir()
    st = status(slurm_cluster, tmp_path, job_id)
    show("mlaunch status (after stop)", status_text(slurm_cluster, tmp_path, job_id))
    assert st["state"] == "stopped" and st["resume_from"] == stopped_at, st
    assert st["stop"]["job_id"] == job_id and st["incarnation"] == 1
