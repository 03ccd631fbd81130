"""A rank's ZeRO state as plain data: `init` builds it, `gather` reads the full params back."""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from .collectives import all_gather, broadcast
from .errors import LayoutError
from .layout import Layout, ParamGroup, UnitSpec, pack, plan
from .mesh import Mesh
from .optim.base import Optimizer
from .stages import Stage, get_stage
from .tree import flatten_with_paths, unflatten
from .unit import StepLog, gather_leaves, unit_programs


class ZeroState(NamedTuple):
    """One rank's state. Tensors per bucket, in `layout.buckets` order.

    Attributes:
      params: `flat[N * S]` per bucket (stages 0-2) or this rank's `shard[S]` (stage 3).
      opt_state: the optimizer's state per bucket, over `flat[N * S]` (stage 0) or `shard[S]`
        (stages 1-3); None for frozen buckets.
      step: the number of updates applied so far.
      layout, stage, mesh, rank: static metadata, never differentiated.
    """

    params: tuple[torch.Tensor, ...]
    opt_state: tuple[Any, ...]
    step: int
    layout: Layout
    stage: Stage
    mesh: Mesh
    rank: int


def shard_of(layout: Layout, b: int, flat: torch.Tensor, rank: int) -> torch.Tensor:
    """Rank `rank`'s `shard[S]` of bucket `b`'s `flat[N * S]` (a view)."""
    s = layout.buckets[b].shard_numel
    return flat[rank * s : (rank + 1) * s]


def init(
    params: Any,
    optimizer: Optimizer,
    *,
    stage: int,
    mesh: Mesh,
    units: UnitSpec = None,
    groups: Sequence[ParamGroup] = (),
    align: int = 1,
    sync: bool = True,
) -> ZeroState:
    """This rank's `ZeroState` for `params` (call on every rank; on SimMesh inside `mesh.run`).

    Ranks first agree that their params have the same structure, shapes and dtypes (one small
    all-gather; a mismatch raises on every rank, naming the leaf, the ranks and the sizes). With
    `sync`, rank 0's values are broadcast, as DDP does at construction.
    """
    with mesh.guard():  # a rank that raises here tells the others (DistMesh) instead of leaving them waiting
        st = get_stage(stage)
        layout = plan(params, mesh.world_size, units=units, groups=groups, align=align)
        _check_distinct(params)
        check_same_layout(layout, mesh)
        flats = tuple(f.detach().clone() for f in pack(layout, params))
        if sync and mesh.world_size > 1:
            flats = tuple(broadcast(f, mesh, 0, tag=b.tag) for f, b in zip(flats, layout.buckets))
        rank = mesh.rank
        held = tuple(shard_of(layout, b, f, rank).clone() if st.params_sharded else f for b, f in enumerate(flats))
        opt_state = tuple(
            None if spec.group.frozen else optimizer.init(
                shard_of(layout, b, flats[b], rank) if st.optimizer_sharded else flats[b], len(spec.leaves))
            for b, spec in enumerate(layout.buckets)
        )
    return ZeroState(held, opt_state, 0, layout, st, mesh, rank)


def _check_distinct(params: Any) -> None:
    """One tensor at two paths would be two leaves updated apart (silently untied)."""
    paths, leaves, _ = flatten_with_paths(params)
    first: dict[int, str] = {}
    for path, leaf in zip(paths, leaves):
        other = first.setdefault(id(leaf), path)
        if other != path:
            raise LayoutError(f"params leaves {other!r} and {path!r} are the same tensor; keep one leaf and use it "
                              f"twice in the loss (fzero.from_module does this for tied module weights)")


def gather(state: ZeroState) -> Any:
    """The full params pytree (original structure and dtypes), on every rank; fresh tensors.

    Stage 3 all-gathers each bucket, so every rank must call it.
    """
    layout, mesh = state.layout, state.mesh
    leaves: list[Any] = [None] * len(layout.leaves)
    with torch.no_grad():
        for program in unit_programs(layout, mesh, state.stage.enter, state.stage.leave, StepLog(0)):
            xs = [state.params[b.index] for b in program.buckets]
            ids = [i for b in program.buckets for i in b.leaves]
            for i, t in zip(ids, gather_leaves(program, xs)):
                leaves[i] = t.clone()
    return unflatten(layout.treespec, leaves)


def _crc(x: Any) -> int:
    return zlib.crc32(repr(x).encode()) & 0x7FFFFFFF


def check_same_layout(layout: Layout, mesh: Mesh) -> None:
    """Raise on every rank unless all ranks planned the same leaves (paths, shapes, dtypes)."""
    n = mesh.world_size
    if n == 1:
        return
    me = torch.tensor([len(layout.leaves), _crc(str(layout.treespec))], dtype=torch.int64, device=mesh.device)
    rows = all_gather(me, mesh, tag="fzero.init/structure").view(n, 2).tolist()
    if any(row[0] != rows[0][0] for row in rows):
        counts = ", ".join(f"rank {r}: {row[0]} leaves" for r, row in enumerate(rows))
        raise LayoutError(f"params differ across ranks (world size {n}): {counts}; every rank must pass the "
                          f"same pytree structure")
    sig = torch.tensor([[_crc((ls.path, ls.dtype, ls.shape)), ls.numel] for ls in layout.leaves] or [[0, 0]],
                       dtype=torch.int64, device=mesh.device).view(-1)
    table = all_gather(sig, mesh, tag="fzero.init/leaves").view(n, -1, 2)
    differ = (table != table[:1]).any(dim=2).any(dim=0).nonzero().flatten().tolist()
    if differ or any(row[1] != rows[0][1] for row in rows):
        i = differ[0] if differ else 0
        ls = layout.leaves[i] if layout.leaves else None
        sizes = ", ".join(f"rank {r}: {table[r, i, 1].item()} elements" for r in range(n))
        sizes += " (same count, other shape or dtype)" if len({table[r, i, 1].item() for r in range(n)}) == 1 else ""
        where = f"leaf {ls.path!r} ({ls.dtype}{list(ls.shape)} on rank {mesh.rank})" if ls else "the structure"
        raise LayoutError(f"params differ across ranks (world size {n}) at {where}: {sizes}; every rank must "
                          f"pass the same paths, shapes and dtypes")
