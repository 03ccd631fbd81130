"""Transforms through a checkpointed unit (`from_module(..., remat=...)`, fzero/_src/remat.py):
a derivative through a step, a gradient taken over the unit in a func-engine step, forward mode
and vmap give the bits of the run without checkpointing (found in review: remat's recompute
under torch.func detached its saved inputs, and `detach()` under torch.func detaches at every
level, so a meta-gradient through a step was 0.1-0.26 off on values of about 1, silently; jvp
and vmap raised torch's "not implemented" errors)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fzero

from .test_remat import _Penalised
from fzero import ConfigError

# torch 2.13 loads its forward-AD decompositions through torch.jit.script on the first jvp of a
# process, which warns (torch's own deprecation): load them once here, quietly (as tests/func_cases.py)
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="`torch.jit.script` is deprecated", category=DeprecationWarning)
    torch.func.jvp(torch.sin, (torch.zeros(1),), (torch.ones(1),))


def _mlp(dropout: float = 0.0) -> torch.nn.Module:
    """Three units (one per linear; the first with its activation and dropout in its home), float64."""
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Dropout(dropout)),
        torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh()), torch.nn.Linear(6, 3)).double()


def _batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(5, 3, generator=g, dtype=torch.float64)


def _on_ranks(n, stage, remat, body, model=_mlp):
    """`body(state, apply, mesh)` on every rank of `SimMesh(n)`, a fresh SGD(0.25) state of
    `model()` at `stage`, every unit checkpointed where `remat`; the ranks' results."""
    module = model()
    params, apply, info = fzero.from_module(module, units=lambda p: p.split(".")[0], remat=remat)
    mesh = fzero.SimMesh(n)

    def rank_fn():
        state = fzero.init(params, fzero.optim.sgd(0.25), stage=stage, mesh=mesh, units=info.units)
        return body(state, apply, mesh)

    return mesh.run(rank_fn)


def _mse(apply):
    return lambda p, b: ((apply(p, b[0]) - b[1]) ** 2).mean()


def _assert_same_bits(run):
    want, got = run(False), run(True)
    for w, g in zip(want, got):
        assert len(w) == len(g)
        for a, b in zip(w, g):
            assert torch.equal(a, b), float((a - b).abs().max())


@pytest.mark.parametrize("wrt", ["params", "batch"])
@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_derivative_through_a_step_with_remat_is_the_bits_without_it(stage, n, wrt):
    """`torch.func.grad` of a function of `step(state, batch)` (`engine="func"`) with respect to
    the params (a meta-gradient, reverse over reverse: the curvature reaches the params through
    remat's backward) or to the batch (dataset distillation: an input whose gradient the step's
    own transform never asks for, but the outer one does), every unit checkpointed: the bits of
    the run without remat, stages 0 and 3, N = 1 and 2. Before, 0.1-0.26 off (params) and 0.05
    off (batch)."""
    def body(state, apply, mesh):
        step = fzero.train_step(_mse(apply), engine="func")
        x, y = _batch(mesh.rank)
        if wrt == "params":
            f = lambda p: sum(t.sum() for t in step(state.replace(params=p), (x, y))[0].params)
            return list(torch.func.grad(f)(state.params))
        f = lambda x: sum(t.square().sum() for t in step(state, (x, y))[0].params)
        return [torch.func.grad(f)(x)]

    _assert_same_bits(lambda remat: _on_ranks(n, stage, remat, body))


def _penalised_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), _Penalised(4), torch.nn.Linear(4, 3)).double()


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_gradient_over_a_checkpointed_unit_in_a_func_engine_step_keeps_its_bits(stage, n):
    """A gradient taken over a checkpointed unit inside the forward (`create_graph=True`), two
    SGD steps with `engine="func"`: the bits of the run without remat. remat's backward runs
    under the step's torch.func level there; before, it detached the saved inputs and the
    second derivative was lost (0.03 off after one step). (The autograd engine was right:
    tests/test_remat.py::test_remat_gives_the_bits_of_the_run_without_it_where_the_forward_used_to_differ,
    its "gradient_over_the_unit" case.)"""
    def body(state, apply, mesh):
        step = fzero.train_step(_mse(apply), engine="func")
        for _ in range(2):
            state, _ = step(state, _batch(mesh.rank))
        return list(fzero.gather(state).values())

    _assert_same_bits(lambda remat: _on_ranks(n, stage, remat and ["2"], body, _penalised_model))


