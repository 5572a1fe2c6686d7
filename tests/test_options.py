"""Bad input to the API gets a clear error naming the valid values."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import nanguard


def model() -> nn.Module:
    return nn.Linear(2, 2)


def test_model_must_be_a_module() -> None:
    with pytest.raises(TypeError, match=r"takes a torch.nn.Module, got function"):
        nanguard.watch(lambda x: x)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("options", "error", "match"),
    [
        ({"on_nonfinite": "explode"}, ValueError, r"'raise', 'warn', 'log'"),
        ({"on_nonfinite": None}, ValueError, r"on_nonfinite=None is not valid"),
        ({"sync": "always"}, ValueError, r"choose one of 'step', 'module'"),
        ({"on_nan": "x"}, TypeError, r"unknown option 'on_nan'.*valid options are: .*on_nonfinite"),
        ({"exclde": ()}, TypeError, r"did you mean 'exclude'"),
        ({"exclude": (nn.Dropout, 3)}, TypeError, r"module types .* or name patterns"),
        ({"exclude": 3}, TypeError, r"exclude= takes module types"),
        ({"allow_inf": (int,)}, TypeError, r"allow_inf= takes module types"),
        ({"max_events": 0}, ValueError, r"max_events= takes an int >= 1, got 0"),
        ({"max_events": 2.5}, TypeError, r"max_events= takes an int"),
        ({"max_propagated": -1}, ValueError, r"max_propagated= takes an int >= 0"),
        ({"log_path": 3}, TypeError, r"log_path= takes a str or os.PathLike"),
        ({"optimizer": "adam"}, TypeError, r"takes a torch.optim.Optimizer, got str"),
        ({"names": {"fc": "x"}}, TypeError, r"names= takes a dict \{module: 'display name'\}"),
        ({"replay": "yes"}, TypeError, r"replay= takes True or False"),
    ],
)
def test_invalid_options(options: dict[str, object], error: type, match: str) -> None:
    m = model()
    with pytest.raises(error, match=match):
        nanguard.watch(m, **options)  # type: ignore[arg-type]
    assert not m._forward_pre_hooks  # nothing attached


def test_single_type_and_single_pattern_are_accepted() -> None:
    m = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    with nanguard.watch(m, exclude=nn.Dropout, allow_inf="0") as guard:  # type: ignore[arg-type]
        assert guard.options.exclude.types == (nn.Dropout,)
        assert guard.options.allow_inf.patterns == ("0",)


def test_options_are_exposed_and_frozen() -> None:
    guard = nanguard.Guard(model(), on_nonfinite="warn", max_events=5)
    assert guard.options.on_nonfinite == "warn"
    assert guard.options.max_events == 5
    with pytest.raises(AttributeError):
        guard.options.max_events = 3  # type: ignore[misc]


def test_check_loss_takes_a_tensor() -> None:
    guard = nanguard.watch(model())
    with pytest.raises(TypeError, match="takes a tensor, got float"):
        guard.check_loss(1.0)  # type: ignore[arg-type]
    guard.detach()


def test_integer_loss_is_ignored() -> None:
    with nanguard.watch(model()) as guard:
        assert guard.check_loss(torch.tensor(3)) is not None
        assert guard.step() == []
