"""During a replay: the exact aten operation that first made NaN/Inf, and its source line.

A ``TorchDispatchMode`` sees every operation of the replayed forward and backward.
For each one whose output is non-finite it checks the inputs exactly: an
operation that makes NaN from inputs without NaN (or Inf from finite inputs) is
a *creator*. In the forward, the creator is the first one that ran in the code of
the module the analysis blamed; its source line is the innermost frame of the
user's code on the Python stack. In the backward, it is the first creator of all;
its source line is the forward line that created the autograd node (recorded by
anomaly mode, switched on for this one replay only), or for the user's own
``torch.autograd.Function`` the line of its backward that ran the op. An in-place op is
described by its inputs as they were before it overwrote them. A non-reentrant
``checkpoint`` re-runs its forward inside the backward: those ops are not the backward's.

Only for the failure path: it syncs the host on every operation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any, Final

import torch
import torch.utils.checkpoint
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from nanguard._checks import INF, NAN, POSINF, flags_of_tensor, tensor_stats
from nanguard._hints import OpInfo

__all__ = ["OpInfo", "OpWatch", "user_frame", "written_args"]

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))
_current_node: Callable[[], Any] = getattr(torch._C, "_current_autograd_node", lambda: None)


#: torch.utils.checkpoint(use_reentrant=False) re-runs the checkpointed forward when the
#: backward unpacks a saved activation: ``unpack_hook`` -> ``_run_fn_with_dynamo_disabled``
#: -> ``recompute_fn`` -> the user's forward, all while a backward node is current.
_CHECKPOINT_FILE: Final = torch.utils.checkpoint.__file__
_RECOMPUTE_FRAMES: Final = frozenset(
    {"unpack_hook", "_run_fn_with_dynamo_disabled", "recompute_fn"}
)


def _recomputing() -> bool:
    """Whether the running op belongs to a non-reentrant checkpoint's recomputed forward.

    The Python stack is the one signal that holds everywhere in the recomputation: grad
    mode is off in its ``torch.no_grad()`` blocks (masks), the top saved-tensor hooks are a
    nested checkpoint's or the user's, and on a GPU the backward runs on another thread
    (whose stack starts at the hook). The reentrant checkpoint recomputes in its own
    ``backward``, which is not matched: its nested backward's ops are the backward's.
    """
    frame: FrameType | None = sys._getframe(1)  # cheaper than a traceback
    while frame is not None:
        code = frame.f_code
        if code.co_name in _RECOMPUTE_FRAMES and code.co_filename == _CHECKPOINT_FILE:
            return True
        frame = frame.f_back
    return False


def _outside(filename: str) -> bool:
    """User code: not torch, not nanguard's private modules (its demo is user code)."""
    path = os.path.abspath(filename)
    if path.startswith((_TORCH_DIR, os.path.join(_PACKAGE_DIR, "_"))):
        return False
    # (Not <frozen runpy>, <string>...; but torch.fx's generated code is the model's own,
    # its lines kept in linecache: a traced model's inlined submodule code runs there.)
    return not filename.startswith("<") or filename.startswith("<eval_with_key>")


_REPLAY_FILE = os.path.join(_PACKAGE_DIR, "_replay.py")


