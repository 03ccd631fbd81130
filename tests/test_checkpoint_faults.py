"""fzero.checkpoint where something goes wrong that no other file covers (found in review).

- A load under an lr schedule that differs where the optimizer's description does not show it
  (a `functools.partial`'s arguments, a value read from a config object, a sequence of another
  length) raises `CheckpointError` naming the step and both lrs: `save` records the schedule's
  value at the saved step and at steps to come (`LR_AHEAD`), `load` compares the target's
  exactly. A schedule object is read by neither (it may move on at each call); a manifest
  without the record loads as before. Every rank reads the schedule at save (before: rank 0
  alone, so a function around an object that moves on at each call moved on rank 0 only, and
  the next step's lr differed across ranks); one that gives two values at the saved step is
  neither recorded nor compared, with an `LrScheduleMovedOn` warning.
- A save whose write fails (a full disk: `OSError` ENOSPC, simulated in DCP's writer or in the
  manifest's) raises a `CheckpointError` naming the checkpoint on every rank (SimMesh's other
  ranks too, which before stopped with `RankFailed`), chains the original, and leaves no
  `.tmp-step-*` folder behind; a folder that cannot be removed is a note, never another error.
  So does a gloo rank whose state dict cannot be built (a host out of memory; before, its peer
  died inside DCP's collectives).
- A crash while `save(keep=K)` deletes an old checkpoint leaves no half-deleted `step-<n>`: the old
  folder is renamed to a `.tmp-step-*` name first, which the next `save(keep=...)` removes.
"""

import dataclasses
import errno
import functools
import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint.filesystem as dcp_fs

import fzero
import fzero.checkpoint as ck
from fzero import optim
from fzero._src import checkpoint as impl


def params() -> dict:
    return {"w": torch.arange(1.0, 9.0), "v": torch.ones(3)}


def loss(p, x):
    return ((p["w"] * x).sum()) ** 2 + p["v"].sum()


def warmup(step: int, peak: float) -> float:
    """0 at step 0, then up to `peak` over 4 steps: every peak gives lr 0.0 at step 0."""
    return peak * min(1.0, step / 4)


@dataclasses.dataclass
class Config:
    lr: float


def schedule(kind: str, peak: float):
    """An lr schedule whose peak `state.describe` does not see."""
    if kind == "partial":
        return functools.partial(warmup, peak=peak)
    config = Config(peak)
    return lambda step: warmup(step, config.lr)


def save_then_load(mesh, root, saved_opt, target_opt, steps=1):
    """On every rank: `steps` steps under `saved_opt()`, save, load into a target under
    `target_opt()`; per rank `(error or None, the loaded state's next step's params, the
    uninterrupted run's)`."""
    step = fzero.train_step(loss)

    def rank_fn():
        state = fzero.init(params(), saved_opt(), stage=1, mesh=mesh)
        for _ in range(steps):
            state, _ = step(state, torch.ones(8))
        path = ck.save(state, root)
        try:
            loaded = ck.load(path, fzero.init(params(), target_opt(), stage=1, mesh=mesh))
        except ck.CheckpointError as e:
            return e, None, None
        return None, fzero.gather(step(loaded, torch.ones(8))[0]), fzero.gather(step(state, torch.ones(8))[0])

    return mesh.run(rank_fn)


