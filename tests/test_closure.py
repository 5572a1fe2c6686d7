"""optimizer.step(closure): the forward and backward run inside step() (PyTorch Lightning's
automatic optimisation calls every optimizer this way; LBFGS needs it). The step is resolved
when the closure returns, before the update, so "raise" and "skip_step" act in time."""

from __future__ import annotations

import collections
import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import nanguard


class PaddedEncoder(nn.Module):
    """Token classifier over padded sequences with nn.MultiheadAttention and a key padding
    mask: a sample made only of padding has every key masked, and softmax gives NaN."""

    def __init__(self, vocab: int = 100, dim: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim, padding_idx=0)
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.head = nn.Linear(dim, 2)

    def forward(self, tokens: Tensor) -> Tensor:
        h = self.embed(tokens)
        h, _ = self.attn(h, h, h, key_padding_mask=tokens == 0)  # (need_weights: the default)
        return self.head(h.mean(dim=1))


def batches(n: int, bad_at: int) -> list[tuple[Tensor, Tensor]]:
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        tokens = torch.randint(1, 100, (8, 12), generator=gen)
        tokens[:, 9:] = 0  # padding at the end of every sample
        if i == bad_at:
            tokens[5] = 0  # an empty sample: nothing but padding
        out.append((tokens, torch.randint(0, 2, (8,), generator=gen)))
    return out


def lightning_style_fit(model: nn.Module, opt: torch.optim.Optimizer, data, keyword: bool) -> None:
    """What Lightning's automatic optimisation does for each batch."""
    for tokens, labels in data:

        def closure(tokens: Tensor = tokens, labels: Tensor = labels) -> Tensor:
            loss = nn.functional.cross_entropy(model(tokens), labels)  # training_step
            opt.zero_grad()
            loss.backward()
            return loss

        if keyword:
            opt.step(closure=closure)
        else:
            opt.step(closure)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_raise_stops_a_closure_step_before_the_update(mode: str) -> None:
    torch.manual_seed(0)
    model = PaddedEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = batches(4, bad_at=2)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        lightning_style_fit(model, opt, data[:2], keyword=False)
        before = copy.deepcopy(model.state_dict())
        with pytest.raises(nanguard.NonFiniteError) as info:
            lightning_style_fit(model, opt, data[2:], keyword=False)
    origin = info.value.event
    assert (origin.step, origin.phase, origin.module) == (2, "forward", "attn")
    assert origin.op is not None
    assert "softmax" in origin.op
    assert "masked" in (origin.hint or "")
    # The weights are those the failing step started from: AdamW never applied it.
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not any(e.phase == "param" for e in guard.events)


def test_skip_step_drops_a_closure_step_and_training_goes_on() -> None:
    torch.manual_seed(0)
    model = PaddedEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard:
        lightning_style_fit(model, opt, batches(5, bad_at=2), keyword=True)
    assert [e.step for e in guard.events if e.details.get("skipped")] == [2]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert guard.current_step == 5


def test_healthy_closure_training_is_identical_to_unguarded() -> None:
    def run(guarded: bool) -> dict[str, Tensor]:
        torch.manual_seed(0)
        model = PaddedEncoder()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if guarded:
            with nanguard.watch(model, optimizer=opt) as guard:
                lightning_style_fit(model, opt, batches(4, bad_at=-1), keyword=False)
            assert guard.events == []
        else:
            lightning_style_fit(model, opt, batches(4, bad_at=-1), keyword=False)
        return model.state_dict()

    plain, guarded = run(False), run(True)
    assert all(torch.equal(plain[k], guarded[k]) for k in plain)


