"""From a review modelled on public bug reports of the Hugging Face ecosystem and model
zoos (openai/CLIP's unclamped logit_scale, left padding under a causal mask)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class Tower(nn.Module):
    def __init__(self, d_in: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.Linear(d_in, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.proj(x), dim=-1)


class CLIP(nn.Module):
    """openai/CLIP's model: a learned temperature in log space, exp'd in the forward
    (the paper clamps it at ln 100; a fine-tune that forgets lets it grow)."""

    def __init__(self) -> None:
        super().__init__()
        self.image = Tower(32)
        self.text = Tower(24)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        i, t = self.image(images), self.text(texts)
        logit_scale = self.logit_scale.exp()
        return logit_scale * i @ t.t()


class Trainer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.clip = CLIP()

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        return self.clip(images, texts)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_exp_of_a_grown_logit_scale_names_the_parameter_and_the_clamp(mode: str) -> None:
    torch.manual_seed(0)
    model = Trainer()
    state = model.state_dict()
    state["clip.logit_scale"] = torch.tensor(89.0)  # a checkpoint of a run without the clamp
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    images, texts = torch.randn(8, 32), torch.randn(8, 24)
    labels = torch.arange(8)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:  # type: ignore[arg-type]
        logits = model(images, texts)
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.op) == (
        0,
        "forward",
        "clip",
        "aten.exp.default",
    )
    assert origin.hint is not None
    assert "of the parameter `clip.logit_scale` (its value is in [89, 89])" in origin.hint
    assert "clamps logit_scale to ln 100" in origin.hint
    assert "log space" not in origin.hint  # (no logsumexp advice for a temperature)


def test_exp_of_activations_keeps_the_log_space_advice() -> None:
    class Scores(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            z = self.proj(x)
            return z.exp() / z.exp().sum(-1, keepdim=True)  # a softmax without the max

    torch.manual_seed(0)
    model = Scores()
    with torch.no_grad():
        model.proj.bias.fill_(120.0)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(4, 8)).sum().backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.op == "aten.exp.default"
    assert origin.hint is not None
    assert "log space" in origin.hint
    assert "parameter" not in origin.hint


class CausalSelfAttention(nn.Module):
    """A decoder's hand-written attention: a causal mask plus the padding mask, both
    -inf, over left-padded batches (the prompt of a sample that is all padding)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        n = x.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return self.out(scores.softmax(-1) @ v)


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.attn = CausalSelfAttention()
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.embed(ids), pad))


def test_left_padding_under_a_causal_mask_is_named_in_the_hint() -> None:
    torch.manual_seed(0)
    model = Decoder()
    ids = torch.randint(0, 50, (3, 6))
    pad = torch.zeros(3, 6, dtype=torch.bool)
    pad[1, :2] = True  # left padding: the first query of sample 1 sees nothing
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt) as guard:
        logits = model(ids, pad)
        F.cross_entropy(logits.flatten(0, 1), ids.flatten()).backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "attn", "nan")
    assert origin.hint is not None
    assert "left padding + a causal mask" in origin.hint
