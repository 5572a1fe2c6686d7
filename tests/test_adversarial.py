"""Adversarial usage: the training loops, NaN causes and exit paths of real bug reports.

Each test pins behaviour a user relies on: the module, phase, kind and tensor of the
origin, no false alarm on healthy training, hooks removed and model state untouched.
"""

from __future__ import annotations

import gc
import json
import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from realistic import PairwiseDistances, TinyLM
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import nanguard


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def origin_of(run: Callable[[], object]) -> nanguard.Event:
    with pytest.raises(nanguard.NonFiniteError) as info:
        run()
    return info.value.event


# ------------------------------------------------------------------------ models
class LogFeatures(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)


class AnchorDistance(nn.Module):
    """Distance between rows 0::2 and 1::2: sqrt at 0 (NaN gradient) when they coincide."""

    def forward(self, x: Tensor) -> Tensor:
        return (x[0::2] - x[1::2]).pow(2).sum(-1, keepdim=True).sqrt()


class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Linear(4, 8)
        self.distance = AnchorDistance()
        self.head = nn.Linear(1, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.distance(self.encoder(x)))


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def train(
    model: nn.Module,
    batches: Iterator[tuple[Tensor, ...]],
    loss_fn: Callable[[Tensor], Tensor] = lambda out: out.pow(2).mean(),
    **options: object,
) -> nanguard.Guard:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, **options) as guard:  # type: ignore[arg-type]
        for inputs in batches:
            opt.zero_grad()
            loss = guard.check_loss(loss_fn(model(*inputs)))
            loss.backward()
            opt.step()
    return guard


def once(*inputs: Tensor) -> Iterator[tuple[Tensor, ...]]:
    yield inputs


# ------------------------------------------------------------ usage patterns
def test_gradient_accumulation_is_quiet_and_counts_optimizer_steps() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt) as guard:
        for _ in range(10):
            for _ in range(4):
                loss = guard.check_loss(model(torch.randn(4, 8)).pow(2).mean())
                loss.backward()
            opt.step()
            opt.zero_grad()
    assert guard.events == []
    assert guard.current_step == 10


def test_gradient_accumulation_names_the_step_of_a_bad_micro_batch() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        with nanguard.watch(model, optimizer=opt):
            for step in range(5):
                for micro in range(4):
                    x = torch.randn(4, 8)
                    if (step, micro) == (3, 2):
                        x[1, 3] = float("nan")
                    model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()

    origin = origin_of(run)
    assert (origin.step, origin.phase, origin.module, origin.tensor) == (3, "input", "", "args[0]")
    assert origin.stats is not None
    assert origin.stats.nan_count == 1


@pytest.mark.parametrize("bad_micro", [0, 2, 3])
def test_gradient_accumulation_localises_a_backward_origin(bad_micro: int) -> None:
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        with nanguard.watch(model, optimizer=opt) as guard:
            for micro in range(4):
                x = torch.randn(4, 4)
                if micro == bad_micro:
                    x[1] = x[0]  # identical anchor and positive: sqrt at 0
                guard.check_loss(model(x).mean()).backward()
            opt.step()

    origin = origin_of(run)
    assert (origin.phase, origin.module, origin.module_type) == (
        "backward",
        "distance",
        "AnchorDistance",
    )
    assert origin.tensor == "grad of args[0]"
    assert origin.kind == "nan"


def test_two_guards_gan_training_is_quiet() -> None:
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), 1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), 1e-3)
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    with (
        nanguard.watch(gen, optimizer=opt_g) as guard_g,
        nanguard.watch(disc, optimizer=opt_d) as guard_d,
    ):
        for _ in range(15):
            fake = gen(torch.randn(16, 4))
            d_loss = bce(disc(torch.randn(16, 8)), ones) + bce(disc(fake.detach()), zeros)
            opt_d.zero_grad()
            guard_d.check_loss(d_loss).backward()
            opt_d.step()
            opt_g.zero_grad()
            guard_g.check_loss(bce(disc(fake), ones)).backward()
            opt_g.step()
    assert guard_g.events == []
    assert guard_d.events == []
    assert guard_g.current_step == guard_d.current_step == 15
    assert hook_count(gen) == hook_count(disc) == 0


