"""Peak resident memory per rank, stages 0-3, training an MLP over gloo: one fresh process pair
per stage (`torchrun --nproc-per-node 2`), JSON lines with the ratios to stage 0.

The model: `--blocks` blocks `x + W2 GELU(W1 x + b1) + b2` (dim -> hidden -> dim), defaults
4 x 2048 -> 8192 -> 2048 = 134.3M float32 parameters, a flat dict of leaves built directly
(no nn.Module copy), one unit per linear layer (8 units of 16.8M), `gather="on_use"` (the loss
reads each unit through `LazyParams` and calls `release` after the layer, as `from_module`'s
`apply` does: stage 3 frees it after its forward and gathers it again in backward; elsewhere
`release` does nothing), AdamW with `donate=True`
(the update is in place: no second copy of params and moments), batch `--batch` per rank, MSE
loss, `--steps` steps.

Allocator: by default the workers run with glibc's `MALLOC_MMAP_THRESHOLD_` = 1 MiB, so every
buffer of 1 MiB or more is its own mapping, returned to the OS when freed, and RSS follows the
bytes fzero holds; glibc's default dynamic threshold (`--mmap-threshold 0`) keeps freed buffers
below 32 MiB in the heap, which RSS then still counts (at 4.2M parameters that hid any
difference between the stages; at 134M the big buffers are 67 MB and mmapped either way).

What is measured, per rank: the training peak (VmHWM, reset with `/proc/self/clear_refs` once the
state is built and the params dict freed, read after the last step: the peak while training),
`ru_maxrss` (the whole process's peak, `fzero.init` included), and after each phase (baseline,
params built, init, train start, each step) the current RSS, VmHWM and ru_maxrss: the timeline
says where the bytes came in if the peaks miss the target. `--events` adds, per rank, the RSS
and VmHWM at every unit event of the last step (each unit's read, release, refill, the start
and end of its Function's backward, every collective started; VmHWM reset at the step's start)
to `--events-prefix{stage}-rank{r}.jsonl`: the first event whose VmHWM is the step's peak
says between which two events the peak was reached. A stage's line reports the larger
rank's peaks, the whole-process peak above the baseline (the RSS after `import torch, fzero` and
the gloo group, before any parameter exists, the same in every stage), `held_bytes` of the state,
and the ratios to stage 0. The last two lines check the issue's target, stage 3 <= 0.6 x stage 0
and peaks never growing from stage 0 to 3, for the training peak and for the whole process.

Expected (proofs/memory.md's model, Ψ = 134.3M, N = 2, float32, Adam): stage 0 holds params 4Ψ,
the full gradient 4Ψ, moments 8Ψ = 16Ψ = 2.15 GB; stage 1 params 4Ψ + gradient 4Ψ + moments
4Ψ = 12Ψ; stage 2 4Ψ + 2Ψ + 4Ψ = 10Ψ; stage 3 8Ψ/N = 8Ψ... halved: 2Ψ + 2Ψ + 4Ψ = 8Ψ = 1.07 GB,
plus, at its peak (a block's backward), about 4 units of 67 MB: the block's refilled params, its
leaf gradients, and the previous unit's reduction in flight (its buffer and gloo's clone of it); the baseline
(~0.3-0.4 GB of torch and gloo) is the same in every stage and pulls the raw ratio towards 1.

Run (the lead, on a quiet machine; ~5-15 min):
    python benchmarks/bench_memory_gloo.py
Tiny check (seconds):
    python benchmarks/bench_memory_gloo.py --dim 64 --hidden 256 --blocks 2 --steps 2
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

TARGET = 0.6


def _rss() -> tuple[int, int, int]:
    """`(current RSS, VmHWM: the peak RSS since the last `_reset_peak`, ru_maxrss: the peak RSS
    of the whole process)`, bytes."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return pages * os.sysconf("SC_PAGE_SIZE"), hwm * 1024, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: `echo 5 > /proc/self/clear_refs`)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# -- one rank of one stage (run under torchrun) -----------------------------------------------------


def _params(a, torch):
    """The MLP's leaves `{"blocks.i.fc{1,2}.{w,b}"}`: w1 [dim, hidden], w2 [hidden, dim]."""
    g = torch.Generator().manual_seed(0)
    p = {}
    for i in range(a.blocks):
        p[f"blocks.{i}.fc1.w"] = torch.randn(a.dim, a.hidden, generator=g) * a.dim**-0.5
        p[f"blocks.{i}.fc1.b"] = torch.zeros(a.hidden)
        p[f"blocks.{i}.fc2.w"] = torch.randn(a.hidden, a.dim, generator=g) * a.hidden**-0.5
        p[f"blocks.{i}.fc2.b"] = torch.zeros(a.dim)
    return p


