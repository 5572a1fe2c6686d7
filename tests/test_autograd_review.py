"""Backward origins under autograd features that change where a gradient is computed:
saved-tensor hooks, reentrant checkpointing, gradient hooks registered in a forward, tied
and late-added parameters (a review of advanced autograd use)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import nanguard

MODES = ("full", "sentinel")


# ----------------------------------------------------- activations packed to float16
def _fp16_pack(t: torch.Tensor) -> tuple[str, torch.Tensor]:
    if t.dtype == torch.float32 and t.numel() > 64:
        return "h", t.detach().to(torch.float16)  # (an ActNN-style memory saving)
    return "f", t


def _fp16_unpack(packed: tuple[str, torch.Tensor]) -> torch.Tensor:
    kind, t = packed
    return t.float() if kind == "h" else t


class _Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(12, 128), nn.SiLU(), nn.Linear(128, 128), nn.SiLU())
        self.out = nn.Linear(128, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(x)).squeeze(-1)


@pytest.mark.parametrize("mode", MODES)
def test_activations_packed_to_float16_are_replayed_as_saved(mode: str) -> None:
    """The forward runs in float32 and stays finite; the pack hook stores the saved input of
    a layer in float16, where a raw feature of 1e5 is Inf: the backward makes NaN from it. The
    replay runs under the same hooks, so the backward is named (not "changed after autograd
    computed them"), and the hint names the pack hook."""
    torch.manual_seed(0)
    model = _Regressor()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x = torch.randn(64, 12)
    x[:, 3] *= 1e5  # a raw, un-scaled feature column
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        with torch.autograd.graph.saved_tensors_hooks(_fp16_pack, _fp16_unpack):
            loss = F.mse_loss(model(x), torch.zeros(64))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "backward"
    assert origin.module.startswith("enc.")
    assert origin.details["reason"] != "external"
    assert origin.hint is not None
    assert "saved_tensors_hooks (pack hook _fp16_pack)" in origin.hint
    assert "float16" in origin.hint


def test_saved_on_cpu_stays_silent_and_identical() -> None:
    def train(guarded: bool) -> nn.Module:
        torch.manual_seed(0)
        model = _Regressor()
        opt = torch.optim.Adam(model.parameters(), 1e-3)
        guard = nanguard.watch(model, optimizer=opt) if guarded else None
        for _ in range(4):
            with torch.autograd.graph.save_on_cpu():
                loss = F.mse_loss(model(torch.randn(32, 12)), torch.randn(32))
            opt.zero_grad()
            loss.backward()
            opt.step()
        if guard is not None:
            assert guard.events == []
            guard.detach()
        return model

    plain, guarded = train(False), train(True)
    for a, b in zip(plain.state_dict().values(), guarded.state_dict().values(), strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------- reentrant checkpointing
class _Attn(nn.Module):
    def __init__(self, d: int, heads: int, qk_norm: bool) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d)
        self.qk_norm = qk_norm

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if self.qk_norm:
            q = q * (~pad)[:, None, :, None]  # padded queries zeroed
            q = q / (torch.sqrt((q * q).sum(-1, keepdim=True)) + 1e-6)  # sqrt'(0): NaN
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class _Block(nn.Module):
    def __init__(self, d: int, qk_norm: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d)
        self.attn = _Attn(d, 4, qk_norm)
        self.norm2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), pad)
        return x + self.mlp(self.norm2(x))


