"""The plain-text table `fedmosaic run` prints."""

import pytest

from fedmosaic.report.results import format_table


def _doc(name: str, acc: float, **summary) -> dict:
    final = {"acc_weighted": acc, "acc_mean": acc, "acc_std": 0.1}
    return {
        "config": {"algorithm": {"name": name}},
        "summary": {"final": final, "best_on_test": {"acc_weighted": acc, "round": 3}, **summary},
    }


def test_cost_column_only_where_a_method_counts_its_training_compute():
    plain = format_table([_doc("local", 0.5)])
    assert "train cost" not in plain and "local" in plain
    ft = {"acc_weighted": 0.9, "acc_mean": 0.8, "acc_std": 0.1}
    table = format_table(
        [
            _doc("fedseq_vanilla", 0.5, paper_cost_total=23.8e9, after_finetune=ft),
            _doc("local", 0.6),
        ]
    )
    lines = table.splitlines()
    assert lines[0].split()[-3:] == ["train", "cost", "(G)"]
    assert lines[2].split()[-1] == "23.8" and "+ fine-tune" in lines[3] and "90.00%" in lines[3]
    assert lines[4].split()[-1] == "-"  # local counts nothing


def test_kilobytes_are_1000_bytes_as_in_the_round_log():
    """20,776 bytes was "20.8 KB" in the round log and "20.3" in this table (/1024)."""
    from fedmosaic.report.summary import round_line

    table = format_table([_doc("lg_fedavg", 0.84, bytes_up_per_client_per_round=20776)])
    assert table.splitlines()[2].split()[-1] == "20.8"
    rec = {"round": 1, "seconds": 1.0, "bytes_up_per_client": 20776, "bytes_down_per_client": 0}
    assert "up 20.8 kB/client" in round_line("lg_fedavg", rec, 3)


def test_every_accuracy_a_method_reports_is_in_its_table():
    """FedProto's table showed its nearest-prototype accuracy (75.3%) only, not its heads'."""
    doc = _doc("fedproto", 0.753)
    doc["summary"]["final"] |= {
        "acc_head_weighted": 0.892,
        "acc_head_mean": 0.88,
        "acc_head_std": 0.05,
    }
    lines = format_table([doc]).splitlines()
    assert lines[2].split()[:2] == ["fedproto", "75.30%"]
    assert lines[3].split()[:3] == ["acc_head", "89.20%", "88.00%"]


def test_curve_is_in_percent_with_the_after_fine_tune_point(monkeypatch):
    """curve.png/curves.png plotted fractions and left out the after-fine-tune headline."""
    from fedmosaic.report import results

    figs = []
    monkeypatch.setattr(results, "save_figure", lambda fig, path: figs.append(fig))
    config = {
        "algorithm": {"name": "fedbabu"},
        "data": {"dataset": "fmnist", "num_clients": 4, "partition": "iid"},
        "model": {"family": "cnn1"},
    }
    doc = {
        "config": config,
        "rounds": [{"round": 1, "acc_weighted": 0.07}, {"round": 2, "acc_weighted": 0.26}],
        "summary": {"after_finetune": {"acc_weighted": 0.9}},
    }
    results.plot_curves({"fedbabu": doc}, "unused.png")
    ax = figs[0].axes[0]
    curve, star = ax.lines
    assert list(curve.get_ydata()) == pytest.approx([7.0, 26.0]) and "%" in ax.get_ylabel()
    assert (list(star.get_xdata()), list(star.get_ydata())) == ([2], [90.0])
    assert star.get_label() == "fedbabu after fine-tune" and star.get_marker() == "*"
    # FedProto: its heads' accuracy dashed beside the nearest-prototype curve
    figs.clear()
    proto = {
        "config": {**config, "algorithm": {"name": "fedproto"}},
        "rounds": [{"round": 1, "acc_weighted": 0.5, "acc_head_weighted": 0.6}],
        "summary": {"final": {"acc_weighted": 0.5, "acc_head_weighted": 0.6}},
    }
    results.plot_curves({"fedproto": proto}, "unused.png")
    curve, head = figs[0].axes[0].lines
    assert head.get_label() == "fedproto acc_head" and list(head.get_ydata()) == [60.0]
