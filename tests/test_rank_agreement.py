"""Ranks whose steps differ are stopped on every rank, before anything is updated.

The step's one agreement row carries the fingerprint of the rank's step settings
(`StepConfig.shared`: every `train_step` setting but the loss) and its state's step counter
(`agreement.Row`). Ranks that differ in either raise `ConfigError` on every rank, naming the setting
(or each rank's step count); a donating step's update launched before the agreement's read is
skipped on the device, so the state is left as it was. Without this, a setting that changes no
collective (`clip_norm`, `normalize`, `accum_dtype`, `on_nonfinite`) or a rank stepping an older
state gave a silently mixed state: stage 0's replicas diverged, stage 3's shards were updated
with different rules.
"""

from __future__ import annotations

import math
import threading

import pytest
import torch

import fzero
from fzero import optim

N = 2


def _params():
    return {"w": torch.arange(1.0, 5.0), "b": torch.linspace(-1.0, 1.0, 3)}


def _loss(p, x):
    return (p["w"] * x).square().sum() + p["b"].sum()


def _errors(run):
    """`run(rank)` on every rank of a SimMesh(2): each rank's exception (or None)."""
    mesh = fzero.SimMesh(N)

    def rank_fn():
        try:
            run(mesh)
        except fzero.FzeroError as e:
            return e
        return None

    return mesh.run(rank_fn)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("setting, values", [("clip_norm", (None, 1.0)), ("on_nonfinite", ("raise", "skip")),
                                             ("accum_dtype", (torch.float32, torch.float64))])
def test_ranks_with_different_step_settings_raise_on_every_rank(stage, setting, values):

    def run(mesh):
        state = fzero.init(_params(), optim.sgd(0.1), stage=stage, mesh=mesh)
        step = fzero.train_step(_loss, **{setting: values[mesh.rank]})
        step(state, torch.ones(4))

    errors = _errors(run)
    for r, e in enumerate(errors):
        assert isinstance(e, fzero.ConfigError), f"rank {r}: {e!r}"
        assert "fzero.train_step settings differ" in str(e) and repr(setting) in str(e), str(e)


@pytest.mark.parametrize("impl", ["single", "fused"])
@pytest.mark.parametrize("setting, values", [("clip_norm", (None, 1.0)), ("gather", ("on_use", "eager"))])
def test_a_donating_step_launched_early_updates_nothing_where_settings_differ(impl, setting, values, monkeypatch):
    """Rank 0 (no clipping, fused kernels) launches its update before the agreement's read; the
    device flag from the rows skips it, so both ranks' states still hold the initial params. At
    stage 0 over leaves of 8 and 4 elements, which no shard cuts: fused AdamW on the CPU refuses a
    leaf cut by the shard, and then nothing is launched early (found in a mutation audit: the test
    was at stage 1 over leaves of 4 and 3, launched nothing early, and passed where the flag
    ignored the settings). With `gather` apart the flag is all that differs: rank 1 launches early
    too."""
    from fzero._src import agreement

    early = []

    class Spy(agreement.HostRead):
        def __init__(self, *args):
            early.append(threading.get_ident())
            super().__init__(*args)

    monkeypatch.setattr(agreement, "HostRead", Spy)
    params = {"w": torch.arange(1.0, 9.0), "b": torch.linspace(-1.0, 1.0, 4)}
    finals = {}

    def run(mesh):
        state = fzero.init(params, optim.adamw(0.1, impl=impl), stage=0, mesh=mesh)
        step = fzero.train_step(lambda p, x: (p["w"] * x.repeat(2)).square().sum() + p["b"].sum(), donate=True,
                                **{setting: values[mesh.rank]})
        try:
            step(state, torch.ones(4))
        finally:
            finals[mesh.rank] = fzero.gather(state)  # not consumed: the step raised before its update

    errors = _errors(run)
    assert all(isinstance(e, fzero.ConfigError) and repr(setting) in str(e) for e in errors), errors
    assert len(early) == (0 if impl == "single" else 1 if setting == "clip_norm" else 2), early
    for r in range(N):
        for k, v in params.items():
            assert torch.equal(finals[r][k], v), (r, k)


