"""Human-readable reports: what was found, where, and what to look at next.

Rendering is kept apart from the data (``Event``) and from the analysis, so each
message can be tested exactly.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from nanguard._events import TensorStats

__all__ = ["Origin", "origin_message", "propagated_message", "kind_word"]

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
    mask_inputs: Sequence[str] = ()
    nonfinite_params: Sequence[str] = ()
    propagated: Sequence[str] = ()
    n_propagated: int = 0
    loss_propagated: bool = False
    stats_problem: str | None = None


def _described(o: Origin) -> str:
    if o.stats is not None:
        return o.stats.summary()
    shape = "(" + ", ".join(str(d) for d in o.shape) + ")"
    text = f"{kind_word(o.kind)} values (shape {shape}, {o.dtype})"
    if o.stats_problem:
        text += f"; exact statistics unavailable: {o.stats_problem}"
    return text


def _propagation(o: Origin) -> str:
    if not o.n_propagated:
        loss = " but the loss" if o.loss_propagated else ""
        return f"It reached no other checked module{loss}."
    shown = ", ".join(f"`{n}`" if n else "the model" for n in o.propagated)
    more = o.n_propagated - len(o.propagated)
    tail = f" and {more} more" if more > 0 else ""
    loss = ", then the loss" if o.loss_propagated else ""
    calls = "call" if o.n_propagated == 1 else "calls"
    return f"It then reached {o.n_propagated} module {calls} ({shown}{tail}){loss}."


def origin_message(o: Origin) -> str:
    """The paragraph for an origin event."""
    word = kind_word(o.kind, o.stats)
    head = f"nanguard: step {o.step}:"
    if o.reason == "input":
        return (
            f"{head} the input batch already contains {word}: `{o.tensor}` passed to "
            f"{_label(o.module or '')} ({o.module_type}) has {_described(o)}. No layer "
            f"created it. {_propagation(o)} Check the data pipeline: missing values read as "
            "NaN, a normalisation dividing by a zero standard deviation, log of zero, a "
            "corrupt sample."
        )
    if o.reason == "loss":
        return (
            f"{head} the loss is {word} ({_described(o)}) while the model's outputs were "
            "finite: the loss function created it. Look at the loss computation: log of 0 "
            "(log(softmax(x)) instead of log_softmax), a division by a zero count or norm, "
            "sqrt at 0, targets out of range."
        )
    if o.reason == "own_code":
        return (
            f"{head} {word} was created in the own code of {_label(o.module or '')} "
            f"({o.module_type}.forward{_call(o.call)}), between its submodules: the tensor "
            f"it passed to `{o.consumer}` as `{o.tensor}` has {_described(o)}, while "
            f"everything it received and every submodule it called before returned finite "
            f"values. {_propagation(o)} Look at the operations in {o.module_type}.forward "
            f"before the call to `{o.consumer}`: {_advice(o.kind, o.stats)}."
        )
    inputs = ""
    if o.inputs:
        ranges = "; ".join(
            f"{label} in [{s.min:.4g}, {s.max:.4g}]" if s.min is not None else label
            for label, s in o.inputs
        )
        inputs = f" ({ranges})"
    text = (
        f"{head} {word} first appeared in the forward pass, in {_label(o.module or '')} "
        f"({o.module_type}{_call(o.call)}): its inputs were finite{inputs} and its "
        f"`{o.tensor}` has {_described(o)}. {_propagation(o)}"
    )
    if o.nonfinite_params:
        names = ", ".join(f"`{p}`" for p in o.nonfinite_params)
        return (
            f"{text} Its own parameters are not finite ({names}): they were corrupted "
            "before this forward (an earlier optimizer step, a bad checkpoint); this forward "
            "only reveals it."
        )
    if o.mask_inputs and o.kind == "nan":
        masks = ", ".join(f"`{m}`" for m in o.mask_inputs)
        return (
            f"{text} It received -inf through {masks}: a row in which every position is "
            "masked gives NaN in softmax (a fully masked sample, e.g. an empty sequence or "
            f"a padding mask that hides everything). Else look at {o.module_type}.forward: "
            f"{_advice(o.kind, o.stats)}."
        )
    return f"{text} Look at {o.module_type}.forward: {_advice(o.kind, o.stats)}."


def propagated_message(
    step: int, kind: str, where: str, module_type: str | None, origin: str | None
) -> str:
    """The sentence for a call that a non-finite value only passed through."""
    word = kind_word(kind)
    what = f"{where} ({module_type})" if module_type else where
    source = f"; it was created earlier, in {origin}" if origin else ""
    return f"nanguard: step {step}: {word} reached {what}{source} (propagated, not an origin)."
