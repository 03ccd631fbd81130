"""Worker functions for tests/test_ddp.py (and the models tests/test_module.py uses): fzero against
torch DDP on the same gloo group. The N = 2 bitwise comparison runs on fzero.testing's public
`ddp_trajectory`, `fzero_trajectory` and `trajectory_differences` (`fzero/testing/ddp.py`).

Each runs on every rank of a `fzero.testing.Pool` as `fn(mesh, *args)`; the test process draws
the batches and ships rank r its own.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import fzero
from fzero import broadcast_buffers, from_module, units_by_prefix
from fzero.testing import ddp_trajectory as ddp_trajectory_of
from fzero.testing import fzero_trajectory as fzero_trajectory_of
from fzero.testing import trajectory_differences

STAGES = (0, 1, 2, 3)


# --- models (tiny, deterministic from a seed) ------------------------------------------------

class MLP(nn.Module):
    """x[B, 8] -> logits[B, 4]; a BatchNorm gives it buffers, a frozen bias a frozen group, and
    `unused` gets no gradient on any rank (DDP leaves its grad None; AdamW must not decay it)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.GELU(), nn.Linear(16, 16), nn.GELU())
        self.head = nn.Linear(16, 4)
        self.head.bias.requires_grad_(False)
        self.unused = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class Encoder(nn.Module):
    """tokens[B, T] -> logits[B, T, 16] through a 2-layer nn.TransformerEncoder, head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 16)
        layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(16, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.emb(tokens)))


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


#: each model's container of blocks, for units_by_prefix (one unit per block)
PREFIXES = {"mlp": "body", "encoder": "layers.layers", "gpt2": "transformer.h"}


def build(name: str) -> tuple[nn.Module, str | None]:
    """`(model, prefix of its blocks for units_by_prefix)`, the same on every rank."""
    torch.manual_seed(0)
    if name == "mlp":
        return MLP(), PREFIXES[name]
    if name == "encoder":
        return Encoder(), PREFIXES[name]
    if name == "gpt2":
        return gpt2(), PREFIXES[name]
    raise ValueError(name)


def loss_of(name: str, out, batch) -> torch.Tensor:
    if name == "gpt2":
        return out.loss
    x, y = batch
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def forward(name: str, model_or_apply, batch, params=None):
    x, y = batch
    call = model_or_apply if params is None else (lambda *a, **k: model_or_apply(params, *a, **k))
    return call(x, labels=y) if name == "gpt2" else call(x)


def make_batches(name: str, n: int, steps: int, seed: int = 1) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """`batches[rank][step] = (x, y)`, drawn in the test process."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        rank = []
        for _ in range(steps):
            if name == "mlp":
                rank.append((torch.randn(6, 8, generator=g), torch.randint(0, 4, (6,), generator=g)))
            else:
                vocab = 64 if name == "gpt2" else 16
                x = torch.randint(0, vocab, (2, 8), generator=g)
                rank.append((x, x if name == "gpt2" else torch.randint(0, vocab, (2, 8), generator=g)))
        out.append(rank)
    return out


def optimizers(kind: str):
    """`(fzero optimizer, torch.optim factory)` with the same hyper-parameters."""
    if kind == "sgd":
        return (fzero.optim.sgd(0.1, momentum=0.9, weight_decay=0.01),
                lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False))
    if kind == "adamw":
        return (fzero.optim.adamw(1e-2, weight_decay=0.1),
                lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=False))
    raise ValueError(kind)


# --- N = 2: every stage bitwise equal to DDP ---------------------------------------------------

def model_of(name: str) -> nn.Module:
    """`build(name)`'s model: `make_model` for fzero.testing's trajectories."""
    return build(name)[0]


def loss_for(name: str):
    """`loss_fn(model, batch)` for fzero.testing's trajectories: the model's forward on the batch,
    then its loss."""
    return lambda model, batch: loss_of(name, forward(name, model, batch), batch)


def ddp_trajectory(mesh, name: str, kind: str, batches: list) -> list[dict[str, torch.Tensor]]:
    """DDP + torch.optim(foreach=False): params (and buffers) after every step on this rank
    (`fzero.testing.ddp_trajectory`; DDP's default broadcasts rank 0's buffers before every forward)."""
    _, make = optimizers(kind)
    return ddp_trajectory_of(mesh, functools.partial(model_of, name),
                             lambda model: make([p for p in model.parameters() if p.requires_grad]),
                             loss_for(name), batches, find_unused_parameters=name == "mlp")


