"""Gradient accumulation over many micro-batches loaded one by one: the inputs kept for a
replay must not hold every micro-batch of the step at once (full mode lets the earlier ones
go past a budget; sentinel mode, whose replay is what tells a bad batch from a bad layer,
keeps them)."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

import nanguard

MICRO_BATCHES = 32  # of 6 MiB each: 192 MiB, past the 128 MiB budget of a small model


def _model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(128, 10),
    )  # fmt: skip


def _accumulate(
    mode: str, bad: int | None, chunks_of_one_batch: bool = False
) -> tuple[nanguard.Guard, list[weakref.ref[torch.Tensor]]]:
    torch.manual_seed(0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    refs: list[weakref.ref[torch.Tensor]] = []
    whole = torch.randn(MICRO_BATCHES * 8, 3, 256, 256) if chunks_of_one_batch else None
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for k in range(MICRO_BATCHES):
            # (a loader's next batch, a fresh tensor each time; or a chunk of one batch)
            x = torch.randn(8, 3, 256, 256) if whole is None else whole[8 * k : 8 * k + 8]
            if k == bad:
                x[2, 1, 100, 100] = float("nan")  # a corrupt image
            refs.append(weakref.ref(x))
            y = torch.randint(0, 10, (8,))
            (nn.functional.cross_entropy(model(x), y) / MICRO_BATCHES).backward()
            del x
        gc.collect()
        kept = [r() is not None for r in refs]
        opt.step()
        opt.zero_grad()
    return guard, kept  # type: ignore[return-value]


def test_earlier_micro_batches_are_let_go_in_full_mode() -> None:
    guard, kept = _accumulate("full", bad=None)
    assert guard.events == []
    # (The first 8, whose output gradients are kept for a backward replay, are kept; then
    # the latest ones that fit: about 128 MiB of 6 MiB micro-batches in all.)
    assert all(kept[:8])
    assert not kept[8]  # freed before the step ended
    assert kept[-1]  # the latest is kept (a replay of it needs it)
    assert 16 <= sum(kept) <= 22


def test_a_corrupt_micro_batch_whose_inputs_were_let_go_is_still_the_origin() -> None:
    guard, _ = _accumulate("full", bad=10)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.details["forward"]) == ("input", "", 11)
    problem = origin.details["stats_problem"]
    assert "the inputs of this micro-batch (forward 11 of the step) were let go" in problem
    assert 'mode="sentinel" keeps them all' in problem


def test_a_corrupt_late_micro_batch_keeps_its_exact_statistics() -> None:
    guard, _ = _accumulate("full", bad=MICRO_BATCHES - 2)
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "input"
    assert "stats_problem" not in origin.details
    assert "It is in sample 2 (of 8 along dim 0)" in origin.message


def test_chunks_of_one_batch_are_not_counted_against_the_budget() -> None:
    """The loop holds the whole batch anyway: letting a chunk's view go frees nothing."""
    guard, kept = _accumulate("full", bad=0, chunks_of_one_batch=True)
    assert all(kept)
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "input"
    assert "stats_problem" not in origin.details


def test_sentinel_mode_keeps_every_micro_batch_to_tell_a_bad_batch() -> None:
    guard, kept = _accumulate("sentinel", bad=1)
    assert all(kept)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details["forward"]) == ("input", 2)


class _InstanceNorm(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        # (hand-written: the sqrt's slope is infinite at a zero variance, a blank image)
        return (h - h.mean((2, 3), keepdim=True)) / (h.var((2, 3), keepdim=True).sqrt() + 1e-5)


def _norm_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 4, stride=4), _InstanceNorm(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
        nn.Linear(128, 10),
    )  # fmt: skip


def _blank_in(bad: int) -> nanguard.Event:
    torch.manual_seed(0)
    model = _norm_model()
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for k in range(MICRO_BATCHES):
            x = torch.randn(8, 3, 256, 256)
            if k == bad:
                x[3] = 0.0  # a blank image
            loss = nn.functional.cross_entropy(model(x), torch.randint(0, 10, (8,)))
            (loss / MICRO_BATCHES).backward()
        opt.step()
    assert guard.origin is not None
    return guard.origin


def test_a_backward_nan_in_an_early_micro_batch_is_named_to_its_operation() -> None:
    """Past the budget, the micro-batches whose output gradients are kept (the first 8)
    keep their inputs too: a backward replay of them needs both."""
    origin = _blank_in(0)
    assert (origin.phase, origin.module) == ("backward", "1")
    assert origin.op == "aten.div.Tensor in SqrtBackward0"


def test_a_backward_nan_in_a_let_go_micro_batch_says_how_to_name_it() -> None:
    origin = _blank_in(11)
    assert (origin.phase, origin.param) == ("grad", "0.weight")
    assert "the inputs of this micro-batch (forward" in origin.message
    assert "were let go for later ones'" in origin.message
    assert 'Run with mode="sentinel"' in origin.message
    assert "Check custom autograd Functions" not in origin.message
