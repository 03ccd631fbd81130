"""Checkpoints on torch.distributed.checkpoint (DCP), in a canonical per-leaf form: `save` on N
ranks at stage s, `load` on M at stage t.

What is written does not depend on the world size or the stage. For every leaf of the layout
(`layout.leaves`, flatten order) a checkpoint holds 1-D canonical tensors, under DCP names:

  params/<path>         the leaf's master values, unpadded, in the leaf's dtype: `[numel]`
  opt/<f>/<path>        optimizer state field `f`, per its spec kind (`KINDS`): a "shard" field
                        the leaf's elements `[numel]`, a "leaf" field the leaf's one entry `[1]`
  step, loss_scale/<f>  the step counter and the loss scaler's state (0-d, as the state holds them)
  rng/<r>/cpu           rank r's `torch.get_rng_state()`; `rng/<r>/cuda` too where CUDA is
                        initialised on the rank's device (`torch.cuda.get_rng_state(device)`)
  buffer/<name>         where `save(..., buffers=)` was given module buffers: rank 0's, whole,
                        of their own shape and dtype (listed in the manifest's "buffers")
  manifest/sha256       rank 0's uint8 `[32]`: the sha256 of the manifest's every field but
                        "files" (`seal`; absent from checkpoints saved before it): not a leaf

Rank r of N writes, of each canonical tensor, the elements of its shard `[r * S, (r + 1) * S)` of
each bucket (`layout.segments(b, r)`), whatever the stage holds there (the stage-3 shard, the
stage 1-2 master shard, or its slice of a replicated `flat[N * S]`), as one DCP chunk whose
offset is the leaf element it starts at; "leaf" fields and the scalars, replicated, are written by
rank 0. So every element is written exactly once, and DCP's metadata (`.metadata`) lists, per
canonical tensor, the chunks `(offset, size)` and the file each is in. Loading at (M, t), a rank
asks DCP for the one range of each canonical tensor it holds (its shard's window, or the whole
leaf where the stage replicates), DCP's `create_read_items_for_chunk_list` resolves which saved
chunks overlap it, and only those are read. Resharding is a copy of bits (proofs/checkpoint.md).

Coordination. On DistMesh, `dcp.save` / `dcp.load` run over the mesh's process group (DCP
exchanges the plans, one `__<r>_0.distcp` file per rank). SimMesh has no process group: the ranks'
shards are all-gathered (an exact copy), and rank 0 writes every rank's chunks in one
`dcp.save(no_dist=True)`; each rank loads by itself with `dcp.load(no_dist=True)`.

On disk, `root/step-<n>/`: DCP's files (`.metadata`, `*.distcp`), then `manifest.json`, written
last: layout, stage, world size, optimizer, the lr schedule's values at the saved step and steps
to come (`lr_record`), precision, scaler, step, and the sha256 and size of every DCP file. All
but "files" is known before the data is written, and sealed in it (`manifest/sha256`): `load`,
`export` and `summary` refuse a manifest that is not the one written with the data
(`check_record`); a damaged "files" entry fails the check of the file it names. Crash
safety: ranks write into `root/.tmp-step-<n>-<token>`, then agree (that every rank's write
succeeded), then rank 0 writes the manifest and renames the folder to `step-<n>` with one atomic
`os.rename`; `keep` renames an old checkpoint back to a `.tmp-step-*` name before deleting it. A
folder named `step-<n>` with a valid manifest is therefore complete; `latest` only ever returns
such a folder, and never one whose manifest is shown edited after the save (its seal differs:
skipped with a warning, `_sealed_last`). A save that fails (a full disk) raises `CheckpointError`
on every rank and rank 0 removes its temporary folder; a crash leaves it to the next
`save(keep=...)`.

Agreement. Every rank checks its own arguments, then the ranks agree (`_agree`: one all-gather of
a row per rank) before anything is written or read, so every rank raises or none does: `save`
agrees that every rank was given the same folder (and step) and that every rank sees the folder
rank 0 created; `load` agrees that every rank read the same checkpoint (its manifest's step and
sha256) and that every rank found it fit.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import dataclasses
import functools
import hashlib
import json
import math
import os
import re
import shutil
import stat
import threading
import types
import warnings
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .collectives import broadcast, gather_rows, gather_texts
from .errors import FzeroError, MeshError, OffloadError, as_int, outside_stacklevel
from .estimate import short_name
from .layout import Layout, LeafSpec
from .mesh import DistMesh, HeldInterrupts, Mesh
from .module import aliased, buffers_written
from .nvme import NoRoom
from .originals import tied_names
from .offload import place, place_opt_state
from .optim.base import FACTORED, IMPLS, check_hyper, field_shapes, leaf_blocks, spec_of
from .precision import Precision
from .scale import LossScaleState
from .state import (NamedFn, ZeroState, check_pending, check_state, describe, described_cells, described_fields,
                    master_values, named, outside_inference_mode, setting_name, unnamed)

FORMAT = 2
MANIFEST = "manifest.json"
DIGEST = "manifest/sha256"  # the DCP name of the sha256 of the manifest's head, saved with the data (`seal`)
_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_DIR = re.compile(r"^\.tmp-step-\d+-[0-9a-f]+$")
GROUP_KEYS = ("weight_decay", "lr_scale")  # a leaf record's group settings that `load` compares
CRASH_POINTS = ("before_data", "mid_data", "before_manifest", "before_rename")


class CheckpointError(FzeroError, ValueError):
    """A checkpoint is missing, incomplete, corrupted, or does not fit the target state."""


class BuffersNotLoaded(UserWarning):
    """`load` without `buffers=` of a checkpoint saved with them: the module buffers stay as
    they are."""


class OldCheckpointNotRemoved(UserWarning):
    """`save(..., keep=K)` wrote and published the new checkpoint but could not delete an older one
    (a permission, a busy file): the save stands; the folder named stays for the user to remove."""


class CheckpointNotSynced(UserWarning):
    """`save` wrote, published and renamed the checkpoint into place, but the fsync of its root
    after the rename failed: the checkpoint is complete and `latest` names it, but after a power
    loss the rename may be lost. The save stands (it returns the path on every rank)."""


class UnsealedCheckpointSkipped(UserWarning):
    """`latest` / `complete` (and `save`, which reads the root's order) skipped a checkpoint whose
    manifest is not the one saved with its data (`check_record`: edited after the save, e.g. its
    `written`): it is never `latest`, and `save(..., keep=K)` never deletes it."""


class LrScheduleMovedOn(UserWarning):
    """The lr schedule gave two values at one step, read twice by `save` (or `load`): it is not a
    function of the step alone (a function around an object that moves on at each call), so
    `save` recorded no lr values (`load` compared none)."""


class _Crash(RuntimeError):
    """Raised by `save(_fail_at=...)` to simulate a crash at a named point (tests only)."""


# -- the canonical form: one table from spec kind to per-leaf tensors ------------------------------

Chunk = tuple[int, int, torch.Tensor]  # (leaf index, leaf_start, values[k]): what a rank writes
Request = tuple[int, int, torch.Tensor]  # (leaf index, leaf_start, destination view[k]): what it reads


def _window(layout: Layout, b: int, rank: int, sharded: bool) -> tuple[int, int]:
    """The flat elements `[lo, hi)` a rank holds of bucket `b`: its shard where `sharded`, else all."""
    spec = layout.buckets[b]
    s = spec.shard_numel
    return (rank * s, (rank + 1) * s) if sharded else (0, spec.padded_numel)


def _shard_chunks(layout: Layout, b: int, x: torch.Tensor, rank: int, sharded: bool) -> list[Chunk]:
    """The leaf elements in rank `rank`'s shard of bucket `b`, read from `x`: this rank's
    `shard[S]` (`sharded`) or the whole `flat[N * S]`. Views (`ChunkSavePlanner.resolve_data`
    copies one chunk at a time as it is written)."""
    shard = x if sharded else layout.rank_shard(b, x, rank)
    return [(seg.leaf, seg.leaf_start, shard[seg.start : seg.stop].detach())
            for seg in layout.segments(b, rank)]


def _shard_requests(layout: Layout, b: int, like: torch.Tensor, rank: int, sharded: bool
                    ) -> tuple[torch.Tensor, list[Request]]:
    """`(buffer[hi - lo], requests)`: a zero buffer for the window `[lo, hi)` of bucket `b`'s
    `flat[M * S]` this rank holds, and per leaf meeting the window the view of the buffer its
    elements `[a - o, z - o)` go to (o the leaf's offset, `[a, z)` its part of the window)."""
    lo, hi = _window(layout, b, rank, sharded)
    out = torch.zeros(hi - lo, dtype=like.dtype, device=like.device)
    requests = []
    for i in layout.buckets[b].leaves:
        ls = layout.leaves[i]
        a, z = max(ls.offset, lo), min(ls.offset + ls.numel, hi)
        if a < z:
            requests.append((i, a - ls.offset, out[a - lo : z - lo]))
    return out, requests


class Kind(NamedTuple):
    """How tensors of one spec kind map to canonical per-leaf tensors (one entry of `KINDS`).

    numel(leaf)                          the length of a leaf's canonical tensor
    chunks(layout, b, x, rank, sharded)  what rank `rank` writes of bucket `b`'s tensor `x`
    requests(layout, b, like, rank, sharded)  the buffer a rank holds and where each read goes
    """

    numel: Callable[[LeafSpec], int]
    chunks: Callable[[Layout, int, torch.Tensor, int, bool], list[Chunk]]
    requests: Callable[[Layout, int, torch.Tensor, int, bool], tuple[torch.Tensor, list[Request]]]


def _replicated(kind: str) -> Kind:
    """A field every rank holds whole ("leaf" `[L]`, factored "rows" / "cols"): one block per
    bucket leaf, of the leaf's canonical shape (`optim.base.field_shapes` / `leaf_blocks`); rank 0
    writes each non-empty block as that leaf's canonical tensor, every rank reads them all."""

    def shapes(layout: Layout, b: int) -> list[tuple[int, ...]]:
        return [layout.leaves[i].shape for i in layout.buckets[b].leaves]

    def blocks(layout: Layout, b: int, x: torch.Tensor) -> list[Chunk]:
        return [(leaf, 0, blk.reshape(-1)) for leaf, blk in
                zip(layout.buckets[b].leaves, leaf_blocks(kind, x, shapes(layout, b))) if blk.numel()]

    def chunks(layout: Layout, b: int, x: torch.Tensor, rank: int, sharded: bool) -> list[Chunk]:
        return [(leaf, o, t.detach()) for leaf, o, t in blocks(layout, b, x)] if rank == 0 else []

    def requests(layout: Layout, b: int, like: torch.Tensor, rank: int, sharded: bool
                 ) -> tuple[torch.Tensor, list[Request]]:
        out = torch.zeros_like(like)
        return out, blocks(layout, b, out)

    return Kind(lambda ls: math.prod(field_shapes(kind, [ls.shape])[0]), chunks, requests)


KINDS: dict[str, Kind] = {"shard": Kind(lambda ls: ls.numel, _shard_chunks, _shard_requests),
                          **{kind: _replicated(kind) for kind in ("leaf", *FACTORED)}}


class Source(NamedTuple):
    """One tensor of a bucket that a checkpoint holds: params are of kind "shard"."""

    prefix: str  # "params" or "opt/<field>"
    kind: str  # a key of KINDS
    bucket: int
    tensor: torch.Tensor
    sharded: bool  # `tensor` is this rank's `shard[S]`, not the whole `flat[N * S]`


def sources(state: ZeroState) -> list[Source]:
    """The tensors `state` checkpoints: per bucket its master values (the stage 1-2 master shard
    if kept, else the params as the stage holds them) and each optimizer field, by its spec."""
    out = []
    for b in range(len(state.layout.buckets)):
        master = None if state.master[b] is None else master_values(state, b)  # NVMe: read from its file
        x, sharded = (master, True) if master is not None else (state.params[b], state.stage.sharded("params"))
        out.append(Source("params", "shard", b, x, sharded))
        opt, tier = state.opt_state[b], state.info.host_tier(b)
        opt = opt if opt is None or tier is None else tier.snapshot(b, opt)  # NVMe: read from its files
        if opt is not None:
            out += [Source(f"opt/{field}", kind, b, t, kind == "shard" and state.stage.sharded("optimizer_state"))
                    for field, kind, t in zip(opt._fields, spec_of(state.optimizer, opt), opt)]  # others: whole
    return out


class Canonical(NamedTuple):
    """A canonical tensor's chunks as DCP is given them: `{offsets: values}` of a tensor of `size`."""

    size: tuple[int, ...]
    chunks: dict[tuple[int, ...], torch.Tensor]


def _whole(t: torch.Tensor) -> Canonical:
    return Canonical(tuple(t.shape), {(0,) * t.dim(): t.detach().clone()})


def canonical(layout: Layout, srcs: list[Source], rank: int) -> dict[str, Canonical]:
    """`{name: Canonical}`: the chunks rank `rank` writes of every source (see the module docstring)."""
    out: dict[str, Canonical] = {}
    for src in srcs:
        kind = KINDS[src.kind]
        for leaf, start, values in kind.chunks(layout, src.bucket, src.tensor, rank, src.sharded):
            ls = layout.leaves[leaf]
            out.setdefault(f"{src.prefix}/{ls.path}", Canonical((kind.numel(ls),), {})).chunks[(start,)] = values
    return out


def _rng_states(mesh: Mesh) -> dict[str, torch.Tensor]:
    """This rank's RNG states: torch's CPU generator, and CUDA's of the mesh's device where CUDA
    is initialised there (`torch.cuda.get_rng_state`; an uninitialised CUDA has no state to keep)."""
    out = {"cpu": torch.get_rng_state()}
    if mesh.device.type == "cuda" and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state(mesh.device)
    return out


def _set_rng_states(mesh: Mesh, states: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and mesh.device.type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.set_rng_state(states["cuda"], mesh.device)


def _scalars(state: ZeroState, buffers: dict[str, torch.Tensor] | None = None) -> dict[str, Canonical]:
    """Rank 0's whole tensors: the step, the loss scaler's state, the module buffers given."""
    out = {"step": _whole(state.step), **{f"buffer/{k}": _whole(t) for k, t in (buffers or {}).items()}}
    if state.loss_scale is not None:
        out.update({f"loss_scale/{f}": _whole(t) for f, t in zip(state.loss_scale._fields, state.loss_scale)})
    return out


def _merge(into: dict[str, Canonical], more: dict[str, Canonical]) -> dict[str, Canonical]:
    for name, c in more.items():
        into.setdefault(name, Canonical(c.size, {})).chunks.update(c.chunks)
    return into


def state_dict(state: ZeroState, buffers: dict[str, torch.Tensor] | None = None) -> dict[str, Canonical]:
    """What this rank hands `dcp.save`: on DistMesh its own chunks (and rank 0 the scalars and
    its `buffers`, `buffer/<name>`); on SimMesh rank 0 every rank's, from all-gathered shards and
    RNG states (a collective: every rank calls it), the others nothing."""
    layout, mesh, rank = state.layout, state.mesh, state.rank
    srcs = sources(state)
    rng = _rng_states(mesh)
    if isinstance(mesh, DistMesh) or mesh.world_size == 1:
        out = canonical(layout, srcs, rank)
        out.update({f"rng/{rank}/{k}": _whole(t) for k, t in rng.items()})
        return _merge(out, _scalars(state, buffers)) if rank == 0 else out
    full = [s._replace(tensor=mesh.collective("all_gather", s.tensor, tag="fzero.checkpoint/gather"), sharded=False)
            if s.sharded else s for s in srcs]
    rngs = {k: mesh.collective("all_gather", t.to(mesh.device), tag="fzero.checkpoint/rng").cpu().view(
        mesh.world_size, -1) for k, t in rng.items()}
    if rank != 0:
        return {}
    out = _scalars(state, buffers)
    for r in range(mesh.world_size):
        _merge(out, canonical(layout, full, r))
        out.update({f"rng/{r}/{k}": _whole(t[r]) for k, t in rngs.items()})
    return out


# -- DCP planners ------------------------------------------------------------------------------------


def _crash_mid_data() -> None:
    raise _Crash("simulated crash half way through writing the data")


class ChunkSavePlanner(SavePlanner):
    """Writes the `{name: Canonical}` state dict `build()` makes (`dcp.save` is given an empty
    one): one DCP `SHARD` write item per chunk, at its offset in the canonical tensor; the global
    plan and metadata are DCP's default ones (the chunks of every rank's plan, per name). `build`
    runs in DCP's planning step (`set_up_planner`), where DCP catches what it raises and hands it
    to every rank (`_builder`). `crash` (tests): called half way through the data."""

    def __init__(self, build: Callable[[], dict[str, Canonical]], crash: Callable[[], None] | None = None) -> None:
        self._build, self._crash = build, crash

    def set_up_planner(self, state_dict: Any, storage_meta: Any = None, is_coordinator: bool = False) -> None:
        self._sd, self._resolved = self._build(), 0

    def create_local_plan(self) -> SavePlan:
        items = [WriteItem(index=MetadataIndex(name, torch.Size(off)), type=WriteItemType.SHARD,
                           tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(off), v.shape),
                                                       properties=TensorProperties.create_from_tensor(v),
                                                       size=torch.Size(c.size)))
                 for name, c in self._sd.items() for off, v in c.chunks.items()]
        self._half = len(items) // 2
        return SavePlan(items)

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        return create_default_global_save_plan(all_plans)

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor:
        if self._crash is not None and self._resolved == self._half:
            self._crash()
        self._resolved += 1
        t = self._sd[write_item.index.fqn].chunks[tuple(write_item.index.offset)]
        # a CPU view would be serialised with its whole storage: a compact copy of this chunk only
        # (DCP moves a GPU chunk to the host, which copies just its elements)
        return t if t.device.type != "cpu" or t.untyped_storage().nbytes() == t.nbytes else t.clone()


class ChunkLoadPlanner(LoadPlanner):
    """Reads the given read items (made by `read_plan`, overlaps resolved by DCP) into the
    destination views `{name: tensor}`: no other chunk is read."""

    def __init__(self, items: list[ReadItem], dests: dict[str, torch.Tensor]) -> None:
        self._items, self._dests = items, dests

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self._items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointError(f"{read_item.storage_index.fqn!r} is stored as bytes; fzero checkpoints hold tensors only")

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self._dests[read_item.dest_index.fqn]
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(d, o, n)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def read_plan(path: str, metadata: Metadata, wanted: dict[str, tuple[tuple[int, ...], torch.Tensor]]
              ) -> list[ReadItem]:
    """DCP read items filling each `wanted[name] = (offsets, dest)` (the range `[offsets,
    offsets + dest.shape)` of canonical tensor `name`) from the saved chunks that overlap it
    (`create_read_items_for_chunk_list`). Checked first: the name is saved, of dest's dtype, and
    the overlapping chunks cover every element of the range; else a `CheckpointError`."""
    items: list[ReadItem] = []
    for name, (off, dest) in wanted.items():
        md = metadata.state_dict_metadata.get(name)
        if md is None:
            raise CheckpointError(f"{path!r}: {name!r} is not in the checkpoint's DCP metadata; it is incomplete "
                                  f"or of another model")
        if not isinstance(md, TensorStorageMetadata) or md.properties.dtype != dest.dtype:
            got = md.properties.dtype if isinstance(md, TensorStorageMetadata) else type(md).__name__
            raise CheckpointError(f"{path!r}: {name!r} is saved as {got}, the target holds {dest.dtype}")
        chunk = ChunkStorageMetadata(offsets=torch.Size(off), sizes=dest.shape)
        mine = create_read_items_for_chunk_list(name, md, [chunk])
        covered = sum(math.prod(item.lengths) for item in mine)
        if covered != dest.numel():
            where = ", ".join(f"[{o}, {o + n})" for o, n in zip(off, dest.shape))
            raise CheckpointError(f"{path!r}: {name!r} has {covered} of the {dest.numel()} elements {where} this "
                                  f"rank needs in the checkpoint's chunks; it is incomplete")
        items += mine
    return items


def files_read(metadata: Metadata, items: list[ReadItem]) -> set[str]:
    """The DCP files the read items touch (`metadata.storage_data`: chunk -> file, offset, length)."""
    return {metadata.storage_data[item.storage_index].relative_path for item in items}


@contextlib.contextmanager
def _unwrapped(rank: int) -> Iterator[None]:
    """DCP wraps the exceptions its steps raise, per rank, in a `CheckpointException` (a
    `BaseException`): raise this rank's own one (else the lowest rank's, with a note naming it),
    so a disk-full `OSError` or a `CheckpointError` keeps its type; DCP's report is its cause."""
    try:
        yield
    except CheckpointException as e:
        if not e.failures:
            raise
        r = rank if rank in e.failures else min(e.failures)
        inner = e.failures[r][0]
        if r != rank:
            inner.add_note(f"raised on rank {r} inside torch.distributed.checkpoint")
        with contextlib.suppress(AttributeError):  # an exception type without a __dict__
            inner._fzero_rank = r  # (`_save_failed` names it)
        raise inner from e


_SINGLE = threading.RLock()  # reentrant: rank 0's `save` on SimMesh reads the root's last seal (`_found`,
# `_sealed_last`) inside its own `dcp.save`, where the state dict is built


@contextlib.contextmanager
def _single_process() -> Iterator[None]:
    """DCP warns "torch.distributed is disabled, unavailable or uninitialized, assuming the intent
    is to save (load) in a single process" on every call without a process group, even when
    `no_dist=True` asks for exactly that: fzero's single-process calls (SimMesh, export) mean it,
    so that one warning is ignored here. `warnings.catch_warnings` swaps the process-wide filter
    list, so these calls are serialised (SimMesh ranks are threads; they run one at a time anyway);
    reentrant, for the seal rank 0's `save` reads inside its own `dcp.save` (`_SINGLE`)."""
    with _SINGLE, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                                category=UserWarning)
        yield


