"""Converged budgets: ``train.plateau_*`` stops a run once validation accuracy has plateaued."""

from __future__ import annotations

import pytest
from helpers.experiments import tiny_raw

from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core.rounds import plateaued
from fedmosaic.experiment import run_experiment


def _rounds(vals: list[float]) -> list[dict[str, float]]:
    return [{"round": i + 1, "val_acc_weighted": v} for i, v in enumerate(vals)]


def test_plateau_rule_by_hand():
    # 10 rounds, window 0.2: best of rounds 1..8 = 0.80, best of 1..10 = 0.805 -> gain 0.005.
    vals = [0.1, 0.5, 0.7, 0.75, 0.78, 0.79, 0.795, 0.80, 0.805, 0.80]
    assert plateaued(_rounds(vals), delta=0.01, window=0.2, min_rounds=5)
    gain = vals[8] - vals[7]  # exactly the float the rule computes (0.805 - 0.80 > 0.005)
    assert not plateaued(_rounds(vals), delta=gain, window=0.2, min_rounds=5)  # gain !< gain
    assert plateaued(_rounds(vals), delta=gain + 1e-12, window=0.2, min_rounds=5)
    assert not plateaued(_rounds(vals), delta=0.01, window=0.2, min_rounds=11)  # too early
    # window 0.5: best of 1..5 = 0.78 -> gain 0.025
    assert not plateaued(_rounds(vals), delta=0.02, window=0.5, min_rounds=5)
    assert plateaued(_rounds(vals), delta=0.03, window=0.5, min_rounds=5)
    # test accuracy never decides: without validation records nothing stops
    no_val = [{"round": i + 1, "acc_weighted": 0.5} for i in range(30)]
    assert not plateaued(no_val, delta=0.5, window=0.2, min_rounds=1)
    assert not plateaued(_rounds(vals), delta=0.0, window=0.2, min_rounds=1)  # off


def test_a_run_stops_on_its_plateau_and_says_so():
    data = {"synthetic_shape": [1, 16, 16], "num_clients": 4, "val_fraction": 0.2}
    train = {"rounds": 40, "plateau_delta": 0.5, "plateau_min_rounds": 3}
    raw = tiny_raw(data=data, train=train, algorithm={"name": "fedavg"})
    doc = run_experiment(from_dict(raw), progress=False)
    # A gain of 50 points over the last 20% is never reached after round 3: it stops there.
    assert [r["round"] for r in doc["rounds"]] == [1, 2, 3]
    assert doc["rounds"][-1]["plateau"] is True
    assert doc["summary"]["rounds_run"] == doc["summary"]["stopped_on_plateau"] == 3
    # Off: the whole cap runs, and the first three rounds are the same numbers.
    raw["train"]["plateau_delta"] = 0.0
    raw["train"]["rounds"] = 4
    full = run_experiment(from_dict(raw), progress=False)
    assert len(full["rounds"]) == 4 and "stopped_on_plateau" not in full["summary"]
    assert [r["acc_weighted"] for r in full["rounds"][:3]] == [
        r["acc_weighted"] for r in doc["rounds"]
    ]


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("plateau_delta", -0.1, "plateau_delta"),
        ("plateau_delta", float("nan"), "plateau_delta"),
        ("plateau_window", 1.0, "plateau_window"),
        ("plateau_window", 0.0, "plateau_window"),
        ("plateau_min_rounds", 0, "plateau_min_rounds"),
    ],
)
def test_plateau_keys_are_checked(key: str, value: float, match: str):
    with pytest.raises(ConfigError, match=match):
        from_dict(tiny_raw(data={"val_fraction": 0.2}, train={key: value}))


def test_plateau_stop_needs_a_validation_split():
    with pytest.raises(ConfigError, match="val_fraction"):
        from_dict(tiny_raw(data={"val_fraction": 0.0}, train={"plateau_delta": 0.001}))


def test_a_plateau_stopped_run_keeps_the_models_of_its_last_round(tmp_path):
    from helpers.experiments import write_toml

    import fedmosaic.api as fm
    from fedmosaic.cli import main

    data = {"synthetic_shape": [1, 16, 16], "num_clients": 4, "val_fraction": 0.2}
    train = {"rounds": 40, "plateau_delta": 0.5, "plateau_min_rounds": 3}
    cfg = write_toml(tmp_path / "c.toml", tiny_raw(data=data, train=train))
    out = tmp_path / "o"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--save-models"]) == 0
    kept = fm.load_run(out)
    assert kept.rounds_done == 3 == kept.summary["stopped_on_plateau"]
    assert not (out / "checkpoint.safetensors").exists()
