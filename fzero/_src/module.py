"""nn.Module interop: a module -> `(params, apply, info)` for `fzero.init` / `fzero.train_step`.

`from_module(model)` returns

- `params`: `{name: tensor}`, one leaf per *distinct* parameter (the first name
  `named_parameters()` gives it), detached (sharing storage with `model`; fzero.init copies);
- `apply(params, *args, **kwargs)`: `model(*args, **kwargs)` computed with `params`, through
  `torch.func.functional_call` over a parameter-free skeleton (a copy of `model` whose
  parameters are `meta` placeholders). Every alias of a tied parameter is bound to the same
  tensor (`named_parameters(remove_duplicate=False)`), so tied weights stay tied and their
  gradient is the sum over all uses, added locally before any reduction (as DDP does);
- `info`: a `ModuleInfo` with the alias table, the live buffers, the suggested `units` and
  `groups` (a frozen `ParamGroup` for `requires_grad=False` parameters).

Buffers (BatchNorm running stats, ...) are per-rank state kept in the skeleton: `apply` passes
them to `functional_call` by identity, so a training-mode forward updates them in place, exactly
as `model(x)` would. A rank's buffers are updated from its own batches only. torch DDP
(`broadcast_buffers=True`) instead copies rank 0's buffers to every rank before each forward;
call `broadcast_buffers(info, mesh)` before each step to get exactly that (tested bitwise
against DDP in tests/test_ddp.py). Without it, rank 0's buffers still equal DDP's rank 0
buffers bit for bit (rank 0's chain of updates is the same), so evaluate or save from rank 0.
Buffer updates happen in plain Python inside the forward: use `engine="autograd"` for models
that update buffers (functorch rejects in-place writes to captured tensors).
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable, Collection
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.nn.utils._named_member_accessor import NamedMemberAccessor  # what functional_call swaps with

from .collectives import broadcast
from .errors import ConfigError, FzeroError, LayoutError
from .layout import DEFAULT_UNIT, ParamGroup, UnitSpec, _unit_of
from .gathering import LazyParams
from .mesh import Mesh
from .remat import remat_call


class ModuleInfo(NamedTuple):
    """What `from_module` learned about a module.

    Attributes:
      aliases: `{params name: (every name the module uses for it, that name first)}`.
      buffers: `{buffer name: the skeleton's live buffer tensor}` (updated in place by `apply`).
      units: the `units` to pass to `fzero.init` (the `from_module` argument, or None).
      groups: the `groups` to pass to `fzero.init`: `ParamGroup("frozen", frozen=True)` over the
        `requires_grad=False` parameters, if any.
      frozen: names of the `requires_grad=False` parameters.
    """

    aliases: dict[str, tuple[str, ...]]
    buffers: dict[str, torch.Tensor]
    units: UnitSpec
    groups: tuple[ParamGroup, ...]
    frozen: tuple[str, ...]


class _FrozenNames:
    """A picklable, comparable `path -> bool` for the frozen ParamGroup."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = frozenset(names)

    def __call__(self, path: str) -> bool:
        return path in self.names

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _FrozenNames) and other.names == self.names

    def __hash__(self) -> int:
        return hash(self.names)

    def __repr__(self) -> str:
        return f"frozen_names({sorted(self.names)})"


