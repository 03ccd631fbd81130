"""`train_step(cast_ahead=True)`: the params an autocast region casts, handed to it cast
(fzero/_src/casting.py; proofs/precision.md, "Casting ahead").

- Against torch DDP at N = 2 under CPU bf16 autocast, for the MLP (BatchNorm), the tied-embedding
  encoder and GPT-2 (Conv1D's addmm, tied head): every stage with and without casting ahead gives
  DDP's params bit for bit after every step, and stages 0-2 did cast (stage 3 at N = 2 gathers in
  its forward, so it casts nothing).
- What is cast: a weight read by one matrix product, not a LayerNorm weight, an embedding, a
  tied weight or a weight cast twice; a loss whose use of a cast param changes runs its forward
  again uncast and keeps the bits.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero import optim
from fzero._src.errors import ConfigError

from . import ddp_cases as cases


@pytest.mark.dist
@pytest.mark.parametrize("name", ["mlp", "encoder", "gpt2"])
def test_every_stage_with_and_without_casting_ahead_equals_ddp_under_autocast(dist2, name):
    batches = cases.make_batches(name, 2, steps=3)
    reports = dist2.run(cases.compare_autocast_with_ddp, [(name, batches[r]) for r in range(2)])
    for rank, report in enumerate(reports):
        bad = {k: v for k, v in report.items() if not k.startswith("cast count") and v}
        assert not bad, f"rank {rank}: differs from DDP: {bad}"
        assert len(report) == 12
        assert all(report[f"cast count stage {s}"] > 0 for s in (0, 1, 2)), report
        assert report["cast count stage 3"] == 0, report


class Net(nn.Module):
    """Each kind of use: `emb` (an embedding, fp32) tied to `out` (a matrix product, cast), `ln`
    (a LayerNorm, fp32), `a` (one matrix product: cast), `b` (two products, each its own cast;
    one with `twice=False`)."""

    def __init__(self, twice: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.blocks = nn.ModuleList([Block(twice), Block(twice)])
        self.out = nn.Linear(8, 16, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor, y: torch.Tensor, extra: bool = False) -> torch.Tensor:
        h = self.emb(x)
        for blk in self.blocks:
            h = blk(h, extra)
        return F.cross_entropy(self.out(h).reshape(-1, 16), y.reshape(-1))


class Block(nn.Module):
    def __init__(self, twice: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8, bias=False)
        self.twice = twice

    def forward(self, h: torch.Tensor, extra: bool) -> torch.Tensor:
        g = self.b(F.gelu(self.a(self.ln(h))))
        h = h + (self.b(g) if self.twice else g)
        if extra:  # the weight read once more, in fp32 (a penalty term's way)
            h = h + self.a.weight.float().sum() * 1e-3
        return h


def _batches(steps: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randint(0, 16, (2, 5), generator=g).to(device), torch.randint(0, 16, (2, 5), generator=g).to(device))
            for _ in range(steps)]


def _train(cast_ahead: bool, extra_at: frozenset = frozenset(), steps: int = 4, stage: int = 0, mesh=None,
           twice: bool = True, **step_args):
    """`(params after the last step, forward calls, what the step learned)` for `Net` under bf16
    autocast at N = 1 (SimMesh on the CPU, or `mesh`), AdamW; `extra_at`: the steps whose loss
    also reads `a.weight` in fp32."""
    mesh = mesh or fzero.SimMesh(1)
    device = mesh.device
    batches = _batches(steps, device)

    def run():
        torch.manual_seed(0)
        model = Net(twice).to(device)
        params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
        calls = []

        def loss_fn(p, batch):
            calls.append(len(calls))
            with torch.autocast(device.type, dtype=torch.bfloat16):
                return apply(p, *batch[0], extra=batch[1])

        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        step = fzero.train_step(loss_fn, cast_ahead=cast_ahead, **step_args)
        k = step_args.get("micro_batches", 1)
        for t, b in enumerate(batches):
            state, _ = step(state, (b, t in extra_at) if k == 1 else [(b, t in extra_at)] * k)
        slot = cases.config_of(step).ahead.of(state.info)
        named = {}
        if slot.learned is not None:
            layout = state.layout
            for unit, casts in slot.learned.casts.items():
                program = next(p for p in fzero._src.step.step_plan(state.info).programs if p.name == unit)
                named.update({layout.leaves[i].path: c for i, c in zip(program.leaves, casts)})
        return dict(fzero.gather(state)), len(calls), named

    return mesh.run(run)[0]


def test_casts_a_weight_one_product_reads_and_nothing_else():
    _, _, casts = _train(True, steps=2)
    cast = sorted(k for k, c in casts.items() if c is not None)
    assert cast == ["blocks.0.a.bias", "blocks.0.a.weight", "blocks.1.a.bias", "blocks.1.a.weight"]
    assert all(c == torch.bfloat16 for k, c in casts.items() if c is not None)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_casting_ahead_keeps_the_bits_over_steps(stage):
    plain, calls, _ = _train(False, stage=stage)
    cast, cast_calls, learned = _train(True, stage=stage)
    assert calls == cast_calls == 4
    assert all(torch.equal(plain[k], cast[k]) for k in plain)
    assert sum(c is not None for c in learned.values()) == 4


def test_a_use_that_changes_runs_the_forward_again_uncast_and_keeps_the_bits():
    """Step 2 reads `a.weight` in fp32 as well: its graph does not hold the casts learned at step 0,
    so the step runs its forward again without them (5 forwards for 4 steps) and learns from that
    graph, where `a.weight` has two uses (not cast since; `a.bias` still is): the params equal
    the uncast run's bit for bit."""
    plain, calls, _ = _train(False, extra_at=frozenset({2}))
    cast, cast_calls, learned = _train(True, extra_at=frozenset({2}))
    assert calls == 4 and cast_calls == 5
    assert all(torch.equal(plain[k], cast[k]) for k in plain)
    assert sorted(k for k, c in learned.items() if c is not None) == ["blocks.0.a.bias", "blocks.1.a.bias"]


