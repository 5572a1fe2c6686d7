"""From a review of scientific models: a model called many times in a step by code outside
it, each call fed what the last returned (a neural ODE's function under a solver, as
torchdiffeq's odeint runs it). The backward runs the calls in reverse: a NaN made in the
last call's backward reaches every earlier call's outputs, which is no loss origin."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanguard


class CentralField(nn.Module):
    """dy/dt = -mag(|y|) * y / |y|: a trajectory at the equilibrium y = 0 stays there,
    and sqrt's derivative at 0 is infinite in every call's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.mag = nn.Sequential(nn.Linear(1, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, t: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        r = torch.sqrt((y**2).sum(-1, keepdim=True))
        return -self.mag(r) * y / (r + 1e-6)


def odeint_rk4(func: nn.Module, y0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    ys, y = [y0], y0
    for i in range(len(t) - 1):
        h = t[i + 1] - t[i]
        k1 = func(t[i], y)
        k2 = func(t[i] + h / 2, y + h / 2 * k1)
        k3 = func(t[i] + h / 2, y + h / 2 * k2)
        k4 = func(t[i] + h, y + h * k3)
        y = y + h / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
        ys.append(y)
    return torch.stack(ys)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("points", [3, 11])  # 8 and 40 calls of the function
def test_a_backward_nan_in_the_last_solver_call_is_the_one_origin(mode: str, points: int) -> None:
    torch.manual_seed(0)
    func = CentralField()
    opt = torch.optim.Adam(func.parameters(), 1e-3)
    y0 = torch.randn(64, 2)
    y0[7] = 0.0  # the equilibrium point is in the data
    t = torch.linspace(0, 1, points)
    target = y0[None] * torch.exp(-t)[:, None, None]
    with nanguard.watch(func, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = guard.check_loss(((odeint_rk4(func, y0, t) - target) ** 2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origins = [e for e in guard.events if e.is_origin]
    calls = 4 * (points - 1)
    assert [(e.phase, e.module, e.tensor) for e in origins] == [("backward", "", "grad of args[1]")]
    assert origins[0].details["forward"] == calls  # (the last call: its backward ran first)
    if calls <= 8:  # (replayed: the output gradients of the first 8 calls are kept)
        assert origins[0].op == "aten.div.Tensor in SqrtBackward0"
        assert origins[0].source is not None
        assert "torch.sqrt((y**2)" in origins[0].source
    assert "the loss computation" not in origins[0].message


class Tower(nn.Module):
    """A submodule keeping its regulariser as an attribute, as MoE routers keep their
    balance loss (``self.aux_loss``) for the training loop to add."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 32)
        with torch.no_grad():
            self.emb.weight[500:].zero_()  # cold-start rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids)
        self.aux_loss = torch.sqrt((e * e).sum(-1)).mean()  # sqrt at 0 for a cold row
        return e


class Ranker(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tower = Tower()
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.tower(ids)).squeeze(-1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_backward_nan_through_a_stored_aux_loss_names_the_term(mode: str) -> None:
    torch.manual_seed(0)
    model = Ranker()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    ids = torch.randint(0, 500, (256,))
    ids[3] = 700  # a new id: its row is still 0
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        pred = model(ids)
        loss = guard.check_loss(((pred - 1) ** 2).mean() + 1e-3 * model.tower.aux_loss)
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError) as raised:
            opt.step()
    event = raised.value.event
    assert (event.phase, event.module, event.param) == ("grad", "tower", "tower.emb.weight")
    assert event.details["reason"] == "stored_backward"
    assert "`self.aux_loss` of `tower` (Tower)" in event.message
    assert "changed after autograd" not in event.message
    assert event.hint is not None
    assert "sqrt, whose slope is Inf at 0" in event.hint
