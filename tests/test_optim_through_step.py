"""Derivatives through a train step (`engine="func"`) for each of fzero's optimizers (docs/func.md).

A meta-gradient through `step(state, batch)` (torch.func.grad of a function of the new state,
reverse over reverse) differentiates the optimizer's update. Found in review: only plain SGD was
right. Adam / AdamW with the default CPU impl ("foreach") had a zero derivative with respect to the
gradient (the meta-gradient came out as the identity, missing its -lr H̄ term), SGD with momentum
("foreach") a zero one once its buffer existed, Nesterov ("foreach") one missing its buffer's
term, every "fused" impl a zero one; "single" raised torch's "out=... arguments don't support automatic
differentiation" for Adam and for SGD with weight decay; LAMB and Adafactor raised it too; and a
donating step raised torch's "a view of a leaf Variable that requires grad is being used in an
in-place operation". Now:

- sgd and adam / adamw (every impl, amsgrad, weight decay, momentum, Nesterov, maximize) are
  differentiable: the kernels still give every bit of the new state (`optim.base.derived`) and an
  out-of-place form of torch's single-tensor algorithm gives the derivative (`optim.base.valued`);
- lamb and adafactor (host floats from exact sums) refuse with an `OptimizerError`, a donating
  step with a `ConfigError`, on every rank, and only where a derivative is taken through the step.

The model makes every value but the optimizer's own arithmetic exact: `L_r = ½ Σ (p - y_r)²`
over float64 leaves of small integers (`y` half-integers on rank 1, so no mean gradient is 0),
dyadic hyper-parameters, N = 2, so the Hessian is the identity, every gradient, reduction and
cotangent outside the update is exact, and the derivative of `F = Σ_r <c, new_r>` is
`c ⊙ (∂new/∂p + ∂new/∂ḡ)`, elementwise. The reference (`_sgd_ref`, `_adam_ref`) writes torch's
single-tensor algorithms out of place in plain torch, and is differentiated serially by
`torch.func.grad` through the same ops, each used as often, so `torch.equal` holds. Stages 0 and 3
on SimMesh(2): stage 0's per-copy derivatives are averaged, stage 3's shards concatenated
(docs/func.md, "Replicated and sharded inputs").
"""

from __future__ import annotations

import re

import pytest
import torch

import fzero
from fzero import optim
from tests import func_cases  # noqa: F401 -- loads torch's forward-AD decompositions quietly (its jit warning)

N = 2
BETAS, EPS = (0.5, 0.75), 0.25


def _loss(p, batch):
    ya, yb = batch
    return 0.5 * ((p["a"] - ya) ** 2).sum() + 0.5 * ((p["b"] - yb) ** 2).sum()


def _data(seed: int = 0, dtype=torch.float64):
    """`(params, per-rank batches, c[8])`: `a[2, 2]` and `b[4]`, one unit (one bucket of 8), so at
    N = 2 stage 3's shards are `a` and `b`, each whole (impl="fused" on the CPU needs that)."""
    g = torch.Generator().manual_seed(seed)
    ints = lambda *shape: torch.randint(-3, 4, shape, generator=g).to(dtype)  # noqa: E731
    params = {"a": ints(2, 2), "b": ints(4)}
    batches = [(ints(2, 2) + 0.5 * r, ints(4) + 0.5 * r) for r in range(N)]
    return params, batches, ints(8)


def _flat(p) -> torch.Tensor:
    return torch.cat([p["a"].reshape(-1), p["b"].reshape(-1)])


def _mean_grad(p: torch.Tensor, batches) -> torch.Tensor:
    """ḡ as the step computes it, `Σ_r fl(p - y_r) · fl(1/N)` (each rank's gradient scaled, then
    summed), from a view of p: its cotangent reaches p as one term, `Σ_r w / N = w` exactly, as
    the adjoint of the step's reduction brings it to each rank's copy."""
    r = p.view_as(p)
    return sum((r - _flat({"a": a, "b": b})) * (1.0 / N) for a, b in batches)


# -- the references: torch's single-tensor algorithms, out of place, on the flat vector -------------


