"""Training recipes as popular repositories write them (timm, nanoGPT, segmentation)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nanguard


def _dice_over_foreground(logits: Tensor, target: Tensor) -> Tensor:
    """1 - Dice, averaged over the images that have foreground (as many repos write it)."""
    p, t = torch.sigmoid(logits).flatten(1), target.flatten(1)
    dice = (2 * (p * t).sum(1) + 1.0) / (p.sum(1) + t.sum(1) + 1.0)
    return 1 - dice[t.sum(1) > 0].mean()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_dice_over_no_foreground_image_is_named_a_mean_over_nothing(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 1, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, background = torch.randn(4, 3, 32, 32), torch.zeros(4, 1, 32, 32)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is torch.bfloat16):
            logits = model(x)
        logits = logits.float()
        loss = F.binary_cross_entropy_with_logits(logits, background)
        loss = guard.check_loss(loss + _dice_over_foreground(logits, background))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "a mean over an empty selection" in origin.hint
    assert "round to exactly 0 or 1" not in origin.hint
    assert "pos_weight" not in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_running_statistics_an_earlier_step_overflowed_are_not_laid_on_an_eval_forward(
    mode: str,
) -> None:
    """A huge but finite training batch overflows BatchNorm's running_var (its output stays
    finite); then a validation forward, in eval() under no_grad, reads a NaN batch. That
    forward wrote no running statistics: the buffer is an origin of its own."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for scale in (1.0, 1.0, 1e21):
            loss = model(torch.randn(16, 4) * scale).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        assert not torch.isfinite(model[1].running_var).all()
        model.eval()
        batch = torch.randn(4, 4)
        batch[0, 0] = float("nan")
        with torch.no_grad():
            model(batch)
    origins = {(e.phase, e.tensor): e for e in guard.events if e.is_origin}
    assert ("input", "args[0]") in origins
    assert "wrote non-finite values into the running statistics" not in (
        origins["input", "args[0]"].message
    )
    buffer = ("param", "1.running_var")
    assert buffer in origins
    assert "Running statistics" in origins[buffer].message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("policy", ["skip_step", "log"])
def test_a_validation_pass_without_eval_that_poisons_batchnorm_says_so(
    mode: str, policy: str
) -> None:
    """Validation under no_grad with model.eval() forgotten: BatchNorm, still in train mode,
    writes a NaN batch's statistics into its running buffers. No optimizer step is there to
    skip: the origin says the buffers stay non-finite (under skip_step too), and a later
    eval() forward says that evaluation, not training, is what cannot recover."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def train_step() -> None:
        x, y = torch.randn(32, 10), torch.randint(0, 2, (32,))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite=policy) as guard:
        for _ in range(3):
            train_step()
        batch = torch.randn(16, 10)
        batch[4, 7] = float("nan")  # a missing value
        with torch.no_grad():
            model(batch)
        for _ in range(2):
            train_step()
        assert all(torch.isfinite(p).all() for p in model.parameters())
        model.eval()
        with torch.no_grad():
            model(torch.randn(16, 10))
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (3, "input")
    skip = (
        " (skip_step puts back what a training step wrote, not this)"
        if policy == "skip_step"
        else ""
    )
    assert (
        "This forward (gradients off, its norms in train() mode: a validation pass without "
        "model.eval()?) also wrote non-finite values into the running statistics "
        f"`1.running_mean`, `1.running_var`: they stay so{skip}, and eval() outputs"
    ) in origin.message
    later = " ".join(e.message for e in guard.events if e.step > 3)
    assert "training cannot recover by itself" not in later
    if mode == "full":  # (a sentinel step reports no propagated calls one by one)
        assert (
            "The buffers `1.running_mean`, `1.running_var` are non-finite: eval() forwards "
            "read them (training-mode ones do not)"
        ) in later
