"""One way to declare a method: payload types from the Generic parameters, choices as Literal."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Generic, TypeVar

import pytest

from fedmosaic.algorithms import ALGORITHMS, build_algorithm
from fedmosaic.algorithms._shared import SharedState
from fedmosaic.algorithms.fedavg import FedAvg
from fedmosaic.algorithms.fedbabu import BodyUpload, FedBABU
from fedmosaic.algorithms.fedproto import FedProto, ProtoBroadcast, ProtoUpload
from fedmosaic.config import ConfigError
from fedmosaic.core.algorithm import Algorithm
from fedmosaic.core.payload import Empty, Payload

T = TypeVar("T", bound=Payload)


def test_payload_types_come_from_the_generic_parameters():
    assert (FedProto.Broadcast, FedProto.Upload) == (ProtoBroadcast, ProtoUpload)
    # FedBABU narrows SharedWeights' upload by naming Algorithm[...] again; FedAvg keeps it.
    assert (FedBABU.Broadcast, FedBABU.Upload) == (SharedState, BodyUpload)
    assert (FedAvg.Broadcast, FedAvg.Upload) == (SharedState, SharedState)
    for name, cls in ALGORITHMS.items():
        assert issubclass(cls.Broadcast, Payload) and issubclass(cls.Upload, Payload), name


def test_a_subclass_inherits_or_binds_the_declaration():
    @dataclass(frozen=True)
    class MyProto(FedProto):  # a user's variant repeats nothing
        pass

    assert (MyProto.Broadcast, MyProto.Upload) == (ProtoBroadcast, ProtoUpload)

    class Half(Algorithm[int, Empty, T], Generic[T]):  # still generic: no types yet
        pass

    class Whole(Half[ProtoUpload]):
        pass

    assert not hasattr(Half, "Upload")
    assert (Whole.Broadcast, Whole.Upload) == (Empty, ProtoUpload)


def test_unresolved_types_fail_at_class_definition_naming_the_class():
    with pytest.raises(TypeError, match=r"^NoTypes must declare Algorithm\[.*Broadcast"):

        class NoTypes(Algorithm):  # type: ignore[type-arg]
            pass

    with pytest.raises(TypeError, match=r"^NotAPayload must declare .* as Upload"):

        class NotAPayload(Algorithm[int, Empty, int]):  # type: ignore[type-var]
            pass


def _choices() -> list[tuple[str, str, tuple[str, ...]]]:
    out = []
    for name, cls in ALGORITHMS.items():
        for key, tp in typing.get_type_hints(cls).items():
            if typing.get_origin(tp) is typing.Literal:
                out.append((name, key, typing.get_args(tp)))
    return out


@pytest.mark.parametrize(("name", "key", "choices"), _choices())
def test_a_value_outside_the_choices_is_refused_naming_key_and_choices(name, key, choices):
    default = ALGORITHMS.get(name).hyperparameters()[key]
    assert default in choices
    for choice in choices:
        assert getattr(build_algorithm({"name": name, key: choice}), key) == choice
    want = f"algorithm.{key} = 'nope'; choose one of {', '.join(choices)}"
    with pytest.raises(ConfigError, match=f"^{want}$"):
        build_algorithm({"name": name, key: "nope"})
    with pytest.raises(ConfigError, match=f"^algorithm.{key} = True; choose one of"):
        build_algorithm({"name": name, key: True})


def test_a_method_built_in_python_is_checked_too():
    with pytest.raises(ValueError, match="^weighting = 'x'; choose one of uniform, count$"):
        FedProto(weighting="x")  # type: ignore[arg-type]

    @dataclass(frozen=True)
    class Strict(FedProto):
        def __post_init__(self) -> None:  # its own checks; no super() call needed
            if self.lam > 5:
                raise ValueError("lam too large")

    with pytest.raises(ValueError, match="^inference = 'some'; choose one of all, own$"):
        Strict(inference="some")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="lam too large"):
        Strict(lam=6.0)


def test_every_string_choice_is_a_literal():
    # The methods' choice hyperparameters (the ones __post_init__ used to check by hand).
    assert len(_choices()) >= 20
