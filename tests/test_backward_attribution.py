"""Who made a non-finite gradient, in model shapes that mislead a naive attribution.

Tied embeddings, parameters of a parent used before its blocks (a ViT's cls_token),
outputs the model also uses itself (a policy's entropy, a VAE's variance), a distance
computed by the caller of a Sequential, a NaN made only in a parameter's gradient, a
Dropout that overflows float16, and a float32 exp that overflows: each names the module
(and operation) that really made the value, in full and sentinel mode.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import nanguard

MODES = ("full", "sentinel")


def train_step(
    model: nn.Module, loss_of: Callable[[nn.Module], Tensor], mode: str, **options: object
) -> nanguard.Guard:
    """One optimizer step under a logging guard; returns the (detached) guard."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanguard.watch(
            model, optimizer=opt, on_nonfinite="log", mode=mode, **options
        ) as guard:
            loss = guard.check_loss(loss_of(model))
            opt.zero_grad()
            loss.backward()
            opt.step()
    return guard


class SafeSqrt(nn.Module):
    """``where(x > 0, sqrt(x), 0)``: finite forward, NaN backward where x <= 0."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))


# --------------------------------------------------------------- tied weights
class TiedLM(nn.Module):
    def __init__(self, vocab: int = 500, dim: int = 64, tied: bool = True) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.mid = nn.Linear(dim, dim)
        self.act = SafeSqrt()
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: Tensor) -> Tensor:
        return self.head(self.act(self.mid(self.emb(idx))))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("tied", [True, False])
def test_tied_embedding_does_not_take_the_blame_for_a_backward_nan(mode: str, tied: bool) -> None:
    idx = torch.randint(0, 500, (8, 32))
    guard = train_step(
        TiedLM(tied=tied),
        lambda m: F.cross_entropy(m(idx).reshape(-1, 500), idx.reshape(-1)),
        mode,
    )
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "act", "SafeSqrt")
    assert origin.op is not None
    assert "SqrtBackward0" in origin.op


# ------------------------------------------- a parent's parameter used before its blocks
class Block(nn.Module):
    def __init__(self, dim: int, sqrt_act: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 2 * dim)
        self.act = SafeSqrt() if sqrt_act else nn.GELU()
        self.fc2 = nn.Linear(2 * dim, dim)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class TinyViT(nn.Module):
    def __init__(self, dim: int = 64) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, dim, 8, stride=8)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, 17, dim) * 0.02)
        self.blocks = nn.Sequential(Block(dim, False), Block(dim, True))
        self.head = nn.Linear(dim, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls_token.expand(len(h), -1, -1), h], 1) + self.pos_embed
        return self.head(self.blocks(h)[:, 0])


@pytest.mark.parametrize("mode", MODES)
def test_a_cls_token_does_not_take_the_blame_for_a_block_backward(mode: str) -> None:
    x, y = torch.randn(16, 3, 32, 32), torch.randint(0, 10, (16,))
    guard = train_step(TinyViT(), lambda m: F.cross_entropy(m(x), y), mode)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == (
        "backward",
        "blocks.1.act",
        "grad of args[0]",
    )
    # The root's parameters' gradients are downstream of it, not an origin.
    assert [e.param for e in guard.events if e.is_origin] == [None]


# ----------------------------------------------- outputs the model also uses itself
class PolicyHead(nn.Module):
    """Returns the action probabilities and their entropy (computed from them)."""

    def __init__(self, dim: int = 32, actions: int = 6) -> None:
        super().__init__()
        self.logits = nn.Linear(dim, actions)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        p = torch.softmax(self.logits(h), -1)
        entropy = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1).mean()
        return p, entropy


@pytest.mark.parametrize("mode", MODES)
def test_an_entropy_made_from_a_returned_output_is_the_heads_backward(mode: str) -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), PolicyHead())
    with torch.no_grad():
        model[2].logits.weight[0] = 0.0
        model[2].logits.bias[0] = -200.0  # action 0 has probability exactly 0
    x = torch.randn(64, 16)
    guard = train_step(model, lambda m: -0.01 * m(x)[1], mode)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "2", "PolicyHead")
    assert origin.tensor == "grad of output[0] of 2"
    assert origin.op is not None
    assert "MulBackward0" in origin.op


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 128), nn.ReLU())
        self.mu = nn.Linear(128, 8)
        self.logvar = nn.Linear(128, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        h = self.body(x)
        mu, var = self.mu(h), torch.exp(self.logvar(h))
        return mu + torch.sqrt(var) * torch.randn_like(mu), mu, var


class VAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = Encoder()
        self.dec = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 64))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        z, mu, var = self.enc(x)
        return self.dec(z), mu, var


@pytest.mark.parametrize("mode", MODES)
def test_a_vae_variance_that_underflowed_is_the_encoders_backward(mode: str) -> None:
    model = VAE()
    with torch.no_grad():
        model.enc.logvar.bias[:2] = -200.0  # exp(-200) == 0: a collapsed posterior
    x = torch.rand(32, 64)

    def loss(m: nn.Module) -> Tensor:
        rec, mu, var = m(x)
        kl = 0.5 * (mu.pow(2) + var - torch.log(var + 1e-8) - 1).sum(1).mean()
        return F.mse_loss(rec, x) + kl

    origin = train_step(model, loss, mode).origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "enc")
    assert origin.tensor == "grad of output[2] of enc"
    assert origin.details["reason"] == "own_code_backward"
    assert origin.op is not None
    assert "SqrtBackward0" in origin.op


# ---------------------------------------- a distance computed by a Sequential's caller
class Siamese(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))

    def forward(self, a: Tensor, p: Tensor) -> Tensor:
        return torch.sqrt(((self.enc(a) - self.enc(p)) ** 2).sum(-1))


@pytest.mark.parametrize("mode", MODES)
def test_a_distance_at_zero_is_the_callers_code_not_the_sequential(mode: str) -> None:
    a = torch.randn(64, 32)
    p = a.clone()
    p[32:] += torch.randn(32, 32)  # half the pairs are identical: distance 0
    origin = train_step(Siamese(), lambda m: m(a, p).mean(), mode).origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "", "Siamese")
    assert origin.details["reason"] == "own_code_backward"


# --------------------------------------------- a NaN made only in a parameter's gradient
class SqrtGain(nn.Module):
    """``x * sqrt(w)``: the gradient of ``w`` is Inf where ``w == 0`` (``x``'s is finite)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(dim) + 0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.w.sqrt()


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_only_in_a_parameters_gradient_names_its_module(mode: str) -> None:
    model = nn.Sequential(nn.Linear(32, 64), SqrtGain(64), nn.ReLU(), nn.Linear(64, 10))
    with torch.no_grad():
        model[1].w[:4] = 0.0
    x, y = torch.randn(128, 32), torch.randint(0, 10, (128,))
    origin = train_step(model, lambda m: F.cross_entropy(m(x), y), mode).origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.tensor) == ("backward", "1", "grad of 1.w")
    assert origin.op is not None
    assert "SqrtBackward0" in origin.op
    assert origin.reproducible is True


