"""The input pipeline of images read from files against a PyTorch DataLoader, side by side, and the share of a
ResNet-50 step spent waiting for it.

    python benchmarks/data_pipeline.py [--images 512] [--rounds 3] [--workers 1 2] [--batch 32] [--dir DIR]
                                       [--train] [--iters 6] [--markdown]

Data: --images ImageNet-size JPEGs (about 500x375, quality 90) cut from scikit-learn's two bundled photographs
(random crops, scales and mirrors) in the ImageFolder layout (DIR/train/<class>/*.jpg, 8 classes, and a tenth as
many in DIR/val/), and the same packed as tar shards by `deepdsl data pack`; made once in --dir (default: a
temporary directory) and reused from there.

Sides, each turning the training images into batches of --batch float32 3x224x224 with RandomResizedCrop (scale
0.08-1, ratio 3/4-4/3), a horizontal flip and ImageNet's normalization, on W worker processes:
- folder / shards: deepdsl's pipeline on `folder:DIR` / `shards:'DIR/train-{000000..00000N}.tar'` (the pattern
  `pack` prints; `image_stream.Pipeline` with the compiled render of a program built here, 3 batch slots as a
  program's default --prefetch 2; `ImageBatches.next()` in a loop, nothing else);
- torch: `torch.utils.data.DataLoader(num_workers=W, persistent_workers=True, shuffle=True, drop_last=True)` over
  a Dataset that does what torchvision's ImageFolder loader, RandomResizedCrop, RandomHorizontalFlip, ToTensor and
  Normalize do (torchvision is not needed: its crop-box algorithm is written here, with the central fallback after
  10 attempts; Pillow decodes and resizes the box bilinearly).
Each side runs in a process of its own; the sides alternate in rounds (their order turning from round to round),
so a busy moment of a shared machine falls on all of them alike. A run's figure: the images a second of the
batches of one pass over the training images, after a warm-up batch (the same images for every side). The table
gives the median over the rounds, the slowest and fastest round, the figure per worker (each worker is a core's
work) and the ratio to torch's with as many workers (above 1: faster than torch; the issue's target is 1.3x). The
load average is printed before and after, with the processor's vector extensions and the decoders' versions.

--train: ResNet-50 (batch 8, 112x112, compiled kernels) trained from the JPEG folder for --iters iterations with
the same augmentation and the program's default workers (the cores); prints the seconds an iteration and the share
of the time the steps waited for images (the report's `input_pipeline.data_wait_share`, measured over the steps
after the first; the target is under 5 % on 2 cores), and the whole wait including the workers' start.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from timing import load_average, print_row, processor  # benchmarks/ is on the path of a script run from it

ROOT = Path(__file__).resolve().parents[1]
CLASSES = 8
SIZE = 224
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
SCALE, RATIO = (0.08, 1.0), (3 / 4, 4 / 3)
AUGMENT = "random-resized-crop,flip,normalize:imagenet"
SLOTS = 3                                  # a program's default: --prefetch 2, and the slot of the batch in use
SIDES = ("folder", "shards", "torch")


# ----------------------------------------------------------------------------------------------------------------
# the data

def make_images(directory: Path, count: int) -> None:
    """`count` JPEGs of about 500x375 in directory/train/<class>/ and a tenth as many in directory/val/ (made in a
    temporary directory renamed at the end: a folder found there is whole)."""
    import sklearn
    from PIL import Image

    if directory.is_dir():
        return
    photos = [Image.open(Path(sklearn.__file__).parent / "datasets" / "images" / name).convert("RGB")
              for name in ("china.jpg", "flower.jpg")]                     # 640x427 each
    partial = directory.with_name(f".{directory.name}.{os.getpid()}.tmp")
    shutil.rmtree(partial, ignore_errors=True)
    rng = random.Random(0)
    for split, n in (("train", count), ("val", max(count // 10, CLASSES))):
        for i in range(n):
            photo = photos[rng.randrange(2)]
            w, h = rng.randint(280, photo.width), rng.randint(210, photo.height)
            left, top = rng.randint(0, photo.width - w), rng.randint(0, photo.height - h)
            size = (rng.randint(480, 520), rng.randint(355, 395))
            image = photo.resize(size, Image.BILINEAR, box=(left, top, left + w, top + h))
            if rng.random() < 0.5:
                image = image.transpose(Image.FLIP_LEFT_RIGHT)
            path = partial / split / f"class{i % CLASSES}" / f"{split}{i:06d}.jpg"
            path.parent.mkdir(parents=True, exist_ok=True)
            image.save(path, format="JPEG", quality=90)
    partial.rename(directory)


def make_shards(images: Path) -> str:
    """The folder's splits packed as tar shards (`deepdsl data pack`) beside it; the spec of the training shards,
    the brace pattern `pack` prints (`shards:'DIR/train-{000000..00000N}.tar'`)."""
    out = images.with_name(images.name + "-shards")
    if not out.is_dir():
        partial = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        shutil.rmtree(partial, ignore_errors=True)
        done = subprocess.run([sys.executable, "-m", "deepdsl", "data", "pack", f"folder:{images}", "-o",
                               str(partial), "--shard-bytes", "16M"], capture_output=True, text=True, cwd=ROOT)
        if done.returncode != 0:
            raise SystemExit(f"deepdsl data pack folder:{images} failed:\n{done.stderr.strip()}")
        partial.rename(out)
    train = sorted(p.name for p in out.glob("train-*.tar"))
    if not train:
        raise SystemExit(f"{out} holds no train-*.tar shards; remove it to pack the folder again")
    first, last = train[0][len("train-"):-len(".tar")], train[-1][len("train-"):-len(".tar")]
    return f"shards:{out}/train-{{{first}..{last}}}.tar" if first != last else f"shards:{out}/{train[0]}"


def kernels_library(work: Path) -> tuple[str | None, str]:
    """The compiled render: (the library of a small program compiled here, "") or (None, why numpy's)."""
    program = work / "lenet.py"
    done = subprocess.run([sys.executable, "-m", "deepdsl", "compile", str(ROOT / "networks" / "lenet.py"), "-o",
                           str(program)], capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        return None, f"deepdsl compile failed: {done.stderr.strip()[-300:]}"
    from deepdsl_runtime.cpu import native

    kernels, why = native.load(program)          # waits for the build `deepdsl compile` started in the background
    if kernels is None:
        return None, why
    return str(native.library_path(program.with_suffix(".c"))), ""


# ----------------------------------------------------------------------------------------------------------------
# the sides (one process each)

def side_ours(spec: str, workers: int, batch: int, library: str | None) -> dict:
    from deepdsl_runtime import image_stream
    from deepdsl_runtime.image_transforms import ImageTransform

    data = image_stream.load(spec, (3, SIZE, SIZE), CLASSES)
    pipeline = image_stream.Pipeline(data, ImageTransform.parse(AUGMENT), batch, SLOTS, workers, 0, library)
    try:
        batches = image_stream.ImageBatches(pipeline, "train", batch, batch, 0, 0, train=True)
        timed = len(data.train) // batch - 1
        batches.next()
        began = time.perf_counter()
        for _ in range(timed):
            batches.next()
        seconds = time.perf_counter() - began
    finally:
        pipeline.close()
    return {"images": timed * batch, "seconds": seconds}


def crop_box(height: int, width: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params(img, scale, ratio): (top, left, h, w)."""
    area = height * width
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    ratio = width / height                       # the central crop of the whole image, its ratio clamped
    if ratio < min(RATIO):
        w, h = width, int(round(width / min(RATIO)))
    elif ratio > max(RATIO):
        w, h = int(round(height * max(RATIO))), height
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class TorchImages:
    """A torch Dataset of the training split: torchvision's ImageFolder loader (Pillow, RGB), RandomResizedCrop,
    RandomHorizontalFlip, ToTensor and Normalize; each sample's draws from its own generator."""

    def __init__(self, directory: str, seed: int = 0):
        import torch

        root = Path(directory) / "train"
        classes = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
        self.items = [(str(p), c) for c, name in enumerate(classes) for p in sorted((root / name).iterdir())
                      if p.suffix.lower() in (".jpg", ".jpeg")]
        self.seed = seed
        self.mean, self.std = torch.tensor(MEAN), torch.tensor(STD)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        import numpy as np
        import torch
        from PIL import Image

        path, label = self.items[i]
        rng = random.Random(self.seed * 1_000_003 + i)
        with open(path, "rb") as f:
            image = Image.open(f).convert("RGB")
        top, left, h, w = crop_box(image.height, image.width, rng)
        image = image.resize((SIZE, SIZE), Image.BILINEAR, box=(left, top, left + w, top + h))
        if rng.random() < 0.5:
            image = image.transpose(Image.FLIP_LEFT_RIGHT)
        x = torch.from_numpy(np.array(image, np.uint8, copy=True)).permute(2, 0, 1).contiguous()
        x = x.to(torch.float32).div(255)
        return x.sub(self.mean[:, None, None]).div(self.std[:, None, None]), label


def side_torch(directory: str, workers: int, batch: int) -> dict:
    import torch

    torch.set_num_threads(1)
    loader = torch.utils.data.DataLoader(TorchImages(directory), batch_size=batch, shuffle=True, drop_last=True,
                                         num_workers=workers, persistent_workers=True,
                                         generator=torch.Generator().manual_seed(0))
    batches = iter(loader)
    timed = len(loader) - 1
    next(batches)
    began = time.perf_counter()
    for _ in range(timed):
        next(batches)
    seconds = time.perf_counter() - began
    del batches, loader
    return {"images": timed * batch, "seconds": seconds, "torch": torch.__version__}


def run_side(job: dict) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, __file__, "--side", json.dumps(job)], capture_output=True, text=True,
                          env=env, timeout=1800)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------------------------------------------
# ResNet-50 trained from the folder

def train_resnet(images: Path, work: Path, iters: int) -> dict:
    program = work / "resnet50.py"
    done = subprocess.run([sys.executable, "-m", "deepdsl", "compile", str(ROOT / "networks" / "resnet50.py"),
                           "--batch", "8", "--image", "112", "-o", str(program)], capture_output=True, text=True,
                          cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"compiling resnet50 failed:\n{done.stderr.strip()}")
    from deepdsl_runtime.cpu import native

    kernels, why = native.load(program)          # the build `deepdsl compile` started in the background, finished
    if kernels is None:
        raise SystemExit(f"resnet50's compiled kernels: {why}")
    report = work / "resnet50-report.json"
    report.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, str(program), "--data", f"folder:{images}", "--iters", str(iters),
                           "--test-iters", "0", "--augment", AUGMENT, "--kernels", "compiled", "--params",
                           str(work / "resnet50.params.npz"), "--fresh", "--report-json", str(report), "--quiet"],
                          capture_output=True, text=True, timeout=3600, cwd=work)
    if done.returncode != 0:
        raise SystemExit(f"training resnet50 failed (exit {done.returncode}):\n{done.stderr.strip()[-3000:]}")
    return json.loads(report.read_text())


