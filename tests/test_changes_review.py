"""A model changed while it is watched, as training scripts do: a head replaced and given
to the optimizer, a checkpoint loaded, micro-batches accumulated, layers fused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanguard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_head_replaced_and_added_to_the_optimizer_has_its_gradients_checked(mode: str) -> None:
    """model[2] = nn.Linear(...) with as many parameters as the old head: the new head's
    NaN gradient is caught in its step, before the optimizer applies it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)
    try:
        with pytest.raises(nanguard.NonFiniteError) as raised:  # noqa: PT012
            for step in range(12):
                if step == 3:
                    model[2] = nn.Linear(16, 1)
                    opt.add_param_group({"params": list(model[2].parameters())})
                if step == 10:  # a NaN made in this weight's gradient alone
                    model[2].weight.register_hook(lambda g: g * float("nan"))
                loss = model(torch.randn(4, 8)).sum()
                opt.zero_grad()
                loss.backward()
                opt.step()
    finally:
        guard.detach()
    event = raised.value.event
    assert (event.step, event.phase, event.param) == (10, "backward", "2.weight")
    assert torch.isfinite(model[2].weight).all()
