"""From an audit of the README against the code: an RL action mask written by a child and
log_softmax'd after it, allow_inf= for an Inf that flows on, check() in the middle of a
step before check_loss, and an internal option a user could pass."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanguard


class MaskedHead(nn.Module):
    """The policy's head: logits of illegal actions set to -inf (an RL action mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 5)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.linear(obs).masked_fill(~legal, float("-inf"))


class PolicyLogSoftmaxInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = MaskedHead()

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(self.head(obs, legal), dim=-1)


class PolicyLogSoftmaxChild(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head = MaskedHead()
        self.log_probs = nn.LogSoftmax(dim=-1)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return self.log_probs(self.head(obs, legal))


def _reinforce(policy: nn.Module, mode: str, steps: int = 6) -> nanguard.Guard:
    """REINFORCE on masked actions: the log-probabilities of illegal actions are -inf on
    purpose; the loss, the gradients and the weights stay finite."""
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    with nanguard.watch(policy, optimizer=opt, mode=mode) as guard:  # type: ignore[arg-type]
        for _ in range(steps):
            obs = torch.randn(8, 6)
            legal = torch.rand(8, 5) > 0.4
            legal[:, 0] = True
            log_probs = policy(obs, legal)
            actions = torch.distributions.Categorical(logits=log_probs).sample()
            returns = torch.randn(8)
            loss = -(log_probs.gather(1, actions[:, None]).squeeze(1) * returns).mean()
            guard.check_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return guard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("policy", [PolicyLogSoftmaxInForward, PolicyLogSoftmaxChild])
def test_an_action_mask_a_child_writes_and_log_softmax_passes_on_is_no_error(
    policy: type[nn.Module], mode: str
) -> None:
    torch.manual_seed(0)
    model = policy()
    guard = _reinforce(model, mode)  # (raises on any origin)
    assert guard.origin is None
    assert all(torch.isfinite(p).all() for p in model.parameters())


class LogOfProbabilities(nn.Module):
    """The same mask, then log(softmax(...)) in float32 of logits far apart: some legal
    actions' probabilities underflow to 0, and their log is -inf the mask did not write."""

    def __init__(self) -> None:
        super().__init__()
        self.head = MaskedHead()

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(self.head(obs, legal) * 200.0, dim=-1))


def test_more_neg_inf_than_the_mask_wrote_is_still_the_parents_origin() -> None:
    torch.manual_seed(0)
    model = LogOfProbabilities()
    with torch.no_grad():
        model.head.linear.weight.mul_(20.0)
    obs = torch.randn(8, 6)
    legal = torch.rand(8, 5) > 0.4
    legal[:, 0] = True
    with nanguard.watch(model, on_nonfinite="log") as guard:
        out = model(obs, legal)
        guard.step()
    assert int(torch.isinf(out).sum()) > int((~legal).sum())  # (underflows beside the mask)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "", "aten.log.default")


class AdditiveBias(nn.Module):
    """An additive -inf bias over the last position, not passed under a mask's name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = torch.zeros_like(x)
        bias[:, -1] = float("-inf")
        return x + bias


class Biased(nn.Module):
    def __init__(self, child_log_softmax: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 5)
        self.bias = AdditiveBias()
        self.log_probs = nn.LogSoftmax(-1) if child_log_softmax else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.bias(self.linear(x))
        return self.log_probs(z) if self.log_probs is not None else torch.log_softmax(z, -1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("child", [False, True], ids=["in_forward", "child"])
def test_allow_inf_covers_the_inf_that_flows_on_from_that_module(child: bool, mode: str) -> None:
    torch.manual_seed(0)
    model = Biased(child)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(
        model,
        optimizer=opt,
        allow_inf=(AdditiveBias,),
        mode=mode,  # type: ignore[arg-type]
    ) as guard:
        for _ in range(3):
            out = model(torch.randn(8, 4))
            loss = guard.check_loss(-out[:, :4].mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.origin is None


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("policy", ["log", "skip_step"])
def test_check_mid_step_then_check_loss_keeps_one_origin(policy: str, mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    x[1, 1] = float("nan")
    with nanguard.watch(
        model,
        optimizer=opt,
        on_nonfinite=policy,  # type: ignore[arg-type]
        mode=mode,  # type: ignore[arg-type]
    ) as guard:
        out = model(x)
        told = guard.check()
        loss = guard.check_loss(((out - torch.randn(8, 1)) ** 2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert [(e.phase, e.module) for e in told if e.is_origin] == [("input", "")]
    # (the loss carries the batch's NaN: no second origin saying the loss made it)
    assert [(e.phase, e.module) for e in guard.events if e.is_origin] == [("input", "")]
    loss_events = [e for e in guard.events if e.phase == "loss"]
    assert loss_events
    assert not any(e.is_origin for e in loss_events)


def test_perturbs_is_learnt_from_the_optimizer_not_an_option() -> None:
    with pytest.raises(TypeError, match="unknown option 'perturbs'") as raised:
        nanguard.watch(nn.Linear(2, 2), perturbs=True)
    assert "perturbs" not in str(raised.value).split("valid options are:")[1]


class PolicyWithPrior(nn.Module):
    """Passes its head's action mask on, and adds log(relu(prior)): a learned action prior
    that an update can bring to 0 at a legal action (-inf the mask did not write)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = MaskedHead()
        self.prior = nn.Parameter(torch.ones(5))

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> torch.Tensor:
        logits = self.head(obs, legal) + torch.log(torch.relu(self.prior))
        return torch.log_softmax(logits, -1)


def test_a_module_passing_a_mask_on_is_still_the_origin_of_its_own_neg_inf_later() -> None:
    torch.manual_seed(0)
    model = PolicyWithPrior()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    legal = torch.ones(8, 5, dtype=torch.bool)
    legal[:, 4] = False
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(5):
            if step == 3:
                with torch.no_grad():
                    model.prior[0] = -0.5  # (relu: 0, log: -inf at legal action 0)
            log_probs = model(torch.randn(8, 6), legal)
            loss = guard.check_loss(-log_probs[:, 0].mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert origins
    first = origins[0]
    assert (first.step, first.phase, first.module, first.op) == (
        3,
        "forward",
        "",
        "aten.log.default",
    )
