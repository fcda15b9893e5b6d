"""Images read from files made into a network's input: decoding, the random draws of a sample, the crop box, the
antialiased resampling plan and the one pass that renders it (torchvision's semantics throughout).

- `decode(data, channels)`: JPEG (recognized by its signature) by simplejpeg, strict: a truncated or corrupt file is
  an error, never a silently wrong image; other formats (PNG, BMP, WebP, TIFF, PPM) by Pillow. Grey (1 channel:
  ITU-R 601 luma, as Pillow's `convert("L")`) or RGB (grey and CMYK converted, alpha dropped); uint8 (H, W, C).
  Images over MOST_PIXELS are refused from their header, before any decoding.
- `ImageTransform.parse(spec)`: the `--augment` spec of images read from files.
- `uniforms(seed, epoch, index)`: a sample's draws from a counter-based generator (numpy's Philox keyed by the
  seed, counter (0, index, epoch, 0)): any sample's draws without the others'. Layout: [0, 20) the 10 attempts of
  RandomResizedCrop (area, log ratio), 20 and 21 its top and left, 22 the flip, 23 and 24 crop:P's offsets.
- `resized_crop_box`: RandomResizedCrop.get_params with those draws; `plan`: the rows and columns of a render, the
  random box or the evaluation transform (Resize(int) then CenterCrop), flipped by reversing the columns.
- `render`: one pass from the decoded image to the float32 (C, OH, OW) rows of a batch slot: the rows' taps over
  the columns the plan reads, the columns' taps, then x scale + bias (normalization). The weights come from
  `axis_plan` (PIL's triangle filter, as `interpolate(mode="bilinear", antialias=True)`), computed once here; the
  compiled kernel (`kernels/cpu_images.c`) and the numpy path sum the taps in the same order in float32, so
  their bits are the same.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

from deepdsl_runtime.data import DataError

__all__ = ["DecodeError", "ImageTransform", "MOST_PIXELS", "MOST_SIDE", "Plan", "UNIFORMS", "axis_plan", "decode",
           "decoder_versions", "plan", "render", "resized_crop_box", "scratch_bound", "scratch_size", "uniforms"]

MOST_PIXELS = 1 << 26            # larger images are refused (decompression bombs; the workers' memory stays bounded)
MOST_SIDE = 1 << 15              # so is a side longer than this (the render's scratch grows with the height)
UNIFORMS = 25
ATTEMPTS = 10                    # RandomResizedCrop's
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
EVAL_FRACTION = 0.875            # ImageNet's evaluation: resize to 256, centre-crop 224
_KEY = 0x1A6E5                   # the second word of the generator's key: these draws, not another stream's


class DecodeError(Exception):
    """An image that cannot be decoded (the reason only; the caller names the file)."""


# ----------------------------------------------------------------------------------------------------------------
# decoding

def decoder_versions() -> str:
    """The decoders this process has and their versions (pixels depend on the libjpeg build): recorded in
    checkpoints."""
    found = []
    try:
        import simplejpeg
        found.append(f"simplejpeg {simplejpeg.__version__}")
    except ImportError:
        pass
    try:
        import PIL
        found.append(f"Pillow {PIL.__version__}")
    except ImportError:
        pass
    return "; ".join(found) or "none"


def _too_large(h: int, w: int) -> None:
    if h * w > MOST_PIXELS:
        raise DecodeError(f"image of {w}x{h} pixels exceeds the limit of {MOST_PIXELS}")
    if max(h, w) > MOST_SIDE:
        raise DecodeError(f"image of {w}x{h} pixels: a side longer than the limit of {MOST_SIDE}")


def decode(data: bytes, channels: int) -> np.ndarray:
    """The image in `data` as uint8 (H, W, channels), channels 1 or 3; DecodeError(reason) where it cannot be."""
    if not data:
        raise DecodeError("empty file")
    if data[:3] == b"\xff\xd8\xff":
        try:
            import simplejpeg
        except ImportError:
            return _pillow(data, channels)
        try:
            w, h, _, _ = simplejpeg.decode_jpeg_header(data)
        except ValueError as err:
            raise DecodeError(f"corrupt JPEG (simplejpeg: {err})") from None
        _too_large(h, w)
        try:
            image = simplejpeg.decode_jpeg(data, colorspace="GRAY" if channels == 1 else "RGB", strict=True)
        except ValueError as err:
            raise DecodeError(f"truncated or corrupt JPEG (simplejpeg: {err})") from None
        return image if image.ndim == 3 else image[:, :, None]
    return _pillow(data, channels)


def _pillow(data: bytes, channels: int) -> np.ndarray:
    try:
        from PIL import Image, ImageFile
    except ImportError:
        raise DecodeError('no decoder for this image: pip install "deepdsl[images]" (simplejpeg and Pillow)') from None
    import io
    import warnings

    ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with Image.open(io.BytesIO(data)) as image:
                _too_large(image.height, image.width)
                image.load()
                mode = "L" if channels == 1 else "RGB"
                if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
                    image = image.convert("RGBA" if channels == 3 else "LA")
                converted = image.convert(mode)
                array = np.asarray(converted, dtype=np.uint8)
    except DecodeError:
        raise
    except Image.UnidentifiedImageError:
        kind = _signature(data)
        if kind:
            raise DecodeError(f"corrupt {kind} (Pillow cannot read its header)") from None
        raise DecodeError("not an image (no JPEG, PNG, BMP, WebP, TIFF or PPM signature)") from None
    except Image.DecompressionBombError as err:          # Pillow's own limit, over ours, refused on opening
        pixels = re.search(r"\((\d+) pixels\)", str(err))
        raise DecodeError(f"image of {pixels[1] if pixels else 'more'} pixels exceeds the limit of {MOST_PIXELS}") \
            from None
    except (OSError, ValueError, SyntaxError, EOFError) as err:
        raise DecodeError(f"truncated or corrupt image (Pillow: {err})") from None
    return array if array.ndim == 3 else array[:, :, None]


def _signature(data: bytes) -> str:
    """The format whose signature `data` starts with, or ""."""
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WebP"
    if data[:4] in (b"II*\x00", b"MM\x00*"):
        return "TIFF"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if data[:2] == b"BM":
        return "BMP"
    return ""


# ----------------------------------------------------------------------------------------------------------------
# the transform spec

@dataclass(frozen=True)
class ImageTransform:
    """What `--augment` asks of images read from files. Spec: `none`, or items joined by commas:
    random-resized-crop[:MIN,MAX] (default 0.08,1), flip, normalize:imagenet | normalize:M/S |
    normalize:M1,M2,M3/S1,S2,S3, center-crop:F (the evaluation transform's crop fraction, 0 < F <= 1), crop:P (pad
    P zeros and crop back at random after the evaluation transform). A comma-separated number continues the
    previous item's value."""
    resized_crop: tuple[float, float] | None = None
    ratio: tuple[float, float] = (3 / 4, 4 / 3)
    flip: bool = False
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    center_crop: float | None = None
    crop: int = 0

    @classmethod
    def parse(cls, spec: str) -> "ImageTransform":
        usage = ("use none, or random-resized-crop[:MIN,MAX], flip, normalize:imagenet|MEAN/STD, center-crop:F and "
                 "crop:P joined by commas")
        items: list[list[str]] = []
        if spec != "none":
            for token in str(spec).split(","):
                if items and _number(token):
                    items[-1][1] += "," + token
                else:
                    name, _, value = token.partition(":")
                    items.append([name, value])
        fields: dict = {}
        for name, value in items:
            key = {"random-resized-crop": "resized_crop", "flip": "flip", "normalize": "mean",
                   "center-crop": "center_crop", "crop": "crop"}.get(name)
            if key is None or key in fields:
                raise DataError(f"--augment {spec!r}: {'unknown item ' + repr(name) if key is None else name + ' twice'}"
                                f"; {usage}")
            try:
                if key == "resized_crop":
                    low, high = (float(v) for v in value.split(",")) if value else (0.08, 1.0)
                    if not 0 < low <= high <= 1:
                        raise ValueError
                    fields[key] = (low, high)
                elif key == "flip":
                    if value:
                        raise ValueError
                    fields[key] = True
                elif key == "mean":
                    if value == "imagenet":
                        mean, std = IMAGENET_MEAN, IMAGENET_STD
                    else:
                        m, s = value.split("/")
                        mean, std = tuple(float(v) for v in m.split(",")), tuple(float(v) for v in s.split(","))
                    if len(mean) != len(std) or not all(math.isfinite(v) for v in mean + std) or min(std) <= 0:
                        raise ValueError
                    fields["mean"], fields["std"] = mean, std
                elif key == "center_crop":
                    fraction = float(value)
                    if not 0 < fraction <= 1:
                        raise ValueError
                    fields[key] = fraction
                else:
                    if not value.isdigit() or int(value) < 1:
                        raise ValueError
                    fields[key] = int(value)
            except ValueError:
                what = {"resized_crop": "random-resized-crop:MIN,MAX takes 0 < MIN <= MAX <= 1",
                        "flip": "flip takes no value",
                        "mean": "normalize takes imagenet, M/S or M1,M2,M3/S1,S2,S3 (finite, std > 0)",
                        "center_crop": "center-crop:F takes 0 < F <= 1", "crop": "crop:P takes P > 0"}[key]
                raise DataError(f"--augment {spec!r}: {what}") from None
        return cls(**fields)

    def scale_bias(self, channels: int) -> tuple[np.ndarray, np.ndarray]:
        """Per channel, out = pixel x scale + bias: 1 / (255 std) and -mean / std (without normalize 1/255, 0)."""
        if not self.mean:
            return np.full(channels, 1 / 255, np.float32), np.zeros(channels, np.float32)
        mean, std = self.mean, self.std
        if len(mean) == 1:
            mean, std = mean * channels, std * channels
        if len(mean) != channels:
            raise DataError(f"--augment normalize gives {len(mean)} means, the network's images have {channels} "
                            "channels")
        m, s = np.array(mean, np.float64), np.array(std, np.float64)
        return (1 / (255 * s)).astype(np.float32), (-m / s).astype(np.float32)

    @property
    def fraction(self) -> float:
        """The evaluation transform's crop fraction."""
        if self.center_crop is not None:
            return self.center_crop
        return EVAL_FRACTION if self.resized_crop else 1.0


