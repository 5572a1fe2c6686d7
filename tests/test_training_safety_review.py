"""From a review of unusual but legitimate training loops: a head put in with
optimizer.add_param_group() in the step it fails, and a loop that zeroes its gradients with
set_to_none=False and reads them after a step skip_step dropped."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class LogLinear(nn.Module):
    """A new block whose log meets ReLU's zeros at once (-inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 16)
        with torch.no_grad():
            self.fc.bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(F.relu(self.fc(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("add_group", [False, True])
def test_a_block_put_in_with_add_param_group_is_named_in_the_step_it_fails(
    add_group: bool, mode: str
) -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(
        model,
        optimizer=opt,
        on_nonfinite="log",
        mode=mode,  # type: ignore[arg-type]
    ) as guard:
        for step in range(4):
            if step == 3:
                model.body[0] = LogLinear()
                if add_group:
                    opt.add_param_group({"params": model.body[0].parameters()})
            x, y = torch.randn(16, 8), torch.randn(16, 1)
            loss = guard.check_loss(F.mse_loss(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.op) == (
        3,
        "forward",
        "body.0",
        "aten.log.default",
    )
    assert origin.reproducible is True


def test_skip_step_puts_the_gradients_back_zeroed_for_a_set_to_none_false_loop() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-2)
    norms = []
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard:
        for step in range(4):
            x = torch.randn(8, 4)
            if step == 2:
                x[0, 0] = float("nan")  # (a bad batch: its step is dropped)
                before = [p.detach().clone() for p in model.parameters()]
            opt.zero_grad(set_to_none=False)
            guard.check_loss(model(x).pow(2).mean()).backward()
            opt.step()
            norms.append(sum(float(p.grad.norm()) for p in model.parameters()))  # (the loop's log)
            if step == 2:
                # (the dropped step moved nothing: no momentum, no weight decay)
                after = list(model.parameters())
                assert all(torch.equal(b, p) for b, p in zip(before, after, strict=True))
                assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in after)
    assert norms[2] == 0.0
    assert norms[3] > 0.0
    assert guard.origin is not None
    assert guard.origin.phase == "input"
    assert all(torch.isfinite(p).all() for p in model.parameters())