def test_lbfgs_healthy_run_is_identical_and_each_step_resolved_once() -> None:
    # LBFGS calls the closure many times per step: the first call's gradients are checked
    # before the first update; the later calls' forwards are resolved at the step's end.
    def run(guarded: bool) -> tuple[list[float], nanguard.Guard | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=5)
        x, y = torch.randn(64, 4), torch.randn(64, 1)

        def closure() -> Tensor:
            opt.zero_grad()
            loss = (model(x) - y).pow(2).mean()
            loss.backward()
            return loss

        guard = nanguard.watch(model, optimizer=opt) if guarded else None
        try:
            losses = [float(opt.step(closure).detach()) for _ in range(3)]
        finally:
            if guard is not None:
                guard.detach()
        return losses, guard

    plain, _ = run(False)
    guarded, guard = run(True)
    assert plain == guarded
    assert guard is not None
    assert guard.events == []
    assert guard.current_step == 3


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as davda54/sam writes it: first_step() moves the weights
    up the gradient, the second forward and backward run there, second_step() puts them back
    and lets the base optimizer step. step(closure) does the three: the first forward and
    backward run before it."""

    def __init__(self, params, base_optimizer, rho: float = 0.05, **kwargs) -> None:
        super().__init__(params, dict(rho=rho, **kwargs))
        self.base_optimizer = base_optimizer(self.param_groups, **kwargs)
        self.param_groups = self.base_optimizer.param_groups

    @torch.no_grad()
    def first_step(self) -> None:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        scale = self.param_groups[0]["rho"] / (
            torch.stack([g.norm() for g in grads]).norm() + 1e-12
        )
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["old_p"] = p.detach().clone()
                    p.add_(p.grad * scale)
        self.zero_grad()

    @torch.no_grad()
    def second_step(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data = self.state[p]["old_p"]
        self.base_optimizer.step()

    @torch.no_grad()
    def step(self, closure=None):
        self.first_step()
        with torch.enable_grad():
            closure()
        self.second_step()


def test_a_forward_before_step_closure_is_resolved_before_the_optimizer_moves_anything() -> None:
    # SAM's first forward runs before step(closure): that forward's NaN must be raised before
    # step() moves the weights by NaN * rho / ||g||.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(512, 10)
    )
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)

    def train() -> None:
        for step in range(4):
            x = torch.randn(16, 3, 8, 8, generator=gen)
            y = torch.randint(0, 10, (16,), generator=gen)
            if step == 2:
                x[3, 0, 2, 2] = float("nan")  # a corrupt pixel
            nn.functional.cross_entropy(model(x), y).backward()

            def closure(x: Tensor = x, y: Tensor = y) -> Tensor:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
            opt.zero_grad()

    with nanguard.watch(model, optimizer=opt) as guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (2, "input")
    assert all(torch.isfinite(p).all() for p in model.parameters())


class IdentityPoisson(nn.Module):
    """Poisson regression with an identity link: nothing keeps the rate positive, and a
    line-search trial point of LBFGS can make it negative (log(rate) is NaN there)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, 1)
        with torch.no_grad():
            self.lin.weight.fill_(0.1)
            self.lin.bias.fill_(3.0)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x).squeeze(-1)


