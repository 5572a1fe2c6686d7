"""Precision and masks: float16 and bfloat16 models, masks that overflow."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanguard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_clip_grad_norm_overflowing_float16_is_reported(mode: str) -> None:
    """A pure float16 model: its gradients are finite, their total norm is not (a sum of
    squares past 65504), so clip_grad_norm_ scales every gradient by 0 and training stalls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with (  # noqa: PT012
        nanguard.watch(model, optimizer=opt, mode=mode),
        pytest.raises(nanguard.NonFiniteError, match="clip_grad_norm_ computed an Inf total"),
    ):
        x = torch.randn(512, 64).half() * 8
        loss = model(x).float().pow(2).sum()
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert torch.isinf(total)
        opt.step()


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / 4.0 + mask
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class _Encoder(nn.Module):
    """HF-style: an additive mask built as (1 - m) * -1e9, -inf once in float16."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.attn = _Attention()
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        mask = (1.0 - keep[:, None, None, :].to(x.dtype)) * -1e9
        return self.head(self.attn(x, mask))


def test_a_float16_mask_of_minus_1e9_on_an_empty_sample_says_it_is_inf_already() -> None:
    torch.manual_seed(0)
    model = _Encoder().half()
    ids, keep = torch.randint(0, 100, (4, 16)), torch.ones(4, 16, dtype=torch.long)
    keep[1] = 0  # an empty sample
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(ids, keep).float().mean().backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.module == "attn"
    assert origin.hint is not None
    assert "in float16 a -1e9 mask, or finfo.min added twice, is -inf already" in origin.hint
