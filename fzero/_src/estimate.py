"""The memory model: bytes of model state per rank for each ZeRO stage.

Ψ = number of parameters, N = world size (the shard axis), and per parameter

    p = bytes of a parameter      g = bytes of a gradient
    s = bytes of optimizer state  m = bytes of the fp32 master copy     K = s + m

Stage k shards the categories its `Stage` names (`Stage.sharded`; the ZeRO paper, Section 5):

    stage 0:  params p·Ψ     grads g·Ψ     state s·Ψ     master m·Ψ     = (p + g + K)·Ψ
    stage 1:  params p·Ψ     grads g·Ψ     state s·Ψ/N   master m·Ψ/N   = (p + g)·Ψ + K·Ψ/N
    stage 2:  params p·Ψ     grads g·Ψ/N   state s·Ψ/N   master m·Ψ/N   = p·Ψ + (g + K)·Ψ/N
    stage 3:  params p·Ψ/N   grads g·Ψ/N   state s·Ψ/N   master m·Ψ/N   = (p + g + K)·Ψ/N

With a bare count Ψ the division is exact (a `Fraction`), as in the paper. With a params
pytree or an `nn.Module` the count is taken from `fzero.layout.plan`: bucket b is a flat buffer
`flat[N * S_b]`; a sharded category costs `S_b` elements per rank, a replicated one the whole
`N * S_b` (padding included). Only model states are counted: no activations, no transient
all-gather buffers, no communication buckets. proofs/memory.md proves each row.

The default optimizer is "adam": fp32 params, gradients and Adam moments (K = 8), what fzero's
`train_step` runs today. The paper's rows use mixed-precision Adam (bf16/fp16 params and
gradients, fp32 master and moments, K = 12): `optimizer="adam-mixed"`, which fzero will train once
it has a precision policy.

Example:
  >>> e = estimate(7.5e9, 64, stage=3, optimizer="adam-mixed")   # the ZeRO paper's Table 1, N = 64
  >>> float(e.total) / 1e9
  1.875
  >>> float(estimate(7.5e9, 64, stage=3).total) / 1e9             # fp32 Adam: 16 bytes / param / N
  1.875
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from numbers import Real
from typing import Any, NamedTuple, Union, overload

import torch

from .errors import ConfigError
from .layout import ParamGroup, UnitSpec, check_world_size, plan
from .stages import STAGES, get_stage

OPTIMIZERS = ("adam-mixed", "adam", "sgd-momentum", "sgd", "adafactor")
CATEGORIES = ("params", "grads", "optimizer_state", "master")


# fp32 optimizer state per parameter: Adam keeps m and v, momentum SGD one buffer, SGD none,
# fzero's adafactor v[S] (its row / column statistics are replicated, O(rows + cols) per leaf).
_STATE_BYTES = {"adam-mixed": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0, "adafactor": 4}
_DEFAULT_DTYPE = {
    "adam-mixed": torch.bfloat16, "adam": torch.float32, "sgd-momentum": torch.float32, "sgd": torch.float32,
    "adafactor": torch.float32,
}  # fmt: skip
_DTYPE_NAMES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}  # fmt: skip

Model = Union[int, float, torch.nn.Module, Any]


class BytesPerParam(NamedTuple):
    """Bytes one parameter costs in each category, before sharding. `K = optimizer_state + master`."""

    params: int
    grads: int
    optimizer_state: int
    master: int

    @property
    def K(self) -> int:  # noqa: N802 -- the paper's name
        return self.optimizer_state + self.master


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of model state on one rank at one ZeRO stage. Exact: each field is a `Fraction`
    (Ψ/N need not be whole for a bare count); `float(e.total) / 1e9` is GB."""

    stage: int
    world_size: int
    params: Fraction
    grads: Fraction
    optimizer_state: Fraction
    master: Fraction

    def __post_init__(self) -> None:
        get_stage(self.stage)
        for name in CATEGORIES:
            value = getattr(self, name)
            if not isinstance(value, Fraction) or value < 0:
                raise ConfigError(f"MemoryEstimate.{name} must be a Fraction >= 0, got {value!r}")

    @property
    def total(self) -> Fraction:
        return self.params + self.grads + self.optimizer_state + self.master


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """`"bf16" | "fp16" | "fp32" | torch.dtype -> torch.dtype` (floating point only)."""
    if isinstance(dtype, str):
        if dtype.lower().removeprefix("torch.") not in _DTYPE_NAMES:
            raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPE_NAMES)} or a torch.dtype")
        dtype = _DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype or its name, got {dtype!r}")
    return dtype


