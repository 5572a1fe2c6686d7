"""What happens when a non-finite value is found: raise, warn, log; where the events go."""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy
import pytest
import torch
from realistic import log_mlp
from torch import nn

import nanguard


def nan_step(guard: nanguard.Guard, model: nn.Module) -> None:
    out = model(torch.randn(16, 784))
    loss = guard.check_loss(out.pow(2).mean())
    loss.backward()


def test_raise_at_the_end_of_the_step_names_the_origin() -> None:
    model = log_mlp()
    with nanguard.watch(model) as guard:  # "raise" is the default
        nan_step(guard, model)
        with pytest.raises(
            nanguard.NonFiniteError,
            match=r"step 0: NaN first appeared in the forward pass, in `1` \(LogFeatures\)",
        ) as info:
            guard.step()
    event = info.value.event
    assert (event.module, event.phase, event.is_origin) == ("1", "forward", True)
    assert guard.origin == event
    assert isinstance(info.value, FloatingPointError)
    assert isinstance(info.value, nanguard.NanguardError)


def test_raise_before_the_optimizer_touches_the_weights() -> None:
    model = log_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with nanguard.watch(model, optimizer=opt) as guard:
        nan_step(guard, model)
        with pytest.raises(nanguard.NonFiniteError, match="`1` \\(LogFeatures\\)"):
            opt.step()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert guard.current_step == 1  # the aborted step is over


def test_raise_on_context_exit_when_the_step_was_not_ended() -> None:
    model = log_mlp()
    with pytest.raises(nanguard.NonFiniteError, match="LogFeatures"), nanguard.watch(model):
        model(torch.randn(4, 784))
    assert not model._forward_hooks
    assert not model[1]._forward_pre_hooks


def test_sync_module_raises_inside_the_forward_at_the_origin() -> None:
    model = log_mlp()
    with nanguard.watch(model, sync="module") as guard:
        with pytest.raises(nanguard.NonFiniteError, match="`1` \\(LogFeatures\\)") as info:
            model(torch.randn(8, 784))
        # The traceback runs through the model's forward: the user sees where.
        frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
        assert "forward" in frames
        assert info.value.event.stats is not None
        assert info.value.event.stats.nan_count > 0
        guard.step()  # already reported: nothing more is raised
    assert [e.is_origin for e in guard.events].count(True) == 1


