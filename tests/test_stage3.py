"""Stage 3 at its promise: forward-only evaluation, rank divergence named, persistent units.

- `evaluate(fn)(state, batch)` returns `fn(fzero.gather(state), batch)` bit for bit in every
  stage and world size, builds no autograd graph, and in stage 3 with `from_module` holds one
  gathered block at a time (a `LiveStorages` census);
- a rank whose forward skips or reorders a unit stops every rank with `DivergentPaths` naming
  the units each rank gathered, in the step and in `evaluate`;
- `train_step(persist_bytes=...)` keeps small units gathered for the step: the same bits as
  stage 0, no backward re-gather of those units (proofs/stage3.md).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import fzero
from fzero import optim
from fzero import evaluate
from fzero import DivergentPaths
from fzero.accounting import LiveStorages

from .stage_harness import PeakAtBackward, classifier_steps


class _Blocks(torch.nn.Module):
    """K tanh(Linear(d, d)) blocks, then a head Linear(d, 3); `order` picks which blocks run."""

    def __init__(self, k: int = 4, d: int = 8) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(k))
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x, order=None):  # (B, d) -> (B, 3)
        for i in order if order is not None else range(len(self.blocks)):
            x = torch.tanh(self.blocks[i](x))
        return self.head(x)


def _module(k: int = 4, d: int = 8):
    torch.manual_seed(0)
    model = _Blocks(k, d)
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, "blocks"))
    return params, apply, info


def _batch(r: int, d: int = 8):
    g = torch.Generator().manual_seed(10 + r)
    return torch.randn(2, d, generator=g), torch.randint(0, 3, (2,), generator=g)


# -- 1. evaluate ---------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_evaluate_returns_fn_of_the_gathered_params_bit_for_bit(stage, n):
    """After one training step (so the state is not its init), `evaluate` returns what `fn`
    returns on `fzero.gather(state)`, in both gathering modes, for `from_module` params (a
    `LazyParams`, released per block in stage 3) and for a nested pytree (placeholders): the
    same values enter the same ops, so `torch.equal`. Nothing is differentiable afterwards."""
    params, apply, info = _module()
    nested = {"w": torch.randn(5, 3, generator=torch.Generator().manual_seed(3)), "b": {"c": torch.ones(3)}}
    mesh, opt = fzero.SimMesh(n), optim.adamw(1e-2, weight_decay=0.1)

    def logits(p, batch):
        return apply(p, batch[0])

    def nested_fn(p, x):
        return torch.tanh(x @ p["w"] + p["b"]["c"]), (x @ p["w"]).sum()

    def rank_fn(r):
        batch = _batch(r)
        state = fzero.init(params, opt, stage=stage, mesh=mesh, units=info.units, groups=info.groups)
        state, _ = fzero.train_step(lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0]), b[1]))(state, batch)
        tree = fzero.init(nested, opt, stage=stage, mesh=mesh, units=lambda path: path.split(".")[0])
        x = batch[0][:, :5]
        outs = [evaluate(logits, gather=g)(state, batch) for g in ("on_use", "eager")]
        outs += [o for g in ("on_use", "eager") for o in evaluate(nested_fn, gather=g)(tree, x)]
        refs = [logits(fzero.gather(state), batch)] * 2 + [*nested_fn(fzero.gather(tree), x)] * 2
        grads = [t.grad for s in (state, tree) for t in s.params]
        return outs, refs, grads

    for outs, refs, grads in mesh.run(rank_fn, [(r,) for r in range(n)]):
        for out, ref in zip(outs, refs):
            assert torch.equal(out, ref)
            assert not out.requires_grad and out.grad_fn is None
        assert all(g is None for g in grads)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_evaluate_under_a_precision_policy_reads_the_params_in_the_compute_dtype(stage):
    """bf16 compute: `fn` reads each leaf as `fzero.gather(state)`'s fp32 master value rounded to
    bf16 once (stages 1-2 hold that copy, stage 3 casts its shard before the gather: the same
    rounding of the same values), so the output equals `fn` on the cast gathered params."""
    params, apply, info = _module()
    mesh, n = fzero.SimMesh(2), 2
    policy = fzero.Precision(torch.bfloat16, torch.float32)

    def rank_fn(r):
        batch = _batch(r)
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units, precision=policy)
        state, _ = fzero.train_step(lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0].bfloat16()).float(),
                                                                                   b[1]))(state, batch)
        out = evaluate(lambda p, x: apply(p, x))(state, batch[0].bfloat16())
        cast = {k: v.bfloat16() for k, v in fzero.gather(state).items()}
        return out, apply(cast, batch[0].bfloat16())

    for out, ref in mesh.run(rank_fn, [(r,) for r in range(n)]):
        assert out.dtype == torch.bfloat16 and torch.equal(out, ref)


def test_evaluate_holds_one_gathered_block_at_a_time_in_stage_3():
    """Stage 3, `from_module`, on use: each block is freed after its forward, so the census of
    block-sized storages (a block's gathered `flat[N * S]`: (d² + d) · 4 bytes; the root unit,
    the head, has another size) peaks at N + 1 over both ranks: each rank's current block, plus
    SimMesh's concatenation of the ranks' shards while it completes an all-gather (the previous
    block is released before the next is gathered). Eager gathering holds all N · K blocks."""
    k, d, n = 6, 8, 2
    params, apply, info = _module(k, d)
    block = (d * d + d) * 4

    def peak(gather):
        mesh = fzero.SimMesh(n)
        census = LiveStorages(count=lambda t: t.untyped_storage().nbytes() == block)

        def rank_fn(r):
            state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
            with census:
                return evaluate(lambda p, x: apply(p, x), gather=gather)(state, _batch(r)[0])

        outs = mesh.run(rank_fn, [(r,) for r in range(n)])
        return census.peak, outs

    (eager, out_e), (on_use, out_u) = peak("eager"), peak("on_use")
    assert all(torch.equal(a, b) for a, b in zip(out_e, out_u))
    assert eager >= n * k * block  # non-vacuous: the census sees every gathered block
    assert on_use <= (n + 1) * block, (on_use, block)


def test_evaluate_rejects_bad_settings():
    with pytest.raises(fzero.ConfigError, match="gather must be one of"):
        evaluate(lambda p, b: 0, gather="lazy")
    with pytest.raises(fzero.ConfigError, match="callable"):
        evaluate(3)


# -- 2. ranks that take different paths ------------------------------------------------------------


def _diverge(n: int, run, orders, stage: int = 3):
    """Run `run(state, batch, order)` on every rank with its order; return each rank's error."""
    params, apply, info = _module()
    mesh, errors = fzero.SimMesh(n), {}

    def rank_fn(r):
        state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units)
        try:
            run(apply, state, _batch(r), orders[r])
        except fzero.MeshError as e:
            errors[r] = e
            raise

    with pytest.raises(fzero.CollectiveMismatch):
        mesh.run(rank_fn, [(r,) for r in range(n)])
    return errors


