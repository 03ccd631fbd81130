"""A forward-mode transform inside a stage-3 loss (a Jacobian penalty by `jacfwd` of the model
with respect to its input), `engine="autograd"`, on-use gathering: the model's units, released
after the first run, are read again inside the transform. Before, torch's bare
`NotImplementedError: Cannot access storage of TensorWrapper` from inside the gather (found in
review of a torch.func researcher); now a `ConfigError` naming the ways out, and the one that runs
on a SimMesh (the params read first, `dict(p)`) has stage 0's bits."""

from __future__ import annotations

import pytest
import torch

import fzero
from fzero import optim

# torch 2.13 loads its forward-AD decompositions through torch.jit.script on the first jvp (tests/func_cases.py)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")


def _setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    return fzero.from_module(model, units=fzero.units_by_prefix(model, ""))


def _penalised(apply, first):
    def loss(p, x):
        w = first(p)
        out = apply(w, x)
        jac = torch.func.jacfwd(lambda xi: apply(w, xi[None])[0])(x[0])  # the input-Jacobian penalty
        return out.square().mean() + jac.square().mean()

    return loss


def _train(stage, first, **step_kw):
    params, apply, info = _setup()
    mesh = fzero.SimMesh(2)
    g = torch.Generator().manual_seed(3)
    xs = [(torch.randn(5, 4, generator=g),) for _ in range(2)]

    def rank(x):
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units, groups=info.groups)
        try:
            state, _ = fzero.train_step(_penalised(apply, first), **step_kw)(state, x)
        except (fzero.ConfigError, fzero.ForwardModeOnSimMesh) as e:
            return e
        return fzero.gather(state)

    return mesh.run(rank, xs)


def test_a_released_unit_read_again_under_forward_mode_is_a_config_error_naming_the_ways_out():
    for e in _train(3, lambda p: p):
        assert isinstance(e, fzero.ConfigError), e
        assert "forward-mode transform" in str(e) and "read unit '0' again" in str(e)
        assert "engine='func'" in str(e) and "w = dict(params)" in str(e)


def test_the_params_read_first_has_stage_0s_bits():
    reference = _train(0, lambda p: p)
    for got, want in zip(_train(3, dict), reference):
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_with_engine_func_on_a_simmesh_the_error_names_the_params_read_first_which_runs():
    """`engine="func"` keeps the units gathered, so the first read inside the transform is a
    gather under forward mode: `ForwardModeOnSimMesh`, whose way out for a loss is named now
    (found in review: DistMesh, SimMesh(1) or reverse mode only)."""
    params, apply, info = _setup()
    mesh = fzero.SimMesh(2)

    def rank():
        state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=info.units, groups=info.groups)

        def loss(p, x):  # the first read of unit '0' inside jvp
            return torch.func.jvp(lambda xi: apply(p, xi), (x,), (torch.ones_like(x),))[1].square().mean()

        with pytest.raises(fzero.ForwardModeOnSimMesh, match=r"read the params first \(w = dict\(params\)\)"):
            fzero.train_step(loss, engine="func")(state, torch.ones(5, 4))

    mesh.run(rank)
    reference = _train(0, lambda p: p, engine="func")
    for got, want in zip(_train(3, dict, engine="func"), reference):
        assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.dist
def test_plain_forward_ad_re_reading_a_released_unit_has_stage_0s_bits(dist2):
    """Plain `torch.autograd.forward_ad` (no torch.func wrappers) reads a re-gathered unit as
    before: not refused (found in review of the refusal's first version, which refused any
    forward-AD level and broke this, stage 0's bits before)."""
    from . import dist_cases

    reference = dist2.run(dist_cases.forward_ad_reread, [(0,)] * 2)
    for got, want in zip(dist2.run(dist_cases.forward_ad_reread, [(3,)] * 2), reference):
        assert all(torch.equal(got[k], want[k]) for k in want)
