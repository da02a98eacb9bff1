"""The docs site's generated reference pages: up to date with the code, and complete (every config
key with a type, default and a meaning; every CLI option with its help)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from fedmosaic import reference
from fedmosaic.config import CHOICES, SECTIONS

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_generated_pages_are_up_to_date():
    assert reference.stale(DOCS) == [], (
        "docs/reference/ is stale: run `python -m fedmosaic.reference` and commit the pages"
    )


def test_stale_detects_an_edited_page(tmp_path):
    # the check must be able to fail: a fresh copy passes, an edited one does not
    for rel, text in reference.pages().items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    assert reference.stale(tmp_path) == []
    page = tmp_path / reference.CONFIG_PAGE
    page.write_text(page.read_text().replace("data.subsample", "data.sub_sample"))
    assert reference.stale(tmp_path) == [reference.CONFIG_PAGE]
    assert reference.main(["--check", "--docs", str(tmp_path)]) == 1


def test_outside_a_checkout_the_generator_creates_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no docs/ here
    assert reference.main([]) == 2
    assert "no docs folder at docs" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_every_config_field_has_a_meaning():
    assert reference.missing_meanings() == [], "add a comment saying what the field means"


def test_a_field_without_a_comment_is_found():
    @dataclasses.dataclass
    class Section:
        # the block above a field explains it
        documented: int = 1
        trailing: str = "x"  # so does a comment at the end of its line
        bare: float = 0.5

    assert reference.field_comments(Section) == {
        "documented": "the block above a field explains it",
        "trailing": "so does a comment at the end of its line",
    }


def test_config_page_lists_every_key_with_default_and_choices():
    page = reference.config_page()
    for section, cls in SECTIONS.items():
        assert f"## `[{section}]`" in page
        for f in dataclasses.fields(cls):
            assert f"| `{section}.{f.name}` |" in page, f"{section}.{f.name} missing"
    row = next(line for line in page.splitlines() if line.startswith("| `data.subsample` |"))
    assert "`float` | `1.0` |" in row and "quick experiments" in row
    for dotted, choices in CHOICES.items():
        row = next(line for line in page.splitlines() if line.startswith(f"| `{dotted}` |"))
        assert all(f"`{c}`" in row for c in choices), row
    assert "| `algorithm.name` |" in page and "(../algorithms/fedproto.md)" in page


def test_cli_page_has_every_command_and_option():
    page = reference.cli_page()
    for cmd in ("run", "compare", "list", "partition", "flower", "flower app"):
        assert f"## `fedmosaic {cmd}`" in page
    for option in ("--set SECTION.KEY=VALUE", "--checkpoint-every K", "--run-config KEY=VALUE"):
        assert f"| `{option}` |" in page
    assert "runs/&lt;config&gt;-&lt;hash&gt;" in page  # no stray HTML tags in the site
