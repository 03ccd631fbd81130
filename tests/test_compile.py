"""torch.compile and fzero (docs/compile.md): what is compiled, and which bits are kept.

fzero's step is marked `torch.compiler.disable`, and its unit reads and collectives go through
`eager` (`torch.compiler.disable` whenever dynamo is about), so dynamo never traces them:
`torch.compile(step)` runs fzero eager (the optimizer and the reductions keep their bits), and
the model is compiled by passing a compiled loss to `train_step`. A compiled loss may round
differently from the eager loss (inductor fuses and reorders), so it is compared with the same
compiled loss run by an eager step, and across stages: the stages feed it the same leaf
values, so every stage gets the same bits.

Compile is slow on 2 CPU cores: one tiny model, one compiled loss object shared by the tests of
an engine (dynamo caches its graph), two steps.
"""

from __future__ import annotations

import os

import pytest
import torch

import fzero
from fzero import optim
from fzero._src.collectives import all_gather
from tests.stage_harness import assert_equal_leaves, full_opt_state

N = 2

# Two warnings torch raises about its own code, not fzero's: importing torch.utils.mkldnn (inductor,
# on the first compile) warns that torch.jit.script_method is deprecated, and dynamo reads `.grad`
# of the non-leaf inputs it wraps (the unit Function's outputs), which warns; dynamo instantiates
# an autograd.Function it speculates through (a collective's), which warns.
pytestmark = [
    pytest.mark.filterwarnings("ignore:<class 'torch.autograd.function.Function'> should not be instantiated"
                               ":DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"),
]


def _params(flat):
    """A flat dict `{dotted path: leaf}` (read lazily on use, `LazyParams`), or nested dicts."""
    g = torch.Generator().manual_seed(0)
    w, b, h = torch.randn(4, 3, generator=g), torch.randn(3, generator=g), torch.randn(3, 2, generator=g)
    if flat:
        return {"layer.w": w, "layer.b": b, "head.w": h}
    return {"layer": {"w": w, "b": b}, "head": {"w": h}}


def _batches():
    g = torch.Generator().manual_seed(1)
    return [[torch.randn(5, 4, generator=g) for _ in range(N)] for _ in range(2)]


def _math(w, b, h, x):
    return (torch.tanh(x @ w + b) @ h).square().mean()  # (B, 4) @ (4, 3) @ (3, 2)


def _loss(p, x):
    """The whole loss: compiled as is with gather="eager" (the loss gets plain leaves)."""
    return _math(p["layer"]["w"], p["layer"]["b"], p["head"]["w"], x)


def _reading(math):
    """On use (flat-dict params, `LazyParams`): read the leaves eagerly, compile the math of them."""
    return lambda p, x: math(p["layer.w"], p["layer.b"], p["head.w"], x)


# On torch 2.11 (the device image, 2026-12-01) dynamo crashed the process (segmentation faults
# inside its fake-tensor code) when SimMesh's thread ranks compiled in turn -- one rank's
# compiled frame paused at a collective's graph break while the next rank compiled: in
# test_compiled_loss_is_compiled[on_use] and test_collective_inside_a_compiled_function. On
# torch 2.13 every case runs. docs/compile.md says the same; this module needs 2.13. To look at
# the crash on an older torch, in a process of its own (a segmentation fault ends it), set
# FZERO_COMPILE_ANY_TORCH=1: `FZERO_COMPILE_ANY_TORCH=1 python -m pytest tests/test_compile.py -x -v`.
TORCH_213 = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 13)
ANY_TORCH = os.environ.get("FZERO_COMPILE_ANY_TORCH") == "1"
pytestmark.append(pytest.mark.skipif(not (TORCH_213 or ANY_TORCH), reason="torch 2.11's dynamo crashes when "
                                     "SimMesh's thread ranks compile in turn (docs/compile.md)"))

COMPILED: dict = {}  # (engine, gather) -> one compiled loss, whose dynamo cache that case's tests share


