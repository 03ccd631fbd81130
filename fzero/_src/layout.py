"""The static plan: a params pytree -> buckets -> flat buffers -> N contiguous shards.

Leaves are grouped into buckets by (unit, dtype, parameter group), in order of first
appearance. A bucket is one flat buffer `flat[N * S]`: its leaves back to back in flatten
order, then zero padding up to a multiple of `N * align` (at least one element per rank). The
buffer is cut into N equal contiguous shards `shard[S]`; rank r holds elements
`[r * S, (r + 1) * S)`. A leaf may straddle shard boundaries.

Every function here is pure: a `Layout` is plain frozen data, derived from shapes and dtypes
only, and `pack` / `unpack` / `shard` / `unshard` make new tensors (or views) without touching
their inputs.

The layout shards over one mesh axis, "shard". A replicate axis (HSDP, ZeRO++ hpZ) would use the
same layout unchanged on every replica, so `Layout.world_size` is the size of the shard axis.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any, Union

import einops
import optree
import torch

from .errors import LayoutError, as_int, outside_stacklevel, refusing_unknown_keywords, said
from .tree import NAMESPACE, flatten_with_paths, unflatten

DEFAULT_UNIT = "default"

UnitSpec = Union[None, Callable[[str], str], Mapping[str, Callable[[str], bool]]]


@refusing_unknown_keywords(lambda given, unknown: LayoutError(_unknown_settings(given.get("name", "default"), unknown)))
@dataclasses.dataclass(frozen=True)
class ParamGroup:
    """Per-leaf optimizer settings, chosen by a predicate on the leaf's dotted path.

    Attributes:
      name: shown in bucket tags and errors.
      match: a callable `path -> bool`, hashable (a function; a callable object of a hashable
        class, e.g. a frozen dataclass); `None` matches every leaf. The first group that matches
        wins, except that a frozen group wins wherever it stands.
      weight_decay: False masks weight decay off (torch: a param group with weight_decay=0; a 0
        given here is taken as False). The amount is the optimizer's.
      lr_scale: the group's learning rate is `fl(lr * lr_scale)`.
      frozen: no optimizer state, no gradient reduction (torch: `requires_grad=False`).
    """

    name: str = "default"
    match: Callable[[str], bool] | None = None
    weight_decay: bool = True
    lr_scale: float = 1.0
    frozen: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise LayoutError(f"ParamGroup name must be a str (it names the group's buckets), got "
                              f"{type(self.name).__name__} {self.name!r}")
        if self.match is not None and not callable(self.match):
            hint = (f"; e.g. match=lambda path: path == {self.match!r} (or fnmatch.fnmatch(path, {self.match!r}) for "
                    f"a glob)" if isinstance(self.match, str) else "")
            raise LayoutError(f"ParamGroup {self.name!r}: match must be None (every leaf) or a callable path -> bool, "
                              f"got {type(self.match).__name__} {self.match!r}{hint}")
        try:  # a group keys its buckets (`plan`), so it is hashed with its fields, `match` among them
            hash(self.match)
        except TypeError:  # found in review: a dataclass matcher (eq, not frozen) was torch's bare TypeError in plan
            raise LayoutError(f"ParamGroup {self.name!r}: match must be hashable (a group keys its buckets, so it is "
                              f"hashed with its fields), got {type_name(self.match)} {self.match!r}, which is not: "
                              f"make its class hashable (@dataclasses.dataclass(frozen=True)), or pass a function, "
                              f"e.g. match=lambda path: matcher(path)") from None
        wd = self.weight_decay
        if as_flag(wd) is not None:
            object.__setattr__(self, "weight_decay", as_flag(wd))
        elif isinstance(wd, (int, float)) and wd == 0:
            object.__setattr__(self, "weight_decay", False)  # torch's spelling of "no decay": weight_decay=0.0
        else:
            raise LayoutError(f"ParamGroup {self.name!r}: weight_decay must be a bool (whether the optimizer's weight "
                              f"decay applies to the group; 0 is taken as False), got {type(wd).__name__} {wd!r}; a "
                              f"group has no decay amount of its own: set it on the optimizer, e.g. "
                              f"fzero.optim.adamw(lr, weight_decay=0.01)")
        if as_flag(self.frozen) is None:
            raise LayoutError(f"ParamGroup {self.name!r}: frozen must be a bool, got {type_name(self.frozen)} "
                              f"{self.frozen!r}")
        object.__setattr__(self, "frozen", as_flag(self.frozen))
        scale = self.lr_scale
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):  # numpy's floats too
            raise LayoutError(f"ParamGroup {self.name!r}: lr_scale must be a Python float (finite, >= 0), got "
                              f"{type(scale).__name__} {scale!r}")
        try:
            scale = float(scale)
        except OverflowError:  # an int beyond float's range
            scale = math.inf
        if not math.isfinite(scale) or scale < 0:
            raise LayoutError(f"ParamGroup {self.name!r}: lr_scale must be finite and >= 0, got {scale}")
        object.__setattr__(self, "lr_scale", scale)  # a float, as group_lr's product with the lr


def _unknown_settings(name: Any, unknown: dict[str, Any]) -> str:
    """`ParamGroup`'s words for keywords it has no field for: what a group can set, and, for
    torch's per-group `lr`, the `lr_scale` that gives it."""
    keys = ", ".join(repr(k) for k in unknown)
    lr = unknown.get("lr")
    scale = (f"; for lr={lr!r}: lr_scale={lr!r} / the optimizer's lr (fzero.optim.adamw(base_lr) then gives "
             f"the group fl(base_lr * lr_scale), under a schedule fl(lr(t) * lr_scale): the whole schedule scaled, "
             f"a floor too, where torch's per-group eta_min or min_lr is not)" if "lr" in unknown else "")
    return (f"ParamGroup {name!r} got {keys}, which a group does not set: a ParamGroup sets only whether the "
            f"optimizer's weight decay applies (weight_decay=False), a learning-rate scale (lr_scale) and frozen; "
            f"the decay amount, betas, eps and momentum are the optimizer's, one for every group{scale}")


