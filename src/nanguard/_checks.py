"""Pure tensor functions: the cheap on-device probe and the exact failure-path statistics.

The probe is one reduction pass whose result is a 0-d tensor that stays on the
tensor's device: reading it is left to the once-per-step resolution.

* float32/float64 use ``sum``: one vectorised pass (fast on strided tensors too).
  A finite sum proves every element finite; a non-finite sum is only a
  suspicion (a sum of huge finite values can overflow), confirmed exactly before
  anyone is told.
* float16/bfloat16 use ``aminmax``: exact (NaN propagates, ``-inf``/``+inf`` land in
  min/max) and it gives the largest magnitude that the overflow-risk check needs;
  a float32 ``sum`` of a half tensor would first materialise a cast copy.
"""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Final

import torch
from torch import Tensor

from nanguard._events import TensorStats

__all__ = [
    "CHECKED_DTYPES",
    "NAN",
    "POSINF",
    "NEGINF",
    "INF",
    "PLAIN_TYPES",
    "bad_samples",
    "is_checked",
    "local_shard",
    "probe",
    "probe_all",
    "probe_source",
    "flags_of",
    "flags_of_tensor",
    "shape_of",
    "stored_values",
    "tensor_stats",
]

#: Bit flags of what a probe (or an exact check) found.
NAN: Final = 1
POSINF: Final = 2
NEGINF: Final = 4
INF: Final = POSINF | NEGINF

_SUM_DTYPES: Final = frozenset({torch.float32, torch.float64})
_HALF_DTYPES: Final = frozenset({torch.float16, torch.bfloat16})
_COMPLEX_DTYPES: Final = frozenset({torch.complex32, torch.complex64, torch.complex128})
_FLOAT8_DTYPES: Final = frozenset(
    getattr(torch, name)
    for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, name)
)
#: Dtypes that can hold NaN/Inf: the only ones probed.
CHECKED_DTYPES: Final = _SUM_DTYPES | _HALF_DTYPES | _COMPLEX_DTYPES | _FLOAT8_DTYPES


#: Tensor types that are their own values (not a DTensor or another subclass).
PLAIN_TYPES: Final = frozenset({Tensor, torch.nn.Parameter})


def local_shard(t: Tensor) -> Tensor:
    """A DTensor's (FSDP2's ``fully_shard``, tensor parallelism) values on this rank, else
    ``t``. Reading a whole DTensor runs collectives, which ranks on another code path (one
    that found nothing non-finite) would never join: nanguard reads each rank's shard."""
    if type(t) in PLAIN_TYPES:
        return t
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    if dtensor is not None and isinstance(t, dtensor):
        shard: Tensor = t.to_local()
        return shard
    return t


def is_checked(t: Tensor) -> bool:
    """Whether ``t`` holds values that can be non-finite (integer and bool tensors cannot)."""
    return t.dtype in CHECKED_DTYPES and not t.is_meta


def probe(t: Tensor) -> tuple[Tensor, ...]:
    """The cheap check: one reduction whose finiteness proves ``t`` finite.

    Returns one 0-d tensor (a sum) or two (min and max, for half precision),
    on ``t``'s device. Must be called with autograd disabled. Never syncs.
    """
    dtype = t.dtype
    if dtype in _SUM_DTYPES:
        return (t.sum(),)
    if dtype in _HALF_DTYPES:
        if t.numel() == 0:
            return ()
        return tuple(torch.aminmax(t))
    if t.is_complex():  # (z.conj() is a lazy view that view_as_real refuses: resolved)
        return (torch.view_as_real(t.resolve_conj()).sum(),)
    # float8 and other exotic floating types: reduce a float32 copy.
    return (t.float().sum(),)


def probe_all(tensors: list[Tensor]) -> tuple[list[Tensor], list[int]]:
    """Probe each tensor; returns all probe values and how many belong to each tensor."""
    values: list[Tensor] = []
    counts: list[int] = []
    for t in tensors:
        try:
            p = probe(t) if t.dtype in CHECKED_DTYPES and t.layout is torch.strided else ()
        except (RuntimeError, NotImplementedError):
            p = ()
        values.extend(p)
        counts.append(len(p))
    return values, counts


