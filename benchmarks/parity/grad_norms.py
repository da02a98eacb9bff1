"""Gradient norms of a method's local loss on a parity split: would a reference's clipping act?

Several reference implementations clip each model's gradient norm (HtFLlib's FML and FedKD at 10)
where fedmosaic does not. This probe builds the harness's federation (the same split, models and
training keys), gives every client the server's first broadcast, and trains each client alone with
plain SGD at the harness's learning rate for ``--epochs`` epochs (its batches in order, the last
one ragged), recording the gradient norm of every step per parameter group: the client's model,
and each child module of its extras (FML's meme, FedKD's mentee and projection). It prints, per
group, the largest norm and how many steps reach ``--threshold``. No server step runs between
epochs: it probes training from the initial weights, where gradients are largest, not a whole
federation.

    PYTHONPATH=. python benchmarks/parity/grad_norms.py fml --variant htfllib_form \\
        --partition dirichlet --alpha 1.0 --epochs 5 --threshold 10
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch


def probe(cfg: Any, epochs: int, threshold: float) -> dict[str, dict[str, float]]:
    """``{group: {"steps", "max", "over"}}`` over every client's ``epochs`` local epochs."""
    from fedmosaic.core.algorithm import Algorithm
    from fedmosaic.federation import build_federation

    fed = build_federation(cfg)
    algo = fed.algo
    if type(algo).before_fit is not Algorithm.before_fit:
        raise SystemExit(f"{cfg.algorithm['name']}: its loss needs before_fit; not probed here")
    state = algo.init_server(fed.spec)
    out: dict[str, dict[str, float]] = {}
    for cid, (model, extras, data) in enumerate(zip(fed.models, fed.extras, fed.clients)):
        msg = algo.broadcast(state, cid, 1)
        algo.receive(model, extras, msg)
        model.train()
        extras.train()
        groups = {"model": [p for p in model.parameters() if p.requires_grad]}
        for name, child in extras.named_children():
            groups[name] = [p for p in child.parameters() if p.requires_grad]
        groups = {k: v for k, v in groups.items() if v}
        params = [p for ps in groups.values() for p in ps]
        for _ in range(epochs):
            for x, y in data.iter_batches("train", cfg.train.batch_size):
                for p in params:
                    p.grad = None
                algo.loss(model, extras, x, y, msg).backward()
                for name, ps in groups.items():
                    grads = [p.grad.norm() for p in ps if p.grad is not None]
                    norm = float(torch.stack(grads).norm()) if grads else 0.0
                    rec = out.setdefault(name, {"steps": 0, "max": 0.0, "over": 0})
                    rec["steps"] += 1
                    rec["max"] = max(rec["max"], norm)
                    rec["over"] += norm >= threshold
                with torch.no_grad():
                    for p in params:
                        if p.grad is not None:
                            p.sub_(p.grad, alpha=cfg.train.lr)
    return out


def main(argv: list[str] | None = None) -> int:
    import harness  # run as a script: its own folder is on sys.path

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_split_arguments(p)
    p.add_argument("--variant", help="one of the method's variants (default: its own form)")
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--threshold", type=float, default=10.0)
    a = p.parse_args(argv)
    setup, method = harness.split_setup(p, a, rounds=1)
    if a.variant is not None and a.variant not in method.variants:
        p.error(f"{a.method} variants: {', '.join(sorted(method.variants)) or 'none'}")
    if a.epochs < 1 or not a.threshold > 0:
        p.error("--epochs must be >= 1 and --threshold > 0")
    from fedmosaic.config import from_dict

    torch.set_num_threads(1)
    algorithm = {**method.algorithm, **(method.variants[a.variant] if a.variant else {})}
    cfg = from_dict(setup.fedmosaic_config(algorithm, method.plugins))
    res = probe(cfg, a.epochs, a.threshold)
    print(
        f"# {a.method} {a.variant or ''} {setup.stem(a.method)}: {a.epochs} local epochs a client"
    )
    for name, r in res.items():
        print(
            f"{name}: {r['steps']:.0f} steps, largest gradient norm {r['max']:.2f}, "
            f"{r['over']:.0f} at or over {a.threshold:g}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
