"""Speech, time-series, tabular and graph models with their real NaN causes: what
nanguard reports about each (found by testing real model code)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import nanguard


def line_of(cls: type, code: str) -> str:
    """``file:line`` of the line of ``cls``'s source that contains ``code``."""
    lines, start = inspect.getsourcelines(cls)
    offset = next(i for i, line in enumerate(lines) if code in line)
    return f"{inspect.getsourcefile(cls)}:{start + offset}"


def guarded_step(
    model: nn.Module, opt: torch.optim.Optimizer, loss: Callable[[], Tensor], **options: Any
) -> nanguard.Guard:
    """One training step under a logging guard: ``loss()`` (checked), backward, step."""
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", **options) as guard:
        value = guard.check_loss(loss())
        opt.zero_grad()
        value.backward()
        opt.step()
    return guard


class MagnitudeFrontend(nn.Module):
    """A learnable spectral front-end: the magnitude sqrt(re^2 + im^2) has no eps, so a
    silent frame (re = im = 0) gives an infinite derivative in the backward."""

    def __init__(self, frame: int = 64, bins: int = 33) -> None:
        super().__init__()
        self.filters = nn.Linear(frame, 2 * bins, bias=False)

    def forward(self, frames: Tensor) -> Tensor:
        re, im = self.filters(frames).chunk(2, dim=-1)
        mag = torch.sqrt(re**2 + im**2)
        return torch.log(mag + 1e-6)


class SpeakerNet(nn.Module):
    """x-vector style: front-end, frame-level layers, mean+std statistics pooling."""

    def __init__(self, bins: int = 33, hidden: int = 64, speakers: int = 20) -> None:
        super().__init__()
        self.frontend = MagnitudeFrontend(bins=bins)
        self.frame = nn.Linear(bins, hidden)
        self.embed = nn.Linear(2 * hidden, 32)
        self.classify = nn.Linear(32, speakers)

    def forward(self, frames: Tensor) -> Tensor:
        x = F.relu(self.frame(self.frontend(frames)))  # (batch, time, hidden)
        stats = torch.cat([x.mean(1), x.std(1)], dim=1)
        return self.classify(F.relu(self.embed(stats)))


def test_an_inf_a_backward_node_masks_itself_is_not_the_origin() -> None:
    """A dead ReLU channel has std 0: StdBackward0 divides by 2 * std and zeroes it itself.
    The Inf that leaves a node is SqrtBackward0's, on the silent frames: that is the op."""
    torch.manual_seed(0)
    model = SpeakerNet()
    with torch.no_grad():  # channel 0 is dead: std over time is 0 for every utterance
        model.frame.weight[0] = -model.frame.weight[0].abs() - 1.0
        model.frame.bias[0] = -10.0
    frames = torch.randn(8, 50, 64)
    frames[2, 10:30] = 0.0  # a silent stretch
    y = torch.randint(0, 20, (8,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = guarded_step(model, opt, lambda: F.cross_entropy(model(frames), y))
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "frontend")
    assert origin.op == "aten.div.Tensor in SqrtBackward0"
    assert origin.source is not None
    assert origin.source.startswith(line_of(MagnitudeFrontend, "mag = torch.sqrt"))
    assert origin.hint is not None
    assert "derivative of sqrt is infinite at 0" in origin.hint


class Forecaster(nn.Module):
    """A GRU over the history, a linear head for the next ``horizon`` values."""

    def __init__(self, horizon: int = 12) -> None:
        super().__init__()
        self.gru = nn.GRU(1, 32, batch_first=True)
        self.head = nn.Linear(32, horizon)

    def forward(self, history: Tensor) -> Tensor:
        out, _ = self.gru(history.unsqueeze(-1))
        return self.head(out[:, -1])


def test_mape_over_zero_targets_is_a_loss_origin_with_the_division_hint() -> None:
    torch.manual_seed(0)
    model = Forecaster()
    history = torch.rand(32, 48) * 100
    target = torch.rand(32, 12) * 100
    target[5, 3:6] = 0.0  # days without sales
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = guarded_step(
        model, opt, lambda: ((target - model(history)).abs() / target.abs()).mean()
    )
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "inf")
    assert origin.hint is not None
    assert "division by zero (MAPE over zero targets" in origin.hint


