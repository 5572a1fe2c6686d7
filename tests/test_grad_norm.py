"""The gradient-norm guard: silent on healthy training, early on exploding gradients."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import nanguard
from nanguard._monitor import GradNormMonitor

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import models


def healthy_batches(name: str):
    """Learnable data for each benchmark model (a fixed teacher or a pattern)."""
    gen = torch.Generator().manual_seed(1)
    if name == "mlp":
        teacher = nn.Linear(784, 10)
        xs = torch.randn(2048, 784, generator=gen)
        ys = teacher(xs).argmax(-1).detach()
        return lambda: _pick(xs, ys, 64, gen)
    if name == "cnn":
        xs = torch.randn(512, 3, 32, 32, generator=gen)
        ys = (xs.mean((1, 2, 3)) > 0).long() * 3
        return lambda: _pick(xs, ys, 32, gen)
    seqs = torch.randint(0, 50, (256, 65), generator=gen)
    return lambda: (lambda s: (s[:, :64], s[:, 1:]))(
        seqs[torch.randint(0, 256, (16,), generator=gen)]
    )


def _pick(xs, ys, n, gen):
    i = torch.randint(0, len(xs), (n,), generator=gen)
    return xs[i], ys[i]


@pytest.mark.parametrize(
    ("name", "optimizer", "steps"),
    [
        ("mlp", "adam", 300),
        ("mlp", "sgd", 300),
        ("cnn", "adam", 120),
        ("transformer", "adamw", 120),
    ],
)
def test_no_false_alarm_on_healthy_training(name: str, optimizer: str, steps: int) -> None:
    torch.manual_seed(0)
    model, _, loss_fn = models.CASES[name](torch.device("cpu"))
    batch = healthy_batches(name)
    opt = {
        "adam": lambda p: torch.optim.Adam(p, lr=1e-3),
        "adamw": lambda p: torch.optim.AdamW(p, lr=1e-3),
        "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    }[optimizer](model.parameters())
    with nanguard.watch(model, optimizer=opt) as guard:
        for _ in range(steps):
            x, y = batch()
            loss = guard.check_loss(loss_fn(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []
    assert len(guard._resolver.monitor.history) > 0


def diverging_mlp_run(lr: float, steps: int = 200):
    """Full-batch regression with SGD at a learning rate past the stable limit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(256, 16)
    y = x.sum(-1, keepdim=True)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(steps):
            loss = guard.check_loss(nn.functional.mse_loss(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if guard.origin is not None:
                break
    return guard


def line_of(code: str, function: object) -> int:
    lines, start = inspect.getsourcelines(function)  # type: ignore[arg-type]
    return start + next(i for i, line in enumerate(lines) if line.strip() == code)


def test_exploding_learning_rate_warns_several_steps_before_the_first_inf() -> None:
    guard = diverging_mlp_run(lr=0.2)
    warnings_ = [e for e in guard.events if e.kind == "grad_norm"]
    assert guard.origin is not None  # it does blow up
    assert warnings_, "no grad_norm warning before the Inf"
    first = warnings_[0]
    assert first.step <= guard.origin.step - 4
    assert (first.phase, first.is_origin, first.module) == ("grad", False, None)
    assert first.details["norm"] > 3 * first.details["reference"]
    assert first.details["reason"] == "spike"
    assert first.details["location"] == f"{__file__}:{line_of('opt.step()', diverging_mlp_run)}"
    top = [name for name, _ in first.details["top"]]
    assert set(top) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert "lower the learning rate" in first.message
    assert "jumped to" in first.message
    # ...and how to quiet it for a healthy run whose norm grows (a density model)
    assert "raise grad_norm_ratio= or pass grad_norm=False" in first.message


def test_warning_is_issued_as_a_warning_under_raise() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    x = torch.randn(256, 16)
    y = x.sum(-1, keepdim=True)

    def train() -> None:
        with nanguard.watch(model, optimizer=opt):
            for _ in range(50):
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()

    with (
        pytest.warns(nanguard.NonFiniteWarning, match="gradient norm jumped"),
        pytest.raises(nanguard.NonFiniteError),
    ):
        train()


def test_absolute_thresholds() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(
        model, optimizer=opt, on_nonfinite="log", grad_norm_threshold=100, param_norm_threshold=50
    ) as guard:
        for scale in (0.01, 100.0, 100.0):
            loss = model(torch.ones(8, 4) * scale).sum()
            opt.zero_grad()
            loss.backward()
            opt.step()
    alarms = [e for e in guard.events if e.kind == "grad_norm"]
    reasons = [e.details["reason"] for e in alarms]
    assert reasons.count("threshold") == 1  # once per excursion, not every step
    assert "param_threshold" in reasons
    assert {e.param for e in alarms if e.param} <= {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert all(e.step == 1 for e in alarms)


def test_monitor_rearms_after_the_norm_comes_back() -> None:
    monitor = GradNormMonitor(warmup=3)
    for _ in range(10):
        assert monitor.observe(1.0) is None
    assert monitor.observe(100.0) is not None
    assert monitor.observe(120.0) is None  # the same excursion
    for _ in range(3):
        monitor.observe(1.0)
    late = monitor.observe(1000.0)
    assert late is not None
    assert late.reason == "spike"


def test_heavy_tailed_noise_of_a_converging_run_is_not_a_spike() -> None:
    monitor = GradNormMonitor()
    early = [5.0, 4.0, 3.0, 2.0, 1.0]
    late = [0.05, 0.04, 0.06, 0.03, 0.05] * 10 + [0.9]  # one hard batch: 20x the median
    assert all(monitor.observe(n) is None for n in early + late)


def test_an_early_norm_rise_while_the_loss_falls_is_learning_not_a_spike() -> None:
    # The norms of the first steps of a contrastive run (and of the diverging run above):
    # alike, but the contrastive loss falls as its norm rises (it leaves its first plateau).
    rising = [1.2, 1.5, 1.9, 1.7, 1.8, 2.0, 1.84, 2.67, 6.1]
    learning = GradNormMonitor()
    assert [learning.observe(n, learning=i == 8) for i, n in enumerate(rising)] == [None] * 9
    diverging = GradNormMonitor()
    alarms = [diverging.observe(n) for n in rising]
    assert alarms[-1] is not None
    assert alarms[-1].reason == "spike"
    # ...and a falling loss does not hide an explosion (far past 10x), nor a later spike.
    exploding = GradNormMonitor()
    for n in rising[:8]:
        exploding.observe(n)
    assert exploding.observe(40.0, learning=True) is not None
    late = GradNormMonitor()
    for _ in range(30):
        late.observe(1.0)
    assert late.observe(4.0, learning=True) is not None


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_contrastive_run_leaving_its_first_plateau_is_no_spike(mode: str) -> None:
    """InfoNCE over two views: at step 8 the loss falls from 3.4 to 2.5 and the gradient
    norm rises from 2.7 to 6.1, 3.3x its median: learning, not an explosion."""

    def block(i: int, o: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(i, o, 3, 2, 1, bias=False), nn.BatchNorm2d(o), nn.ReLU())

    torch.manual_seed(0)
    model = nn.Sequential(
        block(3, 32), block(32, 64), block(64, 128), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 64),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    data = torch.rand(256, 3, 32, 32)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for step in range(24):
            x = data[(step * 32) % 256 :][:32]
            z1 = nn.functional.normalize(model(x + 0.05 * torch.randn_like(x)), dim=1)
            z2 = nn.functional.normalize(model(x.flip(-1)), dim=1)
            logits = z1 @ z2.T / 0.1
            loss = guard.check_loss(nn.functional.cross_entropy(logits, torch.arange(32)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []


def test_grad_norm_guard_can_be_switched_off() -> None:
    guard = nanguard.Guard(nn.Linear(2, 2), grad_norm=False)
    assert not guard._resolver.monitor.spike


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_float64_gradients_beyond_the_float_range_squared_do_not_crash(mode: str) -> None:
    """A float64 gradient norm of ~1e200 is finite, its square is not a Python float."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="raise") as guard:
        for _ in range(3):
            loss = guard.check_loss(model(torch.randn(8, 4, dtype=torch.float64)).sum() * 1e200)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [e for e in guard.events if e.is_origin] == []


def test_a_huge_spike_ratio_is_written_in_scientific_notation() -> None:
    from nanguard._monitor import GradNormAlarm
    from nanguard._report import grad_norm_message

    alarm = GradNormAlarm("spike", 9.263e18, 0.3892, 3 * 0.3892)
    text = grad_norm_message(7, alarm, [("fm.v", 9.0e18)], None)
    assert "jumped to 9.263e+18, 2.38e+19x its recent median 0.3892" in text
    alarm = GradNormAlarm("spike", 4630.0, 2.0, 6.0)
    assert "2,315x its recent median" in grad_norm_message(7, alarm, [("fc", 4630.0)], None)


def test_a_late_jump_below_an_earlier_norm_of_the_run_is_no_spike() -> None:
    """Sparse rewards (a DQN that first reaches its goal after thousands of quiet steps): the
    jump is far above the recent median but below what the run saw before."""
    monitor = GradNormMonitor()
    alarms = [monitor.observe(n) for n in [0.25] * 300 + [0.01] * 3000]
    assert alarms == [None] * 3300
    assert monitor.observe(0.3) is None  # 30x the median, but no more than the early norms
    assert monitor.observe(5.0) is not None  # far above anything seen: a spike


def test_the_large_norms_of_the_first_steps_do_not_hide_a_later_explosion() -> None:
    """Unnormalised targets: the first steps' norms are ~200x the settled ones. A drift that
    makes the norm jump 180x at step 1500 is a spike, although it stays below them."""
    monitor = GradNormMonitor()
    early = [138.0 / (1 + i) for i in range(40)]
    assert all(monitor.observe(n) is None for n in early + [0.66] * 1460)
    alarm = monitor.observe(120.0)
    assert alarm is not None
    assert alarm.reason == "spike"


def tabular_task(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable 5-class problem on 20 features (a fixed random teacher, noisy labels)."""
    gen = torch.Generator().manual_seed(seed)
    teacher = torch.randn(20, 5, generator=gen)
    x = torch.randn(n, 20, generator=gen)
    return x, (x @ teacher + 0.5 * torch.randn(n, 5, generator=gen)).argmax(-1)


def short_tail_loader() -> torch.utils.data.DataLoader:
    """DataLoader's default drop_last=False: 1025 samples in batches of 64 end each epoch
    with a batch of one sample."""
    x, y = tabular_task(1025)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y),
        batch_size=64,
        shuffle=True,
        generator=torch.Generator().manual_seed(1),
    )


def tabular_mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 5)
    )


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_short_last_batch_of_each_epoch_is_no_spike(mode: str) -> None:
    # DataLoader's default drop_last=False: 1025 samples in batches of 64 end each epoch
    # with one sample, whose gradient is ~8x noisier than a full batch's.
    torch.manual_seed(0)
    loader = short_tail_loader()
    model = tabular_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for _ in range(8):
            for xb, yb in loader:
                loss = guard.check_loss(nn.functional.cross_entropy(model(xb), yb))
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert guard.events == []


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_batch_size_lowered_mid_run_is_no_spike(mode: str) -> None:
    # A second stage (or an out-of-memory fallback) at batch 8 after 128.
    torch.manual_seed(0)
    x, y = tabular_task(4096)
    model = tabular_mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for step in range(300):
            i = torch.randint(0, len(x), (128 if step < 200 else 8,), generator=gen)
            loss = guard.check_loss(nn.functional.cross_entropy(model(x[i]), y[i]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []


def test_an_explosion_after_short_last_batches_is_flagged_at_once() -> None:
    # The 1-sample tail batches' large norms must not raise the bar a real explosion (the
    # learning rate x100 at step 200) has to clear.
    torch.manual_seed(0)
    loader = short_tail_loader()
    model = tabular_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
    step = 0
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        while step <= 206:
            for xb, yb in loader:
                if step == 200:
                    for group in opt.param_groups:
                        group["lr"] *= 100
                loss = guard.check_loss(nn.functional.cross_entropy(model(xb), yb))
                opt.zero_grad()
                loss.backward()
                opt.step()
                step += 1
    spikes = [e.step for e in guard.events if e.kind == "grad_norm"]
    assert spikes
    assert spikes[0] == 201


def test_a_spike_judged_for_the_usual_batch_says_so() -> None:
    m = GradNormMonitor()
    for n in (1.0, 1.2, 0.9, 1.1, 1.0, 0.8):
        m.observe(n)
    assert m.observe(20.0, scale=0.125) is None  # one sample where 64 are usual: 2.5
    alarm = m.observe(400.0, scale=0.125)
    assert alarm is not None
    assert (alarm.norm, alarm.scale) == (400.0, 0.125)
    from nanguard._report import grad_norm_message

    text = grad_norm_message(7, alarm, [], None, batch=(1, 64))
    assert text.startswith(
        "nanguard: step 7: the gradient norm jumped to 400 (50 counted for the usual batch of "
        "64: this step's had 1), 50x its recent median 1"
    )


def test_an_early_warning_reaches_the_user_once(caplog: pytest.LogCaptureFixture) -> None:
    # Under "raise" (and "warn") the warning is it: logging's last-resort handler would print
    # a WARNING record of the same text a second time.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    x = torch.randn(256, 16)
    y = x.sum(-1, keepdim=True)

    def train() -> nanguard.Guard:
        with nanguard.watch(model, optimizer=opt, on_nonfinite="warn") as guard:
            for _ in range(30):
                loss = nn.functional.mse_loss(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
        return guard

    with caplog.at_level("INFO", logger="nanguard"), pytest.warns(nanguard.NonFiniteWarning):
        guard = train()
    spikes = [e for e in guard.events if e.kind == "grad_norm"]
    assert spikes
    records = [r for r in caplog.records if "gradient norm jumped" in r.getMessage()]
    assert [r.levelname for r in records] == ["INFO"] * len(spikes)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_validation_pass_with_gradients_on_does_not_blind_the_guard(mode: str) -> None:
    # model.eval() without torch.no_grad() (it only costs memory): its forwards are no part
    # of a training batch. A learning-rate restart bug at step 60 is still flagged at once.
    torch.manual_seed(0)
    x, w = torch.randn(4096, 20), torch.randn(20, 1)
    y = torch.tanh(x @ w) + 0.1 * torch.randn(4096, 1)
    x_val, y_val = torch.randn(2560, 20), torch.randn(2560, 1)
    model = nn.Sequential(
        nn.Linear(20, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        for step in range(64):
            if step == 40:
                model.eval()
                for i in range(0, 2560, 256):
                    nn.functional.mse_loss(model(x_val[i : i + 256]), y_val[i : i + 256])
                model.train()
            if step == 60:
                for group in opt.param_groups:
                    group["lr"] = 0.4
            i = (step * 64) % 4096
            loss = guard.check_loss(nn.functional.mse_loss(model(x[i : i + 64]), y[i : i + 64]))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [e.step for e in guard.events if e.kind == "grad_norm"] == [62]
