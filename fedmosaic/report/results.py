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
from typing import TYPE_CHECKING, Any, cast

import numpy as np

if TYPE_CHECKING:
    from matplotlib.colors import ListedColormap

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
# Columns only some runs have, after the fixed ones: ``[privacy]`` runs add the epsilon spent.
PRIVACY_COLUMNS = ("epsilon", "epsilon_sample")
# ``eval.membership`` runs add the attack on the evaluated models (core/membership.py).
MEMBERSHIP_COLUMNS = ("mia_auc", "mia_auc_max", "mia_tpr", "mia_upload_auc", "mia_upload_tpr")


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


def write_temp(path: Path, write: Callable[[Path], object]) -> Path:
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
    known = (*ROUND_COLUMNS, *PRIVACY_COLUMNS, *MEMBERSHIP_COLUMNS)
    cols = [c for c in known if any(c in r for r in rounds)] + extra
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
    # Beside the axes: inside, the legend covered the curves' late rounds and the stars.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    cfg = next(iter(docs.values()))["config"]
    d = cfg["data"]
    ax.set_title(
        f"{d['dataset']}, {d['num_clients']} clients, {d['partition']}, {cfg['model']['family']}",
        fontsize=9,
    )
    fig.tight_layout()
    save_figure(fig, path)
    plt.close(fig)


# ---- the claim figure: after-fine-tune accuracy against training cost, beside the curves -----
# The committed full-data cells of the main job's suite. Relative on purpose, as the claims'
# ``RESULTS``: resolved against the current directory when read (run from the repository root; an
# installed package has no docs/ beside it, and the figure then shows this run alone).
REFERENCE_CELLS = Path("docs") / "results" / "full" / "layer_expansion"
# What a committed cell must share with a run to stand beside it: the setting, not the data
# fraction (the main job runs 25% of the data, the cells 100%).
CLAIM_KEYS = (
    ("data", "dataset"),
    ("data", "partition"),
    ("data", "alpha"),
    ("data", "num_clients"),
    ("data", "split"),
    ("model", "family"),
    ("train", "rounds"),
    ("train", "participation"),
    ("train", "local_epochs"),
    ("train", "batch_size"),
    ("train", "lr"),
)
BASELINE = "fedbabu"  # the claim's yardstick: costs and gaps are read relative to it
CLAIM_ORDER = (BASELINE, "fedseq_vanilla", "fedseq_anti")  # one colour each in every figure
MIN_SEEDS_FOR_INTERVAL = 3  # as the compare tables: a t-interval from 2 seeds is 12.7 SE wide


def claim_point(doc: dict[str, Any]) -> tuple[float, float] | None:
    """``(training cost in G, after-fine-tune accuracy in %)`` of a run, None where it has not
    both (a method that does not fine-tune or does not count the paper's cost)."""
    s = doc.get("summary", {})
    acc = s.get("after_finetune", {}).get("acc_weighted")
    cost = s.get("paper_cost_total")
    if acc is None or cost is None:
        return None
    return cost / 1e9, 100 * acc


def _claim_key(cfg: dict[str, Any]) -> tuple[Any, ...]:
    return tuple(cfg.get(section, {}).get(k) for section, k in CLAIM_KEYS)


def _fraction(cfg: dict[str, Any]) -> float:
    return float(cfg.get("data", {}).get("subsample", 1.0) or 1.0)


def _fraction_text(f: float) -> str:
    return "full data" if f >= 1 else f"{100 * f:g}% of the data"


def load_reference_cells(
    root: str | Path, like: dict[str, dict[str, Any]] | None = None
) -> dict[str, list[dict[str, Any]]]:
    """Method -> the results documents of the committed cells under ``root``
    (``root/cells/<setting>/<method>/seed<k>/results.json``) that share ``like``'s setting
    (``CLAIM_KEYS``) and methods; without ``like``, every method of the first setting. An absent
    folder or an unreadable cell gives nothing for it (the figure goes on without)."""
    like = like or {}
    base = Path(root) / "cells"
    want = {_claim_key(d.get("config", {})) for d in like.values()}
    names = {d.get("config", {}).get("algorithm", {}).get("name", k) for k, d in like.items()}
    out: dict[str, list[dict[str, Any]]] = {}
    settings = sorted(p.name for p in base.glob("*") if p.is_dir()) if base.is_dir() else []
    for setting in settings if like else settings[:1]:
        for path in sorted(
            (base / setting).glob("*/seed*/results.json"),
            key=lambda p: (p.parent.parent.name, len(p.parent.name), p.parent.name),  # seed2<seed10
        ):
            method = path.parent.parent.name
            if like and method not in names:
                continue
            try:
                doc = json.loads(path.read_text())
            except (OSError, UnicodeDecodeError, ValueError):
                continue
            if not isinstance(doc, dict) or not isinstance(doc.get("summary"), dict):
                continue
            if like and _claim_key(doc.get("config", {})) not in want:
                continue
            out.setdefault(method, []).append(doc)
    return out


