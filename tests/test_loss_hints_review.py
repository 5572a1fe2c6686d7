"""Hints for losses that go non-finite from finite model outputs, on the losses vision and
generative models write by hand: NT-Xent's softmax, a -log(IoU) over decoded boxes, box
targets encoded with a log, Min-SNR loss weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard

MODES = ("full", "sentinel")


def _loss_origin(
    model: nn.Module, mode: str, loss_of: object, *inputs: torch.Tensor
) -> nanguard.Event:
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = guard.check_loss(loss_of(*(model(x) for x in inputs)))  # type: ignore[operator]
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    return origin


class _Projector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.net(x), dim=1)


def _nt_xent(z1: torch.Tensor, z2: torch.Tensor, tau: float = 0.01) -> torch.Tensor:
    z = torch.cat([z1, z2])
    n = z1.size(0)
    sim = torch.exp(z @ z.T / tau)  # cos > 0.887 over tau = 0.01: exp(> 88.7) = Inf
    sim = sim.masked_fill(torch.eye(2 * n, dtype=torch.bool), 0)
    pos = torch.cat([torch.diagonal(sim, n), torch.diagonal(sim, -n)])
    return -torch.log(pos / sim.sum(1)).mean()


@pytest.mark.parametrize("mode", MODES)
def test_nt_xent_with_a_small_temperature_names_the_hand_written_softmax(mode: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 64)
    view1, view2 = x + 0.01 * torch.randn_like(x), x + 0.01 * torch.randn_like(x)
    origin = _loss_origin(_Projector(), mode, _nt_xent, view1, view2)
    assert origin.kind == "nan"
    assert "a softmax or logsumexp written by hand" in origin.hint
    assert "F.cross_entropy" in origin.hint


def _bolts_nt_xent(z1: torch.Tensor, z2: torch.Tensor, tau: float = 0.01) -> torch.Tensor:
    """lightning-bolts' nt_xent_loss: the self-similarity exp(1/tau) subtracted from the row
    sums, clamped, an eps added (Lightning-Universe/lightning-bolts#811)."""
    out = torch.cat([z1, z2])
    sim = torch.exp(out @ out.T / tau)
    neg = sim.sum(-1)
    row_sub = torch.exp(torch.ones_like(neg) / tau)
    neg = torch.clamp(neg - row_sub, min=1e-6)
    pos = torch.exp(torch.sum(z1 * z2, -1) / tau)
    pos = torch.cat([pos, pos])
    return -torch.log(pos / (neg + 1e-6)).mean()


@pytest.mark.parametrize("mode", MODES)
def test_an_nt_xent_that_clamps_its_sums_still_names_the_exp(mode: str) -> None:
    """Between its log and its exps: a clamp, a subtraction, an eps, a cat. exp(100) is Inf,
    Inf - Inf NaN: the exp is named beside the log, not a division of a count."""
    torch.manual_seed(0)
    x = torch.randn(16, 64)
    view1, view2 = x + 0.01 * torch.randn_like(x), x + 0.01 * torch.randn_like(x)
    origin = _loss_origin(_Projector(), mode, _bolts_nt_xent, view1, view2)
    assert origin.kind == "nan"
    assert "exp, Inf above 88" in origin.hint
    assert "0/0 over an empty mask" not in origin.hint


def _iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    lt, rb = torch.max(a[..., :2], b[..., :2]), torch.min(a[..., 2:], b[..., 2:])
    inter = (rb - lt).clamp(min=0).prod(-1)
    area_a = (a[..., 2:] - a[..., :2]).prod(-1)
    area_b = (b[..., 2:] - b[..., :2]).prod(-1)
    return inter / (area_a + area_b - inter)


@pytest.mark.parametrize("mode", MODES)
def test_log_iou_over_boxes_decoded_with_exp_is_no_hand_written_softmax(mode: str) -> None:
    """UnitBox's -log(IoU): a positive whose box does not overlap its target is log(0). The
    boxes' sizes were decoded with an exp, far below the log: the log is named, not exp."""
    torch.manual_seed(0)
    centres = torch.rand(64, 2) * 100
    anchors = torch.cat([centres - 8, centres + 8], -1)
    targets = anchors + torch.rand(64, 4) * 4 - 2
    targets[17] = torch.tensor([300.0, 300.0, 320.0, 320.0])  # far from anchor 17

    def loss_of(pred: torch.Tensor) -> torch.Tensor:
        ctr = (anchors[:, :2] + anchors[:, 2:]) / 2 + pred[:, :2] * 16
        wh = 16 * torch.exp(pred[:, 2:].clamp(max=4))
        boxes = torch.cat([ctr - wh / 2, ctr + wh / 2], -1)
        return (-torch.log(_iou(boxes, targets))).mean()

    head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    origin = _loss_origin(head, mode, loss_of, torch.randn(64, 16))
    assert origin.kind == "inf"
    assert "log(0)" in origin.hint
    assert "written by hand" not in origin.hint


@pytest.mark.parametrize("mode", MODES)
def test_box_targets_encoded_with_log_of_a_zero_width_are_named(mode: str) -> None:
    """Faster R-CNN's target encoding log(gt_w / anchor_w) of a zero-width annotation is
    -Inf: the smooth L1 loss is +Inf from finite outputs, and its own code did nothing."""
    torch.manual_seed(0)
    anchors = torch.rand(64, 2) * 100
    anchors = torch.cat([anchors - 8, anchors + 8], -1)
    gt = anchors + torch.rand(64, 4) * 4 - 2
    gt[40, 2] = gt[40, 0]  # x1 == x2
    gw, aw = gt[:, 2] - gt[:, 0], anchors[:, 2] - anchors[:, 0]
    gh, ah = gt[:, 3] - gt[:, 1], anchors[:, 3] - anchors[:, 1]
    targets = torch.stack([gt[:, 0] / aw, gt[:, 1] / ah, torch.log(gw / aw), torch.log(gh / ah)], 1)

    head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    origin = _loss_origin(
        head, mode, lambda pred: F.smooth_l1_loss(pred, targets), torch.randn(64, 16)
    )
    assert origin.kind == "inf"
    assert origin.hint.startswith(
        "The loss is +Inf from finite model outputs: +Inf in the targets (log(w / anchor_w)"
    )
    assert "of a zero-width box" in origin.hint


@pytest.mark.parametrize("mode", MODES)
def test_min_snr_weights_of_a_zero_terminal_snr_schedule_are_named(mode: str) -> None:
    """diffusers' Min-SNR-gamma weighting min(snr, 5) / snr with a zero-terminal-SNR
    schedule: 0/0 = NaN at the last timestep, multiplied into a finite MSE."""
    torch.manual_seed(0)
    betas = torch.linspace(1e-4, 0.02, 1000, dtype=torch.float64)
    alphas_cumprod = torch.cumprod(1 - betas, 0)
    alphas_cumprod[-1] = 0.0  # zero terminal SNR
    snr = (alphas_cumprod / (1 - alphas_cumprod)).float()
    t = torch.randint(0, 999, (16,))
    t[3] = 999
    weights = torch.clamp(snr[t], max=5.0) / snr[t]
    noise = torch.randn(16, 48)

    def loss_of(pred: torch.Tensor) -> torch.Tensor:
        per_sample = F.mse_loss(pred, noise, reduction="none").mean(1)
        return (weights * per_sample).mean()

    denoiser = nn.Sequential(nn.Linear(48, 96), nn.SiLU(), nn.Linear(96, 48))
    origin = _loss_origin(denoiser, mode, loss_of, torch.randn(16, 48))
    assert origin.kind == "nan"
    assert "NaN in the targets or loss weights" in origin.hint


@pytest.mark.parametrize("mode", MODES)
def test_a_cox_partial_likelihood_written_with_cumsum_of_exp_names_the_exp(mode: str) -> None:
    """DeepSurv's loss as many repositories write it, log(cumsum(exp(h))): an unscaled
    covariate (an income in dollars) drives h past 88 and exp overflows."""
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    x[5, 2], x[6, 2] = 3e4, -3e4  # (one of them drives h far above 88, whatever the weight's sign)
    event = (torch.rand(64) < 0.7).float()

    def cox(h: torch.Tensor) -> torch.Tensor:
        h = h.squeeze(-1)  # (samples sorted by decreasing survival time)
        log_risk = torch.log(torch.cumsum(torch.exp(h), 0))
        return -((h - log_risk) * event).sum() / event.sum()

    origin = _loss_origin(nn.Sequential(nn.Linear(8, 1)), mode, cox, x)
    assert "a softmax or logsumexp written by hand" in origin.hint


@pytest.mark.parametrize("mode", MODES)
def test_a_collapsing_concentration_names_lgammas_slope(mode: str) -> None:
    """A Dirichlet-style concentration softplus(h) pushed to a denormal by an outlier: lgamma
    is finite, its derivative digamma is -Inf."""
    torch.manual_seed(0)
    x = torch.randn(32, 6)
    x[3] = -31.6  # h = -94.8 + bias: softplus(h) about 1e-41, a float32 denormal

    def nll(h: torch.Tensor) -> torch.Tensor:
        concentration = nn.functional.softplus(h)
        return (torch.lgamma(concentration).sum(-1) - torch.lgamma(concentration.sum(-1))).mean()

    model = nn.Sequential(nn.Linear(6, 3))
    with torch.no_grad():
        model[0].weight.fill_(0.5)
        model[0].bias.zero_()
    origin = _loss_origin(model, mode, nll, x)
    assert "lgamma, whose slope digamma(x) is about -1/x near 0" in origin.hint


def _supcon(features: torch.Tensor, labels: torch.Tensor, tau: float = 0.1) -> torch.Tensor:
    """SupContrast's SupConLoss with one view, as the repository writes it."""
    mask = torch.eq(labels[:, None], labels[None, :]).float()
    logits = features @ features.T / tau
    logits = logits - logits.max(1, keepdim=True)[0].detach()  # (exp cannot overflow)
    self_mask = 1 - torch.eye(len(labels))
    mask = mask * self_mask
    exp_logits = torch.exp(logits) * self_mask
    log_prob = logits - torch.log(exp_logits.sum(1, keepdim=True))
    mean_log_prob_pos = (mask * log_prob).sum(1) / mask.sum(1)
    return -mean_log_prob_pos.mean()


@pytest.mark.parametrize("mode", MODES)
def test_supcon_over_anchors_without_a_positive_names_the_division(mode: str) -> None:
    """SupContrast#141: a batch of 64 over 100 classes leaves most anchors without a positive:
    mask.sum(1) is 0 and the mean over their positives is 0/0. The max is subtracted first,
    so exp does not overflow: the division is named first."""
    torch.manual_seed(0)
    labels = torch.randint(0, 100, (64,))
    origin = _loss_origin(_Projector(), mode, lambda z: _supcon(z, labels), torch.randn(64, 64))
    assert origin.kind == "nan"
    assert "one of its own operations: a mean of log-probabilities over a count that is 0" in (
        origin.hint
    )
    assert "count.clamp_min(1)" in origin.hint


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("log_prob", ["logsumexp", "log_softmax"])
def test_supcon_written_with_logsumexp_names_the_division_too(mode: str, log_prob: str) -> None:
    """The same loss as most reimplementations write it, the log-probabilities from
    torch.logsumexp or log_softmax (the self-similarity masked with a large negative) rather
    than log of a sum of exps: an anchor without a positive is still 0/0 in the mean."""
    torch.manual_seed(0)
    labels = torch.randint(0, 100, (64,))

    def supcon(z: torch.Tensor) -> torch.Tensor:
        n = len(labels)
        self_mask = torch.eye(n, dtype=torch.bool)
        logits = (z @ z.T / 0.1).masked_fill(self_mask, -1e9)
        if log_prob == "logsumexp":
            log_probs = logits - torch.logsumexp(logits, dim=1, keepdim=True)
        else:
            log_probs = torch.log_softmax(logits, dim=1)
        positives = (labels[:, None] == labels[None, :]) & ~self_mask
        mean_log_prob_pos = (positives * log_probs).sum(1) / positives.sum(1)
        return -mean_log_prob_pos.mean()

    origin = _loss_origin(_Projector(), mode, supcon, torch.randn(64, 64))
    assert origin.kind == "nan"
    assert "a mean of log-probabilities over a count that is 0" in origin.hint


@pytest.mark.parametrize("mode", MODES)
def test_log_cosh_over_unscaled_targets_names_the_cosh_not_a_log_of_zero(mode: str) -> None:
    """torchmetrics#3488: log(cosh(pred - y)) with house prices in thousands: cosh of a
    residual above 89 is Inf in float32, and so is its log (not a log of 0)."""
    torch.manual_seed(0)
    x = torch.randn(128, 13)
    prices = torch.rand(128, 1) * 750 + 50

    def log_cosh(pred: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.cosh(pred - prices)).mean()

    model = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, 1))
    origin = _loss_origin(model, mode, log_cosh, x)
    assert origin.kind == "inf"
    assert "cosh/sinh overflow to Inf above 89" in origin.hint
    assert "softplus(-2r)" in origin.hint
    assert "log(0)" not in origin.hint


