"""Batches that are not what the step was made for, found by a new-user walkthrough: each failed
with torch's (or Python's) bare error from inside the loss, naming no step setting.

- `micro_batches=1` given a list of micro-batches (`[(x, y)]`: the user read "micro_batches" and
  passed a list of one): the loss's `x, y = batch` raised "not enough values to unpack". The
  loss's error now carries a note naming what was given, what `micro_batches=1` takes and the
  way out; likewise a micro-batch that is itself such a list at k > 1, and `ConfigError`'s
  message for a batch that is not a list or tuple of k micro-batches (a list of another length,
  a stacked tensor, a dict, one batch `(x, y, m)`, an iterator) now names what was given and
  the way out.
- A precision policy (`fzero.Precision(torch.bfloat16, ...)`) given an uncast float32 batch: the
  policy casts the params, not the batch (README, "Mixed precision"; unlike FSDP2's
  `MixedPrecisionPolicy`, whose `cast_forward_inputs` defaults to True), so the first matrix
  product raised torch's "mat1 and mat2 must have the same dtype". The error now carries a note
  naming the batch leaf, its dtype and shape, the compute dtype and the way out, in the step
  and in `fzero.evaluate`. Both notes are made on the error path only.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import fzero
import fzero._src.precision as precision
import fzero._src.step as step_module
from fzero import optim

BF16 = fzero.Precision(torch.bfloat16, torch.float32)


def _params():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 8, generator=g), "head": torch.randn(8, 3, generator=g)}


def _batch(seed=1, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(4, 8, generator=g).to(dtype), torch.randint(0, 3, (4,), generator=g)


def _loss(p, batch):  # the README's loss: one batch (x, y)
    x, y = batch
    return F.cross_entropy(torch.tanh(x @ p["w"]) @ p["head"], y.long())


def _run(mesh, k, batch, stage=0, precision=None, loss=_loss, evaluate=False):
    """On one rank of `mesh`: one step (or one evaluation) on `batch`; the error it raised as
    `(type name, message, fzero's notes)`, or `("ok", loss)`."""
    state = fzero.init(_params(), optim.sgd(0.1), stage=stage, mesh=mesh,
                       **({} if precision is None else {"precision": precision}))
    try:
        if evaluate:
            return "ok", fzero.evaluate(loss)(state, batch)
        return "ok", fzero.train_step(loss, micro_batches=k)(state, batch)[1].loss
    except Exception as e:
        return type(e).__name__, str(e), [n for n in getattr(e, "__notes__", []) if n.startswith("fzero: ")]


def _sim(k, batch, **kw):
    mesh = fzero.SimMesh(1)
    return mesh.run(lambda: _run(mesh, k, batch, **kw))[0]


# -- micro_batches=k given something that is not k micro-batches --------------------------------


def test_a_list_of_one_batch_with_micro_batches_1_says_so_on_the_losss_error():
    """`[(x, y)]` with micro_batches=1: the loss's own error, with a note naming micro_batches=1,
    what was given (a list of 1, its structure) and the way out; a list of 2 batches names
    micro_batches=2 as the way out. Before: the bare ValueError / TypeError, no note."""
    x, y = _batch()
    kind, msg, notes = _sim(1, [(x, y)])
    assert kind == "ValueError" and "not enough values to unpack" in msg, msg
    assert len(notes) == 1, notes
    assert "micro_batches=1" in notes[0] and "[(float32[4, 8], int64[4])], a list of 1 entry" in notes[0], notes
    assert "pass the batch itself, step(state, batches[0])" in notes[0], notes

    kind, msg, notes = _sim(1, [(x, y), _batch(2)])
    assert kind == "TypeError", msg
    assert len(notes) == 1 and "a list of 2 entries of one structure" in notes[0], notes
    assert "train_step(..., micro_batches=2)" in notes[0], notes


def test_the_list_note_is_only_where_the_batch_looks_like_a_list_of_micro_batches():
    """At k = 1 a batch of tensors `(x, y)`, or of containers of different structures, whose loss
    raises gets no micro-batch note; nor does an error of fzero's own class."""
    x, y = _batch()

    def broken(p, batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 7x8)")

    assert _sim(1, (x, y), loss=broken)[2] == []
    assert _sim(1, [(x, y), (x,)], loss=broken)[2] == []  # entries of two structures: a batch of its own

    def refusing(p, batch):
        raise fzero.ConfigError("refused by the loss")

    kind, _, notes = _sim(1, [(x, y)], loss=refusing)
    assert kind == "ConfigError" and notes == [], notes


