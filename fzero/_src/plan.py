"""The step's plans: what a step reads of a state's static parts, built once per `StateInfo`.

A state's layout, stage, mesh, rank, precision and offload never change between steps, so what a
step derives from them is derived once and remembered (`unit.remembered`): `step_plan` (the
units' programs, the trainable buckets, the order the units' probes report in, which buckets are
offloaded or differentiated as held), `plan_of` (per trainable bucket: how it travels, its
segments and the optimizer's context but for the step index and the used flags) and `_probes`
(each unit's `Probe`). The backward, the reduction, the agreement and the update read them; this
module imports none of those.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from .gathering import is_flat_dict
from .layout import ParamGroup, Segment
from .optim.base import UpdateContext
from .stages import Wire
from .state import StateInfo
from .unit import Probe, UnitProgram, remembered, unit_programs


class StepPlan(NamedTuple):
    """What `backward` and `_report` read of a state's `StateInfo` that never changes between
    steps, built once per `StateInfo` (`step_plan`): a step's prologue reads it, so the per-step
    setup is the step's own (its `Inflight`, handed to the units at call time, and the tensors).

    Attributes:
      programs: the units' `UnitProgram`s, in the layout's unit order.
      trainable: the trainable buckets, in layout order.
      trained_leaves: the trainable leaves with elements, in layout order: some rank's loss must
        reach one (`_check_some_leaf_used`).
      flat: whether the params pytree is a flat `{path: tensor}` dict (`gathering.is_flat_dict`).
      leaf_order: where the units' `used[L_u]`, concatenated in unit order, go in `used[L]`:
        None where that order is the layout's, else a CPU index `[Σ L_u]`.
      bucket_at: the same for `bad[B_u]` into `bad[B]`: None, or per bucket its place in the
        concatenated `bad` (None: no unit holds it, it reports 0).
      unused: per unit, the zeros a unit whose probe got no gradient reports (`[L_u]`, CPU).
      on_host: the trainable buckets whose update runs on a host tier (`HostUpdate`).
      held: per bucket, whether the step differentiates the held tensor itself, with no full
        buffer beside it (`offload.differentiated` is then `(held, None)`: no offload of the
        bucket, and a stage that does not differentiate a shard of the full buffer).
      beside: per bucket, whether, where a master is kept, the step differentiates it with the
        held buffer beside it (`offload.differentiated` is then `(master, held)`: no offload of
        the bucket, and a stage that says so -- stage 2 -- asked once with stand-ins).
    """

    programs: tuple[UnitProgram, ...]
    trainable: tuple[int, ...]
    trained_leaves: tuple[int, ...]
    flat: bool
    leaf_order: torch.Tensor | None
    bucket_at: tuple[int | None, ...] | None
    unused: dict[str, torch.Tensor]
    on_host: frozenset[int]
    held: tuple[bool, ...]
    beside: tuple[bool, ...]

    @property
    def offloaded(self) -> bool:
        """Whether some trainable bucket's update runs on a host tier."""
        return bool(self.on_host)


_STEP_PLANS: dict = {}


def step_plan(info: StateInfo) -> StepPlan:
    """`StepPlan` of `info`, built once per `StateInfo` (`unit.remembered`)."""
    return remembered(_STEP_PLANS, info, None, lambda: _step_plan(info))