# ----------------------------------------------------------------------------------------------------------------

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=512, help="training images (and a tenth as many to validate)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker processes of each side")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--dir", help="where the images, shards and programs are made (kept, and reused when there)")
    parser.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    parser.add_argument("--train", action="store_true", help="also ResNet-50 trained from the folder: its data wait")
    parser.add_argument("--iters", type=int, default=6, help="ResNet-50's iterations with --train")
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        job = json.loads(args.side)
        if job["side"] == "torch":
            result = side_torch(job["folder"], job["workers"], job["batch"])
        else:
            result = side_ours(job["spec"], job["workers"], job["batch"], job["library"])
        print(json.dumps(result))
        return 0
    if args.images < 2 * args.batch or args.batch < 1 or args.rounds < 1 or min(args.workers) < 1:
        parser.error("--images must be at least 2 batches, and --batch, --rounds, --workers at least 1")

    from deepdsl_runtime.image_transforms import decoder_versions

    work = Path(args.dir).absolute() if args.dir else Path(tempfile.mkdtemp(prefix="deepdsl-data-"))
    work.mkdir(parents=True, exist_ok=True)
    images = work / f"jpeg{args.images}"
    began = time.perf_counter()
    make_images(images, args.images)
    shards = make_shards(images) if "shards" in args.sides else None
    library, why = kernels_library(work)
    prepared = time.perf_counter() - began
    name, isa = processor()
    import PIL
    import torch
    timed = (args.images // args.batch - 1) * args.batch
    print(f"{name}, {isa}, {os.cpu_count()} cores; decoders {decoder_versions()}; torch {torch.__version__} "
          f"(Pillow {PIL.__version__} decodes and resizes); render {'compiled' if library else 'numpy: ' + why}")
    print(f"{args.images} JPEGs of about 500x375 in {images} (made or found in {prepared:.1f} s); batches of "
          f"{args.batch} 3x{SIZE}x{SIZE}, {timed} images timed after a warm-up batch; {args.rounds} rounds "
          f"interleaved; load average before: {load_average()}", flush=True)

    specs = {"folder": f"folder:{images}", "shards": shards, "torch": None}
    sides = [s for s in SIDES if s in args.sides]
    runs: dict[tuple[str, int], list[float]] = {}
    errors: dict[tuple[str, int], str] = {}
    for round_ in range(args.rounds):
        for workers in args.workers:
            turn = round_ % len(sides)
            for side in sides[turn:] + sides[:turn]:
                job = {"side": side, "workers": workers, "batch": args.batch, "spec": specs[side],
                       "folder": str(images), "library": library}
                result = run_side(job)
                if "error" in result:
                    errors[(side, workers)] = result["error"]
                    print(f"  round {round_ + 1}: {side} with {workers} worker(s) failed: {result['error']}",
                          flush=True)
                    continue
                figure = result["images"] / result["seconds"]
                runs.setdefault((side, workers), []).append(figure)
                print(f"  round {round_ + 1}: {side:6s} {workers} worker(s) {figure:8.1f} images/s", flush=True)
    print(f"load average after: {load_average()}")

    print_row(("side", "workers", "images/s", "slowest", "fastest", "per worker", "vs torch"), args.markdown, 10,
              header=True)
    ratios = []
    for workers in args.workers:
        theirs = statistics.median(runs[("torch", workers)]) if ("torch", workers) in runs else None
        for side in sides:
            figures = runs.get((side, workers))
            if not figures:
                print_row((side, str(workers), "-", "-", "-", "-", errors.get((side, workers), "")[:40]),
                          args.markdown, 10)
                continue
            median = statistics.median(figures)
            ratio = median / theirs if theirs else None
            if ratio is not None and side != "torch":
                ratios.append(f"{side} {workers}w {ratio:.2f}x")
            print_row((side, str(workers), f"{median:.0f}", f"{min(figures):.0f}", f"{max(figures):.0f}",
                       f"{median / workers:.0f}", f"{ratio:.2f}x" if ratio else "-"), args.markdown, 10)
    if ratios:
        print(f"ours / torch per worker core: {', '.join(ratios)} (target: at least 1.30x)")

    if args.train:
        report = train_resnet(images, work, args.iters)
        pipeline = report.get("input_pipeline") or {}
        share, waited = pipeline.get("data_wait_share"), pipeline.get("data_wait_seconds")
        per_iter = report["seconds_per_iter"]
        whole = waited / (per_iter * args.iters) if waited is not None and per_iter else None
        print(f"ResNet-50, batch 8 at 112x112, trained from {images.name} ({AUGMENT}) for {args.iters} iterations "
              f"with {pipeline.get('workers')} decoding worker(s) on {os.cpu_count()} cores: "
              f"{per_iter * 1000:.0f} ms an iteration; data wait "
              + (f"{100 * share:.1f} % of the steps after the first" if share is not None else "not measured")
              + (f" (target: under 5 %); {waited:.2f} s in all, {100 * whole:.1f} % of the training time with the "
                 f"workers' start" if whole is not None else "")
              + f"; load average: {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
