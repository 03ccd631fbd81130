"""Derivatives through a step with respect to a frozen leaf (docs/func.md).

A frozen leaf (`ParamGroup(..., frozen=True)`, or a `requires_grad=False` parameter of
`from_module`) is never updated, but the loss reads it, so the other leaves' gradients -- and
their updates -- depend on it. Through one SGD step, `new = {a: a - lr ḡ_a(a, b), b: b}` with b
frozen, and for `F = <c, new>`:

    dF/db = c_b - lr H̄_abᵀ c_a        (H̄ the mean over ranks of the per-rank Hessians)

as plain torch gives. Found in review: fzero returned c_b (the frozen leaf's identity path
alone) -- the unit Function marked frozen leaves non-differentiable at every level of
differentiation -- and a `jvp` of a step of any state with a frozen group raised torch's "not a
differentiable Tensor". A plain step still gives a frozen leaf no gradient and no reduction.

Equalities are `torch.equal`: the data are small integers in float64 with a dyadic learning rate
and N a power of two (tests/func_cases.py), so every value is a dyadic rational far below 2^53
and no order of summation rounds.
"""

from __future__ import annotations

import pytest
import torch

import fzero
from fzero import optim
from tests import func_cases as cases

LR = cases.LR
FROZEN_B = (fzero.ParamGroup("fr", match=lambda p: p == "b", frozen=True),)


def _init(mesh, stage: int, params):
    return fzero.init(params, optim.sgd(LR), stage=stage, mesh=mesh, groups=FROZEN_B)


def _mine(state, flats):
    """This rank's part of full flats: all of them, or its shard where the stage shards params."""
    if not state.stage.sharded("params"):
        return tuple(flats)
    return tuple(f.chunk(state.mesh.world_size)[state.mesh.rank] for f in flats)


def _slots(layout) -> tuple:
    """Where each leaf lies, as plain data (a layout's groups hold lambdas: no pickle to `dist2`)."""
    return tuple((ls.path, ls.bucket, ls.offset, ls.numel, ls.shape) for ls in layout.leaves)


def _by_path(slots, flats) -> dict:
    return {path: flats[b][o : o + n].view(shape) for path, b, o, n, shape in slots}


def _whole(stage: int, per_rank: list) -> list:
    """Per bucket, the derivative with respect to the value: stage 3's shards concatenated, or the
    mean of the replicated stages' per-copy parts (each copy's F counts once per rank: docs/func.md)."""
    n = len(per_rank)
    return [torch.cat([r[b] for r in per_rank]) if stage == 3 else sum(r[b] for r in per_rank) * (1.0 / n)
            for b in range(len(per_rank[0]))]


def _new(batches, frozen=("b",)):
    """The unsharded step as torch writes it: the frozen leaves kept, the others `p - lr ḡ`."""
    n = len(batches)

    def new(p):
        gs = [torch.func.grad(cases.quadratic)(p, batch) for batch in batches]
        return {k: p[k] if k in frozen else p[k] - LR * sum(g[k] * (1.0 / n) for g in gs) for k in p}

    return new


def _want(params, batches, c) -> dict:
    new = _new(batches)
    return torch.func.grad(lambda p: sum((new(p)[k] * c[k]).sum() for k in p))(params)


def _data(n: int):
    params, batches, _ = cases.data(n, seed=4)
    g = torch.Generator().manual_seed(7)
    c = {k: torch.randint(-2, 3, v.shape, generator=g).double() for k, v in params.items()}
    return params, batches, c


def _derivative(mesh, stage: int, params, batch, c, how: str):
    """`dF/d(held params)` through one `engine="func"` step on this rank, F = <this rank's part of c,
    new params>: by `torch.func.grad` or by plain autograd."""
    state = _init(mesh, stage, params)
    part = _mine(state, fzero.layout.pack(state.layout, c))
    f = cases.step_of(state)

    def objective(p):
        return sum((x * y).sum() for x, y in zip(f(p, batch), part))

    if how == "func":
        return torch.func.grad(objective)(state.params), _slots(state.layout)
    held = tuple(x.detach().clone().requires_grad_() for x in state.params)
    return torch.autograd.grad(objective(held), held), _slots(state.layout)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("how", ["func", "autograd"])
