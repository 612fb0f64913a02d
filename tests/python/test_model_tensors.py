"""The model the user holds is the model (DESIGN.md, Trust invariants; Note [The user's streamed
parameters] in reviva/weights/writes.py, Note [Embedding on the host] in
reviva/weights/host_embedding.py): every tensor reachable from the user's model (parameters,
buffers, state_dict, the input and output embeddings) is real (no expanded placeholder) and holds
its values during and after RevivaManager, reviva.finetune and reviva.from_pretrained; writes
(load_state_dict, p.data = t, p.copy_) reach the next forward or are refused by name; close() gives
every tensor back where it was, the same Parameter objects, bit for bit. CPU (host backend), and on
CUDA with streamed weights and the embedding on the host."""

from __future__ import annotations

import copy
import dataclasses
import gc
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_finetune import batch, lora, tiny_llama
from test_generate import tiny_model
from test_weights import MIXES, budget_where
from torch import nn
from transformers import AutoModelForCausalLM

import reviva
from reviva import RevivaConfig, RevivaManager

peft = pytest.importorskip("peft", reason="peft (a dev requirement) is needed for LoRA models")


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def reachable(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the user reaches from the model, by where it is reached."""
    found: dict[str, torch.Tensor] = {}
    for n, p in model.named_parameters():
        found[f"parameter {n}"] = p
    for n, b in model.named_buffers():
        found[f"buffer {n}"] = b
    for n, t in model.state_dict().items():
        found[f"state_dict {n}"] = t
    found["input embeddings"] = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is not None:
        found["output embeddings"] = out.weight
    return found


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: t.detach().to("cpu", copy=True) for k, t in reachable(model).items()}


def expanded(t: torch.Tensor) -> bool:
    """A placeholder made by expand: a dimension of more than one element at stride 0."""
    return any(s == 0 and d > 1 for s, d in zip(t.stride(), t.shape, strict=True))


def assert_the_model_is_real(
    model: nn.Module, reference: dict[str, torch.Tensor], what: str, skip: tuple[str, ...] = ()
) -> None:
    """No tensor reachable from `model` is a placeholder, and each equals `reference`'s (the
    plain model's), bit for bit; `skip`: names trained since (their values are not compared)."""
    found = reachable(model)
    assert found.keys() == reference.keys(), (what, found.keys() ^ reference.keys())
    for k, t in found.items():
        assert not t.is_meta, f"{what}: {k} is on the meta device"
        assert not expanded(t), f"{what}: {k} is an expanded placeholder, stride {t.stride()}"
        if any(s in k for s in skip):
            continue
        got = t.detach().cpu()
        assert got.dtype == reference[k].dtype and torch.equal(got, reference[k]), (
            f"{what}: {k} differs from the plain model's (sum {got.float().sum().item():.6g} "
            f"against {reference[k].float().sum().item():.6g})"
        )


def assert_given_back(
    model: nn.Module,
    params: dict[str, nn.Parameter],
    devices: dict[str, torch.device],
    reference: dict[str, torch.Tensor],
    what: str,
) -> None:
    """close(): the same Parameter objects, on their devices, with their values."""
    now = dict(model.named_parameters())
    assert now.keys() == params.keys(), what
    for n, p in params.items():
        assert now[n] is p, f"{what}: {n} is another Parameter object"
        assert p.device == devices[n], f"{what}: {n} on {p.device}, was on {devices[n]}"
    assert_the_model_is_real(model, reference, what)


# --- RevivaManager ---------------------------------------------------------------------------


def test_manager_with_streamed_weights_keeps_the_model_real_during_and_after() -> None:
    """Streamed weights and the input embedding on the host: before a call, inside `with
    manager:` after calls with some layers resident, after them, and after close(), every
    reachable tensor is real and the plain model's; close() gives back the same Parameters on
    their devices, and the model runs as HF's after it."""
    model = tiny_model("llama", seed=21)
    ids = torch.randint(1, 211, (1, 30), generator=torch.Generator().manual_seed(1))
    ref = model.generate(ids, max_new_tokens=6, do_sample=False)
    plain_logits = model(ids).logits
    reference = snapshot(model)
    params = dict(model.named_parameters())
    devices = {n: p.device for n, p in params.items()}
    manager = RevivaManager(model, RevivaConfig(stream_weights=True))
    assert manager.host_embedding is not None
    assert_the_model_is_real(model, reference, "manager made")
    weight = model.get_input_embeddings().weight
    assert weight.sum().item() != 0.0
    budget_where(manager, 30, 6, MIXES["some_weights"])
    with manager:
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), ref)
        assert_the_model_is_real(model, reference, "inside with manager")
    assert torch.equal(manager.generate(ids, max_new_tokens=6, do_sample=False), ref)
    assert_the_model_is_real(model, reference, "after calls")
    manager.close()
    assert_given_back(model, params, devices, reference, "manager closed")
    assert torch.equal(model(ids).logits, plain_logits)
    assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), ref)
    with pytest.raises(RuntimeError, match="closed"):
        manager.generate(ids, max_new_tokens=2)
    manager.close()  # (twice: nothing)