def _inside_replay(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """The frames inside the replayed forward (those below nanguard's call of the model):
    the code around the replay (an ``opt.step()`` line) never made the value."""
    for i in range(len(frames) - 1, -1, -1):
        if os.path.abspath(frames[i].filename) == _REPLAY_FILE:
            return frames[i + 1 :]
    return frames


def user_frame(frames: list[traceback.FrameSummary]) -> str | None:
    """``file:line in function: code`` of the innermost frame outside torch and nanguard.

    A tensor subclass's ``__torch_function__``/``__torch_dispatch__`` (a batch tagged with
    metadata, MONAI's MetaTensor) runs every operation on it: the line that called the
    operation is the one further out, when there is one."""
    found = [f for f in reversed(frames) if _outside(f.filename)]
    if not found:
        return None
    frame = next((f for f in found if f.name not in _SUBCLASS_DISPATCH), found[0])
    code = (frame.line or "").strip()
    if frame.filename.startswith("<eval_with_key>"):
        # "<eval_with_key>.3 from model.py:20 in forward": torch.fx's code for a traced
        # model; its line frees what it no longer needs ("sqrt = torch.sqrt(mean);  mean =
        # None"): the operation is the first statement.
        code = code.partition(";")[0].strip()
        return f"{frame.filename}, line {frame.lineno} of the traced code: {code}"
    return f"{frame.filename}:{frame.lineno} in {frame.name}: {code}"


_SUBCLASS_DISPATCH: Final = frozenset({"__torch_function__", "__torch_dispatch__"})


def _node_source(node: Any) -> tuple[str | None, tuple[tuple[str, int], ...]]:
    """The forward line that created an autograd node (anomaly mode's traceback), and the
    ``(file, line)`` of every frame of the replayed forward it was created in."""
    try:
        trace = node.metadata.get("traceback_")
    except (AttributeError, RuntimeError):
        return None, ()
    if not trace:
        return None, ()
    lines = trace if isinstance(trace, list) else [str(trace)]
    text = "".join(lines)
    frames: list[traceback.FrameSummary] = []
    for block in text.split('  File "')[1:]:  # traceback.format_stack() entries
        head, _, code = block.partition("\n")
        try:
            filename, rest = head.split('", line ', 1)
            lineno, _, name = rest.partition(", in ")
            frames.append(
                traceback.FrameSummary(filename, int(lineno), name.strip(), line=code.strip())
            )
        except ValueError:
            continue
    inside = _inside_replay(frames)
    return user_frame(inside), tuple((f.filename, f.lineno or 0) for f in inside)


def _node_name(node: Any) -> str:
    try:
        return str(node.name())
    except (AttributeError, RuntimeError):
        return type(node).__name__


#: Operations that return uninitialised memory: whatever they "make" is not a value.
_UNINITIALISED: Final = frozenset({"empty", "empty_like", "empty_strided", "new_empty"})
#: How C++ composites wrap a scalar such as the NaN they select for invalid inputs.
_SCALAR_TENSOR: Final = torch.ops.aten.scalar_tensor


def written_args(func: Any, args: Any, kwargs: dict[str, Any]) -> Iterator[tuple[Any, Tensor]]:
    """``(argument schema, tensor)`` for each tensor a mutable op writes (``x.add_(1)``'s
    self, ``_foreach_mul_``'s list, an ``out=``)."""
    for i, arg in enumerate(func._schema.arguments):
        alias = arg.alias_info
        if alias is None or not alias.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, Tensor):
                yield arg, t


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> dict[int, Tensor]:
    """Copies of the floating tensors an in-place op reads and then overwrites, by id.

    ``h.sqrt_()`` must be described by the values it took the sqrt of, not by its
    result. ``out=`` arguments are not read, so they are not copied.
    """
    return {
        id(t): t.clone()
        for arg, t in written_args(func, args, kwargs)
        if not arg.is_out and (t.dtype.is_floating_point or t.dtype.is_complex)
    }


def _custom_backward(node: Any) -> bool:
    """Whether ``node`` runs the user's own Python backward (a custom autograd.Function
    defined outside torch): the op then comes from a line of that backward."""
    if not isinstance(node, torch.autograd.function.BackwardCFunction):
        return False
    backward = getattr(getattr(node, "_forward_cls", None), "backward", None)
    if callable(backward):  # @once_differentiable wraps the user's backward
        backward = inspect.unwrap(backward)
    code = getattr(backward, "__code__", None)
    if code is not None and not _outside(code.co_filename):
        # A torch.library custom op's generated Function: its backward calls the one the
        # user gave register_autograd, held in its closure.
        for cell in getattr(backward, "__closure__", None) or ():
            try:
                given = getattr(cell.cell_contents, "_backward_fn", None)
            except ValueError:  # an empty cell
                continue
            code = getattr(inspect.unwrap(given), "__code__", None) if callable(given) else None
            if code is not None:
                break
    return code is not None and _outside(code.co_filename)


def _new_inf_positions(outputs: list[Tensor], inputs: list[Tensor]) -> bool:
    """Whether an elementwise op's output is infinite where none of its (broadcast) inputs
    is: it made those. ``False`` for other ops (their inputs do not broadcast to it)."""
    if len(outputs) != 1 or not outputs[0].is_floating_point():
        return False
    out = outputs[0]
    read = torch.zeros(out.shape, dtype=torch.bool, device=out.device)
    for t in inputs:
        if t.is_floating_point():
            try:
                read |= torch.broadcast_to(torch.isinf(t), out.shape)
            except RuntimeError:
                return False
    return bool((torch.isinf(out) & ~read).any())


def _flags(values: list[Tensor]) -> int:
    flags = 0
    for t in values:
        if t.dtype.is_floating_point or t.dtype.is_complex:
            flags |= flags_of_tensor(t)
    return flags


