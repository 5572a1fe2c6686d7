"""Parameters corrupted in optimizer.step(), GradScaler awareness, skip_step, overflow risk."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
import torch.nn.functional as F
from realistic import Fp16MLP, PairwiseDistances, amp_step, fp16_input
from torch import nn

import nanguard


def fp16_adam_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half()
    x = torch.randn(32, 8).half()
    x[:, 5:] = 0  # three features that are never active: their weights get exactly-zero grads
    return model, x, torch.randn(32, 1).half()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_adam_on_fp16_parameters_corrupts_them_in_the_step(mode: str) -> None:
    # Sentinel steps sweep no parameters; the failing step's sweep finds the same origin.
    model, x, y = fp16_adam_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps=1e-8 underflows in float16
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        for _ in range(3):
            loss = guard.check_loss(nn.functional.mse_loss(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.step, origin.module, origin.module_type) == (
        "param",
        0,
        "0",
        "Linear",
    )
    assert origin.param == "0.weight"
    assert origin.stats is not None
    assert origin.stats.nonfinite_count > 0
    assert "became NaN in optimizer.step()" in origin.message
    assert "eps=1e-8 underflows to 0 in float16" in origin.message
    assert origin.hint is not None
    # (the mechanism: small gradients' second moment underflows too, the update is +-Inf)
    assert "second moment (1 - beta2) * grad**2" in origin.hint
    assert "eps" in origin.hint
    # The gradients of step 0 were finite; everything non-finite later is downstream.
    assert [e for e in guard.events if e.is_origin and e.phase != "param"] == []
    later = [e for e in guard.events if e.step >= 1 and e.phase != "param"]
    assert later
    assert all(not e.is_origin for e in later)
    caused = [e for e in guard.events if e.phase == "param" and not e.is_origin]
    assert {e.param for e in caused} <= {"2.weight", "2.bias"}
    assert all("because its gradient was non-finite" in e.message for e in caused)


def test_skip_step_says_it_cannot_stop_an_update_that_made_weights_from_finite_gradients() -> None:
    # optimizer= was passed: the advice to pass it (for a step resolved too late) is wrong
    # here; Adam's float16 arithmetic made the weights, from finite gradients.
    model, x, y = fp16_adam_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with (
        warnings.catch_warnings(),
        nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard,
    ):
        warnings.simplefilter("ignore")
        for _ in range(2):
            loss = guard.check_loss(nn.functional.mse_loss(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.origin is not None
    assert guard.origin.phase == "param"
    dead = [e for e in guard.events if "weights_nonfinite" in e.details]
    assert dead
    assert "made the weights non-finite from finite gradients" in dead[0].message
    assert "pass optimizer=" not in dead[0].message


def test_raise_names_the_parameter_before_the_next_step_changes_anything() -> None:
    model, x, y = fp16_adam_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt) as guard:
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()  # corrupts 0.weight; found at the next step's resolution
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        with pytest.raises(nanguard.NonFiniteError, match=r"parameter `0.weight` \(Linear\)"):
            opt.step()
    assert guard.origin is not None
    assert guard.origin.step == 0


def test_buffer_poisoned_by_a_nan_batch_is_reported() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(3):
            x = torch.randn(8, 4)
            if step == 1:
                x[0, 0] = float("nan")
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    buffers = [e for e in guard.events if e.phase == "param" and e.details.get("buffer")]
    assert {e.param for e in buffers} >= {"1.running_mean", "1.running_var"}
    assert all(e.step == 1 and not e.is_origin for e in buffers)
    assert "later evaluations in eval() mode" in buffers[0].message
    assert guard.origin is not None
    assert (guard.origin.phase, guard.origin.step) == ("input", 1)  # the buffers only followed


def test_causal_mask_buffer_is_not_corruption() -> None:
    class WithMask(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("causal", torch.triu(torch.full((4, 4), float("-inf")), 1))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.softmax(self.fc(x) + self.causal, dim=-1)

    model = WithMask()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt) as guard:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(4, 4)).pow(2).sum().backward()
            opt.step()
    assert guard.events == []


def test_grad_scaler_overflow_skips_are_expected_not_errors() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # far too large: overflows
    x, y = torch.randn(32, 16) * 10, torch.randn(32, 4)
    with nanguard.watch(model, optimizer=opt, scaler=scaler) as guard:  # on_nonfinite="raise"
        for _ in range(6):
            amp_step(model, opt, scaler, x, y)
        assert "update" in scaler.__dict__  # observed while attached...
    assert "update" not in scaler.__dict__  # ...and restored after
    skips = [e for e in guard.events if e.kind == "amp_overflow"]
    assert len(skips) == 6
    assert all(not e.is_origin for e in skips)
    assert guard.origin is None
    assert skips[0].details["scale_before"] == 2.0**40
    assert skips[0].details["scale_after"] == 2.0**39
    # (GradScaler's flag says non-finite, not which: an overflow is the usual reading)
    assert "non-finite at scale 1.09951e+12, taken for an overflow" in skips[0].message
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert guard.current_step == 6


def test_a_forward_overflow_under_grad_scaler_is_an_origin_and_its_skip_says_so() -> None:
    # Raw prices (up to ~5e5) fed to a float16-autocast model: the cast of the batch itself
    # overflows 65504. GradScaler skips the step, but no scale fixes a forward overflow.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.rand(64, 6) * torch.tensor([5e5, 3e3, 10.0, 1.0, 2e4, 50.0])
    y = torch.randn(64, 1)
    with nanguard.watch(model, optimizer=opt, scaler=scaler, on_nonfinite="log") as guard:
        amp_step(model, opt, scaler, x, y)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "0")
    assert "float16" in (origin.hint or "")
    skip = next(e for e in guard.events if e.kind == "amp_overflow")
    assert skip.details["explained_by_origin"] is True
    assert "not from the loss scaling" in skip.message
    assert "expected" not in skip.message


def test_skip_step_puts_back_the_scale_a_nan_batch_made_grad_scaler_halve() -> None:
    """A corrupt batch makes GradScaler skip the step and halve its scale, though no scale
    would have helped: under skip_step the scale goes back, so the run ends as one that
    never saw that batch (a loader with a bad sample every few hundred steps would push the
    float16 scale down for good). A real overflow still halves it."""
    torch.manual_seed(0)

    def run(drop: bool) -> tuple[nn.Module, torch.amp.GradScaler, nanguard.Guard | None]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        gen = torch.Generator().manual_seed(1)
        guard = (
            None
            if drop
            else nanguard.watch(model, optimizer=opt, scaler=scaler, on_nonfinite="skip_step")
        )
        with guard if guard is not None else contextlib.nullcontext():
            for i in range(6):
                x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 4, generator=gen)
                if i == 3:
                    if drop:
                        continue  # the reference never sees the corrupt batch
                    x[7, 2] = float("nan")
                amp_step(model, opt, scaler, x, y)
        return model, scaler, guard

    model, scaler, guard = run(drop=False)
    reference, ref_scaler, _ = run(drop=True)
    assert guard is not None
    assert scaler.get_scale() == ref_scaler.get_scale() == 2.0**10
    assert scaler.state_dict() == ref_scaler.state_dict()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    (skip,) = [e for e in guard.events if e.details.get("skipped")]
    assert skip.step == 3
    assert "(its scale put back to 1024: not an overflow)" in skip.message
    overflow = next(e for e in guard.events if e.kind == "amp_overflow")
    assert "on_nonfinite='skip_step' puts it back to 1024." in overflow.message


def test_grad_scaler_that_settles_trains_quietly() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    with nanguard.watch(model, optimizer=opt, scaler=scaler) as guard:
        for _ in range(10):
            amp_step(model, opt, scaler, x, y)
    assert guard.events == []
    assert guard.current_step == 10


def test_collapsing_grad_scaler_scale_warns_and_names_the_backward_at_fault() -> None:
    class Broken(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x - x.detach()).abs().sqrt() + x  # sqrt at 0: NaN gradient at any scale

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Broken(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    x, y = torch.randn(4, 8), torch.randn(4, 1)
    guard = nanguard.Guard(
        model, optimizer=opt, scaler=scaler, on_nonfinite="warn", amp_max_skips=5
    )

    def train() -> None:
        with guard:
            for _ in range(6):
                amp_step(model, opt, scaler, x, y)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train()
    texts = [str(w.message) for w in caught if issubclass(w.category, nanguard.NonFiniteWarning)]
    # (Told when the scale reaches the floor, 16 halved four times, with the step it
    # localises: before amp_max_skips=5.)
    assert any("skipped 4 steps in a row and its scale fell to 1" in t for t in texts)
    g = guard
    collapse = [e for e in g.events if e.details.get("collapse")]
    assert len(collapse) == 1
    assert collapse[0].kind == "amp_overflow"
    assert "not an overflow that scaling fixes" in collapse[0].message
    # The NaN is there at any scale: a replay of the first skipped step's backward from the
    # unscaled gradients makes it again, and names it at that step already (not only at the
    # floor, four halvings later).
    origin = g.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.module_type) == (
        0,
        "backward",
        "1",
        "Broken",
    )
    assert origin.op is not None
    assert "SqrtBackward0" in origin.op


def test_a_large_init_scale_backing_off_is_not_called_hopeless() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    # A loss near 1e6 scaled by 2**120 overflows float32: one halving per skipped step.
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**120)
    x, y = torch.randn(4, 8), torch.randn(4, 1) * 1e3
    with nanguard.watch(
        model, optimizer=opt, scaler=scaler, on_nonfinite="log", amp_max_skips=3
    ) as guard:
        for _ in range(4):
            amp_step(model, opt, scaler, x, y)
    collapse = [e for e in guard.events if e.details.get("collapse")]
    assert len(collapse) == 1
    assert "a run of skips at the start is normal" in collapse[0].message
    assert "at any scale" not in collapse[0].message
    assert guard.origin is None


def test_a_checkpoint_with_many_nan_weights_is_one_event_per_few_parameters() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(50)))
    with torch.no_grad():
        for layer in model:
            layer.weight[0, 0] = float("nan")  # a corrupt checkpoint
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(2, 8)).sum().backward()
        guard.step()
    params = [e for e in guard.events if e.phase == "param"]
    assert [e.param for e in params[:3]] == ["0.weight", "1.weight", "2.weight"]
    assert all(e.is_origin for e in params[:3])
    assert len(params) == 4  # max_propagated=3, then one event for the rest
    rest = params[3]
    assert not rest.is_origin
    assert rest.details["more"] == 47
    assert rest.details["names"][0] == "3.weight"
    assert "47 more parameters are non-finite too" in rest.message


def test_skip_step_keeps_the_weights_finite_and_training_continues() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), PairwiseDistances(), nn.Linear(6, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    bad = torch.randn(6, 8)  # rows are distinct, but a distance to itself is always 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard:
        opt.zero_grad()
        model(bad).pow(2).mean().backward()  # NaN gradients (sqrt at 0)
        opt.step()
        for key, value in model.state_dict().items():
            assert torch.equal(value, before[key]), key  # skipped: unchanged
        assert opt.state == {} or all(not s for s in opt.state.values())
        skipped = [e for e in guard.events if e.details.get("skipped")]
        assert len(skipped) == 1
        assert "optimizer step was skipped" in skipped[0].message
        assert guard.origin is not None
        assert guard.origin.module == "1"
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_step_keeps_weights_of_a_second_optimizer_finite_too() -> None:
    # A backbone/head split: the guard knows one optimizer, the other steps after it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), PairwiseDistances(), nn.Linear(6, 1))
    body = torch.optim.AdamW(model[0].parameters(), lr=1e-2)
    head = torch.optim.SGD(model[2].parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=body, on_nonfinite="skip_step") as guard:
        body.zero_grad()
        head.zero_grad()
        model(torch.randn(6, 8)).pow(2).mean().backward()  # NaN gradients (sqrt at 0)
        body.step()
        head.step()
    assert any(e.details.get("skipped") for e in guard.events)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_disabled_grad_scaler_is_accepted() -> None:
    # GradScaler(enabled=use_fp16) is how "AMP optional" is written: off in a bf16 run.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    with nanguard.watch(model, optimizer=opt, scaler=scaler) as guard:
        for _ in range(3):
            amp_step(model, opt, scaler, x, y)
    assert guard.events == []
    assert guard.current_step == 3


def test_skip_step_raises_after_too_many_skips() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), PairwiseDistances(), nn.Linear(6, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(6, 8)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step", max_consecutive_skips=3):
        for step in range(3):
            opt.zero_grad()
            model(x).sum().backward()
            if step < 2:
                opt.step()
            else:
                with pytest.raises(nanguard.NonFiniteError, match="3 optimizer steps in a row"):
                    opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_overflow_risk_is_flagged_before_the_overflow() -> None:
    model = Fp16MLP().half()
    with nanguard.watch(model, on_nonfinite="log") as guard, torch.no_grad():
        model(fp16_input(level=300.0))  # 128 * 300 = 38400: finite, 59% of 65504
        model(fp16_input(level=300.0))
    risks = [e for e in guard.events if e.kind == "overflow_risk"]
    modules = [e.module for e in risks]
    assert len(modules) == len(set(modules))  # once per module, not every forward
    risk = risks[0]
    assert (risk.module, risk.phase, risk.is_origin) == ("up", "forward", False)
    assert 0.5 < risk.details["fraction"] < 1.0
    assert "about to overflow" in risk.message
    assert guard.origin is None


def test_overflow_risk_can_be_switched_off() -> None:
    model = Fp16MLP().half()
    with nanguard.watch(model, overflow_fraction=None) as guard, torch.no_grad():
        model(fp16_input(level=300.0))
    assert guard.events == []


class QueryPool(nn.Module):
    """Attention pooling with a learned query the module owns itself."""

    def __init__(self) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(1, 1, 16))
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, e: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.attn(self.query.expand(len(e), 1, 16), e, e, key_padding_mask=pad)[0].sum()


def test_after_a_logged_failure_a_parent_with_poisoned_parameters_is_not_a_new_origin() -> None:
    """Step 0: a fully masked row makes NaN, SGD applies it to every weight (policy "log").
    Step 1 is non-finite only because of those weights, the parent's own query too."""
    torch.manual_seed(0)
    model = QueryPool()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(2):
            pad = torch.zeros(4, 5, dtype=torch.bool)
            pad[1] = step == 0  # sample 1 has no valid key at step 0
            loss = guard.check_loss(model(torch.randn(4, 5, 16), pad))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.step, e.phase, e.module) for e in origins] == [(0, "forward", "attn")]
    assert not [e for e in guard.events if e.step == 1 and e.phase == "forward" and e.is_origin]


