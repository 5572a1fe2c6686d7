"""Intentional -inf (attention masks) is not an error; NaN always is."""

from __future__ import annotations

import math

import pytest
import torch
from realistic import TinyLM
from torch import Tensor, nn

import nanguard
from nanguard import Event


def test_transformer_lm_with_causal_mask_trains_under_raise() -> None:
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with nanguard.watch(model, on_nonfinite="raise", optimizer=opt) as guard:
        for _ in range(20):
            idx = torch.randint(0, 50, (8, 12))
            logits = model(idx)
            targets = idx[:, 1:].reshape(-1)
            loss = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 50), targets)
            guard.check_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []
    assert guard.current_step == 20


def test_causal_mask_passed_by_the_user_is_not_an_input_origin() -> None:
    layer = nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dropout=0.0)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    mask = nn.Transformer.generate_square_subsequent_mask(7)
    with nanguard.watch(model, on_nonfinite="raise") as guard:
        out = model(torch.randn(3, 7, 16), mask=mask, is_causal=True)
        out.sum().backward()
        guard.step()
    assert guard.events == []


def test_masked_fill_minus_inf_in_own_code_then_softmax_module() -> None:
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = nn.Linear(8, 8)
            self.softmax = nn.Softmax(dim=-1)

        def forward(self, x: Tensor, keep: Tensor) -> Tensor:
            scores = self.q(x) @ x.transpose(-1, -2)
            scores = scores.masked_fill(~keep[:, None, :], float("-inf"))
            return self.softmax(scores) @ x

    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[:, 4:] = False  # padding, but every row still sees something
    with nanguard.watch(Attention(), on_nonfinite="raise") as guard:
        guard.model(torch.randn(2, 6, 8), keep)
        guard.step()
    assert guard.events == []


def test_nan_born_from_a_mask_is_reported() -> None:
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    mask = torch.zeros(4, 4)
    mask[1] = float("-inf")
    with nanguard.watch(mha, on_nonfinite="log") as guard:
        x = torch.randn(2, 4, 8)
        mha(x, x, x, attn_mask=mask)
        guard.step()
    assert guard.origin is not None
    assert guard.origin.module == ""
    assert guard.origin.kind == "nan"
    assert guard.origin.phase == "forward"


class MaskMaker(nn.Module):
    """A module whose output is an additive -inf mask."""

    def forward(self, lengths: Tensor) -> Tensor:
        positions = torch.arange(6)[None, :]
        mask = torch.zeros(lengths.shape[0], 6)
        return mask.masked_fill(positions >= lengths[:, None], float("-inf"))


class Scorer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.masks = MaskMaker()
        self.score = nn.Linear(8, 1)

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        logits = self.score(x).squeeze(-1) + self.masks(lengths)
        return torch.softmax(logits, dim=-1)


def test_a_module_that_builds_a_mask_with_masked_fill_minus_inf_is_not_an_origin() -> None:
    """The replay sees masked_fill(..., -inf) write the -Inf: a mask, on purpose."""
    x, lengths = torch.randn(3, 6, 8), torch.tensor([2, 6, 4])
    with nanguard.watch(Scorer(), on_nonfinite="raise") as guard:
        for _ in range(3):
            guard.model(x, lengths)
            guard.step()
    assert guard.events == []


class OverflowMaskMaker(nn.Module):
    """-Inf by accident: the log of a value clamped to 0."""

    def forward(self, lengths: Tensor) -> Tensor:
        positions = torch.arange(6)[None, :].float()
        return torch.log((lengths[:, None] - positions).clamp_min(0) / 10)


def test_an_accidental_minus_inf_from_a_module_is_an_origin_unless_allowed() -> None:
    model = Scorer()
    model.masks = OverflowMaskMaker()
    x, lengths = torch.randn(3, 6, 8), torch.tensor([2, 6, 4])
    # Without a replay nanguard cannot see which operation wrote it: it may be a mask.
    with nanguard.watch(model, on_nonfinite="log", replay=False) as guard:
        guard.model(x, lengths)
        guard.step()
    assert guard.origin is not None
    assert (guard.origin.module, guard.origin.kind) == ("masks", "inf")
    assert "allow_inf=[OverflowMaskMaker]" in guard.origin.message
    with nanguard.watch(model, on_nonfinite="raise", allow_inf=[OverflowMaskMaker]) as guard:
        guard.model(x, lengths)
        guard.step()
    assert guard.events == []


@pytest.mark.parametrize("allow", [MaskMaker, "masks", "mask*"])
def test_allow_inf_by_type_or_name(allow: object) -> None:
    x, lengths = torch.randn(3, 6, 8), torch.tensor([2, 6, 4])
    with nanguard.watch(Scorer(), on_nonfinite="raise", allow_inf=(allow,)) as guard:
        guard.model(x, lengths)
        guard.step()
    assert guard.events == []


