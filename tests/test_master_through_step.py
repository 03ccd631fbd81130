"""A derivative through a step under a precision policy with a wider master, at stages 1-2, where
the state keeps its master values (`state.master`, each rank's fp32 shard) apart from the 16-bit
copy the forward reads (`state.params`): taken with respect to one of the two alone it missed the
part through the other, silently (stage 1 lacked the identity term, stage 2 was zero; found in
review of a torch.func researcher, docs/func.md). Now refused on every rank; taken with respect to
both and added as the message says, it is stage 0's derivative, bit for bit."""

from __future__ import annotations

import pytest
import torch
from torch.func import grad

import fzero
from fzero import layout as L
from fzero import optim

POLICY = fzero.Precision(torch.bfloat16, torch.float32)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1))


def _data(r: int):
    g = torch.Generator().manual_seed(r)
    x = torch.randn(5, 4, generator=g)
    return x, torch.sin(x.sum(1))


def _run(stage: int, wrt: str, frozen: bool = False):
    """Each rank's derivative of <1, the new params' values> with respect to `wrt` ("params",
    "master" or "both": the params and the masters that exist, as the refusal's recipe puts it),
    or the `ConfigError` it raised. With `frozen`, the first layer is frozen: its bucket keeps no
    master (found in review: the recipe's `state.master` held a None there, which torch.func
    refuses)."""
    model = _model()
    if frozen:
        model[0].requires_grad_(False)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    mesh = fzero.SimMesh(2)

    def rank():
        state = fzero.init(params, optim.sgd(0.5), stage=stage, mesh=mesh, units=info.units, groups=info.groups,
                           precision=POLICY)
        step = fzero.train_step(lambda p, b: ((apply(p, b[0].bfloat16()).float().squeeze(-1) - b[1]) ** 2).mean(),
                                engine="func")
        kept = [b for b, m in enumerate(state.master) if m is not None]

        def total(p, ms):
            master = tuple(ms[kept.index(b)] if b in kept else None for b in range(len(p)))
            new = step(state.replace(params=p, master=master), _data(mesh.rank))[0]
            flats = [f.to(b.dtype) for f, b in zip(new.params, new.layout.buckets)]
            if stage == 3:
                flats = [fzero.collectives.all_gather(f, mesh) for f in flats]
            return sum(v.sum() for v in L.unpack(new.layout, flats).values())

        argnums = {"params": 0, "master": 1, "both": (0, 1)}[wrt]
        try:
            return grad(total, argnums=argnums)(state.params, tuple(state.master[b] for b in kept)), kept
        except fzero.ConfigError as e:
            return e, kept

    return mesh.run(rank)


@pytest.mark.parametrize("stage,wrt", [(1, "params"), (1, "master"), (2, "params")])
def test_a_derivative_wrt_the_params_or_the_master_alone_is_refused_on_every_rank(stage, wrt):
    for e, _ in _run(stage, wrt):
        assert isinstance(e, fzero.ConfigError), e
        assert f"with respect to state.{wrt} alone" in str(e) and "argnums=(0, 1)" in str(e)
        assert f"stage {stage}" in str(e) and "'0.weight'" in str(e)


@pytest.mark.parametrize("frozen", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_both_added_as_the_message_says_is_stage_0s_derivative(stage, frozen):
    """Stage 0's derivative is per copy too (docs/func.md: summed over the ranks); each bucket's
    params part summed over the ranks plus its master shards joined is that sum, bit for bit (a
    frozen bucket, which keeps no master: its params part alone)."""
    stage0, outs = _run(0, "params", frozen), _run(stage, "both", frozen)
    kept = outs[0][1]
    assert kept == ([1] if frozen else [0, 1])
    for b in range(len(stage0[0][0])):
        reference = sum(out[0][b] for out in stage0)
        summed = sum(out[0][0][b].float() for out in outs)  # the params' part: one copy per rank
        n = reference.numel()
        if b not in kept:
            assert torch.equal(summed[:n], reference)
            continue
        joined = torch.cat([out[0][1][kept.index(b)] for out in outs])  # the master's: each rank's shard
        assert torch.equal(summed[:n] + joined[:n], reference), (b, summed + joined, reference)
        if stage == 1:  # neither part alone is it
            assert not torch.equal(summed[:n], reference) and not torch.equal(joined[:n], reference)
        else:  # stage 2 differentiates the master shard itself: its part is whole, and it alone is not refused
            master_alone = _run(2, "master", frozen)
            assert torch.equal(torch.cat([out[0][kept.index(b)] for out in master_alone])[:n], reference)


def test_stages_0_and_3_are_not_refused():
    for stage in (0, 3):
        assert all(isinstance(out[0][0], torch.Tensor) for out in _run(stage, "params"))


def test_the_messages_recipe_names_the_masters_that_exist():
    for e, _ in _run(1, "params", frozen=True):
        assert "kept = [b for b, m in enumerate(state.master) if m is not None]" in str(e)
