"""BENCHMARKS.md's figure from the committed JSON lines: tokens/s and peak memory per mode.

Run:  python benchmarks/plot.py benchmarks/results-1xH200-2026-12-01-b.jsonl benchmarks/h200-n1.png
"""

from __future__ import annotations

import json
import sys


def main(src: str, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in open(src) if line.startswith("{")]
    rows = [r for r in rows if "tok_s_per_gpu" in r]
    names = [r["mode"] for r in rows]
    colors = ["tab:gray" if not n.startswith("fzero") else "tab:blue" for n in names]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.barh(names, [r["tok_s_per_gpu"] / 1e3 for r in rows], color=colors)
    ax1.set_xlabel("tokens/s per GPU (thousands)")
    ax2.barh(names, [max(r["peak_mem_GiB_per_rank"]) for r in rows], color=colors)
    ax2.set_xlabel("peak GiB per rank")
    ax2.set_yticklabels([])
    for ax in (ax1, ax2):
        ax.invert_yaxis()
    fig.suptitle(f"{rows[0]['params_M']:.0f}M-parameter GPT, N = {rows[0]['world']}, torch {rows[0]['torch']}")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"saved {out}")


if __name__ == "__main__":
    main(*sys.argv[1:3])
