"""The gradient norm ``clip_grad_norm_`` saw before it clipped.

The gradient-norm guard reads the gradients when the step ends, at
``optimizer.step()``: after ``clip_grad_norm_(model.parameters(), 1.0)`` they are
scaled down, and a norm that jumped a million times would read as 1.0. Torch offers
no hook there, so while a guard is attached, the function
``clip_grad_norm_`` calls to scale the gradients (``_clip_grads_with_norm_``, also
public as ``torch.nn.utils.clip_grads_with_norm_``) is wrapped: the wrapper keeps
the total norm it is given (a 0-d tensor on the device: no sync), then calls the
original. Calls through any name, imported before or after ``watch()``, pass
there. Restored when the last guard detaches. (A failing step also needs it: a NaN
total norm scaled every gradient by NaN, and .grad no longer tells which were.)
"""

from __future__ import annotations

import contextlib
import inspect
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["Clip", "listen", "listen_errors", "unlisten", "unlisten_errors"]


class Clip:
    """One call of ``clip_grad_norm_`` (or ``clip_grads_with_norm_``)."""

    __slots__ = ("max_norm", "norm", "parameters")

    def __init__(self, parameters: list[Tensor], max_norm: float, norm: Tensor) -> None:
        self.parameters = parameters  # the tensors whose gradients it scaled
        self.max_norm = max_norm
        self.norm = norm  # their total L2 norm before it scaled them (0-d, on the device)


Listener = Callable[[Clip], None]

_lock = threading.Lock()
_listeners: list[Callable[[], Listener | None]] = []  # (weak references to guards' methods)
_original: Callable[..., Any] | None = None
_wrapper: Callable[..., Any] | None = None
_public_patched = False


def _module() -> Any:
    from torch.nn.utils import clip_grad

    return clip_grad


def _clip_code() -> Any:
    """The code object of ``clip_grad_norm_``'s body (under its no_grad wrapper)."""
    try:
        return inspect.unwrap(_module().clip_grad_norm_).__code__
    except (AttributeError, ValueError):
        return None


def _make_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    clip_code = _clip_code()

    def _clip_grads_with_norm_(
        parameters: Any, max_norm: float, total_norm: Tensor, foreach: bool | None = None
    ) -> Any:
        # (A wrapper replaced by a later one, kept in another library's chain, stays quiet.)
        if _listeners and _wrapper is _clip_grads_with_norm_ and not torch.compiler.is_compiling():
            if not isinstance(parameters, (list, tuple, Tensor)):
                parameters = list(parameters)  # (a generator: read it once, pass the list on)
            with contextlib.suppress(Exception):  # nothing here may break the user's clipping
                _notify(parameters, max_norm, total_norm, sys._getframe(1), clip_code)
        return original(parameters, max_norm, total_norm, foreach)

    _clip_grads_with_norm_.__doc__ = original.__doc__
    _clip_grads_with_norm_.__wrapped__ = original  # type: ignore[attr-defined]
    return _clip_grads_with_norm_


def _notify(parameters: Any, max_norm: float, total_norm: Tensor, caller: Any, code: Any) -> None:
    # Only an L2 norm compares with the guard's (clip_grad_norm_'s norm_type; a direct
    # call of clip_grads_with_norm_ does not say, and is taken as L2, the default).
    if code is not None and caller.f_code is code:
        norm_type = caller.f_locals.get("norm_type", 2.0)
        if float(norm_type) != 2.0:
            return
    # A plain tensor: an FSDP2 DTensor norm would need a collective to read.
    if type(total_norm) is not Tensor or total_norm.numel() != 1:
        return
    params = [parameters] if isinstance(parameters, Tensor) else list(parameters)
    clip = Clip(params, float(max_norm), total_norm.detach().reshape(()))
    for ref in list(_listeners):
        listener = ref()
        if listener is not None:
            listener(clip)


class _Strong:
    """A reference to a plain function (kept): the listener itself."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def __call__(self) -> Any:
        return self.target

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Strong) and other.target == self.target

    def __hash__(self) -> int:
        return hash(self.target)


def _prune(refs: list[Callable[[], Any]]) -> None:
    """Drop the references whose guard is gone."""
    refs[:] = [r for r in refs if r() is not None]


def _ref(listener: Any) -> Callable[[], Any]:
    """A weak reference to a guard's bound method (a guard never detached is not kept alive
    by torch's wrapped functions), a strong one to a plain function."""
    if inspect.ismethod(listener):
        return weakref.WeakMethod(listener)
    return _Strong(listener)


