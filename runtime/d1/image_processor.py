"""d1 images (spec 3.8): the 1024×1024-pixel cap, transformers' `Lfm2VlImageProcessor` (torchvision backend)
in plain numpy, and the `<image>` placeholder text that replaces the prompt's image token.

Per image the processor yields crops: either one crop at the "smart size", or (a large image) a grid of
tile_size×tile_size tiles cut from the whole image resized to the grid, then a thumbnail of the whole image at the
smart size. Each crop is rescaled/normalised and cut into encoder_patch_size² patches, each patch flattened (row,
col, channel). The crops are not padded: the runtime runs each crop at its own patch grid. The patches are written
in the vision graph's order (runtime/d1/cells.py: downsample² patches a projector cell, cells row-major), so that
an image's crops go to the graph as they lie, with no gather on the engine thread; `Lfm2Crop.row_major` gives
transformers' order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial

import numpy as np
from PIL import Image

from ..deadline import Deadline
from ..image_transform import BLOCK, fit_area, normalize, resize_bilinear
from ..pixel_workers import PixelWorkers, fill_here
from .cells import unshuffle_order

MAX_PIXELS = 1024 * 1024  # vLLM's d1 cap on the pixels of one image (spec 3.8 step 2)
PIL_BILINEAR = 2  # PILImageResampling.BILINEAR, the only resample the torchvision port implements
IMAGE_TOKEN = "<image>"
IMAGE_START = "<|image_start|>"
IMAGE_END = "<|image_end|>"
IMAGE_THUMBNAIL = "<|img_thumbnail|>"
# Output rows a part of an image's pixel work makes at most (rounded down to whole resize blocks and projector
# cells). Parts run side by side in the pixel workers; a 1024x1024 image's thumbnail (its 512 rows resized from
# 1024, about three quarters of the processor's time) was one part, the processor's critical path.
PART_ROWS = 128

_INT_FIELDS = ("encoder_patch_size", "downsample_factor", "min_image_tokens", "max_image_tokens", "min_tiles",
               "max_tiles", "tile_size")
_BOOL_FIELDS = ("do_image_splitting", "use_thumbnail")


@dataclass(frozen=True)
class Lfm2ImageConfig:
    """The image-processor parameters of a d1 checkpoint; defaults are `Lfm2VlImageProcessor`'s class defaults
    (spec 3.8 step 3)."""

    encoder_patch_size: int = 16
    downsample_factor: int = 2
    min_image_tokens: int = 64
    max_image_tokens: int = 256
    do_image_splitting: bool = True
    min_tiles: int = 2
    max_tiles: int = 10
    tile_size: int = 512
    use_thumbnail: bool = True
    max_pixels_tolerance: float = 2.0
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}: expected a boolean, got {getattr(self, name)!r}")
        tolerance = self.max_pixels_tolerance
        if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)) or not tolerance > 0:
            raise ValueError(f"max_pixels_tolerance: expected a positive number, got {tolerance!r}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if (not isinstance(value, tuple) or len(value) != 3
                    or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)):
                raise ValueError(f"{name}: expected three numbers, got {value!r}")
        if any(v == 0 for v in self.image_std):
            raise ValueError(f"image_std: must not contain 0, got {self.image_std!r}")
        if self.tile_size % (self.encoder_patch_size * self.downsample_factor):
            raise ValueError(f"tile_size: {self.tile_size} is not a multiple of encoder_patch_size × "
                             f"downsample_factor = {self.encoder_patch_size * self.downsample_factor}")
        if self.splits:
            if self.min_tiles > self.max_tiles:
                raise ValueError(f"min_tiles: {self.min_tiles} exceeds max_tiles {self.max_tiles}")
            if self.min_tiles < 2:
                # A 1×1 grid would be one tile with no thumbnail while transformers counts its tokens from the
                # thumbnail size: the prompt and the crops would disagree.
                raise ValueError(f"min_tiles: {self.min_tiles} with max_tiles {self.max_tiles} allows a 1×1 grid, "
                                 "which the LFM2-VL processor lays out inconsistently; use min_tiles >= 2")

    @property
    def splits(self) -> bool:
        """Whether large images are tiled: transformers turns splitting off when it is disabled and also when
        min_tiles == max_tiles == 1."""
        return self.do_image_splitting and not self.min_tiles == self.max_tiles == 1

    @property
    def max_num_patches(self) -> int:
        """The processor's patch budget per crop (it pads every crop to this many patches)."""
        tile = (self.tile_size // self.encoder_patch_size) ** 2 if self.do_image_splitting else 0
        return max(self.max_image_tokens * self.downsample_factor**2, tile)

    @classmethod
    def from_processor_config(cls, raw: dict) -> Lfm2ImageConfig:
        """Read a checkpoint's processor_config.json / preprocessor_config.json content (the image-processor keys
        at the top level or under "image_processor"). Settings this runtime does not reproduce are refused,
        naming the key: a resample other than bilinear (2), no rescale, a rescale factor other than 1/255 (as
        float32 arithmetic sees it: transformers fuses it into mean and std as 1/rescale_factor), no normalize."""
        if not isinstance(raw, dict):
            raise ValueError(f"processor config: expected a JSON object, got {type(raw).__name__}")
        section = raw.get("image_processor", raw)
        if not isinstance(section, dict):
            raise ValueError(f"image_processor: expected a JSON object, got {type(section).__name__}")
        resample = section.get("resample", PIL_BILINEAR)
        if isinstance(resample, bool) or resample != PIL_BILINEAR:
            raise ValueError(f"resample: only bilinear ({PIL_BILINEAR}) is supported, got {resample!r}")
        if section.get("do_rescale", True) is not True:
            raise ValueError(f"do_rescale: must be true, got {section['do_rescale']!r}")
        factor = section.get("rescale_factor", 1 / 255)
        if (isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0
                or np.float32(1.0 / factor) != np.float32(255.0)):
            raise ValueError(f"rescale_factor: only 1/255 is supported, got {factor!r}")
        if section.get("do_normalize", True) is not True:
            raise ValueError(f"do_normalize: must be true, got {section['do_normalize']!r}")
        defaults = cls()
        values = {}
        for name in (*_INT_FIELDS, *_BOOL_FIELDS, "max_pixels_tolerance"):
            values[name] = section.get(name, getattr(defaults, name))
        for name in ("image_mean", "image_std"):
            value = section.get(name, getattr(defaults, name))
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = (value,) * 3
            values[name] = tuple(value) if isinstance(value, list) else value
        return cls(**values)

    def to_dict(self) -> dict:
        """JSON-ready form, the keys named as in the processor config."""
        out = asdict(self)
        out["image_mean"] = list(self.image_mean)
        out["image_std"] = list(self.image_std)
        return out


@dataclass(frozen=True)
class Lfm2Crop:
    """One crop's patches: float32 [gh * gw, 3 * p * p], each flattened (row, col, channel), in the vision graph's
    order: `factor`² patches a projector cell (`unshuffle_order`); `grid` = (gh, gw), the patches high and wide
    (transformers' spatial_shapes)."""

    patches: np.ndarray
    grid: tuple[int, int]
    factor: int

    def row_major(self) -> np.ndarray:
        """The patches row-major, as transformers' processor lays them out (the torch reference takes them so)."""
        return self.patches[np.argsort(unshuffle_order(*self.grid, self.factor))]


@dataclass(frozen=True)
class Lfm2Image:
    """One processed image (spec 3.8 steps 3-4): crops = tiles row-major then the thumbnail, or one crop.
    rows × cols is the tile grid (1 × 1 for a single crop); tile_tokens = `<image>` tokens per tile;
    thumbnail_tokens = tokens of the single crop, or of the thumbnail (0 when a tiled image has none)."""

    crops: tuple[Lfm2Crop, ...]
    rows: int
    cols: int
    tile_tokens: int
    thumbnail_tokens: int
    patches: np.ndarray = field(repr=False, compare=False)  # every crop's patches, one after another (crops view it)

    def consecutive(self, first: int, count: int) -> np.ndarray:
        """Crops first .. first + count - 1, all of one grid, as one [count, patches, width] view of `patches`."""
        crops = self.crops[first:first + count]
        if len(crops) != count or any(c.grid != crops[0].grid for c in crops):
            raise ValueError(f"crops {first}..{first + count - 1} are not {count} crops of one grid")
        start = sum(len(c.patches) for c in self.crops[:first])
        size = len(crops[0].patches)
        return self.patches[start:start + count * size].reshape(count, size, -1)

    @property
    def tiled(self) -> bool:
        return self.rows > 1 or self.cols > 1

    @property
    def image_tokens(self) -> int:
        """Number of `<image>` tokens in the placeholder (= rows of the projector's output for this image)."""
        if self.tiled:
            return self.rows * self.cols * self.tile_tokens + self.thumbnail_tokens
        return self.thumbnail_tokens


def cap_pixels(rgb: np.ndarray, max_pixels: int = MAX_PIXELS) -> np.ndarray:
    """vLLM's d1 cap (spec 3.8 step 2) on uint8 [H, W, 3]: an image of more than `max_pixels` pixels is scaled by
    s = sqrt(max_pixels / (w·h)) to (max(1, int(w·s)), max(1, int(h·s))) with Pillow BICUBIC; smaller images are
    returned as they are, not copied (a 1024x1024 image's two copies through Pillow took 1.2 ms). E.g. 2000×1000 →
    1448×724, 1920×1080 → 1365×768, 1025×1024 → 1024×1023."""
    height, width = rgb.shape[:2]
    if width * height <= max_pixels:
        return rgb
    scale = math.sqrt(max_pixels / (width * height))
    size = (max(1, int(width * scale)), max(1, int(height * scale)))
    return np.asarray(Image.fromarray(rgb).resize(size, Image.Resampling.BICUBIC), dtype=np.uint8)


def _round_by_factor(number: float, factor: int) -> int:
    return round(number / factor) * factor  # Python round: half to even (spec 3.8 step 3)


def _too_large(height: int, width: int, config: Lfm2ImageConfig) -> bool:
    """Spec 3.8 step 3 "too large?": the area rounded to multiples of patch·downsample (each side at least one
    patch) against max_image_tokens · patch² · downsample² · tolerance."""
    patch, factor = config.encoder_patch_size, config.encoder_patch_size * config.downsample_factor
    h_bar = max(patch, _round_by_factor(height, factor))
    w_bar = max(patch, _round_by_factor(width, factor))
    limit = config.max_image_tokens * patch ** 2 * config.downsample_factor ** 2 * config.max_pixels_tolerance
    return h_bar * w_bar > limit


def smart_size(height: int, width: int, config: Lfm2ImageConfig) -> tuple[int, int]:
    """Spec 3.8 step 3 "smart size" (single crop / thumbnail) as (height, width): multiples of
    patch·downsample with an area within [min_image_tokens, max_image_tokens] · (patch·downsample)²."""
    factor = config.encoder_patch_size * config.downsample_factor
    min_pixels = config.min_image_tokens * factor ** 2
    max_pixels = config.max_image_tokens * factor ** 2
    h_bar = max(factor, _round_by_factor(height, factor))
    w_bar = max(factor, _round_by_factor(width, factor))
    return fit_area(height, width, h_bar, w_bar, factor, min_pixels, max_pixels)


def _target_ratios(min_tiles: int, max_tiles: int) -> list[tuple[int, int]]:
    """Candidate grids (w, h), in transformers' order: sorted by w·h over CPython's set order (spec 3.8)."""
    ratios = [(w, h) for n in range(min_tiles, max_tiles + 1) for w in range(1, n + 1) for h in range(1, n + 1)
              if min_tiles <= w * h <= max_tiles]
    return sorted(set(ratios), key=lambda x: x[0] * x[1])


def grid_layout(height: int, width: int, config: Lfm2ImageConfig) -> tuple[int, int]:
    """Spec 3.8 step 3 "large": the tile grid (cols, rows) whose aspect ratio is closest to width/height; a
    strictly smaller difference wins, and on an exact tie the later candidate wins when the image area exceeds
    half of the candidate grid's area."""
    aspect = width / height
    area = width * height
    best_diff, best = float("inf"), (1, 1)
    for ratio in _target_ratios(config.min_tiles, config.max_tiles):
        diff = abs(aspect - ratio[0] / ratio[1])
        if diff < best_diff:
            best_diff, best = diff, ratio
        elif diff == best_diff and area > 0.5 * config.tile_size * config.tile_size * ratio[0] * ratio[1]:
            best = ratio
    return best


def _put_patches(out: np.ndarray, offset: int, pixels: np.ndarray, config: Lfm2ImageConfig) -> None:
    """uint8 [H, W, 3] -> cut into patches in the vision graph's order (a projector cell's factor x factor patches,
    dh major, cells row-major), then the fused rescale/normalize (float32 (x - 255·mean) / (255·std)) written to
    `out` from row `offset` on. The pixels are reordered as bytes, and normalized straight into `out`."""
    patch, factor = config.encoder_patch_size, config.downsample_factor
    ch, cw = pixels.shape[0] // (patch * factor), pixels.shape[1] // (patch * factor)  # cells high and wide
    ordered = np.ascontiguousarray(
        pixels.reshape(ch, factor, patch, cw, factor, patch, 3).transpose(0, 3, 1, 4, 2, 5, 6))
    normalize(ordered, config.image_mean, config.image_std, out[offset:offset + ch * cw * factor * factor])


@dataclass(frozen=True)
class _Band:
    """A part of an image's patches (a `Fill` part, runtime/pixel_workers.py): output rows [top, bottom) of the
    image resized to height x width, cut into crops side by side, crop c's patches of these rows written from row
    offsets[c] of the patches on."""

    height: int
    width: int
    top: int
    bottom: int
    offsets: tuple[int, ...]


def _bands(height: int, width: int, top: int, bottom: int, firsts: Sequence[int], config: Lfm2ImageConfig
           ) -> list[_Band]:
    """Rows [top, bottom) of crops side by side (each crop's patches from row firsts[c]) in parts of at most
    PART_ROWS rows: whole resize blocks (a part resizes only its rows) and whole projector cells (a part's
    patches are consecutive in each crop)."""
    cell = config.encoder_patch_size * config.downsample_factor
    step = math.lcm(BLOCK, cell)
    rows = max(step, PART_ROWS // step * step)
    patches_a_cell_row = (width // len(firsts)) // cell * config.downsample_factor ** 2
    return [_Band(height, width, start, min(start + rows, bottom),
                  tuple(first + (start - top) // cell * patches_a_cell_row for first in firsts))
            for start in range(top, bottom, rows)]


def fill_lfm2_patches(images: Sequence[np.ndarray], out: np.ndarray, band: _Band, stopped: Callable[[], bool], *,
                      config: Lfm2ImageConfig) -> None:
    """One band of crops of the one image, resized (torchvision's antialiased bilinear) and written into `out`."""
    if stopped():
        return
    pixels = resize_bilinear(images[0], band.height, band.width, range(band.top, band.bottom))
    side = band.width // len(band.offsets)
    for c, offset in enumerate(band.offsets):
        _put_patches(out, offset, pixels[:, c * side:(c + 1) * side], config)


def _tokens(height: int, width: int, config: Lfm2ImageConfig) -> int:
    """Tokens of a crop after the projector's pixel unshuffle (transformers rounds each side up)."""
    patch, factor = config.encoder_patch_size, config.downsample_factor
    return math.ceil((height // patch) / factor) * math.ceil((width // patch) / factor)


def lfm2_image(rgb: np.ndarray, config: Lfm2ImageConfig, workers: PixelWorkers | None = None,
               deadline: Deadline | None = None) -> Lfm2Image:
    """RGB uint8 [H, W, 3] (already capped, spec 3.8 step 2) -> the processor's crops (spec 3.8 step 3): a large
    image (when splitting) becomes the grid's tiles, resized from the original image, plus a thumbnail at the
    smart size; any other image one crop at the smart size. Resizes are torchvision's antialiased bilinear.

    The pixel work runs in `workers` where given (in its processes when other media jobs run, as d3's images do),
    in parts of up to PART_ROWS rows of a row of tiles or of the thumbnail; the crops are views of one array of
    patches."""
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.dtype != np.uint8:
        raise ValueError(f"rgb: expected uint8 [H, W, 3], got {rgb.dtype} {rgb.shape}")
    height, width = rgb.shape[:2]
    if height < 1 or width < 1:
        raise ValueError(f"rgb: empty image {height}x{width}")
    new_height, new_width = smart_size(height, width, config)
    patch = config.encoder_patch_size
    patches = (new_height // patch) * (new_width // patch)
    if patches > config.max_num_patches:
        # A very thin image keeps its aspect at the minimum side: more patches than the processor pads a crop to,
        # which transformers' LFM2-VL cannot run either.
        raise ValueError(f"a {width}x{height} image resizes to {new_width}x{new_height}, {patches} patches, more "
                         f"than max_num_patches={config.max_num_patches}")
    thumbnail_tokens = _tokens(new_height, new_width, config)
    tile = config.tile_size
    tiled = config.splits and _too_large(height, width, config)
    if tiled:
        cols, rows = grid_layout(height, width, config)
        thumbnail = config.use_thumbnail and rows * cols != 1
        if not thumbnail:
            thumbnail_tokens = 0
    else:
        rows = cols = 1
        thumbnail = True  # the one crop, at the smart size as a thumbnail is
    grids = ([(tile // patch, tile // patch)] * (rows * cols) if tiled else []) + \
        [(new_height // patch, new_width // patch)] * thumbnail
    starts = np.cumsum([0] + [h * w for h, w in grids]).tolist()  # each crop's first row in the array of patches
    # The tiles' rows, cut from the whole image resized to the grid, then the thumbnail's, in parts of PART_ROWS.
    bands = [band for r in range(rows if tiled else 0)
             for band in _bands(tile * rows, tile * cols, r * tile, (r + 1) * tile, starts[r * cols:(r + 1) * cols],
                                config)]
    if thumbnail:
        bands += _bands(new_height, new_width, 0, new_height, starts[-2:-1], config)
    fill = partial(fill_lfm2_patches, config=config)
    run = workers.fill if workers is not None else fill_here
    out = run(fill, [rgb], (starts[-1], 3 * patch * patch), bands, deadline or Deadline())
    crops = [Lfm2Crop(out[start:end], grid, config.downsample_factor)
             for grid, start, end in zip(grids, starts[:-1], starts[1:], strict=True)]
    return Lfm2Image(tuple(crops), rows, cols, _tokens(tile, tile, config), thumbnail_tokens, out)


def placeholder_text(image: Lfm2Image) -> str:
    """Spec 3.8 step 4: the text replacing the prompt's `<image>` (what `Lfm2VlProcessor._build_image_tokens`
    builds with use_image_special_tokens=True). Tiled: `<|image_start|>`, per tile row-major
    `<|img_row_{r}_col_{c}|>` + `<image>`×tile_tokens, then `<|img_thumbnail|>` + `<image>`×thumbnail_tokens
    (when there is a thumbnail), `<|image_end|>`; one crop: start + `<image>`×tokens + end."""
    parts = [IMAGE_START]
    if image.tiled:
        for r in range(image.rows):
            for c in range(image.cols):
                parts.append(f"<|img_row_{r + 1}_col_{c + 1}|>" + IMAGE_TOKEN * image.tile_tokens)
        if len(image.crops) > image.rows * image.cols:
            parts.append(IMAGE_THUMBNAIL + IMAGE_TOKEN * image.thumbnail_tokens)
    else:
        parts.append(IMAGE_TOKEN * image.thumbnail_tokens)
    parts.append(IMAGE_END)
    return "".join(parts)
