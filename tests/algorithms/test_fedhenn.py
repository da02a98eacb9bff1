"""FedHeNN: CKA properties, kernels, eta schedule, RAD sampling, protocol, end to end."""

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from _bnclient import BN_MEMBERS, bn_buffers, bn_data, bn_model, shifted_rad
from helpers.experiments import tiny_raw
from helpers.toyfed import CLASS_MEANS, means_client, run_toy, toy_model
from helpers.toyfed import NUM_CLASSES as C
from torch import nn

from fedmosaic.algorithms.fedhenn import (
    FedHeNN,
    HeNNBroadcast,
    HeNNUpload,
    center,
    cka,
    cka_distance,
    eta_at,
    hsic,
    kernel_matrix,
    rbf_kernel,
    representation_kernel,
    sample_rad,
)
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core import client as client_ops
from fedmosaic.core.algorithm import FederationSpec, Weighted
from fedmosaic.core.payload import PayloadError
from fedmosaic.core.training import TrainSettings


def _spec(public=None, seed: int = 0) -> FederationSpec:
    return FederationSpec(
        3, C, 4, CLASS_MEANS.shape, ("a", "b", "a"), (8, 8, 8), seed, 3, toy_model, public
    )


def _reps(n=12, d=5, seed=0):
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# ---- CKA --------------------------------------------------------------------------------------
def test_hsic_matches_the_centering_matrix_formula():
    k = kernel_matrix(_reps(seed=1)).double()
    m = kernel_matrix(_reps(d=3, seed=2)).double()
    n = k.shape[0]
    h = torch.eye(n, dtype=torch.float64) - torch.ones(n, n, dtype=torch.float64) / n
    want = torch.trace(k @ h @ m @ h) / (n - 1) ** 2
    assert torch.allclose(hsic(k, m), want)
    assert torch.allclose(center(k), h @ k @ h)
    assert torch.allclose(cka(k, m), want / torch.sqrt(hsic(k, k) * hsic(m, m)))


@pytest.mark.parametrize("kind", ["linear", "rbf"])
def test_cka_of_a_representation_with_itself_is_one(kind):
    k = kernel_matrix(_reps(), kind)
    assert float(cka(k, k)) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("kind", ["linear", "rbf"])
def test_cka_invariant_to_orthogonal_transform_and_isotropic_scaling(kind):
    x, y = _reps(seed=3).float(), _reps(d=7, seed=4).float()
    q, _ = torch.linalg.qr(torch.randn(5, 5, generator=torch.Generator().manual_seed(5)))
    base = cka(kernel_matrix(x, kind), kernel_matrix(y, kind))
    assert 0.0 < float(base) < 1.0
    for x2 in (x @ q, 3.7 * x, 0.2 * (x @ q)):
        assert float(cka(kernel_matrix(x2, kind), kernel_matrix(y, kind))) == pytest.approx(
            float(base), abs=1e-5
        )


def test_linear_cka_equals_the_feature_space_formula_on_centered_inputs():
    x, y = _reps(seed=6), _reps(d=3, seed=7)  # different widths, as across clients
    x, y = x - x.mean(0), y - y.mean(0)
    want = (y.T @ x).norm() ** 2 / ((x.T @ x).norm() * (y.T @ y).norm())  # Eq. 4
    assert torch.allclose(cka(x @ x.T, y @ y.T), want)
    # Centering inside CKA makes the raw (uncentered) inputs give the same value.
    xr, yr = x + 5.0, y - 2.0
    assert torch.allclose(cka(xr @ xr.T, yr @ yr.T), want)


def test_rbf_kernel_sanity_hand_computed():
    a = torch.tensor([[0.0], [1.0], [3.0]])
    # Squared distances [[0, 1, 9], [1, 0, 4], [9, 4, 0]]: median 1, so K = exp(-sq / 2).
    k = rbf_kernel(a, sigma=1.0)
    want = torch.exp(-torch.tensor([[0.0, 1, 9], [1, 0, 4], [9, 4, 0]]) / 2)
    assert torch.allclose(k, want)
    k2 = rbf_kernel(a, sigma=2.0)  # bandwidth x2: exp(-sq / 8)
    assert torch.allclose(k2, want ** (1 / 4))
    r = rbf_kernel(_reps().float(), sigma=0.8)
    assert torch.allclose(r, r.T) and torch.allclose(r.diagonal(), torch.ones(12))
    assert bool(((r > 0) & (r <= 1)).all())


def test_cka_gradient_is_finite_for_constant_representations():
    a = torch.zeros(6, 3, requires_grad=True)  # dead features: K = 0, HSIC(K, K) = 0
    target = kernel_matrix(_reps(n=6).float())
    loss = 1 - cka(kernel_matrix(a), target)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(a.grad).all()


