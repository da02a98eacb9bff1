"""Parity harness: one fedmosaic federation run by fedmosaic and by a reference library's own code.

Steps (one method, one setting, one seed)::

    export   fedmosaic's per-client train/test rows -> <ref>/dataset/<name>/{train,test}/<cid>.npz
    launch   <ref>/system/main.py, unchanged, in the reference's venv, on CPU (via launch_shim.py)
    read     the reference's per-round per-client test accuracy from its stdout
    run      fedmosaic on the same config (serial backend, one thread)
    write    <out>/<method>_<setting>_s<seed>.json: both curves, both metrics, the commands

The reference checkout is the user's (see README.md); nothing of it is copied here and nothing is
downloaded. Rows are exported as the float32 tensors fedmosaic feeds its models (``normalize =
"half"``: ``x / 255`` then ``(x - 0.5) / 0.5``), which is also what the FMNIST generator HtFLlib
points to (PFLlib's ``generate_FashionMNIST.py``: ``ToTensor`` + ``Normalize([0.5], [0.5])``)
writes, so the reference reads exactly the values fedmosaic trains on.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent

# setting name -> fedmosaic data keys (FedTGP Table 10's two label skews)
SETTINGS: dict[str, dict[str, Any]] = {
    "dir01": {"partition": "dirichlet", "alpha": 0.1},
    "pat2": {"partition": "pathological", "classes_per_client": 2},
}


@dataclass(frozen=True)
class Method:
    """One method on both sides: fedmosaic's algorithm table and the reference's arguments."""

    algorithm: dict[str, Any]  # fedmosaic [algorithm] table
    ref_args: list[str]  # the reference main.py's -algo and method arguments
    notes: str = ""
    plugins: tuple[str, ...] = ()  # fedmosaic plugin files (diagnostic variants)
    # fedmosaic options that reproduce the reference where fedmosaic differs on purpose: name ->
    # keys merged over ``algorithm`` (dotted keys set config keys: ``"train.shuffle"``); each is
    # run on the fedmosaic side too and should track it
    variants: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the fedmosaic metric that evaluates the model the reference evaluates ("acc" unless the
    # reference evaluates another model than the paper, e.g. FedGH's global header)
    ref_mode: str = "acc"


# HtFLlib (commit with the HCNNs8 group) <-> fedmosaic. Hyperparameters as FedTGP's Table 10
# (benchmarks/suites/fedtgp_table10.toml): lambda 0.1 for FedProto/FedTGP, tau 100, 100 server epochs.
# HtFLlib's pipeline: its train loader never shuffles, and every client's model is built right
# after torch.manual_seed(0), so clients of one architecture start identical (ARCH_INIT; with one
# architecture, as PFLlib's, every client starts from one copy of the model)
ARCH_INIT: dict[str, Any] = {"model.init": "architecture"}
PIPELINE: dict[str, Any] = {"train.shuffle": False, **ARCH_INIT}
# FedKD: HtFLlib uploads the compressed mentee itself, and its mentee is the first member
HTFLLIB_KD: dict[str, Any] = {"upload_mode": "state", "mentee_arch": "cnn1"}
HTFLLIB_KD_PIPELINE: dict[str, Any] = {**HTFLLIB_KD, **PIPELINE}
HTFLLIB_FML: dict[str, Any] = {
    "meme_arch": "cnn1",
    "loss_form": "htfllib",
    "server_average": "uniform",
}

HTFLLIB: dict[str, Method] = {
    "local": Method({"name": "local"}, ["-algo", "Local"], variants={"pipeline": PIPELINE}),
    "lg_fedavg": Method(
        {"name": "lg_fedavg"}, ["-algo", "LG-FedAvg"], variants={"pipeline": PIPELINE}
    ),
    "fedproto": Method(
        {"name": "fedproto", "lam": 0.1},
        ["-algo", "FedProto", "-lam", "0.1"],
        "both: MSELoss term, plain mean over holders, nearest global prototype over all classes",
        variants={
            "pipeline": PIPELINE,
            # the two halves of the pipeline, one at a time (which one the gap comes from)
            "no_shuffle": {"train.shuffle": False},
            "arch_init": ARCH_INIT,
            # not the reference's options: fedmosaic's own spread on this split (other initial
            # weights and batch orders); a single client's nearest-prototype collapse decides
            # some splits' means
            "own_seed_1": {"seed": 1001},
            "own_seed_2": {"seed": 1002},
        },
    ),
    # diagnostic: FedProto uploading the reference's training-time prototypes (variants.py)
    "fedproto_train_protos": Method(
        {"name": "fedproto_train_protos", "lam": 0.1},
        ["-algo", "FedProto", "-lam", "0.1"],
        "fedmosaic FedProto with the reference's training-time local prototypes",
        (str(HERE / "variants.py"),),
    ),
    "fedtgp": Method(
        {
            "name": "fedtgp",
            "distance": "mse",
            "lam": 0.1,
            "tau": 100.0,
            "server_epochs": 100,
            "stale_prototypes": True,
        },
        ["-algo", "FedTGP", "-lam", "0.1", "-mart", "100", "-se", "100"],
        "fedmosaic's code form (MSELoss, stale prototypes) with lambda 0.1",
        variants={"pipeline": PIPELINE},
    ),
    # FedTGP as the claims page judges its code form (the authors' run script's -lam 10); its
    # "paper_form" variant is fedmosaic's paper form (Euclidean term, lambda 0.1, fresh
    # prototypes), which HtFLlib does not implement: a gap there is the two forms', not parity's
    "fedtgp_code": Method(
        {
            "name": "fedtgp",
            "distance": "mse",
            "lam": 10.0,
            "tau": 100.0,
            "server_epochs": 100,
            "stale_prototypes": True,
        },
        ["-algo", "FedTGP", "-lam", "10", "-mart", "100", "-se", "100"],
        "fedmosaic's code form (MSELoss, stale prototypes) with the authors' lambda 10",
        variants={
            "pipeline": PIPELINE,
            "paper_form": {"distance": "euclidean", "lam": 0.1, "stale_prototypes": False},
        },
    ),
    # FedGH: one server epoch at the paper's eta_g = 0.01 on both sides (HtFLlib's -se default is
    # 100). HtFLlib evaluates each client right after it received the global header, i.e.
    # fedmosaic's acc_global; fedmosaic's acc (the paper's) is the locally trained head.
    "fedgh": Method(
        {"name": "fedgh", "eta_g": 0.01, "server_epochs": 1},
        ["-algo", "FedGH", "-slr", "0.01", "-se", "1"],
        "reference evaluates encoder + global header (fedmosaic acc_global); its server step "
        "pools all (LAR, label) pairs into shuffled batches of 10",
        variants={
            "server_batch_10": {"server_batch_size": 10},
            # that step with HtFLlib's data pipeline (unshuffled loader, per-architecture weights)
            "pipeline_batch_10": {"server_batch_size": 10, **PIPELINE},
            # and LARs over its unshuffled drop_last loader (the ragged tail left out): the whole
            # of HtFLlib's form
            "htfllib_form": {"server_batch_size": 10, "lar_batch": 10, **PIPELINE},
            # HtFLlib's step with each half of its pipeline alone (which half moves the header)
            "batch_10_no_shuffle": {"server_batch_size": 10, "train.shuffle": False},
            "batch_10_arch_init": {"server_batch_size": 10, **ARCH_INIT},
        },
        ref_mode="acc_global",
    ),
    "feddistill": Method(
        {"name": "feddistill", "lam": 1.0},
        ["-algo", "FedDistill", "-lam", "1"],
        "fedmosaic default: the paper's MSE to the leave-one-out mean; the reference: soft-target "
        "CE to the mean over all holders",
        variants={"htfllib_form": {"distill": "kl", "average": "all"}},
    ),
    "fml": Method(
        {"name": "fml", "alpha": 0.5, "beta": 0.5},
        ["-algo", "FML", "-al", "0.5", "-bt", "0.5"],
        "both alpha = beta = 0.5 (HtFLlib's defaults 1.0 switch the KL terms off); the reference's "
        "KLDivLoss 'mean' is 1/C of fedmosaic's batchmean",
        variants={
            "meme_cnn1": {"meme_arch": "cnn1"},
            # HtFLlib's meme with its data pipeline (unshuffled loader, per-architecture weights)
            "pipeline_cnn1": {"meme_arch": "cnn1", **PIPELINE},
            # HtFLlib's meme, loss (undetached KL over B * C) and uniform server mean: all of
            # clientfml/serverfml but its gradient clipping; then with its data pipeline too
            "htfllib_form": HTFLLIB_FML,
            "htfllib_all": {**HTFLLIB_FML, **PIPELINE},
            # the form's two pieces apart, each with HtFLlib's meme
            "htfllib_loss": {"meme_arch": "cnn1", "loss_form": "htfllib"},
            "htfllib_average": {"meme_arch": "cnn1", "server_average": "uniform"},
        },
    ),
    "fedkd": Method(
        {"name": "fedkd", "T_start": 0.95, "T_end": 0.98},
        ["-algo", "FedKD", "-mlr", "0.01", "-Ts", "0.95", "-Te", "0.98"],
        "fedmosaic default uploads the SVD-compressed update (paper); the reference the compressed "
        "mentee itself",
        variants={
            "htfllib_form": HTFLLIB_KD,
            # everything of HtFLlib's that fedmosaic can reproduce (all but its gradient
            # clipping and uniform server average), then the pieces one at a time
            "htfllib_all": {**HTFLLIB_KD_PIPELINE, "loss_form": "htfllib", "svd_form": "htfllib"},
            "pipeline_form": HTFLLIB_KD_PIPELINE,
            "htfllib_loss": {**HTFLLIB_KD_PIPELINE, "loss_form": "htfllib"},
            "htfllib_svd": {**HTFLLIB_KD_PIPELINE, "svd_form": "htfllib"},
        },
    ),
    "fedgen": Method(
        {
            "name": "fedgen",
            "noise_dim": 32,
            "generator_lr": 0.1,
            "hidden_dim": 512,
            "generator_steps": 100,
        },
        ["-algo", "FedGen", "-nd", "32", "-glr", "0.1", "-hd", "512", "-se", "100"],
        "fedmosaic trains a persistent generator with the diversity term; the reference's "
        "generator is never updated (train_generator trains a copy it does not save)",
        variants={"no_diversity": {"eta": 0.0}},
    ),
}


# PFLlib (FedAvgCNN, one architecture) <-> fedmosaic ``fedavgcnn``: methods that share whole
# models or bodies. PFLlib prints no per-client accuracies: the launch shim prints the ones its
# server already computes (``PARITY_PRINT_CLIENTS``), in HtFLlib's format, without changing the run.
PFLLIB: dict[str, Method] = {
    "fedavg": Method(
        {"name": "fedavg"},
        ["-algo", "FedAvg"],
        "both evaluate the global model",
        # not the reference's options: fedmosaic's own spread on this split (other initial
        # weights and batch orders), beside the reference's (--ref-seed-offset)
        variants={"own_seed_1": {"seed": 1001}, "own_seed_2": {"seed": 1002}},
    ),
    "fedprox": Method(
        {"name": "fedprox", "mu": 0.01},
        ["-algo", "FedProx", "-mu", "0.01"],
        "both: mu/2 ||w - w_global||^2 (PFLlib adds mu (w - w_global) to the gradient)",
    ),
    # PFLlib starts every client from a copy of one model (main.py seeds torch once); fedmosaic's
    # clients draw their own weights (the global part is replaced in round 1, the heads are not).
    # FedRoD's personal head has its own init stream, which model.init does not change: its
    # one_init run equals the default, kept as the record of that; pfllib_init also starts each
    # personal head as a copy of the initial generic head, as PFLlib's clientROD does
    "fedper": Method({"name": "fedper"}, ["-algo", "FedPer"], variants={"one_init": ARCH_INIT}),
    "fedrep": Method(
        {"name": "fedrep", "head_epochs": 1},
        ["-algo", "FedRep", "-pls", "1"],
        variants={"one_init": ARCH_INIT},
    ),
    "fedrod": Method(
        {"name": "fedrod"},
        ["-algo", "FedROD"],
        variants={
            "one_init": ARCH_INIT,
            "pfllib_init": {**ARCH_INIT, "personal_init": "generic"},
        },
    ),
    "fedbabu": Method(
        {"name": "fedbabu", "finetune_epochs": 5, "finetune_part": "all"},
        ["-algo", "FedBABU", "-fte", "5"],
        "both fine-tune the whole model for 5 epochs after the last round",
    ),
}


@dataclass(frozen=True)
class Library:
    """A reference library: its launch arguments, model, methods and how it reports."""

    name: str
    model_args: tuple[str, ...]  # main.py's model arguments
    model: dict[str, Any]  # the fedmosaic [model] table that builds the same networks
    dataset_prefix: str  # exported dataset folder name prefix
    methods: dict[str, Method]
    print_clients: bool = False  # the shim prints per-client accuracies (the library does not)
    stem_prefix: str = ""  # result file name prefix


LIBRARIES: dict[str, Library] = {
    # HtFLlib's HCNNs8 = htfe8-gray member for member (client i gets member i mod 8); its feature
    # layer is 512-d, so the parameter-free pool is the identity, as in HtFLlib
    "htfllib": Library(
        "HtFLlib",
        ("-m", "HCNNs8"),
        {"family": "htfe8-gray", "feature_dim": 512, "projection": "pool"},
        "parity_fmnist",
        HTFLLIB,
    ),
    # PFLlib's "-m CNN" is FedAvgCNN with the 1024-d flatten only when "MNIST" is in the dataset
    # name (main.py), hence the upper-case prefix; fedavgcnn's fc1 is 512-d (pool = identity)
    "pfllib": Library(
        "PFLlib",
        ("-m", "CNN"),
        {"family": "fedavgcnn", "feature_dim": 512, "projection": "pool"},
        "parity_FMNIST",
        PFLLIB,
        print_clients=True,
        stem_prefix="pfllib_",
    ),
}


@dataclass
class Setup:
    """The shared experiment: data split, model group, training hyperparameters."""

    setting: str = "dir01"
    subsample: float = 0.05
    num_clients: int = 20
    rounds: int = 40
    seed: int = 0
    batch_size: int = 10
    lr: float = 0.01
    local_epochs: int = 1
    library: str = "htfllib"
    extra: dict[str, Any] = field(default_factory=dict)

    def fedmosaic_config(
        self, algorithm: dict[str, Any], plugins: tuple[str, ...] = ()
    ) -> dict[str, Any]:
        """The fedmosaic config (as a dict for ``fedmosaic.config.from_dict``).

        Keys of ``algorithm`` with a dot (``"train.shuffle"``) set that config key instead (a
        variant's pipeline options); ``"seed"`` runs fedmosaic with that experiment seed on this
        setup's split (``data.split_seed``): its own run-to-run spread.
        """
        algorithm = dict(algorithm)
        dotted = {k: algorithm.pop(k) for k in list(algorithm) if "." in k}
        own_seed = algorithm.pop("seed", None)  # fedmosaic's own streams on this very split
        cfg = {
            "seed": self.seed,
            "plugins": list(plugins),
            "data": {
                "dataset": "fmnist",
                "num_clients": self.num_clients,
                "split": "pool_75_25",
                "val_fraction": 0.0,
                "subsample": self.subsample,
                "normalize": "half",
                **SETTINGS[self.setting],
            },
            "model": dict(LIBRARIES[self.library].model),
            "train": {
                "rounds": self.rounds,
                "participation": 1.0,
                "local_epochs": self.local_epochs,
                "batch_size": self.batch_size,
                "drop_last": True,  # both references' train loaders drop the ragged last batch
                "lr": self.lr,
                "optimizer": "sgd",
                "eval_every": 1,
            },
            "sim": {"backend": "serial", "threads": 1},
            # the references have no peer guard: fedmosaic's (server.peer_factor = 10) dropped
            # honest round-1 uploads of FedDistill on this split, so it is off, like for like
            "server": {"peer_factor": 0.0},
            "algorithm": algorithm,
        }
        for key, value in dotted.items():
            section, name = key.split(".")
            cfg[section][name] = value
        if own_seed is not None:
            cfg["seed"] = own_seed
            cfg["data"]["split_seed"] = self.seed
        return cfg

    def stem(self, method: str) -> str:
        """The result file's stem: ``<method>_<setting>_s<seed>``, with ``_n<clients>`` and
        ``_f<fraction>`` where they differ from the page's 20 clients and 5% of FMNIST (the
        results of other client counts or fractions never take another run's file)."""
        out = f"{LIBRARIES[self.library].stem_prefix}{method}_{self.setting}_s{self.seed}"
        if self.num_clients != Setup.num_clients:
            out += f"_n{self.num_clients}"
        if self.subsample != Setup.subsample:
            out += "_f" + f"{self.subsample:g}".replace(".", "p")
        return out

    @property
    def name(self) -> str:
        """The dataset folder name in the reference checkout (one per split)."""
        sub = f"{self.subsample:g}".replace(".", "p")
        prefix = LIBRARIES[self.library].dataset_prefix
        return f"{prefix}_{self.setting}_{sub}_n{self.num_clients}_s{self.seed}"


# ------------------------------------------------------------------------------------------ export


def build_split(setup: Setup) -> Any:
    """fedmosaic's federated data for ``setup`` (the rows its clients hold)."""
    from fedmosaic.config import from_dict
    from fedmosaic.data.federated import build_federated_data

    cfg = from_dict(setup.fedmosaic_config({"name": "local"}))
    return build_federated_data(cfg.data, cfg.seed)


def export(fd: Any, dest: Path, extra_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write ``fd``'s clients in the PFLlib/HtFLlib layout under ``dest`` (= ``<ref>/dataset/<name>``).

    ``train/<cid>.npz`` and ``test/<cid>.npz`` hold ``data = {"x": float32 [N, C, H, W], "y":
    int64 [N]}`` (what the reference's ``read_data`` loads) in fedmosaic's row order, plus ``rows``
    (int64 [N], fedmosaic's dataset indices; the reference ignores it) so an export can be checked.
    ``config.json`` records the split as the reference's generators do. Returns that config.
    """
    if fd.num_clients and any(cs.val.numel() for cs in fd.clients):
        raise ValueError(
            "export needs data.val_fraction = 0: the reference has no validation split"
        )
    sizes: dict[str, list[int]] = {"train": [], "test": []}
    for split in ("train", "test"):
        (dest / split).mkdir(parents=True, exist_ok=True)
        for cid, cs in enumerate(fd.clients):
            rows = cs.get(split)
            x = fd.batch(rows).numpy().astype(np.float32)
            y = fd.labels[rows].numpy().astype(np.int64)
            _atomic_npz(dest / split / f"{cid}.npz", data={"x": x, "y": y}, rows=rows.numpy())
            sizes[split].append(int(rows.numel()))
    hist = fd.label_histograms("all")
    config = {
        "num_clients": fd.num_clients,
        "num_classes": fd.num_classes,
        "Size of samples for labels in clients": [
            [[c, int(n)] for c, n in enumerate(row) if n] for row in hist
        ],
        "train_sizes": sizes["train"],
        "test_sizes": sizes["test"],
        "normalize": {"mean": fd.mean.tolist(), "std": fd.std.tolist()},
        "exported_by": "fedmosaic benchmarks/parity",
        **(extra_config or {}),
    }
    tmp = dest / f".config.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(config, indent=1))
    os.replace(tmp, dest / "config.json")
    return config


def _atomic_npz(path: Path, **arrays: Any) -> None:
    """Write an ``.npz`` under a temporary name, then rename: a reference run reading the same
    split (it re-reads its files every round) never sees a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)
    os.replace(tmp, path)


def read_export(dest: Path, split: str, cid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(x, y, rows)`` of one exported client file, read as the reference reads it."""
    with open(dest / split / f"{cid}.npz", "rb") as f:
        z = np.load(f, allow_pickle=True)
        data = z["data"].tolist()
        return np.asarray(data["x"]), np.asarray(data["y"]), z["rows"]


# ------------------------------------------------------------------------------------ read back

_ROUND = re.compile(r"^-+Round number: (\d+)-+$")
_CLIENT = re.compile(r"^Client (\d+): Acc: ([-+0-9.eE]+|nan)")
_AVG = re.compile(r"^Averaged Test Accur(?:an|a)cy: ([0-9.]+)")
# PFLlib's FedBABU evaluates once more after every client fine-tuned (no round number)
_FINETUNED = re.compile(r"^-+Evaluate fine-tuned personalized models-+$")


def parse_reference_log(text: str, test_sizes: list[int]) -> list[dict[str, Any]]:
    """Per-round accuracies from HtFLlib's/PFLlib's stdout.

    Their server prints ``-----Round number: r-----`` *before* training round ``r`` (so it is the
    accuracy after ``r`` rounds; ``r = 0`` is the initial models; PFLlib's FedBABU adds one
    ``finetuned`` record after its fine-tuning), then one ``Client <id>: Acc:
    <correct/n>`` line per client and ``Averaged Test Accurancy`` (correct / total over clients, 4
    decimals). ``acc_weighted`` is recomputed at full precision from the client lines and the exported
    test sizes; ``acc_printed`` keeps the printed value as a check. ``acc_mean`` is the plain mean of
    the per-client accuracies.
    """
    out: list[dict[str, Any]] = []
    cur: dict[str, Any] | None = None
    for line in text.splitlines():
        line = line.strip()
        if m := _ROUND.match(line):
            cur = {"round": int(m.group(1)), "client_acc": {}}
        elif _FINETUNED.match(line):
            last = out[-1]["round"] if out else 0
            cur = {"round": last, "finetuned": True, "client_acc": {}}
        elif cur is not None and (m := _CLIENT.match(line)):
            cur["client_acc"][int(m.group(1))] = float(m.group(2))
        elif cur is not None and (m := _AVG.match(line)):
            accs = cur.pop("client_acc")
            ids = sorted(accs)
            if ids != list(range(len(test_sizes))):
                raise ValueError(
                    f"round {cur['round']}: client lines {ids}, expected 0..{len(test_sizes) - 1}"
                )
            n = np.asarray(test_sizes, dtype=np.float64)
            a = np.asarray([accs[i] for i in ids], dtype=np.float64)
            cur["acc_weighted"] = float((a * n).sum() / n.sum())
            cur["acc_mean"] = float(a.mean())
            cur["acc_printed"] = float(m.group(1))
            if abs(cur["acc_printed"] - cur["acc_weighted"]) > 5e-5 + 1e-9:  # printed: 4 decimals
                raise ValueError(
                    f"round {cur['round']}: printed accuracy {cur['acc_printed']} but the client "
                    f"lines weighted by the exported test sizes give {cur['acc_weighted']:.6f}"
                )
            cur["client_acc"] = a.tolist()
            out.append(cur)
            cur = None
    return out


# ------------------------------------------------------------------------------------- the sides


def _ref_command(python: str, setup: Setup, method: Method) -> list[str]:
    """The reference launch: its ``main.py`` arguments for ``setup`` and ``method``."""
    return [
        python,
        str(HERE / "launch_shim.py"),
        "-data", setup.name,
        *LIBRARIES[setup.library].model_args,
        "-ncl", "10",
        "-dev", "cpu",
        "-nc", str(setup.num_clients),
        "-jr", "1",
        "-lbs", str(setup.batch_size),
        "-lr", str(setup.lr),
        "-ls", str(setup.local_epochs),
        "-gr", str(setup.rounds),
        "-fd", "512",
        "-eg", "1",
        "-t", "1",
        *method.ref_args,
    ]  # fmt: skip


def run_reference(
    ref: Path,
    python: str,
    setup: Setup,
    method: Method,
    log: Path,
    threads: int = 1,
    seed_offset: int = 0,
    seed_globals: int | None = None,
) -> tuple[list[str], float]:
    """Run the reference's ``system/main.py`` (unchanged, through the launch shim) on CPU; its
    stdout goes to ``log``. Returns the command and the wall time."""
    cmd = _ref_command(python, setup, method)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env.pop("PYTHONPATH", None)  # the reference's venv, not ours
    # It torch.save()s whole modules between rounds and loads them back with torch.load's pre-2.6
    # default (weights_only=False); our pinned torch 2.13 needs this switch to keep that default
    env["TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD"] = "1"
    if LIBRARIES[setup.library].print_clients:
        env["PARITY_PRINT_CLIENTS"] = "1"
    env["PARITY_SEED_OFFSET"] = str(seed_offset)  # 0: the reference's own seeds
    # "": numpy's and Python's generators left unseeded, as the reference leaves them
    env["PARITY_SEED_GLOBALS"] = "" if seed_globals is None else str(seed_globals)
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(cmd, cwd=ref / "system", stdout=f, stderr=subprocess.STDOUT, env=env)
    if proc.returncode:
        raise RuntimeError(f"reference run failed (exit {proc.returncode}); see {log}")
    return cmd, time.perf_counter() - start


def _kept(key: str) -> bool:
    """Round-record keys a parity result keeps: every test-accuracy mode, both metrics."""
    return key == "round" or (key.startswith("acc") and key.endswith(("_weighted", "_mean")))


def run_fedmosaic(
    setup: Setup, method: Method, algorithm: dict[str, Any] | None = None
) -> tuple[list[dict[str, Any]], float]:
    """fedmosaic's per-round records (``round`` = rounds trained so far) and the wall time;
    ``algorithm`` replaces the method's table (a variant)."""
    from fedmosaic.config import from_dict
    from fedmosaic.experiment import run_experiment

    cfg = from_dict(setup.fedmosaic_config(algorithm or method.algorithm, method.plugins))
    start = time.perf_counter()
    doc = run_experiment(cfg, progress=False)
    rounds = [
        {k: v for k, v in r.items() if _kept(k)} for r in doc["rounds"] if "acc_weighted" in r
    ]
    # the last round's per-client accuracies, as the reference log has them for every round
    rounds[-1]["client_acc"] = [
        c["acc"] for c in sorted(doc["clients"], key=lambda c: c["client_id"])
    ]
    tuned = doc["summary"].get("after_finetune")
    if tuned:  # the method's local fine-tuning after the last round (FedBABU)
        rec = {k: v for k, v in tuned.items() if _kept(k)}
        rounds.append({"round": rounds[-1]["round"], "finetuned": True, **rec})
    return rounds, time.perf_counter() - start


def _reference_setup(setup: dict[str, Any]) -> dict[str, Any]:
    """The part of a recorded setup the reference's run depends on (not fedmosaic's server)."""
    return {k: v for k, v in setup.items() if k not in ("server", "algorithm", "plugins")}


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    """Replace ``path`` atomically (a reader never sees half a result)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, path)


# the fields of a stored result the harness reads back, and their JSON types
RESULT_FIELDS: dict[str, type] = {
    "setup": dict,
    "reference": dict,
    "fedmosaic": dict,
    "variants": dict,
    "train_sizes": list,
    "test_sizes": list,
}


def _read_result(path: Path) -> dict[str, Any]:
    """An earlier result of the harness; a missing, unreadable or malformed one is named."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SystemExit(f"{path}: not a readable parity result ({e})") from None
    if not isinstance(doc, dict):
        raise SystemExit(f"{path}: not a parity result (a JSON object is expected)")
    for key, kind in RESULT_FIELDS.items():
        if key in doc and not isinstance(doc[key], kind):
            raise SystemExit(
                f"{path}: not a parity result ({key} is a {type(doc[key]).__name__}, "
                f"a {kind.__name__} is expected)"
            )
    for key in ("data",):
        if "setup" in doc and not isinstance(doc["setup"].get(key, {}), dict):
            raise SystemExit(f"{path}: not a parity result (setup.{key} is not an object)")
    command = doc.get("reference", {}).get("command", [])
    if not isinstance(command, list):
        raise SystemExit(f"{path}: not a parity result (reference.command is not a list)")
    return doc


def register_setting(partition: str, alpha: float, classes_per_client: int) -> str:
    """The name of a split given by its parameters (``dir0.5`` -> ``dir05``, ``pat3``),
    registered in SETTINGS so that the setup, the export and the result files use it."""
    if partition == "dirichlet":
        name = "dir" + f"{alpha:g}".replace(".", "")
        spec: dict[str, Any] = {"partition": "dirichlet", "alpha": alpha}
    else:
        name = f"pat{classes_per_client}"
        spec = {"partition": "pathological", "classes_per_client": classes_per_client}
    known = SETTINGS.get(name)
    if known is not None and known != spec:  # e.g. a name clash of two alphas
        raise SystemExit(f"setting {name} is already {known}, not {spec}")
    SETTINGS[name] = spec
    return name


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse a bad run argument in one line (exit 2), before anything is built or written, as
    the library's command line does (``split_setup`` checks the split's)."""
    if a.rounds < 1:
        p.error(f"--rounds {a.rounds}: at least 1")
    if a.out.exists() and not a.out.is_dir():
        p.error(f"--out {a.out}: a file, not a folder")
    if a.ref_seed_offset < 0:
        p.error(f"--ref-seed-offset {a.ref_seed_offset}: >= 0")
    if a.ref_seed_globals is not None and not 0 <= a.ref_seed_globals < 2**32:
        p.error(f"--ref-seed-globals {a.ref_seed_globals}: 0 to 2**32 - 1 (numpy's seeds)")
    if a.ref_repeat < 0:
        p.error(f"--ref-repeat {a.ref_repeat}: >= 0")


def _cpu() -> str:
    """This host's processor model (recorded per side: two hosts' runs differ in rounding)."""
    from fedmosaic.provenance import host

    return str(host()["cpu"])


def add_split_arguments(p: argparse.ArgumentParser) -> None:
    """The method and split arguments (also ``grad_norms.py``'s); ``split_setup`` reads them."""
    p.add_argument("method", help="a key of the library's table (HTFLLIB, PFLLIB)")
    p.add_argument("--library", choices=sorted(LIBRARIES), default="htfllib")
    p.add_argument(
        "--setting",
        choices=sorted(SETTINGS),
        default="dir01",
        help="a named split; --partition gives any other",
    )
    p.add_argument(
        "--partition",
        choices=["dirichlet", "pathological"],
        help="any split instead of --setting: Dirichlet label skew (--alpha) or K classes per "
        "client (--classes-per-client); named dir<alpha> / pat<K> in the results",
    )
    p.add_argument("--alpha", type=float, help="--partition dirichlet's alpha (default 0.1)")
    p.add_argument(
        "--classes-per-client", type=int, help="--partition pathological's K (default 2)"
    )
    p.add_argument("--subsample", type=float, default=0.05)
    p.add_argument("--clients", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)


def split_setup(
    p: argparse.ArgumentParser, a: argparse.Namespace, rounds: int
) -> tuple[Setup, Method]:
    """The checked split of ``add_split_arguments``' arguments and the method: a bad one is
    refused in one line (exit 2) before anything is built."""
    lib = LIBRARIES[a.library]
    if a.method not in lib.methods:
        p.error(f"{lib.name} methods: {', '.join(sorted(lib.methods))}")
    if a.clients < 2:
        p.error(f"--clients {a.clients}: at least 2 clients")
    if not (math.isfinite(a.subsample) and 0 < a.subsample <= 1):
        p.error(f"--subsample {a.subsample}: a fraction in (0, 1]")
    if a.seed < 0:
        p.error(f"--seed {a.seed}: a seed is >= 0")
    if a.partition is None and (a.alpha is not None or a.classes_per_client is not None):
        p.error("--alpha and --classes-per-client need --partition")
    if a.alpha is None:
        a.alpha = 0.1
    if a.classes_per_client is None:
        a.classes_per_client = 2
    if a.partition == "dirichlet" and not (math.isfinite(a.alpha) and a.alpha > 0):
        p.error(f"--alpha {a.alpha}: a positive number")
    if a.partition == "pathological" and not 1 <= a.classes_per_client <= 10:
        p.error(f"--classes-per-client {a.classes_per_client}: 1 to 10 (FMNIST's classes)")
    if a.partition is not None:
        a.setting = register_setting(a.partition, a.alpha, a.classes_per_client)
    setup = Setup(a.setting, a.subsample, a.clients, rounds, a.seed, library=a.library)
    return setup, lib.methods[a.method]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_split_arguments(p)
    p.add_argument(
        "--ref", type=Path, required=True, help="the library's checkout (has system/main.py)"
    )
    p.add_argument("--ref-python", default=os.environ.get("PARITY_REF_PYTHON", sys.executable))
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--out", type=Path, default=HERE / "results")
    p.add_argument(
        "--skip",
        choices=["reference", "fedmosaic", "variants"],
        action="append",
        default=[],
        help="leave out a side or the fedmosaic variants (repeatable); a side left out is kept "
        "from an earlier result of the same run, if there is one",
    )
    p.add_argument(
        "--ref-seed-offset",
        type=int,
        default=0,
        help="seed the reference's torch.manual_seed(s) calls with s + K (its own run-to-run "
        "spread on this split); the result is <run>_r<K>.json, fedmosaic's side kept from <run>",
    )
    p.add_argument(
        "--ref-seed-globals",
        type=int,
        default=None,
        metavar="S",
        help="seed the reference's numpy and Python generators (unseeded by the reference: its "
        "client selection and upload order vary between identical runs); the result is "
        "<run>_g<S>.json, fedmosaic's side kept from <run>",
    )
    p.add_argument(
        "--ref-repeat",
        type=int,
        default=0,
        metavar="K",
        help="run the reference again, unchanged, on the identical inputs (its run-to-run spread "
        "with nothing changed); the result is <run>_u<K>.json, fedmosaic's side kept from <run>",
    )
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        help="run only these of the method's variants (repeatable; default: all)",
    )
    p.add_argument(
        "--reference-from",
        type=Path,
        help="take the reference side from this earlier result (same split and reference "
        "arguments, e.g. a diagnostic variant of fedmosaic's method) instead of running it",
    )
    a = p.parse_args(argv)
    _check_args(p, a)
    setup, method = split_setup(p, a, a.rounds)
    lib = LIBRARIES[a.library]
    base_stem = setup.stem(a.method)
    stem = base_stem + (f"_r{a.ref_seed_offset}" if a.ref_seed_offset else "")
    stem += "" if a.ref_seed_globals is None else f"_g{a.ref_seed_globals}"
    stem += f"_u{a.ref_repeat}" if a.ref_repeat else ""
    # a run of the reference under other seeds than its own, or again, keeps fedmosaic's side of
    # the base run
    ref_variant = bool(a.ref_seed_offset) or a.ref_seed_globals is not None or bool(a.ref_repeat)
    # plugin files recorded relative to the repository (no machine path in the record)
    fm_setup = setup.fedmosaic_config(
        method.algorithm, tuple(os.path.relpath(f, HERE.parents[1]) for f in method.plugins)
    )
    keep = a.out / f"{base_stem}.json"
    if "fedmosaic" in a.skip and not ref_variant and keep.exists():
        # fedmosaic's side (and its variants) is kept only from a run of the same config; refuse
        # before running anything rather than drop it
        old_setup = _read_result(keep).get("setup")
        if old_setup != fm_setup:
            raise SystemExit(
                f"{keep.name} was recorded with another fedmosaic config, so --skip fedmosaic "
                "cannot keep its side: run fedmosaic's side again (without --skip fedmosaic)"
            )
    if not (a.ref / "system" / "main.py").is_file():
        # checked before the split is exported into <ref>/dataset: nothing is created there
        p.error(f"--ref {a.ref}: not a checkout of the reference (no system/main.py)")
    a.out.mkdir(parents=True, exist_ok=True)
    dest = a.ref / "dataset" / setup.name
    fd = build_split(setup)
    config = export(fd, dest, {"fedmosaic_data": setup.fedmosaic_config({})["data"]})
    doc: dict[str, Any] = {
        "method": a.method,
        "setting": a.setting,
        "setup": fm_setup,
        "library": a.library,
        "reference": {"library": lib.name, "checkout": a.ref.name},  # no machine path
        "notes": method.notes,
        "ref_mode": method.ref_mode,
        "ref_seed_offset": a.ref_seed_offset,
        "ref_seed_globals": a.ref_seed_globals,
        "ref_repeat": a.ref_repeat,
        "train_sizes": config["train_sizes"],
        "test_sizes": config["test_sizes"],
    }
    commit = a.ref / "COMMIT"
    if commit.exists():
        doc["reference"]["commit"] = commit.read_text().strip()
    if a.reference_from:
        earlier = _read_result(a.reference_from)
        same = earlier["setup"]["data"] == doc["setup"]["data"]
        same &= earlier["reference"]["command"][2:] == _ref_command("", setup, method)[2:]
        if not same:
            raise SystemExit(f"{a.reference_from}: another split or other reference arguments")
        doc["reference"] = {**earlier["reference"], "from": str(a.reference_from)}
    elif "reference" not in a.skip:
        log = a.out / f"{stem}.ref.log"
        cmd, secs = run_reference(
            a.ref,
            a.ref_python,
            setup,
            method,
            log,
            seed_offset=a.ref_seed_offset,
            seed_globals=a.ref_seed_globals,
        )
        doc["reference"].update(
            # as run, without this machine's paths: the venv's python and the shim in this repo
            command=["<ref-python>", "benchmarks/parity/launch_shim.py", *cmd[2:]],
            seconds=round(secs, 1),
            cpu=_cpu(),  # the processor it ran on: runs on two hosts differ in rounding
            rounds=parse_reference_log(log.read_text(), config["test_sizes"]),
        )
    path = a.out / f"{stem}.json"
    base = a.out / f"{base_stem}.json"  # a seed-offset run keeps fedmosaic's side of the base run
    source = path if path.exists() or not ref_variant else base
    earlier = _read_result(source) if source.exists() else {}
    # keep what is not run again: the reference's side for the same split, model and training
    # (fedmosaic's server settings do not reach it); fedmosaic's sides for the same config
    same_ref = _reference_setup(earlier.get("setup", {})) == _reference_setup(doc["setup"])
    if same_ref and "reference" in a.skip and "reference" in earlier and not a.reference_from:
        doc["reference"] = earlier["reference"]
    if earlier.get("setup") == doc["setup"]:
        if "fedmosaic" in a.skip and "fedmosaic" in earlier:
            doc["fedmosaic"] = earlier["fedmosaic"]
        doc["variants"] = earlier.get("variants", {})
    _write_json(path, doc)  # after each side: a later failure keeps what finished
    if "fedmosaic" not in a.skip:
        rounds, secs = run_fedmosaic(setup, method)
        doc["fedmosaic"] = {"seconds": round(secs, 1), "cpu": _cpu(), "rounds": rounds}
        _write_json(path, doc)
    unknown = set(a.variant) - set(method.variants)
    if unknown:
        raise SystemExit(f"{a.method} has no variant {sorted(unknown)}: {sorted(method.variants)}")
    if "variants" not in a.skip and method.variants:
        doc.setdefault("variants", {})
        for name, keys in method.variants.items():
            if a.variant and name not in a.variant:
                continue
            algorithm = {**method.algorithm, **keys}
            rounds, secs = run_fedmosaic(setup, method, algorithm)
            doc["variants"][name] = {
                "algorithm": algorithm,
                "seconds": round(secs, 1),
                "rounds": rounds,
            }
            _write_json(path, doc)
    print(path)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit as e:
        # a refusal (SystemExit with its one-line message) exits 2 like argparse's, not 1
        if isinstance(e.code, str):
            print(f"{Path(sys.argv[0]).name}: error: {e.code}", file=sys.stderr)
            sys.exit(2)
        raise
