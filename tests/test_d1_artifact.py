"""d1 checkpoint format, export gates, images read once, and the startup label check (spec 3.5, 3.8, 3.10;
decision 6)."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from safetensors import safe_open

from tests.d1_checkpoint import image_token_names
from systemone.export.d1.config import D1ExportConfig
from systemone.export.pipeline import ParityError, export_checkpoint
from systemone.models.errors import DecisionError
from systemone.models.registry import FAMILIES
from systemone.runtime.artifact import Artifact
from systemone.runtime.engine import EngineOptions
from systemone.runtime.media_fetch import FetchPolicy
from systemone.runtime.service import DecisionService
from systemone.server.errors import http_status
from tests.media_helpers import CountingServer, data_url, gradient_png

NOUL = {"type": "noul", "instructions": "Is it urgent?"}


# -- the checkpoint (spec 3.10, 3.8, 3.3) ------------------------------------------------------------------------
def test_checkpoint_is_an_lfm2_vl_in_the_released_layout(d1_checkpoint):
    """Spec 3.10: `model.language_model.*`, `model.vision_tower.*`, `model.multi_modal_projector.*`, tied LM head;
    LFM2 conv and attention layers; SigLIP2 without its pooling head."""
    config = json.loads((d1_checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Lfm2VlForConditionalGeneration"] and config["model_type"] == "lfm2_vl"
    assert set(config["text_config"]["layer_types"]) == {"conv", "full_attention"}
    assert config["vision_config"]["model_type"] == "siglip2_vision_model"
    assert config["vision_config"]["vision_use_head"] is False and config["tie_word_embeddings"] is True
    with safe_open(str(d1_checkpoint / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert {".".join(n.split(".")[:2]) for n in names} == {"model.language_model", "model.vision_tower",
                                                            "model.multi_modal_projector"}
    assert any(".conv.in_proj." in n for n in names) and any(".self_attn.q_layernorm." in n for n in names)
    assert FAMILIES.recognise(d1_checkpoint).name == "d1"


def test_processor_config_has_the_lfm2_vl_defaults(d1_checkpoint):
    """Spec 3.8 step 3: the class defaults d1 appears to use (spec 8 Q2)."""
    raw = json.loads((d1_checkpoint / "processor_config.json").read_text())["image_processor"]
    assert {k: raw[k] for k in ("encoder_patch_size", "downsample_factor", "min_image_tokens", "max_image_tokens",
                                "min_tiles", "max_tiles", "tile_size", "max_pixels_tolerance", "resample")} == {
        "encoder_patch_size": 16, "downsample_factor": 2, "min_image_tokens": 64, "max_image_tokens": 256,
        "min_tiles": 2, "max_tiles": 10, "tile_size": 512, "max_pixels_tolerance": 2.0, "resample": 2}


def test_tokenizer_names_the_image_slots(d1_reference_tokenizer):
    """Issue 5 item 1: reserved slots renamed for the LFM2-VL image tokens (`<image>` = 396, the config's
    image_token_id) and matched as special tokens; the LFM2 markers keep their ids."""
    tok = d1_reference_tokenizer
    assert type(tok).__name__ == "TokenizersBackend"  # spec 3.4: tokenizer.json as is
    for slot, name in image_token_names().items():
        assert tok.convert_tokens_to_ids(name) == slot
    assert tok.convert_tokens_to_ids(["<|startoftext|>", "<|im_start|>", "<|im_end|>"]) == [1, 6, 7]
    assert tok.encode("a<image>b", add_special_tokens=False)[1] == 396


# -- export -----------------------------------------------------------------------------------------------------
def test_artifact_is_self_contained(d1_artifact):
    """The runtime needs no checkpoint file: graphs, tokenizer, the processor's template and settings, positions."""
    manifest = json.loads((d1_artifact / "manifest.json").read_text())
    assert manifest["family"] == "d1" and manifest["graphs"]["text"]["dtype"] == "float32"
    for name in ("text.onnx", "vision.onnx", "tokenizer.json", "chat_template.jinja", "vision_positions.npy"):
        assert (d1_artifact / name).is_file()
    inputs = manifest["graphs"]["text"]["inputs"]
    assert isinstance(inputs["input_ids"][0], str) and isinstance(inputs["past_key_2"][2], str)
    assert manifest["parity"]["max_abs_logprob_diff"] < 1e-4
    assert manifest["vision"]["max_image_tokens"] == 256


