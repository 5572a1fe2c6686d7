"""From a review with geometry and probabilistic models (Gaussian processes, rotations,
depth) and an attack on how real code changes a watched model."""

from __future__ import annotations

import logging
import sys
import warnings

import pytest
import torch
from torch import nn

import nanguard
import nanguard._guard


class RBFKernel(nn.Module):
    """A deep-kernel GP's kernel; its lengthscale |raw| is 0 at init: 0/0 on the diagonal."""

    def __init__(self, lengthscale: float) -> None:
        super().__init__()
        self.raw = nn.Parameter(torch.tensor(lengthscale))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return torch.exp(-0.5 * torch.cdist(z, z).pow(2) / self.raw.abs() ** 2)


class ExactGP(nn.Module):
    """The negative marginal log likelihood through a Cholesky factor, in the forward."""

    def __init__(self, lengthscale: float, jitter: float) -> None:
        super().__init__()
        self.feat = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
        self.kernel = RBFKernel(lengthscale)
        self.jitter = jitter

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        k = self.kernel(self.feat(x)) + self.jitter * torch.eye(x.shape[0])
        chol = torch.linalg.cholesky(k)
        alpha = torch.cholesky_solve(y[:, None], chol)[:, 0]
        return 0.5 * (y * alpha).mean() + torch.log(torch.diagonal(chol)).mean()


