"""Usage a demanding user tries: TorchScript parts, float64 extremes in the log, check()
in the middle of a step, GradScaler with skip_step, optimizer subclasses, guards that
overlap or get lost, a shared GradScaler, and options that cannot take effect.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nanguard


class Log(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)


def hook_count(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


# ------------------------------------------------------------------ TorchScript
class Scripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.log(self.lin(x))


class WithScriptedPart(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.jit.script(Scripted())
        self.out = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.inner(x))


def test_a_torchscript_model_is_refused_with_a_clear_error() -> None:
    with pytest.raises(TypeError, match="cannot hook a TorchScript module"):
        nanguard.watch(torch.jit.script(Scripted()))


def test_a_torchscript_part_is_checked_as_part_of_its_parent() -> None:
    model = WithScriptedPart()
    with nanguard.watch(model) as guard:
        model(torch.randn(16, 8)).sum().backward()
        with pytest.raises(nanguard.NonFiniteError, match="own code of the model"):
            guard.step()
    assert guard.origin is not None
    assert (guard.origin.phase, guard.origin.module) == ("forward", "")
    # ...saying so: the scripted part is unhooked, not a submodule that "returned finite".
    assert "a submodule nanguard does not hook, part of that code: `inner` (" in (
        guard.origin.message
    )
    assert "every submodule it called before that nanguard hooks" in guard.origin.message
    assert hook_count(model) == 0


# ------------------------------------------------- float64 extremes in the JSON log
def test_huge_float64_statistics_are_written_as_strict_json(tmp_path: Path) -> None:
    model = nn.Linear(4, 4).double()
    x = torch.full((8, 4), 1e300, dtype=torch.float64)
    x[0, 0] = float("nan")
    path = tmp_path / "events.jsonl"
    with nanguard.watch(model, log_path=path) as guard:
        model(x)
        with pytest.raises(nanguard.NonFiniteError):
            guard.step()
    lines = path.read_text().splitlines()
    assert lines
    for line in lines:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON: {c}"))
    stats = guard.origin.stats if guard.origin else None
    assert stats is not None
    assert stats.mean == pytest.approx(1e300)
    assert stats.std == pytest.approx(0.0, abs=1e290)
    assert nanguard.read_events(path)[0] == guard.events[0]


# ------------------------------------------------------ check() in the middle of a step
@pytest.mark.parametrize("when", ["after_forward", "after_backward"])
def test_check_mid_step_then_step_reports_one_origin(when: str) -> None:
    model = nn.Sequential(nn.Linear(3, 3), Log(), nn.Linear(3, 1))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        out = model(torch.randn(4, 3))
        if when == "after_forward":
            guard.check()
        out.sum().backward()
        if when == "after_backward":
            guard.check()
        later = guard.step()
    assert [(e.phase, e.module) for e in guard.events if e.is_origin] == [("forward", "1")]
    assert later
    assert not any(e.is_origin for e in later)


# -------------------------------------------------- skip_step with a GradScaler
class LogNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 1)

    def forward(self, x: Tensor, shift: float) -> Tensor:
        return self.b(torch.log(self.a(x) - shift))


def test_skip_step_with_a_scaler_stops_after_max_consecutive_skips() -> None:
    model = LogNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(16, 8)
    raised_at, message = None, ""
    with nanguard.watch(
        model, optimizer=opt, scaler=scaler, on_nonfinite="skip_step", max_consecutive_skips=3
    ) as guard:
        for step in range(10):
            try:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x, 100.0).float().mean()  # log of a negative: every step
                opt.zero_grad()
                scaler.scale(guard.check_loss(loss)).backward()
                scaler.step(opt)
                scaler.update()
            except nanguard.NonFiniteError as err:
                raised_at, message = step, str(err)
                break
    assert raised_at == 2
    assert "3 optimizer steps in a row were skipped" in message
    assert message.count("nanguard: ") == 1  # (the quoted origin without its prefix)
    assert "; the last origin: step " in message
    assert [e.step for e in guard.events if e.details.get("skipped")] == [0, 1, 2]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_the_step_count_goes_on_after_skip_step_gives_up() -> None:
    model = LogNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8)
    with nanguard.watch(
        model, optimizer=opt, on_nonfinite="skip_step", max_consecutive_skips=2
    ) as guard:
        for step in range(5):
            loss = model(x, 1e6 if step in (1, 2, 4) else -10.0).mean()
            opt.zero_grad()
            loss.backward()
            try:
                opt.step()
            except nanguard.NonFiniteError:
                assert step == 2
            assert guard.current_step == step + 1
    assert [e.step for e in guard.events if e.is_origin] == [1, 2, 4]


# ------------------------------------ sentinel mode when the step cannot be replayed
def test_sentinel_names_a_bad_batch_even_when_the_replay_is_refused() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 8)
    x[5, 2] = float("nan")
    with nanguard.watch(model, mode="sentinel") as guard:
        loss = F.mse_loss(model(x), torch.zeros(32, 1))
        loss.backward()
        opt.step()  # the weights move before the step is resolved: no replay
        with pytest.raises(nanguard.NonFiniteError):
            guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == ("input", "", "args[0]")
    assert origin.stats is not None
    assert origin.stats.nan_count == 1


def test_sentinel_without_replay_says_it_cannot_name_the_module() -> None:
    model = nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 1))
    with nanguard.watch(model, mode="sentinel", replay=False) as guard:
        model(torch.randn(16, 4)).sum().backward()
        with pytest.raises(
            nanguard.NonFiniteError, match="the module inside that made it is unknown"
        ):
            guard.step()


# ---------------------------------------------------- optimizer subclasses and choices
class MySGD(torch.optim.SGD):
    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        return super().step(closure)


def test_an_optimizer_subclass_calling_super_step_counts_one_step() -> None:
    torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)  # patches SGD.step's hooks too
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1))
    opt = MySGD(model.parameters(), lr=0.1)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "step ends without a recorded call"
        with nanguard.watch(model, optimizer=opt) as guard:
            for _ in range(3):
                loss = model(torch.randn(4, 3)).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
            assert guard.current_step == 3
    assert len(calls) == 6  # torch runs the hooks twice: nanguard counts the step once


def test_an_optimizer_of_another_model_is_warned_about() -> None:
    model, other = nn.Linear(3, 1), nn.Linear(3, 1)
    with pytest.warns(RuntimeWarning, match="holds none of the watched Linear's trainable"):
        guard = nanguard.watch(model, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))
    guard.detach()


# --------------------------------------------------------- overlapping and lost guards
def test_a_model_whose_submodule_is_watched_cannot_be_watched_too() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3), Log()))
    inner = nanguard.watch(model[1])
    with pytest.raises(nanguard.AttachError, match=r"a model inside it .* is already watched"):
        nanguard.watch(model)
    inner.detach()
    outer = nanguard.watch(model, mode="sentinel")  # (its submodules carry no hooks)
    with pytest.raises(nanguard.AttachError, match=r"a model holding it .* is already watched"):
        nanguard.watch(model[1])
    outer.detach()


class Seq2SeqHalf(nn.Module):
    def __init__(self, embed: nn.Embedding) -> None:
        super().__init__()
        self.embed = embed
        self.proj = nn.Linear(16, 16)

    def forward(self, idx: Tensor) -> Tensor:
        return self.proj(self.embed(idx))


def test_models_sharing_a_module_are_watched_through_the_model_holding_both() -> None:
    shared = nn.Embedding(50, 16)
    encoder, decoder = Seq2SeqHalf(shared), Seq2SeqHalf(shared)
    # The shared embedding's hooks would record the decoder's calls as the encoder's.
    with (
        nanguard.watch(encoder),
        pytest.raises(nanguard.AttachError, match="watch the model that holds both"),
    ):
        nanguard.watch(decoder)
    assert hook_count(encoder) == hook_count(decoder) == 0
    both = nn.ModuleDict({"encoder": encoder, "decoder": decoder})
    with nanguard.watch(both) as guard:
        idx = torch.randint(0, 50, (4, 7))
        (encoder(idx).sum() + decoder(idx).sum()).backward()
        assert guard.step() == []


def test_unwatch_detaches_a_lost_guard() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Log())

    def forgetful() -> None:
        nanguard.watch(model)
        raise RuntimeError("the cell failed before guard.detach()")

    with pytest.raises(RuntimeError):
        forgetful()
    with pytest.raises(nanguard.AttachError, match=r"nanguard.unwatch\(model\)"):
        nanguard.watch(model)
    assert nanguard.unwatch(model[1]) == 1  # any module it hooks
    assert hook_count(model) == 0
    assert nanguard.unwatch(model) == 0
    with pytest.raises(TypeError, match=r"takes a torch\.nn\.Module"):
        nanguard.unwatch("model")  # type: ignore[arg-type]
    nanguard.watch(model).detach()


# ------------------------------------------------------------ a GradScaler shared by two
def test_two_guards_sharing_a_scaler() -> None:
    gen = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    disc = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 1))
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    guard_g = nanguard.watch(gen, optimizer=opt_g, scaler=scaler, on_nonfinite="log")
    guard_d = nanguard.watch(disc, optimizer=opt_d, scaler=scaler, on_nonfinite="log")

    def iteration(overflow: bool) -> None:
        fake = gen(torch.randn(32, 8))
        loss_d = guard_d.check_loss(disc(fake.detach()).mean())
        opt_d.zero_grad()
        scaler.scale(loss_d).backward()
        scaler.step(opt_d)
        loss_g = guard_g.check_loss(-disc(fake).mean() * (1e36 if overflow else 1.0))
        opt_g.zero_grad()
        scaler.scale(loss_g).backward()
        scaler.step(opt_g)  # skipped when its gradients overflow
        scaler.update()

    iteration(False)
    iteration(True)
    skips = [e for e in guard_d.events if e.kind == "amp_overflow"]
    assert skips
    assert "another optimizer's step (not this guard's)" in skips[0].message
    guard_d.detach()  # attached last: the generator's guard keeps observing the scaler
    before = guard_g.current_step
    iteration(True)
    assert guard_g.current_step == before + 1
    guard_g.detach()
    assert "update" not in scaler.__dict__


# --------------------------------------------------------------------- sync="module"
class Counted(nn.Linear):
    calls = 0

    def forward(self, x: Tensor) -> Tensor:
        Counted.calls += 1
        return super().forward(x)


def test_sync_module_raises_as_the_origin_returns() -> None:
    model = nn.Sequential(nn.Linear(3, 3), Log(), Counted(3, 3))
    Counted.calls = 0
    with (
        pytest.raises(nanguard.NonFiniteError) as info,
        nanguard.watch(model, sync="module", replay=False),
    ):
        model(torch.randn(4, 3))
    assert info.value.event.module == "1"
    assert Counted.calls == 0  # stopped before the next module ran


# --------------------------------------------------------------------- options
def test_options_that_cannot_take_effect_are_refused() -> None:
    model = nn.Linear(3, 1)
    with pytest.raises(ValueError, match="every= applies to mode='full'"):
        nanguard.watch(model, mode="sentinel", every=4)
    with pytest.raises(ValueError, match="not inside the watched Linear"):
        nanguard.watch(model, names={nn.ReLU(): "act"})
    guard = nanguard.watch(model, check_params=None)  # the documented default
    assert guard.options.check_params is None
    guard.detach()


def test_sentinel_does_not_blame_a_reused_input_buffer_for_the_models_nan() -> None:
    model = nn.Sequential(nn.Linear(8, 8), Log(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    buffer = torch.empty(16, 8)
    first, second = torch.randn(16, 8), torch.randn(16, 8).abs()
    second[3, 2] = float("nan")  # the second micro-batch has a missing value of its own
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode="sentinel") as guard:
        opt.zero_grad()
        for batch in (first, second):  # gradient accumulation through one static buffer
            buffer.copy_(batch)
            model(buffer).mean().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "forward"  # the model's log made the first NaN, not the batch


def test_two_guards_on_one_scaler_detached_in_attach_order_leave_it_clean() -> None:
    import pickle

    scaler = torch.amp.GradScaler("cpu")
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    guard_a = nanguard.watch(a, optimizer=torch.optim.SGD(a.parameters(), lr=0.1), scaler=scaler)
    guard_b = nanguard.watch(b, optimizer=torch.optim.SGD(b.parameters(), lr=0.1), scaler=scaler)
    guard_a.detach()
    guard_b.detach()
    assert "update" not in scaler.__dict__
    pickle.dumps(scaler)


def test_a_failed_step_keeps_none_of_the_callers_tensors_alive() -> None:
    import gc
    import weakref

    model = nn.Linear(256, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nanguard.watch(model, optimizer=opt)
    refs = []

    def train() -> None:
        batch = torch.randn(512, 256)
        batch[0, 0] = float("nan")
        refs.append(weakref.ref(batch))
        loss = model(batch).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()

    with pytest.raises(nanguard.NonFiniteError):
        train()
    gc.collect()
    assert refs[0]() is None
    guard.detach()


class Fallback(torch.optim.SGD):
    """Falls back to a plain update when the inner step fails (caught inside step())."""

    fail = False

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        lrs = [g["lr"] for g in self.param_groups]
        try:
            if self.fail:
                for g in self.param_groups:
                    g["lr"] = None  # SGD.step raises inside
            return super().step(closure)
        except TypeError:
            with torch.no_grad():
                for g, lr in zip(self.param_groups, lrs, strict=True):
                    g["lr"] = lr
                    for p in g["params"]:
                        if p.grad is not None:
                            p.add_(p.grad, alpha=-lr)
            return None


def test_a_nested_step_that_fails_inside_still_counts_the_outer_step() -> None:
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # SGD.step's hooks run too
    model = nn.Linear(4, 1)
    opt = Fallback(model.parameters(), lr=0.1)
    counts = []
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for i in range(3):
            opt.fail = i == 1
            loss = model(torch.randn(8, 4)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            counts.append(guard.current_step)
    assert counts == [1, 2, 3]


class Zero(torch.optim.Optimizer):
    """A ZeRO-like wrapper: steps the optimizer it holds, falling back on an error."""

    def __init__(self, inner: torch.optim.Optimizer) -> None:
        self.inner = inner
        super().__init__(inner.param_groups, {})

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        try:
            return self.inner.step(closure)
        except RuntimeError:
            return None


def test_steps_after_a_swallowed_step_error_are_still_checked() -> None:
    model = nn.Linear(4, 1)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = Zero(inner)
    fail = [False]

    def user_hook(*_: object) -> None:
        if fail[0]:
            raise RuntimeError("a user error in the step")

    steps = []
    with nanguard.watch(model, optimizer=inner, on_nonfinite="log") as guard:
        inner.register_step_pre_hook(user_hook)
        for i in range(5):
            fail[0] = i == 2
            x = torch.randn(8, 4)
            if i == 4:
                x[0, 0] = float("nan")
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            steps.append(guard.current_step)
    assert steps == [1, 2, 2, 3, 4]  # the step that raised before the guard's hook is lost
    assert [(e.step, e.phase) for e in guard.events if e.is_origin] == [(3, "input")]


class NormalisesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(x.sub_(x.mean(0)).div_(x.std(0)))  # in place; 0/0 on a constant column


def test_sentinel_does_not_blame_the_batch_for_what_the_model_wrote_into_it() -> None:
    model = NormalisesItsInput()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8)
    x[:, 1] = 3.0  # a constant feature: finite, but its std is 0
    with nanguard.watch(model, mode="sentinel") as guard:
        model(x).sum().backward()
        opt.step()  # the weights move before the step is resolved: no replay
        with pytest.raises(nanguard.NonFiniteError, match="modified in place"):
            guard.step()
    assert guard.origin is not None
    assert guard.origin.phase == "forward"  # the batch it was given was finite


def test_detach_keeps_a_users_own_scaler_update_wrapper() -> None:
    scaler = torch.amp.GradScaler("cpu")
    calls = []
    plain = scaler.update

    def my_update(new_scale: object = None) -> None:
        calls.append(1)
        plain(new_scale)

    scaler.update = my_update  # type: ignore[method-assign]
    model = nn.Linear(2, 2)
    guard = nanguard.watch(
        model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), scaler=scaler
    )
    guard.detach()
    assert scaler.update is my_update


class ScaledStep(torch.optim.Optimizer):
    """Like accelerate's AcceleratedOptimizer: step() runs scaler.step(inner)."""

    def __init__(self, inner: torch.optim.Optimizer, scaler: torch.amp.GradScaler) -> None:
        self.inner, self.scaler = inner, scaler
        super().__init__(inner.param_groups, {})

    def step(self, closure=None):  # type: ignore[no-untyped-def]
        self.scaler.step(self.inner)


