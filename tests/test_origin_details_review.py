"""What an origin tells beyond its module: the samples of the batch a forward origin's NaN
is in, when only some are (a constant series' zero std, a sequence padded whole: with a
batch of 32, "sample 5" is where to look in the data loader); a norm layer built with
eps=0; a parameter group whose learning rate is out of line with the rest."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nanguard


class RevIN(nn.Module):
    """Reversible instance normalisation (time-series forecasters): per series and channel,
    over time, with no eps: a constant series divides 0 by 0."""

    def __init__(self, time_dim: int = 1) -> None:
        super().__init__()
        self.time_dim = time_dim

    def forward(self, x: Tensor) -> Tensor:
        mean = x.mean(self.time_dim, keepdim=True)
        std = x.std(self.time_dim, keepdim=True)
        return (x - mean) / std


class Forecaster(nn.Module):
    def __init__(self, batch_first: bool = True) -> None:
        super().__init__()
        self.norm = RevIN(1 if batch_first else 0)
        self.rnn = nn.LSTM(3, 16, batch_first=batch_first)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.rnn(self.norm(x))[0])


class PaddedAttention(nn.Module):
    """Attention written by hand with a -inf key-padding mask: a sample padded whole has a
    row of all -inf, softmax 0/0."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.q = nn.Linear(16, 16)
        self.k = nn.Linear(16, 16)
        self.out = nn.Linear(16, 2)

    def forward(self, ids: Tensor, pad: Tensor) -> Tensor:
        h = self.emb(ids)
        scores = self.q(h) @ self.k(h).transpose(1, 2) / 4
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return self.out((scores.softmax(-1) @ h).mean(1))


def _train_step(model: nn.Module, *args: Tensor, mode: str) -> nanguard.Guard:
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        out = model(*args)
        loss = guard.check_loss(out.float().pow(2).mean())
        loss.backward()
        opt.step()
    return guard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_constant_series_are_named_as_samples(mode: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(32, 48, 3)
    x[5] = 1.0  # a sensor stuck at one value
    x[17, :, 1] = 2.0  # ...one channel of another
    guard = _train_step(Forecaster(), x, mode=mode)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "norm", "RevIN")
    assert origin.details["samples"] == [5, 17]
    assert "It is in samples 5, 17 (of 32 along dim 0)." in origin.message


def test_time_major_batch_is_dim_1() -> None:
    """An LSTM without batch_first takes (time, batch, features): the samples are along
    dim 1, even though the norm before it is what the model was given first."""
    torch.manual_seed(0)
    x = torch.randn(48, 16, 3)
    x[:, 9] = -0.5
    guard = _train_step(Forecaster(batch_first=False), x, mode="full")
    origin = guard.origin
    assert origin is not None
    assert origin.module == "norm"
    assert origin.details["samples"] == [9]
    assert "It is in sample 9 (of 16 along dim 1)." in origin.message


def test_many_samples_list_the_first_few() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 24, 3)
    bad = list(range(3, 64, 5))  # 13 of 64
    x[bad] = 0.0
    guard = _train_step(Forecaster(), x, mode="full")
    origin = guard.origin
    assert origin is not None
    assert origin.details["samples"] == bad[:8]
    assert "It is in 13 of 64 samples (along dim 0), the first: 3, 8, 13," in origin.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_fully_padded_sequence_in_own_code_is_named(mode: str) -> None:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (8, 12))
    pad = torch.zeros(8, 12, dtype=torch.bool)
    pad[:, 9:] = True
    pad[6] = True  # an empty sequence
    guard = _train_step(PaddedAttention(), ids, pad, mode=mode)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.details["reason"]) == ("forward", "", "own_code")
    assert origin.details["samples"] == [6]
    assert "It is in sample 6 (of 8 along dim 0)." in origin.message


