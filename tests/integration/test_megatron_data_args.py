"""Megatron-LM's data arguments reach a ``--script pretrain_gpt.py`` verbatim.

The script is a shim standing for Megatron-LM's ``pretrain_gpt.py``: under real torchrun it
records the argv it received, which is all these tests look at. Megatron-LM's ``--data-path``
takes dataset prefixes (``.bin``/``.idx`` without the suffix), optionally weighted; mlaunch's own
trainer reads a text corpus there, and that check must not apply to a Megatron-LM script.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.launch_runs import clean_env, finish, mlaunch

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SHIM = """\
import json, os, sys
from pathlib import Path
out = Path(os.environ["MLAUNCH_RUN_DIR"]) / f"argv-rank{os.environ['RANK']}.json"
out.write_text(json.dumps(sys.argv[1:]))
"""


def _shim(tmp_path: Path) -> Path:
    script = tmp_path / "Megatron-LM" / "pretrain_gpt.py"
    script.parent.mkdir()
    script.write_text(SHIM)
    return script


def _run(tmp_path: Path, *args: str) -> tuple[int, str, list[str]]:
    """The README's command (``--config megatron --script .../pretrain_gpt.py``), sized for a
    CPU test machine, and the argv rank 0's script received."""
    run_dir = tmp_path / "run"
    proc = mlaunch(
        "--config", "megatron", "--script", str(_shim(tmp_path)), "--device", "cpu",
        "--nproc-per-node", "1", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--no-otel-enabled", "--run-dir", str(run_dir),
        *args,
        cwd=tmp_path, env=clean_env(),
    )  # fmt: skip
    code, out = finish(proc)
    argv_file = run_dir / "argv-rank0.json"
    return code, out, json.loads(argv_file.read_text()) if argv_file.exists() else []


def _after(argv: list[str], flag: str, count: int) -> list[str]:
    assert argv.count(flag) == 1, argv
    at = argv.index(flag)
    return argv[at + 1 : at + 1 + count]


def test_data_path_prefixes_and_a_weighted_list_after_dashes_reach_the_script_verbatim(tmp_path):
    # Neither prefix exists here: Megatron-LM's workers open <prefix>.bin/.idx themselves.
    code, out, argv = _run(
        tmp_path, "--", "--data-path", "0.3", "/a/prefix", "0.7", "/b/prefix",
        "--valid-data-path", "/v/prefix", "--split", "949,50,1",
    )  # fmt: skip
    assert code == 0, out
    assert _after(argv, "--data-path", 4) == ["0.3", "/a/prefix", "0.7", "/b/prefix"]
    assert _after(argv, "--valid-data-path", 1) == ["/v/prefix"]
    assert argv[-2:] == ["--split", "949,50,1"]
    assert "--num-layers" in argv and "--bf16" in argv  # the config's settings still translated


def test_data_path_before_dashes_is_megatron_prefixes_not_a_text_corpus(tmp_path):
    code, out, argv = _run(tmp_path, "--data-path", "0.3 /a/prefix 0.7 /b/prefix")
    assert code == 0, out
    assert _after(argv, "--data-path", 4) == ["0.3", "/a/prefix", "0.7", "/b/prefix"]