def _train(apply, state, batch, order):
    loss = lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0], order), b[1])  # noqa: E731
    fzero.train_step(loss)(state, batch)


def _evaluate(apply, state, batch, order):
    evaluate(lambda p, x: apply(p, x, order))(state, batch[0])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("run", [_train, _evaluate], ids=["train_step", "evaluate"])
@pytest.mark.parametrize("case", ["skip", "reorder", "skip_last"])
def test_a_rank_that_takes_another_path_stops_every_rank_naming_the_units(n, run, case):
    """The last rank skips block 1, or runs blocks 2 and 1 swapped, or skips the last block
    (in `evaluate` it then reaches the paths agreement while the others gather): every rank
    raises `DivergentPaths` saying which unit each rank gathered there."""
    normal = [0, 1, 2, 3]
    odd = {"skip": [0, 2, 3], "reorder": [0, 2, 1, 3], "skip_last": [0, 1, 2]}[case]
    errors = _diverge(n, run, [normal] * (n - 1) + [odd])
    assert sorted(errors) == list(range(n))
    for r, e in errors.items():
        assert isinstance(e, DivergentPaths), (r, type(e), e)
        msg = str(e)
        assert "ranks took different paths through the model" in msg
        if case in ("skip", "reorder"):
            assert "rank 0 gathered unit 'blocks.1'" in msg
            assert f"rank {n - 1} gathered unit 'blocks.2'" in msg
        else:
            assert "rank 0 gathered unit 'blocks.3'" in msg


def test_stage_2_ranks_whose_backward_reduces_units_in_another_order_are_named():
    """Stage 2 gathers nothing, but reduces each unit in its backward, in the reverse of the
    forward's data flow: blocks run 0,1,2,3 on rank 0 and 0,2,1,3 on rank 1 reduce 3 then 2 on
    rank 0 and 3 then 1 on rank 1; both raise, naming those units."""
    errors = _diverge(2, _train, [[0, 1, 2, 3], [0, 2, 1, 3]], stage=2)
    assert sorted(errors) == [0, 1]
    for e in errors.values():
        assert isinstance(e, DivergentPaths)
        assert "rank 0 reduced unit 'blocks.2', rank 1 reduced unit 'blocks.1'" in str(e), str(e)


def test_stages_0_and_1_reduce_a_unit_one_rank_skipped_as_zeros():
    """Stages 0-1 reduce every bucket after the backward, on every rank: a rank that skips block
    1 contributes zeros for it (DDP's find_unused_parameters), so on use gives eager's bits."""
    params, apply, info = _module()
    orders = [[0, 1, 2, 3], [0, 2, 3]]
    for stage in (0, 1):
        finals = {}
        for gather in ("on_use", "eager"):
            mesh = fzero.SimMesh(2)

            def rank_fn(r):
                state = fzero.init(params, optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units)
                loss = lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0], orders[r]), b[1])  # noqa: E731
                state, _ = fzero.train_step(loss, gather=gather)(state, _batch(r))
                return fzero.gather(state)

            finals[gather] = mesh.run(rank_fn, [(0,), (1,)])
        assert not torch.equal(finals["on_use"][0]["blocks.1.weight"], params["blocks.1.weight"])
        for a, b in zip(finals["on_use"], finals["eager"]):
            assert all(torch.equal(a[k], b[k]) for k in a)


def _errors_on_both_ranks(body, stage: int = 3) -> dict[int, fzero.MeshError]:
    """`body(state, r)` on both ranks of a SimMesh(2), a `stage` state of units "a" and "b": the
    error each rank raised (`mesh.run` raises the mismatch)."""
    mesh, errors = fzero.SimMesh(2), {}

    def rank_fn(r):
        state = fzero.init({"a": torch.ones(4), "b": torch.ones(4)}, optim.sgd(0.1), stage=stage, mesh=mesh,
                           units=lambda path: path)
        try:
            body(state, r)
        except fzero.MeshError as e:
            errors[r] = e
            raise

    with pytest.raises(fzero.CollectiveMismatch):
        mesh.run(rank_fn, [(0,), (1,)])
    assert sorted(errors) == [0, 1], errors
    return errors


def _divergent_on_both_ranks(body, stage: int = 3) -> list[str]:
    """The words of each rank's `DivergentPaths` (`_errors_on_both_ranks`)."""
    errors = _errors_on_both_ranks(body, stage)
    assert all(isinstance(e, DivergentPaths) for e in errors.values()), errors
    return [str(e) for e in errors.values()]


def test_evaluate_a_rank_that_reads_one_unit_fewer_stops_every_rank():
    """Rank 1 never reads unit "b" (a nested pytree: placeholders, no release): it reaches the
    paths agreement at the end of `evaluate` while rank 0 gathers "b"; both raise, naming it."""
    said = _divergent_on_both_ranks(
        lambda state, r: evaluate(lambda p, r: p["a"].sum() + (p["b"].sum() if r == 0 else 0))(state, r))
    for words in said:
        assert "rank 0 gathered unit 'b', rank 1 had finished its forward" in words


def evaluate_in_another_order_unverified(mesh):
    """On a pool worker, over `DistMesh(verify=False)` (no fingerprint) at N = 4, where gloo's own
    all-gather moves a stage-3 gather (at N = 2 a point-to-point exchange tagged by the call:
    gathers of two units never pair there, they wait out the timeout): the last rank's function
    reads units "b" then "a", the others' "a" then "b", all of one shape. `("DivergentPaths",
    words)` from the paths agreement at the end of `evaluate`, or `("returned", sums)` where the
    mixed gathers went through."""
    m = fzero.DistMesh(verify=False, timeout=30.0)  # over the worker's group
    state = fzero.init({"a": torch.ones(4), "b": torch.full((4,), 2.0)}, optim.sgd(0.1), stage=3, mesh=m,
                       units=lambda path: path)
    order = ("b", "a") if m.rank == m.world_size - 1 else ("a", "b")
    try:
        out = evaluate(lambda p, x: [p[k].sum() for k in order], prefetch=0)(state, None)
    except DivergentPaths as e:
        return "DivergentPaths", str(e)
    return "returned", [float(v) for v in out]


