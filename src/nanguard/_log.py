"""Where events go: a bounded, locked in-memory log and a JSON-lines file."""

from __future__ import annotations

import collections
import json
import os
import threading
from collections.abc import Iterable
from typing import IO

from nanguard._events import Event

__all__ = ["EventLog", "JsonlSink"]


class EventLog:
    """The newest ``max_events`` events, oldest first; counts what it dropped.

    The first origin is kept apart, so a flood of later events never hides it.
    Safe to use from several threads.

    Example:
        >>> log = EventLog(max_events=2)
        >>> log.dropped
        0
    """

    def __init__(self, max_events: int) -> None:
        self._events: collections.deque[Event] = collections.deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._dropped = 0
        self._origin: Event | None = None
        self._latest: Event | None = None

    def extend(self, events: Iterable[Event]) -> None:
        with self._lock:
            for event in events:
                if len(self._events) == self._events.maxlen:
                    self._dropped += 1
                self._events.append(event)
                if event.is_origin:
                    self._latest = event
                    if self._origin is None:
                        self._origin = event

    def snapshot(self) -> list[Event]:
        with self._lock:
            return list(self._events)

    @property
    def dropped(self) -> int:
        with self._lock:
            return self._dropped

    @property
    def origin(self) -> Event | None:
        with self._lock:
            return self._origin

    @property
    def latest_origin(self) -> Event | None:
        """The latest event with ``is_origin=True`` (kept when the log dropped it)."""
        with self._lock:
            return self._latest

    def clear(self) -> None:
        with self._lock:
            self._events.clear()
            self._dropped = 0
            self._origin = None
            self._latest = None


class JsonlSink:
    """Appends one JSON object per event to a file, flushed after each write."""

    def __init__(self, path: str) -> None:
        self.path = path
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115
        self._lock = threading.Lock()

    def write(self, events: Iterable[Event]) -> None:
        with self._lock:
            if self._file is None:
                return
            for event in events:
                self._file.write(json.dumps(event.to_dict(), allow_nan=False) + "\n")
            self._file.flush()

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_jsonl(path: str | os.PathLike[str]) -> list[Event]:
    """Read back the events a guard wrote with ``log_path=``.

    Example:
        >>> import nanguard
        >>> events = nanguard.read_events("nan_events.jsonl")  # doctest: +SKIP
        >>> print(events[0])  # doctest: +SKIP
    """
    with open(path, encoding="utf-8") as fh:
        return [Event.from_dict(json.loads(line)) for line in fh if line.strip()]