def _sgd_ref(lr, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False):
    def update(p, g, state, t):
        g = -g if maximize else g
        if weight_decay != 0:
            g = g.add(p, alpha=weight_decay)
        if momentum == 0:
            return p.add(g, alpha=-lr), state
        buf = g if t == 1 else (state[0] * momentum).add(g, alpha=1 - dampening)
        g = g.add(buf, alpha=momentum) if nesterov else buf
        return p.add(g, alpha=-lr), (buf,)

    return update


def _adam_ref(lr, betas, eps, weight_decay=0.0, amsgrad=False, maximize=False, decoupled=False):
    b1, b2 = betas

    def update(p, g, state, t):
        m, v, *vmax = state
        g = -g if maximize else g
        if weight_decay != 0:
            if decoupled:
                p = p * (1 - lr * weight_decay)
            else:
                g = g.add(p, alpha=weight_decay)
        m = m.lerp(g, 1 - b1)
        v = (v * b2).addcmul(g, g, value=1 - b2)
        vmax = [torch.maximum(vmax[0], v)] if amsgrad else []
        denom = (vmax[0] if amsgrad else v).sqrt() / (1 - b2**t) ** 0.5 + eps
        return p.addcdiv(m, denom, value=-(lr / (1 - b1**t))), (m, v, *vmax)

    return update