def listen(listener: Listener) -> None:
    """Call ``listener`` with each clip from now on (wraps the function on first use)."""
    global _original, _wrapper, _public_patched
    ref = _ref(listener)
    with _lock:
        _prune(_listeners)
        if ref in _listeners:
            return
        module = _module()
        current = getattr(module, "_clip_grads_with_norm_", None)
        if current is None:  # (torch < 2.6: clip_grad_norm_ scales the gradients itself)
            return
        if _wrapper is None or current is not _wrapper:
            _original, _wrapper = current, _make_wrapper(current)
            setattr(module, "_clip_grads_with_norm_", _wrapper)  # noqa: B010
            utils = torch.nn.utils
            _public_patched = getattr(utils, "clip_grads_with_norm_", None) is current
            if _public_patched:
                setattr(utils, "clip_grads_with_norm_", _wrapper)  # noqa: B010
        _listeners.append(ref)


def unlisten(listener: Listener) -> None:
    """Stop calling ``listener``; the last one gone puts torch's function back."""
    global _original, _wrapper, _public_patched
    ref = _ref(listener)
    with _lock:
        if ref not in _listeners:
            return
        _listeners.remove(ref)
        _prune(_listeners)
        if _listeners or _wrapper is None:
            return
        module = _module()
        # (Put back only what is still ours: another library may have wrapped it since.)
        if getattr(module, "_clip_grads_with_norm_", None) is _wrapper:
            setattr(module, "_clip_grads_with_norm_", _original)  # noqa: B010
        utils = torch.nn.utils
        if _public_patched and getattr(utils, "clip_grads_with_norm_", None) is _wrapper:
            setattr(utils, "clip_grads_with_norm_", _original)  # noqa: B010
        _original = _wrapper = None
        _public_patched = False


# ``clip_grad_norm_(..., error_if_nonfinite=True)`` raises from ``_get_total_norm`` before
# any optimizer step ends nanguard's step: a loop that catches it and skips the batch zeroes
# the gradients nanguard never read. While a guard listens, that function is wrapped: the
# error is told to the guard (which resolves the step and notes the origin on it), then
# raised as it was.
ErrorListener = Callable[[BaseException, list[Tensor]], None]
_error_listeners: list[Callable[[], ErrorListener | None]] = []
_norm_original: Callable[..., Any] | None = None
_norm_wrapper: Callable[..., Any] | None = None


def _make_norm_wrapper(original: Callable[..., Any]) -> Callable[..., Any]:
    def _get_total_norm(
        tensors: Any,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
        foreach: bool | None = None,
    ) -> Any:
        try:
            return original(tensors, norm_type, error_if_nonfinite, foreach)
        except RuntimeError as error:
            if error_if_nonfinite and _norm_wrapper is _get_total_norm:
                grads = [tensors] if isinstance(tensors, Tensor) else list(tensors)
                for ref in list(_error_listeners):
                    listener = ref()
                    if listener is not None:
                        with contextlib.suppress(Exception):  # (the user's error comes first)
                            listener(error, grads)
            raise

    _get_total_norm.__doc__ = original.__doc__
    _get_total_norm.__wrapped__ = original  # type: ignore[attr-defined]
    return _get_total_norm


def listen_errors(listener: ErrorListener) -> None:
    """Call ``listener`` with each error ``clip_grad_norm_(error_if_nonfinite=True)`` raises."""
    global _norm_original, _norm_wrapper
    ref = _ref(listener)
    with _lock:
        _prune(_error_listeners)
        if ref in _error_listeners:
            return
        module = _module()
        current = getattr(module, "_get_total_norm", None)
        if current is None:  # (torch < 2.6)
            return
        if _norm_wrapper is None or current is not _norm_wrapper:
            _norm_original, _norm_wrapper = current, _make_norm_wrapper(current)
            setattr(module, "_get_total_norm", _norm_wrapper)  # noqa: B010
        _error_listeners.append(ref)


def unlisten_errors(listener: ErrorListener) -> None:
    """Stop calling ``listener``; the last one gone puts torch's function back."""
    global _norm_original, _norm_wrapper
    ref = _ref(listener)
    with _lock:
        if ref not in _error_listeners:
            return
        _error_listeners.remove(ref)
        _prune(_error_listeners)
        if _error_listeners or _norm_wrapper is None:
            return
        module = _module()
        if getattr(module, "_get_total_norm", None) is _norm_wrapper:
            setattr(module, "_get_total_norm", _norm_original)  # noqa: B010
        _norm_original = _norm_wrapper = None
