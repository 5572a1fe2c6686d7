"""The origin rules of the forward pass, on small models with real NaN causes."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from realistic import (
    Fp16MLP,
    GatedNet,
    LogFeatures,
    MaskedAttention,
    NormalizedEmbedding,
    fp16_input,
    log_mlp,
    var_model,
)
from torch import Tensor, nn

import nanguard


def run_step(model: nn.Module, *args: object, loss: bool = True, **options: object):
    """One forward (+ checked loss and backward) under a logging guard; returns the guard."""
    with nanguard.watch(model, on_nonfinite="log", **options) as guard:
        out = model(*args)
        if loss and isinstance(out, Tensor) and out.requires_grad:
            value = guard.check_loss(out.float().pow(2).mean())
            value.backward()
        guard.step()
    return guard


def test_log_of_negative_activations_names_the_log_layer() -> None:
    model = log_mlp()
    x = torch.randn(64, 784)
    expected = int(torch.isnan(torch.log(model[0](x))).sum())
    guard = run_step(model, x)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type, origin.kind) == (
        "forward",
        "1",
        "LogFeatures",
        "nan",
    )
    assert origin.is_origin
    assert origin.tensor == "output"
    assert origin.stats is not None
    assert origin.stats.nan_count == expected > 0
    assert origin.stats.shape == (64, 256)
    assert origin.stats.dtype == "torch.float32"
    assert origin.step == 0
    # Downstream modules only propagated it: one origin, the rest is_origin=False.
    assert [e.module for e in guard.events if e.is_origin] == ["1"]
    downstream = [e.module for e in guard.events if not e.is_origin and e.phase == "forward"]
    # The ReLU ("3") cannot create NaN: it is recorded as an alias, not a separate call.
    assert downstream == ["2", "4", ""]
    assert origin.n_propagated == 3
    assert origin.propagated == ("2", "4", "")
    loss_events = [e for e in guard.events if e.phase == "loss"]
    assert len(loss_events) == 1
    assert not loss_events[0].is_origin


def test_inputs_statistics_say_the_inputs_were_finite() -> None:
    guard = run_step(log_mlp(), torch.randn(64, 784))
    assert guard.origin is not None
    assert "its inputs were finite (args[0] in [" in guard.origin.message
    assert "Look at LogFeatures.forward" in guard.origin.message


def test_nan_in_the_input_batch_is_an_input_origin() -> None:
    model = log_mlp()
    x = torch.rand(16, 784) + 0.1
    x[3, 100] = float("nan")
    x[7, 5] = float("nan")
    guard = run_step(model, x)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("input", "", "Sequential")
    assert origin.tensor == "args[0]"
    assert origin.stats is not None
    assert origin.stats.nan_count == 2
    assert origin.stats.numel == 16 * 784
    assert "input batch already contains NaN" in origin.message
    assert "It is in samples 3, 7 (of 16 along dim 0)." in origin.message
    assert origin.message.lower().count("data pipeline") == 1  # said once
    # The first layer received it: propagated, not an origin.
    assert all(not e.is_origin for e in guard.events if e.module == "0")


def test_missing_values_in_many_samples_are_counted_not_only_listed() -> None:
    """Tabular features with 2% missing values (NaN) in one batch: the message gives how
    many samples hold them, not just the first few as if they were all."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(14, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 1))
    x = torch.randn(256, 14)
    missing = torch.rand(256, 14) < 0.02
    x[missing] = float("nan")
    rows = missing.any(1).nonzero().flatten().tolist()
    assert len(rows) > 8
    origin = run_step(model, x).origin
    assert origin is not None
    assert origin.phase == "input"
    first = ", ".join(str(i) for i in rows[:8])
    assert f"It is in {len(rows)} of 256 samples (along dim 0), the first: {first}." in (
        origin.message
    )


