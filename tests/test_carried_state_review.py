"""A recurrent state carried across training steps (truncated backpropagation through time,
as pytorch/examples' word_language_model does it): a NaN one step made is in every later
step's state, and those steps are not new origins."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class Forecaster(nn.Module):
    """The hidden state passed in and returned, detached by the loop."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 8)

    def forward(
        self, x: torch.Tensor, hidden: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        out, hidden = self.lstm(x, hidden)
        return self.head(out), hidden


class StatefulForecaster(Forecaster):
    """The hidden state kept on the module between steps."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        out, h = self.lstm(x, self.hidden)
        self.hidden = (h[0].detach(), h[1].detach())
        return self.head(out)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("kept_on_module", [True])
def test_a_nan_carried_in_the_hidden_state_has_one_origin(mode: str, kept_on_module: bool) -> None:
    # (A state passed in as an argument is not told from a new corrupt batch of its shape:
    # each such step stays an origin. Kept on the module, it is the module's state.)
    torch.manual_seed(0)
    batch, length, chunks = 16, 20, 6
    series = torch.randn(batch, length * chunks + 1, 8).cumsum(1) * 0.1
    series[5, 2 * length + 7, 4] = float("nan")  # one missing reading, in chunk 2
    model = StatefulForecaster() if kept_on_module else Forecaster()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    hidden = None
    with nanguard.watch(
        model, optimizer=opt, mode=mode, on_nonfinite="skip_step", max_consecutive_skips=100
    ) as guard:
        for i in range(chunks):
            x = series[:, i * length : (i + 1) * length]
            y = series[:, i * length + 1 : (i + 1) * length + 1]
            if kept_on_module:
                pred = model(x)
            else:
                pred, hidden = model(x, hidden)
                hidden = (hidden[0].detach(), hidden[1].detach())
            loss = guard.check_loss(F.mse_loss(pred, y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origins = [(e.step, e.phase, e.tensor) for e in guard.events if e.is_origin]
    assert origins == [(2, "input", "args[0]")]
    carried = [e for e in guard.events if e.details.get("reason") == "carried_state"]
    assert [e.step for e in carried] == [3, 4, 5]
    for event in carried:
        assert event.details["origin_step"] == 2
        assert "the origin at step 2" in event.message
        assert "reset that state" in event.message
    assert "`self.hidden` the model read" in carried[0].message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_carried_state_beside_weights_gone_nan_says_resetting_it_will_not_help(
    mode: str,
) -> None:
    # on_nonfinite="warn" lets step 2's update apply its NaN gradients: the weights are NaN
    # as well as the state, and resetting the state cannot bring training back.
    torch.manual_seed(0)
    series = torch.randn(16, 6 * 20 + 1, 8).cumsum(1) * 0.1
    series[5, 2 * 20 + 7, 4] = float("nan")
    model = StatefulForecaster()
    opt = torch.optim.SGD(model.parameters(), 1e-2)
    guard = nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="warn")  # type: ignore[arg-type]

    def train() -> None:
        for i in range(6):
            x, y = series[:, i * 20 : (i + 1) * 20], series[:, i * 20 + 1 : (i + 1) * 20 + 1]
            loss = guard.check_loss(F.mse_loss(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.warns(nanguard.NonFiniteWarning):
        train()
    assert [(e.step, e.phase) for e in guard.events if e.is_origin] == [(2, "input")]
    later = [e.message for e in guard.events if e.step >= 3]
    assert any("training cannot recover by itself" in m for m in later)
    assert not any("reset that state" in m for m in later)


def test_a_new_nan_batch_after_a_carried_step_is_still_an_origin() -> None:
    """The batch itself (args[0]) is never taken for carried state."""
    torch.manual_seed(0)
    model = Forecaster()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    hidden = None
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for i in range(3):
            x = torch.randn(4, 10, 8)
            if i in (0, 2):
                x[1, 3, 2] = float("nan")
            pred, hidden = model(x, hidden if i != 2 else None)
            hidden = (hidden[0].detach(), hidden[1].detach())
            loss = F.mse_loss(pred, torch.zeros_like(pred))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(e.step, e.phase) for e in guard.events if e.is_origin][:1] == [(0, "input")]
    assert (2, "input") in [(e.step, e.phase) for e in guard.events if e.is_origin]


class CausalForecaster(nn.Module):
    """pytorch/examples' word_language_model style: the causal mask cached on the module
    (-inf above the diagonal), rebuilt when the window length changes. No recurrent state."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
        self.head = nn.Linear(32, 4)
        self.src_mask: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.src_mask is None or self.src_mask.size(0) != x.size(1):
            self.src_mask = nn.Transformer.generate_square_subsequent_mask(x.size(1))
        return self.head(self.encoder(self.proj(x), mask=self.src_mask, is_causal=True))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_new_nan_batch_is_an_origin_beside_a_cached_mask(mode: str) -> None:
    torch.manual_seed(0)
    model = CausalForecaster()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(
        model, optimizer=opt, mode=mode, on_nonfinite="skip_step", max_consecutive_skips=100
    ) as guard:
        for step in range(6):
            x = torch.randn(8, 12 + step % 2, 4)  # (window lengths vary: the mask is rebuilt)
            if step in (1, 4):
                x[3, 5, 2] = float("nan")  # two separate corrupt readings
            loss = guard.check_loss(nn.functional.mse_loss(model(x), torch.zeros_like(x)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origins = [(e.step, e.phase, e.tensor) for e in guard.events if e.is_origin]
    assert origins == [(1, "input", "args[0]"), (4, "input", "args[0]")]
    assert not [e for e in guard.events if e.details.get("reason") == "carried_state"]
