"""Shared test fixtures (what tests import lives in ``tests/helpers``) and the test kinds. Tests run
single-threaded so the fast suite is stable on 2 cores.

Every test has at least one kind (markers registered in ``pyproject.toml``):

- ``unit``: fast, no real data, no subprocess, no training beyond a few tiny steps;
- ``golden``: pinned numbers (exact committed values, bitwise equality of runs);
- ``integration``: whole runs, subprocesses, the CLI end to end, real data;
- ``flower``: everything under ``tests/flower`` (needs ``flwr``).

The kind comes from, in order: the test's own marker (a decorator or the module's ``pytestmark``,
for files that mix kinds), the folder (``tests/flower``), then ``KINDS`` below (one line a file).
A file missing from ``KINDS`` counts as ``integration``: it runs in the full suite, not in the
quick loop, until it is listed. ``slow`` (real-data checks) is kept and makes a test
``integration`` too.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.experiments import TINY

from fedmosaic.cli import remove_log_handlers
from fedmosaic.federation import install_speed

# The library installs its fast paths when it builds a federation or a client; tests that drive
# models, losses or steps directly get the same paths (a test of the plain path uninstalls and
# restores them, tests/core/test_training.py).
install_speed()
torch.set_num_threads(1)

TESTS = Path(__file__).resolve().parent
KIND_MARKERS = ("unit", "golden", "integration", "flower")
FOLDERS = {"flower": "flower"}
DEFAULT_KIND = "integration"

# The kind of every test of a file (relative to tests/), unless the test says otherwise.
KINDS: dict[str, str] = {
    # accel/
    "accel/test_batched.py": "integration",
    "accel/test_fused_sgd.py": "unit",
    # algorithms/
    "algorithms/test_contract.py": "integration",
    "algorithms/test_declare.py": "unit",
    "algorithms/test_fedavg_fedprox.py": "unit",
    "algorithms/test_fedbabu.py": "unit",
    "algorithms/test_fedclassavg.py": "unit",
    "algorithms/test_feddistill.py": "unit",
    "algorithms/test_fedgen.py": "unit",
    "algorithms/test_fedgh.py": "unit",
    "algorithms/test_fedhenn.py": "unit",
    "algorithms/test_fedhenn_homo.py": "unit",
    "algorithms/test_fedkd.py": "unit",
    "algorithms/test_fedopt.py": "unit",
    "algorithms/test_fedper.py": "unit",
    "algorithms/test_fedproto.py": "unit",
    "algorithms/test_fedrep.py": "unit",
    "algorithms/test_fedrod.py": "unit",
    "algorithms/test_fedseq.py": "unit",
    "algorithms/test_fedtgp.py": "unit",
    "algorithms/test_fml.py": "unit",
    "algorithms/test_ktpfl.py": "unit",
    "algorithms/test_registry.py": "integration",  # test_golden_numbers: golden too
    # core/
    "core/test_acceleration.py": "unit",
    "core/test_cuda.py": "integration",
    "core/test_kernel_build.py": "integration",
    "core/test_kernels.py": "integration",  # native kernels over the whole zoo
    "core/test_membership.py": "unit",
    "core/test_payload.py": "unit",
    "core/test_precision.py": "unit",
    "core/test_robust.py": "unit",
    "core/test_robustness.py": "unit",
    "core/test_rounds.py": "unit",
    "core/test_schema.py": "unit",
    "core/test_server_eval.py": "unit",
    "core/test_training.py": "unit",
    # data/
    "data/test_corrupt_files.py": "unit",
    "data/test_download.py": "unit",
    "data/test_feature_shift.py": "unit",
    "data/test_federated_splits.py": "unit",
    "data/test_fuzz_files.py": "integration",
    "data/test_gzip_stated_size.py": "integration",  # gigabyte-sized headers, the CLI
    "data/test_hf_local.py": "unit",
    "data/test_loaders.py": "unit",
    "data/test_partitioners.py": "unit",
    "data/test_quantity_skew.py": "unit",
    # models/
    "models/test_flops.py": "unit",
    "models/test_projection_none.py": "unit",
    "models/test_zoo.py": "unit",
    # report/
    "report/test_claim_figure.py": "integration",
    "report/test_claims.py": "unit",
    "report/test_privacy_page.py": "unit",
    "report/test_results_table.py": "unit",
    "report/test_sinks.py": "unit",
    "report/test_sinks_wandb_hparams.py": "unit",
    "report/test_suite_report.py": "integration",
    # sim/
    "sim/test_auto_runtime.py": "integration",
    "sim/test_backends.py": "integration",
    "sim/test_devices.py": "integration",
    "sim/test_progress.py": "integration",
    "sim/test_scale.py": "integration",
    "sim/test_serial_memory.py": "integration",
    "sim/test_sim_parts.py": "integration",
    # top level
    "test_adversarial.py": "integration",
    "test_api.py": "integration",
    "test_api_run.py": "integration",
    "test_bad_input.py": "integration",
    "test_checkpoint.py": "integration",
    "test_cli.py": "integration",
    "test_cli_help.py": "integration",
    "test_cli_startup.py": "integration",
    "test_config.py": "unit",
    "test_determinism.py": "golden",
    "test_docs.py": "unit",
    "test_docs_site.py": "integration",
    "test_extending.py": "integration",
    "test_finetune_progress.py": "integration",
    "test_fuzz.py": "unit",  # the command-line cases: integration
    "test_holdout.py": "integration",
    "test_layers.py": "unit",
    "test_main_job.py": "integration",
    "test_memory_check.py": "integration",
    "test_numerics.py": "integration",  # the pinned ones: golden
    "test_observability.py": "integration",
    "test_packaging.py": "integration",
    "test_parity_export.py": "unit",
    "test_peer_guard.py": "integration",
    "test_plateau.py": "integration",
    "test_plugins.py": "integration",
    "test_provenance.py": "integration",
    "test_reference.py": "integration",
    "test_runfolder.py": "integration",
    "test_runfolder_replace.py": "integration",
    "test_transports.py": "integration",
    "test_speed_benchmark.py": "unit",  # the subprocess case: integration
    "test_test_workers.py": "unit",
    "test_types.py": "integration",  # mypy over pyproject's [tool.mypy] files; slow
    "test_upfront_checks.py": "integration",
    "test_verify.py": "integration",  # re-runs (the compare-by-hand case: unit)
}


# Workers of ``-n auto`` (pyproject's addopts): one per usable core, but no more than the memory
# holds (a worker that trains the zoo's models peaks near this much) and no more than this many.
WORKER_MEMORY_GB = 3.0
WORKERS_MAX = 8


def auto_workers(cores: int, available_gb: float | None) -> int:
    """How many test workers ``-n auto`` starts: ``cores``, at most ``WORKERS_MAX`` and at most
    ``available_gb / WORKER_MEMORY_GB`` (unknown memory: no cap), at least 1."""
    n = min(cores, WORKERS_MAX)
    if available_gb is not None:
        n = min(n, int(available_gb // WORKER_MEMORY_GB))
    return max(1, n)


def _available_gb() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return auto_workers(cores or 1, _available_gb())


def kind_of(path: Path) -> str:
    """The kind a test of the file at ``path`` gets when it does not name one itself."""
    rel = path.resolve().relative_to(TESTS)
    if rel.parts[0] in FOLDERS:
        return FOLDERS[rel.parts[0]]
    return KINDS.get(rel.as_posix(), DEFAULT_KIND)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if path.is_relative_to(TESTS) and path.relative_to(TESTS).parts[0] in FOLDERS:
            item.add_marker(FOLDERS[path.relative_to(TESTS).parts[0]])
        if item.get_closest_marker("slow"):
            item.add_marker("integration")  # real data
        if any(item.get_closest_marker(k) for k in KIND_MARKERS):
            continue
        item.add_marker(kind_of(path) if path.is_relative_to(TESTS) else DEFAULT_KIND)


@pytest.fixture(autouse=True)
def _log_handlers_left_as_found() -> Iterator[None]:
    """A command run in-process (``cli.main``, a Flower node's ``main``) adds log handlers bound to
    that test's captured stderr, which is closed when the test ends: a later test's record would
    then print "Logging error" to its own stderr. Each test leaves the handlers as it found them
    (pytest's own capture handlers on the root logger are pytest's to remove)."""
    fm = logging.getLogger("fedmosaic")
    before = list(fm.handlers)
    yield
    for h in list(fm.handlers):
        if h not in before:
            fm.removeHandler(h)
            h.close()
    remove_log_handlers()  # the CLI's, on the root logger


@pytest.fixture
def tiny() -> dict[str, Any]:
    return copy.deepcopy(TINY)
