"""fzero.optim against torch.optim (bitwise) and against a per-leaf LAMB reference (derived bound).

Every optimizer runs on every rank's flat shards of random pytrees (0-d, zero-size, sizes not
divisible by N), with parameter groups (weight-decay mask, lr scale, frozen), N in 1..8, 1-4
steps and random unused leaves, and is compared after every step, params and state; SGD /
Adam / AdamW with each `impl` against torch's matching path, on CPU and (where there is one) on
CUDA. Every step also checks that `update` leaves its inputs alone and equals `update_` on
clones; a census bounds `update_`'s temporaries.
"""

from __future__ import annotations

import importlib
import math
import re
from fractions import Fraction
from unittest import mock

import pytest
import torch
from hypothesis import given, strategies as st

import fzero
import fzero.optim as fo
from fzero._src import layout as L
from fzero._src.accounting import LiveStorages
from fzero._src.layout import ParamGroup
from fzero._src.optim import base as optim_base, exact, fused

from fzero.testing import examples, world_sizes


# ---------------------------------------------------------------------------------------------
# Problems: a pytree, its groups, per-step grads and used masks, N.

SHAPE = st.one_of(
    st.sampled_from([(), (0,), (7,), (3, 5), (2, 0), (1,), (13,)]),
    st.lists(st.integers(0, 5), max_size=3).map(tuple),
)


