"""The operation, source line and hint for causes that are easy to misdescribe: in-place
ops, custom autograd Functions, an exp overflow hidden by later ops, Adam with eps=0, and
torch.logdet of a matrix with a negative determinant. Each model really has its cause."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F

import nanguard


def line_of(obj: Callable[..., object] | type, code: str) -> str:
    """``file:line`` of the line of ``obj``'s source that contains ``code``."""
    lines, start = inspect.getsourcelines(obj)
    offset = next(i for i, line in enumerate(lines) if code in line)
    return f"{inspect.getsourcefile(obj)}:{start + offset}"


def step(
    model: nn.Module,
    *args: object,
    loss_fn: Callable[[object], Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    steps: int = 1,
) -> nanguard.Guard:
    opt = optimizer or torch.optim.SGD(model.parameters(), lr=0.0)
    with nanguard.watch(model, on_nonfinite="log", optimizer=opt) as guard:
        for _ in range(steps):
            out = model(*args)
            loss = guard.check_loss(
                loss_fn(out) if loss_fn is not None else out.float().pow(2).mean()  # type: ignore[union-attr]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    return guard


def quoted_range(hint: str) -> tuple[float, float]:
    """The ``[lo, hi]`` a hint quotes for the op's input."""
    found = re.search(r"is in \[([-\d.e+]+), ([-\d.e+]+)\]", hint)
    assert found is not None, hint
    return float(found[1]), float(found[2])


# --- in-place operations are described by what they read -------------------------------


class InPlaceFeatures(nn.Module):
    """Features transformed in place (saves memory), of activations that can be negative."""

    def __init__(self, op: str) -> None:
        super().__init__()
        self.op = op
        self.lin = nn.Linear(64, 64)
        self.out = nn.Linear(64, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        getattr(h, self.op)()
        return self.out(h)


@pytest.mark.parametrize(
    ("op", "words"), [("sqrt_", ["sqrt of a negative"]), ("log_", ["log of a value <= 0"])]
)
def test_an_in_place_op_quotes_the_values_it_read_not_its_result(op: str, words: list[str]) -> None:
    torch.manual_seed(0)
    model, x = InPlaceFeatures(op), torch.randn(32, 64)
    with torch.no_grad():
        read = model.lin(x)  # what the in-place op is given
    guard = step(model, x)
    origin = guard.origin
    assert origin is not None
    assert origin.op == f"aten.{op}.default"
    assert origin.hint is not None
    for word in words:
        assert word in origin.hint, origin.hint
    # The negative values it was given, not the sqrt/log it wrote over them.
    assert quoted_range(origin.hint) == pytest.approx(
        (float(read.min()), float(read.max())), rel=1e-3
    )


class Whiten(nn.Module):
    """ZCA whitening (Decorrelated BatchNorm) by an eigendecomposition of the covariance."""

    def forward(self, x: Tensor) -> Tensor:
        xc = x - x.mean(0, keepdim=True)
        cov = xc.T @ xc / x.shape[0] + 1e-5 * torch.eye(x.shape[1])
        evals, evecs = torch.linalg.eigh(cov)
        return xc @ evecs @ torch.diag(evals.rsqrt()) @ evecs.T


def whitened_net(dead_units: int) -> nn.Sequential:
    torch.manual_seed(0)
    enc = nn.Linear(32, 16)
    with torch.no_grad():
        enc.bias[:dead_units] = -1e4  # dead ReLU units: equal (zero-variance) eigenvalues
    return nn.Sequential(enc, nn.ReLU(), Whiten(), nn.Linear(16, 1))


def test_eigh_backward_with_repeated_eigenvalues_gets_the_degenerate_eigh_hint() -> None:
    x = torch.randn(256, 32)
    guard = step(whitened_net(dead_units=4), x)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "2")
    assert origin.op is not None
    assert origin.op.endswith("in LinalgEighBackward0")  # an in-place div_ in its formula
    assert origin.source is not None
    assert origin.source.startswith(line_of(Whiten, "torch.linalg.eigh"))
    assert origin.hint is not None
    assert "repeated values" in origin.hint
    assert "torch.where" not in origin.hint
    # The same layer on distinct eigenvalues trains without a report.
    assert step(whitened_net(dead_units=0), x).events == []


# --- a custom autograd.Function: its own backward is the source -------------------------


class LogQuant(torch.autograd.Function):
    """Straight-through log quantiser whose hand-written backward divides by the input."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return torch.sign(x) * torch.log1p(x.abs()).round()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad / x


class OnceLogQuant(LogQuant):
    """The same backward behind @once_differentiable, as many extensions write it."""

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return grad / x


class Quant(nn.Module):
    def __init__(self, function: type[torch.autograd.Function] = LogQuant) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: Tensor) -> Tensor:
        return self.function.apply(x)  # type: ignore[no-any-return]


class QuantNet(nn.Module):
    def __init__(self, function: type[torch.autograd.Function] = LogQuant) -> None:
        super().__init__()
        self.a = nn.Linear(128, 256)
        self.q = Quant(function)
        self.b = nn.Linear(256, 10)
        with torch.no_grad():  # 16 pruned units: their activations are exactly 0
            self.a.weight[:16] = 0
            self.a.bias[:16] = 0

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.q(self.a(x)))


@pytest.mark.parametrize("function", [LogQuant, OnceLogQuant])
def test_a_custom_functions_backward_is_named_with_its_own_line(
    function: type[LogQuant],
) -> None:
    torch.manual_seed(0)
    guard = step(QuantNet(function), torch.randn(64, 128))
    origin = guard.origin
    assert origin is not None
    name = function.__name__
    assert (origin.phase, origin.module, origin.op) == (
        "backward",
        "q",
        f"aten.div.Tensor in {name}Backward",
    )
    backward = inspect.unwrap(function.backward)
    assert origin.source is not None
    assert origin.source.startswith(line_of(backward, "return grad / x"))
    assert f"{name}.backward" in origin.message
    assert "look at Quant.forward" not in origin.message
    assert origin.hint is not None
    assert "custom autograd.Function" in origin.hint
    assert "divided by zero" in origin.hint


# --- an exp overflow that later ops made finite again ----------------------------------


class Mish(nn.Module):
    """Mish as written in many YOLO repositories: exp overflows above 88.7 in float32."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.tanh(torch.log(1 + torch.exp(x)))


class SafeMish(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * torch.tanh(F.softplus(x))


def conv_block(act: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), act, nn.Conv2d(16, 1, 1))


def test_an_exp_overflow_hidden_in_the_forward_is_named_in_the_backward() -> None:
    pixels = torch.randn(2, 3, 32, 32) * 60  # un-normalised images: pre-activations above 88
    guard = step(conv_block(Mish()), pixels)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module_type) == ("backward", "Mish")
    assert origin.op is not None
    assert origin.op.endswith("in ExpBackward0")
    assert origin.hint is not None
    assert "exp overflowed (x > 88.72)" in origin.hint
    assert "F.softplus" in origin.hint
    assert "learning rate" not in origin.hint
    assert step(conv_block(SafeMish()), pixels).events == []


# --- an adaptive optimizer with eps=0 -----------------------------------------------------


def embedding_model() -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(1000, 16), nn.Linear(16, 1))
    return model, torch.randint(0, 1000, (8, 4))  # most rows are not looked up: gradient 0


