"""One step's units on one rank: gathered when the loss uses them, released, gathered again.

`Gathering` owns the life of every unit's parameters during one step's forward and backward:

- `read(unit)` runs the unit's Function once per step (in stage 3: all-gathers the unit's
  buckets) and returns its leaves by path;
- `release(unit)` frees a stage-3 unit's gathered storage after its forward
  (`untyped_storage().resize_(0)`, as FSDP2 does), where the step allows it (`releasable`)
  and nothing beyond fzero and autograd's saved tensors still references it (`_referenced`: a
  view cached on a module, a weight kept by a hook);
- `refill(unit)` gathers a released unit again into the same storage, when backward first reads
  a tensor saved from it (a `saved_tensors_hooks` unpack), and the unit's Function releases it
  once more when its backward is done (`after_backward`);
- a unit read again after its release in the same forward (a block run twice, weight sharing)
  is gathered again, and handed through `_Reread`, whose backward frees it once that use's
  backward is done: each use's backward gathers it anew (one more all-gather per extra use), and
  no unit stays gathered from a later use's backward to an earlier one's (`Gathering._reread`);
- `loss(loss_fn, batch)` calls the loss with the params in the step's gathering mode and adds
  every unit's anchor, so every unit's backward runs on every rank.

Gathering modes (`train_step(..., gather=...)`):

- "on_use" (default): a unit's Function is created when the loss first uses it, so the autograd
  engine runs its backward (stage 2-3: its reduce-scatter) right after the unit's own gradients
  are complete, and stage 3 frees it after use. Flat-dict params (as `from_module` makes) come as
  a `LazyParams` mapping read by path (`from_module`'s `apply` reads a unit when its submodule
  runs); other pytrees come with placeholder leaves that the first torch function using them
  swaps for the real ones (`FirstUse`).
- "eager": every unit's Function runs before the loss, which gets the plain params pytree.
  Simplest and the same bits, but the engine then runs every unit's backward after the rest of
  the backward: stage 2 holds every unit's full gradient at peak and stage 3 every gathered unit
  from forward to backward.

Every rank must read the units in the same order (the same program on every rank does). With
"on_use", a unit the loss never reads is never reduced, and never gathered but by prefetch
(`prefetch=k` gathers up to k units ahead in the layout's order, read or not: found in review,
where the words said never); a rank that skips or
reorders units stops every rank with `DivergentPaths` (a `CollectiveMismatch`) naming the unit
each rank gathered or reduced at that point (`same_paths`; "eager" reduces every unit on every
rank, as DDP with `find_unused_parameters`).

Where units are freed after use, at N > 1 the forward's last unit released stays gathered for
its backward, which comes next (`Gathering.release`; FSDP2 keeps its root's params so; at N = 1
there is no collective to save). Two
settings move frees (never values, proofs/stage3.md):
`persist_bytes` keeps units of at most that many gathered bytes for the whole step (no
backward re-gather), and `max_live_bytes` caps the gathered bytes live at once (kept units are
freed early to make room; what cannot fit raises).

`prefetch=k` (stage 3, on use) issues gathers ahead of use, through `Mesh.start` (on DistMesh
asynchronous: NCCL runs it on its own stream, overlapping the current unit's compute): when
the forward reads unit u, the gathers of the next k units of the predicted order (the layout's
unit order) are started before u computes; when backward refills u, the refills of the next k
released units of the reverse of this step's read order are started before u's backward runs,
skipping units backward never reads (no tensor was saved from them: a frozen unit whose inputs
need no grad, an embedding, whose backward reads its indices only; `Gathering._saves`). A unit
read out of prediction is gathered on demand; a prefetched unit the forward never reads (or
whose backward never reads it) is waited for and dropped, at the latest when the backward is
over (`Gathering.finish`; the step holds its `Gathering` until then). Prefetched units count
against `max_live_bytes` (a prefetch that does not fit waits until it does; a demand read drops
prefetches before it raises). All-gathers copy bits, so the values are those of k = 0
(proofs/stage3.md, section 5). The default (`prefetch=None`) is k = 1 where the mesh overlaps a
started collective with what follows (`Mesh.asynchronous`: DistMesh over N > 1), else k = 0.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import sys
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import optree
import torch
import torch.utils._pytree as torch_pytree
from optree.registry import __GLOBAL_NAMESPACE as _GLOBAL  # type: ignore[attr-defined]
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .casting import Reads, casting
from .collectives import func_level, unwrapped
from .eager import eager, from_compiled
from .errors import CollectiveMismatch, ConfigError, FzeroError, said
from .layout import Layout
from .mesh import EVALUATING, Mesh, entry_of, evaluating_words, unlabelled
from .stages import ENTER_GATHER, Flight, Piece, start_enter_into
from .tree import NAMESPACE, named_paths, unflatten
from .unit import Bucket, Inflight, Probe, UnitProgram, remembered, run_unit, wait_held

GATHERS = ("on_use", "eager")


class DivergentPaths(CollectiveMismatch):
    """Ranks took different paths through the model: at the same point of the step (or of
    `fzero.evaluate`) they gathered or reduced different units, or one had stopped reading."""


_RANK_CALL = re.compile(r"rank (\d+): (.+)")
_TAG = re.compile(r"^(\w+)\(.*tag='([^']*)'\)")
_MICRO_BATCH = re.compile(r"\) \[micro-batch (\d+) of (\d+)\]")  # `Mesh.phase`'s label in a call's words


def in_micro_batch(mesh: Mesh, i: int, k: int) -> contextlib.AbstractContextManager:
    """Around micro-batch `i` of `k` of a step: its collectives carry the label "micro-batch i of k",
    which ranks compare with the rest of each call (`Mesh.phase`), so that a rank whose loss read
    fewer units in an earlier micro-batch -- none, for a loss that returns a constant on an empty
    micro-batch -- meets the others' micro-batch `i` with its `i + 1` as a mismatch (`same_paths`
    names the micro-batches) rather than pairing its units' gathers and reductions with theirs:
    a complete sum, added in another order, and no error (found in review). Nothing at k = 1:
    its calls are compared as they always were. Tags and what `Mesh.record` logs are unchanged.
    With `k` in the label, ranks whose `micro_batches` differ part at their first micro-batch's
    first collective, named as such (`_micro_batch_advice`; before, a rank of fewer micro-batches
    finished and the message gave the empty-micro-batch advice, found in review)."""
    return mesh.phase(f"micro-batch {i} of {k}") if k > 1 else contextlib.nullcontext()


@contextlib.contextmanager
def same_paths(layout: Layout) -> Iterator[None]:
    """Turn a `CollectiveMismatch` whose calls name units into `DivergentPaths`, saying which
    unit each rank gathered (or reduced) at that point; other mismatches pass unchanged.

    Both meshes word a mismatch as one line per rank, `rank r: op(dtype[shape], tag='unit/...')`,
    and every rank raises it, so every rank raises the clearer error too."""
    try:
        yield
    except DivergentPaths:
        raise
    except CollectiveMismatch as e:
        if "the calls differ only in requires_grad" in str(e):  # the same call on every rank: no path parted
            raise
        unit_of = {b.tag: b.unit for b in layout.buckets}
        calls = dict(_RANK_CALL.findall(str(e)))
        leaf_sums = sorted(int(r) for r, call in calls.items() if "/leaf_sum'" in call)
        if leaf_sums:  # an optimizer's collective, not a model path (found in review: the words blamed the model)
            who = ("every rank called ctx.leaf_sum (a collective over every rank), for other buckets or shapes"
                   if len(leaf_sums) == len(calls) else f"the optimizer's update on rank(s) {leaf_sums} called "
                   f"ctx.leaf_sum (a collective over every rank) where the other ranks did not")
            raise CollectiveMismatch(
                f"{who}: an update must call ctx.leaf_sum the same times, in the same order, with the same shapes, "
                f"on every rank, whatever its shard holds (a rank with no element of a leaf adds zeros). The mesh "
                f"said: {e}") from e
        said = {int(r): _what(call.strip(), unit_of) for r, call in calls.items()}
        evaluating = {int(r): f") [{EVALUATING}]" in call for r, call in calls.items()}
        words = evaluating_words(list(calls.values()))  # (the mesh's too: said once, here, `mesh_said`)
        apart = bool(words)  # some ranks in evaluate, not all (where every rank evaluates, the words say it)
        mesh_said = str(e).replace(words, "") if words else str(e)
        if not any(unit for _, unit in said.values()) or any(entry_of(c) for c in calls.values()):
            if not apart:
                raise  # (a rank in checkpoint.save, gather, ...: the mesh's words name it, not a model path)
            # a rank in evaluate met another's call outside it, no model path parted (found in review: the
            # words of a model path, and gather='eager' as the way out)
            raise DivergentPaths(f"a rank in fzero.evaluate met another rank's call outside it:{words} The mesh "
                                 f"said: {mesh_said}") from e
        micro = {int(r): _micro_batch_of(call) for r, call in calls.items()}
        parts = ", ".join(f"rank {r} {what}" + ("" if micro[r] is None else f" in micro-batch {micro[r][0]} of "
                                                                               f"{micro[r][1]}")
                          + (" in fzero.evaluate" if apart and evaluating[r] else "")
                          for r, (what, _) in sorted(said.items()))
        at_unit = {r for r, (what, unit) in said.items() if unit is not None and what.startswith("gathered")}
        finished = {r for r, (what, _) in said.items() if what.startswith("had finished its backward")}
        busy = {r for r, (_, unit) in said.items() if unit is not None}  # a gather or a reduction of a unit
        raise DivergentPaths(  # (a rank in evaluate is in no micro-batch: the micro-batch words are not about it)
            f"ranks took different paths through the model: {parts}. "
            f"{'' if apart else _micro_batch_advice(micro, at_unit) or _no_unit_advice(micro, finished, busy)}"
            f"{words.strip() + ' ' if words else ''}With "
            f"gather='on_use' every rank must read the same units in the same order (a data-dependent branch "
            f"must take the same path on every rank); or use gather='eager', which gathers every unit on every "
            f"rank in declaration order. Ranks whose train_step settings differ (micro_batches, accumulate, gather, "
            f"prefetch, persist_bytes, max_live_bytes) part the same way: every rank must pass the same. The mesh said: "
            f"{mesh_said}"
        ) from e


def _micro_batch_of(call: str) -> tuple[int, int] | None:
    """`(i, k)`: the micro-batch a mismatch line's call was made in, of how many (`in_micro_batch`),
    or None."""
    m = _MICRO_BATCH.search(call)
    return (int(m.group(1)), int(m.group(2))) if m else None


_EMPTY_WAY_OUT = ("run the model and return a zero that depends on its output (out.sum() * 0.0; with "
                  "normalize='tokens', the loss summed over the empty batch). ")  # the advice's way out, both kinds


def _no_unit_advice(micro: Mapping[int, tuple[int, int] | None], finished: Collection[int],
                    busy: Collection[int]) -> str:
    """A step of one micro-batch (no rank in a labelled one) where some ranks finished their
    backward while others still gather or reduce a unit: their loss read fewer units, or none (a
    constant for an empty batch); the way out (found in review: at k = 1 no advice was given)."""
    if not finished or not busy or any(m is not None for m in micro.values()):
        return ""
    return (f"Rank(s) {sorted(finished)} finished their backward where the others still gather or reduce: their "
            f"loss read "
            f"fewer units, or none (a constant, torch.zeros(()), for an empty batch without calling the model). "
            f"Make every rank's loss read the same units: on an empty batch, {_EMPTY_WAY_OUT}")


def _micro_batch_advice(micro: Mapping[int, tuple[int, int] | None], at_unit: Collection[int] = ()) -> str:
    """Where the ranks were in different micro-batches (`in_micro_batch`: `(i, k)`; a rank past
    its backward is in none): which rank was in which, why, and the way out; else "". Ranks in
    steps of different `k` ran different `micro_batches` (found in review: they were given the
    empty-micro-batch advice). A rank in none that gathers a unit (`at_unit`: a forward's or a
    backward's gather, which a step of k > 1 micro-batches makes inside one) is in a step of one
    micro-batch, which has no label: the ranks' `micro_batches` differ too (found in review: it
    was said to be past its last one)."""
    if len(set(micro.values())) < 2 or all(m is None for m in micro.values()):
        return ""
    counts = {m[1] for m in micro.values() if m is not None}
    if len(counts) > 1:
        runs = "; ".join(f"rank(s) {[r for r in sorted(micro) if micro[r] is not None and micro[r][1] == k]} run {k}"
                         for k in sorted(counts))
        return f"The ranks' train_step(micro_batches=...) differ ({runs}): every rank must pass the same. "
    single = sorted(r for r in at_unit if micro[r] is None)
    if single:
        return (f"Rank(s) {single} ran a step of one micro-batch (micro_batches=1: its calls carry no "
                f"micro-batch label) where the others are in a step of {counts.pop()}: the ranks' "
                f"train_step(micro_batches=...) differ; every rank must pass the same. ")
    where = "; ".join(f"rank(s) {[r for r in sorted(micro) if micro[r] == m]} "
                      + ("past its last micro-batch" if m is None else f"in micro-batch {m[0]} of {m[1]}")
                      for m in sorted(set(micro.values()), key=lambda m: -1 if m is None else m[0]))
    return (f"The ranks were in different micro-batches ({where}): a rank whose loss read fewer units in an "
            f"earlier micro-batch -- none, where the loss returns a constant for an empty micro-batch without "
            f"calling the model -- had its later micro-batches' gathers and reductions meet the other ranks' "
            f"earlier ones. Make every micro-batch's loss read the same units on every rank: on an empty "
            f"micro-batch, {_EMPTY_WAY_OUT}")


def _what(call: str, unit_of: Mapping[str, str]) -> tuple[str, str | None]:
    """`(what a rank did, in words; the unit it names or None)` from one mismatch line."""
    m = _TAG.match(call)
    unit = unit_of.get(m.group(2)) if m else None
    if unit is None:
        done = {"fzero.evaluate/paths": "had finished its forward (it reads no further unit)",
                "fzero.step/agree": "had finished its backward (it reads no further unit)",
                "fzero.state/pending": "checked the verdict of the donating step that made its state (the first "
                                       "collective of evaluate, gather or save after train_step(donate=True))"}
        if m and m.group(2) in done:
            return done[m.group(2)], None
        if call.startswith("returned"):
            return "had returned (it read no further unit)", None
        return f"called {unlabelled(call)} (no unit)", None
    verb = {"all_gather": "gathered", "reduce_scatter": "reduced"}.get(m.group(1), f"called {m.group(1)} of")
    return f"{verb} unit {unit!r}", unit


class Gathering:
    """The units of one step on one rank (see the module docstring).

    Args:
      layout, programs: the state's layout and one `UnitProgram` per unit.
      xs, fulls: per bucket, the differentiated tensor and the full buffer beside it (or None).
      probes: per unit, the `Probe` whose gradients report what its backward saw.
      mode: "on_use" or "eager".
      releasable: whether gathered storage may be freed after use and gathered again in backward
        (stage 3 with the autograd engine and a flat-dict loss).
      persist_bytes: a unit whose `gathered_bytes` are at most this stays gathered from its first
        read to the end of the step: `release` keeps it (DeepSpeed's
        `stage3_param_persistence_threshold`), so backward never gathers it again.
      max_live_bytes: None, or a cap on the bytes of gathered units live at once (releasable
        steps only): before a unit is gathered, kept units whose use is done are freed, oldest
        first, to make room; a unit larger than the cap, or units still in use that leave no
        room, raise `ConfigError` naming them.
      prefetch: how many units ahead to start gathering (0: each unit is gathered when read;
        None: `prefetch_of`'s default); see the module docstring. Only stages that gather params
        (stage 3) have gathers to start; elsewhere it changes nothing.
      inflight: the step's `unit.Inflight` (reductions the units' backward starts), handed to
        every unit's Function (`run_unit`); None: each backward waits for its own.
      casts: None, or per unit the dtype each leaf is handed in (`fzero._src.casting`).
      reads: None, or the step's `casting.Reads`: each unit's Function hands the leaves it
        watches as `Watched`, which are handed to its `watch` as they are made.
    """

    def __init__(self, layout: Layout, programs: Sequence[UnitProgram], xs: Sequence[torch.Tensor],
                 fulls: Sequence[torch.Tensor | None], probes: Mapping[str, Probe], mode: str,
                 releasable: bool, persist_bytes: int = 0, max_live_bytes: int | None = None,
                 prefetch: int | None = 0, inflight: Inflight | None = None,
                 casts: Mapping[str, tuple] | None = None, reads: Reads | None = None) -> None:
        if max_live_bytes is not None and not releasable:
            raise ConfigError(f"max_live_bytes={max_live_bytes} caps the gathered units a step holds by freeing "
                              f"them after use, which only stage 3 with gather='on_use', engine='autograd' and "
                              f"flat-dict params (fzero.from_module) do; drop max_live_bytes, or use those settings")
        self.layout, self.mode, self.releasable = layout, mode, releasable
        self.persist_bytes, self.max_live_bytes = persist_bytes, max_live_bytes
        self._kept: list[str] = []  # units whose release was asked but which persist, oldest first
        self._deferring = False  # inside the loss's forward (`loss`): the latest release waits (`release`)
        self._deferred: str | None = None  # the unit whose release waits, kept (in `_kept`)
        self._last: str | None = None  # the forward's last unit, kept for backward's first refill (`_settle_last`)
        self._pinned: set[str] = set()  # units a module's output holds a view of (not freed before their
        # backward), or that something else references at a release (`_referenced`: not freed while it does)
        self._at_read: dict[str, _Uses] = {}  # unit -> the references to it when read (`_referenced`)
        self._saved: dict[int, weakref.WeakSet] = {}  # gathered storage -> the `_Saved` autograd holds over it
        self._programs = {p.name: p for p in programs}
        self._xs, self._fulls, self._probes, self._inflight = xs, fulls, probes, inflight
        self._casts, self._reads = casts or {}, reads
        self._leaves: dict[str, dict[str, torch.Tensor]] = {}  # unit -> {path: leaf}, in read order
        self._read_order: list[str] = []  # `_leaves`' units, in read order, and each one's place there
        self._read_at: dict[str, int] = {}
        self._anchors: list[torch.Tensor] = []
        self._storages: dict[str, list[tuple[Bucket, Any, int]]] = {}  # unit -> (bucket, storage, nbytes)
        self._released: set[str] = set()
        self._owner: dict[int, str] = {}  # gathered storage -> its unit (for refill on unpack)
        self._again: dict[str, dict[str, torch.Tensor]] = {}  # unit read again -> its leaves through `_Reread`
        self._rereads: list[tuple[int, str]] = []  # (units first read before it, unit) per re-read, in order
        self._reread_back: dict[str, int] = {}  # unit -> its `_Reread`s whose backward has run
        prefetch = prefetch_of(prefetch, programs)
        self.prefetch = prefetch if prefetch and mode == "on_use" and _gathers(programs) else 0
        self._ahead: dict[str, list[Flight]] = {}  # unit -> its buckets' gathers in flight, in start order
        self._backward_done: set[str] = set()  # units whose Function's backward has run
        self._handed: list[tuple[str, str, torch.Tensor, int]] = []  # (unit, path, leaf, version) handed out
        self._grad, self._inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()  # `call` sets them
        self.roots: dict[str, torch.Tensor] = {}  # path -> the 0-d leaf its placeholder views (`FirstUse`)

    # -- one unit -------------------------------------------------------------------------

    @eager  # a compiled loss reading a unit gathers it eager (docs/compile.md)
    def read(self, unit: str) -> dict[str, torch.Tensor]:
        """All leaves of `unit` by path, running its Function on the first read this step (and
        gathering it again if it was released)."""
        if self._deferred is not None and self._deferred != unit:
            self._release_deferred()
        if unit not in self._leaves:
            if unit in self._ahead and len(self._ahead[unit]) != len(self._programs[unit].buckets):
                self._drop(unit)  # what a read that raised midway left (`_entering`): read again, gathered anew
            if unit not in self._ahead:  # not prefetched (or prefetch is off): gather it now
                self._make_room(unit)
                if self.prefetch:
                    self._ahead[unit] = self._start(unit)
            if self.prefetch:
                self._prefetch(self._after(unit), backward=False)
            with torch.inference_mode(self._inference), torch.set_grad_enabled(self._grad):  # `call`'s modes
                self._leaves[unit] = self._run(unit, self._ahead.get(unit))
            self._read_at[unit] = len(self._read_order)
            self._read_order.append(unit)
            self._ahead.pop(unit, None)  # (each gather left it as its bucket entered)
            if self.releasable and self._storages[unit] and _use_count is not None:
                self._at_read[unit] = self._uses(unit)
            return self._leaves[unit]
        if unit in self._released:  # read again after its release: a block run twice (weight sharing)
            return self._reread(unit)
        return self._again.get(unit) or self._leaves[unit]

    def _reread(self, unit: str) -> dict[str, torch.Tensor]:
        """The leaves of `unit`, released after an earlier use in this forward and read again (a
        block run twice, ALBERT-style weight sharing): gathered again (`refill`), and where the
        step differentiates, handed through `_Reread`, whose backward frees the unit once the
        backward of this use is done (`release`, behind its check that nothing else references
        it). The earlier use's backward then gathers it again when it unpacks a tensor saved from
        it, as after any release: one more all-gather per extra use, the same bits. Before, the
        unit's one Function, made at its first read, freed it only after the first use's
        backward: it stayed gathered from the last use's backward to the first's, and a model
        running its blocks twice held every block at once in backward (found in review). Later
        reads of the unit until its next release get the same leaves (`_again`: one `_Reread`
        per use). Not where a torch.func transform is active (`_Reread` has no vmap rule) nor
        with `cast_ahead` (its watch must see this use's reads: the leaves stay `Watched`): the
        unit then stays gathered as before. Refused under forward-mode AD (`_forward_mode_reread`)."""
        if torch.autograd.forward_ad._current_level >= 0 and func_level() is not None:  # (plain forward_ad works:
            raise ConfigError(_forward_mode_reread(unit))  # found in review of the first version, which refused it)
        self.refill(unit)
        leaves = self._leaves[unit]
        anchor = self._anchors[-1]  # any unit's: it requires grad where the step differentiates
        if not (torch.is_grad_enabled() and anchor.requires_grad and self._reads is None and func_level() is None):
            return leaves
        anchor, *outs = _Reread.apply(weakref.WeakMethod(self._reread_done), unit, anchor, *leaves.values())
        self._anchors.append(anchor)  # the loss adds it times 0: the Function's backward runs (a frozen unit)
        self._rereads.append((len(self._leaves), unit))
        self._again[unit] = again = dict(zip(leaves, outs))
        return again

    def _run(self, unit: str, gathered: list[Flight] | None = None) -> dict[str, torch.Tensor]:
        casts, reads = self._casts.get(unit), self._reads
        if reads is not None and from_compiled():
            raise ConfigError(f"cast_ahead=True: the loss reads unit {unit!r} from compiled code (torch.compile), "
                              f"which cannot take the watched leaves cast_ahead hands it (docs/compile.md); use "
                              f"train_step(cast_ahead=False) with a compiled loss")
        program = casting(self._programs[unit], casts, watch=reads is not None and (reads.learning or casts is not None))
        if gathered is not None:
            program = _entering(program, gathered)
        ids = [b.index for b in program.buckets]
        after = self.after_backward if self.releasable else None
        outs, anchor = run_unit(program, [self._xs[b] for b in ids], [self._fulls[b] for b in ids],
                                self._probes[unit], after, self._inflight)
        self._anchors.append(anchor)
        if self._reads is not None:
            self._reads.watch(program, outs, [self.layout.leaves[i].path for i in program.leaves])
        leaves = dict(zip(program.leaves, outs))
        with torch._C.DisableTorchFunctionSubclass():  # not a read `Watched` leaves report (cast_ahead)
            plain = [(i, unwrapped(t)) for i, t in leaves.items()]  # torch.func's wrappers: the tensor written
            self._handed.extend((unit, self.layout.leaves[i].path, t, t._version) for i, t in plain
                                if not t.is_inference())  # (no version: nothing writes one outside inference_mode)
        if self.releasable:  # gathered storage only: at N = 1 a bucket may read its held tensor itself
            firsts = [(b, leaves[b.leaves[0]]) for b in program.buckets if b.size and leaves[b.leaves[0]].numel()
                      and leaves[b.leaves[0]].untyped_storage()._cdata != self._held(b.index).untyped_storage()._cdata]
            self._storages[unit] = [(b, t.untyped_storage(), t.untyped_storage().nbytes()) for b, t in firsts]
            self._owner.update({s._cdata: unit for _, s, _ in self._storages[unit]})
        return {self.layout.leaves[i].path: t for i, t in leaves.items()}

    def release(self, unit: str, force: bool = False) -> None:
        """Free the unit's gathered storage until `refill` (or the next read) gathers it again;
        nothing where the step does not release. A unit of at most `persist_bytes` is kept
        instead (unless `force`: the cap needs its room). In the loss's forward the latest unit
        released waits until another is released or read: the forward's last stays gathered for
        its backward, which comes next (FSDP2 keeps its root's params from forward to backward,
        DeepSpeed a param reused within `stage3_max_reuse_distance`), and is freed after it."""
        if not (self.releasable and unit in self._leaves and unit not in self._released and self._storages[unit]):
            return  # (no gathered storage: every bucket reads its held tensor, N = 1)
        if not force and self._programs[unit].gathered_bytes <= self.persist_bytes:
            if unit not in self._kept:
                self._kept.append(unit)
            return
        if not force and self._deferring:
            if unit != self._deferred:
                self._release_deferred()
                self._deferred = unit
                self._kept.append(unit)
            return
        if unit in self._kept:
            self._kept.remove(unit)
        if self._again:  # this use's leaves (`_reread`): fzero's own, no reference that keeps the unit
            self._again.pop(unit, None)
        if self._referenced(unit):  # freeing it would leave that reference reading freed memory
            self._pinned.add(unit)
            return
        for _, storage, _ in self._storages[unit]:
            storage.resize_(0)
        self._released.add(unit)

    def _reread_done(self, unit: str) -> None:
        """`_Reread`'s backward: the backward of one later use of `unit` is done (`_backward_after`
        counts them); free the unit until an earlier use's backward reads it."""
        self._reread_back[unit] = self._reread_back.get(unit, 0) + 1
        self.release(unit)

    def _uses(self, unit: str) -> _Uses:
        """The references to `unit`'s gathered storage and leaves that autograd's saved tensors do
        not account for (`_Uses`): each tensor saved over a unit's storage is a detached copy that
        only its `_Saved` holds (`_Unpacking`), one use of the storage each."""
        storages = [storage for _, storage, _ in self._storages[unit]]
        return _Uses([_use_count(s._cdata) - len(self._saved.get(s._cdata, ())) for s in storages],
                     [sys.getrefcount(t) for t in self._leaves[unit].values()])

    def _referenced(self, unit: str) -> bool:
        """Whether something beyond fzero and autograd's saved tensors still holds `unit`'s storage,
        compared with when it was read: a leaf (a forward hook or a grad hook keeping the weight, a
        Function's `ctx.w`, a loss holding `p["a.weight"]` across the module), or a view made since
        (a slice or a `self.weight.t()` cached on a module). Such a unit is not freed: before, the
        reference read freed memory (torch's "data is not allocated", or a segfault)."""
        at_read = self._at_read.get(unit)  # (none where torch lacks `_use_count`)
        if at_read is None:
            return False
        now = self._uses(unit)
        return any(a > b for a, b in zip(now.storages + now.leaves, at_read.storages + at_read.leaves))

    def holds(self, unit: str, out: Any) -> bool:
        """Whether a tensor of `out` (what a module that read `unit` returned) lies in the unit's
        gathered storage: a module that returns its param or a view of it (`self.weight[:T]`, a
        positional embedding) hands the modules after it memory that `release` would free under
        them (before: torch's "data is not allocated", or a crash reading freed memory)."""
        ids = {storage._cdata for _, storage, _ in self._storages.get(unit, ())}
        if not ids or unit in self._released:
            return False
        with torch._C.DisableTorchFunctionSubclass():  # not a read `Watched` leaves report (cast_ahead)
            return any(unwrapped(t).untyped_storage()._cdata in ids for t in _tensors_in(out))

    def release_used(self, unit: str, out: Any = None) -> None:
        """`release` after a module that read `unit` returned `out` (None: nothing seen), unless
        `out` holds a view of the unit's storage (`holds`), or an earlier output this step did:
        such a unit stays gathered until its backward (`after_backward`)."""
        if unit in self._pinned:
            return
        if self.holds(unit, out):
            self._pinned.add(unit)
            return
        self.release(unit)

    def _release_deferred(self) -> None:
        """Free the unit whose release waits (`release`), unless the cap freed it already."""
        unit, self._deferred = self._deferred, None
        if unit is not None and unit in self._kept:
            self.release(unit, force=True)

    @property
    def live(self) -> dict[str, int]:
        """`{unit: gathered bytes}` of the units gathered now (read and not released, or with a
        prefetched gather in flight), in read order, then start order. A read unit without gathered
        storage (N = 1: each bucket reads its held tensor itself, `_run`) holds none: not listed."""
        held = [u for u in self._leaves if u not in self._released and self._storages.get(u) != []] + [
            u for u in self._ahead if u not in self._leaves or u in self._released]
        return {u: self._programs[u].gathered_bytes for u in held}

    def _make_room(self, unit: str) -> None:
        """Before gathering `unit` under `max_live_bytes`: free kept units (their use is done), oldest
        first, then drop prefetched gathers, latest first, until it fits; raise if it cannot fit."""
        cap = self.max_live_bytes
        if cap is None:
            return
        need = self._programs[unit].gathered_bytes
        if need > cap:
            raise ConfigError(f"max_live_bytes={cap}: unit {unit!r} alone gathers {need} bytes; raise the cap to at "
                              f"least {need}, or split the unit (finer units=...)")
        while sum(self.live.values()) + need > cap and self._kept:
            self.release(self._kept[0], force=True)
        while sum(self.live.values()) + need > cap and self._ahead:
            self._drop(next(reversed(self._ahead)))
        live = self.live
        if sum(live.values()) + need > cap:
            pinned = [u for u in live if u in self._pinned]
            why = (f" (of those, {pinned} stay gathered because a module's output is a view of them or something "
                   f"else still references them: a view cached on a module, a weight kept by a hook, docs/bad-input.md "
                   f"row 57)" if pinned else "")
            raise ConfigError(f"max_live_bytes={cap}: gathering unit {unit!r} ({need} B) while units {live} "
                              f"({sum(live.values())} B) are still in use{why} would exceed the cap; raise it to at "
                              f"least {sum(live.values()) + need}, or use finer units")

    def refill(self, unit: str, backward: bool = False) -> None:
        """Gather a released unit again, into the same storage (the same bits: all-gather copies).
        In backward (`_Unpacking`) the refills of the next `prefetch` units backward will need are
        started first. At N = 1, where the gather is the held shard cast to the compute dtype
        (`Mesh.solo`), the cast is written into the storage itself (`_fill`), not into a new
        tensor copied there."""
        if backward and self._last is not None and (unit == self._last or unit in self._released):
            self._settle_last(unit)
        if unit not in self._released:
            return
        filled = False
        if unit not in self._ahead:
            self._make_room(unit)
            filled = self._fill(unit)
            if not filled:
                self._ahead[unit] = self._start(unit)
        if backward:
            self._prefetch(self._backward_after(unit), backward=True)
        if not filled:
            flights = self._ahead[unit]  # each stays until its wait returns (`wait_held`), for `finish`
            with torch.no_grad():
                for _, storage, nbytes in self._storages[unit][len(self._storages[unit]) - len(flights):]:
                    full = wait_held(flights)
                    if full.untyped_storage()._cdata != storage._cdata:  # else gathered into it (`_start`)
                        _regrown(storage, nbytes, full, full.dtype, full.shape).copy_(full)
            del self._ahead[unit]
        self._released.discard(unit)

    def _fill(self, unit: str) -> bool:
        """`refill` at N = 1, where the stage's enter is the plain gather (`ENTER_GATHER`: at
        N = 1 `Mesh.solo`, which returns its input) and every held shard is on its storage's
        device: each bucket's held shard cast into its storage by one `copy_` (the kernel `.to`
        runs into a new tensor, so the same bits), then the enter of it, recorded as `_start`
        records it. False (nothing done) elsewhere: `refill` gathers and copies."""
        program = self._programs[unit]
        if program.mesh.world_size != 1 or not self._direct(unit):
            return False
        with torch.no_grad():
            for bucket, storage, nbytes in self._storages[unit]:
                held = self._held(bucket.index).detach()
                view = _regrown(storage, nbytes, held, bucket.wire.compute, held.shape)
                view.copy_(held)
                program.stage.enter.start(program.mesh, bucket.wire, view).wait()
        return True

    def _settle_last(self, unit: str) -> None:
        """At backward's first read of the forward's last unit, kept for it (`loss`), or of a
        released unit, whichever comes first: the kept unit is in use where the read is its own;
        else backward gathers another unit first, so the kept one's backward (if any) comes
        later, and it is freed before that gather, as it was after its forward before it was kept
        (gathered again if its backward reads it). Reads of units that were never freed (a root
        unit held for the step) decide nothing."""
        last, self._last = self._last, None
        if unit != last and last in self._kept:
            self.release(last, force=True)

    def after_backward(self, unit: str) -> None:
        """Called by the unit's Function when its backward is done: a refill prefetched for it and
        never read is dropped, and the unit is released."""
        self._backward_done.add(unit)
        if unit in self._ahead:
            self._drop(unit)
        self.release(unit)

    # -- prefetch --------------------------------------------------------------------------------

    def _start(self, unit: str) -> list[Flight]:
        """Start the stage's `enter` of `unit`'s buckets without waiting (`Piece.start`): one
        flight per bucket in bucket order, whose `wait()` is the `flat[N * S]` `enter` returns (the
        shard cast to the compute dtype, all-gathered; frozen buckets too). For a released unit
        (a refill): only the buckets that own a storage (`_storages`), as `refill` fills them."""
        program = self._programs[unit]
        if unit in self._released and self._into_storage(unit):
            mesh, n = program.mesh, program.mesh.world_size
            flights = []
            for b, storage, nbytes in self._storages[unit]:
                shard = self._held(b.index).detach().to(b.wire.compute)
                out = _regrown(storage, nbytes, shard, shard.dtype, (n * shard.shape[0], *shard.shape[1:]))
                flights.append(start_enter_into(mesh, b.wire, shard, out))
            return flights
        buckets = [b for b, _, _ in self._storages[unit]] if unit in self._released else program.buckets
        return [program.stage.enter.start(program.mesh, b.wire, self._held(b.index).detach().to(b.wire.compute))
                for b in buckets]

    def _into_storage(self, unit: str) -> bool:
        """Whether a refill of `unit` all-gathers straight into its released storages: N > 1 and
        `_direct`."""
        return self._programs[unit].mesh.world_size > 1 and self._direct(unit)

    def _direct(self, unit: str) -> bool:
        """Whether a refill of `unit` may write its storages itself (`_fill`, `_into_storage`):
        the stage's enter is the plain gather (`ENTER_GATHER`) and every held shard is on its
        storage's device (an offload tier's enter copies to the device first: it gathers into a
        new tensor, which `refill` copies)."""
        return self._programs[unit].stage.enter is ENTER_GATHER and all(
            self._held(b.index).device == storage.device for b, storage, _ in self._storages[unit])

    def _held(self, b: int) -> torch.Tensor:
        return held_tensor(self._xs, self._fulls, b)

    def _after(self, unit: str) -> list[str]:
        """The `prefetch` units that follow `unit` in the layout's order (none if it is not in it)."""
        units = self.layout.units
        at = self.layout.unit_order.get(unit, len(units) - 1) + 1
        return list(units[at : at + self.prefetch])

    def _backward_after(self, unit: str) -> list[str]:
        """The `prefetch` units backward reads after the use of `unit` whose backward comes now:
        those before it in the forward's reads. Where no unit was read again (`_reread`), the
        reverse of the first reads' order after `unit`. Else the reverse of every read's order
        (first reads and re-reads) after that use, the latest use of `unit` whose backward has not
        run (its re-reads' `_Reread`s that have, `_reread_back`): before, a unit read again was
        prefetched at the backward of its later use for its earliest use's, and held gathered
        between them."""
        if not self._rereads:  # (the reads before `unit`'s, latest first: no list of every read per call)
            at = self._read_at.get(unit, 0)
            return self._read_order[max(at - self.prefetch, 0) : at][::-1]
        order = _read_order(self.gathered, self._rereads)[::-1]
        at = [i for i, u in enumerate(order) if u == unit]
        start = at[min(self._reread_back.get(unit, 0), len(at) - 1)] + 1 if at else len(order)
        return order[start : start + self.prefetch]

    def _prefetch(self, units: Sequence[str], backward: bool) -> None:
        """Start the gathers of `units` in order: in forward those not yet read, in backward those
        released whose backward has not run and that backward can read (`_saves`); stop at the
        first that does not fit the cap (the same decision on every rank: the order, the sizes
        and the tensors the loss saved are the same)."""
        cap = self.max_live_bytes
        for unit in units:
            if unit in self._ahead:
                continue
            wanted = (unit in self._released and unit not in self._backward_done and self._saves(unit)
                      if backward else unit not in self._leaves)
            if not wanted:
                continue
            if cap is not None and sum(self.live.values()) + self._programs[unit].gathered_bytes > cap:
                return
            self._ahead[unit] = self._start(unit)

    def _drop(self, unit: str) -> None:
        """Wait for a prefetched gather nobody will read, and free it (NCCL may still be writing);
        a refill gathered into the released storage frees that storage again. Each bucket's
        gather stays in `_ahead` until its wait returns (`wait_held`): where a wait fails, that one
        is done and the unit's later buckets' are still there, for `finish`; where it is
        interrupted, that one is still there too (before, the unit was taken out first, and a
        failed wait lost them, neither waited for nor handed to the mesh; found in review)."""
        flights = self._ahead[unit]
        while flights:
            wait_held(flights)
        del self._ahead[unit]
        if unit in self._released:
            for _, storage, _ in self._storages[unit]:
                storage.resize_(0)

    def _saves(self, unit: str) -> bool:
        """Whether the loss saved a tensor for backward over `unit`'s gathered storage (`_Unpacking`'s
        pack keys `_saved` by storage, and the key stays when autograd frees the tensor): only
        then can backward read the unit, and so gather it again. Not where nothing was saved
        from it: a frozen unit whose inputs need no grad (fine-tuning's first blocks), an
        embedding, whose backward reads its indices only."""
        return any(storage._cdata in self._saved for _, storage, _ in self._storages.get(unit, ()))

    def drain(self) -> None:
        """Drop every forward prefetch still in flight (the forward is over: those units were not
        read). Backward prefetches are dropped by their unit's `after_backward`, and any left when
        the backward is over by `finish`."""
        for unit in [u for u in self._ahead if u not in self._leaves]:
            self._drop(unit)

    def finish(self, error: BaseException | None = None) -> None:
        """The backward is over (`torch.autograd.grad` returned, or the loss or the backward raised
        `error`): drop every gather still in flight (`_drop`: wait for it, free its storage). A
        refill prefetched for a unit whose backward then reads nothing of it is dropped by that
        unit's `after_backward`, which its Function calls while this object lives; the step holds
        it until this call. (Before, only the graph's saved-tensor hooks held it: freed
        mid-backward, once autograd had freed the last tensor saved through them, with a refill in
        flight, it left that gather unwaited -- on gloo the next collective hung until the mesh
        timeout -- and the later units' `after_backward` unrun; found in review.) So after a whole
        backward nothing is left here; after an error, what the forward and the backward started
        is. No collective starts here.

        On an `error` the refills are waited for too, and the forward's prefetches of units never
        read (`call` drains those only where the loss returns: a loss that raised after reading
        unit u had started the gather of the unit after it, which, before, nobody waited for;
        found in review), but only where the mesh `starts_agreed` (SimMesh; a `DistMesh` that
        verifies starts a collective only once every rank has called it): the ranks may have
        raised at different units, and over `DistMesh(verify=False)` a peer that raised earlier
        never started that gather -- a refill too: a peer whose loss raised after reading every
        unit never reached the backward, whose refills this rank prefetched (before, they were
        waited for as "every rank reached the backward") -- so the wait would last to the process
        group's timeout (found in review); those are handed to the mesh (`Mesh.abandon`): a peer
        that did start one and waits for it gets its data (gloo cancels a point-to-point exchange
        whose handle is freed). A wait that fails passes silently, so that `error` is what the step
        raises; none on the mesh's own error (`MeshError`: a lost or stuck rank, after which a wait
        may never end) nor on an interrupt. The first wait that fails ends the waiting, as in
        `Inflight.settle`: what is left -- the later units' gathers, and the later buckets' of the
        unit whose wait failed -- is handed to the mesh, also where something interrupts the
        waits. (Before, each unit's failed wait was passed over and the next unit's waited for:
        with a frozen or dead peer every unit waited out its own timeout, and the failed unit's
        later buckets were lost, neither waited for nor handed to the mesh; found in review.)"""
        if error is None:
            for unit in list(self._ahead):
                self._drop(unit)
            return
        try:
            for unit in [u for u in self._ahead if self._programs[u].mesh.waits_after(error)]:
                self._drop(unit)
        except RuntimeError:  # (MeshError is one): the rest are not waited for
            pass
        finally:
            for unit in list(self._ahead):  # not waited: kept by the mesh, not cancelled (`Mesh.abandon`)
                self._programs[unit].mesh.abandon(self._ahead.pop(unit))

    @property
    def gathered(self) -> tuple[str, ...]:
        """The units read so far, in the order they were first read."""
        return tuple(self._leaves)

    def leaf_dtypes(self) -> set[torch.dtype]:
        """The dtypes the loss gets the leaves in, gathering nothing: each bucket's compute dtype
        (`Wire.compute`, the precision policy's), or the dtype `cast_ahead` hands a leaf in."""
        dtypes = set()
        for unit, program in self._programs.items():
            compute = [b.wire.compute for b in program.buckets for _ in b.leaves]  # `program.leaves` order
            casts = self._casts.get(unit) or (None,) * len(compute)
            dtypes.update(c if c is not None else d for c, d in zip(casts, compute))
        return dtypes

    # -- the loss -----------------------------------------------------------------------------

    def loss(self, loss_fn: Callable[[Any, Any], torch.Tensor], batch: Any) -> torch.Tensor:
        """`loss_fn(params, batch)` in this step's mode, plus `0 * Σ anchors` (the same bits). At
        N > 1 the forward's last released unit stays gathered for the backward (`release`), which
        starts the refills of the units its backward reaches next now, as a refill would. At N = 1
        its refill is a local copy (a cast), with no collective to save, while holding it through
        the rest of the loss raised the peak by one unit (bf16 stage 3 on the 1.34B GPT: 30.43
        GiB against FSDP2's 30.34, measured in the twenty-fourth session): it is freed there."""
        self._deferring = self.releasable and self.layout.world_size > 1
        try:
            loss = self.call(loss_fn, batch)
        finally:
            self._deferring = False
        # kept (`_kept`) until its backward's `after_backward`, or backward's first refill of another unit
        last, self._deferred = self._deferred, None
        self._last = last
        if last is not None and self.prefetch:
            self._prefetch(self._backward_after(last), backward=True)
        _check_loss(loss)
        if not self._anchors:  # the loss read no unit (or there is none)
            return loss
        return loss + (torch.stack(self._anchors).sum() * 0).to(loss.dtype)

    def call(self, fn: Callable[[Any, Any], Any], batch: Any) -> Any:
        """`fn(params, batch)` with the params in this step's mode, as it returns (no anchors:
        `fzero.evaluate` runs no backward)."""
        # the modes `fn` is called in: every unit's leaves are made in them, also where `fn` first
        # reads a unit under torch.no_grad() or inference_mode() (a statistic), so that the unit
        # still gets its gradient, as torch's params, made once, require grad however first read
        self._grad, self._inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()
        params, context = self._params()
        try:
            with context:
                out = fn(params, batch)
            if isinstance(context, FirstUse):  # a placeholder `fn` returns as it is: the leaf, as eager returns
                out = context.returned(out)
        except RuntimeError as e:  # a write before a read: torch's view check raises inside `fn`
            self._check_unwritten(e)
            _check_not_parameter(e)
            raise
        self._check_unwritten()
        self.drain()  # on an error, `finish` waits only for what every rank started (`Mesh.starts_agreed`)
        return out

    def _check_unwritten(self, cause: BaseException | None = None) -> None:
        """Raise `ConfigError` where `fn` wrote a leaf it was handed in place (`p["w"].clamp_(...)`
        under `torch.no_grad()`; a view's writes bump the version its base shares): the leaves are
        views of the state's own buffers where the stage holds the params whole (stages 0-2, and
        stage 3 at N = 1) and of a gathered copy elsewhere, so the write would change the input
        state in some stages and be lost in others. Raised as an error of `fn` is (on this rank;
        a `DistMesh`'s others are told, `Mesh.guard`). Writes through `.data` or `.detach()` bump
        no version and are not found (docs/bad-input.md). `cause`: the error `fn` raised (torch's, where
        a leaf written in place was then read: its view check), chained to this one."""
        written: dict[str, list[str]] = {}
        with torch._C.DisableTorchFunctionSubclass():
            for unit, path, t, version in self._handed:
                if t._version != version:
                    written.setdefault(unit, []).append(path)
        if written:
            paths = [p for ps in written.values() for p in ps]
            named = named_paths(paths)
            raise ConfigError(
                f"the loss (or evaluate function) wrote a param in place, in unit(s) {list(written)}: one or more "
                f"of {named} (a bucket's leaves are views of one buffer and share the version counter the write "
                f"moved). A step's params are its inputs, views of the state's buffers in some stages and gathered "
                f"copies in others, so the write would change the input state or be lost depending on the stage "
                f"(where the stage holds the params whole, the input state holds it already); compute with a new "
                f"tensor (w.clamp(...), not w.clamp_(...)), and apply constraints to the new state after the step "
                f"(torch's own writers: nn.Embedding(max_norm=...) renormalises its weight in place)") from cause

    def _params(self) -> tuple[Any, Any]:
        layout = self.layout
        paths = remembered(_PATHS, layout, None, lambda: _paths_in_given_order(layout))
        if self.mode == "eager":
            by_path = {path: t for unit in self._programs for path, t in self.read(unit).items()}
            return unflatten(layout.treespec, [by_path[ls.path] for ls in layout.leaves]), contextlib.nullcontext()
        lazy = LazyParams(paths, self)
        if is_flat_dict(layout):
            return lazy, _Unpacking(self) if self.releasable else contextlib.nullcontext()
        dev = {b.index: x.device for b, x in zip(layout.buckets, self._xs)}
        with torch._C._DisableFuncTorch():  # plain tensors under a torch.func level too, so `Placeholder` sees ops
            zeros = [torch.zeros((), dtype=ls.dtype, device=dev[ls.bucket]) for ls in layout.leaves]
            if self._grad and not self._inference and func_level() is None:  # the step differentiates: FirstUse
                self.roots = {ls.path: z.requires_grad_() for ls, z in zip(layout.leaves, zeros)
                              if z.is_floating_point() or z.is_complex()}
            with torch.enable_grad():
                holders = [z.expand(ls.shape).as_subclass(Placeholder) for ls, z in zip(layout.leaves, zeros)]
            for t, ls in zip(holders, layout.leaves):
                t.fzero_path = ls.path  # for `_unswapped`'s message
        first_use = FirstUse({id(t): ls.path for t, ls in zip(holders, layout.leaves)}, lazy.__getitem__)
        return unflatten(layout.treespec, holders), first_use