def test_allow_inf_still_reports_nan() -> None:
    class NanMaker(MaskMaker):
        def forward(self, lengths: Tensor) -> Tensor:
            return super().forward(lengths) * 0.0  # -inf * 0 is NaN

    model = Scorer()
    model.masks = NanMaker()
    with nanguard.watch(model, on_nonfinite="log", allow_inf=(MaskMaker,)) as guard:
        model(torch.randn(3, 6, 8), torch.tensor([2, 6, 4]))
        guard.step()
    assert guard.origin is not None
    assert (guard.origin.module, guard.origin.kind) == ("masks", "nan")


def test_nan_from_a_fully_masked_row_after_an_allowed_mask_blames_the_consumer() -> None:
    x, lengths = torch.randn(3, 6, 8), torch.tensor([0, 6, 4])  # sample 0: nothing visible
    with nanguard.watch(Scorer(), on_nonfinite="log", allow_inf=(MaskMaker,)) as guard:
        guard.model(x, lengths)
        guard.step()
    assert guard.origin is not None
    assert (guard.origin.module, guard.origin.kind, guard.origin.tensor) == ("", "nan", "output")
    assert guard.origin.stats is not None
    assert guard.origin.stats.nan_count == 6


def test_plus_inf_data_that_propagates_is_an_input_origin() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    x = torch.randn(5, 4)
    x[2, 1] = float("inf")  # e.g. a division by zero in feature engineering
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(x)
        guard.step()
    assert guard.origin is not None
    assert (guard.origin.phase, guard.origin.module, guard.origin.kind) == ("input", "", "inf")
    assert guard.origin.stats is not None
    assert guard.origin.stats.posinf_count == 1


def test_inf_in_the_batch_that_the_model_absorbs_is_not_reported() -> None:
    class Clamp(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x.clamp(-10, 10)

    model = nn.Sequential(Clamp(), nn.Linear(4, 1))
    x = torch.randn(5, 4)
    x[0, 0] = float("inf")
    with nanguard.watch(model, on_nonfinite="raise") as guard:
        model(x)
        guard.step()
    assert guard.events == []


class WeightedPooling(nn.Module):
    """Hugging Face style: ``model(input_ids=..., attention_mask=...)``, a multiplicative
    float mask applied in the model's own code before the encoder."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3))

    def forward(self, *, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.emb(input_ids) * attention_mask[..., None]
        return self.body(h).mean(1)


@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_plus_inf_or_nan_in_a_mask_argument_is_bad_data(value: float) -> None:
    # A mask may hold -inf on purpose, never +inf: a weight of 1/length with a zero length.
    torch.manual_seed(0)
    model = WeightedPooling()
    mask = torch.ones(8, 5)
    mask[0, 0] = value
    with nanguard.watch(model, on_nonfinite="log") as guard:
        out = model(input_ids=torch.randint(0, 50, (8, 5)), attention_mask=mask)
        guard.check_loss(out.pow(2).mean()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("input", "")
    assert origin.tensor == "kwargs['attention_mask']"


class PaddedEncoder(nn.Module):
    """The padding mask arrives under a name that says nothing (``pad``) and is handed to
    MultiheadAttention as ``key_padding_mask``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 16)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.head = nn.Linear(16, 1)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        h = self.emb(x)
        a, _ = self.mha(h, h, h, key_padding_mask=pad)
        return self.head(a)


def test_float_padding_mask_under_a_plain_name_is_a_mask_once_a_module_takes_it_as_one() -> None:
    torch.manual_seed(0)
    model = PaddedEncoder()
    partial = torch.zeros(3, 5)
    partial[1, 3:] = float("-inf")  # the last two keys of sample 1 are padding
    with nanguard.watch(model, on_nonfinite="raise") as guard:
        for _ in range(3):
            loss = guard.check_loss(model(torch.randn(3, 5, 8), partial).pow(2).mean())
            loss.backward()
            guard.step()
    assert guard.events == []

    empty = torch.zeros(3, 5)
    empty[1, :] = float("-inf")  # sample 1 is all padding: its attention row is 0/0
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(torch.randn(3, 5, 8), empty).pow(2).mean()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "mha", "nan")
    assert "key_padding_mask" in origin.message


