"""Bad input and misuse: a clear error every time, never a silent wrong result, never a corrupted
state. Each test here failed (or passed silently with a wrong result) before its fix; the
mutation-testing gaps it closes are named in its docstring. The table of checked classes is
docs/bad-input.md."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

import fzero
from fzero import optim


def _sum_loss(p, x):
    return (p["w"].float() * x).sum()


# -- init ------------------------------------------------------------------------------------------


def test_init_broadcasts_rank0_params_by_default():
    """Mutation gap: `sync=False` as the default went unnoticed (no test gave ranks different
    initial params). DDP broadcasts rank 0's values at construction; so does `init`."""
    mesh = fzero.SimMesh(3)
    for stage in (0, 3):
        def rank_fn(r, sync):
            state = fzero.init({"w": torch.full((5,), float(r))}, optim.sgd(0.1), stage=stage, mesh=mesh, sync=sync)
            return fzero.gather(state)["w"]

        synced = mesh.run(lambda r: rank_fn(r, True), [(r,) for r in range(3)])
        assert all(torch.equal(w, torch.zeros(5)) for w in synced)
        if stage == 0:  # without sync each rank keeps its own replica
            apart = mesh.run(lambda r: rank_fn(r, False), [(r,) for r in range(3)])
            assert [w[0].item() for w in apart] == [0.0, 1.0, 2.0]


def test_init_rejects_meta_tensors_naming_the_leaf():
    mesh = fzero.SimMesh(2)
    with pytest.raises(fzero.LayoutError, match=r"\['w \(float32\[4\]\)'\] are meta tensors.*fzero.from_module on it again.*"
                                                r"fzero.accounting.estimate"):
        mesh.run(lambda: fzero.init({"w": torch.empty(4, device="meta"), "b": torch.ones(2)}, optim.sgd(0.1),
                                    stage=3, mesh=mesh))
    model = nn.Linear(3, 2, device="meta")
    params, _, info = fzero.from_module(model)
    with pytest.raises(fzero.LayoutError, match="meta tensors"):
        mesh.run(lambda: fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh, groups=info.groups))
    assert fzero.accounting.estimate(model, 2, stage=3).total > 0  # the estimate reads meta shapes


def test_init_rejects_a_torch_optimizer_naming_it():
    mesh = fzero.SimMesh(1)
    with pytest.raises(fzero.ConfigError, match=r"the class torch\.optim\.adamw\.AdamW"):
        mesh.run(lambda: fzero.init({"w": torch.ones(2)}, torch.optim.AdamW, stage=1, mesh=mesh))
    with pytest.raises(fzero.ConfigError, match="fzero.optim optimizer"):
        mesh.run(lambda: fzero.init({"w": torch.ones(2)}, "adamw", stage=1, mesh=mesh))
    # found in review: a factory not called, and the arguments swapped, were named by their types alone
    with pytest.raises(fzero.ConfigError, match=r"got the function fzero.optim.adamw itself: call it with its "
                                                r"hyper-parameters, fzero.optim.adamw\(lr, ...\)"):
        mesh.run(lambda: fzero.init({"w": torch.ones(2)}, optim.adamw, stage=1, mesh=mesh))
    with pytest.raises(fzero.ConfigError, match=r"got a builtins.dict \(the params\? init takes them first"):
        mesh.run(lambda: fzero.init(optim.sgd(0.1), {"w": torch.ones(2)}, stage=1, mesh=mesh))


