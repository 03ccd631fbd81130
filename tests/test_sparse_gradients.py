"""A sparse gradient reaching a unit's backward: `F.embedding(..., sparse=True)` or
`F.embedding_bag(..., sparse=True)` called by a module's forward (`nn.Embedding(sparse=True)` is
refused at `from_module`, docs/bad-input.md; the functional call gets past that check).

Before, torch's bare `RuntimeError: copy_() between dense and sparse Tensors is not implemented!`
came out of the gradient assembly's copy (`unit.copy_all`), and under `engine="func"`
"reshape is not implemented for sparse tensors", naming no leaf, at every stage and N (found in
review). Now `LayoutError` names the leaf, its shape, the gradient's layout and the way out,
on every rank.

The worker functions are at module level: the pool's workers import them by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero.testing import WorkerError

V, D = 11, 8


class Lookup(nn.Module):
    """An embedding table read by the functional call, sparse or not, bag or not."""

    def __init__(self, sparse: bool, bag: bool) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(V, D))
        self.out = nn.Linear(D, V)
        self.sparse, self.bag = sparse, bag

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.bag:
            h = F.embedding_bag(x, self.table, mode="mean", sparse=self.sparse)
        else:
            h = F.embedding(x, self.table, sparse=self.sparse).mean(1)
        return self.out(h)


def one_step(mesh, stage: int, sparse: bool, bag: bool = False, **step_kwargs) -> float:
    torch.manual_seed(0)
    params, apply, _ = fzero.from_module(Lookup(sparse, bag))
    state = fzero.init(params, fzero.optim.sgd(0.1), stage=stage, mesh=mesh)
    g = torch.Generator().manual_seed(mesh.rank)
    batch = (torch.randint(0, V, (4, 3), generator=g), torch.randint(0, V, (4,), generator=g))
    step = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]), **step_kwargs)
    _, metrics = step(state, batch)
    return float(metrics.loss)


def each_stage(mesh, sparse_on: list[int]) -> dict:
    """`{stage: "OK" or "<type>: <message>"}` of one step per stage, sparse on the ranks `sparse_on`."""
    out = {}
    for stage in (0, 1, 2, 3):
        try:
            one_step(mesh, stage, mesh.rank in sparse_on)
            out[stage] = "OK"
        except Exception as e:  # noqa: BLE001 -- the test reads each stage's error
            out[stage] = f"{type(e).__name__}: {e}"
    return out


NAMED = "params leaf 'table' [11, 8] got a torch.sparse_coo gradient"
WAY_OUT = "pass sparse=False (the same values, a dense gradient)"


@pytest.mark.parametrize("bag", [False, True], ids=["embedding", "embedding_bag"])
@pytest.mark.parametrize("kw", [{}, {"engine": "func"}, {"gather": "eager"}], ids=["autograd", "func", "eager"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_sparse_gradient_is_refused_naming_its_leaf_n1(stage, kw, bag):
    mesh = fzero.SimMesh(1)
    with pytest.raises(fzero.LayoutError) as info:
        mesh.run(lambda: one_step(mesh, stage, True, bag, **kw))
    message = str(info.value)
    assert NAMED in message and WAY_OUT in message, message
    assert "F.embedding / F.embedding_bag called with sparse=True" in message, message


def test_the_same_model_dense_trains_n1():
    """The way out the message gives: sparse=False, the same model, a step at every stage (the
    same loss: the same params, the same batch)."""
    mesh = fzero.SimMesh(1)
    losses = [mesh.run(lambda: one_step(mesh, stage, False))[0] for stage in (0, 1, 2, 3)]
    assert losses == [losses[0]] * 4 and losses[0] > 0, losses


@pytest.mark.dist
def test_a_sparse_gradient_is_refused_on_every_rank_at_every_stage_n2(dist2):
    """Both ranks sparse: each raises the LayoutError itself. Rank 0 alone sparse: rank 0 raises
    it, rank 1 stops with RankFailed naming rank 0, instead of waiting in the gradient's collective."""
    both = dist2.run(each_stage, [([0, 1],)] * 2, timeout=120)
    for rank, res in enumerate(both):
        for stage, text in res.items():
            assert text.startswith("LayoutError: " + NAMED) and WAY_OUT in text, (rank, stage, text)
    one = dist2.run(each_stage, [([0],)] * 2, timeout=120)
    for stage in (0, 1, 2, 3):
        assert one[0][stage].startswith("LayoutError: " + NAMED), (stage, one[0][stage])
        assert one[1][stage].startswith("RankFailed: ") and "rank(s) [0] raised" in one[1][stage], (stage, one[1])
    assert dist2.run(each_stage, [([],)] * 2, timeout=120) == [{s: "OK" for s in range(4)}] * 2


@pytest.mark.dist
def test_a_sparse_gradient_is_refused_in_the_pool_as_a_worker_error(dist2):
    with pytest.raises(WorkerError) as info:
        dist2.run(one_step, [(3, True)] * 2, timeout=120)
    assert [e.rank for e in info.value.errors] == [0, 1]
    for e in info.value.errors:
        assert e.type_name.endswith("LayoutError") and NAMED in e.message, e
