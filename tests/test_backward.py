"""Where the backward pass first makes a non-finite gradient (the forward is finite)."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from realistic import (
    AngleBetween,
    LogProb,
    Orthonormalize,
    PairNet,
    PairwiseDistances,
    SafeExp,
    triplet_loss,
)
from torch import Tensor, nn

import nanguard


def train_step(model: nn.Module, *args: object, loss_fn=None, **options: object):
    """One guarded step with an optimizer; returns the guard."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, on_nonfinite="log", optimizer=opt, **options) as guard:
        out = model(*args)
        loss = (loss_fn or (lambda o: o.float().pow(2).mean()))(out)
        guard.check_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return guard


def backward_origin(guard: nanguard.Guard) -> nanguard.Event:
    origins = [e for e in guard.events if e.is_origin]
    assert len(origins) == 1, [str(e) for e in origins]
    return origins[0]


def test_sqrt_at_zero_in_a_distance_layer() -> None:
    model = nn.Sequential(nn.Linear(8, 4), PairwiseDistances(), nn.Linear(6, 1))
    guard = train_step(model, torch.randn(6, 8))
    origin = backward_origin(guard)
    assert (origin.phase, origin.module, origin.module_type) == (
        "backward",
        "1",
        "PairwiseDistances",
    )
    assert origin.kind == "nan"
    assert origin.tensor == "grad of args[0]"
    assert origin.stats is not None  # replayed with the gradient that reached the model
    assert origin.stats.shape == (6, 4)
    assert origin.stats.nan_count > 0
    assert "the gradient arriving at its output was finite" in origin.message
    assert "the derivative of sqrt is infinite at 0" in origin.message
    assert "acos/asin at +-1" not in origin.message  # (the usual causes: not with a hint)
    # Every forward value was finite; the parameters' gradients only propagated it.
    assert not [e for e in guard.events if e.phase == "forward"]
    grads = [e for e in guard.events if e.phase == "grad"]
    assert grads
    assert all(not e.is_origin for e in grads)
    assert {e.param for e in grads} <= {"0.weight", "0.bias"}


def test_where_with_an_overflowing_unselected_branch() -> None:
    model = nn.Sequential(nn.Linear(8, 16), SafeExp(), nn.Linear(16, 1))
    guard = train_step(model, torch.randn(32, 8) * 3)
    origin = backward_origin(guard)
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "1", "SafeExp")
    assert origin.kind == "nan"


def test_acos_at_one_blames_the_angle_module() -> None:
    class Siamese(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Linear(8, 8)
            self.angle = AngleBetween()

        def forward(self, a: Tensor, b: Tensor) -> Tensor:
            return self.angle(self.encoder(a), self.encoder(b))

    model = Siamese()
    with torch.no_grad():  # an encoder that maps one-hot inputs to one-hot codes
        model.encoder.weight.copy_(torch.eye(8))
        model.encoder.bias.zero_()
    x = torch.eye(8)[:4]
    guard = train_step(model, x, x.clone())  # identical pairs: cos is exactly 1
    origin = backward_origin(guard)
    assert (origin.phase, origin.module, origin.module_type) == (
        "backward",
        "angle",
        "AngleBetween",
    )
    # The encoder, called twice, only propagated it.
    later = [e for e in guard.events if e.phase == "backward" and not e.is_origin]
    assert {e.module for e in later} <= {"encoder", ""}


def test_log_behind_nan_to_num() -> None:
    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.logp = LogProb()

        def forward(self, x: Tensor) -> Tensor:
            return self.logp(torch.softmax(self.fc(x) * 200, dim=-1))  # probabilities hit 0

    guard = train_step(Head(), torch.randn(16, 8))
    origin = backward_origin(guard)
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "logp", "LogProb")


def test_svd_with_repeated_singular_values() -> None:
    model = nn.Sequential(nn.Linear(4, 4, bias=False), Orthonormalize())
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
    guard = train_step(model, torch.eye(4).expand(2, 4, 4).clone())
    origin = backward_origin(guard)
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "1", "Orthonormalize")


