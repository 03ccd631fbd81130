"""A checkpointed unit (`from_module(remat=...)`) whose forward reads a parameter of another unit:
the recompute in backward runs after `apply` returned and binds the checkpointed unit's leaves
only, so that parameter's slot holds a meta stand-in there, and torch's CPU product over it read
uninitialised memory (a BERT-style head tied to the embedding: grad_norm 0.46 for 7.05 after a
step, or a non-finite error, found in review). `from_module` refuses a checkpointed unit whose
home submodule holds another unit's parameter (tied or not, docs/bad-input.md row 215); one
reached through a plain attribute is refused where the recompute reads it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero

V, D = 11, 8


class Head(nn.Module):
    """BERT's LM head: a norm, a decoder (tied to the embedding in `LM`) and a bias of its own."""

    def __init__(self, emb: nn.Embedding | None = None):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.decoder = nn.Linear(D, V, bias=False)
        self.bias = nn.Parameter(torch.zeros(V))
        if emb is not None:  # the embedding held as a plain attribute, not registered
            del self.decoder
            object.__setattr__(self, "emb", emb)

    def forward(self, x):
        weight = self.emb.weight if "emb" in vars(self) else self.decoder.weight
        return F.linear(self.ln(x), weight, self.bias)


class LM(nn.Module):
    def __init__(self, tie: str):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.body = nn.Linear(D, D)
        self.head = Head(self.emb if tie == "attribute" else None)
        if tie == "registered":
            self.head.decoder.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.body(self.emb(idx))))


def _model(tie: str) -> LM:
    torch.manual_seed(0)
    return LM(tie)


def _train(tie: str, stage: int, remat, units=None):
    model = _model(tie)
    params, apply, info = fzero.from_module(model, units=units or fzero.units_by_prefix(model, ""), remat=remat)
    mesh = fzero.SimMesh(2)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, V, (4, 5), generator=g), torch.randint(0, V, (4, 5), generator=g)) for _ in range(2)]

    def loss(p, batch):
        return F.cross_entropy(apply(p, batch[0]).reshape(-1, V), batch[1].reshape(-1))

    def rank(batch):
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        step = fzero.train_step(loss)
        for _ in range(2):
            state, _ = step(state, batch)
        return fzero.gather(state)

    return mesh.run(rank, [(b,) for b in batches])


@pytest.mark.parametrize("stage", [0, 3])
def test_a_checkpointed_head_holding_the_tied_embedding_is_refused_and_the_named_way_out_trains(stage):
    with pytest.raises(fzero.ConfigError, match=r"submodule 'head' of unit 'head' holds 'head.decoder.weight' "
                                                r"\(tied to 'emb.weight'\), a leaf of unit 'emb'.*remat=\['body'\]"):
        fzero.from_module(_model("registered"), units=fzero.units_by_prefix(_model("registered"), ""), remat=True)
    plain, checkpointed = _train("registered", stage, False), _train("registered", stage, ["body"])
    for a, b in zip(plain, checkpointed):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_checkpointed_unit_whose_submodule_holds_a_leaf_of_another_unit_is_refused_untied():
    """No tie: a unit spec that puts the head's decoder in another unit than the head."""
    def units(path):
        return "outer" if path in ("emb.weight", "head.decoder.weight") else path.split(".")[0]

    with pytest.raises(fzero.ConfigError, match=r"holds 'head.decoder.weight', a leaf of unit 'outer'.*"
                                                r"remat=False"):
        fzero.from_module(_model("untied"), units=units, remat=["head"])


@pytest.mark.parametrize("stage", [0, 3])
def test_a_parameter_reached_through_a_plain_attribute_in_a_recompute_is_refused(stage):
    """The head holds the embedding module as a plain attribute: no alias under its submodule, so
    `from_module` cannot see it; the forward reads it bound (the root unit), the recompute in
    backward reads the stand-in. Before, the step trained on it, silently wrong."""
    def units(path):
        return "head" if path.startswith("head.") else "default"

    with pytest.raises(fzero.ConfigError, match=r"parameter 'emb.weight' \(unit 'default'\) was used \(linear\) by the "
                                                r"recompute in backward of checkpointed unit 'head'"):
        _train("attribute", stage, ["head"], units=units)
    # without remat it trains: the function and values of the tied model, so its bits
    tied = _train("registered", stage, False, units=lambda path: "default" if path == "head.decoder.weight" else units(path))
    for a, b in zip(_train("attribute", stage, False, units=units), tied):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_unit_refused_is_named_at_once_and_the_remat_it_suggests_is_taken():
    """Six blocks sharing one attention module and a seventh with its own, each with its own norm
    and MLP (so a block is its unit's home), one unit per block: blocks 1-5 hold block 0's leaves
    (block 0's unit, holding every name of the shared module, has no home: not checkpointed). The error named one unit and suggested the others, each refused in turn (found in
    review); it names them all and suggests the units that pass."""
    class Block(nn.Module):
        def __init__(self, attn):
            super().__init__()
            self.attn, self.ln, self.mlp = attn, nn.LayerNorm(D), nn.Linear(D, D)

        def forward(self, x):
            return self.mlp(self.ln(x + self.attn(x)))

    class Tower(nn.Module):
        def __init__(self):
            super().__init__()
            attn = nn.Linear(D, D)
            self.blocks = nn.ModuleList([*(Block(attn) for _ in range(6)), Block(nn.Linear(D, D))])

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x

    torch.manual_seed(0)
    model = Tower()
    units = fzero.units_by_prefix(model, "blocks")
    with pytest.raises(fzero.ConfigError, match=r"submodule 'blocks.1' of unit 'blocks.1' holds 'blocks.1.attn.weight' "
                                                r"\(tied to 'blocks.0.attn.weight'\).*and 1 more units\..*Leave these "
                                                r"units out of remat \(remat=\['blocks.6'\]\)"):
        fzero.from_module(model, units=units, remat=True)
    fzero.from_module(model, units=units, remat=["blocks.6"])

