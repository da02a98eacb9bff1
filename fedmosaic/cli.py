"""Command line: ``fedmosaic run | list | partition``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from fedmosaic.config import ConfigError, ExperimentConfig, load

DEFAULT_BASELINE = "local"


def default_config_path() -> Path:
    return Path(str(resources.files("fedmosaic") / "configs" / "default.toml"))


def _load(config: str | None, overrides: list[str]) -> ExperimentConfig:
    return load(config or default_config_path(), overrides)


def cmd_run(args: argparse.Namespace) -> int:
    from fedmosaic.experiment import run_experiment
    from fedmosaic.report.results import format_table, plot_curves, write_results

    cfg = _load(args.config, args.set)
    baselines = list(args.baseline or [])
    if args.config is None and args.baseline is None:
        baselines = [DEFAULT_BASELINE]  # the default job shows the method next to Local
    out = Path(args.out or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{cfg.algorithm['name']}")
    names = [cfg.algorithm["name"], *baselines]
    docs: dict[str, dict[str, Any]] = {}
    for name in names:
        overrides = list(args.set) if name == names[0] else [*args.set, f"algorithm.name={name}"]
        run_cfg = _load(args.config, overrides)
        if name != names[0]:
            # A baseline keeps only the method-independent settings.
            run_cfg.algorithm = {"name": name}
        print(
            f"== {name}: {run_cfg.data.dataset}, {run_cfg.data.num_clients} clients, "
            f"{run_cfg.data.partition}, {run_cfg.model.family}, {run_cfg.train.rounds} rounds"
        )
        doc = run_experiment(run_cfg, progress=not args.quiet)
        target = out if len(names) == 1 else out / name
        write_results(target, doc)
        docs[name] = doc
    if len(docs) > 1:
        plot_curves(docs, out / "curves.png")
    print()
    print(format_table(list(docs.values())))
    print(f"\nreport written to {out}/")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    what = args.what
    if what == "algorithms":
        from fedmosaic.algorithms import ALGORITHMS

        for name, cls in ALGORITHMS.items():
            hp = ", ".join(f"{k}={v!r}" for k, v in cls.hyperparameters().items())
            het = "heterogeneous" if cls.supports_heterogeneous else "homogeneous only"
            print(f"{name}\t[{het}]\t{hp}")
    elif what in ("models", "families"):
        from fedmosaic.core.registry import ENCODERS, FAMILIES
        from fedmosaic.models import build_client_model, count_params, flops_per_image

        shape = tuple(int(v) for v in args.input_shape.split("x"))
        if what == "models":
            for name in ENCODERS.names():
                m = build_client_model(name, shape, args.num_classes, args.feature_dim)
                print(
                    f"{name:16s} params={count_params(m):>11,d}  "
                    f"MFLOPs/image={flops_per_image(m, shape) / 1e6:9.2f}"
                )
        else:
            for name, members in FAMILIES.items():
                print(f"{name}: {', '.join(members)}")
    elif what == "datasets":
        from fedmosaic.core.registry import DATASETS

        print("\n".join(DATASETS.names()))
    elif what == "partitioners":
        from fedmosaic.core.registry import PARTITIONERS

        print("\n".join(PARTITIONERS.names()))
    return 0


def cmd_partition(args: argparse.Namespace) -> int:
    from fedmosaic.data import build_federated_data, format_histograms, plot_histograms

    cfg = _load(args.config, args.set)
    fed = build_federated_data(cfg.data, cfg.seed)
    print(format_histograms(fed, args.split))
    if args.png:
        plot_histograms(fed, args.png, args.split)
        print(f"histogram plot written to {args.png}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedmosaic", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="run an experiment on the in-process simulator")
    r.add_argument("config", nargs="?", help="experiment TOML (default: the built-in default job)")
    r.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    r.add_argument("--out", help="output folder (default runs/<time>-<algorithm>)")
    r.add_argument(
        "--baseline",
        action="append",
        metavar="ALGORITHM",
        help="also run this algorithm on the same config and split (repeatable)",
    )
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run)

    ls = sub.add_parser("list", help="list registered algorithms, models, families, ...")
    ls.add_argument(
        "what", choices=["algorithms", "models", "families", "datasets", "partitioners"]
    )
    ls.add_argument("--input-shape", default="1x28x28", help="CxHxW for models (default 1x28x28)")
    ls.add_argument("--num-classes", type=int, default=10)
    ls.add_argument("--feature-dim", type=int, default=512)
    ls.set_defaults(func=cmd_list)

    pa = sub.add_parser("partition", help="print per-client label histograms of a config's split")
    pa.add_argument("config", nargs="?")
    pa.add_argument("--set", action="append", default=[])
    pa.add_argument("--split", default="train", choices=["train", "val", "test"])
    pa.add_argument("--png", help="also save a plot of the histograms")
    pa.set_defaults(func=cmd_partition)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except (FileNotFoundError, ValueError, KeyError) as exc:
        # Data errors (DatasetError, PartitionError) are ValueErrors with a message naming the input.
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
