"""Checkpoints in a canonical per-leaf form: `save` on N ranks at stage s, `load` on M at stage t.

What is written does not depend on the world size or the stage. For every leaf of the layout
(`layout.leaves`, flatten order) a checkpoint holds

  params     the leaf's master values, unpadded, in the leaf's dtype: `leaf[numel]`
  opt/<f>    for each optimizer state field `f` whose spec is "shard": the leaf's elements of it
             (`leaf[numel]`); for a "leaf" field: the leaf's one entry (`[1]`)

cut into pieces `(kind, field, leaf index, leaf_start, values[k])`. Rank r of N writes the pieces
of its shard `[r * S, (r + 1) * S)` of each bucket (`layout.segments(b, r)`), whatever the stage
holds there: the stage-3 shard, the stage 1-2 master shard, or its slice of a replicated
`flat[N * S]`; "leaf" fields, replicated, are written by rank 0 only. So every element of every
leaf is written exactly once, and reading is a copy of bits into the new layout's buffers:
resharding is exact (proofs/checkpoint.md).

On disk, `root/step-<n>/`:

  rank-<r>.pt     per rank: `{"pieces": [...], "rng": torch.get_rng_state()}` (rank 0 also holds
                  `"scalars"`: the step counter and the loss scaler's state, as tensors)
  manifest.json   written last: layout, stage, world size, optimizer, precision, scaler, step,
                  and the sha256 and size of every rank file

Crash safety: ranks write into `root/.tmp-step-<n>-<token>`, then agree (an all-reduce of a
flag, the barrier), then rank 0 writes the manifest and renames the folder to `step-<n>` with
one atomic `os.rename`. A folder named `step-<n>` with a valid manifest is therefore complete;
`latest` only ever returns such a folder.

Why not torch.distributed.checkpoint: fzero's meshes include `SimMesh` (ranks as threads, no
process group), and DCP's resharding needs DTensor/ShardedTensor metadata that flat shards do
not carry; DCP's single-process mode warns on every call. The canonical pieces carry their own
coordinates, so plain `torch.save` files per rank (read back with `weights_only=True`, `mmap`)
reshard by themselves, and the same code runs on SimMesh and DistMesh (a shared file system).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import re
import shutil
from collections.abc import Iterable
from typing import Any

import torch

from .collectives import all_reduce, broadcast
from .errors import FzeroError
from .layout import Layout
from .optim.base import spec_of
from .scale import LossScaleState
from .state import ZeroState, check_state, describe

FORMAT = 1
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")
CRASH_POINTS = ("before_data", "mid_data", "before_manifest", "before_rename")


class CheckpointError(FzeroError, ValueError):
    """A checkpoint is missing, incomplete, corrupted, or does not fit the target state."""


class _Crash(RuntimeError):
    """Raised by `save(_fail_at=...)` to simulate a crash at a named point (tests only)."""


Piece = tuple[str, str, int, int, torch.Tensor]  # (kind, field, leaf index, leaf_start, values[k])


# -- what a rank writes ----------------------------------------------------------------------------


def _owned(layout: Layout, b: int, x: torch.Tensor, rank: int, sharded: bool) -> list[tuple[int, int, torch.Tensor]]:
    """`(leaf, leaf_start, values)` of the leaf elements in rank `rank`'s shard of bucket `b`, read
    from `x`: this rank's `shard[S]` (`sharded`) or the whole `flat[N * S]`. Fresh tensors (a
    view would make `torch.save` write the whole storage)."""
    shard = x if sharded else layout.rank_shard(b, x, rank)
    return [(seg.leaf, seg.leaf_start, shard[seg.start : seg.stop].detach().clone())
            for seg in layout.segments(b, rank)]


def pieces(state: ZeroState) -> list[Piece]:
    """The canonical pieces rank `state.rank` writes: its part of every leaf's master values and
    of every "shard" optimizer field; rank 0 also every "leaf" optimizer field."""
    layout, stage, rank = state.layout, state.stage, state.rank
    out: list[Piece] = []
    for b, spec in enumerate(layout.buckets):
        master = state.master[b]
        x, sharded = (master, True) if master is not None else (state.params[b], stage.sharded("params"))
        out += [("params", "", leaf, start, v) for leaf, start, v in _owned(layout, b, x, rank, sharded)]
        opt = state.opt_state[b]
        if opt is None:
            continue
        for field, kind, t in zip(opt._fields, spec_of(state.optimizer, opt), opt):
            if kind == "shard":
                out += [("opt", field, leaf, start, v)
                        for leaf, start, v in _owned(layout, b, t, rank, stage.sharded("optimizer_state"))]
            elif rank == 0:
                out += [("opt", field, leaf, 0, t[k : k + 1].clone()) for k, leaf in enumerate(spec.leaves)]
    return out


def _rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _scalars(state: ZeroState) -> dict[str, Any]:
    scale = None if state.loss_scale is None else tuple(t.clone() for t in state.loss_scale)
    return {"step": state.step.clone(), "loss_scale": scale}


def _jsonable(x: Any) -> Any:
    return json.loads(json.dumps(x))


def describe_layout(layout: Layout) -> list[dict[str, Any]]:
    """Per leaf: path, shape, dtype, unit, group, frozen (what `load` checks: path, shape, dtype, frozen)."""
    return [{"path": ls.path, "shape": list(ls.shape), "dtype": str(ls.dtype).removeprefix("torch."),
             "unit": ls.unit, "group": ls.group.name, "frozen": ls.group.frozen} for ls in layout.leaves]


def manifest_of(state: ZeroState, files: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The manifest of `state`'s checkpoint with the given `{file: {"sha256", "bytes"}}`."""
    p = state.precision
    return {
        "format": FORMAT,
        "step": int(state.step),
        "stage": state.stage.level,
        "world_size": state.mesh.world_size,
        "leaves": describe_layout(state.layout),
        "optimizer": _jsonable(describe(state.optimizer)),
        "precision": [str(p.param_dtype), str(p.reduce_dtype)],
        "scaler": None if state.info.scaler is None else repr(state.info.scaler),
        "files": files,
    }


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write(path: str, data: bytes, fail_mid: bool = False) -> None:
    """Write `data` to `path` and fsync it (`fail_mid`: write half of it, then crash)."""
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2] if fail_mid else data)
        f.flush()
        os.fsync(f.fileno())
    if fail_mid:
        raise _Crash(f"simulated crash while writing {path}")


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier(state: ZeroState, tag: str) -> None:
    """Every rank reached this point (a collective: SimMesh has no process group)."""
    mesh = state.mesh
    all_reduce(torch.ones((), dtype=torch.int64, device=mesh.device), mesh, "sum", tag=tag)