def test_unnormalised_inputs_under_float16_autocast_name_the_overflowing_weight_gradient() -> None:
    """Inputs around 5000 (not normalised): a weight gradient overflows float16 at any
    scale; GradScaler skips every step until its scale reaches the floor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    with nanguard.watch(model, optimizer=opt, scaler=scaler, on_nonfinite="log") as guard:
        for _ in range(12):
            amp_step(model, opt, scaler, torch.randn(64, 32) * 5000, torch.randn(64, 1))
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "2", "Linear")
    assert origin.op is not None
    assert "AddmmBackward0" in origin.op
    assert origin.source is None  # no user code inside nn.Linear
    assert origin.hint is not None
    assert "overflowed float16" in origin.hint


def test_parameters_replaced_after_watch_are_the_ones_checked() -> None:
    """load_state_dict(assign=True) puts new Parameter objects into the modules."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model.load_state_dict(state, assign=True)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        for step in range(4):
            loss = guard.check_loss(model(torch.randn(8, 4)).mean())
            opt.zero_grad()
            loss.backward()
            guard.step()
            opt.step()
            if step == 1:
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")  # corrupted between steps
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param, origin.step) == ("param", "0.weight", 1)


class FeedForward(nn.Module):
    """T5's feed-forward sublayer: wi -> relu -> wo -> dropout, plus the residual."""

    def __init__(self) -> None:
        super().__init__()
        self.wi = nn.Linear(16, 64, bias=False)
        self.wo = nn.Linear(64, 16, bias=False)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.wo(torch.relu(self.wi(x))))


