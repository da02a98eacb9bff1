"""W&B sink (a fake ``wandb`` module in sys.modules; the real package in offline mode when it is
installed) and TensorBoard hparams from the flattened config."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from fedmosaic import config
from fedmosaic.config import ConfigError
from fedmosaic.report import sinks

ROUNDS = [
    {"round": 1, "acc_weighted": 0.5, "train_loss": 1.25, "bytes_up": 10, "rejected": []},
    {"round": 2, "acc_weighted": 0.75, "train_loss": float("nan"), "bytes_up": 12},
]


def test_flatten_config_by_hand() -> None:
    flat = sinks.flatten_config(
        {"seed": 3, "data": {"alpha": 0.1, "shape": [1, 28, 28], "root": None}, "x": (1, 2)}
    )
    assert flat == {
        "seed": 3,
        "data.alpha": 0.1,
        "data.shape": "[1, 28, 28]",
        "data.root": "none",
        "x": "[1, 2]",
    }
    full = sinks.flatten_config(config.load(None, []).to_dict())
    assert full["data.partition"] == "dirichlet" and full["algorithm.name"] == "lg_fedavg"
    assert all(isinstance(v, (bool, int, float, str)) for v in full.values())


class FakeRun:
    def __init__(self, **kw: Any) -> None:
        self.init = kw
        self.logged: list[tuple[dict, int]] = []
        self.finished = False

    def log(self, data: dict, step: int) -> None:
        self.logged.append((data, step))

    def finish(self) -> None:
        self.finished = True


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[FakeRun]:
    runs: list[FakeRun] = []
    module = types.ModuleType("wandb")

    def init(**kw: Any) -> FakeRun:
        runs.append(FakeRun(**kw))
        return runs[-1]

    module.init = init  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    return runs


def test_wandb_sink_offline_by_default(tmp_path: Path, fake_wandb: list[FakeRun]) -> None:
    cfg = config.load(None, ['sim.wandb="fm-test"', "data.num_clients=5"])
    s = sinks.Sinks(tmp_path / "run1", tensorboard=False, config=cfg.to_dict())
    for rec in ROUNDS:
        s(rec)
    s.close()
    (run,) = fake_wandb
    assert run.init["project"] == "fm-test" and run.init["mode"] == "offline"
    assert run.init["dir"] == str(tmp_path / "run1") and run.init["name"] == "run1"
    assert run.init["config"]["data.num_clients"] == 5
    assert run.init["config"]["sim.wandb"] == "fm-test"
    # finite numbers only (NaN loss and the list are left out), at step = round
    assert run.logged == [
        ({"acc_weighted": 0.5, "train_loss": 1.25, "bytes_up": 10}, 1),
        ({"acc_weighted": 0.75, "bytes_up": 12}, 2),
    ]
    assert run.finished


def test_wandb_mode_from_environment(
    tmp_path: Path, fake_wandb: list[FakeRun], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "disabled")
    sinks.Sinks(tmp_path, tensorboard=False, config={"sim": {"wandb": "p"}}).close()
    assert fake_wandb[0].init["mode"] == "disabled"


def test_wandb_off_by_default_and_missing_package_is_a_config_error(
    tmp_path: Path, fake_wandb: list[FakeRun], monkeypatch: pytest.MonkeyPatch
) -> None:
    sinks.Sinks(tmp_path, tensorboard=False, config=config.load(None, []).to_dict()).close()
    assert fake_wandb == []
    monkeypatch.delitem(sys.modules, "wandb")
    monkeypatch.setattr(sinks, "wandb_module", lambda: None)
    with pytest.raises(ConfigError, match="sim.wandb = 'p' needs the wandb package"):
        sinks.Sinks(tmp_path, tensorboard=False, config={"sim": {"wandb": "p"}})
    monkeypatch.setattr(config, "_wandb_installed", lambda: False)
    with pytest.raises(ConfigError, match="sim.wandb = 'p' needs the wandb package"):
        config.load(None, ['sim.wandb="p"'])


def test_wandb_key_does_not_change_the_config_hash() -> None:
    from fedmosaic.checkpoint import config_hash

    off = config.load(None, []).to_dict()
    on = {**off, "sim": {**off["sim"], "wandb": "p"}}
    assert config_hash(off) == config_hash(on)


def test_tensorboard_hparams_at_close(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple] = []

    class Writer:
        def __init__(self, log_dir: str) -> None: ...

        def add_scalar(self, tag: str, value: float, step: int) -> None: ...

        def flush(self) -> None: ...

        def add_hparams(self, hparams: dict, metrics: dict, run_name: str) -> None:
            calls.append((hparams, metrics, run_name))

        def close(self) -> None:
            calls.append(("closed",))

    monkeypatch.setattr(sinks, "tensorboard_writer", lambda: Writer)
    cfg = config.load(None, ["train.lr=0.05"])
    s = sinks.Sinks(tmp_path, config=cfg.to_dict())
    for rec in ROUNDS:
        s(rec)
    s.close()
    (hparams, metrics, run_name), closed = calls
    assert closed == ("closed",) and run_name == "."
    assert hparams == sinks.flatten_config(cfg.to_dict()) and hparams["train.lr"] == 0.05
    assert metrics == {"hparams/acc_weighted": 0.75}  # the last round's; its NaN loss left out
    # without a config (as before): no hparams
    calls.clear()
    s = sinks.Sinks(tmp_path)
    s(ROUNDS[0])
    s.close()
    assert calls == [("closed",)]


def test_real_tensorboard_writes_hparams(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    s = sinks.Sinks(tmp_path, config=config.load(None, []).to_dict())
    for rec in ROUNDS:
        s(rec)
    s.close()
    blob = b"".join(p.read_bytes() for p in (tmp_path / "tb").rglob("events.out.tfevents.*"))
    assert b"hparams" in blob and b"data.partition" in blob


def test_real_wandb_offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    s = sinks.Sinks(tmp_path, tensorboard=False, config={"sim": {"wandb": "fedmosaic-test"}})
    for rec in ROUNDS:
        s(rec)
    s.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
