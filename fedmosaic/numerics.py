"""Which arithmetic a run does: the host's fastest (``native``) or one that hosts with AVX2
share (``portable``), and what this host's math libraries see.

Why: torch's CPU kernels dispatch on the instruction set at run time. ATen's vectorized kernels
(``ATEN_CPU_CAPABILITY``), oneDNN's JIT convolutions (``ONEDNN_MAX_CPU_ISA``) and MKL's GEMM each
pick AVX-512 code on a host that has it and AVX2 code on one that does not, and those sum in
other orders: the same cell, code and config give other bits on another host (measured: a
full-data layer-expansion cell, round-100 accuracy -0.54 points on an AVX2-only host).

``sim.numerics = "portable"`` pins every library at the common level of x86-64 hosts with AVX2
and FMA, before torch is imported:

- ``ATEN_CPU_CAPABILITY=avx2``: ATen's kernels (and fedmosaic's native kernels, which follow it;
  their 16-lane code gives the 8-lane code's bits anyway);
- ``MKL_CBWR=AVX2,STRICT`` and ``MKL_ENABLE_INSTRUCTIONS=AVX2``: MKL's conditional numerical
  reproducibility on its AVX2 branch, which Intel documents as bitwise across its processors of
  that branch whatever their cache sizes. MKL keeps a branch other than ``AUTO`` or
  ``COMPATIBLE`` on Intel processors only and silently runs ``AUTO`` elsewhere (its developer
  guide, "Specifying Code Branches"): :func:`mkl_branch` reads back the branch that ran, and
  provenance records it;
- ``ONEDNN_MAX_CPU_ISA=AVX2``, and oneDNN off in each process
  (``torch.backends.mkldnn.enabled = False``, which fedmosaic's fast evaluation path follows):
  oneDNN sizes its blocking from the cache it finds, so its sums may still differ between hosts
  of one ISA; convolutions then run as ATen's im2col + MKL GEMM and evaluation's Linear layers
  as MKL GEMM (or the native kernels), under MKL's reproducible branch.

Where that holds: every number of one cell equal under an AVX-512 host's and an AVX2 host's
library levels on one machine (``tests/test_numerics.py``), so across Intel hosts with AVX2.
Across vendors it does not: a full-data FedTGP-grid cell made on an AMD EPYC and re-run on an
Intel Xeon with ``fedmosaic verify`` (both pinned, same torch build) matched round 1 bit for bit
and differed from round 2 (``docs/design.md``, "Portable numerics", gives the size).

The environment must be in place before torch is imported: the ``fedmosaic`` command re-executes
itself with it when a config asks for ``portable`` (:func:`reexec_argv`); a Python caller sets
``FEDMOSAIC_NUMERICS=portable`` (and the pins, :func:`portable_env`) before importing torch, and
:func:`check` refuses a portable config in a process that is not. Simulator workers inherit the
environment. Portable bits hold for the same torch build (the same MKL and ATen code): the
versions are in ``provenance.numerics``.

This module imports no torch at import time (the command line reads it first).
"""

from __future__ import annotations

import functools
import os
import platform
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MODES = ("native", "portable")
FLAG = "FEDMOSAIC_NUMERICS"
PORTABLE_ENV: dict[str, str] = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "MKL_CBWR": "AVX2,STRICT",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
# every variable that moves an instruction-set level, recorded as found
LEVEL_VARS = (FLAG, *PORTABLE_ENV, "FEDMOSAIC_KERNELS")


class NumericsError(ValueError):
    """A portable run asked for in a process that cannot give it (with the reason)."""


def portable_env() -> dict[str, str]:
    """The variables that put a process (and the workers it starts) in portable mode."""
    return {FLAG: "portable", **PORTABLE_ENV}


def requested(environ: Mapping[str, str] | None = None) -> str:
    """The mode this process's environment asks for: ``portable`` or ``native``."""
    env = os.environ if environ is None else environ
    return "portable" if env.get(FLAG, "") == "portable" else "native"


def env_in_place(environ: Mapping[str, str] | None = None) -> bool:
    """Whether every portable pin is set, with its value, in ``environ`` (default: this process)."""
    env = os.environ if environ is None else environ
    return requested(env) == "portable" and all(env.get(k) == v for k, v in PORTABLE_ENV.items())


def cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def host_level(flags: set[str] | None = None) -> str:
    """The instruction-set level the CPU offers: ``avx512`` (F, BW, VL, DQ), ``avx2`` (with FMA),
    ``baseline`` (neither), or ``unknown`` (no /proc/cpuinfo, e.g. macOS)."""
    f = cpu_flags() if flags is None else flags
    if not f:
        return "unknown"
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f:
        return "avx512"
    if {"avx2", "fma"} <= f:
        return "avx2"
    return "baseline"


