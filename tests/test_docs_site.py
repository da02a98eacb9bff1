"""The documentation site (mkdocs.yml + docs/) builds with ``mkdocs build --strict``: every page in
the navigation, no broken link or anchor, the API reference rendered from the code."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fedmosaic.report.suite import SUITE_KEYS

ROOT = Path(__file__).resolve().parents[1]
DOCS_TOOLS = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
MISSING = [m for m in DOCS_TOOLS if importlib.util.find_spec(m.split(".")[0]) is None]
needs_mkdocs = pytest.mark.skipif(
    bool(MISSING),
    reason=f"the docs extra is not installed ({', '.join(MISSING)}): pip install -e '.[docs]' "
    "(scripts/setup.sh does)",
)


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # Material's banner, not a build warning
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@needs_mkdocs
def test_the_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    proc = _build(ROOT / "mkdocs.yml", site)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config_page = (site / "reference" / "config" / "index.html").read_text()
    assert "data.subsample" in config_page and "sim.backend" in config_page
    api_page = (site / "reference" / "api" / "index.html").read_text()
    assert "load_run" in api_page and "run_flower_in_memory" in api_page  # mkdocstrings ran
    # the committed grid cells are data, not pages
    assert not list((site / "results").rglob("results.json"))


@needs_mkdocs
def test_the_site_settings_refuse_a_broken_link(tmp_path):
    """The validation settings of mkdocs.yml turn a broken link into a failed build."""
    import yaml

    settings = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text("# Home\n\n[a page](page.md)\n")
    (docs / "page.md").write_text("# Page\n\n[back](index.md#home)\n")
    config = {
        "site_name": "t",
        "theme": settings["theme"],
        "validation": settings["validation"],
        "markdown_extensions": settings["markdown_extensions"],
        "nav": ["index.md", "page.md"],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    assert _build(tmp_path / "mkdocs.yml", tmp_path / "ok").returncode == 0
    for broken in ("[x](missing.md)", "[x](../README.md)", "[x](index.md#no-such-anchor)"):
        (docs / "page.md").write_text(f"# Page\n\n{broken}\n")
        proc = _build(tmp_path / "mkdocs.yml", tmp_path / "bad")
        assert proc.returncode != 0, f"{broken} passed the strict build"


def _grid_output(rel: Path) -> bool:
    """A grid's own output (``results/full/SUITE/...``: cells, the table ``compare`` writes), which
    mkdocs.yml's ``exclude_docs`` leaves out; the folders' README pages are in the site."""
    return (
        rel.parts[:1] == ("results",)
        and rel.parts[1:2] in (("full",), ("converged",), ("equal",))
        and len(rel.parts) > 3
    )


def test_every_docs_page_is_in_the_navigation():
    """Checked without mkdocs too: a page left out of mkdocs.yml's nav is unreachable."""
    nav = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r"([\w/.-]+\.md)\s*$", nav, flags=re.M))
    pages = {
        p.relative_to(ROOT / "docs").as_posix()
        for p in (ROOT / "docs").rglob("*.md")
        if not _grid_output(p.relative_to(ROOT / "docs"))
    }
    assert pages - listed == set(), f"pages missing from mkdocs.yml's nav: {pages - listed}"


def test_suite_format_page_names_every_key_and_table():
    page = (ROOT / "docs" / "reference" / "suite.md").read_text()
    missing = [k for k in sorted(SUITE_KEYS) if f"| `{k}` |" not in page]
    assert not missing, f"docs/reference/suite.md does not explain suite keys {missing}"
    for table in ("suite", "base", "settings.LABEL", "methods.LABEL", "quick", "converged", "full"):
        assert f"| `[{table}]` |" in page, f"docs/reference/suite.md: no row for [{table}]"