# -- the lr schedule ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["partial", "config"])
@pytest.mark.parametrize("steps", [0, 1])
def test_an_lr_schedule_that_differs_where_describe_cannot_see_is_refused_at_load(tmp_path, kind, steps):
    """Saved under peak 1e-3, loaded under peak 1e-1 (a partial's argument, a dataclass the
    schedule reads): a `CheckpointError` on every rank naming the first step whose lr differs
    and both lrs. Saved at step 0 the lrs agree there (0.0) and part at step 1, which the save
    read ahead. Before, both loaded silently and the resumed run stepped under lr 1e-1. The same
    schedule loads, and the resumed step is the uninterrupted one."""
    mesh = fzero.SimMesh(2)
    got = save_then_load(mesh, str(tmp_path / "other"), lambda: optim.adamw(schedule(kind, 1e-3)),
                         lambda: optim.adamw(schedule(kind, 1e-1)), steps)
    for error, _, _ in got:
        assert isinstance(error, ck.CheckpointError), error
        text = str(error)
        assert (f"step-{steps}' was saved with another lr schedule: lr at step 1: checkpoint 0.00025, target 0.025"
                in text and f"saved at step {steps}" in text), text
        assert "make the target with the schedule it was saved with" in text and "fzero.checkpoint.export" in text
        assert ("with the saved optimizer state (its moments, its step), load into that target, then give the loaded "
                "state the new optimizer on every rank: state.replace(info=dataclasses.replace(") in text, text
    for error, resumed, uninterrupted in save_then_load(mesh, str(tmp_path / "same"),
                                                        lambda: optim.adamw(schedule(kind, 1e-3)),
                                                        lambda: optim.adamw(schedule(kind, 1e-3)), steps):
        assert error is None and all(torch.equal(resumed[k], uninterrupted[k]) for k in resumed)


def listed(step: int, values: tuple) -> float:
    """`values[step]`: an lr sequence in a partial's arguments, which `state.describe` does not see;
    past its end an IndexError."""
    return values[step]


def test_an_lr_schedule_that_ends_is_recorded_as_raising_there(tmp_path):
    """3 lrs saved at step 1: the schedule raises from step 3 on, which the manifest records
    (null). A target with more lrs differs at step 11 (the first step read ahead past the end):
    refused, naming it; the same 3 lrs load."""
    mesh = fzero.SimMesh(1)
    lrs = (0.1, 0.2, 0.3)
    def listing(values):
        return lambda: optim.adamw(functools.partial(listed, values=values))

    (error, _, _), = save_then_load(mesh, str(tmp_path / "a"), listing(lrs), listing(lrs + (0.4,) * 20))
    assert "lr at step 11: checkpoint raised (no lr), target 0.4" in str(error), error
    manifest = ck.read_manifest(str(tmp_path / "a" / "step-1"))
    assert manifest["lr"][:3] == [[1, 0.2], [2, 0.3], [11, None]], manifest["lr"]
    (error, _, _), = save_then_load(mesh, str(tmp_path / "b"), listing(lrs), listing(lrs))
    assert error is None


def test_a_manifest_without_an_lr_record_loads_and_a_damaged_one_is_named(tmp_path, monkeypatch):
    """A checkpoint saved before the record (no "lr" in its manifest) loads under another
    schedule, as before; an "lr" that is not a list of [step, lr or null] is a `CheckpointError`
    naming the field. (Saved as before the manifest's seal, `checkpoint.seal`: a sealed manifest
    whose record is taken off is refused, tests/test_manifest_digest.py.)"""
    monkeypatch.setattr(impl, "seal", lambda head: {})
    mesh = fzero.SimMesh(1)
    (error, _, _), = save_then_load(mesh, str(tmp_path), lambda: optim.adamw(schedule("partial", 1e-3)),
                                    lambda: optim.adamw(schedule("partial", 1e-3)))
    assert error is None
    path = str(tmp_path / "step-1")
    name = os.path.join(path, "manifest.json")
    with open(name) as f:
        manifest = json.load(f)
    for lr, want in ((None, None), ([[1, "0.1"]], "field 'lr' must be null or a list of [step, lr or null]")):
        with open(name, "w") as f:
            json.dump({**manifest, "lr": lr}, f)

        def rank_fn():
            target = fzero.init(params(), optim.adamw(schedule("partial", 1e-1)), stage=1, mesh=mesh)
            try:
                ck.load(path, target)
            except ck.CheckpointError as e:
                return str(e)

        got = mesh.run(rank_fn)[0]
        assert got is None if want is None else want in got, got