@st.composite
def problems(draw, scales=(0.0, 0.1, 0.5, 1.0, 3.0)):
    n = draw(st.integers(1, 6))
    kinds = [draw(st.sampled_from(["a", "a", "b", "frozen"])) for _ in range(n)]
    shapes = [draw(SHAPE) for _ in range(n)]
    steps = draw(st.integers(1, 4))
    used = [[draw(st.sampled_from([True, True, True, False])) for _ in range(n)] for _ in range(steps)]
    return dict(
        kinds=kinds,
        shapes=shapes,
        used=used,
        world=draw(world_sizes()),
        align=draw(st.sampled_from([1, 1, 4])),
        scale=draw(st.sampled_from(scales)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _names(prob):
    return [f"p{i}_{k}" for i, k in enumerate(prob["kinds"])]


def _tree(prob, leaves):
    """Half the leaves in a list of dicts, half in a dict; flatten order is leaf order, and the
    paths ("x.0.p0_a", "y.p3_b", ...) carry the kind."""
    names = _names(prob)
    h = len(leaves) // 2
    return {"x": [{nm: t} for nm, t in zip(names[:h], leaves[:h])], "y": dict(zip(names[h:], leaves[h:]))}


def _groups(prob):
    return (
        ParamGroup("b", match=lambda path: path.endswith("_b"), weight_decay=False, lr_scale=prob["scale"]),
        ParamGroup("frozen", match=lambda path: path.endswith("_frozen"), frozen=True),
    )


def _data(prob):
    gen = torch.Generator().manual_seed(prob["seed"])
    params = [torch.randn(s, generator=gen) for s in prob["shapes"]]
    grads = [[torch.randn(s, generator=gen) for s in prob["shapes"]] for _ in prob["used"]]
    return params, grads


# ---------------------------------------------------------------------------------------------
# Serial simulation of N ranks.

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"))]


class _Pending(Exception):
    pass


def serial_update(update, layout, b, grads, params, states, step, used):
    """One `update(grad, state, param, ctx) -> (param, state)` of bucket `b` on every rank, ranks
    run one after another.

    `ctx.leaf_sum` is a collective; here it is replayed: pass k runs every rank up to its k-th
    call, records its partial and aborts; the sum (rank 0 + rank 1 + ..., in rank order) is then
    known to pass k + 1. `update` must leave its inputs untouched, so re-running it is harmless.
    """
    bucket = layout.buckets[b]
    numels = tuple(layout.leaves[i].numel for i in bucket.leaves)
    known: list[torch.Tensor] = []
    while True:
        partials, results = [], []
        for r in range(layout.world_size):
            calls = [0]

            def leaf_sum(x, calls=calls):
                k = calls[0]
                calls[0] += 1
                if k < len(known):
                    return known[k].clone()
                partials.append(x.clone())
                raise _Pending

            ctx = fo.UpdateContext(step, bucket.group, layout.segments(b, r), bucket.leaves, used, leaf_sum, numels)
            try:
                results.append(update(grads[r], states[r], params[r], ctx))
            except _Pending:
                pass
        if not partials:
            return results
        assert len(partials) == layout.world_size, "ranks made different numbers of leaf_sum calls"
        total = partials[0]
        for p in partials[1:]:
            total = total + p
        known.append(total)


def in_place_on_clones(opt):
    """`update_` on fresh clones of param and the "shard" fields, as `(param, state)`; checks
    that it wrote into them (same tensors, same storage) rather than returning new ones."""

    def update(grad, state, param, ctx):
        kinds = opt.spec(state)
        fresh = type(state)(*[t.clone() if k == "shard" else t for t, k in zip(state, kinds)])
        p = param.clone()
        ptr = p.data_ptr()
        new = opt.update_(grad, fresh, p, ctx)
        assert p.data_ptr() == ptr
        for field, k, t_in, t_out in zip(state._fields, kinds, fresh, new):
            if k == "shard":
                assert t_out is t_in, f"update_ returned a new tensor for shard field {field!r}"
        return p, new

    return update


def _snapshot(tensors):
    return [t.clone() for t in tensors]


class FzeroRun:
    """fzero's optimizer on all N ranks' shards of every bucket, on `device`.

    Each step runs the pure `update`, checks it left grad, param and state untouched, runs
    `update_` on clones of the same inputs and checks the two results are the same bits."""

    def __init__(self, opt, prob, params, device="cpu"):
        self.opt, self.prob, self.device = opt, prob, device
        tree = _tree(prob, params)
        self.layout = L.plan(tree, prob["world"], groups=_groups(prob), align=prob["align"])
        self.shards = [[r.to(device) for r in s.clone()] for s in L.shard(self.layout, L.pack(self.layout, tree))]
        self.states = [
            None if bk.group.frozen else [opt.init(s, len(bk.leaves)) for s in self.shards[bk.index]]
            for bk in self.layout.buckets
        ]

    def step(self, step, grads, used):
        gshards = L.shard(self.layout, L.pack(self.layout, _tree(self.prob, grads)))
        for bk in self.layout.buckets:
            if bk.group.frozen:
                continue
            b = bk.index
            args = ([g.to(self.device) for g in gshards[b]], self.shards[b], self.states[b])
            before = [_snapshot([g, p, *s]) for g, p, s in zip(*args)]
            bused = tuple(used[i] for i in bk.leaves)
            out = serial_update(self.opt.update, self.layout, b, *args, step, bused)
            for g, p, s, was in zip(*args, before):  # pure: inputs untouched
                assert all(torch.equal(x, y) for x, y in zip([g, p, *s], was)), "update wrote into its inputs"
            if self.opt.update_ is not None:
                out_ = serial_update(in_place_on_clones(self.opt), self.layout, b, *args, step, bused)
                for (p, st_), (p_, st2) in zip(out, out_):
                    assert torch.equal(p, p_) and all(torch.equal(x, y) for x, y in zip(st_, st2)), \
                        "update != clone + update_"
            self.shards[b] = [p for p, _ in out]
            self.states[b] = [s for _, s in out]

    def flat(self, b, field=None):
        rows = self.shards[b] if field is None else [getattr(s, field) for s in self.states[b]]
        rows = [r.cpu() for r in rows]
        return L.unshard(self.layout, [torch.stack(rows) if i == b else torch.zeros(bk.world_size, bk.shard_numel, dtype=bk.dtype) for i, bk in enumerate(self.layout.buckets)])[b]

    def leaf(self, i, field=None):
        """Leaf i of the params (or of a "shard" state field)."""
        ls = self.layout.leaves[i]
        return dict(L.bucket_leaves(self.layout, ls.bucket, self.flat(ls.bucket, field)))[i]

    def leaf_state(self, i, field):
        """Entry of leaf i in a "leaf" state field, checked replicated across ranks."""
        ls = self.layout.leaves[i]
        rows = [getattr(s, field).cpu() for s in self.states[ls.bucket]]
        assert all(torch.equal(rows[0], r) for r in rows), f"{field} differs across ranks"
        return rows[0][self.layout.buckets[ls.bucket].leaves.index(i)]

    def check_padding(self):
        for bk in self.layout.buckets:
            if bk.group.frozen:
                continue
            flat = self.flat(bk.index)
            assert not flat[bk.numel :].any(), "padding of params changed"
            for field, kind in zip(self.states[bk.index][0]._fields, self.opt.spec(self.states[bk.index][0])):
                if kind == "shard":
                    assert not self.flat(bk.index, field)[bk.numel :].any(), f"padding of {field} changed"


def torch_optimizer(kind, hp, prob, params, impl="single", device="cpu"):
    """The matching torch.optim instance over trainable leaves, param groups mirrored, with
    `foreach` / `fused` as `impl` says.

    Fused SGD with momentum gets one param group per leaf: torch decides `is_first_step` per
    group and raises on a group that mixes leaves with and without a momentum buffer; fzero
    decides it per leaf, which is what a group of one leaf gives (and, where torch does not
    raise, what torch's shared group gives)."""
    trainable = [k != "frozen" for k in prob["kinds"]]
    leaves = [torch.nn.Parameter(p.clone().to(device), requires_grad=t) for p, t in zip(params, trainable)]
    per_leaf = kind == "sgd" and impl == "fused" and hp["momentum"] != 0
    groups = []
    for k, scale, wd in (("a", 1.0, True), ("b", prob["scale"], False)):
        ps = [p for p, kk in zip(leaves, prob["kinds"]) if kk == k]
        for chunk in ([[p] for p in ps] if per_leaf else [ps] if ps else []):
            groups.append({"params": chunk, "lr": hp["lr"] * scale, "weight_decay": hp["weight_decay"] if wd else 0.0})
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    extra = {k: v for k, v in hp.items() if k not in ("lr", "weight_decay")}
    flags = dict(foreach=impl == "foreach", fused=impl == "fused")
    opt = cls(groups, lr=hp["lr"], **flags, **extra) if groups else None
    return leaves, opt


SGD_HP = st.fixed_dictionaries(
    dict(
        lr=st.sampled_from([0.1, 0.01, 0.37, 1e-3]),
        momentum=st.sampled_from([0.0, 0.9, 0.5]),
        dampening=st.sampled_from([0.0, 0.0, 0.1]),
        nesterov=st.booleans(),
        weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
        maximize=st.booleans(),
    )
).map(lambda h: {**h, "nesterov": h["nesterov"] and h["momentum"] > 0 and h["dampening"] == 0})
ADAM_HP = st.fixed_dictionaries(
    dict(
        lr=st.sampled_from([1e-3, 0.1, 0.37]),
        betas=st.sampled_from([(0.9, 0.999), (0.5, 0.9), (0.0, 0.99), (0.8, 0.0)]),
        eps=st.sampled_from([1e-8, 1e-3, 0.5]),
        weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
        amsgrad=st.booleans(),
        maximize=st.booleans(),
    )
)
FACTORIES = {"sgd": fo.sgd, "adam": fo.adam, "adamw": fo.adamw}


def check_against_torch(kind, fz, leaves, topt):
    for i, p in enumerate(leaves):
        assert torch.equal(fz.leaf(i), p.detach().cpu()), f"leaf {i} ({fz.layout.leaves[i].path}) params differ"
        if not p.requires_grad:
            continue
        tstate = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in (topt.state.get(p, {}) if topt is not None else {}).items()}
        state0 = fz.states[fz.layout.leaves[i].bucket][0]
        for field, spec_kind in zip(state0._fields, fz.opt.spec(state0)):
            if field == "count":  # SGD: momentum buffer exists iff count > 0
                has = tstate.get("momentum_buffer") is not None
                assert has == bool(fz.leaf_state(i, "count") > 0)
                want = tstate["momentum_buffer"] if has else torch.zeros_like(p.cpu())
                assert torch.equal(fz.leaf(i, "momentum_buffer"), want)
            elif field == "momentum_buffer":
                continue
            elif spec_kind == "leaf":
                want = tstate.get(field, torch.tensor(0.0))
                assert torch.equal(fz.leaf_state(i, field), want), f"leaf {i} {field}"
            else:
                want = tstate.get(field, torch.zeros_like(p.cpu()))
                assert torch.equal(fz.leaf(i, field), want), f"leaf {i} {field} differs"


def misplaced(layout, used, device):
    """Whether some used leaf is cut by a shard or, on CUDA, a leaf of numel % 4 == 0 starts at a
    shard element that is not a multiple of 4 (shards are their own aligned allocations here):
    where a placement-dependent fused kernel cannot give torch's bits."""
    for bk in layout.buckets:
        if bk.group.frozen:
            continue
        for r in range(layout.world_size):
            for seg in layout.segments(bk.index, r):
                numel = layout.leaves[seg.leaf].numel
                if used[seg.leaf] and (seg.stop - seg.start != numel or (device == "cuda" and numel % 4 == 0 and seg.start % 4)):
                    return True
    return False


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@examples(100)
@given(prob=problems(), data=st.data())
def test_bitwise_equal_to_torch_optim(kind, device, prob, data):
    """Each `impl` against torch.optim with the matching `foreach` / `fused`, after every step,
    params and state; pure and in-place forms (`FzeroRun.step`).

    "fused" where torch's kernel rounds by placement (CPU always; on CUDA some configurations,
    see `fused.elementwise`) runs per leaf and must refuse exactly the layouts that cut or
    misalign a used leaf (`misplaced`); on CPU it runs with N = 1, so that it compares. The
    impl is drawn with the device's default first (hypothesis favours the first choice): on CPU
    "foreach", so that the forced N = 1 of "fused" does not crowd out the sharded draws."""
    impl = data.draw(st.sampled_from(("foreach", "single", "fused") if device == "cpu" else fo.IMPLS), label="impl")
    _against_torch(kind, device, prob, impl, data)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
@examples(40)
@given(prob=problems(), impl=st.sampled_from(["single", "foreach"]), block=st.integers(1, 9), data=st.data())
def test_cpu_blocks_keep_torchs_bits(kind, prob, impl, block, data):
    """On the CPU "single" and "foreach" run block by block (`base.in_blocks`, a cache-sized
    `CPU_BLOCK` elements per thread): with blocks of 1-9 elements per thread, which cut the
    pieces anywhere, every step still has torch.optim's bits."""
    with mock.patch.object(optim_base, "CPU_BLOCK", block):
        _against_torch(kind, "cpu", prob, impl, data)


def _against_torch(kind, device, prob, impl, data):
    if impl == "fused" and device == "cpu":
        prob = {**prob, "world": 1}
    hp = data.draw(SGD_HP if kind == "sgd" else ADAM_HP)
    params, grads = _data(prob)
    fz = FzeroRun(FACTORIES[kind](**hp, impl=impl), prob, params, device)
    leaves, topt = torch_optimizer(kind, hp, prob, params, impl, device)
    for step, (g, used) in enumerate(zip(grads, prob["used"])):
        for p, gi, u in zip(leaves, g, used):
            p.grad = gi.clone().to(device) if (u and p.requires_grad) else None
        if topt is not None:
            topt.step()
        try:
            fz.step(step, g, used)
        except fo.OptimizerError as e:
            assert impl == "fused" and "rounds by placement" in str(e), e
            assert misplaced(fz.layout, used, device), f"fused refused a layout that places every leaf as torch: {e}"
            return
        check_against_torch(kind, fz, leaves, topt)
        fz.check_padding()


# ---------------------------------------------------------------------------------------------
# Learning-rate schedules.

SCHEDULERS = {
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=3),
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.1),
    "linear": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=0.25, total_iters=3),
    "exponential": lambda o: torch.optim.lr_scheduler.ExponentialLR(o, gamma=0.7),
    "warmup_cosine": lambda o: torch.optim.lr_scheduler.SequentialLR(
        o,
        [torch.optim.lr_scheduler.LinearLR(o, 0.1, total_iters=2), torch.optim.lr_scheduler.CosineAnnealingLR(o, 3)],
        milestones=[2],
    ),
}


