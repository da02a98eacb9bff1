"""Experiment configuration: dataclasses loaded from TOML, with dotted ``--set`` overrides.

Unknown keys, wrong types and impossible combinations raise :class:`ConfigError` naming the key,
before any data is loaded or any model is trained.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Nothing here imports torch (the command line checks a config before it loads any): the server
# rule and the round plan's count come from core/checks.py, the registries only in
# validate_registry.
from fedmosaic.core import accountant  # torch-free (dp-accounting only when it counts)
from fedmosaic.core.checks import (
    PrivacyRule,
    RobustRule,
    clients_per_round,
    did_you_mean,
    largest_f,
    trim_limit,
)
from fedmosaic.core.errors import ConfigError
from fedmosaic.core.registry import ALGORITHMS, ENCODERS, FAMILIES
from fedmosaic.core.typed import build_dataclass, type_ok

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10: the same parser, from PyPI (a dependency there)
    import tomli as tomllib


@dataclass
class DataConfig:
    # the image dataset: fmnist | mnist | emnist | cifar10 | cifar100 | tinyimagenet | digits |
    # synthetic | hf (`fedmosaic list datasets` says which are on disk)
    dataset: str = "fmnist"
    root: str = ""  # explicit data folder; else $FEDMOSAIC_DATA, then system locations
    download: bool = False  # opt-in download for users with internet (never in tests/CI)
    emnist_split: str = "balanced"  # which EMNIST: letters (26 classes) | balanced (47)
    # how labels (or sizes) are dealt to clients: iid | dirichlet | pathological | skewed |
    # shards | pfedhn | quantity_dirichlet | quantity_power_law
    partition: str = "dirichlet"
    alpha: float = 0.1  # dirichlet concentration (beta in some papers)
    classes_per_client: int = 2  # pathological / skewed / shards / pfedhn: classes per client
    num_clients: int = 20  # clients in the federation (held-out newcomers included)
    min_size: int = 10  # dirichlet: redraw until every client has at least this many samples
    # the data's own seed (subsample, partition, splits); -1 = the experiment's seed. Set it to
    # vary the models' initialization and training randomness over one fixed split
    split_seed: int = -1
    max_tries: int = 1000  # dirichlet: give up (error) after this many redraws
    # each client's train/test split: pool_75_25 (75% / 25% of its pooled data, PFLlib/HtFLlib)
    # | 8_1_1 (80% / 10% validation / 10% test, FedGH)
    split: str = "pool_75_25"
    # pool_75_25: fraction of each client's train part held out for validation
    val_fraction: float = 0.0
    public_size: int = 0  # server-held public/alignment split carved out before partitioning
    # server-held labelled evaluation split (rows), carved out before partitioning after the
    # public split and never given to a client: the server evaluates its global model on it
    # (server_acc in the round records) where the method has one (FedAvg, FedProx, FedOpt)
    server_eval_size: int = 0
    subsample: float = 1.0  # fraction of the pooled dataset to use (quick experiments)
    # pixel normalization: half (mean 0.5, std 0.5 as PFLlib) | dataset (per-dataset mean/std)
    normalize: str = "half"
    synthetic_size: int = 2000  # synthetic dataset: number of images
    synthetic_classes: int = 10  # synthetic dataset: number of classes
    synthetic_shape: list[int] = field(default_factory=lambda: [1, 28, 28])  # synthetic: [C, H, W]
    # quantity skew (partition = quantity_dirichlet | quantity_power_law)
    quantity_alpha: float = 1.0  # quantity_dirichlet: client sizes ~ Dir(quantity_alpha)
    power_law_exponent: float = 1.0  # quantity_power_law: rank-k client's share ~ k^-exponent
    quantity_labels: str = "iid"  # labels within the sizes: iid | dirichlet (uses alpha)
    # feature shift: per-client (or per-domain) fixed transforms of the images; off by default
    shift_rotation: float = 0.0  # feature shift: rotation angle ~ U[-r, r] degrees (0 = off)
    shift_contrast: float = 1.0  # feature shift: contrast factor log-uniform in [1/c, c] (1 = off)
    # feature shift: additive brightness ~ U[-b, b] in [0, 1] pixel units (0 = off)
    shift_brightness: float = 0.0
    # feature shift: 0 = a transform per client; k = k shared domains (client i -> i % k)
    shift_domains: int = 0
    # dataset = "hf": a local Hugging Face / flwr-datasets style dataset in data.root
    hf_image_column: str = ""  # hf: the image column; "" = the first of image, img, pixel_values
    # hf: the label column; "" = the first of label, labels, fine_label, target
    hf_label_column: str = ""


@dataclass
class ModelConfig:
    # the clients' encoders: a named heterogeneous family (client i gets member i mod its size)
    # or a single architecture for every client
    family: str = "htfe8-gray"
    feature_dim: int = 512  # width of the features every encoder ends in (the head's input)
    # linear (learnable) | pool (HtFLlib's parameter-free average pool) | none (the encoder's own
    # width: only for `local`, which compares no features, e.g. Local on FedHeNN's own networks)
    projection: str = "linear"
    # initial weights: client (each client from its own seeded stream) | architecture (clients of
    # one architecture start identical, as HtFLlib's torch.manual_seed(0) before every client's
    # model gives them; client i starts as client i mod the family's size does)
    init: str = "client"


@dataclass
class TrainConfig:
    rounds: int = 100  # communication rounds
    clients_per_round: int = 0  # clients sampled per round; 0 = use participation
    # fraction of clients sampled per round: floor(participation x num_clients), at least 1
    participation: float = 1.0
    local_epochs: int = 1  # epochs over its own data each sampled client trains per round
    batch_size: int = 10  # local training batch size
    # drop each epoch's ragged last batch (PFLlib/HtFLlib, FedClassAvg's code); false = every
    # example every epoch (FedHeNN, FedGH's authors, FedBABU, layer expansion)
    drop_last: bool = False
    # a new example order per client and epoch (the papers, PFLlib); false = the same order every
    # epoch, the client's rows in dataset order (HtFLlib's train loader, shuffle=False)
    shuffle: bool = True
    # plain SGD: update Linear weights inside their backward (faster, same maths; ``.grad`` of
    # those weights is then never filled, so losses that differentiate twice (gradient
    # penalties, torch.autograd.grad(..., create_graph=True), gradient hooks) need it off).
    # "auto": on for methods declaring ``acceleration = Acceleration(fused_sgd=True)`` (every
    # built-in), off for any other (a user's method works unchanged); true / false force it.
    fused_sgd: bool | str = "auto"
    lr: float = 0.01  # local learning rate
    optimizer: str = "sgd"  # local optimizer, created afresh every round: sgd | adam
    momentum: float = 0.0  # sgd momentum
    weight_decay: float = 0.0  # L2 weight decay of the local optimizer
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])  # adam's (beta1, beta2)
    eval_every: int = 1  # evaluate every client's test split every this many rounds (and the last)
    eval_batch_size: int = 1000  # batch size of evaluation passes (memory, not numbers)
    # fine-tuning after the last round: -1 = the algorithm's default, 0 = none
    finetune_epochs: int = -1
    # Converged budgets: stop before ``rounds`` (then a cap) once the validation accuracy has
    # improved by less than ``plateau_delta`` (0.001 = 0.1 point) over the last
    # ``plateau_window`` of the rounds run, checked from ``plateau_min_rounds`` on; 0 = off.
    # Needs a validation split (data.val_fraction > 0 or data.split = "8_1_1").
    plateau_delta: float = 0.0
    plateau_window: float = 0.2  # plateau stop: the window, as a fraction of the rounds run
    plateau_min_rounds: int = 20  # plateau stop: never before this many rounds
    # stop with an error after 2 rounds in a row with no finite training loss; false: run every
    # round and report what the diverged models give (a privacy grid where the noise breaks
    # training is a result, not a crash); summary.diverged_rounds counts those rounds
    stop_on_divergence: bool = True
    device: str = "cpu"  # where clients train and evaluate: cpu | cuda | cuda:N
    # Train the round's clients of one architecture together as one batched computation
    # (torch.func.vmap; accel/batched.py) where the method declares it equivalent: "auto" = on
    # for CUDA devices, off on CPU (measured slower there); true | false force it
    batched_clients: bool | str = "auto"
    # Capture the batched clients' training step once per (layout, clients, batch size) as a
    # CUDA graph and replay it (accel/graphs.py): "auto" = on for CUDA with batched clients, SGD
    # and fp32; true on CPU runs the same bookkeeping without a graph (for tests)
    cuda_graphs: bool | str = "auto"
    precision: str = "fp32"  # fp32 | bf16 (autocast of the local training forward; off by default)


@dataclass
class SimConfig:
    check_wire: bool = False  # round-trip every payload through the wire codec and compare
    progress: bool = True  # a progress bar on a terminal (a line per round without one)
    # torch intra-op threads of this process (serial: all the training; processes: the server's
    # own steps); "auto" = 1, the numbers of every backend on any machine; 0 = torch's default
    threads: int | str = "auto"
    # serial (one process) | processes (worker processes, one thread each) | auto: processes with
    # more than one usable core and enough work to repay starting them, how many train a round
    # measured between rounds, else serial (the same numbers either way; sim/backend.py's
    # resolve_runtime and sim/layout.py, recorded in provenance.runtime)
    backend: str = "auto"
    workers: int = 0  # processes backend: number of workers; 0 = number of CPU cores
    # processes backend: one worker per entry (cpu | cuda | cuda:N), each holding its clients'
    # state and the images on that device; [] = every worker on train.device
    devices: list[str] = field(default_factory=list)
    # where clients wait between rounds: "on" = a compact on-disk state store, only the clients
    # being worked on live in memory (memory flat in the population); "off" = all in memory;
    # "auto" = serial: the store once the population's state exceeds 256 MiB; processes: the
    # store with partial participation
    offload_clients: str = "auto"
    # Weights & Biases project to log to ("" = off); needs the wandb extra; offline unless
    # WANDB_MODE says otherwise
    wandb: str = ""
    # "native": each math library takes the host's fastest instruction set (AVX-512 where
    # present); "portable": ATen, MKL and oneDNN pinned at AVX2 (oneDNN off), so a
    # cell gives the same bits on every Intel host with AVX2 and FMA and the same torch build
    # (MKL keeps its AVX2 branch on Intel only: other vendors' hosts differ, fedmosaic verify
    # measures by how much; fedmosaic/numerics.py; the fedmosaic command re-executes itself)
    numerics: str = "native"


@dataclass
class EvalConfig:
    # clients that never train: a seeded random subset, evaluated after the last round as
    # newcomers are served by each method (the final broadcast, then one local round of the
    # method's own client procedure); 0 = every client trains
    holdout_clients: int = 0
    # the loss-threshold membership attack at every evaluation, on each client's evaluated model:
    # its training split (members) against its test split (nonmembers); rounds get mia_auc and
    # mia_tpr (at 1% false positives), means over clients (core/membership.py, docs/privacy.md);
    # where an upload is a whole model, every round also attacks the model the server rebuilds
    # from it (mia_upload_auc, mia_upload_tpr)
    membership: bool = False


@dataclass
class ExperimentConfig:
    seed: int = 0  # one seed for the split, the models' initialization and every random stream
    # modules (``mypkg.methods``) or files (``my_method.py``) imported before anything is looked
    # up: their ALGORITHMS/ENCODERS/FAMILIES/DATASETS/PARTITIONERS registrations are then
    # known here, in every simulator worker and in Flower apps (which rebuild from this config)
    plugins: list[str] = field(default_factory=list)
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    sim: SimConfig = field(default_factory=SimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # the server's aggregation: robust aggregators, update clipping, magnitude sanity, peer guard
    # (``core/robust.py``): aggregator, trim, f, clip_update_norm, max_norm_ratio, peer_factor
    server: RobustRule = field(default_factory=RobustRule)
    # client-level differential privacy of every upload (core/privacy.py, docs/privacy.md)
    privacy: PrivacyRule = field(default_factory=PrivacyRule)
    # the method: name plus its hyperparameters (fedmosaic list algorithms)
    algorithm: dict[str, Any] = field(default_factory=lambda: {"name": "lg_fedavg"})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "train": TrainConfig,
    "sim": SimConfig,
    "eval": EvalConfig,
    "server": RobustRule,
    "privacy": PrivacyRule,
}

CHOICES: dict[str, tuple[str, ...]] = {
    "data.partition": (
        "iid",
        "dirichlet",
        "pathological",
        "skewed",
        "shards",
        "pfedhn",
        "quantity_dirichlet",
        "quantity_power_law",
    ),
    "data.quantity_labels": ("iid", "dirichlet"),
    "data.split": ("pool_75_25", "8_1_1"),
    "data.normalize": ("half", "dataset"),
    "data.emnist_split": ("letters", "balanced"),
    "model.projection": ("linear", "pool", "none"),
    "model.init": ("client", "architecture"),
    "train.optimizer": ("sgd", "adam"),
    "train.precision": ("fp32", "bf16"),
    "sim.backend": ("auto", "serial", "processes"),
    "sim.offload_clients": ("auto", "on", "off"),
    "sim.numerics": ("native", "portable"),
}


def parse_value(text: str) -> Any:
    """Parse a ``--set`` value as a TOML literal (numbers, booleans, lists); else a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides to a raw (TOML-shaped) dict."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value")
        dotted, text = item.split("=", 1)
        parts = dotted.strip().split(".")
        node = raw
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {dotted!r}: {p!r} is not a table")
        node[parts[-1]] = parse_value(text.strip())
    return raw


