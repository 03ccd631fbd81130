"""nn.Module interop (`fzero.from_module`, `fzero.units_by_prefix`), in process.

- `from_module` keeps tied weights tied (one leaf, its aliases recorded; transformers' GPT-2
  head follows its embedding) and `apply(params, ...)` equals the module's forward bit for bit;
  its skeleton holds no parameter storage (meta placeholders), and a missing parameter is named;
- parameters with `requires_grad=False` become a frozen `ParamGroup` that no step moves, and it
  wins over a user group listed before it; a parameter no loss uses is not decayed;
- buffers are per call's copy and updated in place (BatchNorm), the module itself untouched;
- a unit mixing dtypes or devices, and `units_by_prefix` on a missing container, are errors
  naming the parameters / the container; transformers imports without warnings.

The models are tests/ddp_cases.py's; from_module against torch DDP is tests/test_ddp.py.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero import from_module, optim, units_by_prefix

from . import ddp_cases as cases


def test_from_module_keeps_tied_weights_tied_and_matches_the_module():
    model = cases.gpt2()
    params, apply, info = from_module(model, units=units_by_prefix(model, "transformer.h"))
    assert info.aliases["transformer.wte.weight"] == ("transformer.wte.weight", "lm_head.weight")
    assert "lm_head.weight" not in params
    assert len(params) == len(list(model.parameters()))
    x = torch.randint(0, 64, (2, 8))
    want = model(x, labels=x)
    got = apply({k: v.clone().requires_grad_() for k, v in params.items()}, x, labels=x)
    assert torch.equal(want.logits, got.logits) and torch.equal(want.loss, got.loss)
    # a changed embedding changes the head too (tied), not only the input embedding
    moved = dict(params, **{"transformer.wte.weight": params["transformer.wte.weight"] + 1})
    m2 = copy.deepcopy(model)
    with torch.no_grad():
        m2.transformer.wte.weight.add_(1)
    assert torch.equal(m2(x).logits, apply(moved, x).logits)
    assert {info.units(k) for k in params} == {"transformer.h.0", "transformer.h.1", "default"}


def test_skeleton_holds_no_parameter_storage():
    model = cases.gpt2()
    params, apply, info = from_module(model)
    # the skeleton holds meta placeholders only; the real tensors are the caller's
    skeleton = apply._skeleton
    assert all(p.is_meta for p in skeleton.parameters())
    assert all(p.is_meta for _, p in skeleton.named_parameters(remove_duplicate=False))
    with pytest.raises(fzero.FzeroError, match="missing"):
        apply({k: v for k, v in params.items() if k != "lm_head.weight" and not k.endswith("ln_f.bias")},
              torch.zeros(1, 2, dtype=torch.long))


def test_frozen_parameters_become_a_frozen_group_and_stay_put():
    model = cases.MLP()
    params, apply, info = from_module(model)
    assert info.frozen == ("head.bias",)
    assert [g.frozen for g in info.groups] == [True] and info.groups[0].match("head.bias")
    mesh = fzero.SimMesh(2)
    opt = fzero.optim.adamw(1e-2)
    batches = cases.make_batches("mlp", 2, steps=1)

    def rank_fn(batch):
        state = fzero.init(params, opt, stage=3, mesh=mesh, groups=info.groups)
        step = fzero.train_step(lambda p, b: cases.loss_of("mlp", apply(p, b[0]), b))
        state, _ = step(state, batch)
        return fzero.gather(state)

    out = mesh.run(rank_fn, [(b[0],) for b in batches])
    assert torch.equal(out[0]["head.bias"], params["head.bias"])
    assert not torch.equal(out[0]["head.weight"], params["head.weight"])
    assert torch.equal(out[0]["unused.weight"], params["unused.weight"])  # no gradient: no weight decay


def test_buffers_are_per_rank_and_updated_in_place():
    model = cases.MLP()
    params, apply, info = from_module(model)
    before = info.buffers["body.1.running_mean"].clone()
    apply(params, torch.randn(4, 8))
    assert not torch.equal(info.buffers["body.1.running_mean"], before)
    assert torch.equal(model.body[1].running_mean, before)  # the original module is untouched
    assert info.buffers["body.1.num_batches_tracked"].item() == 1


def test_mixed_dtypes_within_a_unit_name_the_parameters():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].to(torch.float64)
    with pytest.raises(fzero.LayoutError, match=r"'0.weight' is torch.float32.*'1.weight' is torch.float64"):
        from_module(model)
    from_module(model, units=units_by_prefix(model, ""))  # one unit per child: fine


def test_mixed_devices_within_a_unit_name_the_parameters():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[1].to("meta")
    with pytest.raises(fzero.LayoutError, match=r"'0.weight' is torch.float32 on cpu, '1.weight' is .* on meta"):
        from_module(model)


def test_units_by_prefix_names_a_missing_container():
    with pytest.raises(fzero.FzeroError, match="no submodule 'blocks'"):
        units_by_prefix(nn.Sequential(nn.Linear(2, 2)), "blocks")


def test_transformers_imports_without_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cases.gpt2()


def test_frozen_group_wins_wherever_it_stands():
    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    params, apply, info = fzero.from_module(model)
    nowd = fzero.ParamGroup("nowd", match=lambda p: p.endswith("bias"), weight_decay=False)
    mesh, opt = fzero.SimMesh(1), optim.sgd(0.1)

    def rank_fn():
        state = fzero.init(params, opt, stage=1, mesh=mesh, groups=[nowd, *info.groups])
        state, _ = fzero.train_step(lambda p, x: apply(p, x).sum())(state, torch.ones(1, 3))
        return fzero.gather(state)

    (final,) = mesh.run(rank_fn)
    assert torch.equal(final["bias"], params["bias"]) and not torch.equal(final["weight"], params["weight"])


@pytest.mark.parametrize("stage", [0, 3])
def test_apply_eval_switches_dropout_and_batchnorm_off_in_every_copy(stage):
    """`model.eval()` after `from_module` does not reach the copy `apply` runs; `apply.eval()`
    does, also in the per-rank copies a stage-3 step made before (reading units on use): the
    evaluation is then deterministic, leaves the running statistics alone, and equals the torch
    module's eval forward with the same values bit for bit; `apply.train()` switches back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 4))
    params, apply, info = from_module(model, units=units_by_prefix(model, ""))
    mesh, x = fzero.SimMesh(2), torch.randn(6, 8)
    loss = lambda p, b: apply(p, b).square().mean()  # noqa: E731
    assert apply.training and apply.eval() is apply and not apply.training

    def rank_fn():
        apply.train()
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units)
        state, _ = fzero.train_step(loss)(state, x)  # train mode: the copies are made, the stats move
        apply.eval()  # each rank its own, as each process of a DistMesh (test_apply_mode_is_per_rank_on_simmesh)
        fzero.collectives.all_reduce(torch.zeros(1), mesh)
        stats = {k: v.clone() for k, v in info.buffers.items()}
        outs = [fzero.evaluate(lambda p, b: apply(p, b))(state, x) for _ in range(2)]
        still = all(torch.equal(v, info.buffers[k]) for k, v in stats.items())
        return outs, still, fzero.gather(state)

    for outs, still, values in mesh.run(rank_fn):
        ref = copy.deepcopy(model).eval()
        ref.load_state_dict({**values, **info.buffers})
        with torch.no_grad():
            want = ref(x)
        assert still and torch.equal(outs[0], outs[1]) and torch.equal(outs[0], want)
    tracked = int(info.buffers["1.num_batches_tracked"])
    apply.eval()(params, x)
    assert int(info.buffers["1.num_batches_tracked"]) == tracked
    assert apply.train() is apply and apply.training
    apply(params, x)  # training again: BatchNorm counts the batch
    assert int(info.buffers["1.num_batches_tracked"]) == tracked + 1
    with pytest.raises(fzero.ConfigError, match="mode must be a bool"):
        apply.train("no")


