"""Forwards from several real threads on one guarded model give a whole log."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import Tensor, nn

import nanguard


class LogHead(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)


def model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8), LogHead(), nn.Linear(8, 2))


def run_threads(target: Callable[[int], None], n: int) -> None:
    """Start ``n`` threads and re-raise the first error any of them hit."""
    errors: list[BaseException] = []

    def wrapped(i: int) -> None:
        try:
            target(i)
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def test_inference_forwards_in_threads() -> None:
    m = model().eval()
    per_thread, n_threads = 25, 6
    with nanguard.watch(m, on_nonfinite="log", max_events=100_000) as guard:

        def work(i: int) -> None:
            gen = torch.Generator().manual_seed(i)
            for _ in range(per_thread):
                with torch.no_grad():
                    m(torch.randn(4, 16, generator=gen))

        run_threads(work, n_threads)
    origins = [e for e in guard.events if e.is_origin]
    nans = sum(1 for e in origins if e.kind == "nan")
    # Every forward took a log of some negative value: one origin per forward.
    assert len(origins) == nans == per_thread * n_threads
    for event in origins:
        assert (event.module, event.module_type, event.phase) == ("3", "LogHead", "forward")
        assert event.stats is not None
        assert event.stats.shape == (4, 8)
        assert 0 < event.stats.nan_count <= 32
        assert event.n_propagated == 2  # "4" and the model: nothing from another thread


def test_training_forwards_in_threads_resolved_by_one_step() -> None:
    m = model()
    with nanguard.watch(m, on_nonfinite="log", max_events=100_000) as guard:

        def work(i: int) -> None:
            gen = torch.Generator().manual_seed(100 + i)
            for _ in range(5):
                m(torch.randn(2, 16, generator=gen)).sum().backward()

        run_threads(work, 4)
        events = guard.step()
    # Every forward's origin is accounted for: the first one, then the same operation
    # made again by later forwards one by one, the rest counted in the step's summary (a
    # step reports a few findings, not one per forward).
    origins = [e for e in events if e.is_origin]
    again = [e for e in events if e.details.get("reason") == "made_again"]
    summarized = sum(e.details.get("origins", 0) for e in events if not e.is_origin)
    assert len(origins) + len(again) + summarized == 20
    assert len(origins) == 1
    assert all(e.module == "3" and not e.is_origin for e in again)
    assert {e.module for e in origins} == {"3"}
    assert guard.events == events


def test_event_log_is_consistent_under_concurrent_steps() -> None:
    m = model()
    guard = nanguard.watch(m, on_nonfinite="log", max_events=50)
    try:

        def work(i: int) -> None:
            for _ in range(10):
                with torch.no_grad():
                    m(torch.randn(3, 16))
                guard.events  # noqa: B018 - reading while others write
                guard.dropped  # noqa: B018

        run_threads(work, 4)
    finally:
        guard.detach()
    events = guard.events
    assert len(events) == 50
    assert guard.dropped == 40 * 3 - 50  # each forward: origin + two propagated
    assert all(isinstance(e, nanguard.Event) for e in events)