class DeepFM(nn.Module):
    """Factorization machine over numeric features plus a deep part (DeepFM)."""

    def __init__(self, features: int = 16, k: int = 8) -> None:
        super().__init__()
        self.v = nn.Parameter(torch.randn(features, k) * 0.05)
        self.linear = nn.Linear(features, 1)
        self.deep = nn.Sequential(nn.Linear(features, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: Tensor) -> Tensor:
        xv = x.unsqueeze(-1) * self.v  # (batch, features, k)
        inter = 0.5 * (xv.sum(1) ** 2 - (xv**2).sum(1)).sum(1, keepdim=True)
        return (self.linear(x) + inter + self.deep(x)).squeeze(-1)


def test_float32_overflow_of_an_unscaled_feature_names_the_data() -> None:
    """A raw column around 3e21 (an unnormalised amount): (sum v x) ** 2 overflows
    float32, and inf - inf makes the NaN. The pow is the op, and the hint says overflow
    and points at the input batch, not at an unknown pattern."""
    torch.manual_seed(0)
    model = DeepFM()
    x = torch.randn(256, 16)
    x[7, 3] = 3e21
    y = torch.randint(0, 2, (256,)).float()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = guarded_step(model, opt, lambda: F.binary_cross_entropy_with_logits(model(x), y))
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "", "nan")
    assert origin.op == "aten.pow.Tensor_Scalar"
    assert origin.source is not None
    assert "xv.sum(1) ** 2" in origin.source
    assert origin.hint is not None
    assert "overflowed float32" in origin.hint
    assert "the input batch holds values up to 3.0e+21: an unscaled feature" in origin.hint


class TabularMLP(nn.Module):
    """Categorical embeddings plus BatchNorm'd numeric features, an MLP with BatchNorm."""

    def __init__(self, numeric: int = 14, cards: tuple[int, ...] = (10, 50, 7)) -> None:
        super().__init__()
        self.embs = nn.ModuleList(nn.Embedding(c, 8) for c in cards)
        self.num_bn = nn.BatchNorm1d(numeric)
        self.mlp = nn.Sequential(
            nn.Linear(numeric + 8 * len(cards), 128), nn.BatchNorm1d(128), nn.ReLU(),
            nn.Linear(128, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1),
        )  # fmt: skip

    def forward(self, cats: Tensor, nums: Tensor) -> Tensor:
        embedded = [emb(cats[:, i]) for i, emb in enumerate(self.embs)]
        return self.mlp(torch.cat([*embedded, self.num_bn(nums)], dim=1)).squeeze(-1)


