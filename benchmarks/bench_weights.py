"""Models larger than the card: weights streamed from pinned host memory (issue 14), in card mode.

Each scenario runs in a fresh worker process (DESIGN.md, "Measuring as a user runs it": a
ballast of device total - card, torch's default allocator settings):

- `reviva_32b`: the Qwen2.5-32B shape (hidden 5120, 64 layers, MLP 27648, 40/8 heads, vocab
  152064, bf16: 65.5 GB) on a 24 GB card, built on the meta device and filled layer by layer
  into pinned host memory (random values made on the GPU). A 32k prompt with 32 new tokens
  (check `card24_32b`), then batch 8 x 4k and batch 1 x 4k (check `batch8_32b`).
- `resident_32b`: the same shape with every weight on the device (no card: it fits the H200),
  32k prompt, as many new tokens: the prefill that card24_32b's is held to.
- `accelerate_32b`: HF accelerate's offload of the same shape (`infer_auto_device_map` +
  `dispatch_model`, max_memory card - 2 GiB), a short prompt: its decode rate (weight-bound: the
  prompt's length barely changes it).
- `reviva_8b`, `accelerate_8b`: the Llama-3-8B shape on an 8 GB card, 32k prompt (check
  `card8_8b`, RevivaConfig's defaults); `reviva_8b_host` and `reviva_8b_device` the same with
  decode_attention forced to "host" or "device" (checks `card8_8b_host_attention`,
  `card8_8b_device_attention`).

A process's first call pays its kernels' set-up, its host memory's pinning and the like, and
varies from process to process more than later calls do: `--processes N` runs every scenario N
times, each time in a fresh process (rounds interleaved: reviva, resident, reviva, ...), and the
prefill check compares, call index by call index, the median over the processes.
`--profile-first-call` writes a torch.profiler table (and a gzipped Chrome trace) of each reviva
process's first call beside the JSON.

The roofline of a decode step is the bytes it must copy (the streamed layers' weights, and the
K/V of layers streamed in decode) over 55 GB/s (pinned H2D on the H200, DESIGN.md).

    python benchmarks/bench_weights.py --out DIR                  # every scenario
    python benchmarks/bench_weights.py --scenarios reviva_8b,accelerate_8b --out DIR
    python benchmarks/bench_weights.py --scenarios reviva_32b,resident_32b --calls 2 \
        --new-tokens 4 --no-batch8 --processes 3 --out DIR     # call 1's prefill, 3 processes
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from card import CallTimer, CardSampler, child_environment, gb, prepare_device, say  # noqa: E402
from common import environment, print_table, write_json  # noqa: E402

PCIE_H2D_BPS = 55e9  # DESIGN.md, "Performance model"

# The shapes, as `python -m reviva plan` names them (reviva.cli.models.PRESETS).
SHAPES = {"32b": "qwen2.5-32b", "8b": "llama3-8b"}

SCENARIOS: dict[str, dict[str, Any]] = {
    "reviva_32b": dict(shape="32b", card_gb=24, kind="reviva"),
    "resident_32b": dict(shape="32b", card_gb=None, kind="resident"),
    "accelerate_32b": dict(shape="32b", card_gb=24, kind="accelerate"),
    "reviva_32b_fp8": dict(shape="32b", card_gb=24, kind="reviva", kv_dtype="fp8", batch8=False),
    "reviva_8b": dict(shape="8b", card_gb=8, kind="reviva"),
    "reviva_8b_fp8": dict(shape="8b", card_gb=8, kind="reviva", kv_dtype="fp8"),
    # decode's streamed K/V attended on the host (Note [Attention on the host]) or fetched, each
    # forced ("auto" takes the host where planner.host_attention_pays): the A/B of card8_8b
    "reviva_8b_host": dict(shape="8b", card_gb=8, kind="reviva", decode_attention="host"),
    "reviva_8b_device": dict(shape="8b", card_gb=8, kind="reviva", decode_attention="device"),
    "accelerate_8b": dict(shape="8b", card_gb=8, kind="accelerate"),
}


def config_of(shape: str, max_positions: int) -> Any:
    from transformers import AutoConfig

    from reviva.cli.models import PRESETS

    fields = dict(PRESETS[SHAPES[shape]])
    cfg = AutoConfig.for_model(fields.pop("model_type"), **fields)
    cfg.max_position_embeddings = max_positions
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    return cfg


def fill_param(name: str, p: Any, generator: Any = None) -> None:
    """Random values made on the GPU (when there is one) and copied into p, wherever p lives;
    norms at 1, as a trained model's are near."""
    import torch

    if name.endswith("norm.weight"):
        p.fill_(1.0)
        return
    where = "cuda" if torch.cuda.is_available() else "cpu"
    v = torch.empty(p.shape, dtype=torch.float32, device=where).normal_(
        0, 0.02, generator=generator
    )
    p.copy_(v.to(p.dtype))