@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.AdamW, torch.optim.RMSprop])
def test_eps_zero_with_a_zero_gradient_is_called_zero_over_zero(
    optimizer: type[torch.optim.Optimizer],
) -> None:
    model, idx = embedding_model()
    guard = step(model, idx, optimizer=optimizer(model.parameters(), lr=1e-3, eps=0.0), steps=2)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param, origin.kind) == ("param", "0.weight", "nan")
    assert origin.hint is not None
    assert f"{optimizer.__name__}.step()" in origin.hint
    assert "0/0" in origin.hint
    assert "eps=0" in origin.hint
    assert "learning rate so large" not in origin.hint
    assert "eps=0" in origin.message
    # The default eps keeps the same model finite.
    model, idx = embedding_model()
    assert step(model, idx, optimizer=optimizer(model.parameters(), lr=1e-3), steps=2).events == []


# --- torch.logdet of a matrix with a negative determinant --------------------------------


class InvConv(nn.Module):
    """Glow's invertible 1x1 convolution, with log|det W| written as torch.logdet."""

    def __init__(self, det_sign: int) -> None:
        super().__init__()
        w = torch.linalg.qr(torch.randn(8, 8))[0]
        if torch.det(w).sign() != det_sign:
            w[0] = -w[0]
        self.weight = nn.Parameter(w)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        z = F.conv2d(x, self.weight[:, :, None, None])
        return z, x.shape[2] * x.shape[3] * torch.logdet(self.weight)