@pytest.mark.parametrize("sched", sorted(SCHEDULERS))
@examples(25)
@given(prob=problems(scales=(0.5, 1.0, 2.0)), hp=ADAM_HP)
def test_lr_sequence_from_torch_scheduler(sched, prob, hp):
    """fzero fed the values a torch scheduler produced equals torch + that scheduler, bit for bit.

    lr scales are powers of two (0.5, 1, 2): then each torch group's own scheduled lr is exactly
    scale * (the recorded lr) (power-of-two scaling commutes with rounding), which is fzero's
    fl(lr(step) * lr_scale)."""
    hp = {**hp, "amsgrad": False}
    dummy = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=hp["lr"])
    scheduler = SCHEDULERS[sched](dummy)
    values = []
    for _ in prob["used"]:
        values.append(dummy.param_groups[0]["lr"])
        dummy.step()
        scheduler.step()
    params, grads = _data(prob)
    fz = FzeroRun(fo.adamw(**{**hp, "lr": fo.sequence(values)}), prob, params)
    leaves, topt = torch_optimizer("adamw", hp, prob, params)
    tsched = SCHEDULERS[sched](topt) if topt is not None else None
    for step, (g, used) in enumerate(zip(grads, prob["used"])):
        for p, gi, u in zip(leaves, g, used):
            p.grad = gi.clone() if (u and p.requires_grad) else None
        if topt is not None:
            topt.step()
            tsched.step()
        fz.step(step, g, used)
        check_against_torch("adamw", fz, leaves, topt)


@given(
    peak=st.floats(1e-6, 10.0),
    final=st.floats(0.0, 1e-6),
    total=st.integers(1, 50),
    warm=st.integers(0, 10),
    f0=st.floats(0.0, 1.0),
    gamma=st.floats(0.01, 1.0),
    size=st.integers(1, 10),
    t=st.integers(0, 80),
)
def test_schedule_formulas(peak, final, total, warm, f0, gamma, size, t):
    """Closed forms equal torch's `_get_closed_form_lr` bit for bit, and have the right shape."""
    u = 2.0**-53

    def closed(make):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=peak)
        s = make(opt)
        s.last_epoch = t
        return s._get_closed_form_lr()[0]

    assert fo.constant(peak)(t) == peak
    assert fo.step_decay(peak, size, gamma)(t) == closed(lambda o: torch.optim.lr_scheduler.StepLR(o, size, gamma))
    lin = fo.linear_warmup(peak, total, f0)
    if f0 > 0:  # torch's LinearLR refuses start_factor 0
        assert lin(t) == closed(lambda o: torch.optim.lr_scheduler.LinearLR(o, f0, 1.0, total))
    else:
        assert lin(t) == peak * (min(total, t) / total)
    assert lin(t) <= lin(t + 1) * (1 + 4 * u)  # non-decreasing up to rounding (3 roundings)
    cos0 = fo.cosine(peak, total, final)
    if t <= total:  # torch's closed form is periodic past T_max; fzero holds at `final`
        assert cos0(t) == closed(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, total, final))
    else:
        assert cos0(t) == cos0(total)
    # ends: |cos(0) - peak| and |cos(T) - final|: a subtraction, a multiply, a divide by 2 (exact)
    # and an add, each relative error <= u, on values <= peak.
    assert abs(cos0(0) - peak) <= 4 * u * peak and abs(cos0(total + t) - final) <= 4 * u * peak
    cw = fo.cosine(peak, total, final, warmup_steps=warm)
    assert cw(t) == (peak * t / warm if t < warm else cos0(t - warm))


# ---------------------------------------------------------------------------------------------
# LAMB: exact per-leaf norms; a per-leaf reference with float32 norms; a derived bound.

U32, U64 = 2.0**-24, 2.0**-53


def gamma(n, u):
    return n * u / (1 - n * u)


