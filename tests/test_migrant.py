"""What a port from DeepSpeed met (a migrant's review), each fixed and checked here.

- F1: params given in 16 bits (`model.bfloat16()`) under a `Precision` whose `param_dtype` is
  that dtype keep no fp32 master: `init` warns once (`fzero.NoFp32Master`), naming the leaves
  and the way out; never where `param_dtype` is None (docs/bad-input.md row 94) or the params
  are fp32;
- F2: `reduce_dtype=None` reduces in `param_dtype` where that is set (FSDP2's rule), as the
  `Precision` docstring now says;
- F3: `evaluate` leaves the mode alone: `apply.eval()` turns dropout off, `model.eval()` does
  not reach `apply` (its docstring says so);
- F4: `ModuleInfo.state_dict(fzero.gather(state))` loads strictly into the original module, tied
  weights and trained BatchNorm statistics included (DeepSpeed's `engine.module`);
- F5: fp16 params with no wider master whose update is NaN / inf: the error names that and the
  way out (fp32 params, `Precision(torch.float16, torch.float32)`, `DynamicLossScale()`), not
  "lower the learning rate";
- F6: `cosine`'s `decay_steps` counts the steps after the warmup, and the GPT-2 example's
  schedule now ends at its last step;
- F7: a DDP / DataParallel / FSDP-wrapped module is refused by `from_module`;
- F8: a torch LR scheduler or optimizer as `lr`, a scheduler's `get_last_lr` as `lr`, a schedule
  returning a list, and recorded `get_last_lr()` lists: `OptimizerError`s naming fzero's way;
- F9: `init(model.parameters(), ...)` names `dict(model.named_parameters())` and `from_module`.
"""

from __future__ import annotations

import copy
import importlib.util
import pathlib
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero import optim

BF16_FP32 = fzero.Precision(torch.bfloat16, torch.float32)


def _init(params, precision, mesh=None, **kw):
    mesh = mesh or fzero.SimMesh(1)
    return mesh.run(lambda: fzero.init(params, optim.adamw(1e-4), stage=3, mesh=mesh, precision=precision, **kw))[0]


# --- F1 -----------------------------------------------------------------------------------------

def test_16bit_params_under_their_own_param_dtype_warn_once_per_init_naming_the_leaves():
    """bf16 params under `Precision(bf16, fp32)`: one `NoFp32Master` per `init` (not per step),
    at the caller's line, naming the first leaves and their count, why (already the policy's
    param_dtype: no fp32 master) and the ways on; a frozen leaf is not named. The premise: the
    master is bf16 indeed, and an update below half a bf16 ulp leaves the weight as it was."""
    params = {f"l{i}": torch.full((4,), 1.0, dtype=torch.bfloat16) for i in range(6)}
    params["mask"] = torch.ones(3, dtype=torch.bfloat16)
    frozen = [fzero.ParamGroup("frozen", match=lambda p: p == "mask", frozen=True)]
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(params, optim.sgd(1e-4), stage=3, mesh=mesh, precision=BF16_FP32, groups=frozen)
        step = fzero.train_step(lambda p, b: sum(v.float().sum() for v in p.values()))
        for _ in range(2):
            state, _ = step(state, None)
        return state, fzero.gather(state)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state, full = mesh.run(rank_fn)[0]
    ours = [w for w in caught if issubclass(w.category, fzero.NoFp32Master)]
    assert len(ours) == 1 and len(caught) == 1, [str(w.message) for w in caught]
    assert ours[0].filename == __file__  # the user's call of init, not fzero's code
    text = str(ours[0].message)
    assert text.startswith("fzero.init: 6 trainable params leaves ('l0' (bfloat16[4]), 'l1' (bfloat16[4]), 'l2' "
                           "(bfloat16[4]), 'l3' (bfloat16[4]) and 2 more) are bfloat16, already the policy's "
                           "param_dtype, so the policy casts nothing: no fp32 master is kept"), text
    assert "'mask'" not in text
    for words in ("model.float() before fzero.from_module", "keeps the fp32 master",
                  "drop param_dtype: fzero.Precision(reduce_dtype=torch.float32)", "fzero.NoFp32Master"):
        assert words in text, words
    assert all(m is None for m in state.master) and state.params[0].dtype == torch.bfloat16  # no master indeed
    assert all(torch.equal(full[k], params[k]) for k in params)  # 1 - 2e-4 rounds to 1 in bf16: nothing moved


