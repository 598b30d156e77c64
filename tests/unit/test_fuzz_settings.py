"""Property-based fuzzing of the settings loader (hypothesis).

Whatever the environment (``MEGATRON_OTEL_*``, ``NEMO_LENS_*``, ``OTEL_*`` names, real and made
up, with any values), the config file (TOML documents built from the settings sections with random
keys and values, or any text or bytes at all) and the flags, :func:`load_settings` either returns a
:class:`Settings` or raises :class:`SettingsError` whose every problem has a non-empty field and
message: never another exception. :func:`collect_problems` agrees: it finds no problem exactly when
:func:`load_settings` succeeds.
"""

from __future__ import annotations

import math
import string
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlaunch.cli.setting_flags import setting_paths
from mlaunch.envcontract import FALLBACK_PREFIX, PRIMARY_PREFIX
from mlaunch.settings import (
    ALIAS_KEYS,
    OTEL_ENV,
    SECTIONS,
    TELEMETRY_KEYS,
    OtelSettings,
    Settings,
    SettingsError,
    collect_problems,
    load_settings,
)

FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)

#: Values a setting plausibly takes, so examples also reach deep validation (not only parsing).
PLAUSIBLE = [
    "0", "1", "-1", "2", "1.5", "0.5", "true", "false", "maybe", "", " ", "default", "all,-layer",
    "per_stepp", "single_rank", "sampled", "nope:fn", "json:nope", "file", "otlp", "none",
    "grpc", "http/protobuf", "http/json", "traceidratio", "always-on", "http://localhost:4317",
    "localhost:4317", "a=1,b", "k=v", "rank_aware", "inf", "nan", "1e400", "défault", "../../etc",
    "x" * 300,
]  # fmt: skip
value_text = st.one_of(st.sampled_from(PLAUSIBLE), st.text(max_size=40))


def check(load: Any) -> Settings | None:
    """Run ``load``: a Settings, or a SettingsError with well-formed problems; anything else
    propagates and fails the property."""
    try:
        result = load()
    except SettingsError as exc:
        assert exc.problems, "a SettingsError with no problem"
        for fld, message in exc.problems:
            assert isinstance(fld, str) and fld.strip(), exc.problems
            assert isinstance(message, str) and message.strip(), exc.problems
        return None
    assert isinstance(result, Settings)
    return result


def check_agrees(**sources: Any) -> None:
    """load_settings succeeds exactly when collect_problems finds nothing."""
    loaded = check(lambda: load_settings(**sources))
    found, problems = collect_problems(**sources)
    for fld, message in problems:
        assert fld.strip() and message.strip(), problems
    assert (loaded is not None) == (not problems), problems
    if loaded is not None:
        assert found is not None


# ---- environment -------------------------------------------------------------------------

known_names = [
    p + k for p in (PRIMARY_PREFIX, FALLBACK_PREFIX) for k in [*TELEMETRY_KEYS, *ALIAS_KEYS]
]
env_name = st.one_of(
    st.sampled_from(known_names + list(OTEL_ENV)),
    st.builds(
        str.__add__,
        st.sampled_from([PRIMARY_PREFIX, FALLBACK_PREFIX, "OTEL_"]),
        st.text(string.ascii_uppercase + "_", max_size=14),
    ),
)


@FUZZ
@given(st.dictionaries(env_name, value_text, max_size=8))
def test_any_environment_loads_or_reports_problems(environ: dict[str, str]) -> None:
    check_agrees(environ=environ)


# ---- config files ------------------------------------------------------------------------


def _toml_string(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def toml_value(value: Any) -> str:
    """``value`` as a TOML value (inline tables for mappings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    assert isinstance(value, Mapping)
    return "{" + ", ".join(f"{_toml_string(k)} = {toml_value(v)}" for k, v in value.items()) + "}"


def toml_document(doc: Mapping[str, Any]) -> str:
    """A document whose top-level tables are written as ``[section]`` headers."""
    lines = []
    for key, value in doc.items():
        if not isinstance(value, Mapping):
            lines.append(f"{_toml_string(key)} = {toml_value(value)}")
    for key, value in doc.items():
        if isinstance(value, Mapping):
            lines.append(f"[{_toml_string(key)}]")
            lines += [f"{_toml_string(k)} = {toml_value(v)}" for k, v in value.items()]
    return "\n".join(lines) + "\n"


scalar = st.one_of(
    st.booleans(),
    st.integers(min_value=-3, max_value=10),
    st.integers(),
    st.floats(),
    value_text,
)
toml_any = st.recursive(
    scalar,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=6,
)


def section_table(model: Any) -> st.SearchStrategy[dict[str, Any]]:
    """A table of random keys (mostly the section's own) and random values."""
    key = st.one_of(st.sampled_from(list(model.model_fields)), st.text(max_size=10))
    return st.dictionaries(key, toml_any, max_size=6)


otel_table = section_table(OtelSettings)
section = st.sampled_from(list(SECTIONS)).flatmap(
    lambda name: st.tuples(
        st.just(name),
        section_table(SECTIONS[name]).flatmap(
            lambda table: (
                st.one_of(st.just(table), otel_table.map(lambda o: {**table, "otel": o}))
                if name == "telemetry"
                else st.just(table)
            )
        ),
    )
)
document = st.lists(st.one_of(section, st.tuples(st.text(max_size=8), toml_any)), max_size=5).map(
    dict
)


@pytest.fixture(scope="module")
def config_dir() -> Iterator[Path]:
    """One scratch directory for the module (hypothesis reruns the test body many times)."""
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


@FUZZ
@given(document)
def test_any_toml_document_of_settings_sections_loads_or_reports_problems(
    config_dir: Path, doc: dict[str, Any]
) -> None:
    path = config_dir / "fuzz.toml"
    path.write_text(toml_document(doc), encoding="utf-8")
    check_agrees(environ={}, config=path)


@FUZZ
@given(st.one_of(st.text(max_size=300), st.binary(max_size=300)))
def test_any_file_content_loads_or_reports_problems(config_dir: Path, content: str | bytes) -> None:
    path = config_dir / "raw.toml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content, encoding="utf-8")
    check_agrees(environ={}, config=path)


# ---- flags -------------------------------------------------------------------------------

PATHS = [path for path, _ in setting_paths()]


@FUZZ
@given(st.dictionaries(st.sampled_from(PATHS), st.one_of(value_text, st.booleans()), max_size=6))
def test_any_flags_load_or_report_problems(flags: dict[str, Any]) -> None:
    check_agrees(flags=flags, environ={})


@FUZZ
@given(
    environ=st.dictionaries(env_name, value_text, max_size=4),
    flags=st.dictionaries(st.sampled_from(PATHS), value_text, max_size=4),
    doc=document,
)
def test_all_sources_together_load_or_report_problems(
    config_dir: Path, environ: dict[str, str], flags: dict[str, Any], doc: dict[str, Any]
) -> None:
    path = config_dir / "all.toml"
    path.write_text(toml_document(doc), encoding="utf-8")
    check_agrees(flags=flags, environ=environ, config=path)


def test_the_fuzzed_documents_are_real_toml() -> None:
    """The writer the properties rely on: what it writes, tomllib reads back the same."""
    import tomllib

    doc = {"training": {"lr": 0.5, "save": 'a"b\\\n'}, "telemetry": {"otel": {"k": [1, True]}}}
    assert tomllib.loads(toml_document(doc)) == doc