def test_a_derivative_through_a_step_wrt_a_frozen_leaf_equals_torchs(n, how):
    """dF/db = c_b - lr H̄_abᵀ c_a in every stage, at N = 1 and 2, by torch.func.grad and by plain
    autograd over the func engine; the trainable leaf's derivative as before."""
    params, batches, c = _data(n)
    want = _want(params, batches, c)
    assert not torch.equal(want["b"], c["b"])  # the cross term is there to miss
    mesh = fzero.SimMesh(n)
    for stage in range(4):
        out = mesh.run(lambda batch: _derivative(mesh, stage, params, batch, c, how), [(b,) for b in batches])
        got = _by_path(out[0][1], _whole(stage, [o[0] for o in out]))
        assert torch.equal(got["b"], want["b"]), (stage, got["b"], want["b"])
        assert torch.equal(got["a"], want["a"]), stage


class _Net(torch.nn.Module):
    def __init__(self, frozen: tuple[str, ...]) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.l0, self.l1 = torch.nn.Linear(3, 4).double(), torch.nn.Linear(4, 2).double()
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(torch.randint(-2, 3, p.shape, generator=g).double())
                p.requires_grad_(name not in frozen)

    def forward(self, x):
        return self.l1(self.l0(x))


def _module_derivative(mesh, stage: int, frozen, gather: str, remat: bool, batch, c):
    model = _Net(frozen)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""), remat=remat)
    state = fzero.init(params, optim.sgd(LR), stage=stage, mesh=mesh, units=info.units, groups=info.groups)
    part = _mine(state, fzero.layout.pack(state.layout, c))
    step = fzero.train_step(lambda p, b: 0.5 * ((apply(p, b[0]) - b[1]) ** 2).sum(), engine="func", gather=gather)
    objective = lambda p: sum((x * y).sum() for x, y in zip(step(state.replace(params=p), batch)[0].params, part))  # noqa: E731
    return torch.func.grad(objective)(state.params), _slots(state.layout)


@pytest.mark.parametrize("frozen", [("l0.bias",), ("l0.weight", "l0.bias")], ids=["bias", "whole_unit"])
@pytest.mark.parametrize("gather", ["on_use", "eager"])
@pytest.mark.parametrize("remat", [False, True], ids=["plain", "remat"])
def test_a_requires_grad_false_parameter_of_from_module_through_a_step(frozen, gather, remat):
    """A `requires_grad=False` parameter (a frozen bias beside its unit's trainable weight, or a
    whole frozen first layer), stages 0 and 3, N = 2, each unit checkpointed or not: every leaf's
    derivative equals torch's, the model called by `torch.func.functional_call`."""
    model = _Net(frozen)
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randint(-2, 3, (4, 3), generator=g).double(), torch.randint(-2, 3, (4, 2), generator=g).double())
               for _ in range(2)]
    params = {k: v.detach() for k, v in model.named_parameters()}
    c = {k: torch.randint(-2, 3, v.shape, generator=g).double() for k, v in params.items()}
    loss = lambda p, b: 0.5 * ((torch.func.functional_call(model, p, (b[0],)) - b[1]) ** 2).sum()  # noqa: E731

    def new(p):
        gs = [torch.func.grad(loss)(p, b) for b in batches]
        return {k: p[k] if k in frozen else p[k] - LR * sum(gr[k] * 0.5 for gr in gs) for k in p}

    want = torch.func.grad(lambda p: sum((new(p)[k] * c[k]).sum() for k in p))(params)
    mesh = fzero.SimMesh(2)
    for stage in (0, 3):
        out = mesh.run(lambda b: _module_derivative(mesh, stage, frozen, gather, remat, b, c), [(b,) for b in batches])
        got = _by_path(out[0][1], _whole(stage, [o[0] for o in out]))
        for k in want:
            assert torch.equal(got[k], want[k]), (stage, k)


