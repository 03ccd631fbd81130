"""The per-step passes fzero adds to a step, timed one by one on the GPU (what each full pass over
the gradient costs, and its transient memory): the float64 sum of squares three ways, the
non-finite check, x * 1.0, torch.cat of per-leaf gradients, the assembly of per-leaf bf16
gradients into fp32 flat slices (one copy per leaf, or one `_foreach_copy_`), a world-size-1 NCCL
all-gather and reduce-scatter. One JSON line per probe (`GBps`: the fp32 buffer's bytes per second).

Run (one GPU):  torchrun --nproc-per-node 1 benchmarks/bench_kernels.py --numel 1343000000
                (`--only assemble,copy`: those probes alone)
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.distributed as dist


def timed(fn, reps: int = 5) -> tuple[float, float]:
    """(median ms, peak extra GiB) of fn() on the current CUDA stream."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2], (torch.cuda.max_memory_allocated() - base) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=1_343_000_000)
    ap.add_argument("--leaves", type=int, default=200)
    ap.add_argument("--only", default="", help="comma-separated probe names (prefixes) to run; default all")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(0)
    n = a.numel
    g = torch.randn(n, device="cuda")
    chunk = 1 << 24
    parts = list(g.split(n // a.leaves))
    half = torch.randn(n, device="cuda", dtype=torch.bfloat16)  # per-leaf bf16 gradients -> fp32 flat slices
    half_parts, flat_parts = list(half.split(n // a.leaves)), list(g.split(n // a.leaves))

    def per_leaf():
        for d, s in zip(flat_parts, half_parts):
            d.copy_(s)

    def chunked():
        acc = torch.zeros((), dtype=torch.float64, device="cuda")
        for c in g.split(chunk):
            acc += c.to(torch.float64).square().sum()
        return acc

    probes = {
        "sumsq_f64_materialised": lambda: g.to(torch.float64).square().sum(),
        "sumsq_vector_norm_f64": lambda: torch.linalg.vector_norm(g, 2, dtype=torch.float64),
        "sumsq_f64_chunked_16M": chunked,
        "sumsq_vector_norm_f32": lambda: torch.linalg.vector_norm(g, 2),
        "sumsq_dot_f32": lambda: torch.dot(g, g),
        "sum_f32": lambda: g.sum(),
        "aminmax": lambda: torch.aminmax(g),
        "sum_f64_nonfinite": lambda: torch.isfinite(g.sum(dtype=torch.float64)),
        "isfinite_all": lambda: torch.isfinite(g).all(),
        "mul_one": lambda: g * 1.0,
        "copy": lambda: g.clone(),
        "cat_leaves": lambda: torch.cat(parts),
        "assemble_bf16_per_leaf": per_leaf,  # fzero's gradient assembly before the seventh session
        "assemble_bf16_foreach": lambda: torch._foreach_copy_(flat_parts, half_parts),  # unit.copy_all
        "nccl_all_gather_n1": lambda: dist.all_gather_into_tensor(torch.empty_like(g), g),
        "nccl_reduce_scatter_n1": lambda: dist.reduce_scatter_tensor(torch.empty_like(g), g),
    }
    exact = g.to(torch.float64).square().sum()
    # is a fused fp32 reduction the same bits on a shard that is an (unaligned) view and on a copy?
    only = tuple(x for x in a.only.split(",") if x)
    probes = {k: f for k, f in probes.items() if not only or k.startswith(only)}
    for off in (() if only else (0, 1, 2, 4, 1024)):
        view = g[off : off + n // 2]
        same = {k: bool(torch.equal(f(view), f(view.clone()))) for k, f in
                (("vector_norm", lambda t: torch.linalg.vector_norm(t, 2)), ("dot", lambda t: torch.dot(t, t)),
                 ("sum", lambda t: t.sum()))}
        print(json.dumps({"probe": "view_vs_copy_bits", "offset": off, "same": same}), flush=True)
    for name, fn in probes.items():
        ms, gib = timed(fn)
        out = fn()
        row = {"probe": name, "numel": n, "ms": round(ms, 3), "extra_GiB": round(gib, 3),
               "GBps": round(g.numel() * 4 / ms / 1e6, 1)}
        if name.startswith("sumsq"):
            v = (out.double().square() if "vector_norm" in name else out.double())
            row["rel_diff_vs_materialised"] = float((v - exact).abs() / exact)
        print(json.dumps(row), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
