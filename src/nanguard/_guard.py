"""The user-facing object: :func:`watch` and :class:`Guard`.

Attach and detach are symmetric and every exit path removes every hook. The
guard resolves the probe buffer once per step (one host read), at the step's
end: the optimizer's step pre-hook (so that ``"raise"`` and ``"skip_step"`` act
before the weights change), ``guard.step()``, a ``GradScaler`` update on a step it
skipped, or the end of an inference forward. Only on failure does it do more.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import fnmatch
import functools
import gc
import logging
import math
import operator
import os
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any, Final

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.hooks import RemovableHandle

from nanguard._checks import flags_of_stats, flags_of_tensor, local_shard, tensor_stats
from nanguard._clip import Clip, listen, listen_errors, unlisten, unlisten_errors
from nanguard._errors import NanguardError, NonFiniteError, NonFiniteWarning, told
from nanguard._events import Event
from nanguard._hints import OpInfo
from nanguard._log import EventLog, JsonlSink
from nanguard._masks import mask_positions
from nanguard._options import _SCALER_TYPES, Matcher, Options, parse_options
from nanguard._params import is_compiled, module_names, plain_name, spellings
from nanguard._probes import ForwardRecord, Frame, HookedModule, LossRecord
from nanguard._recording import BATCH_STATS_NORMS as _BATCH_STATS_NORMS
from nanguard._recording import (
    HOOK_MARK,
    LINALG_ERRORS,
    CopySafeHook,
    Recorder,
    _is_compiling,
    graph_nodes,
    graph_reaches,
    is_passthrough,
    strip_inert_hooks,
)
from nanguard._recording import user_stacklevel as _user_stacklevel
from nanguard._replay import collective_problem, data_parallel, is_data_parallel, world_size
from nanguard._report import kind_word
from nanguard._resolution import (
    _TABLE_CHECK_EVERY,
    AmpObservation,
    Outcome,
    Resolver,
    all_finite,
    host_values,
    hyperparameter,
)
from nanguard._tree import Path, collect

if TYPE_CHECKING:
    from typing_extensions import Unpack

    from nanguard._options import WatchOptions

__all__ = ["AttachError", "Guard", "watch"]

logger = logging.getLogger("nanguard")

#: Kinds that are early warnings about finite values, not non-finite findings.
_WARNING_KINDS = frozenset({"grad_norm", "overflow_risk", "amp_overflow"})


class AttachError(NanguardError, RuntimeError):
    """The guard cannot be attached (already attached, or the model is watched already)."""


AttachError.__module__ = "nanguard"


def _rank() -> tuple[int, bool]:
    """This process's rank, and whether it is final (the process group exists).

    Before ``init_process_group`` (a guard attached to the model before it is wrapped),
    the ``RANK`` variable that torchrun sets is the best guess.
    """
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_rank()), True
    try:
        return int(os.environ.get("RANK", "0")), False
    except ValueError:
        return 0, False


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
    """

    def __init__(self, model: nn.Module, **options: Unpack[WatchOptions]) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"nanguard.watch() takes a torch.nn.Module, got {type(model).__name__}")
        if isinstance(model, torch.jit.ScriptModule):
            raise TypeError(
                "nanguard.watch() cannot hook a TorchScript module (torch.jit.script/trace "
                "modules take no hooks): watch the eager module, before scripting it"
            )
        self._options: Options = parse_options(options)
        self._model = model
        if self._options.names:
            inside = {id(m) for m in model.modules()}
            strangers = [m for m in self._options.names if id(m) not in inside]
            if strangers:
                raise ValueError(
                    f"names= has {len(strangers)} module(s) that are not inside the watched "
                    f"{type(model).__name__} (the first: {type(strangers[0]).__name__} named "
                    f"{self._options.names[strangers[0]]!r}); name modules of this model"
                )
        self._warn_unmatched()
        self._log = EventLog(self._options.max_events)
        module_mode = self._options.sync == "module"
        backward: str | bool = self._options.backward
        if backward is True:  # localise by replay when a replay is possible
            # (A sharded model (FSDP) is never replayed: its gathers are collectives.)
            sharded = collective_problem(model) is not None
            replays = self._options.replay and not sharded
            backward = "probes" if module_mode or not replays else "boundary"
        self._recorder = Recorder(
            keep_inputs=self._options.replay,
            backward="off" if backward is False else str(backward),
            on_site=self._check_site if module_mode else None,
            on_grad=self._check_grad if module_mode else None,
            on_record=self._on_record,
        )
        self._rank_known: int | None = None
        # A torch.compile wrapper: its own hooks run eagerly around the compiled call; the
        # original's run inside it and stand aside (a failing step is replayed eagerly).
        original = getattr(model, "_orig_mod", None)
        self._inner = original if isinstance(original, nn.Module) else model
        self._recorder.compiled = self._inner is not model
        self._recorder.step_ends = (
            self._options.optimizer is not None or self._options.scaler is not None
        )
        self._recorder.has_optimizer = self._options.optimizer is not None
        self._resolver = Resolver(self._inner, self._options, self._recorder, self._current_rank)
        self._resolver.rehook = self._rehook
        self._handles: list[RemovableHandle] = []
        self._pre_handle: RemovableHandle | None = None  # (on the optimizer= one's step)
        self._tree: list[nn.Module] = []  # the model's modules when last hooked
        self._scaler_update: Callable[..., None] | None = None
        self._zero_grad_wrapper: Callable[..., Any] | None = None  # skip_step, see there
        self._zero_grad_of: weakref.ref[torch.optim.Optimizer] | None = None
        self._scaler_previous: Callable[..., None] | None = None
        self._sink: JsonlSink | None = None
        self._sink_failed = False  # writing to log_path failed once: not tried again
        # Gradients a skipped step dropped, put back zeroed after it: (param, grad).
        self._dropped_grads: list[tuple[nn.Parameter, Tensor]] = []
        self._attached = False
        self._stepped = False  # the optimizer's pre-hook resolved this step
        optimizer = self._options.optimizer  # (its param groups: one added is a new head)
        self._groups = len(optimizer.param_groups) if optimizer is not None else 0
        self._skips = 0  # consecutive steps skipped by on_nonfinite="skip_step"
        # skip_step: the running statistics (BatchNorm) as the step's first training forward
        # found them, to put back when the step is dropped: (step, names, live, copies).
        self._stats_kept: tuple[int, list[str], list[Tensor], list[Tensor]] | None = None
        # skip_step: GradScaler's scale and growth count before its latest update()
        self._scaler_kept: tuple[Tensor, Tensor] | None = None
        # skip_step gave the gradients it dropped back as NaN to an optimizer GradScaler then
        # stepped (so that it skips it too): the scale update() backs off for it goes back.
        self._scaler_poisoned = False
        self._scaler_dropped: dict[int, nn.Parameter] = {}  # (see _skip)
        self._unscale_wrapper: Callable[..., Any] | None = None
        self._restore_if_bad: set[str] = set()  # of those, buffers put back only if non-finite
        if self._options.on_nonfinite == "skip_step":
            self._recorder.on_training_forward = self._keep_running_stats
        # The latest forward origin, with what its forwards returned (for other guards).
        # This guard's latest origin: (event, output and input shapes of its forwards, when).
        self._recent: tuple[Event, _Shapes, tuple[weakref.ref[Tensor], ...], float] | None = None
        self._recent_nodes: tuple[int, ...] = ()  # ...and the ids of the nodes that made them
        # An origin of a validation forward found at a training step's end, raised once the
        # step's finite update is applied (see _dispatch), and whether one may wait so.
        self._deferred: Event | None = None
        self._deferring = False
        # This guard's latest loss origin: (event, ids of its graph's top nodes, when).
        self._recent_loss: tuple[Event, frozenset[int], float] | None = None
        self._advanced_at = time.monotonic()  # when this guard's last step ended
        # Optimizer updates of the watched weights at the step's first training forward.
        self._updates_at_forward: tuple[int, int] | None = None  # (step, updates)
        # Optimizers seen stepping: (number of param groups, whether they hold our weights).
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, bool]]
        self._optimizers = weakref.WeakKeyDictionary()
        # Steps of other optimizers over the watched weights since the guard's own stepped.
        self._foreign_steps = 0
        # Another optimizer's steps in a row since optimizer= last stepped (the same one's),
        # the longest such run seen, and optimizer='s own steps: whether it took over.
        self._run_of: weakref.ref[torch.optim.Optimizer] | None = None
        self._run_length = 0
        self._longest_run = 0
        self._guard_steps = 0
        self._warned_switch = False
        self._uncounted = 0  # another optimizer's steps since the last step ended
        # With no optimizer=, scaler= or guard.step(): each optimizer's steps since the last
        # step ended, and the one whose steps end them once that is seen (see _forgotten).
        self._unended: weakref.WeakKeyDictionary[torch.optim.Optimizer, int]
        self._unended = weakref.WeakKeyDictionary()
        self._ending: weakref.ref[torch.optim.Optimizer] | None = None
        self._summaries = 0  # steps in a row with nothing new since the latest origin
        # (Removes torch's global hook if the guard is collected while attached.)
        self._finalizer: weakref.finalize[[], Guard] | None = None
        self._loading: nn.Module | None = None  # whose load_state_dict() is running
        self._load_marks: dict[str, tuple[int, int]] = {}  # ...and the weights before it
        self._warned_foreign = False
        self._warned_unseen = False  # a step ended with no recorded call of the model
        self._replaced: tuple[tuple[int, tuple[int, ...]], bool] | None = None
        self._lock = threading.RLock()

    # --------------------------------------------------------------- lifecycle
    # A guard stored on its model (``self.guard = nanguard.watch(self)``) goes where the
    # model goes: an EMA or a target network made by ``copy.deepcopy(model)`` shares it (it
    # watches the live model; its hooks and locks are not copied)...
    def __copy__(self) -> Guard:
        return self

    def __deepcopy__(self, memo: dict[int, Any]) -> Guard:
        return self

    def __reduce__(self) -> tuple[Callable[[], None], tuple[()]]:
        # ...and ``torch.save(model)`` (or a spawned process given the model) saves none:
        # loaded, the attribute is None, as the copy's hooks are inert.
        return _no_guard, ()

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
        # One guard per model: not on a model another guard watches, on a model inside one
        # or holding one, nor on one sharing a module with another guard's model (a shared
        # embedding): each guard's hooks there would record the other's calls.
        mine = {id(m) for m in self._model.modules()}
        for other in list(_ATTACHED):
            roots = {id(other._model), id(other._inner)}
            if roots & mine or any(m is self._model for m in other._model.modules()):
                what = (
                    "it is"
                    if id(self._model) in roots
                    else f"a model inside it ({type(other._model).__name__}) is"
                    if roots & mine
                    else f"a model holding it ({type(other._model).__name__}) is"
                )
                raise AttachError(
                    f"{type(self._model).__name__} cannot be watched: {what} already watched "
                    "by another nanguard guard; detach that one first (guard.detach(), or "
                    "nanguard.unwatch(model) if it was lost) or keep using it"
                )
        for name, module in module_names(self._model):
            if name and is_passthrough(module):
                continue  # (a shared activation's hooks act only inside their guard's forward)
            if any(
                getattr(hook, HOOK_MARK, False)
                for hook in (*module._forward_pre_hooks.values(), *module._forward_hooks.values())
            ):
                what = (
                    f"its submodule `{name}` is hooked by another nanguard guard (a module "
                    "shared with a model that guard watches: watch the model that holds both)"
                    if name
                    else "it is already watched by another nanguard guard"
                )
                raise AttachError(
                    f"{type(self._model).__name__} cannot be watched: {what}; detach that one "
                    "first (guard.detach(), or nanguard.unwatch(model) if it was lost) or keep "
                    "using it"
                )
        if self._options.sync == "module" and world_size() > 1:
            warnings.warn(
                "nanguard: sync='module' checks each module inside the forward, so a rank "
                "raises alone, before the gradient all-reduce, and the other ranks wait for it "
                "in their next collective; sync='step' stops every rank in the same step",
                RuntimeWarning,
                stacklevel=3,
            )
        try:
            self._resolver.monitor.reset()  # (attached again: perhaps for a new run)
            self._resolver.most_grads = 0
            self._resolver.note_present_grads()
            size = sum(
                p.numel() * p.element_size() for p in self._model.parameters() if not is_lazy(p)
            )
            self._recorder.kept_budget = max(64 << 20, size // 10)
            self._recorder.input_budget = max(128 << 20, size // 10)
            self._recorder.attach(self._hooked_modules(), full=self._full_step())
            self._resolver.note_masks()  # (after: which modules allow Inf is known)
            self._note_buffers()
            opt = self._options.optimizer
            if opt is not None:
                self._warn_foreign_optimizer(opt)
                # (Run eagerly when the optimizer's step is compiled, torch.compile's recipe
                # for a faster step: the resolution reads the host and takes locks.)
                self._pre_handle = opt.register_step_pre_hook(
                    _eager_hook(self._before_optimizer_step)
                )
                self._handles = [self._pre_handle]
            # After load_state_dict() on the model or on one of its modules (a backbone's
            # pretrained weights): what it wrote is the checkpoint's. Every module's load
            # runs its hooks; the call's own module is the one loaded with prefix "" (or the
            # model, loaded by what holds it).
            # (A TorchScript part takes no hooks: a load into it is not seen.)
            for module in self._model.modules():
                if isinstance(module, torch.jit.ScriptModule):
                    continue
                self._handles.append(
                    module._register_load_state_dict_pre_hook(  # type: ignore[no-untyped-call]
                        CopySafeHook(self._before_load), with_module=True
                    )
                )
                self._handles.append(
                    module.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
                        CopySafeHook(self._after_load)
                    )
                )
            # After any optimizer's step: the guard's own ends the training step; another that
            # moves the watched weights is counted (to tell whether a weight found corrupted
            # was corrupted before or after the step's forward). One hook for both: it runs
            # every step, after the optimizer's own post-hooks.
            # (Held weakly: torch keeps this hook in a global dict, which would keep a guard
            # never detached, and its model, alive for the rest of the process.)
            handle = register_optimizer_step_post_hook(_eager_hook(_weakly(self._after_step)))
            self._finalizer = weakref.finalize(self, handle.remove)
            self._handles.append(handle)
            if self._options.scaler is not None:
                self._wrap_scaler()
                self._recorder.scaler_known = True
            if self._options.on_nonfinite == "skip_step" and self._options.optimizer is not None:
                self._wrap_zero_grad(self._options.optimizer)
            # The norms clip_grad_norm_ sees before it scales the gradients down (for the
            # gradient-norm guard; and a NaN one made every gradient NaN, on a failure).
            listen(self._on_clip)
            listen_errors(self._on_clip_error)
            self._sink_failed = False
            if self._options.log_path is not None and (
                "{rank}" not in self._options.log_path or _rank()[1]
            ):
                self._open_sink()  # else at the first event, once the rank is known
            else:
                self._check_sink_dir()
        except BaseException:
            self._remove_hooks()
            raise
        self._attached = True
        _ATTACHED.add(self)
        if self._options.scaler is None:
            self._warn_unpassed_scaler()
        if len(_ATTACHED) > 1:  # several guards: tell which model's outputs feed which
            for guard in _ATTACHED:
                guard._recorder.track_outputs = True
        return self

    def _warn_unpassed_scaler(self) -> None:
        """A GradScaler in the caller's scope (or its ``self``) that watch() was not given:
        the overflows it skips on purpose may be reported as non-finite gradients."""
        try:  # (a hint: nothing in the user's scope may break watch())
            name = _scaler_in_scope(sys._getframe(1))
        except Exception:
            name = None
        if name is not None:
            warnings.warn(
                f"nanguard: a GradScaler (`{name}`) is in scope but was not passed to "
                f"nanguard.watch(): pass scaler={name}, or the overflowing steps it skips on "
                "purpose may be reported as non-finite gradients",
                RuntimeWarning,
                stacklevel=_user_stacklevel(),
            )

    def _warn_foreign_optimizer(self, opt: torch.optim.Optimizer) -> None:
        """optimizer= should step the watched weights: its pre-hook is where a step with
        bad gradients is stopped before they move."""
        trained = {id(p) for p in self._inner.parameters() if p.requires_grad}
        if trained and not any(id(p) in trained for g in opt.param_groups for p in g["params"]):
            warnings.warn(
                f"nanguard: the optimizer= passed to watch() ({type(opt).__name__}) holds none "
                f"of the watched {type(self._model).__name__}'s trainable parameters: its "
                "step() still ends nanguard's steps, but the optimizer that updates this model "
                "steps unchecked. Pass that optimizer.",
                RuntimeWarning,
                stacklevel=_user_stacklevel(),
            )

    def _current_rank(self) -> int:
        if self._rank_known is not None:
            return self._rank_known
        rank, final = _rank()
        if final:
            self._rank_known = rank
        return rank

    def _open_sink(self) -> None:
        path = self._options.log_path
        if path is not None and self._sink is None and not self._sink_failed:
            self._sink = JsonlSink(path.replace("{rank}", str(self._current_rank())))

    def _check_sink_dir(self) -> None:
        """A ``{rank}`` template's file opens at the first event: its directory is made and
        checked now, so a path that cannot be written fails at ``watch()``, not in a step."""
        path = self._options.log_path
        if path is None:
            return
        directory = os.path.dirname(os.path.abspath(path))
        if "{rank}" in directory:
            return
        os.makedirs(directory, exist_ok=True)
        if not os.access(directory, os.W_OK):
            raise PermissionError(f"nanguard: log_path {path!r}: cannot write in {directory!r}")

    def _write_sink(self, events: list[Event]) -> None:
        """Write to ``log_path``; a failure (disk full, the file's directory gone) is warned
        about once and ends the writing: the events stay in ``guard.events``, the training
        goes on."""
        try:
            if self._attached:
                self._open_sink()
            if self._sink is not None:
                self._sink.write([e for e in events if self._sink_keeps(e)])
        except OSError as err:
            sink, self._sink = self._sink, None
            self._sink_failed = True
            if sink is not None:
                with contextlib.suppress(OSError):
                    sink.close()
            warnings.warn(
                f"nanguard: cannot write to log_path {self._options.log_path!r} ({err}): no "
                "more events are written there; they are kept in guard.events.",
                RuntimeWarning,
                stacklevel=_user_stacklevel(),
            )

    def detach(self) -> None:
        """Resolve what is pending (reported, never raised) and remove every hook."""
        if not self._attached:
            return
        try:
            self._resolve(step_end=True, allow_raise=False, final=True)
        except Exception:  # never let a report break the user's exit path
            logger.exception("nanguard: resolving the last step failed")
        finally:
            self._remove_hooks()

    def _remove_hooks(self) -> None:
        unlisten(self._on_clip)
        unlisten_errors(self._on_clip_error)
        self._resolver.clips = []
        self._dropped_grads = []  # (a step that raised after skip_step dropped them)
        self._recorder.detach()
        self._recorder.reset_thread()
        for record in self._recorder.take_pending():
            if isinstance(record, ForwardRecord):
                _remove_leaf_hooks(record)
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        scaler = self._options.scaler
        if scaler is not None and scaler.__dict__.get("update") is self._scaler_update:
            # Back to the newest wrapper of a guard still attached (two guards sharing the
            # scaler), else to the class's method.
            _unwrap(scaler, "update", self._scaler_previous)
        if self._scaler_update is not None:
            # (A wrapper of a guard attached later calls this one, which now passes through.)
            self._scaler_update._nanguard_active = False  # type: ignore[attr-defined]
        self._scaler_update = None
        self._scaler_previous = None
        self._unwrap_unscale()
        self._unwrap_zero_grad()
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        self._attached = False
        _ATTACHED.discard(self)
        _DETACHED.append(weakref.ref(self))

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
            self._resolve(step_end=True, final=True)
        finally:
            self._remove_hooks()

    def _warn_unmatched(self) -> None:
        """A name pattern in ``exclude=``/``allow_inf=`` that matches no module would do
        nothing, silently: a class name written as a string, say."""
        wrapped = is_data_parallel(self._model)
        names = [n for raw, _ in self._model.named_modules() for n in spellings(raw, wrapped)]
        types = {type(m).__name__ for m in self._model.modules()}
        for option in ("exclude", "allow_inf"):
            for pattern in getattr(self._options, option).patterns:
                if any(fnmatch.fnmatchcase(n, pattern) for n in names):
                    continue
                typed = (
                    f"; to match the type {pattern}, pass the class itself"
                    if pattern in types
                    else ""
                )
                warnings.warn(
                    f"nanguard: {option}= pattern {pattern!r} matches no module of this "
                    f"{type(self._model).__name__}: patterns are globs over the names "
                    f"named_modules() gives ('encoder.*.dropout'){typed}",
                    UserWarning,
                    stacklevel=_user_stacklevel(),
                )

    def _hooked_modules(self) -> list[HookedModule]:
        """Modules in ``named_modules()`` order, excluded subtrees left out (and whether
        any is compiled noted)."""
        options = self._options
        hooked: list[HookedModule] = []
        seen: set[int] = set()
        wrapped = is_data_parallel(self._model)

        def walk(module: nn.Module, raw: str) -> None:
            if id(module) in seen:
                return
            seen.add(id(module))
            # Names as the eager model gives them (plain_name drops a compiled module's
            # "_orig_mod"); exclusions and allow-lists match either spelling.
            # (and as the user's model gives them inside a DDP or FSDP wrapper watched
            # whole: exclude=("head",) for `module.head`).
            name = plain_name(raw)
            names = spellings(raw, wrapped)

            def matches(rule: Matcher) -> bool:
                return any(rule.matches(module, n) for n in names)

            if options.exclude and matches(options.exclude):
                return
            if isinstance(module, torch.jit.ScriptModule):
                return  # takes no hooks: checked as part of its parent, like an exclusion
            display = options.names.get(module, name)
            allow_inf = matches(options.allow_inf)
            passthrough = module is not self._model and not allow_inf and is_passthrough(module)
            masks = frozenset() if passthrough else mask_positions(module)
            hooked.append(HookedModule(module, display, allow_inf, passthrough, masks))
            for child_name, child in module._modules.items():
                if child is not None:
                    walk(child, f"{raw}.{child_name}" if raw else child_name)

        walk(self._model, "")
        self._tree = list(self._model.modules())  # (what _rehook compares with)
        # Compiled submodules too: the modules inside them take no hooks in the compiled
        # code, so a failing step is replayed with every module eager (as for a compiled
        # model).
        self._recorder.compiled = any(is_compiled(h.module) for h in hooked)
        return hooked

    def _wrap_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """skip_step: observe ``optimizer.zero_grad()`` (no hook exists for it; wrapped on
        this instance while attached). Zeroing the gradients after a forward's backward
        drops that batch: a loop skipping a bad batch itself (``if not
        torch.isfinite(norm): opt.zero_grad(); continue``), not one that sanitises the
        gradients (``nan_to_num``), whose step still applies them."""
        # (No strong reference to the optimizer: one the user drops, replaced by a second
        # stage's, must go, for that one to take over as the end of the steps.)
        # (Nor to the guard: one never detached goes with its last reference, and its
        # global optimizer hook with it.)
        previous = optimizer.__dict__.get("zero_grad")
        ref = weakref.ref(optimizer)
        guard_ref = weakref.ref(self)

        def zero_grad(*args: Any, **kwargs: Any) -> Any:
            guard = guard_ref()
            if guard is not None and zero_grad is guard._zero_grad_wrapper and guard._attached:
                for record in guard._recorder.pending():
                    if isinstance(record, ForwardRecord) and record.grads:
                        record.grads_zeroed = True
            if previous is not None:  # (another guard's wrapper, or a library's)
                return previous(*args, **kwargs)
            owner = ref()
            return type(owner).zero_grad(owner, *args, **kwargs) if owner is not None else None

        zero_grad._nanguard_active = True  # type: ignore[attr-defined]
        zero_grad._nanguard_previous = previous  # type: ignore[attr-defined]
        optimizer.__dict__["zero_grad"] = zero_grad
        self._zero_grad_wrapper = zero_grad
        self._zero_grad_of = ref

    def _unwrap_zero_grad(self) -> None:
        wrapper, ref = self._zero_grad_wrapper, self._zero_grad_of
        self._zero_grad_wrapper = self._zero_grad_of = None
        optimizer = ref() if ref is not None else None
        if wrapper is not None:
            wrapper._nanguard_active = False  # type: ignore[attr-defined]
        if wrapper is None or optimizer is None:
            return
        if optimizer.__dict__.get("zero_grad") is wrapper:  # (two guards sharing it)
            _unwrap(optimizer, "zero_grad", getattr(wrapper, "_nanguard_previous", None))

    def _wrap_unscale(self) -> None:
        """Wrap ``scaler.unscale_`` (which ``scaler.step()`` calls) on the instance until the
        next ``update()``: it gives the gradients skip_step dropped back as NaN to an
        optimizer GradScaler steps (see ``_skip``)."""
        scaler = self._options.scaler
        if scaler is None or self._unscale_wrapper is not None:
            return
        original = scaler.unscale_
        previous = scaler.__dict__.get("unscale_")

        def unscale_(optimizer: torch.optim.Optimizer) -> Any:
            dropped = self._scaler_dropped if unscale_ is self._unscale_wrapper else {}
            for group in optimizer.param_groups if dropped else ():
                for param in group["params"]:
                    if param.grad is None and id(param) in dropped:
                        param.grad = torch.full_like(param, math.nan)
                        self._scaler_poisoned = True
            return original(optimizer)

        unscale_._nanguard_previous = previous  # type: ignore[attr-defined]
        scaler.__dict__["unscale_"] = unscale_
        self._unscale_wrapper = unscale_

    def _unwrap_unscale(self) -> None:
        wrapper, self._unscale_wrapper = self._unscale_wrapper, None
        self._scaler_dropped = {}
        scaler = self._options.scaler
        if wrapper is None or scaler is None:
            return
        wrapper._nanguard_active = False  # type: ignore[attr-defined]
        if scaler.__dict__.get("unscale_") is wrapper:
            _unwrap(scaler, "unscale_", getattr(wrapper, "_nanguard_previous", None))

    def _wrap_scaler(self) -> None:
        """Observe ``scaler.update()``: GradScaler has no hooks, so its bound method is
        wrapped on this instance while the guard is attached (restored on detach)."""
        scaler = self._options.scaler
        assert scaler is not None
        original = scaler.update  # (another guard's wrapper, when two share the scaler)
        self._scaler_previous = scaler.__dict__.get("update")

        def update(new_scale: Any = None) -> None:
            # Not attached any more (detached under another guard's later wrapper), or
            # GradScaler(enabled=False), whose update() does nothing: pass through.
            if update is not self._scaler_update or not scaler.is_enabled():
                original(new_scale)
                return
            states = scaler._per_optimizer_states
            # This guard's optimizer's flags first: a GAN's two optimizers share one scaler,
            # and one overflowing skips only its own step (the other's overflow is expected
            # all the same: its backward may run through this model). A wrapper (accelerate's
            # AcceleratedOptimizer) steps the optimizer it holds.
            opt = self._options.optimizer  # (read now: another may have taken over)
            if opt is not None and id(opt) not in states:
                inner = getattr(opt, "optimizer", None)
                if isinstance(inner, torch.optim.Optimizer) and id(inner) in states:
                    opt = inner
                elif self._stepped:  # its step() ran, and stepped another through the
                    opt = None  # scaler: a wrapper, its flags are this guard's
            first = opt is not None and id(opt) in states
            order = [id(opt), *(k for k in states if k != id(opt))] if first else list(states)
            # (Copies: update() adds the other optimizers' flags into the first one's.)
            found = [v.clone() for k in order for v in states[k]["found_inf_per_device"].values()]
            if first:
                own = len(states[id(opt)]["found_inf_per_device"])
            else:  # its optimizer did not step since the last update (a WGAN's n_critic)
                own = len(found) if opt is None else 0
            current = scaler._scale
            before = current.detach().clone() if current is not None else None
            tracker = scaler._growth_tracker
            skipping = self._options.on_nonfinite == "skip_step"
            if skipping and tracker is not None and before is not None:
                # (What update() changes, for a skip that puts the scale back.)
                self._scaler_kept = (before, tracker.detach().clone())
            try:
                original(new_scale)
            finally:
                self._unwrap_unscale()  # (the skipped step's gradients are stepped or gone)
            after = scaler._scale
            if before is not None and after is not None and found:
                self._after_scaler_update(AmpObservation(before, after, found, own))

        update._nanguard_active = True  # type: ignore[attr-defined]
        update._nanguard_previous = self._scaler_previous  # type: ignore[attr-defined]
        scaler.__dict__["update"] = update
        self._scaler_update = update

    # ------------------------------------------------------------ user calls
    def check_loss(self, loss: Tensor) -> Tensor:
        """Check a loss (no host sync; resolved with the step). Returns ``loss``.

        A non-finite loss computed from finite model outputs is an origin with
        phase ``"loss"``.
        """
        if _is_compiling():
            # Inside a compiled function (no graph break): unchecked, but for the gradient it
            # sends into the model's outputs.
            return loss
        if not isinstance(loss, Tensor):
            raise TypeError(f"check_loss() takes a tensor, got {type(loss).__name__}")
        if self._attached:
            self._recorder.add_loss(loss)
            if self._resolver.stepped_since_loss:
                self._resolver.stepped_since_loss = []
        return loss

    def step(self) -> list[Event]:
        """End the training step: resolve its probes (one host sync) and count it.

        With ``optimizer=`` the optimizer's ``step()`` counts steps; then this only
        resolves. With an enabled ``scaler=``, ``scaler.update()`` ends and resolves the step:
        this does nothing. Returns the events of the step; raises with
        ``on_nonfinite="raise"``.
        """
        counts = self._options.optimizer is None and self._options.scaler is None
        self._recorder.step_ends = True
        scaler = self._options.scaler
        if scaler is not None and scaler.is_enabled():
            # The step ends at scaler.update(), which knows whether scaler.step() skipped
            # it: the scaled gradients' overflow it expects is no error (and any non-finite
            # gradient makes it skip, so no weight moves before the resolution there).
            return []
        if (
            counts
            and self._recorder.forwards == 0
            and not self._warned_unseen
            and any(p.grad is not None for p in self._inner.parameters())
        ):  # (as at an optimizer's step: gradients, but no call of the model seen)
            self._warn_unseen()
        if (
            counts
            and self._resolver.present_grads
            and (self._recorder.training_forwards or not self._recorder.forwards)
        ):  # (a training step, or none of the model's calls: opt.step() applies .grad next)
            self._resolver.check_present_grads()
        try:
            # (Ending the step, as optimizer= would: every rank acts in the same step.)
            outcome = self._resolve_agreed() if counts else self._resolve(step_end=True)
            if counts and self._options.on_nonfinite == "skip_step":
                # (Called before optimizer.step(): with no gradients, it moves nothing.)
                at_forward = self._updates_at_forward
                moved = (
                    at_forward is not None
                    and at_forward[0] == self._recorder.step
                    and self._recorder.updates != at_forward[1]
                )
                skip = self._skip_agreed(outcome.bad_gradients)
                if skip and moved:
                    warnings.warn(
                        f"nanguard: step {self._recorder.step}: guard.step() ran after an "
                        "optimizer step had already applied the non-finite gradients: too late "
                        "to skip it. Call guard.step() before optimizer.step(), or pass "
                        "optimizer= to watch().",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                elif skip:
                    self._skip(None, outcome, elsewhere=not outcome.bad_gradients)
                else:
                    self._skips = 0
                    if self._resolver.loop_dropped:
                        self._kept_loop_update()
            return outcome.events
        finally:
            if counts:
                self._advance()

    def check(self) -> list[Event]:
        """Resolve the probes recorded so far without ending the step."""
        outcome = self._resolve(step_end=False)
        if any(
            e.phase in ("input", "forward") and e.step == self._recorder.step
            for e in outcome.events
        ):
            # (A loss checked later in the step carries this NaN: not an origin of its own.)
            self._resolver.forward_bad_at = self._recorder.step
        return outcome.events

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
    @staticmethod
    def _nested_step(optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimizer's step hooks run inside another call of its own step (a
        subclass whose ``step()`` calls ``super().step()``: torch runs the hooks for both):
        an ancestor of the calling frame runs the same step wrapper for the same optimizer.
        Asked of the stack, so nothing is left to go stale when a step raises."""
        kind = type(optimizer)
        defining = _STEP_CLASSES.get(kind)
        if defining is None:  # the classes that define step(), most derived first
            # (Not Optimizer's own: it raises NotImplementedError, and torch wraps the step
            # of the instance's class, never Optimizer's.)
            defining = _STEP_CLASSES[kind] = tuple(
                c for c in kind.__mro__ if "step" in c.__dict__ and c is not torch.optim.Optimizer
            )
        if len(defining) < 2:
            _ONE_STEP.add(kind)  # (its hooks can never run nested: not asked again)
            return False
        # Classes whose step() torch wrapped with the hooks (one, unless a subclass's step
        # can call its base's). Read each time: creating a base-class optimizer wraps its
        # step later.
        hooked = 0
        for cls in defining:
            hooked += getattr(cls.__dict__.get("step"), "hooked", False) is True
        if hooked < 2:
            return False
        wrapper: FrameType | None = sys._getframe(2)  # the step wrapper that calls the hook
        while wrapper is not None and not (  # (past torch.compiler.disable's frames)
            wrapper.f_code.co_name == "wrapper" and wrapper.f_code.co_filename == _OPTIM_FILE
        ):
            wrapper = wrapper.f_back
        if wrapper is None:
            return False
        code = wrapper.f_code
        frame: FrameType | None = wrapper.f_back
        while frame is not None:
            if frame.f_code is code and frame.f_locals.get("self") is optimizer:
                return True
            frame = frame.f_back
        return False

    def _before_optimizer_step(
        self, optimizer: torch.optim.Optimizer, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if type(optimizer) not in _ONE_STEP and self._nested_step(optimizer):
            return None
        self._stepped = True
        self._recorder.stepping = True  # (a closure's forwards run inside the step)
        if len(optimizer.param_groups) != self._groups:  # add_param_group(): a new head?
            self._groups = len(optimizer.param_groups)
            self._resolver.refresh_now()
            if self._rehook():  # (the step's forward ran before: its replay needs them)
                self._resolver.hooks_moved = True
        # (args: the optimizer itself, then step()'s own arguments)
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if callable(closure):
            # step(closure) (PyTorch Lightning, LBFGS): the step's forward and backward run
            # inside step(), after this hook. The step is resolved when the closure first
            # returns, before the update: "raise" and "skip_step" act in time; with the
            # forwards before step() too (Lightning's earlier micro-batches of gradient
            # accumulation): torch's optimizers call the closure before they move anything.
            if self._recorder.has_pending() and not _closure_first(optimizer):
                # Another step() may move the weights before it calls the closure (SAM's,
                # up its first forward's gradient): that forward is checked now ("raise"
                # acts before the move), the step ends when the closure returns.
                self._resolve(step_end=False)
            wrapped = self._resolving_closure(optimizer, closure)
            if "closure" in kwargs:
                return args, {**kwargs, "closure": wrapped}
            return (args[0], wrapped, *args[2:]), kwargs
        self._end_step(optimizer)
        return None

    def _scaler_pending(self, optimizer: torch.optim.Optimizer) -> frozenset[int]:
        """The watched parameters outside ``optimizer`` while GradScaler steps it: their
        gradients may still be scaled (another optimizer's, unscaled and checked by
        ``scaler.step()`` of that one, which skips it on an overflow), so an Inf there is
        GradScaler's to judge. Empty unless GradScaler has unscaled ``optimizer`` in this
        step."""
        scaler = self._options.scaler
        if scaler is None or not scaler.is_enabled():
            return frozenset()
        states = getattr(scaler, "_per_optimizer_states", None)
        try:  # (a defaultdict: looked up only when there)
            stage = states[id(optimizer)]["stage"] if id(optimizer) in states else None  # type: ignore[index, operator]
        except (TypeError, KeyError):
            return frozenset()
        if getattr(stage, "name", "") != "UNSCALED":
            return frozenset()
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return frozenset(id(p) for p in self._inner.parameters() if id(p) not in stepped)

    def _resolving_closure(
        self, optimizer: torch.optim.Optimizer, closure: Callable[..., Any]
    ) -> Callable[..., Any]:
        resolved = False

        def resolving_closure(*args: Any, **kwargs: Any) -> Any:
            nonlocal resolved
            loss = closure(*args, **kwargs)  # (an optimizer may pass arguments to it)
            if not resolved:  # (LBFGS calls it again after moving the weights)
                resolved = True
                self._end_step(optimizer)
            return loss

        return resolving_closure

    def _end_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Resolve the step before the optimizer applies it; drop it under skip_step. A
        raise from here (inside scaler.step()) leaves GradScaler ready for the next step."""
        try:
            self._end_step_unguarded(optimizer)
        except BaseException:
            self._forget_scaler_stage(optimizer)
            raise

    def _end_step_unguarded(self, optimizer: torch.optim.Optimizer) -> None:
        if self._resolver.present_grads:  # (the first step since attach: it applies them)
            self._resolver.check_present_grads()
        # (Read only if the step's gradients fail: a loop over the parameters.)
        self._resolver.scaler_pending = functools.partial(self._scaler_pending, optimizer)
        try:
            self._deferring = True  # (a validation batch's origin waits for the update)
            try:
                outcome = self._resolve_agreed()
            finally:
                self._deferring = False
            deferred = self._deferred
            if deferred is not None and (outcome.bad_gradients or not self._resolver.eval_only):
                self._deferred = None  # (the step's own gradients are bad: stopped now)
                raise NonFiniteError(deferred)
            if (
                outcome.bad_gradients
                and self._options.on_nonfinite == "raise"
                and not any(e.is_origin or _stops(e) for e in outcome.events)
                and _nonfinite_grads(optimizer)
            ):
                # Nothing new (an earlier raise caught, training went on): stopped all the
                # same, before the optimizer applies the non-finite gradients. With this
                # step's origin, when it was reported already (another guard's peek).
                latest = self._log.latest_origin
                if latest is not None and latest.step == self._recorder.step:
                    raise NonFiniteError(latest)
                held = self._resolver.held_back_event(self._recorder.step, outcome.events)
                self._dispatch([held], allow_raise=False, notify=False)
                raise NonFiniteError(held)
        except BaseException:
            self._advance()  # the step is over, even though it was aborted
            raise
        finally:
            self._resolver.scaler_pending = None
        if not outcome.bad_gradients:
            rate = self._resolver.lr_event(optimizer, self._recorder.step)
            if rate is not None:  # (the step would make every weight it moves non-finite)
                outcome = Outcome([rate], True)
                self._dispatch([rate], allow_raise=True)
        if self._options.on_nonfinite != "skip_step":
            return
        skip = self._skip_agreed(outcome.bad_gradients)
        if skip:
            try:
                self._skip(optimizer, outcome, elsewhere=not outcome.bad_gradients)
            except BaseException:
                self._advance()  # max_consecutive_skips: the step is over, aborted
                raise
        else:
            self._skips = 0
            if self._resolver.loop_dropped:
                self._kept_loop_update()

    def _forget_scaler_stage(self, optimizer: torch.optim.Optimizer) -> None:
        """A raise inside ``scaler.step(optimizer)`` (before the update): a loop that skips
        the iteration skips scaler.update(), and GradScaler would take the next step's
        scaled gradients for unscaled ones (it unscales once per update), or refuse a second
        step() of another optimizer it stepped (a GAN's). Every optimizer's stage is put
        back to READY, as update() leaves it; the inf checks recorded stay (an update()
        the loop still calls reads them), the scale is untouched."""
        states = getattr(self._options.scaler, "_per_optimizer_states", None)
        if not isinstance(states, dict) or id(optimizer) not in states:
            return
        try:
            from torch.amp.grad_scaler import OptState
        except ImportError:  # (another torch: its update() is the user's to run)
            return
        for state in states.values():
            if isinstance(state, dict) and "stage" in state:
                state["stage"] = OptState.READY

    def _other_optimizers(self) -> bool:
        """Whether another optimizer than optimizer= may move the watched weights (one was
        seen stepping them, or optimizer= leaves a trainable one out: a head's own, not yet
        stepped), or a GradScaler steps it (its update() must follow its step()): a raise
        after optimizer='s update would leave the rest of the step not applied."""
        mine = self._options.optimizer
        if self._options.scaler is not None or mine is None:
            return True
        if any(ours for opt, (_, ours) in self._optimizers.items() if opt is not mine):
            return True
        held = {id(p) for group in mine.param_groups for p in group["params"]}
        return any(p.requires_grad and id(p) not in held for p in self._inner.parameters())

    def _kept_loop_update(self) -> None:
        """skip_step, a step whose failing batch the loop dropped itself (its gradients
        zeroed, or no backward): the update of the finite batches goes ahead; running
        statistics the dropped batch's forward made non-finite are put back."""
        latest = self._log.latest_origin
        restored, _ = self._restore_running_stats(only_bad=True)
        note = self._step_note(
            latest.kind if latest is not None else "nan",
            "the optimizer step went ahead (on_nonfinite='skip_step'): the loop dropped the "
            "non-finite batch itself (no backward, or its gradients zeroed before "
            "optimizer.step()), and the gradients applied, another batch's, were finite."
            + _put_back(restored, "as the step's first forward found them"),
            {"skipped": False, "loop_dropped": True, "restored": restored},
        )
        self._dispatch([note], allow_raise=False)

    def _skip_agreed(self, skip: bool) -> bool:
        """Data parallel: a rank whose loss alone went non-finite (its gradients finite)
        skips; the others, whose all-reduced gradients are finite, must skip with it, or the
        replicas diverge. One small all-reduce a step (not under Join: a rank that ran out of
        batches does not take part in it)."""
        parallel = self._agreeing()
        return _on_any_rank(skip, parallel) if parallel is not None else skip

    def _agreeing(self) -> nn.Module | None:
        """The data-parallel wrapper whose ranks nanguard's own all-reduce can agree across,
        or None (one process, or under Join: a rank that ran out of batches only shadows
        DDP's collectives)."""
        if world_size() > 1:
            parallel = data_parallel(self._model)
            if parallel is not None and not _joining(parallel):
                return parallel
        return None

    def _resolve_agreed(self, amp: AmpObservation | None = None) -> Outcome:
        """Resolve the step's end; under "raise" with data parallelism, every rank raises
        in the same step: a rank whose loss alone went non-finite (its gradients finite,
        the all-reduced ones too) stops, and the others, which found nothing, would run
        their step and wait for it in the next all-reduce forever. One small all-reduce a
        step, as skip_step's (not under Join)."""
        parallel = self._agreeing() if self._options.on_nonfinite == "raise" else None
        if parallel is None:
            return self._resolve(step_end=True, amp=amp)
        try:
            outcome = self._resolve(step_end=True, amp=amp)
        except NonFiniteError:
            _on_any_rank(True, parallel)
            raise
        if _on_any_rank(False, parallel):
            event = self._resolver.other_rank_event(self._recorder.step)
            self._dispatch([event], allow_raise=False, notify=False)
            raise NonFiniteError(event)
        return outcome

    def _note_buffers(self) -> None:
        """The model's buffers, by id: a mask kept as one is never an origin (see
        ``_analysis._inf_input``)."""
        self._recorder.buffer_ids = frozenset(id(b) for b in self._model.buffers())

    def _on_clip(self, clip: Clip) -> None:
        self._resolver.note_clip(clip)

    def _on_clip_error(self, error: BaseException, grads: list[Tensor]) -> None:
        """``clip_grad_norm_(error_if_nonfinite=True)`` found the gradients non-finite and
        raises: the step ends here, aborted (a loop that catches it skips the batch and
        zeroes the gradients). Its origin is reported, and noted on the error."""
        if not self._attached or self._recorder.stepping:
            return
        mine = {id(p.grad) for p in self._inner.parameters() if p.grad is not None}
        if not any(id(g) in mine for g in grads):
            return  # (another model's gradients: a GAN's other network)
        try:
            outcome = self._resolve(step_end=True, allow_raise=False)
        finally:
            self._advance()
        for event in outcome.events:
            if event.is_origin:
                _add_note(error, event.message)

    def _warn_unseen(self) -> None:
        """A step ends with no call of the model recorded: say what that leaves unchecked."""
        if self._recorder.cover_compiled():
            return  # compiled in place after watch(): its calls are recorded from now on
        self._warned_unseen = True
        sentinel = self._options.mode == "sentinel" and not self._recorder.full
        warnings.warn(
            f"nanguard: step {self._recorder.step} ends without a recorded call of the "
            f"watched {type(self._model).__name__}: its forward() was not called (model "
            "methods or submodules called directly), ran inside torch.func transforms, or "
            "runs in compiled code, where its hooks stand aside: a torch.compile wrapper made "
            "after watch() (watch the compiled model) or a compiled function calling it (a "
            "compiled train step: compile the model itself, model.compile() or its blocks). "
            + (
                "Sentinel mode checks that call only: use mode='full' to watch every module."
                if sentinel
                else "Only the gradients and parameters are checked then."
            ),
            RuntimeWarning,
            stacklevel=_user_stacklevel(),
        )

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if type(optimizer) not in _ONE_STEP and self._nested_step(optimizer):
            return  # the end of a nested call of the step
        dropped, self._dropped_grads = self._dropped_grads, []
        for param, grad in dropped:  # (a step skip_step dropped: it moved nothing)
            if param.grad is None:
                param.grad = grad.zero_()
        self._recorder.updates += 1
        self._guard_steps += 1
        self._longest_run = max(self._longest_run, self._run_length)
        self._foreign_steps = self._run_length = 0
        self._run_of = None
        if (
            self._recorder.forwards == 0
            and not self._warned_unseen
            and any(p.grad is not None for p in self._inner.parameters())
        ):  # (after the step: LBFGS runs its forwards inside it; a warm-up step has no grads)
            self._warn_unseen()
        try:
            if self._recorder.has_pending():
                # Forwards run inside step() (the closure of LBFGS): resolve them now, the
                # weights already moved, rather than one step late.
                outcome = self._resolve(step_end=False)
                origin = next((e for e in outcome.events if e.is_origin), None)
                if origin is not None and self._options.on_nonfinite == "skip_step":
                    warnings.warn(
                        f"nanguard: step {origin.step}: {'NaN' if origin.kind == 'nan' else 'Inf'}"
                        f" appeared in a forward that {type(optimizer).__name__}.step() ran "
                        "after it had moved the weights (a later call of its closure, a "
                        "line-search trial point): too late to skip; the step went ahead "
                        "(on_nonfinite='skip_step' drops a step only when the closure's first "
                        "call is non-finite).",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        finally:
            self._advance()
            deferred, self._deferred = self._deferred, None
            if deferred is not None:
                error = NonFiniteError(deferred)
                _add_note(
                    error,
                    f"nanguard: raised after {type(optimizer).__name__}.step() applied this "
                    "step's update, whose gradients were finite: the NaN was a validation "
                    "forward's, not the training batch's (what your loop does after "
                    "optimizer.step(), a scheduler's step, did not run).",
                )
                raise error

    def _before_load(self, module: nn.Module, state_dict: Any, prefix: str, *_: Any) -> None:
        # The module load_state_dict() was called on, or the model loaded by what holds it
        # (nn.DataParallel, a wrapper's ModuleDict). What it writes is what changes (a copy_
        # bumps the version; assign=True puts in another tensor): keys a model renames as it
        # loads, a tied weight under its second name, count; what the state_dict did not
        # hold does not.
        if (prefix == "" or module is self._model) and self._attached:
            self._loading = module
            self._load_marks = self._resolver.load_marks()

    def _after_load(self, module: nn.Module, *_: Any) -> None:
        if module is not self._loading:
            return
        self._loading = None
        marks, self._load_marks = self._load_marks, {}
        if self._attached:
            self._resolver.note_loaded(self._recorder.step, marks)

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        if not self._attached:
            return
        stepped = self._resolver.stepped_since_loss
        if optimizer is not self._options.optimizer and not any(r() is optimizer for r in stepped):
            # (Weights outside the model it moved after the loss read them: a NaN found in
            # them at the step's end may be that loss's doing, not its cause. Each once.)
            stepped.append(weakref.ref(optimizer))
        if optimizer is self._options.optimizer:
            self._after_optimizer_step(optimizer)
        else:
            self._count_update(optimizer)

    def _count_update(self, optimizer: torch.optim.Optimizer) -> None:
        groups = len(optimizer.param_groups)
        known = self._optimizers.get(optimizer)
        if known is None or known[0] != groups:
            mine = {id(p) for p in self._inner.parameters()}
            ours = any(id(p) in mine for g in optimizer.param_groups for p in g["params"])
            known = self._optimizers[optimizer] = (groups, ours)
        if known[1]:
            self._recorder.updates += 1
            self._foreign_steps += 1
            self._uncounted += 1
            if self._run_of is not None and self._run_of() is optimizer:
                self._run_length += 1
            else:
                self._run_of, self._run_length = weakref.ref(optimizer), 1
            if self._options.optimizer is not None and self._takes_over(optimizer):
                self._switch_optimizer(optimizer, self._uncounted)
            elif self._options.optimizer is not None and (
                self._foreign_steps >= _SILENT_STEPS
                or (self._foreign_steps >= 2 and self._replaced_optimizer())
            ):
                self._adopt_steps_of(optimizer, self._uncounted)
            elif self._forgotten(optimizer):
                self._adopt_steps_of(optimizer, self._unended.get(optimizer, 1), forgotten=True)
            elif self._options.optimizer is not None and not self._wraps_ours(optimizer):
                # (Moved the weights within a step optimizer= ends: named if they went bad.)
                # (with the learning rates it stepped with that were not finite: a scheduler
                # may set them right again before the step ends)
                rates = {
                    i: lr
                    for i, g in enumerate(optimizer.param_groups)
                    if not math.isfinite(lr := hyperparameter(g.get("lr")))
                }
                self._resolver.foreign_steppers.append((weakref.ref(optimizer), rates))
                if rates:  # (what it moved is swept at this step's end, not steps later)
                    self._resolver.sweep_soon()

    def _forgotten(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s step ends the training step because nothing else does:
        no ``optimizer=``, no ``scaler=``, and ``guard.step()`` never called while it stepped
        the watched weights twice (once may be the step ``guard.step()`` follows). Until a
        step ends, nothing is resolved: a NaN would be found 64 forwards late, or at exit."""
        options = self._options
        if options.optimizer is not None or options.scaler is not None:
            return False
        if self._recorder.step_ends:  # guard.step() is called: it ends the steps
            self._ending = None
            return False
        if self._ending is not None:
            return self._ending() is optimizer
        count = self._unended[optimizer] = self._unended.get(optimizer, 0) + 1
        if count < 2:
            return False
        self._ending = weakref.ref(optimizer)
        return True

    def _takes_over(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer`` replaced the guard's optimizer=: it moves every watched
        weight that one holds, and stepped twice in a row while that one, which stepped
        before, did not, and nothing but the guard holds that one any more (the second
        stage of a fine-tune: ``opt = Adam(...)`` again); or that one holds none of the
        watched weights any more (a resume that loaded new tensors). Not a part's own
        optimizer (a GAN's discriminator's), nor one stepping several times between the
        steps of optimizer=, which the code still holds (PPO's value optimizer over the whole
        model), nor one rebuilt each step (an LR finder)."""
        opt = self._options.optimizer
        run = self._run_length
        if (
            opt is None
            or run < 2
            or not hasattr(optimizer, "_optimizer_step_pre_hooks")
            or self._wraps_ours(optimizer)
        ):
            return False
        if self._replaced_optimizer():  # (it holds none of the watched weights any more)
            return True
        if not (
            self._guard_steps > 0
            and run > max(1, 2 * self._longest_run)
            and run & (run - 1) == 0  # (looked at after 2, 4, 8... steps: it walks the heap)
        ):
            return False
        mine = {id(p) for p in self._inner.parameters()}
        held = {id(p) for g in opt.param_groups for p in g["params"] if id(p) in mine}
        moved = {id(p) for g in optimizer.param_groups for p in g["params"]}
        return held <= moved and _let_go(opt, self._options)

    def _wraps_ours(self, optimizer: torch.optim.Optimizer) -> bool:
        """A wrapper whose step() steps the guard's optimizer= (ZeRO-like, Lookahead): its
        steps are that one's."""
        opt = self._options.optimizer
        return opt is not None and any(value is opt for value in vars(optimizer).values())

    def _switch_optimizer(self, optimizer: torch.optim.Optimizer, uncounted: int) -> None:
        """Make ``optimizer`` the guard's optimizer=: its step() ends the training steps
        from now on, before it moves the weights (see ``_takes_over``). Its steps so far
        moved them unchecked: this one is resolved now."""
        old = self._options.optimizer
        self._options = dataclasses.replace(self._options, optimizer=optimizer)
        self._resolver._options = self._options
        if self._pre_handle is not None:
            self._pre_handle.remove()
        self._pre_handle = optimizer.register_step_pre_hook(
            _eager_hook(self._before_optimizer_step)
        )
        self._handles.append(self._pre_handle)
        self._groups = len(optimizer.param_groups)
        self._foreign_steps = self._run_length = self._longest_run = 0
        self._run_of = None
        self._guard_steps = 1  # (it has stepped: the run that made it the guard's)
        self._optimizers.pop(optimizer, None)
        text = (
            f"nanguard: another {type(optimizer).__name__} steps the watched weights, and the "
            f"guard's optimizer= ({type(old).__name__}) has stopped: its step() now ends the "
            f"training steps, checked before it moves the weights (its {uncounted} step(s) so "
            "far moved them before the check). Pass it to nanguard.watch() as optimizer= when "
            "you build it to check every one of its steps."
        )
        if self._warned_switch:  # (said once: phases alternating two optimizers)
            logger.info("%s", text)
        else:
            self._warned_switch = True
            warnings.warn(text, RuntimeWarning, stacklevel=_user_stacklevel())
        self._recorder.step += max(uncounted - 1, 0)
        try:
            self._resolve(step_end=True)
        finally:
            self._advance()

    def _replaced_optimizer(self) -> bool:
        """Whether the guard's optimizer= no longer holds any watched parameter (a resume
        that built a new optimizer for weights loaded with assign=True)."""
        opt = self._options.optimizer
        assert opt is not None
        key = (id(self._resolver.params), tuple(len(g["params"]) for g in opt.param_groups))
        if self._replaced is None or self._replaced[0] != key:
            mine = {id(p) for p in self._inner.parameters()}
            held = any(id(p) in mine for g in opt.param_groups for p in g["params"])
            self._replaced = (key, not held)
        return self._replaced[1]

    def _adopt_steps_of(
        self, optimizer: torch.optim.Optimizer, uncounted: int, *, forgotten: bool = False
    ) -> None:
        """End steps at another optimizer's step: the guard's optimizer= holds none of the
        watched weights any more, or has not stepped for many steps of another one (a new
        optimizer built after loading a checkpoint), or nothing ends them (``forgotten``).
        ``uncounted``: its steps since the last step ended, this one included."""
        if forgotten and not self._warned_foreign:
            self._warned_foreign = True
            warnings.warn(
                f"nanguard: {type(optimizer).__name__}.step() moved the watched weights twice "
                "and no training step ended (no optimizer= and no guard.step()): nothing was "
                "checked. Steps now end after that optimizer's steps, when the weights have "
                "already moved"
                + (
                    " (on_nonfinite='skip_step' cannot skip them)"
                    if self._options.on_nonfinite == "skip_step"
                    else ""
                )
                + ". Pass it as optimizer= to nanguard.watch(), or call guard.step() before "
                "its step(), to check before they move.",
                RuntimeWarning,
                stacklevel=_user_stacklevel(),
            )
        elif not self._warned_foreign:
            self._warned_foreign = True
            warnings.warn(
                f"nanguard: the watched parameters are updated by another optimizer "
                f"({type(optimizer).__name__}) while the guard's optimizer= does not step (a "
                "new optimizer after loading a checkpoint, or one that steps far more often, "
                "like PPO's value optimizer): steps now also end after that optimizer's "
                "steps, when the weights have already moved. Pass the optimizer that ends "
                "each training step as optimizer= to check before they move.",
                RuntimeWarning,
                stacklevel=_user_stacklevel(),
            )
        # Each of its steps before this one was a training step the guard did not end:
        # counted, so that later steps keep their numbers.
        self._recorder.step += max(uncounted - 1, 0)
        try:
            self._resolve(step_end=True)
        finally:
            self._advance()

    def _rehook(self) -> bool:
        """Hook modules added to the model since attach (a new task head, LoRA adapters
        injected afterwards), and forget removed ones. Between steps only. Returns whether
        the hooked modules changed."""
        tree = list(self._model.modules())
        hooked = self._recorder.modules
        if len(tree) == len(self._tree) and all(map(operator.is_, tree, self._tree)):
            # The same modules as last time (the usual case, checked every few steps: the
            # walk below reads each module's forward signature). Only a submodule compiled
            # in place since is news.
            self._recorder.compiled = any(is_compiled(h.module) for h in hooked)
            return False
        modules = self._hooked_modules()
        if [(h.module, h.name) for h in modules] == [(h.module, h.name) for h in hooked]:
            return False
        known = {id(h.module): h for h in hooked}  # (keeping what was learned: masks)
        moved = False
        for i, h in enumerate(modules):
            old = known.get(id(h.module))
            if old is None:
                continue
            if old.name != h.name:  # (wrapped in a new parent: named as named_modules() says)
                old.name, old.allow_inf, moved = h.name, h.allow_inf, True
            modules[i] = old
        if moved:
            self._resolver.refresh_now()  # (its names change: renamed() sees it)
        full = self._recorder.full
        self._recorder.detach()
        self._recorder.attach(modules, full=full)
        self._note_buffers()
        logger.info("nanguard: the watched model's modules changed: hooks moved to match")
        return True

    def _advance(self) -> None:
        """Count a step; with ``every=N``, hook every module for the next one or not."""
        step = self._recorder.step
        self._resolver.hooks_moved = False  # (the next step's records have them all)
        if self._attached and step % _TABLE_CHECK_EVERY == _TABLE_CHECK_EVERY - 1:
            self._rehook()  # (as often as the parameter table is checked)
        if self._attached and (step < 2 or step % _TABLE_CHECK_EVERY == _TABLE_CHECK_EVERY - 1):
            self._recorder.keep_hooks_last()  # (user hooks registered after watch())
        if self._attached:
            self._recorder.cover_compiled()  # (model.compile() after watch())
        self._recorder.step += 1
        self._uncounted = 0
        self._resolver.step_ended()
        self._unended.clear()
        self._recorder.stepping = False
        self._recorder.forwards = self._recorder.training_forwards = 0
        self._recorder.model_forwards = 0
        self._recorder.train_forwards = self._recorder.train_model_forwards = 0
        self._recorder.last_outputs = ()
        self._recorder.forget_last_record()
        self._advanced_at = time.monotonic()
        full = self._full_step()
        # (Compiled code guards on its modules' hooks: taking them off for a sentinel step
        # and back would compile every block twice, for hooks that stand aside there.)
        if self._attached and self._recorder.full != full and (full or not self._recorder.compiled):
            self._recorder.set_full(full)

    def _full_step(self) -> bool:
        options = self._options
        return options.mode == "full" and self._recorder.step % options.every == 0

    def _after_scaler_update(self, amp: AmpObservation) -> None:
        if self._stepped:  # the optimizer ran: its pre-hook resolved the step already
            self._stepped = False
            if self._scaler_poisoned:  # (skip_step made the other optimizers' skip: no overflow)
                self._scaler_poisoned = False
                self._put_scale_back()
                return
            self._resolve(step_end=False, amp=amp)
            return
        # GradScaler skipped optimizer.step(): the step ends here. (Under "raise", every
        # rank of a data-parallel run raises with the one whose real origin made the Inf:
        # the others would see only an expected overflow, and wait for it in the next
        # all-reduce.)
        try:
            outcome = self._resolve_agreed(amp)
            if not self._resolver.amp_skipped:
                # No optimizer= (its pre-hook would have resolved the step first), and
                # GradScaler did not skip: scaler.step() ran optimizer.step() already.
                if self._options.on_nonfinite == "skip_step" and any(
                    e.is_origin for e in outcome.events
                ):
                    warnings.warn(
                        f"nanguard: step {self._recorder.step}: GradScaler did not skip this "
                        "step (its gradients were finite), so scaler.step() applied it before "
                        "scaler.update() ended the step: too late to skip it. Pass optimizer= "
                        "to watch() to resolve each step before its update.",
                        RuntimeWarning,
                        stacklevel=_user_stacklevel(),
                    )
                self._skips = 0
                return
            if self._options.on_nonfinite == "skip_step":
                # A real origin (not an overflow GradScaler expects) is a skip that counts.
                mine = any(e.is_origin for e in outcome.events) or self._resolver.amp_past_floor
                # 2: an origin before the scaling (no overflow: the scale goes back), 1: a
                # real skip all the same, 0: an overflow GradScaler expects.
                level = 2.0 if self._resolver.unscalable_skip else 1.0 if mine else 0.0
                parallel = self._agreeing() if self._resolver.amp_skips else None
                if parallel is not None:
                    # Data parallel: every rank skipped (the all-reduced gradients hold the
                    # Inf), but only the rank that made it knows it was real: agree, so that
                    # max_consecutive_skips stops every rank in the same step, and the
                    # scales stay the same.
                    level = _max_on_ranks(level, parallel)
                what = "GradScaler skipped the optimizer step"
                if level >= 2.0:
                    scale = self._put_scale_back()
                    if scale is not None:
                        what += f" (its scale put back to {scale:g}: not an overflow)"
                if level >= 1.0:
                    self._count_skip(outcome, what, elsewhere=not mine)
        finally:
            self._advance()

    def _step_note(self, kind: str, what: str, details: dict[str, Any]) -> Event:
        """An event on what skip_step did with the step: its update dropped, or let go."""
        rank = self._current_rank()
        return Event(
            step=self._recorder.step,
            phase="grad",
            module=None,
            module_type=None,
            param=None,
            kind=kind,
            is_origin=False,
            stats=None,
            rank=rank,
            message=f"nanguard: step {self._recorder.step}{_rank_tag(rank)}: {what}",
            tensor="gradients",
            details=details,
        )

    def _put_scale_back(self) -> float | None:
        """Undo GradScaler's backoff for a skipped step whose overflow was an origin's (a
        NaN batch), not the scaling's: the scale and its growth count as before update().
        Returns the scale, or ``None`` when there was nothing kept."""
        kept, self._scaler_kept = self._scaler_kept, None
        scaler = self._options.scaler
        if kept is None or scaler is None:
            return None
        scale, tracker = kept
        with torch.no_grad():
            if scaler._scale is None or scaler._growth_tracker is None:
                return None
            scaler._scale.copy_(scale)
            scaler._growth_tracker.copy_(tracker)
        return float(scale.item())

    def _on_record(self, record: ForwardRecord | None) -> None:
        """An inference forward ended (``record``), or too many training forwards wait.

        A forward that raised (torch.distributions refusing a NaN parameter) is resolved
        without raising: its exception is on its way to the user and carries the origin (a
        note), which is also warned about.
        """
        raised = record.raised if record is not None else None
        outcome = self._resolve(step_end=False, only=record, allow_raise=raised is None)
        if raised is not None:
            assert record is not None
            record.raised = None  # (its traceback holds the forward's frames)
            if not record.raised_about:
                # An error about something else (an index, a shape): only what the hooks
                # saw go non-finite before it is told, as a possible cause.
                for event in outcome.events:
                    if event.is_origin:
                        _add_note(
                            raised,
                            "nanguard: the forward had gone non-finite before this error, "
                            f"which may be its cause: {event.message.removeprefix('nanguard: ')}",
                        )
                if not any(e.is_origin for e in outcome.events) and _nonfinite_weights(
                    self._model
                ):  # (a fake-quantize check refusing the NaN scale of a NaN weight)
                    latest = _latest_origin(self)
                    _add_note(
                        raised,
                        f"nanguard: the watched {type(self._model).__name__}'s weights are "
                        "non-finite, and this forward computed with them, which may be this "
                        "error's cause"
                        + (
                            f". They went bad after step {latest.step}, whose origin was: "
                            f"{latest.message.removeprefix('nanguard: ')}"
                            if latest is not None
                            else "."
                        ),
                    )
            else:
                origins = [e.message for e in outcome.events if e.is_origin]
                model = type(self._model).__name__
                replayed = self._options.replay and 0 not in record.problems
                if not origins and _nonfinite_weights(self._model):
                    # Nothing new: the weights went non-finite in an earlier step (a run under
                    # "log" applied its gradients), and every forward computes with them.
                    latest = _latest_origin(self)
                    origins = [
                        f"nanguard: step {self._recorder.step}: the watched {model}'s weights are "
                        "non-finite and this forward computed with them: nothing new was made."
                        + (
                            f" They went bad after step {latest.step}, whose origin was: "
                            f"{latest.message}"
                            if latest is not None
                            else ""
                        )
                    ]
                made = call = None
                if not origins:
                    record.raised = raised  # (a replay raises it again, up to the error)
                    try:
                        call = self._resolver.raising_call(record)
                        if isinstance(raised, LINALG_ERRORS):
                            made = self._resolver.made_before_error(record, call)
                    finally:
                        record.raised = None
                code = _raising_code(call[1] if call is not None else None, model)
                if made is not None:
                    op, text = made
                    where = f" at {op.source}" if op.source else ""
                    origins = [
                        f"nanguard: step {self._recorder.step}: the matrix was not finite: "
                        f"`{op.name}` made {_made_word(op)} in {code}{where}, "
                        f"before the error (what its modules returned was finite). Likely "
                        f"cause: {text}"
                    ]
                    # ...and an event of it, as of any origin (guard.origin, log_path): the
                    # error itself stops the training, so it is not raised again.
                    frame = call[1] if call is not None else None
                    out = op.output
                    self._dispatch(
                        [
                            Event(
                                step=self._recorder.step,
                                phase="forward",
                                module=frame.name if frame is not None else "",
                                module_type=type(
                                    frame.module if frame is not None else self._model
                                ).__name__,
                                param=None,
                                kind="nan" if out is None or out.nan_count else "inf",
                                is_origin=True,
                                stats=out,
                                rank=_rank()[0],
                                message=origins[0],
                                op=op.name,
                                source=op.source,
                                hint=text,
                                time=time.time(),
                                details={"reason": "own_code", "raised": type(raised).__name__},
                            )
                        ],
                        allow_raise=False,
                        notify=False,  # (told by the note on the error itself)
                    )
                if not origins and isinstance(raised, LINALG_ERRORS):
                    # (Said of finite matrices too: not positive-definite, singular.)
                    fix = (
                        "not positive-definite: add a jitter to its diagonal (matrix + 1e-6 * "
                        "I), or use torch.linalg.cholesky_ex and retry with more."
                        if "positive-definite" in str(raised)
                        else "singular (rank-deficient: more features than samples, a dead or "
                        "constant feature): add a ridge term to its diagonal (matrix + 1e-6 * "
                        "I), or use torch.linalg.lstsq or pinv."
                    )
                    origins = [
                        f"nanguard: step {self._recorder.step}: what the watched {model}'s "
                        f"modules received and returned was finite. Unless {code} after them "
                        "made the matrix non-finite (torch.isfinite(matrix).all() tells), "
                        f"the matrix is finite and {fix}"
                    ]
                seen = (
                    f"the batch given to the watched {model} was finite (sentinel mode checked "
                    f"only that): the invalid value was made inside {model}.forward"
                    if record.coarse and not replayed
                    else f"what the watched {model}'s modules received and returned was finite "
                    f"(masks aside): the invalid value was made in {code} after them"
                )
                examples = (
                    "a covariance that is finite but not positive-definite (A @ A.T of an A "
                    "with fewer columns than rows is singular; round-off makes an eigenvalue "
                    "negative): add a jitter to its diagonal (+ 1e-4 * I), or pass scale_tril= "
                    "with a positive diagonal (softplus(d) + 1e-4)"
                    if "PositiveDefinite" in str(raised) or "LowerCholesky" in str(raised)
                    else "a distribution over a row that is -inf everywhere (a state with no "
                    "legal action), or a finite value outside what the error names as valid (a "
                    "scale of exactly 0 from a ReLU: softplus(x) + 1e-4; a probability above 1)"
                )
                for message in origins or [
                    f"nanguard: step {self._recorder.step}: {seen}, e.g. {examples}."
                ]:
                    _add_note(raised, message)

    def _skip(
        self, optimizer: torch.optim.Optimizer | None, outcome: Outcome, elsewhere: bool = False
    ) -> None:
        """Drop this optimizer step: gradients to None, so no parameter (or state) moves.

        The model's own parameters too: another optimizer stepping after this one (a
        backbone/head split) would otherwise apply the non-finite gradients. Without
        ``optimizer=``, at ``guard.step()``: the optimizer's step that follows finds none.
        """
        pending = self._scaler_pending(optimizer) if optimizer is not None else frozenset()
        if optimizer is not None:
            kept = []
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is not None:
                        kept.append((param, param.grad))
                    param.grad = None
            # Put back, zeroed, once the step has run (a loop that zeroes with
            # set_to_none=False reads p.grad after it): see _after_optimizer_step.
            self._dropped_grads = kept
            if self._options.scaler is not None:
                # (GradScaler stepped it with finite gradients, a non-finite loss: its
                # update() would count a good step; the scale and its growth go back.)
                self._scaler_poisoned = True
        dropped = {}
        for param in self._inner.parameters():
            if param.grad is not None and id(param) in pending:
                dropped[id(param)] = param
            param.grad = None
        if dropped:
            # GradScaler may still step another optimizer (a head's) through scaler.step():
            # with no gradient at all it asserts, so when it unscales one, its dropped
            # gradients come back as NaN, which skips its step (the scale update() backs off
            # for it is put back). One stepped without the scaler finds None: moves nothing.
            self._scaler_dropped = dropped
            self._wrap_unscale()
        self._resolver.step_skipped(self._recorder.step)
        self._count_skip(
            outcome,
            "the optimizer step was skipped (on_nonfinite='skip_step')"
            if optimizer is not None
            else "the step's gradients were dropped at guard.step() (on_nonfinite='skip_step'; "
            "the optimizer's step() after it moves nothing)",
            elsewhere=elsewhere,
        )

    def _keep_running_stats(self) -> None:
        """Copy the running statistics before the step's first training forward updates
        them (one copy per buffer; nothing for a model without BatchNorm). Never raises:
        a snapshot that cannot be taken only means the skip cannot put them back."""
        step = self._recorder.step
        kept = self._stats_kept
        if kept is not None and kept[0] == step:
            return  # (gradient accumulation: the step's first forward kept them)
        self._updates_at_forward = (step, self._recorder.updates)
        try:
            self._stats_kept = self._snapshot_stats(step, kept)
        except Exception:  # a detector must never break training
            logger.debug("nanguard: running statistics not kept", exc_info=True)
            self._stats_kept = None

    def _snapshot_stats(
        self, step: int, kept: tuple[int, list[str], list[Tensor], list[Tensor]] | None
    ) -> tuple[int, list[str], list[Tensor], list[Tensor]]:
        # (Looked up each step, under skip_step only: layers can be swapped at any time.)
        # Norms and observers, and the buffers a forward was seen updating in place (an
        # observation normaliser's running statistics).
        # While the first forwards still show which buffers they update, every small
        # floating one (an EMA codebook the first step's forward writes non-finite).
        updaters = self._recorder.buffer_updaters | self._recorder.unlearned_buffers()
        norms = [
            (name, module)
            for name, module in module_names(self._inner)
            if isinstance(module, _BATCH_STATS_NORMS)
            or _observer(type(module))
            or (updaters and any((id(module), local) in updaters for local in module._buffers))
        ]
        names: list[str] = []
        live: list[Tensor] = []
        for name, module in norms:
            # Whatever its mode now: a micro-batch later in the step may train it.
            if getattr(module, "track_running_stats", True) is False:
                continue
            norm = isinstance(module, _BATCH_STATS_NORMS) or _observer(type(module))
            for local, buffer in module._buffers.items():
                if buffer is None or is_lazy(buffer):  # (LazyBatchNorm: not yet)
                    continue
                if norm or (id(module), local) in updaters:
                    names.append(f"{name}.{local}" if name else local)
                    live.append(buffer)
                    if not norm:  # (put back only if non-finite: a MoCo queue keeps its keys)
                        self._restore_if_bad.add(names[-1])
        if not live:
            return (step, [], [], [])
        with torch.no_grad():
            if (
                kept is not None
                and len(kept[2]) == len(live)
                and all(a is b for a, b in zip(kept[2], live, strict=True))
            ):
                copies = kept[3]
                _copy_all(copies, live)
            else:
                copies = [buffer.detach().clone() for buffer in live]
        return (step, names, live, copies)

    def _restore_running_stats(self, only_bad: bool = False) -> tuple[list[str], list[str]]:
        """Put back the running statistics the dropped step's forwards updated (``only_bad``:
        only if some went non-finite); returns the names of those that had, and of all put
        back."""
        kept, self._stats_kept = self._stats_kept, None
        if kept is None or kept[0] != self._recorder.step or not kept[2]:
            return [], []
        _, names, live, copies = kept
        with torch.no_grad():
            flags = [flags_of_tensor(t) for t in live]
            if only_bad and not any(flags):
                return [], []
            # (A module's statistics are one state: an observation normaliser whose mean and
            # var went NaN gets its sample count back too, though that stayed finite.)
            bad_owners = {n.rpartition(".")[0] for n, fl in zip(names, flags, strict=True) if fl}
            chosen = [
                i
                for i, n in enumerate(names)
                if flags[i] or n not in self._restore_if_bad or n.rpartition(".")[0] in bad_owners
            ]
            if chosen:
                _copy_all([live[i] for i in chosen], [copies[i] for i in chosen])
        self._resolver.buffers_restored([names[i] for i in chosen])
        return [n for n, fl in zip(names, flags, strict=True) if fl], [names[i] for i in chosen]

    def _count_skip(self, outcome: Outcome, what: str, elsewhere: bool = False) -> None:
        """Note a skipped step; raise after ``max_consecutive_skips`` in a row."""
        self._skips += 1
        restored, rolled_back = self._restore_running_stats()
        finite = len(rolled_back) - len(restored)
        moved = sorted(self._resolver.stepped_first)
        left = (
            "so the weights were left as they were"
            if not moved
            else "so optimizer='s weights were left as they were, but not "
            + ", ".join(f"`{n}`" for n in moved)
            + ": another optimizer had stepped them first with this step's gradients"
        )
        note = self._step_note(
            next((e.kind for e in outcome.events if e.is_origin), "nan"),
            f"{what}: {_skip_reason(outcome, elsewhere)}, {left} "
            f"({self._skips} skipped in a row, at most {self._options.max_consecutive_skips})."
            + _put_back(restored, "as they were before it")
            + (
                f" The {finite} finite running statistics its forward updated were put back "
                "too (a dropped batch leaves no trace; details['rolled_back'] lists them)."
                if finite > 0
                else ""
            ),
            {
                "skipped": True,
                "consecutive": self._skips,
                "restored": restored,
                "rolled_back": rolled_back,
            },
        )
        self._dispatch([note], allow_raise=False)
        if self._skips >= self._options.max_consecutive_skips:
            # (This step's, else the latest: weights gone non-finite steps ago.)
            origin = next((e for e in outcome.events if e.is_origin), None)
            lead = "the last origin"
            pointer = next(
                (
                    e
                    for e in outcome.events
                    if e.details.get("reason") in _OTHER_RANKS or e.details.get("sharded")
                ),
                None,
            )
            if origin is None and (elsewhere or pointer is not None):
                # (Another rank's: this rank has only the events that point there.)
                origin = pointer or note
                lead = "none on this rank, another rank's origin (its own log names it)"
            origin = origin or self._log.latest_origin or note
            raise NonFiniteError(
                _with_message(
                    origin,
                    f"nanguard: {self._skips} optimizer steps in a row were skipped for "
                    f"non-finite gradients (max_consecutive_skips="
                    f"{self._options.max_consecutive_skips}); {lead}: "
                    f"{origin.message.removeprefix('nanguard: ')}",
                )
            )

    def _check_site(self, record: ForwardRecord | LossRecord, site: int, tensor: Tensor) -> None:
        """``sync="module"``: check a new site at once (one host sync each)."""
        if record.reported or self._coarse(record):
            return
        s = record.sites[site]
        if all_finite(host_values(record.values[s.start : s.start + s.nvalues])):
            return
        record.stats[site] = tensor_stats(tensor)
        self._resolve_partial(record)

    def _check_grad(self, record: ForwardRecord, site: int, grad: Tensor) -> None:
        """``sync="module"``: check a gradient at once, inside the backward."""
        if record.reported or record.coarse:
            return
        values = record.grads[-1][1]
        if all_finite(host_values(list(values))):
            return
        record.stats[~site] = tensor_stats(grad)
        self._resolve_partial(record)

    def _coarse(self, record: ForwardRecord | LossRecord) -> bool:
        """A forward whose modules were not hooked (a step between every=N's full ones, a
        compiled one), or a loss computed after one: checked at the step's end, where a
        replay tells what its modules did; at once, the model would be named."""
        if isinstance(record, ForwardRecord):
            return record.coarse
        return any(isinstance(r, ForwardRecord) and r.coarse for r in self._recorder.pending())

    def _resolve_partial(self, record: ForwardRecord | LossRecord) -> None:
        # A loss, with the step's forwards it may have been computed from: a NaN loss
        # after a forward that went non-finite (reported at once) only carries it.
        forwards = (
            [
                r
                for r in self._recorder.pending()
                if isinstance(r, ForwardRecord) and r.reported and r.index < record.index
            ]
            if isinstance(record, LossRecord)
            else []
        )
        records: list[ForwardRecord | LossRecord] = [*forwards, record]
        flags = [
            [flags_of_stats(r.stats[i]) if i in r.stats else 0 for i in range(len(r.sites))]
            for r in records
        ]
        grads: list[list[tuple[int, int]]] = [
            [(s, flags_of_stats(r.stats[~s]) if ~s in r.stats else 0) for s, _ in r.grads]
            if isinstance(r, ForwardRecord)
            else []
            for r in records
        ]
        outcome = self._resolver.resolve_partial(records, flags, grads)
        # (The forwards' own events were told when they were resolved; a loss that only
        # carries their NaN is told with the step, once.)
        events = [e for e in outcome.events if not forwards or (e.phase == "loss" and e.is_origin)]
        self._dispatch(events, allow_raise=True)

    # ------------------------------------------------------------- resolution
    def _resolve(
        self,
        *,
        step_end: bool,
        allow_raise: bool = True,
        amp: AmpObservation | None = None,
        final: bool = False,
        only: ForwardRecord | None = None,
    ) -> Outcome:
        with self._lock:
            recorder = self._recorder
            items = recorder.take(only) if only is not None else recorder.take_pending()
            try:
                outcome = self._resolver.resolve(
                    items, step_end=step_end, step=self._recorder.step, amp=amp, final=final
                )
                self._note_loss(outcome.events, items)
            finally:
                for item in items:
                    if isinstance(item, ForwardRecord) and item.handles:
                        _remove_leaf_hooks(item)
                    elif isinstance(item, LossRecord):
                        # (Its autograd node, read on a failure, carries the recorder's
                        # hooks: kept, a cycle through C++ that no collector breaks.)
                        item.node = None
        recent = self._recent
        if recent is not None and any(getattr(item, "reported", False) for item in items):
            # The forward of the latest origin (reported when another guard peeked) ends
            # its step only now: the origin is as recent as this step.
            self._recent = (*recent[:3], time.monotonic())
        if not outcome.events:
            return outcome
        self._note_recent(outcome.events, items)
        events, blamed = self._blame_other_guards(outcome.events, items)
        if blamed is not None:  # (later steps' "see the origin" name that model's)
            self._resolver.origin_by = next(
                (e.details["made_by"] for e in events if e.details.get("made_by")), None
            )
        self._dispatch(events, allow_raise=allow_raise)
        if blamed is not None and allow_raise and self._options.on_nonfinite == "raise":
            # Raised by the other guard already (caught, and training went on): once more
            # only if this step's optimizer would apply non-finite gradients (a shared
            # embedding's), not for a forward of the aborted step left waiting here.
            optimizer = self._options.optimizer
            if not any(e is blamed for e in _RAISED) or (
                optimizer is not None and _nonfinite_grads(optimizer)
            ):
                _RAISED.append(blamed)
                raise NonFiniteError(blamed)
        if blamed is not None and self._options.on_nonfinite == "warn" and blamed not in _WARNED:
            # (The other guard resolved it without telling anyone: its step sees it reported.)
            _WARNED.append(blamed)
            warnings.warn(NonFiniteWarning(told(blamed)), stacklevel=_user_stacklevel())
        return Outcome(events, outcome.bad_gradients) if blamed is not None else outcome

    def _blame_other_guards(
        self, events: list[Event], items: list[ForwardRecord | LossRecord]
    ) -> tuple[list[Event], Event | None]:
        """A non-finite input made by a model another guard watches (a GAN's generator
        feeding its discriminator), or a non-finite gradient sent back into this model's
        outputs by the model they feed (an encoder's decoder): that guard's origin is the
        one to report.

        The other guard's pending forwards are resolved without being consumed (their
        backward may still run); this guard's event points at that origin instead.
        """
        shared = self._blame_shared_params(events) or self._blame_copied_weights(events)
        if shared is not None:
            return shared
        source = next(
            (
                e
                for e in events
                if e.is_origin
                and (e.phase == "input" or e.details.get("reason") in ("loss_backward", "loss"))
            ),
            None,
        )
        if source is None or source.stats is None:
            return events, None
        # A NaN gradient arriving at this model's outputs, or a NaN loss (phase "loss"): the
        # model they feed (an encoder's decoder, a GAN's discriminator), watched by another
        # guard, may have made it, if what that model was given is this model's output or
        # was computed from it.
        backward = source.phase == "loss"
        through = source.details.get("reason") == "loss"  # the loss itself
        shape = (tuple(source.stats.shape), source.stats.dtype)
        # (a sentinel step's replay stands for it in the list: the step's own outputs)
        records = [item.replaces or item for item in items if isinstance(item, ForwardRecord)]
        outputs = [t for r in records for t in (ref() for ref in r.output_refs) if t is not None]
        nodes = {n for r in records for n in r.output_nodes}
        nodes.update(t.grad_fn for t in outputs if t.grad_fn is not None)
        if backward and not (outputs or nodes):
            return events, None
        # (A guard detached since, its model's origin reported already: the GAN's guards
        # detached generator first, the discriminator's last forward resolved at its own
        # detach.)
        detached = [g for g in (ref() for ref in _DETACHED) if g is not None and not g._attached]
        for other in [*_ATTACHED, *detached]:
            if other is self:
                continue
            origin = None
            pending = other._recorder.pending() if other._attached else []
            recent = other._recent
            if through:
                # A loss made from finite outputs, through the other model: the blame moves
                # only if that model's forward on these outputs went non-finite, by an origin
                # of its own (an overflowing discriminator) or with weights gone bad at its
                # latest origin (a discriminator stepped with NaN gradients). Never for its
                # loss's backward, which this very loss made.
                fed = [r for r in pending if _fed(outputs, nodes, _kept_inputs([r]))]
                if fed:  # (only the forwards given these outputs: not its real batch's)
                    made = [e for e in other._peek(fed) if e.phase in ("input", "forward")]
                    origin = next((e for e in made if e.is_origin), None)
                    if origin is None and made and _nonfinite_weights(other._inner):
                        origin = _latest_origin(other)
            elif other._attached and (
                _fed(outputs, nodes, _kept_inputs(pending))
                if backward
                else shape in other._outputs(pending)
            ):
                peeked = other._peek()
                origin = next((e for e in peeked if e.is_origin), None)
                went_bad = any(e.phase in ("input", "forward") for e in peeked)
                if origin is None and went_bad and _nonfinite_weights(other._inner):
                    # Its weights went bad there, or (no origin of its own: a loss through
                    # this model gave them NaN gradients) at this model's latest origin.
                    origin = _latest_origin(other) or self._log.latest_origin
            if (
                origin is None
                and not through
                and recent is not None
                and (
                    _fed(outputs, nodes, [t for t in (r() for r in recent[2]) if t is not None])
                    or any(id(n) in other._recent_nodes for n in nodes)
                    if backward
                    else shape in recent[1]
                )
                and recent[3] >= self._advanced_at  # since this guard's previous step
            ):
                origin = recent[0]  # reported already, by that guard's own step
            recent_loss = other._recent_loss
            if (
                origin is None
                and backward
                and not through
                and recent_loss is not None
                and recent_loss[2] >= self._advanced_at
                and any(id(n) in recent_loss[1] for n in _source_nodes(records, source))
            ):
                # The gradient came back from a loss the other guard checked, non-finite, and
                # reported (a GAN's generator loss, -log(D(G(z))) at a saturated D).
                made_by = type(other._model).__name__
                word = kind_word(source.kind, source.stats)
                message = (
                    f"nanguard: step {source.step}: the gradient arriving at the outputs of "
                    f"{type(self._model).__name__} holds {word}: it comes from a loss the guard "
                    f"of {made_by} checked, which was non-finite first: not an origin of this "
                    f"model. The origin: {recent_loss[0].message}"
                )
                first = recent_loss[0]
                return _pointing_at(events, source, message, made_by, first), first
            if (
                origin is None
                and through
                and other._options.optimizer is None
                and recent is not None
                and recent[3] >= self._advanced_at
                and recent[0].phase in ("input", "forward", "param")  # (an EMA teacher's)
            ):
                # A model not trained here (a distillation teacher) went non-finite in this
                # step: if the loss reads its outputs as targets, it carries their value. Not
                # known (no gradient links them), so the loss stays the origin, and says so.
                made_by = type(other._model).__name__
                first = recent[0]
                where = f"`{first.module}`" if first.module else "the model"
                note = (
                    f" Another watched model ({made_by}, watched by another guard without "
                    "optimizer=: a teacher?) went non-finite in this step too: if the loss "
                    "reads its outputs (a distillation target), look there: its origin is in "
                    f"{where} ({first.module_type}), phase '{first.phase}'."
                )
                noted = dataclasses.replace(
                    source,
                    message=source.message + note,
                    details={**source.details, "also_nonfinite": made_by},
                )
                return [noted if e is source else e for e in events], None
            if (
                origin is None
                and through
                and other._options.optimizer is None
                and other._attached
                and _nonfinite_weights(other._inner)
            ):
                # Its weights are non-finite now, not told yet (no optimizer ends its steps):
                # what it computes carries them (an EMA teacher's decay of NaN).
                made_by = type(other._model).__name__
                note = (
                    f" Another watched model ({made_by}, watched by another guard without "
                    "optimizer=: a teacher?) holds non-finite weights: if the "
                    "loss reads its outputs (a distillation target), look there (what wrote "
                    "its weights: an EMA update's decay, its source weights)."
                )
                noted = dataclasses.replace(
                    source,
                    message=source.message + note,
                    details={**source.details, "also_nonfinite": made_by},
                )
                return [noted if e is source else e for e in events], None
            if origin is None:
                continue
            made_by = type(other._model).__name__
            word = "NaN" if source.kind == "nan" else "Inf"
            this = type(self._model).__name__
            message = (
                f"nanguard: step {source.step}: the loss is {word}: it was computed through "
                f"{made_by}, watched by another guard, which went non-finite first: not an "
                f"origin of this model. The origin: {origin.message}"
                if through
                else f"nanguard: step {source.step}: the gradient arriving at the outputs of "
                f"{this} holds {word}: it comes back from {made_by}, watched by another guard, "
                "which went non-finite first: not an origin of this model. The origin: "
                f"{origin.message}"
                if backward
                else f"nanguard: step {source.step}: `{source.tensor}` passed to {this} holds "
                f"{word} that {made_by}, watched by another guard, produced: not an origin of "
                f"this model. The origin: {origin.message}"
            )
            return _pointing_at(events, source, message, made_by, origin), origin
        return events, None

    def _blame_shared_params(self, events: list[Event]) -> tuple[list[Event], Event] | None:
        """A parameter's gradient changed after this model's backward: if the parameter is
        also another watched model's (an embedding table held by both), that model's
        backward added to it, and its guard's origin is the one to report."""
        source = next(
            (e for e in events if e.is_origin and e.details.get("reason") == "external"), None
        )
        if source is None or source.param is None:
            return None
        param = next((p for o, p in self._resolver.params.params if o.name == source.param), None)
        if param is None:
            return None
        detached = [g for g in (ref() for ref in _DETACHED) if g is not None]
        for other in [*_ATTACHED, *detached]:
            if other is self:
                continue
            if not any(p is param for p in other._inner.parameters()):
                continue
            origin = (
                next((e for e in other._peek() if e.is_origin), None) if other._attached else None
            )
            if origin is None:
                recent = other._recent
                if recent is None or recent[3] < self._advanced_at:
                    continue
                origin = recent[0]  # reported already, by that guard's own step
            made_by = type(other._model).__name__
            word = "NaN" if source.kind == "nan" else "Inf"
            message = (
                f"nanguard: step {source.step}: the gradient of `{source.param}` holds {word}, "
                f"though this model's backward made it finite: the parameter is also "
                f"{made_by}'s, watched by another guard, whose backward added to it and which "
                f"went non-finite first: not an origin of this model. The origin: "
                f"{origin.message}"
            )
            return _pointing_at(events, source, message, made_by, origin), origin
        return None

    def _blame_copied_weights(self, events: list[Event]) -> tuple[list[Event], Event] | None:
        """Weights that went non-finite outside this guard's optimizer steps, while another
        watched model's weights of the same shapes are non-finite since its origin: code
        copied them (an EMA or AveragedModel's update, a teacher's momentum update). That
        guard's origin is the one to report, once, not one per weight here."""
        sources = [e for e in events if e.is_origin and e.phase == "param" and e.stats is not None]
        if not sources or self._recorder.updates:
            # (A model its own optimizer steps: the update made them, not a copy. An ensemble
            # of identical members holds the same shapes.)
            return None
        shapes = {tuple(e.stats.shape) for e in sources if e.stats is not None}
        for other in list(_ATTACHED):
            if other is self or not other._attached:
                continue
            held = {tuple(t.shape) for t in (*other._inner.parameters(), *other._inner.buffers())}
            if not shapes <= held or not _nonfinite_weights(other._inner):
                continue
            origin = _latest_origin(other)
            if origin is None:
                continue
            made_by = type(other._model).__name__
            # (And the weights this guard took for propagated: written in a forward that
            # the copied ones had made non-finite.)
            for source in [
                e for e in events if e.phase == "param" and e.stats is not None and e.param
            ]:
                if tuple(source.stats.shape) not in held:  # type: ignore[union-attr]
                    continue
                word = "NaN" if source.kind == "nan" else "Inf"
                message = (
                    f"nanguard: step {source.step}: `{source.param}` holds {word} that "
                    f"{made_by}'s weights, watched by another guard, held first: code copied "
                    "them (an EMA or AveragedModel update, a teacher's momentum update, "
                    "load_state_dict): not an origin of this model. The origin: "
                    f"{origin.message}"
                )
                events = _pointing_at(events, source, message, made_by, origin)
            return events, origin
        return None

    def _note_loss(self, events: list[Event], items: list[ForwardRecord | LossRecord]) -> None:
        """A non-finite loss this guard checked and reported as the origin: the ids of the
        autograd nodes near its top (another model's outputs it was computed from: a GAN's
        discriminator, whose guard sees its NaN gradient come back and points here)."""
        origin = next(
            (
                e
                for e in events
                if e.is_origin and e.phase == "loss" and e.details.get("reason") == "loss"
            ),
            None,
        )
        if origin is None:
            return
        ids: set[int] = set()
        for item in items:
            if isinstance(item, LossRecord) and item.node is not None:
                ids.update(id(n) for n in graph_nodes(item.node, _LOSS_NODES_KEPT))
        self._recent_loss = (origin, frozenset(ids), time.monotonic())

    def _note_recent(self, events: list[Event], items: list[ForwardRecord | LossRecord]) -> None:
        # (An input origin too: a generator given a NaN latent hands it to the
        # discriminator, whose guard resolves that forward at its own next step.)
        origin = next(
            (e for e in events if e.is_origin and e.phase in ("input", "forward", "backward")),
            None,
        )
        kept = _kept_inputs(items)
        # (The autograd nodes that made the inputs outlive them: the encoder's output a
        # decoder was given is gone by the encoder's step, its node, which the encoder's
        # record holds, is not. Their ids only: a node kept would keep a graph retained
        # with retain_graph=True, activations and all.)
        made = tuple(id(t.grad_fn) for t in kept if t.grad_fn is not None)
        if origin is not None:
            inputs = tuple(weakref.ref(t) for t in kept)
            self._recent = (origin, self._outputs(items), inputs, time.monotonic())
            self._recent_nodes = made
        elif self._recent is not None and any(e.phase in ("input", "forward") for e in events):
            # Still non-finite, carried from the latest origin (weights it left NaN): a model
            # fed its outputs this step is fed that origin's values.
            origin, shapes, inputs, _ = self._recent
            inputs = (*inputs, *(weakref.ref(t) for t in kept))[-_RECENT_KEPT:]
            self._recent = (origin, shapes | self._outputs(items), inputs, time.monotonic())
            self._recent_nodes = (*self._recent_nodes, *made)[-_RECENT_KEPT:]

    @staticmethod
    def _outputs(items: list[ForwardRecord | LossRecord]) -> _Shapes:
        """Shapes and dtypes of what the forwards returned."""
        found = set()
        for item in items:
            if isinstance(item, ForwardRecord) and item.frames:
                for site in item.frames[0].outputs:
                    s = item.sites[site]
                    found.add((tuple(s.shape), str(s.dtype)))
        return found

    def _peek(self, only: list[ForwardRecord | LossRecord] | None = None) -> list[Event]:
        """Resolve the pending forwards (or ``only`` these of them) without taking them
        (logged, never raised)."""
        with self._lock:
            items = self._recorder.pending() if only is None else only
            outcome = self._resolver.resolve(items, step_end=False, step=self._recorder.step)
        self._note_recent(outcome.events, items)
        events = outcome.events
        if events and not getattr(_PEEKING, "active", False):
            # (A discriminator's forward on the generator's output, peeked by the generator's
            # guard: the NaN gradient its loss sent back is that guard's origin, not one here.)
            _PEEKING.active = True
            try:
                events, _ = self._blame_other_guards(events, items)
            finally:
                _PEEKING.active = False
        self._dispatch(events, allow_raise=False, notify=False)
        return events

    def _sink_keeps(self, event: Event) -> bool:
        """Whether the JSON-lines file gets ``event``: of a run of steps that carry old
        non-finite values on (weights gone non-finite for good: every step, for days), the
        first ten and then the 16th, 32nd, 64th... (the in-memory log keeps them all)."""
        if event.is_origin:
            self._summaries = 0
        if "summary" not in event.details:
            return True
        self._summaries += 1
        n = self._summaries
        return n <= 10 or n & (n - 1) == 0

    def _dispatch(self, events: list[Event], *, allow_raise: bool, notify: bool = True) -> None:
        if not events:
            return
        self._log.extend(events)
        self._write_sink(events)
        policy = self._options.on_nonfinite
        # Each origin (and early warning) reaches the user once by default: as a log record
        # under "log" and "skip_step", as the warning or the exception otherwise (then logged
        # at INFO: logging's last-resort handler would print a WARNING record a second time).
        quiet = policy in ("warn", "raise")
        for event in events:
            if _alarming(event):
                level = logging.INFO if quiet and notify else logging.WARNING
            elif event.is_origin or _stops(event):
                level = logging.INFO if quiet else logging.WARNING
            else:
                level = logging.INFO if event.kind in _WARNING_KINDS else logging.DEBUG
            logger.log(level, "%s", event.message)
        if not notify:
            return
        origins = [e for e in events if e.is_origin]
        # Another rank's NaN arriving through the all-reduce is not an origin here, but this
        # rank must stop (or skip) with the others, before the weights change.
        origins += [e for e in events if _stops(e)]
        early = [
            e
            for e in events
            if _alarming(e)
            and quiet
            # (Under "raise" the step is stopped, and the error says why.)
            and not (policy == "raise" and "weights_nonfinite" in e.details)
        ]
        for event in early:
            warnings.warn(NonFiniteWarning(told(event)), stacklevel=_user_stacklevel())
        if policy == "warn" or (policy == "raise" and not allow_raise):
            for event in origins:
                _WARNED.append(event)  # (once: another guard pointing at it does not again)
                warnings.warn(NonFiniteWarning(told(event)), stacklevel=_user_stacklevel())
        elif policy == "raise" and origins:
            _RAISED.append(origins[0])
            if (
                self._deferring
                and all(e.details.get("eval_without_backward") for e in origins)
                and not self._other_optimizers()
            ):
                # A validation batch run without no_grad(), found at the next training step's
                # end: its finite update goes ahead (a loop that catches the error trains on
                # as it would have), and optimizer.step() raises after applying it.
                self._deferred = origins[0]
                return
            raise NonFiniteError(origins[0])


#: Steps of another optimizer over the watched weights, without one of the guard's own,
#: after which that optimizer is taken to have replaced it (delayed actor updates, several
#: critic steps per generator step stay below; the forwards waiting meanwhile are kept).
_SILENT_STEPS: Final = 32
#: Quantization-aware training's observers and fake-quantize modules: the forward updates
#: their statistics (min/max, scale, zero point) as BatchNorm's (no torch.ao import needed).
_OBSERVER_BASES: Final = frozenset({"ObserverBase", "FakeQuantizeBase"})
_OBSERVER_TYPES: dict[type, bool] = {}


def _observer(kind: type) -> bool:
    known = _OBSERVER_TYPES.get(kind)
    if known is None:
        known = _OBSERVER_TYPES[kind] = any(c.__name__ in _OBSERVER_BASES for c in kind.__mro__)
    return known


#: Optimizer class -> the classes of its MRO that define step() (see _nested_step).
_STEP_CLASSES: dict[type, tuple[type, ...]] = {}
#: Optimizer classes with one step() in their MRO (Adam, SGD...): never a nested step.
_ONE_STEP: set[type] = set()

#: Shapes and dtypes of tensors, to match one model's outputs with another's inputs.
_Shapes = set[tuple[tuple[int, ...], str]]


def _source_nodes(records: Sequence[ForwardRecord], source: Event) -> set[Any]:
    """The autograd nodes that made the outputs of the forward whose backward an event is
    about (``details["forward"]``: which forward of the step), not of the step's others (a
    discriminator's own batch beside the generator's fakes)."""
    number = source.details.get("forward", 1)
    return {n for r in records if r.number == number for n in r.output_nodes}


def _kept_inputs(items: Sequence[ForwardRecord | LossRecord]) -> list[Tensor]:
    """The tensors the forwards were given (kept for their replays), nested ones too."""
    found: list[tuple[Path, Tensor]] = []
    for item in items:
        if isinstance(item, ForwardRecord) and item.replay is not None:
            collect(item.replay.args, ("args",), found, objects=True)
            collect(item.replay.kwargs, ("kwargs",), found, objects=True)
    return [t for _, t in found]


def _pointing_at(
    events: list[Event], source: Event, message: str, made_by: str, origin: Event
) -> list[Event]:
    """``events`` with ``source`` made no origin: it points at another guard's ``origin``."""
    replaced = dataclasses.replace(
        source,
        is_origin=False,
        message=message,
        details={**source.details, "made_by": made_by, "origin": origin.where},
    )
    return [replaced if e is source else e for e in events]


def _latest_origin(guard: Guard) -> Event | None:
    """The latest origin a guard reported (where its weights could have gone bad)."""
    recent = guard._recent
    if recent is not None:
        return recent[0]
    return next((e for e in reversed(guard.events) if e.is_origin), None)


def _nonfinite_weights(model: nn.Module) -> bool:
    """Whether any floating parameter of ``model`` holds NaN/Inf (failure path: syncs)."""
    with torch.no_grad():
        return any(
            p.is_floating_point() and not bool(torch.isfinite(p).all()) for p in model.parameters()
        )


def _scaler_in_scope(frame: FrameType | None) -> str | None:
    """The name of an enabled GradScaler among the first user frame's locals (or its
    ``self``'s attributes)."""
    while frame is not None and str(frame.f_globals.get("__name__", "")).startswith("nanguard"):
        frame = frame.f_back
    if frame is None:
        return None
    names = dict(frame.f_locals)
    owner = names.get("self")
    attrs = getattr(owner, "__dict__", None) if owner is not None else None
    if isinstance(attrs, dict) and not isinstance(owner, nn.Module):
        names.update((f"self.{k}", v) for k, v in attrs.items())
    for name, value in names.items():
        try:
            if isinstance(value, _SCALER_TYPES) and value.is_enabled():
                return name
        except Exception:  # a lazy proxy whose __class__ raises
            continue
    return None


def _fed(outputs: list[Tensor], nodes: set[Any], inputs: list[Tensor], limit: int = 2048) -> bool:
    """Whether one of ``inputs`` was computed from one of ``outputs``: the same tensor, a
    view, or a result of it (the autograd graph behind the input reaches one of ``nodes``,
    those that made the outputs). Breadth first, so a deep branch beside it does not hide a
    near one; ``limit`` nodes at most, on the failure path only."""
    for a in inputs:
        if any(a is o or a._base is o for o in outputs):
            return True
        if graph_reaches(a.grad_fn, nodes, limit, include_start=True):
            return True
    return False


#: A guard peeking, in this thread: its blame of other guards peeks no further (no peek
#: within a peek).
_PEEKING = threading.local()
#: Autograd nodes of a loss origin's graph whose ids a guard keeps (nearest the loss first:
#: another watched model's outputs are a few operations below it).
_LOSS_NODES_KEPT: Final = 512
#: Inputs (and their autograd nodes) a guard keeps of its latest origin's forwards and of
#: those that carried it on.
_RECENT_KEPT: Final = 16
#: Guards attached in this process (to tell a NaN fed from one watched model to another).
_ATTACHED: weakref.WeakSet[Guard] = weakref.WeakSet()
#: Other guards' origins this process warned about on their behalf (see Guard._resolve).
_WARNED: collections.deque[Event] = collections.deque(maxlen=16)
#: ...and the latest origins raised (another guard's step blames one: not raised twice).
_RAISED: collections.deque[Event] = collections.deque(maxlen=16)
#: The guards detached last (nested ``with`` blocks end the inner guard first): what they
#: reported can still explain another guard's last step.
_DETACHED: collections.deque[weakref.ref[Guard]] = collections.deque(maxlen=4)


def _rank_tag(rank: int) -> str:
    """`` (rank N)`` when several ranks print to one terminal, else nothing."""
    return f" (rank {rank})" if world_size() > 1 else ""


_OPTIM_FILE: Final = register_optimizer_step_post_hook.__code__.co_filename


def _add_note(error: BaseException, text: str) -> None:
    """Add a note to an exception on its way to the user. Python 3.10 has no notes (nor
    prints them): there the text is also logged, so that it is not lost."""
    if sys.version_info >= (3, 11):
        error.add_note(text)
        return
    notes = getattr(error, "__notes__", None)
    try:
        if isinstance(notes, list):
            notes.append(text)
        else:
            error.__notes__ = [text]  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass
    logger.warning("%s", text)


def _nonfinite_grads(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer is about to apply a non-finite gradient (failure path only)."""
    with torch.no_grad():
        return any(
            p.grad is not None and bool(flags_of_tensor(local_shard(p.grad)))
            for group in optimizer.param_groups
            for p in group["params"]
        )


def _raising_code(frame: Frame | None, model: str) -> str:
    """Where a forward's error was raised: the own code of the innermost call that never
    returned (a GP head inside the model), else the model's."""
    if frame is not None and frame.name:
        return f"{frame.type_name}.forward's own code (`{frame.name}`)"
    return f"{model}.forward's own code"


def _made_word(op: OpInfo) -> str:
    """What ``op`` made, from its output's statistics: ``NaN``, ``+Inf``, ``-Inf``."""
    out = op.output
    return kind_word("nan" if out is None or out.nan_count else "inf", out)


def _no_guard() -> None:
    """What an unpickled guard is (see ``Guard.__reduce__``)."""


def _weakly(method: Callable[..., None]) -> Callable[..., None]:
    """A function calling the bound ``method`` while its object lives (then nothing)."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args, **kwargs)

    return call


def _eager_hook(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, run outside any graph dynamo traces (a compiled optimizer step)."""
    disable = getattr(torch.compiler, "disable", None)
    return disable(hook) if disable is not None else hook


def _closure_first(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer``'s step() is one of PyTorch's own (a subclass that keeps it,
    ``class MyAdamW(AdamW)``, too): they call the closure before moving anything."""
    owner = next((c for c in type(optimizer).__mro__ if "step" in vars(c)), None)
    return owner is not None and owner.__module__.startswith(_TORCH_OPTIM)


def _let_go(optimizer: torch.optim.Optimizer, options: Options) -> bool:
    """Whether nothing but nanguard refers to ``optimizer`` (its options, its own frames):
    the training code let it go (rebound the name to a new optimizer)."""
    for holder in gc.get_referrers(optimizer):
        # (the options object, or its __dict__: what Python 3.10 reports for a dataclass)
        if isinstance(holder, Options) or holder is getattr(options, "__dict__", None):
            continue
        if isinstance(holder, types.FrameType) and holder.f_code.co_filename == __file__:
            continue
        if isinstance(holder, dict) and _stale_locals(holder, optimizer):
            continue
        return False
    return True


def _stale_locals(holder: dict[str, Any], value: object) -> bool:
    """Whether ``holder`` is the locals of a function running on this thread's stack as read
    once (Python < 3.13: a debugger, a traceback, nanguard's look for a GradScaler at
    watch()), a copy that keeps what a name held then, ``value``, while the name now holds
    something else. Only a frame whose variables those names are is read again: that
    updates its copy (or, for another frame with those names, makes one, kept until the
    frame ends: this runs at most a few times a run, when another optimizer took over)."""
    names = set(holder)
    frame: types.FrameType | None = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if (
            frame.f_globals is not holder
            and code.co_filename != __file__
            and names <= {*code.co_varnames, *code.co_cellvars, *code.co_freevars}
            and frame.f_locals is holder
        ):
            return not any(v is value for v in holder.values())
        frame = frame.f_back
    return False


#: The package of PyTorch's own optimizers, whose step(closure) calls the closure first.
_TORCH_OPTIM: Final = "torch.optim."


#: Reasons of the events a rank gets for a NaN/Inf another rank made.
_OTHER_RANKS: Final = frozenset({"allreduce", "other_rank"})


def _on_any_rank(flag: bool, parallel: nn.Module | None) -> bool:
    """Whether ``flag`` holds on any rank of ``parallel``'s process group (one all-reduce);
    ``flag`` itself when no data-parallel wrapper synchronises the ranks (they may not all
    be here: a collective would wait for them forever)."""
    return bool(_max_on_ranks(1.0 if flag else 0.0, parallel))


def _max_on_ranks(level: float, parallel: nn.Module | None) -> float:
    """The largest ``level`` of the ranks of ``parallel``'s process group (one all-reduce;
    ``level`` itself without a data-parallel wrapper)."""
    if parallel is None:
        return level
    dist = torch.distributed
    group = getattr(parallel, "process_group", None)
    device = next((p.device for p in parallel.parameters()), torch.device("cpu"))
    value = torch.tensor([level], device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def _joining(parallel: nn.Module) -> bool:
    """Whether DDP runs under ``Join`` (uneven inputs): ranks that ran out of batches only
    shadow DDP's own collectives."""
    return bool(getattr(getattr(parallel, "_join_config", None), "enable", False))


def _unwrap(owner: object, name: str, previous: Callable[..., Any] | None) -> None:
    """Put back what ``owner.name`` was before nanguard's wrapper: the newest wrapper of a
    guard still attached, else the class's method. (Only nanguard's own wrappers whose
    guards were detached are skipped: a user's or a library's wrapper stays.)"""
    while previous is not None and getattr(previous, "_nanguard_active", True) is False:
        previous = getattr(previous, "_nanguard_previous", None)
    if previous is not None:
        owner.__dict__[name] = previous
    else:
        del owner.__dict__[name]


def _put_back(restored: list[str], when: str) -> str:
    """The sentence on running statistics put back (none: nothing)."""
    if not restored:
        return ""
    names = ", ".join(f"`{n}`" for n in restored)
    return f" The running statistics its forward had made non-finite were put back {when}: {names}."


def _skip_reason(outcome: Outcome, elsewhere: bool = False) -> str:
    """Why a step was skipped: its gradients, or (they were finite) what the origin made."""
    if elsewhere:
        return (
            "another rank's step went non-finite (its guard reports the origin; every rank "
            "skips it)"
        )
    if any(e.phase in ("grad", "backward") and e.kind in ("nan", "inf") for e in outcome.events):
        return "its gradients were non-finite"
    origin = next((e for e in outcome.events if e.is_origin), None)
    if origin is not None and origin.phase == "loss":
        return "its loss was non-finite"
    if origin is not None and origin.phase in ("input", "forward"):
        return "its forward made non-finite values"
    return "it held non-finite values"


def _stops(event: Event) -> bool:
    """Not an origin, yet the policy acts on it: another rank's NaN in the gradients, or
    gradients an earlier step left non-finite in .grad (``not_zeroed``)."""
    return not event.is_origin and event.details.get("reason") in _STOPPING


#: Not origins, yet they stop the step: another rank's NaN arriving in the all-reduce, and
#: the non-finite gradients of a step that raised, left in .grad and about to be applied.
_STOPPING: Final = frozenset({"allreduce", "not_zeroed"})


def _alarming(event: Event) -> bool:
    """An early warning about finite values that deserves the user's attention (an
    expected GradScaler skip does not; a collapsing scale does), or the news that the
    weights are non-finite for good."""
    if event.kind == "amp_overflow":
        return bool(event.details.get("collapse"))
    return event.kind in _WARNING_KINDS or "weights_nonfinite" in event.details


def _remove_leaf_hooks(record: ForwardRecord) -> None:
    handles, record.handles = record.handles, []
    for handle in handles:
        handle.remove()


def _copy_all(targets: list[Tensor], sources: list[Tensor]) -> None:
    """``targets[i].copy_(sources[i])`` for all, in one multi-tensor call where torch has it."""
    copy = getattr(torch, "_foreach_copy_", None)
    if copy is not None:
        copy(targets, sources)
        return
    for target, source in zip(targets, sources, strict=True):  # (torch < 2.2)
        target.copy_(source)


def _with_message(event: Event, message: str) -> Event:
    import dataclasses

    return dataclasses.replace(event, message=message)


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
        AttachError: another guard watches the model (or a module of it).
        OSError: ``log_path``'s file cannot be opened.

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


def unwatch(model: nn.Module) -> int:
    """Detach every guard whose hooks are on ``model`` (watching it, a module inside it,
    or a model that contains it): a guard that was lost (a notebook cell run again, a
    function that raised before ``detach()``). Returns how many were detached.

    On a copy of a watched model (``copy.deepcopy``, a pickle), it also removes the inert
    hooks the copy holds in place of nanguard's (``torch.jit.script`` cannot compile them).

    Example:
        >>> import torch, nanguard
        >>> model = torch.nn.Linear(3, 1)
        >>> _ = nanguard.watch(model)
        >>> nanguard.unwatch(model)
        1
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"nanguard.unwatch() takes a torch.nn.Module, got {type(model).__name__}")
    inside = {id(m) for m in model.modules()}
    guards = [
        g
        for g in list(_ATTACHED)
        if id(g._model) in inside
        or id(g._inner) in inside
        or any(m is model for m in g._model.modules())
    ]
    for guard in guards:
        guard.detach()
    strip_inert_hooks(model)
    return len(guards)
