"""From a review of the training infrastructure models are wrapped in: quantization-aware
training's module swaps, staged unfreezing, libraries that keep state in their own hooks."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.ao.quantization as tq
from torch import nn

import nanguard


class QatNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quant, self.dequant = tq.QuantStub(), tq.DeQuantStub()
        self.fc1 = nn.Linear(20, 64)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(64, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dequant(self.fc2(self.relu(self.fc1(self.quant(x)))))


def _prepared_qat() -> QatNet:
    """A QatNet in training mode, prepared for quantization-aware training."""
    model = QatNet().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.ao's deprecation notes)
        model.qconfig = tq.get_default_qat_qconfig("fbgemm")  # type: ignore[assignment]
        tq.prepare_qat(model, inplace=True)
    return model


def _qat_steps(model: nn.Module, guard: nanguard.Guard, opt: torch.optim.Optimizer, n: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        x = torch.randn(32, 20, generator=g)
        loss = guard.check_loss(nn.functional.cross_entropy(model(x), x[:, :3].argmax(1)))
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_prepare_qat_after_watch_trains_and_records_the_swapped_modules() -> None:
    # prepare_qat swaps each Linear for a QAT Linear and copies the module's hooks onto it
    # without with_kwargs: nanguard's hooks, called as hook(module, args), raised TypeError
    # in the first forward.
    torch.manual_seed(0)
    model = QatNet().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.ao's deprecation notes)
        with nanguard.watch(model) as guard:
            model.qconfig = tq.get_default_qat_qconfig("fbgemm")  # type: ignore[assignment]
            tq.prepare_qat(model, inplace=True)
            opt = torch.optim.SGD(model.parameters(), 0.05)
            for _ in range(3):
                x = torch.randn(32, 20)
                loss = guard.check_loss(nn.functional.cross_entropy(model(x), x[:, :3].argmax(1)))
                opt.zero_grad()
                loss.backward()
                guard.step()
                opt.step()
            x = torch.randn(32, 20)
            x[7, 11] = float("nan")  # a missing value
            loss = guard.check_loss(nn.functional.cross_entropy(model(x), x[:, :3].argmax(1)))
            loss.backward()
            with pytest.raises(nanguard.NonFiniteError, match=r"step 3: the input batch") as raised:
                guard.step()
    event = raised.value.event
    assert (event.phase, event.module) == ("input", "")
    # (the swapped-in modules' calls are recorded under the names they replaced)
    assert "`fc1`" in event.message
    assert "`fc2`" in event.message


def test_convert_while_watched_leaves_no_hook_on_the_int8_model() -> None:
    torch.manual_seed(0)
    model = QatNet().train()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.qconfig = tq.get_default_qat_qconfig("fbgemm")  # type: ignore[assignment]
        tq.prepare_qat(model, inplace=True)
        opt = torch.optim.SGD(model.parameters(), 0.05)
        guard = nanguard.watch(model, optimizer=opt)
        _qat_steps(model, guard, opt, 3)
        quantized = tq.convert(model.eval(), inplace=True)  # inside the watch, at the end
        guard.detach()
        left = {
            name: len(m._forward_pre_hooks) + len(m._forward_hooks)
            for name, m in quantized.named_modules()
            if m._forward_pre_hooks or m._forward_hooks
        }
        assert left == {}
        assert quantized(torch.randn(4, 20)).shape == (4, 3)


class PerSampleHooks(nn.Module):
    """opacus's GradSampleModule in small: forward hooks count each parameter's forwards,
    backward hooks count them down and, at 0, keep the per-sample gradient (refusing a
    second one before the optimizer took the first: Poisson sampling); a ``hooks_enabled``
    flag turns them off. A replay that ran them left the counts or gradients behind: the
    next real step failed inside the library, and the replay itself failed."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self._module = module
        self.hooks_enabled = True
        for m in module.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_hook(self.capture_activations)
                m.register_full_backward_hook(self.capture_backprops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._module(x)

    def capture_activations(self, module: nn.Module, args: object, output: object) -> None:
        if not self.hooks_enabled or not torch.is_grad_enabled():
            return
        for p in module.parameters():
            p._forward_counter = getattr(p, "_forward_counter", 0) + 1  # type: ignore[attr-defined]

    def capture_backprops(self, module: nn.Module, grad_in: object, grad_out: object) -> None:
        if not self.hooks_enabled:
            return
        for p in module.parameters():
            p._forward_counter -= 1  # type: ignore[attr-defined]
            if p._forward_counter == 0:  # type: ignore[attr-defined]
                if getattr(p, "grad_sample", None) is not None:
                    raise ValueError("Poisson sampling is not compatible with grad accumulation")
                p.grad_sample = torch.ones(1)  # type: ignore[attr-defined]

    def take_grad_samples(self) -> None:
        """What DPOptimizer's step and zero_grad do with them."""
        for p in self.parameters():
            if getattr(p, "grad_sample", None) is None:
                raise ValueError("Per sample gradient is not initialized")
            p.grad_sample = None  # type: ignore[attr-defined]


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(10, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x) * (x.abs().sum(1, keepdim=True) > 0)  # padding rows embed to 0
        r = torch.sqrt((z**2).sum(1, keepdim=True))  # the norm by hand: sqrt at 0
        return self.head(z / (r + 1e-6))


def _dp_steps(model: PerSampleHooks, mode: str, bad: str) -> nanguard.Guard:
    opt = torch.optim.SGD(model.parameters(), 0.1)
    g = torch.Generator().manual_seed(0)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="skip_step") as guard:
        for step in range(4):
            x = torch.randn(32, 10, generator=g)
            if step == 1 and bad == "padding":
                x[5] = 0.0  # an all-padding sample
            if step == 1 and bad == "missing":
                x[5, 3] = float("nan")  # a missing value
            loss = guard.check_loss(nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long()))
            opt.zero_grad()
            loss.backward()
            model.take_grad_samples()  # (raised "not initialized" at step 2 after a replay)
            opt.step()
    return guard


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_replay_of_a_backward_leaves_a_libraries_hook_state_alone(mode: str) -> None:
    torch.manual_seed(0)
    model = PerSampleHooks(Embedder())
    guard = _dp_steps(model, mode, "padding")
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (1, "backward", "_module")
    assert origin.op is not None
    assert "SqrtBackward0" in origin.op
    assert origin.source is not None
    assert "torch.sqrt((z**2)" in origin.source
    assert model.hooks_enabled
    assert [p._forward_counter for p in model.parameters()] == [0, 0, 0, 0]  # type: ignore[attr-defined]