# ------------------------------------------------------- a Dropout overflowing float16
class HalfMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(64, 64)
        self.drop = nn.Dropout(0.5)
        self.out = nn.Linear(64, 8)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.drop(self.fc(x)))


@pytest.mark.parametrize("mode", MODES)
def test_a_dropout_that_overflows_float16_gets_its_operation(mode: str) -> None:
    model = HalfMLP()
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.bias.fill_(40000.0)  # finite in float16; doubled by Dropout(0.5): Inf
    model.half()
    x = torch.randn(16, 64, dtype=torch.float16)
    guard = train_step(model, lambda m: m(x).float().mean(), mode, grad_norm=False)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "drop", "inf")
    assert origin.op is not None
    assert origin.op.startswith("aten.")
    assert origin.source is not None
    assert "self.drop(" in origin.source


# --------------------------------------------------- a float32 exp overflowing to Inf
class ContrastiveHead(nn.Module):
    """CLIP's learnable temperature: logits scaled by ``logit_scale.exp()``."""

    def __init__(self) -> None:
        super().__init__()
        self.img = nn.Linear(32, 16)
        self.txt = nn.Linear(32, 16)
        self.logit_scale = nn.Parameter(torch.tensor(100.0))  # exp(100) overflows float32

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        za, zb = F.normalize(self.img(a), dim=-1), F.normalize(self.txt(b), dim=-1)
        logits = za @ zb.t() * self.logit_scale.exp()
        # The loss inside the model, as return_loss=True does: inf - inf = NaN.
        return F.cross_entropy(logits, torch.arange(len(a)))


