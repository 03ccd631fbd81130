"""What a stage-3 user's unit settings choose, said where it is nothing (found in review of a
stage-3 user): `units_by_prefix` read on another module than the one given to `from_module` (a
wrapper's inner model, the model beside its `torch.compile`d form) put every parameter in one
unit, and `remat=True` over units with no home submodule checkpointed nothing, each without a
word (docs/bad-input.md rows 234-235); ranks whose `prefetch` differs are told that setting may
be why (row 44)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fzero


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


class _Wrapper(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = _Blocks()

    def forward(self, x):
        return self.model(x)


def test_a_prefix_read_on_another_module_is_refused_naming_the_way():
    w = _Wrapper()
    with pytest.raises(fzero.ConfigError, match=r"units=units_by_prefix\(..., 'blocks'\) puts none of this module's "
                                                r"parameters in a unit of its own: none of their names "
                                                r"\(\['model.blocks.0.weight'"):
        fzero.from_module(w, units=fzero.units_by_prefix(w.model, "blocks"))
    params, _, info = fzero.from_module(w, units=fzero.units_by_prefix(w, "model.blocks"))
    assert sorted({info.units(n) for n in params}) == ["default", "model.blocks.0", "model.blocks.1"]


def test_a_prefix_read_on_a_model_of_fewer_blocks_is_refused_naming_the_unseen_ones():
    """Units made on a 2-block model given a 3-block one: the third block went to 'default',
    silently (found in review of the first version of the check)."""
    small, big = _Blocks(), _Blocks()
    big.blocks.append(nn.Linear(4, 4))
    with pytest.raises(fzero.ConfigError, match=r"children \['blocks.0', 'blocks.1'\], and this module's parameters "
                                                r"lie under \['blocks.2'\] too \('blocks.2.(weight|bias)'\)"):
        fzero.from_module(big, units=fzero.units_by_prefix(small, "blocks"))


def test_a_weight_shared_block_under_several_names_is_taken():
    """One block registered twice (ALBERT): its parameters' first names lie outside the container,
    their other names under each of its children; taken, as before the check (a review of its first
    version found it refused, blaming the module it was read on)."""
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared = nn.Linear(4, 4)
            self.blocks = nn.ModuleList([self.shared, self.shared])
            self.head = nn.Linear(4, 2)

        def forward(self, x):
            for b in self.blocks:
                x = torch.tanh(b(x))
            return self.head(x)

    m = Shared()
    params, _, info = fzero.from_module(m, units=fzero.units_by_prefix(m, "blocks"))
    assert info.aliases["shared.weight"] == ("shared.weight", "blocks.0.weight", "blocks.1.weight")
    assert {info.units(n) for n in params} == {"default"}  # units go by a parameter's first name


def test_units_by_prefix_of_a_non_module_says_what_it_wants():
    with pytest.raises(fzero.FzeroError, match=r"units_by_prefix expects the model \(an nn.Module\) whose submodule "
                                               r"'blocks' holds the units, got dict") as e:
        fzero.units_by_prefix({"blocks": []}, "blocks")
    assert e.value.__context__ is None


def test_remat_true_over_units_without_a_home_is_refused():
    with pytest.raises(fzero.ConfigError, match=r"remat=True checkpoints each unit whose parameters share a home "
                                                r"submodule .*units \['default'\]"):
        fzero.from_module(_Blocks(), remat=True)
    m = _Blocks()
    _, _, info = fzero.from_module(m, units=fzero.units_by_prefix(m, "blocks"), remat=True)
    assert info.units("blocks.1.weight") == "blocks.1"


def test_ranks_whose_prefetch_differs_are_told_it_may_be_why():
    m = _Blocks()
    params, apply, info = fzero.from_module(m, units=fzero.units_by_prefix(m, "blocks"))
    mesh, said = fzero.SimMesh(2), {}

    def rank():
        state = fzero.init(params, fzero.optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
        try:
            fzero.train_step(lambda p, x: apply(p, x).sum(), prefetch=mesh.rank)(state, torch.ones(3, 4))
        except fzero.MeshError as e:
            said[mesh.rank] = e
            raise

    with pytest.raises(fzero.CollectiveMismatch):
        mesh.run(rank)
    for e in said.values():
        assert isinstance(e, fzero.DivergentPaths) and "(micro_batches, accumulate, gather, prefetch, " in str(e), e


@pytest.mark.parametrize("stage", [1, 3])
def test_init_without_the_units_from_module_was_given_warns_naming_them(stage):
    """`from_module(model, units=...)` then `fzero.init(params, ...)` without `units`: the whole
    model was one unit, silently -- at stage 3 every parameter gathered at once (found in review).
    `init` warns `fzero.UnitsNotPassed` naming the units and the way (`units=info.units`); with
    them it warns nothing, and a from_module without units (one unit either way) warns nothing."""
    model = _Blocks()
    params, _, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    mesh = fzero.SimMesh(1)
    with pytest.warns(fzero.UnitsNotPassed, match=r"split into 3 units \(\['blocks.0', 'blocks.1', 'default'\]\).*"
                                                   r"units=info.units"):
        state = mesh.run(lambda: fzero.init(params, fzero.optim.sgd(0.1), stage=stage, mesh=mesh))[0]
    assert state.layout.units == ("default",)
    state = mesh.run(lambda: fzero.init(params, fzero.optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units))[0]
    assert len(state.layout.units) == 3
    plain, _, _ = fzero.from_module(_Blocks())
    mesh.run(lambda: fzero.init(plain, fzero.optim.sgd(0.1), stage=stage, mesh=mesh))  # (filterwarnings: error)
