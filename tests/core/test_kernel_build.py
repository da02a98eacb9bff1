"""Building the native kernels: into the user's cache (not the package), with a line on stderr
when the compiler starts and one when it ends, from ``python -m fedmosaic.kernels build`` and
from the first use in a run. The compiler is faked except in the one real build (slow)."""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from torch.utils import cpp_extension

from fedmosaic import kernels
from fedmosaic.kernels import __main__ as kernels_cli

START = re.compile(
    r"^fedmosaic: building native kernels \(one time, about \d+ s\) into (\S+); "
    r"FEDMOSAIC_KERNELS=0 skips them$",
    re.MULTILINE,
)
END = re.compile(r"^fedmosaic: native kernels built in \d+ s$", re.MULTILINE)


@pytest.fixture
def cache(monkeypatch, tmp_path: Path):
    """A fresh user cache, a fake compiler that writes an empty .so (and records its call)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    calls: list[dict] = []

    def fake_load(name, sources, build_directory, **kw):
        calls.append({"name": name, "sources": sources, "dir": build_directory, **kw})
        Path(build_directory, f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(kernels, "_import", lambda so: _FakeModule())
    # a package folder of our own: this checkout's _build (built or not) plays no part
    monkeypatch.setattr(kernels, "__file__", str(tmp_path / "pkg" / "__init__.py"))
    yield SimpleNamespace(root=tmp_path / "cache" / "fedmosaic" / "kernels", calls=calls)
    kernels.reset()  # the next load() decides again, on the real build


class _FakeModule(SimpleNamespace):
    def set_avx512(self, on: bool) -> bool:
        return False

    def avx512_enabled(self) -> bool:
        return False


def test_the_default_build_folder_is_the_users_cache(monkeypatch, tmp_path: Path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    first, package = kernels.build_dirs()
    assert first == tmp_path / "xdg" / "fedmosaic" / "kernels" / kernels._tag()
    assert package == Path(kernels.__file__).with_name("_build")  # still searched, second
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert (
        kernels.build_dirs()[0] == tmp_path / "home" / ".cache/fedmosaic/kernels" / kernels._tag()
    )
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: ignored
    assert kernels.build_dirs()[0].is_relative_to(tmp_path / "home" / ".cache")


def test_build_goes_to_the_cache_and_says_so(cache, capsys):
    so = kernels.build()
    err = capsys.readouterr().err
    assert so == cache.root / kernels._tag() / f"{kernels.NAME}.so" and so.is_file()
    (where,) = START.findall(err)
    assert where == str(cache.root / kernels._tag())
    assert END.search(err), err
    assert err.index("building") < err.index("built in")
    # every unit in one call (ninja compiles them in parallel), with the flags unchanged
    (call,) = cache.calls
    assert call["sources"] == [str(s) for s in kernels.SOURCES] and len(kernels.SOURCES) == 2
    assert call["extra_cflags"] == kernels.CFLAGS and call["extra_ldflags"] == kernels.LDFLAGS
    assert kernels.built() == so
    assert kernels.build() == so and not capsys.readouterr().err  # up to date: silent


def test_a_stale_cache_build_is_rebuilt(cache, capsys):
    so = kernels.build()
    (so.parent / "stamp").write_text("an-older-tag\n")
    assert kernels.built() is None
    assert kernels.build() == so and START.search(capsys.readouterr().err)


def test_an_up_to_date_build_inside_the_package_is_still_found(cache, monkeypatch, tmp_path: Path):
    pkg = tmp_path / "pkg"  # the fixture's package folder
    (pkg / "_build").mkdir(parents=True)
    (pkg / "_build" / f"{kernels.NAME}.so").write_bytes(b"")
    (pkg / "_build" / "stamp").write_text(kernels._tag() + "\n")
    assert kernels.built() == pkg / "_build" / f"{kernels.NAME}.so"  # an existing checkout's
    (pkg / "_build" / "stamp").write_text("stale\n")
    assert kernels.built() is None


def test_the_first_use_in_a_run_says_it_builds(cache, monkeypatch, capsys):
    monkeypatch.setenv(kernels.ENV, "1")
    monkeypatch.setattr(kernels, "cpu_supported", lambda: True)
    kernels.reset()
    assert kernels.load() is not None
    err = capsys.readouterr().err
    assert START.search(err) and END.search(err), err
    kernels.reset()
    kernels.load()  # built now: silent
    assert not capsys.readouterr().err


def test_the_build_command_prints_the_lines(cache, monkeypatch, capsys):
    monkeypatch.setattr(kernels, "cpu_supported", lambda: True)
    monkeypatch.delenv(kernels.ENV, raising=False)
    assert kernels_cli.main(["build"]) == 0
    out, err = capsys.readouterr()
    assert START.search(err) and END.search(err), err
    assert (
        out.strip() == f"fedmosaic.kernels: built {cache.root / kernels._tag() / kernels.NAME}.so"
    )
    assert kernels_cli.main(["build"]) == 0
    assert capsys.readouterr().out.startswith("fedmosaic.kernels: up to date ")


def test_fedmosaic_kernels_0_skips_the_build_command(cache, monkeypatch, capsys):
    monkeypatch.setattr(kernels, "cpu_supported", lambda: True)
    monkeypatch.setenv(kernels.ENV, "0")
    assert kernels_cli.main(["build"]) == 0
    out, err = capsys.readouterr()
    assert "not built (FEDMOSAIC_KERNELS=0)" in out and not err
    assert not cache.calls and not cache.root.exists()
    kernels.reset()
    assert kernels.load() is None and "FEDMOSAIC_KERNELS=0" in kernels.status()


def test_a_failed_build_says_so_and_the_run_takes_the_torch_path(cache, monkeypatch, capsys):
    def broken(name, sources, build_directory, **kw):
        raise RuntimeError("Error building extension 'fedmosaic_linear'\nlinear.cpp: error")

    monkeypatch.setattr(cpp_extension, "load", broken)
    monkeypatch.setattr(kernels, "cpu_supported", lambda: True)
    monkeypatch.setenv(kernels.ENV, "1")
    kernels.reset()
    assert kernels.load() is None
    err = capsys.readouterr().err
    assert START.search(err)
    assert re.search(r"native kernels not built after \d+ s \(linear.cpp: error\); torch path", err)
    assert "linear.cpp: error" in kernels.status()
    assert kernels_cli.main(["build"]) == 1  # the command fails (setup.sh warns and goes on)


def test_a_second_builder_says_it_waits(cache, capsys):
    d = cache.root / kernels._tag()
    d.mkdir(parents=True)
    with open(d / "build.flock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # another process is building
        done: list[Path] = []
        t = threading.Thread(target=lambda: done.append(kernels.build()))
        t.start()
        time.sleep(0.5)
        assert not done
        fcntl.flock(fh, fcntl.LOCK_UN)
    t.join(30)
    err = capsys.readouterr().err
    assert f"fedmosaic: waiting for another process building the native kernels in {d}" in err
    assert done == [d / f"{kernels.NAME}.so"]


def test_the_estimate_counts_the_parallel_units_and_the_load(monkeypatch):
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setenv("MAX_JOBS", "2")
    idle = kernels.build_estimate()
    *units, link = kernels.BUILD_CPU_SECONDS
    assert idle == pytest.approx(max(units) + link)  # two units on two idle CPUs
    monkeypatch.setenv("MAX_JOBS", "1")
    assert kernels.build_estimate() == pytest.approx(sum(units) + link)  # one after the other
    monkeypatch.setenv("MAX_JOBS", "2")
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 6.0, 6.0))
    assert kernels.build_estimate() == pytest.approx(4 * idle)  # 8 runnable on 2 CPUs


@pytest.mark.slow
@pytest.mark.skipif(
    kernels.compiler() is not None or not kernels.cpu_supported(),
    reason="no g++/ninja or no AVX2/FMA here",
)
def test_a_real_build_into_a_fresh_cache(tmp_path: Path):
    """The real compiler (about 10 s on two idle cores, a minute on a busy machine)."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "FEDMOSAIC_KERNELS": "1"}
    cmd = [sys.executable, "-m", "fedmosaic.kernels", "build"]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr
    (where,) = START.findall(run.stderr)
    assert Path(where).parent == tmp_path / "fedmosaic" / "kernels" and END.search(run.stderr)
    assert run.stdout.strip() == f"fedmosaic.kernels: built {where}/{kernels.NAME}.so"
    status = subprocess.run(
        [sys.executable, "-m", "fedmosaic.kernels", "status"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert status.stdout.startswith("fedmosaic.kernels: native (avx"), status.stdout + status.stderr
    assert not status.stderr.count("building native kernels")  # built: nothing to say
