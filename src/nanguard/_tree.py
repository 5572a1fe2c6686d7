"""Find the tensors inside a module's inputs and outputs, with a path to name each one.

Outputs come in every shape: a tensor, tuples, lists, dicts, named tuples,
dataclasses, Hugging Face ``ModelOutput`` (an ordered dict that is also a
dataclass) and ``torch.distributions`` objects (their parameters). A model's own
inputs may also be a batch object of the user's (a PyTorch Geometric ``Data``, a
plain class holding ``x`` and ``edge_index``): with ``objects=True`` its attributes
are looked into too. ``None`` and other objects are ignored. A path is a tuple of
keys (ints for positions, strings for names); :func:`format_path` renders it.
"""

from __future__ import annotations

import collections
import dataclasses
import types
from collections.abc import Mapping, Sequence
from typing import Any, Final

import torch
from torch import Tensor, nn
from torch.distributions import Distribution

__all__ = [
    "OBJECT_BUDGET",
    "DictKey",
    "Path",
    "Walk",
    "attributes",
    "collect",
    "format_path",
    "is_data_object",
    "scalar_list",
]

Path = tuple[Any, ...]

# Deep enough for any real output structure; stops cycles and pathological nesting.
_MAX_DEPTH = 8
#: How many values a walk into batch objects visits at most (a batch holding its dataset,
#: a vocabulary or back-references to itself would be walked at every forward).
OBJECT_BUDGET = 2000


_NOT_DATA = (
    nn.Module,
    type,
    types.ModuleType,
    types.FunctionType,
    types.MethodType,
    types.BuiltinFunctionType,
    Distribution,
    torch.Generator,
)
_data_kinds: dict[type, bool] = {}