class Exp(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.exp()


def test_every_sample_bad_names_none() -> None:
    """An overflow in every sample: no sample to look at, no list."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Exp())
    with torch.no_grad():
        model[0].weight.abs_().mul_(100)
    guard = _train_step(model, torch.randn(16, 8).abs() + 1, mode="full")
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.kind) == ("1", "inf")
    assert "samples" not in origin.details
    assert "It is in" not in origin.message


# --- a norm layer built with eps=0 -------------------------------------------------------


def _norm_origin(norm: nn.Module, dead: bool) -> nanguard.Event:
    """A dead ReLU (every unit's bias far below 0) hands the norm a row of zeros."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), norm, nn.Linear(16, 1))
    if dead:
        with torch.no_grad():
            model[0].bias.fill_(-10.0)
    guard = _train_step(model, torch.randn(32, 8), mode="full")
    origin = guard.origin
    assert origin is not None
    return origin


def test_an_rmsnorm_built_with_eps_0_is_told_to_pass_eps() -> None:
    """Its rsqrt of a mean square of 0 is no op of the user's to put an eps in (LayerNorm's
    and GroupNorm's eps=0 get their own text: test_hints_rules)."""
    origin = _norm_origin(nn.RMSNorm(16, eps=0.0), dead=True)
    assert (origin.phase, origin.module, origin.kind) == ("forward", "2", "nan")
    assert origin.hint is not None
    assert origin.hint.startswith("This RMSNorm was built with eps=0: a row of zeros has RMS 0")
    assert "(it got all zeros: a dead ReLU" in origin.hint
    assert "Pass eps > 0 (1e-6)" in origin.hint
    assert "torch.rsqrt(var + 1e-5)" not in origin.hint


def test_a_norm_with_its_default_eps_trains_on_dead_units() -> None:
    """The same dead layer before a LayerNorm with eps=1e-5: zeros out, no NaN."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.LayerNorm(16), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].bias.fill_(-10.0)
    guard = _train_step(model, torch.randn(32, 8), mode="full")
    assert guard.origin is None


# --- another parameter group's learning rate ---------------------------------------------


class ScaledBlock(nn.Module):
    """A residual block with LayerScale (CaiT, ConvNeXt): ``x + gamma * f(x)``."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gamma = nn.Parameter(torch.full((d,), 0.1))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.gamma * self.fc(x)


def _layerscale_run(gamma_lr: float, rest_lr: float = 1e-4) -> nanguard.Event | None:
    """LayerScale's gammas in a parameter group of their own (no weight decay), its rate
    typed ``gamma_lr``. The error of the first step it raised, if any."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), *[ScaledBlock(32) for _ in range(8)], nn.Linear(32, 1))
    gammas = [p for n, p in model.named_parameters() if n.endswith("gamma")]
    rest = [p for n, p in model.named_parameters() if not n.endswith("gamma")]
    opt = torch.optim.Adam(
        [{"params": rest, "lr": rest_lr}, {"params": gammas, "lr": gamma_lr, "weight_decay": 0.0}]
    )
    with nanguard.watch(model, optimizer=opt, grad_norm=False) as guard:
        for _ in range(20):
            x, y = torch.randn(64, 16), torch.randn(64, 1)
            try:
                loss = guard.check_loss((model(x) - y).pow(2).mean())
                loss.backward()
                opt.step()
                opt.zero_grad()
            except nanguard.NonFiniteError as error:
                return error.event
    return None


def test_a_group_typo_is_named_beside_the_loss_that_overflowed() -> None:
    event = _layerscale_run(gamma_lr=1e3)
    assert event is not None
    assert (event.phase, event.is_origin) == ("loss", True)
    assert event.hint is not None
    assert (
        "Also: the learning rate of the parameter group of `1.gamma`, `2.gamma` and 6 more is "
        "1000, 1e+07 times the other groups' (at most 0.0001): a typo?"
    ) in event.hint


def test_groups_in_proportion_are_not_named() -> None:
    """Every group's rate far too high, none out of line: no group to name."""
    event = _layerscale_run(gamma_lr=1e3, rest_lr=1e2)
    assert event is not None
    assert event.hint is not None
    assert "exploding" in event.hint
    assert "parameter group of" not in event.hint


# --- what a probe cannot tell; an empty batch ----------------------------------------------


class Temperature(nn.Module):
    """Logits over a temperature a schedule anneals (to 0 by mistake: x / 0 is +-Inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 1.0

    def forward(self, x: Tensor) -> Tensor:
        return x / self.t


def test_without_a_replay_a_nan_probe_says_it_may_be_inf_of_both_signs() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), Temperature())
    model[1].t = 0.0
    with nanguard.watch(model, on_nonfinite="log", replay=False) as guard:
        out = model(torch.randn(3, 4))
        guard.check_loss(F.cross_entropy(out, torch.tensor([0, 1, 2]))).backward()
        guard.step()
    assert not torch.isnan(out).any()  # (+Inf and -Inf only)
    origin = guard.origin
    assert origin is not None
    assert origin.module == "1"
    assert "NaN values, or +Inf beside -Inf, which its probe (a sum) cannot tell apart" in (
        origin.message
    )


def test_an_empty_batch_mean_loss_is_named_as_such() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        keep = y > 5  # a filter that keeps no sample
        loss = guard.check_loss(F.cross_entropy(model(x[keep]), y[keep]))
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "nan")
    assert origin.hint is not None
    assert "a mean over an empty batch (the model's outputs hold 0 samples)" in origin.hint
    assert "ignore_index" not in origin.hint


def test_a_float16_output_whose_gradient_overflows_is_told_to_scale_the_loss_down() -> None:
    """Autocast float16 without GradScaler, a loss weighted 1e6: each output's gradient,
    1.25e5, is past float16's 65504. Not an infinite derivative of the loss's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), 1e-6)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(torch.randn(8, 16))
        loss = guard.check_loss(out.float().mean() * 1e6)
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details["reason"], origin.kind) == ("loss", "loss_backward", "inf")
    assert origin.hint is not None
    assert "The gradient sent back into the model's float16 outputs passed 65504" in origin.hint
    assert "infinite derivative" not in origin.hint