_PATHS: dict = {}  # layout -> {path: unit}, what LazyParams reads (one object per layout: from_module's plan key)


def _read_order(first: Sequence[str], rereads: Sequence[tuple[int, str]]) -> list[str]:
    """The forward's reads in order: the units `first` read, each followed by the re-reads made
    after it (`(units first read before it, unit)`, `Gathering._rereads`)."""
    order = []
    after = {}
    for count, unit in rereads:
        after.setdefault(count, []).append(unit)
    order.extend(after.get(0, ()))
    for i, unit in enumerate(first):
        order.append(unit)
        order.extend(after.get(i + 1, ()))
    return order


def check_prefetch(prefetch: Any) -> None:
    if prefetch is None:
        return
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise ConfigError(f"prefetch must be None or an int >= 0 (how many units ahead stage 3 starts gathering; "
                          f"0: gather each unit when it is read; None: 1 where the mesh overlaps collectives "
                          f"with compute, else 0), got {prefetch!r}")


def prefetch_of(prefetch: int | None, programs: Sequence[UnitProgram]) -> int:
    """The prefetch depth a step or an evaluation uses: 0 under a torch.func transform (a step
    differentiated through, docs/func.md: every gather runs in place, differentiably, as the
    step's reductions do, `reduce.overlaps`); else `prefetch` itself, or for None (the default)
    one unit ahead where the mesh's `start` returns before the gather is done
    (`Mesh.asynchronous`: DistMesh over more than one rank), so that the next unit's gather
    overlaps this one's compute, as DeepSpeed and FSDP2 prefetch by default, and 0 elsewhere
    (on SimMesh or over one rank a prefetch only holds a gathered unit longer). The bits are
    the same at every depth."""
    if func_level() is not None:
        return 0
    if prefetch is not None:
        return prefetch
    return 1 if programs and programs[0].mesh.asynchronous else 0