def fzero_trajectory(mesh, name: str, kind: str, stage: int, batches: list) -> list[dict[str, torch.Tensor]]:
    """fzero at `stage`: the gathered params (and buffers) after every step on this rank
    (`fzero.testing.fzero_trajectory`, one unit per block of `build(name)`'s prefix)."""
    opt, _ = optimizers(kind)
    return fzero_trajectory_of(mesh, functools.partial(model_of, name), opt, loss_for(name), batches, stage=stage,
                               units=PREFIXES[name])


def compare_with_ddp(mesh, name: str, kinds: list[str], batches: list) -> dict[str, list[str]]:
    """`{"<kind> stage <s>": [first differences]}`; empty lists mean bitwise equal at every step
    (`fzero.testing.trajectory_differences`)."""
    report = {}
    for kind in kinds:
        ref = ddp_trajectory(mesh, name, kind, batches)
        for stage in STAGES:
            report[f"{kind} stage {stage}"] = trajectory_differences(ref, fzero_trajectory(mesh, name, kind, stage,
                                                                                           batches))
    return report


# --- N > 2: the reduced gradient within the summation bound; the optimizer bitwise -------------

class Recorder:
    """Wraps an fzero optimizer; keeps the reduced gradient `update` is given (per bucket)."""

    def __init__(self, inner) -> None:
        self.inner, self.grads = inner, []

    def optimizer(self):
        def update(grad, state, param, ctx):
            self.grads.append(grad.clone())
            return self.inner.update(grad, state, param, ctx)

        return fzero.optim.Optimizer(self.inner.init, update, self.inner.spec)


def one_step_bound(mesh, name: str, kind: str, batch) -> dict:
    """One step at stage 0 with a recording optimizer, against DDP's `p.grad` and the float64 sum
    of the float32 terms both add.

    Returns, per parameter, the max of |g − exact| / bound for fzero and for DDP (must be <= 1),
    and whether torch.optim stepped with fzero's reduced gradient gives fzero's params bitwise,
    for every stage. (Whether fzero's and DDP's reduced gradients are bitwise equal is not
    returned: at N > 2 the backend's order of the sum decides, and bitwise equality is not
    claimed, proofs/stages.md §3.)
    """
    n = mesh.world_size
    model, prefix = build(name)
    local = copy.deepcopy(model)
    ddp_model = copy.deepcopy(model)
    # this rank's terms x_r = fl(g_r·fl(1/N)), all-gathered: the float32 values fzero and DDP both
    # sum (the same float32 multiply by the Python float 1/N, proofs/stages.md §2.3; exact where N
    # is a power of two), summed here in float64
    loss_of(name, forward(name, local, batch), batch).backward()
    names = [k for k, p in local.named_parameters() if p.requires_grad and p.grad is not None]
    x_all = {k: fzero.collectives.all_gather((p.grad * (1.0 / n)).reshape(1, -1), mesh).double()
             for k, p in local.named_parameters() if k in names}  # [N, numel]
    exact = {k: x.sum(0) for k, x in x_all.items()}
    mag = {k: x.abs().sum(0) for k, x in x_all.items()}
    gamma = (n - 1) * 2.0**-24 / (1 - (n - 1) * 2.0**-24)
    gamma64 = (n - 1) * 2.0**-53 / (1 - (n - 1) * 2.0**-53)
    # float32 summation of the N terms in any order: |fl(Σ x_r) − Σ x_r| <= γ_{N−1}·Σ|x_r|
    # (Higham 4.3); the float64 reference is within γ'_{N−1}·Σ|x_r| of Σ x_r (2^-53). No
    # underflow term: the terms are the float32 values themselves, and a sum never rounds below
    # 2^-126. Where every x_r is 0 the bound is 0 and the sums must be 0 (`_ratio`).
    bound = {k: (gamma + gamma64) * m for k, m in mag.items()}

    ddp = DDP(ddp_model, find_unused_parameters=name == "mlp")
    loss_of(name, forward(name, ddp, batch), batch).backward()
    ddp_grad = {k: p.grad.detach().clone() for k, p in ddp_model.named_parameters() if k in names}

    fz_opt, make = optimizers(kind)
    results = {"ratio_fzero": {}, "ratio_ddp": {}, "optimizer_bitwise": {}}
    final = {}
    for stage in STAGES:
        m, _ = build(name)
        params, apply, info = from_module(m, units=units_by_prefix(m, prefix))
        rec = Recorder(fz_opt)
        opt = rec.optimizer()
        state = fzero.init(params, opt, stage=stage, mesh=mesh, units=info.units, groups=info.groups)
        step = fzero.train_step(lambda p, b: loss_of(name, forward(name, apply, b, p), b))
        state, _ = step(state, batch)
        final[stage] = fzero.gather(state)
        if stage == 0:
            trainable = [b for b in state.layout.buckets if not b.group.frozen]
            assert len(rec.grads) == len(trainable)
            flats = [torch.zeros(b.padded_numel, dtype=b.dtype) for b in state.layout.buckets]
            for b, g in zip(trainable, rec.grads):
                flats[b.index] = g
            fz_grad = fzero.layout.unpack(state.layout, flats)
            for k in names:
                ref = exact[k].reshape(fz_grad[k].shape)
                results["ratio_fzero"][k] = _ratio(fz_grad[k].double() - ref, bound[k].reshape(ref.shape))
                results["ratio_ddp"][k] = _ratio(ddp_grad[k].double() - ref, bound[k].reshape(ref.shape))
            # torch.optim on fzero's reduced gradient must give fzero's params bit for bit
            tm, _ = build(name)
            topt = make([p for p in tm.parameters() if p.requires_grad])
            for k, p in tm.named_parameters():
                p.grad = fz_grad[k].clone() if k in names else None
            topt.step()
            tparams = dict(tm.named_parameters())
            results["optimizer_bitwise"]["torch.optim"] = all(torch.equal(tparams[k].detach(), v)
                                                             for k, v in final[0].items())
        else:
            results["optimizer_bitwise"][f"stage {stage} = stage 0"] = all(
                torch.equal(final[0][k], v) for k, v in final[stage].items())
    return results