def test_a_rank_stepping_an_older_state_raises_on_every_rank():
    def run(mesh):
        step = fzero.train_step(_loss)
        s0 = fzero.init(_params(), optim.sgd(0.1), stage=3, mesh=mesh)
        s1, _ = step(s0, torch.ones(4))
        step(s1 if mesh.rank == 0 else s0, torch.ones(4))  # rank 1 kept the state before

    errors = _errors(run)
    for e in errors:
        assert isinstance(e, fzero.ConfigError), repr(e)
        assert "rank 0: step 1, rank 1: step 0" in str(e) and "an older state" in str(e), str(e)


def _fp16_run(mesh, kept, scale=1024.0):
    """Two fp16 steps under a dynamic scaler, the first skipped (an inf in rank 1's input);
    `kept(rank, before, after)` picks the state each rank steps next."""
    state = fzero.init(_params(), optim.sgd(0.1), stage=3, mesh=mesh,
                       precision=fzero.Precision(torch.float16, torch.float32),
                       loss_scale=fzero.DynamicLossScale(init_scale=scale, hysteresis=1))
    step = fzero.train_step(_loss)
    bad = torch.full((4,), float("inf") if mesh.rank == 1 else 1.0)
    after, metrics = step(state, bad)
    assert metrics.skipped and int(after.step) == 0
    step(kept(mesh.rank, state, after), torch.ones(4))


def test_a_rank_keeping_the_state_from_before_a_skipped_step_raises_on_every_rank():
    """A skipped step leaves `state.step` as it was and halves the loss scale: a rank that kept
    the state from before it has the same step count, so only the scaler's update count (and
    the scale) tell it apart. Before, each rank divided the one reduced gradient by its own
    scale, and stage 3's shards were updated with two different gradients, silently."""
    errors = _errors(lambda mesh: _fp16_run(mesh, lambda r, before, after: after if r == 0 else before))
    for e in errors:
        assert isinstance(e, fzero.ConfigError), repr(e)
        assert "rank 0: loss scaler update 1, rank 1: loss scaler update 0" in str(e), str(e)


def test_ranks_with_different_loss_scales_raise_on_every_rank():
    def run(mesh):
        def kept(r, before, after):  # rank 1 doubles its scale back (an edited or another run's state)
            return after if r == 0 else after.replace(loss_scale=after.loss_scale._replace(
                scale=after.loss_scale.scale * 2))
        _fp16_run(mesh, kept)

    errors = _errors(run)
    for e in errors:
        assert isinstance(e, fzero.ConfigError), repr(e)
        assert "the loss scale differs across ranks (rank 0: 512.0, rank 1: 1024.0" in str(e), str(e)


def test_ranks_with_the_same_settings_in_separate_step_functions_agree():
    """Each rank building its own `train_step` (as under torchrun) is the normal case: same
    fingerprint, no error, and the same bits as one shared step function."""
    got = {}

    def run(mesh):
        state = fzero.init(_params(), optim.sgd(0.1), stage=2, mesh=mesh)
        for _ in range(2):
            state, _ = fzero.train_step(_loss, clip_norm=1.0)(state, torch.ones(4))
        got[mesh.rank] = fzero.gather(state)

    assert _errors(run) == [None, None]
    assert all(torch.equal(got[0][k], got[1][k]) for k in got[0])


