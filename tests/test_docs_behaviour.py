"""What docs/offload.md, docs/compile.md and docs/architecture.md state, checked by running it.

Each test pins a claim of those pages that no other test pinned (the tests the pages name pin
the rest); the claim is quoted in the test's docstring, with the page it comes from. Where a
page said something this audit found false, the test pins what fzero does and says so (the
page's corrected text is proposed beside it):

- docs/compile.md said a whole compiled loss over `LazyParams` "runs eager: dynamo gives up its
  frame at the lazy read". With the autograd engine dynamo breaks the graph at each lazy read
  (`Gathering.read`) and compiles the math between the reads; only the func engine runs it eager.
- docs/compile.md named five places that run eager; `fzero.evaluate`'s body is a sixth.
- docs/architecture.md draws `fzero.accounting` (accounting.py, estimate.py) below the run API's
  modules, but estimate.py imports precision.py (`Precision`); the layers hold with that line
  drawn above the run API's (nothing there imports it).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import inspect
import math
import re
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import fzero
from fzero import optim
from fzero._src.offload import HostTier

ROOT = Path(__file__).resolve().parents[1]
BF16 = fzero.Precision(torch.bfloat16)


def _loss(p, x):
    return torch.tanh(p["a"] * x).sum() + (p["b"] * x).square().sum()


def _tree():
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g)}


def _nvme(path, params=None):
    return fzero.Offload(optimizer="nvme", params=params, nvme_path=str(path))


# -- docs/offload.md ------------------------------------------------------------------------------


def test_the_offload_snippet_runs_on_each_rank():
    """offload.md's one ```python block, run as written on each rank of a SimMesh(2), given what
    it leaves to the reader (`params`, `mesh`, and a `loss_fn` that casts its batch to the compute
    dtype, as the bf16 policy needs): it makes a stage-3 state with the optimizer and the params
    offloaded and a donating step, which trains."""
    (block,) = re.findall(r"```python\n(.*?)```", (ROOT / "docs/offload.md").read_text(), flags=re.S)
    mesh = fzero.SimMesh(2)

    def loss_fn(p, x):
        return (x.to(p["w"].dtype) @ p["w"] + p["b"]).float().square().mean()

    def rank_fn(x):
        ns = {"fzero": fzero, "torch": torch, "mesh": mesh, "loss_fn": loss_fn,
              "params": {"w": torch.ones(8, 4) / 8, "b": torch.zeros(4)}}
        exec(compile(block, "docs/offload.md python block", "exec"), ns)
        state, step = ns["state"], ns["step"]
        assert state.info.offload == fzero.Offload(optimizer="cpu", params="cpu") and state.info.stage.level == 3
        new, m = step(state, x)
        return int(new.step), m.loss

    for steps, loss in mesh.run(rank_fn, [(torch.ones(3, 8),), (torch.ones(3, 8) * 2,)]):
        assert steps == 1 and loss > 0


def test_offload_defaults_and_the_state_keeps_the_settings():
    """offload.md: "`fzero.Offload(optimizer=None | "cpu" | "nvme", params=None | "cpu" | "nvme",
    nvme_path=None, ratio=1.0, pin=True, direct=False)` is a frozen, validated dataclass ... The
    state keeps it (`state.info.offload`)"."""
    fields = [(f.name, f.default) for f in dataclasses.fields(fzero.Offload)]
    assert fields == [("optimizer", None), ("params", None), ("nvme_path", None), ("ratio", 1.0), ("pin", True),
                      ("direct", False)]
    off = fzero.Offload(optimizer="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        off.ratio = 0.5
    mesh = fzero.SimMesh(1)
    for given, tier in ((off, HostTier(torch.device("cpu"))), (None, None)):
        state = mesh.run(lambda: fzero.init({"w": torch.ones(3)}, optim.sgd(0.1), stage=1, mesh=mesh, offload=given))[0]
        assert state.info.offload == (given or fzero.Offload())
        assert state.info.tier == tier  # architecture.md: "or None"


@pytest.mark.parametrize("kwargs, match", [
    (dict(optimizer="cpu", ratio=1.5), r"ratio must be a float in \(0, 1\].*got 1.5"),
    (dict(optimizer="cpu", ratio=math.nan), r"ratio must be a float in \(0, 1\].*got nan"),
    (dict(optimizer="cpu", ratio=-0.5), r"ratio must be a float in \(0, 1\].*got -0.5"),
    (dict(optimizer="nvme", nvme_path="/tmp", direct=1), r"direct must be a bool.*got direct=1"),
    (dict(optimizer="cpu", pin="yes"), r"pin must be a bool, got 'yes'"),
])
def test_a_ratio_outside_the_interval_or_a_flag_that_is_not_a_bool_is_refused(kwargs, match):
    """offload.md: refused when `fzero.Offload(...)` is made: "`ratio` outside (0, 1] ..., a `pin`
    or `direct` that is not a bool" (tests/test_offload.py pins 0, True, pin=1 and direct=True
    without NVMe; these are the other sides: above 1, NaN, negative, direct=1 with NVMe)."""
    with pytest.raises(fzero.ConfigError, match=match):
        fzero.Offload(**kwargs)


def test_what_lives_where_under_a_bf16_policy():
    """offload.md's table, N = 2, the bf16 policy, one trainable bucket (S = 4) and one frozen
    (S = 2): stages 1-2 keep "the full buffer `flat[N * S]` in the compute dtype" and a host
    master `shard[S]` in fp32; stage 3 the param `shard[S]` in bf16; stage 3 with `params="cpu"`
    "its copy in the compute dtype" beside the fp32 master (not the master itself). Frozen
    buckets keep their own dtype and no master; "with `params="cpu"` their shards are on the host
    too" (a host tier), and without it not."""
    params = {"w": torch.randn(7), "f": torch.randn(3)}
    frozen = (fzero.ParamGroup("frozen", match=lambda p: p == "f", frozen=True),)
    mesh = fzero.SimMesh(2)
    cases = [(1, None, 8), (2, None, 8), (3, None, 4), (3, "cpu", 4)]
    for stage, on, held in cases:
        off = fzero.Offload(optimizer="cpu", params=on)
        s = mesh.run(lambda: fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p,
                                        groups=frozen, precision=BF16, offload=off))[0]
        (f,), (w,) = ([b for b, spec in enumerate(s.layout.buckets) if spec.group.frozen == fz] for fz in (True, False))
        assert s.layout.buckets[w].shard_numel == 4, stage
        assert (s.params[w].dtype, s.params[w].numel()) == (torch.bfloat16, held), (stage, on)
        assert (s.master[w].dtype, s.master[w].numel()) == (torch.float32, 4), (stage, on)
        assert s.params[w].untyped_storage().data_ptr() != s.master[w].untyped_storage().data_ptr()
        assert s.params[f].dtype == torch.float32 and s.master[f] is None and s.opt_state[f] is None
        assert (s.info.host_tier(f) is not None) == (on == "cpu"), (stage, on)


@pytest.mark.parametrize("stage", [1, 3])
def test_a_donating_offloaded_step_updates_the_host_state_in_place_and_a_pure_one_does_not(stage):
    """offload.md, "One step" 4: "With `donate=True` the host update writes the ... master and
    optimizer state in place (no second host copy ...); without it the update is pure and its new
    host tensors are" new ones: the input state's host master and moments keep their values."""
    mesh = fzero.SimMesh(2)

    def host(s):  # per bucket: the host master and the moments
        return [t for m, o in zip(s.master, s.opt_state) for t in (m, o.exp_avg, o.exp_avg_sq)]

    def rank_fn(x):
        out = []
        for donate in (True, False):
            s = fzero.init(_tree(), optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p,
                           offload=fzero.Offload(optimizer="cpu"))
            ptrs, before = [t.data_ptr() for t in host(s)], [t.clone() for t in host(s)]
            new, _ = fzero.train_step(_loss, donate=donate)(s, x)
            kept = donate or all(torch.equal(a, b) for a, b in zip(host(s), before))
            changed = not any(torch.equal(a, b) for a, b in zip(host(new), before))
            out.append((donate, [p == t.data_ptr() for p, t in zip(ptrs, host(new))], kept, changed))
        return out

    for per_rank in mesh.run(rank_fn, [(torch.tensor(1.0),), (torch.tensor(2.0),)]):
        for donate, same, kept, changed in per_rank:
            assert same == [donate] * 6 and kept and changed, (donate, same, kept, changed)


def test_nvme_swap_files_live_in_a_fresh_folder_per_init(tmp_path):
    """offload.md, NVMe: the swap files are "one per offloaded bucket and tensor (`entry-<i>.bin`
    ...), in a fresh `fzero-swap-*` folder under `DIR`", "a fresh `init` always makes a new one";
    "only the small replicated fields (step counts ...) stay in host memory" (not stand-ins, no
    file); params="nvme" "without a policy (fp32 params) the shard file is a second copy of the
    master file" (the same bytes after a step)."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        states = [fzero.init(_tree(), optim.adamw(1e-2), stage=3, mesh=mesh, units=lambda p: p,
                             offload=_nvme(tmp_path, "nvme")) for _ in range(2)]
        s, _ = fzero.train_step(_loss, donate=True)(states[0], torch.tensor(1.0))
        return s, states[1]

    s, other = mesh.run(rank_fn)[0]
    folders = sorted(os.listdir(tmp_path))
    paths = [st.info.tier.files.path for st in (s, other)]
    assert len(folders) == 2 and all(f.startswith("fzero-swap-") for f in folders)
    assert sorted(os.path.basename(p) for p in paths) == folders and os.path.dirname(paths[0]) == str(tmp_path)
    entries = s.info.tier.files.entries
    assert [os.path.basename(e.path) for e in entries.values()] == [f"entry-{i}.bin" for i in range(len(entries))]
    assert all(os.path.dirname(e.path) == paths[0] for e in entries.values())
    assert all(o.step.stride() == (1,) for o in s.opt_state)  # a real tensor in host memory
    assert not any(name.endswith("/step") for name in entries)
    for b in range(len(s.params)):
        master, shard = (Path(entries[f"b{b}/{k}"].path).read_bytes() for k in ("master", "params"))
        assert master == shard and len(master) == 4 * s.layout.buckets[b].shard_numel, b


@pytest.mark.parametrize("name, opt, in_files, in_memory", [
    ("adamw", optim.adamw(1e-2), ["exp_avg", "exp_avg_sq"], ["step"]),
    ("sgd", optim.sgd(0.1, momentum=0.9), ["momentum_buffer"], ["count"]),
    ("adafactor", optim.adafactor(1e-2), ["v"], ["step", "rows", "cols"]),
])
def test_nvme_keeps_the_master_and_the_shard_fields_in_files(tmp_path, name, opt, in_files, in_memory):
    """offload.md, NVMe: in swap files "the fp32 master shard and the optimizer state's "shard"
    fields (Adam's `exp_avg`, `exp_avg_sq`; SGD's momentum) ... Only the small replicated fields
    (step counts, Adafactor's factored rows and columns) stay in host memory"; the state holds a
    stand-in for each file-backed tensor (stride 0)."""
    mesh = fzero.SimMesh(1)
    s = mesh.run(lambda: fzero.init({"a": torch.randn(6, 4)}, opt, stage=1, mesh=mesh, offload=_nvme(tmp_path)))[0]
    assert sorted(s.info.tier.files.entries) == sorted([f"b0/{f}" for f in in_files] + ["b0/master"]), name
    fields = dict(zip(s.opt_state[0]._fields, s.opt_state[0]))
    assert sorted(fields) == sorted(in_files + in_memory), name
    assert [fields[f].stride() == (0,) for f in in_files + in_memory] == [True] * len(in_files) + [False] * len(
        in_memory), name
    assert s.master[0].stride() == (0,)


def test_a_load_into_an_nvme_target_gets_fresh_files_and_leaves_the_targets(tmp_path):
    """offload.md: "A checkpoint loaded into an NVMe target gets fresh swap files (the target's are
    left as they were)"; "a `load` into an NVMe target reserves a fresh set of swap files while the
    target's still exist (twice the files on the disk for the load)"."""
    mesh = fzero.SimMesh(1)
    swap = tmp_path / "swap"
    swap.mkdir()

    def rank_fn():
        def make():
            return fzero.init(_tree(), optim.adamw(1e-2), stage=2, mesh=mesh, units=lambda p: p, offload=_nvme(swap))

        state, _ = fzero.train_step(_loss, donate=True)(make(), torch.tensor(1.0))
        saved = fzero.checkpoint.save(state, tmp_path / "ckpt")
        target = make()
        files = {n: Path(e.path).read_bytes() for n, e in target.info.tier.files.entries.items()}
        before = set(os.listdir(swap))
        loaded = fzero.checkpoint.load(saved, target)
        after = set(os.listdir(swap))
        return target, loaded, files, before, after

    target, loaded, files, before, after = mesh.run(rank_fn)[0]
    new = os.path.basename(loaded.info.tier.files.path)
    assert after == before | {new} and new not in before and len(after) == 3  # the saved state's, the target's, new
    assert os.path.isdir(target.info.tier.files.path)
    assert {n: Path(e.path).read_bytes() for n, e in target.info.tier.files.entries.items()} == files
    assert files["b0/master"] != Path(loaded.info.tier.files.entries["b0/master"].path).read_bytes()


def _deepcopy_refused_or_equal(state):
    """`copy.deepcopy(state)` read back: the OffloadError of an NVMe state's copy, or whether a
    plain state's copy holds its values, over the same (shared) info."""
    copied = copy.deepcopy(state)
    try:
        fzero.gather(copied)
    except fzero.OffloadError as e:
        return str(e)
    return copied.info is state.info and all(torch.equal(a, b) for a, b in zip(copied.params, state.params))


def test_a_deepcopy_of_a_simmesh_nvme_state_is_refused_by_its_files(tmp_path):
    """offload.md: "`copy.deepcopy` of a state copies its tensors and shares its static `info`, the
    tier with it, so an NVMe state's deepcopy is such a copy, refused alike (`OffloadError`; before,
    the deepcopy itself raised `TypeError` in `copy`, from the mesh's lock ...)"."""
    mesh = fzero.SimMesh(1)
    got = [mesh.run(lambda: _deepcopy_refused_or_equal(fzero.init(_tree(), optim.adamw(1e-2), stage=1, mesh=mesh,
                                                                    offload=off)))[0]
           for off in (_nvme(tmp_path), None)]
    assert "is not the NVMe tier's stand-in" in got[0] and got[1] is True, got


def deepcopy_of_an_nvme_state(mesh):
    """Run by the gloo workers: `_deepcopy_refused_or_equal` of a DistMesh NVMe state and of a
    plain one."""
    with tempfile.TemporaryDirectory() as d:
        state = fzero.init(_tree(), optim.adamw(1e-2), stage=1, mesh=mesh, offload=_nvme(d))
        nvme = _deepcopy_refused_or_equal(state)
        del state
    return "is not the NVMe tier's stand-in" in nvme, _deepcopy_refused_or_equal(
        fzero.init(_tree(), optim.adamw(1e-2), stage=1, mesh=mesh))


def test_a_deepcopy_of_a_distmesh_nvme_state_is_refused_by_its_files(dist2):
    """offload.md, as above, on DistMesh (before: "cannot pickle '_queue.SimpleQueue' object", from
    the swap files' background thread); a DistMesh state without NVMe copies."""
    out = dist2.run(deepcopy_of_an_nvme_state, timeout=120)
    assert out == [(True, True)] * 2, out


# -- docs/compile.md ------------------------------------------------------------------------------

from .test_docs_claims import compiling  # noqa: E402  (the same marks as test_compile.py's)


def _flat():
    g = torch.Generator().manual_seed(0)
    return {"layer.w": torch.randn(4, 3, generator=g), "layer.b": torch.randn(3, generator=g),
            "head.w": torch.randn(3, 2, generator=g)}


def _flat_loss(p, x):
    return (torch.tanh(x @ p["layer.w"] + p["layer.b"]) @ p["head.w"]).square().mean()


def _xs():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(5, 4, generator=g),) for _ in range(2)]


def _steps(mesh, stage, step, x):
    s = fzero.init(_flat(), optim.adamw(1e-2), stage=stage, mesh=mesh, units=lambda p: p.split(".")[0])
    losses = []
    for t in range(2):
        s, m = step(s, x + t)
        losses.append(m.loss)
    return fzero.gather(s), s.opt_state, losses


@compiling
@pytest.mark.parametrize("engine", ["autograd", "func"])
def test_a_compiled_step_compiles_nothing_and_keeps_the_bits_at_stages_0_to_2(engine):
    """compile.md: "`torch.compile(step)`, either engine, every stage: the same bits as `step`,
    params, optimizer state and metrics ... It compiles nothing: dynamo meets the disabled
    `eager_step` at once" (tests/test_compile.py checks the bits at stage 3)."""
    from torch._dynamo.utils import counters

    mesh = fzero.SimMesh(2)
    for stage in (0, 1, 2):
        step = fzero.train_step(_flat_loss, engine=engine)
        torch._dynamo.reset()
        counters.clear()
        got = mesh.run(lambda x: _steps(mesh, stage, torch.compile(step), x), _xs())
        assert counters["stats"]["unique_graphs"] == 0, (stage, dict(counters["stats"]))
        want = mesh.run(lambda x: _steps(mesh, stage, step, x), _xs())
        for (gp, go, gl), (wp, wo, wl) in zip(got, want):
            assert all(torch.equal(gp[k], wp[k]) for k in wp), stage
            assert all(torch.equal(a, b) for x, y in zip(go, wo) for a, b in zip(x, y)), stage
            assert all(torch.equal(a, b) for a, b in zip(gl, wl)), stage


@compiling
def test_a_whole_compiled_loss_over_lazy_params():
    """compile.md says a whole compiled loss over `LazyParams` (gather="on_use", flat-dict params)
    "does not fail but runs eager: dynamo gives up its frame at the lazy read". It does not fail;
    with the func engine it runs eager (no graph), but with the autograd engine dynamo breaks the
    graph at each of the three lazy reads (`Gathering.read`, run eager) and compiles the math
    between them (torch 2.13): graphs are captured."""
    from torch._dynamo.utils import counters

    mesh = fzero.SimMesh(2)
    got = {}
    for engine in ("autograd", "func"):
        torch._dynamo.reset()
        counters.clear()
        if engine == "func":  # it says so (tests/test_walkthrough.py)
            with pytest.warns(UserWarning, match="the loss is not compiled"):
                step = fzero.train_step(torch.compile(_flat_loss), engine=engine)
        else:
            step = fzero.train_step(torch.compile(_flat_loss), engine=engine)
        mesh.run(lambda x: _steps(mesh, 3, step, x), _xs()[:1] * 2)
        reads = sum(v for k, v in counters["graph_break"].items() if "Gathering.read" in k)
        got[engine] = (counters["stats"]["unique_graphs"] > 0, reads > 0)
    assert got == {"autograd": (True, True), "func": (False, False)}, got


def test_eager_falls_back_to_the_decorator_without_the_callback_reader(monkeypatch):
    """compile.md: "`eager` reads whether dynamo's frame callback is installed through a private
    torch function; where a torch lacks it, it falls back to the decorator" (and with it, calls
    the function directly: tests/test_host.py)."""
    from fzero._src import eager as eager_mod

    def f(x):
        return x + 1

    direct = eager_mod.eager(f)
    assert direct.__wrapped__ is f and not hasattr(direct, "_torchdynamo_orig_callable")
    monkeypatch.setattr(eager_mod, "_callback", None)
    fallback = eager_mod.eager(f)
    assert fallback._torchdynamo_orig_callable is f and torch.equal(fallback(torch.ones(2)), torch.full((2,), 2.0))


def test_the_places_that_run_eager_under_dynamo():
    """compile.md's table: `eager_step` is marked `torch.compiler.disable`; `Gathering.read`,
    `Mesh.collective` / `solo` / `start`, `Pending.wait` and `gathering._not_from_compiled` go
    through `eager`. And the sixth, which the page does not name: `fzero.evaluate`'s function is
    marked `torch.compiler.disable` too, called by the plain function it returns (a compiled `fn`
    inside it is still compiled)."""
    from fzero._src import eager, gathering, mesh, step

    wrapper = eager.eager(lambda: None).__code__
    marked = [gathering.Gathering.read, mesh.Mesh.collective, mesh.Mesh.solo, mesh.Mesh.start, mesh.Pending.wait,
              gathering._not_from_compiled]
    assert [f.__code__ is wrapper for f in marked] == [True] * 6
    assert all(getattr(sub, name) is getattr(mesh.Mesh, name) for sub in (fzero.SimMesh, fzero.DistMesh)
               for name in ("collective", "solo", "start"))
    assert step.eager_step._torchdynamo_orig_callable.__name__ == "eager_step"
    # evaluate returns a plain function calling the disabled `run` (the disabled function itself,
    # which torch.compile unwraps, let dynamo trace fzero's forward: found in review)
    evaluate_call = fzero.evaluate(_flat_loss)
    assert not hasattr(evaluate_call, "_torchdynamo_orig_callable")
    run, = [c.cell_contents for c in evaluate_call.__closure__ if hasattr(c.cell_contents, "_torchdynamo_orig_callable")]
    assert run._torchdynamo_orig_callable.__name__ == "run"


def compiled_collective(mesh, x):
    """Run by the gloo workers: a compiled function calling `all_gather`, against the eager one,
    and dynamo's graph count and graph breaks."""
    import warnings

    from torch._dynamo.utils import counters

    from fzero._src.collectives import all_gather

    warnings.filterwarnings("ignore", "<class 'torch.autograd.function.Function'> should not be instantiated",
                            DeprecationWarning)
    warnings.filterwarnings("ignore", "`torch.jit.script_method` is deprecated", DeprecationWarning)

    def f(x):
        return all_gather(x * 2, mesh, tag="t").sin()

    torch._dynamo.reset()
    counters.clear()
    got = torch.compile(f)(x)
    breaks = sorted({k.split("`<function ")[1].split(" at ")[0] for k in counters["graph_break"]})
    return torch.equal(got, f(x)), counters["stats"]["unique_graphs"], breaks