# ---- schedule and RAD -------------------------------------------------------------------------
def test_eta_schedule_values():
    assert eta_at(0.001, "sqrt", 1) == pytest.approx(0.001)
    assert eta_at(0.001, "sqrt", 4) == pytest.approx(0.002)
    assert eta_at(0.001, "constant", 9) == pytest.approx(0.001)
    assert eta_at(0.001, "linear", 9) == pytest.approx(0.009)
    algo = FedHeNN(eta0=0.01, schedule="sqrt")
    state = algo.init_server(_spec(torch.randn(30, *CLASS_MEANS.shape)))
    msg = algo.broadcast(state, 0, 9)
    assert msg.eta == pytest.approx(0.03) and msg.round_num == 9
    with pytest.raises(ValueError):
        FedHeNN(schedule="exp")
    with pytest.raises(ValueError):
        FedHeNN(kernel="poly")


def test_rad_sampling_is_deterministic_per_round_and_differs_across_rounds(caplog):
    a, b = sample_rad(100, 20, seed=0, round_num=3), sample_rad(100, 20, seed=0, round_num=3)
    assert torch.equal(a, b) and a.unique().numel() == 20 and int(a.max()) < 100
    assert not torch.equal(a, sample_rad(100, 20, seed=0, round_num=4))
    assert not torch.equal(a, sample_rad(100, 20, seed=1, round_num=3))
    assert sample_rad(10, 1000, 0, 1).numel() == 10  # capped to the public size
    public = torch.randn(30, *CLASS_MEANS.shape)
    algo = FedHeNN(rad_size=8)
    state = algo.init_server(_spec(public))
    msg = algo.broadcast(state, 1, 2)
    assert torch.equal(msg.next_rad, public[sample_rad(30, 8, 0, 2)])
    assert torch.equal(algo.broadcast(state, 2, 2).next_rad, msg.next_rad)  # same for all clients
    with caplog.at_level(logging.WARNING, logger="fedmosaic"):
        assert FedHeNN(rad_size=8).init_server(_spec(public)).rad_size == 8
        assert not caplog.records
        assert FedHeNN(rad_size=1000).init_server(_spec(public)).rad_size == 30
    assert "rad_size = 1000 is above the public split (data.public_size = 30)" in caplog.text


def test_public_split_is_required():
    with pytest.raises(ConfigError, match="public_size"):
        FedHeNN().check(_spec(None))
    FedHeNN().check(_spec(torch.zeros(2, *CLASS_MEANS.shape)))
    with pytest.raises(ConfigError):
        FedHeNN().init_server(_spec(None))


# ---- protocol ---------------------------------------------------------------------------------
def test_round_one_has_no_alignment_and_aggregation_sets_the_target():
    public = torch.randn(30, *CLASS_MEANS.shape)
    algo = FedHeNN(rad_size=6, eta0=0.1)
    state = algo.init_server(_spec(public))
    msg = algo.broadcast(state, 0, 1)
    assert msg.rad.shape == (0, *CLASS_MEANS.shape) and msg.kernel.shape == (0, 0)
    torch.manual_seed(0)
    model = toy_model()
    x, y = torch.randn(5, *CLASS_MEANS.shape), torch.tensor([0, 1, 2, 0, 1])
    assert torch.allclose(algo.loss(model, None, x, y, msg), F.cross_entropy(model(x), y))
    # Uploads of round 1 are kernels on round 1's RAD; K_bar is their uniform mean.
    k1, k2 = torch.rand(6, 6), torch.rand(6, 6)
    new = algo.aggregate(
        state, [Weighted(0, 1.0, HeNNUpload(k1)), Weighted(1, 3.0, HeNNUpload(k2))], 1
    )
    assert torch.allclose(new.kernel, (k1 + k2) / 2) and new.kernel_round == 1
    weighted = FedHeNN(rad_size=6, weighting="samples").aggregate(
        state, [Weighted(0, 1.0, HeNNUpload(k1)), Weighted(1, 3.0, HeNNUpload(k2))], 1
    )
    assert torch.allclose(weighted.kernel, 0.25 * k1 + 0.75 * k2)
    # Round 2 aligns on round 1's RAD (where K_bar lives) and uploads on round 2's.
    msg2 = algo.broadcast(new, 0, 2)
    assert torch.equal(msg2.rad, msg.next_rad) and torch.equal(msg2.kernel, new.kernel)
    assert torch.equal(msg2.next_rad, public[sample_rad(30, 6, 0, 2)])
    assert not torch.equal(msg2.next_rad, msg2.rad)


