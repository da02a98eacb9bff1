"""The algorithm contract: server half and client half of one method, side by side.

An :class:`Algorithm` is a frozen dataclass whose fields are its hyperparameters; it holds no
mutable state. Server state goes in and out of ``init_server``/``aggregate``; client state lives
in the client's model and its ``extras`` module (persistent across rounds).
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedmosaic.core import guard
from fedmosaic.core.checks import PrivacyRule
from fedmosaic.core.model import ClientModel
from fedmosaic.core.payload import Payload
from fedmosaic.core.robust import RobustRule
from fedmosaic.core.typed import check_choices

if TYPE_CHECKING:
    from fedmosaic.core.client import ClientData
    from fedmosaic.core.training import TrainSettings

S = TypeVar("S")
B = TypeVar("B", bound=Payload)
U = TypeVar("U", bound=Payload)


@dataclass(frozen=True)
class Weighted(Generic[U]):
    """An upload with its client id and weight (number of local training examples)."""

    client_id: int
    weight: float
    payload: U


@dataclass(frozen=True)
class Phase:
    """A stretch of local training: which parameters train and for how many epochs.

    ``trainable`` entries are model parts (``all``, ``encoder``, ``head``) or qualified parameter
    name prefixes (``encoder.conv1``). ``train_extras`` also trains the client's extras module.
    """

    trainable: tuple[str, ...] = ("all",)
    epochs: int = 1
    train_extras: bool = True
    name: str = "train"


@dataclass(frozen=True)
class FederationSpec:
    """What both halves may know about the federation before round 1."""

    num_clients: int
    num_classes: int
    feature_dim: int
    input_shape: tuple[int, int, int]
    members: tuple[str, ...]  # architecture member string per client
    num_train: tuple[int, ...]  # training examples per client
    seed: int
    rounds: int
    build_model: Callable[[int], ClientModel]  # fresh, deterministic model of client i's arch
    public: Tensor | None = None  # server-held public inputs, normalized float [P, C, H, W]
    device: str = "cpu"
    # How ``build_model`` maps encoders to ``feature_dim`` (``models.build``): every other model a
    # client builds (FML's meme, FedKD's mentee) is built the same way.
    projection: str = "linear"
    # The server's aggregation rule (``[server]``: robust aggregators, clipping, magnitude
    # sanity; ``core/robust.py``), applied by the round loop.
    robust: RobustRule = field(default_factory=RobustRule)
    # Client-level differential privacy of the uploads (``[privacy]``): the round loop applies
    # the central mechanism and counts epsilon; clients apply the local one (core/privacy.py).
    privacy: PrivacyRule = field(default_factory=PrivacyRule)
    # Training examples per client and class, where the server reproduces the partition (the
    # simulator; Flower apps rebuild it from the config): claimed classes and per-class counts
    # in uploads are checked against it. None: unknown, those checks are skipped.
    class_counts: tuple[tuple[int, ...], ...] | None = None
    # The server's labelled evaluation split (``data.server_eval_size``): normalized inputs
    # ``[N, C, H, W]`` and labels ``[N]`` on the CPU, for the round loop's server-side evaluation
    # of ``Algorithm.server_model``; no client's data, and no method's business. None: off.
    server_eval: tuple[Tensor, Tensor] | None = None
    # Every client's features are >= 0 by its encoder's structure (each ends in a ReLU: the
    # assembly reads it from the zoo). Uploads declared as class means of features
    # (``Rows(features=True)``) are then refused with a negative entry: no honest client can
    # send one. False: features may be negative, nothing is checked.
    nonnegative_features: bool = False

    @property
    def homogeneous(self) -> bool:
        return len(set(self.members)) == 1


def payload_to(msg: B, device: torch.device | str) -> B:
    """The same payload with every tensor on ``device`` (no copy when already there)."""
    changes: dict[str, Any] = {}
    for f in dataclasses.fields(msg):
        v = getattr(msg, f.name)
        if isinstance(v, Tensor):
            changes[f.name] = v.to(device)
        elif isinstance(v, dict):
            changes[f.name] = {k: t.to(device) for k, t in v.items()}
    return dataclasses.replace(msg, **changes)


@dataclass(frozen=True)
class Acceleration:
    """What a method declares about its client training so the fast paths of ``fedmosaic.accel``
    may compute it with the same maths (``Algorithm.acceleration``).

    ``batched``: clients of one architecture may train as one batched computation
    (``accel.batched``, ``train.batched_clients``) with the numbers of one-at-a-time. It holds when
    the client's training is ``loss`` over ``phases`` and nothing else per step: ``loss`` is a pure
    function of the model's (and extras') parameters and buffers, the batch and the message (no
    randomness, no Python state carried between steps, no ``.grad`` or hooks), and every
    trainable parameter takes part in it. ``receive``, ``before_fit`` and ``upload`` still run
    per client.

    ``fused_sgd``: with plain SGD the Linear layers' update may run inside their backward
    (``accel.fused``, ``train.fused_sgd = "auto"``), which fills no ``.grad``: ``loss``
    differentiates once (no ``torch.autograd.grad(..., create_graph=True)``, gradient penalties
    or gradient hooks).
    """

    batched: bool = False
    fused_sgd: bool = False


def declared_acceleration(algo: object) -> Acceleration:
    """``algo``'s ``acceleration`` as declared for the code that trains: a subclass that overrides
    ``loss``, ``phases`` or ``before_fit`` below the class declaring it (a user's variant of a
    built-in method) gets none unless it declares ``acceleration`` itself."""
    mro = type(algo).__mro__
    where = next((c for c in mro if "acceleration" in c.__dict__), None)
    if where is None:
        return Acceleration()
    for name in ("loss", "phases", "before_fit"):
        owner = next((c for c in mro if name in c.__dict__), None)
        if owner is not None and owner is not where and issubclass(owner, where):
            return Acceleration()  # overridden below the declaration
    declared = where.__dict__["acceleration"]
    if not isinstance(declared, Acceleration):
        raise TypeError(f"{where.__name__}.acceleration must be an Acceleration(...)")
    return declared


@dataclass(frozen=True)
class FitContext(Generic[B]):
    """What ``before_fit`` may use: the client's parts, this round's message and its settings.

    Only ``before_fit`` takes a context (it needs six things and runs once a round). ``receive``,
    ``loss``, ``predict`` and ``upload`` keep short positional signatures: they need three to
    five, and ``loss`` runs every step (inside ``vmap`` when clients train batched), where
    building an object per call would cost time for nothing.
    """

    model: ClientModel
    extras: nn.Module
    data: ClientData
    msg: B
    settings: TrainSettings
    gen: torch.Generator  # the client's "batches" generator, drawn before training's batches
    round_num: int


def _declared(cls: type) -> tuple[Any, ...] | None:
    """``cls``'s ``Algorithm[S, B, U]`` arguments from its own parametrized bases, or None when it
    names none (it inherits its parent's). A parametrized generic subclass of Algorithm maps its
    own type variables onto its parent's declaration."""
    for base in cls.__dict__.get("__orig_bases__", ()):
        origin = typing.get_origin(base)
        if origin is Algorithm:
            return typing.get_args(base)
        if isinstance(origin, type) and issubclass(origin, Algorithm):
            params = origin.__parameters__  # type: ignore[attr-defined]  # set by Generic
            bound = dict(zip(params, typing.get_args(base), strict=True))
            return tuple(bound.get(a, a) for a in origin._declaration)
    return None


def _after_choices(post_init: Callable[[Any], None]) -> Callable[[Any], None]:
    """``post_init`` preceded by the choices' check (a subclass need not call super())."""

    @functools.wraps(post_init)
    def checked(self: Any) -> None:
        check_choices(self)
        post_init(self)

    return checked


class Algorithm(ABC, Generic[S, B, U]):
    """Base of every method. Subclasses are frozen dataclasses; fields = hyperparameters.

    A method declares its types once, as the Generic parameters ``Algorithm[ServerState,
    Broadcast, Upload]``; ``Broadcast`` and ``Upload`` below are derived from them at class
    definition (a subclass of a concrete method inherits them, or names ``Algorithm[...]``
    again among its bases to narrow them).
    """

    # Derived in __init_subclass__ from the Generic parameters: never assigned by hand.
    Broadcast: ClassVar[type[Payload]]
    Upload: ClassVar[type[Payload]]
    # the type variables themselves until a subclass binds them (read at run time)
    _declaration: ClassVar[tuple[Any, ...]] = (S, B, U)  # type: ignore[misc]
    supports_heterogeneous: ClassVar[bool] = True
    paper: ClassVar[str] = ""
    # False for a method that exchanges nothing (Local): its rounds report 0 bytes, not the
    # framing of its empty payloads (a real deployment would send no message at all)
    communicates: ClassVar[bool] = True
    # How every client model of this method reaches its width (``models.build``): None follows
    # ``model.projection``; "none" keeps each encoder's natural width (FedHeNN: CKA compares L x L
    # kernel matrices, so each client aligns its own penultimate representation, no added layer)
    model_projection: ClassVar[str | None] = None
    # Which fast paths (``fedmosaic.accel``) may compute this method's client training with the
    # same maths; none by default. Read through ``declared_acceleration`` (a subclass that
    # overrides ``loss``, ``phases`` or ``before_fit`` must declare it again).
    acceleration: ClassVar[Acceleration] = Acceleration()
    # Differential privacy of the uploads (``[privacy]``, core/privacy.py). ``server_sums``: the
    # server uses the uploads' private fields only through their uniform mean over the round
    # (per class for per-class rows), so the trusted server's noise on the clipped sum
    # (``central``) protects all it releases; False for a server that trains on each upload.
    server_sums: ClassVar[bool] = False
    # Non-empty: the reason this method's uploads cannot be made private (every mechanism is
    # refused with it); e.g. a shape that depends on the data.
    privacy_refusal: ClassVar[str] = ""
    # Secure aggregation (``privacy.secure_aggregation``, core/secure.py) needs ``summands`` and
    # ``from_sums``; a method without them is refused with this reason.
    secure_refusal: ClassVar[str] = "its server uses each client's upload on its own"
    # The loss is a mean over the batch of per-example terms (DP-SGD's per-example gradients,
    # core/dpsgd.py). Read from the class that defines ``loss``: a subclass that overrides it
    # declares again (cross-entropy here: True).
    per_example_loss: ClassVar[bool] = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # the flags ``acceleration`` replaced: refused, not silently ignored
        for old in ("batchable", "fused_sgd_safe"):
            if old in cls.__dict__:
                raise TypeError(
                    f"{cls.__name__}.{old} is replaced by "
                    f"acceleration = Acceleration(batched=..., fused_sgd=...)"
                )
        if "validate_upload" in cls.__dict__:
            raise TypeError(
                f"{cls.__name__} overrides validate_upload: declare the Upload's fields (schema "
                "and guard role, core/schema.py) and bind their names in upload_names instead"
            )
        own = cls.__dict__.get("__post_init__")
        if own is not None:  # a method's own checks run after the choices' (Algorithm's below)
            cls.__post_init__ = _after_choices(own)  # type: ignore[method-assign,assignment]
        declared = _declared(cls)
        if declared is not None:
            cls._declaration = declared  # else the parent's, inherited
        if getattr(cls, "__parameters__", ()):
            return  # still generic (a base for other methods): its subclasses bind the rest
        _, broadcast, upload = cls._declaration
        for role, tp in (("Broadcast", broadcast), ("Upload", upload)):
            if not (isinstance(tp, type) and issubclass(tp, Payload)):
                raise TypeError(
                    f"{cls.__name__} must declare Algorithm[ServerState, Broadcast, Upload] "
                    f"with a Payload subclass as {role}, got {tp!r}"
                )
        cls.Broadcast, cls.Upload = broadcast, upload

    def __post_init__(self) -> None:
        """Refuse a value outside a ``Literal[...]`` hyperparameter's choices, naming the key.

        The config builder (``core/typed.py``) refuses them first, with the ``[algorithm]`` key;
        this covers a method constructed in Python."""
        check_choices(self)

    # ---- configuration -------------------------------------------------------------------
    def check(self, spec: FederationSpec) -> None:  # noqa: B027 - optional hook
        """Raise ``core.errors.ConfigError`` for a federation this method cannot run (no public
        split, different heads, ...). Called when the federation is assembled (``federation.py``):
        data loaded, nothing trained or written yet."""

    # ---- server half ---------------------------------------------------------------------
    @abstractmethod
    def init_server(self, spec: FederationSpec) -> S: ...

    @abstractmethod
    def broadcast(self, state: S, client_id: int, round_num: int) -> B: ...

    @abstractmethod
    def aggregate(self, state: S, uploads: Sequence[Weighted[U]], round_num: int) -> S: ...

    def upload_names(self, state: S, upload: U) -> Mapping[str, Any]:
        """The values of the names the Upload's declarations use (``core/schema.py``): dims
        (``C``, ``d``, ...), ``like`` references and the guard roles' references, bound from the
        server state. The round loop checks every upload with them (``core/guard.py``); none by
        default (an upload whose declarations name nothing)."""
        return {}

    @typing.final
    def validate_upload(self, state: S, upload: U, client_id: int) -> None:
        """Raise ``PayloadError`` for an upload the server must not use: its declared schema and
        guard roles with the names of :meth:`upload_names` (``guard.check_upload``, what the
        round loop runs on every upload). Declared, never overridden: a method cannot skip it."""
        guard.check_upload(upload, client_id, self.upload_names(state, upload))

    def server_model(self, state: S, spec: FederationSpec) -> ClientModel | None:
        """The global model the server holds in ``state``, as a fresh model of ``spec`` (for the
        server's own evaluation, ``data.server_eval_size``); None for a method with no global
        model (personalized parts, prototypes, heterogeneous models): evaluation is skipped."""
        return None

    def upload_model(self, model: ClientModel, upload: U) -> ClientModel | None:
        """The client's model as the server can rebuild it from ``upload`` alone (a copy of
        ``model`` with the upload's weights; ``eval.membership`` attacks it: what the server
        learns of the client's data). None for an upload that is not a whole model (a head, a
        body, prototypes, logits): the server has no model to score examples with."""
        return None

    def summands(self, upload: U, weight: float) -> Mapping[str, Tensor] | None:
        """What ``upload`` (of weight ``weight``, at most 1) adds to the round's secure sum:
        float tensors by name, each entry in ``[-R, R]`` for the configured range (weights and
        class counts come scaled so that they are at most 1). None: this method's server needs
        each upload (secure aggregation is refused, ``secure_refusal``)."""
        return None

    def from_sums(self, state: S, sums: Mapping[str, Tensor], round_num: int) -> Weighted[U]:
        """The one upload (client id -1) whose :meth:`aggregate` gives the state the round's
        uploads give, from the sums of their :meth:`summands` (float64). Declared with
        ``summands``; a test holds the two equal for every registered method."""
        raise NotImplementedError(f"{type(self).__name__} declares no summands")

    def upload_metrics(self, upload: U) -> dict[str, float]:
        """Per-client numbers an upload reports, summed over the round's valid uploads into the
        round record (e.g. layer expansion's ``train_macs``); none by default."""
        return {}

    # ---- client half ---------------------------------------------------------------------
    def init_client(self, model: ClientModel, spec: FederationSpec, data: ClientData) -> nn.Module:
        """Persistent client-side extras (FML meme model, FedRoD personal head, ...)."""
        return nn.Module()

    def receive(self, model: ClientModel, extras: nn.Module, msg: B) -> None:  # noqa: B027
        """Load the shared parts from the server's message into the client's model."""

    def before_fit(self, ctx: FitContext[B]) -> None:  # noqa: B027
        """Extra local work before the training phases (e.g. KT-pFL's distillation step)."""

    def phases(self, round_num: int, epochs: int) -> Sequence[Phase]:
        return (Phase(("all",), epochs),)

    def loss(self, model: ClientModel, extras: nn.Module, x: Tensor, y: Tensor, msg: B) -> Tensor:
        return F.cross_entropy(model(x), y)

    @abstractmethod
    def upload(self, model: ClientModel, extras: nn.Module, data: ClientData, msg: B) -> U: ...

    def predict(
        self, model: ClientModel, extras: nn.Module, x: Tensor, msg: B
    ) -> dict[str, Tensor]:
        """Scores ``[B, C]`` per evaluation mode; ``acc`` is the headline one."""
        return {"acc": model(x)}

    def finetune_phases(self, epochs: int | None) -> Sequence[Phase]:
        """Local fine-tuning after the last round.

        ``epochs=None`` means the algorithm's own default (``[train] finetune_epochs = -1``):
        none here; FedBABU and layer expansion override it (their papers fine-tune). ``epochs >
        0`` asks any method for a before/after comparison: by default every trainable part of
        the client (model and extras) for ``epochs`` epochs with the method's own local loss.
        """
        if epochs is None or epochs <= 0:
            return ()
        return (Phase(("all",), epochs, name="finetune"),)

    # ---- descriptions --------------------------------------------------------------------
    @classmethod
    def hyperparameters(cls) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        return out