def test_gradient_created_in_a_parents_own_code_blames_the_parent() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 8)
            self.out = nn.Linear(8, 1)

        def forward(self, x: Tensor) -> Tensor:
            h = self.inp(x)
            r = (h * h).sqrt()  # |h| via sqrt: its gradient at h = 0 is 0/0
            return self.out(r)

    model = Block()
    with torch.no_grad():
        model.inp.weight[2].zero_()
        model.inp.bias[2] = 0.0  # unit 2 is exactly 0 for every input
    guard = train_step(model, torch.randn(5, 8))
    origin = backward_origin(guard)
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "", "Block")
    assert origin.details["reason"] == "own_code_backward"
    assert origin.tensor == "grad of output of inp"


def test_triplet_loss_backward_is_a_loss_origin() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    x = torch.randn(12, 8)
    x[1] = x[0]  # anchor == positive: distance 0, sqrt'(0) = inf
    guard = train_step(model, x, loss_fn=triplet_loss)
    origin = backward_origin(guard)
    assert (origin.phase, origin.module, origin.kind) == ("loss", None, "nan")
    assert origin.tensor == "grad of output"
    assert origin.stats is not None  # the gradient that reached the model was kept
    assert origin.stats.shape == (12, 8)
    assert "while the loss and the model's outputs were finite" in origin.message
    assert "the loss computation or its backward created it" in origin.message
    assert [e for e in guard.events if e.phase == "loss" and e.tensor == "loss"] == []


def test_an_unchecked_loss_is_not_claimed_finite() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    with torch.no_grad():
        model[2].weight.fill_(30.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        loss = torch.exp(model(torch.randn(16, 4) * 5)).mean()  # +Inf, never checked
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor, origin.kind) == ("loss", "grad of output", "inf")
    assert "the loss itself was not checked" in origin.message
    assert "while the loss and" not in origin.message


def test_input_that_does_not_require_grad_and_in_place_ops() -> None:
    class InPlace(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.dist = PairwiseDistances()

        def forward(self, x: Tensor) -> Tensor:
            h = self.fc(x)
            h.mul_(2.0).add_(1.0)  # in place on a module's output
            return self.dist(torch.relu_(h))

    guard = train_step(InPlace(), torch.randn(5, 8))
    origin = backward_origin(guard)
    assert (origin.module, origin.phase) == ("dist", "backward")


def test_tuple_and_dict_outputs() -> None:
    class Split(nn.Module):
        def forward(self, x: Tensor) -> dict[str, Tensor]:
            return {"dist": (x[:, None] - x[None, :]).pow(2).sum(-1).sqrt(), "x": x}

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.split = Split()

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            out = self.split(self.fc(x))
            return out["dist"].sum(), out["x"]

    guard = train_step(Net(), torch.randn(3, 4), loss_fn=lambda o: o[0] + o[1].sum())
    assert backward_origin(guard).module == "split"


def test_realistic_size_names_the_module_not_the_first_bad_parameter() -> None:
    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(512, 2048)
            self.b = nn.Linear(2048, 2048)
            self.dist = PairwiseDistances()
            self.head = nn.Linear(256, 1)

        def forward(self, x: Tensor) -> Tensor:
            h = self.b(torch.relu(self.a(x)))
            return self.head(self.dist(h[:, :32]))

    guard = train_step(Big(), torch.randn(256, 512))
    origin = backward_origin(guard)
    assert (origin.phase, origin.module) == ("backward", "dist")
    assert origin.stats is not None
    assert origin.stats.shape == (256, 32)
    bad_params = [e.param for e in guard.events if e.phase == "grad"]
    assert "b.weight" in bad_params  # a 4M-element gradient, only propagated
    assert all(not e.is_origin for e in guard.events if e.phase == "grad")


def test_backward_can_be_switched_off() -> None:
    model = nn.Sequential(nn.Linear(8, 4), PairwiseDistances(), nn.Linear(6, 1))
    guard = train_step(model, torch.randn(6, 8), backward=False)
    origin = backward_origin(guard)
    # Without gradient probes only the parameters' gradients are seen.
    assert origin.phase == "grad"
    assert origin.param in ("0.weight", "0.bias")


@pytest.mark.parametrize("reentrant", [False, True])
def test_backward_origin_inside_a_checkpointed_block(reentrant: bool) -> None:
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)
            self.dist = PairwiseDistances()
            self.head = nn.Linear(6, 1)

        def forward(self, x: Tensor) -> Tensor:
            h = checkpoint(lambda t: self.dist(self.fc(t)), x, use_reentrant=reentrant)
            return self.head(h)

    x = torch.randn(6, 8, requires_grad=reentrant)
    guard = train_step(Net(), x)
    origin = backward_origin(guard)
    assert origin.phase == "backward"
    assert origin.module in ("dist", "")  # inside a reentrant checkpoint only the boundary


