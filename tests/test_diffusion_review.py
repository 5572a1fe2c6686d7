"""From a review with diffusion-model training code (DDPM schedules with min-SNR loss
weights, EDM preconditioning)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard

T = 1000


class GaussianDiffusion(nn.Module):
    """lucidrains-style: the schedule and the min-SNR-gamma loss weights are buffers computed
    in __init__; a zero-terminal-SNR schedule makes the last weight 0/0 = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(17, 64), nn.SiLU(), nn.Linear(64, 16))
        betas = torch.linspace(1e-4, 0.02, T, dtype=torch.float64)
        root = torch.cumprod(1 - betas, 0).sqrt()
        root = (root - root[-1]) * root[0] / (root[0] - root[-1])  # zero terminal SNR
        alpha_bar = (root**2).float()
        snr = alpha_bar / (1 - alpha_bar)
        self.register_buffer("sqrt_ab", alpha_bar.sqrt())
        self.register_buffer("sqrt_1m_ab", (1 - alpha_bar).sqrt())
        self.register_buffer("loss_weight", snr.clamp(max=5.0) / snr)  # NaN at t = T - 1

    def forward(self, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        noise = torch.randn_like(x0)
        xt = self.sqrt_ab[t, None] * x0 + self.sqrt_1m_ab[t, None] * noise
        out = self.model(torch.cat([xt, t[:, None].float() / T], 1))
        loss = F.mse_loss(out, noise, reduction="none").mean(1)
        return (loss * self.loss_weight[t]).mean()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loss_weight_buffer_nan_since_init_is_the_origin_when_first_read(mode: str) -> None:
    # Healthy until a batch samples the last timestep: then the step must stop, and the
    # buffer (NaN before watch() began, never written) is what to look at.
    torch.manual_seed(0)
    diffusion = GaussianDiffusion()
    opt = torch.optim.AdamW(diffusion.parameters(), lr=1e-3)
    with nanguard.watch(diffusion, optimizer=opt, mode=mode) as guard:
        for step in range(3):
            t = torch.randint(0, T - 1, (8,))
            if step == 2:
                t[3] = T - 1
            loss = guard.check_loss(diffusion(torch.randn(8, 16), t))
            opt.zero_grad()
            loss.backward()
            if step < 2:
                opt.step()
                continue
            with pytest.raises(nanguard.NonFiniteError) as raised:
                opt.step()
    assert all(torch.isfinite(p).all() for p in diffusion.parameters())
    origin = raised.value.event
    assert (origin.phase, origin.param, origin.kind) == ("param", "loss_weight", "nan")
    assert "was already NaN before the first step" in origin.message
    assert origin.hint is not None
    assert "computed so in __init__" in origin.hint


def timestep_embedding(t: torch.Tensor, dim: int = 32) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half) / half)
    angles = t[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], -1)


class TimeEmbed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Linear(32, 32)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.mlp(timestep_embedding(t))


class Denoiser(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.time = TimeEmbed()
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.out(self.time(t)) + x


class EDMPrecond(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = Denoiser()

    def forward(self, x: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        c_noise = sigma.log() / 4  # -inf at sigma == 0
        return self.model(x, c_noise)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_minus_inf_noise_level_made_in_the_wrapper_is_the_origin_not_the_embedding(
    mode: str,
) -> None:
    # cos(-inf) is NaN inside the timestep embedding; the -Inf came from the wrapper's log.
    torch.manual_seed(0)
    model = EDMPrecond()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sigma = torch.tensor([0.5, 1.0, 0.0, 2.0])
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        loss = guard.check_loss(model(torch.randn(4, 4), sigma).pow(2).mean())
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == ("forward", "", "args[1] of model")
    assert origin.op == "aten.log.default"
    assert origin.source is not None
    assert "c_noise = sigma.log() / 4" in origin.source


class LastSeen(nn.Module):
    """A buffer NaN as an 'unset' marker at watch() time, overwritten by every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("last", torch.full((4,), float("nan")))
        self.lin = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.last.copy_(x.mean(0))
        return self.lin(x)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_buffer_nan_at_attach_that_forwards_overwrite_is_their_business_later(
    mode: str,
) -> None:
    # Finite for 20 steps; a NaN batch then writes NaN into it: the batch is the origin.
    torch.manual_seed(0)
    model = LastSeen()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(21):
            x = torch.randn(16, 4)
            if step == 20:
                x[3, 1] = float("nan")
            loss = guard.check_loss(model(x).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(e.step, e.phase) for e in guard.events if e.is_origin] == [(20, "input")]
