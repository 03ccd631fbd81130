"""Edges of derivatives through a step (review of the fix that made stage 2-3 hypergradients with
respect to the batch or a closed-over tensor the unsharded ones, docs/func.md "The loss a step
differentiates, and the factor 1/N").

- Found in review: a second forward-mode derivative through a step (a forward-over-reverse HVP,
  `torch.func.jvp` of `torch.func.grad` of a meta-loss, or `torch.func.hessian`) in the same
  process raised torch's internal assert "level <= current_level ... escaped?". The unit's
  probes (`unit.Probe.of`) and the zeros they view (`unit.shared_zeros`), cached for every later
  step, were made inside the first jvp, where `torch.zeros` and `detach()` give tensors wrapped
  at that transform's level; the next transform met them after that level had closed.
- Covered here as well (they hold): N = 3 (fl(1/3) is inexact) at stages 2-3 against stage 0,
  with micro-batches and clipping; a step nested in another step's loss (MAML) against the
  unsharded computation.
"""

from __future__ import annotations

import warnings

import optree
import pytest
import torch

import fzero
from fzero import optim
from fzero._src import plan, unit

D = torch.float64
A = torch.tensor([1.0, -2.0], dtype=D)
X = torch.tensor([0.5, 1.5], dtype=D)

# torch 2.13 loads its forward-AD decompositions through torch.jit.script on the first jvp of a
# process, which warns (torch's own deprecation): load them once here, quietly (as tests/func_cases.py)
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated", category=DeprecationWarning)
    torch.func.jvp(torch.sin, (torch.zeros(1),), (torch.ones(1),))


def _plain_meta(lam: torch.Tensor) -> torch.Tensor:
    """sum of one SGD(0.25) step's new `a` on (a . x)^2 lam^2, unsharded, one rank."""
    g = torch.func.grad(lambda a: (a * X).sum() ** 2 * lam.square().sum())(A)
    return (A - 0.25 * g).sum()


def _hvp(meta, lam):
    """d^2 meta / d lam^2 along 1, forward over reverse."""
    one = torch.ones(1, dtype=D)
    return torch.func.jvp(torch.func.grad(meta), (lam,), (one,))[1]


@pytest.mark.parametrize("stage", [0, 3])
def test_a_second_forward_over_reverse_derivative_through_a_step_works(stage, monkeypatch):
    """Two forward-over-reverse HVPs through a step on one state, one after the other, both the
    unsharded one bit for bit (exact data: 5.0). Before: the second raised torch's internal
    assert, silently set up by the first (the caches of probes and zeros held tensors wrapped at
    the first jvp's level). The caches start empty, as in a fresh process, whatever ran before."""
    monkeypatch.setattr(unit, "_SHARED_ZEROS", {})
    monkeypatch.setattr(plan, "_PROBES", {})
    mesh = fzero.SimMesh(1)
    lam = torch.ones(1, dtype=D)
    want = _hvp(_plain_meta, lam)
    assert want.item() == 5.0

    def rank_fn():
        state = fzero.init({"a": A}, optim.sgd(0.25), stage=stage, mesh=mesh)

        def meta(lam):
            step = fzero.train_step(lambda p, b: (p["a"] * b).sum() ** 2 * lam.square().sum(), engine="func")
            return step(state, X)[0].params[0].sum()

        return _hvp(meta, lam), _hvp(meta, lam)

    first, second = mesh.run(rank_fn)[0]
    assert torch.equal(first, want) and torch.equal(second, want)


# -- N = 3, stages 2-3 against stage 0, micro-batches and clipping ----------------------------

P = {"a": torch.tensor([1.0, -2.0, 0.5, 1.0], dtype=D), "b": torch.tensor([[0.5, 1.0], [-1.0, 0.25]], dtype=D),
     "f": torch.tensor([1.0, 0.5], dtype=D)}
XS = [torch.tensor([0.5, 1.5, -1.0, 2.0], dtype=D), torch.tensor([-1.0, 2.0, 0.25, 0.5], dtype=D),
      torch.tensor([2.0, -0.5, 1.0, -1.0], dtype=D)]
C = {"a": torch.tensor([1.0, 2.0, -1.0, 0.5], dtype=D), "b": torch.tensor([[1.0, -1.0], [0.5, 2.0]], dtype=D)}
FROZEN = [fzero.ParamGroup("hyper", match=lambda path: path == "f", frozen=True)]


def _loss(p, x, lam):
    h = (p["a"] * x).sum() + (p["b"] @ x[:2]).sum() * p["f"].sum()
    return h ** 2 * lam.sum() + (p["b"] ** 2).sum() * 0.5


def _new_params(new, stage, mesh):
    held = [fzero.collectives.all_gather(b, mesh) if stage == 3 else b for b in new.params]
    return fzero.layout.unpack(new.layout, held)


