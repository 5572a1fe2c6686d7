"""Parameters, their gradients and floating buffers: owners, names, multi-tensor norms.

Norms come from ``torch._foreach_norm``, one call per (device, dtype) group, as
``clip_grad_norm_`` does: one kernel for many tensors on a GPU, no Python loop of
``.item()``. The 0-d results join the step's single host read.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["Owned", "ParamTable", "norms"]

_HALF = (torch.float16, torch.bfloat16)


class Owned(NamedTuple):
    """A parameter or buffer with its qualified name and the module that owns it."""

    name: str  # as named_parameters() / named_buffers() give it
    owner: nn.Module
    owner_name: str
    local: str  # attribute name on the owner


def _version(t: Tensor) -> int:
    try:
        return t._version
    except RuntimeError:  # inference tensors
        return -1


def norms(tensors: list[Tensor]) -> list[Tensor]:
    """L2 norm of each tensor as a 0-d tensor on its device (float32 for half types)."""
    out: list[Tensor | None] = [None] * len(tensors)
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.layout is not torch.strided:  # sparse gradients: norm of the stored values
            values = t.coalesce().values() if t.is_sparse else t.values()
            out[i] = torch.linalg.vector_norm(values.float())
            continue
        groups.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), indices in groups.items():
        group = [tensors[i] for i in indices]
        result: Sequence[Tensor]
        if dtype in _HALF:
            result = torch._foreach_norm(group, 2, dtype=torch.float32)
        elif dtype.is_complex or not dtype.is_floating_point:
            result = [
                torch.linalg.vector_norm(t.float() if not dtype.is_complex else t) for t in group
            ]
        else:
            result = torch._foreach_norm(group, 2)
        for i, r in zip(indices, result, strict=True):
            out[i] = r
    return [r for r in out if r is not None]


class ParamTable:
    """The model's parameters and floating buffers, each once, with its owner."""

    def __init__(self, model: nn.Module, names: Mapping[nn.Module, str]) -> None:
        self.params: list[tuple[Owned, nn.Parameter]] = []
        self.buffers: list[Owned] = []
        seen: set[int] = set()
        for module_name, module in model.named_modules():
            display = names.get(module, module_name)
            for local, param in module._parameters.items():
                if param is None or id(param) in seen:
                    continue
                seen.add(id(param))
                qualified = f"{module_name}.{local}" if module_name else local
                self.params.append((Owned(qualified, module, display, local), param))
            for local, buf in module._buffers.items():
                if buf is None or not buf.is_floating_point() or id(buf) in seen:
                    continue
                seen.add(id(buf))
                qualified = f"{module_name}.{local}" if module_name else local
                self.buffers.append(Owned(qualified, module, display, local))
        self._grad_versions: dict[int, tuple[weakref.ref[Tensor], int]] = {}
        self._value_versions: tuple[tuple[int, int], ...] = ()
        self._value_tensors: list[Tensor] = []
        self._by_module: dict[int, list[int]] = {}
        for index, (owned, _) in enumerate(self.params):
            self._by_module.setdefault(id(owned.owner), []).append(index)

    def grads(self) -> tuple[list[int], list[Tensor]]:
        """The gradients that changed since the last call, with their parameters' indices.

        A gradient nobody recomputed (no backward since, no ``zero_grad``) was checked
        already.
        """
        indices: list[int] = []
        grads: list[Tensor] = []
        versions = self._grad_versions
        for index, (_, param) in enumerate(self.params):
            grad = param.grad
            if grad is None:
                continue
            version = _version(grad)
            seen = versions.get(index)
            # The same tensor object (not merely the same id: ids are reused), unchanged.
            if seen is not None and seen[0]() is grad and seen[1] == version:
                continue
            versions[index] = (weakref.ref(grad), version)
            indices.append(index)
            grads.append(grad)
        return indices, grads

    def values(self) -> tuple[list[Owned], list[Tensor]]:
        """Every parameter and floating buffer, or nothing if none changed since last time."""
        owned = [o for o, _ in self.params]
        tensors: list[Tensor] = [p for _, p in self.params]
        for buf in self.buffers:
            tensor = buf.owner._buffers.get(buf.local)
            if tensor is not None and tensor.is_floating_point():
                owned.append(buf)
                tensors.append(tensor)
        versions = tuple((id(t), _version(t)) for t in tensors)
        if versions == self._value_versions and all(
            a is b for a, b in zip(self._value_tensors, tensors, strict=True)
        ):
            return [], []
        self._value_versions = versions
        self._value_tensors = tensors
        return owned, tensors

    def of_module(self, module: nn.Module) -> list[int]:
        """Indices of the parameters ``module`` owns."""
        return self._by_module.get(id(module), [])
