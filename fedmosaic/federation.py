"""The assembly layer: a config becomes a federation (data, splits, spec, clients, round plan).

Every runtime builds its federation here and nowhere else: ``experiment`` (the simulator's
orchestration), the process backend's workers (``sim/processes.py``, from the shared images they
are handed) and the Flower apps (``flower/app.py``). A client's initial model and extras are a pure
function of (config, seed, client id), so the same client is built identically in any process.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from fedmosaic import accel, memory
from fedmosaic.algorithms import build_algorithm
from fedmosaic.config import ExperimentConfig, planned_clients_per_round
from fedmosaic.core import dpsgd, seeding
from fedmosaic.core.algorithm import Algorithm, FederationSpec
from fedmosaic.core.client import ClientData
from fedmosaic.core.errors import ConfigError
from fedmosaic.core.model import ClientModel
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.core.rounds import RoundPlan, clients_per_round, holdout_clients
from fedmosaic.core.training import TrainSettings
from fedmosaic.data import FederatedData, build_federated_data
from fedmosaic.models import (
    build_client_model,
    build_encoder,
    ends_nonnegative,
    family_members,
    split_member,
)

log = logging.getLogger("fedmosaic")


@dataclass
class Federation:
    """Everything a runtime needs: the federated data (``data``), per-client models/extras, spec,
    algorithm, plan.

    ``models`` and ``extras`` are empty when the runtime builds its clients itself (the process
    backend's workers, Flower's ClientApps) and when ``offload`` is set: the serial backend then
    keeps the clients in a state store and builds them on demand (``sim/simulator.py``)."""

    cfg: ExperimentConfig
    data: FederatedData
    algo: Algorithm
    spec: FederationSpec
    clients: list[ClientData]
    models: list[ClientModel]
    extras: list[nn.Module]
    settings: TrainSettings
    plan: RoundPlan
    offload: bool = False

    @property
    def eval_splits(self) -> tuple[str, ...]:
        """The splits every evaluation scores: test, and val where any client has one."""
        return ("test", "val") if any(c.num("val") for c in self.clients) else ("test",)


def model_projection(cfg: ExperimentConfig) -> str:
    """The projection of every client model: the method's own (``Algorithm.model_projection``;
    FedHeNN keeps natural widths) or ``model.projection``."""
    name = cfg.algorithm.get("name")
    fixed = (
        ALGORITHMS.get(name).model_projection
        if isinstance(name, str) and name in ALGORITHMS
        else None
    )
    return fixed or cfg.model.projection


def model_builder(cfg: ExperimentConfig, data: FederatedData) -> Callable[[int], ClientModel]:
    members = family_members(cfg.model.family)
    projection = model_projection(cfg)
    reported: set[str] = set()

    def build(client_id: int) -> ClientModel:
        # Each client's initial weights come from its own stream: same seed, same model. With
        # model.init = "architecture", clients of one member share the stream of the first client
        # holding it (client i mod the family's size), so they start identical.
        key = client_id % len(members) if cfg.model.init == "architecture" else client_id
        seeding.seed_torch(cfg.seed, 0, key, "init")
        member = members[client_id % len(members)]
        model = build_client_model(
            member, data.input_shape, data.num_classes, cfg.model.feature_dim, projection=projection
        )
        if cfg.privacy.dpsgd:  # BatchNorm mixes a batch's examples: GroupNorm under DP-SGD
            replaced = dpsgd.replace_batchnorm(model)
            if replaced and member not in reported:
                reported.add(member)
                log.info(
                    "DP-SGD: %s has %d BatchNorm layers, replaced by GroupNorm", member, replaced
                )
        return model.to(cfg.train.device)

    return build


def client_data(data: FederatedData, device: str) -> list[ClientData]:
    out = []
    for cid, split in enumerate(data.clients):
        splits = {"train": split.train, "test": split.test}
        if split.val.numel() > 0:
            splits["val"] = split.val
        out.append(ClientData(cid, data, data.dataset.labels, splits, data.num_classes, device))
    return out


@functools.cache
def _encoder_nonnegative(
    arch: str, input_shape: tuple[int, int, int], feature_dim: int, projection: str
) -> bool:
    with torch.random.fork_rng(devices=[]):  # a probe build: the run's streams untouched
        return ends_nonnegative(build_encoder(arch, input_shape, feature_dim, projection))


def features_nonnegative(
    members: Sequence[str], input_shape: tuple[int, int, int], feature_dim: int, projection: str
) -> bool:
    """Whether every member's features are >= 0 by its encoder's structure (each ends in a
    ReLU-like activation, then only pooling: HtFLlib's CNNs at their natural width or with the
    pool projection), so a class mean of any client's features is too (``Rows(features=True)``
    holds uploads to it)."""
    return all(
        _encoder_nonnegative(split_member(m)[0], input_shape, feature_dim, projection)
        for m in sorted(set(members))
    )


def make_spec(
    cfg: ExperimentConfig, data: FederatedData, clients: list[ClientData]
) -> FederationSpec:
    members = family_members(cfg.model.family)
    n = data.num_clients
    public = None
    if data.public.numel() > 0:
        public = data.batch(data.public, "cpu")  # [P, C, H, W] normalized, server-held
    server_eval = None
    if data.server_eval.numel() > 0:  # data.server_eval_size: labelled, the server's own
        server_eval = (data.batch(data.server_eval, "cpu"), data.labels[data.server_eval].long())
    return FederationSpec(
        num_clients=n,
        num_classes=data.num_classes,
        feature_dim=cfg.model.feature_dim,
        input_shape=cast(tuple[int, int, int], tuple(data.input_shape)),  # [C, H, W]
        members=tuple(members[i % len(members)] for i in range(n)),
        num_train=tuple(c.num_train for c in clients),
        seed=cfg.seed,
        rounds=cfg.train.rounds,
        build_model=model_builder(cfg, data),
        public=public,
        device=cfg.train.device,
        projection=model_projection(cfg),
        robust=cfg.server,
        privacy=cfg.privacy,
        class_counts=tuple(tuple(c.class_counts("train").tolist()) for c in clients),
        server_eval=server_eval,
        nonnegative_features=features_nonnegative(
            [members[i % len(members)] for i in range(n)],
            cast(tuple[int, int, int], tuple(data.input_shape)),
            cfg.model.feature_dim,
            model_projection(cfg),
        ),
    )


def install_speed() -> None:
    """Install ``fedmosaic.accel`` as core's accelerator (idempotent): fused SGD, fast
    inference, the zoo block's native op, FedTGP's server step by hand; the maths unchanged.
    Speed is opt-in for core (which stays plain) and installed here, where every runtime
    assembles its federation (:func:`build_federation`) or builds a client
    (:func:`make_client`: the process workers, Flower's ClientApps), not by an import."""
    accel.install()


def make_client(
    cfg: ExperimentConfig, algo: Algorithm, spec: FederationSpec, data: ClientData
) -> tuple[ClientModel, nn.Module]:
    """A client's initial model and extras: a pure function of (config, seed, client id).
    Installs the fast paths (:func:`install_speed`): the client trains where it is built."""
    install_speed()
    model = spec.build_model(data.client_id)
    seeding.seed_torch(cfg.seed, 0, data.client_id, "init-extras")
    extras = algo.init_client(model, spec, data).to(cfg.train.device)
    return model, extras


def round_plan(cfg: ExperimentConfig, num_clients: int) -> RoundPlan:
    """Rounds, participants per round, evaluation cadence, held-out clients, plateau stop."""
    holdout = holdout_clients(cfg.seed, num_clients, cfg.eval.holdout_clients)
    trainers = num_clients - len(holdout)
    k = min(cfg.train.clients_per_round, trainers) or clients_per_round(
        trainers, cfg.train.participation
    )
    return RoundPlan(
        num_clients,
        cfg.train.rounds,
        k,
        cfg.train.eval_every,
        cfg.train.finetune_epochs,
        holdout=holdout,
        plateau_delta=cfg.train.plateau_delta,
        plateau_window=cfg.train.plateau_window,
        plateau_min_rounds=cfg.train.plateau_min_rounds,
        local_epochs=cfg.train.local_epochs,
        batch_size=cfg.train.batch_size,
        stop_on_divergence=cfg.train.stop_on_divergence,
        membership=cfg.eval.membership,
    )


def _assemble(
    cfg: ExperimentConfig, data: FederatedData | None
) -> tuple[Algorithm, FederatedData, list[ClientData], FederationSpec]:
    """Everything up to (and including) the method's own check against the federation: the
    device, the algorithm's hyperparameters, the data and ``Algorithm.check(spec)``."""
    wanted = [("train.device", cfg.train.device)]
    wanted += [(f"sim.devices[{i}]", d) for i, d in enumerate(cfg.sim.devices)]
    for key, dev in wanted:
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"{key} = {dev!r} but CUDA is not available")
    algo = build_algorithm(cfg.algorithm)
    if data is None:
        check_memory(cfg)  # before the data are generated, decompressed or partitioned
        data = build_federated_data(cfg.data, cfg.seed)
    clients = client_data(data, cfg.train.device)
    spec = make_spec(cfg, data, clients)
    algo.check(spec)
    return algo, data, clients, spec


