"""The bundled demo goes NaN partway through training and nanguard names the cause."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import torch

import nanguard
from nanguard import demo


def test_demo_training_goes_nan_partway_and_the_head_is_named(tmp_path: Path) -> None:
    printed = io.StringIO()
    guard = demo.train(log_path=str(tmp_path / "events.jsonl"), out=printed)
    assert "step  20  loss" in printed.getvalue()
    origin = guard.origin
    assert origin is not None
    assert 10 < origin.step < 300  # partway through, not at the first step
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "head", "GaussianHead")
    assert origin.tensor == "output[1]"
    assert origin.stats is not None
    assert origin.stats.neginf_count >= 1
    assert origin.stats.nan_count == 0
    assert not guard.attached
    assert nanguard.read_events(tmp_path / "events.jsonl")[0] == origin


def test_demo_stops_before_the_weights_are_corrupted() -> None:
    torch.manual_seed(0)
    guard = demo.train(out=io.StringIO())
    model = guard.model
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_demo_runs_as_a_module() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "nanguard.demo", "--steps", "300"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "origin     head (GaussianHead), phase 'forward'" in result.stdout
    assert "-Inf first appeared in the forward pass, in `head` (GaussianHead)" in result.stdout
    assert "propagated <model> -> loss" in result.stdout
