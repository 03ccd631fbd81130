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

import torch

from ..layout import Segment

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