def test_fp16_params_under_an_fp16_policy_warn_with_the_loss_scale_recipe():
    with pytest.warns(fzero.NoFp32Master, match=r"1 trainable params leaf \('w' \(float16\[2, 3\]\)\) is float16") as w:
        _init({"w": torch.ones(2, 3, dtype=torch.float16)}, fzero.Precision(torch.float16, torch.float32))
    assert "fzero.Precision(torch.float16, torch.float32) and loss_scale=fzero.DynamicLossScale()" in str(w[0].message)


def test_16bit_params_under_another_16bit_param_dtype_warn_too():
    """fp16 params under a bf16 policy: cast, but the master is fp16 all the same."""
    with pytest.warns(fzero.NoFp32Master, match="is float16, 16-bit already, cast to the policy's bf16: no fp32 master"):
        _init({"w": torch.ones(4, dtype=torch.float16)}, fzero.Precision(torch.bfloat16))


@pytest.mark.parametrize("params, precision", [
    ({"w": torch.ones(4, dtype=torch.bfloat16)}, fzero.Precision(reduce_dtype=torch.float32)),  # row 94
    ({"w": torch.ones(4, dtype=torch.bfloat16)}, fzero.Precision()),  # 16 bits on purpose
    ({"w": torch.ones(4)}, BF16_FP32),  # fp32 params: the fp32 master is kept
    ({"w": torch.ones(4, dtype=torch.bfloat16)}, fzero.Precision(torch.float32)),  # a wider compute dtype
], ids=["reduce-only", "no-policy", "fp32-params", "fp32-compute"])
def test_no_warning_where_an_fp32_master_is_kept_or_no_param_dtype_is_set(params, precision):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _init(params, precision)


