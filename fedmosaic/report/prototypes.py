"""Client and global prototypes in 2-D (t-SNE or PCA), as FedTGP's Figure 5.

Client prototypes are each client's per-class mean representation on its training split (its
own model); global prototypes are the server's, as broadcast (``protos [C, d]`` + ``known [C]``).
The plot is made from a run's final checkpoint, so it needs no hook in the training loop.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedmosaic.algorithms._shared import class_means
from fedmosaic.checkpoint import read_checkpoint, restore_tree
from fedmosaic.federation import Federation, build_federation
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


def prototypes_of_run(
    fed: Federation, state: Any
) -> tuple[list[tuple[int, int, Tensor]], Tensor, Tensor]:
    """Client and global prototypes of a federation in ``state``."""
    msg = fed.algo.broadcast(state, 0, fed.plan.rounds + 1)
    if not hasattr(msg, "protos") or not hasattr(msg, "known"):
        raise ValueError(f"{fed.cfg.algorithm['name']} broadcasts no prototypes")
    clients: list[tuple[int, int, Tensor]] = []
    with torch.no_grad():
        for data, model in zip(fed.clients, fed.models, strict=True):
            protos, counts = class_means(model, data, fed.spec.num_classes)
            clients += [(data.client_id, c, protos[c]) for c in range(len(counts)) if counts[c] > 0]
    return clients, msg.protos, msg.known


def plot_prototypes_from_checkpoint(
    cfg: Any, checkpoint: str | Path, path: str | Path, method: str = "tsne"
) -> None:
    """Rebuild the federation of ``cfg``, load its checkpoint, and plot its prototypes."""
    fed = build_federation(cfg)
    loaded = read_checkpoint(checkpoint)
    tensors = loaded.tensors
    for cid, model in enumerate(fed.models):
        prefix = f"client/{cid}/model/"
        model.load_state_dict(
            {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        )
    state = restore_tree(loaded.meta["server_state"], tensors, fed.algo.init_server(fed.spec))
    clients, protos, known = prototypes_of_run(fed, state)
    d = cfg.data
    title = (
        f"{cfg.algorithm['name']}: {d.dataset}, {d.partition}, round {loaded.meta['round']} "
        f"({method.upper()}); colour = class, * = global"
    )
    plot_prototypes(clients, protos, known, path, title, method)
