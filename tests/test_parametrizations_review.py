"""From a review with weight parametrizations (torch.nn.utils.parametrize, weight_norm) and
children that transform their parent's weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.parametrizations import weight_norm

import nanguard


class MaxNorm(nn.Module):
    """Rows rescaled to a norm of at most ``c``: ``c / ||row||``, whose derivative is
    infinite at a zero row (a pruned unit)."""

    def __init__(self, c: float = 0.5) -> None:
        super().__init__()
        self.c = c

    def forward(self, w: torch.Tensor) -> torch.Tensor:
        n = w.pow(2).sum(1, keepdim=True).sqrt()
        return w * (self.c / n).clamp(max=1.0)


class ConstrainedLinear(nn.Module):
    """The same maths without parametrize: the parent holds the weight, a child transforms
    it in the parent's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(32, 16) * 0.2)
        self.b = nn.Parameter(torch.zeros(32))
        self.con = MaxNorm()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.con(self.w), self.b)


def _pruned(how: str) -> tuple[nn.Module, str, str, str]:
    """A model whose layer 2 has a zero (or vanishing) row in a transformed weight, with the
    module, its type and the parameter a user should be pointed at."""
    torch.manual_seed(0)
    if how == "weight_norm":
        layer: nn.Module = weight_norm(nn.Linear(16, 32))
        with torch.no_grad():
            layer.parametrizations.weight.original1[4].fill_(1e-22)  # type: ignore[union-attr,index,operator]
        where = ("2.parametrizations.weight.0", "_WeightNorm")
        param = "2.parametrizations.weight.original1"
    elif how == "parametrize":
        layer = nn.Linear(16, 32)
        parametrize.register_parametrization(layer, "weight", MaxNorm())
        with torch.no_grad():
            layer.parametrizations.weight.original[3].zero_()  # type: ignore[union-attr,index,operator]
        where = ("2.parametrizations.weight.0", "MaxNorm")
        param = "2.parametrizations.weight.original"
    else:
        layer = ConstrainedLinear()
        with torch.no_grad():
            layer.w[3].zero_()
        where = ("2.con", "MaxNorm")
        param = "2.w"
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), layer, nn.ReLU(), nn.Linear(32, 1))
    return model, *where, param


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("how", ["weight_norm", "parametrize", "child"])
def test_a_weight_transforms_backward_is_named_not_the_module_holding_the_weight(
    how: str, mode: str
) -> None:
    # The forward is finite; the backward of the transform (1 / ||row|| at a zero row)
    # makes the weight's gradient non-finite. The transform is where to look, not the
    # ParametrizationList (torch's code) or the parent that only holds the weight.
    model, module, module_type, param = _pruned(how)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        loss = guard.check_loss(F.mse_loss(model(torch.randn(64, 8)), torch.randn(64, 1)))
        opt.zero_grad()
        loss.backward()
        opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (0, "backward")
    assert (origin.module, origin.module_type, origin.param) == (module, module_type, param)
    assert f"Look at {module_type}.forward" in origin.message
    assert "its parent's parameters, which it transforms," in origin.message
    assert "ParametrizationList" not in origin.message
    assert origin.hint is not None
    assert "SVD" not in origin.hint
    if how == "weight_norm":
        assert "weight normalisation" in origin.hint
    else:
        assert "x / y" in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_parametrized_weight_read_again_by_a_regulariser_is_one_origin(mode: str) -> None:
    # A unit of the weight-normalised layer is pruned (v's row zeroed): the forward's weight
    # is 0/0 there, and so is the weight the loss reads again for an orthogonality penalty
    # (the parametrization runs a second time, from user code). One cause, one origin.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), weight_norm(nn.Linear(16, 16)), nn.ReLU(), nn.Linear(16, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        for step in range(5):
            if step == 3:
                with torch.no_grad():
                    model[2].parametrizations.weight.original1[4].zero_()  # type: ignore[union-attr,index,operator]
            x, y = torch.randn(32, 8), torch.randn(32, 1)
            w = model[2].weight
            penalty = (w @ w.t() - torch.eye(16)).pow(2).sum()
            loss = guard.check_loss(F.mse_loss(model(x), y) + 1e-3 * penalty)
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.step, e.module) for e in origins] == [(3, "2.parametrizations.weight.0")]
    assert origins[0].op == "aten._weight_norm_interface.default"


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_spectral_norm_of_a_zero_initialised_weight_is_told_as_such(mode: str) -> None:
    # A discriminator layer zero-initialised (a "start as identity" habit) under spectral
    # norm: sigma is 0 and torch's own W / sigma is 0/0. An eps is not the user's to add.
    torch.manual_seed(0)
    layer = nn.Linear(16, 16)
    nn.init.zeros_(layer.weight)
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(),
        nn.utils.parametrizations.spectral_norm(layer),
        nn.Linear(16, 1),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        loss = guard.check_loss(model(torch.randn(32, 8)).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (0, "forward")
    assert (origin.module, origin.module_type) == ("2.parametrizations.weight.0", "_SpectralNorm")
    assert origin.hint is not None
    assert "largest singular value" in origin.hint
    assert "Add an eps" not in origin.hint
