"""Review of the unwaited-collective code (`DistMesh._p2p_tag`, `Mesh.abandon`, `Mesh.waits_after`,
`Inflight.settle`, `Gathering.finish`) over gloo `DistMesh`es at N = 2, where all-gathers and
reduce-scatters are point-to-point exchanges that gloo matches by tag and cancels when their work
handle is freed, and all-reduces are gloo's own collectives, which it runs to the end whoever
holds their handle.

The scenarios share one pool of their own (an exchange only one rank started stays behind in
its group), each on a gloo group of its own with a short timeout `T`.
"""

from __future__ import annotations

import datetime
import gc
import time
import weakref

import pytest
import torch

import fzero
import fzero.testing

T = 2.0  # the gloo groups' and the meshes' timeout, seconds


def _group() -> object:
    return torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(seconds=T))


def _released(ref: weakref.ref, within: float = 2.0) -> bool:
    """Whether the tensor `ref` names is freed within `within` s (garbage collected meanwhile):
    the backend's own threads let go of a finished collective's tensors a moment after its peers
    see it done."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        gc.collect()
        if ref() is None:
            return True
        time.sleep(0.01)
    return False


# -- 1. two meshes over one process group: one tag space -------------------------------------------


def one_sided_exchange_on_another_mesh_of_the_group(_pool_mesh):
    """On a pool worker: two `DistMesh(verify=False)` over one gloo group; rank 0 starts an
    all-gather on the first that rank 1 never starts, and keeps it (as a rank that raised keeps
    what it prefetched, `Mesh.abandon`); then both all-gather the same op, dtype, shape and tag
    on the second. Returns what the shared all-gather gave (floats), or the error's type name."""
    group = _group()
    first = fzero.DistMesh(group, verify=False, timeout=T)
    second = fzero.DistMesh(group, verify=False, timeout=T)
    held = first.start("all_gather", torch.full((2,), 100.0 + first.rank), tag="x") if first.rank == 0 else None
    try:
        return second.collective("all_gather", torch.full((2,), 10.0 + second.rank), tag="x").tolist()
    except fzero.MeshError as e:
        return type(e).__name__ + ("" if held is None else " (held)")


def exchange_after_ranks_made_different_numbers_of_meshes(_pool_mesh):
    """On a pool worker: rank 0 has made 5 more DistMesh than rank 1 (as a rank of more subgroups
    would have), then both make one over a new group and all-gather on it. Returns the floats
    gathered, and the mesh's ordinal."""
    from fzero._src import mesh as mesh_module

    if torch.distributed.get_rank() == 0:
        mesh_module._NEXT_ORDINAL[0] += 5
    m = fzero.DistMesh(_group(), verify=False, timeout=T)
    return m.collective("all_gather", torch.full((2,), 10.0 + m.rank), tag="x").tolist(), m._ordinal


# -- 2. what `abandon` keeps: only what gloo would cancel ------------------------------------------


def abandon_an_all_reduce_and_an_all_gather(_pool_mesh):
    """On a pool worker, over `DistMesh(verify=False)`: for an all-reduce (gloo's own collective)
    and an all-gather (a point-to-point exchange at N = 2), rank 1 starts it and hands it to
    `Mesh.abandon` at once; rank 0 starts it half a second later and waits for it. Returns, per
    op, rank 0's result and, on rank 1, whether the abandoned collective's result tensor was
    freed once rank 0 had it (a last all-reduce tells rank 1 so)."""
    m = fzero.DistMesh(_group(), verify=False, timeout=T)
    got = {}
    for op in ("all_reduce", "all_gather"):
        x = torch.full((2,), 10.0 + m.rank)
        if m.rank == 1:
            pending = m.start(op, x, arg="sum" if op == "all_reduce" else None, tag=op)
            ref = weakref.ref(pending.result)
            m.abandon(pending)
            del pending
            m.collective("all_reduce", torch.zeros(1), arg="sum", tag="done")
            got[op] = _released(ref)
        else:
            time.sleep(0.5)
            got[op] = m.collective(op, x, arg="sum" if op == "all_reduce" else None, tag=op).tolist()
            m.collective("all_reduce", torch.zeros(1), arg="sum", tag="done")
    return got


# -- the tests --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    with fzero.testing.Pool(2, timeout=60) as p:  # a pool of its own: one-sided exchanges stay behind
        yield p


@pytest.mark.dist
def test_an_exchange_one_rank_left_on_one_mesh_never_feeds_another_mesh_of_the_group(pool):
    """Two `DistMesh` over one process group share gloo's point-to-point tag space, and each
    counted its exchanges from 0: the first exchange of a collective on the second mesh had the
    tag of the first exchange of the same collective on the first (`_p2p_tag`). Rank 0's
    one-sided gather on the first mesh then fed rank 1's gather on the second -- rank 1 got
    rank 0's 100.0 where rank 0 had sent 10.0, silently, and rank 0 waited out the timeout
    (found in review). Each mesh's tags now carry an ordinal its ranks agree on at construction
    (distinct for every DistMesh of a process), so the shared gather gives both ranks the
    right values."""
    got = pool.run(one_sided_exchange_on_another_mesh_of_the_group)
    assert got == [[10.0, 10.0, 11.0, 11.0]] * 2, got


@pytest.mark.dist
def test_ranks_that_made_different_numbers_of_meshes_agree_on_the_new_ones_tags(pool):
    """The ordinal in a mesh's exchange tags is the largest any rank proposed at its construction,
    so ranks that made different numbers of DistMesh before (subgroups) still tag alike: a
    per-process count would have made rank 0's tags differ from rank 1's and every exchange wait
    out the timeout."""
    (got0, ordinal0), (got1, ordinal1) = pool.run(exchange_after_ranks_made_different_numbers_of_meshes)
    assert got0 == got1 == [10.0, 10.0, 11.0, 11.0], (got0, got1)
    assert ordinal0 == ordinal1, (ordinal0, ordinal1)


@pytest.mark.dist
def test_abandon_keeps_only_the_exchanges_gloo_would_cancel(pool):
    """`DistMesh.abandon` keeps an unwaited point-to-point exchange alive (gloo cancels it when
    its handle is freed, and the peer that waits for it would wait out the timeout), but a
    collective the backend runs to the end anyway (gloo's all-reduce here, standing in for every
    NCCL collective, which this suite cannot run) it kept too, with its buffers, until 64 later
    ones pushed it out: after a step that raised with a stage-3 gather or a bucket's reduction in
    flight (`verify=False`, a `MeshError`, an interrupt), that memory stayed held, in a run that
    raises rarely to its end (found in review). Now only the exchange is kept; the peer gets its
    data either way."""
    got = pool.run(abandon_an_all_reduce_and_an_all_gather)
    assert got[0] == {"all_reduce": [21.0, 21.0], "all_gather": [10.0, 10.0, 11.0, 11.0]}, got
    assert got[1] == {"all_reduce": True, "all_gather": False}, got
