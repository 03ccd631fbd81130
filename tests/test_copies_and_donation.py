"""Copies of a state beside donating steps (docs/bad-input.md rows 249-252).

A donating step (`train_step(donate=True)`) writes its input state's buffers in place. A copy
that keeps those tensors -- `copy.copy`, `state.replace()`, `dataclasses.replace`, a `tree_map`
of `lambda t: t`, `t.detach()` or `t.to(t.device)` -- made *before* the step was not refused
after it: it read the next step's values under its own step count, and a donating step of the copy
wrote the state the first step had returned, silently (found in review of a JAX user). States now
count the donating writes of the buffers they share (`state._Buffers`): such a copy is refused by
every reader, both ways; a copy of the tensors (`tree_map(torch.clone, state)`, `copy.deepcopy`)
stays a state of its own. Also here: `copy.deepcopy` on a `SimMesh`, `pickle`'s refusal, a
strided params buffer and `state.replace(step=...)`'s values."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import optree
import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as torch_pytree

import fzero
from fzero import optim

SHARED = r"shares its buffers with a state that a donating step \(train_step\(donate=True\)\) consumed after this one"
COPIES = {
    "copy.copy": copy.copy,
    "state.replace()": lambda s: s.replace(),
    "dataclasses.replace": dataclasses.replace,
    "optree identity": lambda s: optree.tree_map(lambda t: t, s),
    "torch pytree detach": lambda s: torch_pytree.tree_map(torch.Tensor.detach, s),
    "optree .to(device)": lambda s: optree.tree_map(lambda t: t.to(t.device), s),
}


def _params():
    g = torch.Generator().manual_seed(0)
    return {"a": {"w": torch.randn(8, 8, generator=g) / 3, "b": torch.zeros(8)},
            "c": torch.randn(8, 4, generator=g) / 3}


def _loss(p, batch):
    x, y = batch
    return F.mse_loss(torch.tanh(x @ p["a"]["w"] + p["a"]["b"]) @ p["c"], y)


def _batch(rank, t):
    g = torch.Generator().manual_seed(100 * t + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _init(mesh, stage, **kw):
    return fzero.init(_params(), optim.adamw(1e-2, weight_decay=0.1), stage=stage, mesh=mesh,
                      units=lambda path: path.split(".")[0], **kw)


def _leaves(state):
    """The values a state holds (not `pending`, a donating step's flag, which a pure step has not)."""
    return [t.clone() for t in optree.tree_leaves((state.params, state.opt_state, state.step, state.master))]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("how", COPIES)
def test_a_copy_made_before_a_donating_step_is_refused_after_it_and_the_step_returned_is_untouched(stage, how):
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(_loss, donate=True)

    def rank():
        s1, _ = step(_init(mesh, stage), _batch(mesh.rank, 0))
        snap = COPIES[how](s1)
        s2, _ = step(s1, _batch(mesh.rank, 1))
        after = _leaves(s2)
        refused = []
        for use in (lambda: step(snap, _batch(mesh.rank, 1)), lambda: fzero.gather(snap),
                    lambda: fzero.evaluate(_loss)(snap, _batch(mesh.rank, 1))):
            with pytest.raises(fzero.FzeroError, match=SHARED) as e:
                use()
            refused.append(str(e.value))
        s3, _ = step(s2, _batch(mesh.rank, 2))  # the state the step returned goes on
        return refused, after, int(s3.step)

    for refused, after, steps in mesh.run(rank):
        assert all("tree_map(torch.clone, state)" in words for words in refused)
        assert steps == 3


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("how", ["copy.copy", "optree identity"])
def test_a_donating_step_of_the_copy_makes_the_original_refused(stage, how):
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(_loss, donate=True)

    def rank():
        s1, _ = step(_init(mesh, stage), _batch(mesh.rank, 0))
        other, _ = step(COPIES[how](s1), _batch(mesh.rank, 1))
        with pytest.raises(fzero.FzeroError, match=SHARED):
            step(s1, _batch(mesh.rank, 1))
        return int(other.step)

    assert mesh.run(rank) == [2, 2]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("how", ["tree_map(torch.clone)", "copy.deepcopy"])
def test_a_copy_of_the_tensors_is_a_state_of_its_own_and_steps_to_the_bits_of_the_original(stage, how):
    """The ways out the error names: the snapshot keeps step 1's values through the original's
    donating step, and its own steps give the original's bits (a pure reference run beside)."""
    mesh = fzero.SimMesh(2)
    step, pure = fzero.train_step(_loss, donate=True), fzero.train_step(_loss)
    snapshot = {"tree_map(torch.clone)": lambda s: torch_pytree.tree_map(torch.clone, s),
                "copy.deepcopy": copy.deepcopy}[how]

    def rank():
        s1, _ = step(_init(mesh, stage), _batch(mesh.rank, 0))
        reference, _ = pure(s1, _batch(mesh.rank, 1))
        want = _leaves(reference)
        snap = snapshot(s1)
        then = _leaves(snap)
        s2, _ = step(s1, _batch(mesh.rank, 1))
        kept = _equal(_leaves(snap), then)
        again, _ = step(snap, _batch(mesh.rank, 1))
        return kept, _equal(_leaves(again), want), _equal(_leaves(s2), want)

    assert mesh.run(rank) == [(True, True, True)] * 2


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("scaled", [False, True])
def test_states_before_pure_steps_stay_usable_beside_later_donating_steps_frozen_buckets_shared(stage, scaled):
    """No false refusal: a pure step's state shares only what no step writes (a frozen bucket's
    params; a static loss scale's state, kept as it is) with its input; the input, read after
    donating steps of the output, has its values."""
    mesh = fzero.SimMesh(2)
    loss = (lambda p, b: _loss(p, tuple(x.half() for x in b)).float()) if scaled else _loss
    step, pure = fzero.train_step(loss, donate=True), fzero.train_step(loss)
    groups = (fzero.ParamGroup("frozen", match=lambda path: path.startswith("c"), frozen=True), fzero.ParamGroup("rest"))
    scaling = dict(precision=fzero.Precision(torch.float16, torch.float32),
                   loss_scale=fzero.StaticLossScale(128.0)) if scaled else {}

    def rank():
        s0 = _init(mesh, stage, groups=groups, **scaling)
        s1, _ = pure(s0, _batch(mesh.rank, 0))
        before = _leaves(s0), fzero.gather(s1)
        s2, _ = step(s1, _batch(mesh.rank, 1))
        s3, _ = step(s2, _batch(mesh.rank, 2))
        with pytest.raises(fzero.FzeroError, match="was donated"):
            fzero.gather(s1)
        return _equal(_leaves(s0), before[0]), int(step(s0, _batch(mesh.rank, 0))[0].step), int(s3.step)

    assert mesh.run(rank) == [(True, 1, 3)] * 2


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("offload", ["cpu", "nvme"])
def test_copies_beside_donating_steps_of_an_offloaded_state(stage, offload, tmp_path):
    """Copies both before a donating step and of the state it returned (a tree_map looks its
    buffers up) are refused once a donating step wrote what they hold."""
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(_loss, donate=True)
    off = fzero.Offload(optimizer=offload, **({"nvme_path": str(tmp_path)} if offload == "nvme" else {}))

    def rank():
        s1, _ = step(_init(mesh, stage, offload=off), _batch(mesh.rank, 0))
        before = copy.copy(s1)
        s2, _ = step(s1, _batch(mesh.rank, 1))
        of_s2 = optree.tree_map(lambda t: t, s2)
        s3, _ = step(s2, _batch(mesh.rank, 2))
        for snap in (before, of_s2):  # (an NVMe state's copy: refused first by its swap files, as before)
            with pytest.raises(fzero.FzeroError, match=SHARED if offload == "cpu" else "is not the NVMe tier's stand-in"):
                fzero.gather(snap)
        return int(s3.step)

    assert mesh.run(rank) == [3, 3]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_skipped_overflow_writes_nothing_and_the_first_update_refuses_every_copy_before_it(stage):
    """fp16 params with a dynamic loss scale from 2**24: the first steps overflow and are skipped
    (a donating skip hands the input's buffers on unwritten: a copy made before it reads its values
    still, found in review), then one updates, after which every copy made before is refused and
    the state that step returned goes on."""
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(lambda p, b: _loss(p, tuple(x.half() for x in b)).float(), donate=True)
    precision = fzero.Precision(torch.float16, torch.float32)

    def rank():
        state = _init(mesh, stage, precision=precision, loss_scale=fzero.DynamicLossScale(init_scale=2.0 ** 24))
        olds, t = [], 0
        while True:
            olds.append((copy.copy(state), _leaves(state)))
            state, metrics = step(state, _batch(mesh.rank, t))
            t += 1
            if not metrics.skipped:
                break
            old, values = olds[-1]
            assert _equal(_leaves(old), values) and fzero.gather(old) is not None  # readable after a skip
        for old, _ in olds:
            with pytest.raises(fzero.FzeroError, match=SHARED):
                fzero.gather(old)
        return len(olds) > 1, int(step(state, _batch(mesh.rank, t))[0].step)

    assert mesh.run(rank) == [(True, 2)] * 2


def test_deepcopy_on_a_simmesh_shares_the_info_and_pickling_names_the_checkpoint(tmp_path):
    """pickle's refusal names `checkpoint.save(state, root)`, which runs as named (its words had the
    arguments the other way round, which `save` refuses: found in review of the docs)."""
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(_loss, donate=True)

    def rank():
        state, _ = step(_init(mesh, 3), _batch(mesh.rank, 0))
        twin = copy.deepcopy(state)
        assert twin.info is state.info and _equal(_leaves(twin), _leaves(state))
        with pytest.raises(TypeError, match=r"fzero\.checkpoint\.save\(state, root\)"):
            pickle.dumps(state)
        fzero.checkpoint.save(state, tmp_path)  # as the words say
        step(state, _batch(mesh.rank, 1))
        with pytest.raises(fzero.FzeroError, match="was donated"):
            copy.deepcopy(state).params  # noqa: B018  (the mark is kept: refused at its first use)
            fzero.gather(copy.deepcopy(state))
        return int(twin.step)

    assert mesh.run(rank) == [1, 1]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_strided_params_buffer_is_refused_by_replace_and_tree_map(stage):
    """Equal values in a strided view trained from another tensor's storage at stages 0-2 (the
    leaves are `as_strided` views of the buffer): refused, naming the bucket and the way out."""
    mesh = fzero.SimMesh(2)

    def rank():
        state = _init(mesh, stage)
        strided = tuple(torch.stack([p, torch.full_like(p, 7.0)], 1)[:, 0] for p in state.params)
        assert all(torch.equal(a, b) for a, b in zip(strided, state.params))
        words = []
        for make in (lambda: state.replace(params=strided),
                     lambda: optree.tree_map(lambda t: torch.stack([t, t], 1)[:, 0] if t.dim() == 1 and t.numel() > 1
                                             else t, state)):
            with pytest.raises(fzero.FzeroError, match=r"state\.params\[0\] \(bucket 'a/float32/default'.*strides "
                                                       r"\[2\].*one-dimensional and contiguous.*t\.contiguous\(\)"):
                make()
        fine = state.replace(params=tuple(p.contiguous() for p in strided))
        return _equal(optree.tree_leaves(fzero.gather(fine)), optree.tree_leaves(fzero.gather(state)))

    assert mesh.run(rank) == [True, True]


@pytest.mark.parametrize("value, words", [
    (torch.tensor([7]), r"got a torch\.int64 tensor of shape \[1\] holding 7"),
    (torch.tensor(7.5), r"got a torch\.float32 tensor of shape \[\] holding 7\.5"),
    (torch.tensor(-1), r"holding -1"),
    (True, r"got True"),
    ("7", r"got '7'"),
])
def test_replace_step_refuses_what_is_no_step_count(value, words):
    mesh = fzero.SimMesh(1)

    def rank():
        state = _init(mesh, 0)
        with pytest.raises(fzero.FzeroError, match=r"state\.replace\(step=\.\.\.\): the step counter is the number "
                                                   r"of updates applied, an int >= 0 .*" + words):
            state.replace(step=value)

    mesh.run(rank)


@pytest.mark.parametrize("donate", [False, True])
def test_replace_step_takes_a_python_int_and_an_int32_tensor(donate):
    step = fzero.train_step(_loss, donate=donate)
    mesh = fzero.SimMesh(1)

    def rank():
        counts = []
        for value in (7, torch.tensor(7, dtype=torch.int32)):
            state = _init(mesh, 1).replace(step=value)
            assert state.step.dtype == torch.int64 and state.step.dim() == 0
            new, metrics = step(state, _batch(0, 0))
            counts.append((metrics.step, int(new.step)))
        return counts

    assert mesh.run(rank) == [[(7, 8), (7, 8)]]


def test_a_deepcopy_of_an_nvme_state_is_refused_as_its_clone_is(tmp_path):
    """An NVMe state is its swap files; a deepcopy shares the tier (the static `info`) and holds
    copies of its stand-ins: refused by the files (`OffloadError`), as a `tree_map(torch.clone)`."""
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(_loss, donate=True)

    def rank():
        state, _ = step(_init(mesh, 1, offload=fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path))),
                        _batch(mesh.rank, 0))
        for copied in (copy.deepcopy(state), torch_pytree.tree_map(torch.clone, state)):
            with pytest.raises(fzero.OffloadError, match="is not the NVMe tier's stand-in"):
                fzero.gather(copied)
        return int(step(state, _batch(mesh.rank, 1))[0].step)

    assert mesh.run(rank) == [2, 2]


