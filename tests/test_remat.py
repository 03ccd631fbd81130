"""Activation checkpointing per unit (`from_module(..., remat=...)`, fzero/_src/remat.py): the
same bits as the run without it in every stage and engine, dropout included (the recompute
replays the forward's random numbers), only the unit's inputs kept for backward, and in stage 3
one backward gather per unit serving both the recompute and the unit's backward
(proofs/stage3.md, section 6)."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

import fzero
from fzero._src import remat as remat_module
from fzero.accounting import LiveStorages
from fzero.testing import examples
from fzero.testing.strategies import seed_per_case

from . import prefetch_cases as cases
from .stage_harness import classifier_steps
from .test_prefetch import _equal


def _run(n, stage, d, hidden, **kw):
    mesh = fzero.SimMesh(n)
    return mesh.run(functools.partial(cases.train, mesh, stage, d, hidden, **kw))


@functools.lru_cache(maxsize=None)
def _stage_0(n, d, hidden, dropout):
    """Stage 0 without checkpointing: the reference (computed once per model; results are
    only compared, never modified)."""
    return _run(n, 0, d, hidden, dropout=dropout)


@pytest.mark.parametrize("dropout", [0.3])
@pytest.mark.parametrize("engine", ["autograd", "func"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_remat_in_every_stage_equals_stage_0_without_it(stage, engine, dropout):
    """Every block checkpointed, N = 2, two AdamW steps: losses and params equal stage 0 without
    checkpointing, bit for bit, with dropout too: the recompute runs the same ops on the same
    values (the params gathered again copy the same bits) with the generator state the forward
    started from, so it draws the same masks."""
    d, hidden = 8, (8, 12, 16)
    _equal(_stage_0(2, d, hidden, dropout), _run(2, stage, d, hidden, dropout=dropout, remat=True, engine=engine))


@st.composite
def _remat_models(draw):
    """`(N, d, hidden, checkpointed blocks)`: N = 2 or 3 (at N = 1 nothing is gathered, so nothing
    is prefetched), depth 1-4, a non-empty subset of the blocks."""
    n, d, depth = draw(st.integers(2, 3)), draw(st.sampled_from([4, 8])), draw(st.integers(1, 4))
    hidden = tuple(draw(st.lists(st.sampled_from([4, 8, 12]), min_size=depth, max_size=depth)))
    mask = draw(st.integers(1, 2**depth - 1))
    return n, d, hidden, frozenset(f"blocks.{i}" for i in range(depth) if mask >> i & 1)


@pytest.mark.parametrize("k", [1, 2])
def test_remat_with_prefetch_on_random_models_equals_stage_0(k):
    """Random depth and width, a random non-empty subset of blocks checkpointed (and explicitly
    a middle block only, between plain ones), stage 3 with prefetch k >= 1 (prefetch 0, SimMesh's
    default: test_remat_in_every_stage_equals_stage_0_without_it), dropout 0.2: the same bits as
    stage 0 without checkpointing. Each k draws its own models."""

    @seed_per_case(k)
    @examples(2)
    @given(_remat_models())
    @example((2, 8, (8, 12, 4), frozenset({"blocks.1"})))
    def prop(model):
        n, d, hidden, chosen = model
        _equal(_stage_0(n, d, hidden, 0.2), _run(n, 3, d, hidden, dropout=0.2, remat=set(chosen), prefetch=k))

    prop()


def test_without_the_rng_replay_dropout_would_differ(monkeypatch):
    """Non-vacuous: with the replay of the generator state disabled, the recompute draws other
    dropout masks and the gradients (so the params after a step) differ."""
    d, hidden = 8, (8, 12)
    want = _run(2, 3, d, hidden, dropout=0.3)
    monkeypatch.setattr(remat_module.RngState, "put", lambda self: None)
    got = _run(2, 3, d, hidden, dropout=0.3, remat=True)
    assert any(not torch.equal(a[0][k], b[0][k]) for a, b in zip(want, got) for k in a[0])


@pytest.mark.parametrize("stage", [0, 3])
def test_a_checkpointed_block_keeps_only_its_input_for_backward(stage):
    """A census of the floating storages the forward leaves live (allocated between the loss's
    start and its end; gathered parameter storage excluded: `GatherCensusMesh`; and storages
    under 64 bytes: the units' 0-d anchors): one more checkpointed block keeps exactly one more
    (B, T, d) float32 tensor per rank -- its output, the next one's input -- while one more plain
    block keeps several of its activations."""
    n, d, b, t = 1, 8, 2, 5  # one rank: no other rank's allocations between the two notes
    act = b * t * d * 4

    def live(depth, remat):
        mesh = cases.GatherCensusMesh(n)
        census = LiveStorages(count=lambda x: x.is_floating_point() and not mesh.inside(x)
                              and x.untyped_storage().nbytes() >= 64)
        seen = {}

        def rank_fn():
            def note(when):
                torch.zeros(1).add_(1)  # one op: the census re-reads what is live
                seen.setdefault(when, []).append(census.current)

            with census:
                return cases.train(mesh, stage, d, (12,) * depth, steps=1, remat=remat, note=note)

        mesh.run(rank_fn)
        return seen["end"][0] - seen["start"][0]

    remat = [live(k, True) for k in (1, 2, 3)]
    plain = [live(k, False) for k in (1, 2, 3)]
    assert remat[1] - remat[0] == remat[2] - remat[1] == n * act, (remat, act)
    assert plain[1] - plain[0] > 3 * n * act, plain


def _gathers(log, rank):
    units = [r.tag.split("/")[0] for r in log if r.op == "all_gather" and r.rank == rank
             and not r.tag.startswith("fzero.")]
    return {u: units.count(u) for u in set(units)}


def test_in_stage_3_one_backward_gather_serves_the_recompute_and_the_backward():
    """The all-gathers per unit of a checkpointed stage-3 step are those of the plain step: one
    in forward, one in backward for every block but the forward's last, kept gathered for its
    backward (the recompute's params are the refilled storage its backward reads too), and one
    by `fzero.gather` after the step."""
    n, d, hidden = 2, 8, (8, 12, 16)

    def count(remat):
        mesh = fzero.SimMesh(n)

        def rank_fn():
            with mesh.record() as log:
                cases.train(mesh, 3, d, hidden, steps=1, remat=remat)
            return _gathers(log, mesh.rank)

        return mesh.run(rank_fn)[0]

    plain, checkpointed = count(False), count(True)
    last = len(hidden) - 1
    assert checkpointed == plain and all(checkpointed[f"blocks.{i}"] == 3 - (i == last) for i in range(len(hidden))), (
        plain, checkpointed)


def test_remat_rejects_what_it_cannot_checkpoint():
    with pytest.raises(fzero.ConfigError, match="remat names unit 'blocks.9', which is not a unit"):
        cases.model(8, (8,), remat={"blocks.9"})
    with pytest.raises(fzero.ConfigError, match="unit 'default' has no home submodule"):
        cases.model(8, (8,), remat={"default"})
    with pytest.raises(fzero.ConfigError, match="must be True, False or a collection"):
        cases.model(8, (8,), remat="blocks.0")
    torch.manual_seed(0)
    m = cases.Tiny(11, 8, (8, 8))

    def units(path):  # block 0's `up` is a unit of its own inside unit "outer" (the rest of block 0)
        return "inner" if path.startswith("blocks.0.up.") else "outer" if path.startswith("blocks.0.") else "default"

    with pytest.raises(fzero.ConfigError, match=r"unit 'outer' \(submodule 'blocks.0'\) holds the home of unit"):
        fzero.from_module(m, units=units, remat={"outer"})


@pytest.mark.parametrize("engine", ["autograd", "func"])
def test_remat_recomputes_under_the_forwards_autocast(engine):
    """The loss runs under CPU bf16 autocast; backward runs outside it, so the recompute must
    re-enter it (as `torch.utils.checkpoint` does) to compute the same bf16 matmuls: stage 3
    with every block checkpointed equals stage 0 without, bit for bit. Non-vacuous: autocast
    changes the loss (the bf16 run differs from the fp32 one)."""
    n, d, hidden = 2, 8, (8, 12)

    def run(stage, remat, autocast=True):
        mesh = fzero.SimMesh(n)
        params, apply, info = cases.model(d, hidden, remat=remat)

        def loss(p, b):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                logits = apply(p, b[0])
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), b[1].flatten())

        def rank_fn():
            state = fzero.init(params, fzero.optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
            state, m = fzero.train_step(loss, engine=engine)(state, cases.batch(mesh.rank))
            return fzero.gather(state), [m.loss]

        return mesh.run(rank_fn)

    want = run(0, False)
    _equal(want, run(3, True))
    assert not torch.equal(want[0][1][0], run(0, False, autocast=False)[0][1][0])


class _AttentionBlock(torch.nn.Module):
    """`x + fc(attn(x))`, `nn.MultiheadAttention(batch_first=True)` with a causal mask: its input
    projection is a `linear` on a transposed 3-d input, where `torch.matmul` chooses between one
    product and a batched one by whether the weight's transpose requires grad."""

    def __init__(self, d: int):
        super().__init__()
        self.attn, self.fc = torch.nn.MultiheadAttention(d, 2, batch_first=True), torch.nn.Linear(d, d)

    def forward(self, x):
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        return x + self.fc(self.attn(x, x, x, attn_mask=mask, need_weights=False)[0])


class _Attending(torch.nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.inp, self.b, self.head = torch.nn.Linear(d, d), _AttentionBlock(d), torch.nn.Linear(d, 3)

    def forward(self, x):  # (B, T, d) -> (B, 3)
        return self.head(self.b(torch.tanh(self.inp(x)))).mean(1)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("remat", [True, False])
def test_a_no_grad_forward_takes_the_products_a_params_would(stage, remat):
    """Found in review: remat's forward runs without grad, where a view of a leaf that requires
    grad still reports `requires_grad` and `torch.matmul` reads it to fold a `linear` on a
    transposed 3-d input into one product. Stage 3's leaves were views of the gathered buffer,
    which requires no grad (stage 2's, views of the full buffer beside its shard, likewise), so their
    transposes did not, matmul took the batched product, and the
    attention block's output differed from stage 0's in the last bits (the loss, then every
    gradient after it; a tiny GPT's params by up to 6e-3 after one step). The leaves are now
    tensors of their own (`gather_leaves(alone=True)`): under `torch.no_grad()` inside the loss a
    leaf's transpose requires grad at every stage, as a torch param's does, and stage `stage`
    gives stage 0's bits over two steps at N = 2, with remat of the attention block and without."""
    d = 8
    torch.manual_seed(0)
    params, apply, info = fzero.from_module(_Attending(d), units=lambda p: p.split(".")[0],
                                            remat=["b"] if remat else False)
    mesh = fzero.SimMesh(2)
    seen = []

    def loss(p, b):
        with torch.no_grad():
            seen.append(p["b.fc.weight"].t().requires_grad)
        return torch.nn.functional.cross_entropy(apply(p, b[0]), b[1])

    def rank_fn(s):
        return classifier_steps(mesh, params, info.units, loss, s, d)

    for (p0, l0), (ps, ls) in zip(mesh.run(lambda: rank_fn(0)), mesh.run(lambda: rank_fn(stage))):
        assert all(map(torch.equal, l0, ls)) and all(torch.equal(p0[k], ps[k]) for k in p0)
    assert seen and all(seen)


class _SelfAttention(torch.nn.Module):
    """An attention and a gain (a param at this level, so that the unit's home, the module remat
    checkpoints, is this one and not the attention, which returns `(out, None)`)."""

    def __init__(self, d: int):
        super().__init__()
        self.attn, self.gain = torch.nn.MultiheadAttention(d, 2, batch_first=True), torch.nn.Parameter(torch.ones(()))

    def forward(self, q, k, v):
        return self.attn(q, k, v, need_weights=False)[0] * self.gain


class _Penalised(torch.nn.Module):
    """Returns the gradient of an energy of its input, taken inside its forward (a force field, a
    gradient penalty), with the graph kept for the backward through it. Its params lie in `lin`,
    so `lin` is the unit's home, the module remat checkpoints: the gradient is taken over the
    checkpointed module, and the step's backward differentiates through remat's backward."""

    def __init__(self, d: int):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, h):
        with torch.enable_grad():
            energy = torch.tanh(self.lin(h)).square().sum()
            return torch.autograd.grad(energy, h, create_graph=True)[0]


class _RematCase(torch.nn.Module):
    """`emb` (an `Embedding` of token ids, checkpointed in the "embedding" case; else a linear on
    floats), then `b` (checkpointed in the other cases) and `head`; `b` is an attention called
    `attn(h, h, h)`, or a `TransformerEncoderLayer` with dropout (its dropouts act on strided
    activations); "eval_attention" runs the model in eval mode (the attention's fast path runs
    only without grad)."""

    def __init__(self, case: str, d: int = 8):
        super().__init__()
        self.case = case
        self.emb = torch.nn.Embedding(11, d) if case == "embedding" else torch.nn.Linear(d, d)
        if case == "encoder_dropout":
            self.b = torch.nn.TransformerEncoderLayer(d, 2, 16, dropout=0.1, batch_first=True)
        elif case == "gradient_over_the_unit":
            self.b = _Penalised(d)
        else:
            self.b = _SelfAttention(d)
        if case == "frozen_projection":
            self.b.attn.in_proj_weight.requires_grad_(False)
        self.head = torch.nn.Linear(d, 3)

    def forward(self, x):
        h = self.emb(x) if self.case == "embedding" else torch.tanh(self.emb(x))
        if self.case in ("encoder_dropout", "gradient_over_the_unit"):
            h = self.b(h)
        else:
            h = h + self.b(h, h, h)  # one tensor passed three times
        return self.head(h).mean(1)


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("case", ["attention_hhh", "attention_autocast", "encoder_dropout", "eval_attention",
                                  "embedding", "frozen_projection", "gradient_over_the_unit"])
def test_remat_gives_the_bits_of_the_run_without_it_where_the_forward_used_to_differ(case, stage):
    """Found in review; each differed before (the first four silently, by up to 8.6e-3 in a
    param after two steps; the last raised):
    - `attn(h, h, h)`: the recompute got three separate tensors, so `query is key` failed and
      the attention took its other projection; a tensor passed twice is now one input
      (`_Plan.index`), in fp32 and under CPU bf16 autocast (whose casts made without grad also
      took other products);
    - a `TransformerEncoderLayer`'s dropouts: under `torch.func.vjp` the replayed dropout of a
      strided activation drew its mask in another layout; outside transforms the recompute now
      runs under torch's autograd, as the run without checkpointing does;
    - an attention in eval mode: its fast path runs only without grad, and remat's forward ran
      without grad; it now runs in grad mode, its graph dropped;
    - an `Embedding` unit's token ids (and a bool mask): `requires_grad` on them raised in
      backward; only floating-point inputs are differentiated now;
    - a frozen weight (the attention's input projection): the recompute differentiated it, so
      it required grad there and matmul took another product than the forward's; only inputs
      that need a gradient are differentiated now (found in a third review);
    - a gradient taken over the checkpointed unit inside the forward (`_Penalised` around the
      unit's home, its linear, with `create_graph=True`): the second derivative through the
      recompute was lost; a backward with `create_graph=True` now recomputes on the saved
      tensors and keeps the graph of its gradients (found in that review).
    Stage `stage` with remat gives stage 0's bits without remat, N = 2, two steps."""
    d = 8
    mesh = fzero.SimMesh(2)

    def run(stage, remat):
        torch.manual_seed(0)
        model = _RematCase(case, d)
        which = ["emb"] if case == "embedding" else ["b"]
        params, apply, info = fzero.from_module(model, units=lambda p: p.split(".")[0], remat=which if remat else False)
        if case == "eval_attention":
            apply.eval()

        def loss(p, b):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "attention_autocast"):
                out = apply(p, b[0])
            return torch.nn.functional.cross_entropy(out.float(), b[1])

        def rank_fn():
            state = fzero.init(params, fzero.optim.adamw(1e-2), stage=stage, mesh=mesh, units=info.units)
            step = fzero.train_step(loss)
            losses = []
            for t in range(2):
                g = torch.Generator().manual_seed(10 * t + mesh.rank)
                x = torch.randint(0, 11, (2, 5), generator=g) if case == "embedding" else torch.randn(2, 5, d, generator=g)
                state, m = step(state, (x, torch.randint(0, 3, (2,), generator=g)))
                losses.append(m.loss)
            return fzero.gather(state), losses

        return mesh.run(rank_fn)

    for (p0, l0), (ps, ls) in zip(run(0, False), run(stage, True)):
        assert all(map(torch.equal, l0, ls)) and all(torch.equal(p0[k], ps[k]) for k in p0)



class _PreNormResidual(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.ln, self.fc = torch.nn.LayerNorm(d), torch.nn.Linear(d, d)

    def forward(self, h):
        return h + self.fc(torch.relu(self.ln(h)))  # reads its input twice


class _SkipAround(torch.nn.Module):
    """A skip connection around a checkpointed pre-norm residual block (`blk` reads its input twice,
    the model reads it once more after `blk`): the input's gradient has three contributions."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp = torch.nn.Linear(d, d)
        self.blk = _PreNormResidual(d)
        self.head = torch.nn.Linear(d, 4)

    def forward(self, x):
        h = self.inp(x)
        return self.head(self.blk(h) + h)


class _EncoderDecoder(torch.nn.Module):
    """A pre-norm encoder layer (`blk`) whose input, the embedding, the decoder layer reads too."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.emb = torch.nn.Embedding(20, d)
        self.blk = torch.nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0, batch_first=True, norm_first=True,
                                                    activation="gelu")
        self.dec = torch.nn.TransformerDecoderLayer(d, 2, 32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(d, 20)

    def forward(self, x):
        e = self.emb(x)
        memory = self.blk(e, src_key_padding_mask=(x == 0))
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        return self.head(self.dec(e, memory, tgt_mask=mask, tgt_is_causal=True)).flatten(0, 1)


class _ReturnsItsInput(torch.nn.Module):
    """`blk` reads its input twice and returns it as it is beside its output (found in review of
    the change below: splitting that input's gradient lost the part its returned output carries)."""

    class Blk(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

        def forward(self, h):
            return self.b(torch.tanh(self.a(h))) + h, h

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp, self.blk, self.head = torch.nn.Linear(d, d), self.Blk(d), torch.nn.Linear(d, 4)

    def forward(self, x):
        y, same = self.blk(self.inp(x))
        return self.head(y * same)


class _Statistics(torch.nn.Module):
    """`blk` normalises its input and returns the statistics, two outputs of one `var_mean` node
    that reads it (found in that review: the node, reached from both outputs, was counted twice)."""

    class Blk(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.w, self.b = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.zeros(d))

        def forward(self, h):
            var, mean = torch.var_mean(h, dim=-1, keepdim=True)
            return (h - mean) / torch.sqrt(var + 1e-5) * self.w + self.b, mean, var

    def __init__(self, d: int = 16):
        super().__init__()
        self.inp, self.blk = torch.nn.Linear(d, d), self.Blk(d)
        self.body, self.head = torch.nn.Linear(d, d), torch.nn.Linear(d, 4)

    def forward(self, x):
        z, mean, var = self.blk(self.inp(x))
        return self.head(self.body(z) * torch.sqrt(var + 1e-5) + mean)


_G = torch.Generator().manual_seed(3)
_TOKENS = torch.randint(1, 20, (4, 6), generator=_G)
_TOKENS[:, 0] = 0  # padding
_SKIP_CASES = {"skip_around_a_residual_block": (_SkipAround, (torch.randn(8, 16, generator=_G),
                                                              torch.randint(0, 4, (8,), generator=_G))),
               "encoder_input_read_by_the_decoder": (_EncoderDecoder, (_TOKENS, torch.randint(0, 20, (24,),
                                                                                              generator=_G))),
               "input_returned_as_it_is": (_ReturnsItsInput, (torch.randn(8, 16, generator=_G),
                                                              torch.randint(0, 4, (8,), generator=_G))),
               "statistics_of_one_node_returned": (_Statistics, (torch.randn(8, 16, generator=_G),
                                                                 torch.randint(0, 4, (8,), generator=_G)))}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("case", list(_SKIP_CASES))
def test_an_input_read_inside_and_outside_a_checkpointed_unit_gets_torchs_gradient_bits(case, stage):
    """Autograd adds an input's gradient contributions into one buffer, one at a time, as their
    ops' backwards run. A checkpointed unit's recompute summed its own contributions first, so
    where the model reads the input outside the unit too (a skip around a pre-norm block, which
    reads its input twice; an encoder's input the decoder reads) the sum was `c_out + (c_1 + c_2)`
    against torch's `(c_out + c_1) + c_2`: other bits at every stage (found in review, 3e-8 after
    three AdamW steps; 1.5e-4 in the encoder's attention bias). `_Remat` now takes such an input
    once per read and returns each read's contribution in its own slot. The review of that change
    found two cases it broke, now kept whole: an input the unit also returns as it is (its part
    from that output reaches it through no read), and two outputs of one node (`var_mean`), whose
    read was counted twice. SGD, N = 1, against torch on the module (no checkpointing), params
    bit for bit."""
    model_fn, batch = _SKIP_CASES[case]
    got, want, _, _ = _sgd_against_torch(model_fn, _ce, batch, stage, remat=["blk"], steps=3)
    _assert_same(got, want)


# -- what a checkpointed unit's forward may change (found in review) ---------------------------


def _sgd_against_torch(model_fn, loss_m, batch, stage, remat, units_prefix="", steps=2, **fm):
    """`steps` SGD steps of fzero on SimMesh(1) at `stage` against `torch.optim.SGD(foreach=False)`
    on the module itself: (fzero's params, torch's, fzero's buffers, torch's). N = 1: the reduced
    gradient is the local one, so every leaf's bits are torch's where the forward is."""
    torch.manual_seed(0)
    model, ref = model_fn(), model_fn()
    ref.load_state_dict(model.state_dict())
    params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, units_prefix), remat=remat, **fm)
    mesh = fzero.SimMesh(1)

    def rank_fn():
        state = fzero.init(params, fzero.optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units,
                           groups=info.groups)
        step = fzero.train_step(lambda p, b: loss_m(lambda *a, **k: apply(p, *a, **k), b))
        for _ in range(steps):
            state, _ = step(state, batch)
        return fzero.gather(state)

    got = mesh.run(rank_fn)[0]
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, foreach=False)
    for _ in range(steps):
        opt.zero_grad()
        loss_m(ref, batch).backward()
        opt.step()
    return got, dict(ref.named_parameters()), info.buffers, dict(ref.named_buffers())


