"""A module whose ties change after `fzero.from_module` read it: a weight tied afterwards
(`model.head.weight = model.emb.weight`) or a tie broken (`model.head.weight = nn.Parameter(...)`).
`apply` runs the module as `from_module` copied it, so the step trained the old ties, and the
write-back (`model.load_state_dict(info.state_dict(...))`) put one trained leaf over the other,
silently (found in review of a tied-weights user). The step refuses it on every rank, before any
update (docs/bad-input.md row 216); a write-back with `assign=True`, which makes one Parameter
per name over the one tensor, keeps the tie and trains on."""

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
        self.body = nn.Linear(D, D)
        self.head = nn.Linear(D, V, bias=False)
        if tie:
            self.head.weight = self.emb.weight

    def forward(self, idx):
        return self.head(torch.tanh(self.body(self.emb(idx))))


def _model(tie: bool) -> LM:
    torch.manual_seed(0)
    return LM(tie)


def _batches(steps: int = 3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, V, (4, 5), generator=g), torch.randint(0, V, (4, 5), generator=g))
            for _ in range(steps)]


def _steps(model, change=None, *, stage: int = 1, n: int = 2, write_back: bool = False):
    """Three steps on `n` SimMesh ranks from `from_module(model)`, `change(model)` applied after
    `from_module` (the module is shared by the ranks); each rank's gathered params, or the step
    that raised, its error and the params then. `write_back` (`n` = 1): the trained values put
    back into the module after each step, `load_state_dict(..., assign=True)`."""
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    if change is not None:
        change(model)
    mesh = fzero.SimMesh(n)

    def loss(p, batch):
        return F.cross_entropy(apply(p, batch[0]).reshape(-1, V), batch[1].reshape(-1))

    def rank(batches):
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        step = fzero.train_step(loss)
        for i, batch in enumerate(batches):
            try:
                state, _ = step(state, batch)
            except fzero.ConfigError as e:
                return i, str(e), fzero.gather(state)
            if write_back:
                model.load_state_dict(info.state_dict(fzero.gather(state)), assign=True)
        return fzero.gather(state)

    return mesh.run(rank, [(_batches(),)] * n)


def _tie(model):
    model.head.weight = model.emb.weight


def _untie(model):
    model.head.weight = nn.Parameter(model.emb.weight.detach().clone())


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("tied, change, words", [
    (False, _tie, "'emb.weight' and 'head.weight' were two parameters when from_module read the module and are one now"),
    (True, _untie, "'emb.weight' and 'head.weight' were one \\(tied\\) parameter when from_module read the module and "
                   "are two now"),
    (True, lambda m: setattr(m, "head", nn.Linear(D, V, bias=False)), "'emb.weight' and 'head.weight' were one"),
])
def test_a_tie_made_or_broken_after_from_module_is_refused_at_the_first_step_before_any_update(stage, tied, change,
                                                                                              words):
    model = _model(tied)
    before = {k: v.clone() for k, v in fzero.from_module(model)[0].items()}
    for at, message, params in _steps(model, change, stage=stage):
        assert at == 0 and re.search(words, message), message
        assert "Nothing was updated" in message and "Tie (or untie) before fzero.from_module" in message
        assert params.keys() == before.keys() and all(torch.equal(params[k], before[k]) for k in params)


def test_a_write_back_with_assign_keeps_the_tie_and_trains_on_with_the_bits_of_none():
    """`assign=True` gives each name its own Parameter over the one tensor `info.state_dict`
    gives both: the same storage, still tied."""
    model = _model(True)
    (plain,) = _steps(_model(True), n=1)
    (written,) = _steps(model, n=1, write_back=True)
    assert model.head.weight.data_ptr() == model.emb.weight.data_ptr()
    assert plain.keys() == written.keys() and all(torch.equal(plain[k], written[k]) for k in plain)


def test_messages_about_a_tied_weight_name_its_other_names():
    """A tied weight is one leaf under its first name; the user froze or read it by the other
    (`head.weight`), and the messages named only `emb.weight` (found in review)."""
    for at, message, _ in _steps(_model(True), lambda m: m.head.weight.requires_grad_(False)):
        assert at == 0 and "'emb.weight' (trainable then, frozen now, also 'head.weight')" in message, message
    model = _model(True)
    params, apply, info = fzero.from_module(model)
    mesh = fzero.SimMesh(1)

    def rank():
        state = fzero.init(params, fzero.optim.adamw(1e-2), stage=0, mesh=mesh)
        fzero.train_step(lambda p, b: apply(p, b).sum() + model.head.weight.sum())(state, torch.zeros(2, 3).long())

    with pytest.raises(fzero.ConfigError, match=r"the loss read parameter 'emb.weight' \(LM, also 'head.weight'\)"):
        mesh.run(rank)


