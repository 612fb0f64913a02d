"""Long-context generation on a card of N GB, as a user runs it: plain HF (DynamicCache), HF's
offloaded cache (DynamicCache(offloading=True)) and Reviva, on a Llama-3-8B-shaped model (hidden
4096, 32 layers, 32 heads, 8 K/V heads, MLP 14336, vocab 128256, bf16, random weights, SDPA).

Card mode (the default; DESIGN.md, "Measuring as a user runs it")
    python benchmarks/bench_generate.py [--card 24GB] [--contexts 64k]
        [--contenders reviva,hf,hf_offload,reviva_default] [--no-card-contenders hf,reviva_default]
        [--calls 3] [--new-tokens 32] [--warmup-tokens 0] [--max-wall-s 540] [--out DIR]

Every run is one fresh worker process per (contender, context, card or not), context by context:
the first card contender, then the no-card ones, then the other card ones (the checks' data
first, so that a run killed at the device's time limit keeps it). A card worker, before
the model is built, takes (device total - N) with cudaMalloc outside torch's allocator (a ballast),
so that the CUDA context and everything else must fit in N; its environment has no
PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF and nothing sets a per-process memory fraction. The
worker then runs the same generate `--calls` times in a row (call 1 cold, the others warm), with
nothing in between (no prepare(), no empty_cache, no gc.collect); an optional warm-up generate of
`--warmup-tokens` tokens (a different shape) runs before call 1 and is recorded. Contenders:
    hf              model.generate
    hf_offload      model.generate(past_key_values=DynamicCache(offloading=True)), a new cache a
                    call (--slow-new-tokens new tokens: it decodes at ~1 token/s)
    reviva          RevivaManager(model, RevivaConfig(vram_budget=<card>)), one manager, then calls
    reviva_default  RevivaManager(model, RevivaConfig())
    reviva=23GB     RevivaManager(model, RevivaConfig(vram_budget="23GB"))
No-card runs (`--no-card-contenders`) are the same workers without a ballast: plain HF for the
prefill reference, and Reviva with all K/V resident for the compute term of the roofline. Under a
ballast the device still reports its full total, so RevivaConfig() (a fraction of the total) plans
for the whole device, unlike on a real card of N GB; its row says what that gives.

Per call: prefill s (time to the first new token, through a streamer), decode tok/s (tokens after
the first over the time after it), new tokens, OOM/error with its message, torch's
max_memory_allocated and max_memory_reserved, the card-level peak (a thread polls
torch.cuda.mem_get_info every ~2 ms during the call: card_peak_used_gb = N - least free seen,
which counts memory allocated outside torch's allocator and the CUDA context), and Reviva's
get_memory_stats(). A worker's calls are written to the JSON as they arrive (the file is rewritten
after each), so a killed run still leaves its data; `--max-wall-s` skips a run whose estimate does
not fit in what is left and kills a worker at the limit (its finished calls are kept).

Checks (the JSON's `checks`; <N> from --card):
    card<N>_64k   the 24 GB card, 64k prompt, 32 new tokens, three calls: all complete; decode
                  >= 20 tok/s and <= 1.1x the roofline in each call; prefill <= 1.15x plain HF's
                  (no card, the same call number) in call 1 and <= 1.05x in calls 2 and 3.
    card<N>_128k, card<N>_256k   all calls complete, decode <= 1.1x the roofline in each call.
Roofline of a decode token: max(compute, streamed K/V bytes per token / 55 GB/s), compute being
the fastest no-card Reviva call at that context (all K/V resident), streamed layers from Reviva's
stats. Reproduce, one 10-minute device call each (H200 estimates are printed first;
--estimate-only prints them alone; --max-wall-s below the call's limit keeps the JSON whole):
    card<N>_64k   python benchmarks/bench_generate.py --out $OUT --max-wall-s 540
                  (6 workers at 64k: reviva on the card; hf and reviva_default without; hf,
                  hf_offload and reviva_default on the card: ~4.7 min)
    card<N>_128k  python benchmarks/bench_generate.py --contexts 128k \\
                      --no-card-contenders reviva_default --out $OUT --max-wall-s 540  (~6.2 min)
    card<N>_256k  python benchmarks/bench_generate.py --contexts 256k --contenders reviva \\
                      --no-card-contenders reviva_default --no-card-calls 2 --out $OUT \\
                      --max-wall-s 560  (~7.6 min; or two calls, one with --no-card-contenders ""
                      and one with --contenders "", merged)
    one JSON:     python benchmarks/bench_generate.py --analyse A.json B.json C.json --out DIR
CPU dry run of every path (tiny model, fake probe, no ballast): --dry-run.

Fraction mode (the earlier measurement, kept for comparison; not how a user runs it)
    python benchmarks/bench_generate.py --mode fraction [--contexts 16k,64k,128k,256k]
        [--budgets none,24GB] [--contenders hf,hf_offload,reviva] [--none-contenders reviva]
One process per budget, every contender in it, the budget enforced with
torch.cuda.set_per_process_memory_fraction, PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, a
warm-up of every contender and Reviva's prepare() before its timed run; its checks are 64k_24GB,
128k_24GB, 256k_24GB, 16k_none.

Writes benchmarks/results/generate-...json (or into --out) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from card import (  # noqa: E402
    ALLOC_CONF_VARS,
    CallTimer,
    CardSampler,
    WorkerRun,
    child_environment,
    emit,
    error_fields,
    gb,
    prepare_device,
    rss_bytes,
    safe,
    say,
)
from common import (  # noqa: E402
    environment,
    print_table,
    result_path,
    write_json,
    write_result,
)
from plots import plot_beside  # noqa: E402

PCIE_GBPS = 55.0  # pinned H2D, DESIGN.md's performance model (and bench_transfer's measurement)
ANCHORS = {  # DESIGN.md, measured on the same H200 kind
    "hf_64k_decode_tok_s": 8.99,
    "hf_64k_peak_gb": 32.5,
    "hf_64k_prefill_s": 3.73,
    "hf_offload_64k_decode_tok_s": 1.31,
    "hf_offload_64k_peak_gb": 24.2,
    # card mode, N = 24 (DESIGN.md): the longest prompts that ran
    "card24_hf_max_tokens": 20 * 1024,
    "card24_hf_offload_max_tokens": 40 * 1024,
}
SHAPE = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    rope_theta=500000.0,
    max_position_embeddings=1_100_000,  # (rope computed per position: no table of this size)
)
# --dry-run: a tiny model of the same layout on the CPU (fp32, host backend), to run every path.
DRY_SHAPE = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    rope_theta=10000.0,
    max_position_embeddings=4096,
)
# 16MB: the tiny model's weights and working set, and K/V streamed through one slot at 256
# tokens; at 512 tokens Reviva refuses the budget (RevivaOutOfMemoryError): both paths run.
DRY_DEFAULTS = {"contexts": "256,512", "card": "16MB"}

# The checks: context -> kind. "full": completion, decode rate, roofline and prefill against plain
# HF; "roofline": completion and roofline; "long" (issue 13's card24_512k_bf16): completion,
# roofline, and prefill against the same run's 256k prefill (attention is quadratic: up to
# LONG_PREFILL_LIMIT times, no offload penalty on top).
CHECK_CONTEXTS = {65536: "full", 131072: "roofline", 262144: "roofline", 524288: "long"}
LONG_PREFILL_LIMIT = 4.4
# Issue 13's card24_256k: prefill no slower than this (seconds, every call) and the card's peak
# within the card.
MAX_PREFILL_S = {262144: 60.0}
FP8_DECODE_GAIN = 1.8
# Issue 38 (Note [fp8 decode attention]): on the card at the other contexts, fp8 K/V decodes at
# >= FP8_CARD_MIN_TOK_S in calls 2.. with a prefill <= FP8_PREFILL_LIMIT x bf16's (same run,
# same call); on the whole card (no-card reviva_default_fp8 against reviva_default) >=
# FP8_WHOLE_RATIO x bf16's decode in calls 2..; at 512k (kind "long") >= FP8_LONG_MIN_TOK_S,
# 1.2x the 1.72 tok/s measured before the fused kernel (generate-512k-fp8-card24-...-c29e16d).
FP8_CARD_MIN_TOK_S = 100.0
FP8_PREFILL_LIMIT = 1.1
FP8_WHOLE_RATIO = 0.95
FP8_LONG_MIN_TOK_S = 1.2 * 1.72
LONG_PREFILL_REFERENCE = 262144
DRY_CHECK_CONTEXTS = {256: "full", 512: "roofline"}
MIN_DECODE_TOK_S = 20.0
MAX_ROOFLINE_RATIO = 1.1
PREFILL_LIMIT_FIRST = 1.15  # call 1 (cold) against plain HF's call 1, no card
PREFILL_LIMIT_WARM = 1.05  # calls 2.. against plain HF's call of the same number

# Rough H200 figures for the printed wall-time estimates (README/DESIGN anchors).
EST_PREFILL_S = {
    16384: 0.63,
    65536: 3.73,
    131072: 12.0,
    262144: 40.0,
    524288: 145.0,
}  # cuDNN prefill
EST_REVIVA_CARD_TOK_S = {65536: 22.4, 131072: 4.57, 262144: 1.77, 524288: 0.8}
EST_START_S = 12.0  # interpreter, torch, CUDA context, ballast
EST_BUILD_S = 20.0  # the 8B-shaped model, random init on the device
EST_PIN_S_PER_GB = 0.35  # pinning host memory on the H200 host (~0.35 ms per MB)
DONE_GRACE_S = 60.0  # a worker that said DONE and has not exited by then is killed


def parse_tokens(s: str) -> int:
    s = s.strip().lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


def ctx_label(ctx: int) -> str:
    return f"{ctx // 1024}k" if ctx % 1024 == 0 else str(ctx)


def card_label(card: str) -> str:
    from reviva import parse_bytes

    n = parse_bytes(card)
    if n % 10**9 == 0:
        return f"card{n // 10**9}"
    return "card" + "".join(ch for ch in card if ch.isalnum())


def split_list(s: str | None) -> list[str]:
    return [x.strip() for x in (s or "").split(",") if x.strip()]


# reviva_paged's page: 8192 tokens (32 MiB of the 8B shape's K/V per layer, an eighth of a 64k
# layer): large enough that a step's page acquires and merges cost the host little.
PAGE_TOKENS = 8192


def contender_spec(name: str, card: str | None) -> dict[str, Any]:
    """What a contender name runs; ValueError naming it when unknown or meaningless here."""
    if name in ("hf", "hf_offload"):
        return {"kind": name}
    if name == "reviva_default":
        return {"kind": "reviva", "vram_budget": None}
    if name == "reviva":
        if card is None:
            raise ValueError(
                "contender 'reviva' means RevivaConfig(vram_budget=<card>): it has no meaning "
                "without a card; use reviva_default or reviva=<bytes> among --no-card-contenders"
            )
        return {"kind": "reviva", "vram_budget": card}
    if name == "reviva_default_fp8":  # issue 38: fp8 K/V on the whole card
        return {"kind": "reviva", "vram_budget": None, "kv_dtype": "fp8"}
    if name == "reviva_fp8":  # issue 13: fp8 K/V (Note [fp8 K/V rows]) on the card
        if card is None:
            raise ValueError("contender 'reviva_fp8' runs on the card: use it in --contenders")
        return {"kind": "reviva", "vram_budget": card, "kv_dtype": "fp8"}
    if name == "reviva_paged" or name.startswith("reviva_paged="):  # Note [Paged layers]
        if card is None:
            raise ValueError(f"contender {name!r} runs on the card: use it in --contenders")
        page = name.split("=", 1)[1] if "=" in name else str(PAGE_TOKENS)
        if not page.isdigit() or int(page) <= 0:
            raise ValueError(f"contender {name!r}: the page must be a number of tokens > 0")
        return {"kind": "reviva", "vram_budget": card, "kv_page_tokens": int(page)}
    if name in ("reviva_flash", "reviva_cudnn"):  # Note [Prefill attention kernel], forced
        if card is None:
            raise ValueError(f"contender {name!r} runs on the card: use it in --contenders")
        return {"kind": "reviva", "vram_budget": card, "attention_kernel": name[len("reviva_") :]}
    if name.startswith("reviva="):
        from reviva import parse_bytes

        budget = name.split("=", 1)[1]
        parse_bytes(budget)  # ValueError naming it
        return {"kind": "reviva", "vram_budget": budget}
    raise ValueError(
        f"unknown contender {name!r}: use hf, hf_offload, reviva, reviva_fp8, reviva_flash, "
        "reviva_cudnn, reviva_paged, reviva_paged=<tokens>, reviva_default, reviva_default_fp8 "
        "or reviva=<bytes>"
    )


# --- the model ------------------------------------------------------------------------------------


def build_model(layers: int, dry_run: bool = False, dtype: Any = None) -> Any:
    """The benchmark's Llama-shaped model with random weights: bf16 on the GPU (or `dtype`), or a
    tiny fp32 one on the CPU (dry_run)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = DRY_SHAPE if dry_run else SHAPE
    cfg = LlamaConfig(**{**shape, "num_hidden_layers": layers}, attn_implementation="sdpa")
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    torch.manual_seed(0)
    if dry_run:
        return AutoModelForCausalLM.from_config(cfg).eval()
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype or torch.bfloat16)
    return model.eval()


