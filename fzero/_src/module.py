"""nn.Module interop: a module -> `(params, apply, info)` for `fzero.init` / `fzero.train_step`.

`from_module(model)` returns

- `params`: `{name: tensor}`, one leaf per *distinct* parameter (the first name
  `named_parameters()` gives it), detached (sharing storage with `model`; fzero.init copies);
- `apply(params, *args, **kwargs)`: `model(*args, **kwargs)` computed with `params`, through
  `torch.func.functional_call` over a parameter-free skeleton (a copy of `model` whose
  parameters are `meta` placeholders; `model.eval()` does not reach it: `apply.eval()` and
  `apply.train()` set its training mode, `Apply`). Every alias of a tied parameter is bound to
  the same tensor (`named_parameters(remove_duplicate=False)`), so tied weights stay tied and
  their gradient is the sum over all uses, added locally before any reduction (as DDP does);
- `info`: a `ModuleInfo` with the alias table, the live buffers, the suggested `units` and
  `groups` (a frozen `ParamGroup` for `requires_grad=False` parameters); after training,
  `model.load_state_dict(info.state_dict(fzero.gather(state)))` puts the trained weights,
  buffers and extra state (`get_extra_state`, from the copy `apply` ran last, with the trained
  params bound) back into `model` (DeepSpeed's `engine.module`). Extra state the forward changes
  is that copy's: on the on-use path each thread's copy starts from `from_module`'s, so a
  `SimMesh` keeps it across the steps of one `mesh.run` only (a new `mesh.run` starts new
  threads), a process mesh across every step (`ModuleInfo.state_dict`).

`apply` binds the parameters in their registered slots only: a forward reading one from a list,
dict or plain attribute (`self._refs = [self.w]`) raises `ConfigError` naming it and where it is
held (`_Unbound`), and a hook (or one of torch's global module hooks) holding the module, a
submodule, a parameter or a buffer in its closure, defaults or globals (or in an object held
there) is refused by `from_module` (`_check_hooks`): either read the original, never the trained
values (found in review). So is a loss that reads a parameter of `model` itself in grad mode beside
`apply` (`model[0].weight.pow(2).sum()`): its gradient went nowhere (`fzero._src.originals`).

A module wrapped for data parallelism (DDP, DataParallel, FSDP / fully_shard) is refused
(`ConfigError`): pass the module it wraps; fzero reduces the gradients itself.

Buffers (BatchNorm running stats, ...) are per-rank state kept in the skeleton: `apply` passes
them to `functional_call` by identity, so a training-mode forward updates them in place, exactly
as `model(x)` would; `model`'s own buffers are left as they were (read them from
`info.buffers`). With one process per rank (`DistMesh`), a rank's buffers are updated from its
own batches only; on a `SimMesh` the ranks are threads of one process sharing the one skeleton's
buffers, which every rank's forward updates in turn (in an order the stage's collectives set:
a forward that reads the buffers it updates, as spectral_norm's does, then differs between
stages, and neither sentence below holds there: found in review). torch DDP
(`broadcast_buffers=True`) instead copies rank 0's buffers to every rank before each forward;
with one process per rank, call `broadcast_buffers(info, mesh)` before each step to get exactly
that (tested bitwise against DDP on gloo in tests/test_ddp.py), and before each `fzero.evaluate`
too: DDP's eval-mode forward broadcasts as well (a review saw rank 1's validation loss differ
from DDP's without it, and equal with it; the suite tests the steps only). Without it, rank 0's buffers
still equal DDP's rank 0 buffers bit for bit (rank 0's chain of updates is the same), so
evaluate or save from rank 0. A buffer the forward reassigns (`self.ema = ...`) has its new
value copied into the buffer (`keep_reassigned`) at the end of the root's forward; on a `SimMesh`
the ranks' threads share that buffer, so where a collective lies between the reassignment and
that end (stage 3 on use: a later unit's gather), another rank reads the buffer before this
rank's value is copied in, and the rank whose forward ends last overwrites it: the buffer holds
one rank's chain of updates, not every rank's in turn, and differs from `gather="eager"`'s
(found in review; per-process buffers under `DistMesh` are exact); a checkpointed unit's buffers are put back as
its forward found them for the recompute, and as it left them after (`remat`). `fzero.checkpoint.save(state, root,
buffers=info.buffers)` keeps rank 0's buffers beside the state, and `checkpoint.load(path,
target, buffers=info.buffers)` copies them back. Buffer updates happen in plain Python inside
the forward: use `engine="autograd"` for models that update buffers (functorch rejects in-place
writes to captured tensors; `apply` notes on that error the buffers a training-mode norm layer writes,
`captured_write_note`).
"""

from __future__ import annotations

import copy
import dis
import functools
import itertools
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from .collectives import broadcast, in_backward
from .eager import eager
from .errors import ConfigError, FzeroError, LayoutError, outside_stacklevel, said
from .layout import DEFAULT_UNIT, ParamGroup, UnitSpec, _check_leaf, _unit_of
from .gathering import LazyParams
from .mesh import Mesh, SimMesh, simmesh_rank
from .originals import note_born, note_originals
from .precision import BUFFER_NOTE
from .remat import remat_call
from .state import ZeroState, _overlapping


def _no_flattening(rnn: nn.RNNBase) -> None:
    """`nn.RNNBase.flatten_parameters` on `from_module`'s copy: nothing. The copy's weights are
    fzero's leaves, bound per call, which cuDNN's one packed buffer cannot hold (on the CPU torch's
    own is a no-op too); on CUDA torch then runs the RNN over the separate weights, as it does for
    weights it finds out of one chunk."""


