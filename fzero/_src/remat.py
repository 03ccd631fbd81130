"""Activation checkpointing of one unit: keep its inputs, recompute its forward in backward.

`remat_call(forward, params, args, kwargs)` computes `forward(params, *args, **kwargs)` (a
unit's submodule, with its parameters bound) through one autograd Function, `_Remat`, that

- in forward (outside torch.func transforms run by `remat_call` before the Function is applied,
  counting how many times the unit reads each input: `_run_counting_uses`) runs `forward` in
  grad mode (some ops choose their kernel by grad mode or by
  whether an operand requires grad), its graph dropped when it returns, and saves
  only its inputs: the distinct tensors among `args` / `kwargs` (activations; one passed twice,
  as in `attn(h, h, h)`, is one input, the same object at both places in the recompute) and
  `params` (the unit's leaves: views of its gathered storage, which the step frees after the
  forward and gathers again when backward unpacks them; the Function keeps no activation of its
  own);
- in backward unpacks them (in stage 3: one re-gather of the unit, which then serves both the
  recompute and the unit's own backward), puts back the random-number state the forward
  started from (CPU generator, and the CUDA generator of every CUDA device among the inputs),
  recomputes `forward` under the autocast settings of the forward (as `torch.utils.checkpoint`
  does: backward runs outside the loss's `torch.autocast` block) and takes the gradients of its
  floating-point inputs that need one: by torch's autograd outside torch.func transforms, as the run without
  checkpointing does, each read's contribution to an input in a slot of its own (`_each_use`), by
  `torch.func.vjp` inside one; and restores the generators it found.

The recompute runs the same ops on the same values with the same random numbers, so its
outputs, and the vjp's gradients, are the bits of the run without checkpointing
(proofs/stage3.md, section 6). `torch.func.vjp` composes with `torch.func` transforms, so
`train_step(..., engine="func")` works too, where `torch.utils.checkpoint` does not compose.

Under transforms around that backward (a derivative through a step, a gradient penalty taken
with `create_graph=True` in a func-engine step) the recompute runs on the saved tensors
themselves, so the gradients it returns depend on them at every outer level (`detach()` under
torch.func detaches at every level: the derivative through a step was silently wrong, found in
review). Forward mode (`jvp`, a forward-over-reverse HVP through a step) recomputes the forward
under `torch.func.jvp` with the same replays; `vmap` (a vmapped forward reading a checkpointed
unit) checkpoints the vmapped forward: one Function whose forward and recompute are
`torch.func.vmap` of the unit's, so its ops are those of the run without checkpointing.

Shapes: `args` / `kwargs` a pytree of tensors and constants; `params` `{name: tensor}`; the
output a pytree of tensors (what `forward` returns), each output of `_Remat` one leaf.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from .collectives import func_level
from .errors import ConfigError


class RngState(NamedTuple):
    """The generator states a forward starts from: `cpu` (`torch.get_rng_state()`) and, per CUDA
    device index among its inputs, `torch.cuda.get_rng_state(device)`."""

    cpu: torch.Tensor
    cuda: tuple[tuple[int, torch.Tensor], ...]

    @staticmethod
    def now(tensors: list[torch.Tensor]) -> "RngState":
        devices = sorted({t.device.index or 0 for t in tensors if t.device.type == "cuda"})
        return RngState(torch.get_rng_state(), tuple((d, torch.cuda.get_rng_state(d)) for d in devices))

    def put(self) -> None:
        torch.set_rng_state(self.cpu)
        for d, state in self.cuda:
            torch.cuda.set_rng_state(state, d)


@dataclasses.dataclass(frozen=True)
class Autocast:
    """The autocast settings a forward runs under: per device type (CPU, and CUDA where an input
    is on CUDA) whether autocast is on and its dtype, and whether its cast cache is on."""

    devices: tuple[tuple[str, bool, torch.dtype], ...]
    cache: bool

    @staticmethod
    def now(tensors: list[torch.Tensor]) -> "Autocast":
        types = ["cpu"] + (["cuda"] if any(t.device.type == "cuda" for t in tensors) else [])
        return Autocast(tuple((d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d)) for d in types),
                        torch.is_autocast_cache_enabled())

    def context(self) -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        for device, enabled, dtype in self.devices:
            stack.enter_context(torch.autocast(device, dtype=dtype, enabled=enabled, cache_enabled=self.cache))
        return stack


TENSOR = object()  # in `_Plan.consts`: a tensor goes here (not None, which an argument may be)


@dataclasses.dataclass(eq=False)
class _Plan:
    """The static half of one checkpointed call: how to rebuild `(params, args, kwargs)` from
    the Function's tensor inputs, and the output's structure (set by the forward). Not a pytree
    node (a NamedTuple would be one), so `torch.func` passes it to the Function as it is."""

    forward: Callable[..., Any]
    names: tuple[str, ...]
    spec: Any  # the treespec of (args, kwargs) with tensors taken out
    consts: tuple[Any, ...]  # its non-tensor leaves, by position (`TENSOR` where a tensor goes)
    rng: RngState
    autocast: Autocast
    out: list  # [output treespec, its non-tensor leaves by position (`TENSOR` where a tensor goes)], by the forward
    index: tuple[int, ...] = ()  # per position of `(*params, *arg tensors)`, its distinct tensor
    name: str = ""  # the unit's, for messages
    buffers: tuple[torch.Tensor, ...] = ()  # the home submodule's buffers, which its forward may write
    before: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # their values before the forward
    vmapped: tuple[tuple[tuple[int | None, ...], str], ...] = ()  # (in_dims, randomness) per vmap level, inner first
    extra: tuple[int, ...] = ()  # per extra input slot of `_Remat`, the distinct input it repeats (`_uses`)
    ran: tuple[torch.Tensor, ...] | None = None  # the outputs `remat_call` computed, for `_Remat.forward` to return
    reads: tuple[int, ...] = ()  # per distinct input, the edges of the forward's graph into it (`_run_counting_uses`)

    def call(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """`forward(params, *args, **kwargs)` from the distinct tensors the Function takes (one
        per distinct object among `(*params, *arg tensors)`: a tensor passed twice, as in
        `attn(h, h, h)`, is the same object at both places again, which a module may test),
        as a flat tuple of output tensors; under `torch.func.vmap` of each level in `vmapped`
        (`_Remat.vmap`), the innermost first, each output's batch dimension first."""
        fn = self._call
        for in_dims, randomness in self.vmapped:
            fn = _vmapped(fn, in_dims, randomness)
        return fn(*tensors)

    def _call(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        tensors = tuple(tensors[i] for i in self.index) if self.index else tensors
        k = len(self.names)
        params, rest = dict(zip(self.names, tensors[:k])), iter(tensors[k:])
        leaves = [next(rest) if c is TENSOR else c for c in self.consts]
        args, kwargs = tree_unflatten(leaves, self.spec)
        flat, spec = tree_flatten(self.forward(params, *args, **kwargs))
        if not self.out:  # non-tensor outputs (`nn.MultiheadAttention`'s None weights) are the forward's constants
            self.out.extend((spec, tuple(TENSOR if isinstance(t, torch.Tensor) else t for t in flat)))
        return tuple(t for t in flat if isinstance(t, torch.Tensor))

    def output(self, tensors: tuple[torch.Tensor, ...]) -> Any:
        """The forward's output from the Function's output tensors and its constants."""
        rest = iter(tensors)
        return tree_unflatten([next(rest) if c is TENSOR else c for c in self.out[1]], self.out[0])


def _vmapped(fn: Callable[..., tuple[torch.Tensor, ...]], in_dims: tuple[int | None, ...], randomness: str
             ) -> Callable[..., tuple[torch.Tensor, ...]]:
    return lambda *tensors: torch.func.vmap(fn, in_dims=in_dims, randomness=randomness)(*tensors)


def remat_call(forward: Callable[..., Any], params: Mapping[str, torch.Tensor], args: tuple, kwargs: dict,
               name: str = "", buffers: tuple[torch.Tensor, ...] = ()) -> Any:
    """`forward(params, *args, **kwargs)`, saving only its tensor inputs for backward (see the
    module docstring). Without grad mode on, a plain call (nothing to save). `name`: the unit's,
    for messages; `buffers`: the buffers the forward may write (its submodule's), put back as
    they were for the recompute and as the forward left them after it."""
    if not torch.is_grad_enabled():
        return forward(dict(params), *args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    consts = tuple(TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
    _check_constants(name, leaves, spec)
    names = tuple(params)
    inputs = [*(params[n] for n in names), *tensors]
    distinct = {id(t): t for t in inputs}
    index = tuple(list(distinct).index(id(t)) for t in inputs)
    plan = _Plan(forward, names, spec, consts, RngState.now(inputs), Autocast.now(inputs), [], index, name,
                 tuple(buffers))
    tensors = tuple(distinct.values())
    if func_level() is not None or torch.autograd.forward_ad._current_level >= 0:
        return plan.output(_Remat.apply(plan, *tensors))  # (the Function's forward runs the unit: `_Remat.forward`)
    counts = _run_counting_uses(plan, tensors)
    plan.extra = tuple(i for i, k in enumerate(counts) for _ in range(k - 1))
    return plan.output(_Remat.apply(plan, *tensors, *(tensors[i] for i in plan.extra)))


_CONSTANT_TYPES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.layout,
                   torch.memory_format, enum.Enum, type, slice, type(Ellipsis), range)


def _check_constants(name: str, leaves: list[Any], spec: Any) -> None:
    """The recompute calls the forward again with the same non-tensor arguments: one it may
    change (transformers' `DynamicCache`, which each attention block appends its keys to where
    `use_cache=True`) would be seen changed, and the gradients would be another function's
    (found in review: GPT-2 under remat was 0.04 off after 2 steps). Constants and callables
    (an activation function, a module) are taken; any other object is refused, naming it."""
    for i, x in enumerate(leaves):
        if not (isinstance(x, (torch.Tensor, *_CONSTANT_TYPES)) or callable(x)):
            paths, _ = tree_flatten_with_path(tree_unflatten(list(range(len(leaves))), spec))
            path = paths[i][0]
            where = ("args" if path[0].idx == 0 else "kwargs") + keystr(path[1:])
            raise ConfigError(
                f"checkpointed unit {name!r} (from_module(remat=...)) got {where} of type {type(x).__name__}, "
                f"which its forward may change: the recompute in backward would "
                f"read it changed (a KV cache: call the model with use_cache=False, as transformers does under "
                f"gradient checkpointing). Pass tensors and constants only, or leave the unit out of remat")


class _Remat(torch.autograd.Function):
    @staticmethod
    def forward(plan: _Plan, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The forward in grad mode, its graph dropped when it returns: some ops choose their
        kernel by grad mode or by whether an operand requires grad (a cast autocast makes, an
        eval-mode attention's fast path), so a forward without grad could take other kernels than
        the run without checkpointing, and than the recompute (found in review: remat against no
        remat differed under autocast and in eval mode). Until it returns the graph holds what the
        unit's ops save, as the recompute in backward does (a module may also differentiate
        inside its forward, a gradient penalty)."""
        if plan.ran is not None:  # run by `remat_call` (`_run_counting_uses`); an int: that input, returned
            outs, plan.ran = plan.ran, None
            return tuple(tensors[t].view_as(tensors[t]) if isinstance(t, int) else t for t in outs)
        given = {id(t) for t in tensors}  # an input returned as it is (a module returning its param):
        # returned as a view, which autograd takes from a Function that saves its inputs (the same values)
        outs = _run_forward(plan, tensors)
        return tuple(t.view_as(t) if id(t) in given else t.detach() for t in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.plan = inputs[0]
        distinct = inputs[1:len(inputs) - len(ctx.plan.extra)]  # (the extra slots repeat some of them)
        ctx.save_for_backward(*distinct)
        if torch.autograd.forward_ad._current_level >= 0:  # forward mode: `jvp` reads the inputs (only
            ctx.save_for_forward(*distinct)  # there: a plain reference, which would keep stage 3's unit gathered)
        ctx.set_materialize_grads(False)  # (an output the loss never reads gets no gradient, and its branch no
        # backward, as without remat; found in review: zeros through an unread `sqrt` of it made NaN)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        tensors = ctx.saved_tensors  # stage 3: unpacking the params gathers the unit again, once
        plan: _Plan = ctx.plan
        second = torch.is_grad_enabled()  # backward with create_graph=True: a second derivative follows
        with _replayed(plan, tensors):
            got = _recomputed_grads(plan, tensors, grads, ctx.needs_input_grad[1:len(tensors) + 1], second)
        return (None, *got)  # (None for every input that needs no gradient)

    @staticmethod
    def jvp(ctx: Any, _plan: Any, *tangents: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """The outputs' tangents: the forward recomputed under `torch.func.jvp` with the replays
        of backward (forward mode through a checkpointed unit: `torch.func.jvp` of a step, a
        forward-over-reverse HVP; before, torch's "You must implement the jvp function"). Under a
        plain `forward_ad.dual_level` (no torch.func level) `ConfigError`: torch cannot nest
        `torch.func.jvp` there, and a recompute on dual tensors lost the tangent's own reverse
        derivative (0.004 off after two steps of a loss reading a tangent)."""
        if func_level() is None:  # forward_ad.dual_level: no torch.func.jvp inside it
            raise ConfigError(
                f"checkpointed unit {ctx.plan.name!r} (from_module(remat=...)) ran under "
                f"torch.autograd.forward_ad.dual_level: remat computes a unit's tangents by recomputing it under "
                f"torch.func.jvp, which torch cannot nest inside a dual level. Take forward-mode derivatives with "
                f"torch.func.jvp / jacfwd (which work through checkpointed units), or leave the unit out of remat")
        tensors = ctx.saved_tensors
        with _replayed(ctx.plan, tensors):
            return _recomputed_tangents(ctx.plan, tensors, tangents)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, plan: _Plan, *tensors: torch.Tensor) -> tuple:
        """A checkpointed unit under `torch.func.vmap` (a vmapped forward reading it): one
        Function around the vmapped forward, whose forward and recompute are `torch.func.vmap` of
        the unit's (`_Plan.vmapped`), so that its ops, and its gradients' bits, are those of the
        vmapped forward without checkpointing (a vmap of the Function's own backward, which
        `generate_vmap_rule` makes, gave other bits: up to 5.6e-17 off in float64,
        tests/test_remat_through_step.py). Each output's batch dimension comes first."""
        dims = in_dims[1:]
        if all(d is None for d in dims):
            outs = _Remat.apply(plan, *tensors)
            return outs, (None,) * len(outs)
        outs = _Remat.apply(dataclasses.replace(plan, vmapped=(*plan.vmapped, (dims, info.randomness))), *tensors)
        return outs, (0,) * len(outs)


@contextlib.contextmanager
def _replayed(plan: _Plan, tensors: tuple[torch.Tensor, ...]) -> Iterator[None]:
    """The forward's state for a recompute (backward's, or forward mode's): the generators put
    to where the forward started (then back to what was found), the unit's buffers to what the
    forward read (then back to what it left: a running statistic is updated once, as without
    remat), and grad mode on under the forward's autocast settings."""
    found = RngState.now(list(tensors))
    plan.rng.put()
    written = {i: plan.buffers[i].clone() for i in plan.before}  # as the forward left them
    try:  # through `.data`, which moves no version counter: a graph that saved a buffer (batch_norm's running
        # statistics, saved for its double backward, which its own in-place kernel writes without a bump) would
        # find it written, where the run without remat does not (found in review: a recompute inside the
        # forward, an input gradient, was torch's "modified by an inplace operation")
        for i, before in plan.before.items():
            plan.buffers[i].data.copy_(before)
        with torch.enable_grad(), plan.autocast.context():
            yield
    finally:
        found.put()
        for i, after in written.items():
            plan.buffers[i].data.copy_(after)


def _check_inputs_unwritten(plan: _Plan, tensors: tuple[torch.Tensor, ...], versions: list[int]) -> None:
    """A forward that writes an activation it was given in place (`x.mul_(2)`, a leading
    `ReLU(inplace=True)`) leaves the saved input changed: the recompute would start from the
    written values (found in review: it failed inside the recompute with torch's leaf-view
    error). Refused when the forward returns, naming the unit. (A write to the unit's params is
    the loss's, refused where it returns: bad-input row 47.)"""
    params = {plan.index[k] if plan.index else k for k in range(len(plan.names))}
    for i, (t, v) in enumerate(zip(tensors, versions)):
        if i not in params and t._version != v:
            raise ConfigError(f"checkpointed unit {plan.name!r} (from_module(remat=...)) wrote its input "
                              f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} in place in its forward: the "
                              f"recompute in backward would read the written values. Write a new tensor "
                              f"(x = x * 2; ReLU(inplace=False)), or leave the unit out of remat")


def _recomputed_grads(plan: _Plan, tensors: tuple[torch.Tensor, ...], grads: tuple[torch.Tensor, ...],
                      needs: tuple[bool, ...], second: bool = False) -> list[torch.Tensor | None]:
    """The gradients of the distinct `tensors` (the saved inputs) from the recomputed forward and
    the outputs' `grads`: only the floating-point and complex inputs that `needs` a gradient are
    differentiated; the others (token ids and bool masks, on which `requires_grad` raised before;
    frozen leaves and activations that require no grad, which torch's ops must see so, as the
    run without checkpointing has them: found in review) enter requiring none. Outside torch.func transforms by torch's
    autograd, as the run without checkpointing computes them (under `torch.func.vjp` a dropout of
    a strided activation drew its mask in another layout than the forward's: found in review),
    each input differentiated through a view of it, not a leaf (autocast caches its casts of a
    leaf that requires grad, so a weight used twice was cast once and its gradients summed in
    bf16, where the run without checkpointing, whose params are no leaves, casts it twice);
    inside one by `torch.func.vjp` of the saved tensors themselves (`_with`: not detached, so
    the transforms around this one differentiate through these gradients). `second` (a backward with
    `create_graph=True`, as a gradient penalty over the unit takes): the recompute runs on the
    saved tensors themselves and its gradients keep their graph, so that the second derivative
    reaches the inputs (found in review: it was lost, other gradients than without remat)."""
    wanted = [i for i, t in enumerate(tensors) if (t.is_floating_point() or t.is_complex()) and needs[i]]
    got: list[torch.Tensor | None] = [None] * len(tensors)
    extra: list[torch.Tensor | None] = [None] * len(plan.extra)
    if not wanted:
        return [*got, *extra]
    if func_level() is None:
        inputs = [t.detach() for t in tensors]
        for i in wanted:
            inputs[i] = tensors[i] if second else inputs[i].requires_grad_()
        used = list(inputs)
        for i in wanted:  # differentiated through a view: not a leaf, whose casts autocast would cache
            used[i] = inputs[i].view_as(inputs[i])  # (the run without remat has none)
        floor = _sequence_now()
        outs = plan.call(tuple(used))
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad and g is not None]
        if pairs:
            reads = _uses(outs, {(used[i].grad_fn, 0): i for i in wanted}, floor)
            _check_same_reads(plan, reads)
            # (with respect to the views the unit read: under `second` the inputs are the saved tensors
            # themselves, and one computed from another outside the unit counted that path twice; found in
            # review, a gradient penalty 0.007 off)
            with _each_use({i: reads[i] for i in set(plan.extra) if i in reads}) as parts:
                found = torch.autograd.grad([o for o, _ in pairs], [used[i] for i in wanted],
                                            [g for _, g in pairs], allow_unused=True, create_graph=second)
            for i, g in zip(wanted, found):
                got[i] = g
            _spread(plan, got, extra, parts)
        return [*got, *extra]

    given = [k for k, g in enumerate(grads) if g is not None]  # (the outputs the loss read)
    if not given:
        return [*got, *extra]
    fn = _with(plan, tensors, wanted)
    _, vjp = torch.func.vjp(lambda *ds: tuple(fn(*ds)[k] for k in given), *(tensors[i] for i in wanted))
    for i, g in zip(wanted, vjp(tuple(grads[k] for k in given))):
        got[i] = g
    return [*got, *extra]


def _check_same_reads(plan: _Plan, found: dict[int, list[tuple[Any, int]]]) -> None:
    """`ConfigError` where the recompute's graph reads an input another number of times (`found`,
    `_uses`) than the forward's did (`plan.reads`): the forward ran other ops the second time (a
    Python counter, a `random.random()` branch), so the gradients would be another function's
    (found in review: 0.05 off, silently, where `torch.utils.checkpoint` raises). A recompute that
    runs other ops with the same reads is not caught here."""
    for i, reads in found.items():
        if plan.reads and len(reads) != plan.reads[i]:
            raise ConfigError(
                f"checkpointed unit {plan.name!r} (from_module(remat=...)): its recompute in backward read one of its "
                f"inputs {len(reads)} time(s) where its forward read it {plan.reads[i]} time(s), so the recompute ran "
                f"other ops than the forward. A checkpointed unit's forward must compute the same ops each time it is "
                f"called (its random numbers and autocast state are replayed; a Python counter, random.random() or "
                f"other state is not). Make the forward depend on its inputs only, or leave {plan.name!r} out of remat")


def _run_counting_uses(plan: _Plan, tensors: tuple[torch.Tensor, ...]) -> list[int]:
    """`_Remat.forward`'s work, done before the Function is applied (outside torch.func transforms
    and forward mode): run the forward in grad mode on the inputs themselves, keep its outputs
    (detached) in `plan.ran`, and return, per distinct input, how many times the unit's ops read
    it: the edges of the forward's graph into the input's gradient edge (`_uses`; at least 1).

    Why: autograd sums an input's gradient contributions one at a time, in the order their ops'
    backwards run, into one buffer, together with the contributions of the ops outside the unit
    that read it too (a skip connection around a checkpointed block). The recompute's
    `torch.autograd.grad` adds the unit's contributions up by themselves first, so a checkpointed
    block whose input the unit reads twice (a pre-norm residual block: the norm and the
    residual) and the model reads again outside (`head(blk(h) + h)`) summed `c_out + (c_1 + c_2)`
    where the run without remat sums `(c_out + c_1) + c_2`: other bits (found in review, 3e-8
    after three steps, and 1.5e-4 in an encoder's attention bias). So `_Remat` takes such an
    input once per read, and its backward returns each read's contribution in its own slot, in
    the order the recompute's backward made them (`_each_use`): the engine then adds them one by
    one where the run without remat does."""
    wanted = [i for i, t in enumerate(tensors) if (t.is_floating_point() or t.is_complex()) and t.requires_grad]
    floor = _sequence_now()
    outs = _run_forward(plan, tensors)
    edges = _uses(outs, {_edge(tensors[i]): i for i in wanted}, floor)
    given = {id(t): i for i, t in enumerate(tensors)}  # an input returned as it is: `_Remat.forward` views it
    plan.ran = tuple(given[id(t)] if id(t) in given else t.detach() for t in outs)
    returned = {t for t in plan.ran if isinstance(t, int)}  # (its gradient from that output reaches it through no
    # read: kept whole, one slot; found in review, split it lost that part)
    counts = [1] * len(tensors)
    plan.reads = tuple(len(edges.get(i, ())) for i in range(len(tensors)))  # (`_check_same_reads`)
    for i, reads in edges.items():
        counts[i] = 1 if i in returned else max(1, len(reads))
    return counts


def _run_forward(plan: _Plan, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """The unit's forward in grad mode on `tensors`, its outputs (graph attached), after keeping
    every buffer as the forward found it (`_replayed` puts them back for the recompute: some
    kernels write one without bumping its version, batch_norm's running statistics, and comparing
    values would wait for the device); an input the forward wrote in place is refused
    (`_check_inputs_unwritten`)."""
    versions = [t._version for t in tensors]
    plan.before.update({i: b.clone() for i, b in enumerate(plan.buffers)})
    with torch.enable_grad():
        outs = plan.call(tensors)
    _check_inputs_unwritten(plan, tensors, versions)
    return outs


_PROBE = torch.empty(0, requires_grad=True)


def _sequence_now() -> int:
    """The sequence number the next autograd node made on this thread will get (at least): the
    nodes of a forward run after this call have numbers from here on."""
    return _PROBE.view_as(_PROBE).grad_fn._sequence_nr() + 1


def _edge(t: torch.Tensor) -> tuple[Any, int]:
    edge = torch.autograd.graph.get_gradient_edge(t)
    return edge.node, edge.output_nr


def _uses(outs: tuple[torch.Tensor, ...], targets: dict[tuple[Any, int], int], floor: int = 0
          ) -> dict[int, list[tuple[Any, int]]]:
    """Per target input (`targets`: its gradient edge -> its index), the `(node, k)` whose k-th
    next edge is that input's, over the graph of `outs` (nodes numbered from `floor` on: those
    made before the unit ran are outside it, and not walked)."""
    found: dict[int, list[tuple[Any, int]]] = {i: [] for i in targets.values()}
    if not targets:
        return found
    stack = list(dict.fromkeys(o.grad_fn for o in outs if o.grad_fn is not None))  # (a node two outputs share,
    # `var_mean`'s, `chunk`'s, once: found in review, its read was counted twice)
    seen = set(stack)
    while stack:
        node = stack.pop()
        for k, (nxt, nr) in enumerate(node.next_functions):
            if nxt is None:
                continue
            i = targets.get((nxt, nr))
            if i is not None:
                found[i].append((node, k))
            elif nxt not in seen and nxt._sequence_nr() >= floor and nxt.next_functions:
                seen.add(nxt)
                stack.append(nxt)
    return found


@contextlib.contextmanager
def _each_use(found: dict[int, list[tuple[Any, int]]]) -> Iterator[dict[int, list[torch.Tensor | None]]]:
    """Within: each input's gradient contributions, one per read (`found`: its reading nodes and
    edges, `_uses`), recorded in the order the backward run inside makes them (a hook on each
    reading node, after it ran)."""
    parts: dict[int, list[torch.Tensor | None]] = {i: [] for i in found}
    by_node: dict[Any, list[tuple[int, int]]] = {}
    for i, reads in found.items():
        for node, k in reads:
            by_node.setdefault(node, []).append((k, i))
    handles = []
    for node, ks in by_node.items():
        ks.sort()

        def record(grad_inputs: tuple, _grad_outputs: tuple, ks: list[tuple[int, int]] = ks) -> None:
            for k, i in ks:
                parts[i].append(grad_inputs[k])

        handles.append(node.register_hook(record))
    try:
        yield parts
    finally:
        for h in handles:
            h.remove()


def _spread(plan: _Plan, got: list, extra: list, parts: dict[int, list[torch.Tensor | None]]) -> None:
    """Each split input's contributions into its slots (`got[i]` the first, then its places in
    `extra`, in order; fewer where a reading node ran no backward, `_check_same_reads` having
    refused a recompute that reads more); where none ran, `got[i]` stays as it is."""
    for i, contributions in parts.items():
        places = [k for k, j in enumerate(plan.extra) if j == i]
        if not contributions:
            continue
        slots = [*contributions, *[None] * (1 + len(places) - len(contributions))]
        got[i] = slots[0]
        for k, c in zip(places, slots[1:]):
            extra[k] = c


def _with(plan: _Plan, tensors: tuple[torch.Tensor, ...], at: list[int]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """`plan.call` as a function of the tensors at positions `at`, the others the saved
    `tensors` themselves: for `torch.func.vjp` / `jvp` inside a transform. Not detached:
    `detach()` under torch.func detaches at every level, so the outer transforms (a derivative
    through the step, taken by `torch.func.grad` around it) would see the recompute, and so the
    gradients this backward returns, as constant in the saved params and activations (found in
    review: a meta-gradient through a step was 0.1-0.26 off on values of about 1, and a gradient
    penalty over a checkpointed unit in a func-engine step 0.03 off after one step). An input that needs no
    gradient at this level may still need one at an outer level (a batch the outer transform
    differentiates)."""
    def of(*ds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ts = list(tensors)
        for i, d in zip(at, ds):
            ts[i] = d
        return plan.call(tuple(ts))

    return of


def _recomputed_tangents(plan: _Plan, tensors: tuple[torch.Tensor, ...], tangents: tuple[torch.Tensor | None, ...]
                         ) -> tuple[torch.Tensor, ...]:
    """The outputs' tangents from the recomputed forward: `torch.func.jvp` over the floating-point
    and complex inputs that carry a tangent, the others as they are (`_with`)."""
    moving = [i for i, (t, d) in enumerate(zip(tensors, tangents))
              if d is not None and (t.is_floating_point() or t.is_complex())]
    _, out = torch.func.jvp(_with(plan, tensors, moving), tuple(tensors[i] for i in moving),
                            tuple(tangents[i] for i in moving))
    return tuple(out)
