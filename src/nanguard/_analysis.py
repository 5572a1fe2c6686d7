"""Pure functions from resolved probes to findings: where was the value created?

No hooks, no I/O, no tensors: the input is what the hooks recorded (frames,
sites, execution order) and one int of flags per site (see ``_checks``).

The rules, walking one forward in execution order:

1. A tensor first seen entering a module was created by the caller's own code
   (the parent module, between two children) or, for a top-level call, is the
   input batch. NaN there is an origin at once.
2. A module call whose inputs are finite and whose output is not is the origin:
   a child returns before its parent, so the deepest module wins.
3. +/-Inf may be intentional: additive attention masks. Inf that enters through
   a mask-like argument (``attn_mask``, ``src_mask``, ``position_bias``...) or that
   comes out of an ``allow_inf`` module is never reported; a NaN born from it (a
   fully masked attention row) blames the module that made the NaN. Any other Inf
   created outside a module is reported only when it reaches a non-finite output
   (an Inf that the next module absorbs is harmless).
4. Everything after the origin is propagated; one origin per forward.
5. A loss that is non-finite while the step's forwards were clean is an origin
   with phase ``"loss"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from nanguard._checks import NAN
from nanguard._probes import ForwardRecord, Item, LossRecord
from nanguard._tree import Path

__all__ = ["Finding", "analyze", "analyze_record"]


@dataclasses.dataclass
class Finding:
    """One conclusion about one item (a forward record or a loss) of the step.

    Attributes:
        item: index of the record in the step's items.
        reason: ``"input"`` (the batch), ``"own_code"`` (created in a parent's code
            between children), ``"output"`` (created by the module) or ``"loss"``.
        kind: ``"nan"`` or ``"inf"``.
        site: the offending tensor's site in the record.
        frame: the module call to blame (``None`` for a loss); for ``"input"`` the
            top-level call that received the batch.
        consumer: for ``"input"``/``"own_code"``, the call that received the tensor.
        is_origin: created here (``True``) or only reached here (``False``).
        propagated: for an origin, the calls reached afterwards, in order.
        loss_propagated: for an origin, whether a checked loss became non-finite too.
    """

    item: int
    reason: str
    kind: str
    site: int
    frame: int | None
    consumer: int | None = None
    is_origin: bool = True
    propagated: list[int] = dataclasses.field(default_factory=list)
    loss_propagated: bool = False


#: ``is_mask_arg(record, frame, path)``: was this input passed as a mask-like argument?
MaskArg = Callable[[ForwardRecord, int, Path], bool]


def _kind(flags: int) -> str:
    return "nan" if flags & NAN else "inf"


def analyze_record(
    record: ForwardRecord,
    flags: Sequence[int],
    item: int,
    is_mask_arg: MaskArg,
    upstream_bad: bool = False,
) -> tuple[Finding | None, list[Finding]]:
    """Find the origin of one forward, and the calls it propagated to.

    Args:
        record: what the hooks recorded.
        flags: per site, the NaN/+Inf/-Inf bits (0 for finite).
        item: index of the record, copied into the findings.
        is_mask_arg: whether a site entered its module through a mask-like argument.
        upstream_bad: an earlier forward of the same step already went non-finite,
            so a non-finite input batch is carried over rather than created.

    Returns:
        The origin (or ``None``) and the propagated findings, in execution order.
    """
    frames = record.frames
    sites = record.sites
    pending: set[int] = set()  # Inf created outside a module, not yet harmful
    intentional: set[int] = set()
    bad: set[int] = set()
    origin: Finding | None = None
    propagated: list[Finding] = []

    def from_outside(site: int) -> Finding:
        consumer = sites[site].frame
        creator = frames[consumer].parent
        return Finding(
            item=item,
            reason="input" if creator < 0 else "own_code",
            kind=_kind(flags[site]),
            site=site,
            frame=consumer if creator < 0 else creator,
            consumer=consumer,
        )

    for event in record.order:
        if event >= 0:  # a tensor first seen entering a module
            fl = flags[event]
            if not fl:
                continue
            consumer = sites[event].frame
            creator = frames[consumer].parent
            if fl & NAN:
                bad.add(event)
                if origin is None and not (creator < 0 and upstream_bad):
                    origin = from_outside(event)
            elif is_mask_arg(record, consumer, sites[event].path) or (
                creator >= 0 and frames[creator].allow_inf
            ):
                intentional.add(event)
            elif origin is not None or (creator < 0 and upstream_bad):
                bad.add(event)
            else:
                pending.add(event)
            continue

        index = ~event  # a module call returned
        frame = frames[index]
        outs = [o for o in frame.outputs if flags[o] and o not in intentional]
        if not outs:
            continue
        waiting = next((s for s in (*frame.inputs, *outs) if s in pending), None)
        if waiting is not None:
            # An Inf made outside a module reached a non-finite output: it mattered.
            pending.discard(waiting)
            bad.add(waiting)
            if origin is None and not (frames[sites[waiting].frame].parent < 0 and upstream_bad):
                origin = from_outside(waiting)
            bad.update(outs)
            propagated.append(_propagated(item, index, outs[0], flags))
            continue
        if origin is not None or any(s in bad for s in frame.inputs):
            bad.update(outs)
            propagated.append(_propagated(item, index, outs[0], flags))
            continue
        nan_out = next((o for o in outs if flags[o] & NAN), None)
        if nan_out is None and (frame.allow_inf or any(s in intentional for s in frame.inputs)):
            intentional.update(outs)  # a mask made or passed on by this module
            continue
        bad.update(outs)
        origin = Finding(
            item=item,
            reason="output",
            kind="nan" if nan_out is not None else "inf",
            site=nan_out if nan_out is not None else outs[0],
            frame=index,
        )
    if origin is not None:
        origin.propagated = [p.frame for p in propagated if p.frame is not None]
    return origin, propagated


def _propagated(item: int, frame: int, site: int, flags: Sequence[int]) -> Finding:
    return Finding(
        item=item, reason="output", kind=_kind(flags[site]), site=site, frame=frame, is_origin=False
    )


def analyze(
    items: Sequence[Item], flags: Sequence[Sequence[int]], is_mask_arg: MaskArg
) -> list[Finding]:
    """Findings of one step, in execution order: origins and what they reached.

    Args:
        items: the step's records, in the order they completed.
        flags: per item, per site, the NaN/Inf bits.
        is_mask_arg: see :func:`analyze_record`.
    """
    findings: list[Finding] = []
    last_origin: Finding | None = None
    step_bad = False
    for index, item in enumerate(items):
        if isinstance(item, LossRecord):
            fl = flags[index][0]
            if not fl:
                continue
            if step_bad:
                findings.append(Finding(index, "loss", _kind(fl), 0, None, is_origin=False))
                if last_origin is not None:
                    last_origin.loss_propagated = True
            else:
                last_origin = Finding(index, "loss", _kind(fl), 0, None)
                findings.append(last_origin)
            step_bad = True
            continue
        origin, propagated = analyze_record(item, flags[index], index, is_mask_arg, step_bad)
        if origin is not None:
            findings.append(origin)
            last_origin = origin
        findings.extend(propagated)
        if origin is not None or propagated:
            step_bad = True
    return findings
