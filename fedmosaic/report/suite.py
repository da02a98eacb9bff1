"""What a suite is: methods x settings x seeds, each cell one run's config.

Read by ``suite_runner.py`` (which runs the cells) and by ``report/suite_report.py`` (which lays the
tables and figures out by them), so it lives below both.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedmosaic.config import ExperimentConfig


@dataclass
class Method:
    label: str
    algorithm: dict[str, Any]
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class Setting:
    label: str
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class Suite:
    name: str
    title: str
    base: dict[str, Any]
    methods: list[Method]
    settings: list[Setting]
    seeds: list[int]
    target_accuracy: float | None = None
    checkpoint_every: int = 10
    paper: str = ""
    description: str = ""
    budget: str = ""
    quick_budget: str = ""
    converged_budget: str = ""
    full_budget: str = ""
    prototype_plot: str = "tsne"  # tsne | pca | none: client/global prototypes of prototype methods
    # the accuracy the suite's paper reports, the headline columns: weighted (test-size-weighted,
    # HtFLlib/PFLlib) | unweighted (mean of per-client accuracies, FedGH/FedClassAvg)
    paper_metric: str = "weighted"
    # the budget behind the [reference] numbers: rounds (compared with the cells' to flag a
    # different budget) and a free-text description (data fraction, trials, ...)
    paper_rounds: int | None = None
    paper_budget: str = ""
    quick: dict[str, Any] = field(default_factory=dict)
    converged: dict[str, Any] = field(default_factory=dict)
    full: dict[str, Any] = field(default_factory=dict)
    reference: dict[str, dict[str, str]] = field(default_factory=dict)
    path: str = ""


@dataclass
class Cell:
    method: Method
    setting: Setting
    seed: int
    cfg: ExperimentConfig
    hash: str

    @property
    def key(self) -> str:
        return f"{self.setting.label}/{self.method.label}/seed{self.seed}"