# --- a distribution's scale parameter collapsed ---------------------------------------------


class _Policy(nn.Module):
    """A Gaussian policy with a state-independent log_std (cleanrl's PPO)."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 2))
        self.log_std = nn.Parameter(torch.zeros(2))

    def forward(self, obs: Tensor) -> torch.distributions.Normal:
        return torch.distributions.Normal(self.mu(obs), self.log_std.exp())


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_policy_whose_log_std_collapsed_is_named(mode: str) -> None:
    """An entropy bonus of the wrong sign drove log_std to -50: std 2e-22, log_prob's
    (a - mu)^2 / (2 std^2) is Inf, times advantages of both signs NaN."""
    torch.manual_seed(0)
    policy = _Policy()
    with torch.no_grad():
        policy.log_std.fill_(-50.0)
    opt = torch.optim.Adam(policy.parameters(), 3e-4)
    with nanguard.watch(policy, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        dist = policy(torch.randn(64, 8))
        loss = -(dist.log_prob(torch.randn(64, 2)).sum(-1) * torch.randn(64)).mean()
        guard.check_loss(loss).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert origin.hint.startswith(
        "The model's parameter `log_std` is as low as -50 (its exp: 1.9e-22): a "
        "distribution's scale collapsed to 0"
    )


class _Heteroscedastic(nn.Module):
    """A regressor with a learned noise level read by a Gaussian NLL written by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
        self.sigma = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def test_a_raw_std_parameter_gone_negative_is_named() -> None:
    torch.manual_seed(0)
    model = _Heteroscedastic()
    with torch.no_grad():
        model.sigma.fill_(-0.3)  # an SGD step past 0
    with nanguard.watch(model, on_nonfinite="log") as guard:
        x, y = torch.randn(32, 4), torch.randn(32, 1)
        nll = ((y - model(x)) / model.sigma).pow(2).mean() / 2 + torch.log(model.sigma).sum()
        guard.check_loss(nll).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert origin.hint.startswith("The model's parameter `sigma` is as low as -0.3: a scale")


def test_a_healthy_log_std_is_not_blamed() -> None:
    """log(0) in the loss itself beside a log_std of -1: the loss's own operations."""
    torch.manual_seed(0)
    policy = _Policy()
    with torch.no_grad():
        policy.log_std.fill_(-1.0)
    with nanguard.watch(policy, on_nonfinite="log") as guard:
        dist = policy(torch.randn(16, 8))
        loss = dist.log_prob(torch.randn(16, 2)).mean() + torch.log(torch.zeros(()))
        guard.check_loss(loss).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.hint is not None
    assert "log_std" not in origin.hint


