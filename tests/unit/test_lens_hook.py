"""The live-capture hook for nemo-lens workers (mlaunch/lens_hook): the watcher's decisions driven
by a test clock against a stand-in for nemo-lens's state module, the ``sitecustomize`` in fresh
interpreters, the launcher's ``PYTHONPATH`` wiring and which ranks of a run can capture.

The real nemo-lens worker under torchrun: tests/integration/test_lens_live_capture.py.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mlaunch
from mlaunch import envcontract as ec
from mlaunch.launcher import capture as launcher_capture
from mlaunch.launcher import plan as lp
from mlaunch.lens_hook import SITE_DIR
from mlaunch.lens_hook import capture as hook
from mlaunch.rundir import layout as lay

CLEAN = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
S = 1_000_000_000
T0 = 1_000 * S  # the test clock's start (ns)
COARSE = frozenset({"job", "step"})


class FakeLens:
    """nemo-lens's state as the watcher sees it: set up or not, exporting or not."""

    def __init__(self, status: bool | None = True, groups: frozenset[str] = COARSE) -> None:
        self.state, self.current, self.history = status, groups, []

    def status(self) -> bool | None:
        return self.state

    def groups(self) -> frozenset[str]:
        return self.current

    def set_groups(self, groups: frozenset[str]) -> None:
        self.current = frozenset(groups)
        self.history.append(self.current)


def _watcher(tmp_path: Path, lens: FakeLens | None = None, rank: int = 1) -> hook.LensCapture:
    return hook.LensCapture(str(tmp_path), "run1", rank, started_ns=T0, lens=lens or FakeLens())


def _request(tmp_path: Path, **body) -> dict:
    body = {"id": "c1", "created_ns": T0 + S, "run_id": "run1", "ranks": None,
            "groups": "all", "seconds": 2, **body}  # fmt: skip
    path = tmp_path / lay.CAPTURE_REQUEST_FILE
    _write(path, json.dumps(body))
    return body


_MTIMES = itertools.count(1)


def _write(path: Path, text: str) -> None:
    """Write the request file with a fresh mtime, whatever the file system's granularity."""
    path.write_text(text)
    t = next(_MTIMES) * S
    os.utime(path, ns=(t, t))


def _ack(tmp_path: Path, rid: str = "c1", rank: int = 1) -> dict:
    return json.loads(lay.lens_capture_ack_file(tmp_path, rank, rid).read_text())


def test_the_hooks_copies_of_the_environment_names_are_the_contracts():
    assert hook.RUN_DIR == ec.RUN_DIR
    assert hook.RUN_ID == ec.RUN_ID
    assert hook.CAPTURE_REQUEST_FILE == lay.CAPTURE_REQUEST_FILE
    assert hook.TELEMETRY_DIR == lay.TELEMETRY_DIR
    assert hook.CAPTURE_ACK_TEMPLATE == lay.LENS_CAPTURE_ACK_TEMPLATE


def test_a_capture_switches_at_its_start_and_back_at_its_end(tmp_path):
    lens = FakeLens()
    w = _watcher(tmp_path, lens)
    _request(tmp_path, start_ns=T0 + 3 * S, seconds=2)
    wait = w.tick(T0 + 2 * S)  # seen a second before its start: waits for it, switches nothing
    assert lens.history == [] and wait == pytest.approx(1.0)
    w.tick(T0 + 3 * S)
    from mlaunch.model.spec import resolve

    captured = frozenset(g.value for g in resolve("all"))
    assert lens.current == captured | COARSE
    ack = _ack(tmp_path)
    assert ack["applied"] is True and ack["ended_ns"] is None and ack["applied_ns"] > 0
    assert ack["groups"] == sorted(captured) and ack["previous"] == sorted(COARSE)
    assert (ack["start_ns"], ack["end_ns"]) == (T0 + 3 * S, T0 + 5 * S)
    assert w.tick(T0 + 4 * S) == pytest.approx(1.0)  # still inside: nothing changes
    assert lens.current == captured | COARSE
    w.tick(T0 + 5 * S)
    assert lens.current == COARSE and len(lens.history) == 2
    ended = _ack(tmp_path)
    assert ended["applied"] is True and ended["ended_ns"] >= ended["applied_ns"]
    assert {k: v for k, v in ended.items() if k != "ended_ns"} == {
        k: v for k, v in ack.items() if k != "ended_ns"
    }