class _CheckpointedLM(nn.Module):
    def __init__(self, vocab: int = 100, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.blocks = nn.ModuleList([_Block(d, False), _Block(d, True)])
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x, pad = self.emb(idx), idx == 0
        for block in self.blocks:
            x = checkpoint(block, x, pad, use_reentrant=True)
        return self.head(x)


def test_reentrant_checkpoint_names_the_parameters_nearest_the_nan() -> None:
    """No replay can look inside a reentrant checkpoint: the parameters with NaN gradients
    are all nanguard has. It names the one the backward reached first (the last block's
    attention), not the embedding, the furthest from where the NaN was made."""
    torch.manual_seed(0)
    model = _CheckpointedLM()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    idx = torch.randint(1, 100, (4, 17))
    idx[2, 5] = 0  # a padding token inside a sequence
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        loss = F.cross_entropy(model(idx[:, :-1]).flatten(0, 1), idx[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "grad"
    assert origin.param == "blocks.1.attn.qkv.weight"
    assert "this one ran last in the forward" in origin.message
    assert "use_reentrant=False" in origin.message
    # The others follow in the order the backward reached them: the embedding last.
    params = [e.param for e in guard.events if e.phase == "grad" and e.param is not None]
    assert params[0] == "blocks.1.attn.qkv.weight"
    assert "emb.weight" not in params[:2]


# ----------------------------------------------------- a gradient hook in the forward
class _DANN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 32), nn.ReLU())
        self.classifier = nn.Linear(32, 5)
        self.domain = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.encoder(x)
        reversed_h = h.view_as(h)
        reversed_h.register_hook(lambda g: -0.3 * g)  # gradient reversal
        h.register_hook(lambda g: g / g.norm(dim=1, keepdim=True))  # per-sample norm: 0/0
        return self.classifier(h), self.domain(reversed_h).squeeze(-1)


@pytest.mark.parametrize("mode", MODES)
def test_gradient_hook_registered_in_forward_is_the_models_own_code(mode: str) -> None:
    """Unlabelled samples (ignore_index) get no domain loss in this step: their gradient row
    is 0, and the hook's g / g.norm() is 0/0. The classifier's backward is innocent: the
    hook, the model's own forward's code, made the NaN."""
    torch.manual_seed(0)
    model = _DANN()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    y = torch.randint(0, 5, (16,))
    y[::2] = -100
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        logits, domain = model(torch.randn(16, 20))
        loss = F.cross_entropy(logits, y, ignore_index=-100)
        loss = loss + F.binary_cross_entropy_with_logits(domain[1::2], torch.ones(8))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "")
    assert origin.details["reason"] == "own_code_backward"
    assert origin.op == "aten.div.Tensor in ReluBackward0"
    assert origin.source is not None
    assert "g / g.norm(dim=1, keepdim=True)" in origin.source
    assert "in the own code of the model (_DANN.forward)" in origin.message


# ----------------------------------------------------- tied and late-added parameters
class _CosineHead(nn.Module):
    def __init__(self, d: int, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, d))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = self.weight
        wn = w / (torch.sqrt((w * w).sum(1, keepdim=True)) + 1e-6)  # sqrt'(0) at a zero row
        return 10.0 * F.linear(F.normalize(h, dim=-1), wn)


class _TiedLM(nn.Module):
    def __init__(self, vocab: int = 200, d: int = 48) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)  # row 0 is all zeros
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.lm_head = _CosineHead(d, vocab)
        self.lm_head.weight = self.emb.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.rnn(self.emb(idx))[0])


def test_tied_weight_gradient_is_named_with_its_statistics() -> None:
    torch.manual_seed(0)
    model = _TiedLM()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    idx = torch.randint(1, 200, (8, 25))
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), idx[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "lm_head")
    assert origin.tensor == "grad of emb.weight"
    assert "(`emb.weight`: 48 NaN of 9,600 values" in origin.message


def test_parameters_of_a_head_put_in_after_watch_are_named() -> None:
    """A head swapped in after watch() (fine-tuning with an ArcFace-style head): the NaN its
    backward makes in its own weight's gradient is named by that weight."""

    class AngularHead(nn.Module):
        def __init__(self, weight: torch.Tensor) -> None:
            super().__init__()
            self.weight = nn.Parameter(weight.clone())

        def forward(self, e: torch.Tensor) -> torch.Tensor:
            cos = F.linear(F.normalize(e), F.normalize(self.weight)).clamp(-1, 1)
            return 16.0 * torch.cos(torch.acos(cos) + 0.3)  # acos'(1) = -inf

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8), nn.Linear(8, 5))
    opt = torch.optim.SGD(model.parameters(), 0.01)
    x = torch.randn(5, 16)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        with torch.no_grad():
            prototypes = model[:3](x)  # weight imprinting: each class's own sample
        model[3] = AngularHead(prototypes)
        opt = torch.optim.SGD(model.parameters(), 0.01)
        loss = F.cross_entropy(model(x), torch.arange(5))
        opt.zero_grad()
        loss.backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "3")
    assert origin.tensor == "grad of 3.weight"
    assert "(`3.weight`: " in origin.message
    # Told once: the exit's sweep, which now knows the head, does not tell it again.
    assert [e.step for e in guard.events if e.is_origin] == [0]