def mean_interval(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean and the half-width of its 95% Student-t interval (None below
    ``MIN_SEEDS_FOR_INTERVAL`` values)."""

    mean = float(np.mean(values))
    if len(values) < MIN_SEEDS_FOR_INTERVAL:
        return mean, None
    from scipy.stats import t  # type: ignore[import-untyped]  # scipy ships no type information

    sd = float(np.std(values, ddof=1))
    return mean, float(t.ppf(0.975, len(values) - 1)) * sd / math.sqrt(len(values))


def _relative(points: dict[str, tuple[float, float]]) -> tuple[str, str, str] | None:
    """``(baseline, cheapest other method, text)``: the claim's two numbers on two lines, the
    method's cost as a multiple of the baseline's and its accuracy gap to it in points, read
    against ``BASELINE`` (the costliest method without it); None for fewer than two methods."""
    if len(points) < 2:
        return None
    base = BASELINE if BASELINE in points else max(points, key=lambda m: points[m][0])
    cheap = min((m for m in points if m != base), key=lambda m: points[m][0])
    (bc, ba), (cc, ca) = points[base], points[cheap]
    gap = f"{ca - ba:+.2f}".replace("-", "−")
    return base, cheap, f"{cc / bc:.2f}× {base}'s cost\n{gap} pt accuracy"


def _run_name(label: str, doc: dict[str, Any]) -> str:
    return str(doc.get("config", {}).get("algorithm", {}).get("name", label))


def _claim_panel(
    ax: Any,
    colors: dict[str, Any],
    mine: dict[str, tuple[float, float]],
    theirs: dict[str, dict[Any, tuple[float, float]]],
) -> None:
    """This run's point per method (filled circles) beside the committed cells' mean (open
    squares, 95% t-interval whiskers on both axes; ``theirs``: method -> seed -> point), and per
    group an arrow from the baseline to the cheapest method labelled with its cost ratio and
    accuracy gap (for the cells with the paired 95% t-interval of the gap over their seeds)."""
    means: dict[str, tuple[float, float]] = {}
    for m, by_seed in theirs.items():
        xs, ys = zip(*by_seed.values(), strict=True)
        (cx, hx), (cy, hy) = mean_interval(xs), mean_interval(ys)
        means[m] = (cx, cy)
        ax.errorbar(
            [cx],
            [cy],
            xerr=None if hx is None else [hx],
            yerr=None if hy is None else [hy],
            fmt="s",
            ms=9,
            mfc="white",
            mec=colors[m],
            mew=2,
            ecolor=colors[m],
            elinewidth=1.5,
            capsize=5,
            zorder=3,
        )
    for m, (x, y) in sorted(mine.items(), key=lambda kv: kv[0] == BASELINE):  # baseline on top
        ax.plot([x], [y], "o", ms=10, color=colors[m], mec="black", mew=0.8, zorder=4)
    for group in (mine, means):
        rel = _relative(group)
        if rel is None:
            continue
        base, cheap, text = rel
        if group is means:  # the seeds pair up: the gap's own interval, as the claims read it
            common = theirs[base].keys() & theirs[cheap].keys()
            diffs = [theirs[cheap][k][1] - theirs[base][k][1] for k in common]
            gap, half = mean_interval(diffs) if diffs else (0.0, None)
            if half is not None:
                text += f"\npaired 95% CI [{gap - half:+.2f}, {gap + half:+.2f}]".replace("-", "−")
        ax.annotate(
            "",
            xy=group[cheap],
            xytext=group[base],
            arrowprops={
                "arrowstyle": "->",
                "color": "0.35",
                "ls": "--",
                "shrinkA": 9,
                "shrinkB": 9,
            },
            zorder=2,
        )
        # Beside the cheap end, under the arrow (which comes from the costlier baseline).
        ax.annotate(
            f"{cheap}:\n{text}",
            group[cheap],
            xytext=(11, -8),
            textcoords="offset points",
            ha="left",
            va="top",
            fontsize=8.5,
            color="0.2",
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8},
            zorder=5,
        )
    every = [*mine.values(), *means.values()]
    ax.set_xlim(left=0, right=1.12 * max(x for x, _ in every))
    lo, hi = min(y for _, y in every), max(y for _, y in every)
    pad = max(0.6, 0.15 * (hi - lo))
    # Room under the lowest point for its three-line label.
    ax.set_ylim(lo - pad - 0.2 * (hi - lo + 2 * pad), hi + pad)
    ax.set_xlabel(
        "training cost, G (10$^9$ trainable parameters × examples over all\n"
        "clients and rounds: the paper's Table 4 measure)"
    )
    ax.set_ylabel("test accuracy after local fine-tuning (%)")
    ax.set_title("After fine-tuning: accuracy against training cost", fontsize=11)
    ax.grid(alpha=0.3)


def _curves_panel(
    ax: Any,
    colors: dict[str, Any],
    runs: dict[str, dict[str, Any]],
    ref: dict[str, list[dict[str, Any]]],
) -> None:
    """Test accuracy per round before fine-tuning: this run's curves, or without a run the
    committed cells' mean over seeds (band: its 95% t-interval)."""
    from matplotlib.ticker import MaxNLocator

    for m, color in colors.items():
        if runs:
            pts = [
                (r["round"], 100 * r["acc_weighted"])
                for r in runs.get(m, {}).get("rounds", [])
                if r.get("acc_weighted") is not None
            ]
            if pts:
                ax.plot(*zip(*pts, strict=True), color=color, lw=1.2)
            continue
        per: dict[int, list[float]] = {}
        for d in ref.get(m, []):
            for r in d.get("rounds", []):
                if r.get("acc_weighted") is not None:
                    per.setdefault(int(r["round"]), []).append(100 * r["acc_weighted"])
        if per:
            rs = sorted(per)
            stats = [mean_interval(per[t]) for t in rs]
            mean = np.array([v for v, _ in stats])
            half = np.array([h or 0.0 for _, h in stats])
            ax.plot(rs, mean, color=color, lw=1.2)
            ax.fill_between(rs, mean - half, mean + half, color=color, alpha=0.2, lw=0)
    ax.set_xlabel("round")
    ax.set_xlim(left=0)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("test accuracy before fine-tuning (%)")
    ax.grid(alpha=0.3)


def plot_claim(
    docs: dict[str, dict[str, Any]],
    path: str | Path,
    reference_cells: str | Path | None = REFERENCE_CELLS,
    vector: bool = True,
) -> bool:
    """The claim's figure: (left) accuracy after local fine-tuning against training cost (the
    paper's Table 4 measure, in G), this run's point per method beside the committed cells'
    mean with 95% t-intervals over seeds on both axes; (right) the learning curves, test accuracy
    per round before fine-tuning; the key and the claim's numbers below both, outside the data.
    ``path`` (PNG) with SVG and PDF beside it (``vector``; PNG only without).

    Without ``docs`` the figure is the committed cells' alone (mean curves with their interval as
    a band; nothing is written without cells). Where no run has both an after-fine-tune
    accuracy and a cost it degrades to ``plot_curves`` (the learning curves only); a missing
    ``reference_cells`` folder (an installed package) or no cell of the runs' setting leaves this
    run's points alone on the claim's axes. Returns whether the claim panel was drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    ref = load_reference_cells(reference_cells, docs) if reference_cells is not None else {}
    runs = {_run_name(label, doc): doc for label, doc in docs.items()}
    mine = {m: p for m, doc in runs.items() if (p := claim_point(doc)) is not None}
    theirs = {
        m: pts
        for m, cells in ref.items()
        if (pts := {d.get("seed", i): q for i, d in enumerate(cells) if (q := claim_point(d))})
    }
    if docs and not mine:  # no run fine-tunes and counts its cost: nothing to set beside
        plot_curves(docs, path)
        return False
    if not mine and not theirs:  # no run and no cell
        return False

    found = list(dict.fromkeys([*runs, *ref]))
    methods = sorted(
        found, key=lambda m: (CLAIM_ORDER.index(m) if m in CLAIM_ORDER else 9, found.index(m))
    )
    palette = cast(  # tab10 is a listed map of RGB colours
        "Sequence[tuple[float, float, float]]", cast("ListedColormap", plt.get_cmap("tab10")).colors
    )
    colors = {m: palette[i % len(palette)] for i, m in enumerate(methods)}
    cfg = (next(iter(runs.values()), None) or next(iter(ref.values()))[0]).get("config", {})
    run_frac = _fraction_text(_fraction(cfg))
    ref_cfg = next(iter(ref.values()))[0].get("config", {}) if ref else {}
    ref_frac = _fraction_text(_fraction(ref_cfg))
    seeds = max((len(v) for v in theirs.values()), default=0)
    ref_label = f"committed {ref_frac.replace(' data', '-data')} cells, {seeds} seeds"

    fig = plt.figure(figsize=(13, 6.6))
    grid = fig.add_gridspec(2, 2, height_ratios=[1, 0.12], hspace=0.42, wspace=0.22)
    ax, curves_ax, key_ax = (
        fig.add_subplot(grid[0, 0]),
        fig.add_subplot(grid[0, 1]),
        fig.add_subplot(grid[1, :]),
    )
    _claim_panel(ax, colors, mine, theirs)
    _curves_panel(curves_ax, colors, runs, ref)
    which = f"this run ({run_frac})" if runs else f"mean of {seeds} seeds, band: 95% t-interval"
    curves_ax.set_title(f"Before fine-tuning: learning curves, {which}", fontsize=11)

    # The key, shared by both panels, and what to read from it: below the data, never on it.
    handles = [Line2D([], [], color=colors[m], lw=2.5, label=m) for m in methods]
    if mine:
        handles.append(Line2D([], [], color="0.5", marker="o", mec="black", ls="none", ms=9))
        handles[-1].set_label(f"this run ({run_frac})")
    if theirs:
        handles.append(
            Line2D([], [], color="0.5", marker="s", mfc="white", mew=2, ls="-", lw=1.5, ms=8)
        )
        handles[-1].set_label(f"{ref_label}: mean, 95% t-interval")
    key_ax.axis("off")
    key_ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=len(handles),
        fontsize=9,
        frameon=False,
        handlelength=1.8,
        columnspacing=1.6,
    )
    if mine and theirs and run_frac != ref_frac:
        key_ax.text(
            0.5,
            0.15,
            f"Circles and squares come from different data fractions ({run_frac} vs "
            f"{ref_frac}): compare their shapes (cost ratios, accuracy gaps), not their "
            "absolute values.",
            ha="center",
            va="top",
            fontsize=9,
            style="italic",
            transform=key_ax.transAxes,
        )
    d, family = cfg.get("data", {}), cfg.get("model", {}).get("family", "")
    part = d.get("partition", "")
    if part == "dirichlet":
        part = f"Dirichlet({d.get('alpha')})"
    fig.suptitle(
        f"{d.get('dataset', '')}, {d.get('num_clients', '')} clients, {part}, {family}, "
        f"{cfg.get('train', {}).get('rounds', '')} rounds",
        fontsize=12,
    )
    if vector:
        save_figure(fig, path)
    else:
        png = Path(path)

        def save(t: Path) -> None:
            fig.savefig(t, format="png", bbox_inches="tight", dpi=FIGURE_DPI)

        replace_all([(write_temp(png, save), png)])
    plt.close(fig)
    return True


def format_table(docs: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of the summaries of several runs: accuracies in %, 1 kB = 1000 bytes;
    below a method's row, every other accuracy it reports (``acc_head``: FedProto's heads beside
    its nearest-prototype headline, ...) and its accuracy after local fine-tuning."""
    header: tuple[str, ...] = (
        "algorithm",
        "final acc (w)",
        "final acc (mean±std)",
        "best test",
        "s/round",
        "kB up/client",
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


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fedmosaic.report.results [OUT]``: the committed cells' claim figure (PNG only),
    read from ``--cells`` relative to the current directory (run from the repository root)."""
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m fedmosaic.report.results",
        description="The claim figure of committed cells: after-fine-tune accuracy against "
        "training cost (mean, 95%% t-intervals over seeds) beside the mean learning curves.",
    )
    p.add_argument("out", nargs="?", default="docs/results/full_layer_expansion_curves.png")
    p.add_argument("--cells", default=str(REFERENCE_CELLS), help="default: %(default)s")
    args = p.parse_args(argv)
    if not plot_claim({}, args.out, reference_cells=args.cells, vector=False):
        print(f"no cell with an after-fine-tune accuracy and a cost under {args.cells}/cells")
        return 1
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
