"""From a review that reproduced public bug reports of training gone NaN/Inf."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class PointerHead(nn.Module):
    """allennlp's ``masked_log_softmax`` (allenai/allennlp#890): the mask enters through
    ``mask.log()``, -inf where a position is padding. An empty passage masks a whole row,
    and log_softmax of an all -inf row is NaN."""

    def __init__(self, softmax: str) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 1)
        self.softmax = softmax

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x).squeeze(-1) + mask.log()
        if self.softmax == "log_softmax":
            return torch.log_softmax(logits, -1)
        return torch.softmax(logits, -1).clamp_min(1e-9).log()  # attention pooling


def _train(model: PointerHead, mode: str, masked_row: int | None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode):
        for step in range(4):
            x = torch.randn(8, 30, 16)
            mask = torch.ones(8, 30)
            mask[:, 20:] = 0  # padding: -inf on purpose, every step
            if step == 3 and masked_row is not None:
                mask[masked_row] = 0  # an empty passage
            out = model(x, mask)
            loss = F.nll_loss(out, torch.randint(0, 20, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("softmax", ["log_softmax", "softmax"])
def test_a_row_masked_through_the_log_of_its_mask_names_the_softmax(
    mode: str, softmax: str
) -> None:
    torch.manual_seed(0)
    model = PointerHead(softmax)
    _train(model, mode, masked_row=None)  # the padding's -inf alone: quiet
    torch.manual_seed(0)
    with pytest.raises(nanguard.NonFiniteError) as raised:
        _train(PointerHead(softmax), mode, masked_row=5)
    event = raised.value.event
    assert (event.step, event.phase, event.module) == (3, "forward", "")
    # Not the log: it wrote the mask's -inf, as every step did.
    assert event.op == (
        "aten._log_softmax.default" if softmax == "log_softmax" else "aten._softmax.default"
    )
    assert "every position is masked" in event.hint
