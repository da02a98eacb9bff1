"""A user's own method and encoder, from a plugin file, on both backends and from the CLI."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from conftest import tiny_raw

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
    raw = _raw(plugin, "processes")
    cfg = tmp_path / "c.toml"
    lines = ["seed = 0", f"plugins = {json.dumps(raw['plugins'])}"]
    for section in ("data", "model", "train", "sim", "algorithm"):
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in raw[section].items()]
    cfg.write_text("\n".join(lines) + "\n")
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
