"""A fine-tuned model is the model (DESIGN.md "Trust invariants"): the Llama-3-8B shape with PEFT
LoRA, fine-tuned by reviva.finetune on a 24 GB card (card mode), then `close()`,
`merge_and_unload()`, `save_pretrained()` and a reload from the folder, as a user would.

Checks (the JSON's `checks`):
    closed_tensors_identical   after close(), every tensor of the model (parameters and buffers,
                               LoRA's aside) is bit-identical to the plain model's before finetune,
                               on the device it was on, and none is an expanded placeholder
    closed_loss_equal          plain PEFT's loss after close() (no Reviva) against the trained
                               model's loss under finetune, the same batch: within bf16's noise
    saved_tensors_identical    the reloaded model's tensors: the untouched ones bit-identical to
                               the plain model's; q_proj/v_proj equal to PEFT's own merge of the
                               trained adapters computed apart (bit-identical); its buffers,
                               the unsaved ones too (rotary inv_freq), equal to the merged's
    reloaded_loss_equal        the reloaded model's loss (plain HF, the whole card) against the
                               merged model's before saving: bit-identical, and against the loss
                               under finetune within bf16's noise (the merge rounds to bf16)
Reproduce: python benchmarks/check_finetune_roundtrip.py --out DIR [--tokens 4096 --steps 3]
CPU dry run (a tiny model): --dry-run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_finetune import CARD, DRY_SHAPE, SHAPE, build, data, stream_some  # noqa: E402
from card import gb, prepare_device  # noqa: E402
from common import environment, result_path, write_json  # noqa: E402

# bf16 losses from two computation orders (the chunked loss, HF's whole one): a few bf16 ulps
LOSS_RTOL = 2e-3


def snapshot(model: Any) -> dict[str, Any]:
    """Every tensor of the model by name (LoRA's aside), copied to the host."""
    out = {}
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        if "lora_" not in n:
            out[n] = (t.detach().to("cpu", copy=True), t.device)
    return out


def placeholders(model: Any) -> list[str]:
    return [
        n
        for n, t in [*model.named_parameters(), *model.named_buffers(), *model.state_dict().items()]
        if t.numel() > 1 and 0 in t.stride()
    ]


def plain_key(name: str) -> str:
    """A PEFT model's parameter name as the merged model names it."""
    return name.replace("base_model.model.", "").replace(".base_layer", "")


def host_rotary(model: Any) -> None:
    """The rotary embedding's buffers (inv_freq: not saved, computed again by a reload) as a
    model built on the host computes them, as from_pretrained(...).to("cuda") does. A model
    built under torch.device("cuda") computes them on the GPU: one float32 ulp apart (measured
    on the H100 at 108a154: 3e-8), and the reloaded loss then differed from the merged one by
    1.2e-4, no fault of the round trip's."""
    import torch

    for _, m in model.named_modules():
        if type(m).__name__.endswith("RotaryEmbedding"):
            fresh = type(m)(m.config)  # (on the host: the default device)
            with torch.no_grad():
                for name, buf in fresh.named_buffers(recurse=False):
                    getattr(m, name).copy_(buf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument(
        "--attention-chunk-tokens",
        type=int,
        default=None,
        help="decoder layers by chunks of this many query tokens (default: finetune's)",
    )
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    import reviva

    cuda = not args.dry_run
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    row: dict[str, Any] = {"tokens": args.tokens, "steps": args.steps}
    checks: dict[str, Any] = {}
    info, ballast, _probe, _counted = prepare_device(
        reviva.parse_bytes(CARD) if cuda else None, cuda
    )
    row["device"] = info
    vocab = (DRY_SHAPE if args.dry_run else SHAPE)["vocab_size"]
    t0 = time.perf_counter()
    model = build(args.dry_run, dtype, device)
    host_rotary(model)
    plain = snapshot(model)
    batch = data(args.tokens, vocab, device)
    chunks = (
        {}
        if args.attention_chunk_tokens is None
        else {"attention_chunk_tokens": args.attention_chunk_tokens}
    )
    row["attention_chunk_tokens"] = args.attention_chunk_tokens
    tuner = reviva.finetune(model, budget=CARD if cuda else None, **chunks)
    if not cuda:  # (the host backend has no card: a budget that streams some layers)
        stream_some(tuner, args.tokens)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for _ in range(args.steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    with torch.no_grad():
        trained = float(model(**batch).loss)
    row.update(train_losses=losses, loss_under_finetune=trained)
    row["placeholders_during"] = placeholders(model)
    st = tuner.stats()
    row["streamed_layers"] = st.streamed_layers
    row["layers_by_chunks_refused"] = tuner._chunks_refused
    tuner.close()
    if ballast is not None:  # (the checks after close run on the whole card)
        ballast.free()
        ballast = None

    # after close(): the model is the plain model, its adapters trained
    bad = []
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        if "lora_" in n:
            continue
        ref, where = plain[n]
        if t.device != where or t.dtype != ref.dtype or not torch.equal(t.detach().cpu(), ref):
            bad.append(n)
    row["placeholders_after"] = placeholders(model)
    checks["closed_tensors_identical"] = {
        "tensors": len(plain),
        "differ": bad[:10],
        "passed": not bad and not row["placeholders_after"] and not row["placeholders_during"],
    }
    with torch.no_grad():
        closed = float(model(**batch).loss)
    checks["closed_loss_equal"] = {
        "loss_under_finetune": trained,
        "loss_plain_after_close": closed,
        "passed": math.isclose(closed, trained, rel_tol=LOSS_RTOL),
    }

    # merge, save, reload
    merged = model.merge_and_unload()
    with torch.no_grad():
        merged_loss = float(merged(**batch).loss)
    expected = {n: t.detach().cpu().clone() for n, t in merged.state_dict().items()}
    buffers = {n: t.detach().cpu().clone() for n, t in merged.named_buffers()}  # (unsaved too)
    with tempfile.TemporaryDirectory() as folder:
        t = time.perf_counter()
        merged.save_pretrained(folder)
        row["save_s"] = time.perf_counter() - t
        del model, merged, tuner, optimizer
        if cuda:
            torch.cuda.empty_cache()
        t = time.perf_counter()
        again = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        row["reload_s"] = time.perf_counter() - t
    differ, untouched_differ = [], []
    for n, v in again.state_dict().items():
        if n not in expected or not torch.equal(v.cpu(), expected[n]):
            differ.append(n)
        key = next((k for k in plain if plain_key(k) == n), None)
        if key is not None and not any(p in n for p in ("q_proj", "v_proj")):
            if not torch.equal(v.cpu(), plain[key][0]):
                untouched_differ.append(n)
    buffers_differ = [
        n
        for n, v in again.named_buffers()
        if n not in buffers or not torch.equal(v.cpu(), buffers[n])
    ]
    checks["saved_tensors_identical"] = {
        "tensors": len(expected),
        "differ_from_merge": differ[:10],
        "untouched_differ_from_plain": untouched_differ[:10],
        "buffers_differ_from_merge": buffers_differ[:10],
        "passed": not differ and not untouched_differ and not buffers_differ,
    }
    with torch.no_grad():
        reloaded = float(again(**batch).loss)
    checks["reloaded_loss_equal"] = {
        "loss_merged_before_save": merged_loss,
        "loss_reloaded": reloaded,
        "loss_under_finetune": trained,
        "passed": reloaded == merged_loss and math.isclose(reloaded, trained, rel_tol=LOSS_RTOL),
    }
    row["wall_s"] = time.perf_counter() - t0
    if cuda:
        row["peak_allocated_gb"] = gb(torch.cuda.max_memory_allocated())
    env = environment(cuda)
    payload = {"environment": env, "card": CARD, "run": row, "checks": checks}
    name = "finetune-roundtrip" + ("-dry" if args.dry_run else "")
    path = write_json(result_path(name, env, Path(args.out)), payload)
    for name, c in checks.items():
        print(f"{name:28s} {'pass' if c['passed'] else 'FAIL'}  {json.dumps(c)[:300]}")
    print(f"wrote {path}")
    if not all(c["passed"] for c in checks.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
