"""FedClassAvg: SupCon and proximal term against hand-computed numbers, augmentations, equivalence
with LG-FedAvg, and short runs with every payload round-tripped through the wire."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _handmade import run_handmade
from helpers.experiments import tiny_raw
from torch import nn

from fedmosaic.algorithms._augment import augment, color_jitter, random_resized_crop_flip
from fedmosaic.algorithms._shared import SharedState
from fedmosaic.algorithms.fedclassavg import FedClassAvg, prox_term, supcon_loss
from fedmosaic.algorithms.lg_fedavg import LGFedAvg
from fedmosaic.core.model import ClientModel
from fedmosaic.core.rounds import History

# ---- SupCon ---------------------------------------------------------------------------------


def _supcon_by_loops(f1, f2, y, t, normalize):
    """Khosla et al.'s L_out written out term by term with python floats."""
    z = [list(map(float, r)) for r in f1] + [list(map(float, r)) for r in f2]
    lab = [int(v) for v in y] * 2
    if normalize:
        z = [[a / math.sqrt(sum(b * b for b in r)) for a in r] for r in z]
    n = len(z)
    total = 0.0
    for i in range(n):
        denom = 0.0
        for a in range(n):
            if a != i:
                denom += math.exp(sum(p * q for p, q in zip(z[i], z[a])) / t)
        pos = [p for p in range(n) if p != i and lab[p] == lab[i]]
        s = 0.0
        for p in pos:
            s += math.log(math.exp(sum(u * v for u, v in zip(z[i], z[p])) / t) / denom)
        total += -s / len(pos)
    return total / n


def test_supcon_closed_form_two_orthogonal_samples():
    # z = e1, e2, e1, e2 (two classes): every anchor has one positive (logit 1/t) and two
    # negatives (logit 0), so L = log(1 + 2 exp(-1/t)).
    f = torch.eye(2)
    for t in (1.0, 0.5):
        got = supcon_loss(f, f.clone(), torch.tensor([0, 1]), temperature=t)
        assert float(got) == pytest.approx(math.log(1 + 2 * math.exp(-1 / t)), rel=1e-6)


def test_supcon_four_samples_hand_computed():
    f1 = torch.tensor([[1.0, 0.5, -0.2], [0.3, -1.0, 0.8], [0.9, 0.4, 0.1], [-0.5, 0.2, 1.0]])
    f2 = torch.tensor([[0.8, 0.7, -0.1], [0.1, -0.9, 1.1], [1.2, 0.0, 0.3], [-0.4, 0.5, 0.7]])
    y = torch.tensor([0, 1, 0, 2])  # class 2 has a single sample: its only positive is its view
    for t, norm in ((0.5, True), (0.07, True), (2.0, False)):
        got = supcon_loss(f1, f2, y, temperature=t, normalize=norm)
        assert float(got) == pytest.approx(_supcon_by_loops(f1, f2, y, t, norm), rel=1e-5)
    # Khosla's code's scale temperature / base_temperature (the FedClassAvg code: 100 / 0.07).
    scaled = supcon_loss(f1, f2, y, temperature=100.0, normalize=False, base_temperature=0.07)
    ref = _supcon_by_loops(f1, f2, y, 100.0, False) * 100.0 / 0.07
    assert float(scaled) == pytest.approx(ref, rel=1e-5)


# ---- proximal term --------------------------------------------------------------------------


def _head(w, b) -> nn.Linear:
    m = nn.Linear(2, 1)
    with torch.no_grad():
        m.weight.copy_(torch.tensor(w))
        m.bias.copy_(torch.tensor(b))
    return m


def test_prox_values_hand_computed():
    m = _head([[1.0, 2.0]], [0.5])
    g = {"weight": torch.tensor([[0.0, 0.0]]), "bias": torch.tensor([1.5])}
    m.requires_grad_(False)
    # squared distance over weight and bias: 1 + 4 + 1 = 6
    assert float(prox_term(m, g, "l2")) == pytest.approx(math.sqrt(6.0))
    assert float(prox_term(m, g, "squared")) == pytest.approx(3.0)
    # reference code: 1/2 * (MSE(weight) + MSE(bias)) = 1/2 * ((1 + 4) / 2 + 1) = 1.75
    assert float(prox_term(m, g, "mse")) == pytest.approx(1.75)
    with pytest.raises(ValueError):
        prox_term(m, g, "l1")


