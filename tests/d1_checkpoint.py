"""Build a random-init d1 checkpoint in the on-disk format of LiquidAI/d1-3B (an LFM2.5-VL-3B).

No weights can be downloaded here, so tests and benchmarks run on checkpoints this script builds: an
`Lfm2VlForConditionalGeneration` (`config.json`, `model.language_model.*`, `model.vision_tower.*`,
`model.multi_modal_projector.*` tensors in bf16 safetensors, spec 3.10), the real LFM2 tokenizer with reserved slots
named for the LFM2-VL image tokens, an LFM2-VL chat template (spec 3.3) and a processor config with the
LFM2-VL defaults (spec 3.8). The weights are random: answers are meaningless, but every number the export and the
runtime compute can be checked against the torch model.

Reserved slots renamed (the LFM2 text tokenizer leaves them `<|reserved_N|>`; `Lfm2VlConfig.image_token_id`
defaults to 396, the rest of the layout is this project's assumption, as the real d1-3B files cannot be read):

    396 <image>   397..496 <|img_row_R_col_C|> (R, C = 1..10, row-major)   497 <|img_thumbnail|>
    498 <|image_start|>   499 <|image_end|>

    python scripts/build_d1_checkpoint.py OUT [--size tiny|d1-3B] [--seed 0]
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TOKENIZER_GZ = FIXTURES / "lfm2" / "tokenizer.json.gz"

IMAGE_TOKEN_ID = 396
GRID_SIDE = 10  # max_tiles=10 allows up to 10 rows or columns


def image_token_names() -> dict[int, str]:
    """Reserved slot id -> LFM2-VL image token name (see the module docstring)."""
    names = {IMAGE_TOKEN_ID: "<image>"}
    slot = IMAGE_TOKEN_ID + 1
    for row in range(1, GRID_SIDE + 1):
        for col in range(1, GRID_SIDE + 1):
            names[slot] = f"<|img_row_{row}_col_{col}|>"
            slot += 1
    names.update({slot: "<|img_thumbnail|>", slot + 1: "<|image_start|>", slot + 2: "<|image_end|>"})
    return names


# d1-3B-sized shapes: the LFM2-2.6B text backbone and the SigLIP2 so400m NaFlex tower, as the public LFM2 and
# LFM2-VL configs give them (not verified against d1-3B's own files): they serve GPU benchmarks at a realistic
# cost, not parity with real weights.
D1_3B_ATTENTION = (2, 6, 10, 14, 18, 21, 24, 27)
SIZES = {
    "tiny": dict(
        text=dict(hidden_size=64, intermediate_size=192, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, layer_types=["conv", "conv", "full_attention", "conv", "full_attention",
                                                      "conv"]),
        vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2),
        projector_hidden_size=96),
    "d1-3B": dict(
        text=dict(hidden_size=2048, intermediate_size=10752, num_hidden_layers=30, num_attention_heads=32,
                  num_key_value_heads=8,
                  layer_types=["full_attention" if i in D1_3B_ATTENTION else "conv" for i in range(30)]),
        vision=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=26, num_attention_heads=16),
        projector_hidden_size=2560),
}

# Lfm2VlImageProcessor's class defaults (spec 3.8 step 3), which d1-3B appears to use (spec 8 Q2).
IMAGE_PROCESSOR = {
    "image_processor_type": "Lfm2VlImageProcessor",
    "downsample_factor": 2, "do_image_splitting": True, "min_tiles": 2, "max_tiles": 10, "use_thumbnail": True,
    "min_image_tokens": 64, "max_image_tokens": 256, "encoder_patch_size": 16, "tile_size": 512,
    "max_pixels_tolerance": 2.0, "do_resize": True, "size": {"height": 512, "width": 512}, "resample": 2,
    "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "do_pad": True,
    "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}


def config_dict(size: str) -> dict:
    shapes = SIZES[size]
    text = dict(shapes["text"], model_type="lfm2", vocab_size=65536, max_position_embeddings=128000, norm_eps=1e-5,
                conv_L_cache=3, conv_bias=False, block_auto_adjust_ff_dim=size == "tiny", block_ffn_dim_multiplier=1.0,
                block_multiple_of=256 if size != "tiny" else 32,
                rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0),
                tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=7, initializer_range=0.08)
    vision = dict(shapes["vision"], model_type="siglip2_vision_model", num_channels=3, patch_size=16,
                  num_patches=256, hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6, vision_use_head=False)
    return dict(text_config=text, vision_config=vision, image_token_id=IMAGE_TOKEN_ID, downsample_factor=2,
                projector_hidden_act="gelu", projector_hidden_size=shapes["projector_hidden_size"],
                projector_bias=True, projector_use_layernorm=True, tie_word_embeddings=True)


def write_tokenizer_files(out: Path) -> None:
    """The real LFM2 tokenizer with the image slots named, its tokenizer_config.json and the chat template."""
    with gzip.open(TOKENIZER_GZ, "rt", encoding="utf-8") as f:
        tokenizer = json.load(f)
    names = image_token_names()
    by_id = {entry["id"]: entry for entry in tokenizer["added_tokens"]}
    vocab = tokenizer["model"]["vocab"]
    for slot, name in names.items():
        old = by_id[slot]["content"]
        if not old.startswith("<|reserved_"):
            raise ValueError(f"token {slot} is {old!r}, not a reserved slot")
        by_id[slot]["content"] = name
        if vocab.pop(old, slot) != slot:
            raise ValueError(f"vocab maps {old!r} to another id than {slot}")
        vocab[name] = slot
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "TokenizersBackend",
        "bos_token": "<|startoftext|>", "eos_token": "<|im_end|>", "pad_token": "<|pad|>",
        "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
        "legacy": False, "model_max_length": 1000000000000000019884624838656,
        "image_token": "<image>", "image_start_token": "<|image_start|>", "image_end_token": "<|image_end|>",
        "image_thumbnail_token": "<|img_thumbnail|>",
    }, indent=2))
    shutil.copyfile(FIXTURES / "lfm2" / "chat_template.jinja", out / "chat_template.jinja")


def write_processor_files(out: Path) -> None:
    (out / "processor_config.json").write_text(json.dumps({
        "processor_class": "Lfm2VlProcessor", "image_processor": IMAGE_PROCESSOR}, indent=2))


def build_d1_checkpoint(out: str | Path, size: str = "tiny", seed: int = 0) -> Path:
    """Write a seeded random-init d1 checkpoint of `size` to `out` and return its path."""
    import torch
    from transformers import Lfm2VlConfig, Lfm2VlForConditionalGeneration

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = Lfm2VlConfig(**config_dict(size))
    config.architectures = ["Lfm2VlForConditionalGeneration"]
    with torch.device("cpu"):
        model = Lfm2VlForConditionalGeneration(config).eval()
    # transformers initialises norms to one and the embedding tiny: give both spread so that every layer shapes
    # the answer and a random model's picks differ from question to question.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                param.normal_(1.0, 0.3)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    write_tokenizer_files(out)
    write_processor_files(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(build_d1_checkpoint(args.out, args.size, args.seed))


if __name__ == "__main__":
    main()
