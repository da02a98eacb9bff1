import math

import pytest
import torch
from helpers.experiments import tiny_raw
from helpers.toyfed import make_clients, member_data, member_model, member_spec, run_round
from torch import nn

from fedmosaic.algorithms import build_algorithm
from fedmosaic.algorithms.feddistill import (
    ClassLogits,
    FedDistill,
    aggregate_logits,
    distill_loss,
)
from fedmosaic.config import ConfigError
from fedmosaic.core.algorithm import Weighted
from fedmosaic.core.payload import PayloadError


def test_aggregation_with_missing_classes_hand_computed():
    # C = 3. Client A has class 0 only, B classes 0 and 1, C none; nobody has class 2.
    a = ClassLogits(
        torch.tensor([[1.0, 3.0, 0.0], [50.0, 50.0, 50.0], [0.0, 0.0, 0.0]]),
        torch.tensor([True, False, False]),
    )
    b = ClassLogits(
        torch.tensor([[3.0, 1.0, 2.0], [4.0, -2.0, 0.0], [0.0, 0.0, 0.0]]),
        torch.tensor([True, True, False]),
    )
    c = ClassLogits(torch.full((3, 3), 100.0), torch.tensor([False, False, False]))
    algo = FedDistill()
    state = algo.init_server(member_spec(("wide", "narrow", "wide")))
    # Weights (sample counts) do not enter: the mean is over clients that have the class.
    out = algo.aggregate(state, [Weighted(0, 1.0, a), Weighted(1, 9.0, b), Weighted(2, 5.0, c)], 1)
    expected = torch.tensor([[2.0, 2.0, 1.0], [4.0, -2.0, 0.0], [0.0, 0.0, 0.0]])
    assert torch.equal(out.logits, expected)
    assert out.known.tolist() == [True, True, False]
    assert out.logits.dtype == torch.float32


def _three_uploads():
    a = ClassLogits(
        torch.tensor([[1.0, 3.0, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 0.0]]),
        torch.tensor([True, True, False]),
    )
    b = ClassLogits(
        torch.tensor([[3.0, 1.0, 0.0], [4.0, -2.0, 0.0], [0.0, 0.0, 0.0]]),
        torch.tensor([True, True, False]),
    )
    c = ClassLogits(
        torch.tensor([[5.0, 2.0, 0.0], [50.0, 50.0, 50.0], [0.0, 0.0, 6.0]]),  # class 1 unknown
        torch.tensor([True, False, True]),
    )
    return [Weighted(0, 1.0, a), Weighted(1, 1.0, b), Weighted(2, 1.0, c)]


def test_leave_one_out_average_hand_computed():
    """Jeong et al. Alg. 1: client i gets (F - F_i) / (M - 1), F the sum over the M clients."""
    algo = FedDistill()
    assert algo.average == "others"  # the paper's, by default
    spec = member_spec(("wide", "narrow", "wide", "narrow"))  # client 3 does not upload
    state = algo.aggregate(algo.init_server(spec), _three_uploads(), 1)
    # class 0: F = [9, 6, 0], M = 3 -> A: [8, 3]/2, B: [6, 5]/2, C: [4, 4]/2.
    # class 1 (A, B hold it): A gets B's row, B gets A's, C (no class 1) the mean of both.
    # class 2 (only C): unknown to C; A and B get C's row.
    want = {
        0: ([[4.0, 1.5, 0.0], [4.0, -2.0, 0.0], [0.0, 0.0, 6.0]], [True, True, True]),
        1: ([[3.0, 2.5, 0.0], [2.0, 0.0, 0.0], [0.0, 0.0, 6.0]], [True, True, True]),
        2: ([[2.0, 2.0, 0.0], [3.0, -1.0, 0.0], [0.0, 0.0, 0.0]], [True, True, False]),
        # no upload this round: nothing to leave out, the mean over every uploader
        3: ([[3.0, 2.0, 0.0], [3.0, -1.0, 0.0], [0.0, 0.0, 6.0]], [True, True, True]),
    }
    for cid, (logits, known) in want.items():
        msg = algo.broadcast(state, cid, 2)
        assert torch.allclose(msg.logits, torch.tensor(logits)), cid
        assert msg.known.tolist() == known, cid
    # average = "all" (HtFLlib): every client gets the plain mean over all holders.
    every = FedDistill(average="all")
    state = every.aggregate(every.init_server(spec), _three_uploads(), 1)
    for cid in range(4):
        msg = every.broadcast(state, cid, 2)
        assert torch.allclose(msg.logits, torch.tensor(want[3][0]))
        assert msg.known.tolist() == [True, True, True]