@pytest.mark.parametrize("options", [{}, {"backward": "probes"}, {"replay": False}])
@pytest.mark.parametrize("bad_micro", [0, 2])
def test_accumulated_micro_batch_backward_origin(options: dict[str, Any], bad_micro: int) -> None:
    torch.manual_seed(0)
    model = PairNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", **options) as guard:
        for micro in range(4):
            x = torch.randn(4, 4)
            if micro == bad_micro:
                x[1] = x[0]  # two identical samples: d/dx sqrt(0) is infinite
            guard.check_loss(model(x).mean()).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type, origin.tensor) == (
        "backward",
        "d",
        "PairDistance",
        "grad of args[0]",
    )


def test_gradients_written_after_autograd_are_not_blamed_on_a_module() -> None:
    """A hook that writes NaN into .grad (what another rank's NaN does through DDP's
    all-reduce): autograd's own gradients were finite, so no module's backward is named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = {"n": 0}

    def poison(param: Tensor) -> None:
        if step["n"] == 1 and param.grad is not None:
            param.grad[0].fill_(float("nan"))

    handles = [p.register_post_accumulate_grad_hook(poison) for p in model.parameters()]
    try:
        with nanguard.watch(model, optimizer=opt, on_nonfinite="raise") as guard:
            for n in range(3):
                step["n"] = n
                loss = guard.check_loss(model(torch.randn(4, 8)).pow(2).mean())
                opt.zero_grad()
                loss.backward()
                if n < 1:
                    opt.step()
                    continue
                with pytest.raises(nanguard.NonFiniteError) as info:
                    opt.step()
                break
    finally:
        for handle in handles:
            handle.remove()
    origin = info.value.event
    assert (origin.step, origin.phase, origin.kind) == (1, "grad", "nan")
    assert origin.is_origin
    assert origin.details["reason"] == "external"
    assert origin.details["bad_parameters"] == 4
    assert "changed after autograd computed them" in origin.message
    assert "register_post_accumulate_grad_hook" in origin.message
    assert not any(e.phase == "backward" for e in guard.events)
    assert all(torch.isfinite(p).all() for p in model.parameters())


class TripletAngles(nn.Module):
    """A shared encoder called three times and the angle module called twice: anchor-positive
    and anchor-negative angles (the positive is a copy of the anchor: acos at exactly 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        self.angle = AngleBetween()

    def forward(self, a: Tensor, p: Tensor, n: Tensor) -> Tensor:
        za = self.enc(a)
        return self.angle(za, self.enc(p)) - self.angle(za, self.enc(n))


def test_a_shared_module_is_not_blamed_for_parameter_gradients_another_call_explains() -> None:
    """enc's third call gets finite gradients first, but enc's parameter gradients sum over
    its calls, and the first two calls got NaN from the angle's backward."""
    torch.manual_seed(0)
    model = TripletAngles()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    a = torch.randn(16, 8)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        loss = guard.check_loss(model(a, a.clone(), torch.randn(16, 8)).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.call) == ("backward", "angle", 0)
    assert origin.op is not None
    assert "AcosBackward0" in origin.op


class SignedSqrt(nn.Module):
    """sqrt for positive inputs only, the rest passed through: the forward is finite, but
    sqrt of the negative inputs is still computed (NaN) and its gradient is taken."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.where(x > 0, torch.sqrt(x), x)


def test_a_nan_hidden_by_where_in_the_forward_is_named_in_the_backward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), SignedSqrt(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        loss = guard.check_loss(model(torch.randn(16, 4)).pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "1", "SignedSqrt")
    assert origin.op is not None
    assert "SqrtBackward0" in origin.op
    assert origin.source is not None
    assert "torch.where(x > 0, torch.sqrt(x), x)" in origin.source
    assert origin.hint is not None
    assert "unselected branch of torch.where" in origin.hint


class NewGELU(nn.Module):
    """GPT-2's tanh approximation of GELU (Hugging Face's ``gelu_new``)."""

    def forward(self, x: Tensor) -> Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


def test_a_float16_overflow_in_a_derivative_gets_the_overflow_hint() -> None:
    """GPT-2 run in float16 with activations of a few hundred: x ** 3 overflows to Inf,
    tanh hides it in the forward, and the backward's 3 x ** 2 overflows too (then 0 * inf)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), NewGELU(), nn.Linear(32, 1)).half()
    with torch.no_grad():
        model[0].weight.mul_(200)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        loss = guard.check_loss(model(torch.randn(8, 16).half()).float().mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "1", "NewGELU")
    assert origin.op is not None
    assert "PowBackward0" in origin.op
    assert origin.hint is not None
    assert "overflowed float16" in origin.hint


