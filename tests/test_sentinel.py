"""Sentinel mode and every=N: the same origins as full mode, from a replay of the step."""

from __future__ import annotations

import pytest
import torch
from realistic import (
    CAUSES,
    log_mlp,
)
from torch import Tensor, nn

import nanguard


def origin_of(model_factory, make_input, mode: str, loss_fn=None, **options):
    torch.manual_seed(0)
    model = model_factory()
    args = make_input()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, on_nonfinite="log", optimizer=opt, mode=mode, **options) as g:
        out = model(*args)
        loss = g.check_loss((loss_fn or (lambda o: o.float().pow(2).mean()))(out))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return g.origin


CASES = CAUSES


@pytest.mark.parametrize("case", list(CASES))
def test_sentinel_and_full_mode_agree(case: str) -> None:
    factory, make_input, loss_fn = CASES[case]
    full = origin_of(factory, make_input, "full", loss_fn)
    sentinel = origin_of(factory, make_input, "sentinel", loss_fn)
    assert full is not None
    assert sentinel is not None
    fields = ("phase", "module", "module_type", "kind", "tensor", "is_origin", "op")
    assert {f: getattr(sentinel, f) for f in fields} == {f: getattr(full, f) for f in fields}
    assert (sentinel.stats is None) == (full.stats is None)
    if full.stats is not None and sentinel.stats is not None:
        assert sentinel.stats.nonfinite_count == full.stats.nonfinite_count
        assert sentinel.stats.shape == full.stats.shape


def test_sentinel_steady_state_hooks_only_the_model() -> None:
    model = log_mlp()
    with nanguard.watch(model, mode="sentinel") as guard:
        hooked = [m for m in model.modules() if m._forward_hooks]
        assert hooked == [model]
        assert guard.options.mode == "sentinel"
    assert not model._forward_hooks


def test_sentinel_clean_training_has_no_events() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode="sentinel") as guard:
        for _ in range(30):
            loss = guard.check_loss(model(torch.randn(16, 8)).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []


def test_sentinel_raise_names_the_layer_before_the_weights_change() -> None:
    model = log_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.clone() for p in model.parameters()]
    with nanguard.watch(model, optimizer=opt, mode="sentinel"):
        model(torch.randn(8, 784)).sum().backward()
        with pytest.raises(nanguard.NonFiniteError, match=r"in `1` \(LogFeatures\)"):
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_every_n_probes_every_module_only_on_every_nth_step() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    seen = []
    with nanguard.watch(model, optimizer=opt, every=3) as guard:
        for _ in range(7):
            seen.append(bool(model[0]._forward_hooks))
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
    assert seen == [True, False, False, True, False, False, True]
    assert guard.events == []
    assert not model[0]._forward_hooks