class WhereMaskedPolicy(nn.Module):
    """Invalid actions masked with torch.where and a Python -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 6))

    def forward(self, obs: Tensor, legal: Tensor) -> Tensor:
        return torch.where(legal, self.body(obs), float("-inf"))


class MaskedFillPolicy(WhereMaskedPolicy):
    def forward(self, obs: Tensor, legal: Tensor) -> Tensor:
        return self.body(obs).masked_fill(~legal, float("-inf"))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("policy", [MaskedFillPolicy, WhereMaskedPolicy])
def test_action_masks_written_with_minus_inf_in_the_model_are_not_errors(
    policy: type[nn.Module], mode: str
) -> None:
    """PPO with invalid-action masking: -inf logits on purpose, a finite loss."""
    torch.manual_seed(0)
    model = policy()
    opt = torch.optim.Adam(model.parameters(), lr=3e-4)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="raise", mode=mode) as guard:
        for _ in range(5):
            legal = torch.rand(16, 6) > 0.3
            legal[:, 0] = True
            dist = torch.distributions.Categorical(logits=model(torch.randn(16, 8), legal))
            action = dist.sample()
            loss = -(dist.log_prob(action) * torch.randn(16)).mean() - 0.01 * dist.entropy().mean()
            opt.zero_grad()
            guard.check_loss(loss).backward()
            opt.step()
    assert guard.events == []


class LogOfRelu(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(torch.relu(x))  # log(0) = -inf for every negative input


def test_a_minus_inf_made_by_log_is_not_taken_for_a_mask() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), LogOfRelu(), nn.Linear(8, 1))
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(torch.randn(4, 8)).sum()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.kind) == ("forward", "1", "inf")
    assert origin.op is not None
    assert "log" in origin.op
    assert "allow_inf" not in origin.message  # made by log: not a mask


class SpanScorer(nn.Module):
    """Span scores masked with -inf and their log-partition, guarded with where() for a
    sentence without any legal span: logsumexp's backward makes NaN on that row, and
    masked_fill's backward zeroes it before it reaches any parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.score = nn.Linear(16, 1)

    def forward(self, x: Tensor, legal: Tensor) -> tuple[Tensor, Tensor]:
        scores = self.score(x).squeeze(-1).masked_fill(~legal, float("-inf"))
        log_z = torch.logsumexp(scores, -1)
        return torch.where(legal.any(-1), log_z, torch.zeros_like(log_z)), scores