def test_load_state_dict_reaches_the_next_call() -> None:
    """load_state_dict of another model's tensors into a model whose weights stream (and whose
    embedding is on the host): the next call gives the other model's tokens."""
    model = tiny_model("llama", seed=22)
    other = tiny_model("llama", seed=23)
    ids = torch.randint(1, 211, (1, 30), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=6, do_sample=False)
    mine, theirs = model.generate(ids, **kw), other.generate(ids, **kw)
    assert not torch.equal(mine, theirs)
    manager = RevivaManager(model, RevivaConfig(stream_weights=True))
    budget_where(manager, 30, 6, MIXES["some_weights"])
    assert torch.equal(manager.generate(ids, **kw), mine)
    model.load_state_dict(other.state_dict())
    assert torch.equal(manager.generate(ids, **kw), theirs)
    assert_the_model_is_real(model, snapshot(other), "after load_state_dict")
    manager.close()
    assert_the_model_is_real(model, snapshot(other), "closed after load_state_dict")


@pytest.mark.parametrize("how", ["data", "copy_", "parameter"])
def test_a_write_to_a_streamed_parameter_reaches_the_next_call(how: str) -> None:
    """A layer's weights written between calls (p.data = t, p.copy_(t) under no_grad, a new
    Parameter under its name) while the layer is resident (its parameters view its device copy),
    then a call where it streams, then one where it is resident again: each call computes with the
    written values (a plain model with the same writes gives its tokens)."""
    model = tiny_model("llama", seed=24)
    other = tiny_model("llama", seed=25)
    ids = torch.randint(1, 211, (1, 30), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=6, do_sample=False)
    manager = RevivaManager(copy.deepcopy(model), RevivaConfig(stream_weights=True))
    ours = manager.layout.model
    everything, _ = budget_where(manager, 30, 6, MIXES["all_weights"])
    least, _ = budget_where(manager, 30, 6, MIXES["least"])
    manager.config = dataclasses.replace(manager.config, vram_budget=everything)
    assert torch.equal(manager.generate(ids, **kw), model.generate(ids, **kw))
    written = copy.deepcopy(model)
    for target in (written, ours):
        layer, source = target.model.layers[1], other.model.layers[1]
        for (name, p), q in zip(layer.named_parameters(), source.parameters(), strict=True):
            module_name, _, key = name.rpartition(".")
            module = layer.get_submodule(module_name)
            if how == "data":
                p.data = q.detach().clone()
            elif how == "copy_":
                with torch.no_grad():
                    p.copy_(q)
            else:
                module._parameters[key] = nn.Parameter(q.detach().clone(), requires_grad=False)
    want = written.generate(ids, **kw)
    assert not torch.equal(want, model.generate(ids, **kw))
    for budget in (least, everything):
        manager.config = dataclasses.replace(manager.config, vram_budget=budget)
        assert torch.equal(manager.generate(ids, **kw), want), budget
        assert_the_model_is_real(ours, snapshot(written), f"after a call at {budget}")
    manager.close()
    assert_the_model_is_real(ours, snapshot(written), "closed after the writes")