def test_a_micro_batch_that_is_itself_a_list_of_micro_batches_says_so():
    """micro_batches=2 given `[[(x0, y0)], [(x1, y1)]]`: the loss raises on micro-batch 0, and its
    note says that micro-batch is itself a list of micro-batches and the form step takes. Before:
    "the loss raised on micro-batch 0 of 2" alone."""
    kind, msg, notes = _sim(2, [[_batch(1)], [_batch(2)]])
    assert kind == "ValueError", msg
    assert len(notes) == 1 and "micro-batch 0 of 2 (micro_batches=2), which is itself a list of 1" in notes[0], notes
    assert "[(float32[4, 8], int64[4])]" in notes[0] and "not [[(x0, y0)], [(x1, y1)]]" in notes[0], notes


@pytest.mark.parametrize("given, words", [
    ([_batch(1), _batch(2), _batch(3)], ["got a list of 3, [(float32[4, 8], int64[4]), (float32[4, 8], int64[4]), "
                                         "(float32[4, 8], int64[4])]", "train_step(..., micro_batches=3)"]),
    (torch.stack([_batch(1)[0], _batch(2)[0]]), ["got a tensor float32[2, 4, 8]", "list(batch.unbind(0))",
                                                 "list(batch.chunk(2))"]),
    ({"x": _batch()[0], "y": _batch()[1]}, ["got a dict of 2 keys, {'x': float32[4, 8], 'y': int64[4]}",
                                            "make the step with micro_batches=1"]),
    ((*_batch(), torch.ones(4, dtype=torch.bool)), ["got a tuple of 3, (float32[4, 8], int64[4], bool[4]): one batch "
                                                    "passed whole", "x.chunk(2)", "micro_batches=1"]),
    (iter([_batch(1), _batch(2)]), ["got a list_iterator", "list(batches)"]),
])
def test_a_batch_that_is_not_k_micro_batches_names_what_was_given_and_the_way_out(given, words):
    """micro_batches=2 given a list of 3, a stacked tensor, a dict, one batch of 3 tensors or an
    iterator: `ConfigError` naming micro_batches=2, the form it takes, what was given (type,
    length or shape, structure) and the way out. Before: "got a list of 3", "got a Tensor",
    "got a dict", "got a list_iterator" and no way out."""
    kind, msg, _ = _sim(2, given)
    assert kind == "ConfigError", msg
    assert msg.startswith("micro_batches=2: step(state, batches) needs a list or tuple of 2 micro-batches, each what "
                          "the loss takes ([(x0, y0), (x1, y1), ...]), "), msg
    for w in words:
        assert w in msg, (w, msg)


# -- a precision policy given an uncast batch ----------------------------------------------------


@pytest.mark.parametrize("stage", [0, 3])
def test_an_fp32_batch_under_a_bf16_policy_is_named_on_torchs_dtype_error(stage):
    """`Precision(torch.bfloat16, ...)` and an fp32 `x`: torch's dtype error as before, with a note
    naming the leaf, its dtype and shape, the compute dtype, that the policy casts the params
    and not the batch, and the cast to make; the cast made, the same step runs. Before: torch's
    "expected m1 and m2 to have the same dtype" alone."""
    x, y = _batch()
    kind, msg, notes = _sim(1, (x, y), stage=stage, precision=BF16)
    assert kind == "RuntimeError" and "dtype" in msg, msg
    assert len(notes) == 1, notes
    assert ("leaf '0' (float32[4, 8]) of the batch is not in torch.bfloat16, the dtype the params reach the loss in"
            in notes[0]), notes
    assert "casts the params, not the batch" in notes[0] and "x.to(torch.bfloat16)" in notes[0], notes
    assert _sim(1, (x.to(torch.bfloat16), y), stage=stage, precision=BF16)[0] == "ok"


