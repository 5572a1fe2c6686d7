"""After the first failure of a long run: a raise caught and training continued, skips
that cannot recover, a guard used for a second run."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard


def _embedding_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """Adam with eps=0 on an embedding: rows not in the batch get 0/0, NaN, in step 0."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 16), nn.Flatten(), nn.Linear(64, 1))
    return model, torch.optim.Adam(model.parameters(), lr=1e-2, eps=0.0)


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randint(0, 100, (8, 4))).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_raise_caught_and_training_continued_still_stops_nonfinite_gradients(mode: str) -> None:
    """Every later step's gradients are NaN from the NaN embedding rows: 'raise' stops each
    before optimizer.step(), so the layers that are still finite stay finite."""
    model, opt = _embedding_model()
    raised = []
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for _ in range(6):
            try:
                _step(model, opt)
            except nanguard.NonFiniteError as error:
                raised.append(error.event)
    assert torch.isfinite(model[2].weight).all()
    assert torch.isfinite(model[2].bias).all()
    assert guard.origin is not None
    assert (guard.origin.phase, guard.origin.param) == ("param", "0.weight")
    held = [e for e in raised if e.details.get("reason") == "held_back"]
    assert len(held) >= 3
    assert "since the origin at step" in held[-1].message
    assert "before optimizer.step() applies them" in held[-1].message


def test_skip_step_giving_up_names_the_origin_of_the_nonfinite_weights() -> None:
    model, opt = _embedding_model()
    with (  # noqa: PT012
        nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step"),
        pytest.raises(nanguard.NonFiniteError) as raised,
    ):
        for _ in range(10):
            _step(model, opt)
    event = raised.value.event
    assert (event.step, event.phase, event.param, event.is_origin) == (0, "param", "0.weight", True)
    assert "in a row were skipped" in str(raised.value)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_guard_attached_again_for_a_second_run_forgets_the_gradient_norms(mode: str) -> None:
    """k-fold training with one guard: run 2 starts from fresh weights, whose larger early
    gradients are no explosion."""
    torch.manual_seed(0)
    teacher = nn.Linear(16, 1)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)

    def train(steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(64, 16)
            loss = nn.functional.mse_loss(model(x), teacher(x).detach() * 5)
            opt.zero_grad()
            loss.backward()
            opt.step()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", nanguard.NonFiniteWarning)
        train(300)
        guard.detach()
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.reset_parameters()
        opt.state.clear()
        guard.attach()
        train(50)
        guard.detach()
    assert [str(w.message) for w in seen] == []
    assert not [e for e in guard.events if e.kind == "grad_norm"]


def test_warn_says_once_that_the_weights_went_nonfinite_for_good() -> None:
    """'warn' lets a NaN batch's gradients into the weights: the next step says, once, at a
    warning's level, that training cannot recover (not only DEBUG records)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with (
        warnings.catch_warnings(record=True) as seen,
        nanguard.watch(model, optimizer=opt, on_nonfinite="warn"),
    ):
        warnings.simplefilter("always", nanguard.NonFiniteWarning)
        for step in range(12):
            x = torch.randn(16, 32)
            if step == 3:
                x[5, 2] = float("nan")
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    messages = [str(w.message) for w in seen]
    dead = [m for m in messages if "training cannot recover" in m]
    assert len(dead) == 1
    assert dead[0].startswith("nanguard: step 4: still non-finite")
    assert "(see the origin at step 3)" in dead[0]
    assert len(messages) == 2  # the batch at step 3, then this


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_later_steps_point_at_the_step_a_weight_origin_names(mode: str) -> None:
    # A weight written NaN between steps 4 and 5 is found at step 5 and named at step 4:
    # the later steps' "see the origin at step N" must say 4, the step the log holds it at.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(8):
            if step == 5:
                with torch.no_grad():
                    model[2].weight[0, 0] = float("nan")  # a bad in-place edit
            loss = guard.check_loss(model(torch.randn(4, 8)).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.param) == (4, "param", "2.weight")
    later = [e for e in guard.events if "see the origin at step" in e.message]
    assert later
    assert all("see the origin at step 4)" in e.message for e in later)


def test_gradscaler_skips_after_the_weights_went_nonfinite_say_so() -> None:
    """Adam(eps=0) makes embedding rows NaN; GradScaler then skips every step. Those skips
    are no overflow a smaller scale fixes, nor 'normal at the start'."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 16), nn.Flatten(), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    scaler = torch.amp.GradScaler("cpu")
    with nanguard.watch(model, optimizer=opt, scaler=scaler, on_nonfinite="log") as guard:
        for _ in range(16):
            x, y = torch.randint(0, 50, (8, 4)), torch.randn(8, 1)
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("param", "0.weight")
    skips = [e for e in guard.events if e.kind == "amp_overflow" and e.step > origin.step + 1]
    assert len(skips) >= 10
    for event in skips:
        assert "the weights themselves are non-finite (`0.weight`" in event.message
        assert "not an error" not in event.message
        assert "normal" not in event.message


def test_the_jsonl_file_of_a_dead_run_does_not_grow_a_line_a_step(tmp_path: Path) -> None:
    model, opt = _embedding_model()
    path = tmp_path / "events.jsonl"
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", log_path=str(path)) as guard:
        for _ in range(100):
            _step(model, opt)
    written = nanguard.read_events(path)
    summaries = [e for e in guard.events if "summary" in e.details]
    assert len(summaries) >= 95  # (the in-memory log keeps every step)
    kept = [e for e in written if "summary" in e.details]
    assert [e.step for e in kept] == [s.step for s in summaries[:10]] + [
        summaries[n - 1].step for n in (16, 32, 64)
    ]
    assert [e for e in written if e.is_origin] == [e for e in guard.events if e.is_origin]
