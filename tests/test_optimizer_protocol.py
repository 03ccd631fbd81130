"""A custom optimizer's side of the protocol (`fzero.optim.Optimizer`), checked where it is broken.

What `update` / `update_` / a prepared launch return is checked after every bucket's update
(`update.check_update_result`): a pair (pure form), the new param of the input param's shape,
dtype and device, the new state a NamedTuple of the input state's fields (its class, or one made
anew with the same fields) with each field of the input field's shape, dtype and device. Before
(found in review, N = 2), a wrong result failed as a bare unpacking error, a step later inside
the user's update, in torch's `setStorage`, as a false `DivergentPaths`, or not at all: params
silently truncated to integers or widened to float64, a checkpoint that could never be loaded.
And each state field's shape is checked against its spec kind at `fzero.init` (a 0-d step count
of spec "leaf" trained, then `checkpoint.save` failed naming no field). A valid custom optimizer
(Lion-like) runs at every stage, pure and donating, on the device and offloaded.
"""

from __future__ import annotations

import collections
import re
from typing import NamedTuple

import pytest
import torch

import fzero
import fzero.optim as fo

STAGES = (0, 1, 2, 3)
BUCKET = r"\(bucket 'a/float32/default', leaves \['a\.b', 'a\.w'\]\)"  # the first bucket updated


class LionState(NamedTuple):
    m: torch.Tensor


class OtherState(NamedTuple):  # another NamedTuple, of other fields: refused
    v: torch.Tensor


class SameFields(NamedTuple):  # another NamedTuple of LionState's fields: taken
    m: torch.Tensor


def make_params(dtype: torch.dtype = torch.float32) -> dict:
    g = torch.Generator().manual_seed(0)
    return {"a": {"w": torch.randn(6, 5, generator=g).to(dtype), "b": torch.randn(5, generator=g).to(dtype)},
            "c": {"w": torch.randn(5, 3, generator=g).to(dtype)}}


def units(path: str) -> str:
    return path.split(".")[0]


def loss_fn(p: dict, x: torch.Tensor) -> torch.Tensor:
    h = torch.tanh(x.to(p["a"]["w"].dtype) @ p["a"]["w"] + p["a"]["b"])
    return ((h @ p["c"]["w"]) ** 2).float().mean()


def batch(rank: int, t: int = 0) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * t + rank))


# -- a Lion-like optimizer, valid, and the same with one broken result --------------------------

def lion(bad: str | None = None, lr: float = 0.01, b1: float = 0.9, b2: float = 0.99) -> fo.Optimizer:
    """Lion over the used pieces, pure (`update`), in place (`update_`) and two-phase (`prepare_`);
    `bad` names what its result breaks."""
    schedule = fo.as_schedule(lr)

    def init(param, L):
        return LionState(torch.zeros_like(param))

    def spec(s):
        return LionState("shard")

    def step_(g, s, p, ctx):  # writes p and s.m
        eta = fo.group_lr(schedule, ctx)
        for a, b, used in fo.runs(ctx, ctx.used):
            if used:
                c = s.m[a:b] * b1 + g[a:b] * (1 - b1)
                p[a:b].add_(torch.sign(c), alpha=-eta)
                s.m[a:b].mul_(b2).add_(g[a:b], alpha=1 - b2)

    def broken_state(s):
        m = s.m
        return {"none_state": None, "tuple_state": (m,), "dict_state": {"m": m}, "other_namedtuple": OtherState(m),
                "fp64_state": LionState(m.double()), "short_state": LionState(m[:-1]),
                "2d_state": LionState(m.view(1, -1)),
                "fresh_class": collections.namedtuple("LionState", ["m"])(m),  # valid: a class made anew
                "same_fields": SameFields(m)}.get(bad, s)  # valid: another class of the same fields

    def update(g, s, p, ctx):
        p, s = p.clone(), LionState(s.m.clone())
        step_(g, s, p, ctx)
        out = {"arity1": p, "arity3": (p, s, 0), "short_param": (p[:-1], s), "2d_param": (p.view(1, -1), s),
               "int_param": (p.long(), s), "fp64_param": (p.double(), s), "fp16_param": (p.half(), s)}
        return out.get(bad, (p, broken_state(s)))

    def update_(g, s, p, ctx):
        step_(g, s, p, ctx)
        return broken_state(s)

    def prepare_(s, p, ctx):
        return fo.Launch(run=lambda g, found_inf: update_(g, s, p, ctx), check=lambda g: None)

    return fo.Optimizer(init, update, spec, update_, prepare_=prepare_, lr=schedule)


