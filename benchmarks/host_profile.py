"""Host Python time of fzero's step on a toy model whose kernels are tiny, so host time is most of it.

The model: `--blocks` residual blocks `x + W2 GELU(W1 x)` (benchmarks/bench_cpu.py's Block, small
by default: 16 blocks of 16 -> 32 -> 16, 64 leaves in 16 units), batch 4, AdamW (foreach), one
rank (SimMesh(1): no collectives move). Times are the rank thread's CPU time (`time.thread_time`:
what the host spends, not what a busy machine's other processes take from it), medians of
`--steps` steps after `--warmup`, per stage:

- `step_us`: median time of one step;
- `gap_us`: median time from the agreement's return (`agreement.agree`) to the first optimizer
  kernel (a `torch._foreach_*` call), the host Python between the step's one synchronisation
  and its first update kernel;
- `update_us`: median time of `update.update`;
- `gap_calls`: the Python and C function calls in that gap, in one step (`sys.setprofile`):
  the same on every run, where the times depend on how busy the machine is;
- a cProfile of `--profile-steps` steps: the top functions by own time (`--top`), per step.

With `--model gpt` the model is the peers' GPT (benchmarks/peers/bench_peers.py) at toy size
(vocab 256, width 64, `--layers` 24 blocks of 4 heads, sequence 32, batch 2; one unit per
block plus the rest: 25 units), per stage and per policy (`--policies fp32,bf16`; bf16 is
`Precision(bfloat16, float32)`), beside plain torch on the same model (fp32, AdamW
foreach, measured before and after the fzero rows):

- `prologue_us`: from the call of `step` to the forward's first kernel (the token embedding's
  `F.embedding`): host time during which a GPU whose queue the previous step emptied is idle;
- `forward_us`: from that first kernel to the loss's return, and `forward_us_per_unit` its
  excess over plain torch's forward per unit, `(forward_us - plain forward_us) / units`;
- `step_us`: one whole step; plain torch's row has the same fields (its prologue: from the
  start of its step to its first embedding);
- `gap_us`: from the agreement's host read (the `tolist` of the gathered rows) to the first
  optimizer kernel (a `torch._foreach_*` / `torch._fused_*` call): host time during which the
  GPU, drained by that read, is idle (0 for plain torch);
- `prologue_calls`, `forward_calls`, `step_calls`, `gap_calls`, `forward_calls_per_unit`: the same spans in
  Python and C function calls, counted in one more step (`sys.setprofile`): the same on every
  run, so they compare two versions where the times, on a busy machine, do not. On the CPU the
  bf16 rows' forward times include bf16's slower CPU kernels (plain torch runs fp32).

Run:  python benchmarks/host_profile.py                 (JSON lines; --stages 0,1,2,3)
      python benchmarks/host_profile.py --top 15 --stages 0
      python benchmarks/host_profile.py --model gpt --steps 30   (GPT rows, both policies)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "peers"))
from bench_cpu import model_of  # noqa: E402
from bench_peers import GPT  # noqa: E402

import fzero  # noqa: E402
from fzero._src import agreement as agreement_module  # noqa: E402
from fzero._src import step as step_module  # noqa: E402


KERNEL_HOOKS: list = []  # called at every optimizer kernel (`optimizer_kernels`)


def optimizer_kernels() -> None:
    """Wrap torch's `_foreach_*` and `_fused_*` functions (module attributes, looked up at call
    time) but the agreement's `_foreach_norm`, so that each call first calls `KERNEL_HOOKS`: the
    first after the agreement is the optimizer's first kernel, whatever form of the update
    (`update_`, or a prepared one) runs it."""

    def wrapped(fn):
        def call(*args, **kwargs):
            for hook in KERNEL_HOOKS:
                hook()
            return fn(*args, **kwargs)

        return call

    for name in dir(torch):
        if (name.startswith("_foreach_") or name.startswith("_fused_")) and name != "_foreach_norm":
            setattr(torch, name, wrapped(getattr(torch, name)))


optimizer_kernels()


class Clock:
    """Wraps `agreement.agree` and `update.update` (the module attributes `agree_launching` and
    `run_step` look up: `agreement.agree`, `step.update`) and hooks the optimizer kernels to time
    the gap between the agreement and the first update kernel."""

    def __init__(self) -> None:
        self.gaps: list[float] = []
        self.updates: list[float] = []
        self.calls: list[int] = []
        self.count_calls = False
        self._agreed: float | None = None
        self._calls = 0
        agree, update = agreement_module.agree, step_module.update

        def timed_agree(*args, **kwargs):
            out = agree(*args, **kwargs)
            if self.count_calls:
                self._calls = 0
                sys.setprofile(self._count)
            self._agreed = time.thread_time()
            return out

        def timed_update(*args, **kwargs):
            t0 = time.thread_time()
            out = update(*args, **kwargs)
            self.updates.append(time.thread_time() - t0)
            return out

        agreement_module.agree, step_module.update = timed_agree, timed_update
        KERNEL_HOOKS[:] = [self.first_kernel]

    def _count(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            self._calls += 1

    def first_kernel(self) -> None:
        if self._agreed is not None:
            self.gaps.append(time.thread_time() - self._agreed)
            self._agreed = None
            if self.count_calls:
                sys.setprofile(None)
                self.calls.append(self._calls - 2)  # less this function's and the hook's own call


class FirstKernel:
    """Wraps `nn.Embedding.forward` (class-wide: the skeletons fzero binds are copies) to note the
    thread time of the first embedding after `arm()`, and a loss to note when it returns. With
    `arm(count=True)` it counts instead the Python and C function calls (`sys.setprofile`, this
    thread) up to each of those points: the same on every run, where times move with the load."""

    def __init__(self) -> None:
        self.armed_at: float | None = None
        self.first: float | None = None
        self.loss_done: float | None = None
        self.counting = False
        self.calls = 0
        self.marks: list[int] = []
        forward = torch.nn.Embedding.forward

        def timed(module, *args, **kwargs):
            if self.first is None and self.armed_at is not None:
                self.first = time.thread_time()
                self._mark()
            return forward(module, *args, **kwargs)

        torch.nn.Embedding.forward = timed
        self._wrap_gap()

    def _wrap_gap(self) -> None:
        """The gap from the agreement's host read (the `tolist` of a 2-d float64 tensor: the gathered
        rows) to the first optimizer kernel (a `torch._foreach_*` or `torch._fused_*` call other than
        the agreement's `_foreach_norm`): `torch.Tensor.tolist` and those functions are wrapped."""
        self.read_at: float | None = None
        self.gap: float | None = None
        self.gap_marks: list[int] = []
        tolist = torch.Tensor.tolist

        def read(t, *args, **kwargs):
            out = tolist(t, *args, **kwargs)
            if self.armed_at is not None and self.read_at is None and t.dim() == 2 and t.dtype == torch.float64:
                self.read_at = time.thread_time()
                if self.counting:
                    self.gap_marks.append(self.calls)
            return out

        torch.Tensor.tolist = read
        KERNEL_HOOKS[:] = [self._first_kernel]

    def _first_kernel(self) -> None:
        if self.read_at is not None and self.gap is None:
            self.gap = time.thread_time() - self.read_at
            if self.counting:
                self.gap_marks.append(self.calls)

    def _count(self, frame, event, arg) -> None:
        if event in ("call", "c_call"):
            self.calls += 1

    def _mark(self) -> None:
        if self.counting:
            self.marks.append(self.calls)

    def arm(self, count: bool = False) -> None:
        self.first, self.loss_done = None, None
        self.read_at, self.gap, self.gap_marks = None, None, []
        self.counting, self.calls, self.marks = count, 0, []
        self.armed_at = time.thread_time()
        if count:
            sys.setprofile(self._count)

    def loss(self, fn):
        def timed(*args, **kwargs):
            out = fn(*args, **kwargs)
            self.loss_done = time.thread_time()
            self._mark()
            return out

        return timed

    def times(self, done: float) -> tuple[float, float, float, float]:
        """`(prologue, forward, step, gap)` seconds of the step armed last, which ended at `done`
        (gap: 0 for plain torch, which has no agreement)."""
        return self.first - self.armed_at, self.loss_done - self.first, done - self.armed_at, self.gap or 0.0

    def counts(self) -> dict[str, int]:
        """The calls of the step armed last with `count=True`: prologue, forward, whole step."""
        sys.setprofile(None)
        first, loss = self.marks
        read, kernel = self.gap_marks if len(self.gap_marks) == 2 else (0, 0)
        return {"prologue_calls": first, "forward_calls": loss - first, "step_calls": self.calls,
                "gap_calls": kernel - read}


def _medians(rows: list[tuple[float, float, float, float]]) -> dict[str, float]:
    return {k: round(statistics.median(r[i] for r in rows) * 1e6, 1)
            for i, k in enumerate(("prologue_us", "forward_us", "step_us", "gap_us"))}


def gpt_model(a) -> torch.nn.Module:
    torch.manual_seed(0)
    return GPT(256, 64, a.layers, 4, 32)


def plain_gpt(a, clock: FirstKernel, idx: torch.Tensor, tgt: torch.Tensor) -> dict[str, float]:
    """Plain torch's step on the same GPT: forward, backward, AdamW (foreach), zero_grad."""
    model = gpt_model(a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    forward = clock.loss(model)
    rows = []
    for k in range(a.warmup + a.steps):
        clock.arm()
        forward(idx, tgt).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if k >= a.warmup:
            rows.append(clock.times(time.thread_time()))
    clock.arm(count=True)
    forward(idx, tgt).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return {**_medians(rows), **clock.counts()}


def fzero_gpt(a, clock: FirstKernel, stage: int, policy: str, idx: torch.Tensor, tgt: torch.Tensor
              ) -> tuple[dict[str, float], int]:
    """fzero's step (SimMesh(1), on use, donate) on the GPT: `(medians, units)`."""
    model = gpt_model(a)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    precision = fzero.Precision(torch.bfloat16, torch.float32) if policy == "bf16" else fzero.Precision()
    step = fzero.train_step(clock.loss(lambda p, b: apply(p, *b)), donate=True)
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(params, fzero.optim.adamw(1e-4, impl="foreach"), stage=stage, mesh=mesh,
                           units=info.units, precision=precision)
        rows = []
        for k in range(a.warmup + a.steps):
            clock.arm()
            state, _ = step(state, (idx, tgt))
            if k >= a.warmup:
                rows.append(clock.times(time.thread_time()))
        clock.arm(count=True)
        state, _ = step(state, (idx, tgt))
        return {**_medians(rows), **clock.counts()}, len(state.layout.units)

    return mesh.run(rank_fn)[0]


def main_gpt(a) -> None:
    clock = FirstKernel()
    g = torch.Generator().manual_seed(0)
    idx, tgt = (torch.randint(0, 256, (2, 32), generator=g) for _ in range(2))
    before = plain_gpt(a, clock, idx, tgt)
    rows = [(stage, policy, *fzero_gpt(a, clock, stage, policy, idx, tgt))
            for policy in a.policies.split(",") for stage in (int(s) for s in a.stages.split(","))]
    after = plain_gpt(a, clock, idx, tgt)
    plain = {k: round((before[k] + after[k]) / 2, 1) if k.endswith("_us") else before[k] for k in before}
    print(json.dumps({"model": "gpt", "plain": True, **plain, "before": before, "after": after,
                      "torch": torch.__version__}), flush=True)
    for stage, policy, med, units in rows:
        print(json.dumps({
            "model": "gpt", "stage": stage, "policy": policy, "units": units, **med,
            "forward_us_per_unit": round((med["forward_us"] - plain["forward_us"]) / units, 1),
            "forward_calls_per_unit": round((med["forward_calls"] - plain["forward_calls"]) / units, 1),
            "step_over_plain": round(med["step_us"] / plain["step_us"], 3), "torch": torch.__version__}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--profile-steps", type=int, default=50)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--model", choices=("blocks", "gpt"), default="blocks")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--policies", default="fp32,bf16")
    a = ap.parse_args()
    torch.set_num_threads(1)
    if a.model == "gpt":
        return main_gpt(a)
    mesh = fzero.SimMesh(1)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(a.batch, a.dim, generator=g), torch.randn(a.batch, a.dim, generator=g)
    for stage in (int(s) for s in a.stages.split(",")):
        clock = Clock()
        model = model_of(a)
        params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
        step = fzero.train_step(lambda p, b: F.mse_loss(apply(p, b[0]), b[1]), donate=True)

        def rank_fn():
            state = fzero.init(params, fzero.optim.adamw(1e-4, impl="foreach"), stage=stage, mesh=mesh, units=info.units)
            for _ in range(a.warmup):
                state, _ = step(state, (x, y))
            clock.gaps.clear()
            clock.updates.clear()
            times = []
            for _ in range(a.steps):
                t0 = time.thread_time()
                state, _ = step(state, (x, y))
                times.append(time.thread_time() - t0)
            clock.count_calls = True
            state, _ = step(state, (x, y))
            clock.count_calls = False
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(a.profile_steps):
                state, _ = step(state, (x, y))
            prof.disable()
            return times, prof

        (times, prof), = mesh.run(rank_fn)
        stats = pstats.Stats(prof)
        top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[: a.top]  # by own time
        print(json.dumps({
            "stage": stage, "leaves": len(params), "step_us": round(statistics.median(times) * 1e6, 1),
            "gap_us": round(statistics.median(clock.gaps) * 1e6, 1),
            "update_us": round(statistics.median(clock.updates) * 1e6, 1), "gap_calls": clock.calls[0],
            "profile_top_own_us_per_step": [
                (f"{os.path.basename(f)}:{line}:{name}", round(tt / a.profile_steps * 1e6, 1), calls // a.profile_steps)
                for (f, line, name), (_, calls, tt, _, _) in top],
            "torch": torch.__version__}), flush=True)


if __name__ == "__main__":
    main()
