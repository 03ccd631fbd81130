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

Offload (`offload_optimizer="cpu" | "nvme"`, `offload_params="cpu"`, `offload_ratio=r`, or
`offload=fzero.Offload(...)`) moves part of a rank's model state off the device. With H the
elements of the rank's trainable shards that live on the host (every bucket's with params
offload, else the buckets after a device-kept prefix of at most (1 - r) of them,
`host_fractions`) and D = E - H those kept on the device (K above is s + m):

    device:  params as the stage holds them (none with params offload, stage 3), grads as the
             stage holds them (an upper bound: with one micro-batch stages 2-3 free each host
             bucket's gradient shard in the backward as it is copied, `offload.early_copies`),
             optimizer state s·D, master m·D
    host:    grads g·H (the shards' device -> host copies), master m'·H ("cpu"; m' = m, or p
             where there is no master: the host always keeps one, fp32 for fp32 params),
             optimizer state s·H ("cpu"), swap buffers ("nvme")
    NVMe:    optimizer state s·H and master m'·H ("nvme"), and with params "nvme" the
             compute-dtype shards p·E

proofs/memory.md ("Offload") derives each entry from what fzero's offload keeps where.

The default optimizer is "adam": what fzero's `init` keeps without a precision policy -- the
params, gradients and Adam moments all in the params' own dtype and no master copy (fp32: K = 8;
bf16 params: K = 4, the moments in bf16 too), each bucket in its own dtype for a params pytree
(`param_dtype` overrides it). The paper's rows use mixed-precision Adam (bf16/fp16 params and
gradients, fp32 master and moments, K = 12): `optimizer="adam-mixed"`, the paper's accounting, a
bf16 copy of the params beside an fp32 master at every stage. fzero keeps that layout with a
policy (`fzero.Precision(torch.bfloat16)`, or fp16) only where the stage shards the master but
not the params (stages 1-2), or offloads the optimizer; at stages 0 and 3 without offload the
fp32 params are the master itself (one copy, cast to bf16 when a unit is entered or gathered):
no separate copy. `precision=fzero.Precision(...)` estimates that layout, stage by stage
(`policy_bytes_per_param`); `precision=None` (the default) is `fzero.Precision()`, no policy,
but for "adam-mixed".

For a params pytree or module (not a bare count) the optimizer's replicated per-leaf fields are
counted too, as `fzero.optim` makes them (`leaf_bytes`): every rank keeps, per trainable bucket
of L leaves, Adam's, LAMB's and adafactor's step counts (float32 `[L]`), momentum SGD's counts,
and adafactor's row and column statistics -- in the optimizer state, on the device or with the
bucket's offloaded shard. "adam-mixed", the paper's accounting, counts per-element bytes only.

Example:
  >>> e = estimate(7.5e9, 64, stage=3, optimizer="adam-mixed")   # the ZeRO paper's Table 1, N = 64
  >>> float(e.total) / 1e9
  1.875
  >>> float(estimate(7.5e9, 64, stage=3).total) / 1e9             # fp32 Adam: 16 bytes / param / N
  1.875
  >>> e = estimate(14e9, 2, stage=3, optimizer="adam-mixed", offload_optimizer="cpu")
  >>> float(e.total) / 1e9, float(e.host.total) / 1e9               # GPU: bf16 params + grads
  (28.0, 98.0)
  >>> from fzero import Precision                                   # fzero's layout: fp32 params, bf16 compute
  >>> [float(e.total) / 1e9 for e in estimate_stages(7.5e9, 64, precision=Precision(torch.bfloat16, torch.float32))]
  [120.0, 46.40625, 16.875, 1.875]
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from decimal import Decimal
from fractions import Fraction
from numbers import Real
from typing import Any, NamedTuple, Union, overload

import torch

from . import nvme, optim
from .errors import ConfigError
from .layout import ParamGroup, UnitSpec, check_world_size, plan
from .optim.base import init_state
from .precision import FULL, Precision, as_dtype
from .precision import short_name as short_name  # read from here by checkpoint
from .stages import STAGES, Stage, get_stage
from .tree import flatten_with_paths

OPTIMIZERS = ("adam-mixed", "adam", "sgd-momentum", "sgd", "adafactor")
CATEGORIES = ("params", "grads", "optimizer_state", "master")
OFFLOAD_OPTIMIZER = (None, "cpu", "nvme")
OFFLOAD_PARAMS = (None, "cpu", "nvme")


