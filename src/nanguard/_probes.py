"""What the hooks record during a step: module calls (frames), probed tensors (sites).

These are plain slotted classes, built in the hot path; the analysis reads them
after the once-per-step resolution. Nothing here touches tensor values.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from nanguard._events import TensorStats
from nanguard._tree import Path, format_path

__all__ = [
    "Frame",
    "HookedModule",
    "Site",
    "ForwardRecord",
    "LossRecord",
    "Replay",
    "Item",
    "input_label",
    "site_label",
]


class Frame:
    """One call of one module inside a forward."""

    __slots__ = ("call", "hooked", "input_paths", "inputs", "output_paths", "outputs", "parent")

    def __init__(
        self, hooked: HookedModule, call: int, parent: int, inputs: list[int], paths: list[Path]
    ) -> None:
        self.hooked = hooked
        self.call = call
        self.parent = parent  # index of the calling frame, -1 for a top-level call
        self.inputs = inputs  # site indices (probed here, or seen earlier)
        self.input_paths = paths  # how each input was passed: ("args", 0), ("kwargs", "mask")
        self.outputs: list[int] = []
        # Where each output sits in what a top-level call returned (None for the others).
        self.output_paths: list[Path] | None = None

    @property
    def module(self) -> nn.Module:
        return self.hooked.module

    @property
    def name(self) -> str:
        return self.hooked.name

    @property
    def type_name(self) -> str:
        return self.hooked.type_name

    @property
    def allow_inf(self) -> bool:
        return self.hooked.allow_inf


class HookedModule:
    """A module to hook, with its display name and settings.

    ``passthrough`` modules (parameter-free activations, pooling, reshapes) cannot
    turn finite values into NaN/Inf and never raise magnitudes: their output is
    recorded as an alias of their input instead of being probed.
    """

    __slots__ = (
        "allow_inf",
        "mask_positions",
        "module",
        "name",
        "neg_inf_outputs",
        "passes_mask",
        "passthrough",
        "posinf_paths",
        "type_name",
    )

    def __init__(
        self,
        module: nn.Module,
        name: str,
        allow_inf: bool,
        passthrough: bool = False,
        mask_positions: frozenset[int] = frozenset(),
    ) -> None:
        self.module = module
        self.name = name
        # (A torch.compile wrapper is named by the class of the module it compiled.)
        children = getattr(module, "_modules", None)
        original = children.get("_orig_mod") if isinstance(children, dict) else None
        self.type_name = type(module if original is None else original).__name__
        self.allow_inf = allow_inf
        self.passthrough = passthrough
        # Positional arguments named like a mask (attn_mask, src_mask, position_bias...).
        self.mask_positions = mask_positions
        # Its outputs hold -inf written on purpose (a replay saw masked_fill(-inf)): they
        # are probed like masks from then on, so the fast path stays open.
        self.neg_inf_outputs = False
        # ...because it passes on a mask another module wrote (see _passed_on_mask): when a
        # step goes non-finite, what it returns is checked again (its own -inf, a log(0)).
        self.passes_mask = False
        # Its outputs at these paths hold +inf written on purpose (masked_fill(same, inf)
        # for a min()): probed for NaN only, its other outputs as before.
        self.posinf_paths: frozenset[Path] = frozenset()


class Site(NamedTuple):
    """One probed tensor: where it was seen and which probe values belong to it."""

    frame: int  # the call it was first seen entering or leaving (-1 for a loss)
    role: str  # "input" (first seen entering `frame`), "output" or "loss"
    path: Path
    shape: torch.Size
    dtype: torch.dtype
    start: int  # index of the first probe value in the record's `values`
    nvalues: int

    def key(self) -> tuple[Any, ...]:
        """What must match between a run and its replay for the site to be the same."""
        return (self.role, self.path, tuple(self.shape), self.dtype)


def input_label(path: Path) -> str:
    """``("args", 0)`` -> ``"args[0]"``, ``("kwargs", "mask")`` -> ``"kwargs['mask']"``."""
    if path and path[0] == "kwargs":
        return format_path(f"kwargs[{path[1]!r}]", path[2:])
    return format_path(str(path[0]), path[1:]) if path else "input"


def site_label(site: Site) -> str:
    """``"args[0]"``, ``"kwargs['mask']"``, ``"output"``, ``"output[1].logits"``, ``"loss"``."""
    if site.role == "loss":
        return "loss"
    if site.role == "output":
        return format_path("output", site.path)
    return input_label(site.path)


class ForwardRecord:
    """Everything recorded during one top-level module call: its forward and its backward.

    Built once per forward in the hot path: fields that keep their default in a normal
    step are class attributes (set on the instance only when they change).
    """

    # Only the model's own inputs and outputs were probed (a sentinel step, or a
    # compiled model): a failure is located by replaying with every module hooked.
    coarse: bool = False
    # Kept for the failure path only (exact statistics by replay).
    replay: Replay | None = None
    # The autograd sequence number of the latest node it watched (its outputs'): the loss's
    # own operations were made after it.
    output_seq = -1
    output_node_ids: tuple[tuple[int, int], ...] = ()  # ...and those nodes: (id, number)
    inputs_dropped = False  # not kept: too many eval() forwards in one step (memory)
    inputs_let_go = False  # ...or let go for a later micro-batch's (memory)
    input_bytes = -1  # bytes of its inputs counted for that (-1: not counted)
    input_storages: dict[int, int] = {}  # noqa: RUF012  (...by storage: set, never mutated)
    eval_mode = False  # the model was in eval() mode, with gradients on
    fed_grad = False  # ...and given a tensor that requires grad (a rollout's fed-back state)
    in_eval = False  # the model was in eval() mode (no running statistics updated)
    in_step = False  # run inside optimizer.step() (a closure): the update follows it
    # optimizer.zero_grad() ran after its backward (skip_step: the loop dropped its batch)
    grads_zeroed = False
    unchecked_outputs = False  # its outputs were not probed (inside a torch.func transform)
    output_refs: tuple[Any, ...] = ()  # weak references to the outputs (several guards)
    node_refs: tuple[Any, ...] = ()  # weak references to gradient hooks (see _dropped_forwards)
    output_nodes: tuple[Any, ...] = ()  # ...and the autograd nodes that made them
    targets: frozenset[int] | None = None  # set during a replay
    grad_targets: frozenset[int] = frozenset()
    probe_grads = False  # a replay that localises the backward
    # A replay: frames whose inputs get exact statistics (as they are, not as the
    # site they alias), keyed by (frame, path).
    input_frames: frozenset[int] = frozenset()
    unreproduced = False  # a replay saw only finite values where the probes did not
    own_generators = False  # ...drawing from a torch.Generator of the user's (other numbers)
    exact_sites = False  # a replay: check every site exactly
    exact_stats_left = 4  # ...with statistics of the first non-finite ones
    reported = False  # its forward origin was reported already
    reported_backward = False  # ...its backward origin
    # A sentinel step's record that this complete replay stands for in a resolution.
    replaces: ForwardRecord | None = None
    # A replay of its backward made only finite parameter gradients (None: not replayed):
    # this backward did not make the step's bad parameter gradients.
    param_grads_finite: bool | None = None
    # ...and which parameters (ids) it made non-finite gradients for (None: not replayed).
    replayed_bad_params: frozenset[int] | None = None
    replayed_unseen: frozenset[int] = frozenset()  # ...and those it could not recompute
    # The model's outputs whose gradient its own code made non-finite (it used them to
    # compute other outputs): a replay separated that share from the loss's.
    internal_outputs: frozenset[int] = frozenset()
    # A backward replay: (call, site) for each output of a call that it also used to
    # compute another of its outputs (seen in the autograd graph as the call returned).
    frame_uses: set[tuple[int, int]] | None = None
    # A replay's calls made inside a torch.func transform (vmap(functional_call(template,
    # ...))): nothing in them is probed, so their operations are the caller's code.
    transformed: frozenset[int] = frozenset()
    # Outputs the model also used whose gradient from the loss was already non-finite.
    loss_bad_outputs: frozenset[int] = frozenset()
    # Sites shared with the output of a saturating activation (sigmoid, softmax, tanh).
    bounded_sites: frozenset[int] = frozenset()
    # Sites holding one of the model's registered buffers (a causal mask kept as a buffer).
    buffer_sites: frozenset[int] = frozenset()
    # Its backward ran with create_graph=True (a gradient penalty differentiates it again).
    double_backward = False
    # The forward raised this (a torch.distributions argument check on a NaN): resolved
    # at once, and the exception carries what was found.
    raised: BaseException | None = None
    # ...and whether its message names a non-finite value (else a NaN may still be why: a
    # sparsemax's gather at index -1 on a NaN row; told only if the hooks saw one).
    raised_about = True
    # ...and the call whose own code raised it (the innermost one that never returned).
    raised_frame = 0
    # Its output gradients were dropped for a later micro-batch's (memory: see Recorder).
    grads_dropped = False
    # Which forward of the step it was (1 for the first; set from the second on): a
    # micro-batch of gradient accumulation, a call of a decoding loop.
    number = 1
    # The shapes of the outputs of the model's previous call in the step (a loop feeding
    # them back as this call's input).
    previous_outputs: tuple[tuple[int, ...], ...] = ()
    # ...and whether that call's backward had run before this one began (gradient
    # accumulation's micro-batches; a loop feeding its outputs back runs one at the end).
    previous_backward = False
    # Sites of propagated findings about to be reported whose probe read NaN: the origin's
    # replay checks them exactly too (a sum reads +Inf + -Inf as NaN).
    kind_sites: frozenset[int] = frozenset()
    # The data objects it was given, before they were copied for a replay: (where, key, a
    # weak reference). A KV cache a generation loop hands back each call is one.
    given: tuple[tuple[str, Any, Any], ...] = ()
    # Filled on the failure path only: made on first use (see __getattr__).
    stats: dict[int, TensorStats]  # exact statistics of forward sites
    # ...and which samples hold NaN/Inf: (along dim 0, along dim 1) as ``bad_samples``
    # gives them (dim 1: a sequence-first layout's batch).
    rows: dict[int, tuple[tuple[tuple[int, ...], int, int], tuple[tuple[int, ...], int, int]]]
    grad_stats: dict[int, TensorStats]
    input_stats: dict[tuple[int, Path], TensorStats]
    ops: dict[int, Any]  # site (-1: the backward) -> the operation that made it
    unreproduced_sites: set[int]  # ...at these sites (~site: gradients)
    exact: dict[int, int]  # a replay's exact flags, per site
    grad_exact: list[tuple[int, int]]  # its exact (site, flags), in order
    problems: dict[int, str]  # site -> why exact statistics are missing
    # The first gradient reaching each output in a backward with create_graph=True (a
    # derivative through the model, autograd.grad: a PINN residual, forces).
    derivative_grads: dict[int, Tensor]

    def __getattr__(self, name: str) -> Any:
        make = _LAZY.get(name)
        if make is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        value = make()
        setattr(self, name, value)
        return value

    def __init__(self, index: int, step: int, grad: bool, updates: int = 0) -> None:
        self.index = index
        self.step = step
        self.updates = updates  # optimizer updates of the weights before this forward
        self.grad = grad  # autograd was on: a backward (and an optimizer step) will follow
        self.frames: list[Frame] = []
        self.sites: list[Site] = []
        self.values: list[Tensor] = []
        # Execution order of what the analysis walks: a site index (>= 0) for a
        # tensor first seen entering a module, ``~frame`` (< 0) when a call returns.
        self.order: list[int] = []
        # id(tensor) -> (weakref, site, version): tensors probed in this forward.
        self.seen: dict[int, tuple[Any, int, int]] | None = {}
        self.counts: dict[HookedModule, int] = {}
        # Backward: (site, probe values) in the order autograd produced the gradients.
        self.grads: list[tuple[int, tuple[Tensor, ...]]] = []
        self.keep: set[int] = set()  # sites of the model's outputs (their gradients are kept)
        self.output_grads: dict[int, Tensor] = {}
        self.handles: list[Any] = []  # hooks on leaf tensors, removed at resolution
        self.half_outputs: list[int] = []  # float16/bfloat16 output sites (overflow risk)

    def all_values(self) -> list[Tensor]:
        """Forward probe values, then backward ones, in the order ``flags_by_site`` reads."""
        if not self.grads:
            return self.values
        return self.values + [v for _, values in self.grads for v in values]


_LAZY: dict[str, Any] = {
    "stats": dict,
    "rows": dict,
    "grad_stats": dict,
    "input_stats": dict,
    "ops": dict,
    "unreproduced_sites": set,
    "exact": dict,
    "grad_exact": list,
    "problems": dict,
    "derivative_grads": dict,
}


class Replay(NamedTuple):
    """What re-running a forward needs: its inputs, RNG state and modes, and the small
    floating buffers as the forward found them (``(owner, name, buffer, version, copy or
    None)``: a running statistic the forward reads, then updates in place)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    versions: tuple[int, ...]
    rng: Any
    modes: Any
    buffers: tuple[tuple[Any, str, Any, int, Any], ...] = ()
    # Tensors kept as plain attributes that a forward replaces (truncated BPTT's
    # ``self.h = h.detach()``), as this forward found them: ``(module, name, tensor)``.
    attributes: tuple[tuple[Any, str, Any], ...] = ()


class LossRecord:
    """A loss passed to ``guard.check_loss``."""

    __slots__ = (
        "index",
        "node",
        "number",
        "problems",
        "reported",
        "sites",
        "stats",
        "step",
        "tensor",
        "unreproduced_sites",
        "updates",
        "values",
    )

    def __init__(
        self,
        index: int,
        step: int,
        tensor: Tensor,
        values: tuple[Tensor, ...],
        updates: int = 0,
    ) -> None:
        self.index = index
        self.step = step
        self.updates = updates  # optimizer updates of the weights before it was checked
        self.tensor = tensor  # a scalar, kept for exact statistics on failure
        # The autograd node that made it: which operations the loss's own code ran (their
        # kinds; a backward frees their values).
        self.node: Any = None
        self.values = list(values)
        self.sites = [Site(-1, "loss", (), tensor.shape, tensor.dtype, 0, len(values))]
        self.stats: dict[int, TensorStats] = {}
        self.reported = False
        self.problems: dict[int, str] = {}
        self.unreproduced_sites: set[int] = set()
        self.number = 1  # which loss checked in its step (a micro-batch's)

    def all_values(self) -> list[Tensor]:
        return self.values


Item = ForwardRecord | LossRecord
