"""bench_lifetime's repeat_100 check: many generate calls on one manager leave nothing behind
(device, pinned and RSS figures flat from call 5; no RevivaCache alive after a call with gc
disabled)."""

from __future__ import annotations

import gc
import time
from typing import Any

from card import error_fields, rss_bytes, say
from lifetime_measure import (
    DEVICE_TOLERANCE,
    CacheWatch,
    device_memory,
    pinned_figures,
    pinned_in_bytes,
    spread,
)

FLAT_FROM_CALL = 5  # 1-based: figures after calls 5..N must be flat
RSS_TOLERANCE = 0.01


def repeat(
    manager: Any,
    model: Any,
    ids: Any,
    new_tokens: int,
    calls: int,
    gc_calls: int,
    cuda: bool,
    hf_tokens: list[int],
) -> dict[str, Any]:
    watch = CacheWatch(model)
    prompt = ids.shape[1]
    records: list[dict[str, Any]] = []
    first_tokens = None
    try:
        for k in range(1, calls + 1):
            watch.start_call()
            t0 = time.perf_counter()
            rec: dict[str, Any] = {"call": k, "gc": "enabled"}
            try:
                out = manager.generate(ids, max_new_tokens=new_tokens, do_sample=False)
                tokens = out[0, prompt:].tolist()
                del out
                rec["completed"] = len(tokens) == new_tokens
                if first_tokens is None:
                    first_tokens = tokens
                rec["same_tokens_as_call_1"] = tokens == first_tokens
            except Exception as e:
                rec.update(error_fields(e), completed=False)
            rec["wall_s"] = time.perf_counter() - t0
            st = manager.get_memory_stats()
            rec.update(
                streamed_layers=st.get("streamed_layers"),
                resident_layers_in_prefill=st.get("resident_layers_in_prefill"),
                prefill_residual=st.get("prefill_residual"),
                device=device_memory(cuda),
                pinned=pinned_figures(st),
                rss=rss_bytes(),
                **watch.alive(),
            )
            records.append(rec)
            if k in (1, 2, 5) or k % 25 == 0:
                d = rec["device"]
                say(
                    f"  call {k}: {'ok' if rec['completed'] else rec.get('error')}, "
                    f"{rec['wall_s']:.2f} s, allocated {d['allocated']}, used {d['used']}, "
                    f"rss {rec['rss']}, pinned {rec['pinned']}, caches alive {rec['caches_alive']}"
                )
        gc.collect()
        gc.disable()
        try:
            for k in range(calls + 1, calls + gc_calls + 1):
                watch.start_call()
                rec = {"call": k, "gc": "disabled"}
                try:
                    out = manager.generate(ids, max_new_tokens=new_tokens, do_sample=False)
                    rec["completed"] = out.shape[1] == prompt + new_tokens
                    del out
                except Exception as e:
                    rec.update(error_fields(e), completed=False)
                rec.update(
                    device=device_memory(cuda),
                    rss=rss_bytes(),
                    revivacaches_in_gc=watch.live_caches_in_gc(),
                    **watch.alive(),
                )
                records.append(rec)
        finally:
            gc.enable()
    finally:
        watch.remove()

    main = [r for r in records if r["gc"] == "enabled"]
    window = main[FLAT_FROM_CALL - 1 :]
    flat: dict[str, Any] = {}
    for key in ("allocated", "reserved", "used"):
        s = spread([r["device"][key] for r in window])
        flat[f"device_{key}_spread_bytes"] = s
        flat[f"device_{key}_ok"] = s is None or s <= DEVICE_TOLERANCE
    rss_vals = [r["rss"] for r in window]
    flat["rss_spread_bytes"] = spread(rss_vals)
    flat["rss_ok"] = bool(rss_vals) and spread(rss_vals) <= RSS_TOLERANCE * min(rss_vals)
    pinned_keys = sorted({k for r in window for k in r["pinned"]})
    flat["pinned_keys_found"] = pinned_keys
    for key in pinned_keys:
        vals = [pinned_in_bytes(key, r["pinned"][key]) for r in window if key in r["pinned"]]
        flat[f"pinned_{key}_spread_bytes"] = spread(vals)
        flat[f"pinned_{key}_ok"] = spread(vals) <= DEVICE_TOLERANCE
    gc_rows = [r for r in records if r["gc"] == "disabled"]
    survivors = {
        "calls": len(gc_rows),
        "revivacaches_in_gc_after_calls": [r["revivacaches_in_gc"] for r in gc_rows],
        "caches_alive_after_calls": [r["caches_alive"] for r in gc_rows],
        "stores_alive_after_calls": [r["stores_alive"] for r in gc_rows],
        "caches_seen": [r["caches_seen"] for r in gc_rows],
        "stores_seen": [r["stores_seen"] for r in gc_rows],
        "store_note": gc_rows[-1]["store_note"] if gc_rows else None,
    }
    survivors["ok"] = bool(gc_rows) and all(
        r.get("completed")
        and r["revivacaches_in_gc"] == 0
        and r["caches_alive"] == 0
        and r["stores_alive"] == 0
        and r["caches_seen"] == 1
        for r in gc_rows
    )
    all_ok = all(r.get("completed") for r in main) and len(main) == calls
    streamed = all((r.get("streamed_layers") or 0) > 0 for r in main)
    ok_flags = [v for k, v in flat.items() if k.endswith("_ok")]
    return {
        "calls": calls,
        "all_completed": all_ok,
        "streamed_in_every_call": streamed,
        "same_tokens_every_call": all(r.get("same_tokens_as_call_1") for r in main),
        "tokens_equal_plain_hf": first_tokens == hf_tokens,
        "flat_from_call": FLAT_FROM_CALL,
        "flat": flat,
        "gc_disabled": survivors,
        "caches_alive_after_calls_gc_enabled": [r["caches_alive"] for r in main],
        "device_checked": cuda,
        "pass": bool(all_ok and streamed and all(ok_flags) and survivors["ok"]),
        "records": records,
    }
