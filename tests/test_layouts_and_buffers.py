"""Sparse gradients, nested tensors, accumulation past the kept gradients, buffers that
overflow: cases from a sweep of realistic models."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import nanguard


class Recommender(nn.Module):
    """A sparse embedding (SparseAdam/SGD-style recommender) and a linear score."""

    def __init__(self) -> None:
        super().__init__()
        self.users = nn.Embedding(100, 8, sparse=True)
        self.score = nn.Linear(8, 1)

    def forward(self, users: Tensor) -> Tensor:
        return self.score(self.users(users)).squeeze(-1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_missing_label_with_sparse_embedding_gradients_is_the_loss(mode: str) -> None:
    torch.manual_seed(0)
    model = Recommender()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for step in range(2):
            y = torch.rand(16)
            if step == 1:
                y[3] = float("nan")  # a missing rating
            loss = guard.check_loss(F.mse_loss(model(torch.randint(0, 100, (16,))), y))
            opt.zero_grad()
            loss.backward()
            if step == 1:
                with pytest.raises(nanguard.NonFiniteError, match="loss"):
                    opt.step()
            else:
                opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.step, origin.module) == ("loss", 1, None)
    assert model.users.weight.isfinite().all()  # the step was not applied


class _Coalesces(TorchDispatchMode):
    """Counts the coalescing of sparse tensors (a copy and sort of every stored value)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func.overloadpacket in (torch.ops.aten._coalesce, torch.ops.aten.coalesce):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_sparse_gradients_are_not_coalesced_again_each_step(mode: str) -> None:
    # An embedding's sparse gradient is uncoalesced; coalescing it for the gradient norm
    # each step cost a DLRM-style step (1 GiB of tables) 30%, in every mode.
    def coalesces(guarded: bool) -> int:
        torch.manual_seed(0)
        model = Recommender()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        guard = nanguard.watch(model, optimizer=opt, mode=mode) if guarded else None
        try:
            counter = _Coalesces()
            for step in range(3):
                loss = F.mse_loss(model(torch.randint(0, 100, (16,))), torch.rand(16))
                opt.zero_grad()
                loss.backward()
                if step == 2:
                    with counter:
                        opt.step()  # (the guard's end of step runs first, in its hook)
                else:
                    opt.step()
        finally:
            if guard is not None:
                guard.detach()
        return counter.count

    assert coalesces(True) == coalesces(False)


