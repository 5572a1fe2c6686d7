"""Re-run one recorded forward (and its backward) on the failure path.

The hooks keep no activation alive (that would cost as much memory as the
activations themselves). On the rare failing step the forward is run once more,
eagerly, with the same inputs, RNG state and autograd/autocast modes and every
module hooked, and the hooks look at the tensors as they pass:

- exact statistics of chosen sites (the origin and, as they are received, its inputs);
- for a sentinel step or a compiled model, exact flags of every site: a complete
  record to analyse, as if the step had run with every module probed;
- the backward, re-run through ``torch.autograd.grad`` with the gradients that
  reached the model's outputs in the real step (no ``.grad`` is touched), every
  module's gradient checked exactly, to localise a backward origin;
- the aten operation that made the value, and its source line (``_opwatch``).

Buffers (BatchNorm running statistics) and the RNG are restored afterwards: a
replay leaves no trace in training.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import gc
import operator
import random
import sys
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, Final

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from nanguard._checks import flags_of_tensor, stored_values
from nanguard._events import TensorStats
from nanguard._opwatch import OpInfo, OpWatch, written_args
from nanguard._probes import ForwardRecord
from nanguard._recording import (
    MODULE_KEYS,
    Recorder,
    _cuda_initialized,
    copy_containers,
    eager_call,
    top_saved_hooks,
    versions,
    walks_output,
)
from nanguard._tree import Path, Walk, attributes, collect, is_data_object, scalar_list

__all__ = ["ReplayResult", "replay", "replay_target"]


class ReplayResult:
    """What a replay found, or why it could not."""

    def __init__(self, problem: str | None = None, record: ForwardRecord | None = None) -> None:
        self.problem = problem
        self.record = record  # the replayed forward (its own sites and frames)
        self.stats: dict[int, TensorStats] = {}
        self.rows: dict[int, Any] = {}  # site -> bad samples (``ForwardRecord.rows``)
        self.input_stats: dict[tuple[int, Path], TensorStats] = {}
        self.grad_stats: dict[int, TensorStats] = {}
        self.grad_events: list[tuple[int, int]] = []  # (site, exact flags) in backward order
        self.op: OpInfo | None = None  # the forward operation that made the value
        self.backward_op: OpInfo | None = None
        # Whether the recomputed parameter gradients were all finite (None: not recomputed).
        self.param_grads_finite: bool | None = None
        # ids of the parameters whose recomputed gradients were not finite (None: not
        # recomputed): the step's .grad may be worse (clip_grad_norm_ by a NaN norm).
        self.bad_params: frozenset[int] | None = None
        # ...and those it could not recompute (used inside a reentrant checkpoint).
        self.unseen_params: frozenset[int] = frozenset()
        # Whether every tensor the replayed forward's modules took and returned was finite
        # (None: not known): a replay that took another path did not make the value again.
        self.finite: bool | None = None
        # Whether the forward operation's value is in the outputs' autograd graph (see replay).
        self.reached: bool | None = None


def _first_line(err: BaseException, limit: int = 200) -> str:
    """An error's first line, shortened (PyTorch's dispatcher errors run to pages)."""
    text = str(err).strip().splitlines()
    line = text[0] if text else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


_SAFE_LEAVES = (Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _replayable(value: Any, depth: int = 0, walk: Walk | None = None) -> bool:
    """Only plain data: replaying with a mutable object (a KV cache) could change it.
    Lists, dicts and batch objects of plain data are copied when the forward begins, and
    the replay runs on the copies; classes and functions they hold (PyG's attribute
    classes) are no data to change. A batch too large to look through (one holding its
    dataset) is not replayed."""
    if walk is None:
        walk = Walk()
    walk.left -= 1
    if walk.left < 0:
        return False
    if isinstance(value, _SAFE_LEAVES):
        return True
    if type(value).__module__ == "numpy":
        return True  # a numpy batch (a pre-hook or the forward converts it; not written to)
    if depth > 6:
        return False
    if isinstance(value, (tuple, list)):
        if scalar_list(value):
            return True
        return all(_replayable(v, depth + 1, walk) for v in value)
    if isinstance(value, Mapping):
        return all(_replayable(v, depth + 1, walk) for v in value.values())
    if depth and isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)):
        return True  # (held by a batch object: nothing a replay changes)
    if is_data_object(value):  # a batch object (copied when the forward began)
        if id(value) in walk.seen:
            return True  # (a reference back to an object being looked through)
        walk.seen.add(id(value))
        found = attributes(value)
        return found is not None and all(_replayable(v, depth + 1, walk) for v in found.values())
    return False


def replay_target(module: nn.Module) -> nn.Module:
    """The module a replay runs: the eager original of a ``torch.compile`` wrapper."""
    original = getattr(module, "_orig_mod", None)
    return original if isinstance(original, nn.Module) else module


_SHARDED = ("FullyShardedDataParallel", "FSDPModule")


def collective_problem(module: nn.Module) -> str | None:
    """Why a replay cannot run this model's forward on one rank alone, if it cannot.

    A sharded model gathers its weights in the forward: a collective the other ranks would
    never join (the replay would hang until the process group's timeout).
    """
    parallel = data_parallel(module) if world_size() > 1 else None
    # (the wrapper holding it too: FSDP's module watched inside it, whose weights are views
    # of a flat parameter the wrapper gathers and frees)
    outer = [parallel] if parallel is not None and parallel is not module else []
    for sub in [*outer, *module.modules()]:
        sharded = next((c.__name__ for c in type(sub).__mro__ if c.__name__ in _SHARDED), None)
        if sharded is not None:
            return (
                f"the forward runs collectives ({sharded}): a replay on one rank alone would "
                "wait for the other ranks forever"
            )
    return None


#: Operator namespaces of collectives (c10d's, functional collectives).
_COLLECTIVE_NAMESPACES = frozenset({"c10d", "_c10d_functional", "c10d_functional"})


class _CollectiveRefused(Exception):
    """A replay reached a collective (see ``_NoCollectives``; not a RuntimeError, which the
    replayed backward's out-of-memory handling would take for one)."""


class _NoCollectives(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Refuses collectives, before they are issued, in a replay on one rank.

    A forward that exchanges tensors with the other ranks (MoCo's all_gather of keys, a
    loss over gathered features computed inside the model) would wait, replayed on one
    rank alone, for ranks that never join: until the process group's timeout, then crash.
    """

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES:
            raise _CollectiveRefused(str(func))
        return func(*args, **(kwargs or {}))


class _OwnGenerators(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Puts back the ``torch.Generator`` objects a replay draws from (``torch.rand(...,
    generator=g)``: Gumbel noise, a data augmentation inside the model).

    The global RNG is restored around a replay; a generator of the user's own is not known
    until an operation is given it (each sighting is a new Python object for the same
    generator: every state seen is kept, and put back last seen first, which leaves each
    generator as it was first seen). Its state at the step's start was not kept either, so
    the replay drew other numbers than the step (``seen``).
    """

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.states: list[tuple[torch.Generator, Tensor]] = []
        self.seen = False

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Generator):
                self.seen = True
                if len(self.states) < _GENERATOR_STATES:
                    self.states.append((value, value.get_state()))
        return func(*args, **kwargs)

    def restore(self) -> None:
        for generator, state in reversed(self.states):
            generator.set_state(state)
        self.states = []


#: States of the user's own generators kept during one replay (a few per forward, usually).
_GENERATOR_STATES: Final = 4096

#: Wrappers whose backward synchronises gradients across ranks.
DATA_PARALLEL: Final = frozenset({"DistributedDataParallel", *_SHARDED})


def is_data_parallel(module: nn.Module) -> bool:
    """Whether ``module`` itself is a DDP or FSDP wrapper."""
    return any(c.__name__ in DATA_PARALLEL for c in type(module).__mro__)


_WRAPPERS: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module | None, int]] = (
    weakref.WeakKeyDictionary()
)
#: A model found in no wrapper is looked at again for half this many asks (watched, then
#: wrapped in DDP: the wrapper comes after the guard, before training).
_WRAPPER_RECHECK: Final = 16