@pytest.mark.parametrize("stage", [0, 3])
def test_forward_mode_through_a_checkpointed_step_is_the_bits_without_it(stage):
    """`torch.func.jvp` of a step (a forward-over-reverse HVP), `torch.func.jvp` inside the loss,
    `jacrev` of a step and `hessian` (jacfwd of jacrev) with respect to the batch, every unit
    checkpointed, SimMesh(1) (forward mode needs one process per rank, docs/func.md): the bits
    without remat. Before, torch's "You must implement the jvp function" or "does not have vmap
    support"; jacrev was 0.08 off."""
    def body(state, apply, mesh):
        x, y = _batch(0)
        step = fzero.train_step(_mse(apply), engine="func")
        new = lambda p: step(state.replace(params=p), (x, y))[0].params
        _, hvp = torch.func.jvp(new, (state.params,), (tuple(torch.ones_like(t) for t in state.params),))
        jac = torch.func.jacrev(lambda p: torch.cat([t[:9] for t in new(p)]))(state.params)
        hess = torch.func.hessian(lambda x: sum(t.square().sum() for t in step(state, (x, y[:2]))[0].params))(x[:2])

        def tangent_loss(p, b):
            out, t = torch.func.jvp(lambda x: apply(p, x), (b[0],), (torch.ones_like(b[0]),))
            return ((out - b[1]) ** 2).mean() + 0.1 * t.square().mean()

        inside, _ = fzero.train_step(tangent_loss, engine="func")(state, (x, y))
        return [*hvp, *jac, hess, *inside.params]

    _assert_same_bits(lambda remat: _on_ranks(1, stage, remat, body))


@pytest.mark.parametrize("engine", ["autograd", "func"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_checkpointed_unit_under_vmap_is_the_bits_without_it(stage, engine):
    """The model vmapped over the examples inside the loss (`randomness="different"`, dropout
    0.3 in the first unit; and a vmap inside a vmap), every unit checkpointed, two SGD steps:
    the bits of the run without remat. `_Remat.vmap` checkpoints the vmapped forward, so the
    recompute runs its ops (a generated vmap rule, which vmaps the Function's backward, gave
    other bits: 5.6e-17 off). Before, torch's "does not have vmap support"."""
    def body(state, apply, mesh):
        def loss(p, b):
            once = torch.func.vmap(lambda x: apply(p, x), randomness="different")(b[0])
            pairs = torch.stack([b[0], 2 * b[0]], 1)
            twice = torch.func.vmap(torch.func.vmap(lambda x: apply(p, x), randomness="different"),
                                    randomness="different")(pairs).mean(1)
            return ((once - b[1]) ** 2).mean() + ((twice - b[1]) ** 2).mean()

        torch.manual_seed(1)
        step = fzero.train_step(loss, engine=engine)
        for _ in range(2):
            state, _ = step(state, _batch(0))
        return list(fzero.gather(state).values())

    _assert_same_bits(lambda remat: _on_ranks(1, stage, remat, body, lambda: _mlp(0.3)))


def test_a_checkpointed_unit_under_a_plain_dual_level_is_refused():
    """`torch.autograd.forward_ad.dual_level` reaching a checkpointed unit: `ConfigError` naming
    the unit and `torch.func.jvp` (remat's tangents come from a recompute under
    `torch.func.jvp`, which torch cannot nest in a dual level). Before, torch's "You must
    implement the jvp function"."""
    fw = torch.autograd.forward_ad

    def body(state, apply, mesh):
        def loss(p, b):
            with fw.dual_level():
                t = fw.unpack_dual(apply(p, fw.make_dual(b[0], torch.ones_like(b[0])))).tangent
            return t.square().mean()

        return fzero.train_step(loss)(state, _batch(0))

    with pytest.raises(ConfigError, match=r"checkpointed unit '0'.*dual_level.*torch\.func\.jvp"):
        _on_ranks(1, 0, True, body)