@pytest.mark.parametrize("mode", MODES)
def test_missing_labels_dropped_after_an_elementwise_loss_are_named(mode: str) -> None:
    """Tabular regression with missing labels (NaN) dropped after the loss was computed,
    mse(pred, y, reduction="none")[valid].mean(): finite loss, backward 0 * NaN."""
    torch.manual_seed(0)
    x = torch.randn(128, 12)
    y = torch.randn(128, 3)
    y[torch.rand(128, 3) < 0.3] = float("nan")  # missing labels
    valid = ~y.isnan()

    def masked_mse(pred: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(pred, y, reduction="none")[valid].mean()

    model = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 3))
    origin = _loss_origin(model, mode, masked_mse, x)
    assert origin.kind == "nan"
    assert "an elementwise loss selected after it was computed (loss[valid].mean())" in (
        origin.hint
    )
    assert "pred[valid], y[valid]" in origin.hint


class _Acoustic(nn.Module):
    """A CTC acoustic model whose reserved tokens are masked with -inf before log_softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.GRU(40, 64, batch_first=True)
        self.out = nn.Linear(64, 32)
        self.register_buffer("reserved", torch.arange(32) >= 28)

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(feats)
        logits = self.out(h).masked_fill(self.reserved, float("-inf"))
        return logits.log_softmax(-1).transpose(0, 1)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", MODES)
def test_ctc_over_minus_inf_log_probabilities_is_named(mode: str) -> None:
    torch.manual_seed(0)
    targets = torch.randint(1, 28, (8, 12))

    def ctc(log_probs: torch.Tensor) -> torch.Tensor:
        lengths = torch.full((8,), log_probs.size(0), dtype=torch.long)
        return F.ctc_loss(log_probs, targets, lengths, torch.full((8,), 12), zero_infinity=True)

    origin = _loss_origin(_Acoustic(), mode, ctc, torch.randn(8, 40, 40))
    assert origin.kind == "nan"
    assert "CTC, whose backward is NaN where the log-probabilities are -inf" in origin.hint


def test_a_nan_momentum_buffer_loaded_with_sgds_state_is_named() -> None:
    """Weights from the best checkpoint, the optimizer's state from the last one, saved after
    a bad step: SGD's momentum buffer holds NaN, and the first step writes it into the weight
    from a finite gradient. Not a learning rate too high."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    state = opt.state_dict()
    state["state"][0]["momentum_buffer"][0, 0] = float("nan")
    opt.load_state_dict(state)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(2):
            opt.zero_grad()
            model(torch.randn(16, 8)).pow(2).mean().backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("param", "0.weight")
    assert origin.hint is not None
    assert "optimizer's own state for this weight is already non-finite" in origin.hint
    assert "momentum_buffer" in origin.hint
    assert "Lower the learning rate" not in origin.hint