def test_the_warning_reads_only_trainable_leaves():
    """A 16-bit leaf that is frozen keeps no master and needs none."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _init({"w": torch.ones(4), "m": torch.ones(4, dtype=torch.bfloat16)}, BF16_FP32,
              groups=[fzero.ParamGroup("frozen", match=lambda p: p == "m", frozen=True)])


# --- F2 -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("precision, reduced", [
    (fzero.Precision(torch.bfloat16), torch.bfloat16),  # reduce_dtype None: param_dtype
    (fzero.Precision(torch.bfloat16, torch.float32), torch.float32),  # given
    (fzero.Precision(), torch.float32),  # neither: the bucket's own dtype
    (fzero.Precision(reduce_dtype=torch.float64), torch.float64),
])
def test_reduce_dtype_none_means_param_dtype_where_set_as_documented(precision, reduced):
    mesh = fzero.SimMesh(2)

    def rank_fn():
        state = fzero.init({"w": torch.ones(8, 8)}, optim.sgd(0.1), stage=2, mesh=mesh, precision=precision)
        return fzero.train_step(lambda p, x: (x.to(p["w"].dtype) @ p["w"]).float().square().mean())(state,
                                                                                                 torch.ones(4, 8))

    with mesh.record() as log:
        mesh.run(rank_fn)
    assert {r.dtype for r in log if r.op == "reduce_scatter"} == {reduced}
    doc = " ".join(fzero.Precision.__doc__.split())
    assert "None: `param_dtype` where that is set, else each bucket's own dtype" in doc
    assert "`Precision(torch.bfloat16)` reduces in bf16" in doc


# --- F3 -----------------------------------------------------------------------------------------

def test_evaluate_keeps_the_mode_apply_eval_turns_dropout_off_model_eval_does_not():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5), nn.BatchNorm1d(16), nn.Linear(16, 4))
    params, apply, info = fzero.from_module(model)
    mesh, x = fzero.SimMesh(2), torch.randn(6, 8)

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh)
        ev = fzero.evaluate(lambda p, b: apply(p, b))
        return ev(state, x), ev(state, x)

    def run():
        before = {k: v.clone() for k, v in info.buffers.items()}
        a, b = mesh.run(rank_fn)[0]
        return torch.equal(a, b), all(torch.equal(v, info.buffers[k]) for k, v in before.items())

    assert run() == (False, False)  # training mode: dropout on, BatchNorm's statistics updated
    model.eval()
    assert run() == (False, False)  # the original module's mode does not reach apply
    apply.eval()
    assert run() == (True, True)
    apply.train()
    doc = " ".join(fzero.evaluate.__doc__.split())
    assert "`evaluate` does not change the model's mode" in doc
    assert "`model.eval()` on the original module does not reach it" in doc


# --- F4 -----------------------------------------------------------------------------------------

class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.emb.weight  # tied
        self.register_buffer("scale", torch.full((8,), 0.5), persistent=False)  # not in the state_dict

    def forward(self, tokens):
        return self.head(self.bn(self.emb(tokens)) * self.scale)


def test_module_info_state_dict_loads_the_trained_module_strictly():
    torch.manual_seed(0)
    model = _Tied()
    params, apply, info = fzero.from_module(model)
    mesh = fzero.SimMesh(2)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 10, (6,), generator=g) for _ in range(3)]

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.5), stage=3, mesh=mesh)
        step = fzero.train_step(lambda p, t: nn.functional.cross_entropy(apply(p, t), t))
        for t in batches:
            state, _ = step(state, t)
        return fzero.gather(state)

    full = mesh.run(rank_fn)[0]
    with pytest.raises(RuntimeError, match="Missing key"):  # the premise: gather's dict alone does not load
        copy.deepcopy(model).load_state_dict(full)
    sd = info.state_dict(full)
    assert set(sd) == set(model.state_dict()) and "scale" not in sd
    assert sd["head.weight"] is full["emb.weight"] and sd["bn.running_mean"] is info.buffers["bn.running_mean"]
    loaded = copy.deepcopy(model)
    assert not torch.equal(loaded.bn.running_mean, info.buffers["bn.running_mean"])  # trained away from zeros
    assert not loaded.load_state_dict(sd).missing_keys  # strict
    assert loaded.head.weight is loaded.emb.weight and torch.equal(loaded.emb.weight, full["emb.weight"])
    assert all(torch.equal(b, info.buffers[k]) for k, b in loaded.named_buffers())
    x = torch.randint(0, 10, (5,))
    loaded.eval()
    with torch.no_grad():
        want = loaded(x)
    got = apply.eval()(full, x)
    apply.train()
    assert torch.equal(got, want)


def test_module_info_state_dict_names_missing_and_unexpected_keys():
    params, _, info = fzero.from_module(_Tied())
    with pytest.raises(fzero.ConfigError, match=r"missing \['bn.bias', 'bn.weight', 'emb.weight'\], unexpected "
                                                r"\['model'\] .*fzero.gather\(state\)\['model'\]"):
        info.state_dict({"model": params})
    with pytest.raises(fzero.ConfigError, match="got a list"):
        info.state_dict([params])


# --- F5 -----------------------------------------------------------------------------------------

def _half_run(params, precision=fzero.Precision(), loss_scale=None, donate=False, steps=1):
    mesh = fzero.SimMesh(2)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))

    def rank_fn():
        state = fzero.init(params, optim.adamw(1e-3), stage=0, mesh=mesh, precision=precision, loss_scale=loss_scale)
        step = fzero.train_step(lambda p, b: (b.to(p["w"].dtype) @ p["w"] + 0 * p["b"]).float().square().mean(),
                                donate=donate)
        for _ in range(steps):
            state, _ = step(state, x)
        return int(fzero.gather(state)["w"].isfinite().all()), int(state.step)

    return mesh.run(rank_fn)[0]


def test_fp16_params_with_no_master_name_the_missing_master_not_the_lr():
    """AdamW over fp16 params (`model.half()`): eps=1e-8 is 0 in fp16, so 'b', whose gradient
    is 0, updates by 0/0. The error says so and gives the recipe, which then trains."""
    g = torch.Generator().manual_seed(0)
    half = {"w": torch.randn(4, 4, generator=g).half(), "b": torch.zeros(4, dtype=torch.float16)}
    with pytest.raises(fzero.NonFiniteError) as e:
        _half_run(half)
    text = str(e.value)
    assert "optimizer's update made the params NaN or inf in 'b'" in text and "Lower the learning rate" not in text
    assert ("The params leaf 'b' is float16 as given to fzero.init, so the state keeps no wider master" in text
            and "Adam's eps=1e-8 is 0" in text and "on_nonfinite='skip' would skip every such step" in text)
    assert ("Keep fp32 params (model.float() before fzero.from_module, or {k: v.float() for k, v in params.items()}) "
            "and compute in 16 bits under precision=fzero.Precision(torch.float16, torch.float32) and "
            "loss_scale=fzero.DynamicLossScale()") in text
    fp32 = {k: v.float() for k, v in half.items()}  # the way out it names
    assert _half_run(fp32, fzero.Precision(torch.float16, torch.float32), fzero.DynamicLossScale(), steps=2) == (1, 2)


def test_fp32_params_keep_the_lr_advice():
    """An update that overflows fp32 params is the lr's doing: the advice is as before."""
    with pytest.raises(fzero.NonFiniteError, match="Lower the learning rate, keep params in a wider dtype"):
        mesh = fzero.SimMesh(1)
        mesh.run(lambda: fzero.train_step(lambda p, b: p["w"].sum())(
            fzero.init({"w": torch.full((1,), -3e38)}, optim.sgd(1e38), stage=0, mesh=mesh), None))


