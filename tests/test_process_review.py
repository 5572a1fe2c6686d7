"""Several guards in one process, guards left attached, and what a guard keeps alive."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from torch import nn

import nanguard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gan_whose_generator_went_nan_keeps_training_under_warn(mode: str) -> None:
    """The discriminator's guard looks into the generator's pending forwards (where its NaN
    input came from): sites a sentinel step did not probe are no crash."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    disc = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g = torch.optim.SGD(gen.parameters(), 1e-2)
    opt_d = torch.optim.SGD(disc.parameters(), 1e-2)
    with (
        warnings.catch_warnings(),
        nanguard.watch(gen, optimizer=opt_g, mode=mode, on_nonfinite="log") as guard_g,
        nanguard.watch(disc, optimizer=opt_d, mode=mode, on_nonfinite="log") as guard_d,
    ):
        warnings.simplefilter("ignore", RuntimeWarning)
        for it in range(3):
            fake = gen(torch.randn(16, 8)).detach()
            d_loss = disc(fake).mean() - disc(torch.randn(16, 4)).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            if it == 1:
                with torch.no_grad():
                    gen[2].bias[0] = float("nan")  # the generator's weights go bad
            g_loss = -disc(gen(torch.randn(16, 8))).mean()
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
    assert guard_g.origin is not None
    assert guard_g.origin.param == "2.bias"
    assert guard_d.events


@pytest.mark.parametrize("detach", [True, False])
def test_a_finished_guard_keeps_no_model_alive(detach: bool) -> None:
    """A guard detached by its with block, or never detached (a trial of a sweep that
    raised): once the user drops model, optimizer and guard, they are freed, check_loss
    used or not."""

    def trial() -> tuple[weakref.ref[nn.Module], weakref.ref[torch.optim.Optimizer]]:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        guard = nanguard.watch(model, optimizer=opt)
        loss = guard.check_loss(model(torch.randn(8, 16)).pow(2).mean())
        loss.backward()
        opt.step()
        if detach:
            guard.detach()
        return weakref.ref(model), weakref.ref(opt)

    refs = [trial() for _ in range(3)]
    gc.collect()
    assert [(m(), o()) for m, o in refs] == [(None, None)] * 3


class _Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.s


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_generator_origin_caught_by_the_user_is_not_raised_again_by_the_critic(
    mode: str,
) -> None:
    """GAN, 'raise': the generator's guard raises; the user catches it, repairs and trains
    on. The critic's guard, which saw that step's Inf, does not raise it a second time, at
    its next step nor when its with block ends."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), _Scale(), nn.Linear(16, 4))
    disc = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
    opt_g = torch.optim.SGD(gen.parameters(), 1e-2)
    opt_d = torch.optim.SGD(disc.parameters(), 1e-2)
    raised = []
    with (
        nanguard.watch(gen, optimizer=opt_g, mode=mode),
        nanguard.watch(disc, optimizer=opt_d, mode=mode),
    ):
        for it in range(5):
            try:
                fake = gen(torch.randn(16, 8)).detach()
                d_loss = disc(fake).mean() - disc(torch.randn(16, 4) + 1).mean()
                opt_d.zero_grad()
                d_loss.backward()
                opt_d.step()
                if it == 2:
                    gen[2].s.zero_()  # x / 0 in the generator
                g_loss = -disc(gen(torch.randn(16, 8))).mean()
                opt_g.zero_grad()
                g_loss.backward()
                opt_g.step()
            except nanguard.NonFiniteError as error:
                raised.append((it, error.event.step, error.event.module))
                gen[2].s.fill_(1.0)  # repaired
    assert raised == [(2, 2, "2")]