def test_the_captured_groups_are_added_to_the_workers_own(tmp_path):
    lens = FakeLens(groups=frozenset({"job", "checkpoint"}))
    w = _watcher(tmp_path, lens)
    _request(tmp_path, groups="layer,microbatch")
    w.tick(T0 + S)
    assert lens.current == {"job", "checkpoint", "layer", "microbatch"}
    w.tick(T0 + 3 * S)
    assert lens.current == {"job", "checkpoint"}
    ack = _ack(tmp_path)
    assert ack["groups"] == ["checkpoint", "job", "layer", "microbatch"]
    assert ack["previous"] == ["checkpoint", "job"]


def test_a_request_seen_late_still_ends_on_time_and_one_seen_after_its_end_is_not_applied(
    tmp_path,
):
    lens = FakeLens()
    w = _watcher(tmp_path, lens)
    _request(tmp_path, start_ns=T0 + S, seconds=2)
    w.tick(T0 + 2 * S)  # a second late: applied at once
    assert lens.current != COARSE
    w.tick(T0 + 3 * S)
    assert lens.current == COARSE
    lens2 = FakeLens()
    w2 = _watcher(tmp_path / "b", lens2)
    (tmp_path / "b").mkdir()
    _request(tmp_path / "b", start_ns=T0 + S, seconds=2)
    w2.tick(T0 + 4 * S)
    assert lens2.history == []
    ack = _ack(tmp_path / "b")
    assert ack["applied"] is False and "ended" in ack["reason"]


def test_a_rank_without_a_nemo_lens_exporter_answers_why(tmp_path):
    lens = FakeLens(status=False, groups=frozenset())
    w = _watcher(tmp_path, lens)
    _request(tmp_path)
    w.tick(T0 + S)
    assert lens.history == []
    ack = _ack(tmp_path)
    assert ack["applied"] is False and "no exporter" in ack["reason"]


def test_a_process_without_nemo_lens_never_applies_nor_answers(tmp_path):
    lens = FakeLens(status=None)
    w = _watcher(tmp_path, lens)
    _request(tmp_path, seconds=2)
    for t in range(1, 6):
        w.tick(T0 + t * S)
    assert lens.history == [] and w.pending is None
    assert not (tmp_path / lay.TELEMETRY_DIR).exists()


def test_nemo_lens_set_up_after_the_request_still_captures_its_window(tmp_path):
    lens = FakeLens(status=None)
    w = _watcher(tmp_path, lens)
    _request(tmp_path, start_ns=T0 + S, seconds=3)
    w.tick(T0 + S)
    assert lens.history == []
    lens.state = True  # setup_telemetry ran
    w.tick(T0 + 2 * S)
    assert lens.current != COARSE


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ({"seconds": None, "iterations": 5}, "by time"),
        ({"seconds": 0}, "not a number in"),
        ({"seconds": "3"}, "not a number in"),
        ({"seconds": 1e400}, "not a number in"),
        ({"groups": "all,lyaer"}, "lyaer"),
        ({"groups": 7}, "not a span-group spec"),
        ({"start_ns": "soon"}, "start_ns"),
    ],
    ids=["iterations-only", "zero-seconds", "text-seconds", "infinite-seconds", "bad-spec",
         "groups-not-text", "bad-start"],
)  # fmt: skip
def test_a_bad_request_for_this_rank_is_answered_with_its_reason(tmp_path, capsys, body, reason):
    lens = FakeLens()
    w = _watcher(tmp_path, lens)
    _request(tmp_path, **body)
    w.tick(T0 + S)
    assert lens.history == []
    ack = _ack(tmp_path)
    assert ack["applied"] is False and reason in ack["reason"], ack
    assert capsys.readouterr().err.count(hook.LOG_PREFIX) == 1


@pytest.mark.parametrize(
    "body",
    [
        {"created_ns": T0 - 1},  # before this process started: an earlier run or incarnation
        {"run_id": "another-run"},
        {"ranks": [0, 2]},
        {"groups": None, "recorded": True},  # a recorder dump: not a live capture
    ],
    ids=["left-behind", "other-run", "other-ranks", "recorder-dump"],
)
def test_a_request_that_is_not_this_ranks_business_changes_nothing(tmp_path, body):
    if body.get("groups", "") is None:
        body = {k: v for k, v in body.items() if k != "groups"}
        raw = {"id": "c1", "created_ns": T0 + S, "run_id": "run1", "ranks": None, **body}
        _write(tmp_path / lay.CAPTURE_REQUEST_FILE, json.dumps(raw))
    else:
        _request(tmp_path, **body)
    lens = FakeLens()
    w = _watcher(tmp_path, lens)
    for t in range(1, 5):
        w.tick(T0 + t * S)
    assert lens.history == []
    assert not (tmp_path / lay.TELEMETRY_DIR).exists()


