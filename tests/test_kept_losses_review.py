"""A loop that keeps its loss tensors (losses.append(loss), total_loss += loss) keeps their
autograd graphs: nanguard's hooks on those graphs must not keep each step's records, and
the gradients and inputs they held, alive with them."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard

VOCAB = 2048


def _live_tensor_bytes() -> int:
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not isinstance(obj, nn.Parameter):
            try:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # (a FakeTensor a compile test left)
                continue
    return sum(storages.values())


@pytest.mark.filterwarnings("ignore::FutureWarning")  # (the scan meets torch's deprecated names)
@pytest.mark.parametrize("mode", ["full", "sentinel", None])
@pytest.mark.parametrize("keep", ["append", "accumulate"])
def test_kept_losses_do_not_keep_the_steps_gradients(keep: str, mode: str | None) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(VOCAB, 64), nn.Linear(64, VOCAB))
    opt = torch.optim.AdamW(model.parameters(), 1e-3)
    guard = nanguard.watch(model, optimizer=opt, mode=mode) if mode else None
    sizes: list[int] = []
    try:
        _train_keeping(model, opt, keep, sizes)
    finally:
        if guard is not None:
            guard.detach()
    if guard is not None:
        assert guard.events == []
    logits_grad = 8 * 64 * VOCAB * 4  # 4 MiB a step
    assert sizes[1] - sizes[0] < logits_grad  # (it grew by 7 of them a step before)


def _train_keeping(
    model: nn.Module, opt: torch.optim.Optimizer, keep: str, sizes: list[int]
) -> None:
    """Ten steps keeping the losses; live tensor bytes after the 3rd and the 10th."""
    losses: list[torch.Tensor] = []
    total = torch.zeros(())
    for step in range(10):
        ids = torch.randint(0, VOCAB, (8, 65))
        loss = F.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        if keep == "append":
            losses.append(loss)  # averaged and logged later
        else:
            total = total + loss  # the PyTorch FAQ's "accumulating history"
        del loss
        if step in (2, 9):
            sizes.append(_live_tensor_bytes())
