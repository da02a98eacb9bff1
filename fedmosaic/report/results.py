"""The results store: ``results.json``, a CSV of the rounds, a learning-curve figure, text tables."""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROUND_COLUMNS = (
    "round",
    "acc_weighted",
    "acc_mean",
    "acc_std",
    "acc_min",
    "acc_max",
    "val_acc_weighted",
    "train_loss",
    "bytes_up",
    "bytes_down",
    "bytes_up_per_client",
    "bytes_down_per_client",
    "seconds",
    "seconds_train",
    "seconds_aggregate",
    "seconds_eval",
)


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # JSON has no NaN
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj


FIGURE_DPI = 150  # every PNG the library writes (run, compare and prototype figures)


def save_figure(fig: Any, path: str | Path) -> list[Path]:
    """``path`` as PNG (``FIGURE_DPI``) plus vector SVG and PDF beside it, for papers."""
    path = Path(path)
    paths = [path, path.with_suffix(".svg"), path.with_suffix(".pdf")]
    for p in paths:
        fig.savefig(p, bbox_inches="tight", dpi=FIGURE_DPI if p.suffix == ".png" else None)
    return paths


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write-then-rename so an interrupted write never leaves a half file behind."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(_jsonable(doc), indent=1, sort_keys=False))
    os.replace(tmp, path)


def write_results(out_dir: str | Path, doc: dict[str, Any], plot: bool = True) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "results.json", doc)
    rounds = doc.get("rounds", [])
    extra = sorted(
        {k for r in rounds for k in r if k.startswith("acc_head") or k.startswith("acc_proto")}
    )
    cols = [c for c in ROUND_COLUMNS if any(c in r for r in rounds)] + extra
    tmp = out / "rounds.csv.tmp"  # replaces the per-round file of the sink in one step
    with open(tmp, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(cols)
        for r in rounds:
            w.writerow([r.get(c, "") for c in cols])
    os.replace(tmp, out / "rounds.csv")
    if plot:
        plot_curves({doc["config"]["algorithm"]["name"]: doc}, out / "curve.png")
    return out


def plot_curves(docs: dict[str, dict[str, Any]], path: str | Path) -> None:
    """Test accuracy per round of each run: ``path`` (PNG) with SVG and PDF beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    for label, doc in docs.items():
        pts = [
            (r["round"], r["acc_weighted"])
            for r in doc["rounds"]
            if r.get("acc_weighted") is not None
        ]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="." if len(pts) < 40 else None, label=label)
    ax.set_xlabel("round")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_ylabel("test accuracy (weighted over clients)")
    ax.grid(alpha=0.3)
    ax.legend()
    cfg = next(iter(docs.values()))["config"]
    d = cfg["data"]
    ax.set_title(
        f"{d['dataset']}, {d['num_clients']} clients, {d['partition']}, {cfg['model']['family']}",
        fontsize=9,
    )
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


def format_table(docs: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of the summaries of several runs."""
    header = (
        "algorithm",
        "final acc (w)",
        "final acc (mean±std)",
        "best test",
        "s/round",
        "KB up/client",
    )
    # Training compute where the methods count it (FedBABU, layer expansion: the paper's Table 4
    # measure, trainable parameters x examples over all clients and rounds).
    cost = any("paper_cost_total" in doc.get("summary", {}) for doc in docs)
    if cost:
        header = (*header, "train cost (G)")
    rows = []
    for doc in docs:
        s = doc.get("summary", {})
        f = s.get("final", {})
        bt = s.get("best_on_test", {})
        row: tuple[str, ...] = (
            doc["config"]["algorithm"]["name"],
            _pct(f.get("acc_weighted")),
            f"{_pct(f.get('acc_mean'))} ± {_pct(f.get('acc_std'))}",
            f"{_pct(bt.get('acc_weighted'))} (r{bt.get('round', '-')})",
            f"{s.get('seconds_per_round', math.nan):.2f}",
            f"{s.get('bytes_up_per_client_per_round', math.nan) / 1024:.1f}",
        )
        if cost:
            c = s.get("paper_cost_total")
            row = (*row, "-" if c is None else f"{c / 1e9:.1f}")
        rows.append(row)
        if "after_finetune" in s:
            ft = s["after_finetune"]
            fine = (
                "  + fine-tune",
                _pct(ft.get("acc_weighted")),
                f"{_pct(ft.get('acc_mean'))} ± {_pct(ft.get('acc_std'))}",
                "",
                "",
                "",
            )
            rows.append((*fine, "") if cost else fine)
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda r: "  ".join(str(v).ljust(w) for v, w in zip(r, widths, strict=True))  # noqa: E731
    return "\n".join([line(header), line(tuple("-" * w for w in widths)), *map(line, rows)])


def _pct(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.2f}%"
