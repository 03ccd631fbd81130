"""bfloat16 / float16 params without an fp32 master, on the CPU: every stage the same bits, and
torch.optim's bits outside torch's own kernel tails (`fzero._src.optim.ops`).

torch's CPU `add(x, y, alpha=a)` and `rsqrt` round an element of these dtypes one way in the
vectorised body of a call and another in its scalar tail (the last `n mod W` elements of a call
of `n`). fzero calls them on pieces that N and the stage cut differently, so before `ops` the
stages differed by 1-14 elements (found in review) under SGD, Adam's L2 weight decay, LAMB and
Adafactor. `ops` computes the body's formula at every element. AdamW (decoupled decay: a `mul`,
which rounds alike in body and tail) is checked too, as the README claims it.
"""

from __future__ import annotations

import functools

import pytest
import torch

import fzero
import fzero.optim as fo
from fzero._src.layout import ParamGroup
from fzero._src.optim import ops

from .stage_harness import full_opt_state
from .test_optim import FzeroRun, torch_optimizer

HALF = [torch.bfloat16, torch.float16]

# Leaves longer than a vector step, cut by every N below at other places than 32-element bounds;
# "d" in a group of its own (no weight decay, another lr) so that the run has two buckets.
SHAPES = {"a": (37, 5), "b": (100,), "c": (3, 33), "d": (70,), "e": ()}
GROUPS = (ParamGroup("nowd", match=lambda p: p == "d", weight_decay=False, lr_scale=0.5),)

# Each has an add with a scale (`ops.add` / `add_`; Adafactor an rsqrt too). Adam's eps is 1e-3: with
# float16's 1e-8 (below its smallest subnormal) a zero second moment divides by 0 at every stage.
OPTIMIZERS = {
    "sgd": lambda impl: fo.sgd(0.1, impl=impl),
    "sgd-wd": lambda impl: fo.sgd(0.1, weight_decay=0.01, impl=impl),
    "sgd-momentum": lambda impl: fo.sgd(0.1, momentum=0.9, dampening=0.1, weight_decay=0.01, impl=impl),
    "sgd-nesterov": lambda impl: fo.sgd(0.1, momentum=0.9, nesterov=True, weight_decay=0.01, maximize=True, impl=impl),
    "adam-l2": lambda impl: fo.adam(1e-2, eps=1e-3, weight_decay=0.1, impl=impl),
    "adam-l2-amsgrad": lambda impl: fo.adam(1e-2, eps=1e-3, weight_decay=0.1, amsgrad=True, maximize=True, impl=impl),
    # AdamW's decay multiplies p by 1 - lr * weight_decay = 0.99, which moves every bfloat16 element;
    # 0.999 (weight_decay=0.1) moves none (torch's bfloat16 `mul_` returns p), leaving the decay untested.
    "adamw": lambda impl: fo.adamw(1e-2, eps=1e-3, weight_decay=1.0, impl=impl),
    "adamw-amsgrad": lambda impl: fo.adamw(1e-2, eps=1e-3, weight_decay=1.0, amsgrad=True, maximize=True, impl=impl),
    "lamb": lambda impl: fo.lamb(1e-2, weight_decay=0.01),
    "adafactor": lambda impl: fo.adafactor(1e-2, weight_decay=0.01),
}
CASES = [(k, impl) for k in OPTIMIZERS
         for impl in (("single", "foreach") if k.startswith(("sgd", "adam")) else (None,))]


def _loss(params, batch):
    """Every leaf but "b" at the first step (`first`): from the second step on, "b" takes its
    first momentum update, or its first Adam step, while the others take later ones."""
    c, first = batch
    total = c[0] * 0.0
    for key, x in params.items():
        if key == "b" and first:
            continue
        x = x.reshape(-1).float()
        total = total + torch.tanh(x * c[0] + c[1]).square().mean() + (x * c[2]).sum() * 0.1
    return total


