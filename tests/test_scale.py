"""fzero's loss scalers against DeepSpeed 0.19.8's `DynamicLossScaler`, step by step, exactly.

tests/golden/loss_scale_traces.json holds DeepSpeed's own scale and hysteresis after every
update under 299 settings and seeded overflow patterns (written by
tests/golden/make_loss_scale_traces.py, which imports DeepSpeed; this file does not). Every
trace is replayed here: scale, hysteresis and the raise at the minimum must agree at every step.
The properties below hold for any settings; the explicit checks derive, from the update rule,
when the first doublings happen with ZeRO's defaults and check the derivation against a trace.
"""

from __future__ import annotations

import doctest
import json
import math
import pathlib

import optree
import fzero
import fzero.optim
import pytest
import torch
from hypothesis import given, strategies as st

from fzero._src import scale as S
from fzero._src.errors import FzeroError
from fzero._src.scale import (
    DynamicLossScale,
    LossScaleConfigError,
    LossScaleError,
    LossScaleState,
    StaticLossScale,
    scale_of,
)

GOLDEN = json.loads(pathlib.Path(__file__).with_name("golden").joinpath("loss_scale_traces.json").read_text())
TRACES = {t["name"]: t for t in GOLDEN["traces"]}


def decode(trace: dict) -> tuple[list[bool], list[float], list[int]]:
    """(overflow flags, scale after each update, hysteresis after each update) of a golden trace
    (the encoding is described in tests/golden/make_loss_scale_traces.py)."""
    alphabet, w = GOLDEN["alphabet"], trace["width"]
    values = [math.ldexp(m, e) for m, e in trace["scales"]]
    index = [trace["scale"][k : k + w] for k in range(0, len(trace["scale"]), w)]
    scales = [values[sum(alphabet.index(c) * len(alphabet) ** p for p, c in enumerate(reversed(d)))] for d in index]
    return [c == "1" for c in trace["overflow"]], scales, [int(c) for c in trace["hysteresis"]]


def scaler_of(settings: dict) -> DynamicLossScale:
    return DynamicLossScale(**settings)


def copy(state: LossScaleState) -> LossScaleState:
    return LossScaleState(*(t.clone() for t in state))


def same(a: LossScaleState, b: LossScaleState) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------
# The golden traces.


def test_golden_file_is_deepspeeds_and_covers_the_cases():
    """The traces come from the DeepSpeed the semantics are claimed for, and exercise the minimum
    (with and without the raise), the clamp at a floor that is not init_scale / 2**k, growth,
    and every hysteresis value."""
    assert GOLDEN["deepspeed"] == "0.19.8"
    decoded = {name: decode(t) for name, t in TRACES.items()}
    raised = [t for t in TRACES.values() if t["raised_at"] is not None]
    assert len(raised) >= 10 and all(t["settings"]["raise_at_min"] for t in raised)
    floor_held = [n for n, t in TRACES.items() if not t["settings"]["raise_at_min"] and t["settings"]["min_scale"] in decoded[n][1]]
    assert len(floor_held) >= 10
    clamped = [n for n in floor_held if TRACES[n]["settings"]["init_scale"] == 3.0]
    assert clamped
    grew = [n for n, (_, s, _) in decoded.items() if any(b > a for a, b in zip(s, s[1:]))]
    assert len(grew) >= 100 and any(TRACES[n]["settings"]["window"] == 1000 for n in grew)
    for h in (1, 2, 3):
        assert any(set(decoded[n][2]) == set(range(1, h + 1)) for n, t in TRACES.items() if t["settings"]["hysteresis"] == h)


@pytest.mark.parametrize("name", sorted(TRACES))
def test_golden_trace(name):
    """Every update's scale and hysteresis equal DeepSpeed's exactly; it raises where DeepSpeed
    raised, leaving its input as it was; iteration and last_overflow count as DeepSpeed's
    cur_iter and last_overflow_iter (the generator asserts those from DeepSpeed's side). The
    overflow flag alternates between a Python bool and a 0-d bool tensor."""
    trace = TRACES[name]
    flags, scales, hysteresis = decode(trace)
    scaler = scaler_of(trace["settings"])
    state, last = scaler.init(), -1
    for k, flag in enumerate(flags):
        overflow = flag if k % 2 else torch.tensor(flag)
        if k == trace["raised_at"]:
            before = copy(state)
            with pytest.raises(LossScaleError, match="min_scale"):
                scaler.update(state, overflow)
            assert same(state, before)
            assert k == len(flags) - 1
            break
        state = scaler.update(state, overflow)
        last = k if flag else last
        assert (scale_of(state), int(state.hysteresis)) == (scales[k], hysteresis[k]), (name, k)
        assert (int(state.iteration), int(state.last_overflow)) == (k + 1, last), (name, k)
    else:
        assert trace["raised_at"] is None


