"""card24_256k_disk: streamed K/V spilled to disk (RevivaConfig(offload_device="disk"), Note
[Spilled layers] in src/kv_store_disk.cpp), in card mode (a 24 GB card, torch's allocator at its
defaults), Llama-3-8B shape, random weights, bf16.

Worker `pinned` (a fresh process): the call with every streamed layer's K/V in pinned host
memory (the reference tokens). Worker `disk` (another fresh process): the same call with
host_memory set so that at least half of the K/V spills (--host-memory; default 17GB: 22 of the
32 layers spilled at 256k, of which the 4 promoted after prefill come back to the device, 18 read
from disk each step), run --calls times (the first call is a process's first).
The disk's read rate: dd iflag=direct over a 4 GB file written in --dir (the same disk as the
spill's file), measured in the same run.

    python benchmarks/bench_disk_spill.py [--context 256k] [--new-tokens 6] [--calls 2]
                                          [--host-memory 21.5GB] [--dir /tmp] [--out DIR]
                                          [--dry-run]

checks: every disk call completes with the pinned call's tokens; at least half of the K/V on
disk in decode; each call's decode within 1.25x the roofline of the slowest tier: the bytes
its steps read from disk (every spilled layer's valid prefix, each step) over dd's read rate.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompt_cache import dd_read_gbps  # noqa: E402
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
    model = build_model(10 if args.dry_run else 32, dry_run=args.dry_run)
    device = "cuda" if cuda else "cpu"
    if args.worker == "pinned":
        config = reviva.RevivaConfig()
    else:
        config = reviva.RevivaConfig(
            offload_device="disk", disk_path=args.dir, host_memory=args.host_memory
        )
    if args.dry_run:  # (on the CPU, the budget whose plan keeps two layers of K/V: the rest stream)
        from reviva.plan.memory_state import device_state
        from reviva.plan.planner import smallest_budget

        probe = reviva.RevivaManager(model, config)
        budget = smallest_budget(
            probe.layout,
            config,
            device_state(probe.layout, probe.arena),
            1,
            args.context,
            args.new_tokens,
            lambda plan: len(plan.resident_layers) + plan.slots >= 2,
        )
        config = reviva.RevivaConfig(**{**config.__dict__, "vram_budget": budget})
    manager = reviva.RevivaManager(model, config)
    sync = torch.cuda.current_stream().synchronize if cuda else None
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, model.config.vocab_size, (1, args.context), generator=g).to(device)
    out: dict[str, Any] = {
        "card": info,
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "config": repr(config),
        "calls": [],
        # K and V of one token of one layer, in bytes
        "kv_token_bytes": 2
        * model.config.num_key_value_heads
        * getattr(
            model.config, "head_dim", model.config.hidden_size // model.config.num_attention_heads
        )
        * next(model.parameters()).dtype.itemsize,
    }
    for _ in range(1 if args.worker == "pinned" else args.calls):
        timer = CallTimer(sync)
        timer.begin()
        got = manager.generate(ids, max_new_tokens=args.new_tokens, do_sample=False, streamer=timer)
        st = manager.get_memory_stats().to_dict()
        keep = (
            "decode_steps decode_s decode_tok_s prefill_s streamed_layers resident_layers "
            "promoted_layers disk_layers disk_staged_layers disk_peak_staged_layers disk_bytes "
            "disk_reads disk_staging_hits bytes_from_disk bytes_to_disk disk_wait_s disk_file "
            "disk_io_uring disk_direct_io layer_kv_bytes peak_vram_bytes"
        ).split()
        out["calls"].append(
            {
                "tokens": got[0, ids.shape[1] :].tolist(),
                "prefill_s": timer.prefill_s,
                "decode_tok_s": timer.decode_tok_s,
                "stats": {k: st.get(k) for k in keep},
            }
        )
    del ballast
    return out


def run_worker(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--worker", name, "--context", str(args.context)]
    cmd += ["--dir", args.dir, "--new-tokens", str(args.new_tokens), "--calls", str(args.calls)]
    cmd += ["--host-memory", args.host_memory]
    if args.dry_run:
        cmd.append("--dry-run")
    try:
        return worker_result(cmd, name, args.timeout_s)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        text = out.decode(errors="replace") if isinstance(out, bytes) else str(out)
        return {"error": f"worker {name} ran past {args.timeout_s} s", "tail": text[-4000:]}


def disk_read_gbps(folder: str, gb: int) -> float:
    """dd iflag=direct over a file of `gb` GB written (O_DIRECT) in `folder`, then removed."""
    path = Path(folder) / "disk-spill-bench.dd"
    try:
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={path}", "bs=1M", f"count={gb * 1024}", "oflag=direct"],
            check=True,
            capture_output=True,
        )
        return dd_read_gbps(path)
    finally:
        path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--context", type=parse_tokens, default=256 * 1024)
    p.add_argument("--new-tokens", type=int, default=6)
    p.add_argument("--calls", type=int, default=2)
    p.add_argument("--host-memory", default="17GB")
    p.add_argument("--dir", default="/tmp")
    p.add_argument("--timeout-s", type=float, default=560)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true", help="a tiny model on the CPU")
    p.add_argument("--worker", choices=("pinned", "disk"), default=None)
    args = p.parse_args(argv)
    if args.dry_run and args.host_memory == "17GB":
        args.host_memory = "700KB"
    if args.worker:
        print("RESULT " + json.dumps(worker(args), default=str), flush=True)
        return 0
    result: dict[str, Any] = {
        "environment": environment(cuda=False),
        "scenario": "card24_256k_disk",
        "config": vars(args) | {"out": str(args.out)},
        "dd_read_gbps": disk_read_gbps(args.dir, 1 if args.dry_run else 4),
    }
    pinned = run_worker("pinned", args)
    disk = run_worker("disk", args)
    result["pinned"], result["disk"] = pinned, disk
    checks: dict[str, bool] = {}
    if "error" not in pinned and "error" not in disk:
        ref = pinned["calls"][0]["tokens"]
        rows = []
        for i, call in enumerate(disk["calls"]):
            st = call["stats"]
            # the bytes decode's steps read from disk (each step, every spilled layer's valid
            # prefix: the prompt and the tokens so far) over dd's rate
            steps = st["decode_steps"]
            tokens = sum(args.context + 1 + k for k in range(steps))
            step_bytes = st["disk_layers"] * tokens * disk["kv_token_bytes"]
            call["decode_disk_bytes"] = step_bytes
            roofline_s = step_bytes / 1e9 / result["dd_read_gbps"]
            call["roofline_s"] = roofline_s
            call["decode_over_roofline"] = st["decode_s"] / roofline_s if roofline_s else None
            checks[f"call{i + 1}_same_tokens_as_pinned"] = call["tokens"] == ref
            checks[f"call{i + 1}_half_of_the_kv_on_disk"] = (
                2 * st["disk_layers"] >= st["streamed_layers"] + st["resident_layers"]
                if st["streamed_layers"] is not None
                else False
            )
            checks[f"call{i + 1}_decode_within_1.25x_roofline"] = (
                call["decode_over_roofline"] is not None and call["decode_over_roofline"] <= 1.25
            )
            rows.append(
                [
                    i + 1,
                    call["prefill_s"],
                    st["decode_s"],
                    st["disk_layers"],
                    st["bytes_from_disk"] / 1e9,
                    roofline_s,
                    call["decode_over_roofline"],
                ]
            )
        print_table(
            ["call", "prefill s", "decode s", "disk layers", "GB from disk", "roofline s", "x"],
            rows,
        )
    result["checks"] = checks
    name = "disk-spill-dry" if args.dry_run else f"disk-spill-{args.context // 1024}k"
    print("wrote", write_result(name, result, args.out))
    print(json.dumps(checks))
    return 0 if checks and all(checks.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
