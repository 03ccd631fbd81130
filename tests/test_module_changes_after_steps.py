"""The step's check of the module given to `fzero.from_module` (docs/bad-input.md rows 211, 216)
after steps that passed it. Once a full check passed, a step first tries a quick pass
(`originals._unchanged`): every name still finds, by its path from the root, the very parameter
the last full check read, with the flags it watches and the ties it read. Anything else runs the
full check again. The quick pass reads a few dicts per submodule and leaf where the full check
resolved each name from the root: about 4,600 Python calls before the forward's first kernel of
the peers' GPT at toy size (197 leaves, `benchmarks/host_profile.py --model gpt`), then 2,100.
These are the changes it must not pass over, each made after two steps had passed."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero

V, D = 11, 8


class LM(nn.Module):
    def __init__(self, tie: bool):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3)])
        self.head = nn.Linear(D, V, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _tie(model):
    model.head.weight = model.emb.weight


def _untie(model):
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone())


def _freeze_a_deep_layer(model):
    model.blocks[1][0].weight.requires_grad_(False)


def _a_frozen_block_in_place(model):  # the same names, held by a new submodule two levels down
    block = nn.Sequential(nn.Linear(D, D), nn.Tanh()).requires_grad_(False)
    model.blocks[1] = block


def _a_frozen_layer_in_a_new_list(model):  # a parent of the names replaced, its children new
    blocks = nn.ModuleList([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(3)])
    blocks[2][0].bias.requires_grad_(False)
    model.blocks = blocks


def _the_tie_by_the_dict(model):  # no __setattr__: the module's own dict written
    model.head._parameters["weight"] = model.emb.weight


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("tied, change, words", [
    (False, _tie, "'emb.weight' and 'head.weight' were two parameters when from_module read the module and are one now"),
    (False, _the_tie_by_the_dict, "'emb.weight' and 'head.weight' were two parameters"),
    (True, _untie, r"'emb.weight' and 'head.weight' were one \(tied\) parameter when from_module read the module and "
                   "are two now"),
    (False, _freeze_a_deep_layer, r"'blocks.1.0.weight' \(trainable then, frozen now\)"),
    (False, _a_frozen_block_in_place, r"'blocks.1.0.bias' \(trainable then, frozen now\), 'blocks.1.0.weight'"),
    (False, _a_frozen_layer_in_a_new_list, r"'blocks.2.0.bias' \(trainable then, frozen now\)"),
])
def test_a_change_after_steps_that_passed_is_refused_at_the_next_step_before_any_update(stage, tied, change, words):
    torch.manual_seed(0)
    model = LM(tied)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    mesh = fzero.SimMesh(2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, V, (4, 5), generator=g), torch.randint(0, V, (4, 5), generator=g)) for _ in range(3)]

    def loss(p, batch):
        return F.cross_entropy(apply(p, batch[0]).reshape(-1, V), batch[1].reshape(-1))

    def rank():
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        step = fzero.train_step(loss)
        for batch in batches[:2]:
            state, _ = step(state, batch)
        before = fzero.gather(state)
        fzero.collectives.all_reduce(torch.zeros(1), mesh)  # both ranks past their second step before rank 0 changes the module
        if mesh.rank == 0:
            change(model)
        fzero.collectives.all_reduce(torch.zeros(1), mesh)
        with pytest.raises(fzero.ConfigError) as e:
            step(state, batches[2])
        return str(e.value), before, fzero.gather(state)

    for message, before, after in mesh.run(rank):
        assert re.search(words, message) and "Nothing was updated" in message, message
        assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_change_in_the_second_of_two_modules_is_refused_after_steps_that_passed():
    """A state over the params of two `from_module` calls (a body and a head: a GAN's or an
    adapter's layout), the head's names resolving in the body too: freezing the head's weight
    after two steps is refused. The quick pass walks from one root only; links from two roots
    take the full check (a mutant that let them through trained the frozen weight)."""
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))  # names 0.*, 2.*
    head = nn.Sequential(nn.Identity(), nn.Identity(), nn.Linear(4, 2))  # names 2.*, which resolve in body too
    pb, apply_b, _ = fzero.from_module(body)
    ph, apply_h, _ = fzero.from_module(head)
    params = {"body": {k: v for k, v in pb.items() if k.startswith("0.")}, "head": ph}
    rest = {k: v for k, v in pb.items() if not k.startswith("0.")}

    def loss(p, b):
        return F.mse_loss(apply_h(p["head"], apply_b({**p["body"], **rest}, b[0])), b[1])

    mesh = fzero.SimMesh(1)

    def rank():
        state, step = fzero.init(params, fzero.optim.adamw(1e-2), stage=0, mesh=mesh), fzero.train_step(loss)
        batch = (torch.randn(3, 4), torch.randn(3, 2))
        for _ in range(2):
            state, _ = step(state, batch)
        head[2].weight.requires_grad_(False)
        with pytest.raises(fzero.ConfigError, match=r"'head.2.weight' \(trainable then, frozen now\)"):
            step(state, batch)
        return True

    assert mesh.run(rank) == [True]


def test_a_change_through_a_submodule_kept_after_its_root_was_freed_is_refused():
    """The module given to `from_module` freed after two steps, the user keeping one of its
    submodules and freezing its weight: the quick pass, finding no root, takes the full check,
    which finds the change through the submodule (a mutant that took "no root" as unchanged
    trained the frozen weight)."""
    import gc

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    params, apply, _ = fzero.from_module(model)
    head = model[2]
    mesh = fzero.SimMesh(1)
    batch = (torch.randn(3, 4), torch.randn(3, 2))
    step = fzero.train_step(lambda p, b: F.mse_loss(apply(p, b[0]), b[1]))
    states = mesh.run(lambda: fzero.init(params, fzero.optim.adamw(1e-2), stage=0, mesh=mesh))
    for _ in range(2):
        states = mesh.run(lambda s: step(s, batch)[0], [(s,) for s in states])
    del model
    gc.collect()
    head.weight.requires_grad_(False)

    def rank(s):
        with pytest.raises(fzero.ConfigError, match=r"'2.weight' \(trainable then, frozen now\)"):
            step(s, batch)
        return True

    assert mesh.run(rank, [(s,) for s in states]) == [True]


def test_the_quick_pass_is_taken_beside_a_group_that_freezes_a_trainable_parameter(monkeypatch):
    """A `ParamGroup(frozen=True)` over a parameter whose flag stays True: the flag is not watched
    (the state keeps the leaf frozen either way), so after the first step the quick pass passes
    every step and no full check runs (a mutant watching every flag ran the full check at every
    step: the same bits, the prologue's cost back)."""
    from fzero._src import originals

    full = [0]
    now = originals._now

    def counting(born):
        full[0] += 1
        return now(born)

    monkeypatch.setattr(originals, "_now", counting)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    params, apply, _ = fzero.from_module(model)
    groups = (fzero.ParamGroup("frozen-head", match=lambda p: p.startswith("2."), frozen=True), fzero.ParamGroup("rest"))
    mesh = fzero.SimMesh(1)

    def rank():
        s = fzero.init(params, fzero.optim.adamw(1e-2), stage=0, mesh=mesh, groups=groups)
        step = fzero.train_step(lambda p, b: F.mse_loss(apply(p, b[0]), b[1]))
        per = []
        for _ in range(4):
            before = full[0]
            s, _ = step(s, (torch.randn(3, 4), torch.randn(3, 2)))
            per.append(full[0] - before)
        return per

    per = mesh.run(rank)[0]
    assert per[0] > 0 and per[1:] == [0, 0, 0], per