def _assert_same(got, want):
    for k, v in got.items():
        assert torch.equal(v, want[k].detach()), k


class _BatchNormBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU())
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.block(x))


class _SpectralBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.utils.parametrizations.spectral_norm(torch.nn.Linear(4, 8))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.block(x)))


_XY = (torch.randn(6, 4, generator=torch.Generator().manual_seed(5)), torch.tensor([0, 1, 2, 0, 1, 2]))


def _ce(m, b):
    return torch.nn.functional.cross_entropy(m(b[0]), b[1])


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("model_fn", [_BatchNormBlock, _SpectralBlock], ids=["batchnorm", "spectral_norm"])
def test_a_checkpointed_units_buffer_updates_happen_once(stage, model_fn):
    """The recompute ran the forward's in-place buffer updates a second time: BatchNorm's running
    statistics moved twice a step (`num_batches_tracked` 2 after one step) and spectral_norm's
    power iteration started its recompute from the `u` the forward had already advanced, so the
    params differed too (found in review). The recompute now starts from the buffers as the
    forward found them and leaves them as the forward left them: params and buffers are the
    torch module's, bit for bit. (batch_norm writes its running statistics without bumping their
    version, so every buffer of the unit is kept, not only those whose version moved.)"""
    got, want, buffers, want_buffers = _sgd_against_torch(model_fn, _ce, _XY, stage, remat=True)
    _assert_same(got, want)
    _assert_same(buffers, want_buffers)


