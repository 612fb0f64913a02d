"""prompt_cache_256k: a long prompt's cache saved by one process and continued from by a fresh one
(Note [Saved caches] in reviva/cache/saved.py), in card mode (a 24 GB card, torch's allocator at
its defaults), Llama-3-8B shape, random weights.

Worker `save` (a fresh process): prefill of the `--context` prompt and one new token (the
prefill time, as a user sees it), the returned cache saved with manager.save_cache (its time and
the file's size), then the reference: `--new-tokens` greedy tokens continuing from the returned
cache in that process (which the CPU tests show equal to plain HF's over the whole sequence).
The disk's read rate: dd iflag=direct over the saved file (the page cache never held it: the
save writes with O_DIRECT). Worker `load` (another fresh process): reviva.load_cache, then the
same continuation: the time from opening the file to the first new token, and the tokens.

    python benchmarks/bench_prompt_cache.py [--context 256k] [--kv-dtype fp8] [--dir /tmp]
                                            [--out DIR] [--dry-run]

checks: the first token within max(0.25x the prefill, 1.25x the file's size over dd's read
rate); the loaded call's tokens equal the reference's.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from card import CallTimer, prepare_device, worker_result  # noqa: E402
from common import environment, print_table, write_result  # noqa: E402
from generate_contenders import parse_tokens  # noqa: E402
from generate_model import build_model  # noqa: E402

CARD_BYTES = 24 * 10**9


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import reviva

    cuda = not args.dry_run
    info, ballast, _, _ = prepare_device(None if args.dry_run else CARD_BYTES, cuda)
    if "error" in info:
        return {"error": info["error"]}
    model = build_model(4 if args.dry_run else 32, dry_run=args.dry_run)
    device = "cuda" if cuda else "cpu"
    config = reviva.RevivaConfig(kv_dtype=args.kv_dtype)
    manager = reviva.RevivaManager(model, config)
    sync = torch.cuda.current_stream().synchronize if cuda else None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (1, args.context), generator=g).to(device)
    tail = torch.randint(1, model.config.vocab_size, (1, 64), generator=g).to(device)
    path = Path(args.dir) / "prompt-cache-bench.rkv"
    kw = dict(max_new_tokens=args.new_tokens, do_sample=False, return_dict_in_generate=True)
    out: dict[str, Any] = {"card": info, "gpu": torch.cuda.get_device_name() if cuda else None}
    if args.worker == "save":
        path.unlink(missing_ok=True)
        timer = CallTimer(sync)
        timer.begin()
        first = manager.generate(
            ids, max_new_tokens=1, do_sample=False, return_dict_in_generate=True, streamer=timer
        )
        out["prefill_s"] = timer.prefill_s
        t0 = time.perf_counter()
        out["file_bytes"] = manager.save_cache(first, path)
        out["save_s"] = time.perf_counter() - t0
        more = torch.cat([first.sequences, tail], dim=1)
        ref = manager.generate(more, past_key_values=first.past_key_values, **kw)
        out["tokens"] = ref.sequences[0, more.shape[1] :].tolist()
        torch.save(first.sequences.cpu(), path.with_suffix(".ids"))
    else:
        more = torch.cat([torch.load(path.with_suffix(".ids")).to(device), tail], dim=1)
        timer = CallTimer(sync)
        t0 = time.perf_counter()
        loaded = reviva.load_cache(path)
        out["open_s"] = time.perf_counter() - t0
        timer_start = time.perf_counter()
        timer.begin()
        got = manager.generate(more, past_key_values=loaded, streamer=timer, **kw)
        out["first_token_s"] = (timer_start - t0) + (timer.prefill_s or 0.0)
        out["decode_tok_s"] = timer.decode_tok_s
        out["tokens"] = got.sequences[0, more.shape[1] :].tolist()
        out["stats"] = manager.get_memory_stats().to_dict()
    del ballast
    return out


def dd_read_gbps(path: Path) -> float:
    run = subprocess.run(
        ["dd", f"if={path}", "of=/dev/null", "bs=1M", "iflag=direct"],
        capture_output=True,
        text=True,
    )
    m = re.search(r"^(\d+) bytes .* copied, ([0-9.]+) s", run.stderr, re.M)
    if run.returncode != 0 or not m:
        raise RuntimeError(f"dd: {run.stderr.strip()}")
    return int(m.group(1)) / float(m.group(2)) / 1e9


def run_worker(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        name,
        "--context",
        str(args.context),
        "--kv-dtype",
        args.kv_dtype,
        "--dir",
        args.dir,
        "--new-tokens",
        str(args.new_tokens),
    ]
    if args.dry_run:
        cmd.append("--dry-run")
    return worker_result(cmd, name, args.timeout_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=parse_tokens, default=256 * 1024)
    p.add_argument("--kv-dtype", default="auto", choices=("auto", "fp8"))
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--timeout-s", type=float, default=560)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU")
    p.add_argument("--worker", choices=("save", "load"), default=None)
    args = p.parse_args(argv)
    if args.worker:
        print("RESULT " + json.dumps(worker(args), default=str), flush=True)
        return 0
    env = environment(cuda=False)
    saved = run_worker("save", args)
    path = Path(args.dir) / "prompt-cache-bench.rkv"
    result: dict[str, Any] = {
        "environment": env,
        "scenario": "prompt_cache",
        "config": vars(args) | {"out": str(args.out)},
        "save": saved,
    }
    checks: dict[str, bool] = {}
    if "error" not in saved:
        result["dd_read_gbps"] = dd_read_gbps(path)
        loaded = run_worker("load", args)
        result["load"] = loaded
        if "error" not in loaded:
            bound = max(
                0.25 * saved["prefill_s"], 1.25 * saved["file_bytes"] / 1e9 / result["dd_read_gbps"]
            )
            result["first_token_bound_s"] = bound
            checks["first_token_within_bound"] = loaded["first_token_s"] <= bound
            checks["same_tokens_as_the_uninterrupted_call"] = loaded["tokens"] == saved["tokens"]
            print_table(
                [
                    "context",
                    "prefill s",
                    "save s",
                    "file GB",
                    "dd read GB/s",
                    "first token s",
                    "bound s",
                ],
                [
                    [
                        args.context,
                        saved["prefill_s"],
                        saved["save_s"],
                        saved["file_bytes"] / 1e9,
                        result["dd_read_gbps"],
                        loaded["first_token_s"],
                        bound,
                    ]
                ],
            )
    path.unlink(missing_ok=True)
    path.with_suffix(".ids").unlink(missing_ok=True)
    result["checks"] = checks
    name = "prompt-cache-dry" if args.dry_run else f"prompt-cache-{args.context // 1024}k"
    print("wrote", write_result(name, result, args.out))
    print(json.dumps(checks))
    return 0 if checks and all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
