"""Resolving a step: the one host read, then (only on failure) analysis, statistics, events.

Everything a step recorded becomes one list of 0-d device tensors: forward and
backward probes, the per-parameter gradient norms, the parameter norms, the AMP
scale. One ``stack(...).tolist()`` reads them all. When every value is finite,
the gradient norm is unremarkable and no half-precision activation is close to
its limit, that is all a step costs. Otherwise the probes are turned into
findings (``_analysis``), re-checked exactly, described with exact statistics
(from live tensors or a replay) and turned into events.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import math
import operator
import os
import re
import sys
import time
import warnings
import weakref
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any, Final, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn.parameter import is_lazy

from nanguard._analysis import _SOFTMAXES, Finding, analyze, analyze_backward
from nanguard._checks import (
    CHECKED_DTYPES,
    INF,
    NAN,
    NEGINF,
    POSINF,
    bad_samples,
    flags_of,
    flags_of_stats,
    flags_of_tensor,
    local_shard,
    tensor_stats,
)
from nanguard._clip import Clip
from nanguard._events import Event, TensorStats
from nanguard._hints import (
    DTYPE_MAX,
    HUGE_OUTPUTS,
    HintContext,
    OpInfo,
    adaptive_optimizer,
    hint,
    is_attention,
    is_specific,
    learning_rate_note,
    loss_slopes,
    scalar_arg,
)
from nanguard._masks import is_mask_name
from nanguard._monitor import GradNormAlarm, GradNormMonitor
from nanguard._options import Options
from nanguard._params import (
    Groups,
    Owned,
    ParamTable,
    exact_norm,
    exact_norms,
    finite_probes,
    held,
    is_compile_wrapper,
    is_compiled,
    module_names,
    norms,
    plain_name,
    spellings,
)
from nanguard._params import _version as _grad_version
from nanguard._probes import (
    ForwardRecord,
    Frame,
    Item,
    LossRecord,
    Replay,
    Site,
    input_label,
    site_label,
)
from nanguard._recording import BATCH_STATS_NORMS as _BATCH_STATS_NORMS
from nanguard._recording import Recorder, user_stacklevel, versions
from nanguard._replay import (
    ReplayResult,
    collective_problem,
    data_parallel,
    is_data_parallel,
    replay,
    replay_target,
    world_size,
)
from nanguard._report import (
    Origin,
    amp_collapse_message,
    amp_dead_message,
    amp_skip_message,
    backward_message,
    external_grads_message,
    grad_message,
    grad_norm_message,
    kind_word,
    origin_message,
    origin_place,
    overflow_message,
    param_message,
    propagated_message,
    stepper_message,
    stored_message,
)
from nanguard._tree import Path, collect, format_path

__all__ = ["AmpObservation", "Outcome", "Resolver", "host_values", "user_location"]

_HALF = (torch.float16, torch.bfloat16)
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__))


class AmpObservation(NamedTuple):
    """What a ``GradScaler.update()`` saw: the scale before and after, the inf flags."""

    scale_before: Tensor
    scale_after: Tensor
    found_inf: list[Tensor]  # the guard's optimizer's flags first
    own: int  # how many of them are the guard's optimizer's (the others: other optimizers')


#: Steps (whose norm was above the recent median) over which the usual batch is the largest.
_RECENT_BATCHES: Final = 200
#: How a forward origin's value was made inside the model (not in the batch, not a loss).
_MADE: Final = frozenset({"output", "own_code"})
#: Gradient-norm spikes at most this many steps apart are one episode: a hint names its first.
_SPIKE_EPISODE: Final = 10


class Outcome(NamedTuple):
    """The result of resolving a step."""

    events: list[Event]
    bad_gradients: bool  # the optimizer would apply non-finite gradients


#: CPU values are read one by one: there is no device to synchronise with, and a
#: scalar read costs less than stacking the values first. (Tests switch it off to
#: check the accelerator path, where the values are read at once.)
CPU_VALUES_ONE_BY_ONE = True
_IS_CPU: Final = operator.attrgetter("is_cpu")


def _largest(tensors: list[Tensor]) -> list[Tensor]:
    """Each tensor's largest magnitude (NaN if it holds one): one multi-tensor call, or one
    by one where torch refuses (devices mixed, a tensor subclass); those that cannot be read
    are left out (a detector never breaks the step)."""
    try:
        return list(torch._foreach_norm(tensors, math.inf))
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        pass
    out = []
    for t in tensors:
        try:
            out.append(torch.linalg.vector_norm(local_shard(t), math.inf))
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            continue
    return out


def _half_weights(module: nn.Module | None, model: nn.Module) -> bool:
    """The origin module's weights (the model's, for one without any) are float16."""
    for owner in (module, model):
        if owner is not None:
            first = next(owner.parameters(), None)
            if first is not None:
                return first.dtype is torch.float16
    return False


def host_values(values: list[Tensor]) -> list[float]:
    """All values as Python floats: the one host read of a step (one per device)."""
    if CPU_VALUES_ONE_BY_ONE and all(map(_IS_CPU, values)):
        return list(map(Tensor.item, values))
    try:
        host: list[float] = torch.stack(values).tolist()
        return host
    except (RuntimeError, NotImplementedError):  # values on several devices (or dtypes
        pass  # stack cannot mix), or on "meta" (no data)
    out = [0.0] * len(values)
    groups: dict[torch.device, list[int]] = {}
    for i, v in enumerate(values):
        groups.setdefault(v.device, []).append(i)
    for device, indices in groups.items():
        if device.type == "meta":
            continue  # (a model on the meta device, shapes only: nothing to check)
        group = torch.stack([values[i].float() for i in indices]).tolist()
        for i, x in zip(indices, group, strict=True):
            out[i] = x
    return out


def all_finite(host: Sequence[float]) -> bool:
    total = sum(host)  # a finite sum proves every value finite
    return math.isfinite(total) or all(math.isfinite(v) for v in host)


def user_location() -> str | None:
    """``file:line`` of the innermost caller outside nanguard and torch."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith((_PACKAGE_DIR, _TORCH_DIR)):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return None


def _in_list(kept: Replay, path: Path) -> bool:
    """Whether the input at ``path`` (of a kept call) is an element of a list."""
    obj: Any = kept.args if path[0] == "args" else kept.kwargs
    for key in path[1:]:
        if isinstance(obj, list):
            return True
        try:
            obj = _lookup(obj, (key,))
        except (KeyError, IndexError, AttributeError, TypeError):
            return False
    return False


def _lookup(obj: Any, keys: Sequence[Any]) -> Any:
    for key in keys:
        if isinstance(obj, Mapping) or (isinstance(key, int) and isinstance(obj, (list, tuple))):
            obj = obj[key]
        else:
            obj = getattr(obj, key)
    return obj


#: Phases whose origin made the values non-finite before any loss scaling.
_BEFORE_SCALING: Final = frozenset({"input", "forward", "loss"})


def _compiled_inside(model: nn.Module) -> bool:
    """Whether a module inside ``model`` runs compiled (in place, or a compile wrapper)."""
    return any(
        m is not model and not isinstance(m, torch.jit.ScriptModule) and is_compiled(m)
        for m in model.modules()
    )


def _written_in(module: nn.Module, filename: str, line: int) -> bool:
    """Whether ``filename:line`` lies in the module's ``forward`` (or a base class's, or the
    function a decorator wrapped)."""
    path = os.path.abspath(filename)
    for cls in type(module).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is None:
            continue
        code = getattr(inspect.unwrap(forward), "__code__", None)
        if code is None or os.path.abspath(code.co_filename) != path:
            continue
        lines = [n for _, _, n in code.co_lines() if n is not None]
        if lines and code.co_firstlineno <= line <= max(lines):
            return True
    return False


def _source_owner(record: ForwardRecord, frame: int, op: OpInfo) -> int | None:
    """The ancestor of call ``frame`` whose ``forward`` created an operation's node (its
    innermost frame in a forward of the call or of an ancestor: a helper or method the
    forward calls counts as that forward's), when it is not the call's own (else None)."""
    frames = record.frames
    chain = []
    index = frame
    while index >= 0:
        chain.append(index)
        index = frames[index].parent
    for filename, line in reversed(op.where):
        for index in chain:
            if _written_in(frames[index].module, filename, line):
                return None if index == frame else index
    return None


def _source_child(record: ForwardRecord, frame: int, op: OpInfo) -> int | None:
    """A call inside call ``frame`` whose forward created an operation's node (the
    innermost such), when ``frame``'s own forward did not: a child that transforms its
    parent's weight (weight_norm's ``_WeightNorm`` inside a ``ParametrizationList``)."""
    frames = record.frames

    def within(index: int) -> bool:
        while index >= 0:
            index = frames[index].parent
            if index == frame:
                return True
        return False

    inside = [i for i in range(len(frames)) if within(i)]
    for filename, line in reversed(op.where):
        if _written_in(frames[frame].module, filename, line):
            return None
        found = next((i for i in inside if _written_in(frames[i].module, filename, line)), None)
        if found is not None:
            return found
    return None


def _step_loss(items: Sequence[Item], host: Sequence[float], layout: _Layout) -> float | None:
    """The step's scalar losses passed to ``check_loss``, summed (their probe is their
    value), or None when none was, or one is not a finite float scalar."""
    total = None
    for item, (start, length) in zip(items, layout.items, strict=True):
        if isinstance(item, LossRecord):
            value = host[start] if length == 1 else math.nan
            if item.tensor.numel() != 1 or not item.tensor.dtype.is_floating_point:
                value = math.nan
            if not math.isfinite(value):
                return None
            total = value + (total or 0.0)
    return total


def _nonfinite_attribute(record: ForwardRecord) -> str | None:
    """``self.<name>`` of a tensor attribute (or a tuple of them: an LSTM's ``(h, c)``) a
    forward found holding NaN when it began (the state an earlier step left), if any. Exact
    reads, on the failure path only."""
    replay = record.replay
    if replay is None:
        return None
    for owner, name, value in replay.attributes:
        tensors = value if isinstance(value, tuple) else (value,)
        for t in tensors:
            if (
                isinstance(t, Tensor)
                and (t.is_floating_point() or t.is_complex())
                and flags_of_tensor(t) & NAN  # (a cached -inf mask is no carried NaN)
            ):
                prefix = "" if owner is record.frames[0].module else f"{type(owner).__name__}."
                return f"self.{prefix}{name}"
    return None


def _saved_hooks(items: Sequence[Item]) -> str | None:
    """The name of the user's pack hook (``saved_tensors_hooks``) the step's forwards ran
    under, if any."""
    for item in items:
        replay = getattr(item, "replay", None)
        hooks = getattr(replay.modes, "saved_hooks", None) if replay is not None else None
        if hooks is not None:
            return getattr(hooks[0], "__qualname__", None) or repr(hooks[0])
    return None


def _frame_label(frame: Frame) -> str:
    return f"{frame.name}#{frame.call}" if frame.call else frame.name


def _wrapper_frame(item: Item, frame: int | None) -> bool:
    """A call of a ``torch.compile`` wrapper, run eagerly in a replay: the module inside
    it records the same call."""
    return (
        isinstance(item, ForwardRecord)
        and frame is not None
        and 0 < frame < len(item.frames)
        and is_compile_wrapper(item.frames[frame].module)
    )


#: clip_grad_norm_ calls kept for one step at most (one per parameter group is usual).
_MAX_CLIPS: Final = 64


class Clipped(NamedTuple):
    """A step whose gradients ``clip_grad_norm_`` scaled down."""

    norm: float  # the total norm before clipping (the guard's)
    after: float  # ...and after (what optimizer.step() was given)
    max_norm: float
    clips: list[tuple[Clip, float]]  # each clip, with the norm it was given


class _Layout(NamedTuple):
    """Where each group of values sits in the step's host read."""

    items: list[tuple[int, int]]  # (start, length) of each item's values
    grads: tuple[int, int]
    params: tuple[int, int]
    amp: tuple[int, int]
    clips: tuple[int, int]  # the norms clip_grad_norm_ saw this step (see _clip)
    grad_groups: Groups  # which gradients (positions in the step's list) each value covers
    param_groups: Groups  # which parameters/buffers each group of values covers