def _reader(path: str) -> dcp.FileSystemReader:
    """The DCP storage reader of a checkpoint (one place, so a test can count what it reads)."""
    return dcp.FileSystemReader(path)


def _knowing(reader: dcp.StorageReader, metadata: Metadata) -> dcp.StorageReader:
    """`reader`, its `read_metadata` giving `metadata` (read already by the caller, checked
    against the manifest's sha256) where `dcp.load` would read and unpickle `.metadata` again.
    Found in review: `check_record`'s own `dcp.load` (the saved step and seal, ~3 KB) made
    `load`, `export` and `summary` read and unpickle the whole `.metadata` once more, on every
    rank (~190 B per saved chunk: 456 KB and 0.15 s for 600 AdamW leaves saved at N = 4), and
    each `dcp.load` had read it once more than the copy checked. Now `.metadata` is read once
    per call, and what DCP plans with is the copy that was checked."""

    def read_metadata(*args: Any, **kwargs: Any) -> Metadata:
        return metadata

    reader.read_metadata = read_metadata  # type: ignore[method-assign]
    return reader


def _dcp_load(path: str, metadata: Metadata, wanted: dict[str, tuple[tuple[int, ...], torch.Tensor]],
              items: list[ReadItem], mesh: Mesh | None) -> None:
    """`dcp.load` of the read items into the wanted destinations: over the process group on
    DistMesh, in this process (`no_dist`) on SimMesh and offline (`mesh` None). `metadata` is
    the checkpoint's, read already: DCP is given it, not left to read `.metadata` again
    (`_knowing`)."""
    dests = {name: dest for name, (_, dest) in wanted.items()}
    planner = ChunkLoadPlanner(items, dests)
    reader = _knowing(_reader(path), metadata)
    if isinstance(mesh, DistMesh):
        with _unwrapped(mesh.rank):
            dcp.load(dests, storage_reader=reader, planner=planner, process_group=mesh.group)
        return
    with _single_process(), _unwrapped(0):
        dcp.load(dests, storage_reader=reader, planner=planner, no_dist=True)


# -- arguments, and agreement across ranks ---------------------------------------------------------


def _checkpoint_path(x: Any, caller: str = "") -> str:
    """`_fspath` of a checkpoint's path (`root/step-<n>`, not a root) given to `caller`."""
    return _fspath(x, f"{caller}path (a checkpoint folder, root/step-<n>)", checkpoint=True)


def _fspath(x: Any, what: str, checkpoint: bool = False) -> str:
    """`x` (a str or an `os.PathLike` of one) as a str, or a `CheckpointError` naming the argument;
    a `checkpoint` path that is None is most likely `latest(root)` of a root with no complete
    checkpoint, and is said so (found in review: a resume written as `load(latest(root), state)`
    on a first run was told only the type)."""
    if isinstance(x, (str, os.PathLike)):
        p = os.fspath(x)
        if isinstance(p, str):
            return p
    latest_none = x is None and checkpoint
    hint = ("; fzero.checkpoint.latest(root) returns None where the root holds no complete checkpoint (a first "
            "run, or another root): check `path is not None` before loading") if latest_none else ""
    raise CheckpointError(f"{what} must be a str or os.PathLike, got {type(x).__name__} {_short(x)}{hint}")


def _clipped(text: str, n: int) -> str:
    """`text`, cut to `n` characters with "..." where longer."""
    return text if len(text) <= n else text[: n - 3] + "..."


def _short(x: Any, n: int = 80) -> str:
    return _clipped(repr(x), n)


def _error_text(e: BaseException, n: int = 600) -> str:
    return _clipped(f"{type(e).__name__}: {e}", n)


_KEY = 3  # the int64 words of the key a rank brings to an agreement


def _int64(text: str | bytes) -> int:
    """The first 8 bytes of the sha256 of `text` as a signed int64 (an entry of an agreement row)."""
    return int.from_bytes(hashlib.sha256(text.encode() if isinstance(text, str) else text).digest()[:8], "little",
                          signed=True)


def _hex(word: int) -> str:
    return f"{word & (2**64 - 1):016x}"


def _agree(mesh: Mesh, tag: str, error: BaseException | None, key: Sequence[int] | None, shown: str, *,
           failed: Callable[[list[tuple[int, str]]], str], same: Callable[[list[list[int]]], bool] | None = None,
           differ: Callable[[list[list[int]], list[str]], str] | None = None) -> None:
    """The ranks agree before a checkpoint is written or read: every rank raises, or none does.

    One all-gather of `[failed, has key, *key]` per rank: whether this rank's checks raised
    (`error`), and `key` (`_KEY` words naming what the rank works on: the checkpoint it read, the
    folder it was given; None where its checks stopped before it). Every rank sees the same rows,
    so every rank takes the same branch: it returns where no rank failed and the keys are `same`;
    otherwise the ranks exchange `shown` (what each was given) and their errors' text, and raise:
    where the keys differ `CheckpointError(differ(rows, shown per rank))` on every rank (a rank's
    own error added as a note); else a rank that failed its own error, the others
    `CheckpointError(failed([(rank, its error's text), ...]))`. Without `same` (and `differ`)
    no key is compared: only whether some rank failed. A rank whose checks raise
    something unexpected still reaches the all-gather (its caller catches every `Exception`), so
    no rank waits for it."""
    row = [int(error is not None), int(key is not None), *(list(key) if key is not None else [0] * _KEY)]
    rows = gather_rows(mesh, row, tag)
    keyed = [r[2:] for r in rows if r[1]]
    bad = [s for s, r in enumerate(rows) if r[0]]
    alike = same is None or same(keyed)
    if not bad and alike:
        return
    texts = gather_texts(mesh, shown + "\0" + ("" if error is None else _error_text(error)), tag)
    given = [t.partition("\0")[0] for t in texts]
    if not alike:
        assert differ is not None
        out = CheckpointError(differ(rows, given))
        if error is not None:
            out.add_note(f"rank {mesh.rank} also raised {_error_text(error)}")
        raise out
    if error is not None:
        raise error
    raise CheckpointError(failed([(s, texts[s].partition("\0")[2]) for s in bad]))


def _listed(failures: list[tuple[int, str]]) -> str:
    return "".join(f"\n  rank {s}: {text}" for s, text in failures)


def _checked_buffers(buffers: Any, what: str) -> dict[str, torch.Tensor] | None:
    """`buffers` as a dict `{name: tensor}` (None stays None), or a `CheckpointError` naming the
    entry that is not a str name of a tensor."""
    if buffers is None:
        return None
    if not isinstance(buffers, Mapping):
        raise CheckpointError(f"{what}: buffers must be None or a dict {{name: tensor}} (ModuleInfo.buffers of "
                              f"fzero.from_module), got {type(buffers).__name__} {_short(buffers)}")
    for k, v in buffers.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor) or not k:
            raise CheckpointError(f"{what}: buffers[{k!r}] must be a tensor under a non-empty str name, got "
                                  f"{type(v).__name__}")
    return dict(buffers)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_buffers_fit(path: str, manifest: dict[str, Any], buffers: dict[str, torch.Tensor]) -> None:
    """The checkpoint saved buffers of the names, shapes and dtypes of `buffers`, else a
    `CheckpointError` naming the first that differs."""
    saved = manifest.get("buffers")
    if saved is None:
        raise CheckpointError(f"{path!r} holds no module buffers (it was saved without "
                              f"checkpoint.save(..., buffers=...)); load it without buffers=, and keep the buffers "
                              f"the module has")
    theirs = {b["name"]: b for b in saved}
    if theirs.keys() != buffers.keys():
        missing, extra = sorted(buffers.keys() - theirs.keys()), sorted(theirs.keys() - buffers.keys())
        raise CheckpointError(f"{path!r} saved other buffers: not in the checkpoint {missing[:5]}, in the "
                              f"checkpoint only {extra[:5]}; pass every name its save was given in buffers= (the "
                              f"module's, and any of your own saved beside them, as {{**info.buffers, "
                              f"'batches_seen': t}}), each a tensor of its shape and dtype to load into")
    for k, t in buffers.items():
        if theirs[k]["shape"] != list(t.shape) or theirs[k]["dtype"] != _dtype_name(t.dtype):
            raise CheckpointError(f"{path!r}: buffer {k!r} was saved as {theirs[k]['dtype']}{theirs[k]['shape']}, "
                                  f"the one given is {_dtype_name(t.dtype)}{list(t.shape)}")


# -- saving --------------------------------------------------------------------------------------


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x))


def describe_layout(layout: Layout) -> list[dict[str, Any]]:
    """Per leaf: path, shape, dtype, unit, group, frozen and the group's weight_decay and lr_scale
    (what `load` checks: all but unit and group, the names)."""
    return [{"path": ls.path, "shape": list(ls.shape), "dtype": str(ls.dtype).removeprefix("torch."),
             "unit": ls.unit, "group": ls.group.name, "frozen": ls.group.frozen,
             "weight_decay": ls.group.weight_decay, "lr_scale": ls.group.lr_scale} for ls in layout.leaves]


# -- the lr schedule's values: what `describe` cannot see of it ------------------------------------

LR_AHEAD = (0, 1, 10, 100, 1000, 10_000, 100_000)  # a manifest's "lr": the saved step plus each of these


def schedule_source(schedule: Callable) -> Callable:
    """The callable `as_schedule` wrapped into `schedule` (its `source`: the reader of a sequence,
    the user's callable), else `schedule` itself (a float's lambda, a hand-made `Optimizer.lr`)."""
    return getattr(schedule, "source", schedule)