def data_parallel(model: nn.Module) -> nn.Module | None:
    """The DistributedDataParallel or FSDP module that synchronises ``model``'s gradients:
    the model itself, or the wrapper holding it when the inner module is watched; else None.
    (Looked for once per model when found, it walks the objects referring to it; not found,
    again at the first few asks: a model watched before DDP wraps it.)"""
    known = _WRAPPERS.get(model)
    if known is not None and known[0] is None:
        asked = known[1] + 1
        _WRAPPERS[model] = (None, asked)
        if asked > _WRAPPER_RECHECK // 2:
            return None  # (looked for again at the first steps only: a walk of the heap)
        known = None
    if known is None:
        candidates: list[nn.Module] = [model]
        holders = [h for h in gc.get_referrers(model) if isinstance(h, dict)]
        for _ in range(2):  # (a wrapper's _modules dict, in its __dict__)
            found_here = [o for h in holders for o in gc.get_referrers(h)]
            candidates.extend(o for o in found_here if isinstance(o, nn.Module))
            holders = [o for o in found_here if isinstance(o, dict)]
        found = next(
            (module for module in candidates if any(is_data_parallel(m) for m in module.modules())),
            None,
        )
        previous = _WRAPPERS.get(model)
        known = _WRAPPERS[model] = (found, previous[1] if previous is not None else 0)
    return known[0]


def world_size() -> int:
    """How many ranks the default process group has (1 without torch.distributed)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


@contextlib.contextmanager
def _eager() -> Iterator[None]:
    """Compiled code runs eagerly for the duration (``torch.compiler.set_stance``): the
    modules inside a compiled submodule run their hooks, and dynamo neither compiles nor
    marks anything for the replay's hooks and operator watch. Its caches stay as they were."""
    dynamo = sys.modules.get("torch._dynamo")  # (not imported: nothing was compiled)
    set_stance = getattr(dynamo, "set_stance", None)
    stance = None
    if set_stance is not None:
        try:
            stance = set_stance("force_eager")
        except RuntimeError:  # (inside a compiled region: the replay runs as it can)
            stance = None
    if stance is None:
        yield
        return
    with stance:
        yield


def _hook_owners(module: nn.Module) -> list[Any]:
    """Objects whose hooks on ``module``'s modules can be switched off by a ``hooks_enabled``
    flag (opacus's GradSampleModule: its hooks count each parameter's forwards and build
    per-sample gradients, state that a replay would leave wrong)."""
    owners: dict[int, Any] = {}
    for m in module.modules():
        if isinstance(getattr(m, "hooks_enabled", None), bool):
            owners[id(m)] = m
        for hooks in (m._forward_hooks, m._forward_pre_hooks, m._backward_hooks):
            for hook in hooks.values():
                owner = getattr(getattr(hook, "func", hook), "__self__", None)
                if owner is not None and isinstance(getattr(owner, "hooks_enabled", None), bool):
                    owners[id(owner)] = owner
    return list(owners.values())


