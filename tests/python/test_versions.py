"""Note [Tested transformers] (python/reviva/hf_versions.py): the ranges the package declares are
the ones its scripts test, a transformers outside the range is refused by name where Reviva takes
a model, and the cache reaches Reviva's forwards under either of HF's names."""

from __future__ import annotations

import pathlib
import re
import sys

import pytest
import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import reviva
from reviva import hf_versions
from reviva.hf_versions import (
    TRANSFORMERS_REQUIREMENT,
    layer_cache,
    pop_cache,
    transformers_supported,
)

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import torch_pin  # noqa: E402


def tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
    )
    return LlamaForCausalLM(cfg).eval()


def peft_model(model: LlamaForCausalLM) -> torch.nn.Module:
    import peft

    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj"]))


def test_pyproject_declares_the_tested_range_everywhere_it_names_transformers() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    named = re.findall(r'"(transformers[^"]*)"', text)
    assert named, "pyproject names no transformers"
    assert set(named) == {TRANSFORMERS_REQUIREMENT}, named
    # the extras bring what README's snippets import: the Trainer needs accelerate, LoRA peft
    finetune = re.search(r"^finetune = \[(.*)\]$", text, re.M)
    assert finetune is not None
    for name in ("transformers", "accelerate", "peft"):
        assert f'"{name}' in finetune.group(1), name
    for line in re.findall(r'"((?:accelerate|peft)[^"]*)"', text):
        assert "<" in line and ">=" in line, f"{line}: a range needs both bounds"


def test_the_dev_pins_are_the_ranges_lowest() -> None:
    pins = dict(
        line.split("==")
        for line in (ROOT / "requirements-dev.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins["transformers"] == hf_versions.TRANSFORMERS_LOWEST
    torch_pin_minor = tuple(int(x) for x in pins["torch"].split(".")[:2])
    assert torch_pin_minor == torch_pin.TORCH_LOWEST
    assert torch_pin.TORCH_RANGE == "torch>={}.{},<{}.{}".format(
        *torch_pin.TORCH_LOWEST, *torch_pin.TORCH_FIRST_UNTESTED
    )


def test_readme_install_states_the_tested_ranges() -> None:
    text = (ROOT / "README.md").read_text()
    install = text.split("## Install", 1)[1].split("\n## ", 1)[0]
    assert TRANSFORMERS_REQUIREMENT.removeprefix("transformers") in install
    assert torch_pin.TORCH_RANGE.removeprefix("torch") in install
    assert "pip install '.[finetune]'" in install


def test_the_range_is_read_as_releases() -> None:
    assert transformers_supported(hf_versions.TRANSFORMERS_LOWEST)
    assert transformers_supported("5.25.0")
    assert transformers_supported("5.25.3")
    assert not transformers_supported("5.16.1")
    assert not transformers_supported("5.26.0")
    assert not transformers_supported("5.26.0rc1")  # (a pre-release of an untested one)
    assert not transformers_supported("6.0.0")
    assert not transformers_supported("4.57.6")
    assert transformers_supported(transformers.__version__), "the installed one is tested"


@pytest.mark.parametrize("version", ["5.26.0", "5.16.0", "4.57.6"])
def test_an_untested_transformers_is_refused_by_name_before_any_work(
    monkeypatch: pytest.MonkeyPatch, version: str
) -> None:
    model = tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    monkeypatch.setattr(hf_versions, "installed_transformers", lambda: version)
    for make in (
        lambda: reviva.RevivaManager(model),
        lambda: reviva.finetune(peft_model(model), budget="1GB", device="cpu"),
    ):
        with pytest.raises(RuntimeError, match=rf"transformers {re.escape(version)} is installed"):
            make()
    with pytest.raises(RuntimeError, match=re.escape(TRANSFORMERS_REQUIREMENT)):
        reviva.from_pretrained(str(ROOT / "no-such-folder"))
    # nothing was wrapped or moved
    assert "forward" not in model.model.layers[0].__dict__
    for k, v in model.state_dict().items():
        k = k.replace("base_model.model.", "").replace(".base_layer", "")
        if "lora_" not in k:
            assert torch.equal(v, before[k]), k


def test_the_cache_is_read_under_either_name() -> None:
    cache = DynamicCache()
    assert layer_cache({"cache": cache}) is cache
    assert layer_cache({"past_key_values": cache}) is cache
    assert layer_cache({"cache": None, "past_key_values": cache}) is cache
    assert layer_cache({}) is None
    kwargs = {"cache": cache, "max_new_tokens": 3}
    assert pop_cache(kwargs, "x") is cache and kwargs == {"max_new_tokens": 3}
    kwargs = {"past_key_values": cache}
    assert pop_cache(kwargs, "x") is cache and kwargs == {}
    with pytest.raises(ValueError, match="both cache and past_key_values"):
        pop_cache({"cache": cache, "past_key_values": DynamicCache()}, "x")


def test_a_returned_cache_continues_under_this_transformers_name() -> None:
    """generate with return_dict_in_generate returns the call's cache; the next turn passes it
    back under the name this transformers uses (5.25: `cache`, before: `past_key_values`)."""
    model = tiny()
    ids = torch.randint(1, 128, (1, 12))
    kw = dict(max_new_tokens=4, do_sample=False)
    manager = reviva.RevivaManager(model)
    turn = manager.generate(ids, return_dict_in_generate=True, **kw)
    hf_turn = model.generate(ids, return_dict_in_generate=True, **kw)
    assert torch.equal(turn.sequences, hf_turn.sequences)
    name = hf_versions.cache_argument()
    returned = getattr(turn, name)
    nxt = torch.cat([turn.sequences, torch.randint(1, 128, (1, 3))], 1)
    got = manager.generate(nxt, **{name: returned}, **kw)
    ref = model.generate(nxt, **{name: getattr(hf_turn, name)}, **kw)
    assert torch.equal(got, ref)
