"""LAMB: Adam moments with a per-leaf trust ratio (You et al. 2019, "Large Batch Optimization for
Deep Learning: Training BERT in 76 minutes", Algorithm 2)."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import exact, ops
from .base import (
    LearningRate,
    Optimizer,
    OptimizerError,
    UpdateContext,
    as_schedule,
    bumped,
    check_fits,
    check_hyper,
    check_shards,
    group_lr,
    in_place,
    refuse_derivative,
    used_pieces,
)


class LambState(NamedTuple):
    """`step[L]` ("leaf", float32), `exp_avg[S]`, `exp_avg_sq[S]` ("shard")."""

    step: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor


def lamb(
    lr: LearningRate = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-6,
    weight_decay: float = 0.0,
) -> Optimizer:
    r"""LAMB with exact, shard-independent per-leaf norms.

    Per used leaf $\ell$ with its own step count $t$, $\eta$ = `lr(step) * group.lr_scale`,
    $\lambda$ = `weight_decay` (0 where the group masks it off), $(\beta_1, \beta_2)$ = `betas`,
    $\epsilon$ = `eps`, element-wise as torch's Adam:

    $$m \leftarrow \mathrm{lerp}(m, g, 1-\beta_1),\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad
      r = \frac{m / (1-\beta_1^t)}{\sqrt{v}/\sqrt{1-\beta_2^t} + \epsilon} + \lambda p$$

    then per leaf, $\phi_p = \sqrt{\sum_\ell p^2}$, $\phi_r = \sqrt{\sum_\ell r^2}$ and

    $$\rho_\ell = \begin{cases}\phi_p/\phi_r & \phi_p > 0,\ \phi_r > 0\\ 1 & \text{otherwise}\end{cases},
      \qquad p \leftarrow p - (\eta\rho_\ell)\, r .$$

    The sums of squares are exact (see `fzero._src.optim.exact`): each rank computes exact
    integer bins of its pieces of every leaf, `ctx.leaf_sum` adds a float64 `[2 * 28, L]` tensor
    over ranks (exactly, in any order), and $\phi$, $\rho$ are Python floats from the correctly
    rounded sums. So the update is bitwise the same for every N and shard cut. Params must be
    float32 (or narrower), leaves at most 2**33 elements. `ctx.leaf_sum` is called exactly once
    per update, on every rank.

    `update_` writes `param`, `exp_avg`, `exp_avg_sq` in place and returns a new `step`. Its
    transients are larger than the element-wise optimizers': the direction `r[S]`, a run-sized
    `denom`, and the float64 working copies of the exact sums (`exact.square_bins`).
    """
    schedule = as_schedule(lr)
    if not isinstance(betas, (tuple, list)) or len(betas) != 2:
        raise OptimizerError(f"lamb: betas must be a pair of floats, got {betas!r}")
    beta1 = check_hyper("betas[0]", betas[0], 0.0, 1.0, hi_open=True)
    beta2 = check_hyper("betas[1]", betas[1], 0.0, 1.0, hi_open=True)
    eps = check_hyper("eps", eps)
    weight_decay = check_hyper("weight_decay", weight_decay)

    def init(param: torch.Tensor, num_leaves: int) -> LambState:
        if param.dtype == torch.float64:
            raise OptimizerError("lamb: exact norms need float32 (or narrower) params, got a float64 shard")
        return LambState(torch.zeros(num_leaves, dtype=torch.float32), torch.zeros_like(param), torch.zeros_like(param))

    def spec(state):
        return LambState("leaf", "shard", "shard")

    def update_(grad, state, param, ctx: UpdateContext):
        check_shards("lamb", grad, param, state, spec(state), ctx)
        refuse_derivative("lamb", "its per-leaf trust ratios are Python floats made from exact sums of squares "
                          "(fzero._src.optim.exact), which no transform sees, and its kernels write their inputs",
                          (grad, param, *state))
        eta = group_lr(schedule, ctx)
        wd = weight_decay if ctx.group.weight_decay else 0.0
        check_fits("lamb", ctx, param.dtype, {"lr * lr_scale": eta, "eps": eps, "weight_decay": wd})
        steps = bumped(state.step.tolist(), ctx.used, state.step.dtype)
        m, v = state.exp_avg, state.exp_avg_sq
        r = torch.zeros_like(param)
        for start, stop, step in used_pieces(ctx, steps):
            s = slice(start, stop)
            _lamb_direction(grad[s], param[s], m[s], v[s], r[s], step, beta1, beta2, eps, wd)
        positions = {leaf: k for k, leaf in enumerate(ctx.leaves)}
        sums_p, sums_r = exact.leaf_sums_of_squares(ctx, param, r)
        ratios = [trust_ratio(math.sqrt(a), math.sqrt(b)) for a, b in zip(sums_p, sums_r)]
        check_fits("lamb", ctx, param.dtype, {f"lr * lr_scale * trust ratio of bucket leaf {leaf}": eta * ratios[k]
                                              for k, leaf in enumerate(ctx.leaves) if ctx.used[k]})
        for seg in ctx.segments:
            k = positions[seg.leaf]
            if ctx.used[k]:
                s = slice(seg.start, seg.stop)
                ops.add_(param[s], r[s], -(eta * ratios[k]))
        step_t = torch.tensor(steps, dtype=state.step.dtype, device=state.step.device)
        return LambState(step_t, m, v)

    return in_place(init, update_, spec, lr=schedule)


def trust_ratio(param_norm: float, update_norm: float) -> float:
    """$\\phi_p / \\phi_r$, or 1 when either norm is 0."""
    return param_norm / update_norm if param_norm > 0 and update_norm > 0 else 1.0


def _lamb_direction(grad, param, exp_avg, exp_avg_sq, r, step, beta1, beta2, eps, weight_decay) -> None:
    """Moments in place (torch Adam's ops) and the direction into `r`, for one run:
    `r = (m / bc1) / (sqrt(v) / sqrt(bc2) + eps) + wd p` (one run-sized temporary, `denom`)."""
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = (1 - beta2**step) ** 0.5
    denom = exp_avg_sq.sqrt().div_(bias_correction2_sqrt).add_(eps)
    torch.div(exp_avg, bias_correction1, out=r).div_(denom)
    if weight_decay != 0:
        ops.add_(r, param, weight_decay)
