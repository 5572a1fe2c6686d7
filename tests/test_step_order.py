"""Where the step ends relative to ``optimizer.step()``, and what happens after NaN weights.

A weight found non-finite when the step is resolved may have been corrupted before the
step's forward (then the forward only propagated it) or by an optimizer step that ran after
it (``guard.step()`` called after ``optimizer.step()``, the closures of LBFGS). nanguard
tells the two apart by counting the optimizer steps that move the watched weights.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from realistic import LogFeatures, PairNet
from torch import Tensor, nn

import nanguard


def log_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), LogFeatures(), nn.Linear(16, 1))


@pytest.mark.parametrize("guard_step_first", [True, False])
def test_guard_step_before_or_after_the_optimizer_names_the_same_forward_origin(
    guard_step_first: bool,
) -> None:
    model = log_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nanguard.watch(model, on_nonfinite="log")
    try:
        loss = guard.check_loss(model(torch.randn(4, 8)).pow(2).mean())
        opt.zero_grad()
        loss.backward()
        if guard_step_first:
            guard.step()
            opt.step()
        else:
            opt.step()  # applies the NaN gradients to every weight
            guard.step()
    finally:
        guard.detach()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.module_type) == (
        0,
        "forward",
        "1",
        "LogFeatures",
    )
    # Either way the weights went NaN in step 0's update, because of its NaN gradients
    # (found by the final check at detach, or by the resolution after the update).
    params = [e for e in guard.events if e.phase == "param"]
    assert len(params) == 4
    assert all(not e.is_origin and e.step == 0 for e in params)
    assert all("because its gradient was non-finite" in e.message for e in params)
    assert not any("before the first step" in e.message for e in params)
    if not guard_step_first:
        # The replay cannot give exact statistics: the weights moved since the forward.
        assert "optimizer.step() changed the weights" in origin.message


def test_an_unrelated_optimizer_does_not_count_as_an_update() -> None:
    model = log_net()
    other = nn.Linear(2, 2)
    other_opt = torch.optim.SGD(other.parameters(), lr=0.1)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        loss = guard.check_loss(model(torch.randn(4, 8)).pow(2).mean())
        loss.backward()
        other(torch.randn(1, 2)).sum().backward()
        other_opt.step()  # moves someone else's weights only
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.module == "1"
    # The replay still ran: the watched weights did not move.
    assert origin.stats is not None
    assert origin.stats.nan_count > 0


class LogOfShift(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Parameter(torch.tensor(3.0))

    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x + self.shift)


def test_lbfgs_closure_origin_is_reported_in_the_step_that_made_it() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), LogOfShift(), nn.Linear(8, 1))
    x, y = torch.randn(32, 4), torch.randn(32, 1) * 50
    opt = torch.optim.LBFGS(model.parameters(), lr=1.0, max_iter=20)

    def closure() -> Tensor:
        opt.zero_grad()
        loss = guard.check_loss((model(x) - y).pow(2).mean())
        loss.backward()
        return loss

    def train() -> None:
        for _ in range(10):
            opt.step(closure)

    with (
        nanguard.watch(model, optimizer=opt, on_nonfinite="raise") as guard,
        pytest.raises(nanguard.NonFiniteError) as info,
    ):
        train()
    origin = info.value.event
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "1", "LogOfShift")
    # Raised at the end of the optimizer step whose closure made it, not one step later.
    assert origin.step == guard.current_step - 1
    assert not any(e.phase == "param" and e.is_origin for e in guard.events)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.fc1(x) + 1.0)  # a little own code between the children


def test_steps_after_the_weights_went_nan_create_no_new_origin() -> None:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(3):
            x = torch.randn(2, 4)
            if step == 0:
                x[0, 0] = float("nan")  # one bad batch; "log" lets it into the weights
            loss = guard.check_loss(model(x).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.step, e.phase, e.module) for e in origins] == [(0, "input", "")]
    later = [e for e in guard.events if e.step > 0 and e.phase != "param"]
    assert later
    assert all(not e.is_origin for e in later)
    assert any("nothing new was created" in e.message for e in later)


def assert_distance_backward(origin: nanguard.Event | None) -> None:
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type, origin.tensor) == (
        "backward",
        "d",
        "PairDistance",
        "grad of args[0]",
    )


@pytest.mark.parametrize(("micro_batches", "bad"), [(100, 5), (40, 39)])
def test_long_gradient_accumulation_keeps_every_micro_batch_to_the_step_end(
    micro_batches: int, bad: int
) -> None:
    torch.manual_seed(0)
    model = PairNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for micro in range(micro_batches):
            x = torch.randn(4, 4)
            if micro == bad:
                x[1] = x[0]  # d/dx sqrt(0) is infinite
            guard.check_loss(model(x).mean() / micro_batches).backward()
        opt.step()
    if bad < 8:  # the gradients reaching the outputs are kept for the first 8 forwards
        assert_distance_backward(guard.origin)
        return
    origin = guard.origin
    assert origin is not None
    # Beyond them no replay of the backward is possible, and the report says why.
    assert (origin.phase, origin.param) == ("grad", "a.weight")
    assert "were not kept" in origin.message
    assert "saw only finite values" not in origin.message


def test_a_no_grad_forward_before_the_backward_leaves_the_training_forward_pending() -> None:
    """Mean teacher / FixMatch: targets from the same model under no_grad, between the
    training forward and its backward."""
    torch.manual_seed(0)
    model = PairNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        x = torch.randn(4, 4)
        x[1] = x[0]
        out = model(x)
        with torch.no_grad():
            target = model(torch.randn(4, 4))
        loss = guard.check_loss((out - target).pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert_distance_backward(guard.origin)


def test_a_no_grad_forward_is_resolved_on_its_own_at_once() -> None:
    model = log_net()
    guard = nanguard.watch(model, on_nonfinite="log")
    try:
        x = torch.rand(4, 8)
        model(x).sum().backward()  # a training forward, its step not ended
        bad = torch.randn(4, 8)
        bad[0, 0] = float("nan")
        with torch.no_grad():
            model(bad)
        origin = guard.origin
        assert origin is not None
        assert (origin.phase, origin.module) == ("input", "")
        assert len(guard._recorder.take_pending()) == 1  # the training forward still waits
    finally:
        guard.detach()


def test_an_interrupted_forward_does_not_swallow_later_steps() -> None:
    """Ctrl-C inside a forward (a notebook): PyTorch skips the forward hooks that run
    always on exceptions, for a KeyboardInterrupt. The next call starts afresh."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = nanguard.watch(model, optimizer=opt, on_nonfinite="log")
    try:

        def interrupted(x: Tensor) -> Tensor:
            raise KeyboardInterrupt

        model[2].forward = interrupted  # type: ignore[method-assign]
        with pytest.raises(KeyboardInterrupt):
            model(torch.rand(4, 8))
        del model[2].forward
        for _ in range(3):
            opt.zero_grad()
            guard.check_loss(model(torch.rand(4, 8)).pow(2).mean()).backward()
            opt.step()
        assert guard.events == []
        x = torch.rand(4, 8)
        x[0, 0] = float("nan")
        opt.zero_grad()
        guard.check_loss(model(x).pow(2).mean()).backward()
        opt.step()
        origin = guard.origin
        assert origin is not None
        assert (origin.step, origin.phase, origin.module) == (3, "input", "")
    finally:
        guard.detach()