def flow_loss(out: object) -> Tensor:
    z, logdet = out  # type: ignore[misc]
    return 0.5 * z.pow(2).mean() - logdet / z.numel()  # type: ignore[no-any-return]


def test_logdet_of_a_negative_determinant_points_to_slogdet() -> None:
    torch.manual_seed(0)
    guard = step(InvConv(det_sign=-1), torch.randn(2, 8, 16, 16), loss_fn=flow_loss)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module_type, origin.tensor) == ("forward", "InvConv", "output[1]")
    assert origin.source is not None
    assert origin.source.startswith(line_of(InvConv, "torch.logdet(self.weight)"))
    assert origin.hint is not None
    assert "torch.logdet" in origin.hint
    assert "torch.linalg.slogdet" in origin.hint


class LogScaleFlow(nn.Module):
    """A flow step whose logdet is fine (det > 0) and whose log-scale is not (log of <= 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.inv = InvConv(det_sign=1)
        self.scale = nn.Conv2d(8, 8, 1)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        logdet = torch.logdet(self.inv.weight)
        s = self.scale(x)
        return x * s, logdet + torch.log(s).sum()


def test_a_logdet_that_was_fine_is_not_blamed_for_a_later_nan() -> None:
    torch.manual_seed(0)
    guard = step(LogScaleFlow(), torch.randn(2, 8, 16, 16), loss_fn=flow_loss)
    origin = guard.origin
    assert origin is not None
    assert origin.op == "aten.log.default"
    assert origin.source is not None
    assert origin.source.startswith(line_of(LogScaleFlow, "torch.log(s)"))
    assert origin.hint is not None
    assert "logdet" not in origin.hint


class _Whitening(nn.Module):
    """ZCA-style whitening of a batch's features: an unbiased covariance, / (n - 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.features(x)
        f = f - f.mean(0, keepdim=True)
        cov = f.T @ f / (len(f) - 1)  # an epoch's last batch of one sample: 0/0
        return f @ cov  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_covariance_over_a_batch_of_one_names_n_minus_one(mode: str) -> None:
    torch.manual_seed(0)
    model = _Whitening()
    opt = torch.optim.SGD(model.parameters(), 0.01)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for batch in (64, 64, 1):  # (drop_last=False)
            loss = model(torch.randn(batch, 16)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (2, "forward", "")
    assert origin.hint is not None
    assert "n - 1 of a batch of one sample" in origin.hint


# --- an entropy by xlogy/entr inside the model -------------------------------------------


class EntropyPolicy(nn.Module):
    """An actor head that returns its policy's entropy (for the bonus), computed with the
    "safe" xlogy(p, p) or entr(p): finite at p = 0, where their slopes are not."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(128, 256), nn.ReLU())
        self.lin = nn.Linear(256, 18)
        self.how = how

    def forward(self, obs: Tensor) -> tuple[Tensor, Tensor]:
        logits = self.lin(self.body(obs))
        p = logits.softmax(-1)
        if self.how == "xlogy":
            entropy = -torch.special.xlogy(p, p).sum(-1)
        else:
            entropy = torch.special.entr(p).sum(-1)
        return logits, entropy


@pytest.mark.parametrize(
    ("how", "node", "made"),
    [("xlogy", "XlogyBackward0", "NaN"), ("entr", "SpecialEntrBackward0", "-Inf")],
)
def test_an_entropy_in_the_model_by_xlogy_names_its_slope(how: str, node: str, made: str) -> None:
    torch.manual_seed(0)
    obs = torch.randint(0, 256, (64, 128)).float()  # raw bytes: some probabilities are 0
    model = EntropyPolicy(how)
    guard = step(model, obs, loss_fn=lambda out: out[0].logsumexp(-1).mean() - 0.01 * out[1].mean())
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "")
    assert origin.op is not None
    assert origin.op.endswith(f"in {node}")
    assert origin.hint is not None
    assert origin.hint.startswith(f"In the backward, {node} made {made} from a finite forward")
    assert "Take the entropy from log_softmax" in origin.hint


class SafeL2Norm(nn.Module):
    """A "safe" normalisation: where(n > 0, z / n, 0). A blank image's zero embedding takes
    the unselected branch, 0/0 in the forward, whose derivative is still computed."""

    def forward(self, z: Tensor) -> Tensor:
        n = z.norm(dim=-1, keepdim=True)
        return torch.where(n > 0, z / n, torch.zeros_like(z))


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Flatten())
        self.fc = nn.Linear(16 * 28 * 28, 64, bias=False)  # (no bias: blank in, zero out)
        self.norm = SafeL2Norm()

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.fc(self.conv(x)))


def test_a_division_inside_torch_where_is_named_as_where_s_trap() -> None:
    torch.manual_seed(0)
    model = Embedder()
    nn.init.zeros_(model.conv[0].bias)
    x = torch.randn(16, 1, 28, 28)
    x[5] = 0  # a blank image
    guard = step(model, x, loss_fn=lambda z: (z[:8] * z[8:]).sum(-1).mean())
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "norm")
    assert origin.source is not None
    assert origin.source.endswith("return torch.where(n > 0, z / n, torch.zeros_like(z))")
    assert origin.hint is not None
    assert "torch.where on that line computes both branches" in origin.hint
    assert "x / torch.where(ok, y, 1)" in origin.hint


class CollapsedTemperature(nn.Module):
    """A contrastive head with a learned temperature that collapsed to 1e-23; the line that
    divides by it also masks the self-similarities with torch.where (a constant branch)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
        self.tau = nn.Parameter(torch.tensor(1e-23))

    def forward(self, x: Tensor) -> Tensor:
        z = F.normalize(self.enc(x), dim=-1)
        eye = torch.eye(len(x), dtype=torch.bool)
        return torch.where(eye, -1e4, z @ z.T) / self.tau


def test_a_tiny_denominator_on_a_line_with_where_is_not_called_where_s_trap() -> None:
    torch.manual_seed(0)
    guard = step(
        CollapsedTemperature(),
        torch.randn(16, 32),
        loss_fn=lambda logits: F.cross_entropy(logits, torch.arange(16) ^ 1),  # type: ignore[arg-type]
    )
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("backward", "tau")
    assert origin.hint is not None
    assert "overflows for a tiny y" in origin.hint
    assert "torch.where on that line" not in origin.hint


class LaneHead(nn.Module):
    """Segment slopes by a "safe" division: where(dx != 0, dy / dx, 0), dx signed."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(32, 4)

    def forward(self, x: Tensor) -> Tensor:
        p = self.fc(x)  # (x0, y0, x1, y1)
        dx, dy = p[:, 2] - p[:, 0], p[:, 3] - p[:, 1]
        slope = torch.where(dx != 0, dy / dx, torch.zeros_like(dx))
        return torch.stack([slope, dx, dy], -1)


class SmoothL1Head(nn.Module):
    """A box head whose hand-written Smooth-L1 divides by beta, a number (0.0 in config)."""

    def __init__(self, beta: float = 0.0) -> None:
        super().__init__()
        self.reg = nn.Linear(64, 4)
        nn.init.zeros_(self.reg.weight)
        nn.init.zeros_(self.reg.bias)
        self.beta = beta

    def forward(self, x: Tensor) -> Tensor:
        n = torch.abs(self.reg(x))  # (target deltas 0: the proposals are the boxes)
        return torch.where(n < self.beta, 0.5 * n**2 / self.beta, n - 0.5 * self.beta)


@pytest.mark.parametrize("case", ["signed", "number"])
def test_where_s_trap_with_a_signed_or_number_denominator_is_named(case: str) -> None:
    torch.manual_seed(0)
    if case == "signed":
        model: nn.Module = LaneHead()
        x = torch.randn(64, 32)
        x[7] = 0
        with torch.no_grad():
            model.fc.bias[2] = model.fc.bias[0]  # segment 7: dx == 0 exactly
        line = "slope = torch.where(dx != 0, dy / dx, torch.zeros_like(dx))"
    else:
        model, x = SmoothL1Head(), torch.randn(32, 64)
        line = "return torch.where(n < self.beta, 0.5 * n**2 / self.beta, n - 0.5 * self.beta)"
    origin = step(model, x).origin
    assert origin is not None
    assert origin.phase == "backward"
    assert origin.source is not None
    assert origin.source.endswith(line)
    assert origin.hint is not None
    assert "torch.where on that line computes both branches" in origin.hint