@pytest.mark.dist
def test_evaluate_over_an_unverified_mesh_names_ranks_that_read_units_in_another_order(dist4):
    """Without the fingerprint nothing compares the gathers' tags: rank 3's gather of "b" pairs with
    the others' of "a" (one shape), and each rank reads a mix of the two units. Only the paths
    agreement `evaluate` ends with (`evaluate.check_paths`: every rank's order of gathered units,
    compared) sees it. Every other divergence test meets a mismatch at a gather first (SimMesh and
    a verified DistMesh compare tags), so that comparison went untested: with `check_paths`
    returning at once the suite passed, and here `evaluate` returns mixed sums (found by mutation)."""
    for kind, words in dist4.run(evaluate_in_another_order_unverified, timeout=60):
        assert kind == "DivergentPaths", (kind, words)
        assert ("ranks took different paths through the model: at the unit read #0, rank 0 gathered unit 'a', "
                "rank 1 gathered unit 'a', rank 2 gathered unit 'a', rank 3 gathered unit 'b' (world size 4; each "
                "rank's order: [['a', 'b'], ['a', 'b'], ['a', 'b'], ['b', 'a']])") in words, words


@pytest.mark.parametrize("gather", ["on_use", "eager"])
def test_evaluate_on_one_rank_beside_a_step_on_the_other_names_evaluate(gather):
    """Rank 0 evaluates where rank 1 steps (stage 3): evaluate's gathers are the step forward's
    calls, so before they paired, and the mismatch came later, worded as a step's ("rank 0 had
    finished its forward"; with gather="eager", evaluate returned on rank 0; found in review).
    Evaluate's collectives carry the label "evaluate" (`Mesh.phase`): both ranks raise
    `DivergentPaths` at the first gather, naming the rank in evaluate and the way out."""
    loss = lambda p, x: (p["a"] * x).sum() + p["b"].sum()  # noqa: E731

    def body(state, r):
        if r == 0:
            evaluate(loss, gather=gather)(state, torch.ones(4))
        fzero.train_step(loss)(state, torch.ones(4))

    for words in _divergent_on_both_ranks(body):
        assert "rank 0 gathered unit 'a' in fzero.evaluate, rank 1 gathered unit 'a'. Rank(s) [0] were in " \
               "fzero.evaluate and the others not" in words, words


_LOSS = lambda p, x: (p["a"] * x).sum() + p["b"].sum()  # noqa: E731


@pytest.mark.parametrize("stage", [0, 2])
def test_evaluate_on_one_rank_of_a_donated_state_names_evaluate(stage):
    """At stages 0-2 an evaluation runs no collective but one: on a state a donating step returned,
    the check of that step's verdict (an all-gather). Rank 0 evaluating alone (a logging branch)
    met rank 1's next step there unnamed: rank 0's error was the mesh's bare mismatch, rank 1's
    blamed the model's paths (found in review). Now both raise `DivergentPaths` naming the rank in
    fzero.evaluate and what it was doing."""
    def body(state, r):
        step = fzero.train_step(_LOSS, donate=True)
        state, _ = step(state, torch.ones(4))
        if r == 0:
            evaluate(_LOSS)(state, torch.ones(4))
        step(state, torch.ones(4))

    for words in _divergent_on_both_ranks(body, stage):
        assert "rank 0 checked the verdict of the donating step that made its state" in words, words
        assert "in fzero.evaluate" in words and "Rank(s) [0] were in fzero.evaluate" in words, words


def test_evaluate_on_one_rank_beside_a_step_of_micro_batches_is_not_worded_as_micro_batches():
    """Rank 0 evaluates where rank 1 steps over two micro-batches: the words said rank 0 was "past
    its last micro-batch" and gave the empty-micro-batch advice, and named evaluate twice (found
    in review). Now: the ranks' places, evaluate named once, no micro-batch advice."""
    def body(state, r):
        if r == 0:
            evaluate(_LOSS)(state, torch.ones(4))
        fzero.train_step(_LOSS, micro_batches=2)(state, [torch.ones(4), torch.ones(4)])

    for words in _divergent_on_both_ranks(body):
        assert "rank 0 gathered unit 'a' in fzero.evaluate, rank 1 gathered unit 'a' in micro-batch 0" in words, words
        assert "past its last micro-batch" not in words and words.count("were in fzero.evaluate") == 1, words


@pytest.mark.parametrize("then", ["gather", "save"])
def test_evaluate_on_one_rank_of_a_donated_state_beside_a_gather_or_save_names_evaluate(then, tmp_path):
    """Rank 0 evaluates a donated state alone, then every rank calls `fzero.gather` (or
    `checkpoint.save`): rank 0's evaluation meets rank 1's gather at the same check of the
    state's verdict, the same call but for evaluate's label. Rank 1 was told to call the same op
    with the same dtype, shape and tag (which it did), or that its save must not be under
    `if rank == 0:` (it was not); rank 0 got the bare mismatch (found in review). Now rank 0
    raises `DivergentPaths` and rank 1 a mismatch, each naming the rank in fzero.evaluate."""
    def body(state, r):
        state, _ = fzero.train_step(_LOSS, donate=True)(state, torch.ones(4))
        if r == 0:
            evaluate(_LOSS)(state, torch.ones(4))
        fzero.gather(state) if then == "gather" else fzero.checkpoint.save(state, tmp_path / "ck")

    errors = _errors_on_both_ranks(body, stage=0)
    assert isinstance(errors[0], DivergentPaths) and type(errors[1]) is fzero.CollectiveMismatch, errors
    for e in errors.values():  # once each: the DivergentPaths words the mesh's sentence, not beside it
        assert str(e).count("Rank(s) [0] were in fzero.evaluate and the others not") == 1, str(e)
    assert "took different paths through the model" not in str(errors[0])  # no model path parted
    assert "gather='eager'" not in str(errors[0])  # (which would not help: found in review)
    if then == "gather":
        assert "the calls are the same but made in different parts of the ranks' programs: rank(s) [0] in " \
               "fzero.evaluate; rank(s) [1] outside fzero.evaluate" in str(errors[1]), str(errors[1])


# -- 3. persistent units and a cap on live gathered bytes --------------------------------------------


def _gathers(log, rank):
    """`{unit: all-gathers of its params}` on `rank` (the update's agreement is not a unit's)."""
    out = {}
    for r in log:
        if r.op == "all_gather" and r.rank == rank and not r.tag.startswith("fzero."):
            unit = r.tag.split("/")[0]
            out[unit] = out.get(unit, 0) + 1
    return out