def _hypergradients(stage: int, n: int) -> list:
    """Each rank's (d/d held params, d/d lam, d/d its micro-batches) of sum(C * new params) after
    one SGD step of 2 micro-batches with clipping, on SimMesh(n); params' as one full pytree."""
    mesh = fzero.SimMesh(n)

    def rank_fn():
        state = fzero.init(P, optim.sgd(0.25), stage=stage, mesh=mesh, groups=FROZEN, units=lambda p: p)

        def meta(held, lam, xs):
            step = fzero.train_step(lambda p, b: _loss(p, b, lam), engine="func", micro_batches=2, clip_norm=1.0)
            new = _new_params(step(state.replace(params=held), xs)[0], stage, mesh)
            return sum((C[k] * new[k]).sum() for k in C)

        x = XS[mesh.rank]
        return torch.func.grad(meta, argnums=(0, 1, 2))(state.params, torch.tensor([0.5], dtype=D),
                                                        [x, x.flip(0) * 0.5]), state.layout

    outs = mesh.run(rank_fn)
    layout = outs[0][1]
    full = [torch.cat([g[0][b] for g, _ in outs]) if stage == 3 else sum(g[0][b] for g, _ in outs)
            for b in range(len(layout.buckets))]
    return [fzero.layout.unpack(layout, full), sum(g[1] for g, _ in outs), [g[2] for g, _ in outs]]


@pytest.mark.parametrize("stage", [2, 3])
def test_hypergradients_at_three_ranks_with_micro_batches_and_clipping_are_stage_0_s(stage):
    """N = 3, where fl(1/3) rounds: the derivatives with respect to the params, a frozen leaf, a
    closed-over tensor and each micro-batch of each rank are stage 0's (which the fix does not
    touch) to a few ulps: the sharded stages multiply by fl(1/3) on the cotangent at another
    point of the chain than stage 0 and sum in another order, each a relative rounding of
    2^-53 per operation on values of about 1-40 over some tens of operations: 1e-14 relative.
    Before the fix the closed-over tensor's and the batch's were 3 times stage 0's."""
    want = optree.tree_leaves(_hypergradients(0, 3))
    got = optree.tree_leaves(_hypergradients(stage, 3))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-14, atol=1e-14 * max(t.abs().max().item() for t in want))


# -- a step in another step's loss (MAML) -------------------------------------------------------

AB = {"a": P["a"], "b": P["b"]}


def _maml_loss(q, x):
    return _loss({**q, "f": P["f"]}, x, torch.tensor([0.5], dtype=D))


def _maml_unsharded(n: int) -> dict:
    """One outer SGD(0.25) step on the mean over ranks of L(inner(p), flip(x_r)), inner(p) one
    SGD(0.25) step on the mean over ranks of L(p, x_r): one process, plain torch.func."""
    def inner(q):
        gs = [torch.func.grad(_maml_loss)(q, x) for x in XS[:n]]
        return {k: q[k] - 0.25 * sum(g[k] * (1.0 / n) for g in gs) for k in q}

    gs = [torch.func.grad(lambda q: _maml_loss(inner(q), x.flip(0)))(AB) for x in XS[:n]]
    return {k: AB[k] - 0.25 * sum(g[k] * (1.0 / n) for g in gs) for k in AB}


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_step_in_another_step_s_loss_is_the_unsharded_maml_step(stage):
    """An inner func-engine step on a state whose params are the outer loss's (packed with
    `fzero.layout.pack`, this rank's shards at stage 3) inside the outer step's loss: the outer
    step gives the unsharded MAML step, bit for bit at N = 2 (exact data). The inner step's units
    run their backward at the outer step's level as the gather's adjoint, its own level as the
    mean (`unit.differentiating`)."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(AB, optim.sgd(0.25), stage=stage, mesh=mesh, units=lambda p: p)
        template = fzero.init(AB, optim.sgd(0.25), stage=stage, mesh=mesh, units=lambda p: p)

        def outer_loss(p, x):
            flats = fzero.layout.pack(template.layout, {"a": p["a"], "b": p["b"]})
            if stage == 3:
                flats = fzero.layout.local_shards(template.layout, flats, mesh.rank)
            inner = fzero.train_step(_maml_loss, engine="func")(template.replace(params=list(flats)), x)[0]
            return _maml_loss(_new_params(inner, stage, mesh), x.flip(0))

        new = fzero.train_step(outer_loss, engine="func")(state, XS[mesh.rank])[0]
        return _new_params(new, stage, mesh)

    want = _maml_unsharded(2)
    for got in mesh.run(rank_fn):
        for k in want:
            assert torch.equal(got[k], want[k]), (k, got[k], want[k])
