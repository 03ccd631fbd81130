"""ParamGroups that cannot be what the user meant: a group with a match that takes no leaf warns
(`fzero.GroupHoldsNoLeaf`), a group listed after a catch-all (which takes every leaf first) is
refused, and a match that raises or answers with a str is refused naming the group and the path.
Before, each was accepted silently: a no-decay group with a typo left weight decay on the biases,
a `KeyError` from the match named no group, and `"False"` took every leaf (found in review of a
user with optimizer groups; docs/bad-input.md row 225)."""

from __future__ import annotations

import warnings

import pytest
import torch

import fzero

PARAMS = {"fc1": {"weight": torch.ones(3, 2), "bias": torch.ones(3)}, "ln": {"weight": torch.ones(3)}}


def _groups_of(groups):
    layout = fzero.layout.plan(PARAMS, 2, groups=groups)
    return {s.path: s.group.name for s in layout.leaves}


def _init(groups, params=None, **kw):
    """`fzero.init` on SimMesh(1), where the warning is made: `{path: group name}`."""
    mesh = fzero.SimMesh(1)
    state = mesh.run(lambda: fzero.init(params or PARAMS, fzero.optim.adamw(0.1), stage=1, mesh=mesh, groups=groups,
                                        **kw))[0]
    return {s.path: s.group.name for s in state.layout.leaves}


def test_a_group_whose_match_takes_no_leaf_warns_naming_it_and_the_paths():
    typo = fzero.ParamGroup("no-decay", match=lambda path: path.endswith(".bais"), weight_decay=False)
    with pytest.warns(fzero.GroupHoldsNoLeaf, match=r"ParamGroup 'no-decay' holds no leaf: its match is true for "
                                                    r"none of the 3 leaf paths \('fc1.bias', 'fc1.weight', "
                                                    r"'ln.weight'\)") as record:
        got = _init([typo])
    assert got == {"fc1.bias": "default", "fc1.weight": "default", "ln.weight": "default"}
    assert record[0].filename == __file__  # the user's line, not fzero's


def test_a_group_whose_leaves_an_earlier_group_took_warns_naming_where_they_went():
    first = fzero.ParamGroup("no-decay", match=lambda path: path.endswith("bias"), weight_decay=False)
    second = fzero.ParamGroup("slow", match=lambda path: path == "fc1.bias", lr_scale=0.5)
    with pytest.warns(fzero.GroupHoldsNoLeaf, match=r"ParamGroup 'slow' holds no leaf: every leaf it matches went "
                                                    r"to another group .*'fc1.bias' to 'no-decay'"):
        got = _init([first, second])
    assert got["fc1.bias"] == "no-decay"


def test_no_warning_where_the_leaves_went_to_a_frozen_group_or_a_tied_weight_is_matched_by_its_other_name():
    """`[*info.groups, no_decay]` over a model whose biases are frozen: no_decay's leaves went to the
    frozen group, by design; a group matching a tied head by its other name with the settings of
    the first name's group: groups go by the first name (found in review of the first version:
    each warned, with words that named the wrong leaves, and the tied case warned before row 218's
    refusal)."""
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.body, self.head = torch.nn.Embedding(5, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 5)
            self.head.weight = self.emb.weight
            self.body.bias.requires_grad_(False)
            self.head.bias.requires_grad_(False)

        def forward(self, x):
            return self.head(self.body(self.emb(x)))

    params, _, info = fzero.from_module(Tied())
    no_decay = fzero.ParamGroup("no-decay", match=lambda p: p.endswith("bias"), weight_decay=False)
    by_head = fzero.ParamGroup("head", match=lambda p: p == "head.weight")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _init([*info.groups, no_decay, by_head], params)
    assert got["body.bias"] == got["head.bias"] == "frozen" and got["emb.weight"] == "default"
    frozen_head = fzero.ParamGroup("frozen-head", match=lambda p: p.startswith("head"), frozen=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(fzero.LayoutError, match=r"parameter 'emb.weight' is tied \(also 'head.weight'\)"):
            _init([*info.groups, frozen_head], params)


def test_a_group_listed_after_a_catch_all_is_refused():
    groups = [fzero.ParamGroup("all"), fzero.ParamGroup("no-decay", match=lambda p: p.endswith("bias"),
                                                         weight_decay=False)]
    with pytest.raises(fzero.LayoutError, match=r"ParamGroup 'no-decay' is listed after ParamGroup 'all', which has "
                                                r"no match .*'fc1.bias' to 'all'.*List the group with no match last"):
        _groups_of(groups)


def test_groups_that_each_hold_a_leaf_and_a_catch_all_last_that_holds_none_do_not_warn():
    groups = [fzero.ParamGroup("no-decay", match=lambda p: not p.endswith("weight") or p.startswith("ln"),
                               weight_decay=False),
              fzero.ParamGroup("decay", match=lambda p: p == "fc1.weight"), fzero.ParamGroup("rest")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _groups_of(groups)
    assert got == {"fc1.bias": "no-decay", "fc1.weight": "decay", "ln.weight": "no-decay"}


def test_a_match_that_raises_is_refused_naming_the_group_and_the_path():
    ndim = {"fc1.weight": 2}
    group = fzero.ParamGroup("no-decay", match=lambda path: ndim[path] < 2, weight_decay=False)
    with pytest.raises(fzero.LayoutError, match=r"ParamGroup 'no-decay': its match raised KeyError on the leaf path "
                                                r"'fc1.bias'") as e:
        _groups_of([group])
    assert isinstance(e.value.__cause__, KeyError)


def test_a_match_that_answers_with_a_str_is_refused():
    group = fzero.ParamGroup("no-decay", match=lambda path: "False", weight_decay=False)
    with pytest.raises(fzero.LayoutError, match=r"its match returned str 'False' for the leaf path 'fc1.bias', where "
                                                r"it must return a bool"):
        _groups_of([group])


def test_init_warns_at_the_users_line_on_every_rank():
    mesh = fzero.SimMesh(2)
    typo = fzero.ParamGroup("no-decay", match=lambda path: path == "bias", weight_decay=False)

    def rank():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fzero.init({"w": torch.ones(3), "b": torch.ones(2)}, fzero.optim.adamw(0.1), stage=1, mesh=mesh,
                       groups=[typo])
        return [(w.category, w.filename) for w in caught]

    assert mesh.run(rank) == [[(fzero.GroupHoldsNoLeaf, __file__)]] * 2


def test_a_group_matching_a_tied_weight_by_both_names_that_another_took_warns():
    """`[no_decay(emb|head|bias), emb_lr(emb|head)]` over a tied head: emb_lr's leaf went to
    no_decay by its first name, and its lr_scale is lost, as over the untied model, where it warns
    (a review found the tied model silent: the skip for a match by the other name covered a group
    that took a first name too)."""
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.head = torch.nn.Embedding(5, 4), torch.nn.Linear(4, 5)
            self.head.weight = self.emb.weight

        def forward(self, x):
            return self.head(self.emb(x))

    params, _, info = fzero.from_module(Tied())
    no_decay = fzero.ParamGroup("no_decay", match=lambda p: p.endswith("bias") or p.split(".")[0] in ("emb", "head"),
                                weight_decay=False)
    emb_lr = fzero.ParamGroup("emb_lr", match=lambda p: p.split(".")[0] in ("emb", "head"), lr_scale=0.1)
    with pytest.warns(fzero.GroupHoldsNoLeaf, match=r"ParamGroup 'emb_lr' holds no leaf: every leaf it matches went "
                                                    r"to another group .*'emb.weight' to 'no_decay'"):
        _init([no_decay, emb_lr], params)
