"""Tables and figures of parity runs: ``python benchmarks/parity/report.py [results dir] [--fig DIR]``.

Prints one markdown table per run (both sides, both metrics, at rounds 5/10/20/40 and the last) and
writes ``<fig>/<run>.png``: the two sides' curves (weighted test accuracy solid, client mean dashed).
Round ``r`` is the accuracy after ``r`` rounds of training on both sides.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
AT = (5, 10, 20, 40)


def by_round(rounds: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {int(r["round"]): float(r[key]) for r in rounds if key in r}


def table(doc: dict[str, Any]) -> str:
    """Markdown rows: round, reference weighted/mean, fedmosaic weighted/mean, gap (points)."""
    ref, fm = doc["reference"]["rounds"], doc["fedmosaic"]["rounds"]
    rw, rm = by_round(ref, "acc_weighted"), by_round(ref, "acc_mean")
    fw, fmn = by_round(fm, "acc_weighted"), by_round(fm, "acc_mean")
    last = max(set(rw) & set(fw))
    lines = [
        "| round | HtFLlib weighted | fedmosaic weighted | gap | HtFLlib client mean | "
        "fedmosaic client mean | gap |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in [a for a in AT if a < last] + [last]:
        if r not in rw or r not in fw:
            continue
        lines.append(
            f"| {r}{' (final)' if r == last else ''} | {100 * rw[r]:.2f} | {100 * fw[r]:.2f} | "
            f"{100 * (fw[r] - rw[r]):+.2f} | {100 * rm[r]:.2f} | {100 * fmn[r]:.2f} | "
            f"{100 * (fmn[r] - rm[r]):+.2f} |"
        )
    lines.append(
        f"\nMean gap over rounds 1-{last} (weighted): "
        f"{100 * sum(fw[r] - rw[r] for r in range(1, last + 1)) / last:+.2f} points; "
        f"wall time HtFLlib {doc['reference'].get('seconds', '?')} s, "
        f"fedmosaic {doc['fedmosaic'].get('seconds', '?')} s."
    )
    return "\n".join(lines)


def figure(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for side, color in (("reference", "tab:orange"), ("fedmosaic", "tab:blue")):
        rounds = doc[side]["rounds"]
        label = "HtFLlib" if side == "reference" else "fedmosaic"
        for key, style in (("acc_weighted", "-"), ("acc_mean", "--")):
            pts = sorted(by_round(rounds, key).items())
            pts = [(r, a) for r, a in pts if r >= 1]
            ax.plot(
                [r for r, _ in pts],
                [100 * a for _, a in pts],
                style,
                color=color,
                label=f"{label} ({'weighted' if key == 'acc_weighted' else 'client mean'})",
            )
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(f"{doc['method']} ({doc['setting']}, seed {doc['setup']['seed']})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("results", type=Path, nargs="?", default=HERE / "results")
    p.add_argument("--fig", type=Path, help="write one PNG per run here")
    a = p.parse_args(argv)
    for path in sorted(a.results.glob("*.json")):
        doc = json.loads(path.read_text())
        if "reference" not in doc or "fedmosaic" not in doc or "rounds" not in doc["reference"]:
            continue
        print(f"### {doc['method']} ({doc['setting']})\n\n{table(doc)}\n")
        if a.fig:
            figure(doc, a.fig / f"{path.stem}.png")


if __name__ == "__main__":
    main()
