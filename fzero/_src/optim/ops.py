r"""The element-wise ops whose CPU bits for bfloat16 / float16 depend on where an element sits in
the call, computed here so that they do not.

fzero calls torch's ops on pieces of a flat shard, which N, the stage and the blocks cut in
different places (`base.runs`, `base.in_blocks`); an element must get the same bits wherever its
piece starts and however long the piece is. torch's CPU kernels give that for float32 and
float64. For bfloat16 and float16 a kernel runs a vectorised body over the first `n - n mod W`
elements of a call of `n` (per thread) and a scalar tail over the rest (W depends on the vector
width torch's kernels were built for and the CPU runs: 32 measured here, torch 2.13 on an AVX512
CPU; `tests/test_optim_half.py::vector_step` measures it), and two of the ops fzero's optimizers
use round differently in the two (measured on torch 2.13):

* `x.add(y, alpha=a)`, with $\hat a = \mathrm{rnd}_d(\mathrm{rnd}_{32}(a))$ (torch's scalar
  conversion to the dtype $d$, through float32):
  body $\mathrm{rnd}_d(\mathrm{fma}_{32}(y, \hat a, x))$, tail
  $\mathrm{rnd}_d(x + \mathrm{rnd}_d(y \hat a))$ (the product rounded to $d$ first);
* `x.rsqrt()`: body $\mathrm{rnd}_d(\mathrm{rnd}_{32}(1 / \mathrm{rnd}_{32}(\sqrt x)))$ (float32's
  `rsqrt`), tail another formula (for bfloat16 $\mathrm{rnd}_d(1 / \mathrm{rnd}_d(\sqrt x))$).

(The other ops the optimizers use -- `mul`, `div`, `lerp`, `addcmul`, `addcdiv` with scalars,
`sqrt`, `maximum`, `neg`, `clamp`, their foreach forms, conversions -- round alike in body and
tail.) So on the CPU, for these two dtypes, `add` / `add_` / `foreach_add` / `foreach_add_` /
`rsqrt_` compute the body's formula at every element: each element gets what torch gives it in
the body of a call, whatever the piece, and torch's bits except in torch's own tails. Every other
dtype and device calls torch's op itself, unchanged (CUDA's kernels: not measured here).

The add's formula is computed exactly as the body's: in float64, $y \hat a$ is exact (at most
$2 \cdot 11$ significant bits, far inside float64's exponent range), the sum is rounded once to
float64 and then to float32, which equals one rounding to float32 -- the fma's -- because both
terms have at most 22 significant bits: the exact sum fits 53 bits, or its bits past the 24th are
a run of zeros or ones ending far below, which no rounding to 53 bits turns into a float32
midpoint (the argument for overflow past float32's largest value and for its subnormals is the
same, the midpoint's position fixed instead of relative). Then float32 to $d$, as torch converts.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

HALF = (torch.bfloat16, torch.float16)  # the dtypes whose CPU add-with-alpha and rsqrt round by position
CHUNK = 1 << 15  # elements per float64 temporary of `_add_into` (256 KiB), whatever the piece's length


def explicit(x: torch.Tensor) -> bool:
    """Whether `x`'s ops are computed here (a bfloat16 / float16 tensor on the CPU) rather than
    by torch's kernel."""
    return x.device.type == "cpu" and x.dtype in HALF


def rounded_alpha(alpha: float, dtype: torch.dtype) -> float:
    r"""$\hat a$: `alpha` as torch's kernel for `dtype` takes it (`Scalar.to<scalar_t>()`: to
    float32, then to the dtype, each round to nearest even)."""
    return float(torch.tensor(alpha, dtype=torch.float32).to(dtype))


def _add_into(out: torch.Tensor, x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    r"""`out[n] = rnd_d(fma_32(y, â, x))` element by element, `x`, `y`, `out` 1-d views of `n`
    elements of dtype $d$ (`out` may be `x` or `y`), in chunks of `CHUNK`: the temporaries are one
    chunk's, whatever `n`."""
    a = rounded_alpha(alpha, x.dtype)
    flat_out, flat_x, flat_y = out.view(-1), x.reshape(-1), y.reshape(-1)
    for at in range(0, flat_out.numel(), CHUNK):
        s = slice(at, at + CHUNK)
        exact = flat_y[s].to(torch.float64).mul_(a).add_(flat_x[s])  # y * â exact; the sum rounded once
        flat_out[s].copy_(exact.to(torch.float32))  # to float32 (the fma's rounding), then to d
    return out


def add(x: torch.Tensor, y: torch.Tensor, alpha: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """`torch.add(x, y, alpha=alpha, out=out)`, computed by `_add_into` where `explicit(x)`."""
    if not explicit(x):
        return torch.add(x, y, alpha=alpha) if out is None else torch.add(x, y, alpha=alpha, out=out)
    return _add_into(torch.empty_like(x) if out is None else out, x, y, alpha)


def add_(x: torch.Tensor, y: torch.Tensor, alpha: float) -> torch.Tensor:
    """`x.add_(y, alpha=alpha)`, computed by `_add_into` where `explicit(x)`."""
    return _add_into(x, x, y, alpha) if explicit(x) else x.add_(y, alpha=alpha)


def foreach_add(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], alpha: float) -> list[torch.Tensor]:
    """`torch._foreach_add(xs, ys, alpha=alpha)`; per tensor `add` where `explicit` (torch's CPU
    foreach ops are its per-tensor ops)."""
    if xs and explicit(xs[0]):
        return [add(x, y, alpha) for x, y in zip(xs, ys)]
    return torch._foreach_add(xs, ys, alpha=alpha)


def foreach_add_(xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor], alpha: float) -> None:
    """`torch._foreach_add_(xs, ys, alpha=alpha)`; per tensor `add_` where `explicit`."""
    if xs and explicit(xs[0]):
        for x, y in zip(xs, ys):
            add_(x, y, alpha)
        return
    torch._foreach_add_(xs, ys, alpha=alpha)


def rsqrt_(x: torch.Tensor) -> torch.Tensor:
    r"""`x.rsqrt_()`; where `explicit(x)`, the body's $\mathrm{rnd}_d(1/\sqrt{x})$ in float32
    (torch's float32 `rsqrt`, which rounds alike everywhere) at every element."""
    if not explicit(x):
        return x.rsqrt_()
    return x.copy_(torch.rsqrt(x.to(torch.float32)))
