"""fzero.testing's DDP comparison (`fzero/testing/ddp.py`), used as a team adopting fzero would:
a model of its own (a LayerNorm, a BatchNorm and its buffers), DDP against every stage at N = 2
through the public names only; then what `trajectory_differences` reports, the errors of a
model built differently on two ranks or on two calls, and `world_sizes`' argument check.

The worker functions are at module level: the pool's workers import them by name.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fzero
from fzero.testing import (
    BUFFER,
    OPT,
    WorkerError,
    ddp_trajectory,
    fzero_trajectory,
    trajectory_differences,
    world_sizes,
)

# ---------------------------------------------------------------------------------------------
# The team's model, its two trainings and its loss


class Net(nn.Module):
    """x[B, 6] -> logits[B, 3]: a LayerNorm, and a BatchNorm whose running statistics (buffers)
    the forward updates."""

    def __init__(self, width: int = 12) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, width), nn.LayerNorm(width), nn.GELU(),
                                  nn.Linear(width, width), nn.BatchNorm1d(width), nn.GELU())
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def net_loss(model, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def torch_adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)


def batches_for(n: int, steps: int, seed: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`batches[rank][step] = (x, y)`, drawn in the test process."""
    g = torch.Generator().manual_seed(seed)
    return [[(torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(steps)]
            for _ in range(n)]


def against_ddp(mesh, batches: list) -> dict:
    """DDP's trajectory, and its differences from fzero's at every stage; at stage 0 also without
    broadcasting the buffers (DDP broadcasts them: rank 1's running statistics then differ)."""
    ref = ddp_trajectory(mesh, make_net, torch_adamw, net_loss, batches)
    run = lambda stage, **kw: fzero_trajectory(mesh, make_net, fzero.optim.adamw(1e-2, weight_decay=0.1),  # noqa: E731
                                               net_loss, batches, stage=stage, units="body", **kw)
    return {"ref": ref, "stages": {stage: trajectory_differences(ref, run(stage)) for stage in (0, 1, 2, 3)},
            "no broadcast": trajectory_differences(ref, run(0, broadcast_buffers=False), limit=100)}


def seeded_by_rank() -> Net:
    torch.manual_seed(torch.distributed.get_rank())
    return Net()


def wider_on_rank_1() -> Net:
    torch.manual_seed(0)
    return Net(12 + torch.distributed.get_rank())


def ddp_of(mesh, make_model_name: str):
    return ddp_trajectory(mesh, globals()[make_model_name], torch_adamw, net_loss, [])


# ---------------------------------------------------------------------------------------------
# The team's equivalence test


@pytest.mark.dist
def test_my_model_equals_ddp_bit_for_bit_at_every_stage_n2(dist2):
    batches = batches_for(2, steps=3, seed=4)
    results = dist2.run(against_ddp, [(batches[r],) for r in range(2)])
    params = ["body.0.weight", "body.0.bias", "body.1.weight", "body.1.bias", "body.3.weight", "body.3.bias",
              "body.4.weight", "body.4.bias", "head.weight", "head.bias"]
    buffers = [BUFFER + f"body.4.{k}" for k in ("running_mean", "running_var", "num_batches_tracked")]
    for rank, res in enumerate(results):
        ref = res["ref"]
        opt = [OPT + f"{name}.{field}" for name in params for field in ("step", "exp_avg", "exp_avg_sq")]
        assert len(ref) == 3 and list(ref[0]) == params + buffers + opt, list(ref[0])
        assert [ref[t][OPT + "head.weight.step"].item() for t in range(3)] == [1.0, 2.0, 3.0]  # float64, exact
        assert not torch.equal(ref[0]["head.weight"], ref[2]["head.weight"])  # the params moved
        assert int(ref[2][BUFFER + "body.4.num_batches_tracked"]) == 3  # the buffers too
        assert res["stages"] == {0: [], 1: [], 2: [], 3: []}, f"rank {rank}: {res['stages']}"
    # DDP keeps the ranks' params alike; each rank's forward updates its running statistics by its
    # own batch, after the broadcast
    across = trajectory_differences(results[0]["ref"], results[1]["ref"], limit=100)
    assert across and all("'buffer:body.4.running_" in line for line in across), across
    # the comparison sees buffers: without the broadcast only rank 1's running statistics differ,
    # from the second step on (the first starts from equal buffers; a forward in training mode
    # normalises by the batch's statistics, so the params are DDP's)
    assert results[0]["no broadcast"] == []
    differ = results[1]["no broadcast"]
    assert [line.split(": ")[:2] for line in differ] == [
        ["step 1", "'buffer:body.4.running_mean'"], ["step 1", "'buffer:body.4.running_var'"],
        ["step 2", "'buffer:body.4.running_mean'"], ["step 2", "'buffer:body.4.running_var'"]], differ


# ---------------------------------------------------------------------------------------------
# trajectory_differences


def _trajectory() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [{"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g),
             BUFFER + "n": torch.tensor(t)} for t in range(3)]


def test_trajectory_differences_names_step_key_count_and_size_of_a_difference():
    ref, got = _trajectory(), _trajectory()
    assert trajectory_differences(ref, got) == []
    w = got[1]["w"]
    w[2, 1] = torch.nextafter(w[2, 1], torch.tensor(float("inf")))  # one ulp, one element
    ulp = (w[2, 1].double() - ref[1]["w"][2, 1].double()).abs().item()
    assert trajectory_differences(ref, got) == [f"step 1: 'w': float32[3, 4]: 1 of 12 elements differ, "
                                                f"max |diff| {ulp:.3g}"]
    ref[2]["b"][0], got[2]["b"][0] = 0.0, -0.0  # the same value, other bits
    assert trajectory_differences(ref, got)[1] == ("step 2: 'b': float32[4]: 1 of 4 elements differ, max |diff| 0; "
                                                   "first at flat index 0: ref 0.0 (0x00000000), got -0.0 (0x80000000)")


def test_trajectory_differences_is_exact_for_integers_and_shows_nans_bits():
    """int64 values above 2**53 differed by "max |diff| 0" (float64 rounds them), and a NaN
    against 1.0 by "max |diff| nan", neither value shown (found in review of a fzero.testing user)."""
    ref = [{"n": torch.tensor([2**62, 5]), "x": torch.tensor([float("nan"), 1.0])}]
    got = [{"n": torch.tensor([2**62 + 1, 5]), "x": torch.tensor([1.0, 1.0])}]
    assert trajectory_differences(ref, got) == [
        "step 0: 'n': int64[2]: 1 of 2 elements differ, max |diff| 1",
        "step 0: 'x': float32[2]: 1 of 2 elements differ, max |diff| nan; first at flat index 0: ref nan (0x7fc00000), "
        "got 1.0 (0x3f800000)"]
    same_nan = [{"x": torch.tensor([float("nan")])}]
    assert trajectory_differences(same_nan, [{"x": same_nan[0]["x"].clone()}]) == []  # the same bits


def test_trajectory_differences_names_dtype_shape_key_and_length_mismatches():
    ref, got = _trajectory(), _trajectory()
    got[0]["w"] = got[0]["w"].double()
    got[1]["b"] = got[1]["b"][:3]
    del got[2][BUFFER + "n"]
    got[2]["extra"] = torch.zeros(1)
    assert trajectory_differences(ref, got) == [
        "step 0: 'w': float32[3, 4] in ref, float64[3, 4] in got",
        "step 1: 'b': float32[4] in ref, float32[3] in got",
        "step 2: keys only in ref: ['buffer:n']; only in got: ['extra']",
    ]
    assert trajectory_differences(ref, got[:2]) == ["3 steps in ref, 2 in got",
                                                    "step 0: 'w': float32[3, 4] in ref, float64[3, 4] in got",
                                                    "step 1: 'b': float32[4] in ref, float32[3] in got"]


def test_trajectory_differences_stops_at_limit_and_says_how_many_more():
    ref = _trajectory()
    got = [{k: v + 1 for k, v in s.items()} for s in ref]
    lines = trajectory_differences(ref, got, limit=4)
    assert len(lines) == 5 and lines[-1] == "... and 5 more", lines
    with pytest.raises(ValueError, match=r"trajectory_differences: limit must be an int >= 1, got 0"):
        trajectory_differences(ref, got, limit=0)


# ---------------------------------------------------------------------------------------------
# A model built differently on two ranks, or on two calls


@pytest.mark.dist
@pytest.mark.parametrize("make_model,rank_1", [("seeded_by_rank", "float32[12, 6]"),
                                               ("wider_on_rank_1", "float32[13, 6]")])
def test_a_model_built_differently_on_two_ranks_is_refused_on_every_rank(dist2, make_model, rank_1):
    """Without the check, a model seeded by the rank ran without a word (DDP and `fzero.init`
    broadcast rank 0's values, replacing rank 1's), and one of other shapes raised in DDP's
    construction on rank 1 only, rank 0 waiting for it (a `PoolError` after `error_grace`)."""
    with pytest.raises(WorkerError) as info:
        dist2.run(ddp_of, [(make_model,), (make_model,)], timeout=60)
    errors = info.value.errors
    assert [e.rank for e in errors] == [0, 1]
    for e in errors:
        assert e.type_name.endswith("ConfigError"), e
        assert "ddp_trajectory: make_model() built different models on rank 0 and rank 1 (world size 2)" in e.message
        assert ": rank 0 has param 'body.0.weight' float32[12, 6] crc " in e.message, e.message
        assert f", rank 1 param 'body.0.weight' {rank_1} crc " in e.message, e.message
        assert "torch.manual_seed(0), not a seed of the rank" in e.message
    assert errors[0].message == errors[1].message


def unseeded() -> Net:
    return Net()


def test_a_model_built_differently_on_two_calls_is_refused():
    """An unseeded `make_model`: the two trainings would start from different models, and every
    stage would read as differing from DDP."""
    mesh = fzero.SimMesh(2)
    with pytest.raises(fzero.ConfigError, match=r"fzero_trajectory: make_model\(\) built a different model on its "
                                                r"second call here \(rank 0\): the first call gave param "
                                                r"'body.0.weight' float32\[12, 6\] crc \w+, the second param "
                                                r"'body.0.weight' .* seed inside it"):
        mesh.run(lambda: fzero_trajectory(mesh, unseeded, fzero.optim.sgd(0.1), net_loss, [], stage=1))


def test_ddp_trajectory_refuses_a_simmesh():
    mesh = fzero.SimMesh(2)
    with pytest.raises(fzero.ConfigError, match=r"ddp_trajectory: .* is a SimMesh.*fzero.testing.Pool"):
        mesh.run(lambda: ddp_trajectory(mesh, make_net, torch_adamw, net_loss, []))


# ---------------------------------------------------------------------------------------------
# world_sizes


@pytest.mark.parametrize("max_n", [2.5, True, "3", 0])
def test_world_sizes_needs_an_int_of_at_least_one(max_n):
    """Before, 2.5 and "3" raised a bare TypeError from `range`, and True drew N = 1 only."""
    with pytest.raises(ValueError, match=rf"world_sizes: max_n must be an int >= 1, got {max_n!r}"):
        world_sizes(max_n)


# ---------------------------------------------------------------------------------------------
# A 0-element param


class WithEmpty(nn.Module):
    """Net's head with two 0-element params, which torch's optimizers give state of 0 elements."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(6, 3)
        self.nothing = nn.Parameter(torch.zeros(0))
        self.none2 = nn.Parameter(torch.zeros(3, 0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x) + self.nothing.sum() + self.none2.sum()


def make_with_empty() -> WithEmpty:
    torch.manual_seed(0)
    return WithEmpty()


def empty_against_ddp(mesh, batches: list) -> dict:
    """DDP's trajectory under AdamW and SGD with momentum, and fzero's differences from it at every
    stage, the empty params in the head's bucket and in one of their own."""
    opts = {"adamw": (torch_adamw, fzero.optim.adamw(1e-2, weight_decay=0.1)),
            "sgd": (lambda m: torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=False),
                    fzero.optim.sgd(0.1, momentum=0.9))}
    out = {}
    for name, (torch_opt, fzero_opt) in opts.items():
        ref = ddp_trajectory(mesh, make_with_empty, torch_opt, net_loss, batches)
        out[name, "ref"] = ref
        for stage in (0, 1, 2, 3):
            for units in (None, {"empty": lambda path: path.startswith("no")}):
                got = fzero_trajectory(mesh, make_with_empty, fzero_opt, net_loss, batches, stage=stage, units=units)
                out[name, stage, units is None] = trajectory_differences(ref, got)
    return out


@pytest.mark.dist
def test_a_zero_element_param_compares_equal_to_ddp(dist2):
    """Before, every step read `keys only in ref: ['opt:nothing.exp_avg', ...]`: a 0-element leaf
    is in no shard, so fzero's side never made its "shard" fields (its "step" it did)."""
    batches = batches_for(2, steps=2, seed=5)
    results = dist2.run(empty_against_ddp, [(batches[r],) for r in range(2)])
    for rank, res in enumerate(results):
        for field, opt in (("exp_avg", "adamw"), ("exp_avg_sq", "adamw"), ("momentum_buffer", "sgd")):
            ref = res[opt, "ref"]
            assert ref[1][OPT + f"nothing.{field}"].shape == (0,), list(ref[1])
            assert ref[1][OPT + f"none2.{field}"].shape == (3, 0), list(ref[1])
        differences = {k: v for k, v in res.items() if k[1] != "ref"}
        assert differences and all(v == [] for v in differences.values()), f"rank {rank}: {differences}"
