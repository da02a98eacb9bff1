"""benchmarks/speed.py's instruction-set switch (--isa avx2 runs as on a CPU without AVX-512) and
its competing process (--competing)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SPEED = Path(__file__).resolve().parents[1] / "benchmarks" / "speed.py"


def _speed() -> ModuleType:
    spec = importlib.util.spec_from_file_location("speed_bench", SPEED)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.unit
def test_avx2_pins_every_library_and_native_asks_for_nothing() -> None:
    speed = _speed()
    env = speed.isa_env("avx2", {"PATH": "/bin"})
    assert env == {
        "PATH": "/bin",
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert speed.isa_env("avx2", env) is None  # pinned already: no second start
    assert speed.isa_env("native", {"PATH": "/bin"}) is None


@pytest.mark.integration
def test_the_benchmark_says_which_instruction_sets_ran() -> None:
    out = subprocess.run(
        [sys.executable, str(SPEED), "--isa", "avx2", "--workloads", ""],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    line = next(x for x in out.splitlines() if x.startswith("# instruction sets:"))
    assert "ATen AVX2" in line and "forced to AVX2 (--isa avx2)" in line
    assert "native kernel avx512" not in line


@pytest.mark.unit
def test_the_competitor_runs_until_killed() -> None:
    speed = _speed()
    proc = subprocess.Popen([sys.executable, "-c", speed.COMPETITOR])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=3)  # it runs on (a loop, not a script that ends)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode != 0  # it stopped because it was killed


@pytest.mark.unit
@pytest.mark.parametrize(
    ("args", "why"),
    [
        (["--competing", "-1"], "--competing: -1 processes; give 0 or more"),
        (["--competing", "1", "--device", "cuda"], "--competing measures the CPU path"),
    ],
)
def test_a_bad_competing_count_is_one_line_and_exit_2(args: list[str], why: str) -> None:
    out = subprocess.run(
        [sys.executable, str(SPEED), "--workloads", "", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert why in out.stderr.strip().splitlines()[-1]
