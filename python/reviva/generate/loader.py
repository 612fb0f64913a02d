"""reviva.from_pretrained: a checkpoint folder loaded for Reviva without the whole model in
pageable host memory (Note [Loading layer by layer]).

    model = reviva.from_pretrained("path/to/folder", budget="24GB")
    out = model.generate(**tokenizer(prompt, return_tensors="pt"), max_new_tokens=64)
    model.reviva.get_memory_stats()
"""

# Note [Loading layer by layer]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# transformers' from_pretrained materializes every weight before Reviva can wrap the model: a
# model larger than the host's free memory cannot be loaded, and one that fits passes through
# pageable memory before its layers are pinned (the model twice at the peak). Here the model is
# built on the meta device (no memory), the parts outside the decoder layers (embedding, final
# norm, head: a few GB at most) are read onto the compute device, the rotary embedding is made
# there from the config (its inverse frequencies are computed, not stored), and the manager is
# made with fill_layer: StreamedWeights gives each layer's parameters their place in pinned
# host memory and fill_layer reads them from the safetensors files straight into it, a tensor
# at a time (safetensors maps the file; a tensor passes through pageable memory alone). Layers
# the budget holds are made resident per call by the manager, as for any model whose weights
# stream. Not here: a model larger than the host's memory (the disk tier for weights), and
# checkpoints that are not safetensors (.bin pickles load whole).

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from torch import nn

from reviva.config import RevivaConfig

log = logging.getLogger("reviva.loader")  # (the name users filter on)


