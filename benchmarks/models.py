"""The three models of the overhead benchmark: each returns (model, batch, loss_fn)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

Case = tuple[nn.Module, Callable[[], tuple[Tensor, Tensor]], Callable[[Tensor, Tensor], Tensor]]


def mlp(device: torch.device) -> Case:
    """The seed-style MLP: 784-256-128-10, batch 64."""
    model = nn.Sequential(
        nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10)
    ).to(device)
    x = torch.randn(64, 784, device=device)
    y = torch.randint(0, 10, (64,), device=device)
    return model, lambda: (x, y), nn.functional.cross_entropy


class SmallCNN(nn.Module):
    """Four conv-BN-ReLU blocks, two max-pools, dropout, a linear head (CIFAR-sized)."""

    def __init__(self) -> None:
        super().__init__()

        def block(cin: int, cout: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
            )

        self.features = nn.Sequential(
            block(3, 32), block(32, 32), nn.MaxPool2d(2),
            block(32, 64), block(64, 64), nn.MaxPool2d(2), nn.Dropout(0.1),
        )  # fmt: skip
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(64 * 8 * 8, 10))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def cnn(device: torch.device) -> Case:
    model = SmallCNN().to(device)
    x = torch.randn(32, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (32,), device=device)
    return model, lambda: (x, y), nn.functional.cross_entropy


class TransformerLM(nn.Module):
    """A small causal Transformer-encoder language model with a -inf causal mask."""

    def __init__(self, vocab: int = 1000, d_model: int = 128, layers: int = 2, seq: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.zeros(seq, d_model))
        layer = nn.TransformerEncoderLayer(
            d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.1, batch_first=True
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, vocab)
        mask = nn.Transformer.generate_square_subsequent_mask(seq)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.embed(idx) + self.pos[: idx.shape[1]]
        h = self.encoder(h, mask=self.mask, is_causal=True)
        return self.head(h)


def transformer(device: torch.device) -> Case:
    model = TransformerLM().to(device)
    idx = torch.randint(0, 1000, (16, 64), device=device)
    target = torch.randint(0, 1000, (16, 64), device=device)

    def loss_fn(out: Tensor, y: Tensor) -> Tensor:
        return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    return model, lambda: (idx, target), loss_fn


CASES = {"mlp": mlp, "cnn": cnn, "transformer": transformer}
