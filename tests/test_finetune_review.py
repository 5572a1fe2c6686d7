"""Models changed by PyTorch's own machinery (parametrizations, pruning, quantization-aware
training), fine-tuning set-ups and decoding loops, from a review with real model code."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


# ------------------------------------------------------ decoding with a KV cache in a dict
class CachedDecoder(nn.Module):
    """nanoGPT-style incremental decoding: the forward appends to the cache it is given."""

    def __init__(self, vocab: int = 50, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor, cache: dict[str, torch.Tensor]) -> tuple:
        q, k, v = self.qkv(self.emb(idx)).chunk(3, -1)
        if "k" in cache:
            k = torch.cat([cache["k"], k], 1)
            v = torch.cat([cache["v"], v], 1)
        cache["k"], cache["v"] = k, v
        t, s = q.shape[1], k.shape[1]
        causal = torch.ones(t, s, dtype=torch.bool).tril(s - t)
        scores = (q @ k.transpose(1, 2) / 32**0.5).masked_fill(~causal, float("-inf"))
        att = scores.softmax(-1)
        entropy = -(att * att.log()).sum(-1).mean()  # a metric: 0 * log(0) is NaN
        return self.out(att @ v), entropy


@torch.no_grad()
def _generate(model: nn.Module, **watch: object) -> tuple[list[int], int, nanguard.Guard | None]:
    guard = nanguard.watch(model, on_nonfinite="log", **watch) if watch else None  # type: ignore[arg-type]
    cache: dict[str, torch.Tensor] = {}
    logits, _ = model(torch.tensor([[3, 7, 11]]), cache)  # the prompt: a causal mask
    tokens = []
    for _ in range(8):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens.append(int(token))
        logits, _ = model(token, cache)
    if guard is not None:
        guard.detach()
    return tokens, cache["k"].shape[1], guard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_replayed_decoding_step_leaves_the_users_kv_cache_and_tokens_as_they_were(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = CachedDecoder().eval()
    expected = _generate(copy.deepcopy(model))
    tokens, length, guard = _generate(copy.deepcopy(model), mode=mode)
    assert (tokens, length) == expected[:2]
    assert guard is not None
    assert guard.origin is not None
    # Replayed from the cache as it was when the forward began: reproduced, op named.
    assert guard.origin.op == "aten.log.default"
    assert guard.origin.reproducible is True


# ------------------------------------------------ weights already bad in the checkpoint
def test_a_weight_made_inf_by_a_half_conversion_is_blamed_on_the_checkpoint_not_adam() -> None:
    torch.manual_seed(0)
    base = nn.Linear(32, 32).to(torch.bfloat16)
    with torch.no_grad():
        base.weight[3, 4] = 1e5  # an outlier bfloat16 holds and float16 does not
    model = nn.Sequential(base, nn.ReLU(), nn.Linear(32, 4)).half()
    model[0].requires_grad_(False)  # a frozen base, only the head trains
    opt = torch.optim.AdamW(model[2].parameters(), lr=1e-4, eps=1e-4)
    with nanguard.watch(model, optimizer=opt) as guard:
        x, y = torch.randn(8, 32).half(), torch.randint(0, 4, (8,))
        loss = F.cross_entropy(model(x).float(), y)
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param, origin.kind) == ("param", "0.weight", "inf")
    assert "before the first step" in origin.message
    assert origin.hint is not None
    assert "before any optimizer step" in origin.hint
    assert "65504" in origin.hint
    assert "eps" not in origin.hint


def test_a_nan_weight_in_a_loaded_checkpoint_gets_no_optimizer_hint() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    state = model.state_dict()
    state["0.weight"][2, 3] = float("nan")  # a checkpoint saved after training diverged
    model.load_state_dict(state)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt) as guard:
        loss = model(torch.randn(4, 8)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("param", "0.weight")
    assert origin.hint is not None
    assert "checkpoint" in origin.hint
    assert "Adam" not in origin.hint
    assert "learning rate" not in origin.hint


# ------------------------------------- weights computed in a forward pre-hook (hook-based)
class ZeroInitOutput(nn.Module):
    """A HiFi-GAN-style conv stack whose zero-initialised output conv is weight-normed:
    weight = g * v / ||v|| = 0 * (0 / 0), computed by WeightNorm's forward pre-hook."""

    def __init__(self, wrap: object) -> None:
        super().__init__()
        self.inp = nn.Conv1d(4, 32, 3, padding=1)
        conv = nn.Conv1d(32, 4, 3, padding=1)
        nn.init.zeros_(conv.weight)
        nn.init.zeros_(conv.bias)
        self.out = wrap(conv)  # type: ignore[operator]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(F.silu(self.inp(x)))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize(
    ("wrap", "op", "hook"),
    [
        (nn.utils.weight_norm, "aten._weight_norm_interface.default", "WeightNorm"),
        (nn.utils.spectral_norm, "aten.div.Tensor", "SpectralNorm"),
    ],
)
def test_a_weight_made_nan_by_a_hook_based_norm_names_the_op_and_the_pre_hook(
    wrap: object, op: str, hook: str, mode: str
) -> None:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # (deprecated for parametrizations)
        model = ZeroInitOutput(wrap)
    opt = torch.optim.Adam(model.parameters())
    x = torch.randn(8, 4, 16)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        loss = F.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "out", op)
    assert f"Look at Conv1d.forward and its forward pre-hooks ({hook})" in origin.message


