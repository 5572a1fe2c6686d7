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

The backward pass is walked in the order autograd produced the gradients:

6. The first non-finite gradient of a tensor was made by whoever consumed that
   tensor in the forward: the deepest module that received it and whose own
   output gradients were finite (its backward made the bad gradient), else the
   parent's own code that used it. A non-finite gradient arriving at the model's
   outputs was made by the loss's backward (phase ``"loss"``).
7. A module whose output gradients were finite but whose own parameters got
   non-finite gradients is an origin too, if its backward ran first.
8. A forward that already went non-finite makes its whole backward propagated.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection, Sequence
from typing import Final

from nanguard._checks import NAN, NEGINF, POSINF
from nanguard._probes import ForwardRecord, Frame, Item, LossRecord
from nanguard._tree import Path

__all__ = ["Finding", "analyze", "analyze_record"]


@dataclasses.dataclass
class Finding:
    """One conclusion about one item (a forward record or a loss) of the step.

    Attributes:
        item: index of the record in the step's items.
        reason: ``"input"`` (the batch), ``"own_code"`` (created in a parent's code
            between children), ``"output"`` (created by the module), ``"loss"``;
            in the backward ``"backward"`` (the module's backward made a bad input
            gradient), ``"backward_params"`` (...bad gradients of its own parameters),
            ``"own_code_backward"`` (the parent's own code) or ``"loss_backward"``.
        kind: ``"nan"`` or ``"inf"``.
        site: the offending tensor's site in the record.
        frame: the module call to blame (``None`` for a loss); for ``"input"`` the
            top-level call that received the batch.
        consumer: for ``"input"``/``"own_code"``, the call that received the tensor.
        is_origin: created here (``True``) or only reached here (``False``).
        independent: a second origin of the same forward, made from finite inputs.
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
    independent: bool = False  # an origin after another one of the same forward
    # An Inf from outside a module that its forward absorbed and its backward turned into
    # NaN: that module's call.
    absorbed_by: int | None = None
    # An Inf a parent's own code made and a child absorbed, found as the origin of the
    # backward origin ``instead_of`` (which it demoted): confirmed only if a replay sees
    # an operation of that forward make it (not a mask written before the forward).
    instead_of: Finding | None = None


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
    corrupted: Callable[[int], bool] = lambda frame: False,
    deliberate: Collection[int] = (),
    overflowed: Collection[int] = (),
    replayed: bool = False,
    reported: Callable[[int], bool] = lambda frame: False,
) -> tuple[Finding | None, list[Finding]]:
    """Find the origin of one forward, and the calls it propagated to.

    Args:
        record: what the hooks recorded.
        flags: per site, the NaN/+Inf/-Inf bits (0 for finite).
        item: index of the record, copied into the findings.
        is_mask_arg: whether a site entered its module through a mask-like argument.
        upstream_bad: an earlier forward of the same step already went non-finite,
            so a non-finite input batch is carried over rather than created.
        corrupted: whether frame ``i``'s module held non-finite parameters or
            buffers before the forward (then its non-finite output is not new).
        deliberate: sites whose -Inf a replay showed to be written on purpose
            (``masked_fill(mask, -inf)``): masks, like those passed as mask arguments.
        overflowed: sites whose -Inf a replay showed is no mask: made by arithmetic on
            finite values (float16 attention scores ``q @ k.T`` overflowing), or given to a
            module whose code made NaN/Inf of it by an operation that is no softmax (a
            log-SNR of -inf from a schedule's log(0) into a sinusoidal embedding).
        replayed: a replay will check the operation that made a -Inf (a mask written on
            purpose is then refuted as an origin, see ``deliberate``).
        reported: whether frame ``i``'s module holds weights found non-finite at an
            earlier resolution (a -Inf from the batch beside them is no news).

    Returns:
        The origin (or ``None``) and the propagated findings, in execution order.
    """
    frames = record.frames
    sites = record.sites
    pending: set[int] = set()  # non-finite from outside a module, not yet harmful
    intentional: set[int] = set(deliberate)
    bad: set[int] = set()
    origin: Finding | None = None
    propagated: list[Finding] = []
    tainted = False  # set once something non-finite is explained

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

    def made_from_finite(site: int) -> bool:
        # (not from what the maker was given: a -Inf, or a mask, probed by its max)
        maker = frames[sites[site].frame].parent
        return (
            maker >= 0
            and not any(flags[i] for i in frames[maker].inputs)
            and not any(is_mask_arg(record, maker, p) for p in frames[maker].input_paths)
        )

    for event in record.order:
        if event >= 0:  # a tensor first seen entering a module
            fl = flags[event]
            if not fl:
                continue
            consumer = sites[event].frame
            creator = frames[consumer].parent
            if event in intentional:
                continue
            carried = (
                next(
                    (
                        s
                        for s in frames[creator].inputs
                        if s in pending
                        and (
                            flags[s] & (NAN | POSINF)
                            # (-Inf a parent's code made from finite inputs: log(sigma) at
                            # 0, then cos(-inf) inside; not a mask the batch brought, and
                            # one written on purpose the replay refutes)
                            or (flags[s] & NEGINF and replayed and made_from_finite(s))
                            or s in overflowed  # (-Inf a replay showed is data, no mask)
                        )
                    ),
                    None,
                )
                if fl & NAN and creator >= 0 and origin is None and not tainted
                else None
            )
            if carried is not None:
                # The parent's code passed on NaN (or made it from a +Inf) that it received,
                # in the batch: that input is the origin, this value is downstream of it.
                pending.discard(carried)
                bad.update((carried, event))
                origin = from_outside(carried)
                tainted = True
            elif fl & NAN and creator >= 0:
                bad.add(event)  # made by the parent's code: an origin even if absorbed later
                if origin is None and not tainted and not corrupted(creator):
                    # (once tainted, e.g. by a child with NaN weights, it is downstream; so
                    # is a value the parent made from its own non-finite parameters)
                    origin = from_outside(event)
                tainted = True
            elif (not fl & (NAN | POSINF) and is_mask_arg(record, consumer, sites[event].path)) or (
                not fl & NAN and creator >= 0 and frames[creator].allow_inf
            ):  # a mask holds -inf on purpose, never +inf
                intentional.add(event)
            elif (
                tainted
                and creator >= 0
                and fl & (NAN | POSINF)  # (a mask written inside holds -inf, never +inf)
                and not frames[creator].allow_inf
                and not corrupted(creator)
                and _made_from_finite(frames, sites, creator, flags, intentional, bad, pending)
            ):
                # After an earlier origin of the forward, the parent's code made this from
                # finite values of its own (a MoE expert's SwiGLU product overflowing while the
                # router overflowed before it): a second origin, not what the first reached.
                bad.add(event)
                tainted = True
                independent = from_outside(event)
                independent.independent = True
                propagated.append(independent)
            elif tainted or (creator < 0 and upstream_bad):
                bad.add(event)
                # (a batch carrying an earlier forward's NaN, a rollout feeding its output
                # back: what this forward makes of it is downstream too)
                tainted = True
            else:
                # Inf made outside a module, or NaN in the batch (missing values a model
                # may impute itself): an origin only once it reaches a non-finite output.
                pending.add(event)
            continue

        index = ~event  # a module call returned
        frame = frames[index]
        for s, path in zip(frame.inputs, frame.input_paths, strict=True):
            if s in pending and not flags[s] & (NAN | POSINF) and is_mask_arg(record, index, path):
                pending.discard(s)  # passed on as a mask: intentional after all
                intentional.add(s)
        outs = [o for o in frame.outputs if flags[o] and o not in intentional]
        if not outs:
            continue
        waiting = next((s for s in (*frame.inputs, *outs) if s in pending), None)
        if (
            waiting is not None
            and frame.hooked.type_name in _SOFTMAXES
            and flags[waiting] & NEGINF
            and not flags[waiting] & (NAN | POSINF)
            and any(flags[o] & NAN for o in outs)
            and waiting not in overflowed
        ):
            # An nn.Softmax child over scores its parent masked with -inf: NaN on a row
            # where every position is masked. The softmax made it; the -inf was a mask.
            pending.discard(waiting)
            intentional.add(waiting)
            waiting = None
        if waiting is not None:
            # (A call that also received a value already bad, from weights gone non-finite
            # before it, or in which such a value went on (the model's own return): that
            # explains its output, not the -Inf waiting beside it.)
            explained = any(s in bad for s in frame.inputs) or (
                tainted
                and not flags[waiting] & (NAN | POSINF)
                and any(_inside(frames, sites[s].frame, index) for s in bad)
            )
            # An Inf made outside a module reached a non-finite output: it mattered.
            pending.discard(waiting)
            bad.add(waiting)
            maker = frames[sites[waiting].frame].parent
            carried = (
                next(
                    (
                        s
                        for s in frames[maker].inputs
                        if s in pending and (flags[s] & POSINF or s in overflowed)
                    ),
                    None,
                )
                if maker >= 0
                else None
            )
            if carried is not None:
                # The parent's code passed on a +Inf it received (never a mask's value), or a
                # -Inf a replay showed is data: that input is where it came from.
                pending.discard(carried)
                bad.add(carried)
                waiting = carried
                maker = frames[sites[waiting].frame].parent
            # (A -Inf from the batch, a mask as likely as not: the call it reached holding
            # weights already non-finite, or, for a sentinel step, the model holding them
            # anywhere, explains the output. A NaN or +Inf batch is news whatever the weights.)
            masklike = not flags[waiting] & (NAN | POSINF)
            made_by_corrupted = corrupted(maker) if maker >= 0 else masklike and reported(index)
            if (
                origin is None
                and not (maker < 0 and upstream_bad)
                and not made_by_corrupted
                and not explained
            ):
                origin = from_outside(waiting)
            tainted = True
            bad.update(outs)
            propagated.append(_propagated(item, index, outs[0], flags))
            continue
        if (
            tainted
            and frame.inputs
            and not any(
                (flags[s] and s not in intentional) or s in bad or s in pending
                for s in frame.inputs
            )
            and not corrupted(index)
            and not frame.allow_inf
            and not any(_inside(frames, sites[s].frame, index) for s in bad)
        ):
            # Every input this call received was finite, and so were its parameters, and
            # nothing inside it had gone non-finite: it made its non-finite output itself,
            # whatever went wrong before it (a sibling projection overflowing from the same
            # input).
            bad.update(outs)
            nan_out = next((o for o in outs if flags[o] & NAN), None)
            propagated.append(
                Finding(
                    item=item,
                    reason="output",
                    kind="nan" if nan_out is not None else "inf",
                    site=nan_out if nan_out is not None else outs[0],
                    frame=index,
                    independent=True,
                )
            )
            continue
        if tainted or any(s in bad for s in frame.inputs) or corrupted(index):
            # Explained by an origin, by a non-finite input, or by parameters that were
            # already non-finite: everything from here on is downstream.
            tainted = True
            bad.update(outs)
            propagated.append(_propagated(item, index, outs[0], flags))
            continue
        nan_out = next((o for o in outs if flags[o] & NAN), None)
        if nan_out is None and (frame.allow_inf or any(s in intentional for s in frame.inputs)):
            intentional.update(outs)  # a mask made or passed on by this module
            continue
        bad.update(outs)
        tainted = True
        origin = Finding(
            item=item,
            reason="output",
            kind="nan" if nan_out is not None else "inf",
            site=nan_out if nan_out is not None else outs[0],
            frame=index,
        )
    if (
        origin is None
        and pending
        and record.raised is not None
        and record.raised_about
        and not upstream_bad
    ):
        # The forward raised before returning (torch.distributions refusing a NaN argument):
        # what was waiting to matter did. The first of it, in execution order.
        first = next((s for s in record.order if s in pending), None)
        if first is not None:
            origin = from_outside(first)
    if origin is not None:
        origin.propagated = [
            p.frame for p in propagated if p.frame is not None and not p.independent
        ]
    return origin, propagated


#: Modules that make NaN of a row that is all -inf (a fully masked attention row).
_SOFTMAXES: Final = frozenset({"Softmax", "LogSoftmax", "Softmin"})


def _made_from_finite(
    frames: Sequence[Frame],
    sites: Sequence[object],
    frame: int,
    flags: Sequence[int],
    intentional: Collection[int],
    bad: Collection[int],
    pending: Collection[int],
) -> bool:
    """Whether every input of call ``frame`` was finite (or a mask) and nothing inside it
    had gone non-finite yet: what its own code makes now, it makes from finite values."""
    inputs = frames[frame].inputs
    if not inputs:
        return False
    if any((flags[s] and s not in intentional) or s in bad or s in pending for s in inputs):
        return False
    return not any(_inside(frames, sites[s].frame, frame) for s in bad)  # type: ignore[attr-defined]


def _inside(frames: Sequence[Frame], frame: int, ancestor: int) -> bool:
    """Whether call ``frame`` is ``ancestor`` or ran inside it."""
    while frame >= 0:
        if frame == ancestor:
            return True
        frame = frames[frame].parent
    return False


def _never(frame: int) -> bool:
    return False


def _propagated(item: int, frame: int, site: int, flags: Sequence[int]) -> Finding:
    return Finding(
        item=item, reason="output", kind=_kind(flags[site]), site=site, frame=frame, is_origin=False
    )


def _made_in(frames: Sequence[Frame], op: object, frame: int) -> bool:
    """Whether the forward of ``frames[frame]``'s module created the autograd node of the
    backward operation ``op`` (a replay's: the forward lines that created it, outermost
    first, ``op.where``), or a function it called did."""
    where = getattr(op, "where", ())
    if not where or frame >= len(frames):
        return False
    code = getattr(getattr(type(frames[frame].module), "forward", None), "__code__", None)
    if code is None:
        return False
    lines = [line for _, _, line in code.co_lines() if line is not None]
    first, last = code.co_firstlineno, max(lines, default=code.co_firstlineno)
    return any(file == code.co_filename and first <= line <= last for file, line in where)


def _depths(record: ForwardRecord) -> list[int]:
    depths: list[int] = []
    for frame in record.frames:  # parents come before their children
        depths.append(0 if frame.parent < 0 else depths[frame.parent] + 1)
    return depths


def analyze_backward(
    record: ForwardRecord,
    grads: Sequence[tuple[int, int]],
    item: int,
    bad_param_grads: Callable[..., bool],
    propagated_only: bool,
    param_candidates: bool = True,
) -> tuple[Finding | None, list[Finding]]:
    """Find where the backward of one forward first made a non-finite gradient.

    Args:
        record: the forward, with its frames and sites.
        grads: ``(site, flags)`` for each gradient probe, in backward order.
        item: index of the record, copied into the findings.
        bad_param_grads: ``(i, tied=True)``: whether frame ``i``'s module has non-finite
            gradients in its own parameters (``tied=False``: leaving out parameters held
            by several modules, whose gradient sums every use).
        propagated_only: the forward already went non-finite; nothing here is new.
        param_candidates: whether this backward may have made the bad parameter gradients
            (with several backwards per step, only one whose gradients went bad did).

    Returns:
        The origin (or ``None``) and the propagated findings, in backward order.
    """
    frames = record.frames
    sites = record.sites
    made_in = functools.partial(_made_in, frames, record.ops.get(-1))
    consumers: dict[int, list[int]] = {}
    for index, frame in enumerate(frames):
        for site in frame.inputs:
            consumers.setdefault(site, []).append(index)
    # The model's outputs (but those whose bad gradient its own code made: a replay saw it).
    top_outputs = {
        s for f in frames if f.parent < 0 for s in f.outputs if s not in record.internal_outputs
    }
    depths = _depths(record)
    # With several backward passes through one forward (retain_graph=True: a second loss
    # term's), a site's gradient arrives once in each: bad if it was bad in any, and when
    # it first arrived so (else when it first arrived).
    arrived: dict[int, int] = {}  # site -> flags of its gradient
    position: dict[int, int] = {}  # site -> when its gradient arrived
    for n, (site, fl) in enumerate(grads):
        if site not in arrived or (fl and not arrived[site]):
            arrived[site] = fl
            position[site] = n

    def outputs_clean(frame: int, besides: int = -1) -> bool:
        """Gradients reached the call's outputs, all finite. ``besides``: an output that
        is also the input in question (a module returning its input)."""
        outputs = [o for o in frames[frame].outputs if o != besides]
        return any(o in arrived for o in outputs) and not any(arrived.get(o, 0) for o in outputs)

    def never_bad(frame: int) -> bool:
        return not any(arrived.get(o, 0) for o in frames[frame].outputs)

    calls: dict[int, list[int]] = {}  # a module's calls share its parameters' gradients
    for index, frame in enumerate(frames):
        calls.setdefault(id(frame.hooked), []).append(index)

    # Modules whose own parameters got bad gradients while their output gradients
    # were seen and fine: their backward made it, when their output gradients arrived.
    # A module called several times qualifies only if no call got a bad gradient: its
    # parameters' gradients sum over the calls, and a bad one explains them.
    # A bad gradient inside the module (at a submodule's site) explains its parameters'
    # gradients too (a ViT's cls_token, used before the blocks, gets theirs last).
    bad_frames = {sites[s].frame for s, fl in arrived.items() if fl}

    def inner_bad(index: int) -> bool:
        for bad in bad_frames:
            parent = frames[bad].parent
            while parent >= 0:
                if parent == index:
                    return True
                parent = frames[parent].parent
        return False

    # A tied weight's bad gradient names none of its users while a bad gradient flowed
    # through the model (that one explains it); alone, its first user in the backward.
    tied = not bad_frames
    candidates = []
    for index, frame in enumerate(frames):
        if (
            param_candidates
            and bad_param_grads(index, tied=tied)
            and outputs_clean(index)
            and all(never_bad(c) for c in calls[id(frame.hooked)])
            and not any(inner_bad(c) for c in calls[id(frame.hooked)])
        ):
            when = max((position[o] for o in frame.outputs if o in position), default=-1)
            candidates.append((when, -depths[index], index))
    param_first = min(candidates, default=None)

    origin: Finding | None = None
    propagated: list[Finding] = []
    graded = {site for site, _ in grads}  # the sites a gradient reached
    # Calls whose own code carried a bad gradient (a tensor it made and passed to a child
    # got one): what else that code made or read may have got it from there, unseen.
    tainted: set[int] = set()
    for n, (site, fl) in enumerate(grads):
        if not fl:
            continue
        kind = _kind(fl)
        where = sites[site].frame
        if sites[site].role == "output":
            # (the outermost call that returned it as it is: whose caller's code reads it)
            while frames[where].parent >= 0 and site in frames[frames[where].parent].outputs:
                where = frames[where].parent
        scope = frames[where].parent if sites[site].role == "output" or where > 0 else -1
        if origin is not None and not propagated_only and scope not in tainted:
            # After the origin, a module whose backward made NaN from finite output gradients
            # again, reached by nothing bad (every reader of this gradient's tensor sent
            # finite ones back): a second origin (q_norm beside k_norm, both dividing by a
            # zero norm), not what the first reached.
            # (a reader holding the origin, or a bad gradient inside it, explains this one:
            # a Pooler around the norm passed the NaN back to what it was given)
            readers = [
                c
                for c in consumers.get(site, ())
                if not never_bad(c)
                or inner_bad(c)
                or (origin.frame is not None and _inside(frames, origin.frame, c))
            ]
            # (not the origin's module called again: that is one cause, made again)
            clean = [
                c
                for c in consumers.get(site, ())
                if outputs_clean(c, besides=site)
                and not (
                    origin.frame is not None and frames[c].hooked is frames[origin.frame].hooked
                )
            ]
            if clean and not readers and site not in record.loss_bad_outputs:
                deepest = max(clean, key=lambda c: (depths[c], c))
                if deepest != origin.frame:
                    second = Finding(item, "backward", kind, site, deepest, consumer=deepest)
                    second.independent = True
                    propagated.append(second)
                    continue
        if sites[site].role == "input" and where > 0:
            tainted.add(frames[where].parent)  # (made in that parent's code, which carried it)
        if origin is not None or propagated_only:
            receiver = sites[site].frame if sites[site].role == "output" else None
            if receiver is not None:
                propagated.append(Finding(item, "backward", kind, site, receiver, is_origin=False))
            continue
        if param_first is not None and param_first[0] < n:
            origin = Finding(item, "backward_params", "nan", -1, param_first[2])
            receiver = sites[site].frame if sites[site].role == "output" else None
            if receiver is not None:  # this gradient is downstream of it
                propagated.append(Finding(item, "backward", kind, site, receiver, is_origin=False))
            continue
        loss_made = site in record.loss_bad_outputs  # (the model used it too)
        clean = [
            c for c in consumers.get(site, ()) if not loss_made and outputs_clean(c, besides=site)
        ]
        if clean:
            # Several calls read it (SchNet's rbf(r) and cutoff(r)): the one whose forward
            # made the node whose backward went bad, when a replay named that node.
            made = [c for c in clean if made_in(c)] if len(clean) > 1 else []
            chosen = max(made, key=lambda c: (depths[c], c)) if made else None
            if chosen is not None and any(
                _inside(frames, o, chosen) for o in clean if o not in made
            ):
                chosen = None  # (made in a parent's own code, beside its child: see below)
            deepest = chosen if chosen is not None else max(clean, key=lambda c: (depths[c], c))
            origin = Finding(item, "backward", kind, site, deepest, consumer=deepest)
        elif site in top_outputs or loss_made:
            origin = Finding(item, "loss_backward", kind, site, None)
        else:
            # No module consumed it with finite output gradients: the code that used it
            # did. An input is used by the call it entered; an output by the caller.
            first = sites[site].frame
            if sites[site].role == "input":
                owner = first
            else:  # the caller of the outermost call that returned it as it is, unless
                # a call on the way used it for another of its outputs (a replay saw which;
                # without one, a call returning more than it may have)
                uses = record.frame_uses
                owner = frames[first].parent
                while (
                    owner >= 0
                    and site in frames[owner].outputs
                    and (
                        (owner, site) not in uses
                        # (...for outputs that no gradient reached: a BertModel's pooler
                        # output the caller did not use cannot have sent one back)
                        or not any(o in graded for o in frames[owner].outputs if o != site)
                        if uses is not None
                        else frames[owner].outputs == [site]
                    )
                ):
                    owner = frames[owner].parent
                # A call that returned it and made the node whose backward went bad (a
                # distance module returning (r, vec), vec used for r): that call's code.
                makers = [
                    i for i in range(first, len(frames)) if site in frames[i].outputs and made_in(i)
                ]
                if makers and owner not in makers:
                    owner = max(makers, key=lambda i: (depths[i], i))
            if site in record.internal_outputs:
                # Returned by the model and used by a call's own code: the deepest that
                # returned it together with an output computed from it, else the model.
                owner = max(
                    (
                        i
                        for i, f in enumerate(frames)
                        if site in f.outputs and (i, site) in (record.frame_uses or ())
                    ),
                    key=lambda i: (depths[i], i),
                    default=0,
                )
            origin = Finding(
                item, "own_code_backward", kind, site, owner if owner >= 0 else None,
                consumer=first,
            )  # fmt: skip
        receiver = sites[site].frame if sites[site].role == "output" else None
        if origin.reason != "loss_backward" and receiver is not None and receiver != origin.frame:
            # The call that returned the tensor gets its bad gradient next.
            propagated.append(Finding(item, "backward", kind, site, receiver, is_origin=False))
    if origin is None and param_first is not None and not propagated_only:
        origin = Finding(item, "backward_params", "nan", -1, param_first[2])
    if origin is not None:
        origin.propagated = [
            p.frame for p in propagated if p.frame is not None and not p.independent
        ]
    return origin, propagated


def analyze(
    items: Sequence[Item],
    flags: Sequence[Sequence[int]],
    is_mask_arg: MaskArg,
    grads: Sequence[Sequence[tuple[int, int]]] = (),
    bad_param_grads: Callable[..., bool] = lambda item, frame, tied=True: False,
    upstream: Callable[[int, int], bool] = lambda item, frame: False,
    deliberate: Collection[tuple[int, int]] = (),
    stale: Callable[[int], bool] = lambda item: False,
    overflowed: Collection[tuple[int, int]] = (),
    replayed: bool = False,
    known: Callable[[int, int], bool] = lambda item, frame: False,
    bad_before: bool = False,
) -> list[Finding]:
    """Findings of one step, in execution order: origins and what they reached.

    Args:
        items: the step's records, in the order they completed.
        flags: per item, per site, the NaN/Inf bits of the forward.
        is_mask_arg: see :func:`analyze_record`.
        grads: per item, ``(site, flags)`` of its gradient probes in backward order.
        bad_param_grads: ``(item, frame)`` -> whether the frame's module has
            non-finite gradients in its own parameters.
        upstream: ``(item, frame)`` -> whether the frame's module already holds
            non-finite parameters or buffers (corrupted before this forward).
        deliberate: ``(item, site)`` pairs whose -Inf was written on purpose.
        overflowed: ``(item, site)`` pairs whose -Inf an overflow made (no mask).
        stale: ``item`` -> whether an optimizer step changed the weights after that
            forward (``guard.step()`` after ``optimizer.step()``, or a closure optimizer):
            weights found corrupted now may have been finite then, so they only count as
            upstream of it once the step had gone non-finite before it...
        known: ...or when they were found non-finite at an earlier resolution already
            (``(item, frame)`` -> whether the frame's module holds such weights).
        bad_before: an earlier resolution of this step (``guard.check()``) found its forward
            non-finite: a loss after it carries that.
    """
    findings: list[Finding] = []
    last_origin: Finding | None = None
    step_bad = bad_before
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
        origin, propagated = analyze_record(
            item,
            flags[index],
            index,
            is_mask_arg,
            step_bad,
            functools.partial(upstream if step_bad or not stale(index) else known, index),
            {site for i, site in deliberate if i == index},
            {site for i, site in overflowed if i == index},
            replayed,
            functools.partial(known, index),
        )
        if origin is not None:
            findings.append(origin)
            last_origin = origin
        findings.extend(propagated)
        if origin is not None or propagated:
            step_bad = True
    # The backward runs after every forward and the loss of the step. Bad parameter
    # gradients (accumulated over every backward of the step) are only laid at the door of a
    # backward whose own gradients went non-finite, when one did, and never at one whose
    # replay made finite parameter gradients.
    went_bad = {i for i, per in enumerate(grads) if any(fl for _, fl in per)}
    for index, item in enumerate(items):
        if isinstance(item, LossRecord) or index >= len(grads) or not grads[index]:
            continue
        origin, propagated = analyze_backward(
            item,
            grads[index],
            index,
            functools.partial(bad_param_grads, index),
            propagated_only=step_bad,
            param_candidates=(not went_bad or index in went_bad)
            and item.param_grads_finite is not True,
        )
        if origin is not None and not step_bad:
            written = {site for i, site in deliberate if i == index}
            inf_input = _inf_input(item, flags[index], origin, is_mask_arg, written)
            if inf_input is not None:
                origin.is_origin = False  # (its backward turned that Inf into NaN)
                findings.append(inf_input)
        if origin is not None:
            findings.append(origin)
        findings.extend(propagated)
    return findings


def _inf_input(
    record: ForwardRecord,
    flags: Sequence[int],
    origin: Finding,
    is_mask_arg: MaskArg,
    deliberate: Collection[int] = (),
) -> Finding | None:
    """A module whose backward made the first NaN of a finite step, while its forward took
    an Inf from outside it (a log of a zero count, in the batch or in its parent's code)
    and absorbed it (saturating gates): the Inf is where it began, not the module."""
    if origin.reason == "own_code_backward" and origin.frame is not None:
        return _own_inf(record, flags, origin, is_mask_arg, deliberate)
    # Only parameter gradients: an Inf input multiplies into the weight gradient (x^T @ g),
    # never into the input gradient (g @ W); a NaN input gradient has another cause.
    if origin.reason != "backward_params" or origin.frame is None:
        return None
    frames, sites = record.frames, record.sites
    frame = frames[origin.frame]
    if frame.allow_inf:
        return None
    for site, path in zip(frame.inputs, frame.input_paths, strict=True):
        fl = flags[site] if site < len(flags) else 0
        if not fl or fl & NAN or site in deliberate or site in record.buffer_sites:
            continue  # (a mask: -inf written on purpose, or kept as a buffer)
        if is_mask_arg(record, origin.frame, path):
            continue
        consumer = sites[site].frame
        if consumer < 0 or sites[site].role != "input":
            continue
        if is_mask_arg(record, consumer, sites[site].path):
            continue  # (a mask where it entered the model: passed on under another name)
        creator = frames[consumer].parent
        if creator >= 0 and frames[creator].allow_inf:
            continue
        return Finding(
            item=origin.item,
            reason="input" if creator < 0 else "own_code",
            kind="inf",
            site=site,
            frame=consumer if creator < 0 else creator,
            consumer=consumer,
            absorbed_by=origin.frame,
        )
    # (Or its own code made the Inf, and a child absorbed it: ``log(counts * self.scale)``
    # into a sigmoid gate, whose backward makes 0/0 in ``scale``'s gradient.)
    return _own_inf(record, flags, origin, is_mask_arg, deliberate)


def _own_inf(
    record: ForwardRecord,
    flags: Sequence[int],
    origin: Finding,
    is_mask_arg: MaskArg,
    deliberate: Collection[int],
) -> Finding | None:
    """A parent's own code (or its own parameters) whose backward made the first NaN of a
    finite step, after that code made an Inf that a child absorbed (``x / d`` at ``d = 0``
    into a tanh, whose derivative at Inf is 0, then ``DivBackward`` makes 0/0): the Inf, in
    the forward, is where it began. Not a mask: -inf passed to a softmax, or written on
    purpose."""
    frames, sites = record.frames, record.sites
    owner = origin.frame
    if owner is None or frames[owner].allow_inf:
        return None
    for site in record.order:
        if site < 0 or site >= len(flags) or sites[site].role != "input":
            continue
        fl = flags[site]
        if not fl or fl & NAN or site in deliberate or site in record.buffer_sites:
            continue
        consumer = sites[site].frame
        if consumer < 0 or frames[consumer].parent != owner:
            continue
        if is_mask_arg(record, consumer, sites[site].path):
            continue
        if not fl & POSINF and frames[consumer].hooked.type_name in _SOFTMAXES:
            continue  # (scores masked with -inf, into a softmax)
        return Finding(
            item=origin.item, reason="own_code", kind="inf", site=site, frame=owner,
            consumer=consumer, instead_of=origin,
        )  # fmt: skip
    return None
