"""From a review with numerical linear algebra as practitioners write it: Gaussian-process
heads, full-covariance posteriors, Cholesky factors and log-determinants."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributions import MultivariateNormal

import nanguard


class GPHead(nn.Module):
    """An exact GP's negative marginal likelihood, the kernel computed in its own forward.
    Its lengthscale is clipped at 0 by a ReLU (0 at init): 0/0 on the kernel's diagonal."""

    def __init__(self, factor: str) -> None:
        super().__init__()
        self.raw_ls = nn.Parameter(torch.tensor(0.5))
        self.factor = factor

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        ls = F.relu(self.raw_ls - 0.5)
        k = torch.exp(-0.5 * torch.cdist(z, z) ** 2 / ls**2) + 1e-6 * torch.eye(z.shape[0])
        if self.factor == "cholesky":
            chol = torch.linalg.cholesky(k)
        else:  # (info ignored: a failed factorisation leaves garbage in the factor)
            chol, _ = torch.linalg.cholesky_ex(k)
        alpha = torch.cholesky_solve(y[:, None], chol)[:, 0]
        logdet = 2 * torch.log(torch.diagonal(chol)).sum()
        return 0.5 * (y @ alpha) + 0.5 * logdet + 0.5 * z.shape[0] * math.log(2 * math.pi)


class DeepKernelGP(nn.Module):
    def __init__(self, factor: str = "cholesky") -> None:
        super().__init__()
        self.feat = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 4))
        self.gp = GPHead(factor)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.gp(self.feat(x), y) / x.shape[0]


def _gp_data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(192, 16)
    x = torch.cat([x, x[:64]])  # repeated measurements
    return x, torch.sin(x[:, :3].sum(-1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_kernel_made_in_a_submodules_own_code_is_named_with_its_line(mode: str) -> None:
    # The GP head's forward made the NaN and raised in Cholesky: the note said "what the
    # modules returned was finite ... the matrix is finite: add a jitter", of the top model.
    torch.manual_seed(0)
    model = DeepKernelGP()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = _gp_data()
    with (
        nanguard.watch(model, optimizer=opt, mode=mode) as guard,
        pytest.raises(torch.linalg.LinAlgError) as raised,
    ):
        guard.check_loss(model(x, y))
    (note,) = getattr(raised.value, "__notes__", [])
    assert note.startswith(
        "nanguard: step 0: the matrix was not finite: `aten.div.Tensor` made NaN in "
        "GPHead.forward's own code (`gp`) at "
    )
    assert "torch.cdist(z, z) ** 2 / ls**2" in note
    assert "add a jitter" not in note


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_finite_matrix_refused_in_a_submodule_names_that_submodule(mode: str) -> None:
    # A positive lengthscale and duplicated points: finite, singular. Its code is GPHead's.
    torch.manual_seed(0)
    model = DeepKernelGP()
    with torch.no_grad():
        model.gp.raw_ls.fill_(1.5)
    x, y = _gp_data()
    with nanguard.watch(model, mode=mode) as guard, pytest.raises(torch.linalg.LinAlgError) as e:
        guard.check_loss(model(x, y))
    (note,) = getattr(e.value, "__notes__", [])
    assert "Unless GPHead.forward's own code (`gp`) after them made the matrix non-finite" in note
    assert "the matrix is finite and not positive-definite: add a jitter" in note
    assert guard.events == []


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_log_of_a_failed_cholesky_factors_diagonal_says_the_factorisation_failed(
    mode: str,
) -> None:
    # cholesky_ex's info ignored: log(diag(L)) of the garbage left. "Clamp the input" would
    # give a finite, meaningless likelihood.
    torch.manual_seed(0)
    model = DeepKernelGP(factor="cholesky_ex")
    with torch.no_grad():
        model.gp.raw_ls.fill_(1.5)
    x, y = _gp_data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard:
            guard.check_loss(model(x, y))
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "gp", "aten.log.default")
    assert origin.hint is not None
    assert "took the log of a matrix diagonal" in origin.hint
    assert "cholesky_ex with info > 0" in origin.hint
    assert "clamp_min" not in origin.hint


class FullCovHead(nn.Module):
    """A VAE posterior with a full covariance A @ A.T of rank 4 < 16: singular."""

    def __init__(self, kl: str) -> None:
        super().__init__()
        self.mu = nn.Linear(64, 16)
        self.fac = nn.Linear(64, 16 * 4)
        self.kl = kl

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mu = self.mu(h)
        a = self.fac(h).view(-1, 16, 4)
        sigma = a @ a.transpose(1, 2)
        if self.kl == "distribution":
            q = MultivariateNormal(mu, covariance_matrix=sigma, validate_args=True)
            prior = MultivariateNormal(torch.zeros(16), torch.eye(16))
            return q.rsample(), torch.distributions.kl_divergence(q, prior)
        trace = sigma.diagonal(dim1=1, dim2=2).sum(-1)
        return mu, 0.5 * (trace + (mu**2).sum(-1) - 16 - torch.logdet(sigma))


class FullCovVAE(nn.Module):
    def __init__(self, kl: str) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(32, 64), nn.ReLU())
        self.head = FullCovHead(kl)
        self.dec = nn.Linear(16, 32)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z, kl = self.head(self.enc(x))
        return self.dec(z), kl


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("batch", [2, 128])  # (torch prints 2 matrices whole: no "...")
def test_a_singular_covariance_refused_by_a_distribution_gets_covariance_advice(
    mode: str, batch: int
) -> None:
    torch.manual_seed(0)
    model = FullCovVAE("distribution")
    with (
        nanguard.watch(model, mode=mode) as guard,
        pytest.raises(ValueError, match="PositiveDefinite") as raised,
    ):
        guard.check_loss(model(torch.rand(batch, 32))[1].mean())
    (note,) = getattr(raised.value, "__notes__", [])
    if mode == "full":
        assert "made in FullCovHead.forward's own code (`head`) after them" in note
    assert "a covariance that is finite but not positive-definite" in note
    assert "add a jitter to its diagonal" in note
    assert "a state with no legal action" not in note


