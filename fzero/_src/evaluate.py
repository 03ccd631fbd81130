"""`evaluate`: a function of the params -> `evaluate(state, batch) -> output`, forward only.

The forward half of a step, in every stage: each unit's parameters are gathered as the step
gathers them (`gather`, see `fzero._src.gathering`), `fn(params, batch)` runs under
`torch.no_grad()`, and what it returns comes back (a loss, logits, a tuple of them), each tensor
that shares the state's memory cloned and a `LazyParams` returned whole as a dict (`_owned`).
No autograd graph is built, no gradient is made or reduced, no optimizer runs, the state is
not changed. In stage 3 with `gather="on_use"` and flat-dict params (`from_module`), each
unit's gathered storage is freed after its submodule's forward (as the step does before its
backward), so a rank holds about 1 + k gathered units at a time (k = `prefetch`, the units
gathered ahead in the layout's order, read or not: 1 by default on a `DistMesh` over N > 1),
plus any unit spread over the root module; a unit `fn` never reads is gathered only by prefetch.

The bits: a unit's Function enters each bucket exactly as the step does (stage 3: an
all-gather, which copies bits; stages 0-2: the held buffer itself), so `fn` reads the same
values as `fn(fzero.gather(state), batch)` and runs the same ops on them: the outputs are equal
bit for bit (tests/test_stage3.py). Under a `fzero.Precision` policy `fn` reads the params in
the compute dtype, as the step's forward does: the same bits as `fn` over the gathered params
cast to it, `{k: v.to(param_dtype) for k, v in fzero.gather(state).items()}`.

An error of `fn` on one rank: at stage 3 over N > 1 (the forward gathers, and the ranks agree
on the units read after `fn`, `check_paths`) the others stop in this call with `RankFailed`;
at stages 0-2 (no collective) it is the raising rank's alone, and the others' call returns, so
a loop that catches it on each rank stays in step (inside `mesh.run`, whose end agrees, the
others are told there).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from .collectives import all_gather, func_level
from .eager import compiled, note_fullgraph
from .errors import ConfigError, FzeroError, as_int
from .gathering import (EVALUATING, GATHERS, DivergentPaths, Gathering, LazyParams, check_prefetch, is_flat_dict,
                        refuse_compiled_placeholders, replaced_tensors, same_paths)
from .mesh import Mesh
from .precision import note_batch_dtypes
from .state import ZeroState, check_state, checked
from .unit import Probe, unit_programs


def evaluate(fn: Callable[[Any, Any], Any], *, gather: str = "on_use", prefetch: int | None = None
             ) -> Callable[[ZeroState, Any], Any]:
    """Build `evaluate(state, batch) -> fn(params, batch)` for one rank (call it on every rank).

    Args:
      fn: `(params, batch) -> anything`, e.g. a loss function or a model's apply; its params
        are the state's params pytree (a `LazyParams` mapping for flat-dict params with
        `gather="on_use"`), in the compute dtype.
      gather: "on_use" (default: a unit is gathered when `fn` first reads it and, in stage 3
        with flat-dict params, freed after its submodule's forward) or "eager" (every unit
        before `fn`). The same bits either way.
      prefetch: stage 3, on use: start the gathers of the next `prefetch` units of the layout's
        order before the current one computes, as `train_step(..., prefetch=k)` (None, the
        default: 1 on a mesh that overlaps collectives with compute, else 0). Same bits.

    Every rank must read the same units in the same order with "on_use" (as in the step): a rank
    that takes another path through the model stops every rank with `DivergentPaths`. At stages
    0-2 an evaluation runs no collective but one: on a state a donating step returned
    (`train_step(donate=True)`), every reader first checks that step's verdict with one small
    all-gather, so evaluate on some ranks only (a logging branch on rank 0) is refused there too,
    with `DivergentPaths` naming the ranks in `fzero.evaluate`.

    `evaluate` does not change the model's mode: `fn` runs as it is (DeepSpeed's `engine.eval()`
    has no counterpart here). For a `from_module` model, call `apply.eval()` before evaluating
    (dropout off; BatchNorm normalizes with its running statistics and does not update them) and
    `apply.train()` before training again: `apply` runs a parameter-free copy of the module, so
    `model.eval()` on the original module does not reach it. Left in training mode, dropout
    stays on, drawing its masks from torch's RNG (so the steps after the evaluation take other
    masks than without it), and a training-mode BatchNorm updates `info.buffers` in the
    evaluation's forward, `torch.no_grad()` notwithstanding. Forgetting `apply.train()` after is
    silent, as `model.eval()` is in torch: the steps then train with dropout off and BatchNorm's
    statistics frozen. On a `SimMesh`, `apply.eval()` called inside `mesh.run` is the calling
    rank's mode only, as in a process of a `DistMesh`; outside `mesh.run`, every rank's.

    Example:
      >>> mesh = fzero.SimMesh(2)
      >>> def rank_fn():
      ...     state = fzero.init({"w": torch.ones(3)}, fzero.optim.sgd(0.1), stage=3, mesh=mesh)
      ...     return fzero.evaluate(lambda p, x: (p["w"] * x).sum())(state, torch.tensor(2.0))
      >>> mesh.run(rank_fn)
      [tensor(6.), tensor(6.)]
    """
    if not callable(fn):
        raise ConfigError(f"evaluate's fn must be a callable (params, batch) -> output, got {fn!r}")
    if gather not in GATHERS:
        raise ConfigError(f"gather must be one of {GATHERS}, got {gather!r}")
    prefetch = as_int(prefetch)
    check_prefetch(prefetch)

    @torch.compiler.disable  # fzero's own code runs eager; `fn` may be compiled (docs/compile.md)
    def run(state: ZeroState, batch: Any) -> Any:
        if func_level() is not None:
            raise ConfigError("evaluate inside a torch.func transform (grad, vjp, jacrev, jvp, vmap, ...): evaluate "
                              "runs its function under torch.no_grad() on the state's own buffers, so a derivative "
                              "through it is zero or torch's saved-tensor-hooks error, and a vmap over it is refused "
                              "too. For a derivative, differentiate a train_step's loss, or call fn on the params "
                              "read differentiably: fn(fzero.layout.unpack(state.layout, state.params), batch) (stage "
                              "3, N > 1: all-gather each bucket first; fzero.gather is refused under a transform for "
                              "the same reason); for a vmap, put it inside fn: evaluate(lambda p, xs: "
                              "torch.func.vmap(fn, in_dims=(None, 0))(p, xs))(state, xs)")
        if not isinstance(state, ZeroState):
            check_state(state)  # its error, naming what was given
        # labelled and worded first: after a donating step the check of its pending verdict
        # (`checked`) is a collective too, which a rank evaluating alone met unnamed (found in review)
        with _labelled(state.mesh), same_paths(state.layout), _guarded(state), torch.no_grad():
            return _owned(state, forward(state, fn, gather, batch, prefetch))

    def evaluate_call(state: ZeroState, batch: Any) -> Any:
        # a plain function around the disabled `run`, as `train_step`'s `step` is: `torch.compile` of the
        # disabled function itself unwraps it (`_torchdynamo_orig_callable`) and traced fzero's code,
        # compiling `fn` and recompiling at every call (found in review of a compile user)
        return run(state, batch)

    return evaluate_call


@contextlib.contextmanager
def _guarded(state: ZeroState) -> Any:
    """The state checked inside the mesh guard (`checked`: a refused state on one rank stops the
    others in the collective they wait in), and the forward inside it where it has collectives
    of its own (`_gathers`: it ends with `check_paths` after `fn`, eager gathers too), so that an
    error of `fn` on one rank stops the others within this call. A forward with none (stages
    0-2) runs outside it: there an error of `fn` is the raising rank's alone, and announced it
    was taken by the others' next call (a `gather`, a step's reduction), which never ran, so each
    rank that went on was one call behind the other: a step reduced one rank's batch t with
    another's t - 1, silently, until a mismatch (found in review of an evaluating user)."""
    with checked(state):
        if _gathers(state):
            yield
            return
    yield


