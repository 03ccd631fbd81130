"""Offload on one GPU: the largest GPT that trains with fzero stage 3 + optimizer / param / NVMe
offload, against DeepSpeed ZeRO-Offload / ZeRO-Infinity and FSDP2 with CPUOffloadPolicy; the
PCIe ceiling; the host AdamW's speed against DeepSpeed's CPUAdam. One job, JSON lines.

Run (one H200, from the repository root; DeepSpeed from the carried wheels, its ops JIT-built
once, ~1-2 minutes, cached in $TORCH_EXTENSIONS_DIR for the machine's later calls):
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TORCH_EXTENSIONS_DIR=/tmp/torch_extensions_bench_offload
    python3 benchmarks/bench_offload.py --smoke                                # first call: builds, then < 2 min
    python3 benchmarks/bench_offload.py --out $OUT/offload.jsonl                # second call: < 9 min
The host AdamW in cache-sized blocks against one pass per op (fzero's foreach / single on the CPU,
`fzero._src.optim.base.in_blocks`), no DeepSpeed needed (its rows then say it is missing):
    python3 benchmarks/bench_offload.py --child cpu_adam --adam-elements 1e8              (blocks)
    python3 benchmarks/bench_offload.py --child cpu_adam --adam-elements 1e8 --cpu-block 1099511627776
Larger sizes in a further call: `--skip-pcie --skip-adam --start 2 --modes fzero-cpu ds-cpu ...`.
fzero's NVMe modes alone, 3 steps each (warm-up + `--steps 2`), at 0.54B and then the largest of
a list the guard allows (it skips, at no cost, what would not fit 85% of the disk's free space):
    python3 benchmarks/bench_offload.py --skip-pcie --skip-adam --steps 2 --modes fzero-nvme \
        fzero-nvme-params --sizes 2048x8 --total 100 --out $OUT/nvme-small.jsonl
    python3 benchmarks/bench_offload.py --skip-pcie --skip-adam --steps 2 --modes fzero-nvme \
        fzero-nvme-params --mode-sizes fzero-nvme=4096x24,4096x19,4096x16,4096x12 \
        fzero-nvme-params=4096x19,4096x16,4096x12 --total 300 --run-timeout 200 --out $OUT/nvme-large.jsonl
ZeRO-Infinity (`ds-nvme`) needs DeepSpeed's async I/O op, which needs libaio: where the system has
none, unpack Debian's libaio1 and libaio-dev (`apt-get download`, then `dpkg -x FILE DIR`) and pass
`--aio-root DIR`; where TORCH_CUDA_ARCH_LIST names an arch with a suffix ("9.0a"), DeepSpeed
0.19.8's JIT builder fails to parse it: `export TORCH_CUDA_ARCH_LIST=9.0` first.
Smoke (every mode on a tiny model, < 2 minutes once DeepSpeed's ops are built, which a cold cache
adds first: minutes; also on a CPU-only machine, where the CUDA-only rows say so):
    PYTHONPATH=$PWD python3 benchmarks/bench_offload.py --smoke

Rows (each from its own subprocess with a time limit; the driver stays inside `--total` s):
  {"bench": "ds_build"}   DeepSpeed's CPUAdam and async I/O ops JIT-built once (ninja; cached in
                          $TORCH_EXTENSIONS_DIR for every later child), seconds or the error.
  {"bench": "pcie"}       pinned host <-> device copies of `--pcie-gib` GiB, GB/s (median of 5):
                          the ceiling of every offloaded step's traffic.
  {"bench": "cpu_adam"}   one AdamW step over E fp32 elements on the host: fzero's adamw (impl
                          fused / foreach / single, in place: what the offloaded update runs)
                          and DeepSpeedCPUAdam (adamw_mode), ms per step and elements/s.
  {"bench": "train"}      one mode at one model size: params, tokens/s, step time (median of
                          `--steps` after one warm-up step, so >= steps + 1 steps trained), peak
                          GPU memory, host RSS (peak and after the steps), the predicted host /
                          NVMe bytes, or `error` ("oom", "timeout", the exception).
  {"bench": "largest"}    per mode: the largest size that trained, and why the sweep (or search)
                          stopped; a search also says how many attempts it made.

Modes (all: the peers' GPT, bf16 compute with fp32 master and optimizer state, AdamW, stage 3;
the host update: fzero's adamw with `--host-impl` (fused by default), DeepSpeedCPUAdam for
DeepSpeed, torch.optim.AdamW's default (foreach) on FSDP2's host shards):
  fzero-cpu         fzero.Offload(optimizer="cpu")                  (params on the GPU, bf16)
  fzero-cpu-params  fzero.Offload(optimizer="cpu", params="cpu")
  fzero-nvme        fzero.Offload(optimizer="nvme", nvme_path=...)  (master and moments in files)
  fzero-nvme-params fzero.Offload(optimizer="nvme", params="nvme", nvme_path=...)  (+ the bf16 shards)
  ds-cpu            DeepSpeed ZeRO-3, offload_optimizer cpu          (ZeRO-Offload)
  ds-cpu-params     + offload_param cpu
  ds-nvme           offload_optimizer nvme                           (ZeRO-Infinity)
  fsdp2-cpu         FSDP2 fully_shard per block, CPUOffloadPolicy, MixedPrecisionPolicy(bf16, fp32)
With `--sizes` (e.g. `--sizes 12.8 8 5.1 2.7 1.34`: billions of params, or WxD), a search per mode
tries them from the largest down, each attempt in its own child with a time limit, and stops at
the first that trains (`--steps` timed steps after one warm-up; `--steps 2`: 3 steps); sizes
predicted not to fit the host memory or the NVMe folder are skipped without an attempt.
Without it, a sweep grows the model along `LADDER` (width, depth) and stops at the first failure, or when
the next size is predicted (last run's time x the size ratio) to overrun the mode's share of the
time left, or would not fit in 85% of the host's available memory / the NVMe folder's free space
(`predicted`: from fzero.accounting.estimate for fzero, from their byte counts for the peers).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
GIB = 2**30
FZERO_MODES = {"fzero-cpu": ("cpu", None), "fzero-cpu-params": ("cpu", "cpu"), "fzero-nvme": ("nvme", None),
               "fzero-nvme-params": ("nvme", "nvme")}
DS_MODES = {"ds-cpu": ("cpu", None), "ds-cpu-params": ("cpu", "cpu"), "ds-nvme": ("nvme", None)}
MODES = (*FZERO_MODES, *DS_MODES, "fsdp2-cpu")
# (width, depth): 0.54B, 1.34B (the peers' model), 2.69B, 5.1B, 7.5B, 12.8B params at vocab 32000
LADDER = ((2048, 8), (2048, 24), (4096, 12), (4096, 24), (4096, 36), (5120, 40))
SMOKE = dict(ladder=((64, 2),), vocab=128, seq=32, micro=2, heads=2)


def gpt_params(width: int, depth: int, vocab: int, seq: int) -> int:
    """Parameters of the peers' GPT: 12 d^2 per block (qkv 3d^2, proj d^2, mlp 8d^2) + 4d of
    LayerNorms, token and position embeddings, the final LayerNorm and the untied head."""
    return depth * (12 * width * width + 4 * width) + 2 * vocab * width + seq * width + 2 * width


def parse_size(text: str, vocab: int, seq: int) -> tuple[int, int]:
    """`"WxD"` (width x depth) or a number of parameters in billions (`"5.1"`) -> (width, depth):
    the width from `WIDTHS` (the first whose row covers the count), the depth that comes
    closest to the count with it (at least 1)."""
    if "x" in text:
        w, d = text.lower().split("x")
        return int(w), int(d)
    want = float(text) * 1e9
    width = next((w for limit, w in WIDTHS if want <= limit * 1e9), WIDTHS[-1][1])
    per_block, rest = 12 * width * width + 4 * width, 2 * vocab * width + seq * width + 2 * width
    return width, max(1, round((want - rest) / per_block))


# the width a size in billions gets (`parse_size`): up to 1.5B 2048, up to 8B 4096, ...
WIDTHS = ((1.5, 2048), (8.0, 4096), (16.0, 5120), (40.0, 6144))


# fzero's host RSS per param measured on the H200 over the estimate's bytes (BENCHMARKS.md, third
# session: 27.9 GiB at 1.34B and 54.5 GiB at 2.68B against 16 B/param predicted, 1.27-1.30x):
# pinned buffers come from torch's caching host allocator, which rounds each up (to a power of
# two), plus the process's own memory; the guard carries it so that a search does not start a size
# the host cannot hold (an OOM kill costs the attempt's time)
HOST_SLACK = 1.3


def predicted(mode: str, width: int, depth: int, vocab: int, seq: int, slack: float = HOST_SLACK
              ) -> tuple[float, int]:
    """(host, NVMe) bytes a mode is expected to hold at N = 1 for the GPT of (width, depth), for
    the sweep's guard. fzero: `fzero.accounting.estimate` of the model's buckets (one per block,
    `units_by_prefix(model, "blocks")`, and one for the rest: embeddings, head, final LayerNorm;
    bf16 params, fp32 master, Adam, the gradient copy in the fp32 reduce dtype), so the NVMe
    swap buffers, sized by the largest bucket, count; times `slack` (`--host-slack`). DeepSpeed:
    fp32 master 4 + moments 8 + fp32 gradient 4 (+ 2 for offloaded bf16 params), the moments and
    master on NVMe for nvme. FSDP2: fp32 sharded params 4 + fp32 gradients 4 + moments 8, all on
    the host. Plus the model's fp32 copy where it is built on the host (DeepSpeed)."""
    n = gpt_params(width, depth, vocab, seq)
    if mode in FZERO_MODES:
        import torch

        from fzero._src.estimate import estimate

        where, params = FZERO_MODES[mode]
        tree = {f"blocks.{i}": torch.empty(12 * width * width + 4 * width, device="meta") for i in range(depth)}
        tree["rest"] = torch.empty(n - depth * (12 * width * width + 4 * width), device="meta")
        e = estimate(tree, 1, stage=3, optimizer="adam-mixed", grad_dtype="fp32", offload_optimizer=where,
                     offload_params=params, units=lambda path: path)  # one bucket per leaf
        # params="cpu": 4 more bytes per param, beside the one bf16 copy the estimate counts
        # (HostTier.host_cast; a second exists across an update, the new one made before the old
        # goes): one copy more than can exist, kept because the guard was checked with it -- at
        # 4.09B and --host-slack 1.2 it predicted 100.6 GiB against a measured 101.5 GiB RSS
        return slack * (int(e.host.total) + (4 * n if params == "cpu" else 0)), int(e.nvme.total)
    if mode in DS_MODES:
        where, params = DS_MODES[mode]
        return (4 + (2 if params else 0) + (0 if where == "nvme" else 12) + 4) * n, (12 if where == "nvme" else 0) * n
    return (16 + 4) * n, 0


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def folder_bytes(path: str) -> int:
    """Bytes of the files under `path` (allocated blocks: a reserved, unwritten file counts)."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def filesystem(path: str) -> str:
    """The type and device of the mount holding `path` (/proc/mounts' longest matching mount
    point): a tmpfs "NVMe" would be host memory."""
    path, best = os.path.realpath(path), ("", "?", "?")
    with open("/proc/mounts") as f:
        for line in f:
            dev, mount, kind = line.split()[:3]
            if (path == mount or path.startswith(mount.rstrip("/") + "/")) and len(mount) > len(best[0]):
                best = (mount, kind, dev)
    return f"{best[1]} ({best[2]} on {best[0]})"


def emit(row: dict, out: str | None) -> None:
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


# ---------------------------------------------------------------------------------- child: pcie


def bench_pcie(a) -> dict:
    import torch

    if not torch.cuda.is_available():
        return dict(bench="pcie", skipped="no CUDA device")
    n = int(a.pcie_gib * GIB)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = dict(bench="pcie", bytes=n, device=torch.cuda.get_device_name())
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(6):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop) / 1e3)
        times = sorted(times[1:])
        out[f"{name}_GBps"] = round(n / times[len(times) // 2] / 1e9, 2)
    return out


# ------------------------------------------------------------------------- child: DeepSpeed ops


def bench_ds_build(a) -> list[dict]:
    """JIT-build DeepSpeed's CPUAdam and async I/O ops once (ninja; cached for later children
    under $TORCH_EXTENSIONS_DIR), so no training run spends its time limit compiling."""
    rows = []
    for name in ("CPUAdamBuilder", "AsyncIOBuilder"):
        t0 = time.perf_counter()
        try:
            from deepspeed.ops import op_builder

            builder = getattr(op_builder, name)()
            if not builder.is_compatible(verbose=False):
                raise RuntimeError(f"{name} is not compatible with this machine (for async I/O: libaio-dev missing?)")
            builder.load(verbose=False)
            rows.append(dict(bench="ds_build", op=name, ok=True, build_s=round(time.perf_counter() - t0, 1)))
        except Exception as err:  # noqa: BLE001 -- the modes that need the op will fail and say so
            rows.append(dict(bench="ds_build", op=name, ok=False, error=_err(err), build_s=round(time.perf_counter() - t0, 1)))
    return rows


# ------------------------------------------------------------------------------ child: cpu adam


def bench_cpu_adam(a) -> None:
    """One AdamW step on E host fp32 elements: fzero's adamw in place (each impl; foreach and
    single only up to `--adam-slow-max` elements) and DeepSpeedCPUAdam, the same
    hyper-parameters, fresh values per optimizer. Each row is printed when measured."""
    import torch

    from fzero import optim

    sys.path.insert(0, HERE)
    from bench_optim import HP, context

    from fzero._src.optim import base as optim_base

    if a.cpu_block is not None:
        optim_base.CPU_BLOCK = a.cpu_block
    rows = _Printer()
    for e in (int(x) for x in a.adam_elements):
        base = dict(bench="cpu_adam", elements=e, threads=torch.get_num_threads(), cpu_block=optim_base.CPU_BLOCK,
                    torch=torch.__version__)
        p, g = torch.empty(e).uniform_(-1, 1), torch.empty(e).uniform_(-1e-3, 1e-3)
        for impl in optim.IMPLS:
            if impl != "fused" and e > a.adam_slow_max:
                continue
            opt = optim.adamw(**HP, impl=impl)
            state = opt.init(p, 1)
            times = []
            for t in range(1 + a.adam_iters):
                t0 = time.perf_counter()
                state = opt.update_(g, state, p, context([e], t))
                times.append(time.perf_counter() - t0)
            del state
            rows.append(dict(base, who="fzero", impl=impl, **_rate(times[1:], e)))
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            q = torch.nn.Parameter(p.clone())
            q.grad = g.clone()
            lr, betas, eps, wd = HP["lr"], HP["betas"], HP["eps"], HP["weight_decay"]
            t0 = time.perf_counter()
            ds = DeepSpeedCPUAdam([q], lr=lr, betas=betas, eps=eps, weight_decay=wd, adamw_mode=True)
            built = time.perf_counter() - t0
            times = []
            for _ in range(1 + a.adam_iters):
                t0 = time.perf_counter()
                ds.step()
                times.append(time.perf_counter() - t0)
            rows.append(dict(base, who="deepspeed", impl="DeepSpeedCPUAdam", build_s=round(built, 1), **_rate(times[1:], e)))
            del ds, q
        except Exception as err:  # noqa: BLE001 -- not installed, or its op did not build: say so
            rows.append(dict(base, who="deepspeed", impl="DeepSpeedCPUAdam", error=_err(err)))
        del p, g


class _Printer:
    """A list-like sink that prints each JSON row at once (a child killed at its time limit
    still returns what it measured)."""

    def append(self, row: dict) -> None:
        emit(row, None)


def _rate(times: list[float], e: int) -> dict:
    times = sorted(times)
    med = times[len(times) // 2]
    return dict(ms=round(med * 1e3, 2), ms_min=round(times[0] * 1e3, 2), Gelem_per_s=round(e / med / 1e9, 3))


def _err(err: BaseException) -> str:
    text = f"{type(err).__name__}: {err}".replace("\n", " ")
    return text[:400]


# -------------------------------------------------------------------------------- child: train


def _model(a, device):
    import torch

    sys.path.insert(0, os.path.join(HERE, "peers"))
    from bench_peers import GPT

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(a.vocab, a.width, a.depth, a.heads, a.seq)


def _batch(a, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(1)
    idx = torch.randint(0, a.vocab, (a.micro, a.seq), generator=g).to(device)
    tgt = torch.randint(0, a.vocab, (a.micro, a.seq), generator=g).to(device)
    return idx, tgt


def _fzero_trainer(a, where: str, params_tier: str | None):
    import torch

    import fzero
    from fzero import optim

    if not hasattr(fzero, "Offload"):
        raise RuntimeError("this fzero has no fzero.Offload")
    mesh = fzero.DistMesh(verify=False)
    dev = mesh.device
    model = _model(a, dev)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    del model
    nvme_path = None
    if where == "nvme":
        nvme_path = os.path.join(a.nvme_path, "fzero")
        os.makedirs(nvme_path, exist_ok=True)
    off = fzero.Offload(optimizer=where, params=params_tier, nvme_path=nvme_path)
    cuda = dev.type == "cuda"
    policy = fzero.Precision(torch.bfloat16, torch.float32) if cuda else fzero.Precision()
    impl = None if a.host_impl == "default" else a.host_impl
    state = fzero.init(params, optim.adamw(lr=1e-4, impl=impl), stage=3, mesh=mesh, units=info.units,
                       precision=policy, offload=off)
    del params
    step = fzero.train_step(lambda p, batch: apply(p, *batch), donate=True)
    batch = _batch(a, dev)
    box = [state]

    def run():
        box[0], m = step(box[0], batch)
        return m.loss

    return run, dev


def _ds_trainer(a, where: str, params_tier: str | None):
    import deepspeed
    import torch

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    zero = {"stage": 3, "overlap_comm": True, "contiguous_gradients": True, "reduce_bucket_size": 5e8,
            "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5, "sub_group_size": 1e9,
            "offload_optimizer": {"device": where, "pin_memory": True}}
    cfg = {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1, "bf16": {"enabled": cuda},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 1e-2}},
           "zero_optimization": zero, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if where == "nvme":
        from deepspeed.ops.op_builder import AsyncIOBuilder

        if not AsyncIOBuilder().is_compatible(verbose=False):
            raise RuntimeError("DeepSpeed's async_io op is not compatible here (libaio missing?): no ZeRO-Infinity NVMe")
        path = os.path.join(a.nvme_path, "deepspeed")
        os.makedirs(path, exist_ok=True)
        zero["offload_optimizer"].update(nvme_path=path, buffer_count=4, fast_init=False)
        cfg["aio"] = {"block_size": 1 << 20, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                      "overlap_events": True}
    if params_tier:
        zero["offload_param"] = {"device": params_tier, "pin_memory": True}
    with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device=params_tier, pin_memory=True):
        model = _model(a, dev)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    batch = _batch(a, dev)

    def run():
        loss = engine(*batch)
        engine.backward(loss)
        engine.step()
        return loss

    return run, dev


def _fsdp2_trainer(a):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    model = _model(a, dev)  # fully_shard moves each shard to (pinned) host memory
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if cuda else MixedPrecisionPolicy()
    off = CPUOffloadPolicy(pin_memory=cuda)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp, offload_policy=off)
    fully_shard(model, mp_policy=mp, offload_policy=off)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # host tensors: torch's CPU foreach kernels
    batch = _batch(a, dev)

    def run():
        loss = model(*batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return run, dev


def bench_train(a) -> dict:
    import torch

    row = dict(bench="train", mode=a.mode, width=a.width, depth=a.depth, micro=a.micro, seq=a.seq,
               host_impl=a.host_impl if a.mode in FZERO_MODES else None,
               params_M=round(gpt_params(a.width, a.depth, a.vocab, a.seq) / 1e6, 1), torch=torch.__version__)
    t0 = time.perf_counter()
    try:
        if a.mode in FZERO_MODES:
            run, dev = _fzero_trainer(a, *FZERO_MODES[a.mode])
        elif a.mode in DS_MODES:
            run, dev = _ds_trainer(a, *DS_MODES[a.mode])
        else:
            run, dev = _fsdp2_trainer(a)
        row["init_s"] = round(time.perf_counter() - t0, 1)
        cuda = dev.type == "cuda"
        run()  # warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(a.steps):
            t1 = time.perf_counter()
            loss = run()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t1)
        times.sort()
        med = times[len(times) // 2]
        row.update(steps=a.steps + 1, step_s_median=round(med, 3), tok_s=round(a.micro * a.seq / med, 1),
                   loss=round(float(loss.detach()), 4),
                   peak_gpu_GiB=round(torch.cuda.max_memory_allocated() / GIB, 2) if cuda else None,
                   host_rss_GiB=round(rss_now() / GIB, 2), host_rss_peak_GiB=round(rss_peak() / GIB, 2))
        if "nvme" in a.mode:  # the swap files exist: the mode really keeps state on the disk
            on_disk = folder_bytes(a.nvme_path)
            row["nvme_files_GiB"] = round(on_disk / GIB, 3)
            if on_disk == 0:
                row["error"] = f"no swap files under {a.nvme_path}: this {a.mode} does not use the disk"
    except torch.OutOfMemoryError as err:
        row.update(error="oom", detail=_err(err), host_rss_peak_GiB=round(rss_peak() / GIB, 2))
    except Exception as err:  # noqa: BLE001 -- a mode that cannot run says why, the sweep goes on
        row.update(error=_err(err), where=traceback.format_exc(limit=-3).replace("\n", " | ")[-600:])
    return row


# --------------------------------------------------------------------------------------- driver


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child(args: list[str], timeout: float) -> tuple[list[dict], float, str | None]:
    """Run this script with `args` in a new session (one rank of a 1-process group), at most
    `timeout` s; returns its JSON rows, its wall time and an error ("timeout", "exit N")."""
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1",
               LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", PYTHONUNBUFFERED="1")
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    for name, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        env.setdefault(name, value)  # NVLink multicast stays off on the shared machines
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=max(timeout, 1))
        status = None if proc.returncode == 0 else f"exit {proc.returncode}: {_tail(err)}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        status = f"timeout after {timeout:.0f} s; stderr ends: {_tail(err)}"
        _drop_stale_locks()
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return rows, time.perf_counter() - t0, status


def _tail(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if "WARNING" not in line]
    return " | ".join(lines[-4:])[-400:]


def _drop_stale_locks() -> None:
    """A child killed while JIT-building an op leaves torch's build lock behind, and the next
    child would wait on it forever; no other child runs now, so every lock there is stale."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR", "")
    for folder, _, files in os.walk(root) if root else ():
        if "lock" in files:
            os.remove(os.path.join(folder, "lock"))