def test_a_state_reads_as_a_summary_and_compares_as_an_object():
    """`repr` summarises (the fields' repr ran to 430 characters a leaf) and says where the state
    was consumed; `==` is identity (it raised torch's "Boolean value of Tensor with more than one
    value is ambiguous" for a copy)."""
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(_loss, donate=True)

    def rank():
        state = _init(mesh, 3)
        said = repr(state)
        same = (state == state, state == copy.copy(state), hash(state) == hash(state))
        step(state, _batch(mesh.rank, 0))
        return said, same, repr(state)

    for r, (said, same, consumed) in enumerate(mesh.run(rank)):
        assert said == f"ZeroState(stage 3, rank {r} of {mesh!r}, step 0, 2 buckets of 3 leaves)"
        assert same == (True, False, True) and consumed == said[:-1] + "; consumed by a donating step)"


def test_a_refused_copy_stays_refused_through_replace_and_deepcopy():
    """A copy refused after a donating step, made again by `state.replace` (any field),
    `copy.deepcopy` or `copy.copy`: refused too (found in review: both read the next step's values as the copy's
    own). A `tree_map` of it too: below. `dataclasses.replace` rebuilds the state from its tensors
    and is not: docs/bad-input.md row 249."""
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(_loss, donate=True)

    def rank():
        s0 = _init(mesh, 1)
        stale = copy.copy(s0)
        step(s0, _batch(mesh.rank, 0))
        for again in (lambda: stale.replace(), lambda: stale.replace(step=0), lambda: copy.deepcopy(stale),
                      lambda: copy.copy(stale)):
            with pytest.raises(fzero.FzeroError, match=SHARED):
                fzero.gather(again())
        return True

    assert mesh.run(rank) == [True, True]