def test_a_write_of_another_shape_is_refused_by_name() -> None:
    model = tiny_model("llama", seed=26)
    manager = RevivaManager(model, RevivaConfig(stream_weights=True))
    ids = torch.randint(1, 211, (1, 12), generator=torch.Generator().manual_seed(4))
    p = model.model.layers[2].mlp.down_proj.weight
    kept = p.data.clone()
    ref = manager.generate(ids, max_new_tokens=2)
    p.data = torch.zeros(3, 3)
    with pytest.raises(
        ValueError, match=r"mlp\.down_proj.*decoder layer 2 was replaced by a \(3, 3\)"
    ):
        manager.generate(ids, max_new_tokens=2)
    # the refused call left nothing held or wrapped: put right, the next calls are as before
    assert "forward" not in model.model.layers[2].__dict__
    p.data = kept
    for _ in range(2):
        assert torch.equal(manager.generate(ids, max_new_tokens=2), ref)
    model.model.embed_tokens.weight.data = torch.zeros(5, 64)
    with pytest.raises(ValueError, match=r"input embedding's weight was replaced by a \(5, 64\)"):
        manager.host_embedding.sync()


def test_an_embedding_computed_from_the_weight_gives_the_models_logits() -> None:
    """F.embedding over get_input_embeddings().weight (a user's inputs_embeds) under a manager
    whose table is on the host: the plain model's logits, not uniform ones."""
    model = tiny_model("llama", seed=27)
    ids = torch.randint(1, 211, (1, 20), generator=torch.Generator().manual_seed(5))
    ref = model(ids).logits
    manager = RevivaManager(model, RevivaConfig(stream_weights=True))
    assert manager.host_embedding is not None
    embeds = F.embedding(ids, model.get_input_embeddings().weight)
    assert torch.equal(model(inputs_embeds=embeds).logits, ref)
    manager.close()


# --- reviva.finetune -------------------------------------------------------------------------


def test_finetune_keeps_the_model_real_during_and_after() -> None:
    """A PEFT LoRA model under reviva.finetune (some layers streamed, the frozen embedding on
    the host): while the Finetune is open (after a step) and after close(), every reachable
    tensor is real and the plain model's (the LoRA weights are not updated: gradients only);
    close() gives back the same Parameters on their devices."""
    model = lora(tiny_llama(seed=31))
    reference = snapshot(model)
    params = dict(model.named_parameters())
    devices = {n: p.device for n, p in params.items()}
    tuner = reviva.finetune(model, device="cpu", chunk_tokens=16, loss_chunk_tokens=8)
    try:
        assert tuner.host_embedding is not None
        assert_the_model_is_real(model, reference, "finetune made")
        model(**batch(seed=1)).loss.backward()
        assert tuner.stats().streamed_layers > 0 or tuner.stats().resident_layers > 0
        assert_the_model_is_real(model, reference, "finetune open, after a step")
    finally:
        tuner.close()
    assert_given_back(model, params, devices, reference, "finetune closed")


def test_a_second_finetune_trains_on_the_models_values() -> None:
    """finetune -> close -> finetune again: the same loss as a plain run (not ln(vocab) of an
    all-zero embedding)."""
    base = tiny_llama(seed=32)
    plain = lora(copy.deepcopy(base))
    ours = lora(copy.deepcopy(base))
    data = batch(seed=2)
    want = plain(**data).loss.item()
    for k in range(2):
        tuner = reviva.finetune(ours, device="cpu", chunk_tokens=16)
        try:
            got = ours(**data).loss.item()
        finally:
            tuner.close()
        assert got == pytest.approx(want, rel=1e-6), (k, got, math.log(base.config.vocab_size))


