"""Messages a torch.func user meets (found in review), in process:

- `engine="func"` over a `from_module` model whose training-mode forward writes its buffers
  (BatchNorm's running statistics): torch's functorch "would mutate a captured Tensor" error gets
  a note from `apply` naming the buffers and the way out (`engine="autograd"`, `apply.eval()`),
  and only that error gets it;
- an integer / bool / complex params leaf: the `LayoutError` names the path, dtype and shape and
  a way out that exists for the pytree at hand (a plain pytree has no buffers; freezing the leaf
  does not help; a module's integer parameter is better a buffer).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import fzero
from fzero import optim
from fzero._src.module import captured_write_note, training_writes

_TORCH_WORDS = "mutate a captured Tensor"  # functorch's ADInterpreters.cpp (checkForInvalidMutationOnCaptures)


def _bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))


def _step(apply, params, engine: str, groups=()):
    """One stage-0 step on a SimMesh(1); returns the loss."""
    mesh = fzero.SimMesh(1)
    batch = (torch.randn(5, 4, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1, 2, 0, 1]))

    def rank():
        state = fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh, groups=groups)
        step = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]), engine=engine)
        return step(state, batch)[1].loss

    return mesh.run(rank)[0]


def _notes(e: BaseException) -> str:
    return "\n".join(getattr(e, "__notes__", []))


def test_a_training_mode_batchnorm_under_engine_func_names_its_buffers_and_the_way_out():
    """torch's words alone named neither the buffers nor the way out; the note does, and both
    ways out it names run (eval: the running statistics are read, not written)."""
    params, apply, info = fzero.from_module(_bn_model())
    with pytest.raises(RuntimeError, match=_TORCH_WORDS) as caught:
        _step(apply, params, "func")
    note = _notes(caught.value)
    assert "'1.running_mean', '1.running_var', '1.num_batches_tracked'" in note, note
    assert "engine='autograd'" in note and "apply.eval()" in note, note
    before = {n: b.clone() for n, b in info.buffers.items()}
    apply.eval()
    assert torch.isfinite(_step(apply, params, "func"))
    assert all(torch.equal(before[n], b) for n, b in info.buffers.items())  # read, not written
    apply.train()
    assert torch.isfinite(_step(apply, params, "autograd"))
    assert info.buffers["1.num_batches_tracked"].item() == before["1.num_batches_tracked"].item() + 1


class _InplaceEma(nn.Module):
    """A forward writing its own buffer in place: not a module torch says writes buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        self.ema.mul_(0.9).add_(0.1 * y.detach().mean(0))
        return y


def test_a_forward_writing_another_buffer_gets_the_general_note_naming_the_buffers_it_holds():
    params, apply, _ = fzero.from_module(_InplaceEma())
    with pytest.raises(RuntimeError, match=_TORCH_WORDS) as caught:
        _step(apply, params, "func")
    note = _notes(caught.value)
    assert "the module holds buffers 'ema'" in note and "engine='autograd'" in note, note
    assert "apply.eval()" not in note, note  # eval would not stop this forward's write


def test_the_note_is_for_functorchs_mutation_error_only():
    """Another error of the forward under engine='func' keeps torch's message alone; the match is
    on functorch's words (any case), and nothing else."""
    params, apply, _ = fzero.from_module(_bn_model())
    mesh = fzero.SimMesh(1)

    def rank():
        state = fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh)
        step = fzero.train_step(lambda p, x: apply(p, x).sum(), engine="func")
        return step(state, torch.randn(5, 6))  # 6 features, the model takes 4

    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as caught:
        mesh.run(rank)
    assert "torch.func transform" not in _notes(caught.value)
    module, buffers = _bn_model(), {"1.running_mean": torch.zeros(8)}
    assert captured_write_note("mat1 and mat2 shapes cannot be multiplied (5x6 and 4x8)", module, buffers) == ""
    assert "'1.running_var'" in captured_write_note("... that would MUTATE A CAPTURED TENSOR. ...", module, buffers)


def test_training_writes_lists_norm_layers_that_track_statistics_in_training_mode():
    tracked = nn.Sequential(nn.BatchNorm1d(2), nn.BatchNorm1d(2, track_running_stats=False),
                            nn.InstanceNorm1d(2, track_running_stats=True), nn.InstanceNorm1d(2))
    assert training_writes(tracked) == ["0.running_mean", "0.running_var", "0.num_batches_tracked",
                                        "2.running_mean", "2.running_var", "2.num_batches_tracked"]
    assert training_writes(tracked.eval()) == []
    assert training_writes(nn.BatchNorm2d(3)) == ["running_mean", "running_var", "num_batches_tracked"]


# ---------------------------------------------------------------------------------------------
# Leaves of a dtype fzero does not shard


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_an_integer_leaf_of_a_plain_pytree_is_told_a_way_out_it_has(dtype):
    """A plain pytree has no buffers: "keep it outside the params pytree (e.g. as a buffer)" was no
    way out there (found in review)."""
    params = {"w": torch.randn(3), "n": torch.ones(2, dtype=dtype)}
    with pytest.raises(fzero.LayoutError, match=rf"leaf 'n' has dtype {dtype} and shape \(2,\)") as caught:
        fzero.layout.plan(params, 2)
    message = str(caught.value)
    assert "pass it to the loss another way: in the batch, or closed over by the loss" in message, message
    assert "as a buffer)" not in message and "freezing" not in message, message


