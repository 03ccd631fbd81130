"""What README's checkpoint paragraph says of RNG states and the data position: each rank's torch
RNG state is saved and restored at the saved world size (not with `restore_rng=False`, not at
another world size); Python's `random` is never restored; on a SimMesh the restored state lasts
to the end of the `mesh.run` that loaded it; `buffers={"batches_seen": torch.tensor(t)}` comes
back into the tensor `load` is given (found in review: the README wrote an int, which `save`
refuses, and said nothing of the RNG)."""

from __future__ import annotations

import random

import torch

import fzero
import fzero.checkpoint as ck
from fzero import optim

PARAMS = {"w": torch.linspace(-1.0, 1.0, 6)}


def _saved(root: str, n: int) -> str:
    """A checkpoint of `n` ranks, each rank's RNG seeded by its rank before the save."""
    mesh = fzero.SimMesh(n)

    def rank():
        state = fzero.init(PARAMS, optim.sgd(0.1), stage=1, mesh=mesh)
        torch.manual_seed(100 + mesh.rank)
        return ck.save(state, root, buffers={"batches_seen": torch.tensor(7)})

    return mesh.run(rank)[0]


def test_the_torch_rng_is_restored_at_the_saved_world_size_and_random_is_not(tmp_path):
    path = _saved(str(tmp_path), 2)
    mesh = fzero.SimMesh(2)

    def rank(restore):
        target = fzero.init(PARAMS, optim.sgd(0.1), stage=1, mesh=mesh)
        torch.manual_seed(0)
        random.seed(0)
        seen = torch.tensor(0)
        ck.load(path, target, restore_rng=restore, buffers={"batches_seen": seen})
        torch_draw, python_draw = torch.rand(3), random.random()
        torch.manual_seed(100 + mesh.rank)  # the saved rank's state, drawn from afresh
        random.seed(0)
        return int(seen), torch.equal(torch_draw, torch.rand(3)), python_draw == random.random()

    assert mesh.run(lambda: rank(True)) == [(7, True, True)] * 2  # random: the seed the rank set, not a saved one
    assert mesh.run(lambda: rank(False)) == [(7, False, True)] * 2


def test_at_another_world_size_the_rng_is_left_as_it_is(tmp_path):
    path = _saved(str(tmp_path), 2)
    mesh = fzero.SimMesh(1)

    def rank():
        target = fzero.init(PARAMS, optim.sgd(0.1), stage=1, mesh=mesh)
        torch.manual_seed(5)
        before = torch.get_rng_state()
        ck.load(path, target, buffers={"batches_seen": torch.tensor(0)})
        return torch.equal(torch.get_rng_state(), before)

    assert mesh.run(rank) == [True]


def test_on_a_simmesh_the_restored_state_lasts_to_the_end_of_the_run_that_loaded_it(tmp_path):
    path = _saved(str(tmp_path), 1)
    mesh = fzero.SimMesh(1)
    target = mesh.run(lambda: fzero.init(PARAMS, optim.sgd(0.1), stage=1, mesh=mesh))[0]
    torch.manual_seed(9)
    caller = torch.get_rng_state()
    mesh.run(lambda: ck.load(path, target, buffers={"batches_seen": torch.tensor(0)}))
    assert torch.equal(torch.get_rng_state(), caller)  # the next run starts from the caller's, not the saved one