def test_one_large_activation_is_one_overflow_warning_not_one_per_enclosing_module() -> None:
    """T5 in float16: wo's output nears 65504; the dropout after it, the sublayer and the
    block around it carry the same values and are not warned about again."""
    torch.manual_seed(0)
    model = nn.Sequential(FeedForward(), nn.Linear(16, 1))
    x = torch.randn(4, 16)
    ff = model[0]
    with torch.no_grad():
        peak = ff.wo(torch.relu(ff.wi(x))).abs().max()
        ff.wo.weight.mul_(40000 / peak)  # wo's outputs reach 40000 of float16's 65504
    model.half()
    with nanguard.watch(model, on_nonfinite="log") as guard, torch.no_grad():
        model(x.half())
    risks = [e for e in guard.events if e.kind == "overflow_risk"]
    assert [e.module for e in risks] == ["0.wo"]


def test_a_weight_found_by_a_later_sweep_says_when_it_could_have_changed() -> None:
    # Adam(eps=0): embedding rows outside the batch get a zero gradient and turn into 0/0 in
    # the first optimizer step; the same rows are never looked up again, so only the sweep
    # at the end finds them, steps later.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 16), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    idx = torch.randint(0, 1000, (8, 4))
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(3):
            loss = guard.check_loss(model(idx).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("param", "0.weight")
    assert "between step 0 and step" in origin.message
    assert origin.hint is not None
    assert "eps" in origin.hint


def test_steps_that_grad_scaler_skips_unseen_are_warned_about() -> None:
    # GradScaler not passed as scaler=: every step it skips never reaches optimizer.step(),
    # so nanguard never sees the step end and keeps each forward.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**100)  # overflows at every step
    x, y = torch.randn(32, 16), torch.randn(32, 4)
    with (
        warnings.catch_warnings(record=True) as caught,
        nanguard.watch(model, optimizer=opt, on_nonfinite="log"),
    ):
        warnings.simplefilter("always")
        for _ in range(70):
            amp_step(model, opt, scaler, x, y)
    messages = [str(w.message) for w in caught]
    assert sum("forwards since the last optimizer step" in m for m in messages) == 1  # once
    assert sum("is in scope but was not passed" in m for m in messages) == 1  # at watch()


def test_a_grad_scaler_not_passed_to_watch_is_pointed_out() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows the first steps
    x, y = torch.randn(32, 16) * 10, torch.randn(32, 4)
    with pytest.warns(RuntimeWarning, match=r"GradScaler \(`scaler`\) is in scope but was not"):
        guard = nanguard.watch(model, optimizer=opt, on_nonfinite="log")
    with guard:
        amp_step(model, opt, scaler, x, y)  # the scaler skips opt.step()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.stats is not None
    assert (origin.kind, origin.stats.dtype) == ("inf", "torch.float16")
    assert origin.hint is not None
    assert origin.hint.startswith("If the loss was scaled by a GradScaler")
    assert "nanguard.watch(..., scaler=scaler)" in origin.hint


def test_a_grad_scaler_passed_to_watch_gives_no_warning() -> None:
    model = nn.Sequential(nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nanguard.watch(model, optimizer=opt, scaler=scaler):
            pass
    assert scaler.is_enabled()


class NormFeatureTagger(nn.Module):
    """A token tagger with a hand-written norm feature: padded positions are zeroed, so the
    norm's sqrt is taken at 0 there and only the padding embedding row gets a NaN gradient."""

    def __init__(self, vocab: int = 200, dim: int = 16, tags: int = 5) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim + 1, tags)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        e = self.emb(ids) * (ids != 0).unsqueeze(-1)
        norm = torch.sqrt((e**2).sum(-1, keepdim=True))
        return self.fc(torch.cat([e, norm], -1))


def test_a_weight_a_later_sweep_finds_is_blamed_on_the_earlier_bad_gradient() -> None:
    # Step 1's NaN gradient reaches the padding row in optimizer.step(); the row is never
    # looked up again, so only the sweep at step 16 finds it: that is step 1's doing.
    torch.manual_seed(0)
    model = NormFeatureTagger()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(18):
            ids = torch.randint(1, 200, (8, 12))
            if step == 1:
                ids[3, 8:] = 0  # padding
            loss = guard.check_loss(
                nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten() % 5)
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert torch.isnan(model.emb.weight[0]).all()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.step, e.phase) for e in origins] == [(1, "backward")]
    param = next(e for e in guard.events if e.phase == "param")
    assert (param.step, param.param, param.is_origin) == (1, "emb.weight", False)
    assert "because its gradient was non-finite" in param.message
    assert "although" not in param.message


