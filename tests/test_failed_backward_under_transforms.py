"""A step differentiated through (a meta-gradient, `engine="func"`) whose backward raised, caught
by the caller. Found in the twenty-ninth review: `step.drop_unrun_backward` was skipped under a
torch.func transform, which left the nodes torch's engine had not run in the thread's ready queue,
holding the step's graph (activations, the units' Function contexts) until the next backward on
the thread, or for good after the last.
"""

from __future__ import annotations

import gc

import pytest
import torch

import fzero
from fzero import optim
from fzero.testing import assert_trees_equal

from .test_no_leaks import _RaisingBackward  # the identity, whose backward raises


def _graph_tensors() -> int:
    """After a collection: how many tensors the collector reaches have a grad_fn."""
    gc.collect()
    with torch._C.DisableTorchFunctionSubclass():
        return sum(1 for o in gc.get_objects() if issubclass(type(o), torch.Tensor) and o.grad_fn is not None)


def _loss(p, x):
    h = torch.tanh(x @ p["w"]).softmax(-1)  # activations the graph saves
    return h.square().mean() + _RaisingBackward.apply(h.sum())


# torch 2.13 loads its forward-AD decompositions through torch.jit.script on a process's first jvp,
# which warns (torch's own deprecation, as tests/func_cases.py says)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp"])
def test_a_step_whose_backward_raised_under_a_transform_lets_go_of_its_graph(transform):
    """SimMesh(1), stage 0, `engine="func"`, the step called under `torch.func.<transform>` (its
    loss read as a function of a scale): once the error reaches the caller, no tensor with a
    grad_fn is alive that was not before (before the fix, the step's graph, left in the engine's
    ready queue, stayed until the next backward of the thread)."""
    mesh = fzero.SimMesh(1)

    def main():
        torch.manual_seed(0)
        state = fzero.init({"w": torch.randn(6, 6)}, optim.sgd(0.1), stage=0, mesh=mesh)
        step = fzero.train_step(_loss, engine="func")
        x = torch.randn(5, 6)
        f = lambda s: step(state, x)[1].loss * s  # noqa: E731
        one = torch.tensor(1.0)
        before = _graph_tensors()
        with pytest.raises(ValueError, match="refused in the backward"):
            if transform == "grad":
                torch.func.grad(f)(one)
            elif transform == "vjp":
                torch.func.vjp(f, one)
            else:
                torch.func.jvp(f, (one,), (one,))
        return before, _graph_tensors()

    before, after = mesh.run(main)[0]
    assert after <= before, f"{after} tensors with a grad_fn alive after the step, {before} before"


def test_a_meta_gradient_through_a_step_still_runs_after_one_whose_backward_raised():
    """The same step, under `torch.func.grad`: one whose backward raised, then one that does not
    raise gives the meta-gradient of an unfailed run (the dropped nodes are not run)."""
    mesh = fzero.SimMesh(1)
    raising = [True]

    def loss(p, x):
        h = torch.tanh(x @ p["w"])
        out = h.square().mean()
        return out + _RaisingBackward.apply(h.sum()) if raising[0] else out

    def main():
        torch.manual_seed(0)
        state = fzero.init({"w": torch.randn(6, 6)}, optim.sgd(0.1), stage=0, mesh=mesh)
        step = fzero.train_step(loss, engine="func")
        x = torch.randn(5, 6)
        meta = lambda: torch.func.grad(lambda s: step(state, x * s)[1].loss)(torch.tensor(1.0))  # noqa: E731
        raising[0] = False
        clean = meta()
        raising[0] = True
        with pytest.raises(ValueError, match="refused in the backward"):
            meta()
        raising[0] = False
        return clean, meta()

    clean, again = mesh.run(main)[0]
    assert_trees_equal(clean, again, bitwise=True)