def _ratio(diff: torch.Tensor, bound: torch.Tensor) -> float:
    """max |diff| / bound over the elements: 0/0 (a bound of 0 met exactly) counts 0, x/0 inf."""
    return (diff.abs() / bound).nan_to_num(nan=0.0, posinf=float("inf")).max().item()


# --- bad input ---------------------------------------------------------------------------------

def init_with_size(mesh, size: int):
    """Each rank passes a leaf "w" of its own size: fzero.init must raise LayoutError everywhere."""
    return fzero.init({"v": torch.zeros(3), "w": torch.zeros(size)}, fzero.optim.sgd(0.1), stage=1, mesh=mesh)


def reject_on_one_rank(mesh, bad_rank: int):
    """The loss raises on `bad_rank` only: every rank must stop with an error (none hangs)."""
    model, prefix = build("mlp")
    params, apply, info = from_module(model)
    opt = fzero.optim.sgd(0.1)
    state = fzero.init(params, opt, stage=2, mesh=mesh, groups=info.groups)

    def loss_fn(p, batch):
        if mesh.rank == bad_rank:
            raise ValueError(f"rank {mesh.rank}: this batch has the wrong shape")
        x, y = batch
        return F.cross_entropy(apply(p, x), y)

    step = fzero.train_step(loss_fn)
    return step(state, (torch.randn(4, 8), torch.randint(0, 4, (4,))))


def rank_of(mesh):
    return mesh.rank


# --- accumulation: accumulate="once" against DDP's no_sync ------------------------------------

def _accum_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def compare_accumulation_with_ddp(mesh, kind: str, k: int, batches: list) -> dict[str, list[str]]:
    """DDP: per step, `no_sync()` for the first k - 1 micro-batches and `(loss / k).backward()` on
    each, then torch.optim; fzero: `train_step(micro_batches=k, accumulate="once")` at stages 0-1.
    `{"<kind> stage <s>": [first differences]}` (empty: bitwise equal after every step)."""
    import contextlib

    model = _accum_model()
    ddp = DDP(model)
    _, make = optimizers(kind)
    opt = make(list(model.parameters()))
    ref = []
    for step_batches in batches:
        opt.zero_grad(set_to_none=True)
        for i, (x, y) in enumerate(step_batches):
            with ddp.no_sync() if i < k - 1 else contextlib.nullcontext():
                (F.cross_entropy(ddp(x), y) / k).backward()
        opt.step()
        ref.append({n: p.detach().clone() for n, p in model.named_parameters()})
    report = {}
    for stage in (0, 1):
        params, apply, info = from_module(_accum_model())
        fopt, _ = optimizers(kind)
        state = fzero.init(params, fopt, stage=stage, mesh=mesh)
        step = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]), micro_batches=k, accumulate="once")
        diffs = []
        for t, step_batches in enumerate(batches):
            state, _ = step(state, step_batches)
            got = fzero.gather(state)
            diffs += [f"step {t}: {n} max |diff| {(ref[t][n] - got[n]).abs().max().item():.3g}"
                      for n in ref[t] if not torch.equal(ref[t][n], got[n])]
        report[f"{kind} stage {stage}"] = diffs[:6]
    return report


