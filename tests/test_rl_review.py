"""Reinforcement-learning training loops, from a review with real model code: policies that
return torch.distributions objects, argument checks that raise on NaN, rollouts."""

from __future__ import annotations

import math
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.distributions import Categorical, Normal

import nanguard


class GaussianActor(nn.Module):
    """A continuous-control policy returning its action distribution (as public PPO/A2C
    code does): an unclamped log-std head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 64), nn.Tanh())
        self.mu = nn.Linear(64, 1)
        self.log_std = nn.Linear(64, 1)

    def forward(self, obs: torch.Tensor) -> Normal:
        h = self.body(obs)
        return Normal(self.mu(h), torch.exp(self.log_std(h)))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_overflow_inside_a_returned_distribution_is_a_forward_origin(mode: str) -> None:
    torch.manual_seed(0)
    actor = GaussianActor()
    with torch.no_grad():
        actor.log_std.bias.fill_(95.0)  # where a large entropy bonus drove it: exp overflows
    opt = torch.optim.SGD(actor.parameters(), lr=1e-3)
    obs, act, adv = torch.randn(8, 3), torch.randn(8, 1), torch.randn(8)
    with nanguard.watch(actor, optimizer=opt, mode=mode) as guard:
        pi = actor(obs)
        loss = guard.check_loss(-(pi.log_prob(act).sum(-1) * adv).mean())
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "", "inf")
    assert origin.tensor == "output.scale"
    assert origin.op == "aten.exp.default"


def test_a_categorical_policy_output_is_probed_without_false_alarms() -> None:
    """Categorical normalises its logits; a healthy masked policy trains as without a guard."""

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 6)

        def forward(self, obs: torch.Tensor, mask: torch.Tensor) -> Categorical:
            return Categorical(logits=self.net(obs).masked_fill(~mask, float("-inf")))

    def train(guarded: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        policy = Policy()
        opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
        guard = nanguard.watch(policy, optimizer=opt) if guarded else None
        for _ in range(5):
            obs = torch.randn(16, 4)
            mask = torch.rand(16, 6) > 0.3
            mask[:, 0] = True  # every state has a legal action
            pi = policy(obs, mask)
            a = pi.sample()
            loss = -(pi.log_prob(a) * torch.randn(16)).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        if guard is not None:
            guard.detach()
            assert guard.events == []
        return [p.detach().clone() for p in policy.parameters()]

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        guarded = train(True)
    for a, b in zip(train(False), guarded, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_forward_refused_by_a_distributions_check_carries_the_input_origin(
    mode: str, grad: bool
) -> None:
    """The most common RL report: the environment returned a NaN observation and Normal's
    argument check raises ValueError inside forward()."""

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(3, 64), nn.Tanh())
            self.mu = nn.Linear(64, 1)
            self.log_std = nn.Parameter(torch.zeros(1))

        def forward(self, obs: torch.Tensor) -> Normal:
            return Normal(self.mu(self.body(obs)), self.log_std.exp(), validate_args=True)

    torch.manual_seed(0)
    policy = Policy()
    obs = torch.randn(8, 3)
    obs[2, 1] = float("nan")  # the simulator of env 2 blew up
    with (
        nanguard.watch(policy, mode=mode) as guard,
        torch.set_grad_enabled(grad),
        pytest.warns(nanguard.NonFiniteWarning, match="input batch already contains NaN"),
        pytest.raises(ValueError, match="Expected parameter loc") as raised,
    ):
        policy(obs)
    if sys.version_info >= (3, 11):  # (exception notes)
        assert any("It is in sample 2" in note for note in raised.value.__notes__)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("input", "", "nan")


class LogMaskPolicy(nn.Module):
    """Action masking written as ``logits + torch.log(action_mask)`` (a float 0/1 mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(10, 64), nn.ReLU(), nn.Linear(64, 6))

    def forward(self, obs: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
        return self.net(obs) + torch.log(action_mask)  # -inf for illegal actions, on purpose


def _train_log_mask(mode: str | None) -> list[torch.Tensor]:
    torch.manual_seed(0)
    policy = LogMaskPolicy()
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    guard = nanguard.watch(policy, optimizer=opt, mode=mode) if mode else None
    for _ in range(4):
        obs = torch.randn(32, 10)
        mask = (torch.rand(32, 6) > 0.4).float()
        mask[:, 0] = 1.0
        dist = Categorical(logits=policy(obs, mask))
        a = dist.sample()
        loss = -(dist.log_prob(a) * torch.randn(32)).mean() - 0.01 * dist.entropy().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    if guard is not None:
        guard.detach()
        assert guard.events == []
    return [p.detach().clone() for p in policy.parameters()]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_log_of_a_zero_one_action_mask_is_a_mask_not_an_origin(mode: str) -> None:
    expected = _train_log_mask(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _train_log_mask(mode)
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)


def test_the_log_of_probabilities_that_underflowed_is_still_an_origin() -> None:
    class LogSoftmaxByHand(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 6)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(torch.softmax(self.net(x) * 200.0, dim=-1))  # p == 0: -inf

    torch.manual_seed(0)
    model = LogSoftmaxByHand()
    with nanguard.watch(model) as guard:
        model(torch.randn(8, 4)).sum().backward()
        with pytest.raises(nanguard.NonFiniteError):
            guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.op) == ("forward", "aten.log.default")


