"""A rank's ZeRO state as data: `init` builds it, `gather` reads the full params back.

A `ZeroState` is a pytree whose leaves are tensors only (parameters, optimizer state, the step
counter); what describes them -- the layout, the stage, the mesh, the rank, the optimizer -- is
static metadata (`StateInfo`) carried in the tree's structure, as equinox's static fields. So
`optree.tree_map(f, state)` (or `torch.utils._pytree.tree_map`) hands `f` tensors only and
rebuilds a state with the same metadata.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import math
import numbers
import re
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any, NamedTuple

import optree
import torch
import torch.utils._pytree as torch_pytree
from torch.utils.weak import WeakIdKeyDictionary
from optree.registry import __GLOBAL_NAMESPACE as _GLOBAL  # type: ignore[attr-defined]

from .collectives import all_gather, all_reduce, broadcast, func_level, gather_texts
from .errors import ConfigError, FzeroError, LayoutError, NonFiniteError, as_int, said
from .layout import Layout, ParamGroup, UnitSpec, check_groups, packed, plan, warn_groups_holding_no_leaf
from .mesh import Mesh, settings_crc
from .offload import NO_OFFLOAD, HostTier, Offload, check_offload, place, place_opt_state, stage_of, tier_of
from .optim.base import (Optimizer, OptimizerError, _layers_tracked, check_state_shapes, init_state,
                         optimizer_words, spec_of)
from .originals import link_layout, note_synced, tied_names, warn_units_not_passed
from .precision import FULL, Precision, _shown, leaves_words, warn_no_master
from .scale import DynamicLossScale, LossScale, LossScaleState, StaticLossScale
from .stages import Stage, get_stage
from .tree import NAMESPACE, flatten_with_paths, named_paths, unflatten
from .unit import gather_leaves, unit_programs


@dataclasses.dataclass(frozen=True)
class StateInfo:
    """What a state's tensors mean; static (never a pytree leaf, never differentiated).

    Attributes:
      layout: the plan of buckets and shards.
      stage: the ZeRO stage (`fzero.STAGES[k]`).
      mesh: the mesh the state lives on; `rank` is this rank on it.
      optimizer: the `fzero.optim` optimizer `init` made the optimizer state with.
      precision: the `fzero.Precision` policy (compute and reduce dtypes).
      scaler: the fp16 loss scaler (`fzero.StaticLossScale` / `fzero.DynamicLossScale`), or None.
      offload: the `fzero.Offload` settings (what lives in host memory; `fzero._src.offload`).
      tier: the host tier of the offloaded buckets (`HostTier`, or `NvmeTier` with its swap
        files), or None.
      serial: which `fzero.init` on this mesh made the state (1, 2, ... per rank; `init` is
        collective, so the states of one call have the same serial on every rank): the step's
        agreement compares it, so ranks stepping states of different `init`s raise. Not compared
        by `==` (infos of equal meaning share the step's caches).
    """

    layout: Layout
    stage: Stage
    mesh: Mesh
    rank: int
    optimizer: Optimizer
    precision: Precision = FULL
    scaler: LossScale | None = None
    offload: Offload = NO_OFFLOAD
    tier: HostTier | None = None
    serial: int = dataclasses.field(default=0, compare=False)

    @functools.cached_property
    def optimizer_crc(self) -> int:
        """`settings_crc` of the optimizer's description (`named`), as `init` compares it across
        ranks: the step's agreement carries it, so a rank whose state took another optimizer
        after `init` (`state.replace(info=dataclasses.replace(state.info, optimizer=...))`, the
        way to change betas mid-run) raises on every rank (found in review: one rank's new betas
        trained silently apart)."""
        return settings_crc(named(self.optimizer))

    @functools.cached_property
    def groups_described(self) -> str:
        """Each bucket's tag and its group's settings (`ParamGroup`: name, `lr_scale`,
        `weight_decay`, `frozen`), in words: what a layout replaced after `init` (to change one
        group's lr mid-run, `state.replace(info=dataclasses.replace(state.info, layout=...))`)
        changes, and the step's agreement compares through `settings_crc` of it (found in review:
        one rank's new `lr_scale` trained silently apart)."""
        return "; ".join(f"{b.tag}: {b.group.name!r} lr_scale={b.group.lr_scale!r} weight_decay={b.group.weight_decay} "
                         f"frozen={b.group.frozen}" for b in self.layout.buckets)

    @functools.cached_property
    def groups_crc(self) -> int:
        """`settings_crc(groups_described)`, once per info: what the step's agreement carries."""
        return settings_crc(self.groups_described)

    @functools.cached_property
    def _host_buckets(self) -> frozenset[int]:
        return self.offload.host_buckets(self.layout)

    def host_tier(self, b: int) -> HostTier | None:
        """The host tier bucket `b`'s master and optimizer state live in (and how they move), or
        None where they stay on the device (`Offload.host_buckets`)."""
        return self.tier if b in self._host_buckets else None

    def renewed(self) -> "StateInfo":
        """This info for a new state that must not share storage with this one's (a checkpoint's
        load): with NVMe offload, a fresh set of swap files; otherwise itself."""
        tier = self.tier.renewed() if self.tier is not None else None
        if tier is self.tier:
            return self
        return dataclasses.replace(self, tier=tier, stage=stage_of(get_stage(self.stage.level), self.offload, tier))


@dataclasses.dataclass(frozen=True, eq=False, repr=False)  # (equal as objects; `__repr__` below)
class ZeroState:
    """One rank's state. Tensors per bucket, in `layout.buckets` order.

    Attributes:
      params: per bucket, `flat[N * S]`, or this rank's `shard[S]` where the stage shards params.
      opt_state: per bucket, the optimizer's state over `flat[N * S]`, or over `shard[S]` where
        the stage shards optimizer state; None for frozen buckets.
      master: per bucket, this rank's master `shard[S]` where the stage keeps one apart from
        `params` (stages 1-2 under a precision policy: `params` is then the full buffer in the
        compute dtype; and every trainable bucket under optimizer offload, in host memory -- or,
        with optimizer="nvme", in a swap file, the state holding a stand-in: read it with
        `master_values`); else None (`params` holds the master values).
      loss_scale: the loss scaler's `LossScaleState` (0-d tensors), or None without a scaler.
      step: int64 0-d (CPU): the number of updates applied so far (`int(state.step)`).
      info: static `StateInfo`; `layout`, `stage`, `mesh`, `rank`, `optimizer` read it.
      pending: None where every update that made this state was checked on the host (`init`,
        `load`, a pure step); after a donating step (`train_step(donate=True)`), this rank's
        verdict on its own update, not yet read: a float32 0-d tensor on the mesh device, 1 where
        the update left a NaN or inf in what this rank updated, else 0. The next step carries it
        in its agreement row; every other reader checks it first (`check_state`), so a state
        broken in place is never used silently.
    """

    params: tuple[torch.Tensor, ...]
    opt_state: tuple[Any, ...]
    step: torch.Tensor
    master: tuple[torch.Tensor | None, ...]
    loss_scale: LossScaleState | None
    info: StateInfo
    pending: torch.Tensor | None = None

    layout = property(lambda self: self.info.layout)
    stage = property(lambda self: self.info.stage)
    mesh = property(lambda self: self.info.mesh)
    rank = property(lambda self: self.info.rank)
    optimizer = property(lambda self: self.info.optimizer)
    precision = property(lambda self: self.info.precision)

    def __post_init__(self) -> None:
        _check_flat(self)
        object.__setattr__(self, "_held", _buffers_of(self))  # (a state the step makes carries its input's: `renewed`)

    def __repr__(self) -> str:
        """A summary (the fields' repr ran to 430 characters a leaf, most of it the layout: found in
        review), saying where the state was consumed or lost."""
        mark = getattr(self, "_consumed", None)
        said = "; consumed by a donating step" if mark is True else "; lost" if mark is not None else ""
        try:
            step = int(self.step)
        except (TypeError, ValueError, RuntimeError, NotImplementedError):  # (a tree_map to shapes, a wrapper)
            step = "?"
        return (f"ZeroState(stage {self.stage.level}, rank {self.rank} of {self.mesh!r}, step {step}, "
                f"{len(self.layout.buckets)} buckets of {len(self.layout.leaves)} leaves{said})")

    def __copy__(self) -> "ZeroState":
        """A new state over the same buffers, with this one's marks and counts (`_Buffers`)."""
        new = object.__new__(type(self))
        for name, value in self.__dict__.items():
            object.__setattr__(new, name, value)
        return new

    def __deepcopy__(self, memo: dict) -> "ZeroState":
        """A copy of every tensor, sharing the static `info` (as JAX's static fields; it holds the
        mesh, whose locks and process group are not copied: found in review, a `SimMesh` state's
        deepcopy raised "cannot pickle '_thread.RLock' object"); a consumed or lost state's mark
        kept; its buffers its own (`_Buffers`)."""
        if getattr(self, "_consumed", None) is None and _written_since(self):  # (its copy would hold those
            # values as its own: found in review; a consumed or lost state's copy keeps its mark)
            raise FzeroError(_written_words(self))
        memo[id(self.info)] = self.info
        new = object.__new__(type(self))
        memo[id(self)] = new
        for name, value in self.__dict__.items():
            if name != "_held":
                object.__setattr__(new, name, copy.deepcopy(value, memo))
        object.__setattr__(new, "_held", _buffers_of(new))
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError("a ZeroState is not pickled (torch.save, pickle, multiprocessing): its info holds the mesh "
                        "and the optimizer's functions. Save it with fzero.checkpoint.save(state, root) and resume "
                        "with fzero.checkpoint.load(path, state); the full params alone are fzero.gather(state); a "
                        "copy in this process is copy.deepcopy(state) or torch.utils._pytree.tree_map(torch.clone, "
                        "state)")

    def replace(self, **changes: Any) -> "ZeroState":
        """A new state with some fields changed (the others shared). Where this state was donated
        to a step or lost by one (`consume`, `lose`) and the new state keeps one of its buffers
        (any of `params`, `opt_state`, `master`, `loss_scale` not replaced), the new state is
        refused alike: those buffers hold the next step's values, or a half-written update
        (found in review: `state.replace(step=...)` of a donated state read the next state's
        params, silently). The step's own new states are made with `renewed`, which carries no
        mark. `params`, `opt_state` and `master` must keep their structure: one entry per bucket,
        each of the old entry's pytree structure (`_check_replaced`)."""
        _check_replaced(self, changes)
        new = dataclasses.replace(self, **changes)
        recorded = {id(held): n for held, n in self._held}  # (a copy already refused stays so: found in review)
        object.__setattr__(new, "_held", tuple((held, recorded.get(id(held), n)) for held, n in new._held))
        mark = getattr(self, "_consumed", None)
        if mark is not None and not _BUFFERS <= changes.keys():
            object.__setattr__(new, "_consumed", mark)  # the one record: a `Lost` named later names both
        return new


_BUFFERS = frozenset({"params", "opt_state", "master", "loss_scale"})  # what a donating step writes in place


def _check_replaced(state: ZeroState, changes: dict[str, Any]) -> None:
    """`FzeroError` where `changes` gives `params`, `opt_state` or `master` another structure than
    `state`'s: one entry per bucket, each of the old entry's pytree structure (a tensor; the
    optimizer's state NamedTuple; None for a frozen bucket's optimizer state and a bucket without
    a master). Found in review: a torch.optim `state_dict()` as `opt_state` was taken, and the
    next step raised a bare `KeyError: 0`."""
    layout = state.layout
    if "step" in changes:
        changes["step"] = _step_counter(changes["step"])
    for field in ("params", "opt_state", "master"):
        if field not in changes:
            continue
        old, value = getattr(state, field), changes[field]
        what = (f"state.replace({field}=...): {field} is one entry per bucket ({len(old)}: a tuple, as fzero.init "
                f"made it)")
        if not isinstance(value, (tuple, list)) or len(value) != len(old):
            torch_state = isinstance(value, dict) and {"state", "param_groups"} <= value.keys()
            raise FzeroError(f"{what}, got {type(value).__name__}" + (f" of {len(value)}" if isinstance(value, (
                tuple, list)) else "") + (": a torch.optim state_dict() is not fzero's optimizer state; resume with "
                                         "fzero.checkpoint.load" if torch_state else ""))
        for b, (x, y) in enumerate(zip(old, value)):
            want, got = optree.tree_structure(x, namespace=NAMESPACE), optree.tree_structure(y, namespace=NAMESPACE)
            if want != got:
                raise FzeroError(f"{what}; bucket {_bucket_words(layout, b)}: expected {want}, got {got}")
            if field == "opt_state" and x is not None:
                _check_fields_shaped(state, b, x, y)


def _check_fields_shaped(state: ZeroState, b: int, old: Any, new: Any) -> None:
    """`FzeroError` where a field of bucket b's new optimizer state (`state.replace(opt_state=...)`)
    has another shape than the one it replaces, naming the bucket, the field, both shapes, the
    stage and the world size (found in review of a model-surgery user: the step raised the
    optimizer's error, naming neither bucket nor stage)."""
    names = getattr(old, "_fields", range(len(old)))
    for name, x, y in zip(names, old, new):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape != y.shape:
            raise FzeroError(
                f"state.replace(opt_state=...): bucket {_bucket_words(state.layout, b)}, field {name!r}: shape "
                f"{list(y.shape)}, where this state (stage {state.stage.level}, world size {state.mesh.world_size}) "
                f"holds {list(x.shape)}; each field keeps the shape fzero.init made (a sharded field is this "
                f"rank's shard); to move values between stages or world sizes, fzero.gather the one state and "
                f"fzero.init the other with them")


def _step_counter(step: Any) -> torch.Tensor:
    """`state.replace(step=...)`'s value as the state keeps it, an int64 0-d tensor on the host: an
    int (Python's or numpy's) taken; anything else but a 0-d integer tensor of at least 0 refused (found in review:
    `step=7` raised a bare AttributeError in a donating step, `tensor(7.5)`, `tensor(-1)` and
    `tensor([7])` were taken)."""
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):  # (an int, numpy's integers)
        step = torch.tensor(int(step), dtype=torch.int64)
    if (not isinstance(step, torch.Tensor) or step.dim() != 0 or step.dtype.is_floating_point or step.is_complex()
            or step.dtype == torch.bool or int(step) < 0):
        shown = (f"a {step.dtype} tensor of shape {list(step.shape)}" + (f" holding {step.item()}" if step.numel() == 1
                                                                          else "")
                 if isinstance(step, torch.Tensor) else repr(step))
        raise FzeroError(f"state.replace(step=...): the step counter is the number of updates applied, an int >= 0 "
                         f"(or an integer 0-d tensor), got {shown}")
    return step.to(torch.int64) if step.dtype != torch.int64 else step


def _check_flat(state: ZeroState) -> None:
    """`FzeroError` where a bucket's params or master is not the one-dimensional contiguous buffer
    of the bucket's size, or of its shard's, that the stages read it as (`Bucket.views`: one
    `as_strided` per leaf, which reads another tensor's storage as if it were that buffer; found in
    review: a `state.replace(params=...)` of equal values in a strided view trained from garbage at
    stages 0-2, silently). A master is read whole (its shard gathered, or updated element by
    element): its shape only. An expanded zero (an NVMe tier's stand-in) is passed: a view of it
    past its one element raises. Other leaves (a `tree_map` to shapes) are passed over."""
    buckets, sharded = state.info.layout.buckets, state.info.stage.sharded("params")
    for field in ("params", "master"):
        for b, t in enumerate(getattr(state, field)):
            if not isinstance(t, torch.Tensor) or b >= len(buckets):
                continue
            spec = buckets[b]
            held = spec.shard_numel if sharded else spec.padded_numel  # the params this stage holds (found in
            sizes = (held,) if field == "params" else (spec.padded_numel, spec.shard_numel)  # review: another
            # stage's buffers were taken and raised bare torch errors at the step)
            if t.dim() != 1 or t.numel() not in sizes or (
                    field == "params" and not t.is_contiguous() and t.stride() != (0,)):  # (an NVMe tier's
                # stand-in is an expanded zero, never read: a view past its one element raises)
                what = "this rank's shard" if sharded else "the whole buffer"
                holds = f" (stage {state.info.stage.level} holds {what}: {held})" if field == "params" else ""
                if t.dim() == 2 and t.shape[1] in sizes:  # (found in review: a tree_map(torch.stack) of states, the
                    # first move before a vmap over them, was told to call .contiguous() or gather and init)
                    raise FzeroError(
                        f"state.{field}[{b}] (bucket {_bucket_words(state.info.layout, b)}) is a tensor of shape "
                        f"{list(t.shape)}: {t.shape[0]} buffers of {t.shape[1]} stacked (a tree_map of torch.stack "
                        f"over states?). A ZeroState holds one rank's state, one flat buffer per bucket, and a step "
                        f"is not vmapped over states: loop over the states, or vmap inside the loss")
                raise FzeroError(
                    f"state.{field}[{b}] (bucket {_bucket_words(state.info.layout, b)}) is a tensor of shape "
                    f"{list(t.shape)} and strides {list(t.stride())}; each is the bucket's flat buffer, one-dimensional "
                    f"and contiguous, of {spec.padded_numel} elements (world size {spec.world_size} x shard "
                    f"{spec.shard_numel}) or, where the stage shards it, {spec.shard_numel}{holds}: the state made by "
                    f"fzero.init, or a tree_map of it that keeps the shapes (make a strided one contiguous: "
                    f"t.contiguous()); to move values between stages or world sizes, fzero.gather the one state and "
                    f"fzero.init the other with them")


def renewed(state: ZeroState, **changes: Any) -> ZeroState:
    """The step's new state: `state` with `changes`, and no mark of `state`'s (`consume`, `lose`:
    the step marks the state it consumes itself). It holds `state`'s buffers where it keeps them
    (a donating step writes them in place), so it joins `state`'s `_Buffers` at their counts now,
    with no lookup per buffer; a buffer of `changes` new to every state (a pure step's) joins a
    `_Buffers` of its own when a state made from this one looks it up."""
    new = object.__new__(ZeroState)
    for field in _ALL_FIELDS:
        object.__setattr__(new, field, changes.pop(field) if field in changes else getattr(state, field))
    if changes:
        raise TypeError(f"renewed: no field(s) {sorted(changes)} in a ZeroState")
    object.__setattr__(new, "_held", tuple((held, held.writes) for held, _ in getattr(state, "_held", ())))
    return new


def fresh(state: ZeroState, **changes: Any) -> ZeroState:
    """`state` with `changes` where they give it new buffers (a pure step's update): the state's
    `_Buffers` looked up by each buffer, as for a state the user makes."""
    return dataclasses.replace(state, **changes)


class _Buffers:
    """The buffers (their storages) that states share: those `fzero.init` made, and every state made
    of them since -- the step's, a `state.replace`, a `copy.copy`, a `tree_map` that keeps the
    tensors (`lambda t: t`, `t.detach()`, `t.to(t.device)`). `writes` counts the donating steps
    that wrote them in place (`lose`, `consume`). A state records the count of each of its
    `_Buffers` when it is made (`ZeroState._held`) and is refused where one moved since
    (`check_state`): a donating step of a state that shares them wrote them, and this state would
    read that step's values under its own step count (found in review of a JAX user: a snapshot
    by `copy.copy` or `tree_map` before a donating step read the next step's params, and a
    donating step of the snapshot wrote the state that step returned, silently)."""

    __slots__ = ("writes", "__weakref__")

    def __init__(self) -> None:
        self.writes = 0


_HELD_BY: WeakIdKeyDictionary = WeakIdKeyDictionary()  # a buffer's UntypedStorage -> its `_Buffers`


def _writable(state: ZeroState) -> Iterator[Any]:
    """What a donating step may write in place: the params, master and optimizer state of every
    trainable bucket. Not a frozen bucket's params, nor the loss scaler's state, which a step
    replaces (a static scale's is kept as it is): a pure step's state shares them with its input."""
    buckets = state.info.layout.buckets
    for b, (p, opt, m) in enumerate(zip(state.params, state.opt_state, state.master)):
        if b < len(buckets) and not buckets[b].group.frozen:
            yield p
            yield m
            yield from opt if isinstance(opt, tuple) else (opt,)


def _buffers_of(state: ZeroState) -> tuple[tuple[_Buffers, int], ...]:
    """The `_Buffers` of `state`'s writable buffers (`_writable`) and their counts now; buffers of
    none yet (a state of new tensors) join one new `_Buffers`. Tensors without a storage of their
    own (a torch.func wrapper) and other leaves (a `tree_map` to shapes) are passed over."""
    sets: dict[int, _Buffers] = {}
    new = None
    for t in _writable(state):
        if not isinstance(t, torch.Tensor):
            continue
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            continue
        held = _HELD_BY.get(storage)
        if held is None:
            held = new = new or _Buffers()
            _HELD_BY[storage] = held
        sets[id(held)] = held
    return tuple((held, held.writes) for held in sets.values())


def _count_write(state: ZeroState, k: int = 1) -> None:
    """A donating step writes `state`'s buffers in place (k = 1; -1 where it turned out not to)."""
    for held, _ in getattr(state, "_held", ()):
        held.writes += k


def _written_words(state: ZeroState) -> str:
    return (f"this state (step {int(state.step)}) shares its buffers with a state that a donating step "
            f"(train_step(donate=True)) consumed after this one was made -- a copy by copy.copy, state.replace, "
            f"dataclasses.replace or a tree_map that kept the tensors (or any tree_map of such a copy, or a "
            f"tree_unflatten of a treespec taken before that step), or the state a step returned without an "
            f"update (a skipped step hands its input's buffers on): that step wrote them in place, so they hold a "
            f"later step's values. Use the state that step returned; to keep a snapshot beside donating steps, "
            f"copy the tensors before the step: snapshot = torch.utils._pytree.tree_map(torch.clone, state)")


def _written_since(state: ZeroState) -> bool:
    """Whether a donating step of a state sharing `state`'s buffers wrote them since `state` was made."""
    return any(held.writes != n for held, n in getattr(state, "_held", ()))


class _Static:
    """A state's pytree node data: its `info` and its record when flattened (`_held`, the mark),
    which a state rebuilt from its leaves by a `tree_map` (or a `tree_unflatten` of the treespec)
    carries on (`carried_into`): the counts recorded then for the buffers it shares, so that a
    treespec kept past a donating step of the state rebuilds one that is refused (found in
    review); and, where the state was refused already (consumed or lost by a donating step, or
    a copy made before one), the whole record and the mark, so that the rebuilt state is refused
    alike whether the map kept the tensors or copied them (found in review: it was rebuilt as a
    state of its own and read, or copied, the next step's values under its own step count). Equal,
    and hashed, by `info` alone: the record never makes two states' structures differ (a
    `tree_map` over two states)."""

    __slots__ = ("info", "held", "mark", "refused")

    def __init__(self, state: ZeroState) -> None:
        self.info, self.held = state.info, getattr(state, "_held", ())
        self.mark = getattr(state, "_consumed", None)
        self.refused = self.mark is not None or _written_since(state)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Static) and self.info == other.info

    def __hash__(self) -> int:
        return hash(self.info)

    def __repr__(self) -> str:
        return f"_Static({self.info!r})"

    def carried_into(self, new: ZeroState) -> ZeroState:
        """`new`, rebuilt from a state's leaves, with that state's record (above)."""
        recorded = {id(h): n for h, n in self.held}
        held = tuple((h, recorded.get(id(h), n)) for h, n in new._held)
        if self.refused:
            ids = {id(h) for h, _ in new._held}
            held += tuple((h, n) for h, n in self.held if id(h) not in ids)
            if self.mark is not None:
                object.__setattr__(new, "_consumed", self.mark)
        object.__setattr__(new, "_held", held)
        return new


