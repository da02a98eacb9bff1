"""How often each fast path ran, by name: tests read it to check that a path they claim engaged.

Keys: ``fused_steps`` (training steps with fused layers), ``sgd_linear_backward`` (fused Linear
backwards, the FedTGP server step's included), ``fedtgp.server`` (its hand-written steps), ``inference_linear`` (Linear calls through the fast
inference path), ``batched_steps`` (vmapped steps of a group of clients), ``batched_groups``.
"""

from __future__ import annotations

from collections import Counter

engaged: Counter[str] = Counter()