def test_a_state_that_is_not_one_names_the_likely_mix_up():
    """Found in review: a step's `(state, metrics)` pair, or the params, passed as the state were
    named by their type alone; `apply(state, ...)` was said to miss every leaf."""
    mesh = fzero.SimMesh(1)
    model = nn.Linear(3, 2)
    params, apply, _ = fzero.from_module(model)

    def run():
        state = fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh)
        step = fzero.train_step(lambda p, x: apply(p, x).sum())
        out = step(state, torch.ones(1, 3))
        words = []
        for call in (lambda: step(out, torch.ones(1, 3)), lambda: fzero.gather(params), lambda: apply(state, 1.0),
                     lambda: fzero.train_step(lambda p, x: apply(p, x).sum().item())(state, torch.ones(1, 3))):
            with pytest.raises(fzero.FzeroError) as e:
                call()
            words.append(str(e.value))
        return words

    (pair, params_given, applied, a_float), = mesh.run(run)
    assert pair == ("expected the ZeroState made by fzero.init, got tuple of (ZeroState, ...): a step returns (state, "
                    "metrics); unpack it, state, metrics = step(state, batch)"), pair
    assert params_given == ("expected the ZeroState made by fzero.init, got dict (the params? the state is what "
                            "fzero.init(params, optimizer, stage=..., mesh=...) returns, and what each step returns "
                            "first)"), params_given
    assert applied.startswith("apply takes the params (a dict of tensors), not a ZeroState: call it inside the "
                              "loss"), applied
    assert a_float.endswith("got float; compute it from the params as a tensor and return that tensor: loss.item() "
                            "or float(loss) cuts the graph the step differentiates"), a_float


@pytest.mark.parametrize("setting, per_rank", [
    ("stage", lambda r: dict(stage=r + 1)),
    ("optimizer", lambda r: dict(opt=optim.adamw(1e-3 * (r + 1)))),
    ("buckets", lambda r: dict(units=None if r == 0 else (lambda p: p))),
    ("buckets", lambda r: dict(groups=[fzero.ParamGroup("nowd", match=lambda p: p == "b", weight_decay=r == 0)])),
    ("align", lambda r: dict(align=1 + 3 * r)),
    # a leaf frozen on one rank only (an nn.Parameter with requires_grad=False there): the buckets
    # name their leaves' paths (before, leaf indices), so the message shows which leaf it is
    ("buckets' \\(made of init's units= and groups=, and the params' requires_grad\\), .*\"default/float32/"
     "requires_grad=False frozen=True weight_decay=True lr_scale=1.0 leaves=\\(", lambda r: dict(frozen=r == 1)),
])
def test_init_rejects_settings_that_differ_across_ranks(setting, per_rank):
    """Before: a stage, units or optimizer mismatch surfaced later as a CollectiveMismatch of some
    op and tag (or, with DistMesh(verify=False), a hang). Now init names the setting on every rank."""
    mesh = fzero.SimMesh(2)

    def rank_fn(r):
        kw = dict(stage=2, opt=optim.adamw(1e-3), units=None, groups=(), align=1) | per_rank(r)
        opt, frozen = kw.pop("opt"), kw.pop("frozen", False)
        b = torch.nn.Parameter(torch.ones(3), requires_grad=False) if frozen else torch.ones(3)
        return fzero.init({"w": torch.ones(6), "b": b}, opt, mesh=mesh, **kw)

    with pytest.raises(fzero.ConfigError, match=f"settings differ across ranks.*'{setting}'"):
        mesh.run(rank_fn, [(0,), (1,)])


