"""Hints and reports from a review with real generative, detection and speech code: losses
computed inside forward() (torchvision, Hugging Face CTC), a VAE on unnormalised data, a
diffusion sampling loop, a learned power-law compression (PCEN)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


def failing_step(model: nn.Module, mode: str, *inputs: torch.Tensor) -> nanguard.Event:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = guard.check_loss(model(*inputs))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert guard.origin is not None
    return guard.origin


class TinyCTC(nn.Module):
    """An acoustic model returning its CTC loss, as Wav2Vec2ForCTC(labels=...) does."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.GRU(16, 32, batch_first=True)
        self.head = nn.Linear(32, 10)

    def forward(self, feats, feat_lens, labels, label_lens) -> torch.Tensor:  # type: ignore[no-untyped-def]
        h, _ = self.enc(feats)
        logp = self.head(h).log_softmax(-1)
        return F.ctc_loss(logp.transpose(0, 1), labels, feat_lens, label_lens, blank=0)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_ctc_inside_forward_on_an_input_shorter_than_its_target(mode: str) -> None:
    torch.manual_seed(0)
    feats = torch.randn(2, 12, 16)
    feat_lens = torch.tensor([12, 5])
    label_lens = torch.tensor([4, 8])  # 8 labels for 5 frames: no alignment
    labels = torch.randint(1, 10, (int(label_lens.sum()),))
    origin = failing_step(TinyCTC(), mode, feats, feat_lens, labels, label_lens)
    assert (origin.phase, origin.module, origin.kind) == ("forward", "", "inf")
    assert origin.op == "aten._ctc_loss.Tensor"
    assert origin.hint is not None
    assert "zero_infinity=True" in origin.hint
    assert "input is shorter than its target" in origin.hint


class Detector(nn.Module):
    """Computes its box loss in forward (torchvision's model(images, targets))."""

    def __init__(self, loss: str) -> None:
        super().__init__()
        self.backbone = nn.Conv2d(3, 8, 3, 2, 1)
        self.box = nn.Conv2d(8, 4, 1)
        self.loss = loss

    def forward(self, img: torch.Tensor, fg: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        reg = self.box(F.relu(self.backbone(img))).permute(0, 2, 3, 1).reshape(-1, 4)
        if self.loss == "smooth_l1":
            return F.smooth_l1_loss(reg[fg], targets[fg], beta=1 / 9)
        if self.loss == "mse":
            return F.mse_loss(reg[fg], targets[fg])
        return F.binary_cross_entropy_with_logits(reg[fg], targets[fg].sigmoid())


@pytest.mark.parametrize("loss", ["smooth_l1", "mse", "bce_with_logits"])
def test_a_box_loss_over_no_foreground_anchor_says_mean_over_nothing(loss: str) -> None:
    torch.manual_seed(0)
    img, targets = torch.randn(2, 3, 16, 16), torch.randn(128, 4)
    fg = torch.zeros(128, dtype=torch.bool)  # background-only images
    origin = failing_step(Detector(loss), "full", img, fg, targets)
    assert (origin.phase, origin.kind) == ("forward", "nan")
    assert origin.op is not None
    assert origin.op.startswith(f"aten.{loss.replace('bce', 'binary_cross_entropy')}")
    assert origin.hint is not None
    assert "over zero elements (shape (0, 4))" in origin.hint
    assert "max(count, 1)" in origin.hint


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.mu, self.logvar = nn.Linear(64, 4), nn.Linear(64, 4)
        self.decoder = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 12))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.body(x)
        mu, logvar = self.mu(h), self.logvar(h)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * logvar)
        return self.decoder(z), mu, logvar


def test_a_kl_overflow_before_any_optimizer_step_is_not_blamed_on_the_learning_rate() -> None:
    torch.manual_seed(0)
    model = VAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 12)
    x[:, 3] *= 3000  # an income column left in raw units
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        recon, mu, logvar = model(x)
        kld = -0.5 * torch.sum(1 + logvar - mu.pow(2) - logvar.exp()) / len(x)
        loss = guard.check_loss(F.mse_loss(recon, x, reduction="sum") / len(x) + kld)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.kind) == (0, "loss", "inf")
    assert origin.hint is not None
    assert "before any optimizer step" in origin.hint
    assert "look at the last optimizer.step()" not in origin.hint
    assert "logvar.exp()" in origin.hint
    assert f"values up to {x.abs().max().item():.1e}" in origin.hint


