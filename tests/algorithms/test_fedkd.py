import math

import pytest
import torch
from helpers.experiments import tiny_raw
from helpers.toyfed import fake_zoo, make_clients, member_spec, run_round  # noqa: F401 (fixture)

from fedmosaic.algorithms import build_algorithm
from fedmosaic.algorithms.fedkd import (
    FedKD,
    MenteeUpload,
    adaptive_mutual_losses,
    check_compressed,
    compress,
    decompress,
    energy_rank,
    energy_threshold,
    htfllib_loss,
    htfllib_rank,
    truncate_htfllib,
)
from fedmosaic.config import ConfigError
from fedmosaic.core.algorithm import Weighted
from fedmosaic.core.payload import PayloadError, encode


def test_energy_rank_is_minimal_and_reaching_the_threshold_counts():
    s = torch.tensor([3.0, 2.0, 1.0])  # energies 9, 4, 1 of 14
    assert energy_rank(s, 0.9) == 2  # 13/14 >= 0.9 > 9/14
    assert energy_rank(s, 0.95) == 3  # 13/14 = 0.9286 < 0.95
    assert energy_rank(s, 9 / 14) == 1  # exactly reached counts (>=)
    assert energy_rank(s, 1.0) == 3
    assert energy_rank(torch.zeros(4), 0.95) == 1  # a zero matrix: one (zero) triplet


def _low_rank(m, n, rank, noise, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, rank, generator=g) @ torch.randn(rank, n, generator=g)
    return a + noise * torch.randn(m, n, generator=g)


@pytest.mark.parametrize("energy", [0.9, 0.95, 0.98])
def test_truncation_reconstructs_within_tolerance_and_k_is_minimal(energy):
    w = _low_rank(40, 30, 5, 0.3)
    out = compress({"w": w}, energy)
    k = out["w/S"].numel()
    s2 = torch.linalg.svdvals(w.double()).pow(2)
    kept = s2[:k].sum() / s2.sum()
    assert kept >= energy  # the threshold is met ...
    assert k == 1 or s2[: k - 1].sum() / s2.sum() < energy  # ... by the smallest k
    rec = decompress(out, {"w": w})["w"]
    # Eckart-Young: the squared error is exactly the dropped energy (<= 1 - T of the total).
    err = (rec.double() - w.double()).pow(2).sum() / w.double().pow(2).sum()
    assert float(err) == pytest.approx(float(1 - kept), abs=1e-5)
    assert float(err) <= 1 - energy + 1e-6


def test_conv_weights_are_factored_as_out_by_rest():
    w = _low_rank(16, 8 * 3 * 3, 2, 0.01).reshape(16, 8, 3, 3)
    out = compress({"conv.weight": w, "conv.bias": torch.ones(16)}, 0.95)
    k = out["conv.weight/S"].numel()
    assert out["conv.weight/U"].shape == (16, k) and out["conv.weight/V"].shape == (k, 72)
    assert torch.equal(out["conv.bias"], torch.ones(16))  # 1-D: dense
    rec = decompress(out, {"conv.weight": w, "conv.bias": torch.ones(16)})
    assert rec["conv.weight"].shape == w.shape
    assert torch.allclose(rec["conv.weight"], w, atol=0.05)


def test_unprofitable_factors_are_sent_dense_and_exact():
    w = torch.randn(6, 6, generator=torch.Generator().manual_seed(1))  # flat spectrum
    out = compress({"w": w}, 0.95)
    assert set(out) == {"w"} and torch.equal(out["w"], w)


def test_threshold_schedule():
    assert [energy_threshold(t, 4, 0.95, 0.98) for t in (1, 2, 3, 4)] == pytest.approx(
        [0.95, 0.96, 0.97, 0.98]
    )
    assert energy_threshold(0, 4, 0.95, 0.98) == pytest.approx(0.95)  # clamped
    assert energy_threshold(9, 4, 0.95, 0.98) == pytest.approx(0.98)
    assert energy_threshold(1, 1, 0.95, 0.98) == pytest.approx(0.95)
    assert FedKD().threshold(2, 3) == pytest.approx(0.965)