def lamb_reference(p, g, m, v, step, lr, beta1, beta2, eps, wd):
    """One LAMB step of one whole leaf, the textbook way: float32 norms `sqrt(sum(x * x))`.
    Returns (p, m, v, r, rho): the new param and moments, the direction and the trust ratio."""
    m, v = m.clone(), v.clone()
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    denom = (v.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
    r = (m / (1 - beta1**step)).div_(denom)
    if wd != 0:
        r.add_(p, alpha=wd)
    pn, rn = float(torch.sqrt(torch.sum(p * p))), float(torch.sqrt(torch.sum(r * r)))
    ratio = pn / rn if pn > 0 and rn > 0 else 1.0
    new = p.add(r, alpha=-(lr * ratio))
    return new, m, v, r, ratio


# The bounds below are evaluated in float64 by formulas whose every subtraction is of a quantity
# below 1e-3 from 1 (so its relative error does not grow); along any path at most 40 roundings,
# the float64 difference of two float32s included: EVAL = 1 + gamma_40(u64) covers them all.
EVAL = 1 + gamma(40, U64)


def norm_error(t, u):
    r"""The largest |e| with sqrt(s (1 + t')) (1 + d) = sqrt(s) (1 + e), |t'| <= t, |d| <= u (a
    sum with relative error t, then a sqrt rounded with unit u): the larger of the upper side
    sqrt(1 + t)(1 + u) - 1 and the lower side 1 - sqrt(1 - t)(1 - u) (the lower is the larger,
    by about t^2/4 - t u, once t > 4u), written without cancellation."""
    upper = t / (math.sqrt(1 + t) + 1) * (1 + u) + u
    lower = t / (1 + math.sqrt(1 - t)) * (1 - u) + u
    return max(upper, lower)


def ratio_error(e):
    r"""The largest |(1 + e1)/(1 + e2)(1 + d) - 1|, |e1|, |e2| <= e, |d| <= u64 (a float64
    division of two norms with relative errors e): (1 + e)/(1 - e)(1 + u64) - 1, which is
    at least the lower side 1 - (1 - e)/(1 + e)(1 - u64) (x(1 + u) + (1 - u)/x >= 2 for x >= 1),
    written without cancellation."""
    return (2 * e + U64 * (1 + e)) / (1 - e)


def lamb_rho_bound(n, rho_fz):
    r"""A bound on |rho_fz - rho_ref| for a leaf of n elements (no underflow: test data N(0, 1)).

    Reference: `fl32(sum fl32(x_i^2))` in any order is sum x^2 (1 + t), |t| <= gamma_n(u32) (a
    square and at most n - 1 additions of non-negative terms per x_i), then a float32 sqrt:
    |e| <= e32 = norm_error(gamma_n(u32), u32). fzero: the correctly rounded float64 sum
    (`exact.bins_to_sums`), a float64 sqrt: |e| <= e64 = norm_error(u64, u64). Each ratio:
    relative error E = ratio_error(e) against the exact rho; rho <= rho_fz / (1 - E64), so
    |rho_fz - rho_ref| <= rho (E32 + E64) <= rho_fz (E32 + E64) / (1 - E64)."""
    big, small = ratio_error(norm_error(gamma(n, U32), U32)), ratio_error(norm_error(U64, U64))
    return rho_fz * (big + small) / (1 - small) * EVAL


def lamb_update_bound(p_fz, p_ref, r, lr, rho_fz, drho):
    r"""A float64 bound on |p_fz - p_ref| per element, both `p + a r` in float32 from the same
    float32 p and r, a = -(lr rho) rounded to float64 (Python) then to float32 (torch's scalar
    alpha), rho_fz and rho_ref = rho_fz +- drho (drho >= |rho_fz - rho_ref|); no underflow.

    Rounding is not Lipschitz: rho_fz and rho_ref as close as one likes can give alphas one
    float32 ulp apart, so the alphas' rounding is an absolute term, not a factor on drho.
    With u = u32 and |fl(x) - x| <= u |x|, |fl(x) - x| <= u |fl(x)| (round to nearest):

    - |a - lr rho| <= |a - fl64(lr rho)| + |fl64(lr rho) - lr rho| <= (u + u64 (1 + u)) |a|, so
      |a_fz - a_ref| <= lr drho + (u + u64 (1 + u)) (|a_fz| + |a_ref|);
    - the product, if not fused: |fl(a r) - a r| <= u |a r|; the sum: |p_new - S| <= u |p_new|
      for S = p + fl(a r) (or p + a r, fused);
    - so |p_fz - p_ref| <= |a_fz - a_ref| |r| + u |r| (|a_fz| + |a_ref|) + u (|p_fz| + |p_ref|)
      <= (lr drho + (2u + 2 u64) A) |r| + u (|p_fz| + |p_ref|), with
      |a_fz| + |a_ref| <= A = lr (2 rho_fz + drho)(1 + 2u) (|a| <= lr rho (1 + u64)(1 + u)).

    Where p and a r cancel, |p_fz| + |p_ref| is small and the A term is what holds the bound
    (`test_lamb_update_bound_where_update_cancels`)."""
    big_a = lr * (2 * rho_fz + drho) * (1 + 2 * U32)
    r64 = r.double().abs()
    return ((lr * drho + (2 * U32 + 2 * U64) * big_a) * r64 + U32 * (p_fz.double().abs() + p_ref.double().abs())) * EVAL


@examples(60)
@given(prob=problems(), hp=st.fixed_dictionaries(dict(
    lr=st.sampled_from([1e-3, 0.1, 0.37]),
    betas=st.sampled_from([(0.9, 0.999), (0.5, 0.9)]),
    eps=st.sampled_from([1e-6, 1e-3]),
    weight_decay=st.sampled_from([0.0, 0.01, 0.3]),
)))
def test_lamb_within_derived_bound_of_reference(prob, hp):
    """Each step starts the reference from fzero's state; moments and steps must be bitwise
    equal (same element-wise ops), the reference's rho within `lamb_rho_bound` of fzero's
    (`exact_ratio`: from correctly rounded sums, as `exact.bins_to_sums` gives them), params
    within `lamb_update_bound`, and every used leaf with lr >= 2 u32 must move.

    Why it must move: if fl(p_i + a r_i) = p_i for every i, then |a r_i| <= u |p_i| / (1 - u)
    (a float32 x absorbs d only if |d| <= ulp(x)/2 <= u |x|, x normal; an unfused product is at
    least |a r_i|(1 - u)); summing squares, |a| ||r|| <= u ||p|| / (1 - u), |a| <= rho u / (1 - u),
    while |a| >= lr rho_fz (1 - u64)(1 - u) >= lr rho (1 - E64)(1 - u64)(1 - u): so lr < 2u."""
    params, grads = _data(prob)
    fz = FzeroRun(fo.lamb(**hp), prob, params)
    beta1, beta2 = hp["betas"]
    for step, (g, used) in enumerate(zip(grads, prob["used"])):
        before = [(fz.leaf(i).clone(), None if ls.group.frozen else (fz.leaf(i, "exp_avg").clone(), fz.leaf(i, "exp_avg_sq").clone(), float(fz.leaf_state(i, "step"))))
                  for i, ls in enumerate(fz.layout.leaves)]
        fz.step(step, g, used)
        for i, ls in enumerate(fz.layout.leaves):
            p0, st0 = before[i]
            if ls.group.frozen or not used[i]:
                assert torch.equal(fz.leaf(i), p0)
                continue
            m0, v0, t0 = st0
            lr = hp["lr"] * ls.group.lr_scale
            wd = hp["weight_decay"] if ls.group.weight_decay else 0.0
            p_ref, m_ref, v_ref, r, rho_ref = lamb_reference(p0, g[i], m0, v0, t0 + 1, lr, beta1, beta2, hp["eps"], wd)
            assert torch.equal(fz.leaf(i, "exp_avg"), m_ref) and torch.equal(fz.leaf(i, "exp_avg_sq"), v_ref)
            assert float(fz.leaf_state(i, "step")) == t0 + 1
            if p0.numel() == 0:
                continue
            p_fz = fz.leaf(i)
            rho_fz = exact_ratio(p0, r)
            drho = lamb_rho_bound(p0.numel(), rho_fz)
            assert abs(Fraction(rho_fz) - Fraction(rho_ref)) <= drho, f"leaf {i}: rho"
            bound = lamb_update_bound(p_fz, p_ref, r, lr, rho_fz, drho)
            assert ((p_fz.double() - p_ref.double()).abs() <= bound).all(), f"leaf {i}"
            if lr >= 2 * U32 and p0.any() and r.any():
                assert not torch.equal(p_fz, p0), f"leaf {i}: lr {lr} but the update left it unchanged"
        fz.check_padding()


def test_lamb_update_bound_where_update_cancels():
    """`lamb_update_bound` where it is tight: p + a_ref r = 0 exactly, and lr rho_fz, lr rho_ref
    straddle the midpoint of two float32s (0.75 and 0.75 + 2^-24) one float64 ulp either side,
    so the alphas differ by a float32 ulp while drho is 2^-52: p_ref = 0, p_fz = -2^-24 r. A
    bound that scales drho by the alphas' rounding instead of adding it, lr drho (1 + u)^2 |r|
    + u (|p_fz| + |p_ref|), is about 2^-48 |r| here and fails."""
    lr, mid = 1.0, 0.75 + 2.0**-25
    rho_ref, rho_fz = math.nextafter(mid, 0.0), math.nextafter(mid, 1.0)
    r = torch.tensor([1.0, -2.0, 0.5, 2.0**-10, -(2.0**20)])  # powers of two: every a r exact
    p = 0.75 * r
    p_ref, p_fz = p.add(r, alpha=-(lr * rho_ref)), p.add(r, alpha=-(lr * rho_fz))
    assert torch.equal(p_ref, torch.zeros_like(p)) and torch.equal(p_fz, -(2.0**-24) * r)  # the case is the one meant
    bound = lamb_update_bound(p_fz, p_ref, r, lr, rho_fz, rho_fz - rho_ref)
    assert ((p_fz.double() - p_ref.double()).abs() <= bound).all()


def exact_ratio(p, r):
    pn = math.sqrt(math.fsum(x * x for x in p.double().flatten().tolist()))
    rn = math.sqrt(math.fsum(x * x for x in r.double().flatten().tolist()))
    return pn / rn if pn > 0 and rn > 0 else 1.0


@examples(40)
@given(prob=problems(), other=st.integers(1, 8), align=st.sampled_from([1, 3, 8]))
def test_lamb_same_bits_for_every_world_size(prob, other, align):
    """LAMB's norms are exact sums, so N and the shard cuts do not change a single bit."""
    params, grads = _data(prob)
    runs = [FzeroRun(fo.lamb(0.1, weight_decay=0.01), prob, params),
            FzeroRun(fo.lamb(0.1, weight_decay=0.01), {**prob, "world": other, "align": align}, params)]
    for step, (g, used) in enumerate(zip(grads, prob["used"])):
        for run in runs:
            run.step(step, g, used)
        for i in range(len(params)):
            assert torch.equal(runs[0].leaf(i), runs[1].leaf(i))
            if not runs[0].layout.leaves[i].group.frozen:
                assert torch.equal(runs[0].leaf(i, "exp_avg_sq"), runs[1].leaf(i, "exp_avg_sq"))


@examples(60)
@given(
    values=st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=0, max_size=40),
    cuts=st.lists(st.integers(0, 40), max_size=4),
)
def test_exact_square_sums(values, cuts):
    """Bins summed over any cut of a leaf give the correctly rounded float64 of the exact sum of
    squares (math.fsum of exact float64 squares), whatever the magnitudes (subnormal to max)."""
    x = torch.tensor(values, dtype=torch.float32)
    bounds = sorted({0, len(values), *[min(c, len(values)) for c in cuts]})
    total = torch.zeros(exact.BINS, 1, dtype=torch.float64)
    for a, b in reversed(list(zip(bounds, bounds[1:]))):  # any order: the bins are exact
        total = total + exact.square_bins(x[a:b], torch.zeros(b - a, dtype=torch.long), 1)
    want = math.fsum(float(v) ** 2 for v in x.tolist())
    assert exact.bins_to_sums(total) == [want]