class ModuleInfo(NamedTuple):
    """What `from_module` learned about a module.

    Attributes:
      aliases: `{params name: (every name the module uses for it, that name first)}`.
      buffers: `{buffer name: the skeleton's live buffer tensor}` (updated in place by `apply`).
      units: the `units` to pass to `fzero.init` (the `from_module` argument, or None).
      groups: the `groups` to pass to `fzero.init`: `ParamGroup("frozen", frozen=True)` over the
        `requires_grad=False` parameters, if any, as `from_module` read them (freeze first: a step
        of a state made of these params refuses a flag changed afterwards, docs/bad-input.md row 211).
      frozen: names of the `requires_grad=False` parameters.
      persistent: names of the buffers the module's `state_dict` holds (all but those registered
        with `persistent=False`); None: every name in `buffers`.
      extra_state: `(full=None) -> {"<submodule>._extra_state": its get_extra_state()}` for the
        submodules that define `get_extra_state` (read from the copy of the module `apply` ran
        last, `from_module`, with `full`'s params, `fzero.gather(state)`'s, bound in its parameter
        slots while it runs); None where none does. Without `full` (the export recipe
        `{**export, **info.extra_state()}`) a `get_extra_state` that reads a parameter raises
        `ConfigError` naming it: pass the params, `info.extra_state(fzero.gather(state))`.
    """

    aliases: dict[str, tuple[str, ...]]
    buffers: dict[str, torch.Tensor]
    units: UnitSpec
    groups: tuple[ParamGroup, ...]
    frozen: tuple[str, ...]
    persistent: frozenset[str] | None = None
    extra_state: Callable[..., dict[str, Any]] | None = None

    def state_dict(self, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The module's `state_dict` from `full`, the params `fzero.gather(state)` returns (its
        `{params name: tensor}`): every name of each param (`aliases`: a tied weight under each of
        its names), then the buffers the module's `state_dict` holds (`persistent`), as `buffers`
        holds them now -- trained: BatchNorm's running statistics as the steps left them --, then
        `{prefix}_extra_state` of each submodule that defines `get_extra_state` (`extra_state`). So

            model.load_state_dict(info.state_dict(fzero.gather(state)))

        puts the trained weights and buffers back into the original module, strictly (DeepSpeed's
        `engine.module`; `load_state_dict(fzero.gather(state))` alone misses a tied weight's other
        names, and `strict=False` then leaves the module's buffers as they were). Pure: the
        tensors are `full`'s and the live buffers themselves, not copies (`load_state_dict` copies
        them). A `full` whose keys are not the params `from_module` returned is a `ConfigError`
        naming the missing and unexpected keys.

        Extra state is read by `get_extra_state` with `full`'s params bound in the parameter slots
        (one that reads a parameter, `self.lin.weight.abs().max()`, reads the trained value: it
        read the copy's meta stand-in, and a meta tensor went into the state dict, which a strict
        load accepted; found in review), from the copy of the module that ran the last `apply` on
        this thread, else on any thread. `apply` runs copies of the module, not the module:
        `from_module`'s copy for a plain params dict (`gather="eager"`, `fzero.gather`'s dict),
        and on the on-use path (`gather="on_use"`, the default) one per thread, made from
        `from_module`'s copy, as it is then, when the thread first calls `apply`; where none ran,
        `from_module`'s copy, as the module was when `from_module` was called. So extra state the
        forward changes (a count of calls, FP8 scales) is that copy's:

        - on the on-use path, a thread's copy keeps it across the steps the thread runs. With one
          process per rank (`DistMesh`, one thread per process) that is every step. On a `SimMesh`
          each `mesh.run` starts new threads, whose copies start again from `from_module`'s: 3
          steps in 3 `mesh.run` calls give `{'calls': 1}` where torch counts 3, so run the steps
          in one `mesh.run` (found in review). Called on a rank: that rank's copy; after
          `mesh.run`: the copy of the rank that ran last;
        - on the dict path, `from_module`'s one copy runs every forward: on a `SimMesh` every
          rank's (the ranks' threads share it, as they share the buffers), across `mesh.run`
          calls, and an evaluation on `fzero.gather`'s dict adds its forwards there.

        (Found in review: it was missing, and the strict load raised torch's "Missing key(s) in
        state_dict: _extra_state".)"""
        _check_full(full, self.aliases, "ModuleInfo.state_dict(full)")
        kept = self.buffers if self.persistent is None else {k: b for k, b in self.buffers.items()
                                                             if k in self.persistent}
        extra = self.extra_state(full) if self.extra_state is not None else {}
        return {**aliased(full, self.aliases), **kept, **extra}


def _check_full(full: Any, aliases: Mapping[str, tuple[str, ...]], call: str) -> None:
    """`full` must be the params of the module `aliases` is of (`fzero.gather(state)`'s dict):
    else a `ConfigError` naming the missing and unexpected keys."""
    if isinstance(full, Mapping) and set(full) == set(aliases):
        return
    got = set(full) if isinstance(full, Mapping) else set()
    missing, extra = sorted(set(aliases) - got), sorted(got - set(aliases))
    what = (f"a dict of {len(full)} key{'' if len(full) == 1 else 's'}" if isinstance(full, Mapping)
            else f"a {type(full).__name__}")
    raise ConfigError(f"{call} takes the params of this from_module's model as "
                      f"fzero.gather(state) returns them ({len(aliases)} keys), got {what}: missing "
                      f"{missing[:5]}{' ...' if len(missing) > 5 else ''}, unexpected {extra[:5]}"
                      f"{' ...' if len(extra) > 5 else ''} (params nested beside others, as "
                      f"{{'model': params, ...}}: pass that subtree, fzero.gather(state)['model'])")


def aliased(leaves: Mapping[str, Any], aliases: Mapping[str, tuple[str, ...]]) -> dict[str, Any]:
    """`leaves` (`{params name: value}`) with each value also under every other name `aliases`
    gives it (`ModuleInfo.aliases`: a tied weight's names, its own first): the names a module's
    `state_dict` uses. Names `aliases` does not list keep their value. The one rule
    `ModuleInfo.state_dict` and `checkpoint.export(..., aliases=)` build a module's keys by."""
    out = dict(leaves)
    for name, names in aliases.items():
        for alias in names:
            out[alias] = leaves[name]
    return out


_EXTRA_STATE = "_extra_state"  # torch's key suffix (`torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX`)


def extra_state_names(module: nn.Module) -> tuple[str, ...]:
    """The paths of `module`'s submodules (`""`: itself) whose `state_dict` holds
    `{prefix}_extra_state`: those whose class overrides `get_extra_state` (torch's own rule), under
    every name a shared submodule has, as `state_dict` names them."""
    return tuple(name for name, m in module.named_modules(remove_duplicate=False)
                 if getattr(type(m), "get_extra_state", nn.Module.get_extra_state) is not nn.Module.get_extra_state)


def extra_states(module: nn.Module, names: tuple[str, ...]) -> dict[str, Any]:
    """`{"<name>._extra_state": get_extra_state()}` of `module`'s submodules at `names`
    (`extra_state_names`), as `module.state_dict()` holds them."""
    return {f"{name}.{_EXTRA_STATE}" if name else _EXTRA_STATE: module.get_submodule(name).get_extra_state()
            for name in names}


def extra_states_with(module: nn.Module, names: tuple[str, ...], bound: Mapping[str, torch.Tensor]
                      ) -> dict[str, Any]:
    """`extra_states(module, names)` with `bound` (`{every alias: tensor}`, `aliased`) in the
    parameter slots while `get_extra_state` runs: a `get_extra_state` that reads a parameter
    (`{"wmax": self.lin.weight.abs().max()}`) reads the trained value, not the copy's meta stand-in,
    which put a meta tensor in the state dict that a strict `load_state_dict` accepted (found in
    review). The stand-ins are put back after. (`torch.func.functional_call` calls `forward` only.)"""
    with torch.nn.utils.stateless._reparametrize_module(module, dict(bound), tie_weights=False, strict=False):
        return extra_states(module, names)


def extra_states_unbound(module: nn.Module, names: tuple[str, ...], aliases: Mapping[str, tuple[str, ...]],
                         unit_of: Callable[[str], str]) -> dict[str, Any]:
    """`extra_states(module, names)` of a skeleton copy whose parameters are stand-ins, no params
    given (`info.extra_state()`, the export recipe): a `get_extra_state` that reads a parameter
    raises a `ConfigError` naming it and the way out, `info.extra_state(fzero.gather(state))`
    (`_Unbound`, with no root: `_unbound_error`); one that reads none runs as it is."""
    table = {}
    for name, names_ in aliases.items():
        for alias in names_:
            slot = _slot(module, alias)
            if isinstance(slot, _Unbound):
                table[id(slot)] = (name, unit_of(name), None)
    outer = _RUNNING.unbound
    _RUNNING.unbound = table if outer is None else _merged(outer, table)
    try:
        return extra_states(module, names)
    finally:
        _RUNNING.unbound = outer


def persistent_buffers(module: nn.Module) -> frozenset[str]:
    """The names of `module`'s buffers that its `state_dict` holds: every buffer of every
    submodule (under each name a shared submodule has, as `named_buffers(remove_duplicate=False)`
    names them) but those registered with `persistent=False`."""
    return frozenset(f"{mn}.{bn}" if mn else bn for mn, m in module.named_modules(remove_duplicate=False)
                     for bn, b in m._buffers.items() if b is not None and bn not in m._non_persistent_buffers_set)


class _FrozenNames:
    """A picklable, comparable `path -> bool` for the frozen ParamGroup."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = frozenset(names)

    def __call__(self, path: str) -> bool:
        return path in self.names

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FrozenNames) and other.names == self.names

    def __hash__(self) -> int:
        return hash(self.names)

    def __repr__(self) -> str:
        return f"frozen_names({sorted(self.names)})"


def from_module(module: nn.Module, *, units: UnitSpec = None, remat: bool | Collection[str] = False
                ) -> tuple[dict[str, torch.Tensor], Apply, ModuleInfo]:
    """`module -> (params, apply, info)`; see `fzero._src.module`'s docstring.

    Args:
      module: any `nn.Module` (its parameters are read, never modified: they keep the values
        read here until `module.load_state_dict(info.state_dict(...))`; a loss that reads one
        in grad mode beside `apply` is refused, as it would get no gradient: `fzero._src.originals`).
      units: as for `fzero.init` (`None`, `path -> unit name`, or `{unit: predicate}`); e.g.
        `fzero.units_by_prefix(model, "transformer.h")` for one unit per block. Checked here:
        the parameters of one unit must share one device and one dtype.
      remat: activation checkpointing per unit: `True` (every unit that has a home submodule,
        i.e. all but the root's), or the names of the units to checkpoint (False: none). Where
        `apply` reads units on use (`train_step`'s default), a checkpointed unit's submodule
        keeps only its inputs for backward and runs again there, with the random-number state
        of its first run: the same bits (`fzero._src.remat`, proofs/stage3.md). With a plain
        params dict (`gather="eager"`, `fzero.gather`) `apply` computes the same values without
        checkpointing. Refused (`ConfigError`): a checkpointed unit whose submodule holds
        another unit's parameter (a head tied to the embedding), which its recompute in
        backward could not bind.

    Returns:
      `params` `{name: Tensor}` (distinct parameters, module order), `apply(params, *args,
      **kwargs) -> module(*args, **kwargs)`, and a `ModuleInfo`.

    Example:
      >>> import torch.nn.functional as F
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
      >>> params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
      >>> sorted(params), info.units("2.weight")
      (['0.bias', '0.weight', '2.bias', '2.weight'], '2')
      >>> mesh, opt = fzero.SimMesh(2), fzero.optim.adamw(1e-3)
      >>> loss_fn = lambda p, batch: F.cross_entropy(apply(p, batch[0]), batch[1])
      >>> def rank(batch):
      ...     state = fzero.init(params, opt, stage=3, mesh=mesh, units=info.units, groups=info.groups)
      ...     return fzero.train_step(loss_fn)(state, batch)[1].step
      >>> mesh.run(rank, [((torch.ones(3, 4), torch.zeros(3, dtype=torch.long)),)] * 2)
      [0, 0]
    """
    if not isinstance(module, nn.Module):
        config = (": a config dict (DeepSpeed's) has no place here; its settings are keywords of fzero.init "
                  "(stage=, precision=, offload=, loss_scale=) and of fzero.train_step (micro_batches=, clip_norm=), "
                  "docs/deepspeed.md" if isinstance(module, Mapping) else "")
        raise FzeroError(f"from_module expects an nn.Module (the model), got {type(module).__name__}{config}")
    _check_unwrapped(module)
    _warn_compiled(module)
    canonical: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    params: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if nn.parameter.is_lazy(p):  # found in review: torch's ValueError from `detach`, naming no parameter
            raise LayoutError(f"from_module: parameter {name!r} is an uninitialized parameter of a lazy module "
                              f"(nn.LazyLinear, nn.LazyConv2d, ...): it has no shape yet; run the model once on a "
                              f"dummy batch to materialize its parameters before fzero.from_module")
        first = canonical.setdefault(id(p), name)
        aliases.setdefault(first, []).append(name)
        if first == name:  # a frozen parameter stays an nn.Parameter(requires_grad=False): init freezes it
            params[name] = p.detach() if p.requires_grad else nn.Parameter(p.detach(), requires_grad=False)
    frozen = tuple(n for n, p in module.named_parameters() if not p.requires_grad)
    note_originals(module, canonical, aliases)  # a loss reading one in grad mode is refused (`refuse_original_reads`)
    note_born(module, params, aliases, units)  # a state made of them refuses a step where a flag or a tie changed since
    _check_dense(module)
    by_storage = _trainable_by_storage(module)
    _check_buffers_apart(module, by_storage)
    stale = _stale_attributes(module, by_storage) if by_storage else []
    _check_tensor_hooks(module)
    _check_hooks(module)
    _check_units(params, units, aliases)
    remat_units = _remat_units(module, aliases, units, remat)
    placeholders = {id(p): _Unbound.standing_for(p, name) for name, p in module.named_parameters()}
    try:
        skeleton = copy.deepcopy(module, memo=dict(placeholders))  # shared params stay shared placeholders
    except RuntimeError as e:  # a tensor attribute computed from a parameter (prune, the old weight_norm)
        raise FzeroError(f"from_module copies the module without its parameters (copy.deepcopy), which failed: "
                         f"{said(e)} A module holding a tensor computed from a parameter as a plain attribute "
                         f"(torch.nn.utils.prune, torch.nn.utils.weight_norm) copies after one forward under "
                         f"torch.no_grad(); or use torch.nn.utils.parametrize") from e
    _stand_in_for_stale(skeleton, stale)
    buffers = dict(skeleton.named_buffers(remove_duplicate=False))
    # a buffer the forward reassigns: its value kept at the end of the root's forward, inside
    # functional_call (a thread's copy of the skeleton carries the hook and reads its own slots);
    # the slots are read now, before a forward could put a new tensor in one
    slots_of(skeleton)
    for m in skeleton.modules():  # found in review: `rnn.flatten_parameters()` in a forward (the DataParallel
        if isinstance(m, nn.RNNBase):  # idiom) read its `_flat_weights` stand-ins and was refused; the copy's
            m.flatten_parameters = types.MethodType(_no_flattening, m)  # slots hold fzero's leaves: nothing to pack
    kept = skeleton.register_forward_hook(_keep).id  # a thread's copy runs it eager (`_eager_keep`)
    alias_table = {k: tuple(v) for k, v in aliases.items()}
    expected = set(params)
    shapes = {name: tuple(p.shape) for name, p in params.items()}  # what apply checks it is handed (`_check_shapes`)
    unit_of = _unit_of(units)
    # the dict path binds every registered slot: a placeholder its forward reaches is one held
    # outside them (a list, a dict, a plain attribute), which nothing rebinds (`_Unbound`)
    every_placeholder = {id(ph): (canonical[pid], unit_of(canonical[pid]), skeleton)
                         for pid, ph in placeholders.items()}
    extra_names = extra_state_names(skeleton)
    ran = [skeleton]  # where extra state is read (`ModuleInfo.state_dict`): the copy that ran the last apply,
    # on any thread (`ran`) or this one (`per_thread.ran`); kept only where a submodule has extra state
    per_thread = threading.local()
    modes = _Modes(skeleton)
    copies_made: weakref.WeakSet = weakref.WeakSet()  # every live thread's copy: what `Apply.train` sets beside the skeleton
    known: Any = None  # the last unit map whose keys were checked

    @eager
    def enter(params: LazyParams) -> tuple[_Skeleton, int, tuple] | None:
        """The on-use path's start (`apply`): this thread's copy of the skeleton, entered
        (`_Skeleton.enter`), its depth and what `leave` puts back; None where `params` are not
        this module's (the dict path's check then names what differs). Eager, as `leave`: under a
        compiled loss dynamo traces the module's forward, not this bookkeeping (before, it traced
        and guarded it: a new thread's copy, made by `copy.deepcopy`, compiled the stand-ins'
        `__torch_function__` once per parameter shape, and the closure's `known` compiled the
        loss again at the second step; found in review)."""
        nonlocal known
        if not (params.unit_map is known or params.unit_map.keys() == expected):
            return None
        if params.unit_map is not known:  # a new layout: its leaves' shapes, once (specs only)
            _check_shapes(shapes, params.shapes)
        # gathers run inside this forward, and SimMesh switches ranks at collectives: each rank
        # (thread) binds into its own copy of the skeleton (one per depth of `apply` inside
        # `apply`); buffers stay shared, as in eager mode
        known = params.unit_map
        copies = per_thread.__dict__.setdefault("copies", [])
        depth = per_thread.__dict__.get("depth", 0)
        if depth == len(copies):  # a copy takes the skeleton's training flags (`Apply.train`)
            module_copy = copy.deepcopy(skeleton, memo={id(b): b for b in buffers.values()})
            module_copy._forward_hooks[kept] = _eager_keep
            copies_made.add(module_copy)  # held weakly: a thread's copies go with it (SimMesh: each run's threads)
            copies.append(_Skeleton(module_copy, alias_table, remat_units))
        if extra_names and not depth:
            per_thread.ran = ran[0] = copies[0].module
        running = copies[depth]
        outer = running.enter(params, modes)
        per_thread.depth = depth + 1
        return running, depth, outer

    @eager
    def leave(running: _Skeleton, depth: int, outer: tuple) -> None:
        """The on-use path's end: `running`'s units unbound (`_Skeleton.leave`), the depth put back."""
        try:
            running.leave(outer)
        finally:
            per_thread.depth = depth

    def apply(params: dict[str, torch.Tensor] | LazyParams, *args: Any, **kwargs: Any) -> Any:
        """`module(*args, **kwargs)` with `params` (one tensor per distinct parameter) bound.

        With `LazyParams` (`train_step(..., gather="on_use")`), each unit is read, and so
        gathered, in a forward pre-hook of its home submodule (the deepest one holding all its
        parameters) and unbound after that submodule's forward; units at the root are read first.
        The plan of where each alias binds, and the hooks, are made once per thread's copy of
        the skeleton and unit map (`_Skeleton`): a step's host work before its first kernel is
        the reads of the root units.
        """
        if isinstance(params, LazyParams):
            entered = enter(params)  # eager, as `leave`: a compiled loss traces the module's forward only
            if entered is not None:
                running, depth, outer = entered
                try:
                    return running.module(*args, **kwargs)  # (its root's hook keeps a reassigned buffer's value)
                finally:
                    leave(running, depth, outer)
        if not isinstance(params, dict) or set(params) != expected:
            if isinstance(params, ZeroState):  # (found in review: named as missing every leaf)
                raise FzeroError("apply takes the params (a dict of tensors), not a ZeroState: call it inside the "
                                 "loss, loss_fn(params, batch) -> apply(params, ...), where the step hands it the "
                                 "params; outside a step, apply(fzero.gather(state), ...)")
            got = (set(params.unit_map) if isinstance(params, LazyParams) else set(params)
                   if isinstance(params, Mapping) else set())  # (a LazyParams was read as empty: found in review)
            missing, extra = sorted(expected - got), sorted(got - expected)
            nest = (f"; to train more leaves beside the module's, nest them ({{'model': params, 'other': t}}) and "
                    f"call apply(p['model'], ...)" if extra else "")
            raise FzeroError(f"apply needs exactly the params from_module returned ({len(expected)} leaves); missing "
                             f"{missing[:5]}, unexpected {extra[:5]}{nest}")
        bound: dict[str, torch.Tensor] = dict(buffers)
        for name, names in alias_table.items():
            t = params[name]
            if not isinstance(t, torch.Tensor):  # (found in review: `'float' object has no attribute ...`)
                raise FzeroError(f"param {name!r} is a {type(t).__name__}, not a tensor: apply needs the params "
                                 f"from_module returned (tensors of the module's shapes)")
            if t.is_meta:
                raise FzeroError(f"param {name!r} is a meta tensor; apply needs real values")
            if t.shape != shapes[name]:
                _check_shapes(shapes, {k: tuple(v.shape) for k, v in params.items()})
            for alias in names:
                bound[alias] = t
        # strict: every parameter and buffer name of the skeleton is bound, so a meta tensor the
        # forward reaches is one held outside them: `_Unbound` raises on it (found in review)
        outer = _RUNNING.unbound  # inside another apply: its stand-ins stay checked (`_merged`)
        _RUNNING.unbound = every_placeholder if outer is None else _merged(outer, every_placeholder)
        outer_root, _RUNNING.root = _RUNNING.root, skeleton
        if extra_names and outer_root is None:
            per_thread.ran = ran[0] = skeleton
        try:  # one copy for every rank: set to the caller's mode (SimMesh ranks run one at a time)
            return torch.func.functional_call(_in_mode(skeleton, modes), bound, args, kwargs, tie_weights=False,
                                              strict=True)
        finally:
            _RUNNING.unbound, _RUNNING.root = outer, outer_root

    def extra_state(full: Mapping[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """`{"<submodule>._extra_state": its get_extra_state()}`, read from the copy `apply` ran
        last (`ModuleInfo.extra_state`), with `full`'s params bound where given."""
        module = getattr(per_thread, "ran", None)
        module = module if module is not None else ran[0]
        if full is not None:
            _check_full(full, alias_table, "ModuleInfo.extra_state(full)")
            return extra_states_with(module, extra_names, aliased(full, alias_table))
        return extra_states_unbound(module, extra_names, alias_table, unit_of)

    groups = (ParamGroup("frozen", _FrozenNames(frozen), frozen=True),) if frozen else ()
    return params, Apply(apply, skeleton, copies_made, buffers, modes), ModuleInfo(alias_table, buffers, units, groups, frozen,
                                                                           persistent_buffers(skeleton),
                                                                           extra_state if extra_names else None)


def _check_shapes(shapes: Mapping[str, tuple[int, ...]], given: Mapping[str, tuple[int, ...]]) -> None:
    """Raise `FzeroError` where a param `apply` is handed has another shape than the module's
    (`shapes`, read by `from_module`), naming each such leaf: another model's params under the
    same names ran, silently where the shapes happened to fit, or with torch's shape error
    naming no leaf (found in review)."""
    wrong = [f"{name!r} {list(given[name])} (the module's: {list(shape)})" for name, shape in shapes.items()
             if tuple(given[name]) != shape]
    if wrong:
        stacked = {tuple(given[n][:1]) for n in shapes if tuple(given[n][1:]) == shapes[n]}
        stack = (f" They are the module's shapes with one leading dimension of {next(iter(stacked))[0]}: for a "
                 f"stack of models' params (torch.func.stack_module_state), map apply over it, "
                 f"torch.func.vmap(apply, in_dims=(0, None))(params, x)"
                 if len(stacked) == 1 and all(len(given[n]) == len(s) + 1 for n, s in shapes.items()) else
                 " These look like another model's under the same names")
        raise FzeroError(f"apply was handed params of other shapes than the module from_module read: "
                         f"{', '.join(wrong[:5])}{' ...' if len(wrong) > 5 else ''} ({len(wrong)} of {len(shapes)} "
                         f"leaves). apply needs the params from_module returned for this module (or a state made "
                         f"from them).{stack}")


def buffer_slots(module: nn.Module) -> tuple[tuple[nn.Module, str, torch.Tensor, str], ...]:
    """`(submodule, attribute, buffer, dotted name)` of every buffer slot of `module`."""
    return tuple((m, attr, b, f"{name}.{attr}" if name else attr) for name, m in module.named_modules()
                 for attr, b in m._buffers.items() if b is not None)


def _trainable_by_storage(module: nn.Module) -> dict[tuple, list[tuple[str, torch.Tensor]]]:
    """The trainable parameters of `module` by storage (`_storage_key`): only tensors of one storage
    can overlap, so each buffer or attribute looks at its storage's parameters once (before, every
    parameter per buffer: 11 s at 1600 x 1200, found in review)."""
    by_storage: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for n, p in module.named_parameters():
        if p.requires_grad and _storage_key(p) is not None:
            by_storage.setdefault(_storage_key(p), []).append((n, p))
    return by_storage


def _check_buffers_apart(module: nn.Module, by_storage: dict[tuple, list[tuple[str, torch.Tensor]]]) -> None:
    """A buffer sharing memory with a trainable parameter (`register_buffer("w_view",
    lin.weight.detach())`) is refused, naming both: fzero copies the module without its
    parameters, so the buffer's copy kept the initial values while the parameter trained, and the
    state dict written back (`info.state_dict`) loaded the stale buffer over the trained weight
    (found in review of a buffers user: silently). A frozen parameter is never updated: allowed."""
    for name, b in module.named_buffers(remove_duplicate=False):
        shared = _sharing(by_storage, b) if b is not None else None
        if shared is not None:
            raise LayoutError(f"from_module: buffer {name!r} ({str(b.dtype).removeprefix('torch.')}{list(b.shape)}) "
                              f"shares memory with the trainable parameter {shared!r}: fzero trains "
                              f"the parameter apart from the module, so the buffer would keep its initial values. "
                              f"Compute the view in forward from the parameter (self.lin.weight.t()), or register a "
                              f".clone() where the buffer is meant to be apart")


def _stale_attributes(module: nn.Module, by_storage: dict[tuple, list[tuple[str, torch.Tensor]]]
                      ) -> list[tuple[str, str, Any, str, str]]:
    """`(submodule path, attribute, key, name, parameter)` of each plain tensor attribute sharing a
    trainable parameter's memory (`_plain_tensors`), which apart from the module would hold stale
    values (`_stand_in_for_stale`)."""
    return [(prefix, attr, key, name, shared) for prefix, attr, key, name, t in _plain_tensors(module)
            if (shared := _sharing(by_storage, t)) is not None]


def _sharing(by_storage: dict[tuple, list[tuple[str, torch.Tensor]]], t: torch.Tensor) -> str | None:
    """The name of a trainable parameter (`by_storage`: those of each storage) whose memory `t`
    overlaps, or None."""
    trainable = by_storage.get(_storage_key(t), [])
    hit = _overlapping([*(p for _, p in trainable), t]) if trainable else None
    return trainable[min(hit)][0] if hit is not None and len(trainable) in hit else None


_MODULE_SLOTS = frozenset({"_parameters", "_buffers", "_modules"})  # and `_SLOTS`, a skeleton's


def _plain_tensors(module: nn.Module) -> Iterator[tuple[str, str, Any, str, torch.Tensor]]:
    """`(submodule path, attribute, key or None, name, tensor)` of each plain tensor attribute of
    `module` and its submodules (one in a list, tuple or dict attribute too: `name[k]`), neither
    a parameter nor a buffer, but one a forward pre-hook of its module sets before each forward
    (old-style `spectral_norm`'s `weight`: its hook's `name` / `_tensor_name`), which no copy
    makes stale."""
    for prefix, m in module.named_modules(remove_duplicate=False):
        set_by_hooks = {getattr(h, attr, None) for h in m._forward_pre_hooks.values()
                        for attr in ("name", "_tensor_name")}
        for attr, value in vars(m).items():
            if attr in _MODULE_SLOTS or attr == _SLOTS or attr in set_by_hooks:
                continue
            where = f"{prefix}.{attr}" if prefix else attr
            if _plain(value):
                yield prefix, attr, None, where, value
            elif isinstance(value, (dict, list, tuple)):  # (the name made for a tensor only: found in review,
                items = value.items() if isinstance(value, dict) else enumerate(value)  # a 2M-entry dict took 1.3 s)
                yield from ((prefix, attr, k, f"{where}[{k!r}]", v) for k, v in items if _plain(v))


def _stand_in_for_stale(skeleton: nn.Module, stale: list[tuple[str, str, Any, str, str]]) -> None:
    """In from_module's copy, each plain tensor attribute that shares a trainable parameter's
    memory in the module (`_stale_attributes`) held as a `_Stale` stand-in, which a forward
    that reads it is refused by, naming it; one the forward sets anew before reading it (a view
    cached at each call, `self.w_t = self.lin.weight.t()`) is never read. Before, the copy held
    the attribute's initial values and a forward reading it computed with them (torch's
    in-place update writes the attribute with the parameter), silently; a first fix refused every
    such module at `from_module`, the caching one too (both found in review)."""
    for prefix, attr, key, name, shared in stale:
        m = skeleton.get_submodule(prefix)
        value = m.__dict__[attr]
        stand_in = _Stale.standing_for(value if key is None else value[key], name, shared)
        if key is None:
            m.__dict__[attr] = stand_in
        elif isinstance(value, tuple):
            items = list(value)
            items[key] = stand_in
            m.__dict__[attr] = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        else:
            value[key] = stand_in


class _Stale(torch.Tensor):
    """The copy's stand-in for a plain tensor attribute that shares a trainable parameter's memory
    (`_stand_in_for_stale`): a meta tensor of its shape and dtype whose use by any torch function
    but a read of its metadata raises `ConfigError` naming it, the parameter and the ways out."""

    held_as: str  # the attribute's name
    shared: str  # the parameter's

    @classmethod
    def standing_for(cls, t: torch.Tensor, name: str, shared: str) -> "_Stale":
        stand_in = torch.empty(t.shape, dtype=t.dtype, device="meta").as_subclass(cls)
        stand_in.held_as, stand_in.shared = name, shared
        return stand_in

    def __deepcopy__(self, memo: dict) -> "_Stale":  # (a thread's copy of the skeleton: the same stand-in)
        return self

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func not in _METADATA and not _dynamo_probing():
            t = next(x for x in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(x, _Stale))
            raise ConfigError(
                f"the forward read attribute {t.held_as!r} ({str(t.dtype).removeprefix('torch.')}{list(t.shape)}; "
                f"{_op_name(func)}), a plain tensor (neither a parameter nor a buffer) that shares memory with the "
                f"trainable parameter {t.shared!r} in the module given to from_module: torch's optimizer writes the "
                f"parameter in place and so the attribute too, but fzero trains the parameter apart from the "
                f"module, and the copy apply runs would hold the attribute's initial values. Compute it in forward "
                f"from the parameter (self.flat = self.w.view(-1) before reading it), or hold a .clone() where it "
                f"is meant to be apart")
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})


