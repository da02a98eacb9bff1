"""What a suite is: methods x settings x seeds, each cell one run's config.

Read by ``suite_runner.py`` (which runs the cells), by ``report/suite_report.py`` (which lays the
tables and figures out by them) and by ``report/claims.py`` (which judges the papers' claims on
them), so the suite file's reader (``load_suite``) lives here, below all three.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedmosaic.config import ConfigError, ExperimentConfig, read_toml


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


SUITE_KEYS = {
    "name",
    "title",
    "paper",
    "description",
    "seeds",
    "methods",
    "settings",
    "target_accuracy",
    "checkpoint_every",
    "budget",
    "quick_budget",
    "converged_budget",
    "full_budget",
    "prototype_plot",
    "paper_metric",
    "paper_rounds",
    "paper_budget",
}


BUNDLED = Path(__file__).resolve().parents[1] / "suites"  # installed with the package


def bundled_suites() -> list[str]:
    """The names of the suites shipped with fedmosaic (``fedmosaic compare NAME``)."""
    return sorted(p.stem for p in BUNDLED.glob("*.toml"))


def load_suite(path: str | Path) -> Suite:
    """Parse and check a suite file, or a bundled suite by name (unknown keys fail, naming them)."""
    p = Path(path)
    if not p.exists() and p.suffix == "" and (BUNDLED / f"{p.name}.toml").is_file():
        p = BUNDLED / f"{p.name}.toml"
    raw = read_toml(p, "suite file")
    known = {"suite", "base", "settings", "methods", "quick", "converged", "full", "reference"}
    for key in raw:
        if key not in known:
            raise ConfigError(f"{p}: unknown table {key!r}; valid: {', '.join(sorted(known))}")
        if not isinstance(raw[key], dict):
            raise ConfigError(f"{p}: {key} must be a table ([{key}])")
    meta = raw.get("suite", {})
    for key in meta:
        if key not in SUITE_KEYS:
            raise ConfigError(
                f"{p}: unknown key suite.{key}; valid: {', '.join(sorted(SUITE_KEYS))}"
            )
    method_tables = raw.get("methods", {})
    labels = meta.get("methods", list(method_tables))
    if not labels:
        raise ConfigError(f"{p}: suite.methods lists no method")
    methods = []
    for label in labels:
        table = method_tables.get(label, {})
        extra = set(table) - {"algorithm", "set"}
        if extra:
            raise ConfigError(
                f"{p}: methods.{label}: unknown keys {sorted(extra)} (use algorithm, set)"
            )
        algo = dict(table.get("algorithm", {"name": label}))
        algo.setdefault("name", label)
        methods.append(Method(label, algo, dict(table.get("set", {}))))
    setting_tables = raw.get("settings", {})
    setting_labels = meta.get("settings", list(setting_tables) or ["default"])
    settings = [Setting(s, dict(setting_tables.get(s, {}))) for s in setting_labels]
    if meta.get("prototype_plot", "tsne") not in ("tsne", "pca", "none"):
        raise ConfigError(f"{p}: suite.prototype_plot must be tsne, pca or none")
    if meta.get("paper_metric", "weighted") not in ("weighted", "unweighted"):
        raise ConfigError(f"{p}: suite.paper_metric must be weighted or unweighted")
    paper_rounds = meta.get("paper_rounds")
    if paper_rounds is not None and (
        isinstance(paper_rounds, bool) or not isinstance(paper_rounds, int) or paper_rounds < 1
    ):
        raise ConfigError(f"{p}: suite.paper_rounds must be a positive integer")
    seeds = meta.get("seeds", [0])
    if not isinstance(seeds, list) or not all(isinstance(s, int) for s in seeds) or not seeds:
        raise ConfigError(f"{p}: suite.seeds must be a non-empty list of integers")
    return Suite(
        name=meta.get("name", p.stem),
        title=meta.get("title", meta.get("name", p.stem)),
        base=raw.get("base", {}),
        methods=methods,
        settings=settings,
        seeds=seeds,
        target_accuracy=meta.get("target_accuracy"),
        checkpoint_every=int(meta.get("checkpoint_every", 10)),
        paper=meta.get("paper", ""),
        description=meta.get("description", ""),
        budget=meta.get("budget", ""),
        quick_budget=meta.get("quick_budget", ""),
        converged_budget=meta.get("converged_budget", ""),
        full_budget=meta.get("full_budget", ""),
        prototype_plot=meta.get("prototype_plot", "tsne"),
        paper_metric=meta.get("paper_metric", "weighted"),
        paper_rounds=paper_rounds,
        paper_budget=str(meta.get("paper_budget", "")),
        quick=dict(raw.get("quick", {})),
        converged=dict(raw.get("converged", {})),
        full=dict(raw.get("full", {})),
        reference={k: dict(v) for k, v in raw.get("reference", {}).items()},
        path=str(p),
    )