def test_a_sampling_loop_reports_one_origin_and_blames_the_loop() -> None:
    # DDIM sampling with a zero-terminal-SNR schedule: x0 = (x - sqrt(1 - a) eps) / sqrt(a)
    # divides by sqrt(0) after the first call; every later call gets the NaN back.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.SiLU(), nn.Conv2d(16, 3, 3, padding=1))
    betas = torch.linspace(0.00085, 0.012, 1000, dtype=torch.float64)
    root = torch.cumprod(1 - betas, 0).sqrt()
    root = (root - root[-1]) * root[0] / (root[0] - root[-1])  # zero terminal SNR
    alphas = (root**2).float()
    steps = list(range(999, -1, -100))
    with (
        warnings.catch_warnings(record=True) as caught,
        nanguard.watch(model, on_nonfinite="warn") as guard,
        torch.no_grad(),
    ):
        warnings.simplefilter("always")
        x = torch.randn(2, 3, 8, 8)
        for i, t in enumerate(steps):
            eps = model(x)
            a_prev = alphas[steps[i + 1]] if i + 1 < len(steps) else torch.tensor(1.0)
            x0 = (x - (1 - alphas[t]).sqrt() * eps) / alphas[t].sqrt()
            x = a_prev.sqrt() * x0 + (1 - a_prev).sqrt() * eps
    assert len([w for w in caught if issubclass(w.category, nanguard.NonFiniteWarning)]) == 1
    origins = [e for e in guard.events if e.is_origin]
    assert len(origins) == 1
    (origin,) = origins
    assert (origin.phase, origin.details["forward"]) == ("input", 2)
    assert origin.hint is not None
    assert "a sampling loop" in origin.hint
    carried = [e for e in guard.events if e.phase == "input" and not e.is_origin]
    assert [e.details["forward"] for e in carried] == list(range(3, 11))
    assert all("carried on by the loop" in e.message for e in carried)
    # one event per carried call, not one per module it reached
    assert len(guard.events) == len(carried) + 4