def test_a_float32_exp_overflow_that_ends_in_nan_is_called_an_overflow() -> None:
    a, b = torch.randn(8, 32), torch.randn(8, 32)
    origin = train_step(ContrastiveHead(), lambda m: m(a, b), "full").origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "", "nan")
    assert origin.op == "aten.exp.default"
    assert origin.hint is not None
    assert "overflowed float32: exp(x) is Inf above x = 88.72" in origin.hint
    assert "does not recognise" not in origin.hint


# ------------------------------------------------------------- what the reports say
class TwoHeads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(32, 64)
        self.cls = nn.Linear(64, 10)
        self.aux = nn.Linear(64, 10)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.relu(self.trunk(x))
        return self.cls(h), self.aux(h)


@pytest.mark.parametrize("head", [0, 1])
def test_a_loss_origin_names_the_output_the_loss_read(head: int) -> None:
    x = torch.randn(64, 32)

    def focal(m: nn.Module) -> Tensor:
        p = torch.softmax(m(x)[head], -1)
        return ((1 - p) ** 0.5 * -torch.log(p + 1e-9)).mean()  # a focal loss, gamma 0.5

    model = TwoHeads()
    with torch.no_grad():  # one class certain: (1 - p) ** 0.5 at p == 1 has an infinite slope
        getattr(model, ("cls", "aux")[head]).bias[3] = 1e4
    origin = train_step(model, focal, "full").origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.tensor == f"grad of output[{head}]"


class DistAct(nn.Module):
    """Pairwise distances: sqrt at 0 on the diagonal, in the backward."""

    def forward(self, x: Tensor) -> Tensor:
        return (x[:, None, :] - x[None, :, :]).pow(2).sum(-1).sqrt()


def test_the_propagated_path_starts_with_the_call_that_returned_the_tensor() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), DistAct(), nn.Linear(32, 4))
    x = torch.randn(32, 8)
    origin = train_step(model, lambda m: m(x).pow(2).mean(), "full").origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "2")
    assert origin.propagated[:2] == ("1", "0")


class ArcFace(nn.Module):
    """ArcFace margin: acos of the cosine, infinite slope where cos == 1 exactly."""

    def __init__(self, dim: int = 32, classes: int = 100) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.randn(classes, dim))

    def forward(self, h: Tensor, y: Tensor) -> Tensor:
        cos = F.linear(F.normalize(h), F.normalize(self.W)).clamp(-1, 1)
        theta = torch.acos(cos)
        return torch.cos(theta + 0.5 * F.one_hot(y, cos.shape[1])) * 64.0


class ArcNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
        self.head = ArcFace()

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return self.head(self.body(x), y)


def test_a_parameter_gradient_origin_keeps_the_path_it_reached() -> None:
    model = ArcNet()
    x, y = torch.randn(64, 16), torch.randint(0, 100, (64,))
    with torch.no_grad():  # every embedding is 3 * e_8, class y[0]'s centre 2 * e_8: cos == 1
        model.body[2].weight.zero_()
        model.body[2].bias.zero_()
        model.body[2].bias[8] = 3.0
        model.head.W[y[0]] = 0.0
        model.head.W[y[0], 8] = 2.0
    origin = train_step(model, lambda m: F.cross_entropy(m(x, y), y), "full").origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "head")
    assert origin.propagated[:2] == ("body.2", "body.0")  # the backbone got it next


class SigmoidNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 1)
        self.act = nn.Sigmoid()

    def forward(self, x: Tensor) -> Tensor:
        return self.act(self.fc(x))


