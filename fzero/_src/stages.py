"""ZeRO stages 0-3 as compositions of small pieces, not branches.

A stage says, per bucket, what the state holds and where each collective goes:

| stage | params held     | optimizer state | grads reduced                     | after the update |
|-------|-----------------|-----------------|-----------------------------------|------------------|
| 0     | flat[N * S]     | over flat       | after backward: RS then AG (full) | nothing          |
| 1     | flat[N * S]     | over shard[S]   | after backward: RS                | AG params        |
| 2     | flat[N * S]     | over shard[S]   | in backward, per unit: RS         | AG params        |
| 3     | shard[S]        | over shard[S]   | in backward, per unit: RS         | nothing          |

Every stage reduces with the same primitive (reduce-scatter of fl(1/N) * g, summed in the
mesh's rank order) over the same buffers, so the reduced gradient has the same bits in every
stage; stage 0 all-gathers it back, which copies bits. The optimizer is element-wise or uses
exact per-leaf sums, so updating a shard equals updating the full buffer. Hence stages 1-3
equal stage 0 bit for bit (proofs/stages.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from .collectives import all_gather
from .errors import FzeroError
from .mesh import Mesh
from .unit import Bucket, Enter, Leave, enter_full, enter_gather, leave_local, leave_reduce_scatter

Reduce = Callable[[Mesh, Bucket, torch.Tensor], torch.Tensor]
Finish = Callable[[Mesh, Bucket, torch.Tensor], torch.Tensor]


def reduce_none(mesh: Mesh, bucket: Bucket, grad: torch.Tensor) -> torch.Tensor:
    """The unit already reduce-scattered the gradient during backward."""
    return grad


def reduce_full(mesh: Mesh, bucket: Bucket, grad: torch.Tensor) -> torch.Tensor:
    """`flat[N * S] -> flat[N * S]` of `Σ_r fl(1/N) * g_r`: reduce-scatter, then all-gather (stage 0)."""
    return all_gather(leave_reduce_scatter(mesh, bucket, grad), mesh, tag=bucket.tag)


def finish_keep(mesh: Mesh, bucket: Bucket, params: torch.Tensor) -> torch.Tensor:
    return params


def finish_gather(mesh: Mesh, bucket: Bucket, shard: torch.Tensor) -> torch.Tensor:
    """`shard[S] -> flat[N * S]`: every rank's updated slice, back on every rank (stages 1-2)."""
    return all_gather(shard, mesh, tag=bucket.tag)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One ZeRO stage as data: the pieces the unit Function and the step compose.

    Attributes:
      level: 0-3.
      params_sharded: the state holds `shard[S]` (else `flat[N * S]`).
      optimizer_sharded: the optimizer state covers `shard[S]` (else `flat[N * S]`).
      grads_in_backward: gradients are reduce-scattered per unit during backward.
      enter / leave: the unit Function's pieces (see `unit.py`).
      reduce: what happens to a bucket's gradient after the whole backward.
      finish: what happens to a bucket's updated params.
    """

    level: int
    params_sharded: bool
    optimizer_sharded: bool
    grads_in_backward: bool
    enter: Enter
    leave: Leave
    reduce: Reduce
    finish: Finish


STAGES = (
    Stage(0, False, False, False, enter_full, leave_local, reduce_full, finish_keep),
    Stage(1, False, True, False, enter_full, leave_local, leave_reduce_scatter, finish_gather),
    Stage(2, False, True, True, enter_full, leave_reduce_scatter, reduce_none, finish_gather),
    Stage(3, True, True, True, enter_gather, leave_reduce_scatter, reduce_none, finish_keep),
)


def get_stage(stage: int | Stage) -> Stage:
    if isinstance(stage, Stage):
        return stage
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise FzeroError(f"stage must be 0, 1, 2 or 3 (ZeRO stage), got {stage!r}")
    return STAGES[stage]