class Counted:
    """An lr schedule object that counts its calls (one that moves on at each call, as a torch
    scheduler's `step()`)."""

    def __init__(self, lr: float) -> None:
        self.lr, self.calls = lr, 0

    def __call__(self, step: int) -> float:
        self.calls += 1
        return self.lr


def test_an_lr_schedule_object_is_read_by_neither_save_nor_load(tmp_path):
    """A callable object may move on at each call (`as_schedule` calls it once a step): `save`
    and `load` do not call it (its values are not compared, as before), so it is called once per
    step all the same; the manifest records no lr."""
    mesh = fzero.SimMesh(1)
    step = fzero.train_step(loss)
    saved, target = Counted(0.1), Counted(0.2)

    def rank_fn():
        state = fzero.init(params(), optim.adamw(saved), stage=1, mesh=mesh)
        for _ in range(2):
            state, _ = step(state, torch.ones(8))
        path = ck.save(state, str(tmp_path))
        ck.load(path, fzero.init(params(), optim.adamw(target), stage=1, mesh=mesh))
        return path

    path = mesh.run(rank_fn)[0]
    assert (saved.calls, target.calls) == (2, 0)
    assert ck.read_manifest(path)["lr"] is None


class Decaying:
    """An lr schedule object: `lr * 0.9 ** calls`, moving on at each call as a torch scheduler's
    `step()` does, or with `moves=False` `lr * 0.9 ** step`, a function of the step."""

    def __init__(self, lr: float = 0.1, moves: bool = True) -> None:
        self.lr, self.moves, self.calls = lr, moves, 0

    def __call__(self, step: int) -> float:
        self.calls += 1
        return self.lr * 0.9 ** (self.calls if self.moves else step)


def through(obj):
    """A plain function around `obj`, which `save` and `load` read (`_of_the_step`)."""
    return lambda step: obj(step)


def test_a_function_around_a_schedule_object_warns_and_every_rank_steps_on(tmp_path):
    """`through` an object that moves on at each call: every rank reads it at save (each object
    moves alike), the saved step gives two values, so nothing is recorded, with an
    `LrScheduleMovedOn` warning on each rank; the next step runs. Before, rank 0 alone read it
    and that step raised "the optimizer's lr differs across ranks". A function of the step is
    still recorded, and `load` compares a target's with it (refused where it differs); a target
    that moves on is not compared, with the warning."""
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(loss)
    objects = [Decaying(), Decaying()]

    def rank_fn():
        moving = through(objects[mesh.rank])
        state = fzero.init(params(), optim.sgd(moving), stage=1, mesh=mesh)
        state, _ = step(state, torch.ones(8))
        moved = ck.save(state, str(tmp_path / "moved"))
        state, _ = step(state, torch.ones(8))
        pure = fzero.init(params(), optim.sgd(through(Decaying(0.5, moves=False))), stage=1, mesh=mesh)
        path = ck.save(step(pure, torch.ones(8))[0], str(tmp_path / "pure"))
        try:
            ck.load(path, fzero.init(params(), optim.sgd(through(Decaying(1.0, moves=False))), stage=1, mesh=mesh))
        except ck.CheckpointError as e:
            refused = str(e)
        loaded = ck.load(path, fzero.init(params(), optim.sgd(moving), stage=1, mesh=mesh))
        return moved, path, refused, int(loaded.step)

    with pytest.warns(impl.LrScheduleMovedOn) as caught:
        (moved, path, refused, loaded), _ = mesh.run(rank_fn)
    texts = [str(w.message) for w in caught]
    assert len(texts) == 4, texts  # a save and a load on each rank
    assert [w.filename for w in caught] == [__file__] * 4  # the user's save and load (before: a wrapper in fzero)
    assert all("at step 1, then" in t and "called it 8 times on every rank" in t for t in texts), texts
    assert "checkpoint.save recorded no lr values" in texts[0], texts[0]
    assert f"checkpoint.load of {path!r} compared it with none of the lr values saved" in texts[-1], texts[-1]
    assert ck.read_manifest(moved)["lr"] is None and objects[0].calls == objects[1].calls
    assert ck.read_manifest(path)["lr"][0] == [1, 0.45] and "lr at step 1: checkpoint 0.45, target 0.9" in refused
    assert loaded == 1


