"""The import rules that keep the layers apart and the CLI fast.

Two kinds of check: what a command or module actually loads (fresh interpreters), and where each
import statement stands (the source read as syntax trees, so an import inside a function, which a
fresh interpreter would not run, is seen too).
"""

from __future__ import annotations

import ast
import functools
import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.launch_runs import clean_env

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "mlaunch"

HEAVY = ("torch", "opentelemetry.sdk", "grpc", "numpy")

PROBE = """
import io, json, sys, contextlib
sys.argv = ["mlaunch", *{args!r}]
from mlaunch.cli import main
out = io.StringIO()
code = 0
with contextlib.redirect_stdout(out):
    try:
        main()
    except SystemExit as exc:
        code = exc.code or 0
print(json.dumps({{"code": code, "modules": sorted(sys.modules)}}))
"""


def _loaded(args: list[str]) -> tuple[int, set[str]]:
    env = clean_env()
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=args)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    data = json.loads(out.stdout.strip().splitlines()[-1])
    return data["code"], set(data["modules"])


@pytest.mark.parametrize(
    "args", [["groups", "resolve", "all"], ["groups", "resolve"], ["groups", "list"]]
)
def test_groups_commands_import_no_heavy_module(args: list[str]) -> None:
    code, modules = _loaded(args)
    assert code == 0
    heavy = {m for m in modules if m.split(".")[0] in {h.split(".")[0] for h in HEAVY}}
    heavy = {m for m in heavy if any(m == h or m.startswith(h + ".") for h in HEAVY)}
    assert not heavy, sorted(heavy)[:10]


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("mlaunch.model", ("pydantic", "typer", "rich", "opentelemetry", "torch")),
        ("mlaunch.rundir.state", ("pydantic", "typer", "rich", "opentelemetry", "torch")),
        ("mlaunch.settings", ("torch", "opentelemetry", "grpc")),
        # The API alone: the SDK loads only when a rank builds a runtime (setup).
        ("mlaunch.telemetry", ("torch", "opentelemetry.sdk")),
        # Every launch imports these; the receiver's protobuf/grpc load only when one is hosted.
        ("mlaunch.launcher.run", ("torch", "opentelemetry", "grpc", "google")),
        ("mlaunch.launcher.receiver_wiring", ("torch", "opentelemetry", "grpc", "google")),
        # Reading a trace needs OTLP/JSON only: not the telemetry runtime and its fork hook.
        ("mlaunch.trace.reader", ("mlaunch.telemetry",)),
        # A TrainJob is written (and --dry-run printed) without the optional Kubernetes client.
        ("mlaunch.kube.manifest", ("kubernetes", "torch", "opentelemetry")),
        # `mlaunch status RUN_DIR` asks whether the target is a TrainJob: that costs no settings
        # layer, and no client until the API is asked.
        ("mlaunch.cli.trainjob_ops", ("pydantic", "kubernetes", "torch")),
    ],
)
def test_layer_imports(module: str, forbidden: tuple[str, ...]) -> None:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    bad = [m for m in loaded if m.split(".")[0] in forbidden or m in forbidden]
    assert not bad, bad[:10]


# ---- where import statements stand (static) --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Import:
    """One module an import statement names, and where the statement stands."""

    source: str  # the file, relative to the repository, in POSIX form
    line: int
    module: str  # absolute dotted name

    def __str__(self) -> str:
        return f"{self.source}:{self.line} imports {self.module}"


def _package_of(path: Path) -> list[str]:
    """The dotted package a source file's relative imports start from."""
    # The folder: a module's package, and an ``__init__.py``'s own package alike.
    return list(path.relative_to(REPO).parent.parts)