def _token(state: ZeroState) -> int:
    """A random folder token every rank agrees on, from rank 0 (not from torch's RNG, which the
    checkpoint saves)."""
    mesh = state.mesh
    mine = torch.tensor(int.from_bytes(os.urandom(6), "little"), dtype=torch.int64, device=mesh.device)
    return int(broadcast(mine, mesh, 0, tag="fzero.checkpoint/token")) if mesh.world_size > 1 else int(mine)


def save(state: ZeroState, root: str | os.PathLike, *, keep: int | None = None, _fail_at: str | None = None) -> str:
    """Write `state` (every rank calls it) to `root/step-<n>`, n = `int(state.step)`; its path.

    Each rank writes its canonical pieces and its RNG state (`torch.get_rng_state()`, this
    rank's own on SimMesh), all ranks agree, and rank 0 writes the manifest with every file's
    sha256 and renames the folder into place (see the module docstring). With `keep=K`, rank 0
    then deletes the oldest complete checkpoints beyond the newest K.

    Raises `CheckpointError` if `root/step-<n>` exists already (on every rank, before writing).
    """
    check_state(state)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise CheckpointError(f"keep must be None or an int >= 1 (how many checkpoints to keep), got {keep!r}")
    if _fail_at is not None and _fail_at not in CRASH_POINTS:
        raise CheckpointError(f"_fail_at must be one of {CRASH_POINTS}, got {_fail_at!r}")
    mesh, rank, n = state.mesh, state.rank, int(state.step)
    root = os.fspath(root)
    final = os.path.join(root, f"step-{n}")
    with mesh.guard():
        if os.path.exists(final):
            raise CheckpointError(f"checkpoint {final!r} exists already (step {n}); save each step once, or "
                                  f"delete it first")
        tmp = os.path.join(root, f".tmp-step-{n}-{_token(state):012x}")
        if rank == 0:
            os.makedirs(tmp)
        _barrier(state, "fzero.checkpoint/mkdir")
        if _fail_at == "before_data":
            raise _Crash("simulated crash before any data was written")
        data: dict[str, Any] = {"pieces": pieces(state), "rng": torch.get_rng_state()}
        if rank == 0:
            data["scalars"] = _scalars(state)
        buf = io.BytesIO()
        torch.save(data, buf)
        _write(os.path.join(tmp, _rank_file(rank)), buf.getvalue(), fail_mid=_fail_at == "mid_data")
        _barrier(state, "fzero.checkpoint/data")
        if rank == 0:
            if _fail_at == "before_manifest":
                raise _Crash("simulated crash before the manifest was written")
            names = [_rank_file(r) for r in range(mesh.world_size)]
            files = {f: {"sha256": _sha256(os.path.join(tmp, f)), "bytes": os.path.getsize(os.path.join(tmp, f))}
                     for f in names}
            _write(os.path.join(tmp, MANIFEST), json.dumps(manifest_of(state, files), indent=1).encode())
            _fsync_dir(tmp)
            if _fail_at == "before_rename":
                raise _Crash("simulated crash before the rename")
            os.rename(tmp, final)
            _fsync_dir(root)
            if keep is not None:
                for old in complete(root)[:-keep]:
                    shutil.rmtree(old)
        _barrier(state, "fzero.checkpoint/published")
    return final