def test_inline_overflow_in_a_parents_forward_blames_the_parent() -> None:
    model = GatedNet()
    guard = run_step(model, torch.randn(32, 16) * 3)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type, origin.kind) == (
        "forward",
        "block",
        "ExpGate",
        "inf",
    )
    # Not the child that received the overflowed tensor.
    assert origin.tensor == "args[0] of block.out"
    assert origin.details["passed_to"] == "block.out"
    assert origin.details["reason"] == "own_code"
    assert origin.stats is not None
    assert origin.stats.posinf_count > 0
    assert origin.stats.nan_count == 0
    assert "own code of `block` (ExpGate.forward" in origin.message
    assert "before the call to `block.out`" in origin.message


def test_division_by_a_zero_norm_before_a_child_blames_the_parent() -> None:
    model = nn.Sequential(nn.Linear(8, 32, bias=False), NormalizedEmbedding(32))
    x = torch.randn(4, 8)
    x[2] = 0.0  # an all-zero sample: its norm is 0, 0/0 is NaN
    guard = run_step(model, x)
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.module_type, origin.kind) == ("1", "NormalizedEmbedding", "nan")
    assert origin.tensor == "args[0] of 1.proj"
    assert origin.stats is not None
    assert origin.stats.nan_count == 32


def test_fp16_overflow_names_the_projection_that_overflowed() -> None:
    model = Fp16MLP().half()
    guard = run_step(model, fp16_input(), loss=False)
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.module_type, origin.kind) == ("up", "Linear", "inf")
    # (torch's own forward is not where to look: what the layer was given and holds is)
    assert "Look at what this Linear was given and holds" in origin.message
    assert "Linear.forward" not in origin.message
    assert origin.stats is not None
    assert origin.stats.dtype == "torch.float16"
    assert origin.stats.posinf_count > 0
    # The ReLU passed the Inf on; down turned it into NaN (inf - inf): still propagated.
    later = {e.module: e for e in guard.events if not e.is_origin}
    assert later["down"].kind == "nan"
    assert origin.propagated == ("down", "")


class AutocastMLP(nn.Module):
    """GPT-2's MLP with its up-projection under float16 autocast (weights that grew large)."""

    def __init__(self) -> None:
        super().__init__()
        self.c_fc = nn.Linear(64, 256)
        self.c_proj = nn.Linear(256, 64)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            h = self.c_fc(x)
        return self.dropout(h.float()[..., :64])


class ResidualBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(64)
        self.mlp = AutocastMLP()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.ln(x))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_propagated_events_of_an_overflow_to_both_infinities_say_inf(mode: str) -> None:
    # +Inf and -Inf, no NaN, reach the parent and the model: the events say Inf (a sum
    # probe reads them as NaN), and the parent's event names its output, not the child's
    # argument it returned.
    torch.manual_seed(0)
    model = ResidualBlock()
    with torch.no_grad():
        model.mlp.c_fc.weight.mul_(2e5)
    with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard:
        out = model(torch.randn(4, 64))
        guard.step()
    assert not out.isnan().any()
    assert out.isinf().any()
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.kind) == ("mlp.c_fc", "inf")
    later = {e.module: e for e in guard.events if not e.is_origin}
    assert {m: e.kind for m, e in later.items()} == {
        "mlp.dropout": "inf",
        "mlp": "inf",
        "": "inf",
    }
    assert (later["mlp.dropout"].tensor, later["mlp"].tensor) == ("args[0]", "output")
    assert later["mlp"].message.startswith("nanguard: step 0: Inf reached `mlp` (AutocastMLP)")


def test_unbiased_variance_over_one_element_is_nan() -> None:
    model = var_model()
    with pytest.warns(UserWarning, match="degrees of freedom"):
        guard = run_step(model, torch.randn(1, 8))
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.module_type, origin.kind) == ("1", "PerSampleNorm", "nan")
    assert origin.stats is not None
    assert origin.stats.nan_count == 16


def test_fully_masked_attention_row_names_the_attention() -> None:
    attention = MaskedAttention()
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1] = False  # sample 1 has no visible token: softmax over an all -inf row
    guard = run_step(attention, torch.randn(2, 5, 16), keep)
    origin = guard.origin
    assert origin is not None
    # The softmax is in MaskedAttention's own code, so MaskedAttention (the model) is blamed.
    assert (origin.module, origin.module_type, origin.kind) == ("", "MaskedAttention", "nan")
    assert origin.tensor == "args[0] of out"
    assert origin.stats is not None
    assert origin.stats.nan_count == 5 * 16  # every query row of sample 1