def test_batchnorm_statistics_overflowing_in_the_forward_are_not_called_old_corruption() -> None:
    # Finite but exploding activations (up to ~3e38): the batch variance overflows float32.
    # The running statistics this same forward updated are a consequence, not the cause.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[0].weight.fill_(3e37)  # every feature ~1e38, same sign: its batch sum overflows
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        loss = guard.check_loss(model(torch.rand(16, 8) * 0.9 + 0.1).pow(2).mean())
        loss.backward()
        opt.step()
    assert not torch.isfinite(model[1].running_var).all()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.module) for e in origins] == [("forward", "1")]
    origin = origins[0]
    assert "corrupted before this forward" not in origin.message
    assert origin.hint is not None
    assert "exploding" in origin.hint
    buffers = [e for e in guard.events if e.phase == "param" and e.details.get("buffer")]
    assert buffers
    assert all(not e.is_origin for e in buffers)


def test_events_after_an_input_origin_name_the_input_batch() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(16, 8)
    x[3, 2] = float("nan")  # a missing value in one sample
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        guard.check_loss(model(x).pow(2).mean()).backward()
        opt.step()
    assert guard.origin is not None
    assert guard.origin.phase == "input"
    later = [e for e in guard.events if not e.is_origin and e.phase in ("forward", "loss")]
    assert later
    for event in later:
        assert "created earlier, in the input batch" in event.message
        assert "already non-finite" not in event.message


def test_detach_does_not_judge_gradients_no_step_of_the_guard_will_apply() -> None:
    # A GAN's discriminator guard: after its last step, the generator's backward through it
    # leaves large gradients in .grad that its next zero_grad() would discard.
    torch.manual_seed(0)
    disc = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    opt = torch.optim.SGD(disc.parameters(), lr=1e-3)
    guard = nanguard.watch(disc, optimizer=opt, on_nonfinite="log")
    for _ in range(20):
        opt.zero_grad()
        disc(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    opt.zero_grad()
    (disc(torch.randn(16, 8)).mean() * 1e4).backward()  # the generator's loss, through it
    guard.detach()
    assert [e for e in guard.events if e.kind == "grad_norm"] == []
    assert guard.events == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_finfo_min_mask_in_half_precision_is_no_overflow_risk(dtype: torch.dtype) -> None:
    """The half-precision-safe way to mask logits (Hugging Face, RL policies): the dtype's
    most negative value, written on purpose, is not an activation about to overflow."""

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(10, 64), nn.Tanh())
            self.pi = nn.Linear(64, 6)

        def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
            logits = self.pi(self.body(obs))
            return logits.masked_fill(~legal, torch.finfo(logits.dtype).min)

    torch.manual_seed(0)
    model = Policy().to(dtype)
    with nanguard.watch(model) as guard:
        for _ in range(3):
            legal = torch.rand(32, 6) > 0.4
            legal[:, 0] = True
            model(torch.randn(32, 10, dtype=dtype), legal).float().logsumexp(-1).mean().backward()
            guard.step()
    assert guard.events == []


