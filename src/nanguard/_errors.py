"""The exception and warning types: one root, messages that carry the event."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from nanguard._events import Event

__all__ = ["NanguardError", "NonFiniteError", "NonFiniteWarning"]


class NanguardError(Exception):
    """Root of every exception nanguard raises on purpose."""


class NonFiniteError(NanguardError, FloatingPointError):
    """A non-finite value (NaN or Inf) was found and the policy is ``"raise"``.

    Attributes:
        event: the :class:`nanguard.Event` that stopped training: the origin, or for an
            error raised later about the same failure (gradients not zeroed after a caught
            error, a step held back) the event that says why.

    Example:
        >>> try:
        ...     ...  # a guarded training step
        ... except NonFiniteError as err:
        ...     print(err.event.module)  # doctest: +SKIP
    """

    def __init__(self, event: Event) -> None:
        super().__init__(told(event))
        self.event = event

    def __reduce__(self) -> tuple[type[NonFiniteError], tuple[Event]]:
        return (type(self), (self.event,))


class NonFiniteWarning(RuntimeWarning):
    """Issued when the policy is ``"warn"``: for each origin of a non-finite value, and
    for early warnings and steps that still carry one (a step whose values are non-finite
    though nothing new was created)."""


for _cls in (NanguardError, NonFiniteError, NonFiniteWarning):
    _cls.__module__ = "nanguard"


def told(event: Event) -> str:
    """What the user reads of ``event``: its message, and its hint when the message does
    not carry it already (a parameter's origin: the optimizer state, the eps it found)."""
    hint = event.hint
    if hint and hint not in event.message:
        return f"{event.message} Likely cause: {hint}"
    return event.message
