"""Decoder-only language-model training at realistic sizes, from a review with real model
code: gradient accumulation with large logits, checkpoints with bad rows."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class TinyLM(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.block = nn.Sequential(nn.Linear(d, d), nn.GELU())
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.emb(idx)))


def test_accumulation_lets_an_earlier_micro_batchs_logits_gradient_go_when_over_budget() -> None:
    """A real LM's logits gradient (batch x sequence x vocabulary) is the largest tensor of
    the step; kept for 8 micro-batches it grew peak memory 1.8x. Past the budget (a tenth of
    the model, at least 64 MiB; 0 here to stand for a large vocabulary), an earlier
    micro-batch's is let go when the next one starts."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    grads: list[weakref.ref[torch.Tensor]] = []
    alive_at_next_forward = []

    def count(*_: object) -> None:  # inside the next micro-batch's forward
        gc.collect()
        alive_at_next_forward.append(sum(ref() is not None for ref in grads))

    model.block.register_forward_pre_hook(count)
    with nanguard.watch(model, optimizer=opt) as guard:
        guard._recorder.kept_budget = 0
        for _ in range(4):
            idx = torch.randint(0, 512, (4, 16))
            logits = model(idx)
            logits.register_hook(lambda g: grads.append(weakref.ref(g)))
            F.cross_entropy(logits.flatten(0, 1), idx.flatten()).backward()
        opt.step()
    assert alive_at_next_forward == [0, 0, 0, 0]
    assert guard.events == []


def test_a_backward_origin_in_a_micro_batch_whose_gradient_was_let_go_says_so() -> None:
    class Distance(nn.Module):
        def forward(self, a: torch.Tensor) -> torch.Tensor:
            return (a[0::2] - a[1::2]).pow(2).sum(-1).sqrt()  # sqrt at 0: NaN gradient

    class Siamese(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Linear(4, 8)
            self.distance = Distance()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.distance(self.encoder(x))

    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        guard._recorder.kept_budget = 0
        for micro in range(4):
            x = torch.randn(4, 4)
            if micro == 0:
                x[1] = x[0]  # identical pair in the first micro-batch
            model(x).mean().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("grad", "encoder.weight")
    assert "were let go to bound memory" in origin.message


def test_a_nan_row_in_a_loaded_untied_embedding_is_reported_at_the_first_step() -> None:
    """The row's token first appears at step 2; the row was NaN before training started
    (no optimizer update made it, whatever its eps)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100))  # an untied head
    state = model.state_dict()
    state["0.weight"][7] = float("nan")  # a corrupted checkpoint row
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt) as guard:
        ids = torch.randint(8, 100, (4, 16))  # (token 7 is not in this batch)
        loss = F.cross_entropy(model(ids).view(-1, 100), ids.view(-1))
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.param) == (0, "param", "0.weight")
    assert "was already NaN before the first step" in origin.message
    assert origin.stats is not None
    assert origin.stats.nan_count == 32
    assert origin.hint is not None
    assert "eps" not in origin.hint


class LogFeatures(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)  # NaN below 0


def test_modules_that_hand_back_their_input_are_not_in_the_propagated_path() -> None:
    """nanoGPT's default dropout is 0.0: Dropout(p=0) and nn.Identity give back the very
    tensor they received; like the activations, they are not calls the NaN 'reached'."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 8), LogFeatures(), nn.Dropout(0.0), nn.Identity(), nn.GELU(), nn.Linear(8, 2)
    )
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(4, 8)).sum().backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.module_type) == ("1", "LogFeatures")
    reached = [e.module for e in guard.events if e.phase == "forward" and not e.is_origin]
    assert reached == ["5", ""]


def test_a_value_changed_in_place_before_an_identity_is_still_the_callers() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.skip = nn.Identity()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.fc(x)
            h.div_(0.0)  # the model's own code, in place, between two calls
            return self.skip(h)

    model = Scaled()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(2, 4))
    origin = guard.origin
    assert origin is not None
    assert origin.module == ""
    assert origin.details["reason"] == "own_code"


def test_a_nan_loss_in_one_micro_batch_says_which() -> None:
    """Gradient accumulation where the third micro-batch's labels are all ignored:
    cross_entropy's mean over zero tokens is 0/0."""
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for micro in range(4):
            idx = torch.randint(0, 512, (2, 16))
            labels = idx.clone()
            if micro == 2:
                labels[:] = -100  # a micro-batch of padding only
            logits = model(idx)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
            guard.check_loss(loss / 4).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details["loss"]) == ("loss", 3)
    assert "(The loss was number 3 of those checked in the step.)" in origin.message


def _average_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """TRL's per-sequence average log-probability of the response (IPO)."""
    labels, logits = labels[:, 1:].clone(), logits[:, :-1, :]
    loss_mask = labels != -100
    labels[labels == -100] = 0
    logps = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    return (logps * loss_mask).sum(-1) / loss_mask.sum(-1)  # 0/0 for an empty response


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_preference_loss_over_a_truncated_response_leads_with_the_empty_count(mode: str) -> None:
    # A chosen response truncated away by max_length: its mask is empty. Nothing is -inf:
    # the hint leads with the 0/0 count and its fix, not a teacher's masked vocabulary.
    torch.manual_seed(0)
    policy = nn.Sequential(nn.Embedding(256, 32), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 256))
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    ids = torch.randint(0, 256, (8, 48))
    labels = ids.clone()
    labels[:, :30] = -100
    labels[0] = -100  # the response was cut off
    with nanguard.watch(policy, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        avg = _average_logps(policy(ids), labels)
        loss = guard.check_loss(((avg[:4] - avg[4:] - 5.0) ** 2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    first = origin.hint.split(";")[0]
    assert "0/0 over an empty mask or count" in first
    assert "divide by count.clamp_min(1)" in first
    assert "add an eps" not in origin.hint


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_an_all_padding_batch_in_a_cross_entropy_outside_the_model_is_named(
    smoothing: float,
) -> None:
    # fairseq's and Hugging Face's label-smoothed cross-entropy on a batch whose targets are
    # all padding: 0/0, made by F.cross_entropy, where no eps can be added.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 100))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(1, 100, (4, 16))
    targets = torch.zeros(4, 16, dtype=torch.long)  # every one the pad index
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        logits = model(ids)
        loss = F.cross_entropy(
            logits.flatten(0, 1), targets.flatten(), ignore_index=0, label_smoothing=smoothing
        )
        guard.check_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "every target equals ignore_index" in origin.hint.split(";")[0]
