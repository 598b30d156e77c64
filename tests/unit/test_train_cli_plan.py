"""The launch plan's pure parts: trainer-argument mapping, SLURM host lists, config lookup,
resolved-file formats. No process is started."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from mlaunch.launcher import cluster_env, worker_args
from mlaunch.launcher import configs as lc
from mlaunch.launcher import plan as lp
from mlaunch.settings import SECTIONS, SettingsError

CLEAN = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}


def build(flags: dict | None = None, config: str | None = None, env: dict | None = None, cwd=None):
    return lp.build_plan(
        flags=flags or {},
        config=config,
        environ={**CLEAN, **(env or {})},
        cwd=Path(cwd or "/nonexistent-cwd"),
    )


# ---- the trainer contract ------------------------------------------------------------------


def test_every_model_training_parallel_setting_maps_to_a_trainer_argument():
    fields = {
        f"{section}.{name}"
        for section in ("model", "training", "parallelism")
        for name in SECTIONS[section].model_fields
    }
    assert fields == set(worker_args.TRAINER_ARGS) | set(worker_args.NOT_TRAINER_ARGS)
    assert not set(worker_args.TRAINER_ARGS) & set(worker_args.NOT_TRAINER_ARGS)


def test_every_mapped_argument_is_accepted_by_the_trainer_parser():
    from mlaunch.settings.trainer_cli import build_parser

    known = {opt for action in build_parser()._actions for opt in action.option_strings}
    for path, flag in worker_args.TRAINER_ARGS.items():
        for one in flag.split("/"):
            assert one in known, f"{path} -> {one} is not a trainer argument"


def test_plan_arguments_parse_back_to_the_settings_values(tmp_path):
    from mlaunch.settings.trainer_cli import build_parser

    plan = build(
        {
            "model.num_layers": 4, "model.untie_embeddings": True, "training.precision": "bf16",
            "training.save_interval": 5, "training.eval_interval": 0, "training.lr": 0.01,
            "parallelism.pipeline_model_parallel_size": 2, "training.offload_activations": True,
        },
        cwd=tmp_path,
    )  # fmt: skip
    entry = plan.argv[plan.argv.index("mlaunch.trainer") + 1 :]
    ns = build_parser().parse_args(entry)
    assert (ns.num_layers, ns.untie_embeddings, ns.bf16, ns.fp16) == (4, True, True, False)
    assert ns.save == str(plan.run_dir / "checkpoints") and ns.save_interval == 5
    assert ns.eval_iters == 0 and ns.lr == 0.01 and ns.offload_activations
    assert ns.pipeline_model_parallel_size == 2
    assert ns.global_batch_size == 8 and ns.log_interval == 5 and ns.keep_last == 2


def test_megatron_script_gets_megatron_names_and_otel_flags_only(tmp_path):
    script = tmp_path / "pretrain_gpt.py"
    script.write_text("")
    plan = build(
        {"launch.script": str(script), "launch.device": "cpu"}, config="megatron", cwd=tmp_path
    )
    entry = plan.argv[plan.argv.index(str(script)) + 1 :]
    assert "--untie-embeddings" not in entry and "--keep-last" not in entry
    assert "--offload-activations" not in entry and "--sample-tokens" not in entry
    assert entry[entry.index("--tensor-model-parallel-size") + 1] == "2"
    assert "--bf16" in entry
    # The reference's language: the resolved list, each flag one argv item.
    assert entry[-3:] == [
        "--otel-enabled",
        "--otel-service-name=megatron-lm",
        "--otel-span-groups=job,checkpoint,evaluate,model_init,load_checkpoint,step,"
        "forward_backward,optimizer,communication,data_loading,first_iteration,inference",
    ]
    plain = build(
        {"launch.script": str(script), "launch.megatron_args": False},
        config="megatron",
        cwd=tmp_path,
    )
    assert plain.argv[plain.argv.index(str(script)) :] == [str(script)]


# ---- SLURM -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node[01-04],gpu7", ["node01", "node02", "node03", "node04", "gpu7"]),
        ("gpu7", ["gpu7"]),
        ("a[1,3-4]b", ["a1b", "a3b", "a4b"]),
        ("r[1-2]-n[8-9]", ["r1-n8", "r1-n9", "r2-n8", "r2-n9"]),
        ("x[009-011],y", ["x009", "x010", "x011", "y"]),
        ("", []),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert cluster_env.expand_nodelist(nodelist) == hosts


SLURM = {
    "SLURM_JOB_ID": "4242", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
    "SLURM_JOB_NODELIST": "node[01-04],gpu7",
}  # fmt: skip


def test_slurm_supplies_layout_rendezvous_and_run_id(tmp_path):
    plan = build({"training.global_batch_size": 16}, env=SLURM, cwd=tmp_path)
    i = plan.argv.index("--nnodes")
    assert plan.argv[i : i + 12] == [
        "--nnodes", "4", "--nproc-per-node", "2", "--node-rank", "2", "--rdzv-backend", "c10d",
        "--rdzv-endpoint", "node01:29500", "--rdzv-id", "4242",
    ]  # fmt: skip
    assert plan.run_id == "4242" and plan.run_dir == tmp_path / "runs" / "4242"
    assert str(plan.settings.source("launch.nnodes")) == "SLURM_NNODES"


def test_explicit_values_win_over_slurm(tmp_path):
    plan = build(
        {"launch.nnodes": 2, "launch.node_rank": 1, "launch.rdzv_endpoint": "head:1234"},
        env={**SLURM, "MASTER_PORT": "7777"},
        cwd=tmp_path,
    )
    argv = plan.argv
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "head:1234"
    assert argv[argv.index("--rdzv-id") + 1] == "4242"


# ---- config lookup -----------------------------------------------------------------------------


def test_config_names_resolve_to_shipped_files(tmp_path):
    assert set(lc.shipped_configs()) >= {"tiny", "pp2", "dp2pp2", "profiling", "megatron", "gpu8"}
    assert lc.resolve_config(None, tmp_path) == lc.CONFIGS_DIR / "tiny.toml"
    assert lc.resolve_config("pp2.toml", tmp_path) == lc.CONFIGS_DIR / "pp2.toml"
    (tmp_path / "pp2.toml").write_text("")
    assert lc.resolve_config("pp2.toml", tmp_path) == tmp_path / "pp2.toml"  # a local file wins
    with pytest.raises(SettingsError) as err:
        lc.resolve_config("sub/tiny", tmp_path)
    assert err.value.problems[0][0] == "--config"


def test_top_level_configs_link_points_at_the_package_data():
    root = Path(__file__).resolve().parents[2]
    assert (root / "configs").is_symlink()
    assert (root / "configs").resolve() == lc.CONFIGS_DIR


@pytest.mark.parametrize("name", ["tiny", "pp2", "dp2pp2", "profiling", "gpu8"])
def test_shipped_configs_validate_and_every_key_is_commented(name, tmp_path):
    plan = build(config=name, cwd=tmp_path)
    assert plan.exporting_ranks, "every shipped config turns telemetry on"
    for line in (lc.CONFIGS_DIR / f"{name}.toml").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line, f"{name}.toml: uncommented key: {line}"


# ---- resolved files ----------------------------------------------------------------------------

NASTY = "a b 'q' \"dq\" $HOME `id` \\ back\nnew line ;|&*?"


def test_resolved_env_round_trips_through_bash(tmp_path):
    plan = build(
        {
            "telemetry.user_id": NASTY,
            "telemetry.service_name": "svc $x `y`",
            "launch.run_dir": str(tmp_path / "r d $x"),
        },
        env={
            "OTEL_RESOURCE_ATTRIBUTES": "team=a%20b,x=$y`z`",
            "OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer s3cret",
        },
        cwd=tmp_path,
    )
    env_file = tmp_path / "resolved.env"
    env_file.write_text(plan.resolved_env_text())
    out = subprocess.run(
        ["bash", "-c", f". {shlex.quote(str(env_file))} && env -0"],
        env={"PATH": CLEAN["PATH"]}, capture_output=True, check=True,
    ).stdout.decode()  # fmt: skip
    got = dict(item.split("=", 1) for item in out.split("\0") if "=" in item)
    shown = plan.shown_env()
    for name, value in shown.items():
        if name == "OTEL_EXPORTER_OTLP_HEADERS":
            assert name not in got  # redacted secrets are comments, never set to the marker
        else:
            assert got[name] == value, name
    assert got["MEGATRON_OTEL_USER_ID"] == NASTY
    assert got["OTEL_RESOURCE_ATTRIBUTES"] == "team=a%20b,x=$y`z`"
    assert "s3cret" not in plan.resolved_env_text() and "s3cret" not in plan.resolved_json_text()
    assert "s3cret" in plan.resolved_env_text(show_secrets=True)
    assert plan.child_env["OTEL_EXPORTER_OTLP_HEADERS"] == "authorization=Bearer s3cret"


def test_flag_given_otlp_settings_reach_the_workers_as_variables(tmp_path):
    plan = build(
        {
            "telemetry.otel.base_endpoint": "http://collector:4317",
            "telemetry.otel.headers": "x-token=a b",
            "telemetry.otel.resource_attributes": "k=v=w",
            "telemetry.otel.insecure": True,
        },
        cwd=tmp_path,
    )
    env = plan.worker_env
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://collector:4317"
    # tiny.toml names the file exporter; the endpoint flag the user typed wins over it
    assert env["MEGATRON_OTEL_EXPORTER"] == "otlp"
    assert env["OTEL_EXPORTER_OTLP_INSECURE"] == "true"
    # Re-parsed by a worker's settings, the values are the launcher's.
    from mlaunch.settings import load_telemetry_settings

    worker = load_telemetry_settings(env)
    assert worker.otel.headers == {"x-token": "a b"}
    assert worker.otel.resource_attributes == {"k": "v=w"}
    assert worker.otel.base_endpoint == "http://collector:4317"


def test_resolved_json_has_every_setting_with_value_and_source(tmp_path):
    plan = build({"model.num_layers": 4}, env={"NEMO_LENS_USER_ID": "me"}, cwd=tmp_path)
    table = plan.resolved_json()["settings"]
    expected = {f"{s}.{f}" for s, m in SECTIONS.items() for f in m.model_fields if f != "otel"} | {
        f"telemetry.otel.{f}"
        for f in SECTIONS["telemetry"].model_fields["otel"].annotation.model_fields
    }
    assert set(table) == expected
    assert table["model.num_layers"] == {"value": 4, "source": "--num-layers"}
    assert table["telemetry.user_id"] == {"value": "me", "source": "NEMO_LENS_USER_ID"}
    assert table["training.train_iters"]["source"].endswith("tiny.toml [training] train_iters")
    assert table["telemetry.shutdown_timeout_s"]["source"] == "default"


def test_launcher_modules_never_import_torch():
    code = (
        "import sys; from pathlib import Path\n"
        "import mlaunch.cli.train, mlaunch.launcher.run, mlaunch.cli.train_view\n"
        "from mlaunch.launcher.plan import build_plan\n"
        "build_plan(flags={}, environ={}, cwd=Path('.'))\n"
        "bad = [m for m in ('torch', 'opentelemetry.sdk', 'grpc') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_megatron_arguments_go_only_to_a_megatron_lm_entry_point(tmp_path, monkeypatch):
    # Unset = on for pretrain_*.py / a megatron/ checkout / megatron.* modules.
    # Where python -m finds the modules (checked before launch); apart from the scripts, whose
    # folder would otherwise hold a megatron/ package.
    monkeypatch.chdir((tmp_path / "modules").mkdir() or tmp_path / "modules")
    for module in ("megatron/training.py", "mypkg/train.py"):
        (tmp_path / "modules" / module).parent.mkdir(exist_ok=True)
        (tmp_path / "modules" / module).write_text("")
    (tmp_path / "pretrain_gpt.py").write_text("")
    (tmp_path / "train.py").write_text("")
    (tmp_path / "lm").mkdir()
    (tmp_path / "lm" / "megatron").mkdir()
    (tmp_path / "lm" / "run.py").write_text("")
    cases = [
        ({"launch.script": str(tmp_path / "pretrain_gpt.py")}, True, "entry point pretrain_gpt.py"),
        ({"launch.script": str(tmp_path / "lm/run.py")}, True, "megatron/ package"),
        ({"launch.module": "megatron.training"}, True, "module megatron.training"),
        ({"launch.script": str(tmp_path / "train.py")}, False, "not a Megatron-LM entry point"),
        ({"launch.module": "mypkg.train"}, False, "not a Megatron-LM entry point"),
        (
            {"launch.script": str(tmp_path / "train.py"), "launch.megatron_args": True},
            True,
            "--megatron-args",
        ),
        (
            {"launch.script": str(tmp_path / "pretrain_gpt.py"), "launch.megatron_args": False},
            False,
            "= false",
        ),
    ]
    for flags, on, why in cases:
        plan = build(flags, cwd=tmp_path)
        assert plan.settings.launch.megatron_args is on, flags
        assert why in plan.megatron_args_reason, (flags, plan.megatron_args_reason)
        assert ("--num-layers" in plan.argv) is on
    megatron = build({"launch.script": str(tmp_path / "train.py")}, config="megatron", cwd=tmp_path)
    assert megatron.settings.launch.megatron_args is True


def test_the_trainer_run_bare_has_the_settings_defaults():
    """One schema: the trainer's parser takes its defaults from the settings, except where a
    setting declares the trainer's own (an unset value it derives, keep-all checkpoints)."""
    from mlaunch.settings.arg_tables import training_fields
    from mlaunch.settings.args import SAME, Arg
    from mlaunch.settings.trainer_cli import build_parser

    defaults = {a.dest: a.default for a in build_parser()._actions}
    own = {}
    for _, name, info, arg in training_fields():
        if isinstance(arg, Arg) and not arg.choices:
            expected = info.default if arg.bare_default is SAME else arg.bare_default
            assert defaults[name] == expected, name
            if arg.bare_default is not SAME:
                own[name] = arg.bare_default
    assert own == {"global_batch_size": None, "save_interval": None, "keep_last": 0}


