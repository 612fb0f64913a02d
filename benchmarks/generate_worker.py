"""bench_generate's card-mode worker (`--card-worker`): one contender at one context in a fresh
process, under a ballast of (device total - card) when it runs on the card; its generate calls
made as a user makes them, each reported as it completes (card.emit: ENV, WORKER, CALL, DONE)."""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

from card import (
    ALLOC_CONF_VARS,
    CallTimer,
    CardSampler,
    emit,
    error_fields,
    gb,
    prepare_device,
    rss_bytes,
    safe,
    say,
)
from common import environment
from generate_contenders import contender_spec
from generate_model import build_model


def run_call(
    spec: dict[str, Any],
    model: Any,
    manager: Any,
    ids: Any,
    new_tokens: int,
    cuda: bool,
    probe: Any,
    card_bytes: int,
    sample_s: float,
) -> dict[str, Any]:
    """One generate call of a contender, as a user makes it, and what it took."""
    import torch
    from transformers import DynamicCache

    # The compute stream alone, at the call's start and end (card.CallTimer; generate hands
    # the tokens over on the host). A device-wide synchronize would also wait for copies in
    # flight ahead of compute (Reviva's prefetches of the next step's layers).
    sync = (lambda: torch.cuda.current_stream().synchronize()) if cuda else None
    timer = CallTimer(sync)
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False, streamer=timer)
    row: dict[str, Any] = {"prompt_tokens": int(ids.shape[1]), "new_tokens_asked": new_tokens}
    stats_before = dict(manager.get_memory_stats() or {}) if manager is not None else None
    if cuda:
        safe(torch.cuda.reset_peak_memory_stats)
    before = safe(probe)
    sampler = CardSampler(probe, sample_s)
    out = cache = None
    t0 = time.perf_counter()
    try:
        with sampler:
            timer.begin()
            if spec["kind"] == "hf":
                out = model.generate(ids, **kwargs)
            elif spec["kind"] == "hf_offload":
                cache = DynamicCache(config=model.config, offloading=True)
                out = model.generate(ids, past_key_values=cache, **kwargs)
            else:
                out = manager.generate(ids, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        row.update(error=None, oom=False)
    except Exception as e:  # a failure is a result too: recorded, not hidden
        row.update(error_fields(e))
    row["wall_s"] = time.perf_counter() - t0
    del out, cache
    row["prefill_s"] = timer.prefill_s
    row["decode_tok_s"] = timer.decode_tok_s
    row["new_tokens"] = timer.new_tokens
    row["completed"] = row["error"] is None and timer.new_tokens == new_tokens
    if cuda:
        row["max_memory_allocated_gb"] = gb(safe(torch.cuda.max_memory_allocated))
        row["max_memory_reserved_gb"] = gb(safe(torch.cuda.max_memory_reserved))
        row["memory_allocated_after_gb"] = gb(safe(torch.cuda.memory_allocated))
        row["memory_reserved_after_gb"] = gb(safe(torch.cuda.memory_reserved))
    after = safe(probe)
    row["device_free_before_gb"] = gb(before[0]) if before else None
    row["device_free_after_gb"] = gb(after[0]) if after else None
    row["card_min_free_gb"] = gb(sampler.min_free)
    low = sampler.min_free
    row["card_peak_used_gb"] = None if low is None else gb(card_bytes - low)
    row["sampler"] = sampler.summary()
    if manager is not None:
        st = safe(lambda: dict(manager.get_memory_stats() or {})) or {}
        fresh = st != stats_before
        row["reviva_stats_fresh"] = fresh
        row["reviva"] = st if (fresh or row["completed"]) else None
    return row


def card_worker(args: argparse.Namespace) -> int:
    import torch

    from reviva import parse_bytes

    card = None if args.card == "none" else args.card
    spec = contender_spec(args.contender, card)
    ctx = args.context
    cuda = not args.dry_run and torch.cuda.is_available()
    info: dict[str, Any] = {
        "contender": args.contender,
        "spec": spec,
        "mode": "card" if card else "no_card",
        "card": card,
        "context": ctx,
        "pid": os.getpid(),
        "allocator_env": {k: os.environ.get(k) for k in ALLOC_CONF_VARS},
        "device": "cuda" if cuda else "cpu (dry run)",
    }
    say(f"# worker pid {os.getpid()}: {args.contender}, {info['mode']}, {ctx} tokens")
    if not cuda and not args.dry_run:
        info["error"] = {"error": "no CUDA device (use --dry-run on a machine without one)"}
        emit("WORKER", info)
        return 2
    prepared, ballast, probe, card_bytes = prepare_device(parse_bytes(card) if card else None, cuda)
    info.update(prepared)
    if "error" in info:
        emit("WORKER", info)
        return 3
    info["card_bytes"] = card_bytes
    emit("ENV", environment())

    manager = model = ids = None
    try:
        say("# building the model")
        t = time.perf_counter()
        model = build_model(args.layers, args.dry_run)
        info["build_s"] = time.perf_counter() - t
        info["weights_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        if cuda:
            info["allocated_after_build_bytes"] = torch.cuda.memory_allocated()
            info["free_after_build_bytes"] = torch.cuda.mem_get_info()[0]
        say(f"# model built in {info['build_s']:.1f} s, {info['weights_bytes'] / 1e9:.2f} GB")
        if spec["kind"] == "reviva":
            import reviva

            knobs = {
                "kv_dtype": spec.get("kv_dtype", "auto"),
                "kv_page_tokens": spec.get("kv_page_tokens", 0),
                "attention_kernel": spec.get("attention_kernel", "auto"),
            }
            if spec["vram_budget"]:
                knobs["vram_budget"] = spec["vram_budget"]
            cfg = reviva.RevivaConfig(**knobs)
            info["reviva_config"] = repr(cfg)
            t = time.perf_counter()
            manager = reviva.RevivaManager(model, cfg)
            info["manager_init_s"] = time.perf_counter() - t
        device = "cuda" if cuda else "cpu"
        vocab = model.config.vocab_size
        gen = torch.Generator(device=device).manual_seed(ctx)
        ids = torch.randint(1, vocab, (1, ctx), device=device, generator=gen)
        if args.warmup_tokens:
            say(f"# warm-up: {args.warmup_tokens} tokens, 4 new (recorded, not a measured call)")
            wgen = torch.Generator(device=device).manual_seed(1)
            wids = torch.randint(1, vocab, (1, args.warmup_tokens), device=device, generator=wgen)
            info["warmup"] = run_call(
                spec, model, manager, wids, 4, cuda, probe, card_bytes, args.sample_ms / 1e3
            )
            del wids
        else:
            info["warmup"] = None
    except Exception as e:  # the worker's calls are then recorded as not run
        info["error"] = error_fields(e)
        say(f"# setup failed: {info['error']['error']}")
    emit("WORKER", info)
    if "error" in info:
        manager = model = ids = None
        gc.collect()
        if ballast is not None:
            ballast.free()
        emit("DONE", {"rss_bytes": rss_bytes(), "setup_failed": True})
        return 0

    n = args.new_tokens
    for call in range(1, args.calls + 1):
        say(f"# call {call} of {args.calls}: generate {ctx} tokens + {n} new")
        row = run_call(spec, model, manager, ids, n, cuda, probe, card_bytes, args.sample_ms / 1e3)
        row.update(
            call=call,
            warm=call > 1,
            contender=args.contender,
            mode=info["mode"],
            card=card,
            context=ctx,
            rss_after_bytes=rss_bytes(),
        )
        emit("CALL", row)

    del manager, model, ids
    gc.collect()
    if cuda:
        safe(torch.cuda.synchronize)
        safe(torch.cuda.empty_cache)
    if ballast is not None:
        ballast.free()
    emit("DONE", {"rss_bytes": rss_bytes()})
    return 0