def _watch(events: list, fzero) -> None:
    """Record `(event, current RSS, VmHWM)` at every unit event of the step (read, release, refill,
    the Function's backward, each collective issued): with VmHWM reset before a step, the first
    event whose VmHWM equals the step's peak is where the peak was reached (between it and the
    event before)."""
    from fzero._src import gathering, mesh as mesh_mod, unit as unit_mod

    def note(what):
        events.append((what, *_rss()[:2]))

    for name in ("read", "release", "refill", "after_backward"):
        orig = getattr(gathering.Gathering, name)

        def wrapped(self, unit, *args, orig=orig, name=name, **kw):
            out = orig(self, unit, *args, **kw)
            note(f"{name} {unit}")
            return out

        setattr(gathering.Gathering, name, wrapped)
    backward = unit_mod._Unit.backward

    def unit_backward(ctx, *grads):
        note(f"backward< {ctx.program.name}")
        out = backward(ctx, *grads)
        note(f"backward> {ctx.program.name}")
        return out

    unit_mod._Unit.backward = staticmethod(unit_backward)
    start = mesh_mod.DistMesh._start

    def started(self, call, x, **kwargs):
        note(f"start< {call.op} {call.tag}")
        out = start(self, call, x, **kwargs)
        note(f"start> {call.op} {call.tag}")
        return out

    mesh_mod.DistMesh._start = started


def worker(a) -> None:
    import torch
    import torch.nn.functional as F

    import fzero
    from fzero._src.accounting import held_bytes

    torch.set_num_threads(a.threads)
    mesh = fzero.DistMesh(backend="gloo", verify=False)
    timeline = [("baseline", *_rss())]
    params = _params(a, torch)
    numel = sum(t.numel() for t in params.values())
    timeline.append(("params", *_rss()))
    opt = fzero.optim.adamw(1e-4)
    state = fzero.init(params, opt, stage=a.stage, mesh=mesh, units=lambda path: path.rsplit(".", 1)[0])
    del params
    timeline.append(("init", *_rss()))
    held = held_bytes(state, opt)

    def layer(p, unit, x):  # one unit: read (stage 3: gathered), used, released (stage 3: freed until backward)
        w, b = p[f"{unit}.w"], p[f"{unit}.b"]
        y = x @ w + b
        p.release(unit)
        return y

    def loss_fn(p, batch):  # p: the LazyParams mapping gather="on_use" gives a flat-dict loss
        x, y = batch
        for i in range(a.blocks):
            h = F.gelu(layer(p, f"blocks.{i}.fc1", x))  # (B, hidden)
            x = x + layer(p, f"blocks.{i}.fc2", h)  # (B, dim)
        return F.mse_loss(x, y)

    step = fzero.train_step(loss_fn, gather="on_use", donate=True, prefetch=a.prefetch)
    g = torch.Generator().manual_seed(100 + mesh.rank)
    batch = (torch.randn(a.batch, a.dim, generator=g), torch.randn(a.batch, a.dim, generator=g))
    reset = _reset_peak()  # the training peak: from here (state built, params dict freed) to the end
    timeline.append(("train", *_rss()))
    t0 = time.perf_counter()
    loss = None
    events: list = []
    if a.events:
        _watch(events, fzero)
    for k in range(a.steps):
        if a.events and k == a.steps - 1:  # the last step's events, its own peak
            events.clear()
            _reset_peak()
            events.append(("last step", *_rss()[:2]))
        state, m = step(state, batch)
        loss = float(m.loss)
        timeline.append((f"step{k}", *_rss()))
    seconds = time.perf_counter() - t0
    mine = torch.tensor([v for _, *vs in timeline for v in vs], dtype=torch.float64)
    rows = fzero.collectives.all_gather(mine.reshape(1, -1), mesh).tolist()  # (N, 3 * phases), exact below 2**53
    if mesh.rank == 0:
        names = [name for name, *_ in timeline]
        per_rank = [{n: {"rss": int(r[3 * i]), "hwm": int(r[3 * i + 1]), "maxrss": int(r[3 * i + 2])}
                     for i, n in enumerate(names)} for r in rows]
        print(json.dumps({"stage": a.stage, "world": mesh.world_size, "params": numel,
                          "peak_bytes": max(int(r[-1]) for r in rows),
                          "train_peak_bytes": max(int(r[-2]) for r in rows) if reset else None,
                          "baseline_peak_bytes": max(int(r[2]) for r in rows),
                          "held": held._asdict(), "loss": loss, "step_s": round(seconds / a.steps, 3),
                          "timeline": per_rank}), flush=True)
    if a.events:  # each rank its own file
        with open(f"{a.events_prefix}{a.stage}-rank{mesh.rank}.jsonl", "w") as f:
            f.writelines(json.dumps({"event": what, "rss_mib": round(rss / 2**20, 1), "hwm_mib": round(hwm / 2**20, 1)})
                         + "\n" for what, rss, hwm in events)
    torch.distributed.destroy_process_group()


