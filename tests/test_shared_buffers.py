"""A module's buffers written in place on a SimMesh, whose ranks share them (`module.buffers_written`).

SimMesh's ranks are threads of one process running one module, so they share its buffers
(BatchNorm's running statistics and count). `checkpoint.load(..., buffers=)` and
`fzero.broadcast_buffers` write them on each rank in its turn, after that rank's last collective;
before, rank 0 went on into its next forward while rank 1 had still to write: rank 0's backward
then raised torch's "modified by an inplace operation" (stage 2), or rank 1's write overwrote rank
0's forward update (a count of 3 where the uninterrupted run has 4), found in review. Both now end
with one small collective on a SimMesh, so a resumed run is the uninterrupted run, bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.bn, self.b = nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


def run(stage: int, between, tmp_path) -> tuple[dict, dict]:
    """Two SGD steps of `Net` on SimMesh(2) at `stage`, `between(state, info, mesh)` run on every
    rank between them: (the buffers after, rank 0's gathered params after)."""
    torch.manual_seed(0)
    model = Net()
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
    step = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]))
    mesh = fzero.SimMesh(2)

    def rank_fn(seed: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        state = fzero.init(params, fzero.optim.sgd(0.1, momentum=0.9), stage=stage, mesh=mesh, units=info.units)
        for k in range(2):
            if k:
                state = between(state, info, mesh)
            state, _ = step(state, (torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)))
        return fzero.gather(state)

    gathered = mesh.run(rank_fn, [(1,), (2,)])
    return {k: v.clone() for k, v in info.buffers.items()}, gathered[0]


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_resume_that_loads_the_buffers_is_the_uninterrupted_run_on_simmesh(stage, tmp_path):
    """One step, `save(..., buffers=)`, `load(..., buffers=)`, one step: the buffers (count 4:
    two ranks, two steps) and params equal two steps straight, at every stage (before: stage 2
    raised torch's in-place error in the second step's backward; stage 0 counted 3)."""

    def resume(state, info, mesh):
        path = fzero.checkpoint.save(state, str(tmp_path), buffers=info.buffers)
        return fzero.checkpoint.load(path, state, buffers=info.buffers)

    buffers, params = run(stage, resume, tmp_path)
    straight_buffers, straight_params = run(stage, lambda state, info, mesh: state, tmp_path)
    assert int(buffers["bn.num_batches_tracked"]) == 4
    assert_same(buffers, straight_buffers)
    assert_same(params, straight_params)


@pytest.mark.parametrize("stage", [0, 2])
def test_broadcast_buffers_between_steps_keeps_every_ranks_update_on_simmesh(stage, tmp_path):
    """`broadcast_buffers` between two steps on SimMesh (where the buffers are rank 0's already):
    the buffers and params of two steps straight (before: rank 1's copy, taken at the broadcast,
    overwrote rank 0's second forward update, a count of 3)."""
    buffers, params = run(stage, lambda state, info, mesh: (fzero.broadcast_buffers(info, mesh), state)[1], tmp_path)
    straight_buffers, straight_params = run(stage, lambda state, info, mesh: state, tmp_path)
    assert int(buffers["bn.num_batches_tracked"]) == 4
    assert_same(buffers, straight_buffers)
    assert_same(params, straight_params)