def bytes_per_param(
    optimizer: str = "adam",
    param_dtype: torch.dtype | str | None = None,
    grad_dtype: torch.dtype | str | None = None,
) -> BytesPerParam:
    """Bytes per parameter in each category.

    `param_dtype` defaults to bf16 for "adam-mixed" and fp32 otherwise; `grad_dtype` to
    `param_dtype`. Optimizer state is fp32 (Adam 8, momentum SGD 4, SGD 0). A 4-byte fp32 master
    copy exists exactly when params are narrower than fp32 (mixed precision), so "adam-mixed"
    gives the paper's K = 12 and "adam" (fp32 params) K = 8.
    """
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; use one of {OPTIMIZERS}")
    p = as_dtype(param_dtype) if param_dtype is not None else _DEFAULT_DTYPE[optimizer]
    g = as_dtype(grad_dtype) if grad_dtype is not None else p
    if optimizer == "adam-mixed" and p.itemsize >= 4:
        raise ConfigError(
            f"optimizer 'adam-mixed' keeps an fp32 master copy of low-precision params, but param_dtype "
            f"is {p}; use optimizer='adam' for {p} params, or param_dtype='bf16' / 'fp16'"
        )
    master = 4 if p.itemsize < 4 else 0
    return BytesPerParam(p.itemsize, g.itemsize, _STATE_BYTES[optimizer], master)


class _Buffer(NamedTuple):
    """One flat buffer: `full` elements when replicated, `shard` per rank when sharded."""

    full: Fraction
    shard: Fraction
    trainable: bool


def _count(n: Real) -> Fraction:
    if isinstance(n, bool) or not isinstance(n, Real):
        raise ConfigError(f"expected a parameter count, got {n!r}")
    try:
        count = Fraction(n)
    except (OverflowError, ValueError):
        raise ConfigError(f"parameter count must be finite, got {n!r}") from None
    if count < 0 or count.denominator != 1:
        raise ConfigError(f"parameter count must be a whole number >= 0, got {n!r}")
    return count


def params_of(model: Any) -> Any:
    """`nn.Module -> {name: parameter}` (shared parameters once, as `named_parameters` does);
    any other pytree is returned unchanged."""
    if isinstance(model, torch.nn.Module):
        return dict(model.named_parameters())
    return model


def _buffers(model: Model, world_size: int, units: UnitSpec, groups: Sequence[ParamGroup], align: int) -> list[_Buffer]:
    if isinstance(model, Real) and not isinstance(model, bool):
        psi = _count(model)
        return [_Buffer(psi, psi / world_size, True)]
    layout = plan(params_of(model), world_size, units=units, groups=groups, align=align)
    return [_Buffer(Fraction(b.padded_numel), Fraction(b.shard_numel), not b.group.frozen) for b in layout.buckets]


def _stage_estimate(buffers: Sequence[_Buffer], world_size: int, stage: int, bpp: BytesPerParam) -> MemoryEstimate:
    st = get_stage(stage)

    def category(name: str, per_param: int, trainable_only: bool) -> Fraction:
        pick = (lambda b: b.shard) if st.sharded(name) else (lambda b: b.full)
        return sum((per_param * pick(b) for b in buffers if b.trainable or not trainable_only), Fraction(0))

    return MemoryEstimate(
        stage,
        world_size,
        params=category("params", bpp.params, trainable_only=False),
        grads=category("grads", bpp.grads, trainable_only=True),
        optimizer_state=category("optimizer_state", bpp.optimizer_state, trainable_only=True),
        master=category("master", bpp.master, trainable_only=True),
    )


