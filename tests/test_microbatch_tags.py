"""Micro-batches at different positions on different ranks (`train_step(micro_batches=k)`).

Stages 2-3 with `gather="on_use"` gather and reduce only the units a micro-batch's loss reads. A
loss that returns a constant for an empty micro-batch, without calling the model, reads none:
before, a rank whose micro-batch 0 was empty paired its micro-batch 1's gathers and reductions
with the other ranks' micro-batch 0 (same ops, shapes and tags), and the step returned a complete
sum added in another order -- not stage 0's bits -- with no error (found in review). Each
micro-batch's collectives now carry its index (`Mesh.phase`, `gathering.in_micro_batch`):

- such ranks raise `DivergentPaths` on every rank, naming each rank's unit and micro-batch and the
  way out (SimMesh at N = 2, 3; DistMesh over gloo, whose fingerprint carries the label);
- the way out (the model run on the empty micro-batch, a zero that reads every unit) and
  `gather="eager"` give stage 0's bits, and stages 0-1 (every bucket reduced in every micro-batch)
  are unaffected;
- empty micro-batches at the same position on every rank, and k = 1, run as before: stage 0's
  bits, the same collectives, and tags in `Mesh.record` unchanged;
- `Mesh.phase` itself: calls alike but for the label mismatch, naming it; leaving restores it.
"""

from __future__ import annotations

import pytest
import torch

import fzero
from fzero import optim
from fzero._src.mesh import _Call, _fingerprint, settings_crc

from .stage_harness import assert_equal_leaves

W = 7


def _params():
    return {"a": torch.linspace(-1.0, 1.0, W), "b": {"w": torch.linspace(0.5, -0.5, 2 * W).reshape(2, W)}}


def _units(path):
    return path.split(".")[0]  # units "a" and "b"


def _constant_on_empty(p, batch):
    """The reviewed loss: a constant 0 for an empty micro-batch, the model is not called."""
    x, y = batch
    if x.shape[0] == 0:
        return torch.zeros(())
    return _model_loss(p, batch)


def _model_loss(p, batch):
    """The way out: the model runs on every micro-batch; on an empty one its zero reads every unit."""
    x, y = batch
    err = (torch.tanh(x * p["a"]) @ p["b"]["w"].T).sum(dim=1) - y
    return err.square().sum() * 0.0 if x.shape[0] == 0 else err.square().mean()


def _micro_batches(r, k, empty):
    """Rank r's k micro-batches of 2 rows each (seeded by the rank), micro-batch `empty` of none."""
    g = torch.Generator().manual_seed(100 + r)
    return [(torch.randn(0 if i == empty else 2, W, generator=g), torch.randn(0 if i == empty else 2, generator=g))
            for i in range(k)]


def _steps(mesh, stage, k, empties, loss, steps=2, **step_kw):
    """On one rank of `mesh`: `(gathered params, [Metrics])` after `steps` SGD steps of k
    micro-batches, micro-batch `empties[rank]` empty (None: none); `step_kw`: `train_step`'s."""
    state = fzero.init(_params(), optim.sgd(0.1, momentum=0.9), stage=stage, mesh=mesh, units=_units)
    step = fzero.train_step(loss, micro_batches=k, **step_kw)
    metrics = []
    for _ in range(steps):
        mbs = _micro_batches(mesh.rank, k, empties[mesh.rank])
        state, m = step(state, mbs if k > 1 else mbs[0])
        metrics.append(m)
    return fzero.gather(state), metrics


def _run(stage, n, k, empties, loss, **kw):
    mesh = fzero.SimMesh(n)
    return mesh.run(lambda: _steps(mesh, stage, k, empties, loss, **kw))


def _errors(stage, n, k, empties, loss, **kw):
    """Each rank's error where the step raises on every rank."""
    mesh, errors = fzero.SimMesh(n), {}

    def rank_fn():
        try:
            _steps(mesh, stage, k, empties, loss, **kw)
        except fzero.MeshError as e:
            errors[mesh.rank] = e
            raise

    with pytest.raises(fzero.CollectiveMismatch):
        mesh.run(rank_fn)
    return errors