def fill_random(i: int, layer: Any) -> None:
    """fill_layer for RevivaManager: layer i's values, into its pinned host copy."""
    import torch

    where = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator(device=where).manual_seed(1000 + i)
    for name, p in layer.named_parameters():
        fill_param(name, p, g)


def random_model(cfg: Any, place: str) -> Any:
    """A random bf16 model built without memory, then placed: "cuda" or "cpu" (all of it there),
    or "layers_on_meta" (its decoder layers left on the meta device for RevivaManager's
    fill_layer, the rest on the GPU, as a checkpoint loader would have loaded it)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    inner = model.model
    device = "cpu" if place == "cpu" else "cuda"
    if place == "layers_on_meta":
        for module in (inner.embed_tokens, inner.norm, model.lm_head):
            module.to_empty(device=device)
    else:
        model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_meta:
                fill_param(name, p)
    inner.rotary_emb = type(inner.rotary_emb)(config=cfg).to(device)
    return model


def timed_generate(
    gen: Any, ids: Any, new: int, probe: Any, sync: Any, **kwargs: Any
) -> dict[str, Any]:
    timer = CallTimer(sync)
    sampler = CardSampler(probe)
    t = time.perf_counter()
    timer.begin()  # (the prefill's clock starts here: generate puts the prompt first)
    with sampler:
        out = gen(ids, max_new_tokens=new, do_sample=False, streamer=timer, **kwargs)
    wall = time.perf_counter() - t
    batch = ids.shape[0]
    row = {
        "batch": batch,
        "prompt_tokens": ids.shape[1],
        "new_tokens": int(out.shape[1] - ids.shape[1]),
        "wall_s": wall,
        "prefill_s": timer.prefill_s,
        "decode_tok_s": timer.decode_tok_s,
        "decode_batch_tok_s": timer.decode_tok_s * batch if timer.decode_tok_s else None,
        "min_free_bytes": sampler.min_free,
    }
    return row


def run_reviva(spec: dict[str, Any], args: argparse.Namespace, probe: Any, card: int) -> dict:
    import torch

    from reviva import RevivaConfig, RevivaManager

    cfg = config_of(spec["shape"], args.prompt + args.new_tokens + 64)
    t = time.perf_counter()
    model = random_model(cfg, "layers_on_meta")
    budget = f"{spec['card_gb']}GB" if spec["card_gb"] else None
    config = RevivaConfig(
        vram_budget=budget,
        device="cuda",
        kv_dtype=spec.get("kv_dtype", "auto"),
        decode_attention=spec.get("decode_attention", "auto"),
    )
    manager = RevivaManager(model, config, fill_layer=fill_random)
    load_s = time.perf_counter() - t
    say(f"# loaded in {load_s:.1f} s: {manager.weights.total_bytes / 1e9:.1f} GB pinned")
    sync = torch.cuda.synchronize
    rows = []
    calls = [(1, args.prompt, args.new_tokens)] * args.calls
    if spec["shape"] == "32b" and args.batch8 and spec.get("batch8", True):
        calls += [(8, 4096, args.new_tokens), (1, 4096, max(args.new_tokens // 4, 4))]
    for k, (batch, prompt, new) in enumerate(calls):
        ids = torch.randint(1, cfg.vocab_size, (batch, prompt), device="cuda")
        try:
            if k == 0 and args.profile_dir:
                row = profiled(manager.generate, ids, new, probe, sync, args)
            else:
                row = timed_generate(manager.generate, ids, new, probe, sync)
            st = manager.get_memory_stats().to_dict()
            row["stats"] = st
            for k in ("decode_attention", "host_attended_layers", "streamed_layers"):
                row[k] = st.get(k)
            for k in ("host_attention_s", "host_attention_wait_s", "weight_stall_s", "stall_s"):
                row[k] = st.get(k)
            row["card_peak_bytes"] = card - row["min_free_bytes"]
            row.update(roofline(manager, st, cfg, batch, prompt))
        except Exception as e:  # noqa: BLE001 (recorded)
            row = {"batch": batch, "prompt_tokens": prompt, "error": f"{type(e).__name__}: {e}"}
            row["traceback"] = traceback.format_exc()[-3000:]
        rows.append(row)
        say(f"RESULT_ROW {json.dumps(summary(row))}")
    return {"load_s": load_s, "weights_gb": manager.weights.total_bytes / 1e9, "calls": rows}


def profiled(gen: Any, ids: Any, new: int, probe: Any, sync: Any, args: Any) -> dict[str, Any]:
    """timed_generate under torch.profiler (host ops and CUDA API calls, the device's kernels
    and copies): a table of the host's time by op and a gzipped Chrome trace, in --out."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        row = timed_generate(gen, ids, new, probe, sync)
    out = Path(args.profile_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"first-call-{args.worker}-{os.getpid()}"
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=60)
    (out / f"{stem}.txt").write_text(table)
    trace = out / f"{stem}.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as f, gzip.open(str(trace) + ".gz", "wb") as g:
        g.write(f.read())
    trace.unlink()
    row["profile"] = f"{stem}.txt"
    return row