_use_count = getattr(torch._C, "_storage_Use_Count", None)  # tensors (and storage objects) on a storage


@dataclasses.dataclass(frozen=True)
class _Uses:
    """A unit's references not held by autograd's saved tensors (`Gathering._uses`): per gathered
    storage, its use count less the tensors saved over it; per leaf, in read order, its Python
    references (`sys.getrefcount`, the same frame both times)."""

    storages: list[int]
    leaves: list[int]


def _tensors_in(out: Any) -> Iterator[torch.Tensor]:
    """The tensors of a module's output: torch's pytree leaves, and the fields of dataclasses
    (which torch's pytree takes for leaves), recursively."""
    for leaf in torch_pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor):
            yield leaf
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            for f in dataclasses.fields(leaf):
                yield from _tensors_in(getattr(leaf, f.name))


def replaced_tensors(out: Any, hit: Callable[[torch.Tensor], bool], fn: Callable[[torch.Tensor], torch.Tensor],
                     what: Callable[[torch.Tensor], str]) -> Any:
    """`out` with `fn(t)` for each tensor `t` in it where `hit(t)`: through torch's pytree nodes
    (tuples, lists, dicts, NamedTuples, registered types: rebuilt), and the fields of dataclass
    instances, which torch's pytree takes for leaves (`_tensors_in`): a shallow copy with the
    changed fields set, as `object.__setattr__` sets them (no `__init__` runs; frozen ones too).
    An object of another class whose attributes (`__dict__`, `__slots__`) hold such a tensor,
    directly or in a pytree, cannot be rebuilt: `ConfigError` naming its type, the attribute,
    `what(t)` and the way out (found in review: evaluate returned a dataclass holding the on-use
    placeholder of a nested params leaf, at every stage)."""

    def leaf(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return fn(x) if hit(x) else x
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            changed = {}
            for f in dataclasses.fields(x):
                old = getattr(x, f.name)
                new = replaced_tensors(old, hit, fn, what)
                if new is not old:
                    changed[f.name] = new
            if not changed:
                return x
            copied = copy.copy(x)
            for name, value in changed.items():
                object.__setattr__(copied, name, value)
            return copied
        for name, value in _attributes(x):
            held = [t for t in torch_pytree.tree_leaves(value) if isinstance(t, torch.Tensor) and hit(t)]
            if held:
                kind = type(x)
                raise ConfigError(
                    f"the function returned a {kind.__module__}.{kind.__qualname__} whose attribute {name!r} holds "
                    f"{what(held[0])}, which fzero must replace before handing it back but cannot inside an object "
                    f"of that class (it rebuilds tuples, lists, dicts, NamedTuples, dataclasses and torch pytree "
                    f"nodes): return the tensors in one of those, make {kind.__qualname__} a @dataclasses.dataclass, "
                    f"or register it (torch.utils._pytree.register_pytree_node)")
        return x

    if not any(hit(t) for t in _tensors_in(out)) and not any(_attributes(x) for x in torch_pytree.tree_leaves(out)):
        return out  # nothing to replace, no object to look into: `out` itself
    return torch_pytree.tree_map(leaf, out)


_PLAIN = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)