def from_module(module: nn.Module, *, units: UnitSpec = None, remat: bool | Collection[str] = False
                ) -> tuple[dict[str, torch.Tensor], Callable, ModuleInfo]:
    """`module -> (params, apply, info)`; see the module docstring.

    Args:
      module: any `nn.Module` (its parameters are read, never modified).
      units: as for `fzero.init` (`None`, `path -> unit name`, or `{unit: predicate}`); e.g.
        `fzero.units_by_prefix(model, "transformer.h")` for one unit per block. Checked here:
        the parameters of one unit must share one device and one dtype.
      remat: activation checkpointing per unit: `True` (every unit that has a home submodule,
        i.e. all but the root's), or the names of the units to checkpoint (False: none). Where
        `apply` reads units on use (`train_step`'s default), a checkpointed unit's submodule
        keeps only its inputs for backward and runs again there, with the random-number state
        of its first run: the same bits (`fzero._src.remat`, proofs/stage3.md). With a plain
        params dict (`gather="eager"`, `fzero.gather`) `apply` computes the same values without
        checkpointing.

    Returns:
      `params` `{name: Tensor}` (distinct parameters, module order), `apply(params, *args,
      **kwargs) -> module(*args, **kwargs)`, and a `ModuleInfo`.

    Example:
      >>> import torch.nn.functional as F
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
      >>> params, apply, info = fzero.from_module(model, units=fzero.units_by_prefix(model, ""))
      >>> sorted(params), info.units("2.weight")
      (['0.bias', '0.weight', '2.bias', '2.weight'], '2')
      >>> mesh, opt = fzero.SimMesh(2), fzero.optim.adamw(1e-3)
      >>> loss_fn = lambda p, batch: F.cross_entropy(apply(p, batch[0]), batch[1])
      >>> def rank(batch):
      ...     state = fzero.init(params, opt, stage=3, mesh=mesh, units=info.units, groups=info.groups)
      ...     return fzero.train_step(loss_fn)(state, batch)[1].step
      >>> mesh.run(rank, [((torch.ones(3, 4), torch.zeros(3, dtype=torch.long)),)] * 2)
      [0, 0]
    """
    if not isinstance(module, nn.Module):
        raise FzeroError(f"from_module expects an nn.Module, got {type(module).__name__}")
    canonical: dict[int, str] = {}
    aliases: dict[str, list[str]] = {}
    params: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        first = canonical.setdefault(id(p), name)
        aliases.setdefault(first, []).append(name)
        if first == name:  # a frozen parameter stays an nn.Parameter(requires_grad=False): init freezes it
            params[name] = p.detach() if p.requires_grad else nn.Parameter(p.detach(), requires_grad=False)
    frozen = tuple(n for n, p in module.named_parameters() if not p.requires_grad)
    _check_units(params, units)
    remat_units = _remat_units(module, aliases, units, remat)
    placeholders = {id(p): nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), p.requires_grad)
                    for p in module.parameters()}
    skeleton = copy.deepcopy(module, memo=dict(placeholders))  # shared params stay shared placeholders
    buffers = dict(skeleton.named_buffers(remove_duplicate=False))
    alias_table = {k: tuple(v) for k, v in aliases.items()}
    expected = set(params)
    per_thread = threading.local()

    def apply(params: dict[str, torch.Tensor] | LazyParams, *args: Any, **kwargs: Any) -> Any:
        """`module(*args, **kwargs)` with `params` (one tensor per distinct parameter) bound.

        With `LazyParams` (`train_step(..., gather="on_use")`), each unit is read, and so
        gathered, in a forward pre-hook of its home submodule (the deepest one holding all its
        parameters) and unbound after that submodule's forward; units at the root are read first.
        """
        if isinstance(params, LazyParams) and set(params) == expected:
            # gathers run inside this forward, and SimMesh switches ranks at collectives: each rank
            # (thread) binds into its own copy of the skeleton; buffers stay shared, as in eager mode
            if not hasattr(per_thread, "skeleton"):
                per_thread.skeleton = copy.deepcopy(skeleton, memo={id(b): b for b in buffers.values()})
            return _apply_on_use(per_thread.skeleton, buffers, alias_table, params, args, kwargs, remat_units)
        if not isinstance(params, dict) or set(params) != expected:
            got = set(params) if isinstance(params, dict) else set()
            missing, extra = sorted(expected - got), sorted(got - expected)
            raise FzeroError(f"apply needs exactly the params from_module returned; missing {missing[:5]}, "
                             f"unexpected {extra[:5]}")
        bound: dict[str, torch.Tensor] = dict(buffers)
        for name, names in alias_table.items():
            t = params[name]
            if t.is_meta:
                raise FzeroError(f"param {name!r} is a meta tensor; apply needs real values")
            for alias in names:
                bound[alias] = t
        # strict: every parameter and buffer name of the skeleton is bound, so no meta tensor is left
        return torch.func.functional_call(skeleton, bound, args, kwargs, tie_weights=False, strict=True)

    groups = (ParamGroup("frozen", _FrozenNames(frozen), frozen=True),) if frozen else ()
    return params, apply, ModuleInfo(alias_table, buffers, units, groups, frozen)