class MinibatchStd(nn.Module):
    """ProGAN's minibatch standard deviation, without an eps: sqrt at 0 when G collapses."""

    def forward(self, x: Tensor) -> Tensor:
        std = torch.sqrt(x.var(dim=0, unbiased=False)).mean()
        return torch.cat([x, std.expand(x.shape[0], 1)], 1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_two_guards_gan_a_loss_computed_through_a_broken_discriminator_is_not_gs_origin(
    mode: str,
) -> None:
    # A collapsed generator (every fake the same): the discriminator's backward makes NaN at
    # sqrt(0), its optimizer applies it, and the generator's loss through it is NaN.
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
    with torch.no_grad():
        gen[2].weight.zero_()
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), MinibatchStd(), nn.Linear(17, 1))
    opt_g = torch.optim.Adam(gen.parameters(), 1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), 1e-3)
    with (
        nanguard.watch(gen, optimizer=opt_g, on_nonfinite="log", mode=mode) as guard_g,
        nanguard.watch(disc, optimizer=opt_d, on_nonfinite="log", mode=mode) as guard_d,
    ):
        fake = gen(torch.randn(16, 4))
        d_loss = (
            F.softplus(-disc(torch.randn(16, 8))).mean() + F.softplus(disc(fake.detach())).mean()
        )
        opt_d.zero_grad()
        guard_d.check_loss(d_loss).backward()
        opt_d.step()
        opt_g.zero_grad()
        guard_g.check_loss(F.softplus(-disc(fake)).mean()).backward()
        opt_g.step()
    d_origin = guard_d.origin
    assert d_origin is not None
    assert (d_origin.phase, d_origin.module_type) == ("backward", "MinibatchStd")
    assert guard_g.origin is None
    loss = next(e for e in guard_g.events if e.phase == "loss")
    assert "it was computed through Sequential, watched by another guard" in loss.message
    assert "MinibatchStd" in loss.message
    assert "the loss function created it" not in loss.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("policy", ["raise", "log"])
def test_two_guards_gan_a_nan_born_in_the_generator_is_the_generators_origin(
    policy: str, mode: str
) -> None:
    """The discriminator's step is resolved first, and it sees NaN in its input: the
    generator's guard names the origin, not the data pipeline, and only once."""
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 16), LogFeatures(), nn.Linear(16, 8))
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt_g = torch.optim.Adam(gen.parameters(), 1e-3)
    opt_d = torch.optim.Adam(disc.parameters(), 1e-3)
    bce = nn.BCEWithLogitsLoss()
    ones, zeros = torch.ones(16, 1), torch.zeros(16, 1)
    with (
        warnings.catch_warnings(record=True) as caught,
        nanguard.watch(gen, optimizer=opt_g, on_nonfinite=policy, mode=mode) as guard_g,
        nanguard.watch(disc, optimizer=opt_d, on_nonfinite=policy, mode=mode) as guard_d,
    ):
        warnings.simplefilter("always")
        fake = gen(torch.randn(16, 4))
        d_loss = bce(disc(torch.randn(16, 8)), ones) + bce(disc(fake.detach()), zeros)
        opt_d.zero_grad()
        guard_d.check_loss(d_loss).backward()
        if policy == "raise":
            with pytest.raises(nanguard.NonFiniteError) as info:
                opt_d.step()
            assert info.value.event.module == "1"
            assert info.value.event.module_type == "LogFeatures"
        else:
            opt_d.step()
            opt_g.zero_grad()
            guard_g.check_loss(bce(disc(fake), ones)).backward()
            opt_g.step()
    origins = [e for e in guard_g.events if e.is_origin]
    assert [(e.phase, e.module, e.module_type) for e in origins] == [
        ("forward", "1", "LogFeatures")
    ]
    if policy == "raise":  # raised once: not repeated as a warning when the guards close
        assert not [w for w in caught if issubclass(w.category, nanguard.NonFiniteWarning)]
    assert not any(e.is_origin for e in guard_d.events)
    fed = next(e for e in guard_d.events if e.phase == "input")
    assert fed.details["made_by"] == "Sequential"
    assert "watched by another guard" in fed.message
    assert "check the data pipeline" not in fed.message.lower()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_two_guards_gan_under_skip_step_drop_only_the_steps_a_nan_latent_spoiled(
    mode: str,
) -> None:
    """A latent bank row of zeros normalised by its norm (0/0) at iteration 3: both models'
    updates of that iteration are dropped, and no other. The discriminator's call on the
    fakes during the generator's update ends in its next step, whose own batches are finite
    (its gradients were zeroed): that step goes ahead, and no new origin is told."""

    def nets() -> tuple[nn.Module, nn.Module]:
        torch.manual_seed(0)
        gen = nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 16))
        disc = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
        return gen, disc

    def batches() -> list[tuple[Tensor, Tensor]]:
        g = torch.Generator().manual_seed(1)
        out = []
        for it in range(6):
            real, z = torch.randn(16, 16, generator=g), torch.randn(16, 8, generator=g)
            if it == 3:
                z[5] = 0.0
            out.append((real, z / z.norm(dim=1, keepdim=True)))
        return out

    def train(guarded: bool) -> tuple[nn.Module, nn.Module, list[nanguard.Guard]]:
        gen, disc = nets()
        opt_g = torch.optim.Adam(gen.parameters(), 1e-3, betas=(0.5, 0.999))
        opt_d = torch.optim.Adam(disc.parameters(), 1e-3, betas=(0.5, 0.999))
        bce = nn.BCEWithLogitsLoss()
        guards = []
        if guarded:
            guards = [
                nanguard.watch(gen, optimizer=opt_g, on_nonfinite="skip_step", mode=mode),
                nanguard.watch(disc, optimizer=opt_d, on_nonfinite="skip_step", mode=mode),
            ]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for it, (real, z) in enumerate(batches()):
                if not guarded and it == 3:
                    continue  # the reference drops that iteration
                fake = gen(z)
                d_loss = bce(disc(real), torch.ones(16, 1)) + bce(
                    disc(fake.detach()), torch.zeros(16, 1)
                )
                opt_d.zero_grad()
                d_loss.backward()
                opt_d.step()
                g_loss = bce(disc(fake), torch.ones(16, 1))
                opt_g.zero_grad()
                g_loss.backward()
                opt_g.step()
        for guard in guards:
            guard.detach()
        return gen, disc, guards

    gen, disc, (guard_g, guard_d) = train(True)
    ref_gen, ref_disc, _ = train(False)
    for model, ref in ((gen, ref_gen), (disc, ref_disc)):
        for p, q in zip(model.parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q)
    assert [(e.step, e.phase) for e in guard_g.events if e.is_origin] == [(3, "input")]
    assert not any(e.is_origin for e in guard_d.events)
    assert [e.step for e in guard_d.events if e.details.get("skipped")] == [3]
    assert [e.step for e in guard_g.events if e.details.get("skipped")] == [3]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_gradient_from_the_model_downstream_names_that_models_origin(mode: str) -> None:
    # Encoder and decoder, one guard each, one optimizer over both: the encoder's guard
    # resolves first and sees a NaN gradient arriving at its outputs. It comes from the
    # decoder's forward, which is the origin to raise, not the encoder's "loss".
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(8, 16), nn.Tanh())
    dec = nn.Sequential(nn.Linear(16, 16), LogFeatures(), nn.Linear(16, 1))
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], lr=1e-3)
    with (
        nanguard.watch(enc, optimizer=opt, on_nonfinite="raise", mode=mode) as guard_enc,
        nanguard.watch(dec, optimizer=opt, on_nonfinite="raise", mode=mode),
    ):
        loss = dec(enc(torch.randn(16, 8))).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError) as info:
            opt.step()
    assert (info.value.event.phase, info.value.event.module) == ("forward", "1")
    assert info.value.event.module_type == "LogFeatures"
    assert not any(e.is_origin for e in guard_enc.events)
    note = next(e for e in guard_enc.events if e.phase == "loss")
    assert "comes back from Sequential, watched by another guard" in note.message


