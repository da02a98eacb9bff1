"""Portable numerics: a cell gives the same bits whatever instruction-set level the host offers
(ATen, MKL and oneDNN pinned at AVX2), and provenance says which arithmetic made a cell."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fedmosaic import numerics
from fedmosaic.config import ConfigError, load

CONFIG = """
seed = 3
[data]
dataset = "synthetic"
synthetic_size = 600
num_clients = 4
partition = "dirichlet"
alpha = 0.5
[model]
family = "htfe8-gray"
feature_dim = 64
[train]
rounds = 2
batch_size = 10
lr = 0.05
[sim]
backend = "serial"
numerics = "{numerics}"
[algorithm]
name = "fedproto"
"""

# What a host of each level gives the libraries when nothing is pinned (on this machine, forced).
HOST_AVX512 = {
    "ATEN_CPU_CAPABILITY": "avx512",
    "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
    "MKL_ENABLE_INSTRUCTIONS": "AVX512",
}
HOST_AVX2 = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
HOST_SSE = {
    "ATEN_CPU_CAPABILITY": "default",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
}
# the two levels forced on this host: its own and the next one down
LEVELS = {"avx512": (HOST_AVX512, HOST_AVX2, "AVX512"), "avx2": (HOST_AVX2, HOST_SSE, "AVX2")}


def _run(tmp_path: Path, tag: str, mode: str, host: dict[str, str]) -> dict:
    cfg = tmp_path / f"{tag}.toml"
    cfg.write_text(CONFIG.format(numerics=mode))
    env = {k: v for k, v in os.environ.items() if k not in numerics.LEVEL_VARS}
    env.update(host)
    out = tmp_path / tag
    proc = subprocess.run(
        [sys.executable, "-m", "fedmosaic", "run", str(cfg), "--quiet", "--out", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((out / "results.json").read_text())


def _numbers(doc: dict) -> tuple:
    """Every number of a run but its timings."""
    rounds = [{k: v for k, v in r.items() if not k.startswith("seconds")} for r in doc["rounds"]]
    return rounds, doc["clients"], doc["per_client_final_acc"]


@pytest.mark.slow
@pytest.mark.skipif(numerics.host_level() not in LEVELS, reason="needs AVX2 or AVX-512")
@pytest.mark.golden
def test_portable_cells_are_bitwise_across_forced_instruction_set_levels(tmp_path: Path) -> None:
    """The same cell under this host's library levels and the next level down's (AVX-512 and
    AVX2 on an AVX-512 host, AVX2 and SSE on an AVX2 host): native numerics differ (the
    cross-host problem), portable numerics give every number bit for bit."""
    host, lower, capability = LEVELS[numerics.host_level()]
    wide = _run(tmp_path, "native_host", "native", host)
    narrow = _run(tmp_path, "native_lower", "native", lower)
    assert _numbers(wide) != _numbers(narrow)  # what a second host does today
    assert wide["provenance"]["numerics"]["aten_capability"] == capability
    p_wide = _run(tmp_path, "portable_host", "portable", host)
    p_narrow = _run(tmp_path, "portable_lower", "portable", lower)
    assert _numbers(p_wide) == _numbers(p_narrow)
    for doc in (p_wide, p_narrow):
        rec = doc["provenance"]["numerics"]
        assert rec["mode"] == "portable" and rec["aten_capability"] == "AVX2"
        assert rec["onednn_convolutions"] is False
        assert rec["env"]["MKL_CBWR"] == "AVX2,STRICT"
        assert doc["config"]["sim"]["numerics"] == "portable"
    assert p_wide["provenance"]["numerics"]["host_level"] == numerics.host_level()
    assert p_wide["provenance"]["host"]["cpu_id"]["vendor_id"]


def test_provenance_names_the_arithmetic() -> None:
    rec = numerics.record()
    assert rec["mode"] == "native"
    assert rec["aten_capability"] == torch.backends.cpu.get_cpu_capability()
    assert rec["host_level"] in ("avx512", "avx2", "baseline", "unknown")
    assert set(rec["libraries"]) == {"mkl", "onednn", "blas"}


def test_a_portable_config_is_refused_in_a_process_that_is_not_pinned(tmp_path: Path) -> None:
    """The API cannot re-execute its caller: it refuses in one line, naming what to set."""
    from fedmosaic.api import run

    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(numerics="portable"))
    with pytest.raises(ConfigError, match="sim.numerics = 'portable' needs its environment"):
        run(load(cfg), out=str(tmp_path / "o"))
    assert not (tmp_path / "o" / "results.json").exists()


def test_numerics_is_validated(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(CONFIG.format(numerics="fast"))
    with pytest.raises(ConfigError, match="sim.numerics"):
        load(cfg)


def test_host_level_from_cpu_flags() -> None:
    assert (
        numerics.host_level({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"})
        == "avx512"
    )
    assert numerics.host_level({"avx2", "fma", "avx512f"}) == "avx2"  # F alone is not a level
    assert numerics.host_level({"avx2"}) == "baseline"  # no FMA
    assert numerics.host_level(set()) == "unknown"


@pytest.mark.golden
def test_the_native_default_keeps_every_stored_config_hash() -> None:
    """sim.numerics came later: at its default it is left out of the fingerprint, so committed
    cells and checkpoints keep their hashes; "portable" is another configuration."""
    from fedmosaic.checkpoint import config_hash

    base = load(None).to_dict()
    old = json.loads(json.dumps(base))
    del old["sim"]["numerics"]
    assert config_hash(base) == config_hash(old)
    base["sim"]["numerics"] = "portable"
    assert config_hash(base) != config_hash(old)


def test_reexec_carries_the_pins() -> None:
    argv, env = numerics.reexec_argv(["run", "x.toml"])
    assert argv[1:] == ["-m", "fedmosaic", "run", "x.toml"]
    assert numerics.env_in_place(env) and not numerics.env_in_place({})
