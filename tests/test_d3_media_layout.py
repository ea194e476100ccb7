"""Media layout for d3 (spec 4.8, 4.11; appendix D 11): placeholder expansion with double-wrapped videos, 3-D
M-RoPE positions equal to transformers' `get_rope_index`, and the vision graph's grid-derived inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from systemone.runtime.d3.placeholders import MediaLayout, expand_media, mrope_positions
from systemone.runtime.d3.vision_inputs import vision_inputs
from systemone.runtime.tokenizer import PromptTokenizer


@pytest.fixture(scope="module")
def tokenizer(d3_artifact):
    return PromptTokenizer(d3_artifact / "tokenizer.json")


@pytest.fixture(scope="module")
def hf_model(d3_checkpoint):
    from transformers import Qwen3_5Model

    return Qwen3_5Model.from_pretrained(d3_checkpoint, dtype=torch.float32).eval()


IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
MEDIA = [MediaLayout("image", ((3, 5),)), MediaLayout("image", ((2, 2),)),
         MediaLayout("video", ((4, 3), (4, 3), (4, 3)), (0.3, 1.3, 2.4))]


def expanded(tokenizer):
    prefix = tokenizer.encode("<|im_start|>user\n" + IMAGE + IMAGE + VIDEO)
    return expand_media(prefix, MEDIA, tokenizer.encode, tokenizer.token_id)


def test_video_is_double_wrapped_with_a_timestamp_per_group(tokenizer):
    text = tokenizer.decode(expanded(tokenizer).ids)
    assert text.count("<|image_pad|>") == 15 + 4 and text.count("<|video_pad|>") == 3 * 12
    video = text[text.index("<|vision_start|><0.3 seconds>"):]
    assert video.startswith("<|vision_start|><0.3 seconds><|vision_start|>" + "<|video_pad|>" * 12 + "<|vision_end|>"
                            "<1.3 seconds><|vision_start|>")
    assert video.endswith("<|vision_end|><|vision_end|>")


def test_spec_4_10_video_token_count(tokenizer):
    """Appendix B.3: a 10 s 1280x720 30 fps video -> 10 groups x (timestamp tokens + 1 + 180 + 1)."""
    stamps = (0.3, 1.3, 2.4, 3.4, 4.5, 5.5, 6.6, 7.6, 8.7, 9.7)
    layout = MediaLayout("video", ((10, 18),) * 10, stamps)  # 576x320 frames: 10 x 18 merged cells
    out = expand_media(tokenizer.encode(VIDEO), [layout], tokenizer.encode, tokenizer.token_id)
    stamp_tokens = sum(len(tokenizer.encode(f"<{t:.1f} seconds>")) for t in stamps)
    assert len(out.ids) == 2 + stamp_tokens + 10 * (1 + 180 + 1)


def test_positions_equal_transformers_get_rope_index(tokenizer, hf_model):
    out = expanded(tokenizer)
    ids = out.ids + tokenizer.encode("State:\nx<|im_end|>\n")
    ours = mrope_positions(len(ids), out.segments)
    image_pad, video_pad = tokenizer.token_id("<|image_pad|>"), tokenizer.token_id("<|video_pad|>")
    types = torch.tensor([[1 if t == image_pad else 2 if t == video_pad else 0 for t in ids]])
    theirs, _ = hf_model.get_rope_index(torch.tensor([ids]), types,
                                         image_grid_thw=torch.tensor([[1, 6, 10], [1, 4, 4]]),
                                         video_grid_thw=torch.tensor([[3, 8, 6]]))
    assert np.array_equal(ours, theirs[:, 0].numpy())


def test_media_rows_fill_the_pads_in_order(tokenizer):
    out = expanded(tokenizer)
    pads = {tokenizer.token_id("<|image_pad|>"), tokenizer.token_id("<|video_pad|>")}
    assert out.media_positions.tolist() == [i for i, t in enumerate(out.ids) if t in pads]


def test_placeholder_count_must_match_the_media(tokenizer):
    with pytest.raises(ValueError, match="more image placeholders"):
        expand_media(tokenizer.encode(IMAGE * 2), MEDIA[:1], tokenizer.encode, tokenizer.token_id)
    with pytest.raises(ValueError, match="more media than the prompt"):
        expand_media(tokenizer.encode(IMAGE), MEDIA[:2], tokenizer.encode, tokenizer.token_id)


@pytest.mark.parametrize("t, h, w", [(1, 2, 2), (1, 4, 6), (1, 16, 16), (1, 2, 40), (1, 60, 26), (1, 100, 2),
                                     (3, 4, 6), (10, 20, 36)])
def test_vision_inputs_equal_transformers_helpers(t, h, w):
    """One segment, or a video's t frame groups in one run (each its own positions)."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    grid = torch.tensor([[t, h, w]])
    index, weight = get_vision_interpolation_indices_and_weights(grid, num_grid_per_side=48, mode="bilinear",
                                                                 align_corners=True, spatial_merge_size=2)
    ours = vision_inputs(h, w, 48, 2, t)
    assert ours["segments"].shape == (t,)
    assert np.array_equal(ours["interp_index"], index.numpy())
    assert np.abs(ours["interp_weight"] - weight.numpy()).max() <= 1e-6
    assert np.array_equal(ours["rotary_pos"], get_vision_position_ids(grid, 2).numpy())


