"""Gradient norms of a method's local loss on a parity split: would a reference's clipping act?

Several reference implementations clip each model's gradient norm (HtFLlib's FML and FedKD at 10)
where fedmosaic does not. This probe builds the harness's federation (the same split, models and
training keys), gives every client the server's first broadcast, and trains each client alone with
plain SGD at the harness's learning rate for ``--epochs`` epochs (its batches in order, the last
one ragged), recording the gradient norm of every step per parameter group: the client's model,
and each child module of its extras (FML's meme, FedKD's mentee and projection). It prints, per group, the largest norm and how many steps
reach ``--threshold``. No server step runs between epochs: it probes training from the initial
weights, where gradients are largest, not a whole federation.

    PYTHONPATH=. python benchmarks/parity/grad_norms.py fml --variant htfllib_form \\
        --partition dirichlet --alpha 1.0 --epochs 5 --threshold 10
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def _harness() -> Any:
    spec = importlib.util.spec_from_file_location("parity_harness", HERE / "harness.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


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
                            p -= cfg.train.lr * p.grad
    return out


def main(argv: list[str] | None = None) -> int:
    h = _harness()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("method", help="a key of the library's table (HTFLLIB, PFLLIB)")
    p.add_argument("--library", choices=sorted(h.LIBRARIES), default="htfllib")
    p.add_argument("--variant", help="one of the method's variants (default: its own form)")
    p.add_argument("--setting", choices=sorted(h.SETTINGS), default="dir01")
    p.add_argument("--partition", choices=["dirichlet", "pathological"])
    p.add_argument("--alpha", type=float)
    p.add_argument("--classes-per-client", type=int)
    p.add_argument("--subsample", type=float, default=0.05)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--threshold", type=float, default=10.0)
    a = p.parse_args(argv)
    lib = h.LIBRARIES[a.library]
    if a.method not in lib.methods:
        p.error(f"{lib.name} methods: {', '.join(sorted(lib.methods))}")
    method = lib.methods[a.method]
    if a.variant is not None and a.variant not in method.variants:
        p.error(f"{a.method} variants: {', '.join(sorted(method.variants)) or 'none'}")
    if a.epochs < 1 or not a.threshold > 0:
        p.error("--epochs must be >= 1 and --threshold > 0")
    # the harness's own checks of the split's arguments (those of its runs left at their defaults)
    a.rounds, a.out, a.ref_seed_offset, a.ref_seed_globals, a.ref_repeat = 1, HERE, 0, None, 0
    h._check_args(p, a)
    if a.partition is not None:
        a.setting = h.register_setting(a.partition, a.alpha, a.classes_per_client)
    from fedmosaic.config import from_dict

    torch.set_num_threads(1)
    setup = h.Setup(a.setting, a.subsample, a.clients, 1, a.seed, library=a.library)
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
