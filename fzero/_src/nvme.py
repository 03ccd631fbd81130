"""Swap files: named flat tensors kept on a disk (NVMe) and moved through a few host buffers.

`SwapFiles(directory, {name: (numel, dtype)})` makes a fresh subdirectory of `directory`
(`fzero-swap-XXXXXX`) holding one file per entry, `entry-<i>.bin` of `numel * itemsize` bytes,
reserved at construction. The life of one entry in a step (the offload tier's per-bucket loop):

    files.prefetch(name)           # start reading it into a free read buffer (a thread)
    x = files.read(name)           # wait for that read: x[numel] of the entry's dtype (a view
                                   # of the buffer, valid until release)
    files.write(name, new)         # copy `new` into a staging buffer, write it in the background
    files.release(name)            # the read buffer is free again
    ...
    files.flush()                  # every write is on disk, or OffloadError

Double buffering is the bounded pool: `buffers` read buffers and `buffers` staging buffers, each
of the largest entry's bytes, so the host holds `2 * buffers * max_bytes` bytes however many
entries there are, and the reads of the next entry overlap the caller's work on this one.

Ordering, per entry: a read waits for the entry's last write (it returns what was last
written), and a write waits for a read of the entry still in flight (it never changes bytes a
read is copying). Entries are independent of each other.

What is valid: an entry's bytes are trusted only after this object wrote them in this process
(`read` of an entry never written, or whose last write failed, raises). Files are scratch: a
fresh `SwapFiles` always makes a new subdirectory and never opens an old one, so a killed run
leaves files that nothing reads back (delete stale `fzero-swap-*` folders by hand).

Preflight at construction (`OffloadError` naming the path, the bytes and the way out): the
directory exists, is a directory and is writable, and `shutil.disk_usage` shows free space for
every entry; the files are then reserved with `posix_fallocate`, so a disk that fills later
fails here, not in the middle of training. Reads and writes are `os.preadv` / `os.pwrite` on the
tensors' raw bytes (`tensor.view(torch.uint8)`, so bfloat16 works), in small thread pools (the
calls release the GIL). By default they go through the page cache; `direct=True` opens the files
with O_DIRECT (the disk itself, as DeepSpeed's libaio swapper does): each file and buffer is then
padded to `ALIGN` bytes and the buffers start on an `ALIGN` boundary, and a filesystem that
refuses O_DIRECT is an `OffloadError` at construction.
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import queue
import shutil
import tempfile
import weakref
from collections.abc import Iterable, Mapping
from typing import NamedTuple, TypeVar

import torch

from .errors import OffloadError

T = TypeVar("T")

__all__ = ["SwapFiles", "Entry", "BUFFERS", "buffer_bytes"]

BUFFERS = 2  # read buffers, and staging buffers: double buffering
ALIGN = 4096  # O_DIRECT: offsets, lengths and buffer addresses in multiples of the logical block


def buffer_bytes(entry_bytes: Iterable[T], buffers: int = BUFFERS) -> T | int:
    """Host bytes of a `SwapFiles`' buffers: `buffers` read and `buffers` staging buffers, each of
    the largest entry's bytes, `2 * buffers * max(entry_bytes)` (0 without entries)."""
    return 2 * buffers * max(entry_bytes, default=0)


class Entry(NamedTuple):
    """One swap file: `numel` elements of `dtype` at `path`, `stored` bytes on disk (`nbytes`,
    rounded up to `ALIGN` with O_DIRECT)."""

    numel: int
    dtype: torch.dtype
    path: str
    stored: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _check_entries(entries: Mapping[str, tuple[int, torch.dtype]]) -> None:
    if not isinstance(entries, Mapping) or not entries:
        raise OffloadError(f"SwapFiles needs a non-empty dict name -> (numel, dtype), got {entries!r}")
    for name, spec in entries.items():
        ok = isinstance(spec, tuple) and len(spec) == 2
        numel, dtype = spec if ok else (None, None)
        if not (isinstance(name, str) and isinstance(numel, int) and not isinstance(numel, bool) and numel >= 0
                and isinstance(dtype, torch.dtype)):
            raise OffloadError(
                f"SwapFiles entry {name!r}: expected a str name -> (numel: int >= 0, dtype: torch.dtype), got {spec!r}"
            )


