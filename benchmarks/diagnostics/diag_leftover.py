"""Device diag (H200, c53e840): what a call leaves behind: pinned bytes in use after calls with and
without a returned cache, in device and host residual modes; torch's allocated bytes after each of
four calls of a Mistral 1B-width model (the fourth on a new manager) and the new blocks by stream.
Run: python3 benchmarks/diagnostics/diag_leftover.py (mem_snapshot.pickle to $OUT)."""

import argparse
import gc
import os
import pickle
import sys
from collections import Counter
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, MistralConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "python"))
from test_generate import gpu_llama

import reviva
from reviva import RevivaConfig, RevivaManager
from reviva.plan.memory_state import device_state


def blocks():
    out = []
    for seg in torch.cuda.memory_snapshot():
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out.append((seg["stream"], b["size"]))
    return out


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    model = gpu_llama(3, 8192, torch.bfloat16)
    ids = torch.randint(1, 32000, (2, 5000), device="cuda")
    kwargs = dict(max_new_tokens=6, do_sample=False, output_logits=True)
    for mode in ("device", "host"):
        m = RevivaManager(
            model,
            RevivaConfig(chunk_tokens=1024, prefill_residual=mode, prefill_attention="chunked"),
        )
        for rd in (False, True):
            a0 = torch.cuda.memory_allocated()
            out = m.generate(ids, return_dict_in_generate=rd, **kwargs)
            p1 = reviva.pinned_memory_stats()
            del out
            p2 = reviva.pinned_memory_stats()["bytes_in_use"]
            gc.collect()
            p3 = reviva.pinned_memory_stats()["bytes_in_use"]
            torch.cuda.synchronize()
            p4 = reviva.pinned_memory_stats()["bytes_in_use"]
            print(
                mode,
                "return_dict",
                rd,
                "in_use after call",
                p1["bytes_in_use"],
                "after del",
                p2,
                "after gc",
                p3,
                "after sync",
                p4,
                "alloc delta",
                torch.cuda.memory_allocated() - a0,
                "residual",
                m._residual is None,
                "stats",
                {k: v for k, v in p1.items()},
                flush=True,
            )
            if p4:
                objs = [
                    o
                    for o in gc.get_objects()
                    if isinstance(o, torch.Tensor) and o.device.type == "cpu" and o.is_pinned()
                ]
                for o in objs[:10]:
                    print(
                        "  pinned tensor",
                        tuple(o.shape),
                        o.dtype,
                        [type(r).__name__ for r in gc.get_referrers(o)][:5],
                    )
        del m
        gc.collect()
    # baseline growth over a call (the fetch-window test's shape)

    del model
    gc.collect()
    torch.cuda.empty_cache()
    cfg = MistralConfig(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=8,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=32000,
        max_position_embeddings=8192,
        sliding_window=512,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(1, 32000, (1, 4096), device="cuda")

    torch.cuda.memory._record_memory_history(max_entries=100000)
    m = RevivaManager(model, RevivaConfig())
    st0 = device_state(m.layout, m.arena)
    b0 = Counter(blocks())
    print("before", st0, flush=True)
    for i in range(4):
        if i == 3:
            m = RevivaManager(model, RevivaConfig())  # a second manager

        out = m.generate(
            ids,
            max_new_tokens=16,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        st = device_state(m.layout, m.arena)
        print(
            "after call",
            i,
            "baseline +%.1f MB" % ((st.baseline - st0.baseline) / 1e6),
            "reserved",
            torch.cuda.memory_reserved() / 1e6,
            flush=True,
        )
        del out
        gc.collect()
        st = device_state(m.layout, m.arena)
        print("  after del", "baseline +%.1f MB" % ((st.baseline - st0.baseline) / 1e6), flush=True)
        new = Counter(blocks()) - b0
        print(
            "  new blocks (stream, bytes) x count:",
            sorted(new.items(), key=lambda kv: -kv[0][1])[:12],
            flush=True,
        )
    snap = torch.cuda.memory._snapshot()

    with open(os.environ.get("OUT", ".") + "/mem_snapshot.pickle", "wb") as f:
        pickle.dump(snap, f)
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b["size"] >= (1 << 20) and b.get("frames"):
                fr = [
                    f"{x['filename'].split('/')[-1]}:{x['line']}:{x['name']}"
                    for x in b["frames"]
                    if "python" in x["filename"] or x["filename"].endswith(".py")
                ][:6]
                print("  block", b["size"], fr, flush=True)
    print(torch.cuda.memory_summary(abbreviated=True)[:3000])


if __name__ == "__main__":
    main()
