"""A rank's `ZeroState` (`fzero._src.state`): made by `init` with checks, used on its own rank.

- What is left to get wrong when the step reads stage, mesh and optimizer from the state: a
  state handed to another rank, a loss that is not a 0-d float, a stage or gather mode that
  does not exist; each is a `FzeroError` naming it.
- `init` rejects ranks whose leaves have the same element count but another shape, and one
  tensor at two paths.
"""

from __future__ import annotations

import pytest
import torch

import fzero
from fzero import optim


def test_state_misuse_errors():
    """The step reads stage, mesh and optimizer from the state, so they cannot disagree; what is
    left to get wrong: a state handed to another rank (it would update another rank's elements),
    a loss that is not a 0-d float, a stage that does not exist."""
    params = {"a": torch.arange(4.0)}
    mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)

    def rank_fn():
        state = fzero.init(params, opt, stage=3, mesh=mesh)
        with pytest.raises(fzero.FzeroError, match="0-d floating tensor"):
            fzero.train_step(lambda p, c: p["a"])(state, None)
        return state

    states = mesh.run(rank_fn)
    swapped = [(states[1],), (states[0],)]
    with pytest.raises(fzero.FzeroError, match=r"belongs to rank 1 of SimMesh.* runs on rank 0"):
        mesh.run(lambda s: fzero.gather(s), swapped)
    with pytest.raises(fzero.FzeroError, match=r"belongs to rank 1 of SimMesh.* runs on rank 0"):
        mesh.run(lambda s: fzero.train_step(lambda p, c: p["a"].sum())(s, None), swapped)
    with pytest.raises(fzero.ConfigError, match="stage must be 0, 1, 2 or 3"):
        mesh.run(lambda: fzero.init(params, opt, stage=4, mesh=mesh))
    with pytest.raises(fzero.ConfigError, match="gather must be one of"):
        fzero.train_step(lambda p, c: p, gather="lazy")


def test_init_rejects_other_shape_same_numel_and_one_tensor_twice():
    mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)
    with pytest.raises(fzero.LayoutError, match=r"at leaf 'w'.*same count, other shape or dtype"):
        mesh.run(lambda shape: fzero.init({"w": torch.ones(shape)}, opt, stage=3, mesh=mesh), [((2, 3),), ((3, 2),)])
    w = torch.ones(3)
    with pytest.raises(fzero.LayoutError, match="'a' and 'b' are the same tensor"):
        mesh.run(lambda: fzero.init({"a": w, "b": w}, opt, stage=0, mesh=mesh))

