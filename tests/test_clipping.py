"""The gradient-norm guard under ``clip_grad_norm_``: it judges the norm before clipping.

Nearly every real training loop clips (nanoGPT, the HF Trainer, Lightning's
``gradient_clip_val``). The guard reads the gradients at ``optimizer.step()``, after
the clip: without help, a norm that jumped a million times would read as ``max_norm``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.utils.clip_grad as clip_grad_module
from torch import nn
from torch.nn.utils import clip_grad_norm_ as imported_before_watch

import nanguard


def regression_run(
    clip,
    *,
    spike_at: int | None = 100,
    steps: int = 120,
    watch_kwargs: dict | None = None,
    model: nn.Module | None = None,
):
    """A small regression trained with SGD, clipping every step with ``clip(model)``; the
    batch at ``spike_at`` is corrupt (scaled by 1e4: a gradient spike)."""
    torch.manual_seed(0)
    model = model or nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(256, 32)
    y = x[:, :1] * 3
    norms = []
    kwargs = {"optimizer": opt, "on_nonfinite": "log", **(watch_kwargs or {})}
    with nanguard.watch(model, **kwargs) as guard:
        for step in range(steps):
            xb = x * 1e4 if step == spike_at else x
            loss = nn.functional.mse_loss(model(xb), y)
            opt.zero_grad()
            loss.backward()
            norms.append(float(clip(model)))
            opt.step()
    return guard, norms


def spikes(guard: nanguard.Guard) -> list[nanguard.Event]:
    return [e for e in guard.events if e.kind == "grad_norm"]


def test_a_spike_hidden_by_clip_grad_norm_is_reported_with_the_norm_before_clipping() -> None:
    guard, norms = regression_run(lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0))
    (event,) = spikes(guard)
    assert event.step == 100
    assert event.details["reason"] == "spike"
    assert event.details["norm"] == pytest.approx(norms[100], rel=1e-4)
    assert event.details["reference"] == pytest.approx(sorted(norms[50:100])[25], rel=0.05)
    assert event.details["clipped_to"] == 1.0
    assert event.details["norm_after_clipping"] == pytest.approx(1.0, rel=1e-3)
    # Each weight's norm is given before clipping too: they add up to the total.
    top = dict(event.details["top"])
    assert set(top) >= {"0.weight", "2.weight", "4.weight"}
    assert math.sqrt(sum(v * v for v in top.values())) == pytest.approx(norms[100], rel=1e-3)
    assert f"jumped to {norms[100]:.4g}" in event.message
    assert "before clip_grad_norm_" in event.message
    assert "scaled the gradients down to 1" in event.message
    # (advice fit for a run that clips already)
    assert "clip gradients (torch.nn.utils.clip_grad_norm_)" not in event.message
    assert "bad batch" in event.message


def test_a_healthy_run_clipped_every_step_is_silent() -> None:
    # max_norm far below the run's norms: every step is clipped, none is a spike.
    guard, norms = regression_run(
        lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01), spike_at=None
    )
    assert min(norms) > 0.01
    assert guard.events == []
    history = list(guard._resolver.monitor.history)
    assert history[-1] == pytest.approx(norms[-1], rel=1e-4)  # the norms before clipping


@pytest.mark.parametrize(
    "how",
    ["imported_before_watch", "module_attribute", "total_norm_then_clip_grads_with_norm_"],
)
def test_every_way_of_clipping_is_seen(how: str) -> None:
    def clip(model: nn.Module) -> torch.Tensor:
        params = list(model.parameters())
        if how == "imported_before_watch":  # `from torch.nn.utils import clip_grad_norm_`
            return imported_before_watch(params, 1.0)
        if how == "module_attribute":
            return clip_grad_module.clip_grad_norm_(params, 1.0)
        # torchtitan's way: the norm, then clipping with it (a generator of parameters)
        total = torch.nn.utils.get_total_norm([p.grad for p in params])
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, total)
        return total

    guard, norms = regression_run(clip)
    (event,) = spikes(guard)
    assert event.step == 100
    assert event.details["norm"] == pytest.approx(norms[100], rel=1e-4)
    # ...and the gradients were clipped all the same
    assert event.details["norm_after_clipping"] == pytest.approx(1.0, rel=1e-3)


def test_the_threshold_applies_to_the_norm_before_clipping() -> None:
    guard, norms = regression_run(
        lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0),
        spike_at=None,
        steps=5,
        watch_kwargs={"grad_norm_threshold": 1.2, "param_norm_threshold": 0.9},
    )
    assert norms[0] > 1.2  # the run's norms are above both, clipped to 1.0
    (threshold,) = [e for e in spikes(guard) if e.details["reason"] == "threshold"]
    assert threshold.step == 0
    assert threshold.details["norm"] == pytest.approx(norms[0], rel=1e-4)
    # The weights whose own gradient norm passed 0.9 before clipping (about 0.6 after).
    named = {e.module for e in spikes(guard) if e.details["reason"] == "param_threshold"}
    assert named == {"2", "4"}


def test_a_clip_of_another_models_weights_is_not_taken_for_this_ones() -> None:
    # A GAN: the discriminator's gradients are clipped, the generator's are not.
    torch.manual_seed(0)
    gen, disc = nn.Linear(8, 8), nn.Linear(8, 1)
    g_opt = torch.optim.SGD(gen.parameters(), lr=0.01)
    own = []
    with nanguard.watch(gen, optimizer=g_opt) as guard:
        for _ in range(30):
            (disc(gen(torch.randn(64, 8))) ** 2).mean().backward()
            torch.nn.utils.clip_grad_norm_(disc.parameters(), 1e-6)
            own.append(float(torch.nn.utils.get_total_norm([p.grad for p in gen.parameters()])))
            g_opt.step()
            g_opt.zero_grad()
            disc.zero_grad()
    assert guard.events == []
    history = list(guard._resolver.monitor.history)
    assert history == pytest.approx(own, rel=1e-4)  # the generator's own norms


def test_torch_function_is_put_back_on_every_exit() -> None:
    original = clip_grad_module._clip_grads_with_norm_
    public = torch.nn.utils.clip_grads_with_norm_
    model = nn.Linear(4, 1)
    with nanguard.watch(model):
        assert clip_grad_module._clip_grads_with_norm_ is not original
        with nanguard.watch(nn.Linear(4, 1)):  # two guards: one wrapper
            pass
        assert clip_grad_module._clip_grads_with_norm_ is not original
    assert clip_grad_module._clip_grads_with_norm_ is original
    assert torch.nn.utils.clip_grads_with_norm_ is public
    with pytest.raises(ZeroDivisionError), nanguard.watch(model):
        1 / 0  # noqa: B018
    assert clip_grad_module._clip_grads_with_norm_ is original
    # Without the gradient-norm guard too (a NaN total norm makes every gradient NaN: a
    # failing step needs to know), and put back as well.
    with nanguard.watch(model, grad_norm=False):
        assert clip_grad_module._clip_grads_with_norm_ is not original
    assert clip_grad_module._clip_grads_with_norm_ is original


def test_clipping_by_another_norm_type_falls_back_to_the_guards_own_norm() -> None:
    # An inf-norm clip's total is no L2 norm: the guard keeps its own (after clipping).
    def clip(model: nn.Module) -> torch.Tensor:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type=math.inf)
        return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])

    guard, norms = regression_run(clip, spike_at=None, steps=10)
    assert list(guard._resolver.monitor.history) == pytest.approx(norms, rel=1e-4)
    assert guard.events == []


def test_a_nan_gradient_is_still_found_at_its_origin_when_clipping() -> None:
    # A distance between identical points: sqrt's backward at 0. clip_grad_norm_ by the
    # NaN total norm puts NaN in every gradient; the origin is named, and no spike claimed.
    class Siamese(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Linear(4, 4)

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            return torch.sqrt(((self.embed(a) - self.embed(b)) ** 2).sum(-1))

    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    a = torch.randn(8, 4)
    b = a.clone()
    b[1:] += 1  # the first pair is the same point
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step") as guard:
        model(a, b).mean().backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert torch.isnan(total)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "", "Siamese")
    assert "SqrtBackward0" in origin.message
    assert spikes(guard) == []
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the step was skipped


class Schedule(nn.Module):
    """A VDM-style learned noise schedule: gamma(t) = b + |w| t."""

    def __init__(self) -> None:
        super().__init__()
        self.b = nn.Parameter(torch.tensor(-13.3))
        self.w = nn.Parameter(torch.tensor(33.3))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return self.b + self.w.abs() * t


class VDM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unet = nn.Sequential(nn.Linear(17, 64), nn.SiLU(), nn.Linear(64, 16))
        self.gamma = Schedule()

    def forward(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        var = torch.sigmoid(self.gamma(t))[:, None]  # sigmoid(20) is exactly 1.0 in float32
        xt = torch.sqrt(1 - var) * x0 + torch.sqrt(var) * noise  # sqrt's backward at 0
        return self.unet(torch.cat([xt, t[:, None]], 1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_gradients_made_nan_by_clipping_by_a_nan_norm_are_told_apart(mode: str) -> None:
    torch.manual_seed(0)
    model = VDM()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x0, noise, t = torch.randn(8, 16), torch.randn(8, 16), torch.rand(8)
    t[0] = 1.0
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = guard.check_loss(((model(x0, t, noise) - noise) ** 2).mean())
        opt.zero_grad()
        loss.backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    assert torch.isnan(total)
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "backward"
    assert origin.op == "aten.div.Tensor in SqrtBackward0"
    grads = [e for e in guard.events if e.phase == "grad"]
    # The schedule's two gradients went bad in the backward; the UNet's only in clipping.
    assert {e.param for e in grads} == {"gamma.b", "gamma.w"}
    assert all(e.details["bad_parameters"] == 2 for e in grads)
    made = grads[0].details["made_nonfinite_by_clipping"]
    assert set(made) == {"unet.0.weight", "unet.0.bias", "unet.2.weight", "unet.2.bias"}
    assert "finite until clip_grad_norm_ scaled them by max_norm / NaN" in grads[0].message


def test_a_spike_right_after_a_step_the_user_skipped_is_reported() -> None:
    # fairseq / Megatron: a non-finite clip norm skips optimizer.step(); the next step's
    # spike is judged by its own clip, not the dropped step's NaN one.
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.relu(self.a(x)))

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(115):
            x = torch.randn(64, 16, generator=gen)
            y = x[:, :1] * 2
            if step == 110:
                x[5, 3] = float("nan")  # a corrupt sample
            if step == 111:
                x[3] *= 60.0  # an unnormalised sample: a spike
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not torch.isfinite(norm):
                opt.zero_grad()
                continue  # skip this update
            opt.step()
    assert guard.origin is not None
    assert guard.origin.phase == "input"
    (spike,) = spikes(guard)
    assert spike.details["clipped_to"] == 1.0
    assert spike.details["norm"] > 10 * spike.details["reference"]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_skip_step_keeps_the_update_after_a_batch_the_loop_dropped_after_its_backward(
    mode: str,
) -> None:
    """fairseq / timm: a non-finite clip norm and the loop zeroes the gradients and moves
    on. The next batch's update is finite and goes ahead; the running statistics the NaN
    batch wrote are put back, so the model ends as an unguarded run that never saw that
    batch's effects on the weights (whose BatchNorm is finite)."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 4),
        )  # fmt: skip
        return model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

    def batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(8, 3, 8, 8, generator=gen)
        if i == 5:
            x[0, 0, 0, 0] = float("nan")  # a corrupt pixel
        return x, torch.randint(0, 4, (8,), generator=gen)

    def train(model: nn.Module, opt: torch.optim.Optimizer, drop: int = -1) -> list[int]:
        applied = []
        for i in range(8):
            if i == drop:
                continue
            x, y = batch(i)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not torch.isfinite(norm):
                opt.zero_grad()
                continue  # the loop's own skip
            opt.step()
            applied.append(i)
        return applied

    model, opt = make()
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step", mode=mode) as guard:
        applied = train(model, opt)
    assert applied == [0, 1, 2, 3, 4, 6, 7]
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (5, "input")
    assert not any(e.details.get("skipped") for e in guard.events)
    (note,) = [e for e in guard.events if e.details.get("loop_dropped")]
    assert "the optimizer step went ahead (on_nonfinite='skip_step')" in note.message
    assert note.details["restored"] == ["1.running_mean", "1.running_var"]
    buffers = [e for e in guard.events if e.phase == "param" and e.details.get("buffer")]
    assert buffers  # (told as they went NaN: put back, not kept)
    for event in buffers:
        assert "on_nonfinite='skip_step' puts the running statistics back" in event.message
        assert "Running statistics keep it" not in event.message
    assert torch.isfinite(model[1].running_mean).all()
    # The weights (and momentum) are those of an unguarded run that never saw batch 5.
    # (Its running statistics put back at step 5's end lose batch 6's update with them.)
    reference, ref_opt = make()
    train(reference, ref_opt, drop=5)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_skip_step_still_drops_a_step_whose_gradients_the_loop_sanitised(mode: str) -> None:
    """NVIDIA EDM's loop: nan_to_num on every gradient before opt.step(). The gradients are
    finite then, but they are the corrupt batch's own: the step is dropped (the loop did not
    drop that batch, nothing zeroed its gradients)."""

    def make() -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.GroupNorm(4, 16), nn.SiLU(),
                              nn.Conv2d(16, 3, 3, padding=1))  # fmt: skip
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)

    def train(model: nn.Module, opt: torch.optim.Optimizer, drop: int = -1) -> None:
        gen = torch.Generator().manual_seed(1)
        for i in range(6):
            x = torch.randn(8, 3, 16, 16, generator=gen)
            noise = 0.5 * torch.randn(8, 3, 16, 16, generator=gen)
            if i == drop:
                continue
            if i == 3:
                x[2, :, 4:8] = float("nan")  # a corrupt image
            noisy = x + noise
            loss = (model(noisy) - x).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            for p in model.parameters():
                torch.nan_to_num(p.grad, nan=0, posinf=1e5, neginf=-1e5, out=p.grad)
            opt.step()

    model, opt = make()
    with nanguard.watch(model, optimizer=opt, on_nonfinite="skip_step", mode=mode) as guard:
        train(model, opt)
    reference, ref_opt = make()
    train(reference, ref_opt, drop=3)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    assert [e.step for e in guard.events if e.details.get("skipped")] == [3]
    assert not any(e.details.get("loop_dropped") for e in guard.events)
    assert "zero_grad" not in opt.__dict__  # (observed while attached only)


