"""Hints: the most likely cause of an origin, and what to try, in one or two sentences.

:func:`hint` is a pure function of what nanguard learned about an origin (the phase,
the offending tensor's statistics, the aten operation a replay pinned down, the
gradient-norm and GradScaler history). Each rule needs evidence: the most specific
evidence wins, and when nothing matches the hint says so instead of guessing.
"""

from __future__ import annotations

import dataclasses
import linecache
import math
import re
from collections.abc import Callable, Iterable
from types import MappingProxyType
from typing import Final

from nanguard._events import TensorStats

__all__ = [
    "DTYPE_MAX",
    "HUGE_OUTPUTS",
    "HintContext",
    "OpInfo",
    "adaptive_optimizer",
    "custom_backward_name",
    "hint",
    "is_attention",
    "is_specific",
    "learning_rate_note",
    "loss_slopes",
    "scalar_arg",
]

#: Largest finite value of each floating dtype (as ``str(dtype)`` spells it).
DTYPE_MAX: Final = MappingProxyType(
    {
        "torch.float16": 65504.0,
        "torch.bfloat16": 3.3895313892515355e38,
        "torch.float32": 3.4028234663852886e38,
        "torch.float64": 1.7976931348623157e308,
        # (per component: (a+bi)(c+di) = (ac - bd) + ...: inf - inf is NaN at once)
        "torch.complex64": 3.4028234663852886e38,
        "torch.complex128": 1.7976931348623157e308,
    }
)
_HALF: Final = frozenset({"torch.float16", "torch.bfloat16"})
#: How close to the dtype's maximum an input must be to count as "large".
_LARGE_FRACTION: Final = 1.0 / 16.0
#: The longest a hint should be (it ends a message that says much already).
_MAX_HINT: Final = 300
#: How close an op's inputs must come to the batch's largest value for the data to be
#: blamed for its overflow (products of scaled features shrink it by a few orders).
_REACHED: Final = 1e-6
#: How many steps a gradient-norm spike may precede an origin and still explain it.
_SPIKE_WINDOW: Final = 50
#: ...and for a sentence added to a loss's own cause.
_SPIKE_BESIDE_LOSS: Final = 5
#: Attention scores (about max|q| * max|k|) from which a fused attention's softmax is
#: likelier to have overflowed than to have met a fully masked row.
_HUGE_SCORES: Final = 1e8