# -- a save that fails to write ------------------------------------------------------------------


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def half_then_no_space(transforms, stream, data, write_item, *args, **kwargs):
    """DCP's `_write_item` on a full disk: some bytes of the chunk land, then ENOSPC."""
    stream.write(b"\0" * 16)
    no_space()


def save_twice(mesh, root, fault=None):
    """On every rank: save step 1; one more step; save step 2 with `fault` armed (`FAULT`) ->
    per rank `(the second save's error or path, the root's names after it, the path of a retry
    of step 2)`. The retry runs with the fault removed, in the same `mesh.run`: no rank is left
    behind."""
    step = fzero.train_step(loss)
    state = fzero.init(params(), optim.adamw(0.1), stage=1, mesh=mesh)
    state, _ = step(state, torch.ones(8))
    ck.save(state, root)
    state, _ = step(state, torch.ones(8))
    FAULT[:] = [] if fault is None else [fault]
    try:
        got = ck.save(state, root)
    except Exception as e:  # noqa: BLE001 - returned for the test to read
        got = e
    finally:
        FAULT.clear()
    names = sorted(os.listdir(root))
    return got, names, ck.save(state, root)


FAULT: list = []  # the patched function while it should fail


@pytest.mark.parametrize("where", ["data", "manifest"])
def test_a_save_that_fails_to_write_raises_on_every_rank_and_leaves_no_folder(tmp_path, monkeypatch, where):
    """A full disk while DCP writes the chunks (rank 0 writes every rank's on SimMesh), or while
    rank 0 writes the manifest: rank 0 raises `CheckpointError` naming the checkpoint, the rank,
    the OSError (chained as the cause) and the free space; the other rank a `CheckpointError`
    naming the checkpoint and rank 0's failure (before: `RankFailed`, as if rank 0 had died); the
    temporary folder is removed (before: it stayed, and only a save with `keep=` removed it);
    `latest` is the save before, and a retry saves."""
    root = str(tmp_path)
    final = os.path.join(root, "step-2")
    if where == "data":
        fault, write_item = half_then_no_space, dcp_fs._write_item
        monkeypatch.setattr(dcp_fs, "_write_item", lambda *a, **k: (FAULT[0] if FAULT else write_item)(*a, **k))
    else:
        fault, write = no_space, impl._write
        monkeypatch.setattr(impl, "_write", lambda *a, **k: (FAULT[0] if FAULT else write)(*a, **k))
    mesh = fzero.SimMesh(2)
    (error0, names, retried), (error1, _, _) = mesh.run(lambda: save_twice(mesh, root, fault))
    assert isinstance(error0, ck.CheckpointError) and isinstance(error1, ck.CheckpointError), (error0, error1)
    assert isinstance(error0.__cause__, OSError) and error0.__cause__.errno == errno.ENOSPC
    text = str(error0)
    assert text.startswith(f"checkpoint.save of {final!r}: ") and "failed on rank 0 (OSError: [Errno 28]" in text
    assert "bytes free" in text and "nothing was saved" in text and ".tmp-step-2-" in text, text
    assert str(error1).startswith(f"checkpoint.save of {final!r}: 1 other rank(s) of ") and "rank 0: " in str(error1)
    assert names == ["step-1"]
    assert retried == final == ck.latest(root) and sorted(os.listdir(root)) == ["step-1", "step-2"]


