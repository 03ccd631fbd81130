"""Host time of the per-step compile checks `eager_step` runs (the forty-sixth session's
BENCHMARKS section): the refusal of a compiled loss over nested on-use params
(`gathering.refuse_compiled_placeholders`) and the compiled-model warning under engine="func"
(`step._warn_compiled_module_under_func`), each timed over 200,000 calls on a 100-leaf layout,
the call of an empty lambda subtracted.

    python benchmarks/bench_step_checks.py
"""

from __future__ import annotations

import timeit

import torch

import fzero
from fzero import optim
from fzero._src.gathering import refuse_compiled_placeholders
from fzero._src.step import _warn_compiled_module_under_func

CALLS = 200_000


def main() -> None:
    mesh = fzero.SimMesh(1)

    def rank() -> None:
        state = fzero.init({f"l{i}.w": torch.ones(4) for i in range(100)}, optim.sgd(0.1), stage=0, mesh=mesh)
        config = fzero.train_step(lambda p, x: sum(v.sum() for v in p.values())).config

        def per_call(fn) -> float:
            return timeit.timeit(fn, number=CALLS) / CALLS

        empty = per_call(lambda: None)
        refuse = per_call(lambda: refuse_compiled_placeholders(config.loss_compiled, state.layout, config.gather))
        warn = per_call(lambda: _warn_compiled_module_under_func(config, state.layout))
        print(f"refuse_compiled_placeholders: {(refuse - empty) * 1e9:.0f} ns; "
              f"_warn_compiled_module_under_func: {(warn - empty) * 1e9:.0f} ns (empty lambda {empty * 1e9:.0f} ns)")

    mesh.run(rank)


if __name__ == "__main__":
    main()
