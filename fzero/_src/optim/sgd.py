"""SGD with momentum, dampening, Nesterov and L2 weight decay, as torch.optim.SGD(foreach=False)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .base import (
    EmptyState,
    LearningRate,
    Optimizer,
    OptimizerError,
    UpdateContext,
    as_schedule,
    bumped,
    check_hyper,
    check_shards,
    group_lr,
    runs,
)


class SgdMomentumState(NamedTuple):
    """`count[L]` ("leaf"): momentum updates so far per bucket leaf (0: no buffer yet, as torch's
    `momentum_buffer is None`); `momentum_buffer[S]` ("shard")."""

    count: torch.Tensor
    momentum_buffer: torch.Tensor


def sgd(
    lr: LearningRate,
    momentum: float = 0.0,
    dampening: float = 0.0,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    *,
    maximize: bool = False,
) -> Optimizer:
    r"""Stochastic gradient descent, bit for bit `torch.optim.SGD(foreach=False)`.

    Per element of a used leaf, with $\eta$ = `lr(step) * group.lr_scale` and $\lambda$ =
    `weight_decay` (0 where the group masks weight decay off):

    $$g \leftarrow \pm g + \lambda p, \qquad
      b \leftarrow \begin{cases} g & \text{first momentum update of the leaf} \\
                                 \mu b + (1 - \tau) g & \text{otherwise} \end{cases}, \qquad
      d = \begin{cases} g + \mu b & \text{nesterov} \\ b & \text{otherwise} \end{cases}, \qquad
      p \leftarrow p - \eta d$$

    ($-g$ if `maximize`; the momentum lines only when $\mu \ne 0$.)

    Args:
      lr: a float, a callable `step -> float`, or a sequence of per-step floats.
      momentum, dampening, nesterov, weight_decay, maximize: as torch.optim.SGD.

    Returns:
      An `Optimizer`; its state is `EmptyState()` without momentum, else `SgdMomentumState`.

    Example:
      >>> import torch, fzero.optim as fo
      >>> from fzero._src.layout import ParamGroup, Segment
      >>> opt = fo.sgd(0.5, momentum=0.9)
      >>> p, g = torch.ones(4), torch.ones(4)
      >>> ctx = fo.UpdateContext(0, ParamGroup(), (Segment(0, 0, 0, 3),), (0,), (True,))
      >>> p, s = opt.update(g, opt.init(p, 1), p, ctx)
      >>> p.tolist()  # the 4th element is padding
      [0.5, 0.5, 0.5, 1.0]
    """
    schedule = as_schedule(lr)
    momentum = check_hyper("momentum", momentum)
    dampening = check_hyper("dampening", dampening)
    weight_decay = check_hyper("weight_decay", weight_decay)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise OptimizerError(
            f"Nesterov momentum requires a momentum > 0 and zero dampening, got momentum={momentum}, "
            f"dampening={dampening}"
        )

    def init(param: torch.Tensor, num_leaves: int) -> EmptyState | SgdMomentumState:
        if momentum == 0:
            return EmptyState()
        return SgdMomentumState(torch.zeros(num_leaves, dtype=torch.float32), torch.zeros_like(param))

    def spec(state):
        return EmptyState() if momentum == 0 else SgdMomentumState("leaf", "shard")

    def update(grad, state, param, ctx: UpdateContext):
        check_shards("sgd", grad, param, state, spec(state), ctx)
        if ctx.group.frozen:
            return param, state
        eta = group_lr(schedule, ctx)
        wd = weight_decay if ctx.group.weight_decay else 0.0
        p = param.clone()
        if momentum == 0:
            for start, stop, used in runs(ctx, ctx.used):
                if used:
                    _sgd_slice(grad[start:stop], p[start:stop], None, False, eta, wd, momentum, dampening, nesterov, maximize)
            return p, state
        counts = state.count.tolist()
        buf = state.momentum_buffer.clone()
        for start, stop, (used, first) in runs(ctx, [(u, c == 0) for u, c in zip(ctx.used, counts)]):
            if used:
                _sgd_slice(grad[start:stop], p[start:stop], buf[start:stop], first, eta, wd, momentum, dampening, nesterov, maximize)
        count = torch.tensor(bumped(counts, ctx.used), dtype=state.count.dtype, device=state.count.device)
        return p, SgdMomentumState(count, buf)

    return Optimizer(init, update, spec)


def _sgd_slice(grad, param, buf, first, lr, weight_decay, momentum, dampening, nesterov, maximize) -> None:
    """torch/optim/sgd.py `_single_tensor_sgd`, one tensor, on views `param`, `buf` (in place)."""
    grad = grad if not maximize else -grad
    if weight_decay != 0:
        grad = grad.add(param, alpha=weight_decay)
    if momentum != 0:
        if first:
            buf.copy_(grad)  # torch: buf = grad.detach().clone()
        else:
            buf.mul_(momentum).add_(grad, alpha=1 - dampening)
        if nesterov:
            grad = grad.add(buf, alpha=momentum)
        else:
            grad = buf
    param.add_(grad, alpha=-lr)
