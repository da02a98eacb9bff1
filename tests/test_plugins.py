"""A user's own method and encoder, from a plugin file, on both backends and from the CLI."""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path

import pytest
from helpers.experiments import tiny_raw, write_toml

from fedmosaic.cli import main
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.experiment import run_experiment

PLUGIN = textwrap.dedent(
    '''
    """A user's FedAvg with server momentum and a tiny encoder, through the public API only."""
    from collections.abc import Sequence
    from dataclasses import dataclass

    from torch import nn

    from fedmosaic.api import ALGORITHMS, ENCODERS, FAMILIES, SharedWeights, weighted_average


    @ALGORITHMS.register("user_fedavgm")
    @dataclass(frozen=True)
    class UserFedAvgM(SharedWeights):
        supports_heterogeneous = False
        shared = "all"
        momentum: float = 0.5

        def aggregate(self, state, uploads, round_num):
            mean = weighted_average([u.payload.state for u in uploads], [u.weight for u in uploads])
            return {k: state[k] + (1 + self.momentum) * (mean[k] - state[k])
                    if v.is_floating_point() else v for k, v in mean.items()}


    @ENCODERS.register("user_mlp")
    def user_mlp(channels, size):
        return nn.Sequential(nn.Flatten(), nn.Linear(channels * size * size, 32), nn.ReLU()), 32


    FAMILIES.add("user_family", ("user_mlp",))
    '''
)


@pytest.fixture(scope="module")
def plugin(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("plugin") / "user_method.py"
    path.write_text(PLUGIN)
    return path


def _raw(plugin: Path, backend: str) -> dict:
    raw = tiny_raw(
        data={"synthetic_shape": [1, 16, 16]},
        model={"family": "user_family"},
        algorithm={"name": "user_fedavgm", "momentum": 0.5},
        sim={"backend": backend, "workers": 2, "threads": 1},
    )
    raw["plugins"] = [str(plugin)]
    return raw


def test_a_plugin_method_runs_identically_on_both_backends(plugin: Path):
    serial = run_experiment(from_dict(_raw(plugin, "serial")), progress=False)
    procs = run_experiment(from_dict(_raw(plugin, "processes")), progress=False)
    assert [r["acc_weighted"] for r in serial["rounds"]] == [
        r["acc_weighted"] for r in procs["rounds"]
    ]
    assert serial["clients"][0]["arch"] == "user_mlp"


def test_a_plugin_from_the_command_line(plugin: Path, tmp_path: Path):
    cfg = write_toml(tmp_path / "c.toml", _raw(plugin, "processes"))
    assert main(["run", str(cfg), "--out", str(tmp_path / "o"), "--quiet"]) == 0
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    assert doc["config"]["plugins"] == [str(plugin)]


def test_a_broken_plugin_is_a_config_error_naming_it(tmp_path: Path):
    bad = tmp_path / "broken.py"
    bad.write_text("raise RuntimeError('boom')\n")
    raw = tiny_raw()
    raw["plugins"] = [str(bad)]
    with pytest.raises(ConfigError, match="broken.py.*boom"):
        from_dict(raw)
    raw["plugins"] = ["no_such_module_xyz"]
    with pytest.raises(ConfigError, match="no_such_module_xyz"):
        from_dict(raw)


@pytest.fixture
def fresh_cli_plugins(monkeypatch):
    """``--plugin`` records plugins for the rest of the process: each test starts without."""
    from fedmosaic import config

    monkeypatch.setattr(config, "_CLI_PLUGINS", [])


def test_the_plugin_option_on_the_command_line(plugin: Path, tmp_path: Path, fresh_cli_plugins):
    raw = _raw(plugin, "processes")
    raw["plugins"] = []
    cfg = write_toml(tmp_path / "c.toml", raw)
    out = tmp_path / "o"
    # The workers are fresh interpreters: they know the method only through the recorded option.
    args = ["run", str(cfg), "--out", str(out), "--quiet", "--plugin", str(plugin)]
    assert main(args) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["plugins"] == [str(plugin.resolve())]


def test_list_shows_what_a_plugin_registers(plugin: Path, capsys, fresh_cli_plugins):
    assert main(["list", "algorithms", "--plugin", str(plugin)]) == 0
    assert "user_fedavgm" in capsys.readouterr().out


def test_a_relative_plugin_path_is_taken_beside_its_config(
    plugin: Path, tmp_path: Path, monkeypatch
):
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "mine.py").write_text(PLUGIN.replace("user_", "beside_"))
    raw = _raw(plugin, "serial")
    raw["plugins"] = ["mine.py"]
    raw["algorithm"]["name"] = "beside_fedavgm"
    raw["model"]["family"] = "beside_family"
    write_toml(folder / "c.toml", raw)
    monkeypatch.chdir(tmp_path)  # not the config's folder
    from fedmosaic.config import load

    cfg = load(folder / "c.toml")
    assert cfg.plugins == [str((folder / "mine.py").resolve())]


