"""Hooks and the per-step probe buffer.

Every hooked module gets a forward pre-hook and a forward hook. They keep a
per-thread stack of module calls (so a tensor first seen entering a child is
known to come from its parent's own code), probe each tensor once per forward
(a tensor seen before is only referenced) and append the 0-d probe results to
the forward's record. A probed tensor that requires grad also gets a gradient
hook: its gradient is probed in the backward, in the order autograd makes it.
No hook reads a tensor value: the buffer is resolved once per step, by the guard.

Parameter-free activations, pooling and reshapes ("passthrough" modules) get
only a forward hook that records their output as an alias of their input: they
cannot create NaN/Inf from finite values, so probing them would only cost time.

This is the hot path of the library: a few microseconds per module call, so
the code favours local variables and inlined checks over small helpers.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import itertools
import math
import os
import re
import sys
import threading
import warnings
import weakref
from collections.abc import Callable, Container, Iterable, Iterator
from types import FrameType
from typing import Any, Final

import torch
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from nanguard._checks import (
    CHECKED_DTYPES,
    bad_samples,
    flags_of_tensor,
    probe,
    probe_source,
    shape_of,
    stored_values,
    tensor_stats,
)
from nanguard._masks import is_mask_name
from nanguard._probes import ForwardRecord, Frame, HookedModule, Item, LossRecord, Replay, Site
from nanguard._tree import OBJECT_BUDGET, Path, attributes, collect, is_data_object

__all__ = [
    "HOOK_MARK",
    "MODULE_KEYS",
    "PASSTHROUGH",
    "Modes",
    "Recorder",
    "in_backward",
    "is_passthrough",
    "rng_state",
    "versions",
]

#: How a tensor is probed, besides the default (any NaN/Inf shows).
PROBE_MASK: Final = 1  # an additive mask: -Inf is expected (amax)
PROBE_NAN: Final = 2  # allow_inf: only NaN shows

#: Attribute of nanguard's module hooks (see _Hook), to find them on a module.
HOOK_MARK: Final = "__nanguard_hook__"

#: Parameter-free modules that map finite inputs to finite outputs of no larger
#: magnitude. Exact types only: a subclass may override ``forward``.
PASSTHROUGH: Final = frozenset(
    {
        nn.Identity,
        nn.Flatten,
        nn.Unflatten,
        nn.ReLU,
        nn.ReLU6,
        nn.LeakyReLU,
        nn.GELU,
        nn.SiLU,
        nn.Mish,
        nn.Tanh,
        nn.Sigmoid,
        nn.Hardtanh,
        nn.Hardsigmoid,
        nn.Hardswish,
        nn.Softsign,
        nn.Softmax,
        nn.Softmin,
        nn.Dropout,
        nn.Dropout1d,
        nn.Dropout2d,
        nn.Dropout3d,
        nn.AlphaDropout,
        nn.MaxPool1d,
        nn.MaxPool2d,
        nn.MaxPool3d,
        nn.AdaptiveMaxPool1d,
        nn.AdaptiveMaxPool2d,
        nn.AdaptiveMaxPool3d,
    }
)
# Not average pooling: its sum of huge finite values can overflow before the division.
# Dropout scales by 1/(1-p): it can push float16 values near 65504 over the edge.
_SCALING: Final = frozenset({nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout})
# Saturating activations: the site they share describes their input, not their bounded output.
_BOUNDED: Final = frozenset(
    {nn.Tanh, nn.Sigmoid, nn.Hardtanh, nn.Hardsigmoid, nn.Softsign, nn.Softmax, nn.Softmin}
)

_graph_task_id: Callable[[], int] = getattr(torch._C, "_current_graph_task_id", lambda: -1)
_is_compiling: Callable[[], bool] = getattr(
    getattr(torch, "compiler", None), "is_compiling", lambda: False
)
_set_grad_enabled = torch._C._set_grad_enabled
_is_grad_enabled = torch.is_grad_enabled
_new_site = tuple.__new__
_F32 = torch.float32
_F16 = torch.float16
_HALF = (torch.float16, torch.bfloat16)
_Parameter = nn.Parameter
_SCALARS = (int, float, str, bool)
_cuda_initialized: Callable[[], bool] = torch.cuda.is_initialized
_any_autocast: Callable[[], bool] = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)
#: The innermost torch.func transform running (vmap, grad, jacrev), or None.
_in_transform: Callable[[], object] = getattr(
    getattr(torch._C, "_functorch", None), "peek_interpreter_stack", lambda: None
)
_functorch_wrapped: Callable[[Tensor], bool] = getattr(
    getattr(torch._C, "_functorch", None), "is_functorch_wrapped_tensor", lambda t: False
)

# Training forwards that nobody ends (no optimizer, no guard.step() yet) are resolved
# after this many, so that memory stays bounded.
MAX_PENDING_RECORDS: Final = 64
# With a known step end (gradient accumulation over many micro-batches), the limit.
MAX_STEP_RECORDS: Final = 4096
# ...but training forwards in a row with no backward between them are resolved after this
# many: a loop dropping batches (if not torch.isfinite(loss): continue) after something made
# every loss non-finite never reaches optimizer.step(), and would keep them all, silent.
MAX_WITHOUT_BACKWARD: Final = 64
_SUSPECT: Final = 8  # (from this many on, whether their graphs are still held is noted)
# A step this long is worth a warning: steps may be ending unseen (GradScaler's skips).
LONG_STEP: Final = 64
# Forwards in eval() mode with gradients on and no backward (a validation loop without
# no_grad, waiting for the next optimizer step) whose inputs are kept for a replay, per
# step: it bounds the batches kept alive. Forwards that get a backward keep theirs.
MAX_KEPT_INPUTS: Final = 32
# Training forwards per step whose output gradients are kept for a backward replay (each
# is as large as the model's outputs: the logits of a language model).
MAX_KEPT_GRADS: Final = 8


#: What a hook registered with_kwargs gets when a copy of it was registered without
#: (torch.ao.quantization's swap_module, in prepare_qat and convert, copies a module's
#: hooks onto the module that replaces it that way): no keyword arguments, no output.
_NO_KWARGS: Final[dict[str, Any]] = {}
_NO_OUTPUT: Final = object()

_HOOK_DICTS: Final = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


def _inert_hook(module: Any = None, *args: Any, **kwargs: Any) -> None:
    """What a copy of a watched module holds in place of nanguard's hooks: nothing. It
    removes itself when first called (the copy's first forward)."""
    if isinstance(module, nn.Module):
        strip_inert_hooks(module)


def strip_inert_hooks(model: nn.Module) -> None:
    """Remove the inert hooks a copy of a watched model holds (``torch.jit.script`` cannot
    compile them)."""
    for module in model.modules():
        ids = [k for k, hook in module._forward_pre_hooks.items() if hook is _inert_hook]
        ids += [k for k, hook in module._forward_hooks.items() if hook is _inert_hook]
        for name in _HOOK_DICTS if ids else ():
            hooks = module.__dict__.get(name)
            if hooks is not None:
                for k in ids:
                    hooks.pop(k, None)
        for name in ("_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"):
            loads = module.__dict__.get(name)  # (see Guard: torch wraps a pre-hook)
            if loads:
                for k in [k for k, hook in loads.items() if getattr(hook, "hook", hook) in _INERT]:
                    del loads[k]


def _inert() -> Callable[..., None]:
    return _inert_hook


class _Hook(functools.partial):  # type: ignore[type-arg]
    """One of nanguard's module hooks.

    A copy of the watched model (``copy.deepcopy`` for an EMA or SWA average, ``pickle``,
    ``torch.save(model)``) copies its hooks too: the copy gets an inert hook instead, so it
    is not recorded as the watched model, does not keep the guard alive, and can be
    pickled or watched by a guard of its own.
    """

    __nanguard_hook__ = True  # HOOK_MARK: a guard's own hook (a copy's is inert)
    recorder: int = 0  # id() of the Recorder that made it (its copies are found by it)

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _inert, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert_hook

    def __copy__(self) -> Callable[..., None]:
        return _inert_hook


def _inert_load_hook(*args: Any, **kwargs: Any) -> None:
    """What a copy of a watched model holds in place of nanguard's ``load_state_dict``
    hooks: nothing. (Removed with the copy's other inert hooks at its first forward, not
    when called: a load is iterating over them.)"""


def _inert_load() -> Callable[..., None]:
    return _inert_load_hook


_INERT: Final = (_inert_hook, _inert_load_hook)


class CopySafeHook(_Hook):
    """One of nanguard's ``load_state_dict`` hooks: a copy of the model gets an inert one."""

    def __reduce__(self) -> tuple[Callable[[], Callable[..., None]], tuple[()]]:
        return _inert_load, ()

    def __deepcopy__(self, memo: dict[int, Any]) -> Callable[..., None]:
        return _inert_load_hook

    def __copy__(self) -> Callable[..., None]:
        return _inert_load_hook


class _PostHook(_Hook):
    """One of nanguard's forward (post) hooks: kept after the user's (see
    ``Recorder.keep_hooks_last``)."""


class _AroundCompiled:
    """Stands in for the watched model's ``_compiled_call_impl`` (``model.compile()``).

    ``module.compile()`` compiles the module's ``_call_impl``, its hooks inside, where they
    stand aside (no graph break): the model's own hooks are run around the compiled call
    instead, as a ``torch.compile`` wrapper runs them. (A copy of the model, an EMA average
    or a pickle, is not compiled: ``nn.Module.__getstate__`` leaves the compiled call out.)
    """

    def __init__(
        self,
        compiled: Callable[..., Any],
        module: nn.Module,
        pre: Callable[..., None],
        post: Callable[..., None],
    ) -> None:
        self.compiled = compiled
        self.module = module
        self.pre = pre
        self.post = post

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self.module
        self.pre(module, args, kwargs)
        try:
            output = self.compiled(*args, **kwargs)
        except BaseException:
            self.post(module, args, kwargs, None)  # (as always_call=True does)
            raise
        self.post(module, args, kwargs, output)
        return output


def eager_call(module: nn.Module) -> Callable[..., Any]:
    """``module.__call__`` without a compiled call (``module.compile()``): a replay runs
    eagerly, with the hooks in place."""
    if module.__dict__.get("_compiled_call_impl") is not None:
        return module._call_impl
    return module


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


def user_stacklevel() -> int:
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


def is_passthrough(module: nn.Module) -> bool:
    """Whether ``module`` can be recorded as an alias of its input."""
    if type(module) not in PASSTHROUGH:
        return False
    if isinstance(module, nn.LeakyReLU) and abs(module.negative_slope) > 1:
        return False
    return not module._parameters and not module._buffers


def _running(module: nn.Module) -> bool:
    """Whether ``module.forward`` is on this thread's Python stack (a recursive call)."""
    code = getattr(type(module).forward, "__code__", None)
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and frame.f_locals.get("self") is module:
            return True
        frame = frame.f_back
    return False


def record_root(record: ForwardRecord | None) -> HookedModule | None:
    """The module whose call a record is (its first frame)."""
    if record is None or not record.frames:
        return None
    return record.frames[0].hooked


def in_backward() -> bool:
    """True while autograd runs a backward (e.g. a checkpointed forward being recomputed)."""
    return _graph_task_id() != -1


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


def _user_saved_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The user's ``saved_tensors_hooks`` the forward runs under (activations kept in
    float16, or compressed), which change what the backward computes from; not torch's own
    (``save_on_cpu`` keeps the values, a non-reentrant checkpoint's belong to its frame)."""
    hooks = top_saved_hooks()
    if hooks is None or getattr(hooks[0], "__module__", "torch").startswith("torch"):
        return None
    return hooks


def top_saved_hooks() -> tuple[Callable[..., Any], Callable[..., Any]] | None:
    """The ``saved_tensors_hooks`` in force now (the innermost), if any."""
    if _top_saved_hooks is None:
        return None
    try:
        hooks = _top_saved_hooks(False)
    except (TypeError, RuntimeError):  # (another signature)
        return None
    return hooks  # type: ignore[no-any-return]


_top_saved_hooks = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)


