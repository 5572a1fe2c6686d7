"""From a review modelled on public bug reports (diffusers' float16 VAE, timm's ViT
attention in float16, YOLO's box losses)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

import nanguard


class DiagonalGaussian:
    """diffusers' DiagonalGaussianDistribution: a plain class (no dataclass, no
    torch.distributions) holding the encoder's moments."""

    def __init__(self, moments: torch.Tensor) -> None:
        self.mean, self.logvar = torch.chunk(moments, 2, dim=1)
        self.std = torch.exp(0.5 * self.logvar.clamp(-30.0, 20.0))

    def sample(self) -> torch.Tensor:
        return self.mean + self.std * torch.randn_like(self.mean)


@dataclasses.dataclass
class EncoderOutput:
    latent_dist: DiagonalGaussian


class HalfEncoder(nn.Module):
    """A float16 encoder whose second layer overflows (a trained checkpoint's large
    activations, as SDXL's VAE in float16)."""

    def __init__(self, wrap: bool) -> None:
        super().__init__()
        self.down = nn.Linear(64, 256)
        self.mid = nn.Linear(256, 256)
        self.moments = nn.Linear(256, 32)
        self.wrap = wrap
        with torch.no_grad():
            self.mid.weight.mul_(1e5)

    def forward(self, x: torch.Tensor) -> EncoderOutput | DiagonalGaussian:
        posterior = DiagonalGaussian(self.moments(torch.relu(self.mid(torch.relu(self.down(x))))))
        return EncoderOutput(posterior) if self.wrap else posterior


@pytest.mark.parametrize("wrap", [True, False], ids=["in-dataclass", "bare"])
def test_sentinel_mode_looks_inside_a_plain_object_the_model_returns(wrap: bool) -> None:
    # Only the model's outputs are probed in sentinel mode, and a plain object's tensors
    # were not: no event, no warning, latents NaN.
    torch.manual_seed(0)
    model = HalfEncoder(wrap).half()
    x = torch.rand(8, 64, dtype=torch.float16) * 4
    with torch.no_grad():
        assert not torch.isfinite(model(x).latent_dist.mean if wrap else model(x).mean).all()
        with (
            nanguard.watch(model, mode="sentinel") as guard,
            pytest.raises(nanguard.NonFiniteError),
        ):
            model(x)  # (an inference call: resolved as it returns)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "mid")


class ScaledAttention(nn.Module):
    """timm's ViT attention: q scaled by head_dim ** -0.5, then q @ k^T."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, c = x.shape
        qkv = self.qkv(x).reshape(b, n, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q = q * self.scale
        attn = q @ k.transpose(-2, -1)
        return self.proj((attn.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c))  # type: ignore[no-any-return]


def test_an_overflow_of_scores_scaled_already_points_at_logit_growth_not_scaling() -> None:
    # The hint said "Scale q by 1/sqrt(head_dim)", which the line before does already.
    torch.manual_seed(0)
    model = ScaledAttention()
    with torch.no_grad():
        model.qkv.weight[:128].mul_(200.0)  # q and k weights grown in training
    model = model.half()
    with (
        nanguard.watch(model, on_nonfinite="log") as guard,
        torch.no_grad(),
    ):
        model(torch.randn(2, 16, 64, dtype=torch.float16))
    origin = guard.origin
    assert origin is not None
    assert origin.op is not None
    assert origin.op.startswith(("aten.bmm", "aten.matmul"))
    assert origin.hint is not None
    assert "QK-norm" in origin.hint
    assert "Scale q by" not in origin.hint


def ciou(box1: torch.Tensor, box2: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """YOLOv5's bbox_iou(CIoU=True) before its fix: no eps on the heights."""
    (x1, y1, w1, h1), (x2, y2, w2, h2) = box1.unbind(-1), box2.unbind(-1)
    inter = (torch.min(x1 + w1 / 2, x2 + w2 / 2) - torch.max(x1 - w1 / 2, x2 - w2 / 2)).clamp(0) * (
        torch.min(y1 + h1 / 2, y2 + h2 / 2) - torch.max(y1 - h1 / 2, y2 - h2 / 2)
    ).clamp(0)
    iou = inter / (w1 * h1 + w2 * h2 - inter + eps)
    cw = torch.max(x1 + w1 / 2, x2 + w2 / 2) - torch.min(x1 - w1 / 2, x2 - w2 / 2)
    ch = torch.max(y1 + h1 / 2, y2 + h2 / 2) - torch.min(y1 - h1 / 2, y2 - h2 / 2)
    rho2 = (x2 - x1) ** 2 + (y2 - y1) ** 2
    v = (4 / torch.pi**2) * (torch.atan(w2 / h2) - torch.atan(w1 / h1)) ** 2
    with torch.no_grad():
        alpha = v / (v - iou + (1 + eps))
    return iou - (rho2 / (cw**2 + ch**2 + eps) + v * alpha)


def test_a_ciou_loss_on_a_zero_size_label_names_the_aspect_term() -> None:
    # A mosaic crop left a label of width and height 0: atan(0/0) in the target's aspect.
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(head.parameters(), lr=1e-2)
    targets = torch.rand(8, 4) * 0.5 + 0.25
    targets[3, 2:] = 0.0  # the degenerate label
    with nanguard.watch(head, optimizer=opt, on_nonfinite="log") as guard:
        out = head(torch.randn(8, 16))
        boxes = torch.cat([out[:, :2].sigmoid(), out[:, 2:].sigmoid() * 0.5 + 0.1], dim=1)
        loss = guard.check_loss((1.0 - ciou(boxes, targets)).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "CIoU's aspect term" in origin.hint