def _compiled(engine, gather):
    if (engine, gather) not in COMPILED:
        COMPILED[engine, gather] = torch.compile(_loss) if gather == "eager" else _reading(torch.compile(_math))
    return COMPILED[engine, gather]


def _run(stage, engine, loss_fn, compile_step, gather="on_use"):
    mesh = fzero.SimMesh(N)
    params, batches = _params(flat=gather == "on_use"), _batches()

    def rank_fn(*mine):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0])
        step = fzero.train_step(loss_fn, engine=engine, gather=gather)
        step = torch.compile(step) if compile_step else step
        losses = []
        for x in mine:
            state, m = step(state, x)
            losses.append(m.loss)
        return fzero.gather(state), state.opt_state, losses

    return mesh.run(rank_fn, [tuple(b[r] for b in batches) for r in range(N)])


def _assert_same(a, b, what, same_stage=False):
    """Runs `a` and `b` (per rank: gathered params, optimizer state, losses) hold the same bits.
    `b` is stage 0, and `a`'s shards, concatenated in rank order, are compared with `b`'s full
    state (`full_opt_state`); or (`same_stage`) `b` ran `a`'s stage, and each rank's optimizer
    state is compared with the same rank's."""
    assert len(a) == len(b) == N
    for r, ((pa, sa, la), (pb, sb, lb)) in enumerate(zip(a, b)):
        assert_equal_leaves(pa, pb, f"{what}, rank {r}: params")
        assert len(la) == len(lb) and all(torch.equal(x, y) for x, y in zip(la, lb)), f"{what}, rank {r}: losses {la} vs {lb}"
        if same_stage:
            assert_equal_leaves(sa, sb, f"{what}, rank {r}: optimizer state")
    if not same_stage:
        full_a = full_opt_state([x[1] for x in a], b[0][1])
        for k, (fa, fb) in enumerate(zip(full_a, b[0][1])):  # full_opt_state checked the structure
            assert all(torch.equal(x, y) for x, y in zip(fa or (), fb or ())), f"{what}: optimizer state of bucket {k}"


@pytest.mark.parametrize("engine", ["autograd", "func"])
def test_compiled_step_is_the_eager_step(engine):
    """`torch.compile(step)`: before fzero marked its step, dynamo traced it: here it failed in
    the traced gathering code (on torch's own warnings, errors in this suite), and outside the
    suite the autograd engine's AdamW params differed from eager by up to 6e-8. Now dynamo skips the step:
    every bit of params, AdamW state and loss equals the eager step's (stage 3: gathers, frees,
    reduce-scatters and the sharded update all run under it)."""
    loss = _reading(_math)
    _assert_same(_run(3, engine, loss, True), _run(3, engine, loss, False), f"stage 3, {engine}", same_stage=True)


@pytest.mark.parametrize("engine,gather", [("autograd", "on_use"), ("autograd", "eager")])
def test_compiled_loss_same_bits_in_every_stage(engine, gather):
    """A compiled loss inside the step: stages 1-3 equal stage 0 bit for bit (the same compiled
    kernels read the same leaf values), and compiling the step around it changes nothing. On use,
    with flat-dict params, reading a leaf gathers its unit eager (a graph break) and hands the
    compiled code a plain tensor. (Under engine="func" the loss is not compiled at all, and
    train_step warns: tests/test_walkthrough.py; this case ran func with gather="eager" before,
    which compared eager with eager.)"""
    loss = _compiled(engine, gather)
    ref = _run(0, engine, loss, False, gather)
    for stage in (1, 2, 3):
        _assert_same(_run(stage, engine, loss, False, gather), ref, f"stage {stage} vs 0, compiled loss, {engine}")
    _assert_same(_run(3, engine, loss, True, gather), ref, f"compiled step at stage 3 vs stage 0, {engine}")