def imports_in(path: Path, tree: ast.AST | None = None) -> Iterator[Import]:
    """Every module ``path`` imports, at any depth (module top, functions, branches).

    ``from X import a`` yields ``X`` and ``X.a`` (``a`` may be a submodule: ``from
    opentelemetry import sdk``); relative imports are resolved against the file's package; an
    ``importlib.import_module("literal")`` call counts as an import of that literal.
    """
    tree = tree if tree is not None else ast.parse(path.read_text(encoding="utf-8"), str(path))
    source = path.relative_to(REPO).as_posix()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(source, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                package = _package_of(path)
                base = package[: len(package) - (node.level - 1)]
                module = ".".join([*base, *([node.module] if node.module else [])])
            else:
                module = node.module or ""
            yield Import(source, node.lineno, module)
            for alias in node.names:
                if alias.name != "*":
                    yield Import(source, node.lineno, f"{module}.{alias.name}")
        elif (
            isinstance(node, ast.Call)
            and (
                (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                or (isinstance(node.func, ast.Name) and node.func.id == "import_module")
            )
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield Import(source, node.lineno, node.args[0].value)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _library_imports_of(package: str) -> list[Import]:
    """Each import of ``package`` (or a submodule of it) by any module of mlaunch."""
    return sorted(
        {
            imp
            for path in sorted(PACKAGE.rglob("*.py"))
            for imp in imports_in(path)
            if _within(imp.module, package)
        },
        key=lambda imp: (imp.source, imp.line, imp.module),
    )


#: The modules that build the OpenTelemetry pipeline of an exporting rank, the only ones that may
#: import the SDK: the runtime (providers, exporters, processors) and its log bridge, the span encoder
#: of the file and spool exporters (it reads the SDK's ``SpanLimits``) and the samplers (SDK
#: ``Sampler`` subclasses). The telemetry API (``mlaunch/telemetry/__init__.py``) imports the runtime
#: only inside ``setup``, so instrumented code and every process that exports nothing pay for the API
#: alone. The receiver, replay and the job trace use ``opentelemetry.proto`` (generated message
#: classes, no SDK), which is allowed everywhere.
SDK_MODULES = frozenset(
    {
        "mlaunch/telemetry/_runtime.py",
        "mlaunch/telemetry/_logbridge.py",
        "mlaunch/telemetry/_encode.py",
        "mlaunch/telemetry/samplers.py",
    }
)


def test_the_otel_sdk_is_imported_only_by_the_telemetry_runtime() -> None:
    bad = [imp for imp in _library_imports_of("opentelemetry.sdk") if imp.source not in SDK_MODULES]
    assert not bad, "\n".join(map(str, bad))


def test_the_trainer_never_imports_opentelemetry() -> None:
    # The trainer sees telemetry only through mlaunch.telemetry's public API.
    bad = [
        imp
        for imp in _library_imports_of("opentelemetry")
        if imp.source.startswith("mlaunch/trainer/")
    ]
    assert not bad, "\n".join(map(str, bad))


#: What ``mlaunch.otlp`` may import of mlaunch: it sits below telemetry, receiver and trace.
OTLP_MAY_IMPORT = ("mlaunch.otlp", "mlaunch.envcontract", "mlaunch.model")


def test_otlp_imports_only_the_layers_below_it() -> None:
    bad = [
        imp
        for path in sorted((PACKAGE / "otlp").rglob("*.py"))
        for imp in imports_in(path)
        if _within(imp.module, "mlaunch")
        and imp.module != "mlaunch"
        and not any(_within(imp.module, ok) for ok in OTLP_MAY_IMPORT)
    ]
    assert not bad, "\n".join(map(str, bad))


#: The CLI's own modules: the only ones that may import ``mlaunch.cli``.
CLI_MODULES = ("mlaunch/cli/", "mlaunch/__main__.py")


def _library_imports_of_the_cli() -> list[Import]:
    return [
        imp for imp in _library_imports_of("mlaunch.cli") if not imp.source.startswith(CLI_MODULES)
    ]


def test_the_library_never_imports_the_cli() -> None:
    # The library (plan, launcher, settings, trainer, ...) must work without Typer and Rich views.
    bad = _library_imports_of_the_cli()
    assert not bad, "\n".join(map(str, bad))


def test_the_import_scan_sees_every_kind_of_import(tmp_path: Path) -> None:
    # The rules above are only as good as the scan: function-level, relative, ``from X import
    # submodule`` and importlib imports must all be seen, with the line they stand on.
    code = (
        "import a.b\n"
        "def f():\n"
        "    from opentelemetry import sdk\n"
        "    from ..cli.render import span_tree\n"
        "    from . import sibling\n"
        "    importlib.import_module('x.y')\n"
    )
    path = PACKAGE / "launcher" / "example.py"
    found = {(imp.line, imp.module) for imp in imports_in(path, ast.parse(code))}
    assert found == {
        (1, "a.b"),
        (3, "opentelemetry"),
        (3, "opentelemetry.sdk"),
        (4, "mlaunch.cli.render"),
        (4, "mlaunch.cli.render.span_tree"),
        (5, "mlaunch.launcher"),
        (5, "mlaunch.launcher.sibling"),
        (6, "x.y"),
    }


# ---- the layer order (STYLE.md: nothing imports what is above it, no two modules each other) ----


def _top_level_names() -> tuple[str, ...]:
    """mlaunch's packages and top-level modules (``mlaunch.model``, ``mlaunch.envcontract``, ...)."""
    names = {p.stem for p in PACKAGE.glob("*.py") if p.stem not in ("__init__", "__main__")}
    names |= {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    return tuple(sorted(f"mlaunch.{name}" for name in names))


#: Each layer -> what it must never import (a lazy import inside a function counts). ``model`` is
#: the bottom: it imports nothing of mlaunch but itself. ``cli`` is the top: see
#: :func:`test_the_library_never_imports_the_cli`.
LAYER_RULES: dict[str, tuple[str, ...]] = {
    "mlaunch.model": tuple(n for n in _top_level_names() if n != "mlaunch.model"),
    # The run directory's owner sits beside model and envcontract: everything may read it, and it
    # reads nothing of mlaunch (a nemo-lens worker's hook loads it by path, standard library only).
    "mlaunch.rundir": tuple(n for n in _top_level_names() if n != "mlaunch.rundir"),
    "mlaunch.settings": ("mlaunch.trainer", "mlaunch.launcher", "mlaunch.cli"),
    "mlaunch.telemetry": ("mlaunch.launcher", "mlaunch.cli", "mlaunch.trainer"),
    "mlaunch.trace": ("mlaunch.launcher", "mlaunch.cli", "mlaunch.trainer"),
    "mlaunch.receiver": ("mlaunch.launcher",),
    # ``slurm`` builds on the launcher (its status reads the launcher's run records): the
    # launcher is handed what it needs of a job (``capture.request_capture``'s ``status``).
    "mlaunch.launcher": ("mlaunch.slurm", "mlaunch.kube"),
    # ``kube`` sits beside and above ``slurm`` (it reuses the frozen settings of the batch script
    # and the status words); ``slurm`` never reaches Kubernetes.
    "mlaunch.slurm": ("mlaunch.kube", "mlaunch.cli"),
    "mlaunch.kube": ("mlaunch.cli", "mlaunch.doctor"),
}


def _source_module(path: Path) -> str:
    """The dotted module a source file is (a package's ``__init__.py`` is the package)."""
    rel = path.relative_to(REPO).with_suffix("")
    return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


@pytest.mark.parametrize("layer", sorted(LAYER_RULES))
def test_no_layer_imports_a_layer_above_it(layer: str) -> None:
    forbidden = LAYER_RULES[layer]
    bad = sorted(
        {
            str(imp)
            for path in sorted(PACKAGE.rglob("*.py"))
            if _within(_source_module(path), layer)
            for imp in imports_in(path)
            if any(_within(imp.module, f) for f in forbidden)
        }
    )
    assert not bad, "\n".join(bad)


def _extensions() -> dict[str, Path]:
    """The C extensions setup.py declares (``Extension("mlaunch.x._c", sources=[...])``), by
    dotted name: modules whether or not this tree has built them."""
    found: dict[str, Path] = {}
    for node in ast.walk(ast.parse(REPO.joinpath("setup.py").read_text(encoding="utf-8"))):
        if (
            isinstance(node, ast.Call)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Extension"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found[node.args[0].value] = REPO / "setup.py"
    return found


def _modules() -> dict[str, Path]:
    """Every module of mlaunch by dotted name: its sources and its compiled extensions, built or
    not (else ``from mlaunch.telemetry import _cspan`` reads as an import of the package in an
    unbuilt tree, a cycle that is none)."""
    found = {_source_module(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    for p in sorted(PACKAGE.rglob("*.so")):  # _cspan.cpython-311-x86_64-linux-gnu.so -> _cspan
        rel = p.relative_to(REPO)
        found.setdefault(".".join([*rel.parent.parts, p.name.split(".")[0]]), p)
    for name, path in _extensions().items():
        found.setdefault(name, path)
    return found


@functools.cache  # one scan of every source for the tests below (callers copy before changing)
def module_graph() -> dict[str, dict[str, Import]]:
    """module -> {module it imports: the first statement that does}, between mlaunch's modules.

    An imported name resolves to the deepest module it names (``from a.b import c`` is ``a.b.c``
    when that is a module, else ``a.b``). Where one statement names a package and a module in it
    (``from mlaunch.receiver import frontends``), the package is only the path to the module and
    is left out: a submodule's statement does not depend on its package's ``__init__``.
    """
    modules = _modules()
    graph: dict[str, dict[str, Import]] = {}
    for name, path in modules.items():
        if path.suffix != ".py":
            continue
        statements: dict[int, dict[str, Import]] = {}
        for imp in imports_in(path):
            target = imp.module
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                statements.setdefault(imp.line, {}).setdefault(target, imp)
        edges = graph.setdefault(name, {})
        for targets in statements.values():
            for target, imp in targets.items():
                if not any(other.startswith(target + ".") for other in targets):
                    edges.setdefault(target, imp)
    return graph


def import_cycles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The groups of modules that reach each other through imports (Tarjan's strongly connected
    components with more than one module), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def test_no_two_modules_import_each_other() -> None:
    # Module-level and function-level imports alike: when a lower module needs something of a
    # higher one, the thing belongs lower down.
    graph = module_graph()
    cycles = import_cycles(graph)
    lines = [
        f"{' <-> '.join(group)}: "
        + "; ".join(str(imp) for a in group for b, imp in graph[a].items() if b in group)
        for group in cycles
    ]
    assert not cycles, "\n".join(lines)


def test_the_cycle_finder_sees_a_cycle_through_a_lazy_import() -> None:
    # The rule above is only as good as its graph: a cycle closed by a function-level import is
    # one, a package named only on the way to its submodule is not.
    def imp(a: str, b: str) -> Import:
        return Import(a, 1, b)

    graph = {"a": {"b": imp("a", "b")}, "b": {"c": imp("b", "c")}, "c": {"a": imp("c", "a")}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b": imp("a", "b")}, "b": {}}) == []
    graph = module_graph()
    assert "mlaunch.receiver" not in graph["mlaunch.receiver.core"]  # from . import frontends
    # a compiled submodule is a module, built here or not: the package is not imported
    assert "mlaunch.telemetry._cspan" in _extensions()
    assert "mlaunch.telemetry" not in graph["mlaunch.telemetry._recorder"]
