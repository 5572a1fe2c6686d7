"""A failing step's replay names the exact operation and the user's source line, and a
hint: the most likely cause, tested on models that really have that cause."""

from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
from realistic import (
    ExpGate,
    Fp16MLP,
    GatedNet,
    LogFeatures,
    MaskedAttention,
    PairwiseDistances,
    fp16_input,
    log_mlp,
    var_model,
)
from torch import nn

import nanguard


def line_of(cls: type, code: str) -> str:
    """``file:line`` of the line of ``cls``'s source that contains ``code``."""
    lines, start = inspect.getsourcelines(cls)
    offset = next(i for i, line in enumerate(lines) if code in line)
    return f"{inspect.getsourcefile(cls)}:{start + offset}"


def step(model: nn.Module, *args: object, loss_fn=None, **options: object) -> nanguard.Guard:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, on_nonfinite="log", optimizer=opt, **options) as guard:
        out = model(*args)
        loss = guard.check_loss((loss_fn or (lambda o: o.float().pow(2).mean()))(out))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return guard


def test_forward_op_and_source_line() -> None:
    guard = step(log_mlp(), torch.randn(16, 784))
    origin = guard.origin
    assert origin is not None
    assert origin.op == "aten.log.default"
    assert origin.source is not None
    assert origin.source.startswith(line_of(LogFeatures, "torch.log(x)") + " in forward:")
    assert origin.source.endswith("return torch.log(x)")
    assert f"It was made by `aten.log.default` at {origin.source}" in origin.message


def test_op_in_a_parents_own_code() -> None:
    guard = step(GatedNet(), torch.randn(32, 16) * 3)
    origin = guard.origin
    assert origin is not None
    assert origin.op == "aten.exp.default"
    assert origin.source is not None
    assert origin.source.startswith(line_of(ExpGate, "gate = torch.exp"))


def test_backward_op_names_the_node_and_the_forward_line() -> None:
    model = nn.Sequential(nn.Linear(8, 4), PairwiseDistances(), nn.Linear(6, 1))
    guard = step(model, torch.randn(6, 8))
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "backward"
    assert origin.op is not None
    assert origin.op.endswith("in SqrtBackward0")
    assert origin.source is not None
    assert origin.source.startswith(line_of(PairwiseDistances, ".sqrt()"))
    assert "created in the forward at" in origin.message


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda: step(log_mlp(), torch.randn(16, 784)), ["log", "clamp"]),
        (
            lambda: step(Fp16MLP().half(), fp16_input(), loss_fn=lambda o: o.float().mean()),
            ["65504"],
        ),
        (lambda: step(GatedNet(), torch.randn(32, 16) * 3), ["88.72"]),
        (lambda: step(var_model(), torch.randn(1, 8)), ["N-1"]),
        (
            lambda: step(
                MaskedAttention(),
                torch.randn(2, 5, 16),
                torch.tensor([[True] * 5, [False] * 5]),
            ),
            ["masked"],
        ),
        (
            lambda: step(nn.Sequential(nn.Linear(8, 4), PairwiseDistances()), torch.randn(6, 8)),
            ["sqrt", "eps"],
        ),
    ],
    ids=["log", "fp16 overflow", "exp overflow", "variance of one", "masked row", "sqrt grad"],
)
def test_hints_on_models_that_have_the_cause(make, expected: list[str]) -> None:
    warns = pytest.warns(UserWarning, match="degrees of freedom")
    with warns if expected == ["N-1"] else contextlib.nullcontext():
        guard = make()
    origin = guard.origin
    assert origin is not None
    assert origin.hint is not None
    for word in expected:
        assert word in origin.hint, origin.hint
    assert f"Likely cause: {origin.hint}" in origin.message


def test_nan_in_the_data_hint() -> None:
    x = torch.randn(8, 784)
    x[3, 3] = float("nan")
    guard = step(log_mlp(), x)
    assert guard.origin is not None
    assert guard.origin.phase == "input"
    assert guard.origin.hint is not None
    assert "data pipeline" in guard.origin.hint


