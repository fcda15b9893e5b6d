"""The input pipeline of images read from files against a PyTorch DataLoader, side by side, and the share of a
ResNet-50 step spent waiting for it.

    python benchmarks/data_pipeline.py [--images 512] [--rounds 3] [--workers 1 2] [--batch 32] [--dir DIR]
                                       [--train] [--markdown]

Data: ImageNet-size JPEGs (about 500x375, quality 90) cut from scikit-learn's two bundled photographs (random
crops, scales and mirrors), in the ImageFolder layout with 8 classes, and the same packed as tar shards (`deepdsl
data pack`); made once in --dir (default: a temporary directory).

Sides, each decoding the training images with RandomResizedCrop(224) + horizontal flip + ImageNet normalization to
float32 3x224x224, batches of --batch, with W worker processes:
- folder / shards: deepdsl's pipeline (`image_stream.Pipeline` and `ImageBatches`, the compiled render of a program
  built here), `next()` in a loop;
- torch: `torch.utils.data.DataLoader(num_workers=W, persistent_workers=True)` over a Dataset that decodes with
  Pillow and transforms as torchvision's RandomResizedCrop, RandomHorizontalFlip, ToTensor and Normalize do
  (torchvision's crop-box algorithm written here; Pillow's bilinear resize of the box).
Every side runs in its own process, interleaved in rounds; a round's figure is the images a second over the
batches of one pass after a warm-up batch. The table gives the median over rounds, per worker and the ratio to
torch's (above 1: faster than torch). The load average is printed before and after, with the processor's vector
extensions and the decoders' versions.

--train: ResNet-50 (batch 8, 112x112) trained from the JPEG folder for a few iterations with 2 workers; prints the
share of the training time the steps waited for images (the report's `input_pipeline.data_wait_share`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import load_average  # benchmarks/ is on the path of a script run from it

ROOT = Path(__file__).resolve().parents[1]
CLASSES = 8
SIZE = 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
AUGMENT = "random-resized-crop,flip,normalize:imagenet"


def isa() -> str:
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE"


# ----------------------------------------------------------------------------------------------------------------
# the data

def make_images(directory: Path, count: int) -> None:
    """`count` JPEGs of about 500x375 in directory/train/<class>/ and a tenth as many in directory/val/."""
    import numpy as np
    import sklearn
    from PIL import Image

    if (directory / "train").is_dir():
        return
    photos = [Image.open(Path(sklearn.__file__).parent / "datasets" / "images" / name).convert("RGB")
              for name in ("china.jpg", "flower.jpg")]
    rng = random.Random(0)
    for split, n in (("train", count), ("val", max(count // 10, CLASSES))):
        for i in range(n):
            photo = photos[i % 2]
            w, h = rng.randint(300, 427), rng.randint(225, 320)
            left, top = rng.randint(0, photo.width - w), rng.randint(0, photo.height - h)
            image = photo.crop((left, top, left + w, top + h)).resize((rng.randint(480, 520), rng.randint(360, 390)),
                                                                        Image.BILINEAR)
            if rng.random() < 0.5:
                image = image.transpose(Image.FLIP_LEFT_RIGHT)
            path = directory / split / f"class{i % CLASSES}" / f"{i:06d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            image.save(path, format="JPEG", quality=90)
    del np


def make_shards(directory: Path) -> str:
    out = directory.with_name(directory.name + "-shards")
    if not out.is_dir():
        done = subprocess.run([sys.executable, "-m", "deepdsl", "data", "pack", f"folder:{directory}", "-o", str(out),
                               "--shard-bytes", "64MB"], capture_output=True, text=True, check=True)
        del done
    return f"shards:{out}"


def kernels_library(directory: Path) -> str:
    """The compiled render: the library of a small program built here."""
    program = directory / "lenet.py"
    subprocess.run([sys.executable, "-m", "deepdsl", "compile", str(ROOT / "networks" / "lenet.py"), "-o",
                    str(program)], capture_output=True, check=True)
    from deepdsl_runtime.cpu import native
    path = native.library_path(program.with_suffix(".c"))
    deadline = time.monotonic() + 300
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return str(path)


# ----------------------------------------------------------------------------------------------------------------
# sides (one process each)

def side_ours(spec: str, workers: int, batch: int, library: str) -> dict:
    from deepdsl_runtime import image_stream
    from deepdsl_runtime.image_transforms import ImageTransform

    data = image_stream.load(spec, (3, SIZE, SIZE), 1000)
    pipeline = image_stream.Pipeline(data, ImageTransform.parse(AUGMENT), batch, 3, workers, 0, library)
    try:
        batches = image_stream.ImageBatches(pipeline, "train", batch, batch, 0, 0, train=True)
        count = len(data.train) // batch
        batches.next()
        began = time.perf_counter()
        for _ in range(count):
            batches.next()
        seconds = time.perf_counter() - began
    finally:
        pipeline.close()
    return {"images_per_second": count * batch / seconds}


def _box(height: int, width: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params (scale 0.08-1, ratio 3/4-4/3)."""
    area = height * width
    log_ratio = (math.log(3 / 4), math.log(4 / 3))
    for _ in range(10):
        target = area * rng.uniform(0.08, 1.0)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    return 0, 0, height, width