@contextlib.contextmanager
def _library_hooks_off(module: nn.Module) -> Iterator[None]:
    """Another library's hooks that keep state of their own (see ``_hook_owners``) off for
    the duration: the replay is not a step of theirs."""
    owners = [o for o in _hook_owners(module) if o.hooks_enabled]
    for owner in owners:
        owner.hooks_enabled = False
    try:
        yield
    finally:
        for owner in owners:
            owner.hooks_enabled = True


@contextlib.contextmanager
def _local_forward(module: nn.Module) -> Iterator[None]:
    """Run a DistributedDataParallel or DataParallel wrapper as its wrapped module.

    Their forward broadcasts buffers or scatters the batch, collectives the other ranks
    would not join; the wrapper's hooks still run, so the replay records the same calls.
    """
    inner = getattr(module, "module", None)
    wrapper = isinstance(module, (nn.parallel.DistributedDataParallel, nn.DataParallel))
    if not wrapper or not isinstance(inner, nn.Module):
        yield
        return
    module.__dict__["forward"] = inner.__call__
    try:
        yield
    finally:
        module.__dict__.pop("forward", None)


class _SaveWrites(TorchDispatchMode):
    """Copies of the given tensors, each taken just before the replay first writes it in
    place (a key encoder or EMA teacher moved inside ``forward``, a memory bank kept as a
    plain tensor): what a replay writes is put back, and only that is copied (a
    fine-tuned model's frozen base, never written, is not)."""

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._watched: set[int] = set()  # their storages (views of one share it)
        for t in tensors:
            try:
                if t.numel() and t.layout is torch.strided and not t.is_meta:
                    self._watched.add(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # (a tensor without a storage)
                continue
        # Each written storage, whole (a write through any of its views is undone), and a
        # copy of it; put back storage to storage, bumping no tensor's version.
        self.saved: dict[int, tuple[torch.UntypedStorage, torch.UntypedStorage]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self._watched and func._schema.is_mutable:
            for _, t in written_args(func, args, kwargs):
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    continue
                key = storage.data_ptr()
                if key in self._watched and key not in self.saved:
                    self.saved[key] = (storage, storage.clone())  # type: ignore[no-untyped-call]
        return func(*args, **kwargs)

    def restore(self) -> None:
        for storage, saved in self.saved.values():
            storage.copy_(saved)
        self.saved = {}


#: What a module's ``__dict__`` holds that is not its own state (a wrapper's forward is
#: set there for the duration of a replay, see _local_forward).
_MODULE_INTERNALS: Final = MODULE_KEYS | {"forward"}


#: How deep a replay's snapshot follows the modules' attributes (a cache object holding
#: per-layer objects holding tensors: transformers' DynamicCache), and how many objects it
#: copies at most.
_STATE_DEPTH: Final = 4
_STATE_OBJECTS: Final = 20_000


class _PythonState:
    """The model's Python-side state, for a replay to put back: each module's own
    attributes (a queue pointer kept as an int, a counter, ``self.h = h.detach()``), the
    contents of the lists, dicts, deques and plain objects reachable from them (a cache
    list, ``self.stats.calls``, a KV cache's layers), and the tensors among them (copied
    only if the replay writes them in place, see ``_SaveWrites``)."""

    def __init__(self, module: nn.Module) -> None:
        self.modules = [
            (owner, {k: v for k, v in vars(owner).items() if k not in _MODULE_INTERNALS})
            for owner in module.modules()
        ]
        self.contents: list[tuple[Any, Any]] = []  # (object, a copy of what it holds)
        self.tensors: list[Tensor] = []
        seen: set[int] = {id(owner) for owner, _ in self.modules}
        for _, kept in self.modules:
            for value in kept.values():
                self._walk(value, 1, seen)

    def _walk(self, value: Any, depth: int, seen: set[int]) -> None:
        if isinstance(value, Tensor):
            self.tensors.append(value.data)
            return
        if depth > _STATE_DEPTH or id(value) in seen or len(seen) > _STATE_OBJECTS:
            return
        items: Iterable[Any]
        if isinstance(value, (list, collections.deque)):
            saved: Any = list(value)
            items = saved
        elif isinstance(value, dict):
            saved = dict(value)
            items = saved.values()
        elif isinstance(value, tuple):
            saved, items = None, value
        elif _helper(value):
            saved = dict(vars(value))
            items = saved.values()
        else:
            return
        seen.add(id(value))
        if saved is not None:
            self.contents.append((value, saved))
        for item in items:
            self._walk(item, depth + 1, seen)

    def restore(self) -> None:
        for owner, kept in self.modules:
            now = owner.__dict__
            for key in [k for k in now if k not in _MODULE_INTERNALS and k not in kept]:
                del now[key]  # (set by the replay only)
            now.update(kept)
        for value, saved in self.contents:
            try:
                _put_back(value, saved)
            except Exception:  # (an immutable container, torch.fx's immutable_list: the
                continue  # replay cannot have changed it either)


def _put_back(value: Any, saved: Any) -> None:
    """Put ``saved`` back into ``value`` if the replay changed what it holds (compared by
    identity: a container that refuses writes, diffusers' FrozenDict, is left alone when
    it was not changed; written through the built-in methods when it was)."""
    if isinstance(value, (list, collections.deque)):
        if len(value) == len(saved) and all(map(operator.is_, value, saved)):
            return
        if isinstance(value, list):
            list.__setitem__(value, slice(None), saved)
        else:
            value.clear()
            value.extend(saved)
        return
    fields = value if isinstance(value, dict) else value.__dict__
    if len(fields) == len(saved) and all(
        k in fields and dict.__getitem__(fields, k) is v for k, v in saved.items()
    ):
        return
    dict.clear(fields)
    dict.update(fields, saved)


def _helper(value: Any) -> bool:
    """A plain object of the user's kept on a module (its attributes are its state)."""
    return (
        not isinstance(value, (nn.Module, Tensor, type, types.ModuleType, types.FunctionType))
        and isinstance(getattr(value, "__dict__", None), dict)
        and not type(value).__module__.startswith(("torch", "builtins", "nanguard"))
    )


def _written_state(module: nn.Module, state: _PythonState) -> list[Tensor]:
    """The tensors a replay may write in place and must not leave written: the parameters
    (a teacher a forward moves may keep requires_grad=True: timm's ModelEmaV3) and the
    tensors the model's Python-side state holds."""
    return [p.data for p in module.parameters()] + state.tensors


_RENORMING: Final = (nn.Embedding, nn.EmbeddingBag)


@contextlib.contextmanager
def restored_state(module: nn.Module) -> Iterator[None]:
    """Snapshot buffers, frozen parameters and RNG; put them back afterwards, whatever
    happens."""
    # The replay runs on copies of the buffers, put in their place and taken out after: the
    # buffers themselves are never written (an in-place restore would bump their version,
    # and a training graph that saved one, still waiting for its backward, would fail).
    swapped = []
    buffers = []  # (a scripted module's buffers cannot be swapped: restored in place)
    for owner in module.modules():
        scripted = isinstance(owner, torch.jit.ScriptModule)
        for name, buf in list(owner._buffers.items()):
            if buf is None:
                continue
            if scripted:
                buffers.append((owner, name, buf, buf.detach().clone()))
            else:
                owner._buffers[name] = buf.detach().clone()
                swapped.append((owner, name, buf))
    # The parameters autograd does not train, each with its storage (a forward may assign
    # a new one, `p.data = ...`), and the model's Python-side state: what a replay writes
    # there is put back (a forward that moves its key encoder or EMA teacher, advances a
    # queue pointer, appends to a cache).
    frozen = [(p, p.data) for p in module.parameters() if not p.requires_grad]
    python_state = _PythonState(module)
    writes = _SaveWrites(_written_state(module, python_state))
    py_rng = random.getstate()  # (fairseq's LayerDrop draws from Python's random)
    numpy = sys.modules.get("numpy")
    np_rng = numpy.random.get_state() if numpy is not None else None
    # nn.Embedding(max_norm=...) renormalises the rows it looks up in place, in its forward:
    # the step's forward did (the replay reads those rows as the step did), so the replay
    # does not write the weight again (a tied output layer saved it for the step's backward).
    renorming = [
        m for m in module.modules() if isinstance(m, _RENORMING) and m.max_norm is not None
    ]
    limits = [m.max_norm for m in renorming]
    for m in renorming:
        m.max_norm = None
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if _cuda_initialized() else None
    try:
        with writes:
            yield
    finally:
        for m, limit in zip(renorming, limits, strict=True):
            m.max_norm = limit
        for owner, name, buf in swapped:
            owner._buffers[name] = buf
        with torch.no_grad():
            for owner, name, buf, saved in buffers:
                owner._buffers[name] = buf
                buf.copy_(saved)
            for param, data in frozen:
                if param.data.untyped_storage().data_ptr() != data.untyped_storage().data_ptr():
                    param.data = data
        torch.set_rng_state(cpu_rng)
        random.setstate(py_rng)
        if numpy is not None and np_rng is not None:
            numpy.random.set_state(np_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        writes.restore()
        python_state.restore()


@contextlib.contextmanager
def recorded_modes(modes: Any, module: nn.Module | None = None) -> Iterator[None]:
    """Enter the autograd/autocast modes a forward ran under, and the model's train/eval
    mode (a validation forward replayed after ``model.train()``); restored afterwards."""
    training = getattr(modes, "training", None)
    flags = []
    if module is not None and training is not None and module.training != training:
        flags = [(m, m.training) for m in module.modules()]
        module.train(training)
    with contextlib.ExitStack() as stack:
        if flags:
            stack.callback(_restore_training, flags)
        if modes is not None:
            if modes.inference:
                stack.enter_context(torch.inference_mode())
            else:
                stack.enter_context(torch.set_grad_enabled(modes.grad))
            for device_type, dtype in modes.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
            hooks = getattr(modes, "saved_hooks", None)
            if hooks is not None:  # (what the backward reads: as the step saved it)
                stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*hooks))
        yield


def _restore_training(flags: list[tuple[nn.Module, bool]]) -> None:
    for m, flag in flags:
        m.training = flag


def _output_tensors(output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The model's output tensors in the order the post-hook saw them."""
    found: list[tuple[Path, Tensor]] = []
    collect(output, (), found, objects=walks_output(output, args, kwargs), bound_containers=False)
    return [t for _, t in found if t.dtype.is_floating_point or t.dtype.is_complex]


def _internal_outputs(tensors: list[Tensor], limit: int = 1 << 16) -> dict[int, set[int]]:
    """The outputs that another output was computed from (a model returning ``p`` and
    ``entropy(p)``), each with the indices of those others: a search of the autograd
    graph, failure path only."""
    nodes: dict[Any, int] = {}
    for i, t in enumerate(tensors):  # (an output returned twice: its first place)
        if t.grad_fn is not None:
            nodes.setdefault(t.grad_fn, i)
    if len(nodes) < 2:
        return {}
    found: dict[int, set[int]] = {}
    for start, i in nodes.items():
        seen = {start}
        queue = [n for n, _ in start.next_functions if n is not None]
        while queue and len(seen) < limit:
            node = queue.pop()
            if node in seen:
                continue
            seen.add(node)
            j = nodes.get(node)
            if j is not None and j != i:
                found.setdefault(j, set()).add(i)
            queue.extend(n for n, _ in node.next_functions if n is not None)
        if queue:
            return {}  # too large a graph to see every use: no output is told apart
    return found


def _fed_gradients(
    tensors: list[Tensor], kept: list[Tensor | None], inner: dict[int, set[int]]
) -> tuple[list[tuple[Tensor, Tensor]], set[int], set[int]]:
    """The (output, gradient) pairs to backpropagate, the outputs whose gradient the
    model's own code made non-finite, and those the model also used whose loss share is
    non-finite (the loss made it, whatever the model's code adds).

    The gradient kept for an output the model also used (``inner``: a policy's
    probabilities and their entropy) summed the loss's share and the model's own. Outputs
    are taken users first (an output's users are computed from it, so they have fewer users
    of their own): each one's own share is recomputed from its users' loss shares, and only
    its loss share (kept minus own) is fed. When the own share is not finite, the model made
    it: nothing is fed there, and the replay makes it again. An output returned twice (the
    same tensor) is fed once.
    """
    first: dict[int, int] = {}
    for i, t in enumerate(tensors):
        first.setdefault(id(t), i)
    loss_share: dict[int, Tensor] = {}
    own_bad: set[int] = set()
    order = sorted(range(len(tensors)), key=lambda i: len(inner.get(i, ())))
    for i in order:
        g = kept[i] if i < len(kept) else None
        t = tensors[i]
        if g is None or not t.requires_grad or first[id(t)] != i:
            continue
        users = [j for j in inner.get(i, ()) if j in loss_share]
        with torch.no_grad():
            if any(flags_of_tensor(loss_share[j]) for j in users):
                # The loss made its users' gradients bad: this one's own share follows from
                # them and its loss share cannot be told apart. The replay recomputes it.
                continue
        own: Tensor | None = None
        if users:
            try:
                (own,) = torch.autograd.grad(
                    [tensors[j] for j in users],
                    [t],
                    grad_outputs=[loss_share[j] for j in users],
                    retain_graph=True,
                    allow_unused=True,
                )
            except RuntimeError:  # (a reentrant checkpoint: autograd.grad is refused)
                own = None
        with torch.no_grad():
            if own is not None and flags_of_tensor(own):
                own_bad.add(i)
                continue
            loss_share[i] = g - own if own is not None else g
    pairs = [(tensors[i], loss_share[i]) for i in sorted(loss_share)]
    return pairs, own_bad, {i for i, g in loss_share.items() if i in inner and flags_of_tensor(g)}


def _note_generators(generators: _OwnGenerators, record: ForwardRecord) -> None:
    generators.restore()
    if generators.seen:
        record.own_generators = True


def replay(
    recorder: Recorder,
    record: ForwardRecord,
    targets: frozenset[int] = frozenset(),
    *,
    grad_targets: frozenset[int] = frozenset(),
    backward: bool = False,
    input_frames: frozenset[int] | None = None,
    exact: bool = False,
    watch: tuple[int | nn.Module, str] | None = None,
    finite_buffers: frozenset[tuple[int, str]] = frozenset(),
    grad_scale: float = 1.0,
    _passed: int = 0,
    _cut_inputs: bool = False,
) -> ReplayResult:
    """Run ``record``'s forward again, eagerly, with every module hooked.

    Args:
        recorder: the guard's recorder (its hooks look at the replayed tensors).
        record: the forward to replay (its inputs, RNG state and modes were kept).
        targets: forward sites to compute exact statistics of.
        grad_targets: sites whose gradients get exact statistics (backward replayed).
        backward: replay the backward, checking every module's gradient exactly.
        input_frames: calls whose inputs get exact statistics as received.
        exact: check every site exactly (to analyse a sentinel or compiled step).
        watch: ``(frame, kind)``: find the operation in that call's code that made
            ``kind``; with a backward, also the one that made the first bad gradient.
            ``frame`` may be a module: the operation in its code, whichever call it is.
            An operation whose value never reached the model's outputs (a detached
            diagnostic, NaN every step) is passed over for the next one, when there is one.
        finite_buffers: ``(id(owner), name)`` of buffers whose NaN/Inf the replay's copy
            has made +-1: what the step would have made without them (the buffers themselves
            are not touched).
        grad_scale: a factor on the gradients fed to the outputs (``1 / scale``: the
            backward of a step GradScaler scaled, as if unscaled).
    """
    info = record.replay
    if info is None:
        if record.inputs_let_go:
            return ReplayResult(
                f"the inputs of this micro-batch (forward {record.number} of the step) were "
                "let go for later ones' (a step of many micro-batches: their inputs are kept "
                "up to a tenth of the model's parameter bytes, at least 128 MiB; "
                'mode="sentinel" keeps them all)'
            )
        if record.inputs_dropped:
            return ReplayResult(
                "the inputs of the forward were not kept (only those of the first 32 eval() "
                "forwards with gradients on of a step are: wrap validation in torch.no_grad())"
            )
        return ReplayResult("the inputs of the forward were not kept (replay=False)")
    if not (_replayable(info.args) and _replayable(info.kwargs)):
        return ReplayResult("the forward took non-tensor objects that a replay could change")
    if versions(info.args, info.kwargs) != info.versions:
        return ReplayResult("the inputs were modified in place after the forward")
    if record.updates != recorder.updates:
        if record.in_step:  # (LBFGS calls its closure again after each move of the weights)
            return ReplayResult(
                "optimizer.step() changed the weights after the forward, which its closure ran "
                "(only a step's first closure call is checked before the weights move)"
            )
        if recorder.has_optimizer:  # (another optimizer stepped before optimizer=)
            return ReplayResult(
                "another optimizer's step() changed the weights after the forward, before the "
                "step was resolved at the step() of the one passed as optimizer= (with several "
                "optimizers, pass the one that steps first)"
            )
        return ReplayResult(
            "optimizer.step() changed the weights after the forward (resolve the step "
            "before it: optimizer= or guard.step() before optimizer.step())"
        )
    run_backward = bool(grad_targets) or backward
    if run_backward and not record.output_grads and record.grads_dropped:
        return ReplayResult(
            "the gradients that reached the model's outputs were let go to bound memory "
            "(gradient accumulation with large outputs: an earlier micro-batch's are kept "
            "only while they fit in a tenth of the model's size, the latest one's always)"
        )
    if run_backward and not record.output_grads:
        return ReplayResult(
            "the gradients that reached the model's outputs were not kept (they are, for the "
            "first 8 training forwards of a step)"
        )
    module = replay_target(record.frames[0].module)
    problem = collective_problem(module)
    if problem is not None:
        return ReplayResult(problem)
    found_buffers = []  # (owner, name, what the forward found in it)
    replaced = []  # (owner, name, the buffer the forward found, which it then replaced)
    for owner, name, buf, _, copy in info.buffers:
        if owner._buffers.get(name) is not buf:
            # Replaced since: the module assigns a new one each call (a hidden state kept
            # as a buffer, self.h = h.detach()); the replay reads the one the step read.
            if name in owner._buffers:
                replaced.append((owner, name, buf))
            continue
        if copy is not None:
            found_buffers.append((owner, name, copy))
        elif (id(owner), name) in recorder.buffer_updaters:
            return ReplayResult(
                f"the buffer `{name}` of {type(owner).__name__}, which its forward updates in "
                "place, changed after the forward (a replay would not run the step's "
                "computation)"
            )
    # The gradients that reached the model, in the order of its outputs.
    top = record.frames[0].outputs
    output_grads = [record.output_grads.get(site) for site in top]
    if grad_scale != 1.0:
        output_grads = [g if g is None else g * grad_scale for g in output_grads]
    cpu_rng, cuda_rng = info.rng
    frame, kind = watch if watch is not None else (-1, None)
    if isinstance(frame, nn.Module):
        opwatch = OpWatch(functools.partial(recorder.in_module, frame), kind, recorder.probing)
    else:
        watched = record.frames[frame].hooked if 0 <= frame < len(record.frames) else None
        opwatch = OpWatch(
            functools.partial(recorder.in_frame, frame, watched), kind, recorder.probing
        )
    opwatch.skip_forward = _passed
    opwatch.params = {id(p): n for n, p in module.named_parameters()}
    # Whether the forward creator's value is in the autograd graph of the model's outputs
    # (None: not known, as for a value made under no_grad).
    reached: bool | None = None
    again: ForwardRecord | None = None
    param_grads_finite: bool | None = None
    bad_params: frozenset[int] | None = None
    unseen: frozenset[int] = frozenset()
    refused = False  # autograd would not recompute the gradients (reentrant checkpoint)
    retry = False  # ...or went into the freed graph behind an input: cut it, run again
    grads_in_finite = False  # the gradients fed to the replayed backward were finite
    try:
        with (
            restored_state(module),
            _eager(),
            recorder.full_hooks(),
            _local_forward(module),
            _library_hooks_off(module),
            contextlib.ExitStack() as stack,
        ):
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            with torch.no_grad():  # (running statistics as the forward read them)
                for owner, name, copy in found_buffers:
                    owner._buffers[name].copy_(copy)  # (the replay's own copy of the buffer)
                for owner, name, buf in replaced:
                    owner._buffers[name] = buf.detach().clone()
                for owner in module.modules() if finite_buffers else ():
                    for name, buf in owner._buffers.items():
                        if (id(owner), name) in finite_buffers and buf is not None:
                            buf.nan_to_num_(nan=1.0, posinf=1.0, neginf=-1.0)  # (a copy)
            # Tensors kept as attributes that the forward replaces, as it found them (put
            # back as the step left them by restored_state).
            replaced_attributes = recorder.carried
            for owner, name, value in info.attributes:
                if (id(owner), name) in replaced_attributes:  # (the first forwards list all)
                    owner.__dict__[name] = value
            # The replay's copies of the model's buffers count as its buffers (a mask kept as
            # one is never an origin).
            known_buffers = recorder.buffer_ids
            recorder.buffer_ids = known_buffers | {id(b) for b in module.buffers()}
            stack.callback(setattr, recorder, "buffer_ids", known_buffers)
            if world_size() > 1:
                stack.enter_context(_NoCollectives())  # type: ignore[no-untyped-call]
            if _in_checkpoint():
                # sync="module" replays within the forward: a non-reentrant checkpoint there
                # counts what its region saves, and would refuse the backward; the replay's
                # saved tensors are kept as they are instead.
                with contextlib.suppress(RuntimeError):  # (hooks disabled: nothing to bypass)
                    stack.enter_context(torch.autograd.graph.saved_tensors_hooks(_same, _same))
            generators = _OwnGenerators()
            stack.callback(_note_generators, generators, record)
            stack.enter_context(generators)
            # What the replayed code warns about (torch's "std(): degrees of freedom is <=
            # 0"), the step warned about already; and "Anomaly Detection has been enabled".
            stack.enter_context(warnings.catch_warnings())
            warnings.simplefilter("ignore")
            if watch is not None and run_backward:
                # Node creation tracebacks, for the source line of a backward operation.
                stack.enter_context(torch.autograd.detect_anomaly(check_nan=False))
            capture = stack.enter_context(
                recorder.capture(targets, grad_targets, backward, input_frames, exact)
            )
            with recorded_modes(info.modes, module), _watching(opwatch, watch is not None):
                opwatch.forward_running = True
                try:
                    # (Copies of its lists and dicts: a forward appending to a cache it
                    # is given must not change the user's, nor the inputs kept.)
                    args, kwargs = copy_containers(info.args), copy_containers(info.kwargs)
                    if _cut_inputs:
                        args, kwargs = _cut(args), _cut(kwargs)
                    output = eager_call(module)(*args, **kwargs)
                except Exception as err:
                    # The step's forward raised too (a distribution's argument check, a
                    # Cholesky of a NaN matrix): what ran before the error is the record.
                    if record.raised is None or type(err) is not type(record.raised):
                        raise
                    output = None
                finally:
                    opwatch.forward_running = False
            again = capture.record
            made = opwatch.forward_value
            opwatch.forward_value = None
            if watch is not None and output is not None and made is not None:
                node = made.grad_fn
                if node is not None:
                    reached = _reaches(_output_tensors(output, args, kwargs), node)
            del made
            if run_backward and again is not None and output is not None:
                tensors = _output_tensors(output, args, kwargs)
                # (The own shares' backward passes run the gradient probes too: what they
                # recorded is dropped, the replayed backward below records its own.)
                marks = (len(again.grads), len(again.grad_exact), set(again.grad_stats))
                pairs, own_bad, loss_bad = _fed_gradients(
                    tensors, output_grads, _internal_outputs(tensors)
                )
                del again.grads[marks[0] :], again.grad_exact[marks[1] :]
                for key in set(again.grad_stats) - marks[2]:
                    del again.grad_stats[key]
                again.loss_bad_outputs = frozenset(top[i] for i in loss_bad if i < len(top))
                # Outputs whose gradient the model's own code made non-finite: not the loss's.
                again.internal_outputs = frozenset(top[i] for i in own_bad if i < len(top))
                params = [p for p in module.parameters() if p.requires_grad]
                with torch.no_grad():
                    grads_in_finite = not any(flags_of_tensor(g) for _, g in pairs)
                param_grads = None
                # The model's inputs that carry gradients back out (a PINN's coordinates, whose
                # derivative is the residual): their gradients too, or the backward of the
                # module reading them never runs in the replay.
                found: list[tuple[Path, Tensor]] = []
                collect((args, kwargs), (), found, objects=True)  # (a batch object's pos)
                carried = [
                    t
                    for _, t in found
                    if t.requires_grad and (t.is_floating_point() or t.is_complex())
                ]
                if pairs and (params or carried):
                    try:
                        with _watching(opwatch, watch is not None):
                            grads = _param_grads(pairs, [*params, *carried])
                        param_grads = None if grads is None or not params else grads[: len(params)]
                        refused = grads is None
                    except RuntimeError as err:
                        # Out of memory, most likely: every parameter's gradient again, while
                        # the step's own are held. What the forward found still stands; the
                        # parameters' gradients stay unknown. Or autograd went on through an
                        # input into the graph that made it, freed (a weight the model shares
                        # with that code: a tied embedding): again, with the inputs cut there.
                        param_grads = None
                        retry = not _cut_inputs and "a second time" in str(err)
                if param_grads is not None:
                    with torch.no_grad():
                        bad_params = frozenset(
                            id(p)
                            for p, g in zip(params, param_grads, strict=True)
                            if g is not None and not bool(torch.isfinite(stored_values(g)).all())
                        )
                    param_grads_finite = not bad_params
                    # A parameter with a .grad that the replay did not reach (used inside a
                    # reentrant checkpoint): its gradient is unknown, not finite.
                    unseen = frozenset(
                        id(p)
                        for p, g in zip(params, param_grads, strict=True)
                        if g is None and p.grad is not None
                    )
                    if unseen:
                        param_grads_finite = False if bad_params else None
    except _CollectiveRefused as err:
        return ReplayResult(
            f"the forward runs a collective ({err}): a replay on one rank alone would wait for "
            "the other ranks forever (a NaN another rank made also arrives through it: if "
            "another rank reports an origin in this step, look there first)"
        )
    except Exception as err:  # a detector must never break training
        return ReplayResult(f"the replay raised {type(err).__name__}: {_first_line(err)}")
    if retry:
        return replay(
            recorder, record, targets, grad_targets=grad_targets, backward=backward,
            input_frames=input_frames, exact=exact, watch=watch, _passed=_passed,
            _cut_inputs=True,
        )  # fmt: skip
    if again is None:
        return ReplayResult("the replay did not run the same forward")
    if reached is False and _passed < _MAX_PASSED:
        # Only a creator shown to reach the outputs replaces this one: a value can also
        # reach them outside the graph (a straight-through estimator's x + (q - x).detach()).
        later = replay(
            recorder, record, targets, grad_targets=grad_targets, backward=backward,
            input_frames=input_frames, exact=exact, watch=watch, _passed=_passed + 1,
        )  # fmt: skip
        if later.op is not None and later.reached:
            return later
    result = ReplayResult(record=again)
    result.reached = reached
    result.op, result.backward_op = opwatch.forward, opwatch.backward
    if result.backward_op is None and grads_in_finite:
        # Finite gradients in, yet no operation made a new NaN/Inf: one came from a value
        # saved in the forward (sqrt of a negative number behind a torch.where).
        result.backward_op = opwatch.entered
    result.input_stats = dict(again.input_stats)
    result.grad_stats = dict(again.grad_stats)
    result.grad_events = list(again.grad_exact)
    result.param_grads_finite = param_grads_finite
    result.bad_params = bad_params
    result.unseen_params = unseen
    if exact:  # the replayed record stands for the original: no site mapping needed
        result.stats = dict(again.stats)
        result.rows = dict(again.rows)
        return result
    for site in targets:
        if (
            site < len(again.sites)
            and site < len(record.sites)
            and again.sites[site].key() == record.sites[site].key()
            and site in again.stats
        ):
            result.stats[site] = again.stats[site]
            if site in again.rows:
                result.rows[site] = again.rows[site]
    if backward and refused:
        result.problem = (
            "reentrant checkpointing (checkpoint(use_reentrant=True)) does not let a replay "
            "recompute gradients apart from .grad; use_reentrant=False does"
        )
    elif backward and not any(flags for _, flags in result.grad_events) and not bad_params:
        result.problem = "the replay did not reproduce the non-finite gradients"
    elif len(result.stats) < len(targets) or len(result.grad_stats) < len(grad_targets):
        result.problem = "the replay took a different path through the model"
        if again.values:  # (a probe is finite only if its tensor is: proof, not a guess)
            with torch.no_grad():
                result.finite = all(bool(torch.isfinite(v).all()) for v in again.values)
    return result


#: Forward creators a replay passes over (side computations) before it keeps the first.
_MAX_PASSED: Final = 2
#: Autograd nodes searched for whether a value reached the outputs (a failure path's).
_MAX_NODES: Final = 200_000


def _reaches(outputs: list[Tensor], node: Any) -> bool:
    """Whether ``node`` is in the autograd graph of ``outputs`` (``True`` when that cannot
    be told: an output without a graph, or a graph too large to search)."""
    roots = [t.grad_fn for t in outputs if t.grad_fn is not None]
    if not roots:
        return True
    seen = {id(r) for r in roots}
    stack = list(roots)
    while stack:
        current = stack.pop()
        if current is node:
            return True
        if len(seen) > _MAX_NODES:
            return True
        for nxt, _ in getattr(current, "next_functions", ()):
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append(nxt)
    return False


def _same(tensor: Any) -> Any:
    return tensor


def _in_checkpoint() -> bool:
    """Whether the code runs inside a non-reentrant checkpoint's region (its saved-tensor
    hooks on top)."""
    hooks = top_saved_hooks()
    return hooks is not None and getattr(hooks[0], "__module__", "") == "torch.utils.checkpoint"


def _cut(value: Any) -> Any:
    """The inputs computed with gradients (an encoder's state given to a watched decoder)
    cut from the graph that made them, which the step's backward freed: the replay's
    backward stops at them. (A weight the model shares with that code, a tied embedding,
    would otherwise take autograd back through it.) A copy, so the model may still write
    to it in place."""
    if isinstance(value, Tensor):
        if value.grad_fn is not None:
            return value.detach().requires_grad_(True).clone()
        return value
    if type(value) is tuple:
        return tuple(_cut(v) for v in value)
    if type(value) is list:
        return [_cut(v) for v in value]
    if type(value) is dict:
        return {k: _cut(v) for k, v in value.items()}
    return value


def _param_grads(
    pairs: list[tuple[Tensor, Tensor]], params: Sequence[Tensor]
) -> Sequence[Any] | None:
    """The parameters' gradients from backpropagating ``pairs`` (outputs, gradients), or
    ``None`` where autograd refuses to compute them apart from ``.grad``: reentrant
    checkpointing (``checkpoint(use_reentrant=True)``). A ``backward()`` instead would add
    to the ``.grad`` of every leaf it reaches, some of them outside the model; the forward's
    replay is kept either way."""
    try:
        # (retain_graph: a graph behind the model's inputs that is the user's, alive still
        # (sync="module" replays before the user's backward), is read, not freed.)
        return torch.autograd.grad(
            [t for t, _ in pairs],
            params,
            grad_outputs=[g for _, g in pairs],
            allow_unused=True,
            retain_graph=True,
        )
    except RuntimeError as err:
        if "use_reentrant" in str(err):
            return None
        raise


@contextlib.contextmanager
def _watching(opwatch: OpWatch, active: bool) -> Iterator[None]:
    if not active:
        yield
        return
    with opwatch:
        yield
