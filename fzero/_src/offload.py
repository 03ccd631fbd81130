"""Offload: the master copy and optimizer state in host memory, and stage 3's shards too.

`Offload(optimizer="cpu")` (stages 1-3) keeps, per trainable bucket, this rank's fp32 master
`shard[S]` and the optimizer state in host memory (pinned where CUDA is available); the device
keeps what the loss reads (stages 1-2: the full buffer, stage 3: the shard, in the compute
dtype). One step per bucket (`update.update`):

    g_dev[S]  --(device -> host, all buckets started at once; CUDA: a side stream + events)-->
    g_host[S] --(the optimizer on the host: torch's CPU kernels)--> master'[S], state'
    master'   --(host -> device, in the dtype the device holds)--> the stage's `finish`

`Offload(params="cpu")` (stage 3, with the optimizer offloaded) keeps the param shards in host
memory: the shard *is* the master; a unit's `enter` copies each bucket's shard (cast to the
compute dtype first: half the bytes for bf16) to the device and all-gathers it, inside the
prefetched flight (`Piece.start`): the stage's own piece wrapped (`stage_of`). The step
differentiates a device stand-in of each shard (`differentiated`), so gradients are reduced and
kept on the device as without offload.

What moves between tiers is copied, never rounded (the casts are those the stage does anyway),
and the optimizer runs on the same values: on a CPU-only machine (where the "device" is the
CPU and the tier copies into separate buffers) an offloaded run is bitwise the run without
offload (tests/test_offload.py); on CUDA the CPU optimizer kernel stands in for the CUDA one
(proofs/offload.md says what is then bitwise and bounds AdamW's difference).

`HostTier` is the seam a tier plugs into: copies to and from the host (`host`, `start_host`,
`to_device`) and, per bucket, where its optimizer state and master shard live between steps
(`restore`, `prefetch`, `fetch`, `store`, `snapshot`; `keep_master`, `fetch_master`,
`store_master`, `read_master`; `flush`: in host memory, the identity; `NvmeTier` reads and
writes swap files, `fzero._src.nvme.SwapFiles`, and the state holds stand-ins).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import weakref
from collections.abc import Callable
from fractions import Fraction
from typing import Any, NamedTuple

import optree
import torch

from .errors import ConfigError, OffloadError, refusing_unknown_keywords
from .precision import added_in
from .stages import ENTER_GATHER, Flight, Piece, Stage, Wire
from .layout import is_stand_in, stand_in  # (the registry of stand-ins: `layout`'s last section)
from .unit import finite_witness, wait_held

OPTIMIZER_TIERS = (None, "cpu", "nvme")
PARAM_TIERS = (None, "cpu", "nvme")


_DEEPSPEED_NAMES = {  # DeepSpeed's offload_optimizer / offload_param keys -> fzero's
    "device": "optimizer= (offload_optimizer's device) or params= (offload_param's): None, 'cpu' or 'nvme'",
    "offload_optimizer": ("optimizer= ('cpu' or 'nvme'; its nvme_path and ratio are Offload's too, its pin_memory "
                          "is pin=)"),
    "offload_param": "params= ('cpu' or 'nvme')",
    "pin_memory": "pin=",
    "use_direct_io": "direct=",
    **{k: "no such setting: fzero's tiers size and schedule their own buffers (docs/offload.md)"
       for k in ("buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline", "pipeline_read",
                 "pipeline_write")},
}


def _unknown_offload_settings(unknown: dict[str, Any]) -> ConfigError:
    """`Offload`'s words for keywords it has no field for, with fzero's name for each of
    DeepSpeed's config keys (found in review: Python's bare TypeError for `device=`)."""
    named = "; ".join(f"{k} -> {_DEEPSPEED_NAMES.get(k, 'no such setting')}" for k in unknown)
    return ConfigError(f"Offload got {', '.join(repr(k) for k in unknown)} ({named}); its settings are optimizer, "
                       f"params, nvme_path, ratio, pin and direct (help(fzero.Offload), docs/deepspeed.md)")


@refusing_unknown_keywords(lambda given, unknown: _unknown_offload_settings(unknown))
@dataclasses.dataclass(frozen=True)
class Offload:
    """Where model state lives besides the device (given to `fzero.init(..., offload=...)`).

    Attributes:
      optimizer: None (on the device), "cpu" (the master shard and optimizer state in host
        memory; the update runs on the host) or "nvme" (as "cpu", with the fp32 master shard and
        the optimizer state's "shard" fields in swap files under `nvme_path`, `NvmeTier`: host
        memory keeps only their read and staging buffers; needs `donate=True`). Stages 1-3.
      params: None, "cpu" or "nvme": stage 3's param shards in host memory, brought to the
        device per unit ahead of its all-gather. Needs `optimizer` offloaded (the host shard is
        the master the host updates, as FSDP2's `CPUOffloadPolicy`). "nvme" (needs
        `optimizer="nvme"`): each trainable bucket's compute-dtype copy of its shard is a swap
        file too, read when its unit's gather starts (prefetched with it); frozen buckets keep
        their shard in host memory (see `stage_of`).
      nvme_path: the directory of the swap files (`optimizer="nvme"`).
      ratio: the fraction of the trainable elements whose optimizer state is offloaded
        (DeepSpeed's `ratio`), in whole buckets: the first trainable buckets in layout order stay
        on the device while they fit in `1 - ratio` of the elements (`host_buckets`); 1.0: all.
        Choose `bucket_bytes` for a finer split.
      pin: pin host buffers where CUDA is available (page-locked: asynchronous copies).
      direct: NVMe swap files read and written with O_DIRECT (past the page cache, as the disk
        really is; a filesystem that refuses it raises `OffloadError` at `init`).
    """

    optimizer: str | None = None
    params: str | None = None
    nvme_path: str | None = None
    ratio: float = 1.0
    pin: bool = True
    direct: bool = False

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZER_TIERS:
            raise ConfigError(f"Offload.optimizer must be one of {OPTIMIZER_TIERS}, got {self.optimizer!r}")
        if self.params not in PARAM_TIERS:
            raise ConfigError(f"Offload.params must be one of {PARAM_TIERS}, got {self.params!r}")
        if self.params == "nvme" and self.optimizer != "nvme":
            raise ConfigError(f"Offload(params='nvme') keeps stage 3's shards in the swap files of the NVMe tier, "
                              f"which holds the master and optimizer state: use Offload(optimizer='nvme', "
                              f"params='nvme', nvme_path=...), or Offload(optimizer='cpu', params='cpu') (got "
                              f"optimizer={self.optimizer!r})")
        if self.params is not None and self.optimizer is None:
            raise ConfigError(f"Offload(params={self.params!r}) keeps stage 3's shards on the host, where they are the "
                              f"master copy the optimizer updates: offload the optimizer too, "
                              f"Offload(optimizer='cpu', params={self.params!r}) (FSDP2's CPUOffloadPolicy)")
        if self.nvme_path is not None and (isinstance(self.nvme_path, bytes)
                                           or not isinstance(self.nvme_path, (str, os.PathLike))):
            raise ConfigError(f"Offload.nvme_path must be a str or os.PathLike directory, got "
                              f"{type(self.nvme_path).__name__} {self.nvme_path!r}")
        if self.optimizer == "nvme" and not self.nvme_path:
            raise ConfigError("Offload(optimizer='nvme') needs nvme_path=<a directory on the NVMe drive> for the "
                              "optimizer state's swap files; or use optimizer='cpu'")
        if self.nvme_path is not None and self.optimizer != "nvme":
            raise ConfigError(f"Offload(nvme_path={self.nvme_path!r}) is read only with optimizer='nvme' (got "
                              f"optimizer={self.optimizer!r}); drop nvme_path or set optimizer='nvme'")
        r = self.ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or not 0 < r <= 1:
            raise ConfigError(f"Offload.ratio must be a float in (0, 1] (the fraction of the trainable elements whose "
                              f"optimizer state is offloaded, in whole buckets), got {r!r}")
        if r != 1 and self.params is not None:
            raise ConfigError(f"Offload(ratio={r}, params={self.params!r}): with params offloaded every shard is on "
                              f"the host (it is the master), so the whole optimizer state is too; use ratio=1.0, or "
                              f"params=None")
        if not isinstance(self.pin, bool):
            raise ConfigError(f"Offload.pin must be a bool, got {self.pin!r}")
        if not isinstance(self.direct, bool) or self.direct and self.optimizer != "nvme":
            raise ConfigError(f"Offload.direct must be a bool, and True only with optimizer='nvme' (O_DIRECT swap "
                              f"files), got direct={self.direct!r} with optimizer={self.optimizer!r}")

    @property
    def active(self) -> bool:
        return self.optimizer is not None

    def host_buckets(self, layout: Any) -> frozenset[int]:
        """The buckets whose state lives on the host: with params offloaded, every bucket; else the
        trainable buckets after the longest prefix (in layout order) of trainable buckets whose
        shards hold at most `(1 - ratio)` of all trainable shard elements. The same on every rank
        (shard sizes are)."""
        if not self.active:
            return frozenset()
        if self.params is not None:
            return frozenset(range(len(layout.buckets)))
        trainable = [b for b, spec in enumerate(layout.buckets) if not spec.group.frozen]
        sizes = [layout.buckets[b].shard_numel for b in trainable]
        ratio = Fraction(repr(float(self.ratio)))  # exact, as the estimate reads it (0.9 -> 9/10)
        keep, room, kept = 0, (1 - ratio) * sum(sizes), 0
        while keep < len(trainable) and kept + sizes[keep] <= room:
            kept += sizes[keep]
            keep += 1
        return frozenset(trainable[keep:])

    def check_stage(self, stage: Stage) -> None:
        """Stage 0 has no shard to offload; params offload needs stage 3's sharded params."""
        if self.active and not stage.sharded("optimizer_state"):
            raise ConfigError(f"Offload(optimizer={self.optimizer!r}) moves this rank's shard of the optimizer state "
                              f"and master copy to the host, but stage {stage.level} replicates them (no shard); use "
                              f"stage 1, 2 or 3, or offload=None")
        if self.params is not None and not stage.sharded("params"):
            where = "in swap files" if self.params == "nvme" else "on the host"
            raise ConfigError(f"Offload(params={self.params!r}) keeps param shards {where}, but stage "
                              f"{stage.level} holds the full params on every rank; use stage=3, or params=None")


NO_OFFLOAD = Offload()


def check_offload(offload: Any) -> Offload:
    if offload is None:
        return NO_OFFLOAD
    if not isinstance(offload, Offload):
        raise ConfigError(f"offload must be None or a fzero.Offload(...), e.g. fzero.Offload(optimizer='cpu'), got "
                          f"{type(offload).__name__} {offload!r}")
    return offload


# -- the host tier ------------------------------------------------------------------------------


class Transfer:
    """A copy in flight: `wait()` returns the destination once the copy is done (CUDA: its event
    synchronised; otherwise the copy was made at start)."""

    def __init__(self, result: torch.Tensor, event: Any = None) -> None:
        self.result, self.event = result, event

    def wait(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.result


@functools.cache
def _side_stream(device: torch.device) -> Any:
    return torch.cuda.Stream(device)


@dataclasses.dataclass(frozen=True)
class HostTier:
    """Copies between the mesh's `device` and host memory. On CUDA host buffers are pinned (if
    `pin`) and copies are `non_blocking`; device -> host copies run on a side stream after the
    current stream's work (`start_host`), so several overlap the host's updates. Elsewhere (the
    CPU-only stand-in) every copy is a copy into a separate buffer: the same code, the same bits.
    """

    device: torch.device
    pin: bool = True
    in_place = False  # whether a step writes the stored optimizer state in place (NVMe: its files)
    # the device -> host copies started during the backward (`start_early`): id(device tensor) ->
    # (a weak reference to it, its Transfer, its norm or None); an entry goes with its tensor
    early: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def pinned(self, x: torch.Tensor) -> torch.Tensor:
        """`x` (a host tensor) in page-locked memory where copies to CUDA may then be asynchronous;
        a tensor already on the device is left where it is (only host memory can be pinned)."""
        return x.pin_memory() if self.cuda and self.pin and x.device.type == "cpu" and not x.is_pinned() else x

    def host(self, x: torch.Tensor) -> torch.Tensor:
        """A host copy of `x` (a new buffer; pinned on CUDA); blocking."""
        if self.cuda:
            out = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.pin)
            return out.copy_(x.detach())
        return x.to(device="cpu", copy=True)

    def start_host(self, x: torch.Tensor) -> Transfer:
        """`host(x)` without waiting: on CUDA a `non_blocking` copy into a pinned buffer on the side
        stream, after the work queued on `x`'s stream (the caching allocator is told the side stream
        uses `x`); elsewhere the copy, made now. Where `start_early(x)` started the copy of this
        very tensor already (during the backward), that copy."""
        hit = self.early.pop(id(x), None)
        if hit is not None and hit[0]() is x:
            return hit[1]
        if x.numel() and x.untyped_storage().nbytes() == 0:
            raise OffloadError(f"a shed gradient shard {list(x.shape)} {x.dtype} has no early copy to take "
                               f"(HostTier.start_early): its values are gone; report this as a bug")
        if not self.cuda:
            return Transfer(self.host(x))
        if x.device.type == "cpu":  # already on the host: nothing to copy
            return Transfer(x)
        side = _side_stream(x.device)
        side.wait_stream(torch.cuda.current_stream(x.device))
        out = torch.empty(x.shape, dtype=x.dtype, pin_memory=self.pin)
        with torch.cuda.stream(side):
            out.copy_(x.detach(), non_blocking=True)
            event = torch.cuda.Event()
            event.record(side)
        x.record_stream(side)
        return Transfer(out, event)

    def host_cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`x` (host) in `dtype`, in host memory (pinned on CUDA): a new buffer written by one cast
        (read 4, write 2 bytes per element for fp32 -> bf16), or `x` itself where it has `dtype`
        already. With params offloaded the state keeps this compute-dtype copy of the master
        shard beside it, made once per step after the update (`HostUpdate.outputs`), so a unit's
        `enter` moves 2 bytes per element to the device and casts nothing on the host (DeepSpeed
        keeps a 16-bit copy of its offloaded params the same way)."""
        if x.dtype == dtype:
            return x
        if self.cuda:
            return torch.empty(x.shape, dtype=dtype, pin_memory=self.pin).copy_(x)
        return x.to(dtype)

    def start_early(self, x: torch.Tensor, norm: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Start `start_host(x)` now, for a later `start_host(x)` of the same tensor (the update's)
        to take: the backward hands each offloaded bucket's reduced shard here as soon as it
        exists (`unit.Inflight`'s `host`, `early_copies`), so the copy overlaps the rest of the
        backward. The copy is of the tensor's values now: whoever calls this promises that nothing
        writes `x` before the update reads it (a tensor the update does not read, e.g. one later
        rescaled out of place, is never taken: its entry goes with it).

        With `norm` (the step's `‖x‖₂`, `norms.shard_norm`), `x` is *shed*: its norm is taken now,
        on the device (`early_norm` returns it to the agreement), and then `x`'s device memory is
        freed (`shed`): the tensor object stays, for autograd to hand back, with no storage. Whoever
        passes `norm` promises that nothing reads `x` on the device after this but through
        `early_norm` and `readable`."""
        if self._early(x) is not None:
            return
        key = id(x)
        nu = norm(x) if norm is not None and sheddable(x) else None  # queued before the memory can be reused
        transfer = self.start_host(x)
        early = self.early
        self.early[key] = (weakref.ref(x, lambda _: early.pop(key, None)), transfer, nu)
        if nu is not None:
            shed(x)

    def _early(self, x: torch.Tensor) -> tuple[Any, Transfer, torch.Tensor | None] | None:
        hit = self.early.get(id(x))
        return hit if hit is not None and hit[0]() is x else None

    def early_norm(self, x: torch.Tensor) -> torch.Tensor | None:
        """The norm `start_early(x, norm)` took before shedding `x` (None: `x` was not shed)."""
        hit = self._early(x)
        return None if hit is None else hit[2]

    def readable(self, x: torch.Tensor) -> torch.Tensor:
        """`x`, or where it was shed, a device tensor of the values it had (its host copy, waited for
        and copied back): for the rare paths that read a gradient after the agreement (the
        exact norm, naming non-finite leaves)."""
        hit = self._early(x)
        if hit is None or hit[2] is None:
            return x
        return hit[1].wait().to(self.device, copy=True)

    def to_device(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`x` (host) cast to `dtype` on the host (a bf16 copy moves half the bytes), then on the
        device: a new buffer. On CUDA `non_blocking` from pinned memory, queued on the current
        stream before whatever reads it (a collective, the loss). The cast writes the pinned
        buffer itself (`host_cast`): casting to a fresh pageable tensor and pinning a copy of it
        made one more pass over the shard and faulted in a new pageable buffer every step."""
        if self.cuda:
            return self.pinned(self.host_cast(x, dtype)).to(self.device, non_blocking=True)
        return x.to(device=self.device, dtype=dtype, copy=True)

    # -- where a bucket's optimizer state lives between steps (the NVMe seam) --------------------

    def restore(self, b: int, opt_state: Any) -> Any:
        """What the state keeps of a fresh optimizer state (`init`, a checkpoint's load): the host
        tensors, pinned."""
        return optree.tree_map(self.pinned, opt_state)

    def prefetch(self, b: int) -> None:
        """Start bringing bucket `b`'s optimizer state in for its update: in host memory already."""

    def fetch(self, b: int, opt_state: Any) -> Any:
        """Bucket `b`'s optimizer state for the update: in host memory already."""
        return opt_state

    def store(self, b: int, opt_state: Any) -> Any:
        """What the state keeps of bucket `b`'s new optimizer state: the host tensors themselves."""
        return opt_state

    def snapshot(self, b: int, opt_state: Any) -> Any:
        """Bucket `b`'s optimizer state as tensors to read (a checkpoint's save): the state's own."""
        return opt_state

    # -- where a trainable bucket's master shard lives between steps (NVMe: a swap file too) -------

    def keep_master(self, b: int, master: torch.Tensor) -> torch.Tensor:
        """What the state keeps of bucket `b`'s fresh host master `shard[S]` (`init`, a checkpoint's
        load): the tensor itself (`host` pinned it already)."""
        return master

    def fetch_master(self, b: int, master: torch.Tensor) -> torch.Tensor:
        """Bucket `b`'s master `shard[S]` for the update (read with the optimizer state, after
        `prefetch(b)`): in host memory already, the state's own tensor."""
        return master

    def store_master(self, b: int, master: torch.Tensor) -> torch.Tensor:
        """What the state keeps of bucket `b`'s new master: the tensor itself."""
        return master

    def read_master(self, b: int, master: torch.Tensor) -> torch.Tensor:
        """Bucket `b`'s master values as a tensor to read outside a step (`fzero.gather`, a
        checkpoint's save, the rare path's non-finite report): the state's own tensor."""
        return master

    # -- where stage 3's compute-dtype shard lives between steps (params offloaded) ----------------

    def keep_params(self, b: int, shard: torch.Tensor) -> torch.Tensor:
        """What the state keeps of bucket `b`'s fresh compute-dtype host shard (params offloaded):
        the tensor itself."""
        return shard

    def store_params(self, b: int, shard: torch.Tensor) -> torch.Tensor:
        """What the state keeps of bucket `b`'s new compute-dtype host shard: the tensor itself."""
        return shard

    def flush(self) -> None:
        """Every store is durable (nothing to wait for in host memory)."""

    def abort(self, error: BaseException) -> None:
        """After an update that raised: nothing is held in host memory."""

    def check_holds(self, state: Any) -> None:
        """Whether `state` holds the values this tier keeps for it: in host memory they are the
        state's own tensors, so always."""

    def renewed(self) -> "HostTier":
        """A tier for a new state that shares no stored state with this one's: host memory is the
        state's own tensors, so this tier itself."""
        return self


@dataclasses.dataclass(frozen=True, eq=False)
class NvmeTier(HostTier):
    """The host tier whose buckets keep their fp32 master shard and their optimizer state's
    "shard" fields in swap files (`fzero._src.nvme.SwapFiles`, one file per bucket and tensor:
    `b<i>/master`, `b<i>/<field>`); only the replicated fields stay in (pinned) host memory. The
    state holds a stand-in for each file-backed tensor: an `expand`ed 0-d zero of its shape and
    dtype (no memory). Whoever reads the values outside a step goes through the tier:
    `snapshot` (the optimizer state) and `read_master` (`fzero.gather`, `fzero.checkpoint.save`,
    the non-finite report), each a fresh host copy.

    A step's update is double-buffered: `prefetch(b')` starts reading the next bucket's files
    while bucket b is updated in the read buffers (`fetch`, `fetch_master`: views, written in
    place by a donating update), `store` / `store_master` copy the new values into staging
    buffers, write them in the background and free the read buffers, and `flush` waits for every
    write at the end of the update (an error names the file). The pool holds two buckets' files
    (`_open`: `2 * (fields + 1)` read and as many staging buffers). The files are written in
    place: a step consumes its input state (`train_step(..., donate=True)` is required)."""

    files: Any = None
    fields: Any = None  # {bucket: ((field index, file name), ...)} of its file-backed fields
    directory: str = ""
    direct: bool = False
    masters: Any = None  # {bucket: file name} of the trainable host buckets' master shards
    shards: Any = None  # params="nvme": {bucket: file name} of their compute-dtype shards
    tags: Any = None  # params="nvme": {bucket tag: file name}, for `enter` (which knows the tag)
    # file name -> the stand-in of the state whose values the file holds (the last `init`, load or
    # step made it): `check_holds` refuses a state that holds another tensor there
    held: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)
    interrupted: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)
    in_place = True
    # each tier owns its own files: equal only to itself (HostTier's generated __eq__ compares
    # device and pin, which two NVMe tiers with different files share)
    __eq__ = object.__eq__
    __hash__ = object.__hash__

    @staticmethod
    def make(device: torch.device, offload: Offload, shapes: dict[int, Any],
             masters: dict[int, torch.Tensor] | None = None,
             shards: dict[int, tuple[str, torch.Tensor]] | None = None) -> "NvmeTier":
        """The tier for `{bucket: (optimizer state, its spec)}`, `{bucket: master shard}` and
        (params="nvme") `{bucket: (its tag, compute-dtype shard)}`: the "shard" fields, the
        masters and the shards get files, sized and typed as those tensors (the tensors
        themselves are not read: meta tensors do)."""
        fields, entries, names = {}, {}, {}
        params, tags = {}, {}
        for b, (tag, x) in (shards or {}).items():
            params[b] = tags[tag] = f"b{b}/params"
            entries[params[b]] = (x.numel(), x.dtype)
        for b, (opt, spec) in shapes.items():
            named = tuple((k, f"b{b}/{field}") for k, (field, kind) in enumerate(zip(opt._fields, spec))
                          if kind == "shard")
            fields[b] = named
            entries.update({name: (opt[k].numel(), opt[k].dtype) for k, name in named})
        for b, m in (masters or {}).items():
            names[b] = f"b{b}/master"
            entries[names[b]] = (m.numel(), m.dtype)
        return NvmeTier._open(device, offload.pin, offload.nvme_path, offload.direct, fields,
                              entries or {"none": (0, torch.float32)}, names, params, tags)

    def renewed(self) -> "NvmeTier":
        """The same files' layout in a fresh folder of the same directory (nothing written yet)."""
        entries = {name: (e.numel, e.dtype) for name, e in self.files.entries.items()}
        return NvmeTier._open(self.device, self.pin, self.directory, self.direct, self.fields, entries, self.masters,
                              self.shards, self.tags)

    @staticmethod
    def _open(device: torch.device, pin: bool, directory: str, direct: bool, fields: Any,
              entries: dict[str, tuple[int, torch.dtype]], masters: Any, shards: Any = None,
              tags: Any = None) -> "NvmeTier":
        """The tier of fresh swap files `entries` in `directory`, with read and staging buffers for
        two buckets' files (this bucket's fields and master, and the next's: `depth`)."""
        from .nvme import SwapFiles

        depth = 2 * max((len(fields.get(b, ())) + (b in masters) for b in {*fields, *masters}), default=1)
        files = SwapFiles(directory, entries, pin=device.type == "cuda" and pin, buffers=max(depth, 1), direct=direct)
        return NvmeTier(device, pin, files, fields, directory, direct, masters, shards or {}, tags or {})

    def host_cast(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`HostTier.host_cast`, but a new buffer where `x` is a read buffer's view
        (`SwapFiles.holds`): the master the update hands over is one, which the next bucket's
        prefetch refills once `store_master` released it, so neither the device copy `to_device`
        queues (non-blocking on CUDA) nor a host copy the units read (params offloaded) may read
        that buffer itself. Any other tensor (a unit's host shard, params="cpu") as there."""
        if x.dtype != dtype or not self.files.holds(x):
            return super().host_cast(x, dtype)
        if self.cuda:
            return torch.empty(x.shape, dtype=dtype, pin_memory=self.pin).copy_(x)
        return x.clone()

    def _write(self, name: str, x: torch.Tensor) -> None:
        """Write `x` to file `name`, which from here on holds no state's values until `_hold` names
        the state it holds now: a state that held them is refused by `check_holds`, so an
        interrupt between the write and its `_hold` (or between two fields' writes) cannot leave
        the input state passing with files that hold part of the next step (found in review: a
        retried step then trained on a mix of new `exp_avg` and old `exp_avg_sq`, silently)."""
        self.held.pop(name, None)
        self.files.write(name, x)

    def _hold(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """The stand-in of `x` for the state whose values file `name` now holds (`check_holds`)."""
        self.held[name] = out = stand_in(x)
        return out

    def _stand_in(self, b: int, opt_state: Any) -> Any:
        values = list(opt_state)
        for k, name in self.fields[b]:
            values[k] = self._hold(name, values[k])
        return type(opt_state)(*values)

    def check_holds(self, state: Any) -> None:
        """`OffloadError` unless each file-backed tensor of `state` is the stand-in the tier made
        for the values its file holds now (the last `fzero.init`, checkpoint load or step of this
        tier). The files are not the state's own tensors: a copy of the state (a pytree map that
        clones, `copy.deepcopy`) shares them with the original and holds zeros where they hold
        the values -- stepping it would update the files' newer values, and with
        params="nvme" its units would read those zeros as the params -- and an older state
        (stepped already) shares files that a later step rewrote."""
        layout = state.layout
        named = [(state.master, b, name, "master shard") for b, name in self.masters.items()]
        named += [(state.params, b, name, "compute-dtype shard") for b, name in self.shards.items()]
        for b, fields in self.fields.items():
            opt = state.opt_state[b]
            named += [(opt, k, name, f"optimizer field {opt._fields[k]!r}") for k, name in fields]
        for xs, i, name, what in named:
            if xs[i] is not self.held.get(name):
                b = int(name.split("/")[0][1:])
                paths = [leaf.path for leaf in layout.leaves if leaf.bucket == b]
                if self.interrupted:  # found in review: the message blamed a copy after a failed write
                    raise OffloadError(
                        f"this state's step raised while its NVMe tier was updating it ({self.interrupted['error']}), "
                        f"after it began rewriting its swap files (bucket {b}, {paths[:4]}"
                        f"{' ...' if len(paths) > 4 else ''}: {self.files.entries[name].path!r}), which may hold part "
                        f"of the next step's values: the state is lost. Restore it from a checkpoint: "
                        f"fzero.checkpoint.load(path, state) takes this state as its target")
                raise OffloadError(
                    f"this state's {what} of bucket {b} ({paths[:4]}{' ...' if len(paths) > 4 else ''}) is not the "
                    f"NVMe tier's stand-in for it: its swap file {self.files.entries[name].path!r} holds the values of "
                    f"another state (this one is a copy, e.g. a pytree map that clones it, or an older state). A "
                    f"state on optimizer='nvme' is its files, never copied with it: use the state the last step (or "
                    f"fzero.init, fzero.checkpoint.load) returned, and keep copies as checkpoints "
                    f"(fzero.checkpoint.save)")

    def restore(self, b: int, opt_state: Any) -> Any:
        for k, name in self.fields[b]:
            self._write(name, opt_state[k])
        self.files.flush()
        on_file = {k for k, _ in self.fields[b]}
        kept = type(opt_state)(*(x if k in on_file else self.pinned(x) for k, x in enumerate(opt_state)))
        return self._stand_in(b, kept)

    def prefetch(self, b: int) -> None:
        for _, name in self.fields.get(b, ()):
            self.files.prefetch(name)
        if b in self.masters:
            self.files.prefetch(self.masters[b])

    def fetch(self, b: int, opt_state: Any) -> Any:
        values = list(opt_state)
        for k, name in self.fields[b]:
            values[k] = self.files.read(name)
        return type(opt_state)(*values)

    def store(self, b: int, opt_state: Any) -> Any:
        for k, name in self.fields[b]:
            self._write(name, opt_state[k])  # copies first: the read buffer may be the tensor
            self.files.release(name)
        return self._stand_in(b, opt_state)

    def snapshot(self, b: int, opt_state: Any) -> Any:
        values = list(opt_state)
        for k, name in self.fields[b]:
            values[k] = self.files.read(name).clone()
            self.files.release(name)
        return type(opt_state)(*values)

    def keep_master(self, b: int, master: torch.Tensor) -> torch.Tensor:
        self._write(self.masters[b], master)
        self.files.flush()
        return self._hold(self.masters[b], master)

    def fetch_master(self, b: int, master: torch.Tensor) -> torch.Tensor:
        return self.files.read(self.masters[b]).view(master.shape)

    def store_master(self, b: int, master: torch.Tensor) -> torch.Tensor:
        self._write(self.masters[b], master)  # copies first: `master` is the read buffer
        self.files.release(self.masters[b])
        return self._hold(self.masters[b], master)

    def read_master(self, b: int, master: torch.Tensor) -> torch.Tensor:
        values = self.files.read(self.masters[b]).clone().view(master.shape)
        self.files.release(self.masters[b])
        return values

    def keep_params(self, b: int, shard: torch.Tensor) -> torch.Tensor:
        if b not in self.shards:
            return shard
        self._write(self.shards[b], shard)
        self.files.flush()
        return self._hold(self.shards[b], shard)

    def store_params(self, b: int, shard: torch.Tensor) -> torch.Tensor:
        if b not in self.shards:
            return shard
        self._write(self.shards[b], shard)  # copies into a staging buffer: `shard` may go
        return self._hold(self.shards[b], shard)

    def start_shard(self, tag: str) -> "Loading":
        """Start reading the compute-dtype shard of the bucket tagged `tag` (`SwapFiles.start_load`:
        a buffer of its own, so that any number of prefetched units may hold one)."""
        name = self.tags[tag]
        return Loading(self, name, self.files.start_load(name))

    def abort(self, error: BaseException) -> None:
        self.files.release_all()
        self.interrupted["error"] = f"{type(error).__name__}: {error}"  # `check_holds` says why

    def flush(self) -> None:  # (an update's last call: its files are whole again)
        self.files.flush()
        self.interrupted.clear()


class Loading:
    """A shard's read from its swap file in flight (`NvmeTier.start_shard`): `wait()` waits for
    it and returns the shard on the device (a copy: on CUDA non-blocking from the read's own
    pinned buffer, which the caching host allocator keeps until the copy is done)."""

    def __init__(self, tier: NvmeTier, name: str, future: Any) -> None:
        self.tier, self.name, self.future = tier, name, future

    def wait(self) -> torch.Tensor:
        host = self.tier.files.loaded(self.name, self.future)
        if self.tier.cuda:
            return host.to(self.tier.device, non_blocking=True)
        return host.to(device=self.tier.device, copy=True)


def tier_of(offload: Offload, device: torch.device, shapes: dict[int, Any] | None = None,
            masters: dict[int, torch.Tensor] | None = None,
            shards: dict[int, tuple[str, torch.Tensor]] | None = None) -> HostTier | None:
    """The tier an offloaded state's host buckets use (None without offload); NVMe needs the
    buckets' optimizer states, master shards and (params="nvme") compute-dtype shards
    (`NvmeTier.make`)."""
    if not offload.active:
        return None
    if offload.optimizer == "nvme" and shapes is not None:
        return NvmeTier.make(torch.device(device), offload, shapes, masters, shards)
    return HostTier(torch.device(device), offload.pin)


# -- the stage's pieces with the param shards off the device (stage 3, params="cpu" | "nvme") -----


def stage_of(stage: Stage, offload: Offload, tier: HostTier | None) -> Stage:
    """`stage`, or, with params offloaded, stage 3 whose `enter` first copies the host shard to the
    device (inside the flight `Gathering` prefetches), then all-gathers it: the stage's collectives,
    in its order, on the same bits.

    With params="nvme" a trainable bucket's shard is a stand-in (`is_stand_in`) and the tier's
    file of its tag holds the values: `start` begins that file's read (`NvmeTier.start_shard`),
    so the read runs while the units before it compute, and the flight's first phase waits for
    it, copies the shard to the device and starts the all-gather (the one phase of `ENTER_GATHER`'s
    flight, so that the mesh sees the all-gather's own `Pending`); the blocking `run`
    does the same at once. A real tensor (a frozen bucket's host shard, `fzero.gather`'s master
    values) is copied as with params="cpu". Frozen buckets stay in host memory: the units and
    `fzero.gather` cast a frozen shard to another dtype before `enter` where a policy says so
    (`gather_leaves`), and a cast of a stand-in would be zeros, not a stand-in."""
    if offload.params is None:
        return stage
    assert tier is not None and stage.enter is ENTER_GATHER

    def fetch(x: torch.Tensor) -> torch.Tensor:
        return tier.to_device(x, x.dtype)

    def on_file(wire: Wire, shard: torch.Tensor) -> bool:
        return is_stand_in(shard) and wire.tag in (getattr(tier, "tags", None) or {})

    def enter(mesh: Any, wire: Wire, shard: torch.Tensor) -> torch.Tensor:
        x = tier.start_shard(wire.tag).wait() if on_file(wire, shard) else fetch(shard)
        return ENTER_GATHER.run(mesh, wire, x)

    def start_enter(mesh: Any, wire: Wire, shard: torch.Tensor) -> Flight:
        if not on_file(wire, shard):
            return ENTER_GATHER.start(mesh, wire, fetch(shard))
        return Flight(tier.start_shard(wire.tag), (lambda x: ENTER_GATHER.start(mesh, wire, x).pending,))

    return dataclasses.replace(stage, enter=Piece(enter, ENTER_GATHER.moves, ENTER_GATHER.frozen_moves,
                                                  start=start_enter))


# -- what init (and a checkpoint's load) holds where --------------------------------------------


def place(stage: Stage, offload: Offload, tier: HostTier | None, layout: Any, b: int, held: torch.Tensor,
          master: torch.Tensor | None, rank: int, compute: torch.dtype, device: torch.device
          ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`(params, master)` of bucket `b` as an offloaded state holds them, from what `Stage.hold`
    keeps (`held` on the device, `master` or None): a trainable bucket's master `shard[S]` -- the
    kept master, else the shard the optimizer would update in place -- copied to the host. Stage
    3's device shard is then kept in the `compute` dtype (the unit casts to it before the gather
    anyway; the step differentiates a stand-in of the master, `differentiated`); with params
    offloaded the host shard is also `params` (one tensor), and a frozen bucket's shard moves to
    the host. The tier keeps the master (`HostTier.keep_master`: NVMe writes it to its file and
    the state holds a stand-in; `params` is then a host tensor of its own) and, params="nvme",
    the compute-dtype shard (`keep_params`: its file). Without offload, unchanged. What stays on the
    device goes to `device` (the mesh's; a no-op where it is there already)."""
    if tier is None:
        return held.to(device), (None if master is None else master.to(device))
    if layout.buckets[b].group.frozen:
        return (tier.host(held) if offload.params is not None else held.to(device)), None
    on_host = tier.host(master if master is not None else stage.optimizer_params(layout, b, held, rank, None))
    if offload.params is not None:  # what the units read: the compute-dtype copy, made here and by each update
        return tier.keep_params(b, tier.host_cast(on_host, compute)), tier.keep_master(b, on_host)
    return (held.to(device, compute) if stage.sharded("params") else held.to(device)), tier.keep_master(b, on_host)


def place_opt_state(tier: HostTier | None, b: int, opt_state: Any) -> Any:
    """A fresh optimizer state of bucket `b` (made on the host master by `init`, or read by a
    checkpoint's load) as the state keeps it: pinned where CUDA is; NVMe: written to its files."""
    if tier is None or opt_state is None:
        return opt_state
    return tier.restore(b, opt_state)


def differentiated(info: Any, b: int, held: torch.Tensor, master: torch.Tensor | None, device: torch.device
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`Stage.differentiated` of an offloaded state: the step takes gradients with respect to device
    tensors of the master's dtype, so where the stage would differentiate the host master -- stage
    2's master shard, stage 3's shard (held on the device in the compute dtype, or on the host with
    params offloaded) -- it differentiates a stand-in of the master's shape and dtype on the device
    (`_twin`), and the unit reads the held tensor beside it (with params offloaded its `enter`
    copies it to the device). The gradient is then computed, reduced and kept on the device in the
    same dtype as without offload."""
    stage, layout, rank = info.stage, info.layout, info.rank
    if info.offload.params is not None:  # the gradient is the master's (frozen buckets: their own dtype)
        return _twin(master if master is not None else held, device), held
    if master is None or info.host_tier(b) is None:
        return stage.differentiated(layout, b, held, rank, master)
    if stage.sharded("params"):  # stage 3: the device shard is in the compute dtype; the gradient is the master's
        return _twin(master, device), held
    return stage.differentiated(layout, b, held, rank, _twin(master, device))


def _twin(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A zero-cost device tensor of `x`'s shape and dtype (an `expand` of a 0-d zero), for the step
    to differentiate; no unit reads its values (each reads the full tensor beside it)."""
    return torch.zeros((), dtype=x.dtype, device=device).expand(x.shape)


def early_copies(info: Any, micro_batches: int, norm: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 accum_dtype: torch.dtype | None = None) -> Any:
    """The `host` of a step's `unit.Inflight` (None: no early copies): `copy(shard, bucket)` starts
    the device -> host copy of an offloaded bucket's reduced gradient shard as soon as the unit's
    backward has it (`HostTier.start_early`), so that `HostUpdate` finds the copy done instead of
    starting it at the update.

    Only where the copy is the tensor the update reads: one micro-batch (with k > 1 the update
    reads the sum over micro-batches, which exists only after the last backward: the update
    copies it then). A rescale after the agreement (clipping that clips, a loss scale,
    `normalize="tokens"`) leaves an offloaded bucket's shard as it is: the host multiplies its
    copy (`HostUpdate`'s `factor`), so the early copy is still the one the update takes; a shard
    the update does not read (another dtype after accumulation) is never taken, and its early
    copy is dropped with it (`HostTier.start_early`). `bucket`: the
    bucket's index, so that buckets `ratio` keeps on the device are not copied; where the caller
    does not know it (None), the shard is copied only if every trainable bucket is offloaded.

    Shedding (`norm`, the step's shard norm, and `accum_dtype`): where nothing reads the shard on
    the device after its copy but the agreement's norm -- its dtype is the accumulation's and the
    bucket's (`step.accumulate`'s casts are then no-ops) and its bucket index is known -- the norm
    is taken at the copy and the shard's device memory freed (`HostTier.start_early`). The
    device then holds one bucket's reduced gradient at a time instead of the whole shard
    (4 bytes per trainable element for fp32 gradients): what ZeRO-Offload keeps on the GPU."""
    tier = info.tier
    if tier is None or micro_batches != 1:
        return None
    layout = info.layout
    trainable = [b for b, spec in enumerate(layout.buckets) if not spec.group.frozen]
    host = frozenset(b for b in trainable if info.host_tier(b) is not None)
    every = len(host) == len(trainable)

    def copy(shard: torch.Tensor, bucket: int | None) -> None:
        if bucket in host or bucket is None and every:
            dtype = None if bucket is None else layout.buckets[bucket].dtype
            sheds = dtype is not None and shard.dtype == dtype == added_in(accum_dtype, dtype)
            tier.start_early(shard, norm if sheds else None)

    return copy


def sheddable(x: torch.Tensor) -> bool:
    """Whether freeing `x`'s storage frees exactly `x` (a contiguous tensor that is its storage's
    only content: no other view can lose its values)."""
    return (x.layout == torch.strided and x.is_contiguous() and x.storage_offset() == 0
            and x.untyped_storage().nbytes() == x.numel() * x.element_size())


def shed(x: torch.Tensor) -> None:
    """Free `x`'s device memory now, keeping the tensor object (its sizes and dtype) with a storage
    of 0 bytes, as FSDP frees its unsharded params: nothing may read its values after this
    (fzero reads them only through `HostTier.early_norm` and `readable`). A copy still reading it
    on another stream is safe: `start_host` told the caching allocator that the side stream uses
    it (`record_stream`), so the memory is reused only after that copy."""
    x.untyped_storage().resize_(0)


def early_norms(info: Any, shards: list[torch.Tensor]) -> dict[int, torch.Tensor]:
    """`{k: ‖shards[k]‖₂}` for the shards shed in the backward (`early_copies`): the agreement's
    norms of them, taken before their memory went."""
    tier = info.tier
    if tier is None or not tier.early:
        return {}
    known = {k: tier.early_norm(x) for k, x in enumerate(shards)}
    return {k: nu for k, nu in known.items() if nu is not None}


def readable(info: Any, tensors: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """`tensors` with every shed one replaced by a device copy of its values (`HostTier.readable`):
    for the rare paths that read reduced gradients after the agreement."""
    tier = info.tier
    if tier is None or not tier.early:
        return tensors
    return {b: tier.readable(x) for b, x in tensors.items()}


def host_leaf_sum(leaf_sum: Any, device: torch.device) -> Any:
    """A layer-wise optimizer's per-leaf sums over ranks, taken on the mesh's device from host
    partial sums (the collective needs device tensors; the values are float64 copies)."""
    return lambda x: leaf_sum(x.to(device)).to(x.device)


class Stored(NamedTuple):
    """What `HostUpdate.outputs` returns of one bucket's update.

    Attributes:
      back: the new master as the stage's `finish` reads it (on the device in the dtype the state
        holds there, or, with params offloaded, the host copy the units read).
      opt_state: what the state keeps of the new optimizer state (NVMe: stand-ins).
      master: what the state keeps of the new master (NVMe: a stand-in).
      checked: what the update's finite check reads (`update._nonfinite_flag`): the new master, or,
        where it went back to its file, its finite witness taken before (`_ends`).
    """

    back: torch.Tensor
    opt_state: Any
    master: torch.Tensor
    checked: torch.Tensor


def _ends(x: torch.Tensor, within: torch.dtype | None = None) -> torch.Tensor:
    """`x`'s `unit.finite_witness` as a new tensor (the minimum and maximum -- always with
    `within`, so that they can be cast to it -- or on the CPU the sum where it is finite), finite
    exactly where `x` is -- so the finite check, which reads the witness of what it is given,
    decides as it would on `x`; `x`'s copy where it is empty."""
    flat = x.detach().reshape(-1)
    return torch.stack(finite_witness(flat, within is not None)) if flat.numel() else flat.clone()


class HostUpdate:
    """One update's traffic between the device and the host tier, around the optimizer call of
    each offloaded bucket (`update.update`); buckets on the device pass through unchanged.

    At construction every offloaded bucket's reduced gradient shard starts for the host (CUDA: a
    side stream, one event each) and the first bucket's optimizer state starts coming in (NVMe).
    `inputs(b, ...)` waits for bucket b's gradient, starts the next bucket's state, and returns the
    host gradient, the host state and master and the per-leaf sum that runs on the device;
    `outputs(b, ...)` stores the new state and master and returns them with the new master shard
    as the stage's `finish` reads it (on the device in the dtype the state holds there, or, with
    params offloaded, the host copy, which is the params: `Stored`); `done()` waits for the
    tier's writes (NVMe).

    `factor` (default 1): the step's rescale of the reduced gradient (clipping, a loss scale,
    `normalize="tokens"`) where the step leaves it to the host for the offloaded buckets, whose
    `reduced` tensors are then the unscaled ones -- so the copy started in the backward is of the
    tensor read here. `inputs` returns `g_host * factor`: the same one rounding of the same
    float32 product the device's `g * factor` makes (CPU and CUDA both multiply in the tensor's
    opmath type, float32 for float32 and 16-bit gradients, by the Python float rounded to it)."""

    def __init__(self, info: Any, reduced: dict[int, torch.Tensor], factor: float = 1.0) -> None:
        self.info, self.device, self.factor = info, info.mesh.device, factor
        self.tiers = {b: t for b in reduced if (t := info.host_tier(b)) is not None}
        self.grads = {b: t.start_host(reduced[b]) for b, t in self.tiers.items()}
        order = list(self.tiers)
        self.following = dict(zip(order, order[1:]))
        if order:
            self.tiers[order[0]].prefetch(order[0])

    def inputs(self, b: int, grad: torch.Tensor, opt_state: Any, master: torch.Tensor | None, leaf_sum: Any
               ) -> tuple[torch.Tensor, Any, torch.Tensor | None, Any]:
        """`(gradient, optimizer state, master, leaf_sum)` of bucket b for its update: on a host
        tier the host copies (NVMe: the read buffers of its files, `fetch` / `fetch_master`);
        else the inputs themselves."""
        tier = self.tiers.get(b)
        if tier is None:
            return grad, opt_state, master, leaf_sum
        if b in self.following:  # NVMe: the next bucket's state is read while this one updates
            tier.prefetch(self.following[b])
        g = wait_held(self.grads, b)  # taken out of `grads` once its wait returns
        if self.factor != 1.0:
            g = g * self.factor
        return g, tier.fetch(b, opt_state), tier.fetch_master(b, master), host_leaf_sum(leaf_sum, self.device)

    def outputs(self, b: int, master: torch.Tensor, opt_state: Any, held_dtype: torch.dtype) -> "Stored":
        """`Stored` of bucket b's update (`master`: the new master shard, `opt_state` the new
        state). The copy the stage's `finish` reads is made first -- from the read buffer, which
        `store_master` then frees (`NvmeTier.host_cast` makes it a buffer of its own) -- and so
        are the ends the finite check reads of a master going back to its file."""
        tier = self.tiers.get(b)
        if tier is None:
            return Stored(master, opt_state, master, master)
        params = self.info.offload.params is not None  # the host copy the units read, cast once per step here
        if params:  # params="nvme": written to its file, the state keeps a stand-in
            back = tier.store_params(b, tier.host_cast(master, held_dtype))
        else:
            back = tier.to_device(master, held_dtype)
        within = self.info.precision.within(self.info.layout.buckets[b])
        checked = _ends(master, within) if tier.in_place else master
        return Stored(back, tier.store(b, opt_state), tier.store_master(b, master), checked)

    def done(self) -> None:
        for tier in {id(t): t for t in self.tiers.values()}.values():
            tier.flush()  # NVMe: every file written, or OffloadError naming it

    def abort(self, error: BaseException) -> None:
        """After an update that raised (`error`: an I/O error, an interrupt): the tiers give back
        what they hold (NVMe: every read buffer, so a retry reads the files, not a buffer changed
        in place) and remember why, for the message of a state whose files were rewritten."""
        for tier in {id(t): t for t in self.tiers.values()}.values():
            tier.abort(error)