_FIELDS = ("params", "opt_state", "step", "master", "loss_scale", "pending")
_ALL_FIELDS = ("params", "opt_state", "step", "master", "loss_scale", "info", "pending")


def _flatten(state: ZeroState) -> tuple[tuple, _Static, tuple[str, ...]]:
    children = (state.params, state.opt_state, state.step, state.master, state.loss_scale, state.pending)
    return children, _Static(state), _FIELDS


def _unflatten(static: _Static, children: Any) -> ZeroState:
    params, opt_state, step, master, loss_scale, pending = children
    return static.carried_into(ZeroState(params, opt_state, step, master, loss_scale, static.info, pending))


for _namespace in (_GLOBAL, NAMESPACE):
    optree.register_pytree_node(ZeroState, _flatten, _unflatten, namespace=_namespace)
def _torch_flatten(state: ZeroState) -> tuple[list, tuple]:
    """torch's pytree takes None for a leaf: the positions of None optimizer states (frozen
    buckets) and None masters are kept in the context, so `torch.utils._pytree.tree_map` sees
    tensors only too."""
    def split(xs: tuple) -> tuple[tuple, tuple[int, ...]]:
        return tuple(x for x in xs if x is not None), tuple(b for b, x in enumerate(xs) if x is None)

    opt, no_opt = split(state.opt_state)
    master, no_master = split(state.master)
    scale = () if state.loss_scale is None else (state.loss_scale,)
    pending = () if state.pending is None else (state.pending,)
    static = (_Static(state), no_opt, no_master, len(state.params))
    return [state.params, opt, state.step, master, scale, pending], static


