"""LoRA fine-tuning of the Llama-3-8B shape at long context on a 24 GB card (reviva.finetune:
Note [Streamed fine-tuning] in python/reviva/train/finetune.py), against the same step on the whole
card (plain HF with gradient checkpointing).

Model: Llama-3-8B shape (hidden 4096, 32 layers, MLP 14336, 32 heads, 8 K/V heads, vocab 128256),
bf16, random weights, PEFT LoRA r=16 on q_proj and v_proj; one sequence, labels = inputs.
Contenders, each in a fresh worker process (torch's allocator at its defaults):
    reviva_<T>        card mode (24 GB: a cudaMalloc ballast of the rest), reviva.finetune(model,
                      budget="24GB"), T tokens
    plain_ckpt_<T>    the whole card, HF's gradient checkpointing (use_reentrant=False), HF's loss
    plain_ckpt_chunked_<T>   the same with the loss by chunks (reviva.train.token_chunks.head_loss):
                      what the whole card does without the [tokens, vocab] logits
    plain_ckpt_card_<T>  plain HF with gradient checkpointing on the 24 GB card
    grads_<T>         the whole card: the LoRA gradients of one step in fp32, plain bf16 and
                      reviva.finetune(budget="10GB") bf16 (about half the layers streamed), at T
                      tokens (the plain runs with HF's gradient checkpointing)
    chunked_<T>       reviva_<T> with attention_chunk_tokens=ATTN_CHUNK (Note [Layers by chunks of
                      query tokens])
    whole_<T>         reviva_<T> with whole layers (attention_chunk_tokens=None)
    reviva_lengths, chunked_lengths   one process, one step at each of LENGTHS in turn (16k,
                      64k, 128k, 64k, 16k): variable lengths keep their residency
A reviva/chunked run reports `layer_rows_measured`: the working set it measured, less the chunks,
in rows of the hidden size per token (train_plan.TrainMemoryModel.layer_rows, what a fit needs);
--layer-rows R plans its steps with that coefficient instead of the model's (fitting a setting
the model was not fitted on: an out-of-memory inside a step is retried, Note [Out of memory
inside a step]).
Each step is timed with the device synchronized (the first step is a warm-up; the rest are
reported, their median is the step time); card_peak_used_gb from a thread polling free memory.

Checks (the JSON's `checks`):
    train_lora_8b_64k    reviva_65536 fits (its steps ran) and its step <= 1.3x plain_ckpt_65536's
                         (or plain_ckpt_chunked_65536's where HF's loss does not fit the whole card)
    train_lora_8b_128k   reviva_131072 fits; its step time reported
    train_lora_8b_128k_first_step   the same, its first step (a fresh process's), retries named
    train_lora_8b_256k   reviva_262144 or chunked_262144 fits; step time beside the forecast
    train_lora_8b_lengths   every step of a *_lengths run fits, and a repeated length's step is
                         no slower than its first (within REPEAT_SLACK)
    train_lora_8b_64k_today   reviva_65536 (or chunked_65536) no slower than TODAY_64K_S of its
                         GPU (within REPEAT_SLACK)
    train_lora_8b_grads  every LoRA gradient of the streamed bf16 run within 1.5x the plain bf16
                         run's distance from fp32 (+ 2^-8 of the gradient's largest entry)
Reproduce: python benchmarks/bench_finetune.py --out DIR [--runs grads_4096,reviva_65536,...]
CPU dry run (a tiny model, every path): --dry-run.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from card import CardSampler, emit, error_fields, gb, prepare_device  # noqa: E402
from common import environment, print_table, result_path, run_worker, write_json  # noqa: E402

from reviva.cli.models import PRESETS  # noqa: E402

# The Llama-3-8B shape: `python -m reviva plan`'s preset, with room for the longest runs.
SHAPE = {k: v for k, v in PRESETS["llama3-8b"].items() if k not in ("architectures", "model_type")}
SHAPE["max_position_embeddings"] = 262144
DRY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=4096,
)
RUNS = "grads_4096,reviva_65536,plain_ckpt_65536,plain_ckpt_chunked_65536,reviva_131072"
DRY_RUNS = "grads_256,reviva_512,plain_ckpt_512,plain_ckpt_chunked_512"
CARD = "24GB"
ATTN_CHUNK = 4096  # chunked_<T>'s attention_chunk_tokens
LENGTHS = (16384, 65536, 131072, 65536, 16384)
DRY_LENGTHS = (64, 256, 512, 256, 64)
REPEAT_SLACK = 1.05  # (step-to-step noise of one process: 2-3% at 64k on the H200)
# A 64k step on a 24 GB card before issue 51 (the figures: H100 at babfbf2, H200 at
# 303b431), by the GPU's name
TODAY_64K_S = {"H100": 14.5, "H200": 15.9}
GRADS_BUDGET = "10GB"
MAX_VS_WHOLE = 1.3
# The whole card's plain run at long context, before this work (the issue): every contender
# ran out of memory at 4k tokens on a 24 GB card.


def build(dry: bool, dtype: Any, device: str) -> Any:
    import peft
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**(DRY_SHAPE if dry else SHAPE), attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(model, lora, autocast_adapter_dtype=False)
    torch.manual_seed(1)
    with torch.no_grad():  # (LoRA's B starts at zero: random, so that every gradient is real)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model.train()


def chunks_of(name: str) -> dict[str, Any]:
    """reviva.finetune's attention_chunk_tokens for a run: chunked_ ATTN_CHUNK, whole_ None
    (whole layers), reviva_ the default."""
    if name.startswith("chunked_"):
        return {"attention_chunk_tokens": ATTN_CHUNK}
    if name.startswith("whole_"):
        return {"attention_chunk_tokens": None}
    return {}


def tokens_of(name: str) -> int:
    return int(name.rsplit("_", 1)[1])


def data(tokens: int, vocab: int, device: str) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(tokens)
    ids = torch.randint(0, vocab, (1, tokens), generator=g).to(device)
    return {"input_ids": ids, "labels": ids.clone()}


def sync(cuda: bool) -> None:
    import torch

    if cuda:
        torch.cuda.synchronize()


def stream_some(tuner: Any, tokens: int) -> None:
    """Dry runs (the host backend has no card): the budget whose plan streams some layers and
    keeps others, so that both paths run."""
    import reviva

    for budget in range(1 << 20, 1 << 34, 1 << 14):
        tuner.budget = budget
        try:
            plan = tuner.plan(tokens)
        except reviva.RevivaOutOfMemoryError:
            continue
        if 0 < len(plan.resident_layers) < tuner.dims.num_layers:
            return
    raise AssertionError("no budget streams some layers and keeps others")


def timed_steps(step: Any, steps: int, cuda: bool, row: dict[str, Any]) -> None:
    times = []
    for _ in range(steps):
        sync(cuda)
        t = time.perf_counter()
        loss = step()
        sync(cuda)
        times.append(time.perf_counter() - t)
        row["loss"] = float(loss)
        row["step_times_s"] = list(times)
        emit("PROGRESS", {"step_s": times[-1]})
    row["first_step_s"] = times[0]
    row["step_s"] = statistics.median(times[1:]) if len(times) > 1 else times[0]


def layer_rows_measured(tuner: Any, tokens: int) -> float | None:
    """The working set measured at `tokens` (CUDA) in rows of the hidden size per token, less
    the chunks and the loss's rows: what train_plan.TrainMemoryModel.layer_rows models."""
    from reviva.train.plan import working_set

    plan = tuner.stats().plan
    chunk = None if plan is None else plan.attention_chunk_tokens
    measured = tuner._measured.get((tokens, chunk))
    if measured is None:
        return None
    d, m = tuner.dims, tuner._model_for(chunk)
    no_rows = dataclasses.replace(m, layer_rows=0.0, loss_rows=0.0)
    chunks = working_set(d, tokens, tuner.chunk_tokens, tuner.loss_chunk_tokens, no_rows)
    return (measured - chunks) / (tokens * d.hidden_size * d.dtype_bytes) - m.loss_rows


