"""Models called with a batch object: ``model(data)`` as PyTorch Geometric, detectron2 and
SpeechBrain code does. Its tensors are the model's inputs: a NaN in them is the batch's,
and a failing step is replayed (on a copy) like one given plain tensors."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, MutableMapping
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class Graph:
    """A hand-written graph container (a plain class)."""

    def __init__(self, x: torch.Tensor, edge_index: torch.Tensor) -> None:
        self.x = x
        self.edge_index = edge_index


@dataclasses.dataclass
class GraphDC:
    x: torch.Tensor
    edge_index: torch.Tensor


class _Storage(MutableMapping):  # type: ignore[type-arg]
    """PyG's storage: a mapping behind attribute access."""

    def __init__(self, values: dict[str, Any]) -> None:
        self._mapping = dict(values)

    def __getitem__(self, key: str) -> Any:
        return self._mapping[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self._mapping[key] = value

    def __delitem__(self, key: str) -> None:
        del self._mapping[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._mapping)

    def __len__(self) -> int:
        return len(self._mapping)


class PygData:
    """Like torch_geometric.data.Data: attributes live in a storage mapping."""

    def __init__(self, **values: Any) -> None:
        self.__dict__["_store"] = _Storage(values)

    def __getattr__(self, key: str) -> Any:
        try:
            return self.__dict__["_store"][key]
        except KeyError:
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        self._store[key] = value

    def __copy__(self) -> PygData:
        out = PygData.__new__(PygData)
        out.__dict__["_store"] = copy.copy(self._store)
        return out


CONTAINERS = {
    "plain": lambda x, ei: Graph(x, ei),
    "dataclass": lambda x, ei: GraphDC(x, ei),
    "pyg": lambda x, ei: PygData(x=x, edge_index=ei),
}


class MeanConv(nn.Module):
    """GraphSAGE mean aggregation; without the clamp an isolated node divides 0 by 0."""

    def __init__(self, i: int, o: int, clamp: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(2 * i, o)
        self.clamp = clamp

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor) -> torch.Tensor:
        src, dst = edge_index
        total = torch.zeros_like(x).index_add_(0, dst, x[src])
        count = torch.zeros(x.size(0)).index_add_(0, dst, torch.ones(dst.numel()))
        if self.clamp:
            count = count.clamp(min=1)
        mean = total / count[:, None]
        return self.lin(torch.cat([x, mean], -1))


class Net(nn.Module):
    def __init__(self, clamp: bool = True) -> None:
        super().__init__()
        self.conv1 = MeanConv(8, 16, clamp)
        self.conv2 = MeanConv(16, 3, True)

    def forward(self, data: Any) -> torch.Tensor:
        h = F.relu(self.conv1(data.x, data.edge_index))
        return self.conv2(h, data.edge_index)


def graph(nan_feature: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    n = 20
    x = torch.randn(n, 8, generator=gen)
    if nan_feature:
        x[4, 2] = float("nan")  # a missing descriptor
    edge_index = torch.randint(0, n - 1, (2, 60), generator=gen)  # node 19 is isolated
    return x, edge_index, torch.randint(0, 3, (n,), generator=gen)


def train_step(model: nn.Module, batch: Any, y: torch.Tensor, mode: str) -> nanguard.Guard:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = F.cross_entropy(model(batch), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return guard


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("container", list(CONTAINERS))
def test_a_nan_in_a_batch_object_is_the_batchs(container: str, mode: str) -> None:
    torch.manual_seed(0)
    x, edge_index, y = graph(nan_feature=True)
    guard = train_step(Net(), CONTAINERS[container](x, edge_index), y, mode)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("input", "")
    path = "args[0]._store.x" if container == "pyg" else "args[0].x"
    assert origin.tensor == path
    assert origin.stats is not None
    assert origin.stats.nan_count == 1
    assert "the input batch already contains NaN" in origin.message
    assert "sample 4" in origin.message


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("container", list(CONTAINERS))
def test_a_failing_step_given_a_batch_object_is_replayed_to_the_op(
    container: str, mode: str
) -> None:
    torch.manual_seed(0)
    x, edge_index, y = graph()
    guard = train_step(Net(clamp=False), CONTAINERS[container](x, edge_index), y, mode)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("forward", "conv1", "MeanConv")
    assert origin.op == "aten.div.Tensor"
    assert origin.source is not None
    assert "mean = total / count[:, None]" in origin.source
    assert "stats_problem" not in origin.details


class Encoder(nn.Module):
    """Writes its result into the batch object, as PyG-style code does (data.x = ...)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = MeanConv(8, 8, clamp=False)
        self.head = nn.Linear(8, 3)

    def forward(self, data: Graph) -> torch.Tensor:
        data.x = self.conv(data.x, data.edge_index)
        return self.head(data.x)


def test_the_replay_runs_on_a_copy_of_the_batch_object() -> None:
    torch.manual_seed(0)
    x, edge_index, y = graph()
    batch = Graph(x, edge_index)
    guard = train_step(Encoder(), batch, y, "sentinel")
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.op) == ("conv", "aten.div.Tensor")  # replayed from the start
    # The user's object holds what the forward set (once), not what a replay set.
    assert batch.x is not x
    assert batch.x.shape == (20, 8)
    assert batch.edge_index is edge_index


class InPlace(nn.Module):
    """Normalises the batch's features in place, then fails."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 3)

    def forward(self, data: Graph) -> torch.Tensor:
        data.x.sub_(data.x.mean(0))
        return self.lin(data.x) / 0.0


def test_a_batch_object_whose_tensors_the_forward_changed_in_place_is_not_replayed() -> None:
    torch.manual_seed(0)
    x, edge_index, y = graph()
    before = x.clone()
    guard = train_step(InPlace(), Graph(x, edge_index), y, "full")
    origin = guard.origin
    assert origin is not None
    assert origin.module == ""  # found by the probes all the same
    assert "modified in place" in origin.details.get("stats_problem", "")
    # (the replay did not run the in-place normalisation a second time)
    assert torch.equal(x, before - before.mean(0))


class StaticCache:
    """A preallocated key cache the model writes into in place (like HF's StaticCache)."""

    def __init__(self, n: int) -> None:
        self.keys = torch.zeros(n, 8)
        self.position = 0


class Decoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, cache: StaticCache) -> torch.Tensor:
        k = self.proj(x)
        cache.keys[cache.position : cache.position + len(x)] = k.detach()
        cache.position += len(x)
        return torch.log(k)  # NaN for negative keys


def test_a_cache_object_written_in_place_is_left_as_the_forward_left_it() -> None:
    torch.manual_seed(0)
    model = Decoder()
    x = torch.randn(4, 8)
    expected = StaticCache(12)
    with torch.no_grad():
        model(x, expected)
    for mode in ("full", "sentinel"):
        cache = StaticCache(12)
        with nanguard.watch(model, mode=mode, on_nonfinite="log") as guard, torch.no_grad():
            model(x, cache)
        assert guard.origin is not None
        assert guard.origin.module == ""
        assert cache.position == expected.position == 4
        assert torch.equal(cache.keys, expected.keys)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("container", list(CONTAINERS))
def test_healthy_training_on_batch_objects_is_silent_and_unchanged(
    container: str, mode: str
) -> None:
    x, edge_index, y = graph()

    def train(guarded: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        guard = nanguard.watch(model, optimizer=opt, mode=mode) if guarded else None
        for _ in range(20):
            loss = F.cross_entropy(model(CONTAINERS[container](x, edge_index)), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        if guard is not None:
            guard.detach()
            assert guard.events == []
        return model.state_dict()

    plain, guarded = train(False), train(True)
    assert all(torch.equal(plain[k], guarded[k]) for k in plain)


class PygData2(PygData):
    """Since PyG 2.3, Data also holds its attribute classes in its instance dict."""

    def __init__(self, **values: Any) -> None:
        super().__init__(**values)
        self.__dict__["_tensor_attr_cls"] = Graph
        self.__dict__["_edge_attr_cls"] = GraphDC

    def __copy__(self) -> PygData2:  # (as PyG's: every attribute, and a copy of the store)
        out = PygData2.__new__(PygData2)
        out.__dict__.update(self.__dict__)
        out.__dict__["_store"] = copy.copy(self._store)
        return out


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_batch_object_holding_classes_is_still_replayed(mode: str) -> None:
    torch.manual_seed(0)
    x, edge_index, y = graph()
    guard = train_step(Net(clamp=False), PygData2(x=x, edge_index=edge_index), y, mode)
    origin = guard.origin
    assert origin is not None
    assert (origin.module, origin.op) == ("conv1", "aten.div.Tensor")


class SlotsBatch:
    """__slots__ and a dict-backed __getattr__ (an AttrDict-style batch)."""

    __slots__ = ("fields",)

    def __init__(self, **fields: torch.Tensor) -> None:
        self.fields = fields

    def __getattr__(self, key: str) -> torch.Tensor:
        return self.fields[key]  # (a KeyError, not an AttributeError, for a missing key)


def test_a_batch_with_slots_and_a_raising_getattr_does_not_break_the_forward() -> None:
    torch.manual_seed(0)
    x, edge_index, y = graph(nan_feature=True)
    guard = train_step(Net(), SlotsBatch(x=x, edge_index=edge_index), y, "full")
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("input", "args[0].fields['x']")


class Sample:
    def __init__(self, batch: Any, x: torch.Tensor) -> None:
        self.batch = batch  # a back-reference
        self.x = x


class SampleBatch:
    def __init__(self, x: torch.Tensor, edge_index: torch.Tensor, n: int) -> None:
        self.x = x
        self.edge_index = edge_index
        self.samples = [Sample(self, x[i % len(x)]) for i in range(n)]


def test_a_batch_object_with_many_back_references_is_walked_within_a_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from nanguard import _recording
    from nanguard._tree import OBJECT_BUDGET

    copies = 0
    original = copy.copy

    def counting(value: Any) -> Any:
        nonlocal copies
        copies += 1
        return original(value)

    monkeypatch.setattr(_recording.copy, "copy", counting)
    torch.manual_seed(0)
    x, edge_index, y = graph(nan_feature=True)
    guard = train_step(Net(), SampleBatch(x, edge_index, 5000), y, "full")
    assert copies <= OBJECT_BUDGET  # (each object once, and no more than the budget)
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("input", "args[0].x")


class SpeechEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(40, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        return self.out(torch.relu(self.proj(batch["feats"]))).mean(1)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_batch_keeping_thousands_of_raw_tokens_still_has_its_tensors_checked(
    mode: str,
) -> None:
    # A collate_fn keeping each utterance's raw tokens (for WER) ahead of the features.
    torch.manual_seed(0)
    feats = torch.randn(32, 10, 40)
    feats[5, 2:4] = float("nan")  # a corrupt file
    batch = {"tokens": [[f"w{i}_{j}" for j in range(100)] for i in range(32)], "feats": feats}
    model = SpeechEncoder()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log") as guard:
        loss = guard.check_loss(F.cross_entropy(model(batch), torch.randint(0, 3, (32,))))
        opt.zero_grad()
        loss.backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("input", "args[0]['feats']")
    assert "sample 5" in origin.message


class DatasetBatch:
    """A batch that references its whole dataset (torchtext legacy's Batch.dataset)."""

    def __init__(self, dataset: list[Sample], x: torch.Tensor, edge_index: torch.Tensor) -> None:
        self.dataset = dataset  # (before its own tensors, in attribute order)
        self.x = x
        self.edge_index = edge_index


def test_a_batch_referencing_its_dataset_still_has_its_own_tensors_checked() -> None:
    torch.manual_seed(0)
    x, edge_index, y = graph(nan_feature=True)
    dataset = [Sample(None, torch.zeros(3)) for _ in range(5000)]
    guard = train_step(Net(), DatasetBatch(dataset, x, edge_index), y, "full")
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("input", "args[0].x")


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, k: int, x: torch.Tensor, flag: int) -> torch.Tensor:
        return self.lin(x) * k * flag


def test_a_tensor_between_scalar_arguments_is_checked_in_sentinel_mode() -> None:
    torch.manual_seed(0)
    model = Scaled()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    x[1, 2] = float("nan")
    with nanguard.watch(model, optimizer=opt, mode="sentinel", on_nonfinite="log") as guard:
        model(3, x, 5).sum().backward()
        opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.tensor) == ("input", "args[1]")


class DeepUnwrap(nn.Module):
    """Takes its batch nested in lists and dicts, deeper than nanguard's input walk goes."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.Linear(4, 1)

    def forward(self, batch: object) -> torch.Tensor:
        x = batch
        while not isinstance(x, torch.Tensor):
            x = x[0] if isinstance(x, list) else x["img"]  # type: ignore[index]
        return self.l(x)


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_batch_nested_past_the_walk_is_not_said_to_be_finite(mode: str) -> None:
    torch.manual_seed(0)
    model = DeepUnwrap()
    x = torch.randn(5, 4)
    x[1, 1] = float("nan")
    batch: object = x
    for depth in range(12):
        batch = [batch] if depth % 2 == 0 else {"img": batch}
    with nanguard.watch(model, on_nonfinite="log", mode=mode) as guard:  # type: ignore[arg-type]
        model(batch).sum().backward()
        guard.step()
    # The walk stops before the tensor: the NaN is the model's (the first place seen),
    # without the claim that what it was given was finite.
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("forward", "")
    assert "nested deeper than it looks" in origin.message
    assert "its inputs were finite" not in origin.message
    assert "everything it received" not in origin.message
