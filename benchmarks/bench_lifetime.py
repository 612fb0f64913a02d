"""The lifetime of Reviva's generate calls on one RevivaManager: many calls in a row leave nothing
behind, and an interrupted call leaves the model, the device and the next call as they were
(DESIGN.md, "Lifetime of a call").

GPU: a small Llama-shaped model (hidden 512, 8 layers, 8 heads of 64, 8 K/V heads, MLP 1408, vocab
32000, random weights, the head scaled by 8 so that greedy argmax is robust to last-bit
differences, as the tests do), an 8k prompt and 16 new tokens; one process, torch's allocator at
its defaults (PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF removed by re-executing without them).
The vram_budget is chosen so that layers are streamed: from RevivaManager.plan(), the weights, the
working sets and the K/V of half the layers in decode (at least one slot in prefill), then checked
by a first call and lowered a layer's K/V at a time until the call's stats report streamed layers
(every attempt is recorded). Without a GPU (or with --cpu): a tiny fp32 model on the CPU (host
backend), a 256-token prompt; device figures are then absent and their criteria not applied.

    python benchmarks/bench_lifetime.py [--calls 100] [--gc-calls 10] [--out DIR] [--cpu]

Checks (the JSON's `checks`):
    repeat_100  --calls (100) calls of the same generate (bf16 on the GPU) on one manager, after
                the call(s) that chose its budget, gc enabled as a user has it: all complete,
                with streamed layers; after every call torch's allocated and reserved
                bytes, the device's used bytes (mem_get_info), Reviva's pinned/host figures (every
                get_memory_stats() key naming 'host' or 'pinned': whatever exists) and the RSS
                (/proc/self/statm) are recorded; from call 5 to the last, the device figures and
                the pinned ones stay within 1 MiB and the RSS within 1%. Then --gc-calls more
                calls under gc.disable(): after each, no RevivaCache alive (gc.get_objects()) and
                the weak references to the call's RevivaCache and its KVStore (taken by a forward
                pre-hook with kwargs on layer 0, which sees past_key_values) dead.
    interrupt   per dtype (fp32 and bf16 on the GPU), three interrupted calls after two clean
                ones: KeyboardInterrupt raised by a streamer's put() at the 4th new token;
                torch.OutOfMemoryError("injected") raised by a forward pre-hook of the middle
                decoder layer at its first call (prefill) and at its 4th (decode). After each: the
                exception reached the caller as raised; every module's __dict__ as before (a
                'forward' entry only where there was one, the same object, the same keys);
                torch's allocated bytes equal to before the call and the memory outside torch's
                allocator (mem_get_info's used minus torch's reserved: Reviva's arena) within
                1 MiB of it, measured at once after the exception (no gc.collect; the figures
                after one are recorded too; torch's cache of freed blocks and mem_get_info's
                free are recorded, not judged: torch keeps or gives back its cache); the
                next call completes with plain HF's greedy tokens (model.generate without Reviva)
                in fp32, and in bf16 with Reviva's own uninterrupted tokens (a different decode
                attention kernel; equality with HF's is recorded beside). The same interruptions
                of plain HF are recorded as a control (not part of the check).
Reproduce: python benchmarks/bench_lifetime.py --out $OUT (about 2 minutes on the H200, estimated:
model builds in seconds, ~0.2 s a call).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from card import ALLOC_CONF_VARS, error_fields, say  # noqa: E402
from common import environment, print_table, result_path, write_json  # noqa: E402
from lifetime_interrupt import interrupt  # noqa: E402
from lifetime_measure import DEVICE_TOLERANCE, MiB  # noqa: E402
from lifetime_repeat import FLAT_FROM_CALL, RSS_TOLERANCE, repeat  # noqa: E402

GPU_SHAPE = dict(
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=16384,
)
CPU_SHAPE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=211,
    max_position_embeddings=2048,
)


def build_model(shape: dict, dtype: Any, device: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**shape, attn_implementation="sdpa")
    cfg.pad_token_id, cfg.eos_token_id = 0, None
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    with torch.no_grad():  # near-uniform random logits made peaked: argmax robust (as the tests)
        model.lm_head.weight.mul_(8.0)
    return model


# --- choosing a budget that streams layers --------------------------------------------------------


def choose_budget(
    model: Any,
    ids: Any,
    new_tokens: int,
    cuda: bool,
    attempts: list[dict],
    residual: str = "auto",
) -> tuple[Any, int]:
    """A manager whose budget streams layers in decode, and the budget (attempts recorded)."""
    import reviva

    prompt = ids.shape[1]
    n = model.config.num_hidden_layers
    budget = None
    layer_kv = None
    manager = reviva.RevivaManager(model, reviva.RevivaConfig(prefill_residual=residual))
    try:
        from reviva.plan.memory_state import device_state
        from reviva.plan.planner import smallest_budget

        # The planner's own inverse: the smallest budget whose plan holds half the layers'
        # K/V on the device (resident layers and staging slots), so that the rest streams.
        budget = smallest_budget(
            manager.layout,
            manager.config,
            device_state(manager.layout, manager.arena),
            1,
            prompt,
            new_tokens,
            lambda p: len(p.resident_layers) + p.slots >= max(1, n // 2),
        )
        layer_kv = manager.plan(1, prompt, new_tokens).layer_kv_bytes
        attempts.append({"from": "planner.smallest_budget", "budget": budget})
    except Exception as e:  # the planner API changed: a rougher start below
        attempts.append({"from": "planner.smallest_budget", **error_fields(e)})
        budget = None
    if budget is None:
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        head_dim = model.config.hidden_size // model.config.num_attention_heads
        layer_kv = (2 * (prompt + new_tokens) * model.config.num_key_value_heads * head_dim) * next(
            model.parameters()
        ).element_size()
        budget = weights + 96 * MiB + (n // 2) * layer_kv
        attempts.append({"from": "weights + 96 MiB + half the K/V", "budget": budget})
    assert layer_kv is not None
    for _ in range(2 * n):
        config = reviva.RevivaConfig(vram_budget=budget, prefill_residual=residual)
        manager = reviva.RevivaManager(model, config)
        rec: dict[str, Any] = {"budget": budget}
        try:
            manager.generate(ids, max_new_tokens=new_tokens, do_sample=False)
            st = manager.get_memory_stats()
            rec.update(
                streamed_layers=st.get("streamed_layers"),
                resident_layers_in_prefill=st.get("resident_layers_in_prefill"),
            )
        except Exception as e:
            rec.update(error_fields(e))
        attempts.append(rec)
        if rec.get("error") and rec.get("oom"):
            budget += layer_kv // 2  # too small after all: a little more
            continue
        if rec.get("error"):
            raise RuntimeError(f"generate failed while choosing a budget: {rec['error']}")
        if (rec.get("streamed_layers") or 0) > 0:
            return manager, budget
        budget -= layer_kv
    raise RuntimeError(f"no budget streamed a layer: {attempts}")


# --- entry ----------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--gc-calls", type=int, default=10)
    parser.add_argument("--prompt", type=int, default=None, help="default 8192 (CPU: 256)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--cpu", action="store_true", help="the CPU fallback even with a GPU")
    parser.add_argument(
        "--interrupt-dtypes", default=None, help="default float32,bfloat16 (CPU: float32)"
    )
    parser.add_argument(
        "--prefill-residual",
        default="auto",
        choices=("auto", "device", "host"),
        help="RevivaConfig.prefill_residual of every manager (host: the prompt's hidden states "
        "in pinned host memory through prefill)",
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default="lifetime")
    args = parser.parse_args()
    removed = {k: os.environ[k] for k in ALLOC_CONF_VARS if k in os.environ}
    if removed:  # torch's allocator at its defaults, as a user has it: a fresh process without
        env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS}
        env["REVIVA_BENCH_REMOVED_ALLOC_CONF"] = repr(removed)
        os.execve(sys.executable, [sys.executable, *sys.argv], env)

    import torch

    cuda = torch.cuda.is_available() and not args.cpu
    device = "cuda" if cuda else "cpu"
    shape = GPU_SHAPE if cuda else CPU_SHAPE
    prompt = args.prompt or (8192 if cuda else 256)
    dtypes = args.interrupt_dtypes or ("float32,bfloat16" if cuda else "float32")
    env = environment()
    path = result_path(args.name, env, Path(args.out) if args.out else None)
    payload: dict[str, Any] = {
        "environment": env,
        "complete": False,
        "model": {**shape, "lm_head_scaled_by": 8.0, "weights": "random init"},
        "settings": {
            "device": device,
            "prompt_tokens": prompt,
            "new_tokens": args.new_tokens,
            "calls": args.calls,
            "gc_calls": args.gc_calls,
            "repeat_dtype": "bfloat16" if cuda else "float32",
            "interrupt_dtypes": dtypes.split(","),
            "allocator": "torch defaults (" + ", ".join(ALLOC_CONF_VARS) + " unset)",
            "removed_alloc_conf": os.environ.get("REVIVA_BENCH_REMOVED_ALLOC_CONF"),
            "flat_from_call": FLAT_FROM_CALL,
            "prefill_residual": args.prefill_residual,
            "device_tolerance_bytes": DEVICE_TOLERANCE,
            "rss_tolerance": RSS_TOLERANCE,
        },
        "checks": {},
    }
    write_json(path, payload)
    say(f"# lifetime on {device}; writing {path}")

    # repeat_100
    dtype = torch.bfloat16 if cuda else torch.float32
    model = build_model(shape, dtype, device)
    gen = torch.Generator(device=device).manual_seed(0)
    ids = torch.randint(1, shape["vocab_size"], (1, prompt), device=device, generator=gen)
    hf_tokens = model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False)[
        0, prompt:
    ].tolist()
    attempts: list[dict] = []
    budget = None
    try:
        manager, budget = choose_budget(
            model, ids, args.new_tokens, cuda, attempts, args.prefill_residual
        )
        payload["settings"]["budget_bytes"] = budget
        payload["budget_attempts"] = attempts
        say(f"# repeat: budget {budget} bytes ({attempts[-1]})")
        result = repeat(
            manager, model, ids, args.new_tokens, args.calls, args.gc_calls, cuda, hf_tokens
        )
        del manager
    except Exception as e:
        result = {"pass": False, **error_fields(e)}
        payload["budget_attempts"] = attempts
    payload["checks"]["repeat_100"] = {k: v for k, v in result.items() if k != "records"}
    payload["repeat_records"] = result.get("records")
    write_json(path, payload)
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()

    # interrupt, per dtype, each on a fresh model
    per_dtype = {}
    for name in dtypes.split(","):
        model = build_model(shape, getattr(torch, name), device)
        dtype_attempts: list[dict] = []
        try:
            # Chosen again for each model: what the device holds (its baseline) moved since.
            _, b = choose_budget(
                model, ids, args.new_tokens, cuda, dtype_attempts, args.prefill_residual
            )
            per_dtype[name] = interrupt(
                model, ids, args.new_tokens, b, cuda, name, args.prefill_residual
            )
            per_dtype[name]["budget_attempts"] = dtype_attempts
        except Exception as e:
            per_dtype[name] = {"pass": False, **error_fields(e)}
        del model
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        payload["checks"]["interrupt"] = {
            "pass": all(v.get("pass") for v in per_dtype.values()),
            "dtypes": per_dtype,
        }
        write_json(path, payload)

    rep = payload["checks"]["repeat_100"]
    flat = rep.get("flat", {})
    print_table(
        ["check", "pass", "details"],
        [
            [
                "repeat_100",
                rep.get("pass"),
                f"completed {rep.get('all_completed')}, streamed "
                f"{rep.get('streamed_in_every_call')}, allocated spread "
                f"{flat.get('device_allocated_spread_bytes')} B, used spread "
                f"{flat.get('device_used_spread_bytes')} B, rss spread "
                f"{flat.get('rss_spread_bytes')}"
                f" B, survivors ok {rep.get('gc_disabled', {}).get('ok')}",
            ],
            *[
                [
                    f"interrupt {name} {s['scenario']}",
                    s["ok"],
                    f"raised {s['raised']['type']}, restored {s['restored']}, allocated returned "
                    f"{s.get('allocated_returned')}, outside torch returned "
                    f"{s.get('outside_torch_returned')} (torch cache "
                    f"{s.get('torch_cache_change')} B), "
                    f"next tokens ok {s['next_tokens_equal_reference']}",
                ]
                for name, d in per_dtype.items()
                for s in d.get("scenarios", [])
            ],
        ],
    )
    for name, d in per_dtype.items():
        if "error" in d:
            print(f"interrupt {name}: {d['error']}")
    if "error" in rep:
        print(f"repeat_100: {rep['error']}")
    payload["complete"] = True
    write_json(path, payload)
    say(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