@pytest.mark.filterwarnings("ignore:Full backward hook is firing")
def test_replay_of_a_forward_leaves_a_libraries_hook_state_alone() -> None:
    torch.manual_seed(0)
    model = PerSampleHooks(Embedder())
    guard = _dp_steps(model, "sentinel", "missing")  # (a forward-only replay: no count down)
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.tensor) == (1, "input", "args[0]")
    assert [p._forward_counter for p in model.parameters()] == [0, 0, 0, 0]  # type: ignore[attr-defined]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_unfreezing_a_backbone_is_no_gradient_explosion(mode: str) -> None:
    # A staged fine-tune: the head alone, then everything. The norm grows several-fold
    # because more weights have gradients, not because any of them explodes.
    torch.manual_seed(0)
    backbone = nn.Sequential(
        *[nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()) for _ in range(6)]
    )
    model = nn.Sequential(backbone, nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), 0.05, momentum=0.9)
    w = torch.randn(64, 10)
    g = torch.Generator().manual_seed(1)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        backbone.requires_grad_(False)
        for step in range(90):
            if step == 80:
                backbone.requires_grad_(True)
            x = torch.randn(32, 64, generator=g)
            loss = guard.check_loss(nn.functional.cross_entropy(model(x), (x @ w).argmax(1)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_after_unfreezing_a_real_explosion_is_still_told(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    w = torch.randn(64, 10)
    g = torch.Generator().manual_seed(1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        model[0].requires_grad_(False)
        for step in range(180):
            if step == 40:
                model[0].requires_grad_(True)
            x = torch.randn(32, 64, generator=g)
            y = (x @ w).argmax(1)
            if step == 170:
                x = x * 1e4  # an unnormalised batch: its gradients explode
            loss = guard.check_loss(nn.functional.cross_entropy(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [e.step for e in guard.events if e.kind == "grad_norm"] == [170]


def test_a_loop_dropping_every_nonfinite_loss_is_stopped_not_left_to_pile_up() -> None:
    # A NaN pixel makes the fake-quantize scales NaN: every later loss is NaN, the loop's
    # `if not torch.isfinite(loss): continue` drops them all, optimizer.step() never runs
    # again. The guard kept every forward for a step that never ended (1.2 GB, silent).
    torch.manual_seed(0)
    model = _prepared_qat()
    opt = torch.optim.SGD(model.parameters(), 0.05)
    dropped = 0

    def train(guard: nanguard.Guard) -> None:
        nonlocal dropped
        g = torch.Generator().manual_seed(1)
        for i in range(200):
            x = torch.randn(32, 20, generator=g)
            if i == 5:
                x[3, 7] = float("nan")
            loss = guard.check_loss(nn.functional.cross_entropy(model(x), x[:, :3].argmax(1)))
            if not torch.isfinite(loss):
                dropped += 1
                continue
            opt.zero_grad()
            loss.backward()
            opt.step()

    guard = nanguard.watch(model, optimizer=opt)
    try:
        with pytest.raises(nanguard.NonFiniteError, match="step 5: the input batch") as raised:
            train(guard)
    finally:
        guard.detach()
    assert dropped <= 70  # (not all 195)
    assert (raised.value.event.phase, raised.value.event.step) == ("input", 5)


class Policy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        obs = obs / obs.norm(dim=-1, keepdim=True)  # 0/0 for an all-zero (terminal) state
        return self.head(torch.tanh(self.body(obs)))


def test_a_long_rollout_before_its_backward_keeps_every_forward() -> None:
    # REINFORCE: a forward per environment step with gradients on, the log-probabilities
    # kept, one backward at the episode's end. Not a loop dropping its batches.
    torch.manual_seed(0)
    policy = Policy()
    opt = torch.optim.Adam(policy.parameters(), 1e-3)
    with nanguard.watch(policy, optimizer=opt):
        log_probs = []
        for t in range(150):
            obs = torch.randn(1, 8)
            if t == 3:
                obs = torch.zeros(1, 8)  # a terminal state, all zeros
            action = int(torch.randint(0, 4, ()))  # (the environment's choice, say)
            log_probs.append(policy(obs).log_softmax(-1)[0, action])
        loss = -torch.stack(log_probs).sum()
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError) as raised:
            opt.step()
    event = raised.value.event  # (at the step's end: not resolved in the middle)
    assert (event.phase, event.module) == ("forward", "")
    assert event.op == "aten.div.Tensor"
    assert event.details["forward"] == 4  # (the call at t == 3)


def test_qat_observers_of_a_weight_the_let_through_update_made_nan_are_not_new_origins() -> None:
    # on_nonfinite="warn" lets step 1's NaN gradients through: fc1.weight goes NaN. The
    # next forward's weight fake-quantize reads it, its scale goes NaN, and torch refuses
    # the zero point: that is the weight's doing, from step 1's origin.
    torch.manual_seed(0)
    model = _prepared_qat()
    opt = torch.optim.SGD(model.parameters(), 0.01, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        guard = nanguard.watch(model, optimizer=opt, on_nonfinite="warn")

        def train() -> None:
            for i in range(4):
                counts = torch.poisson(torch.full((32, 20), 3.0), generator=g) + 1
                if i == 1:
                    counts[5, 3] = 0  # log(0) in the features: -inf
                x = torch.log(counts)
                loss = guard.check_loss(nn.functional.cross_entropy(model(x), x[:, :3].argmax(1)))
                opt.zero_grad()
                loss.backward()
                opt.step()

        try:
            with pytest.raises(RuntimeError, match="zero_point") as raised:
                train()
        finally:
            guard.detach()
    assert [(e.step, e.phase) for e in guard.events if e.is_origin] == [(1, "input")]
    notes = getattr(raised.value, "__notes__", [])
    assert any("weights are non-finite" in n and "after step 1" in n for n in notes)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
def test_a_log_file_that_cannot_be_written_warns_once_and_training_goes_on() -> None:
    # The disk filled up: writing the events must not break the step (skip_step still
    # skips it), the events stay in memory, and the file is not tried again.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    guard = nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step", log_path="/dev/full")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with guard:
            for step in range(4):
                x = torch.randn(8, 4)
                if step in (1, 2):
                    x[2, 1] = float("nan")
                loss = guard.check_loss(model(x).pow(2).mean())
                opt.zero_grad()
                loss.backward()
                opt.step()
    told = [w for w in caught if "cannot write to log_path '/dev/full'" in str(w.message)]
    assert len(told) == 1
    assert "kept in guard.events" in str(told[0].message)
    assert [e.step for e in guard.events if e.is_origin] == [1, 2]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_rank_template_log_path_that_cannot_be_made_fails_at_watch(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    model = nn.Linear(2, 2)
    with pytest.raises(OSError, match="a_file"):
        nanguard.watch(model, log_path=str(blocker / "events.{rank}.jsonl"))
    # (nothing left attached: the model can be watched again)
    nanguard.watch(model).detach()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_model_on_the_meta_device_trains_watched_without_events(mode: str) -> None:
    # Shapes only (FLOP counting, a dry run before materialising): nothing to read back.
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode, check_params=1) as guard:  # type: ignore[arg-type]
        for _ in range(3):
            loss = guard.check_loss(model(torch.randn(3, 4, device="meta")).sum())
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []
