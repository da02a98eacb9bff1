"""The results store: ``results.json``, a CSV of the rounds, a learning-curve figure, text tables."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import secrets
from collections.abc import Callable, Sequence
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


# After-fine-tune stars of the i-th method sit at x * (1 + STAR_SHIFT * i) (after the last round):
# methods that fine-tune to the same level (FedBABU and layer expansion, 88-92%) would hide
# each other's stars.
STAR_SHIFT = 0.015
FIGURE_DPI = 150  # every PNG the library writes (run, compare and prototype figures)


# ---- atomic writes: a temporary file per writer, renamed over the target --------------------
TEMP_MARK = ".tmp-"  # <name>.tmp-<pid>-<random>: whose it is, and unique per write


def temp_path(path: Path) -> Path:
    """A temporary name beside ``path`` that no other writer uses: the pid says whose it is (a
    dead pid's temporaries are removed when the run folder is next locked) and the random part
    keeps two writes of one process apart. Only its writer removes it."""
    return path.with_name(f"{path.name}{TEMP_MARK}{os.getpid()}-{secrets.token_hex(4)}")


def write_temp(path: Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` to a fresh temporary beside ``path`` and return it (not yet renamed); on
    failure this writer's temporary is removed and the OSError names ``path``."""
    tmp = temp_path(path)
    try:
        write(tmp)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def replace_all(pairs: Sequence[tuple[Path, Path]]) -> None:
    """Rename each temporary over its target, in order; on failure the temporaries not yet
    renamed are removed and the OSError names the target."""
    for i, (tmp, path) in enumerate(pairs):
        try:
            os.replace(tmp, path)
        except OSError as exc:
            for t, _ in pairs[i:]:
                t.unlink(missing_ok=True)
            raise OSError(exc.errno, exc.strerror or str(exc), str(path)) from exc


def write_atomic(path: Path, data: bytes) -> None:
    """Write-then-rename: readers see the old file or the new one, never half of one."""
    replace_all([(write_temp(path, lambda t: t.write_bytes(data)), path)])


def save_figure(fig: Any, path: str | Path) -> list[Path]:
    """``path`` as PNG (``FIGURE_DPI``) plus vector SVG and PDF beside it, for papers (each
    written to a temporary and renamed: a full disk leaves the previous figures)."""
    path = Path(path)
    paths = [path, path.with_suffix(".svg"), path.with_suffix(".pdf")]
    temps: list[tuple[Path, Path]] = []

    def saver(p: Path) -> Callable[[Path], None]:
        dpi = FIGURE_DPI if p.suffix == ".png" else None
        return lambda t: fig.savefig(t, format=p.suffix[1:], bbox_inches="tight", dpi=dpi)

    try:
        for p in paths:
            temps.append((write_temp(p, saver(p)), p))
    except BaseException:
        for t, _ in temps:
            t.unlink(missing_ok=True)
        raise
    replace_all(temps)
    return paths


def json_bytes(doc: Any) -> bytes:
    """``doc`` as ``results.json`` holds it (NaN as null)."""
    return json.dumps(_jsonable(doc), indent=1, sort_keys=False).encode()


def write_json_atomic(path: Path, doc: Any) -> None:
    """Write-then-rename so an interrupted write never leaves a half file behind."""
    write_atomic(path, json_bytes(doc))


def rounds_csv(rounds: Sequence[dict[str, Any]]) -> bytes:
    """The rounds as ``rounds.csv``: the columns the run has, per-mode accuracies after them."""
    extra = sorted(
        {k for r in rounds for k in r if k.startswith("acc_head") or k.startswith("acc_proto")}
    )
    cols = [c for c in ROUND_COLUMNS if any(c in r for r in rounds)] + extra
    buf = io.StringIO(newline="")
    w = csv.writer(buf)
    w.writerow(cols)
    for r in rounds:
        w.writerow([r.get(c, "") for c in cols])
    return buf.getvalue().encode()


def write_results(out_dir: str | Path, doc: dict[str, Any], plot: bool = True) -> Path:
    """``results.json``, ``rounds.csv`` and (``plot``) ``curve.png`` in ``out_dir``: every file
    is written to its own temporary first, and ``results.json`` (what marks the run finished) is
    renamed last, so a failed write (a full disk) leaves the previous files as they were."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    done = out / "results.json"
    rows = out / "rounds.csv"
    temps = [(write_temp(rows, lambda t: t.write_bytes(rounds_csv(doc.get("rounds", [])))), rows)]
    try:
        temps.append((write_temp(done, lambda t: t.write_bytes(json_bytes(doc))), done))
        if plot:
            plot_curves({doc["config"]["algorithm"]["name"]: doc}, out / "curve.png")
    except BaseException:
        for t, _ in temps:
            t.unlink(missing_ok=True)
        raise
    replace_all(temps)
    return out


def plot_curves(docs: dict[str, dict[str, Any]], path: str | Path) -> None:
    """Test accuracy (%) per round of each run, dashed beside it every other accuracy it reports
    (FedProto's heads), and a star at the last round for the accuracy after the method's local
    fine-tuning where it fine-tunes (the table's headline for FedBABU and layer expansion):
    ``path`` (PNG) with SVG and PDF beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    for i, (label, doc) in enumerate(docs.items()):
        pts = [
            (r["round"], 100 * r["acc_weighted"])
            for r in doc["rounds"]
            if r.get("acc_weighted") is not None
        ]
        if not pts:
            continue
        (line,) = ax.plot(
            *zip(*pts, strict=True), marker="." if len(pts) < 40 else None, label=label
        )
        tuned = doc.get("summary", {}).get("after_finetune", {}).get("acc_weighted")
        if tuned is not None:
            last = doc["rounds"][-1]["round"]
            ax.plot(
                [last * (1 + STAR_SHIFT * i)],  # methods tuned to one level: stars side by side
                [100 * tuned],
                marker="*",
                ms=12,
                ls="none",
                color=line.get_color(),
                label=f"{label} after fine-tune",
            )
        for mode in accuracy_modes(doc.get("summary", {}).get("final", {})):
            # Every other accuracy the method reports (FedProto's heads), dashed beside it.
            key = f"{mode}_weighted"
            other = [(r["round"], 100 * r[key]) for r in doc["rounds"] if r.get(key) is not None]
            if other:
                ax.plot(
                    *zip(*other, strict=True),
                    ls="--",
                    marker="x" if len(other) < 40 else None,
                    ms=4,
                    color=line.get_color(),
                    label=f"{label} {mode}",
                )
    ax.set_xlabel("round")
    ax.set_xlim(left=0)  # one round alone got ticks at 0.96, 0.98, ...
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # rounds are whole numbers
    ax.set_ylabel("test accuracy (%, weighted over clients)")
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
    """A plain-text table of the summaries of several runs: accuracies in %, 1 KB = 1000 bytes;
    below a method's row, every other accuracy it reports (``acc_head``: FedProto's heads beside
    its nearest-prototype headline, ...) and its accuracy after local fine-tuning."""
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
            f"{s.get('bytes_up_per_client_per_round', math.nan) / 1000:.1f}",
        )
        if cost:
            c = s.get("paper_cost_total")
            row = (*row, "-" if c is None else f"{c / 1e9:.1f}")
        rows.append(row)
        for mode in accuracy_modes(f):
            other = (
                f"  {mode}",
                _pct(f.get(f"{mode}_weighted")),
                f"{_pct(f.get(f'{mode}_mean'))} ± {_pct(f.get(f'{mode}_std'))}",
                "",
                "",
                "",
            )
            rows.append((*other, "") if cost else other)
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


def accuracy_modes(final: dict[str, Any]) -> list[str]:
    """The accuracies a run reports beside its headline ``acc`` (``acc_head``, ``acc_meme``,
    ...), in the order of its summary."""
    return [
        k[: -len("_weighted")]
        for k in final
        if k.startswith("acc_") and k.endswith("_weighted") and k != "acc_weighted"
    ]


def _pct(v: Any) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.2f}%"