def test_a_bad_file_is_logged_once_and_a_good_request_after_it_still_applies(tmp_path, capsys):
    lens = FakeLens()
    w = _watcher(tmp_path, lens)
    for t, text in enumerate(["{not json", "[1, 2]", '{"groups": "all"}'], start=1):
        _write(tmp_path / lay.CAPTURE_REQUEST_FILE, text)
        w.tick(T0 + t * S)
    assert capsys.readouterr().err.count(hook.LOG_PREFIX) == 1
    assert lens.history == []
    _request(tmp_path, created_ns=T0 + 4 * S, start_ns=T0 + 4 * S)
    w.tick(T0 + 4 * S)
    assert lens.current != COARSE and _ack(tmp_path)["applied"] is True


def test_a_second_capture_while_one_runs_is_refused_and_the_first_goes_on(tmp_path):
    lens = FakeLens()
    w = _watcher(tmp_path, lens)
    _request(tmp_path, seconds=5)
    w.tick(T0 + S)
    during = lens.current
    _request(tmp_path, id="c2", created_ns=T0 + 2 * S, groups="layer")
    w.tick(T0 + 2 * S)
    assert lens.current == during
    assert "c1" in _ack(tmp_path, "c2")["reason"]
    w.tick(T0 + 6 * S)
    assert lens.current == COARSE


def test_the_file_is_looked_at_at_most_once_a_second(tmp_path, monkeypatch):
    w = _watcher(tmp_path)
    stats = []
    real = os.stat
    monkeypatch.setattr(hook.os, "stat", lambda p, *a, **k: stats.append(p) or real(p, *a, **k))
    for ms in range(0, 3000, 100):
        w.tick(T0 + ms * 1_000_000)
    assert len(stats) == 3


# ---- the sitecustomize, in fresh interpreters ------------------------------------------------

PROBE = (
    "import json, os, sys, threading;"
    "print(json.dumps({'threads': [t.name for t in threading.enumerate()],"
    " 'user': os.environ.get('USER_SITECUSTOMIZE'), 'nemo': 'nemo.lens' in sys.modules,"
    " 'mlaunch': 'mlaunch' in sys.modules}))"
)