def test_finetune_with_embeddings_from_the_weight() -> None:
    """F.embedding over get_input_embeddings().weight passed as inputs_embeds under finetune:
    the plain run's loss."""
    base = tiny_llama(seed=33)
    plain = lora(copy.deepcopy(base))
    ours = lora(copy.deepcopy(base))
    data = batch(seed=3)
    ids, labels = data["input_ids"], data["labels"]
    want = plain(inputs_embeds=F.embedding(ids, plain.get_input_embeddings().weight), labels=labels)
    tuner = reviva.finetune(ours, device="cpu", chunk_tokens=16)
    try:
        assert tuner.host_embedding is not None
        embeds = F.embedding(ids, ours.get_input_embeddings().weight)
        got = ours(inputs_embeds=embeds, labels=labels).loss
        assert got.item() == pytest.approx(want.loss.item(), rel=1e-6)
    finally:
        tuner.close()


def test_finetune_takes_a_load_state_dict_between_steps() -> None:
    """load_state_dict of another base model's frozen weights between two steps: the next step's
    loss is the plain run's with the same load."""
    base, other = tiny_llama(seed=34), tiny_llama(seed=35)
    plain = lora(copy.deepcopy(base))
    ours = lora(copy.deepcopy(base))
    data = batch(seed=4)
    tuner = reviva.finetune(ours, device="cpu", chunk_tokens=16)
    try:
        ours(**data).loss.backward()
        plain(**data).loss.backward()
        theirs = other.state_dict()
        for m in (plain, ours):
            names = [k for k in m.state_dict() if "lora_" not in k]
            sd = {
                k: theirs[k.removeprefix("base_model.model.").replace(".base_layer", "")]
                for k in names
            }
            m.load_state_dict(sd, strict=False)
        assert ours(**data).loss.item() == pytest.approx(plain(**data).loss.item(), rel=1e-6)
    finally:
        tuner.close()
    assert_the_model_is_real(ours, snapshot(plain), "closed after load_state_dict")


def test_finetune_close_merge_save_and_reload_equals_the_plain_model(tmp_path: Path) -> None:
    """Two SGD steps of the same LoRA model, plainly and under finetune, then close(),
    merge_and_unload and save_pretrained: the reloaded models' tensors are the same (the frozen
    ones bit for bit, the merged ones within the chunked matmuls' rounding)."""
    base = tiny_llama(seed=36)
    runs = {"plain": lora(copy.deepcopy(base)), "ours": lora(copy.deepcopy(base))}
    tuner = reviva.finetune(runs["ours"], device="cpu", chunk_tokens=16, loss_chunk_tokens=8)
    try:
        for s in range(2):
            for m in runs.values():
                m(**batch(seed=40 + s)).loss.backward()
                with torch.no_grad():
                    for p in m.parameters():
                        if p.requires_grad:
                            p -= 0.05 * p.grad
                            p.grad = None
    finally:
        tuner.close()
    merged = {name: m.merge_and_unload() for name, m in runs.items()}
    theirs = dict(merged["plain"].named_parameters())
    for n, p in merged["ours"].named_parameters():
        assert not expanded(p) and p.device == theirs[n].device, n
        assert torch.allclose(p, theirs[n], rtol=1e-5, atol=1e-6), n
    loaded = {}
    for name, m in merged.items():
        m.save_pretrained(tmp_path / name)
        loaded[name] = AutoModelForCausalLM.from_pretrained(tmp_path / name).state_dict()
    assert loaded["plain"].keys() == loaded["ours"].keys()
    for k, want in loaded["plain"].items():
        got = loaded["ours"][k]
        assert not expanded(got) and got.abs().sum() > 0, k
        if any(t in k for t in ("q_proj", "v_proj")):
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), k
        else:
            assert torch.equal(got, want), k


# --- reviva.from_pretrained ------------------------------------------------------------------