class Modes:
    """Autograd and autocast state at the start of a forward, for a faithful replay."""

    __slots__ = ("autocast", "grad", "inference", "saved_hooks", "training")

    def __init__(self, grad: bool, training: bool = True) -> None:
        self.grad = grad
        self.training = training  # the model's train()/eval() mode
        self.inference = torch.is_inference_mode_enabled()
        self.autocast = _autocast_modes()
        self.saved_hooks = _user_saved_hooks() if grad else None


class _Local(threading.local):
    def __init__(self) -> None:
        self.stack: list[int] = []
        self.record: ForwardRecord | None = None
        self.capture: frozenset[int] | None = None  # replay: sites to compute stats for
        self.capture_grads: frozenset[int] = frozenset()
        self.capture_backward = False  # replay: probe every gradient, exactly
        self.capture_inputs: frozenset[int] = frozenset()  # replay: frames to describe
        self.capture_exact = False  # replay: exact flags (and statistics) of every site
        self.probing = False  # nanguard's own operations are running (in a replay)
        self.captured: ForwardRecord | None = None
        # The backward the watched forwards run in: none (-1), but for a replay that
        # sync="module" runs inside one. A forward recomputed in a later backward (a
        # reentrant checkpoint) is not a new forward.
        self.task = -1


def _version(t: Tensor) -> int:
    """The in-place modification counter; -1 for inference tensors (they have none)."""
    try:
        return t._version
    except RuntimeError:
        return -1