def is_data_object(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a user's (or a library's) data class with
    attributes: a batch object, not a module, class, function or torch/numpy object."""
    kind = type(obj)
    known = _data_kinds.get(kind)
    if known is None:
        where = getattr(kind, "__module__", None) or "builtins"
        known = _data_kinds[kind] = (
            (getattr(kind, "__dictoffset__", 0) != 0 or bool(_slots(kind)))  # attributes
            and not isinstance(obj, _NOT_DATA)
            and where not in ("builtins", "torch", "numpy", "collections")
            and not where.startswith(("torch.", "numpy."))
            and (where == "__main__" or not where.startswith("_"))
        )
    return known


def attributes(obj: Any) -> dict[str, Any] | None:
    """A data object's instance attributes: its ``__dict__`` itself, or for a class with
    ``__slots__`` a dict of them (``None`` when they cannot be read)."""
    try:
        found = object.__getattribute__(obj, "__dict__")
    except Exception:  # (__slots__, or a class that hides it)
        found = None
    if isinstance(found, dict):
        return found
    slots = _slots(type(obj))
    if not slots:
        return None
    values = {}
    for name in slots:
        try:
            values[name] = object.__getattribute__(obj, name)
        except Exception:  # (a slot never set)
            continue
    return values


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (str, bytes, int, float, bool))


def scalar_list(obj: Sequence[Any]) -> bool:
    """A long list of one kind of scalar (raw tokens, ids): it holds no tensor. Judged by
    its ends, so that a batch walk does not visit thousands of strings."""
    return len(obj) > 16 and _plain(obj[0]) and _plain(obj[-1])


def _scalar_mapping(obj: Mapping[Any, Any]) -> bool:
    """A long mapping to one kind of scalar (a vocabulary, a config), judged by its ends
    as ``scalar_list``: it holds no tensor."""
    if len(obj) <= 16:
        return False
    values = iter(obj.values())
    first = next(values, None)
    try:
        last = next(reversed(obj.values()))  # type: ignore[call-overload]
    except (TypeError, StopIteration):  # (a Mapping that cannot be reversed)
        last = next(values, None)
    return _plain(first) and _plain(last)


def _slots(kind: type) -> tuple[str, ...]:
    names: list[str] = []
    for cls in kind.__mro__:
        declared = cls.__dict__.get("__slots__", ())
        names.extend([declared] if isinstance(declared, str) else declared)
    return tuple(n for n in names if n not in ("__dict__", "__weakref__"))


class Walk:
    """One walk into batch objects: the objects seen (cycles) and what is left to visit."""

    __slots__ = ("left", "seen")

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.left = OBJECT_BUDGET


def collect(
    obj: Any,
    path: Path,
    out: list[tuple[Path, Tensor]],
    depth: int = 0,
    objects: bool = False,
    bound_containers: bool = True,
) -> None:
    """Append ``(path, tensor)`` for every tensor inside ``obj`` to ``out``, in order.

    ``objects``: also look into the attributes of data objects (``is_data_object``): for
    a model's own inputs (a batch object) and outputs, not for what flows between its
    modules (a cache object handed to every layer would be read at each call). Such a walk
    visits each object once and at most ``OBJECT_BUDGET`` values; with
    ``bound_containers=False`` the budget counts only what lies inside data objects (a
    model's outputs: a list of 3,000 step outputs is walked whole, a vocabulary its
    posterior object refers to is not).
    """
    _collect(obj, path, out, depth, Walk() if objects else None, bound_containers)


def _collect(
    obj: Any,
    path: Path,
    out: list[tuple[Path, Tensor]],
    depth: int,
    walk: Walk | None,
    bounded: bool = True,
    inside: bool = False,
) -> None:
    if walk is not None and bounded:
        walk.left -= 1
        if walk.left < 0:
            return
    if isinstance(obj, Tensor):
        out.append((path, obj))
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    # (A spent budget stops the loops too: a 50,000-entry vocabulary is not walked.)
    budgeted = walk is not None and bounded
    if isinstance(obj, Mapping):
        if inside and _scalar_mapping(obj):
            # (An object's vocabulary or config: a long mapping to scalars holds no tensor.
            # Not a batch or outputs dict, whose ends may be plain values.)
            return
        # (A plain dict's keys are written out['boxes']; a subclass's (ModelOutput, read
        # by attribute as well) and a mapping of another kind's as attributes.)
        plain = type(obj) in _PLAIN_DICTS
        for key, value in obj.items():
            if budgeted and walk.left <= 0:  # type: ignore[union-attr]
                break
            step = DictKey(key) if plain and type(key) is str else key
            _collect(value, (*path, step), out, depth + 1, walk, bounded, inside)
    elif isinstance(obj, (tuple, list)):
        if walk is not None and scalar_list(obj):
            return  # (raw tokens, ids: a long list of one kind of scalar holds no tensor)
        fields = getattr(obj, "_fields", None)  # named tuples: use the field names
        keys = fields if fields is not None and len(fields) == len(obj) else range(len(obj))
        for key, value in zip(keys, obj, strict=True):
            if budgeted and walk.left <= 0:  # type: ignore[union-attr]
                break
            _collect(value, (*path, key), out, depth + 1, walk, bounded, inside)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name, None)
            _collect(value, (*path, field.name), out, depth + 1, walk, bounded, inside)
    elif isinstance(obj, Distribution):
        # A policy's Normal(mu, std) or Categorical(logits=...): its parameters (and those
        # of a wrapped base distribution, also one kept private: Beta's `_dirichlet`), as
        # they are stored.
        for key, value in vars(obj).items():
            if isinstance(value, Distribution) or (
                not key.startswith("_") and isinstance(value, Tensor)
            ):
                _collect(value, (*path, key), out, depth + 1, walk, bounded, inside)
    elif walk is not None and is_data_object(obj) and id(obj) not in walk.seen:
        walk.seen.add(id(obj))
        found = attributes(obj)
        items = list(found.items()) if found is not None else []
        # Its own tensors first: a batch that also references its dataset or vocabulary
        # must not spend the budget there before reaching them. (Inside, the budget
        # counts.)
        for key, value in items:
            if isinstance(value, Tensor):
                _collect(value, (*path, key), out, depth + 1, walk, True, True)
        for key, value in items:
            if walk.left <= 0:
                break
            if not isinstance(value, Tensor):
                _collect(value, (*path, key), out, depth + 1, walk, True, True)


#: Mappings whose keys are no attributes (a subclass may add attribute access: ModelOutput).
_PLAIN_DICTS: Final = frozenset({dict, collections.OrderedDict, collections.defaultdict})


class DictKey(str):
    """A plain dict's key in a path (``["boxes"]``), told from an attribute's name."""

    __slots__ = ()


def format_path(root: str, path: Path) -> str:
    """``format_path("output", (0, "logits"))`` -> ``"output[0].logits"``;
    ``format_path("args", (1, DictKey("boxes")))`` -> ``"args[1]['boxes']"``."""
    text = root
    for key in path:
        if isinstance(key, DictKey):
            text += f"[{str(key)!r}]"
        elif isinstance(key, int):
            text += f"[{key}]"
        elif isinstance(key, str) and key.isidentifier():
            text += f".{key}"
        else:
            text += f"[{key!r}]"
    return text