def test_a_final_sigmoid_is_not_called_huge_outputs() -> None:
    model = SigmoidNet()
    with torch.no_grad():
        model.fc.weight.fill_(-1e16)  # the sigmoid is exactly 0 for these inputs
    x = torch.rand(64, 8) + 0.1
    origin = train_step(model, lambda m: -torch.log(m(x)).mean(), "full").origin
    assert origin is not None
    assert origin.phase == "loss"
    assert origin.hint is not None
    assert "outputs were huge" not in origin.hint


# ------------------------------------------------------------- a gradient penalty
class Critic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


@pytest.mark.parametrize(
    ("mode", "options"),
    [
        ("full", {}),
        ("sentinel", {}),
        # Every module's gradient probed: the penalty's second derivative reaches only the
        # parameters' gradients, no module's backward made them (one event, not one a call).
        ("full", {"backward": "probes"}),
        ("full", {"sync": "module"}),
    ],
)
def test_a_gradient_penalty_without_eps_is_named_as_such(
    mode: str, options: dict[str, object]
) -> None:
    critic = Critic()
    with torch.no_grad():
        critic.net[0].weight[:8] = 0.0  # dead units...
        critic.net[2].weight[:, 8:] = 0.0  # ...and the rest unused: the input gradient is 0
    real, fake = torch.randn(32, 16), torch.randn(32, 16)

    def wgan_gp(m: nn.Module) -> Tensor:
        interp = (0.5 * real + 0.5 * fake).requires_grad_()
        (grad,) = torch.autograd.grad(m(interp).sum(), interp, create_graph=True)
        penalty = (torch.sqrt((grad**2).sum(1)) - 1).pow(2).mean()  # no eps
        return m(fake).mean() - m(real).mean() + 10 * penalty

    guard = train_step(critic, wgan_gp, mode, **options)
    origin = guard.origin
    assert origin is not None
    assert [e.phase for e in guard.events if e.is_origin] == ["grad"]
    assert origin.details["reason"] == "double_backward"
    assert "create_graph=True" in origin.message
    assert "add an eps" in origin.message
    # (torch's own norm has a 0 slope at 0: only the norm written by hand is the suspect.)
    assert "torch's g.norm() has a 0 slope there" in origin.message
    assert origin.hint is not None  # (what code reading e.hint shows the user)
    assert "sqrt(sum(g**2) + 1e-12)" in origin.hint


@pytest.mark.parametrize(("mode", "backward"), [("full", "probes"), ("sentinel", "probes")])
def test_every_backward_mode_finds_the_operation(mode: str, backward: str) -> None:
    model = nn.Sequential(nn.Linear(16, 32), SafeSqrt(), nn.Linear(32, 4))
    x = torch.randn(64, 16)
    origin = train_step(model, lambda m: m(x).pow(2).mean(), mode, backward=backward).origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "1")
    assert origin.op == "aten.mul.Scalar in SqrtBackward0"
    assert origin.source is not None
    assert "torch.sqrt(x)" in origin.source


# ---------------------------------- outputs the model used: who made the bad gradient
class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pi = nn.Linear(64, 6)
        self.v = nn.Linear(64, 1)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.pi(h), self.v(h)


class ActorCritic(nn.Module):
    """Returns (logits, value, entropy); the entropy is computed by the root from the
    logits that its heads returned together with the value."""

    def __init__(self, entropy_in_root: bool = True) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 64), nn.Tanh())
        self.heads = Heads()
        self.entropy_in_root = entropy_in_root

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits, value = self.heads(self.body(x))
        p = torch.softmax(logits, -1)
        if self.entropy_in_root:
            ent = -torch.where(p > 0, p * p.log(), torch.zeros_like(p)).sum(-1)
        else:
            ent = -(p * torch.log_softmax(logits, -1)).sum(-1)  # safe
        return logits, value, ent


def collapsed_policy(entropy_in_root: bool) -> ActorCritic:
    model = ActorCritic(entropy_in_root)
    with torch.no_grad():
        model.heads.pi.bias[0] = -200.0  # action 0 has probability exactly 0
        model.heads.pi.weight[0] = 0.0
    return model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("backward", [True, "probes"])
