"""Forwards with side effects: the replays of a failing step must leave what the step left.

A queue pointer kept as a Python int, a counter, an EMA teacher moved in ``forward``, a
layer drop drawn from Python's ``random``, an attribute the forward sets: after a failing
step under any policy, the model's state is what an unguarded run's is after the same loop
(one that does by hand what the policy does: no update for the failing step).
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nanguard


class _MoCo(nn.Module):
    """MoCo with its queue pointer and a forward counter kept as Python ints."""

    def __init__(self, size: int = 32) -> None:
        super().__init__()
        self.encoder_q = nn.Sequential(
            nn.Linear(8, 16, bias=False), nn.ReLU(), nn.Linear(16, 8, bias=False)
        )
        self.encoder_k = copy.deepcopy(self.encoder_q)
        for p in self.encoder_k.parameters():
            p.requires_grad = False
        self.register_buffer("queue", F.normalize(torch.randn(8, size), dim=0))
        self.ptr = 0
        self.forwards = 0
        self.last_logits: Tensor | None = None

    def forward(self, im_q: Tensor, im_k: Tensor) -> Tensor:
        self.forwards += 1
        q = self.encoder_q(im_q)
        q = q / q.norm(dim=1, keepdim=True)  # no eps: a blank image is 0/0
        with torch.no_grad():
            pairs = zip(self.encoder_q.parameters(), self.encoder_k.parameters(), strict=True)
            for pq, pk in pairs:
                pk.mul_(0.99).add_(pq, alpha=0.01)  # the momentum encoder
            k = F.normalize(self.encoder_k(im_k), dim=1)
        queue: Tensor = self.queue
        logits = torch.cat([(q * k).sum(1, keepdim=True), q @ queue.clone()], 1) / 0.07
        self.last_logits = logits
        with torch.no_grad():
            queue[:, self.ptr : self.ptr + len(k)] = k.T
            self.ptr = (self.ptr + len(k)) % queue.shape[1]
        return F.cross_entropy(logits, torch.zeros(len(q), dtype=torch.long))


class _LayerDrop(nn.Module):
    """fairseq's LayerDrop: blocks skipped by Python's random."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(6)])
        self.head = nn.Linear(8, 1)

    def forward(self, im_q: Tensor, im_k: Tensor) -> Tensor:
        keep = (im_q[:, :1] != 0).float()
        x = im_q
        for block in self.blocks:
            if self.training and random.random() < 0.5:
                continue
            x = x + torch.tanh(block(x))
        return torch.log(self.head(x).abs() * keep).mean()  # a blank sample: log(0)


def _train(
    make: Callable[[], nn.Module], mode: str | None, policy: str, frozen_stem: bool = False
) -> nn.Module:
    torch.manual_seed(0)
    random.seed(0)
    model = make()
    if frozen_stem:  # (frozen weights outnumbering the trained ones: MoCo v3's patch stem)
        for p in model.encoder_q[0].parameters():
            p.requires_grad = False
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    guard = nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite=policy) if mode else None
    data = torch.Generator().manual_seed(1)
    try:
        for step in range(4):
            a, b = torch.randn(8, 8, generator=data), torch.randn(8, 8, generator=data)
            if step == 2:
                a[3] = 0.0
            loss = model(a, b)
            opt.zero_grad()
            loss.backward()
            if guard is None and not torch.isfinite(loss):
                continue  # what "raise" (caught) and "skip_step" do: no update
            with contextlib.suppress(nanguard.NonFiniteError):
                opt.step()
    finally:
        if guard is not None:
            guard.detach()
    return model


def _same_state(a: nn.Module, b: nn.Module) -> None:
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(x, y), name