def _train_span_scorer(steps: int, **options: object) -> tuple[nn.Module, nanguard.Guard]:
    """Train a SpanScorer with one sentence without a legal span in every batch."""
    torch.manual_seed(0)
    model = SpanScorer()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    legal = torch.ones(4, 5, dtype=torch.bool)
    legal[2] = False  # a sentence with no legal span
    with nanguard.watch(model, optimizer=opt, on_nonfinite="raise", **options) as guard:
        for _ in range(steps):
            log_z, scores = model(torch.randn(4, 5, 16), legal)
            gold = torch.where(legal[:, 0], scores[:, 0], 0.0)
            loss = guard.check_loss((log_z - gold).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return model, guard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_nan_gradient_absorbed_before_any_parameter_is_not_an_error(mode: str) -> None:
    model, guard = _train_span_scorer(3, mode=mode)
    assert guard.events == []
    assert all(p.isfinite().all() for p in model.parameters())


def test_a_nan_gradient_absorbed_at_every_step_is_not_replayed_at_every_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Proving the absorption takes a replay of the backward; the same sites and kinds at
    # the next steps are taken as proven (a cost at every step of a healthy run otherwise).
    import nanguard._resolution as resolution

    replays = []
    real = resolution.replay

    def counted(*args: object, **kwargs: object) -> object:
        replays.append(kwargs.get("backward"))
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(resolution, "replay", counted)
    _, guard = _train_span_scorer(8, backward="probes")
    assert guard.events == []
    assert replays.count(True) == 1  # (backward replays: the proof, at the first step)


def test_a_loss_that_sums_over_masked_logits_is_explained() -> None:
    # Constrained decoding: illegal actions masked with -inf, and label smoothing, which
    # sums log p over every class: the loss is +Inf although the targets are legal.
    torch.manual_seed(0)
    model = MaskedFillPolicy()
    x, legal = torch.randn(32, 8), torch.rand(32, 6) < 0.5
    legal[:, 0] = True
    target = torch.zeros(32, dtype=torch.long)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        for _ in range(3):  # from the second step on, the outputs are probed as masks
            logits = model(x, legal)
            loss = nn.functional.cross_entropy(logits, target, label_smoothing=0.1)
            guard.check_loss(loss).backward()
            guard.step()
    losses = [e for e in guard.events if e.phase == "loss" and e.is_origin]
    assert [e.step for e in losses] == [0, 1, 2]
    for event in losses:
        assert event.kind == "inf"
        assert "-inf written on purpose" in event.message
        assert event.hint is not None
        assert "label_smoothing" in event.hint
        assert "outputs were finite" not in event.message


def test_a_nan_loss_next_to_masked_logits_still_names_nan_targets() -> None:
    # Actor-critic: the policy's logits are masked with -inf on purpose, but the NaN comes
    # from the value targets. The masked logits must not be the only suspect.
    torch.manual_seed(0)
    model = MaskedFillPolicy()
    legal = torch.rand(32, 6) < 0.5
    legal[:, 0] = True
    returns = torch.randn(32)
    returns[3] = float("nan")
    with nanguard.watch(model, on_nonfinite="log") as guard:
        logits = model(torch.randn(32, 8), legal)
        policy = nn.functional.cross_entropy(logits, torch.zeros(32, dtype=torch.long))
        value = (logits[:, 0] - returns).pow(2).mean()
        guard.check_loss(policy + value).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("loss", "nan")
    assert origin.hint is not None
    assert "NaN in the targets" in origin.hint


class Distances(nn.Module):
    """Pairwise distances, and the same with each sample's own class set to +inf: min()
    then picks the hardest negative (batch-hard triplet loss, Hermans et al. 2017)."""

    def forward(self, emb: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        d = torch.cdist(emb, emb)
        same = labels[:, None] == labels[None, :]
        return d, d.masked_fill(same, float("inf"))


class TripletEmbedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        self.dist = Distances()

    def forward(self, x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        return self.dist(nn.functional.normalize(self.net(x), dim=1), labels)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_plus_inf_written_on_purpose_for_min_is_no_error(mode: str) -> None:
    torch.manual_seed(0)
    model = TripletEmbedder()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(6)
    protos = torch.randn(10, 16, generator=gen)
    labels = torch.arange(10).repeat_interleave(4)
    same = labels[:, None] == labels[None, :]
    calls: list[int] = []
    model.net[0].register_forward_hook(lambda *_: calls.append(1))
    per_step = []
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="raise") as guard:
        for _ in range(20):
            calls.clear()
            x = protos[labels] + 0.7 * torch.randn(40, 16, generator=gen)
            d, negatives = model(x, labels)
            hardest = (d * same).max(1).values - negatives.min(1).values
            loss = guard.check_loss(nn.functional.relu(hardest + 0.3).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
            per_step.append(len(calls))
    assert guard.events == []
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert per_step[1:] == [1] * 19  # seen once as a mask: no replay in later steps


class HardNegatives(nn.Module):
    """Batch-hard mining: +inf written on purpose in one output, and a squared distance
    that can overflow in both."""

    def forward(self, emb: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
        d = (emb.unsqueeze(1) - emb.unsqueeze(0)).pow(2).sum(-1)
        same = labels.unsqueeze(0) == labels.unsqueeze(1)
        return d.masked_fill(~same, float("-inf")).amax(1), d.masked_fill(same, float("inf"))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_real_overflow_after_plus_inf_written_on_purpose_is_still_found(mode: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 8))
    mine = HardNegatives()
    net = nn.ModuleDict({"enc": model, "mine": mine})

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = net

        def forward(self, x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
            return self.parts["mine"](self.parts["enc"](x), labels)

    whole = Net()
    opt = torch.optim.SGD(whole.parameters(), lr=0.01)
    with nanguard.watch(whole, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        for step in range(5):
            x, labels = torch.randn(32, 16), torch.randint(0, 4, (32,))
            if step == 4:
                x[3] *= 1e21  # an unnormalised raw value: squared distances overflow
            positives, negatives = whole(x, labels)
            loss = positives - negatives.amin(1) + 1.0
            guard.check_loss(nn.functional.relu(loss).mean()).backward()
            opt.step()
            opt.zero_grad()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (4, "forward", "parts.mine")
    assert origin.tensor == "output[0]"


def test_plus_inf_written_on_purpose_still_reports_its_nan() -> None:
    # A NaN embedding (a zero vector normalised by hand): the +inf fill does not hide it.
    class NormalisedByHand(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x / x.norm(dim=1, keepdim=True)

    model = TripletEmbedder()
    model.net.append(NormalisedByHand())
    x = torch.randn(8, 16)
    with torch.no_grad():
        model.net[2].weight.zero_()
        model.net[2].bias.zero_()
    with nanguard.watch(model, on_nonfinite="log") as guard:
        _, negatives = model(x, torch.arange(4).repeat_interleave(2))
        guard.check_loss(negatives.min(1).values.mean()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.kind) == ("net.3", "nan")


class MissingMarker(nn.Module):
    """Marks padded steps as missing: a hash-embedding style masked_fill(pad, nan)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        return self.proj(x).masked_fill(pad[..., None], float("nan"))


class NanMeanPool(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = MissingMarker()
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        return self.head(self.enc(x, pad).nanmean(dim=1))  # a masked mean


class QueryMaskedAttention(nn.Module):
    """Padded query rows see nothing: an nn.Softmax child makes NaN rows, zeroed at once."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.softmax = nn.Softmax(dim=-1)
        self.head = nn.Linear(16, 3)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-2, -1) / 4
        both = ~pad[:, :, None] & ~pad[:, None, :]
        attn = torch.nan_to_num(self.softmax(scores.masked_fill(~both, float("-inf"))))
        return self.head((attn @ v).sum(1))


@pytest.mark.parametrize(("model_type", "dim"), [(NanMeanPool, 8), (QueryMaskedAttention, 16)])
@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_nan_that_the_models_own_code_absorbs_is_no_error(
    mode: str, model_type: type[nn.Module], dim: int
) -> None:
    # Nothing non-finite reaches the outputs, the loss or a gradient: training is healthy.
    torch.manual_seed(0)
    model = model_type()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="raise") as guard:
        for _ in range(5):
            x, pad = torch.randn(4, 6, dim), torch.zeros(4, 6, dtype=torch.bool)
            pad[:, 4:] = True
            loss = guard.check_loss(
                nn.functional.cross_entropy(model(x, pad), torch.tensor([0, 1, 2, 0]))
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [e.is_origin for e in guard.events] == ([False] if mode == "full" else [])
    if mode == "full":  # said once, not every step
        (event,) = guard.events
        assert event.details == {"absorbed": True}
        assert "was absorbed by the model's own code" in event.message


def test_nan_made_inside_that_reaches_the_output_is_still_an_origin() -> None:
    model = NanMeanPool()
    x, pad = torch.randn(2, 6, 8), torch.zeros(2, 6, dtype=torch.bool)
    pad[1] = True  # every step of sample 1 padded: nanmean over nothing is NaN
    with nanguard.watch(model, on_nonfinite="log") as guard:
        guard.check_loss(model(x, pad).sum()).backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.kind) == ("enc", "nan")


class L2Norm(nn.Module):
    """Written by hand without an eps: 0/0 for an all-zero vector."""

    def forward(self, x: Tensor) -> Tensor:
        return x / x.norm(dim=-1, keepdim=True)


class CosineCodebook(nn.Module):
    """A VQ lookup by cosine similarity."""

    def __init__(self, codes: int = 32, dim: int = 8) -> None:
        super().__init__()
        self.codebook = nn.Embedding(codes, dim)
        self.norm = L2Norm()

    def forward(self, z: Tensor) -> tuple[Tensor, Tensor]:
        sim = self.norm(z) @ nn.functional.normalize(self.codebook.weight, dim=-1).T
        q = self.codebook(sim.argmax(-1))  # argmax of a NaN row: code 0, silently
        commit = nn.functional.mse_loss(q, z.detach()) + 0.25 * nn.functional.mse_loss(
            z, q.detach()
        )
        return z + (q - z).detach(), commit


def test_a_nan_that_argmax_hides_is_still_an_origin() -> None:
    # Not absorbed on purpose: the blank sample is quantised to a wrong code, while the
    # outputs, the loss and the gradients stay finite.
    torch.manual_seed(0)
    enc = nn.Sequential(nn.Linear(16, 8, bias=False), nn.ReLU())
    vq, dec = CosineCodebook(), nn.Linear(8, 16)

    class VQAE(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc, self.vq, self.dec = enc, vq, dec

        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            zq, commit = self.vq(self.enc(x))
            return self.dec(zq), commit

    model = VQAE()
    x = torch.randn(32, 16)
    x[7] = 0.0  # a blank frame
    with nanguard.watch(model, on_nonfinite="log") as guard:  # (sentinel sees the outputs)
        rec, commit = model(x)
        guard.check_loss(nn.functional.mse_loss(rec, x) + commit).backward()
        guard.step()
    assert torch.isfinite(rec).all()
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.kind, origin.op) == ("vq.norm", "nan", "aten.div.Tensor")


def test_a_minus_inf_in_the_batch_is_not_told_to_be_allowed_on_the_whole_model() -> None:
    # allow_inf=[the model] would hide every Inf it makes: the message says what else to do.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    x = torch.randn(8, 4)
    x[2, 1] = float("-inf")  # a latent that is -inf (a VAE's log-variance of 0)
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(x)
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.kind) == ("input", "inf")
    assert "pass it under an argument named like a mask" in origin.message
    assert "allow_inf=[Sequential] would hide every Inf of the model" in origin.message


class PositionalAttention(nn.Module):
    """timm-style: an additive mask passed positionally; a hand-written qk-norm."""

    def __init__(self, d: int = 8, qknorm: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(0.0)
        self.qknorm = qknorm

    def forward(self, x: Tensor, extra: Tensor) -> Tensor:  # (a name no mask's)
        q, k, v = self.qkv(x).chunk(3, -1)
        if self.qknorm:
            q = q / q.norm(dim=-1, keepdim=True)  # 0/0 at a zero query
        att = (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + extra).softmax(-1)
        return self.proj(self.attn_drop(att) @ v)


class MaskFromBatch(nn.Module):
    def __init__(self, qknorm: bool) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.attn = PositionalAttention(qknorm=qknorm)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor, attn_mask: Tensor) -> Tensor:
        h = self.emb(x)
        return self.head(h + self.attn(h, attn_mask[:, None, :]))


class PaddingMask(nn.Module):
    def forward(self, keep: Tensor) -> Tensor:
        return torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))


class MaskBroadcast(nn.Module):
    """A child writes a (B, T) mask; the parent broadcasts it per query, (B, T, T)."""

    def __init__(self) -> None:
        super().__init__()
        self.masks = PaddingMask()
        self.emb = nn.Linear(4, 8)
        self.attn = PositionalAttention()
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor, keep: Tensor) -> Tensor:
        b, t = keep.shape
        bias = self.masks(keep)[:, None, :].expand(b, t, t)
        h = self.emb(x)
        return self.head(h + self.attn(h, bias))