@compiling
def test_a_compiled_function_calling_a_collective_on_distmesh(dist2):
    """compile.md: "A compiled user function that calls `fzero`'s collectives on `SimMesh` or
    `DistMesh`: each collective is one graph break; the same bits as eager"
    (tests/test_compile.py checks SimMesh): on gloo, two graphs split at `Mesh.collective`."""
    out = dist2.run(compiled_collective, [(torch.arange(3.0),), (torch.arange(3.0) + 1,)], timeout=180)
    assert out == [(True, 2, ["Mesh.collective"])] * 2, out


# -- docs/architecture.md -------------------------------------------------------------------------

# The layers, top to bottom (docs/architecture.md's diagram, one list per line; the page's prose
# puts remat.py on module.py's line and config.py ... agreement.py on step.py's). `fzero.accounting`
# (accounting.py, estimate.py) is drawn here above the run API's modules: the page draws it below
# them, but estimate.py imports precision.py; nothing in the run API imports it.
LAYERS = [
    ["cli"], ["testing"], ["checkpoint"], ["accounting", "estimate"],
    ["module", "remat"], ["evaluate"], ["step", "config", "plan", "norms", "reduce", "update", "agreement"],
    ["gathering"], ["state"], ["offload"], ["casting"], ["unit"], ["precision"], ["originals"],
    ["stages"], ["optim"], ["collectives"], ["mesh"], ["layout"],
    ["errors", "eager", "tree", "nvme", "watched", "scale"],
]
STEP_LINE = ["config", "plan", "norms", "reduce", "update", "agreement"]  # "each importing only those before it"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT / "fzero")
    return "testing" if rel.parts[0] == "testing" else "optim" if rel.parts[:2] == ("_src", "optim") else path.stem


