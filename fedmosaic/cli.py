"""Command line: ``fedmosaic run | compare | list | partition | flower``."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import subprocess
import sys
import threading
from importlib import resources
from pathlib import Path
from typing import Any, NoReturn, cast

import fedmosaic
from fedmosaic import numerics
from fedmosaic.config import (
    ConfigError,
    DataConfig,
    ExperimentConfig,
    add_plugins,
    load,
    load_entry_points,
    parse_value,
)

# Startup imports no torch: ``--version``, ``--help`` and a mistake in a config's tables answer in
# a fraction of a second. The rest of the package (torch, the registries, the runtimes) is
# imported by the command that needs it, inside its function; the names this module used to
# import at its top stay reachable as its attributes (``__getattr__`` below).
_LAZY = {
    "CHECKPOINT_FILE": ("fedmosaic.checkpoint", "FILENAME"),
    "FILENAME": ("fedmosaic.checkpoint", "FILENAME"),
    "FINAL_FILE": ("fedmosaic.checkpoint", "FINAL_FILE"),
    "ALGORITHMS": ("fedmosaic.algorithms", "ALGORITHMS"),
    "DATASETS": ("fedmosaic.core.registry", "DATASETS"),
    "ENCODERS": ("fedmosaic.core.registry", "ENCODERS"),
    "FAMILIES": ("fedmosaic.core.registry", "FAMILIES"),
    "PARTITIONERS": ("fedmosaic.core.registry", "PARTITIONERS"),
    "Diverged": ("fedmosaic.core.rounds", "Diverged"),
    "Interrupted": ("fedmosaic.core.rounds", "Interrupted"),
    "stop_requested": ("fedmosaic.core.rounds", "stop_requested"),
    "build_federated_data": ("fedmosaic.data", "build_federated_data"),
    "format_histograms": ("fedmosaic.data", "format_histograms"),
    "plot_histograms": ("fedmosaic.data", "plot_histograms"),
    "where_on_disk": ("fedmosaic.data.datasets", "where_on_disk"),
    "check_runs": ("fedmosaic.federation", "check_runs"),
    "write_app": ("fedmosaic.flower.project", "write_app"),
    "build_client_model": ("fedmosaic.models", "build_client_model"),
    "count_params": ("fedmosaic.models", "count_params"),
    "flops_per_image": ("fedmosaic.models", "flops_per_image"),
    "format_table": ("fedmosaic.report.results", "format_table"),
    "plot_curves": ("fedmosaic.report.results", "plot_curves"),
    "bundled_suites": ("fedmosaic.report.suite", "bundled_suites"),
    "load_suite": ("fedmosaic.report.suite", "load_suite"),
    "RunFolder": ("fedmosaic.runfolder", "RunFolder"),
    "fs_error": ("fedmosaic.runfolder", "fs_error"),
    "build_cells": ("fedmosaic.suite_runner", "build_cells"),
    "cell_status": ("fedmosaic.suite_runner", "cell_status"),
    "run_suite": ("fedmosaic.suite_runner", "run_suite"),
}


def __getattr__(name: str) -> Any:
    """``fedmosaic.cli.RunFolder`` and the other names once imported at the top: imported now."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attr = _LAZY[name]
    return getattr(importlib.import_module(module), attr)


# The default job's baselines: its claim's (docs/results.md: Vanilla scheduling level with FedBABU
# after fine-tuning, at about a third of its training compute) and the other schedule.
DEFAULT_BASELINES = ("fedbabu", "fedseq_anti")


def default_config_path() -> Path:
    return Path(str(resources.files("fedmosaic") / "configs" / "default.toml"))


def _load(config: str | None, overrides: list[str]) -> ExperimentConfig:
    return load(config or default_config_path(), overrides)


def baseline_config(config: str | None, overrides: list[str], name: str) -> ExperimentConfig:
    """``--baseline name``: the run's config with only the method-independent settings kept (the
    ``[algorithm]`` table is ``{name}`` alone, whatever the file or ``--set`` gave the method)."""
    return load(config or default_config_path(), overrides, algorithm={"name": name})