def flags_of(values: list[float]) -> int:
    """Flags from the host values of one probe (a sum, or a min and a max).

    A NaN sum may also be ``+inf + -inf``; it is reported as NaN until an exact
    check says otherwise.
    """
    flags = 0
    if not values:  # a site not probed (a sentinel step's inner call, seen by another guard)
        return flags
    if len(values) == 1:
        (v,) = values
        if math.isnan(v):
            flags = NAN
        elif v == math.inf:
            flags = POSINF
        elif v == -math.inf:
            flags = NEGINF
        return flags
    lo, hi = values
    if math.isnan(lo) or math.isnan(hi):
        return NAN
    if lo == -math.inf:
        flags |= NEGINF
    if hi == math.inf:
        flags |= POSINF
    return flags


def freed(t: Tensor) -> bool:
    """Whether ``t`` views more memory than its storage holds: FSDP frees a flat
    parameter's storage (resized to 0) and leaves its modules' views of it as attributes.
    Reading one would read freed memory (a crash)."""
    if not t.numel() or t.layout is not torch.strided or t.is_meta:
        return False
    try:
        held = t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # (no storage: a wrapper tensor)
        return False
    extent = sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride(), strict=True))
    return held < (t.storage_offset() + extent + 1) * t.element_size()


def flags_of_tensor(t: Tensor) -> int:
    """Exact flags of ``t`` (syncs; for the failure path). A view of freed memory (see
    :func:`freed`) is not read: 0."""
    x = _real_view(stored_values(t))
    if not x.numel() or freed(x):
        return 0
    try:  # one pass: the extremes tell all but a NaN's company
        lo, hi = (float(v) for v in torch.aminmax(x))
    except (RuntimeError, NotImplementedError):  # (a dtype without it)
        lo = hi = math.nan
    if not (math.isnan(lo) or math.isnan(hi)):
        return (NEGINF if lo == -math.inf else 0) | (POSINF if hi == math.inf else 0)
    flags = 0
    if bool(torch.isnan(x).any()):
        flags |= NAN
    if bool((x == math.inf).any()):
        flags |= POSINF
    if bool((x == -math.inf).any()):
        flags |= NEGINF
    return flags


def flags_of_stats(stats: TensorStats) -> int:
    """Exact flags from computed statistics."""
    flags = NAN if stats.nan_count else 0
    if stats.posinf_count:
        flags |= POSINF
    if stats.neginf_count:
        flags |= NEGINF
    return flags


def _real_view(t: Tensor) -> Tensor:
    return torch.view_as_real(t.resolve_conj()) if t.is_complex() else t


def stored_values(t: Tensor) -> Tensor:
    """The values ``t`` holds, as one strided tensor, detached.

    Sparse tensors give their stored values, nested tensors (``nn.TransformerEncoder``'s
    fast path with a padding mask) their components, flattened and joined: most
    reductions are not implemented for either layout.
    """
    t = local_shard(t.detach())
    if t.is_nested:
        parts = [c.reshape(-1) for c in t.unbind()]
        return torch.cat(parts) if parts else torch.empty(0, dtype=t.dtype, device=t.device)
    if t.layout is torch.sparse_coo:
        return t.coalesce().values()
    if t.layout is not torch.strided:  # compressed sparse layouts (CSR, CSC, BSR, BSC)
        return t.values()
    return t


def probe_source(t: Tensor) -> Tensor:
    """What to probe for a tensor whose own reductions are not implemented: a nested
    tensor padded with zeros (one kernel, no Python loop over its components; the zeros
    change no finiteness), or a sparse tensor's stored values."""
    if t.is_nested:
        x = t.detach()
        with contextlib.suppress(RuntimeError, NotImplementedError):
            x = x.sum(-1, keepdim=True)  # reduce the last dimension first: less to pad
        padded: Tensor = torch.nested.to_padded_tensor(x, 0.0)
        return padded
    if t.layout is torch.sparse_coo:  # (uncoalesced, as stored: the same finiteness)
        return local_shard(t.detach())._values()
    return stored_values(t)


def shape_of(t: Tensor) -> tuple[int, ...]:
    """``t``'s shape; a nested tensor's ragged dimensions are given as -1."""
    if not t.is_nested:
        return tuple(t.shape)
    shape = []
    for dim in range(t.dim()):
        try:
            shape.append(int(t.size(dim)))
        except RuntimeError:  # a ragged dimension
            shape.append(-1)
    return tuple(shape)


_BIG_FLOAT64: Final = 1e150  # float64 values whose squares are near overflow


