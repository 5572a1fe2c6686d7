"""Attach/detach symmetry, every exit path, and a model left exactly as it was."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from realistic import log_mlp
from torch import Tensor, nn
from torch.optim.optimizer import _global_optimizer_post_hooks

import nanguard


def hook_count(model: nn.Module) -> int:
    """Forward hooks on the model, and nanguard's global optimizer hook (it counts the
    optimizer steps that move the watched weights)."""
    global_hooks = len(_global_optimizer_post_hooks)
    return global_hooks + sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules()
    )


def all_hooked(model: nn.Module) -> bool:
    """Every module has a forward hook (parameter-free activations need no pre-hook)."""
    return all(len(m._forward_hooks) == 1 for m in model.modules())


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 10),
    )


def test_hooks_removed_on_normal_exit() -> None:
    model = cnn()
    with nanguard.watch(model) as guard:
        assert all_hooked(model)
        assert guard.attached
    assert hook_count(model) == 0
    assert not guard.attached


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_hooks_removed_when_the_body_raises(error: BaseException) -> None:
    model = cnn()

    def body() -> None:
        with nanguard.watch(model):
            model(torch.randn(2, 3, 8, 8))
            raise error

    with pytest.raises(type(error)):
        body()
    assert hook_count(model) == 0


def test_an_error_in_the_body_is_not_masked_by_pending_findings() -> None:
    model = log_mlp()
    guard = nanguard.Guard(model)

    def body() -> None:
        with guard:
            model(torch.randn(4, 784))  # NaN pending, never resolved by a step
            raise ValueError("user error")

    with (
        pytest.warns(nanguard.NonFiniteWarning, match="LogFeatures"),
        pytest.raises(ValueError, match="user error"),
    ):
        body()
    assert guard.origin is not None  # still recorded, and warned about rather than raised


def test_hooks_removed_when_the_forward_raises_midway() -> None:
    class Broken(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise RuntimeError("shape mismatch")

    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), Broken()))
    with nanguard.watch(model) as guard:
        with pytest.raises(RuntimeError, match="shape mismatch"):
            model(torch.randn(2, 4))
        # The guard recovered: the next forward is recorded normally.
        model[0](torch.randn(2, 4))
        guard.step()
    assert hook_count(model) == 0


def test_detach_without_context_manager() -> None:
    model = cnn()
    guard = nanguard.watch(model)
    assert hook_count(model) > 0
    guard.detach()
    guard.detach()  # idempotent
    assert hook_count(model) == 0
    guard.attach()  # and it can be attached again
    assert hook_count(model) > 0
    guard.detach()


def test_guard_constructor_does_not_attach() -> None:
    model = cnn()
    guard = nanguard.Guard(model)
    assert not guard.attached
    assert hook_count(model) == 0
    with guard:
        assert hook_count(model) > 0
    assert hook_count(model) == 0


def test_attaching_twice_is_a_clear_error() -> None:
    model = cnn()
    with nanguard.watch(model) as guard:
        with pytest.raises(nanguard.AttachError, match="already watched by another nanguard"):
            nanguard.watch(model)
        before = hook_count(model)
        with pytest.raises(RuntimeError, match="already attached"):
            guard.attach()
        assert hook_count(model) == before  # nothing was added
        assert all_hooked(model)
    assert hook_count(model) == 0


def test_an_ema_copied_after_watch_is_not_the_watched_model() -> None:
    # timm's ModelEmaV2 and torch's AveragedModel deep-copy the model, hooks included,
    # often after the guard is set up. The copy is another model: its own NaN is not an
    # origin of the watched one, it keeps no guard alive, and it can be watched itself.
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.Tanh(), nn.Linear(256, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="raise") as guard:
        ema = copy.deepcopy(model).eval()
        for _ in range(2):
            loss = guard.check_loss(model(torch.rand(8, 784)).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
        with torch.no_grad():
            ema[0].weight.fill_(float("nan"))
            ema(torch.rand(4, 784))  # the EMA's NaN: none of this guard's business
        with nanguard.watch(ema, on_nonfinite="log") as ema_guard, torch.no_grad():
            ema(torch.rand(4, 784))
    assert guard.events == []
    assert ema_guard.origin is not None
    assert ema_guard.origin.param == "0.weight"  # the EMA's own NaN, told to its own guard


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_copy_made_while_watched_sheds_its_inert_hooks() -> None:
    # An EMA or teacher deep-copied mid-training: its first forward drops the inert hooks,
    # and unwatch(copy) drops them at once (torch.jit.script cannot compile them).
    import copy

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    with nanguard.watch(model):
        ema = copy.deepcopy(model)
        teacher = copy.deepcopy(model)
    assert hook_count(ema) > 0  # (inert ones)
    ema(torch.randn(4, 8))
    assert hook_count(ema) == 0
    assert nanguard.unwatch(teacher) == 0  # (no guard watched it)
    assert hook_count(teacher) == 0
    scripted = torch.jit.script(teacher)
    x = torch.randn(4, 8)
    assert torch.equal(scripted(x), model(x))


def test_a_watched_model_can_be_pickled() -> None:
    # torch.save(model) pickles the module with its hooks: the copy gets inert ones.
    import pickle

    model = nn.Sequential(nn.Linear(784, 256), nn.Tanh(), nn.Linear(256, 10))
    with nanguard.watch(model):
        copy = pickle.loads(pickle.dumps(model))
    x = torch.rand(4, 784)
    torch.testing.assert_close(copy(x), model(x))
    with nanguard.watch(copy) as guard:  # not "already watched"
        copy(x)
    assert guard.events == []


class GuardedClassifier(nn.Module):
    """A model keeping its own guard (module level: torch.save pickles the class by name)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3))
        self.guard: nanguard.Guard | None = None

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