@pytest.mark.filterwarnings("ignore::nanguard.NonFiniteWarning")
@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("policy", ["raise", "skip_step"])
@pytest.mark.parametrize("frozen_stem", [False, True])
def test_a_moco_step_replayed_leaves_its_pointer_queue_and_key_encoder(
    policy: str, mode: str, frozen_stem: bool
) -> None:
    # Each replay advanced the Python-int pointer, counted a forward, and (frozen weights
    # outnumbering the trained ones: none snapshotted) moved the key encoder once more.
    plain = _train(_MoCo, None, policy, frozen_stem)
    guarded = _train(_MoCo, mode, policy, frozen_stem)
    assert isinstance(plain, _MoCo)
    assert isinstance(guarded, _MoCo)
    assert (guarded.ptr, guarded.forwards) == (plain.ptr, plain.forwards) == (0, 4)
    _same_state(guarded, plain)
    assert guarded.last_logits is not None
    assert plain.last_logits is not None
    assert torch.equal(guarded.last_logits, plain.last_logits)


@pytest.mark.filterwarnings("ignore::nanguard.NonFiniteWarning")
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_layer_drop_drawn_from_pythons_random_is_not_moved_by_a_replay(mode: str) -> None:
    # The replays drew from Python's random: every later layer choice differed.
    plain = _train(_LayerDrop, None, "skip_step")
    state = random.getstate()
    guarded = _train(_LayerDrop, mode, "skip_step")
    assert random.getstate() == state  # (the same draws: the same state after the loops)
    _same_state(guarded, plain)


def test_a_key_encoder_that_copies_weights_gone_nan_is_not_a_second_origin() -> None:
    # Under "log" the NaN gradients of a blank image's step are applied to encoder_q; the
    # next forward's momentum update copies them into encoder_k, which was called an origin
    # "outside the optimizer's update", stamped with the earlier step.
    torch.manual_seed(0)
    model = _MoCo()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    data = torch.Generator().manual_seed(1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(4):
            a, b = torch.randn(8, 8, generator=data), torch.randn(8, 8, generator=data)
            if step == 2:
                a[3] = 0.0
            loss = model(a, b)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert bool(model.encoder_k[2].weight.isnan().all())
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.step, e.phase) for e in origins] == [(2, "forward")]
    copies = [e for e in guard.events if e.param and e.param.startswith("encoder_k.")]
    assert copies
    for event in copies:
        assert event.step == 3
        assert "copied weights that had already gone non-finite" in event.message