def _folder(name_or_path: str) -> str:
    """A local folder, or a model id already in the Hugging Face cache (nothing downloaded)."""
    if os.path.isdir(name_or_path):
        return name_or_path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(name_or_path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 (said as the one error a caller can act on)
        raise ValueError(
            f"reviva.from_pretrained: {name_or_path!r} is neither a folder nor a model id in the "
            f"Hugging Face cache (nothing is downloaded): {e}"
        ) from None


def _weight_map(folder: str) -> dict[str, str]:
    """Tensor name -> the safetensors file holding it."""
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            mapping = json.load(f)["weight_map"]
        return {name: os.path.join(folder, file) for name, file in mapping.items()}
    single = os.path.join(folder, "model.safetensors")
    if not os.path.exists(single):
        raise ValueError(
            f"reviva.from_pretrained: no model.safetensors (or its index) in {folder}; "
            "checkpoints in other formats load whole: use transformers' from_pretrained and "
            "RevivaManager(model)"
        )
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return dict.fromkeys(f.keys(), single)


class _Reader:
    """Tensors by name from the checkpoint's files, each file opened once."""

    def __init__(self, weight_map: dict[str, str]) -> None:
        self.weight_map = weight_map
        self.alias: dict[str, str] = {}  # a name -> the name the file holds it under
        self._open: dict[str, Any] = {}

    def _handle(self, name: str) -> tuple[Any, str]:
        """The open file holding a tensor, and the name the file holds it under."""
        from safetensors import safe_open

        file = self.weight_map.get(name)
        name = self.alias.get(name, name)
        if file is None:
            raise ValueError(f"reviva.from_pretrained: the checkpoint has no tensor {name!r}")
        if file not in self._open:
            self._open[file] = safe_open(file, framework="pt")
        return self._open[file], name

    def get(self, name: str) -> torch.Tensor:
        handle, stored = self._handle(name)
        return handle.get_tensor(stored)

    def shape(self, name: str) -> list[int]:
        """The tensor's shape, from its file's header (no data read)."""
        handle, stored = self._handle(name)
        return list(handle.get_slice(stored).get_shape())

    def close(self) -> None:
        self._open.clear()


def from_pretrained(
    name_or_path: str,
    budget: str | int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    config: RevivaConfig | None = None,
) -> nn.Module:
    """A causal LM (the Llama decoder layout) from a folder of safetensors (or a model id in the
    Hugging Face cache), loaded layer by layer into pinned host memory (Note [Loading layer by
    layer]) and wrapped by a RevivaManager: its `generate` runs through the manager (also
    `model.reviva`, the manager). budget: RevivaConfig's vram_budget (ignored with `config`);
    device: the compute device (default cuda if there is one, else cpu)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from reviva.adapters import inspect_model
    from reviva.generate.manager import RevivaManager
    from reviva.hf_versions import check_transformers

    check_transformers("reviva.from_pretrained")  # (before any weight is read)

    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"reviva.from_pretrained: dtype must be a float dtype, got {dtype}")
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if config is None:
        config = RevivaConfig(vram_budget=budget) if budget is not None else RevivaConfig()
    folder = _folder(name_or_path)
    weight_map = _weight_map(folder)
    hf_config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    model.eval()
    model.generation_config = _generation_config(folder)
    layout = inspect_model(model)
    missing = [n for n, _ in model.named_parameters() if n not in weight_map]
    prefix_of = {id(module): name for name, module in model.named_modules()}
    reader = _Reader(weight_map)
    if missing and not (getattr(hf_config, "tie_word_embeddings", False) and len(missing) == 1):
        raise ValueError(
            f"reviva.from_pretrained: the checkpoint in {folder} lacks {len(missing)} of the "
            f"model's tensors, e.g. {missing[:3]}"
        )
    layer_params = {id(p) for layer in layout.layers for p in layer.parameters()}
    # A tied head and embedding are one tensor, saved under either name: each name finds it.
    tied = getattr(hf_config, "tie_word_embeddings", False)
    pair = ("model.embed_tokens.weight", "lm_head.weight")
    if tied and not all(n in weight_map for n in pair) and any(n in weight_map for n in pair):
        held = next(n for n in pair if n in weight_map)
        for n in pair:
            weight_map.setdefault(n, weight_map[held])
            reader.alias[n] = held
    # Every tensor's shape is its parameter's, before anything is read: copy_ would broadcast a
    # [1, n] tensor into an [m, n] place, and a parameter outside the layers would take the
    # tensor's shape, where transformers refuses both; a config.json that disagrees with the
    # tensors is named here too (not by a size error deep in a layer's copy).
    for name, p in model.named_parameters():
        held = reader.shape(name)
        if held != list(p.shape):
            raise ValueError(
                f"reviva.from_pretrained: the checkpoint's {name} has shape {held}, the model "
                f"built from {folder}/config.json wants {list(p.shape)} (the config and the "
                "tensors disagree)"
            )
    # the parts outside the decoder layers, on the compute device
    with torch.no_grad():
        for module_name, module in model.named_modules():
            for key, p in list(module._parameters.items()):
                if p is None or id(p) in layer_params:
                    continue
                full = f"{module_name}.{key}" if module_name else key
                value = reader.get(full).to(device=device, dtype=dtype)
                module._parameters[key] = nn.Parameter(value, requires_grad=False)
        if tied:
            model.tie_weights()
        rotary = model.model.rotary_emb
        with torch.device(device):  # (its inverse frequencies computed there)
            model.model.rotary_emb = type(rotary)(config=hf_config)
        for module in model.modules():  # (any other buffer on meta: computed, never stored)
            for key, buf in module._buffers.items():
                if buf is not None and buf.is_meta:
                    raise ValueError(
                        f"reviva.from_pretrained: {type(module).__name__}.{key} is a buffer the "
                        "checkpoint does not hold; this model loads with transformers' "
                        "from_pretrained and RevivaManager(model)"
                    )

    def fill_layer(i: int, layer: nn.Module) -> None:
        prefix = prefix_of[id(layer)]
        with torch.no_grad():
            for name, p in layer.named_parameters():
                p.copy_(reader.get(f"{prefix}.{name}"))  # (into its pinned host place)

    manager = RevivaManager(model, config, fill_layer=fill_layer)
    reader.close()
    _generate_through(model, manager)
    model.reviva = manager
    log.info("reviva: %s loaded layer by layer (%d layers)", folder, layout.num_layers)
    return model


def _generation_config(folder: str) -> Any:
    """The folder's generation_config.json (eos ids, sampling defaults), else one made from its
    config.json: as transformers' from_pretrained loads it (GenerationMixin.adjust_generation_fn);
    from_config alone would keep the config's defaults and e.g. a list of eos ids unread."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder, _from_auto=True, local_files_only=True)
    except OSError:  # (no generation_config.json: transformers' own fallback)
        return GenerationConfig.from_pretrained(
            folder,
            config_file_name="config.json",
            _from_auto=True,
            _from_model_config=True,
            local_files_only=True,
        )


def _generate_through(model: nn.Module, manager: Any) -> None:
    """model.generate(...) is the manager's from now on (an attribute of the instance), but
    within the manager's own call, where it is HF's (the manager runs HF's generate loop)."""

    def generate(*args: Any, **kwargs: Any) -> Any:
        if manager._in_own_call:
            return type(model).generate(model, *args, **kwargs)
        return manager.generate(*args, **kwargs)

    generate._reviva_manager = manager  # type: ignore[attr-defined]  (its close() removes it)
    model.generate = generate