def roofline(manager: Any, st: dict[str, Any], cfg: Any, batch: int, prompt: int) -> dict:
    """A decode step's bytes to copy: the streamed layers' weights and the K/V of the layers
    streamed in decode (at the prompt's length; not those attended on the host, whose K/V stays
    there), and the rate 55 GB/s gives them."""
    w = manager.weights
    streamed_w = sum(w.layer_bytes[i] for i in range(w.num_layers) if not w.resident(i))
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    row = head_dim + 4 if st["kv_dtype"] == "fp8" else head_dim * 2  # (Note [fp8 K/V rows])
    kv_token = 2 * batch * cfg.num_key_value_heads * row
    streamed_kv = (st["streamed_layers"] - st.get("host_attended_layers", 0)) * prompt * kv_token
    step = streamed_w + streamed_kv
    rate = PCIE_H2D_BPS / step if step else None
    return {
        "step_bytes": step,
        "step_weight_bytes": streamed_w,
        "step_kv_bytes": streamed_kv,
        "roofline_tok_s": rate,
        "of_roofline": (st["decode_tok_s"] / rate) if rate and st.get("decode_tok_s") else None,
    }


def run_resident(spec: dict[str, Any], args: argparse.Namespace, probe: Any, card: int) -> dict:
    import torch

    from reviva import RevivaConfig, RevivaManager

    cfg = config_of(spec["shape"], args.prompt + args.new_tokens + 64)
    model = random_model(cfg, "cuda")
    manager = RevivaManager(model, RevivaConfig())
    assert manager.weights is None
    rows = []
    for _ in range(2):  # the first call of a process pays its kernels' set-up
        ids = torch.randint(1, cfg.vocab_size, (1, args.prompt), device="cuda")
        # as many new tokens as the streamed calls: a call with 8 or more decode steps captures
        # its decode graphs before its first token (Note [Decode graphs]), inside prefill_s
        row = timed_generate(manager.generate, ids, args.new_tokens, probe, torch.cuda.synchronize)
        row["stats"] = manager.get_memory_stats().to_dict()
        rows.append(row)
        say(f"RESULT_ROW {json.dumps(summary(row))}")
    return {"calls": rows}


