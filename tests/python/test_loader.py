"""reviva.from_pretrained (Note [Loading layer by layer] in reviva/loader.py): a checkpoint
folder the test writes (safetensors, one file or shards, tied or untied head) loads layer by
layer into pinned host memory and generates plain HF's tokens through the manager, call after
call; a folder it cannot load is refused by name."""

from __future__ import annotations

import pytest
import torch
from test_generate import TINY
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

import reviva


def saved(tmp_path, cfg, shard: str | None = None):  # noqa: ANN001, ANN201
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(tmp_path, safe_serialization=True, **kw)
    return model


@pytest.mark.parametrize(
    ("family", "shard"),
    [("llama", None), ("llama", "60KB"), ("qwen3_tied", None)],
)
def test_a_saved_folder_loads_layer_by_layer_and_gives_hfs_tokens(
    tmp_path,
    family: str,
    shard: str | None,  # noqa: ANN001
) -> None:
    if family == "qwen3_tied":
        cfg = Qwen3Config(**TINY, tie_word_embeddings=True)
    else:
        cfg = LlamaConfig(**TINY)
    ref_model = saved(tmp_path, cfg, shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    ids = torch.randint(1, 211, (2, 40), generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=8, do_sample=False)
    ref = ref_model.generate(ids, **kw)
    model = reviva.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    for _ in range(2):
        assert torch.equal(model.generate(ids, **kw), ref)
    st = model.reviva.get_memory_stats()
    assert st.weights_streamed, st.summary()
    # every decoder layer's weights filled into the manager's WeightStore (its pinned host
    # blocks on a GPU), equal to the saved model's
    assert model.reviva.weights.num_layers == len(ref_model.model.layers)
    for mine, theirs in zip(model.model.layers, ref_model.model.layers, strict=True):
        for (name, p), q in zip(mine.named_parameters(), theirs.parameters(), strict=True):
            assert not p.is_meta and torch.equal(p.detach().cpu(), q.detach()), name


def test_what_it_cannot_load_is_refused_by_name(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="neither a folder nor a model id"):
        reviva.from_pretrained(str(tmp_path / "nothing-here"), device="cpu")
    saved(tmp_path, LlamaConfig(**TINY))
    (tmp_path / "model.safetensors").rename(tmp_path / "other.bin")
    with pytest.raises(ValueError, match="no model.safetensors"):
        reviva.from_pretrained(str(tmp_path), device="cpu")
    with pytest.raises(ValueError, match="dtype must be a float dtype"):
        reviva.from_pretrained(str(tmp_path), dtype=torch.int8, device="cpu")