class Resolver:
    """Turns recorded steps into events; keeps the state that spans steps."""

    def __init__(
        self,
        model: nn.Module,
        options: Options,
        recorder: Recorder,
        rank: Callable[[], int],
    ) -> None:
        self._model = model
        self._options = options
        self._recorder = recorder
        self._rank = rank
        self.params = ParamTable(model, options.names)
        #: Set by the guard: hook modules added to the model since its hooks were placed;
        #: returns whether there were any (a failing step is then replayed with them).
        self.rehook: Callable[[], bool] = lambda: False
        # The guard moved the hooks during this step, before it was resolved (a head put in
        # with optimizer.add_param_group()): the step's records miss the new modules.
        self.hooks_moved = False
        # The step whose forward a check() mid-step found non-finite (see analyze(bad_before)).
        self.forward_bad_at = -1
        # Gradients .grad held at attach, by parameter id (see note_present_grads).
        self.present_grads: dict[int, tuple[Callable[[], Tensor | None], int]] = {}
        self._stale_grads: dict[int, tuple[Callable[[], Tensor | None], int]] = {}
        # The gradients the latest step's end found non-finite, and that step.
        self._bad_grad_refs: dict[int, Callable[[], Tensor | None]] = {}
        self._bad_grad_refs_step = -1
        self._since_table_check = 0
        self._next_table: ParamTable | None = None  # replaces self.params after a resolution
        # nn.TransformerEncoderLayers, whose fused inference kernel hooks turn off (told once).
        self._encoder_layers = [
            m for m in model.modules() if isinstance(m, nn.TransformerEncoderLayer)
        ]
        self._fast_path_told = False
        # Buffers non-finite since attach that a failing step's forward did not need (ids).
        self._unneeded_buffers: set[int] = set()
        self._last_loss: float | None = None  # the losses checked in the last step, summed
        # The most parameters with a gradient in a step so far: more of them (a frozen
        # backbone unfrozen) make a larger norm that is no explosion; the history restarts.
        self.most_grads = 0
        self.monitor = GradNormMonitor(
            spike=options.grad_norm,
            ratio=options.grad_norm_ratio,
            threshold=options.grad_norm_threshold,
        )
        self._warned_overflow: set[str] = set()
        self._bad_params: set[str] = set()  # already reported as non-finite
        # Weights an optimizer step was to move with a non-finite learning rate (reported):
        # id -> (its step, what the rate was); each told once, forgotten after a sweep.
        self._bad_rates: dict[int, tuple[int, str]] = {}
        self._rate_step = -1  # ...and the step of the latest
        # Other optimizers than optimizer= that moved watched weights in this step (weakly;
        # the guard clears it as the step ends): SAC's critic optimizer, stepped mid-step.
        # ...with the learning rates of theirs that were not finite then, by group.
        #: Weights another optimizer moved with this step's bad gradient before optimizer=
        #: stepped (a skipped step leaves them as that optimizer left them).
        self.stepped_first: set[str] = set()
        self.foreign_steppers: list[
            tuple[weakref.ref[torch.optim.Optimizer], dict[int, float]]
        ] = []
        self._dead_told = False  # ...and that training cannot recover from them
        self._last_bad_grads: set[str] = set()  # parameters with bad gradients last step
        # ...and, per parameter, the first step since the last sweep whose gradient was
        # non-finite: a weight a later sweep finds non-finite was updated with it then.
        self._bad_grads_since: dict[str, int] = {}
        self._param_alarms: set[str] = set()
        self._localisation_problem: str | None = None
        # The failing step's non-finite values all stayed inside the model (see _absorbed).
        self._stayed_inside = False
        self._sweep_every = options.sweep_every
        self._watch_grads = (  # the step's gradients are read (their norms)
            options.backward is not False
            or options.grad_norm
            or options.grad_norm_threshold is not None
            or options.param_norm_threshold is not None
        )
        self._loss_checked = True  # the failing step's loss went through check_loss()
        self._last_spike: int | None = None  # step of the latest gradient-norm alarm
        self._first_spike: int | None = None  # ...and of the first of its episode
        self._batch = 0  # the samples of the step's training forwards (0: unknown)
        self._batch_max = 0  # ...the most of recent steps
        self._batches: collections.deque[int] = collections.deque(maxlen=_RECENT_BATCHES)
        self._since_sweep = 0
        self._sweep_soon = False  # sweep at the next step's end, whatever the schedule
        self._swept_at = -1  # step of the latest parameter sweep (-1: at attach)
        self._prior_sweep = -1  # ...and of the one before it
        self._mask_buffers: set[str] = set()  # buffers holding +/-Inf when attached
        # Weights of allow_inf modules seen holding +/-Inf: swept for NaN only.
        self._inf_weights: set[str] = set()
        # The parameters whose gradients the last step end checked, and those the one before
        # it checked (what the update a sweep judges had been checked against).
        self._listed_last: frozenset[int] | None = None
        self._grads_listed: frozenset[int] | None = None
        # Buffers of excluded modules (their business: a memory bank's NaN empty slots), for
        # the table they were found in.
        self._excluded_buffers: tuple[ParamTable | None, frozenset[str]] = (None, frozenset())
        self.amp_skips = 0  # consecutive steps GradScaler skipped
        # The last step ended had a failing batch the loop dropped itself (see
        # _dropped_by_loop): its finite update stands; what that batch's forward wrote into
        # running statistics does not.
        self.loop_dropped = False
        self._masked_inference_step = -1  # an inference forward of it returned -inf masks
        self._hand_norms: bool | None = None  # the model holds a norm written by hand
        # Other optimizers that stepped since the latest check_loss (see _stale_weights).
        self.stepped_since_loss: list[weakref.ref[torch.optim.Optimizer]] = []
        self.eval_only = False  # ...its origins were all validation forwards (see above)
        # Parameters (ids) outside the optimizer GradScaler steps now (a backbone/head split:
        # the head's gradients may still be scaled), set for one resolution: their Inf is
        # GradScaler's to judge when it steps theirs (see _failure).
        self.scaler_pending: Callable[[], frozenset[int]] | None = None
        self._updated: list[Owned] = []  # buffers forwards update in place (see there)
        self._updated_key: tuple[int, int] | None = None
        # Bad gradients a replay proved absorbed, by sites and kinds: the step of the proof.
        self._absorbed_proofs: dict[tuple[Any, ...], int] = {}
        self._stats_owned: list[Owned] = []  # norms' running statistics (see there)
        self._stats_probed = (-2, -2)  # the last two steps whose end probed them
        self._stats_table: ParamTable | None = None
        self._step_trains = False  # the step being resolved ran a training forward
        # The last step GradScaler skipped had an origin before the scaling: its overflow
        # is no reason for a smaller scale.
        self.unscalable_skip = False
        self._output_peak: float | None = None  # largest model output probe of a failing step
        self._failing_items: list[Item] = []  # the items of the step being resolved
        self._amp_localise = False  # the scale collapsed: localise this skipped step
        self.amp_skipped = False  # ...and whether GradScaler skipped the last step resolved
        self._amp_collapse_reported = False
        self._amp_floor_reached = False  # ...and its scale reached amp_scale_floor
        self.last_scale: float | None = None
        self._origin_step = -1  # the latest step with an origin event
        self._origin_told_step = -1  # ...and the step that event names
        # ...when it pointed at another guard's origin: that model's class name.
        self.origin_by: str | None = None
        # Batches told as input origins in a step: (step, {(id, version): the batch}), only
        # on the failure path (kept until the step ends).
        self._told_inputs: tuple[int, dict[tuple[int, int], Tensor]] = (-1, {})
        self._nan_at_attach: set[str] = set()  # weights and buffers non-finite when attached
        #: weights load_state_dict() left non-finite, with the step it ran in (told once)
        self._nan_loaded: dict[str, int] = {}
        # Old name -> new name of parameters renamed since the table was built (pruning),
        # while a resolution holds indices into the old table.
        self._renaming: dict[str, str] = {}
        # ...the buffers of them, by name: the tensor and its version then.
        self._nan_buffers: dict[str, tuple[Callable[[], Tensor | None], int]] = {}
        self._attach_checked = False  # ...which is known (check_params was not False)
        self.clips: list[Clip] = []  # this step's clip_grad_norm_ calls on watched weights
        self._clips_mark: tuple[int, int] = (-1, -1)  # (step, forwards) when they were made
        # (step, call, non-finite samples of its outputs by shape) of the latest inference
        # call of the model found non-finite
        self._fed_back: tuple[int, int, dict[tuple[int, ...], set[int]]] | None = None
        # ...and the objects given to that call (a KV cache it updates in place), weakly.
        self._fed_objects: list[weakref.ref[Any]] = []
        self._stored_seen: set[tuple[int, int]] = set()  # attributes blamed already
        self._absorbed_seen: set[tuple[str, str]] = set()  # (module, tensor) said absorbed

    def _tell_fast_path(self, items: list[Item]) -> None:
        """Once: an evaluation under no_grad whose TransformerEncoderLayers have hooks
        (checked modules) ran torch's regular path, not the fused kernel it takes without
        them, and the results can differ."""
        if not any(isinstance(i, ForwardRecord) and not i.grad and not i.coarse for i in items):
            return
        hooked = self._recorder.watched_ids()
        for layer in self._encoder_layers:
            if layer.training or not _fused_kernel_layer(layer):
                continue
            if not any(id(m) in hooked for m in layer.modules()):
                continue  # (excluded: any hooks left are the user's own)
            self._fast_path_told = True
            warnings.warn(
                "nanguard: in eval() under no_grad, torch runs an nn.TransformerEncoderLayer "
                "on a fused inference kernel, but not when it or its submodules have hooks, "
                "as nanguard's checks are: the watched model ran the regular path, whose "
                "results can differ (a sample whose padding mask is all True: NaN on the "
                "kernel, finite here). Pass exclude=(nn.TransformerEncoderLayer,) to keep the "
                "kernel, or mode='sentinel', whose steps run unhooked.",
                RuntimeWarning,
                stacklevel=user_stacklevel(),
            )
            return

    # ------------------------------------------------------------------ entry
    def resolve(
        self,
        items: list[Item],
        *,
        step_end: bool,
        step: int,
        amp: AmpObservation | None = None,
        final: bool = False,
    ) -> Outcome:
        """Resolve ``items`` (and, at the end of a step, gradients and parameters).

        Parameters are swept every ``sweep_every`` steps, at the end (``final``), and
        whenever a step goes non-finite (a corrupted weight makes the next forward
        non-finite wherever it is used, so that is where it is found).
        """
        if self._encoder_layers and not self._fast_path_told:
            self._tell_fast_path(items)
        values: list[Tensor] = []
        item_spans = []
        for item in items:
            item_values = item.all_values()
            item_spans.append((len(values), len(item_values)))
            values.extend(item_values)
            if isinstance(item, ForwardRecord) and not item.grad and _masks_out(item):
                # An inference forward returning masked logits (-inf written on purpose: a
                # DPO reference pass): a loss of its step may read them.
                self._masked_inference_step = item.step
        grad_indices: list[int] = []
        param_owned: list[Owned] = []
        grads_at = params_at = amp_at = clips_at = (len(values), 0)
        clips: list[Clip] = []
        grad_groups: Groups = []
        param_groups: Groups = []
        if step_end:
            self.loop_dropped = self.unscalable_skip = self.eval_only = False
            self._grads_listed = self._listed_last
            self._since_table_check += 1
            if self._since_table_check >= _TABLE_CHECK_EVERY or final:
                self._since_table_check = 0
                self._refresh_table()
            # Gradients are read outside autograd (cheaper than torch.no_grad() here).
            enabled = torch.is_grad_enabled()
            torch._C._set_grad_enabled(False)
            try:
                grad_indices, grads = self.params.grads() if self._watch_grads else ([], [])
                self._listed_last = self.params.ids
                grad_norms, grad_groups = norms(grads) if grads else ([], [])
                grads_at = (len(values), len(grad_norms))
                values.extend(grad_norms)
                if self._sweep_due(final):
                    # Finiteness only: one cheap probe per tensor, as for activations.
                    param_owned, tensors = self.params.values(skip=self._unswept())
                    param_values, param_groups = finite_probes(self._nan_only(param_owned, tensors))
                    params_at = (len(values), len(param_values))
                    values.extend(param_values)
                    self._prior_sweep, self._swept_at = self._swept_at, step
                else:
                    # Buffers a forward writes in place (an EMA codebook, an observation
                    # normaliser): every step, as activations are. A non-finite one fails
                    # the step, whose failure path sweeps every weight and names it.
                    # (-Inf ignored: a running maximum starts there, a mask cache fills so.)
                    if self._recorder.buffer_updaters:
                        values.extend(
                            t.nan_to_num(nan=math.nan, posinf=math.inf, neginf=0.0).sum()
                            for t in self._updated_buffers()
                        )
                    # ...and, probing every module, the norms' running statistics (a finite
                    # outlier whose square overflows poisons them in a finite forward): their
                    # largest magnitudes, one call, no sum to overflow.
                    stats = self._running_stats() if self._recorder.full else []
                    if stats:
                        values.extend(_largest(stats))
                        self._stats_probed = (self._stats_probed[1], step)
            finally:
                torch._C._set_grad_enabled(enabled)
            if self.clips:  # the norms before clipping, for the gradient-norm guard
                clips, self.clips = self.clips, []
                if grad_indices:
                    clips_at = (len(values), len(clips))
                    values.extend(c.norm for c in clips)
        if amp is not None:
            amp_values = [amp.scale_before, amp.scale_after, *amp.found_inf]
            amp_at = (len(values), len(amp_values))
            values.extend(v.reshape(()).float() for v in amp_values)
        if not values and not (items and getattr(items[0], "raised", None) is not None):
            return Outcome([], False)
        host = host_values(values) if values else []  # the one host read of the step
        layout = _Layout(
            item_spans, grads_at, params_at, amp_at, clips_at, grad_groups, param_groups
        )
        try:
            outcome = self._interpret(
                items, host, layout, grad_indices, param_owned, step, amp, final, clips
            )
            first = next((e for e in outcome.events if e.is_origin), None)
            if first is not None:
                self._origin_step = step
                # (the step it names: a weight found at this step went bad in the one before)
                self._origin_told_step = first.step
                self.origin_by = None
            return outcome
        finally:
            self._failing_items = []  # no batch or gradient outlives its resolution
            # (but a batch told as an input origin, until its step ends: _told_input)
            if self._next_table is not None:
                old, self.params, self._next_table = self.params, self._next_table, None
                self._new_params(old)
                self._rename(self._renaming)  # (and what this resolution wrote since)
                self._renaming = {}
                # (The gradients of parameters put in since: this failing step's, told.)
                self.params.mark_present(besides=old.ids)

    # --------------------------------------------------------------- fast path
    def _interpret(
        self,
        items: list[Item],
        host: list[float],
        layout: _Layout,
        grad_indices: list[int],
        param_owned: list[Owned],
        step: int,
        amp: AmpObservation | None,
        final: bool = False,
        clips: Sequence[Clip] = (),
    ) -> Outcome:
        events: list[Event] = []
        now = time.time()
        told: tuple[int, GradNormAlarm, Clipped | None] | None = None  # a grad-norm alarm
        g0, gn = layout.grads
        finite = all_finite(host) or self._only_tolerated(items, host, layout)
        if finite and len(items) == 1 and getattr(items[0], "raised", None) is not None:
            finite = not getattr(items[0], "coarse", False)  # (sentinel: its batch unchecked)
        totals = host[g0 : g0 + gn]
        squares = list(map(operator.mul, totals, totals))  # one per group of gradients
        skipped = False
        if amp is not None:
            a0, an = layout.amp
            before, after, *found = host[a0 : a0 + an]
            skipped = any(f != 0 for f in found)  # an overflow GradScaler handles
            self.amp_skipped = skipped
            mine = any(f != 0 for f in found[: amp.own])  # ...and skips this optimizer's step
            events.extend(self._amp_events(step, before, after, skipped, now, mine))
        if gn and not skipped:
            if not all_finite(squares):
                squares = self._refine_squares(grad_indices, layout.grad_groups, squares)
            total = math.sqrt(sum(squares))
            clipped = self._clipped(host, layout, clips, total)
            if clipped is not None:
                total = clipped.norm
            # (At detach, where optimizer.step() ends the steps, no step of ours applies what
            # .grad holds: another model's backward may have left it, a GAN's generator loss
            # through its discriminator. The absolute thresholds still apply.)
            ended_by_optimizer = final and self._options.optimizer is not None
            if len(grad_indices) > self.most_grads and not ended_by_optimizer:
                if self.most_grads:  # (parameters that never had a gradient: unfrozen)
                    self.monitor.reset()
                self.most_grads = len(grad_indices)
            loss = _step_loss(items, host, layout)
            last, self._last_loss = self._last_loss, loss
            alarm = self.monitor.observe(
                total,
                history=not ended_by_optimizer,
                scale=functools.partial(self._batch_scale, items),
                # (the loss checked this step fell by a tenth or more since the last)
                learning=loss is not None and last is not None and loss < last - 0.1 * abs(last),
            )
            if alarm is not None:
                if alarm.reason == "spike":  # (a threshold crossed is no explosion yet)
                    last = self._last_spike
                    if last is None or step - last > _SPIKE_EPISODE:
                        self._first_spike = step  # (spikes a few steps apart: one episode)
                    self._last_spike = step
                told = (len(events), alarm, clipped)
                events.append(self._grad_norm_event(step, alarm, grad_indices, now, clipped))
            if self._options.param_norm_threshold is not None:
                if clipped is not None:  # (each weight's norm before clipping, too)
                    squares = self._unclipped_squares(
                        grad_indices, layout.grad_groups, squares, clipped
                    )
                events.extend(
                    self._param_threshold_events(
                        step, grad_indices, layout.grad_groups, squares, now
                    )
                )
        if any(isinstance(item, ForwardRecord) and item.half_outputs for item in items):
            events.extend(self._overflow_events(items, host, layout, now))
        if finite:
            self._dead_told = False
            if gn:
                self._last_bad_grads = set()
            if param_owned:  # every weight was finite: earlier bad gradients were harmless
                self._bad_grads_since.clear()
            return Outcome(events, False)
        localise, self._amp_localise = self._amp_localise, False
        unscaled = False
        if skipped and not localise and amp is not None:
            # (A NaN no loss scale makes: the same backward from unscaled gradients.)
            localise = unscaled = self._bad_unscaled(items, host[layout.amp[0]])
        c0, cn = layout.clips
        if cn and gn and all_finite(host[:c0]) and all_finite(host[c0 + cn :]):
            # Only clip_grad_norm_'s total norm is non-finite: it overflowed (float16) from
            # finite gradients, and scaled every one of them by max_norm / inf = 0.
            bad = [
                c for c, v in zip(clips, host[c0 : c0 + cn], strict=True) if not math.isfinite(v)
            ]
            return Outcome([*events, self._clip_overflow_event(step, bad, now)], False)
        failure, bad_gradients = self._failure(
            items,
            host,
            layout,
            grad_indices,
            squares,
            param_owned,
            step,
            skipped and not localise,
            now,
            () if cn else clips,
        )
        failure = self._unreproduced_after_origin(failure)
        origin = next((e for e in failure if e.is_origin and e.phase != "param"), None)
        if told is not None and origin is not None:
            # The norm of the gradients still finite, in the step that made a non-finite
            # value elsewhere: not the explosion that turns into NaN later, maybe the same cause.
            at, alarm, clipped = told
            events[at] = self._grad_norm_event(step, alarm, grad_indices, now, clipped, origin)
        # (A tensor "about to overflow" that is this step's origin overflowed already.)
        overflowed = {(e.module, e.tensor) for e in failure if e.is_origin}
        events = [
            e for e in events if e.kind != "overflow_risk" or (e.module, e.tensor) not in overflowed
        ]
        if skipped and not localise:
            failure = self._scaled_derivative(items, failure)
        if skipped and any(
            e.is_origin
            and e.phase in _BEFORE_SCALING
            # (Not the loss's backward: it ran on the scaled loss, where a float16 overflow
            # is what a smaller scale fixes.)
            and e.details.get("reason") != "loss_backward"
            for e in failure
        ):
            # Not an overflow of the scaled gradients that a smaller scale fixes (skip_step
            # puts the scale back).
            self.unscalable_skip = True
            events = [self._unscalable(e, mine) if e.kind == "amp_overflow" else e for e in events]
        elif unscaled and any(e.is_origin for e in failure):
            self.unscalable_skip = True
            events = [
                self._unscalable(e, mine, unscaled=True) if e.kind == "amp_overflow" else e
                for e in events
            ]
        return Outcome(events + failure, bad_gradients)

    def _batch_scale(self, items: list[Item]) -> float:
        """``sqrt(batch / usual batch)``: a smaller batch's gradient is noisier by that much
        (a mean over fewer samples). The step's batch is what its train-mode forwards were
        given (gradient accumulation's micro-batches add up); 1 when unknown."""
        batch = 0
        for item in items:
            # (Not a validation forward run with gradients on in eval(): no backward.)
            if isinstance(item, ForwardRecord) and item.grad and not item.eval_mode:
                size = _batch_of(item)
                if size is None:
                    return 1.0
                batch += size
        self._batch = batch
        if batch <= 0:
            return 1.0
        # The usual batch: the largest of recent steps (one outlier, a validation pass in
        # train() with gradients on, is forgotten).
        self._batches.append(batch)
        self._batch_max = max(self._batches)
        return 1.0 if batch >= self._batch_max else math.sqrt(batch / self._batch_max)

    def _clip_overflow_event(self, step: int, clips: list[Clip], now: float) -> Event:
        grad = next((p.grad for c in clips for p in c.parameters if p.grad is not None), None)
        dtype = str(grad.dtype) if grad is not None else ""
        limit = DTYPE_MAX.get(dtype)
        name = dtype.removeprefix("torch.")
        overflow = f" (the sum of their squares passes {name}'s {limit:g})" if limit else ""
        return self._event(
            step=step,
            phase="grad",
            module=None,
            module_type=None,
            kind="inf",
            is_origin=True,
            message=(
                f"nanguard: step {step}: clip_grad_norm_ computed an Inf total norm from finite "
                f"{name} gradients{overflow}. It scaled every "
                "gradient by max_norm / inf = 0, so this step moves no weight, and the next "
                "ones neither while the norm overflows."
            ),
            tensor="gradients",
            time=now,
            hint=(
                "Compute the total norm in float32: norm = torch.nn.utils.get_total_norm("
                "[p.grad.float() for p in params]), then clip_grads_with_norm_(params, "
                "max_norm, norm); or keep float32 master weights (autocast with GradScaler)."
            ),
            details={"reason": "clip_overflow"},
        )

    def _unreproduced_after_origin(self, failure: list[Event]) -> list[Event]:
        """An origin a replay did not make again, after an earlier origin of the same step
        that it did (or could not tell): the earlier one's values may have reached it in a way
        a replay does not rebuild (MAML's fast weights, made from a NaN sample's gradient and
        run with functional_call; a state kept between calls). Not an origin of its own."""
        first = next((e for e in failure if e.is_origin), None)
        if first is None or first.reproducible is False:
            return failure
        out = []
        for event in failure:
            if event.is_origin and event is not first and event.reproducible is False:
                where = (
                    f" (forward {first.details['forward']})" if "forward" in first.details else ""
                )
                event = dataclasses.replace(
                    event,
                    is_origin=False,
                    hint=None,
                    details={**event.details, "after_origin": True},
                    message=event.message.split(" A replay of this step", 1)[0]
                    + f" A replay did not make it again, and this step's earlier origin{where} "
                    "can have reached it in a way a replay does not rebuild (fast weights made "
                    "from its gradient and run with functional_call, a state kept between "
                    "calls): not an origin of its own.",
                )
            out.append(event)
        return out

    def _bad_unscaled(self, items: list[Item], scale: float) -> bool:
        """A step GradScaler skips for non-finite gradients that its backward makes at scale
        1 too (a sqrt at 0, a NaN the loss scale has nothing to do with): a bug, not an
        overflow that a smaller scale fixes. One replay of the backward from the gradients
        the outputs got, divided by the scale; only when those were finite (else the loss's
        backward overflowed: the scaler's to fix)."""
        if not self._options.replay or not (math.isfinite(scale) and scale > 1.0):
            return False
        for item in items:
            if not isinstance(item, ForwardRecord) or not item.output_grads or not item.frames:
                continue
            with torch.no_grad():
                if any(flags_of_tensor(g) for g in item.output_grads.values()):
                    # (the loss's backward went non-finite at this scale: an overflow that a
                    # normalisation in the loss may have made NaN; the scaler's to judge)
                    continue
            result = replay(self._recorder, item, backward=True, grad_scale=1.0 / scale)
            if result.problem is None and (
                any(fl for _, fl in result.grad_events) or result.bad_params
            ):
                return True
        return False

    def _scaled_derivative(self, items: list[Item], failure: list[Event]) -> list[Event]:
        """A loss origin of a step GradScaler skipped, which also took a derivative through
        the model (the AMP gradient-penalty recipe: ``autograd.grad(scaler.scale(out), x,
        create_graph=True)``): the loss read the scaled derivative, whose float16 overflow a
        smaller scale fixes. Not an origin (were it one, the scale collapses and the step that
        collapses it is localised)."""
        if not any(isinstance(item, ForwardRecord) and item.double_backward for item in items):
            return failure
        out = []
        for event in failure:
            if event.is_origin and event.phase == "loss":
                head = event.message.split(" while ", 1)[0]
                event = dataclasses.replace(
                    event,
                    is_origin=False,
                    hint=None,
                    details={**event.details, "reason": "scaled_derivative"},
                    message=(
                        f"{head}, in a step that took a derivative through the model (a "
                        "gradient penalty: autograd.grad of scaler.scale(...) with "
                        "create_graph=True) and that GradScaler skipped for an overflow: the "
                        "loss read the scaled derivative, which overflowed float16; the "
                        "smaller scale fixes that (no origin)."
                    ),
                )
            out.append(event)
        return out

    def _unscalable(self, event: Event, mine: bool, unscaled: bool = False) -> Event:
        """``unscaled``: the backward makes NaN/Inf from unscaled gradients too."""
        details = event.details
        message = amp_skip_message(
            event.step,
            details["scale_before"],
            details["scale_after"],
            details["consecutive"],
            mine,
            explained=True,
            put_back=self._options.on_nonfinite == "skip_step",
            unscaled=unscaled,
        )
        fields = {f.name: getattr(event, f.name) for f in dataclasses.fields(event)}
        fields.update(message=message, details={**details, "explained_by_origin": True})
        del fields["rank"]
        return self._event(**fields)

    @staticmethod
    def _only_tolerated(items: list[Item], host: list[float], layout: _Layout) -> bool:
        """Every non-finite value is one that only waits to matter: a -Inf that entered a
        module from outside it, or anything non-finite in the batch itself.

        Such a value (an additive mask built in a parent's code, a clamp's bound, missing
        values the model imputes) is only an origin if it reaches a non-finite output, loss
        or gradient, which shows as another value; the fast path stays open for models that
        mask with -inf or impute NaN every step.
        """
        neg_inf: set[int] = set()
        batch: set[int] = set()
        for item, (start, _) in zip(items, layout.items, strict=True):
            for site in item.sites:
                if site.role == "input":
                    at = range(start + site.start, start + site.start + site.nvalues)
                    (batch if site.frame == 0 else neg_inf).update(at)
        return all(
            math.isfinite(v) or i in batch or (v == -math.inf and i in neg_inf)
            for i, v in enumerate(host)
        )

    def _updated_buffers(self) -> list[Tensor]:
        """The buffers forwards were seen updating in place (not a norm's running
        statistics: see ``_running_stats``), but masks and those told already."""
        updaters = self._recorder.buffer_updaters
        key = (len(updaters), id(self.params))
        if self._updated_key != key:
            self._updated_key = key
            self._updated = [
                o
                for o in self.params.buffers
                if (id(o.owner), o.local) in updaters
                and o.name not in self._nan_at_attach  # (reported once, at attach)
                and o.name not in self._mask_buffers
                and not is_mask_name(o.local)
                and not self._allows_inf(o.owner)
            ]
        found = (
            held(o.owner._buffers, o.local)
            for o in self._updated
            if not self._bad_params or o.name not in self._bad_params  # (told once)
        )
        return [t for t in found if t is not None and not is_lazy(t) and t.is_floating_point()]

    def _probed_each_step(self, owned: Owned) -> bool:
        """Whether this buffer was found finite at the end of the step before (running
        statistics: probed at the last two step ends, one after the other; not so with
        every=N, whose steps between probe no module)."""
        earlier, latest = self._stats_probed
        if latest - earlier == 1 and any(o is owned for o in self._stats_owned):
            return True
        return any(o is owned for o in self._updated)

    def _running_stats(self) -> list[Tensor]:
        """The running means and variances of the model's batch-statistics norms."""
        if self._stats_table is not self.params:
            self._stats_table = self.params
            self._stats_owned = [
                o
                for o in self.params.buffers
                if o.local in _RUNNING_STATS and isinstance(o.owner, _BATCH_STATS_NORMS)
            ]
        # (Not one reported already, or loaded so: told once, not a failing step each.)
        told = self._bad_params or self._nan_at_attach
        found = (
            held(o.owner._buffers, o.local)
            for o in self._stats_owned
            if not told or (o.name not in self._bad_params and o.name not in self._nan_at_attach)
        )
        return [
            t
            for t in found
            if t is not None
            and not is_lazy(t)  # (LazyBatchNorm before its first forward)
            and not t.is_meta
            and t.is_floating_point()
            and t.layout is torch.strided
        ]

    def _sweep_due(self, final: bool) -> bool:
        if self._sweep_soon:  # (weights found non-finite when the guard was attached)
            self._sweep_soon = False
            self._since_sweep = 0
            return True
        every = self._sweep_every
        if not every:
            return final and self._options.check_params != 0
        self._since_sweep += 1
        if final or self._since_sweep >= every:
            self._since_sweep = 0
            return True
        return False

    def _sweep_now(self) -> tuple[list[Owned], Groups, list[float]]:
        """The failure path's parameter sweep (its own host read)."""
        if self._options.check_params == 0:  # the user switched sweeps off
            return [], [], []
        # Replaced parameters: sweep the model's own; the table is swapped once this
        # resolution, which holds indices into the old one, is done.
        self._next_table = self._fresh_table()
        if self._next_table is not None:
            self._renaming = _renames(self.params, self._next_table)
            self._rename(self._renaming)
        table = self._next_table or self.params
        with torch.no_grad():
            owned, tensors = table.values(skip=self._unswept(table), always=True)
            values, groups = finite_probes(self._nan_only(owned, tensors))
        self._since_sweep = 0
        return owned, groups, host_values(values) if values else []

    # ------------------------------------------------------------------ clipping
    def note_clip(self, clip: Clip) -> None:
        """``clip_grad_norm_`` is about to scale gradients: keep its norm if they include
        watched ones, and GradScaler (if any) has unscaled them (else it is scaled too)."""
        mine = self.params.ids
        if not any(id(p) in mine for p in clip.parameters):
            return
        scaler, optimizer = self._options.scaler, self._options.optimizer
        if scaler is not None and optimizer is not None and scaler.is_enabled():
            try:
                stage = scaler._per_optimizer_states[id(optimizer)]["stage"]
            except (AttributeError, KeyError, TypeError):
                stage = None
            if stage is not None and getattr(stage, "name", "") != "UNSCALED":
                return  # clipped before scaler.unscale_(): a norm of scaled gradients
        # Clips before the latest forward belong to a step the user dropped without an
        # optimizer step (fairseq's skip on a non-finite norm): not this step's.
        mark = (self._recorder.step, self._recorder.forwards)
        if mark != self._clips_mark or len(self.clips) >= _MAX_CLIPS:
            self.clips = []
            self._clips_mark = mark
        self.clips.append(clip)

    @staticmethod
    def _clipped(
        host: list[float], layout: _Layout, clips: Sequence[Clip], total: float
    ) -> Clipped | None:
        """The step's total gradient norm before ``clip_grad_norm_`` scaled it (``total``
        is the norm after): what each clip removed is put back."""
        c0, cn = layout.clips
        if not cn or not math.isfinite(total):
            return None
        before = host[c0 : c0 + cn]
        if not all_finite(before):
            return None  # (the gradients are non-finite too: the failure path says so)
        after = [v * min(1.0, c.max_norm / (v + 1e-6)) for v, c in zip(before, clips, strict=True)]
        others = max(total * total - sum(v * v for v in after), 0.0)  # weights no clip saw
        norm = math.sqrt(others + sum(v * v for v in before))
        return Clipped(
            norm, total, min(c.max_norm for c in clips), list(zip(clips, before, strict=True))
        )

    @staticmethod
    def _clip_factors(clipped: Clipped) -> dict[int, float]:
        """id(parameter) -> by how much its gradient was scaled down."""
        factors: dict[int, float] = {}
        for clip, before in clipped.clips:
            coef = min(1.0, clip.max_norm / (before + 1e-6))
            if coef > 0:
                for p in clip.parameters:
                    factors[id(p)] = factors.get(id(p), 1.0) / coef
        return factors

    def _unclipped_squares(
        self, grad_indices: list[int], groups: Groups, squares: list[float], clipped: Clipped
    ) -> list[float]:
        factors = self._clip_factors(clipped)
        params = self.params.params
        out = list(squares)
        for n, (_, members) in enumerate(groups):
            if len(members) == 1:
                f = factors.get(id(params[grad_indices[members[0]]][1]), 1.0)
                out[n] = squares[n] * f * f
        return out

    def _grads_of(self, grad_indices: list[int], members: Sequence[int]) -> list[Tensor]:
        grads = (self.params.params[grad_indices[m]][1].grad for m in members)
        return [g for g in grads if g is not None]

    def _refine_squares(
        self, grad_indices: list[int], groups: Groups, squares: list[float]
    ) -> list[float]:
        """Recompute in float64 the squares that overflowed on finite gradients."""
        refined = list(squares)
        for n, ((_, members), value) in enumerate(zip(groups, squares, strict=True)):
            if math.isfinite(value):
                continue
            grads = self._grads_of(grad_indices, members)
            if not any(flags_of_tensor(g) for g in grads):
                # v * v, not v ** 2: a float64 norm above 1e154 squares to inf, not an error
                refined[n] = sum(v * v for v in map(exact_norm, grads))
        return refined

    # ------------------------------------------------------------ failure path
    def _failure(
        self,
        items: list[Item],
        host: list[float],
        layout: _Layout,
        grad_indices: list[int],
        squares: list[float],
        param_owned: list[Owned],
        step: int,
        amp_skipped: bool,
        now: float,
        unread_clips: Sequence[Clip] = (),
    ) -> tuple[list[Event], bool]:
        flags, grad_flags = self._flags(items, host, layout)
        self._step_trains = any(isinstance(i, ForwardRecord) and i.grad for i in items)

        c0, cn = layout.clips
        # clip_grad_norm_ by a non-finite total norm scaled every gradient by NaN. (Its norms
        # are read with the step's only without the gradient-norm guard: read here, failing.)
        nan_clip = (
            not all_finite(host[c0 : c0 + cn])
            if cn
            else not all_finite(host_values([c.norm for c in unread_clips]))
            if unread_clips
            else False
        )
        self._output_peak = _output_peak(items, host, layout)
        self._failing_items = items  # their inputs' peak is read only if a hint needs it
        step_grads = bool(grad_indices)
        # Gradients of parameters: an exact check of each gradient in a suspicious group
        # (a sum of squares of huge finite values can overflow).
        bad_grads: dict[int, int] = {}
        for (_, members), value in zip(layout.grad_groups, squares, strict=True):
            if math.isfinite(value):
                continue
            for m in members:
                grad = self.params.params[grad_indices[m]][1].grad
                exact = flags_of_tensor(grad) if grad is not None else 0
                if exact:
                    bad_grads[grad_indices[m]] = exact
        pending = self.scaler_pending() if self.scaler_pending and bad_grads else None
        if pending:
            # GradScaler steps the optimizer of these after this one, and skips it for an
            # overflow (Inf) of their still-scaled gradients: theirs to judge, not an origin
            # here. A NaN is judged (an optimizer stepped without the scaler applies it).
            table = self.params.params
            for i in [i for i, fl in bad_grads.items() if not fl & NAN]:
                if id(table[i][1]) in pending:
                    del bad_grads[i]
        shared = self.params.shared
        bad_modules = {id(self.params.params[i][0].owner) for i in bad_grads}
        bad_ids = {id(self.params.params[i][1]) for i in bad_grads}
        strict_modules = {  # without parameters held by several modules (tied weights)
            id(self.params.params[i][0].owner)
            for i in bad_grads
            if id(self.params.params[i][1]) not in shared
        }
        discarded: set[int] = set()  # forwards whose non-finite gradients .grad lacks
        if step_grads and not bad_grads:
            self._clear_absorbed(items, grad_flags)
            # Their backward sent non-finite gradients into the model (its own backward did
            # not absorb them), the optimizer's zero_grad() ran after it, and no parameter's
            # gradient is non-finite now: the loop skipped that batch itself.
            discarded = {
                id(item)
                for item, grads in zip(items, grad_flags, strict=True)
                if isinstance(item, ForwardRecord)
                and item.grads_zeroed  # (not a loop's nan_to_num of the gradients)
                and any(fl for _, fl in grads)
            }
        # Parameters and buffers that went non-finite in an optimizer step.
        at, param_groups, param_host = layout.params[0], layout.param_groups, host
        if not param_owned:
            param_owned, param_groups, param_host = self._sweep_now()
            self._prior_sweep, self._swept_at = self._swept_at, step
            at = 0
        corrupted: list[tuple[Owned, Tensor, int]] = []
        suspects: list[int] = []
        for count, members in param_groups:
            if count and flags_of(param_host[at : at + count]):
                suspects.extend(members)
            at += count
        found_bad: list[tuple[Owned, Tensor, int]] = []
        for m in sorted(suspects):
            owned = param_owned[m]
            tensor = self._tensor_of(owned)
            exact = flags_of_tensor(tensor) if tensor is not None else 0
            if tensor is not None and exact:
                found_bad.append((owned, tensor, exact))
        self._unneeded_buffers = self._unneeded(items, [(o, t) for o, t, _ in found_bad])
        for owned, tensor, exact in found_bad:
            if id(tensor) in self._unneeded_buffers:
                continue  # (a table the step's forward does not need: a sampler's)
            if not self._intentional_buffer(owned, exact):
                corrupted.append((owned, tensor, exact))
            elif owned.local in owned.owner._parameters:  # (allow_inf: swept for NaN only)
                self._inf_weights.add(owned.name)
        # Modules whose forward used non-finite weights. A BatchNorm's running statistics
        # are not used in training mode: their Inf explains nothing there.
        corrupted_modules = {
            id(o.owner)
            for o, _, _ in corrupted
            if not (
                isinstance(o.owner, _BATCH_STATS_NORMS)
                and o.owner.training
                and o.local in _RUNNING_STATS
            )
            and not self._written_this_step(o)
        }
        for o, tensor, _ in corrupted:
            # (A tied weight: every module holding it used it.)
            corrupted_modules.update(id(m) for m in self.params.holders.get(id(tensor), ()))
            if o.local == "_flat_param":  # FSDP1 (use_orig_params=False): one tensor holds
                # the weights of every module of its unit, which its forward used
                corrupted_modules.update(id(m) for m in o.owner.modules())

        def holding(modules: set[int]) -> Callable[[int, int], bool]:
            """``(item, frame)`` -> whether the frame's module is one of ``modules``."""

            def holds(item: int, frame: int) -> bool:
                record = items[item]
                if not isinstance(record, ForwardRecord) or not modules:
                    return False
                module = record.frames[frame].module
                # (A step whose modules inside were not recorded, sentinel or compiled and
                # not replayed (a sharded model): weights anywhere inside explain it.)
                return id(module) in modules or (
                    record.coarse and any(id(m) in modules for m in module.modules())
                )

            return holds

        upstream = holding(corrupted_modules)

        called_memo: dict[tuple[tuple[int, bool], ...], set[int]] = {}

        def called_modules() -> set[int]:
            """Modules the step's forwards called (as recorded now: a sentinel step's
            replay has stood in for it): a submodule never called holds weights its parent's
            own code uses (a cosine classifier normalising self.cls.weight itself)."""
            key = tuple((id(i), bool(getattr(i, "coarse", False))) for i in items)
            found = called_memo.get(key)
            if found is None:
                found = called_memo[key] = {
                    id(frame.module)
                    for item in items
                    if isinstance(item, ForwardRecord) and not item.coarse
                    for frame in item.frames
                }
            return found

        def bad_param_grads(item: int, frame: int, tied: bool = True) -> bool:
            """Whether the frame's module has parameters with bad gradients (``tied``:
            counting parameters that other modules hold too), its own or those of its
            submodules no forward called (weights its own code uses)."""
            record = items[item]
            if not isinstance(record, ForwardRecord):
                return False
            module = record.frames[frame].module
            owners = (
                _held_modules(module, called_modules(), self._recorder.watched_ids())
                if not record.coarse and next(module.children(), None) is not None
                else [module]
            )
            params = [p for m in owners for p in m.parameters(recurse=False)]
            replayed = record.replayed_bad_params
            modules = bad_modules if tied else strict_modules
            if replayed is not None:  # what this backward made, not what .grad holds now
                unseen = record.replayed_unseen  # (not recomputed: .grad is all there is)
                return any(
                    id(p) in replayed or (id(p) in unseen and id(module) in modules)
                    for p in params
                    if tied or id(p) not in shared
                )
            if nan_clip:
                # clip_grad_norm_ by a NaN total norm made every .grad NaN: what a module's
                # backward made is known only from a replay's.
                return False
            if tied:  # every module holding one (a tied weight has one owner, several users)
                return any(id(p) in bad_ids for p in params)
            return any(id(m) in modules for m in owners)

        # Forwards after which an optimizer step changed the weights (guard.step() called
        # after optimizer.step(), or the closures of LBFGS): the corruption may be newer.
        updates = self._recorder.updates
        stale_steps = [
            item.step
            for item in items
            if isinstance(item, ForwardRecord) and item.updates < updates
        ]

        def stale(item: int) -> bool:
            record = items[item]
            return isinstance(record, ForwardRecord) and record.updates < updates

        # ...but weights found non-finite at an earlier resolution were so before these
        # forwards (steps ended after optimizer.step(): they went bad in the previous one's),
        # and so were weights whose gradient an earlier resolution found non-finite: the
        # update that applied it ran before these forwards (the closure calls of LBFGS after
        # its first one's NaN loss).
        known = holding(
            {
                id(m)
                for o, tensor, _ in corrupted
                if o.name in self._bad_params
                or o.name in self._last_bad_grads
                or o.name in self._bad_grads_since
                for m in (o.owner, *self.params.holders.get(id(tensor), ()))
            }
        )

        self._stayed_inside = not (bad_grads or corrupted or amp_skipped) and _absorbed(
            items, flags, grad_flags
        )
        if self._stayed_inside:
            # NaN made inside the model that its own code absorbed (nan_to_num after an
            # nn.Softmax child over fully masked rows, masked_fill(pad, nan) then nanmean):
            # nothing non-finite reached its outputs, the loss or the gradients. Sentinel
            # mode never sees it; full mode says so once per tensor, and replays nothing.
            # (An Inf keeps the rules of masks: written on purpose, or an origin.)
            findings = analyze(
                items,
                flags,
                self.is_mask_arg,
                upstream=upstream,
                stale=stale,
                known=known,
                replayed=self._options.replay,
            )
            origins = [f for f in findings if f.is_origin]
            if origins and all(self._written_nan(items[f.item], f, flags) for f in origins):
                self._bad_grads_since.clear()
                if step_grads:
                    self._last_bad_grads = set()
                return self._absorbed_events(items, findings, now), False
        # Weights reported non-finite at an earlier step explain a coarse step that uses them
        # (sentinel with "log"/"warn" after the weights went NaN): no replay, every step.
        for index, item in enumerate(items):
            if (
                isinstance(item, ForwardRecord)
                and not item.coarse
                and item.frames
                and (any(flags[index]) or any(fl for _, fl in grad_flags[index]) or bad_grads)
                and _compiled_inside(item.frames[0].module)
            ):
                # Submodules compiled after watch() (block.compile(), blocks[i] =
                # torch.compile(block)): their hooks stand aside inside the compiled code, so
                # the record misses them. Replayed eagerly, as a compiled model's step is.
                item.coarse = True
        if (
            self._options.replay
            and any(
                isinstance(item, ForwardRecord)
                and item.frames
                and item.replay is not None
                and (any(flags[index]) or any(fl for _, fl in grad_flags[index]) or bad_grads)
                for index, item in enumerate(items)
            )
            and (self.rehook() or self.hooks_moved)
        ):
            # Modules put in the model since its hooks were placed (model.head = ...,
            # blocks[1] = NewBlock()): the record misses them. Replayed with them hooked.
            for item in items:
                if isinstance(item, ForwardRecord) and item.frames and item.replay is not None:
                    item.coarse = True
        reported = {id(o.owner) for o, _, _ in corrupted if o.name in self._bad_params}
        self._expand_coarse(items, flags, grad_flags, bool(bad_grads) and not amp_skipped, reported)
        external = False  # autograd's gradients were finite; .grad was changed after
        self._loss_checked = any(isinstance(item, LossRecord) for item in items)
        self._localisation_problem = None
        if not amp_skipped and self._recorder.backward_mode == "boundary":
            external = self._localise_backward(
                items, flags, grad_flags, bool(bad_grads), upstream, stale
            )
        elif (
            not amp_skipped
            and self._recorder.backward_mode == "probes"
            and self._options.replay
            and bad_grads
            and not any(fl for per in grad_flags for _, fl in per)
        ):
            # Every module's gradient was finite and only parameters' are not: replayed, as
            # with backward="boundary", the backward tells whether it made them (a gradient
            # penalty's second derivative, a hook that changed .grad: not a module's own).
            external = self._localise_backward(items, flags, grad_flags, True, upstream, stale)
        elif not amp_skipped and self._recorder.backward_mode == "probes" and self._options.replay:
            self._internal_output_grads(items, flags, grad_flags, upstream, stale, known)
        findings = self._analyze(items, flags, grad_flags, bad_param_grads, upstream, stale, known)
        findings = self._chained_calls(items, findings)
        sharded = False
        if (
            not external
            and bad_grads
            and all(f.reason == "backward_params" for f in findings)
            and world_size() > 1
            and (
                collective_problem(self._model) is not None
                or (
                    self._recorder.backward_mode == "probes"
                    and data_parallel(self._model) is not None
                )
            )
        ):
            # A sharded model's parameter gradients are reduce-scattered inside the backward
            # (FSDP): bad ones behind finite gradients at every module came from the ranks'
            # shares, not from this rank's module (and the replay cannot run on one rank).
            # DDP's all-reduce, with every module's gradient probed here, likewise.
            external = True
            sharded = collective_problem(self._model) is not None
        if external:
            findings = [f for f in findings if f.reason != "backward_params"]
        elif nan_clip:
            # clip_grad_norm_ by a NaN total norm made every .grad NaN: a module's bad
            # parameter gradients tell that its backward made them only if a replay
            # recomputed them (not behind a reentrant checkpoint).
            findings = [
                f
                for f in findings
                if f.reason != "backward_params"
                or getattr(items[f.item], "replayed_bad_params", None) is not None
            ]
        events: list[Event] = []
        buffer_events: list[Event] = []
        forward_bad = any(f.reason not in _BACKWARD for f in findings)
        # Modules that this step's non-finite values entered (their running statistics,
        # computed from their inputs, follow); not a module that made them from finite inputs.
        reached: set[int] = set()
        fed: set[int] = set()  # ...of them, those their own inputs brought them to (not origins)
        for f in findings:
            record = items[f.item]
            if (
                not f.is_origin
                and f.reason not in _BACKWARD
                and isinstance(record, ForwardRecord)
                and f.frame is not None
            ):
                fed.add(id(record.frames[f.frame].module))
            if f.reason in _BACKWARD or not isinstance(record, ForwardRecord) or record.in_eval:
                continue  # (an eval() forward updates no running statistics)
            if record.coarse and f.reason == "output" and record.frames:
                # (Only the model's outputs were seen, and a replay did not make them again:
                # any module inside may have been reached, the forward's weights since put
                # back (SAM's perturbed second forward).)
                reached.update(id(m) for m in record.frames[0].module.modules())
            frame = f.consumer if f.is_origin else f.frame
            if frame is not None:
                reached.add(id(record.frames[frame].module))
            if f.is_origin and f.reason == "output" and f.frame is not None:
                # The module that made them: its running statistics, updated from the same
                # batch, went with its output, when they were finite after the step before
                # (swept then, or probed at every step's end), or hold the NaN it made now
                # (not a +Inf an earlier overflowing batch left, which its output hid).
                module = record.frames[f.frame].module
                if (
                    isinstance(module, _BATCH_STATS_NORMS)
                    and module.training
                    and (
                        self._prior_sweep == step - 1
                        or any(
                            o.owner is module and self._probed_each_step(o)
                            for o in self._stats_owned
                        )
                        or (f.kind == "nan" and _running_stats_nan(module))
                    )
                ):
                    reached.add(id(module))
            if (
                f.is_origin
                and f.reason in ("output", "own_code")
                and f.frame is not None
                and any(
                    owner == id(record.frames[f.frame].module)
                    for owner, _ in self._recorder.buffer_updaters
                )
            ):
                # The module whose forward made them also writes buffers in place (a
                # hand-written batch norm's statistics, a MoCo queue): from the same values.
                reached.add(id(record.frames[f.frame].module))
        # Where each module was first called in the step's forwards: a weight its forward
        # wrote from values an earlier weight made non-finite is that one's doing.
        called: dict[int, tuple[int, int]] = {}
        for n, item in enumerate(items):
            if isinstance(item, ForwardRecord):
                for i, call in enumerate(item.frames):
                    called.setdefault(id(call.module), (n, i))
        written_first: tuple[int, int] | None = None  # the first weight told written so
        renaming = self._renaming
        bad_grad_names = {
            renaming.get(name, name) for name in (self.params.params[i][0].name for i in bad_grads)
        }
        watched = {
            id(frame.module)
            for item in items
            if isinstance(item, ForwardRecord)
            for frame in item.frames
        }
        poisoned: list[str] = []  # running statistics this step's bad forward updated
        weight_names = {o.name for o, _ in self.params.params}
        # Weights found non-finite before, or now with non-finite gradients to explain them:
        # what a weight not trained copies from (an EMA, a momentum encoder).
        known_bad = set(self._bad_params) | {
            owned.name
            for owned, tensor, _ in corrupted
            if tensor.requires_grad
            and (
                owned.name in self._last_bad_grads
                or owned.name in self._bad_grads_since
                or owned.name in bad_grad_names
            )
        }
        # (Trained ones first: a copy is told after what it copied.)
        corrupted = sorted(corrupted, key=lambda c: not c[1].requires_grad)
        # Another optimizer than optimizer= that moved them in this step, with no origin
        # found: named once, as the origin (SAC's critic optimizer applying the gradients
        # of a loss nanguard did not see).
        # (An origin found before that optimizer stepped explains them; one after it, a loss
        # computed through the weights it wrote, does not.)
        stepper_told: bool | str = not self.foreign_steppers or any(
            f.is_origin and getattr(items[f.item], "updates", 0) < self._recorder.updates
            for f in findings
        )
        checked_before_update = any(
            isinstance(item, LossRecord) and item.updates < self._recorder.updates for item in items
        )
        # (Weights reported non-finite at an earlier step: this step's forwards computed
        # with them, and whatever another optimizer applied follows from that origin.)
        # (Still non-finite now: a checkpoint reloaded since made them finite again.)
        reported_before = any(o.name in self._bad_params for o, _, _ in corrupted)
        for owned, tensor, exact in corrupted:
            if owned.name in self._bad_params:
                continue
            self._bad_params.add(owned.name)
            if owned.local in owned.owner._parameters:
                # (Its gradient was non-finite at an earlier step, told then: whichever
                # optimizer applied it, the update is that origin's, below.)
                stepper = (
                    None
                    if stepper_told is True
                    or reported_before
                    or owned.name in self._last_bad_grads
                    or owned.name in self._bad_grads_since
                    else self._foreign_stepper(tensor)
                )
                if stepper is not None:
                    # (the first one named as the origin, the others it moved as propagated)
                    told, stepper_told = stepper_told, stepper
                    quiet = None if told else stepper
                    name, _, lr = stepper.partition(" with ")
                    # (the others it moved with a non-finite learning rate: propagated from it)
                    said = f"{name}'s {lr.removeprefix('the ')}" if told and lr else None
                    event = self._param_event(
                        owned, tensor, exact, step, now, bool(told), step, stepper=quiet, rate=said
                    )
                    if (
                        quiet is not None
                        and not lr
                        and owned.name in bad_grad_names
                        and checked_before_update
                    ):
                        # This step's backward made the gradient it applied (the guard saw it,
                        # too late), of a loss checked before that optimizer stepped: not a
                        # loss of that optimizer's own (SAC's critic loss, not checked).
                        order = (
                            f"{name}.step() ran before the guard's optimizer= and applied this "
                            "step's non-finite gradient, made by this step's backward, before "
                            "nanguard's check (made before optimizer='s step only): pass the "
                            "optimizer that steps first as optimizer=, or step the guarded one "
                            "first; the backward's origin is then found before any update."
                        )
                        event = dataclasses.replace(
                            event,
                            message=f"{event.message.split(': the likely writer')[0]}. {order}",
                            hint=order,
                            details={**event.details, "reason": "stepped_first"},
                        )
                        self.stepped_first.add(owned.name)
                    events.append(event)
                    continue
                # Changed by an optimizer step; non-finite gradients (or a non-finite
                # forward) before that step explain it (then it is not an origin).
                if stale_steps and (owned.name in bad_grad_names or forward_bad):
                    when = max(stale_steps)  # updated after this resolution's forwards
                    events.append(
                        self._param_event(owned, tensor, exact, when + 1, now, True, when)
                    )
                    continue
                earlier = self._bad_grads_since.get(owned.name)
                caused = owned.name in self._last_bad_grads or earlier is not None
                moved_by = self._bad_rates.pop(id(tensor), None)
                if not caused and moved_by is not None:
                    # (moved with the non-finite learning rate reported at its step)
                    when, rate = moved_by
                    events.append(
                        self._param_event(owned, tensor, exact, step, now, True, when, rate=rate)
                    )
                    continue
                # (A weight loaded non-finite is the checkpoint's, whatever reached it; one an
                # optimizer step may have made is not a forward's.)
                first_call = (
                    called.get(id(owned.owner))
                    if owned.name not in self._nan_at_attach and self._recorder.updates == 0
                    else None
                )
                if (
                    not caused
                    and written_first is not None
                    and first_call is not None
                    and first_call > written_first
                    and id(owned.owner) in fed
                ):
                    # Written by its forward from the NaN that reached it (propagated).
                    events.append(
                        self._param_event(owned, tensor, exact, step, now, True, step, fed=True)
                    )
                    continue
                if not caused and not tensor.requires_grad and known_bad - {owned.name}:
                    # Not trained, and after other weights went non-finite: an EMA or
                    # momentum update in this step's forward copied their NaN (propagated).
                    events.append(
                        self._param_event(owned, tensor, exact, step, now, True, step, copied=True)
                    )
                    continue
                if owned.name in self._nan_loaded:  # (the checkpoint's, loaded while watched)
                    events.append(
                        self._loaded_event(
                            owned, tensor, exact, self._nan_loaded.pop(owned.name), now
                        )
                    )
                    continue
                # (non-finite when the guard was attached: loaded so; finite then, and no
                # optimizer step since: written by the model's own forward)
                loaded = owned.name in self._nan_at_attach if self._attach_checked else None
                if first_call is not None and not caused:
                    written_first = min(written_first or first_call, first_call)
                events.append(
                    self._param_event(
                        owned,
                        tensor,
                        exact,
                        step,
                        now,
                        caused,
                        earlier if caused else None,
                        before=True if loaded else None,
                        written=loaded is False and self._recorder.updates == 0,
                    )
                )
            elif owned.name in self._nan_loaded:  # (a buffer: running statistics saved so)
                buffer_events.append(
                    self._loaded_event(owned, tensor, exact, self._nan_loaded.pop(owned.name), now)
                )
            else:
                # Buffers change in the forward of this step (running statistics).
                # (A module nanguard does not watch, excluded, cannot tell: the step's.)
                # One non-finite since before watch() began (a schedule's 0/0 computed in
                # __init__) was read by this forward, not written by it.
                caused = (
                    forward_bad
                    and not self._untouched_since_attach(owned.name, tensor)
                    and (id(owned.owner) in reached or id(owned.owner) not in watched)
                ) or (
                    # (An observer of a weight found non-finite before, which read it in this
                    # forward: quantization-aware training's fake-quantize statistics.)
                    owned.name not in self._nan_at_attach
                    and any(
                        owned.name.startswith(f"{bad.rpartition('.')[0]}.")
                        for bad in self._bad_params & weight_names
                        if "." in bad
                    )
                )
                # One a forward writes in place (an EMA codebook's embed_avg / cluster_size),
                # from finite values: the operation that wrote it, by a replay.
                in_forward = (
                    not caused
                    and (id(owned.owner), owned.local) in self._recorder.buffer_updaters
                    and owned.name not in self._nan_at_attach
                )
                op = self._buffer_writer(items, owned, exact) if in_forward else None
                if (
                    op is not None
                    and not exact & NAN
                    and any(isinstance(a, float) and math.isinf(a) for a in op.args)
                ):
                    # Written +/-inf on purpose (fill_(inf) before a scatter-min, a
                    # masked_fill): a mask or a sentinel, as such an activation is.
                    self._mask_buffers.add(owned.name)
                    self._bad_params.discard(owned.name)
                    self._updated_key = None  # (no longer probed at every step)
                    continue
                buffer_events.append(
                    self._param_event(
                        owned,
                        tensor,
                        exact,
                        step + 1,
                        now,
                        caused,
                        before=owned.name in self._nan_at_attach,
                        in_forward=in_forward,
                        writer=op,
                    )
                )
                if caused:
                    poisoned.append(owned.name)
        events, buffer_events = self._capped(events, now), self._capped(buffer_events, now)
        has_origin = any(e.is_origin for e in events + buffer_events) or any(
            f.is_origin and not _already(items[f.item], f) for f in findings
        )
        if amp_skipped:
            # GradScaler skips this step: overflowing gradients are expected, not origins.
            findings = [f for f in findings if f.reason not in _BACKWARD]
            bad_grads = {}
        self._bad_grads_since.clear()  # (this resolution swept every weight)
        left_over = self._left_over(bad_grads) if step_grads else None
        if step_grads:
            # (the gradient tensors found non-finite: still the same ones at the next step's
            # end when nobody zeroed them)
            self._bad_grad_refs = {
                id(p): weakref.ref(p.grad)
                for p in (self.params.params[i][1] for i in bad_grads)
                if p.grad is not None
            }
            self._bad_grad_refs_step = step if left_over is None else left_over
            self._last_bad_grads = {self.params.params[i][0].name for i in bad_grads}
            for name in self._last_bad_grads:
                self._bad_grads_since.setdefault(name, step)
        found = self._findings_events(
            items, findings, flags, upstream_any=bool(corrupted_modules), now=now
        )
        # No backward through a checked forward of the model was seen in this step: the
        # gradients came from elsewhere (torch.func's vmap(grad(...)), written to .grad).
        unseen_backward = (
            self._recorder.backward_mode != "off"
            and self._recorder.training_forwards == 0
            and not any(isinstance(item, ForwardRecord) and item.grads for item in items)
            # ...and the model did run inside torch.func in it (not merely unseen: a method
            # called in sentinel mode, a compile wrapper made after watch()).
            and any(isinstance(item, ForwardRecord) and item.unchecked_outputs for item in items)
        )
        # The model's modules also ran inside torch.func transforms in a training step (a
        # Jacobian term: vmap(jacrev(encoder))): derivatives nanguard does not see.
        transformed = _ran_transformed(items)
        explained = has_origin or bool(corrupted) or bool(findings) or self._origin_step == step
        if bad_grads and self._stale_only(bad_grads):
            found.append(self._stale_grads_event(bad_grads, step, now))
        elif bad_grads and external and left_over is not None and not corrupted:
            found.append(self._left_over_event(bad_grads, step, left_over, now))
        elif (
            bad_grads
            and (external or (transformed and not explained and not unseen_backward))
            and not corrupted
        ):
            double = any(isinstance(item, ForwardRecord) and item.double_backward for item in items)
            coarse = any(
                isinstance(item, ForwardRecord) and (item.coarse or item.replaces is not None)
                for item in items
            )
            event = self._external_grads_event(
                bad_grads,
                step,
                now,
                double,
                sharded=sharded,
                transformed=transformed,
                coarse=coarse,
            )
            if event.details.get("reason") == "external":
                event = self._through_stored(event, items)
            found.append(event)
        elif bad_grads and unseen_backward and not corrupted and not found:
            found.append(self._external_grads_event(bad_grads, step, now, False, unseen=True))
        elif bad_grads:
            # (An origin this step, resolved earlier by guard.check(), explains them too.)
            # A module's backward that made its own parameters' gradients non-finite from a
            # finite incoming one (a sqrt(gamma) gate at 0): other modules' may be theirs as
            # well (the same gate in every block; only the first backward is replayed).
            own = {
                record.frames[f.frame].name
                for f in findings
                if f.is_origin
                and f.reason == "backward_params"
                and f.frame is not None
                and isinstance(record := items[f.item], ForwardRecord)
            }
            found.extend(self._grad_events(bad_grads, step, explained, now, nan_clip, items, own))
        if not any(e.is_origin for e in found) and len(found) > 1:
            found = [self._summary_event(found, step, bool(corrupted), now)]
        events.extend(found)
        events.extend(buffer_events)
        events = self._note_poisoned_stats(events, poisoned)
        events = self._derivative_origin(items, events, step, now)
        events = self._stored_origin(items, events, step, now)
        events = self._carried_inputs(items, events, step)
        if step_grads:  # (a training step's end)
            events = self._carried_across(items, events, step)
        # (Weights gone bad are no dropped batch's; running statistics its forward wrote,
        # skip_step puts back.)
        weights_bad = any(owned.local in owned.owner._parameters for owned, _, _ in corrupted)
        origin = any(e.is_origin for e in events)
        # Only validation batches run without no_grad() went non-finite: not the training
        # step's (its update goes ahead: skip_step keeps it, "raise" after it).
        self.eval_only = origin and all(
            e.details.get("eval_without_backward") for e in events if e.is_origin
        )
        self.loop_dropped = (
            origin
            and step_grads
            and not bad_grads
            and not weights_bad
            and not self.eval_only
            and _dropped_by_loop(items, flags, discarded)
        )
        bad = bool(bad_grads) or (origin and not self.loop_dropped and not self.eval_only)
        return self._step_capped(events, step, now), bad

    def _carried_inputs(self, items: list[Item], events: list[Event], step: int) -> list[Event]:
        """A loop that feeds the model's output back (a diffusion sampler, an unrolled
        recurrence under no_grad) carries one bad value into every later call: a
        non-finite batch given to the call right after one that went non-finite, with the
        shape of that call's outputs and non-finite in some of the same samples, is carried
        on, not a new origin (a corrupt validation batch is one, even right after another)."""
        last = self._fed_back
        records = [
            item.replaces or item
            for item in items
            if isinstance(item, ForwardRecord)  # (a sentinel replay: the call it stands for)
        ]
        kept = []
        for e in events:
            call = e.details.get("forward", 1)
            if (
                last is not None
                and last[:2] == (step, call - 1)
                and e.is_origin
                and e.phase == "input"
                and e.stats is not None
                and self._fed_from(records, e, last[2])
            ):
                e = dataclasses.replace(
                    e,
                    is_origin=False,
                    hint=None,
                    message=(
                        f"nanguard: step {step}: the batch given to call {call} of the model "
                        f"holds {kind_word(e.kind, e.stats)} ({e.stats.summary()}) in the "
                        "samples where the previous call's output did: carried on by the loop "
                        "between the calls (propagated, not an origin: see the step's origin)."
                    ),
                )
            elif (
                last is not None
                and last[:2] == (step, call - 1)
                and e.is_origin
                and e.phase in ("input", "forward")
            ):
                state = self._carried_state(records, call)
                if state is not None:
                    e = dataclasses.replace(
                        e,
                        is_origin=False,
                        hint=None,
                        message=(
                            f"nanguard: step {step}: call {call} of the model was given "
                            f"`{state}` again, the object the previous call (which went "
                            "non-finite) updated, and it holds NaN/Inf: carried on by the loop "
                            "(a KV cache, a recurrent state; propagated, not an origin: see the "
                            "step's origin)."
                        ),
                    )
            kept.append(e)
        if (
            len(kept) > 1
            and not any(e.is_origin for e in kept)
            and any(e.phase == "input" and e.details.get("forward", 1) > 1 for e in kept)
        ):  # (one event per carried call, not one per module it reached)
            kept = [e for e in kept if e.phase != "forward"]
        inference = [r for r in records if not r.grad]
        if kept and inference:  # (inference calls, each resolved as it returns)
            latest = max(inference, key=lambda r: r.number)
            self._fed_back = (step, latest.number, _bad_rows_of(latest.output_refs))
            self._fed_objects = [ref for _, _, ref in latest.given]
        return kept

    def _carried_across(self, items: list[Item], events: list[Event], step: int) -> list[Event]:
        """A recurrent state a module keeps across training steps (``self.hidden =
        h.detach()``, truncated BPTT) carries a NaN an earlier step made into every later
        one: a first forward's origin read from it (not from the batch) is that step's
        doing, not a new origin (neither a data-pipeline nor an own-code one)."""
        if self._origin_told_step < 0:
            return events
        first = next(
            (i for i in items if isinstance(i, ForwardRecord) and i.grad and i.frames), None
        )
        if first is None:
            return events
        since = self._origin_told_step
        state: str | bool | None = False  # (not looked for yet: exact reads, only if needed)
        kept = []
        for e in events:
            if (
                e.is_origin
                and e.details.get("forward", 1) == 1
                and e.phase in ("input", "forward")
                and not (e.tensor or "").startswith(("args[0]", "kwargs"))
            ):
                if state is False:
                    state = _nonfinite_attribute(first)
                if isinstance(state, str):
                    advice = (
                        f" The weights {self._bad_weights()} are non-finite too: resetting the "
                        "state will not help, training cannot recover by itself. Reload a "
                        "checkpoint (on_nonfinite='raise' or 'skip_step' stop the update that "
                        "applies non-finite gradients)."
                        if self._bad_params
                        else " After a failed or skipped step, reset that state (self.hidden "
                        "= None)."
                    )
                    if self._bad_params:
                        self._dead_told = True
                    e = dataclasses.replace(
                        e,
                        is_origin=False,
                        hint=None,
                        details={**e.details, "reason": "carried_state", "origin_step": since},
                        message=(
                            f"nanguard: step {step}: the `{state}` the model read holds "
                            f"{kind_word(e.kind, e.stats)}"
                            + (f" ({e.stats.summary()})" if e.stats is not None else "")
                            + ": the recurrent state an earlier step left non-finite (the "
                            f"origin at step {since}), carried into this step (propagated, "
                            f"not an origin; this step's batch is not).{advice}"
                        ),
                    )
            kept.append(e)
        return kept

    def _carried_state(self, records: list[ForwardRecord], call: int) -> str | None:
        """The label of an object given to call ``call`` that was given to the previous call
        too (which went non-finite) and now holds a non-finite tensor: state the model
        updates in place and the loop hands back (``generate()``'s KV cache). Exact; failure
        path only."""
        previous = {id(o) for o in (ref() for ref in self._fed_objects) if o is not None}
        if not previous:
            return None
        record = next((r for r in records if r.number == call), None)
        if record is None or record.replay is None:
            return None
        kept = record.replay
        for where, key, ref in record.given:
            if id(ref()) not in previous:
                continue
            try:  # (the copy kept for a replay: the object as the call got it)
                obj = kept.args[key] if where == "args" else kept.kwargs[key]
            except (IndexError, KeyError, TypeError):
                continue
            found: list[tuple[Path, Tensor]] = []
            collect(obj, (where, key), found, objects=True)
            if any(
                (t.is_floating_point() or t.is_complex()) and flags_of_tensor(t) for _, t in found
            ):
                return input_label((where, key))
        return None

    @staticmethod
    def _fed_from(
        records: list[ForwardRecord], event: Event, previous: dict[tuple[int, ...], set[int]]
    ) -> bool:
        """Whether the event's batch has the shape of the previous call's outputs, and is
        non-finite in samples where they were."""
        assert event.stats is not None
        shape = tuple(event.stats.shape)
        # (The outputs' shapes as probed, or as returned: a passthrough Flatten last returns
        # a view of the site it was given.)
        if shape not in previous and not any(shape in r.previous_outputs for r in records):
            return False
        rows = previous.get(shape)
        if rows is None:
            return True  # (the outputs are gone: the shape is all there is)
        for r in records:
            if r.replay is None:
                continue
            found: list[tuple[Path, Tensor]] = []
            collect(r.replay.args, ("args",), found, objects=True)
            collect(r.replay.kwargs, ("kwargs",), found, objects=True)
            for _, t in found:
                if tuple(t.shape) == shape and t.is_floating_point():
                    bad = _bad_rows(t)
                    if bad:  # (a sampler mixing samples, classifier-free guidance: overlap)
                        return bool(bad & rows)
        return True

    def _step_capped(self, events: list[Event], step: int, now: float) -> list[Event]:
        """At most a few origins and a few propagated events per step, then one event for
        the rest: a step of many forwards (MAML's inner loops, a tree search) would log each
        forward's findings otherwise."""
        origins_left = _STEP_ORIGINS
        others_left = _STEP_OTHERS + 3 * max(0, self._options.max_propagated - 3)
        kept: list[Event] = []
        rest: list[Event] = []
        for event in events:
            if event.is_origin and origins_left > 0:
                origins_left -= 1
                kept.append(event)
            elif not event.is_origin and others_left > 0:
                others_left -= 1
                kept.append(event)
            else:
                rest.append(event)
        if not rest:
            return events
        by_phase: dict[str, int] = {}
        for event in rest:
            by_phase[event.phase] = by_phase.get(event.phase, 0) + 1
        counts = ", ".join(f"{n} {phase}" for phase, n in by_phase.items())
        # (an origin's cause made again in a later forward counts as that forward's origin)
        origins = sum(e.is_origin or e.details.get("reason") == "made_again" for e in rest)
        also = f", {origins} of them origins in later forwards of the step" if origins else ""
        kept.append(
            self._event(
                step=step,
                phase=rest[0].phase,
                module=None,
                module_type=None,
                kind="nan" if any(e.kind == "nan" for e in rest) else rest[0].kind,
                is_origin=False,
                message=(
                    f"nanguard: step {step}: {len(rest)} more findings in this step are not "
                    f"reported one by one ({counts}{also}); the first origin above is where "
                    "it began."
                ),
                time=now,
                details={"more": len(rest), "by_phase": by_phase, "origins": origins},
            )
        )
        return kept

    def sweep_soon(self) -> None:
        """Sweep the parameters at the next resolution."""
        self._sweep_soon = True

    def step_ended(self) -> None:
        """Forget what only the step that ended needed."""
        self.foreign_steppers.clear()
        self.stepped_first.clear()
        if self._told_inputs[1]:
            self._told_inputs = (-1, {})

    def _told_input(self, item: Item, f: Finding) -> bool:
        """Whether the batch of an input origin was reported earlier in this step, given
        to an earlier call that a resolution of its own told (LBFGS calls its closure on
        one batch again after the first call was resolved); remembers it otherwise."""
        if not isinstance(item, ForwardRecord) or item.replay is None:
            return False
        tensor = self._input_tensor(item, item.sites[f.site].path)
        if tensor is None:
            return False
        step, told = self._told_inputs
        if step != item.step:
            told = {}
            self._told_inputs = (item.step, told)
        key = (id(tensor), _grad_version(tensor))  # (-1 for an inference tensor)
        if key in told and told[key] is tensor:
            return True
        told[key] = tensor  # (held until the step ends, step_ended(): its id stays its own)
        return False

    def _stored_op(self, items: list[Item], module: nn.Module, kind: str) -> OpInfo | None:
        """The operation in ``module``'s code that made the value it stored: one replay of
        the step's latest forward that ran it (``None`` if none can be replayed)."""
        if not self._options.replay:
            return None
        for item in reversed(items):
            if not isinstance(item, ForwardRecord) or item.replay is None:
                continue
            record = item.replaces or item
            ran = (
                any(m is module for m in record.frames[0].module.modules())
                if record.coarse
                else any(frame.module is module for frame in record.frames)
            )
            if ran:
                return replay(self._recorder, record, frozenset(), watch=(module, kind)).op
        return None

    def _stored_origin(
        self, items: list[Item], events: list[Event], step: int, now: float
    ) -> list[Event]:
        """A loss origin whose NaN a module kept aside: an auxiliary loss its forward stored
        as an attribute (``self.aux_loss``, ``self.kl``) for the training loop to add. The
        module made it, not the loss function. Likewise a forward origin whose own code
        made nothing (no operation found): the model's forward adding the auxiliary losses
        its submodules stored to the loss it returns."""
        at = next((i for i, e in enumerate(events) if e.is_origin), None)
        if at is None:
            return events
        names = self._options.names
        first = events[at]
        scope: set[int] | None = None  # (the modules that may have stored it: any, for a loss)
        if first.phase == "forward" and first.op is None and first.module is not None:
            owner = next(
                (m for n, m in module_names(self._model) if names.get(m, n) == first.module), None
            )
            if owner is None or first.details.get("reason") not in ("output", "own_code"):
                return events
            scope = {id(m) for m in owner.modules() if m is not owner}
        elif first.phase != "loss":
            return events
        called = {
            id(frame.module)
            for item in items
            if isinstance(item, ForwardRecord) and not item.coarse
            for frame in item.frames
        }
        watched = bool(called)  # (a sentinel step saw the model's own call only)
        # What the loss became: NaN from NaN, +Inf from +Inf (a cached -inf score mask is no
        # auxiliary loss; a single -Inf value is: log(p) at p = 0).
        wanted = NAN if events[at].kind == "nan" else POSINF | NAN
        for name, module in module_names(self._model):
            for attribute, value in vars(module).items():
                if (
                    not isinstance(value, Tensor)
                    or value.grad_fn is None  # (made in a forward, with autograd)
                    or not (value.is_floating_point() or value.is_complex())
                ):
                    continue
                key = (id(value), _grad_version(value))
                if scope is not None and id(module) not in scope:
                    continue
                if key in self._stored_seen or (watched and id(module) not in called):
                    continue  # (blamed in an earlier step, or the module did not run in this)
                with torch.no_grad():
                    scalar = wanted != NAN and value.numel() == 1
                    if not flags_of_tensor(value) & (wanted | NEGINF if scalar else wanted):
                        continue
                    if scope is None and not _loss_uses(items, value):
                        continue  # (kept aside, but not in the loss: a term switched off)
                    stats = tensor_stats(value)
                self._stored_seen.add(key)
                display = names.get(module, name)
                loss = events[at]
                kind = "nan" if stats.nan_count else "inf"
                op = self._stored_op(items, module, kind)
                user = "the loss" if scope is None else _value_of(first)
                message = stored_message(
                    step, display, type(module).__name__, attribute, stats, loss.kind, op, user
                )
                hint_text = self._hint(
                    None, phase="forward", kind=kind, reason="output",
                    module_type=type(module).__name__, stats=stats, step=step, op=op,
                    module=module,
                )  # fmt: skip
                origin = Event(
                    step=step, phase="forward", module=display,
                    module_type=type(module).__name__, param=None, kind=kind, is_origin=True,
                    stats=stats, rank=loss.rank, message=message, tensor=f"self.{attribute}",
                    op=None if op is None else op.name, source=None if op is None else op.source,
                    reproducible=True if op is not None else None,
                    hint=hint_text, details={"reason": "stored"}, time=now,
                )  # fmt: skip
                return _loss_made_elsewhere(
                    events,
                    at,
                    origin,
                    f"built on `self.{attribute}` of {display or 'the model'}",
                    subject=user,
                )
        return events

    def _derivative_origin(
        self, items: list[Item], events: list[Event], step: int, now: float
    ) -> list[Event]:
        """A loss origin whose loss was built on a derivative taken through the model
        (``torch.autograd.grad(u, x, create_graph=True)``: a PINN residual, forces from an
        energy): the model's outputs were finite, but its backward may have made the NaN.
        Replaying that backward with the gradient it was given tells: then the module whose
        backward made it is the origin, and the loss only propagated it."""
        at = next((i for i, e in enumerate(events) if e.is_origin), None)
        if at is None or events[at].phase != "loss" or not self._options.replay:
            return events
        for index, item in enumerate(items):
            if not isinstance(item, ForwardRecord) or not item.double_backward:
                continue
            given = item.__dict__.get("derivative_grads")
            if not given:
                continue
            with torch.no_grad():
                if any(flags_of_tensor(g) for g in given.values()):
                    continue
            kept, item.output_grads = item.output_grads, dict(given)
            try:
                result = replay(self._recorder, item, backward=True, watch=(-1, "grad"))
            finally:
                item.output_grads = kept
            record = result.record
            if record is None or not (any(fl for _, fl in result.grad_events) or result.bad_params):
                continue
            bad = result.bad_params or frozenset()
            frames = record.frames

            def bad_params(
                i: int, tied: bool = True, bad: frozenset[int] = bad, frames: list[Any] = frames
            ) -> bool:
                return any(id(p) in bad for p in frames[i].module.parameters(recurse=False))

            if result.backward_op is not None:  # (which call made its node: see _made_in)
                record.ops[-1] = result.backward_op
            found, _ = analyze_backward(record, result.grad_events, index, bad_params, False)
            if found is None or found.frame is None or found.reason == "loss_backward":
                continue
            frame = frames[found.frame]
            op = result.backward_op
            stats = result.grad_stats.get(found.site) if found.site >= 0 else None
            kind = _exact_kind(found.kind, stats)
            label = site_label(record.sites[found.site]) if found.site >= 0 else "parameters"
            tensor = f"grad of {label}"
            hint_text = self._hint(
                found, phase="backward", kind=kind, reason=found.reason,
                module_type=frame.type_name, stats=stats, op=op, step=step,
            )  # fmt: skip
            message = backward_message(
                step=step, reason=found.reason, kind=kind, module=frame.name,
                module_type=frame.type_name, call=frame.call, tensor=tensor, stats=stats,
                params=(), propagated=(), n_propagated=0, problem=None, op=op,
                hint=hint_text, reproducible=True,
            )  # fmt: skip
            message += (
                " That backward ran inside torch.autograd.grad(..., create_graph=True): a "
                "derivative taken through the model (a PINN residual, forces from an energy), "
                "and the loss built on it became non-finite."
            )
            details: dict[str, Any] = {"reason": "derivative"}
            if getattr(item, "number", 1) > 1:  # (as a forward origin says which forward)
                details["forward"] = item.number
                message += f" (It was forward {item.number} of the step.)"
            loss = events[at]
            origin = Event(
                step=step, phase="backward", module=frame.name, module_type=frame.type_name,
                param=None, kind=kind, is_origin=True, stats=stats, rank=loss.rank,
                message=message, call=frame.call, tensor=tensor,
                op=None if op is None else f"{op.name} in {op.node}" if op.node else op.name,
                source=None if op is None else op.source, reproducible=True, hint=hint_text,
                details=details, time=now,
            )  # fmt: skip
            where = f"the backward of `{frame.name or 'the model'}`"
            return _loss_made_elsewhere(
                events, at, origin, f"made from a derivative through the model that {where} made "
                "non-finite", where
            )  # fmt: skip
        if any(isinstance(item, ForwardRecord) and item.double_backward for item in items):
            # (A first derivative replayed finite, or none kept: a higher one, a Laplacian's
            # u_xx, differentiates the first's backward, which a replay does not rerun.)
            message = events[at].message.replace(
                ": the loss function created it",
                ": the loss function, or the derivatives through the model that it is built on "
                "(see below), created it",
                1,
            )
            loss = dataclasses.replace(events[at], message=message + _LOSS_ON_DERIVATIVES)
            events = [*events[:at], loss, *events[at + 1 :]]
        return events

    def _note_poisoned_stats(self, events: list[Event], poisoned: list[str]) -> list[Event]:
        """The origin's message also names the running statistics its step made non-finite:
        they outlive the step (a raise stops before the weights move, not the buffers), and
        every eval() forward will use them. (skip_step puts back those a training step
        wrote, and says so; not those of a forward with gradients off.)"""
        training = self._step_trains
        if not poisoned or (self._options.on_nonfinite == "skip_step" and training):
            return events
        at = next((i for i, e in enumerate(events) if e.is_origin), None)
        if at is None or events[at].phase == "param":
            return events  # (weights already bad: loaded with them, perhaps, not written)
        listed = ", ".join(f"`{p}`" for p in poisoned[:4])
        more = f" and {len(poisoned) - 4} more" if len(poisoned) > 4 else ""
        skip = (
            " (skip_step puts back what a training step wrote, not this)"
            if self._options.on_nonfinite == "skip_step"
            else ""
        )
        note = (
            f" This step's forward also wrote non-finite values into the running statistics "
            f"{listed}{more}: they stay so after the step, and eval() outputs will be "
            "non-finite until they are reloaded from a checkpoint (or reset with "
            "reset_running_stats() and re-estimated)."
            if training
            else f" This forward (gradients off, its norms in train() mode: a validation pass "
            f"without model.eval()?) also wrote non-finite values into the running statistics "
            f"{listed}{more}: they stay so{skip}, and eval() outputs will be non-finite until "
            "they are reloaded from a checkpoint (or reset with reset_running_stats() and "
            "re-estimated)."
        )
        origin = events[at]
        events = list(events)
        events[at] = dataclasses.replace(origin, message=origin.message + note)
        return events

    def buffers_restored(self, names: list[str]) -> None:
        """Buffers put back as they were (a skipped step): finite again, so a later sweep
        that finds them non-finite reports them anew."""
        self._bad_params.difference_update(names)

    def step_skipped(self, step: int) -> None:
        """The optimizer update of ``step`` was dropped: its bad gradients reached no weight."""
        self._bad_grads_since = {k: v for k, v in self._bad_grads_since.items() if v != step}
        self._last_bad_grads = set()

    def _bad_weights(self) -> str:
        """The weights reported non-finite, named: "`a`, `b`, `c` and 2 more"."""
        bad = sorted(self._bad_params)
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        return ", ".join(f"`{n}`" for n in bad[:3]) + more

    def _latest_origin(self) -> str:
        if self._origin_told_step >= 0 and self.origin_by is not None:
            return (
                f"the origin in {self.origin_by}, watched by another guard, that this guard's "
                f"step {self._origin_told_step} pointed at"
            )
        return (
            f"the origin at step {self._origin_told_step}"
            if self._origin_told_step >= 0
            else "the earlier origin"
        )

    def other_rank_event(self, step: int) -> Event:
        """``"raise"`` with data parallelism: another rank found a non-finite value in this
        step and stops; this one, which found none, stops with it."""
        return self._event(
            step=step,
            phase="grad",
            module=None,
            module_type=None,
            kind="nan",
            is_origin=False,
            message=(
                f"nanguard: step {step}: another rank found a non-finite value in this step "
                "(its guard reports the origin) and stops: this rank, whose step was finite, "
                "stops with it, before optimizer.step(), so that no rank waits for the others "
                "in the next all-reduce and the replicas stay equal."
            ),
            time=time.time(),
            details={"reason": "other_rank"},
        )

    def held_back_event(self, step: int, events: list[Event]) -> Event:
        """``on_nonfinite="raise"``: a step whose gradients are non-finite with no new origin
        (values already bad since an earlier one, the raise caught and training continued)
        is stopped too, before ``optimizer.step()`` applies them."""
        kind = "nan" if any(e.kind == "nan" for e in events) or not events else events[0].kind
        weights = (
            f"; the weights themselves are non-finite ({self._bad_weights()}): reload a checkpoint"
            if self._bad_params
            else ""
        )
        return self._event(
            step=step,
            phase="grad",
            module=None,
            module_type=None,
            kind=kind,
            is_origin=False,
            message=(
                f"nanguard: step {step}: the gradients are {'NaN' if kind == 'nan' else 'Inf'} "
                f"again, carried from values already non-finite since {self._latest_origin()} "
                f"(no new origin){weights}"
                ". on_nonfinite='raise' stops here, before optimizer.step() applies them."
            ),
            tensor="gradients",
            time=time.time(),
            details={"reason": "held_back", "origin_step": self._origin_told_step},
        )

    def _summary_event(self, events: list[Event], step: int, corrupted: bool, now: float) -> Event:
        """One event for a step in which nothing new went non-finite."""
        phases: dict[str, int] = {}
        for event in events:
            phases[event.phase] = phases.get(event.phase, 0) + 1
        parts = []
        for phase, label in (
            ("input", "the input"),
            ("forward", "forward module call"),
            ("loss", "the loss"),
            ("backward", "backward module call"),
            ("grad", "parameter gradient"),
        ):
            n = phases.get(phase, 0)
            if n and phase in ("input", "loss"):
                parts.append(label)
            elif n:
                parts.append(f"{n} {label}{'s' if n > 1 else ''}")
        buffers = {owned.name for owned in self.params.buffers}
        only_buffers = bool(self._bad_params) and buffers.issuperset(self._bad_params)
        source = (
            "running statistics that were already non-finite"
            if corrupted and only_buffers
            else "parameters that were already non-finite"
            if corrupted
            else "values that were already non-finite"
        )
        first = events[0]
        kind = "nan" if any(e.kind == "nan" for e in events) else first.kind
        details: dict[str, Any] = {"summary": phases}
        dead = ""
        if corrupted and only_buffers:
            # Only running statistics: a training forward does not read them, eval() does.
            if not self._dead_told:
                self._dead_told = True
                details["weights_nonfinite"] = sorted(self._bad_params)
                stats_only = all(
                    name.rpartition(".")[2] in _RUNNING_STATS for name in self._bad_params
                )
                dead = (
                    f" The buffers {self._bad_weights()} are non-finite: eval() forwards read "
                    "them (training-mode ones do not), so evaluation stays non-finite until "
                    "they are reloaded from a checkpoint, or reset with reset_running_stats() "
                    "and re-estimated."
                    if stats_only
                    else f" The buffers {self._bad_weights()} are non-finite, and every forward "
                    "that reads them (a queue of negatives, a running normaliser) is too until "
                    "they are reset or reloaded from a checkpoint."
                )
        elif corrupted and self._bad_params and not self._dead_told:
            # Once, at a warning's level: the run is not recovering by itself.
            self._dead_told = True
            details["weights_nonfinite"] = sorted(self._bad_params)
            stop = (
                "on_nonfinite='skip_step' drops an update whose gradients are non-finite only "
                "where they are read: backward=False with grad_norm=False reads none"
                if self._options.on_nonfinite == "skip_step" and not self._watch_grads
                # (optimizer= ends the step before its update: the update itself made them.)
                else "on_nonfinite='skip_step' drops an update whose gradients are non-finite; "
                "this one made the weights non-finite from finite gradients (the optimizer's own "
                "arithmetic, as the origin says), which no check before it can see"
                if self._options.on_nonfinite == "skip_step" and self._options.optimizer is not None
                # (The policy is set, yet the update ran: the step was resolved after it.)
                else "on_nonfinite='skip_step' can only stop an update the step is resolved "
                "before: pass optimizer= to nanguard.watch(), or call guard.step() before "
                "optimizer.step()"
                if self._options.on_nonfinite == "skip_step"
                else "on_nonfinite='raise' or 'skip_step' stop the update that applies "
                "non-finite gradients"
            )
            dead = (
                f" The weights {self._bad_weights()} are non-finite, so every step from now on is: "
                f"training cannot recover by itself. Reload a checkpoint ({stop})."
            )
        return self._event(
            step=step,
            phase=first.phase,
            module=first.module,
            module_type=first.module_type,
            param=first.param,
            kind=kind,
            is_origin=False,
            message=(
                f"nanguard: step {step}: still non-finite, nothing new was created: "
                f"{', '.join(parts)} carried values downstream of {source} (see "
                f"{self._latest_origin()}).{dead}"
            ),
            tensor=first.tensor,
            time=now,
            details=details,
        )

    def resolve_partial(
        self,
        records: Sequence[Item],
        flags: list[list[int]],
        grads: list[list[tuple[int, int]]],
    ) -> Outcome:
        """``sync="module"``: resolve a record at once (the last of ``records``, after the
        forwards it may come from), from exact per-site flags."""
        items = list(records)
        findings = self._analyze(
            items,
            flags,
            grads,
            lambda i, f, tied=True: False,
            lambda i, f: False,
            lambda i: False,
        )
        record = items[-1]
        if (
            isinstance(record, ForwardRecord)
            and self._options.replay
            and -1 not in record.ops
            and any(f.is_origin and f.reason in _MODULE_BACKWARD for f in findings)
        ):
            # Inside the backward: a replay of this forward and of the backward from the
            # gradients that arrived at its outputs (a nested backward, as a reentrant
            # checkpoint's) finds the operation, as at the end of a step.
            self._find_backward_op(record)
        events = self._findings_events(items, findings, flags, upstream_any=False, now=time.time())
        # Weights already non-finite (found so, or given non-finite gradients by an earlier
        # step's update): a forward that reads them reveals nothing new (as a full step's
        # resolution says once), not an origin at every later forward.
        known = self._bad_params | self._last_bad_grads | set(self._bad_grads_since)
        for n, event in enumerate(events):
            bad = event.details.get("nonfinite_params")
            if event.is_origin and bad and known.issuperset(bad):
                events[n] = dataclasses.replace(
                    event,
                    is_origin=False,
                    hint=None,
                    details={**event.details, "reason": "known_weights"},
                    message=(
                        f"nanguard: step {event.step}: `{event.module or 'the model'}` "
                        f"({event.module_type}) made {'NaN' if event.kind == 'nan' else 'Inf'} "
                        f"from its own weights ({', '.join(f'`{b}`' for b in sorted(bad)[:3])}"
                        f"{' and more' if len(bad) > 3 else ''}), non-finite since an earlier "
                        f"step (see {self._latest_origin()}): nothing new."
                    ),
                )
        return Outcome(events, False)

    def _expand_coarse(
        self,
        items: list[Item],
        flags: list[list[int]],
        grad_flags: list[list[tuple[int, int]]],
        bad_param_grads: bool,
        reported: Collection[int] = (),
    ) -> None:
        """Sentinel steps and compiled models probed only the model's inputs and outputs:
        a failing one is replayed with every module checked exactly, and the replayed
        record (complete, with the same kind of findings as a full step) replaces it.

        When a forward already made NaN or +Inf at the model's outputs, or a loss is not
        finite, the backward only follows (as a full step's, see ``_localise_backward``):
        the forward alone is replayed, not the backward and every parameter's gradient.
        """
        follows = any(
            any(fl & (NAN | POSINF) for fl in flags[i])
            if isinstance(item, ForwardRecord)
            else any(flags[i])
            for i, item in enumerate(items)
        )
        loss_bad = any(
            isinstance(item, LossRecord) and any(flags[i]) for i, item in enumerate(items)
        )
        for index, item in enumerate(items):
            if not isinstance(item, ForwardRecord) or not item.coarse:
                continue
            forward_bad = any(flags[index])
            backward_bad = any(fl for _, fl in grad_flags[index])
            if (
                loss_bad
                and not forward_bad
                and self._options.replay
                and item.frames
                and (
                    _stores_nonfinite(items, item.frames[0].module)
                    # (or passes a mask on, its -inf unprobed: a log(0) of its own beside it)
                    or item.frames[0].hooked.passes_mask
                )
            ):
                # Finite outputs, a non-finite loss built on a tensor the forward kept aside
                # (an MoE's self.aux_loss): which module inside made it, the forward replayed
                # with every module checked tells, as a full step's probes do.
                result = replay(self._recorder, item, exact=True, backward=False)
                self._take_replay(items, flags, grad_flags, index, result, False, False)
                continue
            if item.raised is not None and not forward_bad:
                # The forward raised before returning anything to probe: its batch is checked
                # (a NaN observation a distribution's argument check refused), then, if that
                # is finite, the forward is replayed up to the error with every module
                # checked (a kernel matrix a zero lengthscale made NaN, which Cholesky
                # refuses as "not positive-definite").
                # An error about something else (an index, a shape) is replayed only on
                # evidence, a NaN in the batch: whether the model imputes it or not.
                self._check_kept_inputs(item, flags[index])
                bad_batch = any(flags[index])
                if not self._options.replay or bad_batch == item.raised_about:
                    continue
                result = replay(self._recorder, item, exact=True, backward=False)
                self._take_replay(items, flags, grad_flags, index, result, False, False)
                continue
            if not (forward_bad or backward_bad or (bad_param_grads and item.grad)):
                continue
            if not self._options.replay:
                continue
            if reported and any(id(m) in reported for m in item.frames[0].module.modules()):
                # Explained by weights already reported (see upstream()), but for a new bad
                # batch (told as in a full step, which probes it).
                if forward_bad:
                    self._check_kept_inputs(item, flags[index])
                continue
            wants_backward = bool(item.output_grads) and (backward_bad or bad_param_grads)
            backward = wants_backward and not follows
            result = replay(self._recorder, item, exact=True, backward=backward)
            if self._take_replay(
                items, flags, grad_flags, index, result, backward, bad_param_grads
            ):
                # The outputs were finite after all (their sums overflowed): the backward's turn.
                result = replay(self._recorder, item, exact=True, backward=True)
                self._take_replay(items, flags, grad_flags, index, result, True, bad_param_grads)

    def _take_replay(
        self,
        items: list[Item],
        flags: list[list[int]],
        grad_flags: list[list[tuple[int, int]]],
        index: int,
        result: ReplayResult,
        backward: bool,
        bad_param_grads: bool,
    ) -> bool:
        """Put a coarse record's replay in its place when it reproduced what the probes saw.
        Returns whether the backward still needs a replay: the outputs the probes flagged
        were finite (their sums overflowed)."""
        item = items[index]
        assert isinstance(item, ForwardRecord)
        forward_bad = any(flags[index])
        backward_bad = any(fl for _, fl in grad_flags[index])
        full = result.record
        if full is None:
            why = result.problem or "the replay failed"
            full_mode = (
                ' (mode="full" probes every module in the step itself, and names it)'
                if not self._recorder.compiled
                else ""
            )
            item.problems.setdefault(
                0,
                f"{why}; only the model's outputs were checked (sentinel mode, or a "
                f"compiled model), so the module inside that made it is unknown{full_mode}",
            )
            if forward_bad:
                self._check_kept_inputs(item, flags[index])
            return False
        full.step, full.replay, full.coarse = item.step, item.replay, False
        full.number = item.number
        full.replaces = item
        full.reported, full.reported_backward = item.reported, item.reported_backward
        pairs = list(zip(item.frames[0].outputs, full.frames[0].outputs, strict=False))
        full.output_grads = {
            new: item.output_grads[old] for old, new in pairs if old in item.output_grads
        }
        full.keep = set(full.output_grads)
        full.param_grads_finite = result.param_grads_finite
        full.replayed_bad_params = result.bad_params
        full.replayed_unseen = result.unseen_params
        full.double_backward = item.double_backward  # (the replay does not differentiate)
        given = item.__dict__.get("derivative_grads")
        if given:
            full.derivative_grads = {new: given[old] for old, new in pairs if old in given}
        full_flags = [full.exact.get(site, 0) for site in range(len(full.sites))]
        if not forward_bad and any(full_flags[o] for o in full.frames[0].outputs):
            # Its outputs were finite when it ran; the replay's are not: it read state
            # that changed since (running statistics a later forward of the step
            # poisoned, for an eval() forward). Not a faithful replay: keep the probes.
            return False
        # Reproduced: the replay made NaN/Inf where the step's probes saw it (the model's
        # outputs), not merely somewhere (a mask's -inf, written on purpose, is not it).
        flagged = [new for old, new in pairs if flags[index][old]]
        reproduced = any(full_flags[new] for new in flagged) if flagged else any(full_flags)
        if forward_bad and not reproduced and _overflowed_outputs(item, flags[index], full):
            # Huge finite outputs whose probe sum overflowed: no NaN/Inf in the forward.
            for _, new in pairs:
                self._note_output_peak(full.stats.get(new))
            flags[index] = [0] * len(flags[index])
            forward_bad = False
            if not (backward_bad or (bad_param_grads and item.grad)):
                return False
            if not backward and item.output_grads:
                return True
        if (forward_bad and not reproduced) or (
            backward
            and backward_bad
            and not forward_bad
            and not any(fl for _, fl in result.grad_events)
        ):
            first = next((site for site, fl in grad_flags[index] if fl), None)
            outputs = dict(pairs)
            if forward_bad or first is None or outputs.get(first) not in full.internal_outputs:
                item.unreproduced = True  # keep the coarse record: what the probes saw
            # (else the model's own share of an output's gradient, recomputed, is finite:
            # the loss's share made it, as the coarse record says)
            return False
        items[index] = full
        flags[index] = full_flags
        if backward:
            grad_flags[index] = list(result.grad_events)
        else:  # (the backward follows the forward: the gradients the model's outputs got,
            # and its inputs that carry gradients, as the probes saw them)
            outputs = dict(pairs)
            by_path = dict(zip(full.frames[0].input_paths, full.frames[0].inputs, strict=False))
            root = item.frames[0]
            for path, site in zip(root.input_paths, root.inputs, strict=False):
                if path in by_path and site not in outputs:
                    outputs[site] = by_path[path]
            grad_flags[index] = [(outputs[s], fl) for s, fl in grad_flags[index] if s in outputs]
        for site, stats in result.grad_stats.items():
            full.stats[~site] = stats
        return False

    @staticmethod
    def _check_kept_inputs(record: ForwardRecord, flags: list[int]) -> None:
        """A sentinel step that could not be replayed: check the inputs it kept (sentinel
        mode does not probe them, but for those carrying gradients), so that a bad batch is
        still told from a bad model."""
        info = record.replay
        if info is None or not record.frames:
            return
        if versions(info.args, info.kwargs) != info.versions:
            # Modified in place since the model got them (a reused input buffer, or the
            # model's own normalisation): not what it was given, which is what counts.
            return
        found: list[tuple[Path, Tensor]] = []
        collect(info.args, ("args",), found, objects=True)
        collect(info.kwargs, ("kwargs",), found, objects=True)
        root = record.frames[0]
        probed = set(root.input_paths)  # (the inputs carrying gradients: probed already)
        added: list[int] = []
        for path, tensor in found:
            if tensor.dtype not in CHECKED_DTYPES or tensor.is_meta or path in probed:
                continue
            try:
                exact = flags_of_tensor(tensor)
            except (RuntimeError, NotImplementedError):
                continue
            site = len(record.sites)
            record.sites.append(
                Site(0, "input", path, tensor.shape, tensor.dtype, len(record.values), 0)
            )
            flags.append(exact)
            root.inputs.append(site)
            root.input_paths.append(path)
            added.append(site)
            if exact:
                record.stats[site] = tensor_stats(tensor)
        record.order[:0] = added  # entering the model, before anything else

    def _internal_output_grads(
        self,
        items: list[Item],
        flags: list[list[int]],
        grad_flags: list[list[tuple[int, int]]],
        upstream: Callable[[int, int], bool],
        stale: Callable[[int], bool],
        known: Callable[[int, int], bool] = lambda item, frame: False,
    ) -> None:
        """Every module's gradients were probed; a bad one first seen at one of several
        model outputs may still be the model's own: replay the backward without the
        gradient kept there (which summed the loss's share and the model's own)."""
        if analyze(
            items,
            flags,
            self.is_mask_arg,
            upstream=upstream,
            stale=stale,
            known=known,
            replayed=self._options.replay,
        ):
            return  # the forward went non-finite already
        for index, item in enumerate(items):
            if not isinstance(item, ForwardRecord) or not item.grad or not item.frames:
                continue
            top_outputs = set(item.frames[0].outputs)
            first = next((site for site, fl in grad_flags[index] if fl), None)
            if first is None or first not in top_outputs or len(top_outputs) < 2:
                continue
            if any(first in f.inputs for f in item.frames):
                continue
            result = replay(self._recorder, item, backward=True, watch=(-1, "grad"))
            again = result.record
            if again is None or first not in again.internal_outputs:
                continue
            if any(fl for _, fl in result.grad_events):
                _take_output_uses(item, again)
                grad_flags[index] = result.grad_events
                for site, stats in result.grad_stats.items():
                    item.stats[~site] = stats
                if result.backward_op is not None:
                    item.ops[-1] = result.backward_op

    def _localise_backward(
        self,
        items: list[Item],
        flags: list[list[int]],
        grad_flags: list[list[tuple[int, int]]],
        bad_param_grads: bool,
        upstream: Callable[[int, int], bool],
        stale: Callable[[int], bool],
    ) -> bool:
        """Only the gradients crossing the model were probed: replay a step whose backward
        went non-finite inside the model, probing every module's gradients exactly.

        Returns whether the replays show that autograd made only finite gradients, every
        parameter's included, although ``.grad`` is not finite: then something changed the
        gradients afterwards (DDP's all-reduce bringing another rank's NaN, a hook).
        """
        # (Re-checked exactly: finite outputs too large for their probe's sum are no
        # forward origin, and leave the backward to be localised.)
        no_grads: list[list[tuple[int, int]]] = [[] for _ in items]
        forward = self._analyze(items, flags, no_grads, lambda *_, **__: False, upstream, stale)
        if forward:
            return False  # the forward went non-finite already: the backward only follows
        recomputed_finite: list[bool] = []
        for index, item in enumerate(items):
            if not isinstance(item, ForwardRecord) or not item.grad or item.reported_backward:
                continue
            top_outputs = set(item.frames[0].outputs) if item.frames else set()
            first = next((site for site, fl in grad_flags[index] if fl), None)
            used_inside = first is not None and any(first in f.inputs for f in item.frames)
            # With one output, the loss made a bad gradient there; with several, the
            # model's own code may have used it for another (seen by the replay).
            loss_made = first is not None and first in top_outputs and not used_inside
            if loss_made and len(top_outputs) < 2:
                return False  # made by the loss's backward: seen directly
            if first is None and not bad_param_grads:
                continue
            result = replay(self._recorder, item, backward=True, watch=(-1, "grad"))
            if loss_made and (
                result.record is None
                or first not in result.record.internal_outputs
                # The model's own share of that gradient, recomputed, is finite: the loss's
                # share was not.
                or not (any(fl for _, fl in result.grad_events) or result.bad_params)
            ):
                return False
            if result.record is not None:
                _take_output_uses(item, result.record)
            item.param_grads_finite = result.param_grads_finite
            item.replayed_bad_params = result.bad_params
            item.replayed_unseen = result.unseen_params
            recomputed_finite.append(
                first is None
                and result.param_grads_finite is True
                and not any(fl for _, fl in result.grad_events)
            )
            if result.backward_op is not None:  # also for parameters' gradients alone
                item.ops[-1] = result.backward_op
            # Every module's gradients, also when only parameters' gradients went bad
            # (finite gradients arriving at the module that made them name it).
            if result.grad_events and (
                any(fl for _, fl in result.grad_events) or result.bad_params
            ):
                grad_flags[index] = result.grad_events
                for site, stats in result.grad_stats.items():
                    item.stats[~site] = stats
            elif result.problem is not None:
                item.problems[~(first if first is not None else 0)] = result.problem
                # (A micro-batch that could not be replayed explains more than one that was
                # replayed and came out finite. Two kinds at most are said: the inputs of an
                # early micro-batch let go, the output gradients of a late one not kept.)
                known = self._localisation_problem
                if known is None:
                    self._localisation_problem = result.problem
                elif "; for another, " not in known and result.problem[:40] != known[:40]:
                    self._localisation_problem = f"{known}; for another, {result.problem}"
        return bad_param_grads and bool(recomputed_finite) and all(recomputed_finite)

    def _flags(
        self, items: list[Item], host: list[float], layout: _Layout
    ) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        flags: list[list[int]] = []
        grad_flags: list[list[tuple[int, int]]] = []
        for item, (start, _) in zip(items, layout.items, strict=True):
            item_flags = []
            for i, site in enumerate(item.sites):
                if i in item.stats:
                    item_flags.append(flags_of_stats(item.stats[i]))
                else:
                    at = start + site.start
                    item_flags.append(flags_of(host[at : at + site.nvalues]))
            flags.append(item_flags)
            per_grad: list[tuple[int, int]] = []
            if isinstance(item, ForwardRecord) and item.grads:
                at = start + len(item.values)
                for grad_site, values in item.grads:
                    per_grad.append((grad_site, flags_of(host[at : at + len(values)])))
                    at += len(values)
            grad_flags.append(per_grad)
        return flags, grad_flags

    def _analyze(
        self,
        items: list[Item],
        flags: list[list[int]],
        grad_flags: list[list[tuple[int, int]]],
        bad_param_grads: Callable[..., bool],
        upstream: Callable[[int, int], bool],
        stale: Callable[[int], bool],
        known: Callable[[int, int], bool] = lambda item, frame: False,
    ) -> list[Finding]:
        """Analysis with exact re-checks: a refuted suspicion is cleared and the
        analysis runs again (a sum of huge finite values can overflow)."""
        findings: list[Finding] = []
        deliberate: set[tuple[int, int]] = set()
        overflowed: set[tuple[int, int]] = set()
        for _ in range(8):
            findings = analyze(
                items,
                flags,
                self.is_mask_arg,
                grad_flags,
                bad_param_grads,
                upstream,
                deliberate=deliberate,
                stale=stale,
                known=known,
                overflowed=overflowed,
                replayed=self._options.replay,
                bad_before=self.forward_bad_at == self._recorder.step,
            )
            self._mark_kind_sites(items, findings, self._options.max_propagated)
            refuted = False
            for f in findings:
                if not f.is_origin or _already(items[f.item], f):
                    continue
                item = items[f.item]
                if self._deliberate_fill(item, f) or self._passed_on_mask(item, f, deliberate):
                    deliberate.add((f.item, f.site))
                    refuted = True
                    continue
                scores = self._overflowed_scores(item, f, flags[f.item])
                if scores is not None and (f.item, scores) not in overflowed:
                    overflowed.add((f.item, scores))
                    refuted = True
                    continue
                told = self._neginf_told(item, f, flags[f.item])
                if told is not None:
                    what, site = told
                    (deliberate if what == "mask" else overflowed).add((f.item, site))
                    refuted = True
                    continue
                if f.reason == "loss" and self._made_beyond_mask(items, flags):
                    refuted = True
                    continue
                stats = self.origin_stats(item, f)
                if stats is None or stats.nonfinite_count or f.site < 0:
                    continue
                if not _false_alarm(item, f, stats):
                    # The probe saw NaN/Inf, an exact replay of the step does not: not a
                    # numerical bug in the model (nondeterminism, a race, the hardware).
                    item.unreproduced_sites.add(~f.site if f.reason in _BACKWARD else f.site)
                    continue
                if f.reason in _BACKWARD:
                    grad_flags[f.item] = [
                        (s, 0 if s == f.site else fl) for s, fl in grad_flags[f.item]
                    ]
                else:
                    flags[f.item][f.site] = 0
                    top = (
                        item.frames[0].outputs
                        if isinstance(item, ForwardRecord) and item.frames
                        else ()
                    )
                    if f.site in top:
                        self._note_output_peak(stats)  # (an output whose probe sum overflowed)
                refuted = True
            if not refuted:
                break
        return findings

    def _chained_calls(self, items: list[Item], findings: list[Finding]) -> list[Finding]:
        """Submodules called one after another by code outside the model's forward (a
        ``compute_loss`` method), or the model itself, each call fed what the last returned
        (an ODE function under a solver, an unrolled learned optimiser): each call is a
        record of its own, and the backward runs them in reverse. A bad gradient at an
        earlier call's outputs, seemingly from the loss, came from a later call's backward
        origin: it only propagated."""
        later = [
            f.item
            for f in findings
            if f.is_origin and f.reason in _BACKWARD and f.reason != "loss_backward"
        ]
        if not later:
            return findings
        out = []
        for f in findings:
            item = items[f.item]
            if (
                f.is_origin
                and f.reason == "loss_backward"
                and any(i > f.item for i in later)
                and isinstance(item, ForwardRecord)
                and item.frames
                and (
                    not self._is_model(item.frames[0].module)
                    or any(_fed_by(items[i], item) for i in later if i > f.item)
                )
            ):
                receiver = item.sites[f.site].frame if f.site >= 0 else 0
                f = dataclasses.replace(f, reason="backward", frame=receiver, is_origin=False)
            out.append(f)
        return out

    def _written_nan(self, item: Item, f: Finding, flags: list[list[int]]) -> bool:
        """A NaN made on purpose: written as a value (``masked_fill(pad, nan)``, found by one
        replay, the first time), or an ``nn.Softmax`` child's rows over -inf masks. A NaN
        made by accident (0/0 in a norm) that ``argmax`` or a comparison then hid is none."""
        if f.kind != "nan" or f.reason not in _MADE or f.frame is None:
            return False
        if not isinstance(item, ForwardRecord):
            return False
        frame = item.frames[f.frame]
        if (frame.name, _absorbed_label(item, f)) in self._absorbed_seen:
            return True
        if f.reason == "output" and frame.hooked.type_name in _SOFTMAXES:
            masked = any(flags[f.item][s] & NEGINF for s in frame.inputs)
            # (not -inf scores that overflowed float16: nan_to_num would hide a real bug)
            return masked and self._overflowed_scores(item, f, flags[f.item]) is None
        if not self._options.replay:
            return False
        self.describe(item, f)
        op = item.ops.get(f.site)
        return op is not None and any(isinstance(a, float) and math.isnan(a) for a in op.args)

    def _absorbed_events(
        self, items: list[Item], findings: list[Finding], now: float
    ) -> list[Event]:
        """One event, the first time, for each tensor made non-finite and absorbed."""
        events = []
        for f in findings:
            item = items[f.item]
            if not f.is_origin or f.frame is None or not isinstance(item, ForwardRecord):
                continue
            frame = item.frames[f.frame]
            label = _absorbed_label(item, f)
            key = (frame.name, label)
            if key in self._absorbed_seen:
                continue
            self._absorbed_seen.add(key)
            where = f"`{frame.name}` ({frame.type_name})" if frame.name else "the model"
            made = "in the own code of " if f.reason == "own_code" else "in "
            word = "NaN" if f.kind == "nan" else "Inf"
            events.append(
                self._event(
                    step=item.step,
                    phase="forward",
                    module=frame.name,
                    module_type=frame.type_name,
                    kind=f.kind,
                    is_origin=False,
                    message=(
                        f"nanguard: step {item.step}: {word} written on purpose {made}{where} "
                        f"(its `{label}`: a NaN fill, or a softmax over rows masked to -inf) "
                        "was absorbed by the model's own code (nan_to_num, nanmean, a "
                        "torch.where): nothing non-finite reached its outputs, the loss or the "
                        "gradients. Not an error; said once."
                    ),
                    call=frame.call,
                    tensor=label,
                    time=now,
                    details={"absorbed": True},
                )
            )
        return events

    def _overflowed_scores(self, item: Item, f: Finding, flags: list[int]) -> int | None:
        """A softmax module blamed for NaN over -Inf that its parent's own code made: the
        site of that -Inf when a replay shows an overflow made it (float16 ``q @ k.T``),
        not a mask written on purpose, else ``None``."""
        if f.reason != "output" or f.kind != "nan" or f.frame is None:
            return None
        if not isinstance(item, ForwardRecord) or not self._options.replay:
            return None
        frame = item.frames[f.frame]
        if frame.hooked.type_name not in _SOFTMAXES or frame.parent < 0:
            return None
        for site, path in zip(frame.inputs, frame.input_paths, strict=True):
            fl = flags[site] if site < len(flags) else 0
            if not fl & NEGINF or fl & (NAN | POSINF) or site in item.buffer_sites:
                continue
            if item.sites[site].frame != f.frame or self.is_mask_arg(item, f.frame, path):
                continue  # (not made by the parent's code just before: passed on, a mask)
            made = Finding(f.item, "own_code", "inf", site, frame.parent, consumer=f.frame)
            self.describe(item, made)
            op = item.ops.get(site)
            if op is None or op.mask_input:
                return None
            if any(isinstance(a, float) and math.isinf(a) for a in op.args):
                return None  # (masked_fill(~mask, -inf), full(-inf): a mask)
            return site
        return None

    def _neginf_told(self, item: Item, f: Finding, flags: list[int]) -> tuple[str, int] | None:
        """A -Inf from outside a module (the batch, or its parent's code passing on what it
        was given) found as the origin, told by the operation that made NaN/Inf of it: a
        softmax over rows all -inf makes it a mask (an ALiBi bias given positionally), and
        that call's fully masked row the origin (``("mask", its site)``); any other
        operation (a Linear, a sin) makes it data (the log of a 0), and the parent's input it
        came from the origin (``("data", that input's site)``)."""
        if f.reason not in ("input", "own_code") or f.frame is None or f.site < 0:
            return None
        if not isinstance(item, ForwardRecord) or not self._options.replay:
            return None
        frames = item.frames
        parent = frames[f.frame]
        given = (
            [
                s
                for s, path in zip(parent.inputs, parent.input_paths, strict=True)
                if s < len(flags)
                and flags[s] == NEGINF
                and not self.is_mask_arg(item, f.frame, path)
            ]
            if f.reason == "own_code"
            else []
        )
        if given:
            self.describe(item, f)  # (the parent's inputs' exact statistics too)
            paths = dict(zip(parent.inputs, parent.input_paths, strict=True))
            # (A tensor of only 0 and -inf is a mask, whatever reaches it: talking-heads'
            # Linear over masked logits, a CRF's one-hot einsum with -inf constraints.)
            given = [
                s
                for s in given
                if not (
                    (st := item.input_stats.get((f.frame, paths[s]))) is not None
                    and st.min == 0.0
                    and st.max == 0.0
                )
            ]
        if f.kind == "nan":
            # Made NaN of in the parent's code (``sin(log_snr)`` at a -inf log-SNR): data,
            # unless a softmax made it (a masked row) or the parent was given no -Inf.
            if not given or flags[f.site] & POSINF:
                return None
            self.describe(item, f)
            op = item.ops.get(f.site)
            if op is None or op.direction != "forward" or is_attention(op):
                return None
            if sum(1 for s in op.inputs if s is not None and s.neginf_count) != 1:
                return None
            if any(s is not None and (s.nan_count or s.posinf_count) for s in op.inputs):
                return None
            return "data", given[0]
        if flags[f.site] != NEGINF or f.site in item.buffer_sites:
            return None
        if f.reason == "own_code":
            self.describe(item, f)
            if item.ops.get(f.site) is not None or f.site in item.problems:
                return None  # (made by an operation of the parent's: not passed on)
        consumer = next((i for i in f.propagated if f.site in frames[i].inputs), None)
        if consumer is None:
            return None
        out = next((o for o in frames[consumer].outputs if o < len(flags) and flags[o]), None)
        if out is None:
            return None
        made = Finding(f.item, "output", "nan" if flags[out] & NAN else "inf", out, consumer)
        self.describe(item, made)
        op, stats = item.ops.get(out), item.stats.get(out)
        if op is None:
            # No operation made anything new of it: carried on, and as +Inf too (times a
            # negative weight), which no mask holds.
            data = stats is not None and stats.posinf_count > 0 and not stats.nan_count
            return ("data", given[0]) if data and given else None
        if op.direction != "forward":
            return None
        if any(s is not None and (s.nan_count or s.posinf_count) for s in op.inputs):
            return None
        if is_attention(op) and flags[out] & NAN:
            return "mask", f.site
        return ("data", given[0]) if given else None

    def _note_output_peak(self, stats: TensorStats | None) -> None:
        """Outputs whose probe sum overflowed, found finite: their exact size is what the
        loss's hint sees (huge outputs point at exploding weights)."""
        if stats is not None and stats.min is not None and stats.max is not None:
            peak = max(abs(stats.min), abs(stats.max))
            self._output_peak = max(self._output_peak or 0.0, peak)

    def lr_event(self, optimizer: torch.optim.Optimizer, step: int) -> Event | None:
        """An origin when a parameter group's learning rate is NaN/Inf (a scheduler's 0/0 at
        step 0): the step about to run would make every weight it moves non-finite."""
        if self._bad_rates:  # (a sweep after the step tells what it made: then forgotten)
            horizon = step - (self._sweep_every or 1) - 1
            self._bad_rates = {k: v for k, v in self._bad_rates.items() if v[0] >= horizon}
        for index, group in enumerate(optimizer.param_groups):
            decay = hyperparameter(group.get("weight_decay"))
            if not math.isfinite(decay):
                return self._decay_event(optimizer, index, decay, step)
            lr = hyperparameter(group.get("lr"))
            if math.isfinite(lr):
                continue  # (the usual case: one type check and one isfinite a group)
            self._rate_step = step
            for at, other in enumerate(optimizer.param_groups[index:], index):
                other_lr = hyperparameter(other.get("lr"))
                if not math.isfinite(other_lr):
                    rate = f"the learning rate {other_lr} of parameter group {at}"
                    for p in other["params"]:
                        self._bad_rates[id(p)] = (step, rate)
            return self._group_event(
                step,
                lr,
                f"the learning rate of parameter group {index} of {type(optimizer).__name__} "
                f"is {lr}: this optimizer step would make every weight of the group non-finite. "
                + (
                    "A scheduler made it (a warm-up or decay dividing by 0 at step 0, a "
                    "LambdaLR of 0/0): fix the schedule (max(step, 1))."
                    if step == 0
                    else "A scheduler made it (a NaN bound such as eta_min, a division by a "
                    "count that reached 0, a LambdaLR of 0/0): look at its formula at this step."
                ),
                f"lr of param group {index}",
                {"reason": "learning_rate", "group": index, "lr": str(lr)},
                "A learning rate schedule divided by 0 or overflowed: look at its formula at "
                "this step (warm-up from step 0, 1 / sqrt(step)).",
            )
        return None

    def _decay_event(
        self, optimizer: torch.optim.Optimizer, index: int, decay: float, step: int
    ) -> Event:
        """An origin for a parameter group whose weight decay is NaN/Inf (a per-step
        weight-decay schedule, DINO's): the step would make every weight non-finite."""
        return self._group_event(
            step,
            decay,
            f"the weight decay of parameter group {index} of {type(optimizer).__name__} is "
            f"{decay}: this optimizer step would make every weight of the group non-finite. A "
            "weight-decay schedule made it (a cosine or linear schedule indexed past its end, "
            "a 0/0): fix the schedule.",
            f"weight_decay of param group {index}",
            {"reason": "weight_decay", "group": index, "weight_decay": str(decay)},
            "A weight-decay schedule went non-finite: look at its formula at this step (a "
            "schedule array indexed past its end, a division by 0).",
        )

    def _group_event(
        self,
        step: int,
        value: float,
        told: str,
        tensor: str,
        details: dict[str, Any],
        hint: str,
    ) -> Event:
        """The origin for a parameter group's hyperparameter that is NaN/Inf."""
        return self._event(
            step=step,
            phase="param",
            module=None,
            module_type=None,
            kind="nan" if math.isnan(value) else "inf",
            is_origin=True,
            message=f"nanguard: step {step}: {told}",
            tensor=tensor,
            time=time.time(),
            details=details,
            hint=hint,
        )

    def _passed_on_mask(
        self, item: Item, f: Finding, deliberate: Collection[tuple[int, int]]
    ) -> bool:
        """A -Inf the parent's code passed to a child after a layout change (a
        SpecAugment mask's -inf, transposed before a Conv1d): no operation of the parent
        made it (the replay of ``_deliberate_fill`` found none), and a child's output or
        the parent's input it had was a mask written on purpose. Also a module's output
        (``log_softmax`` of an RL action mask a child wrote, in the parent or in an
        ``nn.LogSoftmax`` after it): the -inf it was given, passed on."""
        if f.kind != "inf" or f.reason not in ("own_code", "output"):
            return False
        if f.frame is None or f.site < 0:
            return False
        if not isinstance(item, ForwardRecord) or not self._options.replay:
            return False
        if item.ops.get(f.site) is not None or f.site in item.problems:
            return False  # (an operation of the parent's made it, or the replay failed)
        stats = item.stats.get(f.site)
        if stats is None or stats.nan_count or stats.posinf_count:
            return False
        frames, sites, at = item.frames, item.sites, f.frame
        parent = frames[at]
        paths = dict(zip(parent.inputs, parent.input_paths, strict=True))

        def same_mask(site: int) -> bool:
            # (the same values rearranged, or broadcast: .expand(B, T, T), .repeat(...): the
            # same share of -inf, over a multiple of as many values)
            mask = item.stats.get(site)
            if mask is None and site in paths:
                mask = item.input_stats.get((at, paths[site]))
            return (
                mask is not None
                and mask.numel > 0
                and stats.numel % mask.numel == 0
                and mask.neginf_count * stats.numel == stats.neginf_count * mask.numel
            )

        def given(site: int) -> bool:
            return site in parent.inputs or (
                sites[site].role == "output" and frames[sites[site].frame].parent == f.frame
            )

        # (A module seen writing its -inf on purpose in an earlier step, or one in
        # allow_inf=: its outputs are probed as masks, so no finding of this step holds them.)
        children = (s for fr in frames if fr.parent == f.frame for s in fr.outputs)
        written = {
            s
            for s in (*parent.inputs, *children)
            if sites[s].role == "output"
            and (
                frames[sites[s].frame].hooked.neg_inf_outputs
                or frames[sites[s].frame].hooked.allow_inf
            )
        }
        if any(index == f.item and given(site) and same_mask(site) for index, site in deliberate):
            passed = True
        else:
            missing = frozenset(s for s in written if s not in item.stats and s not in paths)
            if missing:  # (exact statistics of the children's masks: one more replay)
                item.stats.update(replay(self._recorder, item, missing).stats)
            passed = any(given(site) and same_mask(site) for site in written)
        if passed and f.reason == "output":
            # Probed as a mask from now on, as the module that wrote it: no replay each step.
            parent.hooked.neg_inf_outputs = parent.hooked.passes_mask = True
        return passed

    def _made_beyond_mask(self, items: list[Item], flags: Sequence[list[int]]) -> bool:
        """A step gone non-finite downstream (the loss) while a module marked as passing a
        mask on hides -inf from its probes: whether one of them now returns -inf of its own
        (log(0) beside the mask). Its site is then flagged, and its marks dropped."""
        found = False
        for index, item in enumerate(items):
            if not isinstance(item, ForwardRecord):
                continue
            for at, frame in enumerate(item.frames):
                if not frame.hooked.passes_mask:
                    continue
                for site in frame.outputs:
                    if site >= len(flags[index]) or flags[index][site]:
                        continue
                    f = Finding(index, "output", "inf", site, at)
                    if site not in item.stats:  # (once: the loop may ask again)
                        self.describe(item, f)  # (exact statistics, and an op making -inf)
                    stats = item.stats.get(site)
                    if stats is None or not stats.neginf_count:
                        continue
                    if self._passed_on_mask(item, f, ()):
                        continue  # still the mask alone
                    frame.hooked.neg_inf_outputs = frame.hooked.passes_mask = False
                    flags[index][site] |= NEGINF
                    found = True
        return found

    def _deliberate_fill(self, item: Item, f: Finding) -> bool:
        """A -Inf written on purpose: made by an operation given -inf as a value
        (``masked_fill(~mask, -inf)``, ``full(-inf)``, ``F.pad(value=-inf)``) or by the log
        of a mask of 0s and 1s, in an RL action mask or a hand-built attention mask. The
        module's outputs are probed like masks from then on, so later steps stay on the fast
        path."""
        if f.kind != "inf" or f.reason not in ("output", "own_code"):
            return False
        if not isinstance(item, ForwardRecord) or f.site < 0:
            return False
        stats = self.origin_stats(item, f)
        if stats is None or stats.nan_count:
            return False
        positive = bool(stats.posinf_count)  # (+inf written so min() skips it: a triplet
        # loss's batch-hard negatives, a kNN excluding each point itself)
        if positive:  # the operation that made the +Inf (a -inf mask may come first)
            frame = f.frame if f.frame is not None else -1
            op = replay(self._recorder, item, frozenset(), watch=(frame, "posinf")).op
        else:
            if f.site not in item.ops:  # a sentinel step's exact replay gave statistics only
                self.describe(item, f)
            op = item.ops.get(f.site)
        if op is None and (positive or not _from_written_posinf(item, f.frame)):
            return False
        value = math.inf if positive else -math.inf
        # (A -Inf from a +inf written on purpose counts too: log_softmax(-d) after d[eye] =
        # inf, a point that is not its own neighbour.)
        written = op is None or any(
            isinstance(a, float) and (a == value or (not positive and a == math.inf))
            for a in op.args
        )
        if not written and (positive or op is None or not op.mask_input):  # (nor log(mask))
            return False
        if f.reason == "output" and f.frame is not None:
            hooked = item.frames[f.frame].hooked
            site = item.sites[f.site]
            if not positive:
                hooked.neg_inf_outputs = True
            elif site.role == "output" and site.frame == f.frame:
                # That output is probed for NaN only from now on; the others as before
                # (an overflow to +Inf there is still seen).
                hooked.posinf_paths = hooked.posinf_paths | {site.path}
            else:
                hooked.allow_inf = True
            top = item.frames[0]
            if f.frame != 0 and f.site in top.outputs and top.output_paths is not None:
                # The model returns it too: its own probe (all a sentinel step has) alike.
                path = top.output_paths[top.outputs.index(f.site)]
                if positive and path is not None:
                    top.hooked.posinf_paths = top.hooked.posinf_paths | {path}
                elif not positive:
                    top.hooked.neg_inf_outputs = True
        return True

    # ----------------------------------------------------------------- stats
    def origin_stats(self, item: Item, f: Finding) -> TensorStats | None:
        """Exact statistics of the tensor a finding is about (None if unavailable)."""
        if f.reason in _BACKWARD:
            return self._gradient_stats(item, f)
        if f.site in item.stats:
            return item.stats[f.site]
        if isinstance(item, LossRecord):
            item.stats[0] = tensor_stats(item.tensor)
            return item.stats[0]
        if f.reason == "input" and item.replay is not None:
            tensor = self._input_tensor(item, item.sites[f.site].path)
            if tensor is not None:
                item.stats[f.site] = tensor_stats(tensor)
                return item.stats[f.site]
        if not self._options.replay:
            item.problems.setdefault(
                f.site,
                "replay=False"
                + (
                    "; only the model's inputs and outputs were checked (sentinel mode, or a "
                    "compiled model), so the module inside that made it is unknown"
                    if item.coarse
                    else ""
                ),
            )
            return None
        self.describe(item, f)
        return item.stats.get(f.site)

    def _confirm_own_inf(self, items: list[Item], findings: list[Finding]) -> list[Finding]:
        """An Inf of a parent's own code, taken for the origin of a backward NaN, must have
        been made by an operation of that forward (``x / x.sum()`` at a blank sample), seen
        by a replay: a mask written before it (``scores + self.causal_mask``) is not, and
        the backward origin it had demoted stands."""
        kept = []
        for f in findings:
            demoted = f.instead_of
            item = items[f.item]
            if demoted is not None and isinstance(item, ForwardRecord) and self._options.replay:
                self.describe(item, f)
                if item.ops.get(f.site) is None:
                    demoted.is_origin = True
                    continue
            kept.append(f)
        return kept

    def raising_call(self, record: ForwardRecord) -> tuple[int, Frame] | None:
        """The call whose own code raised the forward's error (``record.raised``, set): the
        innermost that never returned. A sentinel step's calls are not known: a replay up
        to the error tells (``None`` where it cannot run)."""
        if not record.coarse:
            at = record.raised_frame
            return (at, record.frames[at]) if at < len(record.frames) else None
        if not self._options.replay or record.replay is None:
            return None
        again = replay(self._recorder, record, frozenset()).record
        if again is None or again.raised is None or again.raised_frame >= len(again.frames):
            return None
        return again.raised_frame, again.frames[again.raised_frame]

    def made_before_error(
        self, record: ForwardRecord, call: tuple[int, Frame] | None
    ) -> tuple[OpInfo, str] | None:
        """A forward that raised (Cholesky of a kernel matrix a zero lengthscale made NaN)
        with everything its modules received and returned finite: the own code of the call
        that raised (``call``, see ``raising_call``) made the invalid value. One replay (per
        kind) up to the error finds the operation in that code that made NaN or Inf;
        returns it and its hint, or ``None``."""
        if not self._options.replay or record.replay is None or not record.frames:
            return None
        at, frame = call if call is not None else (0, record.frames[0])
        # (NaN, or +Inf: an exp overflow. A -Inf is more likely a mask or a log a later
        # clamp absorbed, the matrix then finite: "posinf" looks for the +Inf only.)
        for kind in ("nan", "posinf"):
            result = replay(self._recorder, record, frozenset(), watch=(at, kind))
            op = result.op
            if (
                op is not None
                and "linalg" in op.name
                and not any(s is not None and s.nonfinite_count for s in op.inputs)
            ):
                # (The factorisation that failed, from a finite matrix: torch.linalg.solve's
                # _linalg_solve_ex returns NaN where the matrix is singular, then raises.)
                return None
            if op is not None:
                text = self._hint(
                    None, phase="forward", kind=kind, reason="own_code",
                    module_type=frame.type_name, op=op, step=record.step, module=frame.module,
                )  # fmt: skip
                return op, text
            if result.problem is not None:
                return None
        return None

    def describe(self, item: ForwardRecord, f: Finding) -> None:
        """One replay for a forward origin: exact statistics of the offending tensor and of
        the inputs of the call, and the operation (with its source line) that made it."""
        if f.frame is None or f.site in item.ops or not self._options.replay:
            return
        inputs_of = frozenset({f.frame}) if f.reason in ("output", "own_code") else None
        targets = frozenset() if f.site in item.stats else frozenset({f.site})
        targets |= item.kind_sites - item.stats.keys()  # (propagated: their exact kind)
        result = replay(
            self._recorder,
            item,
            targets,
            input_frames=inputs_of,
            watch=(f.frame, _exact_kind(f.kind, item.stats.get(f.site))),
        )
        item.input_stats.update(result.input_stats)
        item.stats.update(result.stats)
        item.rows.update(result.rows)
        kind = _exact_kind(f.kind, item.stats.get(f.site))
        if result.op is None and result.problem is None and kind != f.kind:
            # The probe's NaN was +Inf + -Inf: look for the operation that made the Inf.
            result = replay(self._recorder, item, frozenset(), watch=(f.frame, kind))
        if result.op is not None:
            item.ops[f.site] = result.op
        if result.problem is not None:
            item.problems.setdefault(f.site, result.problem)
        if result.finite and result.op is None:
            # Another path (a module that misbehaved once, behind an `if` of its own), and
            # every module's tensors finite: the value was not made again.
            item.unreproduced_sites.add(f.site)
            item.problems[f.site] = "the replay did not make it again"

    def _find_backward_op(self, item: ForwardRecord) -> None:
        """One replay of the forward and backward that records the operation whose
        backward first went non-finite (kept as ``item.ops[-1]``)."""
        result = replay(self._recorder, item, backward=True, watch=(-1, "grad"))
        if result.backward_op is not None:
            item.ops[-1] = result.backward_op

    def _gradient_stats(self, item: Item, f: Finding) -> TensorStats | None:
        if not isinstance(item, ForwardRecord):
            return None
        key = ~f.site  # gradient statistics live under negative keys
        # (A sentinel step's replay gave the statistics, but not the backward operation
        # when every module's gradients are probed: one more replay finds it.)
        if key in item.stats and (-1 in item.ops or item.replaces is None):
            return item.stats[key]
        if f.reason == "backward_params":
            # Described through the parameters' gradients; the operation (when every
            # module's gradients were probed, no replay looked for it yet) by a replay.
            if self._options.replay and -1 not in item.ops:
                self._find_backward_op(item)
            return None
        if f.site in item.output_grads:
            item.stats[key] = tensor_stats(item.output_grads[f.site])
            return item.stats[key]
        if not self._options.replay:
            item.problems.setdefault(key, "replay=False")
            return None
        if f.independent:  # (the step's replay went to the first origin's gradient)
            item.problems.setdefault(key, "not recomputed for a second origin of the backward")
            return None
        result = replay(self._recorder, item, grad_targets=frozenset({f.site}), watch=(-1, "grad"))
        for site, stats in result.grad_stats.items():
            item.stats.setdefault(~site, stats)
        if result.backward_op is not None:
            item.ops[-1] = result.backward_op
        if result.problem is not None:
            item.problems.setdefault(key, result.problem)
        return item.stats.get(key)

    @staticmethod
    def _input_tensor(item: ForwardRecord, path: Path) -> Tensor | None:
        assert item.replay is not None
        root = item.replay.args if path[0] == "args" else item.replay.kwargs
        try:
            tensor = _lookup(root, path[1:])
        except (KeyError, IndexError, AttributeError, TypeError):
            return None
        return tensor if isinstance(tensor, Tensor) else None

    def _clear_absorbed(self, items: list[Item], grad_flags: list[list[tuple[int, int]]]) -> None:
        """A non-finite gradient that entered the model at its outputs and that its own
        backward absorbed before any parameter or input (``masked_fill``'s backward zeroes
        the positions where a ``logsumexp`` over a fully masked row made NaN) harms nothing:
        shown by replaying that backward. Every parameter gradient of the step is finite."""
        for index, item in enumerate(items):
            if not isinstance(item, ForwardRecord) or not any(fl for _, fl in grad_flags[index]):
                continue
            bad = {site for site, fl in grad_flags[index] if fl}
            # (Probed inside the model too, with backward="probes": a module's bad gradient
            # that a backward after it dropped, an embedding's padding rows, a dead ReLU.)
            top_inputs = set(item.frames[0].inputs) if item.frames else set()
            if bad & top_inputs or not item.output_grads or not self._options.replay:
                continue  # a bad gradient reached an input, or the backward cannot be replayed
            # The same sites, shapes and kinds proven absorbed by a replay a few steps ago (a
            # model that absorbs them at every step: a Chamfer sqrt at copied points): taken
            # as proven again, not replayed at every step (proven anew every so many steps).
            signature = tuple(
                (item.frames[item.sites[site].frame].name, item.sites[site].key(), fl)
                for site, fl in grad_flags[index]
                if fl
            )
            proven = self._absorbed_proofs.get(signature)
            if proven is not None and 0 <= item.step - proven < _ABSORBED_PROOF_STEPS:
                grad_flags[index] = [(site, 0) for site, _ in grad_flags[index]]
                continue
            result = replay(self._recorder, item, backward=True)
            again = result.record
            if result.param_grads_finite is not True or again is None or not again.frames:
                continue
            inputs = set(again.frames[0].inputs)
            if any(fl for site, fl in result.grad_events if site in inputs):
                continue  # the inputs' gradients are not finite (a trainable input)
            grad_flags[index] = [(site, 0) for site, _ in grad_flags[index]]
            if len(self._absorbed_proofs) >= _ABSORBED_PROOFS_KEPT:
                self._absorbed_proofs.clear()
            self._absorbed_proofs[signature] = item.step

    def _fresh_table(self) -> ParamTable | None:
        """A new table if the model's parameters were replaced since this one was built, or
        its modules moved (``model.feat = nn.Sequential(model.feat, ...)``: new names)."""
        if not self.params.stale() and not self.params.renamed():
            return None
        return ParamTable(self._model, self._options.names, previous=self.params)

    def refresh_now(self) -> None:
        """The model's parameters changed (a group added to the optimizer): check the table
        at this step's end, not at the next periodic check."""
        self._since_table_check = _TABLE_CHECK_EVERY

    def _refresh_table(self) -> None:
        """Rebuild the table if needed (only between resolutions: indices into the table
        are held during one)."""
        table = self._fresh_table()
        if table is not None:
            self._hand_norms = None  # (modules may have changed too: looked at again)
            self._rename(_renames(self.params, table))
            old, self.params = self.params, table
            self._new_params(old)

    def _new_params(self, old: ParamTable) -> None:
        """Trained parameters new since ``old`` (a task head swapped in, adapters added): their
        gradients join the norm, larger at first and no explosion; its history restarts."""
        if any(id(p) not in old.ids and p.requires_grad for _, p in self.params.params):
            self.monitor.reset()

    def _rename(self, renames: dict[str, str]) -> None:
        """Parameters now named otherwise, the same tensors (pruning makes `weight`
        `weight_orig`): what is known of them by name follows them."""
        if not renames:
            return
        for names in (
            self._bad_params,
            self._last_bad_grads,
            self._param_alarms,
            self._nan_at_attach,
        ):
            moved = names & renames.keys()
            names -= moved
            names |= {renames[n] for n in moved}
        for keyed in (self._bad_grads_since, self._nan_loaded):
            taken = {n: keyed.pop(n) for n in keyed.keys() & renames.keys()}
            keyed.update((renames[n], v) for n, v in taken.items())

    def note_present_grads(self) -> None:
        """At attach: what ``.grad`` holds was left by a backward no guard watched (the
        step an earlier guard stopped, a run trained unwatched meanwhile): not this guard's
        to report, unless an optimizer step is about to apply it (``check_present_grads``)."""
        self._refresh_table()
        self.present_grads = self.params.mark_present()

    def check_present_grads(self) -> None:
        """An optimizer step ends: the gradients present at attach that no backward has
        replaced since are checked with the step's (it applies them)."""
        present, self.present_grads = self.present_grads, {}
        self.params.unmark(present)
        self._stale_grads = present

    def _untouched_since_attach(self, name: str, tensor: Tensor) -> bool:
        """A buffer non-finite when the guard was attached and not written since (the same
        tensor, the same version): read by a forward, not made by it."""
        entry = self._nan_buffers.get(name)
        return entry is not None and entry[0]() is tensor and _grad_version(tensor) == entry[1]

    def _stale_only(self, bad_grads: Mapping[int, int]) -> bool:
        """Whether every non-finite gradient is one .grad held when the guard was attached,
        unchanged since (no backward of this guard's made it)."""
        stale, self._stale_grads = self._stale_grads, {}
        if not stale or not bad_grads:
            return False
        for index in bad_grads:
            param = self.params.params[index][1]
            entry, grad = stale.get(id(param)), param.grad
            if entry is None or grad is None or entry[0]() is not grad:
                return False
            if _grad_version(grad) != entry[1]:
                return False
        return True

    def note_masks(self) -> None:
        """Learn which buffers hold +/-Inf on purpose: those that do when the guard is
        attached (a causal mask), and which weights were non-finite already (a checkpoint
        with a NaN row). One host read, at attach time."""
        self._refresh_table()
        if self._options.check_params == 0:
            return
        with torch.no_grad():
            owned, tensors = self.params.values(skip=self._unswept(), always=True)
            checked = [
                (o, t)
                for o, t in zip(owned, tensors, strict=True)
                if not is_lazy(t)  # LazyBatchNorm: no values yet
            ]
            if not checked:
                return
            values, groups = finite_probes([t for _, t in checked])
            host = host_values(values) if values else []
        at = 0
        for (count, _), (o, tensor) in zip(groups, checked, strict=True):
            if count and flags_of(host[at : at + count]):
                flags = flags_of_tensor(tensor)
                if flags and not flags & NAN and self._allows_inf(o.owner):
                    self._inf_weights.add(o.name)  # (+/-Inf on purpose: allow_inf)
                elif o.local in o.owner._parameters:
                    if flags:  # a weight loaded non-finite: reported at the first step's end
                        self._nan_at_attach.add(o.name)
                        self._sweep_soon = True
                        self.params.forget_versions()  # (that sweep reads every tensor)
                elif flags and not flags & NAN:
                    self._mask_buffers.add(o.name)
                elif flags & NAN:  # (a notebook re-watching a model a raise left poisoned)
                    self._nan_at_attach.add(o.name)
                    # (as it was: a forward that writes it since makes it its own again)
                    self._nan_buffers[o.name] = (weakref.ref(tensor), _grad_version(tensor))
            at += count
        self._attach_checked = True

    def load_marks(self) -> dict[str, tuple[int, int]]:
        """``(id, version)`` of every weight and buffer, before a ``load_state_dict()``."""
        table = self.params
        marks = {o.name: (id(p), _grad_version(p)) for o, p in table.params}
        for b in table.buffers:
            t = held(b.owner._buffers, b.local)
            if t is not None:
                marks[b.name] = (id(t), _grad_version(t))
        return marks

    def note_loaded(self, step: int, before: Mapping[str, tuple[int, int]]) -> None:
        """``load_state_dict()`` wrote the weights and buffers that changed since ``before``
        (rare: one host read): those it left non-finite came so from the checkpoint, told as
        such at the step's end; those it left finite are no checkpoint's doing any more."""
        if self._options.check_params == 0:
            return
        # (assign=True puts in new tensors: the table takes them now, between resolutions,
        # so that the step's sweep reads what was loaded)
        self._refresh_table()
        table = self.params
        with torch.no_grad():
            # (buffers too: running statistics saved after a NaN batch; not masks)
            owned, tensors = table.values(skip=self._unswept(table), always=True)
            checked = [
                (o, t)
                for o, t in zip(owned, tensors, strict=True)
                if before.get(o.name) != (id(t), _grad_version(t)) and not is_lazy(t)
            ]
            values, groups = finite_probes([t for _, t in checked])
            host = host_values(values) if values else []
        at = 0
        for (count, _), (o, _) in zip(groups, checked, strict=True):
            if count and flags_of(host[at : at + count]):
                self._nan_loaded[o.name] = step
                self._sweep_soon = True
            else:  # (a later load left it finite: a corrupt checkpoint replaced by a good one)
                self._nan_loaded.pop(o.name, None)
                # (...or weights gone non-finite in training, reloaded from a good
                # checkpoint: a later failure of theirs is new again)
                self._bad_params.discard(o.name)
                self._last_bad_grads.discard(o.name)
                self._bad_grads_since.pop(o.name, None)
            at += count
        if self._nan_loaded:
            self.params.forget_versions()  # (that sweep reads every tensor)

    def _loaded_event(
        self, owned: Owned, tensor: Tensor, exact: int, loaded_at: int, now: float
    ) -> Event:
        stats = tensor_stats(tensor)
        kind = "nan" if exact & NAN else "inf"
        word = kind_word(kind, stats)
        module_type = type(owned.owner).__name__
        buffer = owned.local not in owned.owner._parameters
        if not buffer:
            what, made = "parameter", "no optimizer step or forward made it here"
            hint = (
                "Resume from an earlier checkpoint, saved before the weights went non-finite "
                "(that run's log names where they did), and check each checkpoint's weights "
                "before saving it (torch.isfinite(p).all())."
            )
        else:
            what, made = "buffer", "no forward made it here"
            hint = (
                "Resume from an earlier checkpoint, or recompute this buffer: running statistics "
                "(BatchNorm) by module.reset_running_stats() and a few forward passes in "
                "train() mode over finite batches. Check buffers too before saving one."
            )
        return self._event(
            step=loaded_at,
            phase="param",
            module=owned.owner_name,
            module_type=module_type,
            param=owned.name,
            kind=kind,
            is_origin=True,
            stats=stats,
            message=(
                f"nanguard: step {loaded_at}: {what} `{owned.name}` ({module_type}) is "
                f"{word} since load_state_dict() loaded it in step {loaded_at}: "
                f"{stats.summary()}. The checkpoint holds {word}: it was saved after the "
                f"weights went non-finite ({made})."
            ),
            tensor=owned.name,
            time=now,
            details={"buffer": buffer, "reason": "loaded_checkpoint"},
            hint=hint,
        )

    def _unswept(self, table: ParamTable | None = None) -> set[str]:
        """Buffers the parameter sweeps leave alone: masks, and those of excluded modules."""
        table = table or self.params
        known, excluded = self._excluded_buffers
        if known is not table:
            excluded = frozenset(self._buffers_excluded(table))
            self._excluded_buffers = (table, excluded)
        return self._mask_buffers | excluded if excluded else self._mask_buffers

    def _buffers_excluded(self, table: ParamTable) -> Iterator[str]:
        rule = self._options.exclude
        if not (rule.types or rule.patterns) or not table.buffers:
            return
        excluded: set[int] = set()
        names: set[str] = set()
        wrapped = is_data_parallel(self._model)
        for raw, module in self._model.named_modules():  # (parents first)
            name = plain_name(raw)
            if (name and name.rpartition(".")[0] in names) or any(
                rule.matches(module, n) for n in spellings(raw, wrapped)
            ):  # (as Guard matches them: see _hooked_modules)
                excluded.add(id(module))
                names.add(name)
        for owned in table.buffers:
            if id(owned.owner) in excluded:
                yield owned.name

    def _written_this_step(self, owned: Owned) -> bool:
        """A buffer its module's forward writes in place (a hand-written batch norm's running
        statistics, a MoCo queue, an EMA codebook), probed finite at the end of every step
        and not told bad before: non-finite now, its own forward of this step wrote it, so
        it explains none of that forward's values."""
        return (
            owned.local not in owned.owner._parameters
            and (id(owned.owner), owned.local) in self._recorder.buffer_updaters
            and owned.name not in self._bad_params
            and owned.name not in self._nan_at_attach
        )

    def _unneeded(self, items: list[Item], found: list[tuple[Owned, Tensor]]) -> set[int]:
        """Ids of the buffers non-finite since the guard was attached (a table computed in
        __init__ with a 0/0 at an entry only sampling reads) that the step's forward does not
        need to go non-finite: one replay with finite copies of all of them in their place
        (the buffers themselves are not touched; NaN/Inf made 1, no new 0 to divide by)
        makes the model's outputs just as non-finite. Then none of them is to blame. Asked
        afresh at each failing step: a table one step does not read, another may."""
        tables = [
            (o, t)
            for o, t in found
            if o.name in self._nan_at_attach
            and o.local not in o.owner._parameters
            and o.owner._buffers.get(o.local) is t
            and self._untouched_since_attach(o.name, t)  # (not one a forward writes since)
        ]
        if not tables or not self._options.replay:
            return set()
        owners = {id(o.owner) for o, _ in tables}
        item = next(
            (
                i
                for i in items
                if isinstance(i, ForwardRecord)
                and i.frames
                and i.replay is not None
                # (a sentinel step's record holds the model's call alone: any module inside)
                and (i.coarse or any(id(f.module) in owners for f in i.frames))
            ),
            None,
        )
        if item is None:
            return set()
        outputs = frozenset(item.frames[0].outputs)
        if not outputs:
            return set()
        finite = frozenset((id(o.owner), o.local) for o, _ in tables)
        # (A sentinel step's record holds the model's call alone: the replay stands for it.)
        result = replay(self._recorder, item, outputs, exact=item.coarse, finite_buffers=finite)
        again = result.record
        if item.coarse and again is not None and again.frames:
            outputs = frozenset(again.frames[0].outputs)
        stats = [result.stats.get(site) for site in outputs]
        if result.problem is not None or any(s is None for s in stats):
            return set()
        if not any(s is not None and s.nonfinite_count for s in stats):
            return set()
        return {id(t) for _, t in tables}

    def _intentional_buffer(self, owned: Owned, flags: int) -> bool:
        """A buffer that held +/-Inf when the guard was attached, or named like a mask, is
        a mask; so is one that filled with -Inf since (a mask cache built in a forward).
        +Inf (a running variance that overflowed) and NaN are corruption. A module in
        ``allow_inf`` may hold +/-Inf in its weights too (a CRF's forbidden transitions)."""
        if flags & NAN:
            return False
        if self._allows_inf(owned.owner):
            return True
        if owned.local in owned.owner._parameters:
            return False
        if owned.name in self._mask_buffers or is_mask_name(owned.local):
            return True
        return flags == NEGINF and owned.local not in _RUNNING_STATS

    def _nan_only(self, owned: list[Owned], tensors: list[Tensor]) -> list[Tensor]:
        """The tensors a sweep probes: an allow_inf module's weights that hold +/-Inf on
        purpose (a CRF's forbidden transitions) with their Inf made 0, so that only a NaN
        (weight decay times -inf in an update) shows."""
        if not self._inf_weights:
            return tensors
        return [
            t.nan_to_num(nan=math.nan, posinf=0.0, neginf=0.0) if o.name in self._inf_weights else t
            for o, t in zip(owned, tensors, strict=True)
        ]

    def _allows_inf(self, module: nn.Module) -> bool:
        """Whether ``module`` is in ``allow_inf`` (failure path and attach only)."""
        return any(h.module is module and h.allow_inf for h in self._recorder.modules)

    @staticmethod
    def _tensor_of(owned: Owned) -> Tensor | None:
        param = held(owned.owner._parameters, owned.local)
        return param if param is not None else held(owned.owner._buffers, owned.local)

    @staticmethod
    def is_mask_arg(record: ForwardRecord, frame: int, path: Path) -> bool:
        """Whether ``path`` names a mask-like argument (``attn_mask``, ``position_bias``...)."""
        if len(path) < 2:
            return False
        if path[0] == "kwargs":
            return is_mask_name(path[1])
        return path[1] in record.frames[frame].hooked.mask_positions

    # ---------------------------------------------------------------- events
    def _event(self, **fields: Any) -> Event:
        fields.setdefault("rank", self._rank())
        fields.setdefault("param", None)
        fields.setdefault("stats", None)
        head = f"nanguard: step {fields['step']}:"
        if world_size() > 1 and fields["message"].startswith(head):
            # Several ranks print to one terminal: say which one speaks.
            rest = fields["message"][len(head) :]
            fields["message"] = f"nanguard: step {fields['step']} (rank {fields['rank']}):{rest}"
        return Event(**fields)

    def _findings_events(
        self,
        items: list[Item],
        findings: list[Finding],
        flags: list[list[int]],
        *,
        upstream_any: bool,
        now: float,
    ) -> list[Event]:
        findings = self._confirm_own_inf(items, findings)
        events: list[Event] = []
        shown: dict[tuple[int, bool], int] = {}
        origin_names: dict[int, str] = {}
        origin_calls: dict[int, tuple[str | None, int]] = {}  # ...and which call it was
        origin_ops: dict[tuple[str | None, ...], int] = {}  # ...its operation and kind
        limit = self._options.max_propagated
        # A loss can be told apart from the model only if a forward of it was recorded (not
        # so for a torch.compile wrapper made after watch(), whose forward skips the hooks).
        forwards_seen = self._recorder.forwards > 0 or any(
            isinstance(item, ForwardRecord) and not item.unchecked_outputs for item in items
        )
        # ...and some ran inside torch.func transforms, unchecked (vmap(hessian(...))).
        transformed = _ran_transformed(items)
        # Model outputs holding -inf on purpose (masked logits): finite they were not.
        masked_outputs = any(
            isinstance(item, ForwardRecord)
            and item.frames
            and any(
                flags[i][s] & NEGINF
                # outputs probed as masks (their -inf was seen written on purpose before)
                or item.frames[item.sites[s].frame].hooked.neg_inf_outputs
                for s in item.frames[0].outputs
                if s < len(flags[i])
            )
            for i, item in enumerate(items)
        )
        # ...or made by an allow_inf= module, whose Inf is not probed: for a loss gone
        # +-Inf (not NaN: a 0/0 of its own), the Inf it was allowed to make is likeliest.
        allowed_inf = any(
            isinstance(item, ForwardRecord)
            and item.frames
            and any(
                item.frames[item.sites[s].frame].hooked.allow_inf for s in item.frames[0].outputs
            )
            for item in items
        )
        self._confirm_independent(items, findings)
        # Submodules called directly while the model's forward never ran (an RL agent's
        # get_action_and_value): code nanguard does not watch combined their outputs.
        direct_calls: tuple[str, ...] = ()
        forwards = [item for item in items if isinstance(item, ForwardRecord) and item.frames]
        if forwards and not any(self._is_model(item.frames[0].module) for item in forwards):
            direct_calls = tuple(dict.fromkeys(item.frames[0].name for item in forwards))
        for f in findings:
            item = items[f.item]
            backward = f.reason in _BACKWARD
            if _already(item, f):
                continue
            if f.is_origin:
                if backward:
                    assert isinstance(item, ForwardRecord)
                    event = self._backward_event(item, f, now)
                else:
                    event = self._origin_event(
                        item,
                        f,
                        flags[f.item],
                        now,
                        forwards_seen=forwards_seen,
                        masked_outputs=masked_outputs,
                        allowed_inf=allowed_inf,
                        direct_calls=direct_calls,
                        transformed=transformed,
                    )
                    if event.phase == "input" and self._told_input(item, f):
                        events.append(_batch_told_before(event))
                        continue
                    if (
                        isinstance(item, ForwardRecord)
                        and item.in_step
                        and self._rate_step == item.step
                    ):
                        events.append(_after_bad_rate(event))
                        continue
                    if event.phase == "forward" and event.op is not None:
                        # The same operation of the same module made it again in a later call
                        # of the step (a parametrized weight read again by a regulariser in
                        # the loss, a second micro-batch): one cause, told once.
                        made = (event.module, event.op, event.source, event.kind)
                        if made in origin_ops and origin_ops[made] != f.item:
                            events.append(_made_again(event))
                            continue
                        origin_ops.setdefault(made, f.item)
                origin_names.setdefault(
                    f.item,
                    "the input batch"
                    if event.phase == "input"
                    else "the model"
                    if event.module == ""
                    else f"`{event.where}`"
                    if event.module is not None
                    else "the loss",
                )
                if event.phase == "forward" and event.call is not None:
                    origin_calls.setdefault(f.item, (event.module, event.call))
                events.append(event)
                continue
            if _wrapper_frame(item, f.frame):
                continue  # (the compiled module inside it has the same event)
            key = (f.item, backward)
            count = shown.get(key, 0)
            if f.reason != "loss" and count >= limit:
                continue
            shown[key] = count + 1
            # (the origin of its own record, else the step's first: a loss or a backward
            # reached by a forward's origin, or a forward reached by an input origin)
            origin = origin_names.get(f.item) or next(iter(origin_names.values()), None)
            if origin is None and upstream_any:
                origin = "parameters that were already non-finite"
            own = (
                isinstance(item, ForwardRecord)
                and f.frame is not None
                and origin_calls.get(f.item)
                == (item.frames[f.frame].name, item.frames[f.frame].call)
            )
            events.append(self._propagated_event(item, f, origin, now, own=own))
        for f in findings:  # marked at the end: propagated findings above still count
            if f.is_origin:
                item = items[f.item]
                marked = [item]
                if isinstance(item, ForwardRecord) and item.replaces is not None:
                    marked.append(item.replaces)  # later resolutions replay it afresh
                for record in marked:
                    if f.reason in _BACKWARD and isinstance(record, ForwardRecord):
                        record.reported_backward = True
                    else:
                        record.reported = True
        return events

    @staticmethod
    def _mark_kind_sites(items: list[Item], findings: list[Finding], limit: int) -> None:
        """The forward sites of the propagated events to be shown whose probe read NaN: the
        replay that describes the origin checks them exactly (Inf of both signs is no NaN)."""
        shown: dict[int, int] = {}
        for f in findings:
            item = items[f.item]
            if f.is_origin or f.reason in _BACKWARD or not isinstance(item, ForwardRecord):
                continue
            count = shown[f.item] = shown.get(f.item, 0) + 1
            if count <= limit and f.kind == "nan" and f.site not in item.stats:
                item.kind_sites = item.kind_sites | {f.site}

    def _confirm_independent(self, items: list[Item], findings: list[Finding]) -> None:
        """A second origin of a forward, made from finite inputs, is demoted when a faithful
        replay finds no operation inside that call that made it from finite values: the
        call read the first origin's value from state its inputs do not show (an attribute
        set by its parent, a recurrent cell's own hidden state, a tensor in a plain object).
        Without a replay, or when the replay went another way, the probes' evidence stands
        for a module's output; a parent's own code, which reads its own state (self.h, a
        memory attribute) more often than a module does, needs the replay's operation."""
        for f in findings:
            item = items[f.item]
            if not (f.independent and f.is_origin and isinstance(item, ForwardRecord)):
                continue
            if f.reason in _BACKWARD:  # (seen by gradient probes, not a forward's values)
                continue
            unseen = not self._options.replay or f.site in item.unreproduced_sites
            if unseen and f.reason != "own_code":
                continue  # no replay to tell: the probes' evidence stands
            if not unseen:
                self.describe(item, f)
                if item.ops.get(f.site) is not None or f.site in item.problems:
                    continue
            f.is_origin = f.independent = False
            first = next(
                (g for g in findings if g.item == f.item and g.is_origin and g.reason != "loss"),
                None,
            )
            if first is not None:  # it reached this call after all
                first.propagated = [
                    g.frame
                    for g in findings
                    if g.item == f.item
                    and not g.is_origin
                    and g.reason not in _BACKWARD
                    and g.frame is not None
                ]

    def _hint(
        self,
        f: Finding | None,
        *,
        phase: str,
        kind: str,
        reason: str,
        module_type: str | None = None,
        stats: TensorStats | None = None,
        dtype: str | None = None,
        op: OpInfo | None = None,
        mask_inputs: bool = False,
        params_nonfinite: bool = False,
        buffers_nonfinite: bool = False,
        step: int = 0,
        call_inputs: tuple[TensorStats, ...] = (),
        forward: int = 1,
        updates: int | None = None,
        fed_back: bool = False,
        rebuilt: bool = False,
        module: nn.Module | None = None,
        loss_ops: tuple[str, ...] = (),
        param: Tensor | None = None,
        stale_outside: Sequence[TensorStats] = (),
        item: Item | None = None,
        call: tuple[str, int] | None = None,
    ) -> str:
        optimizer = self._options.optimizer
        state, eps = _optimizer_view(optimizer, param) if phase == "param" else (None, None)
        if reason == "loss_backward" and not loss_ops:  # (the losses checked this step)
            loss_ops = tuple(
                name
                for i in self._failing_items
                if isinstance(i, LossRecord)
                for name in _loss_nodes(i.node, self._failing_items)
            )
        if updates is None:  # (a loss: the optimizer updates before this step's forwards)
            updates = min(
                (i.updates for i in self._failing_items if isinstance(i, ForwardRecord)),
                default=None,
            )
        return hint(
            HintContext(
                phase=phase,
                kind=kind,
                reason=reason,
                module_type=module_type,
                stats=stats,
                dtype=dtype,
                op=op,
                mask_inputs=mask_inputs,
                grad_norm_alarm_step=self._last_spike,
                grad_norm_alarm_first=self._first_spike,
                step=step,
                amp_collapsed=self._amp_collapse_reported,
                params_nonfinite=params_nonfinite,
                buffers_nonfinite=buffers_nonfinite,
                optimizer=type(optimizer).__name__ if optimizer is not None else None,
                output_peak=self._output_peak,
                input_peak=_input_peak(self._failing_items)
                if phase == "loss" and (self._output_peak or 0.0) >= HUGE_OUTPUTS
                # (a forward origin's own inputs: not a later forward's of the step, an
                # energy model's sampler growing its iterate forward after forward)
                else _input_peak([item] if item is not None else self._failing_items)
                if phase == "forward" and op is not None
                else None,
                weight_peak=_weight_peak(self._model)
                if (phase == "loss" and (self._output_peak or 0.0) >= HUGE_OUTPUTS)
                or (phase == "forward" and call is not None and call[1] >= _RECURRENT_CALLS)
                else None,
                call=call,
                scaler_known=self._options.scaler is not None,
                loss_checked=self._loss_checked,
                call_inputs=call_inputs,
                forward=forward,
                updates=updates,
                fed_back=fed_back,
                rebuilt=rebuilt,
                output_dtype=_output_half(self._failing_items) if phase == "loss" else None,
                learning_rate=_learning_rate(optimizer, module, updates, self._model),
                loss_ops=loss_ops,
                optimizer_state=state,
                optimizer_eps=eps,
                saved_hooks=_saved_hooks(self._failing_items) if phase == "backward" else None,
                half_weights=dtype == "torch.float16" and _half_weights(module, self._model),
                grads_unchecked=not self._watch_grads,
                pre_hooks=_pre_hooks(module) if module is not None and phase == "forward" else (),
                module_eps=_norm_eps(module) if phase == "forward" else None,
                collapsed_scale=_collapsed_scale(self._model) if phase == "loss" else None,
                first_input_peak=_input_peak(
                    [i for i in self._failing_items if isinstance(i, ForwardRecord)][:1]
                )
                if phase == "forward" and op is not None and forward > 1
                else None,
                previous_input_peak=_input_peak(
                    [
                        i
                        for i in self._failing_items
                        if isinstance(i, ForwardRecord) and i.number == forward - 1
                    ]
                )
                if phase == "forward" and op is not None and forward > 2
                else None,
                stale_outside=tuple(stale_outside),
            )
        )

    def _is_model(self, module: nn.Module) -> bool:
        """The watched model (or what a replay runs for it: a compile wrapper's original)."""
        root = self._recorder.root
        if module is self._model or (
            root is not None and (module is root.module or module is replay_target(root.module))
        ):
            return True
        # (The model a watched DDP/FSDP wrapper holds, called as ddp.module(x) for evaluation.)
        return is_data_parallel(self._model) and module is getattr(self._model, "module", None)

    @staticmethod
    def _reproducible(item: Item, site: int) -> bool | None:
        if site in item.unreproduced_sites or getattr(item, "unreproduced", False):
            # (Unknown when the replay drew from the user's own generator: other numbers.)
            return None if getattr(item, "own_generators", False) else False
        if isinstance(item, ForwardRecord) and (site in item.ops or item.exact):
            return True
        return None

    def _origin_event(
        self,
        item: Item,
        f: Finding,
        flags: list[int],
        now: float,
        *,
        forwards_seen: bool = True,
        masked_outputs: bool = False,
        allowed_inf: bool = False,
        direct_calls: tuple[str, ...] = (),
        transformed: bool = False,
    ) -> Event:
        stats = self.origin_stats(item, f)
        if (
            isinstance(item, ForwardRecord)
            and f.reason in ("output", "own_code")
            and f.site not in item.unreproduced_sites
        ):
            self.describe(item, f)  # the operation and its source line (one replay)
        kind = f.kind
        if stats is not None and stats.nonfinite_count:
            kind = "nan" if stats.nan_count else "inf"
        elif stats is not None and f.site in item.unreproduced_sites:
            stats = None  # the replay's finite values are not the tensor the probe saw
            item.problems.setdefault(f.site, "the replay did not make it again")
        site = item.sites[f.site]
        details: dict[str, Any] = {"reason": f.reason}
        problem = item.problems.get(f.site)
        if problem is not None and stats is None:
            details["stats_problem"] = problem
        samples: tuple[int, ...] = ()
        batch = n_samples = sample_dim = 0
        if f.reason == "input" and isinstance(item, ForwardRecord) and item.replay is not None:
            path = item.sites[f.site].path
            batch_input = self._input_tensor(item, path)
            if batch_input is not None and not _in_list(item.replay, path):
                # Which samples of the batch (the live tensor, exact). Not for a tensor in a
                # list (torchvision's list of images: its dim 0 is a channel, its index in
                # the list the sample, named in the path already).
                sample_dim = _batch_dim(item, f.site)
                samples, n_samples, batch = bad_samples(
                    batch_input, dim=sample_dim, batch=_other_batch(item, path)
                )
                columns = _bad_columns(batch_input, sample_dim)
                if columns:
                    details["columns"] = list(columns)
                packed = _packed_parent(item, path)
                if packed is not None:  # its rows are time steps of samples, not samples
                    samples, n_samples, batch, steps = _packed_samples(packed)
                    details["time_steps"] = list(steps)
        elif f.reason in ("output", "own_code") and isinstance(item, ForwardRecord):
            # Which samples of the batch a layer made it in, when only some (a constant
            # series' zero std, a sequence padded whole): the batch dim is the one as long
            # as the model's batch (dim 1 first: a time-major model's).
            size, major = _batch_of(item), 0
            if item.frames and item.frames[0].inputs:
                first_input = item.frames[0].inputs[0]
                major = _batch_dim(item, first_input) or _time_major(item, first_input)
                if major and len(item.sites[first_input].shape) > 1:
                    size = item.sites[first_input].shape[1]
            # Dim 1 only for a model known to be time-major; dim 0 only when the model's
            # outputs agree that it is the batch (a time-major loop of cells returning
            # (batch, ...) does not: its dim 0 is time).
            rows = item.rows.get(f.site)
            outputs = [item.sites[s].shape for s in item.frames[0].outputs] if item.frames else []
            agreed = major or not outputs or any(len(o) and o[0] == size for o in outputs)
            # (...and no module called once per entry of dim 0 on slices without it: a cell
            # stepped over time, z[t] for t in range(T), takes dim 0 for time; a block
            # shared by several layers is given the whole batch each time)
            if agreed and not major and size is not None:
                calls = collections.Counter(id(fr.module) for fr in item.frames[1:])
                agreed = not any(
                    calls[id(fr.module)] == size
                    and fr.inputs
                    and item.sites[fr.inputs[0]].shape[:1] != (size,)
                    for fr in item.frames[1:]
                )
            if rows is not None and size is not None and size > 1 and agreed:
                first, count, length = rows[1 if major else 0]
                if length == size and 0 < count < size:
                    samples, n_samples, batch, sample_dim = first, count, size, major
                    details["samples"] = list(first)
        outside = (
            _outside_weights(
                item.node, self._failing_items, {id(p) for p in self._model.parameters()}
            )
            if f.reason == "loss" and isinstance(item, LossRecord)
            else ()
        )
        origin = Origin(
            step=item.step,
            reason=f.reason,
            samples=samples,
            n_samples=n_samples,
            sample_dim=sample_dim,
            batch=batch,
            columns=tuple(details.get("columns", ())),
            time_steps=tuple(details.get("time_steps", ())),
            kind=kind,
            stats=stats,
            shape=tuple(site.shape),
            dtype=str(site.dtype),
            stats_problem=problem if stats is None else None,
            loss_propagated=f.loss_propagated,
            outputs_seen=forwards_seen,
            transformed=transformed and f.reason == "loss",
            # A submodule called on its own (not from the model's forward): its input was
            # made by code between calls, or is the data.
            direct=f.reason == "input"
            and isinstance(item, ForwardRecord)
            and bool(item.frames)
            and not self._is_model(item.frames[0].module),
            masked_outputs=(masked_outputs or (allowed_inf and kind == "inf"))
            and f.reason == "loss",
            output_peak=self._output_peak if f.reason == "loss" else None,
            independent=f.independent,
            direct_calls=direct_calls if f.reason == "loss" else (),
            outside_weights=tuple(tuple(w.shape) for w in outside),
            stale_outside=_stale_weights(outside, self.stepped_since_loss),
        )
        module = module_type = None
        call = None
        tensor = site_label(site)
        propagated: tuple[str, ...] = ()
        if isinstance(item, ForwardRecord) and f.frame is not None:
            frame = item.frames[f.frame]
            module, module_type, call = frame.name, frame.type_name, frame.call
            labels = [
                _frame_label(item.frames[i]) for i in f.propagated if not _wrapper_frame(item, i)
            ]
            propagated = tuple(labels[:10])
            origin.module, origin.module_type, origin.call = module, module_type, call
            origin.propagated, origin.n_propagated = propagated, len(labels)
            origin.tensor = tensor
            if f.absorbed_by is not None:
                origin.absorbed_by = _frame_label(item.frames[f.absorbed_by])
                details["absorbed_by"] = origin.absorbed_by
            if f.reason == "own_code" and f.consumer is not None:
                origin.consumer = _frame_label(item.frames[f.consumer])
                details["passed_to"] = origin.consumer
                if isinstance(item, ForwardRecord):
                    # -Inf it was given (not as a mask) that its code made NaN of: the log of
                    # a 0 in the data, or a mask under a name that is not a mask's.
                    origin.received_neginf = tuple(
                        input_label(p)
                        for i, p in zip(frame.inputs, frame.input_paths, strict=True)
                        if flags[i] & NEGINF and not self.is_mask_arg(item, f.frame, p)
                    )
                    origin.masks_received = tuple(
                        input_label(p)
                        for p in frame.input_paths
                        if (mask := item.input_stats.get((f.frame, p))) is not None
                        and mask.neginf_count
                        and not mask.nan_count + mask.posinf_count
                        and input_label(p) not in origin.received_neginf
                    )
                tensor = f"{tensor} of {origin.consumer}"
                if isinstance(item, ForwardRecord) and item.ops.get(f.site) is None:
                    # (No operation made it from finite values in a replay: it was read.)
                    origin.stale_attributes = _nonfinite_attributes(frame.module)
                if origin.stale_attributes:
                    details["nonfinite_attributes"] = list(origin.stale_attributes)
                # Submodules without hooks (TorchScript, exclude=) run as part of its code.
                hooked = {id(h.module) for h in self._recorder.modules}
                origin.unhooked = tuple(
                    (name, type(child).__name__)
                    for name, child in frame.module.named_children()
                    if id(child) not in hooked
                )[:3]
            if f.reason in ("output", "own_code") and isinstance(item, ForwardRecord):
                origin.no_tensor_inputs = not frame.inputs
                if not frame.inputs and f.frame == 0 and item.replay is not None:
                    given: list[tuple[Path, Tensor]] = []
                    collect(item.replay.args, ("args",), given, objects=True)
                    collect(item.replay.kwargs, ("kwargs",), given, objects=True)
                    floats = any(t.is_floating_point() or t.is_complex() for _, t in given)
                    origin.integer_inputs = bool(given) and not floats  # (token ids, masks)
                    if floats:  # (given, only not recorded: a compiled call's inputs)
                        origin.no_tensor_inputs = False
            if f.reason == "output":
                self._describe_inputs(item, f.frame, flags, origin)
                origin.pre_hooks = _pre_hooks(frame.module)
                origin.builtin = type(frame.module).__module__.startswith("torch.nn.")
                bad = _nonfinite_tensors(frame.module, frame.name, self._unneeded_buffers)
                made = item.ops.get(f.site) if isinstance(item, ForwardRecord) else None
                if made is not None and all(
                    s is None or not s.nonfinite_count for s in made.inputs
                ):
                    bad = []  # (made from finite values: no weight or mask of its explains it)
                origin.nonfinite_params = bad
                if bad:
                    details["nonfinite_params"] = bad
                    params = {n for n, _ in frame.module.named_parameters(recurse=False)}
                    origin.nonfinite_buffers_only = not any(
                        n.rpartition(".")[2] in params for n in bad
                    )
        phase = {"input": "input", "loss": "loss"}.get(f.reason, "forward")
        op = item.ops.get(f.site) if isinstance(item, ForwardRecord) else None
        origin.op = op
        origin.reproducible = self._reproducible(item, f.site)
        origin.own_generators = (
            origin.reproducible is None
            and getattr(item, "own_generators", False)
            and (f.site in item.unreproduced_sites or getattr(item, "unreproduced", False))
        )
        origin.hint = self._hint(
            f,
            phase=phase,
            kind=kind,
            reason=f.reason,
            module_type=module_type,
            stats=stats,
            dtype=str(site.dtype),
            op=op,
            mask_inputs=bool(origin.mask_inputs),
            params_nonfinite=bool(origin.nonfinite_params),
            buffers_nonfinite=origin.nonfinite_buffers_only,
            step=item.step,
            call_inputs=tuple(s for _, s in origin.inputs),
            forward=item.number,
            updates=item.updates if isinstance(item, ForwardRecord) else None,
            loss_ops=_loss_nodes(item.node, self._failing_items)
            if isinstance(item, LossRecord) and f.reason == "loss"
            else (),
            stale_outside=origin.stale_outside,
            item=item,
            fed_back=isinstance(item, ForwardRecord)
            and tuple(site.shape) in (item.replaces or item).previous_outputs
            and not (item.replaces or item).previous_backward,
            rebuilt=f.reason == "input" and _rebuilt(item, site, self._failing_items),
            module=frame.module if f.reason in ("output", "own_code") else None,
            call=_repeated_call(item, f),
        )
        if f.reason == "loss" and not forwards_seen and is_specific(origin.hint):
            # (The loss rules assume finite outputs, which went unchecked: sentinel mode over
            # a model trained through its methods, a compiled train step.)
            origin.hint = (
                "The model's outputs went unchecked (no forward of it was recorded); if they "
                f"were finite: {origin.hint[0].lower()}{origin.hint[1:]}"
            )
        elif (f.reason == "loss" and not forwards_seen) or origin.direct:
            origin.hint = None  # the loss rules assume finite outputs; the data rules, data
        elif (
            op is None
            and item.problems.get(f.site) == "the replay did not make it again"
            and item.number > 1
            and self._options.perturbs
        ):
            # A later forward of a SAM step, NaN with weights its replay (after second_step
            # put them back) finds finite: first_step's perturbation rho * g / ||g||.
            origin.hint = (
                "SAM's first_step perturbs the weights by rho * g / ||g||: a gradient norm of 0 "
                "(a batch the loss already fits: all-zero gradients) makes it 0/0, and this "
                "forward likely computed with NaN weights. Add an eps: rho / (grad_norm + "
                "1e-12)."
            )
        elif (
            origin.reproducible is False
            and isinstance(item, ForwardRecord)
            and not item.grad
            and (layer := _fast_path_layer(self._model, self._options.names)) is not None
        ):
            # Evaluation under no_grad: torch's fused kernel ran in the step, which the
            # replay's hooks turn off; it gives NaN where a sample is padded whole.
            origin.fast_path = layer
            origin.hint = (
                f"In eval() under no_grad, {layer} takes torch's fused inference kernel (off "
                "in the hooked replay), which gives NaN for a sample whose padding mask is all "
                "True (an empty sequence). Drop empty samples, or exclude=(nn."
                "TransformerEncoderLayer,) to check that kernel as it runs."
            )
        elif (
            origin.reproducible is False
            and isinstance(item, ForwardRecord)
            and not is_specific(origin.hint)
            and (self._recorder.compiled or any(is_compiled(m) for m in self._model.modules()))
        ):
            # Compiled code made it, which computes otherwise than the eager replay.
            origin.compiled = True
            origin.hint = (
                "The step ran torch.compile'd code, which computes otherwise than this eager "
                "replay (a reduction's order, half-precision math in float32, inductor's own "
                "random numbers): a value at a domain's edge (a variance rounding below 0 "
                "under a sqrt) can go non-finite there only. Compare with backend='aot_eager', "
                "or compile block by block to find the place."
            )
        elif (
            op is None
            and isinstance(item, ForwardRecord)
            and item.in_step
            and item.number > 1
            and str(item.problems.get(f.site, "")).startswith("optimizer.step() changed")
        ):
            # A later closure call of a step (LBFGS at a trial point): the weights its move
            # made are gone, and with them the operation; the move is the likely cause.
            origin.hint = (
                "This forward ran inside optimizer.step(), a later closure call after the "
                "weights moved (LBFGS at a trial point): a move far too large for the data "
                "took them where values overflow (exp) or leave an operation's domain (log). "
                "Use line_search_fn='strong_wolfe', a smaller lr, or scale the inputs."
            )
        elif origin.masked_outputs:
            origin.hint = _MASKED_LOSS_HINT if kind == "inf" else _MASKED_LOSS_NAN_HINT
        message = origin_message(origin)
        if (
            isinstance(item, LossRecord)
            and f.reason == "loss"
            and kind == "nan"
            and item.step == self._masked_inference_step
            and not origin.masked_outputs
        ):
            # A forward of the step with gradients off returned -inf masks (a DPO reference
            # pass, a rollout): not the training outputs, but the loss may read them.
            note = (
                " An inference forward of this step (gradients off: a reference pass, a "
                "rollout) returned -inf written on purpose (a mask): if the loss reads it, two "
                "-inf log-probabilities subtracted are NaN (a DPO log-ratio at a token both "
                "mask): mask with torch.finfo(dtype).min, or leave such tokens out."
            )
            message += note
            origin.hint = f"{origin.hint or ''}{note}".strip()
            details["inference_masks"] = True
        saturated = (
            self._stayed_inside and kind == "inf" and phase == "forward" and _saturated_mask(op)
        )
        if saturated:
            # An additive mask of finfo.min plus a negative bias (T5's position_bias + mask in
            # float16): -inf only where the mask is, which the softmax absorbed. A mask.
            details["reason"] = "saturated_mask"
            assert op is not None  # (see _saturated_mask)
            message = (
                f"nanguard: step {item.step}: -Inf in {module or 'the model'} "
                f"({module_type}): `{op.name}` met an additive mask of torch.finfo(dtype).min "
                "(or a constant the dtype cannot hold), which rounds to -inf there "
                f"(at {op.source or 'its forward'}). Only masked positions, absorbed before "
                "leaving the model: a mask, not an origin."
            )
        elif self._stayed_inside and kind == "inf" and phase == "forward":
            # (An accidental overflow stays an origin, even hidden: the values there are not
            # what the model computes. T5's float16 guard clamps them on purpose.)
            details["hidden"] = True
            message += (
                " Nothing non-finite left the model (its outputs, the loss and the gradients "
                "were finite): a later activation or its own code hid the Inf (a ReLU maps "
                "-Inf to 0; a clamp, as T5's float16 guard does; nan_to_num), and training "
                "would go on with those values. To train on with them (an Inf written on "
                "purpose, or a clamp you accept, as T5's), pass "
                f"allow_inf=({repr(module) if module else module_type},) (NaN is still "
                "reported); an overflow in float16 goes away in bfloat16 or float32."
            )
        if f.reason == "loss" and world_size() > 1:
            message += (
                f" With {world_size()} ranks: if the loss gathers tensors from every rank "
                "(all_gather of embeddings in a contrastive loss), another rank's NaN arrives "
                "that way; if another rank reports an origin in this step, look there first."
            )
        number = item.number
        if number > 1:  # (a micro-batch, a call of a decoding loop)
            if isinstance(item, LossRecord):
                details["loss"] = number
                message += f" (The loss was number {number} of those checked in the step.)"
            else:
                details["forward"] = number
                message += f" (It was forward {number} of the step.)"
        if phase == "input" and isinstance(item, ForwardRecord) and not item.grad:
            # (A validation batch: the data to look at is the evaluation set's.)
            details["inference"] = True
            message += (
                " (It was an inference forward, with gradients off: an evaluation or "
                "validation batch, not a training one, or an RL rollout's data collection.)"
            )
        elif (
            phase in ("input", "forward")
            and isinstance(item, ForwardRecord)
            and (item.replaces or item).eval_mode  # (as it ran, not as a replay did)
            and not (item.replaces or item).grads
            and item.raised is None
            and not self._recorder.eval_trained  # (eval()-mode training gets backwards)
            and (
                not _loss_follows(self._failing_items, item.replaces or item)
                # (a validation loss checked, with training in train() mode beside it)
                or any(
                    isinstance(i, ForwardRecord) and i.grad and not i.in_eval
                    for i in self._failing_items
                )
            )
        ):
            # (A validation loop without torch.no_grad(): counted in the next training step.)
            details["eval_without_backward"] = True
            message += (
                " (It was a forward in eval() mode with gradients on that no backward "
                "reached: a validation batch run without torch.no_grad(), not a training one.)"
            )
        elif phase == "forward" and isinstance(item, ForwardRecord) and not item.grad:
            # (Counted in the training step that follows it: say which forward it was.)
            details["inference"] = True
            message += (
                " (It was an inference forward, with gradients off: an evaluation, "
                "validation or generation call, not a training one.)"
            )
        return self._event(
            step=item.step,
            phase=phase,
            module=module,
            module_type=module_type,
            kind=kind,
            is_origin=not saturated,
            stats=stats,
            message=message,
            call=call,
            tensor=tensor,
            propagated=propagated,
            n_propagated=origin.n_propagated,
            time=now,
            details=details,
            # (A derivative taken inside the forward: the backward node says which.)
            op=None if op is None else f"{op.name} in {op.node}" if op.node else op.name,
            source=op.source if op is not None else None,
            hint=origin.hint,
            reproducible=origin.reproducible,
        )

    def _describe_inputs(
        self, item: ForwardRecord, frame_index: int, flags: list[int], origin: Origin
    ) -> None:
        frame = item.frames[frame_index]
        masks = {
            i
            for i, p in zip(frame.inputs, frame.input_paths, strict=True)
            if flags[i] & INF and self.is_mask_arg(item, frame_index, p)
        }
        stats = item.input_stats
        described = [
            (p, stats[frame_index, p])
            for i, p in zip(frame.inputs, frame.input_paths, strict=True)
            if (frame_index, p) in stats and i not in masks
        ]
        # The first few, taking each argument in turn: a list of images does not hide the
        # targets passed after it (where a zero-width box came from).
        taken: dict[Path, int] = {}  # per argument, how many of its tensors came before
        turns = []
        for k, (p, _) in enumerate(described):
            turn = taken.get(p[:2], 0)
            taken[p[:2]] = turn + 1
            turns.append((turn, k))
        shown = sorted(k for _, k in sorted(turns)[:_LISTED_INPUTS])
        origin.inputs = [(input_label(described[k][0]), described[k][1]) for k in shown]
        origin.more_inputs = len(described) - len(shown)
        origin.mask_inputs = [
            input_label(p)
            for i, p in zip(frame.inputs, frame.input_paths, strict=True)
            if i in masks
        ]
        origin.mask_args = _mask_parameters(frame.module)
        # Where a -Inf it read (not as a mask) came from: the call that returned it.
        for i in frame.inputs:
            site = item.sites[i]
            if (
                i not in masks
                and flags[i] & NEGINF
                and site.role == "output"
                and 0 <= site.frame != frame_index
            ):
                maker = item.frames[site.frame]
                origin.inf_made_by = f"`{_frame_label(maker)}` ({maker.type_name})"
                break

    def _backward_event(self, item: ForwardRecord, f: Finding, now: float) -> Event:
        op = item.ops.get(-1) if f.reason != "loss_backward" else None
        if f.reason == "backward" and f.frame is not None and op is not None and op.source:
            # The gradient of an input that a call and its parent's own code both used
            # (``self.proj(x) + torch.sqrt(x.var(-1))``): the operation's node was created
            # in the parent's forward, not in the call's.
            owner = _source_owner(item, f.frame, op)
            if owner is not None:
                f.reason, f.frame = "own_code_backward", owner
        stats = self.origin_stats(item, f)
        kind = f.kind
        if stats is not None and stats.nonfinite_count:
            kind = "nan" if stats.nan_count else "inf"
        details: dict[str, Any] = {"reason": f.reason}
        problem = item.problems.get(~f.site) if f.site >= 0 else None
        if problem is not None and stats is None:
            details["stats_problem"] = problem
        frame = item.frames[f.frame] if f.frame is not None else None
        param = None
        tensor = "grad"
        given = False  # (parameters its parent gave it, not its own)
        param_stats: list[tuple[str, TensorStats]] = []
        if f.reason == "backward_params" and frame is not None:
            called = {
                id(c.module)
                for i in self._failing_items
                if isinstance(i, ForwardRecord)
                for c in i.frames
            }
            held = [
                # (named as now: modules moved since the table was built, see _sweep_now)
                (self._renaming.get(owned.name, owned.name), p)
                for module in _held_modules(frame.module, called, self._recorder.watched_ids())
                for owned, p in map(self.params.params.__getitem__, self.params.of_module(module))
            ] or [  # (a module put in after the table was built: its own, by its name)
                (f"{frame.name}.{local}" if frame.name else local, p)
                for local, p in frame.module._parameters.items()
                if p is not None
            ]
            for name, p in held:
                if p.grad is not None and flags_of_tensor(p.grad):
                    param_stats.append((name, tensor_stats(p.grad)))
            if param_stats:
                param, stats = param_stats[0]
                kind = "nan" if stats.nan_count else "inf"
                tensor = f"grad of {param}"
            child = (
                _source_child(item, f.frame, op)
                if op is not None and op.where and f.frame is not None
                else None
            )
            if child is not None:
                # Its weight went through a child's forward, whose backward made the NaN.
                details["params_of"] = frame.name
                frame, given = item.frames[child], True
        elif f.site >= 0:
            site = item.sites[f.site]
            if f.reason == "backward" and frame is not None:
                path = next(
                    (
                        p
                        for s, p in zip(frame.inputs, frame.input_paths, strict=True)
                        if s == f.site
                    ),
                    site.path,
                )
                tensor = f"grad of {input_label(path)}"
            elif f.reason == "loss_backward":
                top = item.frames[0] if item.frames else None
                if top is not None and top.output_paths and f.site in top.outputs:
                    # Where the model returned it (a child's output keeps its own path).
                    path = top.output_paths[top.outputs.index(f.site)]
                    tensor = f"grad of {format_path('output', path)}"
                else:
                    tensor = f"grad of {site_label(site)}"
            else:
                producer = item.frames[site.frame]
                label = _frame_label(producer)
                top = item.frames[0] if item.frames else None
                if not label and top is not None and top.output_paths and f.site in top.outputs:
                    path = top.output_paths[top.outputs.index(f.site)]
                    tensor = f"grad of {format_path('output', path)}"  # the model's own output
                else:
                    tensor = f"grad of {site_label(site)}" + (f" of {label}" if label else "")
        if (
            f.reason == "backward_params"
            and problem is None
            and item.param_grads_finite is None
            and self._localisation_problem is not None
        ):
            # Named from .grad at the step's end alone (clip_grad_norm_ by a NaN norm, or a
            # hook, may have spread it there): say why no replay could check it.
            problem = self._localisation_problem
        labels = [  # (passthrough modules, a Dropout, are left out as in forward paths)
            _frame_label(item.frames[i])
            for i in f.propagated
            if not _wrapper_frame(item, i) and not item.frames[i].hooked.passthrough
        ]
        phase = "loss" if f.reason == "loss_backward" else "backward"
        reproducible = (
            False
            if ~f.site in item.unreproduced_sites
            else (True if op is not None or item.exact else None)
        )
        drawn = reproducible is False and item.own_generators
        if drawn:
            reproducible = None
        second = reproducible is False and item.double_backward
        if second:
            # The step differentiated a derivative through the model (a gradient penalty, a
            # Jacobian regulariser, a PINN's second derivative): a replay reruns the first
            # order only, so its finite values say nothing of the second.
            reproducible = None
            if stats is not None and not stats.nonfinite_count:
                stats, problem = None, "a replay reruns the first-order backward only"
        hint_text = self._hint(
            f,
            phase=phase,
            kind=kind,
            reason=f.reason,
            module_type=frame.type_name if frame is not None else None,
            stats=stats,
            dtype=stats.dtype if stats is not None else None,
            op=op,
            step=item.step,
            updates=item.updates,
            module=frame.module if frame is not None else None,
        )
        grad_out = item.output_grads.get(f.site) if f.reason == "loss_backward" else None
        if grad_out is not None and grad_out.dim() >= 2:
            # Only some samples' gradients at the outputs: those samples' targets (a NaN
            # label, a NaN loss weight) before the loss's formula.
            rows, n_rows, batch = bad_samples(grad_out)
            if 0 < n_rows < batch:
                details["samples"] = list(rows)
                named = ", ".join(map(str, rows)) + (" and more" if n_rows > len(rows) else "")
                noun, whose = ("sample", "that sample's") if n_rows == 1 else ("samples", "their")
                hint_text = (
                    f"Only {noun} {named} (of {batch} along dim 0) of the gradient at the "
                    f"outputs went non-finite: look at {whose} targets and loss terms first (a "
                    f"NaN label or weight, a zero distance under a sqrt). {hint_text or ''}"
                ).strip()
        message = backward_message(
            step=item.step,
            reason=f.reason,
            kind=kind,
            module=frame.name if frame is not None else None,
            module_type=frame.type_name if frame is not None else None,
            call=frame.call if frame is not None else 0,
            tensor=tensor,
            stats=stats,
            params=param_stats,
            propagated=labels[:10],
            n_propagated=len(labels),
            problem=problem,
            op=op,
            hint=hint_text,
            reproducible=reproducible,
            loss_checked=self._loss_checked,
            own_generators=drawn,
            given=given,
        )
        if f.independent:  # (a second origin of the backward: q_norm's beside k_norm's)
            message = message.replace(
                "first appeared in the backward pass",
                "was also made, independently, in the backward pass",
                1,
            )
        if second:
            message += _SECOND_DERIVATIVE
        if item.number > 1:  # (a micro-batch of gradient accumulation: its backward)
            details["forward"] = item.number
            message += f" (It was the backward of forward {item.number} of the step.)"
        return self._event(
            op=None if op is None else f"{op.name} in {op.node}" if op.node else op.name,
            source=op.source if op is not None else None,
            hint=hint_text,
            reproducible=reproducible,
            step=item.step,
            phase="loss" if f.reason == "loss_backward" else "backward",
            module=frame.name if frame is not None else None,
            module_type=frame.type_name if frame is not None else None,
            param=param,
            kind=kind,
            is_origin=True,
            stats=stats,
            message=message,
            call=frame.call if frame is not None else None,
            tensor=tensor,
            propagated=tuple(labels[:10]),
            n_propagated=len(labels),
            time=now,
            details=details,
        )

    def _propagated_event(
        self, item: Item, f: Finding, origin: str | None, now: float, own: bool = False
    ) -> Event:
        """``own``: the output of the very call whose own code made it (the origin)."""
        if isinstance(item, LossRecord) or f.frame is None:
            return self._event(
                step=item.step,
                phase="loss",
                module=None,
                module_type=None,
                kind=f.kind,
                is_origin=False,
                message=propagated_message(item.step, f.kind, "the loss", None, origin),
                tensor="loss",
                time=now,
                # (which loss of the step, as its origin would say: a micro-batch's)
                **({"details": {"loss": item.number}} if item.number > 1 else {}),
            )
        frame = item.frames[f.frame]
        where = f"`{frame.name}`" if frame.name else "the model"
        backward = f.reason in _BACKWARD
        kind, label = f.kind, site_label(item.sites[f.site])
        if backward:
            where = f"the backward of {where}"
        else:
            kind = _exact_kind(kind, item.stats.get(f.site))
            if f.site in frame.outputs and f.site not in frame.inputs:
                # Its output, first seen under another name (a child's input it returned)
                label = _output_label(frame, f.site)
        return self._event(
            step=item.step,
            phase="backward" if backward else "forward",
            module=frame.name,
            module_type=frame.type_name,
            kind=kind,
            is_origin=False,
            message=propagated_message(
                item.step, kind, where, frame.type_name, origin, own=own and not backward
            ),
            call=frame.call,
            tensor=("grad of " if backward else "") + label,
            time=now,
            **({"details": {"forward": item.number}} if item.number > 1 else {}),
        )

    def _grad_events(
        self,
        bad_grads: dict[int, int],
        step: int,
        any_origin: bool,
        now: float,
        nan_clip: bool = False,
        items: Sequence[Item] = (),
        own_backward: Collection[str | None] = (),
    ) -> list[Event]:
        """``own_backward``: modules whose backward made their own parameters' gradients
        non-finite (the step's origins): another module's may be its own doing too."""
        events = []
        # (clip_grad_norm_ by a NaN norm makes every gradient NaN: no order tells then)
        reached = not nan_clip
        ordered = self._backward_order(sorted(bad_grads), items) if reached else sorted(bad_grads)
        clipped_only: list[str] = []  # made NaN by clip_grad_norm_ alone
        if nan_clip and any_origin:
            # A replay recomputed what the backward made: the other gradients were finite
            # until clip_grad_norm_ multiplied them by max_norm / NaN.
            replays = [
                item.replayed_bad_params
                for item in items
                if isinstance(item, ForwardRecord) and item.replayed_bad_params is not None
            ]
            if replays:
                made = frozenset().union(*replays)
                params = self.params.params
                clipped_only = [params[i][0].name for i in ordered if id(params[i][1]) not in made]
                ordered = [i for i in ordered if id(params[i][1]) in made]
        limit = max(1, self._options.max_propagated)
        for n, index in enumerate(ordered[:limit]):
            owned, param = self.params.params[index]
            renamed = self._renaming.get(owned.name)
            if renamed is not None:  # (pruned in this step: weight is weight_orig now)
                owned = owned._replace(name=renamed, local=renamed.rpartition(".")[2])
            stats = tensor_stats(param.grad) if param.grad is not None else None
            exact = bad_grads[index]
            kind = "nan" if exact & NAN else "inf"
            origin = not any_origin and n == 0
            events.append(
                self._event(
                    step=step,
                    phase="grad",
                    module=owned.owner_name,
                    module_type=type(owned.owner).__name__,
                    param=owned.name,
                    kind=kind,
                    is_origin=origin,
                    stats=stats,
                    message=grad_message(
                        step,
                        owned.name,
                        type(owned.owner).__name__,
                        kind,
                        stats,
                        origin,
                        len(ordered),
                        self._unlocalised(items) if origin else None,
                        maybe_own=bool(own_backward) and owned.owner_name not in own_backward,
                        reached_first=reached,
                    ),
                    tensor=f"grad of {owned.name}",
                    time=now,
                    details={"bad_parameters": len(ordered)},
                )
            )
        if nan_clip:
            events = [self._with_clip_note(e, clipped_only) for e in events]
            if clipped_only and not events:
                events.append(self._clip_event(clipped_only, step, now))
        return events

    def _backward_order(self, indices: list[int], items: Sequence[Item]) -> list[int]:
        """Parameters in the order the backward reached them: those of the module called
        last in the step's forward first. A NaN a backward made spreads to the modules
        called before it, never after: the first is the nearest to where it was made
        (reentrant checkpointing, which a replay cannot look inside, would otherwise name
        the embedding for a NaN made in the last block's attention)."""
        last: dict[int, tuple[int, int]] = {}
        for n, item in enumerate(items):
            if isinstance(item, ForwardRecord) and item.grad:
                for i, frame in enumerate(item.frames):
                    last[id(frame.module)] = (n, i)
        if not last:
            return indices
        params = self.params.params
        never = (-1, -1)  # (not called: after those that were)
        # Modules whose calls no frame recorded (a sentinel step's, without its replay):
        # those held last, most often called last, first.
        held: dict[int, int] = {}
        for i in indices:
            held.setdefault(id(params[i][0].owner), len(held))

        def order(i: int) -> tuple[tuple[int, int], int]:
            owner = id(params[i][0].owner)
            return last.get(owner, never), held[owner]

        return sorted(indices, key=order, reverse=True)

    def _with_clip_note(self, event: Event, clipped_only: list[str]) -> Event:
        if clipped_only:
            shown = ", ".join(f"`{n}`" for n in clipped_only[:3])
            more = f" and {len(clipped_only) - 3} more" if len(clipped_only) > 3 else ""
            note = (
                f" The gradients of {len(clipped_only)} other parameters ({shown}{more}) were "
                "finite until clip_grad_norm_ scaled them by max_norm / NaN (its total norm was "
                "not finite)."
            )
        else:
            note = (
                " clip_grad_norm_ scaled every gradient by max_norm / NaN (its total norm was "
                "not finite): gradients finite before clipping are NaN now too."
            )
        details = {**event.details, "clip_total_norm_nonfinite": True}
        if clipped_only:
            details["made_nonfinite_by_clipping"] = clipped_only[:100]
        return dataclasses.replace(event, message=event.message + note, details=details)

    def _clip_event(self, clipped_only: list[str], step: int, now: float) -> Event:
        shown = ", ".join(f"`{n}`" for n in clipped_only[:5])
        more = ", ..." if len(clipped_only) > 5 else ""
        return self._event(
            step=step,
            phase="grad",
            module=None,
            module_type=None,
            kind="nan",
            is_origin=False,
            message=(
                f"nanguard: step {step}: clip_grad_norm_ scaled every gradient by max_norm / NaN "
                f"(its total norm was not finite): the gradients of {len(clipped_only)} "
                f"parameters ({shown}{more}) were finite until then (propagated, not an origin)."
            ),
            time=now,
            details={
                "clip_total_norm_nonfinite": True,
                "made_nonfinite_by_clipping": clipped_only[:100],
            },
        )

    def _capped(self, events: list[Event], now: float) -> list[Event]:
        """The first ``max_propagated`` parameter events, then one event for the rest (a
        step that corrupts a 500-layer model would log 1000 events otherwise)."""
        limit = max(1, self._options.max_propagated)
        if len(events) <= limit + 1:
            return events
        kept, rest = events[:limit], events[limit:]
        first = rest[0]
        names = [e.param for e in rest if e.param is not None]
        what = "buffers" if all(e.details.get("buffer") for e in rest) else "parameters"
        listed = ", ".join(f"`{n}`" for n in names[:5]) + (", ..." if len(names) > 5 else "")
        return [
            *kept,
            self._event(
                step=first.step,
                phase=first.phase,
                module=None,
                module_type=None,
                kind="nan" if any(e.kind == "nan" for e in rest) else first.kind,
                is_origin=False,
                message=(
                    f"nanguard: step {first.step}: {len(rest)} more {what} are non-finite too "
                    f"({listed}); the first {limit} are reported one by one (max_propagated)."
                ),
                time=now,
                details={"more": len(rest), "names": names[:100]},
            ),
        ]

    def _unlocalised(self, items: Sequence[Item] = ()) -> str:
        """Why no module's backward could be named for bad parameter gradients."""
        if not self._options.replay and any(
            isinstance(i, ForwardRecord) and i.coarse for i in items
        ):
            return (
                "a sentinel step probes only the model's outputs and its parameters' "
                "gradients, and replay=False: nothing looked inside the model"
            )
        if self._recorder.backward_mode == "probes":
            return "every module's gradient probe saw only finite values"
        if self._recorder.backward_mode == "off":
            return "the backward is not checked (backward=False)"
        if self._recorder.forwards == 0:
            return (
                "no forward of the model was recorded in this step, so no gradient crossing "
                "it was checked: its forward() was not called (its methods or submodules "
                "were: a LightningModule's training_step calling self.model; watch that "
                "module), or it ran where its hooks stand aside, inside a compiled function "
                "calling it or a torch.compile wrapper made after watch(), or inside "
                "torch.func transforms"
            )
        problem = self._localisation_problem or (
            "replay=False" if not self._options.replay else None
        )
        if problem is None:
            return "the gradients crossing the model's boundary were finite"
        return (
            "the gradients crossing the model's boundary were finite, and the replay that "
            f"would look inside could not run: {problem}"
        )

    def _first_bad_grad(
        self, bad_grads: dict[int, int]
    ) -> tuple[list[int], Owned, TensorStats | None, str]:
        """The parameters with bad gradients in order; the first one's owner and gradient
        statistics; the kind of them all."""
        ordered = sorted(bad_grads)
        owned, param = self.params.params[ordered[0]]
        stats = tensor_stats(param.grad) if param.grad is not None else None
        kind = "nan" if any(bad_grads[i] & NAN for i in ordered) else "inf"
        return ordered, owned, stats, kind

    def _left_over(self, bad_grads: Mapping[int, int]) -> int | None:
        """The step whose non-finite gradients ``.grad`` still holds, the very tensors, when
        every bad one is so: nobody zeroed them (``opt.zero_grad()`` after ``opt.step()``,
        skipped when the ``NonFiniteError`` that step raised was caught), and this step's
        backward added its own to them."""
        refs = self._bad_grad_refs
        if not bad_grads or not refs:
            return None
        params = self.params.params
        for index in bad_grads:
            param = params[index][1]
            ref = refs.get(id(param))
            if ref is None or param.grad is None or ref() is not param.grad:
                return None
        return self._bad_grad_refs_step

    def _left_over_event(
        self, bad_grads: dict[int, int], step: int, since: int, now: float
    ) -> Event:
        def says(name: str, word: str, count: int, more: str) -> str:
            return (
                f"nanguard: step {step}: the gradients of {count} parameters (`{name}`...) "
                f"still hold the {word} of step {since}: this step's backward made finite "
                "gradients and added them to .grad, which nobody zeroed since (propagated from "
                f"step {since}, not an origin). A loop that calls opt.zero_grad() after "
                "opt.step() skips it when the NonFiniteError raised there is caught: zero the "
                "gradients in the except block (or before the backward)."
            )

        return self._held_grads_event(
            bad_grads, step, now, says, origin=False, reason="not_zeroed", origin_step=since
        )

    def _stale_grads_event(self, bad_grads: dict[int, int], step: int, now: float) -> Event:
        """Non-finite gradients .grad held before the guard was attached, about to be
        applied by the optimizer step that ends this one."""

        def says(name: str, word: str, count: int, more: str) -> str:
            return (
                f"nanguard: step {step}: the gradient of `{name}`{more} holds {word}, and it "
                "was in .grad already when watch() began: no backward since made it (the step "
                "an earlier guard stopped before optimizer.step()?). That guard named where it "
                "came from; zero the gradients (optimizer.zero_grad()) before this optimizer "
                "step applies them."
            )

        return self._held_grads_event(
            bad_grads, step, now, says, origin=True, reason="before_watch"
        )

    def _held_grads_event(
        self,
        bad_grads: dict[int, int],
        step: int,
        now: float,
        says: Callable[[str, str, int, str], str],
        *,
        origin: bool,
        **details: Any,
    ) -> Event:
        """An event on gradients .grad holds that no backward of this step made (``says``:
        the message from the first one's name, NaN or Inf, their count and "(N in all)")."""
        ordered, owned, stats, kind = self._first_bad_grad(bad_grads)
        word = "NaN" if kind == "nan" else "Inf"
        more = f" ({len(ordered)} parameters in all)" if len(ordered) > 1 else ""
        return self._event(
            step=step,
            phase="grad",
            module=owned.owner_name,
            module_type=type(owned.owner).__name__,
            param=owned.name,
            kind=kind,
            is_origin=origin,
            stats=stats,
            message=says(owned.name, word, len(ordered), more),
            tensor=f"grad of {owned.name}",
            time=now,
            details={**details, "bad_parameters": len(ordered)},
        )

    def _through_stored(self, event: Event, items: list[Item]) -> Event:
        """Gradients autograd seemed to make finite, from the model's outputs: but a loss
        term the model keeps as an attribute (``self.aux_loss``, a router's balance term, a
        Bayesian layer's KL) took its own path back into the weights, which that replay
        does not run. Its backward is the likely origin, not a write after autograd."""
        for name, module in module_names(self._model):
            for attribute, value in vars(module).items():
                if (
                    not isinstance(value, Tensor)
                    or value.grad_fn is None
                    or not value.is_floating_point()
                    or not _loss_uses(items, value)
                ):
                    continue
                nodes: list[str] = []
                seen = {value.grad_fn}
                queue = collections.deque([value.grad_fn])
                while queue and len(seen) <= 256:  # (the node kinds outlive the backward)
                    node = queue.popleft()
                    try:
                        nodes.append(_node_kind(node))
                        following = [n for n, _ in node.next_functions if n is not None]
                    except (RuntimeError, AttributeError):
                        continue
                    for n in following:
                        if n not in seen:
                            seen.add(n)
                            queue.append(n)
                slopes = loss_slopes(
                    HintContext(phase="backward", kind=event.kind, reason="loss_backward",
                                loss_ops=tuple(nodes))
                )  # fmt: skip
                display = self._options.names.get(module, name)
                owner = f"`{display}`" if display else "the model"
                which = f"`self.{attribute}` of {owner} ({type(module).__name__})"
                message = (
                    f"{event.message.split(', yet ')[0]}, yet this step's forward, loss and "
                    "the backward from the model's outputs were finite. The loss also used "
                    f"{which}, a term the forward kept as an attribute: its backward, which "
                    "that replay does not run, made it. Look at how it is computed"
                    + (f": its operations include {'; '.join(slopes)}." if slopes else ".")
                )
                details = {**event.details, "reason": "stored_backward", "stored": attribute}
                return dataclasses.replace(
                    event,
                    module=display,
                    module_type=type(module).__name__,
                    message=message,
                    details=details,
                    hint=(f"Its operations include {'; '.join(slopes)}." if slopes else None),
                )
        return event

    def _external_grads_event(
        self,
        bad_grads: dict[int, int],
        step: int,
        now: float,
        double_backward: bool,
        unseen: bool = False,
        sharded: bool = False,
        transformed: bool = False,
        coarse: bool = False,
    ) -> Event:
        """Autograd made finite gradients, ``.grad`` holds non-finite ones: written after
        (or made through a double backward, which a replay from the outputs misses, or
        through the model's calls inside torch.func transforms, ``transformed``; or
        ``sharded``: reduce-scattered across ranks inside the backward)."""
        ordered, owned, stats, kind = self._first_bad_grad(bad_grads)
        world = world_size()
        reason = (
            "allreduce"
            if world > 1
            else "double_backward"
            if double_backward or transformed
            else "external"
        )
        message = external_grads_message(
            step,
            world,
            owned.name,
            kind,
            stats,
            len(ordered),
            double_backward,
            unseen,
            sharded,
            probed=self._recorder.backward_mode == "probes",
            transformed=transformed,
            coarse=coarse,
            log_path=self._options.log_path,
        )
        probed = self._recorder.backward_mode == "probes"
        if reason == "external" and not probed:
            # (What the replay's recomputed backward says only holds if the replay ran the
            # step as it ran: a user's pre-hook drawing a new mask each call does not.)
            hooked = next(
                (
                    (name, hooks)
                    for name, module in module_names(self._model)
                    if (hooks := _pre_hooks(module))
                ),
                None,
            )
            if hooked is not None:
                where = f"`{hooked[0]}`" if hooked[0] else "the model"
                message += (
                    f" The replay ran the forward pre-hooks of {where} ({', '.join(hooked[1])}) "
                    "again: one with side effects (drawing the next mask or value of a "
                    "schedule) makes the replay differ from the step, and a NaN its backward "
                    'made goes unseen; backward="probes" checks the step itself.'
                )
        return self._event(
            step=step,
            phase="grad",
            module=owned.owner_name,
            module_type=type(owned.owner).__name__,
            param=owned.name,
            kind=kind,
            # With several ranks it came from another one: not born here.
            is_origin=world == 1,
            stats=stats,
            message=message,
            tensor=f"grad of {owned.name}",
            time=now,
            hint=_external_grads_hint(world, double_backward, transformed, unseen, sharded),
            details={
                "reason": reason,
                "local_gradients_finite": None if unseen or sharded else True,
                "bad_parameters": len(ordered),
                "world_size": world,
                **({"sharded": True} if sharded else {}),
            },
        )

    def _foreign_stepper(self, tensor: Tensor) -> str | None:
        """Another optimizer that moved ``tensor`` in this step, if any: its name, and its
        learning rate when that is not finite (``"Adam with the learning rate nan"``)."""
        for ref, rates in self.foreign_steppers:
            optimizer = ref()
            if optimizer is None:
                continue
            for index, group in enumerate(optimizer.param_groups):
                if any(p is tensor for p in group["params"]):
                    name = type(optimizer).__name__
                    if index in rates:
                        return f"{name} with the learning rate {rates[index]}"
                    return name
        return None

    def _param_event(
        self,
        owned: Owned,
        tensor: Tensor,
        exact: int,
        step: int,
        now: float,
        caused: bool,
        when: int | None = None,
        before: bool | None = None,
        written: bool = False,
        copied: bool = False,
        rate: str | None = None,
        stepper: str | None = None,
        fed: bool = False,
        in_forward: bool = False,
        writer: OpInfo | None = None,
    ) -> Event:
        """``before``: it was so before anything ran (default: when ``step`` is 0);
        ``written``: finite when the guard was attached, and no optimizer step since;
        ``copied``: a weight not trained, written from weights already non-finite;
        ``rate``: moved by a step with this non-finite learning rate (reported);
        ``stepper``: moved within this step by this other optimizer than optimizer=;
        ``in_forward``: a buffer its module's forward writes in place, made non-finite
        there from finite values; ``writer``: the operation that did (a replay's)."""
        stats = tensor_stats(tensor)
        kind = "nan" if exact & NAN else "inf"
        is_param = owned.local in owned.owner._parameters
        if stepper is not None:
            grad = tensor.grad
            return self._event(
                step=step, phase="param", module=owned.owner_name,
                module_type=type(owned.owner).__name__, param=owned.name, kind=kind,
                is_origin=True, stats=stats,
                message=stepper_message(
                    step, owned.name, type(owned.owner).__name__, kind, stats, stepper,
                    grad is not None and bool(flags_of_tensor(grad)),
                ),
                tensor=owned.name, time=now,
                details={"buffer": False, "reason": "other_optimizer", "optimizer": stepper},
                hint=(
                    "A learning rate schedule of that optimizer divided by 0 or overflowed: "
                    "look at its formula at this step (warm-up from step 0)."
                    if " with the learning rate " in stepper
                    else f"Check what {stepper} minimises (a critic's target, a "
                    "discriminator's loss): pass that loss to guard.check_loss(), or watch its "
                    "network with its own guard and optimizer=."
                ),
            )  # fmt: skip
        written = written and is_param and not caused
        op = writer
        if when is None:
            # Checked at the start of `step`: changed in the one before (or in this step's
            # forward, when no optimizer step ran yet).
            when = step if written else max(step - 1, 0)
        before_training = False if written else step == 0 if before is None else before
        outside = None
        if is_param and not caused and not before_training and not written:
            outside = self._not_updated(tensor)
        # Added since the guard last listed the model's parameters (LoRA adapters injected
        # after watch()): its gradient was not checked, so nothing says the update made it.
        listed = self._grads_listed
        unlisted = is_param and not caused and listed is not None and id(tensor) not in listed
        # Its optimizer state already non-finite (a checkpoint's, loaded with it): the update
        # carried it in from finite gradients.
        state, eps = (
            _optimizer_view(self._options.optimizer, tensor)
            if is_param and not caused and not before_training and not written and not outside
            else (None, None)
        )
        return self._event(
            step=when,
            phase="param",
            module=owned.owner_name,
            module_type=type(owned.owner).__name__,
            param=owned.name,
            kind=kind,
            # (Explained by an origin of the step that applied it, when there is one.)
            is_origin=not caused and not (unlisted and self._origin_step >= when),
            stats=stats,
            message=param_message(
                when,
                owned.name,
                type(owned.owner).__name__,
                kind,
                stats,
                is_param,
                before_training=before_training,
                caused=caused,
                copied=copied,
                fed=fed,
                rate=rate,
                # (A training step's: a skip, or a batch the loop dropped, puts them back.)
                put_back=self._options.on_nonfinite == "skip_step" and self._step_trains,
                # (Buffers probed at every step's end: made in this step.)
                since=when if self._probed_each_step(owned) else self._prior_sweep + 1,
                outside=outside,
                written=written,
                unlisted=unlisted,
                adaptive=self._options.optimizer is None
                or adaptive_optimizer(type(self._options.optimizer).__name__),
                in_forward=in_forward,
                op=op,
                grads_read=self._watch_grads,
                bad_state=state,
                optimizer_eps=eps,
            ),
            tensor=owned.name,
            time=now,
            details={
                "buffer": not is_param,
                **({"reason": "written_in_forward"} if in_forward else {}),
                **({"reason": "optimizer_state"} if state else {}),
            },
            op=None if op is None else op.name,
            source=None if op is None else op.source,
            hint=self._hint(
                None,
                phase="forward",
                kind=kind,
                reason="own_code",
                module_type=type(owned.owner).__name__,
                stats=stats,
                dtype=stats.dtype,
                op=op,
                step=when,
                module=owned.owner,
            )
            if op is not None
            else _INF_WEIGHT_HINT
            if owned.name in self._inf_weights and not caused
            else self._hint(
                None,
                phase="param",
                kind=kind,
                reason=("before_training" if is_param else "buffer_before_training")
                if before_training
                else "written_in_forward"
                if written
                else "outside_optimizer"
                if outside is not None
                else "param",
                stats=stats,
                dtype=stats.dtype,
                step=when,
                updates=self._recorder.updates,
                module=owned.owner,
                param=tensor if is_param else None,
            )
            if (is_param or before_training) and not caused and not unlisted
            else None,
        )

    def _buffer_writer(self, items: list[Item], owned: Owned, exact: int) -> OpInfo | None:
        """The operation in the forward of ``owned``'s module that made the value it wrote
        into that buffer, found by replaying the step's forward."""
        kind = "nan" if exact & NAN else "inf"
        if self._options.replay:
            for item in items:
                if isinstance(item, ForwardRecord) and item.frames and item.replay is not None:
                    result = replay(self._recorder, item, frozenset(), watch=(owned.owner, kind))
                    if result.op is not None:
                        return result.op
        return None

    def _not_updated(self, param: Tensor) -> str | None:
        """Why no optimizer update can have made this parameter non-finite, if none can."""
        # (A trained parameter the guard's optimizer does not hold is another optimizer's:
        # its update is as likely a cause as for the guard's own, overflows and all.)
        return None if param.requires_grad else "It is not trained (requires_grad=False)"

    def _grad_norm_event(
        self,
        step: int,
        alarm: GradNormAlarm,
        grad_indices: list[int],
        now: float,
        clipped: Clipped | None = None,
        beside: Event | None = None,
    ) -> Event:
        """``beside``: the origin of a non-finite value found in the same step."""
        grads = self._grads_of(grad_indices, range(len(grad_indices)))
        norms = exact_norms(grads) if len(grads) == len(grad_indices) else []
        params = self.params.params
        if clipped is not None:  # each weight's norm before clipping
            factors = self._clip_factors(clipped)
            norms = [
                n * factors.get(id(params[i][1]), 1.0)
                for i, n in zip(grad_indices, norms, strict=True)
            ]
        named = sorted(
            ((params[i][0].name, n) for i, n in zip(grad_indices, norms, strict=False)),
            key=lambda pair: -pair[1] if math.isfinite(pair[1]) else -math.inf,
        )[:5]
        location = user_location()
        details: dict[str, Any] = {
            "norm": alarm.norm,
            "judged_norm": alarm.norm * alarm.scale,
            "reference": alarm.reference,
            "limit": alarm.limit,
            "reason": alarm.reason,
            "top": [[name, norm] for name, norm in named],
            "location": location,
        }
        if clipped is not None:
            details["clipped_to"] = clipped.max_norm
            details["norm_after_clipping"] = clipped.after
        return self._event(
            step=step,
            phase="grad",
            module=None,
            module_type=None,
            kind="grad_norm",
            is_origin=False,
            message=grad_norm_message(
                step,
                alarm,
                named,
                location,
                clipped.max_norm if clipped else None,
                batch=(self._batch, self._batch_max) if alarm.scale != 1.0 else None,
                beside=None if beside is None else origin_place(beside),
            ),
            tensor="total gradient norm",
            time=now,
            details=details,
        )

    def _param_threshold_events(
        self,
        step: int,
        grad_indices: list[int],
        groups: Groups,
        squares: list[float],
        now: float,
    ) -> list[Event]:
        limit = self._options.param_norm_threshold
        if limit is None:
            return []
        events = []
        # With a per-parameter threshold every group is one gradient (see resolve()).
        per_param = [
            (grad_indices[members[0]], math.sqrt(v) if v >= 0 else v)
            for (_, members), v in zip(groups, squares, strict=True)
        ]
        for index, norm in per_param:
            name = self.params.params[index][0].name
            if math.isfinite(norm) and norm > limit:
                if name in self._param_alarms:
                    continue
                self._param_alarms.add(name)
                alarm = GradNormAlarm("param_threshold", norm, None, limit)
                owned = self.params.params[index][0]
                events.append(
                    self._event(
                        step=step,
                        phase="grad",
                        module=owned.owner_name,
                        module_type=type(owned.owner).__name__,
                        param=name,
                        kind="grad_norm",
                        is_origin=False,
                        message=grad_norm_message(step, alarm, [(name, norm)], user_location()),
                        tensor=f"grad of {name}",
                        time=now,
                        details={"norm": norm, "limit": limit, "reason": "param_threshold"},
                    )
                )
            elif norm < limit * 0.5:
                self._param_alarms.discard(name)
        return events

    def _overflow_events(
        self, items: list[Item], host: list[float], layout: _Layout, now: float
    ) -> list[Event]:
        fraction = self._options.overflow_fraction
        if fraction is None:
            return []
        events = []
        for item, (start, _) in zip(items, layout.items, strict=True):
            if not isinstance(item, ForwardRecord) or not item.half_outputs:
                continue
            risky: set[int] = set()  # sites at risk in this forward
            covered: set[int] = set()  # frames enclosing a call that was at risk
            for index in item.half_outputs:
                site = item.sites[index]
                lo, hi = host[start + site.start], host[start + site.start + 1]
                limit = torch.finfo(site.dtype).max
                # (The dtype's extreme, a finfo.min mask written on purpose; or next to its
                # lowest, such a mask plus a bias: T5's position_bias + mask in float16.)
                peak = max(
                    abs(v)
                    for v in (lo, hi, 0.0)
                    if abs(v) != limit and not (v < 0 and -v >= _NEAR_LOWEST * limit)
                )
                if not (math.isfinite(peak) and peak >= fraction * limit):
                    continue
                risky.add(index)
                at = site.frame
                frame = item.frames[at]
                # Only where the large values first appear: not a call that received them
                # (a dropout after the layer), nor the blocks around that layer.
                if at in covered or any(s in risky for s in frame.inputs):
                    continue
                parent = frame.parent
                while parent >= 0 and parent not in covered:
                    covered.add(parent)
                    parent = item.frames[parent].parent
                key = _frame_label(frame)
                if key in self._warned_overflow:
                    continue
                self._warned_overflow.add(key)
                message = overflow_message(
                    item.step, key, frame.type_name, site_label(site), peak, limit, str(site.dtype)
                )
                details = {"max_abs": peak, "dtype_max": limit, "fraction": peak / limit}
                events.append(self._risk_event(item, frame, site, message, details, now))
            if self._hand_norms is None:  # (once: most models hold none, no walk a step)
                self._hand_norms = any(_hand_norm(type(m)) for m in self._model.modules())
            if self._hand_norms:
                events.extend(self._squared_norm_inputs(item, host, start, now))
        return events

    def _squared_norm_inputs(
        self, item: ForwardRecord, host: list[float], start: int, now: float
    ) -> list[Event]:
        """A norm written by hand (a class named ``*Norm`` not torch's, which compute in
        float32) given float16 values past 256: a variance or mean square taken in float16
        is Inf (x ** 2 > 65504), and rsqrt(Inf) = 0 zeroes the row with nothing non-finite
        leaving the module (LLaMA's RMSNorm without its .float())."""
        for frame in item.frames:
            if not _hand_norm(type(frame.module)):
                continue
            for index in frame.inputs:
                site = item.sites[index]
                if site.dtype is not torch.float16 or site.nvalues != 2:
                    continue
                lo, hi = host[start + site.start], host[start + site.start + 1]
                peak = max(abs(lo), abs(hi))
                key = _frame_label(frame)
                if (
                    not (math.isfinite(peak) and peak > _SQUARE_LIMIT)
                    or key in self._warned_overflow
                ):
                    continue
                self._warned_overflow.add(key)
                message = (
                    f"nanguard: step {item.step}: `{key}` ({frame.type_name}) is given float16 "
                    f"values up to {peak:.6g}: past 256 their squares overflow float16 (x ** 2 > "
                    "65504). If it takes the mean square or variance in float16 (no .float() "
                    "first), that is Inf, and rsqrt(Inf) = 0 silently zeroes the row. Compute "
                    "it in float32 (x.float().pow(2).mean(-1))."
                )
                details = {"max_abs": peak, "squares_overflow": True}
                # (the first such norm of the forward: the rest follow it)
                return [self._risk_event(item, frame, site, message, details, now)]
        return []

    def _risk_event(
        self,
        item: ForwardRecord,
        frame: Frame,
        site: Site,
        message: str,
        details: dict[str, Any],
        now: float,
    ) -> Event:
        """An ``overflow_risk`` warning about ``site``, a tensor of call ``frame``."""
        return self._event(
            step=item.step,
            phase="forward",
            module=frame.name,
            module_type=frame.type_name,
            kind="overflow_risk",
            is_origin=False,
            message=message,
            call=frame.call,
            tensor=site_label(site),
            time=now,
            details=details,
        )

    @property
    def amp_past_floor(self) -> bool:
        """GradScaler is skipping steps in a run that took its scale to the floor: not the
        overflows scaling fixes (skip_step counts them toward max_consecutive_skips)."""
        return self.amp_skips > 0 and self._amp_floor_reached

    def _amp_events(
        self, step: int, before: float, after: float, skipped: bool, now: float, mine: bool
    ) -> list[Event]:
        events: list[Event] = []
        self.last_scale = after
        if not skipped:
            self.amp_skips = 0
            self._amp_collapse_reported = False
            self._amp_floor_reached = False
            return events
        self.amp_skips += 1
        details = {"scale_before": before, "scale_after": after, "consecutive": self.amp_skips}
        floor = self._options.amp_scale_floor if self._amp_floor_reached else None
        weights = self._bad_weights() if self._bad_params else None
        events.append(
            self._event(
                step=step,
                phase="grad",
                module=None,
                module_type=None,
                kind="amp_overflow",
                is_origin=False,
                message=amp_skip_message(
                    step, before, after, self.amp_skips, mine, floor=floor, weights=weights
                ),
                tensor="gradients",
                time=now,
                details=details,
            )
        )
        collapse = (
            self.amp_skips >= self._options.amp_max_skips or after <= self._options.amp_scale_floor
        )
        if after <= self._options.amp_scale_floor and not self._amp_floor_reached:
            # Not an overflow that scaling fixes: localise this step's gradients as if
            # GradScaler had not skipped it (once per collapse; the warning after
            # amp_max_skips skips may have come earlier, at a scale still above the floor).
            self._amp_floor_reached = True
            self._amp_localise = True
        if after == 0.0 < before:
            # (Told once: every later update keeps it at 0.)
            events.append(
                self._event(
                    step=step, phase="grad", module=None, module_type=None,
                    kind="amp_overflow", is_origin=False, message=amp_dead_message(step),
                    tensor="gradients", time=now,
                    details={**details, "collapse": True, "scale_zero": True},
                )
            )  # fmt: skip
        if collapse and not self._amp_collapse_reported:
            self._amp_collapse_reported = True
            events.append(
                self._event(
                    step=step,
                    phase="grad",
                    module=None,
                    module_type=None,
                    kind="amp_overflow",
                    is_origin=False,
                    message=amp_collapse_message(
                        step, after, self.amp_skips, self._options.amp_scale_floor, weights
                    ),
                    tensor="gradients",
                    time=now,
                    details={**details, "collapse": True},
                )
            )
        return events