class Recursive(nn.Module):
    """Calls itself (a recursive net): its own nested call is not an interrupted one."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(4, 4)
        self.log = LogFeatures()

    def forward(self, x: Tensor, depth: int = 2) -> Tensor:
        h = self.cell(x)
        if depth == 0:
            return self.log(h)
        return self(h, depth - 1)


def test_a_model_that_calls_itself_is_one_forward() -> None:
    torch.manual_seed(0)
    model = Recursive()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(torch.randn(4, 4)).sum()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "log", "LogFeatures")
    # It reached the three nested calls of the model, innermost first.
    assert origin.propagated == ("#2", "#1", "")
    assert "(the model (call 2), the model (call 1), the model)" in origin.message


@pytest.mark.parametrize("assign", [True, False])
def test_a_new_optimizer_after_a_resume_still_ends_the_steps(assign: bool) -> None:
    # Resume code rebuilds the optimizer for the loaded weights (with assign=True they are
    # new tensors): the guard's optimizer= never steps again.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    found_at = []
    with (
        warnings.catch_warnings(record=True) as caught,
        nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard,
    ):
        warnings.simplefilter("always")
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=assign)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for step in range(50):
            x = torch.randn(16, 8)
            if step == 4:
                x[3, 0] = float("nan")
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            found_at.append(guard.origin is not None)
    # Found at that step's end when the old optimizer no longer holds the weights (the new
    # one takes over after two steps, then checked before it moves them); else once the old
    # one, which never stepped, has been silent for 32 steps of the new one; never only at
    # detach.
    first = found_at.index(True)
    assert first == 4 if assign else 4 <= first < 40
    if assign:
        said = [str(w.message) for w in caught if "another Adam steps the watched" in str(w)]
        assert len(said) == 1
        assert "checked before it moves the weights (its 2 step(s) so far" in said[0]
    else:
        assert any("another optimizer" in str(w.message) for w in caught)
    assert guard.origin is not None
    assert (guard.origin.phase, guard.origin.module) == ("input", "")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_without_optimizer_or_guard_step_the_steps_end_at_the_optimizers_step(mode: str) -> None:
    # The quickstart without optimizer= and with guard.step() forgotten: nothing ended a
    # step, so a NaN batch was found only at exit, 15 updates later. Two optimizers (the
    # backbone's and the head's) step every iteration: one of them ends the steps.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    backbone = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.SGD(model[2].parameters(), lr=0.1)
    found_at = []
    with (
        warnings.catch_warnings(record=True) as caught,
        nanguard.watch(model, mode=mode, on_nonfinite="log") as guard,
    ):
        warnings.simplefilter("always")
        for step in range(20):
            x = torch.randn(16, 8)
            if step == 5:
                x[3, 0] = float("nan")
            loss = model(x).pow(2).mean()
            backbone.zero_grad()
            head.zero_grad()
            loss.backward()
            backbone.step()
            head.step()
            found_at.append(guard.origin is not None)
    assert found_at.index(True) == 5
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (5, "input", "")
    # The steps after compute with the weights step 5's update made NaN: nothing new.
    assert [e.step for e in guard.events if e.is_origin] == [5]
    told = [str(w.message) for w in caught if "no training step ended" in str(w.message)]
    assert len(told) == 1
    assert "SGD.step() moved the watched weights twice" in told[0]
    assert "optimizer=" in told[0]


def test_guard_step_after_the_optimizers_step_gets_no_forgotten_step_warning() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        warnings.catch_warnings(record=True) as caught,
        nanguard.watch(model, on_nonfinite="log") as guard,
    ):
        warnings.simplefilter("always")
        for step in range(8):
            x = torch.randn(16, 8)
            if step == 4:
                x[3, 0] = float("nan")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
            guard.step()
    assert [str(w.message) for w in caught if "no training step ended" in str(w.message)] == []
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (4, "input")
    assert [e.step for e in guard.events if e.is_origin] == [4]


def test_a_validation_loop_with_gradients_on_keeps_few_batches() -> None:
    # model.eval() without torch.no_grad(): every forward is a training forward waiting for
    # an optimizer step that comes only after the whole validation. Only the first batches
    # are kept for a replay; the bad one is still found, by its probes.
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    alive = []
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        model.eval()
        for i in range(100):
            x = torch.randn(8, 8)
            if i == 50:
                x[2, 3] = float("nan")
            model(x)
            alive.append(weakref.ref(x))
        gc.collect()
        assert sum(r() is not None for r in alive) <= 40
    assert guard.origin is not None
    assert (guard.origin.phase, guard.origin.module) == ("input", "")


@pytest.mark.parametrize("train", [True, False])
def test_sentinel_localises_a_late_micro_batch_of_a_long_accumulation(train: bool) -> None:
    # Softplus underflows to 0 for very negative inputs: log(0) in micro-batch 35 only.
    # Also in eval() mode (fine-tuning with frozen BatchNorm statistics): each micro-batch
    # gets its backward, so it is no validation forward and keeps its inputs.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Softplus(), LogFeatures(), nn.Linear(4, 1))
    model.train(train)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode="sentinel") as guard:
        for micro in range(40):
            x = torch.randn(8, 4)
            out = model(x) if micro != 35 else model(-torch.ones(8, 4) * 1e3)
            (out.mean() / 40).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "2", "aten.log.default")


def test_healthy_loops_get_no_step_warnings() -> None:
    # A warm-up optimizer step before any forward, 70 float32 micro-batches of one step,
    # and a validation loop run with gradients on: none of them is a skipped step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with (
        warnings.catch_warnings(record=True) as caught,
        nanguard.watch(model, optimizer=opt, on_nonfinite="raise"),
    ):
        warnings.simplefilter("always")
        opt.step()  # warm-up: no forward, no gradients
        for _ in range(70):
            (model(torch.randn(4, 8)).pow(2).mean() / 70).backward()
        opt.step()
        model.eval()
        for _ in range(70):
            model(torch.randn(4, 8))
        model.train()
    assert [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)] == []


def test_a_failing_step_keeps_nothing_alive_afterwards() -> None:
    import gc
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        x = torch.randn(8, 8)
        x[0, 0] = float("nan")  # a bad batch; the following ones are healthy
        loss = model(x).sum()
        loss.backward()
        opt.step()
        assert guard.origin is not None
        kept = weakref.ref(x)
        del x, loss
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 8)).sum().backward()
            opt.step()
        gc.collect()
        assert kept() is None


class ImprintedClassifier(nn.Module):
    """Cosine classifier whose class weights are imprinted from backbone embeddings; its
    margin term takes sqrt(1 - cos**2), NaN where rounding pushes |cos| above 1."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16))
        self.weight = nn.Parameter(torch.randn(4, 16))

    def forward(self, x: Tensor) -> Tensor:
        emb = nn.functional.normalize(self.backbone(x), dim=1)
        cos = emb @ nn.functional.normalize(self.weight, dim=1).t()
        return torch.sqrt(1.0 - cos * 1.5)  # (a bad margin: cos > 2/3 gives NaN)


