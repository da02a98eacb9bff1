"""The package's import structure: no cycles, layers point downward, function-level imports only
where they keep an optional dependency optional.

Read from the source with ``ast`` (nothing is imported): every ``import`` of every module, at
module level and inside functions. ``if TYPE_CHECKING:`` imports never run; they may name a
sibling of the same package (core's contracts name each other's types) but nothing above it.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fedmosaic"

# Third-party packages that are optional extras (or need a compiler): imported where used, so the
# package works without them.
OPTIONAL = {"flwr", "matplotlib", "wandb", "tensorboard", "pyarrow", "PIL", "sklearn", "scipy"}
OPTIONAL.add("ray")  # the flower-simulation extra (Flower's Ray runtime)
OPTIONAL.add("dp_accounting")  # the privacy extra (the accountant of [privacy])

# Function-level imports of other kinds, each with its reason. Anything else is hoisted.
ALLOWED_LAZY: dict[tuple[str, str], str] = {
    # importing fedmosaic.config must not pull torch and the model zoo: configs are read (and
    # TOML checked) by tools that never train; validate() needs the registries
    ("fedmosaic.config", "fedmosaic.algorithms"): "registries for validate()",
    ("fedmosaic.config", "fedmosaic.models"): "registries for validate()",
    # what [privacy] asks of the method (its upload's release, its loss) needs torch
    ("fedmosaic.config", "fedmosaic.core.privacy"): "the method's privacy checks in validate()",
    ("fedmosaic.config", "fedmosaic.core.dpsgd"): "the method's privacy checks in validate()",
    ("fedmosaic.config", "fedmosaic.core.secure"): "the method's privacy checks in validate()",
    # Flower starts a ClientApp process per message in deployment: keep its imports light
    ("fedmosaic.flower.app", "*"): "per-message ClientApp processes",
    # the SuperNode launcher's own process never needs torch; its worker imports it at start
    ("fedmosaic.flower.node", "fedmosaic"): "no torch in the SuperNode process",
    # the public API's in-memory Flower run needs the optional flower extra (flwr)
    ("fedmosaic.api", "*"): "flower extra",
    # the command line starts without torch (--version, --help and a config error answer in a
    # fraction of a second): each command imports what it runs once its config passed; and
    # `fedmosaic flower simulate` needs the optional flower-simulation extra (flwr, ray)
    ("fedmosaic.cli", "*"): "a command line that starts without torch",
    # the numerics pins must be in the environment before torch is imported: the command line
    # reads fedmosaic.numerics first, so it imports torch (and the kernels) only when asked
    ("fedmosaic.numerics", "torch"): "pins that must precede torch's import",
    ("fedmosaic.numerics", "fedmosaic"): "pins that must precede torch's import",
    # the native kernels' builder (torch.utils.cpp_extension) is only reached when compiling
    ("fedmosaic.kernels", "torch"): "compiler toolchain only when building",
    # numpy moved numpy.core to numpy._core in 2.0: the pickle allow-list takes whichever exists
    ("fedmosaic.data.datasets", "numpy"): "numpy 1/2 compatibility",
    # torch.utils.tensorboard needs the optional tensorboard package
    ("fedmosaic.report.sinks", "torch"): "tensorboard extra",
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _imports(name: str) -> list[tuple[str, str, int]]:
    """(target, kind, line) of every import in module ``name``; kind: top | function | typing.
    A target inside the package is reduced to the module it names (``from pkg import sub``
    names ``pkg.sub`` when that is a module, else ``pkg``)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    kinds: dict[int, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in ast.walk(node):
                kinds[id(inner)] = "typing"
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(node):
                kinds.setdefault(id(inner), "function")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            out.append((target, kinds.get(id(node), "top"), node.lineno))
    return out


def _owner(target: str) -> str | None:
    """The package module an import lands in, or None outside the package."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _graph(kinds: set[str]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    for name in MODULES:
        for target, kind, _ in _imports(name):
            owner = _owner(target)
            if kind in kinds and owner is not None and owner != name:
                graph[name].add(owner)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_cycles():
    # The test must be able to fail: a two-module and a three-module loop, and a tree.
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == []


def test_the_reader_sees_function_level_and_typing_imports():
    kinds = {(t, k) for t, k, _ in _imports("fedmosaic.flower.app")}
    assert ("fedmosaic.federation", "function") in kinds
    assert any(k == "typing" for _, k, _ in _imports("fedmosaic.core.algorithm"))
    assert "fedmosaic.sim.processes" in _graph({"top"})["fedmosaic.sim.backend"]


def test_no_import_cycles():
    """Every import that runs, module level or inside a function."""
    assert cycles(_graph({"top", "function"})) == []


def test_typing_imports_close_no_cycle_across_packages():
    """With the TYPE_CHECKING imports too, modules that import each other share one package
    (core's contracts name each other's types); across packages the arrows still point one way."""
    for comp in cycles(_graph({"top", "function", "typing"})):
        packages = {m.rpartition(".")[0] for m in comp}
        assert len(packages) == 1, f"an import cycle across packages: {comp}"


@pytest.mark.parametrize(
    ("layer", "may_import"),
    [
        # metrics.py: a leaf of pure functions (accuracy aggregates); core is the plain loop: its
        # fast paths (accel) and their native kernels sit above and beside it
        ("fedmosaic.core", ("fedmosaic.core", "fedmosaic.metrics")),
        # the native kernels: the C++ and its builder, standing alone
        ("fedmosaic.kernels", ("fedmosaic.kernels",)),
        # speed as an opt-in layer above core: fills core.training's seam with the kernels
        ("fedmosaic.accel", ("fedmosaic.core", "fedmosaic.kernels", "fedmosaic.accel")),
        ("fedmosaic.algorithms", ("fedmosaic.core", "fedmosaic.algorithms", "fedmosaic.models")),
        # models: plain torch; the CNN block's native inference comes from the installed
        # accelerator (core.training's seam), never from the kernels directly
        ("fedmosaic.models", ("fedmosaic.core", "fedmosaic.models")),
        # the report reads runs and suites; it never reaches the code that runs them
        # (suite_runner, experiment, api, cli) or a runtime
        (
            "fedmosaic.report",
            (
                "fedmosaic.core",
                "fedmosaic.algorithms",
                "fedmosaic.models",
                "fedmosaic.data",
                "fedmosaic.config",
                "fedmosaic.checkpoint",
                "fedmosaic.provenance",
                "fedmosaic.metrics",
                "fedmosaic.report",
            ),
        ),
    ],
)
def test_lower_layers_import_only_downward(layer: str, may_import: tuple[str, ...]):
    for name in MODULES:
        if name != layer and not name.startswith(layer + "."):
            continue
        for target, _, line in _imports(name):
            owner = _owner(target)
            if owner is None or owner == "fedmosaic":
                continue
            assert any(owner == m or owner.startswith(m + ".") for m in may_import), (
                f"{MODULES[name]}:{line}: {layer} imports {owner}"
            )


# Who may wire the fast paths in: the assembly layer and the runtimes, never core or a method.
WIRES_ACCEL = ("fedmosaic.accel", "fedmosaic.federation", "fedmosaic.sim", "fedmosaic.flower")


def test_accel_is_wired_in_only_by_the_assembly_layer_and_runtimes():
    importers = set()
    for name in MODULES:
        for target, _, line in _imports(name):
            owner = _owner(target) or ""
            if owner == "fedmosaic.accel" or owner.startswith("fedmosaic.accel."):
                importers.add(name)
                assert any(name == m or name.startswith(m + ".") for m in WIRES_ACCEL), (
                    f"{MODULES[name]}:{line}: {name} imports fedmosaic.accel"
                )
    assert "fedmosaic.federation" in importers  # the wiring itself


def test_function_level_imports_only_keep_optional_dependencies_optional():
    stdlib = set(sys.stdlib_module_names)
    for name in MODULES:
        for target, kind, line in _imports(name):
            if kind != "function":
                continue
            root = target.split(".")[0]
            if root in OPTIONAL or root in stdlib and root != "fedmosaic":
                continue
            key = target if _owner(target) is None else _owner(target)
            ok = (name, "*") in ALLOWED_LAZY or any((name, m) in ALLOWED_LAZY for m in (root, key))
            assert ok, f"{MODULES[name]}:{line}: function-level import of {target}: hoist it"


def test_speed_is_installed_by_the_assembly_not_by_an_import():
    """``fedmosaic.accel`` is core's accelerator once a federation or a client is built; importing
    it (or anything) installs nothing."""
    import subprocess
    import sys

    code = (
        "import fedmosaic.accel, fedmosaic.federation, fedmosaic.experiment\n"
        "from fedmosaic.core import training\n"
        "assert training.accelerator() is None, 'installed by an import'\n"
        "from fedmosaic.config import from_dict\n"
        "from fedmosaic.federation import build_federation\n"
        "build_federation(from_dict({'data': {'dataset': 'synthetic', 'synthetic_size': 200, "
        "'num_clients': 2}}), with_clients=False)\n"
        "assert training.accelerator() is fedmosaic.accel.ACCEL\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
