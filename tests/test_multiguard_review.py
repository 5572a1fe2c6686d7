"""From a review with several models and guards in one loop: a GAN's two networks, an
encoder-decoder with tied embeddings."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


def _slerp(a: torch.Tensor, b: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Latent interpolation without a clamp: a latent with itself is acos(1)/sin(0) = NaN."""
    a_n, b_n = a / a.norm(dim=-1, keepdim=True), b / b.norm(dim=-1, keepdim=True)
    omega = torch.acos((a_n * b_n).sum(-1, keepdim=True))
    return (torch.sin((1.0 - t) * omega) * a + torch.sin(t * omega) * b) / torch.sin(omega)


@pytest.mark.parametrize("generator_first", [False, True], ids=["d-detached-first", "g-first"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_discriminator_fed_by_a_broken_generator_at_detach_is_no_data_origin(
    mode: str, generator_first: bool
) -> None:
    # D's forward on G(z) in the last G step is resolved only when the guards detach: it
    # was a new origin, "the input batch already contains NaN: look at the data pipeline"
    # (and again when G's guard was detached first, gone when D's resolved it).
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 2))
    disc = nn.Sequential(nn.Linear(2, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
    bce = nn.BCEWithLogitsLoss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gg = nanguard.watch(gen, optimizer=opt_g, mode=mode, on_nonfinite="warn")
        gd = nanguard.watch(disc, optimizer=opt_d, mode=mode, on_nonfinite="warn")
        try:
            for it in range(4):
                for _ in range(3):
                    real = torch.randn(64, 2) + 2.0
                    fake = gen(torch.randn(64, 8)).detach()
                    d_loss = bce(disc(real), torch.ones(64, 1))
                    d_loss = gd.check_loss(d_loss + bce(disc(fake), torch.zeros(64, 1)))
                    opt_d.zero_grad()
                    d_loss.backward()
                    opt_d.step()
                z0, z1 = torch.randn(64, 8), torch.randn(64, 8)
                if it == 1:
                    z1[:4] = z0[:4]  # a "pair" that is the same latent
                g_loss = gg.check_loss(
                    bce(disc(gen(_slerp(z0, z1, torch.rand(64, 1)))), 1 + 0 * z0[:, :1])
                )
                opt_g.zero_grad()
                g_loss.backward()
                opt_g.step()
        finally:
            for guard in (gg, gd) if generator_first else (gd, gg):
                guard.detach()
    origin = gg.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("input", "")
    # D's events point at G's origin: none of its own.
    assert [e for e in gd.events if e.is_origin] == []
    assert any("watched by another guard" in e.message for e in gd.events)
    # ...and later steps' "see the origin" is G's, not one of D's own.
    assert not any("see the origin at step" in e.message for e in gd.events)
    # G's origin is warned once, not again by D's guard pointing at it.
    told = [w for w in caught if str(w.message) == origin.message]
    assert len(told) == 1


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(500, 64, padding_idx=0)
        self.rnn = nn.GRU(64, 64, batch_first=True)

    def forward(self, src: torch.Tensor) -> torch.Tensor:
        return self.rnn(self.emb(src))[1]  # type: ignore[no-any-return]


class CosineDecoder(nn.Module):
    """A cosine classifier over the embedding it shares with the encoder: the padding row is
    0, and its norm's backward at 0 is NaN (the forward is finite)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.rnn = nn.GRU(64, 64, batch_first=True)

    def forward(self, tgt: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(F.embedding(tgt, self.weight, padding_idx=0), h)
        w = self.weight / (self.weight.pow(2).sum(1, keepdim=True).sqrt() + 1e-6)
        return 10 * out / (out.norm(dim=-1, keepdim=True) + 1e-6) @ w.t()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_decoder_tied_to_an_unwatched_encoder_is_replayed_without_it(mode: str) -> None:
    # The replay's backward went on into the encoder's freed graph through the tied
    # weight, failed, and the message said "the replay did not reproduce" the gradients.
    torch.manual_seed(0)
    enc = Encoder()
    dec = CosineDecoder(enc.emb.weight)
    opt = torch.optim.Adam([*enc.parameters(), dec.rnn.weight_ih_l0], lr=1e-3)
    src, tgt = torch.randint(1, 500, (8, 12)), torch.randint(1, 500, (8, 10))
    tgt[:, 7:] = 0
    with nanguard.watch(dec, optimizer=opt, mode=mode) as guard:
        logits = dec(tgt[:, :-1], enc(src))
        loss = F.cross_entropy(logits.reshape(-1, 500), tgt[:, 1:].reshape(-1), ignore_index=0)
        guard.check_loss(loss)
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.reproducible) == ("backward", "", True)
    assert origin.op == "aten.div.Tensor in SqrtBackward0"
    assert "did not reproduce" not in origin.message
    assert torch.isfinite(enc.emb.weight).all()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_ema_copy_of_a_poisoned_model_points_at_the_models_origin(mode: str) -> None:
    # AveragedModel.update_parameters copied NaN weights into a watched EMA: its guard had
    # six origins at "step 0", one per weight, and a hint about ActNorm's initialisation.
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10),
    )  # fmt: skip
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.99), use_buffers=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with (
            nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="warn") as guard,
            nanguard.watch(ema, mode=mode, on_nonfinite="warn") as ema_guard,
        ):
            for step in range(5):
                x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
                if step == 2:
                    x[3, :, 2:5, 2:5] = float("nan")  # a corrupt image
                loss = guard.check_loss(F.cross_entropy(model(x), y))
                opt.zero_grad()
                loss.backward()
                opt.step()
                ema.update_parameters(model)
                with torch.no_grad():
                    ema(torch.randn(16, 3, 8, 8))
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (2, "input")
    assert [e for e in ema_guard.events if e.is_origin] == []
    pointing = [e for e in ema_guard.events if e.details.get("made_by") == "Sequential"]
    assert pointing
    assert all("code copied them" in e.message for e in pointing)


class MaskedPoolTeacher(nn.Module):
    """Attention pooling over the tokens that are not padding: an empty text masks every
    key, and softmax over a row of -inf is 0/0 = NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32, padding_idx=0)
        self.score = nn.Linear(32, 1)
        self.out = nn.Linear(32, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        scores = self.score(h).squeeze(-1).masked_fill(tokens == 0, float("-inf"))
        return self.out((scores.softmax(-1).unsqueeze(-1) * h).sum(1))  # type: ignore[no-any-return]


class MeanPoolStudent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16, padding_idx=0)
        self.out = nn.Linear(16, 5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = (tokens != 0).float().unsqueeze(-1)
        pooled = (self.emb(tokens) * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return self.out(pooled)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_distillation_loss_after_a_nan_teacher_points_at_the_teacher(mode: str) -> None:
    # The student's guard called its KD loss an origin of its own ("the loss function
    # created it"), beside the teacher guard's exact origin.
    torch.manual_seed(0)
    teacher, student = MaskedPoolTeacher().eval(), MeanPoolStudent()
    opt = torch.optim.Adam(student.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with (
            nanguard.watch(teacher, mode=mode, on_nonfinite="warn") as teacher_guard,
            nanguard.watch(student, optimizer=opt, mode=mode, on_nonfinite="warn") as guard,
        ):
            for step in range(3):
                tokens = torch.randint(1, 100, (16, 12))
                if step == 1:
                    tokens[5] = 0  # an empty text
                with torch.no_grad():
                    target = teacher(tokens).softmax(-1)
                log_probs = F.log_softmax(student(tokens), -1)
                loss = guard.check_loss(F.kl_div(log_probs, target, reduction="batchmean"))
                opt.zero_grad()
                loss.backward()
                opt.step()
    origin = teacher_guard.origin
    assert origin is not None
    assert (origin.module, origin.op) == ("", "aten._softmax.default")
    # (No gradient links the loss to the teacher's outputs: the loss stays the origin,
    # and points at the teacher's.)
    loss_origin = guard.origin
    assert loss_origin is not None
    assert loss_origin.phase == "loss"
    assert "if the loss reads its outputs (a distillation target)" in loss_origin.message
    assert loss_origin.details["also_nonfinite"] == "MaskedPoolTeacher"


class Classifier(nn.Module):
    """An encoder (the watched part), then mean pooling over the tokens that are not
    padding and a head, in the model's own forward: an empty text's mean is 0/0."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32, padding_idx=0)
        self.encoder = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32))
        self.head = nn.Linear(32, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.emb(tokens))
        keep = (tokens != 0).unsqueeze(-1).float()
        return self.head((h * keep).sum(1) / keep.sum(1))  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_guard_on_a_submodule_says_the_code_after_it_may_have_made_the_loss(
    mode: str,
) -> None:
    # The message said "the loss function created it" and sent the user to the loss.
    torch.manual_seed(0)
    model = Classifier()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(1, 100, (16, 12))
    tokens[5] = 0  # an empty text
    with nanguard.watch(model.encoder, optimizer=opt, mode=mode) as guard:
        loss = guard.check_loss(F.cross_entropy(model(tokens), torch.randint(0, 3, (16,))))
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert "the loss function, or the code between them and the loss, created it" in (
        origin.message
    )
    assert "uses 2 trainable weights the watched model does not hold (shape (3,), (3, 32))" in (
        origin.message
    )
    assert "the loss function created it" not in origin.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_forward_origin_in_validation_says_it_was_an_inference_forward(mode: str) -> None:
    # Validated after step 1, counted in step 2: the message did not say it was no
    # training forward.
    torch.manual_seed(0)
    model = MeanPoolStudent()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="warn") as guard:
            for _ in range(2):
                tokens = torch.randint(1, 100, (16, 12))
                loss = guard.check_loss(F.cross_entropy(model(tokens), torch.randint(0, 5, (16,))))
                opt.zero_grad()
                loss.backward()
                opt.step()
            model.eval()
            with torch.no_grad():
                model.emb.weight[7] = 1e38  # a corrupted row, read only by validation
                model(torch.full((4, 12), 7))
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "forward"
    assert origin.details.get("inference") is True
    assert "It was an inference forward, with gradients off" in origin.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_tied_weights_under_two_guards_and_optimizers_keep_one_origin(mode: str) -> None:
    # Under "warn" the step-0 origin went on: at step 1 the decoder's guard blamed the
    # encoder's optimizer for the tied weight, and the encoder's its loss.
    torch.manual_seed(0)
    enc = Encoder()
    dec = CosineDecoder(enc.emb.weight)
    opt_enc = torch.optim.Adam(enc.parameters(), lr=1e-3)
    opt_dec = torch.optim.Adam(dec.rnn.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with (
            nanguard.watch(enc, optimizer=opt_enc, mode=mode, on_nonfinite="warn") as guard_enc,
            nanguard.watch(dec, optimizer=opt_dec, mode=mode, on_nonfinite="warn") as guard_dec,
        ):
            for _ in range(3):
                src, tgt = torch.randint(1, 500, (8, 12)), torch.randint(1, 500, (8, 10))
                tgt[:, 7:] = 0
                logits = dec(tgt[:, :-1], enc(src))
                loss = F.cross_entropy(
                    logits.reshape(-1, 500), tgt[:, 1:].reshape(-1), ignore_index=0
                )
                guard_dec.check_loss(loss)
                opt_enc.zero_grad()
                opt_dec.zero_grad()
                loss.backward()
                opt_dec.step()
                opt_enc.step()
    origins = [e for g in (guard_enc, guard_dec) for e in g.events if e.is_origin]
    assert [(e.step, e.phase, e.op) for e in origins] == [
        (0, "backward", "aten.div.Tensor in SqrtBackward0")
    ]


def test_a_student_loss_made_nan_by_an_ema_teacher_points_at_the_teacher() -> None:
    # Mean-teacher: an AveragedModel whose decay schedule is NaN at one step. The teacher's
    # weights go NaN in update_parameters(); its pseudo-targets make the student's loss NaN.
    from torch.optim.swa_utils import AveragedModel

    torch.manual_seed(0)
    student = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.Adam(student.parameters(), 1e-3)
    decays = [0.99, 0.99, float("nan"), 0.99, 0.99]
    at = [0]

    def ema(avg: torch.Tensor, p: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return decays[at[0]] * avg + (1 - decays[at[0]]) * p

    teacher = AveragedModel(student, avg_fn=ema)
    with (
        nanguard.watch(student, optimizer=opt, on_nonfinite="log") as guard,
        nanguard.watch(teacher, on_nonfinite="log"),
    ):
        for step in range(4):
            at[0] = step
            x = torch.randn(8, 6)
            with torch.no_grad():
                target = teacher(x + 0.1 * torch.randn_like(x)).softmax(-1)
            loss = guard.check_loss(-(target * student(x).log_softmax(-1)).sum(-1).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
            teacher.update_parameters(student)
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (3, "loss")
    assert origin.details["also_nonfinite"] == "AveragedModel"
    assert "holds non-finite weights" in origin.message