def _jvps(mesh, stage: int, params, batch, t):
    """`(jvp of the step's new params along t on every bucket, jvp along t's trainable part with
    the frozen bucket held constant)`, each as this rank's part of the new params' tangent."""
    state = _init(mesh, stage, params)
    f = cases.step_of(state)
    tangent = _mine(state, fzero.layout.pack(state.layout, t))
    _, along = torch.func.jvp(lambda p: f(p, batch), (state.params,), (tangent,))
    train = [b for b, spec in enumerate(state.layout.buckets) if not spec.group.frozen]

    def of_trainable(*xs):
        held = list(state.params)
        for b, x in zip(train, xs):
            held[b] = x
        return f(tuple(held), batch)

    _, trained = torch.func.jvp(of_trainable, tuple(state.params[b] for b in train), tuple(tangent[b] for b in train))
    return along, trained, _slots(state.layout)


def _want_jvps(params, batches, t):
    new = _new(batches)
    along = torch.func.jvp(new, (params,), (t,))[1]
    trained = torch.func.jvp(new, (params,), ({**t, "b": torch.zeros_like(t["b"])},))[1]
    return along, trained


def _check_jvps(stage: int, out: list, want: tuple) -> None:
    slots = out[0][2]
    for k, w in enumerate(want):
        got = _by_path(slots, [torch.cat([o[k][b] for o in out]) if stage == 3 else out[0][k][b]
                               for b in range(len(out[0][k]))])
        for path in w:
            assert torch.equal(got[path], w[path]), (stage, k, path)


def _jvp_data(n: int):
    params, batches, _ = cases.data(n, seed=2)
    g = torch.Generator().manual_seed(9)
    return params, batches, {k: torch.randint(-2, 3, v.shape, generator=g).double() for k, v in params.items()}


@pytest.mark.parametrize("stage", [0, 3])
def test_jvp_through_a_step_of_a_state_with_a_frozen_group(stage):
    """Forward over the step's reverse mode, one rank (forward mode on a SimMesh needs N = 1): the
    tangent of the new params along t = (t_a, t_b) is (t_a - lr (H̄_aa t_a + H̄_ab t_b), t_b), and
    along t_a alone, the frozen bucket held constant, (t_a - lr H̄_aa t_a, 0). Before, both raised
    torch's RuntimeError: the unit's jvp returned a tangent for the frozen leaves it had marked
    non-differentiable."""
    params, batches, t = _jvp_data(1)
    mesh = fzero.SimMesh(1)
    out = mesh.run(lambda: _jvps(mesh, stage, params, batches[0], t))
    _check_jvps(stage, out, _want_jvps(params, batches, t))


def frozen_on_two_processes(mesh, stage: int, params, batch, c, t):
    """A worker for `dist2`: `(dF/d(held params) by torch.func.grad, the two jvps of `_jvps`)`."""
    grads, slots = _derivative(mesh, stage, params, batch, c, "func")
    return grads, *_jvps(mesh, stage, params, batch, t)[:2], slots


def test_frozen_leaf_derivatives_at_stage_3_on_two_processes(dist2):
    """Stage 3 over a DistMesh of 2 (one process per rank: forward mode too; the frozen bucket's
    gather prefetched, DistMesh's default): the gradient w.r.t. the frozen leaf and both jvps
    equal torch's."""
    params, batches, c = _data(2)
    _, _, t = _jvp_data(2)
    out = dist2.run(frozen_on_two_processes, [(3, params, b, c, t) for b in batches], timeout=120)
    slots = out[0][3]
    got = _by_path(slots, _whole(3, [o[0] for o in out]))
    want = _want(params, batches, c)
    assert torch.equal(got["b"], want["b"]) and torch.equal(got["a"], want["a"])
    _check_jvps(3, [(o[1], o[2], slots) for o in out], _want_jvps(params, batches, t))