def test_a_shallow_copy_of_a_consumed_state_keeps_its_mark():
    """`copy.copy` of the state a donating step consumed is that state again: its repr says
    consumed, and a reader says it "was donated", not that another state's step wrote its buffers
    (a mutant dropping the mark in `__copy__` passed the suite)."""
    mesh = fzero.SimMesh(1)
    step = fzero.train_step(_loss, donate=True)

    def rank():
        s0 = _init(mesh, 1)
        step(s0, _batch(0, 0))
        twin = copy.copy(s0)
        assert repr(twin).endswith("; consumed by a donating step)")
        with pytest.raises(fzero.FzeroError, match="was donated to a train_step"):
            fzero.gather(twin)
        return True

    assert mesh.run(rank) == [True]


MAPS = {"optree identity": lambda s: optree.tree_map(lambda t: t, s),
        "optree clone": lambda s: optree.tree_map(torch.clone, s),
        "torch pytree identity": lambda s: torch_pytree.tree_map(lambda t: t, s),
        "torch pytree clone": lambda s: torch_pytree.tree_map(torch.clone, s)}


@pytest.mark.parametrize("how", MAPS)
@pytest.mark.parametrize("stage", [0, 3])
def test_a_tree_map_of_a_refused_state_is_refused_alike_whether_it_keeps_or_copies_the_tensors(stage, how):
    """A state rebuilt by a `tree_map` from one refused already -- the state a donating step
    consumed, a copy made before that step (and a state a donating step lost:
    tests/test_donated_update_raises.py) -- is refused with that state's words, whether the map kept the tensors or cloned them: either way it holds the next
    step's values (or a half-written update) under the old step count. Before: it was a state of
    its own, read and stepped from those values silently (found in review; rows 209, 249). A map
    of the live state is not refused, and a map over two states (their structures equal) runs."""
    mesh = fzero.SimMesh(2)
    step, copied = fzero.train_step(_loss, donate=True), MAPS[how]

    def rank():
        s0 = _init(mesh, stage)
        stale = copy.copy(s0)
        s1, _ = step(s0, _batch(mesh.rank, 0))
        for refused, words in ((s0, "was donated"), (stale, SHARED)):
            with pytest.raises(fzero.FzeroError, match=words):
                fzero.gather(copied(refused))
            with pytest.raises(fzero.FzeroError, match=words):
                step(copied(refused), _batch(mesh.rank, 1))
        live = copied(s1)
        fzero.gather(live)  # the live state's map: read as the state itself
        both = optree.tree_map(lambda a, b: a, s1, copied(s1))
        assert int(both.step) == 1
        return True

    assert mesh.run(rank) == [True, True]