# ---------------------------------------------------------------------------------------------
# Errors.


def test_errors_name_the_problem():
    with pytest.raises(fo.OptimizerError, match="lr"):
        fo.sgd(-0.1)
    with pytest.raises(fo.OptimizerError, match=r"betas\[1\]"):
        fo.adam(1e-3, betas=(0.9, 1.0))
    with pytest.raises(fo.OptimizerError, match="Nesterov"):
        fo.sgd(0.1, nesterov=True)
    with pytest.raises(fo.OptimizerError, match="step 1"):
        fo.as_schedule(lambda t: 0.1 - t)(1)
    with pytest.raises(fo.OptimizerError, match="2 values but step 2"):
        fo.sequence([0.1, 0.2])(2)
    opt = fo.adamw(1e-3)
    state = opt.init(torch.zeros(4), 1)
    ctx = fo.UpdateContext(0, ParamGroup(), (L.Segment(0, 0, 0, 4),), (0,), (True,))
    with pytest.raises(fo.OptimizerError, match=r"\[3\].*\[4\]"):
        opt.update(torch.zeros(3), state, torch.zeros(4), ctx)
    with pytest.raises(fo.OptimizerError, match="exp_avg"):
        opt.update(torch.zeros(5), state, torch.zeros(5), ctx)
    with pytest.raises(fo.OptimizerError, match="float64"):
        fo.lamb().init(torch.zeros(3, dtype=torch.float64), 1)


GROWING = {  # lr 1, 1e20, 1e40 at steps 0, 1, 2: the third lr is a finite Python float past float32's range
    "sgd": lambda lr: fo.sgd(lr, momentum=0.5, weight_decay=0.01),
    "adam": lambda lr: fo.adam(lr, weight_decay=0.01),
    "adamw": lambda lr: fo.adamw(lr),
    "lamb": lambda lr: fo.lamb(lr, weight_decay=0.01),
    "adafactor": lambda lr: fo.adafactor(lr),
}


def _steps(make, params, steps, stage=1, n=2, groups=(), donate=False, scale=1e-25):
    """On SimMesh(n) at `stage`: per rank, `(gathered params after steps - 1 steps, what the last
    step raised (or None), gathered params after it)`; a loss whose gradients are `scale` times
    1 to 3 (tiny by default: the params stay finite under a growing lr)."""
    mesh = fzero.SimMesh(n)

    def rank_fn(x):
        state = fzero.init(params, make(), stage=stage, mesh=mesh, units=lambda p: p, groups=groups)
        step = fzero.train_step(lambda p, x: sum((v.float() * x[: v.numel()].reshape(v.shape) * scale).sum()
                                                 for v in p.values()), donate=donate)
        for _ in range(steps - 1):
            state, _ = step(state, x)
        before, error = fzero.gather(state), None
        try:
            state, _ = step(state, x)
        except fo.OptimizerError as e:
            error = str(e)
        return before, error, fzero.gather(state)

    return mesh.run(rank_fn, [(torch.linspace(1.0, 2.0 + r, 8),) for r in range(n)])


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("kind", sorted(GROWING))
def test_an_lr_past_the_params_dtype_is_an_optimizer_error_before_any_write(kind, donate):
    """A `step_decay` schedule with gamma 1e20 reaches 1e40 at step 2: finite as a Python float,
    past float32's largest value. Before: torch's "value cannot be converted to type float without
    overflow" from inside the update, or inf params (found in review). Now `OptimizerError` on
    every rank naming the optimizer, the value, the step and the group, and the state as it was."""
    params = {"a": torch.ones(5), "b": torch.ones(3)}
    for before, error, after in _steps(lambda: GROWING[kind](fo.step_decay(1.0, 1, 1e20)), params, 3, donate=donate):
        assert error is not None and error.startswith(f"{kind}: lr * lr_scale is 1e+40 at step 2 (parameter group "
                                                      f"'default', lr_scale 1.0), past the range of the params' dtype "
                                                      f"float32 (largest 3.4028234663852886e+38)"), error
        assert all(torch.equal(before[k], after[k]) for k in params)


@pytest.mark.parametrize("make, match", [
    (lambda: fo.sgd(0.1, weight_decay=1e39), r"sgd: weight_decay is 1e\+39 at step 0"),
    (lambda: fo.sgd(0.1, momentum=0.5, dampening=1e39), r"sgd: 1 - dampening is -1e\+39 at step 0"),
    (lambda: fo.adam(1e-3, eps=1e39), r"adam: eps is 1e\+39"),
    (lambda: fo.adam(1e33, betas=(0.999999, 0.999)),
     r"adam: the step size lr \* lr_scale / \(1 - beta1\*\*t\) at step count t = 1 is 9\.99999\d*e\+38"),
    (lambda: fo.adamw(1e20, weight_decay=1e20), r"adamw: 1 - lr \* lr_scale \* weight_decay is -1e\+40"),
    (lambda: fo.adafactor(1e-2, eps=(1e20, 1e-3)), r"adafactor: eps\[0\]\*\*2 is 1e\+40"),
])
def test_hyper_parameters_past_float32_are_optimizer_errors(make, match):
    """Each value an update hands torch's kernels must lie in the params' dtype's range
    (`base.check_fits`): before, a weight decay, `1 - dampening`, a bias-corrected step size or
    AdamW's decay factor past float32's raised torch's overflow error mid-update, and an eps past
    it became inf and silently stopped every update. Now `OptimizerError`, params as they were."""
    (before, error, after), = _steps(make, {"a": torch.ones(5)}, 1, stage=0, n=1, scale=1.0)
    assert error is not None and re.search(match, error), error
    assert torch.equal(after["a"], before["a"])


def test_the_range_is_the_params_dtypes():
    """lr 1e5 is past float16's 65504 (before: torch's "value cannot be converted to type at::Half
    without overflow" mid-update) but within bfloat16's range; lr 1e39 is past float32's but a
    float64 param takes it."""
    def one(make, dtype):
        return _steps(make, {"a": torch.ones(5, dtype=dtype)}, 1, stage=0, n=1, scale=1.0)[0]

    before, error, after = one(lambda: fo.sgd(1e5), torch.float16)
    assert error is not None and re.search(r"sgd: lr \* lr_scale is 100000.0 .* dtype float16 \(largest 65504.0\)",
                                           error), error
    assert torch.equal(after["a"], before["a"])
    for make, dtype in [(lambda: fo.adam(1e5), torch.bfloat16), (lambda: fo.sgd(1e39), torch.float64)]:
        before, error, after = one(make, dtype)
        assert error is None and not torch.equal(after["a"], before["a"]) and torch.isfinite(after["a"]).all()


def test_an_lr_scale_past_float32_names_the_group():
    """`lr(step) * lr_scale` is what the kernels take: lr 1e38 fits, lr_scale 10 makes it 1e39."""
    groups = (fzero.ParamGroup("head", match=lambda p: p == "b", lr_scale=10.0),)
    params = {"a": torch.ones(5), "b": torch.ones(3)}
    for before, error, after in _steps(lambda: fo.sgd(1e38), params, 1, groups=groups):
        assert error is not None and error.startswith("sgd: lr * lr_scale is 1e+39 at step 0 (parameter group 'head', "
                                                      "lr_scale 10.0)"), error
        assert all(torch.equal(before[k], after[k]) for k in before)


