"""Hints that reviewers found misleading: an exploding causal GPT whose attention overflows
(not a masked row), an entropy term whose torch.where hides log(0) = -inf from the forward
but not from the backward, and GeM pooling whose learnable exponent's derivative takes the
log of a zero base. Each model really has its cause; the hints that were right before stay."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import nanguard
from nanguard import TensorStats
from nanguard._hints import HintContext, OpInfo, hint

MASKED = "every position is masked"
UNKNOWN = "nanguard does not recognise this pattern"


def run(
    model: nn.Module,
    batches: list[tuple[Tensor, Tensor]],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    scheduler_gamma: float | None = None,
    **options: object,
) -> nanguard.Guard:
    """Train on ``batches`` under ``on_nonfinite="log"``, stopping at the first origin."""
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=0.0)
    sched = (
        torch.optim.lr_scheduler.ExponentialLR(opt, scheduler_gamma) if scheduler_gamma else None
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gradient-norm spike warns before the origin
        with nanguard.watch(model, optimizer=opt, on_nonfinite="log", **options) as guard:  # type: ignore[arg-type]
            for x, y in batches:
                loss = guard.check_loss(loss_fn(model(x), y))
                opt.zero_grad()
                loss.backward()
                opt.step()
                if sched is not None:
                    sched.step()
                if guard.origin is not None:
                    break
    return guard


# --- attention that overflows is not a masked row -------------------------------------------


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = (
            h.view(b, t, self.heads, c // self.heads).transpose(1, 2)
            for h in self.qkv(x).split(c, -1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # no row is ever all masked
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, 4)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, context: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def lm_loss(logits: Tensor, y: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


@pytest.mark.parametrize(
    ("vocab", "d", "layers", "context", "seed"),
    [
        pytest.param(50, 32, 2, 32, 1, id="backward-of-sdpa"),  # recomputed exp(s - lse) overflows
        pytest.param(32, 16, 1, 16, 0, id="forward-sdpa"),  # the scores themselves overflow
    ],
)
def test_an_exploding_causal_gpt_gets_an_overflow_hint_not_a_masked_row(
    vocab: int, d: int, layers: int, context: int, seed: int
) -> None:
    # SGD with a learning rate that grows 15% a step: the gradient norm spikes, then q and k
    # explode until the attention's softmax overflows. The causal mask hides no whole row.
    torch.manual_seed(seed)
    model = GPT(vocab, d, layers, context)
    data = torch.randint(0, vocab, (64, context + 1))
    batches = [
        (s[:, :-1], s[:, 1:]) for s in (data[torch.randint(0, 64, (16,))] for _ in range(100))
    ]
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    origin = run(model, batches, lm_loss, opt, scheduler_gamma=1.15).origin
    assert origin is not None
    assert origin.module is not None
    assert origin.hint is not None
    assert "exploding" in origin.hint
    assert "gradient norm spiked at step" in origin.hint
    assert "learning rate" in origin.hint
    assert MASKED not in origin.hint
    assert "fully masked" not in origin.hint
    # Which op overflows first in a diverging run depends on the kernels (torch version,
    # threads, the CPU's vector width): the attention's softmax or a LayerNorm's variance.
    assert origin.module.endswith((".attn", ".ln1", ".ln2")) or origin.module == "ln"
    if origin.module.endswith(".attn"):
        assert origin.op is not None
        assert "scaled_dot_product" in origin.op
        assert "overflow the softmax (not a masked row)" in origin.hint


def sdpa_ctx(q: float, k: float, *, backward: bool, **kw: object) -> HintContext:
    def st(*values: float) -> TensorStats:
        return TensorStats.of(torch.tensor(values))

    name = "aten._scaled_dot_product_flash_attention_for_cpu"
    inputs = (st(1e-3), st(q), st(k), st(1.0), st(1.0), st(5.0)) if backward else (st(q), st(k))
    op = OpInfo(
        f"{name}_backward.default" if backward else f"{name}.default",
        inputs,
        st(float("nan"), 1.0),
        direction="backward" if backward else "forward",
        node="ScaledDotProductFlashAttentionForCpuBackward0" if backward else None,
    )
    phase = "backward" if backward else "forward"
    return HintContext(phase=phase, kind="nan", reason="output", op=op, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("backward", [False, True])
def test_attention_scores_decide_between_overflow_and_masked_row(backward: bool) -> None:
    # Ordinary q and k (after a LayerNorm): nothing but a masked row makes NaN there.
    assert MASKED in hint(sdpa_ctx(3.0, 4.0, backward=backward))
    # q and k of 1e5: scores of 1e10, far beyond what the softmax's exp survives.
    text = hint(sdpa_ctx(1e5, 2e5, backward=backward))
    assert MASKED not in text
    assert "q and k reaching 1e+05 and 2e+05" in text
    assert "scores of order 2e+10 overflow the softmax" in text
    assert "spiked" not in text  # no spike to mention
    assert len(text) <= 300
    spiked = hint(sdpa_ctx(1e5, 2e5, backward=backward, grad_norm_alarm_step=7, step=9))
    assert "the gradient norm spiked at step 7, 2 steps earlier" in spiked


def test_a_really_fully_masked_attention_row_keeps_the_masked_row_hint() -> None:
    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
            self.out = nn.Linear(16, 1)

        def forward(self, x: Tensor, padding: Tensor) -> Tensor:
            h, _ = self.attn(x, x, x, key_padding_mask=padding)
            return self.out(h).mean((1, 2))

    torch.manual_seed(0)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1] = True  # sample 1 is all padding: an empty sequence
    model = Encoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
            loss = guard.check_loss(model(torch.randn(3, 6, 16), padding).pow(2).mean())
            loss.backward()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "attn")
    assert origin.hint is not None
    assert MASKED in origin.hint
    assert "overflow the softmax" not in origin.hint


# --- a -inf that torch.where hid in the forward -----------------------------------------------


class PolicyHead(nn.Module):
    """An entropy bonus over a softmax sharp enough that probabilities underflow to 0."""

    def __init__(self, safe: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(32, 100)
        self.safe = safe

    def forward(self, x: Tensor) -> Tensor:
        p = torch.softmax(self.lin(x), -1)
        if self.safe:  # the log only ever sees safe inputs (torch.xlogy's gradient is 0/0 too)
            return -(p * torch.log(torch.where(p > 0, p, 1.0))).sum(-1)
        return -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1)


def entropy_model(safe: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), PolicyHead(safe))


def neg_mean(out: Tensor, _: Tensor) -> Tensor:
    return -out.mean()


def test_a_log_of_zero_hidden_by_where_is_named_in_the_backward() -> None:
    x = torch.randn(64, 16) * 300  # sharp logits: many probabilities are exactly 0
    origin = run(entropy_model(), [(x, x)], neg_mean).origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("backward", "2", "nan")
    assert origin.op is not None
    assert origin.op.endswith("in MulBackward0")
    assert origin.hint is not None
    assert origin.hint.startswith("In the backward, MulBackward0 used a -Inf")
    assert "log(0)" in origin.hint
    assert "torch.where(p > 0, p, 1) before the log" in origin.hint
    assert UNKNOWN not in origin.hint
    # The fix the hint gives keeps the same batch finite.
    assert run(entropy_model(safe=True), [(x, x)], neg_mean).events == []


class WhereSqrt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        return torch.where(h > 0, torch.sqrt(h), torch.zeros_like(h))


class MaskedLogsumexp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        mask = torch.zeros_like(x)
        mask[0] = float("-inf")  # sample 0 has no valid slot
        return torch.logsumexp(self.lin(x) + mask, -1).clamp_min(-1.0)


@pytest.mark.parametrize(
    ("module", "node", "words"),
    [
        # sqrt(h < 0) is a NaN the forward hid: the hidden-NaN hint, not the hidden-Inf one.
        pytest.param(
            WhereSqrt, "SqrtBackward0", ["used a NaN that the forward computed"], id="hidden-nan"
        ),
        # logsumexp of an all -inf slice: its own hint, though its inputs hold -inf too.
        pytest.param(
            MaskedLogsumexp,
            "LogsumexpBackward0",
            ["logsumexp over a slice that is entirely -inf"],
            id="lse",
        ),
    ],
)
def test_hints_that_were_right_stay(module: type[nn.Module], node: str, words: list[str]) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    origin = run(module(), [(x, x)], lambda out, _: out.sum()).origin
    assert origin is not None
    assert origin.phase == "backward"
    assert origin.op is not None
    assert origin.op.endswith(f"in {node}")
    assert origin.hint is not None
    for word in words:
        assert word in origin.hint, origin.hint
    assert "used a -Inf" not in origin.hint


# --- the derivative with respect to a learnable exponent ---------------------------------------


class GeM(nn.Module):
    """Generalised-mean pooling with a learnable exponent (image retrieval)."""

    def __init__(self, eps: float | None = None) -> None:
        super().__init__()
        self.p = nn.Parameter(torch.full((1,), 3.0))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        if self.eps is not None:
            x = x.clamp_min(self.eps)
        return F.avg_pool2d(x.pow(self.p), x.shape[-2:]).pow(1.0 / self.p)


def gem_model(eps: float | None = None) -> nn.Module:
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 8, 3, padding=1)
    with torch.no_grad():
        conv.weight[0] = 0.0
        conv.bias[0] = -1.0  # channel 0 is dead after the ReLU: all zeros
    return nn.Sequential(conv, nn.ReLU(), GeM(eps), nn.Flatten())


def test_a_learnable_exponent_of_a_zero_base_gets_the_exponent_hint() -> None:
    x, y = torch.randn(4, 3, 8, 8), torch.randint(0, 8, (4,))
    origin = run(gem_model(), [(x, y)], nn.CrossEntropyLoss(), mode="sentinel").origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "2", "GeM")
    assert origin.op is not None
    assert origin.op.endswith("in PowBackward1")
    assert origin.hint is not None
    assert "a tensor (learnable) exponent p" in origin.hint
    # GeM's outer pow(1 / p) at 0: the base's derivative is infinite (1 / p < 1)
    assert "with respect to x, p * x ** (p - 1), is infinite" in origin.hint
    assert "x ** p * log(x)" in origin.hint
    assert "x.clamp_min(eps) ** p" in origin.hint
    assert "0 < p < 1" not in origin.hint  # that is the base's derivative (PowBackward0)
    assert run(gem_model(eps=1e-6), [(x, y)], nn.CrossEntropyLoss(), mode="sentinel").events == []


class Prototypes(nn.Module):
    """Distances to class prototypes, (d ** 2).sum() ** 0.5: a point on a prototype is at 0."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.protos = nn.Parameter(torch.randn(2, 4))

    def forward(self, x: Tensor) -> Tensor:
        d = self.embed(x)[:, None] - self.protos
        return -((d**2).sum(-1) ** 0.5)