def poisson_fit(
    policy: str, anscombe: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer, nanguard.Guard, Callable[[], Tensor]]:
    """A Poisson regression fitted by LBFGS with strong-Wolfe line search, watched: its
    closure's log(rate) is NaN at the trial points where the identity link goes negative.
    ``anscombe``: a least-squares fit of the variance-stabilised counts instead,
    (2 sqrt(y + 3/8) - 2 sqrt(rate + 3/8))^2, whose sqrt also makes the gradient NaN."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 5, generator=gen)
    rate = (x @ torch.tensor([0.5, -0.3, 0.2, 0.0, 0.4]) + 1.5).clamp_min(0.05)
    y = torch.poisson(rate, generator=gen)
    torch.manual_seed(0)
    model = IdentityPoisson(5)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=10, line_search_fn="strong_wolfe")
    guard = nanguard.watch(model, optimizer=opt, on_nonfinite=policy)

    def closure() -> Tensor:
        opt.zero_grad()
        rate = model(x)
        if anscombe:
            stable = 2 * (y + 0.375).sqrt() - 2 * (rate + 0.375).sqrt()
            nll = guard.check_loss((stable**2).mean())
        else:
            nll = guard.check_loss((rate - y * torch.log(rate)).mean())
        nll.backward()
        return nll

    return model, opt, guard, closure


def test_lbfgs_line_search_forwards_are_not_told_to_resolve_before_the_step() -> None:
    _, opt, guard, closure = poisson_fit("log", anscombe=True)
    with guard:
        for _ in range(6):
            opt.step(closure)
    # A trial point's NaN loss had a NaN gradient, which the line search applied: the
    # weights went NaN within the step, and its later closure calls computed with them,
    # nothing new (they were each called a forward origin in `lin`, the first one even in
    # the step whose loss origin made the weights NaN).
    went_bad = min(e.step for e in guard.events if e.phase == "param")
    assert [e.step for e in guard.events if e.phase == "param" and e.is_origin] == []
    assert [e.step for e in guard.events if e.is_origin and e.phase == "loss"][-1] == went_bad
    assert [e for e in guard.events if e.phase == "forward" and e.is_origin] == []
    for event in guard.events:  # (their closure ran after the optimizer moved the weights)
        assert "optimizer= or guard.step() before optimizer.step()" not in event.message
    assert any("nothing new was created" in e.message for e in guard.events if e.step > went_bad)


def test_skip_step_says_when_a_later_closure_call_went_non_finite_after_the_update() -> None:
    """LBFGS calls its closure again after it moved the weights (line-search trial points):
    a NaN there cannot be skipped any more, and the user is told that the step went ahead,
    rather than believing it was dropped."""
    _, opt, guard, closure = poisson_fit("skip_step")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with guard:
            for _ in range(3):
                opt.step(closure)
    # Step 0's third call (a trial point) made the NaN; the weights it left make the first
    # call of steps 1 and 2 NaN: those were skipped in time.
    skipped = sorted(e.step for e in guard.events if e.details.get("skipped"))
    assert skipped == [1, 2]
    steps = sorted({e.step for e in guard.events if e.is_origin} - set(skipped))
    assert steps == [0]
    late = [str(w.message) for w in caught if "too late to skip" in str(w.message)]
    assert late == [
        f"nanguard: step {step}: NaN appeared in a forward that LBFGS.step() ran after it "
        "had moved the weights (a later call of its closure, a line-search trial point): too "
        "late to skip; the step went ahead (on_nonfinite='skip_step' drops a step only when the "
        "closure's first call is non-finite)."
        for step in steps
    ]


class SGDWithClosureArgs(torch.optim.SGD):
    """An optimizer that passes an argument to its closure (as some second-order ones ask
    the closure whether to run the backward)."""

    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure(True)
        super().step()
        return loss


def test_a_closure_called_with_arguments_gets_them() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = SGDWithClosureArgs(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    seen = []

    def closure(backward: bool) -> Tensor:
        seen.append(backward)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        if backward:
            loss.backward()
        return loss

    with nanguard.watch(model, optimizer=opt) as guard:
        for _ in range(3):
            opt.step(closure)
    assert seen == [True, True, True]
    assert guard.events == []
    assert guard.current_step == 3


class Lookahead(torch.optim.Optimizer):
    """Lookahead as lonePatient/lookahead_pytorch writes it (and timm, with
    ``_base_optimizer``): an Optimizer subclass that never runs ``Optimizer.__init__``, so
    it takes no step hooks; its step() steps the optimizer it wraps, then pulls the weights
    towards slow copies every k steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, k: int = 2, alpha: float = 0.5) -> None:
        self.optimizer, self.k, self.alpha = optimizer, k, alpha
        self.param_groups = optimizer.param_groups
        self.defaults = optimizer.defaults
        self.state: dict = collections.defaultdict(dict)
        for group in self.param_groups:
            group["counter"] = 0

    def step(self, closure=None):  # type: ignore[override]
        loss = self.optimizer.step(closure)
        for group in self.param_groups:
            if group["counter"] == 0:
                for fast in group["params"]:
                    state = self.state[fast]
                    if "slow" not in state:
                        state["slow"] = fast.detach().clone()
                    state["slow"] += (fast.detach() - state["slow"]) * self.alpha
                    fast.data.copy_(state["slow"])
            group["counter"] = (group["counter"] + 1) % self.k
        return loss