@pytest.mark.parametrize("lib", ["optree", "torch"])
def test_a_treespec_kept_past_a_donating_step_rebuilds_a_refused_state(lib):
    """`leaves, spec = tree_flatten(s0)` of a live state, a donating step of `s0`, then
    `tree_unflatten(spec, leaves)`: the rebuilt state holds the next step's values under step 0,
    and is refused (found in review: it was read silently, as the state was live when flattened).
    The same leaves under a spec taken after the step (the live state's) rebuild it as before."""
    mesh = fzero.SimMesh(1)
    step = fzero.train_step(_loss, donate=True)
    flatten, unflatten = ((lambda s: optree.tree_flatten(s, namespace="fzero")),
                          (lambda spec, leaves: optree.tree_unflatten(spec, leaves))) if lib == "optree" else (
        torch_pytree.tree_flatten, (lambda spec, leaves: torch_pytree.tree_unflatten(leaves, spec)))

    def rank():
        s0 = _init(mesh, 1)
        leaves, spec = flatten(s0)
        s1, _ = step(s0, _batch(0, 0))
        with pytest.raises(fzero.FzeroError, match=SHARED):
            fzero.gather(unflatten(spec, leaves))
        leaves1, spec1 = flatten(s1)
        assert int(unflatten(spec1, leaves1).step) == 1 and fzero.gather(unflatten(spec1, leaves1)) is not None
        return True

    assert mesh.run(rank) == [True]