def _gathers(state: ZeroState) -> bool:
    """Whether `state`'s forward has collectives: stage 3 over N > 1 (gathers, then `check_paths`)."""
    return state.stage.sharded("params") and state.mesh.world_size > 1


def _labelled(mesh: Mesh) -> contextlib.AbstractContextManager:
    """Around an evaluation over N > 1 ranks: its collectives carry the label "evaluate"
    (`Mesh.phase`), so that a rank evaluating where the others step (or gather) raises
    `DivergentPaths` naming it at its first collective. Without the label, a stage-3 evaluation's
    gathers are a step forward's calls, and paired with them: the mismatch came later, worded
    as a step's (found in review). Tags and what `Mesh.record` logs are unchanged."""
    return mesh.phase(EVALUATING) if mesh.world_size > 1 else contextlib.nullcontext()


def _owned(state: ZeroState, out: Any) -> Any:
    """`out` with every tensor that shares memory with the state (a param returned as it is, or a
    view of one: stages 0-2 and stage 3 at N = 1 read the held buffers themselves) cloned, also
    in a dataclass's fields (`replaced_tensors`), and a `LazyParams` returned whole made a dict of
    its leaves: writing an output, or reading it after a donating step, must not reach the state
    (found in review: at stages 0-2 a write to it changed the state, under a bf16 policy its
    compute copy apart from its master, while at stage 3, N > 1, it did not)."""
    held = {t.untyped_storage().data_ptr() for t in (*state.params, *state.master)
            if isinstance(t, torch.Tensor) and t.numel()}
    out = tree_map(lambda x: dict(x) if isinstance(x, LazyParams) else x, out,
                   is_leaf=lambda x: isinstance(x, LazyParams))
    return replaced_tensors(out, lambda t: bool(t.numel()) and t.untyped_storage().data_ptr() in held,
                            torch.Tensor.clone, lambda t: f"a view of the state's own buffer ({t.dtype}"
                                                          f"{list(t.shape)}: a param returned as it is)")


