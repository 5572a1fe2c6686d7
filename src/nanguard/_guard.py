"""The user-facing object: :func:`watch` and :class:`Guard`.

Attach and detach are symmetric and every exit path removes every hook. The
guard resolves the probe buffer once per step (one host sync), and only on
failure does more work: exact re-checks, the origin analysis, statistics, the
report and the policy.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import re
import sys
import time
import warnings
from collections.abc import Sequence
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from nanguard._analysis import Finding, analyze
from nanguard._checks import INF, flags_of, flags_of_stats, tensor_stats
from nanguard._errors import NanguardError, NonFiniteError, NonFiniteWarning
from nanguard._events import Event, TensorStats
from nanguard._log import EventLog, JsonlSink
from nanguard._options import Options, parse_options
from nanguard._probes import ForwardRecord, Item, LossRecord, input_label, site_label
from nanguard._recording import HOOK_MARK, HookedModule, Recorder
from nanguard._replay import replay
from nanguard._report import Origin, origin_message, propagated_message
from nanguard._tree import Path

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from nanguard._options import WatchOptions

__all__ = ["Guard", "watch", "AttachError"]

logger = logging.getLogger("nanguard")

_MASK_ARG = re.compile(r"mask|bias", re.IGNORECASE)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class AttachError(NanguardError, RuntimeError):
    """The guard cannot be attached (already attached, or the model is watched already)."""


AttachError.__module__ = "nanguard"


def _rank() -> int:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def _user_stacklevel() -> int:
    """Stack level of the first frame outside nanguard and torch (for warnings)."""
    frame: FrameType | None = sys._getframe(1)
    level = 1
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith((_PACKAGE_DIR, _TORCH_DIR)):
            return level
        frame = frame.f_back
        level += 1
    return 1


def _lookup(obj: Any, keys: Sequence[Any]) -> Any:
    for key in keys:
        if isinstance(obj, dict) or (isinstance(key, int) and isinstance(obj, (list, tuple))):
            obj = obj[key]
        else:
            obj = getattr(obj, key)
    return obj


def _host_values(values: list[Tensor]) -> list[float]:
    """All probe values as Python floats: the one host sync of a step (one per device)."""
    try:
        host: list[float] = torch.stack(values).tolist()
        return host
    except RuntimeError:  # probes on several devices
        pass
    out = [0.0] * len(values)
    groups: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(v.device, []).append(i)
    for indices in groups.values():
        host = torch.stack([values[i] for i in indices]).tolist()
        for i, x in zip(indices, host, strict=True):
            out[i] = x
    return out


def _finite(host: list[float]) -> bool:
    total = sum(host)  # a finite sum proves every value finite
    return math.isfinite(total) or all(math.isfinite(v) for v in host)


def _frame_label(name: str, call: int) -> str:
    return f"{name}#{call}" if call else name


class Guard:
    """Watches one model for NaN/Inf and reports where they are born.

    Create it with :func:`nanguard.watch` (attached at once) or ``Guard(model)``
    followed by :meth:`attach`. See :class:`nanguard.Options` for the options.

    Example:
        >>> import torch, nanguard
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
        >>> with nanguard.watch(model) as guard:
        ...     loss = guard.check_loss(model(torch.randn(2, 4)).sum())
        ...     loss.backward()
        ...     events = guard.step()
        >>> events, guard.origin is None
        ([], True)
        >>> guard.origin is None
        True
    """

    def __init__(self, model: nn.Module, **options: Unpack[WatchOptions]) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"nanguard.watch() takes a torch.nn.Module, got {type(model).__name__}")
        self._options: Options = parse_options(options)
        self._model = model
        self._log = EventLog(self._options.max_events)
        self._recorder = Recorder(
            keep_inputs=self._options.replay,
            on_site=self._check_site if self._options.sync == "module" else None,
            on_record=self._on_record,
        )
        self._optimizer_handles: list[RemovableHandle] = []
        self._sink: JsonlSink | None = None
        self._attached = False
        self._rank = 0
        self._arg_names: dict[type, tuple[str, ...]] = {}

    # --------------------------------------------------------------- lifecycle
    @property
    def options(self) -> Options:
        """The validated options."""
        return self._options

    @property
    def model(self) -> nn.Module:
        """The watched model."""
        return self._model

    @property
    def attached(self) -> bool:
        """Whether the hooks are in place."""
        return self._attached

    def attach(self) -> Guard:
        """Put the hooks in place. Returns ``self``.

        Raises:
            AttachError: this guard is attached already, or another guard watches the model.
        """
        if self._attached:
            raise AttachError("this guard is already attached; call guard.detach() first")
        for hook in self._model._forward_pre_hooks.values():
            if getattr(hook, HOOK_MARK, False):
                raise AttachError(
                    f"{type(self._model).__name__} is already watched by another nanguard "
                    "guard; detach that one first (guard.detach()) or keep using it"
                )
        self._rank = _rank()
        try:
            self._recorder.attach(self._hooked_modules())
            opt = self._options.optimizer
            if opt is not None:
                self._optimizer_handles = [
                    opt.register_step_pre_hook(self._before_optimizer_step),
                    opt.register_step_post_hook(self._after_optimizer_step),
                ]
            if self._options.log_path is not None:
                self._sink = JsonlSink(self._options.log_path.replace("{rank}", str(self._rank)))
        except BaseException:
            self._remove_hooks()
            raise
        self._attached = True
        return self

    def detach(self) -> None:
        """Resolve what is pending (reported, never raised) and remove every hook."""
        if not self._attached:
            return
        try:
            self._resolve(allow_raise=False)
        except Exception:  # never let a report break the user's exit path
            logger.exception("nanguard: resolving the last step failed")
        finally:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        self._recorder.detach()
        self._recorder.reset_thread()
        handles, self._optimizer_handles = self._optimizer_handles, []
        for handle in handles:
            handle.remove()
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        self._attached = False

    def __enter__(self) -> Guard:
        if not self._attached:
            self.attach()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self.detach()
            return
        try:
            self._resolve()
        finally:
            self._remove_hooks()

    def _hooked_modules(self) -> list[HookedModule]:
        """Modules in ``named_modules()`` order, excluded subtrees left out."""
        options = self._options
        hooked: list[HookedModule] = []
        seen: set[int] = set()

        def walk(module: nn.Module, name: str) -> None:
            if id(module) in seen:
                return
            seen.add(id(module))
            if options.exclude and options.exclude.matches(module, name):
                return
            display = options.names.get(module, name)
            hooked.append(HookedModule(module, display, options.allow_inf.matches(module, name)))
            for child_name, child in module._modules.items():
                if child is not None:
                    walk(child, f"{name}.{child_name}" if name else child_name)

        walk(self._model, "")
        return hooked

    # ------------------------------------------------------------ user calls
    def check_loss(self, loss: Tensor) -> Tensor:
        """Check a loss (no host sync; resolved with the step). Returns ``loss``.

        A non-finite loss computed from finite model outputs is an origin with
        phase ``"loss"``.
        """
        if not isinstance(loss, Tensor):
            raise TypeError(f"check_loss() takes a tensor, got {type(loss).__name__}")
        if self._attached:
            self._recorder.add_loss(loss)
        return loss

    def step(self) -> list[Event]:
        """End the training step: resolve its probes (one host sync) and count it.

        With ``optimizer=`` the optimizer's ``step()`` counts steps; then this only
        resolves. Returns the events of the step; raises with ``on_nonfinite="raise"``.
        """
        try:
            return self._resolve()
        finally:
            if self._options.optimizer is None:
                self._recorder.step += 1

    def check(self) -> list[Event]:
        """Resolve the probes recorded so far without ending the step."""
        return self._resolve()

    @property
    def current_step(self) -> int:
        """The index of the step in progress (0 until the first step ends)."""
        return self._recorder.step

    @property
    def events(self) -> list[Event]:
        """The events so far, oldest first (a copy)."""
        return self._log.snapshot()

    @property
    def origin(self) -> Event | None:
        """The first event with ``is_origin=True``, or ``None``."""
        return self._log.origin

    @property
    def dropped(self) -> int:
        """How many events the bounded log dropped."""
        return self._log.dropped

    def __repr__(self) -> str:
        state = "attached" if self._attached else "detached"
        return (
            f"<nanguard.Guard {type(self._model).__name__} {state}, step {self.current_step}, "
            f"{len(self._log.snapshot())} events>"
        )

    # ---------------------------------------------------------- hook targets
    def _before_optimizer_step(self, *_: Any) -> None:
        try:
            self._resolve()
        except BaseException:
            self._recorder.step += 1  # the step is over, even though it was aborted
            raise

    def _after_optimizer_step(self, *_: Any) -> None:
        self._recorder.step += 1

    def _on_record(self) -> None:
        self._resolve()

    def _check_site(self, record: ForwardRecord | LossRecord, site: int, tensor: Tensor) -> None:
        """``sync="module"``: check a new site at once (one host sync each)."""
        if record.reported:
            return
        s = record.sites[site]
        if _finite(_host_values(record.values[s.start : s.start + s.nvalues])):
            return
        record.stats[site] = tensor_stats(tensor)
        flags = [
            flags_of_stats(record.stats[i]) if i in record.stats else 0
            for i in range(len(record.sites))
        ]
        events = self._report([record], [flags], replay_ok=False)
        self._dispatch(events, allow_raise=True)

    # ------------------------------------------------------------- resolution
    def _resolve(self, *, allow_raise: bool = True) -> list[Event]:
        items = self._recorder.take_pending()
        if not items:
            return []
        values = [v for item in items for v in item.values]
        if not values:
            return []
        host = _host_values(values)
        if _finite(host):
            return []
        flags: list[list[int]] = []
        offset = 0
        for item in items:
            item_flags = []
            for i, site in enumerate(item.sites):
                if i in item.stats:
                    item_flags.append(flags_of_stats(item.stats[i]))
                else:
                    start = offset + site.start
                    item_flags.append(flags_of(host[start : start + site.nvalues]))
            flags.append(item_flags)
            offset += len(item.values)
        events = self._report(items, flags, replay_ok=True)
        self._dispatch(events, allow_raise=allow_raise)
        return events

    def _dispatch(self, events: list[Event], *, allow_raise: bool) -> None:
        if not events:
            return
        self._log.extend(events)
        if self._sink is not None:
            self._sink.write(events)
        policy = self._options.on_nonfinite
        # Each origin reaches the user once by default: as a log record under "log",
        # as the warning or the exception otherwise (then logged at INFO).
        origin_level = logging.WARNING if policy == "log" else logging.INFO
        for event in events:
            logger.log(origin_level if event.is_origin else logging.DEBUG, "%s", event.message)
        origins = [e for e in events if e.is_origin]
        if policy == "warn" or (policy == "raise" and not allow_raise):
            for event in origins:
                warnings.warn(NonFiniteWarning(event.message), stacklevel=_user_stacklevel())
        elif policy == "raise" and origins:
            raise NonFiniteError(origins[0])

    def _report(self, items: list[Item], flags: list[list[int]], *, replay_ok: bool) -> list[Event]:
        """Analysis, exact re-check of the origins, statistics, then events."""
        findings: list[Finding] = []
        for _ in range(8):  # each round refutes at least one false alarm, or stops
            findings = analyze(items, flags, self._is_mask_arg)
            refuted = False
            for f in findings:
                if not f.is_origin or items[f.item].reported:
                    continue
                stats = self._origin_stats(items[f.item], f, replay_ok)
                if stats is not None and stats.nonfinite_count == 0:
                    flags[f.item][f.site] = 0  # a sum of huge finite values overflowed
                    refuted = True
            if not refuted:
                break
        now = time.time()
        events: list[Event] = []
        per_item_shown: dict[int, int] = {}
        origin_names: dict[int, str] = {}
        for f in findings:
            item = items[f.item]
            if item.reported:
                continue
            if f.is_origin:
                event = self._origin_event(item, f, flags[f.item], now)
                origin_names[f.item] = event.where if event.module is not None else "the loss"
                events.append(event)
                continue
            shown = per_item_shown.get(f.item, 0)
            if f.reason != "loss" and shown >= self._options.max_propagated:
                continue
            per_item_shown[f.item] = shown + 1
            events.append(self._propagated_event(item, f, origin_names.get(f.item), now))
        for f in findings:
            if f.is_origin:
                items[f.item].reported = True
        return events

    # ----------------------------------------------------------------- stats
    def _origin_stats(self, item: Item, f: Finding, replay_ok: bool) -> TensorStats | None:
        if f.site in item.stats:
            return item.stats[f.site]
        if isinstance(item, LossRecord):
            item.stats[0] = tensor_stats(item.tensor)
            return item.stats[0]
        if f.reason == "input" and item.args is not None and item.kwargs is not None:
            path = item.sites[f.site].path
            root = item.args if path[0] == "args" else item.kwargs
            try:
                tensor = _lookup(root, path[1:])
            except (KeyError, IndexError, AttributeError, TypeError):
                tensor = None
            if isinstance(tensor, Tensor):
                item.stats[f.site] = tensor_stats(tensor)
                return item.stats[f.site]
        if not replay_ok:
            return None
        targets = {f.site}
        if f.reason == "output" and f.frame is not None:
            targets.update(item.frames[f.frame].inputs)
        result = replay(self._recorder, item, frozenset(targets))
        item.stats.update(result.stats)
        if result.problem is not None:
            item.problems[f.site] = result.problem
        return item.stats.get(f.site)

    def _is_mask_arg(self, record: ForwardRecord, frame: int, path: Path) -> bool:
        """Whether ``path`` names a mask-like argument of the frame's module."""
        if not path:
            return False
        if path[0] == "kwargs":
            return bool(_MASK_ARG.search(str(path[1])))
        module = record.frames[frame].module
        names = self._arg_names.get(type(module))
        if names is None:
            try:
                params = inspect.signature(module.forward).parameters.values()
                names = tuple(
                    p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                )
            except (TypeError, ValueError):
                names = ()
            self._arg_names[type(module)] = names
        position = path[1]
        return (
            isinstance(position, int)
            and position < len(names)
            and bool(_MASK_ARG.search(names[position]))
        )

    # ---------------------------------------------------------------- events
    def _origin_event(self, item: Item, f: Finding, flags: list[int], now: float) -> Event:
        stats = item.stats.get(f.site)
        kind = f.kind
        if stats is not None and stats.nonfinite_count:
            kind = "nan" if stats.nan_count else "inf"
        site = item.sites[f.site]
        details: dict[str, Any] = {"reason": f.reason}
        problem = item.problems.get(f.site)
        if stats is None and problem is None and f.reason in ("output", "own_code"):
            problem = "replay=False" if not self._options.replay else "no replay was possible"
        if problem is not None:
            details["stats_problem"] = problem
        origin = Origin(
            step=item.step,
            reason=f.reason,
            kind=kind,
            stats=stats,
            shape=tuple(site.shape),
            dtype=str(site.dtype),
            stats_problem=problem,
            loss_propagated=f.loss_propagated,
        )
        module = module_type = None
        call = None
        tensor = site_label(site)
        propagated: tuple[str, ...] = ()
        if isinstance(item, ForwardRecord) and f.frame is not None:
            frame = item.frames[f.frame]
            module, module_type, call = frame.name, frame.type_name, frame.call
            labels = [_frame_label(item.frames[i].name, item.frames[i].call) for i in f.propagated]
            propagated = tuple(labels[:10])
            origin.module, origin.module_type, origin.call = module, module_type, call
            origin.propagated, origin.n_propagated = propagated, len(labels)
            origin.tensor = tensor
            if f.reason == "own_code" and f.consumer is not None:
                consumer = item.frames[f.consumer]
                origin.consumer = _frame_label(consumer.name, consumer.call)
                details["passed_to"] = origin.consumer
                tensor = f"{tensor} of {origin.consumer}"
            if f.reason == "output":
                masks = {
                    i
                    for i, p in zip(frame.inputs, frame.input_paths, strict=True)
                    if flags[i] & INF and self._is_mask_arg(item, f.frame, p)
                }
                origin.inputs = [
                    (input_label(p), item.stats[i])
                    for i, p in zip(frame.inputs, frame.input_paths, strict=True)
                    if i in item.stats and i not in masks
                ][:4]
                origin.mask_inputs = [
                    input_label(p)
                    for i, p in zip(frame.inputs, frame.input_paths, strict=True)
                    if i in masks
                ]
                bad_params = _nonfinite_tensors(frame.module, frame.name)
                origin.nonfinite_params = bad_params
                if bad_params:
                    details["nonfinite_params"] = bad_params
        return Event(
            step=item.step,
            phase={"input": "input", "loss": "loss"}.get(f.reason, "forward"),
            module=module,
            module_type=module_type,
            param=None,
            kind=kind,
            is_origin=True,
            stats=stats,
            rank=self._rank,
            message=origin_message(origin),
            call=call,
            tensor=tensor,
            propagated=propagated,
            n_propagated=origin.n_propagated,
            time=now,
            details=details,
        )

    def _propagated_event(self, item: Item, f: Finding, origin: str | None, now: float) -> Event:
        if isinstance(item, LossRecord) or f.frame is None:
            return Event(
                step=item.step,
                phase="loss",
                module=None,
                module_type=None,
                param=None,
                kind=f.kind,
                is_origin=False,
                stats=None,
                rank=self._rank,
                message=propagated_message(item.step, f.kind, "the loss", None, origin),
                tensor="loss",
                time=now,
            )
        frame = item.frames[f.frame]
        where = f"`{frame.name}`" if frame.name else "the model"
        return Event(
            step=item.step,
            phase="forward",
            module=frame.name,
            module_type=frame.type_name,
            param=None,
            kind=f.kind,
            is_origin=False,
            stats=None,
            rank=self._rank,
            message=propagated_message(item.step, f.kind, where, frame.type_name, origin),
            call=frame.call,
            tensor=site_label(item.sites[f.site]),
            time=now,
        )


