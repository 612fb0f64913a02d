"""reviva.from_pretrained (Note [Loading layer by layer] in reviva/generate/loader.py): a checkpoint
folder the test writes (safetensors, one file or shards, tied or untied head) loads layer by
layer into pinned host memory and generates plain HF's tokens through the manager, call after
call; a folder it cannot load is refused by name."""

from __future__ import annotations

import json
import re

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


def test_the_folders_generation_config_is_loaded_as_hf_loads_it(tmp_path) -> None:  # noqa: ANN001
    """A folder's generation_config.json (here a list of eos ids, as chat models ship) is the
    model's generation_config, as transformers' from_pretrained loads it: the call stops where
    HF's stops."""
    from transformers import GenerationConfig

    saved(tmp_path, LlamaConfig(**TINY))
    ids = torch.randint(1, 211, (1, 30), generator=torch.Generator().manual_seed(5))
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path)
    free = ref_model.generate(ids, max_new_tokens=8, do_sample=False)
    stop = int(free[0, 30 + 2])  # the third new token, as one of two eos ids
    GenerationConfig(eos_token_id=[209, stop], pad_token_id=0).save_pretrained(tmp_path)
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path)
    ref = ref_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert ref.shape[1] <= 30 + 3  # (HF stops at the eos id)
    model = reviva.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    assert model.generation_config.eos_token_id == [209, stop]
    assert model.generation_config.to_dict() == ref_model.generation_config.to_dict()
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), ref)
    (tmp_path / "generation_config.json").unlink()  # (HF's from config.json then)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": stop}))
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path)
    model = reviva.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
    assert model.generation_config.to_dict() == ref_model.generation_config.to_dict()
    ref = ref_model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False), ref)


@pytest.mark.parametrize("where", ["a layer", "outside the layers"])
def test_a_tensor_of_another_shape_is_refused_naming_it(tmp_path, where: str) -> None:  # noqa: ANN001
    """A checkpoint tensor whose shape differs from its parameter's is refused naming the tensor
    and both shapes, as transformers refuses it, also where copy_ would broadcast it ([1, n] into
    [m, n]); a config that disagrees with the tensors gives the same error."""
    from safetensors.torch import load_file, save_file

    saved(tmp_path, LlamaConfig(**TINY))
    file = tmp_path / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.2.mlp.down_proj.weight" if where == "a layer" else "model.norm.weight"
    good = tuple(tensors[name].shape)
    tensors[name] = tensors[name][..., :1].contiguous()  # (broadcasts back into its place)
    save_file(tensors, file, metadata={"format": "pt"})
    bad = tuple(tensors[name].shape)
    with pytest.raises(
        ValueError,
        match=re.escape(f"{name}")
        + ".*"
        + re.escape(f"{list(bad)}")
        + ".*"
        + re.escape(f"{list(good)}"),
    ):
        reviva.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")

    saved(tmp_path, LlamaConfig(**TINY))  # the tensors right, the config wider
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["intermediate_size"] = 2 * TINY["intermediate_size"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(
        ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\[160, 64\].*\[320, 64\]"
    ):
        reviva.from_pretrained(str(tmp_path), dtype=torch.float32, device="cpu")