def test_the_dtype_note_names_the_micro_batch_and_evaluate_gets_it_too():
    """micro_batches=2, fp32 micro-batches: the note names micro-batch 0's leaf, beside the note
    naming the micro-batch the loss raised on. `fzero.evaluate` of the same loss on an fp32 batch
    gets the note, worded for its fn."""
    x, y = _batch()
    kind, _, notes = _sim(2, [(x, y), _batch(2)], precision=BF16)
    assert kind == "RuntimeError"
    assert notes[0] == "fzero: the loss raised on micro-batch 0 of 2 (micro_batches=2)", notes
    assert len(notes) == 2 and "leaf '0' (float32[4, 8]) of micro-batch 0 is not in torch.bfloat16" in notes[1], notes
    kind, msg, notes = _sim(1, (x, y), stage=3, precision=BF16, evaluate=True)
    assert kind == "RuntimeError" and "dtype" in msg, msg
    assert len(notes) == 1 and "the dtype the params reach evaluate's fn in" in notes[0], notes


def test_the_dtype_note_is_only_for_dtype_errors_of_batch_leaves_in_no_compute_dtype():
    """No note for torch's dtype error where every floating batch leaf is in the params' compute
    dtype (an int64-only batch; a float leaf already bf16), nor for an error not about dtypes;
    without a policy, bf16 params given as they are and an fp32 input get the note naming the
    params' own dtype."""
    x, y = _batch()

    def mixed(p, batch):  # a dtype error of the loss's own making
        return _loss(p, batch) + (torch.ones(2, 2) @ torch.ones(2, 2, dtype=torch.float64)).sum()

    assert _sim(1, (x.to(torch.bfloat16), y), precision=BF16, loss=mixed)[2] == []

    def shapes(p, batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 7x8)")

    assert _sim(1, (x, y), precision=BF16, loss=shapes)[2] == []
    mesh = fzero.SimMesh(1)

    def bf16_params():
        state = fzero.init({k: v.to(torch.bfloat16) for k, v in _params().items()}, optim.sgd(0.1), stage=0, mesh=mesh)
        with pytest.raises(RuntimeError) as caught:
            fzero.train_step(_loss)(state, (x, y))
        return [n for n in caught.value.__notes__ if n.startswith("fzero: ")]

    (notes,) = mesh.run(bf16_params)
    assert len(notes) == 1 and "(the params' own dtype, as given to fzero.init)" in notes[0], notes


def test_torchs_dtype_errors_are_the_ones_the_note_reads():
    """The words the note looks for are in torch's errors for an fp32 input meeting bf16 params
    (matmul, linear, conv, layer norm, bmm, attention, an RNN), and not in a shape error."""
    b = torch.bfloat16
    x4 = torch.randn(2, 4, 8, 8)
    ops = [lambda: torch.randn(2, 3) @ torch.randn(3, 2, dtype=b),
           lambda: F.linear(torch.randn(2, 3), torch.randn(4, 3, dtype=b), torch.randn(4, dtype=b)),
           lambda: F.conv2d(x4, torch.randn(3, 4, 3, 3, dtype=b), torch.randn(3, dtype=b)),
           lambda: F.conv2d(x4, torch.randn(3, 4, 3, 3, dtype=b)),
           lambda: F.layer_norm(torch.randn(2, 3), (3,), torch.randn(3, dtype=b), torch.randn(3, dtype=b)),
           lambda: torch.bmm(torch.randn(2, 3, 3), torch.randn(2, 3, 3, dtype=b)),
           lambda: F.scaled_dot_product_attention(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4, dtype=b),
                                                  torch.randn(1, 2, 3, 4, dtype=b)),
           lambda: torch.nn.LSTM(3, 4).to(b)(torch.randn(2, 1, 3))]
    batch = (torch.randn(2, 3), torch.zeros(2, dtype=torch.long))
    for op in ops:
        with pytest.raises((RuntimeError, ValueError)) as caught:
            op()
        assert precision.batch_dtype_note(str(caught.value), batch, {b}, b), caught.value
    with pytest.raises(RuntimeError) as caught:
        torch.randn(2, 3) @ torch.randn(4, 2)
    assert precision.batch_dtype_note(str(caught.value), batch, {b}, b) == ""