def test_groups_giving_a_tied_leaf_other_settings_by_its_other_name_are_refused():
    """Groups go by the first name, as the params name a tied leaf: a frozen group over the
    head's name matched nothing and the head trained, where torch's group of `head.weight`
    freezes it (found in review of a tied-weights user). Groups that agree on both names, or
    give neither a setting of its own, are taken, `from_module`'s frozen group too."""
    def init(model, groups):
        params, _, info = fzero.from_module(model)
        mesh = fzero.SimMesh(1)
        return mesh.run(lambda: fzero.init(params, fzero.optim.adamw(1e-2), stage=0, mesh=mesh,
                                           groups=[*info.groups, *groups]).layout)[0]

    head = fzero.ParamGroup("frozen-head", match=lambda path: path.startswith("head."), frozen=True)
    with pytest.raises(fzero.LayoutError, match=r"'emb.weight' is tied \(also 'head.weight'\).*ParamGroup 'default' by "
                                                r"'emb.weight' \(which fzero uses\), ParamGroup 'frozen-head' by "
                                                r"'head.weight' \(frozen=True"):
        init(_model(True), [head])
    both = fzero.ParamGroup("frozen-tied", match=lambda path: path in ("emb.weight", "head.weight"), frozen=True)
    no_decay = fzero.ParamGroup("no-decay", match=lambda path: path.endswith(".bias"), weight_decay=False)
    layout = init(_model(True), [both, no_decay])
    # a group by the first name alone, the other falling to the default group: torch's groups by
    # named_parameters() (which lists the tied weight once, by its first name)
    emb = fzero.ParamGroup("emb-no-decay", match=lambda path: path.startswith("emb."), weight_decay=False)
    assert {ls.path: ls.group.name for ls in init(_model(True), [emb]).leaves}["emb.weight"] == "emb-no-decay"
    # and an explicit catch-all last, torch's [no_decay, decay] pattern (found in review: refused)
    decay = fzero.ParamGroup("decay")
    assert {ls.path: ls.group.name for ls in init(_model(True), [emb, decay]).leaves}["emb.weight"] == "emb-no-decay"
    assert {ls.path: ls.group.name for ls in layout.leaves}["emb.weight"] == "frozen-tied"
    frozen = _model(True)
    frozen.emb.requires_grad_(False)  # the tied weight frozen in the module: from_module's group, by its first name
    layout = init(frozen, [no_decay])
    assert {ls.path: ls.group.frozen for ls in layout.leaves}["emb.weight"]
    init(_model(False), [head])  # untied: the head's own leaf


def test_a_tied_parameter_of_no_elements_written_back_with_assign_steps_on():
    """`assign=True` gives each name a Parameter of its own, and two tensors of no elements share
    no storage to compare: the tie of an empty parameter was refused as broken (found in review),
    though it trains nothing and overwrites nothing."""
    class Empty(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.ones(3))
            self.e1 = nn.Parameter(torch.zeros(0))
            self.sub = nn.Module()
            self.sub.e2 = self.e1

        def forward(self, x):
            return (self.w * x).sum() + self.sub.e2.sum()

    def run(write_back: bool):
        model = Empty()
        params, apply, info = fzero.from_module(model)
        mesh = fzero.SimMesh(1)

        def rank():
            state = fzero.init(params, fzero.optim.sgd(0.1), stage=1, mesh=mesh)
            step = fzero.train_step(lambda p, x: apply(p, x))
            for _ in range(2):
                state, _ = step(state, torch.ones(3))
                if write_back:
                    model.load_state_dict(info.state_dict(fzero.gather(state)), assign=True)
            return fzero.gather(state)

        return mesh.run(rank)[0]

    plain, written = run(False), run(True)
    assert not torch.equal(plain["w"], torch.ones(3)) and torch.equal(plain["w"], written["w"])


def test_a_checkpoint_of_an_untied_model_loaded_into_a_tied_one_names_the_tie(tmp_path):
    """The layout error named the leaf the target lacks and blamed a rename (found in review of a
    tied-weights user): where that leaf is another name of a leaf the target ties, it says so."""
    mesh = fzero.SimMesh(1)

    def rank():
        untied, _, _ = fzero.from_module(_model(False))
        path = fzero.checkpoint.save(fzero.init(untied, fzero.optim.adamw(1e-2), stage=0, mesh=mesh), tmp_path)
        tied, _, _ = fzero.from_module(_model(True))
        target = fzero.init(tied, fzero.optim.adamw(1e-2), stage=0, mesh=mesh)
        with pytest.raises(fzero.checkpoint.CheckpointError) as e:
            fzero.checkpoint.load(path, target)
        return str(e.value)

    text = mesh.run(rank)[0]
    assert "the checkpoint holds 'head.weight' (float32[11, 8]), which the target lacks" in text, text
    assert "the checkpoint's 'head.weight' is another name of the target's 'emb.weight', which the target ties" in text
