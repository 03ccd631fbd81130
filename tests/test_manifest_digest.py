"""A checkpoint's manifest is sealed in its data: an edit of any field but "files" is refused.

The data files and `.metadata` are covered by the manifest's sha256s, and `check_metadata`
compares the manifest with what DCP's metadata says; but an edit that keeps a leaf's numel (a
shape [4, 6] made [6, 4] or [24]), or changes a field DCP keeps no trace of (the stage, the
optimizer's settings, the lr record, the precision policy, the scaler, a leaf's group settings,
`written`), was taken as the truth by `load`, `export` and `summary` (`fzero inspect`): a
transposed leaf loaded, exported and printed with the edited shape, and a manifest edited to
another lr loaded into a target of that lr (found in review). Now `save` writes, with the data,
the sha256 of every field of the manifest but "files" (`checkpoint.seal`, under the DCP name
"manifest/sha256"), and `load`, `export` and `summary` compare it with the manifest they read
(`check_record`). Checkpoints saved before have no such entry and read as before.
"""

import json
import os

import pytest
import torch

import fzero
import fzero.checkpoint as ck
from fzero._src import checkpoint as impl
from fzero._src.cli import main
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import MetadataIndex

from .test_checkpoint_damage import copy, edit, leaf, refused

BUFFERS = {"rm": torch.arange(4.0), "nbt": torch.tensor(3, dtype=torch.int64)}
SEALED = "the manifest does not match the data it was written with"


def make_params() -> dict:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 6, generator=g), "b": torch.randn(3, generator=g)}


def init(mesh, params=None, lr=1e-2):
    return fzero.init(params or make_params(), fzero.optim.adamw(lr, weight_decay=0.1), stage=2, mesh=mesh,
                      loss_scale=fzero.DynamicLossScale())


def save_one(root: str) -> str:
    """Step 1 of a run on SimMesh(2), stage 2, with a loss scale and module buffers: its path."""
    mesh = fzero.SimMesh(2)
    step = fzero.train_step(lambda p, x: ((x @ p["w"]).tanh().sum() + p["b"].sum()).pow(2))

    def rank_fn():
        state, _ = step(init(mesh), torch.randn(2, 4, generator=torch.Generator().manual_seed(mesh.rank)))
        return ck.save(state, root, buffers={n: t.clone() for n, t in BUFFERS.items()})

    return mesh.run(rank_fn)[0]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return save_one(str(tmp_path_factory.mktemp("sealed")))


@pytest.fixture(scope="module")
def unsealed(tmp_path_factory):
    """The same save as fzero wrote it before the seal: no "manifest/sha256" in its data."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(impl, "seal", lambda head: {})
        return save_one(str(tmp_path_factory.mktemp("unsealed")))


def other_lr(m: dict) -> None:
    """The optimizer's lr and the lr record, 0.01 made 0.02: what a target of `adamw(2e-2)` holds."""
    m["optimizer"] = json.loads(json.dumps(m["optimizer"]).replace('"0.01"', '"0.02"'))
    m["lr"] = [[s, 0.02] for s, _ in m["lr"]]


def load_errors(path: str, params=None, lr=1e-2) -> list:
    """`load` on SimMesh(2) into a target of `params` and `lr` (the saved ones by default): each
    rank's exception, or None."""
    mesh = fzero.SimMesh(2)

    def rank_fn():
        try:
            ck.load(path, init(mesh, params, lr), buffers={n: torch.zeros_like(t) for n, t in BUFFERS.items()})
        except Exception as e:  # noqa: BLE001 - the test checks the type
            return e
        return None

    return mesh.run(rank_fn)


