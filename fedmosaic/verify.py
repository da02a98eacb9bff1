"""Re-run a finished run on this host and compare it number by number: which hosts reproduce a
cell, and by how much the others differ.

``fedmosaic verify RESULTS`` reads a run's ``results.json`` (or the folder holding it), rebuilds
its configuration (checked against the cell's stored config hash, so an edited file is refused),
runs it here in the same numerics for its first ``rounds`` rounds (all by default) and compares
every per-round value except wall times bit for bit, then, after a complete re-run, the summary's
final and after-fine-tune accuracies. What differs is reported as the first round and key that
differ and, per metric, the largest difference and the difference at the last round compared,
beside both hosts (CPU, instruction-set level, MKL's branch as MKL reads it back).

A shorter re-run stops the same run after ``rounds`` rounds (its configuration unchanged: a
schedule over the planned rounds stays as it was), so its rounds are the original's first ones.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedmosaic import numerics, provenance
from fedmosaic.checkpoint import config_hash
from fedmosaic.config import ConfigError, ExperimentConfig, experiment_config
from fedmosaic.experiment import run_experiment
from fedmosaic.report.reruns import HEADLINE, Comparison, compare, compare_summary, is_number

RESULTS = "results.json"


class VerifyError(ConfigError):
    """A results file that cannot be re-run (missing, corrupt, edited, or from a plugin)."""


@dataclass(frozen=True)
class Stored:
    """A finished run as its ``results.json`` holds it."""

    path: Path
    doc: dict[str, Any]
    cfg: ExperimentConfig

    @property
    def rounds(self) -> list[dict[str, Any]]:
        return list(self.doc["rounds"])


def load(path: str | Path) -> Stored:
    """The run at ``path`` (its ``results.json`` or the folder holding it), its config rebuilt
    and checked against the hash stored with it."""
    p = Path(path)
    if p.is_dir():
        p = p / RESULTS
    if not p.is_file():
        raise VerifyError(f"{p}: no such results file (a run's results.json or its folder)")
    try:
        doc = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise VerifyError(f"{p}: not a readable results file ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("config"), dict):
        raise VerifyError(f"{p}: no 'config' table: not a fedmosaic results file")
    rounds = doc.get("rounds")
    if not isinstance(rounds, list) or not rounds or not all(isinstance(r, dict) for r in rounds):
        raise VerifyError(f"{p}: no per-round records ('rounds') to compare")
    cell = doc.get("cell")
    stored = cell.get("config_hash") if isinstance(cell, dict) else None
    if stored is not None and config_hash(doc["config"]) != stored:
        raise VerifyError(
            f"{p}: its config does not match its stored config_hash (the file was edited): "
            "nothing to verify"
        )
    if doc["config"].get("plugins"):
        raise VerifyError(
            f"{p}: the run used plugins {doc['config']['plugins']}: verify re-runs built-in "
            "methods only (run the plugin's configuration again with fedmosaic run)"
        )
    try:
        cfg = experiment_config(doc["config"])
    except ConfigError as exc:
        raise VerifyError(f"{p}: its config no longer loads: {exc}") from None
    return Stored(p, doc, cfg)


class Stop(Exception):
    """Raised by a re-run's ``on_round`` to end it after that round (its rounds are kept)."""