def test_multihead_attention_with_a_fully_masked_row() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.ff = nn.Linear(16, 16)

        def forward(self, x: Tensor, mask: Tensor) -> Tensor:
            h, _ = self.attn(x, x, x, attn_mask=mask)
            return self.ff(h)

    mask = torch.zeros(5, 5)
    mask[2] = float("-inf")  # query 2 may attend to nothing
    guard = run_step(Encoder(), torch.randn(2, 5, 16), mask)
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.module_type, origin.kind) == ("attn", "MultiheadAttention", "nan")
    assert "fully masked" in origin.message
    assert "kwargs['attn_mask']" in origin.message


def test_leaf_beats_its_parents() -> None:
    class Inner(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.log = nn.Sequential(nn.Identity(), LogLeaf())

        def forward(self, x: Tensor) -> Tensor:
            return self.log(self.fc(x))

    class LogLeaf(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.log()

    model = nn.Sequential(nn.Sequential(Inner()), nn.Linear(4, 1))
    guard = run_step(model, torch.randn(8, 4))
    assert guard.origin is not None
    assert guard.origin.module == "0.0.log.1"
    assert guard.origin.module_type == "LogLeaf"


def test_shared_module_called_twice_is_told_apart_by_call_index() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shared = nn.Linear(8, 8)

        def forward(self, x: Tensor) -> Tensor:
            h = self.shared(x)  # 8.0 everywhere
            h = h * 1e37  # 8e37: finite in float32...
            return self.shared(h)  # ...but a sum of eight of them overflows

    model = Twice()
    with torch.no_grad():
        model.shared.weight.fill_(1.0)
        model.shared.bias.zero_()
    guard = run_step(model, torch.ones(4, 8), loss=False)
    origin = guard.origin
    assert origin is not None
    assert origin.module == "shared"
    assert origin.call == 1
    assert origin.where == "shared#1"
    assert "call 1" in origin.message


def test_loop_over_a_module_counts_calls() -> None:
    class Unrolled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cell = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            for _ in range(5):
                x = torch.exp(self.cell(x))  # grows until it overflows
            return x

    with torch.no_grad():
        model = Unrolled()
        model.cell.weight.fill_(1.0)
    guard = run_step(model, torch.ones(2, 4), loss=False)
    origin = guard.origin
    assert origin is not None
    # exp happens in the parent's own code; the overflow reaches cell's input on call k.
    assert origin.module == ""
    assert origin.tensor.startswith("args[0] of cell#")


def test_loss_created_nan_is_a_loss_origin() -> None:
    model = nn.Sequential(nn.Linear(8, 4), nn.Softmax(dim=-1))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        probs = model(torch.randn(16, 8))
        target = torch.zeros(16, 4)
        target[:, 1] = 1
        # A hand-written cross-entropy that takes log(1 - p) of a saturated softmax.
        loss = -(target * torch.log(probs - probs)).sum() / 16
        guard.check_loss(loss)
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.is_origin) == ("loss", None, True)
    assert origin.tensor == "loss"
    assert origin.stats is not None
    assert origin.stats.nan_count == 1
    assert "the loss function created it" in origin.message


def test_non_finite_loss_from_non_finite_outputs_is_propagated() -> None:
    guard = run_step(log_mlp(), torch.randn(8, 784))
    loss_events = [e for e in guard.events if e.phase == "loss"]
    assert [e.is_origin for e in loss_events] == [False]
    assert guard.origin is not None
    assert guard.origin.phase == "forward"


@dataclasses.dataclass
class Out:
    hidden: Tensor
    extra: dict[str, Tensor]
    count: int


Pair = collections.namedtuple("Pair", ["logits", "aux"])


@pytest.mark.parametrize(
    ("wrap", "tensor"),
    [
        (lambda t: (t.new_ones(2), t), "output[1]"),
        (lambda t: [None, {"a": t}], "output[1]['a']"),
        (lambda t: Out(t.new_ones(1), {"bad": t}, 3), "output.extra['bad']"),
        (lambda t: Pair(t.new_zeros(1), t), "output.aux"),
        (lambda t: {"ids": torch.ones(2, dtype=torch.long), "x": t}, "output['x']"),
    ],
)
def test_outputs_of_every_shape_are_checked(wrap, tensor: str) -> None:
    class Structured(nn.Module):
        def forward(self, x: Tensor) -> object:
            return wrap(torch.log(x))

    model = nn.Sequential(nn.Linear(3, 3), Structured())
    guard = run_step(model, torch.randn(4, 3), loss=False)
    assert guard.origin is not None
    assert guard.origin.module == "1"
    assert guard.origin.tensor == tensor


def test_hugging_face_style_model_output() -> None:
    class ModelOutput(collections.OrderedDict):  # the shape of transformers' ModelOutput
        pass

    class HFLike(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, input_ids: Tensor) -> ModelOutput:
            h = self.fc(input_ids.float())
            return ModelOutput(logits=torch.log(h - h - 1.0))  # log(-1)

    guard = run_step(HFLike(), torch.ones(2, 4, dtype=torch.long), loss=False)
    assert guard.origin is not None
    assert (guard.origin.module, guard.origin.tensor) == ("", "output.logits")


def test_integer_bool_empty_and_none_outputs_are_fine() -> None:
    class Odd(nn.Module):
        def forward(self, x: Tensor) -> object:
            return (x.argmax(-1), x > 0, x[:0], None, "text", 3, x)

    guard = run_step(nn.Sequential(nn.Linear(4, 4), Odd()), torch.randn(2, 4), loss=False)
    assert guard.events == []


def test_complex_outputs_are_checked() -> None:
    class Spectrum(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return torch.fft.rfft(x) / torch.zeros(())

    guard = run_step(Spectrum(), torch.randn(2, 8), loss=False)
    assert guard.origin is not None
    assert guard.origin.stats is not None
    assert guard.origin.stats.dtype == "torch.complex64"


def test_realistic_size_localises_a_single_bad_element() -> None:
    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(1024, 1024)
            self.b = nn.Linear(1024, 1024)
            self.c = nn.Linear(1024, 1024)

        def forward(self, x: Tensor) -> Tensor:
            h = self.a(x)
            h = self.b(h)
            h = h.clone()
            h[1000, 17] = h[1000, 17] / 0.0 * 0.0  # one NaN among four million values
            return self.c(h)

    model = Big()
    guard = run_step(model, torch.randn(4096, 1024), loss=False)
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.tensor) == ("", "args[0] of c")
    assert origin.stats is not None
    assert origin.stats.numel == 4096 * 1024
    assert origin.stats.nan_count == 1


class Imputing(nn.Module):
    """Tabular model that takes missing values as NaN and imputes them itself."""

    def __init__(self) -> None:
        super().__init__()
        self.fill = nn.Parameter(torch.zeros(8))
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: Tensor) -> Tensor:
        missing = torch.isnan(x)
        x = torch.where(missing, self.fill.expand_as(x), x)
        return self.mlp(torch.cat([x, missing.float()], -1))