class ActNorm(nn.Module):
    """Glow's ActNorm with karpathy's data-dependent initialisation from the first batch."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.s = nn.Parameter(torch.randn(1, dim))
        self.t = nn.Parameter(torch.randn(1, dim))
        self.initialised = False

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.initialised:
            self.s.data = (-torch.log(x.std(dim=0, keepdim=True))).detach()
            self.t.data = (-(x * torch.exp(self.s)).mean(dim=0, keepdim=True)).detach()
            self.initialised = True
        return x * torch.exp(self.s) + self.t, torch.sum(self.s, dim=1)


class ActNormFlow(nn.Module):
    def __init__(self, dim: int = 4) -> None:
        super().__init__()
        self.norm = ActNorm(dim)
        self.net = nn.Sequential(nn.Linear(dim, 32), nn.Tanh(), nn.Linear(32, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z, logdet = self.norm(x)
        return z + self.net(z), logdet


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_weight_written_non_finite_by_the_first_forward_is_not_blamed_on_a_checkpoint(
    mode: str,
) -> None:
    # A binary flag absent from the first batch: a constant feature, std 0, s = -log(0).
    torch.manual_seed(0)
    model = ActNormFlow()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(256, 4)
    x[:, 3] = 0.0
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        z, logdet = model(x)
        loss = guard.check_loss((0.5 * z.pow(2).sum(1) - logdet).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.step, origin.param, origin.kind) == ("param", 0, "norm.s", "inf")
    assert "became +Inf before any optimizer step, in a forward or in code between" in (
        origin.message
    )
    assert "checkpoint" not in origin.message
    assert origin.hint is not None
    assert origin.hint.startswith(
        "The weight became +Inf outside any optimizer step: written by its module's forward"
    )


def test_the_gradients_read_at_a_step_end_are_those_that_changed_since_the_last() -> None:
    # The grad-norm guard reads a gradient once: a new one (zero_grad set it to None), one
    # accumulated into in place, one replaced; never one nobody recomputed since.
    from nanguard._params import ParamTable

    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    table = ParamTable(model, {})
    assert table.grads() == ([], [])  # no gradient yet

    def backward() -> None:
        model(torch.randn(5, 4)).sum().backward()

    backward()
    indices, grads = table.grads()
    assert indices == [0, 1, 2, 3]
    assert all(g is p.grad for g, p in zip(grads, model.parameters(), strict=True))
    assert table.grads() == ([], [])  # nothing recomputed since
    backward()  # accumulated in place: every gradient's version moved
    assert table.grads()[0] == [0, 1, 2, 3]
    model[1].bias.grad = torch.zeros(2)  # one replaced
    model[0].weight.grad = None  # one dropped
    indices, grads = table.grads()
    assert indices == [3]
    assert grads[0] is model[1].bias.grad
    model.zero_grad(set_to_none=True)
    backward()  # every gradient new
    assert table.grads()[0] == [0, 1, 2, 3]
    with torch.inference_mode():
        model[0].bias.grad = torch.ones(3)  # an inference tensor has no version counter
    assert table.grads()[0] == [1]
    assert table.grads() == ([], [])


class SqrtGate(nn.Module):
    """A gate kept >= 0 through sqrt, starting at 0: d sqrt / d gamma is Inf at any scale."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(64, 256), nn.Linear(256, 10)
        self.gamma = nn.Parameter(torch.zeros(256))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.sqrt(self.gamma) * F.gelu(self.fc1(x)))