# ------------------------------------------------------------- a head added after watch()
class ScaledCosineHead(nn.Module):
    """A cosine classifier with a learnable logit scale that starts at 0: sqrt's gradient
    at 0 is infinite while its forward is finite."""

    def __init__(self, d: int = 64, n: int = 5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, d) * 0.1)
        self.scale = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.normalize(self.weight, dim=-1)
        return F.normalize(x, dim=-1) @ w.T * self.scale.sqrt() * 10


class MultiTask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.heads = nn.ModuleDict({"task0": nn.Linear(64, 5)})

    def forward(self, x: torch.Tensor, task: str) -> torch.Tensor:
        return self.heads[task](self.trunk(x))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_head_added_after_watch_is_checked_from_the_step_its_parameters_join(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = MultiTask()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    task = "task0"
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for step in range(8):
            if step == 4:  # a new task arrives: a head and its parameter group
                model.heads["task1"] = ScaledCosineHead()
                opt.add_param_group({"params": model.heads["task1"].parameters()})
                task = "task1"
            x, y = torch.randn(32, 20), torch.randint(0, 5, (32,))
            loss = F.cross_entropy(model(x, task), y)
            opt.zero_grad()
            loss.backward()
            if step < 4:
                opt.step()
                continue
            with pytest.raises(nanguard.NonFiniteError):
                opt.step()  # stopped before the Inf gradient reaches the weight
            break
    assert float(model.heads["task1"].scale) == 0.0
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.module, origin.param) == (4, "heads.task1", "heads.task1.scale")
    if mode == "sentinel":  # (replayed with the new head's hooks)
        assert origin.op == "aten.div.Tensor in SqrtBackward0"


def test_modules_added_after_watch_are_hooked_at_the_next_check() -> None:
    torch.manual_seed(0)
    model = MultiTask()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=opt) as guard:
        model.heads["task1"] = nn.Sequential(nn.Linear(64, 5), nn.LogSigmoid())
        for step in range(40):
            x = torch.randn(8, 20)
            if step == 30:
                with torch.no_grad():  # the new head's weights overflow in this step
                    model.heads["task1"][0].weight.fill_(3e38)
            loss = model(x, "task1").pow(2).mean()
            model.zero_grad()  # (the new head is in no optimizer: its gradients too)
            loss.backward()
            try:
                opt.step()
            except nanguard.NonFiniteError:
                break
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (30, "forward", "heads.task1.0")


