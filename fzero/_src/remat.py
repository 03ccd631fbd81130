"""Activation checkpointing of one unit: keep its inputs, recompute its forward in backward.

`remat_call(forward, params, args, kwargs)` computes `forward(params, *args, **kwargs)` (a
unit's submodule, with its parameters bound) through one autograd Function, `_Remat`, that

- in forward runs `forward` in grad mode (some ops choose their kernel by grad mode or by
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
  checkpointing does, by `torch.func.vjp` inside one; and restores the generators it found.

The recompute runs the same ops on the same values with the same random numbers, so its
outputs, and the vjp's gradients, are the bits of the run without checkpointing
(proofs/stage3.md, section 6). `torch.func.vjp` composes with `torch.func` transforms, so
`train_step(..., engine="func")` works too, where `torch.utils.checkpoint` does not compose.

Shapes: `args` / `kwargs` a pytree of tensors and constants; `params` `{name: tensor}`; the
output a pytree of tensors (what `forward` returns), each output of `_Remat` one leaf.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .collectives import func_level


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
    out: list  # [output treespec], filled by the forward
    index: tuple[int, ...] = ()  # per position of `(*params, *arg tensors)`, its distinct tensor

    def call(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """`forward(params, *args, **kwargs)` from the distinct tensors the Function takes (one
        per distinct object among `(*params, *arg tensors)`: a tensor passed twice, as in
        `attn(h, h, h)`, is the same object at both places again, which a module may test),
        as a flat tuple of output tensors."""
        tensors = tuple(tensors[i] for i in self.index) if self.index else tensors
        k = len(self.names)
        params, rest = dict(zip(self.names, tensors[:k])), iter(tensors[k:])
        leaves = [next(rest) if c is TENSOR else c for c in self.consts]
        args, kwargs = tree_unflatten(leaves, self.spec)
        flat, spec = tree_flatten(self.forward(params, *args, **kwargs))
        if not self.out:
            self.out.append(spec)
        if not all(isinstance(t, torch.Tensor) for t in flat):
            raise TypeError(f"a checkpointed unit must return tensors only (a pytree of them); got "
                            f"{[type(t).__name__ for t in flat]}")
        return tuple(flat)


def remat_call(forward: Callable[..., Any], params: Mapping[str, torch.Tensor], args: tuple, kwargs: dict) -> Any:
    """`forward(params, *args, **kwargs)`, saving only its tensor inputs for backward (see the
    module docstring). Without grad mode on, a plain call (nothing to save)."""
    if not torch.is_grad_enabled():
        return forward(dict(params), *args, **kwargs)
    leaves, spec = tree_flatten((args, kwargs))
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    consts = tuple(TENSOR if isinstance(x, torch.Tensor) else x for x in leaves)
    names = tuple(params)
    inputs = [*(params[n] for n in names), *tensors]
    distinct = {id(t): t for t in inputs}
    index = tuple(list(distinct).index(id(t)) for t in inputs)
    plan = _Plan(forward, names, spec, consts, RngState.now(inputs), Autocast.now(inputs), [], index)
    outs = _Remat.apply(plan, *distinct.values())
    return tree_unflatten(list(outs), plan.out[0])


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
        given = {id(t) for t in tensors}  # an input returned as it is (a module returning its param):
        # returned as a view, which autograd takes from a Function that saves its inputs (the same values)
        with torch.enable_grad():
            outs = plan.call(tensors)
        return tuple(t.view_as(t) if id(t) in given else t.detach() for t in outs)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.plan = inputs[0]
        ctx.save_for_backward(*inputs[1:])
        ctx.set_materialize_grads(True)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        tensors = ctx.saved_tensors  # stage 3: unpacking the params gathers the unit again, once
        plan: _Plan = ctx.plan
        found = RngState.now(list(tensors))
        plan.rng.put()
        second = torch.is_grad_enabled()  # backward with create_graph=True: a second derivative follows
        try:
            with torch.enable_grad(), plan.autocast.context():
                got = _recomputed_grads(plan, tensors, grads, ctx.needs_input_grad[1:], second)
        finally:
            found.put()
        return (None, *got)  # (None for every input that needs no gradient)


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
    inside one by `torch.func.vjp`, which composes with it. `second` (a backward with
    `create_graph=True`, as a gradient penalty over the unit takes): the recompute runs on the
    saved tensors themselves and its gradients keep their graph, so that the second derivative
    reaches the inputs (found in review: it was lost, other gradients than without remat)."""
    wanted = [i for i, t in enumerate(tensors) if (t.is_floating_point() or t.is_complex()) and needs[i]]
    inputs = [t.detach() for t in tensors]
    got: list[torch.Tensor | None] = [None] * len(tensors)
    if not wanted:
        return got
    if func_level() is None:
        for i in wanted:
            inputs[i] = tensors[i] if second else inputs[i].requires_grad_()
        used = list(inputs)
        for i in wanted:  # differentiated through a view: not a leaf, whose casts autocast would cache
            used[i] = inputs[i].view_as(inputs[i])  # (the run without remat has none)
        outs = plan.call(tuple(used))
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        if pairs:
            found = torch.autograd.grad([o for o, _ in pairs], [inputs[i] for i in wanted], [g for _, g in pairs],
                                        allow_unused=True, create_graph=second)
            for i, g in zip(wanted, found):
                got[i] = g
        return got

    def of(*ds: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ts = list(inputs)
        for i, d in zip(wanted, ds):
            ts[i] = d
        return plan.call(tuple(ts))

    _, vjp = torch.func.vjp(of, *(inputs[i] for i in wanted))
    for i, g in zip(wanted, vjp(tuple(grads))):
        got[i] = g
    return got