def _home(names: list[str]) -> str:
    """The deepest submodule path that holds every parameter name in `names` ("" = the root)."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*parts):
        if any(p != level[0] for p in level):
            break
        common.append(level[0])
    return ".".join(common)


def _runs_forward(module: nn.Module) -> bool:
    """False for containers (ModuleList, ModuleDict) whose forward is never called."""
    return type(module).forward is not nn.Module.forward


def _apply_on_use(skeleton: nn.Module, buffers: dict, aliases: dict, params: LazyParams, args: tuple,
                  kwargs: dict, remat: frozenset[str] = frozenset()) -> Any:
    """`skeleton(*args, **kwargs)` binding each unit's parameters when its home submodule runs;
    the submodule of a unit in `remat` runs through `remat_call` instead (its parameters bound
    only inside it: the forward, and the recompute in backward)."""
    by_unit: dict[str, list[str]] = {}
    for name in aliases:
        by_unit.setdefault(params.unit_of(name), []).append(name)
    bound: dict[str, torch.Tensor] = dict(buffers)
    hooks, swapped, patched = [], [], []
    for unit, names in by_unit.items():
        home = _home([alias for name in names for alias in aliases[name]])
        if home and _runs_forward(skeleton.get_submodule(home)) is False:
            home = ""  # e.g. a weight tied across blocks: its home is the ModuleList, which never runs
        if not home:  # spread over the root: read now
            leaves = params.unit(unit)
            bound.update({alias: leaves[name] for name in names for alias in aliases[name]})
            continue
        module = skeleton.get_submodule(home)

        def pre(mod: nn.Module, _args: Any, unit: str = unit, names: list[str] = names, home: str = home) -> None:
            leaves = params.unit(unit)  # gathers the unit on its first read this step (again if released)
            rel = {alias[len(home) + 1 :]: leaves[name] for name in names for alias in aliases[name]}
            orig, _ = NamedMemberAccessor(mod).swap_tensors_dict(rel, allow_missing=False)
            swapped.append((mod, orig))

        def post(mod: nn.Module, _args: Any, _out: Any, unit: str = unit) -> None:
            done, orig = swapped.pop()
            NamedMemberAccessor(done).swap_tensors_dict(orig, allow_missing=False)
            params.release(unit)  # frees the gathered copy where the step allows; backward re-gathers

        if unit in remat:  # nn.Module reads `forward` before its hooks run: replace it for this call
            rel_names = {alias[len(home) + 1 :]: name for name in names for alias in aliases[name]}
            module.forward = functools.partial(_checkpointed, module, params, unit, rel_names)
            patched.append(module)
            continue
        hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        return torch.func.functional_call(skeleton, bound, args, kwargs, tie_weights=False, strict=False)
    finally:
        for h in hooks:
            h.remove()
        for mod in patched:
            del mod.forward
        while swapped:  # a forward that raised inside a unit: put the placeholders back
            mod, orig = swapped.pop()
            NamedMemberAccessor(mod).swap_tensors_dict(orig, allow_missing=False)


def _checkpointed(mod: nn.Module, params: LazyParams, unit: str, rel_names: dict[str, str], *args: Any,
                  **kwargs: Any) -> Any:
    """`mod`'s forward for a checkpointed unit: read the unit (gathering it), run the forward
    through `remat_call` with the unit's parameters `{relative alias: leaf}` bound inside it
    (each distinct leaf one input, so a leaf tied within the unit gets one gradient), release
    the unit."""
    leaves = params.unit(unit)

    def forward(bound: dict[str, torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        rel = {alias: bound[name] for alias, name in rel_names.items()}
        orig, _ = NamedMemberAccessor(mod).swap_tensors_dict(rel, allow_missing=False)
        try:
            return type(mod).forward(mod, *args, **kwargs)
        finally:
            NamedMemberAccessor(mod).swap_tensors_dict(orig, allow_missing=False)

    out = remat_call(forward, {name: leaves[name] for name in dict.fromkeys(rel_names.values())}, args, kwargs)
    params.release(unit)
    return out


def _remat_units(module: nn.Module, aliases: dict[str, list[str]], units: UnitSpec,
                 remat: bool | Collection[str]) -> frozenset[str]:
    """The units to checkpoint: `remat=True` -> every unit with a home submodule that runs a
    forward; names -> those, checked: each must be a unit, have such a home, and no other unit's
    home may lie inside it (its parameters would be read inside the checkpointed forward,
    where no graph is built)."""
    if remat is False or remat is None:
        return frozenset()
    unit_of = _unit_of(units)
    by_unit: dict[str, list[str]] = {}
    for name, names in aliases.items():
        by_unit.setdefault(unit_of(name), []).extend(names)
    homes = {}
    for unit, names in by_unit.items():
        home = _home(names)
        homes[unit] = home if home and _runs_forward(module.get_submodule(home)) else ""
    if remat is True:
        chosen = [u for u, h in homes.items() if h]
    elif isinstance(remat, str) or not isinstance(remat, Collection):
        raise ConfigError(f"remat must be True, False or a collection of unit names, got {remat!r}")
    else:
        chosen = list(remat)
    for unit in chosen:
        if unit not in homes:
            raise ConfigError(f"remat names unit {unit!r}, which is not a unit of this module; its units are "
                              f"{sorted(homes)[:8]} (pass units=... to from_module to define them)")
        if not homes[unit]:
            raise ConfigError(f"remat: unit {unit!r} has no home submodule that runs a forward (its parameters "
                              f"spread over the root or a container), so there is no forward to recompute; drop it "
                              f"from remat or give it its own submodule")
        inner = [u for u, h in homes.items() if u != unit and h.startswith(homes[unit] + ".")]
        if inner:
            raise ConfigError(f"remat: unit {unit!r} (submodule {homes[unit]!r}) holds the home of unit(s) {inner}, "
                              f"whose gathers would run inside the checkpointed forward; checkpoint the inner units "
                              f"instead, or make them one unit")
    return frozenset(chosen)


def _check_units(params: dict[str, torch.Tensor], units: UnitSpec) -> None:
    unit_of = _unit_of(units)
    seen: dict[str, tuple[str, torch.device, torch.dtype]] = {}
    for name, p in params.items():
        unit = unit_of(name)
        first = seen.setdefault(unit, (name, p.device, p.dtype))
        if (p.device, p.dtype) != first[1:]:
            raise LayoutError(
                f"unit {unit!r} mixes parameters on different devices or dtypes: {first[0]!r} is "
                f"{first[2]} on {first[1]}, {name!r} is {p.dtype} on {p.device}; move/cast the module "
                f"(e.g. model.to(device, dtype)) or put them in different units")


def units_by_prefix(module: nn.Module, prefix: str, rest: str = DEFAULT_UNIT) -> Callable[[str], str]:
    """One unit per child of the container `prefix` (e.g. "transformer.h"): `path -> unit name`.

    `"transformer.h.3.attn.c_attn.weight" -> "transformer.h.3"`; every other parameter goes to
    unit `rest` (embeddings, final norm, head).
    """
    try:
        container = module.get_submodule(prefix)
    except AttributeError as e:
        names = [n for n, _ in module.named_modules() if n][:10]
        raise FzeroError(f"units_by_prefix: the module has no submodule {prefix!r}; some it has: {names}") from e
    children = {f"{prefix}.{name}" if prefix else name for name, _ in container.named_children()}
    if not children:
        raise FzeroError(f"units_by_prefix: {prefix!r} ({type(container).__name__}) has no children")

    def unit(path: str) -> str:
        head = path.split(".")
        for k in range(len(head) - 1, 0, -1):  # the longest proper prefix that names a child
            cand = ".".join(head[:k])
            if cand in children:
                return cand
        return rest

    return unit


def broadcast_buffers(info: ModuleInfo, mesh: Mesh) -> None:
    """Copy rank 0's buffers into every rank's, in place (DDP's `broadcast_buffers=True`).

    Call on every rank, before the step whose forward should start from rank 0's buffers.
    """
    with torch.no_grad():
        for name, buf in info.buffers.items():
            buf.copy_(broadcast(buf, mesh, 0, tag=f"fzero.buffers/{name}"))
