"""The guard declared by an upload's fields (``core/schema.py`` roles), applied by
``core/guard.py``: every registered upload declares one for each array field, a method cannot
override the check, and each role does what it says (hand-computed cases)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any

import pytest
import torch
from torch import Tensor

from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.algorithms.fedavg import FedAvg
from fedmosaic.core import guard, robust, schema
from fedmosaic.core.payload import Payload, PayloadError
from fedmosaic.core.robust import RobustRule, ServerView
from fedmosaic.core.schema import Claims, Counts, Rows, SchemaError, Update, Whole


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_array_field_of_every_upload_declares_its_guard_role(name):
    upload = ALGORITHMS.get(name).Upload
    fields, roles = schema.schema_of(upload), schema.roles_of(upload)
    for f, fs in fields.items():
        if fs.kind != "scalar":
            assert roles[f] is not None, f"{upload.__qualname__}.{f} declares no guard role"


def test_a_method_cannot_override_the_check():
    with pytest.raises(TypeError, match="overrides validate_upload"):

        @dataclass(frozen=True)
        class Sloppy(FedAvg):
            def validate_upload(self, state: Any, upload: Any, client_id: int) -> None:
                pass


def test_two_roles_on_a_field_and_malformed_rows_are_programming_errors():
    @dataclass(frozen=True)
    class Two(Payload):
        x: Annotated[Tensor, "[2] float32", Whole(), Counts()]

    with pytest.raises(SchemaError, match="more than one guard role"):
        schema.roles_of(Two)
    with pytest.raises(SchemaError, match="exactly one"):
        Rows()

    @dataclass(frozen=True)
    class Orphan(Payload):
        x: Annotated[Tensor, "[k, 2] float32", Rows(classes="labels")]

    with pytest.raises(SchemaError, match="Rows names no field 'labels'"):
        schema.roles_of(Orphan)
    with pytest.raises(SchemaError, match="go together"):
        Rows(classes="c", ref="g")


@dataclass(frozen=True)
class Up(Payload):
    state: Annotated[dict[str, Tensor], "like shared", Update("shared")]


@dataclass(frozen=True)
class Packed(Payload):  # an update in another form, decoded for the guard (FedKD's factors)
    half: Annotated[dict[str, Tensor], "like shared", Update("base", scale="shared", decode="x2")]


@dataclass(frozen=True)
class Protos(Payload):
    protos: Annotated[Tensor, "[C, 2] float32", Rows(where="counts", ref="glob", known="known")]
    counts: Annotated[Tensor, "[C] int64 >= 0", Counts()]


@dataclass(frozen=True)
class Points(Payload):
    rows: Annotated[Tensor, "[k, 2] float32", Rows(classes="classes")]
    classes: Annotated[Tensor, "[k] int64 in [0, C)", Claims()]


@dataclass(frozen=True)
class Means(Payload):  # class means of the client's features
    rows: Annotated[Tensor, "[k, 2] float32", Rows(classes="classes", features=True)]
    classes: Annotated[Tensor, "[k] int64 in [0, C)", Claims()]


@dataclass(frozen=True)
class Kernel(Payload):
    kernel: Annotated[Tensor, "[2, 2] float32", Whole()]


REF = {"w": torch.tensor([3.0, 4.0])}  # norm 5


def test_update_is_bounded_by_ratio_times_the_reference_norm():
    with robust.serving(ServerView(RobustRule(max_norm_ratio=10.0, peer_factor=0.0))):
        guard.check_upload(Up({"w": torch.tensor([3.0, 4.0 + 49.0])}), 0, {"shared": REF})
        with pytest.raises(PayloadError, match=r"client 3 Up.state: update norm 51 exceeds 10"):
            guard.check_upload(Up({"w": torch.tensor([3.0, 4.0 + 51.0])}), 3, {"shared": REF})


def test_update_decoded_against_another_base_and_scale():
    # decoded: 2 x half = [0, 60]; base {} (a delta): update norm 60 > 10 x ||shared|| = 50
    names = {"shared": REF, "base": {}, "x2": lambda s: {k: 2 * v for k, v in s.items()}}
    with robust.serving(ServerView(RobustRule(max_norm_ratio=10.0, peer_factor=0.0))):
        guard.check_upload(Packed({"w": torch.tensor([0.0, 24.0])}), 0, names)  # 48 <= 50
        with pytest.raises(
            PayloadError, match="update norm 60 exceeds 10 x the broadcast's norm 5"
        ):
            guard.check_upload(Packed({"w": torch.tensor([0.0, 30.0])}), 1, names)


def test_update_norm_is_kept_for_the_peer_guard():
    v = ServerView(RobustRule())
    with robust.serving(v):
        guard.check_upload(Up({"w": torch.tensor([6.0, 8.0])}), 2, {"shared": REF})
    assert math.isclose(v.peer_sq[2], 25.0)  # ||[3, 4]||^2


def test_rows_where_counts_are_bounded_by_the_global_rows_and_kept_by_class():
    glob = torch.tensor([[3.0, 4.0], [0.0, 0.0], [0.0, 1.0]])
    known = torch.tensor([True, False, True])  # largest known norm: 5
    names = {"C": 3, "glob": glob, "known": known}
    v = ServerView(RobustRule(max_norm_ratio=2.0), class_counts=((5, 5, 0),))
    protos = torch.tensor([[3.0, 14.0], [100.0, 0.0], [1e6, 0.0]])  # row 2: count 0, not a row
    with robust.serving(v):
        guard.check_upload(Protos(protos, torch.tensor([5, 5, 0])), 0, names)  # 10 <= 2 x 5
        assert set(v.peer_rows[0]) == {("protos", 0), ("protos", 1)}
        with pytest.raises(PayloadError, match=r"deviates by 11 .* than 2 x the largest global"):
            guard.check_upload(
                Protos(protos + torch.tensor([0.0, 1.0]), torch.tensor([5, 5, 0])), 0, names
            )
        with pytest.raises(PayloadError, match="counts of classes \\[1\\] exceed the partition"):
            guard.check_upload(Protos(protos, torch.tensor([5, 6, 0])), 0, names)


def test_claimed_class_ids_are_checked_against_the_partition():
    v = ServerView(RobustRule(), class_counts=((4, 0, 4), (4, 0, 4)))
    with robust.serving(v):
        guard.check_upload(Points(torch.ones(2, 2), torch.tensor([0, 2])), 0, {"C": 3})
        with pytest.raises(PayloadError, match="claims classes \\[1\\] its partition does not"):
            guard.check_upload(Points(torch.ones(2, 2), torch.tensor([0, 1])), 1, {"C": 3})
    # the refused upload keeps nothing for the peer guard
    assert set(v.peer_rows) == {0} and set(v.peer_rows[0]) == {("rows", 0), ("rows", 2)}


def test_a_whole_field_is_one_row_and_the_peer_guard_names_it():
    v = ServerView(RobustRule(peer_factor=10.0))
    with robust.serving(v):
        for c in range(3):
            guard.check_upload(Kernel(torch.eye(2) * (1 + 0.1 * c)), c, {})
        guard.check_upload(Kernel(torch.eye(2) * -50.0), 3, {})
    out = robust.peer_screen(v, [(c, 1.0) for c in range(4)])
    assert list(out) == [3]
    assert out[3].startswith("its kernel is 72.2 from the median of the 4 clients' rows")


def test_outside_the_round_loop_nothing_is_kept():
    guard.check_upload(Kernel(torch.eye(2)), 0, {})
    assert robust.current().peer_rows == {}


def test_no_method_reaches_into_the_robust_layer():
    # Protection is declared (roles) and aggregation goes through core/aggregate.py: a method
    # that imported core/robust.py could skip or reimplement what every method must get.
    import pathlib
    import re

    import fedmosaic.algorithms as pkg

    folder = pathlib.Path(pkg.__file__).parent
    for path in sorted(folder.glob("*.py")):
        text = path.read_text()
        assert not re.search(r"core(\.| import )robust|\brobust\.", text), path.name


def test_a_kernel_must_be_symmetric_with_a_nonnegative_diagonal():
    # FedHeNN's kernels: a flipped (-x) or unrelated matrix is refused by the schema, a rescaled
    # one (honest widths differ in scale by 100 x) is not
    from fedmosaic.algorithms.fedhenn import HeNNUpload

    k = torch.tensor([[2.0, 0.5], [0.5, 1.0]])
    guard.check_upload(HeNNUpload(k * 300.0), 0, {"L": 2})
    with pytest.raises(PayloadError, match="kernel has diagonal values not >= 0"):
        guard.check_upload(HeNNUpload(-k), 0, {"L": 2})
    with pytest.raises(PayloadError, match="kernel is not a symmetric matrix"):
        guard.check_upload(HeNNUpload(torch.tensor([[1.0, 0.5], [0.0, 1.0]])), 0, {"L": 2})


def test_class_means_of_nonnegative_features_refuse_a_negative_entry():
    names = {"C": 3}
    means = Means(torch.tensor([[0.5, 0.0], [2.0, -0.25]]), torch.tensor([0, 2]))
    honest = Means(torch.tensor([[0.5, 0.0], [2.0, 0.0]]), torch.tensor([0, 2]))
    on = ServerView(RobustRule(), nonnegative_features=True)
    with robust.serving(on):
        guard.check_upload(honest, 1, names)
        with pytest.raises(
            PayloadError,
            match=r"client 1 Means.rows: its class 2 row has a negative entry \(-0.25\)",
        ):
            guard.check_upload(means, 1, names)
        guard.check_upload(means, -1, names)  # a secure round's rebuilt sum: no one client's
    # features that may be negative, and the local privacy mechanism's signed noise: no check
    for view in (
        ServerView(RobustRule()),
        ServerView(RobustRule(), private_noise=(1.0, 0.5), nonnegative_features=True),
    ):
        with robust.serving(view):
            guard.check_upload(means, 1, names)
