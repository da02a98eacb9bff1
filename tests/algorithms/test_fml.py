import math

import pytest
import torch
import torch.nn.functional as F
from helpers.experiments import tiny_raw
from helpers.toyfed import fake_zoo, make_clients, member_spec, run_round  # noqa: F401 (fixture)

from fedmosaic.algorithms import _distill, build_algorithm
from fedmosaic.algorithms._shared import SharedState
from fedmosaic.algorithms.fml import FML, htfllib_mutual_loss, mutual_losses
from fedmosaic.config import ConfigError
from fedmosaic.core.algorithm import Weighted
from fedmosaic.core.payload import PayloadError

ZP = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 1.0]])  # personal logits
ZM = torch.tensor([[0.0, 1.0, 0.0], [1.0, -1.0, 0.5]])  # meme logits
Y = torch.tensor([0, 2])


def _log_softmax(v):
    lse = math.log(sum(math.exp(t) for t in v))
    return [t - lse for t in v]


def _kl_batchmean(student, teacher):
    """(1/B) sum_i sum_c p_teacher log(p_teacher / p_student), with plain floats."""
    total = 0.0
    for s_row, t_row in zip(student.tolist(), teacher.tolist()):
        ls, lt = _log_softmax(s_row), _log_softmax(t_row)
        total += sum(math.exp(b) * (b - a) for a, b in zip(ls, lt))
    return total / len(student)


def _ce(z, y):
    return -sum(_log_softmax(row)[c] for row, c in zip(z.tolist(), y.tolist())) / len(z)


def test_alpha_one_is_pure_cross_entropy():
    lp, lm = mutual_losses(ZP, ZM, Y, alpha=1.0, beta=1.0)
    assert lp.item() == pytest.approx(_ce(ZP, Y), rel=1e-6)
    assert lm.item() == pytest.approx(_ce(ZM, Y), rel=1e-6)
    assert lp.item() == pytest.approx(F.cross_entropy(ZP, Y).item())


def test_kl_batchmean_matches_explicit_formula():
    lp, lm = mutual_losses(ZP, ZM, Y, alpha=0.0, beta=0.0)
    assert lp.item() == pytest.approx(_kl_batchmean(ZP, ZM), rel=1e-5)  # KL(p_meme || p_personal)
    assert lm.item() == pytest.approx(_kl_batchmean(ZM, ZP), rel=1e-5)
    # And the mix: alpha CE + (1 - alpha) KL.
    lp, lm = mutual_losses(ZP, ZM, Y, alpha=0.3, beta=0.8)
    assert lp.item() == pytest.approx(0.3 * _ce(ZP, Y) + 0.7 * _kl_batchmean(ZP, ZM), rel=1e-5)
    assert lm.item() == pytest.approx(0.8 * _ce(ZM, Y) + 0.2 * _kl_batchmean(ZM, ZP), rel=1e-5)


def test_targets_are_detached():
    zp, zm = ZP.clone().requires_grad_(), ZM.clone().requires_grad_()
    lp, lm = mutual_losses(zp, zm, Y, 0.5, 0.5)
    (g_meme,) = torch.autograd.grad(lp, zm, allow_unused=True, materialize_grads=True)
    assert torch.equal(g_meme, torch.zeros_like(zm))
    (g_personal,) = torch.autograd.grad(lm, zp, allow_unused=True, materialize_grads=True)
    assert torch.equal(g_personal, torch.zeros_like(zp))


# the reference's nn.KLDivLoss() warns that its "mean" is not the per-example KL: that is the point
@pytest.mark.filterwarnings("ignore:reduction. 'mean' divides:UserWarning")
def test_htfllib_loss_is_the_references_two_losses_by_hand():
    # nn.KLDivLoss() averages over B * C elements: the per-example KL divided by C (3 here).
    want = (
        0.3 * _ce(ZP, Y)
        + 0.7 * _kl_batchmean(ZP, ZM) / 3
        + 0.8 * _ce(ZM, Y)
        + 0.2 * _kl_batchmean(ZM, ZP) / 3
    )
    assert htfllib_mutual_loss(ZP, ZM, Y, 0.3, 0.8).item() == pytest.approx(want, rel=1e-6)
    # The reference's own expression, term for term.
    kl = torch.nn.KLDivLoss()
    ref = (
        F.cross_entropy(ZP, Y) * 0.3
        + kl(F.log_softmax(ZP, dim=1), F.softmax(ZM, dim=1)) * 0.7
        + F.cross_entropy(ZM, Y) * 0.8
        + kl(F.log_softmax(ZM, dim=1), F.softmax(ZP, dim=1)) * 0.2
    )
    assert htfllib_mutual_loss(ZP, ZM, Y, 0.3, 0.8).item() == pytest.approx(ref.item(), rel=1e-6)


def test_htfllib_loss_trains_each_model_through_the_others_target():
    # alpha = beta = 1 leaves only CE: no cross gradient. With KL, the meme's logits get a gradient
    # from the personal model's KL term (and vice versa), unlike the detached default.
    zp, zm = ZP.clone().requires_grad_(), ZM.clone().requires_grad_()
    (g_meme,) = torch.autograd.grad(htfllib_mutual_loss(zp, zm, Y, 0.0, 1.0), zm)
    (g_ce,) = torch.autograd.grad(F.cross_entropy(zm, Y), zm)
    assert not torch.allclose(g_meme, g_ce)
    zm2 = ZM.clone().requires_grad_()
    (g_kl_target,) = torch.autograd.grad(
        F.kl_div(F.log_softmax(ZP, 1), F.softmax(zm2, 1), reduction="sum") / ZP.numel(), zm2
    )
    assert torch.allclose(g_meme, g_ce + g_kl_target, atol=1e-7)