def test_nan_in_the_batch_that_the_model_imputes_is_not_an_error() -> None:
    torch.manual_seed(0)
    model = Imputing()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="raise") as guard:
        for _ in range(5):
            x = torch.randn(16, 8)
            x[torch.rand(16, 8) < 0.1] = float("nan")
            loss = guard.check_loss(model(x).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_nan_in_the_batch_that_reaches_the_output_is_an_input_origin() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    x = torch.randn(16, 8)
    x[3, 2] = float("nan")
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(x).pow(2).mean()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor, origin.kind) == (
        "input",
        "",
        "args[0]",
        "nan",
    )
    assert origin.stats is not None
    assert origin.stats.nan_count == 1


class RadiusFeatures(nn.Module):
    """Appends each row's radius, computed in the model's own code, before its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(9, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        radius = z.pow(2).sum(-1, keepdim=True).sqrt()
        return self.net(torch.cat([z, radius], -1))


def test_nan_in_the_batch_passed_on_by_the_models_own_code_is_an_input_origin() -> None:
    torch.manual_seed(0)
    model = RadiusFeatures()
    z = torch.randn(4, 8)
    z[2] = float("nan")  # a latent code that went NaN upstream of the model
    guard = run_step(model, z)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == ("input", "", "args[0]")
    assert all(not e.is_origin for e in guard.events if e.phase == "forward")


def test_an_average_pool_whose_sum_overflows_is_the_origin() -> None:
    # Exploded but finite activations (1e36): the 64x64 average sums past float32's max.
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten()
    )
    with torch.no_grad():
        model[0].weight.fill_(1e36)
        model[0].bias.zero_()
    with nanguard.watch(model, on_nonfinite="log") as guard, torch.no_grad():
        model(torch.rand(2, 3, 64, 64) + 0.5)
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "2")
    assert origin.module_type == "AdaptiveAvgPool2d"


class TwoPartVAE(nn.Module):
    """Used through its parts: the training loop calls encode, its own reparameterisation,
    then the decoder; forward() is never called."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(16, 8)
        self.dec = nn.Sequential(nn.Linear(4, 16), nn.Tanh())


