"""Client and global prototypes in 2-D (t-SNE or PCA), as FedTGP's Figure 5.

Client prototypes are each client's per-class mean representation on its training split (its
own model); global prototypes are the server's, as broadcast (``protos [C, d]`` + ``known [C]``).
The plot is made from a run's final checkpoint, so it needs no hook in the training loop: the
suite runner rebuilds the federation and computes the points (``suite_runner.plot_prototypes_of``);
this module only embeds and draws them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fedmosaic.report.results import save_figure


def embed_2d(points: np.ndarray, method: str = "tsne", seed: int = 0) -> np.ndarray:
    """``[n, d] -> [n, 2]``; t-SNE falls back to PCA below 6 points."""
    n = points.shape[0]
    if method == "tsne" and n >= 6:
        from sklearn.manifold import TSNE  # type: ignore[import-untyped]  # scikit-learn ships no types

        perplexity = float(min(30.0, max(2.0, (n - 1) / 3)))
        return TSNE(2, perplexity=perplexity, init="pca", random_state=seed).fit_transform(points)
    if method not in ("tsne", "pca"):
        raise ValueError(f"embedding {method!r}; choose tsne or pca")
    centered = points - points.mean(0, keepdims=True)
    if n < 2:
        return np.zeros((n, 2))
    _, _, vt = np.linalg.svd(centered, full_matrices=False)
    out = centered @ vt[:2].T
    return out if out.shape[1] == 2 else np.pad(out, ((0, 0), (0, 2 - out.shape[1])))


def plot_prototypes(
    client_protos: list[tuple[int, int, Tensor]],
    global_protos: Tensor,
    known: Tensor,
    path: str | Path,
    title: str = "",
    method: str = "tsne",
) -> None:
    """``client_protos``: (client id, class, vector [d]); ``global_protos [C, d]``, ``known [C]``.

    Writes ``path`` (PNG) with SVG and PDF beside it.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    classes = [int(c) for c in torch.nonzero(known).flatten()]
    vecs = [v.float().cpu() for _, _, v in client_protos] + [
        global_protos[c].float().cpu() for c in classes
    ]
    if not vecs:
        raise ValueError("no prototypes to plot")
    xy = embed_2d(torch.stack(vecs).numpy(), method)
    n_client = len(client_protos)
    cmap = plt.get_cmap("tab10" if global_protos.shape[0] <= 10 else "tab20")
    fig, ax = plt.subplots(figsize=(5.5, 5))
    for i, (_, cls, _) in enumerate(client_protos):
        ax.scatter(xy[i, 0], xy[i, 1], s=18, color=cmap(cls % cmap.N), alpha=0.7)
    for j, cls in enumerate(classes):
        k = n_client + j
        ax.scatter(
            xy[k, 0], xy[k, 1], s=220, marker="*", color=cmap(cls % cmap.N), edgecolors="black"
        )
        ax.annotate(
            str(cls), (xy[k, 0], xy[k, 1]), fontsize=8, xytext=(5, 5), textcoords="offset points"
        )
    ax.scatter([], [], s=18, color="gray", label="client prototypes")
    ax.scatter(
        [], [], s=120, marker="*", color="gray", edgecolors="black", label="global prototypes"
    )
    ax.legend(fontsize=8, loc="best")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(title or f"prototypes ({method.upper()}); colour = class", fontsize=9)
    fig.tight_layout()
    save_figure(fig, path)  # PNG + SVG + PDF, as the compare report's figures
    plt.close(fig)
