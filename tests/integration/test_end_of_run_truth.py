"""The end-of-run report tells the truth. Real ``mlaunch train`` processes on
real torchrun (1-2 CPU workers, telemetry off): a failing ``--script`` is reported with the
failing rank's own stderr, a Ctrl-C with a handled traceback in a log is an interruption (130),
and a worker that ignores SIGTERM is force-stopped by a second Ctrl-C."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from support.launch_runs import clean_env

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    return clean_env(PYTHONPATH=str(ROOT))


def _train(tmp: Path, script: str, *args: str) -> list[str]:
    path = tmp / "worker.py"
    path.write_text(textwrap.dedent(script))
    return [
        sys.executable, "-m", "mlaunch", "train", "--script", str(path), "--no-megatron-args",
        "--no-otel-enabled", "--run-dir", str(tmp / "run"), *args,
    ]  # fmt: skip


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[0]
        assert time.monotonic() < end, "the worker never started"
        time.sleep(0.1)


def _interrupt_once_started(tmp: Path, script: str, marker: Path) -> subprocess.Popen:
    """One worker running ``script``; SIGINT to the launcher once the script wrote ``marker``."""
    proc = subprocess.Popen(
        _train(tmp, script, "--nproc-per-node", "1"),
        env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    _wait_for(marker, proc)
    proc.send_signal(signal.SIGINT)
    return proc


def test_a_failing_script_shows_each_failing_ranks_own_stderr(tmp_path: Path) -> None:
    # Each rank must fail on its own: torchrun stops the others (SIGTERM) within its 0.1 s
    # monitor interval of the first failure, which on a loaded machine came before the slower
    # rank's own end. So rank 0 fails first, and rank 1 ignores that SIGTERM, waits until rank 0's
    # process has ended (a zombie or gone: its pid from a file), and only then dies of SIGSEGV.
    # Rank 0 fails only once rank 1 ignores SIGTERM (its ready file): on a loaded machine rank 1
    # could still be starting when rank 0 failed, and torchrun's SIGTERM then ended it.
    pid_file = tmp_path / "rank0.pid"
    ready_file = tmp_path / "rank1.ready"
    script = f"""
        import argparse, os, signal, sys, time
        print("rank output before the end", file=sys.stderr, flush=True)
        def ended(pid):
            try:
                with open(f"/proc/{{pid}}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] == "Z"
            except OSError:
                return True
        if os.environ["LOCAL_RANK"] == "1":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            open({str(ready_file)!r}, "w").close()
            end = time.monotonic() + 60
            while time.monotonic() < end:
                try:
                    pid = int(open({str(pid_file)!r}).read())
                except (OSError, ValueError):
                    pid = None
                if pid is not None and ended(pid):
                    break
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGSEGV)
        end = time.monotonic() + 60
        while not os.path.exists({str(ready_file)!r}) and time.monotonic() < end:
            time.sleep(0.01)
        tmp = {str(pid_file)!r} + ".tmp"
        open(tmp, "w").write(str(os.getpid()))
        os.replace(tmp, {str(pid_file)!r})
        argparse.ArgumentParser().parse_args(["--bogus"])
    """
    out = subprocess.run(
        _train(tmp_path, script, "--nproc-per-node", "2"),
        env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = out.stdout + out.stderr
    assert out.returncode != 0
    assert "rank 0 (node 0, local rank 0) failed: exit code 2: " in text, text
    assert "error: unrecognized arguments: --bogus" in text
    assert "rank 1 (node 0, local rank 1) failed: killed by SIGSEGV" in text, text
    assert "rank output before the end" in text
    assert "Root Cause" not in text and "torchrun exited with" not in text  # not torchrun's dump


def test_ctrl_c_with_a_handled_traceback_in_a_log_is_an_interruption(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    script = f"""
        import time, traceback
        try:
            1 / 0
        except ZeroDivisionError:
            traceback.print_exc()  # handled: the run goes on
        open({str(marker)!r}, "w").close()
        time.sleep(120)
    """
    proc = _interrupt_once_started(tmp_path, script, marker)
    text, _ = proc.communicate(timeout=90)
    assert proc.returncode == 130, text
    # The worker's own lines reach the console (--tee, a script's default) as they are; the
    # launcher's verdict must not read its handled traceback as a failure.
    launcher = "\n".join(ln for ln in text.splitlines() if not ln.startswith("[rank "))
    assert "failed" not in launcher and "ZeroDivisionError" not in launcher, text
    assert "[rank 0] ZeroDivisionError: division by zero" in text
    assert "(after SIGINT)" in text


def test_a_second_ctrl_c_force_stops_a_worker_that_ignores_sigterm(tmp_path: Path) -> None:
    marker = tmp_path / "started"
    script = f"""
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open({str(marker)!r}, "w").close()
        time.sleep(300)
    """
    proc = _interrupt_once_started(tmp_path, script, marker)
    time.sleep(1.5)
    assert proc.poll() is None  # still waiting on the worker (torchrun's grace period)
    forced = time.monotonic()
    proc.send_signal(signal.SIGINT)
    text, _ = proc.communicate(timeout=60)
    assert time.monotonic() - forced < 10, text
    assert "waiting for workers to stop (Ctrl-C again to force)" in text
    assert "SIGINT again: killing the workers (SIGKILL)" in text
    assert proc.returncode == 130, text


def test_an_unreachable_endpoint_is_reported_as_spooled_with_the_replay_command(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [
            sys.executable, "-m", "mlaunch", "train", "--run-dir", str(run_dir), "--train-iters",
            "2", "--otel-exporter", "otlp", "--otlp-endpoint", "http://u:secret@127.0.0.1:1",
            "--otel-shutdown-timeout-s", "2",
        ],
        env=_env(), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    text = out.stdout
    assert out.returncode == 0, text + out.stderr
    line = next(ln for ln in text.splitlines() if ln.startswith("traces:"))
    assert " 0 delivered to http://127.0.0.1:1, " in line and "spooled" in line
    assert "sent to" not in text and "secret" not in text
    spooled = int(line.split(" spooled")[0].rsplit(", ", 1)[1].replace(",", ""))
    assert spooled > 0
    assert f"send them: mlaunch trace replay {run_dir} --endpoint http://127.0.0.1:1" in text


def test_an_ordinary_argparse_script_gets_no_megatron_arguments(tmp_path: Path) -> None:
    # Before: the default handed Megatron-LM's --num-layers ... to every script (exit 2 at once).
    script = tmp_path / "train.py"
    script.write_text(
        "import argparse\np = argparse.ArgumentParser()\np.add_argument('--epochs', type=int)\n"
        "print('epochs', p.parse_args().epochs)\n"
    )
    out = subprocess.run(
        [
            sys.executable, "-m", "mlaunch", "train", "--script", str(script), "--no-otel-enabled",
            "--nproc-per-node", "1", "--run-dir", str(tmp_path / "run"), "--", "--epochs", "3",
        ],
        env=_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    text = " ".join(out.stdout.replace("│", " ").split())
    assert out.returncode == 0, out.stdout + out.stderr
    assert "megatron args not passed (not a Megatron-LM entry point; --megatron-args" in text
