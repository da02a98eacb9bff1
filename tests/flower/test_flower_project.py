"""``fedmosaic flower app`` writes an app folder that Flower's own validator and builder accept."""

from __future__ import annotations

import zipfile
from io import BytesIO

import pytest
from helpers.experiments import tiny_raw

from fedmosaic.cli import main
from fedmosaic.config import ConfigError, from_dict, tomllib  # tomli on Python 3.10
from fedmosaic.flower.settings import FlowerOptions, experiment_from_run_config

CONFIG = """seed = 3
[data]
dataset = "synthetic"
synthetic_size = 240
synthetic_classes = 4
num_clients = 3
[model]
family = "fedhenn5"
feature_dim = 16
[train]
rounds = 2
[algorithm]
name = "fedtgp"
"""


def test_cli_writes_a_runnable_app(tmp_path, capsys):
    cfg_path = tmp_path / "exp.toml"
    cfg_path.write_text(CONFIG)
    out = tmp_path / "app"
    code = main(
        [
            "flower", "app", str(cfg_path), "--out", str(out), "--set", "train.rounds=3",
            "--superlink", "10.0.0.5:9093", "--root-certificates", str(cfg_path),
            "--run-config", "round-timeout=90", "--run-config", "min-replies=2",
        ]
    )  # fmt: skip
    assert code == 0 and "flwr run" in capsys.readouterr().out
    project = tomllib.loads((out / "pyproject.toml").read_text())
    flwr_app = project["tool"]["flwr"]["app"]
    assert flwr_app["components"] == {
        "serverapp": "fedmosaic.flower.app:server_app",
        "clientapp": "fedmosaic.flower.app:client_app",
    }
    rc = flwr_app["config"]
    cfg = experiment_from_run_config(rc)
    assert cfg.seed == 3 and cfg.train.rounds == 3 and cfg.algorithm["name"] == "fedtgp"
    assert cfg.to_dict() == from_dict(cfg.to_dict()).to_dict()
    options = FlowerOptions.from_run_config(rc)
    assert (options.round_timeout, options.min_replies) == (90.0, 2)
    assert options.results_dir == str((out / "results").resolve())
    connection = tomllib.loads((out / ".flwr" / "config.toml").read_text())["superlink"]
    assert connection["default"] == "fedmosaic"
    assert connection["fedmosaic"] == {
        "address": "10.0.0.5:9093",
        "root-certificates": str(cfg_path.resolve()),
    }
    readme = (out / "README.md").read_text()
    assert "num-partitions=3" in readme and "python -m fedmosaic.flower.node" in readme
    # every Flower process started from these commands keeps its files in the app's .flwr/
    assert f"export FLWR_HOME={(out / '.flwr').resolve()} " in readme
    # run-config overrides apply on top of the embedded experiment (flwr run -c ...)
    assert (
        experiment_from_run_config(
            {**rc, "overrides": "train.rounds=7 algorithm.lam=0.5"}
        ).train.rounds
        == 7
    )


@pytest.mark.filterwarnings("ignore:GitWildMatchPattern:DeprecationWarning")  # inside flwr
def test_flower_validates_and_bundles_the_app(tmp_path):
    pytest.importorskip("flwr")
    from flwr.cli.build import build_fab_from_disk
    from flwr.cli.config_utils import load_and_validate

    from fedmosaic.flower.project import write_app

    out = write_app(from_dict(tiny_raw()), tmp_path / "app", insecure=True)
    config, _ = load_and_validate(out / "pyproject.toml")  # imports the component modules
    assert config["tool"]["flwr"]["app"]["publisher"] == "fedmosaic"
    (out / "results").mkdir()
    (out / "results" / "results.json").write_text("{}")
    names = zipfile.ZipFile(BytesIO(build_fab_from_disk(out))).namelist()
    assert "pyproject.toml" in names and not any(n.startswith(("results", ".flwr")) for n in names)
    assert "insecure = true" in (out / ".flwr" / "config.toml").read_text()


def test_unknown_run_config_key_is_an_error(tmp_path, capsys):
    cfg_path = tmp_path / "exp.toml"
    cfg_path.write_text(CONFIG)
    args = ["flower", "app", str(cfg_path), "--out", str(tmp_path / "a"), "--insecure"]
    assert main([*args, "--run-config", "round-timeot=3"]) == 2
    assert "round-timeot" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("round-timeout", float("nan")),  # a NaN deadline never expires
        ("round-timeout", float("inf")),
        ("max-reply-mb", float("nan")),
        ("max-reply-mb", float("inf")),
        ("min-replies", float("inf")),
        ("min-replies", 1e300),  # accepted before: nothing was ever aggregated
        ("min-replies", 0),
        ("min-replies", 1.5),
        ("eval-timeout", -1),
        ("min-nodes", True),
    ],
)
def test_bad_run_config_numbers_are_config_errors(key, value):
    with pytest.raises(ConfigError, match=key):
        FlowerOptions.from_run_config({key: value})


def test_unbalanced_override_quote_is_a_config_error():
    from fedmosaic.flower.settings import experiment_from_run_config

    with pytest.raises(ConfigError, match="overrides"):
        experiment_from_run_config({"experiment": "{}", "overrides": 'train.rounds="3'})
