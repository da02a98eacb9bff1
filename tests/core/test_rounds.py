import math

import pytest

from fedmosaic.core.rounds import EvalResult, sample_clients, summarize_eval
from fedmosaic.metrics import aggregate_accuracy


def test_sampling_is_seeded_and_distinct():
    a = sample_clients(0, 3, 100, 10)
    assert a == sample_clients(0, 3, 100, 10)
    assert a != sample_clients(0, 4, 100, 10)
    assert len(set(a)) == 10 and a == sorted(a)
    assert sample_clients(0, 1, 5, 5) == [0, 1, 2, 3, 4]


def test_aggregate_accuracy_exact():
    s = aggregate_accuracy([9, 1, 0], [10, 10, 0])  # third client has no test data
    assert s["weighted"] == pytest.approx(10 / 20)
    assert s["mean"] == pytest.approx(0.5)
    assert s["std"] == pytest.approx(0.4)
    assert (s["min"], s["max"]) == (0.1, 0.9)


def test_summarize_eval_weighted_and_unweighted():
    res = [
        EvalResult(0, {"test": {"n": 10, "acc": 5, "acc_head": 6}, "val": {"n": 2, "acc": 2}}),
        EvalResult(1, {"test": {"n": 30, "acc": 30, "acc_head": 3}, "val": {"n": 2, "acc": 0}}),
    ]
    rec = summarize_eval(res)
    assert rec["acc_weighted"] == pytest.approx(35 / 40)
    assert rec["acc_mean"] == pytest.approx(0.75)
    assert rec["acc_head_weighted"] == pytest.approx(9 / 40)
    assert rec["val_acc_weighted"] == pytest.approx(0.5)
    assert math.isclose(rec["acc_std"], 0.25)