def tabular_batches(n: int, missing_at: int) -> list[tuple[Tensor, Tensor, Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        cats = torch.stack([torch.randint(0, c, (256,), generator=g) for c in (10, 50, 7)], dim=1)
        nums = torch.randn(256, 14, generator=g)
        if i == missing_at:
            nums[torch.rand(256, 14, generator=g) < 0.02] = float("nan")  # missing values
        out.append((cats, nums, torch.randn(256, generator=g)))
    return out


def train_tabular(batches: list[tuple[Tensor, Tensor, Tensor]], **options: object) -> nn.Module:
    torch.manual_seed(0)
    model = TabularMLP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = nanguard.watch(model, optimizer=opt, **options) if options else None
    try:
        for cats, nums, y in batches:
            loss = F.mse_loss(model(cats, nums), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        if guard is not None:
            guard.detach()
            model.guard_events = guard.events  # type: ignore[assignment]
    return model


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_skip_step_puts_back_the_running_statistics_the_bad_batch_made_nan(mode: str) -> None:
    """skip_step drops the step with missing values: its weights stay, and so do the
    BatchNorm statistics its forward overwrote with NaN. Training then matches, bit for bit,
    a run that never saw that batch, and eval() works."""
    batches = tabular_batches(6, missing_at=2)
    guarded = train_tabular(batches, mode=mode, on_nonfinite="skip_step")
    clean = train_tabular(batches[:2] + batches[3:])
    for (name, a), b in zip(guarded.state_dict().items(), clean.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    guarded.eval()
    cats, nums, _ = tabular_batches(1, missing_at=-1)[0]
    assert torch.isfinite(guarded(cats, nums)).all()
    skip = next(e for e in guarded.guard_events if e.details.get("skipped"))  # type: ignore[attr-defined]
    assert skip.step == 2
    assert "num_bn.running_mean" in skip.details["restored"]
    assert "were put back as they were before it: `num_bn.running_mean`" in skip.message


def test_raise_says_the_running_statistics_stay_nan() -> None:
    batches = tabular_batches(3, missing_at=2)
    with pytest.raises(nanguard.NonFiniteError) as raised:
        train_tabular(batches, on_nonfinite="raise")
    message = str(raised.value)
    assert raised.value.event.phase == "input"
    assert "also wrote non-finite values into the running statistics `num_bn.running_mean`" in (
        message
    )
    assert "reset_running_stats()" in message


class TwoDropoutGCN(nn.Module):
    """Kipf's GCN uses one Dropout twice: on the features and on the hidden layer."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(64, 64)
        self.l2 = nn.Linear(64, 10)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor, adj: Tensor) -> Tensor:
        h = adj @ self.l1(self.drop(x))
        h = h / adj.sum(1, keepdim=True)  # mean aggregation: 0/0 for an isolated node
        return adj @ self.l2(self.drop(h))


def test_a_module_called_twice_is_named_by_the_call_that_saw_the_nan() -> None:
    torch.manual_seed(0)
    model = TwoDropoutGCN()
    adj = (torch.rand(50, 50) < 0.1).float()
    adj[7] = 0.0  # an isolated node
    guard = nanguard.watch(model, on_nonfinite="log")
    with guard:
        model(torch.randn(50, 64), adj).sum().backward()
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.op) == ("", "aten.div.Tensor")
    dropped = [e for e in guard.events if e.module == "drop"]
    assert [e.call for e in dropped] == [1]
    assert "drop#1" in " ".join(e.message for e in guard.events)


class SqrtAbs(nn.Module):
    """The 1.5-power activation z * sqrt(|z|): finite everywhere, but autograd's derivative
    at z = 0 is 0 * inf = NaN."""

    def forward(self, z: Tensor) -> Tensor:
        return z * torch.sqrt(torch.abs(z))


class BurgersPINN(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(2, width), SqrtAbs(), nn.Linear(width, width), nn.Tanh(),
            nn.Linear(width, 1),
        )  # fmt: skip
        for m in self.net:
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight)
                nn.init.zeros_(m.bias)

    def forward(self, x: Tensor, t: Tensor) -> Tensor:
        return self.net(torch.cat([x, t], dim=1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_made_in_the_models_backward_inside_autograd_grad_is_a_backward_origin(
    mode: str,
) -> None:
    """A PINN's residual needs u_x = autograd.grad(u, x, create_graph=True): the forward is
    finite, the collocation point (0, 0) with zero biases puts z = 0 into sqrt's derivative,
    and the loss built on u_x is NaN. The origin is that backward, not the loss function."""
    torch.manual_seed(0)
    model = BurgersPINN()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = (torch.rand(500, 1) * 2 - 1).requires_grad_(True)
    t = torch.rand(500, 1).requires_grad_(True)
    with torch.no_grad():
        x[0] = 0.0
        t[0] = 0.0
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        u = model(x, t)
        u_x, u_t = torch.autograd.grad(u.sum(), (x, t), create_graph=True)
        loss = guard.check_loss(((u_t + u * u_x) ** 2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "net.1", "SqrtAbs")
    assert origin.op == "aten.div.Tensor in SqrtBackward0"
    assert origin.source is not None
    assert origin.source.startswith(line_of(SqrtAbs, "return z * torch.sqrt"))
    assert "torch.autograd.grad(..., create_graph=True)" in origin.message
    loss_event = next(e for e in guard.events if e.phase == "loss")
    assert not loss_event.is_origin
    assert not any("created earlier, in the loss" in e.message for e in guard.events)


def test_a_loss_made_through_torch_func_transforms_does_not_call_the_outputs_finite() -> None:
    """A Poisson PINN takes its Laplacian with vmap(hessian(functional_call(...))): those
    forwards run inside torch.func, unchecked. A NaN collocation point makes the loss NaN;
    the message must not claim the model's outputs were finite and blame the loss."""
    from torch.func import functional_call, hessian, vmap

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(2, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    params = dict(model.named_parameters())

    def u(p: dict[str, Tensor], xy: Tensor) -> Tensor:
        return functional_call(model, p, (xy.unsqueeze(0),)).squeeze()

    laplacian = vmap(lambda p, xy: torch.diagonal(hessian(u, argnums=1)(p, xy)).sum(), (None, 0))
    xy = torch.rand(256, 2)
    xy[17, 0] = float("nan")  # a corrupted mesh point
    boundary = torch.rand(64, 2).round()

    def loss() -> Tensor:
        residual = -laplacian(params, xy) - torch.sin(torch.pi * xy[:, 0])
        return (residual**2).mean() + (model(boundary) ** 2).mean()

    guard = guarded_step(model, opt, loss)
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert "unless it came from the model's calls inside torch.func transforms" in (origin.message)
    assert "a NaN input point" in origin.message


class Expert(nn.Module):
    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.gelu(self.up(x)))


class StoredAuxMoE(nn.Module):
    """Top-1 mixture of experts that keeps its load-balancing loss in ``self.aux_loss``
    for the training loop to add (as many implementations do)."""

    def __init__(self, d: int = 64, experts: int = 4) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts)
        self.experts = nn.ModuleList(Expert(d) for _ in range(experts))

    def forward(self, x: Tensor) -> Tensor:
        probs = self.router(x).softmax(-1)
        choice = probs.argmax(-1)
        out = torch.zeros_like(x)
        importance = []
        for e, expert in enumerate(self.experts):
            chosen = choice == e
            out[chosen] = expert(x[chosen]) * probs[chosen, e : e + 1]
            importance.append(probs[chosen, e].mean())  # NaN for an expert with no token
        self.aux_loss = torch.stack(importance).var()
        return out


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_auxiliary_loss_stored_on_a_module_names_that_module(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), StoredAuxMoE(), nn.Linear(64, 10))
    with torch.no_grad():
        model[1].router.bias[3] = -50.0  # a collapsed expert: it gets no token
    x, y = torch.randn(128, 32), torch.randint(0, 10, (128,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    stored = []

    def loss() -> Tensor:
        out = F.cross_entropy(model(x), y)
        stored.append(model[1].aux_loss)
        return out + 0.01 * model[1].aux_loss

    guard = guarded_step(model, opt, loss, mode=mode)
    assert model[1].aux_loss is stored[0]  # (the replay's own is not left behind)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "1", "StoredAuxMoE")
    assert origin.tensor == "self.aux_loss"
    assert "the loss function created it" not in origin.message
    assert "Look at StoredAuxMoE.forward where `aux_loss` is computed" in origin.message
    # The operation that made it, replayed, and its line: the empty expert's mean.
    assert origin.op == "aten.mean.default"
    assert origin.source is not None
    assert "importance.append(probs[chosen, e].mean())" in origin.source
    assert "It was made by `aten.mean.default` at" in origin.message
    assert origin.hint is not None
    assert "averaged over zero elements" in origin.hint
    loss_event = next(e for e in guard.events if e.phase == "loss")
    assert not loss_event.is_origin


class LogBalancedMoE(StoredAuxMoE):
    """Keeps the log of the least used expert's mean routing probability as its balancing
    term: -Inf once a collapsed expert's probability underflows to exactly 0."""

    def forward(self, x: Tensor) -> Tensor:
        out = super().forward(x)
        probs = self.router(x).softmax(-1)
        self.aux_loss = torch.log(probs.mean(0).min())
        return out


def test_a_minus_inf_auxiliary_loss_stored_on_a_module_names_that_module() -> None:
    # (-Inf was left out, for cached -inf masks: a single value is a loss term, not a mask.)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), LogBalancedMoE(), nn.Linear(64, 10))
    with torch.no_grad():
        model[1].router.bias[3] = -200.0  # a collapsed expert: probability exactly 0
    x, y = torch.randn(128, 32), torch.randint(0, 10, (128,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = guarded_step(
        model, opt, lambda: F.cross_entropy(model(x), y) - 0.01 * model[1].aux_loss
    )
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "1", "inf")
    assert origin.tensor == "self.aux_loss"
    assert origin.details["reason"] == "stored"
    assert origin.stats is not None
    assert origin.stats.neginf_count == 1
    assert origin.op == "aten.log.default"
    assert origin.source is not None
    assert "self.aux_loss = torch.log(probs.mean(0).min())" in origin.source


def test_per_sample_gradients_from_torch_func_are_not_blamed_on_the_first_layer() -> None:
    """DP-SGD: per-sample gradients by vmap(grad(functional_call)), clipped by
    C / norm with no eps, written into .grad. A sample whose gradient is 0 (its label is
    ignored) makes 0/0. No backward through the model ran: nanguard says where the
    gradients came from instead of claiming the model's backward was finite."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = {k: v.detach() for k, v in model.named_parameters()}

    def sample_loss(p: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        out = functional_call(model, p, (x.unsqueeze(0),))
        return F.cross_entropy(out, y.unsqueeze(0), ignore_index=-1, reduction="sum")

    x, y = torch.randn(16, 20), torch.randint(0, 5, (16,))
    y[4] = -1  # an ignored sample: its gradient is exactly 0
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        per_sample = vmap(grad(sample_loss), (None, 0, 0))(params, x, y)
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
        scale = 1.0 / norms  # clipping to norm 1, without an eps
        for name, p in model.named_parameters():
            g = per_sample[name] * scale.view(-1, *([1] * (per_sample[name].dim() - 1)))
            p.grad = g.mean(0)
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "grad"
    assert origin.details["reason"] == "external"
    assert "inside torch.func transforms" in origin.message
    assert "crossing the model's boundary were finite" not in origin.message


def test_a_step_of_many_forwards_reports_a_few_events_and_counts_the_rest() -> None:
    """Second-order MAML: 8 tasks x 5 inner forwards through functional_call in one step.
    An inner learning rate that explodes makes every later forward non-finite: the step
    reports its first findings one by one and one summary that counts the rest."""
    from torch.func import functional_call

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1, 40), nn.ReLU(), nn.Linear(40, 40), nn.ReLU(), nn.Linear(40, 1)
    )
    meta_opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    xs, xq = torch.rand(8, 10, 1) * 10 - 5, torch.rand(8, 10, 1) * 10 - 5
    ys, yq = torch.sin(xs), torch.sin(xq)
    with nanguard.watch(model, optimizer=meta_opt, on_nonfinite="log") as guard:
        meta_loss = torch.zeros(())
        for i in range(8):
            params = dict(model.named_parameters())
            for inner in range(5):
                loss = F.mse_loss(functional_call(model, params, (xs[i],)), ys[i])
                grads = torch.autograd.grad(loss, list(params.values()), create_graph=True)
                lr = 0.01 * 10**inner  # a schedule that grows by mistake
                params = {n: p - lr * g for (n, p), g in zip(params.items(), grads, strict=True)}
            meta_loss = meta_loss + F.mse_loss(functional_call(model, params, (xq[i],)), yq[i])
        meta_loss = guard.check_loss(meta_loss / 8)
        meta_opt.zero_grad()
        meta_loss.backward()
        meta_opt.step()
    events = guard.events
    assert guard.origin is not None
    assert sum(e.is_origin for e in events) <= 8
    assert len(events) <= 8 + 16 + 1
    (summary,) = [e for e in events if "by_phase" in e.details]
    assert summary.details["more"] > 0
    assert f"{summary.details['more']} more findings in this step" in summary.message


def test_running_statistics_nan_before_watch_are_not_said_to_become_nan() -> None:
    """A notebook: a raise left NaN running statistics; watching the model again and
    training on clean batches (the running mean stays NaN) says they were so already, not
    that they became NaN."""
    model = TabularMLP()
    with torch.no_grad():
        model.num_bn.running_mean.fill_(float("nan"))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for cats, nums, y in tabular_batches(2, missing_at=-1):
            loss = F.mse_loss(model(cats, nums), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    (event,) = [e for e in guard.events if e.param == "num_bn.running_mean"]
    assert "was already NaN before the first step" in event.message
    assert "became" not in event.message


class EulerODE(nn.Module):
    """dy/dt = f(y), integrated with fixed explicit Euler steps: stiff dynamics (eigenvalue
    -300) with dt = 0.02 multiply the state by -5 every step."""

    def __init__(self, dim: int = 8, steps: int = 30, dt: float = 0.02) -> None:
        super().__init__()
        self.f = nn.Linear(dim, dim)
        with torch.no_grad():
            self.f.weight.copy_(-300.0 * torch.eye(dim))
            self.f.bias.zero_()
        self.steps, self.dt = steps, dt

    def forward(self, y0: Tensor) -> Tensor:
        y = y0
        for _ in range(self.steps):
            y = y + self.dt * self.f(y)
        return y


def test_a_loss_of_huge_outputs_gives_their_magnitude() -> None:
    torch.manual_seed(0)
    model = EulerODE()
    y0, target = torch.randn(16, 8), torch.randn(16, 8)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        loss = guard.check_loss(F.mse_loss(model(y0), target))
        loss.backward()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "inf")
    assert "the model's outputs were finite, though huge (of the order of" in origin.message


class PairEnergy(nn.Module):
    """A force field: energy from all pairwise distances, forces -dE/dpos taken inside
    forward() with autograd.grad. The self-pairs have distance sqrt(0): finite energy,
    NaN forces."""

    def __init__(self) -> None:
        super().__init__()
        self.rbf = nn.Linear(1, 32)
        self.out = nn.Linear(32, 1)

    def forward(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        if not pos.requires_grad:
            pos = pos.requires_grad_(True)
        diff = pos.unsqueeze(1) - pos.unsqueeze(0)
        dist = torch.sqrt((diff**2).sum(-1, keepdim=True))
        energy = self.out(torch.tanh(self.rbf(dist))).sum()
        forces = -torch.autograd.grad(energy, pos, create_graph=True)[0]
        return energy, forces


def test_forces_taken_inside_forward_name_the_op_that_made_them_nan() -> None:
    torch.manual_seed(0)
    model = PairEnergy()
    pos = torch.randn(12, 3)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        energy, forces = model(pos)
        loss = guard.check_loss(F.mse_loss(forces, torch.zeros_like(forces)) + energy.pow(2))
        loss.backward()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == ("forward", "", "output[1]")
    assert origin.op == "aten.div.Tensor in SqrtBackward0"
    assert origin.source is not None
    assert "torch.autograd.grad(energy, pos, create_graph=True)" in origin.source
    assert "(in SqrtBackward0, a derivative taken in the forward)" in origin.message
    assert origin.hint is not None
    assert "derivative of sqrt is infinite at 0" in origin.hint


def test_a_torch_func_metric_beside_training_keeps_the_loss_hint() -> None:
    """Per-sample gradient norms logged with vmap(grad(...)) beside ordinary training: a
    NaN target still gets the loss hint; the message only adds the caveat."""
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    y[3] = float("nan")

    def sample_loss(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        return F.mse_loss(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0))

    def loss() -> Tensor:
        params = {k: v.detach() for k, v in model.named_parameters()}
        vmap(grad(sample_loss), (None, 0, 0))(params, x[:8], torch.randn(8, 1))  # a metric
        return F.mse_loss(model(x), y)

    guard = guarded_step(model, opt, loss)
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "NaN in the targets" in origin.hint


class MaskedSentinel(nn.Module):
    """Missing values stored as 1e38 are zeroed by the model; a weight row that blew up
    (1e20) makes h * h overflow."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        x = torch.where(x.abs() > 1e30, torch.zeros_like(x), x)
        h = self.proj(x)
        return (h * h).sum(-1)


def test_an_overflow_from_exploded_weights_is_not_blamed_on_a_masked_sentinel() -> None:
    torch.manual_seed(0)
    model = MaskedSentinel()
    with torch.no_grad():
        model.proj.weight[2] = 1e20
    x = torch.randn(16, 8)
    x[0, 5] = 1e38  # a missing value, masked by the model
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(x).mean()).backward()
    origin = guard.origin
    assert origin is not None
    assert origin.hint is not None
    assert "overflowed float32" in origin.hint
    assert "unscaled feature" not in origin.hint


def test_skip_step_trains_a_lazy_batchnorm_model() -> None:
    """skip_step keeps running statistics at each step's first forward: a LazyBatchNorm
    has none yet on the first one, and training must go on as under raise."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LazyBatchNorm1d(), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD([p for p in model.parameters() if not nn.parameter.is_lazy(p)], lr=0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard:
        for _ in range(3):
            loss = model(torch.randn(32, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []
    assert torch.isfinite(model[1].running_mean).all()


class ScoreCachingAttention(nn.Module):
    """Keeps its causal-masked scores (-inf above the diagonal) for visualisation."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / 4.0
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        self.last_scores = scores.masked_fill(causal, float("-inf"))
        return self.last_scores.softmax(-1) @ v


def test_a_cached_mask_does_not_take_over_an_inf_loss() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(ScoreCachingAttention(), nn.Linear(16, 5))
    probs = torch.zeros(4, 8, 5)  # an NLL on probabilities that can be 0: log(0) = -inf
    with nanguard.watch(model, on_nonfinite="log") as guard:
        out = model(torch.randn(4, 8, 16))
        loss = guard.check_loss(-(torch.log(probs) + out * 0).mean())
        loss.backward()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"


def test_an_attribute_blamed_in_one_step_is_not_blamed_again_in_the_next() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), StoredAuxMoE(d=4, experts=2))
    with torch.no_grad():
        model[1].router.bias[1] = -50.0
    x = torch.randn(16, 4)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        out = model(x)
        guard.check_loss(out.pow(2).mean() + model[1].aux_loss).backward()
        guard.step()
        # Step 1: the MoE is not called; the loss itself overflows.
        loss = guard.check_loss((model[0](x) * 1e30).pow(2).mean())
        loss.backward()
        guard.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.step, e.phase) for e in origins] == [(0, "forward"), (1, "loss")]