class LogOfTanh(nn.Module):
    """A parameter-free block: log of a tanh that can be 0 (on for one step)."""

    def __init__(self) -> None:
        super().__init__()
        self.on = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.tanh(x).abs() * (not self.on)) if self.on else torch.tanh(x)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_module_swapped_in_before_the_next_check_is_named_when_it_fails(mode: str) -> None:
    # model[1] = NewBlock(): no parameters, so no add_param_group; the step it makes -Inf
    # comes before the periodic check. The failing step is replayed with it hooked: it is
    # the origin, not the parent's own code between its children.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    x = torch.randn(32, 8)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        model[1] = nn.Sequential(nn.Identity(), LogOfTanh())
        for step in range(4):
            model[1][1].on = step == 3
            loss = guard.check_loss(model(x).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            if step < 3:
                opt.step()
                continue
            with pytest.raises(nanguard.NonFiniteError):
                opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.module_type) == (
        3,
        "forward",
        "1.1",
        "LogOfTanh",
    )
    assert origin.op == "aten.log.default"
    assert origin.source is not None
    assert "torch.log(torch.tanh(x)" in origin.source


# ------------------------------------------------- quantization-aware training, skip_step
def test_skip_step_puts_back_the_fake_quant_observers_a_nan_batch_poisoned() -> None:
    from torch.ao.quantization import (
        DeQuantStub,
        QuantStub,
        get_default_qat_qconfig,
        prepare_qat,
    )

    class QNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.quant = QuantStub()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.bn = nn.BatchNorm2d(8)
            self.fc = nn.Linear(8, 10)
            self.dequant = DeQuantStub()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = F.relu(self.bn(self.conv(self.quant(x))))
            return self.dequant(self.fc(x.mean((2, 3))))

    torch.manual_seed(0)
    model = QNet().train()
    model.qconfig = get_default_qat_qconfig("x86")  # type: ignore[assignment]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (torch.ao's deprecation notices)
        prepare_qat(model, inplace=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard:
            for step in range(8):
                x, y = torch.rand(16, 3, 8, 8), torch.randint(0, 10, (16,))
                if step == 3:
                    x[5] = 0.5  # a blank image, standardised by its own std (0): NaN
                x = (x - x.mean((1, 2, 3), keepdim=True)) / x.std((1, 2, 3), keepdim=True)
                loss = F.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(float(loss))
    assert guard.origin is not None
    assert guard.origin.phase == "input"
    assert all(torch.isfinite(torch.tensor(v)) for i, v in enumerate(losses) if i != 3)
    assert torch.isfinite(model.quant.activation_post_process.scale).all()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_model_fed_numpy_through_a_converting_pre_hook_is_replayed(mode: str) -> None:
    """A scikit-learn style wrapper: the model's own pre-hook turns numpy batches into
    tensors (nanguard's pre-hook runs first and keeps the arrays)."""
    import numpy as np

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = nn.Linear(6, 16)
            self.fc2 = nn.Linear(16, 1)
            self.register_forward_pre_hook(
                lambda _, args: tuple(torch.as_tensor(a, dtype=torch.float32) for a in args)
            )

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.log(F.relu(self.fc1(x))))  # log(0) where relu cuts

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = np.random.default_rng(0).standard_normal((16, 6)).astype(np.float32)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.op) == ("forward", "aten.log.default")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_decoding_loop_says_which_call_made_the_nan(mode: str) -> None:
    """Inference calls do not end steps: the event says which forward of the step it was."""

    class Decoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.out = nn.Linear(8, 10)

        def forward(self, token: torch.Tensor, position: int) -> torch.Tensor:
            h = self.emb(token) / (5 - position)  # a position scaling that breaks at 5
            return self.out(h)

    model = Decoder().eval()
    with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard, torch.no_grad():
        token = torch.tensor([1])
        for position in range(8):
            token = model(token, position).argmax(-1)
    origin = guard.origin
    assert origin is not None
    assert origin.details["forward"] == 6  # positions 0..4 were finite
    assert "(It was forward 6 of the step.)" in origin.message