def _attributes(x: Any) -> list[tuple[str, Any]]:
    """`(name, value)` of the instance attributes (`__dict__`, `__slots__`) of an output object
    that is neither a tensor, a dataclass instance, a plain value nor a callable (a module)."""
    if isinstance(x, (torch.Tensor, *_PLAIN)) or callable(x) or dataclasses.is_dataclass(x):
        return []
    found = list(vars(x).items()) if isinstance(getattr(x, "__dict__", None), dict) else []
    for klass in type(x).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(x, name):
                found.append((name, getattr(x, name)))
    return found


def held_tensor(xs: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor | None], b: int) -> torch.Tensor:
    """Bucket b's held tensor as its unit reads it: the full buffer beside its differentiated
    tensor where there is one (`fulls[b]`), else that tensor (`xs[b]`)."""
    return xs[b] if fulls[b] is None else fulls[b]


def _gathers(programs: Sequence[UnitProgram]) -> bool:
    """Whether the stage enters params by all-gather (stage 3): only then is there a gather to start."""
    return any(p.stage.sharded("params") for p in programs)


def _entering(program: UnitProgram, gathered: list[Flight]) -> UnitProgram:
    """`program` whose `enter` returns the started gathers' results, bucket by bucket, instead of
    gathering (`Flight.wait`: the same bits as `enter`). Holds the pending gathers only, never
    the `Gathering` (the program lives in the autograd graph): `gathered` is the list the
    `Gathering` keeps for the unit (`_ahead`, one flight per bucket in bucket order), and each
    flight stays in it until its wait returns (`wait_held`: an interrupted one stays, a failed one
    is done and taken out). So where a wait raises (a lost peer, a timeout, an interrupt) or the
    unit's forward raises before its last bucket enters, the gathers not yet waited for are still
    there for `Gathering.finish` to wait for or hand to the mesh (before, `read` took the list
    out first, and they were lost: neither waited for nor abandoned, and gloo cancelled those
    exchanges under a peer that waited for them; found in review)."""

    def enter(mesh: Any, wire: Any, x: torch.Tensor) -> torch.Tensor:
        return wait_held(gathered)

    stage = program.stage
    return dataclasses.replace(program, stage=dataclasses.replace(
        stage, enter=Piece(enter, stage.enter.moves, stage.enter.frozen_moves)))