def test_installed_packages_register_through_entry_points(tmp_path: Path, monkeypatch):
    from fedmosaic import config
    from fedmosaic.algorithms import ALGORITHMS

    (tmp_path / "ep_user_pkg.py").write_text(
        "from dataclasses import dataclass\n"
        "from fedmosaic.algorithms.fedavg import FedAvg\n"
        "from fedmosaic.api import ALGORITHMS\n"
        "ALGORITHMS.register('ep_fedavg')(dataclass(frozen=True)(type('EP', (FedAvg,), {})))\n"
    )
    info = tmp_path / "ep_user_pkg-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-user-pkg\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[fedmosaic.algorithms]\nmine = ep_user_pkg\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(config, "_entry_points_loaded", False)
    monkeypatch.setattr(ALGORITHMS, "_items", dict(ALGORITHMS._items))  # undone after the test
    assert "ep_fedavg" not in ALGORITHMS
    raw = tiny_raw(algorithm={"name": "ep_fedavg"}, model={"family": "cnn1"})
    assert from_dict(raw).algorithm["name"] == "ep_fedavg"  # loaded before names are looked up
    (info / "entry_points.txt").write_text("[fedmosaic.models]\nbad = no_such_module_ep\n")
    monkeypatch.setattr(config, "_entry_points_loaded", False)
    with pytest.raises(ConfigError, match="entry point fedmosaic.models:bad"):
        config.load_entry_points()


def _marker_plugin(folder: Path) -> tuple[Path, Path]:
    """A plugin file that leaves a marker file behind when it is imported (it runs code)."""
    marker = folder / "plugin_ran"
    plugin = folder / "evil.py"
    plugin.write_text(f"from pathlib import Path\nPath({str(marker)!r}).write_text('ran')\n")
    return plugin, marker


@pytest.mark.parametrize(
    ("bad", "key"), [({"lr": math.nan}, "train.lr"), ({"rounds": -1}, "train.rounds")]
)
def test_a_plugin_is_not_imported_when_the_config_is_invalid(tmp_path: Path, bad, key):
    plugin, marker = _marker_plugin(tmp_path)
    raw = tiny_raw(train=bad)
    raw["plugins"] = [str(plugin)]
    with pytest.raises(ConfigError, match=key):
        from_dict(raw)
    assert not marker.exists()
    raw["train"] = dict(tiny_raw()["train"])  # the same config, valid: now the plugin runs
    from_dict(raw)
    assert marker.exists()


@pytest.mark.parametrize("bad", ["train.lr=nan", "train.rounds=-1"])
def test_the_command_line_refuses_an_invalid_config_before_its_plugins(
    tmp_path: Path, capsys, bad: str
):
    plugin, marker = _marker_plugin(tmp_path)
    raw = tiny_raw()
    raw["plugins"] = [str(plugin)]
    cfg = write_toml(tmp_path / "c.toml", raw)
    out = tmp_path / "o"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--set", bad]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and bad.split("=")[0] in err[0], err
    assert not marker.exists() and not out.exists()