def test_leave_one_out_forgets_clients_absent_from_the_round():
    algo = FedDistill()
    spec = member_spec(("wide", "narrow", "wide"))
    state = algo.aggregate(algo.init_server(spec), _three_uploads(), 1)
    # Round 2: only client 1 uploads; the others' round-1 logits are not reused.
    state = algo.aggregate(state, _three_uploads()[1:2], 2)
    assert algo.broadcast(state, 1, 3).known.tolist() == [False, False, False]
    msg = algo.broadcast(state, 0, 3)
    assert torch.equal(msg.logits, _three_uploads()[1].payload.logits)


def test_aggregate_logits_function_matches_loop():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 5, 5, generator=g)
    known = torch.rand(4, 5, generator=g) > 0.5
    mean, have = aggregate_logits(logits, known)
    for c in range(5):
        rows = [logits[k, c] for k in range(4) if known[k, c]]
        assert bool(have[c]) == bool(rows)
        if rows:
            assert torch.allclose(mean[c], torch.stack(rows).mean(0), atol=1e-6)
        else:
            assert torch.equal(mean[c], torch.zeros(5))


def test_mse_rows_without_known_class_contribute_zero():
    g = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0], [9.0, 9.0, 9.0]])
    known = torch.tensor([True, True, False])
    z = torch.tensor([[0.5, 0.0, 1.0], [0.0, 1.0, 0.0], [3.0, 3.0, 3.0]], requires_grad=True)
    y = torch.tensor([0, 1, 2])
    loss = distill_loss(z, y, g, known, "mse")
    # row 0: 0.25 + 0 + 1; row 1: 0 + 1 + 0; row 2 (class 2 unknown): 0; mean over 3 * 3.
    assert loss.item() == pytest.approx(2.25 / 9)
    loss.backward()
    assert torch.equal(z.grad[2], torch.zeros(3))
    assert torch.allclose(z.grad[0], 2 * (z[0] - g[0]).detach() / 9)


def _softmax(v):
    e = [math.exp(t) for t in v]
    return [t / sum(e) for t in e]


def test_kl_variant_uses_softmax_probabilities():
    g = torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    known = torch.tensor([True, True, False])
    z = torch.tensor([[0.0, 1.0, 0.0], [1.0, 1.0, -2.0], [5.0, 0.0, 0.0]])
    y = torch.tensor([0, 1, 2])
    T = 2.0
    loss = distill_loss(z, y, g, known, "kl", T)
    expected = 0.0
    for i in range(2):  # row 2's class is unknown: contributes 0
        p = _softmax([v / T for v in g[y[i]].tolist()])
        q = _softmax([v / T for v in z[i].tolist()])
        expected += sum(pi * math.log(pi / qi) for pi, qi in zip(p, q))
    expected = T * T * expected / 3  # averaged over the whole batch
    assert float(loss) == pytest.approx(expected, rel=1e-5)
    # Probability semantics: shifting a global logit row by a constant changes nothing.
    shifted = g + torch.tensor([[10.0], [-3.0], [0.0]])
    assert float(distill_loss(z, y, shifted, known, "kl", T)) == pytest.approx(expected, rel=1e-5)
    # Zero at the target, and the model's loss is CE plus this term.
    assert float(distill_loss(g[y], y, g, known, "kl", T)) == pytest.approx(0.0, abs=1e-7)