# -- finding and checking checkpoints ------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint at `path`, or a `CheckpointError` naming what is wrong."""
    path = os.fspath(path)
    name = os.path.join(path, MANIFEST)
    try:
        with open(name) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{name!r} does not exist: {path!r} is not a complete fzero checkpoint (a save "
                              f"that crashed leaves a .tmp-step-* folder; use fzero.checkpoint.latest(root))") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{name!r} is not a readable manifest: {e}") from None
    keys = ("format", "step", "stage", "world_size", "leaves", "optimizer", "files")
    if not isinstance(manifest, dict) or any(k not in manifest for k in keys) or manifest["format"] != FORMAT:
        raise CheckpointError(f"{name!r} is not a format-{FORMAT} fzero manifest (needs the keys {keys})")
    return manifest


def _files_present(path: str, manifest: dict[str, Any]) -> bool:
    return all(os.path.getsize(os.path.join(path, f)) == meta["bytes"] if os.path.isfile(os.path.join(path, f))
               else False for f, meta in manifest["files"].items())


def complete(root: str | os.PathLike) -> list[str]:
    """The complete checkpoints under `root` (a valid manifest, every file of its size), oldest first."""
    root = os.fspath(root)
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
            found.append((int(m.group(1)), path))
    return [p for _, p in sorted(found)]


def latest(root: str | os.PathLike) -> str | None:
    """The newest complete checkpoint under `root`, or None."""
    done = complete(root)
    return done[-1] if done else None