def _fzero_imports(path: Path) -> set[str]:
    """The fzero modules `path` imports anywhere (inside functions too), by `LAYERS` name."""
    package = path.relative_to(ROOT).with_suffix("").parts[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = list(package[:len(package) - node.level + 1]) if node.level else []
            full = base + (node.module.split(".") if node.module else [])
            names.update(tuple(full + [a.name]) for a in node.names)
            names.add(tuple(full))
        elif isinstance(node, ast.Import):
            names.update(tuple(a.name.split(".")) for a in node.names)
    out = set()
    for n in names:
        if n[:2] == ("fzero", "testing"):
            out.add("testing")
        elif n[:2] == ("fzero", "_src") and len(n) > 2:
            out.add(n[2])
    return out - {"__init__"}


def test_each_module_imports_only_the_layers_below_it():
    """architecture.md: "Each line's modules (under `fzero/_src/`, and `fzero/testing/`) import only
    modules of the lines below it, imports inside functions included"; config.py ... agreement.py
    each import only those before them; the last line imports at most errors.py. The public
    modules re-export from `fzero/_src/`."""
    line = {m: i for i, ms in enumerate(LAYERS) for m in ms}
    files = [*sorted((ROOT / "fzero/_src").glob("*.py")), *sorted((ROOT / "fzero/_src/optim").glob("*.py")),
             *sorted((ROOT / "fzero/testing").glob("*.py"))]
    bad = []
    for path in files:
        if path == ROOT / "fzero/_src/__init__.py":
            continue
        me = _module_name(path)
        assert me in line, f"{path} is on no line of the diagram"
        for dep in _fzero_imports(path) - {me}:
            assert dep in line, f"{path} imports {dep}, on no line of the diagram"
            ok = line[dep] > line[me] or (me in STEP_LINE and dep in STEP_LINE[:STEP_LINE.index(me)]) or (
                me in ("step", "module") and line[dep] == line[me]) or (line[me] == len(LAYERS) - 1 and dep == "errors")
            if not ok:
                bad.append(f"{path.relative_to(ROOT)} imports {dep}")
    assert not bad, bad
    for public in ("layout", "collectives", "optim", "accounting", "checkpoint"):
        tree = ast.parse((ROOT / "fzero" / f"{public}.py").read_text())
        sources = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} - {"__future__"}
        assert sources and all(s.startswith("fzero._src") for s in sources), (public, sources)


