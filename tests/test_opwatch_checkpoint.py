"""A backward origin inside a non-reentrant checkpoint is named by the same operation and
source line as without checkpointing: the checkpoint's forward, re-run inside the backward,
makes -inf masks that are not the backward's doing."""

from __future__ import annotations

import contextlib
import inspect
import math

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import nanguard


def line_of(cls: type, code: str) -> str:
    """``file:line`` of the line of ``cls``'s source that contains ``code``."""
    lines, start = inspect.getsourcelines(cls)
    offset = next(i for i, line in enumerate(lines) if code in line)
    return f"{inspect.getsourcefile(cls)}:{start + offset}"


class TanhGELU(nn.Module):
    """GPT-2's GELU: in float16 ``pow(x, 3)`` overflows to Inf, which tanh hides in the
    forward; its backward then multiplies a zero gradient by ``3 * x**2 = inf``."""

    def forward(self, x: Tensor) -> Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


class CausalAttention(nn.Module):
    """Self-attention with a causal mask of -inf built in the forward (as HF models do),
    optionally biased by the distance between the tokens' keys (sqrt at 0 on the diagonal)."""

    def __init__(self, dim: int, heads: int, distance_bias: bool = False) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.distance_bias = distance_bias

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (
            z.view(b, t, self.heads, d // self.heads).transpose(1, 2)
            for z in self.qkv(x).chunk(3, dim=-1)
        )
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // self.heads)
        if self.distance_bias:
            diff = k.unsqueeze(-2) - k.unsqueeze(-3)
            scores = scores - torch.sqrt((diff * diff).sum(-1))
        with torch.no_grad():
            mask = torch.full((t, t), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        weights = torch.softmax(scores + mask, dim=-1)
        return self.proj((weights @ v).transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, distance_bias: bool) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = CausalAttention(dim, heads, distance_bias)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = TanhGELU()
        self.out = nn.Linear(4 * dim, dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.out(self.act(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(
        self, checkpointing: bool, distance_bias: bool = False, dim: int = 32, layers: int = 2
    ) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(100, dim)
        self.pos = nn.Parameter(torch.randn(16, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, 4, distance_bias) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 100)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids) + self.pos[: ids.shape[1]]
        for block in self.blocks:
            h = checkpoint(block, h, use_reentrant=False) if self.checkpointing else block(h)
        return self.head(self.ln(h))


def overflowing_gpt(checkpointing: bool) -> TinyGPT:
    """float16, with the second block's MLP input scaled up as a diverging run's is."""
    torch.manual_seed(0)
    model = TinyGPT(checkpointing).half()
    with torch.no_grad():
        model.blocks[1].fc.weight.mul_(300.0)
    return model


def distance_gpt(checkpointing: bool) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(checkpointing, distance_bias=True)


def origin_of(model: TinyGPT, mode: str) -> nanguard.Event:
    torch.manual_seed(1)
    ids = torch.randint(0, 100, (2, 16))
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, on_nonfinite="log", optimizer=opt, mode=mode) as guard:
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
        guard.check_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None, [str(e) for e in guard.events]
    return origin


MODES = ["full", "sentinel"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_fp16_gelu_backward_overflow(mode: str, checkpointing: bool) -> None:
    origin = origin_of(overflowing_gpt(checkpointing), mode)
    assert (origin.phase, origin.module) == ("backward", "blocks.1.act")
    assert origin.op == "aten.pow.Tensor_Scalar in PowBackward0"
    assert origin.source is not None
    assert origin.source.startswith(line_of(TanhGELU, "torch.pow(x, 3.0)") + " in forward:")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_sqrt_at_zero_backward(mode: str, checkpointing: bool) -> None:
    origin = origin_of(distance_gpt(checkpointing), mode)
    assert (origin.phase, origin.module) == ("backward", "blocks.1.attn")
    assert origin.op is not None
    assert origin.op.endswith("in SqrtBackward0")
    assert origin.source is not None
    assert origin.source.startswith(line_of(CausalAttention, "torch.sqrt(") + " in forward:")


class NoEpsRMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: Tensor) -> Tensor:
        return self.weight * x / x.pow(2).mean(-1, keepdim=True).sqrt()  # 0/0 on a zero row


class PreNormBlock(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = NoEpsRMSNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm(x))))


class PaddedEncoder(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(100, d)
        self.blocks = nn.ModuleList(PreNormBlock(d) for _ in range(2))
        self.head = nn.Linear(d, 5)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.emb(tokens) * (tokens != 0).unsqueeze(-1)  # padded positions zeroed
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(x.mean(1))


@pytest.mark.parametrize("policy", ["log", "warn", "skip_step"])
def test_sync_module_replays_inside_a_checkpointed_forward_without_breaking_its_backward(
    policy: str,
) -> None:
    # The replay that names the operation runs inside the checkpoint's region: what it saves
    # must not count as the region's, or torch refuses the recomputation in the backward.
    torch.manual_seed(0)
    model = PaddedEncoder()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(1, 100, (8, 16))
    tokens[3, 10:] = 0
    told = pytest.warns(nanguard.NonFiniteWarning) if policy == "warn" else contextlib.nullcontext()
    with told, nanguard.watch(model, optimizer=opt, on_nonfinite=policy, sync="module") as guard:
        loss = nn.functional.cross_entropy(model(tokens), torch.randint(0, 5, (8,)))
        opt.zero_grad()
        loss.backward()  # (torch's CheckpointError here before)
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == (
        "forward",
        "blocks.0.norm",
        "aten.div.Tensor",
    )
    assert origin.source is not None
    assert "0/0 on a zero row" in origin.source