def check_fits(path: str, manifest: dict[str, Any], target: ZeroState) -> None:
    """The checkpoint's leaves (path, shape, dtype, frozen) and optimizer are the target's; every
    file is there with its checksum. A `CheckpointError` naming the first mismatch otherwise."""
    mine, theirs = describe_layout(target.layout), manifest["leaves"]
    keys = ("path", "shape", "dtype", "frozen")
    for i, (a, b) in enumerate(zip(theirs, mine)):
        diff = [k for k in keys if a.get(k) != b[k]]
        if diff:
            shown = ", ".join(f"{k}: checkpoint {a.get(k)!r}, target {b[k]!r}" for k in diff)
            raise CheckpointError(f"{path!r} was saved from another layout: leaf {i} ({b['path']!r}) differs in "
                                  f"{shown}; load into a state made by fzero.init from the same params pytree")
    if len(theirs) != len(mine):
        raise CheckpointError(f"{path!r} holds {len(theirs)} leaves, the target's layout {len(mine)}; load into a "
                              f"state made by fzero.init from the same params pytree")
    want = _jsonable(describe(target.optimizer))
    if manifest["optimizer"] != want:
        raise CheckpointError(f"{path!r} was saved with another optimizer:\n  checkpoint: "
                              f"{str(manifest['optimizer'])[:300]}\n  target:     {str(want)[:300]}\nmake the target "
                              f"with the optimizer the checkpoint was saved with")
    if (manifest.get("scaler") is None) != (target.info.scaler is None):
        raise CheckpointError(f"{path!r} has loss scaler {manifest.get('scaler')!r}, the target "
                              f"{target.info.scaler!r}; make the target with loss_scale set as when it was saved")
    check_files(path, manifest)