@overload
def estimate(model: Model, world_size: int, *, stage: int, **kwargs: Any) -> MemoryEstimate: ...
@overload
def estimate(model: Model, world_size: int, *, stage: None = None, **kwargs: Any) -> tuple[MemoryEstimate, ...]: ...
def estimate(
    model: Model,
    world_size: int,
    *,
    stage: int | None = None,
    param_dtype: torch.dtype | str | None = None,
    grad_dtype: torch.dtype | str | None = None,
    optimizer: str = "adam",
    align: int = 1,
    units: UnitSpec = None,
    groups: Sequence[ParamGroup] = (),
) -> MemoryEstimate | tuple[MemoryEstimate, ...]:
    """Per-rank bytes of params, grads, optimizer state and master weights.

    Args:
      model: a parameter count Ψ (int, or a whole float such as `7.5e9`; no padding, Ψ/N exact),
        a params pytree of floating tensors, or an `nn.Module` (its `named_parameters()`). Only
        shapes and dtypes are read, so meta tensors work. For a pytree, `fzero.layout.plan(model,
        world_size, units=units, groups=groups, align=align)` gives the buckets and their
        padding; leaf dtypes only decide the bucketing, `param_dtype` the bytes. Frozen groups
        have no grads, optimizer state or master copy.
      world_size: N >= 1.
      stage: 0-3, or None for all four.
      param_dtype, grad_dtype, optimizer: see `bytes_per_param`.

    Returns:
      A `MemoryEstimate` for `stage`, or a tuple of them for stages 0, 1, 2, 3.
    """
    world_size = check_world_size(world_size)
    if stage is not None:
        get_stage(stage)
    bpp = bytes_per_param(optimizer, param_dtype, grad_dtype)
    buffers = _buffers(model, world_size, units, groups, align)
    if stage is not None:
        return _stage_estimate(buffers, world_size, stage, bpp)
    return tuple(_stage_estimate(buffers, world_size, s.level, bpp) for s in STAGES)


def estimate_stages(model: Model, world_size: int, **kwargs: Any) -> tuple[MemoryEstimate, ...]:
    """`estimate` for stages 0, 1, 2, 3, in order (keyword arguments as `estimate`, without `stage`)."""
    return estimate(model, world_size, stage=None, **kwargs)


def num_params(model: Model) -> int:
    """Ψ: the count itself, or the number of elements of a pytree's / module's parameters (unpadded)."""
    if isinstance(model, Real) and not isinstance(model, bool):
        return int(_count(model))
    layout = plan(params_of(model), 1)
    return sum(b.numel for b in layout.buckets)


_UNITS = ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "kB"))


def human_bytes(n: Fraction | int | float, digits: int = 3) -> str:
    """`31406250000 -> "31.4 GB"`: decimal units (GB = 10^9 B, as in the ZeRO paper), `digits`
    significant digits, rounded half up (41.25 -> 41.3, as the paper prints), trailing zeros dropped."""
    n = Fraction(n)
    for scale, unit in reversed(((1, "B"), *_UNITS[::-1])):
        shown = round_significant(n / scale, digits)
        if Fraction(shown) >= 1 or scale == 1:  # 999.95 kB shows as 1 MB, not 1000 kB
            return f"{shown} {unit}"
    raise AssertionError("unreachable")


def round_significant(x: Fraction | int | float, digits: int = 3, max_decimals: int | None = None) -> str:
    """`x` rounded half up (away from zero) to `digits` significant digits and at most
    `max_decimals` decimals, trailing zeros dropped: `round_significant(Fraction(165, 4)) == "41.3"`.
    Exact: the rounding works on the rational `x`, never on a binary float's neighbours."""
    x = Fraction(x)
    if x == 0:
        return "0"
    sign, x = ("-" if x < 0 else ""), abs(x)
    exponent = len(str(math.floor(x))) - 1 if x >= 1 else -len(str(math.floor(1 / x)))
    while Fraction(10) ** exponent > x:  # 10^exponent <= x < 10^(exponent + 1)
        exponent -= 1
    decimals = digits - 1 - exponent
    if max_decimals is not None:
        decimals = min(decimals, max_decimals)
    q = Decimal(math.floor(x * Fraction(10) ** decimals + Fraction(1, 2))).scaleb(-decimals)
    s = f"{q:f}"
    return sign + (s.rstrip("0").rstrip(".") if "." in s else s)