def _fit(model: nn.Module, mode: str, x: torch.Tensor) -> tuple[nanguard.Guard, BaseException]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    y = torch.sin(x[:, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", nanguard.NonFiniteWarning)
        with (
            nanguard.watch(model, optimizer=opt, mode=mode) as guard,
            pytest.raises(torch.linalg.LinAlgError) as raised,
        ):
            guard.check_loss(model(x, y))
    return guard, raised.value


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_cholesky_refusing_a_nan_kernel_names_where_the_nan_was_made(mode: str) -> None:
    # torch says "not positive-definite"; the matrix holds NaN from 0/0 (lengthscale 0).
    torch.manual_seed(0)
    guard, error = _fit(ExactGP(lengthscale=0.0, jitter=1e-2), mode, torch.randn(512, 8))
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "kernel", "nan")
    assert origin.op == "aten.div.Tensor"
    assert origin.source is not None
    assert "self.raw.abs() ** 2" in origin.source
    notes = getattr(error, "__notes__", [])
    assert any("`kernel` (RBFKernel)" in note for note in notes)  # told with the error


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_cholesky_refusing_a_finite_matrix_is_not_reported(mode: str) -> None:
    # Duplicated points and no jitter: singular but finite. Not nanguard's business.
    torch.manual_seed(0)
    x = torch.randn(256, 8).repeat(2, 1)
    guard, error = _fit(ExactGP(lengthscale=1.0, jitter=0.0), mode, x)
    assert guard.events == []
    (note,) = getattr(error, "__notes__", [])
    assert "the matrix is finite and not positive-definite: add a jitter" in note


class InlineGP(ExactGP):
    """The same GP with its kernel computed in its own forward (no kernel module)."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = self.feat(x)
        k = torch.exp(-0.5 * torch.cdist(z, z).pow(2) / self.kernel.raw.abs() ** 2)
        chol = torch.linalg.cholesky(k + self.jitter * torch.eye(x.shape[0]))
        alpha = torch.cholesky_solve(y[:, None], chol)[:, 0]
        return 0.5 * (y * alpha).mean() + torch.log(torch.diagonal(chol)).mean()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_kernel_made_in_the_models_own_code_is_not_called_finite(mode: str) -> None:
    # Every module's output was finite: the note said the matrix was finite, add a jitter.
    torch.manual_seed(0)
    guard, error = _fit(InlineGP(lengthscale=0.0, jitter=1e-2), mode, torch.randn(512, 8))
    (note,) = getattr(error, "__notes__", [])
    assert note.startswith(
        "nanguard: step 0: the matrix was not finite: `aten.div.Tensor` made NaN in "
        "InlineGP.forward's own code at "
    )
    assert "self.kernel.raw.abs() ** 2" in note
    assert "add a jitter" not in note
    # ...and an event of it, the guard's origin (log_path, guard.events), not a note only.
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.op) == (
        0,
        "forward",
        "",
        "aten.div.Tensor",
    )
    assert origin.details["raised"] == "_LinAlgError"


class PoseHead(nn.Module):
    """Regresses a unit quaternion (PoseNet-style)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.net(x)
        return q / q.norm(dim=-1, keepdim=True).clamp_min(1e-8)


def geodesic_loss(q: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """2 acos(|<q, t>|), unclamped: a dot product of unit vectors can round past 1."""
    return (2 * torch.acos((q * target).sum(-1).abs())).mean()


def _loss_origin(mode: str, loss_fn: object, target: torch.Tensor) -> nanguard.Event:
    torch.manual_seed(0)
    model = PoseHead()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, 32)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        q = model(x)
        target = q.detach().clone() if target.numel() == 0 else target
        loss = guard.check_loss(loss_fn(q, target))  # type: ignore[operator]
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details.get("reason")) == ("loss", "loss")
    assert origin.hint is not None
    return origin


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loss_made_nan_by_its_own_acos_names_the_acos(mode: str) -> None:
    # The prediction equals the target: <q, q> rounds to 1.0000001 for some rows.
    def scaled(q: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return geodesic_loss(q * 1.0001, t)  # (every row past 1, whatever the rounding)

    origin = _loss_origin(mode, scaled, torch.empty(0))
    assert "acos/asin: NaN past +-1" in origin.hint
    assert "clamp to +-(1 - 1e-7)" in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loss_made_nan_by_a_log_masked_by_multiplying_names_the_log(mode: str) -> None:
    # A scale-invariant log loss on depth, "masked" by multiplying: log(0) at missing pixels
    # is -inf, and -inf * 0 is NaN.
    def si_log(q: torch.Tensor, gt: torch.Tensor) -> torch.Tensor:
        valid = (gt > 0).float()
        d = (torch.log(q.abs() + 1) - torch.log(gt)) * valid
        return (d**2).sum() / valid.sum()

    gt = torch.rand(64, 4) + 0.5
    gt[:, 0] = 0.0  # missing depth
    origin = _loss_origin(mode, si_log, gt)
    assert origin.hint.startswith("The loss is NaN from finite outputs: NaN in the targets, or")
    assert "log: NaN below 0, -Inf at 0, then inf - inf or 0 * -inf (a mask)" in origin.hint
    assert "index the valid entries" in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loss_of_nan_targets_through_safe_operations_keeps_the_general_hint(mode: str) -> None:
    gt = torch.randn(64, 4)
    gt[3, 1] = float("nan")
    origin = _loss_origin(mode, torch.nn.functional.mse_loss, gt)
    assert "one of its own operations" not in origin.hint
    assert "NaN in the targets" in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loss_backward_made_nan_by_its_own_sqrt_names_the_sqrt(mode: str) -> None:
    # A Euclidean distance loss, sqrt(sum(d**2)), at a prediction equal to its target: the
    # loss is finite, sqrt's slope at 0 is not.
    torch.manual_seed(0)
    model = PoseHead()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        q = model(torch.randn(64, 32))
        target = torch.randn(64, 4)
        target[5] = q[5].detach()
        loss = guard.check_loss(((q - target) ** 2).sum(-1).sqrt().mean())
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details.get("reason")) == ("loss", "loss_backward")
    assert origin.hint is not None
    assert "its own operations include sqrt, whose slope is Inf at 0" in origin.hint
    assert "x ** p" not in origin.hint


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_loss_over_two_forwards_names_the_log_between_them(mode: str) -> None:
    # A consistency loss: log(0) of the first forward's output, made before the second
    # forward ran; the loss's own operations are those after each forward's outputs.
    torch.manual_seed(0)
    model = PoseHead()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        first = torch.log(model(torch.randn(16, 32)).abs() * 0)  # -inf
        second = model(torch.randn(16, 32))
        loss = guard.check_loss((first - second).mean())
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.details.get("reason")) == ("loss", "loss")
    assert origin.hint is not None
    assert "one of its own operations: log(0)" in origin.hint


def test_a_freed_output_nodes_id_reused_by_the_loss_does_not_hide_the_loss() -> None:
    # An output node recorded by a forward whose graph was freed: Python may give its id to
    # a node the loss makes later. The node's number tells them apart.
    from nanguard._probes import ForwardRecord
    from nanguard._resolution import _loss_nodes

    x = torch.rand(3, requires_grad=True)
    out = x * 2  # the model's output
    loss = torch.log(out - out.detach()).sum()
    record = ForwardRecord(0, 0, True, 0)
    record.output_seq = out.grad_fn._sequence_nr()
    record.output_node_ids = ((id(out.grad_fn), out.grad_fn._sequence_nr()), (id(loss.grad_fn), -1))
    names = _loss_nodes(loss.grad_fn, [record])
    assert names[:2] == ("SumBackward0", "LogBackward0")


