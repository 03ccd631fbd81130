r"""Adafactor over flat shards: factored second moments whose row and column sums are completed
across shards (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
Cost", Algorithms 4 and 5, without momentum).

A leaf `[..., R, C]` of 2 or more dims keeps per-row and per-column statistics ("rows" /
"cols" fields, replicated, `base.field_shapes`); a leaf of fewer dims keeps a full second
moment in the "shard" field `v`. A shard may cut a leaf anywhere, mid-row included, so the row
and column sums of `g²` are exact per-slot integer bins (`exact.square_bins`, one slot per row
or column) that `ctx.leaf_sum` adds over ranks: every rank then holds the same complete sums,
correctly rounded, whatever N and the cuts are, and every stage gets the same bits.
"""

from __future__ import annotations

import math
import numbers
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
    check_flag,
    check_hyper,
    check_shards,
    factored,
    field_numel,
    field_shapes,
    group_lr,
    in_place,
    refuse_derivative,
)


class AdafactorState(NamedTuple):
    """`step[L]` ("leaf", float32), `rows` ("rows"), `cols` ("cols"), `v[S]` ("shard": the second
    moment of the elements of leaves of fewer than 2 dims; zero and unused elsewhere)."""

    step: torch.Tensor
    rows: torch.Tensor
    cols: torch.Tensor
    v: torch.Tensor


class _Slots(NamedTuple):
    """Where this shard's elements sit in the bucket's factored statistics.

    row[S] / col[S]: each element's slot in the "rows" / "cols" field (`len` of the field, i.e.
    ignored, for padding, unused leaves and leaves of fewer than 2 dims); leaf[S]: its bucket
    leaf position (`L` where ignored: padding and unused leaves)."""

    row: torch.Tensor
    col: torch.Tensor
    leaf: torch.Tensor
    row_offsets: tuple[int, ...]
    col_offsets: tuple[int, ...]