def length_steps(
    model: Any, tuner: Any, lengths: tuple[int, ...], vocab: int, device: str, cuda: bool
) -> dict[str, Any]:
    """One step at each of `lengths` in turn, in this process: each one's time, plan and
    retries (Note [Residency across lengths])."""
    steps = []
    for tokens in lengths:
        batch = data(tokens, vocab, device)
        sync(cuda)
        t = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        sync(cuda)
        st = tuner.stats()
        steps.append(
            {
                "tokens": tokens,
                "step_s": time.perf_counter() - t,
                "loss": float(loss),
                "resident_layers": st.resident_layers,
                "oom_retries": st.oom_retries,
                "weight_bytes_to_device": st.weight_bytes_to_device,
            }
        )
        emit("PROGRESS", steps[-1])
    tuner._collect()  # (the last step's working set)
    return {
        "steps": steps,
        "finetune": {k: v for k, v in vars(tuner.stats()).items() if k != "plan"},
    }


def worker(args: argparse.Namespace) -> None:
    import torch

    import reviva
    from reviva.train.plan import forecast_step
    from reviva.train.token_chunks import head_loss

    name = args.worker
    cuda = not args.dry_run
    device = "cuda" if cuda else "cpu"
    lengths = (DRY_LENGTHS if args.dry_run else LENGTHS) if name.endswith("_lengths") else None
    tokens = max(lengths) if lengths else tokens_of(name)
    ours = name.startswith(("reviva_", "chunked_", "whole_"))
    on_card = ours or "_card_" in name
    card = reviva.parse_bytes(CARD) if on_card and cuda else None
    row: dict[str, Any] = {"run": name, "tokens": tokens}
    info, ballast, probe, counted = prepare_device(card, cuda)
    row["device"] = info
    row["gpu"] = torch.cuda.get_device_name() if cuda else None
    if "error" in info:
        emit("WORKER", row)
        return
    vocab = (DRY_SHAPE if args.dry_run else SHAPE)["vocab_size"]
    try:
        sampler = CardSampler(probe, 0.002)
        if name.startswith("grads_"):
            row.update(grads(args, tokens, vocab, device, cuda))
        else:
            model = build(args.dry_run, torch.bfloat16 if cuda else torch.float32, device)
            batch = data(tokens, vocab, device)
            tuner = None
            if ours:
                # (the loss alone is read: no [tokens, vocab] logits beside it, 32 GB at 128k)
                tuner = reviva.finetune(
                    model,
                    budget=CARD if cuda else None,
                    return_logits=False,
                    **chunks_of(name),
                )
                if args.layer_rows is not None:  # (the model of this run's layers)
                    for attr in ("memory_model", "chunked_memory_model"):
                        m = getattr(tuner, attr)
                        setattr(tuner, attr, dataclasses.replace(m, layer_rows=args.layer_rows))
                if not cuda:
                    stream_some(tuner, tokens)
                if lengths:
                    row["lengths"] = list(lengths)
                    row.update(length_steps(model, tuner, lengths, vocab, device, cuda))
                    row["ok"] = True
                    emit("WORKER", row)
                    return

                def step() -> Any:
                    loss = model(**batch).loss
                    loss.backward()
                    model.zero_grad(set_to_none=True)
                    return loss.detach()
            else:
                inner = model.base_model.model
                inner.gradient_checkpointing_enable({"use_reentrant": False})
                inner.config.use_cache = False
                chunked = "chunked" in name

                def step() -> Any:
                    if chunked:
                        h = inner.model(input_ids=batch["input_ids"]).last_hidden_state
                        loss = head_loss(h, inner.lm_head, batch["labels"], 1024)
                    else:
                        loss = model(**batch).loss
                    loss.backward()
                    model.zero_grad(set_to_none=True)
                    return loss.detach()

            if cuda:
                torch.cuda.reset_peak_memory_stats()
            with sampler:
                timed_steps(step, args.steps, cuda, row)
            row["card"] = sampler.summary()
            low = sampler.min_free
            row["card_peak_used_gb"] = None if low is None or not cuda else gb(counted - low)
            if cuda:
                row["peak_allocated_gb"] = gb(torch.cuda.max_memory_allocated())
                row["peak_reserved_gb"] = gb(torch.cuda.max_memory_reserved())
            if tuner is not None:
                st = tuner.stats()
                row["finetune"] = {k: v for k, v in vars(st).items() if k != "plan"}
                row["plan"] = st.plan.to_dict() if st.plan else None
                chunked = st.plan is not None and st.plan.attention_chunk_tokens is not None
                row["forecast"] = forecast_step(
                    tuner.dims, tokens, st.streamed_layers, chunked=chunked
                ).to_dict()
                row["describe"] = tuner.describe()
                row["layer_rows_measured"] = layer_rows_measured(tuner, tokens)
        row["ok"] = True
    except BaseException as e:  # noqa: BLE001
        row.update(error_fields(e))
        row["ok"] = False
        traceback.print_exc()
    finally:
        if ballast is not None:
            ballast.free()
    emit("WORKER", row)