# ---------------------------------------------------------------------------------------------
# Explicit checks, derived from the rule (fzero/_src/scale.py's docstring).


def growth_steps(init: float, scales: list[float]) -> list[int]:
    """Indices of the updates after which the scale went up (0 = the first update)."""
    before = [init] + scales[:-1]
    return [k for k, (a, b) in enumerate(zip(before, scales)) if b > a]


def test_zero_defaults_first_doubling_after_1001_clean_updates():
    """ZeRO's defaults (init 2**16, W = 1000, H = 2). Update k (0-based) sees i = k and, with no
    overflow yet, l = -1, so k' = i - l - 1 = k clean updates before it: it doubles when k > 0
    and k % 1000 == 0, i.e. on updates 1000 and 2000 — after 1001 and 2001 clean updates."""
    scaler = DynamicLossScale()
    assert (scaler.init_scale, scaler.window, scaler.hysteresis) == (2.0**16, 1000, 2)
    state, seen = scaler.init(), []
    for _ in range(2600):
        state = scaler.update(state, False)
        seen.append(scale_of(state))
    assert growth_steps(2.0**16, seen) == [1000, 2000]
    assert seen[999] == 2.0**16 and seen[1000] == 2.0**17 and seen[2000] == 2.0**18 and seen[-1] == 2.0**18
    _, golden, _ = decode(TRACES["zero_defaults_clean"])
    assert golden == seen


def test_zero_defaults_overflow_resets_the_window():
    """An overflow at update 0 (h: 2 -> 1, scale kept, l = 0) moves the first doubling to
    i - 0 - 1 = 1000, update 1001, which also refills h to 2; an overflow at update 1500 takes
    h to 1 again and sets l = 1500, so the next doubling is at 1500 + 1 + 1000 = 2501."""
    _, scales, hysteresis = decode(TRACES["zero_defaults_overflow_at_0_and_1500"])
    assert growth_steps(2.0**16, scales) == [1001, 2501]
    assert scales[0] == 2.0**16 and scales[1001] == 2.0**17 and scales[2501] == 2.0**18
    assert (hysteresis[0], hysteresis[1000], hysteresis[1001], hysteresis[1500], hysteresis[2501]) == (1, 1, 2, 1, 2)


def test_hysteresis_at_the_minimum_then_raise():
    """At min_scale with H = 2 the first overflow only spends hysteresis (DeepSpeed checks the
    floor only where it would halve); the second raises, or leaves the scale at the floor."""
    for raise_at_min in (False, True):
        scaler = DynamicLossScale(init_scale=1.0, window=5, hysteresis=2, min_scale=1.0, raise_at_min=raise_at_min)
        state = scaler.update(scaler.init(), True)
        assert (scale_of(state), int(state.hysteresis)) == (1.0, 1)
        state = scaler.update(state, False)  # a clean update refills nothing (not consecutive)
        assert int(state.hysteresis) == 1
        if raise_at_min:
            with pytest.raises(LossScaleError, match=r"iteration 2 .*min_scale=1\.0"):
                scaler.update(state, True)
        else:
            state = scaler.update(state, True)
            assert (scale_of(state), int(state.hysteresis)) == (1.0, 1)


def test_module_docstring_examples():
    assert doctest.testmod(S, raise_on_error=True).attempted >= 2


# ---------------------------------------------------------------------------------------------
# Properties.

POSITIVE = st.one_of(
    st.integers(-12, 40).map(lambda e: 2.0**e),
    st.floats(1e-6, 1e12, allow_nan=False, allow_infinity=False),
)


@st.composite
def dynamic_scalers(draw):
    a, b = draw(POSITIVE), draw(POSITIVE)
    return DynamicLossScale(
        init_scale=max(a, b),
        window=draw(st.integers(1, 6)),
        hysteresis=draw(st.integers(1, 4)),
        consecutive_hysteresis=draw(st.booleans()),
        min_scale=min(a, b),
        raise_at_min=draw(st.booleans()),
    )


