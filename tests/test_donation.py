"""`train_step(donate=True)`: the step writes the state's own buffers (JAX's buffer donation).
The same bits as the pure step after every step, in every stage; the consumed input raises when
used again; and the update holds no second copy of the optimizer state."""

from __future__ import annotations

import math
from typing import NamedTuple

import optree
import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

import fzero
from fzero import optim
from fzero.accounting import LiveStorages
from fzero.testing import assert_trees_equal, examples, groups, pytrees, units


def _params():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(13, generator=g), "b": {"w": torch.randn(3, 5, generator=g)}, "f": torch.randn(4, generator=g)}


def _loss(p, x):
    return torch.tanh(p["a"][:5] * x).sum() + (p["b"]["w"] @ x).square().mean() + (p["f"].sum() * 0)


GROUPS = [fzero.ParamGroup("frozen", match=lambda p: p == "f", frozen=True)]


MAKE = {"adamw": lambda impl: optim.adamw(1e-2, weight_decay=0.1, impl=impl),
        "sgd-momentum": lambda impl: optim.sgd(0.1, momentum=0.9, nesterov=True, impl=impl),
        "adam-amsgrad": lambda impl: optim.adam(1e-2, amsgrad=True, impl=impl)}


@pytest.mark.parametrize("opt", ["adamw", "sgd-momentum", "adam-amsgrad"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_donating_step_equals_the_pure_step(stage, opt):
    _same_as_pure(fzero.SimMesh(3), stage, lambda: MAKE[opt](None))


@pytest.mark.parametrize("opt", ["adamw", "sgd-momentum", "adam-amsgrad"])
@pytest.mark.parametrize("stage, n", [(0, 1), (1, 1), (2, 1), (3, 1), (0, 3)])  # CPU "fused": leaves whole in the shard
def test_a_fused_donating_step_equals_the_pure_step(stage, n, opt):
    """As above with torch's fused kernels, which the donating step launches before the
    agreement's read (`agreement.agree_launching`), a frozen group beside them."""
    _same_as_pure(fzero.SimMesh(n), stage, lambda: MAKE[opt]("fused"))


@pytest.mark.filterwarnings("ignore::fzero.GroupHoldsNoLeaf")  # drawn groups may take no leaf of a drawn tree
@examples(40)
@given(tree=pytrees(dtypes=[torch.float32], max_leaves=12), unit_map=units(), group_list=groups(),
       stage=st.integers(0, 3), opt=st.sampled_from(sorted(MAKE)), nan_at=st.integers(0, 3))
def test_a_fused_donating_step_equals_the_pure_step_on_any_tree(tree, unit_map, group_list, stage, opt, nan_at):
    """Any float32 pytree, unit map and groups (frozen ones too), N = 1, torch's fused kernels
    (launched before the agreement's read by the donating step): three steps, one of them NaN
    where `nan_at` < 3 (skipped, the flag making the early kernels write nothing): the donating
    step's params, skips and metrics are the pure step's, bit for bit."""
    assume(optree.tree_leaves(tree))
    mesh = fzero.SimMesh(1)

    def loss(p, t):
        return sum((x.sin() * t).sum() for x in optree.tree_leaves(p))

    def rank_fn(donate):
        state = fzero.init(tree, MAKE[opt]("fused"), stage=stage, mesh=mesh, units=unit_map, groups=group_list)
        step = fzero.train_step(loss, donate=donate, on_nonfinite="skip")
        seen = []
        for t in range(3):
            state, m = step(state, torch.tensor(math.nan if t == nan_at else 0.5 + t))
            seen.append(repr((m.skipped, float(m.loss), float(m.grad_norm))))
        return fzero.gather(state), seen

    (pure,), (donated,) = mesh.run(lambda: rank_fn(False)), mesh.run(lambda: rank_fn(True))
    assert donated[1] == pure[1]
    assert_trees_equal(donated[0], pure[0], bitwise=True)


def _same_as_pure(mesh, stage, make):
    """Three steps, pure and donating, on `mesh`: every step's params, optimizer state, loss and
    gradient norm equal, on every rank."""
    n = mesh.world_size
    xs = [torch.randn(5, generator=torch.Generator().manual_seed(10 + r)) for r in range(n)]

    def rank_fn(x, donate):
        state = fzero.init(_params(), make(), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0], groups=GROUPS)
        step = fzero.train_step(_loss, donate=donate)
        trace = []
        for t in range(3):
            state, m = step(state, x * (t + 1))
            trace.append((fzero.gather(state), [None if s is None else [f.clone() for f in s] for s in state.opt_state],
                          m))
        return trace

    pure = mesh.run(lambda x: rank_fn(x, False), [(x,) for x in xs])
    donated = mesh.run(lambda x: rank_fn(x, True), [(x,) for x in xs])
    for r in range(n):
        for (p0, s0, m0), (p1, s1, m1) in zip(pure[r], donated[r]):
            assert torch.equal(m0.loss, m1.loss) and torch.equal(m0.grad_norm, m1.grad_norm)
            assert torch.equal(p0["a"], p1["a"]) and torch.equal(p0["b"]["w"], p1["b"]["w"])
            assert torch.equal(p0["f"], p1["f"])
            for a, b in zip(s0, s1):
                assert (a is None) == (b is None)
                assert a is None or all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_consumed_state_raises_and_the_update_writes_in_place():
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(_params(), optim.adamw(1e-2), stage=3, mesh=mesh, units=lambda p: p.split(".")[0])
        ptrs = [t.data_ptr() for t in state.params]
        new, _ = fzero.train_step(_loss, donate=True)(state, torch.ones(5))
        assert [t.data_ptr() for t in new.params] == ptrs  # stage 3: each shard written where it was
        with pytest.raises(fzero.FzeroError, match=r"donated to a train_step\(donate=True\)"):
            fzero.train_step(_loss)(state, torch.ones(5))
        with pytest.raises(fzero.FzeroError, match="donated"):
            fzero.gather(state)
        fzero.train_step(_loss, donate=True)(new, torch.ones(5))  # the returned state is fine
        return True

    assert mesh.run(rank_fn) == [True, True]


def test_a_replaced_copy_of_a_consumed_state_is_refused_unless_every_buffer_is_new():
    """`state.replace(...)` of a donated state shares its buffers, which hold the next state's
    values: refused as the state is (found in review: `gather` of `state.replace(step=...)`
    read the next step's params under the old step count, silently). With every buffer field
    replaced it shares none and is a state like any other; a live state's copy steps on."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        init = lambda: fzero.init(_params(), optim.adamw(1e-2), stage=1, mesh=mesh)
        state, step = init(), fzero.train_step(_loss, donate=True)
        new, _ = step(state, torch.ones(5))
        for copy in (state.replace(step=state.step.clone()), state.replace(params=new.params, opt_state=new.opt_state)):
            with pytest.raises(fzero.FzeroError, match=r"donated to a train_step\(donate=True\)"):
                fzero.gather(copy)
            with pytest.raises(fzero.FzeroError, match="donated"):
                step(copy, torch.ones(5))
        fresh = init()
        rebuilt = state.replace(params=fresh.params, opt_state=fresh.opt_state, master=fresh.master,
                                loss_scale=fresh.loss_scale)
        assert_trees_equal(fzero.gather(rebuilt), fzero.gather(fresh))
        live = new.replace(step=new.step.clone())
        newer, _ = step(live, torch.ones(5))
        return int(newer.step)

    assert mesh.run(rank_fn) == [2, 2]


def test_a_skipped_donating_step_leaves_its_input_usable():
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(_params(), optim.adamw(1e-2), stage=2, mesh=mesh)
        new, m = fzero.train_step(_loss, donate=True, on_nonfinite="skip")(state, torch.full((5,), float("nan")))
        assert m.skipped and new is state
        return fzero.gather(state)["a"]

    assert all(torch.equal(a, _params()["a"]) for a in mesh.run(rank_fn))


@pytest.mark.parametrize("offload", [None, "cpu"])
def test_a_donating_step_skipped_for_an_overflow_consumes_its_input(offload):
    """A step skipped for a loss-scale overflow returns a new state (its scaler moved) that shares
    every buffer with its input: the next donating step then wrote both, and the input, still at
    step 0, read and saved step 1's values (found in review). With `donate=True` the input is
    now consumed; the returned state steps on."""
    mesh = fzero.SimMesh(2)
    off = None if offload is None else fzero.Offload(optimizer=offload)

    def rank_fn():
        state = fzero.init(_params(), optim.adamw(1e-2), stage=3, mesh=mesh, offload=off,
                           precision=fzero.Precision(torch.float16, torch.float32),
                           loss_scale=fzero.DynamicLossScale(init_scale=2.0**4, hysteresis=1))
        step = fzero.train_step(lambda p, x: _loss(p, x.half()).float(), donate=True)
        new, m = step(state, torch.full((5,), float("inf")))
        assert m.skipped and new is not state
        new, m = step(new, torch.ones(5))
        assert not m.skipped and int(new.step) == 1
        with pytest.raises(fzero.FzeroError, match="was donated to a train_step"):
            fzero.gather(state)

    mesh.run(rank_fn)


def test_donation_saves_a_copy_of_the_optimizer_state():
    """Peak live bytes of one step above the state (all ranks), stage 0, E elements per rank: the
    pure update makes new params and AdamW's two moments (3E floats) while the reduced gradient (E)
    is alive: 4E. Everything else the step allocates is freed by then, and its backward holds at
    most 3E at once (the local gradient, its fl(1/N)·g copy, the all-gathered reduced gradient;
    activations of a matrix-vector loss are d floats). The donating update allocates nothing, so
    its peak is the backward's: the saving is at least 4E - 3E = E floats per rank."""
    n, d = 2, 64
    params = {"w": torch.randn(d, d)}
    mesh = fzero.SimMesh(n)

    def peak(donate):
        mode = LiveStorages()

        def rank_fn():
            state = fzero.init(params, optim.adamw(1e-3), stage=0, mesh=mesh)
            step = fzero.train_step(lambda p, x: (p["w"] @ x).square().sum(), donate=donate)
            state, _ = step(state, torch.ones(d))
            with mode:
                state, _ = step(state, torch.ones(d))
            return state.layout.buckets[0].padded_numel

        elements = mesh.run(rank_fn)[0]
        return mode.peak, elements

    (pure, elements), (donated, _) = peak(False), peak(True)
    assert pure - donated >= n * elements * 4


def _free_buffers(step):
    """The data pointers of the gradient buffers a donating CPU step function holds for its next
    step on this thread (`unit.HostBuffers`)."""
    return sorted(t.data_ptr() for ts in step.config.buffers._mine().free.values() for t in ts)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_donating_cpu_step_assembles_into_the_buffers_of_the_step_before(stage):
    """A donating stage-0 step on the CPU keeps its units' gradient buffers for the next step (new
    memory each step is memory the system hands out afresh, page by page): after every step the
    step function holds the same buffers -- one step function shared by SimMesh's rank threads,
    each with its own. Stages 1-3, which hold one or two units' full gradients at a time, keep
    none (keeping every unit's would hold a full gradient between steps). The params are the pure
    step's, bit for bit."""
    mesh = fzero.SimMesh(2)
    pure = fzero.train_step(_loss)
    donating = fzero.train_step(_loss, donate=True)

    def rank_fn(x):
        state, want = (fzero.init(_params(), optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0],
                                  groups=GROUPS) for _ in range(2))
        held = []
        for t in range(3):
            want, _ = pure(want, x * (t + 1))
            state, _ = donating(state, x * (t + 1))
            held.append(_free_buffers(donating))
        return held, fzero.gather(state), fzero.gather(want)

    xs = [(torch.randn(5, generator=torch.Generator().manual_seed(20 + r)),) for r in range(2)]
    out = mesh.run(rank_fn, xs)
    assert set(out[0][0][0]).isdisjoint(out[1][0][0])  # each rank thread its own buffers
    for held, got, want in out:
        assert (held[0] and held[0] == held[1] == held[2]) if stage == 0 else held == [[], [], []]
        assert_trees_equal(got, want, bitwise=True)


