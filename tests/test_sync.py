"""No host-device synchronisation inside a guarded forward/backward.

Two independent witnesses: ``aten._local_scalar_dense`` (what every device-to-host
read of a scalar dispatches to) counted by a ``TorchDispatchMode``, and the
Python-level reads (``item``, ``tolist``, ``bool``, ``float``, ``numpy``, ``cpu``,
printing) counted by a ``TorchFunctionMode``. The resolution at the end of the
step is the one sync, outside the counted region.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from realistic import TinyLM
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import nanguard

READS = {
    Tensor.item,
    Tensor.tolist,
    Tensor.__bool__,
    Tensor.__float__,
    Tensor.__int__,
    Tensor.__index__,
    Tensor.numpy,
    Tensor.cpu,
    Tensor.__repr__,
    Tensor.__str__,
    Tensor.__format__,
}


class CountScalarReads(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


class CountPythonReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in READS:
            self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def count_reads(step: Any) -> tuple[int, list[str]]:
    with CountScalarReads() as dispatch, CountPythonReads() as python:
        step()
    return dispatch.count, python.calls


def mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.2),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 10),
    )


@pytest.mark.parametrize(("factory", "shape"), [(mlp, (16, 32)), (cnn, (4, 3, 8, 8))])
def test_zero_syncs_in_a_guarded_forward_and_backward(factory: Any, shape: tuple[int, ...]) -> None:
    model = factory()
    x = torch.randn(*shape)
    with nanguard.watch(model) as guard:

        def step() -> None:
            out = model(x)
            loss = guard.check_loss(nn.functional.cross_entropy(out, torch.zeros(len(x)).long()))
            loss.backward()

        step()
        guard.step()
        scalars, python = count_reads(step)
        guard.step()
    assert scalars == 0
    assert python == []


@pytest.fixture
def accelerator_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read the probes as on an accelerator: all at once (a CPU reads them one by one,
    which costs less there and syncs with nothing)."""
    monkeypatch.setattr(nanguard._resolution, "CPU_VALUES_ONE_BY_ONE", False)


@pytest.mark.usefixtures("accelerator_reads")
def test_the_end_of_the_step_is_one_read() -> None:
    model = mlp()
    with nanguard.watch(model) as guard:
        model(torch.randn(4, 32)).sum().backward()
        scalars, python = count_reads(guard.step)
    assert scalars == 0  # tolist() copies all probes at once, no scalar reads
    assert python == ["tolist"]


def test_transformer_adds_no_sync_to_its_own() -> None:
    # nn.TransformerEncoder syncs on its own (it inspects the mask); nanguard adds none.
    model = TinyLM()
    idx = torch.randint(0, 50, (2, 12))

    def step() -> None:
        model(idx).float().pow(2).mean().backward()

    baseline = count_reads(step)
    with nanguard.watch(model) as guard:
        guarded = count_reads(step)
        guard.step()
    assert guarded == baseline


def test_sync_module_mode_does_read_per_module() -> None:
    model = mlp()
    with nanguard.watch(model, sync="module"):
        _scalars, python = count_reads(lambda: model(torch.randn(4, 32)))
    assert len(python) >= 3  # one read per probed tensor: the cost of the debugging mode


class ActionMaskPolicy(nn.Module):
    """An RL policy that masks invalid actions with -inf in its own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 6))

    def forward(self, obs: Tensor, action_mask: Tensor) -> Tensor:
        return self.body(obs).masked_fill(~action_mask, float("-inf"))


class ScoreWithPadding(nn.Module):
    """Writes +-inf on purpose (declared with allow_inf)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6)

    def forward(self, x: Tensor) -> Tensor:
        out = self.proj(x)
        out[:, -1] = float("inf")
        out[:, -2] = float("-inf")
        return out


def policy_step(model: nn.Module) -> None:
    obs = torch.randn(16, 8)
    mask = torch.rand(16, 6) > 0.3
    mask[:, 0] = True
    dist = torch.distributions.Categorical(logits=model(obs, mask))
    (-(dist.log_prob(dist.sample()) * torch.randn(16)).mean()).backward()


def padded_step(model: nn.Module) -> None:
    out = model(torch.randn(4, 8))
    out[:, :-2].pow(2).mean().backward()


class Imputing(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fill = nn.Parameter(torch.zeros(8))
        self.mlp = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(torch.where(torch.isnan(x), self.fill.expand_as(x), x))


def nan_batch_step(model: nn.Module) -> None:
    x = torch.randn(16, 8)
    x[torch.rand(16, 8) < 0.1] = float("nan")
    model(x).pow(2).mean().backward()


@pytest.mark.parametrize(
    ("factory", "step", "options"),
    [
        pytest.param(ActionMaskPolicy, policy_step, {}, id="masked_fill-inf"),
        pytest.param(
            ScoreWithPadding, padded_step, {"allow_inf": [ScoreWithPadding]}, id="allow_inf"
        ),
        pytest.param(Imputing, nan_batch_step, {}, id="nan-in-batch-imputed"),
    ],
)
@pytest.mark.usefixtures("accelerator_reads")
def test_intentional_non_finite_values_keep_the_one_read_per_step(
    factory: Any, step: Any, options: dict[str, Any]
) -> None:
    """A model that holds Inf or NaN on purpose every step must not pay for the failure
    path (replays, exact checks) every step."""
    torch.manual_seed(0)
    model = factory()
    with nanguard.watch(model, on_nonfinite="raise", **options) as guard:
        for _ in range(2):  # the first step may look (a replay names masked_fill(-inf))
            step(model)
            guard.step()
        step(model)
        scalars, python = count_reads(guard.step)
    assert guard.events == []
    assert scalars == 0
    assert python == ["tolist"]


class StopForward(Exception):
    """baukit-style early exit: the features are grabbed, the rest of the forward skipped."""


class EarlyExit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()
        self.stop = False
        self.features: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor | None:
        h = self.body[0](x)
        if self.stop:
            self.features = h
            raise StopForward
        return self.body[2](self.body[1](h))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_forward_that_raises_on_purpose_every_step_costs_no_sync(mode: str) -> None:
    # An error about something else is looked into the first few times only; a forward
    # returning None inside the user's except block is no raising forward at all.
    torch.manual_seed(0)
    model = EarlyExit()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        model.stop = True
        try:
            model(torch.randn(8, 32))
        except StopForward:
            model.stop = False
            loss = model(torch.randn(8, 32)).pow(2).mean()
            loss.backward()

    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for _ in range(4):  # (the first few are looked into)
            step()
            opt.step()
            opt.zero_grad()
        reads, calls = count_reads(step)
        opt.step()
    assert (reads, calls) == (0, [])
    assert guard.events == []


def test_sync_module_tells_weights_made_non_finite_earlier_once_not_at_every_forward() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", sync="module") as guard:
        for step in range(4):
            x, y = torch.randn(16, 4), torch.randn(16, 1)
            if step == 1:
                x[3, 2] = float("nan")  # one corrupt record: "log" lets the update apply it
            loss = guard.check_loss(((model(x) - y) ** 2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert [(e.step, e.phase) for e in guard.events if e.is_origin] == [(1, "input")]
    later = [e for e in guard.events if e.details.get("reason") == "known_weights"]
    assert later
    assert all("nothing new" in e.message for e in later)