def train_child(mode: str, a, width: int, depth: int, timeout: float) -> tuple[list[dict], float, str | None]:
    """One training attempt of `mode` at (width, depth) in its own child (`child`'s result); the
    swap files a killed run leaves in `--nvme-path` are removed after it."""
    args = ["--child", "train", "--mode", mode, "--host-impl", a.host_impl, "--width", str(width), "--depth",
            str(depth), "--vocab", str(a.vocab), "--seq", str(a.seq), "--micro", str(a.micro), "--heads",
            str(a.heads), "--steps", str(a.steps), "--nvme-path", a.nvme_path]
    out = child(args, timeout)
    shutil.rmtree(os.path.join(a.nvme_path, "fzero"), ignore_errors=True)
    shutil.rmtree(os.path.join(a.nvme_path, "deepspeed"), ignore_errors=True)
    return out


def sweep(mode: str, a, deadline: float, modes_left: int) -> None:
    budget_end = time.perf_counter() + (deadline - time.perf_counter()) / modes_left
    largest, why, last = None, "the ladder ended", None
    for width, depth in a.ladder:
        n = gpt_params(width, depth, a.vocab, a.seq)
        host_b, nvme_b = predicted(mode, width, depth, a.vocab, a.seq, a.host_slack)  # (imports fzero, torch: once)
        left = budget_end - time.perf_counter()
        if last is not None and last[1] * n / last[0] * 1.2 > left:
            why = f"the next size ({n / 1e9:.3g}B) is predicted to take longer than the {left:.0f} s left to this mode"
            break
        if host_b > 0.85 * mem_available():
            why = f"{n / 1e9:.3g}B needs ~{host_b / GIB:.0f} GiB of host memory, more than 85% of what is available"
            break
        if nvme_b and nvme_b > 0.85 * shutil.disk_usage(a.nvme_path).free:
            why = f"{n / 1e9:.3g}B needs ~{nvme_b / GIB:.0f} GiB in {a.nvme_path}, more than 85% of its free space"
            break
        rows, wall, status = train_child(mode, a, width, depth, min(left, a.run_timeout))
        row = rows[0] if rows else dict(bench="train", mode=mode, width=width, depth=depth,
                                         params_M=round(n / 1e6, 1), error=status.split(";")[0], detail=status)
        row.update(wall_s=round(wall, 1), host_pred_GiB=round(host_b / GIB, 1),
                   nvme_pred_GiB=round(nvme_b / GIB, 1))
        emit(row, a.out)
        if "error" in row:
            why = f"{row['params_M'] / 1e3:.3g}B failed: {row['error']}"
            break
        largest, last = row, (n, wall)
    emit(dict(bench="largest", mode=mode, params_M=largest and largest["params_M"],
              tok_s=largest and largest["tok_s"], peak_gpu_GiB=largest and largest["peak_gpu_GiB"],
              host_rss_peak_GiB=largest and largest["host_rss_peak_GiB"], stopped=why), a.out)


