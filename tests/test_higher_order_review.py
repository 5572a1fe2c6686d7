"""Losses built from gradients and features of coordinates (PINNs, gradient penalties,
Jacobian regularisers), and the derivatives that break at 0."""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

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


def test_an_amp_gradient_penalty_overflow_is_a_gradscaler_skip_not_a_loss_origin() -> None:
    """The gradient-penalty recipe of PyTorch's AMP docs: the derivative of the scaled
    critic output overflows float16 at the first scale, the penalty and the loss are NaN,
    GradScaler skips the step and halves its scale. No origin, no raise, training on."""
    torch.manual_seed(0)
    critic = nn.Sequential(
        nn.Flatten(), nn.Linear(3072, 512), nn.LeakyReLU(0.2), nn.Linear(512, 256),
        nn.LeakyReLU(0.2), nn.Linear(256, 1),
    )  # fmt: skip
    opt = torch.optim.Adam(critic.parameters(), lr=1e-4, betas=(0.0, 0.9))
    scaler = torch.amp.GradScaler("cpu")
    real = torch.rand(64, 3, 32, 32) * 2 - 1
    losses = []
    with nanguard.watch(critic, optimizer=opt, scaler=scaler) as guard:  # "raise"
        for _ in range(3):
            fake = torch.rand(64, 3, 32, 32) * 2 - 1
            alpha = torch.rand(64, 1, 1, 1)
            interp = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
            with torch.autocast("cpu", dtype=torch.float16):
                scores = critic(interp)
            (scaled,) = torch.autograd.grad(scaler.scale(scores.sum()), interp, create_graph=True)
            grad = scaled * (1.0 / scaler.get_scale())
            with torch.autocast("cpu", dtype=torch.float16):
                penalty = ((grad.flatten(1).pow(2).sum(1).sqrt() - 1) ** 2).mean()
                loss = critic(fake).float().mean() - critic(real).float().mean() + 10 * penalty
            losses.append(guard.check_loss(loss).item())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert math.isnan(losses[0])
    assert all(math.isfinite(v) for v in losses[1:])
    assert guard.origin is None
    kinds = [(e.step, e.phase, e.kind) for e in guard.events]
    assert kinds == [(0, "grad", "amp_overflow"), (0, "loss", "nan")]
    assert guard.events[1].details["reason"] == "scaled_derivative"
    assert "GradScaler skipped" in guard.events[1].message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_made_by_a_second_derivative_is_not_called_unreproducible(mode: str) -> None:
    """atan2 at (0, 0): its slope is finite there, its second derivative is not; the PDE
    residual's backward differentiates the derivative and sends NaN into the points' grad.
    A replay reruns the first order only: the event says so, not 'a hardware fault'."""
    torch.manual_seed(0)
    model = nn.Sequential(_Polar("atan2"), nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    points = torch.rand(512, 2) * 2 - 1
    points[7] = 0.0
    points.requires_grad_(True)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        u = model(points)
        (du,) = torch.autograd.grad(u.sum(), points, create_graph=True)
        loss = guard.check_loss((du.sum(dim=1) - 1).pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert points.grad is not None
    assert int(points.grad.isnan().sum()) == 2
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("backward", "grad of args[0]")
    assert origin.reproducible is None
    assert "a second derivative made it" in origin.message
    assert "no non-finite value" not in origin.message
    assert "hardware fault" not in origin.message


class _Radial(nn.Module):
    def forward(self, xy: Tensor) -> Tensor:
        r = torch.linalg.vector_norm(xy, dim=1, keepdim=True)
        return torch.cat([xy, r, torch.exp(-r)], dim=1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_laplacian_residual_nan_points_at_second_derivatives(mode: str) -> None:
    """A Poisson PINN: u_xx + u_yy by nested autograd.grad; the radius' second derivative is
    NaN at the origin (its value and slope are finite there). The loss event says where to
    look, not only at the loss function."""
    torch.manual_seed(0)
    model = nn.Sequential(_Radial(), nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    points = torch.rand(512, 2) * 2 - 1
    points[7] = 0.0
    points.requires_grad_(True)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        u = model(points)
        (du,) = torch.autograd.grad(u.sum(), points, create_graph=True)
        u_xx = torch.autograd.grad(du[:, 0].sum(), points, create_graph=True)[0][:, 0]
        u_yy = torch.autograd.grad(du[:, 1].sum(), points, create_graph=True)[0][:, 1]
        loss = guard.check_loss((u_xx + u_yy + 1.0).pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert "second derivatives (u_xx" in origin.message


class _Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(1, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_maml_fast_weights_made_nan_by_a_support_sample_give_one_origin(mode: str) -> None:
    """Second-order MAML: one NaN support sample makes the inner gradient, the fast weights
    and so the query forward NaN. The sample is the origin; the query forward only carries
    it (through fast weights a replay does not rebuild)."""
    torch.manual_seed(0)
    model = _Regressor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    amplitude, phase = torch.rand(4, 1, 1) * 4.9 + 0.1, torch.rand(4, 1, 1) * 3.14
    xs, xq = torch.rand(4, 10, 1) * 10 - 5, torch.rand(4, 10, 1) * 10 - 5
    ys, yq = amplitude * torch.sin(xs + phase), amplitude * torch.sin(xq + phase)
    xs[2, 4, 0] = float("nan")
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        meta = torch.zeros(())
        for task in range(4):
            params = dict(model.named_parameters())
            for _ in range(2):
                inner = F.mse_loss(functional_call(model, params, (xs[task],)), ys[task])
                grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
                params = {n: p - 0.01 * g for (n, p), g in zip(params.items(), grads, strict=True)}
            meta = meta + F.mse_loss(functional_call(model, params, (xq[task],)), yq[task])
        meta = guard.check_loss(meta / 4)
        opt.zero_grad()
        meta.backward()
        opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.details.get("forward")) for e in origins] == [
        ("input", 7)
    ]  # (task 2, first inner step)


def test_sync_module_on_maml_fast_weights_reads_no_gradient_of_a_non_leaf() -> None:
    # Inside functional_call the module's "parameters" are the fast weights, non-leaf
    # tensors: reading their .grad makes torch warn, from nanguard's code, each time.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs, xq = torch.rand(10, 1) * 1000 - 500, torch.rand(10, 1) * 1000 - 500  # not normalised
    ys, yq = torch.sin(xs), torch.sin(xq)
    with (
        warnings.catch_warnings(record=True) as caught,
        nanguard.watch(model, optimizer=opt, on_nonfinite="raise", sync="module"),
        contextlib.suppress(nanguard.NonFiniteError),
    ):
        warnings.simplefilter("always")
        params = dict(model.named_parameters())
        for _ in range(3):  # the inner loop diverges: its third forward overflows
            inner = F.mse_loss(functional_call(model, params, (xs,)), ys)
            grads = torch.autograd.grad(inner, list(params.values()), create_graph=True)
            params = {n: p - 0.01 * g for (n, p), g in zip(params.items(), grads, strict=True)}
        meta = F.mse_loss(functional_call(model, params, (xq,)), yq)
        opt.zero_grad()
        meta.backward()
        opt.step()
    torch_warnings = [w for w in caught if not issubclass(w.category, nanguard.NonFiniteWarning)]
    assert [str(w.message)[:60] for w in torch_warnings] == []


class RadialFeatures(nn.Module):
    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        return torch.cat([xy, torch.sqrt((xy**2).sum(-1, keepdim=True))], -1)


class RadialPINN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat = RadialFeatures()
        self.mlp = nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.feat(xy))


def test_a_derivative_origin_in_the_steps_second_forward_says_which_forward() -> None:
    # Boundary points first, then a collocation grid holding the centre, whose radius
    # r = sqrt(x^2 + y^2) has a 0/0 derivative there (a Ritz energy on grad u).
    torch.manual_seed(0)
    model = RadialPINN()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        th = torch.rand(32) * 2 * math.pi
        ub = model(torch.stack([th.cos(), th.sin()], 1))
        g = torch.linspace(-0.5, 0.5, 9)
        xi = torch.cartesian_prod(g, g).requires_grad_(True)
        u = model(xi)
        du = torch.autograd.grad(u.sum(), xi, create_graph=True)[0]
        loss = (0.5 * (du**2).sum(1) - u.squeeze(1)).mean() + 10 * (ub**2).mean()
        loss = guard.check_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.details["reason"]) == (
        "backward",
        "feat",
        "derivative",
    )
    assert origin.details["forward"] == 2
    assert "(It was forward 2 of the step.)" in origin.message
