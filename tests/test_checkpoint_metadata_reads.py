"""Review of the manifest seal (`checkpoint.seal`, `check_record`): what it costs a reader.

`check_record` reads the saved step and seal (~3 KB of rank 0's file) with a `dcp.load` of its
own. DCP's `load` reads and unpickles `.metadata` itself, so before the fix each `load` (on
every rank), `export` and `summary` read the whole `.metadata` once more than before the seal
(three times per call for load and export, twice for summary; ~190 B per saved chunk: 456 KB and
0.15 s per rank for 600 AdamW leaves at N = 4). Now DCP is handed the copy already read and
checked against the manifest's sha256 (`_dcp_load`, `_knowing`): `.metadata` is read once per
call, and of the data files only the chunks planned are read.
"""

import collections
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import fzero
import fzero.checkpoint as ck
from fzero._src import checkpoint as impl
from fzero._src.mesh import _SIM_THREAD


def params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}": {"w": torch.randn(4, 3, generator=g), "b": torch.randn(3, generator=g)} for i in range(6)}


def make(mesh, stage: int):
    return fzero.init(params(), fzero.optim.adamw(1e-2, weight_decay=0.1), stage=stage, mesh=mesh)


class Counting(FileSystemReader):
    """A DCP reader that records, per rank, each read of `.metadata` and each data item read."""

    log: list = []

    def read_metadata(self, *args, **kwargs):
        Counting.log.append((self._rank(), ".metadata"))
        return super().read_metadata(*args, **kwargs)

    def read_data(self, plan, planner):
        Counting.log += [(self._rank(), item.storage_index.fqn) for item in plan.items]
        return super().read_data(plan, planner)

    @staticmethod
    def _rank() -> int:
        return getattr(_SIM_THREAD, "rank", int(os.environ.get("RANK", 0)))


def metadata_reads(log: list) -> collections.Counter:
    return collections.Counter(rank for rank, what in log if what == ".metadata")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> str:
    """A step-0 save on SimMesh(2), stage 3: sealed."""
    mesh, root = fzero.SimMesh(2), str(tmp_path_factory.mktemp("seal"))
    return mesh.run(lambda: ck.save(make(mesh, 3), root))[0]


def test_metadata_is_read_once_per_call_and_the_seal_costs_two_items(saved, monkeypatch):
    """`load` (each rank of SimMesh(2), another stage), `export` and `summary` read `.metadata`
    once each (three, three and two times before the fix); `summary` reads no data item but the
    step counter and the seal, and `load` no item outside its read plan but those two."""
    monkeypatch.setattr(impl, "_reader", Counting)
    monkeypatch.setattr(Counting, "log", [])
    assert impl.DIGEST in FileSystemReader(saved).read_metadata().state_dict_metadata
    mesh = fzero.SimMesh(2)
    steps = mesh.run(lambda: int(ck.load(saved, make(mesh, 1)).step))
    assert steps == [0, 0] and metadata_reads(Counting.log) == {0: 1, 1: 1}, Counting.log
    for r in range(2):  # every rank reads the step and seal once more, for check_record, nothing else extra
        items = collections.Counter(what for rank, what in Counting.log if rank == r and what != ".metadata")
        assert items["step"] == 2 and items[impl.DIGEST] == 1, items

    for fn in (ck.export, ck.summary):
        Counting.log = []
        fn(saved)
        assert metadata_reads(Counting.log) == {0: 1}, (fn.__name__, Counting.log)
    assert sorted(what for _, what in Counting.log if what != ".metadata") == sorted(["step", impl.DIGEST])


def dist_load_counting(mesh, path):
    """On a gloo rank: load `path` at stage 1 counting this rank's reads; (step, `.metadata`
    reads, data items read)."""
    before = impl._reader
    impl._reader, Counting.log = Counting, []
    try:
        step = int(ck.load(path, make(mesh, 1)).step)
    finally:
        impl._reader = before
    return step, metadata_reads(Counting.log)[mesh.rank], [w for _, w in Counting.log if w != ".metadata"]


@pytest.mark.dist
def test_metadata_is_read_once_per_rank_on_gloo(dist2, saved):
    """The same on a gloo DistMesh: each rank reads `.metadata` once per load (three times before
    the fix: its checked copy, check_record's dcp.load, the state's dcp.load)."""
    for step, reads, items in dist2.run(dist_load_counting, [(saved,)] * 2):
        assert step == 0 and reads == 1 and items.count(impl.DIGEST) == 1, (reads, items)
