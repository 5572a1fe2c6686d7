"""Sequence models from a review with real forecasting code: a one-step model called in a
training rollout (DeepAR, a seq2seq decoder), and a gated RNN fed log-transformed counts."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class Step(nn.Module):
    """One step of an autoregressive forecaster: (previous value, covariate, state)."""

    def __init__(self, hidden: int = 32) -> None:
        super().__init__()
        self.inp = nn.Linear(2, hidden)
        self.cell = nn.GRUCell(hidden, hidden)
        self.out = nn.Linear(hidden, 1)

    def forward(
        self, y_prev: torch.Tensor, cov: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.cell(torch.relu(self.inp(torch.cat([y_prev, cov], -1))), h)
        return self.out(h), h


@pytest.mark.parametrize("detach", [False, True])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_missing_covariate_in_a_training_rollout_is_one_input_origin(
    mode: str, detach: bool
) -> None:
    torch.manual_seed(0)
    model = Step()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    y, cov, target = torch.randn(16, 1), torch.randn(16, 10, 1), torch.randn(16, 10)
    cov[4, 5, 0] = float("nan")  # a missing future covariate at step 5
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        h, ys = torch.zeros(16, 32), []
        for t in range(10):  # backpropagation through the whole rollout
            y, h = model(y, cov[:, t], h)
            ys.append(y)
            if detach:
                y, h = y.detach(), h.detach()
        loss = guard.check_loss(F.mse_loss(torch.cat(ys, 1), target))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origins = [e for e in guard.events if e.is_origin]
    assert len(origins) == 1  # the later calls only carry it on
    (origin,) = origins
    assert (origin.phase, origin.module, origin.tensor) == ("input", "", "args[1]")
    assert origin.details["forward"] == 6
    assert origin.stats is not None
    assert origin.stats.nan_count == 1
    assert "sample 4" in origin.message


class Forecaster(nn.Module):
    def __init__(self, log_in_model: bool) -> None:
        super().__init__()
        self.log_in_model = log_in_model
        self.gru = nn.GRU(1, 16, batch_first=True)
        self.head = nn.Linear(16, 7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.log_in_model:
            x = torch.log(x)  # log-transform of daily sales counts
        h, _ = self.gru(x)
        return self.head(h[:, -1])


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("where", ["model", "data"])
def test_a_log_of_zero_sales_absorbed_by_a_gru_is_the_origin_not_its_backward(
    where: str, mode: str
) -> None:
    # The GRU's gates saturate on -Inf (its output and the loss stay finite); its backward
    # makes 0 * -Inf = NaN in gru.weight_ih_l0's gradient.
    torch.manual_seed(0)
    model = Forecaster(log_in_model=where == "model")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    counts = torch.poisson(torch.full((8, 35, 1), 6.0)) + 1
    counts[2, 7] = 0  # a day without sales
    x, y = counts[:, :28], torch.log(counts[:, 28:, 0])
    if where == "data":
        x = torch.log(x)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        pred = model(x)
        loss = guard.check_loss(F.mse_loss(pred, y))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert torch.isfinite(pred).all()
    assert torch.isfinite(loss)
    origin = guard.origin
    assert origin is not None
    assert origin.kind == "inf"
    assert origin.stats is not None
    assert origin.stats.neginf_count == 1
    assert origin.details["absorbed_by"] == "gru"
    assert "It entered `gru`, whose forward absorbed it" in origin.message
    if where == "model":
        assert (origin.phase, origin.module, origin.tensor) == ("forward", "", "args[0] of gru")
        assert origin.op == "aten.log.default"
        assert origin.source is not None
        assert "x = torch.log(x)" in origin.source
    else:
        assert (origin.phase, origin.module, origin.tensor) == ("input", "", "args[0]")
        assert "sample 2" in origin.message
    backward = [e for e in guard.events if e.phase == "backward" and e.module == "gru"]
    assert backward
    assert not any(e.is_origin for e in backward)


class TabularMLP(nn.Module):
    """Numerical features through an optional in-model transform, then an MLP."""

    def __init__(self, transform: nn.Module | None = None) -> None:
        super().__init__()
        self.transform = transform
        self.mlp = nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.transform is not None:
            x = self.transform(x)
        return self.mlp(x)


class GaussRank(nn.Module):
    """Rank-Gauss transform; the bug: (r + 1) / n is 1 for the top rank, ndtri(1) = +inf."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = x.argsort(0).argsort(0).float()
        return torch.special.ndtri((r + 1) / x.size(0))