def test_a_scaler_skip_through_a_wrapping_optimizer_is_this_guards() -> None:
    model = nn.Linear(4, 1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1e38)
    opt = ScaledStep(torch.optim.SGD(model.parameters(), lr=0.1), scaler)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanguard.watch(model, optimizer=opt, scaler=scaler, on_nonfinite="log") as g:
            loss = model(torch.randn(8, 4) * 100).pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()  # overflows at this scale
            opt.step()
            scaler.update()
    skips = [e for e in g.events if e.kind == "amp_overflow"]
    assert skips
    assert "skipped this optimizer step" in skips[0].message


def test_a_critic_only_iteration_is_not_the_generators_skip() -> None:
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    critic = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-3)
    opt_c = torch.optim.SGD(critic.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        guard_g = nanguard.watch(gen, optimizer=opt_g, scaler=scaler, on_nonfinite="log")
        guard_c = nanguard.watch(critic, optimizer=opt_c, scaler=scaler, on_nonfinite="log")
        with torch.no_grad():
            fake = gen(torch.randn(16, 4))
        loss = critic(fake).mean() * 1e36  # the critic's scaled gradients overflow
        opt_c.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt_c)
        scaler.update()
        guard_g.detach()
        guard_c.detach()
    g_skips = [e.message for e in guard_g.events if e.kind == "amp_overflow"]
    c_skips = [e.message for e in guard_c.events if e.kind == "amp_overflow"]
    assert g_skips
    assert "another optimizer's step (not this guard's)" in g_skips[0]
    assert c_skips
    assert "skipped this optimizer step" in c_skips[0]