# fp32 optimizer state per parameter: Adam keeps m and v, momentum SGD one buffer, SGD none,
# fzero's adafactor v[S] (its row / column statistics are replicated, O(rows + cols) per leaf).
_STATE_BYTES = {"adam-mixed": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0, "adafactor": 4}
_AMSGRAD = ("adam-mixed", "adam")  # amsgrad=True: one more fp32 array, max(v)
_DEFAULT_DTYPE = {
    "adam-mixed": torch.bfloat16, "adam": torch.float32, "sgd-momentum": torch.float32, "sgd": torch.float32,
    "adafactor": torch.float32,
}  # fmt: skip

Model = Union[int, float, torch.nn.Module, Any]


class BytesPerParam(NamedTuple):
    """Bytes one parameter costs in each category (`params`, `grads`, `optimizer_state`, `master`),
    before sharding. `K = optimizer_state + master`."""

    params: int
    grads: int
    optimizer_state: int
    master: int

    @property
    def K(self) -> int:  # noqa: N802 -- the paper's name
        return self.optimizer_state + self.master


class OffloadSetting(NamedTuple):
    """What the estimate reads of an offload: where the optimizer's shard lives (None, "cpu",
    "nvme"), where stage 3's param shards live (None, "cpu", "nvme"), and the fraction r of the trainable
    elements offloaded (DeepSpeed's `ratio`, exact; by whole buckets: `host_fractions`)."""

    optimizer: str | None = None
    params: str | None = None
    ratio: Fraction = Fraction(1)


NO_OFFLOAD = OffloadSetting()


