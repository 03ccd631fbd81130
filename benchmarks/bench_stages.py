"""fzero stages 0-3 on the peers' GPT-style model, one stage per torchrun job.

Run (2 GPUs):  torchrun --nproc-per-node 2 benchmarks/bench_stages.py --stage 3
Profile:       torchrun --nproc-per-node 1 benchmarks/bench_stages.py --stage 2 --profile prof-stage2.txt
Host syncs:    torchrun --nproc-per-node 1 benchmarks/bench_stages.py --stage 0 --syncs 1 (CUDA: one extra step
               under torch.cuda.set_sync_debug_mode("warn"); "host_syncs" counts the step's synchronising calls)
Phases:        torchrun --nproc-per-node 1 benchmarks/bench_stages.py --stage 3 --precision bf16 --phases 1 (CUDA:
               GPU time before the loss, in the forward and after it, and the energy per step; phase_clock.py)
CPU check:     torchrun --nproc-per-node 1 benchmarks/bench_stages.py --stage 2 --dim 64 --layers 2 --heads 2
               --seq 32 --vocab 128 --micro 2 --warmup 1 --steps 2 (gloo; the numbers mean nothing)
The model, data, batch, bf16 autocast, AdamW and timing rule are those of
benchmarks/peers/bench_peers.py (the team's peer script, copied from shared/peers), so the JSON
lines compare one to one with its `ddp` / `fsdp2` modes run in the same job
(benchmarks/run_gpu.sh). fzero keeps fp32 parameters and optimizer state, computes under bf16
autocast, and reduces fp32 gradients, as DDP does here.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "peers"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_peers import GPT  # noqa: E402
from phase_clock import PhaseClock  # noqa: E402

import fzero  # noqa: E402
from fzero import optim  # noqa: E402


def count_syncs(run_step) -> dict:
    """One step under `torch.cuda.set_sync_debug_mode("warn")`: `{"count": synchronising CUDA calls,
    "sites": {"file:line": count} of fzero's frames that made them, "state": the new state}`."""
    import traceback
    import warnings

    sites: dict[str, int] = {}
    count = 0
    torch.cuda.synchronize()

    def note(message, category, filename, lineno, file=None, line=None):
        nonlocal count
        if "synchroniz" not in str(message):
            return
        count += 1
        frames = [f for f in traceback.extract_stack() if "/fzero/" in f.filename]
        where = f"{frames[-1].filename.rsplit('/fzero/', 1)[-1]}:{frames[-1].lineno}" if frames else "outside fzero"
        sites[where] = sites.get(where, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            state, _ = run_step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return {"count": count, "sites": sites, "state": state}


def _side_checks(step, state, batch):
    """One more step, counting what the side-stream checks took: `(state, {"early_norms": [shards
    whose norm the backward took, shards], "update_checks": buckets checked as updated,
    "early_update": whether the update was launched before the agreement's read})`."""
    from fzero._src import agreement as agreement_module
    from fzero._src.norms import EarlyNorms
    from fzero._src.update import Ends

    seen, taken, early = [], [], []
    known, take, skip = EarlyNorms.known, Ends.take, agreement_module.early_skip

    def counted_known(self, shards):
        out = known(self, shards)
        seen.append([len(out), len(shards)])
        return out

    def counted_take(self, b, p):
        taken.append(b)
        return take(self, b, p)

    def counted_skip(*args):
        flag = skip(*args)
        early.append(flag is not None)
        return flag

    EarlyNorms.known, Ends.take, agreement_module.early_skip = counted_known, counted_take, counted_skip
    try:
        state, _ = step(state, batch)
    finally:
        EarlyNorms.known, Ends.take, agreement_module.early_skip = known, take, skip
    return state, {"early_norms": seen[0] if seen else None, "update_checks": len(taken),
                   "early_update": early == [True]}


def _cast_leaves(step, state) -> int:
    """How many leaves the step's forward hands cast (`cast_ahead`; 0 where it casts nothing)."""
    learned = step.config.ahead.of(state.info).learned
    return learned.count if learned is not None else 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--peak", type=float, default=989e12)
    ap.add_argument("--engine", default="autograd", choices=["autograd", "func"])
    ap.add_argument("--profile", default="", help="write the profiler tables of one extra step (rank 0) to this file")
    ap.add_argument("--gather", default="on_use", choices=["eager", "on_use"])
    ap.add_argument("--syncs", type=int, default=0, help="count the host synchronisations of one extra step (CUDA)")
    ap.add_argument("--donate", type=int, default=1, help="train_step(donate=...): update the state in place")
    ap.add_argument("--side", type=int, default=1,
                    help="0: take the agreement's norms and the update's finite check on the step's stream, after "
                         "the backward and the update (what fzero did before its side-stream checks), for an A/B")
    ap.add_argument("--early", type=int, default=1,
                    help="0: launch the update after the agreement's host read, never before it (what fzero did "
                         "before agreement.agree_launching), for an A/B")
    ap.add_argument("--side-assembly", type=int, default=1,
                    help="0: assemble each unit's gradient on the step's stream, not beside the backward on the side "
                         "stream (what fzero did before the tenth session), for an A/B")
    ap.add_argument("--cast-ahead", type=int, default=0,
                    help="1: train_step(cast_ahead=True): the params autocast casts handed to the loss cast, "
                         "their gradients widened in the unit's backward (same bits; fzero/_src/casting.py)")
    ap.add_argument("--prefetch", type=int, default=-1,
                    help="train_step(prefetch=...): stage 3's units gathered ahead (-1: None, fzero's default)")
    ap.add_argument("--precision", default="autocast", choices=["autocast", "bf16"],
                    help="autocast: fp32 params under bf16 autocast (as DDP here); bf16: fzero.Precision(bf16, fp32), "
                         "no autocast (as FSDP2's MixedPrecisionPolicy)")
    ap.add_argument("--phases", type=int, default=0,
                    help="1: CUDA events at the forward's start and end of each timed step, and the GPU's energy per step "
                         "where NVML is (benchmarks/phase_clock.py)")
    a = ap.parse_args()

    mesh = fzero.DistMesh(verify=False)
    dev, rank, world = mesh.device, mesh.rank, mesh.world_size
    torch.manual_seed(0)
    model = GPT(a.vocab, a.dim, a.layers, a.heads, a.seq).to(dev)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    del model  # apply keeps a parameter-free skeleton
    nparams = sum(p.numel() for p in params.values())

    clock = PhaseClock(bool(a.phases))

    def loss_fn(p, batch):
        idx, tgt = batch
        clock.mark("forward")
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda" and a.precision == "autocast"):
            loss = apply(p, idx, tgt)
        clock.mark("loss")
        return loss

    opt = optim.adamw(lr=1e-4)
    if not a.side:
        from fzero._src.norms import EarlyNorms
        from fzero._src.update import Ends

        EarlyNorms.DEVICES = Ends.DEVICES = ()
    if not a.side_assembly:
        from fzero._src.norms import EarlyNorms

        EarlyNorms.assembly = lambda self, state: None
    if not a.early:
        from fzero._src import agreement as agreement_module

        agreement_module.early_skip = lambda *args: None
    policy = fzero.Precision(torch.bfloat16, torch.float32) if a.precision == "bf16" else fzero.Precision()
    state = fzero.init(params, opt, stage=a.stage, mesh=mesh, units=info.units, precision=policy)
    del params
    step = fzero.train_step(loss_fn, engine=a.engine, gather=a.gather, donate=bool(a.donate),
                            cast_ahead=bool(a.cast_ahead), prefetch=None if a.prefetch < 0 else a.prefetch)
    g = torch.Generator(device="cpu").manual_seed(1 + rank)
    idx = torch.randint(0, a.vocab, (a.micro, a.seq), generator=g).to(dev)
    tgt = torch.randint(0, a.vocab, (a.micro, a.seq), generator=g).to(dev)

    for _ in range(a.warmup):
        state, m = step(state, (idx, tgt))
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    dist.barrier()
    clock.start()
    times = []
    for _ in range(a.steps):
        t0 = time.perf_counter()
        clock.begin()
        state, m = step(state, (idx, tgt))
        clock.mark("end")
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    phases = clock.summary()  # and the clock stops: the profiled and checked steps below are not timed
    if a.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            state, m = step(state, (idx, tgt))
            if dev.type == "cuda":
                torch.cuda.synchronize()
        if rank == 0:
            by = "cuda_time_total" if dev.type == "cuda" else "cpu_time_total"
            with open(a.profile, "w") as f:
                f.write(f"# fzero stage {a.stage}, {a.precision}, world {world}, torch {torch.__version__}\n")
                f.write(prof.key_averages().table(sort_by=by, row_limit=30) + "\n")
                f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15) + "\n")
                if dev.type == "cuda":  # where the GPU waited, and for which host work (benchmarks/gaps.py)
                    from gaps import gpu_gaps, kernel_table, kernel_time

                    found = gpu_gaps(prof) | {"kernels_ms": kernel_time(prof)}
                    f.write("# kernels by total time\n" + kernel_table(prof) + "\n")
                    f.write("# GPU idle gaps: " + json.dumps(found) + "\n")
                    print(json.dumps({"mode": f"fzero-stage{a.stage}-{a.precision}-gaps"} | found), flush=True)
    state, side = _side_checks(step, state, (idx, tgt))
    syncs = count_syncs(lambda: step(state, (idx, tgt))) if a.syncs and dev.type == "cuda" else None
    if syncs is not None:
        state = syncs.pop("state")
    times.sort()
    med = times[len(times) // 2]
    tok = a.micro * a.seq
    flops_per_tok = 6 * nparams + 12 * a.layers * a.dim * a.seq  # the peer script's estimate
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
    peaks = fzero.collectives.all_gather(torch.tensor([peak], device=dev), mesh).tolist()
    if rank == 0:
        print(json.dumps({
            "mode": f"fzero-stage{a.stage}" + ("" if a.engine == "autograd" else f"-{a.engine}")
            + ("" if a.gather == "on_use" else f"-{a.gather}") + ("" if a.donate else "-pure")
            + ("" if a.precision == "autocast" else f"-{a.precision}") + ("-profiled" if a.profile else "")
            + ("" if a.side else "-noside") + ("" if a.early else "-noearly")
            + ("" if a.side_assembly else "-noasm") + ("-cast" if a.cast_ahead else "")
            + ("" if a.prefetch < 0 else f"-prefetch{a.prefetch}"),
            "world": world, "params_M": round(nparams / 1e6, 1),
            "step_s_median": round(med, 4), "tok_s_per_gpu": round(tok / med, 1),
            "mfu": round(tok / med * flops_per_tok / a.peak, 4),
            "peak_mem_GiB_per_rank": [round(p, 2) for p in peaks], "loss": round(float(m.loss), 4), **side,
            "cast_leaves": _cast_leaves(step, state), **phases,
            "torch": torch.__version__,
        } | ({} if syncs is None else {"host_syncs": syncs["count"], "sync_sites": syncs["sites"]})), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
