"""Secure aggregation (``core/secure.py``): Flower's quantization by hand, the sums every method
declares against its own aggregation (parametrized over the registry), the config's refusals,
and secure runs on the simulator against unmasked ones."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from helpers.experiments import tiny_raw
from torch import Tensor

from fedmosaic import api
from fedmosaic.algorithms import ALGORITHMS, build_algorithm
from fedmosaic.config import ConfigError, from_dict
from fedmosaic.core import secure
from fedmosaic.core.algorithm import Algorithm, Weighted
from fedmosaic.core.rounds import FitResult
from fedmosaic.experiment import run_experiment

torch.set_num_threads(1)

SUMMING = [n for n in ALGORITHMS.names() if not secure.refusal(ALGORITHMS.get(n))]
REFUSED = [n for n in ALGORITHMS.names() if secure.refusal(ALGORITHMS.get(n))]


# ---- the arithmetic by hand ---------------------------------------------------------------------
def test_levels_leave_room_for_the_sum_of_every_client():
    assert secure.levels(1) == 2**31
    assert secure.levels(3) == 2**30  # 3 * 2^30 < 2^32; 3 * 2^31 is not
    assert secure.levels(20) == 2**27
    for k in range(1, 200):
        t = secure.levels(k)
        assert k * t < 2**32 <= k * 2 * t


def test_quantization_is_exact_on_the_grid_and_unbiased_between():
    sf = secure.SecureForm(scale=1.0, bound=8.0, levels=2**4, seed=0)  # a step of 1
    # -8, 0, 1.0 and 8 sit on the grid: 0, 8, 9, 16 whatever the draw
    q = secure.quantize([np.array([-8.0, 0.0, 1.0, 8.0, 20.0])], sf, rng_seed=3)[0]
    assert q.tolist() == [0, 8, 9, 16, 16]  # 20 is outside: clipped (client_vector refuses it)
    # 0.25 above a level: rounded up a quarter of the time
    many = secure.quantize([np.full(40000, 0.25)], sf, rng_seed=5)[0]
    assert set(many.tolist()) == {8, 9}
    assert abs((many == 9).mean() - 0.25) < 0.01


def test_the_sum_is_recovered_from_the_quantized_sum():
    sf = secure.SecureForm(scale=1.0, bound=8.0, levels=secure.levels(3), seed=0)
    xs = [np.array([0.5, -1.25, 3.0]), np.array([0.25, 0.0, -8.0]), np.array([1.0, 2.0, 4.0])]
    total = sum(secure.quantize([x], sf, rng_seed=i)[0].astype(np.int64) for i, x in enumerate(xs))
    got = secure.unquantize([total], 3, sf)[0]
    np.testing.assert_allclose(got, np.sum(xs, axis=0), atol=3 * 2 * sf.bound / sf.levels)


def test_a_summand_outside_the_range_or_not_finite_is_refused_by_name():
    algo = build_algorithm({"name": "fedavg"})
    up = algo.Upload({"w": torch.tensor([9.0])})
    sf = secure.SecureForm(scale=1.0, bound=8.0, levels=2**20, seed=0)
    with pytest.raises(secure.SecureError, match=r"'state.w' reaches 9.*secagg_range = 8"):
        secure.client_vector(algo, up, 1.0, sf)
    with pytest.raises(secure.SecureError, match="non-finite"):
        secure.client_vector(algo, algo.Upload({"w": torch.tensor([math.nan])}), 1.0, sf)
    # weights are scaled by the public scale, so a large example count stays in range
    names, arrays = secure.client_vector(
        algo, algo.Upload({"w": torch.tensor([4.0])}), 300.0, dataclasses.replace(sf, scale=600.0)
    )
    assert names == ["state.w", "weight"] and [a.tolist() for a in arrays] == [[2.0], [0.5]]


def test_emulate_leaves_out_the_client_it_cannot_carry_and_sums_the_others():
    algo = build_algorithm({"name": "fedavg"})
    results = [
        FitResult(0, algo.Upload({"w": torch.tensor([1.0, 2.0])}), 10, 0, 0),
        FitResult(1, algo.Upload({"w": torch.tensor([100.0, 0.0])}), 10, 0, 0),  # out of range
        FitResult(2, algo.Upload({"w": torch.tensor([3.0, -2.0])}), 30, 0, 0),
        FitResult(3, None, 0, 0, 0, error="lost"),
    ]
    sf = secure.form(0, 8.0, 4, scale=30.0)
    got = secure.emulate(algo, results, sf, round_num=1)
    assert got is not None and got.clients == (0, 2)
    assert "secagg_range" in (results[1].error or "")
    tol = 4 * 2 * sf.bound / sf.levels
    assert got.sums["weight"].tolist() == pytest.approx([40 / 30], abs=tol)
    assert got.sums["state.w"].tolist() == pytest.approx([(10 + 90) / 30, (20 - 60) / 30], abs=tol)
    assert results[0].bytes_up == 8 * (1 + 1 + 2)  # the masked vector: int64 entries + factor


# ---- every method's sums give its own aggregation -----------------------------------------------
def _tensors(obj: Any, path: str = "") -> Iterator[tuple[str, Tensor]]:
    if isinstance(obj, Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{path}.{k}")
    elif dataclasses.is_dataclass(obj):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), f"{path}.{f.name}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{path}[{i}]")


def _captured_rounds(name: str, monkeypatch) -> list[tuple[Algorithm, Any, list[Weighted], int]]:
    cls = ALGORITHMS.get(name)
    calls: list[tuple[Algorithm, Any, list[Weighted], int]] = []
    real = cls.aggregate

    def spy(self, state, uploads, round_num):
        calls.append((self, state, list(uploads), round_num))
        return real(self, state, uploads, round_num)

    monkeypatch.setattr(cls, "aggregate", spy)
    family = "htfe8-gray" if cls.supports_heterogeneous else "cnn1"
    run_experiment(from_dict(tiny_raw(model={"family": family}, algorithm={"name": name})), False)
    monkeypatch.undo()  # the comparisons below call the method's own aggregate
    return calls


@pytest.mark.parametrize("name", SUMMING)
def test_the_declared_sums_give_the_methods_own_aggregate(name, monkeypatch):
    calls = _captured_rounds(name, monkeypatch)
    assert len(calls) == 2
    for algo, state, uploads, round_num in calls:
        scale = max(u.weight for u in uploads)
        terms = [algo.summands(u.payload, u.weight / scale) for u in uploads]
        assert all(t is not None for t in terms)
        sums = {k: sum(t[k] for t in terms) for k in terms[0]}  # exact, float64
        rebuilt = algo.from_sums(state, sums, round_num)
        want = algo.aggregate(state, uploads, round_num)
        got = algo.aggregate(state, [rebuilt], round_num)
        pairs = dict(_tensors(got))
        checked = 0
        for path, w in _tensors(want):
            g = pairs[path]
            if w.is_floating_point():
                err = float((g.double() - w.double()).abs().max()) if w.numel() else 0.0
                assert err <= 1e-6 + 1e-5 * float(w.abs().max()), (name, path, err)
                checked += 1
            # integer buffers: the server's own (state_from_terms), not the clients' largest
        assert checked > 0, name


@pytest.mark.parametrize("name", SUMMING)
def test_a_method_that_aggregates_its_own_way_does_not_inherit_the_sums(name):
    cls = ALGORITHMS.get(name)

    class Changed(cls):  # type: ignore[misc, valid-type]
        def aggregate(self, state, uploads, round_num):
            return state

    Changed.__name__ = f"Changed{cls.__name__}"
    assert "aggregates in its own way" in secure.refusal(Changed())


# ---- the config ---------------------------------------------------------------------------------
def _secure_raw(name: str = "fedavg", **sections: dict[str, Any]) -> dict[str, Any]:
    raw = tiny_raw(algorithm={"name": name}, **sections)
    raw.setdefault("privacy", {})["secure_aggregation"] = True
    raw["sim"] = {**raw.get("sim", {}), "threads": 1, "progress": False}
    return raw


@pytest.mark.parametrize("name", REFUSED)
def test_methods_whose_server_needs_each_upload_are_refused_with_their_reason(name):
    with pytest.raises(ConfigError, match=f"secure_aggregation is not available for '{name}': "):
        from_dict(_secure_raw(name))


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"privacy": {"mechanism": "central"}}, 'use privacy.mechanism = "local"'),
        ({"server": {"aggregator": "median"}}, 'aggregator = "median"'),
        ({"train": {"clients_per_round": 1}}, "at least 2 clients a round"),
        ({"privacy": {"secagg_range": 0}}, r"secagg_range = 0(\.0)? must be > 0"),
        ({"privacy": {"secagg_shares": 1.5}}, r"secagg_shares = 1.5 must be in \(0, 1\]"),
        ({"privacy": {"secagg_threshold": math.nan}}, "must be a finite number"),
        (
            {"privacy": {"secure_aggregation": 1}},
            "secure_aggregation = 1 has type int, expected bool",
        ),
    ],
)
def test_what_secure_aggregation_cannot_do_is_refused_in_one_line(sections, message):
    raw = _secure_raw(**{k: v for k, v in sections.items() if k != "privacy"})
    raw["privacy"].update(sections.get("privacy", {}))
    with pytest.raises(ConfigError, match=message):
        from_dict(raw)


# ---- runs ---------------------------------------------------------------------------------------
def _run(name: str, secure_on: bool, **privacy: Any) -> list[dict[str, Any]]:
    raw = tiny_raw(algorithm={"name": name}, sim={"threads": 1, "progress": False})
    raw["privacy"] = {"secure_aggregation": secure_on, **privacy}
    return api.run(from_dict(raw)).rounds


@pytest.mark.parametrize("name", ["fedavg", "lg_fedavg", "fedproto"])
def test_a_secure_run_gives_the_unmasked_numbers_to_the_quantization_step(name):
    plain, masked = _run(name, False), _run(name, True)
    for p, m in zip(plain, masked, strict=True):
        assert m["participants"] == p["participants"] and m["rejected"] == []
        assert m["train_loss"] == pytest.approx(p["train_loss"], rel=1e-4)
        assert m["acc_weighted"] == pytest.approx(p["acc_weighted"], abs=0.02)
        assert m["bytes_up"] != p["bytes_up"]  # masked vectors, not the uploads


def test_a_secure_run_is_the_same_on_every_backend():
    serial = _run("fedproto", True)
    keys = ("acc_weighted", "train_loss", "bytes_up")
    raw = tiny_raw(
        algorithm={"name": "fedproto"},
        sim={"threads": 1, "progress": False, "backend": "processes", "workers": 2},
    )
    raw["privacy"] = {"secure_aggregation": True}
    procs = api.run(from_dict(raw)).rounds
    assert [[r[k] for k in keys] for r in serial] == [[r[k] for k in keys] for r in procs]


def test_a_client_outside_the_range_is_left_out_and_named(caplog):
    rounds = _run("fedavg", True, secagg_range=1e-3)
    assert all(not r["aggregated"] and r["participants"] == [] for r in rounds)
    assert "secagg_range" in caplog.text


def test_local_noise_and_secure_aggregation_compose():
    rounds = _run("fedavg", True, mechanism="local", clip=1.0, noise_multiplier=0.05)
    assert all(r["aggregated"] for r in rounds)
    assert 0 < rounds[0]["epsilon"] < rounds[1]["epsilon"] < math.inf


def test_the_privacy_page_lists_every_method_with_its_secure_aggregation():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    section = page.split("## Secure aggregation", 1)[1].split("\n## ", 1)[0]
    listed: dict[str, str] = {}
    for row in [line for line in section.splitlines() if line.startswith("| ")][1:]:
        names, said = (c.strip() for c in row.strip("|").split("|"))
        for n in names.split(","):
            listed[n.strip()] = said
    built_in = [n for n, c in ALGORITHMS.items() if c.__module__.startswith("fedmosaic.")]
    want = {}
    for n in built_in:
        why = secure.refusal(ALGORITHMS.get(n))
        want[n] = f"refused: {why}" if why else "yes"
    assert listed == want
