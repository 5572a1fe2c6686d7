"""nanguard: find where NaN/Inf is born in PyTorch training, cheaply enough to leave on.

Example:
    >>> import torch, nanguard
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    >>> with nanguard.watch(model, on_nonfinite="log") as guard:
    ...     out = model(torch.randn(2, 4))
    ...     _ = guard.step()
    >>> guard.events
    []
"""

from __future__ import annotations

from nanguard._errors import NanguardError as NanguardError
from nanguard._errors import NonFiniteError as NonFiniteError
from nanguard._errors import NonFiniteWarning as NonFiniteWarning
from nanguard._events import KINDS as KINDS
from nanguard._events import PHASES as PHASES
from nanguard._events import Event as Event
from nanguard._events import TensorStats as TensorStats
from nanguard._guard import AttachError as AttachError
from nanguard._guard import Guard as Guard
from nanguard._guard import unwatch as unwatch
from nanguard._guard import watch as watch
from nanguard._log import read_jsonl as read_events
from nanguard._options import Options as Options

__all__ = [
    "AttachError",
    "Event",
    "Guard",
    "KINDS",
    "NanguardError",
    "NonFiniteError",
    "NonFiniteWarning",
    "Options",
    "PHASES",
    "TensorStats",
    "read_events",
    "unwatch",
    "watch",
]

__version__ = "0.1.0"