@pytest.mark.parametrize("stage", [0, 3])
def test_a_checkpointed_unit_given_a_kv_cache_is_refused_and_without_one_equals_torch(stage):
    """transformers' GPT-2 hands each block its `DynamicCache` where `use_cache=True` (its
    default); the recompute appended the keys a second time and the gradients were another
    function's (0.04 off after two steps, found in review). A non-tensor argument that is not a
    constant or a callable is now refused, naming the unit; with `use_cache=False` (what
    transformers passes under gradient checkpointing) the step equals the module's."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=32, n_positions=8, resid_pdrop=0.0,
                                     embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    x = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    make = functools.partial(transformers.GPT2LMHeadModel, config)
    with pytest.raises(fzero.ConfigError, match=r"checkpointed unit 'transformer.h.0' .* got args\[1\] of type "
                                                r"DynamicCache.*use_cache=False"):
        _sgd_against_torch(make, lambda m, b: m(b, labels=b).loss, x, stage, remat=True, units_prefix="transformer.h")
    got, want, _, _ = _sgd_against_torch(make, lambda m, b: m(b, labels=b, use_cache=False).loss, x, stage,
                                         remat=True, units_prefix="transformer.h")
    _assert_same(got, want)


class _Attention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(4, 2, batch_first=True)
        self.head = torch.nn.Linear(4, 3)

    def forward(self, x):
        out, weights = self.attn(x, x, x, need_weights=False)
        assert weights is None
        return self.head(out.mean(1))


@pytest.mark.parametrize("stage", [0, 3])
def test_a_checkpointed_unit_may_return_none_beside_tensors(stage):
    """`nn.MultiheadAttention(need_weights=False)` returns `(out, None)`: remat raised a TypeError
    naming no unit (found in review). Non-tensor outputs are now the forward's constants."""
    xy = (torch.randn(2, 5, 4, generator=torch.Generator().manual_seed(2)), torch.tensor([0, 2]))
    got, want, _, _ = _sgd_against_torch(_Attention, _ce, xy, stage, remat=True)
    _assert_same(got, want)