def train_tabular(model: nn.Module, x: torch.Tensor, steps: int, lr: float) -> nanguard.Guard:
    torch.manual_seed(0)
    y = torch.randn(len(x), 1)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log") as guard:
        for _ in range(steps):
            loss = guard.check_loss(F.mse_loss(model(x), y))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if guard.origin is not None:
                break
    return guard


def test_a_missing_value_in_a_table_names_its_row_and_column() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    x[10, 2] = float("nan")
    origin = train_tabular(TabularMLP(), x, 1, 0.01).origin
    assert origin is not None
    assert origin.phase == "input"
    assert origin.details["columns"] == [2]
    assert "It is in sample 10 (of 64 along dim 0). Column (dim 1): 2." in origin.message


def test_a_rank_gauss_transform_at_rank_one_gets_the_clip_hint() -> None:
    torch.manual_seed(0)
    origin = train_tabular(TabularMLP(GaussRank()), torch.randn(64, 6), 1, 0.01).origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == (
        "forward",
        "transform",
        "aten.special_ndtri.default",
    )
    assert origin.hint is not None
    assert "p.clamp(eps, 1 - eps)" in origin.hint
    assert "does not recognise" not in origin.hint


def test_exploding_weights_from_an_unnormalised_column_mention_the_input_scale() -> None:
    torch.manual_seed(0)
    x = torch.randn(64, 6)
    x[:, 4] = 1e6 + 2e5 * torch.randn(64)  # an income column in raw units
    guard = train_tabular(TabularMLP(), x, 60, 1e-3)
    origin = guard.origin
    assert origin is not None
    assert origin.step > 0
    assert origin.hint is not None
    assert "the weights are exploding" in origin.hint
    assert "an unnormalised column" in origin.hint
    assert "standardise the inputs" in origin.hint


def l2norm(t: torch.Tensor) -> torch.Tensor:
    return t / t.pow(2).sum(-1, keepdim=True).sqrt().clamp(min=1e-6)


class CosineAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w_qkv = nn.Parameter(torch.randn(3 * dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:  # not "mask"
        q, k, v = F.linear(x, self.w_qkv).chunk(3, -1)
        scores = 10 * l2norm(q) @ l2norm(k).transpose(-1, -2) + causal
        return x + scores.softmax(-1) @ v


class TinyLM(nn.Module):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.attn = CosineAttention(16)
        self.head = nn.Linear(16, 50)
        self.register_buffer("causal", torch.triu(torch.full((12, 12), float("-inf")), 1))

    def forward(self, ids: torch.Tensor, attn_mask: torch.Tensor | None = None) -> torch.Tensor:
        if self.where == "buffer":
            attn_mask = self.causal
        elif self.where == "own":
            attn_mask = torch.triu(torch.full((12, 12), float("-inf")), 1)
        assert attn_mask is not None
        return self.head(self.attn(self.emb(ids), attn_mask))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("where", ["input", "buffer", "own"])
def test_a_causal_mask_is_not_blamed_for_a_backward_nan_it_did_not_make(
    where: str, mode: str
) -> None:
    # A padded sequence embeds to 0, and l2norm's sqrt at 0 makes the backward NaN.
    torch.manual_seed(0)
    model = TinyLM(where)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mask = torch.triu(torch.full((12, 12), float("-inf")), 1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(3):
            ids = torch.randint(1, 50, (4, 12))
            if step == 1:
                ids[2, 8:] = 0  # padding
            kwargs = {"attn_mask": mask} if where == "input" else {}
            logits = model(ids, **kwargs)
            loss = guard.check_loss(F.cross_entropy(logits.flatten(0, 1), ids.flatten()))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "attn")
    assert origin.op is not None
    assert "SqrtBackward0" in origin.op
    assert "absorbed_by" not in origin.details


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_in_a_packed_sequence_names_its_sample_and_time_step(mode: str) -> None:
    # The packed .data's rows are (time step, length-sorted sample) pairs: its row 17 was
    # called "sample 17 (of 328)" in a batch of 16 sequences.
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    torch.manual_seed(0)
    lstm = nn.LSTM(12, 64, num_layers=2, batch_first=True)
    opt = torch.optim.Adam(lstm.parameters(), lr=1e-3)
    lengths = torch.randint(3, 40, (16,))
    x = torch.randn(16, 40, 12)
    x[5, 1, 3] = float("nan")  # sample 5, time step 1, feature 3
    packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
    with nanguard.watch(lstm, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        out, _ = lstm(packed)
        loss = pad_packed_sequence(out, batch_first=True)[0].pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("input", "args[0].data")
    assert origin.details["time_steps"] == [1]
    assert (
        "It is in sample 5 (of 16 in the packed sequence). At time step 1. Feature: 3."
        in origin.message
    )


class PaddedClassifier(nn.Module):
    """Token ids in, a bool padding mask beside them (True where padded)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(30, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 3)

    def forward(self, tok: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(tok), src_key_padding_mask=pad).mean(1))


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    tok = torch.randint(1, 30, (4, 8), generator=torch.Generator().manual_seed(2))
    pad = torch.arange(8)[None] >= torch.tensor([8, 5, 0, 6])[:, None]  # sample 2: empty
    return tok, pad


def test_a_fused_kernels_nan_in_sentinel_evaluation_is_told_as_that_kernels() -> None:
    # eval() under no_grad: the step runs torch's fused encoder kernel, NaN for the empty
    # sample; the hooked replay runs the regular path, finite. Not "seven possible causes".
    torch.manual_seed(0)
    model = PaddedClassifier().eval()
    with nanguard.watch(model, mode="sentinel", on_nonfinite="log") as guard, torch.no_grad():
        out = model(*_padded_batch())
        guard.step()
    assert torch.isfinite(out).all(1).tolist() == [True, True, False, True]
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.reproducible) == ("forward", "", False)
    assert "it was given only integer or bool tensors" in origin.message
    assert "no tensor that nanguard found" not in origin.message
    assert origin.hint is not None
    assert "`enc.layers.0` takes torch's fused inference kernel" in origin.hint
    assert "padding mask is all True" in origin.hint
    assert "SAM" not in origin.message


def test_full_mode_says_once_that_its_hooks_turn_the_fused_encoder_kernel_off() -> None:
    torch.manual_seed(0)
    model = PaddedClassifier().eval()
    with torch.no_grad():
        unguarded = model(*_padded_batch())

    def evaluate() -> torch.Tensor:
        with nanguard.watch(model, on_nonfinite="log") as guard, torch.no_grad():
            for _ in range(3):
                out = model(*_padded_batch())
                guard.step()
        return out

    with pytest.warns(RuntimeWarning, match="fused inference kernel") as caught:
        guarded = evaluate()
    assert not torch.isfinite(unguarded[2]).any()
    assert torch.isfinite(guarded).all()  # (the regular path: what the warning is about)
    assert sum("fused inference kernel" in str(w.message) for w in caught) == 1
    # Training, or the layers excluded (the kernel kept): nothing to say.
    model.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with nanguard.watch(model, on_nonfinite="log") as guard, torch.no_grad():
            model(*_padded_batch())
            guard.step()
        model.eval()
        kept = nanguard.watch(model, on_nonfinite="log", exclude=(nn.TransformerEncoderLayer,))
        with kept, torch.no_grad():
            model(*_padded_batch())
            kept.step()


class HalfRotary(nn.Module):
    """Rotary embedding whose angles take the dtype of its frequency buffer (float16 after
    ``model.half()``)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        freqs = 1.0 / (10000.0 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", freqs, persistent=False)

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        angles = pos[:, :, None].to(self.inv_freq.dtype) * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class RotaryLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.rot = HalfRotary()
        self.out = nn.Linear(8, 50)

    def forward(self, tok: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.out(self.rot(self.emb(tok), pos))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_positions_past_float16s_range_cast_for_rotary_angles_are_named(mode: str) -> None:
    # Decoding with a KV-cache offset of 66000 in a float16 model: the integer positions
    # cast to float16 are Inf, cos(Inf) is NaN. Not "scale the activations down".
    torch.manual_seed(0)
    model = RotaryLM().half()
    tok = torch.randint(0, 50, (2, 8))
    pos = torch.arange(66000, 66008)[None].expand(2, -1)
    with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard, torch.no_grad():  # type: ignore[arg-type]
        model(tok, pos)
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.op) == ("forward", "rot", "aten._to_copy.default")
    assert origin.hint is not None
    assert "cast integers reaching 66007" in origin.hint
    assert "scale its activations" not in origin.hint