def test_compressed_bytes_shrink():
    state = {
        "fc.weight": _low_rank(64, 64, 2, 0.01),
        "fc.bias": torch.zeros(64),
        "bn.num_batches_tracked": torch.tensor(5),
    }
    dense = len(encode(MenteeUpload(state)))
    small = len(encode(MenteeUpload(compress(state, 0.95))))
    assert small < dense / 4  # rank ~2 of 64: 2 * (64 + 64 + 1) floats instead of 64 * 64


def _ce(z, y):
    total = 0.0
    for row, c in zip(z.tolist(), y.tolist()):
        total -= row[c] - math.log(sum(math.exp(v) for v in row))
    return total / len(z)


def _kl(student, teacher):
    total = 0.0
    for s, t in zip(student.tolist(), teacher.tolist()):
        zs, zt = sum(math.exp(v) for v in s), sum(math.exp(v) for v in t)
        for a, b in zip(s, t):
            p, q = math.exp(b) / zt, math.exp(a) / zs
            total += p * math.log(p / q)
    return total / len(student)


def test_adaptive_losses_against_explicit_computation():
    zt = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]], requires_grad=True)
    zs = torch.tensor([[0.0, 1.0, 0.0], [1.0, -1.0, 2.0]], requires_grad=True)
    ht = torch.tensor([[1.0, 0.0], [0.0, 2.0]], requires_grad=True)
    hs = torch.tensor([[0.5, 0.5], [1.0, 1.0]], requires_grad=True)  # stands for W_h(h_s)
    y = torch.tensor([0, 2])
    l_t, l_s = adaptive_mutual_losses(zt, zs, ht, hs, y)
    ce_t, ce_s = _ce(zt, y), _ce(zs, y)
    w = 1.0 / (ce_t + ce_s)
    mse = ((1 - 0.5) ** 2 + (0 - 0.5) ** 2 + (0 - 1) ** 2 + (2 - 1) ** 2) / 4
    assert l_t.item() == pytest.approx(ce_t + w * (_kl(zt, zs) + mse), rel=1e-5)
    assert l_s.item() == pytest.approx(ce_s + w * (_kl(zs, zt) + mse), rel=1e-5)
    # Each loss trains only its own side, and the adaptive weight is a constant.
    g = torch.autograd.grad(l_t, [zs, hs, ht], allow_unused=True, materialize_grads=True)
    assert torch.equal(g[0], torch.zeros_like(zs)) and torch.equal(g[1], torch.zeros_like(hs))
    assert torch.allclose(g[2], w * 2 * (ht - hs).detach() / 4, atol=1e-6)
    g = torch.autograd.grad(l_s, [zt, ht], allow_unused=True, materialize_grads=True)
    assert all(torch.equal(x, torch.zeros_like(x)) for x in g)


def test_check_compressed_validates_factor_shapes():
    ref = {"w": torch.zeros(8, 6), "b": torch.zeros(8), "n": torch.tensor(0)}
    good = compress({"w": _low_rank(8, 6, 1, 0.0), "b": torch.ones(8), "n": torch.tensor(3)}, 0.95)
    assert "w/U" in good
    check_compressed(good, ref, "x")
    check_compressed({"w": torch.ones(8, 6), "b": torch.ones(8), "n": torch.tensor(1)}, ref, "x")
    u, s, v = torch.zeros(8, 7), torch.zeros(7), torch.zeros(7, 6)  # k = 7 > min(8, 6)
    bad = [
        {**good, "w/U": torch.zeros(8, 2)},  # U and S disagree on k
        {"w/U": u, "w/S": s, "w/V": v, "b": torch.ones(8), "n": torch.tensor(1)},
        {**good, "extra": torch.zeros(1)},
        {k: v for k, v in good.items() if k != "b"},
        {**good, "b": torch.ones(7)},
        {**good, "w/V": good["w/V"].double()},
        {**good, "w": torch.ones(8, 6)},  # dense and factors at once
    ]
    for tensors in bad:
        with pytest.raises(PayloadError):
            check_compressed(tensors, ref, "client 3 mentee upload")


def test_hyperparameters_are_checked():
    bad_keys = (
        {"T_start": 0.99, "T_end": 0.9},
        {"T_end": 1.5},
        {"upload_mode": "grad"},
        {"loss_form": "pfllib"},
        {"svd_form": "slices"},
    )
    for bad in bad_keys:
        with pytest.raises(ConfigError):
            build_algorithm({"name": "fedkd", **bad})