def test_a_guard_stored_on_the_model_survives_its_deep_copies_and_pickles() -> None:
    # A LightningModule-style model keeping its guard as an attribute: an EMA made by
    # deepcopy, torch.save(model) of a checkpoint, a spawned worker given the model all
    # failed on the guard's lock, in the middle of training.
    import copy
    import io

    torch.manual_seed(0)
    model = GuardedClassifier()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.guard = nanguard.watch(model, optimizer=opt, on_nonfinite="log")
    try:
        ema = copy.deepcopy(model)
        buffer = io.BytesIO()
        torch.save(model, buffer)
        for step in range(3):
            x = torch.randn(8, 20)
            if step == 2:
                x[1, 4] = float("inf")
            loss = nn.functional.cross_entropy(model(x), torch.randint(0, 3, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        model.guard.detach()
    assert ema.guard is model.guard  # the copy shares the live guard, no second one
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.guard is None
    x = torch.randn(4, 20)
    torch.testing.assert_close(loaded(x), ema(x))
    origin = model.guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.kind) == (2, "input", "inf")


def test_user_hooks_are_left_alone() -> None:
    model = cnn()
    calls = []
    handle = model.register_forward_hook(lambda m, a, o: calls.append(1))
    with nanguard.watch(model):
        model(torch.randn(2, 3, 8, 8))
    model(torch.randn(2, 3, 8, 8))
    assert len(calls) == 2
    assert len(model._forward_hooks) == 1
    handle.remove()


def test_model_state_is_untouched_even_by_a_replay() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(cnn(), nn.LogSoftmax(-1))
    model[0][5].bias.data[3] = float("nan")  # a NaN at the head: replayed for statistics
    model.train()
    x = torch.randn(4, 3, 8, 8)
    reference = nn.Sequential(cnn(), nn.LogSoftmax(-1))
    reference.load_state_dict(model.state_dict())
    reference.train()
    torch.manual_seed(1)
    reference(x)  # the unguarded run: BatchNorm stats updated once, dropout drew once
    expected_state = {k: v.clone() for k, v in reference.state_dict().items()}
    expected_rng = torch.get_rng_state()

    torch.manual_seed(1)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(x)
        guard.step()
    assert guard.origin is not None
    assert guard.origin.module == "0.5"
    assert guard.origin.stats is not None  # computed by a replay of the forward
    assert torch.equal(torch.get_rng_state(), expected_rng)
    state = model.state_dict()
    assert state.keys() == expected_state.keys()
    for key, value in expected_state.items():
        assert torch.equal(state[key], value) or (
            torch.isnan(value).any() and torch.equal(state[key].isnan(), value.isnan())
        ), key
    assert model.training
    assert all(m.training for m in model.modules())


def test_eval_flag_is_untouched() -> None:
    model = cnn().eval()
    with nanguard.watch(model):
        model(torch.randn(2, 3, 8, 8))
    assert not any(m.training for m in model.modules())


def test_no_reference_to_activations_survives_the_step() -> None:
    model = log_mlp()
    refs: list[weakref.ref[Tensor]] = []
    handle = model[2].register_forward_hook(lambda m, a, o: refs.append(weakref.ref(o)))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        out = model(torch.randn(8, 784))
        loss = guard.check_loss(out.sum())
        loss.backward()
        del out, loss
        guard.step()
        gc.collect()
        assert refs[0]() is None
    handle.remove()


def test_exclude_by_type_and_name_skips_subtrees() -> None:
    model = cnn()
    with nanguard.watch(model, exclude=(nn.Dropout, "1")) as guard:
        hooked = {m for m in model.modules() if m._forward_hooks}
        assert model[3] not in hooked
        assert model[1] not in hooked
        assert model[0] in hooked
        model(torch.randn(2, 3, 8, 8))
        guard.step()


def test_a_nan_created_inside_an_excluded_module_is_reported_where_next_seen() -> None:
    class LogLayer(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.log()

    model = nn.Sequential(nn.Linear(4, 4), LogLayer(), nn.Linear(4, 2))
    with nanguard.watch(model, on_nonfinite="log", exclude=(LogLayer,)) as guard:
        model(torch.randn(8, 4))
        guard.step()
    assert guard.origin is not None
    # The excluded layer runs as part of its parent's code: the parent is named.
    assert (guard.origin.module, guard.origin.tensor) == ("", "args[0] of 2")


class MemoryBank(nn.Module):
    """Keys of recent batches, NaN in the slots not filled yet (skipped when read)."""

    def __init__(self, slots: int = 256, dim: int = 16) -> None:
        super().__init__()
        self.register_buffer("keys", torch.full((slots, dim), float("nan")))
        self.at = 0

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.keys[self.at : self.at + x.shape[0]] = x.detach()
            self.at = (self.at + x.shape[0]) % self.keys.shape[0]
        filled = self.keys[~torch.isnan(self.keys).any(1)]
        return x @ filled.T


class BankModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 16)
        self.bank = MemoryBank()

    def forward(self, x: Tensor) -> Tensor:
        return self.bank(self.enc(x)).logsumexp(1).mean()


def _train_bank(**options: object) -> nanguard.Guard:
    torch.manual_seed(0)
    model = BankModel()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, **options) as guard:  # type: ignore[arg-type]
        for _ in range(20):  # (past the periodic sweep of the buffers)
            loss = model(torch.randn(4, 8))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return guard


