"""`train_step`'s non-finite path and its step counter, on SimMesh.

- A NaN or inf in one rank's local gradient or loss stops every rank with `NonFiniteError`,
  naming the leaves whose reduced gradient is non-finite and the rank(s) of a non-finite loss,
  and with `locate_nonfinite=True` the rank(s) and bucket(s) of a non-finite local gradient
  (`on_nonfinite="raise"`, the default); with `on_nonfinite="skip"` the step returns the input
  state itself, unchanged, and `Metrics.skipped`. Without `locate_nonfinite` the units read no
  local gradient for it: the reduced gradient's `‖g‖²` finds the step (proofs/stages.md §1.3).
- A loss that raises on one rank stops every rank (the others are told which rank failed).
- `state.step` is an int64 0-d tensor counting the updates applied: each non-skipped step adds
  one, a skipped step none; `Metrics.step` is the input state's count (0 for the first step).
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given

import fzero
from fzero import optim
from fzero.testing import examples


def _nan_setup(stage, on_nonfinite, locate=True, loss_fn=None, bad=float("nan")):
    params = {"a": torch.ones(5), "b": torch.ones(3)}
    mesh = fzero.SimMesh(3)
    opt = optim.adamw(0.1)

    def sum_loss(p, c):
        return (p["a"] * c).sum() + p["b"].sum()

    def rank_fn(c):
        state = fzero.init(params, opt, stage=stage, mesh=mesh)
        step = fzero.train_step(loss_fn or sum_loss, on_nonfinite=on_nonfinite, locate_nonfinite=locate)
        new, m = step(state, c)
        return state, new, m

    batches = [torch.ones(5), torch.tensor([1.0, bad, 1, 1, 1]), torch.ones(5)]
    return mesh, rank_fn, batches


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nonfinite_gradient_raises_naming_rank_and_leaf(stage, bad):
    """Rank 1's loss and local gradient are NaN (or inf: a mutation audit's survivor named only
    the gradient of an inf loss): both are named (before, with the gradient located, the loss was
    not; found in review)."""
    mesh, rank_fn, batches = _nan_setup(stage, "raise", bad=bad)
    match = r"rank\(s\) \[1\] \(rank 1: non-finite loss and local gradient in bucket\(s\) " \
            r"\['default/float32/default'\]\); " \
            r"the reduced gradient is non-finite in 'a'\."
    with pytest.raises(fzero.NonFiniteError, match=match):
        mesh.run(rank_fn, [(c,) for c in batches])


def _first_term(p, c):
    """A finite loss whose gradient is NaN where `c` is: d/da of `(a * c)[0]` is `c * [1, 0, ...]`,
    and `NaN * 0` is NaN."""
    return (p["a"] * c)[0] + p["b"].sum()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nonfinite_gradient_is_found_in_the_reduced_norm(stage):
    """Rank 1's loss is finite and its local gradient holds a NaN. Unlocated (the default), no
    unit reads a local gradient for it: the reduced gradient's ‖g‖² finds the step on every rank,
    and the error names the leaf and says the ranks were not checked; located, it names rank 1 and
    its bucket."""
    mesh, rank_fn, batches = _nan_setup(stage, "raise", locate=False, loss_fn=_first_term)
    match = (r"step 0: every rank's loss is finite but the reduced gradient is not \(sum of squares nan; the reduced "
             r"gradient is non-finite in 'a'\): some rank's local gradient held a NaN or inf, or the sum over ranks "
             r"overflowed \(local gradients were not checked: train_step\(locate_nonfinite=True\)")
    with pytest.raises(fzero.NonFiniteError, match=match):
        mesh.run(rank_fn, [(c,) for c in batches])
    mesh, rank_fn, batches = _nan_setup(stage, "raise", locate=True, loss_fn=_first_term)
    match = r"rank\(s\) \[1\] \(rank 1: non-finite local gradient in bucket\(s\) \['default/float32/default'\]\); "
    with pytest.raises(fzero.NonFiniteError, match=match):
        mesh.run(rank_fn, [(c,) for c in batches])


@pytest.mark.parametrize("mode", ["each", "once"])
@pytest.mark.parametrize("where", [0, 1])
def test_a_nonfinite_local_gradient_in_any_micro_batch_is_located(where, mode):
    """Located, with two micro-batches: rank 1's local gradient holds a NaN in micro-batch `where`
    only (its loss finite, `_first_term`). The error names rank 1 and its bucket whichever
    micro-batch it was: the step ORs the micro-batches' reports. (Reading only the last
    micro-batch's report, the step said instead that every local gradient was finite and the sum
    over ranks overflowed, and the suite passed: no located test had more than one micro-batch.)"""
    mesh = fzero.SimMesh(2)
    stage = 1 if mode == "once" else 2

    def rank_fn(r):
        state = fzero.init({"a": torch.ones(5), "b": torch.ones(3)}, optim.sgd(0.1), stage=stage, mesh=mesh)
        step = fzero.train_step(_first_term, micro_batches=2, accumulate=mode, locate_nonfinite=True)
        micro = [torch.ones(5), torch.ones(5)]
        if r == 1:
            micro[where] = torch.tensor([1.0, float("nan"), 1, 1, 1])
        step(state, micro)

    match = r"rank\(s\) \[1\] \(rank 1: non-finite local gradient in bucket\(s\) \['default/float32/default'\]\); "
    with pytest.raises(fzero.NonFiniteError, match=match):
        mesh.run(rank_fn, [(0,), (1,)])


@pytest.mark.parametrize("locate", [True, False])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_nonfinite_step_skipped_leaves_state_unchanged(stage, locate):
    for loss_fn in (None, _first_term):
        mesh, rank_fn, batches = _nan_setup(stage, "skip", locate, loss_fn)
        for before, after, m in mesh.run(rank_fn, [(c,) for c in batches]):
            assert m.skipped and after.step == before.step == 0
            assert all(torch.equal(x, y) for x, y in zip(before.params, after.params))
            assert after is before


def test_nonfinite_loss_on_one_rank_raises_everywhere():
    params = {"a": torch.ones(4)}
    mesh = fzero.SimMesh(2)
    opt = optim.sgd(0.1)

    def rank_fn(scale):
        state = fzero.init(params, opt, stage=3, mesh=mesh)
        step = fzero.train_step(lambda p, c: p["a"].sum() * 0 + c)
        return step(state, scale)

    with pytest.raises(fzero.NonFiniteError, match=r"rank 0: non-finite loss"):
        mesh.run(rank_fn, [(torch.tensor(float("inf")),), (torch.tensor(1.0),)])


def test_loss_error_on_one_rank_stops_every_rank():
    params = {"a": torch.ones(4)}
    mesh = fzero.SimMesh(3)
    opt = optim.sgd(0.1)

    def loss_fn(p, c):
        if c.shape != (4,):
            raise ValueError(f"batch of shape {list(c.shape)} rejected")
        return (p["a"] * c).sum()

    def rank_fn(c):
        state = fzero.init(params, opt, stage=3, mesh=mesh)
        return fzero.train_step(loss_fn)(state, c)

    with pytest.raises(ValueError, match="rejected") as info:
        mesh.run(rank_fn, [(torch.ones(4),), (torch.ones(5),), (torch.ones(4),)])
    assert any("rank 1" in note for note in info.value.__notes__)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_step_counts_updates_and_metrics_report_the_input_count(stage):
    """Three steps, the middle one non-finite on rank 1 and skipped: `state.step` goes 0, 1, 1, 2
    and `Metrics.step` reads 0, 1, 1 (the input state's count, not the count after the update);
    each step leaves its input state's counter as it was."""
    params = {"a": torch.ones(5), "b": torch.ones(3)}
    mesh, opt = fzero.SimMesh(2), optim.adamw(0.1)

    def loss_fn(p, c):
        return (p["a"] * c).sum() + p["b"].sum()

    def rank_fn(*batches):
        state = fzero.init(params, opt, stage=stage, mesh=mesh)
        step = fzero.train_step(loss_fn, on_nonfinite="skip")
        counts, reported, skipped = [state.step], [], []
        for c in batches:
            before = state
            state, m = step(state, c)
            assert before.step.item() == counts[-1].item()  # the input state's counter is not modified
            counts.append(state.step)
            reported.append(m.step)
            skipped.append(m.skipped)
        return counts, reported, skipped

    nan = torch.tensor([1.0, float("nan"), 1, 1, 1])
    batches = [(torch.ones(5), torch.ones(5), torch.ones(5)), (torch.ones(5), nan, torch.ones(5))]
    for counts, reported, skipped in mesh.run(rank_fn, batches):
        assert all(c.dtype == torch.int64 and c.shape == () for c in counts)
        assert [c.item() for c in counts] == [0, 1, 1, 2]
        assert reported == [0, 1, 1] and all(type(s) is int for s in reported)
        assert skipped == [False, True, False]


@examples(40)
@given(stage=st.integers(0, 3), n=st.integers(2, 4), rank=st.data(), where=st.integers(0, 4),
       value=st.sampled_from([float("nan"), float("inf"), float("-inf")]), clean=st.booleans())
def test_locating_changes_only_the_message(stage, n, rank, where, value, clean):
    """Property: the verdict is decided by the reduced gradient, so `locate_nonfinite` changes
    nothing but the error's words. One rank's batch holds a NaN or ±inf at a drawn place (its loss
    finite, its local gradient not: `_first_term`), or no rank's does (`clean`); with and without
    locating, the step is skipped (state unchanged) or taken alike, to the bit."""
    bad = rank.draw(st.integers(0, n - 1))
    params = {"a": torch.linspace(-1, 1, 5), "b": torch.ones(3)}
    mesh = fzero.SimMesh(n)

    def batch(r):
        c = torch.arange(1.0, 6.0) + r
        if not clean and r == bad:
            c[where] = value
        return c

    def run(locate):
        def rank_fn(c):
            state = fzero.init(params, optim.adamw(0.1), stage=stage, mesh=mesh)
            new, m = fzero.train_step(_first_term, on_nonfinite="skip", locate_nonfinite=locate)(state, c)
            return m.skipped, new is state, fzero.gather(new), m.loss, m.grad_norm
        return mesh.run(rank_fn, [(batch(r),) for r in range(n)])

    located, unlocated = run(True), run(False)
    # d/da of (a * c)[0] is c * [1, 0, 0, 0, 0]: NaN at `where` > 0 (NaN or ±inf times 0), and at
    # where == 0 the value itself (the loss then non-finite too): every drawn place breaks the step
    for (s1, same1, p1, l1, g1), (s2, same2, p2, l2, g2) in zip(located, unlocated):
        assert s1 == s2 == (not clean) and same1 == same2 == (not clean)
        assert all(torch.equal(p1[k], p2[k]) for k in p1)
        assert (l1 == l2 or math.isnan(l1) and math.isnan(l2)) and (g1 == g2 or math.isnan(g1) and math.isnan(g2))


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("micro", [1, 2])
def test_the_metrics_loss_is_the_mean_of_the_ranks_losses(n, micro):
    """`Metrics.loss` is the mean over ranks (and micro-batches) of the loss, on every rank, as a
    DDP user averages their ranks' losses: rank r's loss is the constant 1 + r (its micro-batches
    r + 0.5 and r + 1.5). A mutant that left the sum of the ranks' losses undivided passed every
    other test (found by a mutation audit: the stage properties compare stages with each other,
    the DDP comparisons params)."""
    mesh = fzero.SimMesh(n)

    def rank():
        state = fzero.init({"w": torch.zeros(4)}, optim.sgd(0.1), stage=1, mesh=mesh)
        step = fzero.train_step(lambda p, x: (p["w"] * 0 * x).sum() + x[0], micro_batches=micro)
        r = mesh.rank
        batch = torch.full((4,), 1.0 + r) if micro == 1 else [torch.full((4,), r + 0.5), torch.full((4,), r + 1.5)]
        return float(step(state, batch)[1].loss)

    want = sum(1.0 + r for r in range(n)) / n  # 1.5 and 2.0: exact
    assert mesh.run(rank) == [want] * n
