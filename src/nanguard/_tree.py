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

import dataclasses
import types
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributions import Distribution

__all__ = ["Path", "collect", "format_path", "is_data_object"]

Path = tuple[Any, ...]

# Deep enough for any real output structure; stops cycles and pathological nesting.
_MAX_DEPTH = 8


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
            hasattr(obj, "__dict__")
            and not isinstance(obj, _NOT_DATA)
            and where not in ("builtins", "torch", "numpy", "collections")
            and not where.startswith(("torch.", "numpy."))
            and (where == "__main__" or not where.startswith("_"))
        )
    return known


def collect(
    obj: Any,
    path: Path,
    out: list[tuple[Path, Tensor]],
    depth: int = 0,
    objects: bool = False,
) -> None:
    """Append ``(path, tensor)`` for every tensor inside ``obj`` to ``out``, in order.

    ``objects``: also look into the attributes of data objects (``is_data_object``): for
    a model's own inputs (a batch object), not for what flows between its modules (a
    cache object handed to every layer would be read at each call).
    """
    if isinstance(obj, Tensor):
        out.append((path, obj))
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            collect(value, (*path, key), out, depth + 1, objects)
    elif isinstance(obj, (tuple, list)):
        fields = getattr(obj, "_fields", None)  # named tuples: use the field names
        if fields is not None and len(fields) == len(obj):
            for key, value in zip(fields, obj, strict=True):
                collect(value, (*path, key), out, depth + 1, objects)
        else:
            for index, value in enumerate(obj):
                collect(value, (*path, index), out, depth + 1, objects)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            value = getattr(obj, field.name, None)
            collect(value, (*path, field.name), out, depth + 1, objects)
    elif isinstance(obj, Distribution):
        # A policy's Normal(mu, std) or Categorical(logits=...): its parameters (and those
        # of a wrapped base distribution), as they are stored.
        for key, value in vars(obj).items():
            if not key.startswith("_") and isinstance(value, (Tensor, Distribution)):
                collect(value, (*path, key), out, depth + 1)
    elif objects and is_data_object(obj):
        for key, value in list(vars(obj).items()):
            collect(value, (*path, key), out, depth + 1, objects)


def format_path(root: str, path: Path) -> str:
    """``format_path("output", (0, "logits"))`` -> ``"output[0].logits"``."""
    text = root
    for key in path:
        if isinstance(key, int):
            text += f"[{key}]"
        elif isinstance(key, str) and key.isidentifier():
            text += f".{key}"
        else:
            text += f"[{key!r}]"
    return text
