"""State-space models and PINNs, from reviews with real model code: an Inf a parameter's
exp made and the forward hid (Mamba's selective scan), a recurrence that overflows before any
optimizer step, a derivative through the model made non-finite where it reads its inputs."""

from __future__ import annotations

from typing import Any

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
    assert "no optimizer step has moved the watched weights" in event.hint
    assert "recurrence whose factor exceeds 1" in event.hint
    assert "lower the learning rate" not in event.hint.lower()


class PolarFeatures(nn.Module):
    """A PINN's input encoding: the coordinates and their radius, sqrt(x^2 + y^2)."""

    def forward(self, X: Tensor) -> Tensor:
        x, y = X[:, 0:1], X[:, 1:2]
        r = torch.sqrt(x**2 + y**2)  # its derivative is 0/0 at the origin
        return torch.cat([x, y, r], 1)


class InlinePolarPINN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, X: Tensor) -> Tensor:
        r = torch.sqrt((X**2).sum(1, keepdim=True))
        return self.net(torch.cat([X, r], 1))


def polar_pinn() -> nn.Module:
    return nn.Sequential(PolarFeatures(), nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize(
    ("make", "module", "line"),
    [
        (polar_pinn, "0", "r = torch.sqrt(x**2 + y**2)"),
        (InlinePolarPINN, "", "r = torch.sqrt((X**2).sum(1, keepdim=True))"),
    ],
)
def test_a_pinn_derivative_made_non_finite_where_the_model_reads_its_coordinates(
    mode: str, make: Any, module: str, line: str
) -> None:
    # The residual is built on u_x = autograd.grad(u, X, create_graph=True): at the
    # collocation point (0, 0) the backward of the sqrt that reads the coordinates makes the
    # NaN, which exists only in the gradient reaching the model's input.
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        X = torch.rand(64, 2) * 2 - 1
        X[0] = 0.0
        X.requires_grad_(True)
        u = model(X)
        u_x = torch.autograd.grad(u, X, torch.ones_like(u), create_graph=True)[0][:, 0]
        loss = guard.check_loss((u_x**2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("backward", module, "nan")
    assert origin.details["reason"] == "derivative"
    assert origin.op == "aten.div.Tensor in SqrtBackward0"
    assert origin.source is not None
    assert line in origin.source
    assert origin.hint is not None
    assert "derivative of sqrt is infinite at 0" in origin.hint