class PCEN(nn.Module):
    """Learned power-law compression of an energy that is 0 on padded frames."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.r = nn.Parameter(torch.tensor(0.3))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        energy = self.lin(x).pow(2) * mask
        return energy.pow(self.r).mean()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_learnable_exponent_at_zero_points_at_the_bases_derivative(mode: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 10, 8)
    mask = torch.ones(4, 10, 1)
    mask[:, 7:] = 0
    origin = failing_step(PCEN(), mode, x, mask)
    assert origin.phase == "backward"
    assert origin.op is not None
    assert "PowBackward1" in origin.op
    assert origin.hint is not None
    assert "the derivative with respect to x, p * x ** (p - 1), is infinite" in origin.hint
    assert "x.clamp_min(eps) ** p" in origin.hint


def test_a_naive_focal_loss_on_bfloat16_logits_says_to_compute_it_in_float32() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    with torch.no_grad():
        model[2].weight.mul_(40.0)  # confident logits, beyond 6 for some samples
    x, t = torch.randn(64, 16), torch.ones(64, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        p = torch.sigmoid(logits)  # rounds to exactly 1.0 in bfloat16
        focal = -(t * (1 - p) ** 2 * torch.log(p) + (1 - t) * p**2 * torch.log(1 - p))
        loss = guard.check_loss(focal.mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert logits.dtype == torch.bfloat16
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "nan")
    assert origin.hint is not None
    assert "from finite bfloat16 model outputs" in origin.hint
    assert "logits.float()" in origin.hint


class AutoEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, 8, 3, 2, 1), nn.ReLU(), nn.Conv2d(8, 16, 3, 2, 1))
        self.dec = nn.Sequential(nn.ConvTranspose2d(16, 8, 4, 2, 1), nn.ReLU(),
                                 nn.ConvTranspose2d(8, 1, 4, 2, 1), nn.Sigmoid())  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x))


def test_two_corrupt_validation_batches_a_few_calls_apart_are_two_origins() -> None:
    # An autoencoder's output has its input's shape, but nothing feeds it back here.
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.rand(16, 1, 28, 28, generator=gen) for _ in range(20)]
    batches[3][5, 0, 10, 10] = float("nan")
    batches[12][7, 0, 3, 3] = float("inf")  # another bad file
    model = AutoEncoder().eval()
    with nanguard.watch(model, on_nonfinite="log") as guard, torch.no_grad():
        for x in batches:
            F.mse_loss(model(x), x)
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.details["forward"], e.kind) for e in origins] == [
        ("input", 4, "nan"),
        ("input", 13, "inf"),
    ]
    # ...and neither hint tells a loop story: the previous calls' outputs were finite and
    # nothing says this batch was built from them
    assert all("look at the data pipeline" in (e.hint or "") for e in origins)


def test_a_nan_micro_batch_gets_the_data_hint_not_the_loop_one() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        opt.zero_grad()
        for micro in range(4):  # gradient accumulation
            x = torch.randn(8, 20, generator=gen)
            if micro == 2:
                x[3, 7] = float("nan")
            (F.cross_entropy(model(x), torch.randint(0, 5, (8,), generator=gen)) / 4).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details["forward"]) == ("input", 3)
    assert origin.hint is not None
    assert "Assert torch.isfinite(x).all() in the loader" in origin.hint
    assert "sampling loop" not in origin.hint


class Eps(nn.Module):
    """A noise predictor whose GroupNorm (eps=0) makes NaN on a constant input."""

    def __init__(self) -> None:
        super().__init__()
        self.c1 = nn.Conv2d(1, 8, 3, padding=1)
        self.gn = nn.GroupNorm(8, 8, eps=0.0)
        self.c2 = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c2(F.silu(self.gn(self.c1(x))))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_sampler_carrying_a_models_nan_has_one_origin_in_both_modes(mode: str) -> None:
    torch.manual_seed(0)
    model = Eps().eval()
    x = torch.randn(4, 1, 8, 8)
    with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard, torch.no_grad():
        for call in range(8):
            if call == 4:
                x = torch.zeros_like(x)  # a constant image: GroupNorm divides 0 by 0
            x = x - 0.1 * model(x)
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.module, e.details.get("forward")) for e in origins] == [
        ("forward", "gn", 5)
    ]
    carried = [e for e in guard.events if e.phase == "input"]
    assert [e.details["forward"] for e in carried] == [6, 7, 8]


def test_corrupt_validation_batches_one_after_another_are_two_origins() -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.rand(16, 1, 28, 28, generator=gen) for _ in range(6)]
    batches[2][5, 0, 10, 10] = float("nan")
    batches[3][2, 0, 3, 3] = float("nan")  # the next batch: another bad file, another sample
    model = AutoEncoder().eval()
    with nanguard.watch(model, on_nonfinite="log") as guard, torch.no_grad():
        for x in batches:
            F.mse_loss(model(x), x)
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.details["forward"]) for e in origins] == [("input", 3), ("input", 4)]


class CondEps(nn.Module):
    """An eps-net normalising its conditioning without eps: the null prompt (zeros) is 0/0."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv2d(3, 16, 3, padding=1)
        self.cproj = nn.Linear(16, 16)
        self.out = nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        cond = cond / cond.norm(dim=-1, keepdim=True)
        return self.out(F.silu(self.inp(x) + self.cproj(cond)[:, :, None, None]))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_classifier_free_guidance_sampler_has_one_origin(mode: str) -> None:
    # The model runs on cat([x, x]); mixing the halves spreads the NaN to every sample.
    torch.manual_seed(0)
    model = CondEps().eval()
    c, null = torch.randn(4, 16), torch.zeros(4, 16)
    with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard, torch.no_grad():
        x = torch.randn(4, 3, 8, 8)
        for _ in range(5):
            eps_c, eps_u = model(torch.cat([x, x]), torch.cat([c, null])).chunk(2)
            x = x - 0.1 * (eps_u + 5.0 * (eps_c - eps_u))
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.module, e.details.get("forward")) for e in origins] == [
        ("forward", "", None)
    ]
    assert [e.details["forward"] for e in guard.events if e.phase == "input"] == [2, 3, 4, 5]