def test_lbfgs_closure_training_is_quiet() -> None:
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), max_iter=5)
    x, y = torch.randn(32, 3), torch.randn(32, 1)
    with nanguard.watch(model, optimizer=opt) as guard:
        for _ in range(4):

            def closure() -> Tensor:
                opt.zero_grad()
                loss = guard.check_loss(F.mse_loss(model(x), y))
                loss.backward()
                return loss

            opt.step(closure)
    assert guard.events == []
    assert guard.current_step == 4


def test_zero_grad_without_set_to_none_is_quiet() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt) as guard:
        for _ in range(40):
            opt.zero_grad(set_to_none=False)
            guard.check_loss(model(torch.randn(8, 8)).pow(2).mean()).backward()
            opt.step()
    assert guard.events == []


def test_guard_step_with_optimizer_does_not_count_twice() -> None:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt) as guard:
        for _ in range(6):
            opt.zero_grad()
            guard.check_loss(model(torch.randn(8, 8)).pow(2).mean()).backward()
            opt.step()
            assert guard.step() == []
    assert guard.current_step == 6


def test_evaluation_in_the_middle_of_training_is_quiet() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt) as guard:
        for step in range(8):
            loss = guard.check_loss(model(torch.randn(8, 8)).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            if step % 3 == 0:
                model.eval()
                with torch.no_grad():
                    model(torch.randn(8, 8))
                with torch.inference_mode():
                    model(torch.randn(8, 8))
                model.train()
            opt.step()
    assert guard.events == []
    assert guard.current_step == 8
    assert model.training
    assert all(m.training for m in model.modules())


def test_a_nan_in_an_evaluation_batch_is_reported_without_a_step() -> None:
    model = mlp()
    with nanguard.watch(model, on_nonfinite="log") as guard, torch.no_grad():
        x = torch.randn(8, 8)
        x[0, 0] = float("nan")
        model(x)
        assert guard.origin is not None  # resolved at the end of the inference forward
    assert (guard.origin.phase, guard.origin.module, guard.origin.tensor) == (
        "input",
        "",
        "args[0]",
    )


class CheckpointedNet(nn.Module):
    def __init__(self, sqrt_after: int | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU()) for _ in range(4))
        self.out = nn.Linear(16, 1)
        self.sqrt_after = sqrt_after

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        for i, block in enumerate(self.blocks):
            h = checkpoint(block, h, use_reentrant=False)
            if i == self.sqrt_after:
                h = torch.sqrt(h)  # the model's own code, between two checkpointed blocks
        return self.out(h)


def test_activation_checkpointing_is_quiet() -> None:
    guard = train(CheckpointedNet(), ((torch.randn(8, 8),) for _ in range(5)))
    assert guard.events == []


def test_activation_checkpointing_own_code_origin() -> None:
    origin = origin_of(lambda: train(CheckpointedNet(sqrt_after=2), once(torch.randn(8, 8))))
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "", "CheckpointedNet")
    assert origin.tensor == "args[0] of blocks.3"
    assert origin.kind == "nan"


