"""A call every rank must make, made on some ranks only (the DDP habit of `if rank == 0:` around a
save or a gather): the mismatch names the call and says every rank must make it, on every rank,
and is not read as the model's path parting (`DivergentPaths`, whose advice -- gather='eager', a
data-dependent branch -- is not the way out). Found in a new user's walkthrough."""

from __future__ import annotations

import pytest
import torch

import fzero
import fzero.checkpoint as ck
from fzero import optim
from fzero._src.mesh import CollectiveMismatch


def _two_units():
    return {"a": torch.ones(4, 4), "b": torch.ones(4)}


@pytest.mark.parametrize("call", ["gather", "save"])
def test_a_call_made_on_rank_0_only_is_named_on_every_rank(tmp_path, call):
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(lambda p, x: ((x @ p["a"]) + p["b"]).square().sum())

    def rank_fn(x):
        s = fzero.init(_two_units(), optim.sgd(0.1), stage=3, mesh=mesh, units=lambda path: path)
        try:
            if mesh.rank == 0:
                fzero.gather(s) if call == "gather" else ck.save(s, str(tmp_path))
            s, _ = step(s, x)
        except Exception as e:  # noqa: BLE001 - each rank's error is the result
            return e
        return None

    errors = mesh.run(rank_fn, [(torch.ones(2, 4),), (torch.ones(2, 4),)])
    name = "fzero.gather" if call == "gather" else "fzero.checkpoint.save / load"
    for e in errors:
        assert type(e) is CollectiveMismatch, repr(e)
        assert f"rank 0 is in {name}, which every rank must call at the same point of its program (not under " \
               f"`if rank == 0:`" in str(e), str(e)
        assert "gather='eager'" not in str(e)


def test_a_collective_after_a_rank_left_run_on_an_error_raises_naming_it():
    """Both ranks meet a `CollectiveMismatch`; rank 0 lets it leave its function (the run's
    status for it: failed), rank 1 catches it and calls one more all-reduce, with no rank to pair
    with: a `CollectiveMismatch` saying rank 0 already returned from `mesh.run`. A mutation audit
    found a mutant counting only ranks that returned normally pass the suite, and rank 1's
    all-reduce returned None."""
    mesh, got = fzero.SimMesh(2), {}

    def fn(r):
        try:
            fzero.collectives.all_reduce(torch.ones(1), mesh, tag=f"t{r}")
        except CollectiveMismatch:
            if r == 0:
                raise
        try:
            got["next"] = fzero.collectives.all_reduce(torch.ones(1), mesh)
        except CollectiveMismatch as e:
            got["next"] = str(e)

    with pytest.raises(CollectiveMismatch):
        mesh.run(fn, [(0,), (1,)])
    assert isinstance(got["next"], str) and "rank 1 calls all_reduce(float32[1], sum) but rank(s) [0] already " \
                                               "returned from mesh.run" in got["next"], got
