"""A command line that starts fast and refuses in one line: ``--version``, ``--help`` and a
mistake in a config's tables import no torch; every refusal says ``error:``; a mistyped key or
name gets a "did you mean"; a folder holding another configuration's run names what differs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.experiments import tiny_raw, write_toml

from fedmosaic.cli import main
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core.checks import did_you_mean
from fedmosaic.runfolder import RunFolder, config_differences

# Runs the command line as ``fedmosaic ARGS...`` does, then says whether torch was imported.
_PROBE = """
import sys
from fedmosaic.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:
    code = exc.code
print("TORCH IMPORTED" if "torch" in sys.modules else "no torch", file=sys.stderr)
sys.exit(code)
"""


def _run(args: list[str], cwd: Path, *python_flags: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FEDMOSAIC_")}
    return subprocess.run(
        [sys.executable, *python_flags, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_version_imports_no_torch(tmp_path: Path):
    done = _run(["-m", "fedmosaic", "--version"], tmp_path, "-X", "importtime")
    assert done.returncode == 0 and done.stdout.startswith("fedmosaic "), done
    imported = [line for line in done.stderr.splitlines() if "torch" in line]
    assert not imported, imported[:5]


HELP = [
    ["--help"],
    ["run", "--help"],
    ["compare", "--help"],
    ["list", "--help"],
    ["partition", "--help"],
    ["flower", "--help"],
    ["flower", "app", "--help"],
    ["flower", "simulate", "--help"],
]
CONFIG_ERRORS = [
    (["run", "--set", "train.lrr=0.1"], "unknown key 'train.lrr'"),
    (["run", "--set", "trian.lr=0.1"], "unknown key 'trian'"),
    (["run", "--set", "train.lr=nan"], "train.lr = nan must be a finite number"),
    (["run", "--set", "train.lr=fast"], "train.lr = 'fast' has type str"),
    (["run", "--set", "data.num_clients=0"], "data.num_clients = 0 must be >= 1"),
    (["run", "--set", "server.aggregator=avg"], "server.aggregator = 'avg'"),
    (["partition", "--set", "data.alpha=-1"], "data.alpha = -1.0 must be > 0"),
    (["compare", "no-such-suite"], "no-such-suite"),
]


@pytest.mark.parametrize("args", HELP, ids=" ".join)
def test_help_imports_no_torch(tmp_path: Path, args: list[str]):
    done = _run(["-c", _PROBE, *args], tmp_path)
    assert done.returncode == 0 and "usage: fedmosaic" in done.stdout, done
    assert done.stderr.strip().splitlines()[-1] == "no torch", done.stderr


@pytest.mark.parametrize(
    ("args", "said"), CONFIG_ERRORS, ids=[" ".join(a) for a, _ in CONFIG_ERRORS]
)
def test_config_error_imports_no_torch(tmp_path: Path, args: list[str], said: str):
    done = _run(["-c", _PROBE, *args], tmp_path)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done
    assert lines[0].startswith("error: ") and said in lines[0], lines
    assert lines[1:] == ["no torch"], lines
    assert not list(tmp_path.iterdir())  # nothing written


def test_config_and_cli_modules_import_no_torch(tmp_path: Path):
    code = (
        "import sys, fedmosaic.cli, fedmosaic.config, fedmosaic.core.checks, fedmosaic.numerics\n"
        "fedmosaic.cli.build_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])"
    )
    done = _run(["-c", code], tmp_path)
    assert done.returncode == 0 and done.stdout.strip() == "[]", done


# ---- one prefix ------------------------------------------------------------------------------


def test_every_refusal_says_error_not_config_error(tmp_path: Path, capsys):
    cfg = write_toml(tmp_path / "c.toml", tiny_raw(algorithm={"name": "local"}))
    cases = [
        ["run", "--set", "train.lrr=0.1"],  # a ConfigError
        ["run", str(cfg), "--checkpoint-every", "-1", "--out", str(tmp_path / "o")],
        ["run", str(tmp_path / "missing.toml")],
        ["flower", "app", str(cfg), "--out", str(tmp_path / "app"), "--run-config", "nokey"],
    ]
    for args in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), (args, err)
        assert "config error" not in err[0]


def _refused(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``fedmosaic ARGS`` refused: exit 2 and one stderr line starting ``error:``, returned."""
    try:
        code = main(args)
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), (args, code, err)
    return err[0]