def models_line(folder: Path, kept: bool, checkpoints: bool = False) -> str:
    """Where a finished run's models went: kept (with the file's size, 1 MB = 10^6 bytes) or not
    (``checkpoints``: and its resume checkpoint, there for a crash, was removed)."""
    from fedmosaic.checkpoint import FINAL_FILE

    final = folder / FINAL_FILE
    if kept and final.is_file():
        return f"   models kept: {final} ({final.stat().st_size / 1e6:.1f} MB)"
    removed = ", its resume checkpoint removed as the run finished" if checkpoints else ""
    return (
        f"   models not kept{removed} (--save-models keeps them for fedmosaic.api.load_run "
        "and --extend)"
    )


def _in_portable_process(args: argparse.Namespace, cfgs: list[ExperimentConfig]) -> int | None:
    """Where the runs ask for ``sim.numerics = "portable"`` and this process is not pinned, the
    same command re-run in a child process with the pins (they must precede torch's import);
    returns its exit code, or None to go on here."""
    modes = sorted({c.sim.numerics for c in cfgs})
    if len(modes) > 1:
        raise ConfigError(
            f"sim.numerics differs between this command's runs ({' and '.join(modes)}): one "
            "process runs one kind of arithmetic; run them separately"
        )
    if modes != ["portable"] or numerics.env_in_place():
        return None
    why = numerics.can_be_portable()
    if why:
        raise ConfigError(f"sim.numerics = 'portable': {why}")
    cmd, env = numerics.reexec_argv(list(getattr(args, "argv", sys.argv[1:])))
    print(
        "sim.numerics = portable: running this command again with ATen, MKL and oneDNN pinned "
        "at AVX2",
        file=sys.stderr,
        flush=True,
    )
    return subprocess.run(cmd, env=env, check=False).returncode