class DoRALinear(nn.Module):
    """A DoRA adapter: the weight's direction normalised per column (0/0 on a dead column)."""

    def __init__(self, base: nn.Linear, r: int = 4) -> None:
        super().__init__()
        self.base = base
        self.A = nn.Parameter(torch.randn(r, base.in_features) * 0.01)
        self.B = nn.Parameter(torch.zeros(base.out_features, r))
        self.m = nn.Parameter(base.weight.norm(dim=0, keepdim=True).detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.base.weight + self.B @ self.A
        return F.linear(x, self.m * w / w.norm(dim=0, keepdim=True), self.base.bias)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_adapters_injected_after_watch_and_made_nan_are_not_blamed_on_the_optimizer(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1)
    )
    with torch.no_grad():
        model[2].weight[:, 3] = 0.0  # a dead input column in the base weight
    with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard:
        model[0] = DoRALinear(model[0])  # injected after watch(), before the next check
        model[2] = DoRALinear(model[2])
        model.requires_grad_(False)
        adapters = [p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in "ABm"]
        for p in adapters:
            p.requires_grad_(True)
        opt = torch.optim.AdamW(adapters, lr=1e-3)
        for _ in range(2):
            loss = model(torch.randn(2, 5, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            guard.step()
            opt.step()
    origins = [(e.phase, e.module) for e in guard.events if e.is_origin]
    assert origins == [("forward", "2")]
    params = [e for e in guard.events if e.phase == "param" and e.param is not None]
    assert params
    assert all("although its gradients were finite" not in e.message for e in params)
    assert all(
        "was added to the model (or put in another's place) after" in e.message for e in params
    )


def test_a_task_head_swapped_in_restarts_the_gradient_norm_history() -> None:
    # Transfer learning: 60 steps on task A, then a fresh head for task B, added to the
    # optimizer. Its gradients are larger than the converged head's, which is no explosion.
    torch.manual_seed(0)
    body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
    model = nn.Sequential(body, nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    w_a, w_b = torch.randn(8, 3), torch.randn(8, 5)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="warn") as guard:
        for step in range(75):
            if step == 60:
                model[1] = nn.Linear(16, 5)
                opt.add_param_group({"params": model[1].parameters()})
            x = torch.randn(64, 8)
            y = (x @ (w_a if step < 60 else w_b)).argmax(1)
            loss = guard.check_loss(F.cross_entropy(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []


class LogCount(nn.Module):
    """Log-count features without an eps."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 16)

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.proj(torch.log(counts))


class CountNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.feat: nn.Module = LogCount()
        self.head = nn.Linear(16, 1)

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.feat(counts)))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_module_wrapped_in_a_new_parent_after_watch_goes_by_its_new_name(mode: str) -> None:
    # Dropout added mid-run by wrapping the feature module: named_modules() now calls it
    # `feat.0` (and its layer `feat.0.proj`); a zero count later is named so, its weight too.
    torch.manual_seed(0)
    model = CountNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        for step in range(40):
            if step == 2:
                model.feat = nn.Sequential(model.feat, nn.Dropout(0.1))
            counts = torch.randint(1, 20, (32, 4)).float()
            if step == 20:
                counts[5, 2] = 0.0
            loss = guard.check_loss(F.mse_loss(model(counts), torch.randn(32, 1)))
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.module, origin.module_type) == (20, "feat.0", "LogCount")
    assert origin.tensor == "args[0] of feat.0.proj"
    assert origin.op == "aten.log.default"
    names = {name for name, _ in model.named_modules()}
    assert {e.module for e in guard.events if e.module is not None} <= names
    params = {name for name, _ in model.named_parameters()}
    assert {e.param for e in guard.events if e.param is not None} <= params