@pytest.mark.parametrize("engine", ["autograd", "func"])
@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("how", ["detach", "no_grad", "constant"])
def test_a_loss_with_no_graph_to_the_params_raises_on_every_rank(engine, stage, how):
    """torch's `loss.backward()` raises for a loss that does not require grad; a step would train
    nothing and report a zero norm. Each rank raises `ConfigError`, the state left as it was."""

    def loss(p, x):
        if how == "detach":
            return _loss(p, x).detach()
        if how == "constant":
            return torch.tensor(3.0)
        with torch.no_grad():
            return _loss(p, x)

    def run(mesh):
        state = fzero.init(_params(), optim.sgd(0.1), stage=stage, mesh=mesh)
        try:
            fzero.train_step(loss, engine=engine)(state, torch.ones(4))
        finally:
            assert all(torch.equal(v, _params()[k]) for k, v in fzero.gather(state).items())

    for e in _errors(run):
        assert isinstance(e, fzero.ConfigError) and "no rank's loss depends on any trainable param" in str(e), repr(e)


def test_a_loss_one_rank_computes_without_the_params_still_trains_from_the_others():
    """Only where no rank's loss reaches a param: a rank whose loss is a constant adds a zero
    gradient, as a rank whose loss leaves some leaves unused does (`gather="eager"`: with on-use
    gathering every rank must reach the same units, `gathering.DivergentPaths`)."""
    def run(mesh):
        state = fzero.init(_params(), optim.sgd(0.1), stage=2, mesh=mesh)
        loss = _loss if mesh.rank == 0 else (lambda p, x: torch.tensor(0.5))
        new, m = fzero.train_step(loss, gather="eager")(state, torch.ones(4))
        assert not torch.equal(fzero.gather(new)["w"], _params()["w"]) and m.grad_norm > 0

    assert _errors(run) == [None, None]


def test_ranks_stepping_states_of_different_inits_raise_on_every_rank():
    """Two `init`s of the same layout (each collective, so every rank made both): rank 0 steps
    the first, rank 1 the second. Before, stage 3 trained a mix of the two (each rank's shard of
    its own state)."""
    finals = {}

    def run(mesh):
        a = fzero.init(_params(), optim.sgd(0.1), stage=3, mesh=mesh)
        b = fzero.init({k: torch.zeros_like(v) for k, v in _params().items()}, optim.sgd(0.1), stage=3, mesh=mesh)
        try:
            fzero.train_step(_loss)(a if mesh.rank == 0 else b, torch.ones(4))
        finally:
            finals[mesh.rank] = fzero.gather(a)

    for e in _errors(run):
        assert isinstance(e, fzero.ConfigError), repr(e)
        assert "rank 0: the state of its init #1, rank 1: the state of its init #2" in str(e), str(e)
    assert all(torch.equal(finals[r][k], v) for r in range(N) for k, v in _params().items())


def test_the_shared_settings_are_plain_values_and_equal_numbers_agree():
    """The fingerprint is of the settings' reprs: each must be a plain value (no object whose repr
    holds an address), and `clip_norm` 1, 1.0 and np.float64(1.0) are one setting."""
    import numpy as np

    config = fzero.train_step(_loss, clip_norm=np.float64(1.0)).config
    assert all(isinstance(v, (str, int, float, bool, type(None), torch.dtype)) for v in config.shared.values())
    prints = {fzero.train_step(_loss, clip_norm=c).config.fingerprint for c in (1, 1.0, np.float64(1.0))}
    assert len(prints) == 1


def _peak_of(peak, step):
    return peak * 0.5 ** step


class _Halving:
    """A schedule object: `init` describes its class, not its `peak`."""

    def __init__(self, peak):
        self.peak = peak

    def __call__(self, step):
        return self.peak * 0.5 ** step


