"""From a review that reproduced public bug reports of training gone NaN/Inf."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class PointerHead(nn.Module):
    """allennlp's ``masked_log_softmax`` (allenai/allennlp#890): the mask enters through
    ``mask.log()``, -inf where a position is padding. An empty passage masks a whole row,
    and log_softmax of an all -inf row is NaN."""

    def __init__(self, softmax: str) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 1)
        self.softmax = softmax

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x).squeeze(-1) + mask.log()
        if self.softmax == "log_softmax":
            return torch.log_softmax(logits, -1)
        return torch.softmax(logits, -1).clamp_min(1e-9).log()  # attention pooling


def _train(model: PointerHead, mode: str, masked_row: int | None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode):
        for step in range(4):
            x = torch.randn(8, 30, 16)
            mask = torch.ones(8, 30)
            mask[:, 20:] = 0  # padding: -inf on purpose, every step
            if step == 3 and masked_row is not None:
                mask[masked_row] = 0  # an empty passage
            out = model(x, mask)
            loss = F.nll_loss(out, torch.randint(0, 20, (8,)))
            opt.zero_grad()
            loss.backward()
            opt.step()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("softmax", ["log_softmax", "softmax"])
def test_a_row_masked_through_the_log_of_its_mask_names_the_softmax(
    mode: str, softmax: str
) -> None:
    torch.manual_seed(0)
    model = PointerHead(softmax)
    _train(model, mode, masked_row=None)  # the padding's -inf alone: quiet
    torch.manual_seed(0)
    with pytest.raises(nanguard.NonFiniteError) as raised:
        _train(PointerHead(softmax), mode, masked_row=5)
    event = raised.value.event
    assert (event.step, event.phase, event.module) == (3, "forward", "")
    # Not the log: it wrote the mask's -inf, as every step did.
    assert event.op == (
        "aten._log_softmax.default" if softmax == "log_softmax" else "aten._softmax.default"
    )
    assert "every position is masked" in event.hint


@pytest.mark.filterwarnings("ignore:std\\(\\). degrees of freedom:UserWarning")
def test_ppo_advantages_normalised_over_one_sample_get_the_std_in_the_loss_hint() -> None:
    # stable-baselines3#325: 65 samples in minibatches of 64, the last minibatch has one;
    # adv.std() over it is NaN, and no autograd node of the loss shows it.
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = torch.optim.Adam(policy.parameters(), lr=3e-4)
    obs = torch.randn(65, 8)
    with torch.no_grad():
        dist = torch.distributions.Categorical(logits=policy(obs))
        actions = dist.sample()
        old_logp = dist.log_prob(actions)
    advantages = torch.randn(65)

    def update(guard: nanguard.Guard, idx: torch.Tensor) -> None:
        logp = torch.distributions.Categorical(logits=policy(obs[idx])).log_prob(actions[idx])
        adv = advantages[idx]
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
        ratio = torch.exp(logp - old_logp[idx])
        loss = guard.check_loss(-torch.min(adv * ratio, adv * ratio.clamp(0.8, 1.2)).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()

    with nanguard.watch(policy, optimizer=opt) as guard:
        update(guard, torch.arange(0, 64))
        with pytest.raises(nanguard.NonFiniteError) as raised:
            update(guard, torch.arange(64, 65))
    event = raised.value.event
    assert (event.step, event.phase, event.kind) == (1, "loss", "nan")
    assert event.hint is not None
    assert "other inputs without gradient (a std over one sample)" in event.hint


class TiedEmbeddingLM(nn.Module):
    """nn.Embedding(max_norm=...) renormalises the rows it looks up in place, in every
    forward (pytorch/pytorch#26596); its weight is tied to the output layer."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 64, max_norm=1.0)
        self.rnn = nn.GRU(64, 64, batch_first=True)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(tokens))
        return torch.sqrt(h @ self.emb.weight.t() + 0.5)  # NaN where a logit < -0.5


def _tied_lm() -> tuple[TiedEmbeddingLM, torch.Tensor]:
    torch.manual_seed(0)
    model = TiedEmbeddingLM()
    with torch.no_grad():
        model.emb.weight.mul_(3)  # rows above max_norm, as after some training
    return model, torch.randint(0, 1000, (16, 20))


def _lm_loss(model: TiedEmbeddingLM, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, 1000), tokens.roll(-1, 1).reshape(-1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_replay_does_not_renormalise_an_embedding_the_backward_still_needs(mode: str) -> None:
    model, tokens = _tied_lm()
    with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard:
        loss = _lm_loss(model, tokens)
        guard.check()  # (replays the forward, before the step's backward)
        loss.backward()  # the tied weight the graph saved is as it was
    assert guard.origin is not None
    assert (guard.origin.phase, guard.origin.op) == ("forward", "aten.sqrt.default")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_replay_leaves_a_renormalised_embedding_as_the_forward_left_it(mode: str) -> None:
    model, tokens = _tied_lm()
    with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard:
        _lm_loss(model, tokens).backward()
        before = model.emb.weight.detach().clone()
        version = model.emb.weight._version
        guard.step()
    assert guard.origin is not None
    assert torch.equal(model.emb.weight.detach(), before)
    assert model.emb.weight._version == version
    assert model.emb.max_norm == 1.0


class CausalLMWithLoss(nn.Module):
    """transformers' loss as Trainer runs it: the summed token loss divided by
    num_items_in_batch, the count (an integer tensor) of labels that are not -100."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.head = nn.Linear(32, 100)

    def forward(
        self, ids: torch.Tensor, labels: torch.Tensor, num_items_in_batch: torch.Tensor
    ) -> torch.Tensor:
        logits = self.head(self.embed(ids))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        return loss / num_items_in_batch


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_batch_with_every_label_ignored_divided_by_its_count_gets_the_count_hint(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = CausalLMWithLoss()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 100, (3, 12))
    labels = torch.full_like(ids, -100)  # prompts masked out of the loss, all of them
    count = (labels != -100).sum()
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = guard.check_loss(model(ids, labels, count))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.op) == ("forward", "aten.div.Tensor")
    assert origin.hint is not None
    assert "a mean over nothing (every label ignored" in origin.hint
    assert "Add an eps" not in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_poisson_loss_on_negative_rates_names_the_log_of_a_negative(mode: str) -> None:
    # pytorch/pytorch#184030: PoissonNLLLoss(log_input=False) on a raw Linear output.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 5), torch.poisson(torch.full((64, 1), 3.0))
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = guard.check_loss(nn.PoissonNLLLoss(log_input=False)(model(x), y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "nan")
    assert origin.hint is not None
    assert "log: NaN below 0" in origin.hint


def test_a_beta_log_prob_of_an_action_on_its_edge_gets_the_support_hint() -> None:
    # pytorch/pytorch#92260: a logged action of exactly 1.0 under a Beta policy.
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(4, 32), nn.Tanh(), nn.Linear(32, 2))
    opt = torch.optim.Adam(body.parameters(), lr=3e-4)
    obs, act, adv = torch.randn(16, 4), torch.rand(16), torch.rand(16)
    act[3] = 1.0
    with nanguard.watch(body, optimizer=opt, on_nonfinite="log") as guard:
        a, b = (F.softplus(body(obs)) + 1.0).unbind(-1)
        log_prob = torch.distributions.Beta(a, b).log_prob(act)
        loss = guard.check_loss(-(log_prob * adv).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "inf")
    assert origin.hint is not None
    assert "a log-density at the edge of its support" in origin.hint
    assert "a std over one sample" not in origin.hint