def test_an_entropy_the_root_computed_from_an_output_is_the_roots(
    mode: str, backward: object
) -> None:
    x = torch.randn(32, 16)

    def loss(m: nn.Module) -> Tensor:
        logits, value, ent = m(x)
        return value.pow(2).mean() - 0.01 * ent.mean() + 0 * logits.sum()

    origin = train_step(collapsed_policy(True), loss, mode, backward=backward).origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "", "ActorCritic")
    assert origin.details["reason"] == "own_code_backward"


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_made_nan_on_an_output_the_model_also_used_is_the_losss(mode: str) -> None:
    x = torch.randn(32, 16)

    def loss(m: nn.Module) -> Tensor:
        logits, value, ent = m(x)
        p = torch.softmax(logits, -1)
        log_p = torch.where(p > 0, p.log(), torch.full_like(p, -1e9))  # the loss's own trap
        return -(p * log_p).sum(-1).mean() + value.pow(2).mean() - 0.01 * ent.mean()

    origin = train_step(collapsed_policy(False), loss, mode).origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("loss", "grad of output[0]")
    assert origin.details["reason"] == "loss_backward"


class Classifier(nn.Module):
    """Returns logits and the probabilities computed from them (for metrics)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        self.act = SafeSqrt()
        self.head = nn.Linear(32, 5)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        z = self.head(self.act(self.fc(x)))
        return {"logits": z, "probs": z.softmax(-1)}


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_on_the_output_the_model_also_used_still_localises_the_backward(
    mode: str,
) -> None:
    x, y = torch.randn(32, 16), torch.randint(0, 5, (32,))
    origin = train_step(Classifier(), lambda m: F.cross_entropy(m(x)["logits"], y), mode).origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "act", "SafeSqrt")
    assert origin.op == "aten.mul.Scalar in SqrtBackward0"
    assert origin.reproducible is True


@pytest.mark.parametrize("mode", MODES)
def test_a_tied_head_whose_own_gradient_overflows_float16_is_named(mode: str) -> None:
    model = TiedLM(vocab=64, dim=16)
    model.act = nn.Identity()  # type: ignore[assignment]
    with torch.no_grad():
        model.emb.weight.normal_(0, 0.01)
        model.mid.weight.zero_()
        model.mid.bias.fill_(3000.0)  # every token's features are 3000
    model.half()
    idx = torch.randint(0, 64, (64, 64))
    # A static loss scale: the head's weight gradient g^T h, summed over 4096 tokens of
    # 3000, overflows float16, while every activation gradient stays finite.
    origin = train_step(model, lambda m: m(idx).float().mean() * 4096, mode, grad_norm=False).origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "head")
    assert origin.details["reason"] == "backward_params"


# --------------------------------------------- shapes of outputs that mislead the shares
class HFStyleEncoder(nn.Module):
    """Returns last_hidden_state, a pooler computed from it, and hidden_states holding the
    same last tensor again (BERT with output_hidden_states=True)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.layer = nn.Linear(16, 16)
        self.pool = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> dict[str, object]:
        e = self.emb(x)
        h = self.layer(e)
        pooled = torch.tanh(self.pool(h[:, 0]))
        return {"last_hidden_state": h, "pooler_output": pooled, "hidden_states": (e, h)}


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_nan_on_a_hidden_state_returned_twice_is_the_losss(mode: str) -> None:
    x = torch.randn(4, 3, 8)

    def loss(m: nn.Module) -> Tensor:
        out = m(x)
        return torch.sqrt(out["last_hidden_state"] * 0).sum() + out["pooler_output"].pow(2).mean()

    origin = train_step(HFStyleEncoder(), loss, mode).origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("loss", "grad of output['last_hidden_state']")


class Chain(nn.Module):
    """Returns (features, logits = head(features), probs = softmax(logits))."""

    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(16, 16)
        self.low = nn.Linear(16, 16)
        self.head = nn.Linear(16, 5)
        with torch.no_grad():
            self.pre.weight.zero_()
            self.pre.bias.fill_(3000.0)  # every token's features are 3000
            self.low.weight.normal_(0, 1e-4)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        feats = self.low(self.pre(x))
        logits = self.head(feats)
        return feats, logits, logits.softmax(-1)


