"""The records every reporter and integration sees: :class:`Event` and :class:`TensorStats`.

Both are frozen dataclasses that round-trip through plain dicts (and so JSON):
non-finite floats are written as the strings ``"nan"``, ``"inf"`` and ``"-inf"``
so that every line nanguard writes is strict JSON.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["PHASES", "KINDS", "Event", "TensorStats"]

#: Where in a training step a finding was made.
PHASES: Final = ("input", "forward", "loss", "backward", "grad", "param")
#: What was found. ``"nan"`` when any NaN is present, else ``"inf"``; the other
#: kinds are warnings about finite values (see the README).
KINDS: Final = ("nan", "inf", "grad_norm", "amp_overflow", "overflow_risk")


def _float_to_json(x: float) -> float | str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def _optional_to_json(x: float | None) -> float | str | None:
    return None if x is None else _float_to_json(x)


def _float_from_json(x: float | str | int) -> float:
    return float(x)


def _optional_float(x: float | str | int | None) -> float | None:
    return None if x is None else float(x)


def _same_float(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or (math.isnan(a) and math.isnan(b))


def _json_safe(value: Any) -> Any:
    """Make ``value`` strict-JSON friendly: tuples become lists, non-finite floats strings."""
    if isinstance(value, float):
        return _float_to_json(value)
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class TensorStats:
    """Exact statistics of one tensor, computed only once a problem was found.

    ``min``, ``max``, ``mean`` and ``std`` describe the *finite* values (``None``
    when there are none); ``std`` is the population standard deviation.

    Example:
        >>> import torch
        >>> from nanguard import TensorStats
        >>> s = TensorStats.of(torch.tensor([1.0, float("nan"), float("-inf"), 3.0]))
        >>> (s.nan_count, s.inf_count, s.neginf_count, s.min, s.max)
        (1, 1, 1, 1.0, 3.0)
    """

    shape: tuple[int, ...]
    dtype: str
    device: str
    numel: int
    nan_count: int
    posinf_count: int
    neginf_count: int
    min: float | None
    max: float | None
    mean: float | None
    std: float | None
    first_values: tuple[float, ...]

    @property
    def inf_count(self) -> int:
        """Number of infinite values, of either sign."""
        return self.posinf_count + self.neginf_count

    @property
    def nonfinite_count(self) -> int:
        """Number of NaN and infinite values."""
        return self.nan_count + self.inf_count

    @property
    def finite_count(self) -> int:
        """Number of finite values."""
        return self.numel - self.nonfinite_count

    @classmethod
    def of(cls, tensor: Any) -> TensorStats:
        """Compute the exact statistics of ``tensor`` (syncs the host; for the failure path)."""
        from nanguard._checks import tensor_stats

        return tensor_stats(tensor)

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON-friendly dict; :meth:`from_dict` inverts it."""
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "device": self.device,
            "numel": self.numel,
            "nan_count": self.nan_count,
            "inf_count": self.inf_count,
            "posinf_count": self.posinf_count,
            "neginf_count": self.neginf_count,
            "min": _optional_to_json(self.min),
            "max": _optional_to_json(self.max),
            "mean": _optional_to_json(self.mean),
            "std": _optional_to_json(self.std),
            "first_values": [_float_to_json(v) for v in self.first_values],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TensorStats:
        """Rebuild the record written by :meth:`to_dict`."""
        return cls(
            shape=tuple(int(d) for d in data["shape"]),
            dtype=str(data["dtype"]),
            device=str(data["device"]),
            numel=int(data["numel"]),
            nan_count=int(data["nan_count"]),
            posinf_count=int(data["posinf_count"]),
            neginf_count=int(data["neginf_count"]),
            min=_optional_float(data.get("min")),
            max=_optional_float(data.get("max")),
            mean=_optional_float(data.get("mean")),
            std=_optional_float(data.get("std")),
            first_values=tuple(_float_from_json(v) for v in data.get("first_values", ())),
        )

    def __eq__(self, other: object) -> bool:
        # NaN in first_values must compare equal to itself, or a JSON round trip would not.
        if not isinstance(other, TensorStats):
            return NotImplemented
        scalars = ("shape", "dtype", "device", "numel", "nan_count", "posinf_count", "neginf_count")
        if any(getattr(self, n) != getattr(other, n) for n in scalars):
            return False
        floats = ("min", "max", "mean", "std")
        if not all(_same_float(getattr(self, n), getattr(other, n)) for n in floats):
            return False
        return len(self.first_values) == len(other.first_values) and all(
            _same_float(a, b) for a, b in zip(self.first_values, other.first_values, strict=True)
        )

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype, self.numel, self.nan_count, self.inf_count))

    def summary(self) -> str:
        """One line: counts, then the range of the finite values."""
        parts = []
        if self.nan_count:
            parts.append(f"{self.nan_count:,} NaN")
        if self.posinf_count:
            parts.append(f"{self.posinf_count:,} +Inf")
        if self.neginf_count:
            parts.append(f"{self.neginf_count:,} -Inf")
        counts = ", ".join(parts) if parts else "no non-finite value"
        shape = "(" + ", ".join(str(d) for d in self.shape) + ")"
        text = f"{counts} of {self.numel:,} values (shape {shape}, {self.dtype})"
        if self.min is None:
            return text + "; no finite value at all"
        return (
            f"{text}; finite values in [{self.min:.4g}, {self.max:.4g}], "
            f"mean {self.mean:.4g}, std {self.std:.4g}"
        )