_RUNNING_STATS: Final = frozenset({"running_mean", "running_var"})
#: Steps a replay's proof that a model absorbs the same bad gradients holds, and how many
#: such proofs are kept (variable shapes make new ones).
_ABSORBED_PROOF_STEPS: Final = 50
_ABSORBED_PROOFS_KEPT: Final = 64

#: Steps between checks that the parameter table still lists the model's tensors.
_TABLE_CHECK_EVERY: Final = 16
#: A value this close to a half-precision dtype's lowest is a finfo.min mask plus a bias.
_NEAR_LOWEST: Final = 0.999
_LOSS_ON_DERIVATIVES: Final = (
    " The loss was built on derivatives taken through the model (torch.autograd.grad(..., "
    "create_graph=True)): if it is made of second derivatives (u_xx: autograd.grad of a "
    "derivative), the NaN may come from the model's backward differentiated again, which a "
    "replay does not rerun: an operation whose second derivative is infinite where its slope "
    "is finite (a norm or atan2 of a vector that can be 0, a collocation point at the origin)."
)
_SECOND_DERIVATIVE: Final = (
    " This step took a derivative through the model (torch.autograd.grad(..., "
    "create_graph=True)) and its backward differentiated it again: a second derivative made "
    "it, which a replay does not rerun. Look for an operation whose second derivative is "
    "infinite where its value and slope are finite (a norm, atan2 or sqrt of a vector that "
    "can be 0: a collocation point at the origin, a blank image): give it an eps."
)
#: How many of an origin's finite inputs its message lists.
_LISTED_INPUTS: Final = 4
#: Events of one failing step reported one by one: origins, and the others.
_STEP_ORIGINS: Final = 8
_STEP_OTHERS: Final = 16

