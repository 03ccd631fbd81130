"""The per-unit Function: how a unit's parameters enter the loss and its gradient leaves it.

Every stage runs the loss through one `_Unit` Function per unit. It is built from two pieces,
which a `Stage` chooses (see `stages.py`), so stages are compositions rather than branches:

    enter(bucket, x)  -> flat[N * S]      the full flat buffer the loss reads
                         stages 0-2: x is already full (identity)
                         stage 3:    x is shard[S]; all-gather it
    leave(bucket, g)  -> grad of x        g is this rank's full local gradient flat[N * S]
                         stages 0-1: keep g (reduced after backward)
                         stages 2-3: reduce-scatter fl(1/N) * g now -> shard[S]

The Function returns one tensor per leaf (views of the entered flat buffer). Its backward runs
once per step, after autograd has added up every use of every leaf of the unit, so a tied leaf
is reduced once, after its last use, as in DDP. Outputs that no loss term used arrive as `None`
(`set_materialize_grads(False)`): the unit records which leaves got a gradient and which local
gradients were non-finite in the step's `StepLog`, for the one agreement collective after
backward. Works under `torch.func.grad` / `grad_and_value` and plain `torch.autograd.grad`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .collectives import reduce_scatter
from .layout import Layout
from .mesh import Mesh

Enter = Callable[[Mesh, "Bucket", torch.Tensor], torch.Tensor]
Leave = Callable[[Mesh, "Bucket", torch.Tensor], torch.Tensor]


@dataclasses.dataclass(frozen=True)
class Bucket:
    """What the unit Function needs of one bucket: its index, tag, leaf offsets and shapes."""

    index: int
    tag: str
    frozen: bool
    leaves: tuple[int, ...]
    offsets: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    size: int  # N * S, the padded flat buffer

    @staticmethod
    def of(layout: Layout, b: int) -> "Bucket":
        spec = layout.buckets[b]
        leaves = [layout.leaves[i] for i in spec.leaves]
        return Bucket(b, spec.tag, spec.group.frozen, spec.leaves, tuple(ls.offset for ls in leaves),
                      tuple(ls.shape for ls in leaves), spec.padded_numel)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """`flat[N * S] -> [leaf views]`."""
        return [flat[o : o + _numel(s)].view(s) for o, s in zip(self.offsets, self.shapes)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class StepLog:
    """Side channel from the units' backward to the step: which leaves got a gradient, and
    whether each bucket's local gradient held a NaN or inf (a 0-d bool tensor per bucket, left on
    the device: no host sync during backward). Deliberately not a pytree node, so `torch.func`
    passes it through untouched."""

    def __init__(self, num_leaves: int) -> None:
        self.used = [False] * num_leaves
        self.nonfinite: dict[int, torch.Tensor] = {}  # bucket index -> 0-d bool
        self.after_backward: dict[str, Callable[[], None]] = {}  # unit -> run when its backward is done


# -- the pieces a stage composes ----------------------------------------------------------------


def enter_full(mesh: Mesh, bucket: Bucket, flat: torch.Tensor) -> torch.Tensor:
    """Stages 0-2: the state already holds the full buffer."""
    return flat


def enter_gather(mesh: Mesh, bucket: Bucket, shard: torch.Tensor) -> torch.Tensor:
    """Stage 3: `shard[S] -> flat[N * S]` by all-gather."""
    return mesh.collective("all_gather", shard, tag=bucket.tag)


def leave_local(mesh: Mesh, bucket: Bucket, grad: torch.Tensor) -> torch.Tensor:
    """Stages 0-1: the full local gradient; it is reduced after the whole backward."""
    return grad


def leave_reduce_scatter(mesh: Mesh, bucket: Bucket, grad: torch.Tensor) -> torch.Tensor:
    """Stages 2-3: `flat[N * S] -> shard[S]` of `Σ_r fl(1/N) * g_r`, during backward."""
    return reduce_scatter(grad * (1.0 / mesh.world_size), mesh, tag=bucket.tag)


# -- the Function -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class UnitProgram:
    """The static description of one unit under one stage (not a pytree node)."""

    name: str
    mesh: Mesh
    buckets: tuple[Bucket, ...]
    enter: Enter
    leave: Leave
    log: StepLog


def run_unit(program: UnitProgram, xs: Sequence[torch.Tensor],
             extras: Sequence[torch.Tensor | None]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """`([leaf tensors] in bucket order, anchor)` for one unit, from what the state holds.

    `xs[k]` is bucket k's differentiated input (flat or shard, per the stage); `extras[k]` is
    the full flat buffer when the stage keeps one beside a differentiated shard (stage 2), else
    None. The anchor is a 0-d zero the step adds to the loss times 0: it makes the unit's
    backward run on every rank, also where no leaf of the unit reached this rank's loss, so
    every rank calls the unit's reduce-scatter, in the same order (the engine runs the unit
    nodes, all made in the same order on every rank, after every node made later).
    """
    *leaves, anchor = _Unit.apply(program, len(xs), *xs, *extras)
    return leaves, anchor


class _Unit(torch.autograd.Function):
    @staticmethod
    def forward(program: UnitProgram, k: int, *tensors: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        xs, extras = tensors[:k], tensors[k:]
        held = [x if extra is None else extra for x, extra in zip(xs, extras)]
        return (*gather_leaves(program, held), xs[0].new_zeros((), dtype=torch.float32))  # + the anchor

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.program, ctx.k = inputs[0], inputs[1]
        ctx.like = [(x.shape, x.dtype, x.device) for x in inputs[2 : 2 + ctx.k]]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple:
        program, log = ctx.program, ctx.program.log
        grads = grads[:-1]  # the anchor's gradient (a zero) only made this backward run
        result: list[torch.Tensor | None] = []
        at = 0
        for bucket, (shape, dtype, device) in zip(program.buckets, ctx.like):
            gs = grads[at : at + len(bucket.leaves)]
            at += len(bucket.leaves)
            if bucket.frozen:
                result.append(None)
                continue
            flat = _assemble(bucket, gs, program.mesh, dtype, device)
            for leaf, g in zip(bucket.leaves, gs):
                log.used[leaf] = log.used[leaf] or g is not None
            log.nonfinite[bucket.index] = _nonfinite(flat)
            result.append(program.leave(program.mesh, bucket, flat))
        done = log.after_backward.get(program.name)
        if done is not None:
            done()
        return (None, None, *result, *([None] * ctx.k))


def _assemble(bucket: Bucket, grads: Sequence[torch.Tensor | None], mesh: Mesh,
              dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Per-leaf gradients (None: unused) -> this rank's full local gradient `flat[N * S]`."""
    parts, end = [], 0
    for o, s, g in zip(bucket.offsets, bucket.shapes, grads):
        n = _numel(s)
        parts.append(g.reshape(-1) if g is not None else torch.zeros(n, dtype=dtype, device=device))
        end = o + n
    parts.append(torch.zeros(bucket.size - end, dtype=dtype, device=device))
    return torch.cat(parts)


def _nonfinite(flat: torch.Tensor) -> torch.Tensor:
    """0-d bool: does `flat` hold a NaN or inf? For 16/32-bit floats, one float64 sum with no
    temporary: a sum of finite float32 values cannot overflow float64, and NaN or inf survive it."""
    if flat.dtype == torch.float64:
        return ~torch.isfinite(flat).all()
    return ~torch.isfinite(flat.sum(dtype=torch.float64))


def unit_programs(layout: Layout, mesh: Mesh, enter: Enter, leave: Leave, log: StepLog) -> list[UnitProgram]:
    return [
        UnitProgram(unit, mesh, tuple(Bucket.of(layout, b) for b in layout.unit_buckets(unit)), enter, leave, log)
        for unit in layout.units
    ]


def gather_leaves(program: UnitProgram, xs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The unit's leaves from the tensors each bucket enters from (the Function's forward, and
    `fzero.gather` outside autograd)."""
    out: list[torch.Tensor] = []
    for bucket, x in zip(program.buckets, xs):
        out.extend(bucket.views(program.enter(program.mesh, bucket, x)))
    return out

