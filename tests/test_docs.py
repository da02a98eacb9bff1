"""Every registered algorithm has a page in docs/algorithms/ that names its hyperparameters."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.reference import algorithm_page

PAGES = Path(__file__).resolve().parents[1] / "docs" / "algorithms"
# The built-in methods only: a plugin registered by another test module has no page here.
BUILT_IN = [n for n, c in ALGORITHMS.items() if c.__module__.startswith("fedmosaic.algorithms.")]


def test_the_registry_has_built_in_methods():
    assert len(BUILT_IN) >= 20  # guards against an empty parametrization passing vacuously


@pytest.mark.parametrize("name", BUILT_IN)
def test_algorithm_page_exists_and_names_each_hyperparameter(name: str):
    page = PAGES / algorithm_page(name).split("#")[0]  # the server optimizers share fedopt.md
    assert page.is_file(), f"no page docs/algorithms/{page.name} for registered algorithm {name!r}"
    text = page.read_text()
    assert f"`{name}`" in text, f"{page.name} does not name its key `{name}`"
    fields = [f.name for f in dataclasses.fields(ALGORITHMS.get(name)) if f.init]
    # As code (`bn`, `mu = 0.01`, a table cell): a bare word could be prose ("mu" in "mutual").
    missing = [f for f in fields if not re.search(rf"`{re.escape(f)}\b[^`]*`", text)]
    assert not missing, f"{page.name} does not name hyperparameters {missing}"
