"""From reviews modelled on public bug reports of pytorch/pytorch and of detection, speech
and RL codebases: the hints a user reads must point at the fix that works."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


# ------------------------------------------- a hand-written CTC/HMM recursion in the loss
class AcousticModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(8, 16, batch_first=True)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.out(self.rnn(x)[0]), -1)


def monotonic_nll(emissions: torch.Tensor) -> torch.Tensor:
    """pytorch/pytorch#31829: a left-to-right alignment's forward algorithm, log(0) written
    as -inf. The loss is finite; logsumexp over two -inf predecessors has a NaN slope."""
    b, t, s = emissions.shape
    alpha = torch.cat([emissions[:, 0, :1], torch.full((b, s - 1), float("-inf"))], 1)
    for i in range(1, t):
        moved = torch.cat([torch.full((b, 1), float("-inf")), alpha[:, :-1]], 1)
        alpha = torch.logsumexp(torch.stack([alpha, moved]), 0) + emissions[:, i]
    return -alpha[:, -1].mean()


def loss_backward_hint(model: nn.Module, loss_of: Callable[[], torch.Tensor]) -> str:
    """One step whose loss is finite and whose backward is not: the origin's hint."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt) as guard:
        loss = guard.check_loss(loss_of())
        assert torch.isfinite(loss)
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details["reason"]) == ("loss", "loss_backward")
    assert origin.hint is not None
    return origin.hint


def test_a_logsumexp_over_minus_inf_in_the_loss_is_named_by_the_loss_backward_hint() -> None:
    torch.manual_seed(0)
    model = AcousticModel()
    hint = loss_backward_hint(model, lambda: monotonic_nll(model(torch.randn(3, 6, 8))))
    assert "logsumexp, whose slope exp(x - lse) is NaN over a slice entirely -inf" in hint


# ----------------------------------------- the hook-based spectral_norm of a zero weight
def test_the_hook_based_spectral_norm_of_a_zero_weight_gets_its_own_hint() -> None:
    """pytorch/pytorch#20192: sigma = u^T W v = 0 for a zero-initialised weight; the
    division is torch's own pre-hook's, where no eps can be added."""
    torch.manual_seed(0)
    head = nn.Linear(8, 4)
    nn.init.zeros_(head.weight)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.utils.spectral_norm(head))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(4, 8)).sum().backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "2", "aten.div.Tensor")
    assert origin.hint is not None
    assert "largest singular value, estimated as 0" in origin.hint
    assert "Add an eps" not in origin.hint


