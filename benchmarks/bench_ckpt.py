"""Save and load time of fzero's full state against DCP on FSDP2's state, the peers' GPT, one job.

Run (1 GPU, the 1.34B GPT of benchmarks/peers, fp32 + AdamW, fzero stage 3 at N = 1):
  timeout 900 torchrun --standalone --nproc-per-node 1 benchmarks/bench_ckpt.py --stage 3
CPU check (gloo, a tiny model):
  torchrun --standalone --nproc-per-node 1 benchmarks/bench_ckpt.py --stage 1 --dim 64 --layers 2 \
      --heads 2 --seq 32 --vocab 128 --micro 2

One JSON line per mode, in the same job, on rank 0:
  fzero-stage<s>  `fzero.checkpoint.save(state, root)` then `fzero.checkpoint.load(path, state)`:
                  params (fp32 master) + AdamW's exp_avg, exp_avg_sq, step, the step counter and
                  the RNG states, through torch.distributed.checkpoint (fzero's chunk planners),
                  plus fzero's manifest with the sha256 of every file (written on save, checked
                  on load: part of both times);
  fsdp2-dcp       the peers' FSDP2 model (`fully_shard` per block, bf16 param policy, fp32
                  params) after one step of `torch.optim.AdamW`: `get_state_dict(model, opt)`
                  then `dcp.save({"model", "optim"})`; load: `get_state_dict`, `dcp.load`,
                  `set_state_dict` (what torchtitan does).
Times are wall clock around the calls (CUDA synchronised), `bytes` what is on disk. After each
save the files' pages are dropped from the page cache (`posix_fadvise(DONTNEED)`, `--drop-cache
1`), so the load reads the disk rather than memory where the kernel allows it. The directory
(`--dir`, default under /tmp) holds one mode's files at a time (about 16 GB for the 1.34B
GPT: fp32 params and AdamW's two moments) and is removed at the end. `--time-limit` (s) stops the job with an
`{"error": "time limit"}` line.
"""

import argparse
import json
import os
import shutil
import signal
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "peers"))
from bench_peers import GPT  # noqa: E402

import fzero  # noqa: E402
import fzero.checkpoint as ck  # noqa: E402
from fzero import optim  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def on_disk(path: str) -> tuple[int, int]:
    """(bytes, files) under `path`."""
    sizes = [os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs]
    return sum(sizes), len(sizes)


def drop_cache(path: str) -> None:
    """Ask the kernel to drop the page cache of every file under `path` (clean pages: no root needed)."""
    for d, _, fs in os.walk(path):
        for f in fs:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def timed(fn, dev):
    sync(dev)
    dist.barrier()
    t0 = time.perf_counter()
    out = fn()
    sync(dev)
    dist.barrier()
    return out, time.perf_counter() - t0


def batch(a, dev, rank):
    g = torch.Generator(device="cpu").manual_seed(1 + rank)
    idx = torch.randint(0, a.vocab, (a.micro, a.seq), generator=g).to(dev)
    tgt = torch.randint(0, a.vocab, (a.micro, a.seq), generator=g).to(dev)
    return idx, tgt


def bench_fzero(a, mesh, root) -> dict:
    dev, rank = mesh.device, mesh.rank
    torch.manual_seed(0)
    model = GPT(a.vocab, a.dim, a.layers, a.heads, a.seq).to(dev)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    del model
    nparams = sum(p.numel() for p in params.values())

    def loss_fn(p, b):
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            return apply(p, *b)

    state = fzero.init(params, optim.adamw(lr=1e-4), stage=a.stage, mesh=mesh, units=info.units)
    del params
    state, _ = fzero.train_step(loss_fn)(state, batch(a, dev, rank))  # AdamW's moments are not zero
    path, save_s = timed(lambda: ck.save(state, root), dev)
    nbytes, nfiles = on_disk(path)
    if a.drop_cache and rank == 0:
        drop_cache(path)
    loaded, load_s = timed(lambda: ck.load(path, state), dev)
    same = all(torch.equal(x, y) for x, y in zip(fzero._src.tree.flatten_with_paths(loaded)[1],
                                                  fzero._src.tree.flatten_with_paths(state)[1]))
    peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else None
    del loaded, state
    return {"mode": f"fzero-stage{a.stage}", "params_M": round(nparams / 1e6, 1), "save_s": round(save_s, 3),
            "load_s": round(load_s, 3), "bytes": nbytes, "files": nfiles,
            "save_GB_s": round(nbytes / save_s / 1e9, 3), "load_GB_s": round(nbytes / load_s / 1e9, 3),
            "bitwise_equal": same, "peak_mem_GiB": peak and round(peak, 2)}


def bench_fsdp2(a, dev, rank, root) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    model = GPT(a.vocab, a.dim, a.layers, a.heads, a.seq).to(dev)
    nparams = sum(p.numel() for p in model.parameters())
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=cuda)
    model(*batch(a, dev, rank)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

    def save():
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=root)

    def load():
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp.load(sd, checkpoint_id=root)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    _, save_s = timed(save, dev)
    nbytes, nfiles = on_disk(root)
    if a.drop_cache and rank == 0:
        drop_cache(root)
    _, load_s = timed(load, dev)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
    return {"mode": "fsdp2-dcp", "params_M": round(nparams / 1e6, 1), "save_s": round(save_s, 3),
            "load_s": round(load_s, 3), "bytes": nbytes, "files": nfiles,
            "save_GB_s": round(nbytes / save_s / 1e9, 3), "load_GB_s": round(nbytes / load_s / 1e9, 3),
            "peak_mem_GiB": peak and round(peak, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3])
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--micro", type=int, default=1, help="the one training step's batch (before saving)")
    ap.add_argument("--modes", default="fzero,fsdp2")
    ap.add_argument("--dir", default="/tmp/fzero-bench-ckpt")
    ap.add_argument("--drop-cache", type=int, default=1)
    ap.add_argument("--time-limit", type=int, default=600)
    a = ap.parse_args()

    def out_of_time(*_):
        raise TimeoutError(f"bench_ckpt: past --time-limit {a.time_limit} s")

    signal.signal(signal.SIGALRM, out_of_time)
    signal.alarm(a.time_limit)
    mesh = fzero.DistMesh(verify=False)
    dev, rank, world = mesh.device, mesh.rank, mesh.world_size
    root = os.path.join(a.dir, f"job-{os.environ.get('TORCHELASTIC_RUN_ID', os.getpid())}")
    if rank == 0:
        os.makedirs(root, exist_ok=True)
    dist.barrier()
    try:
        for mode in a.modes.split(","):
            if dev.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            try:
                if mode == "fzero":
                    line = bench_fzero(a, mesh, os.path.join(root, "fzero"))
                else:
                    line = bench_fsdp2(a, dev, rank, os.path.join(root, "fsdp2"))
            except TimeoutError as e:
                line = {"mode": mode, "error": "time limit", "detail": str(e)}
            line.update({"world": world, "wall_s": round(time.perf_counter() - t0, 1), "torch": torch.__version__,
                         "dir": a.dir})
            if rank == 0:
                print(json.dumps(line), flush=True)
                shutil.rmtree(os.path.join(root, mode), ignore_errors=True)  # one mode's files on disk at a time
            dist.barrier()
            if "error" in line:
                break
    finally:
        signal.alarm(0)
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