class SqrtAct(nn.Module):
    def forward(self, z: Tensor) -> Tensor:
        return z * torch.sqrt(z.abs())  # a NaN derivative at z = 0


class LossMethodNet(nn.Module):
    """Trained through a method that calls the submodules itself (not forward())."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 16)
        self.act = SqrtAct()
        self.head = nn.Linear(16, 1)
        nn.init.zeros_(self.enc.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.act(self.enc(x)))

    def compute_loss(self, x: Tensor, y: Tensor) -> Tensor:
        return F.mse_loss(self.head(self.act(self.enc(x))), y)


def test_submodules_called_by_a_method_blame_the_backward_that_made_the_nan() -> None:
    """Each direct submodule call is a record of its own: the NaN that act's backward
    sends to enc's output is not a second origin "from the loss"."""
    torch.manual_seed(0)
    model = LossMethodNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    x[0] = 0.0  # a zero input row: z = 0 with the zero bias
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        loss = model.compute_loss(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.module) for e in origins] == [("backward", "act")]


class TimeMajorTagger(nn.Module):
    """An LSTM over (time, batch, features), nn.LSTM's default layout."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(8, 32)
        self.out = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.lstm(x)
        return self.out(h)


def test_a_time_major_batch_names_the_sample_not_every_time_step() -> None:
    torch.manual_seed(0)
    model = TimeMajorTagger()
    x = torch.randn(50, 16, 8)  # 50 time steps, 16 sequences
    x[:, 3, 2] = float("nan")  # one sequence has a broken feature throughout
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(x).pow(2).mean()).backward()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "input"
    assert "It is in sample 3 (of 16 along dim 1)." in origin.message


def test_sentinel_does_not_blame_an_eval_forward_for_statistics_poisoned_after_it() -> None:
    """Gradient accumulation with a validation forward (eval(), gradients on) between two
    micro-batches; the second holds a NaN. Replayed after that batch poisoned BatchNorm, the
    validation forward goes NaN: it ran finite, so its replay is not trusted."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 64, 5),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, mode="sentinel", on_nonfinite="log") as guard:
        opt.zero_grad()
        F.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.randint(0, 5, (4,))).backward()
        model.eval()
        model(torch.randn(2, 3, 8, 8))  # validation with gradients on
        model.train()
        x = torch.randn(4, 3, 8, 8)
        x[0, 0, 0, 0] = float("nan")
        F.cross_entropy(model(x), torch.randint(0, 5, (4,))).backward()
        opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.module) for e in origins] == [("input", "")]