class TorchImages:
    """A torch Dataset of (image, label): Pillow decode, RandomResizedCrop, flip, ToTensor, Normalize."""

    def __init__(self, directory: str):
        root = Path(directory) / "train"
        classes = sorted(p.name for p in root.iterdir() if p.is_dir())
        self.items = [(str(p), c) for c, name in enumerate(classes) for p in sorted((root / name).iterdir())]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        import numpy as np
        import torch
        from PIL import Image

        path, label = self.items[i]
        rng = random.Random(i)
        with Image.open(path) as image:
            image = image.convert("RGB")
            top, left, h, w = _box(image.height, image.width, rng)
            image = image.resize((SIZE, SIZE), Image.BILINEAR, box=(left, top, left + w, top + h))
            if rng.random() < 0.5:
                image = image.transpose(Image.FLIP_LEFT_RIGHT)
            x = torch.from_numpy(np.asarray(image, dtype=np.uint8).copy()).permute(2, 0, 1).float().div_(255)
        x.sub_(torch.tensor(MEAN)[:, None, None]).div_(torch.tensor(STD)[:, None, None])
        return x, label


def side_torch(directory: str, workers: int, batch: int) -> dict:
    import torch

    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(TorchImages(directory), batch_size=batch, shuffle=True, drop_last=True,
                                         num_workers=workers, persistent_workers=True, prefetch_factor=2)
    iterator = iter(loader)
    next(iterator)
    count = len(loader) - 1
    began = time.perf_counter()
    for _ in range(count):
        next(iterator)
    seconds = time.perf_counter() - began
    return {"images_per_second": count * batch / seconds}


def run_side(side: str, args: list[str]) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    done = subprocess.run([sys.executable, __file__, "--side", side, *args], capture_output=True, text=True, env=env,
                          timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{side} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------------

def train_resnet(directory: Path, work: Path, iters: int) -> dict:
    program = work / "resnet50.py"
    subprocess.run([sys.executable, "-m", "deepdsl", "compile", str(ROOT / "networks" / "resnet50.py"), "--batch",
                    "8", "--image", "112", "-o", str(program)], capture_output=True, check=True)
    report = work / "resnet50.json"
    done = subprocess.run([sys.executable, str(program), "--data", f"folder:{directory}", "--iters", str(iters),
                           "--test-iters", "0", "--augment", AUGMENT, "--workers", "2", "--params",
                           str(work / "resnet50.npz"), "--fresh", "--report-json", str(report), "--quiet"],
                          capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise SystemExit(f"resnet50 failed:\n{done.stderr[-3000:]}")
    return json.loads(report.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dir", help="where the images are made (kept; reused when there)")
    parser.add_argument("--train", action="store_true", help="also ResNet-50 trained from the folder: its data wait")
    parser.add_argument("--iters", type=int, default=8, help="ResNet-50's iterations with --train")
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    parser.add_argument("--library", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        workers = args.workers[0]
        result = (side_torch(args.spec, workers, args.batch) if args.side == "torch" else
                  side_ours(args.spec, workers, args.batch, args.library))
        print(json.dumps(result))
        return

    from deepdsl_runtime.image_transforms import decoder_versions
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="deepdsl-data-"))
    images = work / "images"
    make_images(images, args.images)
    shards = make_shards(images)
    library = kernels_library(work)
    print(f"{args.images} JPEGs of about 500x375 in {images}; {isa()}; {os.cpu_count()} cores; {decoder_versions()}; "
          f"load {load_average()}")
    specs = {"folder": f"folder:{images}", "shards": shards, "torch": str(images)}
    results: dict[tuple[str, int], list[float]] = {}
    for round_ in range(args.rounds):
        for workers in args.workers:
            for side, spec in specs.items():
                common = ["--workers", str(workers), "--batch", str(args.batch), "--spec", spec, "--library", library]
                figure = run_side("torch" if side == "torch" else "ours", common)["images_per_second"]
                results.setdefault((side, workers), []).append(figure)
                print(f"round {round_ + 1}: {side:6s} {workers} worker(s) {figure:8.1f} images/s", flush=True)
    print(f"load {load_average()}")
    rows = []
    for workers in args.workers:
        theirs = statistics.median(results[("torch", workers)])
        for side in specs:
            median = statistics.median(results[(side, workers)])
            rows.append((side, workers, median, median / workers, median / theirs))
    if args.markdown:
        print("| side | workers | images/s | per worker | vs torch |\n|---|---|---|---|---|")
        for side, workers, median, per, ratio in rows:
            print(f"| {side} | {workers} | {median:.0f} | {per:.0f} | {ratio:.2f}x |")
    else:
        for side, workers, median, per, ratio in rows:
            print(f"{side:6s} {workers} worker(s): {median:8.1f} images/s, {per:7.1f} per worker, {ratio:.2f}x torch")
    if args.train:
        report = train_resnet(images, work, args.iters)
        pipeline = report["input_pipeline"]
        print(f"ResNet-50 batch 8 at 112x112 from the JPEG folder, 2 workers, {args.iters} iterations: "
              f"{report['seconds_per_iter'] * 1000:.0f} ms an iteration, data wait "
              f"{100 * pipeline['data_wait_share']:.1f} % of the last batches' time "
              f"({pipeline['data_wait_seconds']:.2f} s in all); load {load_average()}")


if __name__ == "__main__":
    main()
