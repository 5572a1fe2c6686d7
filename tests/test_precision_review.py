"""Precision and masks: float16 and bfloat16 models, masks that overflow."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_clip_grad_norm_overflowing_float16_is_reported(mode: str) -> None:
    """A pure float16 model: its gradients are finite, their total norm is not (a sum of
    squares past 65504), so clip_grad_norm_ scales every gradient by 0 and training stalls."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)).half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    with (  # noqa: PT012
        nanguard.watch(model, optimizer=opt, mode=mode),
        pytest.raises(nanguard.NonFiniteError, match="clip_grad_norm_ computed an Inf total"),
    ):
        x = torch.randn(512, 64).half() * 8
        loss = model(x).float().pow(2).sum()
        opt.zero_grad()
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters())
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert torch.isinf(total)
        opt.step()


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(64, 192)
        self.out = nn.Linear(64, 64)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 4, d // 4).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / 4.0 + mask
        return self.out((scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class _Encoder(nn.Module):
    """HF-style: an additive mask built as (1 - m) * -1e9, -inf once in float16."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.attn = _Attention()
        self.head = nn.Linear(64, 10)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        mask = (1.0 - keep[:, None, None, :].to(x.dtype)) * -1e9
        return self.head(self.attn(x, mask))


def test_a_float16_mask_of_minus_1e9_on_an_empty_sample_says_it_is_inf_already() -> None:
    torch.manual_seed(0)
    model = _Encoder().half()
    ids, keep = torch.randint(0, 100, (4, 16)), torch.ones(4, 16, dtype=torch.long)
    keep[1] = 0  # an empty sample
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(ids, keep).float().mean().backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.module == "attn"
    assert origin.hint is not None
    assert "in float16 a -1e9 mask, or finfo.min added twice, is -inf already" in origin.hint


class _T5Attention(nn.Module):
    """transformers' T5Attention in short: position_bias + mask, returned to the next block."""

    def __init__(self, has_bias: bool) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(64, 64, bias=False) for _ in range(4))
        self.rel = nn.Embedding(32, 4) if has_bias else None

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor, position_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = (f(x).view(b, t, 4, d // 4).transpose(1, 2) for f in (self.q, self.k, self.v))
        if position_bias is None:
            assert self.rel is not None
            rp = (torch.arange(t)[None, :] - torch.arange(t)[:, None]).clamp(-15, 16) + 15
            position_bias = self.rel(rp).permute(2, 0, 1)[None] + mask
        w = (q @ k.transpose(-1, -2) + position_bias).float().softmax(-1).type_as(q)
        return self.o((w @ v).transpose(1, 2).reshape(b, t, d)), position_bias


class _T5Like(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 64)
        self.attn = nn.ModuleList([_T5Attention(i == 0) for i in range(2)])
        self.head = nn.Linear(64, 100)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        mask = (1.0 - keep[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        bias = None
        for attn in self.attn:
            y, bias = attn(x, mask, bias)
            x = x + y
        return self.head(x)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_t5_bias_plus_finfo_min_mask_in_float16_is_no_false_alarm(mode: str) -> None:
    """A relative-position bias below -16 plus finfo.min rounds to -inf in float16, at the
    masked keys only: the softmax gives them 0, training is healthy."""
    torch.manual_seed(0)
    model = _T5Like().half()
    first = model.attn[0]
    assert isinstance(first, _T5Attention)
    assert first.rel is not None
    with torch.no_grad():
        first.rel.weight.normal_(0, 20)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:  # "raise"
        for _ in range(3):
            ids, keep = torch.randint(0, 100, (4, 12)), torch.ones(4, 12, dtype=torch.long)
            keep[:, 9:] = 0
            logits = model(ids, keep).float()
            loss = torch.nn.functional.cross_entropy(logits.view(-1, 100), ids.view(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.origin is None
    assert not [e for e in guard.events if e.kind == "overflow_risk"]  # (masks near finfo.min)


def test_a_finfo_min_mask_plus_a_positive_bias_is_no_overflow_warning() -> None:
    """Biases above +16 move T5's masked positions to -65472 or so, next to float16's
    lowest: a mask, not activations about to overflow."""
    torch.manual_seed(0)
    model = _T5Like().half()
    first = model.attn[0]
    assert isinstance(first, _T5Attention)
    assert first.rel is not None
    with torch.no_grad():
        first.rel.weight.fill_(20.0)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        keep = torch.ones(4, 12, dtype=torch.long)
        keep[:, 9:] = 0
        model(torch.randint(0, 100, (4, 12)), keep).float().mean().backward()
        guard.step()
    assert [e.kind for e in guard.events] == []


class _MaskBuilder(nn.Module):
    def forward(self, keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (1.0 - keep[:, None, :].to(dtype)) * -1e9  # -inf in float16


class _Scores(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.mask = _MaskBuilder()
        self.out = nn.Linear(16, 1)

    def forward(self, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        scores = x @ x.transpose(-1, -2) / 4 + self.mask(keep, x.dtype)
        return self.out(scores.softmax(-1) @ x)


def test_a_minus_1e9_mask_that_is_inf_in_float16_is_no_origin_when_absorbed() -> None:
    torch.manual_seed(0)
    model = _Scores().half()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids, keep = torch.randint(0, 100, (4, 16)), torch.ones(4, 16, dtype=torch.long)
    keep[:, 12:] = 0  # padding, every sample with visible tokens
    with nanguard.watch(model, optimizer=opt) as guard:  # "raise"
        loss = model(ids, keep).float().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert guard.origin is None


def test_a_fully_masked_row_under_a_minus_1e9_mask_names_the_constant() -> None:
    torch.manual_seed(0)
    model = _Scores().half()
    ids, keep = torch.randint(0, 100, (4, 16)), torch.ones(4, 16, dtype=torch.long)
    keep[2] = 0  # an empty sample: its softmax row is all -inf
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(ids, keep).float().mean().backward()
        guard.step()
    constants = [e for e in guard.events if e.hint and "the constant -1e+09" in e.hint]
    assert constants
    assert constants[0].module == "mask"


class OverScaledAttention(nn.Module):
    """Attention scaled by a temperature far too large for float16 (a learned logit scale
    that grew): q @ k.T is small, the constant pushes the product past 65504."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.qk = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)
        self.logit_scale = 3e5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).chunk(2, -1)
        att = (q @ k.transpose(-2, -1)) * (self.logit_scale / math.sqrt(q.size(-1)))
        return self.out(att.softmax(-1) @ x)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_float16_product_pushed_past_its_range_by_a_constant_names_the_constant(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), OverScaledAttention())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = guard.check_loss(model(torch.randn(4, 16, 64)).float().pow(2).mean())
        opt.zero_grad()
        loss.backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.op) == ("1", "aten.mul.Tensor")
    assert origin.hint is not None
    assert "times the constant 37500 (a scale or temperature), overflowed float16" in (origin.hint)
    assert "Lower or clamp that factor" in origin.hint


class CastMaskAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / x.shape[-1] ** 0.5
        scores = scores + attention_mask.to(scores.dtype)  # float32's min is -inf in bf16
        return self.o(scores.softmax(-1) @ v)


class CastMaskEncoder(nn.Module):
    """A BERT-style extended mask built in float32 with torch.finfo(torch.float32).min."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 16)
        self.attn = CastMaskAttention(16)
        self.cls = nn.Linear(16, 2)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        extended = (1.0 - mask[:, None, :].float()) * torch.finfo(torch.float32).min
        h = self.emb(ids)
        return self.cls((h + self.attn(h, extended)).mean(1))


def test_a_float32_min_mask_cast_to_bfloat16_is_told_as_a_cast_not_exploding_weights() -> None:
    torch.manual_seed(0)
    model = CastMaskEncoder()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(2):
            ids, mask = torch.randint(0, 30, (3, 6)), torch.ones(3, 6)
            mask[1, 4:] = 0
            if step == 1:
                mask[2] = 0  # a fully padded sample
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(ids, mask)
            loss = guard.check_loss(F.cross_entropy(out.float(), torch.randint(0, 2, (3,))))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (1, "forward", "attn")
    assert origin.op == "aten._to_copy.default"
    assert origin.hint is not None
    assert "torch.finfo(torch.float32).min" in origin.hint
    assert "to bfloat16, which cannot hold them" in origin.hint
    assert "every position is masked" in origin.hint
    assert "exploding" not in origin.hint