def test_step_decay_past_floats_range_is_an_optimizer_error():
    """`gamma ** k` past float's range raises Python's OverflowError; the schedule's value is inf
    there, which `as_schedule` refuses naming the step (before: OverflowError from the update)."""
    assert fo.step_decay(0.0, 1, 10.0)(400) == 0.0
    with pytest.raises(fo.OptimizerError, match="lr at step 400 must be finite, got inf"):
        fo.sgd(fo.step_decay(1.0, 1, 10.0)).lr(400)


def test_schedules_and_hyper_parameters_take_numpy_scalars():
    """Any `numbers.Integral` where an int is wanted, any `numbers.Real` where a float is, as
    Python ints and floats (before: numpy's int64 step counts and float32 values were refused);
    bools and non-finite values are refused as before."""
    np = pytest.importorskip("numpy")
    assert fo.cosine(np.float32(0.5), np.int64(100), warmup_steps=np.int32(10))(50) == fo.cosine(
        float(np.float32(0.5)), 100, warmup_steps=10)(50)
    assert fo.linear_warmup(np.float64(1.0), np.int16(4), np.float32(0.25))(2) == fo.linear_warmup(1.0, 4, 0.25)(2)
    assert fo.step_decay(0.1, np.uint8(3), np.float32(0.5))(7) == fo.step_decay(0.1, 3, float(np.float32(0.5)))(7)
    assert type(fo.cosine(0.1, np.int64(10))(3)) is float
    assert fo.sgd(np.float32(0.5), momentum=np.float64(0.9)).lr(0) == 0.5
    assert fo.sequence([np.float32(0.5), np.int64(1)])(1) == 1.0
    fo.adafactor(np.float32(1e-2), beta2_decay=np.float32(-0.8), d=np.int64(1))
    for bad, match in [(True, r"decay_steps must be an int >= 1, got True"),
                       (np.True_, r"decay_steps must be an int >= 1, got (np\.)?True"),
                       (np.float64(3.0), r"decay_steps must be an int >= 1, got (np\.float64\()?3\.0")]:
        with pytest.raises(fo.OptimizerError, match=match):
            fo.cosine(0.1, bad)
    with pytest.raises(fo.OptimizerError, match="lr must be finite, got inf"):
        fo.sgd(np.float32("inf"))
    with pytest.raises(fo.OptimizerError, match=r"momentum must be a finite float >= 0.0, got nan"):
        fo.sgd(0.1, momentum=np.float64("nan"))
    with pytest.raises(fo.OptimizerError, match="peak must be a Python float, got bool True"):
        fo.cosine(True, 10)
    with pytest.raises(fo.OptimizerError, match="beta2_decay must be a float"):
        fo.adafactor(beta2_decay=np.True_)



def test_a_numpy_float32_lr_is_read_as_its_python_float_which_torch_is_given_to_compare():
    """docs/bad-input.md, numpy scalars: fzero reads `np.float32(lr)` and `np.float32(wd)` as
    their Python floats, so its AdamW takes the bits of `torch.optim.AdamW(lr=float(lr),
    weight_decay=float(wd))`. (torch keeps the numpy scalar in its group, and under NumPy 2 its
    Python-side factors, `lr / bias_correction1` and `1 - lr * wd`, are then float32: other bits,
    1 ulp in some elements, found in review; so the comparison gives torch the floats.)"""
    np = pytest.importorskip("numpy")
    lr, wd = np.float32(0.01), np.float32(0.1)
    g = torch.Generator().manual_seed(3)
    p0, grads = torch.randn(2000, generator=g), [torch.randn(2000, generator=g) for _ in range(6)]
    ref = p0.clone().requires_grad_()
    torch_opt = torch.optim.AdamW([ref], lr=float(lr), weight_decay=float(wd), foreach=False)
    opt = fo.adamw(lr, weight_decay=wd, impl="single")
    p, s = p0.clone(), opt.init(p0, 1)
    ctx = fo.UpdateContext(0, ParamGroup(), (L.Segment(0, 0, 0, 2000),), (0,), (True,))
    for grad in grads:
        ref.grad = grad.clone()
        torch_opt.step()
        p, s = opt.update(grad, s, p, ctx)
        assert torch.equal(p, ref.detach())



def test_an_optimizer_of_another_state_form_put_in_mid_run_is_told_the_way_out():
    """README's `state.replace(info=...)` recipe with an optimizer whose state has another form
    (SGD's momentum switched on mid-run, as torch's `group["momentum"] = 0.9` does) is refused
    naming that its form cannot change and the way out, which runs as written (found in review of
    the optimizer surface: the words named neither)."""
    import dataclasses

    mesh = fzero.SimMesh(2)
    loss = lambda p, x: (p["w"] * x).sum() ** 2  # noqa: E731

    def rank_fn():
        state = fzero.init({"w": torch.linspace(-1.0, 1.0, 7)}, fo.sgd(0.01), stage=1, mesh=mesh)
        step = fzero.train_step(loss)
        state, _ = step(state, torch.ones(7))
        swapped = state.replace(info=dataclasses.replace(state.info, optimizer=fo.sgd(0.01, momentum=0.9)))
        with pytest.raises(fo.OptimizerError, match=re.escape(
                "must keep the form of its state: switching momentum on or off, amsgrad, or another algorithm cannot "
                "take the state over; start the new optimizer's state with fzero.init from fzero.gather(state)")):
            step(swapped, torch.ones(7))
        fresh = fzero.init(fzero.gather(state), fo.sgd(0.01, momentum=0.9), stage=1, mesh=mesh)
        return int(step(fresh, torch.ones(7))[0].step)

    assert mesh.run(rank_fn) == [1, 1]

@pytest.mark.parametrize("factory", ["sgd", "adam", "adamw"])
@pytest.mark.parametrize("key, value, says", [
    ("foreach", True, "impl='foreach'"), ("foreach", False, "impl='single'"), ("fused", True, "impl='fused'"),
    ("differentiable", True, "engine='func', donate=False"), ("capturable", True, "CUDA-graph"),
    ("decoupled_weight_decay", True, "fzero.optim.adamw")])
def test_torch_optims_keywords_are_told_fzeros_spelling(factory, key, value, says):
    """docs/bad-input.md row 272: a keyword of torch.optim's that fzero spells otherwise is a
    `TypeError` naming the factory, the keyword and fzero's spelling (before: Python's bare
    "unexpected keyword argument"; found in review of a user porting a torch script). Other
    unknown keywords keep Python's own error."""
    with pytest.raises(TypeError, match=rf"fzero.optim.{factory}\(\) takes no {key}= \(a torch.optim keyword, "
                                         rf"got {key}={value}\): .*{re.escape(says)}"):
        FACTORIES[factory](0.1, **{key: value})
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        FACTORIES[factory](0.1, bogus=1)
    assert FACTORIES[factory](0.1, impl="single").lr(0) == 0.1

def test_frozen_group_is_an_error_and_spec():
    opt = fo.adam(1e-3, amsgrad=True)
    p = torch.ones(3)
    state = opt.init(p, 2)
    assert opt.spec(state) == fo.AmsgradState("leaf", "shard", "shard", "shard")
    ctx = fo.UpdateContext(0, ParamGroup("fz", frozen=True), (L.Segment(0, 0, 0, 3),), (0, 1), (True, True))
    for update in (opt.update, opt.update_):
        with pytest.raises(fo.OptimizerError, match="'fz' is frozen"):
            update(torch.ones(3), state, p, ctx)
    assert fo.sgd(0.1).spec(fo.sgd(0.1).init(p, 1)) == fo.EmptyState()


