"""Overhead of a full training step under each NaN detector, as ratios to no detection.

Every method runs the same training step (forward, loss, backward, optimizer) on
the same model; methods are interleaved round by round in a shuffled order, and
each round's time is divided by the same round's time without detection, so a
noisy shared machine moves all methods together. The table shows the median.

    python benchmarks/overhead.py                      # all models, CPU
    python benchmarks/overhead.py --models mlp --rounds 60
    python benchmarks/overhead.py --device cuda        # unchanged on a GPU

Methods:
    none      no detection
    nanguard      nanguard.watch(model, optimizer=opt) with its defaults: forward, backward,
                  gradient-norm guard, parameter sweeps
    nanguard-fwd  the same scope as the naive hooks: forward checks only
                  (backward=False, grad_norm=False, check_params=False)
    sentinel      nanguard.watch(model, optimizer=opt, mode="sentinel"): the model's
                  outputs, the loss and the gradient norm each step; the module-level
                  detector only on a failing step's replay
    floor         not a detector: the least that sentinel mode's per-step checks can cost,
                  written by hand with nothing else (a sum of the model's output, a sum of
                  the gradient arriving at it, ``_foreach_norm`` of the parameters' gradients,
                  one read of them all before the optimizer step; no replay state kept)
    naive         a forward hook per module doing ``if torch.isnan(out).any(): raise``
    anomaly       torch.autograd.detect_anomaly()
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models

import nanguard

METHODS = ("none", "nanguard", "nanguard-fwd", "sentinel", "floor", "naive", "anomaly")


def _naive_hooks(model: nn.Module) -> list[Any]:
    def hook(module: nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, Tensor) and out.is_floating_point() and torch.isnan(out).any():
            raise FloatingPointError(f"NaN in {type(module).__name__}")

    return [m.register_forward_hook(hook) for m in model.modules()]


def _floor_hooks(model: nn.Module, opt: torch.optim.Optimizer) -> list[Any]:
    values: list[Tensor] = []

    def output_grad(grads: tuple[Tensor | None, ...]) -> None:
        if grads[0] is not None:
            values.append(grads[0].sum())

    def output(module: nn.Module, args: Any, out: Any) -> None:
        if isinstance(out, Tensor) and out.requires_grad and out.grad_fn is not None:
            with torch.no_grad():
                values.append(out.sum())
            out.grad_fn.register_prehook(output_grad)

    def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        values.extend(torch._foreach_norm(grads, 2))
        read = torch.stack(values).tolist() if values[0].device.type != "cpu" else values
        total = sum(float(v) for v in read)
        values.clear()
        if not math.isfinite(total):
            raise FloatingPointError("non-finite output, gradient or gradient norm")

    return [model.register_forward_hook(output), opt.register_step_pre_hook(before_step)]


class Detectors:
    """Each detection method, built once per model and switched on around a block of steps."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        self.model = model
        self.opt = opt
        self.guards = {
            "nanguard": nanguard.Guard(model, optimizer=opt),
            "nanguard-fwd": nanguard.Guard(
                model, optimizer=opt, backward=False, grad_norm=False, check_params=False
            ),
            "sentinel": nanguard.Guard(model, optimizer=opt, mode="sentinel"),
        }

    @contextlib.contextmanager
    def on(self, method: str) -> Iterator[None]:
        if method == "none":
            yield
        elif method in self.guards:
            guard = self.guards[method]
            guard.attach()
            try:
                yield
            finally:
                guard.detach()
        elif method in ("naive", "floor"):
            handles = (
                _naive_hooks(self.model)
                if method == "naive"
                else _floor_hooks(self.model, self.opt)
            )
            try:
                yield
            finally:
                for h in handles:
                    h.remove()
        elif method == "anomaly":
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                with torch.autograd.detect_anomaly():
                    yield
        else:
            raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def make_step(
    model: nn.Module,
    batch: Callable[[], tuple[Tensor, Tensor]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    opt: torch.optim.Optimizer,
) -> Callable[[], None]:
    def step() -> None:
        x, y = batch()
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()

    return step


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_methods(
    step: Callable[[], None],
    detectors: Detectors,
    device: torch.device,
    methods: tuple[str, ...],
    rounds: int,
    steps: int,
) -> dict[str, tuple[float, float, float, float]]:
    """Per method: median seconds per step, median ratio to "none", and the
    interquartile range of the ratios (how much the machine moved them)."""
    for method in methods:  # warm-up: allocator, lazy inits, hooks' first calls
        with detectors.on(method):
            for _ in range(3):
                step()
    times: dict[str, list[float]] = {m: [] for m in methods}
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    order = list(methods)
    for _ in range(rounds):
        random.shuffle(order)
        this_round = {}
        for method in order:
            with detectors.on(method):
                step()  # untimed: the first step after switching methods warms caches
                _sync(device)
                start = time.perf_counter()
                for _ in range(steps):
                    step()
                _sync(device)
                this_round[method] = (time.perf_counter() - start) / steps
        for method in methods:
            times[method].append(this_round[method])
            ratios[method].append(this_round[method] / this_round["none"])
    out = {}
    for m in methods:
        q1, _, q3 = statistics.quantiles(ratios[m], n=4) if rounds > 1 else (1.0, 1.0, 1.0)
        out[m] = (statistics.median(times[m]), statistics.median(ratios[m]), q1, q3)
    return out


def _live_tensor_bytes() -> int:
    """Bytes of the tensor storages Python can reach (params, grads, optimizer state...)."""
    seen: set[int] = set()
    total = 0
    with warnings.catch_warnings():  # isinstance() touches deprecated module attributes
        warnings.simplefilter("ignore")
        tensors = [obj for obj in gc.get_objects() if isinstance(obj, Tensor)]
    for obj in tensors:
        if obj.device.type == "cpu" and obj.layout is torch.strided:
            storage = obj.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total


def peak_memory(
    step: Callable[[], None], detectors: Detectors, device: torch.device, method: str
) -> int:
    """Peak bytes of tensor memory in use during one step (after warm-up)."""
    with detectors.on(method):
        step()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            step()
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device)
        from torch.profiler import ProfilerActivity, profile

        gc.collect()
        start = _live_tensor_bytes()  # what is alive when the step begins...
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    current = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        current += e.nbytes()  # ...plus what the step allocates, minus what it frees
        peak = max(peak, current)
    return start + peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(models.CASES), choices=models.CASES)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--steps", type=int, default=0, help="steps per round (0: by model)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: unchanged)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    methods = tuple(dict.fromkeys(["none", *args.methods]))
    torch.manual_seed(0)
    random.seed(0)
    print(
        f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads, "
        f"{args.rounds} interleaved rounds: median time per step, median ratio to none "
        "[interquartile range of the per-round ratios]"
    )
    header = "| model | " + " | ".join(methods) + " |"
    print(header)
    print("|" + "---|" * (len(methods) + 1))
    mem_rows = []
    for name in args.models:
        model, batch, loss_fn = models.CASES[name](device)
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        step = make_step(model, batch, loss_fn, opt)
        detectors = Detectors(model, opt)
        steps = args.steps or {"mlp": 20, "cnn": 3, "transformer": 3}[name]
        result = time_methods(step, detectors, device, methods, args.rounds, steps)
        cells = []
        for m in methods:
            seconds, ratio, q1, q3 = result[m]
            spread = "" if m == "none" else f" **{ratio:.3f}x** [{q1:.2f}-{q3:.2f}]"
            cells.append(f"{seconds * 1e3:.2f} ms{spread}")
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
        if not args.no_memory:
            base = peak_memory(step, detectors, device, "none")
            guarded = peak_memory(step, detectors, device, "nanguard")
            mem_rows.append((name, base, guarded))
    if mem_rows:
        print("\npeak tensor memory of one training step")
        print("| model | none | nanguard | ratio |")
        print("|---|---|---|---|")
        for name, base, guarded in mem_rows:
            print(
                f"| {name} | {base / 2**20:.2f} MiB | {guarded / 2**20:.2f} MiB "
                f"| {guarded / base:.3f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