@pytest.mark.parametrize("args", [dict(engine="func"), dict(micro_batches=3), dict(micro_batches=2, accumulate="once"),
                                  dict(gather="eager", clip_norm=0.5), dict(donate=True)])
def test_casting_ahead_beside_other_settings_keeps_the_bits(args):
    plain, _, _ = _train(False, **args)
    cast, _, learned = _train(True, **args)
    assert all(torch.equal(plain[k], cast[k]) for k in plain)
    assert any(c is not None for c in learned.values()) == (args.get("engine") != "func")


def test_cast_ahead_must_be_a_bool():
    with pytest.raises(ConfigError, match="cast_ahead must be a bool"):
        fzero.train_step(lambda p, b: p, cast_ahead="yes")


@pytest.mark.parametrize("stage", [0, 3])
def test_casting_ahead_on_cuda_equals_torch_autocast_with_fused_adamw(stage, nccl_mesh):
    """On CUDA, where fzero's cast is a multi-tensor copy and torch's autocast cast its own kernel,
    and the gradient's widening a multi-tensor copy beside the backward (the side-stream assembly)
    instead of `ToCopyBackward0`'s per-leaf cast: the params after 4 steps are bitwise those of
    the plain model under `torch.autocast` stepped by `torch.optim.AdamW(fused=True)` (fzero's
    default AdamW on CUDA), and those of the step that casts nothing. (No weight is read twice:
    torch's autocast casts a leaf parameter once per region and reuses the cast, fzero's leaves
    are not autograd leaves and are cast at each read; proofs/precision.md.)"""
    device = nccl_mesh.device
    torch.manual_seed(0)
    model = Net(twice=False).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    for x, y in _batches(4, device):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model(x, y).backward()
        opt.step()
    want = dict(model.named_parameters())
    plain, _, _ = _train(False, stage=stage, mesh=nccl_mesh, twice=False)
    cast, _, learned = _train(True, stage=stage, mesh=nccl_mesh, twice=False, donate=True)
    assert sum(c is not None for c in learned.values()) == 6
    for k in plain:
        assert torch.equal(plain[k], cast[k]), k
        assert torch.equal(want[k].detach(), cast[k]), k
