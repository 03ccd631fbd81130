"""The optimizer interface: pure `(init, update, spec)` triples over one bucket's `shard[S]`.

A bucket is the flat buffer of the leaves of one (unit, dtype, ParamGroup), back to back,
padded and cut into N shards (see `fzero._src.layout`). An optimizer sees one rank's shard of
the parameters and of the (already reduced) gradient, and the `Segment`s that say which leaf
elements sit where. Element-wise optimizers apply torch's single-tensor ops to runs of
segments; a layer-wise optimizer reduces per-leaf partial sums through `ctx.leaf_sum`.

State is a NamedTuple of tensors. `spec(state)` is the same NamedTuple of strings:

  "shard"  the field is shaped like the shard, `[S]`, and is sharded like the parameters;
  "leaf"   the field is `[len(ctx.leaves)]`, one entry per bucket leaf, replicated on every rank.

so checkpointing and resharding read the spec, never the optimizer's class.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Union

import torch

from ..errors import FzeroError
from ..layout import ParamGroup, Segment


class OptimizerError(FzeroError, ValueError):
    """A hyper-parameter, a schedule or a shard does not fit the optimizer."""


class UpdateContext(NamedTuple):
    """What `update` needs to know beyond tensors; built by the stage code per bucket and rank.

    Attributes:
      step: the global optimizer-step index, 0 for the first update; schedules read it.
      group: the bucket's `ParamGroup` (`weight_decay` mask, `lr_scale`, `frozen`).
      segments: `layout.segments(bucket, rank)`, this shard's pieces of leaves in shard
        coordinates. Padding lies outside every segment and is never touched.
      leaves: `BucketSpec.leaves`; "leaf" state fields are indexed by position in this tuple.
      used: per bucket leaf, True if the leaf got a gradient this step. An unused leaf is
        skipped exactly as torch.optim skips `p.grad is None`: no update, no weight decay, no
        state change, its step count not incremented.
      leaf_sum: sums a float64 tensor `[..., len(leaves)]` of per-leaf partial values over all
        ranks, element-wise, in a fixed rank order, without changing its dtype; identity when
        N == 1. Only layer-wise optimizers call it (once per update).
    """

    step: int
    group: ParamGroup
    segments: tuple[Segment, ...]
    leaves: tuple[int, ...]
    used: tuple[bool, ...]
    leaf_sum: Callable[[torch.Tensor], torch.Tensor] = lambda x: x


class Optimizer(NamedTuple):
    """A pure optimizer over flat shards (optax's `GradientTransformation`, praxis's spec).

    Attributes:
      init: `(param shard[S], number of bucket leaves L) -> state`.
      update: `(grad shard[S], state, param shard[S], ctx) -> (new param shard[S], new state)`;
        never mutates its inputs. On a frozen group it returns its inputs unchanged (callers
        normally neither init nor update frozen buckets: they have no state).
      spec: `state -> same NamedTuple of "shard" / "leaf"`.
    """

    init: Callable[[torch.Tensor, int], Any]
    update: Callable[[torch.Tensor, Any, torch.Tensor, UpdateContext], tuple[torch.Tensor, Any]]
    spec: Callable[[Any], Any]


class EmptyState(NamedTuple):
    """The state of a stateless optimizer (SGD without momentum)."""


Schedule = Callable[[int], float]
LearningRate = Union[float, Schedule, Sequence[float]]


def check_hyper(name: str, value: Any, lo: float = 0.0, hi: float = math.inf, hi_open: bool = False) -> float:
    """`value` as a Python float, or an `OptimizerError` naming it and the valid range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise OptimizerError(f"{name} must be a Python float, got {type(value).__name__} {value!r}")
    value = float(value)
    ok = lo <= value and (value < hi if hi_open else value <= hi)
    if not ok or math.isnan(value):
        bracket = ")" if hi_open else "]"
        raise OptimizerError(f"{name} must be in [{lo}, {hi}{bracket}, got {value}")
    return value


