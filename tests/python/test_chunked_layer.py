"""reviva.finetune(..., attention_chunk_tokens=N): each decoder layer of a training step by
chunks of query tokens (Note [Layers by chunks of query tokens] in train/chunked_layer.py): the loss
and the LoRA gradients as a plain run's, LayerChunks against HF's decoder layer (fp64, GQA, a
per-head norm, trained norms, a dropout replayed), the peak of a step's allocations, and where
HF's own layer runs instead."""

from __future__ import annotations

import copy
import gc
import logging
import weakref
from typing import Any

import pytest
import torch
from test_finetune import (
    assert_bf16_as_close_as_plain,
    assert_close,
    batch,
    layer_budget,
    lora,
    one_thread,  # noqa: F401  (the module's fixture: one thread)
    step,
    tiny_llama,
)
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen3Config

import reviva
from reviva.train import plan as train_plan
from reviva.train.chunk_attention import _kernel
from reviva.train.chunk_attention import chunk_attention as _attention
from reviva.train.chunked_layer import (
    LayerChunks,
    _attention_refusal,
    _chunk_keys_values,
    _query_chunk,
    refusal,
)
from reviva.train.plan import CHUNKED_MODEL, MODEL, plan_step
from reviva.train.token_chunks import chunk_spans

peft = pytest.importorskip("peft", reason="peft (a dev requirement) is needed for LoRA models")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


class Calls:
    """Counts q_proj's calls in each layer: HF's layer calls it once a pass (forward, recompute),
    the chunked one once a chunk (forward, backward)."""

    def __init__(self, tuner: reviva.Finetune) -> None:
        self.n = [0] * len(tuner.layers)
        self.handles = [
            layer.self_attn.q_proj.register_forward_pre_hook(self._count(i))
            for i, layer in enumerate(tuner.layers)
        ]

    def _count(self, i: int) -> Any:
        def hook(module: nn.Module, args: object) -> None:
            self.n[i] += 1

        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("norms", [False, True])
@pytest.mark.parametrize("resident", [0, 1])
@pytest.mark.parametrize("tokens", [50, 96])
def test_lora_gradients_equal_a_plain_runs(resident: int, tokens: int, norms: bool) -> None:
    """Three steps (SGD between them) of a LoRA model on q, k, v, o and the MLP's three
    projections (and, with `norms`, both norms of every layer trained too), two rows of 50 or 96
    tokens, layers by chunks of 16 (50: the last chunk 2 tokens): the loss and every trained
    parameter's gradient as a plain PEFT run's within fp32 rounding (test_finetune's
    tolerances), with 0 and 1 of 3 layers' weights resident; each layer ran by chunks (q_proj
    once a chunk: forward, backward)."""
    base = tiny_llama(seed=21)
    plain = lora(copy.deepcopy(base), ALL + MLP)
    ours = lora(copy.deepcopy(base), ALL + MLP)
    if norms:
        for m in (plain, ours):
            for n, p in m.named_parameters():
                if "layernorm" in n:
                    p.requires_grad_(True)
                    with torch.no_grad():
                        p.normal_(1, 0.2, generator=torch.Generator().manual_seed(len(n)))
    kw: dict[str, Any] = dict(chunk_tokens=16, loss_chunk_tokens=8, attention_chunk_tokens=16)
    budget = layer_budget(ours, tokens * 2, resident, **kw)
    tuner = reviva.finetune(ours, budget=budget, device="cpu", **kw)
    calls = Calls(tuner)
    try:
        for s in range(3):
            data = batch(seed=30 + s, rows=2, tokens=tokens)
            ref_loss, ref = step(plain, data)
            got_loss, got = step(ours, data)
            assert got_loss == pytest.approx(ref_loss, rel=1e-6)
            assert_close(ref, got, rtol=1e-5, atol=1e-7, what=f"step {s}")
            assert tuner.stats().resident_layers == resident
            assert not norms or any("layernorm" in n for n in got)
        chunks = len(chunk_spans(tokens, 16))
        assert calls.n == [3 * 2 * chunks] * 3, calls.n
    finally:
        calls.remove()
        tuner.close()
    assert all("forward" not in layer.__dict__ for layer in tuner.layers)


