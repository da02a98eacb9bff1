"""FedTGP's server step by hand: ~1,000 steps a round on 10-row tensors, where autograd's graph
and the optimizer's overhead dominate. The plain step (autograd + SGD on the ACL loss) is in
``algorithms/fedtgp.py``, which takes this one through ``core.training.Accelerator.step``
(``core.training.FEDTGP_SERVER_STEP``) when ``fedmosaic.accel`` is installed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from fedmosaic.accel._engaged import engaged
from fedmosaic.accel.fused import sgd_linear_backward, sgd_linear_forward
from fedmosaic.core.training import FEDTGP_SERVER_STEP


def acl_loss_and_grad(
    points: Tensor, labels: Tensor, protos: Tensor, delta: float, eps: float = 1e-12
) -> tuple[Tensor, Tensor]:
    """FedTGP's ``acl_loss`` (``algorithms/fedtgp.py``, Eq. 10) and its gradient with respect
    to ``protos [C, d]``, by hand (no autograd).

    With ``l = -(dist + delta * onehot)`` and ``L = mean_n CE(l_n, y_n)``:
    ``dL/dl = (softmax(l) - onehot) / N``, ``dL/ddist = -dL/dl`` and
    ``ddist[n, c]/dp_c = (p_c - x_n) / dist[n, c]`` (0 where the squared distance sits at the
    ``eps`` floor, ``fedtgp.EPS``, as the clamp's gradient is), so
    ``dL/dp_c = sum_n w[n, c] (p_c - x_n)`` with ``w = -dL/dl / dist``.
    """
    n = points.shape[0]
    rows = torch.arange(n)
    dist = torch.linalg.vector_norm(points.unsqueeze(1) - protos.unsqueeze(0), dim=-1)  # [N, C]
    floor = dist < math.sqrt(eps)  # where acl_loss's clamp of the squared distance acts
    dist = dist.clamp_min(math.sqrt(eps))
    logits = dist.neg()
    logits[rows, labels] -= delta
    logp = F.log_softmax(logits, 1)  # [N, C]
    loss = logp[rows, labels].mean().neg()
    g = logp.exp()  # dL/dl * N
    g[rows, labels] -= 1.0
    w = (g / (dist * -n)).masked_fill_(floor, 0.0)  # [N, C]
    # sum_n w[n, c] (p_c - x_n), as two small products instead of a [N, C, d] reduction
    return loss, protos * w.sum(0).unsqueeze(1) - w.t() @ points


def fedtgp_server_step(
    params: dict[str, Tensor],
    points: Tensor,
    labels: Tensor,
    delta: float,
    lr: float,
    eps: float = 1e-12,
) -> float:
    """One SGD step of FedTGP's server (``fedtgp.train_prototypes``) on a minibatch, in place on
    ``params`` (float32, autograd off): forward, ACL gradient and update written out, each MLP
    weight's SGD step inside its backward (the input gradient with the old weight); returns the
    minibatch's loss. The same step as autograd + SGD to float rounding."""
    engaged[FEDTGP_SERVER_STEP.name] += 1
    emb = params["embedding.weight"]  # [C, d]
    if "mlp.0.weight" not in params:
        loss, grad = acl_loss_and_grad(points, labels, emb, delta, eps)
        emb.sub_(grad, alpha=lr)
        return float(loss)
    w1, b1, w2, b2 = (params[f"mlp.{i}.{k}"] for i in (0, 2) for k in ("weight", "bias"))
    pre = sgd_linear_forward(emb, w1, b1)  # [C, d]
    hidden = pre.relu()
    loss, grad = acl_loss_and_grad(points, labels, sgd_linear_forward(hidden, w2, b2), delta, eps)
    grad = sgd_linear_backward(grad, hidden, w2, b2, lr, True)
    grad = sgd_linear_backward(grad.mul_(pre > 0), emb, w1, b1, lr, True)
    emb.sub_(grad, alpha=lr)
    return float(loss)