def _torch_unflatten(children: list, context: tuple) -> ZeroState:
    (params, opt, step, master, scale, pending), (static, no_opt, no_master, nb) = children, context

    def join(xs: tuple, nones: tuple[int, ...]) -> tuple:
        it = iter(xs)
        return tuple(None if b in nones else next(it) for b in range(nb))

    return static.carried_into(ZeroState(params, join(opt, no_opt), step, join(master, no_master),
                                         scale[0] if scale else None, static.info, pending[0] if pending else None))


torch_pytree.register_pytree_node(ZeroState, _torch_flatten, _torch_unflatten, serialized_type_name="fzero.ZeroState")


def outside_inference_mode(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run as it runs outside `torch.inference_mode()` where it is called inside it: under
    `torch.inference_mode(False)`, in the grad mode of the call (inference mode turns grad mode
    off, so as under `torch.no_grad()`). For `init` and the step, which make a state: under
    inference mode they made one of inference tensors, which a later step outside it refused
    with torch's "Setting requires_grad=True on inference tensor outside InferenceMode" (and the
    autograd engine's step itself said no param was reached, naming no inference mode; found in
    review). As the step already trains under `torch.no_grad()`, the same bits and normal
    tensors. Elsewhere one flag read."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        grad = torch.is_grad_enabled()  # read before inference_mode(False), which turns grad mode on
        with torch.inference_mode(False), torch.set_grad_enabled(grad):
            return fn(*args, **kwargs)

    return call


def inference_parts(state: ZeroState) -> list[str]:
    """The parts of `state` that are inference tensors (made under `torch.inference_mode()`, which
    a step outside it cannot train or write), in words: the field and, per bucket, its leaves
    (`_bucket_words`). The error path of a step: a read of each tensor's flag."""
    def inference(x: Any) -> bool:
        return any(isinstance(t, torch.Tensor) and t.is_inference() for t in torch_pytree.tree_leaves(x))

    layout = state.layout
    parts = [f"{field} of bucket {_bucket_words(layout, b)}" for field in ("params", "master", "opt_state")
             for b, x in enumerate(getattr(state, field)) if inference(x)]
    return parts + [field for field in ("step", "loss_scale", "pending") if inference(getattr(state, field))]