def _plain(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, nn.Parameter)


def _storage_key(t: torch.Tensor) -> tuple | None:
    """`(device, the storage's first byte)` of a strided tensor with memory, else None."""
    try:
        return (t.device, t.untyped_storage().data_ptr()) if t.layout == torch.strided and not t.is_meta else None
    except RuntimeError:  # a tensor subclass without storage
        return None


_SLOTS = "_fzero_slots"  # the attribute of a root module (the skeleton) that holds its `slots_of`


def slots_of(root: nn.Module) -> tuple[tuple[nn.Module, str, torch.Tensor, str], ...]:
    """`buffer_slots(root)`, made once per root module, first before any forward of it (a slot read
    after a reassignment would hold the new tensor), and held by the module itself: a thread's copy
    of the skeleton (`copy.deepcopy`, its buffers kept) gets its own slots with it. Not a table
    beside the modules: the root's forward hook reads it, and a compiled loss over `apply` traces
    that hook; dynamo guarded on a `WeakKeyDictionary`'s keys by position, and when a thread's copy
    was collected its guard raised a bare `IndexError: list index out of range` (found in review:
    on-use steps, then gather="eager" steps, in one process)."""
    slots = root.__dict__.get(_SLOTS)
    if slots is None:
        slots = buffer_slots(root)
        object.__setattr__(root, _SLOTS, slots)
    return slots