# Ops whose non-finite output from finite inputs can only be an overflow.
_SUMS: Final = frozenset(
    {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "dot", "vdot", "mv", "addmv"}
    | {"einsum", "convolution", "conv1d", "conv2d", "conv3d", "sum", "cumsum", "add", "sub"}
)
#: Sums of products of two operands: they overflow where the operands' product does.
_MATMULS: Final = _SUMS - {"sum", "cumsum", "add", "sub"}
_PRODUCTS: Final = frozenset({"mul", "prod", "square", "exp", "exp2", "expm1", "sinh", "cosh"})
_EXPS: Final = frozenset({"exp", "exp2", "expm1"})
#: Optimizers whose update divides by a running scale of the gradient plus eps (as
#: lower-case parts of their class names).
_ADAPTIVE: Final = (
    "adam",
    "rmsprop",
    "adagrad",
    "adadelta",
    "adafactor",
    "adabelief",
    "lamb",
    "adan",
    "sophia",
)
_LOGS: Final = frozenset({"log", "log2", "log10"})
#: Fused losses whose default reduction is a mean over their input's elements.
_MEAN_LOSSES: Final = frozenset(
    {"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "soft_margin_loss"}
    | {"binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div"}
    | {"cross_entropy_loss", "nll_loss", "nll_loss_nd", "nll_loss2d", "multi_margin_loss"}
)
_POLES: Final = frozenset({"lgamma", "digamma", "polygamma", "mvlgamma"})
#: Backward nodes of norms and distances (as :func:`_node_base` spells them).
_NORMALISATIONS: Final = frozenset(
    {"native_layer_norm", "native_group_norm", "rms_norm", "fused_rms_norm", "instance_norm"}
)
_NORMS: Final = frozenset(
    {"norm", "linalgvectornorm", "linalgnorm", "frobeniusnorm", "cdist", "pdist", "dist", "hypot"}
)


@dataclasses.dataclass(frozen=True, slots=True)
class OpInfo:
    """The aten operation that first turned finite inputs into NaN/Inf (found by a replay).

    Attributes:
        name: the overload's name, e.g. ``"aten.log.default"`` or ``"aten.div.Tensor"``.
        inputs: exact statistics of the op's tensor inputs, in order (``None`` for
            non-tensor arguments).
        output: statistics of the (first) non-finite output.
        direction: ``"forward"`` or ``"backward"``.
        node: backward only: the autograd node, e.g. ``"SqrtBackward0"``.
        args: the op's non-tensor arguments (dims, exponents...), best effort.
        source: the user's source line that ran it (in the backward: the forward line
            that created the node), ``"file.py:12 in forward: return torch.log(x)"``.
        custom_backward: the node is the user's own ``torch.autograd.Function``, whose
            Python backward ran the op: ``source`` is then the line of that backward.
        mask_input: ``log`` of a tensor of only 0s and 1s (a mask as floats: log(mask) adds
            -inf where it is 0, on purpose).
        where: in the backward, ``(file, line)`` of each frame of the replayed forward that
            created the node (torch's own included), outermost first.
        inf_from: in the backward, the forward operation that made an Inf among this op's
            inputs by accident (an exp that overflowed), when the replay saw it.
        params: the model's parameter names of the tensor inputs that are its parameters
            (``None`` for the others), in the order of ``inputs``; empty when none is.
        untrained: a forward op run with gradients on whose inputs need none: computed from
            the batch, the targets or frozen weights alone, nothing being trained.
    """

    name: str
    inputs: tuple[TensorStats | None, ...]
    output: TensorStats | None
    direction: str = "forward"
    node: str | None = None
    args: tuple[object, ...] = ()
    source: str | None = None
    custom_backward: bool = False
    hook: bool = False  # ...the user's code is a gradient hook that autograd ran (``source``)
    mask_input: bool = False
    where: tuple[tuple[str, int], ...] = ()  # backward: the node's creation stack, outermost first
    # Backward: the forward op that made, by accident, an Inf this op read (0 * inf).
    inf_from: OpInfo | None = None
    params: tuple[str | None, ...] = ()
    untrained: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class HintContext:
    """Everything :func:`hint` may use about one origin.

    Attributes:
        phase: ``"input"``, ``"forward"``, ``"loss"``, ``"backward"``, ``"grad"`` or ``"param"``.
        kind: ``"nan"`` or ``"inf"``.
        reason: how the origin was found (``"input"``, ``"output"``, ``"own_code"``,
            ``"loss"``, ``"backward"``, ``"loss_backward"``, ``"param"``,
            ``"before_training"`` (a weight non-finite before any optimizer step),
            ``"outside_optimizer"`` (a weight with requires_grad=False)...).
        module_type: class name of the origin's module.
        stats: statistics of the offending tensor.
        dtype: its dtype, e.g. ``"torch.float16"``.
        op: the aten operation a replay found, if any.
        mask_inputs: a mask-like argument carried ``-inf`` into the module.
        grad_norm_alarm_step: step of the latest gradient-norm spike before this origin.
        grad_norm_alarm_first: the first spike of its episode (spikes a few steps apart).
        step: the origin's step.
        amp_collapsed: GradScaler's scale had collapsed.
        params_nonfinite: the module's own parameters were already non-finite.
        buffers_nonfinite: ...all of them buffers (a class weight from a count of 0).
        optimizer: the optimizer's class name, for phase ``"param"``.
        output_peak: the largest finite magnitude the probes of the model's outputs saw in
            the failing step (a sum of the outputs, or their extremes in half precision).
        input_peak: the largest finite magnitude in the failing step's model inputs.
        weight_peak: the largest magnitude among the model's weights (huge outputs only).
        scaler_known: a GradScaler was passed to the guard (``scaler=``).
        loss_checked: the step's loss went through ``guard.check_loss``.
        call_inputs: for a forward origin, statistics of the inputs of the call.
        forward: which call of the model in its step the origin was found in (1: the first).
        updates: optimizer updates of the weights before the failing forward (0: none yet,
            so no learning rate can have made the weights explode); ``None``: unknown.
        output_dtype: for a loss, the model's outputs' dtype when it was half precision.
        loss_ops: for a loss, the autograd nodes its own code made (after the model's
            outputs), by name: which of them can make NaN/Inf from finite values.
        fed_back: an input origin at a later call whose batch has the shape of the
            previous call's outputs (a loop may have built it from them).
        rebuilt: an input origin at a later call whose batch has the shape of the one an
            earlier call of the step was given, finite (the caller built it from that one).
        learning_rate: a sentence on the learning rate of the origin module's parameter
            group when it is out of proportion (see :func:`learning_rate_note`).
        optimizer_state: for phase ``"param"``, the optimizer's state entries of the weight
            that are non-finite (``"exp_avg_sq"``), if any.
        optimizer_eps: for phase ``"param"``, the ``eps`` of the weight's parameter group.
        saved_hooks: for the backward, the name of the user's pack hook the forward ran
            under (``torch.autograd.graph.saved_tensors_hooks``): the backward reads what
            its unpack hook gives back, not what the forward computed.
    """

    phase: str
    kind: str
    reason: str
    module_type: str | None = None
    stats: TensorStats | None = None
    dtype: str | None = None
    op: OpInfo | None = None
    mask_inputs: bool = False
    grad_norm_alarm_step: int | None = None
    grad_norm_alarm_first: int | None = None
    step: int = 0
    amp_collapsed: bool = False
    params_nonfinite: bool = False
    buffers_nonfinite: bool = False
    optimizer: str | None = None
    output_peak: float | None = None
    input_peak: float | None = None
    weight_peak: float | None = None
    scaler_known: bool = False
    loss_checked: bool = True
    call_inputs: tuple[TensorStats, ...] = ()
    forward: int = 1
    updates: int | None = None
    output_dtype: str | None = None
    fed_back: bool = False
    rebuilt: bool = False
    learning_rate: str | None = None
    optimizer_state: str | None = None
    optimizer_eps: float | None = None
    loss_ops: tuple[str, ...] = ()
    saved_hooks: str | None = None
    half_weights: bool = False  # the weights themselves are float16 (model.half())
    grads_unchecked: bool = False  # no gradient is read (backward=False, grad_norm=False)
    # The module's own forward pre-hooks by name (the hook-based spectral_norm's SpectralNorm).
    pre_hooks: tuple[str, ...] = ()
    # A torch.nn normalisation layer's ``eps`` (None: not one, or eps=None).
    module_eps: float | None = None
    # For a forward origin: its module's name and which call of it in that forward (0: the
    # first); for a parent's own code, the call it passed the value to.
    call: tuple[str, int] | None = None
    # For a forward origin in a later forward of its step: the largest finite magnitude in
    # the step's first forward's inputs (a loop feeding the model its results grew them).
    first_input_peak: float | None = None
    # ...and in the forward just before it (a sampler's iterate grows forward after forward;
    # a gradient-accumulation micro-batch with an outlier comes from nowhere).
    previous_input_peak: float | None = None
    # For a loss: a parameter of the model that parameterises a scale, collapsed:
    # (name, its lowest value, whether it is a log-scale).
    collapsed_scale: tuple[str, float, bool] | None = None
    # For a loss: statistics of the weights its code used, outside the watched model, that
    # were already non-finite.
    stale_outside: tuple[TensorStats, ...] = ()


# --- small readers of the evidence -------------------------------------------------------


_SOURCE = re.compile(r"^(?P<path>.+):(?P<line>\d+) in ")
_SCALING = re.compile(r"scale|sqrt|\*\*\s*-\s*0?\.5|temperature|\btau\b", re.IGNORECASE)


def _scaled_before(op: OpInfo, lines: int = 3) -> bool:
    """Whether the operation's source line, or one of the few before it, scales something
    (``q = q * self.scale``, ``/ math.sqrt(d)``): the scores were scaled already."""
    found = _SOURCE.match(op.source or "")
    if found is None:
        return False
    path, line = found["path"], int(found["line"])
    return any(
        _SCALING.search(linecache.getline(path, n)) for n in range(max(1, line - lines), line + 1)
    )


def _made(ctx: HintContext, op: OpInfo) -> str:
    """What ``op`` itself made (an Inf that a later op turned into the finding's NaN)."""
    s = op.output
    if s is None or not s.nonfinite_count:
        return _word(ctx)
    if s.nan_count:
        return "NaN"
    if s.posinf_count and not s.neginf_count:
        return "+Inf"
    return "-Inf" if not s.posinf_count else "Inf"


def _word(ctx: HintContext) -> str:
    if ctx.kind == "nan":
        return "NaN"
    s = ctx.op.output if ctx.op is not None and ctx.op.output is not None else ctx.stats
    if s is not None and s.posinf_count and not s.neginf_count:
        return "+Inf"
    if s is not None and s.neginf_count and not s.posinf_count:
        return "-Inf"
    return "Inf"


def _base(name: str) -> str:
    """``"aten._softmax.default"`` -> ``"softmax"``; ``"aten.log_.default"`` -> ``"log"``."""
    parts = name.removeprefix("torch.ops.").split(".")
    base = parts[1] if len(parts) >= 2 and parts[0] in {"aten", "prims"} else parts[0]
    return base.strip("_")


def _node_base(node: str | None) -> str:
    """``"SqrtBackward0"`` -> ``"sqrt"``, ``"LinalgSvdBackward0"`` -> ``"linalgsvd"``."""
    if not node:
        return ""
    return re.sub(r"Backward\d*$", "", node).lower()


def _dtype(ctx: HintContext) -> str | None:
    candidates: list[TensorStats | None] = []
    if ctx.op is not None:
        candidates += [ctx.op.output, *ctx.op.inputs]
    candidates.append(ctx.stats)
    for s in candidates:
        if s is not None and s.dtype in DTYPE_MAX:
            return s.dtype
    return ctx.dtype if ctx.dtype in DTYPE_MAX else None


def _magnitude(stats: Iterable[TensorStats | None]) -> float | None:
    """The largest finite magnitude among ``stats``, or ``None`` when none is known."""
    peaks = [
        max(abs(s.min), abs(s.max))
        for s in stats
        if s is not None and s.min is not None and s.max is not None
    ]
    return max(peaks) if peaks else None


def _input(op: OpInfo, index: int) -> TensorStats | None:
    return op.inputs[index] if index < len(op.inputs) else None


def _first_input(op: OpInfo) -> TensorStats | None:
    return next((s for s in op.inputs if s is not None), None)


def scalar_arg(op: OpInfo) -> float | None:
    """The op's first number argument (``x * -1e9``), if any."""
    for a in op.args:
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return float(a)
    return None


def _in(s: TensorStats | None, what: str = "input") -> str:
    """`` (its input is in [lo, hi])``, or nothing when the range is unknown."""
    if s is None or s.min is None or s.max is None:
        return ""
    return f" (its {what} is in [{s.min:.4g}, {s.max:.4g}])"


def _has_zero(s: TensorStats) -> bool:
    """Whether ``s`` holds a 0, or its finite range spans 0 (then one is likely)."""
    if 0.0 in s.first_values:
        return True
    return s.min is not None and s.max is not None and s.min <= 0 <= s.max


# --- rules: each returns a hint, or None when its evidence is absent ------------------


def _input_data(ctx: HintContext) -> str | None:
    if ctx.phase != "input" and ctx.reason != "input":
        return None
    if ctx.forward > 1 and ctx.fed_back:
        return (
            f"The batch given to call {ctx.forward} of the model holds {_word(ctx)} and has "
            "the shape of the previous call's (finite) output: if your code builds each call's "
            "input from it (a sampling loop, an unrolled recurrence), that code made it (a "
            "division by sqrt(alpha_bar) at alpha_bar = 0). Else look at the data pipeline."
        )
    if ctx.forward > 1 and ctx.rebuilt:
        return (
            f"Call {ctx.forward} of the model got a batch holding {_word(ctx)}; an earlier "
            "call of the step got a finite one of its shape and took its gradient: your code "
            "between them built this batch from it (an adversarial attack's x + a * g / "
            "||g|| at a zero gradient) and made the value: add an eps there."
        )
    return (
        f"The input batch already holds {_word(ctx)}: look at the data pipeline (missing values "
        "read as NaN, a normalisation dividing by a zero std, log of 0 in feature engineering, "
        "a corrupt sample). Assert torch.isfinite(x).all() in the loader to find the sample."
    )


def _corrupt_weights(ctx: HintContext) -> str | None:
    if not ctx.params_nonfinite:
        return None
    if ctx.buffers_nonfinite:
        return (
            "The module's buffers held NaN/Inf before this forward, which only reads them: "
            "look at how they were computed (a class weight or normaliser from a count of 0 "
            "divides by it: clamp the count) or loaded."
        )
    return (
        "The module's weights were already non-finite before this forward (an earlier "
        "optimizer step or a bad checkpoint): this forward only reveals it. The 'param' "
        "event says when they went bad (none with check_params=False, which skips the "
        "sweeps that date it)."
    )


def _stale_outside(ctx: HintContext) -> str | None:
    """A loss reading a weight outside the watched model that is already non-finite."""
    if ctx.phase != "loss" or not ctx.stale_outside:
        return None
    shape = ", ".join(str(d) for d in ctx.stale_outside[0].shape)
    return (
        f"A weight the loss uses that the watched model does not hold (shape ({shape})) is "
        "non-finite: an update outside the guard broke it (its own optimizer: a gradient "
        "scaled by 1/0, a learning rate too high) or it was loaded so. Watch its module too "
        "(nanguard.watch on a wrapper), or check that update."
    )


def _collapsed_scale(ctx: HintContext) -> str | None:
    """A loss reading a distribution whose scale parameter collapsed (a policy's log_std
    driven to -50, a raw std parameter gone negative)."""
    if ctx.phase != "loss" or ctx.collapsed_scale is None:
        return None
    name, low, log = ctx.collapsed_scale
    if log:
        return (
            f"The model's parameter `{name}` is as low as {low:.3g} (its exp: "
            f"{math.exp(low):.2g}): a distribution's scale collapsed to 0, and log_prob divides "
            "by its square. Clamp it (log_std.clamp(-20, 2), as SAC does) or fix what pushed "
            "it down (an entropy bonus of the wrong sign)."
        )
    return (
        f"The model's parameter `{name}` is as low as {low:.3g}: a scale (std) must stay "
        "positive, and log_prob takes its log and divides by it. Parameterise it as "
        "softplus(s) + 1e-4 or exp(log_std)."
    )


def _before_training(ctx: HintContext) -> str | None:
    """A weight non-finite before any optimizer step: no update made it."""
    if ctx.reason == "buffer_before_training":
        return (
            f"The buffer was {_word(ctx)} before any optimizer step: computed so in __init__ "
            "(a schedule or weight table with a 0/0 at one entry: an SNR of 0 at the last "
            "timestep, a count of 0) or loaded so. Compute it with an eps or a clamp, in "
            "float64 if need be, and check torch.isfinite(buf).all() when it is made."
        )
    if ctx.reason != "before_training":
        return None
    half = ctx.dtype in ("torch.float16", "torch.bfloat16")
    limit = " (float16 tops out at 65504: a bfloat16 or float32 weight beyond it is Inf)"
    return (
        f"The weight was {_word(ctx)} before any optimizer step, so no update made it: a "
        "checkpoint saved after training had diverged, a conversion to a smaller dtype"
        f"{limit if half else ''}, or an initialisation that divides by zero. Check each "
        "tensor of the state_dict with torch.isfinite(t).all() before loading it."
    )


def _outside_optimizer(ctx: HintContext) -> str | None:
    """A weight no optimizer trains (requires_grad=False) went non-finite between steps."""
    if ctx.reason == "written_in_forward":
        return (
            f"The weight became {_word(ctx)} outside any optimizer step: written by its "
            "module's forward (a data-dependent initialisation: x.std(0) + 1e-6) or by code "
            "between steps (an EMA update, AveragedModel.update_parameters: check its decay "
            "and the source weights; copy_, load_state_dict)."
        )
    if ctx.reason != "outside_optimizer":
        return None
    return (
        f"The parameter, not trained (requires_grad=False), became {_word(ctx)} between "
        "steps: an EMA or momentum update writing it in place (a teacher or key encoder: "
        "check the momentum and the source weights), or a checkpoint loaded into it."
    )


#: An adaptive optimizer moves each weight by up to about its learning rate per step: at
#: this rate a weight of usual size (0.01-0.1) is swamped by one update.
_ADAPTIVE_LR_HIGH: Final = 0.1
#: One parameter group's learning rate this many times the others' (and not small): a
#: typo, most likely (discriminative fine-tuning gives a head 10-100x its backbone's).
_LR_OUT_OF_LINE: Final = 1000.0
_LR_NOT_SMALL: Final = 0.01
#: ...and for a group not the origin module's own: far more out of line.
_LR_OTHER_OUT_OF_LINE: Final = 1e4
_LR_OTHER_NOT_SMALL: Final = 0.05


def learning_rate_note(
    optimizer: str,
    own: float,
    others: Iterable[float],
    updates: int | None = None,
    group: str | None = None,
) -> str | None:
    """A sentence when the learning rate ``own`` of an origin's parameter group is out of
    proportion: far above the optimizer's other groups, or, for an adaptive optimizer
    (each step moves a weight by up to about the learning rate), far above a weight's size.
    ``updates``: the optimizer steps since watch() began; an adaptive optimizer's steps
    that cannot have moved a weight by a usual weight's size (0.1 in all: one step at
    lr 0.01 after a checkpoint was loaded) did not cause anything. ``group``: another
    group than the module's, by its weights (```blocks.0.gamma``, ...``): named only when
    out of line with the rest (a typo in the rate of LayerScale's gammas).

    Example:
        >>> print(learning_rate_note("AdamW", 100.0, [1e-3]))
        The learning rate of this module's parameter group is 100, 100,000 times ...
    """
    if not math.isfinite(own):
        return (
            f"The learning rate of this module's parameter group is {own}: a scheduler made "
            "it (a warm-up or decay dividing by 0 at step 0, a LambdaLR of 0/0), and every "
            "update with it is non-finite. Fix the schedule (e.g. max(step, 1))."
        )
    if updates == 0:
        return None  # (no update yet: no learning rate did anything)
    if updates is not None and _moves_by_lr(optimizer) and own * updates < _ADAPTIVE_LR_HIGH:
        return None
    rest = [lr for lr in others if lr > 0]
    whose = f"the parameter group of {group}" if group else "this module's parameter group"
    # (Another group than the origin's: named only far past discriminative fine-tuning's
    # 1000x, a backbone at 1e-5 beside a head at 1e-2.)
    ratio, floor = (
        (_LR_OTHER_OUT_OF_LINE, _LR_OTHER_NOT_SMALL)
        if group
        else (
            _LR_OUT_OF_LINE,
            _LR_NOT_SMALL,
        )
    )
    if rest and own >= floor and own >= ratio * max(rest):
        return (
            f"The learning rate of {whose} is {own:g}, "
            f"{_times(own / max(rest))} times the other groups' (at most {max(rest):g}): a typo? "
            f"Each {optimizer} step moves these weights by up to about "
            + ("the learning rate." if _moves_by_lr(optimizer) else "lr x gradient.")
        )
    if _moves_by_lr(optimizer) and own >= _ADAPTIVE_LR_HIGH and not group:
        return (
            f"{optimizer} with lr={own:g} moves every weight of this module by up to about "
            f"{own:g} per step, more than weights of usual size (0.01-0.1) can take: lower it "
            "(1e-4 to 1e-3 is usual for Adam), with warm-up."
        )
    return None


def _times(ratio: float) -> str:
    """``"100,000"``; ``"1e+35"`` past a million (not 36 digits)."""
    return f"{ratio:,.0f}" if ratio < 1e6 else f"{ratio:.2g}"


def _moves_by_lr(optimizer: str) -> bool:
    """Adam's family, RMSprop and Lion move each weight by about the learning rate per
    step (Adadelta's lr=1.0 only scales its own step size; Adagrad's shrinks as it goes)."""
    name = optimizer.lower()
    return any(k in name for k in ("adam", "rmsprop", "lion", "lamb", "adabelief"))


def adaptive_optimizer(name: str | None) -> bool:
    """Whether an optimizer (by class name) divides by a running magnitude: Adam's family,
    RMSprop, Adagrad..."""
    lowered = (name or "").lower()
    return any(k in lowered for k in _ADAPTIVE)


def _adaptive(ctx: HintContext) -> bool:
    return ctx.phase == "param" and adaptive_optimizer(ctx.optimizer)


def _adam_half(ctx: HintContext) -> str | None:
    if not _adaptive(ctx) or _dtype(ctx) != "torch.float16":
        return None
    return (
        f"{ctx.optimizer} on float16 parameters: eps=1e-8 and the second moment "
        "(1 - beta2) * grad**2 of gradients below ~1e-2 underflow to 0 in float16, so the "
        "update m / (sqrt(v) + eps) is +-Inf (NaN where m underflowed too). Keep float32 "
        "master weights (autocast with GradScaler) or raise eps (e.g. 1e-4)."
    )


def _unchecked_grads(ctx: HintContext) -> str | None:
    """An update made a weight non-finite, and no gradient was read: either may be why."""
    if ctx.phase != "param" or ctx.reason != "param" or not ctx.grads_unchecked:
        return None
    step = f"{ctx.optimizer}.step()" if ctx.optimizer else "optimizer.step()"
    return (
        f"{step} applied gradients nothing checked (backward=False, grad_norm=False): a "
        "NaN gradient (a backward's sqrt or division at 0) or a learning rate so large "
        "that the update overflows. Turn grad_norm on (one norm a step) to tell them apart."
    )


def _adaptive_eps(ctx: HintContext) -> str | None:
    """NaN from finite gradients in an update m / (sqrt(v) + eps), whose size is about the
    learning rate whatever the gradient: no learning rate overflows it, only 0/0 makes NaN."""
    if ctx.kind != "nan" or not _adaptive(ctx):
        return None
    when = _spike_when(ctx)
    if ctx.learning_rate is not None or when is not None:
        # (Unless the gradients themselves were huge: above ~1e19 a gradient's square
        # overflows float32, v is Inf, and a huge m over sqrt(v) is Inf/Inf.)
        spiked = f" (the gradient norm spiked {when})" if when else ""
        return (
            f"NaN in {ctx.optimizer}.step() from gradients that were finite but huge{spiked}: "
            "squares above ~1e38 make the second moment v Inf, and m / sqrt(v) Inf/Inf. Lower "
            "the learning rate, add warm-up, clip gradients (clip_grad_norm_)."
        )
    if ctx.optimizer_state:
        return (
            f"NaN in {ctx.optimizer}.step() from finite gradients: the optimizer's own state "
            f"for this weight is already non-finite ({ctx.optimizer_state}): an optimizer "
            "state_dict loaded with it (a checkpoint saved after a bad step), or a NaN let "
            "into the moments earlier. Load a clean optimizer state, or reset it."
        )
    s = ctx.stats
    every = s is not None and s.numel > 0 and s.nan_count == s.numel
    lr = " (if every value is NaN, also check for a NaN learning rate)" if every else ""
    if any(name in (ctx.optimizer or "").lower() for name in ("lamb", "lars")):
        return (
            f"NaN in {ctx.optimizer}.step() from finite gradients: the trust ratio "
            "||w|| / ||update|| is inf where an update is exactly 0 (a gradient of 0: a LoRA "
            "A whose B starts at zero), then inf * 0. Use a trust ratio of 1 where either norm "
            "is 0, as reference LAMB does; or eps=0 in m / (sqrt(v) + eps)."
        )
    eps = ctx.optimizer_eps  # (above what the dtype rounds to 0: no 0/0 in the update)
    tiny = 6e-8 if _dtype(ctx) == "torch.float16" else 1e-38  # (what the dtype rounds to 0)
    if eps is not None and math.isfinite(eps) and eps >= tiny:
        return (
            f"NaN in {ctx.optimizer}.step() from finite gradients with eps={eps:g}, so no 0/0 "
            "in the update: likely the weight was written outside optimizer.step() "
            f"(load_state_dict of a NaN checkpoint, copy_, .data =){lr}, or huge gradients "
            "whose squares overflow."
        )
    name = (ctx.optimizer or "").lower()
    update, default = (
        ("grad / sqrt(factored v)", "(1e-30, 1e-3)")
        if "adafactor" in name
        else ("grad / (sqrt(sum of grad**2) + eps)", "1e-10")
        if "adagrad" in name
        else ("grad / (sqrt(v) + eps)", "1e-8")
        if "rmsprop" in name
        else ("m / (sqrt(v) + eps)", "1e-8")
    )
    return (
        f"NaN in {ctx.optimizer}.step() from finite gradients is 0/0 in {update}: "
        "eps=0 (or too small for the dtype) with a gradient exactly 0 (an embedding row "
        f"not in the batch, an unused branch){lr}. Set eps > 0 (the default {default})."
    )


#: Backward nodes of a normalisation's 1/sqrt(var + eps): their derivative grows without
#: bound as the variance goes to 0.
_NORM_BACKWARDS: Final = frozenset({"RsqrtBackward0", "SqrtBackward0", "NativeLayerNormBackward0"})


#: Forward operations whose NaN/Inf is a value at the edge of their domain (a log or a
#: division at 0), not a magnitude a learning rate grew.
_DOMAIN_OPS: Final = frozenset(
    {"log", "log2", "log10", "div", "reciprocal", "sqrt", "rsqrt", "acos", "asin", "atanh"}
)


def _rate_of(note: str) -> float:
    """The learning rate a learning-rate note names (NaN/Inf: a schedule's, always first)."""
    found = re.search(r"parameter group is ([^ ,:]+)", note)
    try:
        return float(found.group(1)) if found else 0.0
    except ValueError:
        return math.nan


def _optimizer_state(ctx: HintContext) -> str | None:
    """Any optimizer (SGD's momentum too): its state for the weight is non-finite while
    the gradient was finite; the update carries it into the weight."""
    if ctx.phase != "param" or not ctx.optimizer_state:
        return None
    step = f"{ctx.optimizer}.step()" if ctx.optimizer else "optimizer.step()"
    return (
        f"{_word(ctx)} in {step} from a finite gradient: the optimizer's own state for this "
        f"weight is already non-finite ({ctx.optimizer_state}): an optimizer state_dict loaded "
        "with it (a checkpoint saved after a bad step), or a NaN let into it earlier. Load a "
        "clean optimizer state, or reset it."
    )


def is_attention(op: OpInfo | None) -> bool:
    # (With the fused inference kernels nn.MultiheadAttention and nn.TransformerEncoderLayer
    # take in eval() under no_grad, softmax included.)
    return op is not None and any(
        k in _base(op.name)
        for k in ("softmax", "scaled_dot_product", "multi_head_attention", "transformer_encoder")
    )


#: torch's attention modules: they fill what a bool mask hides themselves.
_TORCH_ATTENTION: Final = frozenset(
    {
        "MultiheadAttention",
        "TransformerEncoderLayer",
        "TransformerDecoderLayer",
        "TransformerEncoder",
        "TransformerDecoder",
        "Transformer",
    }
)


def _masked_text(ctx: HintContext) -> str:
    where = f"{ctx.op.name} made NaN" if ctx.op is not None else "NaN appeared"
    if ctx.module_type in _TORCH_ATTENTION:
        # (torch's own attention fills what a bool mask hides itself: no value to choose)
        return (
            f"{where} over a row where every position is masked: softmax of all -inf is 0/0 "
            "(fully masked: a sample whose padding mask is all True, an empty sequence or "
            "left padding under a causal mask). Drop such samples, or leave one position of "
            "them unmasked."
        )
    half = ctx.op is not None and any(
        s is not None and s.dtype == "torch.float16" for s in ctx.op.inputs
    )
    fix = (
        "(in float16 a -1e9 mask, or finfo.min added twice, is -inf already)"
        if half
        else "or mask with torch.finfo(dtype).min, not -inf"
    )
    return (
        f"{where} over a row where every position is masked: softmax of all -inf is 0/0 "
        "(fully masked: an empty sequence, left padding + a causal mask, a lone graph "
        "node). "
        f"Guard rows with no visible token {fix}."
    )


#: Weights no larger than this do not explain huge outputs by themselves (not exploding).
_MODEST_WEIGHTS: Final = 100.0

#: Operations that write a given value where a mask says: -inf written so is a mask.
_FILLS: Final = frozenset({"masked_fill", "masked_fill_", "where", "index_fill", "fill", "full"})


def _reads_a_mask(ctx: HintContext) -> str | None:
    """The first -inf was written on purpose (``masked_fill(~allowed, -inf)``), yet it reached
    what the module returned: the module picked a masked entry (an index the mask forbids)."""
    op = ctx.op
    if op is None or op.direction != "forward" or ctx.kind != "inf":
        return None
    if _base(op.name) not in _FILLS or scalar_arg(op) != -math.inf:
        return None
    return (
        f"{op.name} wrote -inf on purpose (a mask), and what this module returns read a masked "
        "entry: an index the mask forbids (a gold path through a forbidden transition, a target "
        "that is a masked class or token). Check the targets against the mask (an annotation "
        "error?), or mask with a large finite negative (-1e4) so that such an entry costs a "
        "large, finite penalty."
    )


#: Operations given NaN as the value to write: padding with NaN on purpose.
_NAN_FILLS: Final = _FILLS | {"constant_pad_nd", "pad"}


#: Autograd node bases (``NanToNumBackward0`` -> ``nantonum``) as the functions are spelled.
_FUNCTION_NAMES: Final = {
    "nantonum": "nan_to_num",
    "maskedfill": "masked_fill",
    "logsoftmax": "log_softmax",
    "logsigmoid": "logsigmoid",
    "clampmin": "clamp_min",
    "clampmax": "clamp_max",
    "linalgvectornorm": "torch.linalg.vector_norm",
    "specialxlogy": "xlogy",
}


def _nan_number(ctx: HintContext) -> str | None:
    """An operation given NaN as a plain Python number (not in any tensor nanguard saw): a
    scalar computed outside the model, a mixup lambda from 0/0."""
    op = ctx.op
    if op is None or op.direction != "forward" or _base(op.name) in _NAN_FILLS:
        return None  # (masked_fill(pad, nan), F.pad(value=nan) write NaN on purpose)
    if not any(isinstance(a, float) and math.isnan(a) for a in op.args):
        return None
    return (
        f"{op.name} was given NaN as a plain number, not in a tensor: a scalar computed "
        "outside the model (a mixup lambda or loss weight from 0/0, a temperature, a "
        "schedule's value) and passed in. Look at where that number is computed."
    )


def _masked_row(ctx: HintContext) -> str | None:
    """Only with -inf seen going in: without it, an overflow is as likely (checked later)."""
    if ctx.kind != "nan" or (ctx.op is not None and not is_attention(ctx.op)):
        return None
    if ctx.op is not None and any(s is not None and s.posinf_count for s in ctx.op.inputs):
        return _scores_overflow(ctx)
    neginf = ctx.op is not None and any(s is not None and s.neginf_count for s in ctx.op.inputs)
    if ctx.op is not None:
        peaks = _score_peak(ctx.op)
        if peaks is not None and peaks[2] >= _HUGE_SCORES:
            # Scores that overflow the softmax whatever the mask hides (a padding mask,
            # with -inf, is given to every padded batch): see _attention.
            return None
    return _masked_text(ctx) if ctx.mask_inputs or neginf else None


def _scores_overflow(ctx: HintContext) -> str:
    """A softmax given +Inf: the scores overflowed before it (no mask makes +inf)."""
    assert ctx.op is not None
    half = any(s is not None and s.dtype == "torch.float16" for s in ctx.op.inputs)
    limit = " (float16 tops out at 65504)" if half else ""
    return (
        f"{ctx.op.name} made NaN from scores that already hold +Inf: they overflowed before "
        f"the softmax{limit}, typically an unscaled q @ k.transpose(-2, -1). Scale q by "
        "1/sqrt(head_dim) before the product, use F.scaled_dot_product_attention, or compute "
        "the scores in float32."
    )


def _score_peak(op: OpInfo) -> tuple[float, float, float] | None:
    """Peaks of q, k and their product (about the largest attention score) for a fused
    attention op, whose backward takes the output gradient first."""
    if "scaled_dot_product" not in _base(op.name):
        return None
    first = 1 if op.direction == "backward" else 0
    q, k = _magnitude([_input(op, first)]), _magnitude([_input(op, first + 1)])
    return None if q is None or k is None else (q, k, q * k)


def _attention(ctx: HintContext) -> str | None:
    """NaN from attention with no -inf seen going in: a fully masked row, unless q and k are
    so large that the scores overflow the softmax's exp (the backward recomputes
    exp(s - logsumexp), and a float32 rounding error of s is then far above 88)."""
    op = ctx.op
    if ctx.kind != "nan" or op is None or not is_attention(op):
        return None
    peaks = _score_peak(op)
    if peaks is None or peaks[2] < _HUGE_SCORES:
        return _masked_text(ctx)
    q, k, scores = peaks
    when = _spike_when(ctx)
    spiked = f" (the gradient norm spiked {when})" if when else ""
    return (
        f"{op.name} made NaN from q and k reaching {q:.2g} and {k:.2g}: scores of order "
        f"{scores:.0e} overflow the softmax (not a masked row). The activations are exploding"
        f"{spiked}: lower the learning rate, clip gradients, or normalise q and k."
    )


def _zero_eps(ctx: HintContext) -> str | None:
    """A torch.nn norm layer built with eps=0: an equal-valued row has variance 0."""
    if ctx.module_eps != 0.0 or ctx.phase != "forward" or ctx.reason != "output":
        return None
    x = ctx.call_inputs[0] if ctx.call_inputs else None
    zeros = x is not None and x.min == 0.0 and x.max == 0.0
    given = " (it got all zeros: a dead ReLU or a zero-initialised layer before it?)"
    rms = ctx.module_type == "RMSNorm"
    return (
        f"This {ctx.module_type} was built with eps=0: a row "
        + ("of zeros has RMS 0" if rms else "(or group) of equal values has variance 0")
        + f"{given if zeros else ''}, and normalising divides by it. Pass eps > 0 "
        + ("(1e-6)." if rms else "(1e-5).")
    )


def _variance(ctx: HintContext) -> str | None:
    op = ctx.op
    if op is None or op.direction != "forward":
        return None
    base = _base(op.name)
    if "weight_norm" in base and ctx.kind != "nan":
        return (
            f"{op.name} made Inf: weight normalisation divides by the norm of each row of v, "
            "and a row whose norm underflows (below about 1e-19 in float32: weight decay on a "
            "pruned unit) divides by 0. Keep v's rows away from zero, or add an eps."
        )
    if ctx.kind != "nan":
        return None
    if "batch_norm" in base:
        x = _first_input(op)
        if x is None or len(x.shape) < 2 or x.shape[1] == 0 or x.numel // x.shape[1] != 1:
            # (eval mode: (x - running_mean) / sqrt(running_var + eps), eps = 0 by a config)
            var = _input(op, 4)  # (input, weight, bias, running_mean, running_var, ...)
            if var is not None and var.min is not None and var.min <= 0:
                return (
                    f"{op.name} normalised with running statistics whose running_var is 0 for "
                    f"a channel{_in(var, 'running_var')}: with eps = 0 that is 0/0 (a "
                    "checkpoint or config with eps=0, a channel never seen in training). Set "
                    "eps > 0 (1e-5), or fix the checkpoint's running_var."
                )
            return None
        return (
            f"{op.name} normalised a batch with one value per channel (shape {x.shape}): its "
            "unbiased running variance divides by N-1 = 0. Use batches of more than 1 "
            "(drop_last=True), GroupNorm/LayerNorm, or eval() for single samples."
        )
    if base in _NORMALISATIONS:
        x = _first_input(op)
        peak = _magnitude([x])
        if peak is not None and peak < 1e15:  # not an overflowing variance
            return (
                f"{op.name} made NaN from finite inputs: (x - mean) / sqrt(var + eps) is 0/0 "
                "when a normalised slice is constant (var = 0: a padding row, a dead channel) "
                "and eps = 0. Set eps > 0 (1e-5, or 1e-6 for RMSNorm)."
            )
        if peak is not None and x is not None and x.dtype in DTYPE_MAX:
            when = _spike_when(ctx)
            spiked = f" (the gradient norm spiked {when})" if when else ""
            return (
                f"{op.name} made NaN from finite inputs reaching {peak:.3g}: their variance "
                f"overflowed ({x.dtype} squares above about {math.sqrt(DTYPE_MAX[x.dtype]):.3g} "
                f"are Inf). The activations entering this normalisation are exploding{spiked}: "
                "lower the learning rate, clip gradients, or look at the layer before it."
            )
        return None
    if "weight_norm" in base:
        return (
            f"{op.name} made NaN: weight normalisation divides by the norm of each row of the "
            "direction v, and a row that is all zeros (pruned, or zero-initialised) is 0/0. "
            "Keep v away from zero, or normalise with an eps: v / (v.norm(dim=1, "
            "keepdim=True) + eps)."
        )
    if not {"var", "std"} & set(base.split("_")):
        return None
    return (
        f"{op.name} made NaN: the unbiased variance of a single element divides by N-1 = 0. "
        "Skip inputs of one element (a batch of 1, a one-frame utterance), or pass "
        "correction=0 and divide by std + eps: the std of one value is then 0."
    )


def _backward(ctx: HintContext) -> str | None:
    op = ctx.op
    if op is None or op.direction != "backward":
        return None
    # Only the node says which derivative it was: the aten ops of a backward (mul, div...)
    # come from derivative formulas and do not name the forward operation.
    node = _node_base(op.node)
    if not node:
        return None
    if op.custom_backward:
        return _custom_backward(ctx, op)
    if node in _EXPS and any(s is not None and s.posinf_count for s in op.inputs):
        return _hidden_exp_overflow(ctx, op)
    if _overflowed_half(ctx, op):
        return None  # a half-precision overflow in the derivative: see _overflow
    head = f"In the backward, {op.node} made {_made(ctx, op)} although the forward was finite:"
    if any(s is not None and s.nan_count for s in op.inputs) and node in (
        "softmax",
        "logsoftmax",
    ):
        # A softmax over a row masked whole, its NaN zeroed after (nan_to_num, where).
        return (
            f"In the backward, {op.node} read the NaN its forward made and code after it hid "
            "(nan_to_num, where): a row where every position is masked, or scores that "
            "overflowed. The gradient is NaN all the same: mask with torch.finfo(dtype).min, "
            "not -inf, or keep the scores finite."
        )
    if any(s is not None and s.nan_count for s in op.inputs):
        # A NaN saved in the forward and hidden from its result (torch.where, masking).
        func = _FUNCTION_NAMES.get(node, node)
        return (
            f"In the backward, {op.node} used a NaN that the forward computed and then hid "
            f"(the unselected branch of torch.where, {func} of an invalid input): its gradient "
            f"is still computed. Apply {func} to a safe input: torch.where(ok, x, 1.0)."
        )
    if node in {"sqrt", "rsqrt"}:
        return (
            f"{head} the derivative of sqrt is infinite at 0 (e.g. a distance between identical "
            "points). Put an eps inside the sqrt: torch.sqrt(x + 1e-12)."
        )
    if node in {"xlogy", "specialxlogy", "specialentr"}:
        what = "entr(p)" if node == "specialentr" else "xlogy(x, y)"
        slope = "-(1 + log p) is infinite" if node == "specialentr" else "x / y is 0/0"
        return (
            f"In the backward, {op.node} made {_made(ctx, op)} from a finite forward: {what} is "
            f"finite at 0 but its slope {slope} there (an entropy over a softmax probability "
            "that underflowed to exactly 0). Take the entropy from log_softmax: "
            "-(p * logits.log_softmax(-1)).sum(-1)."
        )
    if node == "binarycrossentropy":
        return (
            f"{head} binary_cross_entropy on probabilities divides by p * (1 - p), 0 where a "
            "sigmoid saturated to exactly 0 or 1 (soon in float16). Give the logits to "
            "binary_cross_entropy_with_logits instead (BCEWithLogitsLoss)."
        )
    if node in _NORMS:
        return (
            f"{head} the derivative of a norm, x / ||x||, blows up at or near a zero vector (a "
            "distance between identical points). Add an eps: torch.sqrt((d * d).sum(-1) + 1e-12)."
        )
    if node in {"acos", "asin"}:
        dtype = _dtype(ctx)
        if dtype in _HALF:
            # (A clamp to 1 - 1e-7 rounds back to 1.0 in half precision.)
            eps = "1e-2" if dtype == "torch.bfloat16" else "1e-3"
            return (
                f"{head} the derivative of {node} is infinite at +-1, and in "
                f"{dtype.removeprefix('torch.')} a clamp to 1 - 1e-7 rounds to 1.0. Clamp to "
                f"(-1 + {eps}, 1 - {eps}), or compute the {node} in float32."
            )
        return (
            f"{head} the derivative of {node} is infinite at +-1 (e.g. a cosine similarity of "
            "exactly 1). Clamp its input to (-1+eps, 1-eps) first."
        )
    if node == "acosh":
        return (
            f"{head} the derivative of acosh, 1 / sqrt(x*x - 1), is infinite at 1: a "
            "hyperbolic (Poincare, Lorentz) distance between identical points, a node sampled "
            "as its own negative. Clamp its input to 1 + eps first (as geoopt does)."
        )
    if node == "pow" and _base(op.name) in _LOGS:
        # PowBackward1/2: the derivative with respect to a tensor exponent, x ** p * log(x).
        return (
            f"{head} x ** p with a tensor (learnable) exponent p at a base x = 0: the derivative "
            "with respect to x, p * x ** (p - 1), is infinite there for p < 1 (NaN once "
            "multiplied by a 0, a padding mask), and the one with respect to p, "
            "x ** p * log(x), meets log(0) = -inf (torch zeroes it at x = 0; below 0 it is "
            "NaN). Clamp the base: x.clamp_min(eps) ** p."
        )
    # (The backward's own pow is x ** (p - 1): the forward's exponent is one more.)
    exponent = scalar_arg(op) if node == "pow" and _base(op.name) == "pow" else None
    power = exponent + 1 if exponent is not None else None
    if power is not None and power < 0:
        # (deg.pow(-0.5) with the Inf masked_fill-ed to 0: the forward hid it, not the slope)
        return (
            f"{head} x ** p with p = {power:g} has an Inf slope at x = 0, even where the "
            "forward's Inf was zeroed afterwards (masked_fill): 0 * inf = NaN. Clamp the base "
            "first, x.clamp_min(eps) ** p, or give isolated nodes self-loops."
        )
    if node == "pow":
        return (
            f"{head} the derivative of x ** p with 0 < p < 1 is infinite at x = 0. Add an eps to "
            "the base: (x + eps) ** p."
        )
    if (
        node in {"div", "reciprocal"}
        and op.source is not None
        and "where(" in op.source
        and _zero_denominator(op, node)
    ):
        return (
            f"In the backward, {op.node} made {_made(ctx, op)}: torch.where on that line "
            "computes both branches, and its unselected one divides by 0 (0/0 or x/0, hidden in "
            "the forward); the derivative there, -x / y^2, is still computed (0 * inf = NaN). "
            "Divide by a safe denominator: x / torch.where(ok, y, 1)."
        )
    if node in {"div", "reciprocal"}:
        return (
            f"{head} the derivative of x / y, -x / y^2, is infinite at y = 0 or overflows for a "
            "tiny y. Add an eps to the denominator, also where its forward result is not used."
        )
    if node in {"log", "log2", "log10", "log1p"}:
        return (
            f"{head} the derivative of log is infinite at 0, so a log of 0 was hidden by where, "
            "clamp or nan_to_num (0 * inf = NaN). Clamp before the log: x.clamp_min(1e-12).log()."
        )
    if node in {"where", "maskedfill", "nantonum", "clamp", "clampmin", "clampmax"}:
        return (
            f"{head} torch.where (or masked_fill, nan_to_num) still back-propagates into the "
            "unselected branch: 0 * inf = NaN. Compute that branch on a safe input, e.g. "
            "torch.where(m, x, 1.0) before the log or division."
        )
    if "weightnorm" in node:
        return (
            f"{head} weight normalisation's gradient divides by each row's norm of v (and its "
            "square): a row with a tiny norm (a pruned unit) makes it infinite. Keep v's rows "
            "away from zero, or add an eps."
        )
    if re.fullmatch(r"(linalg)?(svd|svdvals|eigh?|eigvalsh?|symeig|lobpcg)", node):
        return (
            f"{head} the gradient of an SVD or eigendecomposition divides by differences of the "
            "values, infinite when two are equal (repeated values). Add a tiny perturbation, or "
            "use svdvals/eigvalsh if only the values are needed."
        )
    if node == "logsumexp":
        return (
            f"{head} logsumexp over a slice that is entirely -inf has a NaN gradient. Guard fully "
            "masked slices, or mask with torch.finfo(dtype).min instead of -inf."
        )
    return _hidden_inf(ctx, op)


def _zero_denominator(op: OpInfo, node: str) -> bool:
    """Whether the backward's division may have read a 0 in its denominator (its finite
    range reaches 0: a norm of a zero vector, a signed dx of a degenerate segment; or a
    number, whose value is not known): a division by 0 the forward hid, not one by a tiny
    value (a learned temperature collapsed to 1e-23)."""
    den = _input(op, 0 if node == "reciprocal" else 1)
    if den is None or den.min is None or den.max is None:
        return True
    return den.min <= 0.0 <= den.max


def _hidden_inf(ctx: HintContext, op: OpInfo) -> str | None:
    """NaN from an Inf the node saved in the forward: the derivative's own ops are finite
    until the pinned one, so an Inf among its inputs was computed by the forward and then
    hidden from the result (the unselected branch of torch.where, a product with 0)."""
    made_nan = op.output.nan_count > 0 if op.output is not None else ctx.kind == "nan"
    infs = [s for s in op.inputs if s is not None and s.posinf_count + s.neginf_count]
    if not made_nan or not infs:
        return None
    neg = all(not s.posinf_count for s in infs)
    pos = all(not s.neginf_count for s in infs)
    inf = "-Inf" if neg else "+Inf" if pos else "Inf"
    if op.inf_from is not None:
        return _hidden_inf_from(op, inf, op.inf_from)
    if ctx.saved_hooks is not None:
        return (
            f"In the backward, {op.node} read a {inf} that the forward likely never computed: "
            f"the forward ran under saved_tensors_hooks (pack hook {ctx.saved_hooks}), so the "
            "backward reads what the unpack hook gives back, and a tensor packed to a narrower "
            "dtype comes back Inf where it is out of range (float16 past 65504). Pack in "
            "bfloat16 or float32, or scale the tensor into range before packing."
        )
    if neg:
        example, fix = "log(0)", "torch.where(p > 0, p, 1) before the log"
    else:
        example, fix = "an overflow", "torch.where(ok, x, 0) before the exp or division"
    return (
        f"In the backward, {op.node} used a {inf} that the forward computed (e.g. {example}) and "
        "hid (torch.where's unselected branch): its gradient still flows, 0 * inf = NaN. "
        f"Compute the unsafe branch on safe inputs: {fix}."
    )


def _hidden_inf_from(op: OpInfo, inf: str, maker: OpInfo) -> str:
    """A saved Inf whose maker the replay saw: name it, and why it made the Inf."""
    x = _first_input(maker)
    base = _base(maker.name)
    top = f" (its input reached {x.max:.4g})" if x is not None and x.max is not None else ""
    at = f" at {maker.source}" if maker.source else ""
    if maker.mask_input:  # log(action_mask): -inf on purpose, the product with it is the bug
        return (
            f"In the backward, {op.node} multiplied by the -Inf of a mask's log{at} (on "
            "purpose), hidden in the forward by a product with 0 or torch.where: its gradient "
            "is 0 * inf = NaN. Zero the log-probabilities where the mask is 0 before using them "
            "(logp.masked_fill(mask == 0, 0)); keep the mask."
        )
    if base in {"exp", "exp2", "expm1"}:
        why = (
            f"it overflowed{top}: exp is Inf past 88.7 in float32, 11.1 in float16. Clamp the "
            "exponent, or keep what it comes from in range (a learned log-scale, log-rate or "
            "log-temperature parameter drifts up during training)"
        )
    elif base in _LOGS:
        why = (
            f"it took log(0){_in(x)}. Compute the unsafe branch on safe inputs: "
            "torch.where(p > 0, p, 1) before the log, or p.clamp_min(1e-12)"
        )
    elif base in {"div", "reciprocal"}:
        why = "it divided by 0. Add an eps to the denominator"
    else:
        why = f"it made it from finite values{_in(x)}. Keep its inputs in range"
    return (
        f"In the backward, {op.node} used a {inf} that the forward made and later ops hid (a "
        "product with 0, exp(-inf) = 0, the unselected branch of torch.where): its gradient "
        f"still flows, 0 * inf = NaN. The {inf} was made by {maker.name}{at}: {why}."
    )


def custom_backward_name(node: str | None, hook: bool = False) -> tuple[str, str]:
    """Where a user's own backward formula is, and what it is: ``("VNormFn.backward", "a
    custom autograd.Function")``, or for a ``torch.library`` custom op (its node is
    ``GeneratedBackwardFor_<ns>_<op>_<overload>Backward``) the function given to
    ``register_autograd``; ``hook``: a gradient hook autograd ran at ``node``."""
    if hook:
        if node == "BackwardHookFunctionBackward":
            return "a module's backward hook", "register_full_backward_hook"
        if node is not None and node.endswith("AccumulateGrad"):
            return "a hook on a parameter's gradient", "Tensor.register_hook"
        return f"a gradient hook run at {node}", "Tensor.register_hook or a module hook"
    name = re.sub(r"Backward\d*$", "", node or "")
    generated = re.fullmatch(r"GeneratedBackwardFor_(\w+)", name)
    if generated:
        return (
            f"the backward given to register_autograd for {generated.group(1)}",
            "a torch.library custom op",
        )
    return f"{name or 'the custom Function'}.backward", "a custom autograd.Function"


def _custom_backward(ctx: HintContext, op: OpInfo) -> str | None:
    """An op of the user's own backward formula: judged as user code, like a forward op."""
    where, what = custom_backward_name(op.node, op.hook)
    as_code = dataclasses.replace(ctx, op=dataclasses.replace(op, direction="forward"))
    text = _domain(as_code)
    return f"In {where} ({what}), {text}" if text else None


def _hidden_exp_overflow(ctx: HintContext, op: OpInfo) -> str:
    """exp(x) saved as +Inf: log, tanh or a division made the forward finite again."""
    dtype = _dtype(ctx)
    log = math.log2 if _node_base(op.node) == "exp2" else math.log
    above = f" (x > {log(DTYPE_MAX[dtype]):.4g})" if dtype is not None else ""
    return (
        f"In the backward, {op.node} used its saved result, +Inf: exp overflowed{above} or "
        "its input was +Inf already (a log(0) upstream, a buffer's too), and torch.where, "
        "log, tanh or a division hid it: 0 * inf. Use F.softplus or logaddexp, clamp the "
        "exponent, or floor the log."
    )


def _logdet(ctx: HintContext) -> str | None:
    """torch.logdet is where(sign == -1, nan, logabsdet): the replay sees that where."""
    op = ctx.op
    if op is None or op.direction != "forward":
        return None
    code = (op.source or "").partition(": ")[2]
    if _base(op.name) == "log" and re.search(r"\bdet\s*\(", code) and ctx.kind == "inf":
        # (log(0): a singular matrix, whose slogdet is -inf as well)
        return (
            f"{op.name} took the log of a determinant that is 0: one that underflowed (det of "
            "a large matrix with small entries), which torch.linalg.slogdet(A).logabsdet keeps "
            "finite, or a singular matrix (a zero row: a pruned 1x1 conv), which needs Glow's "
            "LU parameterisation to stay invertible."
        )
    if _base(op.name) == "log" and re.search(r"\bdet\s*\(", code):
        return (
            f"{op.name} took the log of a determinant that is negative or 0 (log(det(A))). "
            "For log|det A| (a flow's log-Jacobian) use torch.linalg.slogdet(A).logabsdet; "
            "clamping the determinant would corrupt the likelihood."
        )
    if _base(op.name) in ("_linalg_slogdet", "linalg_slogdet", "slogdet") and ctx.kind == "inf":
        # (log|det| is -inf for a singular matrix: a pruned or zero-initialised 1x1 conv)
        return (
            f"{op.name} is -Inf for a singular matrix (a zero row or column, duplicated "
            "channels: a pruned or zero-initialised invertible 1x1 conv). Keep it invertible: "
            "Glow's LU parameterisation with s = exp(log_s), or an orthogonal initialisation."
        )
    if _base(op.name) != "where":
        return None
    constant = any(isinstance(a, float) and math.isnan(a) for a in op.args)
    if not constant or not re.search(r"\blogdet\s*\(", code):
        return None
    return (
        "torch.logdet is NaN for a negative determinant. For a flow's log-Jacobian use "
        "torch.linalg.slogdet(A).logabsdet. For a covariance, a negative one is a singular "
        "matrix's round-off: keep it positive-definite (A @ A.T + 1e-4 * I, or a Cholesky "
        "factor with a softplus diagonal)."
    )


#: An entropy term written by hand: p * log(p), p * p.log(), probs * torch.log(probs + ...).
_ENTROPY: Final = re.compile(
    r"\b([\w.]+)\s*\*\s*(?:torch\.)?log2?\(\s*\1\b|\b([\w.]+)\s*\*\s*\2\.log2?\(\)"
    r"|(?:torch\.)?log2?\(\s*([\w.]+)\s*\)\s*\*\s*\3\b"
)
# The log of a matrix's diagonal: log(torch.diagonal(L)), L.diagonal(...).log(), diag(L).log()
_DIAGONAL_LOG = re.compile(
    r"\blog\w*\(\s*(?:[\w\]\[]+\.)*diag(?:onal)?\(|\.diag(?:onal)?\([^()]*\)\.log\("
)
#: Solves with a triangular (Cholesky) factor: NaN from finite inputs where it is singular.
_FACTOR_SOLVES: Final = frozenset(
    {"cholesky_solve", "cholesky_inverse", "linalg_solve_triangular", "triangular_solve"}
)


def _domain(ctx: HintContext) -> str | None:
    op = ctx.op
    if op is None or op.direction != "forward":
        return None
    base = _base(op.name)
    x = _first_input(op)
    if base == "log1p":
        return (
            f"{op.name} took log(1 + x) of a value x <= -1{_in(x)}: it is -Inf at -1 and NaN "
            "below. Keep x above -1 (x.clamp_min(-1 + 1e-6)); for artanh(x) = 0.5 * "
            "(log1p(x) - log1p(-x)) clamp x to (-1 + 1e-7, 1 - 1e-7): 1 - 1e-15 rounds to 1 "
            "in float32."
        )
    if base in _FACTOR_SOLVES and ctx.kind == "nan":
        return (
            f"{op.name} solved with a triangular factor that is singular (a 0 on its "
            "diagonal): what a failed factorisation leaves (cholesky_ex with info > 0: the "
            "matrix was not positive-definite). Check info and add a jitter to the matrix's "
            "diagonal (+ 1e-6 * I)."
        )
    if base in _LOGS and _DIAGONAL_LOG.search((op.source or "").partition(": ")[2]):
        return (
            f"{op.name} took the log of a matrix diagonal holding a value <= 0{_in(x)}: a "
            "Cholesky factor's log-determinant? A failed factorisation (cholesky_ex with info "
            "> 0: not positive-definite) leaves such values. Check info and add a jitter to "
            "the matrix's diagonal; a clamp would hide it."
        )
    if (
        base in _LOGS
        and ctx.kind == "nan"
        and _ENTROPY.search((op.source or "").partition(": ")[2])
    ):
        return (
            f"{op.name} took the log of a probability of 0{_in(x)} in an entropy p * log(p): "
            "0 * -inf is NaN (a masked or saturated position). Use torch.special.entr(p), or "
            "torch.xlogy(p, p), which are 0 at p = 0."
        )
    if (
        base in _LOGS
        and op.untrained  # (not the user's log(probs) on the same line: that needs a gradient)
        and x is not None
        and x.min is not None
        and x.min >= 0  # (an exponential draw: a log of negative values is someone else's)
        and "gumbel_softmax" in (op.source or "").partition(": ")[2]
    ):
        # (torch's gumbel_softmax: -log(exponential_()), and exponential_ can return 0)
        return (
            f"{op.name} inside F.gumbel_softmax took the log of its own noise sample, an "
            "exponential draw of exactly 0 (a rare draw torch can make: -log(0) is Inf). "
            "Draw the Gumbel noise yourself from a clamped uniform, -log(-log(u.clamp(1e-10, "
            "1 - 1e-7))), and add it to the logits."
        )
    if op.untrained and base in (*_LOGS, "sqrt", "rsqrt", "acos", "asin"):
        # (A box regression target log(gt_w / anchor_w) of a box flipped to x2 < x1.)
        what = (
            "took the log of a value <= 0"
            if base in _LOGS
            else "took the sqrt of a negative value"
            if base == "sqrt"
            else "got a value outside its domain"
        )
        return (
            f"{op.name} {what}{_in(x)}, made from tensors that need no gradient (the batch, "
            "targets, a schedule, frozen layers), not by training: a bad sample, label or "
            "constant (a box with x2 < x1 after a flip, a sigma of 0), or a frozen layer's "
            "zeros? Check where it is made first: a clamp would hide bad data."
        )
    if base in _LOGS:
        return (
            f"{op.name} took the log of a value <= 0{_in(x)}: it is -Inf at 0 and NaN below. "
            "Clamp the input (x.clamp_min(1e-12)) or add an eps; use log_softmax or "
            "logsigmoid instead of log(softmax) or log(sigmoid)."
        )
    if base in {"logit", "special_logit"}:
        return (
            f"{op.name} got a value outside (0, 1){_in(x)}: logit is -Inf at 0, +Inf at 1 and "
            "NaN beyond. Squeeze the input into the open interval first, alpha + (1 - 2 * alpha) "
            "* x (as flows do for pixels in [0, 1]), or pass eps= to torch.logit."
        )
    if base == "sqrt":
        return (
            f"{op.name} took the sqrt of a negative value{_in(x)}, which is NaN (a variance or "
            "squared distance that rounding made slightly negative?). Clamp it to a small "
            "positive value, x.clamp_min(1e-12): not to 0, where sqrt's slope is infinite "
            "(a NaN gradient in the backward)."
        )
    if base == "rsqrt" and x is not None and x.min is not None and x.min < 0:
        # (An eps cannot lift a variance of -4: E[x^2] - E[x]^2 cancelled.)
        dtype = _dtype(ctx)
        low = f" in {dtype.removeprefix('torch.')}" if dtype in _HALF else ""
        return (
            f"{op.name} took rsqrt of a negative value{_in(x)}: a variance by cancellation, "
            f"E[x^2] - E[x]^2{low} (use x.var() in float32, clamp_min(0)), or a learned "
            "precision the optimizer moved below 0 (parameterise it as softplus or exp of a "
            "log)."
        )
    if base == "rsqrt" and _dtype(ctx) == "torch.float16":
        return (
            f"{op.name} took rsqrt of 0 in float16{_in(x)}: an eps below float16's smallest "
            "value, 6e-8 (StyleGAN2's demodulation uses 1e-8), rounds away and squares that "
            "small underflow to 0. Use an eps of 1e-5 or more, or compute it in float32."
        )
    lost = _lost_spread(ctx)
    if base in ("rsqrt", "sqrt", "div", "reciprocal") and lost is not None:
        return lost
    if base == "rsqrt":
        return (
            f"{op.name} took rsqrt of a value <= 0{_in(x)}: +Inf at 0, NaN below. Add an eps "
            "inside, torch.rsqrt(var + 1e-5), as normalisation layers do."
        )
    if base in {"acos", "asin", "atanh"}:
        if base == "atanh":
            outside, why = "at or beyond +-1", "a tanh output rounds to exactly +-1"
        else:
            outside, why = "outside [-1, 1]", "a cosine or normalised dot product can exceed 1"
        return (
            f"{op.name} got a value {outside}{_in(x)}: {why} by rounding. Clamp it to "
            "(-1+eps, 1-eps)."
        )
    if base == "acosh":
        low = f" (as low as {x.min:.9g})" if x is not None and x.min is not None else ""
        return (
            f"{op.name} got a value below 1{low}: a hyperbolic distance's argument "
            "(1 + 2|u-v|^2 / ((1-|u|^2)(1-|v|^2))) rounds below 1 at identical points, or a "
            "norm past the ball's edge flips its sign. Clamp it to 1 + eps (as geoopt does)."
        )
    if base == "pow":
        return _pow(ctx, op)
    if base in {"div", "true_divide", "reciprocal"}:
        return _division(ctx, op, base)
    if base in {"special_ndtri", "ndtri", "erfinv", "special_erfinv"}:
        ends = "-1 or 1" if "erfinv" in base else "0 or 1"
        return (
            f"{op.name} is infinite at {ends}{_in(x)}: a probability or rank of exactly "
            f"{ends} (a quantile / rank-Gauss transform of the largest or smallest value). "
            "Clip it first: p.clamp(eps, 1 - eps)."
        )
    if base in _POLES and x is not None and x.min is not None and x.min <= 0:
        return (
            f"{op.name} hit a pole at a non-positive integer{_in(x)}. Keep its input positive, "
            "e.g. softplus(x) + eps."
        )
    empty_mean = base in {"mean", "nanmean"} or base in _MEAN_LOSSES
    if empty_mean and ctx.kind == "nan" and x is not None and x.numel == 0:
        what = (
            "averaged over zero elements"
            if base in {"mean", "nanmean"}
            else ("is a mean (reduction='mean') over zero elements")
        )
        return (
            f"{op.name} {what} (shape {x.shape}), and a mean of nothing is NaN. Guard empty "
            "selections (no foreground anchor, no valid token, no positive pair): skip the "
            "term, or use reduction='sum' divided by max(count, 1)."
        )
    if base in {"_ctc_loss", "ctc_loss"} and ctx.kind == "inf":
        return (
            f"{op.name} is +Inf for a sample whose input is shorter than its target (after the "
            "encoder's downsampling; repeated labels need a blank between them, so one more "
            "frame each): no alignment exists. Pass zero_infinity=True to CTCLoss "
            "(ctc_zero_infinity=True in Hugging Face configs), or drop such samples; check "
            "input_lengths."
        )
    if base.startswith("nll_loss") and ctx.kind == "nan":
        return (
            f"{op.name} made NaN: every target in the batch equals ignore_index (or has weight "
            "0), so its mean is 0/0. Skip such batches, or divide a sum by max(count, 1)."
        )
    return None


def _pow(ctx: HintContext, op: OpInfo) -> str | None:
    base = _input(op, 0)
    made = op.output
    # What pow itself made (an Inf that a later 0 * inf turned into the finding's NaN).
    made_nan = made.nan_count > 0 if made is not None else ctx.kind == "nan"
    if made_nan:
        return (
            f"{op.name} raised a negative base to a fractional power{_in(base, 'base')}, which is "
            "NaN. "
            "Raise x.abs() or x.clamp_min(eps) instead, or use an integer exponent."
        )
    exponent = scalar_arg(op)
    exponent_stats = _input(op, 1)
    if exponent is not None:
        negative = exponent < 0
    elif exponent_stats is not None and exponent_stats.min is not None:
        negative = exponent_stats.min < 0
    else:
        negative = True  # unknown: 0 ** p is Inf exactly when p < 0
    if base is not None and _has_zero(base) and negative:
        return (
            f"{op.name} raised 0 to a negative power{_in(base, 'base')}, which is Inf (a degree "
            "normalisation deg ** -0.5 over an isolated node, a count of 0). Floor the base: "
            "x.clamp_min(1) or x.clamp_min(eps) ** p (a masked_fill of the Inf after leaves a "
            "learned base's gradient NaN)."
        )
    return None


#: A denominator named as a count on the operation's line.
_COUNT_NAME = re.compile(
    r"num_items|\bcounts?\b|n_?tokens|num_tokens|n_valid|num_valid|n_items|mask\.sum\(",
    re.IGNORECASE,
)


def _division(ctx: HintContext, op: OpInfo, base: str) -> str | None:
    den = _input(op, 0 if base == "reciprocal" else 1)
    num = _input(op, 0) if base != "reciprocal" else None
    spectral = ctx.module_type in ("_SpectralNorm", "SpectralNorm") or (
        # (the hook-based nn.utils.spectral_norm divides the weight it keeps as weight_orig)
        "SpectralNorm" in ctx.pre_hooks
        and bool(op.params)
        and (op.params[0] or "").endswith("_orig")
    )
    if spectral and den is not None and _has_zero(den):
        # (torch's own division, by the largest singular value: no eps to add there)
        return (
            f"{op.name} divided the weight by its largest singular value, estimated as 0: "
            "spectral_norm of a weight that is all zeros (zero-initialised, or pruned whole), "
            "0/0 in torch's own code. Initialise that weight otherwise, or leave spectral_norm "
            "off that layer."
        )
    if (
        den is not None
        and num is not None
        and (den.posinf_count or den.neginf_count)
        and (num.posinf_count or num.neginf_count)
    ):  # (a softmax by hand over an empty segment: its max is -inf, exp(x - max) +Inf)
        return (
            f"{op.name} divided Inf by Inf, which is NaN: an eps does not help. Look at what "
            "made the Inf before it: an exp of a "
            "value past 88, or x - max where the max over an empty set (a node with no "
            "edges) is -inf; use torch.softmax / logsumexp, or clamp the max to be finite."
        )
    if den is None and op.name.startswith("aten.div.Tensor") and len(op.inputs) > 1:
        # An integer tensor denominator that is 0: a count (transformers' Trainer divides the
        # summed loss by num_items_in_batch, the labels that are not -100).
        return (
            f"{op.name} divided by an integer tensor holding 0, a count: a mean over nothing "
            "(every label ignored, -100 throughout a batch; an empty mask). Skip such batches "
            "or divide by count.clamp_min(1); an eps is the wrong fix."
        )
    if (
        den is not None
        and den.numel <= 1
        and den.min == 0
        and den.max == 0
        and _COUNT_NAME.search((op.source or "").partition(": ")[2])
    ):
        # A float count (Trainer's num_items_in_batch, divided across ranks) that is 0.
        return (
            f"{op.name} divided by a count that is 0: a mean over nothing (every label "
            "ignored, -100 throughout a batch; an empty mask). Skip such batches or divide "
            "by count.clamp_min(1); an eps is the wrong fix."
        )
    if den is None:
        scalar = scalar_arg(op)
        out = op.output
        if scalar is not None and scalar != 0 and abs(scalar) < 1 and out is not None:
            if not (out.posinf_count or out.neginf_count):
                return None
            later = ", which a softmax or a subtraction then made NaN" if ctx.kind == "nan" else ""
            if abs(scalar) < _TINY_DIVISOR:
                # (x / tau: a temperature annealed to almost 0, gumbel_softmax's; the Inf it
                # made becomes NaN in a softmax after it.)
                return (
                    f"{op.name} divided by {scalar:.3g}, a number (a temperature annealed too "
                    f"far: gumbel_softmax's tau), and the quotient overflowed to Inf{later}. "
                    "Keep it at a floor (tau >= 0.1), or compute in float32."
                )
            return (
                f"{op.name} divided by {scalar:.3g} (a temperature) and the quotient "
                f"overflowed to Inf{_in(_input(op, 0))}{later}: what it divides is too large "
                "for the dtype. Compute it in float32, or normalise first (cosines stay in "
                "[-1, 1])."
            )
        if scalar is not None and scalar != 0:
            return None
        if scalar == 0 and base != "reciprocal":
            return (
                f"{op.name} divided by the number 0 (a Python constant): n - 1 of a batch of "
                "one sample (an unbiased covariance: drop_last=True), a keep probability of 0 "
                "(x / (1 - p) at p = 1: DropPath's drop_prob=1), or another count that reached "
                "0. Fix what sets it; an eps is the wrong fix."
            )
    elif (
        (ctx.kind != "nan" or _made_only_inf(op))  # (an Inf a later op made NaN: lgamma(inf))
        and not _has_zero(den)
        and den.min is not None
        and den.max is not None
    ):
        # A denominator that is never 0: the quotient was too large for the dtype.
        smallest = min(abs(den.min), abs(den.max))
        dtype = _dtype(ctx) or "its dtype"
        return (
            f"{op.name} divided by a denominator as small as {smallest:.4g} and the quotient "
            f"overflowed {dtype.removeprefix('torch.')}. Add an eps to the denominator or clamp "
            "it away from 0 (d.clamp_min(eps)); compute the division in float32."
        )
    line = (op.source or "").partition(": ")[2]
    if _dtype(ctx) == "torch.float16" and "cosine_similarity" in line:
        return (
            f"{op.name} divided by zero{_in(den, 'denominator')} in float16 inside "
            "F.cosine_similarity: its eps=1e-8 rounds to 0 in float16, so a zero vector (a "
            "padding or dead embedding) is 0/0. Pass eps=1e-4, or compute it in float32 "
            "(F.cosine_similarity(a.float(), b.float()))."
        )
    if _dtype(ctx) == "torch.float16":
        # (An eps that float16 cannot hold: BERT's LayerNorm eps=1e-12 under model.half().)
        return (
            f"{op.name} divided by zero{_in(den, 'denominator')} in float16: 0/0 is NaN, x/0 "
            "Inf. Add an eps float16 can hold: below 6e-8 an eps rounds away (BERT's LayerNorm "
            "eps=1e-12: d + 1e-12 is still 0); use 1e-5 or more, or normalise in float32."
        )
    return (
        f"{op.name} divided by zero{_in(den, 'denominator')}: x/0 is Inf and 0/0 is NaN. Add an "
        "eps to the denominator (x / (d + eps)) or clamp it; a norm, std or count can be 0."
    )


#: Dtype conversions (x.to(dtype), x.half(), type_as).
_CASTS: Final = frozenset({"to_copy", "to", "to_dtype", "copy"})


def _divides_by_zero(op: OpInfo) -> bool:
    """A division (or reciprocal, rsqrt, negative power) whose denominator holds an exact
    0: the derivative of sqrt at 0 (grad / (2 * sqrt(x))), of acos at 1."""
    base = _base(op.name)
    if base in ("div", "div_"):
        den = _input(op, 1)
    elif base in ("reciprocal", "rsqrt") or (base == "pow" and (scalar_arg(op) or 0.0) < 0):
        den = _input(op, 0)
    else:
        return False
    return den is not None and (den.min == 0 or den.max == 0 or 0.0 in den.first_values)


def _lost_spread(ctx: HintContext) -> str | None:
    """A half-precision input whose values all rounded to one (1000 +- 0.5 in bfloat16,
    whose spacing there is 8): its variance is exactly 0, and an eps only hides that the
    information is gone."""
    dtype = _dtype(ctx)
    if dtype not in _HALF or ctx.op is None:
        return None
    for s in ctx.call_inputs[:1]:  # (what it normalises, not a shared timestep beside it)
        if s is None or s.min is None or s.max is None or s.min != s.max or s.numel < 2:
            continue
        peak = abs(s.max)
        spacing = peak * (2.0**-7 if dtype == "torch.bfloat16" else 2.0**-10)
        if peak >= 64:
            short = dtype.removeprefix("torch.")
            return (
                f"{ctx.op.name} divided by a spread of 0: every value it normalises is "
                f"{s.max:.4g}, as {short} rounds values near there {spacing:.2g} apart (a "
                "large offset with a small spread). An eps only hides the loss: compute the "
                "statistics in float32, or subtract the offset first."
            )
    return None


def is_specific(text: str | None) -> bool:
    """Whether a hint names a cause (not the plain "does not recognise this pattern")."""
    return bool(text) and not str(text).startswith("nanguard does not recognise")


def _overflowed_half(ctx: HintContext, op: OpInfo) -> bool:
    """The op itself made Inf (and no NaN) in half precision from large operands: an
    overflow, whatever later turned it into NaN (0 * inf in a derivative). Not from operands
    near 1 or 0: a derivative infinite at its domain's edge (acos at a cosine that a clamp to
    1 - 1e-7 left at 1.0, which is 1 - 1e-7 in bfloat16)."""
    out = op.output
    dtype = _dtype(ctx)
    if (
        dtype not in _HALF
        or out is None
        or not out.posinf_count + out.neginf_count
        or out.nan_count
    ):
        return False
    if _divides_by_zero(op):
        return False  # (x / 0: infinite in any precision, whatever the loss scale)
    peak = _magnitude(op.inputs)
    if peak is None or peak >= math.sqrt(DTYPE_MAX[dtype]):
        return True
    # (Moderate operands: an overflow still when a power made it (rsqrt(var) ** 3 of a
    # small variance), the edge of a domain when an operand is exactly 0.)
    return not any(
        s is not None and (s.min == 0 or s.max == 0 or 0.0 in s.first_values) for s in op.inputs
    )


def _made_only_inf(op: OpInfo) -> bool:
    """The op's output holds Inf and no NaN (from finite inputs: an overflow)."""
    out = op.output
    return out is not None and bool(out.posinf_count + out.neginf_count) and not out.nan_count


def _overflow(ctx: HintContext) -> str | None:
    dtype = _dtype(ctx)
    if dtype is None:
        return None
    limit = DTYPE_MAX[dtype]
    op = ctx.op
    short = dtype.removeprefix("torch.")
    if op is None:
        peak = _magnitude([ctx.stats])
        inputs = _magnitude(ctx.call_inputs)
        if peak is not None and peak >= limit * _LARGE_FRACTION:
            what = f"This tensor, with finite values up to {peak:.4g},"
        elif inputs is not None and inputs >= limit * _LARGE_FRACTION:
            what = f"This call, with inputs reaching {inputs:.4g},"  # no op found by a replay
        else:
            return None
    else:
        base = _base(op.name)
        peak = _magnitude(op.inputs)
        large = peak is not None and peak >= limit * _LARGE_FRACTION
        if not large and base in _MATMULS:  # (operands of 3e19 whose products pass 3.4e38)
            each = sorted((_magnitude([s]) or 0.0 for s in op.inputs), reverse=True)
            large = len(each) >= 2 and each[0] * each[1] >= limit * _LARGE_FRACTION
        prone = base in _SUMS or base in _PRODUCTS or base == "pow"
        made_inf = (
            _overflowed_half(ctx, op)
            or base in _EXPS  # exp makes Inf, never NaN
            or (prone and ctx.phase == "forward" and _made_only_inf(op))  # x ** 2 of 3e21
        )
        # NaN from finite inputs is an overflow only where inf - inf can happen.
        if ctx.kind == "nan" and base not in _SUMS and not large and not made_inf:
            return None
        if not (large or made_inf or (prone and (dtype in _HALF or ctx.kind == "inf"))):
            return None
        # (In half precision too when float32 would overflow as well: a softmax written
        # without subtracting the max; bfloat16 has float32's range.)
        wide = math.log(DTYPE_MAX["torch.float32"])
        if base in _EXPS and (dtype not in _HALF or (peak is not None and peak > wide)):
            also = f"; past {wide:.4g} float32 overflows too" if dtype == "torch.float16" else ""
            param = op.params[0] if op.params else None
            if param is not None and op.direction == "forward":
                # exp of a learned log-scale (CLIP's logit_scale, a log-variance, a temperature)
                return (
                    f"{op.name} of the parameter `{param}`{_in(_first_input(op), 'value')} "
                    f"overflowed {short}: exp(x) is Inf above x = {math.log(limit):.4g}{also}. "
                    "A learned log-scale or temperature grew that far: clamp it (CLIP clamps "
                    "logit_scale to ln 100 = 4.605) or lower its learning rate."
                )
            when = _spike_when(ctx)
            if when is not None:  # (FCOS's exp of box sizes, after a raw 0-255 batch)
                return (
                    f"{op.name} overflowed {short}: exp(x) is Inf above x = "
                    f"{math.log(limit):.4g}{_in(_first_input(op))}{also}; the gradient norm "
                    f"spiked {when}: if the weights grew since, lower the learning rate or clip "
                    "gradients; clamp the input (as detectors clamp log box sizes)."
                )
            return (
                f"{op.name} overflowed {short}: exp(x) is Inf above x = "
                f"{math.log(limit):.4g}{_in(_first_input(op))}{also}. Clamp the input or stay "
                "in log space (logsumexp, log_softmax, softplus; subtract the max first)."
            )
        given = _first_input(op)
        if (
            base in _CASTS
            and given is not None
            and given.dtype.startswith(("torch.int", "torch.uint"))
            and peak is not None
            and peak > limit
        ):
            return (
                f"{op.name} cast integers reaching {peak:.6g} (positions or counts: a KV-cache "
                f"offset, a long sequence) to {short}, which cannot hold them (max "
                f"{limit:.6g}): they are Inf there. Cast them to float32 (rotary angles: "
                "compute the table in float32, cast its cos/sin after)."
            )
        if base in _CASTS and peak is not None and peak > limit:
            # (A value the source dtype holds and the target cannot: -3.4e38, float32's
            # finfo.min in an additive mask, is -inf in bfloat16 and float16.)
            extreme = (
                " (torch.finfo(torch.float32).min or max: a mask fill value?)"
                if peak >= DTYPE_MAX["torch.float32"] * 0.999
                else ""
            )
            if extreme:
                masked = (
                    " and NaN on a row where every position is masked" if ctx.kind == "nan" else ""
                )
                return (
                    f"{op.name} cast values reaching {peak:.4g}{extreme}"
                    f" to {short}, which cannot hold them (max {limit:.6g}): they are Inf there"
                    f"{masked}. Build the mask in the target dtype (torch.finfo(scores.dtype)"
                    ".min), or fill after the cast."
                )
            return (
                f"{op.name} cast values reaching {peak:.4g} to {short}, which cannot hold them "
                f"(max {limit:.6g}): they are Inf there. Keep this part in float32 (or "
                "bfloat16), or scale the activations down before the cast."
            )
        constant = scalar_arg(op)
        if constant is not None and abs(constant) > limit:
            # (A Python number past the dtype's range: -1e9 in a mask is -inf in float16.)
            return (
                f"{op.name} multiplied or added the constant {constant:g}, which {short} cannot "
                f"hold (max {limit:.6g}): it is {'-' if constant < 0 else '+'}inf there. Use a "
                "constant the dtype holds: torch.finfo(x.dtype).min, or -1e4 in float16."
            )
        what = f"{op.name}, with operands reaching {peak:.4g}," if peak is not None else op.name
        if (
            constant is not None
            and peak is not None
            and base in _PRODUCTS
            and abs(constant) * peak >= limit * _LARGE_FRACTION
        ):
            # (x * (scale / sqrt(d)) with a scale far too large: the constant did it.)
            return (
                f"{op.name}, {peak:.4g} times the constant {constant:g} (a scale or "
                f"temperature), overflowed {short} (max {limit:.6g}) to Inf"
                f"{' then NaN' if ctx.kind == 'nan' else ''}. Lower or clamp that factor (CLIP "
                "clamps its logit scale at 100), or compute this in bfloat16 or float32."
            )
    then = " then NaN (inf - inf, 0 * inf)" if ctx.kind == "nan" else ""
    if dtype == "torch.float16" and op is not None and op.node in _NORM_BACKWARDS:
        # (rsqrt's derivative -0.5 * x ** -1.5 is huge where the variance is near 0: scaling
        # the activations down makes it larger)
        return (
            f"In the backward of {op.node}, {what} overflowed {short} (max {limit:.6g}) to "
            f"Inf{then}: the derivative of rsqrt/sqrt grows as the variance goes to 0 (a padded "
            "row, an all-zero embedding). Compute the norm in float32 (x.float()), or raise its "
            "eps (1e-5 and above holds in float16); scaling the activations down makes it worse."
        )
    if dtype == "torch.float16":
        if op is not None and _base(op.name) in ("bmm", "baddbmm", "matmul"):
            # A batched product in a module's own code: attention scores, q @ k.T.
            if _scaled_before(op):  # (timm's q = q * self.scale the line before)
                return (
                    f"{what} overflowed {short} (max {limit:.6g}) to Inf{then}. Attention "
                    "scores, scaled already? Their logits grew with the q/k weights: normalise "
                    "q and k per head (QK-norm, timm's qk_norm=True), or use "
                    "F.scaled_dot_product_attention, bfloat16 or float32 here."
                )
            return (
                f"{what} overflowed {short} (max {limit:.6g}) to Inf{then}. Attention scores? "
                "Scale q by 1/sqrt(head_dim) before q @ k.T or use "
                "F.scaled_dot_product_attention; else use bfloat16 or float32 here."
            )
        keep = (
            "compute this in float32 (x.float(), cast back after: the weights are float16 "
            "themselves, so no autocast is there to turn off)"
            if ctx.half_weights
            else "keep this layer in float32 (autocast(enabled=False))"
        )
        return (
            f"{what} overflowed {short}, which cannot hold values above {limit:.6g}, to Inf{then}. "
            f"Use bfloat16, {keep}, or scale its activations or weights down."
        )
    if (
        ctx.input_peak is not None
        and ctx.input_peak >= HUGE_OUTPUTS
        and peak is not None
        and peak >= ctx.input_peak * _REACHED  # (a masked 1e38 sentinel did not reach it)
    ):
        first, previous = ctx.first_input_peak, ctx.previous_input_peak
        if (
            ctx.forward > 2
            and first is not None
            and previous is not None
            and first * 1e6 < ctx.input_peak
            and previous > first * 1e3  # (it had grown already: a chain, not an outlier)
        ):
            return (
                f"{what} overflowed {short} to Inf{then}, given inputs up to "
                f"{ctx.input_peak:.1e} in forward {ctx.forward} of the step, where the first "
                f"forward's were at most {first:.3g}: a loop feeding the model its own results "
                "diverged (a Langevin/SGLD sampler's step size, an energy unbounded below). "
                "Clamp the iterate each step, or lower the step size."
            )
        return (
            f"{what} overflowed {short} (above {limit:.4g}) to Inf{then}, and the input batch "
            f"holds values up to {ctx.input_peak:.1e}: an unscaled feature or a sentinel value "
            "for missing data. Normalise the inputs (or log-transform that column)."
        )
    spike = _spike_when(ctx)
    if spike is not None:
        return (
            f"{what} overflowed {short} (above {limit:.4g}) to Inf{then}: the weights are "
            f"exploding since the gradient-norm spike {spike}. Lower the learning rate (of "
            "every parameter group), add warm-up, clip gradients."
        )
    if (
        ctx.call is not None
        and ctx.call[1] >= 8
        and ctx.weight_peak is not None
        and ctx.weight_peak < _MODEST_WEIGHTS
        and ctx.learning_rate is None  # (a rate out of proportion explains it: said first)
    ):
        # (A state grown over many calls of one module, with weights of usual size: an
        # integrator's step too large for its dynamics, not an update.)
        return (
            f"{what} overflowed {short} to Inf{then} at `{ctx.call[0]}#{ctx.call[1]}`, after "
            f"{ctx.call[1]} earlier calls of it in one forward, with weights of at most "
            f"{ctx.weight_peak:.3g}: a state grown over a recurrence or an ODE solver's steps "
            "(a step too large for the dynamics: dt from the data's time gaps). Use smaller "
            "or adaptive steps, rescale time, or clamp the state."
        )
    if ctx.updates == 0:  # (no optimizer step since attach: no learning rate moved them)
        return (
            f"{what} overflowed {short} (above {limit:.4g}) to Inf{then}, and no optimizer step "
            "has moved the watched weights since watch() began. Unless something else updates "
            "them (by hand, master weights copied in), activations are exploding in the model's "
            "own computation: a product or recurrence whose factor exceeds 1 (a state-space "
            "decay exp(dt * A) needs A < 0), a sum over a long axis left unnormalised, a missing "
            "scale, weights loaded that large."
        )
    # bfloat16 has float32's range: a wider dtype would overflow too.
    return (
        f"{what} overflowed {short} (above {limit:.4g}) to Inf{then}: activations or weights "
        "are exploding. Lower the learning rate, clip gradients, or normalise the activations."
    )


def _amp(ctx: HintContext) -> str | None:
    if not ctx.amp_collapsed:
        return None
    return (
        "GradScaler's scale collapsed: the model makes Inf/NaN at any scale, so this is not an "
        "overflow that loss scaling fixes. Switch to bfloat16 autocast or keep the offending "
        "layers in float32."
    )


def _spike_when(ctx: HintContext, window: int = _SPIKE_WINDOW) -> str | None:
    """``"at step 36, 4 steps earlier"`` for a recent gradient-norm spike, else ``None``."""
    alarm = ctx.grad_norm_alarm_step
    # (This step's own spike comes after its forward and loss: the same bad batch made
    # both. Only an update, phase "param", follows it.)
    earliest = 0 if ctx.phase == "param" else 1
    if alarm is None or not earliest <= ctx.step - alarm <= window:
        return None
    first = ctx.grad_norm_alarm_first
    if first is not None and first < alarm:  # an episode: where it began comes first
        gap = ctx.step - first
        return f"at step {first}, {gap} steps earlier (and again up to step {alarm})"
    gap = ctx.step - alarm
    return f"at step {alarm}, {gap} step{'s' if gap > 1 else ''} earlier" if gap else "at this step"


def _about_loss(ctx: HintContext) -> bool:
    return ctx.phase == "loss" or ctx.reason == "loss_backward"


def _spike(ctx: HintContext) -> str | None:
    ago = _spike_when(ctx)
    if ago is None or _about_loss(ctx):  # (the loss's own causes first: see hint())
        return None
    return (
        f"The gradient norm spiked {ago}: the training was exploding before it turned "
        f"{_word(ctx)}. Lower the learning rate (or add warm-up) and clip gradients "
        "(torch.nn.utils.clip_grad_norm_)."
    )


def _param(ctx: HintContext) -> str | None:
    if ctx.phase != "param":
        return None
    step = f"{ctx.optimizer}.step()" if ctx.optimizer else "optimizer.step()"
    stats = ctx.stats
    peak = (
        max(abs(stats.min), abs(stats.max))
        if stats is not None and stats.min is not None and stats.max is not None
        else None
    )
    if (
        (ctx.kind == "nan" or ctx.learning_rate is None)  # (an Inf needs a huge rate)
        and ctx.optimizer in _PLAIN_OPTIMIZERS  # (another's own step may divide: Adan's)
        and ctx.grad_norm_alarm_step is None
        and peak is not None
        and peak < _MODEST_WEIGHT
    ):
        # w - lr * (g + wd * w) with everything finite is NaN only past an overflow, which
        # weights this small and gradients that never exploded do not reach.
        return (
            f"{step} cannot make {_word(ctx)} from finite gradients and weights this small "
            f"(the rest are within +-{peak:.3g}): code that writes the weights after the "
            "step likely did (a renormalisation w / w.norm() at a zero row, a projection, copy_ or "
            "load_state_dict). Look at what touches them before the next forward."
        )
    return (
        f"The parameter became {_word(ctx)} in {step} although its gradient was finite: a "
        "learning rate so large that the update overflows (or weight decay on a huge weight). "
        "Lower the learning rate."
    )


#: A divisor below this is a temperature annealed towards 0, not one chosen.
_TINY_DIVISOR: Final = 0.01
#: Optimizers whose update is w - lr * (g + wd * w) with momentum: no division.
_PLAIN_OPTIMIZERS: Final = frozenset({"SGD", "ASGD"})
#: Weights below this (in magnitude) cannot overflow in a plain update with a finite gradient.
_MODEST_WEIGHT: Final = 1e18

#: Inputs this large are unnormalised data (standardised features are a few units).
_LARGE_INPUT: Final = 1e4

#: Probes of the model's outputs this large (a sum over the outputs, in float32) come from
#: weights that exploded, not from ordinary logits or regression targets.
HUGE_OUTPUTS: Final = 1e15
#: Where exp overflows in float32 (and bfloat16): exp(88.73) is past 3.4e38.
_EXP_OVERFLOW: Final = 88.7


def _loss(ctx: HintContext) -> str | None:
    if ctx.reason == "loss_backward" and not ctx.loss_checked:
        return (
            f"The loss was not checked, so this is either a non-finite loss (CTC with an input "
            "shorter than its target: zero_infinity=True; log of 0; a mean over zero elements) "
            f"or a backward that made {_word(ctx)} from a finite loss (sqrt or norm of a zero "
            "distance, x ** p with p < 1 at 0, acos at +-1). guard.check_loss(loss) tells "
            "them apart."
        )
    slopes = loss_slopes(ctx) if ctx.reason == "loss_backward" else []
    if slopes:
        return (
            f"The loss's backward made {_word(ctx)} from a finite loss; its own operations "
            f"include {'; '.join(slopes)}."
        )
    if ctx.reason == "loss_backward" and ctx.kind == "inf" and _dtype(ctx) == "torch.float16":
        return (
            "The gradient sent back into the model's float16 outputs passed 65504, the most "
            "float16 holds: each output's gradient is d(loss)/d(output), large for a loss "
            "scaled up (a loss weight) or summed over many elements. Scale the loss down, or "
            "use GradScaler, or bfloat16."
        )
    if ctx.reason == "loss_backward":
        return (
            f"The loss's backward made {_word(ctx)} from a finite loss: an infinite derivative "
            "(sqrt or norm of a zero distance, acos at +-1, focal loss with gamma<1 at 0, "
            "kl_div at zero targets: add an eps) or an Inf/NaN that min/max/clamp/where hid, "
            "times 0 (PPO's ratio: clamp the log-ratio; atan(w/h) of an empty box)."
        )
    if ctx.phase != "loss":
        return None
    if ctx.output_peak is not None and any(
        math.isclose(ctx.output_peak, limit, rel_tol=1e-6) for limit in DTYPE_MAX.values()
    ):
        # Exactly a dtype's largest value: a fill (masked_fill(~legal, finfo.min)), no
        # explosion.
        return (
            f"The model's outputs hold {ctx.output_peak:.4g}, a dtype's largest value: a mask "
            "filled with torch.finfo(dtype).min. A loss over every class (cross_entropy with "
            "label_smoothing, a KL to a uniform) sums them past the float range. Mask with "
            "-1e4 instead, or leave the masked classes out of that term."
        )
    if (
        ctx.output_peak is not None
        and ctx.output_peak >= HUGE_OUTPUTS
        and ctx.input_peak is not None
        and ctx.input_peak >= HUGE_OUTPUTS
    ):
        return (
            f"The model's outputs were huge though finite (about {ctx.output_peak:.1e}), and so "
            f"was its input batch (values up to {ctx.input_peak:.1e}): the loss made "
            f"{_word(ctx)} of them. Look at the data: a sentinel value (1e38, FLT_MAX) for a "
            "missing feature, an unnormalised column, a corrupt sample."
        )
    if ctx.output_peak is not None and ctx.output_peak >= HUGE_OUTPUTS and ctx.updates == 0:
        seen = (
            f" (values up to {ctx.input_peak:.1e}: an unnormalised column?)"
            if ctx.input_peak is not None
            else " (an unnormalised column)"
        )
        return (
            f"The model's outputs were huge though finite (about {ctx.output_peak:.1e}) before "
            "any optimizer step since watch() began, and "
            f"the loss made {_word(ctx)} of them. Look at the input batch's scale{seen}, at "
            "outputs that go through exp() in the loss (logvar.exp() "
            "in a KL term, a scale parameterised by exp), at the weights it started from (a "
            "checkpoint), and at updates written by hand (MAML's inner loop: fast weights "
            "w - lr * g run with functional_call, its lr too high): normalise the inputs, clamp "
            "the log-scale (logvar.clamp(-30, 20)), or initialise the last layer smaller."
        )
    if (
        ctx.output_peak is not None
        and ctx.output_peak >= HUGE_OUTPUTS
        and ctx.weight_peak is not None
        and ctx.weight_peak < _MODEST_WEIGHTS
    ):
        batch = (
            f" or a batch outlier (values up to {ctx.input_peak:.3g})"
            if ctx.input_peak is not None
            else " or a batch outlier"
        )
        return (
            f"The model's outputs reached {ctx.output_peak:.1e} with weights of at most "
            f"{ctx.weight_peak:.3g}, not exploding: the model amplified them (an exp of a "
            f"scale, a recurrence over many steps){batch}, and the loss made {_word(ctx)}. "
            "Clamp a log-scale before exp; clip or normalise a long recurrence."
        )
    if ctx.output_peak is not None and ctx.output_peak >= HUGE_OUTPUTS:
        return (
            f"The model's outputs were huge though finite (about {ctx.output_peak:.1e}) and the "
            f"loss made {_word(ctx)} of them: the weights are exploding (a learning rate far "
            "too high: look at the last optimizer.step()). Lower the learning rate or add "
            "warm-up, and clip gradients."
            + (
                f" The batch holds values up to {ctx.input_peak:.1e}: an unnormalised column "
                "makes the first gradients huge; standardise the inputs."
                if ctx.input_peak is not None and ctx.input_peak >= _LARGE_INPUT
                else ""
            )
        )
    if ctx.dtype == "torch.float16":
        return (
            f"The loss is float16 and {_word(ctx)} from finite outputs: an overflow past 65504 "
            "(exp(logits / T), a sum of squares) is the likeliest. Compute the loss in float32 "
            "(logits.float()); else look for 0/0, log of 0, NaN targets."
        )
    small = ctx.output_peak is not None and ctx.output_peak < 5.0  # (no sigmoid rounds to 1)
    # An exp in the loss of outputs past 88 overflows in float32 too (bfloat16 has its range):
    # no precision is the cause, the hand-written softmax is (a CLIP logit scale of 100).
    overflows = (
        ctx.output_peak is not None
        and ctx.output_peak >= _EXP_OVERFLOW
        and bool({"LogBackward0:of_exps", "ExpBackward0"} & set(ctx.loss_ops))
    )
    # (cross_entropy on logits, NaN from finite outputs: every target ignored, whatever the
    # dtype; no probability rounded to 0 there)
    logits_ce = bool({"NllLossBackward0", "NllLoss2DBackward0"} & set(ctx.loss_ops)) and (
        "LogSoftmaxBackward0" in ctx.loss_ops
    )
    if (
        ctx.output_dtype in _HALF
        and not (small and ctx.output_dtype == "torch.bfloat16")
        and not (overflows and ctx.output_dtype == "torch.bfloat16")
        and not (logits_ce and ctx.kind == "nan")
    ):
        name = ctx.output_dtype.removeprefix("torch.")
        rounds = "about 6" if name == "bfloat16" else "about 8"
        overflow = (
            "an exp or a product computed in float16 before the loss reached float32 "
            "overflows past 65504 (exp(sim / T) with T = 0.07 does from a similarity of 0.78; "
            "Inf / Inf is NaN), or "
            if name == "float16"
            else ""
        )
        # (A box loss divides by sizes made of them: YOLO's (2 * sigmoid(t)) ** 2 is 0.)
        zero = " or 0/0 (w / h of a box)" if "DivBackward0" in ctx.loss_ops else ""
        return (
            f"The loss is {_word(ctx)} from finite {name} model outputs: {overflow}sigmoid/"
            f"softmax round to exactly 0 or 1 there (from a logit of {rounds}), so a loss on "
            f"probabilities meets log(0){zero}. Compute the loss in float32 (logits.float()) or "
            "from logits (log_softmax, BCE with logits). Else: NaN targets, a mean over nothing."
        )
    own = _loss_own_ops(ctx)
    if own:
        ops = "; ".join(own)
        # (Inputs without gradient too, when there is room: PPO's advantages normalised by
        # a std over a minibatch of one sample, which no autograd node of the loss shows.)
        inputs = " or other inputs without gradient (a std over one sample),"
        if len(ops) > _MAX_HINT - 150 or ctx.kind != "nan":
            inputs = ","
        return (
            f"The loss is {_word(ctx)} from finite outputs: {_word(ctx)} in the targets"
            f"{inputs} or one of its own operations: {ops}."
        )
    if ctx.kind == "nan":
        return (
            "The loss is NaN from finite model outputs: NaN in the targets or loss weights, a "
            "mean over nothing (0/0), log/sqrt of a negative, 0 * log(0) in an entropy "
            "(torch.special.xlogy), exp overflow (logsumexp), a scale of 0, a std over one value."
        )
    return (
        f"The loss is {_word(ctx)} from finite model outputs: {_word(ctx)} in the targets "
        "(log(w / anchor_w) of a zero-width box), a division by zero (MAPE, zero "
        "targets), log(0) (use log_softmax), a scale near 0, an exp overflow (logvar.exp(), "
        "SAC's log_alpha.exp(): clamp), or CTC on too short an input (zero_infinity=True)."
    )


_INFINITE_WEIGHT: Final = (
    "BCE with logits given an infinite pos_weight or weight (a label with no positive "
    "example: (N - n_pos) / n_pos at n_pos = 0): clamp the counts"
)
#: The loss's own operations that make NaN/Inf from finite values, by autograd node, in the
#: order they are named: what each does wrong and the fix, for NaN and for Inf (None: it
#: does not make that one).
_LOSS_OPS: Final[tuple[tuple[tuple[str, ...], str | None, str | None], ...]] = (
    (
        # (PPO's clipped surrogate on r = exp(logp - old_logp))
        ("ExpBackward0:ratio",),
        "a ratio exp(logp - old_logp) past 88 (old log-probs padded with -1e4), then inf * 0 "
        "under a mask: clamp the log-ratio (+-20) before exp",
        "a probability ratio exp(logp - old_logp) past 88 (an old log-prob stale, or padded "
        "with -1e4): clamp the log-ratio (to +-20) before the exp",
    ),
    (
        # (not a node: the model's outputs had no sample at all)
        ("EmptyBatch",),
        "a mean over an empty batch (the model's outputs hold 0 samples): 0/0. Skip empty "
        "batches (a filter that kept no sample, a last batch of 0)",
        None,
    ),
    (
        # (a std or var over dim 0 of a batch of one, unbiased: VICReg's variance term on
        # an epoch's last, partial batch)
        ("VarBackward0:one_sample", "StdBackward0:one_sample"),
        "std/var over a batch of one sample (unbiased, over dim 0): 0/0. The last, partial "
        "batch of an epoch (drop_last=True in the DataLoader), or a batch filtered down to "
        "one: skip batches of one, or use correction=0 (and an eps where it divides)",
        None,
    ),
    (
        # (a supervised contrastive loss's mean over each anchor's positives)
        ("DivBackward0:of_logs",),
        "a mean of log-probabilities over a count that is 0, (mask * log_prob).sum(1) / "
        "mask.sum(1) for an anchor with no positive (SupCon): 0/0. Divide by "
        "count.clamp_min(1), or drop those rows",
        "a sum of log-probabilities divided by a count that is 0 (an anchor with no "
        "positive): divide by count.clamp_min(1), or drop those rows",
    ),
    (
        # (log-cosh regression: cosh(r) is Inf for |r| > 89 in float32)
        ("CoshBackward0", "SinhBackward0"),
        "cosh/sinh overflow to Inf above 89 (log(cosh(r)) of a residual that large: unscaled "
        "targets), then inf - inf: use r + softplus(-2r) - log(2), or scale the targets",
        "cosh/sinh overflow to Inf above 89 (log(cosh(r)) of a residual that large: unscaled "
        "targets): use r + softplus(-2r) - log(2), or scale the targets",
    ),
    (
        # (the log of a ratio or a sum of exps: InfoNCE / NT-Xent written by hand)
        ("LogBackward0:of_exps",),
        "a softmax or logsumexp written by hand, log(exp(s) / exp(s).sum()): exp overflows to "
        "Inf above 88 (cosine similarities over a temperature of 0.01 reach 100), then "
        "Inf / Inf is NaN: use F.cross_entropy on the logits, or torch.logsumexp",
        "a softmax or logsumexp written by hand, log(exp(s) / exp(s).sum()): exp overflows to "
        "Inf above 88: use F.cross_entropy on the logits, or torch.logsumexp",
    ),
    (
        ("AcosBackward0", "AsinBackward0"),
        "acos/asin: NaN past +-1 (a dot product of unit vectors rounding to 1.0000001): clamp "
        "to +-(1 - 1e-7)",
        None,
    ),
    (
        # (CIoU's aspect term atan(w / h): a zero-size box, in the targets too, is 0/0)
        ("AtanBackward0",),
        "atan of a ratio w / h of box sides that are 0 (CIoU's aspect term; a zero-size label "
        "from cropping makes the target's 0/0 too): add an eps to h, drop degenerate boxes",
        None,
    ),
    (
        ("MeanBackward0:of_selection",),
        "a mean over an empty selection (x[mask].mean(): a Dice over the images with "
        "foreground, on an all-background batch): guard with mask.any()",
        None,
    ),
    (
        ("LogBackward0", "Log2Backward0", "Log10Backward0"),
        "log: NaN below 0, -Inf at 0, then inf - inf or 0 * -inf (a mask): clamp it, or "
        "index the valid entries",
        "log(0) (use log_softmax or logsigmoid, or clamp the input)",
    ),
    (("CtcLossBackward0",), None, "CTC on an input shorter than its target (zero_infinity=True)"),
    (
        # (a cosine similarity by hand, a @ b.T / (|a| |b|): a zero embedding is 0/0)
        ("DivBackward0:by_norm",),
        "a division by a norm, 0/0 for a zero vector (an all-padding text pooled to 0, a "
        "blank input): use F.normalize or F.cosine_similarity, or clamp the norm "
        "(norm.clamp_min(1e-8))",
        "a division by a norm that is 0 (a zero vector: an all-padding text pooled to 0): "
        "use F.normalize, or clamp the norm (norm.clamp_min(1e-8))",
    ),
    (
        # (its gradient into the model NaN too: an Inf class weight, inf / inf)
        ("NllLossBackward0:bad_weight",),
        "cross_entropy / nll_loss with a class weight of Inf or NaN (1 / count for a class "
        "absent from the batches it was counted on), inf / inf: use 1 / (count + 1) or clamp "
        "the weights",
        "cross_entropy / nll_loss with a class weight of Inf (1 / count for a class absent "
        "from the batches it was counted on): use 1 / (count + 1) or clamp the weights",
    ),
    (
        # (NaN from finite log-probabilities only when the weights of the targets sum to 0)
        ("NllLossBackward0", "NllLoss2DBackward0"),
        "cross_entropy / nll_loss over a batch whose every target equals ignore_index (or "
        "has class weight 0, a fully padded batch): the mean is 0/0. Skip such batches, or "
        "use reduction='sum' divided by max(count, 1)",
        None,
    ),
    (
        # (a tensor by a tensor: x.sum(-1) / mask.sum(-1), before the difference a DPO loss
        # takes of such averages)
        ("DivBackward0", "ReciprocalBackward0"),
        "a division, 0/0 over an empty mask or count (sum / mask.sum() with nothing "
        "selected): divide by count.clamp_min(1); or 0/0 of a ratio (sMAPE's |p - y| / "
        "(|p| + |y|) where both are 0): clamp the denominator, (|p| + |y|).clamp_min(1e-8)",
        "a division by zero (MAPE over zero targets; a predicted scale near 0 in a "
        "likelihood: floor it, softplus(s) + 1e-4)",
    ),
    (
        # (kl_div with log_target=True: exp(t) * (t - s), no node of its own.)
        ("MulBackward0:of_difference",),
        "0 * -inf: a KL divergence or cross-entropy against target log-probabilities that "
        "hold -inf (a teacher's masked or padded vocabulary, log_target=True): mask with "
        "torch.finfo(dtype).min, or drop those entries",
        None,
    ),
    (
        # (-(y * log(p) + (1 - y) * log(1 - p)) on p = sigmoid(logits))
        ("LogBackward0:of_sigmoid",),
        "a binary cross-entropy written by hand on sigmoid outputs: a saturated sigmoid is "
        "exactly 0 or 1 in float32, log(0) = -inf, and 0 * -inf is NaN: use "
        "F.binary_cross_entropy_with_logits on the logits (or F.logsigmoid)",
        "the log of a sigmoid output that saturated to 0 (a binary cross-entropy by hand): "
        "use F.binary_cross_entropy_with_logits on the logits (or F.logsigmoid)",
    ),
    (
        ("ExpBackward0",),
        "exp, Inf above 88, then inf - inf or inf / inf: use logsumexp",
        "an exp overflow, above 88 (logvar.exp() in a KL term: clamp logvar; use logsumexp)",
    ),
    (
        # (a network after the watched model, frozen: a VAE decoder, a perceptual loss's)
        ("FrozenLayer",),
        "a frozen network's layer after the model's outputs, run in another dtype (a "
        "convolution or norm without trainable weights: a float16 VAE decoder overflowing "
        "past 65504): watch that network too (a second guard) or run it in float32",
        "a frozen network's layer after the model's outputs, run in another dtype (a "
        "convolution or norm without trainable weights: a float16 VAE decoder overflowing "
        "past 65504): watch that network too (a second guard) or run it in float32",
    ),
    (("SqrtBackward0",), "sqrt, NaN below 0: clamp to a small positive value", None),
    (("RsqrtBackward0",), "rsqrt, NaN below 0: add an eps", "rsqrt of 0: add an eps"),
    (
        ("PowBackward0", "PowBackward0:fractional"),
        "a fractional power of a negative value: clamp the base",
        None,
    ),
    (("StdBackward0", "VarBackward0"), "std/var, NaN over one element", None),
    (("AtanhBackward0",), "atanh, NaN past +-1: clamp", "atanh at +-1: clamp"),
    (
        ("XlogyBackward0",),
        "xlogy: NaN below 0, or at 0 where +Inf and -Inf terms meet (a Beta/Dirichlet "
        "log_prob of exactly 0 or 1, or outside its support: clamp to [eps, 1 - eps])",
        "a log-density at the edge of its support (a Beta/Dirichlet log_prob of exactly 0 or "
        "1: clamp actions to [eps, 1 - eps])",
    ),
    (("BinaryCrossEntropyWithLogitsBackward0",), _INFINITE_WEIGHT, _INFINITE_WEIGHT),
)


#: The loss's own operations whose derivative is infinite somewhere (or that hide a
#: non-finite value from the forward, not from the backward), by autograd node.
_LOSS_SLOPES: Final[tuple[tuple[tuple[str, ...], str], ...]] = (
    (("SqrtBackward0",), "sqrt, whose slope is Inf at 0 (a zero distance): sqrt(x + 1e-12)"),
    (
        ("HypotBackward0",),
        "hypot, whose slope x / hypot(x, y) is 0/0 at (0, 0) (an STFT magnitude of silence "
        "or zero padding): sqrt(re**2 + im**2 + 1e-7)",
    ),
    (
        ("AcosBackward0", "AsinBackward0"),
        "acos/asin, whose slope is Inf at +-1: clamp to +-(1 - 1e-7), not +-1 (clamp passes "
        "the gradient at its bounds)",
    ),
    (
        ("PowBackward0", "PowBackward1"),
        "x ** p, whose slope is Inf at 0 for p < 1 (a focal loss's (1 - p) ** gamma): add an eps",
    ),
    (("KlDivBackward0",), "kl_div, Inf at zero targets' log: use log_target or an eps"),
    (
        ("LgammaBackward0", "DigammaBackward0"),
        "lgamma, whose slope digamma(x) is about -1/x near 0 (a Dirichlet, Beta or Gamma "
        "concentration collapsing to 0): floor it, softplus(h) + 1e-4",
    ),
    # (Common healthy terms of a loss: after the slopes that are more often the cause.)
    (
        ("LinalgSvdBackward0", "LinalgEighBackward0", "LinalgEigBackward0"),
        "an SVD or eigendecomposition, whose slope divides by differences of the values: Inf "
        "where two are equal (Procrustes alignment of a collapsed, all-equal prediction): add "
        "a tiny perturbation, or leave degenerate samples out",
    ),
    (
        ("XlogyBackward0", "SpecialEntrBackward0"),
        "an entropy by xlogy(p, p) or entr(p), finite at p = 0 where its slope is not (0/0, "
        "-log 0: a softmax probability that underflowed to 0): take it from log_softmax, "
        "-(p * logits.log_softmax(-1)).sum(-1)",
    ),
    # (min/max/clamp/where are in most losses, healthy: after the specific slopes.)
    (
        (
            "WhereBackward0",
            "ClampBackward1",
            "MaximumBackward0",
            "MinimumBackward0",
            "MaskedFillBackward0",
            "IndexPutBackward0",
            "IndexFillBackward0",
            "NanToNumBackward0",
        ),
        "an Inf/NaN that min/max/clamp/where, masked_fill or nan_to_num hid (atan(w/h) of an "
        "empty box, PPO's exp ratio, a 0/0 filled afterwards): its slope, times 0, comes back "
        "NaN; make it finite before it is hidden",
    ),
    (("LogBackward0",), "log, whose slope 1/x is Inf at 0: clamp the input"),
    (("DivBackward0",), "a division, whose slope x / d**2 overflows near d = 0: add an eps"),
    # (in most contrastive losses, healthy: last)
    (
        ("LogsumexpBackward0",),
        "logsumexp, whose slope exp(x - lse) is NaN over a slice entirely -inf (log(0) as the "
        "start of a hand-written CTC or HMM forward recursion): use torch.finfo(dtype).min",
    ),
)


def loss_slopes(ctx: HintContext) -> list[str]:
    """The loss's own operations that can have made its backward non-finite (two at most)."""
    if not ctx.loss_ops:
        return []
    ran = set(ctx.loss_ops)
    texts = []
    # (an elementwise loss by hand: (p - y) ** 2, (p - y).abs())
    by_hand = "SubBackward0" in ran and bool(ran & {"PowBackward0:integer", "AbsBackward0"})
    if (ran & _ELEMENTWISE_LOSSES or by_hand) and ran & {"IndexBackward0", "MaskedSelectBackward0"}:
        texts.append(
            "an elementwise loss selected after it was computed (loss[valid].mean()): targets "
            "holding NaN at the dropped entries (missing labels) make its backward 0 * NaN. "
            "Select before the loss (pred[valid], y[valid])"
        )
    if "CtcLossBackward0" in ran:
        texts.append(
            "CTC, whose backward is NaN where the log-probabilities are -inf (a vocabulary "
            "masked with -inf before log_softmax): mask with torch.finfo(dtype).min"
        )
    return (texts + [text for nodes, text in _LOSS_SLOPES if ran & set(nodes)])[:2]


#: Losses computed element by element (reduction="none" keeps one value per element).
_ELEMENTWISE_LOSSES: Final = frozenset(
    {
        "MseLossBackward0",
        "L1LossBackward0",
        "SmoothL1LossBackward0",
        "HuberLossBackward0",
        "BinaryCrossEntropyBackward0",
        "BinaryCrossEntropyWithLogitsBackward0",
    }
)


#: Autograd nodes of a mean: reductions and the losses that average (reduction="mean").
_MEAN_NODES: Final = frozenset(
    {
        "MeanBackward0",
        "MeanBackward1",
        "SmoothL1LossBackward0",
        "HuberLossBackward0",
        "L1LossBackward0",
        "MseLossBackward0",
        "BinaryCrossEntropyBackward0",
    }
)


def _loss_own_ops(ctx: HintContext) -> list[str]:
    """What the loss's own operations can have done (two at most), most telling first."""
    if not ctx.loss_ops:
        return []
    ran = set(ctx.loss_ops)
    if "IndexBackward0" in ran and ran & _MEAN_NODES:  # x[mask].mean(), l1(p[pos], t[pos])
        ran.add("MeanBackward0:of_selection")
    if {"MulBackward0", "SubBackward0", "LogSoftmaxBackward0"} <= ran and "ExpBackward0" not in ran:
        # exp(t) * (t - log_softmax(s)): kl_div against log-probability targets
        ran.add("MulBackward0:of_difference")
    if "LogBackward0:of_sigmoid" in ran:  # (its text says what the plain log's would)
        ran.discard("LogBackward0")
    if "ExpBackward0:ratio" in ran:  # (its text says what the plain exp's would)
        ran.discard("ExpBackward0")
    if "NllLossBackward0:bad_weight" in ran:  # (not a batch of ignored targets)
        ran -= {"NllLossBackward0", "NllLoss2DBackward0"}
    if ran & {"CoshBackward0", "SinhBackward0"}:
        ran -= {"LogBackward0", "LogBackward0:of_exps"}  # (log-cosh: the log of an Inf cosh)
    found = [(nodes, nan if ctx.kind == "nan" else inf) for nodes, nan, inf in _LOSS_OPS]
    texts = [t for nodes, t in found if t is not None and ran & set(nodes)]
    if "EmptyBatch" in ran and texts:  # (0/0 whatever else the loss ran)
        return texts[:1]
    if ctx.kind == "inf" and {"ExpBackward0", "LogBackward0:of_sigmoid"} <= ran:
        # (+Inf: an exp's overflow as likely as a saturated sigmoid's log; NaN needs the
        # sigmoid's 0 * -inf, or an exp's inf - inf, less direct: that order stays.)
        exp_inf = next(t for nodes, t in found if nodes == ("ExpBackward0",))
        if exp_inf is not None:
            texts = [exp_inf, *(t for t in texts if t != exp_inf)]
    exp = next(t for nodes, t in found if nodes == ("ExpBackward0",))
    if exp in texts[2:] and "exp" not in " ".join(texts[:2]):
        # (An exp's overflow, inf / inf, is NaN's likeliest cause beside a log and a division
        # that need a 0 or a negative value: lightning-bolts' NT-Xent at a temperature of 0.01.)
        return [texts[0], exp]
    return texts[:2]


#: Namespaces of torch's own operations (anything else is a custom op or an extension's).
_TORCH_OPS: Final = frozenset({"aten", "prims", "quantized", "_c10d_functional", "c10d"})


def _finite_inputs(op: OpInfo) -> bool:
    return not any(s is not None and s.nonfinite_count for s in op.inputs)


def _unknown(ctx: HintContext) -> str:
    word = _word(ctx)
    op = ctx.op
    if op is not None and op.direction == "backward":
        node = f" ({op.node})" if op.node else ""
        what = f"{op.name}{node} made {word} in the backward from finite gradients"
    elif op is not None and op.name.partition(".")[0] not in _TORCH_OPS:
        # (A torch.library custom op, or an extension's kernel: the replay sees it whole.)
        return (
            f"{op.name} is not one of torch's operations (a custom op, or an extension's "
            f"kernel): nanguard cannot look inside it. It made {word} from "
            f"{'finite inputs' if _finite_inputs(op) else 'its inputs'}: look at its "
            "implementation for a log, sqrt or division at 0, or an exp that overflows."
        )
    elif op is not None and any(s is not None and s.neginf_count for s in op.inputs):
        return (
            f"{op.name} made {word} from inputs holding -Inf (written as a mask, or the log of "
            "a 0: log(counts) instead of log1p): -inf * 0 or -inf + inf. Keep -inf masks for "
            "softmax only; elsewhere use a large finite value or log1p."
        )
    elif op is not None:
        what = f"{op.name} made {word} from finite inputs"
    else:
        where = f" ({ctx.module_type})" if ctx.module_type else ""
        what = f"{word} appeared in phase '{ctx.phase}'{where}, and no operation was named"
    return f"nanguard does not recognise this pattern: {what}."


def _times_inf(ctx: HintContext) -> str | None:
    """NaN from a product with an infinite factor where the other is 0: a mask built as
    (1 - mask) * float("-inf")."""
    op = ctx.op
    if op is None or ctx.kind != "nan" or op.direction != "forward" or _base(op.name) != "mul":
        return None
    constant = scalar_arg(op)
    stats = [s for s in op.inputs if s is not None]
    infinite = (constant is not None and math.isinf(constant)) or any(
        s.posinf_count + s.neginf_count for s in stats
    )
    # (a 0 in a factor other than one that is all Inf)
    zero = any(_has_zero(s) for s in stats if s.posinf_count + s.neginf_count < s.numel)
    if not infinite or not zero:
        return None
    return (
        f"{op.name} multiplied an infinite value by 0, which is NaN: a mask built as (1 - "
        'mask) * float("-inf")? Fill instead, scores.masked_fill(mask == 0, float("-inf")), '
        "or multiply by torch.finfo(dtype).min."
    )


#: The rules, most specific evidence first.
_RULES: Final[tuple[Callable[[HintContext], str | None], ...]] = (
    _before_training,
    _outside_optimizer,
    _input_data,
    _corrupt_weights,
    _stale_outside,
    _collapsed_scale,
    _unchecked_grads,
    _adam_half,
    _adaptive_eps,
    _optimizer_state,
    _masked_row,
    _reads_a_mask,
    _nan_number,
    _variance,
    _zero_eps,
    _backward,
    _times_inf,
    _logdet,
    _domain,
    _overflow,
    _attention,
    _amp,
    _spike,
    _param,
    _loss,
)


def hint(ctx: HintContext) -> str:
    """The most likely cause of an origin and what to try, in one or two sentences.

    Rules are tried from the most specific evidence (the data, the weights, the exact
    operation a replay found) to circumstantial evidence (GradScaler, a gradient-norm
    spike, the phase); when none applies, the hint says plainly that the pattern is not
    recognised.

    Args:
        ctx: what nanguard learned about the origin.

    Returns:
        A short, non-empty hint.

    Example:
        >>> from nanguard._hints import HintContext, OpInfo, hint
        >>> op = OpInfo(name="aten.sqrt.default", inputs=(None,), output=None)
        >>> print(hint(HintContext(phase="forward", kind="nan", reason="output", op=op)))
        aten.sqrt.default took the sqrt of a negative value, which is NaN (...). Clamp it to a ...
    """
    text = next((t for rule in _RULES if (t := rule(ctx))), None) or _unknown(ctx)
    if ctx.learning_rate is not None and ctx.phase == "loss":
        # (A group's rate out of line with the rest, named beside a loss that overflowed.)
        text = f"{text} Also: {ctx.learning_rate[:1].lower()}{ctx.learning_rate[1:]}"
    elif ctx.learning_rate is not None and ctx.phase in ("forward", "backward", "grad", "param"):
        op = ctx.op
        if (
            op is not None
            and op.direction == "forward"
            and _base(op.name) in _DOMAIN_OPS
            and math.isfinite(_rate_of(ctx.learning_rate))
        ):
            # (A log or division at 0 is the data's or the code's doing before a learning
            # rate's: an outlier batch's softmax underflow. The rate is said after it.)
            text = f"{text} Also: {ctx.learning_rate[:1].lower()}{ctx.learning_rate[1:]}"
        else:
            # A weight moved too far by its updates is the cause behind what the operation did.
            what = "the optimizer" if ctx.phase == "param" else "the operation"
            text = f"{ctx.learning_rate} What {what} did: {text}"
    # (Beside a loss's own cause, only a spike just before it: one 30 steps back was the
    # loss leaving a plateau, not a run diverging into this.)
    ago = _spike_when(ctx, _SPIKE_BESIDE_LOSS)
    if ago is not None and _about_loss(ctx) and "spike" not in text:
        text += f" The gradient norm also spiked {ago}."
    in_backward = ctx.phase == "backward" or ctx.reason == "loss_backward"
    if (
        in_backward
        and ctx.dtype == "torch.float16"
        and not ctx.scaler_known
        # (not beside a derivative infinite at its domain's edge: no scale makes that)
        and (ctx.op is None or _overflowed_half(ctx, ctx.op) or not is_specific(text))
    ):
        # A loss scaled by a GradScaler the guard was not told about overflows on purpose.
        scaled = (
            "If the loss was scaled by a GradScaler, an overflow in the backward is expected "
            "(the scaler skips that step): pass it to nanguard.watch(..., scaler=scaler)."
        )
        text = f"{scaled} Otherwise: {text}" if ctx.kind == "inf" else f"{text} {scaled}"
    return text