# --- clipping: fzero's clip_norm against DDP + clip_grad_norm_ -----------------------------------

def clipping_against_ddp(mesh, stage: int, max_norm: float, lr: float, batch) -> dict:
    """One SGD step (lr, no momentum) with global-norm clipping, DDP + `clip_grad_norm_` against
    fzero's `clip_norm`, from the same params. Returns, per parameter, the largest |difference|
    over the bound of tests/test_ddp.py::test_clipping_within_bound_of_ddp_clip_grad_norm (derived
    there), the two norms, their relative bounds, whether clipping was active, and how many
    elements of the reduced gradient are nonzero with |g| < 2^-63 (the bound's premise: none)."""
    x, y = batch
    model = _accum_model()
    ddp = DDP(model)
    F.cross_entropy(ddp(x), y).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    torch.optim.SGD(model.parameters(), lr=lr, foreach=False).step()
    ref = {n: p.detach().clone() for n, p in model.named_parameters()}

    params, apply, _ = from_module(_accum_model())
    state = fzero.init(params, fzero.optim.sgd(lr, impl="single"), stage=stage, mesh=mesh)
    step = fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0]), b[1]), clip_norm=max_norm)
    state, m = step(state, batch)
    got = fzero.gather(state)
    u = 2.0**-24
    gamma = lambda k: k * u / (1 - k * u)  # noqa: E731
    n_max, leaves = max(g.numel() for g in grads.values()), len(grads)
    eps_torch = gamma(n_max) + gamma(leaves) + 2 * u  # fp32 per-tensor norms, then the norm of the norms
    s_max = max(b.padded_numel for b in state.layout.buckets) // mesh.world_size
    eps_fzero = gamma(s_max + 1) + 2 * u  # fp32 norm per shard (proofs/stages.md §3), float64 over shards
    coef = min(1.0, max_norm / (float(m.grad_norm) + 1e-6))
    ratios = {}
    for n, g in grads.items():
        ulp = torch.finfo(torch.float32).eps * torch.maximum(ref[n].double().abs(), got[n].double().abs())
        bound = lr * g.double().abs() * coef * (eps_torch + eps_fzero + 10 * u) + ulp
        ratios[n] = _ratio(ref[n].double() - got[n].double(), bound)
    tiny = sum(int(((g != 0) & (g.abs() < 2.0**-63)).sum()) for g in grads.values())
    return {"ratios": ratios, "norm_fzero": float(m.grad_norm), "norm_torch": float(total), "active": coef < 1,
            "eps_torch": eps_torch, "eps_fzero": eps_fzero, "tiny": tiny}


# --- bf16: fzero's Precision(bf16, bf16) against DDP on a bf16 copy of the model ------------------

def bf16_reduction_against_ddp(mesh, batch) -> dict[str, bool]:
    """One step: DDP on a bf16 copy of the model (bf16 params, grads reduced in bf16) against fzero
    with fp32 master weights of the same (bf16-representable) values and
    `Precision(bfloat16, bfloat16)`. The same casts happen in both (the forward and the local
    gradient in bf16, `fl(grad · 1/N)` and the sum in bf16), so the reduced gradients are the same
    bits (N = 2); the updates then differ on purpose (fzero updates the fp32 master)."""
    x, y = batch
    m16 = _accum_model().to(torch.bfloat16)
    ddp = DDP(m16)
    F.cross_entropy(ddp(x.to(torch.bfloat16)).float(), y).backward()
    ddp_grad = {n: p.grad.float() for n, p in m16.named_parameters()}

    params, apply, _ = from_module(_accum_model().to(torch.bfloat16).float())
    rec = Recorder(fzero.optim.sgd(1.0))
    state = fzero.init(params, rec.optimizer(), stage=0, mesh=mesh,
                       precision=fzero.Precision(torch.bfloat16, torch.bfloat16))
    fzero.train_step(lambda p, b: F.cross_entropy(apply(p, b[0].to(torch.bfloat16)).float(), b[1]))(state, batch)
    (flat,) = rec.grads  # one bucket, stage 0: the whole reduced gradient, as the fp32 optimizer sees it
    got = fzero.layout.unpack(state.layout, [flat])
    return {n: bool(torch.equal(got[n], ddp_grad[n])) for n in ddp_grad}


