"""Per-round logging sinks: a CSV file always, TensorBoard when it is installed, Weights & Biases
when ``sim.wandb`` names a project (the optional ``wandb`` extra; offline unless ``WANDB_MODE``
says otherwise).

``rounds.csv`` grows one row per round while the run goes (the fixed ``ROUND_COLUMNS``); at the end
``write_results`` rewrites it with exactly the columns the run has (plus per-mode accuracies such
as ``acc_head``). One file, readable at any time. On resume, rows after the checkpoint's round are
dropped first, so a killed and resumed run leaves the same file as an uninterrupted one (timing
columns aside).

TensorBoard also gets the run's hyperparameters (the config flattened to dotted keys) in its
HPARAMS tab, written when the run ends, with the last round's accuracies and loss as the metrics
(``hparams/<name>``). W&B gets the same flattened config as the run's ``config``, and each
round's numbers as one ``log`` call at ``step = round``; its files go under ``<out>/wandb``.
"""

from __future__ import annotations

import csv
import io
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

from fedmosaic.config import ConfigError
from fedmosaic.report.results import (
    MEMBERSHIP_COLUMNS,
    PRIVACY_COLUMNS,
    ROUND_COLUMNS,
    write_atomic,
)

log = logging.getLogger("fedmosaic")
PROGRESS_FILE = "rounds.csv"


class CSVSink:
    """Appends each round's record (the fixed ``ROUND_COLUMNS``, the privacy columns in a run
    under ``[privacy]``, the attack's under ``eval.membership``) to ``rounds.csv``."""

    def __init__(
        self,
        out_dir: str | Path,
        keep_rounds: int = 0,
        private: bool = False,
        membership: bool = False,
    ) -> None:
        self.columns = (
            *ROUND_COLUMNS,
            *(PRIVACY_COLUMNS if private else ()),
            *(MEMBERSHIP_COLUMNS if membership else ()),
        )
        self.path = Path(out_dir) / PROGRESS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        rows: list[list[str]] = []
        if keep_rounds > 0 and self.path.exists():
            try:
                with open(self.path, newline="", encoding="utf-8") as fh:
                    reader = csv.reader(fh)
                    header = next(reader, None)
                    if header == list(self.columns):
                        rows = [
                            r for r in reader if r and r[0].isdigit() and int(r[0]) <= keep_rounds
                        ]
            except (UnicodeDecodeError, csv.Error) as exc:  # results.json keeps every round
                log.warning("%s is not a rounds table (%s): written anew", self.path, exc)
        buf = io.StringIO(newline="")
        w = csv.writer(buf)
        w.writerow(self.columns)
        w.writerows(rows)
        write_atomic(self.path, buf.getvalue().encode())  # a failed start keeps the old file

    def __call__(self, rec: dict[str, Any]) -> None:
        with open(self.path, "a", newline="") as fh:
            csv.writer(fh).writerow([_cell(rec.get(c)) for c in self.columns])

    def close(self) -> None:
        pass


def _cell(v: Any) -> Any:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return ""
    return v


HParam = bool | int | float | str


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, HParam]:
    """``{"data": {"alpha": 0.1}}`` -> ``{"data.alpha": 0.1}``; lists become their text (e.g.
    ``"[1, 28, 28]"``) and None ``"none"``, since TensorBoard and W&B take scalars."""
    out: dict[str, HParam] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten_config(value, f"{name}."))
        elif value is None:
            out[name] = "none"
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            out[name] = str(list(value) if isinstance(value, tuple) else value)
    return out


def _numbers(rec: dict[str, Any]) -> dict[str, int | float]:
    """The record's finite numbers except the round (lists, strings and NaN are left out)."""
    out: dict[str, int | float] = {}
    for key, value in rec.items():
        if key == "round" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if isinstance(value, float) and not math.isfinite(value):
            continue
        out[key] = value
    return out