class _ParentReadsChild(torch.nn.Module):
    """A parent that reads a child's weight outside the child's forward: a tied head
    (`F.linear(h, self.emb.weight[:3])`), or its device for new indices."""

    def __init__(self, how: str, d: int = 8):
        super().__init__()
        self.how, self.emb, self.mid = how, torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.b = torch.nn.Parameter(torch.zeros(3))

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.emb(x))))
        assert self.emb.weight.dtype == torch.float32 and self.emb.weight.shape == (8, 8)  # metadata: fine
        if self.how == "device":
            h = h + torch.arange(8, device=self.emb.weight.device)
        w = self.emb.weight[:3] if self.how == "head" else self.mid.weight[:3].detach() * 0
        return torch.nn.functional.linear(h, w).mean(0) + self.b


@pytest.mark.parametrize("how", ["head", "device"])
@pytest.mark.parametrize("stage", [0, 3])
def test_a_parent_reading_a_childs_param_outside_its_forward_is_a_config_error(how, stage):
    """Found in review: with gather="on_use" a unit is bound only while its home submodule runs,
    so a parent reading the child's weight got the meta stand-in, and torch's CPU matrix product
    over a meta operand returned uninitialised memory: a silently wrong loss at every stage (a
    device read gave meta indices). Now every use but reading its dtype or shape raises
    `ConfigError` naming the parameter and its unit; `gather="eager"` binds every unit and gives
    stage 0's bits at stage 3."""
    torch.manual_seed(0)
    model = _ParentReadsChild(how)
    params, apply, info = fzero.from_module(model, units=lambda p: p.split(".")[0])
    mesh = fzero.SimMesh(2)

    def rank_fn(stage, gather):
        state = fzero.init(params, fzero.optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units)
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(mesh.rank))
        state, m = fzero.train_step(lambda p, x: apply(p, x).square().mean(), gather=gather)(state, x)
        return fzero.gather(state), m.loss

    with pytest.raises(fzero.ConfigError, match=r"parameter 'emb.weight' \(unit 'emb'\) was used \((__getitem__|"
                                                r"\.device)\) outside the forward of the submodule"):
        mesh.run(lambda: rank_fn(stage, "on_use"))
    want, got = mesh.run(lambda: rank_fn(0, "eager")), mesh.run(lambda: rank_fn(stage, "eager"))
    for (p0, l0), (p1, l1) in zip(want, got):
        assert torch.equal(l0, l1) and all(torch.equal(p0[k], p1[k]) for k in p0)