def test_a_temporary_folder_that_cannot_be_removed_is_a_note_on_the_original_error(tmp_path, monkeypatch):
    """The removal after a failed write is best effort: where it fails too, the write's
    `CheckpointError` is raised all the same, with a note naming the folder and the way out."""
    root = str(tmp_path)
    write_item, rmtree = dcp_fs._write_item, shutil.rmtree
    monkeypatch.setattr(dcp_fs, "_write_item", lambda *a, **k: (FAULT[0] if FAULT else write_item)(*a, **k))

    def refusing(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)).startswith(".tmp-step-2-"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(impl.shutil, "rmtree", refusing)
    mesh = fzero.SimMesh(2)
    (error0, names, _), _ = mesh.run(lambda: save_twice(mesh, root, half_then_no_space))
    assert isinstance(error0, ck.CheckpointError) and isinstance(error0.__cause__, OSError), error0
    notes = getattr(error0, "__notes__", [])
    assert len(notes) == 1 and "could not be removed (PermissionError" in notes[0] and "keep=K" in notes[0], notes
    assert len(names) == 2 and names[0].startswith(".tmp-step-2-") and names[1] == "step-1", names


def dist_save_with_a_full_disk(mesh, root):
    """On a torchrun gloo DistMesh: rank 1's DCP writes fail with ENOSPC at the second save;
    per rank `(its error's type and text, or the path, the root's names after it)`."""
    write_item = dcp_fs._write_item
    dcp_fs._write_item = lambda *a, **k: (FAULT[0] if FAULT else write_item)(*a, **k)
    try:
        got, names, _ = save_twice(mesh, root, half_then_no_space if mesh.rank == 1 else None)
    finally:
        dcp_fs._write_item = write_item
    return (type(got).__name__, str(got), names) if isinstance(got, Exception) else (got, names)


def test_a_full_disk_on_one_gloo_rank_raises_on_every_rank_and_leaves_no_folder(dist2, tmp_path):
    """Two gloo processes, rank 1's write fails: DCP hands the failure to both, each raises a
    `CheckpointError` naming the checkpoint and rank 1's OSError, and rank 0 removes the folder."""
    root = str(tmp_path)
    final = os.path.join(root, "step-2")
    for kind, text, names in dist2.run(dist_save_with_a_full_disk, [(root,), (root,)]):
        assert kind == "CheckpointError" and text.startswith(f"checkpoint.save of {final!r}: "), text
        assert "writing the data failed on rank 1 (OSError: [Errno 28]" in text, text
        assert names == ["step-1"]
    assert ck.latest(root) == final


def dist_save_that_cannot_build_its_state_dict(mesh, root):
    """On a torchrun gloo DistMesh: rank 0 runs out of host memory while building its state dict
    (`_scalars`, rank 0's alone); its error's type and text, the root's names after it."""
    scalars = impl._scalars

    def out_of_memory(*args, **kwargs):
        raise MemoryError("simulated: out of host memory building the state dict")

    impl._scalars = out_of_memory if mesh.rank == 0 else scalars
    try:
        ck.save(fzero.init(params(), optim.adamw(0.1), stage=1, mesh=mesh), root)
    except Exception as e:  # noqa: BLE001 - returned for the test to read
        return type(e).__name__, str(e), sorted(os.listdir(root))
    finally:
        impl._scalars = scalars
    return None


def test_a_state_dict_that_cannot_be_built_on_one_gloo_rank_raises_on_every_rank(dist2, tmp_path):
    """Rank 0's state dict raises while being built: it is built inside DCP's planning step,
    which hands the failure to both ranks, and each raises a `CheckpointError` naming rank 0's
    MemoryError; the temporary folder is removed. Before, it was built before `dcp.save` and
    rank 0 raised alone, while rank 1 waited in DCP's collectives until gloo aborted it."""
    root = str(tmp_path)
    for kind, text, names in dist2.run(dist_save_that_cannot_build_its_state_dict, [(root,), (root,)]):
        assert kind == "CheckpointError" and text.startswith(f"checkpoint.save of {os.path.join(root, 'step-0')!r}: ")
        assert "failed on rank 0 (MemoryError: simulated: out of host memory" in text, text
        assert names == []


# -- keep= --------------------------------------------------------------------------------------


class Killed(BaseException):
    """What a process killed half way through deleting a folder leaves: a stop, no cleanup."""


def test_a_crash_while_keep_deletes_an_old_checkpoint_leaks_nothing(tmp_path, monkeypatch):
    """`save(keep=1)` stopped half way through deleting step-1 (its manifest gone, the rest
    there): step-1 is no longer a `step-<n>` folder (it was renamed to `.tmp-step-1-*` before the
    deletion began), `latest` is step-2, and the next `save(keep=1)` removes what is left.
    Before, the half-deleted step-1 stayed forever: neither complete (what `keep` deletes) nor a
    `.tmp-step-*` folder (what a save with `keep` clears)."""
    root = str(tmp_path)
    rmtree = shutil.rmtree

    def killed(path, *args, **kwargs):
        name = os.path.basename(os.fspath(path))
        if name == "step-1" or name.startswith(".tmp-step-1-"):
            os.remove(os.path.join(path, "manifest.json"))
            raise Killed("killed half way through deleting")
        return rmtree(path, *args, **kwargs)

    mesh = fzero.SimMesh(2)
    step = fzero.train_step(loss)

    def first():
        state = fzero.init(params(), optim.adamw(0.1), stage=1, mesh=mesh)
        for _ in range(2):
            state, _ = step(state, torch.ones(8))
            ck.save(state, root, keep=1)

    monkeypatch.setattr(impl.shutil, "rmtree", killed)
    with pytest.raises(Killed):
        mesh.run(first)
    monkeypatch.setattr(impl.shutil, "rmtree", rmtree)
    assert "step-1" not in os.listdir(root) and ck.latest(root) == os.path.join(root, "step-2")

    def second():
        state = ck.load(ck.latest(root), fzero.init(params(), optim.adamw(0.1), stage=1, mesh=mesh))
        state, _ = step(state, torch.ones(8))
        return ck.save(state, root, keep=1)

    assert mesh.run(second)[0] == os.path.join(root, "step-3")
    assert os.listdir(root) == ["step-3"]


# -- the root's fsync after the rename ----------------------------------------------------------


def test_a_root_that_cannot_be_synced_after_the_rename_warns_and_the_save_stands(tmp_path, monkeypatch):
    """The checkpoint is renamed into place, then the fsync of the root fails: a
    `CheckpointNotSynced` warning naming the checkpoint, and `save` returns its path on every
    rank; `latest` names it and it loads. Before, rank 0 raised "is complete and in place", the
    other ranks that the save failed, and a retry found its step taken (found in review)."""
    root = str(tmp_path / "root")
    real = impl._fsync_dir

    def failing_on_the_root(path):
        if os.path.abspath(path) == os.path.abspath(root):
            raise OSError(errno.EIO, "Input/output error")
        return real(path)

    monkeypatch.setattr(impl, "_fsync_dir", failing_on_the_root)
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(loss)

    def rank_fn():
        state, _ = step(fzero.init(params(), optim.adamw(1e-3), stage=1, mesh=mesh), torch.ones(8))
        return ck.save(state, root), fzero.gather(state)

    with pytest.warns(ck.CheckpointNotSynced, match=r"step-1'? is complete and in place.*could not be synced") as seen:
        got = mesh.run(rank_fn)
    assert {w.filename for w in seen} == {__file__}  # the user's call of save
    assert [path for path, _ in got] == [os.path.join(root, "step-1")] * 2 == [ck.latest(root)] * 2
    loaded = mesh.run(lambda: fzero.gather(ck.load(ck.latest(root), fzero.init(params(), optim.adamw(1e-3), stage=1,
                                                                                   mesh=mesh))))
    assert all(torch.equal(loaded[0][k], got[0][1][k]) for k in got[0][1])


def test_another_save_publishing_the_same_step_meanwhile_is_named_and_leaves_its_checkpoint(tmp_path, monkeypatch):
    """Two meshes saving into one root (two process groups of one job): the second rename finds
    `step-n` published by the other save. Every rank raises a `CheckpointError` saying so and to
    save to a root of each mesh's own; the other save's checkpoint stays, loadable, and no
    temporary folder is left. Before: "free space ... latest(root) is the checkpoint before",
    false on both counts (found in review of sub-group meshes)."""
    root = str(tmp_path / "root")
    real, published = impl._fsync_dir, []
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(loss)

    def other_save_first(path):  # the other mesh's save publishes step-1 just before this one's rename
        if os.path.basename(path).startswith(".tmp-step-1") and not os.path.exists(os.path.join(root, "step-1")):
            monkeypatch.setattr(impl, "_fsync_dir", real)
            other = fzero.SimMesh(1)

            def other_rank():
                state, _ = step(fzero.init(params(), optim.adamw(1e-3), stage=1, mesh=other), torch.ones(8))
                ck.save(state, root)
                return fzero.gather(state)

            published.append(other.run(other_rank)[0])
        return real(path)

    def rank_fn():
        state = fzero.init(params(), optim.adamw(1e-3), stage=1, mesh=mesh)
        state, _ = step(state, torch.ones(8))
        fzero.collectives.all_reduce(torch.zeros(1), mesh)
        if mesh.rank == 0:
            monkeypatch.setattr(impl, "_fsync_dir", other_save_first)
        with pytest.raises(ck.CheckpointError) as caught:
            ck.save(state, root)
        return str(caught.value)

    said = mesh.run(rank_fn)
    assert "another save published that folder while this one wrote its data" in said[0] and "free space" not in said[0]
    assert "a root of its own" in said[0] and all("step-1" in words for words in said)
    assert os.listdir(root) == ["step-1"]
    one = fzero.SimMesh(1)
    loaded = one.run(lambda: fzero.gather(ck.load(ck.latest(root), fzero.init(params(), optim.adamw(1e-3), stage=1,
                                                                                 mesh=one))))[0]
    assert published and all(torch.equal(loaded[k], published[0][k]) for k in loaded)


def test_every_file_and_the_folder_are_synced_before_the_rename_and_the_root_after(tmp_path, monkeypatch):
    """proofs/checkpoint.md, steps 2-5: each data file (DCP's), the manifest, then the temporary
    folder are fsynced before the atomic rename makes the checkpoint visible, and the root after
    it, so a power loss never leaves a visible `step-<n>` whose files were not on disk. A crash
    test cannot see a missing fsync (the page cache survives a killed process); the order of the
    calls can. (Without the manifest's fsync, or the folder's, the suite passed: mutations of
    `checkpoint._write` and `_publish`.)"""
    root = str(tmp_path / "root")
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def rename(a, b):
        events.append(("rename", os.fspath(a), os.fspath(b)))
        return real_rename(a, b)

    monkeypatch.setattr(impl.os, "fsync", fsync)
    monkeypatch.setattr(impl.os, "rename", rename)
    mesh = fzero.SimMesh(2)
    final = mesh.run(lambda: ck.save(fzero.init(params(), optim.adamw(1e-3), stage=1, mesh=mesh), root))[0]
    monkeypatch.undo()
    (at, (_, tmp, _)), = [(i, e) for i, e in enumerate(events) if e[0] == "rename" and e[2] == final]
    synced = [e[1] for e in events[:at] if e[0] == "fsync"]
    files = sorted(os.listdir(final))
    assert "manifest.json" in files and any(f.endswith(".distcp") for f in files), files
    for f in files:  # a file DCP writes as `<name>.tmp` and renames in the folder is synced under that name
        assert {os.path.join(tmp, f), os.path.join(tmp, f + ".tmp")} & set(synced), (f, events)
    assert synced[-1] == tmp and synced.index(os.path.join(tmp, "manifest.json")) < len(synced) - 1, events
    assert ("fsync", os.path.dirname(final)) in events[at + 1 :], events


def test_a_schedule_objects_position_is_neither_saved_nor_restored(tmp_path):
    """README: a schedule object passed as the lr is read once a step and never at a checkpoint,
    and its position is not saved: a fresh object given to the target after a load starts from its
    own first value (found in review of a user porting schedules); moving it to the loaded step is
    the user's."""
    mesh = fzero.SimMesh(1)
    step = fzero.train_step(loss)

    def rank_fn():
        schedule = Decaying(0.1)
        state = fzero.init(params(), optim.sgd(schedule), stage=1, mesh=mesh)
        for _ in range(3):
            state, _ = step(state, torch.ones(8))
        calls_at_save = schedule.calls
        path = ck.save(state, str(tmp_path))
        after_save = schedule.calls
        fresh = Decaying(0.1)
        loaded = ck.load(path, fzero.init(params(), optim.sgd(fresh), stage=1, mesh=mesh))
        return calls_at_save, after_save, int(loaded.step), fresh.calls, loaded.optimizer.lr(int(loaded.step))

    calls, after, at, fresh_calls, lr = mesh.run(rank_fn)[0]
    assert calls == after == 3 and at == 3 and fresh_calls == 0  # neither save nor load read the object
    assert lr == 0.1 * 0.9 and lr != 0.1 * 0.9 ** 4  # at step 3: its first value, not the run's fourth


def test_a_load_given_fewer_buffers_than_its_save_names_every_saved_name(tmp_path):
    """README's recipe saves `buffers={**info.buffers, "batches_seen": t}`; a load given only the
    module's buffers is refused naming `batches_seen` and saying to pass every name the save was
    given (it said "pass the buffers of the module it was saved from", which the user had done:
    found in review of the docs); with every name it loads them."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(params(), optim.adamw(1e-3), stage=1, mesh=mesh)
        module_buffers = {"running": torch.arange(3.0)}
        path = ck.save(state, tmp_path, buffers={**module_buffers, "batches_seen": torch.tensor(7)})
        with pytest.raises(ck.CheckpointError, match=r"in the checkpoint only \['batches_seen'\]; pass every name its "
                                                     r"save was given in buffers="):
            ck.load(path, state, buffers={"running": torch.zeros(3)})
        back = {"running": torch.zeros(3), "batches_seen": torch.tensor(0)}
        ck.load(path, state, buffers=back)
        return back

    back = mesh.run(rank_fn)[0]
    assert torch.equal(back["running"], torch.arange(3.0)) and int(back["batches_seen"]) == 7


def test_a_temporary_folder_removed_by_another_saves_keep_is_named(tmp_path, monkeypatch):
    """Another mesh's save into the same root with `keep=` removes the temporary folders it finds,
    this save's in the middle of its write: every rank of this save raises a `CheckpointError`
    saying its temporary folder was removed by another save into the root and to save to a root
    of each mesh's own, not "free space" (found in review of the same-root fix); the other save's
    checkpoint stands."""
    root = str(tmp_path / "root")
    real, done = impl._fsync_dir, []
    step = fzero.train_step(loss)

    def other_save_first(path):
        if os.path.basename(path).startswith(".tmp-step-1") and not done:
            done.append(True)
            monkeypatch.setattr(impl, "_fsync_dir", real)
            other = fzero.SimMesh(1)

            def other_rank():
                state = fzero.init(params(), optim.adamw(1e-3), stage=1, mesh=other)
                for _ in range(2):
                    state, _ = step(state, torch.ones(8))
                ck.save(state, root, keep=3)

            other.run(other_rank)
        return real(path)

    mesh = fzero.SimMesh(1)

    def rank_fn():
        state, _ = step(fzero.init(params(), optim.adamw(1e-3), stage=1, mesh=mesh), torch.ones(8))
        monkeypatch.setattr(impl, "_fsync_dir", other_save_first)
        with pytest.raises(ck.CheckpointError) as caught:
            ck.save(state, root)
        return str(caught.value)

    said = mesh.run(rank_fn)[0]
    assert "was removed while this save wrote it -- by another save into this root" in said, said
    assert "free space" not in said and "a root of its own" in said
    assert os.listdir(root) == ["step-2"] and ck.latest(root) == os.path.join(root, "step-2")
