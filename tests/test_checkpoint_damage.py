"""fzero.checkpoint against damaged checkpoints (found by fuzzing save / load / export / summary
and the `fzero` CLI with truncated, flipped, deleted, swapped, stray and replaced files and
edited manifests).

The data files and DCP's `.metadata` are covered by the manifest's sha256 (tests/test_checkpoint.py);
the manifest itself has none, so an edit that leaves it valid JSON was read as the truth:

- a leaf's shape cut to fewer elements exported that many of the saved values; a leaf or a
  buffer dropped from the lists was left out of the export; a huge shape was a `RuntimeError`
  (an allocation of terabytes), a buffer given another number of dimensions an `IndexError`;
- a `world_size` edit loaded without a word and left the RNG states as they were;
- a `step` edit was the step `fzero export` wrote into the file's metadata; a manifest of
  another save (another step of the same run, every file of the same size) printed as whole by
  `fzero inspect`, as did one with a file taken off its list;
- a manifest nested too deep for `json` was a `RecursionError` out of every reader.

Now the manifest is checked against DCP's metadata (`check_metadata`: every saved leaf and buffer
listed, of its numel / shape and dtype; the RNG states of `world_size` ranks; every data file
listed), `export` compares the saved step with the manifest's as `load` does, and `summary`
checks `.metadata`'s sha256 (a small file) before reading it. Every damage raises
`CheckpointError` naming what is wrong; `fzero inspect` / `fzero export` exit 2 with it.
"""

import json
import os
import shutil

import pytest
import torch

import fzero
import fzero.checkpoint as ck
from fzero._src.cli import main

BUFFERS = {"rm": torch.arange(4.0), "nbt": torch.tensor(3, dtype=torch.int64)}


def make_params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"emb": torch.randn(7, 3, generator=g), "bias": torch.randn(5, generator=g), "empty": torch.zeros(0, 2),
            "scale": torch.randn((), generator=g)}


def loss_fn(p, x):
    return ((torch.tanh(x @ p["emb"]) * p["scale"]).sum(-1) + p["bias"].sum()).pow(2).mean()


def init(mesh):
    return fzero.init(make_params(), fzero.optim.adamw(1e-2, weight_decay=0.1), stage=2, mesh=mesh,
                      loss_scale=fzero.DynamicLossScale())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Steps 2 and 3 of one run on SimMesh(2), stage 2, with a loss scale and module buffers."""
    root = str(tmp_path_factory.mktemp("damage"))
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(loss_fn)

    def rank_fn():
        state = init(mesh)
        paths = []
        for k in range(3):
            state, _ = step(state, torch.randn(2, 7, generator=torch.Generator().manual_seed(10 * k + mesh.rank)))
            if k >= 1:
                paths.append(ck.save(state, root, buffers={n: t.clone() for n, t in BUFFERS.items()}))
        return paths

    return mesh.run(rank_fn)[0]


def copy(src: str, tmp_path) -> str:
    path = str(tmp_path / "copy" / os.path.basename(src))
    shutil.copytree(src, path)
    return path


def edit(path: str, fn) -> str:
    name = os.path.join(path, "manifest.json")
    with open(name) as f:
        m = json.load(f)
    fn(m)
    with open(name, "w") as f:
        json.dump(m, f, indent=1)
    return path


def leaf(m: dict, path: str) -> dict:
    return next(ls for ls in m["leaves"] if ls["path"] == path)


def load_errors(path: str) -> list:
    """`load` on SimMesh(2) into a matching target: each rank's exception, or None."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        try:
            ck.load(path, init(mesh), buffers={n: torch.zeros_like(t) for n, t in BUFFERS.items()})
        except Exception as e:  # noqa: BLE001 - the test checks the type
            return e
        return None

    return mesh.run(rank_fn)


def refused(fn, *words: str) -> str:
    """`fn()` raises `CheckpointError` whose message holds every one of `words`; its text."""
    with pytest.raises(ck.CheckpointError) as info:
        fn()
    text = str(info.value)
    assert all(w in text for w in words), text
    return text


