"""Review of training-loop shapes: an Inf a parent's own code made and a child absorbed,
and ``skip_step`` when the loop ends its steps with ``guard.step()``."""

from __future__ import annotations

import copy
import logging
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard

MODES = ("full", "sentinel")


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("nanguard").setLevel(logging.CRITICAL)


class RowNormalised(nn.Module):
    """Divides by each sample's total mass: a blank sample makes x/0 = Inf, which the
    tanh absorbs (tanh(Inf) = 1); the division's backward then makes 0/0 = NaN."""

    def __init__(self, positive: bool = False) -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 8)
        self.act = nn.Tanh()
        self.l2 = nn.Linear(8, 4)
        self.positive = positive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.l1(x)
        if self.positive:
            h = h.abs() + 0.1
        h = h / x.abs().sum(-1, keepdim=True)
        return self.l2(self.act(h))


class LogCounts(nn.Module):
    """log of a scaled count that is 0 for one sample: -Inf, which a sigmoid gate absorbs;
    the log's backward makes 0/0 in the learnable scale's gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(6))
        self.gate = nn.Sigmoid()
        self.head = nn.Linear(6, 1)

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(torch.log(counts * self.scale)))


def _origin(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str) -> nanguard.Event:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        opt.zero_grad()
        guard.check_loss(F.mse_loss(model(x), y)).backward()
        opt.step()
    assert guard.origin is not None
    return guard.origin


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("positive", [False, True], ids=["mixed-signs", "positive"])
def test_an_inf_made_by_own_code_and_absorbed_is_the_forward_origin(
    mode: str, positive: bool
) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    x[3] = 0
    origin = _origin(RowNormalised(positive), x, y, mode)
    assert (origin.phase, origin.module, origin.kind) == ("forward", "", "inf")
    assert origin.tensor == "args[0] of act"
    assert origin.op == "aten.div.Tensor"
    assert "h = h / x.abs().sum(-1, keepdim=True)" in (origin.source or "")
    assert "divided by zero" in (origin.hint or "")
    assert "although the forward was finite" not in origin.message


@pytest.mark.parametrize("mode", MODES)
def test_a_log_of_zero_in_own_code_absorbed_by_a_gate_is_the_forward_origin(mode: str) -> None:
    torch.manual_seed(0)
    counts = torch.rand(8, 6) * 5 + 1
    counts[2, 4] = 0.0
    origin = _origin(LogCounts(), counts, torch.randn(8, 1), mode)
    assert (origin.phase, origin.module, origin.kind) == ("forward", "", "inf")
    assert origin.tensor == "args[0] of gate"
    assert origin.op == "aten.log.default"
    assert origin.stats is not None
    assert origin.stats.inf_count == 1


@pytest.mark.parametrize("mode", MODES)
def test_skip_step_without_optimizer_drops_the_step_at_guard_step(mode: str) -> None:
    """The README's loop without ``optimizer=``: ``guard.step()`` before ``opt.step()``. A
    corrupt sample at step 2 must leave the weights, Adam's state and the BatchNorm running
    statistics exactly as an unguarded run that drops that step by hand."""

    def run(guarded: bool) -> tuple[nn.Module, torch.optim.Optimizer, list[nanguard.Event]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        batches = [(torch.randn(16, 8), torch.randn(16, 4)) for _ in range(5)]
        batches[2][0][3, 1] = float("nan")
        guard = nanguard.Guard(model, on_nonfinite="skip_step", mode=mode)
        if guarded:
            guard.attach()
        try:
            for step, (x, y) in enumerate(batches):
                if not guarded and step == 2:
                    continue  # the step dropped by hand
                loss = F.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                if guarded:
                    guard.step()
                opt.step()
        finally:
            if guarded:
                guard.detach()
        return model, opt, guard.events

    model, opt, events = run(True)
    reference, ref_opt, _ = run(False)
    origin = next(e for e in events if e.is_origin)
    assert (origin.step, origin.phase, origin.module) == (2, "input", "")
    skipped = [e for e in events if e.details.get("skipped")]
    assert [e.step for e in skipped] == [2]
    assert "dropped at guard.step()" in skipped[0].message
    assert skipped[0].details["restored"] == ["1.running_mean", "1.running_var"]
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    assert all(s["step"] == 4 for s in opt.state_dict()["state"].values())
    assert str(opt.state_dict()) == str(ref_opt.state_dict())


class Block(nn.Module):
    """A projection plus a per-row spread made in the block's own code: a constant row makes
    SqrtBackward divide by 0 in the gradient of ``x``, which the projection also reads."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + torch.sqrt(x.var(-1, keepdim=True))


class BlockNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(8, 8, bias=False)
        self.block = Block()
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.pre(x)))


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_nan_of_a_parents_own_code_is_not_blamed_on_the_child_sharing_its_input(
    mode: str,
) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    x[3] = 0.0  # a blank sample: a constant row after the bias-free projection
    origin = _origin(BlockNet(), x, y, mode)
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "block", "Block")
    assert origin.details["reason"] == "own_code_backward"
    assert origin.op == "aten.div.Tensor in SqrtBackward0"
    assert "torch.sqrt(x.var(-1, keepdim=True))" in (origin.source or "")
    assert "in the own code of `block` (Block.forward)" in origin.message
    assert "Linear.forward" not in origin.message


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as davda54/sam writes it: first_step perturbs the
    weights along the gradient, second_step puts them back and steps the base optimizer."""

    eps = 1e-12

    def __init__(self, params: Any, base: type[torch.optim.Optimizer], **kw: Any) -> None:
        super().__init__(params, {"rho": 0.05, **kw})
        self.base_optimizer = base(self.param_groups, **kw)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([g.norm(2) for g in grads]), 2)
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.data.clone()
                    p.add_(p.grad * group["rho"] / (norm + self.eps))
        self.zero_grad()

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()
        self.zero_grad()

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.first_step()
        with torch.enable_grad():
            closure()
        self.second_step()


class Spread(nn.Module):
    """The spread of the scaled features: sqrt at 0 (a constant row) in the backward."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
        self.head = nn.Linear(5, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.gain
        spread = torch.sqrt(((y - y.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True))
        return self.head(torch.cat([x, spread], -1))


def test_weights_sam_perturbed_and_put_back_are_named_when_a_replay_does_not_reproduce() -> None:
    """The first backward's NaN makes first_step write NaN weights; the second forward goes
    NaN; second_step puts finite weights back before the step ends, so the replay is finite:
    the message must name that possibility, not only a hardware fault."""
    torch.manual_seed(0)
    model = Spread()
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05)
    x, y = torch.randn(16, 4), torch.randn(16, 4)
    x[3] = 0.0
    with nanguard.watch(model, optimizer=opt.base_optimizer, on_nonfinite="log") as guard:
        guard.check_loss(F.mse_loss(model(x), y)).backward()
        opt.first_step()
        guard.check_loss(F.mse_loss(model(x), y)).backward()
        opt.second_step()
    origin = guard.origin
    assert origin is not None
    assert origin.reproducible is False
    assert "SAM's first_step perturbs them, second_step puts them back" in origin.message


def _sam_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(16, 4, generator=g), torch.randn(16, 4, generator=g)) for _ in range(6)]
    batches[3][0][2, 1] = float("nan")  # a corrupt sample at iteration 3
    return batches


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("loop", ["first_second", "closure"])
def test_skip_step_with_sam_passed_as_optimizer_acts_at_the_base_optimizers_step(
    mode: str, loop: str
) -> None:
    """SAM's own step() never runs in its canonical loop (first_step, second_step by hand),
    and its step(closure) stacks the gradients' norms: the base optimizer it wraps is the
    one whose step ends the training step, so the corrupt iteration is named and dropped."""
    torch.manual_seed(0)
    model = Spread()
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="skip_step") as guard:
        for x, y in _sam_batches():
            guard.check_loss(F.mse_loss(model(x), y)).backward()
            if loop == "closure":
                opt.step(lambda x=x, y=y: F.mse_loss(model(x), y).backward())
            else:
                opt.first_step()
                F.mse_loss(model(x), y).backward()
                opt.second_step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (3, "input", "")
    assert [e.step for e in guard.events if e.details.get("skipped")] == [3]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert guard.current_step == 6


