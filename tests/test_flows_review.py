"""Normalizing flows whose layers initialise themselves from the first batch (Glow's and
RealNVP's ActNorm): a weight the first layer's initialisation made non-finite is the origin;
the later layers, initialised from the NaN that reached them, are not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanguard


class ActNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.zeros(d))
        self.log_scale = nn.Parameter(torch.zeros(d))
        self.register_buffer("initialized", torch.tensor(0, dtype=torch.uint8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.initialized.item() == 0:  # data-dependent initialisation, without an eps
            with torch.no_grad():
                self.loc.data.copy_(-x.mean(0))
                self.log_scale.data.copy_(-torch.log(x.std(0)))  # a constant feature: +Inf
                self.initialized.fill_(1)
        return (x + self.loc) * torch.exp(self.log_scale), self.log_scale.sum().expand(len(x))


class Coupling(nn.Module):
    def __init__(self, d: int, mask: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("mask", mask)
        self.net = nn.Sequential(nn.Linear(d, 64), nn.ReLU(), nn.Linear(64, 2 * d))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        masked = x * self.mask
        s, t = self.net(masked).chunk(2, -1)
        s, t = torch.tanh(s) * (1 - self.mask), t * (1 - self.mask)
        return masked + (1 - self.mask) * (x * torch.exp(s) + t), s.sum(-1)


class RealNVP(nn.Module):
    def __init__(self, d: int = 16, depth: int = 4) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for k in range(depth):
            mask = torch.zeros(d)
            mask[k % 2 :: 2] = 1
            layers += [ActNorm(d), Coupling(d, mask)]
        self.flows = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        log_det = torch.zeros(len(x))
        for flow in self.flows:
            x, ld = flow(x)
            log_det = log_det + ld
        return x, log_det


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("policy", ["log", "skip_step"])
def test_only_the_first_data_initialised_layer_is_an_origin(mode: str, policy: str) -> None:
    torch.manual_seed(0)
    model = RealNVP()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(128, 16)
    x[:, 3] = 1.0  # a discrete column, constant in the first batch

    def train() -> nanguard.Guard:
        with nanguard.watch(
            model, optimizer=opt, mode=mode, on_nonfinite=policy, max_consecutive_skips=3
        ) as guard:
            for _ in range(4):
                z, log_det = model(x)
                loss = guard.check_loss((0.5 * (z**2).sum(-1) - log_det).mean())
                opt.zero_grad()
                loss.backward()
                opt.step()
        return guard

    if policy == "skip_step":  # the forward wrote the weights: skipping cannot help
        with pytest.raises(nanguard.NonFiniteError, match=r"flows\.0\.log_scale") as raised:
            train()
        assert "flows.2" not in str(raised.value)
        return
    guard = train()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.param) for e in origins] == [("param", "flows.0.log_scale")]
    later = [e for e in guard.events if e.param is not None and e.param.startswith("flows.2")]
    assert later
    for event in later:
        assert not event.is_origin
        assert "non-finite values from earlier in the step had reached" in event.message


class InvConv2d(nn.Module):
    """Glow's invertible 1x1 convolution, its log-determinant by slogdet."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        weight = torch.linalg.qr(torch.randn(channels, channels))[0]
        self.weight = nn.Parameter(weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _, _, h, w = x.shape
        out = nn.functional.conv2d(x, self.weight[:, :, None, None])
        return out, h * w * torch.linalg.slogdet(self.weight)[1].expand(len(x))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_singular_invertible_convolution_names_the_determinant(mode: str) -> None:
    """Structured pruning zeroed a row of the 1x1 conv: log|det W| is -Inf."""
    torch.manual_seed(0)
    model = InvConv2d(8)
    with torch.no_grad():
        model.weight[3] = 0.0  # a pruned output channel
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        z, log_det = model(torch.randn(4, 8, 16, 16))
        loss = guard.check_loss((0.5 * z.pow(2).sum((1, 2, 3)) - log_det).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == ("forward", "", "output[1]")
    assert origin.op == "aten._linalg_slogdet.default"
    assert origin.hint is not None
    assert "-Inf for a singular matrix" in origin.hint
