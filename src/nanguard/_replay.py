"""Re-run one recorded forward to compute exact statistics of the tensors that matter.

The hooks keep no activation alive (that would cost as much memory as the
activations themselves); on the rare failing step the forward is run once more
with the same inputs, RNG state and autograd/autocast modes, and the hooks
compute exact statistics for the chosen sites as they pass. Buffers (BatchNorm
running statistics) and the RNG are restored afterwards: a replay leaves no trace.
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

__all__ = ["replay", "ReplayResult"]


class ReplayResult:
    """Statistics per site of the original record, or why there are none."""

    def __init__(self, stats: dict[int, TensorStats], problem: str | None) -> None:
        self.stats = stats
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
def _restored_state(module: nn.Module) -> Iterator[None]:
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
def _modes(record: ForwardRecord) -> Iterator[None]:
    modes = record.modes
    with contextlib.ExitStack() as stack:
        if modes is not None:
            if modes.inference:
                stack.enter_context(torch.inference_mode())
            else:
                stack.enter_context(torch.set_grad_enabled(modes.grad))
            for device_type, dtype in modes.autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype))
        yield


def replay(recorder: Recorder, record: ForwardRecord, targets: frozenset[int]) -> ReplayResult:
    """Run ``record``'s forward again and return exact statistics for ``targets``."""
    if record.args is None or record.kwargs is None or record.rng is None:
        return ReplayResult({}, "the inputs of the forward were not kept (replay=False)")
    args, kwargs = record.args, record.kwargs
    if not (_replayable(args) and _replayable(kwargs)):
        return ReplayResult({}, "the forward took non-tensor objects that a replay could change")
    if versions(args, kwargs) != record.versions:
        return ReplayResult({}, "the inputs were modified in place after the forward")
    module = record.frames[0].module
    cpu_rng, cuda_rng = record.rng
    try:
        with _restored_state(module):
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)
            with _modes(record), recorder.capture(targets) as capture:
                module(*args, **kwargs)
    except Exception as err:  # a detector must never break training
        return ReplayResult({}, f"the replay raised {type(err).__name__}: {err}")
    again = capture.record
    if again is None:
        return ReplayResult({}, "the replay did not run the same forward")
    stats: dict[int, TensorStats] = {}
    for site in targets:
        if site < len(again.sites) and site < len(record.sites):
            same = again.sites[site].key() == record.sites[site].key()
            if same and site in again.stats:
                stats[site] = again.stats[site]
    if len(stats) < len(targets):
        return ReplayResult(stats, "the replay took a different path through the model")
    return ReplayResult(stats, None)