@pytest.mark.parametrize("gather", ["on_use", "eager"])
def test_compiled_loss_is_compiled(gather):
    """The compiled code really runs inside the step (not a silent fallback to eager): dynamo
    captures a graph of the loss's ops. (A whole compiled loss over `LazyParams` would break the
    graph at each lazy read, and under the func engine capture nothing, hence `_reading`:
    docs/compile.md.)"""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    loss = torch.compile(_loss) if gather == "eager" else _reading(torch.compile(_math))
    _run(3, "autograd", loss, True, gather)
    assert counters["stats"]["unique_graphs"] >= 1 and counters["stats"]["calls_captured"] >= 5, dict(counters["stats"])


def test_collective_inside_a_compiled_function():
    """A user function that calls a fzero collective, compiled, on SimMesh: the collective is one
    clean graph break (it runs eager), not dynamo tracing SimMesh's condition variable and lock
    (which broke the graph on `Condition` and `RLock._is_owned`). Same bits as eager."""
    from torch._dynamo.utils import counters

    mesh = fzero.SimMesh(N)

    def f(x):
        return all_gather(x * 2, mesh, tag="t").sin()

    cf = torch.compile(f)
    torch._dynamo.reset()
    counters.clear()
    out = mesh.run(lambda x: (cf(x), f(x)), [(torch.arange(3.0) + r,) for r in range(N)])
    for compiled, eager in out:
        assert torch.equal(compiled, eager)
    reasons = " ".join(counters["graph_break"])
    assert "Condition" not in reasons and "RLock" not in reasons, reasons


def test_the_differentiable_read_compiles_with_no_warning_from_the_stand_in_check():
    """README's differentiable read, `fzero.layout.unpack(state.layout, flats)`, inside a compiled
    function: the stand-in check (`layout.is_stand_in`) looks under torch.func's wrappers only
    where dynamo is not tracing, since dynamo cannot trace that (found in review: its "does not
    know how to trace" warning, an error under the suite's warnings-as-errors, and two more graph
    breaks). Compiled, it warns nothing and gives eager's bits. (One graph break stays, before
    and after: dynamo's optree polyfill refuses optree's own treespec in `unflatten`.)"""
    import warnings

    params = {"w": torch.arange(1.0, 5.0), "v": torch.linspace(-1.0, 1.0, 6).reshape(2, 3)}
    layout = fzero.layout.plan(params, 1)
    flats = fzero.layout.pack(layout, params)

    def f(fs):
        p = fzero.layout.unpack(layout, fs)
        return (p["w"] ** 2).sum() + p["v"].sin().sum()

    torch._dynamo.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = torch.compile(f)(flats)
    traced = [str(w.message)[:200] for w in caught if "functorch" in str(w.message)]  # (torch's own deprecations
    assert not traced, traced  # at its first compile are not the check's)
    assert torch.equal(got, f(flats))


def test_a_compiled_evaluate_runs_fzero_eager_and_leaves_fn_as_given():
    """`torch.compile(fzero.evaluate(fn))`: the function evaluate returned was the disabled one,
    which torch.compile unwraps, so dynamo traced fzero's forward, compiled `fn` and recompiled at
    every call (a guard on the state's storage addresses) up to its limit (found in review of a
    compile user). Now a plain function calls the disabled one: no graph, the eager bits."""
    from torch._dynamo.utils import counters

    fn = lambda p, x: (torch.tanh(x @ p["a.w"]) @ p["b.w"]).square().mean()  # noqa: E731
    params = {"a.w": torch.randn(4, 3), "b.w": torch.randn(3, 2)}
    mesh = fzero.SimMesh(1)

    def rank():
        state = fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh, units=lambda p: p.split(".")[0])
        step, compiled = fzero.train_step(fn), torch.compile(fzero.evaluate(fn), backend="eager")
        for _ in range(3):
            state, _ = step(state, torch.randn(5, 4))
            x = torch.randn(5, 4)
            assert torch.equal(compiled(state, x), fzero.evaluate(fn)(state, x))

    torch._dynamo.reset()
    counters.clear()
    mesh.run(rank)
    assert counters["stats"]["unique_graphs"] == 0, dict(counters["stats"])