def _regrown(storage: torch.UntypedStorage, nbytes: int, like: torch.Tensor, dtype: torch.dtype,
             shape: tuple[int, ...]) -> torch.Tensor:
    """A released unit's `storage` grown back to `nbytes`, as a `shape` tensor of `dtype` (on
    `like`'s device) with a version counter of its own, not that of the tensors saved from it."""
    storage.resize_(nbytes)
    return like.new_empty(0, dtype=dtype).set_(storage, 0, shape)


_FLAT: dict = {}


def is_flat_dict(layout: Layout) -> bool:
    """Whether the params pytree is a flat `{path: tensor}` dict (what `from_module` makes); once
    per layout."""
    return remembered(_FLAT, layout, None, lambda: layout.treespec == optree.tree_structure(
        dict.fromkeys((ls.path for ls in layout.leaves), 0), namespace=NAMESPACE))


def _check_loss(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.dtype.is_floating_point:
        got = f"{type(loss).__name__} {loss.dtype} {loss.shape}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise FzeroError(f"loss_fn must return a 0-d floating tensor (this rank's mean loss), got {got}"
                         f"{_loss_way_out(loss)}")


def _loss_way_out(loss: Any) -> str:
    """How to make a loss of what `loss_fn` returned: a tensor of per-example losses is one
    `.mean()` away (or `reduction="mean"`, torch's losses' default), an integer one a computation
    in a floating dtype (found in review: the error named what it got, not the way out)."""
    if isinstance(loss, (list, dict)):  # torch.func's has_aux habit, in another container (found in review)
        return ("; the step takes no auxiliary output: return the loss alone, and keep an auxiliary one by "
                "appending aux.detach() to a list the loss closes over, or compute it with fzero.evaluate(fn)")
    if loss is None:  # a loss_fn that computes the loss and forgets to return it (found in review)
        return "; loss_fn returned nothing: does it end with `return loss`?"
    if isinstance(loss, (int, float)):  # (found in review: no way out)
        return ("; compute it from the params as a tensor and return that tensor: loss.item() or float(loss) "
                "cuts the graph the step differentiates")
    if not isinstance(loss, torch.Tensor):
        return ""
    if loss.is_complex():  # (found in review: no hint)
        return "; make it real, e.g. loss.abs() or loss.real (a complex loss orders nothing to descend)"
    if not loss.dtype.is_floating_point:
        return "; compute the loss in a floating dtype (an integer count or accuracy has no gradient)"
    if loss.dim():
        return "; reduce it to one number, e.g. loss.mean() (torch's losses: reduction='mean', their default, not 'none')"
    return ""


class _Reread(torch.autograd.Function):
    """The leaves of a unit read again after its release in the same forward
    (`Gathering._reread`), handed on as they are (views of the same storage: no copy, the same
    bits), and a view of `anchor`. The engine runs its backward once the backward of every op
    that read those leaves is done -- and, through `anchor`, a unit's anchor the loss adds times 0,
    also where none of them gets a gradient (a frozen unit): then after every node made later, as
    it runs the unit Functions. There it calls `release(unit)` (`Gathering._reread_done`, held
    weakly: the graph must not hold the step's `Gathering`), and passes the gradients through
    unchanged: the unit's Function sums them with the earlier uses' in the order it did before
    (the engine runs the nodes of one device in reverse order of creation)."""

    @staticmethod
    def forward(ctx: Any, release: weakref.WeakMethod, unit: str, anchor: torch.Tensor,
                *leaves: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.release, ctx.unit = release, unit
        ctx.set_materialize_grads(False)
        frozen = [t for t in leaves if not t.requires_grad]
        if frozen:  # as the unit Function hands them: torch.matmul reads requires_grad to choose its product
            ctx.mark_non_differentiable(*frozen)
        return (anchor, *leaves)

    @staticmethod
    def backward(ctx: Any, _anchor: torch.Tensor | None, *grads: torch.Tensor | None) -> tuple:
        release = ctx.release()
        if release is not None:
            release(ctx.unit)
        return (None, None, None, *grads)


class _Saved:
    """What autograd holds for a tensor the loss saves for backward under `_Unpacking`: the tensor
    and its version counter when saved (None where it keeps none)."""

    __slots__ = ("tensor", "version", "__weakref__")

    def __init__(self, tensor: torch.Tensor, version: int | None) -> None:
        self.tensor, self.version = tensor, version


def version_of(t: torch.Tensor) -> int | None:
    """`t`'s version counter, or None for an inference tensor (which keeps none)."""
    try:
        return t._version
    except RuntimeError:  # an inference tensor keeps no version
        return None


def _unmodified(saved: _Saved) -> torch.Tensor:
    """The saved tensor, after torch's own check that nothing wrote it in place since it was saved,
    which torch skips for tensors packed by hooks: without it a stage-3 step that frees units
    would train on the written values where stages 0-2 raise this error."""
    t = saved.tensor
    now = version_of(t)
    if saved.version is not None and now != saved.version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.dtype} {list(t.shape)}] is at version {now}; expected version {saved.version} instead. (fzero "
            f"checks this itself where stage 3 frees units after use, since torch does not check tensors saved "
            f"through saved-tensor hooks; the same loss raises torch's own form of this error at stages 0-2.) "
            f"Compute with a new tensor (h = h * 2, not h.mul_(2))")
    return t