class GaussianHead(nn.Module):
    """Mean and log-scale; the scale from a ReLU (softplus + eps was meant): log(0) = -Inf."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh())
        self.mean, self.scale = nn.Linear(64, 1), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(x)
        return self.mean(h), torch.log(nn.functional.relu(self.scale(h)))


def test_sync_module_under_warn_tells_a_loss_after_a_forward_origin_as_carried() -> None:
    # The forward's -Inf is reported as the model returns; the loss checked next is NaN
    # from it, not a second origin "from finite outputs".
    torch.manual_seed(0)
    model = GaussianHead()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x, y = torch.randn(64, 16), torch.randn(64, 1)
    with (
        warnings.catch_warnings(record=True) as caught,
        nanguard.watch(model, optimizer=opt, sync="module", on_nonfinite="warn") as guard,
    ):
        warnings.simplefilter("always")
        mu, log_sigma = model(x)
        loss = guard.check_loss((log_sigma + 0.5 * ((y - mu) / log_sigma.exp()) ** 2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.module) for e in origins] == [("forward", "")]
    assert len([w for w in caught if issubclass(w.category, nanguard.NonFiniteWarning)]) == 1
    loss_events = [e for e in guard.events if e.phase == "loss"]
    assert loss_events
    assert not any("outputs were finite" in e.message for e in loss_events)


def test_warn_policy_warns_once_per_origin_and_continues() -> None:
    model = log_mlp()
    with nanguard.watch(model, on_nonfinite="warn") as guard:
        nan_step(guard, model)
        with pytest.warns(nanguard.NonFiniteWarning, match="LogFeatures") as record:
            events = guard.step()
    assert len(record) == 1
    assert record[0].filename == __file__  # attributed to the user's line
    assert [e.is_origin for e in events].count(True) == 1


def test_log_policy_records_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    model = log_mlp()
    caplog.set_level(logging.DEBUG, logger="nanguard")
    with nanguard.watch(model, on_nonfinite="log") as guard, warnings.catch_warnings():
        warnings.simplefilter("error")
        nan_step(guard, model)
        events = guard.step()
    origin_records = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert [r.getMessage() for r in origin_records] == [guard.origin.message]
    assert len(caplog.records) == len(events)
    assert all(r.name == "nanguard" for r in caplog.records)


def test_events_go_to_a_json_lines_file_flushed_as_written(tmp_path: Path) -> None:
    path = tmp_path / "logs" / "nan_events.jsonl"
    model = log_mlp()
    with nanguard.watch(model, on_nonfinite="log", log_path=path) as guard:
        nan_step(guard, model)
        guard.step()
        # Flushed: readable while the guard is still attached (a crash loses nothing).
        lines = path.read_text().splitlines()
        assert len(lines) == len(guard.events)
    records = [json.loads(line) for line in lines]
    assert records[0]["is_origin"] is True
    assert records[0]["module"] == "1"
    assert records[0]["stats"]["first_values"]  # NaN written as the string "nan"
    assert nanguard.read_events(path) == guard.events


def test_log_path_rank_placeholder(tmp_path: Path) -> None:
    model = log_mlp()
    with nanguard.watch(model, on_nonfinite="log", log_path=tmp_path / "ev.{rank}.jsonl") as g:
        nan_step(g, model)
        g.step()
    assert (tmp_path / "ev.0.jsonl").exists()


def test_the_log_is_bounded_and_counts_what_it_dropped() -> None:
    model = log_mlp()
    with nanguard.watch(model, on_nonfinite="log", max_events=3) as guard:
        for _ in range(4):
            nan_step(guard, model)
            guard.step()
    events = guard.events
    assert len(events) == 3
    assert guard.dropped > 0
    assert events[-1].step == 3
    # The first origin is kept apart, whatever was dropped.
    assert guard.origin is not None
    assert guard.origin.step == 0


def test_max_propagated_limits_the_downstream_events() -> None:
    model = log_mlp()
    with nanguard.watch(model, on_nonfinite="log", max_propagated=1) as guard:
        nan_step(guard, model)
        guard.step()
    forward = [e for e in guard.events if e.phase == "forward" and not e.is_origin]
    assert [e.module for e in forward] == ["2"]
    assert guard.origin is not None
    assert guard.origin.n_propagated == 3


def test_a_step_skipped_for_a_nan_loss_with_finite_gradients_says_so() -> None:
    # A Lovasz-style average over the classes present, none in a fully ignored crop: 0/0 in
    # the loss, every gradient finite. The step is skipped for the loss, not its gradients.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard:
        out = model(torch.randn(2, 3, 16, 16))
        valid = torch.zeros(2, 16, 16, dtype=torch.bool)  # every pixel is ignore_index
        probs = out.softmax(1).permute(0, 2, 3, 1)[valid]  # (0, 4): no valid pixel
        present = torch.zeros(4)  # so no class present
        loss = guard.check_loss((probs.sum(0) * present).sum() / present.sum())
        opt.zero_grad()
        loss.backward()
        assert all(bool(p.grad.isfinite().all()) for p in model.parameters())
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "nan")
    skip = next(e for e in guard.events if e.details.get("skipped"))
    assert "its loss was non-finite, so the weights were left as they were" in skip.message
    assert "gradients were non-finite" not in skip.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_batch_the_loop_dropped_itself_does_not_skip_the_next_healthy_update(mode: str) -> None:
    # "if not torch.isfinite(loss): continue": the bad batch gets no backward and no step,
    # so it ends with the next batch's step, whose gradients are finite. skip_step drops
    # steps whose gradients are non-finite: that update is applied, as without nanguard.
    def train(guarded: bool) -> tuple[dict[str, torch.Tensor], list[nanguard.Event]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        guard = nanguard.Guard(model, optimizer=opt, on_nonfinite="skip_step", mode=mode)
        gen = torch.Generator().manual_seed(1)
        with guard if guarded else contextlib.nullcontext():
            for i in range(8):
                x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
                loss = nn.functional.mse_loss(model(x), y)
                if i == 5:
                    loss = loss + torch.log(loss * 0)  # -inf
                if guarded:
                    guard.check_loss(loss)
                opt.zero_grad()
                if not torch.isfinite(loss):
                    continue
                loss.backward()
                opt.step()
        return copy.deepcopy(model.state_dict()), guard.events

    plain, _ = train(False)
    guarded, events = train(True)
    assert all(torch.equal(plain[k], guarded[k]) for k in plain)
    origins = [e for e in events if e.is_origin]
    assert [(e.step, e.phase, e.kind) for e in origins] == [(5, "loss", "inf")]
    assert not any(e.details.get("skipped") for e in events)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("bad", ["input", "target"])
def test_a_micro_batch_the_loop_dropped_itself_does_not_skip_the_step(mode: str, bad: str) -> None:
    # Gradient accumulation over 4 micro-batches: one, NaN in its batch or its target, gets
    # no backward (the loop's own isfinite check); the step applies the other three's
    # finite gradients, as without nanguard.
    def train(guarded: bool) -> tuple[dict[str, torch.Tensor], list[nanguard.Event]]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        guard = nanguard.Guard(model, optimizer=opt, on_nonfinite="skip_step", mode=mode)
        gen = torch.Generator().manual_seed(1)
        with guard if guarded else contextlib.nullcontext():
            for i in range(12):
                x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
                if i == 6:
                    (x if bad == "input" else y)[2, 0] = float("nan")
                loss = nn.functional.mse_loss(model(x), y) / 4
                if guarded:
                    guard.check_loss(loss)
                if torch.isfinite(loss):
                    loss.backward()
                if i % 4 == 3:
                    opt.step()
                    opt.zero_grad()
        return copy.deepcopy(model.state_dict()), guard.events

    plain, _ = train(False)
    guarded, events = train(True)
    assert all(torch.equal(plain[k], guarded[k]) for k in plain)
    assert [e.step for e in events if e.is_origin] == [1]
    assert not any(e.details.get("skipped") for e in events)


def _warmup_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    import numpy as np

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def warmup(step: int) -> float:  # step / (10 * step), in numpy: 0/0 = NaN at step 0
        with np.errstate(invalid="ignore"):
            return float(np.float64(step) / np.float64(10 * step))

    torch.optim.lr_scheduler.LambdaLR(opt, warmup)
    return model, opt


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_a_nan_learning_rate_stops_the_step_before_the_weights_change(policy: str) -> None:
    model, opt = _warmup_model()
    before = [p.detach().clone() for p in model.parameters()]
    with nanguard.watch(model, optimizer=opt, on_nonfinite=policy) as guard:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        if policy == "raise":
            with pytest.raises(nanguard.NonFiniteError) as raised:
                opt.step()
            event = raised.value.event
        else:
            opt.step()
            event = guard.origin
    assert event is not None
    assert (event.phase, event.kind, event.details["reason"]) == ("param", "nan", "learning_rate")
    assert "learning rate of parameter group 0 of AdamW is nan" in event.message
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_weights_a_logged_nan_learning_rate_moved_are_propagated_from_it(mode: str) -> None:
    # Under "log" the step runs: every weight of the group goes non-finite. They are the
    # learning rate's doing, not origins of their own ("Adam with eps=0", "float16").
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        for i in range(7):
            if i == 5:
                opt.param_groups[0]["lr"] = float("inf")  # a warm-up dividing by 0
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            loss = guard.check_loss(nn.functional.mse_loss(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.step, e.tensor) for e in origins] == [(5, "lr of param group 0")]
    moved = [e for e in guard.events if e.phase == "param" and e.param is not None]
    assert {e.param for e in moved} == {n for n, _ in model.named_parameters()}
    for event in moved:
        assert event.step == 5
        assert "in optimizer.step() with the learning rate inf of parameter group 0" in (
            event.message
        )
        assert event.hint is None


@pytest.mark.filterwarnings("ignore::nanguard.NonFiniteWarning")  # (the spikes before it)
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_typod_head_learning_rate_whose_logits_overflow_the_loss_is_named(mode: str) -> None:
    # lr=1e3 for the head (meant 1e-3): its logits grow until cross_entropy's sum overflows.
    # The outputs' probe sum overflows too: their exact size still reaches the hint.
    torch.manual_seed(0)
    vocab, d = 128, 64
    blocks = [
        nn.TransformerEncoderLayer(d, 4, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
        for _ in range(2)
    ]
    model = nn.Sequential(nn.Embedding(vocab, d), *blocks, nn.LayerNorm(d))
    model.append(nn.Linear(d, vocab, bias=False))
    head = [model[-1].weight]
    rest = [p for p in model.parameters() if p is not model[-1].weight]
    opt = torch.optim.AdamW([{"params": rest}, {"params": head, "lr": 1e3}], lr=1e-3)
    g = torch.Generator().manual_seed(1)
    data = [torch.randint(0, vocab, (16, 33), generator=g) for _ in range(4)]

    def train() -> None:
        for step in range(60):
            batch = data[step % 4]
            logits = model(batch[:, :-1])
            targets = batch[:, 1:].reshape(-1)
            loss = guard.check_loss(nn.functional.cross_entropy(logits.reshape(-1, vocab), targets))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with (
        nanguard.watch(model, optimizer=opt, mode=mode) as guard,
        pytest.raises(nanguard.NonFiniteError) as raised,
    ):
        train()
    origin = raised.value.event
    assert (origin.phase, origin.details["reason"]) == ("loss", "loss")
    assert origin.hint is not None
    assert "huge though finite" in origin.hint
    assert "learning rate" in origin.hint


def test_weights_of_each_group_name_their_own_nan_learning_rate() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[2].parameters()}], lr=0.1
    )
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for i in range(3):
            if i == 1:
                opt.param_groups[0]["lr"] = float("nan")
                opt.param_groups[1]["lr"] = float("inf")
            loss = guard.check_loss(model(torch.randn(16, 8)).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    moved = {e.param: e.message for e in guard.events if e.phase == "param" and e.param}
    assert "the learning rate nan of parameter group 0" in moved["0.weight"]
    assert "the learning rate inf of parameter group 1" in moved["2.weight"]


@pytest.mark.parametrize(
    ("hyper", "make"),
    [
        ("lr", lambda: torch.tensor(float("nan"))),  # a schedule tensor's entry
        ("lr", lambda: numpy.float32("nan")),  # a numpy schedule's
        ("weight_decay", lambda: float("nan")),  # a weight-decay schedule past its end
    ],
    ids=["lr-tensor", "lr-numpy", "weight-decay"],
)
@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_a_non_finite_hyperparameter_of_any_type_stops_the_step_before_it(
    hyper: str, make: Callable[[], object], policy: str
) -> None:
    # DINO-style loops write pg["lr"] = lr_schedule[it] and pg["weight_decay"] = wd[it]
    # from numpy or torch arrays: a NaN entry is caught before it reaches the weights.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.04)
    guard = nanguard.watch(model, optimizer=opt, on_nonfinite=policy)  # type: ignore[arg-type]

    def train() -> None:
        for step in range(3):
            if step == 2:
                opt.param_groups[0][hyper] = make()
            loss = guard.check_loss(model(torch.randn(8, 4)).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard:
        if policy == "raise":
            told = "learning rate" if hyper == "lr" else "weight decay"
            with pytest.raises(nanguard.NonFiniteError, match=f"the {told} of parameter group 0"):
                train()
        else:
            train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.tensor) == (2, "param", f"{hyper} of param group 0")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert "at step 0" not in origin.message  # (step 2: no warm-up's 0/0 at step 0)