def search(mode: str, a, deadline: float, modes_left: int) -> None:
    """The largest of the mode's sizes (`--mode-sizes`, else `--sizes`) that trains, in few attempts: sizes from the largest down, each
    attempt in its own child with a time limit, stopping at the first that trains (`--steps`
    timed steps after one warm-up). A size predicted not to fit in 85% of the host's available
    memory or the NVMe folder's free space is skipped without an attempt (a "train" row with
    `skipped`); a failed attempt (oom, timeout, an error) moves to the next smaller size. The
    mode's share of the time left is `(deadline - now) / modes_left`; each attempt gets what is
    left of it, at most `--run-timeout`."""
    budget_end = time.perf_counter() + (deadline - time.perf_counter()) / modes_left
    sizes = sorted({parse_size(x, a.vocab, a.seq) for x in a.mode_sizes.get(mode, a.sizes)},
                   key=lambda wd: gpt_params(*wd, a.vocab, a.seq), reverse=True)
    found, why, attempts = None, "every size failed or was skipped", 0
    for width, depth in sizes:
        n = gpt_params(width, depth, a.vocab, a.seq)
        host_b, nvme_b = predicted(mode, width, depth, a.vocab, a.seq, a.host_slack)
        base = dict(bench="train", mode=mode, width=width, depth=depth, params_M=round(n / 1e6, 1),
                    host_pred_GiB=round(host_b / GIB, 1), nvme_pred_GiB=round(nvme_b / GIB, 1))
        left = budget_end - time.perf_counter()
        if left < 5:
            why = f"the mode's time ran out before {n / 1e9:.3g}B"
            break
        if host_b > 0.85 * mem_available():
            emit(dict(base, skipped=f"needs ~{host_b / GIB:.0f} GiB of host memory, more than 85% of the "
                                    f"{mem_available() / GIB:.0f} GiB available"), a.out)
            continue
        if nvme_b and nvme_b > 0.85 * shutil.disk_usage(a.nvme_path).free:
            emit(dict(base, skipped=f"needs ~{nvme_b / GIB:.0f} GiB in {a.nvme_path}, more than 85% of its "
                                    f"free space"), a.out)
            continue
        rows, wall, status = train_child(mode, a, width, depth, min(left, a.run_timeout))
        attempts += 1
        row = dict(base, **rows[0]) if rows else dict(base, error=status.split(";")[0], detail=status)
        row.update(wall_s=round(wall, 1), attempt=attempts)
        emit(row, a.out)
        if "error" not in row:
            found, why = row, f"the largest size that trained, after {attempts} attempt(s)"
            break
    emit(dict(bench="largest", mode=mode, params_M=found and found["params_M"], width=found and found["width"],
              depth=found and found["depth"], tok_s=found and found["tok_s"],
              peak_gpu_GiB=found and found["peak_gpu_GiB"], host_rss_peak_GiB=found and found["host_rss_peak_GiB"],
              attempts=attempts, stopped=why), a.out)