@outside_inference_mode  # a state of normal tensors, as made outside inference mode
def init(
    params: Any,
    optimizer: Optimizer,
    *,
    stage: int,
    mesh: Mesh,
    units: UnitSpec = None,
    groups: Sequence[ParamGroup] = (),
    align: int = 1,
    bucket_bytes: int | None = None,
    sync: bool = True,
    precision: Precision = FULL,
    loss_scale: LossScale | None = None,
    offload: Offload | None = None,
) -> ZeroState:
    """This rank's `ZeroState` for `params` (call on every rank; on SimMesh inside `mesh.run`).

    Ranks first agree that their params have the same structure, shapes and dtypes (one small
    all-gather; a mismatch raises on every rank, naming the leaf, the ranks and the sizes). With
    `sync`, rank 0's values are broadcast, as DDP does at construction.

    Args:
      params: a pytree of floating tensors (see `fzero.layout.plan`); read, never modified. They
        may live on another device than the mesh's (e.g. a model built on the CPU for a CUDA
        mesh): what the state keeps on the device is copied to `mesh.device`, what it offloads
        stays in (or goes to) host memory.
      optimizer: a `fzero.optim` optimizer; the state remembers it, and `train_step` uses it.
      stage: the ZeRO stage, 0-3.
      mesh: the mesh of ranks (`fzero.SimMesh(N)` or `fzero.DistMesh()`).
      units, groups, align, bucket_bytes: as for `fzero.layout.plan`.
      sync: broadcast rank 0's values to every rank. False skips the broadcast: the values must
        then be equal on every rank already (not compared; where they differ the stages differ,
        docs/bad-input.md).
      precision: a `fzero.Precision` (compute and reduce dtypes); the master values stay in the
        params' own dtype (`fzero._src.precision`): fp32 params keep an fp32 master, 16-bit params
        none (a `fzero.NoFp32Master` warning where `param_dtype` is set: give fp32 params,
        `model.float()` before `from_module`, for an fp32 master).
      loss_scale: None, `fzero.StaticLossScale(s)` or `fzero.DynamicLossScale(...)`: fp16 loss
        scaling with DeepSpeed's semantics (the scaler's state is part of the state; see
        `train_step`): for trainable buckets that compute in fp16 (`precision`), or fp32 params
        under a loss run in `torch.autocast(..., dtype=torch.float16)`, or buckets a policy reduces
        in fp16. Refused (`ConfigError`) where every trainable bucket computes in bf16 and none
        reduces in fp16, or none is trainable.
      offload: None or `fzero.Offload(optimizer="cpu" | "nvme", params=None | "cpu" | "nvme",
        nvme_path=, ratio=)`: this rank's master shard and optimizer state (stages 1-3; "nvme":
        the master shard and the state's per-element fields in swap files under `nvme_path`;
        `ratio` < 1 keeps whole buckets on the device) and stage 3's param shards in host memory
        (params "nvme": in swap files too), the update on the host; the same bits where the
        host's kernels are the device's (docs/offload.md).
    """
    if not isinstance(mesh, Mesh):
        raise ConfigError(f"init: mesh must be a fzero.SimMesh(N) or fzero.DistMesh() (the ranks the state is "
                          f"sharded over), got {type(mesh).__name__} {mesh!r:.80}")
    with mesh.guard():  # a rank that raises here tells the others instead of leaving them waiting
        st = get_stage(stage)  # the stage's own pieces; its enter reads the final tier (`stage_of`, below)
        off = check_offload(offload)
        off.check_stage(st)
        tier = tier_of(off, mesh.device)
        _check_optimizer(optimizer)
        if not isinstance(sync, bool):  # `sync="no"` read as True broadcast where the user meant not to
            raise ConfigError(f"sync must be a bool (broadcast rank 0's values to every rank), got "
                              f"{type(sync).__name__} {sync!r}")
        if not isinstance(precision, Precision):
            raise ConfigError(f"precision must be a fzero.Precision, got {type(precision).__name__} {precision!r}; "
                              f"for no policy (every leaf computes and reduces in its own dtype) leave it out or "
                              f"pass fzero.Precision(), the default")
        if loss_scale is not None and not isinstance(loss_scale, (StaticLossScale, DynamicLossScale)):
            scaler = (" (for torch.amp.GradScaler(init_scale=S, growth_interval=W): fzero.DynamicLossScale("
                      "init_scale=S, window=W, hysteresis=1), whose doublings come one clean step later, as "
                      "DeepSpeed's do)" if type(loss_scale).__name__.endswith("GradScaler") else "")
            raise ConfigError(f"loss_scale must be None, fzero.StaticLossScale(...) or fzero.DynamicLossScale(...), "
                              f"got {type(loss_scale).__name__} {loss_scale!r}{scaler}")
        groups = check_groups(groups)  # once: `plan` and `link_layout` both read it (a generator was read once)
        align, bucket_bytes = as_int(align), as_int(bucket_bytes)  # (np.int64: compared across ranks as the int)
        layout = plan(params, mesh.world_size, units=units, groups=groups, align=align, bucket_bytes=bucket_bytes)
        _check_loss_scale(layout, precision, loss_scale)
        warn_no_master(precision, layout)  # 16-bit params under a 16-bit param_dtype: no fp32 master
        _check_real(params)
        _check_distinct(params, {ls.path for ls in layout.leaves if ls.group.frozen})
        link_layout(layout, params, groups)  # leaves from_module returned: a step refuses a module flag changed since
        if units is None:
            warn_units_not_passed(params)
        warn_groups_holding_no_leaf(layout, groups, tied_names(layout))  # (after link_layout's refusal by alias)
        check_same_layout(layout, mesh)
        check_same_settings(mesh, stage=st.level, optimizer=named(optimizer), align=align, sync=bool(sync),
                            bucket_bytes=bucket_bytes,
                            precision=(str(precision.param_dtype), str(precision.reduce_dtype)),
                            loss_scale=repr(loss_scale),
                            offload=(off.optimizer, off.params, off.ratio, off.pin, off.direct),  # not nvme_path
                            buckets=[f"{b.tag} frozen={b.group.frozen} weight_decay={b.group.weight_decay} "
                                     f"lr_scale={b.group.lr_scale} leaves={tuple(layout.leaves[i].path for i in b.leaves)}"
                                     for b in layout.buckets])  # paths, so that a difference names the leaves; the
        # fields labelled (found in review: a tuple of bools and a float)
        rank = mesh.rank
        on_host = off.host_buckets(layout)
        tiers = [tier if b in on_host else None for b in range(len(layout.buckets))]
        computes = [precision.wire(spec).compute for spec in layout.buckets]

        def keep_bucket(b: int, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
            """Bucket b's `(held, master)`, one bucket at a time: with `sync`, rank 0's values (as
            DDP broadcasts at construction, on the mesh's device); what stays on the device is
            put on `mesh.device` (params may come from the host: a model built on the CPU)."""
            if sync and mesh.world_size > 1:
                flat = broadcast(flat.to(mesh.device), mesh, 0, tag=layout.buckets[b].tag)
            note_synced(layout, b, flat)  # what a first step's `ModuleWrittenAfterInit` compares a written leaf with
            if not layout.buckets[b].group.frozen:
                nonfinite.extend(_nonfinite_leaves(layout, b, flat))
            return place(st, off, tiers[b], layout, b, *st.hold(layout, b, flat, rank, computes[b]), rank,
                         computes[b], mesh.device)

        nonfinite: list[str] = []  # trainable leaves whose kept values hold a NaN or inf (`_agreed_serial` raises)
        kept = []  # one bucket's packed buffer at a time beside the params (`packed`: `torch.cat` makes it fresh,
        for b, flat in enumerate(packed(layout, params)):  # so nothing needs a copy), dropped once kept, before
            kept.append(keep_bucket(b, flat.detach()))  # the next is made
            del flat
        held, master = tuple(p for p, _ in kept), tuple(m for _, m in kept)

        def opt_init(b: int, device: Any = None) -> Any:
            p = st.optimizer_params(layout, b, held[b], rank, master[b])
            shapes = [layout.leaves[i].shape for i in layout.buckets[b].leaves]
            try:
                s = init_state(optimizer, p if device is None else p.to(device), shapes)
            except OptimizerError as e:  # found in review: "got a float64 shard", naming no leaf
                raise OptimizerError(f"{e} (fzero.init, making the optimizer state of bucket "
                                     f"{_bucket_words(layout, b)})") from e
            spec = spec_of(optimizer, s)
            # each field's shape against its kind, here rather than at the first checkpoint.save (found in
            # review: a 0-d step count of spec "leaf" trained, then the save failed naming no field)
            check_state_shapes(f"fzero.init: {optimizer_words(optimizer, 'init')}", s, spec, p.numel(), len(shapes),
                               shapes, f" (bucket {_bucket_words(layout, b)})")
            return s

        trainable = dict.fromkeys(b for b, spec in enumerate(layout.buckets) if not spec.group.frozen)  # (ordered; `in`: O(1))
        if off.optimizer == "nvme":  # the files' sizes from states made on the meta device (no memory)
            metas = {b: opt_init(b, "meta") for b in trainable if b in on_host}
            tier = tier_of(off, mesh.device, {b: (s, spec_of(optimizer, s)) for b, s in metas.items()},
                           {b: master[b] for b in metas},
                           {b: (layout.buckets[b].tag, held[b]) for b in metas} if off.params == "nvme" else None)
            tiers = [tier if b in on_host else None for b in range(len(layout.buckets))]
        opt_state = tuple(place_opt_state(tiers[b], b, opt_init(b)) if b in trainable else None
                          for b in range(len(layout.buckets)))
        if off.optimizer == "nvme":  # the masters to their files, once the optimizer states are made from them
            master = tuple(tiers[b].keep_master(b, m) if b in trainable and tiers[b] is not None else m
                           for b, m in enumerate(master))
            held = tuple(tiers[b].keep_params(b, p) if b in trainable and tiers[b] is not None else p
                         for b, p in enumerate(held))  # params="nvme": the compute-dtype shards too
        st = stage_of(st, off, tier)
        serial = _agreed_serial(mesh, nonfinite, sync)
    return ZeroState(held, opt_state, torch.zeros((), dtype=torch.int64), master,
                     None if loss_scale is None else loss_scale.init(),
                     StateInfo(layout, st, mesh, rank, optimizer, precision, loss_scale, off, tier, serial))


_INITS: "weakref.WeakKeyDictionary[Mesh, dict[int, int]]" = weakref.WeakKeyDictionary()  # mesh -> rank -> inits


def _agreed_serial(mesh: Mesh, nonfinite: list[str], sync: bool) -> int:
    """This `init`'s number on `mesh` (`StateInfo.serial`), the same on every rank: one more than
    the largest any rank made before (a rank stopped inside an earlier `init` by another rank's
    error counted one fewer). The same all-gather carries whether the rank's trainable values hold
    a NaN or inf (`nonfinite`, `_nonfinite_leaves`; under `sync=False` each rank keeps its own), so
    every rank raises `NonFiniteError` where one does. Counted per rank, as SimMesh's ranks are
    threads sharing one mesh."""
    counts = _INITS.setdefault(mesh, {})
    mine = torch.tensor([counts.get(mesh.rank, 0) + 1, len(nonfinite)], dtype=torch.int64, device=mesh.device)
    rows = all_gather(mine, mesh, tag="fzero.init/serial").view(mesh.world_size, 2).tolist()
    bad = [r for r, (_, k) in enumerate(rows) if k]
    if bad:
        whose = "rank 0's values (broadcast to every rank: sync=True)" if sync and mesh.world_size > 1 else (
            f"the values of rank(s) {bad}")
        mine_said = (f": params leaves {', '.join(nonfinite[:8])}{' ...' if len(nonfinite) > 8 else ''} on rank "
                     f"{mesh.rank}") if nonfinite else ""
        raise NonFiniteError(f"trainable params hold NaN or inf in {whose} ({mesh!r}){mine_said}; a trainable leaf "
                             f"must start finite (every update of its bucket would be NaN or inf): initialise it (a "
                             f"torch.empty / to_empty tensor never initialised?), or freeze it with a "
                             f"ParamGroup(..., frozen=True) if it is a constant such as a mask. To restore a "
                             f"checkpoint, init from any finite values, then fzero.checkpoint.load")
    counts[mesh.rank] = max(n for n, _ in rows)
    return counts[mesh.rank]


def _check_loss_scale(layout: Layout, precision: Precision, loss_scale: Any) -> None:
    """Loss scaling keeps small fp16 gradients from flushing to zero: those of units computing in
    fp16 (a policy), or, over fp32 or wider params, of a loss computed under
    `torch.autocast(..., dtype=torch.float16)` -- torch's AMP recipe, which fzero cannot see from
    here (found in review: refused before, so its gradients underflowed unscaled); and those a
    policy reduces in fp16 (`Precision(torch.bfloat16, torch.float16)`: the reduction underflows
    as an fp16 computation does; found in review: refused, naming bf16's range). Refused where
    every trainable bucket computes in bf16 and none reduces in fp16: a scale there is a mistaken
    setting, not a guard."""
    if loss_scale is None:
        return
    wires = [precision.wire(b) for b in layout.buckets if not b.group.frozen]
    computes = {w.compute for w in wires}
    if torch.float16 in {w.reduce for w in wires}:  # bf16 units reduced in fp16 (found in review: refused)
        return
    if not computes or computes <= {torch.bfloat16}:
        names = sorted(str(d).removeprefix("torch.") for d in computes) or ["nothing trainable"]
        raise ConfigError(f"loss_scale={loss_scale!r} guards fp16 gradients, but this state computes in {names}, "
                          f"which has fp32's exponent range; drop loss_scale, or compute in fp16 with "
                          f"precision=fzero.Precision(torch.float16, ...) (or keep fp32 params and run the loss "
                          f"under torch.autocast(..., dtype=torch.float16))")


def _check_distinct(params: Any, frozen: Collection[str] = ()) -> None:
    """One tensor at two paths, or two leaves whose memory overlaps (views of one tensor: `W` and
    `W.t()`, overlapping slices), would be two leaves updated apart (silently untied). Views of
    one buffer that share no element (disjoint slices, interleaved columns), and frozen leaves
    (paths in `frozen`, never updated) that overlap only each other, are allowed. So is a frozen
    leaf whose own elements overlap (`expand`); a trainable one is refused (`_self_overlapping`)."""
    paths, leaves, _ = flatten_with_paths(params)
    first: dict[int, str] = {}
    for path, leaf in zip(paths, leaves):
        other = first.setdefault(id(leaf), path)
        if other != path:
            raise LayoutError(f"params leaves {other!r} and {path!r} are the same tensor; keep one leaf and use it "
                              f"twice in the loss (fzero.from_module does this for tied module weights)")
    shared, left = _overlapping(leaves), list(range(len(leaves)))
    while shared is not None and paths[left[shared[0]]] in frozen and paths[left[shared[1]]] in frozen:
        del left[shared[1]]  # two frozen views of one tensor: look again without the second
        shared = _overlapping([leaves[k] for k in left])
    if shared is not None:
        (i, j) = left[shared[0]], left[shared[1]]
        raise LayoutError(f"params leaves {_placed(paths[i], leaves[i])} and {_placed(paths[j], leaves[j])} share "
                          f"memory (views of one tensor, e.g. W and W.t() or overlapping slices): fzero would "
                          f"update them apart and silently untie them; keep one leaf and use it at both places in "
                          f"the loss (e.g. p['emb'].t() for a tied head; fzero.from_module does this for tied module "
                          f"weights), or pass a .clone() to train them apart")
    for path, leaf in zip(paths, leaves):
        if path not in frozen and isinstance(leaf, torch.Tensor) and _self_overlapping(leaf):
            raise LayoutError(f"params leaf {_placed(path, leaf)} holds one memory location at several of its "
                              f"elements (an expand()ed tensor, a stride of 0, or an overlapping as_strided view): "
                              f"fzero would train each element apart and silently untie them (torch.optim refuses "
                              f"to update such a tensor in place); pass leaf.clone() to train its elements apart, "
                              f"keep the smaller tensor as the leaf and expand it in the loss to keep them tied, or "
                              f"freeze it with a ParamGroup(..., frozen=True)")


def _self_overlapping(t: torch.Tensor) -> bool:
    """Whether two elements of a strided tensor are one memory location (found in review: an
    `expand`ed leaf was trained as independent elements, where torch.optim raises). False at once
    where each stride, in increasing order, reaches past the span of the smaller ones (contiguous
    tensors, transposes, slices); True at once for a stride of 0 (`expand`) or more elements than
    the memory they span; otherwise (an `as_strided` view whose strides interleave) each element's
    offset is computed and compared -- the rare path, one int64 per element."""
    if t.layout != torch.strided or t.numel() < 2:
        return False
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    span = 1
    for st, n in dims:
        if st < span:
            break
        span += (n - 1) * st
    else:
        return False
    if dims[0][0] == 0 or t.numel() > 1 + sum((n - 1) * st for st, n in dims):
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for st, n in dims:
        offsets = (offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * st).flatten()
    return bool(offsets.unique().numel() < offsets.numel())


def _placed(path: str, t: torch.Tensor) -> str:
    """A leaf and where its elements sit: path, dtype, shape, stride, storage offset."""
    return (f"{path!r} ({str(t.dtype).removeprefix('torch.')}{list(t.shape)}, stride {list(t.stride())}, "
            f"storage offset {t.storage_offset()})")


def _extent(t: torch.Tensor) -> tuple[Any, int, int, bool] | None:
    """`(device, first byte, end byte, dense)` of the memory a strided tensor's elements span
    (`dense`: its elements fill that span exactly, once each, as a contiguous tensor or a
    transpose do), or None for a tensor with no memory (no elements, meta, not strided)."""
    if t.layout != torch.strided or t.is_meta or t.numel() == 0:
        return None
    try:
        lo = t.data_ptr()
    except RuntimeError:  # a tensor subclass without storage
        return None
    dims = sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1)
    expected, dense = 1, True
    for st, n in dims:
        dense &= st == expected
        expected *= n
    span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return t.device, lo, lo + span * t.element_size(), dense