# -- the driver: one fresh process pair per stage -------------------------------------------------


def run_stage(a, stage: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.nproc),
           __file__, "--worker", "--stage", str(stage), "--dim", str(a.dim), "--hidden", str(a.hidden),
           "--blocks", str(a.blocks), "--batch", str(a.batch), "--steps", str(a.steps), "--threads", str(a.threads)] + (
           [] if a.prefetch is None else ["--prefetch", str(a.prefetch)]) + (
           ["--events", "--events-prefix", a.events_prefix] if a.events else [])
    env = dict(os.environ, OMP_NUM_THREADS=str(a.threads))
    if a.mmap_threshold > 0:  # glibc: buffers of at least this many bytes are mmapped, returned to the OS on free
        env["MALLOC_MMAP_THRESHOLD_"] = str(a.mmap_threshold)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"stage": stage, "error": f"timed out after {a.timeout} s"}
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        ranks = [ln for ln in out.stderr.splitlines() if ln.startswith("[rank")]  # the workers' own traceback
        return {"stage": stage, "error": f"rc {out.returncode}", "stderr_tail": "\n".join((ranks or
                out.stderr.splitlines())[-30:])}
    return json.loads(lines[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=8192)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--stages", default="0,1,2,3")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--timeout", type=int, default=1200, help="seconds per stage")
    ap.add_argument("--timeline", action="store_true", help="print each stage's per-phase RSS timeline")
    ap.add_argument("--events", action="store_true",
                    help="also print, per rank, RSS and VmHWM at every unit event of the last step (where the peak is)")
    ap.add_argument("--mmap-threshold", type=int, default=1 << 20,
                    help="glibc MALLOC_MMAP_THRESHOLD_ for the workers (0: glibc's default, whose dynamic threshold "
                         "keeps freed buffers below 32 MiB in the heap, so RSS counts them after they are freed)")
    ap.add_argument("--events-prefix", default="/tmp/fzero-memory-events-stage",
                    help="with --events: stage s's rank r's event lines go to PREFIX{s}-rank{r}.jsonl")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="train_step(prefetch=k) (default None: the library's, 1 unit on DistMesh): stage 3's units "
                         "gathered ahead, each one unit's params more at the peak")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--stage", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a)
        return
    results = [run_stage(a, int(s)) for s in a.stages.split(",")]
    ok = [r for r in results if "error" not in r]
    base = next((r for r in ok if r["stage"] == 0), None)
    for r in results:
        if "error" in r or base is None:
            print(json.dumps(r), flush=True)
            continue
        above, above0 = r["peak_bytes"] - r["baseline_peak_bytes"], base["peak_bytes"] - base["baseline_peak_bytes"]
        train, train0 = r["train_peak_bytes"], base["train_peak_bytes"]
        line = {"stage": r["stage"], "world": r["world"], "params": r["params"],
                "train_peak_mib": None if train is None else round(train / 2**20, 1),
                "train_ratio_to_stage0": None if train is None else round(train / train0, 3),
                "peak_mib": round(r["peak_bytes"] / 2**20, 1),
                "ratio_to_stage0": round(r["peak_bytes"] / base["peak_bytes"], 3),
                "baseline_mib": round(r["baseline_peak_bytes"] / 2**20, 1), "above_baseline_mib": round(above / 2**20, 1),
                "ratio_above_baseline": round(above / above0, 3) if above0 > 0 else None,
                "held_mib": {k: round(v / 2**20, 1) for k, v in r["held"].items() if isinstance(v, (int, float))},
                "step_s": r["step_s"], "loss": r["loss"], "mmap_threshold": a.mmap_threshold}
        if a.timeline:
            line["timeline_mib"] = [{ph: [round(v[k] / 2**20, 1) for k in ("rss", "hwm", "maxrss")]
                                     for ph, v in rank.items()} for rank in r["timeline"]]
        print(json.dumps(line), flush=True)
    for key in ("train_peak_bytes", "peak_bytes"):
        by_stage = {r["stage"]: r[key] for r in ok if r[key] is not None}
        stages = sorted(by_stage)
        if 0 in by_stage and 3 in by_stage:
            print(json.dumps({"target": f"stage 3 <= {TARGET} x stage 0, non-increasing 0 -> 3", "of": key,
                              "stage3_over_stage0": round(by_stage[3] / by_stage[0], 3),
                              "met_ratio": by_stage[3] <= TARGET * by_stage[0],
                              "non_increasing": all(by_stage[x] >= by_stage[y] for x, y in zip(stages, stages[1:])),
                              "torch": __import__("torch").__version__}), flush=True)


if __name__ == "__main__":
    main()