def _of_the_step(fn: Callable) -> bool:
    """Whether `fn` is a plain Python function, or a `functools.partial` of one: a schedule
    `save` and `load` read at steps to come, taken for a function of the step alone. A callable
    object or a bound method is not read: it may move on at each call (`as_schedule` calls a
    schedule once a step, so that one does so once a step, as a torch scheduler's `step()`),
    and a read outside a step would move it."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return isinstance(fn, types.FunctionType)


def _lr_at(fn: Callable, step: int) -> float | None:
    """`fn(step)` as the lr `as_schedule` makes of it (`check_hyper`), or None where that raises
    (the update at that step would raise: `step.scheduled_lr`, `as_schedule`). `fn` is the
    schedule's source (`schedule_source`), not `as_schedule`'s wrapper: the wrapper keeps the value
    of the step it read last, so a read through it would change what the next update computes,
    and would not call `fn` again at one step."""
    try:
        value = fn(step)
        return None if isinstance(value, torch.Tensor) else check_hyper("lr", value)
    except Exception:  # noqa: BLE001 - recorded as such: the step there raises it again
        return None


def _lr_values(fn: Callable, steps: Sequence[int], at: int) -> tuple[dict[int, float | None], float | None]:
    """`({s: _lr_at(fn, s)}, a second read at step `at`)` for each of `steps` (`at` among them):
    `at` is read first and again last, so a schedule that moves on as it is called (not a function
    of the step alone) gives two values there (`_moved_on`)."""
    values = {at: _lr_at(fn, at)}
    values.update({s: _lr_at(fn, s) for s in steps if s != at})
    return values, _lr_at(fn, at)


def _moved_on(values: dict[int, float | None], again: float | None, at: int, what: str) -> bool:
    """Whether the second read at step `at` (`_lr_values`) differs from the first: then a
    `LrScheduleMovedOn` warning (at the caller of `save` or `load`) saying `what`
    was not done and how many calls the reads cost."""
    if values[at] == again:
        return False
    warnings.warn(LrScheduleMovedOn(
        f"the lr schedule gave lr {_shown_lr(values[at])} at step {at}, then {_shown_lr(again)} at the same step "
        f"{len(values)} calls later: it is not a function of the step alone (a function around an object that "
        f"moves on at each call), so {what}; these reads called it {len(values) + 1} times on every rank, and "
        f"the object is that many calls ahead of the steps now. Pass the object itself as the lr (fzero reads it "
        f"once a step and never at a checkpoint; its position is not saved: after checkpoint.load, move it to the "
        f"loaded state's step yourself), or a schedule of the step"),
        stacklevel=outside_stacklevel())
    return True


def lr_record(optimizer: Any, step: int) -> list[list[Any]] | None:
    """The optimizer's lr (`Optimizer.lr`, before any group's `lr_scale`) at the saved `step`, the
    one its next update reads, and at each of `LR_AHEAD` steps after it: `[[s, lr or None], ...]`
    (None where the schedule raises there). A schedule is a function of the step, so its values
    to come are read at save; `load` reads the target's at the same steps and compares them
    exactly, so a schedule that differs where `describe` does not see -- a `functools.partial`'s
    arguments, a value read from an object -- is refused. None (nothing compared) where the
    optimizer has no lr, or its schedule is a callable object or a method (`_of_the_step`), or it
    gives two values at `step` (`_moved_on`: a warning). Every rank computes it (`save`), so a
    schedule that moves as it is called moves alike on every rank (found in review: rank 0 alone
    read it, and the next step's lr differed across ranks)."""
    values = _schedule_values(optimizer, [step + k for k in LR_AHEAD], step,
                              "checkpoint.save recorded no lr values and load will compare none")
    return None if values is None else [[s, values[s]] for s in sorted(values)]


def _schedule_values(optimizer: Any, steps: list[int], at: int, what: str) -> dict[int, float | None] | None:
    """The optimizer's lr schedule at `steps` (`_lr_values`: None where it raises), read from the
    function under its `as_schedule` wrapper (`schedule_source`); None where it has none, or one
    `load` does not read (`_of_the_step`), or one that gives two values at `at` (`_moved_on`,
    which warns `what`). What `lr_record` saves and `_check_lr` compares."""
    schedule = getattr(optimizer, "lr", None)
    fn = None if schedule is None else schedule_source(schedule)
    if fn is None or not _of_the_step(fn):
        return None
    values, again = _lr_values(fn, steps, at)
    return None if _moved_on(values, again, at, what) else values


def manifest_head(state: ZeroState, buffers: dict[str, torch.Tensor] | None = None, written: int = 0,
                  lr: list[list[Any]] | None = None) -> dict[str, Any]:
    """Every field of `state`'s manifest but "files" (each data file's sha256 and size, added
    once the data is written), as JSON reads it back: saved module `buffers` (name, shape, dtype
    each; None where none were given), `written` (its place in the order of the root's saves,
    `complete`) and `lr` (the `lr_record` every rank computed, `save`) among them. Known before
    the data is written: `seal` saves its sha256 with the data."""
    p = state.precision
    return _jsonable({
        "format": FORMAT,
        "step": int(state.step),
        "written": written,
        "stage": state.stage.level,
        "world_size": state.mesh.world_size,
        "leaves": describe_layout(state.layout),
        "optimizer": _jsonable(describe(state.optimizer)),
        "lr": lr,
        "precision": [str(p.param_dtype), str(p.reduce_dtype)],
        "scaler": None if state.info.scaler is None else repr(state.info.scaler),
        "buffers": None if buffers is None else [{"name": k, "shape": list(t.shape), "dtype": _dtype_name(t.dtype)}
                                                 for k, t in buffers.items()],
    })


def manifest_digest(manifest: Mapping[str, Any]) -> bytes:
    """The sha256 of every field of a manifest but "files", as canonical JSON (sorted keys, no
    spaces, ASCII): the same bytes for the head `save` hashed and the manifest `load` reads back
    (`json` writes every float so that it reads back the same float). "files" is left out: it is
    written after the data (each file's sha256), and a damaged entry of it fails the file check."""
    head = {k: v for k, v in manifest.items() if k != "files"}
    text = json.dumps(head, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(text.encode()).digest()


def seal(head: Mapping[str, Any]) -> dict[str, Canonical]:
    """What rank 0 saves with the data for the manifest's `head` (`manifest_head`): its
    `manifest_digest`, as a uint8 `[32]` tensor under the reserved DCP name `DIGEST` (not a leaf,
    buffer or scalar of the state: nothing reads it as one). `check_record` compares it with the
    manifest read back, so an edit the DCP metadata keeps no trace of (a reshape of the same
    numel, the stage, optimizer, lr record, precision, scaler, a leaf's group, `written`) is
    seen. (One place, so a test can write a checkpoint as fzero did before: without it.)"""
    return {DIGEST: _whole(torch.frombuffer(bytearray(manifest_digest(head)), dtype=torch.uint8))}


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write(path: str, data: bytes) -> None:
    """Write `data` to `path` and fsync it."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier(mesh: Mesh, tag: str) -> None:
    """Every rank reached this point (a collective: SimMesh has no process group)."""
    mesh.collective("all_reduce", torch.ones((), dtype=torch.int64, device=mesh.device), arg="sum", tag=tag)


def _token(state: ZeroState) -> int:
    """A random folder token every rank agrees on, from rank 0 (not from torch's RNG, which the
    checkpoint saves)."""
    mesh = state.mesh
    mine = torch.tensor(int.from_bytes(os.urandom(6), "little"), dtype=torch.int64, device=mesh.device)
    return int(broadcast(mine, mesh, 0, tag="fzero.checkpoint/token")) if mesh.world_size > 1 else int(mine)


def _dcp_save(build: Callable[[], dict[str, Canonical]], tmp: str, mesh: Mesh, crash: Callable[[], None] | None
              ) -> None:
    """`dcp.save` of this rank's chunks (`build()`, `_builder`) into `tmp`: over the process group
    on DistMesh, where DCP hands every rank the failures of all (`_unwrapped`: its own, else the
    lowest rank's); on SimMesh rank 0 alone, for every rank, with `no_dist`. An `Exception` is for the caller's
    agreement (`_write_data`); anything else (an interrupt) is followed by a barrier on DistMesh,
    so a peer whose process died surfaces as the mesh's `RankFailed`."""
    planner = ChunkSavePlanner(build, crash)
    if isinstance(mesh, DistMesh):
        try:
            with _unwrapped(mesh.rank):
                dcp.save({}, storage_writer=dcp.FileSystemWriter(tmp), planner=planner, process_group=mesh.group)
        except Exception:
            raise
        except BaseException:
            _barrier(mesh, "fzero.checkpoint/dcp-failed")
            raise
    elif mesh.rank == 0:
        with _single_process(), _unwrapped(0):
            dcp.save({}, storage_writer=dcp.FileSystemWriter(tmp), planner=planner, no_dist=True)


def _free_space(path: str) -> str:
    """"; its file system has <n> bytes free" of the folder `path`, or "" where that cannot be read."""
    try:
        return f"; its file system has {shutil.disk_usage(path).free:,} bytes free"
    except OSError:
        return ""


def _save_failed(e: Exception, doing: str, final: str, tmp: str, rank: int) -> CheckpointError:
    """What a rank raises where `doing` (its part of a save, after the temporary folder `tmp` was
    made) raised `e`, chained as the cause: the checkpoint, the rank `e` was raised on (this one,
    or the one DCP names), `e`, the free space there (a full disk reads as an `OSError` "No space
    left on device", or as torch's `RuntimeError` "[enforce fail at inline_container.cc] unexpected
    pos" out of its zip writer: found in review, neither named the folder) and the way out."""
    rank = getattr(e, "_fzero_rank", rank)  # DCP's: the rank it was raised on
    if not os.path.isdir(tmp):  # (found in review: another mesh's save with keep= removed it; "free space" misled)
        out = CheckpointError(
            f"checkpoint.save of {final!r}: {doing} failed on rank {rank} ({_error_text(e, 300)}): its temporary "
            f"folder {tmp!r} was removed while this save wrote it -- by another save into this root (a save with "
            f"keep= removes the temporary folders it finds: two meshes saving into one root, two process groups "
            f"or two jobs) --, so nothing of this save was kept; fzero.checkpoint.latest(root) names the last "
            f"complete checkpoint. Save each mesh's checkpoints to a root of its own, or save from one group only")
    else:
        out = CheckpointError(
            f"checkpoint.save of {final!r}: {doing} failed on rank {rank} ({_error_text(e, 300)}){_free_space(tmp)}; "
            f"nothing was saved: its temporary folder {tmp!r} is removed and fzero.checkpoint.latest(root) is the "
            f"checkpoint before; free space (or fix the cause) and save this step again")
    out.__cause__, out.__suppress_context__ = e, True  # as `raise out from e`, where `_agree` raises it
    return out


def _others_failed(final: str, tmp: str, mesh: Mesh) -> Callable[[list[tuple[int, str]]], str]:
    """The words of a rank whose part of a save succeeded where other ranks' failed (`_agree`)."""

    def failed(failures: list[tuple[int, str]]) -> str:
        return (f"checkpoint.save of {final!r}: {len(failures)} other rank(s) of {mesh!r} failed (rank 0 removes "
                f"the temporary folder {tmp!r}; fzero.checkpoint.latest(root) names the last complete checkpoint):"
                f"{_listed(failures)}")

    return failed


def _write_data(build: Callable[[], dict[str, Canonical]], tmp: str, final: str, mesh: Mesh,
                crash: Callable[[], None] | None) -> None:
    """`_dcp_save`, then the ranks agree that every rank's write succeeded (`_agree`, which also
    stands for a barrier: no rank goes on before every rank's data is written): a rank whose write
    raised raises it as `_save_failed`, the others a `CheckpointError` naming it, so every rank
    raises on DistMesh and on SimMesh alike (found in review: on SimMesh rank 0 alone writes, and
    the others stopped with `RankFailed`). A simulated crash (`_Crash`) and the mesh's own failure
    (a peer that died) are raised as they are."""
    error = None
    try:
        _dcp_save(build, tmp, mesh, crash)
    except (_Crash, MeshError):
        raise
    except Exception as e:  # noqa: BLE001 - agreed on first, then raised (_agree)
        error = _save_failed(e, "writing the data", final, tmp, mesh.rank)
    _agree(mesh, "fzero.checkpoint/data", error, None, repr(final), failed=_others_failed(final, tmp, mesh))


def _builder(state: ZeroState, buffers: dict[str, torch.Tensor] | None, head: _Head
             ) -> Callable[[], dict[str, Canonical]]:
    """What builds this rank's `state_dict` for `_write_data`, and on rank 0 the `seal` of the
    manifest's `head` (made there, in DCP's planning step, on either mesh). On DistMesh building
    it makes no collective, so it is left to DCP's planning step (`ChunkSavePlanner`), where DCP
    hands a failure (a host out of memory, an NVMe tier's file that cannot be read) to every rank,
    and every rank raises it through the data agreement (found in review: built before
    `dcp.save`, a failure on one rank left its peers inside DCP's collectives, killed by gloo). On
    SimMesh it all-gathers, a collective every rank makes: built here, as before."""
    sealed = (lambda: seal(head.fields)) if state.rank == 0 else dict
    if isinstance(state.mesh, DistMesh):
        return lambda: {**state_dict(state, buffers), **sealed()}
    sd = state_dict(state, buffers)
    return lambda: {**sd, **sealed()}


@dataclasses.dataclass
class _Head:
    """Rank 0's manifest head (`manifest_head`: `seal` hashes it as the data is written, `_publish`
    writes it) and the root's complete checkpoints before this save (`_found`: the head's
    `written` is one more than theirs, and `keep` deletes among them), each read once, at first
    use, before the data is written."""

    state: ZeroState
    root: str
    buffers: dict[str, torch.Tensor] | None
    lr: list[list[Any]] | None

    @functools.cached_property
    def before(self) -> list[tuple[int, int, str]]:
        return _found(self.root)

    @functools.cached_property
    def fields(self) -> dict[str, Any]:
        return manifest_head(self.state, self.buffers, 1 + max([w for w, _, _ in self.before], default=0), self.lr)


def _publish(tmp: str, final: str, root: str, head: _Head, fail_at: str | None) -> None:
    """Rank 0, once every rank's data is written: the manifest (its `head`, sealed in the data
    with its place `written` in the root's order and the `lr` record; then every file's sha256 and
    size), fsynced with the folder, then the atomic rename of `tmp` to `final` and an fsync of
    `root`."""
    if fail_at == "before_manifest":
        raise _Crash("simulated crash before the manifest was written")
    names = sorted(f for f in os.listdir(tmp) if os.path.isfile(os.path.join(tmp, f)))
    files = {f: {"sha256": _sha256(os.path.join(tmp, f)), "bytes": os.path.getsize(os.path.join(tmp, f))}
             for f in names}
    _write(os.path.join(tmp, MANIFEST), json.dumps({**head.fields, "files": files}, indent=1).encode())
    _fsync_dir(tmp)
    if fail_at == "before_rename":
        raise _Crash("simulated crash before the rename")
    try:
        os.rename(tmp, final)
    except OSError as e:
        if not os.path.isdir(final):
            raise
        raise CheckpointError(  # (found in review: two groups' meshes saving into one root were told of free space)
            f"checkpoint.save of {final!r}: another save published that folder while this one wrote its data -- two "
            f"meshes saving into one root (two process groups, or two jobs) --, so nothing of this save was kept: "
            f"its temporary folder {tmp!r} is removed and {final!r} is the other save's. Save each mesh's "
            f"checkpoints to a root of its own, or save from one group only") from e
    try:
        _fsync_dir(root)
    except OSError as e:  # a warning, not an error: the save stands (found in review: it raised on rank 0 and
        # the other ranks said the save failed, though the checkpoint was complete, and a retry found its step taken)
        warnings.warn(CheckpointNotSynced(
            f"checkpoint.save: {final!r} is complete and in place, and fzero.checkpoint.latest(root) names it, but "
            f"its root {root!r} could not be synced after the rename ({type(e).__name__}: {e}): after a power "
            f"loss the rename may be lost"), stacklevel=outside_stacklevel())


def _abandon(e: BaseException, rank: int, tmp: str, final: str) -> None:
    """After `e` inside a save whose temporary folder `tmp` exists (not a simulated crash, which
    leaves everything as a crash does): rank 0 removes `tmp` where it is still there (not
    renamed), best effort: a failure is a note on `e`, never another error. An `e` not in fzero's
    own words of a failed save (`RankFailed` of a peer that died, an interrupt) gets a note naming
    the checkpoint."""
    notes = getattr(e, "__notes__", [])
    if not isinstance(e, CheckpointError):
        note = f"raised inside checkpoint.save of {final!r}: not saved unless fzero.checkpoint.latest(root) names it"
        if note not in notes:  # (SimMesh's ranks raise one shared RankFailed)
            e.add_note(note)
    if rank == 0 and os.path.isdir(tmp):
        try:
            shutil.rmtree(tmp)
        except OSError as err:
            e.add_note(f"its temporary folder {tmp!r} could not be removed ({type(err).__name__}: {err}); the next "
                       f"checkpoint.save(..., keep=K) removes it, or remove it yourself")


def _same_folder(keys: list[list[int]]) -> bool:
    """The ranks name one folder: the same absolute path, or the same path with links resolved."""
    return any(len({k[i] for k in keys}) <= 1 for i in (0, 1))


def _folder_key(final: str) -> tuple[int, int, int]:
    return _int64(os.path.abspath(final)), _int64(os.path.realpath(final)), 0


def _state_key(state: ZeroState, keep: int | None = None) -> int:
    """Which state a rank saves, and how, as far as the ranks must agree before any collective of
    the save: the `init` that made it (`StateInfo.serial`), whether it carries a donated update
    not yet checked (`pending`: `check_pending` is collective only then), and `keep` (rank 0
    alone deletes: another rank's would be ignored, found in review)."""
    return _int64(f"{state.info.serial} {state.pending is not None} {keep}")


def _what_saved(final: str, state: ZeroState, keep: int | None = None) -> str:
    pending = ", its last donated update not yet checked" if state.pending is not None else ""
    kept = "" if keep is None else f", keep={keep}"
    return f"{final!r} (the state of init #{state.info.serial}{pending}{kept})"


def _same_save(keys: list[list[int]]) -> bool:
    """One folder (`_same_folder`) and one state and keep (`_state_key`) on every rank."""
    return _same_folder(keys) and len({k[2] for k in keys}) <= 1


def _visible(path: str) -> bool:
    """Whether this rank sees the folder `path` (one place, so a test can stand in for a rank
    whose file system is not the others')."""
    return os.path.isdir(path)


def _interrupts_held(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` with Ctrl-C held until it returns or raises (`HeldInterrupts`), then raised: a save is
    published (or fails) before the interrupt, and a load is read whole. Found in review: a SIGINT
    while a rank waited inside `torch.distributed.checkpoint`'s collectives left the others
    waiting to the timeout (a save, lost: the "save on Ctrl-C" a user writes) or aborted their
    process in gloo (a load). A second Ctrl-C is raised at once."""

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        with HeldInterrupts() as held:
            out = fn(*args, **kwargs)
        held.deliver()
        return out

    return call


@_interrupts_held
def save(state: ZeroState, root: str | os.PathLike, *, keep: int | None = None,
         buffers: Mapping[str, torch.Tensor] | None = None, _fail_at: str | None = None) -> str:
    """Write `state` (every rank calls it) to `root/step-<n>`, n = `int(state.step)`; its path.

    A Ctrl-C (SIGINT on the main thread) during the call is held until it returns, then raised
    (`_interrupts_held`): the checkpoint is published first; a second Ctrl-C is raised at once.

    One root per state: `keep` and `latest(root)` read every `step-*` folder of the root as this
    state's, so two states saved into one root (a GAN's generator and discriminator) mix, and
    `keep=` deletes the other's checkpoints (found in review).

    Each rank's canonical chunks and RNG states go through `dcp.save` (`fzero._src.checkpoint`'s
    docstring), all ranks agree, and rank 0 writes the manifest with every file's sha256 and renames
    the folder into place. With `keep=K`, rank 0 first deletes the `.tmp-step-*` folders of saves
    that crashed, and after the rename the complete checkpoints but the K written last (`complete`:
    in the order written, so never the one just written). A step skipped for a non-finite gradient
    does not advance `state.step`: a save after it names the folder of the save before, which raises
    "exists already", so a loop that saves every k steps saves after the steps that were not skipped
    (`if not metrics.skipped and int(state.step) % k == 0`). With `buffers` (`{name: tensor}`, e.g.
    `ModuleInfo.buffers` of `fzero.from_module`: BatchNorm's running statistics), rank 0's are saved
    too (DDP's convention: its buffers are rank 0's), for `load(..., buffers=)` and `export`; the
    other ranks' are not read.

    Before anything is written the ranks agree (`_agree`), so every rank raises `CheckpointError`
    or none does: where the ranks were given different folders (`root/step-<n>`: another root,
    e.g. a per-rank mkdtemp or timestamp, or another step), naming each rank's; where
    `root/step-<n>` exists already, or an argument is wrong, on some rank. Then rank 0 creates
    the temporary folder and every rank checks it sees it (one file system shared by every rank),
    else `CheckpointError` on every rank naming the ranks that do not. A write that fails after
    that (a full disk, in DCP's files or the manifest) raises on every rank, on DistMesh and
    SimMesh alike: a `CheckpointError` naming the checkpoint, the rank and the error (chained as
    its cause) and the free space (`_save_failed`), or naming the rank that failed (`_write_data`);
    rank 0 then removes the temporary folder (best effort: a note where it cannot). `keep` renames
    each old checkpoint to a `.tmp-step-*` name before deleting it (`_remove_old`).
    """
    if not isinstance(state, ZeroState):
        raise CheckpointError(f"checkpoint.save: state must be the ZeroState made by fzero.init, got "
                              f"{type(state).__name__}")
    mesh = state.mesh
    with mesh.guard():
        error, key, final, bufs = None, None, None, None
        shown = _short(root, 300)
        try:
            check_state(state, pending=False)  # this rank's checks; the pending flag's (a collective) after
            bufs = _checked_buffers(buffers, "checkpoint.save")
            keep = as_int(keep)
            if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
                raise CheckpointError(f"keep must be None or an int >= 1 (how many checkpoints to keep), got {keep!r}")
            if _fail_at is not None and _fail_at not in CRASH_POINTS:
                raise CheckpointError(f"_fail_at must be one of {CRASH_POINTS}, got {_fail_at!r}")
            root = _fspath(root, "checkpoint.save: root (the folder that holds the step-<n> checkpoints)")
            final = os.path.join(root, f"step-{int(state.step)}")
            shown, key = _what_saved(final, state, keep), (*_folder_key(final)[:2], _state_key(state, keep))
            if os.path.exists(final):
                raise CheckpointError(f"checkpoint {final!r} exists already (step {int(state.step)}); save each step "
                                      f"once, or delete it first; save each state to a root of its own (two models "
                                      f"trained together, a GAN's generator and discriminator: found in review); a "
                                      f"step skipped for a non-finite gradient, "
                                      f"Metrics.skipped, does not advance state.step, so a save after it finds "
                                      f"the checkpoint of the step before: save after the steps that were not "
                                      f"skipped, `if not metrics.skipped and int(state.step) % every == 0`")
        except Exception as e:  # noqa: BLE001 - agreed on first, then raised (_agree)
            error = e

        def different(rows: list[list[int]], given: list[str]) -> str:
            return (f"the ranks of {mesh!r} passed different folders or states to checkpoint.save:"
                    + "".join(f"\n  rank {s}: {given[s]}" for s in range(len(rows)))
                    + "\nevery rank must save the same step of the same state into the same root, one folder on a "
                    "file system every rank shares (not a per-rank tempfile.mkdtemp() or timestamp: choose it once "
                    "and pass it to every rank); nothing was written")

        def refused(failures: list[tuple[int, str]]) -> str:
            return (f"checkpoint.save into {shown}: {len(failures)} other rank(s) of {mesh!r} refused it; nothing "
                    f"was written:{_listed(failures)}")

        _agree(mesh, "fzero.checkpoint/save", error, key, shown, failed=refused, same=_same_save, differ=different)
        assert final is not None
        check_pending(state)
        rank, n = state.rank, int(state.step)
        lr = lr_record(state.optimizer, n)  # on every rank: whatever the schedule does, it does on each
        tmp = os.path.join(root, f".tmp-step-{n}-{_token(state):012x}")

        def unusable(failures: list[tuple[int, str]]) -> str:
            return (f"checkpoint.save into {root!r}: {len(failures)} other rank(s) of {mesh!r} cannot use the folder "
                    f"{tmp!r}; nothing was saved:{_listed(failures)}")

        error = None
        if rank == 0:
            try:
                if keep is not None and os.path.isdir(root):  # what crashed saves left: room for this one
                    for name in os.listdir(root):
                        if _TMP_DIR.match(name):
                            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
                os.makedirs(tmp)
            except OSError as e:
                error = e
        _agree(mesh, "fzero.checkpoint/mkdir", error, None, repr(tmp), failed=unusable)
        try:  # the folder exists: from here a failure removes it (_abandon); every rank checks it sees it
            error = None if _visible(tmp) else CheckpointError(
                f"rank {rank} of {mesh!r} does not see {tmp!r}, the folder rank 0 created for the checkpoint: "
                f"root {root!r} must be one folder on a file system every rank shares (the same path on every "
                f"host), not a folder of each host's own disk")
            _agree(mesh, "fzero.checkpoint/visible", error, None, repr(tmp), failed=unusable)
            if _fail_at == "before_data":
                raise _Crash("simulated crash before any data was written")
            head = _Head(state, root, bufs, lr)  # rank 0's: sealed with the data, then written
            _write_data(_builder(state, bufs, head), tmp, final, mesh,
                        _crash_mid_data if _fail_at == "mid_data" else None)
            error = None
            if rank == 0:
                try:
                    _publish(tmp, final, root, head, _fail_at)
                except _Crash:
                    raise
                except Exception as e:  # noqa: BLE001 - agreed on first, then raised (_agree)
                    error = e if isinstance(e, CheckpointError) else _save_failed(
                        e, "writing the manifest or renaming the folder", final, tmp, rank)
                if error is None and keep is not None:  # in the order written: the one just written is last
                    for _, _, old in [*head.before, (head.fields["written"], n, final)][:-keep]:
                        _remove_old(old, final)
            _agree(mesh, "fzero.checkpoint/published", error, None, repr(final),
                   failed=_others_failed(final, tmp, mesh))
        except _Crash:
            raise
        except BaseException as e:
            _abandon(e, rank, tmp, final)
            raise
    return final


def _remove_old(old: str, final: str) -> None:
    """Delete the older checkpoint `old` for `keep`, after `final` is published: first renamed
    (atomically, the root fsynced) to `root/.tmp-step-<n>-<token>`, a name `latest` never reads
    and the next `save(keep=...)` removes as a crashed save's folder, then deleted. So no folder
    named `step-<n>` is ever half deleted, and a crash while deleting leaks nothing for longer than
    the next save with `keep` (found in review: a partly deleted `step-<n>` was neither complete,
    what `keep` deletes, nor a `.tmp-step-*` folder, so it stayed forever and blocked a later save
    of its step). A failure warns (`OldCheckpointNotRemoved`) instead of raising (found in review:
    `save` raised although its checkpoint was complete and visible, and a retry then found its
    folder taken)."""
    root, name = os.path.split(old)
    doomed = os.path.join(root, f".tmp-{name}-{os.urandom(6).hex()}")
    try:
        os.rename(old, doomed)
    except OSError as e:
        if os.path.isdir(old):  # not renamed: still a complete checkpoint (else: gone already)
            _old_not_removed(f"the older checkpoint {old!r} could not be deleted ({type(e).__name__}: {e}); "
                             f"remove it yourself", final)
        return
    with contextlib.suppress(OSError):  # the rename on disk before the deletions (best effort)
        _fsync_dir(root)
    try:
        shutil.rmtree(doomed)
    except OSError as e:
        _old_not_removed(f"the older checkpoint {old!r}, moved to {doomed!r} to be deleted, could not be deleted "
                         f"({type(e).__name__}: {e}); the next save(..., keep=K) retries, or remove it yourself", final)


def _old_not_removed(what: str, final: str) -> None:
    warnings.warn(OldCheckpointNotRemoved(f"checkpoint.save(keep=...): {final!r} is saved, but {what}"), stacklevel=outside_stacklevel())


# -- finding and checking checkpoints ------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, or a `CheckpointError` naming what is wrong (the
    file, or the field of it that is missing or of the wrong type)."""
    return _read_manifest(_checkpoint_path(path))[0]


def _root_words(path: str) -> str:
    """The way out for a folder with no manifest: where it is a root that holds checkpoints, the
    one `latest` names (a shell user of `fzero inspect ROOT` was told to call a Python function;
    found in review of a new user); where it is, or holds only, saves that did not complete, that
    (`latest` is None there); else the words on a save that crashed."""
    found, norm = _found_quietly(path), os.path.normpath(path)
    if found:
        return (f": it is a checkpoint root, which holds {len(found)} complete checkpoint(s); the one written last, "
                f"fzero.checkpoint.latest(root), is {found[-1][2]!r}")
    if _TMP_DIR.match(os.path.basename(norm)):
        beside = _found_quietly(os.path.dirname(norm))
        last = (f"its root's last complete checkpoint, fzero.checkpoint.latest(root), is {beside[-1][2]!r}" if beside
                else "its root holds no complete checkpoint (fzero.checkpoint.latest(root) is None): start the run "
                     "afresh, or load from another root")
        return f": it is a save that did not complete (a crash leaves a .tmp-step-* folder); {last}"
    try:
        crashed = sorted(n for n in os.listdir(path) if _TMP_DIR.match(n)) if os.path.isdir(path) else []
    except OSError:  # only the words of an error already raised
        crashed = []
    if crashed:  # found in review: the words sent such a root's user to latest(root), which returns None
        return (f": it holds no complete checkpoint, only {len(crashed)} save(s) that did not complete "
                f"({crashed[0]!r}...; a crash leaves them), so fzero.checkpoint.latest(root) is None: "
                f"start the run afresh, or load from another root")
    return " (a save that crashed leaves a .tmp-step-* folder; use fzero.checkpoint.latest(root))"


def _found_quietly(root: str) -> list[tuple[int, int, str]]:
    """`_found(root)` for an error's words: none where it fails, and without `latest`'s warning on
    an unsealed checkpoint (that warning is `latest`'s, not this error's: found in review)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _found(root)
    except Exception:  # noqa: BLE001 - only the words of an error already raised
        return []


def _read_manifest(path: str) -> tuple[dict[str, Any], bytes]:
    """`(manifest, the sha256 of its bytes)`: what `read_manifest` checks, and what the ranks of a
    `load` compare (the manifest lists every file's sha256, so its own names the checkpoint)."""
    name = os.path.join(path, MANIFEST)
    try:
        with open(name, "rb") as f:
            data = f.read()
        manifest = json.loads(data)
    except FileNotFoundError:
        raise CheckpointError(f"{name!r} does not exist: {path!r} is not a complete fzero checkpoint{_root_words(path)}"
                              ) from None
    except (OSError, ValueError, RecursionError) as e:  # RecursionError: JSON nested too deep (found in review)
        crashed = (" (a save that crashed leaves a .tmp-step-* folder, its manifest perhaps half written; use "
                   "fzero.checkpoint.latest(root))" if _TMP_DIR.match(os.path.basename(os.path.normpath(path))) else "")
        raise CheckpointError(f"{name!r} is not a readable manifest: {e}{crashed}") from None
    keys = ("format", "step", "stage", "world_size", "leaves", "optimizer", "files")
    if isinstance(manifest, dict) and manifest.get("format") == 1:
        raise CheckpointError(f"{name!r} is of format 1 (per-rank torch.save files, before fzero checkpoints went "
                              f"through torch.distributed.checkpoint); this fzero reads format {FORMAT}: load it "
                              f"with the fzero that wrote it and save it again")
    if not isinstance(manifest, dict) or any(k not in manifest for k in keys) or manifest["format"] != FORMAT:
        raise CheckpointError(f"{name!r} is not a format-{FORMAT} fzero manifest (needs the keys {keys})")
    _check_manifest(name, manifest)
    return manifest, hashlib.sha256(data).digest()


def _dtype(name: Any) -> torch.dtype | None:
    """The floating torch dtype a manifest names ("float32", "bfloat16", ...), or None."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    return dtype if isinstance(dtype, torch.dtype) and dtype.is_floating_point else None


def _check_manifest(name: str, m: dict[str, Any]) -> None:
    """The fields fzero reads are of their types, else a `CheckpointError` naming the field."""

    def bad(field: str, want: str, got: Any) -> CheckpointError:
        return CheckpointError(f"{name!r}: field {field!r} must be {want}, got {type(got).__name__} {_short(got)}; "
                               f"the manifest was edited or damaged: load another checkpoint "
                               f"(fzero.checkpoint.complete(root) lists them)")

    def count(x: Any, lo: int) -> bool:  # an int64 (the step rides in the ranks' agreement row)
        return isinstance(x, int) and not isinstance(x, bool) and lo <= x < 2**63

    for field, lo in (("step", 0), ("stage", 0), ("world_size", 1)):
        if not count(m[field], lo):
            raise bad(field, f"an int >= {lo}", m[field])
    if not isinstance(m["leaves"], list):
        raise bad("leaves", "a list of leaf records {path, shape, dtype, frozen}", m["leaves"])
    for i, ls in enumerate(m["leaves"]):
        if not isinstance(ls, dict):
            raise bad(f"leaves[{i}]", "a leaf record {path, shape, dtype, frozen}", ls)
        for k, want, ok in (("path", "a str", lambda v: isinstance(v, str)),
                            ("shape", "a list of ints >= 0",
                             lambda v: isinstance(v, list) and all(count(d, 0) for d in v)),
                            ("dtype", "a floating torch dtype's name", lambda v: _dtype(v) is not None),
                            ("frozen", "a bool", lambda v: isinstance(v, bool))):
            if k not in ls or not ok(ls[k]):
                raise bad(f"leaves[{i}].{k}", want, ls.get(k))
        for k, want, ok in (("weight_decay", "a bool", lambda v: isinstance(v, bool)),
                            ("lr_scale", "a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool))):
            if k in ls and not ok(ls[k]):  # (absent from manifests written before the field)
                raise bad(f"leaves[{i}].{k}", want, ls[k])
    if "written" in m and not count(m["written"], 0):
        raise bad("written", "an int >= 0", m["written"])
    lr = m.get("lr")  # (absent from manifests written before the field)
    if lr is not None and not (isinstance(lr, list) and all(
            isinstance(e, list) and len(e) == 2 and count(e[0], 0)
            and (e[1] is None or isinstance(e[1], float) and math.isfinite(e[1]) and e[1] >= 0) for e in lr)):
        raise bad("lr", "null or a list of [step, lr or null]", lr)
    buffers = m.get("buffers")
    if buffers is not None and not (isinstance(buffers, list) and all(
            isinstance(b, dict) and isinstance(b.get("name"), str) and isinstance(b.get("dtype"), str)
            and isinstance(getattr(torch, b["dtype"], None), torch.dtype)
            and isinstance(b.get("shape"), list) and all(count(d, 0) for d in b["shape"]) for b in buffers)):
        raise bad("buffers", "null or a list of buffer records {name, shape, dtype}", buffers)
    if not isinstance(m["files"], dict):
        raise bad("files", "a dict {file: {sha256, bytes}}", m["files"])
    for f, meta in m["files"].items():
        if f in ("", ".", "..") or os.path.basename(f) != f or "\\" in f:  # (found in review: "../x" and
            # "/etc/passwd" were hashed in full, outside the checkpoint, before the verdict)
            raise bad("files", "a dict whose keys are plain file names inside the checkpoint", f)
        if not isinstance(meta, dict) or not isinstance(meta.get("sha256"), str) or not count(meta.get("bytes"), 0):
            raise bad(f"files[{f!r}]", "a dict {sha256: str, bytes: int}", meta)


def _files_present(path: str, manifest: dict[str, Any]) -> bool:
    """Every file the manifest lists is there, of its size. A file that vanishes while it is
    looked at (another process's `keep=` deleting the checkpoint) is not there: `latest` skips the
    checkpoint (found in review: `FileNotFoundError` out of `latest`)."""
    return not _damaged_files(path, manifest)


def _damaged_files(path: str, manifest: dict[str, Any]) -> list[str]:
    """Each file the manifest lists that is missing or of another size than recorded, in words
    (`_files_present`'s check, said): what `summary` names, where it summed the manifest's sizes
    as the bytes "on disk" and printed a truncated checkpoint as whole (found in review)."""
    out = []
    for f, meta in manifest["files"].items():
        full = os.path.join(path, f)
        try:
            size = os.path.getsize(full) if os.path.isfile(full) else None
        except OSError:
            size = None
        if size != meta["bytes"]:
            out.append(f"file {f!r} is {'missing' if size is None else f'{size:,} B on disk'}, the manifest "
                       f"records {meta['bytes']:,} B")
    return out


def complete(root: str | os.PathLike) -> list[str]:
    """The complete checkpoints under `root` (a valid manifest, every file of its size), in the
    order they were written (each save's manifest records one more than the root's last,
    `written`; by step among those of the same, as manifests from before the field): oldest
    first. Not by step: a run rolled back to an earlier checkpoint writes lower steps after
    higher ones, and its newest state is the one written last (as DeepSpeed's `latest` file
    names the last save). The counter is the manifest's: a checkpoint copied in from another
    root keeps the place it had there. The last ones written whose manifest was edited after the
    save (not the one sealed in their data) are left out, with an `UnsealedCheckpointSkipped`
    warning each (`_sealed_last`): an edited `written` cannot make a checkpoint the last."""
    return _complete(root)


def _complete(root: Any) -> list[str]:
    """`complete(root)`; a warning names the caller of `latest` or `complete`."""
    root = _fspath(root, "root (the folder that holds the step-<n> checkpoints)")
    _check_root(root)
    return [p for _, _, p in _found(root)]


def _check_root(root: str) -> None:
    """A `root` that is a file, or a checkpoint folder itself (it holds a manifest), is a
    `CheckpointError` naming it and its parent; before, `latest` returned None for either, so a
    resume loop (`path = latest(root); if path: load(...)`) started again from scratch without
    a word (found in review). A root that does not exist is one no save has made yet: nothing."""
    if os.path.exists(root) and not os.path.isdir(root):
        folder = os.path.dirname(os.path.abspath(root))
        inside = os.path.isfile(os.path.join(folder, MANIFEST))  # a file of a checkpoint: its root is one up
        named = (f"it is a file of the checkpoint {folder!r}, whose root is {os.path.dirname(folder)!r}" if inside
                 else f"the folder that holds it is {folder!r}")
        raise CheckpointError(f"checkpoint root {root!r} is a file, not the folder that holds the step-<n> "
                              f"checkpoints ({named}: pass the root)")
    if os.path.isfile(os.path.join(root, MANIFEST)):
        raise CheckpointError(f"{root!r} is a checkpoint itself, not a root: pass the folder that holds the step-<n> "
                              f"checkpoints, {os.path.dirname(os.path.abspath(root))!r}, or load {root!r} as it is")


def _found(root: str) -> list[tuple[int, int, str]]:
    """`(written, step, path)` of each complete checkpoint under `root`, sorted; those written
    last whose manifest is not the one sealed in their data left out (`_sealed_last`, with a
    warning at the user's line)."""
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = _STEP_DIR.match(name)
        if m is None:
            continue
        path = os.path.join(root, name)
        try:
            manifest = read_manifest(path)
        except CheckpointError:
            continue
        if _files_present(path, manifest):
            found.append((manifest.get("written", 0), int(m.group(1)), path, manifest))
    found.sort(key=lambda f: f[:3])
    return [f[:3] for f in _sealed_last(root, found)]


def _sealed_last(root: str, found: list[tuple[int, int, str, dict[str, Any]]]
                 ) -> list[tuple[int, int, str, dict[str, Any]]]:
    """`found` (sorted: `(written, step, path, manifest)`) less the checkpoints at its end whose
    manifest is shown edited (`_edit`), each with an `UnsealedCheckpointSkipped` warning (at the
    user's line): checked from the one written last down to
    the first that is not shown edited, so that one is the root's `latest`, and the next save's
    `written` is one more than its own. Found in review: a manifest's `written` edited to
    2**63 - 1 made its checkpoint `latest` for good, and gave every later save a `written` of
    2**63, past a manifest's range, so none of them was complete. Where the last checkpoint's
    seal matches (the usual case) only it is read: its `.metadata` and ~3 KB of rank 0's file
    (`check_record`; that file is hashed only where the seal differs, to tell damage from an
    edit). The ones before it are ordered by their manifests, as before: an edit there moves a
    checkpoint only among the older ones, and `load` refuses it."""
    while found:
        written, _, path, manifest = found[-1]
        problem = _edit(path, manifest)
        if problem is None:
            break
        warnings.warn(UnsealedCheckpointSkipped(
            f"fzero.checkpoint skipped {path!r} (its manifest says written {written}) in root {root!r}: {problem}. "
            f"It is neither latest(root) nor in complete(root), and save(..., keep=K) never deletes it: remove it, "
            f"or put back the manifest it was saved with"), stacklevel=outside_stacklevel())
        found.pop()
    return found


def _edit(path: str, manifest: dict[str, Any]) -> str | None:
    """Why the manifest of the complete checkpoint at `path` is not the one saved with its data
    (`_record_mismatch`'s words: its step or `seal` differs), or None where it is, where the
    checkpoint has no seal (saved before it: only the step is compared), or where that cannot be
    told without more: a `.metadata` or data file damaged (`load` refuses those, naming the file;
    `latest` checks sizes, not checksums), or any other failure to read the record."""
    try:
        return _record_mismatch(path, manifest, _metadata(path, manifest))
    except Exception:  # noqa: BLE001 - damage, not a proven edit: load's to refuse, naming the file
        return None


def latest(root: str | os.PathLike) -> str | None:
    """The complete checkpoint under `root` written last, or None. A checkpoint whose manifest
    was edited after the save (it is not the one sealed in its data, `check_record`) is never
    returned: skipped with an `UnsealedCheckpointSkipped` warning (`_sealed_last`)."""
    done = _complete(root)
    return done[-1] if done else None


def _layout_fix(saved: dict[str, Any], mine: dict[str, Any], diff: list[str], step: int) -> str:
    """The way out `check_fits` names for a leaf whose records in the checkpoint (`saved`, at
    `step`) and in the target (`mine`) differ in `diff` (of path, shape, dtype, frozen), or in its
    group's settings alone (`diff` empty). Where only `frozen` differs the params pytree is the
    same and the target froze or thawed the leaf (a long run that unfreezes a layer on resume),
    which a load cannot do: a leaf frozen at the save has no optimizer state in the checkpoint
    (found in review: such a target was told to use "the same params pytree", which it did)."""
    if set(diff) - {"frozen"}:
        return "load into a state made by fzero.init from the same params pytree"
    fix = (f"make the target with the ParamGroups it was saved with (group {saved.get('group')!r} then, "
           f"{mine['group']!r} now)")
    if not diff:
        return fix
    return (f"{fix}: a leaf frozen at the save (a frozen ParamGroup, or a module param with requires_grad=False) "
            f"has no optimizer state in the checkpoint, a trainable one has, so a load neither thaws nor freezes a "
            f"leaf; to change which leaves train, start a new state from the saved params (fzero.checkpoint.export, "
            f"then fzero.init with the new groups), which keeps no optimizer state and starts at step 0 (shift the "
            f"lr schedule by the saved step: lambda t: schedule(t + {step}))")


def _check_paths(path: str, theirs: list[dict[str, Any]], mine: list[dict[str, Any]],
                 ties: dict[str, str] | None = None) -> None:
    """A `CheckpointError` naming the leaves (path, dtype and shape) the checkpoint holds and the
    target lacks and those the target holds and the checkpoint lacks, where the two sets of paths
    differ. Before, the leaves were compared position by position, so a leaf dropped, added or
    renamed was reported as a later leaf differing in path and shape, blaming one that had not
    changed, and an added leaf sorting last only as a count (found in review)."""
    saved, made = {a["path"]: a for a in theirs}, {b["path"]: b for b in mine}
    lacking = [a for p, a in saved.items() if p not in made]
    extra = [b for p, b in made.items() if p not in saved]
    if not (lacking or extra):
        return

    def listed(leaves: list[dict[str, Any]]) -> str:
        shown = ", ".join(f"{a['path']!r} ({str(a.get('dtype')).removeprefix('torch.')}{list(a.get('shape', []))})"
                          for a in leaves[:6])
        return shown + (f" and {len(leaves) - 6} more" if len(leaves) > 6 else "")

    parts = ([f"the checkpoint holds {listed(lacking)}, which the target lacks"] if lacking else []) + (
        [f"the target holds {listed(extra)}, which the checkpoint lacks"] if extra else [])
    raise CheckpointError(f"{path!r} was saved from another layout ({len(theirs)} leaves, the target's {len(mine)}): "
                          f"{'; '.join(parts)}; load into a state made by fzero.init from the same params pytree "
                          f"(a renamed submodule renames its leaves{_tie_hint(lacking, extra, saved, made, ties or {})}"
                          f")")


def _tie_hint(lacking: list[dict[str, Any]], extra: list[dict[str, Any]], saved: dict[str, Any],
              made: dict[str, Any], ties: dict[str, str]) -> str:
    """The words for a weight tied in one model and not in the other (`from_module` makes a tied
    weight one leaf, by its first name), where the leaves say so: a leaf the target lacks that is
    another name of one of its tied leaves (`ties`: other name -> first name; certain), or at most
    two leaves the target alone holds, each of the dtype and shape of a leaf both hold (the saved
    model tied them: likely). The hint named a rename alone (found in review of a tied-weights
    user); a first version guessed from dtypes and shapes on both sides, and named a tie where
    blocks were renamed or a model was deeper (found in review)."""
    named = [(a["path"], ties[a["path"]]) for a in lacking if a["path"] in ties]
    if named:  # the saved model tied it too where it lacks the target's first name (another order of modules)
        return "; " + "; ".join(
            f"the checkpoint's {p!r} is another name of the target's {first!r}, which the target ties and the saved "
            f"model did not" if first in saved else
            f"the target ties {p!r} and {first!r} as one leaf named {first!r}; the saved model named it {p!r} (its "
            f"modules in another order)" for p, first in named[:4])
    both = {(str(a.get("dtype")), tuple(a.get("shape", ()))) for p, a in saved.items() if p in made}
    homes = {a["path"].rpartition(".")[0] for a in extra}
    if not lacking and len(extra) <= 2 and not (len(extra) == 2 and len(homes) == 1) and all(
            (str(a.get("dtype")), tuple(a.get("shape", ()))) in both for a in extra):  # (a new layer's weight and
        # bias, one submodule: a deeper model, not a tie; found in review)
        return ("; or a weight tied in the saved model and not in the target: from_module makes a tied weight one "
                "leaf, under its first name, so tie as the saving model did")
    return ""


def check_fits(path: str, manifest: dict[str, Any], target: ZeroState) -> None:
    """The checkpoint's leaves (path, shape, dtype, frozen, and the group's weight decay mask and
    lr scale, where the manifest has them: saved since the twenty-third session), optimizer and
    scaler settings (`_scaler_settings`), lr schedule values (`_check_lr`) and precision policy
    (`_check_precision`) are the target's; a `CheckpointError` naming the first mismatch
    otherwise. (Files are checked as they are read.) The optimizer's description is compared
    exactly but for the `impl` of fzero's own optimizers (`_impl_adopted`), which changes the
    bits of the steps to come, not what the state means. A group's settings change the update as
    the optimizer's do: a resume under other groups would step on from the same state as
    another run (found in review: silently, before they were saved)."""
    mine, theirs = describe_layout(target.layout), manifest["leaves"]
    _check_paths(path, theirs, mine, tied_names(target.layout))
    keys = ("path", "shape", "dtype", "frozen")
    for i, (a, b) in enumerate(zip(theirs, mine)):
        diff = [k for k in keys if a.get(k) != b[k]]
        groups = [k for k in GROUP_KEYS if k in a and a[k] != b[k] and not b["frozen"]]  # (a frozen leaf: no update)
        if diff or groups:
            shown = ", ".join(f"{k}: checkpoint {a.get(k)!r}, target {b[k]!r}" for k in diff + groups)
            raise CheckpointError(f"{path!r} was saved from another layout: leaf {i} ({b['path']!r}) differs in "
                                  f"{shown}; {_layout_fix(a, b, diff, manifest['step'])}")
    if len(theirs) != len(mine):
        raise CheckpointError(f"{path!r} holds {len(theirs)} leaves, the target's layout {len(mine)}; load into a "
                              f"state made by fzero.init from the same params pytree")
    want = _jsonable(describe(target.optimizer))
    if _impl_adopted(manifest["optimizer"], target.optimizer, want) != want:
        raise CheckpointError(_other_optimizer(path, manifest["optimizer"], target.optimizer, want))
    _check_lr(path, manifest, target)
    theirs_scaler, mine_scaler = manifest.get("scaler"), None if target.info.scaler is None else repr(target.info.scaler)
    if _scaler_settings(theirs_scaler) != _scaler_settings(mine_scaler):
        raise CheckpointError(f"{path!r} has loss scaler {theirs_scaler!s}, the target {mine_scaler!s}; make the "
                              f"target with the loss_scale it was saved with (a DynamicLossScale's init_scale may "
                              f"differ: the run goes on from the saved scale)")
    _check_precision(path, manifest, target)


def _check_lr(path: str, manifest: dict[str, Any], target: ZeroState) -> None:
    """The target's lr schedule gives, at every step the manifest's "lr" records (`lr_record`),
    exactly the saved value, else a `CheckpointError` naming the first step that differs and both
    values. A schedule changes the steps to come as the optimizer's settings do: a resume under
    another one steps on from the same state as another run (found in review: a peak lr in a
    `functools.partial`'s arguments, or read from a config object, loaded silently). Nothing is
    compared for a manifest without the record (saved before the field, or by an optimizer without
    an lr or with a schedule object) or a target whose schedule `load` does not read
    (`_of_the_step`) or that gives two values at the saved step (`_moved_on`: a warning)."""
    saved = manifest.get("lr")
    if not saved:
        return
    mine = _schedule_values(target.optimizer, [s for s, _ in saved], manifest["step"],
                            f"checkpoint.load of {path!r} compared it with none of the lr values saved")
    if mine is None:
        return
    for s, theirs in saved:
        if mine[s] != theirs:
            raise CheckpointError(
                f"{path!r} was saved with another lr schedule: lr at step {s}: checkpoint {_shown_lr(theirs)}, "
                f"target {_shown_lr(mine[s])} (saved at step {manifest['step']}; the schedules differ where the "
                f"optimizer's description does not show it: a functools.partial's arguments, a value read from an "
                f"object); make the target with the schedule it was saved with. To train on under another "
                f"schedule with the saved optimizer state (its moments, its step), load into that target, then give "
                f"the loaded state the new optimizer on every rank: state.replace(info=dataclasses.replace("
                f"state.info, optimizer=...)); to restart it, start a new state from the saved params "
                f"(fzero.checkpoint.export, then fzero.init)")


def _shown_lr(value: float | None) -> str:
    return "raised (no lr)" if value is None else repr(value)


def _policy(text: Any) -> Precision | None:
    """The `Precision` a manifest's "precision" (`[str(param_dtype), str(reduce_dtype)]`) names,
    or None where it names none."""
    if not (isinstance(text, list) and len(text) == 2):
        return None
    dtypes = [None if t == "None" else _dtype(t.removeprefix("torch.")) if isinstance(t, str) else None for t in text]
    if any(d is None and t != "None" for d, t in zip(dtypes, text)):
        return None
    try:
        return Precision(*dtypes)
    except FzeroError:
        return None


def _shown_policy(manifest: dict[str, Any]) -> str:
    """A manifest's precision policy as `fzero inspect` prints it: as `Precision` shows itself
    (which `load`'s refusal of another policy names), and as `fzero estimate --precision` takes
    it where it can (a COMPUTE dtype given); no policy as such. Before, the raw field, a list
    (`['torch.bfloat16', 'torch.float32']`). A field `load` would refuse
    (`_policy`: edited or damaged) is shown as it is, said so; one a manifest lacks, so."""
    if "precision" not in manifest:
        return "not recorded (saved before the field)"
    policy = _policy(manifest["precision"])
    if policy is None:
        return f"{_short(manifest['precision'])} (not a policy: the manifest was edited or damaged)"
    if policy.param_dtype is None and policy.reduce_dtype is None:
        return "none (every leaf computes and reduces in its own dtype)"
    if policy.param_dtype is None:
        return repr(policy)
    flag = ",".join(short_name(d) for d in (policy.param_dtype, policy.reduce_dtype) if d is not None)
    return f"{policy!r} (fzero estimate --precision {flag})"


def _check_precision(path: str, manifest: dict[str, Any], target: ZeroState) -> None:
    """The checkpoint's precision policy gives every leaf the compute and reduce dtypes the
    target's gives it (`Precision.wire`; so `Precision(torch.float32)` over float32 leaves is no
    policy), else a `CheckpointError` naming the leaf and both policies. A policy changes the steps
    to come as the optimizer's settings do: a resume under another one steps on from the same
    state as another run (found in review: it loaded silently)."""
    if "precision" not in manifest:  # (a manifest without the field: nothing to compare)
        return
    theirs, mine = _policy(manifest["precision"]), target.precision
    if theirs is None:
        raise CheckpointError(f"{os.path.join(path, MANIFEST)!r}: field 'precision' must be [param_dtype, "
                              f"reduce_dtype] (torch dtype names or 'None'), got {_short(manifest['precision'])}; the "
                              f"manifest was edited or damaged: load another checkpoint "
                              f"(fzero.checkpoint.complete(root) lists them)")
    for spec in target.layout.buckets:
        a, b = theirs.wire(spec), mine.wire(spec)
        if a.compute != b.compute or (a.reduce != b.reduce and not spec.group.frozen):  # (frozen: nothing reduced)
            ls = target.layout.leaves[spec.leaves[0]] if spec.leaves else None
            leaf = "" if ls is None else f" (leaf {ls.path!r}, {_dtype_name(ls.dtype)})"
            raise CheckpointError(
                f"{path!r} was saved under another precision policy: checkpoint {theirs}, target {mine}; bucket "
                f"{spec.tag!r}{leaf} would compute in {_dtype_name(a.compute)} and reduce in "
                f"{_dtype_name(a.reduce)} as saved, in {_dtype_name(b.compute)} and {_dtype_name(b.reduce)} in the "
                f"target; make the target with the precision it was saved with")


def _scaler_settings(text: str | None) -> str | None:
    """A loss scaler's repr (as the manifest holds it) less a `DynamicLossScale`'s `init_scale`,
    which only `init` reads (a resume goes on from the saved scale), and its `raise_at_min`,
    which changes no step's bits, only whether a run at the floor stops (a resume may turn it on
    or off: found in review, it was refused). Every other setting changes the steps to come -- a
    `StaticLossScale`'s scale is its state's, a dynamic one's floor and hysteresis bound the
    saved scale and hysteresis -- so a target with others would run as another run (found in
    review: before, only whether both had a scaler was compared)."""
    return None if text is None else re.sub(r"(, )?raise_at_min=[^,)]*", "",
                                            re.sub(r"init_scale=[^,)]*(, )?", "", text))


def _setting_diffs(theirs: Any, node: Any, where: tuple[str, ...]) -> list[tuple[tuple[str, ...], Any, Any]]:
    """Where the checkpoint's optimizer description `theirs` differs from the target's (`node`,
    `_named`): `(names down to the value, checkpoint's, target's)`; a function of another name,
    or of other closure values, is one difference at `where`. Inside `as_schedule` (the lr) the
    names restart at "lr"."""
    if isinstance(node, NamedFn):
        if node.qualname.startswith("as_schedule."):
            where = ("lr",)
        if not (isinstance(theirs, list) and len(theirs) == 2 and theirs[0] == node.qualname
                and isinstance(theirs[1], list) and len(theirs[1]) == len(node.items)):
            return [(where, theirs, unnamed(node))]
        return [d for (name, v), t in zip(node.items, theirs[1]) for d in _setting_diffs(t, v, where + (name,))]
    if isinstance(node, list):
        if not (isinstance(theirs, list) and len(theirs) == len(node)):
            return [(where, theirs, unnamed(node))]
        return [d for (name, v), t in zip(node, theirs) for d in _setting_diffs(t, v, where + (name,))]
    return [] if theirs == node else [(where, theirs, node)]


def _fn_nodes(desc: Any) -> Iterator[list]:
    """The function nodes `[qualname, [values]]` of a JSON optimizer description, depth first."""
    if isinstance(desc, list):
        if len(desc) == 2 and isinstance(desc[0], str) and isinstance(desc[1], list):
            yield desc
            desc = desc[1]
        for v in desc:
            yield from _fn_nodes(v)


def optimizer_name(desc: Any) -> str:
    """A readable name of the optimizer a manifest describes (`manifest["optimizer"]`, the JSON of
    `state.describe(optimizer)`): the name `two_phase` keeps ("adamw", "sgd"), else the function
    that makes the state ("lamb" of `lamb.<locals>.init`), else its qualname."""
    return _named_by(desc)[0]


def _named_by(desc: Any) -> tuple[str, bool]:
    """`optimizer_name`, and whether it is the name `two_phase` keeps (else one read off a function)."""
    for node in _fn_nodes(desc):
        first = node[1][0] if node[1] else None
        if node[0] == "two_phase.<locals>.update_" and isinstance(first, str) and re.fullmatch(r"'\w+'", first):
            return first[1:-1], True
    return _name_of_init(desc), False


def _name_of_init(desc: Any) -> str:
    init = desc[0][0] if isinstance(desc, list) and desc and isinstance(desc[0], list) and desc[0] else None
    if isinstance(init, str):
        return init.split(".<locals>.")[0].lstrip("_") or init
    return _short(desc, 120)


def _constant_lr(desc: Any) -> str | None:
    """The constant lr a JSON optimizer description holds (`as_schedule` of a float), or None."""
    for node in _fn_nodes(desc):
        if node[0] == "as_schedule.<locals>.<lambda>" and len(node[1]) == 1 and isinstance(node[1][0], str):
            return node[1][0]
    return None


_OPTIM_MODULES = __package__ + ".optim."  # fzero's own optimizers' functions are defined under it
_IMPL_VALUES = {repr(i) for i in (*IMPLS, None)}  # how a description writes an `impl` (`state.describe`)


def _impl_paths(x: Any, depth: int = 0, at: tuple[int, ...] = ()) -> Iterator[tuple[int, ...]]:
    """Where `state.describe(x)` (as JSON: a function `[qualname, [values]]`, a tuple a list)
    writes the `impl` of fzero's own optimizers, as index paths into it: each closure variable
    named `impl` of a function defined in `fzero._src.optim` (`adam`'s, `adamw`'s and `sgd`'s
    `prepare_`, wherever the description reaches it: under `update`, `update_` and `prepare_`)
    that holds a value `check_impl` takes. A variable of that name in any other function (a
    user's optimizer, or a user's wrapper around fzero's) is a setting like any other. The walk
    is `describe`'s (`described_fields`, `described_cells`, the depth), so the paths are those
    of its values."""
    if isinstance(x, tuple):
        for k, (_, v) in enumerate(described_fields(x)):
            yield from _impl_paths(v, depth, at + (k,))
        return
    if not callable(x):
        return
    own = isinstance(x, types.FunctionType) and (x.__module__ or "").startswith(_OPTIM_MODULES)
    for k, (name, v) in enumerate(described_cells(x, depth)):
        if callable(v):
            yield from _impl_paths(v, depth + 1, at + (1, k))
        elif own and name == "impl" and repr(v) in _IMPL_VALUES:
            yield at + (1, k)


def _impl_adopted(theirs: Any, optimizer: Any, want: Any) -> Any:
    """A saved optimizer description `theirs` with the target's `impl` (`want`'s, the JSON of
    `describe(optimizer)`) written where the target's optimizer holds fzero's own `impl`
    (`_impl_paths`) and the saved one holds an `impl` value there too; else as saved. So the
    description compares equal to `want` iff the two differ in nothing but `impl`.

    `impl` ("single", "foreach", "fused", or None: "fused" on CUDA where its kernel is
    element-wise, else "foreach", `resolve_impl`) picks which of torch's implementations
    computes the update; every impl keeps the same state fields, of the
    same layout and meaning (`AdamState`, `SgdMomentumState`: the kernels differ, not the state).
    A resume on another machine needs another impl where the saved one is not there (a
    fused kernel torch lacks on that device or dtype), and the default resolves by device
    already (a None saved on CUDA ran fused, loads as None on the CPU and runs foreach, as
    before). The steps after the load take the target impl's bits: each impl is bitwise its
    torch counterpart, not bitwise each other's (docstring of `load`)."""
    out = json.loads(json.dumps(theirs))  # a copy, written into below
    for path in _impl_paths(optimizer):
        node, mine = out, want
        for k in path[:-1]:
            if not (isinstance(node, list) and k < len(node)):
                break
            node, mine = node[k], mine[k]
        else:
            k = path[-1]
            if isinstance(node, list) and k < len(node) and isinstance(node[k], str) and node[k] in _IMPL_VALUES:
                node[k] = mine[k]
    return out


def _other_optimizer(path: str, theirs: Any, optimizer: Any, want: Any) -> str:
    """The message for a checkpoint saved with another optimizer, or the same one with other
    settings: which (by name), or which settings differ, the checkpoint's value and the target's."""
    fix = "make the target with the optimizer and settings the checkpoint was saved with"
    (name, kept), (target_name, target_kept) = _named_by(theirs), _named_by(want)
    names = name, target_name
    made_by = _name_of_init(theirs)
    if kept != target_kept and made_by == _name_of_init(want):  # one description names it, one does not
        return (f"{path!r} was saved with an optimizer described otherwise than the target's ({target_name}): the "
                f"checkpoint's description names none, and makes its state with the same function "
                f"({made_by}); an earlier fzero (before Optimizer.prepare_, 2026-12-01) described its optimizers so, "
                f"and this fzero cannot compare such a description with its own. To train on from it, start a new "
                f"state from its params: fzero.init(fzero.checkpoint.export(path), ...) (the optimizer state "
                f"restarts)")
    if names[0] != names[1]:
        return f"{path!r} was saved with another optimizer: checkpoint {names[0]}, target {names[1]}; {fix}"
    node = named(optimizer)
    adopted = _impl_adopted(theirs, optimizer, want)  # an impl that differs too is no reason: not named
    diffs = _setting_diffs(adopted, node, ()) if _jsonable(unnamed(node)) == want else []
    fullest: dict[str, str] = {}  # one line a setting: its description's deepest copy (the optimizer's
    for where, a, b in diffs:  # description holds the lr at several depths, the shallower cut short)
        line = f"checkpoint {_setting_words(a)}, target {_setting_words(b)}"
        name = setting_name(where)
        if len(line) > len(fullest.get(name, "")):
            fullest[name] = line
    shown = [f"{name}: {line}" for name, line in fullest.items()]
    if shown:  # (found in review of resumes: the way that keeps the optimizer state went unnamed)
        return (f"{path!r} was saved with another optimizer setting ({names[0]}): {'; '.join(shown)}; {fix}; "
                f"then, to keep its moments and step under new settings of the same state fields (not momentum or "
                f"amsgrad turned on), give every rank's loaded state the new optimizer: state.replace(info="
                f"dataclasses.replace(state.info, optimizer=...))")
    return (f"{path!r} was saved with another optimizer ({names[0]}, of other settings):\n  checkpoint: "
            f"{str(theirs)[:300]}\n  target:     {str(want)[:300]}\n{fix}")


def _setting_words(value: Any) -> str:
    """A setting of an optimizer description in a message: a value as saved; a function (a
    schedule: `[qualname, [values]]`) by its name, then its values, cut at 120 characters (before:
    a schedule of another function was shown as the whole description twice, cut before it, found
    in review)."""
    if isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], list):
        if value[0] == "as_schedule.<locals>.<lambda>" and len(value[1]) == 1:  # a constant lr: its value
            return _setting_words(value[1][0])
        if value[0] == "as_schedule.<locals>.checked" and len(value[1]) == 1:  # a schedule: the function given
            return _setting_words(value[1][0])
        inner = json.dumps(value[1])
        return f"function {value[0]} {inner[:120]}{' ...' if len(inner) > 120 else ''}"
    return value if isinstance(value, str) else json.dumps(value)[:120]


def check_files(path: str, manifest: dict[str, Any], only: set[str] | None = None) -> None:
    """Every file the manifest lists (or those in `only`) is there, of its size and sha256; else
    `CheckpointError` naming the file."""
    for f, meta in manifest["files"].items():
        if only is not None and f not in only:
            continue
        name = os.path.join(path, f)
        if not os.path.isfile(name):
            raise CheckpointError(f"{name!r} is missing from the checkpoint (the manifest lists it)")
        try:
            size, digest = os.path.getsize(name), _sha256(name)
        except OSError as e:
            raise CheckpointError(f"{name!r} cannot be read: {e}") from None
        if size != meta["bytes"] or digest != meta["sha256"]:
            raise CheckpointError(f"{name!r} is corrupted: {size} bytes with sha256 {digest[:16]}..., the manifest "
                                  f"recorded {meta['bytes']} bytes with sha256 {meta['sha256'][:16]}...; load an "
                                  f"older checkpoint (fzero.checkpoint.complete(root))")
    if only is not None:
        check_listed(path, manifest, only)


def check_listed(path: str, manifest: dict[str, Any], names: set[str]) -> None:
    """Every file of `names` (those DCP's metadata has a rank read) is one the manifest lists,
    else a `CheckpointError` naming the others."""
    if names - set(manifest["files"]):
        raise CheckpointError(f"{path!r}: DCP's metadata names file(s) {sorted(names - set(manifest['files']))} that "
                              f"the manifest does not list; the checkpoint was altered after it was saved")


def _kernel() -> str:
    """This machine's running kernel, as far as files go: Linux's boot id (one per boot of a host,
    the same in every container on it), else the host's name and network address and this
    process (no two processes taken for one machine where that cannot be told)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        if boot:
            return boot
    except OSError:
        pass
    import socket
    import uuid

    return f"{socket.gethostname()}/{uuid.getnode():x}/{os.getpid()}"


_KERNEL = _kernel()


def _copy_key(name: str) -> str | None:
    """Which copy of a file this process reads at `name`: its kernel, device and inode (`_KERNEL`,
    `st_dev`, `st_ino`), so two ranks with the same key read the same bytes (ranks of one host
    reading a shared or a local folder) and ranks of other hosts, or of another copy, another
    key; None where the file cannot be looked at (the rank checks it itself, `_hash_shares`)."""
    try:
        st = os.stat(name)
    except OSError:
        return None
    return f"{_KERNEL}:{st.st_dev}:{st.st_ino}"


def _reads(path: str, manifest: dict[str, Any], names: set[str]) -> str:
    """What a rank tells the others of the files it reads (`names`, each listed in the manifest):
    JSON `{file: [copy key, bytes]}` (`_copy_key`, the manifest's size), for `_hash_shares`."""
    return json.dumps({f: [_copy_key(os.path.join(path, f)), manifest["files"][f]["bytes"]] for f in sorted(names)})


def _hash_shares(texts: Sequence[str], rank: int) -> set[str]:
    """The files rank `rank` hashes, from every rank's `_reads` (in rank order; "" for a rank
    whose checks stopped before): each copy of a file (one key of `_copy_key`; a file a rank
    could not look at is a copy of its own) is hashed by one of the ranks that read it, the one
    with the fewest bytes to hash so far (the copies read by the fewest ranks, and the largest,
    placed first; ties to the lowest rank). Every rank computes it from the same texts, so every
    copy read is hashed once; the verdict reaches every rank through the agreement that follows
    (`load`). Found in review: every rank hashed every file it read, and every rank reads the
    step counter in rank 0's file, so rank 0's whole file was hashed N times (at stage 0-2 of a
    DistMesh, or on a SimMesh, every file N times)."""
    groups: dict[tuple[str, str], tuple[list[int], int]] = {}
    for r, text in enumerate(texts):
        for f, (copy, nbytes) in (json.loads(text) if text else {}).items():
            readers, _ = groups.setdefault((f, copy if copy is not None else f"rank {r}"), ([], int(nbytes)))
            readers.append(r)
    work: collections.Counter[int] = collections.Counter()
    mine = set()
    for (f, _), (readers, nbytes) in sorted(groups.items(), key=lambda g: (len(g[1][0]), -g[1][1], g[0])):
        hasher = min(readers, key=lambda r: (work[r], r))
        work[hasher] += nbytes
        if hasher == rank:
            mine.add(f)
    return mine


def _read_metadata(path: str) -> Metadata:
    """DCP's metadata (`path/.metadata`), or a `CheckpointError` naming the file."""
    try:
        return _reader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - DCP raises what the unpickling or the file system raised
        raise CheckpointError(f"{os.path.join(path, '.metadata')!r} is not readable DCP metadata: "
                              f"{type(e).__name__}: {e}") from None


def _metadata(path: str, manifest: dict[str, Any]) -> Metadata:
    """DCP's metadata of the checkpoint, its file checked against the manifest first."""
    check_files(path, manifest, only={".metadata"})
    return _read_metadata(path)


def _tensor_md(metadata: Metadata, name: str) -> TensorStorageMetadata | None:
    md = metadata.state_dict_metadata.get(name)
    return md if isinstance(md, TensorStorageMetadata) else None


def _metadata_mismatches(manifest: dict[str, Any], metadata: Metadata) -> list[str]:
    """Where the manifest's leaves, buffers, world size and files say otherwise than DCP's
    metadata, in words (`check_metadata`); empty where they agree."""
    out = []
    leaves = manifest["leaves"]
    paths = [ls["path"] for ls in leaves]
    twice = sorted(p for p, n in collections.Counter(paths).items() if n > 1)
    if twice:
        out.append(f"leaves {twice[:5]} are listed twice")
    for ls in leaves:  # a leaf's canonical params: `params/<path>`, [numel], of its dtype (none if empty)
        numel, md = math.prod(ls["shape"]), _tensor_md(metadata, f"params/{ls['path']}")
        if numel and md is None:
            out.append(f"leaf {ls['path']!r} ({ls['dtype']}{ls['shape']}) is not saved")
        elif md is not None and (tuple(md.size) != (numel,) or md.properties.dtype != _dtype(ls["dtype"])):
            out.append(f"leaf {ls['path']!r} is {ls['dtype']}{ls['shape']} ({numel} elements) in the manifest, "
                       f"{_dtype_name(md.properties.dtype)} of {math.prod(md.size)} elements saved")
    names = metadata.state_dict_metadata  # params/<path>, opt/<field>/<path>: every leaf saved names one
    saved = sorted({k.removeprefix("params/") for k in names if k.startswith("params/")}
                   | {k.split("/", 2)[2] for k in names if k.startswith("opt/") and k.count("/") >= 2})
    listed = set(paths)
    unlisted = [p for p in saved if p not in listed]
    if unlisted:
        out.append(f"saved leaves {unlisted[:5]} are not in the manifest's leaves")
    buffers = {b["name"]: b for b in manifest.get("buffers") or ()}
    for k, b in buffers.items():  # saved whole, of their own shape and dtype
        md = _tensor_md(metadata, f"buffer/{k}")
        if md is None:
            out.append(f"buffer {k!r} is not saved")
        elif list(md.size) != b["shape"] or _dtype_name(md.properties.dtype) != b["dtype"]:
            out.append(f"buffer {k!r} is {b['dtype']}{b['shape']} in the manifest, "
                       f"{_dtype_name(md.properties.dtype)}{list(md.size)} saved")
    extra = sorted(k.removeprefix("buffer/") for k in metadata.state_dict_metadata
                   if k.startswith("buffer/") and k.removeprefix("buffer/") not in buffers)
    if extra:
        out.append(f"saved module buffers {extra[:5]} are not in the manifest's buffers "
                   f"({'none' if manifest.get('buffers') is None else 'it lists others'})")
    ranks = sorted(int(k.split("/")[1]) for k in metadata.state_dict_metadata
                   if re.fullmatch(r"rng/\d+/cpu", k))  # every rank saves its CPU RNG state
    if ranks != list(range(manifest["world_size"])):
        out.append(f"world_size is {manifest['world_size']} in the manifest, the RNG states of "
                   f"{len(ranks)} rank(s) are saved")
    if _tensor_md(metadata, "step") is None:
        out.append("the step counter is not saved")
    files = sorted({d.relative_path for d in metadata.storage_data.values()} - set(manifest["files"]))
    if files:
        out.append(f"DCP's data files {files[:5]} are not in the manifest's files")
    return out


def check_metadata(path: str, manifest: dict[str, Any], metadata: Metadata) -> None:
    """The manifest says what DCP's metadata (checked against the manifest's sha256 first)
    holds: every leaf of elements saved as `params/<path>` of its numel and dtype and every saved
    leaf listed, once; the buffers saved those listed, of their shapes and dtypes; the RNG states
    of `world_size` ranks; the step counter; every data file listed. Else a `CheckpointError`
    naming each difference. Before, an edit to a field that kept the manifest valid JSON loaded
    or exported wrong values silently (found in review: a leaf's shape cut to fewer elements
    exported that many of the saved ones, a leaf or buffer dropped from the list was left out of
    the export, a `world_size` edit left the RNG states unrestored, a huge shape was an
    allocation error). Checked before anything is allocated from the manifest's shapes. A
    reshape that keeps a leaf's numel, and the fields DCP keeps no trace of (stage, optimizer,
    lr record, precision, scaler, a leaf's group), are not seen here: `check_record`, after it,
    compares the whole manifest with the digest saved with the data."""
    problems = _metadata_mismatches(manifest, metadata)
    if problems:
        raise CheckpointError(f"{path!r}: the manifest does not match the checkpoint's DCP metadata: "
                              + "; ".join(problems[:6]) + ("; ..." if len(problems) > 6 else "")
                              + "; the manifest was edited or damaged: load another checkpoint "
                              "(fzero.checkpoint.complete(root) lists them)")


class _Record(NamedTuple):
    """What the data holds of the manifest (`_saved_record`), and the files it is in."""

    step: int
    digest: bytes | None  # `seal`'s sha256; None in a checkpoint saved before it
    files: set[str]


def _saved_record(path: str, manifest: dict[str, Any], metadata: Metadata) -> _Record:
    """Rank 0's step counter and `seal`'s sha256 as the data holds them: two `torch.save` records
    of ~1.6 KB each in one file, read by this process alone (no process group), planned against
    the `metadata` given (`_dcp_load`: `.metadata` is not read again). A read that fails is the
    file's damage where its sha256 says so (`check_files`), else a `CheckpointError` naming the
    error (the file is hashed only then)."""
    md = metadata.state_dict_metadata["step"]  # (`check_metadata`: saved, a tensor)
    wanted = {"step": ((), torch.empty(md.size, dtype=md.properties.dtype))}
    if DIGEST in metadata.state_dict_metadata:
        wanted[DIGEST] = ((0,), torch.empty(32, dtype=torch.uint8))
    items = read_plan(path, metadata, wanted)
    try:
        _dcp_load(path, metadata, wanted, items, None)
    except Exception as e:  # noqa: BLE001 - a damaged file named first, else said as it is
        check_files(path, manifest, only=files_read(metadata, items))
        raise CheckpointError(f"{path!r}: the saved step counter and manifest digest cannot be read "
                              f"({_error_text(e, 300)}); load another checkpoint (fzero.checkpoint.complete(root) "
                              f"lists them)") from None
    digest = wanted.get(DIGEST)
    return _Record(int(wanted["step"][1]), None if digest is None else digest[1].numpy().tobytes(),
                   files_read(metadata, items))


def check_record(path: str, manifest: dict[str, Any], metadata: Metadata, outcome: str = "") -> None:
    """The manifest is the one saved with the data: its step is the saved step counter, and the
    sha256 of its every field but "files" (`manifest_digest`) is the one `seal` saved (where the
    checkpoint has one: one saved before it has not, and only its step is compared). Else a
    `CheckpointError` naming the checkpoint and both values (the file holding them checked against
    its sha256 first: a damaged data file is named as such). So an edited manifest is refused
    however it was edited: a reshape of a leaf that keeps its numel, another stage, optimizer
    setting, lr record, precision, scaler, leaf group or `written` (found in review: `load`,
    `export` and `summary` took those as the truth). Reads ~3 KB of rank 0's file
    (`_saved_record`), nothing else (where they differ, that file is hashed: damage or an edit);
    `outcome` ("; nothing was loaded") ends the sentence."""
    problem = _record_mismatch(path, manifest, metadata, outcome)
    if problem is not None:
        raise CheckpointError(problem)


def _record_mismatch(path: str, manifest: dict[str, Any], metadata: Metadata, outcome: str = "") -> str | None:
    """`check_record`'s verdict: None where the manifest is the one saved with the data, else the
    words of its error; a damaged data file (the one holding the record) raises its own
    `CheckpointError` (`check_files`)."""
    step, digest, files = _saved_record(path, manifest, metadata)
    mine = manifest_digest(manifest)
    if step == manifest["step"] and digest in (None, mine):
        return None
    check_files(path, manifest, only=files)  # the data file damaged, not the manifest: named as such
    fix = "load another checkpoint: fzero.checkpoint.complete(root) lists them"
    if step != manifest["step"]:
        return (f"{path!r}: the manifest says step {manifest['step']} but the saved state holds step {step}: the "
                f"manifest was edited or damaged{outcome} ({fix})")
    return (f"{path!r}: the manifest does not match the data it was written with: the sha256 of its fields but "
            f"'files' is {mine.hex()[:16]}..., the data holds {digest.hex()[:16]}... (saved as {DIGEST!r}); the "
            f"manifest was edited or damaged after the save (any field but 'files': a leaf's shape or group, the "
            f"stage, optimizer, lr record, precision, scaler, buffers, written){outcome} ({fix})")


# -- loading ---------------------------------------------------------------------------------------


class _Wanted(NamedTuple):
    """What a rank reads, `{name: (offsets, destination view)}`, and the state it becomes."""

    ranges: dict[str, tuple[tuple[int, ...], torch.Tensor]]
    buffers: list[list[torch.Tensor]]  # per bucket: the params buffer, then each optimizer field's
    scalars: dict[str, torch.Tensor]  # "step", "loss_scale/<f>"
    rng: dict[str, torch.Tensor]  # "cpu", "cuda": this rank's saved RNG states (if restored)


def _wanted(target: ZeroState, metadata: Metadata, restore_rng: bool) -> _Wanted:
    """The ranges of canonical tensors `target`'s rank holds: its window of each bucket's
    `flat[M * S']` (stage 3 params, sharded optimizer fields) or the whole buffer, per leaf
    (`KINDS[kind].requests`); the scalars; and, with `restore_rng`, this rank's RNG states."""
    layout, stage, rank = target.layout, target.stage, target.rank
    ranges: dict[str, tuple[tuple[int, ...], torch.Tensor]] = {}
    buffers = []
    for b in range(len(layout.buckets)):
        like = torch.empty(0, dtype=layout.buckets[b].dtype, device=target.params[b].device)  # where params live
        kinds = [("params", "shard", like, stage.sharded("params"))]
        opt = target.opt_state[b]
        if opt is not None:
            kinds += [(f"opt/{field}", kind, t, stage.sharded("optimizer_state"))
                      for field, kind, t in zip(opt._fields, spec_of(target.optimizer, opt), opt)]
        bucket = []
        for prefix, kind, t, sharded in kinds:
            buf, requests = KINDS[kind].requests(layout, b, t, rank, sharded)
            ranges.update({f"{prefix}/{layout.leaves[leaf].path}": ((start,), view) for leaf, start, view in requests})
            bucket.append(buf)
        buffers.append(bucket)
    scalars = {"step": torch.empty_like(target.step)}
    if target.loss_scale is not None:
        scalars.update({f"loss_scale/{f}": torch.empty_like(t)
                        for f, t in zip(target.loss_scale._fields, target.loss_scale)})
    rng = {}
    if restore_rng:
        for kind in ("cpu", "cuda"):
            md = metadata.state_dict_metadata.get(f"rng/{rank}/{kind}")
            if md is not None and (kind == "cpu" or target.mesh.device.type == "cuda"):
                rng[kind] = torch.empty(md.size, dtype=md.properties.dtype)
    ranges.update({name: ((0,) * t.dim(), t) for name, t in scalars.items()})
    ranges.update({f"rng/{rank}/{kind}": ((0,) * t.dim(), t) for kind, t in rng.items()})
    return _Wanted(ranges, buffers, scalars, rng)


def _renewed(target: Any, shown: str) -> Any:
    """The target's info with fresh NVMe swap files (`StateInfo.renewed`), or, where the disk
    cannot hold them beside the target's own (`nvme.NoRoom`), an `OffloadError` that says the load
    needs both sets (found in review of offload: a resume on the disk the run trained on got
    `init`'s words, which named neither the load nor the target's files). Made among the checks
    the ranks agree on, so that it raises on every rank or on none (found in review: a rank whose
    disk had room loaded, and its next step met `RankFailed`)."""
    try:
        return target.info.renewed()
    except NoRoom as e:
        raise OffloadError(f"{shown}: a load into an NVMe target makes it a fresh set of swap files while the target's "
                           f"own still hold its state (twice the files on the disk for the load; the target's are "
                           f"removed when it is dropped): {e}. Nothing was loaded and the target is as it was; free "
                           f"room for a second set, or load into a state made by fzero.init with an nvme_path on "
                           f"another disk") from None


def _held(target: ZeroState, w: _Wanted, info: Any) -> tuple[tuple, tuple, tuple]:
    """`(params, master, opt_state)` from the filled buffers, held as `fzero.init` holds them."""
    layout, stage, rank = target.layout, target.stage, target.rank
    params, master, opt_state = [], [], []
    for b, spec in enumerate(layout.buckets):
        tier = info.host_tier(b)
        flat, *fields = w.buffers[b]
        if stage.sharded("params"):  # the buffer is this rank's shard already
            held, m = flat, None
        else:
            held, m = stage.hold(layout, b, flat, rank, target.precision.wire(spec).compute)
        held, m = place(stage, target.info.offload, tier, layout, b, held, m, rank,  # offloaded: master to the host
                        target.precision.wire(spec).compute, target.mesh.device)
        params.append(held)
        master.append(m)
        opt = target.opt_state[b]
        opt_state.append(None if opt is None else place_opt_state(tier, b, type(opt)(*fields)))
    return tuple(params), tuple(master), tuple(opt_state)


def _same_checkpoint(keys: list[list[int]]) -> bool:
    return len({tuple(k) for k in keys}) <= 1


@_interrupts_held
@outside_inference_mode  # a state of normal tensors, as `init` and the step make under inference mode
def load(path: str | os.PathLike, target: ZeroState, *, restore_rng: bool = True,
         buffers: Mapping[str, torch.Tensor] | None = None) -> ZeroState:
    """A new state for `target`'s mesh, rank, stage and settings (any world size M, any stage)
    holding the values saved at `path`; `target` (made by `fzero.init`) is not changed.

    Every rank calls it, with the same checkpoint; a Ctrl-C during it is held until it returns
    (`_interrupts_held`). Before the state is read, the manifest is
    checked against the data it was written with (`check_metadata`, and `check_record`: its step
    and seal, ~3 KB of rank 0's file), then against `target` (leaves, optimizer, lr
    schedule, scaler, precision), this rank's read plan is made (`read_plan`: only the saved
    chunks that overlap what the rank holds) and every file a rank touches is checked against its
    sha256, by one of the ranks that read that copy of it (`_hash_shares`: once per file and host,
    where every rank hashed each file it read, rank 0's N times); the ranks agree on the checks
    and on the checkpoint
    they read (the manifest's step and sha256: ranks that were given different checkpoints, e.g.
    each from its own `latest(root)` while a save ran, raise naming each rank's path and step),
    so a `CheckpointError` is raised on every rank or on none. Then `dcp.load` fills fresh
    buffers: each bucket's master values, held as `fzero.init` holds them (`Stage.hold`: the
    shard, the master shard beside the compute copy `flat.to(compute)`, or the whole buffer);
    each optimizer field per its spec; the step counter and loss scale as saved. With
    `restore_rng` and M == N, this rank's torch RNG states (torch's CPU generator, and CUDA's
    where saved and initialised) are set to the ones saved by the same rank; at another world
    size they are left as they are, without a word, and Python's `random`, numpy's and the user's
    own `torch.Generator` objects are never saved nor restored. On a `SimMesh`, whose `mesh.run`
    restores the caller's RNG as it returns, a restored state lasts to the end of the run that
    loaded it: load and train in one `mesh.run` (found in review: training in the next run drew
    other dropout masks). With `buffers` (`{name: tensor}`, e.g.
    `ModuleInfo.buffers`), the buffers `save(..., buffers=)` kept (rank 0's) are copied into
    them in place, on every rank that passes them; the names, shapes and dtypes must be the
    saved ones. Without `buffers`, a checkpoint that holds them warns (`BuffersNotLoaded`, on
    every rank), where before it left them unloaded silently (found in review).

    An optimizer of fzero's (`adam`, `adamw`, `sgd`) made with another `impl` than the saved one
    ("single", "foreach", "fused", None), and otherwise the same, loads: the state means the same
    under each, and a resume on another machine may lack the saved impl's kernel (`_impl_adopted`).
    The steps after the load take the target impl's bits, each impl being bitwise its torch
    counterpart, not bitwise each other's: such a resume is not bitwise the uninterrupted run. No
    warning: the impl is the one the target was made with, and a default `impl=None` loads
    across devices where it resolves to another one (fused on CUDA, foreach on the CPU) as before.
    """
    if not isinstance(target, ZeroState):
        raise CheckpointError(f"checkpoint.load: target must be a ZeroState made by fzero.init (the state to load "
                              f"into), got {type(target).__name__}")
    mesh = target.mesh
    with mesh.guard():
        error, key, shown = None, None, _short(path, 300)
        read: dict[str, torch.Tensor] = {}  # the saved buffers, read into fresh tensors first
        try:
            # load overwrites it: a broken donated target is what it restores, and an NVMe target whose
            # files another state (or a failed write) rewrote lends only its structure (found in review)
            check_state(target, pending=False, holds=False)
            path = _checkpoint_path(path, "checkpoint.load: ")
            shown = repr(path)
            manifest, digest = _read_manifest(path)
            key = (manifest["step"], _int64(digest), 0)
            metadata = _metadata(path, manifest)
            check_metadata(path, manifest, metadata)
            check_record(path, manifest, metadata, "; nothing was loaded")  # before the target is compared with it
            check_fits(path, manifest, target)
            bufs = _checked_buffers(buffers, "checkpoint.load")
            if bufs is not None:
                _check_buffers_fit(path, manifest, bufs)
            w = _wanted(target, metadata, restore_rng and manifest["world_size"] == mesh.world_size)
            read = {k: torch.empty(t.shape, dtype=t.dtype) for k, t in (bufs or {}).items()}  # on the host
            w.ranges.update({f"buffer/{k}": ((0,) * t.dim(), t) for k, t in read.items()})
            items = read_plan(path, metadata, w.ranges)
            mine = files_read(metadata, items)
            check_listed(path, manifest, mine)
            reads = _reads(path, manifest, mine)
        except Exception as e:  # noqa: BLE001 - agreed on first, then raised (_agree)
            error = e
        # every rank reaches this: each file read is hashed by one rank of those reading its copy
        shares = _hash_shares(gather_texts(mesh, "" if error is not None else reads, "fzero.checkpoint/reads"),
                              mesh.rank)
        info = None
        if error is None:
            try:
                check_files(path, manifest, only=shares)
                info = _renewed(target, shown)  # NVMe: fresh swap files, so the target's stay as they are
            except Exception as e:  # noqa: BLE001 - agreed on first, then raised (_agree)
                error = e

        def different(rows: list[list[int]], given: list[str]) -> str:
            return (f"the ranks of {mesh!r} passed different checkpoints to checkpoint.load:"
                    + "".join(f"\n  rank {s}: {given[s]} " + (f"(step {r[2]}, manifest sha256 {_hex(r[3])}...)"
                                                               if r[1] else "(no manifest read)")
                              for s, r in enumerate(rows))
                    + "\nevery rank must load the same checkpoint: choose it once and pass it to every rank (each "
                    "rank calling fzero.checkpoint.latest(root) while a save runs may pick another step; e.g. choose "
                    "on rank 0 and send it with torch.distributed.broadcast_object_list); nothing was loaded")

        def unfit(failures: list[tuple[int, str]]) -> str:
            return (f"{shown}: {len(failures)} other rank(s) of {mesh!r} found the checkpoint damaged or unfit; nothing was "
                    f"loaded:{_listed(failures)}")

        _agree(mesh, "fzero.checkpoint/checked", error, key, shown, failed=unfit, same=_same_checkpoint,
               differ=different)
        _dcp_load(path, metadata, w.ranges, items, mesh)
        params, master, opt_state = _held(target, w, info)
        if w.rng:
            _set_rng_states(mesh, w.rng)
        for k, t in read.items():  # each in the mode it was made in: `load` runs outside inference mode (a
            # module built under it); no_grad inside, as inference_mode(False) turns grad mode on: a buffer that
            # requires grad was torch's in-place error on a leaf (found in review)
            with torch.inference_mode(bufs[k].is_inference()), torch.no_grad():  # type: ignore[index]
                bufs[k].copy_(t)  # type: ignore[index]  # `read` is empty where `bufs` is None
        if manifest.get("buffers"):  # (the same manifest on every rank: every rank calls it or none)
            buffers_written(mesh, "fzero.checkpoint/buffers_written")
        if bufs is None and manifest.get("buffers"):  # on every rank: each raises alike under -W error
            warnings.warn(BuffersNotLoaded(
                f"checkpoint.load: {shown} holds module buffers {[b['name'] for b in manifest['buffers']][:6]} (saved "
                f"with buffers=), which were not loaded: pass buffers=info.buffers to load them (BatchNorm's running "
                f"statistics: without them the resumed model is not the saved one), or silence this warning "
                f"(fzero.checkpoint.BuffersNotLoaded) where leaving them is meant"), stacklevel=outside_stacklevel())
    scale = None
    if target.loss_scale is not None:
        scale = LossScaleState(*(w.scalars[f"loss_scale/{f}"] for f in target.loss_scale._fields))
    return ZeroState(params, opt_state, w.scalars["step"], master, scale, info)


# -- export, offline ----------------------------------------------------------------------------

_SAFETENSORS = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16",
                torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2", torch.bool: "BOOL",
                torch.int8: "I8", torch.int16: "I16", torch.int32: "I32", torch.int64: "I64", torch.uint8: "U8",
                torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}  # BatchNorm's num_batches_tracked: I64


def export(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
           aliases: dict[str, tuple[str, ...]] | None = None,
           buffers: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """The full params saved at `path`, `{leaf path: tensor}` (master values, in their dtype or
    `dtype`), read from the files alone: no process group, no mesh, any world size it was saved
    at. `dtype` casts what `module.to(dtype)` casts (`_as_module_to`): the params and the floating
    buffers (BatchNorm's running statistics), not the others (its int64 `num_batches_tracked`);
    before, the buffers kept their saved dtype, so a bf16 export held fp32 running statistics
    (found in review). With `aliases` (`ModuleInfo.aliases` of `fzero.from_module`), every name
    of a tied weight gets the same tensor, so the dict is a `state_dict` the original module's
    `load_state_dict` takes; the module buffers a `save(..., buffers=)` kept are in it too (else
    load it with `strict=False`). A module's non-persistent buffers, which its `state_dict` leaves
    out, are among `ModuleInfo.buffers` and so in the dict: a strict `load_state_dict` refuses
    them as unexpected keys, and `strict=False` skips them (their values are not loaded: the
    module makes them itself; found in review). A module's extra state (`get_extra_state`, whose
    `state_dict` key is `{prefix}_extra_state`) is not in a checkpoint, so not in the dict: a strict
    `load_state_dict` refuses it as missing keys; add it from the run, `{**export(path,
    aliases=info.aliases), **info.extra_state(full)}` (`ModuleInfo.extra_state`; `full` the run's
    `fzero.gather(state)`, which a `get_extra_state` that reads a parameter needs), or load with
    `strict=False`, which leaves the module's own (found in review); `load` restores none either.
    Without `aliases` (`fzero export` on the command line) a tied weight is under one of its names
    only: load with `strict=False`, and the module's tie fills the other. Files are checked against their sha256 first, and the manifest
    against the data (`check_metadata`, `check_record`: an edited manifest is refused); a `dtype` that is
    not a floating torch dtype, or `aliases` that name a leaf the checkpoint does not hold or
    rename one it does, are a `CheckpointError` before anything is read. `buffers`: the names of
    the saved buffers to include (`info.buffers`, whose keys are the module's), None: every one --
    a buffer of your own saved beside the module's (the data position, `save(..., buffers={**info.buffers,
    "batches_seen": t})`) is otherwise in the dict too, and a strict `load_state_dict` refuses it
    (found in review); a name that was not saved is a `CheckpointError`."""
    path = _checkpoint_path(path, "checkpoint.export: ")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointError(f"checkpoint.export: dtype must be None or a floating torch.dtype (torch.bfloat16, "
                              f"torch.float16, torch.float32, torch.float64), got {type(dtype).__name__} "
                              f"{_short(dtype)}; nothing was read")
    manifest = read_manifest(path)
    _check_aliases(path, aliases, [ls["path"] for ls in manifest["leaves"]],
                   [b["name"] for b in manifest.get("buffers") or ()])
    kept = _kept_buffers(path, buffers, [b["name"] for b in manifest.get("buffers") or ()])
    check_files(path, manifest)
    metadata = _read_metadata(path)
    check_metadata(path, manifest, metadata)  # before the manifest's shapes are allocated
    check_record(path, manifest, metadata)  # the step `fzero export` writes, and every other field
    leaves = manifest["leaves"]
    flats = {ls["path"]: torch.zeros(math.prod(ls["shape"]), dtype=_dtype(ls["dtype"])) for ls in leaves}
    wanted = {f"params/{p}": ((0,), t) for p, t in flats.items() if t.numel()}
    saved = {b["name"]: torch.empty(b["shape"], dtype=getattr(torch, b["dtype"])) for b in manifest.get("buffers") or ()
             if b["name"] in kept}
    wanted.update({f"buffer/{k}": ((0,) * t.dim(), t) for k, t in saved.items()})
    items = read_plan(path, metadata, wanted)
    _dcp_load(path, metadata, wanted, items, None)
    out = {ls["path"]: flats[ls["path"]].view(ls["shape"]) for ls in leaves}
    out = {k: _as_module_to(t, dtype) for k, t in out.items()}
    saved = {k: _as_module_to(t, dtype) for k, t in saved.items()}
    if aliases:
        out = aliased(out, aliases)
    return {**out, **saved}


def _as_module_to(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """`t` as `module.to(dtype)` leaves a param or buffer: cast where floating, else as it is
    (an int64 step count, a bool mask: casting would change what they count). A complex param
    or buffer stays as it is too, where `Module.to` would drop its imaginary part. None: as saved."""
    return t.to(dtype) if dtype is not None and t.is_floating_point() else t


def _kept_buffers(path: str, buffers: Any, saved: list[str]) -> set[str]:
    """The saved buffers `export(buffers=)` keeps: every one where None, else the names given (a
    dict's keys), each of which must be saved: else a `CheckpointError` naming it and those saved."""
    if buffers is None:
        return set(saved)
    if isinstance(buffers, (str, bytes)) or not isinstance(buffers, Collection) or not all(
            isinstance(b, str) for b in buffers):
        raise CheckpointError(f"checkpoint.export: buffers must be None or a collection of buffer names (info.buffers),"
                              f" got {type(buffers).__name__} {_short(buffers)}; nothing was read")
    missing = sorted(set(buffers) - set(saved))
    if missing:
        raise CheckpointError(f"checkpoint.export: buffers names {_short(missing, 200)}, which {path!r} does not hold "
                              f"(its buffers: {_short(saved, 200)}; save(..., buffers=...) writes them); nothing "
                              f"was read")
    return set(buffers)


def _check_aliases(path: str, aliases: Any, leaves: list[str], buffers: list[str]) -> None:
    """`aliases` is None or `{saved leaf path: (other names,)}` (`ModuleInfo.aliases`) whose other
    names are new: else a `CheckpointError` naming the entry. (Found in review: a leaf of another
    model was a `KeyError`, a str of names was split into one-letter names, and an alias naming a
    saved leaf replaced that leaf's tensor with another's, silently.)"""
    if aliases is None:
        return
    fix = "pass ModuleInfo.aliases of the model the checkpoint was saved from (fzero.from_module)"
    if not isinstance(aliases, Mapping):
        raise CheckpointError(f"checkpoint.export: aliases must be None or a dict {{leaf path: (alias, ...)}}, got "
                              f"{type(aliases).__name__} {_short(aliases)}; {fix}")
    taken = set(leaves) | set(buffers)
    for name, names in aliases.items():
        if name not in leaves:
            raise CheckpointError(f"checkpoint.export: aliases names leaf {name!r}, which {path!r} does not hold "
                                  f"(its leaves: {_short(leaves, 200)}); {fix}")
        if isinstance(names, (str, bytes)) or not isinstance(names, (tuple, list)) or not all(
                isinstance(a, str) for a in names):
            raise CheckpointError(f"checkpoint.export: aliases[{name!r}] must be a tuple of str names, got "
                                  f"{type(names).__name__} {_short(names)}; {fix}")
        for alias in names:
            if alias == name:  # (ModuleInfo.aliases lists the name itself first)
                continue
            if alias in taken:
                raise CheckpointError(f"checkpoint.export: aliases[{name!r}] names {alias!r}, which is a leaf or "
                                      f"buffer of {path!r} itself (it would be replaced by {name!r}'s values); {fix}")
            taken.add(alias)


def _check_safetensors_names(tensors: Any, metadata: Any) -> None:
    """What safetensors' readers take, checked before anything is written (found in review: a
    metadata value that was not a str gave a file `safetensors.torch.load_file` refuses, "invalid
    type: integer"): names and metadata of str, metadata values of str, no tensor named
    `__metadata__` and no metadata key `alias:...`, which would read as an alias of this writer."""
    if not isinstance(tensors, dict) or not all(isinstance(t, torch.Tensor) for t in tensors.values()):
        raise CheckpointError(f"save_safetensors: tensors must be a dict of name -> torch.Tensor, got "
                              f"{type(tensors).__name__}; nothing was written")
    if metadata is not None and not isinstance(metadata, dict):
        raise CheckpointError(f"save_safetensors: metadata must be None or a dict of str -> str, got "
                              f"{type(metadata).__name__}; nothing was written")
    problems = [f"tensor name {k!r} is not a str" for k in tensors if not isinstance(k, str)]
    problems += ["a tensor may not be named '__metadata__' (the header's own key)"] * ("__metadata__" in tensors)
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            problems.append(f"metadata[{k!r}] = {v!r} ({type(k).__name__} -> {type(v).__name__}; the format takes str -> str)")
        elif k.startswith("alias:"):
            problems.append(f"metadata key {k!r} (keys 'alias:<name>' record the aliases of the tensors written)")
    if problems:
        raise CheckpointError(f"save_safetensors: {'; '.join(problems)}; nothing was written")


def _regular_out(out: str | os.PathLike) -> str:
    """`out` as the file to replace: a symbolic link resolved to its target; `CheckpointError`
    where that is there and is not a regular file (or a folder, which the rename refuses itself)."""
    try:
        mode = os.stat(out).st_mode  # following every link, `/dev/stdout`'s magic one too (found in review:
        # the stat of its realpath, `pipe:[N]`, failed and the write named no FIFO)
    except FileNotFoundError:
        mode = None
    except OSError as e:
        if e.errno == errno.ELOOP:  # (found in review: the rename replaced a link of a loop, where open fails)
            raise CheckpointError(f"save_safetensors: {os.fspath(out)!r} goes through a loop of symbolic links, or more "
                                  f"links in a row than the system follows; nothing was written") from None
        mode = None  # (unreadable: the write says why)
    path = os.path.realpath(out) if os.path.islink(out) else os.fspath(out)
    if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode)
                else "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
        raise CheckpointError(f"save_safetensors: {os.fspath(out)!r} is {kind}: the write replaces its file by "
                              f"renaming a complete one onto it, which would put a regular file in its place; "
                              f"name a regular file; nothing was written")
    return path


def save_safetensors(tensors: dict[str, torch.Tensor], out: str | os.PathLike, metadata: dict[str, str] | None = None
                     ) -> None:
    """Write `tensors` as a safetensors file (an 8-byte little-endian header length, a JSON header
    of dtype, shape and byte offsets per name, padded to 8 bytes, then the raw little-endian data).
    A tensor reached under two names is written once (safetensors has no aliasing): the later
    name is not a tensor of the file but a `"alias:<name>": <first name>` entry of its
    `__metadata__`, which also holds `metadata` (`{str: str}`, as the format requires). The bytes go
    to a uniquely named temporary file beside `out`, renamed onto `out` when complete: `out` is
    whole or untouched, and a failure (an `out` that is a folder, a full disk) leaves no file. A
    symbolic link is written through (its target replaced, as `open(out, "w")` would write it); an
    `out` that is there and not a regular file (`/dev/null`, a FIFO, a socket) is refused: the
    rename put a regular file in its place (found in review: `fzero export CKPT /dev/null`, as root,
    replaced the device)."""
    _check_safetensors_names(tensors, metadata)
    out = _regular_out(out)
    other = {name: str(t.dtype) for name, t in tensors.items() if t.dtype not in _SAFETENSORS}
    if other:
        raise CheckpointError(f"save_safetensors: safetensors has no dtype for {other} (it takes "
                              f"{sorted({str(d).removeprefix('torch.') for d in _SAFETENSORS})}); nothing was written")
    seen: dict[int, str] = {}
    header: dict[str, Any] = {"__metadata__": dict(metadata or {})}
    blobs, offset = [], 0
    for name, t in tensors.items():
        if id(t) in seen:
            header["__metadata__"][f"alias:{name}"] = seen[id(t)]
            continue
        seen[id(t)] = name
        data = t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": _SAFETENSORS[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    # A temporary file of a name no other writer uses, beside `out` (same file system: the rename
    # is atomic); removed if anything fails, `out` itself then untouched (found in review: an `out`
    # that was a folder left `out.tmp` behind).
    tmp = f"{os.fspath(out)}.{os.getpid()}-{os.urandom(4).hex()}.tmp"
    try:
        with open(tmp, "xb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for blob in blobs:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def summary(path: str | os.PathLike) -> str:
    """What `fzero inspect` prints of the checkpoint at `path`: step, world size, stage,
    optimizer, precision, scaler, and each leaf's path, shape, dtype and bytes. Checked first:
    every file's size, `.metadata`'s sha256, the manifest against DCP's metadata and against the
    step and seal saved with the data (`check_record`: ~3 KB of rank 0's file); the data files
    are not hashed (`load` and `export` do), but where the seal or step differs (to name a damaged
    file rather than an edited manifest)."""
    path = _checkpoint_path(path, "checkpoint.summary: ")
    m = read_manifest(path)
    lr = _constant_lr(m["optimizer"])
    lines = [f"{path}: step {m['step']}, saved by {m['world_size']} rank(s) at stage {m['stage']}",
             f"optimizer: {optimizer_name(m['optimizer'])}" + (f", lr {lr}" if lr is not None else ""),
             f"precision: {_shown_policy(m)}; loss scaler: {m.get('scaler')}"]
    total = 0
    for ls in m["leaves"]:
        nbytes = math.prod(ls["shape"]) * _dtype(ls["dtype"]).itemsize
        total += nbytes
        lines.append(f"  {ls['path']:40s} {ls['dtype']:9s} {str(ls['shape']):20s} {nbytes:>12,} B"
                     + (" (frozen)" if ls["frozen"] else ""))
    if m.get("buffers"):
        lines.append(f"module buffers (rank 0's): " + ", ".join(f"{b['name']} {b['dtype']}{b['shape']}"
                                                               for b in m["buffers"][:8])
                     + (" ..." if len(m["buffers"]) > 8 else ""))
    damaged = _damaged_files(path, m)
    if damaged:
        raise CheckpointError(f"{path!r} is damaged: " + "; ".join(damaged) + " (latest() and complete() skip it, load "
                              f"and export refuse it: use another checkpoint, fzero.checkpoint.complete(root) lists "
                              f"them)")
    files = sum(meta["bytes"] for meta in m["files"].values())
    metadata = _metadata(path, m)  # its sha256 too: a small file (a manifest of another save names another one)
    check_metadata(path, m, metadata)
    check_record(path, m, metadata)  # ~3 KB of rank 0's file: the step and the manifest's digest
    md = metadata.state_dict_metadata
    chunks = sum(len(v.chunks) for v in md.values() if isinstance(v, TensorStorageMetadata))
    lines.append(f"{len(m['leaves'])} leaves, {total:,} B of params; {len(md)} DCP tensors in {chunks} chunks; "
                 f"{len(m['files'])} files, {files:,} B on disk")
    return "\n".join(lines)
