"""Flower stays optional: nothing outside ``fedmosaic/flower`` imports ``flwr``."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "fedmosaic"


def test_core_modules_never_import_flwr():
    code = (
        "import sys\n"
        "import fedmosaic, fedmosaic.core.payload, fedmosaic.core.algorithm, fedmosaic.core.client\n"
        "import fedmosaic.core.rounds, fedmosaic.core.seeding, fedmosaic.algorithms\n"
        "import fedmosaic.experiment, fedmosaic.sim.simulator, fedmosaic.sim.processes\n"
        "import fedmosaic.cli, fedmosaic.flower.project\n"
        "fedmosaic.cli.build_parser()\n"
        "bad = sorted(m for m in sys.modules if m == 'flwr' or m.startswith('flwr.'))\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_no_flwr_import_outside_the_flower_package():
    pattern = re.compile(r"^\s*(import flwr|from flwr)", re.MULTILINE)
    offenders = [
        str(p.relative_to(PACKAGE))
        for p in PACKAGE.rglob("*.py")
        if "flower" not in p.relative_to(PACKAGE).parts[:1]
        and pattern.search(p.read_text(encoding="utf-8"))
    ]
    assert offenders == []


def test_client_app_module_imports_light():
    """Flower starts a process per message: importing the app must not pull in torch."""
    pytest.importorskip("flwr")
    code = (
        "import sys\n"
        "import fedmosaic.flower.app\n"
        "heavy = [m for m in ('torch', 'fedmosaic.experiment', 'fedmosaic.algorithms') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
