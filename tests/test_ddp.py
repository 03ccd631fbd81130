"""fzero against torch DDP (nn.Module interop on its own: tests/test_module.py).

On the persistent torchrun gloo pools (fixtures `dist2` / `dist4`, tests/conftest.py; `dist3`,
this module's); the worker functions are in tests/ddp_cases.py. What is claimed and why:
proofs/stages.md and proofs/accumulation.md.

- N = 2: every stage 0-3 gives DDP's params (and BatchNorm buffers) bit for bit after every
  step, with SGD (momentum, weight decay) and AdamW, for a toy MLP (BatchNorm, a frozen
  parameter, a parameter no rank uses), a tied-embedding nn.TransformerEncoder model and transformers' GPT-2 (tied head).
- N = 3 and 4: one step's reduced gradient is within the summation bound of proofs/stages.md (§3)
  of the exact sum of its float32 terms, for fzero and for DDP; torch.optim stepped with fzero's
  reduced gradient gives fzero's params bit for bit; stages 1-3 equal stage 0 bit for bit.
- N = 2: a clipped step is within a derived bound of DDP + `clip_grad_norm_`
  (proofs/accumulation.md, Claim 5).
- Bad input: ranks with different shapes, and a loss that raises on one rank only.
"""

from __future__ import annotations

import pytest
import torch

from fzero.testing import WorkerError

from . import ddp_cases as cases
from .conftest import LazyPool

pytestmark = pytest.mark.dist


# --- N = 2: bitwise equal to DDP --------------------------------------------------------------

@pytest.mark.parametrize("name", ["mlp", "encoder", "gpt2"])
def test_every_stage_equals_ddp_bitwise_at_n2(dist2, name):
    batches = cases.make_batches(name, 2, steps=3)
    reports = dist2.run(cases.compare_with_ddp, [(name, ["sgd", "adamw"], batches[r]) for r in range(2)])
    for rank, report in enumerate(reports):
        assert len(report) == 8
        bad = {k: v for k, v in report.items() if v}
        assert not bad, f"rank {rank}: differs from DDP: {bad}"


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_accumulate_once_equals_ddp_no_sync_at_n2(dist2, kind):
    """k = 3 micro-batches per step, 2 steps: DDP with `no_sync()` and `(loss / k).backward()` adds
    each rank's local gradients in micro-batch order and reduces the sum once, as
    `accumulate="once"` does (proofs/accumulation.md): bitwise equal at stages 0 and 1."""
    k, g = 3, torch.Generator().manual_seed(5)
    batches = [[[(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(k)]
                for _ in range(2)] for _ in range(2)]
    reports = dist2.run(cases.compare_accumulation_with_ddp, [(kind, k, batches[r]) for r in range(2)])
    for rank, report in enumerate(reports):
        assert len(report) == 2
        bad = {key: v for key, v in report.items() if v}
        assert not bad, f"rank {rank}: differs from DDP: {bad}"


@pytest.mark.parametrize("stage", [0, 3])
def test_clipping_within_bound_of_ddp_clip_grad_norm(dist2, stage):
    """One clipped SGD step (lr 0.5, limit a tenth of the norm: clipping active) against DDP +
    `clip_grad_norm_` (proofs/accumulation.md, Claim 5). Both norms are of the same reduced
    gradient g (bitwise equal at N = 2, proofs/stages.md §2), ν = ‖g‖ exactly; u = 2^-24, γ_k =
    ku/(1 − ku). Premise, asserted: no nonzero |g| < 2^-63 (a square below 2^-126 errs
    absolutely, proofs/stages.md §3).

    - fzero's ν_f: ν_f² within ε_f = γ_{S+1} + 2u of ν² (S the longest shard, proofs/stages.md
      §3); the root halves that, which also covers the float64 sum over shards and the root, so
      |ν_f − ν| ≤ ε_f·ν. torch's ν_t: fp32 per-tensor norms (their squares within γ_{n+2}, n the
      largest tensor), then the fp32 norm of the L norms (γ_L more before its root): ν_t² within
      γ_{n+L+2} of ν², halved by the root, plus its rounding: |ν_t − ν| ≤ ε_t·ν, ε_t = γ_n + γ_L +
      2u. So |ν_f − ν_t| ≤ (ε_t + ε_f)·ν_f (the halving leaves room for ν_f in place of ν).
    - Coefficients, C(x) = m/(x + 1e-6): fzero's in float64 (2^-52), rounded to float32 as it
      multiplies (u); torch's in float32 as `reciprocal(ν_t + 1e-6) · m`: 1e-6 and m rounded to
      float32, the addition, the reciprocal and the product (γ_5). C(ν_f)/C(ν_t) = (ν_t + 1e-6) /
      (ν_f + 1e-6) is within ε_t + ε_f of 1. So the two float32 coefficients differ by at most
      (ε_t + ε_f + 6u)·coef.
    - g' = fl(g·c): one rounding each (2u). SGD writes fl(p − lr·g') by the same float32 op in
      both (proofs/optimizers.md §1): lr·g' rounded at most once each (2u), and the two results
      rounded once each, half an ulp: at most 2^-23·max(|p'_t|, |p'_f|) together.

    Per element, to first order: |Δp| ≤ lr·|g|·coef·(ε_t + ε_f + 10u) + 2^-23·max(|p'_t|, |p'_f|);
    the second-order terms (≈ 10u·(ε_t + ε_f)) are far below what the halving of ε_f and ε_t left
    over (≥ (n + L + S)u/2). Before, the count was 5u: torch's five roundings of its coefficient
    and SGD's rounding of lr·g' were short-counted (the test passed within that slack)."""
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(2)]
    results = dist2.run(cases.clipping_against_ddp, [(stage, 0.05, 0.5, batches[r]) for r in range(2)])
    for rank, res in enumerate(results):
        assert res["active"], res
        assert res["tiny"] == 0, f"premise: {res['tiny']} elements with 0 < |g| < 2^-63"
        assert abs(res["norm_fzero"] - res["norm_torch"]) <= (res["eps_torch"] + res["eps_fzero"]) * res["norm_fzero"], res
        worst = {k: v for k, v in res["ratios"].items() if v > 1}
        assert not worst, f"rank {rank}: beyond the derived bound: {worst}"
        # on this data the two coefficients round to the same float32 and the params agree bit for bit
        # (proofs/accumulation.md, Claim 5): a pin, since the bound's slack hid a changed coefficient
        # (torch's + 1e-6 dropped gave 0.76 of the bound; found in review of the proofs)
        assert max(res["ratios"].values()) == 0, f"rank {rank}: {res['ratios']}"