def test_init_names_the_differing_optimizer_setting_and_every_ranks_value():
    """Before: the message named only 'optimizer' and this rank's description, cut at 200
    characters, which never reached the lr; the ranks now exchange the differing setting's
    values (one text all-gather, only on the error path) and every rank names each value."""
    mesh = fzero.SimMesh(3)
    cases = [
        (lambda r: optim.adamw(1e-2 * (1 + (r > 0))), "lr: rank 0 0.01, rank 1 0.02, rank 2 0.02"),
        (lambda r: optim.adamw(1e-2, betas=(0.9, 0.99 if r == 2 else 0.999)), r"rank\(s\) \[2\] .*beta2: rank 0 0.999, rank 2 0.99;"),
        (lambda r: optim.adamw(optim.cosine(1e-2, 10 + r)), r"lr \(schedule fn.total\): rank 0 10, rank 1 11, rank 2 12"),
        (lambda r: optim.sgd(0.1) if r else optim.adamw(0.1), "name: rank 0 'adamw', rank 1 'sgd', rank 2 'sgd'"),
    ]
    for make, match in cases:
        errors = []

        def rank_fn(r):
            try:
                fzero.init({"w": torch.ones(4)}, make(r), stage=1, mesh=mesh)
            except fzero.ConfigError as e:
                errors.append(str(e))

        mesh.run(rank_fn, [(0,), (1,), (2,)])
        assert len(errors) == 3 and len(set(errors)) == 1, errors
        assert re.search(match, errors[0]), errors[0]
    with pytest.raises(fzero.ConfigError, match=r"'stage', rank\(s\) \[1, 2\] differ from rank 0: stage: rank 0 1, "
                                                r"rank 1 2, rank 2 3;"):
        mesh.run(lambda r: fzero.init({"w": torch.ones(4)}, optim.sgd(0.1), stage=1 + r, mesh=mesh), [(0,), (1,), (2,)])


def test_requires_grad_false_parameters_are_frozen():
    """torch's convention: a parameter that does not require grad is not trained -- as a raw
    pytree leaf (an nn.Parameter) and through from_module without passing its groups."""
    mesh = fzero.SimMesh(2)
    frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def rank_fn():
        state = fzero.init({"w": torch.ones(4), "f": frozen}, optim.sgd(0.5), stage=2, mesh=mesh)
        state, _ = fzero.train_step(lambda p, x: (p["w"] * x).sum() + (p["f"] * x[:3]).sum())(state, torch.ones(4))
        return fzero.gather(state)

    for full in mesh.run(rank_fn):
        assert torch.equal(full["f"], torch.ones(3)) and torch.equal(full["w"], torch.full((4,), 0.5))

    model = nn.Linear(4, 2)
    model.bias.requires_grad_(False)
    params, apply, info = fzero.from_module(model)
    bias = params["bias"].clone()

    def module_fn():
        state = fzero.init(params, optim.sgd(0.5), stage=1, mesh=mesh)  # no groups=info.groups
        state, _ = fzero.train_step(lambda p, x: apply(p, x).sum())(state, torch.ones(1, 4))
        return fzero.gather(state)

    for full in mesh.run(module_fn):
        assert torch.equal(full["bias"], bias) and not torch.equal(full["weight"], params["weight"])


# -- the step: non-finite values never reach the state ------------------------------------------------


def test_update_that_makes_params_nonfinite_raises_or_skips():
    """fp16 params with the default adamw(1e-3): eps = 1e-8 underflows in fp16, so the first
    update divides by zero. Before: inf written into the params with skipped=False."""
    mesh = fzero.SimMesh(2)
    params = {"w": torch.linspace(-1, 1, 64).half()}

    def run(on_nonfinite):
        def rank_fn():
            state = fzero.init(params, optim.adamw(1e-3), stage=3, mesh=mesh)
            new, m = fzero.train_step(_sum_loss, on_nonfinite=on_nonfinite)(state, torch.full((64,), 1e-3))
            return state, new, m
        return mesh.run(rank_fn)

    with pytest.raises(fzero.NonFiniteError, match=r"update made the params NaN or inf in 'w'"):
        run("raise")
    for old, new, m in run("skip"):
        assert new is old and m.skipped and int(new.step) == 0


@pytest.mark.parametrize("stage, donate, offload", [  # offload shards (stage >= 1); NVMe writes in place (donate)
    (s, d, o) for s in range(4) for d in (False, True) for o in (None, "cpu", "nvme")
    if (o is None or s > 0) and (o != "nvme" or d)])