@pytest.mark.parametrize("engine", ["autograd", "func"])
def test_persist_bytes_keeps_small_units_gathered_and_changes_no_bit(engine):
    """Stage 3, `from_module`, N = 2, two steps. A block gathers (d² + d) · 4 = 288 B, the head
    (unit "default") (3d + 3 + 1 padding) · 4 = 112 B. Freed after use, backward gathers again every unit
    whose saved tensors it reads, but the forward's last (the root's post-hook releases the head
    last: it stays gathered for the backward, which starts with it): blocks 1-3 (block 0's input
    needs no gradient, so its weight is not saved). `persist_bytes` >= a unit's bytes keeps it
    gathered: its one forward gather per step is all (the autograd engine; `engine="func"` never
    frees, so gathers once per step at any threshold). The recorded data collectives equal
    `expected_comm` with the re-gather set minus the persistent units; the params and losses
    equal stage 0's."""
    k, d, n, steps = 4, 8, 2, 2
    params, apply, info = _module(k, d)
    loss = lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0]), b[1])  # noqa: E731
    block, head = (d * d + d) * 4, (3 * d + 3 + 1) * 4  # flat[N * S]: the head's 27 elements padded to 28
    regathered = {f"blocks.{i}" for i in range(1, k)}

    def run(stage, persist):
        mesh = fzero.SimMesh(n)

        def rank_fn(r):
            state = fzero.init(params, optim.adamw(1e-2, weight_decay=0.1), stage=stage, mesh=mesh, units=info.units)
            step = fzero.train_step(loss, engine=engine, persist_bytes=persist)
            losses = []
            with mesh.record() as log:
                for i in range(steps):
                    state, m = step(state, _batch(r + n * i, d))
                    losses.append(m.loss)
            return fzero.gather(state), losses, log, state.layout

        return mesh.run(rank_fn, [(r,) for r in range(n)])

    ref = run(0, 0)
    for persist, kept in ((0, set()), (head, set()), (block - 1, set()), (block, regathered)):
        out = run(3, persist)
        for (p0, l0, _, _), (p3, l3, log, layout) in zip(ref, out):
            assert all(torch.equal(a, b) for a, b in zip(l0, l3))
            assert all(torch.equal(p0[name], p3[name]) for name in p0)
        log, layout = out[0][2], out[0][3]
        again = regathered - kept if engine == "autograd" else set()
        want = {u: steps * (1 + (u in again)) for u in layout.units}
        assert _gathers(log, 0) == want, (persist, _gathers(log, 0), want)
        got = fzero.accounting.comm_volume(log, n, steps=steps)
        assert got.data == fzero.accounting.expected_comm(layout, n, 3, regather=again).data


def test_max_live_bytes_frees_persistent_units_early_and_refuses_what_cannot_fit():
    """Everything persists (`persist_bytes` large), so without a cap a rank ends forward holding
    all K blocks. With `max_live_bytes` = two blocks, kept blocks are freed, oldest first, before
    each gather. A census of block-sized storages over both ranks, read when backward starts
    (the first reduce-scatter; backward's gradient buffers have a block's size too), sees all
    N · K blocks uncapped, and capped at most N · 2 blocks plus SimMesh's concatenation buffer
    while an all-gather completes. Blocks freed early are gathered again in backward; the bits
    equal the uncapped step's. A cap below one block raises `ConfigError` naming the unit."""
    k, d, n = 6, 8, 2
    params, apply, info = _module(k, d)
    loss = lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0]), b[1])  # noqa: E731
    block = (d * d + d) * 4

    def run(cap):
        census = LiveStorages(count=lambda t: t.untyped_storage().nbytes() == block)
        mesh = PeakAtBackward(n, census)

        def rank_fn(r):
            state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
            step = fzero.train_step(loss, persist_bytes=10**9, max_live_bytes=cap)
            with census, mesh.record() as log:
                state, m = step(state, _batch(r, d))
            return fzero.gather(state), m.loss, sum(_gathers(log, mesh.rank).values())

        return mesh.run(rank_fn, [(r,) for r in range(n)]), mesh.forward_peak

    (free, peak_free), (capped, peak_capped) = run(None), run(2 * block + 200)
    for (pf, lf, gf), (pc, lc, gc) in zip(free, capped):
        assert torch.equal(lf, lc) and all(torch.equal(pf[name], pc[name]) for name in pf)
        # uncapped: one gather per unit; capped: re-gathers, 10 in all with the oldest kept block freed first (a
        # mutant freeing the newest first made 11 here and passed while this asserted only gc > k + 1)
        assert gf == k + 1 and gc == 10, gc
    assert peak_free >= n * k * block  # non-vacuous: uncapped, every block stays gathered
    assert peak_capped <= (2 * n + 1) * block, (peak_capped, block)
    with pytest.raises(fzero.ConfigError, match=r"max_live_bytes=100: unit 'blocks.0' alone gathers 288 bytes"):
        run(100)


def test_max_live_bytes_at_n1_counts_nothing_for_units_that_read_their_held_shard():
    """At N = 1 stage 3's units read their held shards (nothing is gathered, nothing freed), so
    they hold no gathered bytes: a cap of two blocks lets a step over six blocks run -- as it did
    when N = 1 gathered copies and freed them -- with the uncapped step's bits."""
    k, d = 6, 8
    params, apply, info = _module(k, d)
    loss = lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0]), b[1])  # noqa: E731
    block = (d * d + d) * 4
    mesh = fzero.SimMesh(1)

    def rank_fn(cap):
        state = fzero.init(params, optim.sgd(0.1), stage=3, mesh=mesh, units=info.units)
        step = fzero.train_step(loss, max_live_bytes=cap)
        for _ in range(2):
            state, m = step(state, _batch(0, d))
        return fzero.gather(state), m.loss

    (pf, lf), (pc, lc) = mesh.run(rank_fn, [(None,)])[0], mesh.run(rank_fn, [(2 * block + 200,)])[0]
    assert torch.equal(lf, lc) and all(torch.equal(pf[name], pc[name]) for name in pf)


def test_persist_and_cap_reject_bad_settings():
    for bad in (-1, 1.5, True):
        with pytest.raises(fzero.ConfigError, match="persist_bytes must be an int >= 0"):
            fzero.train_step(lambda p, b: 0, persist_bytes=bad)
    with pytest.raises(fzero.ConfigError, match="max_live_bytes must be None or an int >= 1"):
        fzero.train_step(lambda p, b: 0, max_live_bytes=0)
    mesh = fzero.SimMesh(1)

    def eager():
        state = fzero.init({"a": torch.ones(2)}, optim.sgd(0.1), stage=3, mesh=mesh)
        fzero.train_step(lambda p, b: p["a"].sum(), gather="eager", max_live_bytes=8)(state, None)

    with pytest.raises(fzero.ConfigError, match="only stage 3 with gather='on_use', engine='autograd'"):
        mesh.run(eager)


# -- refills written into the released storage -------------------------------------------------