def test_artifact_vision_graph_matches_the_vision_tower(d3_artifact, d3_checkpoint):
    """The exported vision graph vs Qwen3_5VisionModel (pooler_output) on a segment shape not seen at export."""
    import json

    from systemone.export.d3.config import D3ExportConfig
    from systemone.runtime.session import GraphSession

    manifest = json.loads((d3_artifact / "manifest.json").read_text())
    assert manifest["graphs"]["vision"]["parity"]["max_abs_diff"] <= 1e-5
    config = D3ExportConfig(d3_checkpoint)
    h, w = 22, 14
    pixels = np.random.default_rng(3).standard_normal((h * w, 1536)).astype(np.float32)
    feeds = {"pixel_values": pixels, **vision_inputs(h, w, manifest["vision"]["position_grid_side"], 2)}
    got = GraphSession(d3_artifact / "vision.onnx", "cpu").run(feeds)[0]
    assert got.shape == (h * w // 4, 64)
    assert np.abs(got - config.reference_vision(pixels, h, w)).max() <= 1e-5


class CountingSession:
    """The artifact's vision graph, counting its runs; `old` hides the `segments` input, as a graph exported before
    runs took several segments."""

    def __init__(self, session, old: bool = False):
        self.session, self.old, self.runs = session, old, 0
        self.input_names = [n for n in session.input_names if not (old and n == "segments")]

    def run(self, feeds, run_options=None):
        self.runs += 1
        if self.old:
            assert "segments" not in feeds
            feeds = {**feeds, "segments": np.zeros(1, dtype=np.int64)}
        return self.session.run(feeds, run_options)


@pytest.mark.parametrize("old, together", [(False, True), (False, False), (True, False)])
def test_segments_of_a_grid_share_vision_runs_and_answer_as_alone(d3_service, old, together):
    """Two 3-group videos and a photo of another grid, of different requests: as on a GPU, the videos' six segments
    run once together; as on the CPU, or with a graph without `segments`, each alone. Every segment's rows are its
    rows alone."""
    from systemone.runtime.d3.media import Preprocessed

    encoder = d3_service.engine.media
    rng = np.random.default_rng(5)
    items = [Preprocessed("video", rng.standard_normal((3 * 8 * 12, 1536)).astype(np.float32), (3, 8, 12), ()),
             Preprocessed("image", rng.standard_normal((6 * 10, 1536)).astype(np.float32), (1, 6, 10), ()),
             Preprocessed("video", rng.standard_normal((3 * 8 * 12, 1536)).astype(np.float32), (3, 8, 12), ())]
    counting = CountingSession(encoder.session, old)
    assert not encoder.segments_together  # the CPU's choice
    clone = replace_session(encoder, counting)
    clone.segments_together = together
    shared = clone.rows_many(items, None)
    assert counting.runs == (2 if together else 7)
    side = encoder.side
    for item, rows in zip(items, shared):
        t, h, w = item.grid
        alone = [encoder.session.run({"pixel_values": segment, **vision_inputs(h, w, side, 2)})[0]
                 for segment in np.split(item.pixels, t)]
        assert rows.shape == (t * h * w // 4, 64)
        assert np.abs(rows - np.concatenate(alone)).max() <= 1e-5


def replace_session(encoder, session):
    import copy

    clone = copy.copy(encoder)
    clone.session = session
    return clone


def test_the_fused_forms_attention_node_keeps_segments_apart(d3_artifact):
    """The CUDA form's vision graph (each block's attention one MultiHeadAttention node, the segments its batch):
    five segments in one run give each segment's rows alone."""
    import json

    from systemone.runtime.session import GraphSession

    manifest = json.loads((d3_artifact / "manifest.json").read_text())
    (form,) = manifest["forms"]
    session = GraphSession(d3_artifact / f"vision.{form}.onnx", "cpu")
    h, w, side = 8, 12, manifest["vision"]["position_grid_side"]
    pixels = np.random.default_rng(7).standard_normal((5 * h * w, 1536)).astype(np.float32)
    together = session.run({"pixel_values": pixels, **vision_inputs(h, w, side, 2, 5)})[0]
    alone = [session.run({"pixel_values": part, **vision_inputs(h, w, side, 2)})[0] for part in np.split(pixels, 5)]
    assert np.abs(together - np.concatenate(alone)).max() <= 1e-3