def _number(token: str) -> bool:
    try:
        float(token.split("/")[0])
        return True
    except ValueError:
        return False


# ----------------------------------------------------------------------------------------------------------------
# draws, boxes, plans

def uniforms(seed: int, epoch: int, index: int) -> np.ndarray:
    """The UNIFORMS draws in [0, 1) of sample `index` in epoch `epoch`."""
    # Philox counts its blocks in the counter's first word: (index, epoch) in the others, so that no two samples'
    # streams overlap (index in the first word, sample i + 1's draws would be sample i's moved by one block)
    bits = np.random.Philox(counter=[0, index, epoch, 0], key=[seed, _KEY])
    return np.random.Generator(bits).random(UNIFORMS)


def resized_crop_box(height: int, width: int, u, scale: tuple[float, float],
                     ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """(top, left, h, w) of RandomResizedCrop(scale, ratio).get_params, its draws taken from `u`."""
    area = height * width
    log_low, log_high = math.log(ratio[0]), math.log(ratio[1])
    for t in range(ATTEMPTS):
        target = area * (scale[0] + (scale[1] - scale[0]) * u[2 * t])
        aspect = math.exp(log_low + (log_high - log_low) * u[2 * t + 1])
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return int(u[20] * (height - h + 1)), int(u[21] * (width - w + 1)), h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def axis_plan(lo: int, length: int, out_len: int, first: int, count: int,
              size: int) -> tuple[np.ndarray, np.ndarray]:
    """Resampling the source interval [lo, lo + length) of an axis of `size` to `out_len` positions, of which
    first .. first + count - 1 are produced: (first source index int32 (count,), weights float32 (count, taps)).
    PIL's triangle filter (support max(scale, 1), weights normalized), as torch's antialiased bilinear
    interpolation; positions outside [0, out_len) get zero weights. The taps of a position are all inside the axis
    (a position whose taps would pass its end starts earlier, with leading zero weights)."""
    scale = length / out_len
    support = max(scale, 1.0)
    inverse = 1 / scale if scale >= 1 else 1.0
    o = np.arange(first, first + count, dtype=np.float64)
    inside = (o >= 0) & (o < out_len)
    center = scale * (o + 0.5)
    xmin = np.maximum(np.trunc(center - support + 0.5), 0)
    xsize = np.where(inside, np.maximum(np.minimum(np.trunc(center + support + 0.5), length) - xmin, 0), 0)
    taps = max(int(xsize.max()) if count else 1, 1)
    starts = np.where(inside, lo + xmin, 0)
    shift = np.maximum(starts + taps - size, 0)          # taps past the axis: start earlier, weights later
    j = np.arange(taps) - shift[:, None]                  # the tap each weight is
    w = np.maximum(1 - np.abs((j + xmin[:, None] - center[:, None] + 0.5) * inverse), 0)
    w[(j < 0) | (j >= xsize[:, None])] = 0
    total = w.sum(axis=1, keepdims=True)
    w /= np.where(total == 0, 1, total)
    return (starts - shift).astype(np.int32), w.astype(np.float32)


@dataclass(frozen=True)
class Plan:
    """What `render` does for one image: the rows' and columns' (first source index, weights), and crop:P's shift
    of the output (dy, dx), or None."""
    rows: tuple[np.ndarray, np.ndarray]
    cols: tuple[np.ndarray, np.ndarray]
    shift: tuple[int, int] | None = None


def plan(transform: ImageTransform, height: int, width: int, out_h: int, out_w: int, u, train: bool) -> Plan:
    """The render of an image of height x width to out_h x out_w: for training with `resized_crop`, the random box;
    else the evaluation transform (Resize(S) of the short side, S = round(min(out) / fraction), then CenterCrop);
    flipped and shifted as the draws `u` say (training only)."""
    if train and transform.resized_crop:
        top, left, h, w = resized_crop_box(height, width, u, transform.resized_crop, transform.ratio)
        rows = axis_plan(top, h, out_h, 0, out_h, height)
        cols = axis_plan(left, w, out_w, 0, out_w, width)
    else:
        s = int(round(min(out_h, out_w) / transform.fraction))
        if width <= height:
            new_w, new_h = s, int(s * height / width)
        else:
            new_h, new_w = s, int(s * width / height)
        rows = axis_plan(0, height, new_h, _centre(new_h, out_h), out_h, height)
        cols = axis_plan(0, width, new_w, _centre(new_w, out_w), out_w, width)
    if train and transform.flip and u[22] < 0.5:
        cols = (cols[0][::-1].copy(), cols[1][::-1].copy())
    shift = None
    if train and transform.crop:
        p = transform.crop
        shift = (int(u[23] * (2 * p + 1)) - p, int(u[24] * (2 * p + 1)) - p)
    return Plan(rows, cols, shift)


def _centre(resized: int, out: int) -> int:
    """The first resized position CenterCrop(out) keeps (negative: it pads, as torchvision's)."""
    if resized >= out:
        return int(round((resized - out) / 2.0))
    return -((out - resized) // 2)


# ----------------------------------------------------------------------------------------------------------------
# rendering

ROWS = 8                         # output rows the compiled render takes at a time (kernels/cpu_images.c)


def _columns_read(plan_: Plan) -> tuple[int, int]:
    """[x0, x1): the source columns the plan reads."""
    starts, weights = plan_.cols
    return int(starts.min()), int(starts.max()) + weights.shape[1]


def scratch_size(image_shape: tuple[int, ...], plan_: Plan) -> int:
    """Floats of scratch `render` needs: the rows' taps of ROWS output rows over the columns the plan reads."""
    x0, x1 = _columns_read(plan_)
    return (x1 - x0) * image_shape[2] * ROWS


def scratch_bound(channels: int) -> int:
    """The most floats `scratch_size` asks for, whatever the image (sides are at most MOST_SIDE)."""
    return MOST_SIDE * channels * ROWS


def render(image: np.ndarray, plan_: Plan, scale: np.ndarray, bias: np.ndarray, out: np.ndarray,
           scratch: np.ndarray | None = None, native=None) -> None:
    """out (C, OH, OW) float32 <- the image (H, W, C) uint8 resampled by `plan_`, x scale + bias per channel; then
    crop:P's shift, the uncovered border the value of a zero pixel (black). With `native` (the program's compiled
    kernels, `Native.resample_image`) and `scratch` (scratch_size floats), the same bits by the compiled kernel."""
    image = np.ascontiguousarray(image)
    (ys, wy), (xs, wx) = plan_.rows, plan_.cols
    if scratch is None or native is None or not native.resample_image(image, ys, wy, xs, wx, scale, bias, out,
                                                                       scratch):
        x0, x1 = _columns_read(plan_)
        part = image[:, x0:x1]
        rows = np.zeros((len(ys), x1 - x0, image.shape[2]), np.float32)
        for t in range(wy.shape[1]):         # acc = acc + w_t x_t tap by tap, the kernel's order: the rows' taps,
            rows += wy[:, t, None, None] * part[ys + t].astype(np.float32)
        acc = np.zeros((len(ys), len(xs), image.shape[2]), np.float32)
        for t in range(wx.shape[1]):         # then the columns'
            acc += wx[None, :, t, None] * rows[:, xs - x0 + t]
        out[...] = (acc * scale + bias).transpose(2, 0, 1)
    if plan_.shift is not None:
        dy, dx = plan_.shift
        _shift(out, dy, dx, bias)


def _shift(out: np.ndarray, dy: int, dx: int, fill: np.ndarray) -> None:
    """out[:, i, j] <- out[:, i + dy, j + dx], `fill` where that lies outside (data.Augment's crop of the padded
    image)."""
    _, h, w = out.shape
    moved = np.empty_like(out)
    moved[...] = fill[:, None, None]
    ys, yd = slice(max(dy, 0), min(h + dy, h)), slice(max(-dy, 0), min(h - dy, h))
    xs, xd = slice(max(dx, 0), min(w + dx, w)), slice(max(-dx, 0), min(w - dx, w))
    moved[:, yd, xd] = out[:, ys, xs]
    out[...] = moved