def grads(args: argparse.Namespace, tokens: int, vocab: int, device: str, cuda: bool) -> dict:
    """One step's LoRA gradients in fp32, plain bf16 and Reviva's bf16 (layers streamed under
    GRADS_BUDGET), at the same parameters."""
    import torch

    import reviva

    dtype = torch.bfloat16 if cuda else torch.float32
    model = build(args.dry_run, dtype, device)
    batch = data(tokens, vocab, device)
    model.base_model.model.config.use_cache = False

    # (plain runs checkpoint each layer, HF's way: the fp32 copy's activations of 4k tokens
    # without it, beside both models, ran out of the H200's memory at 921e88f)
    model.base_model.model.gradient_checkpointing_enable({"use_reentrant": False})

    def lora_grads(m: Any) -> dict[str, Any]:
        m(**batch).loss.backward()
        out = {n: p.grad.detach().float().cpu() for n, p in m.named_parameters() if p.requires_grad}
        m.zero_grad(set_to_none=True)
        return out

    plain = lora_grads(model)
    wide = copy.deepcopy(model).float()
    exact = lora_grads(wide)
    del wide
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    model.base_model.model.gradient_checkpointing_disable()
    # (a budget that streams about half the layers at 4k tokens: the streamed path is checked)
    tuner = reviva.finetune(model, budget=GRADS_BUDGET if cuda else None, return_logits=False)
    if not cuda:
        stream_some(tuner, tokens)
    ours = lora_grads(model)
    st = tuner.stats()
    worst = 0.0
    failing = []
    for n, ref in exact.items():
        plain_err = (plain[n] - ref).abs().max().item()
        err = (ours[n] - ref).abs().max().item()
        scale = ref.abs().max().item()
        allowed = 1.5 * plain_err + 2**-8 * scale
        worst = max(worst, err / allowed if allowed > 0 else 0.0)
        if err > allowed:
            failing.append({"param": n, "err": err, "plain_err": plain_err, "scale": scale})
    return {
        "params": len(exact),
        "worst_err_over_allowed": worst,
        "failing": failing[:10],
        "streamed_layers": st.streamed_layers,
        "resident_layers": st.resident_layers,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", default=None, help=f"comma-separated (default: {RUNS})")
    p.add_argument("--steps", type=int, default=2, help="steps per run, the first a warm-up")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--timeout-s", type=float, default=420.0, help="per worker")
    p.add_argument("--layer-rows", type=float, default=None, help="plan with this layer_rows")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    names = (args.runs or (DRY_RUNS if args.dry_run else RUNS)).split(",")
    for n in names:
        sized = n.rsplit("_", 1)[-1].isdigit()
        if n not in ("reviva_lengths", "chunked_lengths") and (
            not sized
            or not n.startswith(("grads_", "reviva_", "chunked_", "whole_", "plain_ckpt_"))
        ):
            raise SystemExit(
                f"unknown run {n!r}: grads_<T>, reviva_<T>, chunked_<T>, whole_<T>, "
                "plain_ckpt[_chunked]_<T>, reviva_lengths, chunked_lengths"
            )
    env = environment(cuda=False)
    out = result_path("finetune" + ("-dry" if args.dry_run else ""), env, args.out)
    payload: dict[str, Any] = {"environment": env, "card": CARD, "shape": SHAPE, "runs": {}}
    for n in names:
        cmd = [sys.executable, __file__, "--worker", n, "--steps", str(args.steps)]
        if args.dry_run:
            cmd.append("--dry-run")
        if args.layer_rows is not None:
            cmd += ["--layer-rows", str(args.layer_rows)]
        t = time.perf_counter()
        row = run_worker(cmd, {}, args.timeout_s)
        row["wall_s"] = time.perf_counter() - t
        payload["runs"][n] = row
        payload["gpu"] = row.get("gpu") or payload.get("gpu")  # (the worker's: CUDA is there)
        payload["checks"] = checks(payload["runs"])
        write_json(out, payload)
    rows = []
    for n, r in payload["runs"].items():
        rows.append(
            [
                n,
                r.get("ok"),
                r.get("step_s"),
                r.get("card_peak_used_gb"),
                r.get("peak_reserved_gb"),
                (r.get("finetune") or {}).get("streamed_layers"),
                r.get("worst_err_over_allowed"),
                (r.get("error") or "")[:60],
            ]
        )
    print_table(
        ["run", "ok", "step s", "card peak GB", "reserved GB", "streamed", "grad err", "error"],
        rows,
    )
    print(json.dumps(payload["checks"], indent=1))
    print(f"wrote {out}")


def checks(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ours = runs.get("reviva_65536")
    if ours is not None:
        whole = runs.get("plain_ckpt_65536")
        label = "plain_ckpt_65536"
        if whole is None or not whole.get("ok"):
            whole, label = runs.get("plain_ckpt_chunked_65536"), "plain_ckpt_chunked_65536"
        ratio = None
        if ours.get("ok") and whole is not None and whole.get("ok"):
            ratio = ours["step_s"] / whole["step_s"]
        out["train_lora_8b_64k"] = {
            "pass": bool(ours.get("ok")) and ratio is not None and ratio <= MAX_VS_WHOLE,
            "fits": bool(ours.get("ok")),
            "step_s": ours.get("step_s"),
            "against": label,
            "whole_card_step_s": whole.get("step_s") if whole else None,
            "ratio": ratio,
            "limit": MAX_VS_WHOLE,
        }
    big = runs.get("reviva_131072")
    if big is not None:
        out["train_lora_8b_128k"] = {
            "pass": bool(big.get("ok")),
            "step_s": big.get("step_s"),
            "card_peak_used_gb": big.get("card_peak_used_gb"),
        }
    if big is not None:
        first = big.get("finetune") or {}
        out["train_lora_8b_128k_first_step"] = {
            "pass": bool(big.get("ok")) and big.get("first_step_s") is not None,
            "first_step_s": big.get("first_step_s"),
            "oom_retries": first.get("oom_retries"),
            "retried_in": first.get("retried_in"),
        }
    for name in ("reviva_262144", "chunked_262144"):
        r = runs.get(name)
        if r is not None and (r.get("ok") or "train_lora_8b_256k" not in out):
            out["train_lora_8b_256k"] = {
                "pass": bool(r.get("ok")),
                "run": name,
                "step_s": r.get("step_s"),
                "forecast_s": (r.get("forecast") or {}).get("step_s"),
                "oom_retries": (r.get("finetune") or {}).get("oom_retries"),
                "error": (r.get("error") or "")[:300] or None,
            }
    for name in ("reviva_lengths", "chunked_lengths"):
        r = runs.get(name)
        if r is None:
            continue
        steps = r.get("steps") or []
        first: dict[int, float] = {}
        slower = []
        for st in steps:
            t0 = first.setdefault(st["tokens"], st["step_s"])
            if st["step_s"] > REPEAT_SLACK * t0:
                slower.append(st)
        out[f"train_lora_8b_lengths ({name})"] = {
            "pass": bool(r.get("ok")) and len(steps) == len(r.get("lengths") or ()) and not slower,
            "steps": [
                (st["tokens"], round(st["step_s"], 3), st["resident_layers"]) for st in steps
            ],
            "slower_than_first": slower,
            "slack": REPEAT_SLACK,
        }
    for name in ("reviva_65536", "chunked_65536"):
        r = runs.get(name)
        gpu = (r or {}).get("gpu") or ""
        today = next((v for k, v in TODAY_64K_S.items() if k in gpu), None)
        if r is not None and today is not None:
            out[f"train_lora_8b_64k_today ({name})"] = {
                "pass": bool(r.get("ok")) and r["step_s"] <= REPEAT_SLACK * today,
                "step_s": r.get("step_s"),
                "today_s": today,
                "gpu": gpu,
            }
    for n, r in runs.items():
        if n.startswith("grads_"):
            out["train_lora_8b_grads"] = {
                "pass": bool(r.get("ok")) and not r.get("failing"),
                "tokens": r.get("tokens"),
                "worst_err_over_allowed": r.get("worst_err_over_allowed"),
                "streamed_layers": r.get("streamed_layers"),
            }
    return out


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
