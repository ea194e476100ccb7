"""Build a random-init d3 checkpoint in the exact on-disk format of the released vllm-sr/d3 models.

No weights can be downloaded here, so tests and benchmarks run on checkpoints this script builds: a bare
`Qwen3_5Model` (`config.json` with `architectures: ["Qwen3_5Model"]`, `language_model.*` and `visual.*` tensors in
safetensors, bf16 like the released files), `readout.safetensors` (one tensor `weight` `[len(codes), hidden]`),
`decision_config.json` (spec 4.2), the real Qwen3.5 tokenizer, a Qwen3.5-style chat template (spec 4.6) and the
processor configs (spec 4.9/4.10). The weights are random: answers are meaningless, but every number the export and
the runtime compute can be checked against the torch model.

    python scripts/build_d3_checkpoint.py OUT [--size tiny|d3-edge|d3-lite|d3-nano|d3-mini|d3-flash|d3]
        [--attention-mode causal|noncausal_full_attention] [--seed 0] [--device cpu|cuda]

The released sizes are written as save_pretrained shards them, module by module (tests/d3_checkpoint.py,
`write_model_streamed`): d3's 26B parameters are never whole in memory.
"""

from __future__ import annotations

import argparse
import copy
import gzip
import json
import shutil
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TOKENIZER_GZ = FIXTURES / "qwen3_5" / "tokenizer.json.gz"
CODES_FILE = FIXTURES / "qwen3_5" / "golden_prompts_jigor.json"

# Shapes of the Qwen3.5 backbones behind each released d3 size (0.8B for edge/lite, 2B nano, 4B mini, 9B flash,
# 27B d3), as third-party copies of the Qwen3.5 configs give them. Not verified against the released d3 files
# (they cannot be downloaded here): they serve GPU benchmarks at a realistic cost, not parity with real weights.
RELEASED_TEXT = {
    "d3-edge": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                    num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16),
    "d3-lite": dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=8,
                    num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16),
    "d3-nano": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=8,
                    num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=16),
    "d3-mini": dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, num_attention_heads=16,
                    num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32),
    "d3-flash": dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32, num_attention_heads=16,
                     num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=32),
    "d3": dict(hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
               num_key_value_heads=4, linear_num_key_heads=16, linear_num_value_heads=48),
}
_VISION_SMALL = dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12)
_VISION_MID = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16)
_VISION_LARGE = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16)
RELEASED_VISION = {"d3-edge": _VISION_SMALL, "d3-lite": _VISION_SMALL, "d3-nano": _VISION_MID,
                   "d3-mini": _VISION_MID, "d3-flash": _VISION_LARGE, "d3": _VISION_LARGE}

TINY_TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16, linear_value_head_dim=16)
TINY_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, num_position_embeddings=64)

VOCAB_SIZE = 248320  # the Qwen3.5 embedding table (tokenizer: 248,044 + 33 specials, padded)
IMAGE_MEAN = [0.5, 0.5, 0.5]
IMAGE_STD = [0.5, 0.5, 0.5]


def _config(size: str) -> dict:
    if size == "tiny":
        text = dict(TINY_TEXT, rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0,
                                                    partial_rotary_factor=0.25, mrope_section=[2, 1, 1],
                                                    mrope_interleaved=True),
                    initializer_range=0.08,
                    # A full-attention layer before the last one, so that noncausal_full_attention changes
                    # the last token's state (in the last layer it sees the whole prompt in either mode).
                    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])
        vision = dict(TINY_VISION)
    else:
        text = dict(RELEASED_TEXT[size], head_dim=256, full_attention_interval=4, linear_key_head_dim=128, linear_value_head_dim=128,
                    rope_parameters=dict(rope_type="default", rope_theta=10_000_000.0, partial_rotary_factor=0.25,
                                         mrope_section=[11, 11, 10], mrope_interleaved=True))
        vision = dict(RELEASED_VISION[size], num_position_embeddings=2304)
    text.update(vocab_size=VOCAB_SIZE, max_position_embeddings=262144, rms_norm_eps=1e-6, hidden_act="silu",
                linear_conv_kernel_dim=4, tie_word_embeddings=False,
                eos_token_id=248044)
    vision.update(out_hidden_size=text["hidden_size"], patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                  in_channels=3, hidden_act="gelu_pytorch_tanh")
    return dict(text_config=text, vision_config=vision, image_token_id=248056, video_token_id=248057,
                vision_start_token_id=248053, vision_end_token_id=248054, tie_word_embeddings=False)


def answer_codes() -> list[str]:
    """The 255 answer codes of the released models: A..Z then two-letter codes that are single Qwen3.5 tokens."""
    return json.loads(CODES_FILE.read_text())["codes"]


def write_tokenizer_files(out: Path) -> None:
    """The real Qwen3.5 tokenizer, its tokenizer_config.json and the chat template."""
    with gzip.open(TOKENIZER_GZ, "rb") as f:
        (out / "tokenizer.json").write_bytes(f.read())
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "Qwen2Tokenizer",
        "add_bos_token": False,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "errors": "replace",
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": 262144,
    }, indent=2))
    shutil.copyfile(FIXTURES / "qwen3_5" / "chat_template.jinja", out / "chat_template.jinja")


def write_processor_files(out: Path) -> None:
    image = {
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
        "patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": IMAGE_MEAN, "image_std": IMAGE_STD,
        "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    }
    video = dict(image, video_processor_type="Qwen3VLVideoProcessor", fps=2, min_frames=4, max_frames=768,
                 do_sample_frames=True, size={"shortest_edge": 4096, "longest_edge": 25165824})
    del video["image_processor_type"]
    (out / "preprocessor_config.json").write_text(json.dumps(image, indent=2))
    (out / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))