def _keep(root: nn.Module, _args: Any, _out: Any) -> None:
    """The forward hook of the skeleton's root: `keep_reassigned(slots_of(root))`."""
    keep_reassigned(slots_of(root))


# a thread's copy of the skeleton (the on-use path) runs its root's hook eager: a compiled loss traces
# the dict path's (one graph), where the skeleton is one module; the copies are one per thread, and
# dynamo, guarding on the slots' modules, compiled the hook again for each
_eager_keep = eager(_keep)


def keep_reassigned(slots: tuple[tuple[nn.Module, str, torch.Tensor, str], ...]) -> None:
    """After a forward: a buffer the forward reassigned (`self.ema = 0.9 * self.ema + ...`, where
    `nn.Module.__setattr__` puts the new tensor in the slot) has its new value copied into the
    buffer `info.buffers` holds, which the slot then gets back: `functional_call` (and the
    on-use path, as it) puts the old tensor back, and the update was lost (found in review: an
    EMA buffer stayed zero). A new value of another shape, dtype or device, or not a tensor, is
    refused, naming the buffer."""
    for m, attr, buffer, name in slots:
        new = m._buffers.get(attr)
        if new is buffer:
            continue
        if not isinstance(new, torch.Tensor) or (new.shape, new.dtype, new.device) != (buffer.shape, buffer.dtype,
                                                                                        buffer.device):
            shown = (f"{str(new.dtype).removeprefix('torch.')}{list(new.shape)} on {new.device}"
                     if isinstance(new, torch.Tensor) else type(new).__name__)
            raise ConfigError(f"the forward reassigned buffer {name!r} ({str(buffer.dtype).removeprefix('torch.')}"
                              f"{list(buffer.shape)} on {buffer.device}) to {shown}: fzero keeps a buffer's new "
                              f"value by copying it into the buffer, so it must keep its shape, dtype and device")
        with torch.no_grad():
            buffer.copy_(new)
        m._buffers[attr] = buffer


def _wrappers() -> tuple[tuple[type, str, str], ...]:
    """`(class, its name, what fzero would make of it)` of each torch data-parallel wrapper: DDP and
    DataParallel (torch.nn, always imported), FSDP's `FullyShardedDataParallel` and `fully_shard`'s
    `FSDPModule` where `torch.distributed.fsdp` is imported (else no module can be one)."""
    found = [(nn.parallel.DistributedDataParallel, "torch.nn.parallel.DistributedDataParallel",
              "take its parameter names ('module.*') and leave its gradient buckets, hooks and reducer alive "
              "beside fzero's own reduction"),
             (nn.DataParallel, "torch.nn.DataParallel", "take its parameter names ('module.*'), and it would "
              "replicate the module onto its devices at every forward")]
    fsdp = sys.modules.get("torch.distributed.fsdp")
    for attr, name, would in (("FullyShardedDataParallel", "torch.distributed.fsdp.FullyShardedDataParallel",
                               "take FSDP's flat, sharded parameters for the model's"),
                              ("FSDPModule", "torch.distributed.fsdp.fully_shard",
                               "take fully_shard's DTensor shards for the model's parameters")):
        cls = getattr(fsdp, attr, None) if fsdp is not None else None
        if isinstance(cls, type):
            found.append((cls, name, would))
    return tuple(found)


def _check_unwrapped(module: nn.Module) -> None:
    """A module that is (or holds) a data-parallel wrapper (DDP, DataParallel, FSDP / fully_shard)
    is refused with a `ConfigError` naming the wrapper, where it sits, and the way out: it was
    taken, its parameters named `module.*`, with DDP's gradient buckets, hooks and replica kept
    alive beside fzero's own reduction (found in review of a DeepSpeed port). One pass over the
    submodules, at `from_module` only."""
    wrappers = _wrappers()
    for name, m in module.named_modules():
        for cls, what, would in wrappers:
            if not isinstance(m, cls):
                continue
            where = "the module" if not name else f"submodule {name!r} of the module"
            sharded = "fsdp" in what
            if sharded:
                way = ("build the model without it and pass that to from_module: fzero shards the params itself "
                       "(fzero.init(..., stage=3))")
            elif not name:
                way = (f"pass the module it wraps, fzero.from_module({'ddp' if 'Distributed' in what else 'dp'}"
                       f".module), and do not wrap the model: fzero reduces the gradients itself")
            else:
                way = (f"put the module it wraps in its place (model.get_submodule({name!r}).module), or build the "
                       f"model without the wrapper: fzero reduces the gradients itself")
            raise ConfigError(f"from_module: {where} is a {what} wrapper ({type(m).__name__}): fzero would "
                              f"{would}; {way}")


class ModuleCompileDropped(UserWarning):
    """`from_module` of a module that `.compile()` was called on (the module or a submodule):
    `apply` runs a copy of the module (`copy.deepcopy`), which does not keep what `.compile()`
    set, so it runs uncompiled, with no word (found in review). Compile the loss that calls
    `apply` (`train_step(torch.compile(loss_fn))`), or pass `torch.compile(model)` to
    `from_module` (its params are then named `_orig_mod.*`); docs/compile.md."""


def _warn_compiled(module: nn.Module) -> None:
    """Warn `ModuleCompileDropped` naming the (sub)modules `.compile()` was called on (an
    `nn.Module` holds the compiled call in `_compiled_call_impl`, which `copy.deepcopy` drops)."""
    compiled = [f"submodule {name!r} ({type(m).__name__})" if name else f"the module ({type(m).__name__})"
                for name, m in module.named_modules() if getattr(m, "_compiled_call_impl", None) is not None]
    if compiled:
        more = f" and {len(compiled) - 3} more" if len(compiled) > 3 else ""
        warnings.warn(ModuleCompileDropped(
            f"from_module: .compile() was called on {', '.join(compiled[:3])}{more}, and has no effect "
            f"on apply: apply runs a copy of the module (copy.deepcopy), which does not keep what .compile() set, "
            f"so it runs uncompiled. Compile the loss that calls apply instead "
            f"(train_step(torch.compile(loss_fn)), docs/compile.md), or pass torch.compile(model) to from_module "
            f"(its params are then named '_orig_mod.*')"), stacklevel=outside_stacklevel())


def _check_dense(module: nn.Module) -> None:
    """An `nn.Embedding` / `nn.EmbeddingBag` built with `sparse=True` makes a sparse gradient,
    which no flat bucket holds: refused here, naming the leaf (it failed inside the backward's
    copy with torch's "copy_() between dense and sparse Tensors", found in review)."""
    for name, m in module.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad:
            where = f"{name}.weight" if name else "weight"
            raise LayoutError(f"from_module: {where!r} ({type(m).__name__}{tuple(m.weight.shape)}, sparse=True) gets a "
                              f"sparse gradient, which fzero's flat gradient buckets cannot hold; build it with "
                              f"sparse=False (the same values, a dense gradient), or freeze it")


_TENSOR_HOOKS = (("_backward_hooks", "register_hook"),
                 ("_post_accumulate_grad_hooks", "register_post_accumulate_grad_hook"))


def _check_tensor_hooks(module: nn.Module) -> None:
    """A hook registered on a parameter tensor (`p.register_hook`,
    `p.register_post_accumulate_grad_hook`) is refused, naming the parameter: apply's copy holds
    other tensors in the parameters' places (stand-ins, then the step's leaves), which carry no
    hook, so a per-parameter gradient transform ran in torch's training and not in fzero's,
    silently (found in review). One attribute read per parameter; a removed hook leaves an empty
    dict, which is no hook."""
    for name, p in module.named_parameters(remove_duplicate=False):
        if not p.requires_grad:  # frozen: torch never runs its hooks either
            continue
        for attr, how in _TENSOR_HOOKS:
            hooks = getattr(p, attr, None)
            if hooks:
                hook = next(iter(hooks.values()))
                named = f"{getattr(hook, '__module__', None) or type(hook).__module__}.{_qualname(hook)}"
                raise ConfigError(
                    f"from_module: parameter {name!r} ({str(p.dtype).removeprefix('torch.')}{list(p.shape)}) has a "
                    f"tensor hook ({how}: {named!r}), which fzero's step never runs: apply's copy of the module "
                    f"holds the step's own tensors in the parameters' places, without the hook. Remove it (the "
                    f"handle's remove(); a logger's, as wandb.watch's: wandb.unwatch(model)) and put a gradient "
                    f"transform where fzero applies it: clip_norm for clipping, or an optimizer of your own over "
                    f"the flat shards (examples/custom_optimizer.py)")


_HOOKS = (("_forward_pre_hooks", "forward pre-hook"), ("_forward_hooks", "forward hook"),
          ("_backward_pre_hooks", "backward pre-hook"), ("_backward_hooks", "backward hook"))
# torch's global module hooks (`torch.nn.modules.module.register_module_forward_hook`, ...): run for
# every module, apply's copy included, and never copied
_GLOBAL_HOOKS = (("_global_forward_pre_hooks", "register_module_forward_pre_hook"),
                 ("_global_forward_hooks", "register_module_forward_hook"),
                 ("_global_backward_pre_hooks", "register_module_full_backward_pre_hook"),
                 ("_global_backward_hooks", "register_module_full_backward_hook"))


def _global_hooks() -> list[tuple[str, Any]]:
    """`(how it was registered, hook)` of each of torch's global module hooks now registered
    (guarded: a torch without one of the dicts has none of that kind)."""
    glob = sys.modules.get("torch.nn.modules.module")
    return [(how, hook) for attr, how in _GLOBAL_HOOKS
            for hook in (getattr(glob, attr, None) or {}).values()]


def _check_hooks(module: nn.Module) -> None:
    """A hook of `module` or a submodule (forward, forward pre-, backward, backward pre-), or one
    of torch's global module hooks (`register_module_forward_hook`, ..., which run for apply's copy
    too), that holds `module`, one of its submodules, parameters or buffers is refused with a
    `ConfigError` naming the hook's module, the hook and what it holds. `copy.deepcopy` leaves a
    function as it is (and copies no global hook), so apply's copy ran the hook on the original
    objects: a parameter read there never got a gradient and every leaf drifted from torch's, with
    no error (found in review). What deepcopy does rebind is fine: a module hook's bound method's
    `self`, a callable object, a `functools.partial`'s arguments but a parameter (which becomes a
    stand-in nothing binds). A global hook that holds no part of the module is fine. One pass over
    the modules; the tables of what to look for are made only where a hook is found."""
    hooked = [(name, m, kind, hook) for name, m in module.named_modules() for attr, kind in _HOOKS
              for hook in getattr(m, attr, {}).values()]
    global_hooks = _global_hooks()
    if not hooked and not global_hooks:
        return
    held: dict[int, str] = {id(m): f"submodule {n!r}" if n else "the module itself" for n, m in module.named_modules()}
    held.update({id(b): f"buffer {n!r}" for n, b in module.named_buffers()})
    params = {id(p): f"parameter {n!r}" for n, p in module.named_parameters()}
    held.update(params)
    for name, m, kind, hook in hooked:
        found = _held_by(_carried(hook), held, params)
        if found is not None:
            where = f"submodule {name!r} ({type(m).__name__})" if name else f"the module ({type(m).__name__})"
            raise _hook_error(f"the {kind} {_qualname(hook)!r} of {where}", *found)
    for how, hook in global_hooks:  # not copied at all: a bound method's self and a callable object are the originals
        own = getattr(hook, "__self__", None) if isinstance(hook, types.MethodType) else (
            hook if not isinstance(hook, (types.FunctionType, functools.partial)) else None)
        carried = _carried(hook) + ([("self", own), *_attributes("self", own)] if own is not None else [])
        found = _held_by([(h.replace("partial arguments", "partial's arguments", 1), o) for h, o in carried],
                         held, params)
        if found is not None:
            raise _hook_error(f"the global module hook {_qualname(hook)!r} (torch.nn.modules.module.{how})", *found)