def _fill_value(tensors: list[Tensor]) -> float | None:
    """The Inf of a one-element input when it is the only non-finite input (a fill value
    passed as a tensor), else ``None``."""
    fill: float | None = None
    for t in tensors:
        if not (t.dtype.is_floating_point and flags_of_tensor(t)):
            continue
        if t.numel() != 1 or fill is not None:
            return None
        value = float(t.reshape(()).item())
        if value == value:  # not NaN
            fill = value
        else:
            return None
    return fill


class OpWatch(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Finds the creator operations of a replay (see the module docstring).

    Args:
        in_frame: called with no argument, says whether the forward is running in the
            code of the blamed module (the top of nanguard's call stack).
        kind: ``"nan"``, ``"inf"`` or ``"posinf"``: what the forward creator must create.
        busy: says whether nanguard itself is computing (its probes are not the user's).
    """

    def __init__(
        self, in_frame: Callable[[], bool], kind: str | None, busy: Callable[[], bool]
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._in_frame = in_frame
        self._kind = kind
        self._busy = busy
        self.forward: OpInfo | None = None
        self.backward: OpInfo | None = None
        self.entered: OpInfo | None = None  # see __torch_dispatch__
        self.forward_running = False  # the replayed forward runs (not its backward)
        # Tensors carrying an Inf made by accident in this replay: id -> (tensor, its maker).
        self._inf_from: dict[int, tuple[Tensor, OpInfo]] = {}
        # NaN constants written by composite ops (see __torch_dispatch__): id -> tensor.
        self._nan_const: dict[int, Tensor] = {}
        # Forward creators to pass over (an earlier replay's, whose value never reached the
        # output: a diagnostic), and the value the creator made (its autograd node, set once
        # the op returns, tells whether it reached the output; held for the replay only).
        self.skip_forward = 0
        self.forward_value: Tensor | None = None
        # The replayed model's parameters, id -> name: an op reading one says which.
        self.params: dict[int, str] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        current = _current_node()
        # autograd.grad called inside the replayed forward (forces = -dE/dpos): its ops are
        # the forward's, made in the calling module's code.
        nested = current is not None and self.forward_running
        node = None if nested else current
        if node is None and self._kind == "grad" and self.backward is None and not self._busy():
            # A replay localising the backward: the forward ops that make an Inf by accident
            # (exp of a parameter that drifted past 88.7) are remembered, for the backward op
            # that turns a saved Inf into NaN (0 * inf) to name where it came from.
            return self._track_inf(func, args, kwargs, current, nested)
        if (
            self._busy()
            or (self.forward if node is None else self.backward) is not None
            or (node is None and (self._kind is None or not self._in_frame()))
            or func.overloadpacket.__name__ in _UNINITIALISED
            # A checkpoint's forward, re-run for the backward: it made its values (masks of
            # -inf) in the forward already, where they were checked; they are not gradients.
            or (node is not None and _recomputing())
        ):
            return func(*args, **kwargs)
        inputs, _ = tree_flatten((args, kwargs))
        tensors = [t for t in inputs if isinstance(t, Tensor)]
        before: int | None = None
        saved: dict[int, Tensor] = {}
        if func._schema.is_mutable:  # x.log_(): its input is its output, look at it first
            with torch._C._DisableTorchDispatch():
                before = _flags(tensors)
                saved = _written(func, args, kwargs)
        out = func(*args, **kwargs)
        with torch._C._DisableTorchDispatch():  # our own checks are not the user's ops
            outputs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
            made = _flags(outputs)
            if not made:
                return out
            if not tensors and made & NAN and func.overloadpacket is _SCALAR_TENSOR:
                # A NaN constant that a composite op writes (logdet: where(sign == -1, nan,
                # logabsdet)): it makes a NaN value only where it is selected.
                for t in outputs:
                    self._nan_const[id(t)] = t
                return out
            # What the op read: an in-place op's inputs as they were before it wrote them.
            seen = [saved.get(id(t), t) for t in tensors] if saved else tensors
            constant = self._constant(seen) if self._nan_const else None
            if constant is not None:
                had = _flags([t for t in seen if t is not constant])
            else:
                had = before if before is not None else _flags(seen)
            new_nan = bool(made & NAN) and not had & NAN
            new_inf = bool(made & INF) and not had
            # torch.where(mask, x, float("-inf")): the Inf comes in as a one-element tensor
            # and is spread over the output: this is where it was written (a fill).
            fill = _fill_value(seen) if made & INF and not made & NAN and had else None
            new_inf = new_inf or fill is not None
            if constant is not None and new_nan:
                fill = math.nan
            want = self._kind if node is None else None
            if want == "posinf":  # (the +Inf only: a -inf mask written first is not it)
                # (...or where a +inf is written: d[mask] = float("inf"), torch.where(m,
                # torch.tensor(float("inf")), d), a one-element Inf spread over the output)
                new_inf = bool(made & POSINF) and (
                    not had & POSINF or (fill is not None and fill > 0)
                )
            if not (
                new_nan
                if want == "nan"
                else new_inf
                if want in ("inf", "posinf")
                else new_nan or new_inf
            ):
                if (
                    node is not None
                    and self.entered is None
                    and not getattr(func, "is_view", 0)
                    and not _mask_check(func)
                ):
                    # The first backward op with a non-finite output, from a non-finite
                    # input: a saved forward value (sqrt of a negative number hidden by
                    # torch.where) entering the gradients (not abs(x) != inf of nan_to_num's
                    # derivative: a mask of where x is finite, whose own result is finite).
                    self.entered = self._info(func, seen, outputs, inputs, current, None, nested)
                elif node is None and made & INF:
                    maker = self._inf_maker(tensors)
                    if (
                        maker is None
                        # (or more of them than it read: (logits + g) / tau overflowing where
                        # -inf masks some logits already, gumbel_softmax at a tiny tau)
                        and (new_inf or (fill is None and _new_inf_positions(outputs, seen)))
                        and fill is None
                        and not any(isinstance(a, float) and math.isinf(a) for a in inputs)
                    ):
                        # An Inf made by accident (log of 0) that a later op may turn into
                        # NaN: remember it, and the tensors that carry it on.
                        maker = self._info(func, seen, outputs, inputs, current, None, nested)
                    if maker is not None:
                        self._carry_inf(outputs, maker)
                return out
            maker = self._inf_maker(tensors) if node is None and had & INF else None
            # sin(log(0)), p * log(p): the log made the Inf that became NaN. (Not the log of
            # a 0/1 mask: its -inf masks on purpose, and a softmax over a row it masks whole
            # makes the NaN: allennlp's masked_log_softmax.)
            if want == "nan" and maker is not None and not maker.mask_input:
                info = maker
            else:
                info = self._info(func, seen, outputs, inputs, current, fill, nested)
        if node is None:
            if self.skip_forward:
                self.skip_forward -= 1
                return out
            self.forward = info
            self.forward_value = outputs[0] if outputs else None
        else:
            maker = self._inf_maker(seen) if had & INF else None
            if maker is not None:  # (the forward op that made the Inf it read)
                info = dataclasses.replace(info, inf_from=maker)
            self.backward = info
            self._confirm_when_done(node, info)
        return out

    def _track_inf(
        self, func: Any, args: Any, kwargs: dict[str, Any], node: Any, nested: bool
    ) -> Any:
        """Run a forward op; remember it if it made an Inf from finite inputs by accident
        (not a mask written on purpose), and the tensors that carry that Inf on."""
        out = func(*args, **kwargs)
        if func._schema.is_mutable or getattr(func, "is_view", False):
            return out  # (x.exp_() reads what it wrote: not told; a view makes nothing)
        try:
            with torch._C._DisableTorchDispatch():
                outputs = [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]
                if not outputs or not _flags(outputs) & INF:
                    return out
                inputs, _ = tree_flatten((args, kwargs))
                tensors = [t for t in inputs if isinstance(t, Tensor)]
                maker = self._inf_maker(tensors)
                if maker is None:
                    if _flags(tensors) & INF or any(
                        isinstance(a, float) and math.isinf(a) for a in inputs
                    ):
                        return out  # read an Inf that no op here made: a mask, an input
                    maker = self._info(func, tensors, outputs, inputs, node, None, nested)
                self._carry_inf(outputs, maker)
        except (RuntimeError, NotImplementedError):  # a sparse or exotic output: not told
            pass
        return out

    def _carry_inf(self, outputs: list[Tensor], maker: OpInfo) -> None:
        """Remember that ``outputs`` carry the accidental Inf ``maker`` made."""
        for t in outputs:
            self._inf_from[id(t)] = (t, maker)
            # Written into a view (out[..., :m] = x): later ops read the buffer it views.
            base = t._base
            if base is not None:
                self._inf_from[id(base)] = (base, maker)

    def _confirm_when_done(self, node: Any, info: OpInfo) -> None:
        """Keep a backward creator only if its node hands on non-finite gradients.

        A node can make Inf and mask it itself: StdBackward0 divides by ``2 * std`` and
        zeroes where ``std == 0`` (a constant channel before stats pooling). That Inf never
        leaves the node; the creator is a later one, so the watch goes on.
        """

        def done(grad_inputs: Any, grad_outputs: Any) -> None:
            if self.backward is not info:
                return
            with torch._C._DisableTorchDispatch():
                made = [g for g in tree_flatten(grad_inputs)[0] if isinstance(g, Tensor)]
                if made and not _flags(made):
                    self.backward = None

        # (A node that takes no hooks: the creator stands.)
        with contextlib.suppress(AttributeError, RuntimeError, TypeError):
            node.register_hook(done)

    def _inf_maker(self, tensors: list[Tensor]) -> OpInfo | None:
        """The op that made the accidental Inf one of ``tensors`` carries, if any."""
        for t in tensors:
            entry = self._inf_from.get(id(t))
            if entry is not None and entry[0] is t:
                return entry[1]
        return None

    def _constant(self, tensors: list[Tensor]) -> Tensor | None:
        """The NaN constant among ``tensors`` (see ``_nan_const``), if any."""
        return next((t for t in tensors if self._nan_const.get(id(t)) is t), None)

    def _info(
        self,
        func: Any,
        tensors: list[Tensor],
        outputs: list[Tensor],
        inputs: list[Any],
        node: Any,
        fill: float | None,
        nested: bool = False,
    ) -> OpInfo:
        bad = next((t for t in outputs if flags_of_tensor(t)), None)
        source = None
        custom = node is not None and _custom_backward(node)
        if node is None or custom or nested:
            # The forward, or a custom Function's backward: the op ran from a user line
            # that is on the stack now (for other backward nodes, only torch code is).
            source = user_frame(_inside_replay(traceback.extract_stack()))
            custom = custom and source is not None
        where: tuple[tuple[str, int], ...] = ()
        hook = False
        if node is not None and not custom and not nested:
            # Python code of the user's that autograd ran (a gradient hook: a tensor's, a
            # module's full backward hook): the op came from its line, on the stack now.
            stack = _inside_replay(traceback.extract_stack())
            source = user_frame(stack)
            hook = custom = source is not None
            if hook:
                # (Where the hook's code is: in the forward that registered it, a lambda
                # there, its call is that forward's own code, not the module whose
                # gradient it rewrote.)
                where = tuple(
                    (f.filename, f.lineno)
                    for f in stack
                    if _outside(f.filename) and f.lineno is not None
                )
            else:
                source, where = _node_source(node)
        return OpInfo(
            name=str(func),
            inputs=tuple(
                tensor_stats(t)
                if t.dtype.is_floating_point
                or t.dtype.is_complex
                # (integers a cast made float16 Inf of: positions past 65504)
                or (t.dtype != torch.bool and "_to_copy" in str(func))
                else None
                for t in tensors
            ),
            output=tensor_stats(bad) if bad is not None else None,
            direction="forward" if node is None else "backward",
            node=None if node is None else _node_name(node),
            args=tuple(a for a in inputs if isinstance(a, (int, float, bool, str)))
            + ((fill,) if fill is not None else ()),
            source=source,
            custom_backward=custom,
            hook=hook,
            mask_input=node is None and _log_of_mask(func, tensors),
            where=where,
            params=tuple(self.params.get(id(t)) for t in tensors) if self.params else (),
            # (the op's own arguments: ``tensors`` may be copies an in-place op read)
            untrained=node is None
            and torch.is_grad_enabled()
            and any(isinstance(t, Tensor) for t in inputs)
            and not any(isinstance(t, Tensor) and t.requires_grad for t in inputs),
        )


def _log_of_mask(func: Any, tensors: list[Tensor]) -> bool:
    """``torch.log(mask)`` of a mask of 0s and 1s (float, int8 or bool): -inf where it is 0,
    on purpose (``logits + torch.log(action_mask)``). Not probabilities that saturated to 0
    and 1 (a softmax: they require grad), nor a tensor of zeros that underflowed."""
    if str(func) != "aten.log.default" or not tensors or tensors[0].requires_grad:
        return False
    x = tensors[0]
    if x.is_complex():
        return False
    ones = x == 1
    return bool(ones.any() and (ones | (x == 0)).all())


def _mask_check(func: Any) -> bool:
    """An op a derivative uses to test values (``isfinite`` as ``abs(x) != inf``), not to
    compute a gradient from them."""
    name = str(func).split(".")
    return len(name) > 1 and name[1] in ("abs", "isfinite", "isnan", "isinf", "ne", "eq")