def test_impl_choice_and_its_errors():
    """The default rule (`resolve_impl`), unknown names, and where "fused" is refused."""
    with pytest.raises(fo.OptimizerError, match="impl must be one of 'fused', 'foreach', 'single'.*got 'fast'"):
        fo.adamw(impl="fast")
    with pytest.raises(fo.OptimizerError, match="sgd: impl must be one of"):
        fo.sgd(0.1, impl="Fused")
    yes, no = (lambda: True), (lambda: False)
    cpu = torch.zeros(5)
    assert fo.resolve_impl("x", None, cpu, yes) == ("foreach", False)  # the default is fused on CUDA only
    assert fo.resolve_impl("x", "fused", cpu, no) == ("fused", True)  # placement-dependent: per leaf
    assert fo.resolve_impl("x", "single", cpu, no) == ("single", False)
    if torch.cuda.is_available():
        gpu = torch.zeros(5, device="cuda")
        assert fo.resolve_impl("x", None, gpu, yes) == ("fused", False)
        assert fo.resolve_impl("x", None, gpu, no) == ("foreach", False)
        assert fo.resolve_impl("x", "fused", gpu, yes) == ("fused", False)
    assert fused.elementwise(("any",), None, 4, (3,), torch.float32, cpu.device) is False  # CPU: never probed
    with pytest.raises(fo.OptimizerError, match="floating-point shard"):
        fo.resolve_impl("x", "fused", torch.zeros(5, dtype=torch.int32), no)
    seg = (L.Segment(0, 0, 0, 3), L.Segment(1, 0, 3, 5))
    ctx = fo.UpdateContext(0, ParamGroup(), seg, (0, 1), (True, True), leaf_numels=(3, 2))
    fo.check_placement("x", ctx, [cpu])
    with pytest.raises(fo.OptimizerError, match="needs ctx.leaf_numels"):
        fo.check_placement("x", ctx._replace(leaf_numels=()), [cpu])
    cut = ctx._replace(segments=(L.Segment(0, 0, 0, 3), L.Segment(1, 0, 3, 4)), leaf_numels=(3, 4))
    with pytest.raises(fo.OptimizerError, match=r"leaf 1 \(4 elements\) is cut.*\[0, 1\)"):
        fo.check_placement("x", cut, [cpu])
    fo.check_placement("x", cut._replace(used=(True, False)), [cpu])  # an unused leaf is not touched
    if torch.cuda.is_available():  # a whole leaf of 4 at element 3: torch's own tensor would be aligned
        whole = fo.UpdateContext(0, ParamGroup(), (L.Segment(0, 0, 0, 3), L.Segment(1, 0, 3, 7)), (0, 1), (True, True),
                                 leaf_numels=(3, 4))
        with pytest.raises(fo.OptimizerError, match="not at a 16-byte aligned address"):
            fo.check_placement("x", whole, [torch.zeros(8, device="cuda")])


def test_fused_cpu_refuses_cut_leaves():
    """N = 2 cuts a leaf of 7: "fused" on CPU raises, naming the leaf; "foreach" runs."""
    prob = dict(kinds=["a", "a"], shapes=[(7,), (3,)], used=[[True, True]], world=2, align=1, scale=1.0, seed=0)
    params, grads = _data(prob)
    with pytest.raises(fo.OptimizerError, match="is cut by the shard"):
        FzeroRun(fo.adamw(impl="fused"), prob, params).step(0, grads[0], prob["used"][0])
    FzeroRun(fo.adamw(impl="foreach"), prob, params).step(0, grads[0], prob["used"][0])


WORST_HP = {  # every temporary torch's code makes: maximize, (L2) weight decay, Nesterov / amsgrad
    "sgd": dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.1, maximize=True),
    "adam": dict(lr=0.1, weight_decay=0.1, amsgrad=True, maximize=True),
    "adamw": dict(lr=0.1, weight_decay=0.1, amsgrad=True, maximize=True),
}


@pytest.mark.parametrize("impl", fo.IMPLS)
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_in_place_census(kind, impl):
    """`update_` writes param and the "shard" fields in place and allocates at most one
    shard-sized buffer ("fused": none); `update` adds one clone of param and of each "shard"
    field. Counted with `LiveStorages` (new storages made by aten ops, live at once), over two
    steps whose step counts differ between leaves (several pieces, first and later momentum)."""
    sizes, used = (37, 0, 64, 5, 19), [(True, True, False, True, True), (True,) * 5]
    segs, at = [], 0
    for leaf, n in enumerate(sizes):
        segs.append(L.Segment(leaf, 0, at, at + n))
        at += n
    S = at + 3  # padding
    gen = torch.Generator().manual_seed(0)
    opt = FACTORIES[kind](**WORST_HP[kind], impl=impl)
    p = torch.randn(S, generator=gen)
    state = opt.init(p, len(sizes))
    nshard = sum(k == "shard" for k in opt.spec(state))
    # small: the new "leaf" field [L] and one 0-d float32 step count per piece ("fused")
    small = 4 * len(sizes) + 4 * len(segs)
    work = 0 if impl == "fused" else 4 * S
    # the kernel probes a fused impl runs once per process and device (`fused.updates_every_element`,
    # 96-element tensors, cached) before the census: what is counted is the update's own (found on
    # the GPU machine, where this test ran first in its xdist worker)
    ctx0 = fo.UpdateContext(0, ParamGroup(), tuple(segs), tuple(range(len(sizes))), used[0], leaf_numels=sizes)
    opt.update(torch.zeros(S), opt.init(torch.zeros(S), len(sizes)), torch.zeros(S), ctx0)
    for step, u in enumerate(used):
        g = torch.randn(S, generator=gen)
        ctx = fo.UpdateContext(step, ParamGroup(), tuple(segs), tuple(range(len(sizes))), u, leaf_numels=sizes)
        with LiveStorages() as pure_census:
            opt.update(g, state, p, ctx)
        assert pure_census.peak <= 4 * S * (1 + nshard) + work + small, pure_census.peak
        ptr, shard_fields = p.data_ptr(), [t for t, k in zip(state, opt.spec(state)) if k == "shard"]
        with LiveStorages() as census:
            state = opt.update_(g, state, p, ctx)
        assert census.peak <= work + small, (census.peak, work, small)
        assert p.data_ptr() == ptr
        assert all(a is b for a, b in zip([t for t, k in zip(state, opt.spec(state)) if k == "shard"], shard_fields))


class _Drawn:
    """`data` for `_against_torch` whose draw returns fixed hyper-parameters."""

    def __init__(self, hp: dict) -> None:
        self.hp = hp

    def draw(self, strategy):
        return self.hp