class _ObsNorm(nn.Module):
    """RunningMeanStd: an observation normaliser updated in forward, then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))
        self.register_buffer("var", torch.ones(4))
        self.register_buffer("count", torch.tensor(1e-4))
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def forward(self, x: Tensor) -> Tensor:
        mean: Tensor = self.mean
        var: Tensor = self.var
        count: Tensor = self.count
        with torch.no_grad():
            batch_mean, batch_var, n = x.mean(0), x.var(0), x.shape[0]
            delta = batch_mean - mean
            total = count + n
            mean += delta * n / total
            var.copy_((var * count + batch_var * n + delta**2 * count * n / total) / total)
            count.fill_(total)
        return self.net((x - mean) / torch.sqrt(var))  # type: ignore[no-any-return]


@pytest.mark.filterwarnings("ignore::nanguard.NonFiniteWarning")
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_skip_step_puts_a_normalisers_whole_state_back(mode: str) -> None:
    # A NaN observation: mean and var (NaN) were put back, the count (finite) kept the
    # dropped batch: statistics of N samples with a count of N + 8.
    torch.manual_seed(0)
    model = _ObsNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    before: dict[str, Tensor] = {}
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="skip_step"):
        for step in range(3):
            x = torch.randn(8, 4)
            if step == 2:
                before = {k: v.clone() for k, v in model.named_buffers()}
                x[3, 1] = float("nan")
            loss = model(x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    for name, value in model.named_buffers():
        assert torch.equal(value, before[name]), name


class _Carried(nn.Module):
    """A state carried across steps on the module (truncated BPTT's self.h = h.detach()):
    the difference of the input's projection and the last state, then a log-scale head."""

    def __init__(self, buffer: bool) -> None:
        super().__init__()
        self.inp = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.inp.weight.fill_(1.0)
        self.head = nn.Linear(1, 1)
        if buffer:
            self.register_buffer("h", torch.ones(4, 1))
        else:
            self.h = torch.ones(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x) - self.h
        self.h = h.detach()
        return self.head(torch.log(h))  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("buffer", [False, True])
def test_a_replay_starts_from_the_state_the_step_read(buffer: bool, mode: str) -> None:
    # h: 1 -> 2 -> -0.5, log(-0.5) is NaN. The replay started from the state the step left
    # (-0.5: log(1.5 + 0.5) is finite): no operation, "reproducible=False", inputs "in
    # [2, 2]", sentinel naming the whole model; a plain attribute kept the replay's state.
    torch.manual_seed(0)
    model = _Carried(buffer)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for x in (torch.full((4, 1), 3.0), torch.full((4, 1), 1.5)):
            loss = model(x).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert torch.equal(model.h, torch.full((4, 1), -0.5))  # the state the step left
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (1, "forward", "")
    assert origin.op == "aten.log.default"
    assert origin.reproducible is True


class _Stats:
    """A plain helper object a module keeps its running totals in."""

    def __init__(self) -> None:
        self.calls = 0
        self.total = torch.zeros(4)


class _SlotLayer(nn.Module):
    """A layer writing into its slice of a cache shared by the layers, counting its calls
    in a helper object, its running sums in a list of tensors."""

    def __init__(self, slot: Tensor, bad: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.slot = slot
        self.bad = bad
        self.stats = _Stats()
        self.running = [torch.zeros(4)]
        self.shape = torch.fx.immutable_collections.immutable_list([8, 4])  # (fx metadata)

    def forward(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            self.slot.add_(x.mean(0))
            self.running[0].add_(x.mean(0))
            self.stats.calls += 1
            self.stats.total += x.sum(0)
        y = self.lin(x)
        return torch.log(y) if self.bad else y  # NaN where negative, in the second layer


class _SlotNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        cache = torch.zeros(2, 4)  # one storage, a slice per layer
        self.l1 = _SlotLayer(cache[0], False)
        self.bn = nn.BatchNorm1d(4)
        self.l2 = _SlotLayer(cache[1], True)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.bn(self.l1(x))))  # type: ignore[no-any-return]


def _slot_state(model: _SlotNet) -> list[object]:
    return [
        (layer.slot.tolist(), layer.running[0].tolist(), layer.stats.calls, layer.stats.total)
        for layer in (model.l1, model.l2)
    ] + [model.bn.running_mean.tolist(), torch.rand(2).tolist()]


@pytest.mark.filterwarnings("ignore::nanguard.NonFiniteWarning")
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_state_below_the_module_and_in_shared_storage_is_put_back(mode: str) -> None:
    # A helper object's counter and a tensor in a list attribute kept the replays' updates;
    # a write through the second view of one storage was not undone; an immutable list
    # attribute made the clean-up raise, leaving BatchNorm's statistics the replay's.
    def run(guarded: bool) -> list[object]:
        torch.manual_seed(0)
        model = _SlotNet()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="warn")
        if not guarded:
            guard.detach()
        try:
            loss = model(torch.randn(8, 4)).nanmean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        finally:
            if guard.attached:
                assert guard.origin is not None
                assert guard.origin.op == "aten.log.default"
                guard.detach()
        state = _slot_state(model)
        return [s if not isinstance(s, tuple) else (*s[:3], s[3].tolist()) for s in state]

    assert run(guarded=True) == run(guarded=False)