def _probe(
    tmp_path: Path, extra_path: list[str], cwd: Path | None = None, **env: str
) -> tuple[dict, str]:
    full = {
        **CLEAN,
        "PYTHONPATH": os.pathsep.join([str(SITE_DIR), *extra_path]),
        "RANK": "0",
        ec.RUN_DIR: str(tmp_path),
        **env,
    }
    out = subprocess.run(
        [sys.executable, "-c", PROBE], env=full, capture_output=True, text=True, timeout=60,
        cwd=cwd or tmp_path,  # a directory with no folder named mlaunch unless a test makes one
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def test_the_hook_starts_one_watcher_imports_nothing_and_chains_the_users_sitecustomize(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    seen, err = _probe(tmp_path, [str(user)])
    assert seen["threads"].count(hook.THREAD_NAME) == 1
    assert seen["user"] == "ran"  # the sitecustomize it shadows still ran
    assert not seen["nemo"] and not seen["mlaunch"]  # loaded by path; imports neither
    assert err == ""


def test_a_folder_named_mlaunch_where_the_worker_starts_never_shadows_the_installed_one(tmp_path):
    # The folder holding a clone, or an old copy: `python -c`/`-m` put the current directory
    # first on sys.path after site ran. The hook binds the installed mlaunch before that.
    here = tmp_path / "here"
    (here / "mlaunch").mkdir(parents=True)
    (here / "mlaunch" / "__init__.py").write_text('"""an old copy: no __version__"""\n')
    probe = PROBE.replace("'mlaunch' in sys.modules", "__import__('mlaunch').__version__")
    full = {**CLEAN, "PYTHONPATH": str(SITE_DIR), "RANK": "0", ec.RUN_DIR: str(tmp_path)}
    installed = os.environ.get("PYTHONPATH")  # the checkout under test, where one is given
    if installed:
        full["PYTHONPATH"] += os.pathsep + installed
    out = subprocess.run([sys.executable, "-c", probe], env=full, capture_output=True,
                         text=True, timeout=60, cwd=here)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["mlaunch"] == mlaunch.__version__


def test_the_hook_stays_out_of_a_process_that_is_no_rank(tmp_path):
    seen, _ = _probe(tmp_path, [], RANK="")
    assert hook.THREAD_NAME not in seen["threads"]


def test_a_broken_user_sitecustomize_is_reported_as_site_would_and_the_worker_runs(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("raise RuntimeError('user bug')\n")
    seen, err = _probe(tmp_path, [str(user)])
    assert seen["threads"].count(hook.THREAD_NAME) == 1
    assert "Error in sitecustomize" in err and "user bug" in err


def test_the_hook_resolves_a_spec_in_an_interpreter_without_mlaunch(tmp_path):
    # A nemo-lens worker's interpreter has no mlaunch (-S: no site-packages, so no editable
    # install either): the resolver comes from the mlaunch next to the hook's file.
    code = (
        "import importlib.util as u, sys;"
        "assert u.find_spec('mlaunch') is None;"
        f"spec = u.spec_from_file_location('h', {str(Path(hook.__file__))!r});"
        "h = u.module_from_spec(spec); spec.loader.exec_module(h);"
        "print(','.join(sorted(h.resolve_groups('per_step,-communication'))))"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    from mlaunch.model.spec import resolve

    expected = sorted(g.value for g in resolve("per_step") if g.value != "communication")
    assert out.stdout.strip() == ",".join(expected)


# ---- the launcher's side ---------------------------------------------------------------------


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "pretrain_gpt.py"
    path.write_text("")
    return path


def _plan(tmp_path: Path, flags: dict, env: dict | None = None):
    return lp.build_plan(
        flags={"launch.device": "cpu", "launch.nproc_per_node": 2, **flags},
        environ={**CLEAN, **(env or {})},
        cwd=tmp_path,
    )


def test_script_workers_that_trace_get_the_hook_first_on_their_pythonpath(tmp_path, script):
    p = _plan(tmp_path, {"launch.script": str(script), "telemetry.enabled": True},
              {"PYTHONPATH": "/opt/mine"})  # fmt: skip
    assert p.worker_env["PYTHONPATH"] == os.pathsep.join([str(SITE_DIR), "/opt/mine"])
    assert p.child_env["PYTHONPATH"] == p.worker_env["PYTHONPATH"]
    bare = _plan(tmp_path, {"launch.script": str(script), "telemetry.enabled": True})
    assert bare.worker_env["PYTHONPATH"] == str(SITE_DIR)


@pytest.mark.parametrize(
    "flags",
    [
        {"telemetry.enabled": True},  # mlaunch's own trainer watches requests itself
        {"launch.script": "SCRIPT", "telemetry.enabled": False},
        {"launch.script": "SCRIPT", "telemetry.enabled": True, "telemetry.traces_enabled": False},
    ],
    ids=["trainer", "telemetry-off", "traces-off"],
)
def test_no_hook_where_nothing_could_be_captured(tmp_path, script, flags):
    flags = {k: (str(script) if v == "SCRIPT" else v) for k, v in flags.items()}
    p = _plan(tmp_path, flags, {"PYTHONPATH": "/opt/mine"})
    assert "PYTHONPATH" not in p.worker_env
    assert p.child_env["PYTHONPATH"] == "/opt/mine"


def _resolved(tmp_path: Path, flags: dict) -> Path:
    p = _plan(tmp_path, flags)
    p.run_dir.mkdir(parents=True)
    (p.run_dir / lay.RESOLVED_JSON_FILE).write_text(p.resolved_json_text())
    return p.run_dir


def test_lens_capture_ranks_are_the_exporting_ranks_and_the_others_say_why(tmp_path, script):
    run = _resolved(tmp_path, {"launch.script": str(script), "telemetry.enabled": True,
                               "telemetry.export_strategy": "single_rank"})  # fmt: skip
    ranks, why = launcher_capture.lens_capture_ranks(run)
    assert ranks == [1] and set(why) == {0}  # single_rank: the last rank
    assert "single_rank" in why[0] and "all_ranks" in why[0]


def test_lens_capture_ranks_with_every_rank_exporting_or_telemetry_off(tmp_path, script):
    run = _resolved(
        tmp_path / "a",
        {"launch.script": str(script), "telemetry.enabled": True,
         "telemetry.export_strategy": "all_ranks"},
    )  # fmt: skip
    assert launcher_capture.lens_capture_ranks(run) == ([0, 1], {})
    run = _resolved(tmp_path / "b", {"launch.script": str(script), "telemetry.enabled": False})
    ranks, why = launcher_capture.lens_capture_ranks(run)
    assert ranks == [] and set(why) == {0, 1} and "telemetry is off" in why[0]
    assert launcher_capture.lens_capture_ranks(tmp_path / "nowhere") == ([], {})


def test_the_start_lead_leaves_every_rank_a_poll_to_read_the_request():
    from mlaunch.lens_hook import START_LEAD_S

    assert START_LEAD_S > hook.POLL_S
