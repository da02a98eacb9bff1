"""What ``--help`` and ``fedmosaic list datasets`` tell a new user: every command named, plain
text (no reST markup), every option explained, no option offered that the command lacks."""

from __future__ import annotations

import argparse

import pytest

from fedmosaic.cli import build_parser, main
from fedmosaic.data import datasets


def _parsers() -> list[argparse.ArgumentParser]:
    """The top-level parser and every (nested) subcommand's."""
    out, todo = [], [build_parser()]
    while todo:
        p = todo.pop()
        out.append(p)
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                todo.extend(a.choices.values())
    return out


def test_top_level_help_names_every_command_without_markup(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "``" not in text and ":class:" not in text, text
    for name in ("run", "compare", "list", "partition", "flower"):
        assert f"\n    {name} " in text or f"\n    {name}\n" in text, f"{name} missing:\n{text}"
    # the description itself (not only argparse's list of choices) names the Flower deployment
    description = build_parser().description or ""
    assert "Flower" in description and "``" not in description


@pytest.mark.parametrize("parser", _parsers(), ids=lambda p: p.prog)
def test_every_option_and_argument_has_help(parser: argparse.ArgumentParser):
    missing = [
        "/".join(a.option_strings) or a.dest
        for a in parser._actions
        if not isinstance(a, argparse._SubParsersAction) and not a.help
    ]
    assert not missing, f"{parser.prog}: no help for {missing}"


@pytest.mark.parametrize("parser", _parsers(), ids=lambda p: p.prog)
def test_help_offers_only_options_the_command_has(parser: argparse.ArgumentParser):
    text = parser.format_help()
    known = {s for a in parser._actions for s in a.option_strings}
    mentioned = {w.strip("()[],;.:") for w in text.split() if w.startswith(("--", "(--", "[--"))}
    mentioned = {m.split("=")[0] for m in mentioned if m.startswith("--") and len(m) > 2}
    assert mentioned <= known, f"{parser.prog} --help mentions {sorted(mentioned - known)}"


def test_partition_help_does_not_offer_quiet():
    (pa,) = [p for p in _parsers() if p.prog.endswith(" partition")]
    assert "--quiet" not in pa.format_help()


def test_list_datasets_says_which_are_on_disk(tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    (data / "mnist").mkdir(parents=True)
    for stem in datasets.MNIST_FILES:  # the loaders' file check: names only, nothing is read
        (data / "mnist" / f"{stem}.gz").write_bytes(b"")
    monkeypatch.setenv("FEDMOSAIC_DATA", str(data))
    monkeypatch.setenv("FEDMOSAIC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(datasets, "SYSTEM_DIRS", {})
    assert main(["list", "datasets"]) == 0
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()}
    assert rows["dataset"][:2] == ["on", "disk"]
    assert rows["mnist"][0] == "yes" and str(data / "mnist") in " ".join(rows["mnist"])
    assert rows["fmnist"][0] == "no" and "data.root" in " ".join(rows["fmnist"])
    assert rows["cifar10"][0] == "no"
    assert rows["synthetic"][0] == "yes" and rows["digits"][0] == "yes"
    assert rows["hf"][0] == "-"


def test_where_on_disk_reports_each_emnist_split(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDMOSAIC_DATA", str(tmp_path))
    monkeypatch.setenv("FEDMOSAIC_CACHE", str(tmp_path / "cache"))
    for stem in datasets._emnist_stems("letters"):
        (tmp_path / stem).write_bytes(b"")
    found = datasets.where_on_disk("emnist", datasets.DataConfig())
    assert found == {"emnist-letters": tmp_path, "emnist-balanced": None}