# --- autocast: fzero (and cast_ahead) against DDP / the plain model ---------------------------

def autocast_trajectory(mesh, name: str, stage: int | None, cast_ahead: bool, batches: list
                        ) -> tuple[list[dict[str, torch.Tensor]], int]:
    """AdamW steps with the loss under CPU bf16 autocast: `(params after every step, leaves the
    step casts ahead)`; `stage=None` is torch: DDP where a process group of more than one rank
    runs, else the plain model."""
    model, prefix = build(name)

    def under_autocast(fn):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn()

    opt, make = optimizers("adamw")
    out = []
    if stage is None:
        ddp = DDP(model, find_unused_parameters=name == "mlp") if mesh.world_size > 1 else model
        torch_opt = make([p for p in model.parameters() if p.requires_grad])
        for batch in batches:
            torch_opt.zero_grad(set_to_none=True)
            under_autocast(lambda: loss_of(name, forward(name, ddp, batch), batch)).backward()
            torch_opt.step()
            out.append({k: v.detach().clone() for k, v in model.named_parameters()})
        return out, 0
    params, apply, info = from_module(model, units=units_by_prefix(model, prefix))
    del model
    state = fzero.init(params, opt, stage=stage, mesh=mesh, units=info.units, groups=info.groups)
    step = fzero.train_step(lambda p, b: under_autocast(lambda: loss_of(name, forward(name, apply, b, p), b)),
                            cast_ahead=cast_ahead, donate=True)
    for batch in batches:
        broadcast_buffers(info, mesh)
        state, _ = step(state, batch)
        out.append(dict(fzero.gather(state)))
    learned = step.config.ahead.of(state.info).learned if cast_ahead else None
    return out, learned.count if learned is not None else 0


def compare_autocast(mesh, name: str, runs: list[tuple[int, bool]], batches: list) -> dict[str, Any]:
    """`{"stage <s> cast <c>": [first differences from torch], "cast count stage <s> cast <c>": n}`
    for each `(stage, cast_ahead)` of `runs`."""
    ref, _ = autocast_trajectory(mesh, name, None, False, batches)
    report: dict[str, Any] = {}
    for stage, cast in runs:
        got, count = autocast_trajectory(mesh, name, stage, cast, batches)
        report[f"stage {stage} cast {cast}"] = [
            f"step {t}: {k} max |diff| {(a[k].double() - b[k].double()).abs().max().item():.3g}"
            for t, (a, b) in enumerate(zip(ref, got)) for k in a if not torch.equal(a[k], b[k])][:6]
        report[f"cast count stage {stage} cast {cast}"] = count
    return report


def ddp_scales_by_the_reciprocal(mesh) -> dict:
    """DDP's reduced gradient of one 64x64 weight (one bucket of 4096 elements) against the same
    all-reduce of `g * (1/N)` (the multiply by fl(1/N) fzero does, proofs/stages.md §2.3) and of
    `g / N`: whether each is bitwise DDP's, and in how many elements the two differ."""
    n = mesh.world_size
    torch.manual_seed(0)
    model = nn.Linear(64, 64, bias=False)
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 + mesh.rank))
    w = model.weight.detach().clone().requires_grad_()
    (x @ w.T).pow(2).sum().backward()
    ddp = DDP(model)
    ddp(x).pow(2).sum().backward()
    by_mul = fzero.collectives.all_reduce(w.grad * (1.0 / n), mesh)
    by_div = fzero.collectives.all_reduce(w.grad / n, mesh)
    got = model.weight.grad
    return {"mul": torch.equal(got, by_mul), "div": torch.equal(got, by_div), "apart": int((by_mul != by_div).sum())}
