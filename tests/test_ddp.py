"""fzero against torch DDP (nn.Module interop on its own: tests/test_module.py).

On the persistent torchrun gloo pool (fixtures `dist2` / `dist4`, tests/conftest.py); the worker
functions are in tests/ddp_cases.py. What is claimed and why: proofs/stages.md.

- N = 2: every stage 0-3 gives DDP's params (and BatchNorm buffers) bit for bit after every
  step, with SGD (momentum, weight decay) and AdamW, for a toy MLP (BatchNorm, a frozen
  parameter, a parameter no rank uses), a tied-embedding nn.TransformerEncoder model and transformers' GPT-2 (tied head).
- N = 4: one step's reduced gradient is within the summation bound of proofs/stages.md (§3) of
  the exact sum, for fzero and for DDP; torch.optim stepped with fzero's reduced gradient gives
  fzero's params bit for bit; stages 1-3 equal stage 0 bit for bit.
- Bad input: ranks with different shapes, and a loss that raises on one rank only.
"""

from __future__ import annotations

import pytest
import torch

from fzero.testing import WorkerError

from . import ddp_cases as cases

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
    """fzero clips by `min(1, c / (ν + 1e-6))` with ν the norm from fp32 norms per shard (relative
    error at most ε_f = γ_{S+1} + 2u, S the longest shard: proofs/stages.md §3); torch's
    `clip_grad_norm_` by the same formula with its fp32 norm of per-tensor fp32 norms, whose
    relative error is at most ε_t = γ_n + γ_L + 2u (n the largest tensor, L tensors, Higham 3.5 for
    sums of squares, u = 2^-24). The two coefficients then differ by at most (ε_t + ε_f + 3u)
    relative, the clipped gradients by a further 2u, and one SGD step writes p - lr·g' with one
    rounding: per element |Δp| ≤ lr·|g|·coef·(ε_t + ε_f + 5u) + ulp(p).
    Clipping is active (the limit is a tenth of the norm)."""
    g = torch.Generator().manual_seed(9)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(2)]
    results = dist2.run(cases.clipping_against_ddp, [(stage, 0.05, 0.5, batches[r]) for r in range(2)])
    for rank, res in enumerate(results):
        assert res["active"], res
        assert abs(res["norm_fzero"] - res["norm_torch"]) <= (res["eps_torch"] + res["eps_fzero"]) * res["norm_fzero"], res
        worst = {k: v for k, v in res["ratios"].items() if v > 1}
        assert not worst, f"rank {rank}: beyond the derived bound: {worst}"


def test_bf16_policy_reduces_as_ddp_on_a_bf16_model_at_n2(dist2):
    """Where the same casts happen the bits agree: fzero's Precision(bf16, bf16) and DDP on a bf16
    copy of the model give the same reduced gradient (proofs/precision.md)."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(2)]
    for rank, equal in enumerate(dist2.run(cases.bf16_reduction_against_ddp, [(batches[r],) for r in range(2)])):
        assert equal and all(equal.values()), f"rank {rank}: {equal}"


# --- N = 4: the summation bound, then the optimizer bitwise on equal gradients -----------------

@pytest.mark.parametrize("name,kind", [("mlp", "adamw"), ("gpt2", "sgd")])
def test_reduced_gradient_within_summation_bound_at_n4(dist4, name, kind):
    batches = cases.make_batches(name, 4, steps=1, seed=2)
    results = dist4.run(cases.one_step_bound, [(name, kind, batches[r][0]) for r in range(4)])
    for rank, res in enumerate(results):
        assert res["ratio_fzero"], "no gradient was compared"
        worst = {k: v for k, v in res["ratio_fzero"].items() if v > 1}
        assert not worst, f"rank {rank}: fzero's reduced gradient exceeds the bound: {worst}"
        worst = {k: v for k, v in res["ratio_ddp"].items() if v > 1}
        assert not worst, f"rank {rank}: DDP's reduced gradient exceeds the bound (bound is wrong): {worst}"
        assert all(res["optimizer_bitwise"].values()), f"rank {rank}: {res['optimizer_bitwise']}"
        assert len(res["optimizer_bitwise"]) == 4


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
