"""Run a reference's ``main.py`` (cwd = its ``system/``) unchanged, with stand-ins only for imports
of optional packages that the run never uses.

HtFLlib's ``main.py`` imports every server, FedKTL's included (StyleGAN / Stable Diffusion
packages), and ``models.py`` imports ``torchvision`` for model groups we do not run; PFLlib's
imports ``cvxpy`` for FedPAC. Where such an
import fails, an empty stand-in module is registered that raises if anything in it is *used*, so a
run that needed it fails loudly instead of silently changing. With ``PARITY_PRINT_CLIENTS=1`` it
also prints the per-client test accuracies PFLlib computes but does not print (read-only, see
``print_client_accuracies``); with ``PARITY_SEED_OFFSET=k`` every ``torch.manual_seed(s)`` of the
reference seeds ``s + k`` (its spread over torch seeds on one split; ``offset_torch_seeds``); with
``PARITY_SEED_GLOBALS=s`` numpy's and Python's global generators, which the references leave
unseeded, are seeded with ``s`` first (``seed_globals``). Usage
(the reference's venv)::

    cd <ref>/system && <ref-venv>/bin/python <this file> -data ... -algo FedProto ...
"""

from __future__ import annotations

import importlib
import os
import runpy
import sys
import types
from typing import Any

OPTIONAL = [
    "torchvision",
    "cvxpy",  # PFLlib's FedPAC server (imported by its main.py, not run here)
    "flcore.servers.serverktl_stylegan_xl",
    "flcore.servers.serverktl_stylegan_3",
    "flcore.servers.serverktl_stable_diffusion",
]


class _Missing(types.ModuleType):
    """A module that could not be imported: any attribute use raises."""

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)

        def _fail(*_: Any, **__: Any) -> None:
            raise ImportError(f"{self.__name__} is not installed (parity launch shim stand-in)")

        return _fail


def install_stand_ins() -> list[str]:
    """Register stand-ins for the optional imports that fail here; returns their names."""
    sys.path.insert(0, ".")
    missing = []
    for name in OPTIONAL:
        try:
            importlib.import_module(name)
        except Exception:  # any failure of an optional import: the run does not use it
            sys.modules[name] = _Missing(name)
            missing.append(name)
    return missing


def print_client_accuracies() -> None:
    """Print each client's test accuracy as HtFLlib does (``Client <id>: Acc: <correct/n>``).

    PFLlib's ``Server.evaluate`` prints only the weighted mean; the per-client figures it computes
    in ``Server.test_metrics`` are printed here from that method's own return value, which is
    passed on unchanged (the run is not altered: same calls, same order, same random draws).
    """
    from flcore.servers import serverbase  # the reference's module (cwd = its system/)

    original = serverbase.Server.test_metrics

    def test_metrics(self: Any) -> Any:
        stats = original(self)
        ids, num_samples, tot_correct = stats[0], stats[1], stats[2]
        for cid, n, correct in zip(ids, num_samples, tot_correct):
            print(f"Client {cid}: Acc: {correct * 1.0 / n}")
        return stats

    serverbase.Server.test_metrics = test_metrics


def offset_torch_seeds(offset: int) -> None:
    """Every ``torch.manual_seed(s)`` of the reference seeds ``s + offset`` instead.

    Both references seed torch with a constant (0, in ``main.py`` and before every client's
    model), so the spread their torch seeds cause on one split is not seen in one run; this
    measures it. A run with an offset is recorded as such and is not the reference's default
    run. (Their numpy and Python generators are not seeded at all: client selection and the
    order of the received uploads vary from run to run on identical inputs; see
    :func:`seed_globals`.)
    """
    import torch

    original = torch.manual_seed

    def manual_seed(seed: int) -> Any:
        return original(int(seed) + offset)

    torch.manual_seed = manual_seed


def seed_globals(seed: int) -> None:
    """Seed numpy's and Python's global generators with ``seed`` before the reference runs.

    The references never seed them, and HtFLlib draws from both every round
    (``serverbase.select_clients``: ``np.random.choice``; ``receive_ids``: ``random.sample``,
    which orders the uploads a server such as FedTGP's trains on), so two runs on identical
    inputs differ. Seeded, a run repeats; a seeded run is recorded as such and is not the
    reference's default run."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)


if __name__ == "__main__":
    stood_in = install_stand_ins()
    if int(os.environ.get("PARITY_SEED_OFFSET", "0")):
        offset_torch_seeds(int(os.environ["PARITY_SEED_OFFSET"]))
    if os.environ.get("PARITY_SEED_GLOBALS", ""):
        seed_globals(int(os.environ["PARITY_SEED_GLOBALS"]))
    if os.environ.get("PARITY_PRINT_CLIENTS") == "1":
        print_client_accuracies()
    print(f"parity launch shim: stand-ins for {stood_in or 'nothing'}", flush=True)
    sys.argv = ["main.py", *sys.argv[1:]]
    runpy.run_path("main.py", run_name="__main__")
