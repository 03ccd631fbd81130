"""A rank's `ZeroState` (`fzero._src.state`): a pytree of tensors only, made by `init` with checks.

- `optree.tree_map(f, state)` and `torch.utils._pytree.tree_map(f, state)` call `f` on the
  state's tensors only (params, optimizer state, the step counter) -- never on its layout,
  stage, mesh, rank or optimizer, never on a frozen bucket's missing optimizer state -- and
  rebuild a `ZeroState` with the same static `info`, in every stage.
- What is left to get wrong when the step reads stage, mesh and optimizer from the state: a
  state handed to another rank, a loss that is not a 0-d float, a stage or gather mode that
  does not exist; each is a `FzeroError` naming it.
- `init` rejects ranks whose leaves have the same element count but another shape, and one
  tensor at two paths.
"""

from __future__ import annotations

import optree
import pytest
import torch
import torch.utils._pytree as torch_pytree

import fzero
from fzero import optim


def test_state_misuse_errors():
    """The step reads stage, mesh and optimizer from the state, so they cannot disagree; what is
    left to get wrong: a state handed to another rank (it would update another rank's elements),
    a loss that is not a 0-d float, a stage that does not exist."""
    params = {"a": torch.arange(4.0)}
    mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)

    def rank_fn():
        state = fzero.init(params, opt, stage=3, mesh=mesh)
        with pytest.raises(fzero.FzeroError, match=r"0-d floating tensor.*got Tensor torch.float32 torch.Size\(\[4\]\); "
                                                   r"reduce it to one number, e.g. loss.mean\(\)"):
            fzero.train_step(lambda p, c: p["a"])(state, None)  # (the way out: found in review)
        with pytest.raises(fzero.FzeroError, match="got Tensor torch.int64 torch.Size.*in a floating dtype"):
            fzero.train_step(lambda p, c: (p["a"] > 0).sum())(state, None)
        return state

    states = mesh.run(rank_fn)
    swapped = [(states[1],), (states[0],)]
    with pytest.raises(fzero.FzeroError, match=r"belongs to rank 1 of SimMesh.* runs on rank 0"):
        mesh.run(lambda s: fzero.gather(s), swapped)
    with pytest.raises(fzero.FzeroError, match=r"belongs to rank 1 of SimMesh.* runs on rank 0"):
        mesh.run(lambda s: fzero.train_step(lambda p, c: p["a"].sum())(s, None), swapped)
    with pytest.raises(fzero.ConfigError, match="stage must be 0, 1, 2 or 3"):
        mesh.run(lambda: fzero.init(params, opt, stage=4, mesh=mesh))
    with pytest.raises(fzero.ConfigError, match="gather must be one of"):
        fzero.train_step(lambda p, c: p, gather="lazy")


def test_init_rejects_other_shape_same_numel_and_one_tensor_twice():
    mesh, opt = fzero.SimMesh(2), optim.sgd(0.1)
    with pytest.raises(fzero.LayoutError, match=r"at leaf 'w'.*same count, other shape or dtype"):
        mesh.run(lambda shape: fzero.init({"w": torch.ones(shape)}, opt, stage=3, mesh=mesh), [((2, 3),), ((3, 2),)])
    w = torch.ones(3)
    with pytest.raises(fzero.LayoutError, match="'a' and 'b' are the same tensor"):
        mesh.run(lambda: fzero.init({"a": w, "b": w}, opt, stage=0, mesh=mesh))


def _tensors(x) -> list[torch.Tensor]:
    """The tensors in nested tuples (NamedTuples included) and Nones, read without a pytree library."""
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, tuple):
        return [t for y in x for t in _tensors(y)]
    raise TypeError(f"a {type(x).__name__} in a state's tensors")


TREE_MAPS = {"optree": optree.tree_map, "torch": torch_pytree.tree_map}  # no namespace argument