def _stage_run(make, dtype, n, stage, steps=3):
    """Per rank, after each of `steps` steps: `(gathered params, opt_state)` of fzero at `stage`
    on SimMesh(n), with the problem's half params, each rank its own batches."""
    g = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=g).to(dtype) for k, s in SHAPES.items()}
    batches = [[(torch.randn(3, generator=g), t == 0) for t in range(steps)] for _ in range(n)]
    mesh = fzero.SimMesh(n)

    def rank_fn(*mine):
        state = fzero.init(params, make(), stage=stage, mesh=mesh, groups=GROUPS)
        step = fzero.train_step(_loss)
        trace = []
        for c in mine:
            state, _ = step(state, c)
            trace.append((fzero.gather(state), state.opt_state))
        return trace

    return mesh.run(rank_fn, [tuple(b) for b in batches])


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("kind, impl", CASES)
def test_half_params_every_stage_the_same_bits(kind, impl, dtype):
    """Stages 1-3 equal stage 0, params and optimizer state, `torch.equal`, after every step, for
    N = 2, 3, 5 (the leaves straddle shard bounds at other places for each N); each rank of
    stage 0 equal to rank 0."""
    for n in (2, 3, 5):
        zero = _stage_run(lambda: OPTIMIZERS[kind](impl), dtype, n, 0)
        for stage in (1, 2, 3):
            other = _stage_run(lambda: OPTIMIZERS[kind](impl), dtype, n, stage)
            for t, (z_params, z_opt) in enumerate(zero[0]):
                for r in range(n):
                    for key in SHAPES:
                        where = f"N={n} stage {stage} rank {r} step {t} leaf {key!r}"
                        assert torch.equal(other[r][t][0][key], z_params[key]), where
                        assert torch.equal(zero[r][t][0][key], z_params[key]), where
                merged = full_opt_state([other[r][t][1] for r in range(n)], z_opt)
                for b, (mo, zo) in enumerate(zip(merged, z_opt)):
                    for k, (x, y) in enumerate(zip(mo or (), zo or ())):
                        assert torch.equal(x, y), f"N={n} stage {stage} step {t}: bucket {b} field {k}"


# ---------------------------------------------------------------------------------------------
# Against torch.optim's per-param calls, outside torch's tails.


@functools.cache
def vector_step(dtype: torch.dtype) -> int:
    """W of torch's CPU `add_(alpha=)` on `dtype`: a call of `n` elements (one thread: `n` below
    TensorIterator's grain of 32768) computes `[0, n - n mod W)` in its vectorised body and the
    rest in its scalar tail. Measured, not assumed (W follows the vector width torch's kernels
    were built for and the CPU runs, AVX2 or AVX512; 32 here): elements on which the body and
    the scalar path disagree (a call of 4096, a multiple of every W, is all body; a call of one
    element all tail) are laid side by side, and for each length `n` the first element computed
    as the tail computes it must be `n - n mod W` for one power of two W."""
    g = torch.Generator().manual_seed(0)
    x, y, a = torch.randn(4096, generator=g).to(dtype), torch.randn(4096, generator=g).to(dtype), 1.37
    body = x.clone().add_(y, alpha=a)
    scalar = torch.cat([x[i : i + 1].clone().add_(y[i : i + 1], alpha=a) for i in range(4096)])
    apart = body != scalar
    x, y, body = x[apart], y[apart], body[apart]
    assert x.numel() >= 300, "too few elements on which torch's body and tail disagree to measure W"
    first_tail = {}
    for n in range(1, 257):
        is_body = x[:n].clone().add_(y[:n], alpha=a) == body[:n]
        k = int(is_body.logical_not().nonzero()[0]) if not is_body.all() else n
        assert not is_body[k:].any(), f"{dtype}: torch's tail of a call of {n} is not its last elements"
        first_tail[n] = k
    steps = [w for w in (1, 2, 4, 8, 16, 32, 64, 128) if all(k == n - n % w for n, k in first_tail.items())]
    assert len(steps) == 1, f"{dtype}: no single vector step explains torch's tails: {first_tail}"
    return steps[0]


