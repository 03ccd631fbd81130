"""A params leaf reaches the loss as a contiguous view of its bucket: its values and shape, not its
strides (README, "The equivalence guarantee"). Where an op's bits depend on its input's strides, the
loss computes torch's bits for `leaf.contiguous()`."""

import pytest
import torch

import fzero
from fzero import optim


def _loss(p, x):
    return ((p["w"].sum(1) - x) ** 2).mean()  # a sum over the transposed leaf's strided dim


def test_a_transposed_leaf_reaches_the_loss_contiguous_with_torchs_bits_for_its_contiguous_copy():
    torch.manual_seed(0)
    w = torch.randn(4096, 64).t()  # (64, 4096), strides (1, 64)
    x = torch.randn(64)
    mesh = fzero.SimMesh(1)
    seen = {}

    def loss(p, batch):
        seen["contiguous"] = p["w"].is_contiguous()
        return _loss(p, batch)

    def rank():
        state = fzero.init({"w": w}, optim.sgd(0.1, impl="single"), stage=0, mesh=mesh)
        state, metrics = fzero.train_step(loss)(state, x)
        return fzero.gather(state)["w"], metrics.loss

    new, got = mesh.run(rank)[0]
    assert not w.is_contiguous() and seen["contiguous"]
    contiguous = w.contiguous().requires_grad_()
    want = _loss({"w": contiguous}, x)
    assert torch.equal(got.to(want.dtype), want.detach())
    want.backward()
    torch.optim.SGD([contiguous], lr=0.1, foreach=False).step()
    assert torch.equal(new, contiguous.detach())


@pytest.mark.parametrize("stage", [0, 3])
def test_a_leaf_with_an_empty_dimension_has_torchs_contiguous_strides(stage):
    """A `(3, 0)` leaf reaches the loss, and comes out of `gather`, with torch's contiguous
    strides `(1, 1)` (a side of 0 counts as 1). A mutation audit found strides of `(0, 1)` pass the
    suite (metadata only: no values)."""
    mesh, seen = fzero.SimMesh(2), []

    def loss(p, x):
        seen.append(p["e"].stride())
        return (p["w"] * x).sum() + p["e"].sum()

    def rank():
        state = fzero.init({"w": torch.ones(4), "e": torch.empty(3, 0)}, fzero.optim.sgd(0.1), stage=stage, mesh=mesh)
        state, _ = fzero.train_step(loss)(state, torch.ones(4))
        return fzero.gather(state)["e"].stride()

    assert mesh.run(rank) == [torch.empty(3, 0).stride()] * 2 == [(1, 1)] * 2
    assert seen == [(1, 1)] * 2
