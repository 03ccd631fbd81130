"""Swap files (fzero/_src/nvme.py): round trips, ordering, bounded buffers, preflight, I/O errors,
and a killed writer."""

from __future__ import annotations

import errno
import gc
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fzero._src import nvme
from fzero._src.errors import FzeroError, OffloadError
from fzero._src.nvme import SwapFiles
from fzero.testing.strategies import examples

DTYPES = (torch.float32, torch.bfloat16, torch.float64)


def random_bits(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """`[numel]` tensor of `dtype` with uniformly random bits (NaNs, infs and subnormals included)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaN payloads included), which `torch.equal` on floats is not."""
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@examples(15)
@given(
    specs=st.lists(st.tuples(st.integers(0, 300), st.sampled_from(DTYPES)), min_size=1, max_size=5),
    buffers=st.integers(1, 3),
    prefetch=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_round_trip(specs, buffers, prefetch, seed):
    """Every entry reads back bit for bit what was last written (two rounds of writes: the second
    overwrites the first), with and without a prefetch, for any number of buffers."""
    entries = {f"e{i}": spec for i, spec in enumerate(specs)}
    with tempfile.TemporaryDirectory() as root, SwapFiles(root, entries, buffers=buffers) as files:
        for round_ in range(2):
            want = {name: random_bits(n, d, seed + 7 * i + round_) for i, (name, (n, d)) in enumerate(entries.items())}
            sources = {name: x.clone() for name, x in want.items()}
            for name, x in sources.items():
                files.write(name, x)
                x.zero_()  # the write copied: changing the source afterwards changes nothing
            files.flush()
            for name, x in want.items():
                if prefetch:
                    files.prefetch(name)
                got = files.read(name)
                assert got.shape == (entries[name][0],) and same_bits(got, x), name
                files.release(name)


def test_files_are_sized_and_removed(tmp_path):
    entries = {"master": (10, torch.float32), "m": (3, torch.bfloat16), "empty": (0, torch.float64)}
    files = SwapFiles(tmp_path, entries)
    assert os.path.dirname(files.path) == str(tmp_path)
    assert sorted(os.path.getsize(e.path) for e in files.entries.values()) == [0, 6, 40]
    assert files.host_bytes == nvme.buffer_bytes([40, 6, 0]) == 2 * nvme.BUFFERS * 40  # read + staging buffers
    files.close()
    files.close()  # idempotent
    assert os.listdir(tmp_path) == []
    with pytest.raises(OffloadError, match="closed"):
        files.read("master")


def test_garbage_collected_files_are_removed(tmp_path):
    files = SwapFiles(tmp_path, {"a": (4, torch.float32)})
    files.write("a", torch.ones(4))
    files.flush()
    del files
    gc.collect()
    assert os.listdir(tmp_path) == []


def slowed(fn, delay: float, calls: list[int]):
    """`fn` that sleeps `delay` seconds on its first call (counted in `calls`) before running."""

    def wrapper(*args):
        calls.append(1)
        if len(calls) == 1:
            time.sleep(delay)
        return fn(*args)

    return wrapper


def test_read_waits_for_the_entry_write(tmp_path, monkeypatch):
    """A read started while a write of its entry is in flight returns the new bytes: the write
    sleeps before touching the file, so a read that did not wait would return the old ones."""
    old, new = torch.zeros(1000), torch.arange(1000.0)
    with SwapFiles(tmp_path, {"a": (1000, torch.float32)}) as files:
        files.write("a", old)
        files.flush()
        monkeypatch.setattr(nvme, "_pwrite_all", slowed(nvme._pwrite_all, 0.3, []))
        files.write("a", new)
        files.prefetch("a")
        assert torch.equal(files.read("a"), new)


def test_write_waits_for_the_entry_read(tmp_path, monkeypatch):
    """A write issued while a prefetch of its entry is in flight does not change what that
    prefetch returns: the read sleeps before reading, so a write that did not wait would land first."""
    old, new = torch.zeros(1000), torch.arange(1000.0)
    with SwapFiles(tmp_path, {"a": (1000, torch.float32)}) as files:
        files.write("a", old)
        files.flush()
        monkeypatch.setattr(nvme, "_pread_all", slowed(nvme._pread_all, 0.3, []))
        files.prefetch("a")
        files.write("a", new)
        assert torch.equal(files.read("a"), old)
        files.release("a")
        files.flush()
        assert torch.equal(files.read("a"), new)


def test_loads_bypass_the_pool_and_order_with_writes(tmp_path, monkeypatch):
    """`start_load`: five loads of an entry in flight at once through a pool of one read buffer
    (each into a buffer of its own, the caller's to keep: changing one changes no other); a load
    started while a write is in flight returns the new bytes, a write issued while a load is in
    flight does not change what that load returns (each sleeps first, so an unordered one would
    see the other's bytes); an entry never written is refused."""
    old, new = torch.zeros(1000), torch.arange(1000.0)
    with SwapFiles(tmp_path, {"a": (1000, torch.float32), "b": (3, torch.bfloat16)}, buffers=1) as files:
        with pytest.raises(OffloadError, match="'b' was never written"):
            files.start_load("b")
        files.write("a", old)
        files.flush()
        loads = [files.start_load("a") for _ in range(5)]
        got = [files.loaded("a", f) for f in loads]
        got[0].add_(1)
        assert all(torch.equal(g, old) for g in got[1:]) and torch.equal(got[0], old + 1)
        assert files._read_free and len(files._read_free) == 1  # the pool was never touched
        monkeypatch.setattr(nvme, "_pwrite_all", slowed(nvme._pwrite_all, 0.3, []))
        files.write("a", new)
        assert torch.equal(files.loaded("a", files.start_load("a")), new)
        monkeypatch.setattr(nvme, "_pread_all", slowed(nvme._pread_all, 0.3, []))
        pending = files.start_load("a")
        files.write("a", old)
        assert torch.equal(files.loaded("a", pending), new)
        files.flush()
        assert torch.equal(files.loaded("a", files.start_load("a")), old)


def test_holds_names_the_read_buffers_views(tmp_path):
    """`holds(x)`: true for what `read` returns (a view of a pooled read buffer, refilled after its
    release), false for a copy of it and for a `start_load`'s own buffer."""
    with SwapFiles(tmp_path, {"a": (8, torch.float32)}) as files:
        files.write("a", torch.arange(8.0))
        x = files.read("a")
        assert files.holds(x) and files.holds(x[2:]) and not files.holds(x.clone())
        files.release("a")
        assert not files.holds(files.loaded("a", files.start_load("a"))) and not files.holds(torch.ones(8))


def test_writes_of_one_entry_land_in_order(tmp_path, monkeypatch):
    """Two writes of one entry in a row: the second wins even when the first is slow (two writer
    threads would otherwise let the second finish first)."""
    first, second = torch.zeros(1000), torch.arange(1000.0)
    with SwapFiles(tmp_path, {"a": (1000, torch.float32)}, threads=2) as files:
        monkeypatch.setattr(nvme, "_pwrite_all", slowed(nvme._pwrite_all, 0.3, []))
        files.write("a", first)
        files.write("a", second)
        files.flush()
        assert torch.equal(files.read("a"), second)
        files.release("a")
        time.sleep(0.4)  # past the first write's delay: an unchained first write has landed by now
        assert torch.equal(files.read("a"), second)


def test_more_entries_than_buffers(tmp_path):
    """Eight entries through two read buffers, the next one prefetched while the caller updates
    this one in place and writes it back; the held buffers are bounded and named when exhausted."""
    names = [f"bucket{i}" for i in range(8)]
    entries = {name: (50 + i, torch.float64) for i, name in enumerate(names)}
    with SwapFiles(tmp_path, entries, buffers=2) as files:
        for i, name in enumerate(names):
            files.write(name, torch.full((50 + i,), float(i), dtype=torch.float64))
        files.flush()
        for step in range(2):
            files.prefetch(names[0])
            for i, name in enumerate(names):
                x = files.read(name)
                assert torch.equal(x, torch.full_like(x, float(i + step))), (step, name)
                if i + 1 < len(names):
                    files.prefetch(names[i + 1])
                    with pytest.raises(OffloadError, match=r"all 2 read buffers are held by \['bucket"):
                        files.prefetch(names[(i + 2) % len(names)])
                x.add_(1.0)
                files.write(name, x)
                files.release(name)
            files.flush()
        assert len(files._read_free) == 2


def test_unwritten_entry_is_not_valid(tmp_path):
    with SwapFiles(tmp_path, {"a": (4, torch.float32), "b": (4, torch.float32)}) as files:
        files.write("a", torch.ones(4))
        with pytest.raises(OffloadError, match="'b' was never written"):
            files.read("b")
        assert torch.equal(files.read("a"), torch.ones(4))


def test_bad_entries_and_writes(tmp_path):
    for entries in ({}, {"a": (-1, torch.float32)}, {"a": (2.0, torch.float32)}, {"a": (2, "fp32")}, {1: (2, torch.float32)}):
        with pytest.raises(OffloadError, match="SwapFiles"):
            SwapFiles(tmp_path, entries)
    with SwapFiles(tmp_path, {"a": (4, torch.float32)}) as files:
        with pytest.raises(OffloadError, match=r"expected 4 elements of torch.float32, got \(4,\) torch.float64"):
            files.write("a", torch.ones(4, dtype=torch.float64))
        with pytest.raises(OffloadError, match=r"got \(5,\) torch.float32"):
            files.write("a", torch.ones(5))
        with pytest.raises(OffloadError, match=r"no entry 'z'; its entries are \['a'\]"):
            files.prefetch("z")
        with pytest.raises(OffloadError, match="holds no read buffer"):
            files.release("a")
        files.write("a", torch.ones(2, 2))  # any shape of the entry's numel
        assert torch.equal(files.read("a"), torch.ones(4))
    assert os.listdir(tmp_path) == []


def test_unwritable_path_fails_at_construction(tmp_path):
    entries = {"a": (10, torch.float32)}
    (tmp_path / "file").write_text("x")
    cases = [(tmp_path / "missing", "does not exist"), (tmp_path / "file", "is not a directory")]
    if os.geteuid() != 0:  # root ignores the mode bits
        (tmp_path / "ro").mkdir(mode=0o500)
        cases.append((tmp_path / "ro", "is not writable"))
    for path, what in cases:
        with pytest.raises(OffloadError, match=what) as info:
            SwapFiles(path, entries)
        assert str(path) in str(info.value) and "nvme_path" in str(info.value)
        assert "the swap files need 40 bytes" in str(info.value)
    # /proc is writable by its mode and refuses a mkdir even for root (an empty entry: it has 0 bytes free)
    with pytest.raises(OffloadError, match="cannot create a folder in '/proc'.*nvme_path"):
        SwapFiles("/proc", {"a": (0, torch.float32)})
        assert isinstance(info.value, FzeroError)


def test_too_small_disk_fails_at_construction(tmp_path, monkeypatch):
    """Free space one byte short of the entries' 10·4 + 6·2 = 52 bytes: an error naming both
    numbers; exactly enough: no error. Nothing is left behind by the failure."""
    entries = {"a": (10, torch.float32), "b": (6, torch.bfloat16)}
    real = shutil.disk_usage

    def usage(free: int):
        return lambda path: real(path)._replace(free=free)

    monkeypatch.setattr(shutil, "disk_usage", usage(51))
    with pytest.raises(OffloadError, match=r"has 51 bytes free, the swap files need 52 bytes \(1 more\)"):
        SwapFiles(tmp_path, entries)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(shutil, "disk_usage", usage(52))
    SwapFiles(tmp_path, entries).close()


def test_reserve_enospc_fails_at_construction(tmp_path, monkeypatch):
    """The disk fills between the free-space check and the reservation: the same clear error."""

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OffloadError, match=r"cannot reserve 40 bytes .*ENOSPC \(disk full\)"):
        SwapFiles(tmp_path, {"a": (10, torch.float32)})
    assert os.listdir(tmp_path) == []


def test_write_error_surfaces_at_flush(tmp_path, monkeypatch):
    """An injected ENOSPC in the writer thread: `write` returns, `flush` raises naming the entry
    and the errno, a read of that entry refuses, and a later good write makes it valid again."""
    with SwapFiles(tmp_path, {"a": (8, torch.float32), "b": (8, torch.float32)}) as files:
        files.write("b", torch.ones(8))
        files.flush()
        real = os.pwrite

        def failing(fd, data, offset):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "pwrite", failing)
        files.write("a", torch.ones(8))
        files.write("a", torch.ones(8))  # the staging buffers came back after the failures
        files.write("a", torch.ones(8))
        with pytest.raises(OffloadError, match=r"1 swap-file write\(s\) failed: 'a' .*ENOSPC \(disk full\)"):
            files.flush()
        with pytest.raises(OffloadError, match="'a': its last write failed"):
            files.read("a")
        assert torch.equal(files.read("b"), torch.ones(8))
        monkeypatch.setattr(os, "pwrite", real)
        files.write("a", torch.full((8,), 2.0))
        files.flush()
        assert torch.equal(files.read("a"), torch.full((8,), 2.0))