def _overlapping(leaves: Sequence[Any]) -> tuple[int, int] | None:
    """The indices of two leaves that share a byte of memory, or None. Leaves are sorted by their
    first byte per device; runs of overlapping spans are clusters. Where every member of a cluster
    is dense, overlapping spans are shared memory; otherwise (strided views that may interleave)
    the cluster's elements are marked in a scratch buffer over its span (rare)."""
    spans = sorted((e[0].type, e[0].index or 0, e[1], e[2], e[3], k) for k, t in enumerate(leaves)
                   if isinstance(t, torch.Tensor) and (e := _extent(t)) is not None)
    cluster: list[tuple] = []
    for span in spans + [None]:  # a sentinel closes the last cluster
        if cluster and span is not None and span[:2] == cluster[0][:2] and span[2] < max(c[3] for c in cluster):
            if all(c[4] for c in cluster) and span[4]:  # dense: the spans' overlap is shared memory
                widest = max(cluster, key=lambda c: c[3])
                return widest[5], span[5]
            cluster.append(span)
            continue
        if len(cluster) > 1:
            hit = _marked_overlap([leaves[c[5]] for c in cluster], [c[2] for c in cluster])
            if hit is not None:
                return cluster[hit[0]][5], cluster[hit[1]][5]
        cluster = [span]
    return None