# Edits DCP's metadata keeps no trace of: `check_metadata` passes each (valid JSON of the right
# types, the same numel per leaf), and before the seal load / export / summary took each as saved.
EDITS = {
    "w reshaped [6, 4]": lambda m: leaf(m, "w").update(shape=[6, 4]),
    "w flattened [24]": lambda m: leaf(m, "w").update(shape=[24]),
    "stage": lambda m: m.update(stage=3),
    "optimizer lr and lr record": other_lr,
    "lr record dropped": lambda m: m.update(lr=None),  # (load then compared no lr)
    "lr record value": lambda m: m["lr"][2].__setitem__(1, 0.5),
    "precision": lambda m: m.update(precision=["torch.bfloat16", "torch.float32"]),
    "scaler": lambda m: m.update(scaler=m["scaler"].replace("window=1000", "window=10")),
    "frozen": lambda m: leaf(m, "b").update(frozen=True),
    "weight decay mask": lambda m: leaf(m, "b").update(weight_decay=False),
    "lr scale": lambda m: leaf(m, "w").update(lr_scale=0.5),
    "group name": lambda m: leaf(m, "w").update(group="other"),
    "written": lambda m: m.update(written=m["written"] + 5),
    "a key added": lambda m: m.update(note="hand edited"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_an_edit_dcp_keeps_no_trace_of_is_refused_everywhere(saved, tmp_path, capsys, name):
    """Each edit: export, summary, `fzero export`, `fzero inspect` and load (on every rank) raise
    `CheckpointError` naming the checkpoint and saying the manifest does not match the data it
    was written with; nothing is written by `fzero export`."""
    path = edit(copy(saved, tmp_path), EDITS[name])
    impl.check_metadata(path, ck.read_manifest(path), FileSystemReader(path).read_metadata())  # passes: no trace
    for fn in (ck.export, ck.summary):
        refused(lambda: fn(path), repr(path), SEALED, "the manifest was edited or damaged")
    out = str(tmp_path / "x.safetensors")
    assert main(["export", path, out]) == 2 and not os.path.exists(out)
    assert SEALED in capsys.readouterr().err
    assert main(["inspect", path]) == 2 and SEALED in capsys.readouterr().err
    errors = load_errors(path)
    assert all(isinstance(e, ck.CheckpointError) and SEALED in str(e) and "nothing was loaded" in str(e)
               for e in errors), errors


@pytest.mark.parametrize("what", ["transposed leaf", "another lr"])
def test_an_edited_manifest_that_fits_another_target_is_not_loaded_into_it(saved, tmp_path, what):
    """The edits that mattered most: a manifest edited to fit another target loaded the saved
    state into it. `w` [4, 6] recorded as [6, 4] loaded the saved values into a [6, 4] leaf
    (the same numel, so DCP's metadata agreed); the lr edited to 0.02 resumed the run under lr
    0.02 (`check_fits` compares the manifest, and the manifest said 0.02). Both are refused
    now, before the target is compared, on every rank."""
    params = make_params()
    if what == "transposed leaf":
        path = edit(copy(saved, tmp_path), lambda m: leaf(m, "w").update(shape=[6, 4]))
        params["w"] = params["w"].reshape(6, 4)
        errors = load_errors(path, params)
    else:
        path = edit(copy(saved, tmp_path), other_lr)
        errors = load_errors(path, lr=2e-2)
    assert all(isinstance(e, ck.CheckpointError) and SEALED in str(e) and repr(path) in str(e)
               for e in errors), errors
    assert load_errors(saved) == [None, None]  # the checkpoint as saved loads into its own target


def test_a_step_edit_is_named_by_load_export_and_summary(saved, tmp_path):
    """The step, which the data holds too, is named as before (both values), by summary as well
    now (it read no data before, so it printed an edited step)."""
    path = edit(copy(saved, tmp_path), lambda m: m.update(step=7))
    words = "the manifest says step 7 but the saved state holds step 1"
    for fn in (ck.export, ck.summary):
        refused(lambda: fn(path), repr(path), words)
    assert all(isinstance(e, ck.CheckpointError) and words in str(e) for e in load_errors(path))


def test_the_seal_is_saved_and_is_no_leaf_anywhere(saved):
    """The data holds the sha256 of the manifest's head as a uint8[32] under "manifest/sha256";
    it is not among the leaves or buffers that load, export and summary show."""
    md = FileSystemReader(saved).read_metadata()
    entry = md.state_dict_metadata[impl.DIGEST]
    assert entry.properties.dtype == torch.uint8 and tuple(entry.size) == (32,)
    manifest = ck.read_manifest(saved)
    record = impl._saved_record(saved, manifest, md)
    assert record.digest == impl.manifest_digest(manifest) == impl.manifest_digest({**manifest, "files": {}})
    assert record.step == manifest["step"] == 1 and record.files == {"__0_0.distcp"}
    assert sorted(ck.export(saved)) == ["b", "nbt", "rm", "w"]
    text = ck.summary(saved)
    assert "manifest/sha256" not in text and "sha256" not in text and "2 leaves" in text
    mesh = fzero.SimMesh(2)
    got = mesh.run(lambda: sorted(fzero.gather(ck.load(saved, init(mesh), buffers={
        n: torch.zeros_like(t) for n, t in BUFFERS.items()}))))
    assert got == [["b", "w"], ["b", "w"]]


def test_a_checkpoint_saved_before_the_seal_loads_exports_and_inspects(unsealed, saved, tmp_path):
    """No "manifest/sha256" in its data: load, export and summary read it as before (and compare
    its step); the values are those of the sealed save of the same run. Its manifest edited
    where DCP keeps no trace (the lr record taken off) still loads: nothing to compare it with."""
    assert impl.DIGEST not in FileSystemReader(unsealed).read_metadata().state_dict_metadata
    assert load_errors(unsealed) == [None, None]
    out, want = ck.export(unsealed), ck.export(saved)
    assert sorted(out) == sorted(want) and all(torch.equal(out[k], want[k]) for k in want)
    assert "step 1, saved by 2 rank(s) at stage 2" in ck.summary(unsealed)
    assert main(["inspect", unsealed]) == 0
    path = edit(copy(unsealed, tmp_path), lambda m: m.update(lr=None))
    assert load_errors(path) == [None, None]
    path = edit(copy(unsealed, tmp_path / "step"), lambda m: m.update(step=4))
    refused(lambda: ck.summary(path), "the manifest says step 4 but the saved state holds step 1")


@pytest.mark.parametrize("file", ["__0_0.distcp", ".metadata"])
@pytest.mark.parametrize("field", ["sha256", "bytes"])
def test_a_damaged_files_entry_fails_the_file_check(saved, tmp_path, file, field):
    """"files" is not in the seal (it is written after the data): a damaged sha256 or size entry
    fails the file check instead. Load and export hash every file they read: both refuse either,
    naming the file. Summary checks every file's size and `.metadata`'s sha256 (it hashes no
    data file: `fzero inspect` stays cheap): it refuses all but a data file's sha256 entry, which
    load and export refuse; `latest` skips a checkpoint with a wrong size entry."""
    def damage(m):
        meta = m["files"][file]
        meta[field] = "0" * 64 if field == "sha256" else meta["bytes"] + 1

    path = edit(copy(saved, tmp_path), damage)
    words = [file] + (["is corrupted"] if field == "sha256" else [])
    refused(lambda: ck.export(path), *words)
    assert all(isinstance(e, ck.CheckpointError) and all(w in str(e) for w in words) for e in load_errors(path))
    if field == "bytes":
        refused(lambda: ck.summary(path), file, "the manifest records")
        assert ck.latest(os.path.dirname(path)) is None
    elif file == ".metadata":
        refused(lambda: ck.summary(path), file, "is corrupted")
    else:
        assert "step 1, saved by 2 rank(s)" in ck.summary(path)


def test_damaged_bytes_of_the_seal_name_the_data_file_not_the_manifest(saved, tmp_path):
    """Bytes of the data file flipped where the seal is stored: the digest read differs from the
    manifest's (or does not read), and the file's sha256 says why: summary, export and load name
    the data file as corrupted, not the manifest as edited."""
    path = copy(saved, tmp_path)
    info = FileSystemReader(path).read_metadata().storage_data[MetadataIndex(impl.DIGEST, torch.Size([0]))]
    name = os.path.join(path, info.relative_path)
    with open(name, "r+b") as f:
        f.seek(info.offset + info.length - 40)
        data = bytearray(f.read(32))
        f.seek(info.offset + info.length - 40)
        f.write(bytes(b ^ 0xFF for b in data))
    for fn in (ck.summary, ck.export):
        text = refused(lambda: fn(path), info.relative_path, "is corrupted")
        assert SEALED not in text, text
    assert all(isinstance(e, ck.CheckpointError) and "is corrupted" in str(e) for e in load_errors(path))


# -- on real processes (gloo): rank 0 seals, every rank checks ----------------------------------


def dist_save(mesh, root):
    state = fzero.init(make_params(), fzero.optim.adamw(1e-2, weight_decay=0.1), stage=3, mesh=mesh)
    return ck.save(state, root)


def dist_load(mesh, path):
    try:
        ck.load(path, fzero.init(make_params(), fzero.optim.adamw(1e-2, weight_decay=0.1), stage=3, mesh=mesh))
    except ck.CheckpointError as e:
        return str(e)
    return None


@pytest.mark.dist
def test_sealed_on_gloo_and_refused_on_every_rank(dist2, tmp_path):
    """On a gloo DistMesh rank 0 writes the seal into its own file; an intact checkpoint loads on
    both ranks, a reshaped leaf of the same numel is refused on both."""
    path = dist2.run(dist_save, [(str(tmp_path),)] * 2)[0]
    md = FileSystemReader(path).read_metadata()
    assert md.storage_data[MetadataIndex(impl.DIGEST, torch.Size([0]))].relative_path == "__0_0.distcp"
    assert dist2.run(dist_load, [(path,)] * 2) == [None, None]
    edited = edit(copy(path, tmp_path), lambda m: leaf(m, "w").update(shape=[24]))
    texts = dist2.run(dist_load, [(edited,)] * 2)
    assert all(t is not None and SEALED in t and repr(edited) in t for t in texts), texts