SHARD_BYTES = 5 << 30  # a shard's size, as save_pretrained's default max_shard_size ("5GB") makes them


def _spread_norm(weight) -> None:
    # Norm weights start at zero in transformers' init; give them spread so that every layer shapes the answer
    # and the random model's picks differ from question to question.
    weight.normal_(0.0, 0.3)


def write_model_streamed(model_class, config, out: Path, shard_bytes: int = SHARD_BYTES, device: str = "cpu") -> None:
    """The model's bf16 weights written as `save_pretrained` writes a sharded checkpoint (`config.json`,
    `model-0000k-of-0000n.safetensors`, `model.safetensors.index.json`), made module by module in bf16 with
    transformers' own init, on `device` (cuda: the random draws take seconds where a CPU takes minutes at d3's 26B
    values): a released size's model is never whole in memory (d3's is 52 GB in bf16, 104 GB in fp32)."""
    import torch
    from safetensors.torch import save_file

    from systemone.export.skeleton import parameters_on_meta

    with parameters_on_meta():
        model = model_class._from_config(copy.deepcopy(config), dtype=torch.bfloat16).eval()  # keeps config's
    # Each module initialised by the model it belongs to (the vision tower by its own, with its own config).
    owners = {name: module for name, module in model.named_modules() if hasattr(module, "_init_weights")}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if next(module.parameters(recurse=False), None) is None:
                continue
            module.to_empty(device=device, recurse=False)
            owner = max((name for name in owners if module_name.startswith(name)), key=len)
            owners[owner]._init_weights(module)
            for name, param in module.named_parameters(recurse=False):
                key = f"{module_name}.{name}" if module_name else name
                if key.endswith("norm.weight"):
                    _spread_norm(param)
                tensor = param.detach().to("cpu", torch.bfloat16).contiguous()
                if size and size + tensor.nbytes > shard_bytes:
                    shards.append({})
                    size = 0
                shards[-1][key] = tensor
                size += tensor.nbytes
            module.to("meta")
            if len(shards) > 1:  # every shard but the last is complete: written now, under a temporary name
                save_file(shards[0], str(out / f"shard-{_written(out)}.tmp"), metadata={"format": "pt"})
                shards.pop(0)
    save_file(shards[0], str(out / f"shard-{_written(out)}.tmp"), metadata={"format": "pt"})
    parts = sorted(out.glob("shard-*.tmp"), key=lambda path: int(path.name[6:-4]))
    if len(parts) == 1:  # one shard: save_pretrained's single file, no index
        parts[0].rename(out / "model.safetensors")
    else:
        weight_map, total = {}, 0
        for index, part in enumerate(parts, 1):
            name = f"model-{index:05d}-of-{len(parts):05d}.safetensors"
            part.rename(out / name)
            for key, entry in _safetensors_header(out / name).items():
                weight_map[key] = name
                total += entry["data_offsets"][1] - entry["data_offsets"][0]
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.architectures = [model_class.__name__]
    config.dtype = torch.bfloat16
    config.save_pretrained(out)


def _written(out: Path) -> int:
    return len(list(out.glob("shard-*.tmp")))


def _safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def build_d3_checkpoint(out: str | Path, size: str = "tiny", attention_mode: str = "noncausal_full_attention",
                        seed: int = 0, temperature: float = 0.75, device: str = "cpu") -> Path:
    """Write a seeded random-init d3 checkpoint of `size` to `out` and return its path; a released size's weights
    are drawn on `device`."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen3_5Config, Qwen3_5Model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = Qwen3_5Config(**_config(size))
    config.architectures = ["Qwen3_5Model"]
    if size == "tiny":
        with torch.device("cpu"):
            model = Qwen3_5Model(config).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    _spread_norm(param)
        model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    else:
        if device == "cuda":
            torch.cuda.manual_seed(seed)
        write_model_streamed(Qwen3_5Model, config, out, device=device)

    codes = answer_codes()
    hidden = config.text_config.hidden_size
    generator = torch.Generator().manual_seed(seed + 1)
    readout = torch.randn(len(codes), hidden, generator=generator) * (1.5 / hidden**0.5)
    save_file({"weight": readout.to(torch.bfloat16).contiguous()}, str(out / "readout.safetensors"))

    from tokenizers import Tokenizer
    write_tokenizer_files(out)
    write_processor_files(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    token_ids = []
    for code in codes:
        ids = tokenizer.encode(code, add_special_tokens=False).ids
        if len(ids) != 1:
            raise ValueError(f"answer code {code!r} is {len(ids)} tokens; codes must be single tokens")
        token_ids.append(ids[0])
    (out / "decision_config.json").write_text(json.dumps({
        "format_version": 1,
        "prompt": "d3",
        "pooling": "last",
        "attention_mode": attention_mode,
        "codes": codes,
        "token_ids": token_ids,
        "temperature": temperature,
    }, indent=2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--size", default="tiny", choices=["tiny", *RELEASED_TEXT])
    parser.add_argument("--attention-mode", default="noncausal_full_attention",
                        choices=["causal", "noncausal_full_attention"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where a released size's random weights are drawn (cuda: seconds rather than minutes)")
    args = parser.parse_args()
    path = build_d3_checkpoint(args.out, args.size, args.attention_mode, args.seed, device=args.device)
    print(f"wrote a random-init {args.size} d3 checkpoint to {path}")


if __name__ == "__main__":
    main()
