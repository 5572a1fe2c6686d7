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


class LogSnrDenoiser(nn.Module):
    """Conditioned on a log-SNR per sample, which its forward embeds before a child sees it:
    passed on as a column (``how="view"``), scaled (``"scale"``), or through a sinusoidal
    embedding (``"sin"``, where sin(-inf) is NaN)."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.register_buffer("freqs", torch.exp(torch.linspace(0, 4, 8)))
        self.t_mlp = nn.Sequential(nn.Linear(8 if how == "sin" else 1, 32), nn.SiLU())
        self.x_in = nn.Linear(4, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, log_snr: torch.Tensor) -> torch.Tensor:
        if self.how == "sin":
            e = torch.sin(log_snr[:, None] * self.freqs)
        elif self.how == "scale":
            e = log_snr[:, None] / 10
        else:
            e = log_snr[:, None]
        return self.out(self.x_in(x) + self.t_mlp(e))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how", ["view", "scale", "sin"])
def test_a_minus_inf_log_snr_from_the_schedule_is_the_batchs(how: str, mode: str) -> None:
    # A cosine-like schedule whose last beta is 1: log(1 - beta) = -inf, so the log-SNR the
    # training loop passes at t = T is -inf. The model only reshapes, scales or embeds it:
    # no layer made it, and a Linear or a sin is no softmax over a mask.
    betas = torch.full((T,), 0.01)
    betas[-1] = 1.0
    log_ab = torch.cumsum(torch.log(1 - betas), 0)
    log_snr = log_ab - torch.log(-torch.expm1(log_ab))
    torch.manual_seed(0)
    model = LogSnrDenoiser(how)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        for step in range(4):
            t = torch.randint(0, T - 1, (64,))
            if step == 2:
                t[7] = T - 1
            x = torch.randn(64, 4)
            loss = guard.check_loss(F.mse_loss(model(x, log_snr[t]), x))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.tensor) == (2, "input", "", "args[1]")
    assert origin.stats is not None
    assert origin.stats.neginf_count == 1
    # (a 1-D input as long as the batch is one value per sample)
    assert "It is in sample 7 (of 64 along dim 0)" in origin.message
    assert [e.step for e in guard.events if e.is_origin] == [2]
    assert all(torch.isfinite(p).all() for p in model.parameters())


class SamplingTablesDiffusion(GaussianDiffusion):
    """Holds a NaN table (a min-SNR weight it no longer reads) and +Inf tables only its
    sampler reads (1/sqrt(alpha_bar) at a zero terminal SNR), and computes its loss weight
    per step instead: clamp(snr) / snr, 0/0 at the last timestep."""

    def __init__(self) -> None:
        super().__init__()
        ab = self.sqrt_ab**2
        self.register_buffer("sqrt_recip_ab", ab.rsqrt())  # +Inf at t = T - 1
        self.register_buffer("sqrt_recipm1_ab", (1 / ab - 1).sqrt())

    def forward(self, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        noise = torch.randn_like(x0)
        xt = self.sqrt_ab[t, None] * x0 + self.sqrt_1m_ab[t, None] * noise
        out = self.model(torch.cat([xt, t[:, None].float() / T], 1))
        loss = F.mse_loss(out, noise, reduction="none").mean(1)
        snr = self.sqrt_ab[t] ** 2 / self.sqrt_1m_ab[t] ** 2
        return (loss * snr.clamp(max=5.0) / snr).mean()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_tables_the_forward_does_not_read_are_not_blamed_for_its_division(mode: str) -> None:
    # The NaN table is no origin: a replay with it made finite makes the same NaN, which
    # the per-step division made; the +Inf sampling tables do not take over the hint.
    torch.manual_seed(0)
    diffusion = SamplingTablesDiffusion()
    assert not torch.isfinite(diffusion.loss_weight).all()
    opt = torch.optim.AdamW(diffusion.parameters(), lr=1e-3)
    guard = nanguard.watch(diffusion, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        for step in range(4):
            t = torch.randint(0, T - 1, (8,))
            if step == 3:
                t[3] = T - 1
            loss = guard.check_loss(diffusion(torch.randn(8, 16), t))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.param) == (3, "forward", "", None)
    assert origin.op == "aten.div.Tensor"
    assert origin.hint is not None
    assert "divided by zero" in origin.hint
    assert "buffers" not in origin.message
    assert [e.step for e in guard.events if e.is_origin] == [3]
