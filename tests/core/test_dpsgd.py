"""DP-SGD in local training (``core/dpsgd.py``): per-example clipping and noise by hand, the
BatchNorm replacement on every architecture of the zoo, the per-example accountant, and every
registered method either trained with it or refused with its reason."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers.experiments import SMALL, tiny_raw
from torch import nn

from fedmosaic import api
from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core import accountant, dpsgd, privacy, seeding
from fedmosaic.models import build_client_model

torch.set_num_threads(1)


def toy() -> tuple[nn.Linear, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    y = torch.tensor([0, 1, 1, 0])
    return model, x, y


def step(model: nn.Module, x, y, clip: float, noise: float, seed: int = 5) -> None:
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    dpsgd.private_epochs(
        params,
        lambda a, b: F.cross_entropy(model(a), b),
        lambda pos: (x[pos], y[pos]),
        n=4,
        epochs=1,
        batch_size=4,  # q = 1: every example in the one step of the epoch
        clip=clip,
        noise_multiplier=noise,
        optimizer=opt,
        gen=torch.Generator().manual_seed(seed),
        modules=(model,),
    )


def by_hand(model: nn.Linear, x, y, clip: float) -> dict[str, torch.Tensor]:
    """The step computed one example at a time: clipped per-example gradients, summed, / 4."""
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for i in range(4):
        model.zero_grad()
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1]).backward()
        g = {n: p.grad.clone() for n, p in model.named_parameters()}
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in g.values()))
        for n in total:
            total[n] += g[n] * min(1.0, clip / norm)
    return {n: p.detach() - 0.1 * total[n] / 4 for n, p in model.named_parameters()}


@pytest.mark.parametrize("clip", [1e6, 0.05])
def test_a_step_is_the_mean_of_the_clipped_per_example_gradients(clip):
    model, x, y = toy()
    want = by_hand(model, x, y, clip)
    step(model, x, y, clip, noise=0.0)
    for n, p in model.named_parameters():
        assert torch.allclose(p, want[n], atol=1e-6), n
    if clip > 1:  # unclipped: plain SGD on the batch's mean loss
        model2, x, y = toy()
        F.cross_entropy(model2(x), y).backward()
        for p, q in zip(model.parameters(), model2.parameters(), strict=True):
            assert torch.allclose(p, q.detach() - 0.1 * q.grad, atol=1e-6)


def test_the_noise_is_the_seeded_gaussian_of_sd_multiplier_x_clip_over_the_batch():
    model, x, y = toy()
    step(model, x, y, clip=0.05, noise=0.0)
    noisy, _, _ = toy()
    step(noisy, x, y, clip=0.05, noise=2.0)
    gen = torch.Generator().manual_seed(5)
    torch.rand(4, generator=gen)  # the Poisson draw comes first
    for p, q in zip(model.parameters(), noisy.parameters(), strict=True):
        noise = seeding.randn(p.numel(), generator=gen).view(p.shape) * 2.0 * 0.05
        assert torch.allclose(q - p, -0.1 * noise / 4, atol=1e-6)


def test_poisson_batches_vary_in_size_around_the_batch_size():
    gen = torch.Generator().manual_seed(0)
    sizes = [int((torch.rand(1000, generator=gen) < 0.01).sum()) for _ in range(300)]
    assert len(set(sizes)) > 5 and abs(sum(sizes) / len(sizes) - 10) < 1


# Every architecture of the zoo (the deepest ResNets share resnet18's layers: left out for time).
ENCODERS = [
    "cnn1", "cnn4", "cnn8", "fedavgcnn", "fedgh_cnn1", "fedhenn_cnn3", "shallowcnn", "alexnet",
    "googlenet", "mobilenetv2", "shufflenetv2", "resnet4", "resnet10", "resnet18",
]  # fmt: skip


@pytest.mark.parametrize("encoder", ENCODERS)
def test_dpsgd_trains_every_architecture_with_its_batchnorm_replaced(encoder):
    torch.manual_seed(0)
    model = build_client_model(encoder, (1, 28, 28), 4, 16)
    dpsgd.replace_batchnorm(model)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    before = [p.detach().clone() for p in model.parameters()]
    x, y = torch.randn(3, 1, 28, 28), torch.tensor([0, 1, 3])
    model.train()
    dpsgd.private_epochs(
        list(model.parameters()),
        lambda a, b: F.cross_entropy(model(a), b),
        lambda pos: (x[pos], y[pos]),
        n=3,
        epochs=1,
        batch_size=3,
        clip=1.0,
        noise_multiplier=0.5,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        gen=torch.Generator().manual_seed(0),
        modules=(model,),
    )
    after = list(model.parameters())
    assert all(torch.isfinite(p).all() for p in after)
    assert all(not torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_the_per_example_epsilon_is_dp_accountings_poisson_gaussian():
    import dp_accounting as dpa

    acc = dpa.rdp.RdpAccountant()
    acc.compose(dpa.PoissonSampledDpEvent(0.01, dpa.GaussianDpEvent(1.1)), 6000)
    want = acc.get_epsilon(1e-5)
    assert accountant.sample_epsilon("rdp", 1.1, 1e-5, 0.01, 6000) == pytest.approx(want)
    # PLD is tight, RDP an upper bound; more steps, more epsilon
    assert accountant.sample_epsilon("pld", 1.1, 1e-5, 0.01, 6000) <= want
    assert accountant.sample_epsilon("rdp", 1.1, 1e-5, 0.01, 12000) > want
    assert accountant.sample_epsilon("rdp", 1.1, 1e-5, 0.01, 0) == 0.0
    assert accountant.sample_epsilon("rdp", 0.0, 1e-5, 0.01, 5) == math.inf


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_every_method_trains_with_dpsgd_or_is_refused_with_its_reason(name):
    algo = ALGORITHMS.get(name)
    raw = tiny_raw(
        algorithm={"name": name},
        model={"family": "cnn1"},  # the zoo's architectures: the test above
        data=SMALL,  # the per-example gradients, [batch, parameters], are the step's cost
        train={"rounds": 1},
        privacy={"sample_clip": 1.0, "sample_noise_multiplier": 0.5},
        sim={"check_wire": False, "progress": False, "threads": 1, "backend": "serial"},
    )
    if not dpsgd.declares_per_example_loss(algo):
        with pytest.raises(ConfigError, match="per-example terms"):
            from_dict(raw)
        return
    plan = privacy.release_plan(algo.Upload)
    if plan.values or plan.fixed:  # an upload computed on the data needs the upload mechanism
        with pytest.raises(ConfigError, match="DP-SGD does not cover"):
            from_dict(raw)
        raw["privacy"] |= {"mechanism": "local", "noise_multiplier": 0.05}
    result = api.run(from_dict(raw))
    eps = result.rounds[-1]["epsilon_sample"]
    assert 0 < eps < math.inf, eps
    assert math.isfinite(result.rounds[-1]["acc_weighted"])


def test_the_privacy_page_names_the_methods_dpsgd_trains():
    import re
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    text = " ".join(page.split("DP-SGD (`sample_clip > 0`):", 1)[1].split("refused.")[0].split())
    alone_text, with_text = text.split(" alone;")
    alone = set(re.findall(r"[a-z_]+", alone_text.replace(" and ", ", ")))
    both = set(re.findall(r"[a-z_]+", with_text.split(" with an upload")[0].replace(" and ", ", ")))
    built_in = [n for n, c in ALGORITHMS.items() if c.__module__.startswith("fedmosaic.")]
    want_alone, want_both = set(), set()
    for n in built_in:
        algo = ALGORITHMS.get(n)
        if dpsgd.declares_per_example_loss(algo):
            plan = privacy.release_plan(algo.Upload)
            (want_both if plan.values or plan.fixed else want_alone).add(n)
    assert (alone, both) == (want_alone, want_both)
