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
