"""A loss that reads another model's weights or outputs: a center loss whose centres have an
optimizer of their own (outside the guard), a GAN with one guard per model. The report
names what broke, once, and the other guard does not call the same NaN an origin."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nanguard

MODES = ("full", "sentinel")


class CenterLoss(nn.Module):
    """KaiyangZhou/pytorch-center-loss: learned class centres, their own SGD."""

    def __init__(self, classes: int, dim: int) -> None:
        super().__init__()
        self.centers = nn.Parameter(torch.randn(classes, dim))

    def forward(self, features: Tensor, labels: Tensor) -> Tensor:
        return (features - self.centers[labels]).pow(2).sum(-1).clamp(1e-12, 1e12).mean()


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat = nn.Sequential(nn.Linear(10, 16), nn.PReLU(), nn.Linear(16, 2))
        self.fc = nn.Linear(2, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        f = self.feat(x)
        return f, self.fc(f)


@pytest.mark.parametrize("mode", MODES)
def test_center_loss_centres_broken_by_their_own_optimizer_are_named(mode: str) -> None:
    """The repo's loop rescales the centres' gradient by 1 / weight_cent; with the term
    switched off (weight_cent = 0) that is inf * grad, and their SGD makes them NaN. The
    next step's loss, 0 * NaN, is NaN from a finite model (pytorch-center-loss#7)."""
    torch.manual_seed(0)
    model, centre = Embedder(), CenterLoss(4, 2)
    opt_model = torch.optim.SGD(model.parameters(), 1e-2)
    opt_centre = torch.optim.SGD(centre.parameters(), 0.5)
    weight_cent = 0.0

    def train_step(guard: nanguard.Guard) -> None:
        x, y = torch.randn(8, 10), torch.randint(0, 4, (8,))
        f, logits = model(x)
        loss = F.cross_entropy(logits, y) + weight_cent * centre(f, y)
        opt_model.zero_grad()
        opt_centre.zero_grad()
        guard.check_loss(loss).backward()
        opt_model.step()
        for p in centre.parameters():
            assert p.grad is not None
            p.grad.mul_(float("inf"))  # (1. / weight_cent)
        opt_centre.step()

    with nanguard.watch(model, optimizer=opt_model, mode=mode) as guard:
        train_step(guard)  # (finite: the centres go NaN in their own step)
        with pytest.raises(nanguard.NonFiniteError) as raised:
            train_step(guard)
    event = raised.value.event
    assert (event.step, event.phase, event.is_origin) == (1, "loss", True)
    assert "One of them already holds 8 NaN of 8 values (shape (4, 2)" in event.message
    assert event.hint is not None
    assert event.hint.startswith(
        "A weight the loss uses that the watched model does not hold (shape (4, 2)) is "
        "non-finite: an update outside the guard broke it"
    )


def test_a_finite_weight_outside_the_model_is_not_blamed() -> None:
    """The same loop's loss made NaN by the loss itself (log of a zero probability): the
    centres are finite, the hint is the loss's own."""
    torch.manual_seed(0)
    model, centre = Embedder(), CenterLoss(4, 2)
    opt = torch.optim.SGD(model.parameters(), 1e-2)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        f, logits = model(torch.randn(8, 10))
        y = torch.randint(0, 4, (8,))
        probs = logits.softmax(-1) * (torch.arange(4) != 2)  # class 2 never predicted
        loss = F.nll_loss(torch.log(probs), torch.full((8,), 2)) + 0.1 * centre(f, y)
        guard.check_loss(loss).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert "already holds" not in origin.message
    assert origin.hint is not None
    assert "does not hold" not in origin.hint


