"""fzero.checkpoint across ranks and on bad arguments: the ranks agree before a checkpoint is
written or read, so every rank raises a CheckpointError or none does.

- `load` with a different checkpoint per rank (each rank's own `latest(root)` during a save)
  raises on every rank naming each rank's path and step, instead of a state mixed of two steps;
  a copy of the same checkpoint at another path is the same checkpoint.
- `save` with a different root per rank (a per-rank mkdtemp) raises on every rank naming each
  rank's folder, before anything is written; a rank that does not see the folder rank 0 created
  (no shared file system) makes every rank raise, and nothing is left behind.
- An error on one rank only (a bad path, a bad `keep`) raises on every rank: no rank waits.
- Wrong types (a path of None, a target that is not a state, an edited manifest) are
  CheckpointErrors naming the argument or the manifest field; another lr names the lr; `fzero
  inspect` names the optimizer; `fzero export` to a folder that does not exist exits with status 2.
"""

import json
import os
import shutil

import pytest
import torch

import fzero
import fzero.checkpoint as ck
from fzero import optim
from fzero._src import checkpoint as impl
from fzero._src.state import describe


def params() -> dict:
    return {"w": torch.arange(1.0, 7.0), "v": torch.ones(3)}


def loss(p, x):
    return ((p["w"] * x).sum()) ** 2 + p["v"].sum()


def two_steps(mesh, root, opt=lambda: optim.adamw(0.1, weight_decay=0.01), stage=3):
    """On every rank of `mesh`: save after step 1 and after step 2 into `root`; the two paths."""

    def rank_fn():
        state, step, paths = fzero.init(params(), opt(), stage=stage, mesh=mesh), fzero.train_step(loss), []
        for _ in range(2):
            state, _ = step(state, torch.ones(6))
            paths.append(ck.save(state, root))
        return paths

    return mesh.run(rank_fn)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """step-1 and step-2 of one run on SimMesh(2), stage 3, AdamW(lr 0.1, weight decay 0.01)."""
    return two_steps(fzero.SimMesh(2), str(tmp_path_factory.mktemp("ranks")))


def load_per_rank(paths, opt=lambda: optim.adamw(0.1, weight_decay=0.01)):
    """Rank r loads `paths[r]` into a fresh stage-3 target: per rank the step and params, or the
    error (its type and text); the target must be unchanged where load raised."""
    mesh = fzero.SimMesh(len(paths))

    def rank_fn(path):
        target = fzero.init(params(), opt(), stage=3, mesh=mesh)
        before = [t.clone() for t in fzero._src.tree.flatten_with_paths(target)[1]]
        try:
            state = ck.load(path, target)
        except Exception as e:  # noqa: BLE001 - the test compares types
            after = fzero._src.tree.flatten_with_paths(target)[1]
            assert all(torch.equal(a, b) for a, b in zip(before, after)), "target changed"
            return type(e), str(e)
        return int(state.step), fzero.gather(state)["w"].tolist()

    return mesh.run(rank_fn, [(p,) for p in paths])


def test_ranks_loading_different_checkpoints_raise_on_every_rank(saved, tmp_path):
    one, two = saved
    out = load_per_rank([one, two])
    for kind, text in out:
        assert kind is ck.CheckpointError and "passed different checkpoints to checkpoint.load" in text, text
        assert f"rank 0: {one!r} (step 1, manifest sha256 " in text and f"rank 1: {two!r} (step 2" in text, text
        assert "nothing was loaded" in text, text
    # a copy of the same checkpoint elsewhere (the same manifest bytes) is the same checkpoint
    copy = str(tmp_path / "copy" / "step-2")
    shutil.copytree(two, copy)
    same = load_per_rank([two, copy])
    assert same[0] == same[1] and same[0][0] == 2, same
    # one rank given a path that does not exist or is None: its own error there, every rank raises
    for bad in (str(tmp_path / "nope"), None):
        (kind0, text0), (kind1, text1) = load_per_rank([two, bad])
        assert kind0 is kind1 is ck.CheckpointError, (text0, text1)
        assert "1 other rank(s)" in text0 and "rank 1: CheckpointError: " in text0 and "nothing was loaded" in text0
        assert ("does not exist" if bad else "path (a checkpoint folder, root/step-<n>) must be a str") in text1