def _marked_overlap(ts: Sequence[torch.Tensor], starts: Sequence[int]) -> tuple[int, int] | None:
    """Mark each tensor's elements in a scratch buffer over the tensors' joint span (in units of
    the largest byte count dividing every item size and offset), each with its own number; the
    first tensor to find another's mark shares memory with it: `(earlier, later)` positions."""
    base = min(starts)
    unit = 0
    for t, lo in zip(ts, starts):
        unit = math.gcd(unit, t.element_size(), lo - base)
    ends = [lo + (1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))) * t.element_size()
            for t, lo in zip(ts, starts)]
    marks = torch.zeros((max(ends) - base) // unit, dtype=torch.int32)
    for k, (t, lo) in enumerate(zip(ts, starts)):
        per = t.element_size() // unit
        view = marks.as_strided(tuple(t.shape) + (per,), tuple(st * per for st in t.stride()) + (1,),
                                (lo - base) // unit)
        seen = view[view != 0]
        if seen.numel():
            return int(seen[0]) - 1, k
        view.fill_(k + 1)
    return None


def _nonfinite_leaves(layout: Layout, b: int, flat: torch.Tensor) -> list[str]:
    """The leaves of bucket `b` whose values in `flat` hold a NaN or inf, each as `'path'
    (dtype[shape]: k of n elements NaN or inf)`; none where `flat`'s minimum and maximum are
    finite (NaN propagates through both; no tensor of `flat`'s size is made). One read of the
    bucket and one host read; the leaf by leaf count only where some element is not finite."""
    if not flat.numel() or bool(torch.isfinite(torch.stack([flat.amin(), flat.amax()])).all()):
        return []
    bad = []
    for seg in layout.flat_segments(b):
        count = int((~torch.isfinite(flat[seg.start : seg.stop])).sum())
        if count:
            ls = layout.leaves[seg.leaf]
            bad.append(f"{ls.path!r} ({str(ls.dtype).removeprefix('torch.')}{list(ls.shape)}: {count} of {ls.numel} "
                       f"elements NaN or inf)")
    return bad


def _bucket_words(layout: Layout, b: int) -> str:
    """Bucket `b` in words: its tag and its leaves' paths, dtypes and shapes (the first 6)."""
    spec = layout.buckets[b]
    leaves = [layout.leaves[i] for i in spec.leaves]
    named = ", ".join(f"{ls.path!r} ({str(ls.dtype).removeprefix('torch.')}{list(ls.shape)})" for ls in leaves[:6])
    count = f"{len(leaves)} leaves" if len(leaves) != 1 else "1 leaf"
    return f"{spec.tag!r} of {count}: {named}{' ...' if len(leaves) > 6 else ''}"


def _check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, Optimizer):
        what = f"the class {optimizer.__module__}.{optimizer.__qualname__}" if isinstance(optimizer, type) else (
            f"a {type(optimizer).__module__}.{type(optimizer).__qualname__}")
        made = str(getattr(optimizer, "__module__", "")).startswith("fzero.")
        if callable(optimizer) and not isinstance(optimizer, type) and made:  # found in review: a factory uncalled
            what = (f"the function fzero.optim.{optimizer.__name__} itself: call it with its hyper-parameters, "
                    f"fzero.optim.{optimizer.__name__}(lr, ...)")
        elif isinstance(optimizer, dict) and optimizer and all(isinstance(k, str) for k in optimizer):
            what += " (the params? init takes them first: fzero.init(params, optimizer, stage=..., mesh=...))"
        raise ConfigError(f"optimizer must be a fzero.optim optimizer (e.g. fzero.optim.adamw(1e-3)), got {what}; "
                          f"fzero's optimizers update flat shards and are bitwise equal to torch.optim's")
    if optimizer.lr is not None and not callable(optimizer.lr):
        raise ConfigError(f"Optimizer.lr must be None or the schedule step -> lr the update reads (e.g. "
                          f"fzero.optim.as_schedule(0.1)), got {type(optimizer.lr).__name__} {optimizer.lr!r}")


def _check_real(params: Any) -> None:
    """Meta tensors have shapes but no values: fine for `fzero.layout.plan` and the memory estimate, not
    for a state that trains."""
    paths, leaves, _ = flatten_with_paths(params)
    meta = [f"{p} ({str(x.dtype).removeprefix('torch.')}{list(x.shape)})" for p, x in zip(paths, leaves)
            if isinstance(x, torch.Tensor) and x.is_meta]
    if meta:
        raise LayoutError(f"params leaves {meta[:5]}{' ...' if len(meta) > 5 else ''} are meta tensors (shapes, no "
                          f"values); fzero.init needs real values: materialize the model first (e.g. "
                          f"model.to_empty(device=...) and initialise it), then call fzero.from_module on it again "
                          f"where it read the model on the meta device (its params are the tensors it read then); or "
                          f"use fzero.accounting.estimate for a model on the meta device")


def describe(fn_or_tuple: Any, depth: int = 0) -> Any:
    """A process-independent description of an optimizer (or any function): qualified names and
    the plain values (numbers, strings, bools) its closures hold, for comparing settings across
    ranks. Two optimizers that print alike behave alike; the converse is not claimed: what a
    function holds otherwise -- a `functools.partial`'s arguments, a callable object's attributes,
    a dict or a global it reads -- is not described (an lr schedule's values are compared by
    each step instead: `Optimizer.lr`, docs/bad-input.md row 54). `checkpoint._named` follows
    the same rule."""
    if isinstance(fn_or_tuple, tuple):
        return tuple(describe(f, depth) for _, f in described_fields(fn_or_tuple))
    if not callable(fn_or_tuple):
        return repr(fn_or_tuple) if isinstance(fn_or_tuple, (int, float, str, bool, type(None))) else type(
            fn_or_tuple).__qualname__
    values = [describe(v, depth + 1) if callable(v) else repr(v) for _, v in described_cells(fn_or_tuple, depth)]
    return (getattr(fn_or_tuple, "__qualname__", type(fn_or_tuple).__qualname__), tuple(values))


def described_cells(fn: Callable, depth: int) -> list[tuple[str, Any]]:
    """`(name, value)` of each closure variable of `fn` that `describe` describes: plain values
    (numbers, strings, bools, None, tuples of them) and, while depth < 3, functions (not classes),
    in closure order; a cell's name is its `co_freevars` entry (its index where there is none).
    The one rule `describe` and `checkpoint._named` share."""
    cells = getattr(fn, "__closure__", None) or ()
    names = getattr(getattr(fn, "__code__", None), "co_freevars", ()) or [str(i) for i in range(len(cells))]
    kept = []
    for name, cell in zip(names, cells):
        v = cell.cell_contents
        plain = (isinstance(v, (int, float, str, bool, type(None)))
                 or isinstance(v, tuple) and all(isinstance(x, (int, float, str, bool)) for x in v))
        if plain or callable(v) and not isinstance(v, type) and depth < 3:
            kept.append((name, v))
    return kept


def described_fields(x: tuple) -> list[tuple[str, Any]]:
    """`(field name or index, value)` of each entry of a tuple that describes it: an `Optimizer`'s
    fields but `lr`, the schedule its update's closure holds already (described there; left out
    so that descriptions, and the checkpoints that store them, are those of before the field)."""
    names = getattr(x, "_fields", None) or [str(i) for i in range(len(x))]
    skipped = "lr" if isinstance(x, Optimizer) else None
    return [(n, v) for n, v in zip(names, x) if n != skipped]


class NamedFn(NamedTuple):
    """A function as `describe` sees it, with names: its qualname and, per closure value
    `describe` keeps, `(variable name, value)` (a repr, or a nested `NamedFn`)."""

    qualname: str
    items: tuple[tuple[str, Any], ...]


def named(x: Any, depth: int = 0) -> Any:
    """`state.describe(x)` with each value named: a tuple (an `Optimizer`) as `((field, node), ...)`
    in a list, a function as `NamedFn` (its closure variables' names from `co_freevars`), anything
    else as `describe` writes it. The values kept are `describe`'s (`described_cells`), so
    `unnamed` of it is `describe(x)` (`checkpoint._other_optimizer` checks)."""
    if isinstance(x, tuple):
        return [(n, named(v, depth)) for n, v in described_fields(x)]
    if not callable(x):
        return describe(x)
    items = [(name, named(v, depth + 1) if callable(v) else repr(v)) for name, v in described_cells(x, depth)]
    return NamedFn(getattr(x, "__qualname__", type(x).__qualname__), tuple(items))


def unnamed(node: Any) -> Any:
    if isinstance(node, NamedFn):
        return [node.qualname, [unnamed(v) for _, v in node.items]]
    if isinstance(node, list):
        return [unnamed(v) for _, v in node]
    return node


def setting_name(where: tuple[str, ...]) -> str:
    if where[:1] == ("lr",):
        rest = [w for w in where[1:] if w != "value"]
        return "lr" + (f" (schedule {'.'.join(rest)})" if rest else "")
    return where[-1] if where else "optimizer"


def check_same_settings(mesh: Mesh, what: str = "fzero.init", **settings: Any) -> None:
    """Raise on every rank unless every rank passed the same settings (`fzero.init`'s: stage,
    optimizer, buckets: units and groups, align, sync; or a `train_step`'s), naming the first that
    differs and each rank's value."""
    n = mesh.world_size
    if n == 1:
        return
    names = sorted(settings)
    mine = torch.tensor([settings_crc(settings[k]) for k in names], dtype=torch.int64, device=mesh.device)
    table = all_gather(mine, mesh, tag=f"{what}/settings").view(n, len(names))
    differ = (table != table[:1]).any(dim=0).nonzero().flatten().tolist()
    if differ:  # every rank has the same table, so every rank is here: the values in words
        col, name = differ[0], names[differ[0]]
        ranks = [r for r in range(n) if table[r, col] != table[0, col]]
        value = settings[name]
        mine = json.dumps(flat_settings(value) if name == "optimizer" else [[name, repr(value)[:300]]])  # `named`
        rows = [_numbered(json.loads(t)) for t in gather_texts(mesh, mine, f"{what}/settings/{name}")]
        shown = list(dict.fromkeys(  # one line per differing name and values (the lr sits in several closures)
            f"{_REPEAT.sub('', k)}: " + ", ".join(f"rank {r} {rows[r].get(k, '(none)')}" for r in [0, *ranks])
            for k in dict.fromkeys([*rows[0], *(k for r in ranks for k in rows[r])])
            if any(rows[r].get(k) != rows[0].get(k) for r in ranks)))
        listed = " and ".join(filter(None, (", ".join(names[:-1]), names[-1])))
        name_words = f"{name!r}" + (" (made of init's units= and groups=, and the params' requires_grad)"
                                    if name == "buckets" else "")
        raise ConfigError(f"{what} settings differ across ranks (world size {n}): {name_words}, rank(s) {ranks} differ "
                          f"from rank 0: {'; '.join(shown[:6]) or 'in what their descriptions hold'}"
                          f"{' ...' if len(shown) > 6 else ''}; every rank must pass the same {listed}")


def flat_settings(node: Any, where: tuple[str, ...] = ()) -> list[list[str]]:
    """`[name, value]` of every value a `named` description holds, depth first, named as
    `setting_name` names it (the lr inside `as_schedule`, else the closure variable or field);
    each function as `[its name, qualname]` too, so another function differs by its name."""
    if isinstance(node, NamedFn):
        where = ("lr",) if node.qualname.startswith("as_schedule.") else where
        head = [[f"{setting_name(where)} function" if where else "optimizer function", node.qualname]]
        return head + [kv for name, v in node.items for kv in flat_settings(v, where + (name,))]
    if isinstance(node, list):
        return [kv for name, v in node for kv in flat_settings(v, where + (name,))]
    return [[setting_name(where), str(node)]]


_REPEAT = re.compile(r" \(\d+\)$")  # the " (k)" `_numbered` adds to a name's k-th repeat


def _numbered(pairs: list[list[str]]) -> dict[str, str]:
    """`{name: value}` of `flat_settings`' pairs, a name's k-th repeat as "name (k)" (two closures
    may each hold a `beta1`), so that every occurrence is compared with its counterpart."""
    out: dict[str, str] = {}
    for k, v in pairs:
        key, i = k, 1
        while key in out:
            i += 1
            key = f"{k} ({i})"
        out[key] = v
    return out


def gather(state: ZeroState, *, values: Sequence[torch.Tensor] | None = None) -> Any:
    """The full params pytree of `state` (original structure and dtypes), on every rank; fresh
    tensors. With `values` (per bucket, a tensor of the shape, dtype and device of
    `own_values(state)`'s), the pytree of those in place of the state's own: an EMA of the
    weights kept per rank (README).

    Every rank must call it (at N > 1 it starts with a small all-gather of its own tag, so where a
    rank is in a step meanwhile both raise, `CollectiveMismatch` here and `DivergentPaths` or
    `CollectiveMismatch` in the step, rather than pair the step's gathers with this one's); where
    the stage shards params (or keeps a master shard), each bucket is all-gathered. The values are
    the master values, in the params' own dtype.

    Values, not a function of the state: where a `torch.func` transform differentiates the
    state's params, or the `values` given, in reverse mode it raises `ConfigError` on every rank:
    its result would carry no derivative, silently. Under plain autograd the result does not require grad.
    A forward-mode tangent (`jvp`) flows through it.
    """
    with checked(state):
        _refuse_derivative(state)
        if values is None:
            return _gathered(state)
        _refuse_values_derivative(state, values)
        return _gathered(state, _fitting_values(state, values))


def own_values(state: ZeroState) -> tuple[torch.Tensor, ...]:
    """Per bucket, this rank's values that `gather` reads: the master where the state keeps one
    (`state.master[i]`: fp32 under a bf16 policy at stages 1-2, on the host under `Offload`; a
    fresh host copy of the file under an NVMe tier), else `state.params[i]` (the rank's shard
    where the stage shards params). The state's own tensors otherwise, not copies: a donating step
    updates them in place. An EMA kept over them, element-wise, gathers with `gather(state,
    values=ema)` to the EMA of the gathered params bit for bit, in the master's dtype where there
    is one (an EMA over a bf16 `state.params` would be kept in bf16). Every rank
    calls it: after a donating step, the state's check of its pending update is collective."""
    with checked(state):
        return tuple(_own_value(state, b) for b in range(len(state.params)))


def _own_value(state: ZeroState, b: int) -> torch.Tensor:
    """Bucket b's entry of `own_values(state)`: the master's values where kept, else the params."""
    return state.params[b] if state.master[b] is None else master_values(state, b)


def holds_leaf(state: ZeroState, read: dict[int, torch.Tensor], path: str, p: torch.Tensor) -> bool | None:
    """Whether this rank's own values of leaf `path` (`own_values`' part of it: all of it where
    the bucket is whole here, the part in this rank's shard where sharded) equal the matching
    elements of `p`, compared in `p`'s dtype on its device; None where this rank holds none of it
    (a leaf in another rank's shard). `ModuleWrittenAfterInit`'s check of a module parameter
    written since `init`; `read` keeps each bucket's values read once (an NVMe master is a file:
    found in review, read once per leaf)."""
    with torch.no_grad():
        spec = next(leaf for leaf in state.layout.leaves if leaf.path == path)
        b = state.layout.buckets[spec.bucket]
        if b.index not in read:
            read[b.index] = _own_value(state, b.index)
        own = read[b.index]
        start = 0 if own.numel() == b.padded_numel else state.mesh.rank * b.shard_numel
        lo, hi = max(spec.offset, start), min(spec.offset + spec.numel, start + own.numel())
        if lo >= hi:
            return None
        if tuple(p.shape) != spec.shape:
            return False
        mine = own[lo - start:hi - start].to(device=p.device, dtype=p.dtype)
        return torch.equal(mine, p.detach().reshape(-1)[lo - spec.offset:hi - spec.offset])


def _refuse_values_derivative(state: ZeroState, values: Any) -> None:
    """`ConfigError` where a `torch.func` transform differentiates `gather(state, values=...)`
    through the values in reverse mode: read under `torch.no_grad()`, its derivative would be
    zero, silently (found in review, as `_refuse_derivative` for the state's own)."""
    level = func_level()
    held = [v for v in values if isinstance(v, torch.Tensor)] if isinstance(values, Sequence) else []
    if level is not None and _reverse_tracked(held):
        raise ConfigError(
            f"fzero.gather(state, values=...) with values being differentiated (a torch.func transform, level "
            f"{level}: grad, vjp, jacrev, ...; {state.mesh!r}, rank {state.rank}): gather reads them under "
            f"torch.no_grad() into fresh tensors, so a derivative through it would be zero, silently. Read them by "
            f"path differentiably with fzero.layout.unpack(state.layout, <the values, all-gathered where sharded>), "
            f"or call gather outside the transform")


def _fitting_values(state: ZeroState, values: Any) -> tuple[torch.Tensor, ...]:
    """`values` as `gather` reads them, or `ConfigError` naming the bucket, what it got and what
    `own_values(state)` holds there (its shape and dtype, without reading an NVMe file)."""
    own = [p if m is None else m for p, m in zip(state.params, state.master)]
    if isinstance(values, torch.Tensor) or not isinstance(values, Sequence) or len(values) != len(own):
        got = (f"a tensor {_shown(values)}" if isinstance(values, torch.Tensor) else
               f"{len(values)} values" if isinstance(values, Sequence) else type(values).__name__)
        raise ConfigError(f"gather(state, values=...) takes one tensor per bucket, {len(own)} here (as "
                          f"fzero.own_values(state) returns them), got {got}")
    for b, (v, o) in enumerate(zip(values, own)):
        if not isinstance(v, torch.Tensor) or v.shape != o.shape or v.dtype != o.dtype or v.device != o.device:
            got = f"{_shown(v)} on {v.device}" if isinstance(v, torch.Tensor) else type(v).__name__
            raise ConfigError(f"gather(state, values=...): bucket {state.layout.buckets[b].tag!r} takes "
                              f"{_shown(o)} on {o.device}, as fzero.own_values(state) holds it on rank "
                              f"{state.mesh.rank} of {state.mesh.world_size}, got {got}")
    return tuple(v.contiguous() for v in values)  # (a tensor expanded from one value: found in review)


def _gathered(state: ZeroState, values: tuple[torch.Tensor, ...] | None = None) -> Any:
    """`gather`'s values (of `values` in place of `own_values(state)` where given), read under
    `torch.no_grad()`, one unit gathered at a time."""
    with torch.no_grad():
        layout, mesh = state.layout, state.mesh
        if mesh.world_size > 1:  # its own tag first: a rank still in a step (whose gathers look alike) mismatches here
            all_gather(torch.zeros(1, device=mesh.device), mesh, tag="fzero.gather")
        leaves: list[Any] = [None] * len(layout.leaves)
        for program in unit_programs(layout, mesh, state.stage):  # no policy: read the master values
            xs = [_bucket_input(state, b, values) for b in program.buckets]
            # clone in a comprehension: a `for` over the views would leave its variable holding the last
            # one, and so this unit's gathered buffer alive while the next unit gathers
            clones = [t.clone() for t in gather_leaves(program, xs, cast=False)]  # one unit gathered at a time
            for i, t in zip(program.leaves, clones):
                leaves[i] = t
    return unflatten(layout.treespec, leaves)


def _refuse_derivative(state: ZeroState) -> None:
    """`ConfigError` where a `torch.func` transform differentiates `gather` in reverse mode
    (`_reverse_tracked` of the state's params and masters): it reads under `torch.no_grad()` into
    fresh tensors, so `torch.func.grad` of a function of its result was exact zeros, silently
    (found in review: a meta-gradient read by path through `gather`, stages 0 and 3, N = 1 and
    2). Plain autograd is not refused: its result does not require grad, a derivative of it alone
    raises in torch, and a logging read in a meta-learning loop whose params require grad is
    legitimate (found in review of the first refusal). Local: every rank differentiates the same
    program, so every rank raises, before `gather`'s first collective; a rank that alone raises
    does so inside `checked`'s mesh guard, so the others stop with `RankFailed` where they wait."""
    level = func_level()
    held = [t for t in (*state.params, *state.master) if isinstance(t, torch.Tensor)]
    if level is None or not _reverse_tracked(held):
        return
    sharded = state.stage.sharded("params") and state.mesh.world_size > 1
    buckets = state.layout.buckets
    cast = any(isinstance(p, torch.Tensor) and p.dtype != b.dtype for p, b in zip(state.params, buckets))
    p = "fzero.collectives.all_gather(p, state.mesh)" if sharded else "p"
    gathers = (f"[{p}.to(b.dtype) for p, b in zip(state.params, state.layout.buckets)]" if cast else
               f"[{p} for p in state.params]" if sharded else "state.params")
    notes = [f"each rank holds a shard of each bucket at stage {state.stage.level}: all-gather them first"] * sharded
    notes += ["the params are held in the policy's compute dtype: cast each to its bucket's dtype"] * cast
    notes += ["the params as held, in the compute dtype: this state keeps its master values apart"] * any(
        m is not None for m in state.master)
    policy = f" ({'; '.join(notes)})" if notes else ""
    raise ConfigError(
        f"fzero.gather of a state whose params are being differentiated (a torch.func transform, level {level}: "
        f"grad, vjp, jacrev, ...; {state.mesh!r}, rank {state.rank}, stage {state.stage.level}): gather reads the "
        f"values under torch.no_grad() into fresh tensors, so a derivative through it would be zero, silently. To "
        f"read the params by path differentiably, unpack the state's own tensors: "
        f"fzero.layout.unpack(state.layout, {gathers}){policy}; where no derivative is wanted, call gather under "
        f"torch.no_grad(), or of a state of detached params (state.replace(params=tuple(p.detach() for p in "
        f"state.params)))")


def _reverse_tracked(tensors: Sequence[torch.Tensor]) -> bool:
    """Whether a reverse-mode derivative is taken through any of `tensors`: under grad mode, one
    requires grad (plain autograd), or, inside a torch.func transform, one of its wrapper layers
    does (`grad`, `vjp`, `jacrev`, an outer level of a nested transform; vmap's batch does not):
    `optim.base.tracked` without forward-mode tangents, which `torch.no_grad()` does not stop
    (`jvp` through `gather` is right)."""
    grad_mode = torch.is_grad_enabled()
    return grad_mode and any(_layers_tracked(x, grad_mode, tangents=False) for x in tensors)


def _bucket_input(state: ZeroState, b: Any, values: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """What `gather_leaves` reads for bucket b: the params (or `values[b]`) where the state keeps
    no master. A master's values (or `values[b]`): where the stage shards params its `enter`
    gathers the master shard itself (an offloaded stage 3); else the master shard is all-gathered
    here into the full buffer the stage's `enter` passes through."""
    own = _own_value(state, b.index) if values is None else values[b.index]
    if state.master[b.index] is None:
        return own
    master = own.to(state.mesh.device)
    return master if state.stage.sharded("params") else all_gather(master, state.mesh, tag=b.tag)


def master_values(state: ZeroState, b: int) -> torch.Tensor:
    """Bucket b's master shard as a tensor to read: the state's own, or, where its tier keeps it
    in a file (NVMe), a fresh host copy read from there (`HostTier.read_master`) -- the state's
    stand-in holds zeros, never the values."""
    tier = state.info.host_tier(b)
    return state.master[b] if tier is None else tier.read_master(b, state.master[b])


def loss_scale_of(state: ZeroState) -> float:
    """The loss is multiplied by this before backward and the gradient divided by it after the
    reduction: the scaler's current scale (a Python float), or 1."""
    return 1.0 if state.loss_scale is None else float(state.loss_scale.scale)


def consume(state: ZeroState, wrote: bool = True) -> None:
    """Mark a state whose buffers a donating step wrote (or, `wrote=False`, handed on unwritten to
    the state it returns: a skipped overflow): using it again is an error. Its `_Buffers` count the
    write unless `lose` counted it before the first write (so that every other state holding them
    is refused too; the state the step returns, made after that, has the count). A skip writes
    nothing: found in review, a copy made before it was refused though its values were right."""
    if wrote and not isinstance(getattr(state, "_consumed", None), Lost):
        _count_write(state)
    object.__setattr__(state, "_consumed", True)


@dataclasses.dataclass
class Lost:
    """Why a state is lost (`lose`): its donating step raised `error` ("KeyboardInterrupt",
    "OptimizerError: ..."; None until the step's error path names it, `lost_by`) after its update
    had written buckets `buckets` (their tags; empty where not known) of the state in place; or
    (`pure`) a step that does not donate, whose optimizer's pure update wrote the state anyway."""

    error: str | None = None
    buckets: tuple[str, ...] = ()
    pure: bool = False

    def step_words(self, step: int, where: str = "") -> str:
        """The step that lost the state, in words, `where` (the mesh and rank) inside its brackets."""
        return (f"its step (step {step}{where}), whose optimizer's update (Optimizer.update, which must be pure) "
                f"wrote the state in place and" if self.pure else
                f"its donating step (train_step(donate=True), step {step}{where})")


def lose(state: ZeroState, pure: bool = False) -> None:
    """Mark `state` lost: set by a donating step just before its update first writes the state in
    place (`update.update`, `agreement.agree_launching`), so that an exception from there on --
    anywhere before the step marks it consumed (`consume`), which replaces the mark -- leaves a
    state that `check_state` refuses to read (`Lost`), but as a checkpoint's load target. One
    attribute write per step; `keep` takes the mark back where nothing was written after all."""
    if getattr(state, "_consumed", None) is None:
        object.__setattr__(state, "_consumed", Lost(pure=pure))
        _count_write(state)


def keep(state: ZeroState) -> None:
    """Take back `lose`'s mark: the update raised (or was skipped on the device) before any write."""
    if isinstance(getattr(state, "_consumed", None), Lost):
        object.__delattr__(state, "_consumed")
        _count_write(state, -1)


def lost_by(state: Any, error: BaseException, buckets: Sequence[str] = ()) -> None:
    """On a donating step's error path: where `state` is marked lost (`lose`) and its record names
    no error yet, name `error` (and the buckets written, where given), and add a note to `error`
    saying that the state is lost and the way out. Never raises."""
    lost = getattr(state, "_consumed", None)
    if not isinstance(lost, Lost):
        return
    with contextlib.suppress(Exception):
        if buckets and not lost.buckets:
            lost.buckets = tuple(buckets)
        if lost.error is None:
            words = said(error)
            lost.error = type(error).__name__ + (f": {words[:300]}{' ...' if len(words) > 300 else ''}" if words else "")
            error.add_note(f"fzero: {lost.step_words(int(state.step)).removeprefix('its ')} raised after its "
                           f"update had written its input state: that state is lost (a step, "
                           f"fzero.gather, fzero.evaluate or fzero.checkpoint.save of it raises). Restore it from a "
                           f"checkpoint: state = fzero.checkpoint.load(path, state)")


def lost_message(state: ZeroState, lost: Lost) -> str:
    """`check_state`'s error for a lost state (`Lost`): the step, what it raised, the buckets it
    wrote, that the state is lost and the way out."""
    n, step = len(state.layout.buckets), int(state.step)
    written = (f" (bucket(s) {list(lost.buckets[:6])}{' ...' if len(lost.buckets) > 6 else ''} of {n} updated)"
               if lost.buckets else "")
    return (f"this state (step {step}) is lost: {lost.step_words(step, f'; {state.mesh!r}, rank {state.rank}')} raised {lost.error or 'an exception'} after its update had written "
            f"the state in place{written}, so its buffers hold part of step {step + 1}'s values and part of step "
            f"{step}'s; a step, fzero.gather, fzero.evaluate or fzero.checkpoint.save of it would read that "
            f"mix. Restore it from a checkpoint: state = fzero.checkpoint.load(path, state) takes this state as its "
            f"target (only its structure is read); an exception raised before the update wrote anything leaves the "
            f"state usable")


def check_state(state: Any, *, pending: bool = True, holds: bool = True) -> None:
    """A `ZeroState` used on the rank and world size it was made for, not consumed, or a clear error.

    With `pending` (every reader but the step, which carries the flag in its agreement), a state
    made by a donating step whose update is not yet checked is checked first (`check_pending`:
    every rank together, one small all-gather). With `holds` (every reader but a checkpoint's load
    target, of which only the structure is read: the loaded state gets swap files of its own), an
    NVMe tier's state must be the one its files hold (`check_holds`), and no state may be lost
    (`lose`: its donating step raised after its update had written it in place; an NVMe tier's
    files rewritten that way say so first, as `OffloadError`)."""
    if not isinstance(state, ZeroState):
        raise FzeroError(f"expected the ZeroState made by fzero.init, got {type(state).__name__}{_not_state_hint(state)}")
    consumed = getattr(state, "_consumed", None)
    if consumed is True and holds:  # (a load target lends its structure only: found in review, refused)
        raise FzeroError(f"this state (step {int(state.step)}) was donated to a train_step(donate=True) and its "
                         f"buffers now hold the next state's values; use the state that step returned")
    mesh = state.mesh
    state.layout.check_world_size(mesh.world_size)
    if state.rank != mesh.rank:
        raise FzeroError(f"this state belongs to rank {state.rank} of {mesh!r} but runs on rank {mesh.rank}; "
                         f"hand each rank the state fzero.init made on it")
    if holds and state.info.tier is not None:
        state.info.tier.check_holds(state)  # NVMe: the state is the one whose values its files hold
    if holds and consumed is not None:  # (a `Lost`: a donating step raised after writing it in place)
        raise FzeroError(lost_message(state, consumed))
    if holds and _written_since(state):
        raise FzeroError(_written_words(state))
    if pending:
        check_pending(state)


def _not_state_hint(x: Any) -> str:
    """The likely mix-up behind a state that is no `ZeroState` (found in review: the words named
    the type only): a step's `(state, metrics)` pair, or the params themselves."""
    if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], ZeroState):
        return " of (ZeroState, ...): a step returns (state, metrics); unpack it, state, metrics = step(state, batch)"
    if isinstance(x, (dict, list, torch.Tensor)):
        return (" (the params? the state is what fzero.init(params, optimizer, stage=..., mesh=...) returns, and "
                "what each step returns first)")
    return ""