class _GumbelAE(nn.Module):
    """A discrete autoencoder: gumbel_softmax codes, some codes disabled with -inf."""

    def __init__(self, masked: bool, codes: int = 64) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, codes))
        self.dec = nn.Sequential(nn.Linear(codes, 128), nn.GELU(), nn.Linear(128, 32))
        alive = torch.ones(codes, dtype=torch.bool)
        if masked:
            alive[48:] = False
        self.register_buffer("alive", alive)
        self.tau = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.enc(x).masked_fill(~self.alive, float("-inf"))
        return self.dec(F.gumbel_softmax(logits, tau=self.tau, hard=True))  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("masked", [False, True])
def test_a_gumbel_temperature_annealed_too_far_names_the_division(masked: bool, mode: str) -> None:
    # (logits + g) / tau overflows float16 at tau = 1e-4; the softmax makes NaN of it. With
    # -inf already in the logits (disabled codes), the division was not seen making new Inf:
    # the softmax was named, with the attention hint (scale q @ k).
    torch.manual_seed(0)
    model = _GumbelAE(masked)
    model.tau = 1e-4
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        x = torch.randn(128, 32)
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        loss = F.mse_loss(out.float(), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "", "nan")
    assert origin.op == "aten.div.Tensor"
    assert origin.hint is not None
    assert origin.hint.startswith(
        "aten.div.Tensor divided by 0.0001, a number (a temperature annealed too far: "
        "gumbel_softmax's tau), and the quotient overflowed to Inf"
    )


def test_evaluation_calls_between_steps_do_not_count_as_micro_batches() -> None:
    # An evaluation every step (Trainer's eval_steps=1, a validation loop): the NaN is in
    # the third micro-batch of the step, not its "forward 4".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(2):
            model.eval()
            with torch.no_grad():
                model(torch.randn(8, 20, generator=gen))
            model.train()
            for micro in range(4):
                x = torch.randn(8, 20, generator=gen)
                if step == 1 and micro == 2:
                    x[3, 7] = float("nan")
                y = torch.randint(0, 5, (8,), generator=gen)
                (F.cross_entropy(model(x), y) / 4).backward()
            opt.step()
            opt.zero_grad()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.details["forward"]) == (1, "input", 3)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_micro_batch_of_an_autoencoder_gets_the_data_hint(mode: str) -> None:
    # Output and input share their shape, but each micro-batch had its backward before the
    # next began: fresh batches from the loader, not a loop feeding outputs back.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(3):
            opt.zero_grad()
            for micro in range(2):
                x = torch.randn(8, 4, generator=gen)
                if step == 2 and micro == 1:
                    x[0, 0] = float("nan")
                guard.check_loss((model(x) - x).pow(2).mean()).backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.details["forward"]) == (2, "input", 2)
    assert origin.hint is not None
    assert "sampling loop" not in origin.hint
    assert "look at the data pipeline" in origin.hint


def test_an_eval_call_with_gradients_is_no_micro_batch_without_replay_either() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", replay=False) as guard:
        model.eval()
        model(torch.randn(8, 20))  # an evaluation with autograd on (no backward)
        model.train()
        x = torch.randn(8, 20)
        x[3, 7] = float("nan")
        F.cross_entropy(model(x), torch.randint(0, 5, (8,))).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details.get("forward", 1)) == ("input", 1)


class _Enc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.mu, self.logvar = nn.Linear(6, 16), nn.Linear(16, 4), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.relu(self.body(x))
        return self.mu(h), self.logvar(h)


class _BfVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.dec = _Enc(), nn.Linear(4, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        mu, logvar = self.enc(x)
        z = mu + torch.exp(0.5 * logvar) * torch.randn_like(mu)
        return self.dec(z), mu, logvar


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_huge_outputs_from_a_batch_outlier_are_not_blamed_on_the_learning_rate(mode: str) -> None:
    # One sample's unnormalised feature (600) drives logvar up; exp(logvar) in the KL term
    # overflows. The weights are small: the learning rate is not the story.
    torch.manual_seed(0)
    model = _BfVAE()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log")  # type: ignore[arg-type]
    with guard:
        for step in range(3):
            x = torch.randn(8, 6)
            if step == 2:
                x[5] = 600.0
            with torch.autocast("cpu", dtype=torch.bfloat16):
                rec, mu, logvar = model(x)
                kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.float().exp()).sum(-1).mean()
                loss = guard.check_loss((rec.float() - x).pow(2).mean() + kl)
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (2, "loss")
    assert origin.hint is not None
    assert "not exploding" in origin.hint
    assert "learning rate" not in origin.hint