def test_models_sharing_an_activation_instance_each_get_a_guard() -> None:
    act = nn.ReLU()
    a = nn.Sequential(nn.Linear(4, 4), act, nn.Linear(4, 1))
    b = nn.Sequential(nn.Linear(4, 4), act, Log())
    with nanguard.watch(a) as guard_a, nanguard.watch(b, on_nonfinite="log") as guard_b:
        a(torch.randn(8, 4)).sum().backward()
        b(-torch.rand(8, 4) - 1).sum().backward()  # the log of a negative, in b only
        assert guard_a.step() == []
        guard_b.step()
    assert guard_b.origin is not None
    assert (guard_b.origin.phase, guard_b.origin.module) == ("forward", "2")


class SpeechModel(nn.Module):
    """Conv subsampling by 2, a bidirectional GRU, per-frame token log-probabilities."""

    def __init__(self, mels: int = 40, hidden: int = 32, tokens: int = 30) -> None:
        super().__init__()
        self.conv = nn.Conv1d(mels, hidden, 3, stride=2, padding=1)
        self.rnn = nn.GRU(hidden, hidden, batch_first=True, bidirectional=True)
        self.fc = nn.Linear(2 * hidden, tokens)

    def forward(self, feats: Tensor) -> Tensor:
        x = F.relu(self.conv(feats.transpose(1, 2))).transpose(1, 2)
        x, _ = self.rnn(x)
        return self.fc(x).log_softmax(-1)


