"""`python -m reviva demo`: a long prompt through a random-init Llama-shaped model, with and
without Reviva, and a table of what each used and how fast it ran.

On a GPU: a 1B-shaped model (Llama-3.2-1B: hidden 2048, 16 layers, 32 query / 8 K/V heads,
MLP 8192) in bf16, a 32k-token prompt, and a budget of the weights plus a small prefill working
set plus half of the K/V cache, so that about half the layers' K/V stream from pinned host
memory. On a CPU: a small model of the same shape in fp32 and a 4k-token prompt, on the host
backend (threads play the CUDA streams). Plain HF runs first without any cap; fp32 must give the
same tokens, bf16 the same first-token logits within 1e-2.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DemoShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    mlp: int
    vocab: int
    dtype: torch.dtype
    prompt: int
    new_tokens: int


def pass_key_text(key: int, filler_repeats: int = 40) -> str:
    """A pass key buried in filler (about 2k tokens of SmolLM2's tokenizer at 40 repeats each
    side), ending in the question: a real model retrieves it with attention peaked on one spot,
    which random weights cannot check (tests/python/test_real_model.py)."""
    filler = (
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
    )
    return (
        filler * filler_repeats
        + f"The pass key is {key}. Remember it. {key} is the pass key. "
        + filler * filler_repeats
        + "What is the pass key? The pass key is"
    )


GPU_SHAPE = DemoShape(2048, 16, 32, 8, 8192, 32000, torch.bfloat16, 32768, 32)
CPU_SHAPE = DemoShape(512, 8, 8, 4, 1536, 4096, torch.float32, 4096, 32)


def _model(shape: DemoShape, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.mlp,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=2 * shape.prompt,
        pad_token_id=0,
        eos_token_id=None,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=shape.dtype)
    return model.eval()


def run_demo(args: argparse.Namespace) -> int:
    import reviva
    from reviva.planner import device_state, smallest_budget
    from reviva.timing import GenerationTimer

    cuda = torch.cuda.is_available() and reviva.cuda_available()
    device = args.device or ("cuda" if cuda else "cpu")
    on_gpu = device.startswith("cuda")
    shape = GPU_SHAPE if on_gpu else CPU_SHAPE
    if args.prompt:
        shape = DemoShape(**{**shape.__dict__, "prompt": args.prompt})
    if on_gpu:
        props = torch.cuda.get_device_properties(device)
        where = f"{props.name} ({props.total_memory / 2**30:.0f} GiB), CUDA backend"
    else:
        where = "CPU, host backend (threads play the CUDA streams; 'VRAM' is simulated)"
    print(f"reviva {reviva.__version__} (core {reviva.core_version()}) on {where}")

    t0 = time.perf_counter()
    model = _model(shape, device)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"model: Llama-shaped, random init, {params / 1e9:.2f}B parameters, {shape.dtype}, "
        f"{shape.layers} layers; prompt {shape.prompt} tokens, {shape.new_tokens} new tokens "
        f"(built in {time.perf_counter() - t0:.1f} s)"
    )
    ids = torch.randint(
        1,
        shape.vocab,
        (1, shape.prompt),
        device=device,
        generator=torch.Generator(device=device).manual_seed(1),
    )
    kwargs = dict(
        max_new_tokens=shape.new_tokens,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
    )

    timer = GenerationTimer(device)
    with torch.no_grad():  # warm-up (kernels, library handles) so that neither row pays for it
        model.generate(ids[:, :256], max_new_tokens=2, do_sample=False)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats(device)
    timer.begin()
    plain = model.generate(ids, streamer=timer, **kwargs)
    plain_row = {
        "peak": torch.cuda.max_memory_allocated(device) / 1e9 if on_gpu else None,
        "prefill": timer.prefill_s,
        "decode": timer.decode_tok_s,
    }

    # A tight budget: the weights, a small prefill working set (short chunks, attention by query
    # chunks) and half of the K/V, so that about half the layers stream through prefill and
    # decode alike (little memory frees up after prefill to promote them).
    small = reviva.RevivaConfig(chunk_tokens=1024 if on_gpu else 256, prefill_attention="chunked")
    sizing = reviva.RevivaManager(model, small)
    probe = sizing.plan(1, shape.prompt, shape.new_tokens)
    half = probe.num_layers // 2
    budget = smallest_budget(
        sizing.layout,
        small,
        device_state(sizing.layout, sizing.arena),
        1,
        shape.prompt,
        shape.new_tokens,
        lambda p: len(p.resident_layers) + p.slots >= half,
    )
    del sizing
    config = dataclasses.replace(small, vram_budget=budget)
    manager = reviva.RevivaManager(model, config)
    timer.begin()  # the manager's first call: its host copies are pinned while prefill runs
    out = manager.generate(ids, streamer=timer, **kwargs)
    st = manager.get_memory_stats()
    new_plain, new_out = plain.sequences[:, shape.prompt :], out.sequences[:, shape.prompt :]
    same = torch.equal(new_out, new_plain)
    agree = (new_out == new_plain).float().mean().item()
    if shape.dtype == torch.float32:
        # fp32: Reviva's prefill makes the same calls as HF's on each row; the same tokens.
        ok, accuracy = same, ""
    else:
        # bf16: Reviva's chunked prefill runs other attention kernels than HF's whole-prompt
        # call, which round differently; both are held to an fp32 run of the same weights, and
        # Reviva must be about as close to it as plain HF is.
        exact = fp32_reference_logits(model, ids)[:, -1]
        err_hf = relative_error(plain.logits[0], exact)
        err_rv = relative_error(out.logits[0], exact)
        ok = err_rv <= 1.5 * err_hf
        between = relative_error(out.logits[0], plain.logits[0])
        accuracy = (
            f"; first-token logits relative error vs an fp32 run: plain HF {err_hf:.1e}, "
            f"Reviva {err_rv:.1e} (Reviva vs HF {between:.1e})"
        )

    def gb(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.2f} GB"

    def num(x: float | None, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    rows = [
        (
            "plain HF (no cap)",
            gb(plain_row["peak"]),
            num(plain_row["prefill"], ".2f"),
            num(plain_row["decode"], ".1f"),
            f"{probe.num_layers * probe.layer_kv_bytes / 1e9:.2f} GB",
            "-",
            "-",
        ),
        (
            f"Reviva ({budget / 1e9:.2f} GB budget)",
            gb(None if st["peak_vram_mb"] is None else st["peak_vram_mb"] * 2**20 / 1e9),
            num(timer.prefill_s, ".2f"),
            num(timer.decode_tok_s, ".1f"),
            f"{st['kv_device_mb'] * 2**20 / 1e9:.2f} GB",
            f"{st['vram_saved_mb'] * 2**20 / 1e9:.2f} GB",
            f"{st['overlap_ratio']:.3f}",
        ),
    ]
    head = ("", "peak VRAM", "prefill s", "decode tok/s", "K/V on device", "VRAM saved", "overlap")
    widths = [max(len(str(r[i])) for r in (head, *rows)) for i in range(len(head))]
    for r in (head, *rows):
        print(
            "  ".join(
                str(c).rjust(w) if i else str(c).ljust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    print(
        f"Reviva: {st['resident_layers']} of {probe.num_layers} layers' K/V resident, "
        f"{st['streamed_layers']} streamed through {st['slots']} slots (prefetch window "
        f"{st['prefetch_window']}); {st['bytes_to_device'] / 1e9:.2f} GB to the device, "
        f"{st['bytes_to_host'] / 1e9:.2f} GB to the host; compute stalled {st['stall_ms']:.1f} ms"
    )
    print(
        f"same new tokens as plain HF: {'yes' if same else 'no'} ({agree:.1%} agree){accuracy} "
        f"-> {'OK' if ok else 'FAILED'}"
    )
    print(f"total {time.perf_counter() - t0:.1f} s")
    return 0 if ok else 1


def relative_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.float(), ref.float()
    return ((a - ref).norm() / ref.norm()).item()


def fp32_reference_logits(model: Any, ids: torch.Tensor, keep: int = 1) -> torch.Tensor:
    """The logits of the last `keep` positions of `ids` with the model's weights in fp32, [B,
    keep, vocab]: the reference that bf16 runs (HF's and Reviva's) are both held to. Each weight
    gets its own bf16 storage back afterwards, so the model is left exactly as it was.

    Attention runs a fused kernel (CUDA: memory-efficient; fp32, no score matrix) on K/V heads
    expanded by HF's repeat_kv: with grouped heads left to SDPA, fp32 falls to the math kernel,
    whose [heads, n, n] scores are 128 GiB at 32k tokens."""
    from unittest import mock

    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers.integrations import sdpa_attention

    saved = [(p, p.data) for p in model.parameters()]
    try:
        for p, data in saved:
            p.data = data.float()
        with (
            torch.no_grad(),
            mock.patch.object(sdpa_attention, "use_gqa_in_sdpa", lambda *a, **k: False),
            sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.FLASH_ATTENTION]),
        ):
            return model(ids, logits_to_keep=keep).logits.float()
    finally:
        for p, data in saved:
            p.data = data
