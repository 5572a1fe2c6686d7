"""Events and statistics: exact, JSON round trips, readable."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import nanguard
from nanguard import Event, TensorStats


def test_stats_are_exact() -> None:
    t = torch.tensor([[1.0, float("nan"), float("inf")], [-2.0, float("-inf"), float("nan")]])
    s = TensorStats.of(t)
    assert (s.shape, s.numel, s.dtype, s.device) == ((2, 3), 6, "torch.float32", "cpu")
    assert (s.nan_count, s.posinf_count, s.neginf_count, s.inf_count) == (2, 1, 1, 2)
    assert (s.min, s.max, s.mean, s.std) == (-2.0, 1.0, -0.5, 1.5)
    assert s.finite_count == 2
    assert s.first_values[:2] == (1.0, pytest.approx(float("nan"), nan_ok=True))
    assert math.isnan(s.first_values[1])
    assert s.first_values[2] == math.inf


def test_stats_of_all_non_finite_and_half_and_complex() -> None:
    s = TensorStats.of(torch.full((4,), float("nan"), dtype=torch.float16))
    assert s.nan_count == 4
    assert s.min is None
    assert s.mean is None
    assert "no finite value at all" in s.summary()
    c = TensorStats.of(torch.tensor([1 + 1j, complex(float("nan"), 0)]))
    assert c.dtype == "torch.complex64"
    assert c.nan_count == 1  # counted over the real view: (1, 1, nan, 0)
    big = TensorStats.of(torch.randn(1000, 1000))
    assert big.nonfinite_count == 0
    assert len(big.first_values) == 10


def make_event() -> Event:
    stats = TensorStats.of(torch.tensor([0.5, float("nan"), float("-inf")]))
    return Event(
        step=7,
        phase="forward",
        module="encoder.layers.0",
        module_type="TransformerEncoderLayer",
        param=None,
        kind="nan",
        is_origin=True,
        stats=stats,
        rank=0,
        message="nanguard: step 7: ...",
        call=1,
        tensor="output",
        propagated=("encoder.norm", ""),
        n_propagated=2,
        time=123.5,
        details={"reason": "output", "nonfinite_params": ["encoder.layers.0.linear1.weight"]},
    )


def test_event_round_trips_through_strict_json() -> None:
    event = make_event()
    text = json.dumps(event.to_dict(), allow_nan=False)  # strict JSON: no bare NaN
    assert Event.from_dict(json.loads(text)) == event
    assert json.loads(text)["stats"]["first_values"][1] == "nan"


def test_event_is_frozen_and_prints_its_message() -> None:
    event = make_event()
    with pytest.raises(AttributeError):
        event.step = 3  # type: ignore[misc]
    assert str(event) == event.message
    assert event.where == "encoder.layers.0#1"


def test_events_are_hashable_and_dedupe_with_the_log_file(tmp_path: Path) -> None:
    # A frozen dataclass is hashable; its details dict made set(guard.events) raise.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    path = tmp_path / "events.jsonl"
    x = torch.randn(6, 4)
    x[2, 1] = float("nan")
    with nanguard.watch(model, on_nonfinite="log", log_path=path) as guard:
        model(x).sum().backward()
        guard.step()
    events = guard.events
    assert any(e.details for e in events)
    both = set(events) | set(nanguard.read_events(path))
    assert len(both) == len(events)
    assert {make_event(): 1}[make_event()] == 1


def test_phases_and_kinds_are_published() -> None:
    assert nanguard.PHASES == ("input", "forward", "loss", "backward", "grad", "param")
    assert nanguard.KINDS[:2] == ("nan", "inf")