@pytest.mark.parametrize("mode", MODES)
def test_a_chain_of_outputs_keeps_the_parameter_gradient_origin(mode: str) -> None:
    x = torch.randn(4096, 16).half()
    # `low`'s weight gradient, a sum over 4096 tokens of 3000, overflows float16 while
    # every activation gradient stays finite.
    origin = train_step(
        Chain().half(), lambda m: m(x)[-1][:, 0].float().sum(), mode, grad_norm=False
    ).origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "low")
    assert origin.details["reason"] == "backward_params"


class LayerWithAttention(nn.Module):
    """Returns (hidden, attention weights) as Hugging Face layers do; the second is not
    computed from the first."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.att = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return self.norm(self.fc(x)), self.att(x).softmax(-1)


class UsesHidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = LayerWithAttention()
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        h, w = self.layer(x)
        y = torch.where(h > 0, torch.sqrt(h), torch.zeros_like(h))  # this model's own code
        return self.head(y) + w.sum(-1, keepdim=True)


@pytest.mark.parametrize("mode", MODES)
def test_the_caller_that_used_a_layers_output_is_named_not_the_layer(mode: str) -> None:
    x = torch.randn(16, 8)
    origin = train_step(UsesHidden(), lambda m: m(x).pow(2).mean(), mode).origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "", "UsesHidden")
    assert origin.details["reason"] == "own_code_backward"


@pytest.mark.parametrize(
    ("mode", "options"),
    [("full", {"backward": "probes"}), ("full", {"replay": False}), ("sentinel", {})],
)
def test_a_tied_head_is_named_without_a_replay_too(mode: str, options: dict[str, object]) -> None:
    model = TiedLM(vocab=64, dim=16)
    model.act = nn.Identity()  # type: ignore[assignment]
    with torch.no_grad():
        model.emb.weight.normal_(0, 0.01)
        model.mid.weight.zero_()
        model.mid.bias.fill_(3000.0)
    model.half()
    idx = torch.randint(0, 64, (64, 64))
    origin = train_step(
        model, lambda m: m(idx).float().mean() * 4096, mode, grad_norm=False, **options
    ).origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "head")


class LoggingPolicy(nn.Module):
    """Returns its probabilities twice (and in a log dict) with their entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh())
        self.pi = nn.Linear(32, 6)
        with torch.no_grad():
            self.pi.weight[0] = 0.0
            self.pi.bias[0] = -200.0  # action 0 has probability exactly 0

    def forward(self, x: Tensor) -> dict[str, object]:
        p = torch.softmax(self.pi(self.body(x)), -1)
        ent = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum(-1).mean()
        return {"probs": p, "entropy": ent, "logs": {"probs": p}}


@pytest.mark.parametrize("mode", MODES)
def test_the_models_nan_on_an_output_returned_twice_is_the_models(mode: str) -> None:
    x = torch.randn(32, 16)
    origin = train_step(LoggingPolicy(), lambda m: -0.01 * m(x)["entropy"], mode).origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "")
    assert origin.details["reason"] == "own_code_backward"


def test_sync_module_names_a_backward_origin() -> None:
    # Raised inside the backward: the operation and its line come from a replay run there
    # (a nested backward), as the default mode's at the end of the step.
    model = nn.Sequential(nn.Linear(8, 16), SafeSqrt(), nn.Linear(16, 1))
    x = torch.randn(4, 8)
    origin = train_step(model, lambda m: m(x).sum(), "full", sync="module").origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "1")
    assert origin.op is not None
    assert origin.op.endswith("in SqrtBackward0")
    assert origin.source is not None
    assert origin.source.endswith("return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))")
    assert "the unselected branch of torch.where" in origin.hint


def test_sentinel_without_replay_names_the_nearest_bad_gradient_and_says_why() -> None:
    # A sentinel step probes only the model's outputs and gradients: without its replay no
    # module's backward is known. The parameter named is the nearest the output, and the
    # message says why nothing more was found (not "every module's probe was finite").
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), SafeSqrt(), nn.Linear(16, 1)
    )
    x = torch.randn(32, 8)
    origin = train_step(model, lambda m: m(x).sum(), "sentinel", replay=False).origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("grad", "2.weight")
    assert (
        "no module's backward could be named (a sentinel step probes only the model's outputs "
        "and its parameters' gradients, and replay=False: nothing looked inside the model). "
        "With replay=True (the default), nanguard names the module and the operation."
    ) in origin.message
    assert "Check custom autograd Functions" not in origin.message