class TensorBoardSink:
    """Scalars per round under ``tb/`` (accuracy, loss, bytes, seconds); the flattened config
    as hyperparameters when the run ends (``hparams``: None for none)."""

    def __init__(
        self, out_dir: str | Path, writer_cls: Any, hparams: dict[str, HParam] | None = None
    ) -> None:
        self.writer = writer_cls(log_dir=str(Path(out_dir) / "tb"))
        self.hparams = hparams
        self.last: dict[str, int | float] = {}

    def __call__(self, rec: dict[str, Any]) -> None:
        t = int(rec["round"])
        numbers = _numbers(rec)
        self.last = numbers
        for key, value in numbers.items():
            group = (
                "acc"
                if "acc" in key
                else "comm"
                if "bytes" in key
                else "time"
                if "seconds" in key
                else "train"
            )
            self.writer.add_scalar(f"{group}/{key}", value, t)
        self.writer.flush()

    def close(self) -> None:
        if self.hparams:
            metrics = {
                f"hparams/{k}": float(v)
                for k, v in self.last.items()
                if "acc" in k or k == "train_loss"
            }
            # run_name ".": the same tb/ folder, so TensorBoard shows one run with its hparams
            self.writer.add_hparams(self.hparams, metrics, run_name=".")
        self.writer.close()


def wandb_module() -> Any | None:
    """The ``wandb`` package when installed (``pip install 'fedmosaic[wandb]'``), else None."""
    if "wandb" in sys.modules:
        return sys.modules["wandb"]
    try:  # optional (tracking extra): absent, or present with or without type information
        import wandb  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError:
        return None
    return wandb


class WandbSink:
    """Each round's numbers to a W&B run (``step = round``), offline unless ``WANDB_MODE`` is set;
    the run's files go to ``<out_dir>/wandb`` (``wandb sync`` uploads an offline run later)."""

    def __init__(
        self, out_dir: str | Path, module: Any, project: str, config: dict[str, HParam]
    ) -> None:
        self.run = module.init(
            project=project,
            name=Path(out_dir).resolve().name,
            dir=str(Path(out_dir)),
            config=config,
            mode=os.environ.get("WANDB_MODE", "offline"),
        )

    def __call__(self, rec: dict[str, Any]) -> None:
        self.run.log(_numbers(rec), step=int(rec["round"]))

    def close(self) -> None:
        self.run.finish()


def tensorboard_writer() -> Any | None:
    """``SummaryWriter`` when the ``tensorboard`` package is installed, else None."""
    try:
        # optional (tracking extra): absent, or present with or without type information
        import tensorboard  # type: ignore[import-not-found, import-untyped, unused-ignore]  # noqa: F401
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter


class Sinks:
    """All sinks of one run as a single ``on_round`` callback."""

    def __init__(
        self,
        out_dir: str | Path,
        keep_rounds: int = 0,
        tensorboard: bool = True,
        config: dict[str, Any] | None = None,
    ) -> None:
        """``config``: the run's config as a dict (``ExperimentConfig.to_dict()``): its
        flattened keys become TensorBoard hparams and the W&B config; ``sim.wandb`` (a project
        name) turns W&B on."""
        priv = (config or {}).get("privacy", {})
        private = priv.get("mechanism", "none") != "none" or priv.get("sample_clip", 0) > 0
        attacked = bool((config or {}).get("eval", {}).get("membership", False))
        self.sinks: list[Any] = [CSVSink(out_dir, keep_rounds, private, attacked)]
        flat = flatten_config(config) if config else None
        writer = tensorboard_writer() if tensorboard else None
        if writer is not None:
            self.sinks.append(TensorBoardSink(out_dir, writer, flat))
        project = str((config or {}).get("sim", {}).get("wandb", "") or "")
        if project:
            module = wandb_module()
            if module is None:
                raise ConfigError(
                    f"sim.wandb = {project!r} needs the wandb package: "
                    "pip install 'fedmosaic[wandb]' (or set sim.wandb = \"\")"
                )
            self.sinks.append(WandbSink(out_dir, module, project, flat or {}))

    def __call__(self, rec: dict[str, Any]) -> None:
        for sink in self.sinks:
            try:
                sink(rec)
            except OSError as exc:  # logging must never kill a run
                log.warning("logging sink %s failed: %s", type(sink).__name__, exc)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
