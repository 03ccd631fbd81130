"""Module buffers at their edges (found in review of a buffers user): a buffer that requires grad
loads back from a checkpoint (before: torch's in-place error on a leaf, `load` ran the copy
with grad mode on; docs/bad-input.md row 227), and a buffer sharing memory with a trainable
parameter is refused by `from_module` (before: the buffer kept its initial values while the
parameter trained, and `info.state_dict` written back loaded them over the trained weight,
silently; row 228)."""

from __future__ import annotations

import re

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


class _PlainAttribute(nn.Module):
    """A parameter and a plain tensor attribute (neither parameter nor buffer) over one memory: the
    attribute the parameter's base (`base`), a view of it (`view`), one in a list (`listed`) or a
    dict (`keyed`), which the forward reads; or one the forward sets anew before reading it
    (`cached`); or apart (`clone`), or beside a frozen parameter (`frozen`)."""

    def __init__(self, kind: str):
        super().__init__()
        torch.manual_seed(0)
        flat = torch.randn(12)
        self.kind = kind
        self.w = nn.Parameter(flat.view(3, 4), requires_grad=kind != "frozen")
        held = {"base": flat, "view": self.w.detach().view(12), "clone": flat.clone(), "frozen": flat,
                "cached": self.w.detach().view(12)}.get(kind)
        self.flat = held if held is not None else torch.zeros(12)
        self.extra = ([torch.ones(2), self.w.detach()[1]] if kind == "listed" else {"k": self.w.detach()} if kind == "keyed"
                      else None)

    def forward(self, x):
        if self.kind == "cached":
            self.flat = self.w.view(12)  # set anew from the parameter at each call, then read
        out = x @ self.w.t() + self.flat[:3]
        if self.kind == "listed":
            out = out + self.extra[1][:3]
        elif self.kind == "keyed":
            out = out + self.extra["k"][0, :3]
        return out


def _trained(kind, steps=3):
    """`(fzero's w after `steps` SGD steps on SimMesh(2), torch's w after the same)`."""
    g = torch.Generator().manual_seed(1)
    data = [[(torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)) for _ in range(2)] for _ in range(steps)]
    ref = _PlainAttribute(kind)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=False)
    for batches in data:
        grads = [torch.autograd.grad(F.mse_loss(ref(x), y), ref.w) for x, y in batches]
        ref.w.grad = grads[0][0] * 0.5 + grads[1][0] * 0.5
        opt.step()
    params, apply, _ = fzero.from_module(_PlainAttribute(kind))
    mesh = fzero.SimMesh(2)

    def rank(batches):
        state = fzero.init(params, fzero.optim.sgd(0.1, impl="single"), stage=0, mesh=mesh)
        step = fzero.train_step(lambda p, b: F.mse_loss(apply(p, b[0]), b[1]))
        for b in batches:
            state, _ = step(state, b)
        return fzero.gather(state)["w"]

    return mesh.run(rank, [([d[r] for d in data],) for r in range(2)])[0], ref.w.detach()


@pytest.mark.parametrize("kind, name, shape", [("base", "flat", "12"), ("view", "flat", "12"),
                                               ("listed", "extra[1]", "4"), ("keyed", "extra['k']", "3, 4")])
def test_a_plain_tensor_attribute_sharing_memory_with_a_trainable_parameter_is_refused_where_read(kind, name, shape):
    """A plain tensor attribute over a trainable parameter's memory, read by the forward: torch's
    in-place update writes it too, fzero's copy of the module would keep it at its initial values,
    and the weights drifted from torch's from the second step, silently (found in review of a
    user of unusual parameters; row 258). apply's copy holds a stand-in for it: the forward's read
    raises `ConfigError` naming it, the parameter and the ways out."""
    params, apply, _ = fzero.from_module(_PlainAttribute(kind))
    with pytest.raises(fzero.ConfigError, match=rf"the forward read attribute {re.escape(repr(name))} "
                                                rf"\(float32\[{shape}\];.* shares memory with the trainable parameter 'w'"):
        apply(params, torch.randn(2, 4))


@pytest.mark.parametrize("kind", ["cached", "clone"])
def test_a_plain_tensor_attribute_set_in_forward_or_apart_trains_as_torch(kind):
    """One the forward sets anew from the parameter before reading it (a view cached at each call:
    a first version of the check refused it at `from_module`, found in review), one held apart
    (a clone): each trains bit for bit as torch, three steps. Beside a frozen parameter (never
    updated) the attribute is the module's own and apply's forward is the module's."""
    got, want = _trained(kind)
    assert torch.equal(got, want)
    params, apply, _ = fzero.from_module(_PlainAttribute("frozen"))
    x = torch.randn(2, 4)
    assert torch.equal(apply(params, x), _PlainAttribute("frozen")(x))


def test_torch_modules_that_keep_their_own_tensor_attributes_are_taken():
    """Old-style `spectral_norm` sets `module.weight` (a plain tensor over `weight_orig`'s memory at
    first) in a forward pre-hook before each forward: passed over by name. RNNs hold their
    parameters themselves in `_flat_weights`: parameters, not plain tensors."""
    for model in (nn.utils.spectral_norm(nn.Linear(4, 3)), nn.LSTM(4, 3, 2), nn.GRU(4, 3)):
        params, apply, _ = fzero.from_module(model)
        assert set(params) == {n for n, p in model.named_parameters()}
    x = torch.randn(2, 4)
    sn = nn.utils.spectral_norm(nn.Linear(4, 3))
    params, apply, _ = fzero.from_module(sn)
    torch.manual_seed(0)
    got = apply(params, x)
    torch.manual_seed(0)
    assert torch.equal(got, sn(x))