def test_an_update_past_the_compute_dtypes_range_is_caught(stage, donate, offload, tmp_path):
    """fp16 units over an fp32 master: an SGD update takes the master of 'w' to 65000 + 1e5 *
    (1e4 * 1e-4 * ...) past 65504, finite in fp32 and inf in the fp16 copy the next forward
    reads. The update's finite check read the fp32 master only, so the step was kept: stages 1-2
    held inf fp16 params, the next step failed blaming the loss, and under a loss scaler every
    later step was skipped as an overflow (found in review). It is now a broken update, naming
    the leaf and the range: at once without `donate`, at the next read with it. 'b' (fp16
    copy 0.5) stays in range and is not named."""
    mesh, policy = fzero.SimMesh(2), fzero.Precision(torch.float16, torch.float32)
    off = {None: None, "cpu": fzero.Offload(optimizer="cpu"),
           "nvme": fzero.Offload(optimizer="nvme", nvme_path=str(tmp_path))}[offload]
    loss = lambda p, x: (p["w"] * x.half()).float().sum() + p["b"].float().sum()  # noqa: E731

    def rank_fn():
        state = fzero.init({"w": torch.tensor([65000.0, 1.0]), "b": torch.full((2,), 0.5)}, optim.sgd(1e3),
                           stage=stage, mesh=mesh, precision=policy, offload=off, units=lambda path: path)
        step = fzero.train_step(loss, donate=donate)
        new, _ = step(state, torch.tensor([-1.0, 0.0]))
        step(new, torch.zeros(2))

    with pytest.raises(fzero.NonFiniteError, match=r"made the params NaN or inf \(or past float16's range, the "
                                                   r"dtype the units compute in\).* in 'w' \(SimMesh"):
        mesh.run(rank_fn)


@pytest.mark.parametrize("stage", [1, 2])
def test_an_update_past_the_compute_range_skipped_leaves_the_loss_scalers_state(stage):
    """Row 67's skip: `on_nonfinite="skip"` over such an update gives back the state it was given,
    `Metrics.skipped`, and a dynamic loss scaler's state as it was -- its update count (`iteration`)
    and hysteresis unchanged, unlike an overflow's skip (found in review: the row said so, no test
    checked it)."""
    mesh, policy = fzero.SimMesh(2), fzero.Precision(torch.float16, torch.float32)
    loss = lambda p, x: (p["w"] * x.half()).float().sum() + p["b"].float().sum()  # noqa: E731

    def rank_fn():
        state = fzero.init({"w": torch.tensor([65000.0, 1.0]), "b": torch.full((2,), 0.5)}, optim.sgd(1e3),
                           stage=stage, mesh=mesh, precision=policy, units=lambda path: path,
                           loss_scale=fzero.DynamicLossScale(init_scale=2.0))
        new, m = fzero.train_step(loss, on_nonfinite="skip")(state, torch.tensor([-1.0, 0.0]))
        return state, new, m

    for state, new, m in mesh.run(rank_fn):
        assert m.skipped and new is state and int(new.step) == 0
        assert int(new.loss_scale.iteration) == 0 and float(new.loss_scale.scale) == 2.0
        assert int(new.loss_scale.hysteresis) == int(state.loss_scale.hysteresis) == 2