def test_a_no_grad_call_of_a_submodule_is_not_counted_as_a_forward_of_the_model() -> None:
    torch.manual_seed(0)
    model = ImprintedClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 8)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        with torch.no_grad():  # imprint the class weights from the backbone's embeddings
            model.weight.copy_(model.backbone(x[:4]))
        loss = guard.check_loss(model(x).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "")
    assert "forward" not in origin.details  # the model ran once in this step
    assert "It was forward" not in origin.message


class FixMatchNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
        )
        self.classifier = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.backbone(x))


def test_pseudo_labels_from_submodule_calls_carry_a_bad_image_as_one_origin() -> None:
    # FixMatch: pseudo-labels from model.classifier(model.backbone(x_weak)) under no_grad;
    # one weakly augmented image is corrupt. The classifier only gets what the backbone made.
    torch.manual_seed(0)
    model = FixMatchNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x_weak, x_strong = torch.randn(8, 3, 8, 8), torch.randn(8, 3, 8, 8)
    x_weak[0, 0, 0, 0] = float("nan")
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        with torch.no_grad():
            pseudo = model.classifier(model.backbone(x_weak)).argmax(-1)
        loss = nn.functional.cross_entropy(model(x_strong), pseudo)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.module) for e in origins] == [("input", "backbone")]
    carried = next(e for e in guard.events if e.module == "classifier" and e.phase == "input")
    assert "carried on" in carried.message