@pytest.mark.parametrize("other", [0.2, math.nextafter(0.1, 1.0)])  # one ulp apart too (a mutant comparing within
@pytest.mark.parametrize("stage", [0, 3])  # a relative 1e-9 passed without it)
@pytest.mark.parametrize("kind", ["partial", "object"])
def test_lr_schedules_init_cannot_tell_apart_raise_at_the_first_step_they_differ(stage, kind, other):
    """Rank 1's schedule differs only in a `functools.partial`'s argument or a callable object's
    attribute, which `init` does not describe: `init` passes, and the first step raises
    `ConfigError` on every rank naming each rank's lr, the state left as it was."""
    import functools

    def schedule(peak):
        return functools.partial(_peak_of, peak) if kind == "partial" else _Halving(peak)

    def run(mesh):
        state = fzero.init(_params(), optim.sgd(schedule(0.1 if mesh.rank == 0 else other)), stage=stage, mesh=mesh)
        try:
            fzero.train_step(_loss)(state, torch.ones(4))
        finally:
            assert all(torch.equal(v, _params()[k]) for k, v in fzero.gather(state).items())

    errors = _errors(run)
    for e in errors:
        assert isinstance(e, fzero.ConfigError), repr(e)
        assert f"step 0: the optimizer's lr differs across ranks (rank 0: 0.1, rank 1: {other!r}" in str(e), str(e)


@pytest.mark.parametrize("impl", ["single", "fused"])
def test_lr_sequences_that_part_at_a_later_step_stop_that_step_and_keep_the_state(impl):
    """Sequences equal for two steps and different at the third: two steps run (the same bits
    on both ranks), the third raises on every rank and its donating update, launched before the
    agreement's read (`impl="fused"`: its kernels take the skip flag), is skipped on the device."""
    import functools

    def lrs(rank):
        return functools.partial(_at, (0.1, 0.05, 0.02 if rank == 0 else 0.03))

    finals, seconds = {}, {}
    params = {"w": torch.arange(1.0, 5.0), "b": torch.linspace(-1.0, 1.0, 4)}  # fused on the CPU: whole leaves

    def run(mesh):
        state = fzero.init(params, optim.adamw(lrs(mesh.rank), impl=impl), stage=0, mesh=mesh)
        step = fzero.train_step(_loss, donate=True)
        for _ in range(2):
            state, _ = step(state, torch.ones(4))
        seconds[mesh.rank] = fzero.gather(state)
        try:
            step(state, torch.ones(4))
        finally:
            finals[mesh.rank] = fzero.gather(state)  # not consumed: the step raised before its update

    errors = _errors(run)
    for e in errors:
        assert isinstance(e, fzero.ConfigError) and "step 2: the optimizer's lr differs" in str(e), repr(e)
        assert "rank 0: 0.02, rank 1: 0.03" in str(e), str(e)
    for r in range(N):
        for k in seconds[0]:
            assert torch.equal(finals[r][k], seconds[0][k]) and torch.equal(seconds[r][k], seconds[0][k]), (r, k)
        assert not torch.equal(seconds[r]["w"], params["w"])


def _at(values, step):
    return values[step]


def test_the_optimizers_lr_field_is_not_part_of_its_description():
    """`Optimizer.lr` (what the agreement reads) is left out of `describe`: the update's closure
    holds the same schedule, and descriptions (stored in checkpoints) stay those of the six
    fields before it."""
    from fzero._src.state import describe

    for opt in (optim.sgd(0.1, momentum=0.9), optim.adamw(0.1), optim.lamb(0.1), optim.adafactor(0.1)):
        assert opt.lr(3) == 0.1
        assert describe(opt) == describe(tuple(opt)[:6])


def _two_steps_under(values_0, values_1):
    """Two stage-2 SGD steps on two ranks, rank r's lr `values_r` by step, as a `functools.partial`
    of `_at` (whose arguments init does not see)."""

    def run(mesh):
        import functools

        lr = functools.partial(_at, values_0 if mesh.rank == 0 else values_1)
        state = fzero.init(_params(), optim.sgd(lr), stage=2, mesh=mesh)
        step = fzero.train_step(_loss)
        state, _ = step(state, torch.ones(4))
        step(state, torch.ones(4))

    return run


