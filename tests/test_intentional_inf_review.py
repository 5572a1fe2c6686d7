"""Healthy models that write +/-inf on purpose must train under on_nonfinite="raise":
a batch-hard triplet miner excluding each embedding from its own negatives with +inf, and a
linear-chain CRF whose forbidden transitions are -inf inside its parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard

MODES = ("full", "sentinel")


class _BatchHardMiner(nn.Module):
    """Pairwise distances with the diagonal excluded (+inf), as kNN and triplet code does."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, emb: torch.Tensor) -> torch.Tensor:
        d = torch.cdist(emb, emb)
        eye = torch.eye(d.size(0), dtype=torch.bool)
        if self.how == "index_assign":
            d = d.clone()
            d[eye] = float("inf")
            return d
        return torch.where(eye, torch.tensor(float("inf")), d)


class _Embedder(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(64, 256), nn.BatchNorm1d(256), nn.ReLU(), nn.Linear(256, 64)
        )
        self.miner = _BatchHardMiner(how)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        e = F.normalize(self.net(x), dim=-1)
        return e, self.miner(e)


def _train_triplet(how: str, mode: str | None) -> nn.Module:
    torch.manual_seed(0)
    model = _Embedder(how)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    labels = torch.arange(16).repeat_interleave(4)  # P=16 identities x K=4
    same = labels[:, None] == labels[None, :]
    guard = nanguard.watch(model, optimizer=opt, mode=mode) if mode else None
    try:
        for _ in range(8):
            x = torch.randn(64, 64) + labels[:, None].float().sin()
            _, d = model(x)
            hardest_pos = d.masked_fill(~same, 0).masked_fill(d.isinf(), 0).amax(1)
            hardest_neg = d.masked_fill(same, float("inf")).amin(1)
            loss = F.relu(hardest_pos - hardest_neg + 0.2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        if guard is not None:
            guard.detach()
            assert guard.events == []
    return model


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["index_assign", "where_constant"])
def test_plus_inf_written_by_index_or_a_constant_tensor_trains_silently(
    how: str, mode: str
) -> None:
    # d[eye] = float("inf") and torch.where(eye, torch.tensor(float("inf")), d) reach the
    # operations as a one-element +Inf tensor: written on purpose, like masked_fill(inf).
    guarded = _train_triplet(how, mode)
    plain = _train_triplet(how, None)
    for a, b in zip(guarded.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)


TAGS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC"]


def _allowed(i: int, j: int) -> bool:
    """BIO: I-X only after B-X or I-X."""
    to = TAGS[j]
    return not to.startswith("I-") or (TAGS[i][2:] == to[2:] and TAGS[i] != "O")


