"""``projection = "none"``: each encoder keeps its natural width (FedHeNN's own representations)."""

from __future__ import annotations

import pytest
import torch
from helpers.experiments import tiny_raw
from torch import nn

from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core.algorithm import Algorithm
from fedmosaic.core.registry import ALGORITHMS
from fedmosaic.experiment import build_federation
from fedmosaic.models import build_client_model, build_encoder, family_members

# FedHeNN's five CNNs at 1x28x28: flattened conv (6 x 12 x 12), then the last hidden fc.
FEDHENN5_WIDTHS = [864, 120, 120, 84, 84]


def test_none_keeps_the_natural_width_and_adds_no_layer() -> None:
    for member, width in zip(family_members("fedhenn5"), FEDHENN5_WIDTHS, strict=True):
        torch.manual_seed(0)
        model = build_client_model(member, (1, 28, 28), 10, 128, projection="none")
        torch.manual_seed(0)
        linear = build_client_model(member, (1, 28, 28), 10, 128)
        assert model.feature_dim == width and not hasattr(model.encoder, "proj")
        assert isinstance(model.head, nn.Linear) and model.head.in_features == width
        assert model.features(torch.randn(2, 1, 28, 28)).shape == (2, width)
        assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)
        # the same blocks as the projected model, minus its Linear(width, 128)
        names = [n for n, _ in linear.encoder.named_children()]
        assert names == [*(n for n, _ in model.encoder.named_children()), "proj"]
        assert isinstance(linear.encoder.proj, nn.Linear) and linear.feature_dim == 128
    encoder = build_encoder("fedhenn_cnn1", (1, 28, 28), 128, projection="none")
    assert encoder(torch.randn(1, 1, 28, 28)).shape == (1, 864)


def test_unknown_projection_names_the_choices() -> None:
    with pytest.raises(ValueError, match="linear, pool, none"):
        build_client_model("fedavgcnn", (1, 28, 28), 10, 512, projection="conv")


def test_the_algorithm_picks_the_projection_for_every_client_model() -> None:
    assert Algorithm.model_projection is None
    assert ALGORITHMS.get("fedhenn").model_projection == "none"
    assert ALGORITHMS.get("fedhenn_homo").model_projection == "none"

    def federation(name: str):
        raw = tiny_raw(model={"family": "fedhenn5", "feature_dim": 16}, algorithm={"name": name})
        raw["data"]["num_clients"] = 5
        return build_federation(from_dict(raw))

    henn = federation("fedhenn")
    assert [m.feature_dim for m in henn.models] == FEDHENN5_WIDTHS
    assert all(not hasattr(m.encoder, "proj") for m in henn.models)
    # the spec's builder (used by the server half, worker processes and Flower clients) agrees
    assert henn.spec.build_model(0).feature_dim == 864
    local = federation("local")  # no preference: model.projection ("linear") to feature_dim
    assert [m.feature_dim for m in local.models] == [16] * 5
    assert all(isinstance(m.encoder.proj, nn.Linear) for m in local.models)


def test_local_on_fedhenns_own_networks_has_fedhenns_parameter_counts() -> None:
    """FedHeNN's claim compares it with Local on the same networks: client by client, the
    parameter counts of ``local`` with ``model.projection = "none"`` equal FedHeNN's."""

    def federation(name: str, **model):
        raw = tiny_raw(
            model={"family": "fedhenn5", "feature_dim": 16, **model}, algorithm={"name": name}
        )
        raw["data"]["num_clients"] = 5
        return build_federation(from_dict(raw))

    def counts(fed) -> list[int]:
        return [sum(p.numel() for p in m.parameters()) for m in fed.models]

    henn, local = federation("fedhenn"), federation("local", projection="none")
    assert counts(local) == counts(henn)
    assert counts(federation("local")) != counts(henn)  # the projection adds parameters


@pytest.mark.parametrize("name", ["fedproto", "fedavg"])
def test_projection_none_is_refused_for_methods_other_than_local(name: str) -> None:
    raw = tiny_raw(model={"family": "fedhenn5", "projection": "none"}, algorithm={"name": name})
    with pytest.raises(ConfigError, match='model.projection = "none"'):
        from_dict(raw)
