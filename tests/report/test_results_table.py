"""The plain-text table `fedmosaic run` prints."""

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
