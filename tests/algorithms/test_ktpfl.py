"""KT-pFL: personalized targets, the knowledge-coefficient update against finite differences of an
independently written objective, simplex projection and the reference step rule by hand, the
client's distillation step, equivalence with Local at ``distill_epochs = 0``, partial
participation and short runs with every payload round-tripped through the wire."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from helpers.experiments import tiny_raw
from helpers.toyfed import WITH_PUBLIC, accuracy_and_loss, make_toy, run_toy, toy_model

from fedmosaic.algorithms.ktpfl import (
    KTpFL,
    KTpFLBroadcast,
    KTpFLUpload,
    personalized_targets,
    project_rows_to_simplex,
    reference_step_scale,
    soft_kl,
    update_coef,
)
from fedmosaic.algorithms.local import Local
from fedmosaic.config import ConfigError
from fedmosaic.core.algorithm import FederationSpec, FitContext, Weighted
from fedmosaic.core.payload import PayloadError
from fedmosaic.core.training import TrainSettings

# Three clients' soft predictions on two public inputs, three classes: P[j][x][k].
P = [
    [[0.7, 0.2, 0.1], [0.3, 0.3, 0.4]],
    [[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]],
    [[0.1, 0.1, 0.8], [0.5, 0.25, 0.25]],
]
C0 = [[0.5, 0.3, 0.2], [0.2, 0.6, 0.2], [0.1, 0.2, 0.7]]


def _objective(c: list[list[float]], p: list, rho: float) -> float:
    """sum_i mean_x KL(s_i(x) || p_i(x)) + rho * sum_ij (c_ij - 1/N)^2, with plain floats."""
    n = len(c)
    total = 0.0
    for i in range(n):
        row_sum = sum(c[i])
        kl = 0.0
        for x in range(len(p[i])):
            for k in range(len(p[i][x])):
                s = sum(c[i][j] * p[j][x][k] for j in range(n)) / row_sum
                kl += s * math.log(s / p[i][x][k])
        total += kl / len(p[i])
    return total + rho * sum((c[i][j] - 1.0 / n) ** 2 for i in range(n) for j in range(n))


def _fd_grad(c: list[list[float]], p: list, rho: float, h: float = 1e-6) -> list[list[float]]:
    g = [[0.0] * len(c) for _ in c]
    for i in range(len(c)):
        for j in range(len(c)):
            up = [row[:] for row in c]
            dn = [row[:] for row in c]
            up[i][j] += h
            dn[i][j] -= h
            g[i][j] = (_objective(up, p, rho) - _objective(dn, p, rho)) / (2 * h)
    return g


def test_personalized_targets_hand_computed():
    soft = torch.tensor([[[0.9, 0.1]], [[0.5, 0.5]], [[0.2, 0.8]]])  # [N=3, P=1, C=2]
    row = torch.tensor([[0.5, 0.25, 0.25]], dtype=torch.float64)
    everyone = torch.ones(3, dtype=torch.bool)
    got = personalized_targets(row, soft, everyone)
    # 0.5 * [0.9, 0.1] + 0.25 * [0.5, 0.5] + 0.25 * [0.2, 0.8]
    assert torch.allclose(got, torch.tensor([[[0.625, 0.375]]], dtype=torch.float64))
    # Client 1 never uploaded: its weight is dropped and the row renormalized: [2/3, 0, 1/3].
    got = personalized_targets(row, soft, torch.tensor([True, False, True]))
    assert torch.allclose(got, torch.tensor([[[2 / 3, 1 / 3]]], dtype=torch.float64))
    # No weight on any known client: the plain mean of the known predictions.
    got = personalized_targets(torch.tensor([[0.0, 1.0, 0.0]]), soft, torch.tensor([1, 0, 1]) > 0)
    assert torch.allclose(got, torch.tensor([[[0.55, 0.45]]]))


def test_coef_update_matches_finite_differences():
    rho, lr = 0.5, 0.05
    g = _fd_grad(C0, P, rho)
    # Projected gradient step: remove each row's mean (tangent to the simplex); the step stays
    # inside the simplex here, so the projection onto it changes nothing.
    want = [[C0[i][j] - lr * (g[i][j] - sum(g[i]) / 3) for j in range(3)] for i in range(3)]
    assert all(v > 0 for row in want for v in row)
    got = update_coef(
        torch.tensor(C0, dtype=torch.float64),
        torch.tensor(P),
        torch.ones(3, dtype=torch.bool),
        rho=rho,
        lr=lr,
        steps=1,
        adaptive=False,
    )
    assert torch.allclose(got, torch.tensor(want, dtype=torch.float64), atol=1e-7)
    assert torch.allclose(got.sum(1), torch.ones(3, dtype=torch.float64))
    # The objective went down.
    assert _objective(got.tolist(), P, rho) < _objective(C0, P, rho)


def test_coef_update_with_reference_step_rule():
    rho = 0.7
    g = _fd_grad(C0, P, rho)
    g_tan = [[g[i][j] - sum(g[i]) / 3 for j in range(3)] for i in range(3)]
    got = update_coef(
        torch.tensor(C0, dtype=torch.float64),
        torch.tensor(P),
        torch.ones(3, dtype=torch.bool),
        rho=rho,
        lr=1.0,
    )
    for i in range(3):
        scale = reference_step_scale(sum(abs(v) for v in g_tan[i]) / 3)
        step = [C0[i][j] - scale * g_tan[i][j] for j in range(3)]
        want = project_rows_to_simplex(torch.tensor([step], dtype=torch.float64))[0]
        assert torch.allclose(got[i], want, atol=1e-6)


def test_project_rows_to_simplex_hand_computed():
    v = torch.tensor(
        [[0.8, 0.6, -0.5], [0.2, 0.3, 0.5], [1.0, 1.0, 1.0], [2.0, 0.0, 0.0], [-0.4, 0.7, 0.2]],
        dtype=torch.float64,
    )
    want = torch.tensor(
        [
            [0.6, 0.4, 0.0],  # theta = (0.8 + 0.6 - 1) / 2 = 0.2
            [0.2, 0.3, 0.5],  # already on the simplex
            [1 / 3, 1 / 3, 1 / 3],
            [1.0, 0.0, 0.0],
            [0.0, 0.75, 0.25],  # theta = (0.7 + 0.2 - 1) / 2 = -0.05
        ],
        dtype=torch.float64,
    )
    assert torch.allclose(project_rows_to_simplex(v), want)


def test_reference_step_scale_hand_computed():
    # 0.1 -> /5 = 0.02 (scale 0.2); the next iterations go 0.004 -> x5 = 0.02: ends at 0.2.
    assert reference_step_scale(0.1) == pytest.approx(0.2)
    # 0.001 -> x5 = 0.005 -> x5 = 0.025 (25) -> /5, x5 ... ends at 25.
    assert reference_step_scale(0.001) == pytest.approx(25.0)
    assert reference_step_scale(0.03) == pytest.approx(1.0)  # /5 = 0.006, x5 = 0.03: unchanged
    assert reference_step_scale(0.0) == pytest.approx(5.0**5)


# ---- client side ----------------------------------------------------------------------------


def _kl(model, x, target, T):
    with torch.no_grad():
        return float(F.kl_div(F.log_softmax(model(x) / T, 1), target, reduction="batchmean"))


def test_distillation_moves_predictions_toward_target():
    algo = KTpFL(
        T=2.0,
        distill_epochs=20,
        distill_lr=0.5,
        distill_batch_size=8,
        distill_reduction="batchmean",
    )
    toy = make_toy(algo, WITH_PUBLIC)
    model = toy_model()
    x = toy.spec.public  # [16, 1, 3, 4]
    target = F.softmax(torch.randn(16, 3, generator=torch.Generator().manual_seed(1)) * 2, 1)
    before = _kl(model, x, target, algo.T)
    start = [p.detach().clone() for p in model.parameters()]
    gen = torch.Generator().manual_seed(0)
    settings = TrainSettings(batch_size=6, lr=0.1)
    off = KTpFLBroadcast(x, target, False)
    algo.before_fit(FitContext(model, torch.nn.Module(), toy.clients[0], off, settings, gen, 1))
    assert all(torch.equal(a, b) for a, b in zip(start, model.parameters()))  # no target yet
    msg = KTpFLBroadcast(x, target, True)
    algo.before_fit(FitContext(model, torch.nn.Module(), toy.clients[0], msg, settings, gen, 1))
    after = _kl(model, x, target, algo.T)
    assert after < 0.7 * before
    # The upload is softmax(logits / T) on the public inputs.
    model.eval()
    with torch.no_grad():
        up = algo.upload(model, torch.nn.Module(), toy.clients[0], msg)
        assert torch.allclose(up.soft, F.softmax(model(x) / algo.T, 1))
    assert torch.allclose(up.soft.sum(1), torch.ones(16))


def test_distillation_uses_its_own_optimizer_not_the_private_one():
    """Private training with Adam must not turn the distillation step into Adam at 0.02."""
    algo = KTpFL(T=2.0, distill_epochs=1, distill_lr=0.05, distill_batch_size=16)
    toy = make_toy(algo, WITH_PUBLIC)
    x = toy.spec.public  # [16, 1, 3, 4]: one distillation step with batch 16
    target = F.softmax(torch.randn(16, 3, generator=torch.Generator().manual_seed(1)) * 2, 1)
    msg = KTpFLBroadcast(x, target, True)
    got, want = toy_model(), toy_model()
    want.load_state_dict(got.state_dict())
    adam = TrainSettings(batch_size=6, lr=0.1, optimizer="adam", betas=(0.5, 0.999))
    algo.before_fit(
        FitContext(got, torch.nn.Module(), toy.clients[0], msg, adam, torch.Generator(), 1)
    )
    # By hand: one plain SGD step at distill_lr on the distillation loss over all 16 inputs.
    want.train()
    loss = soft_kl(want(x), target, algo.T)
    grads = torch.autograd.grad(loss, list(want.parameters()))
    with torch.no_grad():
        for p, g in zip(want.parameters(), grads):
            p.sub_(algo.distill_lr * g)
    for a, b in zip(got.parameters(), want.parameters()):
        assert torch.allclose(a, b, atol=1e-6)
    with pytest.raises(ValueError, match="distill_optimizer"):
        KTpFL(distill_optimizer="rmsprop")


def test_distill_epochs_zero_trains_exactly_like_local():
    kt = run_toy(KTpFL(distill_epochs=0), WITH_PUBLIC, rounds=3)
    loc = run_toy(Local(), WITH_PUBLIC, rounds=3)
    assert accuracy_and_loss(kt.history) == accuracy_and_loss(loc.history)
    # With distillation, round 1 is still identical (no targets yet) and round 2 is not.
    on = run_toy(KTpFL(distill_lr=0.5), WITH_PUBLIC, rounds=2)
    assert accuracy_and_loss(on.history)[0] == accuracy_and_loss(loc.history)[0]
    assert accuracy_and_loss(on.history)[1] != accuracy_and_loss(loc.history)[1]


# ---- server side ----------------------------------------------------------------------------


def test_run_learns_coefficients_on_the_simplex():
    toy = run_toy(KTpFL(distill_lr=0.5), WITH_PUBLIC, rounds=3)
    assert all(r["rejected"] == [] for r in toy.history.rounds)
    c = toy.state.coef
    assert torch.allclose(c.sum(1), torch.ones(3, dtype=torch.float64)) and bool((c >= 0).all())
    assert not torch.allclose(c, torch.full((3, 3), 1 / 3, dtype=torch.float64))
    assert bool(toy.state.known.all())
    # Each client's broadcast target is its own row of c applied to the stored predictions.
    for i in range(3):
        msg = KTpFL().broadcast(toy.state, i, 4)
        want = sum(float(c[i, j]) * toy.state.soft[j] for j in range(3))
        assert msg.has_target and torch.allclose(msg.target, want.float(), atol=1e-6)


def test_partial_participation_keeps_last_known_predictions():
    algo = KTpFL()
    toy = make_toy(algo, WITH_PUBLIC)
    state = algo.init_server(toy.spec)
    msg = algo.broadcast(state, 0, 1)
    assert not msg.has_target and float(msg.target.abs().sum()) == 0.0
    p_shape = tuple(state.soft.shape[1:])
    g = torch.Generator().manual_seed(2)

    def up(cid: int) -> Weighted[KTpFLUpload]:
        return Weighted(cid, 10.0, KTpFLUpload(F.softmax(torch.randn(p_shape, generator=g), 1)))

    first = [up(0), up(2)]
    state = algo.aggregate(state, first, 1)
    assert state.known.tolist() == [True, False, True]
    assert float(state.soft[1].abs().sum()) == 0.0
    # Client 1 has not uploaded: its target mixes clients 0 and 2 with its row renormalized.
    c = state.coef
    w0, w2 = float(c[1, 0]), float(c[1, 2])
    want = (w0 * first[0].payload.soft + w2 * first[1].payload.soft) / (w0 + w2)
    assert torch.allclose(algo.broadcast(state, 1, 2).target, want, atol=1e-6)
    state = algo.aggregate(state, [up(1)], 2)
    assert bool(state.known.all())
    assert torch.equal(state.soft[0], first[0].payload.soft)  # last known kept
    assert torch.equal(state.soft[2], first[1].payload.soft)


def test_public_subset_is_seeded_and_fixed():
    algo = KTpFL(public_batch=5)
    toy = make_toy(algo, WITH_PUBLIC)
    a, b = algo.init_server(toy.spec), algo.init_server(toy.spec)
    assert a.public.shape == (5, 1, 3, 4) and torch.equal(a.public, b.public)
    rows = {tuple(r.flatten().tolist()) for r in toy.spec.public}
    assert all(tuple(r.flatten().tolist()) in rows for r in a.public)
    other = algo.init_server(dataclasses.replace(toy.spec, seed=1))
    assert not torch.equal(other.public, a.public)
    assert torch.equal(algo.broadcast(a, 0, 1).public, a.public)


def test_validate_upload_rejects_malformed():
    algo = KTpFL()
    toy = make_toy(algo, WITH_PUBLIC)
    state = algo.init_server(toy.spec)
    p = state.soft.shape[1]
    good = torch.full((p, 3), 1 / 3)
    algo.validate_upload(state, KTpFLUpload(good), 0)
    bad = {
        "expected": [good.double(), torch.full((p + 1, 3), 1 / 3)],
        "outside": [good * -1.0],
        "sum to 1": [good * 0.5],
    }
    for msg, uploads in bad.items():
        for soft in uploads:
            with pytest.raises(PayloadError, match=msg):
                algo.validate_upload(state, KTpFLUpload(soft), 0)


def _members_spec(members: tuple[str, ...]) -> FederationSpec:
    n = len(members)
    return FederationSpec(n, 3, 4, (1, 4, 4), members, (8,) * n, 0, 2, toy_model)


def test_config_requires_public_split():
    spec = _members_spec(("a", "a"))
    assert spec.public is None
    with pytest.raises(ConfigError, match="data.public_size"):
        KTpFL().check(spec)
    KTpFL().check(dataclasses.replace(spec, public=torch.zeros(50, 1, 4, 4)))
    with pytest.raises(ValueError, match="T"):
        KTpFL(T=0.0)
    toy = make_toy(KTpFL(), WITH_PUBLIC, public_size=0)
    with pytest.raises(ValueError, match="public"):
        KTpFL().init_server(toy.spec)


# ---- end to end (data + model zoo) -----------------------------------------------------------


@pytest.mark.integration
def test_two_rounds_heterogeneous_with_wire_check():
    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment

    raw = tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "ktpfl"})
    assert raw["data"]["public_size"] > 0
    doc = run_experiment(from_dict(raw), progress=False)
    assert [r["round"] for r in doc["rounds"]] == [1, 2]
    for r in doc["rounds"]:
        assert r["rejected"] == [] and 0.0 <= r["acc_weighted"] <= 1.0
        assert math.isfinite(r["train_loss"]) and r["bytes_up"] > 0 and r["bytes_down"] > 0
    no_public = tiny_raw(data={"public_size": 0}, algorithm={"name": "ktpfl"})
    from fedmosaic.federation import build_federation

    with pytest.raises(ConfigError, match="data.public_size"):  # Algorithm.check on the spec
        build_federation(from_dict(no_public), with_clients=False)


# ---- reference defaults: KL normalization, every public input, epoch ramp --------------------


def test_distillation_kl_mean_is_batchmean_over_C_hand_computed():
    z = torch.tensor([[1.0, 0.0, -1.0], [0.5, 0.5, 2.0]])  # student logits, B = 2, C = 3
    t = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])  # target rows sum to 1
    T = 2.0
    rows = []
    for zr, tr in zip(z.tolist(), t.tolist()):
        lse = math.log(sum(math.exp(v / T) for v in zr))
        rows.append(sum(p * (math.log(p) - (v / T - lse)) for v, p in zip(zr, tr)))
    batchmean = sum(rows) / 2  # the per-example KL averaged over the batch
    assert soft_kl(z, t, T, "batchmean").item() == pytest.approx(batchmean, rel=1e-6)
    assert soft_kl(z, t, T, "mean").item() == pytest.approx(batchmean / 3, rel=1e-6)  # / C
    assert KTpFL().distill_reduction == "mean"  # the reference's, by default
    assert soft_kl(z, t, T).item() == pytest.approx(batchmean / 3, rel=1e-6)


def test_distillation_reduction_scales_the_sgd_step_by_C():
    toy = make_toy(KTpFL(), WITH_PUBLIC)
    x = toy.spec.public  # [16, 1, 3, 4]
    target = F.softmax(torch.randn(16, 3, generator=torch.Generator().manual_seed(1)) * 2, 1)
    msg = KTpFLBroadcast(x, target, True)
    start = toy_model()
    steps = {}
    for red, lr in (("mean", 0.3), ("batchmean", 0.1)):  # C = 3: batchmean at lr / C == mean
        model = toy_model()
        model.load_state_dict(start.state_dict())
        algo = KTpFL(T=2.0, distill_lr=lr, distill_batch_size=16, distill_reduction=red)
        algo.before_fit(
            FitContext(model, torch.nn.Module(), toy.clients[0], msg, TrainSettings(), None, 1)
        )
        steps[red] = [
            p.detach() - q.detach() for p, q in zip(model.parameters(), start.parameters())
        ]
    for a, b in zip(steps["mean"], steps["batchmean"]):
        assert a.abs().sum() > 0 and torch.allclose(a, b, atol=1e-7)


def test_distillation_uses_every_public_input_whatever_train_drop_last():
    algo = KTpFL(distill_batch_size=6)  # 16 public inputs: batches of 6, 6 and the last 4
    toy = make_toy(algo, WITH_PUBLIC)
    x = toy.spec.public
    msg = KTpFLBroadcast(x, torch.full((16, 3), 1 / 3), True)
    model = toy_model()
    seen = []
    model.register_forward_hook(lambda m, inp, out: seen.append(inp[0].shape[0]))
    settings = TrainSettings(batch_size=6, drop_last=True)  # the private loader drops its tail
    algo.before_fit(
        FitContext(model, torch.nn.Module(), toy.clients[0], msg, settings, torch.Generator(), 1)
    )
    assert sorted(seen) == [4, 6, 6] and sum(seen) == 16  # the reference keeps the partial batch


def test_epoch_ramp_is_the_references_schedule():
    ramp = KTpFL(epoch_ramp=True)
    assert [ramp.phases(t, 3)[0].epochs for t in (1, 2, 3, 4, 9)] == [1, 2, 3, 3, 3]
    assert [KTpFL().phases(t, 3)[0].epochs for t in (1, 2, 9)] == [3, 3, 3]  # default: fixed


def test_new_options_are_validated_by_config():
    from fedmosaic.algorithms import build_algorithm

    with pytest.raises(ConfigError, match="distill_reduction"):
        build_algorithm({"name": "ktpfl", "distill_reduction": "sum"})
    with pytest.raises(ConfigError, match="epoch_ramp"):
        build_algorithm({"name": "ktpfl", "epoch_ramp": "yes"})
    algo = build_algorithm({"name": "ktpfl", "distill_reduction": "batchmean", "epoch_ramp": True})
    assert algo == KTpFL(distill_reduction="batchmean", epoch_ramp=True)