def test_save_into_different_roots_raises_on_every_rank_before_writing(tmp_path):
    mesh = fzero.SimMesh(2)
    roots = [str(tmp_path / f"r{r}") for r in range(2)]

    def rank_fn(root):
        state = fzero.init(params(), optim.sgd(0.1), stage=1, mesh=mesh)
        try:
            ck.save(state, root)
        except ck.CheckpointError as e:
            return str(e)

    for text in mesh.run(rank_fn, [(root,) for root in roots]):
        assert "passed different folders or states to checkpoint.save" in text and "nothing was written" in text, text
        assert all(f"rank {r}: {os.path.join(roots[r], 'step-0')!r}" in text for r in range(2)), text
    assert not any(os.path.exists(root) for root in roots)  # not even the temporary folder


def test_one_folder_named_through_a_link_on_one_rank_saves(tmp_path):
    """Rank 0 names the root through a symlink, rank 1 the folder it points to: one folder (the
    same path with links resolved), so the save goes on and every rank returns the one checkpoint.
    A mutation audit found a mutant asking both the paths and the resolved paths to agree pass the
    suite, refusing this save."""
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    mesh = fzero.SimMesh(2)

    def rank_fn(root):
        return ck.save(fzero.init(params(), optim.sgd(0.1), stage=1, mesh=mesh), root)

    paths = mesh.run(rank_fn, [(str(link),), (str(real),)])
    assert [os.path.basename(p) for p in paths] == ["step-0", "step-0"] and os.listdir(real) == ["step-0"]
    assert ck.latest(str(real)) == os.path.join(str(real), "step-0")


