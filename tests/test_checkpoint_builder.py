"""The tiny d3 checkpoint is in the released on-disk format (spec 4.1, 4.2, 4.14)."""

from __future__ import annotations

import json

from safetensors import safe_open
from tokenizers import Tokenizer

from systemone.models.registry import FAMILIES


def test_config_is_a_bare_qwen3_5_model(d3_checkpoint):
    config = json.loads((d3_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5Model"] and config["model_type"] == "qwen3_5"
    assert {"linear_attention", "full_attention"} == set(config["text_config"]["layer_types"])
    assert config["vision_config"]["patch_size"] == 16 and config["vision_config"]["spatial_merge_size"] == 2
    assert FAMILIES.recognise(d3_checkpoint).name == "d3"


def test_weights_use_language_model_and_visual_names(d3_checkpoint):
    with safe_open(str(d3_checkpoint / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert {n.split(".")[0] for n in names} == {"language_model", "visual"}
    assert any(".linear_attn.in_proj_qkv." in n for n in names) and any(".self_attn.q_proj." in n for n in names)


def test_readout_and_decision_config(d3_checkpoint):
    decision = json.loads((d3_checkpoint / "decision_config.json").read_text())
    assert decision["format_version"] == 1 and decision["pooling"] == "last"
    assert decision["attention_mode"] == "noncausal_full_attention" and decision["temperature"] != 1
    codes = decision["codes"]
    assert len(codes) == 255 and codes[:3] == ["A", "B", "C"] and codes[26] == "AA"
    tokenizer = Tokenizer.from_file(str(d3_checkpoint / "tokenizer.json"))
    assert [tokenizer.encode(c, add_special_tokens=False).ids for c in codes] == [[t] for t in decision["token_ids"]]
    hidden = json.loads((d3_checkpoint / "config.json").read_text())["text_config"]["hidden_size"]
    with safe_open(str(d3_checkpoint / "readout.safetensors"), "pt") as f:
        assert list(f.keys()) == ["weight"]
        assert list(f.get_slice("weight").get_shape()) == [255, hidden]


def test_tokenizer_template_and_processor_files(d3_checkpoint):
    tokenizer = Tokenizer.from_file(str(d3_checkpoint / "tokenizer.json"))
    assert tokenizer.token_to_id("<|im_start|>") == 248045 and tokenizer.token_to_id("<think>") == 248068
    assert (d3_checkpoint / "chat_template.jinja").read_text().strip()
    image = json.loads((d3_checkpoint / "preprocessor_config.json").read_text())
    assert image["patch_size"] == 16 and image["merge_size"] == 2 and image["temporal_patch_size"] == 2
    assert json.loads((d3_checkpoint / "video_preprocessor_config.json").read_text())["fps"] == 2


def test_released_sizes_are_written_in_shards_module_by_module_as_save_pretrained_writes_them(d3_checkpoint,
                                                                                               tmp_path):
    """A released size's fp32 model is never whole in memory (d3's is 108 GB): its tensors are made module by module
    and written in save_pretrained's sharded layout, which transformers loads, spread as transformers' init
    spreads them."""
    import torch
    from transformers import Qwen3_5Config, Qwen3_5Model

    from tests.d3_checkpoint import _config, write_model_streamed

    write_model_streamed(Qwen3_5Model, Qwen3_5Config(**_config("tiny")), tmp_path, shard_bytes=200_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0].name == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {shard.name for shard in shards}
    model, info = Qwen3_5Model.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and model.dtype == torch.bfloat16
    reference = Qwen3_5Model.from_pretrained(d3_checkpoint).state_dict()
    streamed = model.state_dict()
    assert set(streamed) == set(reference)
    for name, tensor in reference.items():
        assert streamed[name].shape == tensor.shape, name
        if tensor.numel() > 1000:  # the same init, other random draws: the same spread
            assert abs(streamed[name].float().std() - tensor.float().std()) <= 0.15 * tensor.float().std() + 1e-3, name
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((d3_checkpoint / "config.json").read_text())
