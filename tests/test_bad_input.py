"""Bad input: a one-line error naming what is wrong, exit 2, nothing written."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
from helpers.experiments import SMALL, tiny_raw, write_toml

from fedmosaic.cli import main
from fedmosaic.config import ConfigError, from_dict


def _with(section: str, key: str, value) -> dict:
    raw = tiny_raw(data=SMALL)
    if section == "":
        raw[key] = value
    else:
        raw.setdefault(section, {})[key] = value
    return raw


# Each of these was silently accepted before (issue 12's list).
BAD = [
    ("train", "lr", math.nan, "train.lr"),
    ("train", "lr", math.inf, "train.lr"),
    ("train", "weight_decay", math.nan, "train.weight_decay"),
    ("train", "weight_decay", -0.1, "train.weight_decay"),
    ("train", "momentum", -1.0, "train.momentum"),
    ("train", "betas", [0.9, math.nan], "train.betas"),
    ("data", "alpha", math.nan, "data.alpha"),
    ("data", "alpha", math.inf, "data.alpha"),
    ("data", "min_size", -1, "data.min_size"),
    ("data", "max_tries", 0, "data.max_tries"),
    ("sim", "workers", -1, "sim.workers"),
    ("sim", "threads", -1, "sim.threads"),
    ("train", "finetune_epochs", -5, "train.finetune_epochs"),
    ("", "seed", 2**70, "seed"),
    ("", "seed", -3, "seed"),
]


@pytest.mark.parametrize(("section", "key", "value", "named"), BAD)
def test_bad_config_values_are_refused_by_name(section, key, value, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        from_dict(_with(section, key, value))


@pytest.mark.parametrize(
    ("algorithm", "named"),
    [
        ({"name": "fedprox", "mu": -1.0}, "algorithm.mu"),
        ({"name": "fedtgp", "tau": math.nan}, "algorithm.tau"),
        ({"name": "fedtgp", "lam": math.nan}, "algorithm.lam"),
        ({"name": "fedtgp", "lam": -0.1}, "lam"),  # FedTGP's own check names it
        ({"name": "fedproto", "lam": math.inf}, "algorithm.lam"),
    ],
)
def test_bad_hyperparameters_are_refused_by_name(algorithm, named):
    raw = tiny_raw(data=SMALL, algorithm=algorithm)
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        from_dict(raw)


def _toml(path: Path, **sections) -> Path:
    raw = tiny_raw(data=SMALL, **sections)
    return write_toml(path, raw)


def test_cli_refuses_before_writing_anything(tmp_path: Path, capsys):
    cfg = _toml(tmp_path / "c.toml", algorithm={"name": "local"}, train={"rounds": 1})
    out = tmp_path / "out"
    cases = [
        ["--checkpoint-every", "-1"],
        ["--baseline", "nope"],  # failed only after the main run was written
        ["--set", "data.dataset=nope"],  # fails while loading data, after the sinks existed
    ]
    for extra in cases:
        capsys.readouterr()
        assert main(["run", str(cfg), "--out", str(out), "--quiet", *extra]) == 2, extra
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) >= 1 and err[0].startswith("error:"), err
        assert not out.exists(), f"{extra}: {sorted(p.name for p in out.iterdir())}"


def test_cli_keeps_another_configurations_finished_run(tmp_path: Path, capsys):
    cfg = _toml(tmp_path / "c.toml", algorithm={"name": "local"}, train={"rounds": 1})
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 0
    before = (out / "results.json").read_bytes()
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--set", "train.lr=0.2"]) == 2
    assert "another configuration" in capsys.readouterr().err
    assert (out / "results.json").read_bytes() == before
    args = ["run", str(cfg), "--out", str(out), "--quiet", "--set", "train.lr=0.2", "--overwrite"]
    assert main(args) == 0
    assert json.loads((out / "results.json").read_text())["config"]["train"]["lr"] == 0.2
    # --out that is a file
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["run", str(cfg), "--out", str(f), "--quiet"]) == 2
    assert f.read_text() == "x"


def test_checkpoints_that_do_not_fit_are_refused_and_change_nothing(
    tmp_path: Path, capsys, monkeypatch
):
    from fedmosaic import checkpoint as ck
    from fedmosaic.core import rounds
    from fedmosaic.report import sinks

    cfg = _toml(tmp_path / "c.toml", algorithm={"name": "fedavg"}, train={"rounds": 3})
    out = tmp_path / "out"
    real = sinks.Sinks.__call__

    def ctrl_c_after_round_2(self, rec):
        real(self, rec)
        if rec["round"] == 2:
            rounds.stop_requested.set()  # what the first Ctrl-C does: a checkpoint is written

    monkeypatch.setattr(sinks.Sinks, "__call__", ctrl_c_after_round_2)
    assert main(["run", str(cfg), "--out", str(out), "--quiet"]) == 130
    monkeypatch.setattr(sinks.Sinks, "__call__", real)
    path = out / ck.FILENAME
    loaded = ck.read_checkpoint(path)
    rows = (out / "rounds.csv").read_bytes()

    def nan_weight(meta, tensors):
        key = next(
            k for k, v in tensors.items() if k.startswith("client/") and v.is_floating_point()
        )
        tensors[key] = tensors[key].clone().fill_(float("nan"))

    def huge(prefix):
        def change(meta, tensors):
            key = next(
                k for k, v in tensors.items() if k.startswith(prefix) and v.is_floating_point()
            )
            tensors[key] = tensors[key].clone().fill_(1e30)

        return change

    cases = {
        "server state 5": lambda m, t: m.update(server_state=5),
        "server state a list": lambda m, t: m.update(server_state={"t": "list", "items": []}),
        "1e30 client weights": huge("client/"),
        "1e30 server weights": huge("server/"),
        "round 999": lambda m, t: m.update(round=999),
        "round not a number": lambda m, t: m.update(round="x"),
        "history": lambda m, t: m["history"]["rounds"].pop(),
        "clients": lambda m, t: m.update(num_clients=10**9),
        "NaN": nan_weight,
        "config": lambda m, t: m.update(config="nope"),
    }
    for what, change in cases.items():
        meta, tensors = json.loads(json.dumps(loaded.meta)), dict(loaded.tensors)
        change(meta, tensors)
        _write_unverified(ck, path, meta, tensors)
        capsys.readouterr()
        forged = path.read_bytes()
        assert main(["run", str(cfg), "--out", str(out), "--quiet", "--resume"]) == 2, what
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "checkpoint" in err[0], (what, err)
        if what.startswith(("server state", "1e30")):
            assert str(path) in err[0], (what, err)
        assert (out / "rounds.csv").read_bytes() == rows, what  # nothing changed
        assert path.read_bytes() == forged, what
        assert not (out / "results.json").exists()


def _write_unverified(ck, path: Path, meta: dict, tensors: dict) -> None:
    """A forged file: a valid digest over malformed content (what an attacker can write)."""
    from safetensors.torch import save_file

    meta_json = json.dumps(meta, allow_nan=True, separators=(",", ":"))
    header = {"format": ck.FORMAT, "meta": meta_json, "digest": ck._digest(meta_json, tensors)}
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=header)


def test_clients_without_training_data_are_refused(tmp_path: Path, capsys):
    """200 clients over 200 samples with min_size 0: most hold nothing to train on (this ran)."""
    cfg = _toml(tmp_path / "c.toml", algorithm={"name": "local"}, train={"rounds": 1})
    out = tmp_path / "out"
    sets = ["data.num_clients=200", "data.min_size=0", "data.alpha=0.05", "data.public_size=0"]
    args = ["run", str(cfg), "--out", str(out), "--quiet"]
    for s in sets:
        args += ["--set", s]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "of 200 clients hold no training examples" in err[0], err
    assert not out.exists()


def test_a_non_utf8_config_names_the_file(tmp_path: Path, capsys):
    cfg = tmp_path / "latin1.toml"
    cfg.write_bytes("seed = 0\n# caf\xe9\n".encode("latin-1"))
    assert main(["run", str(cfg), "--out", str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(cfg) in err[0], err


def test_a_corrupt_results_file_is_named_not_called_another_configuration(tmp_path: Path, capsys):
    import fedmosaic.api as fm
    from fedmosaic.checkpoint import CheckpointError

    cfg = _toml(tmp_path / "c.toml", algorithm={"name": "local"}, train={"rounds": 1})
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--save-models"]) == 0
    models = (out / "final.safetensors").read_bytes()
    for broken in (b"", b"not json", b"[1, 2]", b'{"config": {'):
        (out / "results.json").write_bytes(broken)
        capsys.readouterr()
        assert main(["run", str(cfg), "--out", str(out), "--quiet", "--save-models"]) == 2
        (err,) = capsys.readouterr().err.strip().splitlines()
        assert f"{out / 'results.json'} is not a results document" in err, err
        assert "another configuration" not in err  # --overwrite would lose the kept models
        with pytest.raises(CheckpointError, match="results.json: not a results document"):
            fm.load_run(out)
        with pytest.raises(ConfigError, match=r"pass overwrite=True to run again"):  # the API's
            fm.run(cfg, out=out, save_models=True)
        assert (out / "results.json").read_bytes() == broken
        assert (out / "final.safetensors").read_bytes() == models


def test_an_unreadable_rounds_table_is_written_anew_on_resume(tmp_path: Path, caplog):
    from fedmosaic.report.sinks import CSVSink

    (tmp_path / "rounds.csv").write_bytes(b"round,acc\n1,\x00\xff\xfe\n")
    with caplog.at_level("WARNING", logger="fedmosaic"):
        CSVSink(tmp_path, keep_rounds=1)
    assert "is not a rounds table" in caplog.text
    header = (tmp_path / "rounds.csv").read_text().splitlines()
    assert len(header) == 1 and header[0].startswith("round,")


@pytest.mark.parametrize(
    "args, kwargs, named",
    [
        ((123,), {}, "config = 123"),
        ((None, [5]), {}, "overrides = [5]"),
        ((None, "train.rounds=3"), {}, "overrides = 'train.rounds=3'"),
        ((None, None), {}, "overrides = None"),
        ((None,), {"checkpoint_every": "1"}, "checkpoint_every = '1'"),
        ((None,), {"checkpoint_every": 1.5}, "checkpoint_every = 1.5"),
        ((None,), {"checkpoint_every": True}, "checkpoint_every = True"),
    ],
)
def test_the_api_refuses_arguments_of_the_wrong_type_by_name(
    tmp_path: Path, args: tuple, kwargs: dict, named: str
):
    import fedmosaic.api as fm

    raw = tiny_raw(data=SMALL, algorithm={"name": "local"}, train={"rounds": 1})
    args = tuple(raw if a is None and i == 0 else a for i, a in enumerate(args))
    with pytest.raises(ConfigError, match=re.escape(named)):
        fm.run(*args, out=tmp_path / "o", **kwargs)
    assert not (tmp_path / "o").exists()