def _assert_same(got, want, what):
    for r, ((p1, m1), (p0, m0)) in enumerate(zip(got, want)):
        assert_equal_leaves(p1, p0, f"{what}, rank {r}")
        for t, (a, b) in enumerate(zip(m1, m0)):
            assert torch.equal(a.loss, b.loss) and torch.equal(a.grad_norm, b.grad_norm), (what, r, t)


# -- ranks whose empty micro-batch sits elsewhere -------------------------------------------------


@pytest.mark.parametrize("kw", [dict(engine="autograd"), dict(engine="func"), dict(prefetch=1)], ids=str)
@pytest.mark.parametrize("stage, n", [(2, 2), (3, 2), (2, 3), (3, 3)])
def test_an_empty_micro_batch_at_another_position_on_one_rank_stops_every_rank_naming_the_micro_batches(
        stage, n, kw):
    """Rank 1's micro-batch 1 is empty, every other rank's micro-batch 0: rank 1's units of
    micro-batch 0 meet the others' of micro-batch 1. Before: no error, and not stage 0's bits
    (at N = 3, 3e-8 off in `b.w` here; at N = 2 these values happened to agree)."""
    empties = [1 if r == 1 else 0 for r in range(n)]
    errors = _errors(stage, n, 2, empties, _constant_on_empty, **kw)
    assert sorted(errors) == list(range(n))
    verb = "gathered" if stage == 3 else "reduced"
    others = [r for r in range(n) if r != 1]
    for r, e in errors.items():
        msg = str(e)
        assert isinstance(e, fzero.DivergentPaths), (r, type(e), msg)
        assert f"rank 0 {verb} unit " in msg and "in micro-batch 1 of 2, rank 1 " in msg, msg
        assert f"rank 1 {verb} unit " in msg and "in micro-batch 0 of 2" in msg, msg
        assert f"The ranks were in different micro-batches (rank(s) [1] in micro-batch 0 of 2; rank(s) {others} in " \
               f"micro-batch 1 of 2)" in msg, msg
        assert "run the model and return a zero that depends on its output (out.sum() * 0.0" in msg, msg
        assert "[micro-batch 1 of 2]" in msg and "[micro-batch 0 of 2]" in msg, msg  # the mesh's words too


@pytest.mark.parametrize("stage", [2, 3])
def test_an_empty_last_micro_batch_on_one_rank_is_named_too(stage):
    """Rank 1's last micro-batch is empty, rank 0 has none: rank 1 reaches the agreement while
    rank 0 gathers or reduces in micro-batch 1 (a `DivergentPaths` before too); the message now
    says where each rank was and the way out."""
    errors = _errors(stage, 2, 2, [None, 1], _constant_on_empty)
    assert sorted(errors) == [0, 1]
    for e in errors.values():
        msg = str(e)
        assert isinstance(e, fzero.DivergentPaths), msg
        assert "in micro-batch 1 of 2, rank 1 had finished its backward" in msg, msg
        assert "(rank(s) [1] past its last micro-batch; rank(s) [0] in micro-batch 1 of 2)" in msg, msg
        assert "out.sum() * 0.0" in msg, msg


@pytest.mark.parametrize("stage", [2, 3])
def test_the_way_out_and_eager_gathering_give_stage_0s_bits(stage):
    """The loss that runs the model on its empty micro-batch reads every unit, as does
    `gather="eager"` with the constant loss: both equal stage 0 bit for bit; and stage 0 gives
    the same bits for either loss (a zero gradient either way)."""
    empties = [1, 0]
    want = _run(0, 2, 2, empties, _model_loss)
    _assert_same(_run(0, 2, 2, empties, _constant_on_empty), want, "stage 0, constant loss")
    _assert_same(_run(stage, 2, 2, empties, _model_loss), want, f"stage {stage}, the model on the empty micro-batch")
    _assert_same(_run(stage, 2, 2, empties, _constant_on_empty, gather="eager"), want, f"stage {stage}, eager")


@pytest.mark.parametrize("accumulate", ["each", "once"])
def test_stages_0_and_1_are_unaffected(accumulate):
    """Stages 0-1 reduce every bucket in every micro-batch ("each"; zeros where no unit was read)
    or once after the last ("once"): the constant loss at other positions per rank is no
    divergence there, and stage 1 equals stage 0."""
    for n in (2, 3):
        empties = [r % 2 for r in range(n)]
        _assert_same(_run(1, n, 2, empties, _constant_on_empty, accumulate=accumulate),
                     _run(0, n, 2, empties, _constant_on_empty, accumulate=accumulate), f"stage 1, N = {n}")