def test_read_error_is_an_offload_error(tmp_path):
    with SwapFiles(tmp_path, {"a": (8, torch.float32)}) as files:
        files.write("a", torch.ones(8))
        files.flush()
        os.truncate(files.entries["a"].path, 4)  # someone else cut the file short
        with pytest.raises(OffloadError, match=r"read\('a'\) .*EIO.*end of file at byte 4"):
            files.read("a")


KILLED_WRITER = textwrap.dedent(
    """
    import sys, torch
    from fzero._src.nvme import SwapFiles
    files = SwapFiles(sys.argv[1], {"a": (1 << 22, torch.float32)}, threads=1)
    x = torch.arange(float(1 << 22))
    files.write("a", x)
    files.flush()
    print(files.path, flush=True)
    while True:  # rewrite forever, until killed mid-write
        files.write("a", x)
    """
)


def test_killed_writer_leaves_nothing_valid(tmp_path):
    """SIGKILL a process while it rewrites a 16 MiB entry: its folder stays behind (no cleanup
    ran), and a fresh SwapFiles in the same directory makes a new folder and reads nothing of the
    old one: the same entry name is "never written"."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True)
    try:
        old_path = proc.stdout.readline().strip()
        time.sleep(0.2)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    assert os.path.isdir(old_path) and os.listdir(old_path) == ["entry-0.bin"]
    with SwapFiles(tmp_path, {"a": (1 << 22, torch.float32)}) as files:
        assert files.path != old_path and os.path.dirname(files.path) == str(tmp_path)
        with pytest.raises(OffloadError, match="'a' was never written"):
            files.read("a")
        files.write("a", torch.ones(1 << 22))
        assert torch.equal(files.read("a"), torch.ones(1 << 22))
    assert os.listdir(tmp_path) == [os.path.basename(old_path)]  # close removed only its own folder


def test_pin_needs_cuda(tmp_path):
    if torch.cuda.is_available():
        with SwapFiles(tmp_path, {"a": (4, torch.float32)}, pin=True) as files:
            assert files._read_free[0].is_pinned()
    else:
        with pytest.raises(OffloadError, match="CUDA is not available; pass pin=False"):
            SwapFiles(tmp_path, {"a": (4, torch.float32)}, pin=True)


def test_prefetch_overlaps_the_caller(tmp_path, monkeypatch):
    """The prefetch runs in another thread: while the caller is blocked on an event that only
    the read thread sets, the read completes (a synchronous prefetch would deadlock; bounded by
    the 5 s wait)."""
    started = threading.Event()
    real = nvme._pread_all

    def signalling(*args):
        started.set()
        return real(*args)

    with SwapFiles(tmp_path, {"a": (4, torch.float32)}) as files:
        files.write("a", torch.ones(4))
        files.flush()
        monkeypatch.setattr(nvme, "_pread_all", signalling)
        files.prefetch("a")
        assert started.wait(5.0)
        assert torch.equal(files.read("a"), torch.ones(4))


def test_direct_io_round_trip(tmp_path):
    """O_DIRECT: the files are opened with it, each is padded to ALIGN bytes, the buffers start on
    an ALIGN boundary, and odd-sized fp32 / bf16 / fp64 entries read back bit for bit. Where the
    filesystem refuses O_DIRECT, the refusal is the clear error instead, and the round trip is
    skipped, said so in the run's summary (it returned, a pass that checked nothing of O_DIRECT on
    a machine whose temporary directory is a tmpfs)."""
    entries = {"a": (1001, torch.float32), "b": (3, torch.bfloat16), "c": (4096, torch.float64)}
    try:
        files = SwapFiles(tmp_path, entries, direct=True)
    except OffloadError as e:
        assert "refuses O_DIRECT" in str(e) and "direct=False" in str(e)
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT (its refusal checked); no round trip here")
    with files:
        import fcntl

        assert all(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT for fd in files._fds.values())
        assert [os.path.getsize(e.path) for e in files.entries.values()] == [4096, 4096, 8 * 4096]
        assert all(b.data_ptr() % nvme.ALIGN == 0 for b in files._read_free)
        assert files.host_bytes == nvme.buffer_bytes([8 * 4096])
        for step in range(2):
            want = {n: random_bits(k, d, 10 * step + i) for i, (n, (k, d)) in enumerate(entries.items())}
            for name, x in want.items():
                files.write(name, x)
            files.flush()
            for name, x in want.items():
                assert same_bits(files.read(name), x), (step, name)
                files.release(name)