def test_a_lookahead_wrapper_without_step_hooks_is_guarded_through_the_optimizer_it_wraps() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = Lookahead(torch.optim.Adam(model.parameters(), lr=1e-2))
    gen = torch.Generator().manual_seed(0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard:
        for step in range(5):
            x = torch.randn(32, 8, generator=gen)
            pred = model(x).squeeze(-1)
            scale = torch.zeros(()) if step == 3 else pred.detach().abs().mean()
            loss = (pred - x.sum(-1)).pow(2).mean() / scale * scale  # 0/0 at step 3
            opt.optimizer.zero_grad()
            loss.backward()
            if step == 3:
                before = copy.deepcopy(model.state_dict())
            opt.step()
            if step == 3:
                after = model.state_dict()
                assert all(torch.equal(before[k], after[k]) for k in before)
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (3, "loss")
    assert guard.current_step == 5
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_an_optimizer_that_never_ran_optimizer_init_and_wraps_nothing_is_a_clear_error() -> None:
    class Bare(torch.optim.Optimizer):
        def __init__(self, params: list[Tensor]) -> None:
            self.param_groups = [{"params": params}]

        def step(self, closure=None):  # type: ignore[override]
            return None

    model = nn.Linear(3, 1)
    with pytest.raises(TypeError, match=r"never ran torch\.optim\.Optimizer\.__init__"):
        nanguard.watch(model, optimizer=Bare(list(model.parameters())))
    with nanguard.watch(model):  # (nothing was left attached)
        model(torch.randn(2, 3))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("bad", ["batch", "learning_rate"])
def test_lbfgs_calling_its_closure_again_reports_one_origin_under_warn(mode: str, bad: str) -> None:
    # Under "warn" LBFGS goes on after its first closure call is resolved: its later calls
    # on the same NaN batch, or on the weights its NaN learning rate wrote, are that
    # origin's consequences, not new origins.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=4)
    gen = torch.Generator().manual_seed(1)
    guard = nanguard.watch(model, optimizer=opt, on_nonfinite="warn", mode=mode)
    with warnings.catch_warnings(record=True) as caught, guard:
        warnings.simplefilter("always")
        for i in range(6):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            if i == 5 and bad == "batch":
                x[3, 2] = float("nan")
            if i == 5 and bad == "learning_rate":
                opt.param_groups[0]["lr"] = float("nan")

            def closure(x: Tensor = x, y: Tensor = y) -> Tensor:
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss

            opt.step(closure)
    origins = [e for e in guard.events if e.is_origin]
    expected = ("input", "args[0]") if bad == "batch" else ("param", "lr of param group 0")
    assert [(e.step, e.phase, e.tensor) for e in origins] == [(5, *expected)]
    warned = [str(w.message) for w in caught if issubclass(w.category, nanguard.NonFiniteWarning)]
    assert not [m for m in warned if "first appeared" in m or "already contains" in m][1:]


class LoggingSGD(torch.optim.SGD):
    """A user's subclass that overrides step() to add something and calls torch's."""

    def step(self, closure=None):  # type: ignore[no-untyped-def, override]
        return super().step(closure)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("policy", ["raise", "skip_step"])
@pytest.mark.parametrize("kind", [torch.optim.SGD, LoggingSGD])
def test_lightning_accumulation_last_micro_batch_in_the_closure_is_checked_before_the_update(
    mode: str, policy: str, kind: type[torch.optim.SGD]
) -> None:
    # Lightning's accumulate_grad_batches=2: it runs the window's first micro-batch itself
    # and the last one inside optimizer.step(closure). A NaN in that last one was resolved
    # only after the update (the step ended at the pre-hook for the earlier micro-batch).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = kind(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(0)
    batches = [
        (torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(8)
    ]
    batches[3][0][1, 2] = float("nan")  # the second micro-batch of step 1

    def micro(x: Tensor, y: Tensor) -> Tensor:
        loss = nn.functional.mse_loss(model(x), y) / 2
        loss.backward()
        return loss

    def train() -> None:
        for step in range(4):
            first, last = batches[2 * step], batches[2 * step + 1]
            micro(*first)
            opt.step(lambda last=last: micro(*last))
            opt.zero_grad()

    guard = nanguard.watch(model, optimizer=opt, on_nonfinite=policy, mode=mode)
    with guard:
        if policy == "raise":
            with pytest.raises(nanguard.NonFiniteError):
                train()
        else:
            train()
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.details["forward"]) == (1, "input", 2)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_sam_running_statistics_its_perturbed_forward_made_nan_are_not_origins(mode: str) -> None:
    # The loss's log(0) makes the gradient NaN; first_step() moves the weights by it, and the
    # second forward there updates BatchNorm's statistics with NaN: the loss's doing.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt = SAM(model.parameters(), torch.optim.SGD, lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        for i in range(6):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            loss = nn.functional.mse_loss(model(x), y)
            if i == 5:
                loss = loss + torch.log(loss * 0)
            guard.check_loss(loss).backward()
            opt.first_step()
            guard.check_loss(nn.functional.mse_loss(model(x), y)).backward()
            opt.second_step()
            opt.zero_grad()
    origins = [(e.step, e.phase, e.tensor) for e in guard.events if e.is_origin]
    assert origins == [(5, "loss", "loss")]


class PoissonGLM(nn.Module):
    """Poisson regression with the log link: exp(eta) overflows past eta = 88."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 1)

    def forward(self, x: Tensor) -> Tensor:
        return torch.exp(self.lin(x)).squeeze(-1)


def test_an_lbfgs_trial_point_overflowing_gets_a_hint_about_the_move() -> None:
    # torch.optim.LBFGS's defaults (lr=1, no line search) on an unscaled covariate: a later
    # closure call of step 0 evaluates exp at a trial point far out ("does not recognise").
    torch.manual_seed(0)
    model = PoissonGLM()
    opt = torch.optim.LBFGS(model.parameters(), lr=1, max_iter=20)
    x = torch.randn(200, 5) * 3
    x[:, 4] *= 30
    y = torch.poisson(torch.exp(0.3 * x[:, 0]))
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:

        def closure() -> Tensor:
            opt.zero_grad()
            rate = model(x)
            loss = guard.check_loss((rate - y * torch.log(rate)).mean())
            loss.backward()
            return loss

        opt.step(closure)
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (0, "forward")
    assert origin.details.get("forward", 1) > 1
    assert origin.hint is not None
    assert "a later closure call after the weights moved" in origin.hint
    assert "line_search_fn='strong_wolfe'" in origin.hint
