"""On a GPU: no sync inside the hooks, one read per step, the same origins as on the CPU,
and the GPU's own RNG, autocast and GradScaler handled (CUDA only)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from realistic import (
    CAUSES,
    Fp16MLP,
    LogFeatures,
    PairwiseDistances,
    amp_step,
    fp16_input,
    log_mlp,
)
from torch import nn

import nanguard

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def conv_net() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(),
        nn.Linear(8 * 16 * 16, 10),
    )  # fmt: skip


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_guarded_step_does_not_sync_inside_forward_and_backward(mode: str) -> None:
    device = torch.device("cuda")
    model = conv_net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 3, 16, 16, device=device)
    y = torch.randint(0, 10, (4,), device=device)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            torch.cuda.set_sync_debug_mode("error")  # any sync in the hooks raises
            try:
                loss = nn.functional.cross_entropy(model(x), y)
                guard.check_loss(loss)
                loss.backward()
            finally:
                torch.cuda.set_sync_debug_mode("default")
            opt.step()  # the one read of the step happens here, on purpose
    assert guard.events == []


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_whole_training_step_reads_the_device_once(mode: str) -> None:
    device = torch.device("cuda")
    model = conv_net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(4, 3, 16, 16, device=device)
    y = torch.randint(0, 10, (4,), device=device)

    def syncs_in_a_step(guard: nanguard.Guard | None) -> int:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opt.zero_grad(set_to_none=True)
                loss = nn.functional.cross_entropy(model(x), y)
                if guard is not None:
                    guard.check_loss(loss)
                loss.backward()
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in caught)

    unguarded = [syncs_in_a_step(None) for _ in range(3)]
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        syncs_in_a_step(guard)  # the first step also sweeps the parameters once
        guarded = [syncs_in_a_step(guard) for _ in range(3)]
    assert [g - u for g, u in zip(guarded, unguarded, strict=True)] == [1, 1, 1]
    assert guard.events == []


def without_numbers(text: str) -> str:
    return re.sub(r"[-+]?\d[\d.,e+-]*", "#", text)


CASES = {
    **CAUSES,
    "fp16 overflow": (
        lambda: Fp16MLP().half(),
        lambda: (fp16_input(),),
        lambda o: o.float().mean(),
    ),
}


def origin_on(device: str, case: str, mode: str) -> nanguard.Event | None:
    factory, make_input, loss_fn = CASES[case]
    torch.manual_seed(0)
    model = factory().to(device)
    args = tuple(a.to(device) for a in make_input())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, on_nonfinite="log", optimizer=opt, mode=mode) as guard:
        out = model(*args)
        loss = guard.check_loss((loss_fn or (lambda o: o.float().pow(2).mean()))(out))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return guard.origin


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("case", list(CASES))
def test_the_gpu_finds_the_same_origin_op_and_hint_as_the_cpu(case: str, mode: str) -> None:
    cpu = origin_on("cpu", case, mode)
    gpu = origin_on("cuda", case, mode)
    assert cpu is not None
    assert gpu is not None
    fields = ("phase", "module", "module_type", "kind", "tensor", "op", "reproducible")
    assert {f: getattr(gpu, f) for f in fields} == {f: getattr(cpu, f) for f in fields}
    assert gpu.reproducible is not False  # None: a loss seen directly, with no replay
    assert (gpu.source is None) == (cpu.source is None)
    if cpu.stats is not None:
        assert gpu.stats is not None
        assert gpu.stats.device.startswith("cuda")
        assert gpu.stats.shape == cpu.stats.shape
        assert gpu.stats.dtype == cpu.stats.dtype
    assert gpu.hint is not None
    assert cpu.hint is not None
    # The same cause and advice, up to the numbers the device computed.
    assert without_numbers(gpu.hint) == without_numbers(cpu.hint)


def test_sentinel_replay_restores_the_cuda_rng_and_reproduces_dropout() -> None:
    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), LogFeatures(), nn.Linear(16, 1)
        ).cuda()

    x = torch.randn(8, 8, device="cuda")
    reference = make()
    torch.cuda.manual_seed(1)
    reference(x).sum().backward()
    expected_rng = torch.cuda.get_rng_state()

    guarded = make()
    torch.cuda.manual_seed(1)
    with nanguard.watch(guarded, mode="sentinel", on_nonfinite="log") as guard:
        guarded(x).sum().backward()
        guard.step()  # replays forward and backward with the same dropout mask
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.op, origin.reproducible) == ("3", "aten.log.default", True)
    assert torch.equal(torch.cuda.get_rng_state(), expected_rng)
    for (name, a), b in zip(
        reference.state_dict().items(), guarded.state_dict().values(), strict=True
    ):
        assert torch.equal(a.nan_to_num(), b.nan_to_num()), name
    for a, b in zip(reference.parameters(), guarded.parameters(), strict=True):
        assert a.grad is not None
        assert b.grad is not None
        assert torch.equal(a.grad.nan_to_num(), b.grad.nan_to_num())


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_cuda_autocast_fp16_overflow_names_the_projection(mode: str) -> None:
    model = Fp16MLP().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        with torch.autocast("cuda", dtype=torch.float16):
            out = model(fp16_input().float().cuda())
        out.float().mean().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "up", "inf")
    assert origin.stats is not None
    assert origin.stats.dtype == "torch.float16"  # the replay ran under autocast too
    assert origin.hint is not None
    assert "65504" in origin.hint


def test_cuda_grad_scaler_overflow_skips_are_expected_not_errors() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40)  # far too large: overflows
    x, y = torch.randn(32, 16, device="cuda") * 10, torch.randn(32, 4, device="cuda")
    with nanguard.watch(model, optimizer=opt, scaler=scaler) as guard:  # on_nonfinite="raise"
        for _ in range(30):
            amp_step(model, opt, scaler, x, y)
    skips = [e for e in guard.events if e.kind == "amp_overflow"]
    assert skips
    assert all(not e.is_origin for e in skips)
    assert guard.origin is None
    assert skips[0].details["scale_before"] == 2.0**40
    assert skips[0].details["scale_after"] == 2.0**39
    assert scaler.get_scale() < 2.0**40
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert guard.current_step == 30


def test_cuda_skip_step_keeps_the_weights_finite() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), PairwiseDistances(), nn.Linear(6, 1)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard:
        opt.zero_grad()
        model(torch.randn(6, 8, device="cuda")).pow(2).mean().backward()  # sqrt at 0
        opt.step()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "1")
    assert any(e.details.get("skipped") for e in guard.events)


def test_adam_on_fp16_cuda_parameters_corrupts_them_in_the_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)).half().cuda()
    x = torch.randn(32, 8).half().cuda()
    x[:, 5:] = 0  # features never active: their weights get exactly-zero gradients
    y = torch.randn(32, 1).half().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)  # eps=1e-8 underflows in float16
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(3):
            loss = guard.check_loss(nn.functional.mse_loss(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.step, origin.param) == ("param", 0, "0.weight")
    assert "became NaN in optimizer.step()" in origin.message


def test_inductor_on_cuda_reports_the_origin_without_graph_breaks() -> None:
    dynamo = pytest.importorskip("torch._dynamo")
    from torch._dynamo.utils import counters

    def compiled_step(guarded: bool) -> tuple[nanguard.Guard | None, dict[str, int]]:
        dynamo.reset()
        counters.clear()
        model = log_mlp().cuda()
        compiled = torch.compile(model, backend="inductor")
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        guard = nanguard.watch(compiled, optimizer=opt, on_nonfinite="log") if guarded else None
        try:
            compiled(torch.randn(16, 784, device="cuda")).pow(2).mean().backward()
            opt.step()
        finally:
            if guard is not None:
                guard.detach()
        return guard, dict(counters["graph_break"])

    _, plain = compiled_step(guarded=False)
    guard, guarded = compiled_step(guarded=True)
    assert guarded == plain == {}
    assert guard is not None
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "1", "aten.log.default")
