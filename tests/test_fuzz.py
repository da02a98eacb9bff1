"""Fuzzing every numeric config key, through ``from_dict`` and the CLI (issue 12).

The keys come from the config dataclasses (``config.SECTIONS``, ``seed``) and from every
registered algorithm's hyperparameters, so a key added tomorrow is fuzzed without editing this
file. Each bad value must either be refused with a :class:`ConfigError` naming the key, or be
legitimately valid (the small, explained allow-lists below). Hostile data files through the CLI:
tests/data/test_fuzz_files.py.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing

import pytest
from helpers.experiments import SMALL, tiny_raw, write_toml

from fedmosaic.algorithms import ALGORITHMS
from fedmosaic.cli import main
from fedmosaic.config import SECTIONS, ConfigError, from_dict

# Bad values for a number: name -> (value, how it reads on the command line).
BAD = {
    "nan": (math.nan, "nan"),
    "inf": (math.inf, "inf"),
    "-inf": (-math.inf, "-inf"),
    "huge-int": (2**70, str(2**70)),
    "huge-float": (1e300, "1e300"),
    "string": ("x", '"x"'),
    "list": ([1], "[1]"),
}
# Values that are wrong for most numbers but a legitimate setting for some.
EDGE = {"negative": (-1, "-1"), "zero": (0, "0")}

# ``key`` (dotted; algorithm keys as "<method>.<key>") -> why 0 is a valid setting.
ZERO_OK = {
    "seed": "a seed",
    "data.min_size": "no minimum client size",
    "data.split_seed": "a seed",
    "data.val_fraction": "no validation split",
    "data.public_size": "no public split (methods that need one check the FederationSpec)",
    "data.server_eval_size": "no server evaluation split",
    "data.power_law_exponent": "equal client sizes",
    "data.shift_rotation": "feature shift off",
    "data.shift_brightness": "feature shift off",
    "data.shift_domains": "a transform per client",
    "train.clients_per_round": "use train.participation",
    "train.momentum": "plain SGD",
    "train.weight_decay": "no weight decay",
    "train.finetune_epochs": "no fine-tuning",
    "train.plateau_delta": "plateau stopping off",
    "sim.threads": "torch's default",
    "sim.workers": "one per CPU core",
    "eval.holdout_clients": "every client trains",
    "server.trim": "trimmed mean with nothing trimmed (the mean)",
    "server.f": "krum tolerating no Byzantine client",
    "server.clip_update_norm": "no clipping",
    "server.max_norm_ratio": "magnitude check off",
    "server.peer_factor": "peer guard off",
    "privacy.noise_multiplier": "clipping only (an infinite epsilon, reported)",
    "privacy.target_epsilon": "no target",
    "privacy.epsilon": "the noise multiplier as given",
    "privacy.sample_clip": "DP-SGD off",
    "privacy.sample_noise_multiplier": "DP-SGD's clipping only",
    # server optimizers: no first/second moment memory; FedAvgM has no tau at all
    "fedadagrad.beta1": "no momentum",
    "fedadagrad.beta2": "no second-moment memory",
    "fedadam.beta1": "no momentum",
    "fedadam.beta2": "no second-moment memory",
    "fedyogi.beta1": "no momentum",
    "fedyogi.beta2": "no second-moment memory",
    "fedavgm.beta1": "FedAvgM at beta 0 is FedAvg",
    "fedavgm.beta2": "unused by FedAvgM",
    "fedavgm.tau": "unused by FedAvgM",
    # loss weights: 0 switches a term off (FedProx at mu 0 is FedAvg)
    "fedprox.mu": "FedAvg",
    "fedproto.lam": "term off",
    "fedtgp.lam": "term off",
    "feddistill.lam": "term off",
    "fedgen.gen_lam": "term off",
    "fedgen.eta": "term off",
    "fedhenn.eta0": "alignment off",
    "fedhenn_homo.eta0": "alignment off",
    "fml.alpha": "term off",
    "fml.beta": "term off",
    "fedclassavg.rho": "term off",
    "ktpfl.rho": "term off",
    "fedclassavg.base_temperature": "scale 1 (documented)",
    "fedtgp.tau": "margin capped at 0",
    "fedtgp.fixed_margin": "no fixed margin",
    # epochs / steps: 0 = that stage does not run
    "fedbabu.finetune_epochs": "no fine-tuning",
    "fedseq_anti.finetune_epochs": "no fine-tuning",
    "fedseq_vanilla.finetune_epochs": "no fine-tuning",
    "fedrep.head_epochs": "no head-only phase",
    "fedgen.generator_steps": "generator never trained",
    "fedgh.server_epochs": "server head never trained",
    "fedtgp.server_epochs": "prototypes from the plain mean",
    "ktpfl.coef_steps": "coefficients stay uniform",
    "ktpfl.distill_epochs": "no distillation",
    "fedgh.server_batch_size": "the whole set per step (documented)",
    "fedgh.lar_batch": "LARs over the whole split (paper)",
    "fedhenn.rad_batch": "the whole RAD (paper)",
    "fedhenn_homo.rad_batch": "the whole RAD (paper)",
}
NEGATIVE_OK = {
    "train.finetune_epochs": "-1 = the method's default",
    "data.split_seed": "-1 = the experiment's seed",
}


def _numeric(tp) -> bool:
    return any(a in (int, float) for a in (typing.get_args(tp) or (tp,)))


def _keys() -> list[tuple[str, str, str | None]]:
    """(section or "", key, algorithm name or None) for every numeric config key."""
    out: list[tuple[str, str, str | None]] = [("", "seed", None)]
    for section, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        out += [(section, f.name, None) for f in dataclasses.fields(cls) if _numeric(hints[f.name])]
    for name in ALGORITHMS.names():
        cls = ALGORITHMS.get(name)
        hints = typing.get_type_hints(cls)
        out += [
            ("algorithm", f.name, name)
            for f in dataclasses.fields(cls)
            if f.init and _numeric(hints[f.name])
        ]
    return out


KEYS = _keys()


def _label(section: str, key: str, algo: str | None) -> str:
    return f"{algo}.{key}" if algo else (f"{section}.{key}" if section else key)


def _raw(section: str, key: str, algo: str | None, value) -> dict:
    raw = tiny_raw(data=SMALL)
    if algo:
        raw["algorithm"] = {"name": algo, key: value}
    elif section:
        raw.setdefault(section, {})[key] = value
    else:
        raw[key] = value
    return raw


def _names_key(message: str, section: str, key: str, algo: str | None) -> bool:
    if algo:  # an algorithm's own check names the bare hyperparameter
        return re.search(rf"\b{re.escape(key)}\b", message) is not None
    return (f"{section}.{key}" if section else key) in message


def test_every_section_and_algorithm_is_fuzzed():
    labels = {_label(*k) for k in KEYS}
    assert {"seed", "data.alpha", "train.lr", "sim.workers", "model.feature_dim"} <= labels
    assert {"fedprox.mu", "fedtgp.tau", "ktpfl.distill_lr"} <= labels
    assert {"fedprox", "fedtgp", "ktpfl", "fedgen", "fedadam"} <= {a for _, _, a in KEYS if a}
    stale = (set(ZERO_OK) | set(NEGATIVE_OK)) - labels
    assert not stale, f"allow-list entries for keys that no longer exist: {sorted(stale)}"


@pytest.mark.parametrize("what", list(BAD) + list(EDGE))
@pytest.mark.parametrize("section, key, algo", KEYS, ids=[_label(*k) for k in KEYS])
def test_a_bad_number_is_refused_by_name(section, key, algo, what):
    value = {**BAD, **EDGE}[what][0]
    label = _label(section, key, algo)
    allowed = (what == "zero" and label in ZERO_OK) or (what == "negative" and label in NEGATIVE_OK)
    try:
        from_dict(_raw(section, key, algo, value))
    except ConfigError as exc:
        assert not allowed, f"{label} = {value!r}: allow-listed but refused: {exc}"
        assert _names_key(str(exc), section, key, algo), f"{label}: {exc} does not name the key"
        assert "\n" not in str(exc)
        return
    assert allowed, f"{label} = {value!r} was accepted"


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "Traceback" not in err[0] and err[0].startswith("error:"), err
    return err[0]


# CLI subset: every section key and one key per algorithm, each with a value it must refuse.
CLI_CASES = [(s, k, a) for s, k, a in KEYS if not a] + list(
    {a: (s, k, a) for s, k, a in KEYS if a}.values()
)


@pytest.mark.parametrize("section, key, algo", CLI_CASES, ids=[_label(*k) for k in CLI_CASES])
@pytest.mark.integration
def test_cli_refuses_a_bad_set_with_one_line_and_no_out(section, key, algo, tmp_path, capsys):
    cfg = write_toml(tmp_path / "c.toml", tiny_raw(data=SMALL, algorithm={"name": algo or "local"}))
    dotted = f"algorithm.{key}" if algo else (f"{section}.{key}" if section else key)
    for what in ("nan", "huge-int", "string"):
        out = tmp_path / f"out-{what}"
        args = ["run", str(cfg), "--out", str(out), "--quiet", "--set", f"{dotted}={BAD[what][1]}"]
        assert main(args) == 2, (dotted, what)
        assert key in _one_line_error(capsys), (dotted, what)
        assert not out.exists(), (dotted, what)


@pytest.mark.integration
def test_cli_leaves_a_previous_run_untouched(tmp_path, capsys):
    cfg = write_toml(tmp_path / "c.toml", tiny_raw(data=SMALL, algorithm={"name": "local"}))
    out = tmp_path / "out"
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--set", "train.rounds=1"]) == 0
    before = {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["run", str(cfg), "--out", str(out), "--quiet", "--set", "train.lr=nan"]) == 2
    assert "train.lr" in _one_line_error(capsys)
    assert {p.name: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