def decoder_layer(kind: str, dtype: torch.dtype) -> tuple[nn.Module, nn.Module, Any]:
    """(a decoder layer of 6 heads over 2 K/V heads, its rotary embedding, the config)."""
    torch.manual_seed(3)
    common = dict(
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=64,
        max_position_embeddings=128,
    )
    cfg = (Qwen3Config if kind == "qwen3" else LlamaConfig)(**common)
    cfg._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    layer = model.model.layers[0]
    with torch.no_grad():  # (norms that are not all ones: their gradients mean something)
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.2)
    return layer, model.model.rotary_emb, cfg


def rope(rotary: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    return rotary(x, positions)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("chunk", [5, 16, 37])
def test_layer_chunks_equal_hf_layer_in_fp64(kind: str, chunk: int) -> None:
    """LayerChunks against HF's decoder layer (sdpa, GQA 6 heads over 2, Qwen3's q/k norms,
    norms not all ones) in fp64, two rows of 37 tokens by chunks of 5, 16 and 37: the output and
    every parameter's gradient within 1e-10, the input's within 1e-8 (HF's RMSNorm computes in
    fp32 whatever the dtype, and the chunks back-propagate the input norm twice, through the
    queries and through K and V, where HF sums their gradients first: 2.9e-9 measured, the same
    for one chunk of 37)."""
    layer, rotary, _ = decoder_layer(kind, torch.float64)
    for p in layer.parameters():
        p.requires_grad_(True)
    mine = copy.deepcopy(layer)
    x = torch.randn(2, 37, 48, dtype=torch.float64)
    cos, sin = rope(rotary, x)
    dy = torch.randn(2, 37, 48, dtype=torch.float64)

    xr = x.clone().requires_grad_(True)
    ref = layer(xr, position_embeddings=(cos, sin), attention_mask=None)
    ref.backward(dy)
    chunks = LayerChunks(mine, cos, sin, 37, chunk)
    got = chunks.forward(x)
    dx = chunks.backward(x, dy, need_x=True)
    assert not got.requires_grad
    assert torch.allclose(got, ref, rtol=0, atol=1e-10), (got - ref).abs().max()
    assert dx is not None
    assert torch.allclose(dx, xr.grad, rtol=0, atol=1e-8), (dx - xr.grad).abs().max()
    theirs = dict(layer.named_parameters())
    for name, p in mine.named_parameters():
        err = (p.grad - theirs[name].grad).abs().max().item()
        assert err < 1e-10, (name, err)
    for p in mine.parameters():  # (without the input's gradient: the parameters' the same)
        p.grad = None
    assert chunks.backward(x, dy, need_x=False) is None
    for name, p in mine.named_parameters():
        assert (p.grad - theirs[name].grad).abs().max().item() < 1e-10, name


def reference_rows(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: int, e: int, groups: int, **kw: Any
) -> torch.Tensor:
    """Rows s..e of causal attention over the whole sequence (math, GQA by repeat)."""
    kk, vv = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, is_causal=True, **kw)
    return out[:, :, s:e]


@pytest.mark.parametrize("groups", [1, 3, 4])
def test_split_attention_equals_rows_of_whole_causal_attention(groups: int) -> None:
    """fp64 CPU, 2 rows, 2 K/V heads, head_dim 16, 53 tokens by chunks of 11: each chunk's
    attention in two kernel calls (its own keys causal, those before without a mask, merged by
    log-sum-exp) equals the whole causal attention's rows, and its q, K, V gradients equal the
    whole one's (through that chunk's rows alone), within 1e-12; the split path ran (the CPU
    flash kernel)."""
    torch.manual_seed(groups)
    b, kv, t, d = 2, 2, 53, 16
    q = torch.randn(b, kv * groups, t, d, dtype=torch.float64)
    k, v = (
        torch.randn(b, kv, t, d, dtype=torch.float64),
        torch.randn(b, kv, t, d, dtype=torch.float64),
    )
    for s, e in chunk_spans(t, 11):
        assert _kernel(q[:, :, s:e], k[:, :, :e], v[:, :, :e], 0.3) is not None
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        ref = reference_rows(*leaves, s, e, groups, scale=0.3)
        dout = torch.randn_like(ref)
        ref.backward(dout)
        qc = q[:, :, s:e].clone().requires_grad_()
        kc, vc = (x[:, :, :e].clone().requires_grad_() for x in (k, v))
        got = _attention(qc, kc, vc, 0.3, groups)
        assert got.grad_fn is not None and "SplitAttention" in type(got.grad_fn).__name__
        got.backward(dout)
        assert (got - ref).abs().max().item() < 1e-12, (s, e)
        for mine, theirs in (
            (qc.grad, leaves[0].grad[:, :, s:e]),
            (kc.grad, leaves[1].grad[:, :, :e]),
            (vc.grad, leaves[2].grad[:, :, :e]),
        ):
            assert (mine - theirs).abs().max().item() < 1e-12, (s, e)


