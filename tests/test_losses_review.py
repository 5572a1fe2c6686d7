"""From a review of losses written by hand as public bug reports show them: contrastive
losses at a CLIP logit scale, VICReg on an epoch's last batch of one, a cosine similarity by
hand, an STFT magnitude by hypot, a re-id net ending in nn.Flatten."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


def _failing_step(
    model: nn.Module, mode: str, batch: tuple[torch.Tensor, ...], loss_fn: object, **options: object
) -> nanguard.Event:
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with nanguard.watch(model, optimizer=opt, mode=mode, **options) as guard:  # type: ignore[arg-type]
        loss = guard.check_loss(loss_fn(*batch))  # type: ignore[operator]
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError) as raised:
            opt.step()
    return raised.value.event


class DualEncoder(nn.Module):
    """Two views through one encoder, CLIP's learnt logit scale at its clamp of 100."""

    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Sequential(nn.Linear(512, 512), nn.GELU(), nn.Linear(512, 128))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(100.0)))

    def forward(self, v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        a = F.normalize(self.img(v1), dim=-1)
        b = F.normalize(self.img(v2), dim=-1)
        return self.logit_scale.exp().clamp(max=100) * a @ b.t()


def infonce_by_hand(logits: torch.Tensor) -> torch.Tensor:
    e = torch.exp(logits)  # exp(100 * cos) is Inf past cos = 0.887, in any precision
    return -torch.log(e.diagonal() / e.sum(1)).mean()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_hand_written_softmax_at_logit_scale_100_under_bf16_is_not_blamed_on_bf16(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = DualEncoder()
    x = torch.randn(64, 512)
    views = (x + 0.3 * torch.randn(64, 512), x + 0.3 * torch.randn(64, 512))

    def loss_fn(v1: torch.Tensor, v2: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return infonce_by_hand(model(v1, v2).float())  # (the loss in float32 already)

    event = _failing_step(model, mode, views, loss_fn)
    assert event.phase == "loss"
    assert event.hint is not None
    assert "softmax or logsumexp written by hand" in event.hint
    assert "F.cross_entropy" in event.hint
    assert "round to exactly 0 or 1" not in event.hint  # (bfloat16 rounding is not it)


class Expander(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(100, 256), nn.ReLU())
        self.projector = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512))
        self.probe = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.backbone(x)
        return self.projector(h), self.probe(h.detach())  # (solo-learn's online probe)


def vicreg(z1: torch.Tensor, z2: torch.Tensor) -> torch.Tensor:
    n, d = z1.shape
    std1 = torch.sqrt(z1.var(dim=0) + 1e-4)
    std2 = torch.sqrt(z2.var(dim=0) + 1e-4)
    var = F.relu(1 - std1).mean() / 2 + F.relu(1 - std2).mean() / 2
    z1c = z1 - z1.mean(0)
    cov = (z1c.T @ z1c) / (n - 1)
    off = cov.pow(2).sum() - cov.diagonal().pow(2).sum()
    return 25 * F.mse_loss(z1, z2) + 25 * var + off / d


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_vicreg_on_a_last_batch_of_one_names_the_variance_not_ignored_labels(mode: str) -> None:
    torch.manual_seed(0)
    model = Expander()
    x = torch.randn(1, 100)  # 1025 samples in batches of 64: the last holds one
    y = torch.randint(0, 10, (1,))

    def loss_fn(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        (z1, logits), (z2, _) = model(x + 0.1), model(x - 0.1)
        return vicreg(z1, z2) + F.cross_entropy(logits, y)

    with pytest.warns(UserWarning, match="degrees of freedom"):  # (torch's own note)
        event = _failing_step(model, mode, (x, y), loss_fn)
    assert event.phase == "loss"
    assert event.hint is not None
    assert event.hint.index("std/var over a batch of one sample") < event.hint.find("ignore")
    assert "drop_last=True" in event.hint


class BiEncoder(nn.Module):
    """Mean-pooled token embeddings; an all-padding query pools to a zero vector."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 64, padding_idx=0)
        self.proj = nn.Linear(64, 64, bias=False)

    def forward(self, q: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.proj(self.emb(q).mean(1)), self.proj(self.emb(d).mean(1))


def ranking_loss(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    cos = a @ b.T / (a.norm(dim=1, keepdim=True) * b.norm(dim=1, keepdim=True).T)
    return F.cross_entropy(20 * cos, torch.arange(a.shape[0]))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_cosine_by_hand_of_a_zero_embedding_names_the_norm(mode: str) -> None:
    torch.manual_seed(0)
    model = BiEncoder()
    q = torch.randint(1, 1000, (32, 12))
    q[3] = 0  # an empty query: all padding
    d = torch.randint(1, 1000, (32, 40))

    def loss_fn(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
        return ranking_loss(*model(q, d))

    event = _failing_step(model, mode, (q, d), loss_fn)
    assert event.phase == "loss"
    assert event.hint is not None
    assert event.hint.index("a division by a norm") < event.hint.find("ignore_index")
    assert "F.normalize" in event.hint


class MaskNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(1, 16, 15, padding=7), nn.PReLU(), nn.Conv1d(16, 1, 15, padding=7)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.net(x.unsqueeze(1))).squeeze(1)  # 0 over the padding


def stft_loss(y_hat: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    loss = y_hat.new_zeros(())
    for n in (256, 512):
        a, b = (
            torch.stft(v, n, n // 4, window=torch.hann_window(n), return_complex=True)
            for v in (y_hat, y)
        )
        mag_a, mag_b = torch.hypot(a.real, a.imag), torch.hypot(b.real, b.imag)
        loss = loss + F.l1_loss(mag_a.clamp(min=1e-7).log(), mag_b.clamp(min=1e-7).log())
    return loss


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_stft_magnitude_by_hypot_over_zero_padding_names_hypot(mode: str) -> None:
    torch.manual_seed(0)
    model = MaskNet()
    clean = torch.randn(4, 8000) * 0.1
    clean[:, 5000:] = 0.0  # zero-padded utterances: silent STFT frames
    noisy = clean + 0.05 * torch.randn(4, 8000) * (clean != 0)

    def loss_fn(noisy: torch.Tensor, clean: torch.Tensor) -> torch.Tensor:
        return stft_loss(model(noisy), clean)

    event = _failing_step(model, mode, (noisy, clean), loss_fn)
    assert (event.phase, event.details["reason"]) == ("loss", "loss_backward")
    assert event.hint is not None
    assert event.hint.startswith("The loss's backward made NaN from a finite loss")
    assert "hypot, whose slope" in event.hint


class ReIdNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 16, 3, stride=2, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(16, 50, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = self.backbone(x)
        return f, self.classifier(f)  # (the embedding, and identity logits from it)


def triplet_by_hand(e: torch.Tensor) -> torch.Tensor:
    sq = (e * e).sum(1)
    d = (sq[:, None] + sq[None, :] - 2 * e @ e.t()).clamp(min=0).sqrt()  # 0 on the diagonal
    return F.relu(d[:, :4].max(1).values - d[:, 4:].min(1).values + 0.3).mean()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_gradient_at_an_output_made_by_flatten_has_the_outputs_shape(mode: str) -> None:
    torch.manual_seed(0)
    model = ReIdNet()
    x = torch.randn(8, 3, 32, 16)

    def loss_fn(x: torch.Tensor) -> torch.Tensor:
        f, logits = model(x)
        return triplet_by_hand(f) + F.cross_entropy(logits, torch.arange(8) // 4)

    event = _failing_step(model, mode, (x,), loss_fn)
    assert (event.phase, event.tensor) == ("loss", "grad of output[0]")
    assert event.stats is not None
    assert event.stats.shape == (8, 16)  # (not the pooling's (8, 16, 1, 1))
    assert "(shape (8, 16)," in event.message


def test_skip_step_says_it_put_back_the_finite_batchnorm_statistics_of_the_dropped_batch() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 16))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(8, 32)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard:
        before = {k: v.clone() for k, v in model.state_dict().items()}
        loss = guard.check_loss(triplet_by_hand(model(x)))  # finite; its backward is not
        opt.zero_grad()
        loss.backward()
        opt.step()
    skipped = [e for e in guard.events if e.details.get("skipped")]
    assert len(skipped) == 1
    assert skipped[0].details["restored"] == []  # (none went non-finite)
    assert skipped[0].details["rolled_back"] == [
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    assert "The 3 finite running statistics its forward updated were put back" in (
        skipped[0].message
    )
    for name, value in model.state_dict().items():  # (the batch left no trace)
        assert torch.equal(value, before[name]), name


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_masked_squared_error_by_hand_over_missing_targets_says_select_first(mode: str) -> None:
    # Forecasting targets read from a CSV hold NaN where values are missing; the loss
    # drops them after squaring: the backward's 0 * NaN at the dropped entries.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 256), nn.ReLU(), nn.Linear(256, 24))
    history, future = torch.randn(32, 96), torch.randn(32, 24)
    future[5, 10:14] = float("nan")  # a sensor outage

    def loss_fn(history: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        pred = model(history)
        return ((pred - future) ** 2)[~torch.isnan(future)].mean()

    event = _failing_step(model, mode, (history, future), loss_fn)
    assert (event.phase, event.details["reason"]) == ("loss", "loss_backward")
    assert event.hint is not None
    assert "selected after it was computed" in event.hint
    assert "Select before the loss" in event.hint


class ConstrainedDecoder(nn.Module):
    """Masks vocabulary ids that are never legal (15 to 19) with ``fill``."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.fill = fill
        self.emb = nn.Embedding(20, 16)
        self.proj = nn.Linear(16, 20)
        legal = torch.ones(20, dtype=torch.bool)
        legal[15:] = False
        self.register_buffer("legal", legal)

    def forward(self, tok: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(tok)).masked_fill(~self.legal, self.fill)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("fill", [-math.inf, torch.finfo(torch.float32).min])
def test_label_smoothing_over_a_masked_vocabulary_is_told_a_fix_that_works(
    fill: float, mode: str
) -> None:
    # label_smoothing puts eps / C of the target on every class: -inf * eps / C is +Inf, and
    # so is a sum of five finfo.min log-probabilities. -1e4 works; finfo.min does not.
    torch.manual_seed(0)
    model = ConstrainedDecoder(fill)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    ce = nn.CrossEntropyLoss(label_smoothing=0.1)
    tok, target = torch.randint(0, 15, (12,)), torch.randint(0, 15, (12,))
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        loss = guard.check_loss(ce(model(tok), target))
        opt.zero_grad()
        loss.backward()
        opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.kind) == (0, "loss", "inf")
    assert origin.hint is not None
    assert "-1e4" in origin.hint
    assert "label_smoothing" in origin.hint
    assert "Mask with torch.finfo" not in origin.hint
    assert "exploding" not in origin.hint
    assert "normalise the inputs" not in origin.hint
    # ...and -1e4 is finite indeed.
    assert torch.isfinite(ce(ConstrainedDecoder(-1e4)(tok), target))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_unchecked_loss_over_a_nan_target_names_the_sample(mode: str) -> None:
    # The loss is not passed to check_loss: the NaN is first seen in the gradient at the
    # outputs, in one row only: the sample whose regression target is NaN.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x, y = torch.randn(8, 10), torch.randn(8, 1)
    y[6] = math.nan
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:  # type: ignore[arg-type]
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details["reason"]) == ("loss", "loss_backward")
    assert origin.details["samples"] == [6]
    assert origin.hint is not None
    assert origin.hint.startswith("Only sample 6 (of 8 along dim 0)")
    assert "targets" in origin.hint
