"""Small models that go non-finite for the reasons real training runs do.

Each factory returns a model (and what to feed it) whose first non-finite value
is created at a known place, by a known cause; the tests assert what nanguard
says about it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn


class LogFeatures(nn.Module):
    """``log`` of activations that can be negative: NaN (and -Inf at exactly 0)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)


def log_mlp() -> nn.Sequential:
    """784-256-128-10 MLP with a log-features layer after the first linear."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(784, 256), LogFeatures(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)
    )


class ExpGate(nn.Module):
    """A gated block whose gate is an inline ``exp`` in its own forward (overflows)."""

    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        gate = torch.exp(h * 60.0)  # exp of large logits overflows float32 to +inf
        return self.out(h * gate)


class GatedNet(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Linear(16, dim)
        self.block = ExpGate(dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.relu(self.block(self.embed(x))))


class NormalizedEmbedding(nn.Module):
    """Divides by the row norm in its own code before its projection: 0/0 on a zero row."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        unit = x / x.norm(dim=-1, keepdim=True)
        return self.proj(unit)


class Fp16MLP(nn.Module):
    """A float16 feed-forward block whose up-projection overflows 65504 (the T5 fp16 case)."""

    def __init__(self, dim: int = 128, hidden: int = 256) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.act = nn.ReLU()
        self.down = nn.Linear(hidden, dim)
        with torch.no_grad():  # correlated weights: hidden units sum ~dim * |x|
            self.up.weight.fill_(1.0)
            self.up.bias.zero_()

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.act(self.up(x)))


def fp16_input(batch: int = 4, dim: int = 128, level: float = 600.0) -> Tensor:
    """Hidden states of a deep fp16 model: large, but finite (128 * 600 > 65504)."""
    return (torch.full((batch, dim), level) + torch.randn(batch, dim)).half()


class PerSampleNorm(nn.Module):
    """Standardises each sample over its batch with the unbiased variance: NaN at batch 1."""

    def forward(self, x: Tensor) -> Tensor:
        mean = x.mean(dim=0, keepdim=True)
        var = x.var(dim=0, keepdim=True)  # unbiased: 0/0 when the batch has one sample
        return (x - mean) / torch.sqrt(var + 1e-5)


def var_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), PerSampleNorm(), nn.Linear(16, 2))


class TinyLM(nn.Module):
    """A causal Transformer-encoder LM with the -inf mask of ``generate_square_subsequent_mask``."""

    def __init__(self, vocab: int = 50, d_model: int = 32, seq: int = 12, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=64, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        self.register_buffer(
            "mask", nn.Transformer.generate_square_subsequent_mask(seq), persistent=False
        )

    def forward(self, idx: Tensor, padding: Tensor | None = None) -> Tensor:
        h = self.embed(idx)
        n = idx.shape[1]
        h = self.encoder(h, mask=self.mask[:n, :n], src_key_padding_mask=padding)
        return self.head(h)


class MaskedAttention(nn.Module):
    """Hand-written attention that masks with ``masked_fill(-inf)`` in its own code."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.scale = 1.0 / math.sqrt(dim)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
        return self.out(torch.softmax(scores, dim=-1) @ v)


class PairwiseDistances(nn.Module):
    """Euclidean distances between all rows: sqrt at 0 on the diagonal (finite forward,
    NaN gradient)."""

    def forward(self, x: Tensor) -> Tensor:
        return (x[:, None, :] - x[None, :, :]).pow(2).sum(-1).sqrt()


class PairDistance(nn.Module):
    """Distance between consecutive samples: sqrt at 0 when two samples coincide."""

    def forward(self, x: Tensor) -> Tensor:
        return (x[0::2] - x[1::2]).pow(2).sum(-1, keepdim=True).sqrt()


class PairNet(nn.Module):
    """Linear -> PairDistance -> Linear: a NaN gradient in the backward of ``d``."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.d = PairDistance()
        self.h = nn.Linear(1, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.h(self.d(self.a(x)))


class SafeExp(nn.Module):
    """``where(x < 0, exp(100 x), 1 + x)``: the unselected exp overflows for x > 0.9, and
    its gradient is still computed (0 * inf = NaN)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.where(x < 0, torch.exp(x * 100.0), 1.0 + x)


class AngleBetween(nn.Module):
    """acos of a cosine similarity that is exactly 1 for identical vectors."""

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        cos = nn.functional.cosine_similarity(a, b, dim=-1).clamp(-1.0, 1.0)
        return torch.acos(cos)


class LogProb(nn.Module):
    """log hidden behind nan_to_num: a finite forward, a NaN backward at p = 0."""

    def forward(self, p: Tensor) -> Tensor:
        return torch.nan_to_num(torch.log(p), neginf=0.0)


class Orthonormalize(nn.Module):
    """``U @ Vh`` from an SVD: its gradient is NaN when singular values repeat."""

    def forward(self, x: Tensor) -> Tensor:
        u, _, vh = torch.linalg.svd(x, full_matrices=False)
        return u @ vh


def triplet_loss(embeddings: Tensor, margin: float = 1.0) -> Tensor:
    """A hand-written triplet loss with sqrt distances (sqrt at 0 when anchor == positive)."""
    a, p, n = embeddings[0::3], embeddings[1::3], embeddings[2::3]
    d_ap = (a - p).pow(2).sum(-1).sqrt()
    d_an = (a - n).pow(2).sum(-1).sqrt()
    return torch.relu(d_ap - d_an + margin).mean()


def zero_row_input() -> tuple[Tensor]:
    x = torch.randn(4, 8)
    x[2] = 0.0  # a zero row: its norm is 0
    return (x,)


def one_masked_sample() -> tuple[Tensor, Tensor]:
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1] = False  # every position of sample 1 masked
    return torch.randn(2, 5, 16), keep


def duplicated_rows() -> tuple[Tensor]:
    x = torch.randn(12, 8)
    x[1] = x[0]  # anchor == positive
    return (x,)


#: name -> (model factory, inputs factory, loss or None for ``out.float().pow(2).mean()``):
#: one real cause each, with a known origin (run on any device, in any mode).
CAUSES: dict[str, tuple[Callable[[], nn.Module], Callable[[], tuple[Tensor, ...]], Any]] = {
    "log of negatives": (log_mlp, lambda: (torch.randn(64, 784),), None),
    "inline overflow in a parent": (GatedNet, lambda: (torch.randn(32, 16) * 3,), None),
    "division by a zero norm": (
        lambda: nn.Sequential(nn.Linear(8, 32, bias=False), NormalizedEmbedding(32)),
        zero_row_input,
        None,
    ),
    "fully masked attention row": (MaskedAttention, one_masked_sample, None),
    "sqrt at 0 in the backward": (
        lambda: nn.Sequential(nn.Linear(8, 4), PairwiseDistances(), nn.Linear(6, 1)),
        lambda: (torch.randn(6, 8),),
        None,
    ),
    "loss backward": (
        lambda: nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)),
        duplicated_rows,
        triplet_loss,
    ),
}


def amp_step(model: nn.Module, opt: Any, scaler: Any, x: Tensor, y: Tensor) -> None:
    """One float16-autocast training step with a GradScaler, on the device of ``x``."""
    with torch.autocast(x.device.type, dtype=torch.float16):
        loss = nn.functional.mse_loss(model(x).float(), y)
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