def _step_plan(info: StateInfo) -> StepPlan:
    layout = info.layout
    programs = tuple(unit_programs(layout, info.mesh, info.stage, info.precision))
    leaves = [i for p in programs for i in p.leaves]
    buckets = [b.index for p in programs for b in p.buckets]
    trainable = tuple(b.index for b in layout.buckets if not b.group.frozen)

    def on_device(b: int) -> bool:  # neither the params nor the bucket's master and state offloaded
        return info.offload.params is None and info.host_tier(b) is None

    trained_leaves = tuple(ls.index for ls in layout.leaves if not ls.group.frozen and ls.numel > 0)
    return StepPlan(programs, trainable, trained_leaves, is_flat_dict(layout),
                    None if leaves == list(range(len(layout.leaves))) else torch.tensor(leaves, dtype=torch.long),
                    None if buckets == list(range(len(layout.buckets))) else
                    tuple({b: k for k, b in enumerate(buckets)}.get(b) for b in range(len(layout.buckets))),
                    {p.name: torch.zeros(len(p.leaves)) for p in programs},
                    frozenset(b for b in trainable if info.host_tier(b) is not None),
                    tuple(on_device(b.index) and not (info.stage.sharded("grads") and not info.stage.sharded("params"))
                          for b in layout.buckets),
                    tuple(on_device(b.index) and _beside(info, b.index) for b in layout.buckets))


def _beside(info: StateInfo, b: int) -> bool:
    """Whether the stage differentiates bucket b's master with its held buffer beside it: its
    `differentiated` asked with stand-ins (no tensor is read where a master is given)."""
    held, master = object(), object()
    x, full = info.stage.differentiated(info.layout, b, held, info.rank, master)
    return x is master and full is held


_PROBES: dict = {}


def _probes(info: StateInfo, programs: list, devices: tuple[torch.device, ...], grad: bool, locate: bool
            ) -> dict[str, Probe]:
    """Each unit's `Probe` (zeros on the device of its first bucket's differentiated tensor; leaves
    that require grad for the autograd engine, `grad`; `locate`: the units check each local
    gradient), built once per `StateInfo`, devices, engine and `locate`: no step writes them, and
    `torch.autograd.grad` returns their gradients without accumulating any."""
    def build() -> dict[str, Probe]:
        probes = {p.name: Probe.of(p, d, locate) for p, d in zip(programs, devices)}
        return {u: Probe(*(t.requires_grad_() for t in p)) for u, p in probes.items()} if grad else probes

    return remembered(_PROBES, info, (devices, grad, locate), build)


class BucketPlan(NamedTuple):
    """What a step needs of one trainable bucket that never changes for a state's `StateInfo`
    (layout, stage, mesh, rank, precision): how it travels, and the optimizer's context but for
    the step index and the used flags (`context`)."""

    index: int
    wire: Wire
    group: ParamGroup
    segments: tuple[Segment, ...]  # `Stage.segments`: the leaf pieces of what the optimizer updates
    leaves: tuple[int, ...]
    leaf_sum: Callable[[torch.Tensor], torch.Tensor]
    numels: tuple[int, ...]
    shapes: tuple[tuple[int, ...], ...]
    within: torch.dtype | None  # `precision.narrower_range`: the compute dtype the finite check reads in

    def context(self, step: int, used: list[bool] | None, leaf_sum: Callable | None = None) -> UpdateContext:
        """`used`: the step's used flags over all leaves (None: every leaf used); `leaf_sum`: where
        the optimizer's per-leaf sums run elsewhere (an offloaded bucket's, on the host)."""
        mine = (True,) * len(self.leaves) if used is None else tuple(map(used.__getitem__, self.leaves))
        return UpdateContext(step, self.group, self.segments, self.leaves, mine, leaf_sum or self.leaf_sum,
                             self.numels, self.shapes)


_PLANS: dict = {}


def plan_of(info: StateInfo) -> dict[int, BucketPlan]:
    """`{bucket: BucketPlan}` over the trainable buckets, built once per `StateInfo` (every state a
    step returns shares its input's; `unit.remembered`)."""
    layout, stage, mesh, rank = info.layout, info.stage, info.mesh, info.rank
    return remembered(_PLANS, info, None, lambda: {
        spec.index: BucketPlan(spec.index, info.precision.wire(spec), spec.group,
                               stage.segments(layout, spec.index, rank), spec.leaves,
                               stage.leaf_sum(mesh, spec.tag), tuple(layout.leaves[i].numel for i in spec.leaves),
                               tuple(layout.leaves[i].shape for i in spec.leaves),
                               info.precision.within(spec))
        for spec in layout.buckets if not spec.group.frozen})