@pytest.mark.usefixtures("fake_zoo")
def test_untrained_update_leaves_the_global_mentee_unchanged():
    algo = FedKD()
    spec = member_spec(("wide", "narrow"), rounds=3)
    models, extras, data = make_clients(algo, spec)
    state = algo.init_server(spec)
    assert state.energy == pytest.approx(0.95)
    # Clients load exactly the server's reconstruction.
    msg = algo.broadcast(state, 0, 1)
    algo.receive(models[0], extras[0], msg)
    mentee = extras[0].mentee.state_dict()
    assert all(torch.equal(mentee[k], state.mentee[k]) for k in mentee)
    # With no training, every update is zero and the global mentee stays where it is.
    up = algo.upload(models[0], extras[0], data[0], msg)
    new = algo.aggregate(state, [Weighted(0, 5.0, up)], 1)
    assert new.energy == pytest.approx(0.965)
    for k, v in state.mentee.items():
        assert torch.allclose(new.mentee[k], v, atol=1e-5)


@pytest.mark.usefixtures("fake_zoo")
@pytest.mark.parametrize("upload_mode", ["update", "state"])
def test_zoo_free_rounds(upload_mode):
    # The wide member as mentee: its 64 x 12 layer is worth factoring on the wire.
    algo = FedKD(upload_mode=upload_mode, mentee_arch="wide")
    spec = member_spec(("wide", "narrow"), rounds=2)
    models, extras, data = make_clients(algo, spec)
    state = algo.init_server(spec)
    w_h = [e.W_h.weight.clone() for e in extras]
    for t in (1, 2):
        new, uploads, sizes = run_round(algo, state, models, extras, data, t)
        assert any(not torch.equal(new.mentee[k], state.mentee[k]) for k in state.mentee)
        dense = len(encode(MenteeUpload(decompress(uploads[0].payload.tensors, state.mentee))))
        # The bytes counted are those of the factors. A few SGD steps give a low-rank update,
        # worth factoring; the weights themselves (near their random init) are not.
        if upload_mode == "update":
            assert "encoder.1.weight/U" in uploads[0].payload.tensors and sizes[0] < dense
        else:
            assert sizes[0] <= dense
        state = new
    assert all(not torch.equal(e.W_h.weight, w0) for e, w0 in zip(extras, w_h))
    scores = algo.predict(models[1], extras[1], data[1].source.batch(torch.arange(4)), None)
    assert set(scores) == {"acc", "acc_mentee"}


@pytest.mark.integration
def test_two_rounds_heterogeneous_end_to_end():
    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment  # needs the model zoo

    raw = tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "fedkd"})
    doc = run_experiment(from_dict(raw), progress=False)
    for r in doc["rounds"]:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0 and 0.0 <= r["acc_mentee_weighted"] <= 1.0
        # A few local steps give low-rank updates: the upload is a fraction of the mentee that
        # comes down (near its random init, the weights themselves do not compress).
        assert r["bytes_up_per_client"] < r["bytes_down_per_client"] / 2


def test_mentee_is_built_with_the_clients_projection():
    from torch import nn

    from fedmosaic.config import from_dict
    from fedmosaic.experiment import build_federation  # needs the model zoo

    raw = tiny_raw(
        model={"family": "htfe8-gray", "projection": "pool"}, algorithm={"name": "fedkd"}
    )
    fed = build_federation(from_dict(raw))
    for model, extras in zip(fed.models, fed.extras, strict=True):
        assert isinstance(model.encoder.proj, nn.AdaptiveAvgPool1d)
        assert isinstance(extras.mentee.encoder.proj, nn.AdaptiveAvgPool1d)
    state = fed.algo.init_server(fed.spec)
    assert state.mentee.keys() == fed.extras[0].mentee.state_dict().keys()
    assert not any(k.endswith("proj.weight") for k in state.mentee)


