"""From a review of the fixes made after a review of generative, sequence, loss and
parametrized models: cases where a new rule misfired."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class LseAttention(nn.Module):
    """Attention normalised by hand, ``s - logsumexp(s)``, over scores plus an extended
    mask (0 / -inf) it is given positionally as ``ext``."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, ext: torch.Tensor) -> torch.Tensor:
        s = self.q(h) @ self.k(h).transpose(-1, -2) / math.sqrt(h.shape[-1]) + ext
        p = (s - torch.logsumexp(s, -1, keepdim=True)).exp()
        return self.o(p @ self.v(h))


class ExtMaskModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.attn = LseAttention()
        self.head = nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor, ext: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(ids), ext))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_mask_a_hand_written_log_softmax_mishandles_is_no_bad_batch(mode: str) -> None:
    # A fully padded sample: -inf - -inf in the attention's own log-softmax. The -Inf came in
    # with the batch, but that operation is the model's handling of a mask, not data.
    torch.manual_seed(0)
    model = ExtMaskModel()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        for step in range(4):
            ids = torch.randint(0, 50, (4, 6))
            lengths = torch.tensor([6, 4, 5, 0 if step == 2 else 3])
            keep = torch.arange(6)[None] < lengths[:, None]
            ext = torch.zeros(4, 6).masked_fill(~keep, float("-inf"))[:, None, :]
            loss = guard.check_loss(F.cross_entropy(model(ids, ext).flatten(0, 1), ids.flatten()))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (2, "forward", "attn")
    assert origin.op == "aten.sub.Tensor"


class FrozenBackbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU())
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(x))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_nan_running_stats_a_frozen_norm_reads_are_named_though_there_are_two(mode: str) -> None:
    # A checkpoint with NaN running mean and variance, the backbone frozen in eval(): both
    # are read. Made finite one at a time, the other keeps the output NaN: they are judged
    # together (and a NaN made 1, not a 0 to divide by).
    torch.manual_seed(0)
    model = FrozenBackbone()
    with torch.no_grad():
        model.backbone[1].running_mean.fill_(float("nan"))  # type: ignore[union-attr,operator]
        model.backbone[1].running_var.fill_(float("nan"))  # type: ignore[union-attr,operator]
    model.backbone.eval()
    opt = torch.optim.SGD(model.head.parameters(), lr=1e-2)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        loss = guard.check_loss(
            F.cross_entropy(model(torch.randn(8, 8)), torch.randint(0, 2, (8,)))
        )
        opt.zero_grad()
        loss.backward()
        opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origins = [e for e in guard.events if e.is_origin]
    assert {e.param for e in origins} <= {"backbone.1.running_mean", "backbone.1.running_var"}
    assert origins
    assert all(e.phase == "param" for e in origins)


def test_the_fused_kernel_warning_is_only_for_layers_that_take_it() -> None:
    # batch_first=False, or a SiLU: torch never runs those on the fused kernel; an excluded
    # layer whose only hook is the user's own: not nanguard's doing.
    def evaluate(layer: nn.TransformerEncoderLayer, **options: object) -> None:
        model = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False).eval()
        x = torch.randn(6, 2, 16) if not layer.self_attn.batch_first else torch.randn(2, 6, 16)
        with nanguard.watch(model, on_nonfinite="log", **options) as guard, torch.no_grad():  # type: ignore[arg-type]
            model(x)
            guard.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        evaluate(nn.TransformerEncoderLayer(16, 2, 32, batch_first=False))
        evaluate(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, activation=F.silu))
        hooked = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True)
        hooked.register_forward_hook(lambda *_: None)
        evaluate(hooked, exclude=(nn.TransformerEncoderLayer,))


class Tempered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.temp = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * torch.sqrt(self.temp)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_backward_origin_in_a_reordered_module_names_its_parameter_as_now(mode: str) -> None:
    # The blocks are reordered right after watch(), before any periodic check: the failing
    # block is `blocks.0` now, and so is its parameter's name.
    torch.manual_seed(0)
    outer = nn.Module()
    outer.blocks = nn.ModuleList([Tempered(), Tempered()])
    outer.forward = lambda x: outer.blocks[1](outer.blocks[0](x))  # type: ignore[method-assign]
    opt = torch.optim.SGD(outer.parameters(), lr=1e-3)
    guard = nanguard.watch(outer, optimizer=opt, mode=mode)  # type: ignore[arg-type]
    first, second = outer.blocks[0], outer.blocks[1]
    outer.blocks = nn.ModuleList([second, first])  # (reordered: `first` is blocks.1 now)
    with torch.no_grad():
        first.temp.zero_()  # sqrt at 0: an infinite derivative

    def train() -> None:
        loss = guard.check_loss(outer(torch.randn(4, 8)).pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "backward"
    names = dict(outer.named_parameters())
    assert origin.param in names
    assert names[origin.param] is first.temp


class TalkingHeads(nn.Module):
    """CaiT-style talking heads: a Linear mixes the heads' logits before the softmax, after
    a padding bias (0 / -inf) given positionally was added: -inf * w1 + -inf * w2 of mixed
    signs is NaN. The mask is misused by the model's code, not data gone bad."""

    def __init__(self, d: int = 16, h: int = 4) -> None:
        super().__init__()
        self.h = h
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.pre_softmax = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.h, d // self.h).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-1, -2) / math.sqrt(d // self.h) + extra
        s = self.pre_softmax(s.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)
        return self.o((s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d))


class TalkingEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.attn, self.head = nn.Embedding(50, 16), TalkingHeads(), nn.Linear(16, 5)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        return self.head((h + self.attn(h, pad)).mean(1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_zero_and_minus_inf_mask_through_a_linear_is_the_models_misuse_not_bad_data(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = TalkingEncoder()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    tokens = torch.randint(1, 50, (3, 6))
    pad = torch.arange(6)[None] >= torch.tensor([6, 4, 6])[:, None]
    bias = torch.zeros(3, 1, 1, 6).masked_fill(pad[:, None, None, :], float("-inf"))
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:  # type: ignore[arg-type]
        loss = guard.check_loss(F.cross_entropy(model(tokens, bias), torch.randint(0, 5, (3,))))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "attn")
    assert "data pipeline" not in origin.message


class LogCountNet(nn.Module):
    """Standardises its (log-count) features with F.layer_norm in its own code."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(F.layer_norm(x, (8,)))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_log_of_a_zero_count_normalised_by_the_models_own_code_is_the_batchs(mode: str) -> None:
    # The batch holds log(counts) with one count of 0: -Inf, which F.layer_norm in the
    # model's own code makes NaN of. Not a mask (finite values spread well beyond 0): the
    # input batch is the origin, not "eps = 0".
    torch.manual_seed(0)
    model = LogCountNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        for step in range(4):
            counts = torch.randint(1, 50, (16, 8)).float()
            if step == 2:
                counts[5, 7] = 0.0
            loss = guard.check_loss(model(torch.log(counts)).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.tensor) == (2, "input", "args[0]")
    assert "sample 5" in origin.message