def test_bf16_params_keep_the_lr_advice_and_are_told_of_the_missing_master():
    """bf16 keeps fp32's exponent range and Adam's eps: an update that overflows bf16 params (sgd at
    lr 1e38) is the lr's doing, as in fp32, so the lr advice stays, followed by the missing fp32
    master (found in review: the fp16 words, "a lower learning rate does not help", replaced it)."""
    mesh = fzero.SimMesh(1)
    with pytest.raises(fzero.NonFiniteError) as e:
        mesh.run(lambda: fzero.train_step(lambda p, x: (p["w"].float() * x).sum())(
            fzero.init({"w": torch.ones(4, dtype=torch.bfloat16)}, optim.sgd(1e38), stage=0, mesh=mesh),
            torch.full((4,), 100.0)))
    text = str(e.value)
    assert "Lower the learning rate, keep params in a wider dtype, or use on_nonfinite='skip'. The params leaf 'w' is " \
           "bfloat16 as given to fzero.init, so the state keeps no wider master" in text
    assert "fzero.Precision(torch.bfloat16, torch.float32)" in text and "does not help" not in text


def test_a_donating_step_over_fp16_params_names_the_missing_master_too():
    g = torch.Generator().manual_seed(0)
    half = {"w": torch.randn(4, 4, generator=g).half(), "b": torch.zeros(4, dtype=torch.float16)}
    with pytest.raises(fzero.NonFiniteError, match=r"donating step .* restore it from a checkpoint .*The params "
                                                   r"leaf 'b' is float16 as given to fzero.init.*DynamicLossScale"):
        _half_run(half, donate=True)


# --- F6 -----------------------------------------------------------------------------------------

def test_cosine_decay_steps_count_after_the_warmup_and_the_docstring_says_so():
    total, warm = 20, 2
    s = optim.cosine(1.0, total - warm, warmup_steps=warm)
    assert s(total) == 0.0 and s(total - 1) > 0.0 and s(warm) == 1.0
    assert optim.cosine(1.0, total, warmup_steps=warm)(total) > 0.0  # total as decay_steps: not yet at `final`
    doc = " ".join(optim.cosine.__doc__.split())
    assert "`decay_steps` counts the steps *after* the warmup" in doc
    assert "`cosine(peak, total - warmup_steps, warmup_steps=warmup_steps)`" in doc