def test_from_pretrained_keeps_the_model_real_and_close_gives_it_back(tmp_path: Path) -> None:
    """A folder loaded layer by layer: its tensors are the saved model's before a call, inside
    `with model.reviva:`, after calls and after close() (its layers, which were never anywhere
    but the pinned host copy, keep their values there); HF's own generate after close."""
    torch.manual_seed(7)
    from test_generate import TINY
    from transformers import LlamaConfig

    saved = AutoModelForCausalLM.from_config(LlamaConfig(**TINY)).eval()
    saved.save_pretrained(tmp_path, safe_serialization=True)
    ids = torch.randint(1, 211, (1, 24), generator=torch.Generator().manual_seed(6))
    kw = dict(max_new_tokens=6, do_sample=False)
    ref = saved.generate(ids, **kw)
    reference = snapshot(saved)
    model = reviva.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    assert model.reviva.host_embedding is not None
    assert_the_model_is_real(model, reference, "loaded")
    assert torch.equal(model.generate(ids, **kw), ref)
    with model.reviva:
        assert_the_model_is_real(model, reference, "inside with model.reviva")
    assert_the_model_is_real(model, reference, "after a call")
    manager = model.reviva
    manager.close()
    assert "generate" not in model.__dict__ and "reviva" not in model.__dict__
    assert_the_model_is_real(model, reference, "closed")
    assert torch.equal(model.generate(ids, **kw), ref)
    del manager
    gc.collect()


# --- on CUDA ---------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_streamed_weights_and_host_embedding_keep_the_model_real() -> None:
    """CUDA, bf16, a model on the GPU with its layers' weights streamed and its embedding on the
    host: the weight is a CUDA tensor over the pinned table (model.device stays CUDA), every
    reachable tensor real and the plain model's during and after calls; load_state_dict and
    p.copy_ reach the next call; close() gives back the same Parameters on the GPU, bit for bit;
    then a finetune of a LoRA model of it and its close() do the same."""
    torch.manual_seed(0)
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        vocab_size=4096,
        max_position_embeddings=1024,
        pad_token_id=0,
        eos_token_id=None,
    )
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        other = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.randint(1, 4096, (1, 64), device="cuda")
    kw = dict(max_new_tokens=8, do_sample=False)
    reference = snapshot(model)
    params = dict(model.named_parameters())
    devices = {n: p.device for n, p in params.items()}
    manager = RevivaManager(model, RevivaConfig(stream_weights=True))
    budget_where(manager, 64, 8, MIXES["some_weights"])
    helper = RevivaManager(copy.deepcopy(other), manager.config)  # (Reviva's tokens for other's)
    theirs = helper.generate(ids, **kw)
    helper.close()
    del helper
    try:
        assert manager.host_embedding is not None and model.device.type == "cuda"
        weight = model.get_input_embeddings().weight
        assert weight.device.type == "cuda"
        assert weight.data_ptr() == manager.host_embedding.table.data_ptr()
        assert_the_model_is_real(model, reference, "cuda: manager made")
        first = manager.generate(ids, **kw)
        assert manager.get_memory_stats()["embedding_on_host"]
        with manager:
            assert_the_model_is_real(model, reference, "cuda: inside with manager")
        assert_the_model_is_real(model, reference, "cuda: after a call")
        model.load_state_dict(other.state_dict())
        assert torch.equal(manager.generate(ids, **kw), theirs)
        with torch.no_grad():  # (p.copy_ back to the model's own values)
            for n, p in model.named_parameters():
                p.copy_(reference[f"parameter {n}"])
        assert torch.equal(manager.generate(ids, **kw), first)
        assert_the_model_is_real(model, reference, "cuda: written back")
    finally:
        manager.close()
    assert_given_back(model, params, devices, reference, "cuda: manager closed")

    tuned = peft.get_peft_model(
        model,
        peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]),
        autocast_adapter_dtype=False,
    )
    reference = snapshot(tuned)
    params = dict(tuned.named_parameters())
    devices = {n: p.device for n, p in params.items()}
    tuner = reviva.finetune(tuned, chunk_tokens=32)
    try:
        assert tuner.host_embedding is not None
        labels = ids.clone()
        tuned(input_ids=ids, labels=labels).loss.backward()
        assert_the_model_is_real(tuned, reference, "cuda: finetune open")
    finally:
        tuner.close()
    assert_given_back(tuned, params, devices, reference, "cuda: finetune closed")
