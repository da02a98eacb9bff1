"""The README's main job on real Fashion-MNIST, shrunk to fit the test budget."""

import pytest

from fedmosaic.cli import default_config_path
from fedmosaic.config import load
from fedmosaic.experiment import run_experiment


@pytest.mark.slow
def test_default_job_learns_on_real_fmnist():
    pytest.importorskip("fedmosaic.data")
    from pathlib import Path

    if not Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz").exists():
        pytest.skip("Debian's dataset-fashion-mnist is not installed")
    cfg = load(
        default_config_path(),
        ["data.subsample=0.05", "train.rounds=3", "sim.progress=false", "sim.check_wire=true"],
    )
    doc = run_experiment(cfg, progress=False)
    accs = [r["acc_weighted"] for r in doc["rounds"]]
    # Dirichlet(0.1) clients hold ~2-3 classes each: a personalized model beats chance (10%) fast.
    assert accs[-1] > 0.5, accs
    assert doc["config"]["data"]["dataset"] == "fmnist"