def driver(a) -> None:
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", "/tmp/torch_extensions_bench_offload")  # every child's op cache
    start = time.perf_counter()
    os.makedirs(a.nvme_path, exist_ok=True)
    emit(dict(bench="job", modes=a.modes, ladder=a.ladder, sizes=a.sizes, mode_sizes=a.mode_sizes,
              host_slack=a.host_slack, aio_root=a.aio_root, total_s=a.total, smoke=a.smoke, nvme_path=a.nvme_path,
              nvme_free_GiB=round(shutil.disk_usage(a.nvme_path).free / GIB, 1), nvme_fs=filesystem(a.nvme_path),
              host_available_GiB=round(mem_available() / GIB, 1), cpus=os.cpu_count()), a.out)
    reserve = a.mode_floor * len(a.modes)  # the sweeps' share, kept from the fixed phases
    deadline = start + a.total

    def cap(limit: float) -> float:
        return max(1.0, min(limit, deadline - time.perf_counter() - reserve))

    if not a.skip_build and any(m in DS_MODES for m in a.modes):
        rows, wall, status = child(["--child", "ds_build"], cap(a.build_timeout))
        for row in rows or [dict(bench="ds_build", error=status, wall_s=round(wall, 1))]:
            emit(row, a.out)
        if a.smoke:  # the smoke's time limit starts once the ops are built (a cold build takes minutes)
            deadline += time.perf_counter() - start
    if not a.skip_pcie:
        rows, _, status = child(["--child", "pcie", "--pcie-gib", str(a.pcie_gib)], cap(60))
        for row in rows or [dict(bench="pcie", error=status)]:
            emit(row, a.out)
    if not a.skip_adam:
        args = ["--child", "cpu_adam", "--adam-iters", str(a.adam_iters), "--adam-slow-max", str(a.adam_slow_max),
                "--adam-elements", *map(str, a.adam_elements)] + ([] if a.cpu_block is None else ["--cpu-block", str(a.cpu_block)])
        rows, wall, status = child(args, cap(a.adam_timeout))
        for row in rows:
            emit(row, a.out)
        if status:
            emit(dict(bench="cpu_adam", error=status, wall_s=round(wall, 1)), a.out)
    for i, mode in enumerate(a.modes):
        (search if a.sizes or mode in a.mode_sizes else sweep)(mode, a, deadline, len(a.modes) - i)
    emit(dict(bench="done", wall_s=round(time.perf_counter() - start, 1)), a.out)