class Classifier(nn.Module):
    """A Transformer encoder with a padding mask: in eval under no_grad PyTorch runs its
    fast path on nested tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(300, 64)
        layer = nn.TransformerEncoderLayer(64, 4, 128, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2)
        self.head = nn.Linear(64, 3)

    def forward(self, tokens: Tensor, padding: Tensor) -> Tensor:
        return self.head(self.encoder(self.embed(tokens), src_key_padding_mask=padding)[:, 0])


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_the_fast_path_on_nested_tensors_names_the_layer_that_overflowed(mode: str) -> None:
    torch.manual_seed(0)
    model = Classifier().eval()
    with torch.no_grad():
        model.encoder.layers[1].linear2.weight.mul_(1e37)  # finite, but its output is not
    tokens = torch.randint(0, 300, (8, 12))
    padding = torch.zeros(8, 12, dtype=torch.bool)
    padding[1, 6:] = True
    with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard, torch.no_grad():
        model(tokens, padding)
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert origin.module is not None
    assert origin.module.startswith("encoder.layers.1")
    assert len(origin.message) < 2000  # no dispatcher error dump pasted into it


class SmoothedDistances(nn.Module):
    """Pairwise distances with an ``eps`` under the sqrt (a contrastive loss's)."""

    def forward(self, e: Tensor, eps: float) -> Tensor:
        return ((e[:, None, :] - e[None, :, :]).pow(2).sum(-1) + eps).sqrt()


class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
        self.distances = SmoothedDistances()

    def forward(self, x: Tensor, eps: float) -> Tensor:
        return self.distances(self.encode(x), eps)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_bad_backward_past_the_kept_micro_batches_is_not_pinned_on_a_good_one(
    mode: str,
) -> None:
    """12 micro-batches; the one whose distances hit sqrt(0) comes after the 8 whose
    output gradients are kept: no earlier, healthy backward may take the blame."""
    torch.manual_seed(0)
    model = Embedder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        opt.zero_grad()
        for k in range(12):
            d = model(torch.randn(8, 16), 0.0 if k == 10 else 1e-6)  # eps forgotten once
            (F.relu(1.0 - d).mean() / 12).backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "grad"  # named down to the parameter, and the event says why
    assert "no module's backward could be named" in origin.message
    assert not [e for e in guard.events if e.phase == "backward" and e.is_origin]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_running_variance_that_overflows_is_found_by_the_sweep(mode: str) -> None:
    """One batch of huge but finite activations: the variance overflows to +Inf while
    every output, loss and gradient stays finite; eval() would output garbage."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(8, 2),
    )  # fmt: skip
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(20):
            x = torch.randn(4, 3, 8, 8) * (1e20 if step == 2 else 1.0)
            loss = guard.check_loss(F.cross_entropy(model(x), torch.randint(0, 2, (4,))))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert not model[1].running_var.isfinite().all()
    [event] = guard.events
    assert (event.phase, event.param, event.kind, event.is_origin) == (
        "param",
        "1.running_var",
        "inf",
        True,
    )
    if mode == "full":  # (checked at every step's end: found in the step that made it)
        assert event.step == 2
        assert "became +Inf: " in event.message
    else:
        assert "became +Inf between step 0 and step" in event.message
    assert "square overflows" in event.message


def test_a_causal_mask_buffer_present_at_attach_stays_a_mask() -> None:
    class Causal(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)
            self.register_buffer("causal", torch.full((6, 6), float("-inf")).triu(1))

        def forward(self, x: Tensor) -> Tensor:
            scores = self.proj(x) @ x.transpose(-1, -2) + self.causal
            return scores.softmax(-1) @ x

    torch.manual_seed(0)
    model = Causal()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with nanguard.watch(model, optimizer=opt, check_params=1) as guard:
        for _ in range(3):
            loss = model(torch.randn(2, 6, 8)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []


class ScaledBatchNorm(nn.BatchNorm1d):
    """A BatchNorm variant that rescales each row by its L1 norm times a temperature."""

    def forward(self, x: Tensor, temperature: float = 1.0) -> Tensor:  # type: ignore[override]
        y = super().forward(x)
        return y / (y.abs().sum(-1, keepdim=True) * temperature)


class ScaledNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 8, bias=False)
        self.norm = ScaledBatchNorm(8)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor, temperature: float) -> Tensor:
        return self.head(self.norm(self.lin(x), temperature))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_stale_running_statistic_does_not_excuse_a_new_nan_in_training_mode(mode: str) -> None:
    """The running variance went +Inf after step 0 (as an overflowing batch leaves it; not
    swept yet); step 2 makes NaN in the same module (a temperature of 0). A BatchNorm in
    training mode does not use its running statistics, so the NaN is a new origin."""
    torch.manual_seed(0)
    model = ScaledNet()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    options = {"check_params": 1000, "on_nonfinite": "log"}
    with nanguard.watch(model, optimizer=opt, mode=mode, **options) as guard:
        for step in range(3):
            loss = guard.check_loss(
                model(torch.randn(6, 4), 0.0 if step == 2 else 1.0).pow(2).mean()
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
            if step == 0:
                with torch.no_grad():
                    model.norm.running_var.fill_(float("inf"))
    forward = [e for e in guard.events if e.is_origin and e.phase == "forward"]
    assert [(e.step, e.module) for e in forward] == [(2, "norm")]
    # The running variance, overflowed after step 0, is its own report: at the next step's
    # end in full mode (running statistics are checked at every step's end there), at the
    # failing step's sweep in sentinel mode.
    buffer = next(e for e in guard.events if e.param == "norm.running_var")
    assert buffer.is_origin
    if mode == "full":
        assert buffer.step == 1
    else:
        assert "between step 0 and step" in buffer.message


class SpectralGain(nn.Module):
    """A spectral layer (FNO style) dividing the spectrum by a gain that can be 0."""

    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(5))

    def forward(self, x: Tensor) -> Tensor:
        return torch.fft.rfft(x) / self.gain


def test_complex_values_are_counted_per_element() -> None:
    model = nn.Sequential(SpectralGain())
    with torch.no_grad():
        model[0].gain[2] = 0.0  # one frequency of each of 3 samples divided by 0
    with nanguard.watch(model, on_nonfinite="log") as guard, torch.no_grad():
        model(torch.randn(3, 8))
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.op) == ("0", "aten.div.Tensor")
    assert origin.stats is not None
    assert origin.stats.dtype == "torch.complex64"
    assert (origin.stats.numel, origin.stats.nonfinite_count) == (15, 3)


def test_statistics_of_a_sparse_adjacency_count_its_zeros() -> None:
    """A GCN's normalised sparse adjacency with NaN rows (an isolated node): the summary
    is that of the whole matrix, as its dense form gives it, not of the stored values."""
    from nanguard._checks import tensor_stats

    torch.manual_seed(0)
    n = 300
    edges = torch.randint(0, n, (2, 2000))
    values = torch.rand(2000) * 0.5 + 0.1
    values[:5] = float("nan")
    sparse = torch.sparse_coo_tensor(edges, values, (n, n)).coalesce()
    got, want = tensor_stats(sparse), tensor_stats(sparse.to_dense())
    assert (got.numel, got.nan_count) == (want.numel, want.nan_count)
    assert got.min == want.min == 0.0
    assert got.max == pytest.approx(want.max)
    assert got.mean == pytest.approx(want.mean, rel=1e-6)
    assert got.std == pytest.approx(want.std, rel=1e-6)


class KeepsAWeightView(nn.Module):
    """Leaves a view of its weight made with autograd as an attribute, as FSDP1 leaves its
    modules' views of the flat parameter whose storage it then frees."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.w_view = self.lin.weight * 1.0
        return self.lin(x)


def test_a_module_attribute_whose_storage_was_freed_is_not_read() -> None:
    # A loss origin makes nanguard look through the modules' tensor attributes for a stored
    # auxiliary loss: reading one whose storage FSDP freed crashed the process.
    model = KeepsAWeightView()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        out = model(torch.randn(2, 4))
        model.w_view.untyped_storage().resize_(0)  # freed, as FSDP frees its flat parameter
        loss = guard.check_loss(out.sum() * float("nan"))
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("loss", None)


class EMAQuantizer(nn.Module):
    """VQ-VAE's EMA codebook without Laplace smoothing of the cluster sizes (sonnet's
    VectorQuantizerEMA before it had one): a code no vector chose gets embed_avg / 0."""

    def __init__(self, codes: int = 128, dim: int = 16, decay: float = 0.99) -> None:
        super().__init__()
        self.codes, self.decay = codes, decay
        embed = torch.randn(codes, dim)
        self.register_buffer("embed", embed)
        self.register_buffer("cluster_size", torch.zeros(codes))
        self.register_buffer("embed_avg", embed.clone())

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        b, d, h, w = z.shape
        flat = z.permute(0, 2, 3, 1).reshape(-1, d)
        dist = flat.pow(2).sum(1, keepdim=True) - 2 * flat @ self.embed.T + self.embed.pow(2).sum(1)
        q = self.embed[dist.argmin(1)]
        if self.training:
            with torch.no_grad():
                onehot = F.one_hot(dist.argmin(1), self.codes).type(flat.dtype)
                self.cluster_size.mul_(self.decay).add_(onehot.sum(0), alpha=1 - self.decay)
                self.embed_avg.mul_(self.decay).add_(onehot.T @ flat, alpha=1 - self.decay)
                self.embed.copy_(self.embed_avg / self.cluster_size[:, None])  # dead code: x/0
        commit = F.mse_loss(flat, q.detach())
        q = flat + (q - flat).detach()  # straight-through
        return q.view(b, h, w, d).permute(0, 3, 1, 2), commit


class VQVAE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, 32, 4, 2, 1), nn.ReLU(), nn.Conv2d(32, 16, 4, 2, 1))
        self.vq = EMAQuantizer()
        self.dec = nn.Sequential(
            nn.ConvTranspose2d(16, 32, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(32, 3, 4, 2, 1)
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        q, commit = self.vq(self.enc(x))
        return self.dec(q), commit


def _train_vqvae(mode: str, policy: str, steps: int = 3) -> tuple[nanguard.Guard, VQVAE]:
    torch.manual_seed(0)
    model = VQVAE()
    opt = torch.optim.Adam(model.parameters(), lr=2e-4)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite=policy) as guard:
        for _ in range(steps):
            x = torch.rand(16, 3, 16, 16)
            recon, commit = model(x)
            loss = guard.check_loss(F.mse_loss(recon, x) + 0.25 * commit)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return guard, model


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_ema_codebook_a_forward_divides_by_a_dead_codes_zero_count_is_the_origin(
    mode: str,
) -> None:
    # Step 0's outputs, loss and gradients are finite; the codebook written in its forward
    # is not, and step 1 is NaN everywhere: the origin is step 0's write, not "nothing new".
    guard, _ = _train_vqvae(mode, "log")
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module, origin.param) == (
        0,
        "param",
        "vq",
        "vq.embed",
    )
    assert origin.op == "aten.div.Tensor"
    assert origin.source is not None
    assert "self.embed_avg / self.cluster_size" in origin.source
    assert "writes it in place" in origin.message
    assert origin.hint is not None
    assert "divided by zero" in origin.hint