def test_export_writes_nothing_when_the_text_graph_disagrees(d1_checkpoint, tmp_path, monkeypatch):
    """Like optimum's validation: a graph that reads other log-probabilities than the torch model is refused."""
    real = D1ExportConfig.reference_logprobs
    monkeypatch.setattr(D1ExportConfig, "reference_logprobs", lambda self, *a, **k: real(self, *a, **k) + 0.01)
    with pytest.raises(ParityError, match="no artifact written"):
        export_checkpoint(str(d1_checkpoint), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


# -- images, once per request (decision 6) -----------------------------------------------------------
def test_images_are_fetched_and_encoded_once_per_request(d1_artifact):
    """6 questions over 2 images: one GET per URL; the vision graph runs once per crop grid (a 2x2-tiled 1024x1024
    image: its four 512 tiles and its thumbnail, all 32x32 patches, in one run; a 640x480 image: one crop)."""
    server = CountingServer({"a.png": gradient_png(1024, 1024), "b.png": gradient_png(640, 480)})
    options = EngineOptions(device="cpu", fetch_policy=FetchPolicy(allow_private_hosts=True))
    service = DecisionService(Artifact.load(d1_artifact), options)
    questions = {f"q{i}": [NOUL, {"type": "score", "criteria": ["a", "b", "c"]}][i % 2] for i in range(6)}
    with server.running():
        before = service.engine.vision_session.runs
        response = service.decide({"state": "x", "images": [f"{server.url}/a.png", f"{server.url}/b.png"],
                                   "questions": questions})
        assert len(response["answers"]) == 6
        assert dict(server.gets) == {"a.png": 1, "b.png": 1}
        assert service.engine.vision_session.runs - before == 1 + 1
        before = service.engine.vision_session.runs
        # Prepared reads the media; the vision graph runs when the request is answered.
        prepared = service.prepare({"state": "x", "images": [f"{server.url}/b.png"] * 2, "questions": {"q": NOUL}})
        service.answer(prepared)
        (prompt,) = prepared.prompts
    assert server.gets["b.png"] == 2 and service.engine.vision_session.runs - before == 1
    assert prompt.token_ids.count(396) == 2 * 234


def test_an_images_position_tables_are_made_while_it_loads_not_when_the_vision_graph_runs(d1_artifact):
    """A crop grid's position table (the SigLIP2 table resized to it) is made in the media pool as the image loads:
    the vision graph's turn, which every request's images share, finds it made."""
    service = DecisionService(Artifact.load(d1_artifact), EngineOptions(device="cpu"))
    encoder = service.engine.media
    body = {"state": "x", "images": [data_url(gradient_png(700, 300))], "questions": {"q": NOUL}}
    request, _ = service.validate(body)
    (image,) = service.load_media(request).in_order()
    grids = {crop.grid for crop in image.crops}
    made = encoder.positions.cache_info()
    assert made.currsize == len(grids) == made.misses
    encoder.rows(image, None)
    assert encoder.positions.cache_info().misses == made.misses


@pytest.mark.parametrize("size", [(1, 1), (3, 5000), (50, 50)])
def test_small_and_thin_images_are_answered(d1_service, size):
    """Spec 3.8: smart resize takes any image to at least 32 px a side and the 64-token minimum."""
    body = {"state": None, "images": [data_url(gradient_png(*size))], "questions": {"q": NOUL}}
    assert len(d1_service.decide(body)["answers"]) == 1


def test_an_image_too_thin_for_the_processor_is_a_400(d1_service):
    """A 10000x1 strip resizes to 6,400 patches, more than the processor's 1,024 per crop (transformers' LFM2-VL
    cannot run it either): 400 naming the limit and the image, never a 5xx."""
    body = {"state": None, "images": [data_url(gradient_png(10000, 1))], "questions": {"q": NOUL}}
    with pytest.raises(DecisionError, match=r"Failed to apply Lfm2VlProcessor on images\[0\]: .*max_num_patches=1024"):
        d1_service.decide(body)


# -- startup label check (spec 3.5, 1.1) ----------------------------------------------------------------------
def _artifact_copy(d1_artifact, tmp_path, template: str):
    copy = tmp_path / "art"
    copy.mkdir()
    for item in d1_artifact.iterdir():
        os.symlink(item, copy / item.name)
    (copy / "chat_template.jinja").unlink()
    (copy / "chat_template.jinja").write_text(template)
    return copy


def test_a_template_whose_labels_merge_with_the_tail_disables_the_endpoint(d1_artifact, tmp_path):
    """Spec 3.5 / 1.1: the generation tail "assistant: " makes " A" one token with the space, so a generic label is
    not one token after the tail: every call answers 501 NotImplementedError."""
    template = (d1_artifact / "chat_template.jinja").read_text().replace("assistant\\n", "assistant: ")
    service = DecisionService(Artifact.load(_artifact_copy(d1_artifact, tmp_path, template)),
                              EngineOptions(device="cpu"))
    assert service.engine.unsupported
    with pytest.raises(DecisionError, match="does not support the structured decision API") as info:
        service.decide({"state": None, "questions": {"q": NOUL}})
    assert http_status(info.value) == (501, "NotImplementedError")


def test_the_real_template_passes_the_startup_check(d1_service):
    """Spec 3.5: the LFM2 tail is the ids of "assistant\\n" and every generic label is one token after it."""
    tok = d1_service.artifact.tokenizer
    assert d1_service.engine.tail == tok.encode("assistant\n") and d1_service.engine.unsupported is None


def test_prefix_split_leaves_every_question_a_token():
    """The shared prefix never swallows a whole prompt (identical prompts still read their last token)."""
    from systemone.runtime.tokenizer import shared_prefix

    assert shared_prefix([[1, 2, 3], [1, 2, 3]]) == 2
    assert shared_prefix([[1, 2, 3, 4], [1, 2, 5]]) == 2
    assert shared_prefix([[1, 2], [1, 2, 3]]) == 1
    assert shared_prefix([[7, 8], [9]]) == 0


def test_a_hub_id_exports_from_the_hub_cache(d1_checkpoint, tmp_path, monkeypatch):
    """`systemone export LiquidAI/d1-3B` goes through huggingface_hub's snapshot_download; offline it answers from
    the cache, and the artifact records the hub id as its source."""
    import huggingface_hub.constants as constants

    cache = tmp_path / "hub"
    repo = cache / "models--LiquidAI--d1-tiny"
    shutil.copytree(d1_checkpoint, repo / "snapshots" / ("1" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    out = export_checkpoint("LiquidAI/d1-tiny", tmp_path / "out", lengths=(7,), forms=["portable"])
    assert not list(tmp_path.glob(".out.*")), "a staging folder was left behind"
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"] == "LiquidAI/d1-tiny" and manifest["family"] == "d1"
    assert Artifact.load(out).source == "LiquidAI/d1-tiny"
