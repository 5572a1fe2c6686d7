"""NaN/Inf causes from public bug reports (fourth round): each model as the report built
it, the cause as it happened."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nanguard


class _GumbelNoise(nn.Module):
    """Gumbel-style noise from a generator of the model's own (a seeded noise stream); a
    draw below 0.05 gives -inf, which the softmax after it absorbs."""

    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.generator = generator

    def forward(self, logits: Tensor) -> Tensor:
        u = torch.rand(logits.shape, generator=self.generator)
        return torch.log((u - 0.05).clamp_min(0.0))


class _Sampler(nn.Module):
    def __init__(self, generator: torch.Generator) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 10)
        self.noise = _GumbelNoise(generator)
        self.dec = nn.Linear(10, 16)

    def forward(self, x: Tensor) -> Tensor:
        q = self.enc(x)
        return self.dec(F.softmax(q + self.noise(q), dim=-1))


def _seed_hit_then_miss() -> int:
    """A seed whose first draw of 2 x 10 has a value below 0.05, and whose second not."""
    g = torch.Generator()
    for seed in range(1000):
        g.manual_seed(seed)
        first, second = torch.rand(2, 10, generator=g), torch.rand(2, 10, generator=g)
        if (first < 0.05).any() and not (second < 0.05).any():
            return seed
    raise AssertionError("no such seed")


def _train(guarded: bool, mode: str) -> tuple[dict[str, Tensor], Tensor, nanguard.Guard | None]:
    generator = torch.Generator()
    generator.manual_seed(_seed_hit_then_miss())
    torch.manual_seed(0)
    model = _Sampler(generator)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    guard = nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") if guarded else None
    x = torch.randn(2, 16)
    try:
        loss = (model(x) - x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    finally:
        if guard is not None:
            guard.detach()
    return model.state_dict(), generator.get_state(), guard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_replay_leaves_the_users_own_generator_as_the_step_left_it(mode: str) -> None:
    """A replay draws from the model's torch.Generator again: put back, so training goes on
    with the same numbers as unguarded; the origin says why the replay did not see the Inf."""
    plain_weights, plain_state, _ = _train(False, mode)
    weights, state, guard = _train(True, mode)
    assert torch.equal(state, plain_state)
    assert all(torch.equal(weights[k], plain_weights[k]) for k in plain_weights)
    assert guard is not None
    if mode == "full":  # (sentinel mode: the -inf never left the model, nothing to replay)
        origin = guard.origin
        assert origin is not None
        assert (origin.module, origin.kind, origin.reproducible) == ("noise", "inf", None)
        assert "torch.Generator of its own" in origin.message
        assert "hardware fault" not in origin.message


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(64)
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True)

    def forward(self, x: Tensor, padding: Tensor) -> Tensor:
        h = self.norm(x)
        return x + self.attn(h, h, h, key_padding_mask=padding, need_weights=False)[0]


def test_the_fused_attention_kernel_on_an_all_padding_sample_gets_the_masked_row_hint() -> None:
    """pytorch/pytorch#40932: nn.MultiheadAttention in eval() under no_grad takes the fused
    kernel; a sample that is all padding comes out NaN. The hint is the softmax's fully
    masked row, as on the training path."""
    torch.manual_seed(0)
    model = _Block().eval()
    x = torch.randn(8, 16, 64)
    padding = torch.zeros(8, 16, dtype=torch.bool)
    padding[3] = True  # an empty sequence
    with torch.no_grad(), nanguard.watch(model, on_nonfinite="log") as guard:
        model(x, padding)
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.module == "attn"
    assert origin.op is not None
    assert "multi_head_attention" in origin.op
    assert origin.hint is not None
    assert "every position is masked" in origin.hint


def test_distillation_against_a_teachers_masked_vocabulary_names_the_kl_term() -> None:
    """KL(teacher || student) with log_target=True, the teacher's padded vocabulary masked
    to -inf: exp(t) * (t - s) is 0 * -inf there."""
    torch.manual_seed(0)
    student = nn.Sequential(nn.Embedding(96, 32), nn.Linear(32, 96))
    opt = torch.optim.AdamW(student.parameters(), lr=1e-3)
    tokens = torch.randint(0, 80, (4, 16))
    teacher = torch.randn(4, 16, 96).masked_fill(torch.arange(96) >= 80, float("-inf"))
    with nanguard.watch(student, optimizer=opt, on_nonfinite="log") as guard:
        s = F.log_softmax(student(tokens) / 2.0, dim=-1)
        t = F.log_softmax(teacher / 2.0, dim=-1)
        loss = guard.check_loss(F.kl_div(s, t, log_target=True, reduction="batchmean") * 4.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "0 * -inf: a KL divergence" in origin.hint


def test_bce_with_an_infinite_pos_weight_names_it() -> None:
    """pos_weight = (N - n_pos) / n_pos for a label that never occurs: Inf."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 6))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    labels = (torch.rand(500, 6) < 0.2).float()
    labels[:, 4] = 0.0
    positives = labels.sum(0)
    pos_weight = (len(labels) - positives) / positives
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        out = model(torch.randn(16, 32))
        loss = F.binary_cross_entropy_with_logits(out, labels[:16], pos_weight=pos_weight)
        guard.check_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "infinite pos_weight" in origin.hint


class _InstanceStats(nn.Module):
    """AdaIN's statistics over the spatial positions: one position is a variance of one."""

    def forward(self, x: Tensor) -> Tensor:
        flat = x.flatten(2)
        return (x - flat.mean(-1)[..., None, None]) / flat.std(-1)[..., None, None]


def test_a_replay_does_not_repeat_the_warnings_of_the_users_code() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), _InstanceStats(), nn.Flatten(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with (
        nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard,
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("always", UserWarning)
        loss = model(torch.randn(4, 3, 3, 3)).sum()  # a 1 x 1 feature map
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert guard.origin is not None
    assert guard.origin.module == "1"
    assert len([w for w in seen if "degrees of freedom" in str(w.message)]) == 1