class TiedLM(nn.Module):
    def __init__(self, vocab: int = 100, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Sequential(nn.Linear(dim, dim), nn.Tanh())
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(self.body(self.embed(idx)))


def test_weight_tying_is_quiet() -> None:
    def loss_fn(logits: Tensor) -> Tensor:
        return F.cross_entropy(logits.reshape(-1, 100), torch.randint(0, 100, (40,)))

    guard = train(TiedLM(), ((torch.randint(0, 100, (4, 10)),) for _ in range(15)), loss_fn)
    assert guard.events == []


def test_a_nan_row_in_a_loaded_embedding_is_a_parameter_origin() -> None:
    model = TiedLM()
    with torch.no_grad():
        model.embed.weight[7] = float("nan")
    idx = torch.randint(0, 100, (4, 10))
    idx[0, 0] = 7
    origin = origin_of(lambda: train(model, once(idx), lambda out: out.mean()))
    assert (origin.phase, origin.param, origin.module) == ("param", "embed.weight", "embed")
    assert origin.stats is not None
    assert origin.stats.nan_count == 32
    assert "before the first step" in origin.message


class InplaceSqrt(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        x.sqrt_()
        return x


class ScaledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)
        self.root = InplaceSqrt()
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.root(self.proj(x) * 1.0))


def test_an_in_place_op_that_returns_its_input_is_the_origin() -> None:
    origin = origin_of(lambda: train(ScaledNet(), once(torch.randn(4, 4))))
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "root", "InplaceSqrt")
    assert origin.tensor == "output"
    # its input is described as it was received, before the in-place op
    assert "inputs were finite" in origin.message


def test_a_submodule_called_directly_is_named() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        with nanguard.watch(model, optimizer=opt) as guard:
            for step in range(3):
                x = torch.randn(4, 8)
                if step == 1:
                    x[0, 0] = float("nan")
                features = model[0](x)  # user code calls a layer outside model.forward
                loss = model(torch.randn(4, 8)).mean() + features.pow(2).mean()
                opt.zero_grad()
                guard.check_loss(loss).backward()
                opt.step()

    origin = origin_of(run)
    assert (origin.step, origin.phase, origin.module, origin.module_type) == (
        1,
        "input",
        "0",
        "Linear",
    )


class KeywordOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 1)

    def forward(self, *, input_ids: Tensor, scale: float = 1.0) -> Tensor:
        return self.proj(input_ids) * scale


def test_keyword_only_inputs_are_named() -> None:
    model = KeywordOnly()
    x = torch.randn(2, 4)
    x[1, 1] = float("inf")
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(input_ids=x, scale=2.0).mean()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor, origin.kind) == ("input", "kwargs['input_ids']", "inf")