def _attention_origin(
    model: nn.Module, mode: str, *args: Tensor, keep: Tensor | None = None, **options: object
) -> Event:
    """One step; the loss over the kept positions only (the padding's outputs left out)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log", **options) as guard:
        out = model(*args)
        loss = guard.check_loss((out if keep is None else out[keep]).pow(2).mean())
        loss.backward()
        opt.step()
    assert guard.origin is not None
    return guard.origin


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("qknorm", [False, True])
def test_a_batch_mask_reshaped_and_passed_positionally_is_no_origin(
    mode: str, qknorm: bool
) -> None:
    # A fully masked sample (softmax NaN), or a healthy mask and a 0/0 in the qk-norm: the
    # attention's own code made the NaN, not the model's reshape of its mask.
    torch.manual_seed(0)
    model = MaskFromBatch(qknorm)
    mask = torch.zeros(2, 5)
    if qknorm:
        mask[1, 3:] = float("-inf")
        with torch.no_grad():
            model.attn.qkv.weight[:8].zero_()
            model.attn.qkv.bias[:8].zero_()
    else:
        mask[1] = float("-inf")
    origin = _attention_origin(model, mode, torch.randn(2, 5, 4), mask, keep=mask == 0)
    assert (origin.phase, origin.module, origin.kind) == ("forward", "attn", "nan")
    assert origin.op == ("aten.div.Tensor" if qknorm else "aten._softmax.default")


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_childs_mask_broadcast_per_query_is_still_a_mask(mode: str) -> None:
    torch.manual_seed(0)
    keep = torch.ones(2, 5, dtype=torch.bool)
    keep[1] = False  # an empty sample
    origin = _attention_origin(MaskBroadcast(), mode, torch.randn(2, 5, 4), keep, keep=keep)
    assert (origin.phase, origin.module, origin.kind) == ("forward", "attn", "nan")
    assert origin.op == "aten._softmax.default"


class CausalBlock(nn.Module):
    """A causal mask written on purpose in the parent's own code, passed positionally."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(4, 8)
        self.attn = PositionalAttention(qknorm=True)
        self.head = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        t = x.shape[1]
        causal = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        h = self.emb(x)
        return self.head(h + self.attn(h, causal))