class _Unpacking(torch.autograd.graph.saved_tensors_hooks):
    """Backward needs a tensor saved from a released unit's storage: gather that unit again first.
    Every tensor saved inside the loss is packed as a `_Saved`, so that its version is checked
    as torch checks it without hooks (`_unmodified`).

    A saved tensor made by autograd (it has a `grad_fn`) is kept detached, as torch keeps a saved
    output without hooks: an op that saves its own output (`softmax`, `exp`, `tanh`) held
    through its `_Saved` the output, whose `grad_fn` is that op's node, which holds the `_Saved`:
    a cycle through C++ that Python's collector cannot see, freed only by a backward through the
    node. Where none ran -- a loss that raised in its forward, a result the loss computed in grad
    mode and dropped (`logits.softmax(-1)` for a metric) -- the graph and, through `unpack`, this
    step's `Gathering` with its gathered units, prefetches in flight and the input state's
    buffers were never freed: every such step leaked them (found in review). A leaf that requires
    grad is kept itself, as torch keeps it (its gradient's accumulator lives as long as it)."""

    def __init__(self, gathering: Gathering) -> None:
        def pack(t: torch.Tensor) -> _Saved:
            key = t.untyped_storage()._cdata
            if key not in gathering._owner:
                if t.grad_fn is None:
                    return _Saved(t, version_of(t))
                with torch._C.DisableTorchFunctionSubclass():  # as the unit's below: no subclass sees it
                    return _Saved(t.detach(), version_of(t))
            # a unit's: a detached copy (the same storage and version counter; torch gives the
            # unpacked tensor back its autograd metadata), one use of the storage that only this
            # `_Saved` holds, counted by `Gathering._uses`
            with torch._C.DisableTorchFunctionSubclass():
                saved = _Saved(t.detach(), version_of(t))
            gathering._saved.setdefault(key, weakref.WeakSet()).add(saved)
            return saved

        def unpack(saved: _Saved) -> torch.Tensor:
            t = _unmodified(saved)
            unit = gathering._owner.get(t.untyped_storage()._cdata)
            if unit is not None:
                gathering.refill(unit, backward=True)
            return t

        super().__init__(eager(pack), eager(unpack))  # a compiled loss saves tensors: dynamo does not compile
        # the hooks (it compiled `version_of` as a frame of its own, found in review)

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if isinstance(exc[1], RuntimeError) and "saved tensor hooks" in said(exc[1]):
            raise ConfigError(
                "a torch.func transform (grad, vjp, jacrev, hessian, vmap(grad)) ran inside the loss of a stage-3 step "
                "with engine='autograd', gather='on_use' and flat-dict params: that step frees each unit after its "
                "forward and gathers it again in backward through saved-tensor hooks, which torch.func refuses. Use "
                "engine='func' (units then stay gathered from their forward to their backward), or gather='eager' "
                "(docs/func.md)") from exc[1]


