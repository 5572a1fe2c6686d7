"""From a randomised sweep of watch() options: combinations that each work alone and
named the wrong origin, or none, together."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class RMSNorm(nn.Module):
    """eps outside the sqrt: an all-zero sample's backward is 0 * inf = NaN."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / (torch.sqrt(x.pow(2).mean(-1, keepdim=True)) + 1e-6) * self.weight


class Regressor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 64, bias=False)
        self.norm = RMSNorm(64)
        self.head = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.inp(x)))  # type: ignore[no-any-return]


def _train_blank_record(clip: bool, **options: Any) -> tuple[nanguard.Guard, nn.Module]:
    """Three steps; at step 1 one record of the batch is all zeros."""
    torch.manual_seed(0)
    model = Regressor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with nanguard.watch(model, optimizer=opt, **options) as guard:
            for step in range(3):
                x, y = torch.randn(32, 16), torch.randn(32, 1)
                if step == 1:
                    x[7] = 0.0
                loss = guard.check_loss(F.mse_loss(model(x), y))
                opt.zero_grad()
                loss.backward()
                if clip:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
    return guard, model


@pytest.mark.parametrize(
    "options",
    [
        {"backward": "probes"},
        {"replay": False},
        {"backward": "probes", "replay": False},
        {"backward": "probes", "grad_norm": False},
        {"replay": False, "grad_norm": False},
    ],
    ids=["probes", "no-replay", "probes-no-replay", "probes-no-norm", "no-replay-no-norm"],
)
def test_a_backward_origin_survives_clip_grad_norm_of_a_nan_total(options: dict[str, Any]) -> None:
    # clip_grad_norm_ by the NaN total norm made every .grad NaN: the origin was lost ("see
    # the earlier origin", there was none) or laid on the output Linear, whose parameter
    # gradients only the clip made NaN.
    guard, _ = _train_blank_record(clip=True, on_nonfinite="log", **options)
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (1, "backward", "norm")
    clipped = [e for e in guard.events if e.details.get("clip_total_norm_nonfinite")]
    assert clipped  # and the clip's part is told


def test_unchecked_gradients_are_not_called_finite() -> None:
    # backward=False, grad_norm=False: no gradient is read. The message said "although its
    # gradients were finite" and sent the user to the learning rate.
    guard, _ = _train_blank_record(clip=False, on_nonfinite="log", backward=False, grad_norm=False)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("param", "inp.weight")
    assert "although its gradients were finite" not in origin.message
    assert "Its gradients were not checked (backward=False, grad_norm=False)" in origin.message
    assert origin.hint is not None
    assert "applied gradients nothing checked" in origin.hint