@pytest.mark.usefixtures("fake_zoo")
def test_first_broadcast_is_the_full_mentee_by_default():
    # At T_start = 0.5 the wide member's random 64 x 12 layer is worth factoring (at 0.95 a random
    # matrix is not, and would be sent dense anyway).
    spec = member_spec(("wide", "narrow"), rounds=3)
    full = FedKD(mentee_arch="wide", T_start=0.5)
    assert full.first_broadcast == "full"  # PFLlib: the full model first
    state = full.init_server(spec)
    msg = full.broadcast(state, 0, 1)
    assert not any("/" in k for k in msg.tensors)  # no U/S/V factors: every tensor dense
    assert msg.tensors.keys() == state.mentee.keys()
    assert all(torch.equal(msg.tensors[k], state.mentee[k]) for k in msg.tensors)
    assert msg.energy == pytest.approx(0.5)  # uploads of round 1 still compress at T_start
    svd = FedKD(mentee_arch="wide", T_start=0.5, first_broadcast="svd")
    s2 = svd.init_server(spec)
    assert "encoder.1.weight/U" in svd.broadcast(s2, 0, 1).tensors
    # Same initial weights; the svd variant's server base is the truncated reconstruction.
    assert not torch.equal(s2.mentee["encoder.1.weight"], state.mentee["encoder.1.weight"])
    with pytest.raises(ConfigError, match="first_broadcast"):
        build_algorithm({"name": "fedkd", "first_broadcast": "dense"})


def test_mentee_arch_must_be_a_member_or_in_the_zoo():
    spec = member_spec(("wide", "narrow"), rounds=1)
    FedKD(mentee_arch="wide").check(spec)  # one of the federation's members
    FedKD(mentee_arch="cnn1").check(spec)  # in the zoo
    with pytest.raises(ConfigError, match="algorithm.mentee_arch = 'nope'"):
        FedKD(mentee_arch="nope").check(spec)


# ---- parity options (HtFLlib's clientkd.py forms) -------------------------------------------
def test_htfllib_loss_value_by_hand():
    # B = 1, C = 2: p_t = (1/2, 1/2), p_s = (3/4, 1/4), y = 0; h_t = (1, 0), W_h h_s = (0, 0).
    zt = torch.tensor([[0.0, 0.0]])
    zs = torch.tensor([[math.log(3.0), 0.0]])
    ht, hs, y = torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), torch.tensor([0])
    s = math.log(2.0) + math.log(4 / 3)  # CE_t + CE_s
    kl_st = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)  # KL(p_s || p_t)
    kl_ts = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(2.0)  # KL(p_t || p_s)
    mse = 0.5  # ((1 - 0)^2 + 0) / 2, counted twice
    # KLDivLoss 'mean': divided by B * C = 2, not by B (batchmean)
    expected = s + ((kl_st + kl_ts) / 2 + 2 * mse) / s
    assert htfllib_loss(zt, zs, ht, hs, y).item() == pytest.approx(expected, rel=1e-6)


def test_htfllib_loss_gradients_flow_through_the_weight_and_both_sides():
    # Equal logits: both KL terms and their gradients vanish, so the mentor's logit gradient is
    # dCE_t/dz_t (1 - X / S^2), X = 2 MSE = 1, S = 2 ln 2 (not dCE_t/dz_t, as with a detached w).
    zt = torch.zeros(1, 2, requires_grad=True)
    zs = torch.zeros(1, 2, requires_grad=True)
    ht = torch.tensor([[1.0, 0.0]], requires_grad=True)
    hs = torch.zeros(1, 2, requires_grad=True)
    htfllib_loss(zt, zs, ht, hs, torch.tensor([0])).backward()
    s = 2 * math.log(2.0)
    factor = 1 - 1 / s**2
    assert zt.grad.tolist()[0] == pytest.approx([-0.5 * factor, 0.5 * factor], rel=1e-6)
    assert zs.grad.tolist()[0] == pytest.approx([-0.5 * factor, 0.5 * factor], rel=1e-6)
    # Hidden loss twice, undetached: d(2 MSE / S)/dh_t = 2 (h_t - W_h h_s) / S, and minus that
    # for W_h h_s (detached form: w (h_t - W_h h_s) into h_t only).
    assert ht.grad.tolist()[0] == pytest.approx([2 / s, 0.0], rel=1e-6)
    assert hs.grad.tolist()[0] == pytest.approx([-2 / s, 0.0], rel=1e-6)