class _InPlace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        # two layers: the unit's home is the Sequential (the deepest submodule holding its params)
        self.block = torch.nn.Sequential(torch.nn.ReLU(inplace=True), torch.nn.Linear(4, 4), torch.nn.Linear(4, 3))

    def forward(self, x):
        return self.block(self.first(x))


def test_a_checkpointed_unit_writing_its_input_in_place_is_refused():
    """`ReLU(inplace=True)` first in a checkpointed unit writes the activation it was given: the
    recompute would start from the written values (it failed there with torch's leaf-view error,
    found in review). Refused when the forward returns, naming the unit; without remat it trains."""
    with pytest.raises(fzero.ConfigError, match=r"checkpointed unit 'block' .* wrote its input float32\[6, 4\] in "
                                                r"place"):
        _sgd_against_torch(_InPlace, _ce, _XY, 0, remat=True)
    got, want, _, _ = _sgd_against_torch(_InPlace, _ce, _XY, 0, remat=False)
    _assert_same(got, want)


class _TorchCheckpointed(torch.nn.Module):
    """Block `b` run through `torch.utils.checkpoint` (non-reentrant), as a migrating script does;
    `remat=True` calls it directly, for `from_module(remat={"b"})`."""

    def __init__(self, remat=False):
        super().__init__()
        self.a, self.b = (torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4)) for _ in range(2))
        self.remat = remat

    def forward(self, x):
        h = self.a(x)
        return (self.b(h) if self.remat else torch.utils.checkpoint.checkpoint(self.b, h, use_reentrant=False)).sum()