def test_a_nan_in_a_loaded_optimizer_state_is_the_reason_given() -> None:
    """A checkpoint's Adam state saved after a bad step: exp_avg_sq holds a NaN. The first
    update carries it into the weight from finite gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    state = opt.state_dict()
    state["state"][0]["exp_avg_sq"][0, 0] = float("nan")
    resumed = torch.optim.Adam(model.parameters(), 1e-3)
    resumed.load_state_dict(state)
    with nanguard.watch(model, optimizer=resumed, on_nonfinite="log") as guard:
        guard.check_loss(model(torch.randn(8, 4)).pow(2).mean()).backward()
        resumed.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("param", "0.weight")
    assert origin.details["reason"] == "optimizer_state"
    assert "the optimizer's own state for it (`exp_avg_sq`) already held NaN/Inf" in origin.message
    assert "Typical causes" not in origin.message


# --- no sample named where the batch dim is not known ---------------------------------------


class _LogCounts(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)


class _CellLoop(nn.Module):
    """A time-major model (time, batch, features) stepping a GRUCell by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.feat = _LogCounts()
        self.cell = nn.GRUCell(4, 8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        z = self.feat(x)
        h = torch.zeros(x.shape[1], 8)
        for t in range(x.shape[0]):
            h = self.cell(z[t], h)
        return self.head(h)


def test_time_steps_of_a_hand_written_time_major_loop_are_not_called_samples() -> None:
    """Time steps 3 and 7 are 0 in every series: dim 0 is time, not the batch (the model
    returns (batch, 1)), and every sample holds the NaN: no sample to name."""
    torch.manual_seed(0)
    x = torch.rand(16, 8, 4) + 0.5
    x[3] = 0.0
    x[7] = 0.0
    guard = _train_step(_CellLoop(), x, mode="full")
    origin = guard.origin
    assert origin is not None
    assert origin.module == "feat"
    assert "samples" not in origin.details
    assert "It is in" not in origin.message


def test_query_rows_of_a_heads_times_batch_layout_are_not_called_samples() -> None:
    """Scores of shape (batch * heads, T, T) with batch == T: a fully masked query row in
    every sample is along dim 1, which is no batch dim."""
    torch.manual_seed(0)
    heads, b, t = 4, 16, 16

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qk = nn.Linear(8, 16)
            self.softmax = nn.Softmax(dim=-1)

        def forward(self, x: Tensor, allowed: Tensor) -> Tensor:
            q = self.qk(x).view(b, t, heads, 4).transpose(1, 2).reshape(b * heads, t, 4)
            scores = (q @ q.transpose(1, 2)).masked_fill(~allowed, float("-inf"))
            return (self.softmax(scores) @ q).reshape(b, heads, t, 4).sum((1, 3))

    allowed = torch.ones(b * heads, t, t, dtype=torch.bool)
    allowed[:, 12:, :] = False  # query rows 12..15 see no key, in every sample
    guard = _train_step(Attn(), torch.randn(b, t, 8), allowed, mode="full")
    origin = guard.origin
    assert origin is not None
    assert origin.module == "softmax"
    assert "samples" not in origin.details


def test_discriminative_fine_tuning_rates_are_not_called_a_typo() -> None:
    """A backbone at 1e-5 beside a head at 1e-2 (1000x: usual fine-tuning), and the loss's
    own log(0): no note on the head's rate."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    model = nn.Sequential(backbone, nn.Linear(16, 4))
    opt = torch.optim.SGD(
        [
            {"params": backbone.parameters(), "lr": 1e-5},
            {"params": model[1].parameters(), "lr": 1e-2},
        ],
        momentum=0.9,
    )
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(3):
            probs = model(torch.randn(8, 8)).softmax(-1)
            if step == 2:
                probs = probs * 0  # a target class masked out
            loss = guard.check_loss(-torch.log(probs[:, 0]).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.hint is not None
    assert "a typo?" not in origin.hint


# --- a hand-written float16 norm whose squares overflow --------------------------------------


class _HandRMSNorm(nn.Module):
    """LLaMA's RMSNorm without its .float(): the mean square taken in float16."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def _squares_warnings(layer: nn.Module) -> tuple[nanguard.Guard, list[nanguard.Event]]:
    """A float16 model whose residual channel 3 has grown to 300, ``layer`` after it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), layer, nn.Linear(32, 1)).half()
    with torch.no_grad():
        model[0].bias[3] = 300.0
    with nanguard.watch(model, on_nonfinite="log") as guard:
        out = model(torch.randn(8, 16, dtype=torch.float16))
        guard.step()
    assert torch.isfinite(out).all()
    return guard, [e for e in guard.events if e.details.get("squares_overflow")]


def test_a_float16_hand_written_rmsnorm_given_values_past_256_is_warned() -> None:
    """x ** 2 overflows to Inf inside the norm and rsqrt(Inf) = 0 zeroes the row: nothing
    non-finite leaves any module (pytorch#133085), so only a warning can tell."""
    guard, warned = _squares_warnings(_HandRMSNorm(32))
    assert [(e.kind, e.module) for e in warned] == [("overflow_risk", "1")]
    assert "past 256 their squares overflow float16" in warned[0].message
    assert guard.origin is None


def test_torchs_own_rmsnorm_is_not_warned_about_its_squares() -> None:
    """nn.RMSNorm computes in float32: values of 300 in float16 are fine."""
    assert _squares_warnings(nn.RMSNorm(32))[1] == []


def test_noisynets_weight_sigma_is_not_taken_for_a_collapsed_scale() -> None:
    """NoisyLinear's weight_sigma may be negative (sigma times a symmetric draw): the loss's
    own log(0) is the cause named, not a scale parameter."""
    torch.manual_seed(0)

    class NoisyHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight_mu = nn.Parameter(torch.randn(4, 8) * 0.1)
            self.weight_sigma = nn.Parameter(torch.full((4, 8), -0.05))

        def forward(self, x: Tensor) -> Tensor:
            return x @ (self.weight_mu + self.weight_sigma * torch.randn(4, 8)).T

    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), NoisyHead())
    with nanguard.watch(model, on_nonfinite="log") as guard:
        probs = model(torch.randn(16, 6)).softmax(-1) * (torch.arange(4) != 2)
        guard.check_loss(-torch.log(probs[:, 2]).mean()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.hint is not None
    assert "weight_sigma" not in origin.hint
    assert "log(0)" in origin.hint


@pytest.mark.parametrize("name", ["ObsNormalizer", "BatchNormSubclass"])
def test_no_squares_warning_for_modules_that_are_no_hand_written_norm(name: str) -> None:
    class ObsNormalizer(nn.Module):  # (subtracts and divides: no squares)
        def forward(self, x: Tensor) -> Tensor:
            return (x - 1.0) / 300.0

    class BatchNormSubclass(nn.BatchNorm1d):  # (torch's kernel, float32 statistics)
        pass

    layer = ObsNormalizer() if name == "ObsNormalizer" else BatchNormSubclass(32)
    assert _squares_warnings(layer)[1] == []


def test_an_old_gradient_norm_spike_is_not_tied_to_a_loss_origin() -> None:
    """A spike 32 steps back (a loss leaving its first plateau) beside a loss-backward
    origin at a fractional power's edge is no precursor; one 2 steps back is said."""
    from nanguard._hints import HintContext, hint

    def ctx(spike: int) -> HintContext:
        return HintContext(
            phase="loss",
            kind="nan",
            reason="loss_backward",
            step=42,
            grad_norm_alarm_step=spike,
            loss_ops=("PowBackward0:fractional",),
        )

    assert "spiked" not in hint(ctx(10))
    assert "The gradient norm also spiked at step 40, 2 steps earlier." in hint(ctx(40))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loss_reading_an_allow_inf_modules_inf_does_not_say_outputs_were_finite(
    mode: str,
) -> None:
    """allow_inf= lets a head make -Inf (its Inf is not probed); the loss over it is -Inf:
    full mode says what sentinel mode says, not "the model's outputs were finite"."""

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(8, 1)
            nn.init.constant_(self.lin.bias, -5.0)

        def forward(self, h: Tensor) -> Tensor:
            return torch.log(torch.relu(self.lin(h)))

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Head())
    with nanguard.watch(model, allow_inf=(Head,), mode=mode, on_nonfinite="log") as guard:
        guard.check_loss(model(torch.randn(16, 4)).mean()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert "while the model's outputs were finite" not in origin.message
    assert "written on purpose" in origin.message


def test_events_of_a_second_micro_batch_carry_its_number() -> None:
    """Gradient accumulation: micro-batch 2 goes -Inf; the origin says forward 2, and so do
    the events it reached (the model's output, loss 2), for filtering by micro-batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), _LogCounts())
    with torch.no_grad():
        model[0].weight.abs_()  # (positive inputs: positive counts)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        for micro in range(2):
            x = torch.rand(8, 4) + (0.0 if micro == 1 else 10.0)
            with torch.no_grad():
                model[0].bias.fill_(-100.0 if micro == 1 else 0.0)
            guard.check_loss(model(x).sum() / 2).backward()
        guard.step()
    bad = [e for e in guard.events if e.phase in ("forward", "loss")]
    assert bad
    assert all(e.details.get("forward") == 2 or e.details.get("loss") == 2 for e in bad), [
        (e.phase, e.module, e.details) for e in bad
    ]


class _CellTagger(_CellLoop):
    """The same loop returning every step's output, (time, batch, 1): time-major outputs."""

    def forward(self, x: Tensor) -> Tensor:
        z = self.feat(x)
        h = torch.zeros(x.shape[1], 8)
        outs = []
        for t in range(x.shape[0]):
            h = self.cell(z[t], h)
            outs.append(self.head(h))
        return torch.stack(outs)


def test_time_steps_of_a_time_major_tagger_are_not_called_samples() -> None:
    """Its outputs are time-major too, so they do not tell; the cell called once per entry
    of dim 0 does: dim 0 is time."""
    torch.manual_seed(0)
    x = torch.rand(16, 8, 4) + 0.5
    x[3] = 0.0
    x[7] = 0.0
    guard = _train_step(_CellTagger(), x, mode="full")
    origin = guard.origin
    assert origin is not None
    assert origin.module == "feat"
    assert "samples" not in origin.details


def test_an_allow_inf_head_with_finite_outputs_does_not_take_a_losss_own_nan() -> None:
    """The masked policy head (allow_inf=) returned finite values this step (every action
    legal); the loss's own 0/0 (returns normalised by a std of 0) is NaN: the outputs were
    finite, and that is said, not "held -inf written on purpose"."""

    class PolicyHead(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 4)

        def forward(self, h: Tensor, legal: Tensor) -> Tensor:
            return self.lin(h).masked_fill(~legal, float("-inf"))

    class Agent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(6, 16), nn.Tanh())
            self.pi = PolicyHead()
            self.v = nn.Linear(16, 1)

        def forward(self, obs: Tensor, legal: Tensor) -> tuple[Tensor, Tensor]:
            h = self.body(obs)
            return self.pi(h, legal), self.v(h).squeeze(-1)

    torch.manual_seed(0)
    agent = Agent()
    legal = torch.ones(8, 4, dtype=torch.bool)
    ret = torch.full((8,), 1.0)  # constant returns
    with nanguard.watch(agent, allow_inf=["pi"], on_nonfinite="log") as guard:
        logits, v = agent(torch.randn(8, 6), legal)
        adv = (ret - ret.mean()) / ret.std()
        logp = torch.log_softmax(logits, -1)[:, 0]
        guard.check_loss(-(logp * adv).mean() + 0.5 * ((v - ret) ** 2).mean()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert "while the model's outputs were finite" in origin.message


def test_a_block_shared_by_as_many_layers_as_the_batch_keeps_the_samples() -> None:
    """An ALBERT-style block applied 4 times to a batch of 4 takes the whole batch each
    time: dim 0 is still the batch, and the bad sample is named."""

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Linear(16, 16)
            self.norm = RevIN()

        def forward(self, x: Tensor) -> Tensor:
            h = self.norm(x)
            for _ in range(4):
                h = torch.tanh(self.block(h))
            return h.mean(1)

    torch.manual_seed(0)
    x = torch.randn(4, 12, 16)
    x[1] = 0.5  # a constant series
    guard = _train_step(Shared(), x, mode="full")
    origin = guard.origin
    assert origin is not None
    assert origin.module == "norm"
    assert origin.details.get("samples") == [1]
