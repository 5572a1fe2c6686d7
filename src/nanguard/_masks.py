"""Additive attention masks: arguments whose -inf is intentional.

An argument is mask-like when its name says so (``mask``, ``attn_mask``,
``src_key_padding_mask``, ``position_bias``, ``attn_bias``...). Such an argument is
probed with ``amax``: NaN and +Inf still show, -Inf (masked positions) does not, so
a model that passes a causal mask every step keeps the one-read fast path.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable
from typing import Final

from torch import nn

__all__ = ["MASK_NAME", "is_mask_name", "mask_positions"]

MASK_NAME: Final = re.compile(r"mask|bias", re.IGNORECASE)


def is_mask_name(name: object) -> bool:
    """Whether an argument or attribute named ``name`` holds an additive mask."""
    return isinstance(name, str) and MASK_NAME.search(name) is not None


def mask_positions(module: nn.Module) -> frozenset[int]:
    """Positions of ``module.forward``'s positional parameters named like a mask."""
    try:
        params: Iterable[inspect.Parameter] = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    positional = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return frozenset(i for i, name in enumerate(positional) if is_mask_name(name))