def kv_bytes_per_token_per_layer(shape: dict, itemsize: int) -> int:
    """K and V of one token in one layer."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    return 2 * shape["num_key_value_heads"] * head_dim * itemsize


# --- card mode: the worker ------------------------------------------------------------------------


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


# --- card mode: the driver ------------------------------------------------------------------------


def _interp_loglog(table: dict[int, float], x: int, below: str = "linear") -> float:
    """Log-log interpolation of a table, extrapolated with its end slopes; below the first
    point linear in x (times), or held (rates: "hold")."""
    pts = sorted(table.items())
    if x <= pts[0][0]:
        return pts[0][1] * (x / pts[0][0] if below == "linear" else 1.0)
    for (x0, y0), (x1, y1) in zip(pts, pts[1:], strict=False):
        if x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0)
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    (x0, y0), (x1, y1) = pts[-2], pts[-1]
    slope = math.log(y1 / y0) / math.log(x1 / x0)
    return y1 * (x / x1) ** slope


def estimate_s(run: dict[str, Any], args: argparse.Namespace) -> float:
    """Rough H200 wall time of one worker (from the anchors; the dry run is faster)."""
    ctx, spec = run["context"], run["spec"]
    card_gb = run["card_bytes"] / 1e9 if run["card_bytes"] else None
    prefill = _interp_loglog(EST_PREFILL_S, ctx)
    n = args.slow_new_tokens if spec["kind"] == "hf_offload" else args.new_tokens
    oom = card_gb is not None and (
        (spec["kind"] == "hf" and ctx > ANCHORS["card24_hf_max_tokens"] * card_gb / 24)
        or (
            spec["kind"] == "hf_offload"
            and ctx > ANCHORS["card24_hf_offload_max_tokens"] * card_gb / 24
        )
    )
    if oom:
        per_call = 0.5 * prefill
    elif spec["kind"] == "hf":
        per_call = prefill + n / (9.0 * 65536 / max(ctx, 16384))
    elif spec["kind"] == "hf_offload":
        per_call = 1.2 * prefill + n / (0.4 * 65536 / max(ctx, 16384))
    elif card_gb is not None:
        per_call = 1.05 * prefill + n / _interp_loglog(EST_REVIVA_CARD_TOK_S, ctx, "hold")
    else:
        per_call = prefill + n / (26.0 * min(1.0, (65536 / ctx) ** 0.3))
    first_extra = 0.0
    if spec["kind"] == "reviva":  # pinning the host copies inside call 1
        kv_gb = ctx * 128 * 1024 / 1e9
        first_extra = EST_PIN_S_PER_GB * kv_gb
    build = EST_BUILD_S * args.layers / 32
    warm = 5.0 if args.warmup_tokens else 0.0
    return EST_START_S + build + warm + first_extra + run["calls"] * per_call


def _fmt(x: Any, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def call_summary(row: dict[str, Any]) -> str:
    result = (
        "ok"
        if row.get("completed")
        else ("OOM" if row.get("oom") else ("not run" if row.get("not_run") else "ERROR"))
    )
    return (
        f"{row['mode']:>7} {row['contender']:>14} {ctx_label(row['context']):>5} call "
        f"{row['call']}: {result:>7} prefill {_fmt(row.get('prefill_s'), '.2f')} s, decode "
        f"{_fmt(row.get('decode_tok_s'), '.2f')} tok/s, {row.get('new_tokens')} new, card peak "
        f"{_fmt(row.get('card_peak_used_gb'), '.2f')} GB, torch "
        f"{_fmt(row.get('max_memory_allocated_gb'), '.2f')}/"
        f"{_fmt(row.get('max_memory_reserved_gb'), '.2f')} GB "
        f"{(row.get('error') or '')[:160]}"
    )


def card_driver(args: argparse.Namespace) -> int:
    from reviva import parse_bytes

    card = args.card
    card_bytes = parse_bytes(card)
    contexts = [parse_tokens(c) for c in split_list(args.contexts)]
    no_card_contexts = (
        [parse_tokens(c) for c in split_list(args.no_card_contexts)]
        if args.no_card_contexts is not None
        else contexts
    )
    on_card = split_list(args.contenders)
    no_card = split_list(args.no_card_contenders)
    runs: list[dict[str, Any]] = []
    for ctx in sorted(set(contexts) | set(no_card_contexts)):
        if args.warmup_tokens and args.warmup_tokens == ctx:
            raise ValueError(
                f"--warmup-tokens {args.warmup_tokens} is the measured shape: a warm-up must "
                "have another"
            )
        card_runs = [
            {
                "mode": "card",
                "card": card,
                "card_bytes": card_bytes,
                "contender": name,
                "spec": contender_spec(name, card),
                "context": ctx,
                "calls": args.calls,
            }
            for name in on_card
            if ctx in contexts
        ]
        no_card_runs = [
            {
                "mode": "no_card",
                "card": None,
                "card_bytes": None,
                "contender": name,
                "spec": contender_spec(name, None),
                "context": ctx,
                "calls": args.no_card_calls or args.calls,
            }
            for name in no_card
            if ctx in no_card_contexts
        ]
        # The checks' data first (a run killed at the device's time limit keeps it): the first
        # card contender, the no-card references, then the other card contenders.
        runs += card_runs[:1] + no_card_runs + card_runs[1:]
    shape = DRY_SHAPE if args.dry_run else SHAPE
    env = environment(cuda=False)
    child_env, removed = child_environment()
    settings = {
        "mode": "card",
        "card": card,
        "card_bytes": card_bytes,
        "card_label": card_label(card),
        "contexts": contexts,
        "contenders": on_card,
        "no_card_contenders": no_card,
        "no_card_contexts": no_card_contexts,
        "calls_per_worker": args.calls,
        "calls_per_no_card_worker": args.no_card_calls or args.calls,
        "new_tokens": args.new_tokens,
        "slow_new_tokens_hf_offload": args.slow_new_tokens,
        "warmup": (
            {"tokens": args.warmup_tokens, "new_tokens": 4} if args.warmup_tokens else "none"
        ),
        "sample_ms": args.sample_ms,
        "allocator": "torch defaults: " + ", ".join(ALLOC_CONF_VARS) + " removed from every "
        "worker's environment; no set_per_process_memory_fraction",
        "removed_from_worker_env": removed,
        "ballast": "cudaMalloc of (device total - card) outside torch's allocator, after "
        "torch.cuda.init() and before the model, in every card worker",
        "between_calls": "nothing: no prepare(), no empty_cache, no gc.collect",
        "token_clock": (
            "a streamer timing each token as generate hands it over (on the host); "
            "the compute stream synchronized at the call's start and end"
        ),
        # Reviva's environment switches the workers inherit (e.g. REVIVA_PIN_HOST_COPIES).
        "reviva_env": {k: v for k, v in os.environ.items() if k.startswith("REVIVA_")},
        "pcie_gbps_for_roofline": PCIE_GBPS,
        "kv_bytes_per_token_per_layer": kv_bytes_per_token_per_layer(
            shape, 4 if args.dry_run else 2
        ),
        "num_layers": args.layers,
        "check_contexts": DRY_CHECK_CONTEXTS if args.dry_run else CHECK_CONTEXTS,
        "thresholds": {
            "min_decode_tok_s": MIN_DECODE_TOK_S,
            "max_roofline_ratio": MAX_ROOFLINE_RATIO,
            "prefill_limit_first_call": PREFILL_LIMIT_FIRST,
            "prefill_limit_later_calls": PREFILL_LIMIT_WARM,
        },
        "max_wall_s": args.max_wall_s,
        "dry_run": args.dry_run,
    }
    model = {
        **shape,
        "num_hidden_layers": args.layers,
        "dtype": "float32 (dry run, CPU)" if args.dry_run else "bfloat16",
        "attn_implementation": "sdpa",
        "weights": "random init",
    }
    if args.dry_run or args.estimate_only or args.cold_page_cache:
        settings["page_cache"] = "not warmed (" + (
            "dry run)"
            if args.dry_run
            else "estimate only)"
            if args.estimate_only
            else "--cold-page-cache)"
        )
    else:
        settings["page_cache"] = warm_page_cache()
        say(f"# page cache: {settings['page_cache']}")
    if args.dry_run or args.estimate_only or args.cold_jit_cache:
        settings["jit_cache"] = "not warmed"
    else:
        settings["jit_cache"] = warm_jit_cache(sorted({run["context"] for run in runs}))
        say(f"# CUDA JIT cache: {settings['jit_cache']}")
    estimates = []
    say(f"# card mode, card {card}: {len(runs)} workers")
    for i, run in enumerate(runs):
        run["estimate_s"] = estimate_s(run, args)
        estimates.append({k: run[k] for k in ("mode", "contender", "context", "estimate_s")})
        say(
            f"#   [{i + 1}] {run['mode']:>7} {run['contender']:>14} "
            f"{ctx_label(run['context']):>5}, {run['calls']} calls: ~{run['estimate_s']:.0f} s "
            "(H200 estimate)"
        )
    say(f"# estimated total ~{sum(r['estimate_s'] for r in runs):.0f} s")
    if args.estimate_only:
        return 0

    rows: list[dict[str, Any]] = []
    workers: list[dict[str, Any]] = []
    path = result_path(args.name or f"generate-{card_label(card)}", env, args.out_dir)

    def save(final: bool = False) -> None:
        analysis = analyse_card(rows, settings)
        payload = {
            "environment": env,
            "complete": final,
            "model": model,
            "settings": settings,
            "anchors": ANCHORS,
            "estimates": estimates,
            "workers": workers,
            "runs": rows,
            **analysis,
        }
        write_json(path, payload)

    save()
    say(f"# writing {path} as results arrive")
    t_start = time.perf_counter()
    for i, run in enumerate(runs):
        elapsed = time.perf_counter() - t_start
        record: dict[str, Any] = {
            k: run[k]
            for k in ("mode", "card", "contender", "spec", "context", "calls", "estimate_s")
        }
        workers.append(record)
        if args.max_wall_s and elapsed + run["estimate_s"] > args.max_wall_s:
            record["status"] = (
                f"skipped: estimated {run['estimate_s']:.0f} s, {args.max_wall_s - elapsed:.0f} s "
                f"left of --max-wall-s {args.max_wall_s:.0f}"
            )
            say(f"# [{i + 1}] {record['status']}")
            add_missing_calls(rows, run, args, record["status"])
            save()
            continue
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--card-worker",
            "--contender",
            run["contender"],
            "--context",
            str(run["context"]),
            "--card",
            run["card"] or "none",
            "--calls",
            str(run["calls"]),
            "--new-tokens",
            str(args.slow_new_tokens if run["spec"]["kind"] == "hf_offload" else args.new_tokens),
            "--warmup-tokens",
            str(args.warmup_tokens),
            "--sample-ms",
            str(args.sample_ms),
            "--layers",
            str(args.layers),
        ] + (["--dry-run"] if args.dry_run else [])
        say(f"# [{i + 1}/{len(runs)}] {' '.join(cmd[1:])}")
        record["command"] = " ".join(cmd[1:])
        t0 = time.perf_counter()
        worker = WorkerRun(cmd, child_env, ("ENV", "WORKER", "CALL", "DONE"), DONE_GRACE_S)

        def on_line(tag: str, obj: Any, record: dict[str, Any] = record) -> None:
            if tag == "TEXT":
                say("  | " + obj)
            elif tag == "ENV":
                for k in ("gpu", "gpu_memory_bytes", "gpu_count", "torch_cuda", "reviva_core"):
                    if k in obj and env.get(k) is None:
                        env[k] = obj[k]
            elif tag == "WORKER":
                record["info"] = obj
                if obj.get("error"):
                    say(f"  ! worker setup: {obj['error'].get('error')}")
                save()
            elif tag == "CALL":
                rows.append(obj)
                say("  = " + call_summary(obj))
                save()
            elif tag == "DONE":
                record["done"] = obj

        deadline = t_start + args.max_wall_s if args.max_wall_s else None
        record["status"] = worker.follow(deadline, on_line)
        record["returncode"] = worker.returncode
        record["wall_s"] = time.perf_counter() - t0
        record["log_tail"] = worker.tail[-60:]
        say(f"# [{i + 1}] {record['status']} after {record['wall_s']:.0f} s")
        setup_error = (record.get("info") or {}).get("error")
        why = f"setup failed: {setup_error['error']}" if setup_error else record["status"]
        add_missing_calls(rows, run, args, why)
        save()

    analysis = analyse_card(rows, settings)
    print_card_table(rows)
    for x in analysis["rooflines"]:
        print(
            f"roofline {x['mode']} {x['contender']} {ctx_label(x['context'])} call {x['call']}: "
            f"measured {x['measured_s'] * 1e3:.1f} ms/token, roofline "
            f"{_fmt(x['roofline_s'] and x['roofline_s'] * 1e3, '.1f')} ms (compute "
            f"{_fmt(x['compute_s'] and x['compute_s'] * 1e3, '.1f')}, transfer "
            f"{x['transfer_s'] * 1e3:.1f}) -> {_fmt(x['ratio_to_roofline'], '.3f')}x"
        )
    print(json.dumps(analysis["checks"], indent=1))
    save(final=True)
    say(f"wrote {path}")
    plot_beside(path)
    return 0


def add_missing_calls(
    rows: list[dict[str, Any]], run: dict[str, Any], args: argparse.Namespace, why: str
) -> None:
    """The calls a worker did not report, as failed rows: a check then sees them as failures."""
    have = {
        r["call"]
        for r in rows
        if (r["mode"], r["contender"], r["context"])
        == (run["mode"], run["contender"], run["context"])
    }
    for call in range(1, run["calls"] + 1):
        if call not in have:
            rows.append(
                {
                    "mode": run["mode"],
                    "card": run["card"],
                    "contender": run["contender"],
                    "context": run["context"],
                    "call": call,
                    "completed": False,
                    "not_run": True,
                    "oom": False,
                    "error": f"not run: {why}",
                }
            )


def print_card_table(rows: list[dict[str, Any]]) -> None:
    table = []
    for r in rows:
        st = r.get("reviva") or {}
        result = (
            "ok"
            if r.get("completed")
            else ("OOM" if r.get("oom") else ("not run" if r.get("not_run") else "ERROR"))
        )
        table.append(
            [
                r["mode"],
                r["contender"],
                ctx_label(r["context"]),
                r["call"],
                result,
                _fmt(r.get("prefill_s"), ".2f"),
                _fmt(r.get("decode_tok_s"), ".2f"),
                _fmt(r.get("new_tokens"), "d"),
                _fmt(r.get("max_memory_allocated_gb"), ".2f"),
                _fmt(r.get("max_memory_reserved_gb"), ".2f"),
                _fmt(r.get("card_peak_used_gb"), ".2f"),
                _fmt(st.get("streamed_layers"), "d"),
            ]
        )
    print_table(
        [
            "mode",
            "contender",
            "ctx",
            "call",
            "result",
            "prefill s",
            "decode tok/s",
            "new",
            "alloc GB",
            "reserved GB",
            "card peak GB",
            "streamed",
        ],
        table,
    )


def analyse_card(rows: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """Rooflines of every Reviva card call, and the checks, from the rows of this run (or of
    merged runs)."""
    kvb = settings["kv_bytes_per_token_per_layer"]
    calls_expected = settings["calls_per_worker"]
    label = settings["card_label"]
    th = settings["thresholds"]
    by: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault((r["mode"], r["contender"], r["context"]), []).append(r)
    for v in by.values():
        v.sort(key=lambda r: r["call"])

    def compute(ctx: int, transfer_s: float | None = None) -> dict[str, Any] | None:
        """The fastest no-card Reviva decode at ctx (all K/V resident): the compute term. Without
        a run at ctx, a run at a shorter context c bounds it: a decode step's compute is a fixed
        part (the weights) plus a part linear in the context (attention), so it is at most
        ctx / c times that run's; when that bound is under the transfer term, the roofline is the
        transfer term whatever the compute term is, and the bound stands in for it."""
        best = _fastest(ctx)
        if best is not None or transfer_s is None:
            return best
        shorter = [c for (mode, _, c) in by if mode == "no_card" and c < ctx]
        for c in sorted(set(shorter), reverse=True):
            found = _fastest(c)
            if found is None:
                continue
            bound = found["s"] * ctx / c
            if bound > transfer_s:
                return None
            return {
                "tok_s": 1 / bound,
                "s": bound,
                "from": f"bound: {found['from']} at {c} tokens x {ctx}/{c} (under the transfer)",
            }
        return None

    def _fastest(ctx: int) -> dict[str, Any] | None:
        best = None
        for (mode, name, c), calls in by.items():
            if mode != "no_card" or c != ctx or not name.startswith("reviva"):
                continue
            if "fp8" in name:  # (other bytes per token: not bf16's compute term)
                continue
            for r in calls:
                rate = r.get("decode_tok_s")
                st = r.get("reviva") or {}
                if not r.get("completed") or not rate or st.get("streamed_layers", 0) != 0:
                    continue
                if best is None or rate > best["tok_s"]:
                    where = f"no_card {name} call {r['call']}"
                    best = {"tok_s": rate, "s": 1 / rate, "from": where}
        return best

    rooflines = []
    roof_of: dict[tuple[str, str, int, int], dict[str, Any]] = {}
    for r in rows:
        if r["mode"] != "card" or not r["contender"].startswith("reviva"):
            continue
        if r["contender"] == "reviva_fp8":  # other bytes per token; its check is against bf16
            continue
        if not r.get("completed") or not r.get("decode_tok_s"):
            continue
        st = r.get("reviva") or {}
        streamed = st.get("streamed_layers")
        mean_len = r["context"] + (r.get("new_tokens") or 0) / 2
        transfer_s = (streamed or 0) * kvb * mean_len / (PCIE_GBPS * 1e9)
        comp = compute(r["context"], transfer_s)
        roof = max(comp["s"] if comp else 0.0, transfer_s)
        measured = 1 / r["decode_tok_s"]
        steps = st.get("decode_steps")
        h2d = st.get("bytes_to_device")
        x = {
            "mode": r["mode"],
            "contender": r["contender"],
            "context": r["context"],
            "call": r["call"],
            "streamed_layers": streamed,
            "resident_layers": st.get("resident_layers"),
            "streamed_kv_gb_per_token": (streamed or 0) * kvb * mean_len / 1e9,
            "measured_h2d_gb_per_token": h2d / max(steps + 1, 1) / 1e9
            if h2d is not None and steps is not None
            else None,
            "compute_s": comp["s"] if comp else None,
            "compute_from": comp["from"] if comp else None,
            "transfer_s": transfer_s,
            # Without the compute term the roofline is the transfer alone: a lower bound that
            # the check does not accept (it needs the no-card run).
            "roofline_s": roof if roof > 0 else None,
            "measured_s": measured,
            "ratio_to_roofline": measured / roof if roof > 0 else None,
            "complete_roofline": comp is not None and streamed is not None,
        }
        rooflines.append(x)
        roof_of[(r["mode"], r["contender"], r["context"], r["call"])] = x

    from reviva import parse_bytes

    card_bytes = parse_bytes(settings["card"])
    checks: dict[str, Any] = {}
    for ctx, kind in sorted(settings["check_contexts"].items(), key=lambda kv: int(kv[0])):
        ctx = int(ctx)
        calls = by.get(("card", "reviva", ctx))
        if not calls:
            continue  # not run here (another device call, merged with --analyse)
        hf = {r["call"]: r for r in by.get(("no_card", "hf", ctx), [])}
        short = {r["call"]: r for r in by.get(("card", "reviva", LONG_PREFILL_REFERENCE), [])}
        hf_warm = [r["prefill_s"] for r in hf.values() if r["call"] > 1 and r.get("completed")]
        missing = []
        if kind == "long" and not short:
            missing.append(
                f"no card Reviva run at {LONG_PREFILL_REFERENCE} tokens in this run (the prefill "
                f"reference): add --contexts {ctx_label(LONG_PREFILL_REFERENCE)},{ctx_label(ctx)}"
            )
        if len(calls) < calls_expected:
            missing.append(f"{len(calls)} of {calls_expected} calls recorded")
        if (
            not any(
                roof_of.get(("card", "reviva", ctx, r["call"]), {}).get("complete_roofline")
                for r in calls
            )
            and compute(ctx) is None
        ):
            missing.append(
                f"no completed no-card Reviva run with all K/V resident at {ctx} tokens (the "
                "roofline's compute term): add --no-card-contenders reviva_default or merge one"
            )
        if kind == "full" and not hf:
            missing.append(
                f"no no-card plain HF run at {ctx} tokens (the prefill reference): add "
                "--no-card-contenders hf or merge one"
            )
        per_call = []
        for r in calls:
            roof = roof_of.get(("card", "reviva", ctx, r["call"]))
            ratio = roof["ratio_to_roofline"] if roof and roof["complete_roofline"] else None
            c: dict[str, Any] = {
                "call": r["call"],
                "completed": bool(r.get("completed")),
                "error": r.get("error"),
                "new_tokens": r.get("new_tokens"),
                "prefill_s": r.get("prefill_s"),
                "decode_tok_s": r.get("decode_tok_s"),
                "ratio_to_roofline": ratio,
                "roofline_ok": ratio is not None and ratio <= th["max_roofline_ratio"],
                "card_peak_used_gb": r.get("card_peak_used_gb"),
                "max_memory_allocated_gb": r.get("max_memory_allocated_gb"),
                "max_memory_reserved_gb": r.get("max_memory_reserved_gb"),
                "streamed_layers": (r.get("reviva") or {}).get("streamed_layers"),
            }
            ok = c["completed"] and c["roofline_ok"]
            if ctx in MAX_PREFILL_S:
                pre, peak = r.get("prefill_s"), r.get("card_peak_used_gb")
                card_gb = card_bytes / 1e9
                c.update(
                    max_prefill_s=MAX_PREFILL_S[ctx],
                    prefill_time_ok=bool(pre and pre <= MAX_PREFILL_S[ctx]),
                    card_gb=card_gb,
                    peak_within_card=peak is not None and peak <= card_gb,
                )
                ok = ok and c["prefill_time_ok"] and c["peak_within_card"]
            if kind == "full":
                ref = hf.get(r["call"])
                ref_s = ref.get("prefill_s") if ref and ref.get("completed") else None
                limit = (
                    th["prefill_limit_first_call"]
                    if r["call"] == 1
                    else th["prefill_limit_later_calls"]
                )
                pre = r.get("prefill_s")
                c.update(
                    decode_ok=(r.get("decode_tok_s") or 0) >= th["min_decode_tok_s"],
                    hf_prefill_s_same_call=ref_s,
                    prefill_ratio=pre / ref_s if pre and ref_s else None,
                    prefill_limit=limit,
                    prefill_ok=bool(pre and ref_s and pre <= limit * ref_s),
                    prefill_ratio_vs_hf_best_warm=pre / min(hf_warm) if pre and hf_warm else None,
                )
                ok = ok and c["decode_ok"] and c["prefill_ok"]
            if kind == "long":
                ref = short.get(r["call"])
                ref_s = ref.get("prefill_s") if ref and ref.get("completed") else None
                pre = r.get("prefill_s")
                c.update(
                    reference_prefill_s_same_call=ref_s,
                    prefill_vs_reference=pre / ref_s if pre and ref_s else None,
                    prefill_limit=LONG_PREFILL_LIMIT,
                    prefill_ok=bool(pre and ref_s and pre <= LONG_PREFILL_LIMIT * ref_s),
                )
                ok = ok and c["prefill_ok"]
            c["ok"] = bool(ok)
            per_call.append(c)
        name = f"{label}_{ctx_label(ctx)}" + ("_bf16" if kind == "long" else "")
        if kind == "full":
            criteria = (
                f"{calls_expected} calls complete; decode >= {th['min_decode_tok_s']} tok/s and "
                f"<= {th['max_roofline_ratio']}x the roofline in each; prefill <= "
                f"{th['prefill_limit_first_call']}x plain HF's (no card, same call number) in "
                f"call 1, <= {th['prefill_limit_later_calls']}x in later calls"
            )
        elif kind == "long":
            criteria = (
                f"{calls_expected} calls complete; decode <= {th['max_roofline_ratio']}x the "
                f"roofline in each; prefill <= {LONG_PREFILL_LIMIT}x the same call's prefill at "
                f"{LONG_PREFILL_REFERENCE} tokens on the card"
            )
        else:
            criteria = (
                f"{calls_expected} calls complete; decode <= {th['max_roofline_ratio']}x "
                "the roofline in each"
            )
        if ctx in MAX_PREFILL_S:
            criteria += f"; prefill <= {MAX_PREFILL_S[ctx]} s and the card's peak within the card"
        checks[name] = {
            "kind": kind,
            "context": ctx,
            "card": settings["card"],
            "criteria": criteria,
            "missing": missing,
            "calls": per_call,
            "pass": not missing and all(c["ok"] for c in per_call),
        }
    # card24_512k_fp8 (issue 13): fp8 K/V completes and decodes >= FP8_DECODE_GAIN x the bf16
    # decode of the same run, call by call.
    for ctx, kind in sorted(settings["check_contexts"].items(), key=lambda kv: int(kv[0])):
        ctx = int(ctx)
        fp8 = by.get(("card", "reviva_fp8", ctx))
        if kind != "long" or not fp8:
            continue
        bf16 = {r["call"]: r for r in by.get(("card", "reviva", ctx), [])}
        missing = [] if bf16 else [f"no card bf16 Reviva run at {ctx} tokens in this run"]
        per_call = []
        for r in fp8:
            ref = bf16.get(r["call"])
            ref_rate = ref.get("decode_tok_s") if ref and ref.get("completed") else None
            rate = r.get("decode_tok_s")
            gain = rate / ref_rate if rate and ref_rate else None
            st = r.get("reviva") or {}
            per_call.append(
                {
                    "call": r["call"],
                    "completed": bool(r.get("completed")),
                    "error": r.get("error"),
                    "prefill_s": r.get("prefill_s"),
                    "decode_tok_s": rate,
                    "bf16_decode_tok_s": ref_rate,
                    "decode_gain": gain,
                    "kv_fp8_rel_error": st.get("kv_fp8_rel_error"),
                    "streamed_layers": st.get("streamed_layers"),
                    "ok": bool(
                        r.get("completed")
                        and gain
                        and gain >= FP8_DECODE_GAIN
                        and rate >= FP8_LONG_MIN_TOK_S
                    ),
                }
            )
        checks[f"{label}_{ctx_label(ctx)}_fp8"] = {
            "kind": "fp8",
            "context": ctx,
            "card": settings["card"],
            "criteria": f"completes; decode >= {FP8_DECODE_GAIN}x the bf16 decode of the same "
            f"run and call and >= {FP8_LONG_MIN_TOK_S:.2f} tok/s",
            "missing": missing,
            "calls": per_call,
            "pass": not missing and bool(per_call) and all(c["ok"] for c in per_call),
        }
    checks.update(fp8_speed_checks(by, settings))
    plan = plan_check(rows, settings)
    if plan is not None:
        checks["plan_1M_fp8"] = plan
    return {"rooflines": rooflines, "checks": checks}


def fp8_speed_checks(
    by: dict[tuple[str, str, int], list[dict[str, Any]]], settings: dict[str, Any]
) -> dict[str, Any]:
    """Issue 38's checks at the contexts that are not "long": card24_<ctx>_fp8 (decode >=
    FP8_CARD_MIN_TOK_S in calls 2.., prefill <= FP8_PREFILL_LIMIT x the bf16 card run's of the
    same call) and whole_<ctx>_fp8 (no-card reviva_default_fp8's decode >= FP8_WHOLE_RATIO x
    reviva_default's, calls 2..). Only where this run has the fp8 rows."""
    checks: dict[str, Any] = {}
    label = settings["card_label"]
    for ctx, kind in sorted(settings["check_contexts"].items(), key=lambda kv: int(kv[0])):
        ctx = int(ctx)
        if kind == "long":
            continue
        for mode, fp8_name, bf16_name, name in (
            ("card", "reviva_fp8", "reviva", f"{label}_{ctx_label(ctx)}_fp8"),
            ("no_card", "reviva_default_fp8", "reviva_default", f"whole_{ctx_label(ctx)}_fp8"),
        ):
            fp8 = by.get((mode, fp8_name, ctx))
            if not fp8:
                continue
            bf16 = {r["call"]: r for r in by.get((mode, bf16_name, ctx), []) if r.get("completed")}
            missing = [] if bf16 else [f"no completed {mode} {bf16_name} run at {ctx} tokens"]
            per_call = []
            for r in fp8:
                ref = bf16.get(r["call"], {})
                rate, ref_rate = r.get("decode_tok_s"), ref.get("decode_tok_s")
                pre, ref_pre = r.get("prefill_s"), ref.get("prefill_s")
                x = {
                    "call": r["call"],
                    "completed": bool(r.get("completed")),
                    "error": r.get("error"),
                    "decode_tok_s": rate,
                    "bf16_decode_tok_s": ref_rate,
                    "decode_vs_bf16": rate / ref_rate if rate and ref_rate else None,
                    "prefill_s": pre,
                    "bf16_prefill_s": ref_pre,
                    "prefill_vs_bf16": pre / ref_pre if pre and ref_pre else None,
                    "kv_fp8_rel_error": (r.get("reviva") or {}).get("kv_fp8_rel_error"),
                    "streamed_layers": (r.get("reviva") or {}).get("streamed_layers"),
                    "card_peak_used_gb": r.get("card_peak_used_gb"),
                }
                ok = x["completed"]
                if mode == "card":
                    ok = ok and x["prefill_vs_bf16"] is not None
                    ok = ok and x["prefill_vs_bf16"] <= FP8_PREFILL_LIMIT
                    if r["call"] > 1:
                        ok = ok and bool(rate) and rate >= FP8_CARD_MIN_TOK_S
                elif r["call"] > 1:
                    ok = ok and x["decode_vs_bf16"] is not None
                    ok = ok and x["decode_vs_bf16"] >= FP8_WHOLE_RATIO
                x["ok"] = bool(ok)
                per_call.append(x)
            criteria = (
                f"decode >= {FP8_CARD_MIN_TOK_S} tok/s in calls 2..; prefill <= "
                f"{FP8_PREFILL_LIMIT}x the bf16 card run's of the same call"
                if mode == "card"
                else f"decode >= {FP8_WHOLE_RATIO}x reviva_default's (bf16) in calls 2.."
            )
            checks[name] = {
                "kind": "fp8_speed",
                "context": ctx,
                "card": settings["card"] if mode == "card" else None,
                "criteria": criteria,
                "missing": missing,
                "calls": per_call,
                "pass": not missing and len(per_call) >= 2 and all(c["ok"] for c in per_call),
            }
    return checks


# Issue 13's plan_1M_fp8: `python -m reviva plan` says 1M tokens with fp8 K/V fit a 24 GB card
# and a 128 GiB host and predicts the times; its predictions at these contexts within
# PLAN_TOLERANCE of what the card runs measured.
PLAN_CONTEXTS = (262144, 524288)
PLAN_TOLERANCE = 0.15


def _plan_json(*argv: str) -> dict[str, Any]:
    import contextlib
    import io

    from reviva.cli.main import main as reviva_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        reviva_main(["plan", "--model", "llama3-8b", "--json", *argv])
    return json.loads(buf.getvalue())


def plan_check(rows: list[dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any] | None:
    """plan_1M_fp8 from the 24 GB card's Reviva rows at 256k and 512k of the 8B shape (None when
    this run has none: another run, merged with --analyse, brings them)."""
    if settings.get("card") != "24GB" or settings.get("num_layers") != SHAPE["num_hidden_layers"]:
        return None
    runs = [
        r
        for r in rows
        if r["mode"] == "card"
        and r["contender"] in ("reviva", "reviva_fp8", "reviva_flash")
        and r["context"] in PLAN_CONTEXTS
        and r.get("completed")
    ]
    if not runs:
        return None
    host = ("--host-memory", "128GiB", "--new-tokens", "16")
    million = _plan_json("--context", "1M", "--kv-dtype", "fp8", *host)
    compared = []
    for r in runs:
        st = r.get("reviva") or {}
        kernel = st.get("attention_kernel") or "flash"  # rows before the choice: flash
        kv = "fp8" if r["contender"] == "reviva_fp8" else "auto"
        new = str(r.get("new_tokens") or 16)
        argv = ["--context", str(r["context"]), "--kv-dtype", kv, "--new-tokens", new]
        pred = _plan_json(*argv, "--attention-kernel", kernel)
        f = pred.get("forecast") or {}
        predicted = f.get("prefill_s")
        if predicted is not None and r["call"] == 1:  # a process's first call: cuDNN's plans
            predicted += f.get("prefill_first_call_extra_s") or 0.0
        x: dict[str, Any] = {
            "contender": r["contender"],
            "context": r["context"],
            "call": r["call"],
            "attention_kernel": kernel,
            "measured_prefill_s": r.get("prefill_s"),
            "predicted_prefill_s": predicted,
            "measured_decode_tok_s": r.get("decode_tok_s"),
            "predicted_decode_tok_s": f.get("decode_call_tok_s"),
        }
        for what in ("prefill_s", "decode_tok_s"):
            m, p = x[f"measured_{what}"], x[f"predicted_{what}"]
            err = p / m - 1 if m and p else None
            x[f"{what}_error"] = err
            x[f"{what}_ok"] = err is not None and abs(err) <= PLAN_TOLERANCE
        x["ok"] = x["prefill_s_ok"] and x["decode_tok_s_ok"]
        compared.append(x)
    bf16 = {x["context"] for x in compared if x["contender"] != "reviva_fp8"}
    missing = [
        f"no completed bf16 card run at {c} tokens to compare with"
        for c in PLAN_CONTEXTS
        if c not in bf16
    ]
    fits = bool(million.get("fits")) and (million.get("host_bytes") or 0) <= 128 * 2**30
    return {
        "kind": "plan",
        "criteria": "plan: 1M tokens, fp8 K/V, fit a 24 GB card and a 128 GiB host with times "
        f"predicted; its prefill and decode predictions within {PLAN_TOLERANCE:.0%} of every "
        f"measured card run at {', '.join(ctx_label(c) for c in PLAN_CONTEXTS)}",
        "missing": missing,
        "plan_1m_fp8": {
            "fits": million.get("fits"),
            "host_bytes": million.get("host_bytes"),
            "forecast": million.get("forecast"),
            "error": million.get("error"),
        },
        "compared": compared,
        "pass": not missing and fits and all(x["ok"] for x in compared),
    }


def merge_card(args: argparse.Namespace, parts: list[dict[str, Any]]) -> int:
    settings = dict(parts[0]["settings"])
    for p in parts[1:]:
        s = p["settings"]
        for k in ("card", "kv_bytes_per_token_per_layer", "calls_per_worker", "num_layers"):
            if s.get(k) != settings.get(k):
                raise ValueError(f"cannot merge: {k} differs ({s.get(k)!r} vs {settings.get(k)!r})")
    settings["contexts"] = sorted({c for p in parts for c in p["settings"]["contexts"]})
    # One row per (mode, contender, context, call): a later file's row replaces an earlier one
    # (a re-run), except that a call not run never replaces one that ran.
    merged: dict[tuple, dict[str, Any]] = {}
    replaced = 0
    for p in parts:
        for r in p["runs"]:
            key = (r["mode"], r["contender"], r["context"], r["call"])
            if key in merged and r.get("not_run") and not merged[key].get("not_run"):
                continue
            replaced += key in merged
            merged[key] = r
    rows = list(merged.values())
    settings["merge_replaced_rows"] = replaced
    analysis = analyse_card(rows, settings)
    print_card_table(rows)
    print(json.dumps(analysis["checks"], indent=1))
    env = {
        **parts[0]["environment"],
        "merged_from": [
            {
                "file": Path(f).name,
                "git_sha": p["environment"]["git_sha"],
                "command": p["environment"]["command"],
                "complete": p.get("complete"),
            }
            for f, p in zip(args.analyse, parts, strict=True)
        ],
    }
    payload = {
        "environment": env,
        "complete": all(p.get("complete") for p in parts),
        "model": parts[0]["model"],
        "settings": settings,
        "anchors": ANCHORS,
        "workers": [w for p in parts for w in p.get("workers", [])],
        "runs": rows,
        **analysis,
    }
    path = result_path(args.name or f"generate-{settings['card_label']}-merged", env, args.out_dir)
    write_json(path, payload)
    print(f"wrote {path}")
    plot_beside(path)
    return 0


# --- fraction mode (the earlier measurement): one worker per budget -------------------------------


def run_one(model: Any, contender: str, ctx: int, new_tokens: int, budget: str | None) -> dict:
    import torch
    from transformers import DynamicCache

    import reviva

    ids = torch.randint(
        1,
        SHAPE["vocab_size"],
        (1, ctx),
        device="cuda",
        generator=torch.Generator(device="cuda").manual_seed(ctx),
    )
    kwargs = dict(max_new_tokens=new_tokens, do_sample=False)
    timer = CallTimer(lambda: torch.cuda.current_stream().synchronize())
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    row: dict[str, Any] = {
        "contender": contender,
        "context": ctx,
        "budget": budget or "none",
        "new_tokens_asked": new_tokens,
    }
    stats = None
    try:
        if contender == "hf":
            timer.begin()
            model.generate(ids, streamer=timer, **kwargs)
        elif contender == "hf_offload":
            cache = DynamicCache(config=model.config, offloading=True)
            timer.begin()
            model.generate(ids, past_key_values=cache, streamer=timer, **kwargs)
            del cache
        elif contender == "reviva":
            cfg = reviva.RevivaConfig(vram_budget=budget) if budget else reviva.RevivaConfig()
            manager = reviva.RevivaManager(model, cfg)
            # Setup, as for a manager reused across calls: pin the host copies (reported apart).
            t = time.perf_counter()
            manager.prepare(1, ctx, new_tokens)
            row["prepare_s"] = time.perf_counter() - t
            timer.begin()
            manager.generate(ids, streamer=timer, **kwargs)
            stats = manager.get_memory_stats().to_dict()
            del manager
        else:
            raise ValueError(f"unknown contender {contender!r}")
        row["oom"] = False
    except (torch.OutOfMemoryError, reviva.RevivaOutOfMemoryError, MemoryError) as e:
        row["oom"] = True
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
    except Exception as e:  # a failure is a result too: recorded, not hidden
        row["oom"] = False
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
        row["traceback"] = traceback.format_exc()[-3000:]
    torch.cuda.synchronize()
    row["prefill_s"] = timer.prefill_s
    row["decode_tok_s"] = timer.decode_tok_s
    row["new_tokens"] = timer.new_tokens
    row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    row["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    if stats is not None:
        row["reviva"] = stats
    del ids
    gc.collect()
    torch.cuda.empty_cache()
    return row


def fraction_worker(args: argparse.Namespace) -> int:
    import torch

    budget = None if args.budget == "none" else args.budget
    t0 = time.perf_counter()
    model = build_model(args.layers)
    weights = torch.cuda.memory_allocated()
    print(f"# model built in {time.perf_counter() - t0:.1f} s, {weights / 1e9:.2f} GB", flush=True)
    if budget:
        import reviva

        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(reviva.parse_bytes(budget) / total)
    # Warm-up (kernels, cuBLAS/cuDNN handles) so that the first measured run is not charged.
    for contender in args.contenders.split(","):
        run_one(model, contender, 1024, 4, budget)
    for ctx in [parse_tokens(c) for c in args.contexts.split(",")]:
        for contender in args.contenders.split(","):
            n = args.new_tokens
            if contender == "hf_offload":  # ~1 token/s at 64k: fewer tokens, same rate
                n = args.slow_new_tokens if ctx < 128 * 1024 else max(2, args.slow_new_tokens // 2)
            t = time.perf_counter()
            row = run_one(model, contender, ctx, n, budget)
            row["wall_s"] = time.perf_counter() - t
            row["weights_gb"] = weights / 1e9
            print("RESULT " + json.dumps(row), flush=True)
    return 0


def analyse_fraction(rows: list[dict]) -> dict[str, Any]:
    """Rooflines and the issue's acceptance figures, from rows of the same run."""
    by = {(r["contender"], r["context"], r["budget"]): r for r in rows}
    out: dict[str, Any] = {"rooflines": [], "checks": {}}
    for r in rows:
        st = r.get("reviva")
        if r["budget"] == "none" or not st or not r.get("decode_tok_s"):
            continue
        if st.get("streamed_layers", 0) == 0:  # everything resident: no transfer roofline
            continue
        free = by.get(("reviva", r["context"], "none"))
        compute_s = 1 / free["decode_tok_s"] if free and free.get("decode_tok_s") else None
        mean_len = r["context"] + r["new_tokens"] / 2
        per_layer = 2 * SHAPE["num_key_value_heads"] * 128 * 2 * mean_len
        nonres = st["streamed_layers"] * per_layer
        transfer_s = nonres / (PCIE_GBPS * 1e9)
        roof_s = max(compute_s or 0.0, transfer_s)
        step_s = 1 / r["decode_tok_s"]
        out["rooflines"].append(
            {
                "context": r["context"],
                "budget": r["budget"],
                "streamed_layers": st["streamed_layers"],
                "resident_layers": st.get("resident_layers"),
                "nonresident_kv_gb_per_token": nonres / 1e9,
                "measured_h2d_gb_per_token": st.get("bytes_to_device", 0)
                / max(st.get("decode_steps", 0) + 1, 1)
                / 1e9,
                "compute_s_all_resident": compute_s,
                "transfer_s": transfer_s,
                "roofline_s": roof_s,
                "measured_s": step_s,
                "ratio_to_roofline": step_s / roof_s,
            }
        )
    hf64 = by.get(("hf", 65536, "none"))
    rv64 = by.get(("reviva", 65536, "24GB"))
    if rv64 and hf64:
        roof = next((x for x in out["rooflines"] if x["context"] == 65536), None)
        out["checks"]["64k_24GB"] = {
            "decode_tok_s": rv64.get("decode_tok_s"),
            "decode_ge_12": (rv64.get("decode_tok_s") or 0) >= 12,
            "vs_hf_no_budget_decode": (rv64.get("decode_tok_s") or 0)
            / (hf64.get("decode_tok_s") or float("inf")),
            "ratio_to_roofline": roof and roof["ratio_to_roofline"],
            "within_25pct_of_roofline": bool(roof and roof["ratio_to_roofline"] <= 1.25),
            "prefill_s": rv64.get("prefill_s"),
            "hf_prefill_s_no_budget": hf64.get("prefill_s"),
            "prefill_ratio": (rv64.get("prefill_s") or float("inf")) / (hf64.get("prefill_s") or 1),
            "prefill_le_1_1x": (rv64.get("prefill_s") or float("inf"))
            <= 1.1 * (hf64.get("prefill_s") or 0),
            "peak_allocated_gb": rv64.get("peak_allocated_gb"),
            "peak_le_24GB": (rv64.get("peak_allocated_gb") or 99) <= 24.0,
        }
    for ctx in (131072, 262144):
        rv = by.get(("reviva", ctx, "24GB"))
        if rv:
            roof = next((x for x in out["rooflines"] if x["context"] == ctx), None)
            out["checks"][f"{ctx // 1024}k_24GB"] = {
                "completed": not rv.get("oom") and "error" not in rv,
                "peak_allocated_gb": rv.get("peak_allocated_gb"),
                "decode_tok_s": rv.get("decode_tok_s"),
                "ratio_to_roofline": roof and roof["ratio_to_roofline"],
                "within_20pct_of_roofline": bool(roof and roof["ratio_to_roofline"] <= 1.2),
            }
    hf16, rv16 = by.get(("hf", 16384, "none")), by.get(("reviva", 16384, "none"))
    if hf16 and rv16 and hf16.get("prefill_s") and rv16.get("prefill_s"):
        out["checks"]["16k_none"] = {
            "prefill_ratio": rv16["prefill_s"] / hf16["prefill_s"],
            "decode_ratio": (hf16.get("decode_tok_s") or 0) / (rv16.get("decode_tok_s") or 1e-9),
            "within_5pct": rv16["prefill_s"] <= 1.05 * hf16["prefill_s"]
            and (rv16.get("decode_tok_s") or 0) >= (hf16.get("decode_tok_s") or 0) / 1.05,
        }
    return out


def merge_fraction(args: argparse.Namespace, parts: list[dict[str, Any]]) -> int:
    rows = [r for part in parts for r in part["runs"]]
    analysis = analyse_fraction(rows)
    print(json.dumps(analysis, indent=1))
    payload = {
        **parts[0],
        "environment": {
            **parts[0]["environment"],
            "merged_from": [
                {
                    "file": Path(p).name,
                    "git_sha": part["environment"]["git_sha"],
                    "command": part["environment"]["command"],
                }
                for p, part in zip(args.analyse, parts, strict=True)
            ],
        },
        "runs": rows,
        **analysis,
    }
    payload.pop("worker_log_tails", None)
    path = write_result(args.name or "generate", payload, args.out_dir)
    print(f"wrote {path}")
    plot_beside(path)
    return 0


def fraction_driver(args: argparse.Namespace) -> int:
    env = environment()
    rows: list[dict] = []
    logs: dict[str, str] = {}
    child_env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    for budget in args.budgets.split(","):
        cmd = [
            sys.executable,
            __file__,
            "--mode",
            "fraction",
            "--worker",
            "--budget",
            budget,
            "--contexts",
            args.contexts,
            "--contenders",
            args.none_contenders if budget == "none" and args.none_contenders else args.contenders,
            "--new-tokens",
            str(args.new_tokens),
            "--slow-new-tokens",
            str(args.slow_new_tokens),
            "--layers",
            str(args.layers),
        ]
        print(f"# budget {budget}: {' '.join(cmd[1:])}", flush=True)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env
        )
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("RESULT "):
                row = json.loads(line[7:])
                rows.append(row)
                print(
                    f"  {row['contender']:>10} {row['context'] // 1024:>4}k {budget:>5}: "
                    f"prefill {row.get('prefill_s')} decode {row.get('decode_tok_s')} "
                    f"peak {row['peak_allocated_gb']:.2f} GB oom {row.get('oom')} "
                    f"{row.get('error', '')[:120]}",
                    flush=True,
                )
            else:
                print("  | " + line.rstrip(), flush=True)
        proc.wait()
        logs[budget] = "".join(lines[-200:])
        if proc.returncode != 0:
            print(f"# worker for budget {budget} exited with {proc.returncode}", flush=True)

    analysis = analyse_fraction(rows)
    table = []
    for r in rows:
        table.append(
            [
                r["contender"],
                f"{r['context'] // 1024}k",
                r["budget"],
                "OOM" if r.get("oom") else ("ERROR" if "error" in r else "ok"),
                _fmt(r.get("prefill_s"), ".2f"),
                _fmt(r.get("decode_tok_s"), ".2f"),
                _fmt(r.get("peak_allocated_gb"), ".2f"),
                _fmt(r.get("reviva", {}).get("resident_layers"), "d"),
                _fmt(r.get("reviva", {}).get("overlap_ratio"), ".3f"),
            ]
        )
    print_table(
        [
            "contender",
            "context",
            "budget",
            "result",
            "prefill s",
            "decode tok/s",
            "peak GB",
            "resident",
            "overlap",
        ],
        table,
    )
    for x in analysis["rooflines"]:
        print(
            f"roofline {x['context'] // 1024}k {x['budget']}: measured {x['measured_s'] * 1e3:.1f}"
            f" ms/token, roofline {x['roofline_s'] * 1e3:.1f} ms (compute "
            f"{(x['compute_s_all_resident'] or 0) * 1e3:.1f}, transfer {x['transfer_s'] * 1e3:.1f})"
            f" -> {x['ratio_to_roofline']:.3f}x"
        )
    print(json.dumps(analysis["checks"], indent=1))
    payload = {
        "environment": env,
        "model": {
            **SHAPE,
            "num_hidden_layers": args.layers,
            "dtype": "bfloat16",
            "attn_implementation": "sdpa",
            "weights": "random init",
        },
        "settings": {
            "mode": "fraction",
            "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
            "budget_enforcement": "torch.cuda.set_per_process_memory_fraction",
            "pcie_gbps_for_roofline": PCIE_GBPS,
            "new_tokens": args.new_tokens,
            "slow_new_tokens": args.slow_new_tokens,
        },
        "anchors": ANCHORS,
        "runs": rows,
        **analysis,
        "worker_log_tails": logs,
    }
    path = write_result(args.name or "generate", payload, args.out_dir)
    print(f"wrote {path}")
    plot_beside(path)
    return 0


# --- entry ----------------------------------------------------------------------------------------


def warm_page_cache() -> dict[str, Any]:
    """Reads the shared libraries that every worker loads (torch's, the NVIDIA wheels', Triton's,
    Reviva's) once, before the first worker. Kernels load lazily, inside a worker's first call:
    on a freshly started machine the first worker would read them from disk there and the later
    workers would find them in the page cache, so call 1 of whichever contender runs first
    (Reviva on the card) paid for a cold disk that the no-card references did not. Returns what
    was read and how long it took (seconds near the disk's rate: the cache was cold)."""
    import importlib.util

    roots: list[str] = []
    for name in ("torch", "nvidia", "triton", "reviva"):
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            roots += list(spec.submodule_search_locations)
    t = time.perf_counter()
    files = size = 0
    for root in roots:
        for folder, _, names in os.walk(root):
            for name in names:
                if not (name.endswith(".so") or ".so." in name or name.endswith(".cubin")):
                    continue
                try:
                    with open(os.path.join(folder, name), "rb", buffering=0) as f:
                        while chunk := f.read(8 << 20):
                            size += len(chunk)
                except OSError:
                    continue
                files += 1
    seconds = time.perf_counter() - t
    return {
        "roots": roots,
        "files": files,
        "bytes": size,
        "seconds": round(seconds, 3),
        "gb_per_s": round(size / seconds / 1e9, 2) if seconds > 0 else None,
    }


def warm_jit_cache(contexts: list[int]) -> dict[str, Any]:
    """Makes HF's attention call (transformers' sdpa_attention_forward, which plain HF's prefill
    and Reviva's whole-prompt prefill both make) once at each context, in a process of its own,
    before the first worker. cuDNN compiles its attention kernels at run time and the CUDA
    driver keeps the result in its JIT cache on disk (~/.nv/ComputeCache): the first process on
    a freshly started machine pays the compile inside its first call (H200, 64k: 0.88 s against
    0.11 s in each later process, benchmarks/results/jit-cache-2026-12-01-a19b83d.json), so
    call 1 of whichever contender ran first (Reviva on the card) paid what the no-card
    references did not. Returns each context's first-call seconds in that process."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--prime-attention"]
    cmd.append(",".join(str(c) for c in contexts))
    t = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after 900 s"}
    out: dict[str, Any] = {"seconds": round(time.perf_counter() - t, 3)}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        out["error"] = (done.stderr or done.stdout)[-500:]
        return out
    out["first_call_s"] = json.loads(lines[-1])
    return out


def prime_attention(contexts: list[int]) -> None:
    """--prime-attention: HF's attention call at each context (the model's shape, bf16,
    causal, no mask), first-call seconds printed as JSON (warm_jit_cache)."""
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    heads, kv_heads = SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    head_dim = SHAPE["hidden_size"] // heads
    module = torch.nn.Module()
    module.is_causal = True
    module.num_key_value_groups = heads // kv_heads
    seconds = {}
    for tokens in contexts:
        kw = dict(dtype=torch.bfloat16, device="cuda")
        q = torch.randn(1, heads, tokens, head_dim, **kw)
        k = torch.randn(1, kv_heads, tokens, head_dim, **kw)
        v = torch.randn(1, kv_heads, tokens, head_dim, **kw)
        torch.cuda.synchronize()
        t = time.perf_counter()
        sdpa_attention_forward(module, q, k, v, None, dropout=0.0, scaling=head_dim**-0.5)
        torch.cuda.synchronize()
        seconds[str(tokens)] = round(time.perf_counter() - t, 4)
        del q, k, v
    print(json.dumps(seconds))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("card", "fraction"), default="card")
    parser.add_argument(
        "--card", default=None, help="card mode: the card's memory (default 24GB; dry run 16MB)"
    )
    parser.add_argument(
        "--contexts",
        default=None,
        help="prompt lengths (default: card 64k, fraction 16k,64k,128k,256k, dry run 256,512)",
    )
    parser.add_argument(
        "--contenders",
        default=None,
        help="card mode: contenders on the card (default reviva,hf,hf_offload,reviva_default); "
        "fraction mode: every budget's contenders (default hf,hf_offload,reviva)",
    )
    parser.add_argument(
        "--no-card-contenders",
        default="hf,reviva_default",
        help="card mode: contenders run without a card at each context (prefill reference, "
        "roofline compute); '' for none",
    )
    parser.add_argument(
        "--no-card-contexts",
        default=None,
        help="card mode: prompt lengths of the no-card contenders (default: --contexts); e.g. "
        "64k for the compute term that bounds a longer context's (the 512k check)",
    )
    parser.add_argument("--calls", type=int, default=3, help="card mode: calls per worker")
    parser.add_argument(
        "--no-card-calls",
        type=int,
        default=0,
        help="card mode: calls per no-card worker (default: --calls); the 64k check compares "
        "plain HF's call k with Reviva's call k, so it needs all of them",
    )
    parser.add_argument(
        "--warmup-tokens",
        type=int,
        default=0,
        help="card mode: a warm-up generate of this many tokens (4 new) before call 1, "
        "recorded; 0 (default): none, call 1 is cold",
    )
    parser.add_argument(
        "--sample-ms", type=float, default=2.0, help="card mode: mem_get_info polling interval"
    )
    parser.add_argument(
        "--max-wall-s",
        type=float,
        default=0.0,
        help="card mode: skip runs whose estimate does not fit, kill a worker at this many "
        "seconds from the start (0: no limit)",
    )
    parser.add_argument(
        "--cold-page-cache",
        action="store_true",
        help="card mode: do not read the workers' shared libraries into the page cache first "
        "(the first worker on a fresh machine then loads its kernels from disk in its call 1)",
    )
    parser.add_argument(
        "--cold-jit-cache",
        action="store_true",
        help="card mode: do not make HF's attention call at each context in a process of its "
        "own first (the first worker on a fresh machine then pays cuDNN's run-time compile in "
        "its call 1)",
    )
    parser.add_argument("--prime-attention", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dry-run", action="store_true", help="card mode on the CPU, tiny model")
    parser.add_argument(
        "--estimate-only", action="store_true", help="card mode: print the runs and estimates"
    )
    parser.add_argument("--budgets", default="none,24GB", help="fraction mode")
    parser.add_argument(
        "--none-contenders",
        default=None,
        help="fraction mode: contenders for budget none (default: --contenders)",
    )
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--slow-new-tokens",
        type=int,
        default=8,
        help="new tokens for HF's offloaded cache (fraction mode: half of it from 128k)",
    )
    parser.add_argument("--layers", type=int, default=None, help="decoder layers (default: all)")
    parser.add_argument("--out", default=None, help="results folder (default benchmarks/results)")
    parser.add_argument("--name", default=None, help="file name stem of the JSON")
    parser.add_argument(
        "--analyse",
        nargs="+",
        metavar="JSON",
        default=None,
        help="merge the runs of earlier result files (e.g. from separate device calls), "
        "recompute rooflines and checks, write the merge",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--budget", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--card-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--context", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out_dir = Path(args.out) if args.out else None
    if args.layers is None:
        args.layers = (DRY_SHAPE if args.dry_run else SHAPE)["num_hidden_layers"]
    if args.card_worker:
        return card_worker(args)
    if args.prime_attention:
        prime_attention([int(c) for c in args.prime_attention.split(",")])
        return 0
    if args.analyse:
        parts = [json.loads(Path(p).read_text()) for p in args.analyse]
        if parts[0].get("settings", {}).get("mode") == "card":
            return merge_card(args, parts)
        return merge_fraction(args, parts)
    if args.mode == "fraction":
        if args.dry_run:
            parser.error("--dry-run is card mode's")
        args.contexts = args.contexts or "16k,64k,128k,256k"
        args.contenders = args.contenders or "hf,hf_offload,reviva"
        if args.worker:
            return fraction_worker(args)
        return fraction_driver(args)
    if args.dry_run:
        args.contexts = args.contexts or DRY_DEFAULTS["contexts"]
        args.card = args.card or DRY_DEFAULTS["card"]
    args.contexts = args.contexts or "64k"
    args.card = args.card or "24GB"
    if args.contenders is None:
        args.contenders = "reviva,hf,hf_offload,reviva_default"
    return card_driver(args)


if __name__ == "__main__":
    sys.exit(main())