class TopKMoE(nn.Module):
    """Top-2 routing whose balancing term averages each expert's routing probability over
    its tokens: NaN for an expert that got none (stored for the loop to add)."""

    def __init__(self, d: int = 32, experts: int = 8, k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(d, d) for _ in range(experts))
        self.k = k

    def forward(self, x: Tensor) -> Tensor:
        probs = self.router(x).softmax(-1)
        top, chosen = probs.topk(self.k, -1)
        out = torch.zeros_like(x)
        per_expert = []
        for e, expert in enumerate(self.experts):
            tokens, slot = torch.where(chosen == e)
            per_expert.append(probs[tokens, e].mean())  # NaN when expert e got no token
            if tokens.numel():
                out.index_add_(0, tokens, expert(x[tokens]) * top[tokens, slot, None])
        counts = torch.bincount(chosen.flatten(), minlength=len(self.experts))
        self.aux_loss = (counts.float() / chosen.numel() * torch.stack(per_expert)).sum()
        return out


class TokenMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 32)
        self.moe = TopKMoE()
        self.head = nn.Linear(32, 100)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.emb(ids).flatten(0, 1)
        return self.head(h + self.moe(h))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_gradient_norm_jump_in_the_step_of_an_origin_points_at_that_origin(mode: str) -> None:
    # An all-padding batch routes every token alike: the stored balancing term is NaN and
    # the finite gradients jump. The jump is no explosion heading for NaN (lower the
    # learning rate): it comes with the origin, which the user should look at first.
    torch.manual_seed(0)
    model = TokenMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for i in range(8):
            ids = torch.randint(0, 100, (8, 16))
            if i == 7:
                ids[:] = 0
            logits = model(ids)
            loss = F.cross_entropy(logits, ids.flatten().roll(-1)) + 0.01 * model.moe.aux_loss
            guard.check_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.module, origin.tensor) == (7, "moe", "self.aux_loss")
    (jump,) = [e for e in guard.events if e.kind == "grad_norm"]
    assert jump.step == 7
    assert jump.details["reason"] == "spike"
    assert "in the step where `moe` (forward) made a non-finite value" in jump.message
    assert "look at that origin first" in jump.message
    assert "while every value is still finite" not in jump.message
    assert "Exploding gradients turn into Inf and NaN" not in jump.message