class ScaleNorm(nn.Module):
    """Divides by the spread of the previous batch, then keeps this batch's: a feature that
    was constant in one batch divides the next one by 0."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x / self.scale
        if self.training:
            with torch.no_grad():
                self.scale.copy_(x.std(0))
        return y


class NormalisedPolicy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.obs_norm = ScaleNorm(6)
        self.net = nn.Sequential(nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 4))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.net(self.obs_norm(obs))


@pytest.mark.parametrize("mode", MODES)
def test_a_replay_reads_the_running_statistics_the_forward_read_not_those_it_left(
    mode: str,
) -> None:
    """The failing forward divided by the statistics it found (0, from the batch before),
    then replaced them: a replay with what it left would be finite (not reproducible)."""
    torch.manual_seed(0)
    model = NormalisedPolicy()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(6):
            obs = torch.randn(32, 6, generator=g)
            if step == 3:
                obs[:, 2] = 1.5  # a sensor stuck for one batch: its spread is 0
            loss = guard.check_loss(F.cross_entropy(model(obs), torch.randint(0, 4, (32,))))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if guard.origin is not None:
                break
        scale_after = model.obs_norm.scale.clone()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.module, origin.kind) == (4, "obs_norm", "inf")
    assert origin.reproducible is True
    assert origin.op == "aten.div.Tensor"
    assert "y = x / self.scale" in (origin.source or "")
    assert origin.stats is not None
    assert origin.stats.inf_count == 32
    assert torch.equal(model.obs_norm.scale, scale_after)  # the replay put it back
    assert bool((scale_after > 0).all())  # as step 4 left it


class Tagger(nn.Module):
    """A multi-label tagger computing its loss in forward, with a ``pos_weight`` buffer made
    from class counts: a class with no positive example gets +inf."""

    def __init__(self, pos_weight: torch.Tensor) -> None:
        super().__init__()
        self.cls = nn.Linear(8, 5)
        self.register_buffer("pos_weight", pos_weight)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.cls(x)
        return F.binary_cross_entropy_with_logits(logits, labels, pos_weight=self.pos_weight)


@pytest.mark.parametrize("mode", MODES)
def test_a_buffer_non_finite_from_the_start_is_called_a_buffer_not_corrupted_weights(
    mode: str,
) -> None:
    torch.manual_seed(0)
    labels = (torch.rand(200, 5) < 0.3).float()
    labels[:, 4] = 0  # a rare class with no positive in the training set
    positives = labels.sum(0)
    model = Tagger((len(labels) - positives) / positives)  # +inf for class 4
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = model(torch.randn(16, 8), labels[:16])
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.op == "aten.binary_cross_entropy_with_logits.default"
    assert origin.details["nonfinite_params"] == ["pos_weight"]
    assert "Its own buffers are not finite (`pos_weight`)" in origin.message
    assert "optimizer step" not in (origin.hint or "")
    assert "count of 0" in (origin.hint or "")


def _attention(q: torch.Tensor) -> torch.Tensor:
    """A helper outside any forward, as model files write them."""
    return torch.sqrt(q.var(-1, keepdim=True))


class HelperBlock(Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) + _attention(x)


class HelperNet(BlockNet):
    def __init__(self) -> None:
        super().__init__()
        self.block = HelperBlock()


@pytest.mark.parametrize("mode", MODES)
def test_a_backward_nan_of_a_helper_the_parent_calls_is_the_parents(mode: str) -> None:
    torch.manual_seed(0)
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    x[3] = 0.0
    origin = _origin(HelperNet(), x, y, mode)
    assert (origin.phase, origin.module) == ("backward", "block")
    assert origin.details["reason"] == "own_code_backward"
    assert "torch.sqrt(q.var(-1, keepdim=True))" in (origin.source or "")


class ScaledHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.out = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 1)
        with torch.no_grad():
            self.fc2.weight.fill_(30.0)
            self.out.weight.fill_(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.fc1(x))
        h = self.fc2(h * 1e-3)
        return self.out(h)


@pytest.mark.parametrize("mode", MODES)
def test_a_torch_modules_own_backward_overflow_stays_the_modules(mode: str) -> None:
    """fp16 input gradient g @ W of an nn.Linear past 65504: its node was created in
    Linear.forward (torch's code), called from the parent's line: still the Linear's."""
    torch.manual_seed(0)
    model = ScaledHead().half()
    x = torch.randn(32, 64).half()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode, grad_norm=False) as g:
        loss = g.check_loss(model(x).float().mean() * 60000)  # a loss scale, as GradScaler's
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = g.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == ("backward", "fc2", "grad of args[0]")
    assert origin.op == "aten.mm.default in AddmmBackward0"