@pytest.mark.parametrize("library", sorted(TREE_MAPS))
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tree_map_over_a_state_sees_tensors_only_and_keeps_its_info(stage, library):
    """A frozen bucket (optimizer state None) next to a trained one with AdamW's state (a
    NamedTuple of a "leaf" step count and two shards); `f` adds one, so the rebuilt state
    shows that it holds `f`'s outputs."""
    params = {"a": torch.arange(5.0), "frozen": {"w": torch.ones(2, 3)}, "b": torch.zeros(())}
    frozen = fzero.ParamGroup("frozen", match=lambda p: p.startswith("frozen"), frozen=True)
    mesh, opt = fzero.SimMesh(2), optim.adamw(0.1)
    states = mesh.run(lambda: fzero.init(params, opt, stage=stage, mesh=mesh, groups=[frozen]))
    for state in states:
        assert None in state.opt_state and any(s is not None for s in state.opt_state)
        want = _tensors(state.params) + _tensors(state.opt_state) + [state.step]
        seen = []

        def f(x):
            seen.append(x)
            return x + 1 if isinstance(x, torch.Tensor) else x

        out = TREE_MAPS[library](f, state)
        assert {type(x) for x in seen} == {torch.Tensor}, f"{library}.tree_map passed {[type(x) for x in seen]}"
        assert len(seen) == len(want) and {id(x) for x in seen} == {id(x) for x in want}
        assert type(out) is fzero.ZeroState and out.info is state.info
        for name in ("layout", "stage", "mesh", "rank", "optimizer"):
            assert getattr(out, name) is getattr(state, name)
        assert [s is None for s in out.opt_state] == [s is None for s in state.opt_state]
        got = _tensors(out.params) + _tensors(out.opt_state) + [out.step]
        assert len(got) == len(want) and all(torch.equal(y, x + 1) for x, y in zip(want, got))


@pytest.mark.parametrize("library", sorted(TREE_MAPS))
def test_tree_map_over_two_states_of_two_inits_of_one_optimizer(library):
    """Two `init`s of one optimizer (serials 1 and 2: `StateInfo.serial`, which the step's
    agreement compares, is not compared by `==`) have equal infos, so a tree_map over both (the
    difference of two runs' states) works. A mutation audit's survivor compared the serial:
    "Node context mismatch for custom node type ZeroState"."""
    mesh, opt = fzero.SimMesh(1), optim.sgd(0.1)

    def run():
        a = fzero.init({"w": torch.ones(4)}, opt, stage=0, mesh=mesh)
        b = fzero.init({"w": torch.zeros(4)}, opt, stage=0, mesh=mesh)
        return a, b

    (a, b), = mesh.run(run)
    assert a.info.serial != b.info.serial and a.info == b.info
    diff = TREE_MAPS[library](lambda x, y: x - y, a, b)
    assert torch.equal(diff.params[0], torch.ones(4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA mesh: needs a GPU")
def test_params_on_the_host_for_a_cuda_mesh_are_placed_on_its_device(nccl_mesh):
    """A model built on the CPU, trained on a CUDA mesh: `init` copies what the state keeps on the
    device to `mesh.device` (and what it offloads stays on the host), in every stage, with and
    without optimizer offload, so the steps run and give the bits of the same params handed over
    on the GPU. (Before, the state kept the host tensors and the first step failed deep inside:
    a device mismatch in the loss, or the stage-3 gather's MeshError.)"""
    mesh = nccl_mesh
    gen = torch.Generator().manual_seed(3)
    tree = {f"u{i}.w": torch.randn(64, 64, generator=gen) / 8 for i in range(3)}

    def loss(p, x):
        for i in range(3):
            x = torch.tanh(x @ p[f"u{i}.w"])
        return x.square().mean()

    def run(params, stage, offload, policy):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0],
                           offload=offload, precision=policy)
        placed = [t.device.type for t in state.params]
        step = fzero.train_step(loss, donate=True)
        for t in range(2):
            x = torch.randn(16, 64, generator=torch.Generator().manual_seed(t)).to(mesh.device)
            state, _ = step(state, x.to(policy.param_dtype or torch.float32))
        return placed, fzero.gather(state)

    for stage in range(4):
        for offload in [None] + ([fzero.Offload(optimizer="cpu")] if stage else []):
            for policy in (fzero.Precision(), fzero.Precision(torch.bfloat16, torch.float32)):
                placed, got = run(tree, stage, offload, policy)
                _, want = run({k: v.to(mesh.device) for k, v in tree.items()}, stage, offload, policy)
                assert placed == ["cuda"] * 3, (stage, offload, policy)
                assert all(torch.equal(got[k], want[k]) for k in tree), (stage, offload, policy)