@pytest.mark.parametrize("impl", ["single", "foreach"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_cpu_blocks_keep_each_pieces_own_step(kind, impl):
    """Two 10-element leaves, the first unused at the first step: from then on their step counts
    differ (SGD: one takes its first momentum update while the other does not), and blocks of 7
    elements per thread hold pieces of both. Each piece keeps its own count: torch.optim's bits
    (a block that gave its pieces one key failed here, and not always in the drawn test above)."""
    prob = dict(kinds=["a", "a"], shapes=[(10,), (10,)], used=[[False, True], [True, True], [True, True]],
                world=1, align=1, scale=1.0, seed=0)
    hp = (dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=False, weight_decay=0.0, maximize=False)
          if kind == "sgd" else dict(lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.1, amsgrad=False,
                                     maximize=False))
    with mock.patch.object(optim_base, "CPU_BLOCK", max(1, 7 // torch.get_num_threads())):
        _against_torch(kind, "cpu", prob, impl, _Drawn(hp))


def test_cpu_blocks_leave_half_precision_in_one_call():
    """bfloat16 / float16 shards are not cut into blocks: one call, whatever the block size
    (torch's CPU `add_(alpha=)` rounds them by position; fzero's adds go through `optim.ops`,
    which does not, but half-precision blocks are not held to bitwise equality by a test yet)."""
    calls = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        xs = [torch.zeros(50, dtype=dtype)]
        with mock.patch.object(optim_base, "CPU_BLOCK", 1):
            optim_base.in_blocks(lambda a, keys: calls.append((dtype, a[0].numel())), "foreach", [xs], [0.0])
    per = torch.get_num_threads()
    assert calls[:2] == [(torch.bfloat16, 50), (torch.float16, 50)]
    assert [n for d, n in calls[2:]] == [per] * (50 // per) + ([50 % per] if 50 % per else [])


@pytest.mark.parametrize("impl", ["single", "foreach"])
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_cpu_blocks_run_the_kernel_per_block(kind, impl):
    """A 1000-element shard of three leaves, two steps, with blocks of 7 elements per thread:
    the kernel runs once per block, never over more than a block, and params and state have the
    bits of one call over the whole shard."""
    sizes, starts, S = (300, 1, 699), (0, 300, 301), 1000
    segs = tuple(L.Segment(leaf, 0, a, a + n) for leaf, (a, n) in enumerate(zip(starts, sizes)))
    gen = torch.Generator().manual_seed(3)
    p, g = torch.randn(S, generator=gen), torch.randn(S, generator=gen)
    kernels = importlib.import_module(f"fzero._src.optim.{'sgd' if kind == 'sgd' else 'adam'}").KERNELS
    real, results, calls = kernels[impl], [], []

    def spy(params, *args, **hyper):
        calls.append(sum(t.numel() for t in params))
        real(params, *args, **hyper)

    for block in (1 << 40, 7):
        opt = FACTORIES[kind](**WORST_HP[kind], impl=impl)
        q, state = p.clone(), opt.init(p, len(sizes))
        calls.clear()
        with mock.patch.object(optim_base, "CPU_BLOCK", block), mock.patch.dict(kernels, {impl: spy}):
            for step in range(2):
                ctx = fo.UpdateContext(step, ParamGroup(), segs, (0, 1, 2), (True,) * 3, leaf_numels=sizes)
                state = opt.update_(g, state, q, ctx)
        results.append((q, state, list(calls)))
    (q0, s0, c0), (q1, s1, c1) = results
    per = 7 * torch.get_num_threads()
    assert c0 == [S, S] and len(c1) == 2 * math.ceil(S / per) and max(c1) <= per, (c0, c1)
    assert torch.equal(q0, q1)
    assert all(torch.equal(a, b) for a, b in zip(s0, s1))


@pytest.mark.parametrize("impl", ["single", "foreach", "fused"])
def test_an_adam_step_count_past_2_24_stays_as_torchs_float32_count(impl):
    """torch's float32 `state["step"]` stays at 2**24 (2**24 + 1 rounds to it); the single and
    foreach kernels read 2**24 + 1 for the bias correction, 5 elements of 1000 apart from torch
    with betas near 1 (found in review). The count is now rounded as torch's tensor holds it."""
    from fzero._src.layout import Segment

    n, s = 1000, float(2**24)
    g = torch.Generator().manual_seed(0)
    p0, grad = torch.randn(n, generator=g), torch.randn(n, generator=g)
    m0, v0 = torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.1
    kw = dict(lr=1e-3, betas=(0.9999999, 0.9999999))
    state = fo.AdamState(torch.tensor([s]), m0.clone(), v0.clone())
    ctx = fo.UpdateContext(0, ParamGroup(), (Segment(0, 0, 0, n),), (0,), (True,), leaf_numels=(n,))
    got, new = fo.adam(**kw, impl=impl).update(grad, state, p0, ctx)
    p = torch.nn.Parameter(p0.clone())
    p.grad = grad.clone()
    ref = torch.optim.Adam([p], **kw, foreach=impl == "foreach", fused=impl == "fused")
    ref.state[p] = {"step": torch.tensor(s), "exp_avg": m0.clone(), "exp_avg_sq": v0.clone()}
    ref.step()
    assert torch.equal(got, p.detach()) and float(new.step) == float(ref.state[p]["step"]) == s


def _torchs_fused_sgd_updates_every_element(dtype: torch.dtype) -> bool:
    """torch.optim.SGD(fused=True) on the CPU, lr 0.5, ones by ones: whether every element is 0.5."""
    p = torch.nn.Parameter(torch.ones(96, dtype=dtype))
    p.grad = torch.ones_like(p)
    torch.optim.SGD([p], lr=0.5, fused=True).step()
    return bool(torch.all(p.detach() == 0.5))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_fused_sgd_where_torchs_kernel_skips_elements_is_refused(dtype):
    """torch 2.13's CPU `_fused_sgd_` in bfloat16 / float16 leaves the elements of its vectorised
    body unchanged (found in review: of 32 elements none moves; torch.optim.SGD(fused=True) trains
    nothing there). `impl="fused"` calls that kernel, so where torch.optim's own fused step skips
    elements fzero refuses it, naming the way out, and leaves the params as they were; where it
    does not, fzero's fused step moves every element as torch's does."""
    params = {"a": torch.ones(5, dtype=dtype), "b": torch.ones(3, dtype=dtype)}
    (before, error, after), = _steps(lambda: fo.sgd(0.5, impl="fused"), params, 1, stage=0, n=1, scale=1.0)
    if _torchs_fused_sgd_updates_every_element(dtype):
        assert error is None
        assert all(bool(torch.all(after[k] != before[k])) for k in params)
    else:
        assert error is not None and re.search(
            rf"sgd: impl='fused' on {dtype} shards on cpu: .* leaves elements unchanged .* use impl='foreach'", error)
        assert all(torch.equal(after[k], before[k]) for k in params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torchs_cpu_fused_sgd_in_half_precision_is_the_case_refused(dtype):
    """The refusal above is not vacuous on the torch this suite runs: torch's CPU fused SGD in
    half precision skips elements (torch 2.11 and 2.13: this test passed under both). Should a torch fix it, this test fails
    and says so: the refusal then lifts by itself (the probe is per device and dtype)."""
    assert not _torchs_fused_sgd_updates_every_element(dtype), (
        f"torch {torch.__version__}'s CPU fused SGD now updates every {dtype} element: drop this test")


def test_init_state_given_a_leaf_count_says_leaf_shapes_are_shapes():
    """Found in review: `init_state(opt, p, 1)` raised Python's "'int' object is not iterable"."""
    p = torch.zeros(12)
    for bad in (1, [3], [(-1,)], [(True, 2)], [("4",)]):
        with pytest.raises(fo.OptimizerError, match=r"init_state: leaf_shapes must be one shape \(a tuple of ints "
                                                     r">= 0\) per leaf .*a leaf count is not one\); got "):
            fo.init_state(fo.adamw(1e-3), p, bad)
    assert len(fo.init_state(fo.adamw(1e-3), p, [torch.Size([4, 3])])) == 3
    import numpy as np
    rows = fo.init_state(fo.adafactor(1e-3), p, [(np.int64(4), 3)])
    assert fo.init_state(fo.adafactor(1e-3), p, [(4, 3)])._fields == rows._fields
    assert all(torch.equal(a, b) for a, b in zip(rows, fo.init_state(fo.adafactor(1e-3), p, [(4, 3)])))


def test_a_hyper_parameter_below_its_range_says_the_range_it_must_be_in():
    """Found in review: "[0.0, inf]" where inf is refused; a range closed at inf now reads as a
    bound, finite where inf is refused."""
    with pytest.raises(fo.OptimizerError, match=r"^lr must be a finite float >= 0.0, got -1.0$"):
        fo.sgd(-1.0)
    with pytest.raises(fo.OptimizerError, match=r"^eps must be a finite float >= 0.0, got -1.0$"):
        fo.adamw(1e-3, eps=-1.0)
    with pytest.raises(fo.OptimizerError, match=r"^d must be a float >= 0.0, got -1.0$"):  # inf: no clipping
        fo.adafactor(d=-1.0)
    with pytest.raises(fo.OptimizerError, match=r"^betas\[0\] must be in \[0.0, 1.0\), got 1.0$"):
        fo.adamw(1e-3, betas=(1.0, 0.9))


def test_a_tensor_lr_or_hyper_parameter_is_told_to_pass_a_float():
    """torch.optim takes a tensor lr; fzero reads it on the host as a number (found in review: the
    words gave no way out)."""
    import numpy as np

    for lr in (torch.tensor(0.1), np.array(0.1)):
        with pytest.raises(fo.OptimizerError, match=r"a tensor or array of one value: pass float\(lr\)"):
            fo.adamw(lr)
    with pytest.raises(fo.OptimizerError, match=r"eps must be a Python float, got Tensor .*; pass float\(...\) of it$"):
        fo.adamw(0.1, eps=torch.tensor(1e-8))
