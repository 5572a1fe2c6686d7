"""State-space and recurrent models, from a review with real model code (Mamba-style
selective scans): an Inf a parameter's exp made and the forward hid, a recurrence that
overflows before any optimizer step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nanguard


class SelectiveSSM(nn.Module):
    """Mamba's discretisation (mamba-minimal): A = -exp(A_log), deltaA = exp(delta * A)."""

    def __init__(self, d: int = 32, n: int = 8) -> None:
        super().__init__()
        self.proj = nn.Linear(d, d)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1).float()).repeat(d, 1))
        self.out = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        delta = F.softplus(self.proj(x))
        A = -torch.exp(self.A_log)  # -inf where A_log passed 88.7
        deltaA = torch.exp(delta.unsqueeze(-1) * A)  # exp(-inf) = 0: the forward stays finite
        return self.out((deltaA * x.unsqueeze(-1)).sum(-1))


def _raised(model: nn.Module, x: Tensor, mode: str) -> nanguard.Event:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode):
        loss = model(x).pow(2).mean()
        assert torch.isfinite(loss)
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError) as raised:
            opt.step()
    return raised.value.event


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_inf_a_parameters_exp_made_and_the_forward_hid_is_named_in_the_backward_hint(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = SelectiveSSM()
    with torch.no_grad():
        model.A_log[:4, -1] = 89.0  # a log-rate drifted past exp's float32 limit
    event = _raised(model, torch.randn(16, 32), mode)
    assert (event.phase, event.module, event.kind) == ("backward", "", "nan")
    assert event.op == "aten.mul.Tensor in MulBackward0"
    assert event.source is not None
    assert "deltaA = torch.exp(delta.unsqueeze(-1) * A)" in event.source
    assert event.hint is not None
    # Not a log(0) behind torch.where (there is none): the exp of the parameter, its line.
    assert "log(0)" not in event.hint
    assert "made by aten.exp.default at " in event.hint
    assert "A = -torch.exp(self.A_log)" in event.hint
    assert "its input reached 89" in event.hint


class PositiveDecayScan(nn.Module):
    """A selective scan with the minus sign of A forgotten: every step multiplies by > 1."""

    def __init__(self, d: int = 64, n: int = 16) -> None:
        super().__init__()
        self.dt = nn.Linear(d, d)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, n + 1).float()).repeat(d, 1))
        self.out = nn.Linear(d, d)

    def forward(self, u: Tensor) -> Tensor:
        A = torch.exp(self.A_log)  # should be -exp(A_log)
        dA = torch.exp(F.softplus(self.dt(u)).unsqueeze(-1) * A)
        x = u.new_zeros(u.size(0), u.size(2), A.size(1))
        ys = []
        for t in range(u.size(1)):
            x = dA[:, t] * x + u[:, t].unsqueeze(-1)
            ys.append(x.sum(-1))
        return self.out(torch.stack(ys, 1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_overflow_before_any_optimizer_step_is_not_blamed_on_the_learning_rate(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = PositiveDecayScan()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode):
        loss = model(torch.randn(4, 128, 64)).pow(2).mean()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError) as raised:
            opt.step()
    event = raised.value.event
    assert (event.step, event.phase, event.module) == (0, "forward", "")
    assert event.op == "aten.mul.Tensor"
    assert event.source is not None
    assert "x = dA[:, t] * x + u[:, t].unsqueeze(-1)" in event.source
    assert event.hint is not None
    assert "no optimizer step has moved the weights" in event.hint
    assert "recurrence whose factor exceeds 1" in event.hint
    assert "learning rate," not in event.hint.lower()