class BalancedRouter(nn.Module):
    """Keeps the variance of its experts' mean routing probability as ``self.aux_loss``:
    NaN for an expert that got no token."""

    def __init__(self, d: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(d, experts)

    def forward(self, x: Tensor) -> Tensor:
        probs = self.gate(x).softmax(-1)
        top = probs.argmax(-1)
        importance = [probs[top == e, e].mean() for e in range(probs.shape[-1])]
        self.aux_loss = torch.stack(importance).var()
        return probs


class RoutedBlock(nn.Module):
    def __init__(self, d: int = 16, experts: int = 4) -> None:
        super().__init__()
        self.router = BalancedRouter(d, experts)
        self.ff = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.router(x)[:, :1] * self.ff(x)


class RoutedLM(nn.Module):
    """Returns its loss, as Hugging Face models do given labels, with the auxiliary losses
    its routers stored added in."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(RoutedBlock() for _ in range(3))
        self.head = nn.Linear(16, 5)

    def forward(self, x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        aux = sum(block.router.aux_loss for block in self.blocks)
        return F.cross_entropy(logits, labels) + 0.01 * aux, logits


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loss_returned_by_the_model_built_on_a_stored_auxiliary_loss_names_its_router(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = RoutedLM()
    with torch.no_grad():
        model.blocks[1].router.gate.bias[2] = -50.0  # a collapsed expert: it gets no token
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        loss, _ = model(torch.randn(64, 16), torch.randint(0, 5, (64,)))
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == (
        "forward", "blocks.1.router", "BalancedRouter",
    )  # fmt: skip
    assert origin.tensor == "self.aux_loss"
    assert origin.op == "aten.mean.default"
    assert origin.source is not None
    assert "importance = [probs[top == e, e].mean()" in origin.source
    assert "and `output[0]` of the model (NaN) is built on it" in origin.message
    model_event = next(e for e in guard.events if e.module == "" and e.phase == "forward")
    assert not model_event.is_origin
    assert "built on `self.aux_loss` of blocks.1.router" in model_event.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_stored_nan_the_loss_does_not_use_is_not_blamed_for_it(mode: str) -> None:
    # The balancing term is switched off (not added): the loss goes NaN from a NaN target.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), StoredAuxMoE(), nn.Linear(64, 10))
    with torch.no_grad():
        model[1].router.bias[3] = -50.0  # a collapsed expert: aux_loss is NaN every step
    x, y = torch.randn(128, 32), torch.randn(128, 10)
    y[5, 3] = float("nan")  # a corrupt target
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    guard = guarded_step(model, opt, lambda: F.mse_loss(model(x), y), mode=mode)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("loss", None)
    assert not any(e.tensor == "self.aux_loss" for e in guard.events)