_INF_WEIGHT_HINT: Final = (
    "This weight holds +/-inf on purpose (allow_inf), and an update of an infinite entry is "
    "NaN: weight decay adds wd * -inf to its gradient, then Adam's moments divide inf by inf. "
    "Put such parameters in a param group with weight_decay=0, or write a large finite value "
    "(-1e4) instead of -inf."
)
_MASKED_LOSS_HINT: Final = (
    "The model's outputs hold -inf on purpose (masked logits), and the loss reads a masked "
    "one: a target that is a masked class (its log-probability is -inf: check the targets "
    "against the mask), or a term over every class (cross_entropy with label_smoothing, a "
    "KL divergence to a uniform or a prior, an entropy bonus). Mask with a moderate "
    "negative (-1e4: torch.finfo(dtype).min overflows a sum over classes) instead of -inf, "
    "or leave the masked classes out of that term."
)
_MASKED_LOSS_NAN_HINT: Final = (
    "The model's outputs hold -inf on purpose (masked logits). A row masked whole (a state "
    "with no legal action, a sample of padding only) normalises to NaN (-inf - -inf in a "
    "log_softmax, Categorical(logits=...)): keep one entry of every row unmasked (a no-op "
    "action) or leave such rows out. Two -inf log-probabilities subtracted are NaN too (a "
    "DPO or PPO log-ratio, policy - reference, at a token both mask). An entropy or KL term "
    "over them is 0 * -inf = NaN at "
    "the masked classes (mask with torch.finfo(dtype).min, or leave them out of that term); "
    "else, as with any loss: NaN in the targets, an exp that overflowed (a ratio "
    "exp(new - old)), a std over a single element."
)


