"""From a review with graph networks and machine-learned interatomic potentials: distances
read by several modules, distance modules returning (r, vec), forces taken with respect to
positions held in a batch object."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanguard


class Batch:
    """A PyG/SchNetPack-style data object."""

    def __init__(self, **fields: torch.Tensor) -> None:
        self.__dict__.update(fields)


class RBF(nn.Module):
    """Gaussian expansion of distances; a width an update pushed below 0 makes gamma Inf
    (exp(-inf * d**2) = 0 hides it from the forward, not from the backward)."""

    def __init__(self, n: int = 16, cutoff: float = 5.0) -> None:
        super().__init__()
        self.register_buffer("mu", torch.linspace(0, cutoff, n))
        self.width = nn.Parameter(torch.full((n,), cutoff / n))

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        gamma = 0.5 / self.width.clamp(min=0.0) ** 2
        return torch.exp(-gamma * (r[:, None] - self.mu) ** 2)


class CosineCutoff(nn.Module):
    def forward(self, r: torch.Tensor) -> torch.Tensor:
        return 0.5 * (torch.cos(math.pi * r / 5.0) + 1.0) * (r < 5.0).float()


class Potential(nn.Module):
    """SchNet-like: the distances r are read by the RBF expansion and by the cutoff."""

    def __init__(self) -> None:
        super().__init__()
        self.rbf = RBF()
        self.cut = CosineCutoff()
        self.lin = nn.Linear(16, 1)

    def forward(self, pos: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        vec = pos[edges[1]] - pos[edges[0]]
        r = torch.sqrt((vec * vec).sum(-1))
        return (self.lin(self.rbf(r)).squeeze(-1) * self.cut(r)).sum()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_force_training_names_the_module_of_two_reading_the_distances_that_made_it(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = Potential()
    with torch.no_grad():
        model.rbf.width[5] = -1e-3
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pos = (torch.rand(40, 3) * 6).requires_grad_(True)
    edges = torch.combinations(torch.arange(40)).T
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        energy = model(pos, edges)
        forces = -torch.autograd.grad(energy, pos, create_graph=True)[0]
        loss = guard.check_loss(forces.pow(2).mean())
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module, origin.module_type) == ("backward", "rbf", "RBF")


class Sqrt(nn.Module):
    def forward(self, r: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(r * r)  # its backward is NaN at r == 0


class Cos(nn.Module):
    def forward(self, r: torch.Tensor) -> torch.Tensor:
        return torch.cos(r)


class Siblings(nn.Module):
    def __init__(self, bad_first: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.a = Sqrt()
        self.b = Cos()
        self.head = nn.Linear(2, 1)
        self.bad_first = bad_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        r = self.lin(x)
        if self.bad_first:
            u, v = self.a(r), self.b(r)
        else:
            v, u = self.b(r), self.a(r)
        return self.head(torch.cat([u, v], -1))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("bad_first", [True, False])
def test_of_two_modules_reading_one_tensor_the_one_whose_backward_made_nan_is_named(
    mode: str, bad_first: bool
) -> None:
    torch.manual_seed(0)
    model = Siblings(bad_first)
    with torch.no_grad():
        model.lin.weight.zero_()
        model.lin.bias.zero_()  # r == 0
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        loss = guard.check_loss(model(torch.randn(64, 3)).pow(2).mean())
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "a")


class Distance(nn.Module):
    """Returns the distances and the edge vectors (SchNet/PaiNN/NequIP edge modules)."""

    def forward(self, pos: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, ...]:
        vec = pos[edges[1]] - pos[edges[0]]
        r = torch.sqrt((vec * vec).sum(-1))
        return r, vec


class PaiNNLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dist = Distance()
        self.mlp = nn.Sequential(nn.Linear(1, 32), nn.SiLU(), nn.Linear(32, 1))

    def forward(self, data: Batch) -> torch.Tensor:
        r, vec = self.dist(data.pos, data.edge_index)
        e_edge = self.mlp(r[:, None]).squeeze(-1) + 0.1 * vec.sum(-1)
        return torch.zeros(data.pos.shape[0]).index_add_(0, data.edge_index[0], e_edge).sum()


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_forces_from_positions_in_a_batch_object_name_the_distance_modules_backward(
    mode: str,
) -> None:
    # Two atoms overlap: sqrt's backward at r = 0 makes the forces NaN.
    torch.manual_seed(0)
    pos0 = torch.randn(200, 3) * 3
    pos0[1] = pos0[0]
    edges = torch.combinations(torch.arange(20)).T
    edges = torch.cat([edges, edges.flip(0)], 1)
    model = PaiNNLike()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pos = pos0.clone().requires_grad_(True)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        energy = model(Batch(pos=pos, edge_index=edges))
        forces = -torch.autograd.grad(energy, pos, create_graph=True)[0]
        loss = guard.check_loss(F.mse_loss(forces, torch.zeros(200, 3)) + energy.pow(2))
        loss.backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "dist")
    assert origin.op is not None
    assert "SqrtBackward0" in origin.op


class Interaction(nn.Module):
    """SchNet's interaction block: it receives r itself and hands it to two children."""

    def __init__(self) -> None:
        super().__init__()
        self.a = Sqrt()
        self.b = Cos()

    def forward(self, r: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.a(r), self.b(r)], -1)


class WithBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 1)
        self.block = Interaction()
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(self.lin(x)))


@pytest.mark.parametrize("mode", ["full", "sentinel"])
def test_a_block_and_its_children_reading_one_tensor_name_the_child_that_made_it(
    mode: str,
) -> None:
    torch.manual_seed(0)
    model = WithBlock()
    with torch.no_grad():
        model.lin.weight.zero_()
        model.lin.bias.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with nanguard.watch(model, optimizer=opt, mode=mode) as guard:
        guard.check_loss(model(torch.randn(64, 3)).pow(2).mean()).backward()
        with pytest.raises(nanguard.NonFiniteError):
            opt.step()
    origin = guard.origin
    assert origin is not None
    assert (origin.phase, origin.module) == ("backward", "block.a")