def model_state_bytes(cfg: ExperimentConfig, shape: tuple[int, int, int], classes: int) -> int:
    """Mean bytes of one client model's parameters and buffers, built on the meta device (shapes
    only: nothing allocated, no random stream drawn)."""
    members = family_members(cfg.model.family)
    sizes = []
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        for member in dict.fromkeys(members):
            m = build_client_model(
                member, shape, classes, cfg.model.feature_dim, projection=model_projection(cfg)
            )
            sizes.append(module_nbytes(m) * members.count(member))
    return sum(sizes) // len(members)


def memory_parts(cfg: ExperimentConfig) -> list[memory.Part]:
    """The run's memory estimate (:mod:`fedmosaic.memory`): the pooled data, the clients'
    splits, and the client models kept in memory (all of them with ``sim.offload_clients =
    "off"`` or the process backend at full participation; at most :data:`OFFLOAD_BUDGET` under
    "auto", which moves a larger population to the on-disk state store; none with "on")."""
    d = cfg.data
    parts = memory.data_parts(d)
    known = memory.dataset_shape(d)
    if known is None:
        return parts
    _, shape, classes = known
    off = cfg.sim.offload_clients
    full = cfg.sim.backend == "processes" and planned_clients_per_round(cfg) >= (
        d.num_clients - cfg.eval.holdout_clients
    )
    if off == "on":
        return parts
    try:
        each = model_state_bytes(cfg, shape, classes)
    except Exception:  # a model that cannot be sized here is sized by building it, later
        return parts
    total = d.num_clients * each
    if off == "auto" and not full:
        total = min(total, OFFLOAD_BUDGET)
    what = (
        f"data.num_clients x {memory.size_text(each)} of client model state (model.family = "
        f'"{cfg.model.family}", sim.offload_clients = "{off}") = {memory.size_text(total)}'
    )
    keys = ("data.num_clients", "model.family", "sim.offload_clients")
    return [*parts, memory.Part(what, total, keys)]