def test_a_buffer_nan_from_the_start_says_how_to_exclude_its_module() -> None:
    with pytest.raises(nanguard.NonFiniteError, match="already NaN before the first step") as e:
        _train_bank()
    assert e.value.event.param == "bank.keys"
    assert "exclude its module: exclude=('bank',)" in e.value.event.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_buffers_of_an_excluded_module_are_not_swept(mode: str) -> None:
    guard = _train_bank(exclude=("bank",), mode=mode)
    assert guard.events == []


def test_custom_names_from_ordered_dict_and_names_option() -> None:
    from collections import OrderedDict

    class LogLayer(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.log()

    log = LogLayer()
    model = nn.Sequential(OrderedDict(encoder=nn.Linear(4, 4), logf=log, decoder=nn.Linear(4, 2)))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(8, 4))
        guard.step()
    assert guard.origin is not None
    assert guard.origin.module == "logf"
    with nanguard.watch(model, on_nonfinite="log", names={log: "features.log"}) as guard:
        model(torch.randn(8, 4))
        guard.step()
    assert guard.origin is not None
    assert guard.origin.module == "features.log"
    assert "`features.log` (LogLayer)" in guard.origin.message


def test_names_match_named_modules_with_shared_submodules() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    with nanguard.watch(model) as guard:
        names = {h.name for h in guard._hooked_modules()}
    assert names == {name for name, _ in model.named_modules()}


class _Log0(nn.Module):
    """log(0) while ``on``: a stopped step leaves NaN gradients in ``.grad``."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.log(torch.zeros_like(x)) if self.on else x


def _stopped_step(mode: str) -> tuple[nn.Module, torch.optim.Optimizer, Tensor]:
    """A step the first guard stops before optimizer.step(): NaN stays in .grad."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), _Log0(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 8)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        model[1].on = True
        loss = guard.check_loss(model(x).pow(2).mean())
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
        model[1].on = False
    assert guard.origin is not None
    assert guard.origin.module == "1"
    assert not torch.isfinite(model[0].weight.grad).all()
    return model, opt, x


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_gradients_left_before_attach_are_not_a_new_guards_origin(mode: str) -> None:
    # The NaN gradients of a step an earlier guard stopped: an evaluation under a new
    # guard runs no backward, so nothing there is its to report.
    model, _, x = _stopped_step(mode)
    with nanguard.watch(model, mode=mode) as guard:
        with torch.no_grad():
            model(x)
        guard.step()
    assert guard.events == []


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_gradients_left_before_attach_are_checked_when_an_optimizer_applies_them(
    mode: str,
) -> None:
    model, opt, _ = _stopped_step(mode)
    before = model[0].weight.detach().clone()
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="skip_step") as guard:
        opt.step()  # (no backward since: the optimizer would apply the NaN gradients)
    assert guard.origin is not None
    assert guard.origin.phase == "grad"
    assert torch.equal(model[0].weight, before)  # skipped: the weights stay finite