def test_skip_step_stops_a_scale_collapsing_under_a_real_bug_after_max_skips() -> None:
    # Every skip under a NaN no scale fixes counts: each step's replay from the unscaled
    # gradients makes it again (an origin each), skip_step puts the scale back, and the
    # run stops after max_consecutive_skips instead of halving the scale to nothing.
    torch.manual_seed(0)
    model = SqrtGate()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    guard = nanguard.watch(
        model, optimizer=opt, scaler=scaler, on_nonfinite="skip_step", max_consecutive_skips=4
    )

    def train_step() -> None:
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def train_steps(n: int) -> None:
        for _ in range(n):
            train_step()

    with guard, pytest.raises(nanguard.NonFiniteError, match="4 optimizer steps in a row"):
        train_steps(30)
    assert guard.current_step < 10
    origins = [e for e in guard.events if e.is_origin]
    assert [e.step for e in origins] == [0, 1, 2, 3]
    assert all(e.op == "aten.div.Tensor in SqrtBackward0" for e in origins)
    skips = [e for e in guard.events if e.kind == "amp_overflow"]
    assert skips
    assert not any("Occasional skips are expected" in e.message for e in skips)
    assert scaler.get_scale() == 4.0  # (put back: a smaller scale fixes nothing here)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_guard_step_with_a_scaler_leaves_its_expected_overflows_to_scaler_update() -> None:
    # No optimizer=: the README's guard.step() before the optimizer's (scaler's) step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 512))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)  # skips at the start
    with nanguard.watch(model, scaler=scaler) as guard:  # on_nonfinite="raise"
        for _ in range(5):
            x, y = torch.randn(128, 64), torch.randint(0, 512, (128,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = guard.check_loss(F.cross_entropy(model(x).float(), y))
            opt.zero_grad()
            scaler.scale(loss).backward()
            assert guard.step() == []
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() < 2.0**24  # it did skip
    assert guard.current_step == 5
    assert guard.origin is None
    assert {e.kind for e in guard.events} == {"amp_overflow"}


class UnstableSoftmaxAttention(nn.Module):
    """Unscaled scores and a softmax written without subtracting the max."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.q(x) @ self.k(x).transpose(-1, -2)
        w = s.exp()
        w = w / w.sum(-1, keepdim=True)
        return w @ self.v(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_an_exp_past_float32s_range_under_autocast_gets_the_log_space_hint(
    dtype: torch.dtype,
) -> None:
    # Scores reach ~390: exp overflows float32 and bfloat16 too, so "use float32" is no fix.
    torch.manual_seed(0)
    model = UnstableSoftmaxAttention()
    with torch.no_grad():
        model.q.weight.mul_(6.0)
        model.k.weight.mul_(6.0)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        with torch.autocast("cpu", dtype=dtype):
            out = model(torch.randn(2, 16, 64))
        guard.check_loss(out.float().sum())
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.op) == ("forward", "aten.exp.default")
    assert origin.hint is not None
    assert "stay in log space" in origin.hint
    assert "subtract the max first" in origin.hint
    assert "Use bfloat16" not in origin.hint
    assert "exploding" not in origin.hint


def test_a_scaled_gradient_overflowing_in_the_loss_backward_is_not_said_to_be_unscalable() -> None:
    # At the floor, the loss's own backward (on the scaled loss) overflows float16 where it
    # casts back to the logits: the loss itself was finite, so its skip is not "explained".
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 512))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0)  # at the floor after one skip
    x, y = torch.randn(128, 64), torch.randint(0, 512, (128,))
    with nanguard.watch(model, optimizer=opt, scaler=scaler, on_nonfinite="log") as guard:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = 1e7 * F.cross_entropy(model(x).float(), y)  # over-weighted, finite
        loss = guard.check_loss(loss)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details["reason"]) == ("loss", "loss_backward")
    (skip,) = [
        e for e in guard.events if e.kind == "amp_overflow" and not e.details.get("collapse")
    ]
    assert not skip.details.get("explained_by_origin")
    assert "already held NaN/Inf" not in skip.message


class GatedResidual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.gamma = nn.Parameter(torch.zeros(64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.sqrt(self.gamma) * F.gelu(self.fc(x))


def test_other_blocks_bad_parameter_gradients_are_not_called_propagated_from_a_params_origin() -> (
    None
):
    # Every block's sqrt(gamma) at 0 makes its own Inf gradient; the gradient each block
    # receives is finite. Only the first in the backward is localised.
    torch.manual_seed(0)
    model = nn.Sequential(GatedResidual(), GatedResidual(), GatedResidual(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        loss = guard.check_loss(
            F.cross_entropy(model(torch.randn(32, 64)), torch.randint(0, 10, (32,)))
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.details["reason"]) == (
        "backward",
        "2",
        "backward_params",
    )
    others = {e.param: e.message for e in guard.events if e.phase == "grad" and e.module != "2"}
    assert set(others) == {"0.gamma", "1.gamma"}
    assert all("propagated, not an origin" not in m for m in others.values())
    assert all("or made by its own module's backward" in m for m in others.values())


class BackboneAndHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU())
        self.head = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


def _two_optimizer_amp_run(
    options: dict[str, object] | None,
) -> tuple[nn.Module, list[float], list]:
    """The AMP recipe for two optimizers (a backbone's and a head's) sharing one GradScaler:
    early on only the head's scaled gradients overflow float16, so GradScaler skips the
    head's step and lets the backbone's go ahead."""
    torch.manual_seed(0)
    model = BackboneAndHead()
    opt0 = torch.optim.SGD(model.backbone.parameters(), lr=0.05, momentum=0.9)
    opt1 = torch.optim.Adam(model.head.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**22, growth_interval=3)
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(64, 32, generator=gen), torch.randint(0, 10, (64,), generator=gen))]
    batches *= 8
    guard = None
    if options is not None:
        guard = nanguard.watch(model, optimizer=opt0, scaler=scaler, **options)
    scales, head_skipped = [], []
    try:
        for x, y in batches:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x).float(), y)
            opt0.zero_grad()
            opt1.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt0)
            scaler.step(opt1)
            state = scaler._per_optimizer_states[id(opt1)]
            head_skipped.append(sum(v.item() for v in state["found_inf_per_device"].values()))
            scaler.update()
            scales.append(scaler.get_scale())
    finally:
        if guard is not None:
            guard.detach()
    return model, scales, head_skipped, guard


@pytest.mark.parametrize(
    "options",
    [{}, {"mode": "sentinel"}, {"on_nonfinite": "skip_step"}],
    ids=["full", "sentinel", "skip"],
)
def test_a_head_optimizer_that_grad_scaler_skips_is_no_alarm_for_the_backbones(
    options: dict[str, object],
) -> None:
    reference, scales, skipped, _ = _two_optimizer_amp_run(None)
    assert 1 in skipped[:3]  # (the case: the head's step skipped while the backbone's ran)
    model, guarded_scales, _, guard = _two_optimizer_amp_run(options)
    assert guard is not None
    assert guard.origin is None
    assert {e.kind for e in guard.events} <= {"amp_overflow"}
    assert guarded_scales == scales
    for (name, a), b in zip(
        reference.state_dict().items(), model.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


class ProbedBackbone(nn.Module):
    """A backbone and an online linear probe on its detached features (SSL's linear
    evaluation during pre-training), the probe also reading metadata columns."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64))
        self.probe = nn.Linear(64 + 4, 10)

    def forward(self, x: torch.Tensor, meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.backbone(x)
        return h, self.probe(torch.cat([h.detach(), meta], dim=1))


def test_skip_step_with_a_second_optimizer_still_to_step_through_grad_scaler() -> None:
    torch.manual_seed(0)
    model = ProbedBackbone()
    opt0 = torch.optim.SGD(model.backbone.parameters(), lr=0.1)
    opt1 = torch.optim.SGD(model.probe.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y, meta = torch.randn(16, 32), torch.randint(0, 10, (16,)), torch.randn(16, 4)
    meta[3, 1] = float("nan")  # a corrupt metadata column: only the probe reads it
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with nanguard.watch(model, optimizer=opt0, scaler=scaler, on_nonfinite="skip_step") as guard:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h, logits = model(x, meta)
            loss = h.pow(2).mean() + F.cross_entropy(logits.float(), y)
        opt0.zero_grad()
        opt1.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt0)  # GradScaler found the backbone's gradients finite: it steps
        scaler.step(opt1)  # (no "No inf checks were recorded for this optimizer")
        scaler.update()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "input"
    assert any(e.details.get("skipped") for e in guard.events)
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name  # neither optimizer moved anything
    assert scaler.get_scale() == 2.0**10  # the probe's skip was the batch's, not an overflow


class HandWrittenLayerNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        var = (x * x).mean(-1, keepdim=True) - mean * mean  # E[x^2] - E[x]^2: x*x overflows
        return (x - mean) / torch.sqrt(var + 1e-5) * self.weight + self.bias


@pytest.mark.parametrize("half", [True, False], ids=["model.half()", "autocast"])
def test_a_float16_overflow_hint_fits_how_the_model_runs_in_float16(half: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 128), HandWrittenLayerNorm(128), nn.Linear(128, 1))
    with torch.no_grad():
        model[0].bias.fill_(300.0)  # a large offset: 300**2 is past float16's 65504
    x = torch.randn(16, 32)
    if half:
        model, x = model.half(), x.half()
    autocast = torch.autocast("cpu", dtype=torch.float16, enabled=not half)
    with nanguard.watch(model, on_nonfinite="log") as guard, autocast:
        model(x).float().mean().backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.module == "1"
    assert origin.op == "aten.mul.Tensor"
    assert origin.hint is not None
    assert "overflowed float16" in origin.hint
    if half:  # (no autocast to turn off: the weights are float16 themselves)
        assert "autocast(enabled=False)" not in origin.hint
        assert "x.float()" in origin.hint
    else:
        assert "autocast(enabled=False)" in origin.hint


def test_an_output_that_overflowed_is_its_steps_origin_not_also_about_to_overflow() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 1))
    with torch.no_grad():
        model[0].weight.mul_(3000.0)  # unnormalised features: float16 overflows here
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    torch.manual_seed(5)
    x = torch.randn(8, 16) * 10
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        with torch.autocast("cpu", dtype=torch.float16):
            out = model(x)
        opt.zero_grad()
        out.float().pow(2).mean().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.kind) == ("0", "inf")
    assert [e for e in guard.events if e.kind == "overflow_risk" and e.module == "0"] == []