def _refill_runs(mesh, method, direct, precision, prefetch, batch_of):
    """Three stage-3 steps of `_module`'s model on `mesh` with `Gathering.<method>` (`_fill` or
    `_into_storage`) counted, and answering False (the refill that copies) unless `direct`: per
    rank `(gathered params, losses, the recorded collectives, the method's answers)`. Patched
    once, outside the rank threads."""
    from fzero._src.gathering import Gathering

    params, apply, info = _module()
    real = getattr(Gathering, method)
    answers = []

    def counted(self, unit):
        ok = real(self, unit) if direct else False
        answers.append(ok)
        return ok

    bf16 = precision.param_dtype == torch.bfloat16

    def rank_fn():
        state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units, precision=precision)
        step = fzero.train_step(
            lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0].bfloat16() if bf16 else b[0]).float(), b[1]),
            donate=True, prefetch=prefetch)
        losses = []
        with mesh.record() as log:
            for t in range(3):
                state, m = step(state, batch_of(mesh.rank, t))
                losses.append(m.loss)
        return fzero.gather(state), losses, list(log), answers

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Gathering, method, counted)
        return mesh.run(rank_fn)


@pytest.mark.parametrize("prefetch", [0, 1])
def test_refill_at_one_rank_casts_into_the_storage_and_changes_no_bit(prefetch):
    """Stage 3 at N = 1 under a bf16 policy releases each block after its forward (its held fp32
    shard is not the bf16 tensor the unit reads) and refills it in backward. Its gather is the
    cast of the held shard (`Mesh.solo` returns its input), so the refill writes the cast into
    the released storage by one `copy_` (`Gathering._fill`) instead of casting into a new tensor
    and copying that: the same params, losses and recorded collectives bit for bit as the
    refill that copies, and every block is refilled in place (4 per step), without prefetch: at
    N = 1 the forward's last block is freed too (kept, it raised the peak with no collective to
    save). With prefetch every refill but the first is started ahead, which takes the copying
    path: the forward's last block, read by backward first, is the one filled in place."""
    mesh = fzero.SimMesh(1)
    policy = fzero.Precision(torch.bfloat16, torch.float32)
    got, want = (_refill_runs(mesh, "_fill", direct, policy, prefetch, lambda r, t: _batch(t))[0]
                 for direct in (True, False))
    logs = [[(r.op, r.dtype, r.elements, r.tag) for r in run[2]] for run in (got, want)]
    assert got[1] == want[1] and logs[0] == logs[1]
    assert all(torch.equal(got[0][k], want[0][k]) for k in want[0])
    assert not any(want[3]) and sum(got[3]) == (12 if prefetch == 0 else 3)


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("policy", [None, "bf16"])
def test_refill_at_several_ranks_gathers_into_the_storage_and_changes_no_bit(n, prefetch, policy):
    """At N > 1 a released block's refill all-gathers straight into its released storage
    (`Mesh.start`'s `out`; `Gathering._start`) instead of into a new tensor copied there: the
    same params, losses and recorded collectives bit for bit as the refill that copies, with
    and without a prefetched refill (a prefetch never read frees the storage again), fp32 and
    under a bf16 policy."""
    mesh = fzero.SimMesh(n)
    prec = fzero.Precision(torch.bfloat16, torch.float32) if policy else fzero.Precision()
    got, want = (_refill_runs(mesh, "_into_storage", direct, prec, prefetch, lambda r, t: _batch(r + 10 * t))
                 for direct in (True, False))
    for r in range(n):
        logs = [sorted((x.rank, x.op, x.elements, x.tag) for x in run[r][2]) for run in (got, want)]
        assert got[r][1] == want[r][1] and logs[0] == logs[1]
        assert all(torch.equal(got[r][0][k], want[r][0][k]) for k in want[r][0])
        assert any(got[r][3]) and not any(want[r][3])


# -- modules that return their own params ----------------------------------------------------------


class _Returns(torch.nn.Module):
    """A module whose forward returns its param itself (`whole`) or a slice of it (a learned
    positional embedding, `self.weight[:T]`): a view of the unit's gathered storage."""

    def __init__(self, rows: int, d: int, whole: bool):
        super().__init__()
        self.weight, self.whole = torch.nn.Parameter(torch.randn(rows, d)), whole

    def forward(self, t: int):
        return self.weight if self.whole else self.weight[:t]


class _UsesReturned(torch.nn.Module):
    def __init__(self, d: int = 8, whole: bool = False):
        super().__init__()
        self.pos, self.lin, self.out = _Returns(5 if whole else 7, d, whole), torch.nn.Linear(d, d), torch.nn.Linear(d, 3)

    def forward(self, x):  # x: (B, 5, d)
        p = self.pos(x.shape[1])
        h = torch.tanh(self.lin(x))  # another unit read after pos's forward (pos was freed here)
        h = h * p  # the view read by an elementwise op
        h = self.lin(p) + h  # and as a module's input
        return self.out(h).mean(1)


@pytest.mark.parametrize("whole", [True, False])
@pytest.mark.parametrize("prefetch", [0, 1])
@pytest.mark.parametrize("remat", [False, True])
def test_a_module_that_returns_its_param_keeps_its_unit_gathered(whole, prefetch, remat):
    """Found in review (older than the deferred release): stage 3 freed a unit after its module's
    forward though the module returned its param (or a slice of it), so what read that output
    next read freed memory (torch's "data is not allocated", or a crash in an elementwise op).
    Now a unit whose module's output is a view of its gathered storage stays gathered until its
    backward: stage 3 gives stage 0's bits over two steps, N = 2, with or without prefetch and
    remat."""
    d = 8
    torch.manual_seed(0)
    model = _UsesReturned(d, whole)
    params, apply, info = fzero.from_module(model, units=lambda p: p.split(".")[0], remat=remat)
    mesh = fzero.SimMesh(2)

    def loss(p, b):
        return torch.nn.functional.cross_entropy(apply(p, b[0]), b[1])

    def rank_fn(stage):
        return classifier_steps(mesh, params, info.units, loss, stage, d, **({"prefetch": prefetch} if stage == 3 else {}))

    for (p0, l0), (p3, l3) in zip(mesh.run(lambda: rank_fn(0)), mesh.run(lambda: rank_fn(3))):
        assert all(torch.equal(a, b) for a, b in zip(l0, l3))
        assert all(torch.equal(p0[k], p3[k]) for k in p0)


@dataclasses.dataclass
class _Out:
    h: torch.Tensor
    pos: torch.Tensor


class _PosTwice(torch.nn.Module):
    """Returns a slice of its weight when called without input, a product with it otherwise."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(9, d))

    def forward(self, x=None, t=None):
        return self.weight[:t] if x is None else x @ self.weight[: x.shape[-1]].T


class _PosInDataclass(torch.nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(7, d))

    def forward(self, x):
        return _Out(x, self.weight[: x.shape[1]])


class _ReturnsLater(torch.nn.Module):
    """`twice`: the view-returning unit called again with a plain output before the view is read;
    else its view comes inside a dataclass (which torch's pytree does not open)."""

    def __init__(self, twice: bool, d: int = 8):
        super().__init__()
        self.twice = twice
        self.pos = _PosTwice(d) if twice else _PosInDataclass(d)
        self.mid, self.out = torch.nn.Linear(d, d), torch.nn.Linear(d, 3)

    def forward(self, x):
        if self.twice:
            p = self.pos(t=x.shape[1])
            h = torch.tanh(self.pos(x))  # the same unit again: a plain output
        else:
            o = self.pos(x)
            h, p = o.h, o.pos
        h = torch.tanh(self.mid(h))  # another unit read
        return self.out(h + p).mean(1)


@pytest.mark.parametrize("twice", [True, False])
def test_a_returned_param_view_stays_valid_after_a_second_call_and_inside_a_dataclass(twice):
    """Found in review of the test above's fix: a unit whose view was returned and then called
    again with a plain output was freed by the second release; a view inside a dataclass output
    was not seen. Both freed the storage the view reads (a crash). A unit one output held a view
    of now stays gathered for the step's forward, and dataclass fields are searched: stage 0's
    bits at stage 3, N = 2."""
    d = 8
    torch.manual_seed(0)
    params, apply, info = fzero.from_module(_ReturnsLater(twice, d), units=lambda p: p.split(".")[0])
    mesh = fzero.SimMesh(2)

    def rank_fn(stage):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        step = fzero.train_step(lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0]), b[1]))
        g = torch.Generator().manual_seed(mesh.rank)
        state, m = step(state, (torch.randn(2, 5, d, generator=g), torch.randint(0, 3, (2,), generator=g)))
        return fzero.gather(state), m.loss

    for (p0, l0), (p3, l3) in zip(mesh.run(lambda: rank_fn(0)), mesh.run(lambda: rank_fn(3))):
        assert torch.equal(l0, l3) and all(torch.equal(p0[k], p3[k]) for k in p0)


class _WritesSaved(torch.nn.Module):
    """`a -> sigmoid -> c`; `write`: the sigmoid's output, which sigmoid saves for its backward, is
    then scaled in place (torch refuses that backward); else scaled in place by `relu_` after a
    product, which saves nothing it then writes (torch accepts it)."""

    def __init__(self, write: bool, d: int = 8):
        super().__init__()
        self.write = write
        self.a, self.c = torch.nn.Linear(d, d), torch.nn.Linear(d, 3)

    def forward(self, x):
        if self.write:
            h = torch.sigmoid(self.a(x))
            h.mul_(2)
        else:
            h = self.a(x).relu_()
        return self.c(h)


@pytest.mark.parametrize("write", [True, False])
def test_a_tensor_saved_for_backward_and_written_in_place_raises_at_every_stage(write):
    """Found in review: stage 3 packs every tensor the loss saves for backward through saved-tensor
    hooks (to gather a released unit again when backward reads it), and torch does not check the
    version of a tensor packed by hooks. A loss that wrote a saved activation in place trained on
    at stage 3 with a gradient from the written values, where stages 0-2 raise torch's "modified
    by an inplace operation". Now stage 3 raises that error too (`gathering._unmodified`), and an
    in-place write torch accepts (`relu_` on a product's output) still gives stage 0's bits."""
    d = 8
    torch.manual_seed(0)
    params, apply, info = fzero.from_module(_WritesSaved(write, d), units=lambda p: p.split(".")[0])
    mesh = fzero.SimMesh(2)

    def loss(p, b):
        return torch.nn.functional.cross_entropy(apply(p, b[0]), b[1])

    def rank_fn(stage):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        step = fzero.train_step(loss)
        g = torch.Generator().manual_seed(mesh.rank)
        try:
            state, _ = step(state, (torch.randn(4, d, generator=g), torch.randint(0, 3, (4,), generator=g)))
        except RuntimeError as e:
            return str(e)
        return fzero.gather(state)

    for stage in (0, 1, 2, 3):
        for got, want in zip(mesh.run(lambda: rank_fn(stage)), mesh.run(lambda: rank_fn(0))):
            if write:
                assert isinstance(got, str) and "modified by an inplace operation" in got, (stage, got)
                assert "modified by an inplace operation" in want
            else:
                assert all(torch.equal(got[k], want[k]) for k in want), stage