def test_bad_arguments_are_one_line_naming_them_and_write_nothing(tmp_path: Path, capsys):
    cfg = write_toml(tmp_path / "c.toml", tiny_raw(algorithm={"name": "local"}))
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    app = ["flower", "app", str(cfg), "--insecure", "--out"]
    cases = {
        # argparse's refusals: one line, not the usage block first
        ("verify", str(cfg), "--rounds", "abc"): "--rounds: invalid int value",
        ("run", str(cfg), "--out", ""): "--out: '' names no folder",
        ("compare", "fedtgp_table10", "--list", "--seeds", "a,b"): "--seeds: 'a,b'",
        ("compare", "fedtgp_table10", "--list", "--methods", ""): "--methods: '' names nothing",
        ("compare", "fedtgp_table10", "--list", "--settings", ","): "--settings: ',' names",
        ("compare", "fedtgp_table10", "--list", "--checkpoint-every", "-3"): "-3 must be >= 0",
        # a value no split can use, whatever the partition
        ("run", str(cfg), "--set", "data.partition=iid", "--set", "data.alpha=-1"): "data.alpha",
        ("run", str(tmp_path / "adir")): "'" + str(tmp_path / "adir") + "' is a folder, not a file",
        ("partition", str(cfg), "--png", str(tmp_path / "adir")): "must name a .png file",
        ("partition", str(cfg), "--png", str(tmp_path / "no" / "x.png")): "does not exist",
        (*app, ""): "--out: '' names no folder",
        (*app, str(tmp_path / "afile")): "is a file, not a folder",
        (*app, str(tmp_path / "p"), "--superlink", "host:99999"): "--superlink 'host:99999'",
    }
    for args, said in cases.items():
        assert said in _refused(list(args), capsys), args
    certs = ["flower", "app", str(cfg), "--out", str(tmp_path / "p"), "--root-certificates"]
    assert "is not a file" in _refused([*certs, str(tmp_path / "no.pem")], capsys)
    assert sorted(q.name for q in tmp_path.iterdir()) == ["adir", "afile", "c.toml"]


def test_flower_app_writes_only_into_a_new_empty_or_own_folder(tmp_path: Path, capsys):
    cfg = write_toml(tmp_path / "c.toml", tiny_raw(algorithm={"name": "local"}))
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "pyproject.toml").write_text("[project]\nname = 'theirs'\n")
    app = ["flower", "app", str(cfg), "--insecure", "--out"]
    assert "not a fedmosaic Flower app" in _refused([*app, str(theirs)], capsys)
    assert [q.name for q in theirs.iterdir()] == ["pyproject.toml"]  # untouched
    assert (theirs / "pyproject.toml").read_text() == "[project]\nname = 'theirs'\n"
    ours = tmp_path / "ours"
    assert main([*app, str(ours)]) == 0
    assert main([*app, str(ours), "--run-config", "round-timeout=60"]) == 0  # rewritten
    assert "round-timeout = 60" in (ours / "pyproject.toml").read_text()


# ---- did you mean ----------------------------------------------------------------------------


def test_did_you_mean_suffix():
    assert did_you_mean("lrr", ["lr", "momentum"], "train.{}") == "; did you mean 'train.lr'?"
    assert did_you_mean("fedavgg", ["fedavg", "fedavgm", "local"]) == (
        "; did you mean 'fedavg' or 'fedavgm'?"
    )
    assert did_you_mean("zzzz", ["lr", "momentum"]) == ""


