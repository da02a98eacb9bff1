"""Per-(seed, round, client, purpose) random streams, identical in every runtime.

Every random choice in a run derives from the experiment seed through :func:`derive`, so the
simulator (serial or multi-process) and Flower clients draw exactly the same numbers.
"""

from __future__ import annotations

import zlib

import numpy as np
import torch

SERVER = -1  # client id used for server-side streams


def derive(seed: int, round_num: int, client_id: int, purpose: str) -> int:
    """A 63-bit seed for one stream; ``purpose`` separates independent uses."""
    tag = zlib.crc32(purpose.encode())
    ss = np.random.SeedSequence([seed & 0xFFFFFFFF, round_num, client_id + 1, tag])
    return int(ss.generate_state(2, dtype=np.uint64)[0] >> np.uint64(1))


def torch_generator(seed: int, round_num: int, client_id: int, purpose: str) -> torch.Generator:
    return torch.Generator().manual_seed(derive(seed, round_num, client_id, purpose))


def numpy_rng(seed: int, round_num: int, client_id: int, purpose: str) -> np.random.Generator:
    return np.random.default_rng(derive(seed, round_num, client_id, purpose))


_cpu_only: bool | None = None


def _no_accelerator() -> bool:
    """Whether this process can reach no device besides the CPU (checked once)."""
    global _cpu_only
    if _cpu_only is None:
        others = [getattr(torch, n, None) for n in ("xpu", "mtia")]
        mps = getattr(torch.backends, "mps", None)
        _cpu_only = not (
            torch.cuda.is_available()
            or any(m is not None and m.is_available() for m in others)
            or (mps is not None and mps.is_available())
            or hasattr(torch, torch._C._get_privateuse1_backend_name())  # a plugin device
        )
    return _cpu_only


def seed_torch(seed: int, round_num: int, client_id: int, purpose: str) -> None:
    """Seed torch's global RNG (dropout, augmentations, sampling inside losses)."""
    s = derive(seed, round_num, client_id, purpose)
    if _no_accelerator():
        # torch.manual_seed also queues a seed for every device not yet initialised, recording
        # a traceback each time (about 1 ms a call, twice per client built: 20 s of a
        # 10,000-client evaluation). Without a device, the CPU generator is all it seeds.
        torch.default_generator.manual_seed(s)
    else:
        torch.manual_seed(s)


def randn(*shape: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Standard normal float32 samples that are the same on every CPU.

    ``torch.randn`` in float32 takes a vectorized path whose values depend on the CPU's
    instruction set (AVX2 vs AVX-512 vs none: different last bits, which a few rounds of
    training amplify); the float64 path is scalar, so drawing in float64 and rounding is not.
    """
    return torch.randn(*shape, generator=generator, dtype=torch.float64).float()
