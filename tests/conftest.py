"""Shared test fixtures (what tests import lives in ``tests/helpers``). Tests run single-threaded so
the fast suite is stable on 2 cores."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from helpers.experiments import TINY

torch.set_num_threads(1)


@pytest.fixture
def tiny() -> dict[str, Any]:
    return copy.deepcopy(TINY)