def test_a_head_broken_by_the_losss_own_gradient_is_not_the_cause() -> None:
    """The head outside the watched backbone steps first (opt_head.step(); opt.step()): the
    loss's log(0) on an extreme sample makes its gradient NaN, its optimizer makes it NaN
    after the loss read it finite. The loss's own operation is the cause."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 8))
    head = nn.Linear(8, 4)
    opt = torch.optim.SGD(backbone.parameters(), lr=0.01)
    opt_head = torch.optim.SGD(head.parameters(), lr=0.1)
    with nanguard.watch(backbone, optimizer=opt) as guard:
        x, y = torch.randn(16, 10), torch.randint(0, 4, (16,))
        x[3] *= 1e5  # one extreme sample: its probability underflows to 0
        p = torch.softmax(head(backbone(x)), -1)
        loss = guard.check_loss(-torch.log(p[torch.arange(16), y]).mean())
        loss.backward()
        opt_head.step()
        assert not torch.isfinite(head.weight).all()
        with pytest.raises(nanguard.NonFiniteError) as raised:
            opt.step()
    event = raised.value.event
    assert (event.phase, event.details["reason"]) == ("loss", "loss")
    assert "already holds" not in event.message
    assert event.hint is not None
    assert "log(0)" in event.hint
    assert "does not hold" not in event.hint


def _gan(
    policy: str, mode: str, outlier_at: int = -1, check_d: bool = True
) -> tuple[nanguard.Guard, nanguard.Guard]:
    """A sigmoid discriminator and the generator's non-saturating loss written by hand,
    -log(D(G(z))): once D separates real from fake perfectly its sigmoid is exactly 0 on
    the fakes, and G's loss is log(0) (ganhacks#36, StudioGAN#67). One guard per model."""
    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1), nn.Sigmoid())
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    opt_d = torch.optim.Adam(disc.parameters(), 2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(gen.parameters(), 2e-4, betas=(0.5, 0.999))
    guard_d = nanguard.watch(disc, optimizer=opt_d, mode=mode, on_nonfinite=policy)
    guard_g = nanguard.watch(gen, optimizer=opt_g, mode=mode, on_nonfinite=policy)
    try:
        for step in range(5):
            real = torch.randn(16, 8)
            real[:, 0] += 10.0
            if step == outlier_at:  # a real sample far outside: log(p_real) = log(0)
                real[5, 0] = -100.0
            if step == 3:  # D has won: a perfect separator on feature 0
                with torch.no_grad():
                    disc[0].weight.zero_()
                    disc[0].bias.zero_()
                    disc[0].weight[0, 0] = 1.0
                    disc[2].weight.zero_()
                    disc[2].weight[0, 0] = 30.0
                    disc[2].bias.fill_(-150.0)
            fake = gen(torch.randn(16, 4))
            p_real, p_fake = disc(real), disc(fake.detach())
            d_loss = -(torch.log(p_real) + torch.log(1 - p_fake)).mean()
            opt_d.zero_grad()
            (guard_d.check_loss(d_loss) if check_d else d_loss).backward()
            opt_d.step()
            g_loss = -torch.log(disc(fake)).mean()
            opt_g.zero_grad()
            guard_g.check_loss(g_loss).backward()
            opt_g.step()
    except nanguard.NonFiniteError:
        pass
    finally:
        guard_d.detach()
        guard_g.detach()
    return guard_d, guard_g


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_gan_generator_loss_is_the_one_origin(policy: str, mode: str) -> None:
    """The discriminator's guard sees G's NaN gradient come back into D's output: it points
    at G's guard's loss origin, and has no origin of its own ("the loss was not checked"
    was wrong: G's guard checked it)."""
    guard_d, guard_g = _gan(policy, mode)
    origin = guard_g.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.details["reason"]) == (3, "loss", "loss")
    assert guard_d.origin is None
    pointing = [e for e in guard_d.events if e.details.get("reason") == "loss_backward"]
    assert pointing
    assert all(not e.is_origin for e in pointing)
    assert "it comes from a loss the guard of Sequential checked" in pointing[0].message
    assert "not checked" not in pointing[0].message


# --- a validation batch run without no_grad() ---------------------------------------------


class _Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.bn = nn.BatchNorm1d(16)
        self.b = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


