"""Speed as an opt-in layer: faster ways to compute core's training and inference, same maths.

``core.training`` is the plain loop; it asks an ``Accelerator`` (its seam) how to run a phase's
steps or an evaluation faster. This package answers, using the native kernels
(``fedmosaic.kernels``) where they are built:

- ``fused``: plain SGD applied inside the Linear (and 1-channel conv) layers' backward;
- ``inference``: Linear layers through the native kernel or oneDNN while autograd is off;
- ``prototypes``: FedTGP's server step written out by hand;
- ``batched``: many clients of one layout trained as one ``vmap`` computation (called by the
  runtimes, ``sim/``, not through the seam).

Importing the package installs it (``install``): the assembly layer (``federation.py``) does, so
every runtime trains accelerated; core and the algorithms never import it. ``engaged`` counts
what ran, for tests that claim a fast path engaged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, cast

from torch import Tensor, nn

from fedmosaic.accel import batched
from fedmosaic.accel._engaged import engaged
from fedmosaic.accel.fused import fused_steps
from fedmosaic.accel.inference import fast_inference
from fedmosaic.accel.prototypes import fedtgp_server_step
from fedmosaic.core import training
from fedmosaic.core.training import (
    FEDTGP_SERVER_STEP,
    FastStep,
    FastSteps,
    PrototypeServerStep,
    StepT,
    TrainSettings,
)
from fedmosaic.kernels import conv as fast_conv

__all__ = ["ACCEL", "Accel", "engaged", "install"]

# methods' own fast steps by their typed key (``Accelerator.step``); the annotated name makes
# the type checker hold the implementation to the key's signature
_FEDTGP_SERVER: PrototypeServerStep = fedtgp_server_step
STEPS: dict[FastStep[Any], object] = {FEDTGP_SERVER_STEP: _FEDTGP_SERVER}


class Accel:
    """``core.training.Accelerator``: fused SGD steps, fast inference, named fast steps."""

    def steps(
        self,
        modules: Sequence[nn.Module],
        params: Sequence[nn.Parameter],
        s: TrainSettings,
        lr: float,
    ) -> FastSteps | None:
        return fused_steps(modules, params, s, lr)

    def inference(self, *modules: nn.Module) -> contextlib.AbstractContextManager[object]:
        return fast_inference(*modules)

    def step(self, key: FastStep[StepT]) -> StepT | None:
        return cast("StepT | None", STEPS.get(key))

    # ``Accelerator.fit_clients``: clients of one layout trained together (accel/batched.py)
    fit_clients = staticmethod(batched.fit_clients)

    def block_inference(self, block: nn.Module, x: Tensor) -> Tensor | None:
        if not fast_conv.block_eligible(block) or not fast_conv.block_ready(block, x):
            return None
        return fast_conv.conv_pool_relu_inference(x, fast_conv.block_conv(block))


ACCEL = Accel()


def install() -> None:
    """Make core's training and inference use this package (idempotent)."""
    training.use_accelerator(ACCEL)