def _forward_mode_reread(unit: str) -> str:
    """The refusal of a unit read again, after its release, under a torch.func forward-mode
    transform (its wrappers have no storage; plain `torch.autograd.forward_ad` reads it): torch's bare
    "Cannot access storage of TensorWrapper" from inside the gather before (found in review of a
    torch.func researcher: a Jacobian penalty by `jacfwd` of the model inside the loss)."""
    return (f"a torch.func forward-mode transform (jvp, jacfwd, hessian) inside the loss of a stage-3 "
            f"step with engine='autograd', gather='on_use' and flat-dict params read unit {unit!r} again after that "
            f"step had released it (the model run once before the transform): the step gathers such a unit anew, "
            f"which forward mode cannot see through. Use engine='func' (units then stay gathered from their forward "
            f"to their backward) or gather='eager', or read the params first (w = dict(params)) and run the "
            f"transform over w (docs/func.md)")


def _paths_in_given_order(layout: Layout) -> dict[str, str]:
    """`{path: unit}` of a layout's leaves, a flat dict's in the order its keys were given (the
    order `unflatten` restores, and `gather="eager"`'s dict has): the layout's leaves follow
    optree's flatten order, which sorts a dict's keys, so a loss iterating `params.values()` to
    sum over leaves (a DP-SGD clip norm) added them in another order than over the dict it was
    given, or over `model.named_parameters()`: other bits (found in review of a torch.func user)."""
    units = {ls.path: ls.unit for ls in layout.leaves}
    if not is_flat_dict(layout):
        return units
    given = unflatten(layout.treespec, [ls.path for ls in layout.leaves])
    return {path: units[path] for path in given.values()}


class LazyParams(Mapping):
    """The read-only mapping `{dotted path: leaf}` a loss gets when gathering on use: reading
    any leaf of a unit gathers the whole unit (once per step); a unit never read is gathered only
    after the loss, to reduce its (zero) gradient. `from_module`'s `apply` reads a unit in a
    forward pre-hook of its submodule and calls `release` after that submodule's forward.

    The step builds it (not user code): `unit_of` maps each dotted path to its unit, and
    `gathering` is the step's `Gathering`, which gathers and frees the units."""

    def __init__(self, unit_of: dict[str, str], gathering: Gathering) -> None:
        self._unit_of = unit_of
        self._gathering = gathering
        self._level = func_level()  # the torch.func level the loss runs at

    def unit_of(self, path: str) -> str:
        return self._unit_of[path]

    @property
    def unit_map(self) -> Mapping[str, str]:
        """`{path: unit}` (read-only; the same object for every step of one layout)."""
        return self._unit_of

    def unit(self, unit: str) -> dict[str, torch.Tensor]:
        """All leaves of `unit`, gathering it now if it was not yet (a new dict: one kept past the
        unit's use holds its leaves, which keeps the unit gathered, `Gathering._referenced`)."""
        return dict(self._gathering.read(unit))

    def release(self, unit: str, output: Any = None) -> None:
        """Free the unit's gathered storage where the step allows (stage 3, autograd engine),
        unless `output` (what the module that read the unit returned) holds a view of it (a
        module returning its param or a slice of it): then the unit stays gathered until its
        backward, since what follows reads that view."""
        self._gathering.release_used(unit, output)

    @property
    def gathered(self) -> tuple[str, ...]:
        """The units read so far, in the order they were first read."""
        return self._gathering.gathered

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """`{path: shape}` of every leaf, from the layout's specs (nothing gathered)."""
        return {ls.path: tuple(ls.shape) for ls in self._gathering.layout.leaves}

    @property
    def dtypes(self) -> set[torch.dtype]:
        """The dtypes the leaves are handed in, gathering nothing (`Gathering.leaf_dtypes`)."""
        return self._gathering.leaf_dtypes()

    def __getitem__(self, path: str) -> torch.Tensor:
        if path not in self._unit_of:
            raise KeyError(f"{path!r} is not a params path; some are {list(self._unit_of)[:5]}")
        return self._gathering.read(self._unit_of[path])[path]

    def __iter__(self) -> Iterator[str]:
        return iter(self._unit_of)

    def __len__(self) -> int:
        return len(self._unit_of)

    def __repr__(self) -> str:
        return f"LazyParams({len(self)} leaves, gathered units {list(self.gathered)})"


def _flatten_lazy(params: LazyParams) -> tuple[list[torch.Tensor], tuple[str, ...], tuple[str, ...]]:
    """Flattening reads (so gathers) every leaf, in sorted-key order like a dict; it unflattens
    to a plain dict. So a loss that maps or flattens its params works on use too."""
    keys = tuple(sorted(params))
    return [params[k] for k in keys], keys, keys


def _flatten_lazy_for_torch(params: LazyParams) -> tuple[list[torch.Tensor], list[str]]:
    """torch's pytree flatten (what `torch.func.grad`, `vjp`, `jacrev` and `jvp` do to their
    arguments, inside their own level): a unit first gathered there would be that transform's
    tensor, dead once it returns, yet cached for the rest of the step. So where units are still
    ungathered and the level is not the loss's, say so (`vmap` flattens before its level: fine)."""
    missing = [u for u in dict.fromkeys(params._unit_of.values()) if u not in params.gathered]
    if missing and func_level() != params._level:
        raise FzeroError(
            f"a torch.func transform inside the loss received the params mapping (LazyParams) with units "
            f"{missing[:4]} not gathered yet: it would gather them inside its own level, and the step would keep "
            f"them after it returns. Pass dict(params) instead (reading it gathers every unit first), or read the "
            f"units before the transform (docs/func.md)")
    leaves, keys, _ = _flatten_lazy(params)
    return leaves, list(keys)


