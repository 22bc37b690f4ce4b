"""A small thread-safe least-recently-used map, for the bounded caches keyed by content or by a
conversation id (projected image tokens, the transformers engine's prefix caches)."""

from __future__ import annotations

import threading
from collections import OrderedDict


class LRU:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            if key not in self._items:
                return None
            self._items.move_to_end(key)
            return self._items[key]

    def put(self, key, value) -> None:
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def pop(self, key):
        with self._lock:
            return self._items.pop(key, None)

    def __len__(self) -> int:
        return len(self._items)

    def keys(self) -> list:
        with self._lock:
            return list(self._items)