@pytest.mark.parametrize("stage", [2, 3])
def test_micro_batches_empty_at_the_same_position_on_every_rank_run_as_before(stage):
    """The normal path: micro-batch 1 empty on every rank (both units unread there, on every
    rank), and no empty one: stage 0's bits; the recorded collectives carry the buckets' tags as
    at k = 1 (the label is compared, not recorded; their count per k: test_accumulation.py's
    `expected_comm` test)."""
    for empties in ([1, 1, 1], [None, None, None]):
        _assert_same(_run(stage, 3, 2, empties, _constant_on_empty), _run(0, 3, 2, empties, _constant_on_empty),
                     f"stage {stage}, empties {empties}")
    mesh = fzero.SimMesh(2)
    with mesh.record() as log:
        mesh.run(lambda: _steps(mesh, stage, 2, [None, None], _model_loss, steps=1))
    assert {x.tag for x in log if not x.tag.startswith("fzero.")} == {"a/float32/default", "b/float32/default"}


# -- Mesh.phase ----------------------------------------------------------------------------------


def test_calls_alike_but_for_their_phase_are_a_mismatch_naming_each_phase():
    mesh = fzero.SimMesh(2)

    def fn():
        with mesh.phase("p0"):
            fzero.collectives.all_reduce(torch.ones(2), mesh, "sum", tag="t")  # the same phase: fine
            with mesh.phase(f"q{mesh.rank}"):
                pass
            fzero.collectives.all_reduce(torch.ones(2), mesh, "sum", tag="t")  # restored on leaving
            with mesh.phase(f"q{mesh.rank}"):
                fzero.collectives.all_reduce(torch.ones(2), mesh, "sum", tag="t")

    with mesh.record() as log, pytest.raises(fzero.CollectiveMismatch) as info:
        mesh.run(fn)
    msg = str(info.value)
    assert "rank 0: all_reduce(float32[2], sum, tag='t') [q0]" in msg and "rank 1: all_reduce(float32[2], sum, " \
           "tag='t') [q1]" in msg, msg
    assert {x.tag for x in log} == {"t"}


def test_a_call_without_a_phase_has_the_fingerprint_it_had_before_phases():
    """DistMesh's fingerprint: the tag's crc alone without a phase (k = 1 and every other call
    compare as before), the tag's and the phase's with one."""
    call = _Call("all_gather", torch.float32, (3,), None, "a/float32/default")
    assert _fingerprint(1, 5, call)[10] == settings_crc("a/float32/default")
    labelled = _Call("all_gather", torch.float32, (3,), None, "a/float32/default", phase="micro-batch 1")
    assert _fingerprint(1, 5, labelled)[10] != _fingerprint(1, 5, call)[10]
    assert _fingerprint(1, 5, labelled)[:10] == _fingerprint(1, 5, call)[:10]


# -- DistMesh over gloo ----------------------------------------------------------------------------


def dist_empty_micro_batch(mesh, stage, empties, way_out):
    """Run by the pool's workers (as tests.test_microbatch_tags): `mesh.run` of `_steps` with
    micro-batch `empties[rank]` empty; `(gathered params, losses)` or the error's type and words."""
    loss = _model_loss if way_out else _constant_on_empty
    try:
        params, metrics = mesh.run(lambda: _steps(mesh, stage, 2, empties, loss))[0]
    except fzero.MeshError as e:
        return type(e).__name__, str(e)
    return params, [m.loss for m in metrics]


