from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# Make tests/realistic.py importable as a plain module.
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
