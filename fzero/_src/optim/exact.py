r"""Exact per-leaf sums of squares of a float32 shard, independent of where shards cut.

A float32 $x$ squares exactly in float64 (24-bit significand -> 48 bits). Cut every $x^2$ at
fixed bit positions $2^{L + jW}$ ($L = -300$, $W = 20$, $j = 0..K-1$, $K = 28$; this covers
$[2^{-298}, 2^{256})$, every square of a float32) into integer "pieces"
$\lfloor x^2 / 2^{L+jW} \rfloor \bmod 2^W < 2^W$. A sum of $n$ pieces is an integer below
$n \cdot 2^W$, exact in float64 while $n \le 2^{33}$, in any order, on one rank or across
ranks. So the bins $B_{j,\ell} = \sum_{i \in \ell} \mathrm{piece}_j(x_i^2)$ are exact,
and $\sum_j B_{j,\ell}\,2^{L+jW} = \sum_{i \in \ell} x_i^2$ exactly; `math.fsum` turns the K
terms into the correctly rounded float64 of the exact sum. The result depends only on the leaf's
values, not on N, the shard cuts or the reduction order.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from ..layout import Segment
from .base import OptimizerError

LOW, WIDTH, BINS = -300, 20, 28
MAX_LEAF_NUMEL = 2**33  # n * 2**WIDTH <= 2**53


def leaf_ids(segments: Sequence[Segment], positions: dict[int, int], size: int, mask: Sequence[bool]) -> torch.Tensor:
    """`ids[S]`: the bucket position of the leaf each element belongs to, or `len(mask)` for
    padding and for leaves whose `mask` entry is False."""
    ids = torch.full((size,), len(mask), dtype=torch.long)
    for seg in segments:
        k = positions[seg.leaf]
        if mask[k]:
            ids[seg.start : seg.stop] = k
    return ids


def square_bins(x: torch.Tensor, ids: torch.Tensor, num_leaves: int) -> torch.Tensor:
    """`x[S]` (float32 or narrower), `ids[S]` -> `bins[BINS, num_leaves]` float64 of exact integers.

    Non-finite squares are added to bin 0 as they are (so the leaf's sum is inf or nan).
    """
    t = x.detach().to(torch.float64).square()  # exact
    ids = ids.to(t.device)
    out = t.new_zeros(BINS, num_leaves + 1)
    bad = ~torch.isfinite(t)
    if bool(bad.any()):
        out[0].index_add_(0, ids[bad], t[bad])
        t = torch.where(bad, torch.zeros_like(t), t)
    nonzero = t[t > 0]
    if nonzero.numel() == 0:
        return out[:, :num_leaves]
    hi_exp = math.frexp(nonzero.max().item())[1]  # max < 2**hi_exp
    lo_exp = math.frexp(nonzero.min().item())[1] - 54  # every set bit >= 2**lo_exp
    j_lo = max(0, (lo_exp - LOW) // WIDTH)
    j_hi = min(BINS - 1, (hi_exp - LOW) // WIDTH)
    for j in range(j_lo, j_hi + 1):
        q = torch.floor(t * 2.0 ** -(LOW + j * WIDTH))  # exact: power-of-two scaling, in range
        piece = q - torch.floor(q * 2.0**-WIDTH) * 2.0**WIDTH  # integer in [0, 2**WIDTH)
        out[j].index_add_(0, ids, piece)
    return out[:, :num_leaves]


def bins_to_sums(bins: torch.Tensor) -> list[float]:
    """`bins[BINS, L]` (summed over ranks) -> per-leaf sum of squares, correctly rounded float64."""
    cols = bins.cpu().T.tolist()
    return [math.fsum(b * 2.0 ** (LOW + j * WIDTH) for j, b in enumerate(col)) for col in cols]


def leaf_sums_of_squares(ctx: Any, *xs: torch.Tensor, mask: Sequence[bool] | None = None) -> list[list[float]]:
    """Per `x` of `xs` (each shaped like the shard: the grad, the param, a "shard" state field,
    float32 or narrower), per bucket leaf (`ctx.leaves` order), the sum of squares of the leaf's
    elements over every rank's shard, correctly rounded float64: the same bits whatever N, the
    shard cuts and the reduction order, so a per-leaf norm (LAMB's trust ratio) keeps stages 1-3
    bitwise equal to stage 0. A plain float sum of the shard's squares through `ctx.leaf_sum` is
    not: its rounding depends on where the shards cut a leaf. A collective (one `ctx.leaf_sum`
    of `len(xs) * BINS * len(ctx.leaves)` float64): call it on every rank, the same times.
    `mask`: per leaf whether to count it (default `ctx.used`; a leaf left out sums to 0)."""
    for x in xs:
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.dtype == torch.float64:
            shown = f"{x.dtype}{list(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
            raise OptimizerError(f"leaf_sums_of_squares takes 1-d float32 (or narrower) shards, got {shown}: a "
                                 f"float64 square is not exact in float64")
    num = len(ctx.leaves)
    positions = {leaf: k for k, leaf in enumerate(ctx.leaves)}
    ids = leaf_ids(ctx.segments, positions, xs[0].numel() if xs else 0, ctx.used if mask is None else mask)
    partial = torch.cat([square_bins(x, ids, num) for x in xs]) if xs else torch.zeros(0, num, dtype=torch.float64)
    total = ctx.leaf_sum(partial)
    if not isinstance(total, torch.Tensor) or total.dtype != torch.float64 or total.shape != partial.shape:
        raise OptimizerError(f"ctx.leaf_sum returned {getattr(total, 'dtype', type(total).__name__)}"
                             f"{list(getattr(total, 'shape', []))} for float64{list(partial.shape)}; it must sum "
                             f"element-wise over ranks and keep shape and dtype")
    return [bins_to_sums(total[k * BINS : (k + 1) * BINS]) for k in range(len(xs))]

