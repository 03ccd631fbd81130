"""Found in the thirtieth review (input validation of the configuration, layout, optimizer and
accounting code; docs/bad-input.md).

- a trainable params leaf whose own elements share memory (`torch.zeros(1).expand(4)`, an
  overlapping `as_strided` view) was trained as independent elements, silently untied, where
  torch.optim refuses to update such a tensor;
- an uninitialized parameter of a lazy module reached torch's `ValueError` inside `plan`, naming
  no leaf; a `ParamGroup` whose `match` is unhashable (a dataclass with eq) was a bare
  `TypeError` in `plan`;
- an optimizer's `init` refusing a bucket (lamb / adafactor on float64) named no leaf at `init`;
- `train_step(clip_norm=10**400)` was Python's `OverflowError`, a numpy float32 refused;
- `fzero.optim.sequence(0.1)` was Python's `TypeError`;
- `fzero.layout.pack / unpack / shard / unshard / local_shards` given a wrong argument (swapped,
  a list, a float rank) were `AttributeError` / `TypeError`, `rank=True` read as rank 1;
- `fzero.accounting.expected_comm(grad_dtype="bf16")` was an `AttributeError`, an int dtype taken;
  `held_bytes` of a params dict an `AttributeError`;
- `fzero.accounting.estimate` took a float8 dtype (a state `init` refuses), read `offload="cpu"`
  (or `True`) as no offload, and left `align`, `units` and `groups` out of a bare count's
  estimate (a frozen group counted as trainable), silently;
- an optimizer's `update` given another optimizer's state, a plain tuple, a context whose
  segments do not fit the shard, or an integer shard raised from inside (or updated other
  elements silently).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import fzero
from fzero import optim
from fzero._src.config import StepConfig
from fzero.accounting import estimate, expected_comm
from fzero.layout import ParamGroup, Segment


def _init(params, *, n: int = 1, stage: int = 1, opt=None, **kw):
    mesh = fzero.SimMesh(n)
    return mesh.run(lambda: fzero.init(params, opt or optim.sgd(0.1), stage=stage, mesh=mesh, **kw))


# --- a leaf whose own elements share memory ------------------------------------------------------

@pytest.mark.parametrize("leaf", [
    torch.zeros(1).expand(4),  # stride 0
    torch.arange(3.0).view(3, 1).expand(3, 2),
    torch.arange(6.0).as_strided((3, 2), (1, 1)),  # overlapping strides
])
def test_a_trainable_leaf_whose_elements_share_memory_is_refused_naming_it(leaf):
    with pytest.raises(fzero.LayoutError, match="holds one memory location at several of its elements") as info:
        _init({"ok": torch.ones(2), "bias": leaf}, n=2)
    assert f"'bias' (float32{list(leaf.shape)}, stride {list(leaf.stride())}" in str(info.value)
    assert "'ok'" not in str(info.value)
    frozen = [ParamGroup("mask", match=lambda path: path == "bias", frozen=True)]
    assert len(_init({"ok": torch.ones(2), "bias": leaf}, n=2, groups=frozen)) == 2  # never updated: allowed


def test_strided_leaves_whose_elements_are_distinct_are_taken_and_trained_as_their_clones():
    """Transposes, slices, and an `as_strided` view whose strides interleave without sharing an
    element (offsets 0, 3, 2, 5, 4, 7) train as their contiguous clones do."""
    leaves = {"t": torch.arange(6.0).view(2, 3).t(), "s": torch.arange(12.0)[::2],
              "i": torch.arange(8.0).as_strided((3, 2), (2, 3))}
    mesh = fzero.SimMesh(1)

    def trained(params):
        def fn():
            step = fzero.train_step(lambda p, b: sum((v * b).square().sum() for v in p.values()))
            state, _ = step(fzero.init(params, optim.sgd(0.1), stage=0, mesh=mesh), torch.tensor(0.5))
            return fzero.gather(state)
        return mesh.run(fn)[0]

    got, want = trained(leaves), trained({k: v.clone() for k, v in leaves.items()})
    assert all(torch.equal(got[k], want[k]) for k in leaves)


# --- lazy modules, modules as params, unhashable matchers ------------------------------------------

def test_an_uninitialized_lazy_parameter_is_refused_naming_the_leaf():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.LazyLinear(3))
    params = dict(model.named_parameters())
    for call in (lambda: fzero.layout.plan(params, 2), lambda: _init(params), lambda: estimate(model, 2, stage=1)):
        with pytest.raises(fzero.LayoutError, match=r"params leaf '1\.(bias|weight)' is an uninitialized "
                                                    r"parameter of a lazy module.*dummy batch"):
            call()
    with pytest.raises(fzero.LayoutError, match=r"from_module: parameter '1\.weight' is an uninitialized "
                                                r"parameter of a lazy module.*dummy batch"):
        fzero.from_module(model)
    model(torch.ones(1, 2))  # materialized: taken
    assert len(fzero.layout.plan(dict(model.named_parameters()), 2).leaves) == 4
    assert sorted(fzero.from_module(model)[0]) == ["0.bias", "0.weight", "1.bias", "1.weight"]


def test_a_module_given_as_the_params_names_the_way_out():
    with pytest.raises(fzero.LayoutError, match=r"'<root>' is a Linear, not a tensor: pass the module's "
                                                r"parameters, dict\(model.named_parameters\(\)\), or use "
                                                r"fzero.from_module\(model\)"):
        _init(torch.nn.Linear(2, 3))


def test_a_param_group_whose_matcher_is_unhashable_is_refused_when_made():
    @dataclasses.dataclass
    class Prefix:  # eq without frozen: unhashable
        prefix: str

        def __call__(self, path):
            return path.startswith(self.prefix)

    with pytest.raises(fzero.LayoutError, match=r"ParamGroup 'no-decay': match must be hashable.*Prefix"):
        ParamGroup("no-decay", match=Prefix("b"), weight_decay=False)
    @dataclasses.dataclass(frozen=True)
    class FrozenPrefix:
        prefix: str

        def __call__(self, path):
            return path.startswith(self.prefix)

    layout = fzero.layout.plan({"a": torch.ones(2), "b": torch.ones(3)}, 2,
                               groups=[ParamGroup("no-decay", match=FrozenPrefix("b"), weight_decay=False)])
    assert [ls.group.name for ls in layout.leaves] == ["default", "no-decay"]


# --- errors of the optimizer's init name the bucket --------------------------------------------------

@pytest.mark.parametrize("opt", [optim.lamb(), optim.adafactor()], ids=["lamb", "adafactor"])
def test_an_optimizer_refusing_a_bucket_at_init_names_its_leaves(opt):
    params = {"w": torch.ones(2, 2), "head": torch.ones(3, dtype=torch.float64)}
    with pytest.raises(optim.OptimizerError, match=r"got a float64 shard \(fzero.init, making the optimizer state of "
                                                   r"bucket 'default/float64/default' of 1 leaf: 'head' "
                                                   r"\(float64\[3\]\)\)"):
        _init(params, opt=opt)


# --- clip_norm, sequence -----------------------------------------------------------------------------

def test_clip_norm_takes_any_real_number_and_refuses_one_past_floats_range():
    loss = lambda p, b: p["w"].sum()  # noqa: E731
    for c in (np.float32(0.5), np.float64(0.5), 0.5):
        got = StepConfig(loss, clip_norm=c)
        assert type(got.clip_norm) is float and got.clip_norm == 0.5
        assert got.fingerprint == StepConfig(loss, clip_norm=0.5).fingerprint  # ranks compare the value
    for bad in (10**400, True, torch.tensor(1.0), float("inf"), 0):
        with pytest.raises(fzero.ConfigError, match="clip_norm must be None or a finite float > 0"):
            fzero.train_step(loss, clip_norm=bad)


def test_an_lr_sequence_of_something_not_a_list_is_an_optimizer_error():
    for bad in (0.1, None, "0.1"):
        with pytest.raises(optim.OptimizerError, match="sequence takes the lr of each optimizer step"):
            optim.sequence(bad)
    assert optim.sequence(np.array([0.1, 0.2]))(1) == 0.2
    assert optim.sequence(x / 10 for x in range(3))(2) == 0.2


# --- fzero.layout's functions given wrong arguments --------------------------------------------------

def test_layout_functions_name_a_wrong_argument():
    params = {"a": torch.ones(5)}
    layout = fzero.layout.plan(params, 2)
    flats = fzero.layout.pack(layout, params)
    calls = {
        r"fzero.layout.pack: layout must be the Layout": lambda: fzero.layout.pack(params, layout),  # swapped
        r"fzero.layout.unpack: layout must be the Layout": lambda: fzero.layout.unpack(flats, layout),
        r"flat buffers of bucket 'default/float32/default' is a list, not a tensor":
            lambda: fzero.layout.unpack(layout, [[1.0] * 6]),
        r"expected 1 flat buffers \(a tuple or list, one tensor per bucket\), got one tensor of shape \[6\]":
            lambda: fzero.layout.shard(layout, flats[0]),
        r"shard stacks of bucket 'default/float32/default' is a list": lambda: fzero.layout.unshard(layout, [[1.0]]),
        r"rank must be an int in \[0, 2\).*got float 1.5": lambda: fzero.layout.local_shards(layout, flats, 1.5),
        r"rank must be an int in \[0, 2\).*got bool True": lambda: fzero.layout.local_shards(layout, flats, True),
    }
    for message, call in calls.items():
        with pytest.raises(fzero.LayoutError, match=message):
            call()
    assert torch.equal(fzero.layout.local_shards(layout, flats, np.int64(1))[0], flats[0][3:])


# --- accounting and estimate -------------------------------------------------------------------------

def test_expected_comm_takes_dtype_names_and_refuses_other_dtypes():
    layout = fzero.layout.plan({"a": torch.ones(6)}, 2)
    by_name = expected_comm(layout, 2, 3, grad_dtype="bf16", param_dtype="fp16")
    assert by_name == expected_comm(layout, 2, 3, grad_dtype=torch.bfloat16, param_dtype=torch.float16)
    for bad in (torch.int32, torch.float8_e4m3fn, "int8"):
        with pytest.raises(fzero.ConfigError):
            expected_comm(layout, 2, 3, grad_dtype=bad)


def test_held_bytes_of_something_not_a_state_is_a_config_error():
    with pytest.raises(fzero.ConfigError, match="state must be the ZeroState fzero.init made"):
        fzero.accounting.held_bytes({"a": torch.ones(2)})
    assert fzero.accounting.held_bytes(_init({"a": torch.ones(2)})[0]).params == 8


def test_estimate_refuses_dtypes_narrower_than_16_bits():
    for kw in (dict(param_dtype=torch.float8_e4m3fn), dict(grad_dtype=torch.float8_e5m2)):
        with pytest.raises(fzero.ConfigError, match="narrower than 16 bits"):
            estimate(1000, 2, stage=1, **kw)


@pytest.mark.parametrize("offload", ["cpu", True, {"optimizer": "cpu"}])
def test_estimate_refuses_an_offload_that_is_not_an_offload(offload):
    with pytest.raises(fzero.ConfigError, match=r"offload must be None or a fzero.Offload\(...\)"):
        estimate(14e9, 2, stage=3, offload=offload)
    assert estimate(14e9, 2, stage=3, offload=fzero.Offload(optimizer="cpu")).host.total > 0


@pytest.mark.parametrize("kw", [dict(align=128), dict(align=0), dict(units=lambda path: path),
                                dict(groups=[ParamGroup("all", frozen=True)])],
                         ids=["align", "align0", "units", "groups"])
def test_estimate_of_a_bare_count_refuses_layout_settings(kw):
    with pytest.raises(fzero.ConfigError, match="a bare parameter count has none"):
        estimate(1000, 3, stage=1, **kw)
    assert estimate(1000, 3, stage=1, align=1, units=None, groups=[]) == estimate(1000, 3, stage=1)


# --- an optimizer's update given what does not fit ---------------------------------------------------

def _ctx(segments=(Segment(0, 0, 0, 3),), leaves=(0,), group=ParamGroup()):
    return optim.UpdateContext(0, group, tuple(segments), leaves, (True,) * len(leaves))


@pytest.mark.parametrize("form", ["update", "update_"])
def test_an_update_given_inputs_that_do_not_fit_raises_an_optimizer_error(form):
    sgd, adam, lamb = optim.sgd(0.5, momentum=0.9), optim.adam(0.1), optim.lamb(0.1)
    p, g = torch.ones(4), torch.ones(4)
    cases = [
        (sgd, g, adam.init(p, 1), p, _ctx(),
         r"the optimizer state is AdamState\('step', 'exp_avg', 'exp_avg_sq'\), but this optimizer's state has the "
         r"fields \('count', 'momentum_buffer'\)"),
        (adam, g, sgd.init(p, 1), p, _ctx(), r"the optimizer state is SgdMomentumState"),
        (lamb, g, optim.sgd(0.1).init(p, 1), p, _ctx(), r"the optimizer state is EmptyState\(\)"),
        (adam, g, adam.init(p, 2), p, _ctx([Segment(0, 0, 0, 3), Segment(2, 0, 3, 4)], (0, 1)),
         r"ctx.segments\[1\] = Segment\(leaf=2.*does not fit"),  # a leaf not in ctx.leaves
        (sgd, g, sgd.init(p, 2), p, _ctx([Segment(0, 0, 0, 9), Segment(1, 0, 1, 2)], (0, 1)),
         r"ctx.segments\[0\] = Segment\(leaf=0, leaf_start=0, start=0, stop=9\) does not fit"),  # past the shard
        (sgd, g, sgd.init(p, 2), p, _ctx([Segment(0, 0, 0, 3), Segment(1, 0, 2, 4)], (0, 1)),
         r"ctx.segments\[1\].*does not fit"),  # overlapping
        (adam, g, adam.init(p, 1), p, _ctx([Segment(0, 0, -2, 3)]), r"ctx.segments\[0\].*does not fit"),
        (sgd, g, sgd.init(p, 1), p, _ctx(group=None), r"ctx.group must be the bucket's fzero.ParamGroup"),
        (adam, g.long(), adam.init(p.long(), 1), p.long(), _ctx(), r"param shard is torch.int64"),
    ]
    if form == "update":
        cases += [
            (adam, g, tuple(adam.init(p, 1)), p, _ctx(), r"the optimizer state must be the NamedTuple"),
            (adam, g, None, p, _ctx(), r"the optimizer state must be the NamedTuple"),
            (sgd, [1.0] * 4, sgd.init(p, 1), p, _ctx(), r"grad shard must be a tensor"),
        ]
    for opt, grad, state, param, ctx, message in cases:
        before = param.clone()
        with pytest.raises(optim.OptimizerError, match=message):
            getattr(opt, form)(grad, state, param, ctx)
        assert torch.equal(param, before)  # refused before anything is written