def check_memory(cfg: ExperimentConfig) -> None:
    """Refuse (ConfigError, one line naming the keys) a run whose estimate exceeds the available
    memory, before anything is built."""
    if memory.check_enabled():
        memory.check_fits(memory_parts(cfg))


def check_runs(runs: Sequence[tuple[str, ExperimentConfig]]) -> None:
    """Check every run against its federation before the first one starts: a method that cannot
    run there (no public split, different heads, ...) fails now, as a ``ConfigError`` naming the
    run, not after earlier runs have trained and written. Builds no client model; runs with the
    same data table and seed share one partition (the dataset files are cached per process)."""
    shared: dict[str, FederatedData] = {}
    for label, cfg in runs:
        key = repr((cfg.data, cfg.seed))
        try:
            _, data, _, _ = _assemble(cfg, shared.get(key))
        except ConfigError as exc:
            raise ConfigError(f"{label}: {exc}") from exc
        shared[key] = data
        if len(shared) > 4:  # bounded: a suite's cells come setting by setting
            del shared[next(iter(shared))]


# Client state (parameters and buffers of every model and extras) the serial backend keeps in
# memory under sim.offload_clients = "auto"; a larger population goes to the state store. 1,000
# cnn2 clients hold 2.3 GB; the store costs a file write and read per client and round.
OFFLOAD_BUDGET = 256 * 2**20