def run_accelerate(spec: dict[str, Any], args: argparse.Namespace, probe: Any, card: int) -> dict:
    import torch
    from accelerate import dispatch_model, infer_auto_device_map

    cfg = config_of(spec["shape"], 8192)
    t = time.perf_counter()
    model = random_model(cfg, "cpu")
    build_s = time.perf_counter() - t
    # 80% of the card for the modules accelerate places there: the rest holds the CUDA
    # context, the K/V and the activations (a 24 GB card is 22.4 GiB)
    max_memory = {0: f"{int(card * 0.8) >> 20}MiB", "cpu": "400GiB"}
    layer_class = type(model.model.layers[0]).__name__
    device_map = infer_auto_device_map(
        model, max_memory=max_memory, no_split_module_classes=[layer_class]
    )
    on_gpu = sum(1 for v in device_map.values() if v == 0)
    model = dispatch_model(model, device_map=device_map)
    rows = []
    for _ in range(args.accelerate_calls):
        ids = torch.randint(1, cfg.vocab_size, (1, args.accelerate_prompt), device="cuda")
        try:
            row = timed_generate(
                model.generate, ids, args.accelerate_new_tokens, probe, torch.cuda.synchronize
            )
            row["card_peak_bytes"] = card - row["min_free_bytes"]
        except Exception as e:  # noqa: BLE001 (recorded)
            row = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        rows.append(row)
        say(f"RESULT_ROW {json.dumps(summary(row))}")
    return {
        "build_s": build_s,
        "max_memory": max_memory,
        "modules_on_gpu": on_gpu,
        "modules": len(device_map),
        "calls": rows,
    }


def summary(row: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in row.items() if k not in ("stats", "traceback")}


def worker(args: argparse.Namespace) -> int:
    spec = SCENARIOS[args.worker]
    card = spec["card_gb"] * 10**9 if spec["card_gb"] else None
    info, ballast, probe, card_bytes = prepare_device(card, cuda=True)
    if "error" in info:
        print("WORKER " + json.dumps({"device": info, "error": info["error"]}, default=str))
        return 1
    run = {"reviva": run_reviva, "resident": run_resident, "accelerate": run_accelerate}
    try:
        result = run[spec["kind"]](spec, args, probe, card_bytes)
    except Exception as e:  # noqa: BLE001 (recorded)
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    result["device"] = info
    result["environment"] = environment()
    print("WORKER " + json.dumps(result, default=str), flush=True)
    if ballast is not None:
        ballast.free()
    return 0


def first_ok(result: dict[str, Any] | None, batch: int = 1, prompt: int | None = None) -> dict:
    for row in (result or {}).get("calls", []):
        if "error" in row or row.get("batch") != batch:
            continue
        if prompt is not None and row.get("prompt_tokens") != prompt:
            continue
        return row
    return {}


def calls_ok(result: dict[str, Any] | None, batch: int, prompt: int) -> list[dict[str, Any]]:
    return [
        r
        for r in (result or {}).get("calls", [])
        if "error" not in r and r.get("batch") == batch and r.get("prompt_tokens") == prompt
    ]


def processes(results: dict[str, Any], scenario: str) -> list[dict[str, Any]]:
    """The scenario's runs, one per process (--processes: `name`, `name@2`, ...)."""
    return [v for k, v in results.items() if k == scenario or k.startswith(scenario + "@")]


def calls_by_process(
    results: dict[str, Any], scenario: str, batch: int, prompt: int
) -> list[list[dict[str, Any]]]:
    return [rows for run in processes(results, scenario) if (rows := calls_ok(run, batch, prompt))]


def median_prefill(runs: list[list[dict[str, Any]]]) -> list[float | None]:
    """Per call index, the median prefill over the processes that made that call."""
    most = max((len(rows) for rows in runs), default=0)
    out: list[float | None] = []
    for i in range(most):
        xs = [rows[i]["prefill_s"] for rows in runs if len(rows) > i and rows[i].get("prefill_s")]
        out.append(statistics.median(xs) if xs else None)
    return out