def _recorded(mesh, stage: int, params, batch, c, what: str):
    """The collectives of a plain step (`what="step"`), or of `torch.func.grad` through one with
    respect to the trainable bucket alone (`"trainable"`) or every bucket (`"all"`), and the
    frozen bucket's tag."""
    state = _init(mesh, stage, params)
    f = cases.step_of(state)
    part = _mine(state, fzero.layout.pack(state.layout, c))
    frozen = next(b for b, spec in enumerate(state.layout.buckets) if spec.group.frozen)
    objective = lambda p: sum((x * y).sum() for x, y in zip(f(p, batch), part))  # noqa: E731

    def of_trainable(x):
        held = list(state.params)
        held[1 - frozen] = x
        return objective(tuple(held))

    with mesh.record() as log:
        if what == "step":
            f(state.params, batch)
        elif what == "trainable":
            torch.func.grad(of_trainable)(state.params[1 - frozen])
        else:
            torch.func.grad(objective)(state.params)
    return [(r.op, r.tag) for r in log if r.rank == mesh.rank], state.layout.buckets[frozen].tag


def test_a_frozen_bucket_is_reduced_only_where_a_derivative_wrt_it_is_taken():
    """Stage 3, N = 2: a plain step gathers the frozen bucket and reduces nothing of it; so does a
    derivative through the step w.r.t. the trainable bucket alone. One w.r.t. the frozen bucket
    too reduce-scatters its gradient once, in the unit's backward of the outer derivative
    (where the cross term comes from)."""
    params, batches, c = _data(2)
    mesh = fzero.SimMesh(2)
    ops = {}
    for what in ("step", "trainable", "all"):
        out = mesh.run(lambda b: _recorded(mesh, 3, params, b, c, what), [(b,) for b in batches])
        calls, tag = out[0]
        ops[what] = [op for op, t in calls if t == tag]
    assert ops["step"] == ["all_gather"]
    assert ops["trainable"] == ["all_gather"]
    assert ops["all"] == ["all_gather", "reduce_scatter"]


def _through_the_autograd_engine(mesh, stage: int, params, batch, which: str) -> str:
    """Plain autograd through an `engine="autograd"` step with respect to the frozen bucket or
    every bucket: the error's words on this rank."""
    state = _init(mesh, stage, params)
    f = cases.step_of(state, engine="autograd")
    frozen = next(b for b, spec in enumerate(state.layout.buckets) if spec.group.frozen)
    held = tuple(x.detach().clone().requires_grad_(which == "all" or b == frozen) for b, x in enumerate(state.params))
    try:
        f(held, batch)
    except fzero.ConfigError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("which", ["frozen", "all"])
def test_plain_autograd_through_an_autograd_engine_step_is_refused_on_every_rank(which):
    """That engine detaches the params to take the step's gradient: a derivative through it was
    the update's identity term alone (`c`, for every leaf; found in review), silently. Now
    `ConfigError` on every rank, before the step, naming the leaves and `engine="func"` (whose
    derivative is right: `test_a_derivative_through_a_step_wrt_a_frozen_leaf_equals_torchs`)."""
    params, batches, _ = _data(2)
    mesh = fzero.SimMesh(2)
    for stage in (0, 3):
        out = mesh.run(lambda b: _through_the_autograd_engine(mesh, stage, params, b, which), [(b,) for b in batches])
        named = "'b'" if which == "frozen" else "'a', 'b'"
        for words in out:
            assert f"engine='autograd' whose params require grad ({named};" in words, words
            assert "engine='func'" in words and "-lr H c" in words
