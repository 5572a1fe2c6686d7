"""Losses built from gradients and features of coordinates (PINNs, gradient penalties,
Jacobian regularisers), and the derivatives that break at 0."""

from __future__ import annotations

import torch
from torch import Tensor, nn

import nanguard


class _Polar(nn.Module):
    """Polar features of 2-D points: a radius and an angle."""

    def __init__(self, feature: str) -> None:
        super().__init__()
        self.feature = feature

    def forward(self, xy: Tensor) -> Tensor:
        x, y = xy[:, :1], xy[:, 1:]
        if self.feature == "hypot":
            return torch.cat([torch.hypot(x, y), xy], dim=1)
        return torch.cat([torch.atan2(y, x), xy], dim=1)


def test_the_slope_of_a_radius_at_the_origin_gets_the_norm_hint() -> None:
    """torch.hypot(x, y) at (0, 0) in a PINN's first derivative: the same hint as a norm."""
    torch.manual_seed(0)
    model = nn.Sequential(_Polar("hypot"), nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    points = torch.rand(512, 2) * 2 - 1
    points[7] = 0.0  # a collocation point at the origin
    points.requires_grad_(True)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        u = model(points)
        (du,) = torch.autograd.grad(u.sum(), points, create_graph=True)
        loss = guard.check_loss((du.sum(dim=1) - 1).pow(2).mean())  # a PDE residual
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "0")
    assert origin.op is not None
    assert origin.op.endswith("HypotBackward0")
    assert origin.hint is not None
    assert "derivative of a norm" in origin.hint