def _held_by(carried: list[tuple[str, Any]], held: Mapping[int, str], params: Mapping[int, str]
             ) -> tuple[str, str] | None:
    """`(what, how)` of the first part of the module among `carried` (`_carried`): any part, or a
    parameter where deepcopy copies the object (`partial arguments`); None where none is."""
    for how, obj in carried:
        what = (params if how.startswith("partial arguments") else held).get(id(obj))
        if what is not None:
            return what, how
    return None


def _qualname(hook: Any) -> str:
    return (getattr(hook, "__qualname__", None) or getattr(getattr(hook, "func", None), "__qualname__", None)
            or type(hook).__name__)


def _hook_error(which: str, what: str, how: str) -> ConfigError:
    """The refusal of hook `which` holding `what` (in its `how`). It holds the original object,
    which apply's copy cannot rebind: true whether the hook reads that object's tensors (then they
    are not the trained values and get no gradient) or only keys or names by it (activation
    capture, where the key would not be the copy's either; found in review: the message said the
    hook read tensors where it only keyed by the module)."""
    return ConfigError(
        f"from_module: {which} holds {what} (in its {how}): the original object, which apply's copy of the "
        f"module cannot rebind (copy.deepcopy keeps a function as it is), so where the hook reads that object's "
        f"tensors they are the original module's, never the values being trained, and get no gradient, silently "
        f"(and a dict keyed by it never sees the copy's modules). Read what it needs through the hook's module "
        f"argument (lambda mod, args, out: out * mod.scale, with the parameter on the module the hook is "
        f"registered on), or make the hook a method of a submodule that holds it (m.scaler.hook: deepcopy rebinds "
        f"a bound method's self). To capture activations, key them by name: for n, m in model.named_modules(): "
        f"m.register_forward_hook(lambda mod, i, o, n=n: acts.__setitem__(n, o))")