def run_steps(opt: fo.Optimizer, stage: int, steps: int = 2, donate: bool = False, n: int = 2,
              dtype: torch.dtype = torch.float32, offload: fzero.Offload | None = None, expect: str | None = None):
    """`steps` steps of `opt` at `stage` on SimMesh(n); `expect`: the `OptimizerError` (a regex) the
    first step raises on every rank, else every rank's gathered params after the steps."""
    params = make_params(dtype)

    def rank_fn():
        state = fzero.init(params, opt, stage=stage, mesh=mesh, units=units, offload=offload)
        step = fzero.train_step(loss_fn, donate=donate)
        if expect is not None:
            with pytest.raises(fo.OptimizerError, match=expect):
                step(state, batch(mesh.rank))
            return None
        for t in range(steps):
            state, _ = step(state, batch(mesh.rank, t))
        return fzero.gather(state)

    mesh = fzero.SimMesh(n)
    return mesh.run(rank_fn)


def shard(stage: int, numel: int = 35, n: int = 2) -> int:
    """The size of the flat piece the update of a bucket of `numel` elements gets (padded to n)."""
    padded = -(-numel // n) * n
    return padded if stage == 0 else padded // n


# -- 1. the update's result --------------------------------------------------------------------

def pure_expected(bad: str, s: int) -> str:
    """The message (regex) of a broken pure result, for a first-bucket piece of `s` elements."""
    field = "state field 'm' as "
    want_s = rf"expected float32\[{s}\] on cpu"
    return {
        "arity1": r"Optimizer.update returned torch.Tensor, expected the pair \(new param shard, new state\)",
        "arity3": r"Optimizer.update returned tuple of 3 values, expected the pair \(new param shard, new state\)",
        "short_param": rf"Optimizer.update returned the new param shard as float32\[{s - 1}\] on cpu, {want_s}",
        "2d_param": rf"Optimizer.update returned the new param shard as float32\[1, {s}\] on cpu, {want_s}",
        "int_param": rf"Optimizer.update returned the new param shard as int64\[{s}\] on cpu, {want_s}",
        "fp64_param": rf"Optimizer.update returned the new param shard as float64\[{s}\] on cpu, {want_s}",
        **state_expected("Optimizer.update", s, field),
    }[bad]


def state_expected(form: str, s: int, field: str = "state field 'm' as ") -> dict[str, str]:
    want = rf"expected float32\[{s}\] on cpu"
    cls = (r"expected a NamedTuple of the input state's fields, as its own class "
           r"tests\.test_optimizer_protocol\.LionState\('m',\)")
    return {
        "none_state": rf"{form} returned the new state as NoneType None, {cls}",
        "tuple_state": rf"{form} returned the new state as a tuple of 1 values, {cls}",
        "dict_state": rf"{form} returned the new state as a dict of keys \['m'\], {cls}",
        "other_namedtuple": rf"{form} returned the new state as tests\.test_optimizer_protocol\.OtherState\('v',\), "
                            rf"{cls}",
        "fp64_state": rf"{form} returned {field}float64\[{s}\] on cpu, {want}",
        "short_state": rf"{form} returned {field}float32\[{s - 1}\] on cpu, {want}",
        "2d_state": rf"{form} returned {field}float32\[1, {s}\] on cpu, {want}",
    }


OPTIMIZER = r"optimizer 'lion' \(update lion\.<locals>\.update_? \(.*test_optimizer_protocol\.py:\d+\)\): "
LAUNCH = r"optimizer 'lion' \(the launch of prepare_ lion\.<locals>\.prepare_ \(.*test_optimizer_protocol\.py:\d+\)\): "
PURE_BAD = ("arity1", "arity3", "none_state", "tuple_state", "dict_state", "other_namedtuple", "short_param",
            "2d_param", "int_param", "fp64_param", "fp64_state", "short_state", "2d_state")
STATE_BAD = ("none_state", "tuple_state", "dict_state", "other_namedtuple", "fp64_state", "short_state", "2d_state")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("bad", PURE_BAD)
def test_a_broken_pure_update_result_names_optimizer_bucket_field_got_and_expected(bad, stage):
    """Before: ValueError (unpacking), TypeError, an AttributeError a step later, torch's
    `setStorage ... out of bounds`, a false `DivergentPaths`, or nothing (int / float64 params)."""
    expect = OPTIMIZER + pure_expected(bad, shard(stage)) + r".*" + BUCKET
    run_steps(lion(bad), stage, expect=expect)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("bad", STATE_BAD)
def test_a_broken_in_place_update_result_names_optimizer_bucket_field_got_and_expected(bad, stage):
    """The donating step: `update_` (no `prepare_`) and a prepared launch (`prepare_`), each
    returning a broken new state."""
    opt = lion(bad)
    form = {"update_": "Optimizer\\.update_", "launch": "a prepared launch"}
    for kind, o in (("update_", opt._replace(update_=opt.update_)), ("launch", opt)):
        assert (o.prepare_ is None) == (kind == "update_")
        who = OPTIMIZER if kind == "update_" else LAUNCH  # a launch's result: named by its prepare_
        expect = who + state_expected(form[kind], shard(stage))[bad] + r".*" + BUCKET
        run_steps(o, stage, donate=True, expect=expect)


@pytest.mark.parametrize("stage", STAGES)
def test_a_half_param_returned_for_bfloat16_params_is_refused(stage):
    """Before: stages 0 and 3 kept the fp16 param (gather returned fp16), stages 1-2 cast it back."""
    s = shard(stage)
    expect = (OPTIMIZER + rf"Optimizer.update returned the new param shard as float16\[{s}\] on cpu, expected "
              rf"bfloat16\[{s}\] on cpu.*\(bucket 'a/bfloat16/default', leaves \['a\.b', 'a\.w'\]\)")
    run_steps(lion("fp16_param"), stage, dtype=torch.bfloat16, expect=expect)


def test_an_offloaded_update_is_checked_against_its_host_inputs():
    """An offloaded bucket updates host copies: its result is checked against them (a valid one
    runs, bit for bit the device run's; a float64 state field is refused)."""
    off = fzero.Offload(optimizer="cpu")
    for stage in (1, 2, 3):
        for donate in (False, True):
            host = run_steps(lion(), stage, donate=donate, offload=off)
            assert_trees_equal(host[0], run_steps(lion(), stage, donate=donate)[0])
        expect = OPTIMIZER + state_expected("Optimizer.update", shard(stage))["fp64_state"] + r".*" + BUCKET
        run_steps(lion("fp64_state"), stage, offload=off, expect=expect)


def assert_trees_equal(a: dict, b: dict) -> None:
    import optree

    for x, y in zip(optree.tree_leaves(a), optree.tree_leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


@pytest.mark.parametrize("stage", STAGES)
def test_a_valid_custom_optimizer_runs_at_every_stage_pure_and_donating(stage):
    """No false positive: the Lion-like optimizer's three forms (pure, update_, prepared launch)
    run two steps and give the same params, on every rank, every leaf moved."""
    runs = [run_steps(lion(), stage, donate=False), run_steps(lion(), stage, donate=True),
            run_steps(lion()._replace(update_=lion().update_), stage, donate=True)]
    for out in runs:
        assert_trees_equal(out[0], out[1])
    for out in runs[1:]:
        assert_trees_equal(runs[0][0], out[0])
    moved = [not torch.equal(x, y) for x, y in zip(_leaves(runs[0][0]), _leaves(make_params()))]
    assert all(moved)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["fresh_class", "same_fields"])
def test_a_new_state_of_the_input_fields_in_another_namedtuple_class_trains(kind, stage):
    """An optimizer whose update returns its state in a NamedTuple class made anew each call (same
    name, same fields: `collections.namedtuple` inside the update), or in another class of the same
    fields, trains as the one returning the input's own class, bitwise, in the three forms: nothing
    downstream reads the class, only the fields (`spec_of`, `check_state_fields`, checkpoints).
    Before (found in review): refused by `type(out) is type(state)`, with a message naming the same
    class twice, where it trained before that check."""
    want = run_steps(lion(), stage, donate=False)
    runs = [run_steps(lion(kind), stage, donate=False), run_steps(lion(kind), stage, donate=True),
            run_steps(lion(kind)._replace(update_=lion(kind).update_), stage, donate=True)]
    for out in runs:
        for got in out:
            assert_trees_equal(want[0], got)


def _leaves(tree: dict) -> list[torch.Tensor]:
    import optree

    return optree.tree_leaves(tree)


# -- 2. the state's shapes at init ------------------------------------------------------------

class StepState(NamedTuple):
    m: torch.Tensor
    t: torch.Tensor


def shaped_opt(field: str) -> fo.Optimizer:
    """SGD keeping a "shard" `m` and a "leaf" step count `t`, one of them of a wrong shape (`field`)."""

    def init(p, L):
        m = torch.zeros(p.numel() + 1) if field == "long_m" else torch.zeros_like(p)
        t = {"scalar_t": torch.zeros(()), "short_t": torch.zeros(max(L - 1, 0)), "list_t": [0.0] * L}.get(
            field, torch.zeros(L))
        return StepState(m, t)

    def spec(s):
        return StepState("shard", "leaf")

    def update(g, s, p, ctx):
        return p - 0.01 * g, StepState(s.m, s.t + 1)

    return fo.Optimizer(init, update, spec, lr=fo.as_schedule(0.01))


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("field", ["scalar_t", "short_t", "long_m", "list_t"])
def test_a_state_field_not_shaped_as_its_kind_is_refused_at_init(field, stage):
    """Before: accepted, trained, then `checkpoint.save` failed ("a 'leaf' field of 2 leaves ...
    has 2 elements, got shape []", naming no field) -- or, for a list, an AttributeError."""
    s = shard(stage)
    expect = {
        "scalar_t": r"state field 't' \(leaf\) has shape \[\], expected \[2\] .*bucket 'a/float32/default'.*\. A "
                    r"scalar \(a step count\) is a 'leaf' field \[L\], one entry per bucket leaf",
        "short_t": r"state field 't' \(leaf\) has shape \[1\], expected \[2\]",
        "long_m": rf"state field 'm' \(shard\) has shape \[{s + 1}\], expected \[{s}\] for a shard of {s} elements",
        "list_t": r"state field 't' \(leaf\) has list \[0\.0, 0\.0\], not a tensor, expected \[2\]",
    }[field]
    prefix = r"fzero\.init: optimizer 'shaped_opt' \(init shaped_opt\.<locals>\.init \(.*\)\): "
    mesh = fzero.SimMesh(2)

    def rank_fn():
        with pytest.raises(fo.OptimizerError, match=prefix + expect) as e:
            fzero.init(make_params(), shaped_opt(field), stage=stage, mesh=mesh, units=units)
        assert "(bucket 'a/float32/default' of 2 leaves: 'a.b' (float32[5]), 'a.w' (float32[6, 5]))" in str(e.value)
        fzero.init(make_params(), shaped_opt("ok"), stage=stage, mesh=mesh, units=units)  # the valid one

    mesh.run(rank_fn)


def test_the_messages_name_the_first_bucket_updated():
    """The layout these tests read: bucket 0 is 'a/float32/default' with leaves a.b and a.w, 35 elements."""
    layout = fzero.layout.plan(make_params(), 2, units=units)
    first = layout.buckets[0]
    assert first.tag == "a/float32/default"
    assert [layout.leaves[i].path for i in first.leaves] == ["a.b", "a.w"]
    assert sum(layout.leaves[i].numel for i in first.leaves) == 35
    assert re.search(BUCKET, "(bucket 'a/float32/default', leaves ['a.b', 'a.w'])")


# -- 3. whole leaves for an update that needs them (fzero.optim.whole_leaves) -------------------

def newton_schulz(G: torch.Tensor, steps: int = 3) -> torch.Tensor:
    """Muon's orthogonalisation of a 2-d update (its quintic Newton-Schulz iteration)."""
    a, b, c = 3.4445, -4.7750, 2.0315
    X = G / (G.norm() + 1e-7)
    tall = X.shape[0] > X.shape[1]
    X = X.T if tall else X
    for _ in range(steps):
        A = X @ X.T
        X = a * X + (b * A + c * A @ A) @ X
    return X.T if tall else X


def muon_direction(G: torch.Tensor) -> torch.Tensor:
    return newton_schulz(G) if G.dim() == 2 else torch.sign(G)


def muon(lr: float = 0.05, whole: bool = True) -> fo.Optimizer:
    """A Muon-like update of each leaf from its whole gradient (`fo.whole_leaves`); `whole=False`:
    the naive form, the leaf assembled from this rank's pieces alone (no `leaf_sum`)."""
    schedule = fo.as_schedule(lr)

    def init(p, L):
        return fo.EmptyState()

    def spec(s):
        return fo.EmptyState()

    def update(g, s, p, ctx):
        fo.check_shards("muon", g, p, s, spec(s), ctx)
        eta, p = fo.group_lr(schedule, ctx), p.clone()
        leaves = fo.whole_leaves(ctx if whole else ctx._replace(leaf_sum=lambda x: x), g)
        pos = {leaf: k for k, leaf in enumerate(ctx.leaves)}
        for seg in ctx.segments:
            k = pos[seg.leaf]
            if ctx.used[k]:
                u = muon_direction(leaves[k]).reshape(-1)
                p[seg.start:seg.stop].add_(u[seg.leaf_start:seg.leaf_start + seg.stop - seg.start], alpha=-eta)
        return p, s

    return fo.Optimizer(init, update, spec, lr=schedule)


def muon_by_hand(steps: int, n: int = 2, lr: float = 0.05) -> dict:
    """The same update applied to the full params, leaf by leaf, with DDP's averaged gradients
    (each rank's gradient times 1/n, summed in rank order)."""
    import optree

    p = make_params()
    for t in range(steps):
        grads = [torch.func.grad(loss_fn)(p, batch(r, t)) for r in range(n)]
        g = optree.tree_map(lambda x: x * (1.0 / n), grads[0])
        for other in grads[1:]:
            g = optree.tree_map(lambda a, b: a + b * (1.0 / n), g, other)
        p = optree.tree_map(lambda w, d: w.clone().add_(muon_direction(d), alpha=-lr), p, g)
    return p


@pytest.mark.parametrize("stage", STAGES)
def test_whole_leaves_gives_a_muon_like_update_the_full_leaf_bit_for_bit(stage):
    """At every stage, N = 2, the update built on `whole_leaves` gives DDP's params bit for bit
    (two steps); the naive one (each rank's pieces only) differs where shards cut the 2-d leaves
    (stages 1-3: a.w at element 18 of its bucket, c.w at 8) and is the same at stage 0."""
    want = muon_by_hand(2)
    got = run_steps(muon(), stage)
    assert_trees_equal(got[0], want)
    assert_trees_equal(got[1], want)
    naive = run_steps(muon(whole=False), stage)[0]
    differs = [not torch.equal(x, y) for x, y in zip(_leaves(naive), _leaves(want))]
    assert differs == ([False, False, False] if stage == 0 else [False, True, True])  # a.b (1-d), a.w, c.w


def test_whole_leaves_needs_the_leaf_shapes_and_a_flat_shard():
    ctx = fo.UpdateContext(0, fzero.ParamGroup("default"), (), (0,), (True,))
    with pytest.raises(fo.OptimizerError, match=r"whole_leaves needs ctx.leaf_shapes"):
        fo.whole_leaves(ctx, torch.zeros(4))
    with pytest.raises(fo.OptimizerError, match=r"whole_leaves: shard \[2, 2\] must be a 1-d shard"):
        fo.whole_leaves(ctx._replace(leaf_shapes=((2, 2),)), torch.zeros(2, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_whole_leaves_assembles_every_bit_signed_zeros_inf_and_nan_included(dtype):
    """Two ranks' pieces of one [2, 3] leaf (after a 1-element leaf, rank 0 holds its elements 0-2,
    rank 1 elements 3-5 then padding): the sum of their buffers (what `leaf_sum` computes at N = 2, in either
    order) is the leaf, bit for bit -- the buffer's filler -0.0 is the additive identity, so a
    -0.0 element stays -0.0 (a filler of +0.0 would make it +0.0), a +0.0 one +0.0."""
    from fzero.layout import Segment

    leaf = torch.tensor([[-0.0, 1.5, float("inf")], [float("nan"), -3.25e-3, 0.0]], dtype=dtype)
    flat = torch.cat([torch.tensor([7.0], dtype=dtype), leaf.reshape(-1)])  # leaves 0 ([1]) and 1 ([2, 3])
    segments = [(Segment(0, 0, 0, 1), Segment(1, 0, 1, 4)), (Segment(1, 3, 0, 3),)]
    pieces = [flat[0:4], torch.cat([flat[4:7], torch.zeros(1, dtype=dtype)])]  # rank 1: padding at its end
    bufs = []

    def ctx(r, leaf_sum):
        return fo.UpdateContext(0, fzero.ParamGroup("default"), segments[r], (0, 1), (True, True), leaf_sum,
                                leaf_shapes=((1,), (2, 3)))

    for r in range(2):
        fo.whole_leaves(ctx(r, lambda x: bufs.append(x) or x), pieces[r])
    for order in ((0, 1), (1, 0)):
        total = bufs[order[0]] + bufs[order[1]]
        for r in range(2):
            got = fo.whole_leaves(ctx(r, lambda x: total), pieces[r])
            assert got[1].dtype == dtype and got[1].shape == (2, 3)
            assert torch.equal(got[1].view(torch.int16 if dtype != torch.float32 else torch.int32),
                               leaf.view(torch.int16 if dtype != torch.float32 else torch.int32))
            assert set(got) == ({0, 1} if r == 0 else {1})


def test_leaf_sums_of_squares_are_exact_wherever_the_shards_cut():
    """`fzero.optim.leaf_sums_of_squares`, the exact per-leaf sums LAMB's trust ratio uses, public
    for a user's per-leaf norm (found in review of an optimizer author: a float sum of each
    shard's squares through `ctx.leaf_sum` was 2.2e-16 off stage 0's at stages 1-3, and the exact
    helper was private): two ranks' pieces of a [2, 3] leaf after a [1] leaf, summed in either
    order, and the whole bucket on one rank, give `math.fsum` of the float64 squares, bit for
    bit; a leaf `mask` leaves out sums to 0; float64 is refused."""
    import math

    from fzero.layout import Segment

    g = torch.Generator().manual_seed(0)
    flat = torch.randn(7, generator=g) * torch.tensor([1.0, 1e-3, 3.0, 1e4, 0.5, 7.0, 1e-20])
    want = [math.fsum(float(v) ** 2 for v in flat[:1].tolist()), math.fsum(float(v) ** 2 for v in flat[1:].tolist())]
    segments = [(Segment(0, 0, 0, 1), Segment(1, 0, 1, 4)), (Segment(1, 3, 0, 3),)]
    pieces = [flat[0:4], torch.cat([flat[4:7], torch.zeros(1)])]
    bufs = []

    def ctx(segs, leaf_sum, used=(True, True)):
        return fo.UpdateContext(0, fzero.ParamGroup("default"), segs, (0, 1), used, leaf_sum)

    for r in range(2):
        fo.leaf_sums_of_squares(ctx(segments[r], lambda x: bufs.append(x) or x), pieces[r])
    for order in ((0, 1), (1, 0)):
        total = bufs[order[0]] + bufs[order[1]]
        for r in range(2):
            [sums] = fo.leaf_sums_of_squares(ctx(segments[r], lambda x: total), pieces[r])
            assert sums == want, (sums, want)
    whole = (Segment(0, 0, 0, 1), Segment(1, 0, 1, 7))
    [sums], [halves] = fo.leaf_sums_of_squares(ctx(whole, lambda x: x), flat), fo.leaf_sums_of_squares(
        ctx(whole, lambda x: x, (True, False)), flat)
    assert sums == want and halves == [want[0], 0.0]
    with pytest.raises(fo.OptimizerError, match=r"float32 \(or narrower\) shards, got torch.float64\[7\]"):
        fo.leaf_sums_of_squares(ctx(whole, lambda x: x), flat.double())


def _nan_in_padding(inner: fo.Optimizer) -> fo.Optimizer:
    """`inner` whose updates also write NaN after the last segment: into the padding, no leaf."""
    def spoil(p, ctx):
        end = max((seg.stop for seg in ctx.segments), default=0)
        p[end:] = float("nan")
        return p

    def update(g, s, p, ctx):
        p, s = inner.update(g, s, p, ctx)
        return spoil(p, ctx), s

    def update_(g, s, p, ctx):
        s = inner.update_(g, s, p, ctx)
        spoil(p, ctx)
        return s

    return fo.Optimizer(inner.init, update, inner.spec, update_, lr=inner.lr)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("stage", [0, 1, 3])
def test_an_update_writing_nan_into_the_padding_is_named(stage, donate):
    """Every leaf right, NaN in the padding only: a pure step raises `OptimizerError` saying where
    (before: the finite check found the NaN, the leaves none, and the step returned the old state
    with `skipped=False`, every step; found in review of an optimizer author); a donating step's
    next step names it (before: "made the params NaN or inf in  (..., 0 leaves)")."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(make_params(), _nan_in_padding(lion()), stage=stage, mesh=mesh, units=units)
        step = fzero.train_step(loss_fn, donate=donate, on_nonfinite="skip")
        try:
            for t in range(2):
                state, m = step(state, batch(mesh.rank, t))
        except (fo.OptimizerError, fzero.NonFiniteError) as e:
            return type(e).__name__, str(e)
        return "returned", str(m)

    for kind, said in mesh.run(rank_fn):
        assert kind == ("NonFiniteError" if donate else "OptimizerError"), (kind, said)
        assert "wrote NaN or inf outside every leaf, into the padding" in said, said
        assert ("made the params NaN or inf on rank(s) [" in said and "] outside every leaf" in said) if donate else \
            said.startswith("step 0: "), said


@pytest.mark.parametrize("stage", [0, 1, 3])
def test_a_pure_update_that_writes_its_param_loses_the_state(stage):
    """After the `OptimizerError` for a pure update that wrote its param in place, the state is
    lost: `gather` of it raises naming that step (before: it read the written params without a
    word; found in review of an optimizer author)."""
    inner = lion()
    writes = fo.Optimizer(inner.init, lambda g, s, p, ctx: (p, inner.update_(g, s, p, ctx)), inner.spec, lr=inner.lr)
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(make_params(), writes, stage=stage, mesh=mesh, units=units)
        with pytest.raises(fo.OptimizerError, match=r"wrote its input\(s\) \['param', 'state.m'\] in place"):
            fzero.train_step(loss_fn)(state, batch(mesh.rank))
        with pytest.raises(fzero.FzeroError, match=r"this state \(step 0\) is lost: its step \(step 0; .*\), whose "
                                                   r"optimizer's update \(Optimizer.update, which must be pure\) "
                                                   r"wrote the state in place and raised OptimizerError"):
            fzero.gather(state)

    mesh.run(rank_fn)


def test_ctx_leaf_sum_called_on_some_ranks_is_named_as_the_optimizers():
    """An update that calls `ctx.leaf_sum` where its shard holds one segment: at stage 1, N = 2,
    rank 1 does (its piece of bucket 'a' lies inside one leaf), rank 0 does not (two leaves). The
    mismatch names the optimizer's collective (before: `DivergentPaths`, "ranks took different
    paths through the model ... use gather='eager'"; found in review)."""
    inner = lion()

    def update(g, s, p, ctx):
        if len(ctx.segments) == 1:
            ctx.leaf_sum(torch.zeros(len(ctx.leaves), dtype=torch.float64))
        return inner.update(g, s, p, ctx)

    mesh = fzero.SimMesh(2)
    state = [None]

    def rank_fn():
        state[0] = fzero.init(make_params(), fo.Optimizer(inner.init, update, inner.spec, lr=inner.lr), stage=1,
                              mesh=mesh, units=units)
        fzero.train_step(loss_fn)(state[0], batch(mesh.rank))

    with pytest.raises(fzero.CollectiveMismatch, match=r"the optimizer's update on rank\(s\) \[1\] called "
                                                       r"ctx.leaf_sum .* where the other ranks did not") as e:
        mesh.run(rank_fn)
    assert not isinstance(e.value, fzero.DivergentPaths)


def test_ctx_leaf_sum_of_other_shapes_on_every_rank_is_worded_so():
    """Every rank calls `ctx.leaf_sum`, with a shape of its own (its shard's segment count): the
    words say so (a review found them saying "where the other ranks did not", of no other rank)."""
    inner = lion()

    def update(g, s, p, ctx):
        ctx.leaf_sum(torch.zeros(len(ctx.segments), dtype=torch.float64))
        return inner.update(g, s, p, ctx)

    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(make_params(), fo.Optimizer(inner.init, update, inner.spec, lr=inner.lr), stage=1,
                           mesh=mesh, units=units)
        fzero.train_step(loss_fn)(state, batch(mesh.rank))

    with pytest.raises(fzero.CollectiveMismatch, match=r"every rank called ctx.leaf_sum \(a collective over every "
                                                       r"rank\), for other buckets or shapes: an update must call"):
        mesh.run(rank_fn)