def test_every_n_still_finds_the_origin_on_a_sentinel_step() -> None:
    from realistic import LogFeatures

    model = nn.Sequential(nn.Linear(8, 8), nn.Sigmoid(), LogFeatures(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, every=4, on_nonfinite="log") as guard:
        for step in range(3):
            x = torch.randn(8, 8) * (1e4 if step == 2 else 1.0)  # sigmoid saturates to 0
            model(x).sum().backward()
            opt.step()
    assert guard.origin is not None
    assert (guard.origin.step, guard.origin.module) == (2, "2")
    assert guard.origin.op == "aten.log.default"
    assert guard.origin.kind == "inf"


class Flaky(nn.Module):
    """Misbehaves only the first time it is called: a stand-in for a nondeterministic
    kernel, a data race or a hardware fault (state outside the model: a counter on the
    module would be replayed as the forward found it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = [0]  # (a list, changed in place: not replayed)

    def forward(self, x: Tensor) -> Tensor:
        self.calls[0] += 1
        if self.calls[0] == 1:
            x = x.clone()
            x[0, 0] = float("nan")
        return x * 2


class FlakyBlock(nn.Module):
    """A block with a layer of its own whose output is spoiled once: the fault's branch
    returns a copy, the replay's the layer's own output (another path, a site fewer)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = [0]

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        self.calls[0] += 1
        if self.calls[0] == 1:
            h = h.clone()
            h[0, 0] = float("inf")
        return h


@pytest.mark.parametrize("flaky", [Flaky, FlakyBlock], ids=["leaf", "block with a layer"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_failure_the_replay_does_not_reproduce_is_labelled(mode: str, flaky: type) -> None:
    model = nn.Sequential(nn.Linear(4, 4), flaky(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        model(torch.randn(3, 4)).sum().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.reproducible is False
    assert "nondeterministic kernel, a data race or a hardware fault" in origin.message
    assert "different path" not in origin.message  # (the path is the same; the value is not)
    if mode == "full":
        assert origin.module == "1"  # the probes located it; only the replay disagreed


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_exploded_but_finite_logits_are_no_false_alarm(mode: str) -> None:
    # Logits of 1e36 (a diverging output bias): finite, but their float32 sum overflows.
    # Cross-entropy and every gradient stay finite: nothing to report, and above all no
    # "hardware fault" from a replay that cannot reproduce a NaN that never was.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 256), nn.Tanh(), nn.Linear(256, 1000))
    with torch.no_grad():
        model[2].bias.fill_(1e36)
    x, y = torch.randn(64, 128), torch.randint(0, 1000, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="raise", mode=mode) as guard:
        out = model(x)
        assert torch.isfinite(out).all()
        assert not torch.isfinite(out.sum())
        guard.check_loss(nn.functional.cross_entropy(out, y)).backward()
        opt.step()
    assert guard.origin is None
    assert [e for e in guard.events if e.kind in ("nan", "inf")] == []


class FlakyWithMask(nn.Module):
    """Takes an additive -inf padding mask: the replay sees that -inf, written on purpose,
    which must not pass for the step's NaN reproduced."""

    def __init__(self) -> None:
        super().__init__()
        self.flaky = nn.Sequential(nn.Linear(4, 4), Flaky())
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor, attn_mask: Tensor) -> Tensor:
        return self.head(self.flaky(x) + 0 * attn_mask.clamp_min(-1)[..., None])


def test_an_unreproduced_failure_of_a_model_taking_a_mask_is_still_reported() -> None:
    model = FlakyWithMask()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    mask = torch.zeros(3, 5)
    mask[:, 3:] = float("-inf")
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode="sentinel") as guard:
        model(torch.randn(3, 5, 4), mask).sum().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "forward"
    assert origin.reproducible is False


def test_reproduced_failures_say_so() -> None:
    origin = origin_of(log_mlp, lambda: (torch.randn(64, 784),), "full")
    assert origin is not None
    assert origin.reproducible is True


def test_sentinel_replay_leaves_rng_buffers_and_parameters_as_they_were() -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), LogLayer(), nn.Linear(16, 1)
        )

    class LogLayer(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.log(x)

    x = torch.randn(8, 8)
    reference = make()
    torch.manual_seed(1)
    reference(x).sum().backward()
    expected_rng = torch.get_rng_state()

    guarded = make()
    torch.manual_seed(1)
    with nanguard.watch(guarded, mode="sentinel", on_nonfinite="log") as guard:
        guarded(x).sum().backward()
        guard.step()  # replays forward and backward
    assert guard.origin is not None
    assert guard.origin.module == "3"
    assert torch.equal(torch.get_rng_state(), expected_rng)
    for (name, a), b in zip(
        reference.state_dict().items(), guarded.state_dict().values(), strict=True
    ):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), name
    for a, b in zip(reference.parameters(), guarded.parameters(), strict=True):
        assert torch.equal(a.grad.nan_to_num(), b.grad.nan_to_num())


class ActorCritic(nn.Module):
    """CleanRL style: training calls a method, never forward()."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Linear(8, 4)
        self.critic = nn.Linear(8, 1)

    def get_action_and_value(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        return self.actor(obs), self.critic(obs)


def test_sentinel_says_when_the_models_forward_is_never_called() -> None:
    model = ActorCritic()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, mode="sentinel"):
        logits, value = model.get_action_and_value(torch.randn(16, 8))
        loss = logits.logsumexp(-1).mean() + value.pow(2).mean()
        loss.backward()
        with pytest.warns(RuntimeWarning, match="mode='full'"):
            opt.step()


def test_lbfgs_forwards_inside_the_step_are_seen() -> None:
    import warnings

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.LBFGS(model.parameters(), max_iter=3)
    x, y = torch.randn(16, 4), torch.randn(16, 1)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanguard.watch(model, optimizer=opt, mode="sentinel"):
            opt.step(closure)
    assert not [w for w in caught if "without a recorded call" in str(w.message)]


def test_a_replay_that_runs_out_of_memory_in_its_backward_keeps_the_forward_origin(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # On an accelerator filled to 90%, recomputing every parameter's gradient while the
    # step's own are held can run out of memory: the module the forward replay found stands.
    import nanguard._replay as replay_module

    def out_of_memory(*_: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.50 GiB")

    monkeypatch.setattr(replay_module, "_param_grads", out_of_memory)
    model = log_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode="sentinel", on_nonfinite="log") as guard:
        model(torch.randn(8, 784)).sum().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "1", "LogFeatures")
    assert origin.op == "aten.log.default"


class CountBackward(torch.autograd.Function):
    """The identity, counting the backward passes that go through it."""

    calls = 0

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:
        CountBackward.calls += 1
        return grad


class CountedConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
            nn.Conv2d(16, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
        )  # fmt: skip
        self.out = nn.Conv2d(16, 3, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(CountBackward.apply(self.features(x)))


@pytest.mark.parametrize("where", ["input", "loss"])
def test_a_step_whose_forward_or_loss_went_bad_replays_the_forward_only(where: str) -> None:
    # A corrupt image, or a denoising loss dividing by sqrt(1 - alpha_bar) = 0: the backward
    # only carries that on (as full mode judges it), so the failing step's replay runs no
    # second backward and no second set of parameter gradients.
    origins = {}
    for mode in ("full", "sentinel"):
        torch.manual_seed(0)
        model = CountedConvNet()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
            for step in range(2):
                x, noise = torch.randn(4, 3, 16, 16), torch.randn(4, 3, 16, 16)
                alpha_bar = torch.full((4, 1, 1, 1), 0.5)
                if step == 1 and where == "input":
                    x[2, :, 3:5] = float("nan")
                if step == 1 and where == "loss":
                    alpha_bar[1] = 1.0
                CountBackward.calls = 0
                x0 = model(x)
                eps = (x - alpha_bar.sqrt() * x0) / (1 - alpha_bar).sqrt()
                loss = guard.check_loss(nn.functional.mse_loss(eps, noise))
                opt.zero_grad()
                loss.backward()
                opt.step()
                assert CountBackward.calls == 1, (mode, step)
        origins[mode] = guard.origin
    full, sentinel = origins["full"], origins["sentinel"]
    assert full is not None
    assert sentinel is not None
    assert (
        (sentinel.phase, sentinel.module)
        == (full.phase, full.module)
        == (("input", "") if where == "input" else ("loss", None))
    )
    assert sentinel.stats == full.stats


class PairDistances(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        # Each sample's distance to every other: sqrt at 0 on the diagonal, whose gradient
        # is Inf (times the zero difference: NaN). The forward is finite.
        return ((x[:, None] - x[None]) ** 2).sum(-1).sqrt()


def test_finite_logits_too_large_to_sum_and_a_backward_origin_are_both_told() -> None:
    # The logits' probe overflows (a false alarm the forward replay clears), and the
    # backward of sqrt at 0 is the real origin: the backward is replayed after all.
    origins = {}
    for mode in ("full", "sentinel"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), PairDistances(), nn.Linear(16, 100))
        with torch.no_grad():
            model[2].bias.fill_(1e36)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        x, y = torch.randn(16, 32), torch.randint(0, 100, (16,))
        with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
            out = model(x)
            assert torch.isfinite(out).all()
            guard.check_loss(nn.functional.cross_entropy(out, y)).backward()
            opt.step()
        origins[mode] = guard.origin
    for origin in origins.values():
        assert origin is not None
        assert (origin.phase, origin.module, origin.module_type) == (
            "backward",
            "1",
            "PairDistances",
        )
    assert origins["sentinel"].op == origins["full"].op


def test_steps_after_the_weights_were_reported_non_finite_are_not_replayed() -> None:
    # Under "log", training goes on with NaN weights: each later step is explained by them
    # (nothing new is created) and is not replayed again and again at ~3x a step's cost.
    torch.manual_seed(0)
    model = log_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []
    model[0].register_forward_hook(lambda *_: calls.append(1))
    per_step = []
    with nanguard.watch(model, optimizer=opt, mode="sentinel", on_nonfinite="log") as guard:
        for _ in range(5):
            calls.clear()
            loss = guard.check_loss(model(torch.randn(8, 784)).sum())
            opt.zero_grad()
            loss.backward()
            opt.step()
            per_step.append(len(calls))
    assert guard.origin is not None
    assert guard.origin.step == 0
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    assert per_step[0] > 1  # the failing step is replayed, once or twice
    assert per_step[2:] == [1, 1, 1]
    later = [e for e in guard.events if e.step >= 2]
    assert later
    assert not any(e.is_origin for e in later)


class LogGate(nn.Module):
    """A router whose log-probabilities are a log of a linear score: NaN where it is < 0."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(4, 4)
        self.unsafe = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.score(x)
        return torch.log(p) if self.unsafe else torch.log(p.abs() + 1)


class AuxLossModel(nn.Module):
    """Keeps its router's auxiliary loss as an attribute of the model itself (MoE style)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = LogGate()
        self.body = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.aux_loss = self.gate(x).mean()
        return self.body(x)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_aux_loss_the_model_itself_stores_names_the_submodule_that_made_it(mode: str) -> None:
    # The outputs are finite, the loss adds model.aux_loss: sentinel mode named the model
    # ("its forward stored self.aux_loss", no operation), full mode the gate's log.
    torch.manual_seed(0)
    model = AuxLossModel()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:  # type: ignore[arg-type]
        for step in range(3):
            model.gate.unsafe = step == 1
            out = model(torch.randn(5, 4))
            loss = guard.check_loss(out.pow(2).mean() + 0.01 * model.aux_loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.tensor) == (
        1,
        "forward",
        "gate",
        "output",
    )
    assert origin.op == "aten.log.default"