class PaddedHistory(nn.Module):
    """Mean of L2-normalised item embeddings over a padded history, the eps outside the
    sqrt: sqrt's backward at a padding row's zero vector is NaN, and the embedding's
    backward drops it (padding_idx gets no gradient). Healthy: every weight stays finite."""

    def __init__(self) -> None:
        super().__init__()
        self.item = nn.Embedding(1000, 32, padding_idx=0)
        self.mlp = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8))

    def forward(self, history: Tensor) -> Tensor:
        e = self.item(history)
        e = e / (torch.sqrt((e**2).sum(-1, keepdim=True)) + 1e-8)
        mask = (history != 0).float().unsqueeze(-1)
        return self.mlp((e * mask).sum(1) / mask.sum(1).clamp_min(1))


@pytest.mark.parametrize("options", [{"backward": "probes"}, {}, {"mode": "sentinel"}])
def test_a_nan_gradient_a_later_backward_drops_inside_the_model_is_no_error(
    options: dict[str, str],
) -> None:
    torch.manual_seed(0)
    model = PaddedHistory()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="raise", **options) as guard:
        for _ in range(4):
            history = torch.randint(1, 1000, (16, 12), generator=gen)
            history[:, 8:] = 0  # padding
            loss = model(history).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.mark.parametrize("options", [{"backward": "probes"}, {}, {"mode": "sentinel"}])
def test_a_nan_gradient_the_loop_zeroed_is_still_reported(options: dict[str, str]) -> None:
    """The loss's backward makes NaN (sqrt at a zero distance); the loop sees the NaN norm,
    zeroes the gradients with model.zero_grad() and goes on: .grad is finite at the next
    step's end, yet the NaN was real, not absorbed by the model."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", **options) as guard:
        for i in range(4):
            x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
            out = model(x)
            target = out.detach() if i == 2 else y  # a target equal to the prediction
            loss = torch.sqrt(((out - target) ** 2).sum(-1)).mean()
            model.zero_grad()
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if not torch.isfinite(norm):
                model.zero_grad()
                continue
            opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.step, e.phase) for e in origins] == [(2, "loss")]


class NoisyDecoder(nn.Module):
    """A decoder with a learned noise variance, its std sqrt(var): the variance projected
    to 0 (a clamp after the step) makes the variance's own gradient infinite."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 64))
        self.noise_var = nn.Parameter(torch.full((64,), 0.05))

    def forward(self, z: Tensor) -> Tensor:
        mu = self.lin(z)
        std = torch.sqrt(self.noise_var)
        return mu + std * torch.randn_like(mu)


@pytest.mark.parametrize("options", [{"sync": "module"}, {"backward": "probes"}, {}])
def test_a_bad_gradient_of_a_parameter_alone_gets_its_operation_in_every_setting(
    options: dict[str, str],
) -> None:
    torch.manual_seed(0)
    model = NoisyDecoder()
    with torch.no_grad():
        model.noise_var[10:14] = 0
    z, x = torch.randn(16, 32), torch.randn(16, 64)
    origin = train_step(model, lambda m: ((m(z) - x) ** 2).mean(), "full", **options).origin
    assert origin is not None
    assert (origin.phase, origin.param) == ("backward", "noise_var")
    assert origin.op is not None
    assert origin.op.endswith("in SqrtBackward0")
    assert origin.source is not None
    assert origin.source.endswith("std = torch.sqrt(self.noise_var)")
    assert "the derivative of sqrt is infinite at 0" in origin.hint


