"""From a review with recommendation, tabular and meta-learning training code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


def sparsemax(z: torch.Tensor) -> torch.Tensor:
    """pytorch-tabnet's sparsemax: on a NaN row the support is empty, and the gather at
    index -1 raises (an IndexError-like RuntimeError that names no NaN)."""
    zs, _ = torch.sort(z, dim=-1, descending=True)
    k = torch.arange(1, z.size(-1) + 1, dtype=z.dtype)
    cs = zs.cumsum(-1) - 1
    support = ((k * zs) > cs).sum(-1, keepdim=True)
    tau = cs.gather(-1, support - 1) / support.to(z.dtype)
    return torch.clamp(z - tau, min=0)


class AttentiveTransformer(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparsemax(self.bn(self.fc(x)))


class TabNetStep(nn.Module):
    def __init__(self, d: int = 20) -> None:
        super().__init__()
        self.bn0 = nn.BatchNorm1d(d)
        self.att = AttentiveTransformer(d)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.bn0(x)
        return self.head(self.att(x) * x)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_error_a_nan_row_causes_carries_the_nan_batch_as_a_note(mode: str) -> None:
    # A missing value in the batch, not imputed: the sparsemax raises about an index.
    torch.manual_seed(0)
    model = TabNetStep()
    opt = torch.optim.Adam(model.parameters())
    x, y = torch.randn(256, 20), torch.randint(0, 2, (256,))
    x[5, 3] = float("nan")
    with (
        pytest.warns(nanguard.NonFiniteWarning),
        nanguard.watch(model, optimizer=opt, mode=mode) as guard,
        pytest.raises(RuntimeError, match="index -1 is out of bounds") as raised,
    ):
        F.cross_entropy(model(x), y)
    (note,) = raised.value.__notes__
    assert note.startswith("nanguard: the forward had gone non-finite before this error")
    assert "It is in sample 5 (of 256 along dim 0). Column (dim 1): 3." in note
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("input", "args[0]")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_error_about_something_else_gets_no_note(mode: str) -> None:
    # A shape error with a finite batch: nothing of nanguard's to say, nothing replayed.
    torch.manual_seed(0)
    model = TabNetStep()
    with (
        nanguard.watch(model, mode=mode) as guard,
        pytest.raises(RuntimeError, match="running_mean should contain 21 elements") as raised,
    ):
        model(torch.randn(8, 21))
    assert not getattr(raised.value, "__notes__", [])
    assert guard.events == []
