"""Parameters, their gradients and floating buffers: owners, names, multi-tensor norms.

Norms come from ``torch._foreach_norm``, one call per (device, dtype) group, as
``clip_grad_norm_`` does: one kernel for many tensors on a GPU, no Python loop of
``.item()``. The 0-d results join the step's single host read.
"""

from __future__ import annotations

import functools
import operator
import weakref
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from typing import Final, NamedTuple

import torch
from torch import Tensor, nn

from nanguard._checks import CHECKED_DTYPES, PLAIN_TYPES, local_shard, probe

__all__ = [
    "Groups",
    "Owned",
    "ParamTable",
    "exact_norm",
    "exact_norms",
    "finite_probes",
    "held",
    "is_compile_wrapper",
    "is_compiled",
    "module_names",
    "norms",
    "plain_name",
]

_HALF = (torch.float16, torch.bfloat16)
_GRAD: Final = operator.attrgetter("grad")
_VERSION: Final = operator.attrgetter("_version")
_IS_NONE: Final = functools.partial(operator.is_, None)
_KIND: Final = operator.attrgetter("dtype", "device", "layout")
_CALL: Final = operator.methodcaller("__call__")
#: Number of tensors -> groups of one tensor each (norms' usual result, reused).
_ONE_EACH: dict[int, tuple[tuple[int, tuple[int, ...]], ...]] = {}
_FOREACH = (torch.float32, torch.float64)  # normed in their own dtype


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


def _no_tensor() -> Tensor | None:
    """A weak reference that never held a tensor."""
    return None


def held(table: Mapping[str, Tensor | None], name: str) -> Tensor | None:
    """``module._parameters[name]`` or ``_buffers[name]``, ``None`` when absent (a
    TorchScript module's tables are wrappers without ``get``)."""
    try:
        return table[name]
    except (KeyError, RuntimeError):
        return None


#: The eager module a ``torch.compile`` wrapper (``OptimizedModule``) holds.
_COMPILED_ORIGINAL: Final = "_orig_mod"


def plain_name(name: str) -> str:
    """A module's name as the eager model gives it: a compiled submodule's wrapper adds
    no ``_orig_mod`` segment (``h.0.attn``, not ``h.0._orig_mod.attn``)."""
    if _COMPILED_ORIGINAL not in name:
        return name
    return ".".join(part for part in name.split(".") if part != _COMPILED_ORIGINAL)


def unwrapped_name(name: str) -> str:
    """A module's name inside a data-parallel wrapper, without the wrapper's parts (DDP's
    ``module.``, FSDP's ``_fsdp_wrapped_module.``)."""
    name = name.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")
    if name == "_fsdp_wrapped_module":
        name = ""
    if name == "module":
        return ""
    return name.removeprefix("module.")


def spellings(raw: str, wrapped: bool) -> tuple[str, ...]:
    """The names exclusions and allow-lists match a module by: as ``named_modules()``
    gives it, as the eager model does (``plain_name``), and, in a watched data-parallel
    wrapper (``wrapped``), as the user's model does (``unwrapped_name``)."""
    name = plain_name(raw)
    return tuple(dict.fromkeys((name, raw, unwrapped_name(name) if wrapped else name)))


