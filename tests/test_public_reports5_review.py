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


class PooledEncoder(nn.Module):
    """Returns (last_hidden_state, pooler_output), as BertModel does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 32)
        self.norm = nn.LayerNorm(32)
        self.pool = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.norm(self.lin(x))
        return h, torch.tanh(self.pool(h[:, 0]))


class SiameseMeanPool(nn.Module):
    """Mean-pools the hidden states (the pooler output unused) of two texts; a contrastive
    loss on their distance: sqrt at 0 for two empty texts (a NaN gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = PooledEncoder()

    def forward(self, x: torch.Tensor, mask: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.enc(x)[0]
        m = mask.unsqueeze(-1)
        ea, eb = ((h * m).sum(1) / m.sum(1).clamp(min=1e-9)).chunk(2)
        d = torch.sqrt(((ea - eb) ** 2).sum(-1))
        return (y * d**2 + (1 - y) * torch.relu(1 - d) ** 2).mean()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_parents_backward_nan_is_not_laid_on_a_child_whose_other_output_went_unused(
    mode: str,
) -> None:
    # The encoder used its hidden states for its pooler output, which the caller ignored:
    # the NaN gradient was called the encoder's own code's.
    torch.manual_seed(0)
    model = SiameseMeanPool()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    mask = torch.ones(8, 8)
    mask[2] = mask[6] = 0  # a pair of two empty texts
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = model(torch.randn(8, 8, 16), mask, torch.tensor([0.0, 1.0, 1.0, 0.0]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "")
    assert origin.op == "aten.div.Tensor in SqrtBackward0"


class CausalLMWithLoss(nn.Module):
    """The loss computed in the forward, as transformers' ForCausalLMLoss with
    num_items_in_batch: a sum over the labels that are not -100, divided by their count,
    which Trainer passes as a float (divided across ranks)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.emb(ids))
        num_items_in_batch = (labels != -100).sum().float()
        loss = nn.functional.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        return loss / num_items_in_batch


def test_a_float_count_of_zero_labels_gets_the_every_label_ignored_hint() -> None:
    # A completion truncated away: every label -100. The hint said "add an eps".
    torch.manual_seed(0)
    model = CausalLMWithLoss()
    ids = torch.randint(0, 50, (1, 12))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(ids, torch.full((1, 12), -100)).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.hint is not None
    assert "divided by a count that is 0" in origin.hint
    assert "an eps is the wrong fix" in origin.hint


class LitModule(nn.Module):
    """A LightningModule's shape: training_step calls self.model; its forward() never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)  # type: ignore[no-any-return]

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        out = self.model(x)
        return torch.sqrt((out**2).sum(-1)).mean()  # a zero row: sqrt's slope at 0


def test_a_model_whose_forward_never_runs_is_told_to_watch_the_called_module() -> None:
    # Sentinel mode on the LightningModule: the error offered torch.compile causes only.
    torch.manual_seed(0)
    lit = LitModule()
    with torch.no_grad():
        lit.model[2].weight.zero_()
        lit.model[2].bias.zero_()
    opt = torch.optim.SGD(lit.parameters(), lr=0.1)
    with nanguard.watch(lit, optimizer=opt, mode="sentinel", on_nonfinite="log") as guard:
        loss = lit.training_step(torch.randn(4, 8))
        opt.zero_grad()
        loss.backward()
        with pytest.warns(RuntimeWarning, match="without a recorded call"):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "grad"
    assert "its forward() was not called" in origin.message
    assert "Watch the module whose forward() the training step calls" in origin.message
