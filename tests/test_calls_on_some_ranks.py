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
