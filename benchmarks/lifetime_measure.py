"""What bench_lifetime measures around a call: torch's and the device's memory, Reviva's pinned
and host figures, each module's __dict__ (restored after an interrupted call?), and weak
references to each call's RevivaCache and KVStore (CacheWatch)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

MiB = 1 << 20
DEVICE_TOLERANCE = MiB


def device_memory(cuda: bool) -> dict[str, int | None]:
    import torch

    if not cuda:
        return {"allocated": None, "reserved": None, "free": None, "used": None}
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return {
        "allocated": torch.cuda.memory_allocated(),
        "reserved": torch.cuda.memory_reserved(),
        "free": free,
        "used": total - free,
    }


def pinned_figures(stats: dict[str, Any]) -> dict[str, Any]:
    """Every get_memory_stats() figure of host or pinned memory held (whatever this version has;
    not the bytes_to_* traffic counters)."""
    return {
        k: v
        for k, v in stats.items()
        if ("host" in k or "pinned" in k)
        and not k.startswith("bytes_to")
        and isinstance(v, int | float)
        and not isinstance(v, bool)
    }


def pinned_in_bytes(key: str, value: float) -> float:
    """Reviva's stats give sizes in MiB where the key ends in _mb, else in bytes."""
    return value * MiB if key.endswith("_mb") else value


def module_snapshot(model: Any) -> dict[str, tuple[bool, int | None, tuple[str, ...]]]:
    """Per module: whether its __dict__ holds a 'forward', which object, and its keys."""
    out = {}
    for name, m in model.named_modules():
        fwd = m.__dict__.get("forward")
        keys = tuple(sorted(m.__dict__))
        out[name] = ("forward" in m.__dict__, id(fwd) if fwd is not None else None, keys)
    return out


def snapshot_differences(before: dict, after: dict) -> list[str]:
    diffs = []
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a == b:
            continue
        if a is None or b is None:
            diffs.append(f"{name or '<model>'}: module {'added' if a is None else 'removed'}")
            continue
        if a[0] != b[0] or a[1] != b[1]:
            diffs.append(f"{name or '<model>'}: forward in __dict__ {a[0]} -> {b[0]}")
        if a[2] != b[2]:
            diffs.append(
                f"{name or '<model>'}: __dict__ keys +{sorted(set(b[2]) - set(a[2]))} "
                f"-{sorted(set(a[2]) - set(b[2]))}"
            )
    return diffs


class CacheWatch:
    """Weak references to the RevivaCache of each call, and to its KVStore, taken by a forward
    pre-hook (with kwargs) on the first decoder layer, which is handed past_key_values."""

    def __init__(self, model: Any) -> None:
        try:
            from reviva import RevivaCache

            self.cache_type: Any = RevivaCache
        except ImportError:
            self.cache_type = None
        self.caches: list[weakref.ReferenceType] = []
        self.stores: list[weakref.ReferenceType] = []
        self.store_note: str | None = None
        layer = model.model.layers[0]
        self.handle = layer.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _is_cache(self, obj: Any) -> bool:
        # type(), not isinstance: gc.get_objects() holds objects whose __class__ property warns
        if self.cache_type is not None:
            return issubclass(type(obj), self.cache_type)
        return type(obj).__name__ == "RevivaCache"

    def _hook(self, module: Any, args: Any, kwargs: dict) -> None:
        cache = kwargs.get("past_key_values")
        if cache is None or not self._is_cache(cache):
            return None
        if any(r() is cache for r in self.caches):
            return None
        self.caches.append(weakref.ref(cache))
        store = getattr(cache, "store", None)
        if store is not None:
            try:
                self.stores.append(weakref.ref(store))
            except TypeError as e:
                self.store_note = f"KVStore takes no weak reference: {e}"
        return None

    def start_call(self) -> None:
        self.caches, self.stores = [], []

    def alive(self) -> dict[str, Any]:
        return {
            "caches_seen": len(self.caches),
            "caches_alive": sum(r() is not None for r in self.caches),
            "stores_seen": len(self.stores),
            "stores_alive": sum(r() is not None for r in self.stores),
            "store_note": self.store_note,
        }

    def live_caches_in_gc(self) -> int:
        return sum(1 for o in gc.get_objects() if self._is_cache(o))

    def remove(self) -> None:
        self.handle.remove()


def spread(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return (max(vals) - min(vals)) if vals else None
