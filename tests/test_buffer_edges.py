"""Module buffers at their edges (found in review of a buffers user): a buffer that requires grad
loads back from a checkpoint (before: torch's in-place error on a leaf, `load` ran the copy
with grad mode on; docs/bad-input.md row 227), and a buffer sharing memory with a trainable
parameter is refused by `from_module` (before: the buffer kept its initial values while the
parameter trained, and `info.state_dict` written back loaded them over the trained weight,
silently; row 228)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero


class _GradBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)
        self.register_buffer("g", torch.ones(4, requires_grad=True))

    def forward(self, x):
        return self.lin(x * self.g)


def test_a_buffer_that_requires_grad_loads_back(tmp_path):
    torch.manual_seed(0)
    params, apply, info = fzero.from_module(_GradBuffer())
    mesh = fzero.SimMesh(1)
    batch = (torch.randn(3, 4), torch.zeros(3, dtype=torch.long))

    def rank():
        state = fzero.init(params, fzero.optim.sgd(0.1), stage=0, mesh=mesh)
        state, _ = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]))(state, batch)
        path = fzero.checkpoint.save(state, tmp_path, buffers=info.buffers)
        with torch.no_grad():
            info.buffers["g"].fill_(7.0)  # lost: load puts the saved values back
        fzero.checkpoint.load(path, state, buffers=info.buffers)

    mesh.run(rank)
    assert torch.equal(info.buffers["g"], torch.ones(4)) and info.buffers["g"].requires_grad


class _ViewBuffer(nn.Module):
    def __init__(self, frozen: bool = False, clone: bool = False, rows: slice = slice(1, None)):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.lin.weight.requires_grad_(not frozen)
        view = self.lin.weight.detach()[rows]
        self.register_buffer("rows", view.clone() if clone else view)

    def forward(self, x):
        return self.lin(x) + self.rows.sum()


class _ParamInBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("store", torch.zeros(10))
        self.w = nn.Parameter(self.store[2:6])

    def forward(self, x):
        return x * self.w


@pytest.mark.parametrize("rows, shape", [(slice(1, None), "3, 4"), (slice(0, 1), "1, 4"), (slice(None), "4, 4")])
def test_a_buffer_sharing_memory_with_a_trainable_parameter_is_refused_naming_both(rows, shape):
    """Any overlap: a view from the parameter's first byte too (a review of the first version found
    `weight.detach()[0]` taken: the check read only an overlap that began inside the parameter)."""
    with pytest.raises(fzero.LayoutError, match=rf"from_module: buffer 'rows' \(float32\[{shape}\]\) shares memory "
                                                r"with the trainable parameter 'lin.weight'"):
        fzero.from_module(_ViewBuffer(rows=rows))


def test_a_parameter_inside_a_buffer_is_refused_too():
    with pytest.raises(fzero.LayoutError, match=r"buffer 'store' \(float32\[10\]\) shares memory with the "
                                                r"trainable parameter 'w'"):
        fzero.from_module(_ParamInBuffer())


@pytest.mark.parametrize("kind", ["frozen", "clone"])
def test_a_buffer_beside_a_frozen_parameter_or_a_clone_is_taken(kind):
    params, _, info = fzero.from_module(_ViewBuffer(frozen=kind == "frozen", clone=kind == "clone"))
    assert set(info.buffers) == {"rows"} and set(params) == {"lin.weight", "lin.bias"}