class _FrozenProjection(torch.nn.Module):
    """A linear, then `nn.MultiheadAttention(batch_first=True)` whose input projection is frozen:
    its `linear` on a transposed 3-d input is one product or a batched one as `torch.matmul` finds
    the weight's transpose requiring grad or not."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.inp, self.attn, self.head = torch.nn.Linear(d, d), torch.nn.MultiheadAttention(d, 2, batch_first=True), \
            torch.nn.Linear(d, 3)
        self.attn.in_proj_weight.requires_grad_(False)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.head(h + self.attn(h, h, h, need_weights=False)[0]).mean(1)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_frozen_weight_takes_the_product_torchs_frozen_param_takes(stage):
    """Found in review: a frozen leaf came out of the unit's Function requiring grad, so its
    transpose did, and `torch.matmul` folded the attention's input projection into one product,
    where torch's frozen param (no grad) takes the batched one: the logits differed from the torch
    module's in the last bit (5.96e-08), at every stage. Frozen leaves are now marked
    non-differentiable: the step's forward gives the module's logits bit for bit."""
    torch.manual_seed(0)
    model = _FrozenProjection()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 5, 8, generator=g), torch.randint(0, 3, (2,), generator=g)
    want = model(x).detach()
    params, apply, info = fzero.from_module(model, units=lambda p: p.split(".")[0])
    mesh = fzero.SimMesh(1)
    seen = []

    def loss(p, b):
        out = apply(p, b[0])
        seen.append(out.detach())
        return torch.nn.functional.cross_entropy(out, b[1])

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units, groups=info.groups)
        fzero.train_step(loss)(state, (x, y))

    mesh.run(rank_fn)
    assert torch.equal(seen[0], want)


# -- found in review: pre-hooks, sparse gradients, extra leaves, reassigned buffers, copies -----


@pytest.mark.parametrize("stage", [0, 3])
def test_a_users_forward_pre_hook_reads_the_bound_params(stage):
    """`torch.nn.utils.prune` computes the weight in a forward pre-hook of its module, from
    `weight_orig`: fzero's binding pre-hook ran after it, so the hook read a placeholder and the
    step raised "used outside the forward of the submodule its unit is bound in". fzero's now
    runs first: the step equals torch's SGD on the pruned module, bit for bit."""
    import torch.nn.utils.prune as prune

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    with torch.no_grad():  # prune's weight is a computed attribute: from_module copies it after a forward
        model(torch.randn(1, 4))
    ref = copy.deepcopy(model)
    x, y = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    params, apply, info = from_module(model, units=units_by_prefix(model, ""))
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units)
        state, _ = fzero.train_step(lambda p, b: nn.functional.cross_entropy(apply(p, b[0]), b[1]))(state, (x, y))
        return fzero.gather(state)

    got = mesh.run(rank_fn)[0]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=False)
    nn.functional.cross_entropy(ref(x), y).backward()
    opt.step()
    for k, v in ref.named_parameters():
        assert torch.equal(got[k], v.detach()), k