def check_files(path: str, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists is there, of its size and sha256; else `CheckpointError`."""
    for f, meta in manifest["files"].items():
        name = os.path.join(path, f)
        if not os.path.isfile(name):
            raise CheckpointError(f"{name!r} is missing from the checkpoint (the manifest lists it)")
        size, digest = os.path.getsize(name), _sha256(name)
        if size != meta["bytes"] or digest != meta["sha256"]:
            raise CheckpointError(f"{name!r} is corrupted: {size} bytes with sha256 {digest[:16]}..., the manifest "
                                  f"recorded {meta['bytes']} bytes with sha256 {meta['sha256'][:16]}...; load an "
                                  f"older checkpoint (fzero.checkpoint.complete(root))")


# -- loading ---------------------------------------------------------------------------------------


def _read(path: str, manifest: dict[str, Any]) -> tuple[dict[tuple[str, str], list], dict[str, Any], list]:
    """`({(kind, field): [(leaf, start, values)]}, scalars, rng per saved rank)` from every rank file."""
    table: dict[tuple[str, str], list] = {}
    scalars: dict[str, Any] = {}
    rng = []
    for f in sorted(manifest["files"]):
        data = torch.load(os.path.join(path, f), weights_only=True, mmap=True)
        for kind, field, leaf, start, values in data["pieces"]:
            table.setdefault((kind, field), []).append((leaf, start, values))
        scalars.update(data.get("scalars", {}))
        rng.append(data["rng"])
    return table, scalars, rng


def _assemble(path: str, layout: Layout, b: int, parts: Iterable, like: torch.Tensor, what: str,
              window: tuple[int, int] | None = None) -> torch.Tensor:
    """Elements `[lo, hi)` (`window`; default all of them) of bucket `b`'s `flat[N * S]` of `what`,
    from canonical pieces, zero padding, in `like`'s dtype and device: `buffer[hi - lo]`. Every
    leaf element inside the window must be covered exactly once."""
    spec = layout.buckets[b]
    lo, hi = window if window is not None else (0, spec.padded_numel)
    out = torch.zeros(hi - lo, dtype=like.dtype, device=like.device)
    mine = set(spec.leaves)
    filled = {i: 0 for i in spec.leaves}
    for leaf, start, values in parts:
        if leaf not in mine:
            continue
        ls = layout.leaves[leaf]
        if values.dtype != like.dtype:
            raise CheckpointError(f"{path!r}: {what} of leaf {ls.path!r} is {values.dtype}, the target holds "
                                  f"{like.dtype}")
        a, z = ls.offset + start, ls.offset + start + values.numel()  # the piece in flat coordinates
        a2, z2 = max(a, lo), min(z, hi)
        if a2 < z2:
            out[a2 - lo : z2 - lo] = values[a2 - a : z2 - a]
            filled[leaf] += z2 - a2
    for i, count in filled.items():
        ls = layout.leaves[i]
        want = max(0, min(ls.offset + ls.numel, hi) - max(ls.offset, lo))
        if count != want:
            raise CheckpointError(f"{path!r}: {what} of leaf {ls.path!r} has {count} of the {want} elements this "
                                  f"rank needs in the checkpoint; it is incomplete")
    return out


def _window(layout: Layout, b: int, rank: int, sharded: bool) -> tuple[int, int] | None:
    """The flat elements a rank holds of bucket `b`: its shard where `sharded`, else all (None)."""
    s = layout.buckets[b].shard_numel
    return (rank * s, (rank + 1) * s) if sharded else None


def _leaf_field(path: str, layout: Layout, b: int, parts: list, like: torch.Tensor, what: str) -> torch.Tensor:
    """A "leaf" field `[L]` of bucket `b` from its per-leaf entries."""
    got = {leaf: values for leaf, _, values in parts}
    missing = [layout.leaves[i].path for i in layout.buckets[b].leaves if i not in got]
    if missing:
        raise CheckpointError(f"{path!r}: {what} has no entry for leaves {missing[:5]}")
    return torch.cat([got[i] for i in layout.buckets[b].leaves]).to(device=like.device)


def _opt_state(path: str, target: ZeroState, b: int, table: dict) -> Any:
    opt = target.opt_state[b]
    if opt is None:
        return None
    layout, stage, rank = target.layout, target.stage, target.rank
    fields = []
    for field, kind, like in zip(opt._fields, spec_of(target.optimizer, opt), opt):
        parts = table.get(("opt", field), [])
        if kind == "leaf":
            fields.append(_leaf_field(path, layout, b, parts, like, f"optimizer field {field!r}"))
            continue
        window = _window(layout, b, rank, stage.sharded("optimizer_state"))
        fields.append(_assemble(path, layout, b, parts, like, f"optimizer field {field!r}", window))
    return type(opt)(*fields)


def load(path: str | os.PathLike, target: ZeroState, *, restore_rng: bool = True) -> ZeroState:
    """A new state for `target`'s mesh, rank, stage and settings (any world size M, any stage)
    holding the values saved at `path`; `target` (made by `fzero.init`) is not changed.

    Every rank calls it; no collective runs. Before anything is built, the manifest is checked
    against `target` (leaves, optimizer, scaler) and every file against its sha256
    (`CheckpointError` naming the file and the mismatch). Each bucket's master values are
    assembled into `flat[M * S']` and held as `fzero.init` holds them (`Stage.hold`: the shard,
    the master shard beside the compute copy `flat.to(compute)`, or the whole buffer); each
    optimizer field per its spec; the step counter and loss scale as saved. Where the stage
    keeps a shard (stage 3's params, sharded optimizer fields) only that shard's elements are
    assembled. With `restore_rng`
    and M == N, this rank's torch RNG state is set to the one saved by the same rank.
    """
    check_state(target)
    path = os.fspath(path)
    with target.mesh.guard():
        manifest = read_manifest(path)
        check_fits(path, manifest, target)
        table, scalars, rng = _read(path, manifest)
        layout, stage, rank = target.layout, target.stage, target.rank
        params, master, opt_state = [], [], []
        for b, spec in enumerate(layout.buckets):
            like = target.master[b] if target.master[b] is not None else target.params[b]
            like = torch.empty(0, dtype=spec.dtype, device=like.device)
            parts = table.get(("params", ""), [])
            if stage.sharded("params"):  # hold keeps this rank's shard: assemble only that
                held, m = _assemble(path, layout, b, parts, like, "params", _window(layout, b, rank, True)), None
            else:
                flat = _assemble(path, layout, b, parts, like, "params")
                held, m = stage.hold(layout, b, flat, rank, target.precision.wire(spec).compute)
            params.append(held)
            master.append(m)
            opt_state.append(_opt_state(path, target, b, table))
        scale = scalars.get("loss_scale")
        if restore_rng and manifest["world_size"] == target.mesh.world_size:
            torch.set_rng_state(rng[rank])
    return ZeroState(tuple(params), tuple(opt_state), scalars["step"].clone(), tuple(master),
                     None if scale is None else LossScaleState(*(t.clone() for t in scale)), target.info)


# -- export, offline ----------------------------------------------------------------------------

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
_SAFETENSORS = {torch.float32: "F32", torch.float64: "F64", torch.bfloat16: "BF16", torch.float16: "F16"}


def export(path: str | os.PathLike, *, dtype: torch.dtype | None = None,
           aliases: dict[str, tuple[str, ...]] | None = None) -> dict[str, torch.Tensor]:
    """The full params saved at `path`, `{leaf path: tensor}` (master values, in their dtype or
    `dtype`), read from the files alone: no process group, no mesh, any world size it was saved
    at. With `aliases` (`ModuleInfo.aliases` of `fzero.from_module`), every name of a tied weight
    gets the same tensor, so the dict is a `state_dict` the original module's `load_state_dict`
    takes (buffers are not part of a checkpoint: `strict=False`, or add them). Files are checked
    against their sha256 first."""
    path = os.fspath(path)
    manifest = read_manifest(path)
    check_files(path, manifest)
    table, _, _ = _read(path, manifest)
    leaves = manifest["leaves"]
    out: dict[str, torch.Tensor] = {}
    covered = [0] * len(leaves)
    flats = [torch.zeros(math.prod(ls["shape"]), dtype=_DTYPES[ls["dtype"]]) for ls in leaves]
    for leaf, start, values in table.get(("params", ""), []):
        flats[leaf][start : start + values.numel()] = values
        covered[leaf] += values.numel()
    for i, ls in enumerate(leaves):
        if covered[i] != flats[i].numel():
            raise CheckpointError(f"{path!r}: leaf {ls['path']!r} has {covered[i]} of {flats[i].numel()} elements in "
                                  f"the checkpoint's files; it is incomplete")
        t = flats[i].view(ls["shape"])
        out[ls["path"]] = t if dtype is None else t.to(dtype)
    if aliases:
        for name, names in aliases.items():
            for alias in names:
                out[alias] = out[name]
    return out


def save_safetensors(tensors: dict[str, torch.Tensor], out: str | os.PathLike, metadata: dict[str, str] | None = None
                     ) -> None:
    """Write `tensors` as a safetensors file (an 8-byte little-endian header length, a JSON header
    of dtype, shape and byte offsets per name, padded to 8 bytes, then the raw little-endian data).
    A tensor reached under two names is written once (safetensors has no aliasing)."""
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
    tmp = os.fspath(out) + ".tmp"
    with open(tmp, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for blob in blobs:
            f.write(blob)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out)


def summary(path: str | os.PathLike) -> str:
    """What `fzero inspect` prints: step, world size, stage, optimizer, precision, scaler, and each
    leaf's path, shape, dtype and bytes."""
    m = read_manifest(path)
    opt = m["optimizer"][1][0] if isinstance(m["optimizer"], list) and len(m["optimizer"]) > 1 else m["optimizer"]
    lines = [f"{os.fspath(path)}: step {m['step']}, saved by {m['world_size']} rank(s) at stage {m['stage']}",
             f"optimizer: {str(opt)[:120]}", f"precision: {m.get('precision')}, loss scaler: {m.get('scaler')}"]
    total = 0
    for ls in m["leaves"]:
        nbytes = math.prod(ls["shape"]) * _DTYPES[ls["dtype"]].itemsize
        total += nbytes
        lines.append(f"  {ls['path']:40s} {ls['dtype']:9s} {str(ls['shape']):20s} {nbytes:>12,} B"
                     + (" (frozen)" if ls["frozen"] else ""))
    files = sum(meta["bytes"] for meta in m["files"].values())
    lines.append(f"{len(m['leaves'])} leaves, {total:,} B of params; {len(m['files'])} files, {files:,} B on disk")
    return "\n".join(lines)