def test_a_grad_scaler_scale_that_reaches_zero_is_said_to_be_dead_for_good() -> None:
    # Under "warn" training goes on while GradScaler halves its scale at each skipped
    # step: from a tiny scale it reaches 0 in a few steps, and 0 never grows back.
    torch.manual_seed(0)
    model = SqrtGate()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**-146)
    with (
        warnings.catch_warnings(record=True) as caught,
        nanguard.watch(model, optimizer=opt, scaler=scaler, on_nonfinite="warn") as guard,
    ):
        warnings.simplefilter("always")
        for _ in range(6):
            x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x).float(), y)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert scaler.get_scale() == 0.0
    dead = [e for e in guard.events if e.details.get("scale_zero")]
    assert len(dead) == 1  # (once, not at every later step)
    assert "can never grow back" in dead[0].message
    assert any("can never grow back" in str(w.message) for w in caught)


def test_skip_step_leaves_nothing_for_a_second_optimizer_stepped_without_grad_scaler() -> None:
    # The online probe's optimizer is stepped directly (its own loss, not scaled): the
    # skip must leave it no gradient to apply, not NaN meant for GradScaler.
    torch.manual_seed(0)
    model = ProbedBackbone()
    opt = torch.optim.SGD(model.backbone.parameters(), lr=0.1)
    probe_opt = torch.optim.Adam(model.probe.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    x, y, meta = torch.randn(16, 32), torch.randint(0, 10, (16,)), torch.randn(16, 4)
    meta[3, 1] = float("nan")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with nanguard.watch(model, optimizer=opt, scaler=scaler, on_nonfinite="skip_step") as guard:
        h, logits = model(x, meta)
        opt.zero_grad()
        probe_opt.zero_grad()
        scaler.scale(h.pow(2).mean()).backward()
        F.cross_entropy(logits, y).backward()  # (the probe's fp32 loss, unscaled)
        scaler.step(opt)
        probe_opt.step()
        scaler.update()
    assert guard.origin is not None
    assert guard.origin.phase == "input"
    for name, value in model.state_dict().items():
        assert torch.equal(value, before[name]), name


class PaddedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16, padding_idx=0)
        self.lstm = nn.LSTM(16, 16, batch_first=True)
        self.fc = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.lstm(self.emb(x))[0][:, -1])


def test_a_max_norm_written_after_the_step_is_not_claimed_to_be_the_steps_doing() -> None:
    # emb.weight /= its row norms by hand after opt.step(): the zero padding row is 0/0.
    # Found at the next step's sweep, nanguard cannot tell the update from that write.
    torch.manual_seed(0)
    model = PaddedEncoder()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(3):
            x = torch.randint(1, 30, (4, 8))
            x[:, 6:] = 0
            loss = guard.check_loss(F.cross_entropy(model(x), torch.randint(0, 2, (4,))))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 1:
                with torch.no_grad():
                    model.emb.weight.div_(model.emb.weight.norm(dim=1, keepdim=True))
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("param", "emb.weight")
    assert "became NaN in optimizer.step()" not in origin.message
    assert "in an optimizer.step() or written after one" in origin.message
    assert origin.hint is not None
    assert "written outside optimizer.step()" in origin.hint


def test_the_raised_error_for_a_weight_carries_the_cause_found() -> None:
    # Resumed from a checkpoint saved after a bad step: Adam's exp_avg_sq holds NaN. The
    # error the user reads names it, not only the event's hint.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    opt.step()
    state = opt.state_dict()
    state["state"][0]["exp_avg_sq"][0, 0] = float("nan")
    opt.load_state_dict(state)
    guard = nanguard.watch(model, optimizer=opt)

    def train() -> None:
        for _ in range(3):
            loss = guard.check_loss(model(torch.randn(8, 4)).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError) as raised:
        train()
    assert raised.value.event.phase == "param"
    assert "Likely cause:" in str(raised.value)
    assert "`exp_avg_sq`" in str(raised.value)