def test_prox_l2_gradient_is_finite_at_zero_and_exact_elsewhere():
    m = _head([[1.0, 2.0]], [0.5])
    same = {k: v.detach().clone() for k, v in m.state_dict().items()}
    val = prox_term(m, same, "l2")
    val.backward()
    assert float(val.detach()) == 0.0
    for p in m.parameters():
        assert torch.isfinite(p.grad).all() and bool((p.grad == 0).all())
    # Away from 0 the gradient is (w - g) / ||w - g||.
    m.zero_grad()
    g = {"weight": torch.tensor([[0.0, 0.0]]), "bias": torch.tensor([1.5])}
    prox_term(m, g, "l2").backward()
    r6 = math.sqrt(6.0)
    assert torch.allclose(m.weight.grad, torch.tensor([[1 / r6, 2 / r6]]))
    assert torch.allclose(m.bias.grad, torch.tensor([-1 / r6]))


def test_client_loss_has_finite_gradients_at_round_start():
    torch.manual_seed(0)
    model = ClientModel(nn.Sequential(nn.Flatten(), nn.Linear(12, 4)), nn.Linear(4, 3), 4, 3)
    msg = SharedState(model.part_state("head"))  # the head equals the global head: distance 0
    x, y = torch.randn(6, 1, 3, 4), torch.tensor([0, 1, 2, 0, 1, 2])
    algo = FedClassAvg(rho=0.5)
    loss = algo.loss(model, nn.Module(), x, y, msg)
    loss.backward()
    assert math.isfinite(float(loss.detach()))
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_hyperparameters_are_validated():
    with pytest.raises(ValueError, match="prox"):
        FedClassAvg(prox="l1")
    with pytest.raises(ValueError):
        FedClassAvg(temperature=0.0)


# ---- augmentations --------------------------------------------------------------------------


def test_augment_shapes_determinism_and_randomness():
    x = torch.randn(5, 3, 12, 10)
    torch.manual_seed(7)
    a = augment(x)
    torch.manual_seed(7)
    b = augment(x)
    assert a.shape == x.shape and a.dtype == x.dtype
    assert torch.equal(a, b)  # same global seed, same views
    assert not torch.equal(augment(x), a)  # the next draw differs
    assert torch.isfinite(a).all()


def test_crop_identity_flip_and_zoom():
    x = torch.randn(4, 2, 8, 8)
    same = random_resized_crop_flip(x, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip_p=0.0)
    assert torch.allclose(same, x, atol=1e-5)
    flipped = random_resized_crop_flip(x, scale=(1.0, 1.0), ratio=(1.0, 1.0), flip_p=1.0)
    assert torch.allclose(flipped, x.flip(-1), atol=1e-5)
    # A column ramp cropped to a quarter of the area (half the width) spans half the columns.
    w = 16
    ramp = torch.arange(w, dtype=torch.float32).expand(64, 1, w, w).clone()
    torch.manual_seed(0)
    out = random_resized_crop_flip(ramp, scale=(0.25, 0.25), ratio=(1.0, 1.0), flip_p=0.5)
    span = out[:, 0, 0, -1] - out[:, 0, 0, 0]  # [64]; negative when flipped
    assert torch.all((span.abs() - 0.5 * (w - 1)).abs() <= 0.5)
    assert (span < 0).any() and (span > 0).any()
    # Bilinear resampling of an in-image box never leaves the input's range.
    torch.manual_seed(1)
    y = random_resized_crop_flip(x)
    assert y.min() >= x.min() - 1e-5 and y.max() <= x.max() + 1e-5


