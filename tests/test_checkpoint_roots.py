"""A checkpoint's files are hashed once per load, and a root's order trusts only sealed manifests.

- `load` hashed, on every rank, every data file the rank's read plan touches; every rank reads the
  step counter from rank 0's file, so rank 0's whole file was hashed N times (at stages 0-2 of a
  DistMesh, and on a SimMesh, every file N times: 300 MB of a 300 MB checkpoint per rank at
  N = 2). Now each copy of a file (one file of one host: `_copy_key`) is hashed by one of the
  ranks reading it (`_hash_shares`), and the verdict reaches every rank through the load's
  agreement: a damaged file is still refused on every rank, and a copy of the checkpoint of a
  rank's own (another folder, another host's disk) is still hashed by that rank.
- A manifest's `written` edited to 2**63 - 1 made its checkpoint `latest(root)` for good, and
  gave every later save a `written` of 2**63, past a manifest's range, so none of them was
  complete. Now `latest` / `complete` (and the order `save` reads) skip the checkpoints written
  last whose manifest is not the one sealed in their data, with an `UnsealedCheckpointSkipped`
  warning naming the path; checkpoints saved before the seal are ordered as before.
- `save` reads the root's complete checkpoints (`_found`) once.
"""

import json
import os
import re
import shutil
import warnings

import pytest
import torch

import fzero
import fzero.checkpoint as ck
from fzero._src import checkpoint as impl


def make_params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(40, 30, generator=g), "b": torch.randn(30, generator=g)}


def init(mesh, stage=2):
    return fzero.init(make_params(), fzero.optim.adamw(1e-2), stage=stage, mesh=mesh)


def save_steps(root: str, steps, n: int = 1, keep=None) -> list[str]:
    """Saves of `init`'s state at each of `steps` (its step counter set) on SimMesh(n): their paths."""
    mesh = fzero.SimMesh(n)

    def rank_fn():
        state, out = init(mesh), []
        for s in steps:
            out.append(ck.save(state.replace(step=torch.tensor(s, dtype=state.step.dtype)), root, keep=keep))
        return out

    return mesh.run(rank_fn)[0]


def set_written(path: str, written: int) -> None:
    name = os.path.join(path, "manifest.json")
    with open(name) as f:
        m = json.load(f)
    m["written"] = written
    with open(name, "w") as f:
        json.dump(m, f, indent=1)


