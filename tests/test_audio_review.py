"""From a review with audio and speech models (log-mel front ends, SpecAugment, Conv1d
encoders over (batch, time, mels) features)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class TimeMask(nn.Module):
    """SpecAugment's time mask, filled with -inf (frames 10..19 of every clip)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros_like(x, dtype=torch.bool)
        mask[:, 10:20] = True
        return x.masked_fill(mask, float("-inf"))


class LogMel(nn.Module):
    """A log-mel front end without a floor: log(0) on a silent clip."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x.clamp_min(0))


class Encoder(nn.Module):
    """(batch, time, mels) features transposed to (batch, mels, time) for the Conv1d, as
    every log-mel -> Conv1d front end does."""

    def __init__(self, front: nn.Module, layout: str) -> None:
        super().__init__()
        self.front = front
        self.layout = layout
        self.conv = nn.Conv1d(80, 32, 5, padding=2)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.front(x)
        x = x.transpose(1, 2) if self.layout == "transpose" else x.permute(0, 2, 1).contiguous()
        return self.head(self.conv(x).mean(-1))


def _origin(model: nn.Module, mode: str, x: torch.Tensor) -> nanguard.Event:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    y = torch.randint(0, 4, (x.shape[0],))
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        loss = guard.check_loss(F.cross_entropy(model(x), y))
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    assert guard.origin is not None
    return guard.origin


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("layout", ["transpose", "permute"])
def test_a_minus_inf_time_mask_transposed_before_a_conv_is_a_mask(mode: str, layout: str) -> None:
    # The -inf is the mask's, written on purpose; the Conv1d mixing it with weights of both
    # signs makes the NaN. Not the encoder's own code (the transpose made nothing).
    torch.manual_seed(0)
    origin = _origin(Encoder(TimeMask(), layout), mode, torch.randn(4, 101, 80))
    assert (origin.phase, origin.module, origin.kind) == ("forward", "conv", "nan")
    assert origin.op == "aten.convolution.default"
    assert origin.hint is not None
    assert "written as a mask" in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_log_of_silence_transposed_before_a_conv_is_the_log(mode: str) -> None:
    torch.manual_seed(0)
    x = torch.rand(4, 101, 80)
    x[2] = 0.0  # a silent clip
    origin = _origin(Encoder(LogMel(), "transpose"), mode, x)
    assert (origin.phase, origin.module, origin.kind) == ("forward", "front", "inf")
    assert origin.op == "aten.log.default"


class PriorEncoder(nn.Module):
    """A -inf time mask whose scores only a softmax reads (harmless), and a log-prior table
    with log(0) at one frame that the encoder's own code adds before the Conv1d (the bug)."""

    def __init__(self) -> None:
        super().__init__()
        self.front = TimeMask()
        self.conv = nn.Conv1d(80, 32, 5, padding=2)
        self.head = nn.Linear(32, 4)
        counts = torch.ones(101)
        counts[50] = 0
        self.log_prior = torch.log(counts / counts.sum())  # (a plain attribute)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.front(x), 1)
        z = x + self.log_prior[None, :, None]
        h = self.conv(z.transpose(1, 2))
        return self.head(h.mean(-1)) + (w.sum((1, 2))[:, None] - 80)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_minus_inf_the_parent_added_is_not_taken_for_a_childs_mask(mode: str) -> None:
    # The mask's -inf are not the values passed to the Conv1d (their count differs).
    torch.manual_seed(0)
    origin = _origin(PriorEncoder(), mode, torch.randn(4, 101, 80))
    assert (origin.phase, origin.module, origin.kind) == ("forward", "", "inf")
    assert origin.tensor == "args[0] of conv"