FLAGS = st.lists(st.booleans(), max_size=60)


def run(scaler, flags):
    """The states after each update, stopping at a raise: (states, raised)."""
    state, states = scaler.init(), []
    for flag in flags:
        try:
            state = scaler.update(state, flag)
        except LossScaleError:
            return states, True
        states.append(state)
    return states, False


@given(dynamic_scalers(), FLAGS)
def test_update_is_pure(scaler, flags):
    """`update` never changes its input (nor on the raise), and returns a fresh state."""
    state = scaler.init()
    for flag in flags:
        before = copy(state)
        try:
            new = scaler.update(state, torch.tensor(flag))
        except LossScaleError:
            assert same(state, before)
            return
        assert same(state, before)
        assert all(n is not o for n, o in zip(new, state))
        state = new


@given(dynamic_scalers(), FLAGS)
def test_dynamic_scale_bounds(scaler, flags):
    """min_scale <= scale <= init_scale * 2**g, g = (n - 1) // W the most doublings n updates
    allow (update k doubles only if k' = k - l - 1 >= W, and doublings are >= W updates apart);
    1 <= hysteresis <= H; a raise only at the floor."""
    states, raised = run(scaler, flags)
    for n, state in enumerate(states, start=1):
        assert scaler.min_scale <= scale_of(state) <= scaler.init_scale * 2.0 ** ((n - 1) // scaler.window)
        assert 1 <= int(state.hysteresis) <= scaler.hysteresis
    if raised:
        assert scaler.raise_at_min and scale_of(states[-1] if states else scaler.init()) == scaler.min_scale


@given(dynamic_scalers(), st.integers(1, 60))
def test_clean_run_doubles_every_window(scaler, n):
    """Without overflow the bound is reached: after n updates, init_scale * 2**((n - 1) // W)."""
    states, _ = run(scaler, [False] * n)
    assert scale_of(states[-1]) == scaler.init_scale * 2.0 ** ((n - 1) // scaler.window)


@given(dynamic_scalers(), FLAGS)
def test_bool_and_tensor_overflow_agree(scaler, flags):
    a, raised_a = run(scaler, flags)
    b, raised_b = run(scaler, [torch.tensor(f) for f in flags])
    assert raised_a == raised_b and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


@given(POSITIVE, FLAGS)
def test_static_scale_never_changes(scale, flags):
    scaler = StaticLossScale(scale)
    state = scaler.init()
    for flag in flags:
        new = scaler.update(state, flag)
        assert same(new, scaler.init()) and scale_of(new) == scale
        state = new


@given(st.one_of(dynamic_scalers(), POSITIVE.map(StaticLossScale)))
def test_state_is_tensors_only(scaler):
    """A pytree map over a state sees four 0-d CPU tensors of the documented dtypes."""
    leaves = optree.tree_leaves(scaler.init())
    assert [(t.dtype, t.shape, t.device.type) for t in leaves] == [
        (torch.float64, (), "cpu"),
        (torch.int64, (), "cpu"),
        (torch.int64, (), "cpu"),
        (torch.int64, (), "cpu"),
    ]


BAD = {
    "init_scale": [0.0, -1.0, math.inf, math.nan, True, "1", None, 10**400],
    "min_scale": [0.0, -2.0, math.nan, math.inf, 2.0**17, False],
    "window": [0, -3, 1.5, True, None],
    "hysteresis": [0, -1, 2.0, False],
    "consecutive_hysteresis": [1, None, "no"],
    "raise_at_min": [0, "yes"],
}


@given(st.sampled_from(sorted(BAD)).flatmap(lambda k: st.tuples(st.just(k), st.sampled_from(BAD[k]))))
def test_bad_dynamic_settings_name_the_setting(case):
    setting, value = case
    with pytest.raises(LossScaleConfigError, match=f"DynamicLossScale.{setting}") as e:
        DynamicLossScale(**{setting: value})
    assert isinstance(e.value, FzeroError) and isinstance(e.value, ValueError)


@given(st.sampled_from([0, 0.0, -1.0, math.inf, math.nan, True, "8"]))
def test_bad_static_scale_names_the_setting(value):
    with pytest.raises(LossScaleConfigError, match="StaticLossScale.scale"):
        StaticLossScale(value)


@pytest.mark.parametrize("scaler", [DynamicLossScale(), StaticLossScale(8.0)], ids=["dynamic", "static"])
@pytest.mark.parametrize("overflow", [1, 0.0, None, torch.tensor(1.0), torch.tensor([True]), torch.tensor(1)])
def test_bad_overflow_is_rejected(scaler, overflow):
    with pytest.raises(LossScaleConfigError, match="overflow must be"):
        scaler.update(scaler.init(), overflow)


def test_errors_are_fzero_errors():
    assert issubclass(LossScaleError, FzeroError) and issubclass(LossScaleConfigError, FzeroError)


@pytest.mark.parametrize("make", [lambda v: StaticLossScale(v), lambda v: DynamicLossScale(init_scale=v, min_scale=v),
                                  lambda v: DynamicLossScale(min_scale=v)], ids=["static", "dynamic-init", "dynamic-min"])
def test_a_scale_below_float32s_normal_range_is_refused(make):
    """The step unscales by 1 / s in float32: below 2**-126 that overflows (found in review: at
    1e-39 every step raised a NonFiniteError blaming the optimizer's update). 2**-126 itself is
    taken, and a step under it unscales exactly (the gradient of a loss that is linear in w)."""
    for bad in (1e-39, 2.0**-127, 5e-324):
        with pytest.raises(LossScaleConfigError, match=r"at least float32's smallest normal number 2\*\*-126"):
            make(bad)
    scaler = make(2.0**-126)
    mesh = fzero.SimMesh(1)

    def rank(x):
        state = fzero.init({"w": torch.ones(4)}, fzero.optim.sgd(0.5), stage=0, mesh=mesh, loss_scale=scaler)
        state, metrics = fzero.train_step(lambda p, x: (p["w"] * x).sum())(state, x)
        return fzero.gather(state)["w"], bool(metrics.skipped)

    [(w, skipped)] = mesh.run(rank, [(torch.arange(4.0),)])
    assert not skipped and torch.equal(w, torch.ones(4) - 0.5 * torch.arange(4.0))


def _gradscaler_scales(steps: int, bad: set[int], init: float, window: int) -> list[float]:
    """The scale torch's `GradScaler(init_scale, growth_interval)` uses at each step of a plain
    loop, the gradients made inf at the steps in `bad`."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=init, growth_interval=window)
    used = []
    for t in range(steps):
        used.append(scaler.get_scale())
        opt.zero_grad()
        scaler.scale((w * w).sum()).backward()
        if t in bad:
            w.grad.fill_(float("inf"))
        scaler.step(opt)
        scaler.update()
    return used


@pytest.mark.parametrize("bad", [{8}, {2, 3}, {3, 10}, set()])
def test_against_gradscaler_the_same_halvings_and_each_doubling_one_clean_step_later(bad):
    """What README and proofs/precision.md say of torch's AMP recipe: `DynamicLossScale(init_scale=S,
    window=W, hysteresis=1)` halves where `GradScaler(init_scale=S, growth_interval=W)` does and
    doubles every W clean steps as it does, but each run of clean steps doubles first one step later
    (DeepSpeed's count: after n >= 1 clean updates the scale is `S' * 2**((n - 1) // W)`, GradScaler's
    `S' * 2**(n // W)`, S' the scale the run started at). Found in review: the docs said only
    "not GradScaler's every-growth_interval doubling"."""
    steps, init, window = 14, 1024.0, 3
    scaler = fzero.DynamicLossScale(init_scale=init, window=window, hysteresis=1)
    state, ours = scaler.init(), []
    for t in range(steps):
        ours.append(scale_of(state))
        state = scaler.update(state, t in bad)
    theirs = _gradscaler_scales(steps, bad, init, window)
    # each side's scale at the start of the current run of clean steps, and the run's length so far: an
    # overflow on GradScaler's doubling step ({3, 10}) halves scales that differ already
    mine, torchs, clean = init, init, 0
    for t in range(steps):
        assert theirs[t] == torchs * 2 ** (clean // window), (t, theirs)
        assert ours[t] == mine * 2 ** (max(clean - 1, 0) // window), (t, ours)
        if t in bad:
            mine, torchs, clean = ours[t] / 2, theirs[t] / 2, 0
        else:
            clean += 1