def test_a_step_that_raises_lets_its_buffers_go_and_the_next_is_right():
    """A donating step that raises (a non-finite loss) gives back none of the buffers it lent --
    here every one the step before left: the traceback may still reach them -- and the next steps
    assemble into new ones, then keep those, with the pure steps' bits."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        pure, donating = fzero.train_step(_loss), fzero.train_step(_loss, donate=True)
        state, want = (fzero.init(_params(), optim.adamw(1e-2), stage=0, mesh=mesh) for _ in range(2))
        state, _ = donating(state, torch.ones(5))
        want, _ = pure(want, torch.ones(5))
        assert _free_buffers(donating)
        with pytest.raises(fzero.NonFiniteError):
            donating(state, torch.full((5,), math.inf))
        assert _free_buffers(donating) == []
        for t in range(2):
            state, _ = donating(state, torch.full((5,), 2.0 + t))
            want, _ = pure(want, torch.full((5,), 2.0 + t))
            assert _free_buffers(donating)
        return fzero.gather(state), fzero.gather(want)

    [(got, want)] = mesh.run(rank_fn)
    assert_trees_equal(got, want, bitwise=True)


class _KeptState(NamedTuple):
    last: torch.Tensor  # the gradient of the step before: the very tensor the update was handed


def _keeping_optimizer():
    """p <- p - 0.1 (g + g_prev), whose state is the gradient it was given, not a copy."""

    def init(param, num_leaves):
        return _KeptState(torch.zeros_like(param))

    def update(grad, state, param, ctx):
        return param - 0.1 * (grad + state.last), _KeptState(grad)

    def update_(grad, state, param, ctx):
        param.sub_(0.1 * (grad + state.last))
        return _KeptState(grad)

    return optim.Optimizer(init, update, lambda s: _KeptState("shard"), update_=update_)


def test_a_gradient_the_optimizer_keeps_is_not_assembled_into_again():
    """An optimizer whose state keeps the gradient it was handed (stage 0: the reduced gradient
    is the buffer the step assembled) still sees it whole at the next step: a donating step does
    not lend a buffer the state it returned holds. The bits are the pure step's."""
    mesh = fzero.SimMesh(2)

    def rank_fn(x):
        pure, donating = fzero.train_step(_loss), fzero.train_step(_loss, donate=True)
        state, want = (fzero.init(_params(), _keeping_optimizer(), stage=0, mesh=mesh) for _ in range(2))
        for t in range(3):
            want, _ = pure(want, x * (t + 1))
            state, _ = donating(state, x * (t + 1))
            kept = {o.last.untyped_storage().data_ptr() for o in state.opt_state if o is not None}
            assert kept.isdisjoint(_free_buffers(donating))
        return fzero.gather(state), fzero.gather(want)

    xs = [(torch.randn(5, generator=torch.Generator().manual_seed(30 + r)),) for r in range(2)]
    for got, want in mesh.run(rank_fn, xs):
        assert_trees_equal(got, want, bitwise=True)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_donating_step_over_buckets_of_different_block_counts_on_the_cpu(stage):
    """A bucket cut into several CPU update blocks beside a small one, `donate=True`: the update's
    finite witnesses stack together, and the step gives the pure step's bits (found in review of a
    stage-3 user: torch's "stack expects each tensor to be equal size" after the update had written
    the state, which was then lost; the suite's models were all one block)."""
    from fzero._src.optim.base import CPU_BLOCK

    big = 2 * CPU_BLOCK * max(1, torch.get_num_threads()) + 5
    g = torch.Generator().manual_seed(0)
    params = {"big": torch.randn(big, generator=g), "small": torch.randn(7, generator=g)}
    mesh = fzero.SimMesh(1)

    def rank(donate):
        state = fzero.init({k: v.clone() for k, v in params.items()}, optim.sgd(0.1, momentum=0.9), stage=stage,
                           mesh=mesh, units=lambda path: path)
        step = fzero.train_step(lambda p, x: (p["big"] * x).sum() + p["small"].square().sum(), donate=donate)
        for t in range(2):
            state, _ = step(state, torch.full((big,), 0.5 + t))
        return fzero.gather(state)

    donated, pure = mesh.run(lambda: rank(True))[0], mesh.run(lambda: rank(False))[0]
    assert all(torch.equal(donated[k], pure[k]) for k in params)
