"""The bundled example: a regression model that goes NaN partway through training.

Run it with ``python -m nanguard.demo``. The model predicts a mean and a scale
per sample and is trained with the Gaussian negative log-likelihood. Its scale
comes out of a ReLU, a common slip (``softplus(x) + eps`` is the safe choice):
as training shrinks the scale of the low-noise samples, one of them reaches
exactly 0, ``log(0)`` is ``-inf`` and the loss turns NaN. Plain training only
shows the NaN loss; nanguard names the module, the step and the tensor.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TextIO

import torch
from torch import Tensor, nn

import nanguard

__all__ = ["GaussianHead", "Regressor", "make_data", "main", "train"]


class GaussianHead(nn.Module):
    """Predicts a mean and a log standard deviation from features."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.mean = nn.Linear(features, 1)
        self.scale = nn.Linear(features, 1)
        nn.init.constant_(self.scale.bias, 1.0)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        sigma = torch.relu(self.scale(h))  # the slip: can be exactly 0
        return self.mean(h), torch.log(sigma)


class Regressor(nn.Module):
    """A two-layer MLP body and a Gaussian head."""

    def __init__(self, inputs: int = 8, hidden: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU()
        )
        self.head = GaussianHead(hidden)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        mean, log_sigma = self.head(self.body(x))
        return mean, log_sigma


def make_data(n: int = 2048, seed: int = 0) -> tuple[Tensor, Tensor]:
    """Heteroscedastic data: half of it almost noise-free, which drives scales to 0."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=gen)
    w = torch.randn(8, 1, generator=gen)
    noise = 0.05 + 0.5 * (x[:, :1] > 0).float()
    return x, x @ w + noise * torch.randn(n, 1, generator=gen)


def gaussian_nll(mean: Tensor, log_sigma: Tensor, y: Tensor) -> Tensor:
    return (log_sigma + 0.5 * ((y - mean) / log_sigma.exp()) ** 2).mean()


def train(
    steps: int = 300,
    seed: int = 0,
    lr: float = 3e-3,
    log_path: str | None = None,
    out: TextIO | None = None,
) -> nanguard.Guard:
    """Train under a guard until it raises; returns the guard (its events and origin)."""
    stream = sys.stdout if out is None else out

    def write(text: str) -> None:
        print(text, file=stream)

    torch.manual_seed(seed)
    x, y = make_data(seed=seed)
    model = Regressor()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    guard = nanguard.watch(model, optimizer=opt, log_path=log_path)
    try:
        for step in range(steps):
            idx = torch.randint(0, len(x), (64,), generator=gen)
            mean, log_sigma = model(x[idx])
            loss = guard.check_loss(gaussian_nll(mean, log_sigma, y[idx]))
            opt.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]
            if step % 20 == 0:
                write(f"  step {step:3d}  loss {loss.item():8.4f}")
            opt.step()  # nanguard resolves the step here, before the weights change
    except nanguard.NonFiniteError:
        pass
    finally:
        guard.detach()
    return guard


def report(guard: nanguard.Guard) -> str:
    """What the demo prints about the origin."""
    origin = guard.origin
    if origin is None:
        return "nanguard found nothing: training stayed finite."
    lines = [
        f"nanguard stopped training at step {origin.step}, before optimizer.step() "
        "touched the weights.",
        "",
        f"  origin     {origin.module or '<model>'} ({origin.module_type}), phase {origin.phase!r}",
        f"  tensor     {origin.tensor}: {origin.kind}",
    ]
    if origin.stats is not None:
        lines.append(f"  stats      {origin.stats.summary()}")
        lines.append("  first      " + ", ".join(f"{v:.4g}" for v in origin.stats.first_values[:6]))
    path = " -> ".join(p or "<model>" for p in origin.propagated)
    loss = [e for e in guard.events if e.phase == "loss" and e.step == origin.step]
    calls = "call" if origin.n_propagated == 1 else "calls"
    lines.append(
        f"  propagated {path or '-'}{' -> loss' if loss else ''}  "
        f"({origin.n_propagated} module {calls})"
    )
    lines += ["", str(origin)]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanguard.demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-path", default=None, help="also write events as JSON lines")
    args = parser.parse_args(argv)
    print(
        "Training a regressor with a Gaussian head (mean and scale) on the Gaussian NLL,\n"
        "with nanguard.watch(model, optimizer=opt):"
    )
    guard = train(args.steps, args.seed, args.lr, args.log_path)
    print()
    print(report(guard))
    if guard.origin is not None:
        print(
            "\nThe fix here: produce the scale with softplus(x) + 1e-4 instead of relu(x), "
            "so that log() never sees 0."
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