def rerun(
    cfg: ExperimentConfig, rounds: int, on_round: Callable[[dict[str, Any]], None] | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The run of ``cfg`` on this host, stopped after ``rounds`` rounds (or when ``on_round``
    raises :class:`Stop`): its per-round records as ``results.json`` stores them, and its
    results document when it ran to its end."""
    records: list[dict[str, Any]] = []

    def hook(rec: dict[str, Any]) -> None:
        records.append(json.loads(json.dumps(rec)))  # as results.json stores it
        if on_round is not None:
            on_round(records[-1])
        if len(records) >= rounds and rounds < cfg.train.rounds:
            raise Stop

    try:
        doc = run_experiment(cfg, progress=False, on_round=hook)
    except Stop:
        return records, None
    return [json.loads(json.dumps(r)) for r in doc["rounds"]], doc


def host_line(doc: dict[str, Any]) -> str:
    """CPU, instruction-set level, torch's capability and MKL's branch of a run's provenance."""
    prov = doc.get("provenance", {}) if isinstance(doc.get("provenance"), dict) else {}
    host = prov.get("host", {}) if isinstance(prov.get("host"), dict) else {}
    num = prov.get("numerics", {}) if isinstance(prov.get("numerics"), dict) else {}
    cpu_id = host.get("cpu_id", {}) if isinstance(host.get("cpu_id"), dict) else {}
    mkl = num.get("mkl_branch")
    mkl_words = (
        f"MKL branch {mkl.get('branch')}" if isinstance(mkl, dict) else "MKL branch not recorded"
    )
    cpu = str(host.get("cpu", "?"))
    if cpu_id.get("vendor_id"):
        cpu += (
            f" ({cpu_id['vendor_id']}, family {cpu_id.get('cpu family', '?')} model "
            f"{cpu_id.get('model', '?')})"
        )
    if not num:  # made before provenance recorded the numerics: native arithmetic
        return f"{cpu}, native numerics (levels not recorded)"
    return (
        f"{cpu}, {num.get('mode', 'native')} numerics, host {num.get('host_level', '?')}, torch "
        f"at {num.get('aten_capability', '?')}, {mkl_words}"
    )


def this_host() -> dict[str, Any]:
    """This host as a run's provenance would record it (for :func:`host_line`)."""
    return {
        "provenance": {
            "host": provenance.host(),
            "numerics": numerics.record(),
            "code": provenance.code(),
        }
    }


def code_line(stored: dict[str, Any], here: dict[str, Any]) -> str:
    """Whether the re-run's code is the stored run's (its source hash): other code may give
    other numbers for reasons that are not the host's."""

    def source(doc: dict[str, Any]) -> str | None:
        code = doc.get("provenance", {}).get("code", {})
        return code.get("source_hash") if isinstance(code, dict) else None

    a, b = source(stored), source(here)
    if a is None:
        return "  code: the stored run records no source hash"
    if a == b:
        return f"  code: the stored run's (source hash {a[:12]})"
    return (
        f"  code: other than the stored run's (source hash {a[:12]} stored, {str(b)[:12]} here): "
        "a difference may come from the code, not the host"
    )


def _fmt(v: Any) -> str:
    return repr(v) if not is_number(v) else f"{float(v):.17g}"


def report(out: Comparison, stored: Stored, here_host: dict[str, Any]) -> str:
    """The comparison in words: identical, or where and by how much it differs."""
    lines = [
        f"stored: {stored.path}",
        f"  made on {host_line(stored.doc)}",
        f"  re-run on {host_line(here_host)}",
        code_line(stored.doc, here_host),
    ]
    if out.identical:
        lines.append(
            f"identical: every one of {out.values} numbers of rounds 1-{out.rounds} equal bit for "
            "bit (wall times left out)"
        )
        return "\n".join(lines)
    assert out.first is not None
    r, key, x, y = out.first
    lines.append(
        f"different: {out.differing} of {out.values} numbers of rounds 1-{out.rounds}; the "
        f"first in round {r}, {key}: {_fmt(x)} stored, {_fmt(y)} here"
    )
    for key in [k for k in HEADLINE if k in out.by_key] + sorted(
        k for k in out.by_key if k not in HEADLINE
    ):
        d = out.by_key[key]
        last = (
            f"; round {out.rounds}: {d.last[0]:.6g} stored, {d.last[1]:.6g} here "
            f"({d.last[1] - d.last[0]:+.3g})"
            if d.last is not None and d.last[0] != d.last[1]
            else ""
        )
        lines.append(
            f"  {key}: differs in {d.rounds} round(s) from round {d.first_round}, largest "
            f"|difference| {d.max_abs:.3g}{last}"
        )
    for key, (x, y) in out.summary.items():
        lines.append(f"  summary {key}: {x:.6g} stored, {y:.6g} here ({y - x:+.3g})")
    return "\n".join(lines)


def check_keep(keep: Path, rounds: int, have: int) -> None:
    """Refuse a ``keep`` path before anything runs: an existing file is never replaced, and only
    a complete re-run is kept."""
    if rounds != have:
        raise VerifyError(f"keeping the re-run needs all {have} rounds, not {rounds}")
    if keep.exists() or keep.is_symlink():
        raise VerifyError(f"{keep} exists: a kept re-run never replaces a file (choose another)")
    if keep.parent.exists() and not keep.parent.is_dir():
        raise VerifyError(f"{keep.parent} is a file, not a folder")


def keep_rerun(keep: Path, stored: Stored, doc: dict[str, Any]) -> None:
    """Write the re-run's results document at ``keep`` (whole or not at all), carrying the
    stored run's ``cell`` record (suite setting, method, seed, config hash) so that the claims
    page matches it with the cell it re-ran (``<budget>/<suite>/reruns/...``)."""
    out = dict(doc)
    if isinstance(stored.doc.get("cell"), dict):
        out["cell"] = stored.doc["cell"]
    keep.parent.mkdir(parents=True, exist_ok=True)
    tmp = keep.with_name(f".{keep.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(out, indent=1))
        os.replace(tmp, keep)
    finally:
        tmp.unlink(missing_ok=True)


def verify(
    path: str | Path | Stored,
    rounds: int | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    keep: Path | None = None,
) -> tuple[Comparison, str]:
    """Re-run the run at ``path`` (or one already loaded) for its first ``rounds`` rounds (all:
    None) on this host and compare; returns the comparison and its report. ``on_round`` sees
    each round's record and may raise :class:`Stop` to end the re-run there. ``keep``: write
    the complete re-run's results document there (:func:`keep_rerun`)."""
    stored = path if isinstance(path, Stored) else load(path)
    have = len(stored.rounds)
    if rounds is None:
        rounds = have
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise VerifyError(f"rounds = {rounds!r} must be a whole number >= 1")
    if rounds > have:
        raise VerifyError(f"rounds = {rounds}: {stored.path} holds {have} round(s)")
    if keep is not None:
        check_keep(keep, rounds, have)
    records, doc = rerun(stored.cfg, rounds, on_round)
    out = compare(stored.rounds[: len(records)], records[:rounds])
    if doc is not None and rounds == have:
        compare_summary(out, stored.doc.get("summary", {}), doc.get("summary", {}))
        if keep is not None:
            keep_rerun(keep, stored, doc)
    return out, report(out, stored, this_host())


__all__ = [
    "Comparison",
    "Stop",
    "Stored",
    "VerifyError",
    "compare",
    "compare_summary",
    "load",
    "report",
    "rerun",
    "verify",
]
