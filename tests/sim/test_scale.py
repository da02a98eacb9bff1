"""Cross-device scale: what a 10,000-client federation on the serial backend holds and builds is
counted, not timed. Building it builds no client model; a round builds at most its participants;
a client evaluated before is read from the state store, not built again; the per-client data
index is the only per-client memory besides the store."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.experiments import tiny_raw

from fedmosaic.config import from_dict
from fedmosaic.core import rounds, seeding
from fedmosaic.core.model import ClientModel
from fedmosaic.data.partition import partition
from fedmosaic.federation import build_federation
from fedmosaic.sim.backend import Runtime, make_transport
from fedmosaic.sim.host import MAX_SPARES

N = 10_000
K = 100  # 1% per round


def scale_raw(offload: str) -> dict:
    """10,000 clients of one small CNN on tiny synthetic images (4 rows each at least),
    quantity-skewed like ``configs/cross_device_10k.toml``, 1% per round."""
    return tiny_raw(
        data={
            "synthetic_shape": [1, 8, 8],
            "synthetic_size": 6 * N,
            "partition": "quantity_power_law",
            "power_law_exponent": 0.5,
            "min_size": 4,
            "num_clients": N,
            "public_size": 0,
        },
        model={"family": "fedhenn_cnn2", "feature_dim": 8},
        train={"rounds": 2, "participation": 0.01},
        sim={"offload_clients": offload, "backend": "serial", "threads": 1, "check_wire": False},
    )


@pytest.fixture
def constructions(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts ClientModel constructions: ``count[0]``."""
    count = [0]
    original = ClientModel.__init__

    def counting(self: ClientModel, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        count[0] += 1

    monkeypatch.setattr(ClientModel, "__init__", counting)
    return count


def test_ten_thousand_clients_build_models_only_for_participants(constructions: list[int]):
    cfg = from_dict(scale_raw("on"))
    fed = build_federation(cfg, offload=None)
    assert fed.offload and constructions[0] == 0
    assert fed.plan.clients_per_round == K
    transport = make_transport(fed, Runtime("serial", 1, 1, "test"))
    try:
        state = fed.algo.init_server(fed.spec)
        trained: set[int] = set()
        for t in (1, 2):
            constructions[0] = 0
            sampled = rounds.sample_round(fed.spec, fed.plan, t)
            results = transport.fit(t, rounds.broadcast(fed.algo, state, sampled, t))
            assert [r.client_id for r in results] == sampled
            fresh = set(sampled) - trained
            # a client trained before is read into a spare module, a new one is built
            assert constructions[0] <= len(fresh) + MAX_SPARES
            assert constructions[0] >= len(fresh)  # the count can fail: new clients are built
            trained |= set(sampled)
        host = transport.host
        assert host is not None and not host.live  # nobody held between rounds
        assert sum(len(s) for s in host.spare.values()) <= MAX_SPARES
        stored = {int(p.stem) for p in host.store.root.glob("*.bin")}
        assert stored == trained  # the store holds the clients that trained, no others
        # Evaluating 500 clients, most never trained: each new one is built once (its initial
        # state is its construction) and stored; evaluated again, all are read into a spare.
        some = sorted(trained)[:50] + [c for c in range(N) if c not in trained][:450]
        msgs = rounds.broadcast(fed.algo, state, some, 3)
        constructions[0] = 0
        assert len(transport.evaluate(2, msgs)) == 500
        assert 450 <= constructions[0] <= 450 + MAX_SPARES
        assert {int(p.stem) for p in host.store.root.glob("*.bin")} == trained | set(some)
        transport.invalidate()  # no cached counts: evaluate for real
        constructions[0] = 0
        assert len(transport.evaluate(2, msgs)) == 500
        assert constructions[0] == 0 and not host.live
    finally:
        transport.close()


def test_the_per_client_memory_is_the_data_index():
    """Per client the federation holds its index rows (int64) and small fixed records, nothing
    that grows with the model: the bytes of every tensor it holds per client, counted."""
    fed = build_federation(from_dict(scale_raw("on")), offload=None)
    assert not fed.models and not fed.extras
    per_client = 0
    for split in fed.data.clients:
        per_client += sum(
            t.numel() * t.element_size() for t in (split.train, split.val, split.test)
        )
    rows = sum(len(split) for split in fed.data.clients)
    assert per_client == 8 * rows  # one int64 per row a client holds, nothing else
    assert len(fed.clients) == N and len(fed.spec.num_train) == N


def test_partitioning_ten_thousand_clients_draws_once_per_client(monkeypatch: pytest.MonkeyPatch):
    """The quantity-skew partitioners are vectorized over clients: the power-law split of
    10,000 clients (IID labels) draws one permutation of the clients and one of the rows,
    however many clients there are; with Dirichlet labels one draw per client and pass."""
    labels = np.random.default_rng(0).integers(0, 10, size=6 * N)
    calls: dict[str, int] = {}

    class Counting:
        def __init__(self, rng: np.random.Generator) -> None:
            self.rng = rng

        def __getattr__(self, name: str) -> object:
            calls[name] = calls.get(name, 0) + 1
            return getattr(self.rng, name)

    rng = seeding.numpy_rng(0, 0, 0, "test")

    def split(**labels_kw: object) -> list[np.ndarray]:
        calls.clear()
        return partition(
            "quantity_power_law",
            labels,
            N,
            Counting(rng),  # type: ignore[arg-type]
            power_law_exponent=0.5,
            min_size=4,
            **labels_kw,  # type: ignore[arg-type]
        )

    shares = split(quantity_labels="iid")
    assert len(shares) == N and sum(s.size for s in shares) == labels.size
    assert min(s.size for s in shares) >= 4
    assert calls == {"permutation": 2}
    shares = split(quantity_labels="dirichlet", alpha=0.5)
    assert sum(s.size for s in shares) == labels.size
    assert calls["dirichlet"] == N and calls["multinomial"] < 2 * N


def test_seed_torch_draws_torch_manual_seeds_stream(monkeypatch: pytest.MonkeyPatch):
    """``seed_torch`` seeds only the CPU generator on a machine without another device (no
    lazily queued device seeds, each of which recorded a traceback): the same global stream as
    ``torch.manual_seed``; with a device present it goes through ``torch.manual_seed``."""
    import torch

    torch.manual_seed(seeding.derive(0, 3, 7, "fit"))
    want = torch.rand(5)
    original = torch.manual_seed
    calls: list[int] = []

    def counting(s: int) -> torch.Generator:
        calls.append(s)
        return original(s)

    for cpu_only in (True, False):
        monkeypatch.setattr(seeding, "_cpu_only", cpu_only)
        monkeypatch.setattr(torch, "manual_seed", counting)
        calls.clear()
        torch.rand(3)  # move the stream on: the seed must reset it
        seeding.seed_torch(0, 3, 7, "fit")
        assert torch.equal(torch.rand(5), want)
        assert len(calls) == (0 if cpu_only else 1)


def test_the_shipped_cross_device_config_samples_one_percent():
    """``configs/cross_device_10k.toml`` parses and plans 100 of 10,000 clients a round."""
    from importlib import resources

    from fedmosaic.config import load
    from fedmosaic.federation import round_plan

    cfg = load(str(resources.files("fedmosaic") / "configs" / "cross_device_10k.toml"), [])
    assert cfg.data.num_clients == N and cfg.data.partition == "quantity_power_law"
    plan = round_plan(cfg, cfg.data.num_clients)
    assert plan.clients_per_round == K and plan.eval_every == 50
