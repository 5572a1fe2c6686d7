"""Under no_grad, inference_mode, eval, autocast and gradient checkpointing."""

from __future__ import annotations

import pytest
import torch
from realistic import Fp16MLP, fp16_input, log_mlp
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import nanguard


@pytest.mark.parametrize("context", [torch.no_grad, torch.inference_mode])
def test_inference_contexts_resolve_each_forward(context: type) -> None:
    model = log_mlp().eval()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        with context():
            model(torch.randn(4, 784))
        # Without a step or optimizer, an inference forward is a step of its own.
        assert guard.origin is not None
    assert (guard.origin.module, guard.origin.kind) == ("1", "nan")
    assert guard.origin.stats is not None  # replayed under the same mode


def test_inference_mode_raise_happens_in_the_forward() -> None:
    model = log_mlp()
    with nanguard.watch(model) as guard, torch.inference_mode():
        with pytest.raises(nanguard.NonFiniteError, match="LogFeatures"):
            model(torch.randn(4, 784))
        model[0](torch.randn(4, 784))  # the guard keeps working afterwards
    assert guard.origin is not None


def test_eval_mode_batchnorm_uses_running_stats_clean() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.ReLU()).eval()
    with nanguard.watch(model) as guard, torch.no_grad():
        model(torch.randn(1, 8))
    assert guard.events == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_on_cpu_clean(dtype: torch.dtype) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    with nanguard.watch(model) as guard:
        with torch.autocast("cpu", dtype=dtype):
            out = model(torch.randn(8, 16))
        assert out.dtype == dtype
        out.float().sum().backward()
        guard.step()
    assert guard.events == []


def test_autocast_fp16_overflow_is_found_with_stats() -> None:
    model = Fp16MLP()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        with torch.autocast("cpu", dtype=torch.float16):
            model(fp16_input().float())
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.kind) == ("up", "inf")
    assert origin.stats is not None
    assert origin.stats.dtype == "torch.float16"  # the replay ran under autocast too


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.log(self.fc(x))


class Checkpointed(nn.Module):
    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.block = Block()
        self.out = nn.Linear(8, 1)
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        h = checkpoint(self.block, h, use_reentrant=self.reentrant)
        return self.out(h)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recompute_is_not_a_second_origin(reentrant: bool) -> None:
    model = Checkpointed(reentrant)
    x = torch.randn(4, 8, requires_grad=reentrant)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(x).sum().backward()  # backward re-runs block's forward
        events = guard.step()
    origins = [e for e in events if e.is_origin]
    assert [(e.module, e.phase) for e in origins] == [("block", "forward")]
    assert sum(1 for e in events if e.module == "block.fc") == 0  # fc's output was finite


@pytest.mark.parametrize("reentrant", [False, True])
def test_sentinel_replay_of_a_checkpointed_model(reentrant: bool) -> None:
    # The replay recomputes the parameters' gradients: reentrant checkpointing refuses
    # torch.autograd.grad, which must not cost the forward's localisation.
    torch.manual_seed(0)
    model = Checkpointed(reentrant)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x = torch.randn(4, 8, requires_grad=reentrant)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode="sentinel") as guard:
        model(x).sum().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "block")
    assert origin.op == "aten.log.default"
    assert all(p.grad is not None for p in model.parameters())  # .grad put back
