"""What ``mlaunch trace`` does with hostile outputs and inputs.

Writing outputs never destroys what is there (the rule: mlaunch/outputs.py,
docs/trace.md "Output files"): a FIFO or device is written in place, a symlink's target is
written, an input trace file or a file of the run directory is refused, a failed write (a full
disk) leaves neither a temporary file nor a changed target, missing directories are created by
``export`` and ``report`` alike.

Traces of crashed and live runs: a torn last line is skipped with a warning by every
command; a run still being written exports; malformed spans never give a traceback, with or
without ``--skip-invalid``, and every command skips the same ones; a FIFO or directory where a
trace file is expected is refused without hanging; an exported Chrome trace fed back says what it
is.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from support.synthetic_traces import TraceBuilder, request_line
from support.trace_cli import invoke_trace as _invoke
from support.trace_cli import user_error

from mlaunch.model.spans import SpanName

REPO = Path(__file__).resolve().parents[2]


def _refused(result, *needles: str) -> str:
    """Exit 2 with one ``error: FIELD PATH: message; fix: ...`` line and no traceback."""
    text = user_error(result, *needles)
    lines = [ln for ln in text.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: --output ") and "fix:" in lines[0], text
    return text


# ---- writing outputs -----------------------------------------------------------------------


def test_export_to_a_fifo_writes_through_it_and_keeps_it_a_fifo(
    run_dir: Path, tmp_path: Path
) -> None:
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()), daemon=True)
    reader.start()
    r = _invoke("export", run_dir, "-o", fifo)
    if r.exit_code != 0:  # unblock the reader if nothing opened the FIFO for writing
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
    reader.join(10)
    assert r.exit_code == 0, r.output
    assert stat.S_ISFIFO(os.stat(fifo).st_mode), "the FIFO was replaced by a regular file"
    assert json.loads(got[0])["traceEvents"]
    assert not list(tmp_path.glob(".pipe*"))


def test_export_to_stdout_through_a_link_is_written_in_place(run_dir: Path, tmp_path: Path) -> None:
    # A link of our own to the process's stdout, like /dev/stdout: code that renames over its
    # target (what this test guards against) must never be pointed at the real /dev/stdout,
    # since as root it would replace the machine's /dev/stdout with a regular file.
    link = tmp_path / "stdout"
    link.symlink_to("/proc/self/fd/1")
    proc = subprocess.run(
        [sys.executable, "-m", "mlaunch", "trace", "export", str(run_dir), "-o", str(link)],
        capture_output=True, cwd=tmp_path, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = proc.stdout.decode().split("\nwrote ")[0]
    assert json.loads(doc)["traceEvents"]
    assert link.is_symlink() and os.readlink(link) == "/proc/self/fd/1"


def test_a_symlink_stays_a_link_and_its_target_is_written(run_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    r = _invoke("export", run_dir, "-o", link)
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["traceEvents"]


@pytest.mark.parametrize("cmd", ["export", "report"])
def test_an_input_trace_file_is_refused(run_dir: Path, cmd: str) -> None:
    f = run_dir / "telemetry" / "traces-rank0.jsonl"
    before = f.read_bytes()
    _refused(_invoke(cmd, run_dir, "-o", f), str(f), "input trace file")
    _refused(_invoke(cmd, f, "-o", f), "input trace file")
    # also through a symlink to it
    link = run_dir.parent / "sneaky.json"
    link.symlink_to(f)
    _refused(_invoke(cmd, run_dir, "-o", link), "input trace file")
    assert f.read_bytes() == before


@pytest.mark.parametrize("cmd", ["export", "report"])
def test_a_file_of_the_run_directory_is_refused_but_earlier_outputs_are_replaced(
    run_dir: Path, cmd: str
) -> None:
    progress = run_dir / "progress.jsonl"
    progress.write_text('{"iteration": 1}\n')
    _refused(_invoke(cmd, run_dir, "-o", progress), "run directory", "progress.jsonl")
    _refused(_invoke(cmd, run_dir / "telemetry", "-o", progress), "run directory")
    assert progress.read_text() == '{"iteration": 1}\n'
    out = run_dir / f"mine.{cmd}"
    for _ in range(2):  # a new file in the run directory, then the command's own earlier output
        r = _invoke(cmd, run_dir, "-o", out)
        assert r.exit_code == 0, r.output


@pytest.mark.parametrize("source", ["store", "json"])
def test_full_disk_leaves_no_temporary_file_and_the_old_output(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str
) -> None:
    from mlaunch.trace import chrome

    out = tmp_path / "trace.json"
    out.write_text("previous export")

    def full_store(self: Any, *_: Any) -> None:  # a part's events, half written
        self.out.write('{"displayTimeUnit":"ms"')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    # every export reads a span store (chrome.export_chrome); --skip-invalid, a store of its own
    monkeypatch.setattr(chrome._Pass2, "part", full_store)
    extra = ["--skip-invalid"] if source == "json" else []
    r = _invoke("export", run_dir, "-o", out, *extra)
    assert r.exit_code == 2 and "No space left on device" in r.output, r.output
    assert "Traceback" not in r.output
    assert out.read_text() == "previous export"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "trace.json"]


def test_full_disk_during_report(
    run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlaunch import outputs

    class Full:
        def __init__(self, f: Any) -> None:
            self.f = f

        def write(self, text: str) -> int:
            self.f.write(text[:100])
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            self.f.close()

    real_open = open
    monkeypatch.setattr(outputs, "open", lambda *a, **k: Full(real_open(*a, **k)), raising=False)
    out = tmp_path / "out" / "r.html"
    r = _invoke("report", run_dir, "-o", out)
    assert r.exit_code == 2 and "No space left on device" in r.output, r.output
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("cmd", ["export", "report"])
def test_missing_output_directories_are_created_by_every_command(
    run_dir: Path, tmp_path: Path, cmd: str
) -> None:
    out = tmp_path / "new" / "deeper" / "out.file"
    r = _invoke(cmd, run_dir, "-o", out)
    assert r.exit_code == 0, r.output
    assert out.is_file()


def test_an_output_directory_is_refused_in_one_line(run_dir: Path) -> None:
    _refused(_invoke("export", run_dir, "-o", run_dir), "is a directory")
    _refused(_invoke("report", run_dir, "-o", run_dir), "is a directory")


def test_output_help_states_the_rule() -> None:
    for cmd in ("export", "report"):
        r = _invoke(cmd, "--help")
        flat = " ".join(r.output.split())
        for words in ("replaced atomically", "symlink", "FIFO", "refused"):
            assert words in flat, (cmd, words)


# ---- crashed and live runs ------------------------------------------------------------------


@pytest.mark.parametrize("cmd", ["summary", "goodput", "export", "report"])
def test_a_torn_last_line_is_skipped_with_a_warning_by_every_command(
    run_dir: Path, tmp_path: Path, cmd: str
) -> None:
    f = run_dir / "telemetry" / "traces-rank0.jsonl"
    text = f.read_text()
    f.write_text(text + text.splitlines()[0][:57])  # a writer killed mid-line
    args = ("-o", tmp_path / "out") if cmd in ("export", "report") else ()
    r = _invoke(cmd, run_dir, *args)
    assert r.exit_code == 0, r.output
    assert "torn last line" in r.output


def test_a_torn_line_glued_to_a_restarted_writers_line_keeps_the_restart(run_dir: Path) -> None:
    f = run_dir / "telemetry" / "traces-rank0.jsonl"
    lines = f.read_text().splitlines()
    # the crash tore line 1's copy; the restart appended its own line (append mode) right after
    f.write_text("\n".join([*lines[:-1], lines[0][:57] + lines[-1]]) + "\n")
    r = _invoke("summary", run_dir, "--json")
    assert r.exit_code == 0, r.output
    assert f"skipped 1 torn last line(s) (a crashed or still-running writer): {f}:{len(lines)}" in (
        r.output
    )
    assert json.loads(r.stdout)["read"]["spans"] == 21  # every span, the restart's included


def test_other_malformed_lines_still_need_skip_invalid(run_dir: Path) -> None:
    f = run_dir / "telemetry" / "traces-rank1.jsonl"
    lines = f.read_text().splitlines()
    f.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    r = _invoke("summary", run_dir)
    assert r.exit_code == 2 and f"{f}:2:" in r.output and "--skip-invalid" in r.output
    r = _invoke("summary", run_dir, "--skip-invalid")
    assert r.exit_code == 0 and f"skipped {f}:2: not valid JSON" in r.output


def _big_run(run_dir: Path) -> Path:
    b = TraceBuilder(world_size=1)
    for i in range(3000):
        b.span(0, SpanName.ITERATION, i * 10, i * 10 + 9, attrs={"iteration": i})
    return b.write_run_dir(run_dir, batch=4)


def test_export_of_a_run_still_writing_never_fails(tmp_path: Path) -> None:
    run_dir = _big_run(tmp_path / "run")
    f = run_dir / "telemetry" / "traces-rank0.jsonl"
    line = f.read_text().splitlines()[-1] + "\n"
    stop = threading.Event()

    def writer() -> None:  # appends in two halves, like a writer caught mid-line
        # Bounded and paced (about 2 MB/s, 20 MB at most): an unpaced writer grows the file faster
        # than an export reads it, and the test would fill the disk.
        with open(f, "a") as fh:
            for _ in range(20_000 // 2):
                if stop.is_set():
                    return
                fh.write(line[:40])
                fh.flush()
                time.sleep(0.0005)
                fh.write(line[40:])
                fh.flush()
                time.sleep(0.0005)

    t = threading.Thread(target=writer, daemon=True)
    t.start()
    try:
        results = [_invoke("export", run_dir, "-o", tmp_path / f"t{i}.json") for i in range(6)]
    finally:
        stop.set()
        t.join(10)
    for r in results:
        assert r.exit_code == 0, r.output
    for i in range(6):
        assert json.loads((tmp_path / f"t{i}.json").read_text())["traceEvents"]


def _span_line(mutate: Any) -> str:
    b = TraceBuilder(world_size=1)
    b.span(0, SpanName.ITERATION, 0, 5, attrs={"iteration": 1})
    b.span(0, SpanName.ITERATION, 10, 15, attrs={"iteration": 2})
    bad = b.span(0, SpanName.ITERATION, 20, 30, attrs={"iteration": 3})
    spans = b.spans[0]
    victim = next(s for s in spans if s["spanId"] == bad.span_id)
    mutate(victim)
    return request_line(b.resource(0), spans)


#: Malformed spans the readers once crashed on or disagreed about. Each is refused (exit 2,
#: file and line named) without --skip-invalid and dropped with it; "end before start" is kept
#: as an instant span by every command.
MALFORMED: dict[str, Any] = {
    "name-is-a-number": lambda s: s.update(name=42),
    "name-missing": lambda s: s.pop("name"),
    "attributes-a-string": lambda s: s.update(attributes="iteration=3"),
    "attributes-an-object": lambda s: s.update(attributes={"iteration": 3}),
    "start-missing": lambda s: s.pop("startTimeUnixNano"),
    "end-not-a-number": lambda s: s.update(endTimeUnixNano="soon"),
    "start-a-boolean": lambda s: s.update(startTimeUnixNano=True),
    "events-an-object": lambda s: s.update(events={"name": "x"}),
    "event-without-time": lambda s: s.update(events=[{"name": "x"}]),
    "links-of-strings": lambda s: s.update(links=["abc"]),
    "span-id-a-number": lambda s: s.update(spanId=7),
    "span-is-a-list": lambda s: (s.clear(), s.update(BAD=1)),
}
#: Malformed parts every reader tolerates (the span is kept; the bad part decodes to nothing).
TOLERATED: dict[str, Any] = {
    "end-before-start": lambda s: s.update(endTimeUnixNano=str(int(s["startTimeUnixNano"]) - 5)),
    "attribute-not-an-object": lambda s: s["attributes"].append("junk"),
    "attribute-value-a-string": lambda s: s["attributes"].append({"key": "k", "value": "v"}),
    "int-value-not-a-number": lambda s: s["attributes"].append(
        {"key": "k", "value": {"intValue": "abc"}}
    ),
    "iteration-not-a-number": lambda s: s["attributes"].__setitem__(
        0, {"key": "megatron.iteration", "value": {"stringValue": "three"}}
    ),
    "status-a-string": lambda s: s.update(status="ERROR"),
    "span-id-not-hex": lambda s: s.update(spanId="zzzz"),
}
_CMDS = ("summary", "goodput", "export", "report")


def _run_all(f: Path, tmp_path: Path, *extra: str) -> dict[str, Any]:
    out = {}
    for cmd in _CMDS:
        args = ("-o", tmp_path / f"out.{cmd}") if cmd in ("export", "report") else ()
        out[cmd] = _invoke(cmd, f, *args, *extra)
        assert "Traceback" not in out[cmd].output, out[cmd].output
        assert out[cmd].exception is None or isinstance(out[cmd].exception, SystemExit), repr(
            out[cmd].exception
        )
    return out


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_a_malformed_span_is_refused_or_skipped_alike_by_every_command(
    tmp_path: Path, case: str
) -> None:
    f = tmp_path / "traces-rank0.jsonl"
    f.write_text(_span_line(MALFORMED[case]) + "\n")
    for cmd, r in _run_all(f, tmp_path).items():
        assert r.exit_code == 2, (cmd, r.output)
        assert f"{f}:1:" in r.output and "malformed span" in r.output, (cmd, r.output)
    runs = _run_all(f, tmp_path, "--skip-invalid")
    for cmd, r in runs.items():
        assert r.exit_code == 0, (cmd, r.output)
    s = json.loads(_invoke("summary", f, "--skip-invalid", "--json").stdout)
    step = next(x for x in s["spans"] if x["name"] == SpanName.ITERATION)
    assert step["count"] == 2
    # the same warning, naming the same span, from every command
    warnings = {
        cmd: [ln for ln in r.output.splitlines() if ln.startswith("warning: skipped")]
        for cmd, r in runs.items()
        if cmd != "report"
    }
    assert len({tuple(w) for w in warnings.values()}) == 1 and warnings["summary"], warnings
    assert "1 malformed span(s) skipped" in runs["report"].output


@pytest.mark.parametrize("case", list(TOLERATED), ids=list(TOLERATED))
def test_tolerated_malformed_parts_keep_the_span_in_every_command(
    tmp_path: Path, case: str
) -> None:
    f = tmp_path / "traces-rank0.jsonl"
    f.write_text(_span_line(TOLERATED[case]) + "\n")
    for extra in ((), ("--skip-invalid",)):
        for cmd, r in _run_all(f, tmp_path, *extra).items():
            assert r.exit_code == 0, (cmd, r.output)
    s = json.loads(_invoke("summary", f, "--json").stdout)
    g = json.loads(_invoke("goodput", f, "--json").stdout)
    step = next(x for x in s["spans"] if x["name"] == SpanName.ITERATION)
    assert step["count"] == 3
    # summary's step time is what goodput counts as productive before the first-step excess
    assert step["total_ms"] >= g["overall"]["productive_ms"] >= 0


def test_end_before_start_counts_as_an_instant_span_in_summary_and_goodput(
    tmp_path: Path,
) -> None:
    f = tmp_path / "traces-rank0.jsonl"
    f.write_text(_span_line(TOLERATED["end-before-start"]) + "\n")
    s = json.loads(_invoke("summary", f, "--json").stdout)
    g = json.loads(_invoke("goodput", f, "--json").stdout)
    step = next(x for x in s["spans"] if x["name"] == SpanName.ITERATION)
    assert step["total_ms"] == pytest.approx(10.0)
    assert g["ranks"][0]["wall_ms"] == pytest.approx(20.0)


def _no_hang(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlaunch", "trace", *map(str, args)],
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_non_regular_trace_file_in_a_run_directory_is_refused_without_hanging(
    tmp_path: Path, kind: str
) -> None:
    tel = tmp_path / "run" / "telemetry"
    tel.mkdir(parents=True)
    bad = tel / "traces-rank0.jsonl"
    os.mkfifo(bad) if kind == "fifo" else bad.mkdir()
    p = _no_hang("summary", tmp_path / "run")
    assert p.returncode == 2, p.stderr
    assert str(bad) in p.stderr and "not a trace file" in p.stderr and "Traceback" not in p.stderr


@pytest.mark.parametrize("path", ["/dev/null", "fifo"])
def test_a_device_or_fifo_as_the_trace_path_is_refused(tmp_path: Path, path: str) -> None:
    if path == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    p = _no_hang("goodput", path)
    assert p.returncode == 2 and "not a regular file" in p.stderr, p.stderr


def test_an_exported_chrome_trace_fed_back_says_what_it_is(run_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    assert _invoke("export", run_dir, "-o", out).exit_code == 0
    one_line = tmp_path / "one-line.json"
    one_line.write_text(json.dumps(json.loads(out.read_text())) + "\n")
    for f in (out, one_line):
        for extra in ((), ("--skip-invalid",)):
            r = _invoke("summary", f, *extra)
            assert r.exit_code == 2, r.output
            assert "Chrome trace-event JSON" in r.output and "traces-rank<R>.jsonl" in r.output