for _namespace in (_GLOBAL, NAMESPACE):
    optree.register_pytree_node(LazyParams, _flatten_lazy, lambda keys, leaves: dict(zip(keys, leaves)),
                                path_entry_type=optree.MappingEntry, namespace=_namespace)
torch_pytree.register_pytree_node(
    LazyParams, _flatten_lazy_for_torch,
    lambda leaves, keys: dict(zip(keys, leaves)), serialized_type_name="fzero.LazyParams")


# what a placeholder answers itself anywhere: its metadata is the leaf's (not its strides: an expanded zero's)
_METADATA = frozenset(f"torch.Tensor.{name}" for name in (
    "shape.__get__", "dtype.__get__", "device.__get__", "ndim.__get__", "layout.__get__", "requires_grad.__get__",
    "is_cuda.__get__", "is_meta.__get__", "size", "dim", "numel", "nelement", "__len__", "element_size",
    "is_floating_point", "is_complex", "__repr__", "__format__"))


class Placeholder(torch.Tensor):
    """A placeholder leaf (`FirstUse`): inside the loss call, the mode swaps it for the gathered
    leaf before any torch function sees it. Elsewhere its metadata (shape, dtype, device, ...)
    answers as the leaf's, and anything that would read its values raises, where it would read
    the placeholder's zeros (found in review, each silent before): a torch function outside the
    loss call (a custom Function's backward reading what its forward saved, a
    `torch.utils.checkpoint` recompute in backward, code that kept it past the step), and below
    torch functions, an op the dispatcher reaches with it (a torch.func transform given it as an
    input: `vmap(f)(w)` wraps it past the mode)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = torch.overrides.resolve_name(func) or getattr(func, "__name__", repr(func))
        if name in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                if name in ("torch.Tensor.__repr__", "torch.Tensor.__format__"):  # tracebacks, debuggers
                    return f"<fzero on-use placeholder of shape {tuple(args[0].shape)}>"
                return func(*args, **(kwargs or {}))
        if torch.compiler.is_compiling():  # dynamo traces it: a plain tensor, for `FirstUse` to refuse at run time
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise _unswapped(name, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise _unswapped(str(func), args, kwargs)


def _check_not_parameter(e: RuntimeError) -> None:
    """Raise `ConfigError` from torch's error for `nn.Parameter(w)` of a placeholder leaf:
    `Parameter.__new__` makes a tensor subclass's Parameter by `w.detach()`, which `FirstUse`
    answers with the gathered leaf, not a `Placeholder`, and torch then refuses the type. Read
    on the error path only: nothing is added to a torch function's dispatch."""
    if f"Parameter from an instance of type {Placeholder.__name__}" in said(e):
        raise ConfigError(
            "nn.Parameter(w) of a params leaf that is an on-use placeholder (gather='on_use' with params that are "
            "not a flat dict: fzero hands the function placeholders it swaps for the gathered leaf at their first use, "
            "and nn.Parameter's construction does not go through that swap). A Parameter made inside the function "
            "is a new leaf, detached from the param: no gradient would reach the param through it, in any stage or "
            "gather mode. Use the tensor itself (w); where an API insists on a Parameter, pass "
            "nn.Parameter(w.detach()) knowing it is cut off, or use gather='eager' or flat-dict params") from e


def _placeholders_named(args: Any, kwargs: Any) -> str:
    """The params paths and shapes of the placeholders among an op's arguments, for `_unswapped`
    (before, its message named the op only: which leaf, in a pytree of many, was left to guess)."""
    flat, _ = tree_flatten((args, kwargs or {}))
    words = [f"{getattr(a, 'fzero_path', '?')!r} {list(a.shape)}" for a in flat if isinstance(a, Placeholder)]
    return f"; the leaf{'s' if len(words) > 1 else ''} {', '.join(dict.fromkeys(words))}" if words else ""


def _unswapped(name: str, args: Any = (), kwargs: Any = None) -> ConfigError:
    return ConfigError(
        f"gather='on_use' with params that are not a flat dict: {name} received a placeholder leaf where fzero's "
        f"swap for the gathered leaf does not reach (it holds zeros{_placeholders_named(args, kwargs)}): outside "
        f"the loss call -- a custom autograd.Function's backward reading a placeholder its forward saved, a "
        f"torch.utils.checkpoint recompute reading one from a closure, a placeholder kept past the loss -- or a "
        f"torch.func transform given it as an input (vmap(f)(w)), or a custom Function's forward under vmap. Pass such code the leaf's view made by "
        f"torch (w.view_as(w); for a whole params pytree, optree.tree_map(lambda w: w.view_as(w), params)), "
        f"use gather='eager', or flat-dict params")


class FirstUse(TorchFunctionMode):
    """For params that are not a flat dict: the loss gets shape-correct placeholder leaves (a 0-d
    zero expanded to the leaf's shape: no memory), and the first torch function or tensor method
    that receives a placeholder gets the real leaf instead -- so the unit is gathered, and its
    Function created, at its first use. Reading a placeholder's attributes through torch
    (`.shape` included) counts as a use; a torch function that receives one where the mode is
    not active raises (`Placeholder`); data read any other way (e.g. `.data_ptr()`) would see
    the placeholder's zeros. A custom `torch.autograd.Function` is such a way: its `apply` does
    not go through torch's function dispatch, so a placeholder passed to it is the node's input,
    and the leaf would get no gradient from it. So where the step differentiates (grad mode, the
    autograd engine, no torch.func level), each placeholder is a view of a 0-d leaf of its own
    that requires grad (`Gathering.roots`): a Function applied to one in grad mode makes an edge
    to that root, and the step, which differentiates the roots too, raises where any gets a
    gradient (`step.refuse_placeholder_gradients`)."""

    def __init__(self, placeholders: dict[int, str], read: Callable[[str], torch.Tensor]) -> None:
        super().__init__()
        self._paths, self._read = placeholders, read

    def swapped(self, tree: Any) -> Any:
        """`tree` (a call's arguments, or what the loss returned) with each placeholder in it the
        leaf it stands for; the same object where it holds none."""
        flat, spec = tree_flatten(tree)
        if not any(isinstance(a, torch.Tensor) and id(a) in self._paths for a in flat):
            return tree
        _not_from_compiled(self._paths, flat)
        return tree_unflatten([self._read(self._paths[id(a)]) if isinstance(a, torch.Tensor) and id(a) in self._paths
                               else a for a in flat], spec)

    def returned(self, out: Any) -> Any:
        """What the loss returned, each placeholder in it the leaf it stands for: in torch's pytree
        nodes and in dataclasses' fields (`replaced_tensors`; an object of another class holding
        one raises `ConfigError` naming its type)."""
        return replaced_tensors(out, lambda t: id(t) in self._paths, lambda t: self._read(self._paths[id(t)]),
                                lambda t: f"the on-use placeholder of params leaf {self._paths[id(t)]!r} "
                                          f"(gather='on_use', params not a flat dict)")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        given = (args, kwargs or {})
        args, kwargs = swapped = self.swapped(given)
        out = func(*args, **kwargs)
        if out is NotImplemented and swapped is not given:
            # an operator whose other operand torch refuses (`"x" @ w`, a batch unpacked wrong): the
            # leaf said NotImplemented, and torch, which would then ask the placeholder, must not --
            # its error would blame the swap. A TypeError here is torch's NotImplemented to Python,
            # whose error is the plain one ("unsupported operand type(s) for @: 'str' and 'Tensor'")
            raise TypeError(f"{torch.overrides.resolve_name(func) or func} does not take these operands")
        return out


def _compiled_reads_words(what: str) -> str:
    return (f"gather='on_use' with params that are not a flat dict: compiled code (torch.compile) {what}, which "
            f"fzero swaps for the gathered leaf at its first use, outside dynamo; use gather='eager' with a compiled "
            f"loss, or flat-dict params read outside the compiled code (docs/compile.md)")


def refuse_compiled_placeholders(fn_compiled: bool, layout: Layout, mode: str) -> None:
    """`_not_from_compiled`'s `ConfigError` before the function runs, where it is itself compiled
    (`fn_compiled`, `eager.compiled`: the one compiled function fzero can see): raised inside the
    compiled code, the error made dynamo skip that function's code for the rest of the process,
    so a fresh `torch.compile` of it with gather='eager', as the words say, ran eager with no word
    (found in review of torch.compile)."""
    if mode == "on_use" and fn_compiled and not is_flat_dict(layout):
        paths = named_paths([ls.path for ls in layout.leaves])
        raise ConfigError(_compiled_reads_words(f"would be handed placeholders of the params leaves ({paths})"))


@eager
def _not_from_compiled(paths: dict[int, str], flat: list[Any]) -> None:
    """Raise `ConfigError` where compiled code (torch.compile) hands `FirstUse` a placeholder.
    Dynamo cannot trace the swap (on torch 2.13 it stopped inside it with
    InternalTorchDynamoError, NameError: '___tuple_iterator_getitem'); traced, this call is a
    graph break, and run by the compiled code it raises (`from_compiled`). A plain eager call
    returns at once. Dynamo then skips the code of the compiled function that raised for the
    rest of the process: the words say so (a compiled loss is refused before, in
    `refuse_compiled_placeholders`)."""
    if from_compiled():
        named = [paths[id(a)] for a in flat if isinstance(a, torch.Tensor) and id(a) in paths]
        raise ConfigError(_compiled_reads_words(f"reads the placeholder of {named}") + "; dynamo does not compile "
                          "the function that raised this again in this process (it skips its code): make the change "
                          "in a new process, or call torch._dynamo.reset() first")