def test_gradient_norm_spike_before_the_nan_hint() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)  # far too high: diverges
    x = torch.randn(256, 16)
    y = x.sum(-1, keepdim=True)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(60):
            loss = guard.check_loss(nn.functional.mse_loss(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if guard.origin is not None:
                break
    spike = next(e for e in guard.events if e.kind == "grad_norm")
    origin = guard.origin
    assert origin is not None
    assert origin.hint is not None
    assert f"step {spike.step}" in origin.hint
    assert "learning rate" in origin.hint


def test_unknown_pattern_says_so() -> None:
    class Odd(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.special.erfcx(-x * 30)  # overflows for large negative arguments

    guard = step(nn.Sequential(nn.Linear(4, 4), Odd()), torch.ones(3, 4) * 10)
    origin = guard.origin
    assert origin is not None
    assert origin.op == "aten.special_erfcx.default"
    assert origin.hint == (
        "nanguard does not recognise this pattern: aten.special_erfcx.default made +Inf "
        "from finite inputs."
    )
    assert "Likely cause" not in origin.message  # no guess: the generic advice instead


def test_an_origin_inside_a_built_in_module_has_no_source_line_rather_than_a_wrong_one() -> None:
    """No user code runs inside nn.Linear: the line around the replay (opt.step()) did not
    make the value and must not be given as its source."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with torch.no_grad():
        model[0].weight.mul_(50)  # weights that grew during training
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        loss = guard.check_loss(model((torch.randn(8, 32) * 5000).half()).float().pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "0", "Linear")
    assert origin.op is not None
    assert "addmm" in origin.op
    assert origin.source is None


class VAE(nn.Module):
    """The reparameterisation trick with exp(0.5 * logvar): it overflows in the model's own
    code, and the noise gives the Inf both signs (a probe's sum reads +Inf + -Inf as NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(8, 4)
        self.logvar = nn.Linear(8, 4)
        self.dec = nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mu, logvar = self.mu(x), self.logvar(x)
        std = torch.exp(0.5 * logvar)
        return self.dec(mu + torch.randn_like(std) * std)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_inf_of_both_signs_is_traced_to_the_op_that_made_it(mode: str) -> None:
    torch.manual_seed(0)
    model = VAE()
    with torch.no_grad():
        model.logvar.bias.fill_(400.0)  # a log-variance that ran away
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "", "inf")
    assert origin.op == "aten.exp.default"
    assert origin.source is not None
    assert "std = torch.exp(0.5 * logvar)" in origin.source
    assert origin.reproducible is True


class NormalizeInPlace(nn.Module):
    """Rows normalised in place by the parent, then an activation and a linear layer: a row
    summing to 0 divides by 0 in the parent's own code."""

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.act = act
        self.l2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        h.div_(h.sum(-1, keepdim=True) * 0)  # a normaliser that is 0: Inf and NaN in place
        return self.l2(self.act(h))


@pytest.mark.parametrize("act", [nn.ReLU(), nn.ReLU(inplace=True), nn.GELU(), nn.Dropout(0.1)])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_in_place_write_in_the_parent_is_its_origin_through_an_activation(
    act: nn.Module, mode: str
) -> None:
    torch.manual_seed(0)
    model = NormalizeInPlace(act)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = guard.check_loss(model(torch.randn(8, 8)).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == ("forward", "", "args[0] of act")
    assert origin.op == "aten.div_.Tensor"


class TimestepEmbedding(nn.Module):
    """A diffusion model's sinusoidal embedding of log(sigma): sigma = 0 gives log = -Inf,
    and sin(-Inf) = NaN a few operations later."""

    def forward(self, sigma: torch.Tensor) -> torch.Tensor:
        c = torch.log(sigma)[:, None] / 4 * torch.arange(1, 5)
        return torch.cat([torch.sin(c), torch.cos(c)], -1)


def test_an_inf_that_a_later_op_turns_into_nan_is_traced_to_the_op_that_made_the_inf() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(TimestepEmbedding(), nn.Linear(8, 1))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(torch.tensor([0.5, 0.0, 0.25])).sum()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "0", "nan")
    assert origin.op == "aten.log.default"
    assert origin.source is not None
    assert "torch.log(sigma)" in origin.source
    assert origin.hint is not None
    assert "log of a value <= 0" in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_fast_weights_from_functional_call_are_not_called_a_loss_bug(mode: str) -> None:
    """MAML-style fast weights that went NaN, passed with torch.func.functional_call: the
    replay can only use the module's own weights, so it cannot make the NaN again; the
    event must say so, not blame the loss or show the replay's finite values."""
    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        fast = dict(model.named_parameters())
        fast["0.weight"] = fast["0.weight"] * float("nan")  # an inner-loop update gone bad
        out = functional_call(model, fast, (torch.randn(8, 4),))
        loss = guard.check_loss(nn.functional.mse_loss(out, torch.randn(8, 1)))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "forward"
    assert origin.module == ("0" if mode == "full" else "")
    assert origin.reproducible is False
    assert origin.stats is None
    assert "functional_call" in origin.message


class EntropyBonus(nn.Module):
    """Logits from max-normalised features (1/0 on an all-zero row, discarded by where),
    then an entropy term whose p * log(p) is 0 * -inf when a probability underflows."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 6) * 3.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.abs().amax(-1, keepdim=True)
        inv = torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale))
        p = torch.softmax(x * inv @ self.w * 40.0, -1)
        return -(p * torch.log(p)).sum(-1)


def test_an_inf_that_was_discarded_is_not_named_for_a_later_nan() -> None:
    torch.manual_seed(0)
    model = EntropyBonus()
    x = torch.randn(4, 16) * 5
    x[1] = 0.0  # a padding row
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(x).sum()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.op == "aten.log.default"  # not the reciprocal whose Inf where() dropped
    assert origin.source is not None
    assert "p * torch.log(p)" in origin.source


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_validation_forward_is_replayed_in_eval_mode(mode: str) -> None:
    # Validation without no_grad(): the forward waits for the next optimizer step, by
    # which time the model is back in train mode. Its NaN comes from BatchNorm's eval path
    # only (a running variance gone negative), so the replay must run in eval mode too.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16, momentum=0.0), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with torch.no_grad():
        model[1].running_var[3] = -1e-5
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        model.eval()
        model(torch.randn(16, 8))  # validation, gradients left on
        model.train()
        loss = model(torch.randn(32, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "1")
    assert origin.reproducible is True
    assert origin.op == "aten.native_batch_norm.default"
    assert all(m.training for m in model.modules())  # the replay put train mode back


class SpectralConv(nn.Module):
    """A Fourier Neural Operator layer: the low modes' product is written into a
    preallocated spectrum by slice assignment, then transformed back."""

    def __init__(self, channels: int = 16, modes: int = 12) -> None:
        super().__init__()
        self.modes = modes
        scale = 1.0 / channels**2
        self.w = nn.Parameter(torch.randn(channels, channels, modes, modes, dtype=torch.cfloat))
        with torch.no_grad():
            self.w.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        m = self.modes
        xf = torch.fft.rfft2(x, norm="ortho")
        out = torch.zeros(b, c, h, w // 2 + 1, dtype=torch.cfloat)
        out[:, :, :m, :m] = torch.einsum("bixy,ioxy->boxy", xf[:, :, :m, :m], self.w)
        return torch.fft.irfft2(out, s=(h, w), norm="ortho")


def test_an_inf_written_into_a_buffer_by_slice_assignment_names_its_maker() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 16, 1), SpectralConv(), nn.Conv2d(16, 1, 1))
    with torch.no_grad():  # weights blown up to float32's edge
        model[1].w.copy_(torch.full_like(model[1].w.real, 3e38).to(torch.cfloat))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(torch.randn(2, 1, 32, 32)).pow(2).mean()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.module == "1"
    assert origin.op == "aten.bmm.default"  # the einsum, not the irfft2 that read the buffer
    assert origin.source is not None
    assert "torch.einsum" in origin.source


class AttentionPool(nn.Module):
    """Attention pooling over a bag of instances (multiple-instance learning), logging the
    attention's entropy: NaN every step (0 * log 0 where the attention is exactly 0), but
    detached and never used. An empty bag divides 0 by 0: that is what the output gets."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.score = nn.Linear(d, 1)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        a = torch.softmax(self.score(h).squeeze(-1) * 500, -1)
        self.attn_entropy = -(a * a.log()).sum(-1).mean().detach()  # for TensorBoard
        a = a * mask
        return (a[..., None] * h).sum(1) / a.sum(-1, keepdim=True)


class BagClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc, self.pool, self.cls = nn.Linear(32, 16), AttentionPool(), nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.cls(self.pool(torch.relu(self.enc(x)), mask))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_operation_named_is_the_one_whose_value_reached_the_output(mode: str) -> None:
    torch.manual_seed(0)
    model = BagClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 20, 32) * 3, torch.randint(0, 2, (8,))
    mask = torch.ones(8, 20)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for bag in (None, 2):  # (the diagnostic alone is harmless: nothing is reported)
            if bag is not None:
                mask[bag] = 0  # every instance of the bag filtered out
            loss = nn.functional.cross_entropy(model(x, mask), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if bag is None:
                assert model.pool.attn_entropy.isnan()
                assert guard.origin is None
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.module, origin.op) == (1, "pool", "aten.div.Tensor")
    assert origin.source is not None
    assert line_of(AttentionPool, "/ a.sum(-1, keepdim=True)") in origin.source
    assert origin.hint is not None
    assert "divided by zero" in origin.hint


def fake_quant(x: torch.Tensor) -> torch.Tensor:
    """Per-token absmax int8 fake quantisation with a straight-through gradient."""
    s = x.abs().amax(-1, keepdim=True) / 127
    codes = (x / s).round().clamp(-128, 127)  # 0/0 on an all-zero row
    return x + (codes * s - x).detach()


class QuantLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = fake_quant(x)
        with torch.no_grad():  # monitoring: the spread of the quantised activations
            p = torch.histc(xq, bins=64, min=-4, max=4).div(xq.numel())
            self.spread = -(p * p.log()).sum()  # NaN (0 * log 0) every step: only logged
        return nn.functional.linear(xq, self.weight, self.bias)


class QuantMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16, padding_idx=0)
        self.fc1, self.out = QuantLinear(16, 64), nn.Linear(64, 100)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.fc1(self.emb(tokens))))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_value_that_reaches_the_output_through_detach_is_still_its_operation(mode: str) -> None:
    # The straight-through estimator's NaN is outside the autograd graph of the output, and
    # so is the logged entropy's (under no_grad): neither is shown to reach the output by
    # the graph, and the division, the first, stays the one named.
    torch.manual_seed(0)
    model = QuantMLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(1, 100, (4, 12))
    tokens[1, 6:] = 0  # padding: all-zero embedding rows
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        logits = model(tokens)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.op == "aten.div.Tensor"
    assert origin.source is not None
    assert "(x / s).round()" in origin.source