def test_a_module_just_pruned_names_the_copy_that_failed():
    import torch.nn.utils.prune as prune

    model = nn.Sequential(nn.Linear(4, 8))
    prune.l1_unstructured(model[0], "weight", amount=0.5)
    with pytest.raises(fzero.FzeroError, match=r"from_module copies the module .*torch.nn.utils.prune"):
        from_module(model)


def test_a_sparse_embedding_is_refused_naming_the_leaf():
    """It failed in the backward with torch's "copy_() between dense and sparse Tensors"."""
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    with pytest.raises(fzero.LayoutError, match=r"'0.weight' \(Embedding\(10, 4\), sparse=True\).*sparse=False"):
        from_module(model)


def test_apply_given_an_extra_leaf_names_it_and_how_to_nest():
    """A flat `{**params, "temp": t}` under on-use gathering said every leaf was missing and the
    extra one was not named (found in review)."""
    model = nn.Linear(4, 2)
    params, apply, _ = from_module(model)
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init({**params, "temp": torch.ones(2)}, optim.sgd(0.1), stage=0, mesh=mesh)
        fzero.train_step(lambda p, x: (apply(p, x) * p["temp"]).sum())(state, torch.ones(3, 4))

    with pytest.raises(fzero.FzeroError, match=r"\(2 leaves\); missing \[\], unexpected \['temp'\]; .*nest them"):
        mesh.run(rank_fn)