def _external_grads_hint(
    world: int, double_backward: bool, transformed: bool, unseen: bool, sharded: bool
) -> str | None:
    """What to change when gradients nanguard did not see made ``.grad`` non-finite."""
    if world > 1 or sharded:
        return None
    if unseen:
        return (
            "Check the per-sample gradient computation (vmap(grad(...)), DP-SGD): clipping "
            "divides by each sample's norm, C / (norm + eps) with eps > 0; a loss term NaN for "
            "one sample is NaN in the sum."
        )
    if double_backward:
        return (
            "A gradient penalty's norm written by hand, sqrt(sum(g**2)), has an infinite "
            "slope where the gradient is 0: add an eps, sqrt(sum(g**2) + 1e-12), or use "
            "g.norm(); check divisions by a gradient norm too."
        )
    if transformed:
        return (
            "sqrt or a norm of a Jacobian (torch.func) that is 0 somewhere has an infinite "
            "slope at 0: add an eps, sqrt(x + 1e-12); check divisions by it too."
        )
    return None


_BACKWARD = frozenset({"backward", "backward_params", "own_code_backward", "loss_backward"})


def _take_output_uses(item: ForwardRecord, replayed: ForwardRecord) -> None:
    """What a backward replay of ``item`` saw of the model's use of its own outputs."""
    item.internal_outputs = replayed.internal_outputs
    item.frame_uses = replayed.frame_uses
    item.loss_bad_outputs = replayed.loss_bad_outputs