def test_import_fzero_imports_its_namespaces_but_not_fzero_testing():
    """architecture.md: "`fzero/__init__.py` re-exports the run API and imports those namespaces,
    not `fzero.testing`"."""
    code = ("import sys, fzero\n"
            "print(sorted(m for m in sys.modules if m.startswith('fzero.') and not m.startswith('fzero._src')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["['fzero.accounting',", "'fzero.checkpoint',", "'fzero.collectives',",
                                  "'fzero.layout',", "'fzero.optim']"], out.stdout


def test_the_records_and_owners_the_page_names():
    """architecture.md's "Where each concept lives": `ZeroState(params, opt_state, step, master,
    loss_scale, info, pending)`, `StateInfo(layout, stage, mesh, rank, optimizer, precision,
    scaler, offload, tier, serial)`, `StepConfig(loss_fn, ..., ahead, buffers, checked)` field for
    field ("the `train_step` keywords, plus `ahead` ..., `buffers` ... and `checked` ...: left out
    of equality"), and
    the pieces and methods it names on `Stage` and `Gathering`."""
    from fzero._src import gathering

    def names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    assert names(fzero.ZeroState) == ["params", "opt_state", "step", "master", "loss_scale", "info", "pending"]
    assert names(fzero.StateInfo) == ["layout", "stage", "mesh", "rank", "optimizer", "precision", "scaler", "offload",
                                      "tier", "serial"]
    assert names(fzero.StepConfig) == [
        "loss_fn", "engine", "on_nonfinite", "gather", "micro_batches", "accumulate", "accum_dtype", "normalize",
        "clip_norm", "donate", "persist_bytes", "max_live_bytes", "prefetch", "cast_ahead", "locate_nonfinite", "ahead",
        "buffers", "checked"]
    assert [f.name for f in dataclasses.fields(fzero.StepConfig) if not f.compare] == ["ahead", "buffers", "checked"]
    assert list(inspect.signature(fzero.train_step).parameters) == names(fzero.StepConfig)[:-3]  # its keywords
    assert {"shards", "enter", "leave", "after_backward", "finish"} <= set(names(fzero.Stage))
    for m in ("moves", "hold", "optimizer_params", "grad_shard", "differentiated", "leaf_sum", "segments"):
        assert callable(getattr(fzero.Stage, m)), m
    assert isinstance(fzero.Stage.reduces_after_leave, property)
    for m in ("read", "release", "refill", "after_backward", "call", "loss", "drain", "finish"):
        assert callable(getattr(gathering.Gathering, m)), m


@pytest.mark.parametrize("donate", [True, False])
def test_the_agreement_is_one_float64_all_gather_and_the_pure_step_adds_a_max_flag(donate):
    """architecture.md, step 4: "one all-gather of `[loss, used[L], bad[B], ‖g_shard‖², count,
    broken, settings, step, serial, lr, scale, scaled]` (float64 ...)" -- L + B + 10 columns per
    rank; step 5: "Without `donate=True` the update's finite flag is all-reduced (max, tag
    "fzero.step/update")". Three leaves in three buckets, N = 2."""
    params = {"a": torch.randn(13), "b": {"w": torch.randn(3, 5)}, "c": torch.randn(2)}
    mesh = fzero.SimMesh(2)

    def rank_fn():
        s = fzero.init(params, optim.adamw(1e-2), stage=2, mesh=mesh, units=lambda p: p.split(".")[0])
        step = fzero.train_step(lambda p, x: (p["a"][:5] * x).sum() + (p["b"]["w"] @ x).square().mean()
                                + p["c"].sum(), donate=donate)
        with mesh.record() as log:
            step(s, torch.ones(5))
        return len(s.layout.buckets), [(c.op, c.reduce, c.dtype, c.elements, c.tag) for c in log
                                       if c.rank == mesh.rank and (c.tag or "").startswith("fzero.")]

    for buckets, calls in mesh.run(rank_fn):
        want = [("all_gather", None, torch.float64, 2 * (3 + 3 + 10), "fzero.step/agree")]
        if not donate:
            want.append(("all_reduce", "max", torch.float64, 1, "fzero.step/update"))
        assert buckets == 3 and calls == want, calls