@pytest.mark.parametrize(
    ("change", "suggested"),
    [
        ({"train": {"lrr": 0.1}}, "train.lr"),
        ({"data": {"num_client": 3}}, "data.num_clients"),
        ({"trian": {"lr": 0.1}}, "train.lr"),  # the section mistyped: the key it meant
        ({"sevrer": {"nothing_like_this": 1}}, "server"),
        ({"sed": 3}, "seed"),
        ({"algorithm": {"name": "fedavgg"}}, "fedavg"),
        ({"algorithm": {"name": "fedprox", "muu": 0.1}}, "algorithm.mu"),
        ({"model": {"family": "htfe8-gra"}}, "htfe8-gray"),
        ({"model": {"family": "resnet81"}}, "resnet18"),
    ],
)
def test_unknown_keys_and_names_suggest_the_closest(change: dict, suggested: str):
    raw = tiny_raw()
    for section, values in change.items():
        if isinstance(values, dict) and section != "algorithm":
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    with pytest.raises(ConfigError) as err:
        from_dict(raw)
    # the suggestion closes the line: "; did you mean 'x'?" or "; did you mean 'x' or 'y'?"
    message = str(err.value)
    tail = message[message.rindex("; did you mean ") :]
    assert f"'{suggested}'" in tail and tail.endswith("?"), message


def test_unknown_key_far_from_every_name_gets_no_suggestion():
    with pytest.raises(ConfigError) as err:
        from_dict(tiny_raw(train={"qqqqqq": 1}))
    assert "did you mean" not in str(err.value)
    assert "unknown key 'train.qqqqqq'; valid keys: " in str(err.value)


def test_unknown_dataset_suggests_the_closest():
    from fedmosaic.config import DataConfig
    from fedmosaic.data.datasets import DatasetError, load_dataset

    with pytest.raises(DatasetError, match=r"; did you mean 'fmnist'( or '\w+')?\?$"):
        load_dataset(DataConfig(dataset="fmnis"), 0)


def test_cli_prints_the_suggestion(capsys):
    assert main(["run", "--set", "train.lrr=0.1"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: unknown key 'train.lrr'") and line.endswith(
        "did you mean 'train.lr'?"
    ), line


# ---- a folder holding another configuration's run ---------------------------------------------


def test_another_configurations_run_names_the_differing_keys(tmp_path: Path, capsys):
    cfg = write_toml(tmp_path / "c.toml", tiny_raw(algorithm={"name": "local"}))
    out = tmp_path / "out"
    out.mkdir()
    finished = {"config": from_dict(tiny_raw(algorithm={"name": "local"})).to_dict()}
    (out / "results.json").write_text(json.dumps(finished))
    args = ["run", str(cfg), "--out", str(out), "--quiet", "--set", "train.lr=0.2"]
    assert main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {out} holds a finished run of another configuration"), line
    assert "(train.lr = 0.05 there, 0.2 here)" in line, line
    assert "--overwrite" in line
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]  # nothing else written


def test_config_differences_first_keys_both_values_and_count():
    base = from_dict(tiny_raw()).to_dict()
    other = from_dict(
        tiny_raw(train={"lr": 0.1, "rounds": 5}, data={"alpha": 0.5}, algorithm={"name": "local"})
    ).to_dict()
    said = config_differences(base, other, shown=2)
    assert (
        said
        == "data.alpha = 1.0 there, 0.5 here; train.rounds = 2 there, 5 here; and 2 more key(s)"
    )
    assert config_differences(base, base) == ""
    # keys that do not change results are not differences (sim.progress is neutral)
    quiet = from_dict(tiny_raw(sim={"progress": True})).to_dict()
    assert config_differences(base, quiet) == ""


def test_refusal_of_an_unreadable_config_names_no_keys(tmp_path: Path):
    (tmp_path / "results.json").write_text(json.dumps({"rounds": []}))
    with RunFolder(tmp_path) as folder, pytest.raises(ConfigError) as err:
        folder.check(from_dict(tiny_raw()))
    assert str(err.value).startswith(f"{tmp_path} holds a finished run of another configuration:")