class _RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_a_float16_norms_backward_overflow_is_blamed_on_the_variance_not_the_scale() -> None:
    """A Llama-style RMSNorm run in float16: a padding token's near-zero embedding has a
    variance of about 4e-4, rsqrt of it is about 50 and finite, and its derivative's rsqrt ** 3
    is past 65504. Scaling the activations down would make it worse: the hint says float32 or
    a larger eps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(50, 64), _RMSNorm(64), nn.Linear(64, 50))
    with torch.no_grad():
        model[0].weight[0] *= 0.02  # the padding token's row, barely trained
    model = model.half()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    tokens = torch.randint(1, 50, (4, 12))
    tokens[2, 7:] = 0  # right padding
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        logits = model(tokens[:, :-1]).float()
        loss = F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "1")
    assert origin.hint is not None
    assert "In the backward of RsqrtBackward0" in origin.hint
    assert "raise its eps" in origin.hint
    assert "scale its activations" not in origin.hint


class _BetaPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(17, 64), nn.Tanh(), nn.Linear(64, 12))

    def forward(self, obs: torch.Tensor) -> torch.distributions.Beta:
        alpha, beta = F.softplus(self.net(obs)).add(1.0).chunk(2, -1)
        return torch.distributions.Beta(alpha, beta)


@pytest.mark.parametrize("mode", MODES)
def test_a_beta_policy_returned_as_a_distribution_keeps_the_loss_ops_hint(mode: str) -> None:
    """Behaviour cloning with expert actions rescaled to [0, 1]: saturated ones are exactly 0
    or 1, where Beta.log_prob is -Inf. The policy returns the Beta itself (its concentrations
    are kept in a private Dirichlet): the loss's own operations are still read."""
    torch.manual_seed(0)
    actions = torch.rand(64, 6)
    actions[7, 2] = 1.0  # a saturated expert action
    origin = _loss_origin(
        _BetaPolicy(),
        mode,
        lambda dist: -dist.log_prob(actions).sum(-1).mean(),
        torch.randn(64, 17),
    )
    assert origin.kind == "inf"
    assert "a log-density at the edge of its support" in origin.hint


