"""GPU readiness: a guarded training step never syncs inside the hooks (CUDA only)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanguard

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@cuda
def test_guarded_step_does_not_sync_inside_forward_and_backward() -> None:
    device = torch.device("cuda")
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 16 * 16, 10),
    ).to(device)  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 3, 16, 16, device=device)
    y = torch.randint(0, 10, (4,), device=device)
    with nanguard.watch(model, optimizer=opt) as guard:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            torch.cuda.set_sync_debug_mode("error")  # any sync in the hooks raises
            try:
                loss = nn.functional.cross_entropy(model(x), y)
                guard.check_loss(loss)
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            opt.step()  # the one read of the step happens here, on purpose
    assert guard.events == []


@cuda
def test_origin_on_cuda() -> None:
    class LogLayer(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(x)

    model = nn.Sequential(nn.Linear(8, 8), LogLayer(), nn.Linear(8, 1)).cuda()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(16, 8, device="cuda")).sum().backward()
        guard.step()
    assert guard.origin is not None
    assert (guard.origin.module, guard.origin.op) == ("1", "aten.log.default")
    assert guard.origin.stats is not None
    assert guard.origin.stats.device.startswith("cuda")