def test_uniform_server_average_ignores_sample_counts():
    a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([5.0, -2.0])}
    state = {"w": torch.zeros(2)}
    ups = [Weighted(0, 1.0, SharedState(a)), Weighted(1, 3.0, SharedState(b))]
    assert torch.equal(FML().aggregate(state, ups, 1)["w"], torch.tensor([4.0, -1.0]))
    uniform = FML(server_average="uniform")
    assert torch.equal(uniform.aggregate(state, ups, 1)["w"], torch.tensor([3.0, 0.0]))
    # The secure-sum path weighs the same way.
    sums: dict[str, torch.Tensor] = {}
    for u in ups:
        for k, v in uniform.summands(u.payload, u.weight).items():
            sums[k] = sums[k] + v if k in sums else v
    assert torch.equal(
        uniform.from_sums(state, sums, 1).payload.state["w"], torch.tensor([3.0, 0.0])
    )


def test_meme_averaged_exactly_with_buffers():
    a = {
        "w": torch.tensor([[1.0, 2.0]]),
        "bn.running_mean": torch.tensor([0.0]),
        "bn.num_batches_tracked": torch.tensor(3),
    }
    b = {
        "w": torch.tensor([[5.0, -2.0]]),
        "bn.running_mean": torch.tensor([4.0]),
        "bn.num_batches_tracked": torch.tensor(7),
    }
    algo = FML()
    state = {k: torch.zeros_like(v) for k, v in a.items()}
    out = algo.aggregate(
        state, [Weighted(0, 1.0, SharedState(a)), Weighted(1, 3.0, SharedState(b))], 1
    )
    # (1 * a + 3 * b) / 4
    assert torch.equal(out["w"], torch.tensor([[4.0, -1.0]]))
    assert torch.equal(out["bn.running_mean"], torch.tensor([3.0]))
    assert int(out["bn.num_batches_tracked"]) == 7
    with pytest.raises(PayloadError):
        algo.validate_upload(state, SharedState({"w": torch.zeros(1, 2)}), 0)


def test_hyperparameters_are_checked():
    for bad in ({"alpha": 1.5}, {"beta": -0.1}, {"loss_form": "kl"}, {"server_average": "mean"}):
        with pytest.raises(ConfigError):
            build_algorithm({"name": "fml", **bad})


@pytest.mark.usefixtures("fake_zoo")
def test_meme_is_smallest_member_and_server_init_deterministic():
    spec = member_spec(("wide", "narrow", "wide"))
    assert _distill.small_member("", spec) == "narrow"
    assert _distill.small_member("wide", spec) == "wide"
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    s1 = FML().init_server(spec)
    assert torch.equal(torch.rand(1), before)  # the caller's RNG stream is untouched
    s2 = FML().init_server(spec)
    assert s1.keys() == s2.keys() and all(torch.equal(s1[k], s2[k]) for k in s1)
    assert s1["encoder.1.weight"].shape == (4, 12)  # the narrow member


@pytest.mark.usefixtures("fake_zoo")
def test_zoo_free_rounds_train_both_models_and_average_memes():
    algo = FML()
    spec = member_spec(("wide", "narrow"))
    models, extras, data = make_clients(algo, spec)
    state = algo.init_server(spec)
    personal0 = [m.state_dict()["head.weight"].clone() for m in models]
    new_state, _, _ = run_round(algo, state, models, extras, data, 1)
    # Every meme was trained from the broadcast state; the server holds their weighted mean.
    memes = [e.meme.state_dict() for e in extras]
    w = [d.num_train for d in data]
    for k, v in new_state.items():
        assert torch.allclose(v, (w[0] * memes[0][k] + w[1] * memes[1][k]) / sum(w), atol=1e-6)
        assert not torch.equal(v, state[k]) or not v.is_floating_point()
    for m, p0 in zip(models, personal0):
        assert not torch.equal(m.state_dict()["head.weight"], p0)
    scores = algo.predict(models[0], extras[0], data[0].source.batch(torch.arange(4)), None)
    assert set(scores) == {"acc", "acc_meme"} and scores["acc_meme"].shape == (4, 3)


@pytest.mark.integration
def test_two_rounds_heterogeneous_end_to_end():
    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment  # needs the model zoo

    doc = run_experiment(
        from_dict(tiny_raw(model={"family": "htfe8-gray"}, algorithm={"name": "fml"})),
        progress=False,
    )
    for r in doc["rounds"]:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0 and 0.0 <= r["acc_meme_weighted"] <= 1.0


@pytest.mark.parametrize("projection", ["pool", "linear"])
def test_meme_is_built_with_the_clients_projection(projection):
    from torch import nn

    from fedmosaic.config import from_dict
    from fedmosaic.experiment import build_federation  # needs the model zoo

    raw = tiny_raw(
        model={"family": "htfe8-gray", "projection": projection}, algorithm={"name": "fml"}
    )
    fed = build_federation(from_dict(raw))
    kind = nn.AdaptiveAvgPool1d if projection == "pool" else nn.Linear
    assert fed.spec.projection == projection
    for model, extras in zip(fed.models, fed.extras, strict=True):
        # Both encoders end in the same kind of projection block (pool: parameter-free).
        assert isinstance(model.encoder.proj, kind)
        assert isinstance(extras.meme.encoder.proj, kind)
    # The server's initial meme has the same tensors as the clients' (no proj.weight under pool).
    state = fed.algo.init_server(fed.spec)
    assert state.keys() == fed.extras[0].meme.state_dict().keys()
    assert any(k.endswith("proj.weight") for k in state) == (projection == "linear")
