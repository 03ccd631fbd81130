"""`fzero export --dtype` / `checkpoint.export(dtype=)` and `fzero inspect`'s precision line
(found in review).

- `--dtype bf16` cast the params but not the floating buffers: a BatchNorm's running statistics
  stayed fp32 where `module.to(torch.bfloat16)` casts them. Now the API and the command line
  cast what `Module.to` casts (every floating tensor) and leave the integer buffers
  (`num_batches_tracked`) as saved.
- `fzero inspect` printed the precision policy as the manifest's raw list
  (`['torch.bfloat16', 'torch.float32']`). Now as `Precision` shows itself (as `load`'s refusal
  of another policy names it) and as `fzero estimate --precision` takes it.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import fzero
import fzero.checkpoint as ck
from fzero import optim
from fzero._src import checkpoint as impl
from fzero._src.cli import _parse_precision, main


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    with torch.no_grad():  # running statistics of fp32 values bf16 rounds, and a count bf16 would too
        model[1].running_mean.copy_(torch.tensor([0.1, -0.2, 0.3]))
        model[1].running_var.copy_(torch.tensor([1.1, 0.7, 1.3]))
        model[1].num_batches_tracked.fill_(257)
    return model


@pytest.fixture(scope="module")
def bn_checkpoint(tmp_path_factory):
    """A checkpoint of `_bn_model()` saved with its buffers, and the model itself."""
    model = _bn_model()
    params, _, info = fzero.from_module(model)
    mesh = fzero.SimMesh(1)
    root = str(tmp_path_factory.mktemp("bn"))
    path = mesh.run(lambda: ck.save(fzero.init(params, optim.sgd(0.1), stage=1, mesh=mesh, units=info.units), root,
                                    buffers=info.buffers))[0]
    return path, model


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """The same names, and per name the same dtype and bits."""
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (k, got[k], want[k])


@pytest.mark.parametrize("dtype, flag", [(torch.bfloat16, "bf16"), (torch.float64, "fp64")])
def test_export_dtype_casts_what_module_to_casts(bn_checkpoint, tmp_path, capsys, dtype, flag):
    """`export(dtype=)` and `fzero export --dtype` give `module.to(dtype).state_dict()`: params
    and running statistics in `dtype`, `num_batches_tracked` int64 (257, which bf16 would round
    to 256). Before, the running statistics stayed fp32 (both ways). Without a dtype: as saved."""
    from safetensors.torch import load_file

    path, model = bn_checkpoint
    want = copy.deepcopy(model).to(dtype).state_dict()
    assert want["1.running_mean"].dtype == dtype and want["1.num_batches_tracked"].dtype == torch.int64
    _same(ck.export(path, dtype=dtype), want)
    out = str(tmp_path / "m.safetensors")
    assert main(["export", path, out, "--dtype", flag]) == 0
    capsys.readouterr()
    _same(load_file(out), want)
    _same(ck.export(path), model.state_dict())


def test_export_dtype_help_names_the_buffers(capsys):
    """`fzero export --help` says what --dtype casts: the floating buffers too, not the integer ones."""
    with pytest.raises(SystemExit):
        main(["export", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "as module.to(dtype) does: the params and the floating buffers" in text, text
    assert "integer buffers (num_batches_tracked) stay as saved" in text, text


def _inspected(tmp_path, capsys, precision, edit=None) -> str:
    """`fzero inspect`'s precision line of a checkpoint saved under `precision` (`Precision()`:
    no policy), its manifest rewritten by `edit` where given: then saved as before the
    manifest's seal (`checkpoint.seal`), which refuses an edited manifest."""
    mesh = fzero.SimMesh(1)
    root = str(tmp_path / f"p{len(os.listdir(tmp_path))}")
    with pytest.MonkeyPatch.context() as mp:
        if edit is not None:
            mp.setattr(impl, "seal", lambda head: {})
        path = mesh.run(lambda: ck.save(fzero.init({"w": torch.ones(2, 2)}, optim.sgd(0.1), stage=1, mesh=mesh,
                                                   precision=precision), root))[0]
    if edit is not None:
        name = os.path.join(path, "manifest.json")
        with open(name) as f:
            manifest = json.load(f)
        with open(name, "w") as f:
            json.dump(edit(manifest), f)
    assert main(["inspect", path]) == 0
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("precision: "))


@pytest.mark.parametrize("precision, flag", [
    (fzero.Precision(torch.bfloat16, torch.float32), "bf16,fp32"),
    (fzero.Precision(torch.float16), "fp16"),
])
def test_inspect_prints_the_policy_as_precision_and_as_the_flag(tmp_path, capsys, precision, flag):
    """The policy as `Precision` shows itself and as `fzero estimate --precision` takes it (the
    flag parses back to the same policy). Before: `precision: ['torch.bfloat16', 'torch.float32']`."""
    line = _inspected(tmp_path, capsys, precision)
    assert line == f"precision: {precision!r} (fzero estimate --precision {flag}); loss scaler: None", line
    assert _parse_precision(flag) == precision


def test_inspect_prints_no_policy_a_reduce_only_one_and_a_damaged_field(tmp_path, capsys):
    """No policy is said in words; a reduce dtype alone (no --precision form: COMPUTE is
    required there) as `Precision`; a field `load` would refuse as it is, said so; a manifest
    without the field, so. Before: `['None', 'None']`, `['None', 'torch.float32']`, the list."""
    assert _inspected(tmp_path, capsys, fzero.Precision()) == (
        "precision: none (every leaf computes and reduces in its own dtype); loss scaler: None")
    reduce_only = fzero.Precision(reduce_dtype=torch.float64)
    assert _inspected(tmp_path, capsys, reduce_only) == f"precision: {reduce_only!r}; loss scaler: None"
    assert _inspected(tmp_path, capsys, fzero.Precision(), lambda m: {**m, "precision": ["torch.int8", "None"]}) == (
        "precision: ['torch.int8', 'None'] (not a policy: the manifest was edited or damaged); loss scaler: None")
    without = lambda m: {k: v for k, v in m.items() if k != "precision"}  # noqa: E731
    assert _inspected(tmp_path, capsys, fzero.Precision(), without) == (
        "precision: not recorded (saved before the field); loss scaler: None")