@contextlib.contextmanager
def checked(state: Any, *, pending: bool = True) -> Iterator[None]:
    """`check_state(state, pending=pending)`, then the caller's work, inside the state's mesh
    guard (`Mesh.guard`): where one rank's state is refused (donated already, another rank's, an
    NVMe state whose files moved on) the other ranks stop with `RankFailed` at the collective
    they wait in, instead of waiting out DistMesh's timeout. A `state` that is not a ZeroState
    names no mesh: its `FzeroError` is raised at once, and ranks that called with a state wait
    for that timeout (docs/bad-input.md)."""
    if not isinstance(state, ZeroState):
        check_state(state)
    with state.mesh.guard():
        check_state(state, pending=pending)
        yield


def check_pending(state: ZeroState) -> None:
    """Taken by every rank together where `state.pending` is set (a donating step made it): one
    all-gather of each rank's flag `[N]`, tag "fzero.state/pending"; `NonFiniteError` on every
    rank where some rank's update left a NaN or inf (`broken_update`). No collective otherwise."""
    if state.pending is None:
        return
    flag = state.pending.to(device=state.mesh.device, dtype=torch.float64).reshape(1)
    flags = all_gather(flag, state.mesh, tag="fzero.state/pending").tolist()
    ranks = [r for r, f in enumerate(flags) if f != 0]
    if ranks:
        raise broken_update(state, ranks)


