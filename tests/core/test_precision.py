"""``train.precision``: bf16 autocast of the local training forward; fp32 unchanged."""

from __future__ import annotations

import pytest
import torch
from helpers.experiments import tiny_raw

from fedmosaic.accel import batched
from fedmosaic.config import from_dict
from fedmosaic.core.algorithm import Phase
from fedmosaic.core.training import run_phases
from fedmosaic.experiment import build_federation, run_experiment


def _fed(**train):
    raw = tiny_raw(
        model={"family": "cnn1", "feature_dim": 16}, algorithm={"name": "local"}, train=train
    )
    return build_federation(from_dict(raw))


def _epoch_losses(fed, cid, epochs):
    gen = torch.Generator().manual_seed(0)
    model, extras, data = fed.models[cid], fed.extras[cid], fed.clients[cid]
    return [
        run_phases(fed.algo, model, extras, None, data, [Phase()], fed.settings, gen).mean_loss
        for _ in range(epochs)
    ]


def test_bf16_runs_in_bfloat16_and_learns():
    fed = _fed(precision="bf16", lr=0.1)
    dtypes = []
    head = fed.models[2].head
    hook = head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    losses = _epoch_losses(fed, 2, 6)
    hook.remove()
    assert set(dtypes) == {torch.bfloat16}  # the forward ran under autocast
    assert all(p.dtype == torch.float32 for p in fed.models[2].parameters())  # master weights
    assert losses[-1] < 0.1 * losses[0], losses  # measured 1.16 -> 0.006 (fp32: the same)


@pytest.mark.golden
def test_fp32_is_the_default_and_bitwise_unchanged():
    def numbers(**train):
        raw = tiny_raw(train=train, sim={"threads": 1})
        doc = run_experiment(from_dict(raw), progress=False)
        return [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in doc["rounds"]]

    assert _fed().settings.precision == "fp32"
    # Asking for fp32 is the default config itself (the numbers are pinned by the golden tests).
    assert from_dict(tiny_raw(train={"precision": "fp32"})).train == from_dict(tiny_raw()).train
    dtypes = []
    fed = _fed()
    fed.models[0].head.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    _epoch_losses(fed, 0, 1)
    assert set(dtypes) == {torch.float32}


@pytest.mark.integration
def test_bf16_batched_clients_learn():
    fed = _fed(precision="bf16", lr=0.1, local_epochs=3)
    one = _fed(precision="bf16", lr=0.1, local_epochs=3)
    msgs = [fed.algo.broadcast(None, c, 1) for c in range(4)]
    res = batched.fit_group(
        fed.algo, fed.models, fed.extras, msgs, fed.clients, fed.settings, 0, 1, 3
    )
    from fedmosaic.core import client as client_ops

    seq = [
        client_ops.fit(one.algo, m, e, msg, d, one.settings, 0, 1, 3)
        for m, e, msg, d in zip(one.models, one.extras, msgs, one.clients)
    ]
    for a, b in zip(seq, res):
        assert abs(a.stats.mean_loss - b.stats.mean_loss) < 0.05  # bf16 rounding, not equality
    # three epochs' mean loss well below the untrained ~log 4 = 1.39 (measured 0.48-0.71)
    assert max(r.stats.mean_loss for r in res) < 0.9