def _global_names(code: types.CodeType, depth: int = 0) -> list[str]:
    """The global names `code` loads (`LOAD_GLOBAL` / `LOAD_NAME`), and those of the code nested in
    it (a lambda or def inside the hook, a comprehension before Python 3.12), 3 deep. Not
    `co_names`, which also lists attribute names: a hook reading `mod.fc` was refused as holding a
    module-level `fc` (found in review), while a nested lambda's globals were never looked at
    (found in review: `lambda: gm[2].weight.sum()` inside a hook was accepted)."""
    names = list(dict.fromkeys(i.argval for i in dis.get_instructions(code)
                               if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")))
    if depth < 3:
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                names += [n for n in _global_names(c, depth + 1) if n not in names]
    return names


_OPAQUE = (nn.Module, torch.Tensor, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
           types.MethodType, functools.partial)
_ATTRIBUTES_READ = 64  # of one held object: the check stays cheap on an object of many attributes


def _attributes(how: str, obj: Any) -> list[tuple[str, Any]]:
    """`(where, value)` of the first `_ATTRIBUTES_READ` attributes (`vars`) of a plain object a
    hook holds (where: `how` and the attribute's name), one level: a trainer whose `.model` is the
    module (found in review: accepted, and the hook read the untrained original). None of a
    module, tensor, function, type or Python module, or of an object without a `__dict__`."""
    if isinstance(obj, _OPAQUE):
        return []
    try:
        attrs = vars(obj)
    except Exception:  # no `__dict__` (slots, a C object), or a proxy whose lookup raises: not looked into
        return []
    if not isinstance(attrs, dict):
        return []
    return [(f"{how}, as attribute {k!r} of a {type(obj).__name__}", v)
            for _, (k, v) in zip(range(_ATTRIBUTES_READ), attrs.items())]


def _carried(hook: Any, depth: int = 0) -> list[tuple[str, Any]]:
    """`(where, object)` for what a hook holds that copy.deepcopy leaves pointing at the original:
    a function's closure cells, defaults, keyword defaults and the globals its code loads
    (`_global_names`, nested code included) (one level into a list, tuple, dict or a plain
    object's attributes, `_attributes`; into a held function or bound method, self included, 3
    deep); a `functools.partial`'s arguments (deepcopy copies them: a parameter among them becomes
    a stand-in) and its function; the hook's own bound method's function (deepcopy rebinds its
    `self`). A callable object is deep-copied: nothing."""
    if depth > 3:
        return []
    found: list[tuple[str, Any]] = []
    if isinstance(hook, functools.partial):
        found = [("partial arguments", a) for a in (*hook.args, *hook.keywords.values())]
        hook = hook.func
    fn = getattr(hook, "__func__", hook)
    code = getattr(fn, "__code__", None)
    if isinstance(code, types.CodeType):
        for cell in getattr(fn, "__closure__", None) or ():
            try:
                found.append(("closure", cell.cell_contents))
            except ValueError:  # an empty cell
                pass
        found += [("defaults", d) for d in getattr(fn, "__defaults__", None) or ()]
        found += [("keyword defaults", d) for d in (getattr(fn, "__kwdefaults__", None) or {}).values()]
        glob = getattr(fn, "__globals__", None) or {}
        found += [("globals", glob[n]) for n in _global_names(code) if n in glob]
    out = []
    for how, obj in found:
        out.append((how, obj))
        if isinstance(obj, (list, tuple)):
            out += [(how, x) for x in obj]
        elif isinstance(obj, dict):
            out += [(how, x) for x in obj.values()]
        elif how != "globals" and (hasattr(obj, "__code__") or isinstance(obj, functools.partial)):
            if isinstance(obj, types.MethodType):  # a held bound method keeps its original self
                out.append((how, obj.__self__))
            out += _carried(obj, depth + 1)
        else:
            out += _attributes(how, obj)
    return out


class _Setting:
    """One `Apply.train(mode)` call's setting, or the flags the module came with (`given`, one per
    submodule in `modules()` order, mixed or not: a BatchNorm set to eval before `from_module`).
    A module copy records the setting it holds (`put`), so `_in_mode` sets it again only where the
    caller's setting is another one. Deep-copied as itself: a thread's copy of the skeleton keeps
    the record, as it keeps the flags."""

    __slots__ = ("training", "given")

    def __init__(self, training: bool, given: tuple[bool, ...] | None = None) -> None:
        self.training, self.given = training, given

    def __deepcopy__(self, memo: dict) -> _Setting:
        return self

    def put(self, module: nn.Module) -> None:
        """Give `module` (a copy of the skeleton) this setting's flags, and record it."""
        if self.given is None:
            module.train(self.training)
        else:
            for m, flag in zip(module.modules(), self.given):
                m.training = flag
        module.__dict__["_fzero_setting"] = self


class _Modes:
    """The training mode `apply` runs in: the process's (`shared`: the flags the module came with,
    until `Apply.train` sets one outside a `SimMesh` rank, every rank's), and, on a `SimMesh`, a
    rank's own where that rank set one (`ranks`: per mesh, held weakly, so a freed mesh's go with
    it), as each process of a `DistMesh` keeps its own. Found in review: a rank's
    `apply.eval()` / `apply.train()` set every rank's copies, and rank 0, past a collective first,
    switched back to training before rank 1's evaluation ran, with dropout on, silently; then,
    with a mode per rank compared by the root's flag only, a rank that set none ran with every
    submodule training (a frozen BatchNorm updated its statistics), a rank's `apply.train()` left
    a frozen submodule frozen where a process's unfroze it, and a new mesh at a freed mesh's
    address (`id`) took its ranks' modes."""

    def __init__(self, skeleton: nn.Module) -> None:
        self.shared = _Setting(skeleton.training, tuple(m.training for m in skeleton.modules()))
        skeleton.__dict__["_fzero_setting"] = self.shared
        self.ranks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # SimMesh -> {rank: _Setting}

    def set(self, mode: bool) -> bool:
        """Set the mode of the caller (its rank on a SimMesh, else every rank's); whether it was
        set for every rank."""
        rank = simmesh_rank()
        if rank is not None:
            self.ranks.setdefault(rank[0], {})[rank[1]] = _Setting(mode)
            return False
        self.shared = _Setting(mode)
        self.ranks.clear()
        return True

    def now(self) -> _Setting:
        """The setting the caller runs in."""
        if not self.ranks:
            return self.shared
        rank = simmesh_rank()
        if rank is None:
            return self.shared
        return self.ranks.get(rank[0], {}).get(rank[1], self.shared)


def _in_mode(module: nn.Module, modes: _Modes) -> nn.Module:
    """`module` (the skeleton, or a thread's copy of it) with the caller's setting (`_Modes.now`),
    put where it holds another (one dict read a call where it holds the caller's)."""
    setting = modes.now()
    if module.__dict__.get("_fzero_setting") is not setting:
        setting.put(module)
    return module


class Apply:
    """`from_module`'s `apply(params, *args, **kwargs) -> module(*args, **kwargs)`, and, as an
    `nn.Module` has, its training mode: `train(mode=True)`, `eval()` and `training`.

    `apply` runs a parameter-free copy of the module made by `from_module`, so `model.eval()`
    after `from_module` does not reach it: call `apply.eval()` (dropout off, BatchNorm reading
    and not updating its running statistics) before evaluating, and `apply.train()` before
    training again. Like `nn.Module.train`, it sets every submodule's flag; the flags start as
    the module's were when `from_module` was called. Called on a `SimMesh` rank (inside
    `mesh.run`), it sets that rank's mode only, as in a process of a `DistMesh`; outside, every
    rank's (`_Modes`). A rank that set no mode runs with the flags the module came with (a
    submodule set to eval before `from_module`, a frozen BatchNorm, stays so) or the last ones set
    outside; `train()` / `eval()` on a rank set every submodule's flag, as outside."""

    def __init__(self, call: Callable[..., Any], skeleton: nn.Module, copies: weakref.WeakSet,
                 buffers: Mapping[str, torch.Tensor], modes: _Modes) -> None:
        self._call, self._skeleton, self._copies = call, skeleton, copies  # copies: per thread, freed with it
        self._modes = modes
        self._buffers = buffers  # `ModuleInfo.buffers` itself: the dtypes a call's note names are the current ones
        self.__doc__ = call.__doc__

    def __call__(self, params: dict[str, torch.Tensor] | LazyParams, *args: Any, **kwargs: Any) -> Any:
        try:
            return self._call(params, *args, **kwargs)
        except RuntimeError as e:  # (the notes are made here, on the error path only)
            for note in (buffer_dtype_note(said(e), self._buffers, param_dtypes(params)),
                         captured_write_note(said(e), self._skeleton, self._buffers)):
                if note:
                    e.add_note(note)
            raise

    def train(self, mode: bool = True) -> Apply:
        """Set the training mode of every submodule, as `nn.Module.train(mode)`; returns `self`."""
        if not isinstance(mode, bool):
            raise ConfigError(f"apply.train(mode): mode must be a bool, got {type(mode).__name__} {mode!r}")
        if self._modes.set(mode):  # every rank's: each copy now; a rank's own: its copies as it runs them
            for m in (self._skeleton, *self._copies):
                self._modes.shared.put(m)
        return self

    def eval(self) -> Apply:
        """`train(False)`, as `nn.Module.eval()`; returns `self`."""
        return self.train(False)

    @property
    def training(self) -> bool:
        """The caller's training mode (its rank's, on a `SimMesh`), as `nn.Module.training`."""
        return self._modes.now().training

    def __repr__(self) -> str:
        return f"<fzero apply of {type(self._skeleton).__name__}, training={self.training}>"


_DTYPE_WORDS = ("scalar type", "dtype")  # torch's words for operands of different dtypes


def buffer_dtype_note(message: str, buffers: Mapping[str, torch.Tensor], params: Collection[torch.dtype]) -> str:
    """The note `apply` adds to a torch error about dtypes where a floating buffer of the module
    is in none of the floating dtypes its `params` (dtypes, `param_dtypes`) reach it in: a precision
    policy (`fzero.Precision`) casts the params to its compute dtype, not the buffers, so a module
    that mixes the two (BatchNorm's running statistics beside its bf16 weight) meets torch's
    "expected scalar type BFloat16 but found Float", which names neither (found in review). ""
    where the message is not about dtypes, or every floating buffer has a dtype of the params (an
    input of another dtype is no buffer's doing: found in review)."""
    floating = {d for d in params if d.is_floating_point}
    odd = {name: b.dtype for name, b in buffers.items() if b.is_floating_point() and b.dtype not in floating}
    if not floating or not odd or not any(w in message.lower() for w in _DTYPE_WORDS):
        return ""
    shown = ", ".join(f"{name} {str(d).removeprefix('torch.')}" for name, d in list(odd.items())[:4])
    more = f" and {len(odd) - 4} more" if len(odd) > 4 else ""
    dtypes = sorted(map(str, floating))
    to = dtypes[0] if len(dtypes) == 1 else "dtype"
    held = dtypes[0] if len(dtypes) == 1 else f"one of {', '.join(dtypes)}"
    return (f"{BUFFER_NOTE} {held}, but not its buffers {shown}{more} (a precision policy "
            f"casts the params to its compute dtype, not the module's buffers); where the module reads both in one "
            f"op, cast its floating buffers to the params' dtype before from_module (for m in model.modules(): for n, "
            f"b in m.named_buffers(recurse=False): setattr(m, n, b.to({to})) where b.is_floating_point()), or compute "
            f"under torch.autocast with fp32 params instead")


# functorch's words where a grad transform meets an in-place write to a tensor it did not get as an
# input (`checkForInvalidMutationOnCaptures`, aten/src/ATen/functorch/ADInterpreters.cpp, torch 2.13:
# "... attempted to call in-place operation (aten::add_.Tensor) that would mutate a captured Tensor.")
_CAPTURED_WRITE = "mutate a captured tensor"


def captured_write_note(message: str, module: nn.Module, buffers: Mapping[str, torch.Tensor]) -> str:
    """The note `apply` adds to functorch's "would mutate a captured Tensor" error: under a
    `torch.func` transform (`train_step(..., engine="func")`) a forward that writes a tensor in
    place, which a training-mode BatchNorm does to its running statistics, is refused with torch's
    words alone, naming neither the buffers nor the way out (found in review). Names the buffers
    `module` (the skeleton, in its current training mode) writes in its forward where that is known
    (`training_writes`), else the buffers it holds; "" where the message is another."""
    if _CAPTURED_WRITE not in message.lower():
        return ""
    written = training_writes(module)
    way_out = ("use train_step(..., engine='autograd') (the default), where the forward updates the buffers in place "
               "as model(x) would")
    if written:
        return (f"fzero: under a torch.func transform (train_step's engine='func', or torch.func.grad/vjp around "
                f"apply) the forward may not write a tensor in place that the transform did not get as an input, "
                f"and this module's training-mode forward writes its buffers {_listed(written)}; {way_out}, or call "
                f"apply.eval() first if the forward should read them without updating them (BatchNorm then "
                f"normalizes with its running statistics)")
    held = f"; the module holds buffers {_listed(list(buffers))}, which a forward may write" if buffers else ""
    return (f"fzero: under a torch.func transform (train_step's engine='func', or torch.func.grad/vjp around apply) "
            f"the forward wrote in place to a tensor the transform did not get as an input (a buffer, a batch "
            f"tensor, a tensor the model closes over){held}; {way_out}, or make the write out of place")


def _listed(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:6])
    return f"{shown} and {len(names) - 6} more" if len(names) > 6 else shown


def training_writes(module: nn.Module) -> list[str]:
    """The buffers of `module` its forward writes in place, in the training mode it is in now,
    where torch's own modules say so: a norm layer that tracks running statistics in training mode
    (BatchNorm*, SyncBatchNorm, InstanceNorm* with `track_running_stats=True`) writes
    `running_mean`, `running_var` and `num_batches_tracked`. A module's own forward is not read:
    its writes are not known here. (Spectral norm's power iteration writes its `_u` / `_v` through
    `out=`, which functorch lets pass: not listed.)"""
    written = []
    for name, m in module.named_modules():
        if m.training and getattr(m, "track_running_stats", False) is True:
            written += [f"{name}.{a}" if name else a for a in ("running_mean", "running_var", "num_batches_tracked")
                        if m._buffers.get(a) is not None]
    return written


def param_dtypes(params: Any) -> set[torch.dtype]:
    """The dtypes of the leaves `apply` received, gathering nothing: a `LazyParams` hands each
    leaf in its bucket's compute dtype (`Wire.compute`: the precision policy's), or in the dtype
    `cast_ahead` casts it to; a mapping's values answer their own (an on-use placeholder's
    metadata is its leaf's)."""
    if isinstance(params, LazyParams):
        return params.dtypes
    if isinstance(params, Mapping):
        return {v.dtype for v in params.values() if isinstance(v, torch.Tensor)}
    return set()


def _home(names: list[str]) -> str:
    """The deepest submodule path that holds every parameter name in `names` ("" = the root)."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if any(p != level[0] for p in level):
            break
        common.append(level[0])
    return ".".join(common)


def _runs_forward(module: nn.Module) -> bool:
    """False for containers (ModuleList, ModuleDict) whose forward is never called."""
    return type(module).forward is not nn.Module.forward


class _Running(threading.local):
    """Of the calls running on this thread: `.unbound` {id(placeholder): (alias, unit, the skeleton
    copy holding it)} (the dict path: every placeholder; inside another apply, merged with that
    call's, `_merged`), `.root` the skeleton copy the innermost call runs; None outside a call;
    `.recomputing` the checkpointed unit whose recompute in backward runs, where `.unbound` is set
    for it after `apply` returned (`_checkpointed`), else None; `.remat` the checkpointed units of
    the innermost call (for `_unbound_error`'s words).
    All are set on every thread as it first reads them: a compiled loss over `apply` traces their
    reads, and an attribute missing on the first call and present after (`getattr(..., None)`)
    made dynamo guard on `hasattr` and compile the loss again at the second step (found in review)."""

    def __init__(self) -> None:
        self.unbound: dict[int, tuple[str, str, nn.Module | None]] | None = None
        self.root: nn.Module | None = None
        self.recomputing: str | None = None
        self.remat: frozenset[str] = frozenset()


_RUNNING = _Running()
_METADATA = frozenset({torch.Tensor.dtype.__get__, torch.Tensor.shape.__get__, torch.Tensor.ndim.__get__,
                       torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__, torch.Tensor.size,
                       torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
                       torch.Tensor.is_complex, torch.Tensor.element_size})


class _Unbound(nn.Parameter):
    """A skeleton's stand-in for a parameter its unit has not bound (a meta tensor): while `apply`
    runs, a torch function on it other than reading its dtype or shape raises `ConfigError`. That
    is code outside the forward of the submodule the unit is bound in reading the parameter (a
    parent's tied head `F.linear(h, self.emb.weight)`, `device=self.pos.weight.device`): before,
    it got the meta tensor, and torch's CPU matrix product over a meta operand returns
    uninitialised memory, a silently wrong loss (found in review). Or it is a stand-in that
    `copy.deepcopy` put where the module also holds the parameter outside `_parameters` (`self._refs
    = [self.w2]`), which no path rebinds: the dict path (`gather="eager"`, `fzero.gather`'s
    output) got the meta tensor there too (found in review); the error then names where it is
    held (`_held_elsewhere`), and not `gather="eager"`. Outside every `apply`, a use in backward is a
    recompute of the forward after `apply` returned (`torch.utils.checkpoint` around a submodule):
    `ConfigError` naming the parameter (`alias`, kept by `copy.deepcopy`) and `remat`; before, torch's
    "Tensor on device meta" (found in review)."""

    alias: str

    @classmethod
    def standing_for(cls, p: torch.Tensor, alias: str) -> _Unbound:
        """The stand-in for parameter `p`, registered as `alias`."""
        stand_in = cls(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
        stand_in.alias = alias
        return stand_in

    def __deepcopy__(self, memo: dict) -> _Unbound:
        if id(self) not in memo:
            memo[id(self)] = type(self).standing_for(self, self.alias)
        return memo[id(self)]

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unbound = _RUNNING.unbound
        if func not in _METADATA and not _dynamo_probing():
            if unbound:
                for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                    if id(t) in unbound:
                        raise _unbound_error(t, *unbound[id(t)], func)
            elif in_backward():
                for t in torch.utils._pytree.tree_leaves((args, kwargs)):
                    if isinstance(t, _Unbound):
                        raise _recomputed_error(t, func)
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs or {})  # as nn.Parameter's


def _dynamo_probing() -> bool:
    """Whether dynamo, tracing a compiled loss, reads a tensor's metadata itself (`.is_nested`, as it
    wraps a stand-in the traced forward reached): a call in real Python while a compilation is under
    way (`is_compiling()`, set for its duration). `_Unbound` lets those through; the traced forward's
    own use of the stand-in is checked where it runs: in traced code dynamo folds
    `is_dynamo_compiling()` to True, so this is False there and the check is traced, whose
    `ConfigError` dynamo hands on by running the frame eager. Before, the probe raised inside
    dynamo: `InternalTorchDynamoError` naming `.is_nested`, not a `ConfigError` (found in review)."""
    return torch.compiler.is_compiling() and not torch.compiler.is_dynamo_compiling()


def _merged(outer: dict[int, tuple[str, str, nn.Module]], inner: dict[int, tuple[str, str, nn.Module]]
            ) -> dict[int, tuple[str, str, nn.Module]]:
    """The stand-ins checked while an `apply` runs inside another's forward (a second
    `from_module`'d model called from the first's, with a plain dict or on use): the inner call's
    and still the outer call's, so an outer parameter read while its unit is unbound (passed into
    the inner call as an argument) raises as it did outside it. The inner table alone let it
    through: a loss from a meta operand, no error (found in review). Made only when nested: the
    single call keeps its own table."""
    return {**outer, **inner}


def _unbound_error(t: torch.Tensor, alias: str, unit: str, root: nn.Module | None, func: Any) -> ConfigError:
    """The error for placeholder `t` of parameter `alias` (unit `unit`) of skeleton copy `root` (the
    one whose call's table holds it) used by `func`: read by `get_extra_state` with no params bound
    where `root` is None (`extra_states_unbound`); held outside `_parameters` where `root` holds it
    so, or where its slot holds a bound leaf now (the dict path binds every slot), else read outside
    its unit's home submodule."""
    if root is None:
        return ConfigError(
            f"parameter {alias!r} was read ({_op_name(func)}) by a get_extra_state called without params "
            f"(info.extra_state()): from_module's copy of the module holds a meta stand-in for it, never the "
            f"trained values; pass the params, info.extra_state(fzero.gather(state)) (ModuleInfo.state_dict "
            f"passes its own)")
    held = _held_elsewhere(root, t)
    if held or _slot(root, alias) is not t:
        shape = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
        where = (" and ".join(repr(h) for h in held[:3]) + (f" and {len(held) - 3} more" if len(held) > 3 else "")
                 if held else "an attribute of a submodule or of an object it holds")
        return ConfigError(
            f"parameter {alias!r} ({shape}) is also held outside the module's registered parameters, as {where} "
            f"(a list, dict or plain attribute), and the forward used it ({_op_name(func)}): from_module's apply "
            f"runs a copy of the module whose parameters it binds in their registered slots only, so that copy "
            f"holds a meta stand-in there, never the values being trained. In the forward, read it through its module "
            f"attribute (the name {alias!r} registers), or register the container (nn.ParameterList, "
            f"nn.ParameterDict)")
    if _RUNNING.recomputing is not None:
        return ConfigError(
            f"parameter {alias!r} (unit {unit!r}) was used ({_op_name(func)}) by the recompute in backward of "
            f"checkpointed unit {_RUNNING.recomputing!r} (from_module(remat=...)), after apply returned: the "
            f"recompute binds that unit's leaves only, so it reads a meta stand-in for {alias!r}, not the values "
            f"being trained (its forward reached the parameter without its own module holding it: through a plain "
            f"attribute). Leave unit {_RUNNING.recomputing!r} out of remat (remat=[...] naming the others)")
    if unit in _RUNNING.remat:  # (found in review: old-style spectral_norm's pre-hook under remat=True, whose
        # words named neither remat nor a way out that keeps it)
        return ConfigError(
            f"parameter {alias!r} (unit {unit!r}) was used ({_op_name(func)}) outside the forward of the "
            f"submodule unit {unit!r} is bound in, which is checkpointed (from_module(remat=...)): a checkpointed "
            f"unit's parameters are bound only inside that forward, where its recompute in backward runs too, and "
            f"this read ran outside it: in a forward pre-hook or forward hook on the submodule (old-style "
            f"nn.utils.spectral_norm / weight_norm compute the weight in a pre-hook) or in a parent's forward. "
            f"Leave {unit!r} out of remat "
            f"(remat=[...] naming the others), or use torch.nn.utils.parametrizations.spectral_norm / "
            f"weight_norm, which compute it inside the forward")
    return ConfigError(
        f"parameter {alias!r} (unit {unit!r}) was used ({_op_name(func)}) outside the "
        f"forward of the submodule its unit is bound in, where from_module's apply holds a meta "
        f"stand-in for it (gather='on_use' binds a unit only while its home submodule runs). Read it "
        f"inside that submodule, put it in a unit whose home runs around the read (units=..., e.g. "
        f"the parent's), or use train_step(gather='eager')")


def _recomputed_error(t: _Unbound, func: Any) -> ConfigError:
    """The error for stand-in `t` used in backward with no `apply` running: a recompute of the
    forward (torch.utils.checkpoint's) after `apply` returned, or a module's backward hook reading
    its parameter (before, the hook got the meta stand-in's device and no grad; found in review)."""
    shape = f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
    return ConfigError(
        f"parameter {t.alias!r} ({shape}) was used ({_op_name(func)}) in backward, after from_module's apply "
        f"returned: by a recompute of the forward (torch.utils.checkpoint around a submodule?) or by a backward "
        f"hook reading it from the module. apply binds the parameters only while it runs, so after it "
        f"from_module's copy of the module holds a meta stand-in there, never the values being trained. For "
        f"activation checkpointing use fzero's own: from_module(model, remat=[...]) naming the units to recompute "
        f"(it binds their parameters again in backward), with the submodule called directly in the forward; a "
        f"backward hook reads the gradients it is given, not the module's parameters")


_REGISTERED = frozenset({"_parameters", "_buffers", "_modules"})


def _held_elsewhere(root: nn.Module, t: torch.Tensor) -> list[str]:
    """Where the submodules of `root` hold `t` outside their registered slots: `'path.attr'`,
    `'path.attr[i]'` or `"path.attr['key']"` (one level into a list, tuple or dict). An RNN's
    `_flat_weights`, which its forward refreshes from the slots, is not such a place. Read on the
    error path only."""
    found = []
    for name, m in root.named_modules():
        for attr, v in vars(m).items():
            if attr in _REGISTERED or (attr == "_flat_weights" and isinstance(m, nn.RNNBase)):
                continue
            at = f"{name}.{attr}" if name else attr
            if v is t:
                found.append(at)
            elif isinstance(v, (list, tuple)):
                found += [f"{at}[{k}]" for k, x in enumerate(v) if x is t]
            elif isinstance(v, dict):
                found += [f"{at}[{k!r}]" for k, x in v.items() if x is t]
    return found


def _slot(root: nn.Module, alias: str) -> Any:
    """What `root` holds in the registered slot of parameter `alias` now (None where it has none)."""
    path, _, attr = alias.rpartition(".")
    try:
        return root.get_submodule(path)._parameters.get(attr)
    except AttributeError:
        return None


def _op_name(func: Any) -> str:
    """A torch function as a user wrote it: `.device` for an attribute read, else its name."""
    name = getattr(func, "__name__", repr(func))
    owner = getattr(func, "__self__", None)
    return f".{owner.__name__}" if name == "__get__" and hasattr(owner, "__name__") else name


class _Binding(NamedTuple):
    """One alias of a parameter in a skeleton copy: the module reads it as `owner._parameters[attr]`;
    `name` is its params name (its distinct leaf), `placeholder` the skeleton's meta Parameter
    that is put back after use."""

    owner: nn.Module
    attr: str
    name: str
    placeholder: torch.Tensor


class _UnitBinding(NamedTuple):
    """Every alias of one unit's parameters (`bindings`) and its distinct params `names`.
    `caches`: the owners that also keep their params outside `_parameters` (`nn.RNNBase`'s
    `_flat_weights`, which its forward refreshes and a write to `_parameters` does not): unbinding
    refreshes it to the placeholders, else the leaves left there would keep the unit gathered
    after its use (`Gathering._referenced`)."""

    unit: str
    bindings: tuple[_Binding, ...]
    names: tuple[str, ...]
    caches: tuple[nn.Module, ...] = ()

    def bind(self, leaves: Mapping[str, torch.Tensor]) -> None:
        """Write each alias's leaf where the module reads it (what torch's `swap_tensor` does, minus
        its per-call checks: the plan checked once that each alias is a parameter slot)."""
        for b in self.bindings:
            b.owner._parameters[b.attr] = leaves[b.name]

    def unbind(self) -> None:
        for b in self.bindings:
            b.owner._parameters[b.attr] = b.placeholder
        for owner in self.caches:  # (not `_init_flat_weights`, which reads the placeholders' device)
            owner._flat_weights = [owner._parameters.get(name) for name in owner._flat_weights_names]


class _Plan(NamedTuple):
    """How one skeleton copy binds the units of one unit map, built once per (copy, map).

    Attributes:
      unit_map: `{params name: unit}` the plan was built for (`LazyParams.unit_map`).
      root: units without a home submodule that runs a forward: read and bound before the call.
      hooked: `{home submodule: its units}`: read and bound in the submodule's forward pre-hook,
        unbound and released in its forward hook.
      checkpointed: `{home submodule: its unit}` for the units in `remat`: the submodule's forward
        runs through `_checkpointed`.
      remat: those units' names (what `_RUNNING.remat` holds while a call runs).
    """

    unit_map: Mapping[str, str]
    root: tuple[_UnitBinding, ...]
    hooked: dict[nn.Module, tuple[_UnitBinding, ...]]
    checkpointed: dict[nn.Module, _UnitBinding]
    unbound: dict[int, tuple[str, str, nn.Module]]  # id(placeholder) -> (alias, unit, its root): what `_Unbound` names
    remat: frozenset[str] = frozenset()


def _plan(skeleton: nn.Module, aliases: dict[str, tuple[str, ...]], unit_map: Mapping[str, str],
          remat: frozenset[str]) -> _Plan:
    """Each unit's home (the deepest submodule holding all its aliases that runs a forward; the
    root if none) and, per alias, the module and attribute it is bound to."""
    by_unit: dict[str, list[str]] = {}
    for name in aliases:
        by_unit.setdefault(unit_map[name], []).append(name)
    root: list[_UnitBinding] = []
    hooked: dict[nn.Module, list[_UnitBinding]] = {}
    checkpointed: dict[nn.Module, _UnitBinding] = {}
    unbound: dict[int, tuple[str, str, nn.Module]] = {}
    for unit, names in by_unit.items():
        home = _home([alias for name in names for alias in aliases[name]])
        if home and not _runs_forward(skeleton.get_submodule(home)):
            home = ""  # e.g. a weight tied across blocks: its home is the ModuleList, which never runs
        bindings = tuple(_binding(skeleton, alias, name) for name in names for alias in aliases[name])
        caches = tuple({id(b.owner): b.owner for b in bindings if isinstance(b.owner, nn.RNNBase)}.values())
        binding = _UnitBinding(unit, bindings, tuple(names), caches)
        for b in bindings:  # a loop, not a dict comprehension: torch.compile, tracing a compiled loss into
            # the plan, failed inside one holding the module ("NameError: ___tuple_iterator_getitem", torch 2.13)
            unbound[id(b.placeholder)] = (b.name, unit, skeleton)
        module = skeleton.get_submodule(home) if home else skeleton
        if not home:
            root.append(binding)
        elif unit in remat:
            checkpointed[module] = binding
        else:
            hooked.setdefault(module, []).append(binding)
    return _Plan(unit_map, tuple(root), {m: tuple(u) for m, u in hooked.items()}, checkpointed, unbound,
                 frozenset(b.unit for b in checkpointed.values()))


def _binding(skeleton: nn.Module, alias: str, name: str) -> _Binding:
    path, _, attr = alias.rpartition(".")
    owner = skeleton.get_submodule(path)
    if attr not in owner._parameters:
        raise FzeroError(f"from_module: parameter {alias!r} is not in {type(owner).__name__}._parameters of the "
                         f"module's copy; was the module changed after from_module? Call from_module again")
    return _Binding(owner, attr, name, owner._parameters[attr])


class _Call(NamedTuple):
    """One `apply` running in a skeleton copy: its params, its plan, the hooked units bound now
    (innermost last) and the root units bound before the forward."""

    params: LazyParams
    plan: _Plan
    bound: list[_UnitBinding]
    roots: list[_UnitBinding]


class _Skeleton:
    """One thread's copy of the skeleton, bound unit by unit as its submodules run (`enter`, the
    forward, `leave`; `apply` calls the three).

    The forward pre-hook and forward hook of each home submodule are registered once, on first
    use, and stay: they act on the running call (`call`; outside a call they do nothing), so a
    step registers no hook. A checkpointed unit's home gets an instance `forward` once, which
    runs `_checkpointed` while a call's plan says so and the class's forward otherwise. The plan
    is cached for the last unit map seen (each step's `LazyParams` carry the same map object).
    At most one call runs in a copy at a time: `apply` inside `apply` uses the next copy."""

    def __init__(self, module: nn.Module, aliases: dict[str, tuple[str, ...]], remat: frozenset[str]) -> None:
        self.module, self.aliases, self.remat = module, aliases, remat
        self.plan: _Plan | None = None
        self.call: _Call | None = None
        self._hooked: set[nn.Module] = set()
        self._patched: set[nn.Module] = set()
        self._buffers = slots_of(module)

    def plan_for(self, unit_map: Mapping[str, str]) -> _Plan:
        plan = self.plan
        if plan is not None and (plan.unit_map is unit_map or plan.unit_map == unit_map):
            return plan
        plan = _plan(self.module, self.aliases, unit_map, self.remat)
        for module in plan.hooked.keys() - self._hooked:
            module.register_forward_pre_hook(self._pre, prepend=True)  # before a user's own (prune reads the weight)
            module.register_forward_hook(self._post)
            self._hooked.add(module)
        for module in plan.checkpointed.keys() - self._patched:  # nn.Module reads `forward` before its hooks run
            module.forward = functools.partial(self._forward, module)
            self._patched.add(module)
        self.plan = plan
        return plan

    def enter(self, params: LazyParams, modes: _Modes) -> tuple:
        """Start a call: the caller's training mode set (`_in_mode`), the root units read and
        bound, the stand-ins checked (`_RUNNING`); returns what `leave` puts back. The module's
        forward runs between the two (`apply`), its home submodules' hooks binding the rest."""
        _in_mode(self.module, modes)
        plan = self.plan_for(params.unit_map)
        roots: list[_UnitBinding] = []
        try:
            for binding in plan.root:  # nothing is read before the plan is ready: the reads launch back to back
                binding.bind(params.unit(binding.unit))
                roots.append(binding)  # bound: put back, also where a later root unit's read raises
        except BaseException:
            for binding in roots:
                binding.unbind()
            raise
        self.call = _Call(params, plan, [], roots)
        outer = (_RUNNING.unbound, _RUNNING.root, _RUNNING.remat)
        _RUNNING.unbound = plan.unbound if outer[0] is None else _merged(outer[0], plan.unbound)
        _RUNNING.root = self.module
        _RUNNING.remat = plan.remat
        return outer

    def leave(self, outer: tuple) -> None:
        """End the call `enter` started (returning or raising): the placeholders put back where
        units are bound (a forward that raised inside a unit), the buffers put back in their slots
        (their new values kept by the root's hook)."""
        _RUNNING.unbound, _RUNNING.root, _RUNNING.remat = outer
        call, self.call = self.call, None
        if call is None:
            return
        bound = call.bound
        while bound:  # a forward that raised inside a unit: put the placeholders back
            bound.pop().unbind()
        for binding in call.roots:
            binding.unbind()
        for module, attr, buffer, _ in self._buffers:  # the buffer put back (its new value kept above)
            module._buffers[attr] = buffer

    @eager
    def _pre(self, module: nn.Module, _args: Any) -> None:
        call = self.call
        if call is None:
            return
        for binding in call.plan.hooked.get(module, ()):
            binding.bind(call.params.unit(binding.unit))  # gathers the unit on its first read this step
            call.bound.append(binding)

    @eager
    def _post(self, module: nn.Module, _args: Any, _out: Any) -> None:
        call = self.call
        if call is None:
            return
        bound = call.bound
        for binding in call.plan.hooked.get(module, ()):
            binding.unbind()
            for k in range(len(bound) - 1, -1, -1):  # the innermost entry (a child that raised may lie above)
                if bound[k] is binding:
                    del bound[k]
                    break
            call.params.release(binding.unit, _out)  # frees the gathered copy where the step allows (and `_out`
            # holds no view of it); backward re-gathers

    @eager
    def _forward(self, module: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = self.call
        binding = call.plan.checkpointed.get(module) if call is not None else None
        if binding is None:
            return type(module).forward(module, *args, **kwargs)
        return _checkpointed(module, call.params, binding, *args, **kwargs)


def _checkpointed(mod: nn.Module, params: LazyParams, binding: _UnitBinding, *args: Any, **kwargs: Any) -> Any:
    """`mod`'s forward for a checkpointed unit: read the unit (gathering it), run the forward
    through `remat_call` with the unit's parameters bound inside it (each distinct leaf one
    input, so a leaf tied within the unit gets one gradient), release the unit."""
    checked = (_RUNNING.unbound, _RUNNING.root, binding.unit)
    slots, calls = buffer_slots(mod), itertools.count()  # the buffers as the forward finds them

    def forward(bound: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        outer = (_RUNNING.unbound, _RUNNING.root, _RUNNING.recomputing)
        if outer[0] is None:  # the recompute in backward, after `apply` returned: its stand-ins stay checked
            # (one reached through a plain attribute read uninitialised memory, silently: found in review)
            _RUNNING.unbound, _RUNNING.root, _RUNNING.recomputing = checked
        binding.bind(bound)
        recompute = next(calls) > 0
        found = [m._buffers[attr] for m, attr, _, _ in slots] if recompute else []  # (read by recomputes only)
        if recompute:  # the recompute reads the tensors the forward found (which `_replayed` refilled)
            for m, attr, buffer, _ in slots:
                m._buffers[attr] = buffer
        try:
            return type(mod).forward(mod, *args, **kwargs)
        finally:
            binding.unbind()
            _RUNNING.unbound, _RUNNING.root, _RUNNING.recomputing = outer
            for (m, attr, _, _), was in zip(slots, found):  # and leaves the slots as it found them
                m._buffers[attr] = was

    out = remat_call(forward, _distinct(params.unit(binding.unit), binding.names), args, kwargs, binding.unit,
                     tuple(mod.buffers()))
    params.release(binding.unit, out)  # (no reference to the leaves left here: it would keep them gathered)
    return out


def _distinct(leaves: Mapping[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {name: leaves[name] for name in names}


def _remat_units(module: nn.Module, aliases: dict[str, list[str]], units: UnitSpec,
                 remat: bool | Collection[str]) -> frozenset[str]:
    """The units to checkpoint: `remat=True` -> every unit with a home submodule that runs a
    forward; names -> those, checked: each must be a unit, have such a home, and no other unit's
    home may lie inside it (its parameters would be read inside the checkpointed forward,
    where no graph is built)."""
    if remat is False or remat is None:
        return frozenset()
    unit_of = _unit_of(units)
    by_unit: dict[str, list[str]] = {}
    for name, names in aliases.items():
        by_unit.setdefault(unit_of(name), []).extend(names)
    homes = {}
    for unit, names in by_unit.items():
        home = _home(names)
        homes[unit] = home if home and _runs_forward(module.get_submodule(home)) else ""
    if remat is True:
        chosen = [u for u, h in homes.items() if h]
        if not chosen:  # (found in review of a stage-3 user: remat=True checkpointed nothing, without a word)
            raise ConfigError(f"remat=True checkpoints each unit whose parameters share a home submodule that runs "
                              f"a forward, and no unit here has one (units {sorted(homes)[:6]}: their parameters "
                              f"spread over the root or a container): pass units that follow the model's blocks, "
                              f"e.g. units=fzero.units_by_prefix(model, 'blocks'), or leave remat out")
    elif isinstance(remat, str) or not isinstance(remat, Collection):
        raise ConfigError(f"remat must be True, False or a collection of unit names, got {remat!r}")
    else:
        chosen = list(remat)
    for unit in chosen:
        if unit not in homes:
            raise ConfigError(f"remat names unit {unit!r}, which is not a unit of this module; its units are "
                              f"{sorted(homes)[:8]} (pass units=... to from_module to define them)")
        if not homes[unit]:
            raise ConfigError(f"remat: unit {unit!r} has no home submodule that runs a forward (its parameters "
                              f"spread over the root or a container), so there is no forward to recompute; drop it "
                              f"from remat or give it its own submodule")
        inner = [u for u, h in homes.items() if u != unit and h.startswith(homes[unit] + ".")]
        if inner:
            raise ConfigError(f"remat: unit {unit!r} (submodule {homes[unit]!r}) holds the home of unit(s) {inner}, "
                              f"whose gathers would run inside the checkpointed forward; checkpoint the inner units "
                              f"instead, or make them one unit")
    _refuse_foreign_leaves(chosen, homes, aliases, unit_of)
    return frozenset(chosen)


def _refuse_foreign_leaves(chosen: list[str], homes: dict[str, str], aliases: dict[str, list[str]],
                           unit_of: Callable[[str], str]) -> None:
    """`ConfigError` where a checkpointed unit's home submodule holds a parameter of another unit
    (a head's `decoder.weight` tied to the embedding, or a unit spec that puts a leaf of the
    submodule elsewhere): its forward reads that parameter, and the recompute in backward, which
    runs after `apply` returned, binds the checkpointed unit's leaves only, so it read the other
    unit's meta stand-in: gradients from uninitialised memory, silently (found in review). Every
    such unit at once, and the `remat=` of the others (found in review: one per error, each
    suggested list refused in turn)."""
    foreign = {}
    for unit in chosen:
        found = [(alias, first, unit_of(first)) for first, names in aliases.items() if unit_of(first) != unit
                 for alias in names if alias.startswith(homes[unit] + ".")]
        if found:
            foreign[unit] = found
    if not foreign:
        return
    rest = sorted(set(chosen) - set(foreign))
    shown = "; ".join(
        f"submodule {homes[unit]!r} of unit {unit!r} holds {alias!r}" + (f" (tied to {first!r})" if alias != first
                                                                        else "")
        + f", a leaf of unit {owner!r}" + (f", and {len(found) - 1} more" if len(found) > 1 else "")
        for unit, found in list(foreign.items())[:4] for alias, first, owner in found[:1])
    more = f"; and {len(foreign) - 4} more units" if len(foreign) > 4 else ""
    raise ConfigError(
        f"remat: {shown}{more}. A checkpointed forward reads such a parameter, but the recompute in backward binds "
        f"the checkpointed unit's own leaves only, so it would read the other unit's leaf unbound. Leave "
        f"{'that unit' if len(foreign) == 1 else 'these units'} out of remat "
        f"({f'remat={rest!r}' if rest else 'remat=False'}), or make the leaf one of the unit's (units=...), where it "
        f"can join it: same dtype and device, and every name of it inside the unit's submodule")


def _check_units(params: dict[str, torch.Tensor], units: UnitSpec, aliases: dict[str, list[str]]) -> None:
    _check_prefix_units(units, [n for names in aliases.values() for n in names])
    unit_of = _unit_of(units)
    seen: dict[str, tuple[str, torch.device, torch.dtype]] = {}
    for name, p in params.items():
        unit = unit_of(name)
        first = seen.setdefault(unit, (name, p.device, p.dtype))
        if (p.device, p.dtype) != first[1:]:
            for leaf in (first[0], name):  # an integer parameter: the way out is not another unit (found in review)
                _check_leaf(leaf, params[leaf])
            raise LayoutError(
                f"unit {unit!r} mixes parameters on different devices or dtypes: {first[0]!r} is "
                f"{first[2]} on {first[1]}, {name!r} is {p.dtype} on {p.device}; move/cast the module "
                f"(e.g. model.to(device, dtype)) or put them in different units: units go by parameter path, so "
                f"one submodule's parameters may be split, e.g. by dtype (a frozen bf16 base beside fp32 adapters): "
                f"dtypes = {{n: str(p.dtype) for n, p in model.named_parameters()}}; "
                f"units=lambda path: f'{{path.rsplit(\".\", 1)[0]}}-{{dtypes[path]}}'")


def _check_prefix_units(units: UnitSpec, names: list[str]) -> None:
    """`units_by_prefix`'s units over this module's parameter names (every name of a tied one):
    a `ConfigError` where none falls under a child of the prefix, or one falls under a child the
    units never saw -- read on another module than the one given to `from_module` (a wrapper's
    inner model, the model beside its `torch.compile`d form, a model of fewer blocks), which put
    every parameter, or the unseen blocks', in unit `rest`, silently (found in review of a
    stage-3 user)."""
    prefix, children = getattr(units, "fzero_prefix", (None, ()))
    if prefix is None or not names:
        return
    head = f"{prefix}." if prefix else ""
    under = {".".join(n.split(".")[: head.count(".") + 1]): n for n in names if n.startswith(head) and
             n.count(".") > head.count(".")}  # child path -> a parameter under it
    unseen = sorted(set(under) - set(children))
    if unseen:
        raise ConfigError(f"units=units_by_prefix(..., {prefix!r}) was read on a module whose {prefix or 'root'!r} has "
                          f"children {sorted(children)[:4]}, and this module's parameters lie under {unseen[:4]} too "
                          f"({under[unseen[0]]!r}), which it would put in unit 'default': read the prefix on the module "
                          f"given to from_module")
    if not set(under) & set(children):
        raise ConfigError(f"units=units_by_prefix(..., {prefix!r}) puts none of this module's parameters in a unit of "
                          f"its own: none of their names ({names[:4]}) lies under one of its children "
                          f"({sorted(children)[:4]}). Read the prefix on the module given to from_module (for a "
                          f"torch.compile'd model, whose names start '_orig_mod.': units_by_prefix(compiled, "
                          f"'_orig_mod.{prefix}')), or name a container whose children hold parameters")


def units_by_prefix(module: nn.Module, prefix: str, rest: str = DEFAULT_UNIT) -> Callable[[str], str]:
    """One unit per child of the container `prefix` (e.g. "transformer.h"): `path -> unit name`.

    `"transformer.h.3.attn.c_attn.weight" -> "transformer.h.3"`; every other parameter goes to
    unit `rest` (embeddings, final norm, head). `module` is the model whose submodule `prefix`
    is read (`""`: the model itself); a `prefix` it lacks, or one with no children, raises
    `FzeroError`; so does a `from_module` where no parameter falls under one of its children (the
    prefix read on another module than the one given to `from_module`: a wrapper's inner model, or
    the model beside its `torch.compile`d form, whose names start `_orig_mod.`).
    """
    if not isinstance(module, nn.Module):  # (found in review: torch's AttributeError, chained twice)
        raise FzeroError(f"units_by_prefix expects the model (an nn.Module) whose submodule {prefix!r} holds the "
                         f"units, got {type(module).__name__}")
    try:
        container = module.get_submodule(prefix)
    except AttributeError as e:
        names = [n for n, _ in module.named_modules() if n][:10]
        raise FzeroError(f"units_by_prefix: the module has no submodule {prefix!r}; some it has: {names}") from e
    children = {f"{prefix}.{name}" if prefix else name for name, child in container._modules.items()  # a child
                if child is not None}  # registered twice (a weight-shared block) under each of its names
    if not children:
        raise FzeroError(f"units_by_prefix: {prefix!r} ({type(container).__name__}) has no children")

    def unit(path: str) -> str:
        head = path.split(".")
        for k in range(len(head) - 1, 0, -1):  # the longest proper prefix that names a child
            cand = ".".join(head[:k])
            if cand in children:
                return cand
        return rest

    unit.fzero_prefix = (prefix, frozenset(children))  # type: ignore[attr-defined]  # `_check_units` reads it
    return unit


def broadcast_buffers(info: ModuleInfo, mesh: Mesh) -> None:
    """Copy rank 0's buffers into every rank's, in place (DDP's `broadcast_buffers=True`):
    the buffers of `info` (`ModuleInfo.buffers`), over `mesh`.

    Call on every rank, before the step (or the `fzero.evaluate`: DDP's eval-mode forward
    broadcasts too) whose forward should start from rank 0's buffers.
    """
    with torch.no_grad():
        for name, buf in info.buffers.items():
            buf.copy_(broadcast(buf, mesh, 0, tag=f"fzero.buffers/{name}"))
    buffers_written(mesh, "fzero.buffers/written")


def buffers_written(mesh: Mesh, tag: str) -> None:
    """Call on every rank after each wrote a module's buffers in place: where the ranks share them
    (a `SimMesh` of N > 1 ranks, threads of one process running one module), hold every rank until
    the last has written. Each rank writes in its turn, after its last collective; a rank that went
    on into its forward read the buffers, saved them for backward and updated them (BatchNorm's
    count and running statistics) with the other ranks' writes still to come, which then raised
    torch's in-place error in the backward or overwrote that update (found in review, after
    `checkpoint.load(..., buffers=)` and `broadcast_buffers`). One all-reduce of one element;
    nothing where each rank has its own buffers (one process per rank, `DistMesh`)."""
    if isinstance(mesh, SimMesh) and mesh.world_size > 1:
        mesh.collective("all_reduce", torch.zeros(1), arg="sum", tag=tag)