class _SharedTable(nn.Module):
    """Holds a parameter another model holds too (an embedding table given to both)."""

    def __init__(self, table: nn.Parameter) -> None:
        super().__init__()
        self.table = table
        self.act = _Log0()
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.act(x @ self.table.T))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("first", ["a", "b"])
def test_a_parameter_shared_with_another_watched_model_blames_that_models_origin(
    mode: str, first: str
) -> None:
    # B's log(0) sends NaN into the shared table's gradient; A's own backward was finite.
    # Whichever optimizer steps first, every error the user sees is B's origin, and A's
    # event points at it.
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(16, 8) * 0.1)
    a, b = _SharedTable(table), _SharedTable(table)
    opt_a = torch.optim.SGD(a.parameters(), lr=0.01)
    opt_b = torch.optim.SGD(b.head.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    errors: list[nanguard.Event] = []
    try:
        with (
            nanguard.watch(a, optimizer=opt_a, mode=mode) as guard_a,
            nanguard.watch(b, optimizer=opt_b, mode=mode) as guard_b,
        ):
            b.act.on = True
            loss = (a(x) - y).pow(2).mean() + (b(x) - y).pow(2).mean()
            loss.backward()
            for opt in (opt_a, opt_b) if first == "a" else (opt_b, opt_a):
                try:
                    opt.step()
                except nanguard.NonFiniteError as error:
                    errors.append(error.event)
            b.act.on = False
    except nanguard.NonFiniteError as error:  # (A's last step, resolved at its exit)
        errors.append(error.event)
    assert errors
    assert all((e.module, e.op) == ("act", "aten.log.default") for e in errors)
    assert guard_b.origin is not None
    assert guard_b.origin.module == "act"
    assert [e for e in guard_a.events if e.is_origin] == []
    told = next(e for e in guard_a.events if e.param == "table")
    assert "also _SharedTable's, watched by another guard" in told.message
    assert "aten.log.default" in told.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_gradients_left_before_attach_are_checked_at_a_guard_step_ending_no_forward(
    mode: str,
) -> None:
    # A notebook cell re-run: the guard watches again, and guard.step(); opt.step() finishes
    # the step an earlier guard stopped. opt.step() would apply the NaN gradients.
    model, _, _ = _stopped_step(mode)
    before = model[0].weight.detach().clone()
    guard = nanguard.watch(model, mode=mode)
    try:
        with (
            pytest.warns(RuntimeWarning, match="ends without a recorded call"),
            pytest.raises(nanguard.NonFiniteError) as raised,
        ):
            guard.step()
    finally:
        guard.detach()
    event = raised.value.event
    assert (event.phase, event.details["reason"]) == ("grad", "before_watch")
    assert "it was in .grad already when watch() began" in event.message
    assert torch.equal(model[0].weight, before)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_validation_loss_with_gradients_on_keeps_no_graph(mode: str) -> None:
    import weakref

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        loss = guard.check_loss(model(torch.randn(8, 16)).pow(2).mean())
        loss.backward()
        opt.step()
        model.eval()  # validation, gradients left on (no torch.no_grad())
        outputs = []
        for _ in range(5):
            out = model(torch.randn(8, 16))
            guard.check_loss(out.pow(2).mean())
            outputs.append(weakref.ref(out))
            del out
        gc.collect()
        assert [ref() for ref in outputs] == [None] * 5


def test_a_shared_parameter_origin_is_warned_under_warn() -> None:
    # Two guards, a tied embedding: B's origin is resolved by A's step; someone must say it.
    torch.manual_seed(0)
    table = nn.Parameter(torch.randn(16, 8) * 0.1)
    a, b = _SharedTable(table), _SharedTable(table)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    guard_a = nanguard.watch(a, on_nonfinite="warn")
    guard_b = nanguard.watch(b, on_nonfinite="warn")
    try:
        b.act.on = True
        loss = (a(x) - y).pow(2).mean() + (b(x) - y).pow(2).mean()
        loss.backward()
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            guard_a.step()
            guard_b.step()
    finally:
        guard_a.detach()
        guard_b.detach()
    told = [str(w.message) for w in warned if issubclass(w.category, nanguard.NonFiniteWarning)]
    assert len(told) == 1
    assert "in `act` (_Log0)" in told[0]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_batch_under_inference_mode_is_reported_not_a_crash(mode: str) -> None:
    # Inference tensors have no version counter: reading one must not break the model call.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard, torch.inference_mode():  # type: ignore[arg-type]
        x = torch.randn(4, 8)  # (an inference tensor, made under inference_mode)
        x[2, 3] = float("nan")
        model(x)
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("input", "args[0]")
    assert origin.details.get("inference") is True