class _Built(Exception):
    pass


def test_the_gpt2_example_schedule_ends_at_its_last_step(monkeypatch):
    """The example's optimizer, captured as it is made (nothing trains): its cosine reaches 0 at
    step `--steps`, after the last update, and not before. Before, `decay_steps` was the total,
    so the lr was still far from 0 at the end."""
    path = pathlib.Path(__file__).parent.parent / "examples" / "gpt2_stage3.py"
    spec = importlib.util.spec_from_file_location("_gpt2_stage3_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    made = []

    def adamw(lr, **kw):
        made.append(lr)
        raise _Built

    monkeypatch.setattr(fzero.optim, "adamw", adamw)
    monkeypatch.setattr(sys, "argv", ["gpt2_stage3.py", "--layers", "1", "--embd", "8", "--heads", "1", "--vocab",
                                      "16", "--seq", "4", "--steps", "20", "--lr", "1.0"])
    with pytest.raises(_Built):
        example.main()
    (lr,) = made
    assert lr(0) == 0.0 and lr(2) == 1.0  # warmup of 2 steps
    assert lr(19) > 0.0 and lr(20) == 0.0


# --- F7 -----------------------------------------------------------------------------------------

def test_from_module_refuses_a_data_parallel_wrapper():
    inner = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(fzero.ConfigError, match=r"from_module: the module is a torch.nn.DataParallel wrapper "
                                                r"\(DataParallel\): fzero would take its parameter names "
                                                r"\('module.\*'\).*fzero.from_module\(dp.module\)"):
        fzero.from_module(nn.DataParallel(inner))
    with pytest.raises(fzero.ConfigError, match=r"submodule 'body' of the module is a torch.nn.DataParallel wrapper"
                                                r".*model.get_submodule\('body'\).module"):
        fzero.from_module(nn.ModuleDict({"body": nn.DataParallel(inner)}))
    params, _, _ = fzero.from_module(inner)  # the way out
    assert sorted(params) == ["0.bias", "0.weight", "2.bias", "2.weight"]


def ddp_wrapped(mesh):
    """On a torchrun worker (a gloo group of 2): `from_module` of a DDP-wrapped model, of its
    `.module`, and of a `fully_shard`ed one."""
    from torch.distributed.fsdp import fully_shard

    out = {}
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for name, wrapped in (("ddp", lambda: nn.parallel.DistributedDataParallel(model)),
                          ("fsdp2", lambda: fully_shard(copy.deepcopy(model)))):
        try:
            fzero.from_module(wrapped())
            out[name] = "accepted"
        except fzero.ConfigError as e:
            out[name] = str(e)
    out["inner"] = sorted(fzero.from_module(nn.parallel.DistributedDataParallel(model).module)[0])
    return out


def test_from_module_refuses_ddp_and_fully_shard_over_gloo(dist2):
    for got in dist2.run(ddp_wrapped):
        assert got["ddp"].startswith("from_module: the module is a torch.nn.parallel.DistributedDataParallel "
                                     "wrapper (DistributedDataParallel): fzero would take its parameter names "
                                     "('module.*') and leave its gradient buckets, hooks and reducer alive"), got
        assert "fzero.from_module(ddp.module)" in got["ddp"]
        assert got["fsdp2"].startswith("from_module: the module is a torch.distributed.fsdp.fully_shard wrapper "
                                       "(FSDPSequential): fzero would take fully_shard's DTensor shards"), got
        assert got["inner"] == ["0.bias", "0.weight", "1.bias", "1.weight"]


# --- F8 -----------------------------------------------------------------------------------------

def _torch_scheduler():
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=1.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3))