class Recurrent(nn.Module):
    """One cell applied five times; each call grows the state until it overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = x
        for _ in range(5):
            h = self.cell(h) * 3.0
        return self.out(h)


def test_a_shared_cell_is_blamed_at_the_call_that_overflowed() -> None:
    model = Recurrent()
    with torch.no_grad():
        model.cell.weight.fill_(1e8)
        model.cell.bias.zero_()
    origin = origin_of(lambda: train(model, once(torch.ones(2, 8))))
    assert (origin.phase, origin.module, origin.call, origin.kind) == ("forward", "cell", 4, "inf")
    assert "call 4" in origin.message


def test_lstm_input_nan_is_an_input_origin() -> None:
    class Tagger(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = nn.LSTM(4, 8, batch_first=True)
            self.head = nn.Linear(8, 1)

        def forward(self, x: Tensor) -> Tensor:
            out, _ = self.rnn(x)
            return self.head(out[:, -1])

    x = torch.randn(2, 5, 4)
    x[1, 3, 2] = float("nan")
    origin = origin_of(lambda: train(Tagger(), once(x)))
    assert (origin.phase, origin.module, origin.tensor) == ("input", "", "args[0]")
    assert origin.propagated[:2] == ("rnn", "head")


# ------------------------------------------------------------ real NaN causes
class RowNormalise(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x / x.sum(-1, keepdim=True)


class LogSoftmaxByHand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 5)

    def forward(self, x: Tensor) -> Tensor:
        return torch.log(torch.softmax(self.proj(x), -1))


class SqrtByPow(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.pow(x, 0.5)


class UnitByHand(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        return h / h.norm(dim=-1, keepdim=True)


class Growth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rate = nn.Linear(4, 64)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cumprod(1 + self.rate(x).abs() * 10, dim=-1)


def test_zero_row_normalisation() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), RowNormalise(), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].bias.fill_(-100.0)  # every ReLU output is 0: 0/0
    origin = origin_of(lambda: train(model, once(torch.randn(4, 4))))
    assert (origin.phase, origin.module, origin.module_type, origin.kind) == (
        "forward",
        "2",
        "RowNormalise",
        "nan",
    )
    assert origin.stats is not None
    assert origin.stats.nan_count == 32
    assert "`2` (RowNormalise)" in origin.message


def test_log_of_softmax_underflow_is_neg_inf_in_the_model() -> None:
    model = LogSoftmaxByHand()
    with torch.no_grad():
        model.proj.weight.mul_(100)

    def loss_fn(out: Tensor) -> Tensor:
        return F.nll_loss(out, torch.randint(0, 5, (16,)))

    origin = origin_of(lambda: train(model, once(torch.randn(16, 8) * 10), loss_fn))
    assert (origin.phase, origin.module, origin.kind, origin.tensor) == (
        "forward",
        "",
        "inf",
        "output",
    )
    assert origin.stats is not None
    assert origin.stats.neginf_count > 0
    assert origin.stats.posinf_count == 0


def test_fractional_power_of_negatives() -> None:
    model = nn.Sequential(nn.Linear(8, 8), SqrtByPow(), nn.Linear(8, 1))
    origin = origin_of(lambda: train(model, once(torch.randn(4, 8))))
    assert (origin.phase, origin.module, origin.module_type, origin.kind) == (
        "forward",
        "1",
        "SqrtByPow",
        "nan",
    )


def test_division_by_a_zero_norm_but_not_f_normalize() -> None:
    model = nn.Sequential(nn.ReLU(), UnitByHand(), nn.Linear(8, 1))
    with torch.no_grad():
        model[1].proj.weight.zero_()
        model[1].proj.bias.zero_()
    origin = origin_of(lambda: train(model, once(torch.randn(4, 8))))
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "1", "UnitByHand")

    safe = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        safe[0].weight.zero_()
        safe[0].bias.zero_()

    class Normalised(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = safe

        def forward(self, x: Tensor) -> Tensor:
            return F.normalize(self.body(x), dim=0)

    assert train(Normalised(), ((torch.randn(4, 8),) for _ in range(3))).events == []


def test_cdist_of_identical_points_is_quiet() -> None:
    class Pairwise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            h = self.proj(x)
            return torch.cdist(h, h)  # zero diagonal: PyTorch's backward handles it

    model = nn.Sequential(Pairwise(), nn.Linear(6, 1))
    assert train(model, ((torch.randn(6, 4),) for _ in range(3))).events == []


def test_cumulative_product_overflow() -> None:
    model = nn.Sequential(Growth(), nn.Linear(64, 1))
    origin = origin_of(lambda: train(model, once(torch.randn(4, 4) * 3)))
    assert (origin.phase, origin.module, origin.module_type, origin.kind) == (
        "forward",
        "0",
        "Growth",
        "inf",
    )
    assert origin.stats is not None
    assert origin.stats.posinf_count > 0


def test_exp_in_a_custom_loss() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight.fill_(30.0)
    origin = origin_of(
        lambda: train(model, once(torch.randn(16, 4) * 5), lambda out: torch.exp(out).mean())
    )
    assert (origin.phase, origin.module, origin.tensor, origin.kind) == (
        "loss",
        None,
        "loss",
        "inf",
    )


def test_exp_in_an_unchecked_loss_is_named_by_its_backward() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight.fill_(30.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def run() -> None:
        with nanguard.watch(model, optimizer=opt):
            opt.zero_grad()
            torch.exp(model(torch.randn(16, 4) * 5)).mean().backward()  # no check_loss
            opt.step()

    origin = origin_of(run)
    assert (origin.phase, origin.tensor, origin.kind) == ("loss", "grad of output", "inf")


class PaddedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor, key_padding_mask: Tensor) -> Tensor:
        h = self.embed(x)
        out, _ = self.attn(h, h, h, key_padding_mask=key_padding_mask)
        return self.head(out)


def test_multihead_attention_with_a_sample_whose_keys_are_all_padding() -> None:
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1, :] = True
    origin = origin_of(lambda: train(PaddedEncoder(), once(torch.randn(3, 5, 8), pad)))
    assert (origin.phase, origin.module, origin.module_type) == (
        "forward",
        "attn",
        "MultiheadAttention",
    )
    assert (origin.tensor, origin.kind) == ("output[0]", "nan")
    assert origin.stats is not None
    assert origin.stats.nan_count == 5 * 16  # exactly sample 1


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_multihead_attention_with_partial_padding_is_quiet(dtype: torch.dtype) -> None:
    pad = torch.zeros(3, 5, dtype=dtype)
    pad[1, 3:] = True if dtype == torch.bool else float("-inf")
    guard = train(PaddedEncoder(), ((torch.randn(3, 5, 8), pad) for _ in range(3)))
    assert guard.events == []


def test_cross_entropy_target_out_of_range_then_training_continues() -> None:
    model = nn.Linear(8, 5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = nanguard.watch(model, optimizer=opt)
    with pytest.raises(IndexError):
        F.cross_entropy(model(torch.randn(4, 8)), torch.tensor([0, 1, 7, 2]))
    for _ in range(3):
        opt.zero_grad()
        guard.check_loss(model(torch.randn(4, 8)).pow(2).mean()).backward()
        opt.step()
    guard.detach()
    assert guard.events == []
    assert guard.current_step == 3
    assert hook_count(model) == 0


def test_batchnorm_with_batch_size_one_raises_torch_error_and_leaves_no_hooks() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        train(model, once(torch.randn(1, 8)))
    assert hook_count(model) == 0


def test_float16_overflow_in_attention_scores_blames_the_attention_code() -> None:
    class Attention(nn.Module):
        def __init__(self, dim: int = 64) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.o = nn.Linear(dim, dim)

        def forward(self, x: Tensor) -> Tensor:
            scores = self.q(x) @ self.k(x).transpose(-2, -1)  # unscaled, float16: overflows
            return self.o(scores.softmax(-1) @ self.v(x))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(16, 64)
            self.attn = Attention()
            self.head = nn.Linear(64, 1)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.attn(self.embed(x)))

    model = Net().half()
    with torch.no_grad():
        model.embed.weight.mul_(40)
    x = torch.randn(2, 10, 16).half() * 10
    origin = origin_of(lambda: train(model, once(x), lambda out: out.float().mean()))
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "attn", "Attention")
    assert origin.tensor == "args[0] of attn.o"
    assert origin.stats is not None
    assert origin.stats.dtype == "torch.float16"
    # No mask anywhere: the scores' matmul overflowed to +Inf, the softmax made NaN of it.
    assert origin.op == "aten.bmm.default"
    assert origin.source is not None
    assert "scores = self.q(x) @ self.k(x)" in origin.source
    assert origin.hint is not None
    assert "overflowed float16" in origin.hint
    assert "fully masked" not in origin.message


# ------------------------------------------------------------------ robustness
class Flaky(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.fail = False

    def forward(self, x: Tensor) -> Tensor:
        h = self.proj(x)
        if self.fail:
            raise RuntimeError("CUDA out of memory (simulated)")
        return h


class FlakyNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.flaky = Flaky()
        self.log = LogFeatures()
        self.b = nn.Linear(4, 1)
        self.use_log = False

    def forward(self, x: Tensor) -> Tensor:
        h = self.flaky(self.a(x))
        if self.use_log:
            h = self.log(h)
        return self.b(h)


def test_a_forward_that_raises_half_way_does_not_confuse_later_steps() -> None:
    model = FlakyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    failures: list[str] = []

    def run() -> None:
        with nanguard.watch(model, optimizer=opt) as guard:
            for step in range(6):
                model.flaky.fail = step == 2
                model.use_log = step == 4
                try:
                    opt.zero_grad()
                    guard.check_loss(model(torch.randn(4, 4)).pow(2).mean()).backward()
                    opt.step()
                except RuntimeError as err:
                    failures.append(str(err))

    origin = origin_of(run)
    assert failures == ["CUDA out of memory (simulated)"]
    # the step that raised never reached optimizer.step(): it is not counted
    assert (origin.step, origin.phase, origin.module, origin.module_type) == (
        3,
        "forward",
        "log",
        "LogFeatures",
    )
    assert hook_count(model) == 0


def test_keyboard_interrupt_inside_a_forward_removes_every_hook() -> None:
    model = FlakyNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def interrupt(x: Tensor) -> Tensor:
        raise KeyboardInterrupt

    model.flaky.forward = interrupt  # type: ignore[method-assign]
    with pytest.raises(KeyboardInterrupt), nanguard.watch(model, optimizer=opt):
        model(torch.randn(4, 4))
    assert hook_count(model) == 0
    assert len(opt._optimizer_step_pre_hooks) == len(opt._optimizer_step_post_hooks) == 0


@pytest.mark.parametrize("broken", [False, True])
def test_no_activation_is_kept_alive_after_a_step(broken: bool) -> None:
    refs: list[weakref.ref[Tensor]] = []

    class Spy(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            refs.append(weakref.ref(x))
            return torch.log(x - 0.5) if broken else x * 1.0

    model = nn.Sequential(nn.Linear(64, 64), Spy(), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(3):
            opt.zero_grad()
            loss = guard.check_loss(model(torch.randn(32, 64)).pow(2).mean())
            loss.backward()
            opt.step()
            del loss
        gc.collect()
        assert refs
        assert all(r() is None for r in refs)
    assert (guard.origin is not None) == broken


class StatefulNet(nn.Module):
    """BatchNorm (EMA and cumulative), dropout, spectral and weight norm: state a replay
    could disturb. ``trigger`` makes the forward go NaN in the model's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.parametrizations.spectral_norm(nn.Linear(8, 16))
        self.b = nn.utils.parametrizations.weight_norm(nn.Linear(16, 16))
        self.bn = nn.BatchNorm1d(16)
        self.bn_cumulative = nn.BatchNorm1d(16, momentum=None)
        self.old_sn = nn.utils.spectral_norm(nn.Linear(16, 16))
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(16, 1)
        self.trigger = False

    def forward(self, x: Tensor) -> Tensor:
        h = self.drop(self.bn_cumulative(self.bn(self.b(self.a(x)))))
        h = self.old_sn(h)
        if self.trigger:
            h = torch.log(h)
        return self.head(h)


