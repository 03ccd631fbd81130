"""The agreement: the step's one collective of what every rank saw, read as the `Verdict`.

Each rank puts in one float64 row (`Row`) its loss, what its backward saw (`Report`: the leaves
that got a gradient and, with `locate_nonfinite`, its non-finite local gradients), its part of
`‖g‖²` (`norms.sum_of_squares`) and what identifies its step (settings, step counter, `init`, lr,
loss scale); `agreement` all-gathers the rows on the device and `agree` reads them on the host
once -- the step's one host synchronisation -- as the `Verdict` every rank decides alike on:
which leaves were used, whether the step is finite, and, where ranks stepped different states or
settings, `ConfigError` on every rank. `agree_launching` launches a donating update before that
read where the verdict can only say whether it runs (`update.Early`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .collectives import all_gather
from .config import StepConfig
from .errors import ConfigError
from .mesh import settings_crc
from .norms import EarlyNorms, exact_sum_of_squares, in_order, sum_of_squares
from .offload import early_norms, readable
from .plan import step_plan
from .state import ZeroState, check_same_settings, keep, loss_scale_of, named
from .update import Early, Ends, Ready, _first_write, _settle_lost, _updating


class Report(NamedTuple):
    """What the units' backward saw on this rank: `used[L]` (CPU float32, 1 where the leaf got a
    gradient) and `bad[B]` (float32 on the mesh device, 1 where a bucket's local gradient held a
    NaN or inf; zeros where the units did not check, `locate_nonfinite` off or N = 1)."""

    used: torch.Tensor
    bad: torch.Tensor


class Verdict(NamedTuple):
    """What every rank agreed on: used leaves, ranks with non-finite values, the loss (summed over
    ranks in rank order), ‖g‖², the total token count (`normalize="tokens"`), the ranks whose
    previous, donating update left a NaN or inf in the state (`ZeroState.pending`), and whether
    `bad_ranks` names the ranks of non-finite local gradients (`located`: at N = 1, or with
    `locate_nonfinite`), or only those of non-finite losses."""

    used: list[bool]
    bad_ranks: dict[int, list[str]]
    loss: float
    norm_sq: float
    count: float
    broken_ranks: tuple[int, ...] = ()
    located: bool = True
    bad_losses: tuple[int, ...] = ()  # the ranks of `bad_ranks` whose loss is non-finite (their gradient may be too)

    @property
    def finite(self) -> bool:
        return not self.bad_ranks and math.isfinite(self.norm_sq)


class Row(NamedTuple):
    """The columns of `agreement`'s row, `[loss, used[L], bad[B], ‖g_shard‖², count, broken,
    settings, step, serial, lr, scale, scaled]`, for L leaves and B buckets: loss at 0, used at
    `1 : 1 + L`, bad at `1 + L : sq`, then one column each."""

    sq: int
    tokens: int
    broken: int
    settings: int
    step: int
    serial: int
    lr: int
    scale: int
    scaled: int
    width: int

    @staticmethod
    def of(num: int, nb: int) -> "Row":
        sq = 1 + num + nb
        return Row(*range(sq, sq + 10))


def agreement(state: ZeroState, loss: torch.Tensor, report: Report, reduced: dict[int, torch.Tensor],
              count: torch.Tensor, norms: EarlyNorms | None, settings: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The one agreement collective: `(rows[N, L + B + 10], the rank's gradient shards)`, the rows
    of `[loss, used[L], bad[B], ‖g_shard‖², count, broken, settings, step, serial, lr, scale,
    scaled]` (float64, `Row`) from every rank, gathered on the device and not read yet: `agree`
    reads them on the host (the step's one host synchronisation), and what the host can do before
    that read runs before it (`prepare`). `settings` is the fingerprint of the step's settings
    (`StepConfig.fingerprint`), `step` the state's step counter, `serial` which `init` made it
    (`StateInfo.serial`), `lr` the optimizer's lr at this step (`scheduled_lr`, exact in
    float64), `scale` the loss scale the step used and `scaled` its scaler's update count
    (`LossScaleState.iteration`, -1 without a scaler: a skipped step leaves `step` as it was, so a
    rank that kept the state from before a skip shows only there): ranks whose steps differ in any
    raise `ConfigError` on every rank, before anything is updated (`_check_same_steps`).

    `‖g_shard‖²` is `sum_of_squares` of the rank's shards of the *reduced* gradient (stage 0
    takes its rank's shard of the full buffer, so every stage computes it from the same tensor
    values); ranks' parts and losses are then summed in rank order on the host (`in_order`:
    Python floats, float64 adds). `broken` is the state's `pending` flag
    (0 without one): whether the donating update that made the state left a NaN or inf on this
    rank. Where some rank's part is not finite -- a NaN or inf, or a float32 norm that overflowed
    -- every rank (all see the same rows) recomputes its part exactly in float64
    (`exact_sum_of_squares`) and the parts are gathered again: the rare path decides finiteness
    exactly. The units check their local gradients only with `locate_nonfinite` at N > 1 (else
    `bad` is 0): a NaN or inf in any rank's local gradient makes the reduced gradient's `‖g‖²`
    NaN or inf all the same (proofs/stages.md §1, step 3), and at N = 1 the rare path then names
    the buckets from the reduced gradient, which is the local one. `norms`
    (`EarlyNorms`): the shard norms already taken in the backward, the same bits.
    """
    layout, stage, mesh, rank = state.layout, state.stage, state.mesh, state.rank
    n, dev = mesh.world_size, mesh.device
    num, nb = len(layout.leaves), len(layout.buckets)
    shards = [stage.grad_shard(layout, b, g, rank) for b, g in reduced.items()]
    known = early_norms(state.info, shards) | ({} if norms is None else norms.known(shards))
    sq = sum_of_squares(shards, dev, known)
    scaled = -1 if state.loss_scale is None else int(state.loss_scale.iteration)
    settings = settings_crc((settings, state.info.optimizer_crc, state.info.groups_crc))  # the step's settings,
    # the state's optimizer and its parameter groups
    checks = torch.tensor([settings, int(state.step), state.info.serial, scheduled_lr(state), loss_scale_of(state),
                           scaled], dtype=torch.float64)
    # one copy to the device
    host = torch.cat([report.used.to(torch.float64), count.to(torch.float64).reshape(1), checks])
    host = (host.pin_memory() if dev.type == "cuda" else host).to(dev, non_blocking=True)
    broken = (state.pending.to(device=dev, dtype=torch.float64).reshape(1) if state.pending is not None
              else sq.new_zeros(1))
    row = torch.cat([loss.to(device=dev, dtype=torch.float64).reshape(1), host[:num],
                     report.bad.to(dev, torch.float64), sq.reshape(1), host[num : num + 1], broken, host[num + 1 :]])
    return all_gather(row, mesh, tag="fzero.step/agree").view(n, Row.of(num, nb).width), shards


def scheduled_lr(state: ZeroState) -> float:
    """The optimizer's lr at the state's step (`Optimizer.lr`), before any group's `lr_scale`
    (which `init` compares); 0.0 for an optimizer that does not say (`lr=None`); -1.0 where the
    schedule raises at this step (its values are >= 0, `as_schedule`): the update raises it again
    after the verdict, unless the step is skipped (a skipped step reads no lr, as torch's).
    `as_schedule`'s schedules compute each step's value once (the update reads the same)."""
    schedule, step = state.optimizer.lr, int(state.step)
    if schedule is None:
        return 0.0
    try:
        value = schedule(step)
    except Exception:  # noqa: BLE001 -- raised again by the update, where there is one
        return -1.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ConfigError(f"step {step}: Optimizer.lr returned {type(value).__name__} {value!r}; a schedule returns "
                          f"a finite float >= 0 (fzero.optim.as_schedule checks one)")
    return float(value)


def agree(config: StepConfig, state: ZeroState, rows: torch.Tensor, shards: list[torch.Tensor],
          reduced: dict[int, torch.Tensor]) -> Verdict:
    """`agreement`'s rows read on the host once (`tolist`: the step's one synchronisation), as the
    `Verdict` every rank agrees on (`_verdict`)."""
    return _verdict(config, state, rows.tolist(), shards, reduced)


def agree_launching(config: StepConfig, state: ZeroState, rows: torch.Tensor, shards: list[torch.Tensor],
                    reduced: dict[int, torch.Tensor], report: Report, ready: Ready | None
                    ) -> tuple[Verdict, Ready | None, Early | None]:
    """`agree`, with the update launched before the read where nothing the verdict decides but
    whether it runs changes its kernels (`early_skip`): `(verdict, ready, launched)`.

    The rows' copy to the host is queued first (`HostRead`), then every prepared bucket's kernels
    with the device flag that skips them (`Launch.skips`), then the host reads: the device goes
    from the agreement to the update without waiting for the host, as DDP's optimizer follows its
    backward; each bucket's finite check follows its kernels (`Ends`), as in `update`.
    `launched` (`Early`): where the flag was 0 (the kernels ran; the verdict is then finite and
    every leaf used); None otherwise. Where the flag was 1 the kernels wrote nothing and the
    prepared launches are spent (`ready` None): a verdict that is finite all the same (a float32
    ‖g‖² that overflowed but whose exact value is finite, `_verdict`) updates through `update_`.
    Ranks may differ in whether they launch early (a check that fails on one rank only): the
    launches are local, and every rank makes the same collectives after the read. The state is
    marked lost before the first launch (`update._first_write`) and the mark taken back where the
    flag skipped the kernels (read on the error path: the verdict's `ConfigError` comes with it
    set), or where nothing was written (`update._settle_lost`)."""
    skip = early_skip(config, state, rows, reduced, report, ready)
    grads = None if skip is None else _checked(ready, reduced)
    if grads is None:
        return agree(config, state, rows, shards, reduced), ready, None
    read = HostRead(rows, skip)
    ends, states = Ends.of(state, True), {}
    wrote, watch = [], None  # the state is marked lost before the first launch (`_first_write`), as in `update`
    try:
        for b, g in grads.items():
            if not wrote:
                watch = _first_write(state, b, ready.params[b], state.opt_state[b])
            with _updating(ends):
                states[b] = ready.launches[b].run(g, skip)
            wrote.append(b)
            if ends is not None:
                ends.take(b, ready.params[b])
        got, skipped = read.values()
        verdict = _verdict(config, state, got, shards, reduced)
    except BaseException as e:  # (the verdict's `ConfigError` comes with the flag set: nothing was written)
        if _skipped(skip):
            keep(state)
        else:
            _settle_lost(state, e, wrote, watch)
        raise
    if skipped:  # the kernels wrote nothing
        keep(state)
        return verdict, None, None
    assert verdict.finite and all(verdict.used) and not verdict.broken_ranks, "the device flag and the verdict disagree"
    return verdict, ready, Early(states, ends)


def _skipped(skip: torch.Tensor) -> bool:
    """On `agree_launching`'s error path: whether the early launch's flag skipped its kernels (they
    then wrote nothing), read on the host; False where it cannot be read."""
    try:
        return bool(skip.item() != 0)
    except Exception:  # noqa: BLE001 -- unknown: the state counts as written
        return False


def _checked(ready: Ready, reduced: dict[int, torch.Tensor]) -> dict[int, torch.Tensor] | None:
    """Each bucket's gradient in its param's dtype, checked by its launch (`Launch.check`), or None
    where some check fails: nothing is launched early then, and the error is raised after the
    verdict, where a step that is skipped raises none (as without the early launch)."""
    grads = {b: g.to(ready.params[b].dtype) for b, g in reduced.items()}
    try:
        for b, g in grads.items():
            ready.launches[b].check(g)
    except Exception:  # noqa: BLE001 -- `update` launches it again after the verdict, and it raises there
        return None
    return grads


def early_skip(config: StepConfig, state: ZeroState, rows: torch.Tensor, reduced: dict[int, torch.Tensor],
               report: Report, ready: Ready | None) -> torch.Tensor | None:
    """The flag an update launched before the agreement's read gives its kernels (float32 0-d on
    the mesh device: 1 where some rank's row has a non-finite loss or ‖g‖², a non-finite local
    gradient, or a broken previous update -- every way a verdict is not finite), or None where
    the update may not be launched then: it must be a donating step's (`ready`, nothing
    differentiates through it) whose every bucket is prepared with kernels that skip on the flag
    (`Launch.skips`: torch's fused kernels), and the verdict must decide nothing else about it --
    no clipping and no loss scaler (no factor from the norm), "mean" normalizing (none from the
    count), every leaf used on this rank (so in every rank's OR too, `_used`)."""
    if (ready is None or not ready.overlap or config.clip_norm is not None or state.info.scaler is not None
            or config.normalize != "mean"):
        return None
    if not all(b in ready.launches and ready.launches[b].skips for b in reduced) or not reduced:
        return None
    if not bool((report.used > 0).all()):  # a host tensor: no synchronisation
        return None
    return skip_flag(rows, len(state.layout.leaves), len(state.layout.buckets))


def skip_flag(rows: torch.Tensor, num: int, nb: int) -> torch.Tensor:
    """float32 0-d, on the rows' device: 1 where some row of `agreement`'s (`Row`) has a
    non-finite loss or ‖g‖², a bad bucket (> 0) or a broken flag (≠ 0), or where the rows' step
    settings or step counters differ, else 0. Where it is 0, `_verdict` of the same rows is
    finite, names no broken rank and raises no `ConfigError`."""
    c = Row.of(num, nb)
    loss, bad, sq, broken = rows[:, 0], rows[:, 1 + num : c.sq], rows[:, c.sq], rows[:, c.broken]
    checks = rows[:, c.settings : c.width]
    clean = (torch.isfinite(loss).all() & torch.isfinite(sq).all() & (bad <= 0).all() & (broken == 0).all()
             & (checks == checks[:1]).all())
    return clean.logical_not().to(torch.float32)


class HostRead:
    """Tensors' values for the host, their copy queued now and read later (`values`): on CUDA into
    pinned memory behind an event, so that work queued after it on the stream does not delay the
    read; elsewhere `tolist` when read."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.tensors, self.done = tensors, None
        if tensors and tensors[0].device.type == "cuda":
            self.tensors = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                                 for t in tensors)
            self.done = torch.cuda.Event()
            self.done.record()

    def values(self) -> list:
        if self.done is not None:
            self.done.synchronize()
        return [t.tolist() for t in self.tensors]


def _verdict(config: StepConfig, state: ZeroState, rows: list[list[float]], shards: list[torch.Tensor],
             reduced: dict[int, torch.Tensor]) -> Verdict:
    """The agreed rows (one per rank, `agree`'s layout) -> `Verdict`: Python over ranks and
    columns, no tensor op but on the rare paths."""
    layout, mesh = state.layout, state.mesh
    n, num, nb = mesh.world_size, len(layout.leaves), len(layout.buckets)
    c = Row.of(num, nb)
    _check_same_steps(config, state, rows, c)
    losses, sqs, counts = [r[0] for r in rows], [r[c.sq] for r in rows], [r[c.tokens] for r in rows]
    bad_rows = [r[1 + num : c.sq] for r in rows]
    if not all(math.isfinite(q) for q in sqs):  # the rare path: decide exactly (shed shards: their host copies)
        shards = list(readable(state.info, dict(enumerate(shards))).values())
        exact = exact_sum_of_squares(shards, mesh.device).reshape(1)
        sqs = all_gather(exact, mesh, tag="fzero.step/agree_exact").tolist()
    bad_ranks = {r: [layout.buckets[b].tag for b, x in enumerate(bad_rows[r]) if x > 0]
                 for r in range(n) if not math.isfinite(losses[r]) or max(bad_rows[r], default=0.0) > 0}
    if n == 1 and not math.isfinite(sqs[0]):  # the rare path without a local check: the reduced is the local
        bad_ranks[0] = _nonfinite_buckets(state, readable(state.info, reduced))
    used = _used(rows, num)
    broken = tuple(r for r in range(n) if rows[r][c.broken] != 0)
    located = n == 1 or config.locate_nonfinite
    bad_losses = tuple(r for r in range(n) if not math.isfinite(losses[r]))
    return Verdict(used, bad_ranks, in_order(losses), in_order(sqs), in_order(counts), broken, located, bad_losses)


def _check_same_steps(config: StepConfig, state: ZeroState, rows: list[list[float]], c: Row) -> None:
    """Raise `ConfigError` on every rank (all read the same rows) where the ranks' steps differ in
    their settings (`StepConfig.shared`; one more all-gather, of each setting's fingerprint, names
    the first that differs: `state.check_same_settings`), in the `init` that made their states
    (`StateInfo.serial`), in their state's step counter or its loss scaler's update count (a rank
    that stepped an older state: a skipped step moves only the latter), in the loss scale (each
    rank would divide the one reduced gradient by its own) or in their optimizer's lr at this step
    (schedules `init` could not tell apart: a `functools.partial`'s arguments, a callable object's
    attributes)."""
    if any(r[c.settings] != rows[0][c.settings] for r in rows):
        check_same_settings(state.mesh, "fzero.train_step", **config.shared)
        check_same_settings(state.mesh, "fzero.train_step's state (state.info.optimizer, which a "
                            "state.replace(info=...) changes on every rank or none)", optimizer=named(state.optimizer))
        check_same_settings(state.mesh, "fzero.train_step's state (its parameter groups, state.info.layout, which a "
                            "state.replace(info=...) changes on every rank or none)",
                            groups=state.info.groups_described)
        raise ConfigError(f"train_step settings differ across ranks (world size {state.mesh.world_size}), though "
                          f"each setting alone agrees: rank {state.mesh.rank}'s are {config.shared}")
    for col, what, fix in ((c.serial, "the state of its init #{}", "the state the same fzero.init made (and its "
                            "steps returned)"),
                           (c.step, "step {}", "the state its previous step returned (a rank kept an older state, "
                            "or restored another checkpoint)"),
                           (c.scaled, "loss scaler update {}", "the state its previous step returned, skipped steps "
                            "included (a rank kept the state from before a skipped step, or restored another "
                            "checkpoint)")):
        values = [int(r[col]) for r in rows]
        if any(v != values[0] for v in values):
            said = ", ".join(f"rank {r}: " + what.format(v) for r, v in enumerate(values))
            raise ConfigError(f"ranks stepped different states ({said}; world size {len(values)}): every rank must "
                              f"step {fix}. Nothing was updated")
    scales = [r[c.scale] for r in rows]
    if any(v != scales[0] for v in scales):
        said = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(scales))
        raise ConfigError(f"step {int(state.step)}: the loss scale differs across ranks ({said}; world size "
                          f"{len(scales)}): every rank must step the state its previous step returned, or load one "
                          f"checkpoint. Nothing was updated")
    lrs = [r[c.lr] for r in rows]
    if any(v != lrs[0] for v in lrs):
        said = ", ".join(f"rank {r}: " + ("its schedule raised, or returned a value refused (negative, NaN, inf, "
                                             "not a number)" if v < 0 else repr(v)) for r, v in enumerate(lrs))
        raise ConfigError(f"step {int(state.step)}: the optimizer's lr differs across ranks ({said}; world size "
                          f"{len(lrs)}): every rank must pass the same lr schedule (fzero.init compares the values "
                          f"a schedule's closure holds, not a functools.partial's arguments or a callable object's "
                          f"attributes). Nothing was updated")


def _check_some_leaf_used(state: ZeroState, verdict: Verdict) -> None:
    """Raise `ConfigError` on every rank (the verdict is agreed) where no rank's loss reached any
    trainable leaf that has elements: the loss has no autograd graph to the params (made under
    `torch.no_grad()`, detached, or from other tensors), so the step would train nothing and
    report a zero gradient norm. (torch's `loss.backward()` raises for such a loss where it needs
    no grad at all; one that needs grad through some other tensor it accepts, and its optimizer
    step does nothing: fzero raises for both.)"""
    layout, trainable = state.layout, step_plan(state.info).trained_leaves
    if trainable and not any(verdict.used[i] for i in trainable):  # stops at the first used one
        raise ConfigError(f"step {int(state.step)}: no rank's loss depends on any trainable param ({len(trainable)} "
                          f"leaves, e.g. {layout.leaves[trainable[0]].path!r}; world size {state.mesh.world_size}): "
                          f"loss_fn returned a loss with no autograd graph to the params (computed under "
                          f"torch.no_grad(), detached, or from copies of them), so the step would train nothing. "
                          f"Nothing was updated")


def _used(rows: list[list[float]], num: int) -> list[bool]:
    """Per leaf, whether some rank's row says it got a gradient (`used[L]`, columns 1 to L): where
    every rank used every leaf (the common case) one pass of C-level `min`s says so, without a
    Python step per leaf."""
    if not num:
        return []
    cols = [r[1 : 1 + num] for r in rows]
    if min(map(min, cols)) > 0:
        return [True] * num
    return [m > 0 for m in map(max, zip(*cols))]


def _nonfinite_buckets(state: ZeroState, reduced: dict[int, torch.Tensor]) -> list[str]:
    """At N = 1: the tags of the buckets whose reduced gradient -- there the local gradient, summed
    over micro-batches -- holds a NaN or inf (one check per bucket, only on a non-finite step)."""
    return [state.layout.buckets[b].tag for b, g in reduced.items() if not bool(torch.isfinite(g).all())]
