"""Functions the torchrun workers of `fzero.testing.Pool` run for tests/test_allreduce.py, as
`fn(mesh, *args)` (the mesh first, so a test runs the same function on a `SimMesh` too)."""

from __future__ import annotations

import torch


def reduce_forms(mesh, x):
    """A sum over ranks of `x[N * S]` in both forms, blocking and started: `all_reduce(x)` and
    `all_gather(reduce_scatter(x))`."""
    blocking = {"all_reduce": mesh.collective("all_reduce", x, arg="sum"),
                "rs_ag": mesh.collective("all_gather", mesh.collective("reduce_scatter", x))}
    ar = mesh.start("all_reduce", x, arg="sum")
    rs = mesh.start("reduce_scatter", x)
    started = {"all_reduce": ar.wait(), "rs_ag": mesh.start("all_gather", rs.wait()).wait()}
    return {"blocking": blocking, "started": started}