def budget_for_chunks_only(model: nn.Module, tokens: int, **kw: Any) -> int:
    """A budget where whole layers do not fit a step of `tokens` tokens (one row) even with every
    layer streamed, and layers by chunks do (the planner's own numbers)."""
    probe = reviva.finetune(copy.deepcopy(model), budget="1TB", device="cpu", **kw)
    try:
        dims, held = probe.dims, probe.plan(tokens).held
        args = (dims, tokens, held, probe.chunk_tokens, probe.loss_chunk_tokens)

        def fits(budget: int, memory: Any) -> bool:
            d, t, h, c, lc = args
            try:
                plan_step(d, t, budget, h, c, lc, model=memory, logits=probe.return_logits)
            except reviva.RevivaOutOfMemoryError:
                return False
            return True

        for budget in range(1 << 20, 1 << 34, 1 << 14):
            if fits(budget, CHUNKED_MODEL):
                assert not fits(budget, MODEL)
                return budget
    finally:
        probe.close()
    raise AssertionError("no budget fits layers by chunks")


def test_auto_runs_layers_by_chunks_only_where_whole_ones_do_not_fit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """reviva.finetune's default (attention_chunk_tokens="auto", its chunk shrunk to 16 tokens
    here): with a budget that whole layers of a 96-token step do not fit but chunks do, the step
    runs by chunks of 16 (q_proj once a chunk), its plan says so, and its loss and gradients are
    a plain run's; a 16-token step in the same process runs whole layers (a row no longer than
    a chunk), and a 96-token step after it by chunks again. With attention_chunk_tokens=None
    the same budget refuses the step before any work, naming the numbers; a budget that neither
    fits names the chunks."""
    monkeypatch.setattr(train_plan, "AUTO_CHUNK_TOKENS", 16)
    base = tiny_llama(seed=23)
    plain = lora(copy.deepcopy(base), ALL)
    ours = lora(copy.deepcopy(base), ALL)
    kw: dict[str, Any] = dict(chunk_tokens=16, loss_chunk_tokens=8)
    budget = budget_for_chunks_only(ours, 96, **kw)
    tuner = reviva.finetune(ours, budget=budget, device="cpu", **kw)
    assert tuner.attention_chunk_tokens == "auto"
    calls = Calls(tuner)
    try:
        for s, tokens in enumerate((96, 16, 96)):
            calls.n = [0] * len(calls.n)
            data = batch(seed=90 + s, rows=1, tokens=tokens)
            ref_loss, ref = step(plain, data)
            got_loss, got = step(ours, data)
            assert got_loss == pytest.approx(ref_loss, rel=1e-6)
            assert_close(ref, got, rtol=1e-5, atol=1e-7, what=f"step {s} ({tokens} tokens)")
            plan = tuner.stats().plan
            assert plan is not None
            if tokens == 96:
                assert plan.attention_chunk_tokens == 16
                assert "layers by chunks of 16 query tokens" in tuner.describe()
                assert calls.n == [2 * 6] * 3, calls.n
            else:
                assert plan.attention_chunk_tokens is None
                assert calls.n == [2] * 3, calls.n  # (forward and recompute, whole)
    finally:
        calls.remove()
        tuner.close()
    whole = reviva.finetune(
        lora(copy.deepcopy(base), ALL),
        budget=budget,
        device="cpu",
        attention_chunk_tokens=None,
        **kw,
    )
    try:
        with pytest.raises(reviva.RevivaOutOfMemoryError, match="does not fit a budget") as e:
            whole.plan(96)
        assert "by chunks" not in str(e.value)
    finally:
        whole.close()
    tight = reviva.finetune(lora(copy.deepcopy(base), ALL), budget=budget // 4, device="cpu", **kw)
    try:
        with pytest.raises(reviva.RevivaOutOfMemoryError, match="by chunks of 16 query tokens"):
            tight.plan(96)
    finally:
        tight.close()


def test_lora_dropout_masks_replayed_in_the_backward() -> None:
    """A LoRA dropout (p=0.5) in q, v, o, gate and down, fp64, chunks of 8 of 29 tokens:
    LayerChunks' output and gradients equal the same chunks run with one plain graph from the
    same generator state (each chunk's masks drawn again in its backward, not fresh ones)."""
    layer, rotary, _ = decoder_layer("llama", torch.float64)
    cfg = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"]
    )
    cfg.lora_dropout = 0.5
    holder = nn.Module()
    holder.layer = layer
    model = peft.get_peft_model(holder, cfg, autocast_adapter_dtype=False)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    layer = model.base_model.model.layer
    layer.train()
    x = torch.randn(1, 29, 48, dtype=torch.float64)
    cos, sin = rope(rotary, x)
    dy = torch.randn(1, 29, 48, dtype=torch.float64)
    trained = [p for p in layer.parameters() if p.requires_grad]
    spans = chunk_spans(29, 8)

    def run(chunked: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        for p in trained:
            p.grad = None
        torch.manual_seed(11)
        if chunked:
            chunks = LayerChunks(layer, cos, sin, 29, 8)
            y = chunks.forward(x)
            chunks.backward(x, dy, need_x=False)
        else:  # (the forward's order of draws: every chunk's k/v path, then its query path)
            kv = [_chunk_keys_values(layer, x[:, s:e], cos[:, s:e], sin[:, s:e]) for s, e in spans]
            keys = torch.cat([k for k, _ in kv], dim=2)
            values = torch.cat([v for _, v in kv], dim=2)
            y = torch.cat(
                [
                    _query_chunk(
                        layer, x[:, s:e], keys[:, :, :e], values[:, :, :e], cos[:, s:e], sin[:, s:e]
                    )
                    for s, e in spans
                ],
                dim=1,
            )
            y.backward(dy)
        return y.detach(), [p.grad.clone() for p in trained]

    got, got_grads = run(True)
    ref, ref_grads = run(False)
    assert torch.allclose(got, ref, rtol=0, atol=1e-12)
    for a, b in zip(got_grads, ref_grads, strict=True):
        assert torch.allclose(a, b, rtol=0, atol=1e-12), (a - b).abs().max()
    assert len(trained) == 10
    with torch.no_grad():  # (the masks matter: another draw gives another output)
        torch.manual_seed(12)
        other = LayerChunks(layer, cos, sin, 29, 8).forward(x)
    assert not torch.allclose(other, got)


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes of host tensors made inside the block and alive at once: every op's
    outputs' storages, counted from their making until torch frees them (storage objects are
    kept one per storage, so their finalizers run when the memory goes)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                if id(storage) not in self.seen:
                    self.seen.add(id(storage))
                    self.live += storage.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(storage, self._freed, id(storage), storage.nbytes())
        return out

    def _freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.seen.discard(key)