class SiameseDistances(nn.Module):
    """Euclidean distances of embedded pairs: sqrt at 0 for a pair of identical inputs, whose
    derivative is infinite at any loss scale."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(
        self, a: torch.Tensor, p: torch.Tensor, n: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ea, ep, en = self.enc(a), self.enc(p), self.enc(n)
        return ((ea - ep) ** 2).sum(1).sqrt(), ((ea - en) ** 2).sum(1).sqrt()


def triplets_under_a_scaler(mode: str, steps: int) -> nanguard.Guard:
    """float16 triplet steps under a GradScaler; at step 1 a sampler repeats an image
    (a == p), and sqrt's backward at 0 is NaN at any scale."""
    torch.manual_seed(0)
    model = SiameseDistances()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    gen = torch.Generator().manual_seed(3)
    guard = nanguard.watch(model, optimizer=opt, scaler=scaler, mode=mode, on_nonfinite="log")  # type: ignore[arg-type]
    with guard:
        for step in range(steps):
            a, p, n = torch.randn(3, 4, 20, generator=gen)
            if step == 1:
                p[1] = a[1]
            with torch.autocast("cpu", dtype=torch.float16):
                dp, dn = model(a, p, n)
                loss = guard.check_loss(F.relu(dp - dn + 1.0).float().mean())
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    return guard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_no_loss_scale_makes_is_an_origin_at_gradscalers_first_skip(mode: str) -> None:
    # A sampler repeats an image: a == p, and sqrt's backward at 0 makes NaN under any
    # scale. GradScaler skips every such step and halves its scale; nanguard replays the
    # backward from the unscaled gradients at the first skip, finds the NaN again, and
    # names it there, not 30 halvings later at the floor.
    guard = triplets_under_a_scaler(mode, steps=4)
    model = guard.model
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (1, "backward")
    assert origin.op == "aten.div.Tensor in SqrtBackward0"
    assert origin.hint is not None
    assert "derivative of sqrt is infinite at 0" in origin.hint
    assert "overflowed" not in origin.hint
    skips = [e for e in guard.events if e.kind == "amp_overflow"]
    assert [e.step for e in skips] == [1]
    assert "from unscaled gradients made NaN/Inf too" in skips[0].message
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_skip_step_with_a_scaler_and_no_optimizer_does_not_claim_a_skip_it_could_not_make() -> None:
    # No optimizer=: the step ends at scaler.update(), after scaler.step() ran the update
    # (GradScaler skips only non-finite gradients; here only the float16 loss overflowed).
    # Saying "GradScaler skipped ... the weights were left as they were" would be false.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    gen = torch.Generator().manual_seed(1)
    guard = nanguard.watch(model, scaler=scaler, on_nonfinite="skip_step")

    def train() -> None:
        for step in range(5):
            x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 32, generator=gen) * 2
            if step == 3:
                y = y * 200  # outlier targets: the float16 sum overflows
            with torch.autocast("cpu", dtype=torch.float16):
                loss = guard.check_loss((model(x) - y.half()).pow(2).sum() / 1000)
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()

    with guard, pytest.warns(RuntimeWarning, match="GradScaler did not skip this step"):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (3, "loss")
    assert not any("GradScaler skipped" in e.message for e in guard.events)
    assert not any(e.details.get("skipped") for e in guard.events)


def _overflowing_loss_run(guarded: bool) -> tuple[list[torch.Tensor], list[tuple[float, int]]]:
    """Twelve float16 steps; batch 5's outlier targets overflow the loss's float16 sum (its
    gradients stay finite). Unguarded, the loop leaves batch 5 out; guarded, skip_step
    drops it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=3)
    guard = (
        nanguard.watch(model, optimizer=opt, scaler=scaler, on_nonfinite="skip_step")
        if guarded
        else None
    )
    gen = torch.Generator().manual_seed(1)
    scales = []
    for step in range(12):
        x, y = torch.randn(32, 16, generator=gen), torch.randn(32, 32, generator=gen) * 2
        if step == 5:
            if guard is None:
                continue
            y = y * 200
        with torch.autocast("cpu", dtype=torch.float16):
            loss = (model(x) - y.half()).pow(2).sum() / 1000
        if guard is not None:
            loss = guard.check_loss(loss)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        if step != 5:
            scales.append((scaler.get_scale(), int(scaler._growth_tracker.item())))  # type: ignore[union-attr]
    if guard is not None:
        notes = [e for e in guard.events if e.details.get("skipped")]
        assert len(notes) == 1
        assert "its loss was non-finite" in notes[0].message
        guard.detach()
    return [p.detach().clone() for p in model.parameters()], scales


def test_skip_step_drops_an_overflowing_loss_as_if_the_batch_never_came_scaler_included() -> None:
    # GradScaler saw finite gradients and counted a good step; the step nanguard dropped
    # must not count toward its growth: the scale grows when it would have without it.
    (ref_weights, ref_scales), (weights, scales) = (
        _overflowing_loss_run(False),
        _overflowing_loss_run(True),
    )
    assert all(torch.equal(a, b) for a, b in zip(ref_weights, weights, strict=True))
    assert scales == ref_scales


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_healthy_infonce_loss_under_gradscaler_overflows_without_an_origin(mode: str) -> None:
    # The first steps' scaled similarity gradient overflows float16, and F.normalize's
    # backward in the loss turns those rows into NaN (no Inf left): GradScaler's overflow,
    # which a smaller scale fixes. No origin; training goes on.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    opt = torch.optim.SGD(model.parameters(), 0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    gen = torch.Generator().manual_seed(1)
    guard = nanguard.watch(model, optimizer=opt, scaler=scaler, mode=mode)  # type: ignore[arg-type]
    with guard:
        for _ in range(8):
            x = torch.randn(4, 32, generator=gen)
            x1 = x + torch.randn(4, 32, generator=gen)
            x2 = x + torch.randn(4, 32, generator=gen)
            with torch.autocast("cpu", dtype=torch.float16):
                z1, z2 = F.normalize(model(x1), dim=1), F.normalize(model(x2), dim=1)
                loss = F.cross_entropy(z1 @ z2.T / 0.07, torch.arange(4))
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert guard.origin is None
    assert any(e.kind == "amp_overflow" for e in guard.events)
    assert scaler.get_scale() < 2.0**16
