"""From a review with complex-valued, FFT-based and spectral models (scientific ML, speech)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class UnitPhase(nn.Module):
    """A unit-modulus conjugate spectrum: z / |z| is 0/0 at a silent sample, and the result
    is a lazy conjugate view (``.conj()``), which ``torch.view_as_real`` refuses."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.fft.rfft(x)
        return (z / z.abs()).conj()


class PhaseClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.phase = UnitPhase()
        self.head = nn.Linear(2 * 33, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.phase(x)
        return self.head(torch.cat([z.real, z.imag], -1))


def _silent_batch() -> torch.Tensor:
    x = torch.randn(8, 64)
    x[2] = 0  # a silent sample
    return x


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_in_a_conjugate_view_is_found_without_gradients(mode: str) -> None:
    torch.manual_seed(0)
    model = UnitPhase()
    with (
        nanguard.watch(model, mode=mode, on_nonfinite="log") as guard,
        torch.no_grad(),
    ):
        model(_silent_batch())
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "", "aten.div.Tensor")
    assert origin.stats is not None
    assert origin.stats.dtype == "torch.complex64"
    assert origin.stats.nan_count == 33  # the silent sample's 33 frequencies


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_module_returning_a_conjugate_view_is_named_not_the_next_one(mode: str) -> None:
    torch.manual_seed(0)
    model = PhaseClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        F.cross_entropy(model(_silent_batch()), torch.zeros(8, dtype=torch.long)).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "phase", "aten.div.Tensor")
    assert "divided by zero" in (origin.hint or "")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_in_a_conjugated_batch_is_an_input_origin(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(33, 16, dtype=torch.cfloat))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    spec = torch.fft.rfft(torch.randn(8, 64))
    spec[3, 5] = complex(float("nan"), 0.0)  # a corrupt sample
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        model(spec.conj()).abs().pow(2).mean().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("input", "")


class CompressedSpectrum(nn.Module):
    """Power-law compression of a conjugated complex projection: |z| ** 0.3 has an infinite
    slope at |z| = 0 (a silent sample), and the gradient reaching ``cl`` is conjugated."""

    def __init__(self) -> None:
        super().__init__()
        self.cl = nn.Linear(33, 64, dtype=torch.cfloat, bias=False)
        self.out = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.cl(torch.fft.rfft(x)).conj()
        return self.out(z.abs() ** 0.3)


@pytest.mark.parametrize(
    ("mode", "backward"), [("full", True), ("full", "probes"), ("sentinel", True)]
)
def test_a_backward_nan_behind_a_conjugate_names_the_power(mode: str, backward: bool | str) -> None:
    torch.manual_seed(0)
    model = CompressedSpectrum()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(16, 64)
    x[4] = 0
    with nanguard.watch(
        model, optimizer=opt, mode=mode, backward=backward, on_nonfinite="log"
    ) as guard:
        F.cross_entropy(model(x), torch.zeros(16, dtype=torch.long)).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "")
    assert origin.op == "aten.pow.Tensor_Scalar in PowBackward0"
    assert origin.source is not None
    assert "z.abs() ** 0.3" in origin.source


class ComplexGain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(64, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).real


def test_an_exploding_complex_gradient_is_warned_about_with_its_whole_norm() -> None:
    # Its float32 norm overflows: the exact norm must keep the imaginary part (all of it).
    model = ComplexGain()
    opt = torch.optim.SGD(model.parameters(), lr=1e-30)
    gen = torch.Generator().manual_seed(0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for i in range(12):
            scale = 1e25 if i == 11 else 1.0
            x = torch.complex(torch.ones(64), torch.randn(64, generator=gen) * scale)
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    (event,) = guard.events
    assert (event.step, event.kind, event.phase) == (11, "grad_norm", "grad")
    assert "jumped to 7.7" in event.message


class SpectralConv1d(nn.Module):
    """A Fourier Neural Operator's spectral convolution (complex weights on the lowest modes)."""

    def __init__(self, channels: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.w = nn.Parameter(torch.randn(channels, channels, modes, dtype=torch.cfloat) / channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = torch.fft.rfft(x)
        out = torch.zeros(x.shape[0], x.shape[1], x.shape[-1] // 2 + 1, dtype=torch.cfloat)
        out[..., : self.modes] = torch.einsum("bix,iox->box", xf[..., : self.modes], self.w)
        return torch.fft.irfft(out, n=x.shape[-1])


def test_a_complex_product_overflowing_to_nan_gets_the_overflow_hint() -> None:
    # Weights and activations that exploded: (a+bi)(c+di) overflows as ac - bd = inf - inf.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 16, 1), SpectralConv1d(16, 12), nn.Conv1d(16, 1, 1))
    with torch.no_grad():
        model[0].weight.mul_(1e19)
        model[1].w.mul_(1e21)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        model(torch.randn(8, 1, 64)).pow(2).mean().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.kind, origin.module, origin.op) == ("nan", "1", "aten.bmm.default")
    assert origin.hint is not None
    assert "overflowed complex64 (above 3.403e+38) to Inf then NaN" in origin.hint