def test_skip_step_puts_back_an_ema_codebook_the_first_forward_wrote_non_finite() -> None:
    guard, model = _train_vqvae("full", "skip_step", steps=2)
    assert torch.isfinite(model.vq.embed).all()  # put back after each dropped step
    skips = [e for e in guard.events if e.details.get("skipped")]
    assert len(skips) == 2
    assert "vq.embed" in skips[0].message


@pytest.mark.parametrize(("every", "found"), [(1, 5), (4, 8)])
def test_running_statistics_a_finite_outlier_overflowed_are_reported_in_their_step(
    every: int, found: int
) -> None:
    # A glitched reading of 1e20 (finite): its square overflows BatchNorm's variance, the
    # running_var goes +Inf, yet the batch's outputs, loss and gradients are finite. Full
    # mode checks it at every step's end; with every=4 the steps between probe no module,
    # and the full step that finds it must not say it made it.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", every=every) as guard:
        for step in range(10):
            x = torch.randn(64, 4)
            if step == 5:
                x[7, 2] = 1e20
            loss = F.mse_loss(model(x), torch.randn(64, 1))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.param) == (found, "param", "1.running_var")
    assert ("between step" in origin.message) == (every > 1)
    assert "square overflows" in origin.message


def test_lazy_norms_before_their_first_forward_are_left_alone_at_a_step_end() -> None:
    # (Their running statistics are placeholders without values until the first forward.)
    model = nn.Sequential(nn.LazyLinear(8), nn.LazyBatchNorm1d(), nn.Linear(8, 1))
    with nanguard.watch(model) as guard:
        guard.step()  # a step ended before any forward (a loop's first guard.step())
        model(torch.randn(4, 3)).sum().backward()
        guard.step()
    assert guard.events == []