class TierBytes(NamedTuple):
    """Bytes of one rank's model state in one off-device tier (host memory or NVMe), per category
    (`params`, `grads`, `optimizer_state`, `master`); `buffers` are the NVMe swap files' host
    buffers (`nvme.buffer_bytes`)."""

    params: Fraction = Fraction(0)
    grads: Fraction = Fraction(0)
    optimizer_state: Fraction = Fraction(0)
    master: Fraction = Fraction(0)
    buffers: Fraction = Fraction(0)

    @property
    def total(self) -> Fraction:
        return sum(self, Fraction(0))


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of model state on one rank (of `world_size`) at one ZeRO `stage`. Exact: each field is
    a `Fraction` (Ψ/N need not be whole for a bare count); `float(e.total) / 1e9` is GB.

    `params`, `grads`, `optimizer_state`, `master` and `total` are the device's (the GPU's);
    `host` (CPU RAM) and `nvme` are the off-device tiers of `offload` (zero without offload)."""

    stage: int
    world_size: int
    params: Fraction
    grads: Fraction
    optimizer_state: Fraction
    master: Fraction
    host: TierBytes = TierBytes()
    nvme: TierBytes = TierBytes()
    offload: OffloadSetting = NO_OFFLOAD

    def __post_init__(self) -> None:
        get_stage(self.stage)
        values = [(name, getattr(self, name)) for name in CATEGORIES]
        values += [(f"{tier}.{k}", v) for tier in ("host", "nvme") for k, v in getattr(self, tier)._asdict().items()]
        for name, value in values:
            if not isinstance(value, Fraction) or value < 0:
                raise ConfigError(f"MemoryEstimate.{name} must be a Fraction >= 0, got {value!r}")

    @property
    def total(self) -> Fraction:
        """Bytes on the device."""
        return self.params + self.grads + self.optimizer_state + self.master


def bytes_per_param(
    optimizer: str = "adam",
    param_dtype: torch.dtype | str | None = None,
    grad_dtype: torch.dtype | str | None = None,
    *,
    amsgrad: bool = False,
) -> BytesPerParam:
    """Bytes per parameter in each category.

    `optimizer` is one of "adam-mixed" (the ZeRO paper's bf16 params with an fp32 master),
    "adam", "sgd-momentum", "sgd", "adafactor" (else `ConfigError`). `param_dtype` defaults to
    bf16 for "adam-mixed" and fp32 otherwise; `grad_dtype` to `param_dtype`. Optimizer state is
    fp32 (Adam 8, 12 with `amsgrad`, momentum SGD 4, adafactor 4 -- its per-element second
    moment; the per-leaf fields are not per parameter -- SGD 0). A
    4-byte fp32 master copy exists exactly when params are narrower than fp32 (mixed precision),
    so "adam-mixed" gives the paper's K = 12 and "adam" (fp32 params) K = 8.
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
    return BytesPerParam(p.itemsize, g.itemsize, _state_bytes(optimizer, amsgrad), master)


def _state_bytes(optimizer: str, amsgrad: bool) -> int:
    """fp32 bytes of optimizer state per parameter (`amsgrad`: Adam's third array, max(v))."""
    if not isinstance(amsgrad, bool):
        raise ConfigError(f"amsgrad must be a bool, got {amsgrad!r}")
    if amsgrad and optimizer not in _AMSGRAD:
        raise ConfigError(f"amsgrad=True is an Adam setting; optimizer {optimizer!r} has none: use one of {_AMSGRAD}")
    return _STATE_BYTES[optimizer] + 4 * amsgrad


def policy_bytes_per_param(
    optimizer: str,
    stage: int | Stage,
    precision: Precision,
    param_dtype: torch.dtype | str | None = None,
    grad_dtype: torch.dtype | str | None = None,
    offload: OffloadSetting = NO_OFFLOAD,
    *,
    amsgrad: bool = False,
) -> tuple[BytesPerParam, int]:
    """Bytes per parameter of what `fzero.init(..., precision=precision)` keeps at `stage`, and
    the bytes per parameter of a frozen bucket's params.

    `optimizer` and `amsgrad` as for `bytes_per_param`, but "adam-mixed" is refused (the policy
    decides the copies: use "adam"); `offload` is where the master and optimizer state live
    (`OffloadSetting`; default none).

    `param_dtype` is the dtype the params are held in (default fp32), `precision.param_dtype`
    (default: the same) the one units compute in, and the reduced gradients are held at the
    update in `grad_dtype` (default: the held dtype, whatever `precision.reduce_dtype` is: the step
    casts each reduced part to its bucket's dtype, `fzero._src.step.accumulate`; before, the reduce
    dtype was counted, half the held fp32 gradient under `Precision(bf16)`: found in review). A
    trainable bucket keeps a
    compute-dtype copy of its params beside its master (in the held dtype) only where the two
    differ and the stage shards the master but not the params (stages 1-2), or the optimizer is
    offloaded (stages 1-3: the master moves off the device); elsewhere (stages 0 and 3 without
    offload) the held params are the master, cast when a unit is entered or gathered: p = the
    held dtype's bytes, m = 0. The optimizer state is in the master's (held) dtype: fp32 Adam 8
    bytes, bf16 Adam 4. Frozen buckets keep their params in the held dtype.
    """
    if optimizer == "adam-mixed":
        raise ConfigError("optimizer 'adam-mixed' is the ZeRO paper's accounting (a bf16 copy beside an fp32 master at "
                          "every stage); with precision=fzero.Precision(...) the policy decides the copies: use "
                          "optimizer='adam'")
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {optimizer!r}; use one of {OPTIMIZERS}")
    if not isinstance(precision, Precision):
        raise ConfigError(f"precision must be a fzero.Precision (e.g. fzero.Precision(torch.bfloat16, torch.float32); "
                          f"fzero.Precision() for no policy) or None (the paper's accounting), got {precision!r}")
    st = stage if isinstance(stage, Stage) else get_stage(stage)
    held = as_dtype(param_dtype) if param_dtype is not None else torch.float32
    compute = precision.param_dtype or held
    grads = as_dtype(grad_dtype) if grad_dtype is not None else held
    state = _state_bytes(optimizer, amsgrad) // 4 * held.itemsize
    copy = compute != held and st.sharded("master") and (offload.optimizer is not None or not st.sharded("params"))
    bpp = BytesPerParam(compute.itemsize if copy else held.itemsize, grads.itemsize, state,
                        held.itemsize if copy else 0)
    return bpp, held.itemsize


class _Buffer(NamedTuple):
    """One flat buffer: `full` elements when replicated, `shard` per rank when sharded; `bucket`
    is False for a bare count (one buffer standing for buckets whose sizes are unknown); `dtype`
    the bucket's own and `shapes` its leaves' (None and () for a bare count)."""

    full: Fraction
    shard: Fraction
    trainable: bool
    bucket: bool = True
    dtype: torch.dtype | None = None
    shapes: tuple[tuple[int, ...], ...] = ()


class _Cost(NamedTuple):
    """What one buffer costs at one stage: `bpp` per element; `frozen` bytes per element of its
    params where it is frozen; `leaf` bytes of its replicated per-leaf optimizer fields per rank
    (`leaf_bytes`; 0 for a frozen buffer or a bare count); `item` bytes per element of one
    per-element optimizer field (what an NVMe swap file holds per element)."""

    bpp: BytesPerParam
    frozen: int
    leaf: int = 0
    item: int = 4
    kept: BytesPerParam | None = None  # where an offload keeps the buffer's shard on the device (ratio < 1):
    # its cost without the offload (stage 3: the held params are the master, no compute copy); None: `bpp`

    @property
    def on_device(self) -> BytesPerParam:
        return self.bpp if self.kept is None else self.kept


def _optimizer_of(optimizer: str, amsgrad: bool) -> Any:
    """The `fzero.optim` optimizer an estimate's optimizer name stands for (hyper-parameters do
    not change what its state holds)."""
    return {"adam": lambda: optim.adam(1e-3, amsgrad=amsgrad), "sgd-momentum": lambda: optim.sgd(0.1, momentum=0.9),
            "sgd": lambda: optim.sgd(0.1), "adafactor": lambda: optim.adafactor()}[optimizer]()


@functools.lru_cache(maxsize=4096)
def leaf_bytes(optimizer: str, dtype: torch.dtype, shapes: tuple[tuple[int, ...], ...], amsgrad: bool = False) -> int:
    """Bytes of the replicated fields (spec kinds "leaf", "rows", "cols") of one trainable
    bucket's optimizer state, whose leaves have `shapes` and whose master is in `dtype`: what the
    `fzero.optim` optimizer of that name makes (`init_state` on the meta device: no memory), so
    what every rank keeps at every stage besides the per-element fields -- Adam's, LAMB's and
    adafactor's step counts, momentum SGD's counts (float32 `[L]`), adafactor's row and column
    statistics (in `dtype`). 0 for "adam-mixed" (the paper's accounting)."""
    if optimizer == "adam-mixed":
        return 0
    opt = _optimizer_of(optimizer, amsgrad)
    state = init_state(opt, torch.empty(0, dtype=dtype, device="meta"), shapes)
    return sum(t.numel() * t.element_size() for t, kind in zip(state, opt.spec(state)) if kind != "shard")


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


_MODEL = ("a model is a parameter count (an int, or a whole float such as 7.5e9), an nn.Module, or a "
          "pytree of tensors (only shapes and dtypes are read: meta tensors work)")


def params_of(model: Any) -> Any:
    """`nn.Module -> {name: parameter}` (shared parameters once, as `named_parameters` does);
    any other pytree is returned unchanged. None and a str are refused: mistakes, not models (found
    in review: `estimate(None, 8)` said 0 bytes; an empty container is a model of no parameters,
    as `fzero.init` takes it), and a count inside a container is named as such (`[1e9]`: the words
    blamed a "params leaf")."""
    if isinstance(model, torch.nn.Module):
        return dict(model.named_parameters())
    if model is None or isinstance(model, (str, bytes)):
        raise ConfigError(f"{_MODEL}; got {type(model).__name__} {model!r}")
    paths, leaves, _ = flatten_with_paths(model)
    counts = [p for p, leaf in zip(paths, leaves) if isinstance(leaf, Real) and not isinstance(leaf, bool)]
    if counts:
        raise ConfigError(f"{_MODEL}; got a {type(model).__name__} holding the number(s) at {counts[:4]}: pass a "
                          f"count alone (estimate(7.5e9, ...)), or one pytree of tensors")
    return model


def _buffers(model: Model, world_size: int, units: UnitSpec, groups: Sequence[ParamGroup], align: int,
             bucket_bytes: int | None = None) -> list[_Buffer]:
    if isinstance(model, Real) and not isinstance(model, bool):
        psi = _count(model)
        return [_Buffer(psi, psi / world_size, True, bucket=False)]
    layout = plan(params_of(model), world_size, units=units, groups=groups, align=align, bucket_bytes=bucket_bytes)
    return [_Buffer(Fraction(b.padded_numel), Fraction(b.shard_numel), not b.group.frozen, True, b.dtype,
                    tuple(layout.leaves[i].shape for i in b.leaves)) for b in layout.buckets]


def _ratio(r: Any) -> Fraction:
    """The offloaded fraction as an exact rational in (0, 1]: a float is read as the decimal it
    prints (0.3 -> 3/10, not the binary neighbour)."""
    what = "offload ratio must be a number in (0, 1] (the fraction of the trainable elements offloaded)"
    if isinstance(r, bool) or not isinstance(r, Real) or not math.isfinite(r):
        raise ConfigError(f"{what}, got {r!r}")
    value = Fraction(repr(float(r))) if isinstance(r, float) else Fraction(r)
    if not 0 < value <= 1:
        raise ConfigError(f"{what}, got {r!r}")
    return value


def offload_setting(
    offload: Any = None, optimizer: str | None = None, params: str | None = None, ratio: Real = 1
) -> OffloadSetting:
    """`fzero.Offload(...)` (read by its `optimizer`, `params`, `ratio`), or the three settings
    themselves, checked -> `OffloadSetting`. Errors name the setting and the way out."""
    if offload is not None:
        if not (hasattr(offload, "optimizer") and hasattr(offload, "params")):  # found in review: "cpu" and True
            # were read as no offload, silently
            raise ConfigError(f"offload must be None or a fzero.Offload(...) (e.g. fzero.Offload(optimizer='cpu')), "
                              f"got {type(offload).__name__} {offload!r:.80}; or pass offload_optimizer='cpu' / "
                              f"'nvme', offload_params and offload_ratio instead")
        if (optimizer, params, ratio) != (None, None, 1):
            raise ConfigError("pass either offload=fzero.Offload(...) or offload_optimizer / offload_params / "
                              "offload_ratio, not both")
        optimizer, params = getattr(offload, "optimizer", None), getattr(offload, "params", None)
        ratio = getattr(offload, "ratio", 1)
    if optimizer not in OFFLOAD_OPTIMIZER:
        raise ConfigError(f"offload optimizer must be one of {OFFLOAD_OPTIMIZER}, got {optimizer!r}")
    if params not in OFFLOAD_PARAMS:
        raise ConfigError(f"offload params must be one of {OFFLOAD_PARAMS}, got {params!r}")
    if params == "nvme" and optimizer != "nvme":
        raise ConfigError(f"offload params='nvme' keeps stage 3's shards in the NVMe tier's swap files: offload the "
                          f"optimizer to 'nvme' too, or use params='cpu' with optimizer='cpu' (got "
                          f"optimizer={optimizer!r})")
    if params is not None and optimizer is None:
        raise ConfigError(f"offload params={params!r} keeps stage 3's shards on the host as the master copy the "
                          f"host's optimizer updates: offload the optimizer too (optimizer='cpu')")
    r = _ratio(ratio)
    if r != 1 and (optimizer is None or params is not None):
        raise ConfigError(f"offload ratio {ratio} splits the optimizer's shard between device and host: it needs the "
                          f"optimizer offloaded and the params not (got optimizer={optimizer!r}, params={params!r})")
    return OffloadSetting(optimizer, params, r)


def check_offload_stage(off: OffloadSetting, st: Stage) -> None:
    """Optimizer offload moves the rank's shard (stages 1-3); params offload stage 3's shards."""
    if off.optimizer is not None and not st.sharded("optimizer_state"):
        raise ConfigError(f"offload optimizer={off.optimizer!r} moves this rank's shard of the optimizer state, but "
                          f"stage {st.level} replicates it; use stage 1, 2 or 3, or no offload")
    if off.params is not None and not st.sharded("params"):
        raise ConfigError(f"offload params={off.params!r} moves param shards, but stage {st.level} holds the full "
                          f"params on every rank; use stage 3, or params=None")


def _stage_estimate(
    buffers: Sequence[_Buffer], world_size: int, stage: int, costs: Sequence[_Cost], off: OffloadSetting = NO_OFFLOAD,
) -> MemoryEstimate:
    """`costs[k]`: what buffer k costs at this stage (`_Cost`)."""
    st = get_stage(stage)
    check_offload_stage(off, st)

    def category(name: str, per_param: Any, trainable_only: bool) -> Fraction:
        pick = (lambda b: b.shard) if st.sharded(name) else (lambda b: b.full)
        return sum(((per_param(c) if b.trainable else c.frozen) * pick(b) for b, c in zip(buffers, costs)
                    if b.trainable or not trainable_only), Fraction(0))

    grads = category("grads", lambda c: c.bpp.grads, trainable_only=True)
    leaf = [Fraction(c.leaf if b.trainable else 0) for b, c in zip(buffers, costs)]  # replicated: every rank's
    if off.optimizer is None:
        state = category("optimizer_state", lambda c: c.bpp.optimizer_state, trainable_only=True) + sum(leaf)
        return MemoryEstimate(stage, world_size, category("params", lambda c: c.bpp.params, trainable_only=False),
                              grads, state, category("master", lambda c: c.bpp.master, trainable_only=True))
    # Offloaded (stages 1-3: state and master are sharded): h_b of bucket b's shard is on the host;
    # the part kept on the device costs what it would without the offload (`_Cost.kept`: at stage 3
    # no compute copy beside the master; before, charged the offloaded cost, found in review)
    h = host_fractions(buffers, off)
    kept = [(1 - f) * b.shard if b.trainable else Fraction(0) for b, f in zip(buffers, h)]
    host, disk = _offloaded(buffers, h, costs, off)
    params = Fraction(0) if off.params is not None else category(  # params offloaded: every shard on the host
        "params", lambda c: c.bpp.params, trainable_only=False) + sum(
        ((c.on_device.params - c.bpp.params) * k for c, k in zip(costs, kept)), Fraction(0))
    state = sum((c.bpp.optimizer_state * k + (1 - f) * lf for c, k, f, lf in zip(costs, kept, h, leaf)), Fraction(0))
    master = sum((c.on_device.master * k for c, k in zip(costs, kept)), Fraction(0))
    return MemoryEstimate(stage, world_size, params, grads, state, master, host, disk, off)


def host_fractions(buffers: Sequence[_Buffer], off: OffloadSetting) -> list[Fraction]:
    """The part of each buffer's shard that an offload keeps on the host, as `Offload.host_buckets`
    decides: with params offloaded every bucket (1); else the trainable buckets after the longest
    prefix, in layout order, of trainable buckets whose shards hold at most `(1 - r)` of all
    trainable shard elements (1), the others 0. A bare count has no buckets: there the limit of
    many small ones, r of the shard on the host."""
    if off.params is not None:
        return [Fraction(1)] * len(buffers)
    if any(not b.bucket for b in buffers):
        return [off.ratio if b.trainable else Fraction(0) for b in buffers]
    room = (1 - off.ratio) * sum((b.shard for b in buffers if b.trainable), Fraction(0))
    h, kept, prefix = [], Fraction(0), True
    for b in buffers:
        prefix = prefix and (not b.trainable or kept + b.shard <= room)
        kept += b.shard if b.trainable and prefix else 0
        h.append(Fraction(0) if not b.trainable or prefix else Fraction(1))
    return h


def _master_bytes(c: _Cost) -> int:
    """A host shard's master bytes per element: m, else p (the params are the master)."""
    return c.bpp.master or c.bpp.params


def _offloaded(
    buffers: Sequence[_Buffer], h: Sequence[Fraction], costs: Sequence[_Cost], off: OffloadSetting,
) -> tuple[TierBytes, TierBytes]:
    """Host and NVMe bytes of an offloaded rank, with `h` from `host_fractions` and `costs` per
    buffer (`_Cost`). For each host shard the host holds the copy of its reduced gradient (all
    buckets' copies are started at once in `update`) and, with "cpu", its master (the fp32
    master where the params are narrower, else a copy of the param shard: m or p bytes) and its
    optimizer state; its replicated per-leaf fields (`leaf_bytes`) stay in host memory with
    "nvme" too. With "nvme" the master and the optimizer state's per-element fields are in swap
    files (one file per bucket and tensor: Adam's m, v and the master), and the host keeps the
    files' buffers, `nvme.buffer_bytes` with twice a bucket's files as buffers (`NvmeTier._open`;
    not counted for a bare count, whose buckets are unknown). With params offloaded, frozen
    shards live on the host in the params' dtype, and so does a copy of each trainable shard
    where the master is wider or in a file (what a unit moves to the device: p bytes) -- with
    params="nvme" that copy is a swap file too (p bytes on the disk), and the host keeps,
    besides the pool, the reads of the shards in flight: counted as two of the largest
    (`SwapFiles.start_load`: one unit read ahead while one is copied, one bucket per unit; each
    further prefetched unit or bucket adds one)."""
    host_of = [(c, f * b.shard) for b, c, f in zip(buffers, costs, h) if b.trainable]  # (cost, elements on the host)
    frozen = sum((c.frozen * f * b.shard for b, c, f in zip(buffers, costs, h) if not b.trainable), Fraction(0))
    leaf = sum((f * c.leaf for b, c, f in zip(buffers, costs, h) if b.trainable), Fraction(0))
    state = sum((c.bpp.optimizer_state * e for c, e in host_of), Fraction(0))
    master = sum((_master_bytes(c) * e for c, e in host_of), Fraction(0))
    on_nvme = off.optimizer == "nvme"
    in_file = off.params == "nvme"  # the compute-dtype copy in swap files, read per unit into buffers of its own
    # per bucket on the host: its per-element fields' files (`item` bytes an element each: Adam's m and v) and
    # its master's
    shards = [(c, f * b.shard) for b, c, f in zip(buffers, costs, h) if b.trainable and b.bucket and f]
    fields = [c.bpp.optimizer_state // c.item for c, _ in shards]
    files = [n for (c, e), k in zip(shards, fields) for n in [c.item * e] * k + [_master_bytes(c) * e]]
    copy = sum((c.bpp.params * e for c, e in host_of if off.params is not None and (c.bpp.master or on_nvme)),
               Fraction(0))
    reads = 2 * max((c.bpp.params * e for c, e in shards), default=0) if in_file else 0
    pool = nvme.buffer_bytes(files + [c.bpp.params * e for c, e in shards] * in_file,
                             buffers=2 * (max(fields, default=0) + 1))
    host = TierBytes(
        # with params offloaded and a wider master (or one in a file), the host keeps the shard in the params' dtype
        params=frozen + (Fraction(0) if in_file else copy),
        grads=sum((c.bpp.grads * e for c, e in host_of), Fraction(0)),
        optimizer_state=leaf + (Fraction(0) if on_nvme else state),
        master=Fraction(0) if on_nvme else master,
        buffers=Fraction(pool + reads) if on_nvme else Fraction(0),
    )
    if not on_nvme:
        return host, TierBytes()
    return host, TierBytes(params=copy if in_file else Fraction(0), optimizer_state=state, master=master)


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
    offload: Any = None,
    offload_optimizer: str | None = None,
    offload_params: str | None = None,
    offload_ratio: Real = 1,
    precision: Precision | None = None,
    amsgrad: bool = False,
    bucket_bytes: int | None = None,
) -> MemoryEstimate | tuple[MemoryEstimate, ...]:
    """Per-rank bytes of params, grads, optimizer state and master weights.

    Args:
      model: a parameter count Ψ (int, or a whole float such as `7.5e9`; no padding, Ψ/N exact),
        a params pytree of floating tensors, or an `nn.Module` (its `named_parameters()`). Only
        shapes and dtypes are read, so meta tensors work. For a pytree, `fzero.layout.plan(model,
        world_size, units=units, groups=groups, align=align, bucket_bytes=bucket_bytes)` gives
        the buckets and their padding; each bucket costs what its own dtype does, unless
        `param_dtype` is given (or the optimizer is "adam-mixed", the paper's bf16 params). Frozen
        groups have no grads, optimizer state or master copy. The optimizer's replicated per-leaf
        fields (`leaf_bytes`: step counts, adafactor's row and column statistics) are counted in
        the optimizer state, whole on every rank; a bare count has no leaves, so none, and no
        layout: `align`, `units`, `groups` and `bucket_bytes` other than their defaults are refused
        with it (`ConfigError`).
      world_size: N >= 1.
      stage: 0-3, or None for all four.
      param_dtype, grad_dtype, optimizer, amsgrad: see `policy_bytes_per_param` (for
        "adam-mixed": `bytes_per_param`). `param_dtype` is the dtype the params are held in
        (default: each bucket's own; fp32 for a bare count).
      offload: a `fzero.Offload(...)` (anything else but None is a `ConfigError`), or its settings
        as `offload_optimizer` (None, "cpu", "nvme"), `offload_params` (None, "cpu", "nvme"; stage
        3) and `offload_ratio` (r in (0, 1]).
      precision: a `fzero.Precision`: what `fzero.init(..., precision=precision)` keeps, stage by
        stage (`policy_bytes_per_param`): with fp32 params and `Precision(torch.bfloat16)` a bf16
        copy beside the fp32 master at stages 1-2, and at stage 3 only with the optimizer
        offloaded; "adam-mixed" is then refused (use "adam"). None (the default): what `fzero.init`
        keeps without `precision=` (`fzero.Precision()`: no master copy, the optimizer state in
        the params' dtype -- bf16 params keep bf16 moments, not an fp32 master), but for
        optimizer="adam-mixed": the ZeRO paper's accounting (`bytes_per_param`: a bf16 copy beside
        an fp32 master at every stage, per-element bytes only).
      bucket_bytes: `fzero.init`'s / `plan`'s cap on a bucket's bytes (pytrees and modules only).

    Returns:
      A `MemoryEstimate` for `stage`, or a tuple of them for stages 0, 1, 2, 3 (with an offload:
      for the stages that accept it, 1-3 or 3).
    """
    world_size = check_world_size(world_size)
    if stage is not None:
        get_stage(stage)
    off = offload_setting(offload, offload_optimizer, offload_params, offload_ratio)
    cost = _costs(optimizer, precision, param_dtype, grad_dtype, off, amsgrad)
    cost(STAGES[0], _Buffer(Fraction(0), Fraction(0), True, bucket=False))  # check the settings before planning
    if isinstance(model, Real) and not isinstance(model, bool):
        _check_bare_count(bucket_bytes=bucket_bytes, align=align, units=units, groups=groups)
    buffers = _buffers(model, world_size, units, groups, align, bucket_bytes)

    def one(level: int) -> MemoryEstimate:
        st = get_stage(level)
        return _stage_estimate(buffers, world_size, level, [cost(st, b) for b in buffers], off)

    if stage is not None:
        return one(stage)
    return tuple(one(s.level) for s in STAGES if _accepts(s, off))


def _costs(optimizer: str, precision: Precision | None, param_dtype: torch.dtype | str | None,
           grad_dtype: torch.dtype | str | None, off: OffloadSetting, amsgrad: bool) -> Any:
    """`(stage, buffer) -> _Cost`: the paper's bytes for "adam-mixed" without a policy
    (`bytes_per_param`), else what `fzero.init` keeps under `precision` (None: no policy) for a
    bucket held in `param_dtype`, or in its own dtype (`policy_bytes_per_param`, `leaf_bytes`)."""
    if precision is None and optimizer == "adam-mixed":
        bpp = bytes_per_param(optimizer, param_dtype, grad_dtype, amsgrad=amsgrad)
        return lambda st, b: _Cost(bpp, bpp.params)
    policy = FULL if precision is None else precision

    def cost(st: Stage, b: _Buffer) -> _Cost:
        held = as_dtype(param_dtype) if param_dtype is not None else b.dtype if b.dtype is not None else torch.float32
        bpp, frozen = policy_bytes_per_param(optimizer, st, policy, held, grad_dtype, off, amsgrad=amsgrad)
        leaf = leaf_bytes(optimizer, held, b.shapes, amsgrad) if b.bucket and b.trainable else 0
        kept = (policy_bytes_per_param(optimizer, st, policy, held, grad_dtype, NO_OFFLOAD, amsgrad=amsgrad)[0]
                if off.optimizer is not None and off.ratio != 1 else None)
        return _Cost(bpp, frozen, leaf, held.itemsize, kept)

    return cost


def default_bytes_per_param(optimizer: str = "adam", param_dtype: torch.dtype | str | None = None,
                            grad_dtype: torch.dtype | str | None = None, *, amsgrad: bool = False) -> BytesPerParam:
    """Bytes per parameter `estimate` counts without `precision=` (the same at every stage, no
    offload): the paper's (`bytes_per_param`) for "adam-mixed", else what `fzero.init` keeps with
    no policy for params held in `param_dtype` (default fp32)."""
    if optimizer == "adam-mixed":
        return bytes_per_param(optimizer, param_dtype, grad_dtype, amsgrad=amsgrad)
    return policy_bytes_per_param(optimizer, 0, FULL, param_dtype, grad_dtype, amsgrad=amsgrad)[0]


def _check_bare_count(**layout: Any) -> None:
    """A bare parameter count has no layout: `bucket_bytes`, `align`, `units` and `groups` other
    than their defaults are a `ConfigError` naming them (found in review: align, units and groups
    were ignored silently -- no padding, a frozen group's leaves counted as trainable -- where the
    command line refuses `--align` with `--params`)."""
    defaults = {"bucket_bytes": None, "align": 1, "units": None, "groups": ()}
    given = [f"{k}={v!r:.60}" for k, v in layout.items()
             if not (v is defaults[k] or (k == "groups" and isinstance(v, (tuple, list)) and not v)
                     or (k == "align" and not isinstance(v, bool) and v == 1))]
    if given:
        many = len(given) > 1
        raise ConfigError(f"{', '.join(given)} {'shape' if many else 'shapes'} a layout's buckets (padding, units, "
                          f"frozen groups, bucket cuts); a bare parameter count has none, so the estimate would leave "
                          f"{'them' if many else 'it'} out: pass a params pytree or an nn.Module (meta tensors will "
                          f"do), or leave {'them' if many else 'it'} out")


def _accepts(st: Stage, off: OffloadSetting) -> bool:
    try:
        check_offload_stage(off, st)
    except ConfigError:
        return False
    return True


def estimate_stages(model: Model, world_size: int, **kwargs: Any) -> tuple[MemoryEstimate, ...]:
    """`estimate(model, world_size, ...)` for stages 0, 1, 2, 3, in order (keyword arguments as
    `estimate`, without `stage`; with an offload, the stages that accept it)."""
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