def _stateful_run(guarded: bool) -> tuple[dict[str, Tensor], Tensor, nanguard.Guard | None]:
    torch.manual_seed(0)
    model = StatefulNet()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    guard = nanguard.watch(model, optimizer=opt, on_nonfinite="log") if guarded else None
    for step in range(4):
        model.trigger = step == 2
        opt.zero_grad()
        loss = model(torch.randn(8, 8)).mean()
        if guard is not None:
            guard.check_loss(loss)
        loss.backward()
        opt.step()
    if guard is not None:
        guard.detach()
    return model.state_dict(), torch.get_rng_state(), guard


def test_replays_leave_model_state_and_rng_exactly_as_without_nanguard() -> None:
    plain, plain_rng, _ = _stateful_run(guarded=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guarded, guarded_rng, guard = _stateful_run(guarded=True)
    assert guard is not None
    assert guard.origin is not None
    assert (guard.origin.step, guard.origin.module, guard.origin.tensor) == (
        2,
        "",
        "args[0] of head",
    )
    assert guard.origin.stats is not None  # exact statistics: a replay ran
    assert plain.keys() == guarded.keys()
    for key, value in plain.items():
        assert torch.equal(value, guarded[key]) or torch.allclose(
            value, guarded[key], rtol=0, atol=0, equal_nan=True
        ), key
    assert torch.equal(plain_rng, guarded_rng)


def test_event_log_round_trips_real_events(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(4, 8), AnchorDistance(), nn.Linear(1, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = tmp_path / "events-{rank}.jsonl"
    with (
        warnings.catch_warnings(),
        nanguard.watch(model, optimizer=opt, on_nonfinite="log", log_path=str(path)) as guard,
    ):
        warnings.simplefilter("ignore")
        for step in range(3):
            x = torch.randn(6, 4)
            if step == 0:
                x[1] = x[0]  # backward origin
            if step == 2:
                x[0, 0] = float("inf")  # input origin
            opt.zero_grad()
            guard.check_loss(model(x).mean()).backward()
            opt.step()
    written = tmp_path / "events-0.jsonl"

    def strict(constant: str) -> float:
        raise ValueError(f"non-standard JSON constant {constant}")

    for line in written.read_text().splitlines():
        json.loads(line, parse_constant=strict)
    events = guard.events
    assert {e.phase for e in events if e.is_origin} >= {"backward", "input"}
    assert nanguard.read_events(written) == events


def test_a_failed_attach_leaves_no_hook_on_model_or_optimizer(tmp_path: Path) -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(OSError, match="a_file"):
        nanguard.watch(model, optimizer=opt, log_path=str(blocker / "events.jsonl"))
    assert hook_count(model) == 0
    assert len(opt._optimizer_step_pre_hooks) == len(opt._optimizer_step_post_hooks) == 0
    nanguard.watch(model, optimizer=opt).detach()  # and the model can be watched again


def test_attach_detach_cycles_and_submodule_attach() -> None:
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nanguard.Guard(model, optimizer=opt)
    for _ in range(3):
        guard.attach()
        with pytest.raises(nanguard.AttachError, match="already watched"):
            nanguard.watch(model[0])
        opt.zero_grad()
        guard.check_loss(model(torch.randn(2, 8)).sum()).backward()
        opt.step()
        guard.detach()
    assert hook_count(model) == 0
    assert len(opt._optimizer_step_pre_hooks) == 0
    assert guard.current_step == 3


def test_transformer_lm_with_train_eval_switches_is_quiet() -> None:
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with warnings.catch_warnings(), nanguard.watch(model, optimizer=opt) as guard:
        warnings.simplefilter("ignore", UserWarning)  # torch's mask-type deprecation
        for step in range(6):
            idx = torch.randint(0, 50, (4, 12))
            pad = torch.zeros(4, 12, dtype=torch.bool)
            pad[0, 8:] = True
            opt.zero_grad()
            logits = model(idx, pad)
            guard.check_loss(F.cross_entropy(logits.reshape(-1, 50), idx.reshape(-1))).backward()
            opt.step()
            if step % 2 == 0:
                model.eval()
                with torch.no_grad():
                    model(idx, pad)
                model.train()
    assert guard.events == []


def test_nested_tensor_fast_path_in_evaluation_is_quiet() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(50, 32)
            layer = nn.TransformerEncoderLayer(32, 4, 64, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
            self.head = nn.Linear(32, 50)

        def forward(self, idx: Tensor, pad: Tensor) -> Tensor:
            return self.head(self.encoder(self.embed(idx), src_key_padding_mask=pad))

    model = Encoder().eval()
    with (
        warnings.catch_warnings(),
        nanguard.watch(model) as guard,
        torch.no_grad(),
    ):
        warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
        for _ in range(3):
            pad = torch.zeros(4, 12, dtype=torch.bool)
            pad[0, 6:] = True
            model(torch.randint(0, 50, (4, 12)), pad)
    assert guard.events == []


def test_grad_scaler_float16_training_has_no_origin() -> None:
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    with nanguard.watch(model, optimizer=opt, scaler=scaler) as guard:
        for _ in range(12):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = guard.check_loss(model(torch.randn(32, 16)).float().pow(2).mean())
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert guard.origin is None
    assert all(e.kind == "amp_overflow" for e in guard.events)
    assert not any(e.is_origin for e in guard.events)
    assert guard.current_step == 12
    assert "update" not in scaler.__dict__  # the wrapper is gone


def test_deep_model_origin_and_hooks() -> None:
    layers: list[nn.Module] = []
    for _ in range(300):
        layers += [nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()]
    model = nn.Sequential(*layers, LogFeatures(), nn.Linear(16, 1))
    with torch.no_grad():
        model[-4].bias.fill_(-10.0)  # the last LayerNorm+GELU end below 0: log makes NaN
    origin = origin_of(lambda: train(model, once(torch.randn(4, 16))))
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "900", "LogFeatures")
    assert origin.n_propagated == 2  # the head and the model
    assert hook_count(model) == 0


def test_a_nan_in_the_input_is_counted_exactly() -> None:
    x = torch.randn(6, 8)
    x[2, 3] = float("nan")
    x[4, 1] = math.inf
    origin = origin_of(lambda: train(mlp(), once(x)))
    assert (origin.phase, origin.kind) == ("input", "nan")
    assert origin.stats is not None
    assert (origin.stats.nan_count, origin.stats.posinf_count, origin.stats.numel) == (1, 1, 48)


class ScoreModel(nn.Module):
    """Per-sample input gradients of an energy, taken with torch.func inside the forward."""

    def __init__(self) -> None:
        super().__init__()
        self.energy = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
        self.head = nn.Linear(16, 1)
        self.shift = 0.0  # > 0: sqrt of a negative energy inside the transform

    def forward(self, x: Tensor) -> Tensor:
        from torch.func import functional_call, grad, vmap

        params = dict(self.energy.named_parameters())

        def energy(p: dict[str, Tensor], xi: Tensor) -> Tensor:
            e = functional_call(self.energy, p, (xi,)).squeeze(-1)
            return (e - self.shift).sqrt() if self.shift else e

        return self.head(vmap(grad(energy, argnums=1), in_dims=(None, 0))(params, x))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_torch_func_transforms_inside_the_forward(mode: str) -> None:
    # Hooks run inside vmap/grad on batched tensors: probing those would crash the step's
    # read. What the transform returns is checked outside it.
    torch.manual_seed(0)
    model = ScoreModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        for step in range(3):
            model.shift = 100.0 if step == 2 else 0.0
            loss = guard.check_loss(model(torch.randn(64, 16)).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step < 2:
                assert guard.events == []
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (2, "forward", "")
    assert origin.tensor == "args[0] of head"


def test_an_old_origin_of_another_guard_is_not_blamed_for_a_new_nan_gradient() -> None:
    # A teacher (watched, logged) went NaN once, long ago; now the student's own loss takes
    # sqrt at 0: the NaN gradient at the student's outputs is the student's origin.
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(4, 4), LogFeatures())
    student = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    opt = torch.optim.SGD(student.parameters(), lr=0.01)
    x = torch.randn(16, 4)
    with (
        nanguard.watch(teacher, on_nonfinite="log") as guard_t,
        nanguard.watch(student, optimizer=opt, on_nonfinite="log") as guard_s,
    ):
        with torch.no_grad():
            teacher(x)
        assert guard_t.origin is not None
        for step in range(5):
            out = student(x)
            loss = (out * 0).abs().sqrt().sum() if step == 4 else out.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard_s.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (4, "loss")
    assert "made_by" not in origin.details


def test_a_model_of_the_same_shape_that_is_not_fed_is_not_blamed() -> None:
    # Two unrelated models in one loop, each with its own guard; B's input happens to have
    # A's output shape, and B fails in the same step. A's own NaN gradient stays A's.
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
    b = nn.Sequential(nn.Linear(16, 16), LogFeatures(), nn.Linear(16, 1))
    opt_a = torch.optim.SGD(a.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.01)
    with (
        nanguard.watch(a, optimizer=opt_a, on_nonfinite="log") as guard_a,
        nanguard.watch(b, optimizer=opt_b, on_nonfinite="log"),
    ):
        out_b = b(torch.randn(32, 16))
        (a(torch.randn(32, 16)) * 0).abs().sqrt().sum().backward()  # A's own NaN gradient
        out_b.sum().backward()
        opt_a.step()
        opt_b.step()
    origin = guard_a.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert "made_by" not in origin.details


def test_a_deep_unwatched_branch_beside_the_fed_output_does_not_hide_it() -> None:
    # Guard A's output h and a deep unwatched branch are concatenated into guard B's input;
    # B's backward makes the NaN gradient that reaches A. The search from B's input to h
    # must not get lost in the branch.
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    b = nn.Sequential(nn.Linear(16, 4), PairwiseDistances(), nn.Linear(4, 1))  # sqrt at 0
    deep = nn.Sequential(*[nn.Linear(8, 8) for _ in range(200)])  # not watched
    opt = torch.optim.SGD([*a.parameters(), *b.parameters(), *deep.parameters()], lr=0.0)
    x = torch.randn(4, 8)
    with (
        nanguard.watch(a, optimizer=opt, on_nonfinite="log") as guard_a,
        nanguard.watch(b, optimizer=opt, on_nonfinite="log"),
    ):
        b(torch.cat([a(x), deep(x)], dim=-1)).sum().backward()
        opt.step()
    assert any(e.phase == "loss" for e in guard_a.events)  # a NaN gradient did reach A
    assert not any(e.is_origin for e in guard_a.events)
