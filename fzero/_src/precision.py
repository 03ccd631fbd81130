"""Mixed precision: the dtypes units compute and reduce in, beside fp32 master weights.

`Precision(param_dtype, reduce_dtype)` (FSDP2's `MixedPrecisionPolicy` is the model) is given to
`fzero.init(..., precision=...)`. The state keeps each bucket's master values in the dtype the
params were given in (fp32, typically) and the optimizer state beside them, sharded as the stage
says; units are cast to `param_dtype` once per unit and step, inside the unit Function (before
the all-gather where the stage shards params, so the gather moves `param_dtype` bytes), and the
loss computes in it; each unit's gradient is reduced in `reduce_dtype` and the optimizer updates
the master values. Stages 1-2 keep a `param_dtype` copy of the full params beside their fp32
master shard (ZeRO's 2Ψ + 2Ψ + KΨ/N); stage 0 keeps the full master and casts it each step;
stage 3 keeps only the master shard (proofs/precision.md).
"""

from __future__ import annotations

import dataclasses

import torch

from .errors import ConfigError
from .layout import BucketSpec
from .stages import Wire


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes of computation and reduction (None: the bucket's own dtype, no cast).

    Attributes:
      param_dtype: what units are gathered and computed in (fp32, bf16, fp16, fp64; not
        narrower than 16 bits).
      reduce_dtype: what gradients are reduced in; not narrower than 16 bits.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            dtype = getattr(self, name)
            if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point
                                      or dtype.is_complex):
                raise ConfigError(f"Precision.{name} must be a floating torch.dtype (torch.float32, torch.bfloat16, "
                                  f"torch.float16) or None, got {dtype!r}")
        if self.reduce_dtype is not None and self.reduce_dtype.itemsize < 2:
            raise ConfigError(f"Precision.reduce_dtype {self.reduce_dtype} is narrower than 16 bits: sums of "
                              f"gradients over ranks need at least fp16 / bf16; use torch.float32 or torch.bfloat16")
        if self.param_dtype is not None and self.param_dtype.itemsize < 2:  # also the reduce dtype where that is None
            raise ConfigError(f"Precision.param_dtype {self.param_dtype} is narrower than 16 bits: units compute in "
                              f"it, and torch's 8-bit floats have no arithmetic but scaled matrix products (their "
                              f"gradients would be reduced in it too); use torch.bfloat16 or torch.float16")

    def wire(self, bucket: BucketSpec) -> Wire:
        """How bucket `bucket` travels under this policy."""
        return Wire(bucket.tag, self.param_dtype or bucket.dtype, self.reduce_dtype or self.param_dtype or bucket.dtype)

    def within(self, bucket: BucketSpec) -> torch.dtype | None:
        """`narrower_range` of the bucket's compute dtype against its own: the dtype its update's
        finite check reads the master's extremes in, or None."""
        return narrower_range(self.wire(bucket).compute, bucket.dtype)


FULL = Precision()  # no policy: every bucket computes and reduces in its own dtype


def narrower_range(compute: torch.dtype, held: torch.dtype) -> torch.dtype | None:
    """`compute` where its largest finite value is below `held`'s (fp16 units over fp32 or bf16
    master values), else None: there a finite master value can still be inf in its compute copy
    (|x| >= 65520 rounds to inf in fp16; bf16 too, above 3.3961e38, where fp32 goes on to
    3.4028e38), so an update's finite check reads the master's extremes as the compute dtype holds
    them (`unit.finite_witness(x, extremes=True)`, then cast)."""
    return compute if torch.finfo(compute).max < torch.finfo(held).max else None


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """float32, or `dtype` where wider (float64)."""
    return torch.promote_types(torch.float32, dtype)


def added_in(accum_dtype: torch.dtype | None, dtype: torch.dtype) -> torch.dtype:
    """The dtype a step adds gradients of `dtype` in (`train_step(accum_dtype=...)`):
    `accum_dtype` where given, else float32 or `dtype` where wider. By default a float64 gradient
    is not rounded to float32 (when the default was float32 itself, it was, even with one
    micro-batch, where nothing is added: found in review, 1.1e-07 from torch's SGD step on
    float64 params); a dtype given is the user's."""
    return accum_dtype if accum_dtype is not None else at_least_float32(dtype)


DTYPE_NAMES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
    "fp64": torch.float64, "float64": torch.float64, "double": torch.float64,
}  # fmt: skip
"""The names `as_dtype` takes for a dtype (`fzero estimate --dtype/--precision`, `estimate`,
`expected_comm`), each dtype's short name first."""


def short_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16 -> "bf16"`: the name `as_dtype` (and so `fzero estimate --dtype/--precision`)
    takes first for a dtype."""
    return next(name for name, d in DTYPE_NAMES.items() if d == dtype)


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """`"bf16" | "fp16" | "fp32" | torch.dtype -> torch.dtype`: floating point of 16 bits or more,
    the dtypes fzero keeps params and gradients in (`layout.PARAM_DTYPES`, `Precision`); else a
    `ConfigError` naming the value. Here, below `estimate` and `accounting`, which both read it."""
    if isinstance(dtype, str):
        if dtype.lower().removeprefix("torch.") not in DTYPE_NAMES:
            raise ConfigError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPE_NAMES)} or a torch.dtype")
        dtype = DTYPE_NAMES[dtype.lower().removeprefix("torch.")]
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"dtype must be a floating torch.dtype or its name, got {dtype!r}")
    if dtype.itemsize < 2:  # found in review: float8 gave an estimate of a state fzero.init refuses to make
        raise ConfigError(f"dtype {dtype} is narrower than 16 bits: fzero keeps no params or gradients in it (a "
                          f"params leaf or a fzero.Precision of it is refused); use bf16, fp16, fp32 or fp64")
    return dtype