def as_schedule(lr: LearningRate) -> Schedule:
    """A float, a callable `step -> float` or a sequence of per-step floats, as `step -> float`.

    The value is checked (finite, >= 0) each time it is read, so a schedule that goes negative
    fails at the step where it does, naming the step.
    """
    if isinstance(lr, (int, float)) and not isinstance(lr, bool):
        value = check_hyper("lr", lr)
        return lambda step: value
    if callable(lr):
        fn = lr
    elif isinstance(lr, Sequence) and not isinstance(lr, (str, bytes)):
        values = tuple(lr)
        for i, v in enumerate(values):
            check_hyper(f"lr[{i}]", v)

        def fn(step: int) -> float:
            if not 0 <= step < len(values):
                raise OptimizerError(
                    f"the lr sequence has {len(values)} values but step {step} was asked for; "
                    f"give one value per optimizer step, or a callable schedule"
                )
            return float(values[step])
    else:
        raise OptimizerError(f"lr must be a float, a callable step -> float or a sequence of floats, got {lr!r}")

    def checked(step: int) -> float:
        value = fn(step)
        if isinstance(value, torch.Tensor):
            raise OptimizerError(f"the lr schedule returned a tensor at step {step}; return a Python float")
        return check_hyper(f"lr at step {step}", value)

    return checked


def group_lr(schedule: Schedule, ctx: UpdateContext) -> float:
    """`fl(lr(step) * group.lr_scale)`: a Python float, as torch's `group["lr"]`."""
    return schedule(ctx.step) * ctx.group.lr_scale


def check_shards(name: str, grad: torch.Tensor, param: torch.Tensor, state: Any, spec: Any, ctx: UpdateContext) -> None:
    """Shapes and dtypes of one update's inputs, with messages that name them."""
    if grad.dim() != 1 or param.dim() != 1 or grad.shape != param.shape:
        raise OptimizerError(
            f"{name}: grad shard {list(grad.shape)} and param shard {list(param.shape)} must be the same "
            f"1-d shard[S] of one bucket (pass layout.local_shards(...) entries, not leaves)"
        )
    if grad.dtype != param.dtype:
        raise OptimizerError(f"{name}: grad shard is {grad.dtype} but param shard is {param.dtype}")
    if len(ctx.used) != len(ctx.leaves):
        raise OptimizerError(f"{name}: ctx.used has {len(ctx.used)} entries for {len(ctx.leaves)} bucket leaves")
    if ctx.segments and ctx.segments[-1].stop > param.numel():
        raise OptimizerError(
            f"{name}: ctx.segments reach element {ctx.segments[-1].stop} of a shard of {param.numel()}; "
            f"were they made for another bucket or world size?"
        )
    for field, t, kind in zip(state._fields, state, spec):
        want = (len(ctx.leaves),) if kind == "leaf" else tuple(param.shape)
        if tuple(t.shape) != want:
            raise OptimizerError(
                f"{name}: state field {field!r} ({kind}) has shape {list(t.shape)}, expected {list(want)} for a "
                f"shard of {param.numel()} elements and {len(ctx.leaves)} bucket leaves; was it made by init "
                f"for this bucket?"
            )


def runs(ctx: UpdateContext, key: Sequence[Any]) -> list[tuple[int, int, Any]]:
    """Maximal runs `(start, stop, key)` of consecutive segments with equal `key[leaf position]`.

    Segments of consecutive leaves are adjacent in the shard, so in the common case (every
    leaf used, all step counts equal) this is one run over all non-padding elements.
    """
    pos = {leaf: k for k, leaf in enumerate(ctx.leaves)}
    out: list[tuple[int, int, Any]] = []
    for seg in ctx.segments:
        k = key[pos[seg.leaf]]
        if out and out[-1][2] == k and out[-1][1] == seg.start:
            out[-1] = (out[-1][0], seg.stop, k)
        else:
            out.append((seg.start, seg.stop, k))
    return out


def bumped(counts: list[float], used: Sequence[bool]) -> list[float]:
    """Per-leaf step counts after one update: +1 where used (exact in float32 up to 2**24)."""
    return [c + 1.0 if u else c for c, u in zip(counts, used)]