def _train_with_validation(
    policy: str | None, mode: str = "full"
) -> tuple[nn.Module, list[nanguard.Event], list[int]]:
    """Validation in eval() mode with gradients on (no torch.no_grad()), its outputs only
    read; one validation batch holds a NaN. The loop catches NonFiniteError and trains on.
    Returns the model, the events, and the steps whose optimizer.step() raised."""
    torch.manual_seed(0)
    model = _Regressor()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    guard = nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite=policy) if policy else None
    torch.manual_seed(1)
    raised = []
    for step in range(6):
        x, y = torch.randn(8, 6), torch.randn(8, 1)
        loss = F.mse_loss(model(x), y)
        if guard is not None:
            loss = guard.check_loss(loss)
        opt.zero_grad()
        loss.backward()
        try:
            opt.step()
        except nanguard.NonFiniteError:
            raised.append(step)
            opt.zero_grad()
        if step == 2:
            model.eval()
            for k in range(3):
                val = torch.randn(4, 6)
                if k == 1:
                    val[1, 1] = float("nan")
                model(val).mean().item()
            model.train()
    events = guard.events if guard is not None else []
    if guard is not None:
        guard.detach()
    return model, events, raised


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(p, q)
        for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_validation_nan_raises_after_the_next_training_update(mode: str) -> None:
    """Found at the next training step's end: that step's gradients are finite, so its
    update is applied first and optimizer.step() raises after it. A loop that catches the
    error trains exactly as an unguarded one (the update was lost before)."""
    unguarded, _, _ = _train_with_validation(None)
    guarded, events, raised = _train_with_validation("raise", mode)
    assert raised == [3]
    origin = next(e for e in events if e.is_origin)
    assert (origin.step, origin.phase) == (3, "input")
    assert origin.details["eval_without_backward"] is True
    assert _same_weights(guarded, unguarded)


def test_skip_step_keeps_a_training_step_beside_a_validation_nan_and_says_nothing_dropped() -> None:
    unguarded, _, _ = _train_with_validation(None)
    guarded, events, raised = _train_with_validation("skip_step")
    assert raised == []
    assert _same_weights(guarded, unguarded)
    assert not any(e.details.get("loop_dropped") for e in events)
    assert not any(e.details.get("skipped") for e in events)


# --- one input buffer refilled for every micro-batch --------------------------------------


class _Distance(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c = nn.Parameter(torch.randn(4))

    def forward(self, h: Tensor) -> Tensor:
        return torch.sqrt(((h - self.c) ** 2).sum(-1, keepdim=True))


class _DistanceNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dist = _Distance()
        self.head = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.cat([x, self.dist(x)], -1))


def test_a_refilled_input_buffer_is_named_when_it_keeps_the_replay_out() -> None:
    """A static buffer refilled with copy_ for each of 4 micro-batches (CUDA graphs, pinned
    memory); micro-batch 3 holds a sample equal to the learned centre: sqrt's slope at 0.
    Its input is gone by the step's end, so no replay can name the module: the message
    says why and what to change, not "check custom autograd Functions"."""
    torch.manual_seed(0)
    model = _DistanceNet()
    opt = torch.optim.SGD(model.parameters(), 1e-2)
    x_buf, y_buf = torch.empty(6, 4), torch.empty(6, 1)
    with nanguard.watch(model, optimizer=opt) as guard:
        opt.zero_grad()
        for micro in range(4):
            x_buf.copy_(torch.randn(6, 4))
            y_buf.copy_(torch.randn(6, 1))
            if micro == 2:
                x_buf[4] = model.dist.c.detach()
            guard.check_loss(F.mse_loss(model(x_buf), y_buf) / 4).backward()
        with pytest.raises(nanguard.NonFiniteError) as raised:
            opt.step()
    event = raised.value.event
    assert (event.phase, event.param, event.is_origin) == ("grad", "dist.c", True)
    assert "the inputs were modified in place after the forward" in event.message
    assert "give each forward a tensor of its own, x_buf.clone()" in event.message
    assert "Check custom autograd Functions" not in event.message


# --- a frozen float16 network after the watched model --------------------------------------


def test_a_frozen_half_decoder_after_the_watched_unet_is_named_in_the_loss_hint() -> None:
    """Latent diffusion fine-tuning with a pixel-space loss through a frozen float16 VAE
    decoder whose activations pass 65504 (SDXL's VAE: sliders#30): only the UNet is
    watched, so the loss is the origin; its hint names the frozen layers, not a division."""
    torch.manual_seed(0)
    unet = nn.Sequential(nn.Conv2d(4, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, 4, 3, padding=1))
    decoder = nn.Sequential(
        nn.Conv2d(4, 32, 3, padding=1),
        nn.GroupNorm(8, 32),
        nn.SiLU(),
        nn.Conv2d(32, 3, 3, padding=1),
    )
    with torch.no_grad():
        decoder[0].weight.mul_(6000.0)
    decoder.half().requires_grad_(False)
    opt = torch.optim.AdamW(unet.parameters(), 1e-4)
    with nanguard.watch(unet, optimizer=opt, on_nonfinite="log") as guard:
        latents = torch.randn(2, 4, 8, 8) * 8  # (un-normalised latents)
        image = decoder((unet(latents) / 0.13025).half()).float()
        loss = guard.check_loss(F.mse_loss(image, torch.rand(2, 3, 8, 8)))
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "nan")
    assert origin.hint is not None
    assert "a frozen network's layer after the model's outputs" in origin.hint