def _mode_sizes(text: str) -> tuple[str, list[str]]:
    mode, _, sizes = text.partition("=")
    if mode not in MODES or not sizes:
        raise SystemExit(f"--mode-sizes {text!r}: expected MODE=S1,S2 with MODE one of {', '.join(MODES)}")
    return mode, sizes.split(",")


def _use_libaio(root: str) -> None:
    """Put an unpacked libaio's headers and library on the compiler's, the linker's and the
    loader's paths (this process's environment, which every child inherits): DeepSpeed's
    `AsyncIOBuilder.is_compatible` compiles a test against CFLAGS/LDFLAGS, its JIT build's g++
    reads CPATH/LIBRARY_PATH, and the op's `libaio.so.1` is found through LD_LIBRARY_PATH."""
    include, lib = os.path.join(root, "usr", "include"), os.path.join(root, "usr", "lib", "x86_64-linux-gnu")
    if not os.path.exists(os.path.join(include, "libaio.h")):
        raise SystemExit(f"--aio-root {root}: no usr/include/libaio.h there (unpack libaio-dev into it)")
    for name, flag, value in (("CFLAGS", "-I", include), ("LDFLAGS", "-L", lib)):
        os.environ[name] = " ".join(filter(None, (os.environ.get(name), flag + value)))
    for name, value in (("CPATH", include), ("LIBRARY_PATH", lib), ("LD_LIBRARY_PATH", lib)):
        os.environ[name] = ":".join(filter(None, (value, os.environ.get(name))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true",
                    help="every mode on a tiny model, < 2 minutes after DeepSpeed's ops are built")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--total", type=float, default=None, help="seconds for the whole job (default 530; smoke 110)")
    ap.add_argument("--run-timeout", type=float, default=240, help="seconds per training run")
    ap.add_argument("--mode-floor", type=float, default=None,
                    help="seconds per mode the fixed phases (PCIe, op build, CPU Adam) leave to the sweeps (45; smoke 9)")
    ap.add_argument("--start", type=int, default=0, help="first LADDER index of every sweep")
    ap.add_argument("--sizes", nargs="+", default=None,
                    help="find the largest that trains per mode instead of growing along LADDER: sizes as WxD "
                         "(width x depth) or params in billions (e.g. 12.8 8 5.1 2.7), tried from the largest down, "
                         "stopping at the first that trains (search)")
    ap.add_argument("--mode-sizes", nargs="+", default=[], metavar="MODE=S1,S2",
                    help="a search's sizes for one mode (e.g. fzero-cpu-params=4096x19,4096x16), in place of --sizes")
    ap.add_argument("--host-slack", type=float, default=HOST_SLACK,
                    help="fzero's measured host RSS over the estimate's host bytes, for the guard that skips sizes "
                         f"predicted not to fit (default {HOST_SLACK})")
    ap.add_argument("--aio-root", default=None,
                    help="a folder holding an unpacked libaio (`dpkg -x libaio1_*.deb DIR; dpkg -x libaio-dev_*.deb "
                         "DIR`) for DeepSpeed's async I/O op (ZeRO-Infinity) where the system has none: its include "
                         "and lib folders go on every child's CFLAGS/LDFLAGS/CPATH/LIBRARY_PATH/LD_LIBRARY_PATH")
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    ap.add_argument("--nvme-path", default="/tmp/fzero-bench-nvme", help="folder for fzero's and DeepSpeed's swap files")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=2)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3, help="timed steps, after one warm-up step")
    ap.add_argument("--host-impl", default="fused", choices=["fused", "foreach", "single", "default"],
                    help="fzero's adamw impl for the host update (default: fused, torch's vectorised CPU kernel; "
                         "'default' is fzero's own choice, foreach on host tensors)")
    ap.add_argument("--pcie-gib", type=float, default=1.0)
    ap.add_argument("--adam-elements", type=float, nargs="+", default=[1e8, 1e9])
    ap.add_argument("--adam-iters", type=int, default=3)
    ap.add_argument("--adam-slow-max", type=float, default=1e8, help="largest E for fzero's foreach / single impls")
    ap.add_argument("--cpu-block", type=int, default=None,
                    help="fzero.optim's CPU_BLOCK for the cpu_adam rows (elements per thread of one block of a CPU "
                         "foreach / single update; 1099511627776: one pass per op, as before the blocks)")
    ap.add_argument("--adam-timeout", type=float, default=120)
    ap.add_argument("--skip-pcie", action="store_true")
    ap.add_argument("--skip-adam", action="store_true")
    ap.add_argument("--skip-build", action="store_true", help="DeepSpeed's ops are built already")
    ap.add_argument("--build-timeout", type=float, default=300)
    # child-only
    ap.add_argument("--child", choices=["pcie", "ds_build", "cpu_adam", "train"], help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    ap.add_argument("--width", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--depth", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.mode_sizes = dict(_mode_sizes(x) for x in a.mode_sizes)
    if a.aio_root:
        _use_libaio(a.aio_root)
    if a.child == "pcie":
        emit(bench_pcie(a), None)
        return
    if a.child == "ds_build":
        for row in bench_ds_build(a):
            emit(row, None)
        return
    if a.child == "cpu_adam":
        bench_cpu_adam(a)
        return
    if a.child == "train":
        emit(bench_train(a), None)
        return
    if a.smoke:
        a.ladder = SMOKE["ladder"] if not a.sizes else ()
        a.vocab, a.seq, a.micro, a.heads = SMOKE["vocab"], SMOKE["seq"], SMOKE["micro"], SMOKE["heads"]
        a.adam_elements, a.pcie_gib, a.adam_timeout, a.run_timeout = [1e6], 1 / 64, 30, 40
        a.total = a.total or 110
        a.mode_floor = 9 if a.mode_floor is None else a.mode_floor
    else:
        a.ladder = LADDER[a.start:]
        a.total = a.total or 530
        a.mode_floor = 45 if a.mode_floor is None else a.mode_floor
    driver(a)


if __name__ == "__main__":
    main()