@pytest.mark.parametrize("stage, donate", [(0, False), (1, True), (3, False)])
def test_an_adam_second_moment_overflow_is_kept_as_torch_keeps_it(stage, donate):
    """The update's finite check reads the updated params (or master), not the optimizer state, as
    torch and DeepSpeed read none: a finite gradient of 3e21 squares past float32's range, Adam's
    `exp_avg_sq` turns inf, `m / (sqrt(inf) + eps)` is 0, and that element never moves again --
    in torch.optim.Adam as here, bit for bit, and no step is skipped or raised (a review took the
    docs to say the state is checked; they now say what is read). `clip_norm` bounds such a
    gradient."""
    mesh, w0 = fzero.SimMesh(2), torch.tensor([1.0, 2.0])
    xs = [torch.tensor([3e21, 1.0]), torch.tensor([1.0, 1.0]), torch.tensor([-2.0, 0.5])]
    ref = w0.clone().requires_grad_(True)
    opt = torch.optim.Adam([ref], lr=1e-2, foreach=True)
    for x in xs:
        opt.zero_grad()
        (ref * x).sum().backward()
        opt.step()

    def rank_fn():
        state = fzero.init({"w": w0.clone()}, optim.adam(1e-2), stage=stage, mesh=mesh)
        step = fzero.train_step(_sum_loss, on_nonfinite="raise", donate=donate)
        for x in xs:
            state, m = step(state, x)
            assert not m.skipped
        return fzero.gather(state)["w"]

    for w in mesh.run(rank_fn):
        assert torch.equal(w, ref.detach())
        assert w[0] == 1.0 and w[1] != 2.0  # the first element frozen at its initial value, the second trained
    assert not torch.isfinite(opt.state[ref]["exp_avg_sq"][0])


@pytest.mark.parametrize("g, overflows", [(5.7e20, False), (5.9e20, True)])
def test_the_second_moments_overflow_starts_where_the_docs_say(g, overflows):
    """README and proofs/precision.md: the first step's `exp_avg_sq`, `(1 - beta2) g^2`, passes
    float32's largest value at |g| about 5.8e20 (beta2 = 0.999), not at sqrt(3.4e38) = 1.8e19 as
    they said (found in review of the docs): torch's Adam below it keeps a finite moment and moves
    the element, above it freezes it; fzero's step gives torch's bits either side."""
    w0 = torch.tensor([1.0, 2.0])
    ref = w0.clone().requires_grad_(True)
    opt = torch.optim.Adam([ref], lr=1e-2, foreach=False)
    for x in (torch.tensor([g, 1.0]), torch.tensor([1.0, 1.0])):
        opt.zero_grad()
        (ref * x).sum().backward()
        opt.step()
    assert bool(torch.isfinite(opt.state[ref]["exp_avg_sq"][0])) is not overflows
    assert (ref[0].item() == 1.0) is overflows
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init({"w": w0.clone()}, optim.adam(1e-2, impl="single"), stage=1, mesh=mesh)
        step = fzero.train_step(_sum_loss)
        for x in (torch.tensor([g, 1.0]), torch.tensor([1.0, 1.0])):
            state, _ = step(state, x)
        return fzero.gather(state)["w"]

    assert torch.equal(mesh.run(rank_fn)[0], ref.detach())


@pytest.mark.parametrize("stage, donate", [(1, False), (1, True), (3, False), (3, True)])
def test_an_update_past_bf16s_range_is_caught(stage, donate):
    """bf16's largest value (3.3895e38) is below fp32's (3.4028e38): an fp32 master of 3.40e38 is
    finite and rounds to inf in the bf16 copy, so it is a broken update as in fp16."""
    mesh = fzero.SimMesh(2)
    loss = lambda p, x: (p["w"] * x.to(p["w"].dtype)).float().sum()  # noqa: E731

    def rank_fn():
        state = fzero.init({"w": torch.tensor([3.38e38, 1.0])}, optim.sgd(2e36), stage=stage, mesh=mesh,
                           precision=fzero.Precision(torch.bfloat16, torch.float32))
        step = fzero.train_step(loss, donate=donate)
        new, _ = step(state, torch.tensor([-1.0, 0.0]))  # donate=False raises here, True at the next read
        step(new, torch.zeros(2))

    with pytest.raises(fzero.NonFiniteError, match=r"NaN or inf \(or past bfloat16's range"):
        mesh.run(rank_fn)


