"""Adam and AdamW (with amsgrad), as torch.optim.Adam / AdamW(foreach=False)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .base import (
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


class AdamState(NamedTuple):
    """`step[L]` ("leaf", float32 like torch's `state["step"]`), `exp_avg[S]`, `exp_avg_sq[S]` ("shard")."""

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


class AmsgradState(NamedTuple):
    """`AdamState` plus `max_exp_avg_sq[S]` ("shard")."""

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    max_exp_avg_sq: torch.Tensor


def _adam(name: str, lr, betas, eps, weight_decay, amsgrad, maximize, decoupled) -> Optimizer:
    schedule = as_schedule(lr)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise OptimizerError(f"{name}: betas must be a pair of floats, got {betas!r}")
    beta1 = check_hyper("betas[0]", betas[0], 0.0, 1.0, hi_open=True)
    beta2 = check_hyper("betas[1]", betas[1], 0.0, 1.0, hi_open=True)
    eps = check_hyper("eps", eps)
    weight_decay = check_hyper("weight_decay", weight_decay)
    State = AmsgradState if amsgrad else AdamState

    def init(param: torch.Tensor, num_leaves: int):
        zeros = [torch.zeros_like(param) for _ in State._fields[1:]]
        return State(torch.zeros(num_leaves, dtype=torch.float32), *zeros)

    def spec(state):
        return State("leaf", *["shard"] * (len(State._fields) - 1))

    def update(grad, state, param, ctx: UpdateContext):
        check_shards(name, grad, param, state, spec(state), ctx)
        if ctx.group.frozen:
            return param, state
        eta = group_lr(schedule, ctx)
        wd = weight_decay if ctx.group.weight_decay else 0.0
        steps = bumped(state.step.tolist(), ctx.used)
        p = param.clone()
        moments = [t.clone() for t in state[1:]]
        for start, stop, (used, step) in runs(ctx, list(zip(ctx.used, steps))):
            if used:
                views = [t[start:stop] for t in moments]
                _adam_slice(grad[start:stop], p[start:stop], *views[:2], views[2] if amsgrad else None, step,
                            beta1, beta2, eta, wd, eps, maximize, decoupled)
        step_t = torch.tensor(steps, dtype=state.step.dtype, device=state.step.device)
        return p, State(step_t, *moments)

    return Optimizer(init, update, spec)


def _adam_slice(grad, param, exp_avg, exp_avg_sq, max_exp_avg_sq, step, beta1, beta2, lr, weight_decay, eps,
                maximize, decoupled) -> None:
    """torch/optim/adam.py `_single_tensor_adam` (not capturable, not differentiable), one tensor,
    on views (in place); `step` is the Python float torch reads with `_get_value(step_t)`."""
    grad = grad if not maximize else -grad
    if weight_decay != 0:
        if decoupled:
            param.mul_(1 - lr * weight_decay)
        else:
            grad = grad.add(param, alpha=weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    bias_correction2_sqrt = bias_correction2**0.5
    if max_exp_avg_sq is not None:
        max_exp_avg_sq.copy_(torch.maximum(max_exp_avg_sq, exp_avg_sq))
        denom = (max_exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)


def adam(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
) -> Optimizer:
    r"""Adam with L2 weight decay, bit for bit `torch.optim.Adam(foreach=False)`.

    Per element of a used leaf, with $t$ the leaf's own step count (after increment),
    $\eta$ = `lr(step) * group.lr_scale`, $\lambda$ = `weight_decay` (0 where masked):

    $$g \leftarrow \pm g + \lambda p,\quad m \leftarrow \mathrm{lerp}(m, g, 1-\beta_1),\quad
      v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad \hat v = \max(\hat v, v)\ \text{(amsgrad) else } v,$$
    $$p \leftarrow p - \frac{\eta}{1-\beta_1^t}\cdot
      \frac{m}{\sqrt{\hat v}/\sqrt{1-\beta_2^t} + \epsilon}$$

    with the bias corrections in Python float math, as torch. State: `AdamState`, or
    `AmsgradState` if `amsgrad`.
    """
    return _adam("adam", lr, betas, eps, weight_decay, amsgrad, maximize, decoupled=False)


def adamw(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    *,
    maximize: bool = False,
) -> Optimizer:
    r"""AdamW (decoupled weight decay), bit for bit `torch.optim.AdamW(foreach=False)`.

    As `adam` with $\lambda = 0$ in the gradient, and first $p \leftarrow p\,(1 - \eta\lambda)$
    (the factor a Python float).
    """
    return _adam("adamw", lr, betas, eps, weight_decay, amsgrad, maximize, decoupled=True)