def test_a_schedule_that_raises_on_one_rank_only_is_named_on_every_rank():
    """Rank 0's lr values end after one step, rank 1's go on: at step 1 both raise
    `ConfigError` saying rank 0's schedule raised (where every rank's raises, the update raises
    the schedule's own error, after the verdict: `test_host.py::
    test_a_prepare_that_raises_raises_after_the_verdict`)."""

    for e in _errors(_two_steps_under((0.1,), (0.1, 0.05))):
        assert isinstance(e, fzero.ConfigError), repr(e)
        assert ("step 1: the optimizer's lr differs across ranks (rank 0: its schedule raised, or returned a value "
                "refused (negative, NaN, inf, not a number), rank 1: 0.05") in str(e)


def test_a_schedule_that_returns_a_refused_value_on_one_rank_is_not_said_to_have_raised_only():
    """Rank 1's schedule returns -0.001 at step 1: the words said "its schedule raised" (found in
    review of a user porting schedules); they name a refused value too."""

    for e in _errors(_two_steps_under((0.1, 0.05), (0.1, -0.001))):
        assert isinstance(e, fzero.ConfigError), repr(e)
        assert ("(rank 0: 0.05, rank 1: its schedule raised, or returned a value refused (negative, NaN, inf, not a "
                "number)") in str(e), str(e)


def test_a_schedule_object_is_read_once_a_step_and_the_row_compares_what_the_update_applies():
    """Found in review: the agreement's read of the lr was a second call of the schedule, so an
    object that moves to its next value on each call was asked twice a step (and once more per
    bucket: before this session too). `as_schedule` computes each step's value once: two steps
    over two buckets call it twice, and SGD applies 0.1 then 0.2, torch's values."""
    calls = []

    class Counting:
        def __call__(self, step):
            calls.append(step)
            return 0.1 * len(calls)

    mesh = fzero.SimMesh(1)
    params = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([3.0])}

    def rank_fn():
        state = fzero.init(params, optim.sgd(Counting()), stage=0, mesh=mesh, units=lambda path: path)
        step = fzero.train_step(lambda p, x: (p["a"].sum() + p["b"].sum()) * x)
        for _ in range(2):
            state, _ = step(state, torch.tensor(1.0))
        return fzero.gather(state)

    out = mesh.run(rank_fn)[0]
    assert calls == [0, 1]
    w = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    opt = torch.optim.SGD([w], lr=0.1)
    for lr in (0.1, 0.2):
        opt.param_groups[0]["lr"] = lr
        opt.zero_grad()
        w.sum().backward()
        opt.step()
    assert torch.equal(out["a"], w.detach())