# What each manifest edit does to the export of the params (or buffers) before the check.
EXPORT_EDITS = {
    # 4 of bias's 5 saved values, silently
    "bias shape cut": (lambda m: leaf(m, "bias").update(shape=[4]),
                       ["leaf 'bias' is float32[4] (4 elements) in the manifest, float32 of 5 elements saved"]),
    # emb read as 6 of its 21 values
    "emb shape cut": (lambda m: leaf(m, "emb").update(shape=[2, 3]), ["leaf 'emb' is float32[2, 3]"]),
    # emb exported as an empty tensor
    "emb shape emptied": (lambda m: leaf(m, "emb").update(shape=[7, 0]), ["leaf 'emb' is float32[7, 0]"]),
    # bias missing from the export
    "leaf dropped": (lambda m: m["leaves"].remove(leaf(m, "bias")),
                     ["saved leaves ['bias'] are not in the manifest's leaves"]),
    # an empty export
    "no leaves": (lambda m: m.update(leaves=[]), ["saved leaves ['bias', 'emb', 'empty', 'scale']"]),
    # an empty leaf renamed (no params of its own saved; its optimizer "leaf" field names it)
    "empty leaf renamed": (lambda m: leaf(m, "empty").update(path="emptz"), ["saved leaves ['empty']"]),
    # RuntimeError: DefaultCPUAllocator: can't allocate memory (4 TiB)
    "huge shape": (lambda m: leaf(m, "emb").update(shape=[2**20, 2**20]), ["leaf 'emb' is float32[1048576, 1048576]"]),
    # TypeError: zeros(): Overflow when unpacking long long
    "overflowing shape": (lambda m: leaf(m, "emb").update(shape=[2**62, 4]), ["leaf 'emb'"]),
    # the buffers missing from the export
    "buffers None": (lambda m: m.update(buffers=None),
                     ["saved module buffers ['nbt', 'rm'] are not in the manifest's buffers (none)"]),
    "buffer dropped": (lambda m: m["buffers"].pop(0), ["saved module buffers ['rm']", "it lists others"]),
    # rm exported as 2 of its 4 values
    "buffer shape cut": (lambda m: m["buffers"][0].update(shape=[2]),
                         ["buffer 'rm' is float32[2] in the manifest, float32[4] saved"]),
    # IndexError: tuple index out of range
    "buffer reshaped": (lambda m: m["buffers"][0].update(shape=[2, 2]), ["buffer 'rm' is float32[2, 2]"]),
    "buffer dimension added": (lambda m: m["buffers"][1].update(shape=[1]), ["buffer 'nbt' is int64[1]"]),
    # the CLI wrote fzero_step "7" into the safetensors file of step 2
    "step": (lambda m: m.update(step=7), ["the manifest says step 7 but the saved state holds step 2"]),
}


@pytest.mark.parametrize("name", sorted(EXPORT_EDITS))
def test_an_edited_manifest_is_refused_by_export_and_inspect(saved, tmp_path, capsys, name):
    """Each edit, valid JSON of the right types, returned wrong tensors from `export` (or raised
    another exception) before; now export, `fzero export` and (but for the step, which only the
    data holds) summary and `fzero inspect` refuse it, naming the leaf or buffer."""
    fn, words = EXPORT_EDITS[name]
    path = edit(copy(saved[0], tmp_path), fn)
    refused(lambda: ck.export(path), "the manifest was edited or damaged", *words)
    out = str(tmp_path / "x.safetensors")
    assert main(["export", path, out]) == 2 and not os.path.exists(out)
    assert words[0] in capsys.readouterr().err
    if name != "step":
        refused(lambda: ck.summary(path), "the manifest does not match the checkpoint's DCP metadata", *words)
        assert main(["inspect", path]) == 2 and words[0] in capsys.readouterr().err


@pytest.mark.parametrize("world_size", [1, 3])
def test_an_edited_world_size_is_refused_by_load(saved, tmp_path, world_size):
    """A `world_size` edit loaded at the saved size without restoring the saved RNG states
    (`restore_rng` applies only where the world sizes agree), silently; now every rank raises,
    as do export and summary."""
    path = edit(copy(saved[0], tmp_path), lambda m: m.update(world_size=world_size))
    errors = load_errors(path)
    words = f"world_size is {world_size} in the manifest, the RNG states of 2 rank(s) are saved"
    assert all(isinstance(e, ck.CheckpointError) and words in str(e) for e in errors), errors
    refused(lambda: ck.export(path), words)
    refused(lambda: ck.summary(path), words)


