"""Vision code from a review: a Swin-style attention with an nn.Softmax child over a fully
masked row, and a fine-tune with frozen BatchNorm statistics whose running_var has a 0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class Attention(nn.Module):
    """Swin's WindowAttention style: the scores go through an nn.Softmax child."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        if mask is not None:
            scores = scores + mask
        return self.proj(self.softmax(scores) @ v)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.attn = Attention(16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(pad.shape, dtype=x.dtype).masked_fill(pad, float("-inf"))[:, None, :]
        return self.head(self.attn(self.embed(x), mask=mask).mean(1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_fully_masked_row_in_an_nn_softmax_child_blames_the_softmax(mode: str) -> None:
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    x = torch.randn(4, 6, 8)
    pad = torch.zeros(4, 6, dtype=torch.bool)
    pad[2] = True  # sample 2 is all padding
    with nanguard.watch(net, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = guard.check_loss(F.cross_entropy(net(x, pad), torch.tensor([0, 1, 0, 1])))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "attn.softmax", "nan")
    assert origin.op == "aten._softmax.default"
    assert origin.hint is not None
    assert "every position is masked" in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_frozen_batchnorm_with_eps_0_and_a_dead_channel_names_running_var(mode: str) -> None:
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, eps=0.0), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 2),
    )  # fmt: skip
    with torch.no_grad():
        net[1].running_var[3] = 0.0  # channel 3 dead in the checkpoint
        net[1].running_mean[3] = 0.0
        net[0].weight[3] = 0.0
        net[0].bias[3] = 0.0
    net[1].eval()  # frozen statistics while fine-tuning
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with nanguard.watch(net, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = F.cross_entropy(net(torch.randn(4, 3, 8, 8)), torch.tensor([0, 1, 0, 1]))
        loss = guard.check_loss(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.module == "1"
    assert origin.hint is not None
    assert "running_var is 0" in origin.hint
    assert "eps > 0" in origin.hint


class LargeChannelNet(nn.Module):
    """An embedding with one large, always-positive channel (a "massive activation") that
    q and k of a Swin-style attention read with opposite signs (or the same)."""

    def __init__(self, sign: float) -> None:
        super().__init__()
        self.attn = Attention(16)
        self.head = nn.Linear(16, 2)
        with torch.no_grad():
            self.attn.qkv.weight[:16, 0] = 20.0
            self.attn.qkv.weight[16:32, 0] = 20.0 * sign

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return self.head(self.attn(x).mean(1)).float()


@pytest.mark.parametrize("sign", [-1.0, 1.0])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_float16_scores_overflowing_to_minus_inf_are_no_mask(mode: str, sign: float) -> None:
    # q @ k.T past 65504 in float16: every score -Inf (or +Inf). No mask wrote it: the
    # attention's own code is the origin, not its nn.Softmax child ("a fully masked row").
    torch.manual_seed(0)
    net = LargeChannelNet(sign)
    x = torch.randn(2, 16, 16)
    x[..., 0] = 8.0
    with nanguard.watch(net, mode=mode, on_nonfinite="log") as guard:
        guard.check_loss(net(x).sum()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "attn", "inf")
    assert origin.tensor == "args[0] of attn.softmax"
    assert origin.op == "aten.bmm.default"
    assert origin.source is not None
    assert origin.source.endswith("scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5")
    assert origin.hint is not None
    assert "overflowed float16" in origin.hint
    assert "masked" not in origin.hint


class ZeroedAttention(Attention):
    """The same attention, its NaN rows zeroed (the usual guard for fully masked rows)."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5
        return self.proj(torch.nan_to_num(self.softmax(scores)) @ v)


def test_scores_overflowing_to_minus_inf_are_no_mask_even_when_nan_to_num_hides_them() -> None:
    torch.manual_seed(0)
    net = LargeChannelNet(-1.0)
    net.attn = ZeroedAttention(16)
    with torch.no_grad():
        net.attn.qkv.weight[:16, 0] = 20.0
        net.attn.qkv.weight[16:32, 0] = -20.0
    x = torch.randn(2, 16, 16)
    x[..., 0] = 8.0
    with nanguard.watch(net, on_nonfinite="log") as guard, torch.no_grad():  # (evaluation)
        out = net(x)
        guard.step()
    assert torch.isfinite(out).all()  # every attention row zeroed: a silent bug
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.op) == ("attn", "aten.bmm.default")


class DepthRefiner(nn.Module):
    """Fed log-depth maps, standardised in its own forward before the first conv."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(1.0))
        self.register_buffer("std", torch.tensor(0.5))
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (x - self.mean) / self.std
        return self.conv2(F.relu(self.conv1(x)))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_minus_inf_data_in_the_batch_is_the_input_origin(mode: str) -> None:
    # The dataset takes the log of a depth map whose sensor holes are 0: -Inf pixels, which
    # the model's standardisation passes on and its conv makes NaN and +Inf of. -Inf can be
    # a mask, but a convolution is no softmax: the batch is where it began, not the model.
    torch.manual_seed(0)
    model = DepthRefiner()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    depth = torch.rand(4, 4, 1, 12, 12) * 5 + 0.5
    depth[3, 1, 0, 4:6, 4:6] = 0.0
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        for batch in depth:
            x = torch.log(batch)
            loss = guard.check_loss(F.smooth_l1_loss(model(x), x.nan_to_num(neginf=0.0)))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.tensor) == (3, "input", "", "args[0]")
    assert origin.stats is not None
    assert (origin.stats.neginf_count, origin.stats.nan_count) == (4, 0)
    assert "It is in sample 1 (of 4 along dim 0)" in origin.message
    assert "the own code" not in origin.message
    assert all(torch.isfinite(p).all() for p in model.parameters())


class MaskedPool(nn.Module):
    """Attention pooling whose additive mask comes in positionally, under a name that is
    not a mask's: its -inf (0 elsewhere) is still a mask, made NaN by a fully masked row."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(8, 1)
        self.out = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        w = torch.softmax(self.score(x).squeeze(-1) + pad, -1)
        return self.out((w.unsqueeze(-1) * x).sum(1))


def test_a_zero_minus_inf_argument_is_still_a_mask_not_bad_data() -> None:
    torch.manual_seed(0)
    model = MaskedPool()
    pad = torch.zeros(4, 6)
    pad[:, 4:] = float("-inf")
    pad[2] = float("-inf")  # a sequence with no tokens left
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(4, 6, 8), pad).sum().backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "")
    assert origin.details["reason"] == "own_code"
    assert origin.op is not None
    assert "softmax" in origin.op


class HandSyncBN(nn.Module):
    """A hand-written SyncBatchNorm (one process): the unbiased variance over n - 1, written
    into its running statistics in the same forward."""

    def __init__(self, c: int, momentum: float = 0.1, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(c))
        self.bias = nn.Parameter(torch.zeros(c))
        self.register_buffer("running_mean", torch.zeros(c))
        self.register_buffer("running_var", torch.ones(c))
        self.momentum, self.eps = momentum, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // x.shape[1]
        mean = x.sum((0, 2, 3)) / n
        var = ((x * x).sum((0, 2, 3)) - n * mean * mean) / (n - 1)
        with torch.no_grad():
            self.running_mean.mul_(1 - self.momentum).add_(self.momentum * mean)
            self.running_var.mul_(1 - self.momentum).add_(self.momentum * var)
        xh = (x - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + self.eps)
        return xh * self.weight[None, :, None, None] + self.bias[None, :, None, None]


class SubclassSyncBN(nn.BatchNorm2d):
    """detectron2's NaiveSyncBatchNorm shape: a BatchNorm2d subclass with its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel() // x.shape[1]
        mean = x.sum((0, 2, 3)) / n
        var = ((x * x).sum((0, 2, 3)) - n * mean * mean) / (n - 1)
        with torch.no_grad():
            assert self.running_mean is not None
            assert self.running_var is not None
            self.running_mean.mul_(0.9).add_(0.1 * mean)
            self.running_var.mul_(0.9).add_(0.1 * var)
        xh = (x - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + self.eps)
        return xh * self.weight[None, :, None, None] + self.bias[None, :, None, None]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("norm", [HandSyncBN, SubclassSyncBN])
def test_a_norm_that_writes_the_nan_it_made_into_its_running_stats_is_the_origin(
    norm: type[nn.Module], mode: str
) -> None:
    # The epoch's last batch holds one image and the head runs at 1x1: n - 1 = 0. The norm
    # makes 0/0 and writes it into its running_var in the same forward: it is the origin
    # (not "downstream of running statistics already non-finite"), its buffer propagated.
    def block(ci: int, co: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(ci, co, 3, stride=2, padding=1, bias=False), norm(co))

    torch.manual_seed(0)
    model = nn.Sequential(block(3, 8), block(8, 16), block(16, 16), nn.Flatten(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        for size in (8, 8, 8, 1):
            x, y = torch.randn(size, 3, 8, 8, generator=gen), torch.randint(0, 4, (size,))
            loss = guard.check_loss(F.cross_entropy(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.step, e.phase, e.module) for e in origins] == [(3, "forward", "2.1")]
    assert origins[0].op == "aten.div.Tensor"
    written = [e for e in guard.events if e.param == "2.1.running_var"]
    assert written
    assert not any(e.is_origin for e in written)


class ManifoldMixupNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU())
        self.layer = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, lam: float, perm: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        h = lam * h + (1 - lam) * h[perm]
        return self.fc(self.layer(h).mean((2, 3)))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_mixup_lambda_given_as_a_python_float_is_named_as_such(mode: str) -> None:
    # lam = mix weight / total weight, 0/0 at an epoch where mixup is off: a Python float,
    # in no tensor, so the multiplication is where it shows. The hint says so.
    torch.manual_seed(0)
    model = ManifoldMixupNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        for step in range(4):
            x, y = torch.randn(6, 3, 8, 8), torch.randint(0, 4, (6,))
            lam = float("nan") if step == 2 else 0.3
            loss = guard.check_loss(F.cross_entropy(model(x, lam, torch.randperm(6)), y))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.module, origin.op) == (2, "", "aten.mul.Tensor")
    assert origin.hint is not None
    assert "NaN as a plain number" in origin.hint