@pytest.mark.parametrize("gather", ["on_use", "eager"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_torch_utils_checkpoint_in_a_from_module_forward_is_refused_naming_remat(stage, gather):
    """Its recompute runs in backward, after `apply` returned, over the meta stand-ins of
    from_module's copy: a `ConfigError` naming the parameter and `remat` (before: torch's "Tensor
    on device meta is not on the expected device cpu!", found in review; bad-input row 247). The
    way out it names, `from_module(remat={"b"})` with `b` called directly, trains, with the bits of
    the run without checkpointing."""
    def run(model, remat):
        torch.manual_seed(0)
        params, apply, info = fzero.from_module(model, units=lambda path: path.split(".")[0],
                                                 remat=remat)
        mesh = fzero.SimMesh(2)

        def rank():
            state = fzero.init(params, fzero.optim.sgd(0.1), mesh=mesh, stage=stage, units=info.units)
            step = fzero.train_step(lambda p, x: apply(p, x), gather=gather)
            return fzero.gather(step(state, torch.ones(2, 4) * (1 + mesh.rank))[0])
        return mesh.run(rank)

    torch.manual_seed(1)
    with pytest.raises(fzero.ConfigError, match=r"parameter 'b\.0\.weight' \(float32\[4\]\) was used \(layer_norm\) "
                                                r"in backward, after from_module's apply returned.*torch\.utils\."
                                                r"checkpoint.*from_module\(model, remat=\[\.\.\.\]\)"):
        run(_TorchCheckpointed(), None)
    torch.manual_seed(1)
    model = _TorchCheckpointed(remat=True)
    with_remat, without = run(model, {"b"}), run(model, None)
    assert all(torch.equal(with_remat[0][k], without[0][k]) for k in without[0])


def test_a_backward_hook_reading_its_modules_parameter_is_refused_naming_the_hook():
    """A module backward hook reading `m.weight.device` ran after `apply` returned, over the meta
    stand-in (it got `meta` and no grad, found in review): the same `ConfigError` as row 247's,
    whose words name the hook too. A hook reading the gradients it is given trains."""
    def run(hook):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        model[1].register_full_backward_hook(hook)
        params, apply, _ = fzero.from_module(model)
        mesh = fzero.SimMesh(1)
        return mesh.run(lambda: fzero.train_step(lambda p, x: apply(p, x).sum())(
            fzero.init(params, fzero.optim.sgd(0.1), mesh=mesh, stage=3), torch.ones(2, 4))[1].loss)

    with pytest.raises(fzero.ConfigError, match=r"parameter '1\.weight' \(float32\[1, 4\]\) was used \(\.device\) in "
                                                r"backward.*or by a backward hook reading it from the module.*a "
                                                r"backward hook reads the gradients it is given"):
        run(lambda m, grad_in, grad_out: m.weight.device)
    seen = []
    run(lambda m, grad_in, grad_out: seen.append(grad_out[0].shape))
    assert seen == [torch.Size([2, 1])]


def test_torch_utils_checkpoint_under_the_func_engine_is_told_about_remat():
    """Under `engine="func"` torch refuses the checkpoint's saved-tensor hooks inside
    `torch.func.grad` with its own words (found in review: they name neither the checkpoint nor
    fzero's way out); fzero adds a note naming `remat`, which trains under that engine."""
    torch.manual_seed(0)
    params, apply, info = fzero.from_module(_TorchCheckpointed(), units=lambda path: path.split(".")[0])
    mesh = fzero.SimMesh(1)

    def rank():
        state = fzero.init(params, fzero.optim.sgd(0.1), mesh=mesh, stage=0, units=info.units)
        with pytest.raises(RuntimeError, match="saved tensor hooks") as e:
            fzero.train_step(lambda p, x: apply(p, x), engine="func")(state, torch.ones(2, 4))
        return getattr(e.value, "__notes__", [])

    notes = mesh.run(rank)[0]
    assert any("torch.utils.checkpoint in the forward?" in n and "from_module(model, remat=[...])" in n for n in notes)


class _OldSpectral(torch.nn.Module):
    """`l1` under old-style `nn.utils.spectral_norm` (a forward pre-hook computes `weight` from
    `weight_orig`), or under the parametrization, which computes it inside the forward."""

    def __init__(self, parametrized=False):
        super().__init__()
        norm = torch.nn.utils.parametrizations.spectral_norm if parametrized else torch.nn.utils.spectral_norm
        self.l1 = norm(torch.nn.Linear(4, 8))
        self.head = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.l1(x)))