def _preflight(directory: str, needed: int) -> None:
    """The directory exists and is writable, and its disk has `needed` bytes free."""
    way_out = "point nvme_path at a writable folder on a disk with enough free space, or offload to 'cpu'"
    if not os.path.isdir(directory):
        what = "does not exist" if not os.path.exists(directory) else "is not a directory"
        raise OffloadError(f"NVMe offload: {directory!r} {what} (the swap files need {needed} bytes); {way_out}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise OffloadError(f"NVMe offload: {directory!r} is not writable (the swap files need {needed} bytes); {way_out}")
    free = shutil.disk_usage(directory).free
    if free < needed:
        raise NoRoom(
            f"NVMe offload: {directory!r} has {free} bytes free, the swap files need {needed} bytes "
            f"({needed - free} more); {way_out}"
        )


class NoRoom(OffloadError):
    """The disk has no room for the swap files (too few bytes free, or ENOSPC while reserving
    them): the one cause a load's second set of files adds (`checkpoint._renewed`)."""


def _reserve(path: str, nbytes: int) -> None:
    """Create `path` with `nbytes` bytes allocated on disk (`posix_fallocate`; a plain size where
    the filesystem cannot allocate). ENOSPC here is an `OffloadError`."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        if nbytes:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise
                os.ftruncate(fd, nbytes)  # EOPNOTSUPP / EINVAL: the filesystem has no fallocate
    finally:
        os.close(fd)


def _cleanup(fds: dict[str, int], path: str) -> None:
    """Close the files and delete their folder (run once, by `close` or when the object dies)."""
    for fd in fds.values():
        os.close(fd)
    fds.clear()
    shutil.rmtree(path, ignore_errors=True)


def _describe(e: BaseException) -> str:
    if not isinstance(e, OSError):
        return f"{type(e).__name__}: {e}"
    name = errno.errorcode.get(e.errno or 0, "")
    disk_full = " (disk full)" if e.errno == errno.ENOSPC else ""
    return f"{name}{disk_full}: {e.strerror or e}"


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _buffer(nbytes: int, pin: bool, align: int) -> torch.Tensor:
    """`[nbytes]` uint8 host buffer whose first byte sits on an `align` boundary."""
    raw = torch.empty(nbytes + align - 1, dtype=torch.uint8, pin_memory=pin)
    start = -raw.data_ptr() % align
    return raw[start : start + nbytes]


def _bytes_of(buffer: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU uint8 tensor, writable, no copy."""
    return memoryview(buffer.numpy()).cast("B")


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of `data` at `offset` (`pwrite` may write less than asked: loop)."""
    while len(data):
        n = os.pwrite(fd, data, offset)
        data, offset = data[n:], offset + n


def _pread_all(fd: int, out: memoryview, offset: int, path: str) -> None:
    """Fill `out` from `offset`; a file shorter than that is EIO (someone cut it)."""
    while len(out):
        n = os.preadv(fd, [out], offset)
        if n == 0:
            raise OSError(errno.EIO, f"unexpected end of file at byte {offset}", path)
        out, offset = out[n:], offset + n


class SwapFiles:
    """Named flat tensors in files under a fresh subdirectory of `directory` (see the module doc).

    Args:
      directory: an existing writable folder (the NVMe mount).
      entries: `{name: (numel, dtype)}`; entry `name` is `numel` elements of `dtype`.
      pin: pin the host buffers (page-locked, for asynchronous device copies; needs CUDA).
      buffers: read buffers, and separately staging buffers, each of the largest entry's size
        (2 = double buffering: read the next entry while the caller works on this one).
      threads: I/O threads for reads, and separately for writes.
      direct: O_DIRECT reads and writes (no page cache; files and buffers padded to `ALIGN`).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        entries: Mapping[str, tuple[int, torch.dtype]],
        pin: bool = False,
        buffers: int = BUFFERS,
        threads: int = 2,
        direct: bool = False,
    ) -> None:
        _check_entries(entries)
        if not isinstance(buffers, int) or buffers < 1 or not isinstance(threads, int) or threads < 1:
            raise OffloadError(f"SwapFiles: buffers and threads must be ints >= 1, got {buffers!r}, {threads!r}")
        if pin and not torch.cuda.is_available():
            raise OffloadError("SwapFiles(pin=True) pins host buffers for CUDA copies, but CUDA is not available; "
                               "pass pin=False")
        directory = os.fspath(directory)
        align = ALIGN if direct else 1
        stored = {name: _round_up(n * d.itemsize, align) for name, (n, d) in entries.items()}
        _preflight(directory, sum(stored.values()))
        self._create_files(directory, entries, stored, direct)
        max_bytes = max(e.stored for e in self.entries.values())
        read, staging = ([_buffer(max_bytes, pin, align) for _ in range(buffers)] for _ in "rs")
        self.host_bytes = sum(b.numel() for b in read + staging)  # buffer_bytes(stored bytes, buffers)
        self._read_storages = frozenset(b.untyped_storage().data_ptr() for b in read)
        self._read_free = read
        self._staging: queue.SimpleQueue[torch.Tensor] = queue.SimpleQueue()
        for b in staging:
            self._staging.put(b)
        self._readers = cf.ThreadPoolExecutor(threads, thread_name_prefix="fzero-swap-read")
        self._writers = cf.ThreadPoolExecutor(threads, thread_name_prefix="fzero-swap-write")
        self._pin, self._align = pin, align
        self._loads: dict[str, list[cf.Future[torch.Tensor]]] = {}  # `start_load`s a write must wait for
        self._writes: dict[str, cf.Future[None]] = {}  # the last write of each entry
        self._reads: dict[str, tuple[torch.Tensor, cf.Future[None]]] = {}  # buffer and read, until release
        self._valid: set[str] = set()  # entries whose last write completed
        self._failed: set[str] = set()  # entries whose last write failed (reported by flush)
        self._closed = False

    # ---------------------------------------------------------------------------------- helpers

    def _create_files(self, directory: str, entries: Mapping[str, tuple[int, torch.dtype]],
                      stored: Mapping[str, int], direct: bool) -> None:
        """A fresh folder `self.path` under `directory`, one reserved file per entry, opened; any
        failure removes what was made and is an `OffloadError` naming the way out."""
        try:
            self.path = tempfile.mkdtemp(prefix="fzero-swap-", dir=directory)
        except OSError as e:
            raise OffloadError(f"NVMe offload: cannot create a folder in {directory!r}: {_describe(e)}; point "
                               "nvme_path at a writable folder") from e
        self.entries = {
            name: Entry(n, d, os.path.join(self.path, f"entry-{i}.bin"), stored[name])
            for i, (name, (n, d)) in enumerate(entries.items())
        }
        self._fds: dict[str, int] = {}
        self._remove = weakref.finalize(self, _cleanup, self._fds, self.path)
        try:
            for name, entry in self.entries.items():
                _reserve(entry.path, entry.stored)
                self._fds[name] = os.open(entry.path, os.O_RDWR | (os.O_DIRECT if direct else 0))
        except OSError as e:
            self._remove()
            if direct and e.errno == errno.EINVAL:
                raise OffloadError(f"NVMe offload: the filesystem of {directory!r} refuses O_DIRECT; put nvme_path on "
                                   f"a disk's filesystem (ext4, xfs), or pass direct=False (through the page cache)") from e
            raise (NoRoom if e.errno == errno.ENOSPC else OffloadError)(
                f"NVMe offload: cannot reserve {sum(stored.values())} bytes of swap files in {directory!r}: "
                f"{_describe(e)}; free space or point nvme_path at a larger disk"
            ) from e

    def _entry(self, name: str) -> Entry:
        if self._closed:
            raise OffloadError(f"SwapFiles at {self.path!r} is closed; entry {name!r} is gone")
        if name not in self.entries:
            raise OffloadError(f"SwapFiles has no entry {name!r}; its entries are {sorted(self.entries)}")
        return self.entries[name]

    def _write_task(self, name: str, staging: torch.Tensor, after: list[cf.Future[None]]) -> None:
        try:
            cf.wait(after)  # the entry's previous write, and a read still copying its old bytes
            _pwrite_all(self._fds[name], _bytes_of(staging)[: self.entries[name].stored], 0)
        finally:
            self._staging.put(staging)

    def _read_task(self, name: str, buffer: torch.Tensor, after: cf.Future[None] | None) -> None:
        if after is not None:
            after.result()  # the entry's last write; its error is the read's error
        entry = self.entries[name]
        _pread_all(self._fds[name], _bytes_of(buffer)[: entry.stored], 0, entry.path)

    def _load_task(self, name: str, after: cf.Future[None] | None) -> torch.Tensor:
        if after is not None:
            after.result()  # the entry's last write; its error is the load's error
        entry = self.entries[name]
        out = _buffer(entry.stored, self._pin, self._align)
        _pread_all(self._fds[name], _bytes_of(out), 0, entry.path)
        return out[: entry.nbytes].view(entry.dtype)

    def _check_written(self, name: str) -> None:
        if name in self._writes or name in self._valid:
            return
        if name in self._failed:
            raise OffloadError(f"SwapFiles entry {name!r}: its last write failed (flush reported it), so its file "
                               "holds nothing valid; write it again before reading it")
        raise OffloadError(f"SwapFiles entry {name!r} was never written, so its file holds nothing valid; "
                               "write(name, tensor) before reading it")

    # ----------------------------------------------------------------------------------- public

    def write(self, name: str, tensor: torch.Tensor) -> None:
        """Copy `tensor` (any shape of the entry's numel and dtype, any device) into a staging
        buffer, then write it to the entry's file in the background. Blocks only while every
        staging buffer is in flight. Errors surface at `flush` (or at a later read of `name`)."""
        entry = self._entry(name)
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != entry.numel or tensor.dtype != entry.dtype:
            got = f"{tuple(tensor.shape)} {tensor.dtype}" if isinstance(tensor, torch.Tensor) else repr(tensor)
            raise OffloadError(f"SwapFiles.write({name!r}): expected {entry.numel} elements of {entry.dtype}, got {got}")
        staging = self._staging.get()
        try:
            staging[: entry.nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))
        except BaseException:
            self._staging.put(staging)
            raise
        loads = [f for f in self._loads.pop(name, ()) if not f.done()]
        after = [f for f in (self._writes.get(name), self._reads.get(name, (None, None))[1]) if f is not None] + loads
        self._valid.discard(name)
        self._failed.discard(name)
        self._writes[name] = self._writers.submit(self._write_task, name, staging, after)

    def prefetch(self, name: str) -> None:
        """Start reading entry `name` into a free read buffer (no-op if it is already read or
        being read). Raises `OffloadError` if every read buffer is held: release one first."""
        self._entry(name)
        if name in self._reads:
            return
        self._check_written(name)
        if not self._read_free:
            raise OffloadError(
                f"SwapFiles.prefetch({name!r}): all {len(self._reads)} read buffers are held by "
                f"{sorted(self._reads)}; release one first, or make SwapFiles with more buffers"
            )
        buffer = self._read_free.pop()
        self._reads[name] = (buffer, self._readers.submit(self._read_task, name, buffer, self._writes.get(name)))

    def read(self, name: str) -> torch.Tensor:
        """`[numel]` host tensor of the entry's dtype holding what was last written: waits for
        the prefetch (starting one if there is none). A view of a read buffer: valid until
        `release(name)`, and the caller may change it in place."""
        entry = self._entry(name)
        self.prefetch(name)
        buffer, future = self._reads[name]
        try:
            future.result()
        except OSError as e:  # the failed read gives its buffer back: a retry reads the file again (found
            self.release(name)  # in review: the failed future was kept, and every later read raised it)
            raise OffloadError(f"SwapFiles.read({name!r}) from {entry.path!r}: {_describe(e)}") from e
        return buffer[: entry.nbytes].view(entry.dtype)

    def start_load(self, name: str) -> cf.Future[torch.Tensor]:
        """Start reading entry `name` into a new host buffer of its own (pinned with `pin`;
        aligned with O_DIRECT), outside the read-buffer pool: the future's result is `[numel]` of
        the entry's dtype holding what was last written, the caller's to keep. Never waits for a
        buffer, so any number may be in flight (each holds its entry's bytes until dropped); a
        later `write` of the entry waits for the loads in flight. For reads whose consumer may
        hold several at once in an order the pool cannot know (stage 3's prefetched units)."""
        self._entry(name)
        self._check_written(name)
        future = self._readers.submit(self._load_task, name, self._writes.get(name))
        self._loads[name] = [f for f in self._loads.get(name, ()) if not f.done()] + [future]
        return future

    def loaded(self, name: str, future: cf.Future[torch.Tensor]) -> torch.Tensor:
        """The result of `start_load(name)`: waits for it; an I/O error is an `OffloadError`."""
        try:
            return future.result()
        except OSError as e:
            path = self.entries[name].path
            raise OffloadError(f"SwapFiles.start_load({name!r}) from {path!r}: {_describe(e)}") from e

    def holds(self, x: torch.Tensor) -> bool:
        """Whether `x` is a view of one of the read buffers (what `read` returns: valid only until
        its `release`, after which a prefetch may refill it)."""
        return x.device.type == "cpu" and x.untyped_storage().data_ptr() in self._read_storages

    def release(self, name: str) -> None:
        """Give entry `name`'s read buffer back (waits for its read if it is still running)."""
        self._entry(name)
        if name not in self._reads:
            raise OffloadError(f"SwapFiles.release({name!r}): it holds no read buffer (prefetch or read it first)")
        buffer, future = self._reads.pop(name)
        cf.wait([future])
        self._read_free.append(buffer)

    def release_all(self) -> None:
        """Give every read buffer back, waiting for the reads in flight: after an update that
        raised, so that a retry reads the files again, not a buffer the update had changed in
        place before the error (found in review)."""
        for name in list(self._reads):
            self.release(name)

    def flush(self) -> None:
        """Wait for every write; `OffloadError` naming the entries whose write failed."""
        failed = []
        for name, future in self._writes.items():
            error = future.exception()
            if error is None:
                self._valid.add(name)
            else:
                self._failed.add(name)
                failed.append(f"{name!r} ({self.entries[name].path}): {_describe(error)}")
        self._writes = {}
        if failed:
            raise OffloadError(
                f"NVMe offload: {len(failed)} swap-file write(s) failed: {'; '.join(failed)}; free space on "
                f"{os.path.dirname(self.path)!r} or point nvme_path at a larger, writable disk"
            )

    def close(self) -> None:
        """Wait for the I/O in flight, then delete the files and their folder. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._readers.shutdown(wait=True)
        self._writers.shutdown(wait=True)
        self._remove()

    def __enter__(self) -> SwapFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        total = sum(e.nbytes for e in self.entries.values())
        return f"SwapFiles({self.path!r}, {len(self.entries)} entries, {total} bytes)"