def can_be_portable() -> str | None:
    """Why this host cannot run in portable mode, or None when it can."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"portable numerics pin x86-64 instruction sets; this host is {platform.machine()}"
    level = host_level()
    if level == "baseline":
        return "portable numerics need AVX2 and FMA, which this CPU lacks"
    return None


def reexec_argv(argv: list[str]) -> tuple[list[str], dict[str, str]]:
    """The command line and environment that re-run ``fedmosaic <argv>`` in portable mode."""
    env = {**os.environ, **portable_env()}
    return [sys.executable, "-m", "fedmosaic", *argv], env


def apply_in_process() -> None:
    """The in-process half of portable mode (torch imported): oneDNN off. Called by
    every process that trains (the run's process and each simulator worker)."""
    if requested() != "portable":
        return
    import torch

    # a module-level flag torch documents setting; its stubs type it as the descriptor
    torch.backends.mkldnn.enabled = False  # type: ignore[assignment]


def check(mode: str) -> None:
    """Refuse a run whose ``sim.numerics`` this process cannot honour (a one-line reason)."""
    if mode not in MODES:
        raise NumericsError(f"sim.numerics = {mode!r}: choose one of {', '.join(MODES)}")
    import torch

    have = requested()
    if mode == "native":
        if have == "portable":
            raise NumericsError(
                f"sim.numerics = 'native' in a process pinned portable ({FLAG}=portable): unset "
                f"{FLAG} and the pins ({', '.join(PORTABLE_ENV)}), or set sim.numerics = "
                "'portable'"
            )
        return
    why = can_be_portable()
    if why:
        raise NumericsError(f"sim.numerics = 'portable': {why}")
    cap = torch.backends.cpu.get_cpu_capability()
    if not env_in_place() or cap != "AVX2":
        raise NumericsError(
            "sim.numerics = 'portable' needs its environment before torch is imported "
            f"(torch's CPU capability here: {cap}): run it with the fedmosaic command, which "
            f"re-executes itself so, or set {', '.join(f'{k}={v}' for k, v in portable_env().items())} "
            "before Python starts"
        )
    apply_in_process()


# MKL's branch codes (mkl_service.h: MKL_CBWR_*), as mkl_serv_cbwr_get reads them back
_MKL_BRANCHES = {
    1: "off",
    2: "AUTO",
    3: "COMPATIBLE",
    4: "SSE2",
    6: "SSSE3",
    7: "SSE4_1",
    8: "SSE4_2",
    9: "AVX",
    10: "AVX2",
    12: "AVX512",
    14: "AVX512_E1",
}
_MKL_STRICT = 0x10000


@functools.cache
def mkl_branch() -> dict[str, Any] | None:
    """The code branch MKL runs on, read back from MKL itself (None where torch has no MKL).

    Why read it back: MKL keeps a requested branch other than ``AUTO`` and ``COMPATIBLE`` only on
    Intel processors and silently runs ``AUTO`` elsewhere (its developer guide, "Specifying Code
    Branches"), so ``MKL_CBWR=AVX2`` is the AVX2 branch on an Intel host and the processor's own
    branch on an AMD one. ``auto`` is the branch ``AUTO`` picks on this host (on an AMD EPYC MKL
    reads back ``AUTO`` for both).
    """
    import ctypes

    import torch

    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib"):
        try:
            lib = ctypes.CDLL(str(lib_dir / name))
            get, auto = lib.mkl_serv_cbwr_get, lib.mkl_serv_cbwr_get_auto_branch
        except (OSError, AttributeError):
            continue
        torch.mm(torch.ones(2, 2), torch.ones(2, 2))  # MKL reads MKL_CBWR on its first call
        code, every = int(get(1)), int(get(-1))
        return {
            "branch": _MKL_BRANCHES.get(code, str(code)),
            "strict": bool(every & _MKL_STRICT),
            "auto": _MKL_BRANCHES.get(int(auto()), str(int(auto()))),
        }
    return None


@functools.cache
def _library_versions() -> dict[str, str | None]:
    import torch

    text = torch.__config__.show()
    mkl = re.search(r"Math Kernel Library Version ([^\s]+)", text)
    dnn = re.search(r"MKL-DNN v([^\s]+)", text)
    blas = re.search(r"BLAS_INFO=([^,\s]+)", text)
    return {
        "mkl": mkl.group(1) if mkl else None,
        "onednn": dnn.group(1) if dnn else None,
        "blas": blas.group(1) if blas else None,
    }


def record() -> dict[str, Any]:
    """``provenance.numerics``: the mode, the CPU's level and what torch and fedmosaic's native
    kernels run at, the math libraries' versions and every level variable as found."""
    import torch

    from fedmosaic import kernels

    flags = cpu_flags()
    return {
        "mode": requested(),
        "host_level": host_level(flags),
        "cpu_flags_avx512": sorted(f for f in flags if f.startswith("avx512")),
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_convolutions": bool(torch.backends.mkldnn.enabled),
        "kernels": kernels.status(),
        "libraries": _library_versions(),
        "mkl_branch": mkl_branch(),
        "env": {k: os.environ[k] for k in LEVEL_VARS if k in os.environ},
    }


__all__ = [
    "MODES",
    "PORTABLE_ENV",
    "NumericsError",
    "apply_in_process",
    "can_be_portable",
    "check",
    "host_level",
    "portable_env",
    "record",
    "reexec_argv",
    "requested",
]