class _ClampedLogGP(nn.Module):
    """Log features clamped (log(p).clamp(min=-100): a -Inf the clamp absorbs), then a
    low-rank kernel: finite and singular."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = torch.sigmoid(self.enc(x)) * (x > 0)  # some exact zeros
        f = torch.log(p).clamp(min=-100.0)
        return torch.linalg.cholesky(f @ f.T).sum()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_singular_finite_matrix_after_an_absorbed_minus_inf_gets_the_jitter_note(
    mode: str,
) -> None:
    # The replay named the log's -Inf, which the clamp absorbed: "the matrix was not finite".
    torch.manual_seed(0)
    model = _ClampedLogGP()
    with (
        nanguard.watch(model, mode=mode, on_nonfinite="warn"),
        pytest.raises(torch.linalg.LinAlgError) as raised,
    ):
        model(torch.randn(8, 4))
    (note,) = getattr(raised.value, "__notes__", [])
    assert "the matrix is finite and not positive-definite: add a jitter" in note
    assert "the matrix was not finite" not in note


class _BallGroup(nn.Module):
    """PointNet++-style grouping: the max of features over each query's ball of points."""

    def __init__(self, d: int, radius: float) -> None:
        super().__init__()
        self.radius = radius
        self.mlp = nn.Linear(d + 3, d)

    def forward(self, pos: torch.Tensor, feat: torch.Tensor, centers: torch.Tensor) -> torch.Tensor:
        d2 = ((centers[:, :, None] - pos[:, None]) ** 2).sum(-1)
        inside = d2 < self.radius**2
        rel = pos[:, None] - centers[:, :, None]
        h = self.mlp(torch.cat([feat[:, None].expand(-1, centers.shape[1], -1, -1), rel], -1))
        return h.masked_fill(~inside[..., None], float("-inf")).amax(2)  # empty ball: -inf


class _PointNet(nn.Module):
    def __init__(self, d: int = 32) -> None:
        super().__init__()
        self.emb = nn.Linear(3, d)
        self.group = _BallGroup(d, 0.3)
        self.out = nn.Linear(d, 4)
        axis = torch.linspace(0.2, 0.8, 2)
        grid = torch.stack(torch.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(1, 8, 3)
        self.register_buffer("grid", grid)

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        centers = self.grid.expand(pos.shape[0], -1, -1)
        return self.out(self.group(pos, self.emb(pos), centers)).mean(1)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_minus_inf_from_an_empty_ball_names_the_grouping_that_made_it(mode: str) -> None:
    # The Linear after it makes the NaN; the message said "see where it was made" but never
    # named the grouping whose output held the -Inf.
    torch.manual_seed(0)
    model = _PointNet()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        pos = torch.rand(4, 256, 3)
        pos[1] *= 0.1  # a small object: most queries find no point
        loss = model(pos).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "out")
    assert "It came out of `group` (_BallGroup): look there" in origin.message


class _Python310:
    """``sys`` as Python 3.10 shows it to nanguard: no exception notes."""

    version_info = (3, 10, 13, "final", 0)

    def __getattr__(self, name: str) -> object:
        return getattr(sys, name)