_PLUGINS: dict[str, Any] = {}
# --plugin on the command line: imported at once and recorded in every config this process
# builds (so the simulator's workers and the Flower apps import them too).
_CLI_PLUGINS: list[str] = []
# Installed packages extend fedmosaic through these entry-point groups (each entry point names
# a module that registers its algorithms / encoders and families / datasets / partitioners).
ENTRY_POINT_GROUPS = (
    "fedmosaic.algorithms",
    "fedmosaic.models",
    "fedmosaic.datasets",
    "fedmosaic.partitioners",
)
_entry_points_loaded = False


def resolve_plugin(name: str, base: Path) -> str:
    """A ``.py`` plugin as an absolute path (relative ones against ``base``); modules as named."""
    if not name.endswith(".py"):
        return name
    path = Path(name).expanduser()
    return str((path if path.is_absolute() else base / path).resolve())


def add_plugins(names: list[str]) -> None:
    """``--plugin``: import each now (relative paths against the working folder) and record it
    in every config built afterwards in this process."""
    for name in names:
        resolved = resolve_plugin(name, Path.cwd())
        load_plugins([resolved])
        if resolved not in _CLI_PLUGINS:
            _CLI_PLUGINS.append(resolved)


def load_entry_points() -> None:
    """Import every installed package's ``fedmosaic.*`` entry points, once per process."""
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    _entry_points_loaded = True  # set first: a failing plugin is reported once, not retried
    from importlib.metadata import entry_points

    for group in ENTRY_POINT_GROUPS:
        for ep in entry_points(group=group):
            try:
                ep.load()
            except Exception as exc:  # the package's own error: name the entry point
                raise ConfigError(
                    f"entry point {group}:{ep.name} = {ep.value!r} cannot be imported: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc


def load_plugins(names: list[str]) -> None:
    """Import each plugin once per process (a module name, or a path to a ``.py`` file)."""
    import hashlib
    import importlib
    import importlib.util
    import sys

    for name in names:
        if name in _PLUGINS:
            continue
        try:
            if name.endswith(".py"):
                path = Path(resolve_plugin(name, Path.cwd()))
                if not path.is_file():
                    raise ConfigError(f"plugins: {name!r} does not exist")
                tag = hashlib.sha1(str(path).encode()).hexdigest()[:8]
                mod_name = f"fedmosaic_plugin_{path.stem}_{tag}"
                spec = importlib.util.spec_from_file_location(mod_name, path)
                assert spec is not None and spec.loader is not None
                module = importlib.util.module_from_spec(spec)
                sys.modules[mod_name] = module
                spec.loader.exec_module(module)
            else:
                module = importlib.import_module(name)
        except ConfigError:
            raise
        except Exception as exc:  # the plugin's own error: name the plugin
            raise ConfigError(
                f"plugins: cannot import {name!r}: {type(exc).__name__}: {exc}"
            ) from exc
        _PLUGINS[name] = module


def check_keys(cls: type, values: dict[str, Any], where: str) -> None:
    """Every key of ``values`` a field of the dataclass ``cls``; else a ConfigError naming the
    key, the valid ones and the closest (``train.lrr``: did you mean 'train.lr'?)."""
    fields = sorted(f.name for f in dataclasses.fields(cls) if f.init)
    for key in values:
        if key not in fields:
            name = f"{where}.{key}"
            raise ConfigError(
                f"unknown key {name!r}; valid keys: {', '.join(fields)}"
                + did_you_mean(str(key), fields, where + ".{}")
            )


def _top_level_hint(key: str, value: Any) -> str:
    """The did-you-mean of an unknown top-level key: the section it was meant for, with the key
    it holds where that is one of the section's (``trian.lr``: did you mean 'train.lr'?)."""
    known = ["seed", "plugins", *SECTIONS, "algorithm"]
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    if close and close[0] in SECTIONS and isinstance(value, dict) and len(value) == 1:
        inner = str(next(iter(value)))
        if inner in {f.name for f in dataclasses.fields(SECTIONS[close[0]])}:
            return did_you_mean(str(key), close, "{}." + inner)
    return did_you_mean(str(key), known)


def from_dict(raw: dict[str, Any]) -> ExperimentConfig:
    raw = dict(raw)
    top_known = {"seed", "plugins", *SECTIONS, "algorithm"}
    for key in raw:
        if key not in top_known:
            raise ConfigError(
                f"unknown key {key!r}; valid top-level keys: {', '.join(sorted(top_known))}"
                + _top_level_hint(key, raw[key])
            )
    seed = raw.get("seed", 0)
    if not type_ok(seed, int):
        raise ConfigError(f"seed = {seed!r} must be an int")
    plugins = raw.get("plugins", [])
    if not isinstance(plugins, list) or not all(isinstance(p, str) and p for p in plugins):
        raise ConfigError(f"plugins = {plugins!r} must be a list of module names or .py paths")
    plugins = [*plugins, *(p for p in _CLI_PLUGINS if p not in plugins)]
    sections: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        value = raw.get(name, {})
        if not isinstance(value, dict):
            raise ConfigError(f"{name} must be a table, got {value!r}")
        check_keys(cls, value, name)
        sections[name] = build_dataclass(cls, value, name)
    algo = raw.get("algorithm", {"name": "lg_fedavg"})
    if not isinstance(algo, dict) or not isinstance(algo.get("name"), str):
        raise ConfigError("[algorithm] must be a table with a string key 'name'")
    cfg = ExperimentConfig(seed=seed, plugins=list(plugins), algorithm=dict(algo), **sections)
    # A plugin is code: a config whose own values are wrong is refused before any of it runs.
    validate_values(cfg)
    load_entry_points()
    load_plugins(plugins)  # before the algorithm/model names are looked up
    validate_registry(cfg)
    return cfg


def read_toml(path: str | Path, what: str = "config file") -> dict[str, Any]:
    """A TOML file as a dict; a missing or malformed file is a ConfigError naming it."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"{what} {str(p)!r} is a folder, not a file")
    if not p.is_file():
        raise ConfigError(f"{what} {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {str(p)!r} is not valid TOML: {exc}") from exc
    except UnicodeDecodeError as exc:  # TOML is UTF-8 by definition
        raise ConfigError(f"{what} {str(p)!r} is not UTF-8 text: {exc}") from exc


def load(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    algorithm: dict[str, Any] | None = None,
) -> ExperimentConfig:
    """A config file with ``overrides`` applied; ``algorithm`` replaces its whole ``[algorithm]``
    table after them (a baseline of another method keeps none of the file's method settings)."""
    raw = read_toml(path) if path is not None else {}
    plugins = raw.get("plugins")
    if path is not None and isinstance(plugins, list):
        # A relative .py plugin sits beside its config (else it is taken from the working
        # folder); recorded as an absolute path, so workers started elsewhere find it too.
        base = Path(path).parent
        raw["plugins"] = [
            resolve_plugin(p, base)
            if isinstance(p, str) and p.endswith(".py") and (base / p).is_file()
            else p
            for p in plugins
        ]
    raw = apply_overrides(raw, list(overrides or []))
    if algorithm is not None:
        raw["algorithm"] = dict(algorithm)
    return from_dict(raw)


# What names an experiment: a TOML path, a dict of its tables, or a config already built.
Config = str | Path | dict[str, Any] | ExperimentConfig


def experiment_config(config: Config, overrides: Sequence[str] = ()) -> ExperimentConfig:
    """A validated config from a TOML path, a dict of its tables, or an ``ExperimentConfig``;
    ``overrides`` are ``--set``-style ``"section.key=value"`` strings. Plugins named in it are
    imported here."""
    if (
        isinstance(overrides, str)
        or not isinstance(overrides, Sequence)
        or not all(isinstance(o, str) for o in overrides)
    ):
        raise ConfigError(
            f"overrides = {overrides!r}: a list of 'section.key=value' strings, "
            "e.g. ['train.rounds=3']"
        )
    if isinstance(config, ExperimentConfig):
        config = config.to_dict()
    if not isinstance(config, dict | str | Path):
        raise ConfigError(
            f"config = {config!r}: a TOML path, a dict of its tables or an ExperimentConfig"
        )
    if isinstance(config, dict):
        return from_dict(apply_overrides(copy.deepcopy(config), list(overrides)))
    return load(config, list(overrides))


def _wandb_installed() -> bool:
    import importlib.util
    import sys

    return "wandb" in sys.modules or importlib.util.find_spec("wandb") is not None


def _device_ok(dev: str) -> bool:
    """``cpu``, ``cuda`` or ``cuda:N``."""
    n = dev[5:]
    return dev in ("cpu", "cuda") or (dev.startswith("cuda:") and n.isascii() and n.isdigit())


# No setting of this project means anything beyond these magnitudes (counts, sizes, rates,
# weights); a value past them is a typo or an attack (2**70 overflows int64 later, 1e300 turns
# every loss into inf), so it is refused by name before anything runs. ``seed`` has its own range.
MAX_INT = 10**9
MAX_FLOAT = 1e6
MAX_FEATURE_DIM = 1 << 16
# The memory data.dataset = "synthetic" may take to generate (synthetic_memory); the images are
# generated a chunk of CHUNK_PIXELS at a time and their statistics computed directly (a float64
# copy, ~16 bytes a pixel) only up to STATS_DIRECT_PIXELS (fedmosaic/data/datasets.py).
MAX_SYNTHETIC_BYTES = 1 << 31
MAX_SYNTHETIC_CLASSES = 100_000  # ImageNet-21k has ~21,800
CHUNK_PIXELS = 1 << 22
STATS_DIRECT_PIXELS = 1 << 25


def synthetic_memory(size: int, classes: int, shape: list[int]) -> int:
    """Peak bytes the synthetic generator needs: the uint8 images, int64 labels and their
    shuffle (24 bytes an image), the class grids, one chunk's float64 working set (noise, class
    means, their sum, the clipped and rounded copies) and the statistics' working set."""
    c, h, w = shape
    pixels = c * h * w
    grids = classes * c * min(h, 4) * min(w, 4) * 8
    chunk = 5 * 8 * max(CHUNK_PIXELS, pixels)
    stats = 16 * min(size * pixels, STATS_DIRECT_PIXELS)
    return size * (pixels + 24) + grids + chunk + stats


def _check_magnitudes(where: str, obj: Any) -> None:
    """Every int/float field of the dataclass ``obj`` (lists too) within +-MAX_INT / MAX_FLOAT."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        items = value if isinstance(value, (list, tuple)) else [value]
        for v in items:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            top = MAX_INT if isinstance(v, int) else MAX_FLOAT
            if abs(v) > top:
                raise ConfigError(
                    f"{where}.{f.name} = {value!r} is out of range (|value| <= {top:g})"
                )


def planned_clients_per_round(cfg: ExperimentConfig) -> int:
    """Clients sampled per round: ``train.clients_per_round``, else ``train.participation`` of
    the clients that train (all but ``eval.holdout_clients``); the round plan's number."""
    trainers = cfg.data.num_clients - cfg.eval.holdout_clients
    return min(cfg.train.clients_per_round, trainers) or clients_per_round(
        trainers, cfg.train.participation
    )


def _check_rule_fits_round(cfg: ExperimentConfig) -> None:
    """A robust rule the planned round cannot satisfy is refused, naming the largest value that
    fits (it would otherwise be clamped: multi-Krum on too few clients is Krum)."""
    s, k = cfg.server, planned_clients_per_round(cfg)
    sampled = f"{k} clients per round (data.num_clients, train.participation / clients_per_round)"
    if s.aggregator in ("krum", "multi_krum") and s.f > largest_f(k):
        if largest_f(k) < 0:
            raise ConfigError(
                f'server.aggregator = "{s.aggregator}" needs at least 3 clients per round '
                f"(n > 2f + 2); this federation samples {sampled}"
            )
        raise ConfigError(
            f'server.f = {s.f} is too large for "{s.aggregator}" on {sampled}: it needs '
            f"n > 2f + 2; the largest allowed is {largest_f(k)}"
        )
    if s.aggregator == "trimmed_mean" and s.trim >= trim_limit(k):
        raise ConfigError(
            f"server.trim = {s.trim} would cut every value on {sampled}; it must be below "
            f"{trim_limit(k):.6g}"
        )


def _check_privacy_plan(cfg: ExperimentConfig) -> None:
    """What ``[privacy]`` needs of the rest of the config (the method's part: ``validate_registry``)."""
    p, s = cfg.privacy, cfg.server
    if p.secure_aggregation:
        if not s.plain:
            raise ConfigError(
                f"privacy.secure_aggregation gives the server only the plain sum; server.aggregator"
                f' = "{s.aggregator}" with server.clip_update_norm = {s.clip_update_norm:g} needs '
                'each upload (use aggregator "mean" and no clipping)'
            )
        if planned_clients_per_round(cfg) < 2:
            raise ConfigError(
                "privacy.secure_aggregation needs at least 2 clients a round (the sum of one "
                "upload is that upload): raise train.clients_per_round"
            )
    if not p.on:
        return
    if p.mechanism == "central" and not s.plain:
        raise ConfigError(
            f'privacy.mechanism = "central" adds its noise to the plain sum of the clipped '
            f'uploads; server.aggregator = "{s.aggregator}" with server.clip_update_norm = '
            f'{s.clip_update_norm:g} is not that sum (use aggregator "mean" and no clipping, or '
            "the local mechanism)"
        )
    trainers = cfg.data.num_clients - cfg.eval.holdout_clients
    k = planned_clients_per_round(cfg)
    if p.accountant == "pld" and k < trainers:
        raise ConfigError(
            f'privacy.accountant = "pld" cannot count rounds that sample '
            f"{k} of {trainers} clients without replacement; "
            'use privacy.accountant = "rdp"'
        )
    if p.epsilon > 0:  # the noise that ends the planned rounds at epsilon
        # local: a client may take part in every round (its epsilon counts its own uploads)
        try:
            z = accountant.noise_for(
                p.mechanism, p.accountant, p.epsilon, p.delta, cfg.train.rounds, trainers, k
            )
        except ImportError as exc:
            raise ConfigError(f"privacy.epsilon: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"privacy.epsilon = {p.epsilon:g}: {exc}") from None
        cfg.privacy = dataclasses.replace(p, noise_multiplier=z)


def _check_synthetic_pool(d: DataConfig) -> None:
    """What is absurd on its face for a synthetic pool, refused before it is generated: more
    classes than any dataset has, fewer than two images a class (one to train on, one to
    test), more clients than there are images to share (each client needs one)."""
    if d.synthetic_classes > MAX_SYNTHETIC_CLASSES:
        raise ConfigError(
            f"data.synthetic_classes = {d.synthetic_classes} must be <= "
            f"{MAX_SYNTHETIC_CLASSES} (every client model has a head row per class)"
        )
    if d.synthetic_size < 2 * d.synthetic_classes:
        raise ConfigError(
            f"data.synthetic_classes = {d.synthetic_classes} leaves data.synthetic_size = "
            f"{d.synthetic_size} images at fewer than 2 a class (one to train on, one to test); "
            "lower data.synthetic_classes or raise data.synthetic_size"
        )
    # An upper bound on the rows the clients share: the stratified subsample keeps
    # round(subsample x n_c) of each class, at least one.
    # (The public and server splits come out of it later, refused by name if they leave none.)
    pool = min(d.synthetic_size, int(d.subsample * d.synthetic_size) + d.synthetic_classes)
    if d.num_clients > pool:
        raise ConfigError(
            f"data.num_clients = {d.num_clients} is more than the {pool} images there are to "
            f"share (data.synthetic_size = {d.synthetic_size} x data.subsample = "
            f"{d.subsample:g}): every client needs a training example; lower "
            "data.num_clients or raise data.synthetic_size"
        )


def validate(cfg: ExperimentConfig) -> None:
    """Checks that need no data: choices, ranges, algorithm hyperparameters, model family."""
    validate_values(cfg)
    validate_registry(cfg)


def validate_values(cfg: ExperimentConfig) -> None:
    """The config's own values (choices, ranges, types): nothing looked up in a registry, so
    these run before any plugin is imported."""
    for section in SECTIONS:
        _check_magnitudes(section, getattr(cfg, section))
    for dotted, choices in CHOICES.items():
        section, key = dotted.split(".")
        value = getattr(getattr(cfg, section), key)
        if value not in choices:
            raise ConfigError(f"{dotted} = {value!r}; choose one of {', '.join(choices)}")
    d, t = cfg.data, cfg.train
    positive = {
        "data.num_clients": d.num_clients,
        "train.rounds": t.rounds,
        "train.batch_size": t.batch_size,
        "train.eval_every": t.eval_every,
        "train.eval_batch_size": t.eval_batch_size,
        "train.local_epochs": t.local_epochs,
    }
    for k, v in positive.items():
        if v < 1:
            raise ConfigError(f"{k} = {v} must be >= 1")
    if d.alpha <= 0:  # whatever the partition: a value no split can use is a mistake, not unused
        raise ConfigError(f"data.alpha = {d.alpha} must be > 0")
    if d.quantity_alpha <= 0:
        raise ConfigError(f"data.quantity_alpha = {d.quantity_alpha} must be > 0")
    if d.power_law_exponent < 0:
        raise ConfigError(f"data.power_law_exponent = {d.power_law_exponent} must be >= 0")
    if not 0.0 <= d.shift_rotation <= 180.0:
        raise ConfigError(f"data.shift_rotation = {d.shift_rotation} must be in [0, 180] degrees")
    if d.shift_contrast < 1.0:
        raise ConfigError(f"data.shift_contrast = {d.shift_contrast} must be >= 1 (1 = off)")
    if not 0.0 <= d.shift_brightness <= 1.0:
        raise ConfigError(f"data.shift_brightness = {d.shift_brightness} must be in [0, 1]")
    if d.shift_domains < 0:
        raise ConfigError(f"data.shift_domains = {d.shift_domains} must be >= 0")
    if d.partition in ("pathological", "skewed") and d.classes_per_client < 1:
        raise ConfigError(f"data.classes_per_client = {d.classes_per_client} must be >= 1")
    if not 0.0 < d.subsample <= 1.0:
        raise ConfigError(f"data.subsample = {d.subsample} must be in (0, 1]")
    if not 0.0 <= d.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction = {d.val_fraction} must be in [0, 1)")
    if d.public_size < 0:
        raise ConfigError(f"data.public_size = {d.public_size} must be >= 0")
    if d.server_eval_size < 0:
        raise ConfigError(f"data.server_eval_size = {d.server_eval_size} must be >= 0")
    if not 0.0 < t.participation <= 1.0:
        raise ConfigError(f"train.participation = {t.participation} must be in (0, 1]")
    if not 0 <= t.clients_per_round <= d.num_clients:
        raise ConfigError(
            f"train.clients_per_round = {t.clients_per_round} must be in [0, data.num_clients={d.num_clients}]"
        )
    if t.lr <= 0:
        raise ConfigError(f"train.lr = {t.lr} must be > 0")
    sim = cfg.sim
    at_least = {
        "data.min_size": (d.min_size, 0),
        "data.split_seed": (d.split_seed, -1),
        "data.max_tries": (d.max_tries, 1),
        "data.classes_per_client": (d.classes_per_client, 1),
        "data.synthetic_size": (d.synthetic_size, 1),
        "data.synthetic_classes": (d.synthetic_classes, 2),
        "train.finetune_epochs": (t.finetune_epochs, -1),
        "sim.workers": (sim.workers, 0),
    }
    for k, (v, low) in at_least.items():
        if v < low:
            raise ConfigError(f"{k} = {v} must be >= {low}")
    if sim.threads != "auto" and not (isinstance(sim.threads, int) and sim.threads >= 0):
        raise ConfigError(
            f'sim.threads = {sim.threads!r} must be "auto" or an int >= 0 (0 = torch\'s default)'
        )
    if cfg.model.projection == "none" and cfg.algorithm.get("name") != "local":
        raise ConfigError(
            'model.projection = "none" (each encoder\'s own width) is only for algorithm "local": '
            "methods that share features need one width (FedHeNN picks its own projection)"
        )
    if not 1 <= cfg.model.feature_dim <= MAX_FEATURE_DIM:
        raise ConfigError(
            f"model.feature_dim = {cfg.model.feature_dim} must be in [1, {MAX_FEATURE_DIM}]"
        )
    if not 0 <= cfg.seed < 2**63:
        raise ConfigError(f"seed = {cfg.seed} must be in [0, 2**63)")
    if not 0.0 <= t.momentum < 1.0:
        raise ConfigError(f"train.momentum = {t.momentum} must be in [0, 1)")
    if t.weight_decay < 0:
        raise ConfigError(f"train.weight_decay = {t.weight_decay} must be >= 0")
    if not 0.0 <= t.plateau_delta < 1.0:
        raise ConfigError(f"train.plateau_delta = {t.plateau_delta} must be in [0, 1)")
    if not 0.0 < t.plateau_window < 1.0:
        raise ConfigError(f"train.plateau_window = {t.plateau_window} must be in (0, 1)")
    if t.plateau_min_rounds < 1:
        raise ConfigError(f"train.plateau_min_rounds = {t.plateau_min_rounds} must be >= 1")
    if not isinstance(t.fused_sgd, bool) and t.fused_sgd != "auto":
        raise ConfigError(f'train.fused_sgd = {t.fused_sgd!r} must be true, false or "auto"')
    if t.plateau_delta > 0 and d.val_fraction == 0 and d.split != "8_1_1":
        raise ConfigError(
            f"train.plateau_delta = {t.plateau_delta} stops on validation accuracy: set "
            'data.val_fraction > 0 (or data.split = "8_1_1")'
        )
    if len(t.betas) != 2 or not all(0.0 <= b < 1.0 for b in t.betas):
        raise ConfigError(f"train.betas = {t.betas} must be two numbers in [0, 1)")
    if len(d.synthetic_shape) != 3 or min(d.synthetic_shape) < 1:
        raise ConfigError(
            f"data.synthetic_shape = {d.synthetic_shape} must be [C, H, W], each >= 1"
        )
    need = synthetic_memory(d.synthetic_size, d.synthetic_classes, d.synthetic_shape)
    if d.dataset == "synthetic" and need > MAX_SYNTHETIC_BYTES:
        # the largest size that fits, by bisection (the need grows with the size)
        lo, hi = 0, d.synthetic_size
        while lo < hi:
            mid = (lo + hi + 1) // 2
            fits = synthetic_memory(mid, d.synthetic_classes, d.synthetic_shape)
            lo, hi = (mid, hi) if fits <= MAX_SYNTHETIC_BYTES else (lo, mid - 1)
        raise ConfigError(
            f"data.synthetic_size = {d.synthetic_size} needs {need / 2**30:.1f} GiB to generate "
            f"{d.synthetic_shape} images (at most {MAX_SYNTHETIC_BYTES / 2**30:g} GiB); the "
            f"largest accepted size here is {lo}"
        )
    if d.dataset == "synthetic":
        _check_synthetic_pool(d)
    if not 0 <= cfg.eval.holdout_clients < d.num_clients:
        raise ConfigError(
            f"eval.holdout_clients = {cfg.eval.holdout_clients} must be in "
            f"[0, data.num_clients - 1 = {d.num_clients - 1}] (at least one client trains)"
        )
    _check_rule_fits_round(cfg)
    _check_privacy_plan(cfg)
    if sim.wandb and not _wandb_installed():
        raise ConfigError(
            f"sim.wandb = {sim.wandb!r} needs the wandb package: pip install 'fedmosaic[wandb]'"
        )
    if not _device_ok(t.device):
        raise ConfigError(f"train.device = {t.device!r}; use cpu, cuda or cuda:N")
    if t.batched_clients not in ("auto", True, False):
        raise ConfigError(
            f'train.batched_clients = {t.batched_clients!r}; choose "auto", true or false'
        )
    if t.cuda_graphs not in ("auto", True, False):
        raise ConfigError(f'train.cuda_graphs = {t.cuda_graphs!r}; choose "auto", true or false')
    for i, dev in enumerate(sim.devices):
        if not _device_ok(dev):
            raise ConfigError(f"sim.devices[{i}] = {dev!r}; use cpu, cuda or cuda:N")
    if sim.devices and sim.backend == "serial":
        raise ConfigError(
            f'sim.devices = {sim.devices!r} places worker processes: set sim.backend = "processes"'
        )


def validate_registry(cfg: ExperimentConfig) -> None:
    """The names looked up in the registries (algorithm and its hyperparameters, model family):
    after the plugins that may register them are imported."""
    d = cfg.data
    # The registries, imported here and only here: they need torch (the algorithms and models
    # are torch modules), which the checks above do not, so a mistake in the generic tables is
    # refused without it (``fedmosaic run --set train.lrr=0.1`` costs no torch import).
    from fedmosaic.algorithms import build_algorithm
    from fedmosaic.models import family_members

    name = cfg.algorithm["name"]
    if name not in ALGORITHMS:
        raise ConfigError(
            f"algorithm.name = {name!r} is unknown; known: {', '.join(ALGORITHMS.names())}"
            + did_you_mean(name, ALGORITHMS.names())
        )
    check_keys(
        ALGORITHMS.get(name), {k: v for k, v in cfg.algorithm.items() if k != "name"}, "algorithm"
    )
    algo = build_algorithm(cfg.algorithm)
    _check_magnitudes("algorithm", algo)
    try:
        members = family_members(cfg.model.family)
    except KeyError as exc:
        hint = did_you_mean(cfg.model.family, [*FAMILIES.names(), *ENCODERS.names()])
        raise ConfigError(f"model.family = {cfg.model.family!r}: {exc.args[0]}{hint}") from None
    heterogeneous = len({m for m in members}) > 1 and d.num_clients > 1
    if heterogeneous and not algo.supports_heterogeneous:
        raise ConfigError(
            f"algorithm.name = {cfg.algorithm['name']!r} needs identical client models, but "
            f"model.family = {cfg.model.family!r} is heterogeneous; pick a single architecture "
            f'(e.g. model.family = "{members[0]}")'
        )
    if cfg.privacy.on or cfg.privacy.dpsgd:
        _check_method_privacy(cfg, algo)
    if cfg.privacy.secure_aggregation:
        from fedmosaic.core import secure

        why = secure.refusal(algo)
        if why:
            raise ConfigError(
                f"privacy.secure_aggregation is not available for {cfg.algorithm['name']!r}: {why}"
            )
    # What the method needs of the federation itself (a public split, identical heads) is checked
    # against the FederationSpec when the federation is assembled: Algorithm.check.


def _check_method_privacy(cfg: ExperimentConfig, algo: Any) -> None:
    """The method's uploads can be released under ``[privacy]`` (core/privacy.py)."""
    from fedmosaic.core import privacy

    try:  # the accountant's, needed from round 1: refused before anything trains
        import dp_accounting  # type: ignore[import-untyped, unused-ignore]  # noqa: F401
    except ImportError:
        raise ConfigError(
            "[privacy] needs dp-accounting for its accountant: pip install 'fedmosaic[privacy]'"
        ) from None
    name = cfg.algorithm["name"]
    if cfg.privacy.dpsgd:
        from fedmosaic.core import dpsgd

        if not dpsgd.declares_per_example_loss(algo):
            raise ConfigError(
                f"privacy.sample_clip = {cfg.privacy.sample_clip:g} (DP-SGD) needs a loss that "
                f"is a mean of per-example terms; {name!r} does not declare one "
                "(per_example_loss: its loss couples a batch's examples, uses other data or "
                "counts as it goes)"
            )
        try:
            plan = privacy.release_plan(algo.Upload)
        except privacy.PrivacyError as exc:
            raise ConfigError(f"[privacy] is not available for {name!r}: {exc}") from None
        if not cfg.privacy.on and (plan.values or plan.fixed):
            raise ConfigError(
                f"privacy.sample_clip (DP-SGD) protects what {name!r} trains, but its upload also "
                f"carries values computed on the data ({', '.join(plan.values + plan.fixed)}), "
                'which DP-SGD does not cover: add privacy.mechanism = "local" (or "central")'
            )
    if not cfg.privacy.on:
        return
    try:
        privacy.check_releasable(algo.Upload, algo.privacy_refusal)
    except privacy.PrivacyError as exc:
        raise ConfigError(f"[privacy] is not available for {name!r}: {exc}") from None
    if cfg.privacy.mechanism == "central" and not algo.server_sums:
        raise ConfigError(
            f'privacy.mechanism = "central" needs a server that only averages the uploads; '
            f"{name!r}'s server uses each client's upload on its own (it trains on them), so "
            'noise on the sum would not cover what it releases; use privacy.mechanism = "local"'
        )