@pytest.mark.parametrize("stage", [0, 3])
def test_a_checkpointed_units_parameter_read_by_a_pre_hook_is_refused_naming_remat(stage):
    """Old-style `spectral_norm` reads `l1.weight_orig` in a forward pre-hook, before the
    checkpointed forward binds the unit: refused naming remat and the two ways that keep training
    (found in review: the words were those of a unit read on use, naming neither remat nor a way
    that keeps it; bad-input row 268). Without remat the module trains as torch; the
    parametrization trains under remat as torch, bit for bit."""
    with pytest.raises(fzero.ConfigError, match=r"'l1\.weight_orig' \(unit 'l1'\).* which is checkpointed "
                                                r"\(from_module\(remat=\.\.\.\)\).*Leave 'l1' out of remat.*"
                                                r"parametrizations\.spectral_norm"):
        _sgd_against_torch(_OldSpectral, _ce, _XY, stage, remat=True)
    _assert_same(*_sgd_against_torch(_OldSpectral, _ce, _XY, stage, remat=False)[:2])
    _assert_same(*_sgd_against_torch(functools.partial(_OldSpectral, True), _ce, _XY, stage, remat=True)[:2])


class _TwoInputs(torch.nn.Module):
    """One checkpointed unit given two inputs, one computed from the other outside it."""

    class Blk(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.ln, self.fc = torch.nn.LayerNorm(d), torch.nn.Linear(d, d)

        def forward(self, h, skip):
            return self.fc(self.ln(h)) + skip

    def __init__(self, d: int = 8):
        super().__init__()
        self.inp, self.blk, self.head = torch.nn.Linear(d, d), self.Blk(d), torch.nn.Linear(d, 3)

    def forward(self, x):
        h0 = self.inp(x)
        return self.head(self.blk(torch.tanh(h0), h0))


def _penalised(m, b):
    x = b[0].clone().requires_grad_()
    ce = torch.nn.functional.cross_entropy(m(x), b[1])
    g, = torch.autograd.grad(ce, x, create_graph=True)
    return ce + (g * g).sum()


@pytest.mark.parametrize("stage", [0, 3])
def test_a_gradient_penalty_over_a_unit_given_an_input_computed_from_another_gets_torchs_bits(stage):
    """A backward with `create_graph=True` (a gradient penalty in the loss) recomputes on the saved
    tensors themselves; it took the gradients with respect to them, so where one input is computed
    from another outside the unit (`blk(tanh(h0), h0)`), the path through the first counted again
    in the second's gradient: 0.007 off after one step (found in review). It now differentiates
    with respect to what the unit read. SGD, N = 1, one step, against torch."""
    batch = (torch.randn(6, 8, generator=torch.Generator().manual_seed(5)), torch.tensor([0, 1, 2, 0, 1, 2]))
    got, want, _, _ = _sgd_against_torch(_TwoInputs, _penalised, batch, stage, remat=["blk"], steps=1)
    _assert_same(got, want)


class _UnreadOutput(torch.nn.Module):
    """`blk` returns a second output the loss never reads, `sqrt` of its input where positive:
    finite, but `sqrt`'s derivative is NaN where the input is negative."""

    class Blk(torch.nn.Module):
        def __init__(self, d):
            super().__init__()
            self.a, self.b = torch.nn.Linear(d, d), torch.nn.Linear(d, d)

        def forward(self, h):
            return self.b(torch.tanh(self.a(h))) + h, torch.where(h > 0, h.sqrt(), 0.0)

    def __init__(self, d: int = 8):
        super().__init__()
        self.inp, self.blk, self.head = torch.nn.Linear(d, d), self.Blk(d), torch.nn.Linear(d, 3)

    def forward(self, x):
        y, _ = self.blk(self.inp(x))
        return self.head(y)


@pytest.mark.parametrize("engine", ["autograd", "func"])
@pytest.mark.parametrize("stage", [0, 3])
def test_an_output_the_loss_never_reads_runs_no_backward_as_without_remat(stage, engine):
    """The checkpointed unit's unread output got a zero gradient (the Function materialised it),
    and the recompute ran its branch's backward: zero times `sqrt`'s infinite derivative at 0 made
    the input's gradient NaN, where torch runs no backward there (found in review). Params equal
    the run without remat, bit for bit, in both engines."""
    xy = (torch.randn(6, 8, generator=torch.Generator().manual_seed(5)), torch.tensor([0, 1, 2, 0, 1, 2]))
    mesh = fzero.SimMesh(1)

    def run(remat):
        torch.manual_seed(0)
        model = _UnreadOutput()
        params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""), remat=remat)

        def rank_fn():
            state = fzero.init(params, fzero.optim.sgd(0.1), stage=stage, mesh=mesh, units=info.units)
            step = fzero.train_step(lambda p, b: _ce(lambda *a: apply(p, *a), b), engine=engine)
            for _ in range(2):
                state, _ = step(state, xy)
            return fzero.gather(state)

        return mesh.run(rank_fn)[0]

    want, got = run(False), run(["blk"])
    assert all(torch.isfinite(v).all() for v in got.values())
    _assert_same(got, want)