class _PoseLifter(nn.Module):
    """2D keypoints to 3D joints, its head zero-initialised to start from the mean pose (a
    common choice): at first every predicted joint is the same point."""

    def __init__(self, joints: int = 17) -> None:
        super().__init__()
        self.joints = joints
        self.body = nn.Sequential(nn.Linear(2 * joints, 256), nn.ReLU())
        self.head = nn.Linear(256, 3 * joints)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x)).view(-1, self.joints, 3)


def _pa_mpjpe(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Procrustes-aligned MPJPE (Kabsch rotation by SVD), as pose repositories write it."""
    p = pred - pred.mean(1, keepdim=True)
    t = target - target.mean(1, keepdim=True)
    u, _, vh = torch.linalg.svd(p.transpose(1, 2) @ t)  # a zero matrix: repeated values
    rotation = u @ vh
    scale = (p @ rotation * t).sum((1, 2)) / (p**2).sum((1, 2)).clamp_min(1e-8)
    return (scale[:, None, None] * p @ rotation - t).norm(dim=-1).mean()


@pytest.mark.parametrize("mode", MODES)
def test_a_procrustes_loss_over_a_collapsed_prediction_names_the_svd(mode: str) -> None:
    """The SVD's backward divides by differences of singular values, all 0 here: the hint
    names it first, not the division the loss already clamps."""
    torch.manual_seed(0)
    x, target = torch.randn(32, 34), torch.randn(32, 17, 3)
    origin = _loss_origin(_PoseLifter(), mode, lambda pred: _pa_mpjpe(pred, target), x)
    assert origin.tensor is not None
    assert origin.tensor.startswith("grad of")
    assert "an SVD or eigendecomposition, whose slope divides by differences of" in origin.hint


class _Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 18))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(obs)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["xlogy", "entr"])
def test_an_entropy_bonus_over_collapsed_probabilities_names_xlogy(mode: str, how: str) -> None:
    """Raw observations (bytes 0-255) give logit gaps past 104: softmax probabilities of
    exactly 0, where xlogy(p, p) and entr(p) are finite and their slopes are not."""
    torch.manual_seed(0)
    obs = torch.randint(0, 256, (64, 128)).float()

    def loss(logits: torch.Tensor) -> torch.Tensor:
        p = logits.softmax(-1)
        entropy = -torch.special.xlogy(p, p).sum(-1) if how == "xlogy" else torch.special.entr(p)
        return logits.logsumexp(-1).mean() - 0.01 * entropy.sum(-1).mean()

    origin = _loss_origin(_Policy(), mode, loss, obs)
    assert "an entropy by xlogy(p, p) or entr(p)" in origin.hint
    assert "log_softmax" in origin.hint


class _KeypointNet(nn.Module):
    def __init__(self, joints: int = 16) -> None:
        super().__init__()
        self.joints = joints
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU())
        self.xy, self.cls = nn.Linear(128, joints * 2), nn.Linear(128, joints)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.xy(h).view(-1, self.joints, 2), self.cls(h)


@pytest.mark.parametrize("procrustes", [False, True])
def test_a_zero_distance_is_named_before_healthy_entropy_and_svd_terms(procrustes: bool) -> None:
    """A per-joint distance by hand, sqrt at 0 where invisible joints' targets are the
    prediction itself, next to a healthy xlogy entropy and a healthy Procrustes SVD: the
    hint names the sqrt first (which terms a loss holds says nothing of which went bad)."""
    torch.manual_seed(0)
    x, gt, visible = torch.randn(32, 64), torch.randn(32, 16, 2), torch.rand(32, 16) > 0.2

    def loss(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        xy, logits = out
        target = torch.where(visible[..., None], gt, xy.detach())  # invisible: ignored
        distance = torch.sqrt(((xy - target) ** 2).sum(-1)).mean()
        p = logits.softmax(-1)
        total = distance + 0.01 * torch.special.xlogy(p, p).sum(-1).mean()
        if procrustes:
            a, b = xy - xy.mean(1, keepdim=True), target - target.mean(1, keepdim=True)
            u, _, vh = torch.linalg.svd(a.transpose(1, 2) @ b)
            total = total + 0.1 * (a @ (u @ vh) - b).pow(2).mean()
        return total

    origin = _loss_origin(_KeypointNet(), "full", loss, x)
    assert "its own operations include sqrt, whose slope is Inf at 0" in origin.hint


class BetaDecoder(nn.Module):
    """A decoder of pixel intensities in [0, 1] as a Beta likelihood."""

    def __init__(self, z: int = 16, pixels: int = 196) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(z, 128), nn.ReLU(), nn.Linear(128, 2 * pixels))

    def forward(self, z: torch.Tensor) -> torch.distributions.Beta:
        a, b = F.softplus(self.net(z)).add(1e-4).chunk(2, -1)
        return torch.distributions.Beta(a, b)


def test_a_beta_likelihood_of_pixels_exactly_zero_is_said_to_be_at_the_edge_of_its_support() -> (
    None
):
    # Mostly background: 60% of the targets are exactly 0 (none below it), where xlogy's
    # +Inf and -Inf terms meet. "Below 0" would send the user looking for negatives.
    torch.manual_seed(0)
    model = BetaDecoder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.rand(64, 196)
    x[x < 0.6] = 0.0
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        loss = guard.check_loss(-model(torch.randn(64, 16)).log_prob(x).sum(-1).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.hint is not None
    assert "xlogy" in origin.hint
    assert "exactly 0 or 1" in origin.hint


class SquashedActor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.net(obs))


def test_an_infinite_loss_from_a_coefficient_without_gradient_names_one() -> None:
    # SAC's temperature: alpha = log_alpha.exp(), learnt apart, used detached in the actor's
    # loss; a log_alpha that climbed past 88.7 makes alpha Inf, and the loss with it.
    torch.manual_seed(0)
    actor = SquashedActor()
    opt = torch.optim.Adam(actor.parameters(), lr=1e-3)
    log_alpha = torch.tensor(89.0, requires_grad=True)
    with nanguard.watch(actor, optimizer=opt, on_nonfinite="log") as guard:
        action = actor(torch.randn(32, 8))
        log_prob = -(action**2).sum(-1)  # (a stand-in for the squashed Gaussian's)
        q = action.sum(-1)
        loss = guard.check_loss((log_alpha.exp().detach() * log_prob - q).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "log_alpha.exp()" in origin.hint


class SigmoidHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.fc(x)).squeeze(-1)


def test_a_binary_cross_entropy_by_hand_on_a_saturated_sigmoid_names_the_logits_loss() -> None:
    torch.manual_seed(0)
    model = SigmoidHead()
    with torch.no_grad():
        model.fc.weight.mul_(400.0)  # a very confident head: the sigmoid is exactly 0 or 1
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,)).float()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        p = model(x)
        loss = guard.check_loss(-(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean())
        loss.backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "binary cross-entropy written by hand on sigmoid outputs" in origin.hint
    assert "F.binary_cross_entropy_with_logits" in origin.hint


class TanhActor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 2))

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu, log_std = self.body(obs).chunk(2, -1)
        return mu, log_std.clamp(-5, 2)


def test_a_gaussian_log_scale_is_no_softmax_written_by_hand() -> None:
    # A TanhNormal NLL of replayed actions: atanh(1.0) is +inf, log(1 - a^2) -inf. The
    # Normal's log(scale) of scale = log_std.exp() is log(exp(x)): no sum of exps.
    torch.manual_seed(0)
    model = TanhActor()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        a = torch.tanh(torch.randn(8, 1))
        a[4] = torch.tanh(torch.tensor(10.0))  # == 1.0 in float32
        mu, log_std = model(torch.randn(8, 3))
        normal = torch.distributions.Normal(mu, log_std.exp())
        logp = (normal.log_prob(torch.atanh(a)) - torch.log(1 - a.pow(2))).sum(-1)
        loss = guard.check_loss(-logp.mean())
        loss.backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "softmax or logsumexp written by hand" not in origin.hint


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_a_softmax_by_hand_with_a_reciprocal_gets_the_hand_softmax_hint() -> None:
    torch.manual_seed(0)
    model = Scorer()
    with torch.no_grad():
        model.fc.weight.mul_(100.0)  # logits past 88: exp overflows
    x, y = torch.randn(16, 8), torch.randint(0, 5, (16,))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        z = model(x)
        p = torch.exp(z) * (1.0 / torch.exp(z).sum(1, keepdim=True))
        loss = guard.check_loss(-p.gather(1, y[:, None]).log().mean())
        loss.backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "a softmax or logsumexp written by hand" in origin.hint


def test_a_bce_by_hand_averaged_over_an_empty_mask_leads_with_the_division() -> None:
    # Nothing saturated (outputs in (0, 1)): the 0/0 of the empty mask is the cause.
    torch.manual_seed(0)
    model = SigmoidHead()
    x, y = torch.randn(32, 8), torch.randint(0, 2, (32,)).float()
    valid = torch.zeros(32)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        p = model(x)
        bce = -(y * torch.log(p) + (1 - y) * torch.log(1 - p))
        loss = guard.check_loss((bce * valid).sum() / valid.sum())
        loss.backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "0/0 over an empty mask" in origin.hint


class _SigmoidVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.dec = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 16), nn.Sigmoid())

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x).chunk(2, -1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.dec(z), mu, logvar


@pytest.mark.parametrize("mode", MODES)
def test_a_vae_bce_by_hand_leads_with_the_saturated_sigmoid_not_its_kl_exp(mode: str) -> None:
    """x * log(r) + (1 - x) * log(1 - r) on a decoder saturated to r = 1.0 exactly; the
    KL term's logvar.exp() is far from overflowing (tensorflow-mnist-VAE#4)."""
    torch.manual_seed(0)
    model = _SigmoidVAE()
    with torch.no_grad():
        model.dec[2].bias[3] = 40.0  # an over-confident pixel
    x = (torch.rand(32, 16) > 0.5).float()
    x[:, 3] = 1.0  # (1 - x) * log(1 - r) = 0 * -inf

    def loss_of(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        r, mu, logvar = out
        rec = -(x * torch.log(r) + (1 - x) * torch.log(1 - r)).sum(1)
        kld = -0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(1)
        return (rec + kld).mean()

    origin = _loss_origin(model, mode, loss_of, x)
    assert "own operations: a binary cross-entropy written by hand on sigmoid" in origin.hint


@pytest.mark.parametrize("mode", MODES)
def test_a_ppo_ratio_overflow_on_padded_old_log_probs_is_named_first(mode: str) -> None:
    """A rollout engine pads old log-probs with -1e4: exp(logp - old_logp) is Inf there,
    and the mask multiplies it by 0 (miles#1363, slime#2198)."""
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))
    obs, actions = torch.randn(4, 12, 16), torch.randint(0, 8, (4, 12))
    mask = torch.ones(4, 12)
    mask[:, 9:] = 0.0
    old_logp = torch.full((4, 12), -1.5)
    old_logp[:, 9:] = -1e4  # the padding sentinel
    adv = torch.randn(4, 12)

    def loss_of(logits: torch.Tensor) -> torch.Tensor:
        logp = logits.log_softmax(-1).gather(-1, actions[..., None]).squeeze(-1)
        ratio = torch.exp(logp - old_logp)
        surrogate = torch.max(-adv * ratio, -adv * ratio.clamp(0.8, 1.2))
        return (surrogate * mask).sum() / mask.sum()

    origin = _loss_origin(policy, mode, loss_of, obs)
    assert origin.kind == "nan"
    assert "own operations: a ratio exp(logp - old_logp) past 88" in origin.hint