def test_bf16_policy_reduces_as_ddp_on_a_bf16_model_at_n2(dist2):
    """Where the same casts happen the bits agree: fzero's Precision(bf16, bf16) and DDP on a bf16
    copy of the model give the same reduced gradient (proofs/precision.md)."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(2)]
    for rank, equal in enumerate(dist2.run(cases.bf16_reduction_against_ddp, [(batches[r],) for r in range(2)])):
        assert equal and all(equal.values()), f"rank {rank}: {equal}"


# --- N = 3, 4: the summation bound, then the optimizer bitwise on equal gradients ---------------

@pytest.fixture(scope="module")
def dist3():
    """3 torchrun gloo workers for this module (N = 3: fl(1/N) is not a power of two, so the terms
    `fl(g·fl(1/N))` round)."""
    pool = LazyPool(3)
    yield pool
    pool.close()


def _check_summation_bound(results, n):
    for rank, res in enumerate(results):
        assert res["ratio_fzero"], "no gradient was compared"
        worst = {k: v for k, v in res["ratio_fzero"].items() if v > 1}
        assert not worst, f"N = {n} rank {rank}: fzero's reduced gradient exceeds the bound: {worst}"
        worst = {k: v for k, v in res["ratio_ddp"].items() if v > 1}
        assert not worst, f"N = {n} rank {rank}: DDP's reduced gradient exceeds the bound (bound is wrong): {worst}"
        assert all(res["optimizer_bitwise"].values()), f"N = {n} rank {rank}: {res['optimizer_bitwise']}"
        assert len(res["optimizer_bitwise"]) == 4


@pytest.mark.parametrize("name,kind", [("mlp", "adamw"), ("gpt2", "sgd")])
def test_reduced_gradient_within_summation_bound_at_n4(dist4, name, kind):
    batches = cases.make_batches(name, 4, steps=1, seed=2)
    _check_summation_bound(dist4.run(cases.one_step_bound, [(name, kind, batches[r][0]) for r in range(4)]), 4)


def test_reduced_gradient_within_summation_bound_at_n3(dist3):
    """N = 3, where each term `fl(g_r·fl(1/3))` rounds (at N = 4 the multiply is exact): the bound
    is on the sum of those float32 terms, which fzero and DDP both add."""
    batches = cases.make_batches("mlp", 3, steps=1, seed=2)
    _check_summation_bound(dist3.run(cases.one_step_bound, [("mlp", "adamw", batches[r][0]) for r in range(3)]), 3)


def test_ddp_multiplies_by_the_reciprocal_at_n3(dist3):
    """DDP's reduced gradient is the sum of `fl(g_r·fl(1/N))`, the terms fzero reduces, not of
    `fl(g_r / N)`: at N = 3 (1/3 inexact) its bits are those of the same all-reduce of `g * (1/N)`,
    which differ from `g / N`'s in many elements (proofs/stages.md §2.3)."""
    for res in dist3.run(cases.ddp_scales_by_the_reciprocal):
        assert res["mul"] and not res["div"] and res["apart"] > 100, res


# --- bad input on the pool ----------------------------------------------------------------------

def test_different_shapes_across_ranks_raise_on_every_rank(dist2):
    with pytest.raises(WorkerError) as info:
        dist2.run(cases.init_with_size, [(4,), (5,)])
    errors = info.value.errors
    assert [e.rank for e in errors] == [0, 1]
    for e in errors:
        assert e.type_name.endswith("LayoutError"), e
        assert "'w'" in e.message and "4 elements" in e.message and "5 elements" in e.message, e.message
        assert "rank 0: 'w' float32[4] (4 elements), rank 1: 'w' float32[5] (5 elements)" in e.message, e.message
    assert errors[0].message == errors[1].message  # every rank names every rank's shape


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_loss_rejecting_batch_on_one_rank_stops_every_rank(dist2, bad_rank):
    with pytest.raises(WorkerError) as info:
        dist2.run(cases.reject_on_one_rank, [(bad_rank,), (bad_rank,)], timeout=60)
    errors = {e.rank: e for e in info.value.errors}
    assert sorted(errors) == [0, 1]
    assert errors[bad_rank].type_name.endswith("ValueError")
    assert "wrong shape" in errors[bad_rank].message
    other = errors[1 - bad_rank]
    assert other.type_name.endswith("RankFailed") and f"[{bad_rank}]" in other.message, other
    assert dist2.run(cases.rank_of, [(), ()]) == [0, 1]  # the pool survives
