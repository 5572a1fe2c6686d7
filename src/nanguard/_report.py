"""Human-readable reports: what was found, where, and what to look at next.

Rendering is kept apart from the data (``Event``) and from the analysis, so each
message can be tested exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from nanguard._events import Event, TensorStats
from nanguard._hints import OpInfo, custom_backward_name, is_attention, is_specific
from nanguard._monitor import GradNormAlarm

__all__ = [
    "Origin",
    "amp_collapse_message",
    "amp_skip_message",
    "backward_message",
    "grad_message",
    "grad_norm_message",
    "kind_word",
    "origin_message",
    "overflow_message",
    "param_message",
    "propagated_message",
]

_ADVICE = {
    "nan": (
        "an operation outside its domain (log or sqrt of a negative number, 0/0, inf - inf, "
        "0 * inf), a softmax over a row that is entirely -inf (a fully masked attention row), "
        "or a variance over a single element"
    ),
    "+Inf": (
        "an overflow (exp of a large value, a float16 value above 65504, a product of large "
        "activations) or a division by zero"
    ),
    "-Inf": (
        "log of 0 (log of a relu or of a probability that underflowed to 0), an overflow of "
        "a large negative value, or a negative number divided by zero"
    ),
}
_ADVICE["Inf"] = f"{_ADVICE['+Inf']}; or {_ADVICE['-Inf']}"

#: Model outputs whose magnitude a loss-origin message gives (a loss of them overflows).
_HUGE_LOSS_INPUTS = 1e9


def _advice(kind: str, stats: TensorStats | None) -> str:
    return _ADVICE["nan"] if kind == "nan" else _ADVICE[kind_word(kind, stats)]


def kind_word(kind: str, stats: TensorStats | None = None) -> str:
    """``"NaN"``, ``"+Inf"``, ``"-Inf"`` or ``"Inf"``."""
    if kind == "nan":
        return "NaN"
    if stats is not None and stats.posinf_count and not stats.neginf_count:
        return "+Inf"
    if stats is not None and stats.neginf_count and not stats.posinf_count:
        return "-Inf"
    return "Inf"


def _label(name: str) -> str:
    """A module name in backticks, or the model itself (``""``; ``"#2"``: its call 2)."""
    if name.startswith("#"):
        return f"the model (call {name[1:]})"
    return f"`{name}`" if name else "the model"


def _call(call: int) -> str:
    return f", call {call}" if call else ""


@dataclasses.dataclass
class Origin:
    """Everything a message about one origin can say."""

    step: int
    reason: str  # "input" | "own_code" | "output" | "loss"
    kind: str
    module: str | None = None
    module_type: str | None = None
    call: int = 0
    tensor: str = ""
    stats: TensorStats | None = None
    shape: tuple[int, ...] = ()
    dtype: str = ""
    consumer: str | None = None
    inputs: Sequence[tuple[str, TensorStats]] = ()
    more_inputs: int = 0  # finite inputs not listed in ``inputs``
    mask_inputs: Sequence[str] = ()
    mask_args: Sequence[str] = ()  # its forward's parameters named like a mask
    received_neginf: Sequence[str] = ()  # own code: its inputs holding -Inf (not masks)
    masks_received: Sequence[str] = ()  # ...and those holding -Inf as masks (attn_mask=)
    no_tensor_inputs: bool = False  # its call was given no tensor the walk found
    integer_inputs: bool = False  # ...but integer or bool ones (token ids, masks)
    fast_path: str = ""  # the TransformerEncoderLayer whose fused kernel the step took
    compiled: bool = False  # not reproduced, and the step ran torch.compile'd code
    nonfinite_params: Sequence[str] = ()
    nonfinite_buffers_only: bool = False  # ...all of them buffers, none a parameter
    pre_hooks: Sequence[str] = ()  # the module's own forward pre-hooks (weight_norm...)
    builtin: bool = False  # a torch.nn module: its forward is torch's, not the user's
    # Plain tensor attributes of the module (not parameters, not buffers) already non-finite:
    # state an earlier call wrote (a running statistic kept under no_grad).
    stale_attributes: Sequence[str] = ()
    samples: Sequence[int] = ()  # input and forward origins: indices of the bad samples
    n_samples: int = 0  # ...how many there are (``samples`` lists the first few)
    sample_dim: int = 0  # ...along which dimension (1 for a time-major sequence batch)
    batch: int = 0  # ...and the size of that dimension
    columns: Sequence[int] = ()  # ...and, for a table (samples x features), which features
    # ...and for a PackedSequence (rows of steps of samples), the time steps they are at
    time_steps: Sequence[int] = ()
    # output origins fed a -Inf not as a mask: the call whose output it was, "`g` (Type)"
    inf_made_by: str | None = None
    # own_code origins: the module's submodules that nanguard does not hook (TorchScript,
    # excluded), (name, type): they ran as part of its code
    unhooked: Sequence[tuple[str, str]] = ()
    propagated: Sequence[str] = ()
    n_propagated: int = 0
    loss_propagated: bool = False
    stats_problem: str | None = None
    op: OpInfo | None = None
    hint: str | None = None
    reproducible: bool | None = None
    # Not made again by a replay that drew other numbers from a torch.Generator of the
    # user's own (its state at the step's start is not kept).
    own_generators: bool = False
    outputs_seen: bool = True  # a loss origin: a forward of the model was recorded
    transformed: bool = False  # ...and some of its forwards ran inside torch.func, unchecked
    output_peak: float | None = None  # a loss origin: how large the model's outputs were
    masked_outputs: bool = False  # ...whose outputs held -inf on purpose (masked logits)
    direct: bool = False  # an input origin of a submodule called on its own
    independent: bool = False  # a second origin of the same forward, from finite inputs
    direct_calls: Sequence[str] = ()  # a loss origin: submodules called without the model
    # a loss origin: shapes of trainable weights outside the watched model its code used
    outside_weights: Sequence[tuple[int, ...]] = ()
    # ...the statistics of those of them already non-finite (an earlier step broke them)
    stale_outside: Sequence[TensorStats] = ()
    # The call whose forward absorbed this Inf (saturating gates) and whose backward made
    # NaN of it (an origin found through its backward).
    absorbed_by: str | None = None


def _described(o: Origin) -> str:
    if o.stats is not None:
        return o.stats.summary()
    shape = "(" + ", ".join(str(d) for d in o.shape) + ")"
    text = f"{kind_word(o.kind)} values (shape {shape}, {o.dtype})"
    if o.kind == "nan" and o.dtype not in ("torch.float16", "torch.bfloat16"):
        # (Its probe, a sum, is NaN for +Inf beside -Inf too: x / 0 of signed values.)
        text = (
            "NaN values, or +Inf beside -Inf, which its probe (a sum) cannot tell apart "
            f"(shape {shape}, {o.dtype})"
        )
    if o.stats_problem:
        text += f"; exact statistics unavailable: {o.stats_problem}"
    return text


def _propagation(o: Origin) -> str:
    if o.absorbed_by is not None:
        return (
            f"It entered {_label(o.absorbed_by)}, whose forward absorbed it (its outputs stayed "
            "finite) and whose backward made NaN of it (0 * Inf in the gradients)."
        )
    if not o.n_propagated:
        loss = " but the loss" if o.loss_propagated else ""
        return f"It reached no other checked module{loss}."
    shown = ", ".join(_label(n) for n in o.propagated)
    more = o.n_propagated - len(o.propagated)
    tail = f" and {more} more" if more > 0 else ""
    loss = ", then the loss" if o.loss_propagated else ""
    calls = "call" if o.n_propagated == 1 else "calls"
    return f"It then reached {o.n_propagated} module {calls} ({shown}{tail}){loss}."


def _evidence(o: Origin) -> str:
    """The operation a replay pinned down, and whether the replay reproduced the value."""
    parts = []
    if o.op is not None:
        where = f" at {o.op.source}" if o.op.source else ""
        inside = f" (in {o.op.node}, a derivative taken in the forward)" if o.op.node else ""
        parts.append(f" It was made by `{o.op.name}`{inside}{where}.")
    if o.reproducible is False and o.fast_path:
        parts.append(
            " A replay of this step with exact checks saw only finite values: the step ran "
            f"{o.fast_path} in eval() under no_grad, on torch's fused inference kernel, which "
            "torch skips once modules are hooked (as in the replay)."
        )
    elif o.reproducible is False and o.compiled:
        parts.append(
            " A replay of this step with exact checks, run eagerly, saw only finite values: "
            "the step ran torch.compile'd code, which computes otherwise (see the hint)."
        )
    elif o.reproducible is False:
        parts.append(_unreproduced("values"))
    elif o.own_generators:
        parts.append(_OWN_GENERATORS)
    return "".join(parts)


_OWN_GENERATORS = (
    " A replay could not draw the same random numbers: the forward draws from a "
    "torch.Generator of its own (generator=...), whose state at the step's start nanguard "
    "does not keep (look at what those numbers feed: a log of a uniform draw that can be "
    "exactly 0, -log(-log(U)) without an eps)."
)


def _unreproduced(what: str) -> str:
    """The sentence for a value (or gradient) that an exact replay did not make again."""
    return (
        f" A replay of this step with exact checks saw only finite {what}: the forward ran "
        "with other weights than the module's own (torch.func.functional_call, fast "
        "weights), or with weights that changed before the step ended (SAM's first_step "
        "perturbs them, second_step puts them back), or drew random numbers in code compiled "
        "by inductor, whose random stream an eager replay does not follow (set "
        "torch._inductor.config.fallback_random = True), or took a fused inference kernel that "
        "torch skips once modules are hooked (TransformerEncoderLayer in eval() under "
        "no_grad: exclude it to keep that path), or read state that the step's forward itself "
        "updated (a hidden state carried on the module, self.h = h.detach(); a memory bank) "
        "or drew from Python's random or NumPy (LayerDrop), or a nondeterministic kernel, a "
        "data race or a hardware fault, not a numerical bug in the model's code."
    )


def _advise(o: Origin, look: str, generic: str) -> str:
    """``look`` ("Look at X.forward"), then the hint when there is one, else ``generic``."""
    if is_specific(o.hint):
        return f" {look}. Likely cause: {o.hint}"
    return f" {look}: {generic}."


def origin_message(o: Origin) -> str:
    """The paragraph for an origin event."""
    text = _origin_text(o)
    # A -Inf whose operation is unknown may be a mask nanguard could not recognise; one made
    # by log or an overflow is not (a fill with -inf is recognised and never reported).
    if (
        o.kind == "inf"
        and kind_word(o.kind, o.stats) != "+Inf"  # -Inf, or a sign not known
        and o.reason in ("input", "output", "own_code")
        and (o.op is None or o.reason == "input")
    ):
        if not o.module:  # (the model itself: allow_inf there would hide every Inf)
            text += (
                " If this Inf is a mask on purpose, "
                + (
                    "pass it under an argument named like a mask (attn_mask=...)"
                    if o.reason == "input"
                    else "write it with masked_fill(mask, float('-inf')), which nanguard recognises"
                )
                + f"; allow_inf=[{o.module_type}] would hide every Inf of the model."
            )
            return text
        text += (
            " If this Inf is written on purpose (a mask), tell nanguard: "
            f"allow_inf=[{o.module_type}] in nanguard.watch()"
            + (", or pass it under an argument named like a mask" if o.reason == "input" else "")
            + "."
        )
    return text


def _origin_text(o: Origin) -> str:
    word = kind_word(o.kind, o.stats)
    head = f"nanguard: step {o.step}:"
    if o.reason == "input" and o.direct:
        text = (
            f"{head} `{o.tensor}` passed to {_label(o.module or '')} ({o.module_type}), called "
            f"on its own rather than from the model's forward(), already holds {word}: "
            f"{_described(o)}. It was made before that call, by the code that computed it "
            "between the model's calls in this step (a method such as reparameterize, the "
            f"training loop), or it came with the data. {_propagation(o)}"
        )
        return text + _advise(
            o,
            f"Look at what computed `{o.tensor}` before {_label(o.module or '')} was called",
            "an exp that overflowed, a log or sqrt of a negative value, a division by zero",
        )
    if o.reason == "input":
        which = _which_samples(o)
        if o.samples:
            if o.time_steps:
                steps = ", ".join(str(t) for t in o.time_steps[:8])
                noun = "step" if len(o.time_steps) == 1 else "steps"
                which = (
                    which.replace(f"along dim {o.sample_dim}", "in the packed sequence")
                    + f" At time {noun} {steps}{'...' if len(o.time_steps) > 8 else ''}."
                )
            if o.columns:
                # (a table's features, a waveform's time samples: the same dim 1)
                noun = "Column" if len(o.columns) == 1 else "Columns"
                dim = " (dim 1)"
                if o.time_steps:  # (a packed sequence's rows: its columns are features)
                    noun, dim = ("Feature" if len(o.columns) == 1 else "Features"), ""
                which += f" {noun}{dim}: {', '.join(str(c) for c in o.columns)}."
        text = (
            f"{head} the input batch already contains {word}: `{o.tensor}` passed to "
            f"{_label(o.module or '')} ({o.module_type}) has {_described(o)}. No layer "
            f"created it.{which} {_propagation(o)}"
        )
        if is_specific(o.hint):
            return f"{text} Likely cause: {o.hint}"
        return text + _advise(
            o,
            "Check the data pipeline",
            "missing values read as NaN, a normalisation dividing by a zero standard "
            "deviation, log of zero, a corrupt sample",
        )
    if o.reason == "loss" and not o.outputs_seen:
        text = (
            f"{head} the loss is {word} ({_described(o)}), and no forward of the watched model "
            "was recorded in this step to tell whether the model or the loss made it: its "
            "forward() was not called (model methods or submodules called directly: in "
            "sentinel mode only that call is checked, use mode='full'), it ran inside "
            "torch.func transforms, or inside compiled code where nanguard's hooks stand aside: "
            "a torch.compile wrapper made after watch() (watch the compiled model), or a "
            "compiled function that calls the model, a compiled train step (compile the model "
            "itself, model.compile() or its blocks, and call check_loss outside it)."
        )
        return text + _advise(
            o,
            "Look at the model's outputs and the loss computation",
            "an overflow or a domain error in the model (exp, log, sqrt, a division), or in "
            "the loss: log of 0, a division by a zero count",
        )
    if o.reason == "loss" and o.direct_calls:
        names = ", ".join(_label(n) for n in o.direct_calls[:5])
        more = f" and {len(o.direct_calls) - 5} more" if len(o.direct_calls) > 5 else ""
        text = (
            f"{head} the loss is {word} ({_described(o)}), and the watched model's forward() "
            f"was not called in this step: its submodules {names}{more} were called directly "
            "and returned finite values. The value was made by the code that called them and "
            "combined their outputs (a model method such as get_action_and_value, which "
            "nanguard does not watch), or by the loss."
        )
        return text + _advise(
            o,
            "Look at the model method that calls them and at the loss computation",
            "log of probabilities that can be 0, 0 * -inf in the entropy of masked logits, "
            "exp of a large log-ratio, a division by a zero count",
        )
    if o.reason == "loss":
        outputs = (
            "held no NaN/Inf but for -inf written on purpose (a mask)"
            if o.masked_outputs
            else f"were finite, though huge (of the order of {o.output_peak:.1e} at least)"
            if o.output_peak is not None and o.output_peak >= _HUGE_LOSS_INPUTS
            else "were finite"
        )
        unless = (
            ", unless it came from the model's calls inside torch.func transforms (vmap, grad, "
            "hessian, jacrev), whose values nanguard cannot check: if the loss uses them, check "
            "their inputs and outputs (a NaN input point, sqrt or pow at 0 in a derivative)"
            if o.transformed
            else ""
        )
        if o.outside_weights:
            shapes = ", ".join(str(tuple(s)) for s in o.outside_weights[:3])
            more = ", ..." if len(o.outside_weights) > 3 else ""
            n = len(o.outside_weights)
            text = (
                f"{head} the loss is {word} ({_described(o)}) while the watched model's "
                f"outputs {outputs}: the loss function, or the code between them and the "
                f"loss, created it{unless}. That code uses {n} trainable "
                f"weight{'s' if n > 1 else ''} the watched model does not hold (shape "
                f"{shapes}{more}): another model (a discriminator, a critic), or the rest of "
                "a model of which only a part is watched (its pooling, its head)."
            )
            if o.stale_outside:
                first = o.stale_outside[0]
                others = len(o.stale_outside) - 1
                text += (
                    f" One of them already holds {first.summary()}"
                    + (f" ({others} more too)" if others else "")
                    + " at the step's end: it went non-finite outside the guard, before this "
                    "step's loss (or in an update of its own since)."
                )
            return text + _advise(
                o,
                "Look at the code that uses the watched model's outputs, up to the loss "
                "(watch the whole model to have its modules checked)",
                "a division by a zero count (a mean over an empty mask), log of 0, sqrt at 0, "
                "an overflow",
            )
        text = (
            f"{head} the loss is {word} ({_described(o)}) while the model's outputs "
            f"{outputs}: the loss function created it{unless}."
        )
        return text + _advise(
            o,
            "Look at the loss computation",
            "log of 0 (log(softmax(x)) instead of log_softmax), a division by a zero count or "
            "norm, sqrt at 0, an overflow of huge outputs (exploding training), targets out of "
            "range",
        )
    if o.reason == "own_code":
        made = "was also made, independently," if o.independent else "was created"
        unhooked = ", ".join(f"`{name}` ({kind})" for name, kind in o.unhooked)
        inside = (
            f" (or in a submodule nanguard does not hook, part of that code: {unhooked})"
            if unhooked
            else ""
        )
        checked = " that nanguard hooks" if unhooked else ""
        given = ", ".join(f"`{n}`" for n in o.received_neginf)
        if given:
            # (-Inf it was given: a mask, or data gone bad; nanguard cannot tell which)
            what = "made NaN of" if o.kind == "nan" else "passed on"
            text = (
                f"{head} {word} came out of the own code of {_label(o.module or '')} "
                f"({o.module_type}.forward{_call(o.call)}){inside}, between its submodules: "
                f"the tensor it passed to `{o.consumer}` as `{o.tensor}` has "
                f"{_described(o)}. It received -Inf in {given}, which its code {what}: the "
                "log of a 0 in the data (a sensor hole, a zero count), or a mask under a name "
                f"that is not a mask's. {'' if o.independent else _propagation(o)}"
                f"{_evidence(o)}"
            )
        else:
            received = (
                "it was given only integer or bool tensors (token ids, masks), and every "
                f"submodule it called before{checked} returned finite values"
                if o.integer_inputs
                else "it was given no tensor that nanguard found (none, or nested deeper than it "
                f"looks: check the batch yourself), and every submodule it called before"
                f"{checked} returned finite values"
                if o.no_tensor_inputs
                else f"it received no NaN or +Inf (-Inf only in "
                f"{', '.join(f'`{n}`' for n in o.masks_received)}, a mask) and every submodule "
                f"it called before{checked} returned finite values"
                if o.masks_received
                else f"everything it received and every submodule it called before{checked} "
                "returned finite values"
            )
            text = (
                f"{head} {word} {made} in the own code of {_label(o.module or '')} "
                f"({o.module_type}.forward{_call(o.call)}){inside}, between its submodules: "
                f"the tensor it passed to `{o.consumer}` as `{o.tensor}` has {_described(o)}, "
                f"while {received}.{_which_samples(o)} {'' if o.independent else _propagation(o)}"
                f"{_evidence(o)}"
            )
        if o.stale_attributes:
            names = ", ".join(f"`{a}`" for a in o.stale_attributes)
            text += (
                f" Its attribute {names} (a plain tensor, not a parameter or buffer) already "
                "holds NaN/Inf: state an earlier call wrote (a running statistic updated under "
                "no_grad, a cache). Look at where it is written, and at that update's inputs."
            )
        return text + _advise(
            o,
            f"Look at the operations in {o.module_type}.forward before the call to `{o.consumer}`",
            _advice(o.kind, o.stats),
        )
    inputs = ""
    if o.inputs and o.reproducible is not False:  # (else they are the replay's, not its)
        ranges = "; ".join(
            (f"{label} in [{s.min:.4g}, {s.max:.4g}]" if s.min is not None else label)
            + (f" and {s.neginf_count:,} -Inf" if s.neginf_count else "")
            for label, s in o.inputs
        )
        more = f"; {o.more_inputs:,} more" if o.more_inputs else ""
        inputs = f" ({ranges}{more})"
    # -Inf taken for a mask (written on purpose) that this module turned into NaN.
    neg_inf = any(s.neginf_count for _, s in o.inputs)
    received = (
        "its inputs held no NaN, only -Inf"
        if neg_inf
        else "it was given only integer or bool tensors (token ids, masks)"
        if o.integer_inputs
        else "it was given no tensor that nanguard found (none, or nested deeper than it "
        "looks: check the batch yourself)"
        if o.no_tensor_inputs
        else "its inputs were finite"
    )
    text = (
        f"{head} {word} "
        + ("was also made, independently, " if o.independent else "first appeared ")
        + f"in the forward pass, in {_label(o.module or '')} "
        f"({o.module_type}{_call(o.call)}): {received}{inputs} and its "
        f"`{o.tensor}` has {_described(o)}."
        + _which_samples(o)
        + ("" if o.independent else f" {_propagation(o)}")
        + _evidence(o)
    )
    if o.nonfinite_params and o.nonfinite_buffers_only:
        names = ", ".join(f"`{p}`" for p in o.nonfinite_params)
        return (
            f"{text} Its own buffers are not finite ({names}): they held NaN/Inf before this "
            "forward (computed so, a class weight from a count of 0, or loaded so); this "
            "forward only reads them."
        )
    if o.nonfinite_params:
        names = ", ".join(f"`{p}`" for p in o.nonfinite_params)
        return (
            f"{text} Its own parameters are not finite ({names}): they were corrupted "
            "before this forward (an earlier optimizer step, a bad checkpoint); this forward "
            "only reveals it."
        )
    if neg_inf and o.kind == "nan" and not o.mask_inputs:
        where = (
            f" It came out of {o.inf_made_by}: look there (a max over an empty set, a "
            "neighbourhood or segment with no member, is -inf; so is a log of 0)."
            if o.inf_made_by
            else " See where it was made."
        )
        text += (
            " A -Inf (a mask, or the log of a 0) that reaches anything but a softmax makes NaN "
            f"(-inf * 0, -inf + inf).{where}"
        )
    if o.mask_inputs and o.kind == "nan":
        masks = ", ".join(f"`{m}`" for m in o.mask_inputs)
        text += (
            f" It received -inf through {masks}: a row in which every position is masked "
            "gives NaN in softmax (a fully masked sample, e.g. an empty sequence or a padding "
            "mask that hides everything)."
        )
    hooks = (
        f" and its forward pre-hooks ({', '.join(o.pre_hooks)}), which run before it"
        if o.pre_hooks
        else ""
    )
    masks = ", ".join(f"`{m}`" for m in (o.mask_inputs or o.mask_args))
    softmax = is_attention(o.op)  # (a softmax, or a fused attention kernel holding one)
    look = (
        f"Look at the masks it was given ({masks}): which sample has every position masked"
        if o.builtin and not o.pre_hooks and masks and o.kind == "nan" and softmax
        else f"Look at what this {o.module_type} was given and holds (its input's scale, its "
        "weights, its dtype)"
        if o.builtin and not o.pre_hooks
        else f"Look at {o.module_type}.forward{hooks}"
    )
    return text + _advise(o, look, _advice(o.kind, o.stats))


def _which_samples(o: Origin) -> str:
    """`` It is in samples 3, 17 (of 32 along dim 0).`` (empty when not known)."""
    if not o.samples:
        return ""
    listed = ", ".join(str(i) for i in o.samples)
    total = max(o.n_samples, len(o.samples))
    if total > len(o.samples):
        return (
            f" It is in {total:,} of {o.batch:,} samples (along dim {o.sample_dim}), the first: "
            f"{listed}."
        )
    noun = "sample" if total == 1 else "samples"
    return f" It is in {noun} {listed} (of {o.batch} along dim {o.sample_dim})."


def propagated_message(
    step: int,
    kind: str,
    where: str,
    module_type: str | None,
    origin: str | None,
    own: bool = False,
) -> str:
    """The sentence for a call that a non-finite value only passed through (``own``: the
    output of the call whose own code made it, between its children)."""
    word = kind_word(kind)
    what = f"{where} ({module_type})" if module_type else where
    if own:
        return (
            f"nanguard: step {step}: {word} reached the output of {what}, made in its own "
            "code (the origin event; propagated, not an origin)."
        )
    source = f"; it was created earlier, in {origin}" if origin else ""
    return f"nanguard: step {step}: {word} reached {what}{source} (propagated, not an origin)."


_BACKWARD_ADVICE = (
    "an operation whose derivative is infinite where its value is finite: sqrt or norm at "
    "0 (a distance between identical points), acos/asin at +-1, acosh at 1, pow with a "
    "fractional "
    "exponent at 0, log hidden behind nan_to_num or clamp, torch.where whose unselected "
    "branch overflows (its gradient is still computed: 0 * inf), a division by a value "
    "that is 0, an SVD or eigendecomposition with repeated values, logsumexp over a slice "
    "that is all -inf"
)


def backward_message(
    *,
    step: int,
    reason: str,
    kind: str,
    module: str | None,
    module_type: str | None,
    call: int,
    tensor: str,
    stats: TensorStats | None,
    params: Sequence[tuple[str, TensorStats]],
    propagated: Sequence[str],
    n_propagated: int,
    problem: str | None,
    op: OpInfo | None = None,
    hint: str | None = None,
    reproducible: bool | None = None,
    loss_checked: bool = True,
    own_generators: bool = False,
    given: bool = False,
) -> str:
    """The paragraph for an origin in the backward pass (``given``: the parameters are
    its parent's, which its forward transforms)."""
    # The user's own autograd.Function: its Python backward ran the op, not autograd.
    custom = custom_backward_name(op.node, op.hook) if op and op.custom_backward else None
    hook = op is not None and op.hook
    text = _backward_text(
        step, reason, kind, module, module_type, call, tensor, stats, params,
        propagated, n_propagated, problem, loss_checked, custom, is_specific(hint), hook, given,
    )  # fmt: skip
    if op is not None and custom:
        where = f" at {op.source}" if op.source else ""
        text += f" It was made by `{op.name}` in {custom[0]}{where}."
    elif op is not None:
        node = f" (the backward of {op.node})" if op.node else ""
        where = f", created in the forward at {op.source}" if op.source else ""
        text += f" It was made by `{op.name}`{node}{where}."
    if reproducible is False:
        text += _unreproduced("gradients")
    elif own_generators:
        text += _OWN_GENERATORS
    if is_specific(hint):
        text += f" Likely cause: {hint}"
    return text


def _backward_text(
    step: int,
    reason: str,
    kind: str,
    module: str | None,
    module_type: str | None,
    call: int,
    tensor: str,
    stats: TensorStats | None,
    params: Sequence[tuple[str, TensorStats]],
    propagated: Sequence[str],
    n_propagated: int,
    problem: str | None,
    loss_checked: bool = True,
    custom: tuple[str, str] | None = None,
    hinted: bool = False,
    hook: bool = False,
    given: bool = False,
) -> str:
    """``hinted``: a specific hint follows (the list of usual causes is left out);
    ``custom``: the user's own backward code made it (``hook``: a gradient hook)."""
    word = kind_word(kind, stats)
    advice = "" if hinted else f": {_BACKWARD_ADVICE}"
    head = f"nanguard: step {step}:"
    if stats is not None:
        described = stats.summary()
    else:
        described = f"{word} values" + (
            f" (exact statistics unavailable: {problem})" if problem else ""
        )
    if n_propagated:
        shown = ", ".join(_label(n) for n in propagated)
        more = n_propagated - len(propagated)
        tail = f" and {more} more" if more > 0 else ""
        calls = "call" if n_propagated == 1 else "calls"
        reached = f" It then reached the backward of {n_propagated} module {calls} ({shown}{tail})."
    else:
        reached = ""
    where = _label(module or "") if module is not None else "the model"
    if reason == "loss_backward":
        if loss_checked:
            seen = "while the loss and the model's outputs were finite"
        else:
            seen = (
                "while the model's outputs were finite (the loss itself was not checked: pass "
                "it to guard.check_loss() to tell a non-finite loss from its backward)"
            )
        return (
            f"{head} the gradient arriving at the model's output is {word} ({described}) "
            f"{seen}: the loss computation or its backward created it.{reached} Look at the "
            "loss computation: an overflow or log(0) in the loss, sqrt of a distance that can "
            "be 0 (e.g. a triplet or contrastive loss on identical embeddings), log or "
            "division at 0, norm of a zero vector."
        )
    if custom and hook:
        custom_look = (
            f"at {custom[0]} ({custom[1]}), the user's code that rewrites the gradient: its "
            "formula is not finite everywhere."
        )
    elif custom:
        custom_look = (
            f"at {custom[0]}, the hand-written backward of {custom[1]} that "
            f"{module_type}.forward calls: its formula is not finite everywhere."
        )
    else:
        custom_look = ""
    if reason == "backward_params":
        whose = "its parent's parameters, which it transforms," if given else "its own parameters"
        listed = "; ".join(f"`{name}`: {s.summary()}" for name, s in params[:3]) or tensor
        unchecked = (
            f" This is read from .grad at the end of the step, which no replay could check "
            f"({problem}): clip_grad_norm_ by a NaN total norm, or a gradient hook, puts NaN "
            "there from another module's backward."
            if problem and stats is not None
            else ""
        )
        return (
            f"{head} {word} first appeared in the backward pass, in the backward of {where} "
            f"({module_type}{_call(call)}): the gradient arriving at its output was finite, "
            f"but the gradients of {whose} are not ({listed}).{unchecked}{reached} "
            + (
                f"Look {custom_look}"
                if custom
                else f"Look at {module_type}.forward{advice}"
                + ("; or inputs so large that input x gradient overflows." if advice else ".")
            )
        )
    if reason == "own_code_backward":
        look = (
            f"Look {custom_look}"
            if custom
            else f"Look at the operations in {module_type}.forward that use this tensor{advice}."
        )
        return (
            f"{head} {word} first appeared in the backward pass, in the own code of {where} "
            f"({module_type}.forward{_call(call)}): the {tensor} is {described}, while every "
            f"gradient arriving from later in the model was finite.{reached} {look}"
        )
    return (
        f"{head} {word} first appeared in the backward pass, in the backward of {where} "
        f"({module_type}{_call(call)}): the gradient arriving at its output was finite and the "
        f"{tensor} it produced has {described}.{reached} The forward was finite: "
        + (f"look {custom_look}" if custom else f"look at {module_type}.forward{advice}.")
    )


def grad_message(
    step: int,
    param: str,
    module_type: str,
    kind: str,
    stats: TensorStats | None,
    is_origin: bool,
    count: int,
    unlocalised: str | None = None,
    maybe_own: bool = False,
    reached_first: bool = False,
) -> str:
    """The sentence for a parameter whose gradient is non-finite (``maybe_own``: the
    step's origin is another module's backward making its own parameters' gradients: this
    one's may be its module's doing as well; ``reached_first``: of those with non-finite
    gradients, its module ran last in the forward)."""
    word = kind_word(kind, stats)
    described = stats.summary() if stats is not None else f"{word} values"
    others = f" ({count} parameters in all have non-finite gradients)" if count > 1 else ""
    if is_origin:
        why = f" ({unlocalised})" if unlocalised else ""
        check = (
            " Watch the module whose forward() the training step calls, or compile the "
            "model itself (model.compile() or its blocks), not a function that calls it, and "
            "nanguard names the module."
            if unlocalised and unlocalised.startswith("no forward")
            else (
                " Of the modules whose parameters' gradients are non-finite, this one ran "
                "last in the forward: its backward is where the backward reached them first, "
                "so look there first (at the sqrt, norm, division or custom autograd "
                "Function of its forward), or run the checkpointed blocks with "
                "use_reentrant=False for nanguard to name the operation."
            )
            if reached_first and count > 1 and unlocalised and "use_reentrant" in unlocalised
            else (
                " A module inside a checkpointed block may have made it in its backward (a "
                "sqrt or norm at 0), and this parameter's module only received it: watch with "
                'backward="probes" for nanguard to name the block that called checkpoint, or '
                "run the blocks with use_reentrant=False for it to name the module and the "
                "operation."
            )
            if unlocalised and "use_reentrant" in unlocalised
            else ' Run with mode="sentinel" (it keeps every micro-batch for its replay), or '
            "fewer, larger micro-batches, for nanguard to name the module and the operation."
            if unlocalised and "micro-batch (forward" in unlocalised
            else " With replay=True (the default), nanguard names the module and the operation."
            if unlocalised and unlocalised.startswith("a sentinel step")
            else " An input of the step's forwards was changed in place since: one buffer "
            "refilled for every micro-batch (x_buf.copy_(batch), for CUDA graphs or pinned "
            "memory: give each forward a tensor of its own, x_buf.clone()), or the model's own "
            "in-place operation on its input (x.sub_(mean): mode='full' checks it as it runs), "
            "so no replay could run to name the module and the operation."
            if unlocalised and "modified in place after the forward" in unlocalised
            else " Check custom autograd Functions and gradient hooks that write to .grad."
        )
        return (
            f"nanguard: step {step}: the gradient of parameter `{param}` ({module_type}) has "
            f"{described}{others}, and no module's backward could be named{why}.{check}"
        )
    why = (
        "not localised: carried on from the step's origin, or made by its own module's "
        "backward as the origin's were; only the first is replayed"
        if maybe_own
        else "propagated, not an origin"
    )
    return (
        f"nanguard: step {step}: the gradient of parameter `{param}` ({module_type}) has "
        f"{described}{others} ({why})."
    )


def _rank_logs(log_path: str | None) -> str:
    """Where another rank's events are: its own log, or how to give it one."""
    if log_path is not None and "{rank}" in log_path:
        return f"(in its own log, {log_path} with its rank)"
    return "(log_path='events.{rank}.jsonl' gives each rank its file)"


def external_grads_message(
    step: int,
    world: int,
    param: str,
    kind: str,
    stats: TensorStats | None,
    count: int,
    double_backward: bool = False,
    unseen: bool = False,
    sharded: bool = False,
    probed: bool = False,
    transformed: bool = False,
    coarse: bool = False,
    log_path: str | None = None,
) -> str:
    """The paragraph for gradients that autograd made finite and ``.grad`` holds non-finite
    (``double_backward``: part of them came through ``autograd.grad(create_graph=True)``;
    ``unseen``: no backward through the model was seen at all; ``sharded``: a sharded
    model's gradients, reduce-scattered across ranks inside the backward)."""
    word = kind_word(kind, stats)
    described = stats.summary() if stats is not None else f"{word} values"
    which = f"{count} parameter gradients hold" if count > 1 else "a parameter gradient holds"
    if sharded:
        return (
            f"nanguard: step {step}: {which} {word} in this rank's shard (`{param}`: "
            f"{described}), yet the gradient crossing every module of this rank's backward "
            f"was finite. With {world} ranks, a sharded model's gradients (FSDP) are "
            "reduce-scattered across the ranks inside the backward: another rank's non-finite "
            "gradients came in that way, and that rank reports the origin "
            f"{_rank_logs(log_path)}. Not an origin on this rank; if no rank reports one, a "
            "module's use of its own parameters made them (a sharded model is not replayed on "
            "one rank to find which)."
        )
    if unseen:
        return (
            f"nanguard: step {step}: {which} {word} (`{param}`: {described}), and no backward "
            "through a checked forward of the model ran in this step: the gradients were made "
            "where nanguard does not look, inside torch.func transforms (per-sample gradients "
            "with vmap(grad(...)), as DP-SGD computes them) or by code that writes .grad. "
            "Check that computation: per-sample clipping dividing by a norm of 0 "
            "(C / (norm + eps)), a NaN in the batch, a loss term that is NaN for one sample."
        )
    if transformed and not double_backward and world == 1:
        return (
            f"nanguard: step {step}: {which} {word} (`{param}`: {described}), yet this "
            "step's forward and its backward from the model's outputs are finite. The step "
            "also ran the model's modules inside torch.func transforms (jacrev, vmap, grad: a "
            "Jacobian or per-sample term), whose derivatives nanguard does not see: the loss "
            "term built from them made it, in its backward. sqrt or a norm of a Jacobian that "
            "is 0 somewhere (a saturated tanh) has an infinite slope at 0: add an eps "
            "(sqrt(x + 1e-12)); check divisions by it too."
        )
    if double_backward and world == 1:
        return (
            f"nanguard: step {step}: {which} {word} (`{param}`: {described}), yet this "
            "step's forward and its backward from the model's outputs are finite. This step "
            "differentiated gradients (autograd.grad(create_graph=True): a gradient penalty, "
            "an input-gradient regulariser, MAML): the term built from those gradients made "
            "it, in its own backward. A norm written by hand of a gradient that is 0 somewhere "
            "(sqrt(sum(g**2)): torch's g.norm() has a 0 slope there) has an infinite slope at 0: "
            "add an eps (sqrt(sum(g**2) + 1e-12)); check divisions by a gradient norm too."
        )
    head = (
        f"nanguard: step {step}: {which} {word} "
        f"(`{param}`: {described}), yet this step's forward, loss and backward were "
        + (
            "finite (every module's gradient was probed): the parameters' gradients were "
            "changed after autograd computed them."
            if probed
            else "finite, and recomputing the backward gives finite gradients for every "
            "parameter: the gradients were changed after autograd computed them."
        )
    )
    if world > 1:
        return (
            f"{head} With {world} ranks, that is the gradient all-reduce "
            "(DistributedDataParallel) bringing in another rank's non-finite gradients: that "
            f"rank reports the origin {_rank_logs(log_path)}. Not an origin on this rank. If "
            "no rank reports one, the all-reduce made it: a communication hook that sums in "
            "float16 (fp16_compress_hook) overflows past "
            "65504 (use bf16_compress_hook, or keep the gradients smaller)."
        )
    unwatched = (
        " Or a loss term computed through its submodules outside the model's forward (a "
        "torch.func Jacobian of the encoder, a penalty on a submodule's output), whose "
        "backward sentinel mode does not watch: mode='full' tells."
        if coarse
        else ""
    )
    return (
        f"{head} Look at what writes to .grad after the backward: gradient hooks "
        "(register_hook, register_post_accumulate_grad_hook), DDP communication hooks, "
        f"gradient clipping or scaling code, or an all-reduce of the gradients.{unwatched}"
    )


def stepper_message(
    step: int,
    param: str,
    module_type: str,
    kind: str,
    stats: TensorStats,
    stepper: str,
    bad_grad: bool,
) -> str:
    """The paragraph for a weight found non-finite that another optimizer than the
    guard's ``optimizer=`` moved in this step (SAC's critic optimizer, mid-step)."""
    name, _, rate = stepper.partition(" with ")
    if rate:  # (its learning rate was not finite: the update, whatever the gradient)
        how = f" with {rate}: that made it"
    else:
        how = (", with a gradient that is non-finite now" if bad_grad else "") + (
            ": the likely writer. nanguard checks gradients before optimizer='s steps only, so "
            "that step applied them unchecked"
        )
    return (
        f"nanguard: step {step}: parameter `{param}` ({module_type}) is "
        f"{kind_word(kind, stats)}: {stats.summary()}. In this step {name}.step(), another "
        f"optimizer than the guard's optimizer=, moved it{how}."
    )


def param_message(
    step: int,
    param: str,
    module_type: str,
    kind: str,
    stats: TensorStats,
    is_param: bool,
    before_training: bool,
    caused: bool = False,
    since: int = 0,
    outside: str | None = None,
    written: bool = False,
    unlisted: bool = False,
    adaptive: bool = True,
    copied: bool = False,
    rate: str | None = None,
    fed: bool = False,
    put_back: bool = False,
    in_forward: bool = False,
    op: OpInfo | None = None,
    grads_read: bool = True,
    bad_state: str | None = None,
    optimizer_eps: float | None = None,
) -> str:
    """The paragraph for a parameter or buffer that went non-finite between steps.

    ``since``: the first step after the last sweep that found it finite. ``outside``: why
    the optimizer's update cannot be what made it (a parameter it does not train).
    ``written``: finite when the guard was attached, and no optimizer step ran since.
    ``rate``: the non-finite learning rate the update that made it ran with (reported).
    ``fed``: written by its module's forward, which non-finite values had reached.
    ``in_forward``: a buffer its module's forward writes in place (not running statistics
    of a norm), made non-finite from finite values, by ``op`` when a replay found it.
    """
    word = kind_word(kind, stats)
    what = "parameter" if is_param else "buffer"
    if rate is not None:
        return (
            f"nanguard: step {step}: parameter `{param}` ({module_type}) became {word} in "
            f"optimizer.step() with {rate} (propagated, not an origin: see the step's event "
            f"on that learning rate): {stats.summary()}."
        )
    if written:
        return (
            f"nanguard: step {step}: parameter `{param}` ({module_type}) became {word} before "
            "any optimizer step, in a forward or in code between steps (it was finite when the "
            f"guard was attached): {stats.summary()}. The module's own code, or code that "
            "writes the weights, did: a data-dependent initialisation from the first batch "
            "(ActNorm's -log(std) where a feature is constant, std 0), a weight normalised by a "
            "zero norm, an in-place update in forward(), a `.data` or copy_ write between "
            "steps. Look at where its forward assigns it, and at what else writes it."
        )
    if caused and not is_param:
        kept = (
            "on_nonfinite='skip_step' puts the running statistics back as the step's first "
            "forward found them (its note on the step says which)"
            if put_back
            else "Running statistics keep it: later evaluations in eval() mode will be "
            "non-finite too"
            if param.rpartition(".")[2] in ("running_mean", "running_var")
            else "The buffer keeps it: later forwards that read it (a queue of negatives, a "
            "codebook, a centre) will be non-finite too, until it is reset"
        )
        return (
            f"nanguard: step {step}: buffer `{param}` ({module_type}) became {word}: "
            f"{stats.summary()}, updated in a forward that had gone non-finite "
            f"(propagated, not an origin: see the step's origin). {kept}."
        )
    if caused and fed:
        return (
            f"nanguard: step {step}: parameter `{param}` ({module_type}) became {word} in its "
            "module's forward, which non-finite values from earlier in the step had reached (a "
            f"data-dependent initialisation, ActNorm's, from a NaN input): {stats.summary()} "
            "(propagated, not an origin: see the step's origin)."
        )
    if caused and copied:
        return (
            f"nanguard: step {step}: parameter `{param}` ({module_type}) became {word}: "
            f"{stats.summary()}. It is not trained: code that writes it (an EMA or momentum "
            "update, a teacher, a key encoder) copied weights that had already gone "
            "non-finite (propagated, not an origin: see the earlier origin)."
        )
    if caused:
        return (
            f"nanguard: step {step}: {what} `{param}` ({module_type}) became {word} in "
            f"optimizer.step() because its gradient was non-finite: {stats.summary()} "
            "(propagated, not an origin: see the step's earlier origin)."
        )
    if before_training:
        owner = param.rpartition(".")[0]
        on_purpose = (
            f" If it holds {word} on purpose (the empty slots of a memory bank), exclude its "
            f"module: exclude=({owner!r},)."
            if not is_param and owner
            else f" If it holds {word} on purpose (a CRF's forbidden transitions), pass "
            f"allow_inf=({owner!r},)."
            if owner and not stats.nan_count
            else ""
        )
        return (
            f"nanguard: step {step}: {what} `{param}` ({module_type}) was already {word} before "
            f"the first step: {stats.summary()}. Check the checkpoint it was loaded from and "
            f"the initialisation.{on_purpose}"
        )
    if not is_param and in_forward:
        made = (
            f" It was made by `{op.name}`" + (f" at {op.source}" if op.source else "") + "."
            if op is not None
            else ""
        )
        return (
            f"nanguard: step {step}: buffer `{param}` ({module_type}) became {word} in the "
            f"step's forward, which writes it in place (an EMA codebook, a running "
            f"normaliser), from finite values: {stats.summary()}.{made} Every later forward "
            f"reads it: look at that update in {module_type}.forward"
            + (
                "."
                if op is not None and "div" not in op.name
                else " (a division by a count that can be 0: a dead code's cluster size "
                "wants Laplace smoothing or an eps)."
            )
        )
    if not is_param:
        when = (
            f" between step {since} and step {step} (buffers are swept every check_params "
            "steps and whenever a step goes non-finite)"
            if since < step
            else ""
        )
        return (
            f"nanguard: step {step}: buffer `{param}` ({module_type}) became {word}{when}: "
            f"{stats.summary()}. Running statistics (BatchNorm running_mean/var) are updated "
            "in the forward: a batch with non-finite activations, or with finite ones so "
            "large that their square overflows (above ~1e19 in float32, ~256 in float16), "
            "poisons them for every later evaluation in eval() mode."
        )
    between = (
        f" of a step between step {since} and step {step} (parameters are swept every "
        "check_params steps and whenever a step goes non-finite)"
        if since < step
        else ""
    )
    if unlisted:
        when = f" between step {since} and step {step}" if since < step else ""
        return (
            f"nanguard: step {step}: parameter `{param}` ({module_type}) became {word}{when}: "
            f"{stats.summary()}. It was added to the model (or put in another's place) after "
            "the guard last listed its parameters (checked every 16 steps), so its gradient "
            "was not checked. If it was non-finite from the start, what built it wrote that "
            "value (fuse_conv_bn_eval of a BatchNorm whose running_var is 0 with eps=0, a "
            "reparameterisation, load_state_dict(assign=True) of a NaN checkpoint); else the "
            "step's origin, if any, is where to look (a NaN gradient makes the update NaN). "
            "Its gradients are checked from now on."
        )
    if outside is not None:
        when = f" between step {since} and step {step}" if since < step else ""
        return (
            f"nanguard: step {step}: parameter `{param}` ({module_type}) became {word} "
            f"outside the optimizer's update{when}: {stats.summary()}. {outside}, so code "
            "that writes it in place changed it: an EMA or momentum update (a teacher, a key "
            "encoder), load_state_dict, a `.data =` assignment. Check what that code was "
            "given (a NaN momentum, source weights already non-finite)."
        )
    if not grads_read:
        return (
            f"nanguard: step {step}: parameter `{param}` ({module_type}) became {word} in "
            f"optimizer.step(){between}: {stats.summary()}. Its gradients were not checked "
            "(backward=False, grad_norm=False), so neither is known: a non-finite gradient "
            "(its module's backward can make one from finite values: sqrt or a division at "
            "0) or the update itself (a learning rate so large that it overflows) made it."
        )
    # (Swept steps later: an optimizer step of that window, or code that wrote the weight
    # after one; nothing tells which.)
    where = (
        f" between step {since} and step {step}, in an optimizer.step() or written after "
        "one (parameters are swept every check_params steps and whenever a step goes "
        "non-finite)"
        if since < step
        else " in optimizer.step()"
    )
    if bad_state:
        return (
            f"nanguard: step {step}: parameter `{param}` ({module_type}) became {word}"
            f"{where}: {stats.summary()}, although its gradients were finite: the optimizer's "
            f"own state for it ({bad_state}) already held NaN/Inf, and the update carried it "
            "in. An optimizer state_dict loaded with it (a checkpoint saved after a bad step), "
            "or a NaN let into the moments earlier: load a clean optimizer state, or reset it."
        )
    if adaptive and optimizer_eps and stats.dtype not in ("torch.float16", "torch.bfloat16"):
        # (An eps the dtype holds: no 0/0 in the update, the usual Adam causes are out.)
        return (
            f"nanguard: step {step}: parameter `{param}` ({module_type}) became {word}"
            f"{where}: {stats.summary()}, although its gradients were finite and the "
            f"optimizer's eps ({optimizer_eps:g}) rules out a 0/0 in the update: likely a write "
            "outside the step since the weight was last checked (load_state_dict of a "
            "checkpoint holding NaN, copy_, a .data assignment), or gradients so huge that "
            "their squares overflow."
        )
    return (
        f"nanguard: step {step}: parameter `{param}` ({module_type}) became {word}"
        f"{where}: {stats.summary()}, although its gradients were "
        + (
            "finite. Typical causes: Adam-type optimizers (Adam, RMSprop...) with eps=0 (an "
            "exactly-zero gradient gives 0/0), or on float16 parameters (eps=1e-8 underflows "
            "to 0 in float16, and so does the second moment of small gradients: the update is "
            "+-Inf): set eps > 0, keep float32 master weights; a learning rate so large that "
            "the update overflows; weight decay on an already huge weight; or a write outside "
            "the step (load_state_dict, copy_, a .data assignment)."
            if adaptive or stats.dtype == "torch.float16"
            else "finite. Typical causes: a learning rate so large that the update overflows; "
            "weight decay on an already huge weight; or a write outside the step since the "
            "weight was last checked (load_state_dict of a checkpoint holding NaN, copy_, a "
            ".data assignment)."
        )
    )


def _times(ratio: float) -> str:
    """``17x``, ``2,380x``, ``2.38e+19x``."""
    return f"{ratio:,.0f}x" if ratio < 1e6 else f"{ratio:.3g}x"


def origin_place(event: Event) -> str:
    """Where an origin event was: ``"`encoder.attn` (forward)"``, ``"the loss"``."""
    if event.phase == "input":
        return "the input batch"
    if event.phase == "loss":
        return "the loss"
    if event.module:
        return f"`{event.module}` ({event.phase})"
    if event.module == "":
        return f"the model ({event.phase})"
    return f"the {event.phase} phase"


def grad_norm_message(
    step: int,
    alarm: GradNormAlarm,
    top: Sequence[tuple[str, float]],
    location: str | None,
    clipped_to: float | None = None,
    batch: tuple[int, int] | None = None,
    beside: str | None = None,
) -> str:
    """The paragraph for an exploding-gradient warning (``clipped_to``: the max_norm of
    the ``clip_grad_norm_`` that scaled the gradients down before the step; ``batch``:
    this step's batch and the run's usual one, when the norm was judged for the latter;
    ``beside``: where a non-finite value was made in the same step)."""
    norm, reference, limit, reason = alarm.norm, alarm.reference, alarm.limit, alarm.reason
    largest = ", ".join(f"`{name}` {value:.3g}" for name, value in top)
    where = f" The step was taken at {location}." if location else ""
    if beside is not None:
        if reason == "spike" and reference is not None:
            head = (
                f"nanguard: step {step}: the norm of the finite gradients jumped to "
                f"{norm:.4g}, {_times(norm * alarm.scale / reference)} its recent median "
                f"{reference:.4g}"
            )
        else:
            head = f"nanguard: step {step}: the gradient norm {norm:.4g} exceeds its limit"
        biggest = f" Largest: {largest}." if largest else ""
        return (
            f"{head}, in the step where {beside} made a non-finite value.{biggest}{where} "
            "The same cause (a bad batch, a value at the edge of an operation's domain) can "
            "have made both: look at that origin first. If the norm stays high in the "
            "steps after it, lower the learning rate (or add warm-up) or clip gradients."
        )
    if reason == "spike" and reference is not None:
        judged = norm * alarm.scale
        counted = (
            f" ({judged:.4g} counted for the usual batch of {batch[1]}: this step's had {batch[0]})"
            if alarm.scale != 1.0 and batch is not None
            else ""
        )
        head = (
            f"nanguard: step {step}: the gradient norm jumped to {norm:.4g}{counted}, "
            f"{_times(judged / reference)} its recent median {reference:.4g}, while every "
            "value is still finite."
        )
    elif reason == "param_threshold":
        head = (
            f"nanguard: step {step}: the gradient norm of {largest} exceeds "
            f"param_norm_threshold={limit:.4g}."
        )
        largest = ""
    else:
        head = (
            f"nanguard: step {step}: the gradient norm {norm:.4g} exceeds "
            f"grad_norm_threshold={limit:.4g}."
        )
    biggest = f" Largest: {largest}." if largest else ""
    healthy = (
        " If the run stays healthy at this level (a density model's likelihood gradient grows "
        "as it sharpens; a sparse reward first reached after near-zero gradients, a loss term "
        "switched on), raise grad_norm_ratio= or pass grad_norm=False."
        if reason == "spike"
        else ""
    )
    if clipped_to is not None:
        return (
            f"{head} (Norms before clip_grad_norm_, which scaled the gradients down to "
            f"{clipped_to:.4g}.){biggest}{where} Clipping bounds this step's update, not what "
            "made the gradients explode: look for a bad batch, lower the learning rate (or "
            f"add warm-up).{healthy}"
        )
    return (
        f"{head}{biggest}{where} Exploding gradients turn into Inf and NaN a few steps later: "
        "lower the learning rate (or add warm-up), clip gradients "
        f"(torch.nn.utils.clip_grad_norm_), look for a bad batch.{healthy}"
    )


def overflow_message(
    step: int, module: str, module_type: str, tensor: str, peak: float, limit: float, dtype: str
) -> str:
    """The paragraph for a half-precision activation close to its largest value."""
    share = 100.0 * peak / limit
    advice = (
        # bfloat16 has float32's range: there, such values mean the run is exploding
        "Activations or weights are exploding: lower the learning rate, clip gradients, or "
        "normalise the activations."
        if dtype == "torch.bfloat16"
        else "Keep this layer in float32 (or use bfloat16), rescale its weights or inputs, or "
        "clamp its output."
    )
    return (
        f"nanguard: step {step}: the `{tensor}` of `{module}` ({module_type}) reaches "
        f"{peak:.6g} in {dtype}, {share:.0f}% of its largest finite value {limit:.6g}: it is "
        f"about to overflow to Inf. {advice}"
    )


def amp_skip_message(
    step: int,
    before: float,
    after: float,
    consecutive: int,
    mine: bool = True,
    explained: bool = False,
    floor: float | None = None,
    weights: str | None = None,
    put_back: bool = False,
    unscaled: bool = False,
) -> str:
    """The sentence for a step GradScaler skipped (``mine``: this guard's optimizer's; else
    another optimizer's sharing the scaler, whose backward reached this model;
    ``explained``: the step's forward or loss already made the NaN/Inf, an origin, and
    ``put_back``: skip_step puts the scale back; ``unscaled``: its backward made NaN/Inf
    from unscaled gradients too;
    ``floor``: this run of skips took the scale down to ``amp_scale_floor`` already;
    ``weights``: the model's weights found non-finite, named)."""
    run = f" ({consecutive} in a row)" if consecutive > 1 else ""
    what = "this optimizer step" if mine else "another optimizer's step (not this guard's)"
    head = f"nanguard: step {step}: GradScaler skipped {what}{run}"
    if weights is not None:
        return f"{head}: {_dead_weights(weights, after)}"
    if floor is not None and not explained:
        return (
            f"{head}: the gradients were non-finite again at scale {before:g}, past the "
            f"floor (amp_scale_floor={floor:g}): not the occasional overflow a smaller scale "
            "fixes (the collapse event says where it was localised)."
        )
    if explained:
        scale = (
            f"scale does not fix it: on_nonfinite='skip_step' puts it back to {before:g}."
            if put_back
            else f"scale (now {after:g}) does not fix it."
        )
        held = (
            "a replay of its backward from unscaled gradients made NaN/Inf too (the origin event)"
            if unscaled
            else "this step's forward or loss already held NaN/Inf (the origin event)"
        )
        return (
            f"{head}: its gradients were non-finite, but not from the loss scaling: {held}, "
            f"so a smaller {scale}"
        )
    return (
        f"{head}: the scaled gradients were non-finite at scale {before:g}, taken for an "
        f"overflow; the scale is now {after:g}. Occasional skips are expected with float16 "
        "mixed precision and are not an error (if they go on until the scale reaches "
        "amp_scale_floor, nanguard localises the cause)."
    )


def _steps(n: int) -> str:
    return "1 step" if n == 1 else f"{n} steps"


def _dead_weights(weights: str, scale: float) -> str:
    return (
        f"the weights themselves are non-finite ({weights}; see the origin), so every step's "
        f"gradients are, whatever the scale (now {scale:g}): not an overflow, and training "
        "cannot recover by itself. Reload a checkpoint."
    )


def amp_collapse_message(
    step: int, scale: float, consecutive: int, floor: float, weights: str | None = None
) -> str:
    """The paragraph for a GradScaler whose scale collapses (or keeps backing off)."""
    if weights is not None:
        return (
            f"nanguard: step {step}: GradScaler has skipped {_steps(consecutive)} in a row: "
            f"{_dead_weights(weights, scale)}"
        )
    if scale > floor:
        # Still far above the floor: a large init_scale backing off, or a real problem.
        return (
            f"nanguard: step {step}: GradScaler has skipped {_steps(consecutive)} in a row; its "
            f"scale is now {scale:g}. A scale too large for the model backs off one halving "
            "per skipped step, so a run of skips at the start is normal; if it goes on until "
            "the scale "
            "reaches amp_scale_floor, nanguard localises the overflowing gradient. "
            "amp_max_skips sets how many skips in a row are tolerated."
        )
    return (
        f"nanguard: step {step}: GradScaler has skipped {_steps(consecutive)} in a row and its "
        f"scale fell to {scale:g} (floor {floor:g}): the gradients overflow even at a tiny "
        "scale, so this is not an overflow that scaling fixes. Something in the model makes "
        "Inf/NaN gradients (this step's origin event names where), or float16 cannot hold the "
        "model's activations or gradients (inputs not normalised; a bfloat16-pretrained model "
        "run in float16): switch to bfloat16 or keep the offending layers in float32."
    )


def amp_dead_message(step: int) -> str:
    """The paragraph for a GradScaler whose scale reached 0 (it cannot grow back)."""
    return (
        f"nanguard: step {step}: GradScaler's scale reached 0 after skipping every step: it "
        "can never grow back (each growth multiplies 0), so it skips every step from now on "
        "and training has stopped for good. Fix the origin nanguard named when the scale "
        "reached amp_scale_floor, then restart from a checkpoint."
    )


def stored_message(
    step: int,
    module: str,
    module_type: str,
    attribute: str,
    stats: TensorStats,
    loss_kind: str,
    op: OpInfo | None = None,
    user: str = "the loss",
) -> str:
    """The paragraph for a non-finite tensor a module kept as an attribute in its forward
    (an auxiliary loss) that the loss then used (``op``: the operation a replay found that
    made it; ``user``: what used it, when not the loss: the model's output)."""
    word = kind_word(stats_kind(stats), stats)
    advice = _advice(stats_kind(stats), stats)
    finite = " while the model's outputs were finite" if user == "the loss" else ""
    made = ""
    if op is not None:  # (the hint then says what to do about that operation)
        where = f" at {op.source}" if op.source else ""
        made = f" It was made by `{op.name}`{where}."
        advice = "that is the line to fix"
    return (
        f"nanguard: step {step}: {word} first appeared in the forward pass, in "
        f"{_label(module)} ({module_type}): its forward stored `self.{attribute}` "
        f"({stats.summary()}) as an attribute, not an output, so it was not checked there, "
        f"and {user} ({kind_word(loss_kind, None)}) is built on it{finite} (an auxiliary "
        f"loss: load balancing, a KL term).{made} Look at "
        f"{module_type}.forward where `{attribute}` is computed: {advice}."
    )


def stats_kind(stats: TensorStats) -> str:
    return "nan" if stats.nan_count else "inf"
