"""fedmosaic installs into a user's own environment: every third-party import is declared, the
sources are Python 3.10, torch is a range (the exact CPU pin lives in constraints.txt), and the
built wheel installs beside an existing torch and runs a federation."""

from __future__ import annotations

import ast
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from helpers.experiments import tiny_raw, write_toml

from fedmosaic.config import tomllib  # tomli on Python 3.10

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fedmosaic"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())

# Import name -> distribution name, where they differ.
DIST_OF = {"PIL": "pillow", "sklearn": "scikit-learn", "yaml": "pyyaml", "tomli": "tomli"}

# Standard-library names that only Python 3.11+ has: (module, attribute) or (module, None).
PY311_ONLY = {
    ("tomllib", None),
    ("typing", "Self"),
    ("typing", "Never"),
    ("typing", "LiteralString"),
    ("typing", "assert_never"),
    ("typing", "reveal_type"),
    ("typing", "NotRequired"),
    ("typing", "Required"),
    ("typing", "dataclass_transform"),
    ("typing", "TypeVarTuple"),
    ("typing", "Unpack"),
    ("datetime", "UTC"),
    ("enum", "StrEnum"),
    ("asyncio", "TaskGroup"),
    ("hashlib", "file_digest"),
    ("contextlib", "chdir"),
}


def _sources() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "_build" not in p.parts)


def _name(req: str) -> str:
    return re.split(r"[\s\[<>=!~;]", req, maxsplit=1)[0].lower().replace("_", "-")


def _declared() -> tuple[set[str], set[str]]:
    """(core dependencies, dependencies of any extra) as normalized distribution names."""
    core = {_name(r) for r in PYPROJECT["project"]["dependencies"]}
    extras = {
        _name(r) for reqs in PYPROJECT["project"]["optional-dependencies"].values() for r in reqs
    }
    return core, extras


def _third_party_imports(path: Path) -> list[tuple[str, bool]]:
    """(top-level import name, at module level?) for every non-stdlib, non-fedmosaic import."""
    tree = ast.parse(path.read_text(), str(path))
    module_level = {id(n) for n in tree.body}
    for node in tree.body:  # imports inside a module-level `if`/`try` still run on import
        if isinstance(node, ast.If | ast.Try):
            module_level |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if top not in sys.stdlib_module_names and top != "fedmosaic":
                found.append((top, id(node) in module_level))
    return found


def test_every_third_party_import_is_declared():
    """A module may import a package only if pyproject declares it: unconditionally (at module
    level) only a core dependency, except fedmosaic.flower, which is the flower extra's own code;
    inside a function an extra's package too (a lazy import that names the extra on failure)."""
    core, extras = _declared()
    wrong = []
    for path in _sources():
        rel = path.relative_to(ROOT)
        for top, at_import in _third_party_imports(path):
            dist = DIST_OF.get(top, top).lower().replace("_", "-")
            allowed = core if at_import and rel.parts[1] != "flower" else core | extras
            if dist not in allowed:
                wrong.append(f"{rel}: imports {top} ({dist} is not declared)")
    assert not wrong, "\n".join(sorted(set(wrong)))


def test_sources_are_python_310():
    """Every source parses as Python 3.10 and uses no standard-library name added in 3.11 outside
    a ``sys.version_info`` branch (only 3.11 is on this machine: this is the 3.10 check)."""
    wrong = []
    for path in _sources() + sorted((ROOT / "tests").rglob("*.py")):
        text = path.read_text()
        tree = ast.parse(text, str(path), feature_version=(3, 10))
        guarded = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "version_info" in ast.unparse(node.test):
                guarded |= {id(n) for n in ast.walk(node)}
        for node in ast.walk(tree):
            if id(node) in guarded:
                continue
            hits = []
            if isinstance(node, ast.Import):
                hits = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                hits = [(node.module, None)] + [(node.module, a.name) for a in node.names]
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                mod = {"_dt": "datetime", "dt": "datetime"}.get(node.value.id, node.value.id)
                hits = [(mod, node.attr)]
            for hit in hits:
                if hit in PY311_ONLY:
                    wrong.append(
                        f"{path.relative_to(ROOT)}:{node.lineno}: {'.'.join(filter(None, hit))}"
                    )
    assert not wrong, "Python 3.11+ only:\n" + "\n".join(wrong)


def test_metadata_installs_beside_any_torch():
    """torch is a range in the package metadata (an exact pin fights a user's CUDA build); the
    exact CPU wheel is pinned in constraints.txt, which scripts/setup.sh installs with."""
    project = PYPROJECT["project"]
    assert project["requires-python"] == ">=3.10"
    (torch,) = [r for r in project["dependencies"] if _name(r) == "torch"]
    assert "==" not in torch and ">=" in torch and "<3" in torch, torch
    assert {"flower", "tracking", "hf", "dev", "docs"} <= set(project["optional-dependencies"])
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text().split()
    setup = (ROOT / "scripts" / "setup.sh").read_text().replace("\\\n", " ")
    installs = [line for line in setup.splitlines() if "pip install" in line]
    assert len(installs) == 4, (
        installs
    )  # torch local, torch from the CPU index, its deps, fedmosaic
    assert all("-c constraints.txt" in line for line in installs), installs  # every one pinned
    assert "--index-url https://download.pytorch.org/whl/cpu" in installs[1]  # never PyPI's CUDA
    assert "pyproject.toml constraints.txt" in setup  # the stamp covers the pin