class _KeepsFn(torch.autograd.Function):
    """`x @ w.T` whose backward reads `w` from a `ctx` attribute (not `save_for_backward`)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.w = w
        return x @ w.T

    @staticmethod
    def backward(ctx, g):
        return g @ ctx.w, None


class _KeepingLinear(torch.nn.Linear):
    """A linear layer whose weight something keeps past its forward, as `keep` says: a view it
    caches goes to `put` (functions, which `from_module`'s copy of the model shares)."""

    def __init__(self, keep: str, put, d: int):
        super().__init__(d, d)
        self.keep, self.put = keep, put

    def forward(self, x):
        w = self.weight
        if self.keep == "slice":  # a view cached
            self.put(w[:3])
        elif self.keep == "transpose":  # a cached view the product below saves for backward too
            wt = w.t()
            self.put(wt)
            return x @ wt + self.bias
        elif self.keep == "ctx":
            return _KeepsFn.apply(x, w) + self.bias
        elif self.keep == "grad_hook":
            out = torch.nn.functional.linear(x, w, self.bias)
            if out.requires_grad:
                out.register_hook(lambda g: g + 0 * w.sum())
            return out
        return torch.nn.functional.linear(x, w, self.bias)


class _Kept(torch.nn.Module):
    """`p`, `a` (a `_KeepingLinear`), `b` and `c`, each a unit (so `a`'s input requires grad, and
    the product in `a` saves its weight); what `a` kept (`get`) is read after `b` ran, in the
    forward; what else it keeps is read in the backward."""

    def __init__(self, keep: str, put, get, d: int = 8):
        super().__init__()
        self.get = get
        self.p, self.a = torch.nn.Linear(d, d), _KeepingLinear(keep, put, d)
        self.b, self.c = torch.nn.Linear(d, d), torch.nn.Linear(d, 3)

    def forward(self, x):
        h = torch.tanh(self.b(torch.tanh(self.a(torch.tanh(self.p(x))))))
        kept = self.get()
        if kept is not None:
            h = h + kept.sum()
        return self.c(h)


@pytest.mark.parametrize("keep", ["slice", "transpose", "ctx", "grad_hook", "forward_hook", "loss", "unit_dict"])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_a_unit_referenced_past_its_forward_stays_gathered(keep, prefetch):
    """Found in review: a reference to a stage-3 unit's param kept past its submodule's forward
    somewhere other than the output (a view cached, the weight kept by a forward hook, a grad
    hook or a Function's `ctx`, a loss holding `p["a.weight"]`, or the dict `p.unit("a")`, across
    `apply`) read the storage
    stage 3 freed after that forward: torch's "data is not allocated", or a segfault (seen with
    the cached slice and the forward hook). Now `release` frees no unit something beyond fzero
    and autograd's saved tensors still holds (`Gathering._referenced`): stage 0's bits at stage
    3, N = 2, over two steps, and what was kept can be read after each step (stage 3's holds
    that step's gathered values; at stage 0 it is a view of the state's buffers, which a donated
    update writes, so only its finiteness is compared)."""
    d = 8
    torch.manual_seed(0)
    mesh = fzero.SimMesh(2)
    held: dict[int, torch.Tensor] = {}  # per rank (SimMesh's ranks are threads): the tensor kept

    def put(t):
        held[mesh.rank] = t

    model = _Kept(keep, put, lambda: held.get(mesh.rank) if keep in ("slice", "transpose") else None, d)
    if keep == "forward_hook":  # registered before from_module's: it runs while the weight is bound
        model.a.register_forward_hook(lambda m, i, o: put(m.weight))
    params, apply, info = fzero.from_module(model, units=lambda p: p.split(".")[0])

    def loss(p, b):
        w = p["a.weight"] if keep == "loss" else p.unit("a") if keep == "unit_dict" else None
        out = apply(p, b[0])
        if keep == "unit_dict":
            w = w["a.weight"]
        if w is not None:
            out = out + w.sum()
        if keep == "forward_hook":
            out = out + held[mesh.rank].sum()
        return torch.nn.functional.cross_entropy(out, b[1])

    def rank_fn(stage):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        step = fzero.train_step(loss, **({"prefetch": prefetch} if stage == 3 else {}))
        out = []
        for t in range(2):
            g = torch.Generator().manual_seed(10 * t + mesh.rank)
            state, m = step(state, (torch.randn(4, d, generator=g), torch.randint(0, 3, (4,), generator=g)))
            kept = held.get(mesh.rank)
            out.append((m.loss, kept.sum() if kept is not None else None))  # before: a segfault or torch's error
        held.pop(mesh.rank, None)
        return fzero.gather(state), out

    for (p0, o0), (p3, o3) in zip(mesh.run(lambda: rank_fn(0)), mesh.run(lambda: rank_fn(3))):
        assert all(torch.equal(l0, l3) for (l0, _), (l3, _) in zip(o0, o3))
        assert all(torch.equal(p0[k], p3[k]) for k in p0)
        kept = [k for _, k in o3 if k is not None]
        assert len(kept) == (2 if keep in ("slice", "transpose", "forward_hook") else 0)
        assert all(torch.isfinite(k) for k in kept)


def test_a_torch_without_storage_use_counts_frees_units_as_before(monkeypatch):
    """`Gathering._referenced` needs `torch._C._storage_Use_Count`; where a torch build lacks it,
    nothing is recorded at the read and units are freed after use as before (the check's
    protection is then absent, not its cost): stage 0's bits at stage 3, N = 2, with every
    released unit gathered again in backward."""
    from fzero._src import gathering

    monkeypatch.setattr(gathering, "_use_count", None)
    d = 8
    torch.manual_seed(0)
    mesh = fzero.SimMesh(2)
    params, apply, info = fzero.from_module(_Kept("none", None, lambda: None, d), units=lambda p: p.split(".")[0])

    def rank_fn(stage):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        step = fzero.train_step(lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0]), b[1]))
        g = torch.Generator().manual_seed(mesh.rank)
        with mesh.record() as log:
            state, m = step(state, (torch.randn(4, d, generator=g), torch.randint(0, 3, (4,), generator=g)))
        gathers = sum(1 for r in log if r.op == "all_gather" and r.rank == mesh.rank)
        return fzero.gather(state), m.loss, gathers

    for (p0, l0, _), (p3, l3, g3) in zip(mesh.run(lambda: rank_fn(0)), mesh.run(lambda: rank_fn(3))):
        assert torch.equal(l0, l3) and all(torch.equal(p0[k], p3[k]) for k in p0)
        assert g3 == 4 + 3  # four units read, and the three released before the last gathered again


class _Recurrent(torch.nn.Module):
    def __init__(self, kind: str, d: int = 8):
        super().__init__()
        self.p, self.g, self.c = torch.nn.Linear(d, d), getattr(torch.nn, kind)(d, d, batch_first=True), torch.nn.Linear(d, 3)

    def forward(self, x):  # (B, T, d)
        return self.c(self.g(torch.tanh(self.p(x)))[0][:, -1])


@pytest.mark.parametrize("kind", ["GRU", "LSTM", "RNN"])
def test_a_recurrent_unit_is_freed_after_use(kind):
    """Found in review of `Gathering._referenced`: `nn.RNNBase` keeps its weights in
    `_flat_weights` too, which its forward refreshes and from_module's unbinding (a write to
    `_parameters`) did not, so every recurrent unit looked referenced after its forward and stayed
    gathered for the step and after it. Unbinding now puts the placeholders there too: the unit
    is freed after its forward and gathered again in backward (three units read, the two freed
    before the last gathered again), with stage 0's bits."""
    d = 8
    torch.manual_seed(0)
    mesh = fzero.SimMesh(2)
    params, apply, info = fzero.from_module(_Recurrent(kind, d), units=lambda p: p.split(".")[0])

    def rank_fn(stage):
        state = fzero.init(params, optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
        step = fzero.train_step(lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0]), b[1]))
        g = torch.Generator().manual_seed(mesh.rank)
        with mesh.record() as log:
            state, m = step(state, (torch.randn(2, 5, d, generator=g), torch.randint(0, 3, (2,), generator=g)))
        return fzero.gather(state), m.loss, sum(1 for r in log if r.op == "all_gather" and r.rank == mesh.rank)

    for (p0, l0, _), (p3, l3, g3) in zip(mesh.run(lambda: rank_fn(0)), mesh.run(lambda: rank_fn(3))):
        assert torch.equal(l0, l3) and all(torch.equal(p0[k], p3[k]) for k in p0)
        assert g3 == 3 + 2