def test_an_unchecked_ctc_loss_is_not_called_finite() -> None:
    # One utterance's target (30 tokens) is longer than its 20 output frames: its CTC loss
    # is +Inf and its gradient NaN; the loss never went through check_loss.
    torch.manual_seed(0)
    model = SpeechModel()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    lengths = torch.tensor([10, 12, 30, 15])
    targets = torch.randint(1, 30, (4, 30))
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        log_probs = model(torch.randn(4, 40, 40))
        loss = F.ctc_loss(log_probs.transpose(0, 1), targets, torch.full((4,), 20), lengths)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert not origin.hint.startswith("The loss's backward made NaN from a finite loss")
    assert "The loss was not checked" in origin.hint
    assert "zero_infinity=True" in origin.hint


class MaskedAgent(nn.Module):
    """CleanRL layout: training calls get_action_and_value, never forward()."""

    def __init__(self, obs: int = 16, actions: int = 6) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(obs, 32), nn.Tanh(), nn.Linear(32, actions))
        self.critic = nn.Sequential(nn.Linear(obs, 32), nn.Tanh(), nn.Linear(32, 1))

    def get_action_and_value(self, x: Tensor, legal: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = self.actor(x).masked_fill(~legal, float("-inf"))
        probs = logits.softmax(-1)
        entropy = -(probs * torch.log(probs)).sum(-1)  # 0 * -inf = NaN for illegal actions
        return logits.log_softmax(-1), entropy, self.critic(x)


def test_a_nan_made_in_an_agent_method_is_not_blamed_on_the_loss_alone() -> None:
    torch.manual_seed(0)
    agent = MaskedAgent()
    opt = torch.optim.Adam(agent.parameters(), lr=3e-4)
    legal = torch.ones(32, 6, dtype=torch.bool)
    legal[:, 4:] = False
    with nanguard.watch(agent, optimizer=opt, on_nonfinite="log") as guard:
        logp, entropy, value = agent.get_action_and_value(torch.randn(32, 16), legal)
        loss = guard.check_loss(-logp[:, 0].mean() - 0.01 * entropy.mean() + value.pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert "forward() was not called in this step" in origin.message
    assert "its submodules `actor`, `critic` were called directly" in origin.message
    assert "the loss function created it" not in origin.message


class StatefulCell(nn.Module):
    """A streaming cell keeping its state in ``self.h`` (not among its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.h: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x) if self.h is None else self.lin(x) + self.h
        self.h = torch.log(h.abs() - 0.5) if self.h is None else h  # NaN at the first call
        return self.h


class Streaming(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cell = StatefulCell()
        self.out = nn.Linear(4, 1)

    def forward(self, xs: Tensor) -> Tensor:
        self.cell.h = None
        ys = [self.cell(xs[:, t]) for t in range(xs.shape[1])]
        return self.out(ys[-1])


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_call_reading_the_first_origins_value_from_its_own_state_is_not_a_second_origin(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = Streaming()
    with nanguard.watch(model, on_nonfinite="log", mode=mode) as guard:
        model(torch.randn(8, 3, 4)).sum().backward()
        guard.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.module, e.call) for e in origins] == [("cell", 0)]
    later = [e for e in guard.events if e.module == "cell" and not e.is_origin]
    assert later
    assert all("created earlier, in `cell`" in e.message for e in later)


def test_a_generators_own_log0_loss_through_a_healthy_discriminator_stays_its_origin() -> None:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid())
    with torch.no_grad():
        disc[2].bias.fill_(-200.0)  # a confident discriminator: sigmoid(-200) is 0.0
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-3)
    with (
        nanguard.watch(gen, optimizer=opt_g, on_nonfinite="log") as guard_g,
        nanguard.watch(disc, optimizer=opt_d, on_nonfinite="log"),
    ):
        fake = gen(torch.randn(5, 4))
        real = torch.randn(5, 6)
        d_loss = -(torch.log(disc(real) + 1e-8) + torch.log(1 - disc(fake.detach()) + 1e-8))
        opt_d.zero_grad()
        d_loss.mean().backward()
        opt_d.step()
        g_loss = guard_g.check_loss(-torch.log(disc(fake)).mean())  # log(0)
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    origin = guard_g.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "inf")
    assert "the loss function, or the code between them and the loss, created it" in (
        origin.message
    )
    assert "another model (a discriminator, a critic)" in origin.message


def test_a_skipped_steps_bad_gradients_do_not_excuse_a_later_optimizer_overflow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard:
        for step in range(7):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            if step == 1:
                x[3, 2] = float("nan")  # skipped: the weights stay finite
            for group in opt.param_groups:
                group["lr"] = float("inf") if step == 5 else 0.01  # a scheduler bug
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
            if step < 5:
                assert all(torch.isfinite(p).all() for p in model.parameters())
    params = [e for e in guard.events if e.phase == "param" and e.is_origin]
    assert params
    assert params[0].step == 5
    # (named before the step: the Inf learning rate itself; skip_step kept the weights)
    assert params[0].details["reason"] == "learning_rate"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_absolute_gradient_thresholds_still_apply_when_the_guard_closes() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4) * 1e3, torch.randn(16, 1)
    with nanguard.watch(model, on_nonfinite="log", grad_norm_threshold=10) as guard:
        F.mse_loss(model(x), y).backward()  # one suspicious batch, no step
    assert [e.kind for e in guard.events] == ["grad_norm"]
    assert "exceeds grad_norm_threshold=10" in guard.events[0].message


class LazyProxy:
    """Like werkzeug's LocalProxy outside its context: any look at its class raises."""

    @property
    def __class__(self):  # type: ignore[override]
        raise RuntimeError("working outside of application context")


def test_an_object_in_scope_that_raises_on_inspection_does_not_break_watch() -> None:
    current_app = LazyProxy()  # noqa: F841  (in the caller's scope, as at a script's top level)
    model = nn.Linear(2, 2)
    guard = nanguard.watch(model)
    assert guard.attached
    guard.detach()


def test_a_generator_loss_through_a_discriminator_broken_by_its_own_loss_is_not_gs_origin() -> None:
    # The discriminator's hand-written log(1 - D(fake)) is log(0): its loss is the origin, its
    # optimizer applies the NaN gradients, and the generator's loss through it is NaN.
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid())
    with torch.no_grad():
        disc[2].bias.fill_(200.0)  # saturated: D(x) is exactly 1.0
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-3)
    with (
        nanguard.watch(gen, optimizer=opt_g, on_nonfinite="log") as guard_g,
        nanguard.watch(disc, optimizer=opt_d, on_nonfinite="log") as guard_d,
    ):
        fake = gen(torch.randn(5, 4))
        d_loss = -(torch.log(disc(torch.randn(5, 6))) + torch.log(1 - disc(fake.detach()))).mean()
        opt_d.zero_grad()
        guard_d.check_loss(d_loss).backward()
        opt_d.step()
        g_loss = guard_g.check_loss(-torch.log(disc(fake)).mean())
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    assert guard_d.origin is not None
    assert guard_d.origin.phase == "loss"
    assert guard_g.origin is None
    loss = next(e for e in guard_g.events if e.phase == "loss")
    assert "it was computed through Sequential, watched by another guard" in loss.message


