"""A long run's resume: what a checkpoint refuses when the run goes on under other settings, and
the way out each refusal names."""

import pytest
import torch

import fzero
import fzero.checkpoint as ck


def params(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"emb": torch.randn(5, 3, generator=g), "body": {"w": torch.randn(3, 3, generator=g),
                                                            "b": torch.randn(3, generator=g)}}


def loss_fn(p, x):
    return (torch.tanh(x @ p["emb"]) @ p["body"]["w"] + p["body"]["b"]).pow(2).mean()


FROZEN_EMB = fzero.ParamGroup("frozen", match=lambda path: path == "emb", frozen=True)
NO_DECAY = fzero.ParamGroup("no-decay", match=lambda path: path.endswith(".b"), weight_decay=False)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Stage 3 at N = 2, AdamW under a warmup schedule, the embedding frozen: 2 steps, saved."""
    root = str(tmp_path_factory.mktemp("long-run"))
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(loss_fn)

    def rank_fn():
        state = fzero.init(params(), fzero.optim.adamw(fzero.optim.linear_warmup(1e-2, 4), weight_decay=0.1),
                           stage=3, mesh=mesh, groups=[FROZEN_EMB, NO_DECAY])
        for k in range(2):
            state, _ = step(state, torch.randn(4, 5, generator=torch.Generator().manual_seed(10 * k + mesh.rank)))
        return ck.save(state, root)

    return mesh.run(rank_fn)[0]


def load_error(path: str, groups, leaves=None) -> str:
    mesh = fzero.SimMesh(2)

    def rank_fn():
        target = fzero.init(leaves or params(seed=3), fzero.optim.adamw(fzero.optim.linear_warmup(1e-2, 4),
                                                                        weight_decay=0.1),
                            stage=1, mesh=mesh, groups=groups)
        with pytest.raises(ck.CheckpointError) as info:
            ck.load(path, target)
        return str(info.value)

    errors = mesh.run(rank_fn)
    assert errors[0] == errors[1]
    return errors[0]


def test_a_resume_that_freezes_or_thaws_a_leaf_is_told_why_a_load_cannot_and_the_way(saved):
    """The same params pytree, another set of frozen leaves (the embedding thawed on resume; one
    more leaf frozen): refused (a leaf frozen at the save has no optimizer state in the checkpoint),
    naming the groups, why, and the way out -- a new state from `export`'s params, its schedule
    shifted by the saved step. Before: "load into a state made by fzero.init from the same params
    pytree", which the target was. A target of another pytree keeps those words."""
    more = fzero.ParamGroup("more", match=lambda path: path == "body.w", frozen=True)
    for groups, leaf, was_frozen in (([NO_DECAY], "emb", True), ([FROZEN_EMB, NO_DECAY, more], "body.w", False)):
        text = load_error(saved, groups)
        assert f"('{leaf}') differs in frozen: checkpoint {was_frozen}, target {not was_frozen}" in text, text
        assert "same params pytree" not in text, text
        assert "make the target with the ParamGroups it was saved with" in text, text
        assert "neither thaws nor freezes a leaf" in text and "fzero.checkpoint.export" in text, text
        assert "lambda t: schedule(t + 2)" in text, text  # the saved step

    other = params(seed=3)
    other["body"]["w"], other["body"]["b"] = torch.randn(3, 4), torch.randn(4)
    text = load_error(saved, [FROZEN_EMB, NO_DECAY], leaves=other)
    assert "differs in shape" in text and "load into a state made by fzero.init from the same params pytree" in text
    assert "neither thaws" not in text, text
