"""Find the tensors inside a module's inputs and outputs, with a path to name each one.

Outputs come in every shape: a tensor, tuples, lists, dicts, named tuples,
dataclasses, Hugging Face ``ModelOutput`` (an ordered dict that is also a
dataclass) and ``torch.distributions`` objects (their parameters). ``None`` and
other objects are ignored. A path is a tuple of keys
(ints for positions, strings for names); :func:`format_path` renders it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from torch import Tensor
from torch.distributions import Distribution

__all__ = ["Path", "collect", "format_path"]

Path = tuple[Any, ...]

# Deep enough for any real output structure; stops cycles and pathological nesting.
_MAX_DEPTH = 8


def collect(obj: Any, path: Path, out: list[tuple[Path, Tensor]], depth: int = 0) -> None:
    """Append ``(path, tensor)`` for every tensor inside ``obj`` to ``out``, in order."""
    if isinstance(obj, Tensor):
        out.append((path, obj))
        return
    if depth >= _MAX_DEPTH or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
        return
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            collect(value, (*path, key), out, depth + 1)
    elif isinstance(obj, (tuple, list)):
        fields = getattr(obj, "_fields", None)  # named tuples: use the field names
        if fields is not None and len(fields) == len(obj):
            for key, value in zip(fields, obj, strict=True):
                collect(value, (*path, key), out, depth + 1)
        else:
            for index, value in enumerate(obj):
                collect(value, (*path, index), out, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for field in dataclasses.fields(obj):
            collect(getattr(obj, field.name, None), (*path, field.name), out, depth + 1)
    elif isinstance(obj, Distribution):
        # A policy's Normal(mu, std) or Categorical(logits=...): its parameters (and those
        # of a wrapped base distribution), as they are stored.
        for key, value in vars(obj).items():
            if not key.startswith("_") and isinstance(value, (Tensor, Distribution)):
                collect(value, (*path, key), out, depth + 1)


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