def test_logdet_of_a_singular_covariance_says_keep_it_positive_definite() -> None:
    # Round-off makes some determinants of A @ A.T negative: logdet is NaN there.
    torch.manual_seed(0)
    model = FullCovVAE("logdet")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with nanguard.watch(model, on_nonfinite="log") as guard:
            guard.check_loss(model(torch.rand(128, 32))[1].mean())
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "head")
    assert origin.hint is not None
    assert "For a covariance" in origin.hint
    assert "positive-definite" in origin.hint


class LogEnrichedPINN(nn.Module):
    """u = (1 - r^2) net(x, y, log r) for a point source: finite at r = 1e-20 (log r = -46),
    its slope x / r^2 too, its second derivative ~ 1 / r^2 overflows."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 64), nn.Tanh(), nn.Linear(64, 1))

    def forward(self, xy: torch.Tensor) -> torch.Tensor:
        x, y = xy[:, :1], xy[:, 1:]
        r2 = x**2 + y**2
        return (1 - r2) * self.net(torch.cat([x, y, 0.5 * torch.log(r2)], dim=1))  # type: ignore[no-any-return]


def test_a_pinn_loss_of_overflowing_second_derivatives_is_not_headlined_as_the_loss_alone() -> None:
    # The message began "the loss function created it" and named the cause only after.
    torch.manual_seed(0)
    model = LogEnrichedPINN()
    xy = torch.rand(128, 2) * 2 - 1
    xy[0] = torch.tensor([1e-20, 0.0])  # a collocation point at the source
    xy.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with nanguard.watch(model, on_nonfinite="log") as guard:
            u = model(xy)
            du = torch.autograd.grad(u.sum(), xy, create_graph=True)[0]
            u_xx = torch.autograd.grad(du[:, 0].sum(), xy, create_graph=True)[0][:, 0]
            u_yy = torch.autograd.grad(du[:, 1].sum(), xy, create_graph=True)[0][:, 1]
            guard.check_loss(((u_xx + u_yy + 1) ** 2).mean()).backward()
            guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "loss"
    assert "the loss function created it" not in origin.message
    assert "or the derivatives through the model that it is built on" in origin.message
    assert "The loss was built on derivatives taken through the model" in origin.message


@pytest.mark.parametrize(
    "line",
    [
        "logdet = 2 * torch.log(L.diagonal(dim1=-2, dim2=-1)).sum(-1)",
        "logdet = 2 * torch.log(torch.diagonal(L)).sum()",
        "logdet = 2 * L.diagonal(dim1=-2, dim2=-1).log().sum(-1)",
    ],
)
def test_every_spelling_of_a_factors_log_diagonal_gets_the_failed_factorisation_hint(
    line: str,
) -> None:
    from nanguard._hints import HintContext, hint
    from nanguard._opwatch import OpInfo

    op = OpInfo(
        "aten.log.default", (), None, direction="forward", source=f"/gp.py:7 in forward: {line}"
    )
    text = hint(HintContext(phase="forward", kind="inf", reason="own_code", op=op))
    assert "took the log of a matrix diagonal" in text
    assert "clamp_min" not in text


def test_a_solve_with_a_singular_factor_says_the_factorisation_failed() -> None:
    # The usual GP loss: cholesky_ex (info ignored), then cholesky_solve makes the NaN.
    from nanguard._hints import HintContext, hint
    from nanguard._opwatch import OpInfo

    op = OpInfo("aten.cholesky_solve.default", (), None, direction="forward")
    text = hint(HintContext(phase="forward", kind="nan", reason="own_code", op=op))
    assert "triangular factor that is singular" in text
    assert "cholesky_ex with info > 0" in text
    assert "does not recognise" not in text