def offload_budget(device: str) -> int:
    """The client state kept live under "auto": :data:`OFFLOAD_BUDGET` of host memory, or on a
    CUDA device half of its free memory when that is more (the states live on the card there;
    the store would copy each one off and back and through a file every round)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return OFFLOAD_BUDGET
    free, _ = torch.cuda.mem_get_info(dev)
    return max(OFFLOAD_BUDGET, free // 2)


def module_nbytes(*modules: nn.Module) -> int:
    """Bytes of the parameters and buffers of ``modules``."""
    return sum(
        t.numel() * t.element_size() for m in modules for t in (*m.parameters(), *m.buffers())
    )


def build_federation(
    cfg: ExperimentConfig,
    with_clients: bool = True,
    data: FederatedData | None = None,
    offload: bool | None = False,
) -> Federation:
    """Load data (unless given: a worker's view of the shared images), build the algorithm, check
    it against the spec and (unless a worker backend owns them) build every client.

    ``offload``: False builds every client here, in ``models``/``extras`` (for callers that read
    them); None lets ``sim.offload_clients`` decide (the simulator's own runs): "on" builds none
    (the serial backend builds them on demand), "auto" builds one client per architecture of the
    family first and stops there when the population's estimated state exceeds
    :func:`offload_budget` (the numbers are the same either way: no client's stream depends on
    where its state waits).
    """
    install_speed()
    algo, data, clients, spec = _assemble(cfg, data)
    settings = TrainSettings.from_config(cfg.train, algo, cfg.privacy, cfg.eval.membership)
    plan = round_plan(cfg, data.num_clients)
    fed = Federation(cfg, data, algo, spec, clients, [], [], settings, plan)
    return add_clients(fed, offload) if with_clients else fed


def add_clients(fed: Federation, offload: bool | None = False) -> Federation:
    """``fed`` with its clients built here (``offload`` as in :func:`build_federation`), on the
    data, algorithm and spec it already holds: a runtime that turns out to train in this
    process (``sim.backend = "auto"`` choosing serial) builds them without assembling twice."""
    cfg, clients = fed.cfg, fed.clients
    models: list[ClientModel] = []
    extras: list[nn.Module] = []
    if offload is None:
        offload = cfg.sim.offload_clients == "on"
        auto = cfg.sim.offload_clients == "auto"
    else:
        auto = False
    if not offload:
        probe = min(len(family_members(cfg.model.family)), len(clients)) if auto else 0
        for c in clients:
            m, e = make_client(cfg, fed.algo, fed.spec, c)
            models.append(m)
            extras.append(e)
            if len(models) == probe:  # client i is architecture i % probe
                sizes = [module_nbytes(m, e) for m, e in zip(models, extras)]
                budget = offload_budget(cfg.train.device)
                if sum(sizes[i % probe] for i in range(len(clients))) > budget:
                    models, extras, offload = [], [], True
                    break
    return dataclasses.replace(fed, models=models, extras=extras, offload=bool(offload))
