"""Native CPU kernels (C++, AVX2/FMA, and AVX-512 where present) with a torch fallback.

- The fused plain-SGD Linear layer for skinny batches (``linear_forward``,
  ``linear_backward_sgd``): the forward streams W once with the batch rows in registers, the
  backward computes ``dx`` with the old W and applies the update in the same pass over W. Where
  the CPU (and torch's capability, which follows ``ATEN_CPU_CAPABILITY``) has AVX-512, 16-lane
  code runs that does the 8-lane AVX2 code's arithmetic element by element: the same bits on
  either machine (``isa()``, ``set_isa()``).
- The gray CNNs' first block, ``Conv2d(1 -> 8n) -> 2x2 max pool -> ReLU``, as one op, with its
  SGD step in the backward (``kernels.conv``); its AVX-512 code also gives the AVX2 code's bits.

The extension is compiled by the project's install (``scripts/setup.sh`` runs
``python -m fedmosaic.kernels build``) with ``torch.utils.cpp_extension``, the system's g++
and ninja and OpenMP (``at::parallel_for`` then runs on torch's threads), into
``fedmosaic/kernels/_build`` (or ``$XDG_CACHE_HOME/fedmosaic/kernels`` where the package folder
is read-only). When it is missing and a compiler is present it is built on first use; without a
compiler, on a CPU without AVX2/FMA, or with ``FEDMOSAIC_KERNELS=0``, the torch path is used.
One log line per process says which.

Numbers: the kernels sum in another order than MKL's sgemm and mkldnn, so a run with them and
one without agree to float tolerance, not bit for bit; they sum in a fixed order whatever the
thread count, and every process of a run loads the same extension, so the runtimes stay
bitwise equal to each other.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

log = logging.getLogger("fedmosaic.kernels")

NAME = "fedmosaic_linear"
SOURCE = Path(__file__).with_name("linear.cpp")
# -fopenmp: at::parallel_for is inlined into the extension and runs on ATen's OpenMP pool only
# when the extension itself is compiled with OpenMP (without it every call runs on one thread);
# the linked libgomp.so.1 is the one torch has already loaded.
CFLAGS = ["-O3", "-mavx2", "-mfma", "-fno-math-errno", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
MAX_BATCH = 24  # the kernel beats MKL up to ~24 rows (measured: 1.0-1.1x at 24, 0.8-0.9x at 64)
ENV = "FEDMOSAIC_KERNELS"  # "0": always the torch path

_module: ModuleType | None = None
_reason = ""
_loaded = False


def _tag() -> str:
    h = hashlib.sha256(SOURCE.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS + [torch.__version__, sys.version]).encode())
    return h.hexdigest()[:16]


def build_dirs() -> list[Path]:
    """Where the extension may live: inside the package, then the user's cache."""
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return [Path(__file__).with_name("_build"), cache / "fedmosaic" / "kernels"]


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(NAME, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def built() -> Path | None:
    """The up-to-date shared object, if one is built."""
    tag = _tag()
    for d in build_dirs():
        so, stamp = d / f"{NAME}.so", d / "stamp"
        if so.is_file() and stamp.is_file() and stamp.read_text().strip() == tag:
            return so
    return None


def cpu_supported() -> bool:
    """AVX2 with FMA (ATen's AVX2 level requires both)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def compiler() -> str | None:
    """Why the extension cannot be built here, or None when it can."""
    for tool in ("g++", "ninja"):
        if shutil.which(os.environ.get("CXX", "g++") if tool == "g++" else tool) is None:
            return f"no {tool} on PATH"
    return None


def build(verbose: bool = False) -> Path:
    """Compile the extension into the first writable build folder; returns the shared object."""
    from torch.utils import cpp_extension

    why = compiler()
    if why:
        raise RuntimeError(f"cannot build {NAME}: {why}")
    err: Exception | None = None
    tag = _tag()
    for d in build_dirs():
        try:
            d.mkdir(parents=True, exist_ok=True)
            with _build_lock(d):
                so, stamp = d / f"{NAME}.so", d / "stamp"
                if so.is_file() and stamp.is_file() and stamp.read_text().strip() == tag:
                    return so  # another process built it while this one waited
                stamp.unlink(missing_ok=True)
                # Holding our lock, torch's own ``lock`` file is stale: a build killed (SIGKILL)
                # mid-compile leaves it, and torch would then wait on it forever.
                (d / "lock").unlink(missing_ok=True)
                # copies: load() appends torch's -L/-l flags to the lists it is given, which
                # would change _tag() and leave a stamp that the next process finds stale
                cpp_extension.load(
                    NAME,
                    [str(SOURCE)],
                    extra_cflags=list(CFLAGS),
                    extra_ldflags=list(LDFLAGS),
                    build_directory=str(d),
                    verbose=verbose,
                    is_python_module=True,
                )
                stamp.write_text(tag + "\n")
                return so
        except OSError as e:  # read-only folder: try the next
            err = e
    raise RuntimeError(f"cannot build {NAME}: {err}")


@contextlib.contextmanager
def _build_lock(d: Path):  # noqa: ANN202 - a context manager
    """One builder per folder at a time (an OS lock: released when its process dies, however)."""
    with open(d / "build.flock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def load() -> ModuleType | None:
    """The extension module, or None (torch path); decided once per process and logged."""
    global _module, _reason, _loaded
    if _loaded:
        return _module
    _loaded = True
    if os.environ.get(ENV, "1") == "0":
        _reason = f"{ENV}=0"
    elif not cpu_supported():
        _reason = f"CPU capability {torch.backends.cpu.get_cpu_capability()} lacks AVX2/FMA"
    else:
        try:
            so = built() or build()
            _module = _import(so)
        except Exception as e:  # noqa: BLE001 - any build/import failure: the torch path
            _reason = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    if _module is not None:
        # torch's capability follows ATEN_CPU_CAPABILITY: "avx2" there keeps us on AVX2 too
        _module.set_avx512(_want_avx512())
        log.info(
            "fused SGD layers: native kernels (%s: Linear, 1-channel conv blocks)", isa().upper()
        )
    else:
        log.info("fused SGD layers: torch path (%s)", _reason)
    return _module


def status() -> str:
    """One line: which path the fused SGD Linear layer takes in this process."""
    return f"native ({isa()})" if load() is not None else f"torch ({_reason})"


def isa() -> str:
    """The kernel's instruction set in this process: ``"avx512"`` (16 lanes) or ``"avx2"``.

    Both give the same bits (the 16-lane code does the same fused multiply-adds in the same order
    per element), so a run does not depend on which one a machine takes."""
    mod = load()
    return "avx512" if mod is not None and mod.avx512_enabled() else "avx2"


_allow_avx512 = True  # set_isa("avx2") turns the 16-lane code off


def _want_avx512() -> bool:
    # torch's capability follows ATEN_CPU_CAPABILITY: "avx2" there keeps the kernel on AVX2 too
    return _allow_avx512 and torch.backends.cpu.get_cpu_capability() == "AVX512"


def set_isa(name: str) -> str:
    """Force ``"avx2"`` or allow ``"avx512"`` (tests, benchmarks); returns the ISA now in use."""
    global _allow_avx512
    if name not in ("avx2", "avx512"):
        raise ValueError(f"isa {name!r}: choose avx2 or avx512")
    _allow_avx512 = name == "avx512"
    mod = load()
    if mod is not None:
        mod.set_avx512(_want_avx512())
    return isa()


def reset() -> None:
    """Forget the decision (tests; after changing ``FEDMOSAIC_KERNELS``)."""
    global _module, _reason, _loaded
    _module, _reason, _loaded = None, "", False


def usable(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> bool:
    """Whether the kernel takes this call: CPU float32, contiguous parameters, 1..MAX_BATCH rows."""
    n = x.numel() // max(x.shape[-1], 1) if x.dim() else 0
    return (
        0 < n <= MAX_BATCH
        and x.dtype == weight.dtype == torch.float32
        and x.device.type == weight.device.type == "cpu"
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous()))
        and load() is not None
    )


def linear_forward(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x W^T + b`` for ``x`` [.., in] (caller checked :func:`usable`)."""
    mod = load()
    assert mod is not None
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = mod.linear_forward(x2, weight.detach(), None if bias is None else bias.detach())
    return y.reshape(*x.shape[:-1], weight.shape[0])


def linear_backward_sgd(
    grad: Tensor, x: Tensor, weight: Tensor, bias: Tensor | None, lr: float, need_dx: bool
) -> Tensor | None:
    """``dx = grad W`` (old W), then ``W -= lr grad^T x``, ``b -= lr sum(grad)`` in place."""
    mod = load()
    assert mod is not None
    g2 = grad.reshape(-1, grad.shape[-1]).contiguous()
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    dx = mod.linear_backward_sgd(
        g2, x2, weight.detach(), None if bias is None else bias.detach(), lr, need_dx
    )
    # Written through raw pointers: bump the version counters as an in-place op would, so that a
    # weight another op saved for its backward is refused by autograd as on the torch path.
    torch.autograd.graph.increment_version(weight)
    if bias is not None:
        torch.autograd.graph.increment_version(bias)
    return dx.reshape(x.shape) if need_dx else None