def test_a_bfloat16_activation_near_its_limit_is_called_exploding() -> None:
    model = nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight.fill_(2e37)
        model[0].bias.zero_()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.full((2, 4), 3.0, dtype=torch.bfloat16))
        guard.step()
    risk = [e for e in guard.events if "about to overflow" in e.message]
    assert risk
    assert "exploding" in risk[0].message
    assert "float32" not in risk[0].message


class NaiveSoftplus(nn.Module):
    """log(1 + exp(x)) written by hand: exp overflows for x > 88."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.log(1 + torch.exp(x))


def test_a_generator_loss_through_a_discriminator_overflowing_this_step_points_at_it() -> None:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 6))
    disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1), NaiveSoftplus())
    with torch.no_grad():
        disc[2].bias.fill_(95.0)  # exp(95) overflows float32
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-3)
    with (
        nanguard.watch(gen, optimizer=opt_g, on_nonfinite="log") as guard_g,
        nanguard.watch(disc, optimizer=opt_d, on_nonfinite="log"),
    ):
        g_loss = guard_g.check_loss(disc(gen(torch.randn(5, 4))).mean())
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
    assert guard_g.origin is None
    loss = next(e for e in guard_g.events if e.phase == "loss")
    assert "it was computed through Sequential, watched by another guard" in loss.message
    assert "NaiveSoftplus" in loss.message


class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = LogOf()
        self.b = ExpOf()
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.a(x) + self.b(x))


class LogOf(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)


class ExpOf(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.exp(x * 1000)


def test_without_a_replay_a_second_origin_keeps_the_probes_evidence() -> None:
    torch.manual_seed(0)
    model = TwoHeads()
    with nanguard.watch(model, on_nonfinite="log", replay=False) as guard:
        model(torch.randn(4, 8)).sum().backward()
        guard.step()
    assert [e.module for e in guard.events if e.is_origin] == ["a", "b"]


@pytest.mark.parametrize("checked", [True, False])
def test_a_generator_loss_through_a_discriminator_stepped_into_nan_points_at_it(
    checked: bool,
) -> None:
    # At step 1 D's own forward overflows, its loss is inf - inf and its step writes NaN into
    # its weights; G's loss through D is NaN, whether or not G's guard saw the loss.
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1), NaiveSoftplus())
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-3)
    with (
        nanguard.watch(gen, optimizer=opt_g, on_nonfinite="log") as guard_g,
        nanguard.watch(disc, optimizer=opt_d, on_nonfinite="log") as guard_d,
    ):
        for step in range(2):
            if step == 1:
                with torch.no_grad():
                    disc[2].bias.fill_(95.0)
            fake = gen(torch.randn(5, 4))
            d_loss = disc(torch.randn(5, 6)).mean() - disc(fake.detach()).mean()
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            g_loss = -disc(fake).mean()
            if checked:
                g_loss = guard_g.check_loss(g_loss)
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
    assert guard_d.origin is not None
    assert guard_d.origin.module_type == "NaiveSoftplus"
    assert guard_g.origin is None
    loss = next(e for e in guard_g.events if e.phase == "loss")
    assert "watched by another guard" in loss.message


def test_a_nan_in_the_discriminators_real_batch_does_not_excuse_the_generators_log0() -> None:
    torch.manual_seed(0)
    gen = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 6))
    disc = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1), nn.Sigmoid())
    with torch.no_grad():
        disc[2].bias.fill_(-200.0)  # confident: D(fake) is exactly 0
    opt_g = torch.optim.SGD(gen.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(disc.parameters(), lr=1e-3)
    real = torch.randn(5, 6)
    real[2, 1] = float("nan")  # a corrupt real sample: D's own input origin
    with (
        nanguard.watch(gen, optimizer=opt_g, on_nonfinite="log") as guard_g,
        nanguard.watch(disc, optimizer=opt_d, on_nonfinite="log") as guard_d,
    ):
        fake = gen(torch.randn(5, 4))
        d_loss = -(torch.log(disc(real) + 1e-8) + torch.log(1 - disc(fake.detach()) + 1e-8))
        g_loss = guard_g.check_loss(-torch.log(disc(fake)).mean())  # log(0): G's own
        opt_g.zero_grad()
        g_loss.backward()
        opt_g.step()
        opt_d.zero_grad()
        d_loss.mean().backward()
        opt_d.step()
    assert guard_g.origin is not None
    assert (guard_g.origin.phase, guard_g.origin.kind) == ("loss", "inf")
    assert any(e.is_origin and e.phase == "input" for e in guard_d.events)


class RootDecoder(nn.Module):
    """A decoder whose own code takes a sqrt at 0: a finite forward, a NaN backward into the
    encoder's output."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 3)

    def forward(self, h: Tensor) -> Tensor:
        return self.fc(torch.sqrt(h - h.min()))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_decoders_backward_origin_is_found_and_the_encoder_points_at_it(mode: str) -> None:
    torch.manual_seed(0)
    encoder, decoder = nn.Linear(4, 8), RootDecoder()
    opt_e = torch.optim.SGD(encoder.parameters(), lr=1e-3)
    opt_d = torch.optim.SGD(decoder.parameters(), lr=1e-3)
    with (
        nanguard.watch(encoder, optimizer=opt_e, on_nonfinite="log", mode=mode) as guard_e,
        nanguard.watch(decoder, optimizer=opt_d, on_nonfinite="log", mode=mode) as guard_d,
    ):
        loss = guard_d.check_loss((decoder(encoder(torch.randn(16, 4))) - 1).pow(2).mean())
        opt_e.zero_grad()
        opt_d.zero_grad()
        loss.backward()
        opt_e.step()
        opt_d.step()
    origin = guard_d.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == ("backward", "", "grad of args[0]")
    assert guard_e.origin is None
    back = next(e for e in guard_e.events if e.phase == "loss")
    assert "it comes back from RootDecoder, watched by another guard" in back.message


class BNNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.bn(self.a(x))))


@pytest.mark.parametrize("checked", [False, True], ids=["metric", "val-loss-checked"])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_validation_batch_run_with_gradients_on_is_told_as_one(mode: str, checked: bool) -> None:
    # model.eval() without torch.no_grad(): the NaN validation batch is found at the next
    # training step's end; its message says it was that validation forward, not training data.
    torch.manual_seed(0)
    model = BNNet()
    opt = torch.optim.SGD(model.parameters(), 0.05)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:  # type: ignore[arg-type]
        for step in range(5):
            model.train()
            loss = guard.check_loss(model(torch.randn(16, 4)).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 2:
                model.eval()
                for k in range(3):
                    xv = torch.randn(8, 4)
                    if k == 1:
                        xv[5, 2] = float("nan")
                    out = model(xv)
                    if checked:  # (a validation loss, checked and never backpropagated)
                        guard.check_loss(out.pow(2).mean())
                    out.argmax(-1)
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (3, "input", "")
    assert origin.stats is not None
    assert origin.stats.shape == (8, 4)  # (the validation batch, not a training one)
    assert origin.details["eval_without_backward"] is True
    assert "a validation batch run without torch.no_grad()" in origin.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_eval_mode_training_whose_loop_skips_a_nan_loss_is_not_called_validation(
    mode: str,
) -> None:
    # Fine-tuning in eval() (frozen BatchNorm statistics): every forward but the skipped one
    # gets its backward. The NaN batch is a training batch, not a validation pass.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), 1e-2)
    model.eval()
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:  # type: ignore[arg-type]
        for step in range(5):
            x = torch.randn(8, 4)
            if step == 3:
                x[5, 0] = float("nan")
            loss = guard.check_loss(((model(x) - torch.randn(8, 1)) ** 2).mean())
            if not torch.isfinite(loss):
                continue
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "input"
    assert "eval_without_backward" not in origin.details
    assert "validation" not in origin.message