def test_replace_step_takes_numpys_integers():
    import numpy as np

    mesh = fzero.SimMesh(1)
    assert mesh.run(lambda: int(_init(mesh, 0).replace(step=np.int64(7)).step))[0] == 7


@pytest.mark.parametrize("stage", [0, 3])
def test_a_consumed_state_is_a_load_target_like_any_other(stage, tmp_path):
    """`checkpoint.load` reads only its target's structure: a state a donating step consumed is one
    (it was refused, "was donated", found in review); the loaded state equals one loaded into a
    fresh target, and the state the step returned is untouched and steps on beside it."""
    import fzero.checkpoint as ck

    mesh = fzero.SimMesh(2)
    step = fzero.train_step(_loss, donate=True)

    def rank():
        s1, _ = step(_init(mesh, stage), _batch(mesh.rank, 0))
        path = ck.save(s1, str(tmp_path))
        s2, _ = step(s1, _batch(mesh.rank, 1))
        before = _leaves(s2)
        loaded = ck.load(path, s1)
        fresh = ck.load(path, _init(mesh, stage))
        same, kept = _equal(_leaves(loaded), _leaves(fresh)), _equal(_leaves(s2), before)
        step(loaded, _batch(mesh.rank, 1))
        return same, kept, int(step(s2, _batch(mesh.rank, 2))[0].step)

    assert mesh.run(rank) == [(True, True, 3)] * 2


def test_another_stages_buffers_are_refused_by_replace_naming_what_this_stage_holds():
    """`s3.replace(params=s0.params)` (stage 0's whole buffers into a stage-3 state), the other
    way round (`own_values` of stage 3, shards, into a stage-0 state), and `s3.replace(opt_state=
    s0.opt_state)` (stage 0's whole moments): refused where made, naming what the stage holds (the
    bucket and field, both shapes, the stage and world size) and the way to move values (gather,
    then init). Before: the params were taken, since either size passed, and the next step raised a
    bare torch error ("invalid gradient ... got [9] but expected shape compatible with [18]";
    "setStorage ... out of bounds"); the optimizer state, the optimizer's own error, naming neither
    bucket nor stage (found in review of a model-surgery user). The same shapes are taken."""
    mesh = fzero.SimMesh(2)

    def rank():
        s0, s3 = _init(mesh, 0), _init(mesh, 3)
        with pytest.raises(fzero.FzeroError, match=r"state.params\[0\] .*\(stage 3 holds this rank's shard: \d+\).*"
                                                   r"fzero.gather the one state and fzero.init the other"):
            s3.replace(params=s0.params)
        with pytest.raises(fzero.FzeroError, match=r"\(stage 0 holds the whole buffer: \d+\)"):
            s0.replace(params=tuple(s3.params))
        with pytest.raises(fzero.FzeroError, match=r"bucket .*, field 'exp_avg': shape \[\d+\], where this state "
                                                   r"\(stage 3, world size 2\) holds \[\d+\]"):
            s3.replace(opt_state=s0.opt_state)
        s3.replace(opt_state=tuple(optree.tree_map(torch.clone, s3.opt_state)))
        return True

    assert mesh.run(rank) == [True, True]