def test_a_fractional_constant_exponent_keeps_the_base_hint() -> None:
    torch.manual_seed(0)
    model = Prototypes()
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 0, 1])
    with torch.no_grad():
        # Sample 0 lies exactly on prototype 0 (computed as the forward computes it: one
        # row alone may round differently from the batch, by the CPU's kernels).
        model.protos[0] = model.embed(x)[0]
    origin = run(model, [(x, y)], nn.CrossEntropyLoss()).origin
    assert origin is not None
    assert origin.phase == "backward"
    assert origin.op is not None
    assert origin.op.endswith("in PowBackward0")
    assert origin.hint is not None
    assert "0 < p < 1" in origin.hint
    assert "learnable" not in origin.hint


def test_a_bfloat16_overflow_is_called_exploding_not_a_reason_for_float32() -> None:
    # bfloat16 has float32's range: past 3.4e38 the weights are exploding, and float32
    # would overflow at the same step.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 1)).to(torch.bfloat16)
    with torch.no_grad():
        model[0].weight.fill_(1e37)  # what a diverging run's weights reach
    x = torch.full((4, 16), 100.0, dtype=torch.bfloat16)
    guard = run(model, [(x, x[:, :1])], lambda out, y: (out - y).float().pow(2).mean())
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.kind) == ("0", "inf")
    assert origin.hint is not None
    assert "overflowed bfloat16" in origin.hint
    assert "exploding" in origin.hint
    # (Filled by hand before the first step: no optimizer step moved them under the guard.)
    assert "no optimizer step has moved the watched weights" in origin.hint
    assert "float32" not in origin.hint


