"""User extensions of PyTorch around a watched model: torch.func ensembles, custom ops,
tensor subclasses, and the user's own hooks."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, stack_module_state, vmap

import nanguard


def line_of(obj: Callable[..., object] | type, code: str) -> str:
    """``file:line`` of the line of ``obj``'s source holding ``code``."""
    lines, start = inspect.getsourcelines(obj)
    offset = next(i for i, line in enumerate(lines) if code in line)
    return f"{inspect.getsourcefile(obj)}:{start + offset}"


class _Member(nn.Module):
    """One member of an ensemble: normalised features (0/0 on an all-zero padded row)."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(6, 16, bias=False)
        self.l2 = nn.Linear(16, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.l1(x)
        h = h / h.norm(dim=-1, keepdim=True)
        return self.l2(h)


class _Ensemble(nn.Module):
    """torch.func's model-ensembling recipe: stacked weights, one template run under vmap."""

    def __init__(self, template: str, k: int = 4) -> None:
        super().__init__()
        members = [_Member() for _ in range(k)]
        params, _ = stack_module_state(members)  # type: ignore[arg-type]
        self.names = list(params)
        self.params = nn.ParameterList([nn.Parameter(params[n]) for n in self.names])
        # The tutorial's stateless template on the meta device, or a real one.
        self.base = copy.deepcopy(members[0]).to("meta") if template == "meta" else members[0]

    def forward(self, x: Tensor) -> Tensor:
        params = dict(zip(self.names, self.params, strict=True))

        def one(p: dict[str, Tensor], xx: Tensor) -> Tensor:
            return functional_call(self.base, p, (xx,))  # type: ignore[no-any-return]

        return vmap(one, in_dims=(0, None))(params, x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("mode", ["full", "sentinel"])
@pytest.mark.parametrize("template", ["meta", "real"])
def test_a_vmap_ensemble_is_watched_and_its_members_line_is_named(template: str, mode: str) -> None:
    # watch() read the meta template's parameters (a crash: "Cannot copy out of meta
    # tensor"), and with a real template the operation was looked for in the template's own
    # calls, which run inside vmap unprobed: no op, no line, "Look at" the wrong forward.
    def train(x: Tensor, guarded: bool) -> tuple[nn.Module, nanguard.Guard | None]:
        torch.manual_seed(0)
        model = _Ensemble(template)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        guard = nanguard.watch(model, optimizer=opt, mode=mode, on_nonfinite="log")
        if not guarded:
            guard.detach()
        try:
            for _ in range(3):
                loss = ((model(x) - 1) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        finally:
            if guard.attached:
                guard.detach()
        return model, guard if guarded else None

    torch.manual_seed(1)
    x = torch.randn(32, 6)
    model, guard = train(x, guarded=True)
    plain, _ = train(x, guarded=False)
    assert guard is not None
    assert guard.events == []
    for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
        if not a.is_meta:
            assert torch.equal(a, b)

    x[3] = 0.0  # a padded row
    _, guard = train(x, guarded=True)
    assert guard is not None
    origin = guard.origin
    assert origin is not None
    assert (origin.step, origin.phase, origin.kind, origin.op) == (
        0,
        "forward",
        "nan",
        "aten.div.Tensor",
    )
    assert origin.source is not None
    assert origin.source.startswith(line_of(_Member.forward, "h = h / h.norm"))
    assert origin.reproducible is True
    assert origin.hint is not None
    assert "divided by zero" in origin.hint