def cmd_run(args: argparse.Namespace) -> int:
    cfg = _load(args.config, args.set)
    # imported once the config's own tables passed (they pull in torch)
    from fedmosaic.checkpoint import FINAL_FILE, config_hash
    from fedmosaic.federation import check_runs
    from fedmosaic.report.results import format_table, plot_claim
    from fedmosaic.runfolder import RunFolder, RunOptions, fs_error

    baselines = list(args.baseline or [])
    if args.config is None and args.baseline is None:
        baselines = list(DEFAULT_BASELINES)  # the default job: the method next to its claim's
    every = args.checkpoint_every
    if every is None:  # a long run survives a crash: a checkpoint every tenth of its rounds
        every = max(5, cfg.train.rounds // 10) if cfg.train.rounds >= 20 else 0
    if every < 0:
        raise ConfigError(f"--checkpoint-every {every} must be >= 0")
    names = [cfg.algorithm["name"], *baselines]
    # Every run's config is checked before anything runs or is written (a bad --baseline fails
    # now, not after the main run).
    plans: list[tuple[str, ExperimentConfig, Path]] = []
    for name in names:
        if name == names[0]:
            run_cfg = _load(args.config, args.set)
        else:
            run_cfg = baseline_config(args.config, args.set, name)
        plans.append((name, run_cfg, Path()))
    # The default folder is named by the runs' configs: the same command finds it again, and an
    # interrupted run there is resumed rather than started over.
    auto = args.out is None
    if auto:
        stem = Path(args.config).stem if args.config else "default"
        digest = config_hash({"runs": [c.to_dict() for _, c, _ in plans]})[:8]
        out = Path("runs") / f"{stem}-{digest}"
    else:
        out = Path(args.out)
    plans = [(n, c, out if len(names) == 1 else out / n) for n, c, _ in plans]
    # Each method against its federation (public split, heads, ...), still before anything runs.
    check_runs([(f"--baseline {n}" if i else f"run {n}", c) for i, (n, c, _) in enumerate(plans)])
    code = _in_portable_process(args, [c for _, c, _ in plans])
    if code is not None:
        return code
    keep_final = args.save_models or args.extend  # an extended run keeps its final state
    docs: dict[str, dict[str, Any]] = {}
    ran = False
    with contextlib.ExitStack() as stack:
        # Every folder locked and checked before the first run starts (runfolder's lifecycle):
        # a refusal of any of them leaves all of them as they were.
        starts = []
        for name, run_cfg, target in plans:
            folder = stack.enter_context(RunFolder(target))
            resume = args.resume or (auto and not args.overwrite and not args.extend)
            start = folder.check(
                run_cfg, overwrite=args.overwrite, resume=resume, extend=args.extend
            )
            starts.append((name, run_cfg, folder, start, resume))
        for name, run_cfg, folder, start, resume in starts:
            if start.done is not None:
                print(
                    f"== {name}: already done: {folder.path} holds this configuration's finished "
                    "run (kept; --overwrite runs it again)"
                )
                if args.save_models and not (folder.path / FINAL_FILE).is_file():
                    print("   it kept no models: add --overwrite to train it again and keep them")
                docs[name] = start.done
                continue
            print(
                f"== {name}: {run_cfg.data.dataset}, {run_cfg.data.num_clients} clients, "
                f"{run_cfg.data.partition}, {run_cfg.model.family}, {run_cfg.train.rounds} rounds"
            )
            if start.keep and not args.extend:
                print(
                    f"   resuming after round {start.keep} from the checkpoint in {folder.path} "
                    "(an interrupted run of this command)"
                )
            elif every:
                print(
                    f"   a checkpoint every {every} rounds in {folder.path}: if interrupted, run "
                    "the same command again to continue" + ("" if auto else " (with --resume)")
                )
            opts = RunOptions(
                progress=not args.quiet,
                checkpoint_every=every,
                resume=resume,
                extend=args.extend,
                keep_final=keep_final,
            )
            doc = folder.execute(run_cfg, start, opts)
            print(models_line(folder.path, keep_final, every > 0))
            docs[name] = doc
            ran = True
        if len(docs) > 1 and ran:
            try:
                plot_claim(docs, out / "curves.png")
            except OSError as exc:
                raise fs_error(exc, out / "curves.png") from exc
    print()
    print(format_table(list(docs.values())))
    print(f"\nreport written to {out}/")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from fedmosaic.verify import Stop, check_keep, compare, load, verify

    stored = load(args.results)
    have = len(stored.rounds)
    rounds = have if args.rounds is None else args.rounds
    if rounds < 1 or rounds > have:
        raise ConfigError(f"--rounds {rounds}: {stored.path} holds rounds 1-{have}")
    if args.keep is not None:
        if args.first_difference:
            raise ConfigError("--keep keeps a complete re-run: leave out --first-difference")
        check_keep(args.keep, rounds, have)
    code = _in_portable_process(args, [stored.cfg])
    if code is not None:
        return code

    def on_round(rec: dict[str, Any]) -> None:
        r = int(rec["round"])
        one = compare(stored.rounds[r - 1 : r], [rec])
        if not args.quiet:
            words = (
                f"{one.values} numbers equal"
                if one.identical
                else f"{one.differing} of {one.values} numbers differ"
            )
            print(f"round {r}/{rounds}: {words}", file=sys.stderr, flush=True)
        if args.first_difference and not one.identical:
            raise Stop

    print(f"verify: re-running {stored.path} for {rounds} round(s) here", file=sys.stderr)
    out, text = verify(stored, rounds, on_round, keep=args.keep)
    print(text)
    if args.keep is not None:
        print(f"verify: the re-run is kept at {args.keep}", file=sys.stderr)
    return 0 if out.identical else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from fedmosaic.report.suite import load_suite

    suite = load_suite(args.suite)
    # the cells' configs are checked against the registries (torch) once the suite file parsed
    from fedmosaic.suite_runner import build_cells, cell_status, run_suite

    cells = build_cells(
        suite,
        args.set,
        quick=args.quick,
        converged=args.converged,
        full=args.full,
        methods=args.methods,
        settings=args.settings,
        seeds=args.seeds,
        check=not args.list,  # listing needs no data
    )
    out = Path(args.out or f"runs/compare-{suite.name}")
    if args.list:
        for c in cells:
            print(f"{c.key}\t{c.cfg.train.rounds} rounds\t{cell_status(out, c)[0]}")
        return 0
    code = _in_portable_process(args, [c.cfg for c in cells])
    if code is not None:
        return code
    command = " ".join(
        ["fedmosaic compare", args.suite, "--out", str(out)]
        + (["--quick"] if args.quick else [])
        + (["--converged"] if args.converged else [])
        + (["--full"] if args.full else [])
        + (["--force"] if args.force else [])
        + (["--reuse-other-code"] if args.reuse_other_code else [])
        + [
            f"--{k} {','.join(map(str, v))}"
            for k, v in (
                ("methods", args.methods),
                ("settings", args.settings),
                ("seeds", args.seeds),
            )
            if v
        ]
        + [f"--set {item}" for item in args.set]
    )
    run_suite(
        suite,
        out,
        cells,
        resume=args.resume,
        checkpoint_every=args.checkpoint_every,
        progress=not args.quiet,
        command=command,
        force=args.force,
        reuse_other_code=args.reuse_other_code,
    )
    print((out / "table.md").read_text())
    print(f"report written to {out}/index.html")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    what = args.what
    if what == "suites":  # the suite files only: no torch
        from fedmosaic.report.suite import bundled_suites

        print("\n".join(bundled_suites()))
        return 0
    # The registries are filled by importing the package (torch).
    import torch

    import fedmosaic.data  # noqa: F401  (registers the datasets and partitioners)
    from fedmosaic.algorithms import ALGORITHMS
    from fedmosaic.core.registry import ENCODERS, FAMILIES, PARTITIONERS
    from fedmosaic.models import build_client_model, count_params, flops_per_image

    if what == "algorithms":
        for name, cls in ALGORITHMS.items():
            hp = ", ".join(f"{k}={v!r}" for k, v in cls.hyperparameters().items())
            het = "heterogeneous" if cls.supports_heterogeneous else "homogeneous only"
            print(f"{name}\t[{het}]\t{hp}")
    elif what in ("models", "families"):
        # [C, H, W] as the option asks; a model of another rank fails naming the shape
        shape = cast(tuple[int, int, int], tuple(int(v) for v in args.input_shape.split("x")))
        if what == "models":
            for name in ENCODERS.names():
                # On the meta device: shapes only, no weights drawn or initialized (ResNet-152
                # took most of the 32 s this listing needed); parameter and FLOP counts are equal.
                with torch.device("meta"):
                    m = build_client_model(name, shape, args.num_classes, args.feature_dim)
                print(
                    f"{name:16s} params={count_params(m):>11,d}  "
                    f"MFLOPs/image={flops_per_image(m, shape) / 1e6:9.2f}"
                )
        else:
            for name, members in FAMILIES.items():
                print(f"{name}: {', '.join(members)}")
    elif what == "datasets":
        print(format_datasets())
    elif what == "partitioners":
        print("\n".join(PARTITIONERS.names()))
    return 0


def _dataset_status(name: str) -> tuple[str, str]:
    """(on disk, where) for ``fedmosaic list datasets``: the loaders' own search (data.root
    unset: $FEDMOSAIC_DATA, the system folders, the download cache), nothing read."""
    from fedmosaic.data.datasets import where_on_disk

    if name == "digits":
        return "yes", "bundled with scikit-learn"
    if name == "synthetic":
        return "yes", "generated (data.synthetic_*; no files)"
    if name == "hf":
        return "-", "reads data.root (a local Hugging Face / flwr-datasets dataset)"
    found = where_on_disk(name, DataConfig())
    if found is None:
        return "-", "a plugin's dataset (its own loader decides)"
    present = {k: v for k, v in found.items() if v is not None}
    if not present:
        return "no", "set data.root or $FEDMOSAIC_DATA to its folder, or data.download = true"
    where = ", ".join(str(v) if k == name else f"{k}: {v}" for k, v in present.items())
    missing = [k for k in found if k not in present]
    return "yes", where + (f" (not found: {', '.join(missing)})" if missing else "")


def format_datasets() -> str:
    """Every registered dataset, whether its files are on this machine, and where."""
    import fedmosaic.data  # noqa: F401  (registers the datasets)
    from fedmosaic.core.registry import DATASETS

    rows = [("dataset", "on disk", "where"), *((n, *_dataset_status(n)) for n in DATASETS.names())]
    w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
    return "\n".join(f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows)


def cmd_partition(args: argparse.Namespace) -> int:
    cfg = _load(args.config, args.set)
    png = None if args.png is None else Path(args.png)
    if png is not None:  # checked before the data are read: a plot written elsewhere is no plot
        if png.suffix.lower() != ".png" or png.is_dir():
            raise ConfigError(f"--png {args.png!r} must name a .png file")
        if not png.parent.is_dir():
            raise ConfigError(f"--png {args.png!r}: the folder {str(png.parent)!r} does not exist")
    # Loading and splitting the data needs torch (the datasets are decoded into tensors and the
    # feature-shift transforms are torch ops): imported once the config passed.
    from fedmosaic.data import build_federated_data, format_histograms, plot_histograms

    data = build_federated_data(cfg.data, cfg.seed)
    print(format_histograms(data, args.split))
    if png is not None:
        plot_histograms(data, png, args.split)
        print(f"histogram plot written to {png}")
    return 0


def cmd_flower_app(args: argparse.Namespace) -> int:
    from fedmosaic.flower.project import write_app

    cfg = _load(args.config, args.set)
    run_config = _run_config_items(args.run_config)
    out = write_app(
        cfg, args.out, args.superlink, args.insecure, args.root_certificates, run_config
    )
    print(f"Flower app written to {out}/ (see {out}/README.md)")
    print(f"  FLWR_HOME={out.resolve()}/.flwr flwr run {out} fedmosaic --stream")
    return 0


def cmd_flower_simulate(args: argparse.Namespace) -> int:
    # flwr and ray are optional extras: imported only by this command
    from fedmosaic.flower.simulation import run_simulation, simulation_run_config
    from fedmosaic.report.results import format_table

    # Flower prints through its own handler; passed on to ours too, every line came twice
    logging.getLogger("flwr").propagate = False
    cfg = _load(args.config, args.set)
    extra = _run_config_items(args.run_config)
    doc = run_simulation(simulation_run_config(cfg, args.out, extra))
    print(format_table([doc]))
    print(f"\nresults written to {args.out}/")
    return 0


def _run_config_items(items: list[str]) -> dict[str, Any]:
    """``--run-config KEY=VALUE`` items (values parsed as TOML literals)."""
    run_config = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--run-config {item!r} must look like key=value")
        run_config[key.strip()] = parse_value(value.strip())
    return run_config


LOG_LEVELS = ("debug", "info", "warning", "error")


SET_HELP = (
    "override one config key, e.g. train.rounds=50 or data.subsample=0.1 (repeatable; "
    "every key: docs/reference/config.md)"
)


def _logging_options(quiet: bool) -> argparse.ArgumentParser:
    """--log-level, --log-file and --plugin; ``quiet``: the command also has --quiet."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        choices=LOG_LEVELS,
        default=None,
        help="default: info (one line per round when stderr is not a terminal)"
        + ("; warning with --quiet" if quiet else ""),
    )
    common.add_argument("--log-file", metavar="PATH", help="also write the log to this file")
    _plugin_option(common)
    return common


def _set_option(parser: argparse.ArgumentParser, help: str = SET_HELP) -> None:
    parser.add_argument(
        "--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help=help
    )


def _run_config_option(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument(
        "--run-config",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"{example} (see docs/flower.md)",
    )


def _plugin_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--plugin",
        action="append",
        default=[],
        metavar="MODULE",
        help="import a module or .py file that registers algorithms, models, datasets or "
        "partitioners (repeatable; recorded in the config, so workers and Flower apps load it)",
    )


class _Parser(argparse.ArgumentParser):
    """argparse with its refusals in one line (``error: fedmosaic run: argument ...``), exit 2,
    not the usage block first; every subcommand's parser is one too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def _folder(value: str) -> str:
    """A folder argument: an empty name would write into the current directory."""
    if not value.strip():
        raise argparse.ArgumentTypeError("'' names no folder")
    return value


def _names(value: str) -> list[str]:
    """A comma-separated list that names something (``--methods ,`` is a mistake, not "all")."""
    names = [x.strip() for x in value.split(",") if x.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{value!r} names nothing")
    return names


def _seeds(value: str) -> list[int]:
    try:
        return [int(x) for x in _names(value)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r}: seeds are integers, e.g. 0,1,2") from None


def _count(value: str) -> int:
    """A count >= 0 (``--checkpoint-every``)."""
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid int value: {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} must be >= 0")
    return n


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="fedmosaic",
        description="Heterogeneous, personalized federated learning: run an experiment, compare "
        "methods on a suite, list what is registered, inspect a split, deploy on Flower.",
        epilog="fedmosaic COMMAND --help shows a command's options.",
    )
    p.add_argument("--version", action="version", version=f"fedmosaic {fedmosaic.__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = _logging_options(quiet=True)

    def command(name: str, help: str, **kwargs: Any) -> argparse.ArgumentParser:
        # the one-line help in the command list is also the command's own --help description
        return sub.add_parser(name, help=help, description=help, **kwargs)

    r = command("run", "run an experiment on the in-process simulator", parents=[common])
    r.add_argument("config", nargs="?", help="experiment TOML (default: the built-in default job)")
    _set_option(r)
    r.add_argument(
        "--out",
        type=_folder,
        help="output folder (default runs/<config>-<hash>: the same command finds it again and "
        "resumes an interrupted run there)",
    )
    r.add_argument(
        "--baseline",
        action="append",
        metavar="ALGORITHM",
        help="also run this algorithm on the same config and split (repeatable)",
    )
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    r.add_argument(
        "--save-models",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="keep the trained server state and every client's model as OUT/final.safetensors "
        "(its size is printed; fedmosaic.api.load_run(OUT) and --extend need it; default off: "
        "the default job's 100 clients take 225 MB per method)",
    )
    r.add_argument(
        "--extend",
        action="store_true",
        help="continue a finished --save-models run in --out to more rounds "
        "(--set train.rounds=N; nothing else may change)",
    )
    r.add_argument(
        "--overwrite",
        action="store_true",
        help="run again over a finished run in --out (this configuration's or another's)",
    )
    r.add_argument(
        "--checkpoint-every",
        type=int,
        default=None,
        metavar="K",
        help="save a checkpoint in the output folder every K rounds (and after the last); "
        "default: every tenth of the rounds (at least 5) for runs of 20 rounds or more, 0: only "
        "when interrupted",
    )
    r.add_argument(
        "--resume", action="store_true", help="continue from the output folder's checkpoint"
    )
    r.set_defaults(func=cmd_run)

    c = command(
        "compare",
        "run a suite: methods x settings x seeds, one table and an HTML report",
        parents=[common],
    )
    c.add_argument(
        "suite", help="suite TOML, or the name of a bundled suite (fedmosaic list suites)"
    )
    c.add_argument("--out", type=_folder, help="output folder (default runs/compare-<suite>)")
    _set_option(c, SET_HELP + "; applied to every cell")
    c.add_argument("--quick", action="store_true", help="apply the suite's [quick] reduced budget")
    c.add_argument(
        "--converged",
        action="store_true",
        help="apply the suite's [converged] budget (a round cap and a plateau stop on validation)",
    )
    c.add_argument(
        "--full",
        action="store_true",
        help="apply the suite's [full] budget: the claims' cells (full data where it fits, one "
        "round count for every method)",
    )
    c.add_argument("--methods", type=_names, help="comma-separated subset of the suite's methods")
    c.add_argument("--settings", type=_names, help="comma-separated subset of the suite's settings")
    c.add_argument("--seeds", type=_seeds, help="comma-separated seeds (default: the suite's)")
    c.add_argument(
        "--resume", action="store_true", help="continue interrupted cells from their checkpoints"
    )
    c.add_argument(
        "--checkpoint-every", type=_count, default=None, metavar="K", help="default: the suite's"
    )
    c.add_argument("--force", action="store_true", help="run every cell again, cached or not")
    c.add_argument(
        "--reuse-other-code",
        action="store_true",
        help="keep cells this config produced with other code (listed in the report)",
    )
    c.add_argument("--list", action="store_true", help="list the cells and whether they are done")
    c.add_argument("--quiet", action="store_true", help="no progress bars")
    c.set_defaults(func=cmd_compare)

    v = command(
        "verify",
        "re-run a finished run (its results.json) on this host and compare every number: "
        "exit 0 when all are equal bit for bit, 1 when some differ",
        parents=[common],
    )
    v.add_argument("results", help="a run's results.json, or the folder holding it")
    v.add_argument(
        "--rounds",
        type=int,
        default=None,
        metavar="N",
        help="compare the first N rounds only (the same run stopped there; default: all)",
    )
    v.add_argument(
        "--first-difference",
        action="store_true",
        help="stop after the first round in which a number differs",
    )
    v.add_argument("--quiet", action="store_true", help="no line per round")
    v.add_argument(
        "--keep",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the complete re-run's results.json here (never over an existing file); under "
        "docs/results/<budget>/<suite>/reruns/<setting>/<method>/seed<k>/<host>/ the claims page "
        "compares it with its cell",
    )
    v.set_defaults(func=cmd_verify)

    ls = command(
        "list",
        "list the registered algorithms (with hyperparameters), models, families, datasets "
        "(and whether they are on disk), partitioners or bundled suites",
    )
    ls.add_argument(
        "what",
        choices=["algorithms", "models", "families", "datasets", "partitioners", "suites"],
        help="what to list",
    )
    ls.add_argument("--input-shape", default="1x28x28", help="CxHxW for models (default 1x28x28)")
    ls.add_argument(
        "--num-classes", type=int, default=10, help="classes for models' counts (default 10)"
    )
    ls.add_argument(
        "--feature-dim", type=int, default=512, help="feature width for models (default 512)"
    )
    _plugin_option(ls)
    ls.set_defaults(func=cmd_list)

    pa = command(
        "partition",
        "print per-client label histograms of a config's split",
        parents=[_logging_options(quiet=False)],
    )
    pa.add_argument("config", nargs="?", help="experiment TOML (default: the built-in default job)")
    _set_option(pa)
    pa.add_argument(
        "--split",
        default="train",
        choices=["train", "val", "test"],
        help="which part of each client's data (default train)",
    )
    pa.add_argument("--png", metavar="PATH", help="also save a plot of the histograms")
    pa.set_defaults(func=cmd_partition)

    fl = command(
        "flower", "deploy on Flower, or run on its Ray simulation runtime (docs/flower.md)"
    )
    fl_sub = fl.add_subparsers(dest="flower_command", required=True, metavar="COMMAND")
    app_help = "write a Flower app folder that flwr run accepts"
    fa = fl_sub.add_parser("app", help=app_help, description=app_help)
    fa.add_argument("config", help="experiment TOML")
    fa.add_argument("--out", required=True, type=_folder, help="app folder to write")
    _set_option(fa)
    fa.add_argument("--superlink", default="127.0.0.1:9093", help="SuperLink address host:port")
    tls = fa.add_mutually_exclusive_group()
    tls.add_argument("--root-certificates", help="CA certificate of the SuperLink (TLS)")
    tls.add_argument("--insecure", action="store_true", help="no TLS (loopback demos only)")
    _run_config_option(fa, "app run config, e.g. round-timeout=120 min-replies=2")
    _plugin_option(fa)
    fa.set_defaults(func=cmd_flower_app)
    sim_help = "run on Flower's simulation runtime (Ray): a local instance or a cluster"
    fs = fl_sub.add_parser("simulate", help=sim_help, description=sim_help)
    fs.add_argument("config", help="experiment TOML")
    fs.add_argument(
        "--out", required=True, type=_folder, help="results folder (results.json, server.log)"
    )
    _set_option(fs)
    _run_config_option(
        fs, "run config, e.g. client-num-cpus=2 client-num-gpus=0.25 ray-address=auto"
    )
    _plugin_option(fs)
    fs.set_defaults(func=cmd_flower_simulate)
    return p


def remove_log_handlers() -> None:
    """Close and remove the root handlers an earlier ``setup_logging`` added (it marks them)."""
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_fedmosaic", False):
            root.removeHandler(h)
            h.close()


def setup_logging(args: argparse.Namespace) -> None:
    """The ``fedmosaic`` logger: level from ``--log-level`` (default info, warning with
    ``--quiet``), to stderr and, with ``--log-file``, to that file as well."""
    name = getattr(args, "log_level", None)
    if name is None:
        name = "warning" if getattr(args, "quiet", False) else "info"
    level = getattr(logging, name.upper())
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    remove_log_handlers()
    root = logging.getLogger()
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    if getattr(args, "log_file", None):
        path = Path(args.log_file)
        if path.is_dir():  # FileHandler's own error would not say which option
            raise ValueError(f"--log-file {path} is a directory, not a file")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            handlers.append(logging.FileHandler(path))
        except OSError as exc:
            raise ValueError(f"--log-file {exc.filename or path}: {exc.strerror or exc}") from exc
    for h in handlers:
        h.setFormatter(fmt)
        h._fedmosaic = True  # type: ignore[attr-defined]
        root.addHandler(h)
    root.setLevel(logging.WARNING)  # other libraries stay quiet
    logging.getLogger("fedmosaic").setLevel(level)


class _NotRaised(Exception):
    """Stands for the round loop's exceptions while it is not imported (none can be raised)."""


def _round_loop() -> Any:
    """``fedmosaic.core.rounds`` where a command has imported it, else None. The CLI does not
    import it itself (it pulls in torch): before it is loaded no round runs, so there is no stop
    flag to set or clear and none of its exceptions can reach ``main``."""
    return sys.modules.get("fedmosaic.core.rounds")


def _loop_error(name: str) -> type[BaseException]:
    """The round loop's exception ``name`` (``Interrupted``, ``Diverged``) for an ``except``
    clause (evaluated only when an exception reaches it)."""
    rounds = _round_loop()
    return getattr(rounds, name) if rounds is not None else _NotRaised


def _on_sigint(signum: int, frame: Any) -> None:
    """First Ctrl-C: stop after the round in progress (checkpoint written); second: now (and
    at once before any round loop is loaded: nothing to save)."""
    rounds = _round_loop()
    if rounds is None or rounds.stop_requested.is_set():
        raise KeyboardInterrupt
    rounds.stop_requested.set()
    print(
        "\nstopping after the round in progress (a checkpoint is written); Ctrl-C again to "
        "stop now without one",
        file=sys.stderr,
        flush=True,
    )


def _clear_stop() -> None:
    rounds = _round_loop()
    if rounds is not None:
        rounds.stop_requested.clear()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # to re-run it portably
    _clear_stop()
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        setup_logging(args)  # inside: a --log-file that cannot be written is one line, exit 2
        load_entry_points()
        add_plugins(getattr(args, "plugin", None) or [])
        return int(args.func(args))
    except (FileNotFoundError, ValueError, KeyError) as exc:  # ConfigError among them
        # Data errors (DatasetError, PartitionError) are ValueErrors with a message naming the input.
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {msg}", file=sys.stderr)
        return 2
    except _loop_error("Interrupted") as caught:
        stop: Any = caught  # the round loop's Interrupted (loaded lazily): saved, round_num
        said = (
            "checkpoint written; rerun the same command with --resume to continue"
            if stop.saved
            else "no checkpoint written, nothing to resume"
        )
        print(f"interrupted after round {stop.round_num}: {said}", file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted (nothing saved for the round in progress)", file=sys.stderr)
        return 130
    except _loop_error("Diverged") as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `fedmosaic list ... | head`: the reader left; nothing to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a read-only or full disk, a path that is a file, ...
        where = f"{exc.filename}: " if exc.filename is not None else ""
        print(f"error: {where}{exc.strerror or exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a library's own error type (safetensors, PIL, ...): one line
        logging.getLogger("fedmosaic").debug("traceback", exc_info=True)
        print(
            f"error: {type(exc).__name__}: {exc} (--log-level debug shows the traceback)",
            file=sys.stderr,
        )
        return 1
    finally:
        _clear_stop()
        if previous is not None:
            signal.signal(signal.SIGINT, previous)


if __name__ == "__main__":
    sys.exit(main())
