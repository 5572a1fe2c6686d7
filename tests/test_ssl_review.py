"""Self-supervised and metric learning, from a review with real model code: momentum
encoders updated inside forward(), EMA teachers, contrastive losses."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class MomentumContrast(nn.Module):
    """MoCo's builder: the key encoder moves towards the query encoder inside forward()
    (``_momentum_update_key_encoder``), and the keys go into a queue buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder_q = nn.Sequential(
            nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False)
        )
        self.encoder_k = copy.deepcopy(self.encoder_q)
        for p in self.encoder_k.parameters():
            p.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(8, 32), dim=0))
        self.register_buffer("queue_ptr", torch.zeros(1, dtype=torch.long))

    def forward(self, im_q: torch.Tensor, im_k: torch.Tensor) -> torch.Tensor:
        q = self.encoder_q(im_q)
        q = q / q.norm(dim=1, keepdim=True)  # (no eps: a blank image is 0/0)
        with torch.no_grad():
            pairs = zip(self.encoder_q.parameters(), self.encoder_k.parameters(), strict=True)
            for pq, pk in pairs:
                pk.data = pk.data * 0.99 + pq.data * 0.01
            k = F.normalize(self.encoder_k(im_k), dim=1)
        l_pos = (q * k).sum(1, keepdim=True)
        l_neg = q @ self.queue.clone().detach()
        logits = torch.cat([l_pos, l_neg], dim=1) / 0.07
        with torch.no_grad():
            ptr = int(self.queue_ptr)
            self.queue[:, ptr : ptr + k.shape[0]] = k.T
            self.queue_ptr[0] = (ptr + k.shape[0]) % self.queue.shape[1]
        return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long))


def _train_moco(mode: str | None) -> MomentumContrast:
    torch.manual_seed(0)
    model = MomentumContrast()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    guard = (
        nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="skip_step") if mode else None
    )
    for step in range(4):
        im_q, im_k = torch.randn(8, 8), torch.randn(8, 8)
        if step == 2:
            im_q[3] = 0.0  # a blank image
        loss = model(im_q, im_k)
        opt.zero_grad()
        loss.backward()
        if mode is None and not torch.isfinite(loss):
            opt.zero_grad(set_to_none=True)  # what skip_step does
        opt.step()
    if guard is not None:
        guard.detach()
        assert guard.origin is not None
        assert (guard.origin.phase, guard.origin.op) == ("forward", "aten.div.Tensor")
    return model


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_replay_does_not_repeat_a_momentum_update_made_inside_forward(mode: str) -> None:
    expected = _train_moco(None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        got = _train_moco(mode)
    for (name, a), b in zip(expected.state_dict().items(), got.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_an_ema_teacher_made_nan_by_its_update_is_not_blamed_on_the_optimizer() -> None:
    """BYOL with the target encoder inside the watched model; a momentum schedule over zero
    steps gives tau = NaN, and the EMA writes NaN into the target's weights."""

    class BYOL(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.online = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32))
            self.target = copy.deepcopy(self.online)
            for p in self.target.parameters():
                p.requires_grad = False
            self.predictor = nn.Linear(32, 32)

        def forward(self, x1: torch.Tensor, x2: torch.Tensor) -> torch.Tensor:
            p = F.normalize(self.predictor(self.online(x1)), dim=-1)
            with torch.no_grad():
                t = F.normalize(self.target(x2), dim=-1)
            return (2 - 2 * (p * t).sum(-1)).mean()

    torch.manual_seed(0)
    model = BYOL()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    tau = float("nan")  # 1 - (1 - 0.99) * (cos(pi * k / 0) + 1) / 2
    raised = False
    with nanguard.watch(model, optimizer=opt) as guard:
        for _ in range(3):
            x = torch.randn(16, 20)
            loss = model(x + 0.1 * torch.randn_like(x), x)
            opt.zero_grad()
            loss.backward()
            try:
                opt.step()
            except nanguard.NonFiniteError:
                raised = True
                break
            with torch.no_grad():
                pairs = zip(model.online.parameters(), model.target.parameters(), strict=True)
                for po, pt in pairs:
                    pt.mul_(tau).add_(po, alpha=1 - tau)
    assert raised
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("param", "target.0.weight")
    assert "outside the optimizer's update" in origin.message
    assert "requires_grad=False" in origin.message
    assert "although its gradients were finite" not in origin.message
    assert origin.hint is not None
    assert "EMA" in origin.hint
    assert "learning rate" not in origin.hint