class ClassMinNorm(nn.Module):
    """Keeps the smallest feature norm of each class in the batch: filled with +inf, then a
    scatter-min; a class absent from the batch keeps +inf, which min() skips (on purpose)."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
        self.cls = nn.Linear(16, classes)
        self.register_buffer("class_min_norm", torch.zeros(classes))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        f = self.body(x)
        with torch.no_grad():
            self.class_min_norm.fill_(float("inf"))
            self.class_min_norm.scatter_reduce_(0, y, f.norm(dim=1), reduce="amin")
        return self.cls(f)


def test_a_buffer_a_forward_fills_with_inf_on_purpose_is_no_origin() -> None:
    torch.manual_seed(0)
    model = ClassMinNorm()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt) as guard:  # on_nonfinite="raise"
        for _ in range(20):  # (past a 16-step sweep)
            x, y = torch.randn(8, 32), torch.randint(0, 10, (8,))
            loss = guard.check_loss(F.cross_entropy(model(x, y), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert torch.isinf(model.class_min_norm).any()
    assert guard.events == []


class ColdStartRecommender(nn.Module):
    """A sparse embedding (SparseAdam) and a dense MLP (Adam), with a norm penalty written
    by hand: sqrt at a cold-start row that is still 0 has an infinite slope."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(2000, 16, sparse=True)
        with torch.no_grad():
            self.emb.weight[1000:].zero_()
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        e = self.emb(ids)
        return self.mlp(e).squeeze(-1), torch.sqrt((e * e).sum(-1)).mean()


@pytest.mark.parametrize("policy", ["raise", "skip_step"])
def test_a_sparse_optimizer_stepping_before_the_guarded_one_is_named_for_what_it_did(
    policy: str,
) -> None:
    torch.manual_seed(0)
    model = ColdStartRecommender()
    sparse = torch.optim.SparseAdam([model.emb.weight], lr=1e-2)
    dense = torch.optim.Adam(model.mlp.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=dense, on_nonfinite=policy) as guard:  # type: ignore[arg-type]
        for step in range(3):
            ids = torch.randint(0, 1000, (64,))
            if step == 2:
                ids[0] = 1999  # a new id
            pred, penalty = model(ids)
            loss = guard.check_loss(F.mse_loss(pred, torch.rand(64)) + 1e-3 * penalty)
            sparse.zero_grad()
            dense.zero_grad()
            loss.backward()
            sparse.step()  # (before the guarded optimizer: applied unchecked)
            if step == 2 and policy == "raise":
                with pytest.raises(nanguard.NonFiniteError, match=r"step 2: parameter `emb\.w"):
                    dense.step()
            else:
                dense.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.param) == (2, "param", "emb.weight")
    assert origin.details["reason"] == "stepped_first"
    assert origin.hint is not None
    assert "pass the optimizer that steps first as optimizer=" in origin.hint
    assert "Check what SparseAdam minimises" not in origin.hint
    if policy == "skip_step":
        skipped = next(e for e in guard.events if e.details.get("skipped"))
        assert "but not `emb.weight`" in skipped.message
