"""A model changed while it is watched, as training scripts do: a head replaced and given
to the optimizer, a checkpoint loaded, micro-batches accumulated, layers fused."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import nanguard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_head_replaced_and_added_to_the_optimizer_has_its_gradients_checked(mode: str) -> None:
    """model[2] = nn.Linear(...) with as many parameters as the old head: the new head's
    NaN gradient is caught in its step, before the optimizer applies it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)
    try:
        with pytest.raises(nanguard.NonFiniteError) as raised:  # noqa: PT012
            for step in range(12):
                if step == 3:
                    model[2] = nn.Linear(16, 1)
                    opt.add_param_group({"params": list(model[2].parameters())})
                if step == 10:  # a NaN made in this weight's gradient alone
                    model[2].weight.register_hook(lambda g: g * float("nan"))
                loss = model(torch.randn(4, 8)).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        guard.detach()
    event = raised.value.event
    assert (event.step, event.phase, event.param) == (10, "backward", "2.weight")
    assert torch.isfinite(model[2].weight).all()


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, steps: int, before: dict[int, Any]
) -> None:
    for step in range(steps):
        if step in before:
            before[step]()
        loss = model(torch.randn(16, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_checkpoint_loaded_mid_training_is_not_blamed_on_adams_eps(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps=1e-8
    checkpoint = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint["2.weight"][1, 3] = float("nan")
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        _train(model, opt, 6, {4: lambda: model.load_state_dict(checkpoint)})
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("param", "2.weight")
    # (load_state_dict() on the watched model is seen: the checkpoint is named, not Adam.)
    assert origin.details["reason"] == "loaded_checkpoint"
    assert "since load_state_dict() loaded it in step 4" in origin.message
    assert origin.hint is not None
    assert "earlier checkpoint" in origin.hint
    assert "Set eps > 0" not in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_in_a_loaded_optimizer_state_is_named(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _train(model, opt, 2, {})
    state = copy.deepcopy(opt.state_dict())
    state["state"][0]["exp_avg_sq"][0, 0] = float("nan")
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        _train(model, opt, 6, {3: lambda: opt.load_state_dict(state)})
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("param", "0.weight")
    assert origin.hint is not None
    assert "optimizer's own state for this weight is already non-finite (`exp_avg_sq`)" in (
        origin.hint
    )


class _Length(nn.Module):
    """The length of each feature vector: its backward is 0/0 at a zero vector."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.sqrt((h * h).sum(-1, keepdim=True))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_backward_origin_in_an_accumulated_micro_batch_says_which(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), _Length(), nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        opt.zero_grad()
        for micro in range(1, 5):
            x = torch.randn(4, 8)
            if micro == 3:
                x[1] = 0.0  # a zero feature vector: sqrt's backward at 0
            (model(x).pow(2).mean() / 4).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "1")
    assert origin.details["forward"] == 3
    assert "(It was the backward of forward 3 of the step.)" in origin.message


def test_a_weight_a_fusion_made_infinite_is_not_blamed_on_a_step() -> None:
    """Deployment after training: fuse_conv_bn_eval folds a BatchNorm with eps=0 and a dead
    channel (running_var 0) into a new conv, whose weight is Inf from the start."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(3):
            loss = model(torch.randn(4, 3, 8, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        bn = model[1]
        assert isinstance(bn, nn.BatchNorm2d)
        bn.running_var[2] = 0.0
        bn.eps = 0.0
        model[0] = torch.nn.utils.fuse_conv_bn_eval(model[0], bn)
        model[1] = nn.Identity()
        with torch.no_grad():
            model(torch.randn(2, 3, 8, 8))
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param, origin.kind) == ("param", "0.weight", "inf")
    assert "what built it wrote that value (fuse_conv_bn_eval" in origin.message
    assert "of a step between" not in origin.message


def test_steps_keep_their_numbers_after_the_optimizer_is_swapped_unwatched() -> None:
    """A two-phase recipe builds a new optimizer without watching again: once the guard
    takes its steps for the training steps, the steps before count too."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Sigmoid(), _Log(), nn.Linear(16, 1))
    opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with (
        warnings.catch_warnings(),
        nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard,
    ):
        warnings.simplefilter("ignore", RuntimeWarning)  # (the swap is noticed, and said)
        for step in range(50):
            if step == 5:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            x = torch.randn(8, 8)
            if step == 45:
                x[0] = -1e4  # sigmoid underflows to 0: log(0)
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.module) == (45, "2")


class _Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)