class Recorder:
    """Owns the hooks and the step buffer of one guard."""

    def __init__(
        self,
        *,
        keep_inputs: bool,
        backward: str,
        on_site: Callable[[ForwardRecord | LossRecord, int, Tensor], None] | None,
        on_grad: Callable[[ForwardRecord, int, Tensor], None] | None,
        on_record: Callable[[ForwardRecord | None], None],
    ) -> None:
        self._keep_inputs = keep_inputs
        # "probes": every module's gradients; "boundary": only those crossing the top-level
        # call (the rest is found by replaying a failing step); "off": none.
        self._backward = backward
        self._on_site = on_site  # sync="module": called after each new site
        self._on_grad = on_grad  # sync="module": called after each gradient probe
        self._on_record = on_record  # called when a record ends (may resolve)
        # Called as a training forward of the model starts (skip_step keeps the running
        # statistics it is about to update).
        self.on_training_forward: Callable[[], None] | None = None
        # Output shapes of the model's latest call in this step (see ForwardRecord).
        self.last_outputs: tuple[tuple[int, ...], ...] = ()
        self.buffer_ids: frozenset[int] = frozenset()  # the watched model's buffers
        self._local = _Local()
        self._lock = threading.Lock()
        self._pending: list[Item] = []
        self._counter = itertools.count(1)  # next() on it is atomic
        self._handles: list[RemovableHandle] = []  # the model's own hooks
        self._inner: list[RemovableHandle] = []  # every other module's
        self._modules: list[HookedModule] = []
        self._watched_ids: set[int] | None = None  # ids of their modules, when asked
        self._rehooked_from: set[int] | None = None  # ...before a rehook
        # The model's own hooks: (model, pre-hook, post-hook), see cover_compiled.
        self._root_calls: tuple[nn.Module, Callable[..., None], Callable[..., None]] | None = None
        self._mask_names: dict[str, bool] = {}
        self.compiled = False  # the model is a torch.compile wrapper: inner hooks never run
        self.step = 0
        self.updates = 0  # optimizer steps that changed the watched parameters
        self.stepping = False  # inside the guard's optimizer.step() (a closure's forwards)
        self.step_ends = False  # an optimizer, a scaler or guard.step() ends the steps
        self.has_optimizer = False  # optimizer= was given (its step ends the steps)
        self._training = 0  # pending training forwards
        self.forwards = 0  # forwards recorded in this step (the guard resets it)
        self.model_forwards = 0  # ...of them, calls of the model itself
        self.training_forwards = 0  # ...of them, with autograd on
        self._last_record: weakref.ref[ForwardRecord] | None = None  # (its outputs: above)
        self.train_forwards = 0  # ...of them, in train() mode too (micro-batches)
        self.train_model_forwards = 0  # ...of those, calls of the model itself
        self.scaler_known = False  # the guard sees GradScaler's skipped steps
        self.track_outputs = False  # keep weak references to the model's outputs
        self.raised_others = 0  # forwards that raised about something else, looked into
        self._loss_nodes: collections.deque[LossRecord] = collections.deque(maxlen=2)
        self._warned_long = False
        self._half_training = 0  # pending training forwards under float16 autocast
        self._eval_waiting = 0  # pending eval() forwards with gradients on and no backward yet
        self.eval_trained = False  # an eval() forward with gradients on got its backward
        self.without_backward = 0  # training forwards since a gradient was last probed
        self._kept = 0  # of which output gradients are kept
        self._kept_bytes = 0  # ...and how many bytes they hold
        # Bytes of the inputs kept for a replay of this step's later micro-batches, and
        # their storages (see _bound_inputs).
        self._input_bytes = 0
        self._input_storages: set[int] = set()
        # Bytes of earlier micro-batches' output gradients kept beyond their own backward
        # (set at attach: a tenth of the model's parameters, at least 64 MiB).
        self.kept_budget = 64 << 20
        # ...and of the inputs of earlier micro-batches kept for a replay (see _bound_inputs;
        # set at attach: a tenth of the model's parameters, at least 128 MiB).
        self.input_budget = 128 << 20
        # Small floating buffers outside BatchNorm-like modules (which never read in train
        # mode what they update), found at the first forward: (owner, name).
        self._stat_buffers: list[tuple[nn.Module, str]] | None = None
        self.buffer_updaters: set[tuple[int, str]] = set()  # ...a forward updated in place
        self._buffer_forwards = 0  # forwards that kept a copy of every one of them
        # Tensor attributes a forward replaces (self.h = h.detach()), learnt in the first
        # two forwards after attach.
        self._carried: list[tuple[nn.Module, str]] = []
        # ...by identity ((id(module), name): a module may define __eq__, torchmetrics' does)
        self._carried_keys: set[tuple[int, str]] = set()
        self._attribute_forwards = 0

    # ------------------------------------------------------------------ hooks
    def watched_ids(self) -> set[int]:
        """Ids of the modules the guard hooks (all of them in sentinel mode too, where a
        step hooks the model alone and its replay every one)."""
        if self._watched_ids is None:
            ids = {id(m.module) for m in self._modules}
            self._watched_ids = ids & self._rehooked_from if self._rehooked_from else ids
        return self._watched_ids

    def attach(self, modules: Iterable[HookedModule], *, full: bool = True) -> None:
        """Hook the modules; the first is the model. ``full=False``: only the model itself
        (sentinel steps); the others are hooked for replays or full steps."""
        # Hooked again after a change of the model (see Guard._rehook): a module new to
        # the model ran unhooked until now, so is never taken for one that did not run.
        before = {id(m.module) for m in self._modules} if self._modules else None
        self._modules = list(modules)
        self._watched_ids = None
        self._rehooked_from = before
        self._stat_buffers = None  # (the model's modules may have changed)
        self._carried = []
        self._carried_keys = set()
        self._attribute_forwards = 0
        try:
            self._handles = self._hook(self._modules[:1])
            self.set_full(full)
            self.cover_compiled()
        except BaseException:
            self.detach()
            raise

    def cover_compiled(self) -> bool:
        """Run the model's own hooks around its compiled call if it was compiled in place
        (``model.compile()``; at attach, and each step: compiled after ``watch()``).
        Whether it was compiled since the last look."""
        calls = self._root_calls
        if calls is None:
            return False
        module, pre, post = calls
        compiled = module.__dict__.get("_compiled_call_impl")
        if compiled is None or isinstance(compiled, _AroundCompiled):
            return False
        module._compiled_call_impl = _AroundCompiled(compiled, module, pre, post)
        self.compiled = True  # (the modules inside record nothing: replay a failing step)
        return True

    def _hook(self, modules: Iterable[HookedModule]) -> list[RemovableHandle]:
        handles: list[RemovableHandle] = []
        try:
            for hooked in modules:
                m = hooked.module
                if hooked.passthrough:
                    post = self._make_passthrough_hook(hooked)
                else:
                    pre, post = self._make_hooks(hooked)
                    if self._modules and hooked is self._modules[0]:
                        self._root_calls = (m, pre, post)  # (see cover_compiled)
                    # First of the module's pre-hooks: what the others compute (the weight
                    # of the hook-based weight_norm, spectral_norm and pruning) is the
                    # module's own code.
                    hook = _Hook(pre)
                    hook.recorder = id(self)
                    handles.append(
                        m.register_forward_pre_hook(hook, prepend=True, with_kwargs=True)
                    )
                # The model's post-hook runs even when its forward raises (the step's record
                # is closed, the error noted). Not the others': a submodule's always_call
                # hook id is guarded by torch.compile, so identical blocks compiled one by
                # one would each recompile (the recompile limit is 8); the stack mends a
                # submodule's skipped post-hook (see post_hook).
                root = bool(self._modules) and hooked is self._modules[0]
                hook = _PostHook(post)
                hook.recorder = id(self)
                handles.append(m.register_forward_hook(hook, with_kwargs=True, always_call=root))
        except BaseException:
            for handle in handles:
                handle.remove()
            raise
        return handles

    def keep_hooks_last(self) -> None:
        """Put each module's post-hook back after the forward hooks registered since (a
        user's hook that rewrites an output, registered after ``watch()``: what the next
        module receives is the output to check). Between steps only: a few times."""
        for handle in (*self._handles, *self._inner):
            hooks = handle.hooks_dict_ref()
            if (
                isinstance(hooks, collections.OrderedDict)
                and isinstance(hooks.get(handle.id), _PostHook)
                and next(reversed(hooks)) != handle.id
            ):
                hooks.move_to_end(handle.id)

    @property
    def modules(self) -> list[HookedModule]:
        """The hooked modules, the model first."""
        return list(self._modules)

    @property
    def root(self) -> HookedModule | None:
        """The watched model itself (the first hooked module)."""
        return self._modules[0] if self._modules else None

    @property
    def full(self) -> bool:
        """Whether every module is hooked (else only the model: a sentinel step)."""
        return bool(self._inner) or len(self._modules) <= 1

    def set_full(self, full: bool) -> None:
        """Hook every module (``True``) or only the model (``False``), from the next forward."""
        if full and not self._inner:
            self._inner = self._hook(self._modules[1:])
        elif not full and self._inner:
            inner, self._inner = self._inner, []
            for handle in inner:
                handle.remove()

    @contextlib.contextmanager
    def full_hooks(self) -> Iterator[None]:
        """Every module hooked for the duration (a replay of a sentinel step)."""
        was = self.full
        self.set_full(True)
        try:
            yield
        finally:
            self.set_full(was)

    def detach(self) -> None:
        # The losses' autograd nodes carry this recorder's hooks: kept here, a cycle through
        # C++ objects that the garbage collector cannot break (the model would outlive it).
        for record in self._loss_nodes:
            record.node = None
        self._loss_nodes.clear()
        self.set_full(False)
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        if self._modules:  # (copies on modules swapped in since: quantization's)
            for module in self._modules[0].module.modules():
                found = [
                    key
                    for hooks in (module._forward_pre_hooks, module._forward_hooks)
                    for key, hook in hooks.items()
                    if isinstance(hook, _Hook) and getattr(hook, "recorder", None) == id(self)
                ]
                for name in _HOOK_DICTS if found else ():
                    dictionary = module.__dict__.get(name)
                    if dictionary is not None:
                        for key in found:
                            dictionary.pop(key, None)
        calls, self._root_calls = self._root_calls, None
        if calls is not None:
            around = calls[0].__dict__.get("_compiled_call_impl")
            if isinstance(around, _AroundCompiled):
                calls[0]._compiled_call_impl = around.compiled

    def _make_hooks(self, hooked: HookedModule) -> tuple[Callable[..., None], Callable[..., None]]:
        local = self._local
        start = self._start_record
        see = self._see
        see_all = self._see_all
        finish = self._finish_record
        mask_name = self._mask_name
        describe_inputs = self._describe_inputs
        is_model = bool(self._modules) and hooked is self._modules[0]
        recorder = self

        def pre_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] = _NO_KWARGS
        ) -> None:
            # (kwargs missing: a copy of this hook registered without with_kwargs, on a
            # module that replaced this one; see _tolerant)
            # Inside torch.compile the hook is skipped (no graph break; a failing step is
            # replayed eagerly). A recomputation inside backward is not a new forward.
            if _is_compiling() or _graph_task_id() != local.task:
                return
            stack = local.stack
            if stack and is_model and record_root(local.record) is hooked and not _running(module):
                # The model is called again while its last call is still open: that call
                # was interrupted (KeyboardInterrupt skips the post-hooks). Forget it.
                stale = local.record
                if stale is not None:
                    for handle in stale.handles:
                        handle.remove()
                stack = local.stack = []
                local.record = None
            if stack:
                record = local.record
                if record is None:
                    return
                parent = stack[-1]
            else:
                record = local.record = start(module, args, kwargs)
                parent = -1
            counts = record.counts
            call = counts.get(hooked, 0)
            counts[hooked] = call + 1
            frames = record.frames
            index = len(frames)
            inputs: list[int] = []
            paths: list[Path] = []
            frames.append(Frame(hooked, call, parent, inputs, paths))
            stack.append(index)
            if record.targets is not None and _in_transform() is not None:
                record.transformed = record.transformed | {index}
            if record.input_frames and index in record.input_frames:
                describe_inputs(record, index, args, kwargs)
            masks = hooked.mask_positions
            if record.coarse and record.replay is not None:
                # A sentinel step probes the outputs only: a failing step is replayed with
                # every site checked exactly, which tells a bad batch from a bad layer.
                # Inputs that carry gradients back out (a decoder fed by a watched encoder)
                # are probed too: a NaN the backward sends there reaches no output.
                if parent < 0:
                    for position, arg in enumerate(args):
                        if isinstance(arg, Tensor) and arg.requires_grad:
                            see(record, index, inputs, paths, "input", ("args", position), arg,
                                position in masks)  # fmt: skip
                return
            seen = record.seen
            root = parent < 0  # (a batch object given to the model: its tensors are probed)
            for position, arg in enumerate(args):
                if isinstance(arg, Tensor):
                    # The previous module's output, unchanged: a reference (see _see).
                    entry = seen.get(id(arg)) if seen is not None else None
                    if entry is not None and entry[0]() is arg:
                        try:
                            version = arg._version
                        except RuntimeError:
                            version = -1
                        if entry[2] == version:
                            inputs.append(entry[1])
                            paths.append(("args", position))
                            continue
                    mask = position in masks
                    see(record, index, inputs, paths, "input", ("args", position), arg, mask)
                elif arg is not None and not isinstance(arg, _SCALARS):
                    see_all(record, index, inputs, paths, "input", ("args", position), arg, 0, root)
            if kwargs:
                for name, arg in kwargs.items():
                    if isinstance(arg, Tensor):
                        mask = mask_name(name)
                        see(record, index, inputs, paths, "input", ("kwargs", name), arg, mask)
                    elif arg is not None and not isinstance(arg, _SCALARS):
                        see_all(
                            record, index, inputs, paths, "input", ("kwargs", name), arg, 0, root
                        )

        def post_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any = _NO_OUTPUT
        ) -> None:
            if _is_compiling() or _graph_task_id() != local.task:
                return
            if output is _NO_OUTPUT:  # (a copy called as hook(module, args, output))
                output, kwargs = kwargs, _NO_KWARGS
            stack = local.stack
            record = local.record
            if not stack or record is None:
                return  # hooks attached in the middle of a forward
            index = stack.pop()
            frames = record.frames
            unreturned: list[int] = []  # (innermost first)
            if frames[index].hooked is not hooked:  # a forward raised (and was caught)
                while stack and frames[index].hooked is not hooked:
                    unreturned.append(index)
                    index = stack.pop()
            outputs = frames[index].outputs
            mode = PROBE_NAN if hooked.allow_inf else PROBE_MASK if hooked.neg_inf_outputs else 0
            # The call has returned (before its outputs are seen: sync="module" resolves
            # at once, and finds this call the origin while it returns).
            record.order.append(~index)
            # (The model's own outputs keep their paths: a loss reads one of them.)
            paths = frames[index].output_paths = [] if not stack else None
            # (The model's own outputs: also inside a plain object of the user's, a
            # diffusers posterior holding its moments; what flows between its modules not.)
            top = not stack
            # (...but not the batch object it was given, filled in and handed back: its
            # inputs, NaN imputed by the model perhaps, are no value it made.)
            walk = top and walks_output(output, args, kwargs)
            if hooked.posinf_paths:  # (+inf written on purpose in some of its outputs)
                found_outputs: list[tuple[Path, Tensor]] = []
                collect(output, (), found_outputs, objects=walk, bound_containers=False)
                for sub_path, tensor in found_outputs:
                    at = PROBE_NAN if sub_path in hooked.posinf_paths else mode
                    see(record, index, outputs, paths, "output", sub_path, tensor, at)
            elif isinstance(output, Tensor):
                see(record, index, outputs, paths, "output", (), output, mode)
            elif output is not None:
                see_all(record, index, outputs, paths, "output", (), output, mode, walk)
                if record.frame_uses is not None and len(outputs) > 1:
                    _note_uses(record, index, output, walk)
            if top:
                if recorder.track_outputs or not record.grad or record.eval_mode:
                    # Several guards: which model feeds which. An inference call: what a loop
                    # feeding its outputs back carries (see Resolver._carried_inputs).
                    found: list[tuple[Path, Tensor]] = []
                    collect(output, (), found, objects=walk, bound_containers=False)
                    record.output_refs = tuple(weakref.ref(t) for _, t in found)
                    if record.grad and not record.eval_mode:
                        # The nodes that made them outlive the tensors (torch.cat([h, ...])
                        # keeps no reference to h); a backward frees what they saved.
                        record.output_nodes = tuple(
                            t.grad_fn for _, t in found if t.grad_fn is not None
                        )
                if not frames[index].outputs and _any_wrapped(output):
                    record.unchecked_outputs = True  # run inside vmap/grad: not probed
                if output is None:  # (an always_call hook: the forward may have raised)
                    raised = sys.exc_info()[1]
                    if (
                        isinstance(raised, Exception)
                        and not isinstance(raised, _NOT_NUMERIC)
                        and raised.__traceback__ is not None
                        # (raised by this call, not one an outer except block handles)
                        and raised.__traceback__.tb_frame is sys._getframe(1)
                    ):
                        about = _about_nonfinite(raised)
                        # An error about something else is looked into the first few times
                        # only (one host read each): a forward that raises on purpose every
                        # step (an early exit to grab features) stays at one read a step.
                        if about or recorder.raised_others < _RAISED_OTHERS:
                            recorder.raised_others += not about
                            record.raised = raised
                            record.raised_about = about
                            record.raised_frame = _raising_call(raised, frames, unreturned, index)
                finish(record, frames[index].outputs)

        return pre_hook, post_hook

    def _make_passthrough_hook(self, hooked: HookedModule) -> Callable[..., None]:
        local = self._local
        scaling = type(hooked.module) in _SCALING
        bounded = type(hooked.module) in _BOUNDED

        def passthrough_hook(
            module: nn.Module, args: tuple[Any, ...], kwargs: Any, output: Any = _NO_OUTPUT
        ) -> None:
            if _is_compiling() or _graph_task_id() != local.task:
                return
            if output is _NO_OUTPUT:  # (a copy called as hook(module, args, output))
                output, kwargs = kwargs, _NO_KWARGS
            record = local.record
            if record is None or not local.stack:
                return  # called outside a watched forward
            seen = record.seen
            if (
                seen is not None
                and args
                and isinstance(output, Tensor)
                and isinstance(args[0], Tensor)
                and not (scaling and output.dtype is _F16)
            ):
                source = args[0]
                entry = seen.get(id(source))
                # The same tensor, not modified in place since it was probed (by the caller's
                # own code, h.div_(0)) but for the activation's own in-place write (or given
                # back untouched: nn.Identity, Dropout(p=0)).
                written = output is source and getattr(module, "inplace", False) is True
                if (
                    entry is not None
                    and entry[0]() is source
                    and _version(source) == entry[2] + written
                ):
                    # The same values up to a finite-preserving map: share the site.
                    seen[id(output)] = (weakref.ref(output), entry[1], _version(output))
                    counts = record.counts  # (a call all the same: later calls count on)
                    counts[hooked] = counts.get(hooked, 0) + 1
                    if bounded:  # (its probe says nothing of this output's magnitude)
                        record.bounded_sites = record.bounded_sites | {entry[1]}
                    if output is source:  # in place: the site now describes the new version
                        seen[id(source)] = (entry[0], entry[1], _version(source))
                    return
            self._late_frame(record, hooked, args, kwargs, output)

        return passthrough_hook

    def _late_frame(
        self,
        record: ForwardRecord,
        hooked: HookedModule,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
    ) -> None:
        """Record a passthrough call in full (its input came from its caller's code)."""
        stack = self._local.stack
        counts = record.counts
        call = counts.get(hooked, 0)
        counts[hooked] = call + 1
        index = len(record.frames)
        inputs: list[int] = []
        paths: list[Path] = []
        record.frames.append(Frame(hooked, call, stack[-1] if stack else -1, inputs, paths))
        self._see_all(record, index, inputs, paths, "input", ("args",), args)
        if kwargs:
            self._see_all(record, index, inputs, paths, "input", ("kwargs",), kwargs)
        frame = record.frames[index]
        if output is not None:
            self._see_all(record, index, frame.outputs, None, "output", (), output)
        record.order.append(~index)

    def _describe_inputs(
        self, record: ForwardRecord, frame: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        """A replay: exact statistics of a call's inputs, as the call receives them."""
        found: list[tuple[Path, Tensor]] = []
        collect(args, ("args",), found, objects=frame == 0)
        collect(kwargs, ("kwargs",), found, objects=frame == 0)
        self._local.probing = True
        try:
            for path, tensor in found:
                if tensor.dtype in CHECKED_DTYPES:
                    record.input_stats[frame, path] = tensor_stats(tensor)
        finally:
            self._local.probing = False

    def _mask_name(self, name: str) -> bool:
        known = self._mask_names.get(name)
        if known is None:
            known = self._mask_names[name] = is_mask_name(name)
        return known

    def _see_all(
        self,
        record: ForwardRecord,
        frame: int,
        refs: list[int],
        paths: list[Path] | None,
        role: str,
        path: Path,
        obj: Any,
        mode: int = 0,
        objects: bool = False,
    ) -> None:
        found: list[tuple[Path, Tensor]] = []
        # (objects: a batch object's tensors; the model's outputs: all theirs, and what
        # objects among them hold within the walk's budget)
        collect(obj, path, found, objects=objects, bound_containers=role != "output")
        for sub_path, tensor in found:
            self._see(record, frame, refs, paths, role, sub_path, tensor, mode)

    def _see(
        self,
        record: ForwardRecord,
        frame: int,
        refs: list[int],
        paths: list[Path] | None,
        role: str,
        path: Path,
        t: Tensor,
        mask: int = 0,
    ) -> None:
        """Reference ``t``'s site if it was probed in this forward, else probe it.

        ``mask``: ``PROBE_MASK``: ``t`` is an additive mask, probed with ``amax`` (-Inf is
        expected); ``PROBE_NAN``: Inf of either sign is allowed (``allow_inf``), only NaN
        shows.
        """
        dtype = t.dtype
        if dtype not in CHECKED_DTYPES or t.is_meta:
            return  # integer/bool tensors cannot hold NaN/Inf
        seen = record.seen
        if seen is None:
            return
        key = id(t)
        entry = seen.get(key)
        try:
            version = t._version
        except RuntimeError:  # inference tensors have no version counter
            version = -1
        if (
            entry is not None
            and entry[0]() is t
            and entry[2] == version
            # (The model's own output shared by a reshape (nn.Flatten last): probed as
            # itself, so that its gradient's statistics have its shape.)
            and (frame or role != "output" or record.sites[entry[1]].shape == t.shape)
        ):
            refs.append(entry[1])  # the same tensor, not modified in place since
            if paths is not None:
                paths.append(path)
            if (
                frame == 0
                and role == "output"
                and self._backward == "boundary"
                and t.requires_grad
                and _is_grad_enabled()
                and record.targets is None
            ):  # the model's output, probed inside: its gradient starts the backward
                self._watch_grad(record, entry[1], t)
            return
        if _functorch_wrapped(t):
            # Inside torch.func (vmap, grad, jacrev): a probe of it would be batched or
            # traced, and could not be read after the transform. Its result is seen outside.
            return
        grad = t.requires_grad and _is_grad_enabled()
        if grad:  # the probe must not join the autograd graph
            _set_grad_enabled(False)
        capturing = record.targets is not None
        if capturing:
            self._local.probing = True
        try:
            values: tuple[Tensor, ...]
            if mask == PROBE_NAN and t.numel() and t.is_floating_point():
                values = tuple(
                    v.nan_to_num(nan=math.nan, posinf=0.0, neginf=0.0) for v in torch.aminmax(t)
                )
            elif mask and t.numel() and t.is_floating_point():
                values = (t.amax(),)
            else:
                values = (t.sum(),) if dtype is _F32 else probe(t)
            shape: tuple[int, ...] = t.shape
        except (RuntimeError, NotImplementedError):  # nested, sparse, exotic subclasses
            try:  # a nested tensor (nn.TransformerEncoder's fast path) or sparse: its values
                # A mask's largest value is read from the components, not their sums.
                values = (stored_values(t).amax(),) if mask else probe(probe_source(t))
                shape = shape_of(t)
            except (RuntimeError, NotImplementedError):
                return
        finally:
            if grad:
                _set_grad_enabled(True)
            if capturing:
                self._local.probing = False
        if not values:
            return
        site = len(record.sites)
        record_values = record.values
        record.sites.append(
            _new_site(Site, (frame, role, path, shape, dtype, len(record_values), len(values)))
        )
        record_values.extend(values)
        seen[key] = (weakref.ref(t), site, version)
        refs.append(site)
        if paths is not None:
            paths.append(path)
        if role == "input":
            record.order.append(site)
            if key in self.buffer_ids:
                record.buffer_sites = record.buffer_sites | {site}
        elif dtype in _HALF and len(values) == 2:
            record.half_outputs.append(site)
        # (A parameter is a leaf: the metaclass's isinstance check runs only for leaves.)
        if grad and not (t.is_leaf and isinstance(t, _Parameter)):
            mode = self._backward
            if mode == "probes" or record.probe_grads or (mode == "boundary" and frame == 0):
                self._watch_grad(record, site, t)
        targets = record.targets
        if targets is not None:
            local = self._local
            local.probing = True
            try:
                if record.exact_sites:
                    flags = flags_of_tensor(t)
                    record.exact[site] = flags
                    # And where the probe overflowed (a sum of huge finite values): that
                    # tells a sentinel step's false alarm from a value not reproduced.
                    # Of the non-finite sites, the first few (where the origin is): past a
                    # NaN batch every module's output is, and statistics of large tensors
                    # cost more than the replay (an origin further on gets its own).
                    if site in targets or (not flags and not all(math.isfinite(v) for v in values)):
                        record.stats[site] = tensor_stats(t)
                        if site in targets and flags:
                            record.rows[site] = _rows(t)
                    elif flags and record.exact_stats_left:
                        record.exact_stats_left -= 1
                        record.stats[site] = tensor_stats(t)
                        record.rows[site] = _rows(t)
                elif site in targets:
                    record.stats[site] = tensor_stats(t)
                    if record.stats[site].nonfinite_count:
                        record.rows[site] = _rows(t)
            finally:
                local.probing = False
        elif self._on_site is not None:
            self._on_site(record, site, t)

    def _watch_grad(self, record: ForwardRecord, site: int, t: Tensor) -> None:
        """Probe ``t``'s gradient when autograd makes it."""
        node = t.grad_fn
        if node is None:  # a leaf: its hooks outlive the graph, remove them later
            hook = functools.partial(self._grad_hook, record, site)
            record.handles.append(t.register_hook(hook))  # type: ignore[no-untyped-call]
        else:
            # A pre-hook on the node that made ``t`` sees the gradient arriving at ``t``
            # (half the cost of a tensor hook, and unaffected by later in-place ops).
            # (The record held weakly: a loss the loop keeps (losses.append(loss)) keeps the
            # graph, and would keep every step's record and output gradients with it.)
            hook = functools.partial(self._node_hook, weakref.ref(record), site, t.output_nr)
            node.register_prehook(hook)
            if self.without_backward >= _SUSPECT:
                # (The node holds the hook: when the hook is gone, so is the graph, freed
                # without a backward. See _dropped_forwards.)
                record.node_refs = (*record.node_refs, weakref.ref(hook))
            # (Where the loss's own operations end: see _resolution._loss_nodes.)
            seq = node._sequence_nr()
            record.output_seq = max(record.output_seq, seq)
            # (with its number: an id alone may be reused once the node is freed)
            record.output_node_ids = (*record.output_node_ids, (id(node), seq))

    def _node_hook(
        self,
        ref: weakref.ref[ForwardRecord],
        site: int,
        index: int,
        grads: tuple[Tensor | None, ...],
    ) -> None:
        grad = grads[index] if index < len(grads) else None
        record = ref()
        if grad is not None and record is not None:  # (None: resolved and let go)
            self._grad_hook(record, site, grad)

    def _grad_hook(self, record: ForwardRecord, site: int, grad: Tensor) -> None:
        """Probe the gradient of one site (runs inside autograd's backward)."""
        if grad is None or grad.dtype not in CHECKED_DTYPES:
            return
        enabled = _is_grad_enabled()  # on under create_graph=True: stay off the graph
        if enabled:
            _set_grad_enabled(False)
            record.double_backward = True
        try:
            values = (grad.sum(),) if grad.dtype is _F32 else probe(grad)
        except (RuntimeError, NotImplementedError):
            return
        finally:
            if enabled:
                _set_grad_enabled(True)
        if record.eval_mode and not record.grads:  # not a validation
            if record.targets is None:  # (the step's own backward, not a replay's)
                self.eval_trained = True  # (eval()-mode training: frozen BatchNorm statistics)
            if self._eval_waiting:
                self._eval_waiting -= 1
        self.without_backward = 0
        record.grads.append((site, values))  # one append: atomic across engine threads
        if record.targets is not None:  # a replay
            local = self._local
            local.probing = True
            try:
                if record.probe_grads:  # localising the backward: check exactly, at once
                    flags = flags_of_tensor(grad)
                    record.grad_exact.append((site, flags))
                    if flags and not record.grad_stats:
                        record.grad_stats[site] = tensor_stats(grad)
                elif site in record.grad_targets:
                    record.grad_stats[site] = tensor_stats(grad)
            finally:
                local.probing = False
        if site in record.keep:
            record.output_grads[site] = grad
            self._kept_bytes += grad.numel() * grad.element_size()
            if self._kept_bytes > self.kept_budget:
                self._drop_earlier_grads(record)
            if enabled and site not in record.derivative_grads:
                record.derivative_grads[site] = grad.detach()
        if self._on_grad is not None and record.targets is None:
            self._on_grad(record, site, grad)

    def _drop_earlier_grads(self, record: ForwardRecord | None) -> None:
        """Gradient accumulation with large outputs (a language model's logits): the
        output gradients of earlier micro-batches, oldest first, are let go until what is
        kept fits the budget; the latest micro-batch's are always kept."""
        with self._lock:
            for other in self._pending:
                if other is record or not isinstance(other, ForwardRecord):
                    continue
                if not other.output_grads:
                    continue
                self._kept_bytes -= sum(
                    g.numel() * g.element_size() for g in other.output_grads.values()
                )
                other.output_grads = {}
                other.grads_dropped = True
                if self._kept_bytes <= self.kept_budget:
                    return

    # ---------------------------------------------------------------- records
    def _start_record(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> ForwardRecord:
        grad = _is_grad_enabled()
        record = ForwardRecord(next(self._counter), self.step, grad, self.updates)
        if self.stepping:
            record.in_step = True  # (run by a closure: the optimizer moves the weights after)
        record.coarse = not self.full or self.compiled
        if not module.training:
            record.in_eval = True
        capture = self._local.capture
        if capture is not None:
            record.targets = capture
            record.grad_targets = self._local.capture_grads
            record.probe_grads = self._local.capture_backward
            record.input_frames = self._local.capture_inputs
            record.exact_sites = self._local.capture_exact
            if record.probe_grads or record.grad_targets:  # a backward replay
                record.frame_uses = set()  # (which outputs a call's own code used)
        else:
            if self.forwards:
                # (A submodule called on its own, a no_grad call of the backbone, is no
                # forward of the model: the model's calls are numbered among themselves.)
                model = bool(self._modules) and module is self._modules[0].module
                if grad and module.training:
                    # (A training forward is numbered among the step's training forwards:
                    # evaluation calls between steps are no micro-batch of it.)
                    count = self.train_model_forwards if model else self.train_forwards
                else:
                    count = self.model_forwards if model else self.forwards
                record.number = count + 1
                record.previous_outputs = self.last_outputs
                last = self._last_record() if self._last_record is not None else None
                if last is not None and last.grads:  # (a micro-batch's, not a loop's call)
                    record.previous_backward = True
            elif self.step == 0:  # the first forward: hooks the user added since watch()
                self.keep_hooks_last()
            if grad and self._kept_bytes > self.kept_budget:
                self._drop_earlier_grads(None)  # (the next micro-batch: memory for its own)
            if grad and module.training and self.on_training_forward is not None:
                self.on_training_forward()
            if not self._keep_inputs:
                return record
            if grad and not module.training:
                record.eval_mode = True
                if any(isinstance(a, Tensor) and a.requires_grad for a in args) or any(
                    isinstance(a, Tensor) and a.requires_grad for a in kwargs.values()
                ):
                    record.fed_grad = True  # (an eval-mode rollout: its backward will come)
            # Pending eval() forwards that never got a backward: a validation loop without
            # no_grad (eval-mode training gets its backward, and keeps its inputs).
            if record.eval_mode and self._eval_waiting >= MAX_KEPT_INPUTS:
                record.inputs_dropped = True  # a validation loop with gradients on: memory
            else:
                if (not _FLAT.issuperset(map(type, args)) and any(_copied(a) for a in args)) or (
                    kwargs
                    and not _FLAT.issuperset(map(type, kwargs.values()))
                    and any(_copied(a) for a in kwargs.values())
                ):  # a list or dict the forward may append to (a KV cache), a batch object
                    # whose attributes it may set: as it is now
                    record.given = _given_objects(args, kwargs)
                    args, kwargs = copy_containers(args), copy_containers(kwargs)
                record.replay = Replay(
                    args,
                    kwargs,
                    versions(args, kwargs),
                    rng_state(),
                    Modes(grad, module.training),
                    self._forward_buffers(module),
                    self._forward_attributes(module),
                )
                if self.forwards and grad and not record.coarse:
                    # (A later micro-batch. Sentinel mode keeps every one: its replay is
                    # what tells a bad batch from a bad layer.)
                    self._bound_inputs(record)
        return record

    def _bound_inputs(self, record: ForwardRecord) -> None:
        """Gradient accumulation over many micro-batches loaded one by one: the inputs kept
        for a replay would hold every micro-batch of the step at once. Past the budget,
        earlier ones are let go: those whose output gradients are not kept first, oldest
        first."""
        with self._lock:
            records = [r for r in self._pending if isinstance(r, ForwardRecord) and r.grad]
            for r in (*records, record):
                if r.input_bytes < 0 and r.replay is not None:
                    r.input_storages = self._new_storages(r.replay)
                    r.input_bytes = sum(r.input_storages.values())
                    self._input_bytes += r.input_bytes
            # (No backward replay of those could run anyway.)
            for other in sorted(records, key=lambda r: bool(r.output_grads)):
                if self._input_bytes <= self.input_budget:
                    return
                if other.replay is not None:
                    other.replay = None
                    other.inputs_let_go = True
                    self._input_bytes -= max(other.input_bytes, 0)
                    for key in other.input_storages:  # (freed: its address may come again)
                        self._input_storages.discard(key)

    def _new_storages(self, replay: Replay) -> dict[int, int]:
        """Address -> bytes of the storages of a forward's inputs not counted yet. Only
        tensors that are their whole storage: a chunk of a larger batch is memory the loop
        holds anyway."""
        found: list[tuple[Path, Tensor]] = []
        collect((replay.args, replay.kwargs), (), found)
        new: dict[int, int] = {}
        for _, t in found:
            try:
                storage = t.untyped_storage()
                key, size = storage.data_ptr(), storage.nbytes()
            except (RuntimeError, NotImplementedError):  # (no storage: a wrapper subclass)
                continue
            if size == t.numel() * t.element_size() and key not in self._input_storages:
                self._input_storages.add(key)
                new[key] = size
        return new

    @property
    def carried(self) -> set[tuple[int, str]]:
        """``(id(module), name)`` of the attributes a forward was seen replacing (see
        ``_forward_attributes``)."""
        return self._carried_keys

    def _forward_attributes(self, model: nn.Module) -> tuple[tuple[Any, str, Any], ...]:
        """The tensors and numbers kept as plain attributes that a forward replaces (a
        hidden state carried across steps, a call counter a branch reads), as this forward
        finds them: every one in the first two forwards, while that is learnt (see
        ``_finish_record``); then those only."""
        if self._attribute_forwards < 2:
            self._attribute_forwards += 1
            return tuple(
                (owner, name, value)
                for owner in model.modules()
                for name, value in vars(owner).items()
                if _carried_value(value) and name not in MODULE_KEYS
            )
        carried = self._carried
        if not carried:
            return ()
        return tuple((owner, name, owner.__dict__.get(name)) for owner, name in carried)

    def unlearned_buffers(self) -> set[tuple[int, str]]:
        """The small floating buffers a forward may update in place, while the first
        forwards have not shown which do yet (empty after)."""
        if self._buffer_forwards >= 2:
            return set()
        model = self._modules[0].module if self._modules else None
        if model is None:
            return set()
        return {
            (id(owner), name)
            for owner in model.modules()
            if not isinstance(owner, (BATCH_STATS_NORMS, torch.jit.ScriptModule))
            for name, buf in owner._buffers.items()
            if buf is not None and buf.is_floating_point() and buf.numel() <= _STAT_BUFFER_NUMEL
        }

    def _forward_buffers(self, model: nn.Module) -> tuple[tuple[Any, str, Any, int, Any], ...]:
        """The model's small floating buffers as this forward finds them, copied if a
        forward updates them in place (an observation normaliser's running mean, read then
        updated) or in the first forwards, before that is known: a replay then runs with
        what the forward read, not with what it left."""
        stat = self._stat_buffers
        if stat is None:
            # (The watched model's, whichever call came first: a submodule called on its
            # own before training, MoCo's encoder_q under no_grad, holds only its own.)
            root = self.root.module if self.root is not None else model
            stat = self._stat_buffers = [
                (owner, name)
                for owner in root.modules()
                if not isinstance(owner, (BATCH_STATS_NORMS, torch.jit.ScriptModule))
                for name, buf in owner._buffers.items()
                if buf is not None and buf.is_floating_point() and buf.numel() <= _STAT_BUFFER_NUMEL
            ]
        if not stat:
            return ()
        learning = self._buffer_forwards < 2
        self._buffer_forwards += learning
        found = []
        for owner, name in stat:
            buf = owner._buffers.get(name)
            if buf is None:
                continue
            try:
                version = buf._version
            except RuntimeError:  # an inference tensor: never updated in place in a forward
                continue
            copy = None
            if learning or (id(owner), name) in self.buffer_updaters:
                copy = buf.detach().clone()
            found.append((owner, name, buf, version, copy))
        return tuple(found)

    def _finish_record(self, record: ForwardRecord, outputs: list[int]) -> None:
        local = self._local
        local.record = None
        record.seen = None  # drop the weak references
        if record.targets is not None:
            local.captured = record
            return
        if record.replay is not None and record.replay.attributes:
            for owner, name, value in record.replay.attributes:
                key = (id(owner), name)
                if owner.__dict__.get(name) is not value and key not in self._carried_keys:
                    self._carried.append((owner, name))  # replaced by the forward
                    self._carried_keys.add(key)
        if record.replay is not None and record.replay.buffers:
            for owner, name, buf, version, _ in record.replay.buffers:
                if buf._version != version:  # updated in place by this forward
                    self.buffer_updaters.add((id(owner), name))
        if not record.unchecked_outputs:  # (not run inside a torch.func transform)
            self.forwards += 1
            is_model = bool(record.frames) and record.frames[0].hooked is self.root
            self.model_forwards += is_model
            if record.frames:
                sites = record.sites
                self.last_outputs = tuple(tuple(sites[i].shape) for i in outputs)
                self._last_record = weakref.ref(record)
            self.training_forwards += record.grad
            if record.grad and not record.in_eval:  # (as the numbering at its start)
                self.train_forwards += 1
                self.train_model_forwards += is_model
        with self._lock:
            if self._keep_inputs and record.grad and self._kept < MAX_KEPT_GRADS:
                record.keep.update(outputs)  # gradients arriving at the model, for a replay
                self._kept += 1
            self._pending.append(record)
            self._training += record.grad
            self._eval_waiting += record.eval_mode
            self.without_backward += record.grad
            limit = MAX_STEP_RECORDS if self.step_ends else MAX_PENDING_RECORDS
            if (
                record.grad
                and self.without_backward % MAX_WITHOUT_BACKWARD == 0
                and self._dropped_forwards(record)
            ):
                limit = 0
                self.without_backward = 0
            # (A validation loop run with gradients on: its forwards get no backward, and
            # waiting for the next optimizer step would keep thousands of records, whose
            # small allocations among the freed activations fragment the heap.)
            many = self._training >= limit or (
                record.eval_mode
                and self._eval_waiting >= MAX_KEPT_INPUTS
                and self._eval_outputs_dropped(record)
            )
            # Float16 training forwards piling up: GradScaler is skipping steps unseen.
            self._half_training += record.grad and _in_float16(record)
            long_step = self._half_training == LONG_STEP and not self.scaler_known
        if long_step and self.step_ends and not self._warned_long:
            self._warned_long = True
            warnings.warn(
                f"nanguard: {LONG_STEP} float16 training forwards since the last optimizer "
                "step. If that is not gradient accumulation, steps are ending unseen: "
                "GradScaler skips optimizer.step() when it finds Inf, so pass scaler= to "
                "nanguard.watch(); until a step ends, its forwards (and inputs) are kept.",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
        if not record.grad or record.raised is not None:
            # An inference forward has no backward and no optimizer step: it is a step of
            # its own (training forwards around it wait for the end of theirs). A forward
            # that raised has neither either.
            self._on_record(record)
        elif many:
            self._on_record(None)

    def _dropped_forwards(self, current: ForwardRecord) -> bool:
        """Whether the training forwards waiting without a backward had their graphs freed
        (a loop skipping non-finite losses), not kept for one (a rollout, whose backward
        comes at the end of its episode). Those after the first few are known (see
        _watch_grad); called with the lock."""
        known = [
            item
            for item in self._pending
            if isinstance(item, ForwardRecord) and item is not current and item.node_refs
        ]
        freed = sum(all(ref() is None for ref in item.node_refs) for item in known)
        # (the latest two losses' graphs are kept for their hint: see add_loss)
        return freed >= MAX_WITHOUT_BACKWARD // 2 and len(known) - freed <= 2

    def _eval_outputs_dropped(self, current: ForwardRecord) -> bool:
        """Whether the eval-mode forwards waiting for a backward dropped their outputs (a
        validation loop: nothing is left to backpropagate), not kept them for a loss (an
        eval-mode rollout, whose backward comes after its last call). Called with the lock."""
        waiting = [
            item
            for item in self._pending
            if isinstance(item, ForwardRecord) and item.eval_mode and not item.grads
        ]
        return not any(item.fed_grad for item in waiting) and all(
            ref() is None
            for item in waiting
            if item is not current  # (its caller holds what it just returned)
            for ref in item.output_refs
        )

    def add_loss(self, loss: Tensor) -> LossRecord | None:
        """Probe a loss (no sync); ``None`` when it cannot hold NaN/Inf."""
        if loss.dtype not in CHECKED_DTYPES or loss.is_meta:
            return None
        with torch.no_grad():
            values = probe(loss)
        record = LossRecord(next(self._counter), self.step, loss.detach(), values, self.updates)
        with self._lock:
            record.number = 1 + sum(isinstance(item, LossRecord) for item in self._pending)
            self._pending.append(record)
            last = next((i for i in reversed(self._pending) if isinstance(i, ForwardRecord)), None)
        if loss.grad_fn is not None and last is not None and last.grad and not last.eval_mode:
            # The autograd node that made it (which operations the loss ran, on a failure):
            # a training loss's, whose backward frees what its graph holds; the latest two.
            # (Not a validation loss computed with gradients on: that graph would stay.)
            kept = self._loss_nodes
            if len(kept) == kept.maxlen:
                kept[0].node = None
            record.node = loss.grad_fn
            kept.append(record)
        if self._on_site is not None:
            self._on_site(record, 0, loss)
        return record

    def pending(self) -> list[Item]:
        """A copy of the pending records (they stay pending)."""
        with self._lock:
            return list(self._pending)

    def has_pending(self) -> bool:
        return bool(self._pending)

    def take_pending(self) -> list[Item]:
        with self._lock:
            items, self._pending = self._pending, []
            self._training = self._kept = self._half_training = self._eval_waiting = 0
            self._kept_bytes = self._input_bytes = 0
            self._input_storages = set()
        return items

    def take(self, record: ForwardRecord) -> list[Item]:
        """Only ``record`` (an inference forward), if it is still pending."""
        with self._lock:
            if record not in self._pending:
                return []
            self._pending.remove(record)
        return [record]

    def reset_thread(self) -> None:
        """Forget a forward left unfinished by an exception in this thread."""
        self._local.stack = []
        self._local.record = None

    @property
    def backward_mode(self) -> str:
        return self._backward

    # ----------------------------------------------------------------- replay
    def capture(
        self,
        targets: frozenset[int],
        grad_targets: frozenset[int] = frozenset(),
        backward: bool = False,
        input_frames: frozenset[int] | None = None,
        exact: bool = False,
    ) -> Capture:
        """Context manager: the next top-level forward in this thread is a replay."""
        return Capture(
            self._local, targets, grad_targets, backward, input_frames or frozenset(), exact
        )

    def in_frame(self, frame: int, hooked: HookedModule | None = None) -> bool:
        """Whether this thread's forward is running in the code of call ``frame``.

        ``hooked``: the module of that call. A passthrough module (Dropout, an activation)
        is never on the stack: its frame is made when it returns, so while it runs, the
        next frame of the record is its own.
        """
        local = self._local
        stack = local.stack
        if stack and stack[-1] == frame:
            return True
        record = local.record
        if stack and record is not None and stack[-1] in record.transformed:
            # A call inside a torch.func transform (a template run by functional_call under
            # vmap): not probed, so not blamed: its code runs as its nearest probed caller's.
            top = len(stack) - 1
            while top >= 0 and stack[top] in record.transformed:
                top -= 1
            return top >= 0 and stack[top] == frame
        if hooked is None or not hooked.passthrough:
            return False
        record = local.record
        return record is not None and len(record.frames) == frame and _running(hooked.module)

    def forget_last_record(self) -> None:
        """The step ended: its last forward is no previous call of the next step's."""
        self._last_record = None

    def in_module(self, module: nn.Module) -> bool:
        """Whether this thread's forward is running in the code of ``module`` (any of its
        calls in the record being made: a replay of a forward whose calls are not known,
        a sentinel step's)."""
        local = self._local
        stack, record = local.stack, local.record
        return bool(stack) and record is not None and record.frames[stack[-1]].module is module

    def probing(self) -> bool:
        """Whether nanguard's own operations are running in this thread (a replay)."""
        return self._local.probing


class Capture:
    """Runs one forward as a replay: recorded apart, with statistics for ``targets``."""

    def __init__(
        self,
        local: _Local,
        targets: frozenset[int],
        grad_targets: frozenset[int],
        backward: bool,
        input_frames: frozenset[int],
        exact: bool,
    ) -> None:
        self._local = local
        self._targets = targets
        self._grad_targets = grad_targets
        self._backward = backward
        self._input_frames = input_frames
        self._exact = exact
        self._saved: tuple[list[int], ForwardRecord | None, int] = ([], None, -1)
        self._record: ForwardRecord | None = None
        self._active = False

    @property
    def record(self) -> ForwardRecord | None:
        """The replayed forward's record, once its top-level call returned."""
        return self._local.captured if self._active else self._record

    def __enter__(self) -> Capture:
        local = self._local
        self._saved = (local.stack, local.record, local.task)
        local.task = _graph_task_id()  # (sync="module": inside the step's backward)
        local.stack = []
        local.record = None
        local.capture = self._targets
        local.capture_grads = self._grad_targets
        local.capture_backward = self._backward
        local.capture_inputs = self._input_frames
        local.capture_exact = self._exact
        local.captured = None
        self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        local = self._local
        self._record = local.captured
        self._active = False
        local.capture = None
        local.capture_grads = frozenset()
        local.capture_backward = False
        local.capture_inputs = frozenset()
        local.capture_exact = False
        local.captured = None
        local.stack, local.record, local.task = self._saved


#: How many forwards raising an error about something else are resolved at once, per guard.
_RAISED_OTHERS: Final = 3
#: A forward raising these is left alone: control flow (a generator-style forward), or out
#: of memory (whose retry, a smaller batch, must not meet a replay).
_NOT_NUMERIC: Final = (StopIteration, StopAsyncIteration, MemoryError, torch.cuda.OutOfMemoryError)
#: torch.linalg's error (Cholesky: "not positive-definite", solve: "singular").
LINALG_ERRORS: Final[tuple[type[BaseException], ...]] = tuple(
    t for t in (getattr(torch.linalg, "LinAlgError", None),) if isinstance(t, type)
)
_NONFINITE_WORDS: Final = re.compile(r"\b(nan|inf|infinity|non-?finite)\b", re.IGNORECASE)


#: Constraints an argument check fails for NaN/Inf as for finite values it refuses.
_ANY_VALUE_CONSTRAINTS: Final = (
    "Real()",
    "PositiveDefinite",
    "PositiveSemidefinite",
    "LowerCholesky",
)


def _about_nonfinite(error: BaseException) -> bool:
    """Whether an exception is about a non-finite value (a distribution's argument check,
    multinomial's "probability tensor contains either inf, nan or element < 0"), not about
    something else (a shape, an index) that a NaN the model tolerates has nothing to do with.

    A distribution's argument check prints the values it refused: one about finite values
    (a scale of exactly 0 from a relu) is not, unless the check is ``Real()`` (which only
    NaN and Inf fail) or the printout was summarised (a NaN may hide behind ``...``).
    """
    if isinstance(error, LINALG_ERRORS):
        # "not positive-definite", "singular": said of a matrix holding NaN too (a kernel
        # matrix with a 0/0 on its diagonal), which the message does not tell.
        return True
    try:
        text = str(error)
    except Exception:  # (a __str__ that fails)
        return False
    if _NONFINITE_WORDS.search(text):
        return True
    if "satisfy the constraint" not in text:
        return False
    constraint, _, found = text.partition("but found invalid values")
    # (A matrix constraint is checked by a factorisation, which a NaN fails as a finite
    # singular matrix does: the printout need not show it.)
    return any(c in constraint for c in _ANY_VALUE_CONSTRAINTS) or "..." in found


def _in_float16(record: ForwardRecord) -> bool:
    """Whether the forward ran in float16 (autocast or a .half() model: where GradScaler
    is used)."""
    if record.half_outputs and any(record.sites[i].dtype is _F16 for i in record.half_outputs):
        return True
    modes = record.replay.modes if record.replay is not None else None
    autocast = modes.autocast if modes is not None else _autocast_modes()
    return any(dtype is _F16 for _, dtype in autocast)


def _raising_call(
    raised: BaseException, frames: list[Frame], unreturned: list[int], root: int
) -> int:
    """The call whose own code raised: the innermost that never returned and whose forward
    is on the exception's traceback (not one that raised earlier and was caught)."""
    codes = set()
    tb = raised.__traceback__
    while tb is not None:
        codes.add(tb.tb_frame.f_code)
        tb = tb.tb_next
    for index in unreturned:
        forward = getattr(type(frames[index].module).forward, "__code__", None)
        if forward in codes:
            return index
    return root


def walks_output(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the data objects in what the model returned are looked into: not when it
    returns the batch object it was given (filled in: its inputs are no value it made)."""
    return not any(output is a for a in args) and not any(output is v for v in kwargs.values())


def _any_wrapped(output: Any) -> bool:
    """Whether a forward's output holds tensors of a torch.func transform."""
    found: list[tuple[Path, Tensor]] = []
    collect(output, (), found)
    return any(_functorch_wrapped(t) for _, t in found)


def graph_reaches(
    start: Any, targets: Container[Any], limit: int = 4096, *, include_start: bool = False
) -> bool:
    """Whether one of the autograd nodes ``targets`` is in the graph below ``start`` (or is
    ``start``, with ``include_start``). Breadth first, so a deep branch beside it does not
    hide a near one; ``limit`` nodes at most (failure paths only)."""
    if start is None:
        return False
    if include_start and start in targets:
        return True
    seen = {start}
    todo = collections.deque(n for n, _ in start.next_functions if n is not None)
    while todo and len(seen) < limit:
        node = todo.popleft()
        if node in targets:
            return True
        if node in seen:
            continue
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return False


def graph_nodes(start: Any, limit: int) -> list[Any]:
    """The first ``limit`` autograd nodes of the graph below ``start`` (itself included),
    breadth first: the nearest. Failure paths only."""
    seen = {start}
    found = [start]
    todo = collections.deque(n for n, _ in start.next_functions if n is not None)
    while todo and len(found) < limit:
        node = todo.popleft()
        if node in seen:
            continue
        seen.add(node)
        found.append(node)
        todo.extend(n for n, _ in node.next_functions if n is not None)
    return found


def _note_uses(record: ForwardRecord, frame: int, output: Any, top: bool = False) -> None:
    """A backward replay: note the outputs of call ``frame`` that it used to compute
    another of its outputs (an entropy from the probabilities it returns as well)."""
    seen = record.seen
    uses = record.frame_uses
    if seen is None or uses is None:
        return
    found: list[tuple[Path, Tensor]] = []
    collect(output, (), found, objects=top, bound_containers=False)
    nodes: list[tuple[int, Any]] = []
    for _, t in found:
        entry = seen.get(id(t))
        if entry is not None and entry[0]() is t and t.grad_fn is not None:
            nodes.append((entry[1], t.grad_fn))
    for site, node in nodes:
        if any(
            other != site and other_node is not node and graph_reaches(other_node, {node})
            for other, other_node in nodes
        ):
            uses.add((frame, site))


_CONTAINERS: Final = (list, dict, tuple)


def _given_objects(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """``(where, key, weak reference)`` for each data object a call was given (before
    ``copy_containers`` copies it): the loop's own state when it gives the same one again."""
    given = []
    for where, values in (("args", enumerate(args)), ("kwargs", kwargs.items())):
        for key, value in values:
            if is_data_object(value):
                try:
                    given.append((where, key, weakref.ref(value)))
                except TypeError:  # (no weak references: not followed)
                    continue
    return tuple(given)


def _copied(value: Any) -> bool:
    """Whether ``copy_containers`` copies ``value``: a list, dict, tuple or data object."""
    kind = type(value)
    return kind not in _FLAT and (kind in _CONTAINERS or is_data_object(value))


class _Copying:
    """One copy of a forward's arguments: what is left to visit, and the objects copied
    already (an object referenced twice, or by itself, is copied once)."""

    __slots__ = ("left", "memo")

    def __init__(self) -> None:
        self.left = OBJECT_BUDGET
        self.memo: dict[int, Any] = {}


def copy_containers(value: Any, depth: int = 0, state: _Copying | None = None) -> Any:
    """``value`` with its lists, dicts and data objects (a batch object, a dataclass)
    copied (recursively), tensors and other objects shared: a forward that appends to a
    cache it is given, or sets an attribute of its batch object, changes the copy, not
    the user's. At most ``OBJECT_BUDGET`` values are visited (a batch holding its whole
    dataset is shared past that).
    """
    if state is None:
        state = _Copying()
    state.left -= 1
    if depth > 6 or state.left < 0:
        return value
    kind = type(value)
    if kind is list:
        if (
            not value
            or len(value) > state.left
            or not (
                isinstance(value[0], _CONTAINERS)
                or isinstance(value[-1], _CONTAINERS)
                or is_data_object(value[0])
                or is_data_object(value[-1])
            )
        ):  # (token ids, tensors: lists are near always of one kind, copied at C speed)
            return list(value)
        return [copy_containers(v, depth + 1, state) for v in value]
    if kind is dict:
        if len(value) > state.left:
            return dict(value)
        return {k: copy_containers(v, depth + 1, state) for k, v in value.items()}
    if isinstance(value, tuple):
        items = [copy_containers(v, depth + 1, state) for v in value]
        if all(a is b for a, b in zip(items, value, strict=True)):
            return value
        try:
            return kind(*items) if hasattr(value, "_fields") else kind(items)
        except Exception:  # (a tuple type built otherwise stays shared)
            return value
    if isinstance(value, (list, dict)):  # a subclass (OrderedDict, defaultdict...)
        try:
            out = copy.copy(value)
            if isinstance(value, list):
                out[:] = [copy_containers(v, depth + 1, state) for v in value]
            else:
                for k, v in value.items():
                    out[k] = copy_containers(v, depth + 1, state)
        except Exception:  # (a container that will not be copied stays shared)
            return value
        return out
    if is_data_object(value):
        known = state.memo.get(id(value))
        if known is not None:
            return known
        try:
            out = copy.copy(value)
        except Exception:  # (an object that will not be copied stays shared)
            return value
        state.memo[id(value)] = out
        found = attributes(out)
        if out is value or found is None:
            return out
        for k, v in list(found.items()):
            found[k] = copy_containers(v, depth + 1, state)
        return out
    return value


_FLAT: Final = frozenset({Tensor, nn.Parameter, int, float, bool, str, type(None)})
#: What every nn.Module keeps in its ``__dict__`` (hooks, parameters, buffers, mode): its
#: own attributes are the rest.
MODULE_KEYS: Final = frozenset(vars(nn.Module()))
#: Attributes a forward may replace and read again next time (bool is an int).
_CARRIED_TYPES: Final = (Tensor, int, float)


def _carried_value(value: object) -> bool:
    """A value a forward may carry to the next as a plain attribute: a tensor, a number, or
    a tuple of tensors (an LSTM's ``(h, c)``)."""
    if isinstance(value, _CARRIED_TYPES):
        return True
    return type(value) is tuple and bool(value) and all(isinstance(v, Tensor) for v in value)


#: Buffers larger than this are tables (positional encodings, masks), not running statistics.
_STAT_BUFFER_NUMEL: Final = 1 << 16
#: Normalisations that use the batch's statistics in training mode, not the running ones.
BATCH_STATS_NORMS: Final = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)


def versions(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, ...]:
    """In-place modification counters of the tensors passed to a forward (those inside
    lists, dicts and batch objects too)."""
    out = [_version(a) for a in args if isinstance(a, Tensor)]
    if kwargs:
        out.extend(_version(a) for a in kwargs.values() if isinstance(a, Tensor))
    if not _FLAT.issuperset(map(type, args)) or (
        kwargs and not _FLAT.issuperset(map(type, kwargs.values()))
    ):
        found: list[tuple[Path, Tensor]] = []
        for a in (*args, *kwargs.values()):
            if not isinstance(a, Tensor):
                collect(a, (), found, objects=True)
        out.extend(_version(t) for _, t in found)
    return tuple(out)


_cpu_generator = torch.default_generator


def rng_state() -> tuple[Tensor, list[Tensor] | None]:
    """CPU and (when in use) CUDA random generator states."""
    cuda = torch.cuda.get_rng_state_all() if _cuda_initialized() else None
    return _cpu_generator.get_state(), cuda


def _rows(t: Tensor) -> tuple[tuple[tuple[int, ...], int, int], tuple[tuple[int, ...], int, int]]:
    """The samples of a non-finite tensor that hold NaN/Inf, along dim 0 and along dim 1
    (which is the batch is for the caller to tell). Failure path: exact reads."""
    return bad_samples(t), bad_samples(t, dim=1) if t.dim() >= 3 else ((), 0, 0)
