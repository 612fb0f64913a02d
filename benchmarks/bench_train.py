"""A training step with activation offload, on a card of N GB as a user runs it: time against peak
memory.

Model: Llama-shaped, hidden 2048, 16 layers, MLP 8192, 32 heads, 8 K/V heads, vocab 32000, bf16
(1.2B), sequence 8192, forward+backward with labels. Contenders:
    plain              no offload
    save_on_cpu        torch.autograd.graph.save_on_cpu(pin_memory=True)
    reviva_all         reviva.offload_activations with one ActivationOffload (offload-all,
                       default min_bytes 0: every saved tensor); reviva_all_min1024K:
                       tensors under 1 MiB stay on the device; reviva_all_arena: the
                       blocks brought back in Reviva's arena (memory="arena") instead of
                       torch's pool
    reviva_<budget>    ActivationOffload(budget=<budget>), e.g. reviva_6GB
    growth             offload-all for --growth-steps steps on one engine: device and pinned
                       memory after each (a leak shows as growth)
Each contender times --steps steps after one warm-up step (the first step's time is recorded
too), then one untimed step from an emptied cache that records the reserved peak and where memory
grows (allocated and reserved at each layer's forward and backward). The roofline of a step that
offloads A bytes is max(forward, A / D2H bandwidth) + max(backward, A / H2D bandwidth), with
forward and backward from the plain run (the no-card one when there is one) and the bandwidths of
plain 1 GiB pinned copies measured in the plain workers.

Card mode (the default; DESIGN.md, "Measuring as a user runs it")
    python benchmarks/bench_train.py [--card 24GB] [--contenders ...] [--no-card-contenders plain]
        [--steps 5] [--max-wall-s 540] [--out DIR]
Every contender runs in a fresh worker process that takes (device total - N) with cudaMalloc
outside torch's allocator before the model is built, with torch's allocator at its defaults
(PYTORCH_CUDA_ALLOC_CONF and PYTORCH_ALLOC_CONF removed from its environment; no per-process
fraction). A thread polls torch.cuda.mem_get_info every ~2 ms during the steps: card_peak_used_gb
= N - least free seen. Rows are written to the JSON as they arrive.

Checks (the JSON's `checks`):
    train_card     on the card: reviva_all's step <= 0.5x save_on_cpu's, its peak (allocated)
                   <= save_on_cpu's, its step <= 1.05x the roofline; every reviva_<budget>'s
                   peak (allocated) <= its budget. A contender whose blocks live in Reviva's
                   arena adds the arena's peak mapped bytes to torch's peak allocated (an upper
                   bound of the two at once); card_peak_used_gb counts everything.
    offload_all*, reviva_<budget>, no_growth   the earlier figures, from the card runs.
Reproduce: python benchmarks/bench_train.py --out $OUT --max-wall-s 540 (12 workers, ~4.5 min
estimated on the H200; printed first). CPU dry run of every path (tiny model): --dry-run.

In-process mode (the earlier measurement; not how a user runs it): --mode inprocess runs every
contender in this one process with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and no card.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_card_mode import driver, worker  # noqa: E402
from train_contenders import CONTENDERS, DRY_CONTENDERS  # noqa: E402
from train_inprocess import inprocess  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mode", choices=("card", "inprocess"), default="card")
    parser.add_argument("--card", default="24GB", help="card mode: the card's memory")
    parser.add_argument(
        "--contenders", default=None, help=f"default {CONTENDERS} (dry run: {DRY_CONTENDERS})"
    )
    parser.add_argument(
        "--no-card-contenders",
        default="plain",
        help="card mode: contenders also run without a card (plain: the roofline's forward and "
        "backward); '' for none",
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq", type=int, default=None, help="tokens (default 8192; dry run 256)")
    parser.add_argument("--growth-steps", type=int, default=None, help="default 50 (dry run 6)")
    parser.add_argument("--sample-ms", type=float, default=2.0)
    parser.add_argument("--max-wall-s", type=float, default=0.0)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, a tiny model")
    parser.add_argument("--estimate-only", action="store_true")
    parser.add_argument("--no-bandwidth", dest="bandwidth", action="store_false")
    parser.add_argument("--out", default=None)
    parser.add_argument("--name", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--contender", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out_dir = Path(args.out) if args.out else None
    args.seq = args.seq or (256 if args.dry_run else 8192)
    args.growth_steps = args.growth_steps or (6 if args.dry_run else 50)
    args.contenders = (
        args.contenders
        if args.contenders is not None
        else (DRY_CONTENDERS if args.dry_run else CONTENDERS)
    )
    if args.worker:
        return worker(args)
    if args.mode == "inprocess":
        return inprocess(args)
    return driver(args, Path(__file__).resolve())


if __name__ == "__main__":
    sys.exit(main())