def as_flag(value: Any) -> bool | None:
    """`value` as a bool where it is one: a bool, a numpy bool, or the int 0 or 1 (torch takes
    these for its flags); None for anything else -- a string or another number would switch a
    behaviour on silently (`maximize="no"` maximizes)."""
    if isinstance(value, bool) or (isinstance(value, int) and value in (0, 1)):
        return bool(value)
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)
    return None


def type_name(value: Any) -> str:
    """`value`'s type with its module where not a builtin (numpy's bool prints as `bool`)."""
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


@dataclasses.dataclass(frozen=True)
class LeafSpec:
    """Where one leaf lives: bucket `bucket`, elements `[offset, offset + numel)` of its flat buffer.

    `index` is its position in `Layout.leaves` (the pytree's flatten order), `path` its dotted
    path, `shape` and `dtype` its own, `unit` the unit and `group` the `ParamGroup` it belongs to.
    """

    index: int
    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    unit: str
    group: ParamGroup
    bucket: int
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclasses.dataclass(frozen=True)
class BucketSpec:
    """One flat buffer `flat[world_size * shard_numel]` holding `leaves` back to back, then padding.

    `index` is its position in `Layout.buckets`; `unit`, `dtype` and `group` the unit, dtype and
    `ParamGroup` its leaves share; `leaves` their indices in `Layout.leaves`; `numel` their
    elements (padding excluded); `part` k for the k-th bucket of its (unit, dtype, group) where
    `plan(bucket_bytes=...)` cuts them into several, else 0.
    """

    index: int
    unit: str
    dtype: torch.dtype
    group: ParamGroup
    leaves: tuple[int, ...]
    numel: int
    shard_numel: int
    world_size: int
    part: int = 0  # k-th bucket of its (unit, dtype, group) where `plan(bucket_bytes=...)` splits it

    @property
    def padded_numel(self) -> int:
        return self.world_size * self.shard_numel

    @property
    def tag(self) -> str:
        base = f"{self.unit}/{str(self.dtype).removeprefix('torch.')}/{self.group.name}"
        return base if self.part == 0 else f"{base}#{self.part}"


