"""The static type check: mypy, configured by ``[tool.mypy]`` in pyproject.toml (the files it
covers, how the rest of the package is read), finds no error."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # about 90 s of one core with a cold cache (measured 2026-11-30), under 1 s warm
def test_mypy_finds_no_error():
    if importlib.util.find_spec("mypy") is None:
        pytest.skip("mypy is not installed (the dev extra: pip install -e '.[dev]')")
    cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, f"mypy exit code {out.returncode}:\n{out.stdout}{out.stderr}"