SGD_CASES = [dict(lr=0.1, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.01, maximize=False),
             dict(lr=0.1, momentum=0.9, dampening=0.1, nesterov=False, weight_decay=0.01, maximize=False),
             dict(lr=0.37, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=0.3, maximize=True)]
ADAM_CASES = [dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-3, weight_decay=0.1, amsgrad=False, maximize=False),
              dict(lr=0.1, betas=(0.5, 0.9), eps=1e-3, weight_decay=0.3, amsgrad=True, maximize=True)]
# (For AdamW too: its decay p * (1 - lr * wd) moves bfloat16 elements in the second, 0.97, not in the first, 0.999.)
# Not "fused": it calls torch's fused kernel per leaf as torch does (its CPU kernel rounds by
# placement: `fused.py`), which `ops` leaves alone; and torch 2.13's CPU `_fused_sgd_` for these
# dtypes leaves the elements of its vectorised body unchanged and, with momentum, writes buffers
# that differ from run to run (measured here), so no test can hold it to fixed bits.
TORCH_CASES = [pytest.param(kind, hp, impl, id=f"{kind}{i}-{impl}")
               for kind, cases in (("sgd", SGD_CASES), ("adam", ADAM_CASES), ("adamw", ADAM_CASES))
               for i, hp in enumerate(cases) for impl in ("single", "foreach")]


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("kind, hp, impl", TORCH_CASES)
def test_half_params_are_torchs_outside_torchs_tails(kind, hp, impl, dtype):
    """fzero against torch.optim (per-param calls, `foreach` as `impl`), params and momentum /
    moment buffers after each of 3 steps, for N = 1, 2, 3, 5: equal on every element of a leaf of `n`
    elements outside `[n - n mod W, n)` (`vector_step`), torch's scalar tail, where torch rounds
    by its other formula (`fzero._src.optim.ops`); the leaves are far below 32768 elements, so
    torch makes one call per leaf on one thread. Leaf 1 is unused at the first step: then torch
    takes SGD's foreach branch for a group with a leaf that has no momentum buffer yet (`sgd._foreach`)."""
    w = vector_step(dtype)
    shapes = [(37, 5), (100,), (3, 33), (64,), (1,), (31,), ()]
    prob = dict(kinds=["a", "a", "b", "a", "a", "b", "a"], shapes=shapes, align=1, scale=0.5, seed=0,
                used=[[True, False, True, True, True, True, True]] + [[True] * len(shapes)] * 2)
    g = torch.Generator().manual_seed(1)
    params = [torch.randn(s, generator=g).to(dtype) for s in shapes]
    grads = [[torch.randn(s, generator=g).to(dtype) for s in shapes] for _ in prob["used"]]
    factory = {"sgd": fo.sgd, "adam": fo.adam, "adamw": fo.adamw}[kind]
    for n in (1, 2, 3, 5):
        prob["world"] = n
        fz = FzeroRun(factory(**hp, impl=impl), prob, params)
        leaves, topt = torch_optimizer(kind, hp, prob, params, impl)
        for step, (gs, used) in enumerate(zip(grads, prob["used"])):
            for p, gi, u in zip(leaves, gs, used):
                p.grad = gi.clone() if u else None
            topt.step()
            fz.step(step, gs, used)
            for i, p in enumerate(leaves):
                m = p.numel()
                body = slice(0, m - m % w)
                state = topt.state.get(p, {})
                fields = {"param": (fz.leaf(i), p.detach())}
                for field in ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                    if state.get(field) is not None:
                        fields[field] = (fz.leaf(i, field), state[field])
                for field, (ours, theirs) in fields.items():
                    assert torch.equal(ours.reshape(-1)[body], theirs.reshape(-1)[body]), \
                        f"N={n} step {step} leaf {i} {field}: elements [0, {body.stop}) of {m} (W={w})"