class Encoder(nn.Module):
    """A VAE encoder: the mean and log-variance of the latent."""

    def __init__(self) -> None:
        super().__init__()
        self.mu = nn.Linear(8, 4)
        self.logvar = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.mu(x), self.logvar(x)


def test_a_vae_kl_whose_logvar_exp_overflows_gets_that_hint() -> None:
    torch.manual_seed(0)
    model = Encoder()
    with torch.no_grad():
        model.logvar.bias.fill_(100.0)  # a log-variance that has drifted up: exp(100) > 3.4e38

    def kl(out: tuple[Tensor, Tensor], _: Tensor) -> Tensor:
        mu, logvar = out
        return -0.5 * torch.mean(1 + logvar - mu.pow(2) - logvar.exp())

    x = torch.randn(16, 8)
    guard = run(model, [(x, x)], kl)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "inf")
    assert origin.hint is not None
    assert "logvar.exp()" in origin.hint


class BertLayerNorm(nn.Module):
    """The original BERT LayerNorm, written by hand with variance_epsilon=1e-12."""

    def __init__(self, hidden: int, eps: float = 1e-12) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.variance_epsilon = eps

    def forward(self, x: Tensor) -> Tensor:
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class PaddedEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(1000, 64, padding_idx=0)
        self.ln = BertLayerNorm(64)
        self.cls = nn.Linear(64, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.cls(self.ln(self.embed(ids)).mean(1))


def test_an_eps_that_float16_cannot_hold_is_named_in_a_division_hint() -> None:
    # model.half() on BERT's LayerNorm: pad rows (padding_idx, no position embedding) are
    # constant, their variance 0, and 0 + 1e-12 is 0 in float16: 0/0.
    torch.manual_seed(0)
    net = PaddedEncoder().half()
    ids = torch.randint(1, 1000, (4, 12))
    ids[:, 8:] = 0
    guard = run(
        net, [(ids, torch.tensor([0, 1, 2, 0]))], lambda out, y: F.cross_entropy(out.float(), y)
    )
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "ln", "aten.div.Tensor")
    assert origin.hint is not None
    assert "in float16" in origin.hint
    assert "an eps rounds away" in origin.hint


