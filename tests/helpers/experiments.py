"""What the tests share besides fixtures: the tiny experiment config, TOML writing, the numbers of
a results document, and runs stopped or memory-capped on purpose."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

# A tiny federation: 4 clients on synthetic 1x28x28 images, 4 classes, two CNN widths.
TINY: dict[str, Any] = {
    "seed": 0,
    "data": {
        "dataset": "synthetic",
        "synthetic_size": 240,
        "synthetic_classes": 4,
        "synthetic_shape": [1, 28, 28],
        "partition": "dirichlet",
        "alpha": 1.0,
        "min_size": 20,
        "num_clients": 4,
        "public_size": 40,
    },
    "model": {"family": "cnn1", "feature_dim": 16},
    "train": {"rounds": 2, "batch_size": 10, "lr": 0.05, "eval_every": 1},
    "sim": {"check_wire": True, "progress": False},
    "algorithm": {"name": "fedavg"},
}

# Smaller synthetic images for runs whose checks do not depend on the image size: cnn1's first
# linear layer (nearly all its parameters at 28 x 28) a third of the size.
SMALL: dict[str, Any] = {"synthetic_shape": [1, 16, 16]}


def tiny_raw(**sections: dict[str, Any]) -> dict[str, Any]:
    """TINY with some keys replaced: ``tiny_raw(train={"rounds": 3}, algorithm={"name": "local"})``."""
    raw = copy.deepcopy(TINY)
    for section, values in sections.items():
        if section == "algorithm":
            raw["algorithm"] = dict(values)
        elif isinstance(values, dict):
            raw.setdefault(section, {}).update(values)
        else:
            raw[section] = values
    return raw


def write_toml(path: Path, raw: dict[str, Any]) -> Path:
    """``raw`` (a ``tiny_raw``-style dict) written as an experiment TOML at ``path``."""
    lines = [f"seed = {raw['seed']}"]
    if raw.get("plugins"):
        lines.append(f"plugins = {json.dumps(raw['plugins'])}")
    for section in ("data", "model", "train", "sim", "algorithm"):
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in raw[section].items()]
    path.write_text("\n".join(lines) + "\n")
    return path


TIMING = {"seconds", "seconds_train", "seconds_aggregate", "seconds_eval"}


def round_numbers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """A results document's round records without their timings (what must be reproducible)."""
    return [{k: v for k, v in r.items() if k not in TIMING} for r in doc["rounds"]]


def numbers(doc: dict[str, Any]) -> tuple[Any, ...]:
    """Everything in results.json that is not a timing."""
    summary = {k: v for k, v in doc["summary"].items() if k != "seconds_per_round"}
    return round_numbers(doc), doc["clients"], doc["per_client_final_acc"], summary


class _Stopped(Exception):
    pass


def run_until_round(cfg: Any, last: int, checkpoint_dir: Path, monkeypatch: Any) -> None:
    """Run ``cfg`` with a checkpoint after every round and stop it dead after round ``last``
    (as a kill would): ``checkpoint_dir`` then holds that round's checkpoint."""
    from fedmosaic.checkpoint import Checkpointer, CheckpointPolicy
    from fedmosaic.experiment import run_experiment

    original = Checkpointer.after_round

    def stop_after(self: Any, t: int, *args: Any) -> None:
        original(self, t, *args)
        if t == last:
            raise _Stopped

    with monkeypatch.context() as m:
        m.setattr(Checkpointer, "after_round", stop_after)
        with pytest.raises(_Stopped):
            run_experiment(
                cfg, progress=False, checkpoint=CheckpointPolicy(checkpoint_dir, every=1)
            )


def run_capped(code: str, headroom: int, timeout: float = 120) -> Any:
    """Run ``code`` in a fresh interpreter whose address space is capped at ``headroom`` bytes
    above what it holds after importing fedmosaic's data loaders (``RLIMIT_AS``): a regression
    that allocates far too much fails with MemoryError instead of swapping the machine. The
    child prints what it found; returns the ``subprocess.CompletedProcess``."""
    import os
    import subprocess
    import sys
    import textwrap

    prelude = textwrap.dedent(
        """
        import resource
        import fedmosaic.data.datasets  # torch, numpy: the baseline
        with open("/proc/self/status") as fh:
            vm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + {headroom}, resource.RLIM_INFINITY))
        """
    ).format(headroom=int(headroom))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