def card_check(
    runs: list[list[dict[str, Any]]],
    accelerate: dict[str, Any],
    card_gb: int,
    least_tok_s: float,
    resident: list[list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """One model-larger-than-the-card check over the scenario's processes' calls (`runs`, one
    list per process): every call's decode (the slowest at least `least_tok_s`, within 1.15x of
    its roofline, 6x accelerate's), the peak within the card, and (with `resident` processes)
    each call index's median prefill within 1.2x the resident processes' median of that index
    (the first call of a process pays its kernels' set-up in both)."""
    rows = [r for run in runs for r in run]
    rates = [r.get("decode_tok_s") for r in rows]
    # (the slowest call decides; a call without a decode rate fails the check)
    row = min(rows, key=lambda r: r.get("decode_tok_s") or 0.0)
    acc_rate = accelerate.get("decode_tok_s")
    rate = row.get("decode_tok_s")
    out: dict[str, Any] = {
        "decode_tok_s": rate,
        "decode_tok_s_per_call": rates,
        "roofline_tok_s": row.get("roofline_tok_s"),
        "of_roofline": row.get("of_roofline"),
        "step_weight_gb": gb(row.get("step_weight_bytes")),
        "step_kv_gb": gb(row.get("step_kv_bytes")),
        "accelerate_decode_tok_s": acc_rate,
        "x_accelerate": rate / acc_rate if rate and acc_rate else None,
        "prefill_s": [[r.get("prefill_s") for r in run] for run in runs],
        "card_peak_gb": max(gb(r.get("card_peak_bytes")) or 0 for r in rows),
    }
    ok = (
        rate is not None
        and rate >= least_tok_s
        and (row.get("of_roofline") or 0) >= 1 / 1.15
        and acc_rate is not None
        and rate >= 6 * acc_rate
        and out["card_peak_gb"] <= card_gb
    )
    limits = f"decode >= {least_tok_s} tok/s, >= 1/1.15 of the roofline, >= 6x accelerate; "
    limits += f"peak <= {card_gb} GB"
    if resident is not None:
        mine, theirs = median_prefill(runs), median_prefill(resident)
        ratios = [a / b for a, b in zip(mine, theirs, strict=False) if a and b]
        out["processes"] = len(runs)
        out["resident_processes"] = len(resident)
        out["resident_prefill_s"] = [[q.get("prefill_s") for q in run] for run in resident]
        out["median_prefill_s"] = mine
        out["resident_median_prefill_s"] = theirs
        out["prefill_x_resident"] = ratios
        ok = ok and bool(ratios) and len(ratios) == len(mine) and all(x <= 1.2 for x in ratios)
        limits += (
            "; each call index's median prefill over the processes <= 1.2x the resident "
            "processes' median of the same index"
        )
    out["limits"] = limits
    return {"pass": bool(ok), **out}


def analyse(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    checks: dict[str, Any] = {}
    acc32 = first_ok(results.get("accelerate_32b"))
    acc8 = first_ok(results.get("accelerate_8b"))
    res32 = calls_by_process(results, "resident_32b", 1, args.prompt)
    for name, key, card, least, resident, acc in (
        ("card24_32b", "reviva_32b", 24, 1.05, res32, acc32),
        ("card24_32b_fp8", "reviva_32b_fp8", 24, 1.05, res32, acc32),
        ("card8_8b", "reviva_8b", 8, 5.0, None, acc8),
        ("card8_8b_fp8", "reviva_8b_fp8", 8, 5.0, None, acc8),
        ("card8_8b_host_attention", "reviva_8b_host", 8, 5.0, None, acc8),
        ("card8_8b_device_attention", "reviva_8b_device", 8, 5.0, None, acc8),
    ):
        runs = calls_by_process(results, key, 1, args.prompt)
        if runs:
            checks[name] = card_check(runs, acc, card, least, resident or None)
    b8 = first_ok(results.get("reviva_32b"), 8, 4096)
    b1 = first_ok(results.get("reviva_32b"), 1, 4096)
    if b8 and b1:
        ratio = b8["decode_batch_tok_s"] / b1["decode_tok_s"]
        checks["batch8_32b"] = {
            "pass": ratio >= 6 and b8["card_peak_bytes"] <= 24e9,
            "batch8_tok_s": b8["decode_batch_tok_s"],
            "batch1_tok_s": b1["decode_tok_s"],
            "ratio": ratio,
            "card_peak_gb": gb(b8["card_peak_bytes"]),
            "limit": "batch 8 tokens/s >= 6x batch 1's (4k prompts)",
        }
    return checks


def driver(args: argparse.Namespace) -> int:
    env, removed = child_environment()
    scenarios = [s for s in args.scenarios.split(",") if s]
    for s in scenarios:
        if s not in SCENARIOS:
            raise SystemExit(f"unknown scenario {s!r}; known: {', '.join(SCENARIOS)}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    env_here = environment(cuda=False)
    results: dict[str, Any] = {}
    status: dict[str, Any] = {}
    deadline = time.perf_counter() + args.max_wall_s
    passthrough = [
        f"--prompt={args.prompt}",
        f"--new-tokens={args.new_tokens}",
        f"--calls={args.calls}",
        f"--accelerate-prompt={args.accelerate_prompt}",
        f"--accelerate-new-tokens={args.accelerate_new_tokens}",
        f"--accelerate-calls={args.accelerate_calls}",
    ] + ([] if args.batch8 else ["--no-batch8"])
    if args.profile_first_call:
        passthrough.append(f"--profile-dir={out_dir}")
    path = out_dir / f"weights-{env_here['date_utc'][:10]}-{env_here['git_sha'][:12]}.json"
    # (--processes: round after round of every scenario, each run a fresh process)
    rounds = [
        (s if k == 0 else f"{s}@{k + 1}", s) for k in range(args.processes) for s in scenarios
    ]
    for key, s in rounds:
        left = deadline - time.perf_counter()
        if left < 30:
            status[key] = "not run: --max-wall-s reached"
            continue
        cmd = [sys.executable, __file__, "--worker", s, *passthrough]
        say(f"# {s}: {' '.join(cmd)}")
        t = time.perf_counter()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=left)
            out = proc.stdout
            status[key] = {"exit": proc.returncode, "wall_s": time.perf_counter() - t}
            if proc.returncode != 0:
                status[key]["stderr_tail"] = proc.stderr[-3000:]
        except subprocess.TimeoutExpired as e:
            out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
            status[key] = {"exit": "killed at --max-wall-s", "wall_s": time.perf_counter() - t}
        for line in out.splitlines():
            if line.startswith(("RESULT_ROW", "#")):
                say(f"  {key}: {line}")
            if line.startswith("WORKER "):
                results[key] = json.loads(line[len("WORKER ") :])
        checks = analyse(results, args)
        write_json(
            path,
            {
                "environment": env_here,
                "settings": vars(args),
                "allocator_settings_removed": removed,
                "pcie_h2d_bps": PCIE_H2D_BPS,
                "status": status,
                "checks": checks,
                "results": results,
            },
        )
    checks = analyse(results, args)
    rows = [
        [k, v.get("pass"), json.dumps({x: y for x, y in v.items() if x != "pass"})[:150]]
        for k, v in checks.items()
    ]
    print_table(["check", "pass", "figures"], rows)
    say(f"# wrote {path}")
    return 0


def merge(args: argparse.Namespace) -> int:
    """One JSON (and its checks) from several runs' files: device calls are 10 minutes at most,
    so the scenarios of one set of checks may come from two calls."""
    parts = [json.loads(Path(f).read_text()) for f in args.merge]
    results: dict[str, Any] = {}
    for part in parts:
        results.update(part["results"])
    prompts = {part["settings"]["prompt"] for part in parts}
    if len(prompts) != 1:
        raise SystemExit(f"the runs have different --prompt values: {sorted(prompts)}")
    args.prompt = prompts.pop()
    checks = analyse(results, args)
    env = environment(cuda=False)
    path = Path(args.out) / f"weights-merged-{env['date_utc'][:10]}-{env['git_sha'][:12]}.json"
    write_json(
        path,
        {
            "environment": env,
            "merged_from": [str(f) for f in args.merge],
            "parts_environment": [part["environment"] for part in parts],
            "status": [part["status"] for part in parts],
            "pcie_h2d_bps": PCIE_H2D_BPS,
            "checks": checks,
            "results": results,
        },
    )
    for k, v in checks.items():
        say(f"{k}: {'PASS' if v['pass'] else 'FAIL'} {json.dumps(v)[:300]}")
    say(f"# wrote {path}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--scenarios", default=",".join(SCENARIOS))
    p.add_argument("--prompt", type=int, default=32768)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--calls", type=int, default=1)
    p.add_argument("--no-batch8", dest="batch8", action="store_false")
    p.add_argument("--accelerate-prompt", type=int, default=512)
    p.add_argument("--accelerate-new-tokens", type=int, default=4)
    p.add_argument("--accelerate-calls", type=int, default=1)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--max-wall-s", type=float, default=540)
    p.add_argument("--processes", type=int, default=1, help="fresh processes per scenario")
    p.add_argument(
        "--profile-first-call",
        action="store_true",
        help="profile each reviva process's first call (files beside the JSON)",
    )
    p.add_argument("--profile-dir", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--merge", nargs="+", metavar="JSON", help="merge runs' JSON files")
    args = p.parse_args()
    if args.processes < 1:
        p.error(f"--processes must be at least 1, got {args.processes}")
    if args.worker:
        return worker(args)
    if args.merge:
        return merge(args)
    return driver(args)


if __name__ == "__main__":
    raise SystemExit(main())