def test_reduced_gradient_overflow_is_caught():
    """Mutation gap: fp16 local gradients that are finite on every rank but overflow when summed
    (3 x fl(65504 * fl(1/3)) = 65520 rounds to inf) wrote inf params with skipped=False."""
    mesh = fzero.SimMesh(3)
    params = {"w": torch.zeros(4, dtype=torch.float16)}

    def run(on_nonfinite):
        def rank_fn():
            state = fzero.init(params, optim.sgd(1e-9), stage=2, mesh=mesh)
            step = fzero.train_step(_sum_loss, on_nonfinite=on_nonfinite, locate_nonfinite=True)
            new, m = step(state, torch.full((4,), 65504.0))
            return state, new, m
        return mesh.run(rank_fn)

    with pytest.raises(fzero.NonFiniteError, match="local gradient are finite but .* the sum over ranks overflowed"):
        run("raise")
    for old, new, m in run("skip"):
        assert new is old and m.skipped


def test_large_finite_fp16_gradients_are_not_called_nonfinite():
    """Mutation gap: the local non-finite check summing in the gradient's dtype overflows for
    large finite fp16 gradients (4 x 60000 > 65504) and raised a spurious NonFiniteError."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init({"w": torch.zeros(4, dtype=torch.float16)}, optim.sgd(1e-6), stage=1, mesh=mesh)
        state, m = fzero.train_step(_sum_loss)(state, torch.full((4,), 60000.0))
        return fzero.gather(state)["w"], m

    want = torch.zeros(4, dtype=torch.float16).add_(torch.full((4,), 60000.0, dtype=torch.float16), alpha=-1e-6)
    for w, m in mesh.run(rank_fn):  # the reduced gradient is 0.5 * 60000 + 0.5 * 60000, exact
        assert not m.skipped and torch.equal(w, want)


def test_grad_norm_equals_an_independent_value():
    """Mutation gap: grad_norm was compared only between stages. Integer-valued gradients make
    every sum exact: rank r's shard of the serially reduced gradient (5 elements padded to 6: ranks
    hold [0, 3) and [3, 5)) has the exact integer `s_r = Σ x²`, its norm is the correctly rounded
    float32 square root of it, and grad_norm is `sqrt(Σ_r ν_r²)` in float64 (proofs/stages.md §3)."""
    mesh = fzero.SimMesh(2)
    xs = [torch.tensor([2.0, -4.0, 6.0, 0.0, 8.0]), torch.tensor([4.0, 2.0, -2.0, 10.0, 0.0])]
    reduced = xs[0] * 0.5 + xs[1] * 0.5
    nus = [reduced[:3].square().sum().sqrt(), reduced[3:].square().sum().sqrt()]  # float32, exact sums
    want = sum(nu.double().square() for nu in nus).sqrt()
    for stage in range(4):
        def rank_fn(x):
            state = fzero.init({"w": torch.zeros(5)}, optim.sgd(0.1), stage=stage, mesh=mesh)
            return fzero.train_step(_sum_loss)(state, x)[1].grad_norm

        assert all(torch.equal(g, want) for g in mesh.run(rank_fn, [(x,) for x in xs]))


def test_lamb_moves_zero_initialised_leaves():
    """Mutation gap: a trust ratio of 0 where ‖p‖ = 0 (it must be 1, as in LAMB's reference) would
    never train a zero-initialised bias; the tests drew only non-zero params. With ‖p‖ = 0 the
    update is the Adam direction times lr. The reduced gradient of `b` is 1 (fl(1·½) + fl(1·½)),
    and the first step is computed here with LAMB's own ops on it (fzero/_src/optim/lamb.py:
    `lerp_`, `mul_`/`addcmul_`, `sqrt`, `div_`, `add_`, then `p.add_(r, alpha=-(lr·ratio))` with
    ratio 1): m = 0.1, v = 0.001, r = (m / 0.1) / (√v / √0.001 + 1e-6) ≈ 1 / (1 + 1e-6), so
    b = -0.1·r ≈ -0.1 + 1e-7 in every element, bit for bit (a ratio of 0 leaves b = 0)."""
    mesh = fzero.SimMesh(2)
    lr, beta1, beta2, eps = 0.1, 0.9, 0.999, 1e-6  # optim.lamb's defaults but lr

    def rank_fn():
        state = fzero.init({"b": torch.zeros(6), "w": torch.ones(6)}, optim.lamb(lr), stage=2, mesh=mesh)
        state, _ = fzero.train_step(lambda p, x: (p["b"] * x).sum() + (p["w"] * x).sum())(state, torch.ones(6))
        return fzero.gather(state)["b"]

    g = torch.ones(6)
    m = torch.zeros(6).lerp_(g, 1 - beta1)
    v = torch.zeros(6).mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = v.sqrt().div_((1 - beta2**1) ** 0.5).add_(eps)
    r = torch.div(m, 1 - beta1**1).div_(denom)
    want = torch.zeros(6).add_(r, alpha=-(lr * 1.0))
    assert bool((want < 0).all())  # it moved
    for b in mesh.run(rank_fn):
        assert torch.equal(b, want)


def test_a_misspelled_state_spec_is_an_error():
    """A custom optimizer whose spec says "shards" (not "shard") was read as "shard"; memory
    accounting, checkpoints and resharding read the spec, so init checks it is one of the two words."""
    base = optim.sgd(0.1, momentum=0.9)
    bad = optim.Optimizer(base.init, base.update, lambda s: type(s)(*["shards"] * len(s)), base.update_)
    mesh = fzero.SimMesh(1)

    def rank_fn():
        fzero.init({"w": torch.ones(3)}, bad, stage=1, mesh=mesh)  # refused at init, before any step

    with pytest.raises(optim.OptimizerError, match=r"spec of state field 'count' is 'shards'"):
        mesh.run(rank_fn)


def test_replace_refuses_a_field_of_another_structure():
    """Found in review: a torch.optim `state_dict()` as `opt_state` was taken, and the next step
    raised a bare `KeyError: 0`."""
    mesh = fzero.SimMesh(1)
    params = {"w": torch.ones(4, 3), "b": torch.zeros(3)}

    def run():
        state = fzero.init(params, optim.adamw(1e-3), stage=1, mesh=mesh)
        w = torch.ones(4, 3, requires_grad=True)
        torch_opt = torch.optim.AdamW([w])
        w.sum().backward()
        torch_opt.step()
        words = []
        for field, value in (("opt_state", torch_opt.state_dict()), ("opt_state", state.opt_state * 2),
                             ("opt_state", fzero.init(params, optim.sgd(0.1, momentum=0.9), stage=1,
                                                      mesh=mesh).opt_state),
                             ("params", state.params[0]), ("master", (torch.zeros(3),))):
            with pytest.raises(fzero.FzeroError) as e:
                state.replace(**{field: value})
            words.append(str(e.value))
        kept = state.replace(params=list(state.params), opt_state=state.opt_state, master=state.master)
        return words, kept

    (words, kept), = mesh.run(run)
    what = "is one entry per bucket (1: a tuple, as fzero.init made it)"
    assert words[0] == (f"state.replace(opt_state=...): opt_state {what}, got dict: a torch.optim state_dict() is "
                        f"not fzero's optimizer state; resume with fzero.checkpoint.load"), words[0]
    assert words[1] == f"state.replace(opt_state=...): opt_state {what}, got tuple of 2", words[1]
    bucket = "; bucket 'default/float32/default' of 2 leaves: 'b' (float32[3]), 'w' (float32[4, 3]): expected "
    assert words[2] == (f"state.replace(opt_state=...): opt_state {what}{bucket}PyTreeSpec(AdamState(step=*, "
                        f"exp_avg=*, exp_avg_sq=*)), got PyTreeSpec(SgdMomentumState(count=*, momentum_buffer=*))"), words[2]
    assert words[3] == f"state.replace(params=...): params {what}, got Tensor", words[3]
    assert words[4] == f"state.replace(master=...): master {what}{bucket}PyTreeSpec(None), got PyTreeSpec(*)", words[4]
    assert len(kept.params) == 1