def test_a_torch_scheduler_or_optimizer_as_lr_names_fzeros_schedules():
    opt, sched = _torch_scheduler()
    ways = ("fzero.optim.cosine(peak, decay_steps, warmup_steps=...)", "fzero.optim.linear_warmup(peak, warmup_steps)",
            "fzero.optim.step_decay(init, step_size, gamma)", "lambda t:",
            "record sched.get_last_lr()[0] before each optimizer.step() and pass fzero.optim.sequence(recorded)")
    with pytest.raises(optim.OptimizerError, match=r"^lr is a torch LR scheduler "
                                                   r"\(torch.optim.lr_scheduler.LambdaLR\)") as e:
        optim.adamw(sched)
    assert all(w in str(e.value) for w in ways), str(e.value)
    with pytest.raises(optim.OptimizerError, match=r"^lr is a torch optimizer \(torch.optim.adamw.AdamW\)") as e:
        optim.sgd(opt)
    assert all(w in str(e.value) for w in ways)


def test_a_replayed_scheduler_is_told_what_a_replay_leaves_out():
    """The refusal says a replay carries the first group's lr, that lr_scale scales the whole
    schedule, floors included; for OneCycleLR with its momentum cycle, that fzero keeps the
    momentum fixed; for ReduceLROnPlateau, the recipe a metric-driven lr needs (found in review of
    a user porting torch schedulers: lr_scale under an eta_min, and OneCycleLR's beta1, trained
    otherwise than torch, silently)."""
    opt, _ = _torch_scheduler()
    sched = torch.optim.lr_scheduler
    with pytest.raises(optim.OptimizerError, match=r"scales that whole schedule, floors included") as e:
        optim.adamw(sched.CosineAnnealingLR(opt, T_max=10, eta_min=1e-4))
    assert "cycle_momentum" not in str(e.value) and "ReduceLROnPlateau" not in str(e.value)
    with pytest.raises(optim.OptimizerError, match=r"OneCycleLR with cycle_momentum=True also cycles the optimizer's "
                                                   r"momentum.*make it with cycle_momentum=False"):
        optim.adamw(sched.OneCycleLR(opt, max_lr=1.0, total_steps=10))
    with pytest.raises(optim.OptimizerError) as e:
        optim.adamw(sched.OneCycleLR(opt, max_lr=1.0, total_steps=10, cycle_momentum=False))
    assert "cycle_momentum=True" not in str(e.value)
    with pytest.raises(optim.OptimizerError, match=r"ReduceLROnPlateau's lr follows a metric.*sched\.step\(float\("
                                                   r"metrics\.loss\)\).*lr=lambda t: dummy_optimizer\.param_groups"):
        optim.adamw(sched.ReduceLROnPlateau(opt))


def test_the_plateau_recipe_steps_with_the_lrs_the_scheduler_set():
    """ReduceLROnPlateau by the refusal's recipe: a dummy optimizer's lr, lowered by the scheduler
    from each step's loss, is the lr the next step takes (the same bits as `sequence` of those lrs)."""
    mesh = fzero.SimMesh(2)
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(6, 3, generator=g)
    batches = [(torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)) for _ in range(12)]

    def loss(p, b):
        return F.mse_loss(b[0] @ p["w"], b[1])

    def train(lr, after=None):
        state, step, used = fzero.init({"w": w0.clone()}, optim.adamw(lr), stage=1, mesh=mesh), fzero.train_step(
            loss), []
        for b in batches:
            used.append(state.optimizer.lr(int(state.step)))
            state, metrics = step(state, b)
            if after is not None:
                after(float(metrics.loss))
        return used, fzero.gather(state)["w"]

    def rank():
        dummy = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
        plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(dummy, factor=0.5, patience=0, threshold=0.5)
        used, w = train(lambda t: dummy.param_groups[0]["lr"], after=plateau.step)
        again, w_again = train(optim.sequence(used))
        return len(set(used)) > 1, again == used, torch.equal(w, w_again)

    assert mesh.run(rank) == [(True, True, True)] * 2


