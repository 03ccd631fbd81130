"""Upper bounds, not results: how much faster a step would be without one of fzero's own passes.

Runs `bench_stages.py` with a pass removed by a patch, so the numbers it trains on are WRONG
(timing only; the loss it prints shows it):
  WHATIF=noassemble  each unit's backward returns a zero buffer made once, instead of
                     assembling its gradient (no copy, no zero fill);
  WHATIF=noends      no finite check of the updated params (the state's pending flag is 0);
  WHATIF=both        both.
Run beside the real modes in one job, e.g. (1 GPU):
  WHATIF=noassemble torchrun --nproc-per-node 1 benchmarks/whatif.py --stage 0 --steps 20
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fzero._src import step, unit  # noqa: E402

WHAT = os.environ.get("WHATIF", "")


def _cached_zeros() -> object:
    made = {}

    def assemble(bucket, grads, dtype, device, side=None):
        key = (id(bucket), dtype, str(device))
        if key not in made:
            made[key] = torch.zeros(bucket.size, dtype=dtype, device=device)
        return made[key]

    return assemble


if WHAT in ("noassemble", "both"):
    unit._assemble = _cached_zeros()
if WHAT in ("noends", "both"):
    step.Ends.of = staticmethod(lambda state, donate: None)
    step._nonfinite_flag = lambda state, updated, taken=None: torch.zeros((), device=state.mesh.device)
if WHAT not in ("", "noassemble", "noends", "both"):
    sys.exit(f"WHATIF={WHAT!r}: expected noassemble, noends or both")

import bench_stages  # noqa: E402

if __name__ == "__main__":
    bench_stages.main()