def test_htfllib_rank_is_strict_and_never_full():
    s = torch.tensor([3.0, 2.0, 1.0])  # energies 9, 4, 1 of 14
    assert htfllib_rank(s, 0.9) == 2  # 13 > 12.6
    assert htfllib_rank(s, 9 / 14) == 2  # 9 > 9 fails (strict); energy_rank gives 1
    assert htfllib_rank(s, 0.95) == 0  # 13 < 13.3 and the full rank is never tried: k = 0
    # slices share one k: energies per index summed, (4 + 1, 1 + 0) of 6
    two = torch.tensor([[2.0, 1.0], [1.0, 0.0]])
    assert htfllib_rank(two, 0.8) == 1  # 5 > 4.8
    assert htfllib_rank(two, 0.9) == 0  # 5 < 5.4


def test_truncate_htfllib_by_hand():
    w = torch.diag(torch.tensor([3.0, 2.0, 1.0]))
    conv = torch.zeros(2, 1, 2, 2)
    conv[0, 0] = torch.diag(torch.tensor([2.0, 1.0]))
    conv[1, 0] = torch.diag(torch.tensor([1.0, 0.0]))
    state = {
        "w": w,
        "conv": conv,
        "row": torch.ones(1, 4),  # shape[0] == 1: not decomposed
        "b": torch.ones(3),
        "n": torch.tensor(7),
    }
    out = truncate_htfllib(state, 0.9)
    assert torch.allclose(out["w"], torch.diag(torch.tensor([3.0, 2.0, 0.0])), atol=1e-6)
    assert torch.allclose(out["conv"], torch.zeros_like(conv), atol=1e-6)  # k = 0: zeroed
    for k in ("row", "b", "n"):
        assert out[k] is state[k]
    # at 0.8 each 2 x 2 slice keeps its top triplet (one SVD per slice, not [out, in*kh*kw])
    out = truncate_htfllib(state, 0.8)
    kept = torch.zeros_like(conv)
    kept[0, 0, 0, 0], kept[1, 0, 0, 0] = 2.0, 1.0
    assert torch.allclose(out["conv"], kept, atol=1e-6)
    assert torch.allclose(truncate_htfllib(state, 0.95)["w"], torch.zeros(3, 3))  # k = 0
    zero = torch.zeros(3, 3)
    assert truncate_htfllib({"z": zero}, 0.9)["z"] is zero  # all-zero: kept as is


@pytest.mark.usefixtures("fake_zoo")
def test_parity_options_route_compression_and_loss():
    spec = member_spec(("wide", "narrow"), rounds=2)
    initial = FedKD(mentee_arch="wide").init_server(spec).mentee  # dense, full first broadcast
    algo = FedKD(
        mentee_arch="wide",
        T_start=0.5,
        first_broadcast="svd",
        svd_form="htfllib",
        upload_mode="state",
    )
    state = algo.init_server(spec)
    expected = truncate_htfllib(initial, 0.5)
    assert state.message.keys() == initial.keys()  # dense truncated tensors, no factors
    assert all(torch.equal(state.mentee[k], expected[k]) for k in initial)
    models, extras, data = make_clients(algo, spec)
    new, uploads, _ = run_round(algo, state, models, extras, data, 1)
    up = uploads[0].payload.tensors
    assert up.keys() == initial.keys()
    sent = truncate_htfllib(extras[0].mentee.part_state("all"), 0.5)
    assert all(torch.equal(up[k], sent[k]) for k in up)
    # the loss option
    x, y = data[0].source.batch(torch.arange(4)), torch.tensor([0, 1, 0, 1])
    loss = FedKD(mentee_arch="wide", loss_form="htfllib").loss(models[0], extras[0], x, y, None)
    h_t, h_s = models[0].features(x), extras[0].mentee.features(x)
    direct = htfllib_loss(
        models[0].head(h_t), extras[0].mentee.head(h_s), h_t, extras[0].W_h(h_s), y
    )
    assert torch.equal(loss, direct)
    default = FedKD(mentee_arch="wide").loss(models[0], extras[0], x, y, None)
    assert not torch.allclose(loss, default)


@pytest.mark.integration
def test_htfllib_forms_end_to_end():
    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment  # needs the model zoo

    algorithm = {"name": "fedkd", "upload_mode": "state", "loss_form": "htfllib"}
    raw = tiny_raw(model={"family": "htfe8-gray"}, algorithm={**algorithm, "svd_form": "htfllib"})
    doc = run_experiment(from_dict(raw), progress=False)
    for r in doc["rounds"]:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0