def test_clips_of_steps_that_never_end_are_not_kept() -> None:
    # A manual update without an optimizer (p -= lr * p.grad) never ends a step.
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        for _ in range(200):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
                    p.grad = None
        assert len(guard._resolver.clips) == 1


class Siamese(nn.Module):
    """Verification net: the embedding distance (sqrt of a squared distance) is computed in
    a reentrant checkpoint; a pair holding the same image twice has distance 0, and
    SqrtBackward0 makes NaN there."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        self.head = nn.Linear(1, 1)

    @staticmethod
    def distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ((a - b) ** 2).sum(-1).sqrt()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        d = checkpoint(self.distance, self.encoder(a), self.encoder(b), use_reentrant=True)
        return self.head(d[:, None]).squeeze(1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_clipped_reentrant_checkpoint_nan_names_no_module_in_either_mode(mode: str) -> None:
    # Two micro-batches, then clip_grad_norm_ by the NaN total norm: every .grad is NaN, so
    # no module's parameters tell which backward made it (the head's are NaN by clipping).
    torch.manual_seed(0)
    model = Siamese()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for _ in range(2):  # micro-batches
            a, b = torch.randn(8, 32), torch.randn(8, 32)
            b[3] = a[3]  # the same image twice
            same = (torch.arange(8) % 2).float()
            loss = nn.functional.binary_cross_entropy_with_logits(model(a, b), same) / 2
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert len(origins) == 1
    assert origins[0].phase == "grad"
    assert origins[0].module != "head"
    assert "clip_grad_norm_" in origins[0].message


class RBF(nn.Module):
    """Gaussian RBF layer over a hand-written distance, its centres taken from training
    samples: a batch holding one has distance exactly 0, and SqrtBackward0 gives 0 * inf."""

    def __init__(self, centers: torch.Tensor) -> None:
        super().__init__()
        self.centers = nn.Parameter(centers.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = torch.sqrt(((x[:, None, :] - self.centers[None]) ** 2).sum(-1))
        return torch.exp(-0.5 * d)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_backward_origin_in_own_parameters_survives_a_nan_clip(mode: str) -> None:
    # The replay recomputes the gradients: the RBF's own ones were NaN before clipping.
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 4, generator=gen), torch.randint(0, 3, (64,), generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), RBF(x[:10]), nn.Linear(10, 3))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(4))
        model[0].bias.zero_()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        loss = guard.check_loss(nn.functional.cross_entropy(model(x[:16]), y[:16]))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with pytest.raises(nanguard.NonFiniteError) as info:
            opt.step()
    origin = info.value.event
    assert (origin.phase, origin.module) == ("backward", "1")
    assert origin.op is not None
    assert "SqrtBackward0" in origin.op
    assert all(torch.isfinite(p).all() for p in model.parameters())


class ProtoHead(nn.Module):
    """logits = -||f - prototype||: sqrt's slope is Inf where a prototype equals a feature."""

    def __init__(self, d: int, classes: int) -> None:
        super().__init__()
        self.protos = nn.Parameter(torch.randn(classes, d))

    def forward(self, f: torch.Tensor) -> torch.Tensor:
        return -(f.unsqueeze(1) - self.protos).pow(2).sum(-1).sqrt()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_strict_clip_that_raises_on_nan_gradients_carries_their_origin(mode: str) -> None:
    # clip_grad_norm_(error_if_nonfinite=True) raises before any optimizer step: a loop that
    # catches it skips the batch and zeroes gradients nanguard would never have read.
    torch.manual_seed(0)
    torchs = clip_grad_module._get_total_norm
    body = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
    model = nn.Sequential(body, ProtoHead(16, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 8), torch.randint(0, 10, (16,))
    with torch.no_grad():
        model[1].protos[:] = body(x)[:10]  # a data-dependent prototype initialisation
    skipped = []
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for _ in range(2):
            loss = guard.check_loss(torch.nn.functional.cross_entropy(model(x), y))
            opt.zero_grad()
            loss.backward()
            try:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, error_if_nonfinite=True)
            except RuntimeError as error:  # torch's own error, as it was
                skipped.append(error)
                opt.zero_grad()
                continue
            opt.step()
    assert len(skipped) == 2
    assert any("in the backward of `1` (ProtoHead)" in n for n in skipped[0].__notes__)
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (0, "backward", "1")
    assert clip_grad_module._get_total_norm is torchs  # (put back)