@dataclasses.dataclass(frozen=True, slots=True)
class Event:
    """One finding: where a non-finite value was created, or reached, or a warning.

    The first ten fields are the stable contract that integrations build on.
    ``str(event)`` is a readable one-paragraph report (the ``message``).

    Attributes:
        step: training step (counted from 0 by optimizer steps or ``guard.step()``).
        phase: ``"input"``, ``"forward"``, ``"loss"``, ``"backward"``, ``"grad"`` or ``"param"``.
        module: qualified name as ``model.named_modules()`` gives it (``""`` is the
            model itself; ``names=`` overrides it), or ``None`` when no module is involved
            (a loss, a parameter group's learning rate or weight decay).
        module_type: class name of ``module``.
        param: qualified parameter name, for parameter findings.
        kind: ``"nan"`` when any NaN is present, else ``"inf"`` (or a warning kind).
        is_origin: ``True`` where the value was created, ``False`` where it only arrived.
        stats: exact statistics of the offending tensor, when they could be computed.
        rank: ``torch.distributed`` rank (0 without distributed training).
        message: the human-readable report.
        call: which call of ``module`` in its forward (0 for the first), for modules
            called several times (shared weights, loops).
        tensor: which tensor of the call: ``"output"``, ``"output[1]"``,
            ``"output.logits"``, ``"args[0]"``, ``"kwargs['mask']"``, ``"loss"``...
        propagated: for an origin, the first module calls the value reached afterwards.
        n_propagated: for an origin, how many module calls it reached in all.
        time: wall-clock time (``time.time()``) when the finding was resolved.
        details: further JSON-safe facts (e.g. non-finite parameters of the module).
        op: for an origin found by a replay, the aten operation that made the value
            (``"aten.log.default"``; in the backward, ``"aten.div.Tensor in SqrtBackward0"``).
        source: the user's source line of that operation, ``"file.py:12 in forward: code"``
            (for the backward, the forward line that created the failing node).
        hint: the most likely cause and what to try.
        reproducible: ``False`` when a replay of the step with exact checks saw only finite
            values (a nondeterministic kernel, a data race or a hardware fault);
            ``True`` when it reproduced the value; ``None`` when no replay ran.

    Example:
        >>> from nanguard import Event
        >>> e = Event(step=3, phase="loss", module=None, module_type=None, param=None,
        ...           kind="nan", is_origin=True, stats=None, rank=0, message="loss is NaN")
        >>> Event.from_dict(e.to_dict()) == e
        True
    """

    step: int
    phase: str
    module: str | None
    module_type: str | None
    param: str | None
    kind: str
    is_origin: bool
    stats: TensorStats | None
    rank: int
    message: str
    call: int | None = None
    tensor: str | None = None
    propagated: tuple[str, ...] = ()
    n_propagated: int = 0
    time: float = 0.0
    # (Left out of the hash: a dict is not hashable, and an event is, as a frozen dataclass.)
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    op: str | None = None
    source: str | None = None
    hint: str | None = None
    reproducible: bool | None = None

    def __str__(self) -> str:
        return self.message

    @property
    def where(self) -> str:
        """A short label: ``module`` (with its call index when not the first) or the phase."""
        if self.param:
            return self.param
        if self.module is None:
            return self.phase
        name = self.module if self.module else "<model>"
        return f"{name}#{self.call}" if self.call else name

    def to_dict(self) -> dict[str, Any]:
        """A strict-JSON-friendly dict; :meth:`from_dict` inverts it."""
        return {
            "step": self.step,
            "phase": self.phase,
            "module": self.module,
            "module_type": self.module_type,
            "param": self.param,
            "kind": self.kind,
            "is_origin": self.is_origin,
            "stats": None if self.stats is None else self.stats.to_dict(),
            "rank": self.rank,
            "message": self.message,
            "call": self.call,
            "tensor": self.tensor,
            "propagated": list(self.propagated),
            "n_propagated": self.n_propagated,
            "time": self.time,
            "details": _json_safe(dict(self.details)),
            "op": self.op,
            "source": self.source,
            "hint": self.hint,
            "reproducible": self.reproducible,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Event:
        """Rebuild the record written by :meth:`to_dict` (unknown keys are ignored)."""
        stats = data.get("stats")
        return cls(
            step=int(data["step"]),
            phase=str(data["phase"]),
            module=data.get("module"),
            module_type=data.get("module_type"),
            param=data.get("param"),
            kind=str(data["kind"]),
            is_origin=bool(data["is_origin"]),
            stats=None if stats is None else TensorStats.from_dict(stats),
            rank=int(data.get("rank", 0)),
            message=str(data.get("message", "")),
            call=data.get("call"),
            tensor=data.get("tensor"),
            propagated=tuple(data.get("propagated", ())),
            n_propagated=int(data.get("n_propagated", 0)),
            time=float(data.get("time", 0.0)),
            details=dict(data.get("details") or {}),
            op=data.get("op"),
            source=data.get("source"),
            hint=data.get("hint"),
            reproducible=data.get("reproducible"),
        )