def test_without_a_replay_a_mask_the_parent_wrote_is_not_taken_for_the_origin() -> None:
    # replay=False: no operation can tell a mask from a log(0); the NaN the attention's own
    # code made (0/0 in its qk-norm) stays the origin.
    torch.manual_seed(0)
    model = CausalBlock()
    with torch.no_grad():
        model.attn.qkv.weight[:8].zero_()
        model.attn.qkv.bias[:8].zero_()
    origin = _attention_origin(model, "full", torch.randn(2, 5, 4), replay=False)
    assert (origin.phase, origin.module, origin.kind) == ("forward", "attn", "nan")


class MHAClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.mha = nn.MultiheadAttention(16, 2, batch_first=True)
        self.out = nn.Linear(16, 2)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        a, _ = self.mha(h, h, h, key_padding_mask=pad)
        return self.out(a.mean(1))


def test_a_fully_padded_sample_in_multihead_attention_points_at_its_masks() -> None:
    # A bool key_padding_mask is not probed (no -inf to see): the message still sends the
    # user to the masks, not to "its input's scale, its weights, its dtype".
    torch.manual_seed(0)
    model = MHAClassifier()
    pad = torch.zeros(3, 5, dtype=torch.bool)
    pad[1] = True  # every key of sample 1 is padding
    with nanguard.watch(model, on_nonfinite="log") as guard:
        model(torch.randint(0, 20, (3, 5)), pad).sum().backward()
        guard.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "mha")
    assert "Look at the masks it was given (`key_padding_mask`, `attn_mask`)" in origin.message
    assert "its input's scale" not in origin.message


