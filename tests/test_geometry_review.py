"""From a review with geometry and probabilistic models (Gaussian processes, rotations,
depth) and an attack on how real code changes a watched model."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nanguard


class RBFKernel(nn.Module):
    """A deep-kernel GP's kernel; its lengthscale |raw| is 0 at init: 0/0 on the diagonal."""

    def __init__(self, lengthscale: float) -> None:
        super().__init__()
        self.raw = nn.Parameter(torch.tensor(lengthscale))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.exp(-0.5 * torch.cdist(z, z).pow(2) / self.raw.abs() ** 2)


class ExactGP(nn.Module):
    """The negative marginal log likelihood through a Cholesky factor, in the forward."""

    def __init__(self, lengthscale: float, jitter: float) -> None:
        super().__init__()
        self.feat = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
        self.kernel = RBFKernel(lengthscale)
        self.jitter = jitter

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        k = self.kernel(self.feat(x)) + self.jitter * torch.eye(x.shape[0])
        chol = torch.linalg.cholesky(k)
        alpha = torch.cholesky_solve(y[:, None], chol)[:, 0]
        return 0.5 * (y * alpha).mean() + torch.log(torch.diagonal(chol)).mean()


def _fit(model: nn.Module, mode: str, x: torch.Tensor) -> tuple[nanguard.Guard, BaseException]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    y = torch.sin(x[:, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with (
            nanguard.watch(model, optimizer=opt, mode=mode) as guard,
            pytest.raises(torch.linalg.LinAlgError) as raised,
        ):
            guard.check_loss(model(x, y))
    return guard, raised.value


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_cholesky_refusing_a_nan_kernel_names_where_the_nan_was_made(mode: str) -> None:
    # torch says "not positive-definite"; the matrix holds NaN from 0/0 (lengthscale 0).
    torch.manual_seed(0)
    guard, error = _fit(ExactGP(lengthscale=0.0, jitter=1e-2), mode, torch.randn(512, 8))
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "kernel", "nan")
    assert origin.op == "aten.div.Tensor"
    assert origin.source is not None
    assert "self.raw.abs() ** 2" in origin.source
    notes = getattr(error, "__notes__", [])
    assert any("`kernel` (RBFKernel)" in note for note in notes)  # told with the error


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_cholesky_refusing_a_finite_matrix_is_not_reported(mode: str) -> None:
    # Duplicated points and no jitter: singular but finite. Not nanguard's business.
    torch.manual_seed(0)
    x = torch.randn(256, 8).repeat(2, 1)
    guard, error = _fit(ExactGP(lengthscale=1.0, jitter=0.0), mode, x)
    assert guard.events == []
    (note,) = getattr(error, "__notes__", [])
    assert "the matrix is finite and not positive-definite or singular" in note