def broken_update(state: ZeroState, ranks: Sequence[int]) -> NonFiniteError:
    """The error for a state whose donating update left a NaN or inf on `ranks` (every rank calls
    it: the leaves are found by `nonfinite_leaves` over what each rank updated, one all-reduce)."""
    layout, stage, rank = state.layout, state.stage, state.rank
    updated = _Updated(lambda b: stage.optimizer_params(layout, b, state.params[b], rank,
                                                        None if state.master[b] is None else master_values(state, b)),
                       [b.index for b in layout.buckets if not b.group.frozen])
    leaves = updated_nonfinite_leaves(state, updated)
    named = named_paths(leaves)
    advice = unmastered_words(state, leaves, "Lower the learning rate or keep params in a wider dtype; donate=False "
                              "checks each update before keeping it (and can skip it)") if leaves else PADDING_WRITTEN
    return NonFiniteError(
        f"step {int(state.step) - 1}: the update of a donating step (train_step(donate=True)) made the params NaN or "
        f"inf{range_words(state)} on rank(s) {list(ranks)} {f'in {named}' if leaves else 'outside every leaf'} "
        f"({state.mesh!r}, {len(leaves)} leaves). It wrote "
        f"the state in "
        f"place, so this state is lost: restore it from a checkpoint (fzero.checkpoint.load). {advice}")


def unmastered_words(state: ZeroState, paths: Collection[str], lr_advice: str) -> str:
    """The advice of a `NonFiniteError` whose update made leaves `paths` NaN or inf: `lr_advice`
    (the caller's "lower the learning rate ..."), or, where those leaves include trainable 16-bit
    params -- bf16 / fp16 as given to `fzero.init`, whose master values are then 16-bit too
    (`Stage.hold` keeps the master in the params' own dtype) -- words naming them and the way to an
    fp32 master. With an fp16 leaf among them the words replace `lr_advice`: in fp16 Adam's
    eps=1e-8 is 0, so a small (or zero) gradient element makes the update inf or NaN at any lr,
    and `on_nonfinite='skip'` then skips every step (found in review of a DeepSpeed port:
    `model.half()`). bf16 keeps fp32's exponent range and eps: there the lr may well be the cause,
    and the words follow `lr_advice` (found in review: they replaced it). The error path only: a
    read of the layout's leaf specs."""
    wanted = set(paths)
    half = [ls for ls in state.layout.leaves if ls.path in wanted and ls.dtype.itemsize == 2]
    if not half:
        return lr_advice
    dtypes, shown = leaves_words(half)
    named = f"params leaf {shown} is" if len(half) == 1 else f"params leaves {shown} are"
    given = (f"The {named} {'/'.join(dtypes)} as given to fzero.init, so the state keeps no wider master and the "
             f"optimizer updates {'it' if len(half) == 1 else 'them'} in {'/'.join(dtypes)} itself")
    fp32 = ("keep fp32 params (model.float() before fzero.from_module, or {k: v.float() for k, v in params.items()}) "
            "and compute in 16 bits under precision=")
    if "float16" not in dtypes:
        return (f"{lr_advice}. {given}: for an fp32 master, {fp32}fzero.Precision(torch.bfloat16, torch.float32) "
                f"(DeepSpeed's bf16 mode: bf16 compute, fp32 master)")
    return (f"{given}: in float16 small constants and squares underflow to 0 (Adam's eps=1e-8 is 0, so an element "
            f"whose squared gradient underflows, or is 0, divides by 0), whatever the lr; a lower learning rate does "
            f"not help, and on_nonfinite='skip' would skip every such step. {fp32[0].upper()}{fp32[1:]}"
            f"fzero.Precision(torch.float16, torch.float32) and loss_scale=fzero.DynamicLossScale() (DeepSpeed's "
            f"fp16 mode: fp16 compute, fp32 master, dynamic loss scaling)")


def range_words(state: ZeroState) -> str:
    """Where some bucket computes in a dtype of narrower range than its master: the words saying
    that a master value past that range counts as inf (`Precision.within`)."""
    narrow = sorted({str(w).removeprefix("torch.") for b in state.layout.buckets
                     if (w := state.info.precision.within(b)) is not None})
    return f" (or past {'/'.join(narrow)}'s range, the dtype the units compute in)" if narrow else ""


class _Updated:
    """`{bucket: what its optimizer updated}` read one bucket at a time (`items`), so a master kept
    in files is copied to the host per bucket while it is checked, never all at once."""

    def __init__(self, read: Any, buckets: Sequence[int]) -> None:
        self.read, self.buckets = read, buckets

    def items(self) -> Any:
        return ((b, self.read(b)) for b in self.buckets)


PADDING_WRITTEN = (
    "The optimizer's update wrote NaN or inf outside every leaf, into the padding at the end of a shard (the "
    "elements ctx.segments leave out), which fzero's finite check reads with the rest. An update must leave the "
    "padding as it found it (zeros): compute over ctx.segments, or write zeros there")  # (found in review:
# the step took the check for a non-finite leaf, found none, and kept the old state without a word)


def updated_nonfinite_leaves(state: ZeroState, updated: dict[int, torch.Tensor]) -> list[str]:
    """`nonfinite_leaves` of what this rank's optimizer updated per bucket (`Stage.optimizer_params`:
    its shard, or stage 0's whole buffer), each leaf piece where `Stage.segments` puts it; cast to
    the bucket's compute dtype where its range is narrower (`Precision.within`), as the update's
    finite check reads it."""
    within = {b.index: state.info.precision.within(b) for b in state.layout.buckets}
    return nonfinite_leaves(state, updated, mine=lambda b, p: p if within[b] is None else p.to(within[b]),
                            where=state.stage.segments)


def nonfinite_leaves(state: ZeroState, tensors: dict[int, torch.Tensor], mine: Any = None, where: Any = None
                     ) -> list[str]:
    """Taken by every rank together: the leaves whose values in `tensors` (per bucket; by default
    the *reduced* gradients, of which each rank reads its shard) hold a NaN or inf, by one
    all-reduce `[L]` (max), tag "fzero.step/nonfinite". `mine(b, t)` picks what this rank checks,
    `where(layout, b, rank)` its segments. The rare path: one host read per segment."""
    layout, stage, mesh, rank = state.layout, state.stage, state.mesh, state.rank
    mine = mine or (lambda b, g: stage.grad_shard(layout, b, g, rank))
    where = where or (lambda layout, b, rank: layout.segments(b, rank))
    flags = torch.zeros(len(layout.leaves), dtype=torch.float64, device=mesh.device)
    for b, g in tensors.items():
        local = mine(b, g)
        for seg in where(layout, b, rank):
            if not bool(torch.isfinite(local[seg.start : seg.stop]).all()):
                flags[seg.leaf] = 1.0
    flags = all_reduce(flags, mesh, "max", tag="fzero.step/nonfinite")
    return [layout.leaves[i].path for i in (flags > 0).nonzero().flatten().tolist()]


def check_same_layout(layout: Layout, mesh: Mesh) -> None:
    """Raise on every rank unless all ranks planned the same leaves (paths, shapes, dtypes)."""
    n = mesh.world_size
    if n == 1:
        return
    me = torch.tensor([len(layout.leaves), settings_crc(str(layout.treespec))], dtype=torch.int64, device=mesh.device)
    rows = all_gather(me, mesh, tag="fzero.init/structure").view(n, 2).tolist()
    if any(row[0] != rows[0][0] for row in rows):
        counts = ", ".join(f"rank {r}: {row[0]} {'leaf' if row[0] == 1 else 'leaves'}" for r, row in enumerate(rows))
        # every rank is here (the rows are theirs): the paths, so the words name the leaves (found in review)
        paths = [set(json.loads(t)) for t in gather_texts(mesh, json.dumps([ls.path for ls in layout.leaves]),
                                                          tag="fzero.init/paths")]
        apart = "; ".join(f"rank {r} " + ", ".join(
            f"{word} {named_paths(sorted(which), 4)}" for word, which in (("has", paths[r] - paths[0]),
                                                                       ("lacks", paths[0] - paths[r])) if which)
            for r in range(1, n) if paths[r] != paths[0])
        raise LayoutError(f"params differ across ranks (world size {n}): {counts}" + (
            f" ({apart}, against rank 0's)" if apart else "") + "; every rank must pass the same pytree structure")
    # per leaf: its path, dtype and shape (each a checksum, so the message can say which differs) and numel
    per_leaf = [[settings_crc(ls.path), settings_crc(str(ls.dtype)), settings_crc(ls.shape), ls.numel]
                for ls in layout.leaves]
    sig = torch.tensor(per_leaf or [[0, 0, 0, 0]], dtype=torch.int64, device=mesh.device).view(-1)
    table = all_gather(sig, mesh, tag="fzero.init/leaves").view(n, -1, 4)
    differ = (table != table[:1]).any(dim=2).any(dim=0).nonzero().flatten().tolist()
    if differ or any(row[1] != rows[0][1] for row in rows):
        if not differ:  # every leaf alike: the containers differ (a list on one rank, a tuple on another, ...)
            specs = gather_texts(mesh, str(layout.treespec)[:400], tag="fzero.init/treespec")  # the same words
            # on every rank (found in review: each named its own)
            each = "; ".join(f"rank {r}: {spec}" for r, spec in enumerate(specs) if r == 0 or spec != specs[0])
            raise LayoutError(f"params differ across ranks (world size {n}): the leaves' paths, shapes and dtypes "
                              f"agree but the pytree structure does not ({each}); every rank must pass the same "
                              f"containers")
        i = differ[0]
        ls = layout.leaves[i]
        col = table[:, i, :]

        def ranks_differing(c: int) -> list[int]:
            return [r for r in range(n) if col[r, c].item() != col[0, c].item()]

        # every rank's path, dtype and shape of the leaf, in words (every rank is here: the table is theirs)
        each = [json.loads(t) for t in gather_texts(
            mesh, json.dumps([ls.path, str(ls.dtype).removeprefix("torch."), list(ls.shape), ls.numel]),
            tag="fzero.init/leaf")]
        sizes = ", ".join(f"rank {r}: {path!r} {dtype}{shape} ({numel} elements)"
                          for r, (path, dtype, shape, numel) in enumerate(each))
        if ranks_differing(0):
            sizes += (f" (the paths differ: rank(s) {ranks_differing(0)} have another path than rank 0's at leaf "
                      f"{i} in flatten order)")
        elif len({col[r, 3].item() for r in range(n)}) == 1:
            what = [name for c, name in ((1, "dtype"), (2, "shape")) if ranks_differing(c)]
            sizes += (f" (same count, other shape or dtype: the {' and '.join(what)} "
                      f"{'differ' if len(what) > 1 else 'differs'} on rank(s) "
                      f"{sorted(set(ranks_differing(1) + ranks_differing(2)))} from rank 0's)")
        more = f"; {len(differ) - 1} later leaf(s) differ too" if len(differ) > 1 else ""
        raise LayoutError(f"params differ across ranks (world size {n}) at leaf {each[0][0]!r} (rank 0's path; leaf "
                          f"{i} of {len(layout.leaves)} in flatten order): {sizes}{more}. Every rank must pass the "
                          f"same paths, shapes and dtypes: build the params the same way on every rank (the same "
                          f"model, config and dtype, nothing sized by the rank or by its data), and make each rank's "
                          f"part of the work its batch, not its params")