def test_alignment_uses_encoder_features_not_logits():
    torch.manual_seed(0)
    model = toy_model()
    rad = torch.randn(10, *CLASS_MEANS.shape)
    x, y = torch.randn(5, *CLASS_MEANS.shape), torch.tensor([0, 1, 2, 0, 1])
    ce = F.cross_entropy(model(x), y)
    with torch.no_grad():
        k_feat = kernel_matrix(model.features(rad))
        k_logit = kernel_matrix(model(rad))
    algo = FedHeNN(eta0=0.5)

    def msg(k):
        return HeNNBroadcast(rad, k, rad, 0.5, 2)

    # Aligning to its own feature kernel costs nothing: CKA = 1.
    assert torch.allclose(algo.loss(model, None, x, y, msg(k_feat)), ce, atol=1e-5)
    want = ce + 0.5 * (1 - cka(k_feat, k_logit))
    assert torch.allclose(algo.loss(model, None, x, y, msg(k_logit)), want, atol=1e-5)
    # The RBF kernel and a random RAD subset per step are options.
    assert torch.allclose(
        FedHeNN(kernel="rbf").loss(
            model, None, x, y, msg(rbf_kernel(model.features(rad).detach()))
        ),
        ce,
        atol=1e-5,
    )
    torch.manual_seed(1)
    sub = FedHeNN(rad_batch=4).loss(model, None, x, y, msg(k_feat))
    assert torch.allclose(sub, ce, atol=1e-5)  # any block of its own kernel: CKA = 1


def test_upload_is_the_trained_models_kernel_on_the_new_rad_in_eval_mode():
    data = means_client()
    public = torch.randn(30, *CLASS_MEANS.shape)
    algo = FedHeNN(rad_size=7, eta0=0.1)
    state = algo.init_server(_spec(public))
    k0 = torch.rand(7, 7)
    state = algo.aggregate(state, [Weighted(0, 1.0, HeNNUpload(k0 @ k0.T))], 1)
    msg = algo.broadcast(state, 0, 2)
    torch.manual_seed(0)
    model = toy_model()
    before = [p.detach().clone() for p in model.parameters()]
    out = client_ops.fit(
        algo,
        model,
        algo.init_client(model, _spec(public), data),
        msg,
        data,
        TrainSettings(batch_size=8, lr=0.1),
        0,
        2,
        1,
    )
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with torch.no_grad():
        want = kernel_matrix(model.eval().features(msg.next_rad))
    assert isinstance(out.upload, HeNNUpload) and out.upload.kernel.shape == (7, 7)
    assert torch.allclose(out.upload.kernel, want, atol=1e-5)
    assert not out.upload.kernel.requires_grad
    algo.validate_upload(state, out.upload, 0)


def test_validate_upload_rejects_wrong_kernel_shape():
    algo = FedHeNN(rad_size=5)
    state = algo.init_server(_spec(torch.randn(20, *CLASS_MEANS.shape)))
    algo.validate_upload(state, HeNNUpload(torch.zeros(5, 5)), 0)
    for bad in (torch.zeros(4, 4), torch.zeros(5, 6), torch.zeros(5), torch.zeros(5, 5).double()):
        with pytest.raises(PayloadError, match="kernel"):
            algo.validate_upload(state, HeNNUpload(bad), 2)


# ---- BatchNorm: the RAD pass is the inference map and leaves the statistics alone -------------
def _bn_msg(eta: float) -> HeNNBroadcast:
    rad = shifted_rad()
    a = torch.randn(len(rad), 5, generator=torch.Generator().manual_seed(2))
    return HeNNBroadcast(rad, a @ a.T, rad, eta, 2)  # K_bar: some other representation's kernel


def _bn_fit(model, msg: HeNNBroadcast, lr: float) -> client_ops.FitOutput:
    settings = TrainSettings(batch_size=4, lr=lr)  # 8 examples: two steps
    return client_ops.fit(
        FedHeNN(rad_size=6), model, nn.Module(), msg, bn_data(), settings, 0, 2, 1
    )