@dataclasses.dataclass(frozen=True)
class Segment:
    """A piece of leaf `leaf` (its index in `Layout.leaves`) held in one shard: leaf elements
    `[leaf_start, leaf_start + stop - start)` sit at shard elements `[start, stop)`."""

    leaf: int
    leaf_start: int
    start: int
    stop: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """The plan for one params pytree and one shard-axis size. Plain data; see `plan`.

    `treespec` is the pytree's structure (optree's), `leaves` a `LeafSpec` per leaf in flatten
    order, `buckets` a `BucketSpec` per flat buffer, `world_size` N and `align` the multiple every
    shard's length is.
    """

    treespec: optree.PyTreeSpec
    leaves: tuple[LeafSpec, ...]
    buckets: tuple[BucketSpec, ...]
    world_size: int
    align: int

    @functools.cached_property
    def _by_unit(self) -> dict[str, tuple[int, ...]]:
        """Each unit's bucket indices, in layout order, the units in their first bucket's order:
        made once (found in review at 5,000 units: a scan of every bucket per unit, and a tuple of
        the units made at each read, took the first step, and a prefetching step, quadratic time)."""
        out: dict[str, list[int]] = {}
        for b in self.buckets:
            out.setdefault(b.unit, []).append(b.index)
        return {unit: tuple(indices) for unit, indices in out.items()}

    @functools.cached_property
    def units(self) -> tuple[str, ...]:
        return tuple(self._by_unit)

    @functools.cached_property
    def unit_order(self) -> dict[str, int]:
        """Each unit's place in `units`."""
        return {unit: i for i, unit in enumerate(self.units)}

    def unit_buckets(self, unit: str) -> tuple[int, ...]:
        """The indices of the buckets of unit `unit`, in layout order."""
        return self._by_unit.get(unit, ())

    def segments(self, bucket: int, rank: int) -> tuple[Segment, ...]:
        """The pieces of leaves that shard `rank` of bucket `bucket` holds, in shard order."""
        b = self.buckets[bucket]
        lo, hi = rank * b.shard_numel, (rank + 1) * b.shard_numel
        out = []
        for i in b.leaves:
            leaf = self.leaves[i]
            start, stop = max(leaf.offset, lo), min(leaf.offset + leaf.numel, hi)
            if start < stop:
                out.append(Segment(i, start - leaf.offset, start - lo, stop - lo))
        return tuple(out)

    def flat_segments(self, bucket: int) -> tuple[Segment, ...]:
        """The pieces of leaves in the whole `flat[N * S]` of bucket `bucket` (one per non-empty leaf)."""
        leaves = (self.leaves[i] for i in self.buckets[bucket].leaves)
        return tuple(Segment(ls.index, 0, ls.offset, ls.offset + ls.numel) for ls in leaves if ls.numel)

    def owners(self, leaf: int) -> tuple[tuple[int, Segment], ...]:
        """`(rank, segment)` for every rank that holds elements of leaf `leaf`, in rank order."""
        b = self.buckets[self.leaves[leaf].bucket]
        return tuple(
            (r, s) for r in range(self.world_size) for s in self.segments(b.index, r) if s.leaf == leaf
        )

    def rank_shard(self, bucket: int, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s `shard[S]` of bucket `bucket`'s `flat[N * S]`: a view, elements `[r * S, (r + 1) * S)`.

        The one definition of "this rank's shard" in fzero.
        """
        s = self.buckets[bucket].shard_numel
        return flat[rank * s : (rank + 1) * s]

    def check_world_size(self, world_size: int, what: str = "mesh") -> None:
        """`LayoutError` unless `world_size` is the layout's (`what`: what has it, for the message)."""
        if world_size != self.world_size:
            raise LayoutError(
                f"this layout was planned for world size {self.world_size} but the {what} has world size "
                f"{world_size}; plan again with fzero.layout.plan(params, world_size={world_size}, ...)"
            )


def check_world_size(world_size: Any) -> int:
    world_size = as_int(world_size)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise LayoutError(f"world size must be an int >= 1, got {world_size!r}")
    return world_size


def _unit_of(units: UnitSpec) -> Callable[[str], str]:
    if units is None:
        return lambda path: DEFAULT_UNIT
    if callable(units):
        return lambda path: str(units(path))
    if isinstance(units, Mapping):
        table = list(units.items())
        for name, pred in table:
            if not callable(pred):
                raise LayoutError(f"units[{name!r}] must be a callable path -> bool (the unit's leaves), got "
                                  f"{type(pred).__name__} {pred!r}")
        return lambda path: next((name for name, pred in table if pred(path)), DEFAULT_UNIT)
    raise LayoutError(f"units must be None, a callable path -> name, or a mapping name -> predicate; got {units!r}")


NO_GRAD = ParamGroup("requires_grad=False", frozen=True)


def check_groups(groups: Any) -> tuple[ParamGroup, ...]:
    """`groups` as a tuple of `ParamGroup`s, or a `LayoutError` naming what was given."""
    if isinstance(groups, ParamGroup):
        raise LayoutError(f"groups must be a list of fzero.ParamGroup, got one ParamGroup {groups.name!r}; "
                          f"pass groups=[...] around it")
    if groups is None or isinstance(groups, (str, bytes)) or not isinstance(groups, Sequence):
        raise LayoutError(f"groups must be a list (or tuple) of fzero.ParamGroup, () for none, got "
                          f"{type(groups).__name__} {groups!r}"[:300])
    for k, g in enumerate(groups):
        if not isinstance(g, ParamGroup):
            raise LayoutError(f"groups[{k}] must be a fzero.ParamGroup(name, match=..., ...), got "
                              f"{type(g).__name__} {g!r}"[:300])
    return tuple(groups)


def _group_of(groups: Sequence[ParamGroup]) -> Callable[[str, torch.Tensor], ParamGroup]:
    """First match wins, except that a leaf any frozen group matches is frozen, wherever that group
    stands: a no-decay group listed first must not train a `requires_grad=False` parameter. An
    `nn.Parameter` with `requires_grad=False` is frozen too (torch's convention) when no frozen
    group claims it; a plain tensor's `requires_grad` is not read (tensors made by `torch.randn`
    do not require grad, and are the usual leaves of a params pytree)."""
    default = ParamGroup()
    frozen = [g for g in groups if g.frozen]

    def group_of(path: str, leaf: torch.Tensor) -> ParamGroup:
        claimed = next((g for g in frozen if matches(g, path)), None)
        if claimed is not None:
            return claimed
        if isinstance(leaf, torch.nn.Parameter) and not leaf.requires_grad:
            return NO_GRAD
        return next((g for g in groups if matches(g, path)), default)

    return group_of


def matches(group: ParamGroup, path: str) -> bool:
    """Whether `group` takes the leaf at `path`: its `match` (None: every leaf) read as a flag,
    with a `LayoutError` naming the group and the path where the match raises (before: the
    match's own error, a bare `KeyError` naming neither; found in review) or returns a str (true
    whatever it says: a "False" took every leaf, silently)."""
    if group.match is None:
        return True
    try:
        hit = group.match(path)
    except Exception as e:  # noqa: BLE001 - any error of a user's match
        raise LayoutError(f"ParamGroup {group.name!r}: its match raised {type(e).__name__} on the leaf path {path!r}: "
                          f"{said(e)}"[:400] + "; a match is called with every leaf's dotted path (a tied weight's "
                          "other names too): make it answer False for the paths it does not know") from e
    if isinstance(hit, (str, bytes)):
        raise LayoutError(f"ParamGroup {group.name!r}: its match returned {type(hit).__name__} {hit!r:.60} for the "
                          f"leaf path {path!r}, where it must return a bool (any non-empty str is true, \"False\" too)")
    return bool(hit)


class GroupHoldsNoLeaf(UserWarning):
    """A `ParamGroup` with a `match` took no leaf of the params: its match is true for no leaf
    path (a typo?), or every leaf it matches went to another group (first match wins; a frozen
    group wherever it stands). Those leaves train with the settings of the group that took them."""


def _refuse_shadowed(groups: Sequence[ParamGroup], held: Collection[ParamGroup], paths: Sequence[str],
                     group_of: Callable[[str, torch.Tensor], ParamGroup], leaves: Sequence[torch.Tensor]) -> None:
    """A group with a `match` listed after a catch-all (no match, not frozen), which took the
    leaves it matches, is a `LayoutError`: listed there it can never hold a leaf (found in review:
    a no-decay group after `ParamGroup("all")` left weight decay on the biases without a word)."""
    for k, g in enumerate(groups):
        catch_all = next((e for e in groups[:k] if e.match is None and not e.frozen), None)
        if g.match is None or g in held or catch_all is None:
            continue
        taken = {p: group_of(p, t).name for p, t in zip(paths, leaves) if matches(g, p)}
        if catch_all.name in taken.values():
            raise LayoutError(f"ParamGroup {g.name!r} is listed after ParamGroup {catch_all.name!r}, which has no match "
                              f"and so takes every leaf first (the first group that matches wins): {g.name!r} holds "
                              f"none of the {len(taken)} leaves it matches ({_shown_paths(taken)}). List the group "
                              f"with no match last")


def warn_groups_holding_no_leaf(layout: "Layout", groups: Sequence[ParamGroup], other_names: Collection[str] = ()
                                ) -> None:
    """`GroupHoldsNoLeaf` for each group with a `match` that holds no leaf of `layout`, where
    that is not by design: its match is true for no leaf path (a typo?), or every leaf it
    matches went to another group that trains it. Not where the leaves it matches went to a
    frozen group (a frozen group wins wherever it stands), nor where it matches tied leaves by
    their other names alone (`other_names`, a tied leaf's names but its first: groups go by the first
    name, and where they disagree `fzero.init` has refused them, bad-input row 218). At the user's line
    (found in review: a no-decay group that matched no leaf, by a typo, left weight decay on the
    biases without a word)."""
    group_of = {spec.path: spec.group for spec in layout.leaves}
    held = set(group_of.values())
    paths = list(group_of)
    for g in groups:
        if g.match is None or g in held:
            continue
        taken = {p: group_of[p] for p in paths if matches(g, p)}
        if taken and all(t.frozen for t in taken.values()):
            continue
        if not taken and any(matches(g, name) for name in other_names):  # a tied leaf by its other name only (a
            continue  # group taking a first name too but holding none warns: found in review of the first version)
        said_of = (f"every leaf it matches went to another group (the first group that matches wins), whose settings "
                   f"they train with: {_shown_paths({p: t.name for p, t in taken.items()})}" if taken else
                   f"its match is true for none of the {len(paths)} leaf paths ({_shown_paths(dict.fromkeys(paths))}), "
                   f"so the leaves it was meant for train in the group that took them (ParamGroup('default'), weight "
                   f"decay on and lr_scale 1.0, where no group matches)")
        warnings.warn(GroupHoldsNoLeaf(f"ParamGroup {g.name!r} holds no leaf: {said_of}. Fix its match, or leave "
                                       f"the group out"), stacklevel=outside_stacklevel())


def _shown_paths(paths: Mapping[str, str | None], most: int = 6) -> str:
    """Up to `most` paths, each with the group that took it where given."""
    shown = [f"{p!r} to {name!r}" if name else repr(p) for p, name in list(paths.items())[:most]]
    return ", ".join(shown) + (f", ... ({len(paths)} in all)" if len(paths) > most else "")


PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what an update computes in


def _check_leaf(path: str, leaf: Any,
                group_of: Callable[[str, torch.Tensor], ParamGroup] | None = None) -> torch.Tensor:
    """`leaf` if fzero can shard it, else a `LayoutError` naming its path (and, for a dtype fzero
    does not shard, its dtype, shape and the way out: `_not_float_hint`, where `group_of` says
    whether the leaf is frozen)."""
    if not isinstance(leaf, torch.Tensor):
        raise LayoutError(f"params leaf {path!r} is a {type(leaf).__name__}, not a tensor{_not_tensor_hint(leaf)}")
    if torch.nn.parameter.is_lazy(leaf):  # found in review: torch's ValueError from inside `plan`, naming no leaf
        raise LayoutError(f"params leaf {path!r} is an uninitialized parameter of a lazy module (nn.LazyLinear, "
                          f"nn.LazyConv2d, ...): it has no shape yet; run the model once on a dummy batch to "
                          f"materialize its parameters before fzero.init / fzero.from_module / fzero.layout.plan")
    if leaf.is_nested or leaf.layout != torch.strided:
        raise LayoutError(f"params leaf {path!r} is a {'nested' if leaf.is_nested else leaf.layout} tensor; fzero "
                          f"shards dense (torch.strided) leaves only: pass its dense form (t.to_dense())")
    if leaf.dtype not in PARAM_DTYPES:
        frozen = group_of is not None and group_of(path, leaf).frozen
        raise LayoutError(
            f"params leaf {path!r} has dtype {leaf.dtype} and shape {tuple(leaf.shape)}; fzero shards "
            f"float16, bfloat16, float32 and float64 leaves only{_not_float_hint(leaf, frozen)}"
        )
    return leaf


def _not_tensor_hint(leaf: Any) -> str:
    """The way out for a params leaf that is no tensor, where one is known: a module, or an
    iterator such as `model.parameters()` (a generator, which optree takes for a leaf: found in
    review of a DeepSpeed port, whose `initialize(model_parameters=model.parameters())` takes
    one) -- the params pytree is a dict of the module's named parameters, or `from_module`'s."""
    if isinstance(leaf, torch.nn.Module):
        return ": pass the module's parameters, dict(model.named_parameters()), or use fzero.from_module(model)"
    if isinstance(leaf, Iterator):
        return (" (an iterator, such as model.parameters() or model.named_parameters(), which fzero does not "
                "unroll): pass a pytree of tensors, dict(model.named_parameters()) (its leaves named as the "
                "module names them), or use fzero.from_module(model) (params, apply, info: tied weights kept "
                "tied, buffers kept)")
    return ""


def _not_float_hint(leaf: torch.Tensor, frozen: bool) -> str:
    """The way out for a leaf of a dtype fzero does not shard. "Keep it outside the params pytree
    (e.g. as a buffer)" was given for every such leaf (found in review): a pytree not from a module
    has no buffers, and freezing the leaf does not help (a frozen leaf is sharded too)."""
    if leaf.dtype.is_floating_point:  # float8
        return " (float8 is a compute or storage format: keep the params in bf16/fp32 and cast where computing)"
    also = (" (freezing does not exempt it: a frozen leaf is sharded and gathered as the others are, only not "
            "updated)" if frozen else "")
    elsewhere = "pass it to the loss another way: in the batch, or closed over by the loss"
    if leaf.is_complex():
        return (f"{also}: hold it as its real view, torch.view_as_real(t) (a float leaf with a last dim of 2), "
                f"and read it as torch.complex(w[..., 0], w[..., 1]) in the loss (torch.view_as_complex refuses a "
                f"leaf at an odd offset of its flat bucket); in a module, as two real parameters through a "
                f"parametrization (torch.nn.utils.parametrize.register_parametrization with a right_inverse returning "
                f"(w.real, w.imag) and a forward returning torch.complex(re, im)); or {elsewhere}")
    if isinstance(leaf, torch.nn.Parameter):  # a module's integer parameter (requires_grad=False: frozen anyway)
        return (f": fzero trains no integer or bool parameter; register it as a buffer of its module "
                f"instead (module.register_buffer(name, t)): fzero.from_module keeps a module's buffers beside the "
                f"params (info.buffers); or {elsewhere}")
    return (f"{also}: fzero trains no integer or bool tensor; {elsewhere} (a from_module model's integer "
            f"buffers, BatchNorm's num_batches_tracked, are kept as buffers, not params); or cast it to a floating "
            f"dtype if it is to be trained")


def _check_distinct(paths: list[str], params: Any) -> None:
    """Two leaves whose dotted paths are one string (`{"a.b": x, "a": {"b": y}}`, `{1: x, "1": y}`)
    raise `LayoutError` naming both: everything after `plan` finds a leaf by its path (the loss's
    mapping, a unit's Function, a checkpoint), so one would be read as the other (found in review:
    silently, at every stage)."""
    first: dict[str, int] = {}
    for i, path in enumerate(paths):
        if path in first:
            accessors = optree.tree_flatten_with_accessor(params, none_is_leaf=False, namespace=NAMESPACE)[0]
            raise LayoutError(
                f"params leaves {accessors[first[path]].codify('params')} and {accessors[i].codify('params')} have "
                f"the same path {path!r} (fzero names a leaf by its keys joined with '.'); rename one of the keys")
        first[path] = i


def plan(
    params: Any,
    world_size: int,
    *,
    units: UnitSpec = None,
    groups: Sequence[ParamGroup] = (),
    align: int = 1,
    bucket_bytes: int | None = None,
) -> Layout:
    """The layout of `params` over `world_size` ranks.

    Args:
      params: a pytree (dicts, lists, tuples, NamedTuples, nested) of floating tensors of any
        shape, 0-d and zero-size included. Only shapes and dtypes are read.
      world_size: N, the size of the shard axis.
      units: how leaves are grouped into units (the granularity of stage-3 gathers and stage-2
        reductions): `None` (one unit), a callable `path -> unit name`, or a mapping
        `unit name -> path predicate` (first match wins; unmatched leaves go to "default").
      groups: parameter groups; the first whose `match` accepts a leaf's path wins, a frozen
        group wherever it stands; an `nn.Parameter` leaf with `requires_grad=False` is frozen.
      align: each shard's length is a multiple of `align` elements.
      bucket_bytes: None (one bucket per unit, dtype and group), or a cap: the leaves of each
        (unit, dtype, group) are cut into consecutive buckets of at most this many bytes of
        leaves (padding not counted), each leaf kept whole -- a leaf larger than the cap is a
        bucket of its own. The k-th bucket after the first is tagged `unit/dtype/group#k`. Leaf
        paths and offsets within their bucket keep their meaning; every bucket is reduced and
        gathered on its own (more, smaller collectives that can be in flight at once).

    Returns:
      A `Layout` whose buckets hold `flat[N * S]` with `S = align * max(1, ceil(numel / (N * align)))`.
    """
    world_size = check_world_size(world_size)
    align, bucket_bytes = as_int(align), as_int(bucket_bytes)
    if isinstance(align, bool) or not isinstance(align, int) or align < 1:
        raise LayoutError(f"align must be an int >= 1, got {align!r}")
    if bucket_bytes is not None and (isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int)
                                     or bucket_bytes < 1):
        raise LayoutError(f"bucket_bytes must be None or an int >= 1 (the most bytes of leaves per bucket), "
                          f"got {bucket_bytes!r}")
    if params is None:  # found in review: an empty layout, and `fzero.init(None, ...)` a state of nothing
        raise LayoutError("params is None: pass a pytree of tensors, dict(model.named_parameters()), or "
                          "fzero.from_module(model)'s params (an empty container is a model of no parameters)")
    paths, leaves, spec = flatten_with_paths(params)
    _check_distinct(paths, params)
    groups = check_groups(groups)
    unit_of, group_of = _unit_of(units), _group_of(groups)
    keys: dict[tuple[str, torch.dtype, ParamGroup], list[int]] = {}
    for i, (path, leaf) in enumerate(zip(paths, leaves)):
        leaf = _check_leaf(path, leaf, group_of)
        keys.setdefault((unit_of(path), leaf.dtype, group_of(path, leaf)), []).append(i)
    _check_group_names(keys)
    _refuse_shadowed(groups, {g for _, _, g in keys}, paths, group_of, leaves)
    specs: list[LeafSpec | None] = [None] * len(leaves)
    buckets = []
    runs = [(key, part, run) for key, members in keys.items()
            for part, run in enumerate(_runs(members, [leaves[i].numel() * key[1].itemsize for i in members],
                                             bucket_bytes))]
    for b, ((unit, dtype, group), part, members) in enumerate(runs):
        offset = 0
        for i in members:
            specs[i] = LeafSpec(i, paths[i], tuple(leaves[i].shape), dtype, unit, group, b, offset)
            offset += specs[i].numel
        shard = align * max(1, -(-offset // (world_size * align)))
        buckets.append(BucketSpec(b, unit, dtype, group, tuple(members), offset, shard, world_size, part))
    _check_distinct_tags(buckets)
    return Layout(spec, tuple(specs), tuple(buckets), world_size, align)  # type: ignore[arg-type]


def _check_group_names(keys: Mapping[tuple[str, torch.dtype, ParamGroup], Any]) -> None:
    """Two different groups that both hold leaves must have different names: a name tags its
    buckets (`unit/dtype/group`), and two buckets of one tag were read as one where a tag keys
    them (found in review: stage 3's NVMe param offload loaded one bucket's shard for all of
    them). Two unnamed groups are both "default", as is the group of the leaves no group matches."""
    seen: dict[str, ParamGroup] = {}
    for _, _, group in keys:
        other = seen.setdefault(group.name, group)
        if other != group:
            raise LayoutError(f"two parameter groups hold leaves under one name {group.name!r}: {other!r} and "
                              f"{group!r}. A group's name tags its buckets, so name each apart, e.g. "
                              f"ParamGroup('no-decay', ...) (the leaves no group matches are in ParamGroup('default'))")


def _check_distinct_tags(buckets: Sequence[BucketSpec]) -> None:
    """Every bucket's tag (`unit/dtype/group`, `#k` for a `bucket_bytes` part) is its own: names
    that make one tag twice (a group named "default#1" beside the second part of "default", a
    "/" in a unit or group name) are refused, naming both buckets (found in review: stage 3's
    NVMe param offload read one bucket's shard for another)."""
    seen: dict[str, BucketSpec] = {}
    for b in buckets:
        other = seen.setdefault(b.tag, b)
        if other is not b:
            raise LayoutError(f"buckets {other.index} ({other.unit!r}, group {other.group.name!r}, part {other.part}) and "
                              f"{b.index} ({b.unit!r}, group {b.group.name!r}, part {b.part}) have one tag {b.tag!r}: "
                              f"rename the group (a name ending in '#<k>' or holding '/' can repeat another bucket's tag)")


def _runs(members: list[int], nbytes: list[int], cap: int | None) -> list[list[int]]:
    """`members` cut into consecutive runs of at most `cap` bytes (`nbytes[k]`: member k's), each
    member whole; a member larger than `cap` is a run of its own. `cap=None`: one run."""
    if cap is None:
        return [members]
    runs: list[list[int]] = [[]]
    size = 0
    for i, n in zip(members, nbytes):
        if runs[-1] and size + n > cap:
            runs.append([])
            size = 0
        runs[-1].append(i)
        size += n
    return runs


def check_layout(layout: Any, fn: str) -> Layout:
    """`layout` where it is a `Layout`, else a `LayoutError` naming `fn` (the function given it)
    and what was given (found in review: `pack(params, layout)`, its arguments swapped, was an
    `AttributeError` from inside)."""
    if not isinstance(layout, Layout):
        raise LayoutError(f"fzero.layout.{fn}: layout must be the Layout fzero.layout.plan(params, world_size) made "
                          f"(the first argument), got {type_name(layout)} {layout!r:.80}")
    return layout


def _leaves_of(layout: Layout, params: Any) -> list[torch.Tensor]:
    paths, leaves, spec = flatten_with_paths(params)
    if spec != layout.treespec:
        planned = [ls.path for ls in layout.leaves]
        where = next((f"; first difference at leaf {i}: params has {p!r}, the layout {q!r}"
                      for i, (p, q) in enumerate(zip(paths, planned)) if p != q), "")
        if not where and len(paths) != len(planned):
            extra = (paths if len(paths) > len(planned) else planned)[min(len(paths), len(planned))]
            where = f"; params has {len(paths)} leaves, the layout {len(planned)} (first extra: {extra!r})"
        raise LayoutError(
            f"params structure differs from the layout's{where}:\n  params: {spec}\n  layout: {layout.treespec}"
        )
    for leaf, ls in zip(leaves, layout.leaves):
        _check_leaf(ls.path, leaf, lambda _path, _leaf, group=ls.group: group)
        if tuple(leaf.shape) != ls.shape or leaf.dtype != ls.dtype:
            raise LayoutError(
                f"params leaf {ls.path!r} is {leaf.dtype}{list(leaf.shape)} but the layout planned "
                f"{ls.dtype}{list(ls.shape)}"
            )
    return leaves


def pack(layout: Layout, params: Any) -> tuple[torch.Tensor, ...]:
    """`params -> (flat[N * S] per bucket)` under `layout`: leaves back to back, zero padding at
    the end.

    A bucket's leaves are joined into one buffer, so they must be on one device (`LayoutError`
    naming the bucket, its leaves and their devices otherwise); buckets may differ."""
    return tuple(packed(layout, params))


def packed(layout: Layout, params: Any) -> Iterator[torch.Tensor]:
    """`pack`'s buffers one bucket at a time, each made when the next is asked for; every
    bucket's leaves are checked before the first is made. A caller that keeps a part of each
    (`fzero.init` keeps its shard) holds one bucket's buffer beside the params, not all of them
    (found in review: `init` held the packed model and a copy of it, twice the params' bytes, at
    once)."""
    leaves = _leaves_of(check_layout(layout, "pack"), params)
    for b in layout.buckets:
        _check_one_device(layout, b, leaves)
    return (_pack_bucket(b, leaves) for b in layout.buckets)


def _pack_bucket(b: BucketSpec, leaves: Sequence[torch.Tensor]) -> torch.Tensor:
    """Bucket `b`'s `flat[N * S]` (a fresh buffer): its leaves back to back, zero padding at the end."""
    parts = [leaves[i].reshape(-1) for i in b.leaves]
    parts.append(leaves[b.leaves[0]].new_zeros(b.padded_numel - b.numel))
    return torch.cat(parts)


def _check_one_device(layout: Layout, b: BucketSpec, leaves: Sequence[torch.Tensor]) -> None:
    """Every leaf of bucket `b` on the device of its first, or a `LayoutError` naming the bucket,
    each leaf elsewhere with its device, and the way out (found in review: torch's "Tensor on
    device meta is not on the expected device cpu!", naming no leaf)."""
    first = leaves[b.leaves[0]].device
    elsewhere = [i for i in b.leaves if leaves[i].device != first]
    if elsewhere:
        named = ", ".join(f"{layout.leaves[i].path!r} on {leaves[i].device}" for i in elsewhere[:6])
        more = f" and {len(elsewhere) - 6} more" if len(elsewhere) > 6 else ""
        raise LayoutError(
            f"bucket {b.tag!r} joins its {len(b.leaves)} leaves into one flat buffer, but they are on more than one "
            f"device: {layout.leaves[b.leaves[0]].path!r} on {first}, {named}{more}; move every params leaf to one "
            f"device first (model.to(device), or optree.tree_map(lambda t: t.to(device), params)); fzero.init then "
            f"copies the state to the mesh's device")


def check_flats(layout: Layout, flats: Sequence[torch.Tensor], what: str = "flat buffers") -> None:
    """`flats` fit `layout`: one tensor per bucket, of the bucket's `dtype[N * S]`, holding its own
    values. A stand-in of the NVMe tier's swap files (`is_stand_in`: what `state.params`
    holds under `Offload(params="nvme")`, which reads as zeros) is refused by name (found in
    review: `unpack(state.layout, state.params)`, the README's differentiable read, gave zeros and
    a loss over them ran, silently). Any other tensor of the right shape and dtype is taken, one
    expanded from one value too (autograd's gradient of `flat.sum()` with respect to a flat
    buffer: refused by the stride test this replaces, found in review)."""
    _check_buffers(layout, flats, what)
    for b, f in zip(layout.buckets, flats):
        if tuple(f.shape) != (b.padded_numel,) or f.dtype != b.dtype:
            raise LayoutError(
                f"{what} of bucket {b.tag!r} is {f.dtype}{list(f.shape)}; the layout expects "
                f"{b.dtype}[{b.padded_numel}] (world size {layout.world_size} x shard {b.shard_numel})"
            )
        if is_stand_in(f):
            raise LayoutError(stand_in_words(f"{what} of bucket {b.tag!r} ({f.dtype}{list(f.shape)})"))


def _check_buffers(layout: Layout, xs: Any, what: str) -> None:
    """`xs` is a sequence of tensors, one per bucket of `layout`, or a `LayoutError` naming what is
    not (a tensor given alone, a list of floats: before, torch's or Python's `AttributeError`)."""
    if isinstance(xs, torch.Tensor) or not isinstance(xs, Sequence):
        got = f"one tensor of shape {list(xs.shape)}" if isinstance(xs, torch.Tensor) else type_name(xs)
        raise LayoutError(f"expected {len(layout.buckets)} {what} (a tuple or list, one tensor per bucket), got {got}; "
                          f"pass what fzero.layout.pack / shard returned")
    if len(xs) != len(layout.buckets):
        raise LayoutError(f"expected {len(layout.buckets)} {what}, one per bucket; got {len(xs)}")
    for b, x in zip(layout.buckets, xs):
        if not isinstance(x, torch.Tensor):
            raise LayoutError(f"{what} of bucket {b.tag!r} is a {type_name(x)}, not a tensor")


def bucket_leaves(layout: Layout, bucket: int, flat: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """`flat[N * S] -> [(leaf index, view of the leaf)]` for the leaves of one bucket."""
    out = []
    for i in layout.buckets[bucket].leaves:
        ls = layout.leaves[i]
        out.append((i, flat[ls.offset : ls.offset + ls.numel].view(ls.shape)))
    return out


def unpack(layout: Layout, flats: Sequence[torch.Tensor]) -> Any:
    """`flats` (`flat[N * S]` per bucket of `layout`) -> params: each leaf a view of its bucket's
    buffer."""
    check_flats(check_layout(layout, "unpack"), flats)
    leaves: list[Any] = [None] * len(layout.leaves)
    for b, flat in zip(layout.buckets, flats):
        for i, view in bucket_leaves(layout, b.index, flat):
            leaves[i] = view
    return unflatten(layout.treespec, leaves)


def shard(layout: Layout, flats: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """`flats` (`flat[N * S]` per bucket of `layout`) -> `shards[N, S]` per bucket; row r is rank
    r's shard (a view)."""
    check_flats(check_layout(layout, "shard"), flats)
    return tuple(einops.rearrange(f, "(n s) -> n s", n=layout.world_size) for f in flats)


def local_shards(layout: Layout, flats: Sequence[torch.Tensor], rank: int) -> tuple[torch.Tensor, ...]:
    """Rank `rank`'s `shard[S]` of every bucket of `layout`, from `flats` (`flat[N * S]` per
    bucket; views). A `rank` that is not an int in `[0, world size)` raises `LayoutError`."""
    check_layout(layout, "local_shards")
    if isinstance(rank, bool) or not isinstance(rank, numbers.Integral):  # found in review: 1.5 was a TypeError
        raise LayoutError(f"rank must be an int in [0, {layout.world_size}) (the layout's world size), got "
                          f"{type_name(rank)} {rank!r}")
    rank = int(rank)
    if not 0 <= rank < layout.world_size:
        raise LayoutError(f"rank {rank} is outside world size {layout.world_size}")
    check_flats(layout, flats)
    return tuple(layout.rank_shard(b, f, rank) for b, f in enumerate(flats))


def unshard(layout: Layout, shards: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """`shards` (`[N, S]` per bucket of `layout`) -> `flat[N * S]` per bucket; the inverse of
    `shard`."""
    _check_buffers(check_layout(layout, "unshard"), shards, "shard stacks")
    for b, s in zip(layout.buckets, shards):
        if tuple(s.shape) != (layout.world_size, b.shard_numel):
            raise LayoutError(
                f"shards of bucket {b.tag!r} have shape {list(s.shape)}; expected "
                f"[{layout.world_size}, {b.shard_numel}] (world size x shard)"
            )
        if is_stand_in(s):  # (`state.params[b].unsqueeze(0)` at N = 1, an expand at N > 1: its zeros)
            raise LayoutError(stand_in_words(f"shards of bucket {b.tag!r} ({s.dtype}{list(s.shape)})"))
    return tuple(einops.rearrange(s, "n s -> (n s)") for s in shards)


# -- stand-ins: what an NVMe-offloaded state holds for values kept in a swap file ------------------
#
# A stand-in (`stand_in`) is an `expand` of a 0-d zero of its own, never read for its values; the
# files hold them. It is marked exactly: its 0-d base is registered here (weakly: a stand-in's
# views hold their base, and an entry goes with its base), so `is_stand_in` says whether a tensor
# is one, a view of one, or shares its memory (`detach()`), and nothing else -- not a tensor that
# happens to be expanded from one value (autograd's gradient of `flat.sum()` with respect to a flat
# buffer is such an expand, found in review), which the stride test used before refused. Readers
# that take values refuse a stand-in by name (`check_flats`, `unshard`, the public
# `collectives.all_gather`): it reads as zeros. Here, below `collectives` and `offload` (which
# makes them), so that both read one registry.

_BY_ID: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # id(base) -> base
_BY_PTR: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()  # its data_ptr -> base


def stand_in(x: torch.Tensor) -> torch.Tensor:
    """What a state holds for a tensor kept in a swap file: a zero-cost tensor of `x`'s shape and
    dtype on the host (an `expand` of a 0-d zero of its own; stride 0), never read for its values,
    its base registered (`is_stand_in`)."""
    base = torch.zeros((), dtype=x.dtype)
    _BY_ID[id(base)] = base
    _BY_PTR[base.data_ptr()] = base
    return base.expand(x.shape)


def is_stand_in(x: torch.Tensor) -> bool:
    """Whether `x` is a stand-in (`stand_in`), a view of one (a slice, `view`, `unsqueeze`, `to` its
    own dtype and device: its `_base` is the stand-in's registered base, one attribute read and a
    dict lookup), or shares its memory without being a view (`detach()`: read only where every
    stride is 0, by its address, which no other live tensor has while the base lives), also under
    torch.func's wrappers (`unwrapped`: found in review, `torch.func.grad` of the README's
    differentiable read took the stand-ins' zeros, silently). A real tensor -- one expanded on
    purpose, autograd's gradient of a sum, a copy of a stand-in (its zeros) -- is not."""
    if not torch.compiler.is_compiling():  # dynamo cannot trace the unwrapping (found in review: a warning,
        x = unwrapped(x)  # an error under -W error, and two more graph breaks in a compiled `unpack`)
    base = x._base
    if base is not None:
        return _BY_ID.get(id(base)) is base
    try:  # not a view: the 0-d base itself, or a `detach()` of a stand-in (every stride 0)
        return not any(x.stride()) and _BY_PTR.get(x.data_ptr()) is not None
    except RuntimeError:  # no strides (sparse) or no storage (a torch.func wrapper, a subclass)
        return False


def unwrapped(x: torch.Tensor) -> torch.Tensor:
    """The plain tensor under `x`'s torch.func wrappers (grad tracking, batched), or `x` itself
    outside every transform: what an in-place write through `x` writes, and whose version it
    moves. Private to torch (`torch._C._functorch`, in 2.11 and 2.13, as `collectives.func_level`
    reads it)."""
    f = torch._C._functorch
    while f.is_functorch_wrapped_tensor(x) or f.is_batchedtensor(x):
        x = f.get_unwrapped(x)
    return x


def stand_in_words(what: str) -> str:
    """The words of a refusal of `what`, a stand-in, by a reader of values."""
    return (f"{what} is one of the stand-ins of the swap files that an NVMe-offloaded state holds "
            f"(state.params under Offload(params=\"nvme\"); the master and optimizer state under "
            f"optimizer=\"nvme\"): zeros, the values being in the files, not values of its own. Read the params "
            f"with fzero.gather(state) (no derivative), or offload them with params=\"cpu\" to read them "
            f"differentiably")