def flip(name: str) -> None:
    with open(name, "r+b") as f:
        data = bytearray(f.read())
        data[len(data) // 2] ^= 0xFF
        f.seek(0)
        f.write(bytes(data))


def counting_hashes(monkeypatch) -> list[str]:
    """`_sha256` counted: the file names it hashes, in order, from every rank (SimMesh: one process)."""
    hashed, sha256 = [], impl._sha256

    def counted(name):
        hashed.append(os.path.basename(name))
        return sha256(name)

    monkeypatch.setattr(impl, "_sha256", counted)
    return hashed


def loads(paths, stage=2) -> list:
    """`load` on SimMesh(len(paths)), rank r of `paths[r]`: each rank's `CheckpointError` text, or None."""
    mesh = fzero.SimMesh(len(paths))

    def rank_fn():
        try:
            ck.load(paths[mesh.rank], init(mesh, stage))
        except ck.CheckpointError as e:
            return str(e)
        return None

    return mesh.run(rank_fn)


# -- 1. each file hashed once per load --------------------------------------------------------------


def test_hash_shares_give_each_copy_of_a_file_to_one_reader():
    """The assignment itself: a file read by several ranks from one copy is hashed by one of them
    (balanced by bytes); another copy (another host, another folder) by one of its own readers; a
    file a rank could not look at (no copy key) by that rank; a rank whose checks failed ("") by
    no one; the files a rank does not read never."""
    def reads(**files):
        return json.dumps({f: list(v) for f, v in files.items()})

    # stage 3 at N = 2: both read rank 0's file (the step counter), rank 1 its own too
    texts = [reads(f0=("a:1", 100)), reads(f0=("a:1", 100), f1=("a:2", 100))]
    assert [impl._hash_shares(texts, r) for r in range(2)] == [{"f0"}, {"f1"}]
    # stage 0-2: every rank reads every file: one each
    texts = [reads(f0=("a:1", 100), f1=("a:2", 100))] * 2
    assert [impl._hash_shares(texts, r) for r in range(2)] == [{"f0"}, {"f1"}]
    # rank 1 on another host (another kernel): its copies are its own to hash
    texts = [reads(f0=("a:1", 100), f1=("a:2", 100)), reads(f0=("b:1", 100), f1=("b:2", 100))]
    assert [impl._hash_shares(texts, r) for r in range(2)] == [{"f0", "f1"}, {"f0", "f1"}]
    # a file rank 1 could not stat: rank 1 checks it (and finds it missing); rank 0 its own copy
    texts = [reads(f0=("a:1", 100)), reads(f0=(None, 100))]
    assert [impl._hash_shares(texts, r) for r in range(2)] == [{"f0"}, {"f0"}]
    # rank 0's checks failed: rank 1 hashes what it reads; one rank: everything it reads
    assert impl._hash_shares(["", reads(f0=("a:1", 1))], 1) == {"f0"}
    assert impl._hash_shares([reads(f0=("a:1", 1), f1=("a:2", 5))], 0) == {"f0", "f1"}


def test_load_hashes_each_data_file_once_on_simmesh(tmp_path, monkeypatch):
    """SimMesh writes one data file, which every rank reads: it was hashed once per rank (N
    times); now once. Only DCP's small `.metadata` is hashed by every rank, which unpickles its
    copy (`_metadata`)."""
    path = save_steps(str(tmp_path), [1], n=2)[0]
    hashed = counting_hashes(monkeypatch)
    assert loads([path, path]) == [None, None]
    assert sorted(hashed) == [".metadata", ".metadata", "__0_0.distcp"], hashed


def test_a_damaged_file_read_by_every_rank_is_refused_on_every_rank(tmp_path):
    """The rank that hashes the file raises its own error naming it; every other rank raises
    the load's agreement naming that rank, the file and the damage: nothing is loaded."""
    path = save_steps(str(tmp_path), [1], n=2)[0]
    flip(os.path.join(path, "__0_0.distcp"))
    errors = loads([path, path])
    assert all(e is not None and "__0_0.distcp" in e and "is corrupted" in e for e in errors), errors
    assert sum("other rank(s)" in e and "nothing was loaded" in e for e in errors) == 1, errors


def test_a_ranks_own_copy_of_the_checkpoint_is_hashed_by_that_rank(tmp_path, monkeypatch):
    """Ranks may load one checkpoint from copies of their own (each host's disk: the ranks agree
    on the manifest's sha256, not the path): a damaged file in rank 1's copy is refused although
    rank 0's copy of it is whole and rank 0 hashes it; each copy's data file is hashed once."""
    path = save_steps(str(tmp_path / "a"), [1], n=2)[0]
    other = str(tmp_path / "b" / "step-1")
    shutil.copytree(path, other)
    hashed = counting_hashes(monkeypatch)
    assert loads([path, other]) == [None, None]
    assert sorted(hashed) == [".metadata", ".metadata", "__0_0.distcp", "__0_0.distcp"], hashed
    flip(os.path.join(other, "__0_0.distcp"))
    errors = loads([path, other])
    assert "__0_0.distcp" in errors[1] and "is corrupted" in errors[1] and repr(other)[1:-1] in errors[1], errors
    assert "1 other rank(s)" in errors[0] and "nothing was loaded" in errors[0], errors


def dist_save(mesh, root, stage):
    return ck.save(init(mesh, stage), root)


def dist_load_hashes(mesh, path, stage):
    """This rank's `load` of `path`: (the files it hashed, its `CheckpointError` text or None)."""
    hashed, sha256 = [], impl._sha256

    def counted(name):
        hashed.append(os.path.basename(name))
        return sha256(name)

    impl._sha256 = counted
    try:
        ck.load(path, init(mesh, stage))
        error = None
    except ck.CheckpointError as e:
        error = str(e)
    finally:
        impl._sha256 = sha256
    return sorted(hashed), error


@pytest.mark.dist
@pytest.mark.parametrize("stage", [3, 1])
def test_load_hashes_each_data_file_once_on_gloo(dist2, tmp_path, stage):
    """On a gloo DistMesh at N = 2 every rank reads rank 0's file (the step counter; at stages
    0-2 every file): rank 1 hashed both files (stage 1: both ranks both), now each data file is
    hashed by one rank; a flipped byte in rank 0's file is refused on both ranks, naming it."""
    path = dist2.run(dist_save, [(str(tmp_path), stage)] * 2)[0]
    got = dist2.run(dist_load_hashes, [(path, stage)] * 2)
    assert [e for _, e in got] == [None, None], got
    data = sorted(f for files, _ in got for f in files if f != ".metadata")
    assert data == ["__0_0.distcp", "__1_0.distcp"], got
    flip(os.path.join(path, "__0_0.distcp"))
    got = dist2.run(dist_load_hashes, [(path, stage)] * 2)
    assert all(e is not None and "__0_0.distcp" in e and "is corrupted" in e for _, e in got), got


# -- 2. the root's order: an edited `written` ------------------------------------------------------


def test_an_edited_written_is_skipped_with_a_warning_and_saves_go_on(tmp_path):
    """step-1's manifest edited to `written` 2**63 - 1: `latest` named it for good, and the next
    save's `written` (2**63) made that save incomplete. Now it is skipped, with a warning naming
    it; the next save is written 3 and is `latest`; `keep` leaves it alone."""
    root = str(tmp_path)
    one, two = save_steps(root, [1, 2])
    set_written(one, 2**63 - 1)
    with pytest.warns(impl.UnsealedCheckpointSkipped, match=re.escape(f"skipped '{one}' (its manifest says written "
                                                                      f"{2**63 - 1})")) as rec:
        assert ck.latest(root) == two
    assert "the manifest does not match the data it was written with" in str(rec[0].message)
    assert rec[0].filename == __file__  # the warning names the caller of latest
    with pytest.warns(impl.UnsealedCheckpointSkipped):
        assert ck.complete(root) == [two]
    with warnings.catch_warnings(record=True) as saved:
        warnings.simplefilter("always", impl.UnsealedCheckpointSkipped)
        three = save_steps(root, [3], keep=1)[0]
        assert ck.read_manifest(three)["written"] == 3
        assert ck.latest(root) == three and sorted(os.listdir(root)) == ["step-1", "step-3"]
    # from save too the user's line (found in review: a functools.cached_property frame named first)
    assert {w.filename for w in saved if w.category is impl.UnsealedCheckpointSkipped} == {__file__}


def test_an_edited_checkpoint_below_the_last_is_not_read(tmp_path, monkeypatch):
    """Only the checkpoints written last are checked against their seal (reading its
    `.metadata` and ~3 KB of data each): `latest` on a root of several reads one seal."""
    root = str(tmp_path)
    paths = save_steps(root, [1, 2, 3])
    edit, seen = impl._edit, []
    monkeypatch.setattr(impl, "_edit", lambda path, m: seen.append(path) or edit(path, m))
    assert ck.latest(root) == paths[-1] and seen == [paths[-1]]


def test_checkpoints_without_a_seal_and_damaged_ones_keep_their_place(tmp_path, monkeypatch):
    """A checkpoint saved before the seal is ordered by its manifest, as before (nothing to check
    it against); a damaged data file (a flipped byte where the seal is, or elsewhere) is still
    `latest`, as before: `latest` checks sizes, `load` refuses it naming the file."""
    root = str(tmp_path)
    with monkeypatch.context() as mp:
        mp.setattr(impl, "seal", lambda head: {})  # as fzero saved before the seal
        first, second = save_steps(root, [1, 2])
    set_written(first, 2**60)
    with warnings.catch_warnings():
        warnings.simplefilter("error", impl.UnsealedCheckpointSkipped)
        assert ck.complete(root) == [second, first]
    sealed = save_steps(str(tmp_path / "sealed"), [1])[0]
    info = ck_metadata(sealed)
    with open(os.path.join(sealed, info.relative_path), "r+b") as f:  # the seal's own bytes
        f.seek(info.offset + info.length - 40)
        data = f.read(32)
        f.seek(info.offset + info.length - 40)
        f.write(bytes(b ^ 0xFF for b in data))
    with warnings.catch_warnings():
        warnings.simplefilter("error", impl.UnsealedCheckpointSkipped)
        assert ck.latest(str(tmp_path / "sealed")) == sealed
    assert all("is corrupted" in e for e in loads([sealed]))


def ck_metadata(path):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import MetadataIndex

    return FileSystemReader(path).read_metadata().storage_data[MetadataIndex(impl.DIGEST, torch.Size([0]))]


def dist_save_after_edit(mesh, root):
    """A gloo save into a root whose last checkpoint's `written` was edited: rank 0 reads the
    root's order inside DCP's planning step; returns (path, written, the warnings rank 0 saw)."""
    state = init(mesh, 3)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        path = ck.save(state.replace(step=torch.tensor(5, dtype=state.step.dtype)), root)
    return path, ck.read_manifest(path)["written"], [w.category.__name__ for w in rec]


@pytest.mark.dist
def test_a_gloo_save_after_an_edited_written_counts_on(dist2, tmp_path):
    root = str(tmp_path)
    one = dist2.run(dist_save, [(root, 3)] * 2)[0]
    set_written(one, 2**63 - 1)
    got = dist2.run(dist_save_after_edit, [(root,)] * 2)
    assert [(p, w) for p, w, _ in got] == [(os.path.join(root, "step-5"), 1)] * 2, got
    assert "UnsealedCheckpointSkipped" in got[0][2], got
    with pytest.warns(impl.UnsealedCheckpointSkipped):
        assert ck.latest(root) == os.path.join(root, "step-5")


# -- 3. save reads the root once ----------------------------------------------------------------------


def test_save_reads_the_roots_checkpoints_once(tmp_path, monkeypatch):
    """`_found` (every manifest of the root, and now the last one's seal) ran twice a save
    before `_Head` (git log: "checkpoint.save reads the root's checkpoints once"); once, with
    `keep` or without, on SimMesh(2), and one seal is read."""
    root = str(tmp_path)
    save_steps(root, [1, 2])
    found, calls = impl._found, []
    monkeypatch.setattr(impl, "_found", lambda *a, **k: calls.append(a[0]) or found(*a, **k))
    edit, seals = impl._edit, []
    monkeypatch.setattr(impl, "_edit", lambda path, m: seals.append(path) or edit(path, m))
    save_steps(root, [3], n=2)
    save_steps(root, [4], n=2, keep=2)
    assert calls == [root, root] and len(seals) == 2, (calls, seals)
    assert sorted(os.listdir(root)) == ["step-3", "step-4"]