def test_inspect_refuses_a_manifest_of_another_save_and_an_unlisted_file(saved, tmp_path, capsys):
    """`fzero inspect` checked only the files' sizes: step 3's manifest over step 2's files (all of
    the same sizes) printed "step 3" with exit 0, and a manifest without its data file's entry
    printed one file fewer. Now `.metadata`'s sha256 is checked (another save's differs), and the
    files DCP's metadata names must be listed."""
    two, three = saved
    path = copy(two, tmp_path)
    shutil.copy(os.path.join(three, "manifest.json"), os.path.join(path, "manifest.json"))
    refused(lambda: ck.summary(path), ".metadata", "is corrupted")
    assert main(["inspect", path]) == 2 and ".metadata" in capsys.readouterr().err
    path = edit(copy(three, tmp_path), lambda m: m["files"].pop("__0_0.distcp"))
    refused(lambda: ck.summary(path), "DCP's data files ['__0_0.distcp'] are not in the manifest's files")


def test_a_manifest_nested_too_deep_is_a_checkpoint_error(saved, tmp_path, capsys):
    """JSON nested deeper than Python's recursion limit: `json.loads` raises `RecursionError`,
    which was not caught (it is neither an OSError nor a ValueError), out of load on every rank,
    export, summary, read_manifest, and the CLI (a traceback, exit 1)."""
    path = copy(saved[0], tmp_path)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        f.write("[" * 100_000 + "]" * 100_000)
    for fn in (ck.read_manifest, ck.export, ck.summary):
        refused(lambda: fn(path), "manifest.json", "is not a readable manifest", "recursion")
    errors = load_errors(path)
    assert all(isinstance(e, ck.CheckpointError) and "recursion" in str(e) for e in errors), errors
    assert main(["inspect", path]) == 2 and "is not a readable manifest" in capsys.readouterr().err
    assert ck.latest(os.path.dirname(path)) is None


def test_an_undamaged_copy_still_loads_exports_and_inspects(saved, tmp_path):
    """The checks refuse nothing whole: the copy loads, exports the saved params and buffers, and
    its summary names the step and both files."""
    path = copy(saved[0], tmp_path)
    assert load_errors(path) == [None, None]
    out = ck.export(path)
    assert sorted(out) == ["bias", "emb", "empty", "nbt", "rm", "scale"] and torch.equal(out["rm"], BUFFERS["rm"])
    assert out["emb"].shape == (7, 3) and out["empty"].shape == (0, 2) and out["scale"].shape == ()
    assert "step 2, saved by 2 rank(s) at stage 2" in ck.summary(path)


@pytest.mark.parametrize("key", ["../outside.bin", "/etc/hostname", "sub/x.distcp", "..", ""])
def test_a_files_key_that_is_not_a_plain_name_is_refused_before_any_file_is_read(saved, tmp_path, key):
    """`files` keys name files inside the checkpoint: a path ("../x", "/etc/...") was joined onto
    the checkpoint's and hashed in full -- a file outside it, however large -- before the verdict
    "corrupted" (found in review). Now the manifest's own check refuses it, naming the field."""
    path = edit(copy(saved[0], tmp_path), lambda m: m["files"].update({key: {"sha256": "0" * 64, "bytes": 1}}))
    for fn in (ck.read_manifest, ck.export, ck.summary):
        refused(lambda: fn(path), "manifest.json", "plain file names inside the checkpoint")


def test_a_half_written_manifest_of_a_crashed_save_names_the_crash(saved, tmp_path):
    """A `.tmp-step-*` folder whose manifest a crash cut short: the error says what such a folder
    is and to use `latest`, as a missing manifest's does (found in review: JSON's words alone)."""
    path = str(tmp_path / ".tmp-step-3-00000000abcd")
    shutil.copytree(saved[0], path)
    name = os.path.join(path, "manifest.json")
    with open(name, "rb") as f:
        data = f.read()
    with open(name, "wb") as f:
        f.write(data[: len(data) // 2])
    refused(lambda: ck.read_manifest(path), "is not a readable manifest", "a save that crashed leaves a .tmp-step-*",
            "fzero.checkpoint.latest(root)")
    finished = copy(saved[0], tmp_path)  # a finished checkpoint's broken manifest: no such words
    with open(os.path.join(finished, "manifest.json"), "w") as f:
        f.write("{")
    with pytest.raises(ck.CheckpointError) as e:
        ck.read_manifest(finished)
    assert "is not a readable manifest" in str(e.value) and "crashed" not in str(e.value)