class _Counted(torch.nn.Module):
    """`blk`'s forward branches on a Python counter: its recompute takes the other branch."""

    class Blk(torch.nn.Module):
        def __init__(self, d):  # (two layers: the unit's home is this module, whose forward branches)
            super().__init__()
            self.a, self.b, self.n = torch.nn.Linear(d, d), torch.nn.Linear(d, d), 0

        def forward(self, h):
            self.n += 1
            y = self.b(torch.tanh(self.a(h)))
            return y + h * h if self.n % 2 else y * 3 + h

    def __init__(self, d: int = 8):
        super().__init__()
        self.inp, self.blk, self.head = torch.nn.Linear(d, d), self.Blk(d), torch.nn.Linear(d, 3)

    def forward(self, x):
        return self.head(self.blk(self.inp(x)))


def test_a_recompute_that_reads_its_input_another_number_of_times_is_refused():
    """A forward that runs other ops when recomputed (a Python counter) trained another function's
    gradients, silently (0.05 off after three steps, found in review; `torch.utils.checkpoint`
    raises there): the recompute counts the reads of each input and refuses another count, naming
    the unit (bad-input row 271). A recompute that runs other ops with the same reads is not caught.
    Without remat the module trains as torch."""
    with pytest.raises(fzero.ConfigError, match=r"checkpointed unit 'blk' .*recompute in backward read one of its "
                                                r"inputs 2 time\(s\) where its forward read it 3 time\(s\).*leave "
                                                r"'blk' out of remat"):
        _sgd_against_torch(_Counted, _ce, _XY8, 0, remat=["blk"], steps=1)
    _assert_same(*_sgd_against_torch(_Counted, _ce, _XY8, 0, remat=False, steps=3)[:2])


_XY8 = (torch.randn(6, 8, generator=torch.Generator().manual_seed(5)), torch.tensor([0, 1, 2, 0, 1, 2]))
