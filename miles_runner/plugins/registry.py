"""A name -> plug-in registry. Config selects plug-ins by registered name only, never by import path."""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class PluginError(ValueError):
    """An unknown or duplicate plug-in name."""


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind  # e.g. "task", "reward": used in messages
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise PluginError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = entry
            return entry

        return add

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise PluginError(
                f"unknown {self.kind} {name!r}; registered {self.kind}s: {', '.join(self.names())}"
            ) from None

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