def test_a_cap_that_a_referenced_unit_exceeds_says_why_it_stays_gathered():
    """`max_live_bytes` counts a unit kept gathered because something references it (row 57): the
    cap's error names it as such (found in review: it said only "still in use")."""
    d = 8
    mesh = fzero.SimMesh(2)
    held: dict[int, torch.Tensor] = {}

    def put(t):
        held[mesh.rank] = t

    params, apply, info = fzero.from_module(_Kept("slice", put, lambda: held.get(mesh.rank), d),
                                            units=lambda p: p.split(".")[0])
    unit = (d * d + d) * 4  # one linear layer's gathered bytes (N divides them)

    def rank_fn():
        state = fzero.init(params, optim.adamw(1e-2), stage=3, mesh=mesh, units=info.units)
        step = fzero.train_step(lambda p, b: torch.nn.functional.cross_entropy(apply(p, b[0]), b[1]),
                                max_live_bytes=unit * 3 // 2)  # room for one unit: `a` stays, `b` cannot come
        g = torch.Generator().manual_seed(mesh.rank)
        step(state, (torch.randn(4, d, generator=g), torch.randint(0, 3, (4,), generator=g)))

    with pytest.raises(fzero.ConfigError, match=r"\['a'\] stay gathered because .* something else still references"):
        mesh.run(rank_fn)


# -- what evaluate hands back (found in review) --------------------------------------------------


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("n", [1, 2])
def test_evaluate_returns_tensors_of_its_own(stage, n):
    """A param returned as it is was a view of the state's buffer at stages 0-2 and at stage 3,
    N = 1 (a gathered copy at stage 3, N > 1): writing it changed the state in some stages only,
    and with `donate=True` it took the next step's values. Outputs sharing the state's memory are
    now cloned, and a `LazyParams` returned whole (from_module's flat params, on use) comes back
    as a dict of tensors."""
    mesh = fzero.SimMesh(n)
    params = {"w": torch.arange(4.0), "b": torch.ones(2)}

    def rank_fn():
        state = fzero.init(params, optim.sgd(0.5), stage=stage, mesh=mesh)
        w = fzero.evaluate(lambda p, b: p["w"])(state, None)
        w.add_(100.0)
        everything = fzero.evaluate(lambda p, b: p)(state, None)
        state, _ = fzero.train_step(lambda p, b: (p["w"] ** 2).sum() + p["b"].sum(), donate=True)(state, None)
        return fzero.gather(state), everything

    for after, everything in mesh.run(rank_fn):
        assert torch.equal(after["w"], params["w"] * 0.0)  # w - 0.5 * 2w: the write did not reach the state
        assert type(everything) is dict and torch.equal(everything["w"], params["w"])  # (not the step's values)


def test_evaluate_inside_a_torch_func_transform_is_refused():
    """Its function runs under no_grad: stage 0 gave a zero derivative, stage 3 torch's
    saved-tensor-hooks error (found in review)."""
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init({"w": torch.ones(3)}, optim.sgd(0.1), stage=0, mesh=mesh)
        ev = fzero.evaluate(lambda p, x: (p["w"] * x).sum())
        torch.func.grad(lambda x: ev(state, x))(torch.ones(3))

    with pytest.raises(fzero.ConfigError, match="evaluate inside a torch.func transform"):
        mesh.run(rank_fn)


@dataclasses.dataclass
class _Returned:
    w: torch.Tensor
    total: torch.Tensor


@dataclasses.dataclass(frozen=True, slots=True)
class _FrozenReturned:
    pair: list


class _NotATree:
    def __init__(self, w: torch.Tensor) -> None:
        self.w = w


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("n", [1, 2])
def test_evaluate_returns_the_leaves_a_dataclass_holds(stage, n):
    """Found in review: with nested params on use, a param returned inside a dataclass (a leaf to
    torch's pytree) came back as fzero's placeholder, which raised at its first use. Now a
    dataclass's fields are walked (a copy with the real leaf, frozen and slotted ones too), and
    cloned where they share the state's memory, as evaluate's other outputs; an object of another
    class holding a placeholder (or a view of the state) raises `ConfigError` naming its type
    and the way out."""
    nested = {"w": torch.randn(5, 3, generator=torch.Generator().manual_seed(3)), "b": {"c": torch.ones(3)}}
    mesh = fzero.SimMesh(n)

    def fn(p, x):
        return _Returned(p["w"], p["b"]["c"].sum() * x), (_FrozenReturned([p["b"]["c"], x]), 7)

    def rank_fn():
        state = fzero.init(nested, optim.sgd(0.1), stage=stage, mesh=mesh, units=lambda path: path.split(".")[0])
        outs = {g: evaluate(fn, gather=g)(state, torch.tensor(2.0)) for g in ("on_use", "eager")}
        for out, (frozen, _) in outs.values():
            out.w.add_(1.0)  # writes an output of its own: the state keeps its values
            frozen.pair[0].add_(1.0)
        with pytest.raises(fzero.ConfigError, match=r"returned a .*_NotATree whose attribute 'w' holds .*make "
                                                     r"_NotATree a @dataclasses.dataclass, or register it"):
            evaluate(lambda p, x: _NotATree(p["w"]), gather="on_use")(state, None)
        return outs, fzero.gather(state)

    for outs, after in mesh.run(rank_fn):
        fzero.testing.assert_trees_equal(after, nested)
        for out, (frozen, seven) in outs.values():
            assert type(out.w) is torch.Tensor and type(frozen.pair[0]) is torch.Tensor and seven == 7
            assert torch.equal(out.w, nested["w"] + 1) and torch.equal(out.total, torch.tensor(6.0))
            assert torch.equal(frozen.pair[0], nested["b"]["c"] + 1)


@pytest.mark.parametrize("stage", [0, 3])
def test_nn_parameter_of_an_on_use_placeholder_names_it_and_the_way_out(stage):
    """`nn.Parameter(p["w"])` inside the function, with nested params on use: torch's "Creating a
    Parameter from an instance of type Placeholder requires that detach() returns an instance of
    the same type" before (found in review); now `ConfigError` saying what the placeholder is,
    that such a Parameter is cut off from the param's gradient, and the ways out, in evaluate and
    in a step. Eager gathering hands the real leaf, and torch's Parameter of it is made."""
    mesh = fzero.SimMesh(2)
    units = lambda path: path.split(".")[0]  # noqa: E731

    def rank_fn():
        state = fzero.init({"a": {"w": torch.ones(3)}}, optim.sgd(0.1), stage=stage, mesh=mesh, units=units)
        eager = evaluate(lambda p, x: torch.nn.Parameter(p["a"]["w"]).sum(), gather="eager")(state, None)
        for call in (lambda: evaluate(lambda p, x: torch.nn.Parameter(p["a"]["w"]).sum())(state, None),
                     lambda: fzero.train_step(lambda p, x: (torch.nn.Parameter(p["a"]["w"]) * p["a"]["w"]).sum())(
                         state, None)):
            with pytest.raises(fzero.ConfigError, match=r"nn.Parameter\(w\) of a params leaf that is an on-use "
                                                         r"placeholder.*no gradient would reach the param.*"
                                                         r"gather='eager'"):
                call()
        return eager

    assert [float(x) for x in mesh.run(rank_fn)] == [3.0, 3.0]