# --- a sampler that feeds the model its own results -----------------------------------------


class _Energy(nn.Module):
    """IGEBM/JEM-style energy with a learnt quadratic confinement term."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(4, 32), nn.SiLU(), nn.Linear(32, 1))
        self.log_prec = nn.Parameter(torch.zeros(4))
        self.sign = 1.0

    def forward(self, x: Tensor) -> Tensor:
        quadratic = 0.5 * (x.pow(2) * self.log_prec.exp()).sum(-1)
        return self.f(x).squeeze(-1) + self.sign * quadratic


def test_a_diverging_sgld_chain_is_named_not_the_data() -> None:
    """Short-run SGLD of 60 forwards per step: once the confinement term turns concave
    (energy unbounded below) the chain grows geometrically and overflows in a late
    forward (JEM#4). Its inputs there are the sampler's iterate, not an unscaled batch."""
    torch.manual_seed(0)
    energy = _Energy()
    opt = torch.optim.Adam(energy.parameters(), 1e-3)

    def sgld(x: Tensor) -> Tensor:
        x = x.clone().requires_grad_(True)
        for _ in range(60):
            g = torch.autograd.grad(energy(x).sum(), x)[0]
            x = (x - g + 0.01 * torch.randn_like(x)).detach().requires_grad_(True)
        return x.detach()

    with nanguard.watch(energy, optimizer=opt) as guard:
        energy.sign = -1.0
        with torch.no_grad():
            energy.log_prec.fill_(0.7)
        neg = sgld(torch.rand(32, 4) * 2 - 1)
        loss = energy(torch.randn(32, 4)).mean() - energy(neg).mean()
        opt.zero_grad()
        guard.check_loss(loss).backward()
        with pytest.raises(nanguard.NonFiniteError) as raised:
            opt.step()
    event = raised.value.event
    assert (event.phase, event.module) == ("forward", "")
    assert event.details["forward"] > 30
    assert event.hint is not None
    assert "a loop feeding the model its own results diverged" in event.hint
    assert "where the first forward's were at most 0.9" in event.hint
    assert "unscaled feature" not in event.hint


# --- an ODE solver's state overflowing ------------------------------------------------------


class _ODEFunc(nn.Module):
    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.log_k = nn.Parameter(torch.full((d,), 0.5))
        self.net = nn.Sequential(nn.Linear(d, 32), nn.Tanh(), nn.Linear(32, d))

    def forward(self, y: Tensor) -> Tensor:
        return -self.log_k.exp() * y + self.net(y)


class _LatentODE(nn.Module):
    """A Latent ODE with a hand-written fixed-step RK4 (4 sub-steps per observation gap)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.enc = nn.Linear(2, d)
        self.func = _ODEFunc(d)
        self.dec = nn.Linear(d, 1)

    def forward(self, x0: Tensor, times: Tensor) -> Tensor:
        y = self.enc(x0)
        outs = []
        for i in range(times.shape[0] - 1):
            dt = (times[i + 1] - times[i]) / 4
            for _ in range(4):
                k1 = self.func(y)
                k2 = self.func(y + dt / 2 * k1)
                k3 = self.func(y + dt / 2 * k2)
                k4 = self.func(y + dt * k3)
                y = y + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)
            outs.append(self.dec(y))
        return torch.stack(outs, 1)


def test_an_rk4_state_blown_up_by_a_long_time_gap_is_not_called_exploding_weights() -> None:
    """A stiff decay and a 5000-unit gap in one series' record: dt far past RK4's stability
    limit grows the state 1e6x per sub-step until it overflows (torchdiffeq#132, #105).
    The weights are small; the learning rate is not the cause."""
    torch.manual_seed(0)
    model = _LatentODE()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt) as guard:
        for step in range(4):
            x0 = torch.randn(16, 2)
            times = torch.cumsum(torch.rand(6) * 0.5, 0)
            if step == 3:
                times[3:] += 5000.0  # a long gap in the record
            target = torch.exp(-times[1:])[None, :, None] * x0[:, :1, None]
            loss = guard.check_loss(F.mse_loss(model(x0, times), target))
            opt.zero_grad()
            loss.backward()
            if step < 3:
                opt.step()
        with pytest.raises(nanguard.NonFiniteError) as raised:
            opt.step()
    event = raised.value.event
    assert (event.step, event.phase) == (3, "forward")
    assert event.hint is not None
    assert "a state grown over a recurrence or an ODE solver's steps" in event.hint
    assert "Lower the learning rate" not in event.hint


# --- two modules' backwards each making NaN ------------------------------------------------


class _HandQKNorm(nn.Module):
    """QK-norm written by hand: x / (|x| + eps), the eps outside the sqrt (its slope at a
    zero vector is Inf: a zero pad embedding makes q and k zero there)."""

    def forward(self, x: Tensor) -> Tensor:
        return x / (torch.sqrt((x * x).sum(-1, keepdim=True)) + 1e-6)


class _QKNormAttention(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, d, padding_idx=0)
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.q_norm = _HandQKNorm()
        self.k_norm = _HandQKNorm()
        self.head = nn.Linear(d, 50)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        q, k = self.q_norm(self.q_proj(h)), self.k_norm(self.k_proj(h))
        return self.head(torch.softmax(q @ k.transpose(1, 2) * 4, -1) @ h)


@pytest.mark.parametrize("mode", MODES)
def test_q_norm_and_k_norm_backwards_are_two_origins(mode: str) -> None:
    """Both norms divide by a zero norm at the pad positions: each backward makes NaN from
    finite gradients. The second is an origin too, not what the first reached (ReaLLM-Forge
    #447): fixing one leaves the other."""
    torch.manual_seed(0)
    model = _QKNormAttention()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    ids = torch.randint(1, 50, (4, 16))
    ids[:, 12:] = 0  # padding
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        logits = model(ids)
        loss = guard.check_loss(F.cross_entropy(logits.flatten(0, 1), ids.flatten()))
        loss.backward()
        opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert {(e.phase, e.module) for e in origins} == {
        ("backward", "q_norm"),
        ("backward", "k_norm"),
    }
    second = origins[1]
    assert "was also made, independently, in the backward pass" in second.message
    assert origins[0].module not in (origins[1].propagated or ())
    assert origins[1].module not in (origins[0].propagated or ())


# --- DPO against a reference pass with -inf log-probs --------------------------------------


class _MaskedLM(nn.Module):
    def __init__(self, vocab: int = 64, d: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.mix = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.head = nn.Linear(d, vocab)

    def forward(self, ids: Tensor, vocab_mask: Tensor | None = None) -> Tensor:
        logits = self.head(self.mix(self.embed(ids)))
        if vocab_mask is not None:
            logits = logits.masked_fill(~vocab_mask, float("-inf"))
        return logits


def _sequence_logp(logits: Tensor, ids: Tensor) -> Tensor:
    logp = logits[:, :-1].float().log_softmax(-1)
    return logp.gather(-1, ids[:, 1:, None]).squeeze(-1).sum(-1)


@pytest.mark.parametrize("mode", MODES)
def test_dpo_with_a_reference_pass_that_masks_a_new_token_says_the_outputs_held_minus_inf(
    mode: str,
) -> None:
    """The reference (the same model, no_grad) masks a special token added for fine-tuning
    with -inf; the token ends both completions: (pi_c - ref_c) - (pi_r - ref_r) is
    inf - inf (trl#2553). The training outputs were finite; the step's reference pass
    returned -inf masks, which the message and hint bring up."""
    torch.manual_seed(0)
    model = _MaskedLM()
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    chosen, rejected = torch.randint(0, 63, (2, 16)), torch.randint(0, 63, (2, 16))
    chosen[:, -1] = rejected[:, -1] = 63  # the new end-of-turn token
    ref_vocab = torch.ones(64, dtype=torch.bool)
    ref_vocab[63] = False
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        with torch.no_grad():
            ref_c = _sequence_logp(model(chosen, vocab_mask=ref_vocab), chosen)
            ref_r = _sequence_logp(model(rejected, vocab_mask=ref_vocab), rejected)
        pi_c = _sequence_logp(model(chosen), chosen)
        pi_r = _sequence_logp(model(rejected), rejected)
        loss = -F.logsigmoid(0.1 * ((pi_c - ref_c) - (pi_r - ref_r))).mean()
        guard.check_loss(loss).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "nan")
    assert origin.details["inference_masks"] is True
    assert "An inference forward of this step (gradients off" in origin.message
    assert origin.hint is not None
    assert "two -inf log-probabilities subtracted are NaN" in origin.hint


def test_the_discriminators_own_loss_origin_is_not_pointed_at_the_generators() -> None:
    """The step after G's loss origin, D's own (unchecked) loss goes non-finite on an
    outlier real sample. D's step also holds its forward of G's previous loss; only the
    forward the bad gradient came back into decides: D's own origin stands."""
    guard_d, guard_g = _gan("skip_step", "full", outlier_at=4, check_d=False)
    assert guard_g.origin is not None
    assert guard_g.origin.step == 3
    own = [e for e in guard_d.events if e.is_origin]
    assert [(e.step, e.details["reason"], e.details.get("samples")) for e in own] == [
        (4, "loss_backward", [5])
    ]


class _EnergyFeature(nn.Module):
    def forward(self, h: Tensor) -> Tensor:
        return (h**2).mean(-1, keepdim=True)


class _WithEnergy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 16)
        self.e = _EnergyFeature()
        self.b = nn.Linear(17, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(x)
        return self.b(torch.cat([h, self.e(h)], -1))


def test_an_outlier_in_one_accumulated_micro_batch_is_the_data_not_a_sampler() -> None:
    """Micro-batch 3 of 4 holds a missing-value sentinel (1e30): its input came from the
    loader, not from the model's earlier results (forward 2's were of usual size)."""
    torch.manual_seed(0)
    model = _WithEnergy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt) as guard:
        opt.zero_grad()
        for micro in range(4):
            x, y = torch.randn(8, 6), torch.randn(8, 1)
            if micro == 2:
                x[5, 1] = 1e30
            guard.check_loss(F.mse_loss(model(x), y) / 4).backward()
        with pytest.raises(nanguard.NonFiniteError) as raised:
            opt.step()
    event = raised.value.event
    assert (event.phase, event.module, event.details["forward"]) == ("forward", "e", 3)
    assert event.hint is not None
    assert "an unscaled feature or a sentinel value for missing data" in event.hint
    assert "diverged" not in event.hint


def test_a_float32_perceptual_network_in_the_loss_is_not_named_for_a_log_of_zero() -> None:
    """A frozen float32 feature network in a perceptual loss, and the loss's own log(0): no
    dtype cast, no overflow to speak of; the log is the cause named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 3, 3, padding=1), nn.Sigmoid())
    features = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()).requires_grad_(False)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        image = model(torch.randn(2, 3, 8, 8))
        perceptual = (features(image) - features(torch.rand(2, 3, 8, 8))).pow(2).mean()
        loss = guard.check_loss(perceptual + torch.log(image.mean() * 0))
        loss.backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "frozen network" not in origin.hint
    assert "log(0)" in origin.hint


class _PooledSentence(nn.Module):
    """A token head reads the encoder states; a sentence embedding normalises their mean
    with the hand-written norm (computed in the model's own code: h.mean(1))."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.enc = nn.Linear(16, 16, bias=False)
        self.tok_head = nn.Linear(16, 50)
        self.sent_proj = nn.Linear(16, 8, bias=False)
        self.l2 = _HandQKNorm()

    def forward(self, tok: Tensor) -> tuple[Tensor, Tensor]:
        h = self.enc(self.emb(tok))
        return self.tok_head(h), self.l2(self.sent_proj(h.mean(1)))


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_carried_through_the_models_own_code_is_no_second_origin(mode: str) -> None:
    """A sample of padding only: the norm's backward makes NaN, which reaches h through
    h.mean(1) in the model's own code; the token head reading h sent finite gradients back,
    yet h's bad gradient is the norm's, not a second origin."""
    torch.manual_seed(0)
    model = _PooledSentence()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tok = torch.randint(1, 50, (4, 6))
    tok[1] = 0
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        logits, sent = model(tok)
        loss = F.cross_entropy(logits.reshape(-1, 50), tok.reshape(-1)) + (sent @ sent.T).mean()
        guard.check_loss(loss).backward()
        opt.step()
    origins = [(e.phase, e.module) for e in guard.events if e.is_origin]
    assert origins == [("backward", "l2")]


def test_a_rollouts_minus_inf_masks_do_not_make_a_later_losss_outputs_masked() -> None:
    """A rollout under no_grad with -inf action masks, then a behaviour-cloning loss that
    never reads it goes NaN (0 * log 0): the training outputs were finite, and that is said;
    the rollout's masks are only a hedged note."""
    torch.manual_seed(0)
    model = _MaskedLM()
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    legal = torch.ones(64, dtype=torch.bool)
    legal[60:] = False
    ids = torch.randint(0, 63, (2, 16))
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(3):
            with torch.no_grad():
                model(ids, vocab_mask=legal)  # the rollout
            probs = model(ids).softmax(-1)
            if step == 2:
                probs = probs * (torch.arange(64) != 5)  # an action never taken
            loss = -(F.one_hot(ids, 64) * torch.log(probs)).sum(-1).mean()
            opt.zero_grad()
            guard.check_loss(loss).backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert "while the model's outputs were finite" in origin.message
    assert "held no NaN/Inf but for -inf" not in origin.message


class _Pooler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 8, bias=False)
        self.l2 = _HandQKNorm()

    def forward(self, h: Tensor) -> Tensor:
        return self.l2(self.proj(h.mean(1)))


class _PooledEncoder(nn.Module):
    """A Sequential encoder, a token head on its states, a Pooler holding the norm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.enc = nn.Sequential(
            nn.Linear(16, 16, bias=False), nn.Tanh(), nn.Linear(16, 16, bias=False)
        )
        self.tok_head = nn.Linear(16, 50)
        self.pool = _Pooler()

    def forward(self, tok: Tensor) -> tuple[Tensor, Tensor]:
        h = self.enc(self.emb(tok))
        return self.tok_head(h), self.pool(h)


class _SharedNormAttention(_QKNormAttention):
    """One norm module for both q and k (called twice)."""

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        q, k = self.q_norm(self.q_proj(h)), self.q_norm(self.k_proj(h))
        return self.head(torch.softmax(q @ k.transpose(1, 2) * 4, -1) @ h)


@pytest.mark.parametrize("model_class", [_PooledEncoder, _SharedNormAttention])
def test_one_backward_cause_is_one_origin(model_class: type[nn.Module]) -> None:
    """The Pooler holding the norm went bad because its child did; a norm module called
    for q and for k is one cause made again: neither is a second, independent origin."""
    torch.manual_seed(0)
    model = model_class()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    tok = torch.randint(1, 50, (4, 16))
    tok[1] = 0
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        out = model(tok)
        if isinstance(out, tuple):
            loss = F.cross_entropy(out[0].reshape(-1, 50), tok.reshape(-1)) + out[1].sum()
        else:
            loss = F.cross_entropy(out.flatten(0, 1), tok.flatten())
        guard.check_loss(loss).backward()
        opt.step()
    origins = [(e.phase, e.module) for e in guard.events if e.is_origin]
    assert len(origins) == 1, origins
    assert origins[0][0] == "backward"


def _scaled_run(guarded: bool) -> nn.Module:
    """GradScaler on CPU float16 autocast; a validation batch without no_grad() holds a NaN
    before step 3. Guarded, step 3's scaler.step() raises (caught: the loop trains on);
    unguarded, the loop skips step 3's step and update itself."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    guard = nanguard.watch(model, optimizer=opt, scaler=scaler) if guarded else None
    torch.manual_seed(1)
    for step in range(6):
        x, y = torch.randn(8, 6), torch.randn(8, 1)
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if step == 3 and not guarded:
            continue
        try:
            scaler.step(opt)
            scaler.update()
        except nanguard.NonFiniteError:
            assert step == 3
        if step == 2:
            model.eval()
            val = torch.randn(4, 6)
            val[1, 1] = float("nan")
            model(val).sum().item()
            model.train()
    if guard is not None:
        guard.detach()
    return model


def test_a_raise_inside_scaler_step_leaves_the_next_step_unscaled() -> None:
    """The raise skips scaler.update(), which resets GradScaler's per-optimizer state: the
    next scaler.step() took the scaled gradients (x1024) for unscaled ones."""
    assert _same_weights(_scaled_run(guarded=True), _scaled_run(guarded=False))


# --- the last attack: a real second origin beside a head's own code; GradScaler loops --------


class _ScaledHead(nn.Module):
    """A head with an operation of its own before its hand-written norm."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)
        self.scale = nn.Parameter(torch.ones(8))
        self.norm = _HandQKNorm()
        self.out = nn.Linear(8, 1)

    def forward(self, h: Tensor) -> Tensor:
        return self.out(self.norm(self.proj(h) * self.scale))


class _TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(4, 8, bias=False), nn.ReLU())
        self.head = _ScaledHead()
        self.proj_a = nn.Linear(8, 8, bias=False)
        self.norm_a = _HandQKNorm()
        self.out_a = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.trunk(x)
        a = self.out_a(self.norm_a(self.proj_a(h)))
        return self.head(h), a


def test_a_second_norm_beside_a_heads_own_code_is_still_an_origin() -> None:
    """A zero row makes both norms' backward NaN, each on its own (fixing one leaves the
    other): the NaN crossing the head's own code does not taint the model's other branch."""
    torch.manual_seed(0)
    model = _TwoHeads()
    x, y = torch.randn(6, 4), torch.randn(6, 1)
    x[2] = 0.0
    with nanguard.watch(model, on_nonfinite="log") as guard:
        a, b = model(x)
        guard.check_loss(((a - y) ** 2).mean() + ((b - y) ** 2).mean()).backward()
        guard.step()
    origins = {(e.phase, e.module) for e in guard.events if e.is_origin}
    assert origins == {("backward", "head.norm"), ("backward", "norm_a")}


def test_a_gan_sharing_one_scaler_trains_on_after_a_caught_raise() -> None:
    """One GradScaler for D and G; a raise inside scaler.step(optG) (a NaN learning rate)
    is caught and the iteration skipped: D's optimizer was stepped too, and the next
    iteration's scaler.step(optD) must not refuse it."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    disc = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g, opt_d = torch.optim.Adam(gen.parameters()), torch.optim.Adam(disc.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    skipped = []
    with (
        nanguard.watch(gen, optimizer=opt_g, scaler=scaler) as guard_g,
        nanguard.watch(disc, optimizer=opt_d, scaler=scaler) as guard_d,
    ):
        for it in range(4):
            opt_g.param_groups[0]["lr"] = float("nan") if it == 1 else 1e-3
            try:
                fake = gen(torch.randn(8, 4))
                loss_d = F.binary_cross_entropy_with_logits(
                    disc(torch.randn(8, 2)), torch.ones(8, 1)
                ) + F.binary_cross_entropy_with_logits(disc(fake.detach()), torch.zeros(8, 1))
                opt_d.zero_grad()
                scaler.scale(guard_d.check_loss(loss_d)).backward()
                scaler.step(opt_d)
                loss_g = F.binary_cross_entropy_with_logits(disc(fake), torch.ones(8, 1))
                opt_g.zero_grad()
                scaler.scale(guard_g.check_loss(loss_g)).backward()
                scaler.step(opt_g)
                scaler.update()
            except nanguard.NonFiniteError:
                skipped.append(it)
    assert skipped == [1]
    assert all(torch.isfinite(p).all() for p in gen.parameters())


def test_scaler_update_after_a_caught_raise_in_scaler_step_still_works() -> None:
    """A loop catching NonFiniteError around scaler.step() alone, then calling
    scaler.update() as usual: GradScaler's recorded inf checks are kept for it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    with nanguard.watch(model, optimizer=opt, scaler=scaler):
        for step in range(3):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(torch.randn(8, 4)).float().pow(2).mean()
            scaler.scale(loss).backward()
            if step == 1:  # a validation batch without no_grad(), one NaN in it
                model.eval()
                val = torch.randn(4, 4)
                val[0, 0] = float("nan")
                model(val).sum().item()
                model.train()
            try:
                scaler.step(opt)
            except nanguard.NonFiniteError:
                assert step == 1
            scaler.update()
    assert all(torch.isfinite(p).all() for p in model.parameters())