def _nonfinite_tensors(module: nn.Module, prefix: str) -> list[str]:
    """Own parameters and buffers of ``module`` that hold NaN/Inf (failure path)."""
    bad = []
    with torch.no_grad():
        for name, tensor in (
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ):
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad.append(f"{prefix}.{name}" if prefix else name)
    return bad


def watch(model: nn.Module, **options: Unpack[WatchOptions]) -> Guard:
    """Watch ``model`` for NaN/Inf; returns an attached :class:`Guard`.

    Use it as a context manager (hooks are removed on exit, whatever happens) or
    call :meth:`Guard.detach` yourself.

    Args:
        model: the ``torch.nn.Module`` to watch (every submodule is hooked).
        **options: see :class:`nanguard.Options`.

    Raises:
        TypeError: ``model`` is not a module, or an option is unknown or mistyped.
        ValueError: an option's value is not one of its valid values.

    Example:
        >>> import torch, nanguard
        >>> model = torch.nn.Linear(3, 1)
        >>> with nanguard.watch(model, on_nonfinite="log") as guard:
        ...     _ = model(torch.tensor([[1.0, float("nan"), 0.0]]))
        ...     _ = guard.step()
        >>> guard.origin.phase, guard.origin.module
        ('input', '')
    """
    return Guard(model, **options).attach()