class _MeanDecodedVAE(nn.Module):
    """A VAE decoding its mean (no sampling): the decoder never sees exp(logvar)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 8)
        self.mu = nn.Linear(8, 4)
        self.logvar = nn.Linear(8, 4)
        self.dec = nn.Linear(4, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = torch.relu(self.enc(x))
        mu, logvar = self.mu(h), self.logvar(h)
        return torch.sigmoid(self.dec(mu)), mu, logvar


@pytest.mark.parametrize("mode", MODES)
def test_a_vae_whose_kl_exp_overflows_to_inf_leads_with_the_exp(mode: str) -> None:
    """The same hand-written BCE, finite, beside a KL term whose logvar.exp() overflows
    (logvar = 100, an encoder head gone large): +Inf, and the exp leads."""
    torch.manual_seed(0)
    model = _MeanDecodedVAE()
    with torch.no_grad():
        model.logvar.bias.fill_(100.0)
    x = torch.rand(8, 16)

    def loss_of(out: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        r, mu, logvar = out
        rec = -(x * torch.log(r) + (1 - x) * torch.log(1 - r)).sum(1)
        kld = -0.5 * (1 + logvar - mu**2 - logvar.exp()).sum(1)
        return (rec + kld).mean()

    origin = _loss_origin(model, mode, loss_of, x)
    assert origin.kind == "inf"
    assert "own operations: an exp overflow, above 88 (logvar.exp() in a KL term" in origin.hint


@pytest.mark.parametrize("mode", MODES)
def test_a_geodesic_loss_clamped_to_exactly_one_is_told_to_clamp_inside(mode: str) -> None:
    """acos(clamp(cos, -1, 1)) where a prediction equals its target: clamp passes the
    gradient at its bound and acos's slope there is Inf (geoopt#79, RotationContinuity#1)."""
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    x = torch.randn(16, 8)
    with torch.no_grad():
        target = head(x)  # (samples seen without augmentation: identical)

    def loss_of(pred: torch.Tensor) -> torch.Tensor:
        return torch.acos(F.cosine_similarity(pred, target, dim=-1).clamp(-1, 1)).mean()

    origin = _loss_origin(head, mode, loss_of, x)
    assert origin.details["reason"] == "loss_backward"
    assert "clamp to +-(1 - 1e-7), not +-1" in origin.hint


