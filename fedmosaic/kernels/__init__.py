"""Native CPU kernels (C++, AVX2/FMA, and AVX-512 where present) with a torch fallback.

- The fused plain-SGD Linear layer for skinny batches (``linear_forward``,
  ``linear_backward_sgd``): the forward streams W once with the batch rows in registers, the
  backward computes ``dx`` with the old W and applies the update in the same pass over W. Where
  the CPU (and torch's capability, which follows ``ATEN_CPU_CAPABILITY``) has AVX-512, 16-lane
  code runs that does the 8-lane AVX2 code's arithmetic element by element: the same bits on
  either machine (``isa()``, ``set_isa()``).
- The gray CNNs' first block, ``Conv2d(1 -> 8n) -> 2x2 max pool -> ReLU``, as one op, with its
  SGD step in the backward (``kernels.conv``); its AVX-512 code also gives the AVX2 code's bits.

The extension is compiled once per user and torch/Python version (``scripts/setup.sh`` runs
``python -m fedmosaic.kernels build``; otherwise the first run that needs it builds it) with
``torch.utils.cpp_extension``, the system's g++ and ninja (its translation units in parallel)
and OpenMP (``at::parallel_for`` then runs on torch's threads), into the user's cache,
``$XDG_CACHE_HOME/fedmosaic/kernels/<tag>`` (``~/.cache/...``; the package's ``_build`` folder
where the cache is not writable, and an up-to-date build found there is used). A build says so
on stderr when it starts (with an estimate) and when it ends (with its time). Without a
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
import threading
import time
from pathlib import Path
from types import ModuleType

import torch
from torch import Tensor

log = logging.getLogger("fedmosaic.kernels")

NAME = "fedmosaic_linear"
# Two translation units that ninja compiles in parallel: the kernels (ATen's headers only) and
# the Python bindings (pybind11 and torch's tensor casters), not torch/extension.h's whole C++
# API, which was ~90% of the compile time.
SOURCES = (Path(__file__).with_name("linear.cpp"), Path(__file__).with_name("bindings.cpp"))
# CPU seconds of a build (g++ -O3 of linear.cpp, of bindings.cpp, the link; measured with g++ 12
# and torch 2.13 on an x86-64 server core), for the estimate the start line gives (build_estimate):
# about 8 s on two idle cores.
BUILD_CPU_SECONDS = (7.0, 7.0, 1.0)
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
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS + [torch.__version__, sys.version]).encode())
    return h.hexdigest()[:16]


def cache_root() -> Path | None:
    """``$XDG_CACHE_HOME/fedmosaic/kernels`` (``~/.cache/fedmosaic/kernels``); None without a
    home folder."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    try:  # the XDG spec: a relative path is ignored
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    except RuntimeError:  # no HOME and no passwd entry
        return None
    return base / "fedmosaic" / "kernels"


def build_dirs() -> list[Path]:
    """Where the extension may live, in the order :func:`built` looks and :func:`build` tries:
    the user's cache (one folder per source/flags/torch/Python tag, so versions do not evict each
    other), then ``_build`` inside the package (a checkout built there before; the fallback where
    the cache is not writable)."""
    root = cache_root()
    package = Path(__file__).with_name("_build")
    return [root / _tag(), package] if root is not None else [package]


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


def build_jobs() -> int:
    """How many units ninja compiles at once: ``MAX_JOBS`` (torch passes it to ninja) or, as
    ninja's default does, every CPU this process may use."""
    try:
        return max(1, int(os.environ["MAX_JOBS"]))
    except (KeyError, ValueError):
        return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1)


def build_estimate() -> float:
    """Seconds a build should take here: the measured CPU seconds, the units spread over the
    jobs, slowed by the machine's load (runnable processes beyond its CPUs share them)."""
    *units, link = BUILD_CPU_SECONDS
    jobs = min(build_jobs(), len(units))
    cpus = os.cpu_count() or 1
    try:
        busy = max(1.0, (os.getloadavg()[0] + jobs) / cpus)
    except OSError:
        busy = 1.0
    return (max(max(units), sum(units) / jobs) + link) * busy


def _say(msg: str) -> None:
    """A line on stderr: a build is seen whether or not logging is set up."""
    print(f"fedmosaic: {msg}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _heartbeat(every: float = 30.0):  # noqa: ANN202 - a context manager
    """A "still building" line every ``every`` seconds while the compiler runs."""
    stop = threading.Event()
    t0 = time.perf_counter()

    def beat() -> None:
        while not stop.wait(every):
            _say(f"still building native kernels ({time.perf_counter() - t0:.0f} s so far)")

    thread = threading.Thread(target=beat, name="fedmosaic-kernels-build", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def build(verbose: bool = False) -> Path:
    """Compile the extension into the first writable build folder; returns the shared object.

    Says on stderr when the compiler starts (where, about how long, how to skip) and when it
    ends (how long it took); nothing when another process built it meanwhile."""
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
                _say(
                    f"building native kernels (one time, about {build_estimate():.0f} s) into "
                    f"{d}; {ENV}=0 skips them"
                )
                t0 = time.perf_counter()
                try:
                    with _heartbeat():
                        # copies: load() appends torch's -L/-l flags to the lists it is given,
                        # which would change _tag() and leave a stamp the next process finds stale
                        cpp_extension.load(
                            NAME,
                            [str(src) for src in SOURCES],
                            extra_cflags=list(CFLAGS),
                            extra_ldflags=list(LDFLAGS),
                            build_directory=str(d),
                            verbose=verbose,
                            is_python_module=True,
                        )
                except Exception as e:
                    last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                    took = time.perf_counter() - t0
                    _say(f"native kernels not built after {took:.0f} s ({last}); torch path")
                    raise
                stamp.write_text(tag + "\n")
                _say(f"native kernels built in {time.perf_counter() - t0:.0f} s")
                return so
        except OSError as e:  # read-only folder: try the next
            err = e
    raise RuntimeError(f"cannot build {NAME}: {err}")


@contextlib.contextmanager
def _build_lock(d: Path):  # noqa: ANN202 - a context manager
    """One builder per folder at a time (an OS lock: released when its process dies, however)."""
    with open(d / "build.flock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"waiting for another process building the native kernels in {d}")
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