class AlibiAttention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x: Tensor, alibi: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + alibi
        return self.o(torch.softmax(scores, -1) @ v)


class AlibiLM(nn.Module):
    """Its ALiBi bias (slopes times distances, -inf on future and padded keys) comes in
    positionally, under a name that is not a mask's."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Linear(8, d)
        self.attn = AlibiAttention(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x: Tensor, alibi: Tensor) -> Tensor:
        return self.head(self.attn(self.emb(x), alibi))


def alibi_bias(lengths: list[int], t: int = 6, slope: float = 0.5) -> Tensor:
    i = torch.arange(t)
    dist = (i[None, :] - i[:, None]).float()
    bias = (slope * dist).masked_fill(dist > 0, float("-inf")).expand(len(lengths), t, t).clone()
    for n, length in enumerate(lengths):
        bias[n, :, length:] = float("-inf")
    return bias


def train_with_alibi(model: nn.Module, mode: str, steps: int) -> nanguard.Guard:
    """SGD steps of a model given an ALiBi bias; at step 2 one sample is padded whole."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    with nanguard.watch(model, optimizer=opt, on_nonfinite="log", mode=mode) as guard:  # type: ignore[arg-type]
        for step in range(steps):
            lengths = [6, 5, 4, 0 if step == 2 else 3]
            out = model(torch.randn(4, 6, 8), alibi_bias(lengths))
            loss = guard.check_loss(((out - torch.randn(4, 6, 1)) ** 2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()
    return guard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_an_alibi_bias_given_positionally_is_no_bad_batch(mode: str) -> None:
    # -Inf beside varied finite values, like data gone bad (the log of a 0): but the bias
    # held it in every step, and a fully padded sample's NaN is the softmax's masked row.
    torch.manual_seed(0)
    guard = train_with_alibi(AlibiLM(), mode, steps=8)
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (2, "forward", "attn")
    assert origin.op == "aten._softmax.default"
    # Later steps compute with the weights step 2's NaN gradients made NaN: the bias beside
    # them is no new origin ("the input batch already contains -Inf"), in sentinel steps
    # (the model's call alone recorded) too.
    assert [e.step for e in guard.events if e.is_origin] == [2]


class LeafAlibiAttention(nn.Module):
    """Attention with its projections as plain parameters (no child modules): the softmax
    over a fully padded row is the last thing before its return."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(d, 3 * d) / d**0.5)
        self.o = nn.Parameter(torch.randn(d, d) / d**0.5)

    def forward(self, x: Tensor, alibi: Tensor) -> Tensor:
        q, k, v = (x @ self.qkv).chunk(3, -1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]) + alibi
        return (torch.softmax(scores, -1) @ v) @ self.o


class LeafAlibiLM(nn.Module):
    def __init__(self, scaled: bool, d: int = 16) -> None:
        super().__init__()
        self.scaled = scaled
        self.emb = nn.Linear(8, d)
        self.attn = LeafAlibiAttention(d)
        self.head = nn.Linear(d, 1)

    def forward(self, x: Tensor, alibi: Tensor) -> Tensor:
        bias = alibi * 2.0 if self.scaled else alibi  # (a slope applied here: a new tensor)
        return self.head(self.attn(self.emb(x), bias))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("scaled", [False, True])
def test_a_positional_alibi_bias_into_a_leaf_attention_is_its_masked_row(
    scaled: bool, mode: str
) -> None:
    # The -Inf comes in with the batch and reaches a module whose output is NaN: its
    # softmax over a row all -inf made it (a fully padded sample), so the bias was a mask
    # and the attention is the origin, not the batch nor the model's own code. The steps
    # after, computing with the weights that NaN made NaN, add no origin.
    torch.manual_seed(0)
    guard = train_with_alibi(LeafAlibiLM(scaled), mode, steps=5)
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (2, "forward", "attn")
    assert origin.op == "aten._softmax.default"
    assert origin.hint is not None
    assert "every position is masked" in origin.hint
    assert [e.step for e in guard.events if e.is_origin] == [2]


class TemperedCausalAttention(nn.Module):
    """A causal mask kept as a -inf buffer, and a learned temperature under a sqrt."""

    def __init__(self, d: int = 16, t: int = 8) -> None:
        super().__init__()
        self.temp = nn.Parameter(torch.tensor(1.0))
        self.register_buffer("causal", torch.full((t, t), float("-inf")).triu(1))

    def forward(self, x: Tensor) -> Tensor:
        scores = x @ x.transpose(-1, -2) / torch.sqrt(self.temp) + self.causal
        return torch.softmax(scores, -1) @ x


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_causal_mask_buffer_does_not_take_over_the_attentions_origin(mode: str) -> None:
    # The temperature went negative: sqrt made NaN in the attention, whose -inf mask buffer
    # is a mask, not a buffer "already non-finite" that this forward only read.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), TemperedCausalAttention(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        for step in range(5):
            if step == 3:
                with torch.no_grad():
                    model[1].temp.fill_(-1.0)
            loss = guard.check_loss(model(torch.randn(2, 8, 4)).pow(2).mean())
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.module) == (3, "forward", "1")
    assert origin.op == "aten.sqrt.default"
    assert "nonfinite_params" not in origin.details
    assert "buffers" not in origin.message
    assert origin.hint is not None
    assert "sqrt of a negative value" in origin.hint


class BiasAttention(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        return self.o((q @ k.transpose(-1, -2) / 4.0 + bias).softmax(-1) @ v)


class BiasLM(nn.Module):
    """Builds a causal + padding bias with masked_fill(-inf) and hands it over positionally."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 16)
        self.attn = BiasAttention()
        self.head = nn.Linear(16, 20)

    def forward(self, tok: Tensor, pad: Tensor) -> Tensor:
        t = tok.shape[1]
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None] & ~pad[:, None, :]
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        h = self.emb(tok)
        return self.head(h + self.attn(h, bias))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_masked_row_origin_says_it_received_the_mask_not_only_finite_values(mode: str) -> None:
    # Left padding leaves query 0 of sample 2 nothing to attend to: the softmax's NaN. The
    # attention did receive -Inf (the bias, a mask): "everything it received was finite"
    # would send the user away from the mask.
    torch.manual_seed(0)
    model = BiasLM()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    tok = torch.randint(0, 20, (3, 6), generator=torch.Generator().manual_seed(7))
    guard = nanguard.watch(model, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        for step in range(4):
            pad = torch.zeros(3, 6, dtype=torch.bool)
            pad[1, 4:] = True  # right padding: every query sees itself
            if step == 3:
                pad[2, :2] = True  # left padding: query 0 sees nothing
            out = model(tok, pad)
            keep = ~pad[:, 1:]
            loss = guard.check_loss(
                nn.functional.cross_entropy(out[:, :-1][keep], tok[:, 1:][keep])
            )
            opt.zero_grad()
            loss.backward()
            opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.module, origin.op) == (3, "attn", "aten._softmax.default")
    assert "it received no NaN or +Inf (-Inf only in `args[1]`, a mask)" in origin.message
    assert "everything it received" not in origin.message


class ZeroedRowsAttention(nn.Module):
    """Causal attention that zeroes the NaN of fully masked rows with nan_to_num."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.o = nn.Linear(d, d)

    def forward(self, x: Tensor, pad: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        allowed = causal[None] & ~pad[:, None, :]
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        scores = q @ k.transpose(-1, -2) / 4.0 + bias  # (additive: its backward passes all)
        return self.o(torch.softmax(scores, -1).nan_to_num(0.0) @ v)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_masked_rows_nan_zeroed_in_the_forward_is_named_at_the_softmax_backward(
    mode: str,
) -> None:
    # Left padding: query 0 of sample 1 sees nothing. nan_to_num hides the NaN from the
    # forward, the softmax's backward reads it again: SoftmaxBackward0, not nan_to_num's.
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("attn", ZeroedRowsAttention())
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, :2] = True
    guard = nanguard.watch(model.attn, optimizer=opt, mode=mode)  # type: ignore[arg-type]

    def train() -> None:
        loss = guard.check_loss(model.attn(torch.randn(2, 6, 16), pad).pow(2).mean())
        opt.zero_grad()
        loss.backward()
        opt.step()

    with guard, pytest.raises(nanguard.NonFiniteError):
        train()
    origin = guard.origin
    assert origin is not None
    assert origin.phase == "backward"
    assert origin.op is not None
    assert "SoftmaxBackward0" in origin.op
    assert origin.hint is not None
    assert "every position is masked" in origin.hint