@pytest.mark.parametrize("mode", MODES)
def test_an_inf_class_weight_is_named_not_a_batch_of_ignored_targets(mode: str) -> None:
    """Inverse-frequency class weights counted on batches that never held class 3: weight
    Inf; the first patch with it makes inf / inf (MultiPlanarUNet#24)."""
    torch.manual_seed(0)
    seg = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    counts = torch.tensor([900.0, 80.0, 20.0, 0.0])
    weight = counts.sum() / counts  # class 3: inf
    target = torch.randint(0, 3, (2, 8, 8))
    target[1, 2:4, 2:4] = 3  # the first lesion of class 3

    origin = _loss_origin(
        seg, mode, lambda out: F.cross_entropy(out, target, weight=weight), torch.randn(2, 1, 8, 8)
    )
    assert origin.kind == "nan"
    assert "a class weight of Inf or NaN (1 / count for a class absent" in origin.hint
    assert "ignore_index" not in origin.hint


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_of_ignored_targets_keeps_the_ignore_index_hint(mode: str) -> None:
    torch.manual_seed(0)
    seg = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    target = torch.full((2, 8, 8), 255)  # a patch with no annotation

    origin = _loss_origin(
        seg,
        mode,
        lambda out: F.cross_entropy(out, target, ignore_index=255),
        torch.randn(2, 1, 8, 8),
    )
    assert "every target equals ignore_index" in origin.hint
    assert "class weight of Inf" not in origin.hint