@pytest.mark.parametrize("how", ["dict", "evaluate stage 3", "step stage 3"])
def test_apply_given_another_models_params_of_other_shapes_names_them(how):
    """Another model's params under the same names (`inp.*`, `out.*`, wider) ran through `apply`,
    silently where the shapes happened to fit (found in review: a wrong output, no error); a
    single wrong leaf gave torch's shape error, naming none. `apply` compares the shapes it is
    handed with the module's: the dict path on each call (host metadata), the on-use path once
    per layout; `FzeroError` names each leaf, its shape and the module's."""

    class Net(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.inp, self.out, self.scale = nn.Linear(8, d), nn.Linear(d, 4), d ** -0.5

        def forward(self, x):
            return self.out(torch.tanh(self.inp(x)) * self.scale)

    torch.manual_seed(0)
    model_a = Net(16)
    params_a, apply_a, _ = from_module(model_a)
    params_b, _, _ = from_module(Net(32))
    x = torch.randn(5, 8)
    words = (r"'inp.weight' \[32, 8\] \(the module's: \[16, 8\]\), 'inp.bias' \[32\].*\(3 of 4 leaves\).*"
             r"another model's under the same names")
    if how == "dict":
        with pytest.raises(fzero.FzeroError, match=words):
            apply_a(params_b, x)
        with pytest.raises(fzero.FzeroError, match=r"'inp.weight' \[16, 9\] \(the module's: \[16, 8\]\) \(1 of 4"):
            apply_a({**params_a, "inp.weight": torch.zeros(16, 9)}, x)  # before: torch's error, naming no leaf
        assert torch.equal(apply_a(params_a, x), model_a(x))  # its own params run as the module does
        stacked = {k: torch.stack([v, v]) for k, v in params_a.items()}  # two models' params, not mapped over
        with pytest.raises(fzero.FzeroError, match=r"one leading dimension of 2: .*torch.func.vmap\(apply, in_dims"):
            apply_a(stacked, x)
        with pytest.raises(fzero.FzeroError, match=r"param 'inp.bias' is a float, not a tensor"):
            apply_a({**params_a, "inp.bias": 0.5}, x)
        return
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(params_b, optim.sgd(0.1), stage=3, mesh=mesh)
        if how == "evaluate stage 3":
            return fzero.evaluate(lambda p, b: apply_a(p, b))(state, x)
        return fzero.train_step(lambda p, b: apply_a(p, b).sum())(state, x)

    with pytest.raises(fzero.FzeroError, match=words):
        mesh.run(rank_fn)


class _Ema(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)
        self.register_buffer("ema", torch.zeros(3))

    def forward(self, x):
        y = self.fc(x)
        if self.training:
            self.ema = 0.9 * self.ema + 0.1 * y.detach().mean(0)  # reassigned, not written in place
        return y


@pytest.mark.parametrize("how", ["dict", "stage 3 on use"])
def test_a_buffer_the_forward_reassigns_keeps_its_new_value(how):
    """`functional_call` (and the on-use path, as it) put the old buffer back after the forward,
    so an EMA buffer updated by reassignment stayed zero (found in review). Its new value is now
    copied into the buffer `info.buffers` holds: after two forwards it equals the module's."""
    torch.manual_seed(0)
    model, x = _Ema(), torch.randn(4, 3)
    ref = copy.deepcopy(model)
    params, apply, info = from_module(model)
    ref(x), ref(x)
    if how == "dict":
        apply(params, x), apply(params, x)
    else:
        mesh = fzero.SimMesh(1)

        def rank_fn():
            state = fzero.init(params, optim.sgd(0.0), stage=3, mesh=mesh)
            step = fzero.train_step(lambda p, b: apply(p, b).sum())
            for _ in range(2):
                state, _ = step(state, x)

        mesh.run(rank_fn)
    assert torch.equal(info.buffers["ema"], ref.ema) and not torch.equal(ref.ema, torch.zeros(3))


def test_a_buffer_reassigned_to_another_shape_is_refused():
    class Grow(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.register_buffer("seen", torch.zeros(1))

        def forward(self, x):
            self.seen = torch.cat([self.seen, x.detach().sum().reshape(1)])
            return self.fc(x)

    params, apply, _ = from_module(Grow())
    with pytest.raises(fzero.ConfigError, match=r"reassigned buffer 'seen' \(float32\[1\] on cpu\) to float32\[2\]"):
        apply(params, torch.ones(1, 2))


def test_the_per_thread_copies_go_with_their_threads():
    """Each SimMesh run's threads made their own copies of the skeleton, and `apply` kept every one
    for ever (60 after 30 runs, found in review): they are now held weakly."""
    import gc

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    params, apply, info = from_module(model, units=units_by_prefix(model, ""))
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
        fzero.train_step(lambda p, x: apply(p, x).sum())(state, torch.ones(3, 2))

    for _ in range(10):
        mesh.run(rank_fn)
    gc.collect()
    assert len(apply._copies) <= 2
    apply.eval()  # the skeleton and every live copy
    assert not apply.training


def _conv_bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(4, 2))


def _bf16_step(model):
    """One bf16-policy step of `model` on SimMesh(2), stage 3: the ranks' losses."""
    params, apply, info = from_module(model)
    mesh = fzero.SimMesh(2)
    x, y = torch.randn(4, 3, 6, 6), torch.randint(0, 2, (4,))

    def rank():
        state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh,
                           precision=fzero.Precision(torch.bfloat16, torch.float32))
        step = fzero.train_step(lambda p, b: nn.functional.cross_entropy(apply(p, b[0].bfloat16()).float(), b[1]))
        return step(state, (x, y))[1].loss

    return mesh.run(rank)


