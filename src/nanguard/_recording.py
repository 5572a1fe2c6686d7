"""Hooks and the per-step probe buffer.

Every hooked module gets a forward pre-hook and a forward hook. They keep a
per-thread stack of module calls (so a tensor first seen entering a child is
known to come from its parent's own code), probe each tensor once per forward
(a tensor seen before is only referenced) and append the 0-d probe results to
the forward's record. No hook reads a tensor value: the buffer is resolved
once per step, by the guard.

This is the hot path of the library: a few microseconds per module call, so
the code favours local variables and inlined checks over small helpers.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Final

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from nanguard._checks import CHECKED_DTYPES, probe, tensor_stats
from nanguard._probes import ForwardRecord, Frame, HookedModule, Item, LossRecord, Site
from nanguard._tree import Path, collect

__all__ = ["Recorder", "HookedModule", "in_backward", "HOOK_MARK", "Modes"]

#: Attribute set on nanguard's hook functions, to find them on a module.
HOOK_MARK: Final = "__nanguard_hook__"

_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled
_new_site = tuple.__new__
_F32 = torch.float32
_SCALARS = (int, float, str, bool)

_cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized

# A forward that nobody ends (no optimizer, no guard.step()) is resolved after
# this many records, so that memory stays bounded.
MAX_PENDING_RECORDS: Final = 64


def in_backward() -> bool:
    """True while autograd runs a backward (e.g. a checkpointed forward being recomputed)."""
    return _graph_task_id() != -1


_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def _autocast_modes() -> tuple[tuple[str, torch.dtype], ...]:
    if not _any_autocast():
        return ()
    modes = []
    for device_type in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device_type):
                modes.append((device_type, torch.get_autocast_dtype(device_type)))
        except (TypeError, AttributeError, RuntimeError):  # torch < 2.4
            if device_type == "cpu" and torch.is_autocast_cpu_enabled():
                modes.append(("cpu", torch.get_autocast_cpu_dtype()))
            elif device_type == "cuda" and torch.is_autocast_enabled():
                modes.append(("cuda", torch.get_autocast_gpu_dtype()))
    return tuple(modes)


class Modes:
    """Autograd and autocast state at the start of a forward, for a faithful replay."""

    __slots__ = ("autocast", "grad", "inference")

    def __init__(self, grad: bool) -> None:
        self.grad = grad
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = _autocast_modes()


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[int] = []
        self.record: ForwardRecord | None = None
        self.capture: frozenset[int] | None = None  # replay: sites to compute stats for
        self.captured: ForwardRecord | None = None


class Recorder:
    """Owns the hooks and the step buffer of one guard."""

    def __init__(
        self,
        *,
        keep_inputs: bool,
        on_site: Callable[[ForwardRecord | LossRecord, int, Tensor], None] | None,
        on_record: Callable[[], None],
    ) -> None:
        self._keep_inputs = keep_inputs
        self._on_site = on_site  # sync="module": called after each new site
        self._on_record = on_record  # called when a record ends (may resolve)
        self._local = _Local()
        self._lock = threading.Lock()
        self._pending: list[Item] = []
        self._counter = itertools.count(1)  # next() on it is atomic
        self._handles: list[RemovableHandle] = []
        self.step = 0

    # ------------------------------------------------------------------ hooks
    def attach(self, modules: Iterable[HookedModule]) -> None:
        try:
            for hooked in modules:
                pre, post = self._make_hooks(hooked)
                m = hooked.module
                self._handles.append(m.register_forward_pre_hook(pre, with_kwargs=True))
                self._handles.append(
                    m.register_forward_hook(post, with_kwargs=True, always_call=True)
                )
        except BaseException:
            self.detach()
            raise

    def detach(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def _make_hooks(self, hooked: HookedModule) -> tuple[Callable[..., None], Callable[..., None]]:
        local = self._local
        start = self._start_record
        see = self._see
        see_all = self._see_all

        def pre_hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if _graph_task_id() != -1:  # a recomputation inside backward is not a new forward
                return
            stack = local.stack
            if stack:
                record = local.record
                parent = stack[-1]
            else:
                record = local.record = start(module, args, kwargs)
                parent = -1
            if record is None:
                return
            counts = record.counts
            call = counts.get(hooked, 0)
            counts[hooked] = call + 1
            frames = record.frames
            index = len(frames)
            inputs: list[int] = []
            paths: list[Path] = []
            frames.append(Frame(hooked, call, parent, inputs, paths))
            stack.append(index)
            for position, arg in enumerate(args):
                if isinstance(arg, Tensor):
                    see(record, index, inputs, paths, "input", ("args", position), arg)
                elif arg is not None and not isinstance(arg, _SCALARS):
                    see_all(record, index, inputs, paths, "input", ("args", position), arg)
            if kwargs:
                for name, arg in kwargs.items():
                    if isinstance(arg, Tensor):
                        see(record, index, inputs, paths, "input", ("kwargs", name), arg)
                    elif arg is not None and not isinstance(arg, _SCALARS):
                        see_all(record, index, inputs, paths, "input", ("kwargs", name), arg)

        def post_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
        ) -> None:
            if _graph_task_id() != -1:
                return
            stack = local.stack
            record = local.record
            if not stack or record is None:
                return  # hooks attached in the middle of a forward
            index = stack.pop()
            frames = record.frames
            if frames[index].hooked is not hooked:  # a forward raised and was caught
                while stack and frames[index].hooked is not hooked:
                    index = stack.pop()
            outputs = frames[index].outputs
            if isinstance(output, Tensor):
                see(record, index, outputs, None, "output", (), output)
            elif output is not None:
                see_all(record, index, outputs, None, "output", (), output)
            record.order.append(~index)
            if not stack:
                self._finish_record(record)

        setattr(pre_hook, HOOK_MARK, True)
        setattr(post_hook, HOOK_MARK, True)
        return pre_hook, post_hook

    def _see_all(
        self,
        record: ForwardRecord,
        frame: int,
        refs: list[int],
        paths: list[Path] | None,
        role: str,
        path: Path,
        obj: Any,
    ) -> None:
        found: list[tuple[Path, Tensor]] = []
        collect(obj, path, found)
        for sub_path, tensor in found:
            self._see(record, frame, refs, paths, role, sub_path, tensor)

    def _see(
        self,
        record: ForwardRecord,
        frame: int,
        refs: list[int],
        paths: list[Path] | None,
        role: str,
        path: Path,
        t: Tensor,
    ) -> None:
        """Reference ``t``'s site if it was probed in this forward, else probe it."""
        dtype = t.dtype
        if dtype not in CHECKED_DTYPES or t.is_meta:
            return  # integer/bool tensors cannot hold NaN/Inf
        seen = record.seen
        if seen is None:
            return
        key = id(t)
        entry = seen.get(key)
        version = _version(t)
        if entry is not None and entry[0]() is t and entry[2] == version:
            refs.append(entry[1])  # the same tensor, not modified in place since
            if paths is not None:
                paths.append(path)
            return
        grad = t.requires_grad and _is_grad_enabled()
        if grad:  # the probe must not join the autograd graph
            _set_grad_enabled(False)
        try:
            values = (t.sum(),) if dtype is _F32 else probe(t)
        except (RuntimeError, NotImplementedError):  # sparse, nested, exotic subclasses
            return
        finally:
            if grad:
                _set_grad_enabled(True)
        if not values:
            return
        site = len(record.sites)
        record_values = record.values
        record.sites.append(
            _new_site(Site, (frame, role, path, t.shape, dtype, len(record_values), len(values)))
        )
        record_values.extend(values)
        seen[key] = (weakref.ref(t), site, version)
        refs.append(site)
        if paths is not None:
            paths.append(path)
        if role == "input":
            record.order.append(site)
        targets = record.targets
        if targets is not None:
            if site in targets:
                record.stats[site] = tensor_stats(t)
        elif self._on_site is not None:
            self._on_site(record, site, t)

    # ---------------------------------------------------------------- records
    def _start_record(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ForwardRecord:
        record = ForwardRecord(next(self._counter), self.step)
        capture = self._local.capture
        if capture is not None:
            record.targets = capture
            return record
        record.modes = Modes(_is_grad_enabled())
        if self._keep_inputs:
            record.args = args
            record.kwargs = kwargs
            record.versions = versions(args, kwargs)
            record.rng = rng_state()
        return record

    def _finish_record(self, record: ForwardRecord) -> None:
        local = self._local
        local.record = None
        record.seen = None  # drop the weak references
        if record.targets is not None:
            local.captured = record
            return
        with self._lock:
            self._pending.append(record)
            many = len(self._pending) >= MAX_PENDING_RECORDS
        if many or not record.modes.grad:
            # An inference forward has no backward and no optimizer step: it is a
            # step of its own. Training forwards wait for the end of the step.
            self._on_record()

    def add_loss(self, loss: Tensor) -> LossRecord | None:
        """Probe a loss (no sync); ``None`` when it cannot hold NaN/Inf."""
        if loss.dtype not in CHECKED_DTYPES or loss.is_meta:
            return None
        with torch.no_grad():
            values = probe(loss)
        record = LossRecord(next(self._counter), self.step, loss.detach(), values)
        with self._lock:
            self._pending.append(record)
        if self._on_site is not None:
            self._on_site(record, 0, loss)
        return record

    def take_pending(self) -> list[Item]:
        with self._lock:
            items, self._pending = self._pending, []
        return items

    def pending_records(self) -> int:
        with self._lock:
            return len(self._pending)

    def reset_thread(self) -> None:
        """Forget a forward left unfinished by an exception in this thread."""
        self._local.stack = []
        self._local.record = None

    # ----------------------------------------------------------------- replay
    def capture(self, targets: frozenset[int]) -> Capture:
        """Context manager: the next top-level forward in this thread is a replay."""
        return Capture(self._local, targets)


class Capture:
    """Runs one forward as a replay: recorded apart, with statistics for ``targets``."""

    def __init__(self, local: _Local, targets: frozenset[int]) -> None:
        self._local = local
        self._targets = targets
        self._saved: tuple[list[int], ForwardRecord | None] = ([], None)
        self.record: ForwardRecord | None = None

    def __enter__(self) -> Capture:
        local = self._local
        self._saved = (local.stack, local.record)
        local.stack = []
        local.record = None
        local.capture = self._targets
        local.captured = None
        return self

    def __exit__(self, *exc: object) -> None:
        local = self._local
        self.record = local.captured
        local.capture = None
        local.captured = None
        local.stack, local.record = self._saved


def _version(t: Tensor) -> int:
    """The in-place modification counter; -1 for inference tensors (they have none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


def versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """In-place modification counters of the tensors passed to a forward."""
    out = [_version(a) for a in args if isinstance(a, Tensor)]
    if kwargs:
        out.extend(_version(a) for a in kwargs.values() if isinstance(a, Tensor))
    return tuple(out)


def rng_state() -> tuple[Tensor, list[Tensor] | None]:
    """CPU and (when in use) CUDA random generator states."""
    cuda = torch.cuda.get_rng_state_all() if _cuda_initialized() else None
    return torch.get_rng_state(), cuda
