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
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generate_driver import card_driver  # noqa: E402
from generate_fraction import fraction_driver, fraction_worker, merge_fraction  # noqa: E402
from generate_model import DRY_SHAPE, SHAPE  # noqa: E402
from generate_report import merge_card  # noqa: E402
from generate_warmup import prime_attention  # noqa: E402
from generate_worker import card_worker  # noqa: E402

# 16MB: the tiny model's weights and working set, and K/V streamed through one slot at 256
# tokens; at 512 tokens Reviva refuses the budget (RevivaOutOfMemoryError): both paths run.
DRY_DEFAULTS = {"contexts": "256,512", "card": "16MB"}


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
        return fraction_driver(args, __file__)
    if args.dry_run:
        args.contexts = args.contexts or DRY_DEFAULTS["contexts"]
        args.card = args.card or DRY_DEFAULTS["card"]
    args.contexts = args.contexts or "64k"
    args.card = args.card or "24GB"
    if args.contenders is None:
        args.contenders = "reviva,hf,hf_offload,reviva_default"
    return card_driver(args, Path(__file__).resolve())


if __name__ == "__main__":
    sys.exit(main())