@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_ops_compute_torchs_body_at_every_element(dtype):
    """`ops.add` / `add_` / `foreach_add` / `rsqrt_` against torch's own op on calls of 4096
    elements, a multiple of every vector step (so all body; one thread: below 32768), over
    values from the dtype's subnormals to products past float32's range (bfloat16: element 0 is
    `-3e38 + 3e38 * 1.5`, finite only through the body's fma): the same bits everywhere; and on
    any piece the same bits as on the whole."""
    g = torch.Generator().manual_seed(2)
    low, high = (-140, 120) if dtype == torch.bfloat16 else (-24, 14)

    def wide(n):
        return (torch.randn(n, generator=g) * torch.exp2(torch.randint(low, high, (n,), generator=g).float())).to(dtype)

    for alpha in (1.5, 1.37, -0.0123, 3.0e4, -2.0**-20, 1.0):
        x, y = wide(4096), wide(4096)
        if dtype == torch.bfloat16:
            x[0], y[0] = -3e38, 3e38
        want = x.clone().add_(y, alpha=alpha)
        keep = ~want.isnan()
        assert dtype != torch.bfloat16 or alpha != 1.5 or torch.isfinite(want[0])
        got = [ops.add(x, y, alpha), ops.add_(x.clone(), y, alpha), ops.foreach_add([x], [y], alpha)[0],
               ops.add(x, y, alpha, out=torch.empty_like(x))]
        for out in got:
            assert torch.equal(out[keep], want[keep]) and out[~keep].isnan().all(), alpha
        for a, b in ((0, 1), (5, 70), (33, 4096), (1000, 1031)):
            assert torch.equal(ops.add(x[a:b], y[a:b], alpha), got[0][a:b])
    v = wide(4096).abs()
    assert torch.equal(ops.rsqrt_(v.clone()), v.clone().rsqrt_())
    assert torch.equal(ops.rsqrt_(v[3:40].clone()), v.clone().rsqrt_()[3:40])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sgd_foreach_with_a_leaf_never_used_is_torchs_in_half_precision(dtype):
    """SGD(momentum, foreach) over a bucket of two leaves, the second never used (no gradient, so
    no momentum buffer): torch's foreach SGD decides whether every buffer exists over the params
    that have a gradient, and fzero must decide over the used leaves alike, bit for bit in bf16 and
    fp16 (the branches round differently there). A mutant deciding over every leaf passed every
    other test (found by a mutation audit: every stage decided alike). Pieces of 64 elements:
    shorter ones fall in torch's scalar tail."""
    from fzero._src.layout import Segment

    n = 64
    g = torch.Generator().manual_seed(0)
    a0, b0 = torch.randn(n, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)
    grads = [torch.randn(n, generator=g).to(dtype) for _ in range(3)]
    a, b = torch.nn.Parameter(a0.clone()), torch.nn.Parameter(b0.clone())
    ref = torch.optim.SGD([a, b], lr=0.1, momentum=0.9, foreach=True)
    opt = fo.sgd(0.1, momentum=0.9, impl="foreach")
    p = torch.cat([a0, b0])
    state = opt.init(p, 2)
    segments = (Segment(0, 0, 0, n), Segment(1, 0, n, 2 * n))
    for step, grad in enumerate(grads):
        a.grad, b.grad = grad.clone(), None
        ref.step()
        ctx = fo.UpdateContext(step, ParamGroup(), segments, (0, 1), (True, False), leaf_numels=(n, n))
        p, state = opt.update(torch.cat([grad, torch.zeros(n, dtype=dtype)]), state, p, ctx)
        assert torch.equal(p[:n], a.detach()) and torch.equal(p[n:], b0), step