def test_a_steps_peak_bytes_shrink_by_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Memory proxy on the host: a step of 2048 tokens (hidden 256, 8 heads over 2 K/V heads:
    Llama-3-8B's GQA ratio; 2 layers; LoRA on q, k, v, o; fp32), the peak of the bytes its
    forward and its backward make, in rows of the hidden size per token (the checkpoints on the
    host count: on this backend they are host tensors too). Measured: HF's layers 12.0 rows in
    the forward and 13.9 in the backward; by chunks of 16 query tokens 7.2 and 7.8 (the host's
    SDPA expands K and V to a call's query heads and masks by a [chunk, keys] tensor; CUDA's
    flash kernel does neither)."""
    # (torch's CausalBias is a tensor subclass, which cannot be made under a dispatch mode)
    import reviva.train.chunk_attention as chunk_attention

    own = chunk_attention.causal_lower_right

    def made_outside(*args: int) -> Any:
        with _disable_current_modes():
            return own(*args)

    monkeypatch.setattr(chunk_attention, "causal_lower_right", made_outside)
    tokens = 2048
    torch.manual_seed(4)
    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=896,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=tokens,
        tie_word_embeddings=False,
    )
    base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    rows: dict[int | None, tuple[float, float]] = {}
    row = tokens * 256 * 4
    for chunk in (None, 16):
        model = lora(copy.deepcopy(base), ALL)
        tuner = reviva.finetune(
            model, device="cpu", chunk_tokens=64, loss_chunk_tokens=64, attention_chunk_tokens=chunk
        )
        try:
            with LiveBytes() as forward:
                loss = model(**batch(seed=5, tokens=tokens)).loss
            with LiveBytes() as backward:
                loss.backward()
            rows[chunk] = (forward.peak / row, backward.peak / row)
        finally:
            tuner.close()
    assert rows[None][0] > 11 and rows[None][1] > 13, rows
    assert rows[16][0] < 7.7 and rows[16][1] < 8.3, rows


def padded(data: dict) -> dict:
    """The batch with row 0 left-padded by 5 tokens (HF's mask: not the causal one)."""
    mask = torch.ones_like(data["input_ids"])
    mask[0, :5] = 0
    labels = data["labels"].clone()
    labels[0, :5] = -100
    return {**data, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("case", ["padding", "sliding_window", "eager", "eager_padding"])
def test_where_chunks_apply_and_where_hf_runs(case: str, caplog: pytest.LogCaptureFixture) -> None:
    """A padding mask, Mistral's sliding window of 8 tokens (shorter than the sequence), eager
    with padding: HF's layer runs (q_proj once a pass), said once in the log, and the gradients
    are a plain run's, and the plan is HF's layers' from then on. Eager without padding (its
    causal [T, T] mask is recognized): by chunks, the gradients a plain (eager) run's."""
    if case == "sliding_window":
        torch.manual_seed(8)
        cfg = MistralConfig(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=101,
            sliding_window=8,
        )
        base = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    else:
        extra = {"attn_implementation": "eager"} if case.startswith("eager") else {}
        base = tiny_llama(seed=8, layers=2, **extra)
    plain = lora(copy.deepcopy(base), ALL)
    ours = lora(copy.deepcopy(base), ALL)
    tuner = reviva.finetune(ours, device="cpu", chunk_tokens=16, attention_chunk_tokens=16)
    calls = Calls(tuner)
    chunked = case == "eager"
    try:
        with caplog.at_level(logging.INFO, logger="reviva.finetune"):
            for s in range(2):
                data = batch(seed=40 + s, rows=2, tokens=48)
                if "padding" in case:
                    data = padded(data)
                ref_loss, ref = step(plain, data)
                got_loss, got = step(ours, data)
                assert got_loss == pytest.approx(ref_loss, rel=1e-6)
                assert_close(ref, got, rtol=1e-5, atol=1e-7, what=f"{case}, step {s}")
        said = [r.getMessage() for r in caplog.records if "runs as HF runs it" in r.message]
        if chunked:
            assert calls.n == [2 * 2 * 3] * 2 and not said, (calls.n, said)
            assert tuner.plan(96, 48).attention_chunk_tokens == 16
        else:
            # (HF's layers: the plan of their working set)
            assert tuner.plan(96, 48).attention_chunk_tokens is None
            assert calls.n == [2 * 2] * 2, calls.n  # (forward and recompute, whole)
            assert len(said) == 1, said
            why = "sliding window of 8" if case == "sliding_window" else "other than the causal"
            assert why in said[0], said
    finally:
        calls.remove()
        tuner.close()


def test_attention_dropout_and_other_refusals_named() -> None:
    """What the refusals name. The attention's call: attention dropout in training, a cache,
    cos/sin needing a gradient, eager without a mask (no mask there is no causal mask), a module
    of another layout; the plain causal call is taken (None). The layer's: another class, a
    child more, arguments by position."""
    layer, rotary, cfg = decoder_layer("llama", torch.float32)
    attn = layer.self_attn
    x = torch.randn(1, 20, 48)
    cos, sin = rope(rotary, x)
    assert _attention_refusal(attn, x, (cos, sin), None, None, {}) is None
    attn.train()
    attn.attention_dropout = 0.1
    assert "attention dropout" in _attention_refusal(attn, x, (cos, sin), None, None, {})
    attn.eval()
    assert _attention_refusal(attn, x, (cos, sin), None, None, {}) is None  # (no dropout in eval)
    assert "cache" in _attention_refusal(attn, x, (cos, sin), None, object(), {})
    grad_cos = cos.clone().requires_grad_(True)
    assert "require a gradient" in _attention_refusal(attn, x, (grad_cos, sin), None, None, {})
    assert "non-causal" in _attention_refusal(attn, x, (cos, sin), None, None, {"is_causal": False})
    cfg._attn_implementation = "eager"
    assert "no mask under" in _attention_refusal(attn, x, (cos, sin), None, None, {})
    causal = torch.full((20, 20), torch.finfo(torch.float32).min).triu(1)[None, None]
    assert _attention_refusal(attn, x, (cos, sin), causal, None, {}) is None
    assert "other than the causal" in _attention_refusal(
        attn, x, (cos, sin), causal.transpose(-1, -2), None, {}
    )
    assert "not one of" in _attention_refusal(nn.Linear(2, 2), x, (cos, sin), None, None, {})
    cfg._attn_implementation = "sdpa"
    call = {"position_embeddings": (cos, sin), "attention_mask": None, "position_ids": None}
    assert refusal(layer, x, (), call) is None
    assert "by position" in refusal(layer, x, (None,), call)
    assert "not one of the decoder layers" in refusal(nn.Linear(2, 2), x, (), call)
    layer.extra = nn.Dropout(0.1)
    assert "children" in refusal(layer, x, (), call)
    del layer.extra
    assert "cache" in refusal(layer, x, (), {**call, "past_key_values": object()})
    assert "cache" in refusal(layer, x, (), {**call, "cache": object()})  # (transformers 5.25)


def test_attention_dropout_runs_hfs_attention() -> None:
    """A model with attention dropout in training: HF's layers run in the step (q_proj once a
    pass), and the step runs."""
    model = lora(tiny_llama(seed=9, layers=2, attention_dropout=0.2), ALL)
    tuner = reviva.finetune(model, device="cpu", chunk_tokens=16, attention_chunk_tokens=16)
    calls = Calls(tuner)
    try:
        loss, grads = step(model, batch(seed=2, tokens=48))
        assert calls.n == [2, 2] and all(torch.isfinite(g).all() for g in grads.values())
    finally:
        calls.remove()
        tuner.close()


@pytest.mark.parametrize("bad", [0, -16, 1.5, True, "512", "Auto"])
def test_bad_attention_chunk_tokens_refused_by_name(bad: object) -> None:
    model = lora(tiny_llama(seed=1, layers=1))
    with pytest.raises(
        ValueError, match="attention_chunk_tokens must be an int >= 1, None or 'auto'"
    ):
        reviva.finetune(model, device="cpu", attention_chunk_tokens=bad)  # type: ignore[arg-type]


def gpu_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=101,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


@pytest.mark.gpu
def test_gpu_causal_lower_right_with_gqa_equals_the_rows_of_whole_attention() -> None:
    """CUDA, bf16, head_dim 32, 8 heads over 2: each chunk's attention (flash under
    causal_lower_right with enable_gqa, or K/V expanded) equals the same rows of SDPA's causal
    attention over the whole sequence (fp32), within bf16 rounding."""
    from reviva.train.chunk_attention import _attend

    torch.manual_seed(0)
    q = torch.randn(1, 8, 1500, 32, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 1500, 32, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, 1500, 32, device="cuda", dtype=torch.bfloat16)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, enable_gqa=True
    )
    for s, e in chunk_spans(1500, 512):
        got = _attend(q[:, :, s:e], k[:, :, :e], v[:, :, :e], 32**-0.5, 4)
        err = (got.float() - ref[:, :, s:e]).abs().max().item()
        assert err < 2e-2, (s, e, err)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["default", "FLASH_ATTENTION", "CUDNN_ATTENTION"])
def test_gpu_split_attention_equals_rows_of_whole_attention(backend: str) -> None:
    """CUDA, bf16, head_dim 128, 8 heads over 2 K/V heads, 1500 tokens by chunks of 512, under
    SDPA's default choice and with flash or cuDNN forced: each chunk's attention and its q, K, V
    gradients against the same rows of a whole causal attention in fp32 (math), within bf16
    rounding; the two-call path ran with that kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    t, groups = 1500, 4
    q = torch.randn(1, 8, t, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, t, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(1, 2, t, 128, device="cuda", dtype=torch.bfloat16)
    forced = [] if backend == "default" else [getattr(SDPBackend, backend)]
    for s, e in chunk_spans(t, 512):
        leaves = [x.float().requires_grad_() for x in (q, k, v)]
        ref = reference_rows(*leaves, s, e, groups)
        dout = torch.randn_like(ref)
        ref.backward(dout)
        qc = q[:, :, s:e].clone().requires_grad_()
        kc, vc = (x[:, :, :e].clone().requires_grad_() for x in (k, v))
        with sdpa_kernel(forced) if forced else torch.enable_grad():
            kernel = _kernel(qc, kc, vc, 128**-0.5)
            assert kernel is not None, backend
            if backend == "CUDNN_ATTENTION":
                assert kernel.name == "cuDNN"
            if backend == "FLASH_ATTENTION":
                assert kernel.name == "flash"
            got = _attention(qc, kc, vc, 128**-0.5, groups)
            got.backward(dout.to(torch.bfloat16))
        assert (got.float() - ref).abs().max().item() < 2e-2, (backend, s, e)
        pairs = (
            (qc.grad, leaves[0].grad[:, :, s:e]),
            (kc.grad, leaves[1].grad[:, :, :e]),
            (vc.grad, leaves[2].grad[:, :, :e]),
        )
        for name, (mine, theirs) in zip("qkv", pairs, strict=True):
            err = (mine.float() - theirs).abs().max().item()
            scale = theirs.abs().max().item()
            assert err < 2e-2 * max(scale, 1.0), (backend, s, e, name, err, scale)


@pytest.mark.gpu
def test_gpu_bf16_chunked_layers_close_to_plain_and_to_fp32() -> None:
    """CUDA, bf16, 4 layers (hidden 256, 8 heads over 2 K/V heads), LoRA on q, k, v, o and
    down_proj, 3072 tokens with the layers by chunks of 512: the LoRA gradients of two steps no
    further from an fp32 run's than 1.5 times the plain bf16 run's distance plus a bf16
    rounding of the largest; the layers ran by chunks."""
    targets = (*ALL, "down_proj")
    fp32 = lora(gpu_model(seed=12), targets).cuda()
    runs = {
        "fp32": fp32,
        "plain": copy.deepcopy(fp32).to(torch.bfloat16),
        "ours": copy.deepcopy(fp32).to(torch.bfloat16),
    }
    tokens = 3072
    tuner = reviva.finetune(
        runs["ours"], chunk_tokens=1024, loss_chunk_tokens=512, attention_chunk_tokens=512
    )
    calls = Calls(tuner)
    try:
        for s in range(2):
            data = batch(seed=60 + s, tokens=tokens, device="cuda")
            grads = {name: step(m, data, lr=0.0)[1] for name, m in runs.items()}
            assert_bf16_as_close_as_plain(grads, s)
        assert calls.n == [2 * 2 * 6] * 4, calls.n
    finally:
        calls.remove()
        tuner.close()
        runs.clear()
        gc.collect()