class _Periodic(nn.Module):
    """Renormalises its features every 4th forward, counted by a Python int."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU())
        self.head = nn.Linear(32, 3)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        h = self.enc(x)
        if self.calls % 4 == 0:
            h = h / h.norm(dim=-1, keepdim=True)  # 0/0 for an all-zero sample
        return self.head(h)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_replay_takes_the_branch_the_step_took_on_a_counter(mode: str) -> None:
    # The replay saw the counter the step left (5): the other branch, no NaN, no operation;
    # sentinel mode named the whole model, "reproducible=False".
    torch.manual_seed(0)
    model = _Periodic()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(4):
            x = torch.randn(8, 16)
            if step == 3:
                x[2] = 0.0
            loss = F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert model.calls == 4
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.op) == (
        3,
        "forward",
        "",
        "aten.div.Tensor",
    )
    assert origin.reproducible is True


class _Counter(nn.Module):
    """A metric-like module: counts in forward, and defines __eq__ as torchmetrics' Metric
    does (building a new object, always truthy)."""

    def __init__(self) -> None:
        super().__init__()
        self.tp = 0

    def __eq__(self, other: object) -> bool:
        return object()  # type: ignore[return-value]

    __hash__ = nn.Module.__hash__

    def forward(self, x: Tensor) -> Tensor:
        self.tp += 1
        return x


class _FrozenConfig(dict):  # type: ignore[type-arg]
    """diffusers' FrozenDict: clear() works, update() refuses."""

    def update(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("frozen")


class _LayerCache:
    def __init__(self) -> None:
        self.keys = torch.zeros(0, 4)


class _KVCache:
    """A cache object holding one object per layer, each replacing its tensor (torch.cat)."""

    def __init__(self) -> None:
        self.layers = [_LayerCache()]


class _StatefulModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)
        self.first = _Counter()
        self.second = _Counter()
        self.config = _FrozenConfig(hidden=4, layers=1)
        self.cache = _KVCache()
        self.teacher = nn.Linear(4, 4)  # (an EMA copy kept trainable: timm's ModelEmaV3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(self.enc(x))
        h = self.second(h)
        layer = self.cache.layers[0]
        layer.keys = torch.cat([layer.keys, h.detach()[:2]])
        with torch.no_grad():
            for pt, ps in zip(self.teacher.parameters(), self.enc.parameters(), strict=True):
                pt.mul_(0.9).add_(ps, alpha=0.1)
        if self.second.tp % 3 == 0:
            h = h / h.norm(dim=-1, keepdim=True)  # 0/0 for an all-zero sample
        return h + self.teacher(x)  # type: ignore[no-any-return]


@pytest.mark.filterwarnings("ignore::nanguard.NonFiniteWarning")
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_state_in_real_library_shapes_is_put_back_after_a_replay(mode: str) -> None:
    # A module defining __eq__ (torchmetrics) made the learning of replaced attributes
    # compare modules equal (slow steps, attributes not learnt); a FrozenDict config was
    # emptied; a KV cache's per-layer objects kept the replay's keys; a trainable teacher
    # moved in forward kept the replay's update.
    def run(guarded: bool) -> tuple[list[object], nanguard.Guard | None]:
        torch.manual_seed(0)
        model = _StatefulModel()
        opt = torch.optim.SGD(model.enc.parameters(), lr=0.1)
        guard = nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="skip_step")
        if not guarded:
            guard.detach()
        try:
            for step in range(4):
                x = torch.randn(8, 4)
                if step == 2:
                    x[1] = 0.0
                    with torch.no_grad():
                        model.enc.bias.zero_()
                loss = model(x).nanmean()
                opt.zero_grad()
                loss.backward()
                grads = [p.grad for p in model.enc.parameters() if p.grad is not None]
                if not guarded and not all(bool(torch.isfinite(g).all()) for g in grads):
                    continue  # (what skip_step does)
                opt.step()
        finally:
            if guard.attached:
                guard.detach()
        state = [
            model.first.tp,
            model.second.tp,
            dict(model.config),
            model.cache.layers[0].keys.shape,
            model.teacher.weight.tolist(),
        ]
        return state, guard if guarded else None

    plain, _ = run(guarded=False)
    state, guard = run(guarded=True)
    assert state == plain
    assert guard is not None
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.op) == (2, "aten.div.Tensor")
    assert origin.reproducible is True
