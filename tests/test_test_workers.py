"""The suite's worker count under ``-n auto`` (tests/conftest.py): one per usable core, capped by
memory and by a maximum, never zero."""

from __future__ import annotations

from conftest import WORKER_MEMORY_GB, WORKERS_MAX, auto_workers


def test_one_worker_per_core_where_memory_allows():
    assert auto_workers(2, 24.0) == 2  # this project's 2-core, 24 GB machine
    assert auto_workers(1, 24.0) == 1


def test_memory_caps_the_workers():
    assert auto_workers(64, 16.0) == int(16.0 // WORKER_MEMORY_GB) == 5
    assert auto_workers(4, 2 * WORKER_MEMORY_GB - 0.1) == 1


def test_at_most_the_maximum_and_at_least_one():
    assert auto_workers(128, 1024.0) == WORKERS_MAX
    assert auto_workers(128, None) == WORKERS_MAX  # memory unknown: cores and the maximum
    assert auto_workers(8, 0.5) == 1  # too little memory for one: still one
