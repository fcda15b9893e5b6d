"""Images read from files made into a network's input (deepdsl_runtime.image_transforms): the resampling against
torch's antialiased interpolation, the crop boxes against torchvision's RandomResizedCrop algorithm written here,
the evaluation transform against Resize + CenterCrop, the compiled render bit for bit the numpy one, the draws,
strict decoding of real and damaged files, and the --augment spec."""
from __future__ import annotations

import dataclasses
import io
import math
import pickle
import shutil
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

simplejpeg = pytest.importorskip("simplejpeg")
Image = pytest.importorskip("PIL.Image")

from deepdsl_runtime import image_transforms as it  # noqa: E402
from deepdsl_runtime.data import DataError  # noqa: E402
from tests.support.program_helpers import compile_program  # noqa: E402

TOLERANCE = 5e-5          # float32 sums of a few taps against torch's, on [0, 1] pixels


def photograph(name: str = "china.jpg") -> bytes:
    import sklearn
    return (Path(sklearn.__file__).parent / "datasets" / "images" / name).read_bytes()


def torch_resize(image: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    """(C, H', W') float: the uint8 (H, W, C) image / 255 resized as torchvision's tensor Resize(antialias=True)."""
    x = torch.tensor(image.astype(np.float32) / 255).permute(2, 0, 1)[None]
    return F.interpolate(x, size, mode="bilinear", antialias=True, align_corners=False)[0].numpy()


def rendered(image, plan, transform=it.ImageTransform(), native=None) -> np.ndarray:
    c = image.shape[2]
    out = np.empty((c, len(plan.rows[0]), len(plan.cols[0])), np.float32)
    scratch = np.empty(it.scratch_size(image.shape, plan), np.float32) if native is not None else None
    it.render(image, plan, *transform.scale_bias(c), out, scratch, native)
    return out


def reference_box(height, width, u, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision.transforms.RandomResizedCrop.get_params, its torch.empty(1).uniform_ and torch.randint draws
    replaced by the uniforms u (attempt t: u[2t] the area, u[2t + 1] the log ratio; u[20], u[21] the offsets)."""
    area = height * width
    log_ratio = torch.log(torch.tensor(ratio))
    for attempt in range(10):
        target_area = area * (scale[0] + (scale[1] - scale[0]) * u[2 * attempt])
        aspect_ratio = math.exp(float(log_ratio[0]) + float(log_ratio[1] - log_ratio[0]) * u[2 * attempt + 1])
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = int(u[20] * (height - h + 1))
            j = int(u[21] * (width - w + 1))
            return i, j, h, w
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


@pytest.mark.parametrize("height,width", [(375, 500), (500, 333), (31, 29), (8, 8), (3, 200)])
def test_crop_boxes_are_torchvision_random_resized_crop(height, width):
    for index in range(200):
        u = it.uniforms(7, 1, index)
        for scale in ((0.08, 1.0), (0.9, 1.0)):
            assert it.resized_crop_box(height, width, u, scale) == reference_box(height, width, u, scale)
    # every attempt failing: the central fallback (a strip of an image far wider than 4:3)
    u = np.full(it.UNIFORMS, 0.999)
    assert it.resized_crop_box(3, 200, u, (0.99, 1.0)) == reference_box(3, 200, u, (0.99, 1.0)) == (0, 98, 3, 4)


@pytest.mark.parametrize("channels", [3, 1])
def test_random_crops_resample_as_torch_antialiased_interpolation(channels):
    rng = np.random.default_rng(channels)
    image = rng.integers(0, 256, (120, 170, channels), dtype=np.uint8)
    transform = it.ImageTransform.parse("random-resized-crop:0.05,1,flip")
    for index in range(12):
        for out in ((32, 32), (96, 64), (150, 200)):                 # down- and upsampling, not square
            u = it.uniforms(3, 0, index)
            plan = it.plan(transform, 120, 170, *out, u, train=True)
            top, left, h, w = reference_box(120, 170, u, (0.05, 1.0))
            want = torch_resize(image[top:top + h, left:left + w], out)
            if u[22] < 0.5:
                want = want[:, :, ::-1]
            got = rendered(image, plan, transform)
            assert np.abs(got - want).max() < TOLERANCE


@pytest.mark.parametrize("height,width,out,fraction", [(375, 500, (224, 224), 0.875), (500, 375, (224, 224), 1.0),
                                                        (40, 60, (28, 28), 1.0), (50, 20, (32, 48), 1.0),
                                                        (8, 8, (28, 28), 1.0)])
def test_the_evaluation_transform_is_resize_then_centre_crop(height, width, out, fraction):
    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    transform = it.ImageTransform(center_crop=fraction)
    size = int(round(min(out) / fraction))
    resized_hw = (size, int(size * width / height)) if height <= width else (int(size * height / width), size)
    resized = torch_resize(image, resized_hw)
    # torchvision's CenterCrop: pad where the image is smaller, then crop at round((H' - h) / 2)
    pad = [max((o - r) // 2, 0) for o, r in zip(out, resized_hw)]
    pad_end = [max((o - r + 1) // 2, 0) for o, r in zip(out, resized_hw)]
    padded = np.pad(resized, ((0, 0), (pad[0], pad_end[0]), (pad[1], pad_end[1])))
    top, left = (int(round((p - o) / 2.0)) for p, o in zip(padded.shape[1:], out))
    want = padded[:, top:top + out[0], left:left + out[1]]
    got = rendered(image, it.plan(transform, height, width, *out, None, train=False))
    assert np.abs(got - want).max() < TOLERANCE
    # an image already of the network's size passes unchanged (fraction 1)
    same = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    np.testing.assert_array_equal(rendered(same, it.plan(it.ImageTransform(), 32, 32, 32, 32, None, False)),
                                  same.transpose(2, 0, 1).astype(np.float32) * np.float32(1 / 255))


def test_normalize_and_pad_crop():
    rng = np.random.default_rng(1)
    image = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    transform = it.ImageTransform.parse("normalize:imagenet,crop:4")
    scale, bias = transform.scale_bias(3)
    for index in range(10):
        u = it.uniforms(0, 0, index)
        got = rendered(image, it.plan(transform, 32, 32, 32, 32, u, train=True), transform)
        dy, dx = (int(u[23] * 9) - 4, int(u[24] * 9) - 4)
        plain = (image.astype(np.float32) / 255 - np.array(it.IMAGENET_MEAN)) / np.array(it.IMAGENET_STD)
        padded = np.pad(plain.transpose(2, 0, 1), ((0, 0), (4, 4), (4, 4)), constant_values=np.nan)
        want = padded[:, 4 + dy:36 + dy, 4 + dx:36 + dx]
        black = np.broadcast_to(bias[:, None, None], want.shape)
        want = np.where(np.isnan(want), black, want)
        assert np.abs(got - want).max() < 1e-5
    assert not np.array_equal(rendered(image, it.plan(transform, 32, 32, 32, 32, it.uniforms(0, 0, 1), False)),
                              rendered(image, it.plan(transform, 32, 32, 32, 32, it.uniforms(0, 0, 1), True)))


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("needs a C compiler")
    from deepdsl.codegen.native import build_library
    from deepdsl_runtime.cpu import native as kernels

    _, path = compile_program("mlp", tmp_path_factory.mktemp("render"), batch=2)
    built, why = build_library(path.with_suffix(".c"))
    assert built is not None, why
    found, why = kernels.load(path)
    assert found is not None, why
    return found


@pytest.mark.parametrize("channels", [3, 1])
def test_the_compiled_render_has_the_bits_of_numpy(native, channels):
    rng = np.random.default_rng(channels)
    image = rng.integers(0, 256, (97, 143, channels), dtype=np.uint8)
    for spec in ("random-resized-crop,flip,normalize:0.5/0.25", "center-crop:0.875", "flip,crop:3",
                 "random-resized-crop:0.9,1"):
        transform = it.ImageTransform.parse(spec)
        scale, bias = transform.scale_bias(channels)
        for index in range(8):
            # whole blocks of eight rows and columns and not, smaller than a block, up- and downsampling
            for out in ((24, 24), (64, 80), (200, 150), (7, 33), (13, 5)):
                plan = it.plan(transform, 97, 143, *out, it.uniforms(5, 2, index), train=index % 3 != 0)
                a = rendered(image, plan, transform)
                b = np.empty_like(a)
                scratch = np.full(it.scratch_size(image.shape, plan) + 16, np.nan, np.float32)
                it.render(image, plan, scale, bias, b, scratch[:-16], native)
                assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), (spec, index, out)
                assert np.isnan(scratch[-16:]).all()                # nothing written past the scratch asked for
    assert it.scratch_size((97, 143, channels), plan) <= it.scratch_bound(channels)
    whole = it.plan(it.ImageTransform(), 97, 143, 8, 8, None, False)          # (the compiled kernel did run)
    assert native.resample_image(image, *whole.rows, *whole.cols, scale, bias, np.empty((channels, 8, 8), np.float32),
                                 np.empty(it.scratch_size(image.shape, whole), np.float32))


def test_draws_are_keyed_by_seed_epoch_and_index():
    u = it.uniforms(11, 3, 12345)
    assert u.shape == (it.UNIFORMS,) and u.dtype == np.float64 and 0 <= u.min() and u.max() < 1
    np.testing.assert_array_equal(u, it.uniforms(11, 3, 12345))
    for other in (it.uniforms(12, 3, 12345), it.uniforms(11, 4, 12345), it.uniforms(11, 3, 12346),
                  it.uniforms(11, 3, 12344), it.uniforms(11, 2, 12345)):
        assert not np.intersect1d(other, u).size            # no draw shared, in any position
    flips = np.array([it.uniforms(0, 0, i)[22] < 0.5 for i in range(400)])
    assert 150 < flips.sum() < 250


# ----------------------------------------------------------------------------------------------------------------
# decoding

def pillow(data: bytes, mode: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert(mode))


def jpeg(array: np.ndarray, **kwargs) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="JPEG", quality=90, **kwargs)
    return buffer.getvalue()


@pytest.mark.parametrize("name", ["china.jpg", "flower.jpg"])
def test_real_photographs_decode_as_pillow_decodes_them(name):
    data = photograph(name)
    rgb = it.decode(data, 3)
    assert rgb.shape == (427, 640, 3) and rgb.dtype == np.uint8
    assert np.abs(rgb.astype(int) - pillow(data, "RGB")).mean() < 1.0     # libjpeg builds differ in rounding
    grey = it.decode(data, 1)
    assert grey.shape == (427, 640, 1)
    assert np.abs(grey[:, :, 0].astype(int) - pillow(data, "L")).mean() < 1.5


def test_grey_cmyk_palette_and_alpha_images_convert_to_the_networks_channels():
    rng = np.random.default_rng(0)
    grey = jpeg(rng.integers(0, 256, (20, 30), dtype=np.uint8))
    as_rgb = it.decode(grey, 3)
    assert as_rgb.shape == (20, 30, 3) and np.array_equal(as_rgb[..., 0], as_rgb[..., 2])
    cmyk = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (20, 30, 3), dtype=np.uint8)).convert("CMYK").save(cmyk, format="JPEG")
    decoded = it.decode(cmyk.getvalue(), 3)
    assert decoded.shape == (20, 30, 3)
    assert np.abs(decoded.astype(int) - pillow(cmyk.getvalue(), "RGB")).mean() < 3
    rgba = io.BytesIO()
    pixels = rng.integers(0, 256, (9, 7, 4), dtype=np.uint8)
    Image.fromarray(pixels, "RGBA").save(rgba, format="PNG")
    np.testing.assert_array_equal(it.decode(rgba.getvalue(), 3), pixels[..., :3])
    palette = io.BytesIO()
    Image.fromarray(pixels[..., :3]).convert("P").save(palette, format="PNG")
    assert it.decode(palette.getvalue(), 3).shape == (9, 7, 3)
    assert it.decode(palette.getvalue(), 1).shape == (9, 7, 1)


def test_damaged_files_raise_one_line_reasons():
    data = photograph()
    flipped = bytearray(data)
    for at in range(len(data) // 3, len(data) // 3 + 64):      # a run of flipped bytes in the entropy-coded data
        flipped[at] ^= 0x55
    png = io.BytesIO()
    Image.fromarray(np.zeros((40, 40, 3), np.uint8) + 7).save(png, format="PNG")
    cases = {"truncated JPEG": data[:len(data) // 2], "corrupt JPEG": bytes(flipped), "empty": b"",
             "not an image": b"hello, world\n" * 10, "truncated PNG": png.getvalue()[:len(png.getvalue()) // 2]}
    for what, damaged in cases.items():
        with pytest.raises(it.DecodeError) as err:
            it.decode(damaged, 3)
        assert "\n" not in str(err.value) and str(err.value), what
    # a header claiming more pixels than the limit is refused before decoding
    big = bytearray(jpeg(np.zeros((8, 8, 3), np.uint8)))
    sof = big.index(b"\xff\xc0")
    big[sof + 5:sof + 9] = (20000).to_bytes(2, "big") + (20000).to_bytes(2, "big")
    with pytest.raises(it.DecodeError, match="exceeds the limit"):
        it.decode(bytes(big), 3)
    big[sof + 5:sof + 9] = (8).to_bytes(2, "big") + (40000).to_bytes(2, "big")
    with pytest.raises(it.DecodeError, match="a side longer than the limit"):
        it.decode(bytes(big), 3)
    # so is a PNG's, also past Pillow's own limit (which it enforces on opening); a damaged header names the format
    header = bytearray(png.getvalue())
    ihdr = header.index(b"IHDR")
    header[ihdr + 4:ihdr + 12] = (20000).to_bytes(4, "big") * 2
    with pytest.raises(it.DecodeError, match="corrupt PNG"):                        # its checksum is now wrong
        it.decode(bytes(header), 3)
    header[ihdr + 17:ihdr + 21] = zlib.crc32(bytes(header[ihdr:ihdr + 17])).to_bytes(4, "big")
    with pytest.raises(it.DecodeError, match="^image of 400000000 pixels exceeds the limit of 67108864$"):
        it.decode(bytes(header), 3)
    with pytest.raises(it.DecodeError, match="^not an image"):
        it.decode(b"hello, world\n" * 10, 3)


def test_decoders_missing(monkeypatch):
    data = photograph("flower.jpg")
    monkeypatch.setitem(sys.modules, "simplejpeg", None)                 # (an import of it raises ImportError)
    np.testing.assert_array_equal(it.decode(data, 3), pillow(data, "RGB"))     # Pillow decodes JPEG then
    assert it.decoder_versions().startswith("Pillow ")
    monkeypatch.setitem(sys.modules, "PIL", None)
    with pytest.raises(it.DecodeError, match=r'pip install "deepdsl\[images\]"'):
        it.decode(data, 3)
    assert it.decoder_versions() == "none"
    # and the runtime imports without either
    code = ("import sys; sys.modules['PIL'] = sys.modules['simplejpeg'] = None; "
            "from deepdsl_runtime import image_transforms, image_stream; print(image_transforms.MOST_PIXELS)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == str(it.MOST_PIXELS), done.stderr


# ----------------------------------------------------------------------------------------------------------------
# the --augment spec

def test_the_augment_spec():
    t = it.ImageTransform.parse("random-resized-crop:0.08,1,flip,normalize:0.485,0.456,0.406/0.229,0.224,0.225")
    assert t.resized_crop == (0.08, 1.0) and t.flip and t.mean == it.IMAGENET_MEAN and t.std == it.IMAGENET_STD
    assert t.fraction == 0.875 and it.ImageTransform.parse("none").fraction == 1.0
    assert it.ImageTransform.parse("random-resized-crop").resized_crop == (0.08, 1.0)
    assert it.ImageTransform.parse("center-crop:0.9,crop:4").crop == 4
    scale, bias = it.ImageTransform.parse("normalize:0.5/0.25").scale_bias(3)
    np.testing.assert_allclose(scale, 1 / (255 * 0.25)) and np.testing.assert_allclose(bias, -2)
    for bad in ("mirror", "flip,flip", "random-resized-crop:0.5", "random-resized-crop:0,1", "normalize:1/0",
                "normalize:imagenet,normalize:imagenet", "center-crop:1.5", "crop:0", "flip:1"):
        with pytest.raises(DataError, match="--augment") as err:
            it.ImageTransform.parse(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(DataError, match="3 means.*1 channels"):
        it.ImageTransform.parse("normalize:imagenet").scale_bias(1)
    # sent to the decoding workers: picklable, and frozen
    assert pickle.loads(pickle.dumps(t)) == t
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.flip = False
