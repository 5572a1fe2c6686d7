"""Training utilities that rename a watched parameter while the guard is attached:
``torch.nn.utils.prune`` turns ``weight`` into ``weight_orig`` (the same tensor) between
epochs of iterative magnitude pruning."""

from __future__ import annotations

import pytest
import torch
import torch.nn.utils.prune as prune
from torch import nn

import nanguard


class _RateModel(nn.Module):
    """A Poisson rate regressor whose log is taken of a raw linear output (bug: it should be
    a softplus or an exp): NaN wherever the head's output turns negative."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU())
        self.head = nn.Linear(64, 1)
        with torch.no_grad():
            self.head.bias.fill_(3.0)  # positive at first, drifting below 0 as it trains

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.head(self.body(x)))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_layer_pruned_while_watched_is_not_a_second_origin(mode: str) -> None:
    torch.manual_seed(0)
    model = _RateModel()
    opt = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(4):
            if step == 2:  # between epochs: half of the first layer's weights pruned
                prune.l1_unstructured(model.body[0], "weight", amount=0.5)
            x = torch.randn(32, 64)
            if step == 3:
                with torch.no_grad():
                    model.head.bias.fill_(-50.0)  # the head's output goes negative
            loss = (model(x) - torch.randn(32, 1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.step, e.phase, e.module) for e in origins] == [(3, "forward", "")]
    assert origins[0].op == "aten.log.default"
    # (the pruned weight went NaN from its NaN gradient: propagated, under its new name)
    pruned = [e for e in guard.events if e.param == "body.0.weight_orig"]
    assert pruned
    assert not any(e.is_origin for e in pruned)
    assert not any("although its gradients were finite" in e.message for e in guard.events)


def test_a_gradient_of_a_layer_pruned_while_watched_is_told_under_its_new_name() -> None:
    torch.manual_seed(0)
    model = _RateModel()
    opt = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(4):
            if step == 2:
                prune.l1_unstructured(model.head, "weight", amount=0.5)
            if step == 3:
                with torch.no_grad():
                    model.head.bias.fill_(-50.0)  # the head's output goes negative
            loss = (model(torch.randn(32, 64)) - torch.randn(32, 1)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    names = {e.param for e in guard.events if e.phase == "grad"}
    assert "head.weight_orig" in names  # (what named_parameters() calls it now)
    assert "head.weight" not in names
