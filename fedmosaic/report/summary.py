"""What a finished run reports: ``results.json``'s summary, per-client records, the round line.

The same for every runtime (simulator, process backend, Flower): each hands the round loop's
:class:`History` here with what the report says about the federation (its config, clients, their
architectures and the data), not the federation itself.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import fedmosaic
from fedmosaic import provenance
from fedmosaic.config import ExperimentConfig
from fedmosaic.core import membership
from fedmosaic.core.client import ClientData
from fedmosaic.core.rounds import EvalResult, History, per_client_acc, summarize_eval
from fedmosaic.data import FederatedData


def summarize(history: History) -> dict[str, Any]:
    """Final, best-on-validation and best-on-test (as the papers report it) accuracies."""
    rounds = [r for r in history.rounds if "acc_weighted" in r]
    summary: dict[str, Any] = {}
    if not rounds:
        return summary
    last = rounds[-1]
    summary["final"] = {k: last[k] for k in last if k.startswith("acc") or k.endswith("_weighted")}
    summary["final"]["round"] = last["round"]
    summary["rounds_run"] = int(history.rounds[-1]["round"])
    if history.rounds[-1].get("plateau"):
        # train.plateau_delta: the run stopped before its cap (train.rounds) on a plateau
        summary["stopped_on_plateau"] = summary["rounds_run"]
    best_test = max(rounds, key=lambda r: r["acc_weighted"])
    summary["best_on_test"] = {
        "note": "max over evaluated rounds of test accuracy, as the papers report it",
        "round": best_test["round"],
        "acc_weighted": best_test["acc_weighted"],
        "acc_mean": best_test["acc_mean"],
    }
    if "val_acc_weighted" in last:
        best_val = max(rounds, key=lambda r: r["val_acc_weighted"])
        summary["best_on_val"] = {
            "note": "test accuracy at the round with the best validation accuracy",
            "round": best_val["round"],
            "val_acc_weighted": best_val["val_acc_weighted"],
            "acc_weighted": best_val["acc_weighted"],
            "acc_mean": best_val["acc_mean"],
        }
    if "mia_auc" in last:  # eval.membership: the attack on the last evaluated models
        summary["membership"] = {
            "note": "loss-threshold membership attack on each client's evaluated model, its "
            "training split against its test split; means over clients (mia_tpr: at 1% false "
            "positives; mia_auc_max: the most exposed client); mia_upload_*: the same attack on "
            "the models the server rebuilds from the last round's uploads, where they are whole "
            "models",
            "round": last["round"],
            **{k: last[k] for k in ("mia_auc", "mia_auc_max", "mia_tpr", "mia_clients")},
        }
        final = history.rounds[-1]
        for k in ("mia_upload_auc", "mia_upload_auc_max", "mia_upload_tpr", "mia_upload_clients"):
            if k in final:
                summary["membership"][k] = final[k]
    for key in ("epsilon", "epsilon_sample"):  # [privacy]: the budget spent, at privacy.delta
        if key in history.rounds[-1]:
            summary[key] = history.rounds[-1][key]
    lost = sum(1 for r in history.rounds if r.get("diverged"))
    if lost:  # train.stop_on_divergence = false: rounds where no client had a finite loss
        summary["diverged_rounds"] = lost
    secs = [r["seconds"] for r in history.rounds]
    summary["seconds_per_round"] = sum(secs) / len(secs)
    summary["bytes_up_per_client_per_round"] = sum(
        r["bytes_up_per_client"] for r in history.rounds
    ) / len(history.rounds)
    summary["bytes_down_per_client_per_round"] = sum(
        r["bytes_down_per_client"] for r in history.rounds
    ) / len(history.rounds)
    for key in ("paper_cost", "train_macs"):
        if any(key in r for r in history.rounds):
            # Training compute summed over clients and rounds: ``paper_cost`` is the layer-expansion
            # paper's Table 4 measure (trainable parameters x examples, which it calls FLOPs),
            # ``train_macs`` the forward + backward multiply-accumulates (``models/flops.py``).
            summary[f"{key}_total"] = sum(r.get(key, 0) for r in history.rounds)
    served = [r for r in rounds if "server_acc" in r]
    if served:  # data.server_eval_size, where the method holds a global model
        summary["server_evaluated"] = {
            "note": "the server's global model on its own held-out split (data.server_eval_size), "
            "computed by the server; every other accuracy here is client-evaluated",
            "round": served[-1]["round"],
            "server_acc": served[-1]["server_acc"],
            "server_loss": served[-1]["server_loss"],
        }
    if history.finetune_eval:
        summary["after_finetune"] = summarize_eval(history.finetune_eval)
    if history.holdout_before:
        summary["holdout"] = {
            "note": "clients that never trained: on the final broadcast (before) and after one "
            "local round of the method's own client procedure (after)",
            "clients": sorted(r.client_id for r in history.holdout_before),
            "before": summarize_eval(history.holdout_before),
            "after": summarize_eval(history.holdout_after),
        }
    return summary


def client_records(
    clients: Sequence[ClientData],
    members: Sequence[str],
    shifts: Sequence[dict[str, float]],
    history: History,
) -> list[dict[str, Any]]:
    """One record per client: its architecture (``members[cid]``), split sizes, label counts,
    feature shift (``shifts[cid]``, when the data has any) and final accuracies."""
    final = {r.client_id: r for r in history.final_eval}
    tuned = {r.client_id: r for r in history.finetune_eval}
    held_before = {r.client_id: r for r in history.holdout_before}
    held_after = {r.client_id: r for r in history.holdout_after}
    recs = []
    for c in clients:
        rec: dict[str, Any] = {
            "client_id": c.client_id,
            "arch": members[c.client_id],
            "num_train": c.num_train,
            "num_val": c.num("val"),
            "num_test": c.num("test"),
            "train_label_counts": c.class_counts("train").tolist(),
            "test_label_counts": c.class_counts("test").tolist(),
        }
        if shifts:  # feature shift: this client's transform (data.shift_*)
            rec["feature_shift"] = shifts[c.client_id]
        if c.client_id in final:
            rec.update(_client_accs(final[c.client_id], ""))
        if c.client_id in tuned:
            rec.update(_client_accs(tuned[c.client_id], "finetuned_"))
        if c.client_id in held_before:
            rec["holdout"] = True
            rec.update(_client_accs(held_before[c.client_id], "newcomer_before_"))
            rec.update(_client_accs(held_after[c.client_id], "newcomer_after_"))
        recs.append(rec)
    return recs


def _client_accs(r: EvalResult, prefix: str) -> dict[str, float]:
    out = {prefix + k: v for k, v in membership.client_scores(r.counts).items()}
    for split, counts in r.counts.items():
        if split in membership.SPLITS:
            continue
        n = counts.get("n", 0)
        for mode, correct in counts.items():
            if mode == "n":
                continue
            key = mode if split == "test" else f"{split}_{mode}"
            out[prefix + key] = correct / n if n else math.nan
    return out


def round_line(name: str, rec: dict[str, Any], rounds: int) -> str:
    """One log line per round (when no progress bar is shown): accuracy, loss, time, bytes."""
    acc = f"acc {100 * rec['acc_weighted']:.2f}%" if "acc_weighted" in rec else "acc -"
    loss = rec.get("train_loss", math.nan)
    return (
        f"{name} round {rec['round']}/{rounds}: {acc}, loss {loss:.4f}, {rec['seconds']:.1f} s, "
        f"up {rec['bytes_up_per_client'] / 1e3:.1f} kB/client, "
        f"down {rec['bytes_down_per_client'] / 1e3:.1f} kB/client"
        + (f", server acc {100 * rec['server_acc']:.2f}%" if "server_acc" in rec else "")
        + (f", epsilon {rec['epsilon']:.3g}" if "epsilon" in rec else "")
        + (f", attack AUC {rec['mia_auc']:.3f}" if "mia_auc" in rec else "")
        + (f", rejected {rec['rejected']}" if rec.get("rejected") else "")
    )


class FinetuneLines:
    """The fine-tuning's progress when no progress bar is shown: a line when it starts, one per
    ``step`` clients (a tenth of them by default; not within ``min_seconds`` of the previous
    line, so a fine-tuning of a few seconds prints two lines) and one at the end, each with the
    time so far and the ETA. Called as ``on_finetune(done, total)`` by a transport
    (``set_progress``)."""

    def __init__(
        self, name: str, emit: Callable[[str], None], step: int = 0, min_seconds: float = 2.0
    ) -> None:
        self.name, self.emit, self.step, self.min_seconds = name, emit, step, min_seconds
        self.started = self.last = time.perf_counter()

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done == 0:
            self.started = self.last = now
            self.emit(f"{self.name} fine-tune: {total} clients, each fine-tunes its model locally")
            return
        step = self.step or max(1, math.ceil(total / 10))
        if done != total and (done % step or now - self.last < self.min_seconds):
            return
        self.last = now
        took = now - self.started
        eta = took / done * (total - done)
        self.emit(
            f"{self.name} fine-tune: clients {done}/{total}, {took:.1f} s"
            + (f", ETA {eta:.0f} s" if done < total else "")
        )


def results_document(
    cfg: ExperimentConfig,
    data: FederatedData,
    clients: Sequence[ClientData],
    members: Sequence[str],
    history: History,
    wall_seconds: float,
    started: str | None = None,
    workers: int | None = None,
) -> dict[str, Any]:
    """The ``results.json`` document of a finished run (any runtime): ``data`` is the run's
    federated data, ``clients`` its clients and ``members[cid]`` each one's architecture."""
    ds = data.dataset
    return {
        "library": {"name": "fedmosaic", "version": fedmosaic.__version__},
        "environment": {"python": platform.python_version(), "torch": torch.__version__},
        "seed": cfg.seed,
        "config": cfg.to_dict(),
        "rounds": history.rounds,
        "clients": client_records(clients, members, data.shifts, history),
        "per_client_final_acc": per_client_acc(history.final_eval),
        "summary": summarize(history),
        "wall_seconds": wall_seconds,
        "provenance": provenance.provenance(ds.sources, ds.images, ds.labels, started, workers),
    }