def test_a_step_that_succeeds_builds_no_note(monkeypatch):
    """The notes are made on the error path only: a step under a policy, with micro-batches, runs
    with the note builders made to raise."""
    def boom(*args, **kwargs):
        raise AssertionError("a note was built in a step that succeeded")

    for name in ("note_batch_dtypes", "_like_micro_batches", "_literal"):
        monkeypatch.setattr(step_module, name, boom)
    x, y = _batch()
    assert _sim(2, [(x.to(torch.bfloat16), y)] * 2, stage=3, precision=BF16)[0] == "ok"


# -- over gloo ------------------------------------------------------------------------------------


def both_cases_on(mesh):
    """On a pool worker: `[(x, y)]` with micro_batches=1, and an fp32 batch under the bf16 policy
    at stage 3 (the loss raises after its first gather)."""
    return _run(mesh, 1, [_batch()], stage=3), _run(mesh, 1, _batch(), stage=3, precision=BF16)


@pytest.mark.dist
def test_over_gloo_every_rank_gets_both_notes(dist2):
    """DistMesh (gloo, 2 workers): each rank raises the loss's error with its note, and no rank is
    left waiting."""
    for listed, uncast in dist2.run(both_cases_on, timeout=60):
        assert listed[0] == "ValueError" and len(listed[2]) == 1 and "micro_batches=1" in listed[2][0], listed
        assert uncast[0] == "RuntimeError" and len(uncast[2]) == 1, uncast
        assert "leaf '0' (float32[4, 8]) of the batch is not in torch.bfloat16" in uncast[2][0], uncast


def test_a_dtype_error_about_integer_targets_gets_no_note():
    """cross_entropy's error for float class labels under a bf16 policy is about the targets' kind,
    not the batch meeting the params: no note telling every floating leaf to be cast to bfloat16
    (found in review)."""
    b = torch.bfloat16
    with pytest.raises(RuntimeError) as caught:
        F.cross_entropy(torch.randn(2, 3, dtype=b), torch.tensor([0.0, 1.0], dtype=b).view(2).to(torch.float32))
    assert "long" in str(caught.value).lower(), caught.value  # non-vacuous: torch's words name Long
    batch = (torch.randn(2, 3).to(b), torch.tensor([0.0, 1.0]))
    assert precision.batch_dtype_note(str(caught.value), batch, {b}, b) == ""


def test_no_batch_note_beside_applys_buffer_note():
    """A BatchNorm's fp32 buffers under a bf16 policy, the loss casting its input itself: torch's
    dtype error gets `apply`'s buffer note (row 106) and no batch note, which told a loss that
    casts its input to cast it (found in review)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 3))
    params, apply, info = fzero.from_module(model)
    mesh = fzero.SimMesh(1)

    def rank(batch):
        state = fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh, precision=BF16)
        step = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0].to(torch.bfloat16)).float(), b[1]))
        with pytest.raises(RuntimeError) as e:
            step(state, batch)
        return getattr(e.value, "__notes__", [])

    notes = mesh.run(rank, [(_batch(),)])[0]
    assert any(n.startswith("fzero: the params reach the module in torch.bfloat16, but not its buffers") for n in notes)
    assert not any("of the batch" in n for n in notes), notes