def test_a_precision_policy_beside_fp32_buffers_is_explained_on_torchs_dtype_error():
    """A precision policy casts the params, not the buffers: BatchNorm's fp32 running statistics
    beside its bf16 weight make torch raise "expected scalar type BFloat16 but found Float",
    which names neither; `apply` adds a note naming the buffers and the way out (found in
    review). The way out -- the module's floating buffers cast before `from_module` -- runs."""
    with pytest.raises(RuntimeError, match="scalar type") as caught:
        _bf16_step(_conv_bn())
    note = "\n".join(getattr(caught.value, "__notes__", []))
    assert "casts the params to its compute dtype, not the module's buffers" in note, note
    assert "1.running_mean float32, 1.running_var float32" in note, note
    assert "reach the module in torch.bfloat16" in note and "b.to(torch.bfloat16)" in note, note  # LazyParams' wires
    model = _conv_bn()
    for m in model.modules():
        for name, b in m.named_buffers(recurse=False):
            if b.is_floating_point():
                setattr(m, name, b.to(torch.bfloat16))
    losses = _bf16_step(model)
    assert torch.equal(losses[0], losses[1]) and torch.isfinite(losses[0])


def test_the_buffer_note_is_only_for_dtype_errors_of_modules_with_floating_buffers():
    """The note is for a floating buffer in none of the params' dtypes: not for torch's dtype error
    of an input (fp32 params and buffers, a float64 or an int64 input, no policy: found in review),
    nor for buffers already in the params' dtype; it names the params' dtype for the cast."""
    from fzero._src.module import buffer_dtype_note, param_dtypes

    bf16, fp32 = {torch.bfloat16}, {torch.float32}
    floating = {"bn.running_mean": torch.zeros(2), "bn.num_batches_tracked": torch.zeros((), dtype=torch.int64)}
    note = buffer_dtype_note("expected scalar type BFloat16 but found Float", floating, bf16)
    assert "bn.running_mean float32" in note and "b.to(torch.bfloat16)" in note, note
    assert "num_batches_tracked" not in note
    assert buffer_dtype_note("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)", floating, bf16) == ""
    assert buffer_dtype_note("expected scalar type BFloat16 but found Float",
                             {"n": torch.zeros((), dtype=torch.int64)}, bf16) == ""
    assert buffer_dtype_note("mat1 and mat2 must have the same dtype, but got Double and Float", floating, fp32) == ""
    assert "b.to(dtype)" in buffer_dtype_note("expected scalar type BFloat16 but found Float", floating,
                                              {torch.bfloat16, torch.float16})
    params, apply, _ = from_module(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
    assert param_dtypes(params) == fp32
    for x in (torch.ones(2, 3, dtype=torch.float64), torch.ones(2, 3, dtype=torch.long)):
        with pytest.raises(RuntimeError, match="dtype") as caught:
            apply(params, x)
        assert not getattr(caught.value, "__notes__", None), caught.value.__notes__


@pytest.mark.parametrize("stage", [0, 3])
def test_apply_mode_is_per_rank_on_simmesh(stage):
    """Each rank of a `SimMesh` runs `apply.eval()`, a collective, an evaluation, `apply.train()`
    (a rank program written for one process per rank). Before, the ranks shared one mode: rank 0
    ran past the collective and switched back to training before rank 1's evaluation, which ran
    with dropout on, silently, and took masks from the RNG the next steps use (found in review).
    Now each rank keeps its own mode, as each process of a `DistMesh` does; a mode set outside
    `mesh.run` is every rank's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Dropout(0.5), nn.Linear(16, 4))
    params, apply, info = from_module(model, units=units_by_prefix(model, ""))
    mesh, x = fzero.SimMesh(2), torch.randn(6, 8)

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units)
        apply.eval()
        full = fzero.gather(state)  # a collective: rank 0 runs on past it first
        with torch.no_grad():
            plain = apply(full, x)  # the dict path: one copy every rank runs
        lazy = fzero.evaluate(lambda p, b: apply(p, b))(state, x)  # stage 3: on use, each rank's copy
        evaluating = apply.training
        apply.train()
        return plain, lazy, evaluating, apply.training

    for plain, lazy, evaluating, training in mesh.run(rank_fn):
        with torch.no_grad():
            want = model.eval()(x)
        assert torch.equal(plain, want) and torch.equal(lazy, want) and not evaluating and training
    assert apply.training  # the ranks' modes were theirs: outside the run, the one set before it
    apply.eval()  # outside mesh.run: every rank's
    assert mesh.run(lambda: apply.training) == [False, False]
    apply.train()


def _frozen_bn():
    """The root trains, its BatchNorm was set to eval before from_module (frozen statistics)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
    m[1].eval()
    return m


def test_a_rank_that_sets_no_mode_keeps_the_flags_the_module_came_with():
    """Rank 0 alone calls `apply.eval()` and runs the dict path; rank 1, which set no mode, then
    runs it: its frozen BatchNorm must stay frozen, as in a process of a DistMesh, and so must the
    main thread's after the run. Before, a mode per rank compared by the root's flag alone set
    every submodule training for rank 1 and the main thread (found in review)."""
    params, apply, info = from_module(_frozen_bn())
    mesh, x = fzero.SimMesh(2), torch.randn(5, 4)

    def rank_fn():
        if mesh.rank == 0:
            apply.eval()
            with torch.no_grad():
                apply(params, x)
        fzero.collectives.all_reduce(torch.zeros(1), mesh)
        before = info.buffers["1.running_mean"].clone()
        if mesh.rank == 1:
            with torch.no_grad():
                apply(params, x)
        return torch.equal(before, info.buffers["1.running_mean"])

    assert mesh.run(rank_fn) == [True, True]
    before = info.buffers["1.running_mean"].clone()
    with torch.no_grad():
        apply(params, x)
    assert torch.equal(before, info.buffers["1.running_mean"]) and apply.training


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_apply_train_sets_every_submodule_inside_mesh_run_as_outside(where):
    """`apply.train()`, as `nn.Module.train()`, sets every submodule's flag: a frozen BatchNorm
    trains after it, whether a rank calls it inside `mesh.run` or the caller outside. Before,
    inside `mesh.run` it reached no submodule where the root already trained (found in review)."""
    params, apply, info = from_module(_frozen_bn())
    mesh, x = fzero.SimMesh(2), torch.randn(5, 4)
    if where == "outside":
        apply.train()

    def rank_fn():
        if where == "inside":
            apply.train()
        state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
        before = info.buffers["1.running_mean"].clone()
        fzero.train_step(lambda p, b: apply(p, b).square().mean())(state, x)
        return not torch.equal(before, info.buffers["1.running_mean"])

    assert mesh.run(rank_fn) == [True, True]


def test_a_new_simmesh_does_not_take_a_freed_meshs_rank_modes():
    """Ranks' modes are held per mesh, weakly: a mesh made where a freed one was (the same `id`)
    starts from the shared mode. Before, they were keyed by `id(mesh)`, and a new mesh's ranks ran
    with dropout off where `apply.training` said True (found in review)."""
    import gc

    _, apply, _ = from_module(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5)))

    def evaluate_only():
        apply.eval()
        return apply.training

    for _ in range(8):
        mesh = fzero.SimMesh(2)
        assert mesh.run(evaluate_only) == [False, False]
        del mesh
        gc.collect()
        assert fzero.SimMesh(2).run(lambda: apply.training) == [True, True]
    assert len(apply._modes.ranks) == 0