def tensor_stats(t: Tensor, first: int = 10) -> TensorStats:
    """Exact statistics of ``t``: counts of NaN/+Inf/-Inf and the finite values' summary.

    Syncs the host: only for tensors that matter, after a failure was found. A DTensor's
    statistics are those of this rank's shard (shape included).
    """
    t = local_shard(t)
    with torch.no_grad():
        x = _real_view(stored_values(t))
        if x.dtype not in _SUM_DTYPES:
            x = x.float()
        flat = x.reshape(-1)
        if t.is_complex():  # counted per complex element (by its worst component)
            parts = flat.reshape(-1, 2)
            nan_at = torch.isnan(parts).any(-1)
            pos_at = (parts == math.inf).any(-1) & ~nan_at
            neg_at = (parts == -math.inf).any(-1) & ~nan_at & ~pos_at
            nan, posinf, neginf = int(nan_at.sum()), int(pos_at.sum()), int(neg_at.sum())
            # The finite summary: both components of the elements that are finite.
            finite = parts[torch.isfinite(parts).all(-1)].reshape(-1)
        elif not flags_of_tensor(flat):  # (one pass for a finite tensor)
            nan = posinf = neginf = 0
            finite = flat
        else:
            nan = int(torch.count_nonzero(torch.isnan(flat)))
            posinf = int(torch.count_nonzero(flat == math.inf))
            neginf = int(torch.count_nonzero(flat == -math.inf))
            finite = flat[torch.isfinite(flat)]
        # A sparse tensor's values not stored are zeros: they count in the summary.
        implicit = 0
        if t.layout is not torch.strided and not t.is_nested and not t.is_complex():
            implicit = max(t.numel() - flat.numel(), 0)
        lo = hi = mean = std = None
        if finite.numel():
            f64 = finite.double()
            lo = float(f64.min())
            hi = float(f64.max())
            # Scaled when the sum or the squares of huge float64 values would overflow.
            scale = max(abs(lo), abs(hi))
            scaled = f64 / scale if scale > _BIG_FLOAT64 else f64
            if implicit:
                lo, hi = min(lo, 0.0), max(hi, 0.0)
                n = scaled.numel() + implicit
                mean = float(scaled.sum()) / n
                std = math.sqrt(max(float((scaled * scaled).sum()) / n - mean * mean, 0.0))
            else:
                mean = float(scaled.mean())
                std = float(scaled.std(correction=0))
            if scale > _BIG_FLOAT64:
                mean, std = mean * scale, std * scale
        elif implicit:
            lo = hi = mean = std = 0.0
        values = tuple(float(v) for v in flat[:first].tolist())
    return TensorStats(
        shape=shape_of(t),
        dtype=str(t.dtype),
        device=str(t.device),
        numel=t.numel(),
        nan_count=nan,
        posinf_count=posinf,
        neginf_count=neginf,
        min=lo,
        max=hi,
        mean=mean,
        std=std,
        first_values=values,
    )


def bad_samples(
    t: Tensor, limit: int = 8, dim: int = 0, batch: int | None = None
) -> tuple[tuple[int, ...], int, int]:
    """Indices along ``dim`` of the samples holding NaN/Inf (the first ``limit``), how many
    samples hold them, and the size of ``dim`` (``((), 0, 0)`` for a 0-d or exotic tensor).
    A 1-D tensor only when ``batch`` (the batch size of the other inputs) is its length."""
    try:
        # (A 1-D input's entries are features or scalars as often as samples: named only
        # beside inputs with as many samples, a diffusion model's timesteps or log-SNRs.)
        one_d = t.dim() == 1 and batch is not None and batch > 1 and t.shape[0] == batch
        if (t.dim() <= 1 and not one_d) or t.layout is not torch.strided or t.is_nested:
            return (), 0, 0
        with torch.no_grad():
            x = torch.view_as_real(t.resolve_conj()) if t.is_complex() else t
            if dim >= x.dim() - (1 if t.is_complex() else 0):
                dim = 0
            x = x.detach().movedim(dim, 0)
            bad = (~torch.isfinite(x)).reshape(x.shape[0], -1).any(1)
            indices = bad.nonzero().flatten()
            first = tuple(int(i) for i in indices[:limit].tolist())
            return first, int(indices.numel()), x.shape[0]
    except (RuntimeError, NotImplementedError):
        return (), 0, 0
