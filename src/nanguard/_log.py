"""Where events go: a bounded, locked in-memory log and a JSON-lines file."""

from __future__ import annotations

import collections
import glob
import json
import os
import re
import threading
import warnings
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
        try:
            os.makedirs(directory, exist_ok=True)
            self._file: IO[str] | None = open(path, "a", encoding="utf-8")  # noqa: SIM115
        except OSError as error:  # (a directory where a file is, no permission...)
            raise type(error)(
                error.errno,
                f"nanguard: log_path={path!r} cannot be opened for appending "
                f"({error.strerror}: {error.filename or path})",
            ) from error
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

    A path holding ``{rank}`` (the template given to ``watch()``) reads every rank's file,
    events ordered by time. A last line cut short (the job was killed while writing it) is
    skipped with a warning; any other line that is not an event is a ``ValueError`` naming
    the file and the line.

    Example:
        >>> import nanguard
        >>> events = nanguard.read_events("nan_events.jsonl")  # doctest: +SKIP
        >>> print(events[0])  # doctest: +SKIP
    """
    text = os.fspath(path)
    if "{rank}" not in text:
        return _read_one(text)
    pattern = re.compile(re.escape(text).replace(re.escape("{rank}"), r"\d+") + r"\Z")
    found = sorted(
        f for f in glob.glob(glob.escape(text).replace("{rank}", "*")) if pattern.match(f)
    )
    if not found:
        raise FileNotFoundError(f"nanguard: no file matches {text!r} (with {{rank}} a number)")
    events = [event for file in found for event in _read_one(file)]
    events.sort(key=lambda e: (e.time, e.rank))
    return events


def _read_one(path: str) -> list[Event]:
    with open(path, encoding="utf-8") as fh:
        lines = [(n, line) for n, line in enumerate(fh, 1) if line.strip()]
    events = []
    for position, (number, line) in enumerate(lines):
        try:
            events.append(Event.from_dict(json.loads(line)))
        except (ValueError, TypeError, KeyError) as err:
            if position == len(lines) - 1 and not line.endswith("\n"):
                warnings.warn(
                    f"nanguard: {path}, line {number}: cut short (the run was stopped while "
                    f"writing it): skipped; the {len(events)} events before it are read",
                    RuntimeWarning,
                    stacklevel=3,
                )
                break
            raise ValueError(f"nanguard: {path}, line {number}: not an event: {err}") from err
    return events