def _false_alarm(item: Item, f: Finding, stats: TensorStats) -> bool:
    """Exact statistics show only finite values where the probe did not: an overflowing
    float32/64 sum of huge finite values (a false alarm), unless a replay simply did not
    reproduce the value (then it is kept, marked not reproducible)."""
    if f.reason == "loss" or (
        f.reason == "input" and isinstance(item, ForwardRecord) and not item.coarse
    ):
        return True  # computed from the live tensor: exact
    site = item.sites[f.site] if f.reason not in _BACKWARD else None
    return _sum_overflows(site, stats)


def _sum_overflows(site: Site | None, stats: TensorStats | None) -> bool:
    """Whether a finite tensor with these statistics can have a non-finite probe sum
    (``site`` None: a gradient, always probed by its sum)."""
    summed = site is None or (site.nvalues == 1 and site.dtype in (torch.float32, torch.float64))
    if not summed or stats is None or stats.min is None or stats.max is None:
        return False
    peak = max(abs(stats.min), abs(stats.max))
    return peak * stats.numel >= float(torch.finfo(torch.float32).max)


def _overflowed_outputs(coarse: ForwardRecord, flags: list[int], full: ForwardRecord) -> bool:
    """Every output a sentinel step flagged is finite in the replay and so large that its
    probe sum overflowed: a false alarm, not a value the replay failed to reproduce."""
    pairs = list(zip(coarse.frames[0].outputs, full.frames[0].outputs, strict=False))
    flagged = [(old, new) for old, new in pairs if flags[old]]
    if not flagged or any(flags[s] for s in range(len(flags)) if s not in dict(pairs)):
        return False
    return all(_sum_overflows(full.sites[new], full.stats.get(new)) for _, new in flagged)