# ----------------------------------------------------- gumbel_softmax's own noise at 0
@pytest.fixture
def zero_exponential_draw(monkeypatch: pytest.MonkeyPatch) -> dict[str, bool]:
    """pytorch/pytorch#22442, #101620: ``exponential_`` returned exactly 0 now and then,
    and gumbel_softmax's noise -log(0) was Inf. The rare draw is made to happen once."""
    state = {"on": False}
    original = torch.Tensor.exponential_

    def exponential_(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        out = original(self, *args, **kwargs)  # type: ignore[arg-type]
        if state["on"]:
            out.view(-1)[5] = 0.0
        return out

    monkeypatch.setattr(torch.Tensor, "exponential_", exponential_)
    return state


class Selector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gumbel_softmax(self.score(x), tau=0.5)


def test_gumbel_softmax_noise_of_an_exact_zero_draw_names_the_noise(
    zero_exponential_draw: dict[str, bool],
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Selector(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(3):
            zero_exponential_draw["on"] = step == 2
            loss = guard.check_loss(F.mse_loss(model(torch.randn(16, 10)), torch.randn(16, 1)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.module, origin.op) == (2, "0", "aten.log.default")
    assert origin.hint is not None
    assert "inside F.gumbel_softmax took the log of its own noise sample" in origin.hint


# ---------------------------------------- a std over one frame: correction=0 is no fix
class UtteranceMVN(nn.Module):
    """fairseq's per-utterance mean and variance normalisation of a spectrogram."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - x.mean(0)) / x.std(0)


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.normalize = UtteranceMVN()
        self.proj = nn.Linear(20, 8)

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        return self.proj(self.normalize(frames)).mean(0)


def test_a_std_over_one_frame_says_to_skip_it_or_add_an_eps_where_it_divides() -> None:
    torch.manual_seed(0)
    model = Encoder()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        for frames in (40, 1):  # (the second utterance is one frame long)
            model(torch.randn(frames, 20)).sum().backward()
            guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.module, origin.op) == (1, "normalize", "aten.std.correction")
    assert origin.hint is not None
    assert "Skip inputs of one element" in origin.hint
    assert "divide by std + eps" in origin.hint


# ------------------------------------------- a regression target from a flipped box
class BoxTargets(nn.Module):
    """A region-proposal head that encodes its regression targets inside forward, as
    torchvision's BoxCoder: log(gt_w / anchor_w)."""

    def __init__(self) -> None:
        super().__init__()
        self.deltas = nn.Linear(16, 4)
        self.register_buffer("anchors", torch.tensor([[0.0, 0.0, 8.0, 8.0]]).repeat(6, 1))

    def forward(self, features: torch.Tensor, boxes: torch.Tensor) -> torch.Tensor:
        pred = self.deltas(features)
        anchor_w = self.anchors[:, 2] - self.anchors[:, 0]
        gt_w = boxes[:, 2] - boxes[:, 0]
        target = torch.log(gt_w / anchor_w)
        return F.smooth_l1_loss(pred[:, 2], target)


def test_log_of_a_target_computed_from_data_alone_points_at_the_data() -> None:
    torch.manual_seed(0)
    model = BoxTargets()
    boxes = torch.tensor([[1.0, 1.0, 5.0, 6.0]]).repeat(6, 1)
    boxes[3] = torch.tensor([6.0, 1.0, 2.0, 6.0])  # a horizontal flip gone wrong: x2 < x1
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(6, 16), boxes).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "", "aten.log.default")
    assert origin.hint is not None
    assert "a bad sample, label or constant" in origin.hint
    assert "clamp_min(1e-12)" not in origin.hint


class LogOfActivations(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(self.proj(x))  # (negative outputs: the model's own doing)


def test_log_of_values_that_need_a_gradient_keeps_the_clamp_advice() -> None:
    torch.manual_seed(0)
    model = LogOfActivations()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(8, 4)).sum().backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.hint is not None
    assert "clamp_min(1e-12)" in origin.hint
    assert "a bad sample, label or constant" not in origin.hint


# ------------------------------------ exp of box sizes, steps after a gradient spike
class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(1.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


class FCOSHead(nn.Module):
    """mmdetection's FCOS regression branch: exp(scale(conv_reg(feat)))."""

    def __init__(self) -> None:
        super().__init__()
        self.reg_convs = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU())
        self.conv_reg = nn.Conv2d(16, 4, 3, padding=1)
        self.scale = Scale()

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        return self.scale(self.conv_reg(self.reg_convs(feat))).float().exp()


class Detector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 16, 3, 2, 1)
        )
        self.bbox_head = FCOSHead()

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        return self.bbox_head(self.backbone(img))


def iou_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mmdetection's IoULoss on ltrb distances, -log(iou), in float64 (finite for any
    finite prediction: the overflow is the model's exp)."""
    pl, pt, pr, pb = pred.double().unbind(-1)
    tl, tt, tr, tb = target.double().unbind(-1)
    area_p = (pl + pr) * (pt + pb)
    area_t = (tl + tr) * (tt + tb)
    inter = (torch.min(pl, tl) + torch.min(pr, tr)) * (torch.min(pb, tb) + torch.min(pt, tt))
    return -torch.log((inter + 1.0) / (area_t + area_p - inter + 1.0)).mean()


def test_an_exp_overflow_after_a_gradient_spike_names_the_spike() -> None:
    """mmdetection#1606: one batch not normalised (raw 0-255 pixels) makes the gradient
    norm jump; a few steps later the regression logits pass 88.7 and exp overflows."""
    torch.manual_seed(0)
    model = Detector()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pos = torch.zeros(2, 8, 8, dtype=torch.bool)
    pos[:, 2:6, 2:6] = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)  # (the spike's warning)
        with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
            for step in range(8):
                img = torch.rand(2, 3, 32, 32) * 255.0
                if step != 3:
                    img = (img - 123.0) / 58.0
                target = torch.rand(2, 8, 8, 4) * 20 + 1
                reg = model(img)
                loss = guard.check_loss(iou_loss(reg.permute(0, 2, 3, 1)[pos], target[pos]))
                opt.zero_grad()
                loss.backward()
                opt.step()
    spikes = [e.step for e in guard.events if e.kind == "grad_norm"]
    assert spikes
    assert spikes[0] == 3
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "bbox_head", "aten.exp.default")
    assert origin.step == 5
    assert origin.hint is not None
    assert "the gradient norm spiked at step 3" in origin.hint


# ------------------------- sentinel mode, a model trained through its submodules only
class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
        self.critic = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 1))