def test_color_jitter_ranges():
    x = torch.randn(32, 1, 6, 6)
    torch.manual_seed(3)
    bright = color_jitter(x, brightness=0.4, contrast=0.0)
    shift = bright - x  # one offset per image, within [-0.4, 0.4]
    per_image = shift.flatten(1)
    assert torch.allclose(per_image, per_image[:, :1].expand_as(per_image), atol=1e-6)
    assert per_image.abs().max() <= 0.4 + 1e-6
    torch.manual_seed(3)
    con = color_jitter(x, brightness=0.0, contrast=0.4)
    m = x.mean((1, 2, 3), keepdim=True)
    assert torch.allclose(con.mean((1, 2, 3), keepdim=True), m, atol=1e-5)  # mean kept
    ratio = ((con - m).flatten(1) / (x - m).flatten(1))[:, 0]  # contrast factor per image
    assert ratio.min() >= 0.6 - 1e-4 and ratio.max() <= 1.4 + 1e-4


# ---- runs -----------------------------------------------------------------------------------


def _numbers(h: History, acc: str = "acc") -> list[tuple[float, float, float]]:
    return [(r[f"{acc}_weighted"], r[f"{acc}_mean"], r["train_loss"]) for r in h.rounds]


def test_no_contrast_no_prox_no_augment_trains_exactly_like_lg_fedavg():
    # Equivalence needs augment=False: augmented inputs would differ from LG-FedAvg's plain x.
    plain = FedClassAvg(contrastive=False, rho=0.0, augment=False)
    h_cls, s_cls = run_handmade(plain, rounds=3)
    h_lg, s_lg = run_handmade(LGFedAvg(), rounds=3)
    # LG-FedAvg evaluates the global head: FedClassAvg's acc_global
    assert _numbers(h_cls, "acc_global") == _numbers(h_lg)
    assert all(torch.equal(s_cls[k], s_lg[k]) for k in s_lg)
    h_full, _ = run_handmade(FedClassAvg(), rounds=3)
    assert _numbers(h_full, "acc_global") != _numbers(h_lg)


def test_the_headline_is_the_clients_own_classifier_after_local_training():
    """Algorithm 1 outputs w_k = w_F_k + w_C_k: ``acc`` scores the client's classifier as its
    local update left it (stored at upload), ``acc_global`` the global head received since."""
    torch.manual_seed(0)
    model = ClientModel(nn.Sequential(nn.Flatten(), nn.Linear(12, 4)), nn.Linear(4, 3), 4, 3)
    algo = FedClassAvg()
    extras = algo.init_client(model, None, None)  # type: ignore[arg-type]
    trained = {k: v + 1.0 for k, v in model.part_state("head").items()}  # after local training
    model.load_part_state("head", trained)
    algo.upload(model, extras, None, SharedState({}))  # type: ignore[arg-type]
    glob = {k: -v for k, v in trained.items()}  # the next broadcast, loaded on receive
    model.load_part_state("head", glob)
    x = torch.randn(5, 1, 3, 4)
    out = algo.predict(model, extras, x, SharedState(glob))
    f = model.features(x)
    assert torch.equal(out["acc"], F.linear(f, trained["weight"], trained["bias"]))
    assert torch.equal(out["acc_global"], F.linear(f, glob["weight"], glob["bias"]))
    assert not torch.equal(out["acc"], out["acc_global"])


def test_handmade_two_rounds_with_wire_check_and_bytes():
    h, state = run_handmade(FedClassAvg(prox="mse", normalize=False, temperature=100.0))
    assert [r["round"] for r in h.rounds] == [1, 2]
    d, c = 8, 3
    for r in h.rounds:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0 and 0.0 <= r["acc_global_weighted"] <= 1.0
        # (d + 1) * C float32 up, plus the safetensors framing.
        assert (d + 1) * c * 4 < r["bytes_up_per_client"] < (d + 1) * c * 4 + 400
    assert set(state) == {"weight", "bias"} and state["weight"].shape == (c, d)


@pytest.mark.integration
def test_two_rounds_on_zoo_family_with_wire_check():
    raw = tiny_raw(
        model={"family": "htfe8-gray", "feature_dim": 32},
        algorithm={"name": "fedclassavg"},
        train={"optimizer": "adam", "lr": 1e-3, "betas": [0.5, 0.999]},
    )
    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment

    doc = run_experiment(from_dict(raw), progress=False)
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    for r in doc["rounds"]:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0
        assert r["bytes_up_per_client"] > (32 + 1) * 4 * 4  # (d + 1) * C floats