def test_a_hand_made_optimizers_lr_must_be_a_schedule_of_floats():
    """`Optimizer.lr` a float (not a schedule) is refused by `init`; a schedule that returns
    something other than a finite float >= 0 stops the step with `ConfigError` (review: before,
    a bare TypeError from the agreement's row, or a float lr not compared)."""
    base = optim.sgd(0.1)
    mesh = fzero.SimMesh(1)

    def rank_fn(lr):
        state = fzero.init(_params(), base._replace(lr=lr), stage=0, mesh=mesh)
        fzero.train_step(_loss)(state, torch.ones(4))

    with pytest.raises(fzero.ConfigError, match=r"Optimizer.lr must be None or the schedule step -> lr"):
        mesh.run(lambda: rank_fn(0.1))
    with pytest.raises(fzero.ConfigError, match=r"step 0: Optimizer.lr returned str 'fast'; a schedule returns a "
                                                r"finite float >= 0"):
        mesh.run(lambda: rank_fn(lambda step: "fast"))
    mesh.run(lambda: rank_fn(lambda step: 0.1))  # a plain callable of floats is fine
    mesh.run(lambda: rank_fn(lambda step: 0.1 * step))  # 0.0 at step 0 (a warmup's first step): >= 0 (a mutation
    # audit's survivor refused it)
    with pytest.raises(fzero.ConfigError, match=r"returned float -1e-09; a schedule returns a finite float >= 0"):
        mesh.run(lambda: rank_fn(lambda step: -1e-9))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_an_optimizer_changed_mid_run_on_every_rank_or_on_one(stage):
    """Adam's betas changed after two steps, by giving the state another optimizer (the README's
    recipe): on every rank, torch's AdamW with `group["betas"]` changed at that step, bit for bit;
    on one rank alone, `ConfigError` on every rank naming the betas, before anything is updated
    (before: that rank trained with its own betas, silently; found in review)."""
    import dataclasses

    w0 = torch.linspace(-1.0, 1.0, 7)
    xs = [torch.linspace(0.5, 2.0, 7) * (k + 1) for k in range(4)]
    new = (0.8, 0.99)
    ref = torch.nn.Parameter(w0.clone())
    opt = torch.optim.AdamW([ref], lr=0.1, foreach=False)
    for k, x in enumerate(xs):
        if k == 2:
            opt.param_groups[0]["betas"] = new
            two = ref.detach().clone()
        opt.zero_grad()
        ((ref * x).sum() ** 2).backward()
        opt.step()

    def run(who):
        mesh = fzero.SimMesh(2)

        def rank():
            state = fzero.init({"w": w0.clone()}, optim.adamw(0.1), stage=stage, mesh=mesh)
            step = fzero.train_step(lambda p, x: (p["w"] * x).sum() ** 2)
            for k, x in enumerate(xs):
                if k == 2 and mesh.rank in who:
                    state = state.replace(info=dataclasses.replace(state.info, optimizer=optim.adamw(0.1, betas=new)))
                try:
                    state, _ = step(state, x)
                except fzero.ConfigError as e:
                    return str(e), fzero.gather(state)["w"]
            return "trained", fzero.gather(state)["w"]

        return mesh.run(rank)

    for said, w in run({0, 1}):
        assert said == "trained" and torch.equal(w, ref.detach())
    for said, w in run({1}):
        assert "(state.info.optimizer" in said and "beta1: rank 0 0.9, rank 1 0.8" in said, said
        assert "beta2: rank 0 0.999, rank 1 0.99" in said, said
        assert torch.equal(w, two)  # two steps taken, the third refused before any update


@pytest.mark.parametrize("stage", [0, 3])
def test_a_group_setting_changed_on_one_rank_only_is_refused_naming_the_groups(stage):
    """A layout whose group has another `lr_scale` (or `weight_decay`) put in one rank's state
    after two steps (`state.replace(info=dataclasses.replace(state.info, layout=...))`): the next
    step raises `ConfigError` on every rank naming the parameter groups, before any update.
    Before: the step's agreement compared the optimizer, not the groups, and each rank updated
    its part with its own lr, silently (found in review of a model-surgery user). On every rank,
    the change trains (the groups' settings are the state's)."""
    import dataclasses

    params = {"a": torch.linspace(-1.0, 1.0, 6), "b": torch.linspace(0.5, 1.5, 4)}
    before = (fzero.ParamGroup("head", match=lambda p: p == "b"),)
    after = (fzero.ParamGroup("head", match=lambda p: p == "b", lr_scale=0.5),)

    def run(who):
        mesh = fzero.SimMesh(2)

        def rank():
            state = fzero.init(params, optim.adamw(0.1), stage=stage, mesh=mesh, groups=before)
            step = fzero.train_step(lambda p, x: (p["a"].sum() * x) ** 2 + (p["b"] * x).sum() ** 2)
            for k in range(3):
                if k == 2 and mesh.rank in who:
                    layout = fzero.layout.plan(params, 2, groups=after)
                    state = state.replace(info=dataclasses.replace(state.info, layout=layout))
                try:
                    state, _ = step(state, torch.tensor(1.0 + k))
                except fzero.ConfigError as e:
                    return str(e), int(state.step)
            return "trained", int(state.step)

        return mesh.run(rank)

    assert run({0, 1}) == [("trained", 3)] * 2
    for said, step in run({1}):
        assert "(its parameter groups, state.info.layout" in said and "'groups'" in said, said
        assert step == 2