def test_on_python_3_10_the_note_on_a_refused_matrix_is_logged_not_lost(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Python 3.10 neither has add_note nor prints __notes__: the note, nanguard's only word
    # on a finite singular matrix, is kept in __notes__ and logged.
    monkeypatch.setattr(nanguard._guard, "sys", _Python310())
    torch.manual_seed(0)
    x = torch.randn(256, 8).repeat(2, 1)
    with caplog.at_level(logging.WARNING, logger="nanguard"):
        guard, error = _fit(ExactGP(lengthscale=1.0, jitter=0.0), "full", x)
    assert guard.events == []
    (note,) = getattr(error, "__notes__", [])
    assert "the matrix is finite and not positive-definite: add a jitter" in note
    assert any(note in r.getMessage() for r in caplog.records)


class PoincareDistance(nn.Module):
    def forward(self, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        sqdist = ((u - v) ** 2).sum(-1)
        squnorm = (u**2).sum(-1).clamp(max=1 - 1e-5)
        sqvnorm = (v**2).sum(-1).clamp(max=1 - 1e-5)
        return torch.acosh(1 + 2 * sqdist / ((1 - squnorm) * (1 - sqvnorm)))


class PoincareEmbedding(nn.Module):
    """Poincare embeddings (facebookresearch/poincare-embeddings): each row scores an
    anchor against its positive and sampled negatives by hyperbolic distance."""

    def __init__(self, nodes: int = 20_000, dim: int = 10) -> None:
        super().__init__()
        self.lt = nn.Embedding(nodes, dim)
        self.lt.weight.data.uniform_(-1e-3, 1e-3)
        self.dist = PoincareDistance()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        e = self.lt(idx)
        return -self.dist(e[:, :1].expand_as(e[:, 1:]), e[:, 1:])


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_node_sampled_as_its_own_negative_gets_the_acosh_hint(mode: str) -> None:
    # acosh'(1) = 1 / sqrt(0): a distance between identical points has an infinite slope.
    torch.manual_seed(0)
    model = PoincareEmbedding()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    idx = torch.randint(0, 20_000, (512, 21))
    idx[7, 13] = idx[7, 0]  # the anchor drawn among its own negatives
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        target = torch.zeros(512, dtype=torch.long)
        loss = guard.check_loss(nn.functional.cross_entropy(model(idx), target))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "dist")
    assert origin.op is not None
    assert "AcoshBackward0" in origin.op
    assert origin.hint is not None
    assert "the derivative of acosh, 1 / sqrt(x*x - 1), is infinite at 1" in origin.hint


class LorentzDistance(nn.Module):
    """The Lorentz model's distance, acosh(-<u, v>_L): exactly 1 for identical points, and
    float rounding takes it just below (here a tiny margin subtracted makes that sure)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 3)

    def forward(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        u, v = self.emb(i), self.emb(j)
        u0 = torch.sqrt(1 + u.pow(2).sum(-1, keepdim=True))
        v0 = torch.sqrt(1 + v.pow(2).sum(-1, keepdim=True))
        inner = (u0 * v0).squeeze(-1) - (u * v).sum(-1)
        return torch.acosh(inner - 1e-6)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_acosh_of_a_value_below_one_gets_its_domain_hint(mode: str) -> None:
    torch.manual_seed(0)
    model = LorentzDistance()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        d = model(torch.tensor([1, 2, 3]), torch.tensor([4, 2, 5]))  # (2, 2): the same point
        loss = guard.check_loss(d.mean())
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.op) == ("forward", "aten.acosh.default")
    assert origin.hint is not None
    assert "got a value below 1" in origin.hint
    assert "Clamp it to 1 + eps" in origin.hint


class _RidgeReadout(nn.Module):
    """A few-shot closed-form readout (R2D2, MetaOptNet): least squares over ReLU features of
    the support images, W = solve(F^T F, F^T Y), with no ridge term."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 64), nn.ReLU())
        with torch.no_grad():
            self.features[1].bias[:4] = -100.0  # dead units: 0 on every image

    def forward(
        self, support: torch.Tensor, labels: torch.Tensor, query: torch.Tensor
    ) -> torch.Tensor:
        f = self.features(support)
        gram = f.T @ f  # 64 features, 10 support images: rank 10 at most
        w = torch.linalg.solve(gram, f.T @ nn.functional.one_hot(labels, 5).float())
        return self.features(query) @ w  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_singular_solve_gets_ridge_advice_not_cholesky(mode: str) -> None:
    torch.manual_seed(0)
    model = _RidgeReadout()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        support, labels = torch.randn(10, 3, 8, 8), torch.arange(5).repeat(2)
        with pytest.raises(torch.linalg.LinAlgError, match="singular") as raised:
            model(support, labels, torch.randn(15, 3, 8, 8))
    assert guard.events == []  # (nothing was non-finite)
    (note,) = getattr(raised.value, "__notes__", [])
    assert "the matrix is finite and singular (rank-deficient" in note
    assert "lstsq" in note
    assert "cholesky_ex" not in note


class _GaussianHead(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh())
        self.mean = nn.Linear(32, 2)
        self.scale = nn.Linear(32, 2)

    def forward(self, x: torch.Tensor) -> torch.distributions.Normal:
        h = self.body(x)
        scale = nn.functional.relu(self.scale(h))
        return torch.distributions.Normal(self.mean(h), scale, validate_args=True)


def test_a_distribution_refusing_a_finite_zero_scale_is_told_it_may_be_finite() -> None:
    """A ReLU'd scale is exactly 0 for some rows: Normal's argument check raises, and nothing
    is non-finite. The note must not send the user looking for an -inf only."""
    torch.manual_seed(0)
    model = _GaussianHead()
    opt = torch.optim.Adam(model.parameters(), 3e-4)
    with (
        nanguard.watch(model, optimizer=opt) as guard,
        pytest.raises(ValueError, match="scale") as raised,
    ):
        model(torch.randn(512, 8)).log_prob(torch.zeros(512, 2)).mean().backward()
    assert guard.events == []
    notes = getattr(raised.value, "__notes__", [])
    assert any("a scale of exactly 0 from a ReLU" in n for n in notes), notes