def test_a_nan_that_where_hid_in_a_box_loss_is_among_the_loss_backward_causes() -> None:
    # An FCOS-style box loss at every location, masked with torch.where: the negatives' empty
    # target boxes make atan(0 / 0) = NaN there; the backward multiplies it by 0.
    torch.manual_seed(0)
    head = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    pos = torch.zeros(64, dtype=torch.bool)
    pos[:10] = True
    target = (torch.rand(64, 4) * 20 + 1) * pos[:, None]

    def box_loss(out: Tensor, target: Tensor) -> Tensor:
        pred = torch.exp(out)  # ltrb distances
        wp, hp = pred[:, 0] + pred[:, 2], pred[:, 1] + pred[:, 3]
        wt, ht = target[:, 0] + target[:, 2], target[:, 1] + target[:, 3]
        v = (torch.atan(wt / ht) - torch.atan(wp / hp)) ** 2
        return torch.where(pos, v, torch.zeros_like(v)).sum() / pos.sum()

    origin = run(head, [(torch.randn(64, 16), target)], box_loss).origin
    assert origin is not None
    assert (origin.phase, origin.kind, origin.details.get("reason")) == (
        "loss",
        "nan",
        "loss_backward",
    )
    assert origin.hint is not None
    assert "an Inf/NaN that min/max/clamp/where, masked_fill or nan_to_num hid" in origin.hint
    assert "atan(w/h) of an empty box" in origin.hint