class _CRF(nn.Module):
    """A linear-chain CRF whose forbidden transitions are -inf in its parameters: the
    logsumexp gives them a gradient of 0, and Adam leaves them at -inf."""

    def __init__(self) -> None:
        super().__init__()
        k = len(TAGS)
        self.start = nn.Parameter(torch.empty(k).uniform_(-0.1, 0.1))
        self.transitions = nn.Parameter(torch.empty(k, k).uniform_(-0.1, 0.1))
        forbidden = torch.tensor([[not _allowed(i, j) for j in range(k)] for i in range(k)])
        with torch.no_grad():
            self.transitions[forbidden] = float("-inf")
            self.start[torch.tensor([t.startswith("I-") for t in TAGS])] = float("-inf")

    def forward(self, emissions: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        score = self.start[tags[:, 0]] + emissions[:, 0].gather(1, tags[:, :1]).squeeze(1)
        for i in range(1, emissions.size(1)):
            score = score + self.transitions[tags[:, i - 1], tags[:, i]]
            score = score + emissions[:, i].gather(1, tags[:, i : i + 1]).squeeze(1)
        alpha = self.start + emissions[:, 0]
        for i in range(1, emissions.size(1)):
            alpha = torch.logsumexp(
                alpha.unsqueeze(2) + self.transitions + emissions[:, i].unsqueeze(1), dim=1
            )
        return (torch.logsumexp(alpha, dim=1) - score).mean()


class _Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(500, 32)
        self.emit = nn.Linear(32, len(TAGS))
        self.crf = _CRF()

    def forward(self, tokens: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.crf(self.emit(self.embed(tokens)), tags)  # type: ignore[no-any-return]


def _legal_tags(n: int, length: int) -> torch.Tensor:
    tags = torch.zeros(n, length, dtype=torch.long)
    for b in range(n):
        for i in range(0, length - 1, 4):
            kind = 1 + 2 * ((b + i) % 2)  # B-PER or B-LOC, then its I-
            tags[b, i], tags[b, i + 1] = kind, kind + 1
    return tags


def _train_tagger(mode: str | None, **options: object) -> tuple[nn.Module, nanguard.Guard | None]:
    torch.manual_seed(0)
    model = _Tagger()
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    guard = nanguard.watch(model, optimizer=opt, mode=mode, **options) if mode else None
    try:
        for _ in range(6):
            loss = model(torch.randint(0, 500, (16, 12)), _legal_tags(16, 12))
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        if guard is not None:
            guard.detach()
    return model, guard


@pytest.mark.parametrize("mode", MODES)
def test_a_crf_with_minus_inf_in_its_parameters_says_to_allow_it(mode: str) -> None:
    with pytest.raises(nanguard.NonFiniteError, match=r"pass allow_inf=\('crf',\)") as raised:
        _train_tagger(mode)
    assert raised.value.event.param in ("crf.start", "crf.transitions")


@pytest.mark.parametrize("mode", MODES)
def test_a_crf_in_allow_inf_trains_silently_and_its_nan_is_still_told(mode: str) -> None:
    model, guard = _train_tagger(mode, allow_inf=("crf",))
    assert guard is not None
    assert guard.events == []
    plain, _ = _train_tagger(None)
    for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # A checkpoint with a NaN transition: NaN is reported in an allow_inf module too.
    checkpoint = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint["crf.transitions"][0, 0] = float("nan")
    opt = torch.optim.AdamW(model.parameters(), 1e-2)
    with nanguard.watch(model, optimizer=opt, mode=mode, allow_inf=("crf",)) as guard:
        model.load_state_dict(checkpoint)
        loss = model(torch.randint(0, 500, (16, 12)), _legal_tags(16, 12))
        opt.zero_grad()
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError) as raised:
            opt.step()
    origin = raised.value.event
    assert (origin.phase, origin.param, origin.kind) == ("param", "crf.transitions", "nan")
    assert origin.details["reason"] == "loaded_checkpoint"


@pytest.mark.parametrize("mode", MODES)
def test_weight_decay_on_an_allowed_minus_inf_weight_is_named_at_its_step(mode: str) -> None:
    """Adam's L2 term adds wd * -inf to the forbidden transitions' gradient: the first
    update makes them NaN. The allowed weights are still swept for NaN: the step and the
    parameter are named, with what to change."""
    torch.manual_seed(0)
    model = _Tagger()
    opt = torch.optim.Adam(model.parameters(), 1e-3, weight_decay=0.01)
    with nanguard.watch(
        model, optimizer=opt, mode=mode, allow_inf=("crf",), on_nonfinite="log"
    ) as guard:
        for _ in range(3):
            loss = model(torch.randint(0, 500, (16, 12)), _legal_tags(16, 12))
            opt.zero_grad()
            loss.backward()
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase) == (0, "param")
    assert origin.param in ("crf.start", "crf.transitions")
    assert origin.hint is not None
    assert "weight_decay=0" in origin.hint


class _SoftNeighbours(nn.Module):
    """A soft-nearest-neighbour (NCA) head: a point is not its own neighbour (d_ii = +inf),
    so log p_ii = log_softmax(-d)_ii is -inf on purpose."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.embed = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e = self.embed(x)
        d = (e[:, None, :] - e[None, :, :]).pow(2).sum(-1)
        eye = torch.eye(len(e), dtype=torch.bool)
        if self.how == "index_assign":
            d[eye] = float("inf")
        else:
            d = d.masked_fill(eye, float("inf"))
        return F.log_softmax(-d, dim=1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("how", ["index_assign", "masked_fill"])
def test_minus_inf_made_from_a_deliberate_plus_inf_trains_silently(how: str, mode: str) -> None:
    torch.manual_seed(0)
    model = _SoftNeighbours(how)
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for _ in range(5):
            x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
            logp = model(x)
            same = (y[:, None] == y[None]) & ~torch.eye(32, dtype=torch.bool)
            loss = -torch.logsumexp(logp.masked_fill(~same, float("-inf")), 1).mean()
            loss = guard.check_loss(loss)
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []


class _ExcludingSelf(nn.Module):
    def forward(self, e: torch.Tensor) -> torch.Tensor:
        d = (e[:, None, :] - e[None, :, :]).pow(2).sum(-1)
        d[torch.eye(len(e), dtype=torch.bool)] = float("inf")  # not its own neighbour
        return d


class _NCA(nn.Module):
    """The +inf written by a child module, the -inf of log_softmax(-d) in the parent's code."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 32))
        self.dist = _ExcludingSelf()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(-self.dist(self.embed(x)), dim=1)


@pytest.mark.parametrize("mode", MODES)
def test_minus_inf_in_a_parent_from_a_childs_deliberate_plus_inf_trains_silently(mode: str) -> None:
    torch.manual_seed(0)
    model = _NCA()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        for _ in range(5):
            x, y = torch.randn(32, 16), torch.randint(0, 4, (32,))
            same = (y[:, None] == y[None]) & ~torch.eye(32, dtype=torch.bool)
            loss = -torch.logsumexp(model(x).masked_fill(~same, float("-inf")), 1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
    assert guard.events == []