class DepthWithEdges(nn.Module):
    """Returns a depth map and its edges (computed from the depth by a module, with eps)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.depth = nn.Linear(32, 8)
        self.edge = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        depth = self.depth(self.trunk(x))
        return self.edge(depth), depth


@pytest.mark.parametrize("mode", MODES)
def test_a_loss_nan_on_an_output_a_module_also_consumed_is_the_losss(mode: str) -> None:
    x = torch.randn(32, 16)

    def loss(m: nn.Module) -> Tensor:
        edges, depth = m(x)
        smooth = torch.sqrt((depth[:, 1:] - depth[:, 1:]) ** 2).mean()  # sqrt at 0
        return edges.pow(2).mean() + smooth

    origin = train_step(DepthWithEdges(), loss, mode).origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("loss", "grad of output[1]")


class _Norms(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h * h).sum(-1).sqrt()  # its backward is 0/0 at a zero vector


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16, bias=False)
        self.scale = nn.Parameter(torch.ones(16))
        self.drop = nn.Dropout(0.1)
        self.lengths = _Norms()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (The Dropout gets a value of the encoder's own code, as GPT's wte + wpe.)
        return self.lengths(self.drop(self.proj(x) * self.scale))  # type: ignore[no-any-return]


def test_a_backward_path_leaves_out_passthrough_modules_as_forward_paths_do() -> None:
    torch.manual_seed(0)
    model = _Encoder()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    x = torch.randn(16, 8)
    x[5] = 0.0  # a blank sample: a zero vector, whose length's slope is 0/0
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        model(x).sum().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "lengths")
    assert "It then reached the backward of 1 module call (`proj`)" in origin.message


class ClassifierWithProjector(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU())
        self.cls = nn.Linear(64, 10)
        self.proj = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32))
        nn.init.zeros_(self.proj[2].weight)  # zero-initialised output layer: z is constant

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.enc(x)
        return self.cls(h), self.proj(h)


@pytest.mark.parametrize("backward", [True, "probes"])
def test_a_second_backward_through_a_retained_graph_is_told_apart_from_the_first(
    backward: object,
) -> None:
    # A classifier loss's backward (finite), then a VICReg variance term's through the same
    # forward (retain_graph=True): sqrt of a variance of 0 has an infinite slope. The loss's
    # backward made the NaN at the projector's output, not a module's backward.
    torch.manual_seed(0)
    model = ClassifierWithProjector()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 16), torch.randint(0, 10, (32,))
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", backward=backward) as guard:
        logits, z = model(x)
        loss_cls = guard.check_loss(nn.functional.cross_entropy(logits, y))
        opt.zero_grad()
        loss_cls.backward(retain_graph=True)
        loss_var = guard.check_loss(nn.functional.relu(1 - torch.sqrt(z.var(dim=0))).mean())
        loss_var.backward()
        opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert [(e.phase, e.details.get("reason"), e.tensor) for e in origins] == [
        ("loss", "loss_backward", "grad of output[1]")
    ]


class CosineHead(nn.Module):
    """A cosine classifier normalising its head's weight in its own code: the head module
    is never called, its weight only read (sqrt of a zero row's norm in the backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.cls = nn.Linear(16, 5, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        f = self.backbone(x)
        f = f / torch.sqrt((f**2).sum(1, keepdim=True) + 1e-6)
        w = self.cls.weight
        wn = w / torch.sqrt((w**2).sum(1, keepdim=True)).clamp_min(1e-12)
        return 16.0 * nn.functional.linear(f, wn)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_weight_the_parents_code_uses_has_its_backward_nan_named_there(mode: str) -> None:
    # A new class's zero row: only cls.weight's gradient is NaN. It was "no module's
    # backward could be named... check custom autograd Functions" on `cls`, never called.
    torch.manual_seed(0)
    model = CosineHead()
    opt = torch.optim.SGD(model.parameters(), 0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:  # type: ignore[arg-type]
        for step in range(3):
            if step == 2:
                with torch.no_grad():
                    model.cls.weight[4].zero_()
            x, y = torch.randn(16, 8), torch.randint(0, 5, (16,))
            loss = guard.check_loss(nn.functional.cross_entropy(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (2, "backward", "")
    assert origin.op == "aten.div.Tensor in SqrtBackward0"
    assert origin.source is not None
    assert "wn = w / torch.sqrt" in origin.source
    assert "`cls.weight`" in origin.message
    assert origin.hint is not None
    assert "eps inside the sqrt" in origin.hint