def test_sentinel_loss_origin_without_a_recorded_forward_still_gets_a_hedged_hint() -> None:
    """stable-baselines3#325: advantages normalised over a minibatch of one sample."""
    torch.manual_seed(0)
    agent = Agent()
    opt = torch.optim.Adam(agent.parameters(), lr=3e-4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (no recorded forward; the std of one value)
        with nanguard.watch(agent, optimizer=opt, mode="sentinel", on_nonfinite="log") as guard:
            for batch in (8, 1):
                obs = torch.randn(batch, 4)
                logits, value = agent.actor(obs), agent.critic(obs).squeeze(-1)
                returns = torch.randn(batch)
                adv = returns - value.detach()
                adv = (adv - adv.mean()) / adv.std()
                logp = torch.log_softmax(logits, -1)[:, 0]
                loss = guard.check_loss(-(logp * adv).mean() + F.mse_loss(value, returns))
                opt.zero_grad()
                loss.backward()
                opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (1, "loss")
    assert origin.hint is not None
    assert origin.hint.startswith("The model's outputs went unchecked")


# ------------------------------------------ cosine_similarity of a zero vector in float16
class Tower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 64)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = Tower()
        self.b = Tower()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cosine_similarity(self.a(x), self.b(y), dim=-1)


def test_float16_cosine_similarity_of_a_zero_vector_names_its_eps() -> None:
    """pytorch/pytorch#69512: F.cosine_similarity's eps=1e-8 is 0 in float16; a tower whose
    ReLU died returns a zero embedding, and the cosine is 0/0."""
    torch.manual_seed(0)
    model = Siamese()
    with torch.no_grad():
        model.a.fc.bias.fill_(-50.0)  # (dead: every unit below 0)
        model.a.fc.weight.mul_(0.01)
    model.half()
    x = torch.randn(8, 32, dtype=torch.float16)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(x, torch.randn(8, 32, dtype=torch.float16)).float().sum().backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "", "aten.div.Tensor")
    assert origin.hint is not None
    assert "inside F.cosine_similarity: its eps=1e-8 rounds to 0 in float16" in origin.hint


# ---------------------------- time series: a dispersion underflowing, a NaN filled away
class NegativeBinomialHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 2)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu_raw, alpha_raw = self.proj(h).unbind(-1)
        return F.softplus(mu_raw), F.softplus(alpha_raw)


class Forecaster(nn.Module):
    """Hugging Face's time-series models: the NLL computed in forward when given the
    future values (gluonts#287: a dispersion whose softplus underflows, 1 / alpha = Inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(1, 16, batch_first=True)
        self.head = NegativeBinomialHead()

    def forward(self, past: torch.Tensor, future: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(past.unsqueeze(-1))
        mu, alpha = self.head(h)
        total_count = 1.0 / alpha
        distr = torch.distributions.NegativeBinomial(
            total_count=total_count, logits=torch.log(mu * alpha), validate_args=False
        )
        return -distr.log_prob(future).mean()


def test_a_quotient_that_overflowed_from_a_tiny_denominator_is_not_called_a_division_by_zero() -> (
    None
):
    torch.manual_seed(0)
    model = Forecaster()
    with torch.no_grad():
        model.head.proj.bias[1] = -100.0  # (softplus(-100) = 4e-44: a subnormal alpha)
    y = torch.poisson(torch.full((8, 25), 3.0))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(y[:, :-1], y[:, 1:]).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "", "aten.reciprocal.default")
    assert origin.hint is not None
    assert "divided by a denominator as small as" in origin.hint
    assert "divided by zero" not in origin.hint


def divide_no_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """N-BEATS' loss helper (darts, neuralforecast): a / b with NaN and Inf filled by 0."""
    result = a / b
    result[result != result] = 0.0
    result[result == float("inf")] = 0.0
    result[result == float("-inf")] = 0.0
    return result


def test_a_0_over_0_filled_in_the_loss_names_the_fill_not_an_eps() -> None:
    """darts#2517: MAPE over a zero target: the forward is finite (the NaN filled by 0),
    the backward 0 / 0 = NaN into the forecasts."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(24, 64), nn.ReLU(), nn.Linear(64, 6))
    series = 5 + torch.poisson(torch.full((16, 30), 4.0))
    series[3, 27] = 0.0  # (a store closed for a day: a zero target)
    target = series[:, 24:]
    hint = loss_backward_hint(
        model, lambda: divide_no_nan(target - model(series[:, :24]), target).abs().mean()
    )
    assert "masked_fill or nan_to_num hid" in hint