def test_sentinel_mode_warns_that_a_methods_only_model_is_unchecked_with_guard_step() -> None:
    """CleanRL's Agent is trained through get_action_and_value(); its forward() never runs."""

    class Agent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.actor = nn.Linear(4, 2)
            self.critic = nn.Linear(4, 1)

        def get_action_and_value(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return self.actor(x), self.critic(x)

    agent = Agent()
    opt = torch.optim.SGD(agent.parameters(), lr=0.1)
    with (
        nanguard.watch(agent, mode="sentinel") as guard,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        for _ in range(3):
            logits, v = agent.get_action_and_value(torch.randn(8, 4))
            loss = logits.logsumexp(-1).mean() + v.pow(2).mean()
            opt.zero_grad()
            loss.backward()
            guard.step()
            opt.step()
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(texts) == 1  # once
    assert "step 0 ends without a recorded call of the watched Agent" in texts[0]
    assert "Sentinel mode checks that call only" in texts[0]


def test_a_saturated_softmax_under_log_is_an_origin_even_when_it_is_all_zeros_and_ones() -> None:
    """REINFORCE with one observation: softmax saturates to exactly [0, 1], and log makes
    -inf. Probabilities require grad; an action mask does not."""

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.l1 = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.log(torch.softmax(self.l1(x), dim=1))

    policy = Policy()
    with torch.no_grad():
        policy.l1.weight.zero_()
        policy.l1.bias.copy_(torch.tensor([0.0, 200.0]))  # exp(-200) is 0 in float32
    with nanguard.watch(policy) as guard:
        logp = policy(torch.randn(1, 4))
        (-logp[0, 0]).backward()
        with pytest.raises(nanguard.NonFiniteError):
            guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.op) == ("forward", "aten.log.default")


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool])
def test_the_log_of_an_integer_or_bool_action_mask_is_a_mask(dtype: torch.dtype) -> None:
    """PettingZoo's observation["action_mask"] is int8."""

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(10, 6)

        def forward(self, obs: torch.Tensor, mask: torch.Tensor) -> Categorical:
            return Categorical(logits=self.net(obs) + torch.log(mask))

    torch.manual_seed(0)
    policy = Policy()
    opt = torch.optim.SGD(policy.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nanguard.watch(policy, optimizer=opt) as guard:
            for _ in range(3):
                mask = torch.rand(16, 6) > 0.4
                mask[:, 0] = True
                pi = policy(torch.randn(16, 10), mask.to(dtype))
                loss = -(pi.log_prob(pi.sample()) * torch.randn(16)).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert guard.events == []


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_unrelated_exception_in_a_model_that_imputes_its_nan_is_no_origin(mode: str) -> None:
    """A tabular model fills its missing values itself; a batch with an unseen category id
    makes nn.Embedding raise IndexError, which the loop catches."""

    class Tabular(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.fill = nn.Parameter(torch.zeros(8))
            self.head = nn.Linear(12, 1)

        def forward(self, x: torch.Tensor, cat: torch.Tensor) -> torch.Tensor:
            x = torch.where(torch.isnan(x), self.fill, x)
            return self.head(torch.cat([x, self.emb(cat)], dim=1))

    torch.manual_seed(0)
    model = Tabular()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    skipped: list[IndexError] = []
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for step in range(4):
            x = torch.randn(16, 8)
            x[x > 1.5] = float("nan")  # missing values, imputed by the model
            cat = torch.randint(0, 5, (16,))
            if step == 2:
                cat[3] = 7  # a category the embedding has not seen
            try:
                loss = model(x, cat).pow(2).mean()
            except IndexError as error:
                skipped.append(error)
                continue
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert len(skipped) == 1
    assert not getattr(skipped[0], "__notes__", None)  # nothing blamed on the batch's NaN
    assert guard.events == []


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_state_with_no_legal_action_refused_by_categorical_gets_a_note(mode: str) -> None:
    """Every logit of one state masked with -inf: Categorical's argument check raises in
    forward(); no module made a NaN, the model's own code after them did."""

    class Policy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> Categorical:
            logits = self.fc(obs).masked_fill(~legal, float("-inf"))
            return Categorical(logits=logits, validate_args=True)

    policy = Policy()
    legal = torch.ones(16, 4, dtype=torch.bool)
    legal[5] = False  # no legal action in state 5
    with (
        nanguard.watch(policy, mode=mode) as guard,
        pytest.raises(ValueError, match="Expected parameter") as raised,
    ):
        policy(torch.randn(16, 8), legal)
    assert guard.events == []
    if sys.version_info >= (3, 11):
        (note,) = raised.value.__notes__
        assert "made in Policy.forward" in note or "made inside Policy.forward" in note
        assert "no legal action" in note


class MaskedPolicy(nn.Module):
    """PPO's invalid-action masking: the policy returns its logits with the illegal actions
    at -inf; the training loop builds the distribution."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 64), nn.Tanh())
        self.pi, self.v = nn.Linear(64, 6), nn.Linear(64, 1)

    def forward(self, obs: torch.Tensor, legal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.body(obs)
        return self.pi(h).masked_fill(~legal, float("-inf")), self.v(h).squeeze(-1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_state_with_no_legal_action_in_the_loss_gets_the_whole_row_hint(mode: str) -> None:
    torch.manual_seed(0)
    policy = MaskedPolicy()
    opt = torch.optim.Adam(policy.parameters(), lr=3e-4)
    obs, actions = torch.randn(256, 8), torch.randint(0, 3, (256,))
    legal = torch.rand(256, 6) > 0.3
    legal[:, 0] = True  # (the actions taken are legal)
    legal[17] = False  # a terminal observation: no legal action at all
    with nanguard.watch(policy, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        logits, value = policy(obs, legal)
        dist = Categorical(logits=logits, validate_args=False)
        loss = guard.check_loss(-(dist.log_prob(actions * 0)).mean() + value.pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "A row masked whole (a state with no legal action" in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_distribution_refusing_a_finite_scale_of_zero_gets_no_note(mode: str) -> None:
    """Normal(mu, relu(s)): an exact 0 scale breaks GreaterThan(0), a finite value nanguard
    has nothing to say about (no NaN, no -inf row)."""

    class GaussianPolicy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mu, self.sigma = nn.Linear(4, 1), nn.Linear(4, 1)

        def forward(self, obs: torch.Tensor) -> Normal:
            scale = nn.functional.relu(self.sigma(obs))
            return Normal(self.mu(obs), scale, validate_args=True)

    torch.manual_seed(0)
    policy = GaussianPolicy()
    with (
        nanguard.watch(policy, mode=mode) as guard,
        pytest.raises(ValueError, match="GreaterThan") as raised,
    ):
        policy(torch.randn(64, 4))
    assert "nan" not in str(raised.value)
    assert not getattr(raised.value, "__notes__", None)
    assert guard.events == []


class NormalHead(nn.Module):
    """A forecaster's probabilistic head: a Normal whose arguments are checked."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU())
        self.proj = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> Normal:
        p = self.proj(self.body(x))
        return Normal(p[:, 0], nn.functional.softplus(p[:, 1]) + 1e-3, validate_args=True)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_argument_check_on_weights_made_nan_earlier_says_so_in_its_note(mode: str) -> None:
    # Under "log", a NaN target's gradients reached the weights in step 0; step 1's
    # distribution refuses its NaN parameters. The note is about the weights, not about the
    # model's own code after finite modules.
    if sys.version_info < (3, 11):
        pytest.skip("exception notes are Python 3.11+")
    torch.manual_seed(0)
    model = NormalHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 8), torch.randn(16)
    y_bad = y.clone()
    y_bad[3] = float("nan")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log"):
            loss = ((model(x).mean - y_bad) ** 2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            with pytest.raises(ValueError, match="Expected parameter loc") as raised:
                model(x)
    notes = getattr(raised.value, "__notes__", [])
    assert len(notes) == 1
    assert "the watched NormalHead's weights are non-finite" in notes[0]
    assert "They went bad after step 0, whose origin was: nanguard: step 0: " in notes[0]
    assert "was finite" not in notes[0].split("whose origin was")[0]


class MaskedEntropyPolicy(nn.Module):
    """Illegal actions masked with logits + log(mask), and an entropy bonus that hides the
    masked entries' p * logp = 0 * -inf behind torch.where: its backward is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 5)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.l(x) + torch.log(mask)  # -inf on purpose
        logp = torch.log_softmax(logits, -1)
        p = logp.exp()
        entropy = -torch.where(mask > 0, p * logp, torch.zeros_like(p)).sum(-1)
        return logp, entropy


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_backward_of_a_product_with_a_masks_log_keeps_the_mask_in_its_hint(mode: str) -> None:
    torch.manual_seed(0)
    model = MaskedEntropyPolicy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    mask = torch.ones(6, 5)
    mask[:, 3] = 0  # action 3 is illegal
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        logp, entropy = model(torch.randn(6, 4), mask)
        loss = -logp[:, 0].mean() - 0.01 * entropy.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.op) == ("backward", "aten.mul.Tensor in MulBackward0")
    assert origin.hint is not None
    assert "the -Inf of a mask's log at " in origin.hint
    assert "torch.log(mask)" in origin.hint
    assert "keep the mask" in origin.hint
    assert "log(0)" not in origin.hint


class ActorCritic(nn.Module):
    """SAC's policy as stable-baselines3 lays it out: one module, an actor and a critic,
    each with its own optimizer, their submodules called directly."""

    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(17, 64), nn.ReLU(), nn.Linear(64, 6))
        self.critic = nn.Sequential(nn.Linear(23, 64), nn.ReLU(), nn.Linear(64, 1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_weights_another_optimizer_made_nan_within_the_step_name_that_optimizer(
    mode: str,
) -> None:
    # The tanh correction without eps, log(1 - tanh(u)^2), is +inf once tanh saturates: the
    # critic's target, its loss (not checked) and critic_opt.step() go non-finite. The guard
    # watches the policy with optimizer=actor_opt: the critic's weights were finite when the
    # step began, not "NaN before the first step", and there was no earlier origin.
    torch.manual_seed(0)
    policy = ActorCritic()
    actor_opt = torch.optim.Adam(policy.actor.parameters(), 3e-4)
    critic_opt = torch.optim.Adam(policy.critic.parameters(), 3e-4)
    guard = nanguard.watch(policy, optimizer=actor_opt, mode=mode, on_nonfinite="raise")

    def train() -> None:
        for step in range(3):
            obs = torch.randn(512, 17) * (200.0 if step == 2 else 1.0)  # unnormalised
            act = torch.rand(512, 6) * 2 - 1
            with torch.no_grad():
                u = policy.actor(obs) + torch.randn(512, 6)
                logp = -0.5 * u.pow(2).sum(-1) - torch.log(1 - torch.tanh(u) ** 2).sum(-1)
                target = torch.randn(512) - 0.2 * logp
            q = policy.critic(torch.cat([obs, act], 1)).squeeze(-1)
            critic_opt.zero_grad()
            nn.functional.mse_loss(q, target).backward()
            critic_opt.step()
            actor_loss = -policy.critic(torch.cat([obs, torch.tanh(policy.actor(obs))], 1)).mean()
            guard.check_loss(actor_loss)
            actor_opt.zero_grad()
            actor_loss.backward()
            actor_opt.step()

    with (
        warnings.catch_warnings(action="ignore", category=RuntimeWarning),  # (submodules)
        guard,
        pytest.raises(nanguard.NonFiniteError) as raised,
    ):
        train()
    origin = raised.value.event
    assert (origin.step, origin.phase, origin.module) == (2, "param", "critic.0")
    assert origin.details["reason"] == "other_optimizer"
    assert "In this step Adam.step(), another optimizer than the guard's optimizer=" in (
        origin.message
    )
    assert "before the first step" not in origin.message
    assert origin.hint is not None
    assert "pass that loss to guard.check_loss()" in origin.hint
    assert guard.origin == origin


class OneModuleGAN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.G = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 8))
        self.D = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.D(self.G(z))


def test_weights_another_optimizer_moved_with_a_nan_learning_rate_name_that_rate() -> None:
    # The discriminator's warm-up is 0/0 at step 0 (set right by the scheduler just after
    # its step): its gradients were finite, its learning rate made the weights NaN.
    torch.manual_seed(0)
    model = OneModuleGAN()
    opt_g = torch.optim.Adam(model.G.parameters(), 2e-4)
    opt_d = torch.optim.Adam(model.D.parameters(), 2e-4)
    warm = torch.optim.lr_scheduler.LambdaLR(opt_d, lambda s: 1.0 if s else math.nan)
    bce = nn.functional.binary_cross_entropy_with_logits
    with nanguard.watch(model, optimizer=opt_g, on_nonfinite="log") as guard:
        for _ in range(2):
            real, z = torch.randn(32, 8), torch.randn(32, 4)
            fake = model.G(z).detach()
            d_loss = bce(model.D(real), torch.ones(32, 1)) + bce(model.D(fake), torch.zeros(32, 1))
            opt_d.zero_grad()
            d_loss.backward()
            opt_d.step()
            warm.step()
            g_loss = guard.check_loss(bce(model(z), torch.ones(32, 1)))
            opt_g.zero_grad()
            g_loss.backward()
            opt_g.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (0, "param", "D.0")
    assert "another optimizer than the guard's optimizer=, moved it with the learning rate nan" in (
        origin.message
    )
    assert origin.hint is not None
    assert "learning rate schedule" in origin.hint
    others = [e for e in guard.events if e.param in ("D.0.bias", "D.2.weight", "D.2.bias")]
    assert others
    assert all("with Adam's learning rate nan (propagated" in e.message for e in others)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_another_optimizers_nan_learning_rate_before_the_guards_step_is_named_at_once(
    mode: str,
) -> None:
    # Backbone and head optimizers stepped in turn, the backbone's first: its warm-up is 0/0
    # at step 0. The weights it wrote are found at the head optimizer's step, this step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    backbone = torch.optim.SGD(model[0].parameters(), lr=0.1)
    head = torch.optim.SGD(model[2].parameters(), lr=0.1)
    warm = torch.optim.lr_scheduler.LambdaLR(backbone, lambda s: 1.0 if s else math.nan)
    with nanguard.watch(model, optimizer=head, mode=mode, on_nonfinite="log") as guard:
        for _ in range(2):
            loss = guard.check_loss(model(torch.randn(32, 8)).pow(2).mean())
            backbone.zero_grad()
            head.zero_grad()
            loss.backward()
            for opt in (backbone, head):
                opt.step()
            warm.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (0, "param", "0")
    assert origin.details["reason"] == "other_optimizer"
    assert "moved it with the learning rate nan" in origin.message


class NormBonusCritic(nn.Module):
    """A critic adding a feature-norm bonus, sqrt(sum(h**2)): 0 for an all-zero input's
    features, where sqrt's slope is infinite (a NaN gradient from a finite forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.f = nn.Sequential(nn.Linear(6, 16, bias=False), nn.Tanh())
        self.q = nn.Linear(16, 1)

    def forward(self, o: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        h = self.f(torch.cat([o, a], -1))
        return self.q(h) + 0.1 * torch.sqrt((h**2).sum(-1, keepdim=True))


class Agent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.actor = nn.Sequential(nn.Linear(4, 2), nn.Tanh())
        self.critic = NormBonusCritic()


def test_weights_another_optimizer_moves_after_an_origin_are_not_new_origins() -> None:
    # The critic's optimizer steps first; its NaN weights of step 2 make every later
    # gradient NaN: the critic's other weights going NaN at step 3 are that origin's doing.
    torch.manual_seed(0)
    agent = Agent()
    actor_opt = torch.optim.Adam(agent.actor.parameters(), 1e-3)
    critic_opt = torch.optim.Adam(agent.critic.parameters(), 1e-3)
    with nanguard.watch(agent, optimizer=actor_opt, on_nonfinite="log") as guard:
        for step in range(4):
            o, a, r = torch.randn(8, 4), torch.rand(8, 2), torch.randn(8, 1)
            if step == 2:
                o[3], a[3] = 0.0, 0.0
            q_loss = guard.check_loss(((agent.critic(o, a) - r) ** 2).mean())
            critic_opt.zero_grad()
            q_loss.backward()
            critic_opt.step()
            pi_loss = -agent.critic(o, agent.actor(o)).mean()
            actor_opt.zero_grad()
            pi_loss.backward()
            actor_opt.step()
    origins = [(e.step, e.phase, e.param) for e in guard.events if e.is_origin]
    assert origins == [(2, "param", "critic.f.0.weight")]
    assert guard.origin is not None
    assert guard.origin.details["reason"] == "stepped_first"