def _slots(ctx: UpdateContext, size: int) -> _Slots:
    shapes = ctx.leaf_shapes
    row_n = [math.prod(s) for s in field_shapes("rows", shapes)]
    col_n = [math.prod(s) for s in field_shapes("cols", shapes)]
    row_off = tuple(sum(row_n[:k]) for k in range(len(shapes)))
    col_off = tuple(sum(col_n[:k]) for k in range(len(shapes)))
    row = torch.full((size,), sum(row_n), dtype=torch.long)
    col = torch.full((size,), sum(col_n), dtype=torch.long)
    pos = {leaf: k for k, leaf in enumerate(ctx.leaves)}
    for seg in ctx.segments:
        k = pos[seg.leaf]
        if not (ctx.used[k] and factored(shapes[k])) or seg.stop == seg.start:
            continue
        r, c = shapes[k][-2], shapes[k][-1]
        e = torch.arange(seg.leaf_start, seg.leaf_start + seg.stop - seg.start)  # flat index in the leaf
        row[seg.start : seg.stop] = row_off[k] + e // c
        col[seg.start : seg.stop] = col_off[k] + (e // (r * c)) * c + e % c
    leaf = exact.leaf_ids(ctx.segments, pos, size, ctx.used)
    return _Slots(row, col, leaf, row_off, col_off)


def adafactor(
    lr: LearningRate = 1e-2,
    beta2_decay: float = -0.8,
    eps: tuple[float | None, float] = (None, 1e-3),
    d: float = 1.0,
    weight_decay: float = 0.0,
    *,
    relative_step: bool = False,
    scale_parameter: bool = False,
) -> Optimizer:
    r"""Adafactor without momentum, with absolute steps by default.

    Per used leaf with its own step count $t$ (after increment), $\hat\beta_{2t} = 1 - t^{c}$
    ($c$ = `beta2_decay`), $\epsilon_1$ = `eps[0]` (None: the param dtype's machine epsilon),
    $\epsilon_2$ = `eps[1]`, $\eta$ = `lr(step) * group.lr_scale`, $\lambda$ = `weight_decay`:

    a leaf `[..., R, C]` (2 or more dims; per leading index):
    $$R_i \leftarrow \mathrm{lerp}(R_i, \tfrac{1}{C}\textstyle\sum_j g_{ij}^2, t^{c}),\quad
      C_j \leftarrow \mathrm{lerp}(C_j, \tfrac{1}{R}\textstyle\sum_i g_{ij}^2, t^{c}),\quad
      \hat v_{ij} = \frac{R_i C_j}{\max(\frac{1}{R}\sum_i R_i,\ \epsilon_1)}$$
    a leaf of fewer dims: $v \leftarrow \mathrm{lerp}(v, g^2, t^c)$, $\hat v = v$; then

    $$u = g \,/\, \sqrt{\max(\hat v, \epsilon_1^2)},\quad
      \rho = \begin{cases}\min(\eta, 1/\sqrt t) & \text{relative\_step}\\ \eta & \text{else}\end{cases},\quad
      \alpha = \rho \cdot \begin{cases}\max(\epsilon_2, \mathrm{RMS}(p)) & \text{scale\_parameter}\\ 1 & \text{else}\end{cases}$$
    $$p \leftarrow p\,(1 - \eta\lambda),\qquad p \leftarrow p - \frac{\alpha}{\max(1, \mathrm{RMS}(u)/d)}\, u .$$

    This is torch.optim.Adafactor's algorithm (no momentum, $\hat\beta_2$ schedule, update
    clipping $d$ = `d`, decoupled weight decay) with its relative step and parameter scaling made
    options, off by default: the step is the learning rate, as in the paper's absolute-step
    setting; `relative_step=True, scale_parameter=True` is torch's step size. Bits are not
    torch's (torch sums with `norm`, fzero exactly): the sums $\sum g^2$ per row and column,
    $\sum p^2$ and $\sum u^2$ per leaf are exact (`fzero._src.optim.exact`), completed over ranks
    by `ctx.leaf_sum` (twice per update: the statistics and $\sum p^2$, then $\sum u^2$), and
    correctly rounded to float64; means and RMS are Python floats from them, the row means of
    the replicated `rows` by `math.fsum`. So the update is the same for every N, stage and
    shard cut. Params must be float32 (or narrower).

    `update_` writes `param` and `v` in place and returns new `step`, `rows` and `cols`.
    """
    schedule = as_schedule(lr)
    if not isinstance(beta2_decay, numbers.Real) or isinstance(beta2_decay, bool) or not -1.0 <= beta2_decay <= 0.0:
        raise OptimizerError(f"adafactor: beta2_decay must be a float in [-1, 0] (t**beta2_decay is 1 - beta2_t), "
                             f"got {beta2_decay!r}")
    beta2_decay = float(beta2_decay)
    if not isinstance(eps, (tuple, list)) or len(eps) != 2:
        raise OptimizerError(f"adafactor: eps must be a pair (eps1 or None, eps2), got {eps!r}")
    eps1 = None if eps[0] is None else check_hyper("eps[0]", eps[0])
    eps2 = check_hyper("eps[1]", eps[1])
    d = check_hyper("d", d, allow_inf=True)  # inf: no update clipping
    if d == 0:
        raise OptimizerError("adafactor: d (the update clipping threshold) must be > 0, got 0.0")
    weight_decay = check_hyper("weight_decay", weight_decay)
    relative_step = check_flag("relative_step", relative_step)
    scale_parameter = check_flag("scale_parameter", scale_parameter)

    def init(param: torch.Tensor, leaf_shapes: tuple[tuple[int, ...], ...]) -> AdafactorState:
        if param.dtype == torch.float64:
            raise OptimizerError("adafactor: exact sums need float32 (or narrower) params, got a float64 shard")
        if isinstance(leaf_shapes, int):
            raise OptimizerError("adafactor: init needs the bucket leaves' shapes, not their count; call "
                                 "fzero.optim.init_state(optimizer, param, leaf_shapes) (fzero.init does)")
        rows = param.new_zeros(field_numel("rows", leaf_shapes))
        cols = param.new_zeros(field_numel("cols", leaf_shapes))
        return AdafactorState(torch.zeros(len(leaf_shapes), dtype=torch.float32), rows, cols, torch.zeros_like(param))

    def spec(state):
        return AdafactorState("leaf", "rows", "cols", "shard")

    def update_(grad, state, param, ctx: UpdateContext):
        check_shards("adafactor", grad, param, state, spec(state), ctx)
        refuse_derivative("adafactor", "its factored statistics' means, the row scales and the step sizes "
                          "(update clipping, RMS) are Python floats made from exact sums of squares "
                          "(fzero._src.optim.exact), which no transform sees, and its kernels write their inputs",
                          (grad, param, *state))
        e1 = torch.finfo(param.dtype).eps if eps1 is None else eps1
        eta = group_lr(schedule, ctx)
        wd = weight_decay if ctx.group.weight_decay else 0.0
        decay = {"1 - lr * lr_scale * weight_decay": 1 - eta * wd} if wd else {}
        check_fits("adafactor", ctx, param.dtype, {"lr * lr_scale": eta, "eps[0]**2": e1 * e1, **decay})
        steps = bumped(state.step.tolist(), ctx.used, state.step.dtype)
        shapes, num = ctx.leaf_shapes, len(ctx.leaves)
        slots = _slots(ctx, param.numel())
        nr, nc = state.rows.numel(), state.cols.numel()
        partial = torch.cat([exact.square_bins(grad, slots.row, nr), exact.square_bins(grad, slots.col, nc),
                             exact.square_bins(param, slots.leaf, num)], dim=1)
        sums = exact.bins_to_sums(_summed(ctx, partial))
        row_sq, col_sq, p_sq = sums[:nr], sums[nr : nr + nc], sums[nr + nc :]
        rows, cols = state.rows.clone(), state.cols.clone()
        scale = _row_scale(ctx, shapes, steps, slots, rows, cols, row_sq, col_sq, e1, beta2_decay)
        u = torch.zeros_like(param)
        pos = {leaf: k for k, leaf in enumerate(ctx.leaves)}
        for seg in ctx.segments:
            k = pos[seg.leaf]
            if not ctx.used[k] or seg.stop == seg.start:
                continue
            s, w = slice(seg.start, seg.stop), steps[k] ** beta2_decay
            if factored(shapes[k]):
                est = rows[slots.row[s]].mul_(cols[slots.col[s]]).div_(scale[slots.row[s]])
            else:
                state.v[s].lerp_(grad[s] * grad[s], w)
                est = state.v[s].clone()
            torch.mul(ops.rsqrt_(est.clamp_(min=e1 * e1)), grad[s], out=u[s])
        u_sq = exact.bins_to_sums(_summed(ctx, exact.square_bins(u, slots.leaf, num)))
        alphas = [0.0] * num  # an unused leaf is not updated (and its step count may be 0)
        for k, shape in enumerate(shapes):
            if not ctx.used[k]:
                continue
            n = max(1, math.prod(shape))
            rho = min(eta, 1 / math.sqrt(steps[k])) if relative_step else eta
            alpha = rho * max(eps2, math.sqrt(p_sq[k] / n)) if scale_parameter else rho
            alphas[k] = alpha / max(1.0, math.sqrt(u_sq[k] / n) / d)
        check_fits("adafactor", ctx, param.dtype, {f"the step size of bucket leaf {leaf}": alphas[k]
                                                   for k, leaf in enumerate(ctx.leaves) if ctx.used[k]})
        for seg in ctx.segments:
            k = pos[seg.leaf]
            if ctx.used[k]:
                s = slice(seg.start, seg.stop)
                if wd != 0:
                    param[s].mul_(1 - eta * wd)
                ops.add_(param[s], u[s], -alphas[k])
        step_t = torch.tensor(steps, dtype=state.step.dtype, device=state.step.device)
        return AdafactorState(step_t, rows, cols, state.v)

    return in_place(init, update_, spec, shaped=True, lr=schedule)


def _summed(ctx: UpdateContext, partial: torch.Tensor) -> torch.Tensor:
    total = ctx.leaf_sum(partial)
    if total.dtype != torch.float64 or tuple(total.shape) != tuple(partial.shape):
        raise OptimizerError(f"adafactor: ctx.leaf_sum returned {total.dtype}{list(total.shape)} for "
                             f"float64{list(partial.shape)}; it must sum element-wise over ranks and keep shape and dtype")
    return total


def _row_scale(ctx, shapes, steps, slots, rows, cols, row_sq, col_sq, e1, beta2_decay) -> torch.Tensor:
    """Update the used factored leaves' `rows` / `cols` in place (lerp towards the row and column
    means of g², float64 means rounded to the field's dtype) and return, per row slot, the
    denominator `max(mean of the leaf's rows over R, eps1)` of its leading index (`fsum`)."""
    scale = torch.ones(rows.numel(), dtype=rows.dtype, device=rows.device)
    for k, shape in enumerate(shapes):
        if not (ctx.used[k] and factored(shape)):
            continue
        r, c = shape[-2], shape[-1]
        w = steps[k] ** beta2_decay
        a, b = slots.row_offsets[k], slots.col_offsets[k]
        nr, nc = math.prod(shape[:-1]), math.prod(shape[:-2]) * c
        row_mean = [x / c if c else 0.0 for x in row_sq[a : a + nr]]
        col_mean = [x / r if r else 0.0 for x in col_sq[b : b + nc]]
        rows[a : a + nr].lerp_(torch.tensor(row_mean, dtype=rows.dtype, device=rows.device), w)
        cols[b : b + nc].lerp_(torch.tensor(col_mean, dtype=cols.dtype, device=cols.device), w)
        values = rows[a : a + nr].tolist()
        for g in range(nr // r if r else 0):  # per leading index
            mean = math.fsum(values[g * r : (g + 1) * r]) / r
            scale[a + g * r : a + (g + 1) * r] = max(mean, e1)
    return scale