@pytest.mark.dist
@pytest.mark.parametrize("stage", [2, 3])
def test_on_gloo_the_fingerprint_carries_the_micro_batch(dist2, stage):
    """The same divergence over DistMesh: every rank raises `DivergentPaths` naming the micro-batches
    (before: the step returned, the bits not stage 0's); the way out equals SimMesh's stage 0."""
    out = dist2.run(dist_empty_micro_batch, [(stage, [0, 1], False)] * 2)
    for r, (kind, msg) in enumerate(out):
        assert kind == "DivergentPaths", (r, kind, msg)
        assert "rank 0 " in msg and "in micro-batch 1 of 2, rank 1 " in msg and "in micro-batch 0 of 2" in msg, msg
    got = dist2.run(dist_empty_micro_batch, [(stage, [0, 1], True)] * 2)
    want = _run(0, 2, 2, [0, 1], _model_loss)
    for r, ((p1, l1), (p0, m0)) in enumerate(zip(got, want)):
        assert_equal_leaves(p1, p0, f"gloo stage {stage} vs SimMesh stage 0, rank {r}")
        assert all(torch.equal(a, b.loss) for a, b in zip(l1, m0)), (r, l1, m0)


def _words_of_counts(stage, counts):
    """Each rank's `DivergentPaths` words where rank r steps with micro_batches=counts[r]."""
    mesh, errors = fzero.SimMesh(len(counts)), {}

    def rank_fn():
        k = counts[mesh.rank]
        state = fzero.init(_params(), optim.sgd(0.1), stage=stage, mesh=mesh, units=_units)
        mbs = _micro_batches(mesh.rank, k, None)
        try:
            fzero.train_step(_model_loss, micro_batches=k)(state, mbs if k > 1 else mbs[0])
        except fzero.MeshError as e:
            errors[mesh.rank] = e
            raise

    with pytest.raises(fzero.CollectiveMismatch):
        mesh.run(rank_fn)
    assert sorted(errors) == list(range(len(counts)))
    assert all(isinstance(e, fzero.DivergentPaths) for e in errors.values()), errors
    return [str(e) for e in errors.values()]


def test_ranks_whose_micro_batches_differ_are_told_so_first():
    """Stage 3, rank 0 steps with micro_batches=1 (no micro-batch label), rank 1 with 2: rank 0's
    forward gather met rank 1's in micro-batch 0, and the words said rank 0 was "past its last
    micro-batch" and gave the empty-micro-batch advice (found in review). A rank in no micro-batch
    that gathers a unit is in a step of one: the words say the settings differ."""
    for msg in _words_of_counts(3, [1, 2]):
        assert "Rank(s) [0] ran a step of one micro-batch" in msg and "micro_batches=...) differ" in msg, msg
        assert "past its last micro-batch" not in msg and "out.sum() * 0.0" not in msg, msg


@pytest.mark.parametrize("stage", [0, 3])
def test_ranks_stepping_different_counts_of_micro_batches_are_told_so_at_the_first(stage):
    """`accumulate="each"`, rank 0 with micro_batches=2, rank 1 with 3: the label carries the
    count, so the ranks part at micro-batch 0's first collective and the words name the setting.
    Before: rank 0 finished its two micro-batches, and the message gave the empty-micro-batch
    advice (found in review of a user with uneven data)."""
    for msg in _words_of_counts(stage, [2, 3]):
        assert "in micro-batch 0 of 2, rank 1 " in msg and "in micro-batch 0 of 3" in msg, msg
        assert "The ranks' train_step(micro_batches=...) differ (rank(s) [0] run 2; rank(s) [1] run 3)" in msg, msg
        assert "out.sum() * 0.0" not in msg, msg


@pytest.mark.parametrize("stage", [2, 3])
def test_a_loss_that_reads_no_unit_on_one_rank_is_told_the_way_out(stage):
    """One micro-batch, rank 1's batch empty and its loss a constant without the model: at stages
    2-3 (gather="on_use") rank 0 gathers or reduces a unit rank 1 never reaches, `DivergentPaths`
    on both, and the words now give the way out they give at k > 1 (found in review: none was
    given at k = 1). The way out trains as stage 0 does."""
    errors = _errors(stage, 2, 1, [None, 0], _constant_on_empty)
    assert sorted(errors) == [0, 1]
    for e in errors.values():
        msg = str(e)
        assert isinstance(e, fzero.DivergentPaths), msg
        assert "rank 1 had finished its backward" in msg, msg
        assert "Rank(s) [1] finished their backward where the others still gather or reduce" in msg, msg
        assert "out.sum() * 0.0" in msg, msg
    ways = [_run(s, 2, 1, [None, 0], _model_loss) for s in (stage, 0)]
    for (p, _), (p0, _) in zip(*ways):
        assert_equal_leaves(p, p0, f"stage {stage} vs stage 0")