# name -> (fzero optimizer of an impl, reference, names of the reference state's fields in the fzero state)
CASES = {
    "sgd": (lambda i: optim.sgd(0.25, impl=i), _sgd_ref(0.25), ()),
    "sgd_momentum_dampening": (lambda i: optim.sgd(0.25, momentum=0.5, dampening=0.25, impl=i),
                               _sgd_ref(0.25, momentum=0.5, dampening=0.25), ("momentum_buffer",)),
    "sgd_nesterov_weight_decay": (lambda i: optim.sgd(0.25, momentum=0.5, nesterov=True, weight_decay=0.25, impl=i),
                                  _sgd_ref(0.25, momentum=0.5, nesterov=True, weight_decay=0.25),
                                  ("momentum_buffer",)),
    "sgd_weight_decay_maximize": (lambda i: optim.sgd(0.25, weight_decay=0.5, maximize=True, impl=i),
                                  _sgd_ref(0.25, weight_decay=0.5, maximize=True), ()),
    "adam": (lambda i: optim.adam(0.25, BETAS, EPS, impl=i), _adam_ref(0.25, BETAS, EPS), ("exp_avg", "exp_avg_sq")),
    "adam_l2_maximize": (lambda i: optim.adam(0.25, BETAS, EPS, weight_decay=0.5, maximize=True, impl=i),
                         _adam_ref(0.25, BETAS, EPS, weight_decay=0.5, maximize=True), ("exp_avg", "exp_avg_sq")),
    "adamw": (lambda i: optim.adamw(0.25, BETAS, EPS, weight_decay=0.5, impl=i),
              _adam_ref(0.25, BETAS, EPS, weight_decay=0.5, decoupled=True), ("exp_avg", "exp_avg_sq")),
    "amsgrad": (lambda i: optim.adam(0.25, BETAS, EPS, amsgrad=True, impl=i),
                _adam_ref(0.25, BETAS, EPS, amsgrad=True), ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
}
IMPLS = ("single", "foreach", "fused")


def _mine(state, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of a full flat: all of it, or its shard where the stage shards params."""
    return full.chunk(N)[state.rank] if state.stage.sharded("params") else full


def _meta(mesh, stage: int, opt, params, batch, c, steps_before: int):
    """On one rank: after `steps_before` plain steps, grad of `<c (this rank's part), new params>`
    through one more step with respect to the held params, the new state that step gave inside the
    transform (aux), and the same step's state taken plainly; plus the state it started from."""
    state = fzero.init(params, opt, stage=stage, mesh=mesh)
    step = fzero.train_step(_loss, engine="func")
    for _ in range(steps_before):
        state, _ = step(state, batch)
    part = _mine(state, c)

    def f(p):
        new, _ = step(state.replace(params=p), batch)
        return (new.params[0] * part).sum(), (new.params, new.opt_state)

    got, (inside_params, inside_opt) = torch.func.grad(f, has_aux=True)(state.params)
    plain, _ = step(state, batch)
    return got[0], (inside_params, inside_opt), (plain.params, plain.opt_state), (state.params[0], state.opt_state[0])


def _whole(stage: int, parts) -> torch.Tensor:
    return torch.cat(parts) if stage == 3 else sum(parts) * (1.0 / N)


def _full(stage: int, parts) -> torch.Tensor:
    """A held "shard" field or params, whole: stage 3's shards concatenated, stage 0's rank 0 copy."""
    return torch.cat(parts) if stage == 3 else parts[0]


def _want(ref, p0: torch.Tensor, state0: tuple, t: int, batches, c: torch.Tensor) -> torch.Tensor:
    """dF/dp serially, `F = <c, new>`, `new = ref(q, ḡ(p), state, t)` with `q` a view of p: the
    update's uses of p are summed first, then ḡ's, as the step's slices of the shard sum them."""

    def f(p):
        q = p.view_as(p)
        new, _ = ref(q, _mean_grad(p, batches), state0, t)
        return (new * c).sum()

    return torch.func.grad(f)(p0)


def _check(name: str, impl: str, stage: int, steps_before: int) -> None:
    make, ref, fields = CASES[name]
    params, batches, c = _data(seed=3)
    mesh = fzero.SimMesh(N)
    out = mesh.run(lambda b: _meta(mesh, stage, make(impl), params, b, c, steps_before),
                   [(b,) for b in batches])
    got = _whole(stage, [o[0] for o in out])
    p0 = _full(stage, [o[3][0] for o in out])
    state0 = tuple(_full(stage, [getattr(o[3][1], f) for o in out]) for f in fields)
    want = _want(ref, p0, state0, steps_before + 1, batches, c)
    where = (impl, stage, steps_before)
    assert torch.equal(got, want), (where, (got - want).abs().max())
    assert not torch.equal(want, c)  # non-vacuous: the update's own derivative is not the identity's
    for _, inside, plain, _ in out:  # the differentiated step's new state: the plain step's bits
        for x, y in zip(inside[0], plain[0]):
            assert torch.equal(x, y), where
        for s, t in zip(inside[1], plain[1]):
            for x, y in zip(s, t):
                assert torch.equal(x, y) and x.dtype == y.dtype, where


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_meta_gradient_through_a_step_is_the_update_s_derivative(name):
    """Every impl, through the first step (the state as init makes it) and through the second (its
    state made by a plain first step: momentum buffers and moments that exist), stages 0 and 3."""
    for impl in IMPLS:
        for stage in (0, 3):
            for steps_before in (0, 1):
                _check(name, impl, stage, steps_before)


def _chain(mesh, stage: int, opt, params, batch):
    """On one rank: grad of `<c (this rank's part), params after two steps>` through both (the
    first step's new state, moments included, carries the derivative into the second)."""
    state = fzero.init(params, opt, stage=stage, mesh=mesh)
    step = fzero.train_step(_loss, engine="func")
    c = _mine(state, _data(seed=3)[2])

    def f(p):
        s1, _ = step(state.replace(params=p), batch)
        s2, _ = step(s1, batch)
        return (s2.params[0] * c).sum()

    return torch.func.grad(f)(state.params)[0]


@pytest.mark.parametrize("name", ["adam", "sgd_momentum_dampening", "amsgrad"])
def test_a_meta_gradient_through_two_steps_carries_the_state_s_derivative(name):
    """d<c, p2>/dp0 through two steps equals the reference's, where the first step's moments depend
    on p0 (a derivative that ends at the second step's params reaches p0 through them too). The
    reference's first step gives the kernels' bits here ("single", "foreach": the same ops)."""
    make, ref, _ = CASES[name]
    params, batches, c = _data(seed=3)
    zeros = tuple(torch.zeros(8, dtype=torch.float64) for _ in range(3 if name == "amsgrad" else 2))
    start = zeros[:1] if name.startswith("sgd") else zeros

    def f(p):
        q = p.view_as(p)
        p1, s1 = ref(q, _mean_grad(p, batches), start, 1)
        q1 = p1.view_as(p1)
        p2, _ = ref(q1, _mean_grad(p1, batches), s1, 2)
        return (p2 * c).sum()

    want = torch.func.grad(f)(_flat(params))
    mesh = fzero.SimMesh(N)
    for impl in ("single", "foreach"):
        for stage in (0, 3):
            got = _whole(stage, mesh.run(lambda b: _chain(mesh, stage, make(impl), params, b), [(b,) for b in batches]))
            assert torch.equal(got, want), (impl, stage, (got - want).abs().max())


def _jvp(mesh, opt, params, batch, t):
    state = fzero.init(params, opt, stage=3, mesh=mesh)
    step = fzero.train_step(_loss, engine="func")
    return torch.func.jvp(lambda p: step(state.replace(params=(p,)), batch)[0].params[0], (state.params[0],), (t,))


def test_a_jvp_through_an_adamw_step_is_the_update_s_derivative():
    """Forward mode (SimMesh(1): forward mode needs one process per rank), every impl: the tangent
    of the new params along t is `(∂new/∂p + ∂new/∂ḡ) t` (H = I), and the primal the plain step's."""
    make, ref, _ = CASES["adamw"]
    params, batches, c = _data(seed=5)
    mesh = fzero.SimMesh(1)
    batch = batches[1]  # half-integers: no gradient element is 0
    zeros = (torch.zeros(8, dtype=torch.float64),) * 2
    _, want = torch.func.jvp(lambda p: ref(p.view_as(p), p - _flat({"a": batch[0], "b": batch[1]}), zeros, 1)[0],
                             (_flat(params),), (c,))
    for impl in IMPLS:
        (primal, tangent), = mesh.run(lambda: _jvp(mesh, make(impl), params, batch, c))
        assert torch.equal(tangent, want), impl
        (plain,) = mesh.run(lambda: fzero.train_step(_loss, engine="func")(
            fzero.init(params, make(impl), stage=3, mesh=mesh), batch)[0].params[0])
        assert torch.equal(primal, plain), impl


# -- refused: optimizers with no differentiable form, and donating steps --------------------------


def _refused(mesh, stage: int, opt, params, batch, donate: bool = False):
    """On one rank: the error message of a derivative through a step (or None); the new params of a
    step under a transform that differentiates nothing through it (the derivative of a scalar
    times the sum of the step's new params) and of a plain step; those of a step whose loss holds
    a vmap over examples and of a plain step. Each step of a fresh state (a donating step consumes
    its input)."""
    fresh = lambda: fzero.init(params, opt, stage=stage, mesh=mesh)  # noqa: E731
    step = fzero.train_step(_loss, engine="func", donate=donate)
    state = fresh()
    try:
        torch.func.grad(lambda p: step(state.replace(params=p), batch)[0].params[0].sum())(state.params)
        msg = None
    except fzero.FzeroError as e:
        msg = f"{type(e).__name__}: {e}"
    x = torch.tensor(3.0, dtype=params["a"].dtype)
    beside = torch.func.grad(lambda s: s * step(fresh(), batch)[0].params[0].sum())(x)
    per_example = lambda p, b: torch.func.vmap(lambda ya, yb: _loss(p, (ya, yb)))(*b).sum()  # noqa: E731
    rows = tuple(y[None] for y in batch)
    vmapped = fzero.train_step(per_example, engine="func", donate=donate)(fresh(), rows)[0].params[0]
    return msg, (beside, step(fresh(), batch)[0].params[0].sum()), (vmapped, step(fresh(), batch)[0].params[0])


@pytest.mark.parametrize("name", ["lamb", "adafactor"])
def test_a_derivative_through_lamb_or_adafactor_raises_on_every_rank(name):
    """Their update is made of host floats from exact sums: refused, naming the optimizer, why and
    the ones that are differentiable, at stages 0 and 3 on every rank. A step under a transform
    that does not differentiate through it, or with a vmap inside its loss, runs as before."""
    opt = optim.lamb(0.25) if name == "lamb" else optim.adafactor(0.25)
    params, batches, _ = _data(seed=1, dtype=torch.float32)
    mesh = fzero.SimMesh(N)
    for stage in (0, 3):
        out = mesh.run(lambda b: _refused(mesh, stage, opt, params, b), [(b,) for b in batches])
        for msg, (beside, plain), (vmapped, plain_again) in out:
            assert msg is not None and msg.startswith(f"OptimizerError: {name}: a derivative is being taken through "
                                                      f"its update"), msg
            assert re.search(r"Python floats .* exact sums .* sgd \(every impl.*adam / adamw", msg), msg
            assert torch.equal(beside, plain) and torch.equal(vmapped, plain_again)


@pytest.mark.parametrize("name", ["sgd", "adam"])
def test_a_derivative_through_a_donating_step_raises_on_every_rank(name):
    """Every stage: a `ConfigError` naming donate=False and the differentiable optimizers (before:
    torch's "a view of a leaf Variable that requires grad is being used in an in-place operation").
    A donating step under a transform that differentiates nothing through it, or with a vmap
    inside its loss, runs as before."""
    make = CASES[name][0]
    params, batches, _ = _data(seed=1)
    mesh = fzero.SimMesh(N)
    for stage in range(4):
        out = mesh.run(lambda b: _refused(mesh, stage, make("foreach"), params, b, donate=True),
                       [(b,) for b in batches])
        for rank, (msg, (beside, plain), (vmapped, plain_again)) in enumerate(out):
            assert msg is not None and msg.startswith("ConfigError: train_step(..., donate=True) is being "
                                                      "differentiated through"), msg
            assert f"rank {rank}, stage {stage}" in msg and "Use donate=False" in msg, msg
            assert torch.equal(beside, plain) and torch.equal(vmapped, plain_again)


def test_an_in_place_update_refuses_a_derivative():
    """`Optimizer.update_` (and a prepared launch) writes its inputs: a derivative through it is
    refused with the way out (the pure update); the pure update's derivative is -lr."""
    from fzero._src.layout import ParamGroup, Segment

    opt = optim.adam(0.25, BETAS, EPS)
    ctx = optim.UpdateContext(0, ParamGroup(), (Segment(0, 0, 0, 4),), (0,), (True,))
    p, g = torch.tensor([1.0, 2.0, -1.0, 0.5]), torch.tensor([0.5, -1.0, 2.0, 1.0])
    s = optim.init_state(opt, p, [(4,)])

    def in_place(x):
        fresh = type(s)(*[t.clone() for t in s])
        q = p.clone()
        opt.update_(x, fresh, q, ctx)
        return q.sum()

    with pytest.raises(optim.OptimizerError, match=r"adam: a derivative is being taken through an in-place update "
                                                   r".*Call the pure update"):
        torch.func.grad(in_place)(g)
    with pytest.raises(optim.OptimizerError, match=r"a prepared update \(Optimizer.prepare_\): a derivative"):
        torch.func.grad(lambda x: opt.prepare_(s, p.clone(), ctx)(x).exp_avg.sum())(g)
    got = torch.func.grad(lambda x: opt.update(x, s, p, ctx)[1].exp_avg.sum())(g)
    assert torch.equal(got, torch.full((4,), 1 - BETAS[0]))


def _autograd_meta(mesh, stage: int, opt, params, batch, c):
    """`_meta`'s derivative (through the first step) by plain autograd: params that require grad."""
    state = fzero.init(params, opt, stage=stage, mesh=mesh)
    p = state.params[0].detach().requires_grad_()
    new, _ = fzero.train_step(_loss, engine="func")(state.replace(params=(p,)), batch)
    return torch.autograd.grad((new.params[0] * _mine(state, c)).sum(), p)[0]


@pytest.mark.parametrize("name", ["adam", "sgd_momentum_dampening"])
def test_a_meta_gradient_by_plain_autograd_is_the_update_s_derivative(name):
    """The same derivative where autograd, not torch.func, differentiates through the step (params
    that require grad), every impl, stages 0 and 3."""
    make, ref, _ = CASES[name]
    params, batches, c = _data(seed=3)
    state0 = (torch.zeros(8, dtype=torch.float64),) * 2
    want = _want(ref, _flat(params), state0, 1, batches, c)
    mesh = fzero.SimMesh(N)
    for impl in IMPLS:
        for stage in (0, 3):
            got = _whole(stage, mesh.run(lambda b: _autograd_meta(mesh, stage, make(impl), params, b, c),
                                         [(b,) for b in batches]))
            assert torch.equal(got, want), (impl, stage, (got - want).abs().max())


def test_the_differentiated_update_gives_the_plain_update_s_bits_in_every_dtype():
    """`Optimizer.update` under torch.func.grad (with respect to the grad and the param) returns the
    plain update's bits, every impl, float32 / float64 / bfloat16 / float16 (whose CPU adds the
    optimizers compute themselves, `optim.ops`), on a shard of a used leaf, an unused leaf and
    padding, at the first update and at a later one with mixed step counts; or raises the plain
    update's error (a fused kernel torch lacks)."""
    from fzero._src.layout import ParamGroup, Segment

    segments = (Segment(0, 0, 0, 8), Segment(1, 0, 8, 12), Segment(2, 0, 12, 20))
    g = torch.Generator().manual_seed(9)
    compared = set()
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        p, grad = (torch.randn(24, generator=g).to(dtype) for _ in range(2))
        for name, (make, _, _) in CASES.items():
            for impl in IMPLS:
                opt = make(impl)
                ctxs = [optim.UpdateContext(k, ParamGroup(), segments, (0, 1, 2), used, leaf_numels=(8, 4, 8))
                        for k, used in ((0, (True, False, True)), (1, (True, True, True)))]
                state, param = optim.init_state(opt, p, [(8,), (4,), (8,)]), p
                for ctx in ctxs:
                    try:
                        want = opt.update(grad, state, param, ctx)
                    except optim.OptimizerError as e:
                        with pytest.raises(optim.OptimizerError, match=re.escape(str(e))):
                            torch.func.grad(lambda x: opt.update(x, state, param, ctx)[0].sum())(grad)
                        break

                    def f(x, q):
                        new = opt.update(x, state, q, ctx)
                        return new[0].float().sum(), new

                    _, got = torch.func.grad(f, argnums=(0, 1), has_aux=True)(grad, param)
                    where = (name, impl, dtype, ctx.step)
                    assert torch.equal(got[0], want[0]), where
                    assert all(torch.equal(x, y) for x, y in zip(got[1], want[1])), where
                    compared.add((impl, dtype))
                    param, state = want
    assert len(compared) == len(IMPLS) * 4  # every impl compared in every dtype (fused: some optimizers)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_step_differentiated_at_three_ranks_gives_the_plain_steps_bits(stage):
    """At N = 3, where 1/N is inexact, a step differentiated through (torch.func.grad of its new
    params' sum with respect to a scale the loss closes over: the blocking, differentiable
    reduction) gives the new params of the same step run plainly (the overlapped one), bit for bit:
    both are DDP's sum of fl(1/N) g_r. A mutation audit found `grad / N` in the differentiable
    reduction unseen: at N = 2 both are exact."""
    mesh = fzero.SimMesh(3)

    def rank_fn():
        w = torch.randn(96, generator=torch.Generator().manual_seed(0))
        x = torch.randn(96, generator=torch.Generator().manual_seed(10 + mesh.rank))
        state = fzero.init({"w": w}, optim.sgd(0.1), stage=stage, mesh=mesh)

        def loss(scale):
            return lambda p, b: ((p["w"] * b).sum() * scale).square()

        plain = fzero.gather(fzero.train_step(loss(torch.tensor(1.0)), engine="func")(state, x)[0])["w"]
        kept = {}

        def meta(scale):
            new = fzero.train_step(loss(scale), engine="func")(state, x)[0]
            kept["w"] = new.params[0].detach()
            return new.params[0].sum()

        torch.func.grad(meta)(torch.tensor(1.0))
        return plain, kept["w"]

    out = mesh.run(rank_fn)
    plain = out[0][0]
    got = torch.cat([k for _, k in out]) if stage == 3 else out[0][1]
    assert torch.equal(got[:plain.numel()], plain)