# ---- what the launcher says while it runs --------------------------------------------------


def test_the_sigterm_notice_promises_only_what_the_workers_will_do():
    from mlaunch.cli import train_view as view

    assert view.stop_text(build()) == "finish the iteration and flush telemetry"
    saving = build({"training.save_interval": 5})
    assert view.stop_text(saving) == "finish the iteration, save and flush telemetry"
    assert view.stop_text(build({"telemetry.enabled": False})) == "finish the iteration"
    restarts = build({"launch.max_restarts": 1})  # mlaunch adds a save for the restarts
    assert view.stop_text(restarts) == "finish the iteration, save and flush telemetry"


def test_the_starting_line_and_the_restart_notice():
    from mlaunch.cli import train_view as view
    from mlaunch.launcher.run import Restart

    plan = build({"launch.max_restarts": 2})
    assert view.starting_text(plan).startswith("starting 2 worker(s) (torchrun): ")
    notice = view.restart_text(plan, Restart(1, "rank 1 killed by SIGKILL", 1, 0.0), 2)
    assert notice == (
        "restart 1 of 2: rank 1 killed by SIGKILL; torchrun started the workers again;"
        " resuming from the newest valid checkpoint"
    )


def test_a_rerun_in_a_run_dir_with_checkpoints_resumes_without_save_interval(tmp_path):
    # runs/k9l/checkpoints held iteration 30 and a rerun without --save-interval started at
    # iteration 1: it resumes from them, and saves there at the end again
    run_dir = tmp_path / "run"
    fresh = build({"launch.run_dir": str(run_dir)}, config="tiny", cwd=tmp_path)
    assert "--load" not in fresh.argv and "--save" not in fresh.argv
    ckpt = run_dir / "checkpoints"
    (ckpt / "iter_0000030").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("30\n")
    again = build({"launch.run_dir": str(run_dir)}, config="tiny", cwd=tmp_path)
    argv = again.argv
    assert argv[argv.index("--load") + 1] == str(ckpt)
    assert argv[argv.index("--save") + 1] == str(ckpt)
    assert "--save-interval" not in argv  # at the end only, as the user asked
    from mlaunch.cli.train_view import _checkpoint_text

    assert f"resuming from {ckpt}" in _checkpoint_text(again)