def test_a_frozen_integer_leaf_is_told_that_freezing_does_not_exempt_it():
    params = {"w": torch.randn(3), "n": torch.tensor(3)}
    groups = [fzero.ParamGroup("f", match=lambda p: p == "n", frozen=True)]
    with pytest.raises(fzero.LayoutError, match=r"leaf 'n' has dtype torch.int64 and shape \(\)") as caught:
        fzero.layout.plan(params, 1, groups=groups)
    message = str(caught.value)
    assert "freezing does not exempt it: a frozen leaf is sharded" in message, message
    assert "in the batch, or closed over by the loss" in message, message


def test_a_modules_integer_parameter_is_told_to_be_a_buffer_by_from_module():
    """Beside float parameters, from_module said "put them in different units", which then failed
    in init; a module's integer parameter is better a buffer, which from_module keeps as one."""
    model = nn.Linear(3, 2)
    model.count = nn.Parameter(torch.tensor(3), requires_grad=False)
    for units in (None, lambda name: name):
        with pytest.raises(fzero.LayoutError, match=r"leaf 'count' has dtype torch.int64") as caught:
            params, _, info = fzero.from_module(model, units=units)
            fzero.layout.plan(params, 1, units=info.units, groups=info.groups)
        assert "register it as a buffer of its module" in str(caught.value), str(caught.value)
        assert "different units" not in str(caught.value)
    model.count = None
    del model._parameters["count"]
    model.register_buffer("count", torch.tensor(3))
    params, _, info = fzero.from_module(model)
    assert set(params) == {"weight", "bias"} and "count" in info.buffers  # the way out


class _ToComplex(nn.Module):
    def forward(self, re, im):
        return torch.complex(re, im)

    def right_inverse(self, w):
        return w.real.clone(), w.imag.clone()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_complex_module_parameter_trained_as_two_real_ones_is_torch_adamw_on_the_complex_one(stage):
    """The refusal's way out for a module's complex parameter (found in review: the real-view advice
    cannot reach a module's weight, and a parametrization returning one real view is refused by
    torch): two real parameters through a parametrization. It trains bit for bit as
    torch.optim.AdamW(foreach=False) on the complex module, which views complex params as real."""
    def make(split):
        torch.manual_seed(0)
        m = nn.Linear(4, 3, dtype=torch.complex64)
        if split:
            for name in ("weight", "bias"):
                torch.nn.utils.parametrize.register_parametrization(m, name, _ToComplex())
        return m

    def loss_of(forward, b):
        return F.mse_loss(torch.view_as_real(forward(b[0].to(torch.complex64))), b[1])

    g = torch.Generator().manual_seed(1)
    data = [[(torch.randn(5, 4, generator=g), torch.randn(5, 3, 2, generator=g)) for _ in range(2)] for _ in range(3)]
    ref = make(False)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    for step in data:
        grads = [torch.autograd.grad(loss_of(ref, b), list(ref.parameters())) for b in step]
        for p, g0, g1 in zip(ref.parameters(), *grads):
            p.grad = g0 * 0.5 + g1 * 0.5
        opt.step()
    with pytest.raises(fzero.LayoutError, match="register_parametrization"):
        fzero.init(fzero.from_module(make(False))[0], optim.adamw(1e-2), stage=stage, mesh=fzero.SimMesh(1))
    params, apply, _ = fzero.from_module(make(True))
    mesh = fzero.SimMesh(2)

    def rank(batches):
        state = fzero.init(params, optim.adamw(1e-2, impl="single"), stage=stage, mesh=mesh)
        step = fzero.train_step(lambda p, b: loss_of(lambda x: apply(p, x), b))
        for b in batches:
            state, _ = step(state, b)
        return fzero.gather(state)

    full = mesh.run(rank, [([d[r] for d in data],) for r in range(2)])[0]
    for name in ("weight", "bias"):
        got = torch.complex(full[f"parametrizations.{name}.original0"], full[f"parametrizations.{name}.original1"])
        assert torch.equal(got, getattr(ref, name).detach())


def test_a_complex_leaf_is_told_its_real_view_and_that_way_runs():
    w = torch.randn(3, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
    with pytest.raises(fzero.LayoutError, match=r"leaf 'w' has dtype torch.complex64 and shape \(3,\)") as caught:
        fzero.layout.plan({"w": w}, 2)
    assert "torch.view_as_real(t)" in str(caught.value) and "torch.complex(w[..., 0], w[..., 1])" in str(caught.value)
    mesh, x = fzero.SimMesh(2), torch.arange(3.0)

    def loss(p, x):
        return (torch.complex(p["w"][..., 0], p["w"][..., 1]) * x).abs().sum() + p["a"].sum()

    def rank():  # "a" first: "w" starts at an odd offset of the flat bucket
        state = fzero.init({"a": torch.zeros(1), "w": torch.view_as_real(w)}, optim.sgd(0.1), stage=3, mesh=mesh)
        return fzero.train_step(loss)(state, x)[1].loss

    want = loss({"a": torch.zeros(1), "w": torch.view_as_real(w)}, x)
    assert all(torch.allclose(got, want.to(got.dtype)) for got in mesh.run(rank))