def test_a_value_made_between_directly_called_submodules_is_not_called_data() -> None:
    torch.manual_seed(0)
    model = TwoPartVAE()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        mu, logvar = model.enc(torch.randn(32, 16)).chunk(2, dim=-1)
        z = mu + torch.exp(0.5 * logvar * 1e3) * torch.randn_like(mu)  # exp overflows
        guard.check_loss(model.dec(z).pow(2).mean()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("input", "dec")
    assert "called on its own" in origin.message
    assert "data pipeline" not in origin.message


class SwiGLU(nn.Module):
    """A Llama-style MLP: gate and up read the same input, so in float16 both can overflow."""

    def __init__(self, dim: int = 128, hidden: int = 256) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_sibling_that_overflows_on_its_own_is_an_origin_too(mode: str) -> None:
    # Fixing only `gate` (keeping it in float32) would fail again at `up`: both are named.
    model = SwiGLU()
    with torch.no_grad():
        model.gate.weight.fill_(1.0)  # 128 inputs of ~600: sums past 65504
        model.up.weight.fill_(1.0)
    model.half()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:
        model(fp16_input()).float().mean().backward()
        opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.module, e.phase, e.kind) for e in origins] == [
        ("gate", "forward", "inf"),
        ("up", "forward", "inf"),
    ]
    assert guard.origin == origins[0]
    assert "was also made, independently, in the forward pass, in `up`" in origins[1].message
    assert "its inputs were finite" in origins[1].message
    assert origins[1].hint is not None
    assert "65504" in origins[1].hint
    down = next(e for e in guard.events if e.module == "down" and e.phase == "forward")
    assert not down.is_origin
    assert "created earlier, in `gate`" in down.message
    assert "up" not in origins[0].propagated


def test_a_parent_whose_child_made_the_value_is_not_a_second_origin() -> None:
    # The model's inputs are finite and its output is not, but the value was made inside it.
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8), LogFeatures()))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(16, 8)).sum().backward()
        guard.step()
    assert [e.module for e in guard.events if e.is_origin] == ["1.1"]


class Expert(nn.Module):
    """A Mixtral expert: the SwiGLU product is computed in the expert's own code."""

    def __init__(self, dim: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class RoutedBlock(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, 4, bias=False)
        self.expert = Expert(dim)

    def forward(self, x: Tensor) -> Tensor:
        logits = self.gate(x)
        weight = nn.functional.softmax(logits, dim=-1, dtype=torch.float)[:, :1].to(x.dtype)
        return self.expert(x) * weight  # the routing weight scales the expert's output


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_second_overflow_in_a_parents_own_code_is_an_origin_too(mode: str) -> None:
    # In float16 the router overflows, and independently so does the expert's product of
    # two finite projections (384 * 384): routing in float32 alone would not fix the step.
    model = RoutedBlock()
    with torch.no_grad():
        model.gate.weight.fill_(600.0)
        model.expert.w1.weight.fill_(3.0)
        model.expert.w3.weight.fill_(3.0)
    with nanguard.watch(model, on_nonfinite="log", mode=mode) as guard:
        with torch.autocast("cpu", dtype=torch.float16):
            model(torch.full((4, 16), 8.0))
        guard.check()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.module, e.tensor, e.kind) for e in origins] == [
        ("gate", "output", "inf"),
        ("expert", "args[0] of expert.w2", "inf"),
    ]
    assert "was also made, independently, in the own code of `expert`" in origins[1].message
    assert origins[1].op == "aten.mul.Tensor"