def forward(state: ZeroState, fn: Callable[[Any, Any], Any], gather: str, batch: Any,
            prefetch: int | None = None) -> Any:
    """`fn(params, batch)` through the state's unit Functions, under `torch.no_grad()`. Where `fn`
    raises after reading a unit, the gathers prefetch started ahead of it are waited for and freed,
    as a step's are (`Gathering.finish`; before, left unwaited, found in review)."""
    layout, stage, mesh, rank = state.layout, state.stage, state.mesh, state.rank
    programs = unit_programs(layout, mesh, stage, state.precision)
    pairs = [stage.differentiated(layout, b, p, rank, m) for b, (p, m) in enumerate(zip(state.params, state.master))]
    xs, fulls = [x for x, _ in pairs], [full for _, full in pairs]
    probes = {p.name: Probe.of(p, xs[p.buckets[0].index].device) for p in programs}
    on_use = gather == "on_use" and stage.sharded("params")
    refuse_compiled_placeholders(compiled(fn), layout, gather)  # (placeholders at every stage on use: found in
    # review)
    gathering = Gathering(layout, programs, xs, fulls, probes, gather, on_use and is_flat_dict(layout),
                           prefetch=prefetch)
    try:
        out = gathering.call(fn, batch)
    except BaseException as e:  # the gathers `fn` started ahead (prefetch): waited for and freed, or kept
        gathering.finish(e)  # by the mesh (`finish`); an interrupt too (before, its gathers were dropped: gloo cancelled them)
        _note_batch_dtypes(e, state, batch)
        with contextlib.suppress(Exception):
            note_fullgraph(e, gather)
        raise
    if _gathers(state):  # also after an eager forward, whose gathers all came before `fn`: an error of `fn` on
        # one rank then stops the others here, in this call (`_guarded`; found in review: their call returned,
        # and their next call took the error)
        check_paths(state, gathering.gathered)
    return out


def _note_batch_dtypes(e: BaseException, state: ZeroState, batch: Any) -> None:
    """On torch's error of operands of different dtypes that `fn` raised, the note the step adds
    too (`precision.batch_dtype_note`): the batch's floating leaves in none of the dtypes the
    params reach `fn` in (a precision policy casts the params, not the batch). Built on the error
    path only; none on fzero's own errors, nor on an interrupt."""
    if isinstance(e, Exception) and not isinstance(e, FzeroError):
        note_batch_dtypes(e, state.precision, state.layout.buckets, batch, reader="evaluate's fn")


def check_paths(state: ZeroState, gathered: tuple[str, ...]) -> None:
    """Raise `DivergentPaths` on every rank unless every rank gathered the same units in the same
    order: one all-gather of `[count, unit index per read, -1 padding][U + 1]` (int64, tag
    "fzero.evaluate/paths"). A rank that read fewer units than another reaches this collective
    while the other waits in a gather, so that mismatch names both; this catches the rest."""
    layout, mesh = state.layout, state.mesh
    n, units = mesh.world_size, list(layout.units)
    if n == 1:
        return
    row = torch.full((len(units) + 1,), -1, dtype=torch.int64, device=mesh.device)
    row[0] = len(gathered)
    row[1 : 1 + len(gathered)] = torch.tensor([units.index(u) for u in gathered], dtype=torch.int64)
    rows = all_gather(row, mesh, tag="fzero.evaluate/paths").view(n, len(units) + 1).tolist()
    if all(r == rows[0] for r in rows):
        return
    orders = [[units[i] for i in r[1 : 1 + r[0]]] for r in rows]
    at = next(k for k in range(len(units)) if len({tuple(o[k : k + 1]) for o in orders}) > 1)
    parts = ", ".join(f"rank {r} gathered {f'unit {o[at]!r}' if at < len(o) else 'no unit'}"
                      for r, o in enumerate(orders))
    raise DivergentPaths(
        f"ranks took different paths through the model: at the unit read #{at}, {parts} (world size {n}; "
        f"each rank's order: {orders}). With gather='on_use' every rank must read the same units in the same "
        f"order; or use gather='eager'")