def module_names(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``model.named_modules()`` with the names of ``plain_name``."""
    for name, module in model.named_modules():
        yield plain_name(name), module


def is_compile_wrapper(module: nn.Module) -> bool:
    """A ``torch.compile`` wrapper: its module inside records the same call."""
    return module._modules.get(_COMPILED_ORIGINAL) is not None


def is_compiled(module: nn.Module) -> bool:
    """A ``torch.compile`` wrapper, or a module compiled in place (``module.compile()``):
    the hooks of the modules inside run only when it runs eagerly."""
    return is_compile_wrapper(module) or getattr(module, "_compiled_call_impl", None) is not None


#: Which tensors one probe value covers: (number of values, indices of the tensors).
Groups = list[tuple[int, tuple[int, ...]]]


def norms(tensors: list[Tensor]) -> tuple[list[Tensor], Groups]:
    """L2 norms, as 0-d float tensors on their devices, one per tensor.

    One ``torch._foreach_norm`` per (device, dtype) group, as ``clip_grad_norm_`` does:
    a single kernel for many tensors on a GPU. Half-precision tensors are reduced in
    float32. The norm of huge finite values can overflow: callers re-check a
    non-finite result exactly.
    """
    kinds = set(map(_KIND, tensors))
    if len(kinds) == 1:  # the usual case: one kind of tensor (found without a Python loop)
        ((dtype, _, layout),) = kinds
        if dtype in _FOREACH and layout is torch.strided:
            each = _ONE_EACH.get(len(tensors))
            if each is None:
                each = _ONE_EACH[len(tensors)] = tuple((1, (i,)) for i in range(len(tensors)))
            return list(torch._foreach_norm(tensors, 2)), list(each)
    values: list[Tensor] = []
    groups: Groups = []
    by_kind: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        if t.layout is not torch.strided:  # sparse gradients: the stored values
            # (Uncoalesced: an embedding's sparse gradient is, and coalescing it each step
            # cost a DLRM step 30%; a row looked up twice counts as two in the norm.)
            stored = (t._values() if t.is_sparse else t.values()).float()
            values.append(torch.linalg.vector_norm(stored))
            groups.append((1, (i,)))
        else:
            by_kind.setdefault((t.device, t.dtype), []).append(i)
    for (_, dtype), indices in by_kind.items():
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
        values.extend(result)
        groups.extend((1, (i,)) for i in indices)
    return values, groups


def finite_probes(tensors: list[Tensor]) -> tuple[list[Tensor], Groups]:
    """Probes proving the tensors finite (see ``_checks.probe``), one group per tensor."""
    values: list[Tensor] = []
    groups: Groups = []
    for i, t in enumerate(tensors):
        try:
            p = probe(t) if t.dtype in CHECKED_DTYPES and t.layout is torch.strided else ()
        except (RuntimeError, NotImplementedError, ValueError):  # ValueError: lazy, no values
            p = ()
        values.extend(p)
        groups.append((len(p), (i,)))
    return values, groups


def exact_norm(t: Tensor) -> float:
    """The L2 norm in float64, for values whose float32 square overflowed (failure path)."""
    t = local_shard(t)
    values = (t.coalesce().values() if t.is_sparse else t).detach()
    # (A complex tensor's norm in complex128: .double() would drop its imaginary part.)
    wide = values.to(torch.complex128) if values.is_complex() else values.double()
    return float(torch.linalg.vector_norm(wide))


def exact_norms(tensors: list[Tensor]) -> list[float]:
    """L2 norms computed on the host one by one (an alarm's path, not a step's)."""
    return [exact_norm(t) for t in tensors]


class ParamTable:
    """The model's parameters and floating buffers, each once, with its owner."""

    def __init__(
        self,
        model: nn.Module,
        names: Mapping[nn.Module, str],
        previous: ParamTable | None = None,
    ) -> None:
        self.params: list[tuple[Owned, nn.Parameter]] = []
        self.buffers: list[Owned] = []
        seen: set[int] = set()
        #: Parameters held by several modules (tied embeddings): their gradient sums every
        #: use, so a bad one does not tell which module's backward made it.
        self.shared: set[int] = set()
        #: ...and every module holding each of those (by parameter id): T5's `shared`,
        #: `encoder.embed_tokens` and `decoder.embed_tokens` hold one weight.
        self.holders: dict[int, list[nn.Module]] = {}
        for module_name, module in module_names(model):
            display = names.get(module, module_name)
            for local, param in module._parameters.items():
                if param is not None and id(param) in seen:
                    self.shared.add(id(param))
                    self.holders.setdefault(id(param), []).append(module)
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
        self._tensors = [p for _, p in self.params]
        self.ids = frozenset(id(p) for p in self._tensors)
        self._model = model
        # Per parameter: a weak reference to the gradient last checked, and its version.
        self._grad_refs: list[Callable[[], Tensor | None]] = [_no_tensor] * len(self._tensors)
        self._grad_seen: list[int] = [-1] * len(self._tensors)
        self._value_versions: tuple[tuple[int, int], ...] = ()
        self._value_tensors: list[Tensor] = []
        self._by_module: dict[int, list[int]] = {}
        index_of: dict[int, int] = {}
        for index, (owned, param) in enumerate(self.params):
            self._by_module.setdefault(id(owned.owner), []).append(index)
            index_of[id(param)] = index
        for param_id, modules in self.holders.items():  # (a tied head holds its weight too)
            for module in modules:
                self._by_module.setdefault(id(module), []).append(index_of[param_id])
        if previous is not None:  # gradients already checked stay checked
            old = {
                id(p): (previous._grad_refs[i], previous._grad_seen[i])
                for i, (_, p) in enumerate(previous.params)
            }
            for index, (_, param) in enumerate(self.params):
                kept = old.get(id(param))
                if kept is not None:
                    self._grad_refs[index], self._grad_seen[index] = kept

    def mark_present(
        self, besides: Container[int] = ()
    ) -> dict[int, tuple[Callable[[], Tensor | None], int]]:
        """Take the gradients ``.grad`` holds now as checked (left by a backward no guard
        watched; or, for parameters not in ``besides`` (ids), made by the failing step just
        resolved before the table knew them); returns them, by parameter id, for ``unmark``."""
        marked: dict[int, tuple[Callable[[], Tensor | None], int]] = {}
        for index, param in enumerate(self._tensors):
            # (Not a tensor standing in for a parameter, torch.func.functional_call's fast
            # weights: reading .grad of a non-leaf makes torch warn.)
            grad = param.grad if param.is_leaf else None
            if grad is None or id(param) in besides:
                continue
            entry = (weakref.ref(grad), _version(grad))
            self._grad_refs[index], self._grad_seen[index] = entry
            marked[id(param)] = entry
        return marked

    def unmark(self, marked: Mapping[int, tuple[Callable[[], Tensor | None], int]]) -> None:
        """Check again those of ``marked`` still unchanged (an optimizer is to apply them)."""
        for index, param in enumerate(self._tensors):
            entry = marked.get(id(param))
            if (
                entry is not None
                and self._grad_refs[index]() is entry[0]()
                and self._grad_seen[index] == entry[1]
            ):
                self._grad_refs[index], self._grad_seen[index] = _no_tensor, -1

    def grads(self) -> tuple[list[int], list[Tensor]]:
        """The gradients that changed since the last call, with their parameters' indices.

        A gradient nobody recomputed (no backward since, no ``zero_grad``) was checked
        already.
        """
        current = list(map(_GRAD, self._tensors))
        refs, seen = self._grad_refs, self._grad_seen
        # The usual step (every gradient a new plain tensor since the last call: zero_grad
        # set them to None): found with C-level loops only, this runs every step.
        if not any(map(_IS_NONE, current)) and set(map(type, current)) <= PLAIN_TYPES:
            try:
                now = list(map(_VERSION, current))
            except RuntimeError:  # (an inference tensor assigned as a gradient)
                now = None
            if now is not None and not any(map(operator.is_, map(_CALL, refs), current)):
                self._grad_refs = list(map(weakref.ref, current))
                self._grad_seen = now
                return list(range(len(current))), current
        indices: list[int] = []
        grads: list[Tensor] = []
        for index, grad in enumerate(current):
            if grad is None:
                continue
            version = _version(grad)
            # The same tensor object (not merely the same id: ids are reused), unchanged.
            if refs[index]() is grad and seen[index] == version:
                continue
            refs[index] = weakref.ref(grad)
            seen[index] = version
            indices.append(index)
            grads.append(local_shard(grad))  # (FSDP2: this rank's shard, no collective)
        return indices, grads

    def values(
        self, skip: Container[str] = (), always: bool = False
    ) -> tuple[list[Owned], list[Tensor]]:
        """Every parameter and floating buffer (but those named in ``skip``: masks), or
        nothing if none changed since last time (unless ``always``)."""
        # (Not a meta-device template, the torch.func ensembling recipe's: no values.)
        owned = [o for o, p in self.params if not p.is_meta]
        tensors: list[Tensor] = [p for _, p in self.params if not p.is_meta]
        for buf in self.buffers:
            if buf.name in skip:
                continue
            tensor = held(buf.owner._buffers, buf.local)
            if tensor is not None and tensor.is_floating_point() and not tensor.is_meta:
                owned.append(buf)
                tensors.append(tensor)
        versions = tuple((id(t), _version(t)) for t in tensors)
        if (
            not always
            and versions == self._value_versions
            and all(a is b for a, b in zip(self._value_tensors, tensors, strict=True))
        ):
            return [], []
        self._value_versions = versions
        self._value_tensors = tensors
        return owned, [local_shard(t) for t in tensors]

    def forget_versions(self) -> None:
        """Make the next ``values()`` return every tensor, changed or not."""
        self._value_versions = ()

    def stale(self) -> bool:
        """Whether a module now holds another tensor than the one listed, or the model
        holds parameters the table lacks: parameters replaced or added after the guard was
        built (``load_state_dict(assign=True)``, ``to()`` with
        ``torch.__future__.set_overwrite_module_params_on_conversion(True)``)."""
        if any(held(o.owner._parameters, o.local) is not p for o, p in self.params):
            return True
        if any(held(o.owner._buffers, o.local) is None for o in self.buffers):
            return True
        # ...or added (LoRA adapters injected after watch()), or held by a module put in
        # another's place (model.head = nn.Linear(...): the old head keeps its own).
        return frozenset(map(id, self._model.parameters())) != self.ids

    def renamed(self) -> bool:
        """Whether a module holding a listed parameter is named otherwise now (wrapped in a
        new parent, a ModuleList reordered): the table's names would be stale."""
        current = {id(m): n for n, m in module_names(self._model)}  # (as the table names them)
        for o, _ in self.params:
            prefix = o.name[: -len(o.local) - 1] if o.name != o.local else ""
            if current.get(id(o.owner), prefix) != prefix:
                return True
        return False

    def of_module(self, module: nn.Module) -> list[int]:
        """Indices of the parameters ``module`` holds (owns, or shares: a tied head)."""
        return self._by_module.get(id(module), [])