@torch.no_grad()
def test_loss_lam_and_variants():
    torch.manual_seed(0)
    model = member_model()
    x = torch.randn(4, 1, 3, 4)
    y = torch.tensor([0, 1, 2, 0])
    msg = ClassLogits(torch.randn(3, 3), torch.tensor([True, False, True]))
    ce = torch.nn.functional.cross_entropy(model(x), y)
    assert float(FedDistill(lam=0.0).loss(model, nn.Module(), x, y, msg)) == pytest.approx(
        float(ce)
    )
    z = model(x)
    for kind in ("mse", "kl"):
        want = ce + 0.5 * distill_loss(z, y, msg.logits, msg.known, kind)
        got = FedDistill(lam=0.5, distill=kind).loss(model, nn.Module(), x, y, msg)
        assert float(got) == pytest.approx(float(want))


def test_upload_is_eval_mode_class_mean():
    torch.manual_seed(0)
    model = member_model()
    model.encoder.append(nn.Dropout(0.5))  # eval mode must switch it off
    data = member_data(0)
    data.labels[data.rows("train")[data.targets("train") == 2]] = 1  # no class 2 left
    data._y.clear()
    model.train()
    up = FedDistill().upload(
        model, nn.Module(), data, ClassLogits(torch.zeros(3, 3), torch.zeros(3))
    )
    assert model.training  # mode restored
    model.eval()
    with torch.no_grad():
        x, y = data.source.batch(data.rows("train")), data.targets("train")
        z = model(x)
    assert up.known.tolist() == [True, True, False]
    for c in (0, 1):
        assert torch.allclose(up.logits[c], z[y == c].mean(0), atol=1e-6)
    assert torch.equal(up.logits[2], torch.zeros(3))


def test_validate_upload_rejects_bad_shapes():
    algo = FedDistill()
    state = algo.init_server(member_spec())
    algo.validate_upload(state, ClassLogits(torch.zeros(3, 3), torch.ones(3, dtype=torch.bool)), 0)
    bad = [
        ClassLogits(torch.zeros(3, 4), torch.ones(3, dtype=torch.bool)),
        ClassLogits(torch.zeros(3, 3, dtype=torch.float64), torch.ones(3, dtype=torch.bool)),
        ClassLogits(torch.zeros(3, 3), torch.ones(3)),
        ClassLogits(torch.zeros(3, 3), torch.ones(2, dtype=torch.bool)),
    ]
    for upload in bad:
        with pytest.raises(PayloadError):
            algo.validate_upload(state, upload, 7)


def test_hyperparameters_are_checked():
    for bad in ({"distill": "ce"}, {"lam": -1.0}, {"T": 0.0}, {"average": "mean"}):
        with pytest.raises(ConfigError):
            build_algorithm({"name": "feddistill", **bad})


@pytest.mark.parametrize(("distill", "average"), [("mse", "others"), ("kl", "all")])
def test_zoo_free_rounds_learn_the_global_logits(distill, average):
    algo = FedDistill(distill=distill, average=average)
    spec = member_spec()
    models, extras, data = make_clients(algo, spec)
    state = algo.init_server(spec)
    for t in (1, 2):
        state, _, _ = run_round(algo, state, models, extras, data, t)
    assert state.known.all()
    assert torch.isfinite(state.logits).all() and state.logits.abs().sum() > 0


@pytest.mark.parametrize("distill", ["mse", "kl"])
@pytest.mark.integration
def test_two_rounds_heterogeneous_end_to_end(distill):
    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment  # needs the model zoo

    raw = tiny_raw(
        model={"family": "htfe8-gray"}, algorithm={"name": "feddistill", "distill": distill}
    )
    doc = run_experiment(from_dict(raw), progress=False)
    for r in doc["rounds"]:
        assert r["rejected"] == [] and math.isfinite(r["train_loss"])
        assert 0.0 <= r["acc_weighted"] <= 1.0
        # Per-class logits: C x C floats + C bools each way, far less than any model.
        assert r["bytes_up_per_client"] < 2000