def test_a_weight_renormalised_by_user_code_after_the_step_is_not_blamed_on_the_rate() -> None:
    # Prototypes kept on the unit sphere by hand after each SGD step; a spare prototype's
    # row is all zeros: 0/0. SGD cannot make that NaN from a finite gradient (an update of
    # about 1e-3): "lower the learning rate" sent the user the wrong way.
    class ProtoNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc = nn.Linear(4, 8)
            self.proto = nn.Linear(8, 5, bias=False)
            with torch.no_grad():
                self.proto.weight[4] = 0.0  # a spare prototype, unused for now

        def forward(self, x: Tensor) -> Tensor:
            return self.proto(torch.relu(self.enc(x)))[:, :4]  # type: ignore[no-any-return]

    torch.manual_seed(0)
    model = ProtoNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(3):
            logits = model(torch.randn(16, 4))
            loss = nn.functional.cross_entropy(logits, torch.randint(0, 4, (16,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
            with torch.no_grad():
                model.proto.weight.div_(model.proto.weight.norm(dim=1, keepdim=True))
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.param, origin.kind) == (
        0,
        "param",
        "proto.weight",
        "nan",
    )
    assert origin.hint is not None
    assert origin.hint.startswith(
        "SGD.step() cannot make NaN from finite gradients and weights this small"
    )
    assert "code that writes the weights after the step" in origin.hint
    assert "Lower the learning rate" not in origin.hint


def test_skip_step_resolved_after_the_update_is_not_recommended_to_itself() -> None:
    # Steps ended at the optimizer's step (no optimizer=, no guard.step(): Lightning's loop
    # with the guard around trainer.fit): skip_step cannot act, the weights go NaN, and the
    # summary told this skip_step user to use skip_step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        warnings.catch_warnings(record=True) as caught,
        nanguard.watch(model, on_nonfinite="skip_step") as guard,
    ):
        warnings.simplefilter("always")
        for step in range(8):
            x = torch.randn(16, 8)
            if step == 3:
                x[3, 0] = float("nan")
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    assert any("skip_step' cannot skip them" in str(w.message) for w in caught)
    dead = [e for e in guard.events if "cannot recover by itself" in e.message]
    assert dead
    assert "can only stop an update the step is resolved before" in dead[0].message
    assert "'raise' or 'skip_step' stop" not in dead[0].message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_a_second_stage_optimizer_built_after_watch_is_checked_before_it_steps(
    mode: str, policy: str
) -> None:
    # Two-stage fine-tuning: a new optimizer for the same weights, not given to the guard.
    # It takes over as the steps' end after two of its steps, so a NaN batch later is
    # stopped before it moves the weights (it was found only at detach, under "raise"
    # warned then, under "skip_step" applied).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    guard = nanguard.watch(model, optimizer=opt, on_nonfinite=policy, mode=mode)
    raised_at = None
    with warnings.catch_warnings(record=True) as caught, guard:
        warnings.simplefilter("always")
        for i in range(8):
            if i == 3:
                opt = torch.optim.Adam(model.parameters(), lr=5e-3)  # stage 2
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 1, generator=gen)
            if i == 5:
                x[3, 2] = float("nan")
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            try:
                opt.step()
            except nanguard.NonFiniteError:
                raised_at = i
                break
    assert all(bool(p.isfinite().all()) for p in model.parameters())
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (5, "input")
    if policy == "raise":
        assert raised_at == 5
    else:
        assert any(e.details.get("skipped") for e in guard.events)
    assert sum("another Adam steps the watched weights" in str(w.message) for w in caught) == 1


class TrunkTwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.pi = nn.Linear(32, 4)
        self.v = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.trunk(x)
        return self.pi(h), self.v(h).squeeze(-1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("policy_first", [False, True])
def test_a_value_optimizer_stepping_several_times_a_policy_step_does_not_take_over(
    mode: str, policy_first: bool
) -> None:
    # PPO with a shared trunk: the value optimizer holds every weight and steps three times
    # for each step of the policy's (the guard's optimizer=), which keeps stepping. It is
    # no replacement: a NaN advantage must still stop the policy's step before it applies.
    torch.manual_seed(0)
    model = TrunkTwoHeads()
    opt_pi = torch.optim.Adam([*model.trunk.parameters(), *model.pi.parameters()], 1e-3)
    opt_v = torch.optim.Adam(model.parameters(), 1e-3)
    guard = nanguard.watch(model, optimizer=opt_pi, on_nonfinite="raise", mode=mode)

    def train() -> None:
        for it in range(6):
            obs, ret = torch.randn(64, 8), torch.randn(64)
            for _ in range(0 if policy_first else 3):
                value_loss = (model(obs)[1] - ret).pow(2).mean()
                opt_v.zero_grad()
                value_loss.backward()
                opt_v.step()
            logits, value = model(obs)
            adv = ret - value.detach()
            if it == 4:
                adv = adv / adv[:0].std()  # the std of nothing: NaN
            logp = logits.log_softmax(-1)[:, 0]
            opt_pi.zero_grad()
            (-(logp * adv).mean()).backward()
            opt_pi.step()
            for _ in range(3 if policy_first else 0):
                value_loss = (model(obs)[1] - ret).pow(2).mean()
                opt_v.zero_grad()
                value_loss.backward()
                opt_v.step()

    with warnings.catch_warnings(record=True) as caught, guard:
        warnings.simplefilter("always")
        with pytest.raises(nanguard.NonFiniteError):
            train()
    assert not [w for w in caught if "steps the watched weights" in str(w.message)]
    assert all(bool(p.isfinite().all()) for p in model.parameters())


def test_a_second_stage_optimizer_takes_over_with_a_grad_scaler_too() -> None:
    # The scaler's wrapper held the first optimizer for good: nanguard's own reference kept
    # it "held", and the new one never became the guard's.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    guard = nanguard.watch(model, optimizer=opt, scaler=scaler, on_nonfinite="log")
    with warnings.catch_warnings(record=True) as caught, guard:
        warnings.simplefilter("always")
        for i in range(8):
            if i == 3:
                opt = torch.optim.Adam(model.parameters(), lr=5e-3)  # stage 2
            loss = model(torch.randn(16, 8)).pow(2).mean()
            opt.zero_grad()
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    assert sum("another Adam steps the watched weights" in str(w.message) for w in caught) == 1
    assert guard.events == []


def test_a_guard_on_the_optimizer_that_steps_second_says_to_pass_the_first() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    body = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.SGD(model[2].parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with torch.no_grad():
        model[0].weight[0] = float("inf")  # (an Inf the first layer makes from its weights)
    with nanguard.watch(model, optimizer=head, on_nonfinite="log") as guard:
        loss = model(x).sum()
        body.zero_grad()
        head.zero_grad()
        loss.backward()
        body.step()  # moves the weights before the guard's optimizer resolves the step
        head.step()
    problems = [e.details.get("stats_problem") for e in guard.events if e.is_origin]
    assert problems
    assert problems[0] is not None
    assert "pass the one that steps first" in problems[0]