class _LoRALinear(torch.nn.Module):
    """A frozen bf16 base weight beside fp32 adapters, in one module (PEFT's usual dtypes)."""

    def __init__(self, d: int = 6, r: int = 2):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(d, d).bfloat16(), requires_grad=False)
        self.lora_A = torch.nn.Parameter(torch.randn(r, d) * 0.1)
        self.lora_B = torch.nn.Parameter(torch.randn(d, r) * 0.1)

    def forward(self, x):
        return F.linear(x.bfloat16(), self.weight).float() + x @ self.lora_A.T @ self.lora_B.T


def test_a_unit_of_two_dtypes_is_told_units_split_one_modules_parameters_and_that_recipe_trains():
    """The refusal of a unit mixing dtypes names the way out by path (found in review of a LoRA
    user: "put them in different units" did not say one module's parameters may be split); the
    recipe it gives trains, every stage with stage 0's bits."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(_LoRALinear(), torch.nn.Tanh(), _LoRALinear())
    with pytest.raises(fzero.LayoutError) as e:
        fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    text = str(e.value)
    assert "unit '0' mixes parameters on different devices or dtypes: '0.weight' is torch.bfloat16" in text
    assert "units go by parameter path, so one submodule's parameters may be split" in text
    recipe = text[text.index("dtypes = "):]
    namespace = {"model": model}
    exec(recipe.replace("; units=", "\nunits="), namespace)  # the message's own words, run
    params, apply, info = fzero.from_module(model, units=namespace["units"])
    assert info.units("0.weight") == "0-torch.bfloat16" and info.units("0.lora_A") == "0-torch.float32"
    mesh = fzero.SimMesh(2)
    x = torch.randn(2, 4, 6)

    def rank(stage, x):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units, groups=info.groups)
        for _ in range(2):
            state, _ = fzero.train_step(lambda p, b: apply(p, b).pow(2).mean())(state, x)
        return fzero.gather(state)

    results = {s: mesh.run(functools.partial(rank, s), [(x[0],), (x[1],)]) for s in (0, 3)}
    for a, b in zip(results[0], results[3]):
        assert all(torch.equal(a[k], b[k]) for k in a)
    assert torch.equal(results[3][0]["0.weight"], model[0].weight) and not torch.equal(
        results[3][0]["0.lora_A"], model[0].lora_A)


def test_a_config_dict_given_to_from_module_names_where_its_settings_go():
    with pytest.raises(fzero.FzeroError, match=r"from_module expects an nn.Module \(the model\), got dict: a config "
                                               r"dict \(DeepSpeed's\) has no place here; .*fzero.init \(stage="):
        fzero.from_module({"zero_optimization": {"stage": 3}})
    with pytest.raises(fzero.FzeroError, match=r"got list$"):
        fzero.from_module([torch.nn.Linear(2, 2)])
