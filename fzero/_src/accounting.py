"""Accounting: the bytes a rank really holds and the bytes its collectives really move.

Two halves, each with a formula and a measurement that tests hold against each other:

- memory: `held_bytes(state)` reads the tensors a `ZeroState` holds (what `fzero.accounting.estimate`
  predicts); `storage_bytes(tree)` is an independent census of live distinct storages, and
  `LiveStorages` a dispatch mode that tracks the live and peak bytes of the storages allocated
  during a step (all of them, or those a predicate picks, in total or per group).
- communication: `comm_volume(records, N)` sums the collectives that `Mesh.record()` logged;
  `expected_comm(layout or Ψ, N, stage, ...)` is the per-step formula, read from the `Stage`
  (proofs/communication.md).

Ring model of wire bytes per rank (what one rank sends; it receives as much):

    all_gather, reduce_scatter of B logical bytes (the whole N * S buffer):  (N - 1)/N · B
    all_reduce of B bytes (reduce-scatter, then all-gather):                2(N - 1)/N · B
    broadcast of B bytes (pipelined ring: every rank but the last forwards):   B   (0 if N == 1)

Collectives whose tag starts with "fzero." (the step's agreement all-gather, `init`'s structure
check) or ends with "/leaf_sum" (a layer-wise optimizer's per-leaf sums) are *control*: small,
independent of Ψ, reported apart and never part of the data volume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from fractions import Fraction
from typing import Any, NamedTuple, Union

import optree
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .errors import ConfigError, as_int
from .layout import Layout, check_world_size
from .mesh import Mesh
from .optim.base import spec_of
from .precision import as_dtype
from .stages import Stage, get_stage

OPS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
CONTROL_PREFIX = "fzero."
CONTROL_SUFFIX = "/leaf_sum"


# ------------------------------------------------------------------------------------- memory


class HeldBytes(NamedTuple):
    """Bytes of model state one rank holds, per category (as `fzero.accounting.estimate` names them).

    `params` counts the params tensors the state holds, `grads` the paper's gradient bytes of the
    stage (`grad_bytes`: at stage 1 the full gradient, an upper bound on the reduced shard its
    update reads). `optimizer_state` counts every optimizer-state tensor, sharded and replicated
    fields alike; `optimizer_leaf` is the part in replicated fields, "leaf", "rows" and "cols"
    (per-leaf step counts: `[L_b]` float32 per trainable bucket; factored row / column statistics),
    or None when `held_bytes` was not given the optimizer. `master` counts the master shards a state
    keeps apart from its params (stages 1-2 under a precision policy); 0 where the params are the
    master copy. `tiers`: the same split by where each tensor lives (`TierSplit`), or None.
    """

    params: int
    grads: int
    optimizer_state: int
    master: int
    optimizer_leaf: int | None = None
    tiers: "TierSplit | None" = None

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.master


class TierSplit(NamedTuple):
    """`held_bytes` by where the state keeps each tensor: `device` (the mesh's), `host` (the
    offload tier's host memory) and `nvme` (the swap files' fields, at their logical size), each a
    `HeldBytes` (without `tiers`). Where a tensor lives is read from the state's settings (the
    bucket's host tier, `Offload.params`), not from `tensor.device`: on a CPU-only machine the
    device is the host too.

    `grads` per tier: the device's is `grad_bytes` (the reduced gradient every trainable bucket
    has at the update, as `HeldBytes.grads`); the host's is the copy of each offloaded bucket's
    reduced `shard[S]` that the update reads (transient, as the device's; what
    `estimate(..., offload=...)`'s `host.grads` counts). So the tiers' totals add up to
    `HeldBytes.total` plus `host.grads`, which `HeldBytes.total` never counted."""

    device: HeldBytes
    host: HeldBytes
    nvme: HeldBytes


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in optree.tree_leaves(tree, none_is_leaf=False) if isinstance(x, torch.Tensor)]


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(tree))


def grad_bytes(layout: Layout, stage: int | Stage) -> int:
    """Bytes of gradient a rank holds under `layout` at `stage` (0-3 or a `Stage`; gradients are
    transient, so this is read from the layout), as the ZeRO paper counts it: per trainable
    bucket, the reduced `shard[S]` where the stage shards gradients (stages 2-3, reduce-scattered
    during backward), else `flat[N * S]`. At stage 0 that is the all-reduced buffer the update
    reads. At stage 1 it is the paper's full gradient, which fzero's stage 1 holds as local
    gradients at the end of the backward under `accumulate="once"` (the autograd engine with
    "each" holds one or two units' at a time); its update reads the reduced shard, as stage 2's
    does (found in review: this said the update's buffer at every stage), so at stage 1 this is
    an upper bound on what the step holds at the update
    (`tests/test_accounting.py::test_stage_1_updates_a_reduced_shard_where_grad_bytes_counts_the_papers_full_gradient`)."""
    if not isinstance(layout, Layout):  # (found in review: an int was an AttributeError, 'buckets')
        raise ConfigError(f"grad_bytes: expected a fzero.layout.plan layout (state.layout), got "
                          f"{type(layout).__name__} {layout!r}; for a bare parameter count use "
                          f"fzero.accounting.estimate(count, world_size, stage=...).grads")
    sharded = get_stage(stage).sharded("grads")
    return sum((b.shard_numel if sharded else b.padded_numel) * b.dtype.itemsize
               for b in layout.buckets if not b.group.frozen)


def held_bytes(state: Any, optimizer: Any = None) -> HeldBytes:
    """`ZeroState -> HeldBytes` of this rank, from the tensors the state holds.

    params: Σ nbytes of `state.params` (`flat[N * S]` in stages 0-2, `shard[S]` in stage 3), but
    for a bucket whose params tensor is its master (params offloaded without a narrower compute
    dtype: one host tensor), which counts once, as master;
    optimizer_state: Σ nbytes of every tensor in `state.opt_state`; grads: `grad_bytes`.
    With `optimizer` (the `fzero.optim` triple the state was made with), its `spec` splits off
    the replicated fields (every kind but "shard") into `optimizer_leaf`.
    Tensors count wherever they live: under `fzero.Offload` the host's master and optimizer state
    count too, and NVMe's file-backed fields count at their stand-ins' logical size; `tiers`
    (`TierSplit`) says how much of each is on the device, in host memory and in files (compare
    `estimate(..., offload=...)`'s `host` and `nvme`).
    """
    tiers = tier_split(state, optimizer)  # checks `state` first
    return HeldBytes(
        params=sum(t.params for t in tiers),
        grads=tiers.device.grads,  # grad_bytes
        optimizer_state=_nbytes(state.opt_state),
        master=_nbytes(state.master),
        optimizer_leaf=None if optimizer is None else sum(t.optimizer_leaf for t in tiers),
        tiers=tiers,
    )


def tier_split(state: Any, optimizer: Any = None) -> TierSplit:
    """`TierSplit` of a state's bytes (see there). Per bucket b: `params[b]` is on the host where
    params are offloaded (every bucket, frozen ones too), else on the device; `master[b]` and
    `opt_state[b]` are on the host where b has a host tier (`StateInfo.host_tier`), else on the
    device -- but an NVMe tier's file-backed fields (`NvmeTier.fields`), master shards
    (`NvmeTier.masters`) and, params="nvme", compute-dtype shards (`NvmeTier.shards`) are in
    files."""
    from .state import ZeroState  # here: `state` imports what accounting imports, not the converse

    if not isinstance(state, ZeroState):  # found in review: a params dict was an AttributeError ('info')
        raise ConfigError(f"held_bytes / tier_split: state must be the ZeroState fzero.init made (one rank's), got "
                          f"{type(state).__name__} {state!r:.80}; for the bytes of a params pytree use "
                          f"fzero.accounting.storage_bytes or estimate")
    info = state.info
    params_off = info.offload.params is not None
    tiers = ("device", "host", "nvme")
    acc = {t: dict(params=0, grads=0, optimizer_state=0, master=0, optimizer_leaf=0) for t in tiers}
    acc["device"]["grads"] = grad_bytes(state.layout, state.stage)
    shard_files = getattr(info.tier, "shards", None) or {}  # params="nvme": the shards' swap files
    for b, spec in enumerate(state.layout.buckets):
        tier = info.host_tier(b)
        if state.params[b] is not state.master[b]:  # one tensor (params offload, no policy): counted as master
            where = "nvme" if b in shard_files else "host" if params_off else "device"
            acc[where]["params"] += _nbytes(state.params[b])
        if spec.group.frozen:
            continue
        if tier is not None:
            acc["host"]["grads"] += spec.shard_numel * spec.dtype.itemsize  # the update's copy of the shard
        master_in_file = b in (getattr(tier, "masters", None) or {})  # NVMe: the master shard's swap file
        acc["device" if tier is None else "nvme" if master_in_file else "host"]["master"] += _nbytes(state.master[b])
        opt = state.opt_state[b]
        if opt is None:
            continue
        on_file = {k for k, _ in (getattr(tier, "fields", None) or {}).get(b, ())}
        kinds = spec_of(optimizer, opt) if optimizer is not None else (None,) * len(opt)
        for k, (field, kind) in enumerate(zip(opt, kinds)):
            where = "device" if tier is None else ("nvme" if k in on_file else "host")
            acc[where]["optimizer_state"] += _nbytes(field)
            if kind is not None and kind != "shard":
                acc[where]["optimizer_leaf"] += _nbytes(field)
    if optimizer is None:
        for a in acc.values():
            a["optimizer_leaf"] = None
    return TierSplit(*(HeldBytes(**acc[t]) for t in tiers))


def storage_bytes(tree: Any) -> int:
    """Bytes of the distinct live storages the tensors of `tree` reach (deduplicated by
    `untyped_storage().data_ptr()`): an oracle that does not read fzero's layout. Views into
    one buffer count it once; a small view of a big buffer counts the whole buffer."""
    seen: dict[int, int] = {}
    for t in _tensors(tree):
        st = t.untyped_storage()
        seen[st.data_ptr()] = max(seen.get(st.data_ptr(), 0), st.nbytes())
    return sum(seen.values())


class LiveStorages(TorchDispatchMode):
    """A census of the storages aten ops allocate while entered: the bytes live now and at peak.

    Every op's output whose storage is not one of the op's inputs' storages is a new allocation
    (views and in-place results share an input's storage and are skipped); it is tracked, through
    a weak reference to the C++ storage (`StorageWeakRef`: the census never keeps a storage
    alive), until that expires. Storages created before the mode was entered (the state, the
    batch) are never counted, so `peak` is the most bytes above what existed at entry. A tracked
    storage counts its size *now* (re-read at every op): one shrunk by `resize_(0)` counts 0
    until it is resized again. Internal scratch buffers of a single kernel are invisible to it.

    Args:
      count: `count(tensor) -> bool`, asked about each new storage (with the op output holding
        it, on the thread running the op): only storages it accepts are tracked. Default: all.
        E.g. `lambda t: t.untyped_storage().nbytes() in sizes` for gradient-shaped storages.
      group: `group(tensor) -> key`, asked with `count`: the group a tracked storage is counted
        in, for `peaks`. Default: one group, `None`. E.g. `lambda t: threading.get_ident()` for
        a peak per SimMesh rank thread.

    Attributes (updated after every op):
      current: bytes of the tracked storages live now, over all groups.
      peak: the most `current` has been.
      peaks: `{key: the most bytes group key has held at once}`, for every group seen.

    History: every tracked storage's life is kept as `(birth, death, bytes, key)` over an op
    counter (`tick`, advanced once per op): alive at tick t iff `birth <= t < death`, at the most
    bytes it held. `relabel(tensor, key)` changes the key of the live storage a tensor uses, for
    its whole life, before and after: a storage whose role is known only after it was made (a
    gradient that reaches its consumer later) is counted in its role from its birth.
    `peaks_of(select)` is the most bytes the storages whose final key `select` accepts held at
    once, per `key_group(key)`, over the whole history -- an oracle whose identification of
    storages does not depend on their sizes.

    Thread-locality: torch keeps the dispatch-mode stack per thread, and SimMesh computes a
    collective's results for all ranks on whichever rank thread completes the round. So enter
    one *shared* `LiveStorages` inside every rank's function: it then counts the live bytes of
    all ranks together (exact, whichever thread allocates), and `peak` is the peak of the sum.
    With `group` by thread, a collective's results count for the thread that built them. One
    rank runs at a time, so no lock is needed beyond SimMesh's own.
    """

    def __init__(self, count: Callable[[torch.Tensor], bool] | None = None,
                 group: Callable[[torch.Tensor], Hashable] | None = None) -> None:
        super().__init__()
        from torch.multiprocessing.reductions import StorageWeakRef

        self._ref = StorageWeakRef
        self._count = count if count is not None else _always
        self._group = group if group is not None else _one_group
        self._live: dict[int, tuple[Any, Life]] = {}  # storage cdata -> (weak ref, its life)
        self.history: list[Life] = []  # every tracked storage's life, in birth order
        self.tick = 0
        self.peak = 0
        self.current = 0
        self.peaks: dict[Hashable, int] = {}
        self._by_group: dict[Hashable, int] = {}  # group -> bytes live now

    def _sweep(self) -> None:
        """Drop expired storages (their death is now) and re-read the others' sizes into
        `current`, `_by_group` and their lives' most bytes."""
        self._by_group = {}
        for k, (ref, life) in list(self._live.items()):
            st = None if ref.expired() else torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            if st is None:
                life.death = self.tick
                del self._live[k]
                continue
            life.nbytes = max(life.nbytes, st.nbytes())
            self._by_group[life.key] = self._by_group.get(life.key, 0) + st.nbytes()
        self.current = sum(self._by_group.values())

    def relabel(self, t: torch.Tensor, key: Hashable) -> bool:
        """Give the live tracked storage `t` uses the key `key` for its whole life (the group it
        counts in from now on, and in `peaks_of`); False (nothing changed) if it is not tracked."""
        entry = self._live.get(t.untyped_storage()._cdata)
        if entry is None:
            return False
        entry[1].key = key
        return True

    def peaks_of(self, select: Callable[[Hashable], bool],
                 key_group: Callable[[Hashable], Hashable] | None = None) -> dict[Hashable, int]:
        """`{key_group(key): the most bytes its storages held at once}` over the history, counting
        the storages whose final key `select` accepts (still-live ones as alive to the end)."""
        key_group = key_group if key_group is not None else _one_group
        events: list[tuple[int, int, Hashable, int]] = []  # (tick, 0 death / 1 birth, group, bytes)
        for life in self.history:
            if not select(life.key):
                continue
            g = key_group(life.key)
            events.append((life.birth, 1, g, life.nbytes))
            if life.death is not None:
                events.append((life.death, 0, g, -life.nbytes))
        now: dict[Hashable, int] = {}
        peaks: dict[Hashable, int] = {}
        for _, _, g, delta in sorted(events, key=lambda e: (e[0], e[1])):  # deaths at a tick come first
            now[g] = now.get(g, 0) + delta
            peaks[g] = max(peaks.get(g, 0), now[g])
        return peaks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ins = {x.untyped_storage()._cdata for x in optree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)}
        out = func(*args, **kwargs)
        self.tick += 1
        for t in optree.tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            st = t.untyped_storage()
            if st._cdata in ins or st._cdata in self._live or not self._count(t):
                continue
            life = Life(self.tick, None, st.nbytes(), self._group(t))
            self._live[st._cdata] = (self._ref(st), life)
            self.history.append(life)
        self._sweep()
        for key, nbytes in self._by_group.items():
            self.peaks[key] = max(self.peaks.get(key, 0), nbytes)
        self.peak = max(self.peak, self.current)
        return out


@dataclasses.dataclass
class Life:
    """One tracked storage's life in a `LiveStorages` history: born after op `birth`, gone at op
    `death` (None: still live), at most `nbytes`, counted under `key` (its group, or its label)."""

    birth: int
    death: int | None
    nbytes: int
    key: Hashable


def _always(t: torch.Tensor) -> bool:
    return True


def _one_group(t: torch.Tensor) -> None:
    return None


# ------------------------------------------------------------------------------ communication


class OpTotal(NamedTuple):
    """One op's totals over some collectives of one rank: how many, their logical elements and
    bytes (`CollectiveRecord` conventions: N * S for all_gather / reduce_scatter), and the
    bytes the rank sends on the wire under the ring model (exact, a `Fraction`)."""

    count: int
    elements: int
    bytes: int
    wire_bytes: Fraction


@dataclasses.dataclass(frozen=True)
class CommVolume:
    """Collectives of one rank on a mesh of `world_size` ranks, per op: `data` (what moves params
    and grads) and `control` (tags "fzero.*" and "*/leaf_sum", reported apart). Totals cover
    `data` only."""

    world_size: int
    data: Mapping[str, OpTotal]
    control: Mapping[str, OpTotal] = dataclasses.field(default_factory=dict)

    @property
    def elements(self) -> int:
        return sum(t.elements for t in self.data.values())

    @property
    def bytes(self) -> int:
        return sum(t.bytes for t in self.data.values())

    @property
    def wire_bytes(self) -> Fraction:
        return sum((t.wire_bytes for t in self.data.values()), Fraction(0))

    @property
    def count(self) -> int:
        return sum(t.count for t in self.data.values())


def wire_factor(op: str, world_size: int) -> Fraction:
    """Bytes one rank sends per logical byte, ring model (module docstring)."""
    n = check_world_size(world_size)
    if op in ("all_gather", "reduce_scatter"):
        return Fraction(n - 1, n)
    if op == "all_reduce":
        return Fraction(2 * (n - 1), n)
    if op == "broadcast":
        return Fraction(int(n > 1))
    raise ConfigError(f"unknown collective {op!r}; expected one of {OPS}")


def is_control(tag: str | None) -> bool:
    """True for fzero's small bookkeeping collectives: tag "fzero.*" or "*/leaf_sum"."""
    return tag is not None and (tag.startswith(CONTROL_PREFIX) or tag.endswith(CONTROL_SUFFIX))


def _totals(items: Iterable[tuple[str, int, int]], world_size: int) -> dict[str, OpTotal]:
    out: dict[str, OpTotal] = {}
    for op, elements, nbytes in items:
        c, e, b, w = out.get(op, OpTotal(0, 0, 0, Fraction(0)))
        out[op] = OpTotal(c + 1, e + elements, b + nbytes, w + nbytes * wire_factor(op, world_size))
    return {op: out[op] for op in OPS if op in out}


def comm_volume(records: Sequence[Any], world_size: int, *, rank: int | None = None, steps: int = 1) -> CommVolume:
    """`records` (what `Mesh.record()` recorded) -> one rank's `CommVolume`, per step.

    `world_size` is the size of the mesh that recorded them. The records carry no world size, so
    what can be checked is: every record's rank is below it, every all_gather / reduce_scatter
    counts a multiple of it (`N * S` elements), and records of several ranks (as `SimMesh`
    records: every rank) hold exactly `world_size` ranks; else ConfigError. `rank` picks whose
    records to sum (default: the lowest rank present); it must be present (no records at all, a record
    taken where nothing was communicated, give an empty `CommVolume`). Every rank present
    must have called the same sequence of (op, dtype, elements, tag), else ConfigError: on a
    correct mesh they always do. `steps` (an int >= 1, the steps the records cover) divides the
    totals (they must divide evenly).
    """
    world_size = _world_size(world_size, "comm_volume")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"comm_volume: steps must be an int >= 1 (the optimizer steps the records cover), "
                          f"got {steps!r}")
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size):
        raise ConfigError(f"comm_volume: rank must be None or an int in [0, {world_size}) (world_size={world_size}), "
                          f"got {rank!r}")
    by_rank: dict[int, list[Any]] = {}
    for r in records:
        by_rank.setdefault(r.rank, []).append(r)
    if not by_rank:
        return CommVolume(world_size, {}, {})
    _check_recorded_world(by_rank, world_size)
    key = lambda r: (r.op, r.reduce, r.dtype, r.elements, r.tag)  # noqa: E731
    first = min(by_rank)
    for r, recs in by_rank.items():
        if [key(x) for x in recs] != [key(x) for x in by_rank[first]]:
            raise ConfigError(f"ranks {first} and {r} recorded different collectives; records must come from "
                             f"one mesh's complete steps")
    if rank is not None and rank not in by_rank:
        raise ConfigError(f"comm_volume: rank={rank} recorded nothing; the records hold ranks {sorted(by_rank)}: "
                          f"pick one of them, or leave rank out")
    mine = by_rank[first if rank is None else rank]
    data = _totals(((x.op, x.elements, x.bytes) for x in mine if not is_control(x.tag)), world_size)
    control = _totals(((x.op, x.elements, x.bytes) for x in mine if is_control(x.tag)), world_size)
    if steps != 1:
        data, control = _per_step(data, steps), _per_step(control, steps)
    return CommVolume(world_size, data, control)


def _world_size(world_size: Any, fn: str) -> int:
    world_size = as_int(world_size)  # (np.int64, as estimate takes it)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"{fn}: world_size must be an int >= 1 (the size of the mesh), got {world_size!r}")
    return world_size


def _check_recorded_world(by_rank: Mapping[int, Sequence[Any]], world_size: int) -> None:
    """What records tell of the world size they were made at must agree with `world_size`."""
    ranks = sorted(by_rank)
    fix = "pass the world size of the mesh that recorded them"
    if ranks[-1] >= world_size or ranks[0] < 0:
        raise ConfigError(f"comm_volume: world_size={world_size}, but the records hold ranks {ranks}: {fix}")
    if len(ranks) > 1 and len(ranks) != world_size:
        raise ConfigError(f"comm_volume: world_size={world_size}, but the records hold {len(ranks)} ranks {ranks} "
                          f"(records of several ranks, as SimMesh makes, hold every rank): {fix}")
    for x in by_rank[ranks[0]]:
        if x.op in ("all_gather", "reduce_scatter") and x.elements % world_size:
            raise ConfigError(f"comm_volume: world_size={world_size}, but a recorded {x.op} (tag {x.tag!r}) counts "
                              f"{x.elements} elements, not a multiple of it (N * S): {fix}")


def _per_step(totals: dict[str, OpTotal], steps: int) -> dict[str, OpTotal]:
    out = {}
    for op, t in totals.items():
        if t.count % steps or t.elements % steps or t.bytes % steps:
            raise ConfigError(f"{op}: totals {t} are not a whole multiple of {steps} steps")
        out[op] = OpTotal(t.count // steps, t.elements // steps, t.bytes // steps, t.wire_bytes / steps)
    return out


class _Buf(NamedTuple):
    unit: str
    elements: int  # N * S (padded), or Ψ for a bare count
    itemsize: int
    trainable: bool


Model = Union[Layout, int]


def _bufs(model: Model, world_size: int) -> list[_Buf]:
    if isinstance(model, Layout):
        model.check_world_size(world_size, "world size argument")
        return [_Buf(b.unit, b.padded_numel, b.dtype.itemsize, not b.group.frozen) for b in model.buckets]
    count = as_int(model)  # (found in review: 7.5e9 and np.int64 were refused, as "Ψ >= 0", where estimate takes them)
    if isinstance(count, float) and count.is_integer():
        count = int(count)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ConfigError(f"expected_comm: expected a Layout or a parameter count Ψ (an int, or a whole float such as "
                          f"7.5e9) >= 0, got {model!r}")
    return [_Buf("default", count, 4, True)]


def expected_comm(
    model: Model,
    world_size: int,
    stage: int | Stage,
    *,
    grad_dtype: torch.dtype | None = None,
    param_dtype: torch.dtype | None = None,
    regather: bool | Iterable[str] = False,
    accumulation: int = 1,
    accumulate: str = "each",
    mesh: Mesh | None = None,
) -> CommVolume:
    """Data collectives of one rank in one optimizer step (control collectives excluded).

    `stage` is 0-3 or a `Stage`. `model` is a `fzero.layout.plan` layout (one buffer of `N * S_b`
    elements per bucket b, padding included) or a bare count Ψ (one trainable fp32 buffer of Ψ
    elements). Each buffer's dtype is its bucket's unless `param_dtype` (gathers of params) /
    `grad_dtype` (reductions) say otherwise. The collectives per buffer are the stage's
    (`Stage.moves`); per trainable buffer of E elements:

        stage 0:  RS(E) + AG(E)          reduce, then gather the reduced gradient back; or
                  AR(E)                  one all-reduce on a `mesh` whose all-reduce has their bits
                                         (`Mesh.all_reduce_is_reduce_scatter_gather`), as DDP
        stage 1:  RS(E) + AG(E)          reduce; gather the updated params
        stage 2:  RS(E) + AG(E)          same collectives, reduced per unit during backward
        stage 3:  AG(E) + [AG(E)] + RS(E)  forward gather, backward re-gather if `regather`

    and in stage 3 every frozen buffer is gathered in forward (AG(E)) and again with its unit
    where `regather` says so (a frozen weight's backward reads it for its input's gradient; it
    is never reduced). `regather` is a bool or the set of units that are gathered again in
    backward: with `gather="on_use"`, the autograd engine and `from_module`, the units with a
    home submodule (every unit but one spread over the root) are freed after their forward and
    gathered again in backward, but for the forward's last at N > 1 (kept for its backward) and
    units whose backward reads none of their params (proofs/communication.md); with
    `gather="eager"` none is. In elements, stages 0-2 move 2Ψ,
    stage 3 2Ψ without and 3Ψ with the re-gather (proofs/communication.md); stage 0's one
    all-reduce counts Ψ elements (its buffer) and sends the wire bytes of RS + AG, 2(N-1)/N per byte.

    `grad_dtype` / `param_dtype`: a floating torch dtype of 16 bits or more, or its name ("bf16",
    "fp32", ... as `fzero.accounting.estimate` takes them), or None.

    `mesh`: the mesh the steps run on, where it decides which collectives a stage issues (stage 0's
    all-reduce); None: the reduce-scatter + all-gather form. Its world size must be `world_size`.

    With k = `accumulation` micro-batches per step, what happens in forward and backward happens
    k times; with `accumulate="each"` the reductions too (stage 0: k·(RS + AG) or k·AR, stages 1-2:
    k·RS + AG, stage 3: k·(AG + [AG] + RS)); with "once" (stages 0-1) the reduction runs once
    after the last micro-batch (stage 0: RS + AG, stage 1: RS + AG).
    """
    st = get_stage(stage)
    world_size = _world_size(world_size, "expected_comm")
    # found in review: "bf16" was an AttributeError ('str' object has no attribute 'itemsize'), torch.int32 taken
    grad_dtype = None if grad_dtype is None else as_dtype(grad_dtype)
    param_dtype = None if param_dtype is None else as_dtype(param_dtype)
    if isinstance(accumulation, bool) or not isinstance(accumulation, int) or accumulation < 1:
        raise ConfigError(f"accumulation must be an int >= 1 (micro-batches per step), got {accumulation!r}")
    if accumulate not in ("each", "once"):
        raise ConfigError(f"accumulate must be 'each' or 'once', got {accumulate!r}")
    if accumulate == "once" and st.sharded("grads"):  # as `train_step` refuses it (`step.micro_batches_of`)
        raise ConfigError(f"expected_comm: accumulate='once' adds full local gradients and reduces them once, but "
                          f"stage {st.level} shards gradients (it keeps only a shard), so train_step refuses it; "
                          f"use accumulate='each', or stage 0 or 1")
    if mesh is not None and mesh.world_size != world_size:
        raise ConfigError(f"expected_comm: world_size={world_size} but mesh {mesh!r} has world size "
                          f"{mesh.world_size}; pass mesh.world_size, or leave mesh out")
    per_micro = ("forward", "regather", "backward") if accumulate == "each" else ("forward", "regather")
    bufs = _bufs(model, world_size)
    again = (lambda u: regather) if isinstance(regather, bool) else _regathered(regather, bufs).__contains__
    items: list[tuple[str, int, int]] = []
    for b in bufs:
        sizes = {"params": param_dtype.itemsize if param_dtype is not None else b.itemsize,
                 "grads": grad_dtype.itemsize if grad_dtype is not None else b.itemsize}
        for move in st.moves(b.trainable, again(b.unit), mesh):
            items += [(move.op, b.elements, b.elements * sizes[move.what])] * (
                accumulation if move.when in per_micro else 1)
    return CommVolume(world_size, _totals(items, world_size), {})


def _regathered(regather: Any, bufs: Sequence[_Buf]) -> frozenset[str]:
    """`expected_comm`'s `regather` as a set of unit names, each a unit of the model. A str is
    refused: iterating it would give its characters, not one unit."""
    units = sorted({b.unit for b in bufs})
    if isinstance(regather, str) or not isinstance(regather, Iterable):
        raise ConfigError(f"expected_comm: regather must be a bool or a set of unit names, got {regather!r}"
                          + (f"; for the one unit pass regather={{{regather!r}}}" if isinstance(regather, str) else ""))
    names = frozenset(regather)
    if any(not isinstance(u, str) for u in names):
        raise ConfigError(f"expected_comm: regather must hold unit names (str), got {sorted(map(repr, names))}")
    unknown = sorted(names - set(units))
    if unknown:
        raise ConfigError(f"expected_comm: regather names units the model does not have: {unknown}; its units: "
                          f"{units}")
    return names


def agreement_elements(layout: Layout) -> int:
    """Elements (float64) of the step's one agreement all-gather: N · (L + B + 10), L leaves, B
    buckets (loss, a used flag per leaf, a non-finite flag per bucket, the rank's part of ‖g‖², its
    token count, its flag of a donating update not yet checked, the fingerprint of its step's
    settings, its state's step counter, which `init` made it, its optimizer's lr at the step, its
    loss scale and its loss scaler's update count)."""
    return layout.world_size * (len(layout.leaves) + len(layout.buckets) + 10)