def test_save_with_a_keep_that_differs_across_ranks_raises_on_every_rank(tmp_path):
    """Rank 0 alone deletes old checkpoints: before, another rank's `keep` was ignored silently
    (found in review); now the ranks agree on it with the folder, before anything is written."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(params(), optim.sgd(0.1), stage=1, mesh=mesh)
        try:
            ck.save(state, str(tmp_path), keep=1 + 2 * mesh.rank)
        except ck.CheckpointError as e:
            return str(e)

    for text in mesh.run(rank_fn):
        assert "passed different folders or states to checkpoint.save" in text and "nothing was written" in text
        assert "rank 0: " in text and "keep=1)" in text and "keep=3)" in text, text
    assert os.listdir(tmp_path) == []


def test_save_refuses_a_folder_a_rank_does_not_see(tmp_path, monkeypatch):
    """Rank 1 stands for a host whose file system is not rank 0's: every rank raises, rank 0
    removes the folder it created, nothing is published."""
    mesh = fzero.SimMesh(2)
    real = impl._visible
    monkeypatch.setattr(impl, "_visible", lambda path: real(path) and mesh.rank != 1)

    def rank_fn():
        state = fzero.init(params(), optim.sgd(0.1), stage=2, mesh=mesh)
        try:
            ck.save(state, tmp_path)
        except ck.CheckpointError as e:
            return str(e)

    text0, text1 = mesh.run(rank_fn)
    assert "rank 1 of SimMesh" in text1 and "does not see" in text1 and "shares" in text1, text1
    assert "1 other rank(s)" in text0 and "rank 1: CheckpointError: " in text0 and "nothing was saved" in text0, text0
    assert os.listdir(tmp_path) == [] and ck.latest(tmp_path) is None


def test_an_error_on_one_rank_raises_on_every_rank(tmp_path):
    """A bad argument on one rank only (`keep`, the root's type): that rank raises its error, the
    other a CheckpointError naming it; then a save with good arguments works on the same mesh."""
    mesh = fzero.SimMesh(2)

    def rank_fn(keep, root, then):
        state = fzero.init(params(), optim.sgd(0.1), stage=0, mesh=mesh)
        try:
            ck.save(state, root, keep=keep)
        except ck.CheckpointError as e:
            return str(e), then and ck.save(state, str(tmp_path), keep=1)

    out = mesh.run(rank_fn, [(1, str(tmp_path), True), (0, str(tmp_path), True)])
    assert "keep must be None or an int >= 1" in out[1][0], out
    assert "1 other rank(s)" in out[0][0] and "rank 1: CheckpointError: keep must be" in out[0][0], out
    assert out[0][1] == out[1][1] == str(tmp_path / "step-0")
    out = mesh.run(rank_fn, [(None, str(tmp_path / "a"), False), (None, None, False)])
    assert "root (the folder that holds the step-<n> checkpoints) must be a str" in out[1][0], out
    assert "rank 1: CheckpointError: checkpoint.save: root" in out[0][0], out


def test_wrong_types_and_an_edited_manifest_are_checkpoint_errors(saved, tmp_path):
    one, _ = saved
    mesh = fzero.SimMesh(1)
    state = mesh.run(lambda: fzero.init(params(), optim.sgd(0.1), stage=0, mesh=mesh))[0]
    with pytest.raises(ck.CheckpointError, match=r"checkpoint.load: path .* must be a str or os.PathLike, got "
                                                 r"NoneType None; fzero.checkpoint.latest\(root\) returns None where "
                                                 r"the root holds no complete checkpoint"):
        mesh.run(lambda: ck.load(ck.latest(str(tmp_path / "never-saved")), state))
    for fn in (ck.export, ck.summary, ck.read_manifest):  # the same hint; a root that is None gets none
        with pytest.raises(ck.CheckpointError, match=r"got NoneType None; fzero.checkpoint.latest\(root\) returns"):
            fn(None)
    with pytest.raises(ck.CheckpointError, match=r"got NoneType None$"):
        ck.latest(None)
    with pytest.raises(ck.CheckpointError, match="target must be a ZeroState made by fzero.init .* got str"):
        ck.load(one, "state")
    with pytest.raises(ck.CheckpointError, match="state must be the ZeroState made by fzero.init, got NoneType"):
        ck.save(None, tmp_path)
    for fn in (ck.latest, ck.complete, ck.read_manifest, ck.export, ck.summary):
        with pytest.raises(ck.CheckpointError, match="must be a str or os.PathLike, got int 3"):
            fn(3)
    with open(os.path.join(one, "manifest.json")) as f:
        manifest = json.load(f)
    edits = {"leaves": ("x", "field 'leaves' must be a list of leaf records"),
             "step": ("1", "field 'step' must be an int >= 0, got str '1'"),
             "files": ([], "field 'files' must be a dict"),
             "leaves.0.shape": ("six", "field 'leaves[0].shape' must be a list of ints >= 0, got str 'six'"),
             "leaves.1.dtype": ("int64", "field 'leaves[1].dtype' must be a floating torch dtype's name")}
    for i, (field, (value, message)) in enumerate(edits.items()):
        path = str(tmp_path / str(i) / "step-1")
        shutil.copytree(one, path)
        edited = json.loads(json.dumps(manifest))
        name, *rest = field.split(".")
        if rest:
            edited[name][int(rest[0])][rest[1]] = value
        else:
            edited[name] = value
        with open(os.path.join(path, "manifest.json"), "w") as f:
            json.dump(edited, f)
        for kind, text in load_per_rank([path, path]):
            assert kind is ck.CheckpointError and message in text and "edited or damaged" in text, (field, text)
        assert ck.latest(str(tmp_path / str(i))) is None  # not a complete checkpoint either
    # a step of the right type that is not the saved state's: found once the state is read
    path = str(tmp_path / "step" / "step-1")
    shutil.copytree(one, path)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump({**manifest, "step": manifest["step"] + 6}, f)
    for kind, text in load_per_rank([path, path]):
        assert kind is ck.CheckpointError, text
        assert f"the manifest says step {manifest['step'] + 6} but the saved state holds step {manifest['step']}" in text


def test_another_optimizer_setting_is_named(saved):
    one, _ = saved
    for opt, want in ((lambda: optim.adamw(0.5, weight_decay=0.01), "lr: checkpoint 0.1, target 0.5"),
                      (lambda: optim.adamw(0.1, weight_decay=0.05), "weight_decay: checkpoint 0.01, target 0.05"),
                      (lambda: optim.adamw(0.1, weight_decay=0.01, betas=(0.8, 0.999)), "beta1: checkpoint 0.9, "
                                                                                          "target 0.8"),
                      (lambda: optim.lamb(0.1), "another optimizer: checkpoint adamw, target lamb")):
        for kind, text in load_per_rank([one, one], opt):
            assert kind is ck.CheckpointError and want in text and len(text) < 500, text  # (not the description:
            # thousands of characters; the words name the way that keeps the moments too, found in review)
            assert "another optimizer" in text


def test_inspect_names_the_optimizer(saved, capsys, tmp_path):
    from fzero._src.cli import main

    assert main(["inspect", saved[0]]) == 0
    assert "optimizer: adamw, lr 0.1\n" in capsys.readouterr().out
    out = str(tmp_path / "missing" / "model.safetensors")  # a folder that does not exist: exit status 2
    assert main(["export", saved[0], out]) == 2 and f"cannot write {out!r}" in capsys.readouterr().err
    names = {"sgd": optim.sgd(0.1, momentum=0.9), "adam": optim.adam(0.1), "lamb": optim.lamb(0.1),
             "adafactor": optim.adafactor(0.1)}
    for name, opt in names.items():
        assert impl.optimizer_name(json.loads(json.dumps(describe(opt)))) == name


# -- on real processes (gloo): the save's and the load's agreement through a process group -------


def dist_disagree(mesh, base):
    """Rank r saves into base/r<r> (refused on both), then both into base/same at steps 1 and 2,
    then rank r loads step-<r + 1> (refused on both), then both load step 2: the texts of the two
    errors, what base holds and the step loaded at last."""
    state, step = fzero.init(params(), optim.sgd(0.1), stage=3, mesh=mesh), fzero.train_step(loss)
    texts = []
    try:
        ck.save(state, os.path.join(base, f"r{mesh.rank}"))
    except ck.CheckpointError as e:
        texts.append(str(e))
    same = os.path.join(base, "same")
    for _ in range(2):
        state, _ = step(state, torch.ones(6))
        ck.save(state, same)
    target = fzero.init(params(), optim.sgd(0.1), stage=3, mesh=mesh)
    try:
        ck.load(os.path.join(same, f"step-{mesh.rank + 1}"), target)
    except ck.CheckpointError as e:
        texts.append(str(e))
    return texts, sorted(os.listdir(base)), int(ck.load(ck.latest(same), target).step)


@pytest.mark.dist
def test_different_roots_and_checkpoints_on_gloo(dist2, tmp_path):
    for r, (texts, listed, step) in enumerate(dist2.run(dist_disagree, [(str(tmp_path),)] * 2)):
        assert len(texts) == 2, texts
        assert "passed different folders or states to checkpoint.save" in texts[0], texts[0]
        assert f"rank 1: {str(tmp_path / 'r1' / 'step-0')!r}" in texts[0], texts[0]
        assert "passed different checkpoints to checkpoint.load" in texts[1] and "(step 2, manifest" in texts[1]
        assert listed == ["same"] and step == 2


def test_ranks_saving_states_of_different_inits_raise_on_every_rank(tmp_path):
    """The folder's agreement also compares which state each rank saves (its init, and whether it
    carries an unchecked donated update, whose check is collective): ranks passing states of
    different inits raise before any other collective of the save, nothing written."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        a = fzero.init({"w": torch.ones(4)}, fzero.optim.sgd(0.1), stage=1, mesh=mesh)
        b = fzero.init({"w": torch.ones(4)}, fzero.optim.sgd(0.1), stage=1, mesh=mesh)
        with pytest.raises(ck.CheckpointError, match=r"the state of init #1\)\n  rank 1: .*the state of init #2\)"):
            fzero.checkpoint.save(a if mesh.rank == 0 else b, tmp_path)
        return True

    assert mesh.run(rank_fn) == [True, True]
    assert not list(tmp_path.iterdir())