def _build_wheel(tmp: Path) -> Path:
    """The wheel of a clean copy of the project (no build outputs, compiled kernels or caches)."""
    src = tmp / "src"
    skip = shutil.ignore_patterns("_build", "__pycache__", "*.egg-info", "*.so", "*.o")
    shutil.copytree(PACKAGE, src / "fedmosaic", ignore=skip)
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    build = ["wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp), str(src)]
    out = subprocess.run(
        [sys.executable, "-m", "pip", *build], capture_output=True, text=True, env=_env(tmp)
    )
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = tmp.glob("fedmosaic-*.whl")
    return wheel


def _env(tmp: Path) -> dict[str, str]:
    """No index, no user config (offline, and nothing of this machine's pip set-up leaks in)."""
    drop = ("PYTHONPATH", "VIRTUAL_ENV")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("PIP_")}
    env |= {
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_NO_INDEX": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "HOME": str(tmp / "home"),
        "XDG_CACHE_HOME": str(tmp / "cache"),
        "FEDMOSAIC_KERNELS": "0",  # compiling them is setup's job, not this test's
        "OMP_NUM_THREADS": "1",
    }
    return env


@pytest.mark.slow
def test_wheel_installs_beside_an_existing_torch_and_runs(tmp_path: Path):
    """Build the wheel, install it into a fresh venv that already sees this interpreter's torch
    (a .pth file: torch was installed before fedmosaic, as a user's CUDA build would be), and
    run a tiny federation from it outside the repository: torch is not reinstalled."""
    import torch

    wheel = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in (
        "configs/default.toml",
        "suites/layer_expansion.toml",
        "kernels/linear.cpp",
        "py.typed",
    ):
        assert f"fedmosaic/{shipped}" in names
    assert not [n for n in names if "_build" in n or n.endswith(".so")]
    meta = (
        zipfile.ZipFile(wheel).read(f"{wheel.name.split('-')[0]}-0.1.0.dist-info/METADATA").decode()
    )
    assert "Requires-Python: >=3.10" in meta
    assert "License-Expression: Apache-2.0" in meta and "License-File: LICENSE" in meta
    assert f"{wheel.name.split('-')[0]}-0.1.0.dist-info/licenses/LICENSE" in names
    (torch_req,) = re.findall(r"^Requires-Dist: torch\b.*$", meta, re.MULTILINE)
    assert "==" not in torch_req and ">=2.4" in torch_req and "<3" in torch_req, torch_req

    venv, env = tmp_path / "venv", _env(tmp_path)
    # --without-pip: pip, like torch, comes from the existing environment (a venv's own bundled
    # setuptools would shadow the newer one that torch's metadata asks for)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, env=env)
    py = venv / "bin" / "python"
    site = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
        env=env,
    ).stdout.strip()
    Path(site, "existing_torch.pth").write_text(sysconfig.get_path("purelib") + "\n")

    install = subprocess.run(
        [py, "-m", "pip", "install", str(wheel)], capture_output=True, text=True, env=env
    )
    assert install.returncode == 0, install.stdout + install.stderr
    assert "Successfully installed fedmosaic-0.1.0" in install.stdout
    assert "torch" not in install.stdout.split("Successfully installed")[-1]
    assert not re.search(r"(Collecting|Downloading|Processing) .*torch", install.stdout)

    work = tmp_path / "elsewhere"  # not the repository: its fedmosaic/ must not be picked up
    work.mkdir()
    write_toml(work / "tiny.toml", tiny_raw(train={"rounds": 1}))
    probe = "import fedmosaic, torch; print(fedmosaic.__file__); print(torch.__file__)"
    where = subprocess.run(
        [py, "-c", probe], cwd=work, check=True, capture_output=True, text=True, env=env
    ).stdout.split()
    assert where[0].startswith(str(venv)), where  # the wheel's copy, not the repo's source
    assert where[1] == torch.__file__  # the torch that was there before
    run = subprocess.run(
        [venv / "bin" / "fedmosaic", "run", "tiny.toml", "--out", "out", "--quiet"],
        cwd=work,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert (work / "out" / "results.json").is_file()


def test_a_built_kernel_is_up_to_date_in_the_next_process(monkeypatch, tmp_path: Path):
    """build() stamps the tag a fresh process computes. torch's load() appends its link flags to
    the lists it is given, so the stamp it wrote did not match: the next process found the fresh
    build stale and went through build() again (seen from the wheel: `built()` None right after
    `python -m fedmosaic.kernels build`)."""
    from torch.utils import cpp_extension

    from fedmosaic import kernels

    def load(name: str, sources: list[str], **kw) -> None:
        kw["extra_ldflags"].append("-ltorch")  # as the real one does
        Path(kw["build_directory"], f"{name}.so").write_bytes(b"")

    fresh = list(kernels.LDFLAGS)
    monkeypatch.setattr(kernels, "LDFLAGS", list(fresh))  # a mutation stays in this test
    monkeypatch.setattr(cpp_extension, "load", load)
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    monkeypatch.setattr(kernels, "build_dirs", lambda: [tmp_path])
    so = kernels.build()
    monkeypatch.setattr(kernels, "LDFLAGS", fresh)  # the next process: the module's own flags
    assert kernels.built() == so


def test_flower_without_its_extra_names_the_extra(monkeypatch, tmp_path: Path):
    """The Flower runtime is an extra: without flwr the API says which one to install."""
    from fedmosaic import api

    # As if not installed: every flwr module (an earlier test may have imported flwr.app, which
    # the import system would then find without its parent) and fedmosaic's Flower modules.
    for mod in [m for m in sys.modules if m == "flwr" or m.startswith("flwr.")] or ["flwr"]:
        monkeypatch.setitem(sys.modules, mod, None)
    for mod in [m for m in sys.modules if m.startswith("fedmosaic.flower.")]:
        monkeypatch.delitem(sys.modules, mod)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'fedmosaic\[flower\]'"):
        api.run_flower_in_memory(tiny_raw(), tmp_path / "out")