def test_skip_step_that_reads_no_gradient_is_warned_about() -> None:
    with pytest.warns(UserWarning, match="skip_step' with backward=False and grad_norm=False"):
        nanguard.Guard(nn.Linear(2, 2), on_nonfinite="skip_step", backward=False, grad_norm=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        nanguard.Guard(nn.Linear(2, 2), on_nonfinite="skip_step", backward=False)
        nanguard.Guard(nn.Linear(2, 2), backward=False, grad_norm=False)


class Sensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("fault", ["nan_input", "fp16_overflow"])
def test_sync_module_on_a_step_between_every_n_full_steps_replays_first(fault: str) -> None:
    # every=2, sync="module": step 1 probes only the model's edges, and sync="module"
    # resolved it at once, naming the model ("its inputs were finite").
    torch.manual_seed(0)
    model = Sensor()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with nanguard.watch(model, optimizer=opt, on_nonfinite="log", every=2, sync="module") as g:
            for step in range(3):
                x, y = torch.randn(32, 16), torch.randn(32, 1)
                if step == 1 and fault == "nan_input":
                    x[3, 4] = float("nan")
                if step == 1 and fault == "fp16_overflow":
                    x = x * 1e6  # normalisation forgotten
                with torch.autocast("cpu", dtype=torch.float16, enabled=fault == "fp16_overflow"):
                    out = model(x)
                loss = g.check_loss(F.mse_loss(out.float(), y))
                opt.zero_grad()
                loss.backward()
                opt.step()
    origin = g.origin
    assert origin is not None
    if fault == "nan_input":
        assert (origin.step, origin.phase, origin.module) == (1, "input", "")
    else:
        assert (origin.step, origin.phase, origin.module) == (1, "forward", "net.0")


class MultiTask(nn.Module):
    """A dict of heads framed by plain values (the batch size first, a temperature last);
    its log of a variance that a ReLU made exactly 0 is -Inf."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.heads = nn.ModuleList(nn.Linear(64, 1) for _ in range(16))
        self.var_head = nn.Linear(64, 1)
        with torch.no_grad():
            self.var_head.bias.fill_(-100.0)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.trunk(x)
        out: dict[str, object] = {"batch_size": x.shape[0]}
        for i, head in enumerate(self.heads):
            out[f"task_{i}"] = head(h)
        out["log_var"] = torch.log(torch.relu(self.var_head(h)))
        out["temperature"] = 1.0
        return out


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_long_outputs_dict_framed_by_plain_values_is_checked_whole(mode: str) -> None:
    # A mapping whose ends are scalars was taken for a vocabulary and skipped: the loss was
    # blamed, "the model's outputs were finite".
    torch.manual_seed(0)
    model = MultiTask()
    with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard:
        out = model(torch.randn(8, 32))
        guard.check_loss(out["log_var"].mean())  # type: ignore[union-attr]
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == ("forward", "", "output['log_var']")


class Simulator(nn.Module):
    """A learned particle simulator rolled out over its own outputs; the pairwise distance
    includes i == j, whose sqrt's backward at 0 is NaN at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(3, 32), nn.Tanh(), nn.Linear(32, 2))

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        d = pos[:, :, None, :] - pos[:, None, :, :]
        density = torch.exp(-torch.sqrt((d**2).sum(-1))).sum(-1, keepdim=True)
        return pos + 0.1 * self.mlp(torch.cat([pos, density], -1))  # type: ignore[no-any-return]


def test_a_replay_inside_the_backward_leaves_the_users_graph_to_the_user() -> None:
    # sync="module" replays inside the backward, before the user's own backward reaches
    # the calls before: the replay's backward went on into that graph and freed it, and
    # the user's loss.backward() raised "Trying to backward through the graph a second time".
    torch.manual_seed(0)
    model = Simulator()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with nanguard.watch(model, optimizer=opt, on_nonfinite="warn", sync="module") as guard:
            for _ in range(2):
                pos = torch.randn(4, 8, 2)
                for _ in range(3):
                    pos = model(pos)
                loss = guard.check_loss(F.mse_loss(pos, torch.randn(4, 8, 2)))
                opt.zero_grad()
                loss.backward()
                opt.step()
    assert guard.origin is not None
    assert guard.current_step == 2


def test_a_share_of_a_sum_is_not_taken_for_a_count() -> None:
    from nanguard import TensorStats
    from nanguard._hints import HintContext, hint
    from nanguard._opwatch import OpInfo

    zero = TensorStats(
        shape=(), dtype="torch.float32", device="cpu", numel=1, nan_count=0, posinf_count=0,
        neginf_count=0, min=0.0, max=0.0, mean=0.0, std=0.0, first_values=(0.0,),
    )  # fmt: skip
    for line, count in [("w = w / w.sum()", False), ("loss = loss / num_items_in_batch", True)]:
        op = OpInfo(
            "aten.div.Tensor", (zero, zero), None, direction="forward",
            source=f"/m.py:3 in forward: {line}",
        )  # fmt: skip
        text = hint(HintContext(phase="forward", kind="nan", reason="own_code", op=op))
        assert ("a count that is 0" in text) is count
