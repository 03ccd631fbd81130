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

The policy casts the params, not the batch (FSDP2's policy casts a module's floating forward
inputs by default, `cast_forward_inputs=True`; fzero's loss takes the whole batch, targets too,
and casts none of it): the loss casts its floating inputs (`x.to(torch.bfloat16)`). Where it does
not, torch's dtype error from inside the loss carries a note naming the batch leaves in no
compute dtype and the cast to make (`batch_dtype_note`, made on the error path only).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import warnings
from collections.abc import Collection, Sequence
from typing import Any

import torch

from .errors import ConfigError, outside_stacklevel, said
from .layout import BucketSpec, Layout, LeafSpec
from .stages import Wire
from .tree import flatten_with_paths


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes of computation and reduction (FSDP2's `MixedPrecisionPolicy` rule for None).

    The master values stay in the dtype the params are given in: fp32 params under
    `Precision(torch.bfloat16, torch.float32)` keep an fp32 master, while params given in bf16
    (`model.bfloat16()`) keep none (`fzero.init` warns, `NoFp32Master`, where `param_dtype` is set).

    Attributes:
      param_dtype: what units are gathered and computed in (fp32, bf16, fp16, fp64; not
        narrower than 16 bits). None: each bucket's own dtype, no cast.
      reduce_dtype: what gradients are reduced in; not narrower than 16 bits. None: `param_dtype`
        where that is set, else each bucket's own dtype -- so `Precision(torch.bfloat16)` reduces
        in bf16; pass `reduce_dtype=torch.float32` to reduce fp32 params' gradients in fp32.
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


class NoFp32Master(UserWarning):
    """`fzero.init` under a `Precision` whose `param_dtype` is set, of trainable params already
    16-bit (`model.bfloat16()` / `model.half()` before `from_module`): the state keeps the master
    values in the params' own dtype, so it keeps no fp32 master and the optimizer updates 16-bit
    values (DeepSpeed's bf16 / fp16 modes keep an fp32 master whatever the module's dtype).
    Give fp32 params for an fp32 master, or drop `param_dtype` to train in 16 bits on purpose."""


def unmastered(precision: Precision, layout: Layout) -> list[LeafSpec]:
    """The trainable leaves that `precision` computes in a 16-bit `param_dtype` and whose master
    values are 16-bit too, as given (`Stage.hold` keeps the master in the params' own dtype):
    empty where `param_dtype` is None (16-bit params with no policy, or with only a wider
    `reduce_dtype`, train in 16 bits on purpose: docs/bad-input.md row 94) or not 16-bit. Read
    from the layout's specs only, once per `init`."""
    compute = precision.param_dtype
    if compute is None or compute.itemsize != 2:
        return []
    return [layout.leaves[i] for b in layout.buckets if not b.group.frozen and b.dtype.itemsize == 2
            for i in b.leaves]


def no_master_message(precision: Precision, leaves: Sequence[LeafSpec]) -> str:
    """`NoFp32Master`'s words for `leaves` (`unmastered`): the first few (path, dtype, shape) and
    their count, why no fp32 master is kept, and the two ways on."""
    compute = short_name(precision.param_dtype)  # type: ignore[arg-type]  # (`unmastered` found it set)
    dtypes, listed = leaves_words(leaves, specs=True)
    alike = dtypes == [str(precision.param_dtype).removeprefix("torch.")]
    same = ("already the policy's param_dtype, so the policy casts nothing" if alike
            else f"16-bit already, cast to the policy's {compute}")
    now = "as now" if alike else f"in their own {'/'.join(dtypes)}"
    fp16 = (" (fp16 params also lose Adam's eps=1e-8, which is 0 in fp16, and small gradients: fp32 params with "
            "fzero.Precision(torch.float16, torch.float32) and loss_scale=fzero.DynamicLossScale() is DeepSpeed's "
            "fp16 mode)") if "float16" in dtypes else ""
    counted = "1 trainable params leaf" if len(leaves) == 1 else f"{len(leaves)} trainable params leaves"
    verb = "is" if len(leaves) == 1 else "are"
    return (f"fzero.init: {counted} ({listed}) {verb} {'/'.join(dtypes)}, "
            f"{same}: no fp32 master is kept (the state keeps the master values in the params' own dtype), so "
            f"the optimizer updates them in {'/'.join(dtypes)} and an update smaller than half a unit in the last "
            f"place of a weight rounds away, silently (DeepSpeed's bf16 / fp16 modes keep an fp32 master whatever "
            f"the module's dtype){fp16}. For fp32 master weights, give fzero.init fp32 params: model.float() "
            f"before fzero.from_module (or {{k: v.float() for k, v in params.items()}}); {precision!r} then "
            f"computes in {compute} and keeps the fp32 master. To train in 16 bits on purpose, drop param_dtype: "
            f"fzero.Precision(reduce_dtype={precision.reduce_dtype or precision.param_dtype}) computes these params "
            f"{now}, with no warning (fzero.NoFp32Master)")


def leaves_words(leaves: Sequence[LeafSpec], specs: bool = False) -> tuple[list[str], str]:
    """`leaves` in a message: their dtypes' names, sorted, and the first 4 paths (with each one's
    `dtype[shape]` where `specs`) and how many more -- `NoFp32Master`'s words and the step's
    missing-master advice (`state.unmastered_words`)."""
    dtypes = sorted({str(ls.dtype).removeprefix("torch.") for ls in leaves})
    shown = ", ".join(f"{ls.path!r} ({_shown(ls)})" if specs else repr(ls.path) for ls in leaves[:4])
    return dtypes, shown + (f" and {len(leaves) - 4} more" if len(leaves) > 4 else "")


def warn_no_master(precision: Precision, layout: Layout) -> None:
    """`NoFp32Master` where `unmastered` finds leaves (`fzero.init`, on every rank: each raises
    alike under `-W error`), at the user's line."""
    leaves = unmastered(precision, layout)
    if leaves:
        warnings.warn(NoFp32Master(no_master_message(precision, leaves)), stacklevel=outside_stacklevel())


def narrower_range(compute: torch.dtype, held: torch.dtype) -> torch.dtype | None:
    """`compute` where its largest finite value is below `held`'s (fp16 units over fp32 or bf16
    master values), else None: there a finite master value can still be inf in its compute copy
    (|x| >= 65520 rounds to inf in fp16; bf16 too, above 3.3961e38, where fp32 goes on to
    3.4028e38), so an update's finite check reads the master's extremes as the compute dtype holds
    them (`unit.finite_witness(x, extremes=True)`, then cast)."""
    return compute if torch.finfo(compute).max < torch.finfo(held).max else None


# words of torch's errors for operands of different dtypes: "expected m1 and m2 to have the same dtype",
# "expected scalar type BFloat16 but found Float", "Input type (float) and bias type (c10::BFloat16)
# should be the same", "to have the same type as tensor", "prelu: Type promoting not supported"
DTYPE_WORDS = ("dtype", "scalar type", "same type", "type (", "type promot")


_INTEGER = re.compile(r"\b(long|int|int64|int32|short|byte|bool|char)\b")  # an integer dtype's name in torch's words


def _about_floating_dtypes(message: str) -> bool:
    """Whether torch's `message` is about operands of different dtypes (`DTYPE_WORDS`) and names no
    integer dtype: cross_entropy's "expected target dtype to be Long or Byte, but got Float" under
    a bf16 policy is about the targets' kind, not the batch meeting the params, and was told to
    cast every floating leaf to bfloat16 (found in review). (Not "names the params' dtype": layer
    norm's "expect parameter to have scalar type of Float" names only the input's.)"""
    words = message.lower()
    return any(w in words for w in DTYPE_WORDS) and not _INTEGER.search(words)


def computes(precision: Precision, buckets: Collection[BucketSpec]) -> frozenset[torch.dtype]:
    """The dtypes the params reach the loss in under `precision`: each bucket's compute dtype
    (`Wire.compute`), read from the layout without gathering."""
    return frozenset(precision.wire(b).compute for b in buckets)


BUFFER_NOTE = "fzero: the params reach the module in"  # how `module.buffer_dtype_note` starts


def batch_dtype_note(message: str, batch: Any, params: Collection[torch.dtype], policy: torch.dtype | None,
                     where: str = "the batch", reader: str = "the loss") -> str:
    """The note a step (or `evaluate`) adds to an error its loss raised, where the error is about
    dtypes (`DTYPE_WORDS` in `message`) and a floating tensor of `batch` is in none of the dtypes
    `params` (`computes`) reach the loss in: under a precision policy (`policy`, its
    `param_dtype`) the params are cast, not the batch, so an fp32 input meets bf16 params in the
    first matrix product with torch's "mat1 and mat2 must have the same dtype", which names no
    input and no policy (found in a new-user walkthrough; FSDP2's `MixedPrecisionPolicy` casts a
    module's floating forward inputs by default, `cast_forward_inputs=True`, fzero's policy does
    not: README, "Mixed precision"). It names those leaves (their pytree paths in `where`, dtype,
    shape), the params' dtype and the way out (a cast in `reader`). "" elsewhere; built on the
    error path only, so a step that succeeds does no work for it."""
    if not _about_floating_dtypes(message):
        return ""
    paths, leaves, _ = flatten_with_paths(batch)
    odd = [(path, t) for path, t in zip(paths, leaves)
           if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype not in params]
    if not odd or not params:
        return ""
    if len(odd) == 1 and odd[0][0] == "<root>":
        shown = f"{where} (a tensor {_shown(odd[0][1])}) is"
    else:
        named = [f"{path!r} ({_shown(t)})" for path, t in odd[:4]]
        listed = (named[0] if len(odd) == 1 else ", ".join(named) + f" and {len(odd) - 4} more" if len(odd) > 4
                  else f"{', '.join(named[:-1])} and {named[-1]}")
        shown = f"leaf {listed} of {where} is" if len(odd) == 1 else f"leaves {listed} of {where} are"
    held = sorted(set(params), key=str)
    if len(held) > 1:
        return (f"fzero: {shown} in none of the dtypes the params reach {reader} in "
                f"({', '.join(map(str, held))}); cast each floating input to the dtype of the params it meets, in "
                f"{reader}")
    to = held[0]
    if policy is not None and policy == to:
        why = ("the fzero.Precision policy's param_dtype: the policy casts the params, not the batch, unlike FSDP2's "
               "MixedPrecisionPolicy(cast_forward_inputs=True)")
        other = ", or keep fp32 params and compute under torch.autocast"
    else:
        why, other = "the params' own dtype, as given to fzero.init", ""
    return (f"fzero: {shown} not in {to}, the dtype the params reach {reader} in ({why}); cast floating "
            f"inputs to {to} in {reader} (x.to({to}); a from_module model: apply(p, x.to({to})){other})")


def note_batch_dtypes(e: BaseException, precision: Precision, buckets: Collection[BucketSpec], batch: Any,
                      where: str = "the batch", reader: str = "the loss") -> None:
    """Add `batch_dtype_note` to `e`, an error the loss (or `evaluate`'s fn) raised, for the
    dtypes the params reach it in under `precision` (`computes`); the step's and `evaluate`'s
    error paths. A note that cannot be made never hides `e`."""
    if any(str(n).startswith(BUFFER_NOTE) for n in getattr(e, "__notes__", ())):
        return  # the module's floating buffers meet the params: the batch may be cast already (found in review)
    with contextlib.suppress(Exception):
        note = batch_dtype_note(said(e), batch, computes(precision, buckets), precision.param_dtype, where, reader)
        if note:
            e.add_note(note)


def _shown(t: torch.Tensor | LeafSpec) -> str:
    """A tensor (or a layout's leaf spec) in a message: its dtype and shape, `float32[4, 8]`."""
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


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