class MemoryDecoder(nn.Module):
    """Reads the encoder's output from an attribute its parent set (not an argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.memory: Tensor | None = None
        self.proj = nn.Linear(8, 8)
        self.out = nn.Linear(8, 1)

    def forward(self, tgt: Tensor) -> Tensor:
        assert self.memory is not None
        return self.out(torch.relu(self.proj(tgt + self.memory.amax(1, keepdim=True))))


class ExpFeatures(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.exp(x)


class EncoderDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(8, 8), ExpFeatures())
        self.decoder = MemoryDecoder()

    def forward(self, src: Tensor, tgt: Tensor) -> Tensor:
        self.decoder.memory = self.encoder(src)
        return self.decoder(tgt)


@pytest.mark.parametrize("replay", [True, False])
def test_state_read_from_an_attribute_is_no_second_origin(replay: bool) -> None:
    # The decoder's own code passes on the encoder's +Inf, read from self.memory: one
    # origin (with replay=False there is no operation to tell it was made there).
    torch.manual_seed(0)
    model = EncoderDecoder()
    with nanguard.watch(model, on_nonfinite="log", replay=replay) as guard:
        src, tgt = torch.randn(4, 5, 8) * 400, torch.randn(4, 5, 8)
        guard.check_loss(model(src, tgt).pow(2).mean()).backward()
        guard.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.module, e.kind) for e in origins] == [("encoder.1", "inf")]


class LogScaleTracker(nn.Module):
    """Normalises by a running log-scale kept as a plain attribute, updated under no_grad
    after its use."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = torch.zeros(4)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.lin(x - self.mu)
        with torch.no_grad():
            self.mu = 0.9 * self.mu + 0.1 * torch.log(x.abs().amax(0) - 1.0)
        return y


def test_state_kept_in_a_plain_attribute_is_named_when_it_was_already_non_finite() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(LogScaleTracker(), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for step in range(4):
            x = torch.randn(16, 4) * 3
            if step == 2:
                x[:, 1] = 0.5  # log of a negative: mu goes NaN, after its use this step
            loss = guard.check_loss(model(x).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.module, origin.tensor) == (3, "0", "args[0] of 0.lin")
    assert origin.details["nonfinite_attributes"] == ["mu"]
    assert "Its attribute `mu` (a plain tensor, not a parameter or buffer)" in origin.message


class KeepsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.last: Tensor | None = None

    def forward(self, x: Tensor) -> Tensor:
        h = torch.log(x)  # NaN for negative inputs: made here, this call
        self.last = h.detach()
        return self.lin(h)


def test_an_attribute_that_only_keeps_this_calls_value_is_not_blamed() -> None:
    model = nn.Sequential(nn.Linear(4, 4), KeepsLast())
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(torch.randn(8, 4)).sum()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.op) == ("1", "aten.log.default")
    assert "nonfinite_attributes" not in origin.details


def test_the_output_of_a_parent_that_made_the_nan_is_not_said_to_come_from_earlier() -> None:
    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.log(self.a(x) - 10))  # NaN between its children

    model = nn.Sequential(Parent(), nn.Linear(4, 2))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randn(3, 4)).sum().backward()
        guard.step()
    assert guard.origin is not None
    assert guard.origin.module == "0"
    (own,) = [e for e in guard.events if e.module == "0" and not e.is_origin]
    assert "created earlier" not in own.message
    assert "reached the output of `0` (Parent), made in its own code" in own.message