def _rebuilt(item: Item, site: Site, items: Sequence[Item]) -> bool:
    """Whether an input ``site`` of a later forward of the step has the path and shape of
    one an earlier forward of the same model was given (finite: else that one is the
    origin) that required its gradient: the code between them built it from that
    gradient (an adversarial attack's perturbed batch; not a micro-batch's)."""
    if not isinstance(item, ForwardRecord) or item.number < 2 or not item.frames:
        return False
    model = item.frames[0].module
    key = (site.path, tuple(site.shape))
    for other in items:
        if (
            not isinstance(other, ForwardRecord)
            or other.number >= item.number
            or other.replay is None
            or not other.frames
            or other.frames[0].module is not model
            or not any(
                s.frame == 0 and s.role == "input" and (s.path, tuple(s.shape)) == key
                for s in other.sites
            )
        ):
            continue
        earlier = Resolver._input_tensor(other, site.path)
        if earlier is not None and earlier.requires_grad and _perturbed(earlier, item, site):
            return True
    return False


def _perturbed(earlier: Tensor, item: ForwardRecord, site: Site) -> bool:
    """Whether the batch at ``site`` of ``item`` is ``earlier`` moved a little (an attack's
    step): most finite values within a quarter of ``earlier``'s spread of it. A next
    micro-batch from the loader is unrelated to the one before."""
    later = Resolver._input_tensor(item, site.path)
    if later is None or later.shape != earlier.shape or not later.is_floating_point():
        return False
    with torch.no_grad():
        a, b = earlier.detach().float(), later.detach().float()
        both = torch.isfinite(a) & torch.isfinite(b)
        if not bool(both.any()):
            return False
        spread = float(a[both].std()) if int(both.sum()) > 1 else 0.0
        near = (a - b).abs()[both] <= 0.25 * spread + 1e-12
        return float(near.float().mean()) >= 0.5


def _dropped_by_loop(
    items: list[Item], flags: list[list[int]], discarded: Collection[int] = ()
) -> bool:
    """Whether every forward (or loss) of the step that went non-finite had no backward, or
    one whose non-finite gradients the loop then zeroed (``discarded``, by id): the loop
    dropped that batch itself (``if not torch.isfinite(loss): continue``, or after the
    backward, ``if not torch.isfinite(grad_norm): opt.zero_grad(); continue``), and the
    gradients the step applies are another batch's (the caller checks they are finite:
    skip_step has nothing to drop)."""
    failing = [item for item, f in zip(items, flags, strict=True) if any(f)]
    if not failing:
        return False

    def dropped(record: ForwardRecord) -> bool:
        record = record.replaces or record  # (a sentinel step's: its own, not a replay's)
        return not record.grads or id(record) in discarded

    for item in failing:
        if isinstance(item, LossRecord):  # (through the forwards it was computed from)
            forwards = _forwards_under(item.node, items) or _forward_before(item, items)
            if not forwards or not all(map(dropped, forwards)):
                return False
            continue
        if not isinstance(item, ForwardRecord) or not (item.replaces or item).grad:
            return False  # (a sentinel step's: its own backward, not a replay's)
        if not dropped(item):
            return False
    return True


def _forward_before(loss: LossRecord, items: Sequence[Item]) -> list[ForwardRecord]:
    """The step's training forward checked last before ``loss`` (when its graph no longer
    leads to one: the loop let it go)."""
    before = [
        item
        for item in items
        if isinstance(item, ForwardRecord) and item.grad and item.index < loss.index
    ]
    return [max(before, key=operator.attrgetter("index"))] if before else []


def _graph_nodes(
    starts: Sequence[Any], limit: int, expand: Callable[[Any], bool] = lambda node: True
) -> Iterator[Any]:
    """The autograd nodes ``starts`` lead to, breadth first, ``limit`` at the most; a node
    ``expand`` refuses is yielded without what it leads to."""
    seen = set(starts)
    queue = collections.deque(starts)
    given = 0
    while queue and given < limit:
        node = queue.popleft()
        given += 1
        yield node
        try:
            nexts = node.next_functions if expand(node) else ()
        except (RuntimeError, AttributeError):
            continue
        for following, _ in nexts:
            if following is not None and following not in seen:
                seen.add(following)
                queue.append(following)


def _forwards_under(node: Any, items: Sequence[Item], limit: int = 256) -> list[ForwardRecord]:
    """The step's forwards whose outputs the autograd graph of ``node`` (a loss's) reaches."""
    forwards = {
        n: f
        for f in items
        if isinstance(f, ForwardRecord)
        for n in (f.replaces or f).output_node_ids
    }
    if node is None or not forwards:
        return []

    def record_of(node: Any) -> ForwardRecord | None:
        try:
            return forwards.get((id(node), node._sequence_nr()))
        except (RuntimeError, AttributeError):
            return None

    found: list[ForwardRecord] = []
    for reached in _graph_nodes([node], limit, lambda n: record_of(n) is None):
        record = record_of(reached)
        if record is not None and record not in found:
            found.append(record)
    return found


def _batch_told_before(event: Event) -> Event:
    """An input origin's event for a batch reported earlier in its step: propagated."""
    return dataclasses.replace(
        event,
        is_origin=False,
        hint=None,
        message=(
            f"nanguard: step {event.step}: the same {kind_word(event.kind, event.stats)} batch "
            f"(`{event.tensor}`) was given to the model again (an optimizer's closure called "
            "once more, LBFGS): reported above (propagated, not an origin)."
        ),
        details={**event.details, "reason": "input_again"},
    )


def _made_again(event: Event) -> Event:
    """A forward origin whose module and operation (at the same line) made the step's
    earlier origin already: the same cause, in a later call of the step."""
    where = f"`{event.module}`" if event.module else "the model"
    again = (
        f" in forward {event.details['forward']} of the step" if "forward" in event.details else ""
    )
    return dataclasses.replace(
        event,
        is_origin=False,
        hint=None,
        message=(
            f"nanguard: step {event.step}: {kind_word(event.kind, event.stats)} made again by "
            f"{where} ({event.module_type}){again}, with the same operation (`{event.op}`) as "
            "the origin above: the same cause (propagated, not a new origin)."
        ),
        details={**event.details, "reason": "made_again"},
    )


def _after_bad_rate(event: Event) -> Event:
    """A forward origin in a call of the optimizer's closure after its update with a
    non-finite learning rate (LBFGS's later calls): propagated from that rate."""
    where = f"`{event.module}`" if event.module else "the model"
    return dataclasses.replace(
        event,
        is_origin=False,
        hint=None,
        message=(
            f"nanguard: step {event.step}: {kind_word(event.kind, event.stats)} in {where}, in a "
            "call of the optimizer's closure after its update with the non-finite learning "
            "rate reported above (propagated, not an origin)."
        ),
        details={**event.details, "reason": "after_learning_rate"},
    )


def hyperparameter(value: object) -> float:
    """A hyperparameter as a float: a Python number, a numpy scalar, a one-element CPU
    tensor (a schedule array's entry); anything else counts as finite (0.0)."""
    if isinstance(value, float):
        return value
    if isinstance(value, Tensor):  # (on an accelerator: not read, no device sync)
        return float(value) if value.numel() == 1 and value.device.type == "cpu" else 0.0
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return 0.0


def _held_modules(
    module: nn.Module, called: Collection[int], watched: Collection[int]
) -> list[nn.Module]:
    """``module`` and its descendants that no forward of the step called (ids in
    ``called``): weights its own code uses (a cosine classifier normalising
    ``self.cls.weight`` itself), whose gradients its backward makes."""
    found, stack = [module], list(module.children())
    while stack:
        child = stack.pop()
        # (Only one nanguard hooks: another, excluded or put in after watch(), may well
        # have run without a record.)
        if id(child) not in called and id(child) in watched:
            found.append(child)
            stack.extend(child.children())
    return found


def _loss_follows(items: Sequence[Item], record: ForwardRecord) -> bool:
    """Whether a checked loss came right after ``record``'s forward (its own loss: a
    training forward whose backward the loop then skipped)."""
    later = [i for i in items if i.index > record.index]
    return bool(later) and isinstance(min(later, key=lambda i: i.index), LossRecord)


def _mask_parameters(module: nn.Module) -> list[str]:
    """The parameters of ``module.forward`` named like a mask (``key_padding_mask``,
    ``attn_mask``): a bool mask is not probed, yet a fully masked row comes from it."""
    try:
        names = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return []
    return [name for name in names if is_mask_name(name)]


def _stores_nonfinite(items: Sequence[Item], model: nn.Module) -> bool:
    """Whether a module of ``model`` holds, as an attribute, a non-finite tensor its forward
    made with autograd that a checked loss of the step was computed from."""
    for module in model.modules():
        for value in vars(module).values():
            if (
                isinstance(value, Tensor)
                and value.grad_fn is not None
                and (value.is_floating_point() or value.is_complex())
                and flags_of_tensor(value.detach()) & (NAN | POSINF)
                and _loss_uses(items, value)
            ):
                return True
    return False


def _loss_uses(items: Sequence[Item], value: Tensor, limit: int = 4096) -> bool:
    """Whether a checked loss of the step was computed from ``value`` (its autograd graph
    reaches ``value``'s node); true when no loss's graph is known, or too large to tell."""
    target = value.grad_fn
    starts = [i.node for i in items if isinstance(i, LossRecord) and i.node is not None]
    if not starts or target is None:
        return True
    walked = 0
    for node in _graph_nodes(starts, limit):
        if node is target:
            return True
        walked += 1
    return walked >= limit


def _value_of(event: Event) -> str:
    """``"`output[0]` of the model"``: the tensor a forward event is about."""
    owner = f"`{event.module}`" if event.module else "the model"
    return f"`{event.tensor}` of {owner}" if event.tensor else f"the output of {owner}"


def _loss_made_elsewhere(
    events: list[Event],
    at: int,
    origin: Event,
    how: str,
    where: str | None = None,
    subject: str = "the loss",
) -> list[Event]:
    """``events[at]``, a loss origin, was made by ``origin``: put it first and make the
    loss event a propagated one (``how`` it was made). ``where``: also tell the events after
    it, which were told the value was created in the loss. ``subject``: what ``events[at]``
    is about, when not the loss."""
    loss = events[at]
    follow = dataclasses.replace(
        loss,
        is_origin=False,
        message=(
            f"nanguard: step {loss.step}: {subject} is {kind_word(loss.kind, loss.stats)}, "
            f"{how} (see the step's origin)."
        ),
        hint=None,
    )
    rest = events[at + 1 :]
    if where is not None:
        moved = f"created earlier, in {where}"
        rest = [
            dataclasses.replace(e, message=e.message.replace("created earlier, in the loss", moved))
            if "created earlier, in the loss" in e.message
            else e
            for e in rest
        ]
    return [*events[:at], origin, follow, *rest]


#: Layers that take sequences time-major unless built with batch_first=True.
_SEQUENCE_FIRST: Final = (
    nn.RNNBase,
    nn.MultiheadAttention,
    nn.Transformer,
    nn.TransformerEncoder,
    nn.TransformerDecoder,
    nn.TransformerEncoderLayer,
    nn.TransformerDecoderLayer,
)


_CHECKING_HOOKS: Final = ("nanguard", "torch.export", "torch._export")


def _norm_eps(module: nn.Module | None) -> float | None:
    """A torch.nn norm layer's ``eps`` (None: not one, or eps=None, its dtype's)."""
    if not isinstance(module, _TORCH_NORMS):
        return None
    eps = getattr(module, "eps", None)
    return float(eps) if isinstance(eps, (int, float)) else None


def _pre_hooks(module: nn.Module) -> tuple[str, ...]:
    """Names of the module's own forward pre-hooks (the hook-based weight_norm,
    spectral_norm and pruning compute its weight there), nanguard's aside."""
    names = []
    for hook in module._forward_pre_hooks.values():
        inner = hook.func if isinstance(hook, functools.partial) else hook
        if getattr(inner, "__module__", "").startswith(_CHECKING_HOOKS):
            # (nanguard's own, and the inert ones a copied model carries; torch.export's,
            # which check the inputs' shapes and compute nothing)
            continue
        name = getattr(inner, "__name__", None) or type(inner).__name__
        if name not in names:
            names.append(name)
    return tuple(names)