@pytest.mark.parametrize(("family", "member"), BN_MEMBERS)
@pytest.mark.integration
def test_alignment_pass_leaves_batchnorm_statistics_as_local_training_does(family, member):
    # lr = 0: the weights never move, so the only difference between the runs is the RAD pass
    # (inputs shifted by +3, another distribution than the training data).
    aligned, alone = bn_model(family, member), bn_model(family, member)
    _bn_fit(aligned, _bn_msg(eta=1.0), lr=0.0)
    _bn_fit(alone, _bn_msg(eta=0.0), lr=0.0)  # eta = 0: CE only, no RAD forward at all
    got, want, init = bn_buffers(aligned), bn_buffers(alone), bn_buffers(bn_model(family, member))
    assert len(want) > 20 and got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key
    assert any(not torch.equal(init[k], want[k]) for k in want if k.endswith("running_mean"))
    # With real steps: one count per training batch (the RAD pass adds none) ...
    trained, ce_only = bn_model(family, member), bn_model(family, member)
    _bn_fit(trained, _bn_msg(eta=1.0), lr=0.05)
    _bn_fit(ce_only, _bn_msg(eta=0.0), lr=0.05)
    counts = [int(v) for k, v in bn_buffers(trained).items() if k.endswith("num_batches_tracked")]
    assert counts and set(counts) == {2}
    # ... and the CKA gradient still reaches the weights through the client's representation.
    assert any(not torch.equal(a, b) for a, b in zip(trained.parameters(), ce_only.parameters()))


@pytest.mark.parametrize(("family", "member"), BN_MEMBERS)
def test_training_kernel_and_uploaded_kernel_are_the_same_map(family, member):
    model = bn_model(family, member)
    out = _bn_fit(model, _bn_msg(eta=1.0), lr=0.05)  # running statistics now off their init
    rad = shifted_rad()
    assert torch.allclose(out.upload.kernel, representation_kernel(model, rad, "linear", 1.0))
    model.train()
    model.head.eval()  # a module's own mode must survive the RAD pass
    # K_i (with gradient, as in the loss) against the upload on the same weights: CKA = 1.
    dist = cka_distance(model, rad, out.upload.kernel, "linear", 1.0)
    assert float(dist.detach()) == pytest.approx(0.0, abs=1e-5)
    assert model.encoder.training and all(m.training for m in model.encoder.modules())
    assert not model.head.training
    # Gradient flows through the client's RAD representation.
    other = cka_distance(model, rad, _bn_msg(1.0).kernel, "linear", 1.0)
    other.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.encoder.parameters())


# ---- end to end -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs",
    [{"eta0": 0.1}, {"eta0": 0.1, "kernel": "rbf", "rad_batch": 8, "weighting": "samples"}],
)
def test_two_rounds_heterogeneous_toy_federation(kwargs):
    fed = run_toy(FedHeNN(rad_size=16, **kwargs), CLASS_MEANS, rounds=3, public_size=24)
    rounds = fed.history.rounds
    assert [r["round"] for r in rounds] == [1, 2, 3]
    for r in rounds:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0
    # Up: one L x L float32 kernel; down from round 2: two RADs + K_bar.
    assert rounds[0]["bytes_up_per_client"] >= 16 * 16 * 4
    assert rounds[1]["bytes_down_per_client"] >= 2 * 16 * 12 * 4 + 16 * 16 * 4
    assert fed.state.kernel.shape == (16, 16) and fed.state.kernel_round == 3


@pytest.mark.integration
def test_two_rounds_with_config_and_wire_check():
    raw = tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "fedhenn", "rad_size": 20})
    from fedmosaic.experiment import run_experiment

    doc = run_experiment(from_dict(raw), progress=False)
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    assert all(r["rejected"] == [] for r in doc["rounds"])


@pytest.mark.integration
def test_clients_of_different_widths_align_their_own_representations():
    # fedhenn5 at 1x28x28: widths 864, 120, 120, 84, 84, no projection layer (Sec. 4.1's CNNs).
    raw = tiny_raw(model={"family": "fedhenn5"}, algorithm={"name": "fedhenn", "rad_size": 20})
    raw["data"]["num_clients"] = 5
    from fedmosaic.experiment import build_federation, run_experiment

    fed = build_federation(from_dict(raw))
    assert [m.feature_dim for m in fed.models] == [864, 120, 120, 84, 84]
    serial = run_experiment(from_dict({**raw, "sim": {**raw["sim"], "threads": 1}}), progress=False)
    assert [r["round"] for r in serial["rounds"]] == [1, 2]
    assert all(r["rejected"] == [] and math.isfinite(r["train_loss"]) for r in serial["rounds"])
    # Worker processes build the same per-client widths: bitwise the serial numbers.
    procs = run_experiment(
        from_dict({**raw, "sim": {**raw["sim"], "backend": "processes", "workers": 2}}),
        progress=False,
    )
    keys = ("train_loss", "acc_weighted", "acc_mean")
    assert [[r[k] for k in keys] for r in procs["rounds"]] == [
        [r[k] for k in keys] for r in serial["rounds"]
    ]
