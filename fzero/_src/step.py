"""`train_step`: a loss, an optimizer and a stage -> a pure `step(state, batch) -> (state, metrics)`.

One step on one rank:

1. forward: each unit's leaves come out of the per-unit Function (gathered in stage 3), the
   params pytree is rebuilt, and `loss_fn(params, batch)` gives this rank's mean loss;
2. backward (`torch.autograd.grad`, or `torch.func.grad_and_value` with `engine="func"`): each
   unit's Function records which leaves got a gradient and reduces per unit in stages 2-3;
3. stages 0-1 reduce each bucket after backward; the reduced gradient is `Σ_r fl(1/N) g_r`;
4. one all-gather of a small float64 vector agrees on what every rank saw: its loss, which
   leaves it used, which local gradients were non-finite, and its part of `‖g‖²`;
5. a non-finite step raises on every rank or is skipped (`on_nonfinite`), leaving the state as
   it was; otherwise the optimizer updates what the rank owns, and stages 1-2 all-gather the
   new params.

The input state is never modified. The new state's updated tensors are fresh; what a step does
not touch (frozen buckets' params) is shared with the input state, as in JAX: treat states as
immutable.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import optree
import torch

from .collectives import all_gather, all_reduce
from .errors import FzeroError, NonFiniteError
from .layout import Layout
from .lazy import FirstUse, LazyParams
from .mesh import Mesh
from .optim.base import Optimizer, UpdateContext
from .stages import Stage, get_stage
from .state import ZeroState, shard_of
from .tree import NAMESPACE, unflatten
from .unit import Bucket, StepLog, run_unit, unit_programs

ENGINES = ("autograd", "func")
NONFINITE = ("raise", "skip")
GATHERS = ("eager", "on_use")


class Metrics(NamedTuple):
    """What a step reports, the same on every rank.

    Attributes:
      loss: float64 0-d, the mean over ranks of each rank's loss (summed in rank order, / N).
      grad_norm: float64 0-d, `‖Σ_r fl(1/N) g_r‖₂` over all trainable leaves (squares summed per
        shard in float64, then over ranks in rank order; the same bits in every stage).
      step: the index of this update (0 for the first).
      skipped: True if the step was non-finite and `on_nonfinite="skip"` left the state as it was.
    """

    loss: torch.Tensor
    grad_norm: torch.Tensor
    step: int
    skipped: bool


def train_step(
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: Optimizer,
    *,
    stage: int,
    mesh: Mesh,
    engine: str = "autograd",
    on_nonfinite: str = "raise",
    gather: str = "eager",
) -> Callable[[ZeroState, Any], tuple[ZeroState, Metrics]]:
    """Build `step(state, batch) -> (state, metrics)` for one rank (see the module docstring).

    Args:
      loss_fn: `(params, batch) -> 0-d loss`, this rank's mean loss on its micro-batch.
      optimizer: a `fzero.optim` optimizer.
      stage: ZeRO stage 0-3; must be the stage the state was made with.
      mesh: the mesh the state lives on.
      engine: "autograd" (`torch.autograd.grad` over the unit Functions; lower peak memory, see
        DESIGN.md) or "func" (`torch.func.grad_and_value`; composes with other transforms).
      on_nonfinite: "raise" (NonFiniteError on every rank, naming ranks and leaves) or "skip".
      gather: "eager" runs every unit's Function (stage 3: gathers every unit) before calling
        `loss_fn` with the params pytree; the autograd engine then runs every unit's backward
        (and so stage 2's reductions) after the rest of the backward. "on_use" creates each
        unit's Function when the loss first uses the unit, so its backward runs right after the
        unit's: flat-dict params (as `from_module` makes) come as a `LazyParams` mapping read by
        path (`from_module`'s `apply` reads a unit when its submodule runs, and stage 3 with the
        autograd engine frees it after and re-gathers it in backward); other pytrees come with
        placeholder leaves that the first torch function using them swaps for the real ones.
        The numbers are the same bits either way.
    """
    st = get_stage(stage)
    if engine not in ENGINES:
        raise FzeroError(f"engine must be one of {ENGINES}, got {engine!r}")
    if on_nonfinite not in NONFINITE:
        raise FzeroError(f"on_nonfinite must be one of {NONFINITE}, got {on_nonfinite!r}")
    if gather not in GATHERS:
        raise FzeroError(f"gather must be one of {GATHERS}, got {gather!r}")

    def step(state: ZeroState, batch: Any) -> tuple[ZeroState, Metrics]:
        _check_state(state, st, mesh)
        with mesh.guard():
            return _step(loss_fn, optimizer, st, mesh, engine, on_nonfinite, gather, state, batch)

    return step


def _check_state(state: ZeroState, st: Stage, mesh: Mesh) -> None:
    if not isinstance(state, ZeroState):
        raise FzeroError(f"step expects the ZeroState made by fzero.init, got {type(state).__name__}")
    if state.stage.level != st.level:
        raise FzeroError(f"the state was made for stage {state.stage.level} but this step runs stage {st.level}; "
                         f"pass the same stage to fzero.init and fzero.train_step")
    state.layout.check_world_size(mesh.world_size)
    if state.mesh is not mesh:
        raise FzeroError(f"the state lives on {state.mesh!r} but this step runs on {mesh!r}")


def _is_flat_dict(layout: Layout) -> bool:
    flat = optree.tree_structure(dict.fromkeys((ls.path for ls in layout.leaves), 0), namespace=NAMESPACE)
    return layout.treespec == flat


def _inputs(state: ZeroState, st: Stage) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Per bucket: the differentiated tensor, and the full buffer beside it where the stage keeps one."""
    if st.grads_in_backward and not st.params_sharded:  # stage 2: grads of the shard, reads the full flat
        xs = [shard_of(state.layout, b, f, state.rank) for b, f in enumerate(state.params)]
        return xs, list(state.params)
    return list(state.params), [None] * len(state.params)


def _local_loss(loss_fn: Callable, st: Stage, mesh: Mesh, layout: Layout, log: StepLog,
                extras: list[torch.Tensor | None], batch: Any, gather: str, engine: str) -> Callable:
    programs = {p.name: p for p in unit_programs(layout, mesh, st.enter, st.leave, log)}

    def loss_of(xs: list[torch.Tensor]) -> torch.Tensor:
        storages: dict[str, list[tuple[int, Any, int]]] = {}  # unit -> (bucket, gathered storage, bytes)
        lazy_dict = gather == "on_use" and _is_flat_dict(layout)  # else placeholders, swapped at first use
        can_release = lazy_dict and st.params_sharded and engine == "autograd"
        anchors: list[torch.Tensor] = []
        owner: dict[int, str] = {}  # gathered storage -> its unit, for re-gathering on unpack

        def materialize(unit: str) -> dict[str, torch.Tensor]:
            program = programs[unit]
            ids = [b.index for b in program.buckets]
            outs, anchor = run_unit(program, [xs[b] for b in ids], [extras[b] for b in ids])
            anchors.append(anchor)
            leaves = dict(zip((i for b in program.buckets for i in b.leaves), outs))
            if can_release:
                storages[unit] = [(b.index, leaves[i].untyped_storage(), leaves[i].untyped_storage().nbytes())
                                  for b in program.buckets for i in b.leaves[:1] if leaves[i].numel()]
                owner.update({st._cdata: unit for _, st, _ in storages[unit]})
            return {layout.leaves[i].path: t for i, t in leaves.items()}

        def release(unit: str) -> None:
            for _, storage, _ in storages[unit]:
                storage.resize_(0)

        def refill(unit: str) -> None:
            with torch.no_grad():
                for b, storage, nbytes in storages[unit]:
                    full = mesh.collective("all_gather", xs[b].detach(), tag=layout.buckets[b].tag)
                    storage.resize_(nbytes)
                    full.new_empty(0).set_(storage, 0, full.shape).copy_(full)  # own version counter

        first_use = None
        if gather == "on_use" and not lazy_dict:
            lazy = LazyParams({ls.path: ls.unit for ls in layout.leaves}, materialize)
            holders = [torch.zeros((), dtype=ls.dtype, device=xs[ls.bucket].device).expand(ls.shape)
                       for ls in layout.leaves]
            first_use = FirstUse({id(t): ls.path for t, ls in zip(holders, layout.leaves)}, lazy.__getitem__)
            params: Any = unflatten(layout.treespec, holders)
        elif lazy_dict:
            params = LazyParams({ls.path: ls.unit for ls in layout.leaves}, materialize,
                                release if can_release else None, refill if can_release else None)
            if can_release:
                log.after_backward = {unit: (lambda u=unit: params.release(u)) for unit in programs}
        else:
            by_path = {path: t for unit in programs for path, t in materialize(unit).items()}
            params = unflatten(layout.treespec, [by_path[ls.path] for ls in layout.leaves])
        if can_release:
            def unpack(t: torch.Tensor) -> torch.Tensor:  # backward needs a saved tensor: re-gather
                unit = owner.get(t.untyped_storage()._cdata)  # its unit first if it was released
                if unit is not None:
                    params.refill(unit)
                return t

            with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
                loss = loss_fn(params, batch)
        elif first_use is not None:
            with first_use:
                loss = loss_fn(params, batch)
        else:
            loss = loss_fn(params, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
            raise FzeroError(f"loss_fn must return a 0-d floating tensor (this rank's mean loss), got "
                             f"{type(loss).__name__} {getattr(loss, 'dtype', '')} {getattr(loss, 'shape', '')}")
        return loss + (torch.stack(anchors).sum() * 0).to(loss.dtype) if anchors else loss  # same bits

    return loss_of


def _grads(loss_of: Callable, xs: list[torch.Tensor], trainable: list[int], engine: str):
    """`(grads per trainable bucket (None: no gradient reached it), loss)`."""
    if engine == "func":
        def f(tr: tuple, rest: list) -> torch.Tensor:
            merged = list(rest)
            for k, b in enumerate(trainable):
                merged[b] = tr[k]
            return loss_of(merged)

        grads, loss = torch.func.grad_and_value(f)(tuple(xs[b] for b in trainable), xs)
        return list(grads), loss.detach()
    merged = list(xs)
    for b in trainable:
        merged[b] = xs[b].detach().requires_grad_()
    with torch.enable_grad():
        loss = loss_of(merged)
    if not loss.requires_grad or not trainable:
        return [None] * len(trainable), loss.detach()
    grads = torch.autograd.grad(loss, [merged[b] for b in trainable], allow_unused=True)
    return list(grads), loss.detach()


def _step(loss_fn, optimizer, st, mesh, engine, on_nonfinite, gather, state, batch):
    layout, rank = state.layout, state.rank
    buckets = layout.buckets
    trainable = [b.index for b in buckets if not b.group.frozen]
    log = StepLog(len(layout.leaves))
    xs, extras = _inputs(state, st)
    loss_of = _local_loss(loss_fn, st, mesh, layout, log, extras, batch, gather, engine)
    try:
        grads, loss = _grads(loss_of, xs, trainable, engine)
    finally:
        # the release callbacks hold the LazyParams, whose leaves hold the autograd graph, whose
        # unit Functions hold this log: a cycle through C++ that Python's GC cannot see
        log.after_backward.clear()

    units = {b: Bucket.of(layout, b) for b in trainable}
    reduced = {}
    for b, g in zip(trainable, grads):  # g is None where no leaf of the bucket reached the loss here
        reduced[b] = st.reduce(mesh, units[b], torch.zeros_like(xs[b]) if g is None else g)

    used, bad_ranks, mean_loss, norm_sq = _agree(state, st, mesh, log, loss, reduced)
    metrics_loss = torch.tensor(mean_loss, dtype=torch.float64)
    grad_norm = torch.tensor(math.sqrt(norm_sq) if math.isfinite(norm_sq) else norm_sq, dtype=torch.float64)
    if bad_ranks or not math.isfinite(norm_sq):
        if on_nonfinite == "raise":
            leaves = _nonfinite_leaves(state, st, mesh, reduced)
            raise NonFiniteError(_nonfinite_message(state.step, bad_ranks, leaves, norm_sq))
        return state, Metrics(metrics_loss, grad_norm, state.step, True)

    new_params, new_opt = list(state.params), list(state.opt_state)
    for b in trainable:
        spec = buckets[b]
        if st.optimizer_sharded:
            p = state.params[b] if st.params_sharded else shard_of(layout, b, state.params[b], rank)
            segments = layout.segments(b, rank)
            leaf_sum = (lambda x, tag=spec.tag: all_reduce(x, mesh, "sum", tag=tag + "/leaf_sum"))
        else:
            p, segments, leaf_sum = state.params[b], layout.flat_segments(b), (lambda x: x)
        ctx = UpdateContext(state.step, spec.group, segments, spec.leaves, tuple(used[i] for i in spec.leaves),
                            leaf_sum)
        p_new, new_opt[b] = optimizer.update(reduced[b], state.opt_state[b], p, ctx)
        new_params[b] = st.finish(mesh, units[b], p_new)
    new_state = state._replace(params=tuple(new_params), opt_state=tuple(new_opt), step=state.step + 1)
    return new_state, Metrics(metrics_loss, grad_norm, state.step, False)


def _agree(state: ZeroState, st: Stage, mesh: Mesh, log: StepLog, loss: torch.Tensor, reduced: dict):
    """The one agreement collective: `[loss, used[L], bad[B], ‖g_shard‖²]` from every rank.

    `bad[b]` says whether bucket b's *local* gradient held a NaN or inf on that rank; `‖g_shard‖²`
    sums the squares of the rank's slice of the *reduced* gradient in float64 (stage 0 takes its
    rank's slice of the full buffer, so every stage sums the same numbers in the same order).
    """
    layout, n, dev = state.layout, mesh.world_size, mesh.device
    num, nb = len(layout.leaves), len(layout.buckets)
    bad = torch.zeros(nb, dtype=torch.float64, device=dev)
    for b, flag in log.nonfinite.items():
        bad[b] = flag.to(device=dev, dtype=torch.float64)
    sq = torch.zeros((), dtype=torch.float64, device=dev)
    for b, g in reduced.items():
        sq = sq + _my_shard(state, st, b, g).to(torch.float64).square().sum().to(dev)
    row = torch.cat([loss.to(device=dev, dtype=torch.float64).reshape(1),
                     torch.tensor(log.used, dtype=torch.float64, device=dev), bad, sq.reshape(1)])
    rows = all_gather(row, mesh, tag="fzero.step/agree").view(n, num + nb + 2).cpu()
    losses, used_rows, bad_rows, sqs = rows[:, 0], rows[:, 1 : 1 + num], rows[:, 1 + num : 1 + num + nb], rows[:, -1]
    used = (used_rows > 0).any(dim=0).tolist()
    bad_ranks = {r: [layout.buckets[b].tag for b in (bad_rows[r] > 0).nonzero().flatten().tolist()]
                 for r in range(n) if not math.isfinite(losses[r].item()) or bool((bad_rows[r] > 0).any())}
    total_loss, total_sq = 0.0, 0.0
    for r in range(n):  # rank order
        total_loss += losses[r].item()
        total_sq += sqs[r].item()
    return used, bad_ranks, total_loss / n, total_sq


def _my_shard(state: ZeroState, st: Stage, b: int, reduced: torch.Tensor) -> torch.Tensor:
    """This rank's `shard[S]` of bucket b's reduced gradient (stage 0 holds the full buffer)."""
    return reduced if st.optimizer_sharded else shard_of(state.layout, b, reduced, state.rank)


def _nonfinite_leaves(state: ZeroState, st: Stage, mesh: Mesh, reduced: dict) -> list[str]:
    """The rare path, taken by every rank together: the leaves whose *reduced* gradient holds a
    NaN or inf (a NaN or inf in any rank's local gradient survives the sum), by one all-reduce."""
    layout, rank = state.layout, state.rank
    flags = torch.zeros(len(layout.leaves), dtype=torch.float64, device=mesh.device)
    for b, g in reduced.items():
        mine = _my_shard(state, st, b, g)
        for seg in layout.segments(b, rank):
            if not bool(torch.isfinite(mine[seg.start : seg.stop]).all()):
                flags[seg.leaf] = 1.0
    flags = all_reduce(flags, mesh, "max", tag="fzero.step/nonfinite")
    return [layout.leaves[i].path for i in (flags > 0).nonzero().flatten().tolist()]


def _nonfinite_message(step: int, bad_ranks: dict, leaves: list[str], norm_sq: float) -> str:
    named = ", ".join(repr(p) for p in leaves[:8]) + (" ..." if len(leaves) > 8 else "")
    where = f"; the reduced gradient is non-finite in {named}" if leaves else ""
    if not bad_ranks:
        return (f"step {step}: every rank's loss and local gradient are finite but the reduced gradient is not "
                f"(sum of squares {norm_sq}{where}): the sum over ranks overflowed. The state is unchanged; lower "
                f"the learning rate or loss scale, or use on_nonfinite='skip'")
    parts = [f"rank {r}: non-finite " + (f"local gradient in bucket(s) {tags}" if tags else "loss")
             for r, tags in bad_ranks.items()]
    return (f"step {step}: non-finite values on rank(s) {list(bad_ranks)} ({'; '.join(parts)}){where}. The state "
            f"is unchanged; use on_nonfinite='skip' to skip such steps")