def _batch_dim(record: ForwardRecord, site: int) -> int:
    """The batch dimension of an input: 1 when the first layer that reads it takes its
    sequences time-major (``nn.LSTM`` without ``batch_first=True``), else 0."""
    for frame in record.frames:
        if site in frame.inputs and isinstance(frame.module, _SEQUENCE_FIRST):
            layer = frame.module
            if isinstance(layer, (nn.TransformerEncoder, nn.TransformerDecoder)):
                layer = layer.layers[0] if len(layer.layers) else layer
            first = getattr(layer, "batch_first", None)
            if first is None:  # (a Transformer*Layer keeps it on its self_attn)
                first = getattr(getattr(layer, "self_attn", None), "batch_first", True)
            return 0 if first else 1
    return 0


def _time_major(record: ForwardRecord, given: int) -> int:
    """1 when a time-major sequence layer (``nn.LSTM`` without ``batch_first``) further in
    takes a tensor whose first two dims are those of the model's input ``given`` (a norm or
    an embedding before it kept them), else 0."""
    shape = tuple(record.sites[given].shape[:2])
    for frame in record.frames[1:]:
        if isinstance(frame.module, _SEQUENCE_FIRST) and frame.inputs:
            first = frame.inputs[0]
            if tuple(record.sites[first].shape[:2]) == shape:
                return _batch_dim(record, first)
    return 0


def _fused_kernel_layer(layer: nn.TransformerEncoderLayer) -> bool:
    """Whether torch's fused inference kernel can run this layer at all (what its forward
    checks of the layer itself: batch_first, a relu or gelu, biases, an even head count)."""
    attn = layer.self_attn
    return bool(
        attn.batch_first
        and getattr(layer, "activation_relu_or_gelu", False)
        and attn._qkv_same_embed_dim
        and attn.in_proj_bias is not None
        and attn.num_heads % 2 == 0
        and layer.norm1.eps == layer.norm2.eps
    )


def _running_stats_nan(module: nn.Module) -> bool:
    """Whether a norm's running mean or variance holds NaN (failure path: exact reads)."""
    with torch.no_grad():
        return any(
            isinstance(b, Tensor) and b.is_floating_point() and bool(torch.isnan(b).any())
            for b in (getattr(module, name, None) for name in _RUNNING_STATS)
        )


def _fast_path_layer(model: nn.Module, names: Mapping[nn.Module, str]) -> str | None:
    """The first ``nn.TransformerEncoderLayer`` of a model in eval() (``"`enc.layers.0`"``):
    under no_grad it takes torch's fused kernel, which hooks turn off."""
    if model.training:
        return None
    for name, module in model.named_modules():
        if isinstance(module, nn.TransformerEncoderLayer) and not module.training:
            label = names.get(module, name)
            return f"`{label}`" if label else "the model"
    return None


def _other_batch(record: ForwardRecord, path: Path) -> int | None:
    """The size of dim 0 shared by the model's other tensor inputs of two dimensions or
    more (``None`` when there are none, or they disagree)."""
    assert record.replay is not None
    found: list[tuple[Path, Tensor]] = []
    collect(record.replay.args, ("args",), found, objects=True)
    collect(record.replay.kwargs, ("kwargs",), found, objects=True)
    sizes = {
        t.shape[0]
        for p, t in found
        if p != path and t.dim() >= 2 and t.layout is torch.strided and not t.is_nested
    }
    return sizes.pop() if len(sizes) == 1 else None


def _ran_transformed(items: Sequence[Item]) -> bool:
    """Whether a training forward of the model ran inside torch.func transforms (vmap,
    jacrev, hessian), where nothing is probed."""
    return any(
        isinstance(item, ForwardRecord) and item.unchecked_outputs and item.grad for item in items
    )


def _packed_parent(item: ForwardRecord, path: Path) -> Any:
    """The ``PackedSequence`` whose ``.data`` is at ``path`` in ``item``'s inputs, if any."""
    if len(path) < 2 or path[-1] != "data" or item.replay is None:
        return None
    root = item.replay.args if path[0] == "args" else item.replay.kwargs
    try:
        parent = _lookup(root, path[1:-1])
    except (KeyError, IndexError, AttributeError, TypeError):
        return None
    return parent if isinstance(parent, nn.utils.rnn.PackedSequence) else None


def _packed_samples(
    packed: nn.utils.rnn.PackedSequence, limit: int = 8
) -> tuple[tuple[int, ...], int, int, tuple[int, ...]]:
    """The samples (in the batch's own order) and the time steps of a packed sequence's
    non-finite rows: its rows are time-major, ``batch_sizes[t]`` of them at step ``t``,
    sorted by length (``sorted_indices`` gives each one's sample). Failure path."""
    with torch.no_grad():
        data = packed.data.detach()
        bad = ~torch.isfinite(data.reshape(data.shape[0], -1)).all(dim=1)
        rows = bad.nonzero().flatten().cpu()
        sizes = packed.batch_sizes.cpu().long()
        starts = torch.cumsum(sizes, 0) - sizes
        steps = torch.searchsorted(starts, rows, right=True) - 1
        position = rows - starts[steps]
        order = packed.sorted_indices
        found = order.cpu()[position] if order is not None else position
    samples = sorted(set(found.tolist()))
    times = sorted(set(steps.tolist()))
    return tuple(samples[:limit]), len(samples), int(sizes[0]) if len(sizes) else 0, tuple(times)


def _bad_rows(t: Tensor) -> set[int]:
    """Indices along dim 0 of every sample holding NaN/Inf (exact; failure path)."""
    return set(bad_samples(t, limit=t.shape[0] if t.dim() else 0)[0])


def _bad_rows_of(refs: tuple[Any, ...]) -> dict[tuple[int, ...], set[int]]:
    """For each live output (weak references), its non-finite samples, by shape."""
    rows: dict[tuple[int, ...], set[int]] = {}
    for ref in refs:
        t = ref()
        if isinstance(t, Tensor) and t.is_floating_point():
            rows.setdefault(tuple(t.shape), set()).update(_bad_rows(t))
    return rows


def _bad_columns(t: Tensor, dim: int, limit: int = 8) -> tuple[int, ...]:
    """A table (samples x features, along dim 0): the features holding NaN/Inf, the first
    ``limit``; none when most are bad (then it is the samples that are)."""
    try:
        if t.dim() != 2 or dim != 0 or t.layout is not torch.strided or t.is_complex():
            return ()
        with torch.no_grad():
            bad = (~torch.isfinite(t.detach())).any(0).nonzero().flatten()
            if bad.numel() > max(1, t.shape[1] // 2):
                return ()
            return tuple(int(i) for i in bad[:limit].tolist())
    except (RuntimeError, NotImplementedError):
        return ()


def _output_peak(items: list[Item], host: list[float], layout: _Layout) -> float | None:
    """The largest finite magnitude among the probes of the model's outputs (a sum, or a
    min and a max): huge but finite outputs point at exploding weights."""
    peak: float | None = None
    for item, (start, _) in zip(items, layout.items, strict=True):
        if not isinstance(item, ForwardRecord) or not item.frames:
            continue
        for index in item.frames[0].outputs:
            if index in item.bounded_sites:
                continue  # the logits under a final sigmoid or softmax: not the outputs
            site = item.sites[index]
            # A single probe is a sum: its mean magnitude is a lower bound of the largest.
            numel = math.prod(site.shape) if site.nvalues == 1 else 1
            for v in host[start + site.start : start + site.start + site.nvalues]:
                if math.isfinite(v) and (peak is None or abs(v) / max(numel, 1) > peak):
                    peak = abs(v) / max(numel, 1)
    return peak


def _output_half(items: list[Item]) -> str | None:
    """``"torch.bfloat16"`` or ``"torch.float16"`` when the step's model outputs were in
    half precision (autocast, or a half model): a loss computed from them rounds early."""
    for item in items:
        if isinstance(item, ForwardRecord) and item.frames:
            for index in item.frames[0].outputs:
                dtype = item.sites[index].dtype
                if dtype in (torch.float16, torch.bfloat16):
                    return str(dtype)
    return None


def _weight_peak(model: nn.Module) -> float | None:
    """The largest magnitude among the model's finite floating weights (failure path: one
    multi-tensor reduction, one read)."""
    weights = [
        p.detach()
        for p in model.parameters()
        if p.numel() and p.is_floating_point() and not is_lazy(p)
    ]
    if not weights:
        return None
    with torch.no_grad():
        peaks = torch.stack([n.float() for n in torch._foreach_norm(weights, math.inf)])
        return float(peaks.nan_to_num(0.0, 0.0, 0.0).max())


def _input_peak(items: Sequence[Item]) -> float | None:
    """The largest finite magnitude in the kept inputs of the step's forwards (failure path:
    huge outputs may come from huge data rather than from exploding weights)."""
    peak: float | None = None
    with torch.no_grad():
        for item in items:
            if not isinstance(item, ForwardRecord) or item.replay is None:
                continue
            masks = item.frames[0].hooked.mask_positions if item.frames else frozenset()
            found: list[tuple[Path, Tensor]] = []  # (tensors in dicts and tuples too)
            for i, a in enumerate(item.replay.args):
                if i not in masks:
                    collect(a, (), found, objects=True)
            for k, a in item.replay.kwargs.items():
                if not is_mask_name(k):
                    collect(a, (), found, objects=True)
            args = [t for path, t in found if not any(is_mask_name(str(p)) for p in path)]
            for arg in args:  # not masks: finfo.min in an attention mask is no data
                if not isinstance(arg, Tensor) or not arg.is_floating_point() or not arg.numel():
                    continue
                try:
                    finite = arg.detach()[torch.isfinite(arg.detach())]
                except (RuntimeError, NotImplementedError):  # nested, sparse
                    continue
                if finite.numel():
                    value = float(finite.abs().max())
                    peak = value if peak is None else max(peak, value)
    return peak


def _node_kind(node: Any) -> str:
    """An autograd node's name; a power by a number, with what its exponent makes of it
    (the exponent, a number, outlives the backward): ``x ** 2`` has no infinite slope."""
    name = str(node.name())
    if name != "PowBackward0":
        return name
    try:
        exponent = float(node._saved_exponent)
    except (AttributeError, RuntimeError, TypeError, ValueError):
        return name
    if exponent.is_integer():
        return "PowBackward0:integer"
    return name if exponent < 1 else "PowBackward0:fractional"


#: Nodes between a hand-written softmax's exp and its log: the sum, the ratio, the
#: positives picked out of the similarity matrix.
_EXP_TO_LOG: Final = frozenset(
    {
        "DivBackward0",
        "ReciprocalBackward0",
        "MeanBackward0",
        "MeanBackward1",
        "SumBackward0",
        "SumBackward1",
        "IndexBackward0",
        "DiagonalBackward0",
        "SelectBackward0",
        "GatherBackward0",
        "MaskedFillBackward0",
        "MaskedSelectBackward0",
        "MulBackward0",
        "CumsumBackward0",  # (a Cox partial likelihood: log(cumsum(exp(h))))
    }
)


def _log_of_exps(node: Any, depth: int = 6) -> bool:
    """Whether a ``log`` node takes the log of a ratio or a sum of exps, a few nodes down
    (``-log(exp(pos) / exp(sim).sum(1))``): a softmax or logsumexp written by hand. Not the
    log of an IoU whose boxes were decoded with an exp (a product, a difference between)."""
    # (A sum or a ratio on the way: log(exp(log_std)), a Gaussian NLL's log-scale, is not.)
    frontier = [(n, False) for n, _ in node.next_functions if n is not None]
    for _ in range(depth):
        following: list[tuple[Any, bool]] = []
        for n, summed in frontier:
            name = n.name()
            if name == "ExpBackward0" and summed:
                return True
            if name in _EXP_TO_LOG:
                passed = summed or name in _SUMS_OF_EXPS
                following.extend((m, passed) for m, _ in n.next_functions if m is not None)
        frontier = following
    return False


#: What makes a softmax or a logsumexp of exps: a sum of them, or a ratio.
_SUMS_OF_EXPS: Final = frozenset(
    {
        "DivBackward0",
        "ReciprocalBackward0",
        "SumBackward0",
        "SumBackward1",
        "MeanBackward0",
        "MeanBackward1",
        "CumsumBackward0",
    }
)


#: What lies between a sigmoid and the log of it: 1 - p, and views (p.squeeze(-1)).
_TO_SIGMOID: Final = frozenset(
    {
        "RsubBackward1",
        "RsubBackward0",
        "SubBackward0",
        "NegBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "UnsqueezeBackward0",
        "ViewBackward0",
        "ReshapeAliasBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "IndexBackward0",
        "CloneBackward0",
    }
)


def _log_of_sigmoid(node: Any) -> bool:
    """Whether a ``log`` node takes the log of a sigmoid, or of 1 minus one (a binary
    cross-entropy written by hand on probabilities)."""
    frontier = [n for n, _ in node.next_functions if n is not None]
    for _ in range(3):
        following: list[Any] = []
        for n in frontier:
            name = n.name()
            if name == "SigmoidBackward0":
                return True
            if name in _TO_SIGMOID:
                following.extend(m for m, _ in n.next_functions if m is not None)
        frontier = following
    return False


#: What a sum of log-probabilities passes through on its way to a division by a count.
_LOGS_TO_DIV: Final = frozenset(
    {"SumBackward0", "SumBackward1", "MulBackward0", "MaskedFillBackward0", "NegBackward0"}
)
#: Findings of a module's backward (not the loss's).
_MODULE_BACKWARD: Final = frozenset({"backward", "backward_params", "own_code_backward"})
_LOG_NODES: Final = frozenset({"LogBackward0", "LogSoftmaxBackward0", "SubBackward0"})
#: What ``logits - ...`` subtracts to make log-probabilities: log of a sum of exps, logsumexp.
_LOG_NORMALISERS: Final = frozenset({"LogBackward0", "LogsumexpBackward0"})


def _from_written_posinf(item: ForwardRecord, frame: int | None) -> bool:
    """Whether a call of ``frame`` returned a +inf written on purpose (a distance module
    excluding the diagonal) to its own code, whose -Inf is then of it (log_softmax(-d))."""
    if frame is None:
        return False
    for call in item.frames:
        paths = call.hooked.posinf_paths
        if (
            call.parent == frame
            and paths
            and any(item.sites[s].path in paths for s in call.outputs)
        ):
            return True
    return False


def _renames(old: ParamTable, new: ParamTable) -> dict[str, str]:
    """Old name -> new name of the parameters both tables hold under different names."""
    now = {id(p): o.name for o, p in new.params}
    return {o.name: now[id(p)] for o, p in old.params if now.get(id(p), o.name) != o.name}


def _divides_logs(node: Any, depth: int = 3) -> bool:
    """Whether a division's numerator is a (masked) sum of log-probabilities: the mean over
    the positives of each anchor a supervised contrastive loss takes, ``(mask *
    log_prob).sum(1) / mask.sum(1)``, which is 0/0 for an anchor with none."""
    first = node.next_functions[0][0] if node.next_functions else None
    frontier = [first] if first is not None else []
    for _ in range(depth):
        following: list[Any] = []
        for n in frontier:
            name = n.name()
            if name in _LOG_NODES:
                return name != "SubBackward0" or any(
                    m is not None and m.name() in _LOG_NORMALISERS for m, _ in n.next_functions
                )
            if name in _LOGS_TO_DIV:
                following.extend(m for m, _ in n.next_functions if m is not None)
        frontier = following
    return False


#: Norms of a vector, and what a norm passes through on its way to a denominator.
_NORMS: Final = frozenset(
    {"LinalgVectorNormBackward0", "NormBackward0", "NormBackward1", "NormBackward3"}
)
_TO_DENOMINATOR: Final = frozenset(
    {
        "MulBackward0",
        "UnsqueezeBackward0",
        "ExpandBackward0",
        "ViewBackward0",
        "TBackward0",
        "TransposeBackward0",
        "PermuteBackward0",
        "MmBackward0",
    }
)


def _divides_by_norm(node: Any, depth: int = 3) -> bool:
    """Whether a division's denominator is made of vector norms, unclamped: a cosine
    similarity written by hand, ``a @ b.T / (|a| |b|)``, is 0/0 for a zero vector."""
    nexts = node.next_functions
    second = nexts[1][0] if len(nexts) > 1 else None
    frontier = [second] if second is not None else []
    for _ in range(depth):
        following: list[Any] = []
        for n in frontier:
            name = n.name()
            if name in _NORMS:
                return True
            if name in _TO_DENOMINATOR:
                following.extend(m for m, _ in n.next_functions if m is not None)
        frontier = following
    return False


def _over_one_sample(node: Any, items: Sequence[Item]) -> bool:
    """Whether an unbiased std/var of the loss reduced dim 0 of a batch of one sample (the
    model's outputs are all one sample long): 0/0. Its dims outlive the backward."""
    try:
        dims = node._saved_dim
        correction = node._saved_correction
    except (AttributeError, RuntimeError):
        return False
    if dims is None or 0 not in tuple(dims) or not correction:
        return False
    shapes = [
        item.sites[s].shape
        for item in items
        if isinstance(item, ForwardRecord) and item.frames
        for s in item.frames[0].outputs
    ]
    return bool(shapes) and all(len(shape) >= 1 and shape[0] == 1 for shape in shapes)


def _fed_by(later: Item, earlier: ForwardRecord) -> bool:
    """Whether a later call of the model took, with a gradient, an input of the shape of
    one of ``earlier``'s outputs: what a solver or an unrolled loop feeds it (the state a
    call returned, moved on). Not a second view of a batch, which takes no gradient."""
    if not isinstance(later, ForwardRecord) or not later.frames:
        return False
    later = later.replaces or later  # (a sentinel step's probes: what its backward got)
    earlier = earlier.replaces or earlier
    shapes = {tuple(earlier.sites[s].shape) for s in earlier.frames[0].outputs}
    graded = {site for site, _ in later.grads}
    return any(
        s in graded and tuple(later.sites[s].shape) in shapes for s in later.frames[0].inputs
    )


def _loss_graph(node: Any, items: Sequence[Item], limit: int = 256) -> Iterator[Any]:
    """The autograd nodes the loss's own code made: those made after the step's model
    outputs (autograd numbers its nodes in creation order), breadth first, and the leaves
    (AccumulateGrad) they reach. Nothing when the outputs' nodes are unknown."""
    # (A sentinel step's replay ran after the loss: the step's own forwards count.)
    forwards = [(i.replaces or i) for i in items if isinstance(i, ForwardRecord)]
    seqs = [f.output_seq for f in forwards if f.output_seq >= 0]
    if not seqs or node is None:
        return
    # The model's nodes: those of its outputs (a loss over two forwards ran code between
    # them), and everything made before the first forward's outputs.
    outputs = {n for f in forwards for n in f.output_node_ids}
    boundary = min(seqs) if outputs else max(seqs)
    seen = {node}
    queue = collections.deque([node])
    while queue and len(seen) <= limit:
        node = queue.popleft()
        try:
            if node.name() == "torch::autograd::AccumulateGrad":
                yield node  # (a leaf's: not looked through)
                continue
            seq = node._sequence_nr()
            if (id(node), seq) in outputs or seq <= boundary:
                continue  # (the model's)
            nexts = node.next_functions
        except (RuntimeError, AttributeError):
            continue
        yield node
        for following, _ in nexts:
            if following is not None and following not in seen:
                seen.add(following)
                queue.append(following)


def _loss_nodes(node: Any, items: Sequence[Item], limit: int = 256) -> tuple[str, ...]:
    """The names of the autograd nodes the loss's own code made (``_loss_graph``), which is
    where a loss from finite outputs went non-finite. Their values are gone (the backward
    freed them), their kinds are not."""
    names: list[str] = []
    for made in _loss_graph(node, items, limit):
        try:
            if made.name() == "torch::autograd::AccumulateGrad":
                continue
            names.append(_node_kind(made))
            if names[-1] == "LogBackward0" and _log_of_exps(made):
                names.append("LogBackward0:of_exps")
            elif names[-1] == "LogBackward0" and _log_of_sigmoid(made):
                names.append("LogBackward0:of_sigmoid")
            elif names[-1] == "DivBackward0" and _divides_logs(made):
                names.append("DivBackward0:of_logs")
            elif names[-1] == "DivBackward0" and _divides_by_norm(made):
                names.append("DivBackward0:by_norm")
            elif names[-1] in ("VarBackward0", "StdBackward0") and _over_one_sample(made, items):
                names.append(f"{names[-1]}:one_sample")
            elif names[-1] in _LAYER_NODES and "FrozenLayer" not in names and _frozen(made):
                names.append("FrozenLayer")
            elif names[-1] in ("ClampBackward1", "ClampBackward0") and _clamps_a_ratio(made):
                names.append("ExpBackward0:ratio")
        except (RuntimeError, AttributeError):
            continue
    if (
        {"NllLossBackward0", "NllLoss2DBackward0"} & set(names)
        and not _NAN_MAKERS & set(names)  # (nothing else in the loss can make its NaN)
        and _output_grads_bad(items)
    ):
        # cross_entropy whose gradient into the model is NaN: weights of Inf (1/count of a
        # class absent where the counts were taken), not a batch of ignored targets (its
        # gradient is 0).
        names.append("NllLossBackward0:bad_weight")
    if "FrozenLayer" in names and "ToCopyBackward0" not in names:
        # (Named only beside a cast, x.half() before a frozen float16 decoder: a float32
        # perceptual network or a fixed Sobel kernel does not overflow at 65504.)
        names.remove("FrozenLayer")
    if _empty_outputs(items):
        names.append("EmptyBatch")
    return tuple(names)


def _clamps_a_ratio(node: Any) -> bool:
    """Whether a clamp's input is ``exp(a - b)``: PPO's clipped ratio,
    ``exp(logp - old_logp).clamp(1 - eps, 1 + eps)`` (not SAC's clamp of a log_std)."""
    made = node.next_functions[0][0] if node.next_functions else None
    if made is None or made.name() != "ExpBackward0":
        return False
    below = made.next_functions[0][0] if made.next_functions else None
    return below is not None and below.name() == "SubBackward0"


#: Autograd nodes of a network's layers whose second input is the layer's weight.
_LAYER_NODES: Final = frozenset(
    {
        "ConvolutionBackward0",
        "NativeGroupNormBackward0",
        "NativeLayerNormBackward0",
        "NativeBatchNormBackward0",
    }
)


def _frozen(node: Any) -> bool:
    """Whether a layer's node took a weight that needs no gradient (a frozen network's: its
    weight's slot in the graph is empty), or none."""
    functions = node.next_functions
    return len(functions) > 1 and functions[1][0] is None


#: Parameters that are a scale's log (a policy's log_std, a VAE prior's log_sigma)...
_LOG_SCALE: Final = re.compile(r"(^|[._])log_?(std|sigma|scale|var)s?$", re.IGNORECASE)
#: ...and a scale itself (a raw std parameter), a whole name: not NoisyNet's weight_sigma,
#: which may be negative (the noise is sigma times a symmetric draw).
_RAW_SCALE: Final = re.compile(r"(^|\.)(std|sigma|stddev)$", re.IGNORECASE)


#: torch's norm layers (they compute a float16 input's statistics in float32; their
#: ``eps`` keeps a variance of 0 from dividing).
_TORCH_NORMS: Final = (
    nn.modules.batchnorm._NormBase,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.RMSNorm,
    nn.LocalResponseNorm,
)
#: Class names of norms written by hand: RMSNorm, T5LayerNorm, LayerNorm2d (ConvNeXt),
#: L2Normalize, a Normalization (not an ObsNormalizer, a SurfaceNormalHead).
_NORM_NAME: Final = re.compile(r"norm([123]d)?$|normali[sz](e|ation)$", re.IGNORECASE)
#: Module classes: whether a norm written by hand (named *Norm, not torch's).
_HAND_NORMS: dict[type, bool] = {}


def _hand_norm(kind: type) -> bool:
    """Whether a module class is a norm written by hand: RMSNorm, T5LayerNorm by name; not
    torch's or a subclass of one, which compute in float32; not an ObsNormalizer."""
    known = _HAND_NORMS.get(kind)
    if known is None:
        known = _HAND_NORMS[kind] = bool(_NORM_NAME.search(kind.__name__)) and not (
            kind.__module__.startswith("torch.") or issubclass(kind, _TORCH_NORMS)
        )
    return known


#: The largest float16 value whose square float16 holds (65504 ** 0.5).
_SQUARE_LIMIT: Final = 255.9
#: A module called this many times in one forward: a recurrence or an integrator's.
_RECURRENT_CALLS: Final = 8


def _masks_out(record: ForwardRecord) -> bool:
    """Whether the model returned an output of a module seen writing -inf masks there."""
    frames = record.frames
    return bool(frames) and any(
        frames[record.sites[s].frame].hooked.neg_inf_outputs for s in frames[0].outputs
    )


def _repeated_call(item: Item, f: Finding) -> tuple[str, int] | None:
    """The module call a forward origin is at, by name and index: its own, or for a
    parent's own code the call it passed the value to (an ODE solver's ``func#45``)."""
    if not isinstance(item, ForwardRecord) or f.frame is None:
        return None
    at = f.consumer if f.reason == "own_code" and f.consumer is not None else f.frame
    if at >= len(item.frames):
        return None
    frame = item.frames[at]
    return frame.name or type(frame.module).__name__, frame.call


def _collapsed_scale(model: nn.Module) -> tuple[str, float, bool] | None:
    """A parameter of ``model`` parameterising a scale that has collapsed: a log-scale
    below -30 (its exp under 1e-13), or a raw scale at or below 0. Failure path."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            log = bool(_LOG_SCALE.search(name))
            if not (log or _RAW_SCALE.search(name)) or not p.is_floating_point() or not p.numel():
                continue
            finite = p[torch.isfinite(p)]
            if not finite.numel():
                continue
            low = float(finite.min())
            if (log and low < -30.0) or (not log and low <= 0.0):
                return name, low, log
    return None


#: The loss's own operations that make NaN from finite values (beside cross_entropy's).
_NAN_MAKERS: Final = frozenset(
    {
        "LogBackward0",
        "Log2Backward0",
        "Log10Backward0",
        "DivBackward0",
        "ReciprocalBackward0",
        "SqrtBackward0",
        "RsqrtBackward0",
        "PowBackward0",
        "PowBackward0:fractional",
        "StdBackward0",
        "VarBackward0",
        "ExpBackward0",
        "AcosBackward0",
        "AsinBackward0",
        "AtanhBackward0",
        "XlogyBackward0",
    }
)


def _output_grads_bad(items: Sequence[Item]) -> bool:
    """Whether a gradient the backward sent into the model's outputs holds NaN/Inf (those
    kept: failure path, exact reads)."""
    with torch.no_grad():
        return any(
            g.is_floating_point() and not bool(torch.isfinite(g).all())
            for item in items
            if isinstance(item, ForwardRecord)
            for g in item.output_grads.values()
        )


def _empty_outputs(items: Sequence[Item]) -> bool:
    """Whether the step's training forwards returned only tensors of 0 samples (an empty
    batch: a filter that kept nothing, a last batch of 0)."""
    shapes = [
        item.sites[site].shape
        for item in items
        if isinstance(item, ForwardRecord) and item.frames and item.grad
        for site in item.frames[0].outputs
    ]
    return bool(shapes) and all(len(s) and s[0] == 0 for s in shapes)


def _outside_weights(
    node: Any, items: Sequence[Item], own: set[int], limit: int = 256
) -> tuple[nn.Parameter, ...]:
    """The weights (``nn.Parameter``s: not a leaf input, a PINN's coordinates) the loss's
    own code used that the watched model does not hold (``own``: their ids): the rest of a
    model of which only a part is watched (its pooling, its head), another model (a
    discriminator), a center loss's centres."""
    found: list[nn.Parameter] = []
    for made in _loss_graph(node, items, limit):
        variable = getattr(made, "variable", None)
        if isinstance(variable, nn.Parameter) and id(variable) not in own:
            found.append(variable)
    return tuple(found)


def _stale_weights(
    weights: Sequence[Tensor], stepped: Sequence[weakref.ref[torch.optim.Optimizer]] = ()
) -> tuple[TensorStats, ...]:
    """Statistics of those of ``weights`` that hold NaN/Inf (failure path: exact reads):
    a weight outside the guard that an earlier step of its own optimizer broke. Not one an
    optimizer in ``stepped`` moved after the loss read it (its NaN may be the loss's)."""
    moved = {
        id(p)
        for ref in stepped
        if (opt := ref()) is not None
        for group in opt.param_groups
        for p in group["params"]
    }
    with torch.no_grad():
        return tuple(
            tensor_stats(w)
            for w in weights
            if id(w) not in moved and w.is_floating_point() and not bool(torch.isfinite(w).all())
        )


def _saturated_mask(op: OpInfo | None) -> bool:
    """An addition that made only -inf from an input holding its dtype's lowest value (an
    additive mask of torch.finfo(dtype).min, plus a negative bias): a mask saturating."""
    if op is None or op.direction != "forward" or op.output is None:
        return False
    base = op.name.split(".")[1].rstrip("_") if op.name.count(".") >= 1 else op.name
    out = op.output
    if out.nan_count or out.posinf_count or not out.neginf_count:
        return False
    limit = DTYPE_MAX.get(out.dtype)
    if limit is None:
        return False
    low = -limit  # (torch.finfo(dtype).min)
    if base == "mul":  # (1 - keep) * -1e9: a constant the dtype cannot hold
        constant = scalar_arg(op)
        return constant is not None and constant < low
    if base not in ("add", "sub"):
        return False
    return any(s is not None and s.min is not None and s.min <= low for s in op.inputs)


def _optimizer_view(
    optimizer: torch.optim.Optimizer | None, param: Tensor | None
) -> tuple[str | None, float | None]:
    """For a weight gone non-finite in an update (failure path): its non-finite optimizer
    state entries (``"exp_avg_sq"``), and the ``eps`` of its parameter group."""
    if optimizer is None or param is None:
        return None, None
    bad: list[str] = []
    eps: float | None = None
    try:
        for name, value in optimizer.state.get(param, {}).items():
            if (
                isinstance(value, Tensor)
                and (value.is_floating_point() or value.is_complex())
                and flags_of_tensor(local_shard(value))
            ):
                bad.append(name)
        group = next(
            (g for g in optimizer.param_groups if any(p is param for p in g["params"])), None
        )
        if group is not None and isinstance(group.get("eps"), (int, float)):
            eps = float(group["eps"])
    except (TypeError, ValueError, RuntimeError, KeyError):  # (an exotic optimizer)
        return None, None
    return (", ".join(f"`{n}`" for n in bad[:3]) or None), eps


def _learning_rate(
    optimizer: torch.optim.Optimizer | None,
    module: nn.Module | None,
    updates: int | None = None,
    model: nn.Module | None = None,
) -> str | None:
    """A note on the learning rate of ``module``'s parameter group, when out of proportion;
    else on another group's of ``model``'s weights far out of line with the rest (LayerScale's
    gammas given lr=10 in a group of their own: the activations explode elsewhere)."""
    if optimizer is None:
        return None
    try:
        groups = [
            (float(group.get("lr", 0.0)), list(group["params"])) for group in optimizer.param_groups
        ]
    except (TypeError, ValueError, RuntimeError, KeyError):  # (an exotic learning rate object)
        return None
    kind = type(optimizer).__name__
    if module is not None:
        # Its own parameters' groups first (a multi-task wrapper's learned loss weights: its
        # backbone's group is another's), else those of its submodules'; the largest rate.
        direct = {id(p) for p in module.parameters(recurse=False)}
        mine = direct or {id(p) for p in module.parameters()}
        own: float | None = None
        others: list[float] = []
        for lr, params in groups:
            if any(id(p) in mine for p in params):
                own = lr if own is None else max(own, lr)
            elif params:
                others.append(lr)
        note = None if own is None else learning_rate_note(kind, own, others, updates)
        if note is not None or (own is None and model is None):
            return note
    if model is None or len(groups) < 2:
        return None
    names = {id(p): n for n, p in model.named_parameters()}
    for i, (lr, params) in enumerate(groups):
        held = [names[id(p)] for p in params if id(p) in names]
        if not held or not math.isfinite(lr):
            continue
        rest = [other for j, (other, ps) in enumerate(groups) if j != i and ps]
        more = f" and {len(held) - 2:,} more" if len(held) > 2 else ""
        label = ", ".join(f"`{n}`" for n in held[:2]) + more
        note = learning_rate_note(kind, lr, rest, updates, group=label)
        if note is not None:
            return note
    return None


def _absorbed_label(item: ForwardRecord, f: Finding) -> str:
    label = site_label(item.sites[f.site])
    if f.reason == "own_code" and f.consumer is not None:
        label = f"{label} of {_frame_label(item.frames[f.consumer])}"
    return label


def _absorbed(
    items: list[Item], flags: list[list[int]], grad_flags: list[list[tuple[int, int]]]
) -> bool:
    """Whether every non-finite value of the step stayed inside the model: its outputs,
    the losses and the gradients probed were finite (the weights too, checked by the
    caller), and every forward was seen whole (not a sentinel step, not one that raised)."""
    for index, item in enumerate(items):
        if isinstance(item, LossRecord):
            if any(flags[index]):
                return False
            continue
        if not isinstance(item, ForwardRecord) or item.coarse or item.raised is not None:
            return False
        if not item.frames or any(fl for _, fl in grad_flags[index]):
            return False
        if any(flags[index][o] for o in item.frames[0].outputs if o < len(flags[index])):
            return False
    return True


def _batch_of(record: ForwardRecord) -> int | None:
    """The first dimension of the first tensor the model was given: its batch."""
    info = record.replay
    if info is not None:
        first = info.args[0] if info.args else None
        if isinstance(first, Tensor):  # (the usual case, every step: no walk)
            return int(first.shape[0]) if first.dim() else None
        found: list[tuple[Path, Tensor]] = []
        collect(info.args, ("args",), found, objects=True)
        collect(info.kwargs, ("kwargs",), found, objects=True)
        return next((int(t.shape[0]) for _, t in found if t.dim()), None)
    if record.frames:  # (inputs not kept: the shapes of the probed ones)
        for site in record.frames[0].inputs:
            shape = record.sites[site].shape
            if len(shape):
                return int(shape[0])
    return None


def _output_label(frame: Frame, site: int) -> str:
    """``"output"`` (``"output[1]"``... where the call's output paths are known)."""
    if frame.output_paths is not None:
        path = frame.output_paths[frame.outputs.index(site)]
        if path is not None:
            return format_path("output", path)
    return "output"


def _exact_kind(kind: str, stats: TensorStats | None) -> str:
    """The finding's kind, corrected by exact statistics: a probe (a sum) reads
    +Inf + -Inf as NaN."""
    if stats is not None and not stats.nan_count and stats.nonfinite_count:
        return "inf"
    return kind


def _already(item: Item, f: Finding) -> bool:
    """Whether the item's origin of this direction was reported in an earlier resolution."""
    if f.reason in _BACKWARD:
        return isinstance(item, ForwardRecord) and item.reported_backward
    return item.reported


def _nonfinite_attributes(module: nn.Module) -> list[str]:
    """Plain tensor attributes of ``module`` (neither parameters nor buffers) that hold
    NaN/Inf (failure path): state a forward keeps for the next (``self.mu = ...``)."""
    bad = []
    with torch.no_grad():
        for name, value in vars(module).items():
            if isinstance(value, Tensor) and (value.is_floating_point() or value.is_complex()):
                with contextlib.suppress(RuntimeError, NotImplementedError):
                    if flags_of_tensor(value):
                        bad.append(name)
    return bad


def _nonfinite_tensors(
    module: nn.Module, prefix: str, blameless: Collection[int] = ()
) -> list[str]:
    """Own parameters and buffers of ``module`` that hold NaN/Inf (failure path); not the
    running statistics a BatchNorm in training mode updates from the very forward at fault,
    nor ``blameless`` ones (ids: masks, tables the forward did not need)."""
    updated = isinstance(module, _BATCH_STATS_NORMS) and module.training
    bad = []
    with torch.no_grad():
        for name, tensor in (
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ):
            if (updated and name in _RUNNING_STATS) or id(tensor) in blameless:
                continue
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad.append(f"{prefix}.{name}" if prefix else name)
    return bad