def test_a_sac_actor_loss_is_not_taken_for_ppos_ratio() -> None:
    """exp, min and clamp in SAC's actor loss, no ratio: log(1 - tanh(u)^2) without an eps
    at a saturated action is the cause named."""
    torch.manual_seed(0)

    class Actor(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(4, 32), nn.ReLU())
            self.mu = nn.Linear(32, 2)
            self.log_std = nn.Linear(32, 2)

        def forward(self, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = self.body(s)
            return self.mu(h), self.log_std(h)

    actor = Actor()
    with torch.no_grad():
        actor.mu.bias[0] = 30.0  # a saturated action dimension
    q1, q2 = nn.Linear(6, 1), nn.Linear(6, 1)
    s = torch.randn(32, 4)

    def loss_of(out: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        mu, log_std = out
        log_std = log_std.clamp(-20, 2)
        std = log_std.exp()
        u = mu + std * torch.randn_like(mu)
        a = torch.tanh(u)
        log_pi = (-0.5 * ((u - mu) / std) ** 2 - log_std).sum(-1)
        log_pi = log_pi - torch.log(1 - a.pow(2)).sum(-1)
        q = torch.min(q1(torch.cat([s, a], -1)), q2(torch.cat([s, a], -1))).squeeze(-1)
        return (0.2 * log_pi - q).mean()

    origin = _loss_origin(actor, "full", loss_of, s)
    assert "ratio exp(logp - old_logp)" not in origin.hint
    assert "log(0)" in origin.hint
