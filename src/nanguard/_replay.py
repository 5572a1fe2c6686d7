"""Re-run one recorded forward (and its backward) to compute exact statistics.

The hooks keep no activation alive (that would cost as much memory as the
activations themselves); on the rare failing step the forward is run once more
with the same inputs, RNG state and autograd/autocast modes, and the hooks
compute exact statistics for the chosen sites as they pass. For gradients, the
replayed outputs are back-propagated with the gradients that arrived at the
model's outputs in the real step, through ``torch.autograd.grad`` (so no
``.grad`` is touched). Buffers (BatchNorm running statistics) and the RNG are
restored afterwards: a replay leaves no trace.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from nanguard._events import TensorStats
from nanguard._probes import ForwardRecord
from nanguard._recording import Recorder, _cuda_initialized, versions
from nanguard._tree import Path, collect

__all__ = ["ReplayResult", "replay"]


class ReplayResult:
    """Statistics per site of the original record, or why there are none."""

    def __init__(
        self,
        stats: dict[int, TensorStats],
        problem: str | None,
        grad_stats: dict[int, TensorStats] | None = None,
        grad_events: list[tuple[int, int]] | None = None,
        input_stats: dict[tuple[int, Path], TensorStats] | None = None,
    ) -> None:
        self.input_stats = input_stats or {}
        self.stats = stats
        self.grad_stats = grad_stats or {}
        self.grad_events = grad_events or []  # (site, exact flags) in backward order
        self.problem = problem


_SAFE_LEAVES = (Tensor, int, float, bool, str, bytes, type(None), torch.dtype, torch.device)


def _replayable(value: Any, depth: int = 0) -> bool:
    """Only plain data: replaying with a mutable object (a KV cache) could change it."""
    if isinstance(value, _SAFE_LEAVES):
        return True
    if depth > 6:
        return False
    if isinstance(value, (tuple, list)):
        return all(_replayable(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(_replayable(v, depth + 1) for v in value.values())
    return False


@contextlib.contextmanager
def restored_state(module: nn.Module) -> Iterator[None]:
    """Snapshot buffers and RNG; put them back afterwards, whatever happens."""
    buffers = []
    for owner in module.modules():
        for name, buf in owner._buffers.items():
            if buf is not None:
                buffers.append((owner, name, buf, buf.detach().clone()))
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if _cuda_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for owner, name, buf, saved in buffers:
                owner._buffers[name] = buf
                buf.copy_(saved)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@contextlib.contextmanager
def recorded_modes(modes: Any) -> Iterator[None]:
    """Enter the autograd/autocast modes a forward ran under."""
    with contextlib.ExitStack() as stack:
        if modes is not None:
            if modes.inference:
                stack.enter_context(torch.inference_mode())
            else:
                stack.enter_context(torch.set_grad_enabled(modes.grad))
            for device_type, dtype in modes.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
        yield


def _output_tensors(record: ForwardRecord, output: Any) -> dict[int, Tensor]:
    """Map the replayed model's output tensors to the sites of the original outputs."""
    found: list[tuple[Path, Tensor]] = []
    collect(output, (), found)
    top = record.frames[0]
    by_site: dict[int, Tensor] = {}
    # The same traversal order as the post-hook: the n-th tensor is the n-th output ref.
    tensors = [t for _, t in found if t.dtype.is_floating_point or t.dtype.is_complex]
    for site, tensor in zip(top.outputs, tensors, strict=False):
        by_site.setdefault(site, tensor)
    return by_site


def replay(
    recorder: Recorder,
    record: ForwardRecord,
    targets: frozenset[int],
    grad_targets: frozenset[int] = frozenset(),
    backward: bool = False,
    input_frames: frozenset[int] | None = None,
) -> ReplayResult:
    """Run ``record``'s forward again: exact statistics for ``targets`` (forward sites)
    and, when gradients were kept, for the gradients of ``grad_targets``. With
    ``backward``, every module's gradient is checked exactly, in backward order (to
    localise a backward origin), with statistics of the first non-finite one."""
    info = record.replay
    if info is None:
        return ReplayResult({}, "the inputs of the forward were not kept (replay=False)")
    if not (_replayable(info.args) and _replayable(info.kwargs)):
        return ReplayResult({}, "the forward took non-tensor objects that a replay could change")
    if versions(info.args, info.kwargs) != info.versions:
        return ReplayResult({}, "the inputs were modified in place after the forward")
    if (grad_targets or backward) and not record.output_grads:
        return ReplayResult({}, "the gradients that reached the model's outputs were not kept")
    module = record.frames[0].module
    cpu_rng, cuda_rng = info.rng
    grad_stats: dict[int, TensorStats] = {}
    again: ForwardRecord | None = None
    try:
        with restored_state(module):
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            with (
                recorded_modes(info.modes),
                recorder.capture(targets, grad_targets, backward, input_frames) as capture,
            ):
                output = module(*info.args, **info.kwargs)
            again = capture.record
            if (grad_targets or backward) and again is not None:
                outputs = _output_tensors(again, output)
                pairs = [
                    (outputs[s], g)
                    for s, g in record.output_grads.items()
                    if s in outputs and outputs[s].requires_grad
                ]
                params = [p for p in module.parameters() if p.requires_grad]
                if pairs and params:
                    torch.autograd.grad(
                        [t for t, _ in pairs],
                        params,
                        grad_outputs=[g for _, g in pairs],
                        allow_unused=True,
                    )
                grad_stats = dict(again.grad_stats)
    except Exception as err:  # a detector must never break training
        return ReplayResult({}, f"the replay raised {type(err).__name__}: {err}")
    if again is None:
        return ReplayResult({}, "the replay did not run the same forward")
    stats: dict[int, TensorStats] = {}
    for site in targets:
        if site < len(again.sites) and site < len(record.sites):
            same = again.sites[site].key() == record.sites[site].key()
            if same and site in again.stats:
                stats[site] = again.stats[site]
    events = list(again.grad_exact)
    inputs = dict(again.input_stats)
    if backward and not any(flags for _, flags in events):
        problem = "the replay did not reproduce the non-finite gradients"
        return ReplayResult(stats, problem, grad_stats, events, inputs)
    if len(stats) < len(targets) or len(grad_stats) < len(grad_targets):
        problem = "the replay took a different path through the model"
        return ReplayResult(stats, problem, grad_stats, events, inputs)
    return ReplayResult(stats, None, grad_stats, events, inputs)