class RadiusDecoder(nn.Module):
    """A DeepSDF-style decoder fed latent codes trained outside it: sqrt of |z|^2 at a
    zero code has a finite forward and a NaN gradient for the input only."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, z: Tensor) -> Tensor:
        radius = z.pow(2).sum(-1, keepdim=True).sqrt()
        return self.net(torch.cat([z, radius], -1))


def test_a_nan_gradient_for_trainable_inputs_is_reported_though_parameters_are_finite() -> None:
    torch.manual_seed(0)
    decoder = RadiusDecoder()
    codes = nn.Embedding(4, 8)  # outside the watched model, same optimizer
    with torch.no_grad():
        codes.weight[2].zero_()
    opt = torch.optim.SGD([*decoder.parameters(), *codes.parameters()], lr=0.1)
    with nanguard.watch(decoder, optimizer=opt) as guard:
        loss = guard.check_loss((decoder(codes(torch.arange(4))).squeeze(-1) - 1).pow(2).mean())
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (0, "backward")
    assert codes.weight.isfinite().all()  # raised before the update


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_clipping_by_a_nan_norm_does_not_move_the_backward_origin(mode: str) -> None:
    # clip_grad_norm_ multiplies every gradient by max_norm / total_norm: with one NaN
    # gradient, all of them are NaN by the optimizer step, the head's included. The head's
    # backward made finite gradients; the distance's sqrt at 0 made the NaN.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), PairwiseDistances(), nn.Linear(6, 16), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        guard.check_loss(model(torch.randn(6, 8)).pow(2).mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert not torch.isfinite(model[3].weight.grad).all()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "1")
    assert origin.op is not None
    assert "SqrtBackward0" in origin.op


class GainedCheckpoint(nn.Module):
    """A reentrant checkpoint around a distance layer (sqrt at 0 in its backward), and a
    learnable gain that lives outside the model."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 4)
        self.dist = PairwiseDistances()
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor, gain: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(lambda t: self.dist(self.fc(t)), x, use_reentrant=True)
        return self.head(h * gain)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_replay_under_reentrant_checkpointing_leaves_outside_gradients_alone(mode: str) -> None:
    torch.manual_seed(0)
    model = GainedCheckpoint()
    gain = torch.ones(1, requires_grad=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        model(torch.randn(6, 8, requires_grad=True), gain).sum().backward()
        before = gain.grad.clone()
        opt.step()  # resolves the step, replays included
    assert torch.equal(gain.grad, before)
    # The replay cannot see inside the checkpoint: no claim that .grad was changed later.
    assert guard.origin is not None
    assert not any("changed after autograd" in e.message for e in guard.events)


class CheckpointedBlocks(nn.Module):
    """Reentrant-checkpointed blocks (the input of each needs grad), one with a distance
    whose sqrt at 0 makes the backward NaN; a head outside the checkpoints."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 6)
        self.block = nn.Sequential(nn.Linear(6, 4), PairwiseDistances())
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        return self.head(checkpoint(self.block, self.emb(x), use_reentrant=True))


def test_a_nan_clip_behind_reentrant_checkpoints_names_no_module_from_grad_alone() -> None:
    torch.manual_seed(0)
    model = CheckpointedBlocks()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        model(torch.randn(6, 4, requires_grad=True)).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # NaN into every .grad
        opt.step()
    origin = guard.origin
    assert origin is not None
    # Clipping put NaN in every .grad (the head's too): no module is named from its .grad.
    # The probe of the input's gradient saw the model's backward make it; the checkpoint
    # hides which of its modules did, and the message says why.
    assert (origin.phase, origin.module) == ("backward", "")
    assert not any(e.phase == "backward" and e.is_origin and e.module for e in guard.events)
    assert "use_reentrant=False" in origin.message
    assert any(
        "clip_grad_norm_ scaled every gradient by max_norm / NaN" in e.message for e in guard.events
    )


class HandRMSNorm(nn.Module):
    """RMS norm written by hand, the eps outside the sqrt: a zeroed (padded) row has a
    finite forward, and sqrt's backward at 0 is inf * 0 = NaN."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return self.g * x / torch.sqrt((x * x).mean(-1, keepdim=True)).clamp_min(1e-6)


class SelfCheckpointedBlock(nn.Module):
    """A block that checkpoints its own body, as Hugging Face and timm blocks do."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = HandRMSNorm(d)
        self.ff = nn.Linear(d, d)

    def _body(self, x: Tensor) -> Tensor:
        return x + self.ff(self.norm(x))

    def forward(self, x: Tensor) -> Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self._body, x, use_reentrant=True)  # type: ignore[no-any-return]


class PaddedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.blocks = nn.ModuleList(SelfCheckpointedBlock(16) for _ in range(2))
        self.head = nn.Linear(16, 20)

    def forward(self, x: Tensor) -> Tensor:
        h = self.emb(x) * (x != 0).unsqueeze(-1)  # padded positions zeroed
        for block in self.blocks:
            h = block(h)
        return self.head(h)


@pytest.mark.parametrize("backward", [True, "probes"])
def test_a_nan_made_inside_a_reentrant_checkpoint_does_not_blame_the_embedding(
    backward: bool | str,
) -> None:
    # Only the embedding's gradient is NaN (the padded rows): it received the NaN the
    # norm's backward made inside the checkpoint. Not "custom autograd Functions and
    # gradient hooks that write to .grad": the way to the module is told instead.
    torch.manual_seed(0)
    model = PaddedLM()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randint(1, 20, (2, 6))
    x[1, 4:] = 0
    with nanguard.watch(model, optimizer=opt, backward=backward, on_nonfinite="log") as guard:  # type: ignore[arg-type]
        loss = guard.check_loss(
            nn.functional.cross_entropy(model(x).flatten(0, 1), torch.randint(0, 20, (12,)))
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    if backward == "probes":
        assert (origin.phase, origin.module) == ("backward", "blocks.0")
    else:
        assert (origin.phase, origin.param) == ("grad", "emb.weight")
        assert "Check custom autograd Functions" not in origin.message
        assert 'watch with backward="probes"' in origin.message
        assert "use_reentrant=False" in origin.message


class ScheduledMaskNet(nn.Module):
    """Its pre-hook draws the next feature mask of a schedule (DropEdge/DropPath style); a
    row the mask zeroes has a norm of 0, where sqrt's slope is infinite."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.keep = torch.ones(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x) * self.keep
        return torch.sqrt((h**2).sum(-1))


def test_a_pre_hook_with_side_effects_is_named_when_the_replay_finds_the_backward_finite() -> None:
    torch.manual_seed(0)
    model = ScheduledMaskNet()
    masks = [torch.ones(4, 4) for _ in range(10)]
    masks[2][1] = 0.0  # step 2 drops every feature of sample 1; the replay draws mask 3
    schedule = iter(masks)
    model.register_forward_pre_hook(lambda m, args: setattr(m, "keep", next(schedule)))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(3):
            loss = guard.check_loss(model(torch.randn(4, 4)).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    # The replay drew another mask: its backward was finite, and nanguard cannot tell the
    # step's NaN gradients from a .grad written after; it says what else may be the reason.
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.details["reason"]) == (2, "grad", "external")
    assert "The replay ran the forward pre-hooks of the model (<lambda>) again" in origin.message
    assert 'backward="probes" checks the step itself' in origin.message