def test_a_schedulers_get_last_lr_as_lr_is_refused_when_made():
    """Before: accepted, then Python's TypeError at the first step."""
    _, sched = _torch_scheduler()
    with pytest.raises(optim.OptimizerError, match=r"^lr LambdaLR.get_last_lr \(a bound method\) is called as "
                                                   r"lr\(step\).*takes no step.*fzero.optim.sequence"):
        optim.adamw(sched.get_last_lr)
    with pytest.raises(optim.OptimizerError, match=r"^lr .*<lambda> \(.*test_migrant.py:\d+\) is called as lr\(step\)"):
        optim.adamw(lambda: 0.1)


def test_a_callable_schedule_with_step_and_get_last_lr_is_a_schedule():
    """A user's schedule class that also logs through `step()` / `get_last_lr()` is called as
    `lr(step)`, not refused as a torch scheduler (found in review); a decorated function whose
    wrapper takes the step is taken; one that needs more than the step says so."""
    import functools

    class Logged:
        def __call__(self, step):
            return 0.1 / (step + 1)

        def step(self):
            pass

        def get_last_lr(self):
            return [0.1]

    from fzero._src.optim.base import as_schedule

    optim.sgd(Logged())  # made, not refused
    assert as_schedule(Logged())(3) == 0.1 / 4

    def injecting(fn):
        @functools.wraps(fn)
        def wrapper(step):
            return fn(step, 0.5)
        return wrapper

    @injecting
    def halved(step, factor):
        return 0.1 * factor

    optim.sgd(halved)
    assert as_schedule(halved)(7) == 0.1 * 0.5
    with pytest.raises(optim.OptimizerError, match=r"signature \(step, group\) cannot be called with the step alone"):
        optim.sgd(lambda step, group: 0.1)


@pytest.mark.parametrize("returned, words", [
    (lambda: [0.1], r"returned list \[0.1\] at step 0.*return get_last_lr\(\)\[0\]"),
    (lambda: torch.tensor(0.1), r"returned torch.Tensor tensor\(0.1000\) at step 0.*float\(x\)"),
    (lambda: None, r"returned NoneType None at step 0"),
])
def test_a_schedule_returning_no_number_names_the_callable_and_the_step(returned, words):
    def schedule(t):
        return returned()

    mesh = fzero.SimMesh(1)
    with pytest.raises(optim.OptimizerError, match=r"^the lr schedule .*schedule \(.*test_migrant.py:\d+\) " + words):
        mesh.run(lambda: fzero.train_step(lambda p, b: p["w"].sum())(
            fzero.init({"w": torch.ones(2)}, optim.adamw(schedule), stage=0, mesh=mesh), None))


def test_sequence_of_recorded_get_last_lr_lists_names_the_index_and_its_docstring_says_so():
    opt, sched = _torch_scheduler()
    recorded = []
    for _ in range(3):
        recorded.append(sched.get_last_lr())
        opt.step()
        sched.step()
    with pytest.raises(optim.OptimizerError, match=r"lr\[0\] must be a Python float, got list .*record "
                                                   r"get_last_lr\(\)\[0\]"):
        optim.sequence(recorded)
    s = optim.sequence([v[0] for v in recorded])
    assert [s(t) for t in range(3)] == [1 / 3, 2 / 3, 1.0]
    assert "`get_last_lr()[0]`" in " ".join(optim.sequence.__doc__.split())


# --- F9 -----------------------------------------------------------------------------------------

def test_init_of_a_parameters_generator_names_the_way():
    model, mesh = nn.Linear(3, 2), fzero.SimMesh(1)
    for given in (model.parameters(), model.named_parameters()):
        with pytest.raises(fzero.LayoutError, match=r"params leaf '<root>' is a generator, not a tensor \(an "
                                                    r"iterator.*dict\(model.named_parameters\(\)\).*"
                                                    r"fzero.from_module\(model\)"):
            mesh.run(lambda: fzero.init(given, optim.sgd(0.1), stage=0, mesh=mesh))