class Attend(nn.Module):
    def forward(self, scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.softmax(scores, -1) @ v


class CausalBlock(nn.Module):
    """A causal -inf mask kept as a buffer, added to the scores in the block's code and
    absorbed by a custom attention child; independently, a distance between two identical
    tokens takes sqrt at 0, whose backward makes NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)
        self.att = Attend()
        self.register_buffer("causal", torch.triu(torch.full((8, 8), float("-inf")), 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / 4 + self.causal
        y = self.att(scores, self.v(x))
        e = self.v(x)
        return y * torch.sqrt(((e[:, :1] - e[:, 1:2]) ** 2).sum(-1, keepdim=True))


@pytest.mark.parametrize("mode", MODES)
def test_a_mask_absorbed_by_a_child_is_not_taken_for_an_unrelated_backward_nan(mode: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16)
    x[:, 1] = x[:, 0]  # two identical tokens: a distance of 0
    model = CausalBlock()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        loss = guard.check_loss(model(x).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("backward", "", "nan")
    assert origin.details["reason"] == "own_code_backward"
    assert origin.op == "aten.div.Tensor in SqrtBackward0"


class ScaledLog(nn.Module):
    """A fixed per-feature scale kept as a buffer, saved by the multiplication for the
    backward; log of negative values makes NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(8, 8), nn.Linear(8, 1)
        self.register_buffer("scale", torch.rand(8) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.log(self.fc(x) * self.scale))


@pytest.mark.parametrize(
    ("how", "options"),
    [
        ("check", {"on_nonfinite": "log"}),
        ("check", {"on_nonfinite": "log", "mode": "sentinel"}),
        ("no_grad forward", {"on_nonfinite": "log"}),
        ("sync", {"on_nonfinite": "log", "sync": "module"}),
    ],
)
def test_a_replay_before_the_backward_leaves_the_saved_buffers_usable(
    how: str, options: dict[str, Any]
) -> None:
    """A replay while a training graph that saved a buffer waits for its backward: the
    buffers are not written, so that backward still runs (it raised "modified by an
    inplace operation")."""
    torch.manual_seed(0)
    model = ScaledLog()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    version = model.scale._version
    with nanguard.watch(model, optimizer=opt, **options) as guard:
        loss = model(torch.randn(4, 8)).mean()
        if how == "check":
            guard.check()
        elif how == "no_grad forward":
            with torch.no_grad():
                model(torch.randn(4, 8))
        opt.zero_grad()
        loss.backward()  # (raised before)
        opt.step()
    assert guard.origin is not None
    assert guard.origin.module == ""
    assert guard.origin.op == "aten.log.default"
    assert model.scale._version == version


@pytest.mark.filterwarnings("ignore::nanguard.NonFiniteWarning")
def test_a_gradscaler_collapsing_past_its_floor_is_localised_after_the_skips_warning() -> None:
    """A Bernoulli decoder whose float16 sigmoid saturates to exactly 0: BCE's backward is
    0/0 at every step, whatever the scale. The warning after 10 skips comes at scale 64;
    when the scale reaches the floor (1.0), the step is localised and raised."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 784), nn.Sigmoid())
    with torch.no_grad():
        model[2].bias.fill_(-25.0)  # confident background: float16 sigmoid is exactly 0
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x, y = torch.randn(32, 16), torch.zeros(32, 784)
    y[:, :100] = 1.0
    raised: nanguard.NonFiniteError | None = None
    with nanguard.watch(model, optimizer=opt, scaler=scaler) as guard:
        for _ in range(25):
            with torch.autocast("cpu", dtype=torch.float16):
                p = model(x)
            loss = guard.check_loss(F.binary_cross_entropy(p, y.half()))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            try:
                scaler.update()
            except nanguard.NonFiniteError as error:
                raised = error
                break
    assert raised is not None
    assert scaler.get_scale() <= 1.0
    assert raised.event.is_origin


class RunningMeanNorm(nn.Module):
    """An observation normaliser: subtracts the running mean, then updates it in place."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x - self.mean
        if self.training:
            with torch.no_grad():
                self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return y


@pytest.mark.parametrize("mode", MODES)
def test_skip_step_puts_back_a_normalisers_statistics_a_nan_observation_reached(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(RunningMeanNorm(6), nn.Linear(6, 32), nn.Tanh(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(0)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="skip_step") as guard:
        for step in range(8):
            obs = torch.randn(16, 6, generator=g)
            if step == 3:
                obs[5, 2] = float("nan")  # one corrupt observation
            loss = F.mse_loss(model(obs), torch.zeros(16, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    skipped = [e for e in guard.events if e.details.get("skipped")]
    assert [e.step for e in skipped] == [3]  # the later steps train again
    assert "0.mean" in skipped[0].details["restored"]
    assert bool(torch.isfinite(model[0].mean).all())
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_step_at_a_guard_step_after_the_optimizers_step_says_it_is_too_late() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, on_nonfinite="skip_step") as guard:
        for step in range(3):
            x = torch.randn(16, 8)
            if step == 1:
                x[3, 1] = float("nan")
            opt.zero_grad()
            F.mse_loss(model(x), torch.randn(16, 4)).backward()
            opt.step()
            if step == 1:
                with pytest.warns(RuntimeWarning, match="too late to skip it"):
                    guard.step()
            else:
                guard.step()
    assert not [e for e in guard.events if e.details.get("skipped")]  # nothing claimed
    assert guard.origin is not None
    assert guard.origin.phase == "input"


def test_a_failure_after_reloading_a_good_checkpoint_is_a_new_origin() -> None:
    # Step 2's NaN batch made the weights NaN; the loop reloaded its last good checkpoint
    # at step 4. At step 11 its own max-norm write divides a zeroed row, 0/0: a new origin,
    # not "downstream of parameters already non-finite (see the origin at step 2)".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), 1e-2)
    ckpt = copy.deepcopy((model.state_dict(), opt.state_dict()))
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(13):
            x, y = torch.randn(32, 8), torch.randn(32, 1)
            if step == 2:
                x[3, 1] = math.nan
            loss = guard.check_loss(nn.functional.mse_loss(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                if step == 11:
                    model[0].weight[5] = 0.0
                model[0].weight.div_(model[0].weight.norm(dim=1, keepdim=True))
            if step % 5 == 4:
                if any(not torch.isfinite(p).all() for p in model.parameters()):
                    model.load_state_dict(ckpt[0])
                    opt.load_state_dict(ckpt[1])
                else:
                    ckpt = copy.deepcopy((model.state_dict(), opt.state_dict()))
    origins = [(e.step, e.phase, e.param) for e in guard.events if e.is_origin]
    assert origins == [(2, "input", None), (11, "param", "0.weight")]
    assert not any("0.bias" in e.message and e.step == 11 for e in guard.events)


class SAMNoEps(SAM):
    """SAM written without the eps of rho / ||g||: a gradient norm of 0 is 0/0."""

    eps = 0.0


def test_sams_first_step_dividing_by_a_zero_gradient_norm_is_named() -> None:
    # A hinge loss the batch already satisfies: every gradient is 0, first_step's scale is
    # 0/0, and the second forward computes with NaN weights (second_step puts back finite
    # ones, so the replay does not make it again).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = SAMNoEps(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(4):
            x = torch.randn(32, 4)
            y = torch.sign(x[:, 0])
            if step == 3:
                with torch.no_grad():
                    y = torch.sign(model(x).squeeze(1))
                    model[2].weight.mul_(100)
                    model[2].bias.mul_(100)  # separable with a large margin
            loss = guard.check_loss(F.relu(1 - y * model(x).squeeze(1)).mean())
            loss.backward()
            opt.first_step()
            guard.check_loss(F.relu(1 - y * model(x).squeeze(1)).mean()).backward()
            opt.second_step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (3, "forward")
    assert origin.hint is not None
    assert "SAM's first_step" in origin.hint
    assert "rho / (grad_norm + 1e-12)" in origin.hint
