"""The training loop behind a generated program's command line: `run(ModelClass, args)` does what the options say:
data, fresh initialization or resuming from a checkpoint, the loop with its progress bar (one batch, accumulated
batches or ranks: `deepdsl_runtime.parallel`), periodic and final checkpoints, SIGINT/SIGTERM handling, stopping
on a non-finite loss, the test pass and the report.

Exit status: 0 on success, 1 for a usage problem (bad option, data spec or output path, unusable checkpoint,
unavailable device), 3 when the loss or the state became NaN or infinite (nothing is saved over the last good
checkpoint), 4 when a checkpoint or report could not be written (a full disk: the previous checkpoint stays),
5 when a data-parallel job was ended because a rank made no progress (--rank-timeout), 6 when an image read from
files cannot be read or decoded during the run, or a decoding worker ended (the last checkpoint stays), 128 + signal
number after SIGINT/SIGTERM/SIGHUP (the checkpoint saved first; a second signal stops at once).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import signal
import sys
import time
import traceback
import warnings
from typing import TYPE_CHECKING

import numpy as np

from deepdsl_runtime import checkpoint as ckpt
from deepdsl_runtime import data as datasets
from deepdsl_runtime import image_stream, metrics, parallel, replay
from deepdsl_runtime.frames import run_with_room
from deepdsl_runtime.schedule import Schedule, ScheduleError

if TYPE_CHECKING:
    from deepdsl_runtime.program import Model

EXIT_USAGE, EXIT_DIVERGED, EXIT_SAVE, EXIT_DATA = 1, 3, 4, 6


class RunError(Exception):
    """A problem reported as one line; `status` is the exit status (1: a usage problem)."""

    def __init__(self, message: str, status: int = EXIT_USAGE, collective: bool = False):
        super().__init__(message)
        self.status = status
        self.collective = collective          # raised on every rank at the same point (data parallelism)


# ----------------------------------------------------------------------------------------------------------------
# matrix products through the tiled multi-device GEMM

_BYTE_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}
MOST_DEVICE_BYTES = 1 << 48      # 256 TiB: more memory than any device has; a larger size is a mistake
MOST_THREADS = 1024              # more threads than any machine runs at once (each takes a stack and scratch)
MOST_GEMM_DEVICES = 1024         # likewise devices
MOST_PREFETCH = 64               # batches decoded ahead: each holds a slot of shared memory


def _shown(number: int) -> str:
    """An integer for a message: its digits, or how many there are of them."""
    text = str(number)
    return text if len(text) <= 24 else f"a number of {len(text)} digits"


def _byte_size(text: str) -> int | float:
    """'65536', '64K', '256M', '2G' (binary units, an optional trailing 'B' or 'iB') as bytes; a size too large for
    an integer (1e999) as a float, which `_check_args` refuses naming the option."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in _BYTE_UNITS and not t[-1:].isdigit() else ""
    try:
        value = float(t[:len(t) - len(unit)]) * _BYTE_UNITS[unit]
    except ValueError:
        value = math.nan
    if math.isnan(value):
        raise argparse.ArgumentTypeError(f"'{text}' is not a size in bytes (e.g. 65536, 64K, 256M, 2G)")
    return int(value) if abs(value) <= MOST_DEVICE_BYTES else value


KERNELS = ("auto", "compiled", "numpy")


def add_kernel_options(parser) -> None:
    """The command-line options choosing the CPU kernels and their threads."""
    parser.add_argument("--kernels", choices=KERNELS, default="auto",
                        help="CPU kernels: the program's compiled library where it is built (auto), only those "
                             "(compiled), or numpy's")
    parser.add_argument("--threads", type=int, metavar="N",
                        help="threads of the compiled kernels and the matrix products (default: the cores this "
                             "process may use, fewer while other processes keep some of them busy)")
    parser.add_argument("--no-replay", action="store_true",
                        help="run every training step's Python (by default a step's kernel calls are recorded "
                             "after two steps, checked bit for bit against its Python, and replayed without it)")


def add_parallel_options(parser) -> None:
    """The command-line options of gradient accumulation and data-parallel training (`deepdsl_runtime.parallel`)."""
    parser.add_argument("--accumulate", type=int, default=1, metavar="K",
                        help="add the gradients of K batches before each update: a batch of K times the compiled "
                             "one in the memory of one (needs a program compiled with --data-parallel)")
    parser.add_argument("--data-parallel", action="store_true",
                        help="under mpiexec: each rank trains on its share of every global batch (ranks x K x "
                             "batch examples), gradients summed over the ranks; alone, as without it")
    parser.add_argument("--reduce", choices=parallel.REDUCE_MODES, default="exact",
                        help="how the ranks sum their gradients, bucket by bucket during the backward pass: exact "
                             "(in rank order: bit for bit the training of one process with --accumulate RANKS) or "
                             "fast (MPI's Allreduce)")
    parser.add_argument("--batch-norm", choices=parallel.BATCH_NORM_MODES, default="synced",
                        help="ranks normalize by the statistics of all ranks' batches (synced: as one process "
                             "training on the global batch) or of their own batch (local: bit for bit one process "
                             "with --accumulate RANKS, running statistics included)")
    parser.add_argument("--no-overlap", action="store_true",
                        help="sum the gradients after the step, not during its backward pass")
    parser.add_argument("--rank-timeout", type=float, default=600.0, metavar="SECONDS",
                        help="end the job (exit 5) when a rank has made no progress for this long: a rank stopped or "
                             "hung in a way MPI does not notice (0: wait for ever)")


def add_workflow_options(parser) -> None:
    """The command-line options of a run's length in epochs, its validation, metric log and best checkpoint."""
    parser.add_argument("--epochs", type=int, metavar="E",
                        help="train for E passes over the training split (instead of --iters; counted from where "
                             "a resumed run's data stream is)")
    parser.add_argument("--eval-every", metavar="N|epoch",
                        help="run the test step over the validation split every N iterations, or after each epoch; "
                             "its loss and accuracies are printed and logged")
    parser.add_argument("--eval-batches", type=int, metavar="K",
                        help="validate on the first K batches of the validation split (default: all of it)")
    parser.add_argument("--top-k", type=int, metavar="K",
                        help="also the top-K accuracy of classifiers (default: 5 for networks of 10 classes or "
                             "more; 0: none)")
    parser.add_argument("--keep-best", metavar="METRIC",
                        help="write PARAMS.best.npz whenever the validation METRIC (loss, accuracy, topK) improves")
    parser.add_argument("--log", metavar="PATH",
                        help="append one JSON object per logged iteration (iteration, epoch, loss, lr, images/s, "
                             "data wait, memory, validation figures); a resumed run continues it exactly")
    parser.add_argument("--log-every", type=int, default=10, metavar="N",
                        help="iterations between entries of --log and --tensorboard (and every validation)")
    parser.add_argument("--tensorboard", metavar="DIR",
                        help="also write the logged figures as TensorBoard event files into DIR (needs the "
                             "tensorboard extra: tensorboardX)")


def add_gemm_options(parser) -> None:
    """The command-line options that run the matrix products of the steps on the tiled multi-device GEMM."""
    parser.add_argument("--gemm-devices", type=int, default=0, metavar="N",
                        help="compute the matrix products (fully connected layers, convolutions) tiled over N "
                             "devices (simulated CPU devices with --device cpu); 0: numpy's matmul in place")
    parser.add_argument("--gemm-device-memory", type=_byte_size, metavar="BYTES",
                        help="memory of each GEMM device (e.g. 64M; default 256M); given alone, one device")
    parser.add_argument("--gemm-tile", type=int, default=512, metavar="T", help="GEMM tile edge in elements")


def _why_python_steps(args, products) -> str | None:
    """Why the training steps run in Python whatever `replay.TrainSteps` finds (None: they may be replayed)."""
    if getattr(args, "no_replay", False):
        return "--no-replay"
    if products is not None:
        return "--gemm-devices (the tiled products)"
    if getattr(args, "check_memory", False):
        return "--check-memory (every step's buffers checked)"
    return None


def _tiled_products(args):
    """The `gemm` function the options ask for (a TiledProducts), or None for numpy's own products."""
    count = getattr(args, "gemm_devices", 0)
    memory_bytes = getattr(args, "gemm_device_memory", None)
    if count < 0:
        raise RunError("--gemm-devices must be >= 0")
    if count == 0 and memory_bytes is None:
        return None
    if count > MOST_GEMM_DEVICES:
        raise RunError(f"--gemm-devices must be at most {MOST_GEMM_DEVICES}, got {_shown(count)}")
    count = max(count, 1)
    memory_bytes = (256 << 20) if memory_bytes is None else memory_bytes
    tile = args.gemm_tile
    if tile < 1:
        raise RunError("--gemm-tile must be >= 1")
    need = 5 * tile * tile * 4          # a device holds an accumulator, two operand tiles, a spare and its scratch
    if memory_bytes < need:
        raise RunError(f"--gemm-device-memory {memory_bytes} bytes holds fewer than 5 float32 tiles of "
                       f"{tile}x{tile} (needs at least {need}); give more memory or a smaller --gemm-tile")
    if args.device != "cpu":
        raise RunError("--gemm-devices: only the CPU backend routes its matrix products through the tiled GEMM")
    from deepdsl_runtime.gemm import TiledGemm
    from deepdsl_runtime.gemm.products import TiledProducts, cpu_devices
    try:                                  # a simulated device holds its memory from the start
        devices = cpu_devices(count, memory_bytes)
    except MemoryError:
        raise RunError(f"--gemm-devices {count} x --gemm-device-memory {memory_bytes} bytes: this machine cannot hold "
                       "the simulated devices' memory; give fewer or smaller devices") from None
    return TiledProducts(TiledGemm(devices, tile=tile))


def _build_kernels(model_cls, args) -> None:
    """A program's first run on this machine builds its compiled CPU kernels from the `.c` beside it where they
    are missing and a C compiler is there (as `deepdsl compile` does; `deepdsl_runtime.cpu.native.to_build`),
    saying so; a failed build leaves numpy's kernels, and says why."""
    if args.device != "cpu" or getattr(args, "kernels", "auto") == "numpy":
        return
    from deepdsl_runtime.cpu import native

    program = model_cls.program_file()
    target = native.to_build(program) if program else None
    if target is None:
        return
    source = os.path.splitext(os.path.abspath(program))[0] + ".c"
    _say(args, f"building {target.name} from {os.path.basename(source)} (the compiled CPU kernels, once on this "
               "machine)")
    built, why = native.build_library(source)
    if built is None:
        _say(args, f"compiled CPU kernels not built ({why}): running numpy's")


# ----------------------------------------------------------------------------------------------------------------
# the run

class _Signals:
    """SIGINT/SIGTERM/SIGHUP set a flag the run checks between steps (it then saves and stops); a second signal
    this process receives raises KeyboardInterrupt where the program is (stop now: a checkpoint being written stays
    the previous one); later ones change nothing. `received` may also be set by the ranks' agreement (a signal to
    another rank), which does not make this rank's own copy of that signal, arriving later, a second one."""

    def __init__(self):
        self.received: int | None = None
        self.again: int | None = None     # the second signal
        self._own: int | None = None      # the first signal this process received itself
        self._old = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.again is not None:        # stopping at once already
            return
        if self._own is not None:         # a second signal: stop now
            self.again = signum
            raise KeyboardInterrupt
        self._own = signum
        if self.received is None:
            self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        return False


def _say(args, text: str) -> None:
    if not args.quiet:
        try:
            print(text, flush=True)
        except OSError:                   # a terminal gone (SIGHUP) or a closed pipe: the run goes on
            pass


def _line(text: str) -> None:
    """One line on standard error, in one write (the ranks of a job share one stream; nothing where it is gone)."""
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except OSError:
        pass


def _error(model_cls, text: str, status: int = EXIT_USAGE) -> int:
    _line(f"{model_cls.name}: error: {text}")
    return status


def best_path(params: str) -> str:
    """Where --keep-best writes: `P.best.npz` beside the checkpoint `P.npz` (`P.best.npz` for a `P` without .npz)."""
    return (params[:-4] if params.endswith(".npz") else params) + ".best.npz"


def _check_directory(path: str, option: str) -> None:
    """A directory an option writes files into: one there, or one that can be made (its parent a directory)."""
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise RunError(f"{option} {path}: not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise RunError(f"{option} {path}: the directory is not writable")
        return
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise RunError(f"{option} {path}: cannot be made ({parent} is not a writable directory)")


def _check_args(args) -> None:
    """Every numeric option in its range before anything runs."""
    for key in ("iters", "test_iters", "save_every", "warmup"):
        count = getattr(args, key, 0) or 0
        if not 0 <= count < 2 ** 63:           # a checkpoint keeps iterations as int64
            raise RunError(f"--{key.replace('_', '-')} must be in [0, 2^63), got {_shown(count)}")
    for key in ("epochs", "eval_batches", "log_every"):
        count = getattr(args, key, None)
        if count is not None and not 1 <= count < 2 ** 63:
            raise RunError(f"--{key.replace('_', '-')} must be in [1, 2^63), got {_shown(count)}")
    top = getattr(args, "top_k", None)
    if top is not None and not 0 <= top < 2 ** 31:
        raise RunError(f"--top-k must be in [0, 2^31), got {_shown(top)}")
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise RunError(f"--lr must be a finite number > 0, got {args.lr}")
    momentum = getattr(args, "momentum", None)
    if momentum is not None and not (math.isfinite(momentum) and 0 <= momentum < 1):
        raise RunError(f"--momentum must be in [0, 1), got {momentum}")
    if not (math.isfinite(args.decay) and args.decay >= 0):
        raise RunError(f"--decay must be a finite number >= 0, got {args.decay}")
    if not 0 <= args.seed < 2 ** 63:
        raise RunError(f"--seed must be in [0, 2^63), got {args.seed}")
    timeout = getattr(args, "rank_timeout", 0.0)
    if not (math.isfinite(timeout) and timeout >= 0):
        raise RunError(f"--rank-timeout must be a finite number >= 0, got {timeout}")
    workers = getattr(args, "workers", None)
    if workers is not None and not 0 <= workers <= MOST_THREADS:
        raise RunError(f"--workers must be in [0, {MOST_THREADS}], got {_shown(workers)}")
    prefetch = getattr(args, "prefetch", 2)
    if not 1 <= prefetch <= MOST_PREFETCH:
        raise RunError(f"--prefetch must be in [1, {MOST_PREFETCH}], got {_shown(prefetch)}")
    threads = getattr(args, "threads", None)
    if threads is not None and not 1 <= threads <= MOST_THREADS:
        raise RunError(f"--threads must be in [1, {MOST_THREADS}], got {threads}")
    memory = getattr(args, "gemm_device_memory", None)
    if memory is not None and memory > MOST_DEVICE_BYTES:
        raise RunError(f"--gemm-device-memory must be at most 2^48 bytes (256 TiB), got {memory:g} bytes")


def _training_length(model_cls, args) -> None:
    """--iters or --epochs, not both; without either, the network's own iterations (`Model.defaults`). With
    --epochs, `args.iters` stays 0 until the data is known (`_Run.count_epochs`)."""
    epochs = getattr(args, "epochs", None)
    args.iters = getattr(args, "iters", None)
    if epochs is not None and args.iters is not None:
        raise RunError(f"--epochs {epochs} and --iters {args.iters} both say how long to train; give one of them")
    if args.iters is None:
        args.iters = 0 if epochs is not None else int(model_cls.defaults.get("iters", 1000))


def _recipe(args, input_shape: tuple[int, ...] = ()) -> tuple[Schedule, object]:
    """The learning-rate schedule (--lr-schedule, --warmup; cosine's length follows --iters) and the augmentation
    (--augment) of the options: a `data.Augment` where the spec is one (crop:P, flip), else an
    `image_transforms.ImageTransform` (random-resized-crop, normalize, center-crop: images read from files, which
    `_Run.choose_augment` checks once the data is known); for images of `input_shape` (N, C, H, W), a crop pads
    them by at most their height and width (a larger padding crops mostly zeros, and its scratch grows with its
    square)."""
    spec = getattr(args, "augment", "none")
    try:
        schedule = Schedule.parse(getattr(args, "lr_schedule", "constant"), getattr(args, "warmup", 0), args.iters)
    except ScheduleError as err:
        raise RunError(str(err)) from None
    try:
        augment = datasets.Augment.parse(spec)
    except datasets.DataError as err:
        try:
            from deepdsl_runtime.image_transforms import ImageTransform
            augment = ImageTransform.parse(spec)
        except datasets.DataError as image_err:
            known = "random-resized-crop", "normalize", "center-crop"
            raise RunError(str(image_err if any(k in spec for k in known) else err)) from None
    crop = getattr(augment, "crop", 0)
    if crop and len(input_shape) == 4 and crop > min(input_shape[2:]):
        h, w = input_shape[2:]
        raise RunError(f"--augment {args.augment}: crop:{crop} pads the network's {h}x{w} images by more than their "
                       f"size; use at most crop:{min(h, w)}")
    return schedule, augment


def _checkpoint(model: Model, iteration: int, position: tuple[int, int], data_spec: str) -> ckpt.Checkpoint:
    return ckpt.Checkpoint(path="", tensors=model.host_tensors(), network=model.name,
                           structure_hash=model.structure_hash, iteration=iteration, seed=model.seed,
                           data_position=position, data=data_spec)


def _checkpoint_bytes(model: Model) -> int:
    """An upper bound of the checkpoint's size: float32 tensors plus a page of zip and .npy headers per entry."""
    shapes = model.expected_shapes()
    return sum(4 * math.prod(shape) for shape in shapes.values()) + 4096 * (len(shapes) + 8)


def _resume(model: Model, path: str) -> ckpt.Checkpoint:
    found = ckpt.read(path)
    if found.network != model.name:
        raise ckpt.CheckpointError(f"{path}: field '__network__': a checkpoint of '{found.network}', this program "
                                   f"trains '{model.name}'")
    if found.structure_hash != model.structure_hash:
        raise ckpt.CheckpointError(
            f"{path}: field '__structure_hash__': written by a program of another structure ({found.structure_hash}, "
            f"this one is {model.structure_hash}); start over with --fresh (adding --init-from {path} reuses its "
            "parameters whose names and shapes match), or choose another --params")
    ckpt.check_tensors(found, model.expected_shapes())
    return found


_PYTORCH_SUFFIXES = {"weight": "W", "bias": "B", "running_mean": "mean", "running_var": "var"}


def pytorch_name(name: str) -> str | None:
    """The deepdsl name of a PyTorch `state_dict` entry: its module path with underscores for dots, and deepdsl's
    suffix for the tensor (`layer1.0.conv1.weight` -> `layer1_0_conv1_W`, `bn1.running_var` -> `bn1_var`,
    `attn.in_proj_weight` -> `attn_in_proj_W`); a parameter of a module's own (`cls_token`, `blocks.0.gamma`) by its
    path (`cls_token`, `blocks_0_gamma`); None for an entry with no counterpart (`num_batches_tracked`)."""
    module, _, tensor = name.rpartition(".")
    prefix = f"{module.replace('.', '_')}_" if module else ""
    suffix = _PYTORCH_SUFFIXES.get(tensor)
    if suffix is not None:
        return f"{prefix}{suffix}" if module else None
    if tensor == "num_batches_tracked":
        return None
    for ending, short in (("_weight", "W"), ("_bias", "B")):
        if tensor.endswith(ending) and len(tensor) > len(ending):
            return f"{prefix}{tensor[:-len(ending)]}_{short}"
    return f"{prefix}{tensor}"


def _init_from(model: Model, path: str, source: dict[str, np.ndarray], args) -> None:
    """Copy the parameters (and model state) among `source`, the tensors read from `path` (a deepdsl checkpoint, a
    plain .npz of arrays or a .safetensors file: `checkpoint.read_weights`), whose names and shapes match into a
    freshly initialized model; none matching is an error. A name this network does not have is read as a PyTorch
    `state_dict` name (`pytorch_name`)."""
    loaded, skipped = [], []
    candidates = {**model.params, **{k: s for k, s in model.states.items() if not s.optimizer}}
    by_name, renamed = {}, []
    for name, array in source.items():
        target = name if name in candidates else pytorch_name(name)
        if target in candidates and target not in by_name:
            by_name[target] = array
            if target != name:
                renamed.append(f"{name} -> {target}")
    for name, spec in candidates.items():
        array = by_name.get(name)
        if array is None:
            skipped.append(f"{name} (not in file)")
        elif tuple(array.shape) != tuple(spec.shape):
            skipped.append(f"{name} (shape {'x'.join(map(str, array.shape))} in file, "
                           f"{'x'.join(map(str, spec.shape))} here)")
        elif array.dtype.kind != "f" or not np.all(np.isfinite(array)):
            skipped.append(f"{name} (not finite float data)")
        else:
            model.tensors[name] = model.rt.asarray(array.astype(np.float32))
            loaded.append(name)
    if not loaded:
        raise RunError(f"--init-from {path}: none of its tensors matches this network's by name and shape "
                       f"({', '.join(skipped[:3])}{', ...' if len(skipped) > 3 else ''}); nothing to start from")
    _say(args, f"initialized {len(loaded)} of {len(candidates)} tensors from {path}"
               + (f" (by PyTorch's names: {', '.join(renamed[:3])}{', ...' if len(renamed) > 3 else ''})"
                  if renamed else "")
               + (f"; skipped: {', '.join(skipped)}" if skipped else ""))


def run(model_cls: type[Model], args) -> int:
    """Train and test as the parsed command-line options say; returns the exit status. Every problem is one line on
    standard error; numpy's floating-point warnings are silenced (a non-finite loss or state is reported as such)."""
    with _Signals() as signals, np.errstate(all="ignore"), warnings.catch_warnings():
        if args.quiet:
            warnings.simplefilter("ignore")
        session = ranks = None
        try:
            ranks = parallel.world(getattr(args, "data_parallel", False), getattr(args, "rank_timeout", 0.0),
                                   lambda: signals.received, model_cls.name)
            session = _Run(model_cls, args, signals, ranks)
            try:
                status = run_with_room(session.execute)      # its steps' calls on one frame chunk
            finally:
                if session.pipeline is not None:
                    session.pipeline.close()
            ranks.barrier()                   # every rank has said its line before any exits
            session.watchdog.stop()
            if status:                        # said before mpi4py ends the job for the status
                ranks.end(status, collective=True)
            return status
        except (RunError, ckpt.CheckpointError, datasets.DataError, parallel.ParallelError) as err:
            status = getattr(err, "status", EXIT_USAGE)
            if not getattr(err, "said", False):
                _error(model_cls, str(err), status)
            if ranks is not None:             # the others stop at the same point, or are stopped
                ranks.end(status, collective=getattr(err, "collective", False))
            return status
        except KeyboardInterrupt as interrupt:
            _release_quietly(interrupt)
            received = signals.again or signals.received or signal.SIGINT
            kept = session.kept() if session is not None else "nothing was written"
            what = "again" if signals.received in (None, received) else f"after {signal.Signals(signals.received).name}"
            _line(f"{model_cls.name}: {signal.Signals(received).name} {what}: stopped at once; {kept}")
            if ranks is not None:
                ranks.end(128 + received, collective=False)
            return 128 + received


def _release_quietly(interrupt: BaseException) -> None:
    """Free now what the frames an interrupt stopped still hold, without the reports of their `__del__`s: a zip
    archive interrupted inside its constructor (the checkpoint being written) raises AttributeError when freed,
    which Python would print as a traceback after the one line the program says."""
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        traceback.clear_frames(interrupt.__traceback__)
        gc.collect()
    finally:
        sys.unraisablehook = hook


def _network_files(source: str, program: str | None) -> list[str]:
    """The files that may be the network file the program's header names (`source`, relative to where it was
    compiled): `source` from the current directory (where `deepdsl run` runs it) and from the program's directory
    and each directory above it (`generated/lenet.py` of `networks/lenet.py`)."""
    if not source:
        return []
    bases = [os.getcwd()]
    if program:
        directory = os.path.dirname(os.path.realpath(program))
        bases.append(directory)
        while os.path.dirname(directory) != directory:
            directory = os.path.dirname(directory)
            bases.append(directory)
    found = (os.path.join(base, source) for base in bases)
    return list(dict.fromkeys(path for path in found if os.path.isfile(path)))


# options a rank may set on its own: threads follow its machine's cores, only rank 0 speaks
_PER_RANK = ("threads", "quiet")


class _Run:
    """One invocation of a generated program: start (fresh, resumed or fine-tuned), train, test, report.

    Before the first iteration every output is checked (--params and --report-json writable, with room for the
    checkpoint; a read-only checkpoint is refused), and temporaries a killed run left beside the checkpoint are
    removed. A checkpoint is written only over a finite state whose test loss on one batch is finite."""

    def __init__(self, model_cls: type[Model], args, signals: _Signals, ranks=None):
        _training_length(model_cls, args)
        _check_args(args)
        self.schedule, self.augment = _recipe(args, model_cls.batch_shape)
        if self.augment and (getattr(model_cls, "tokens", False) or getattr(model_cls, "target_shape", None)):
            raise RunError(f"--augment {args.augment}: augmentation crops and mirrors images, and {model_cls.name} "
                           f"takes {'tokens' if getattr(model_cls, 'tokens', False) else 'float targets'}; "
                           "leave it out")
        self.args, self.signals, self.ranks = args, signals, ranks or parallel.Alone()
        self.accumulation = parallel.Accumulation(self.ranks, getattr(args, "accumulate", 1),
                                                  getattr(args, "reduce", "exact"),
                                                  not getattr(args, "no_overlap", False),
                                                  getattr(args, "batch_norm", "synced"))
        if self.accumulation.split and not model_cls.accumulators:
            raise RunError(f"--accumulate and --data-parallel run the accumulate and apply steps, which this program "
                           f"was compiled without; compile it with `deepdsl compile {model_cls.source} "
                           "--data-parallel`")
        if self.ranks.rank > 0:
            args.quiet = True                     # rank 0 speaks for the job
        _build_kernels(model_cls, args)
        threads = getattr(args, "threads", None)
        if threads is None and self.ranks.local_size > 1:       # the ranks on this machine share its cores
            threads = max(1, len(os.sched_getaffinity(0)) // self.ranks.local_size)
        self.model = model_cls(args.device, args.seed, getattr(args, "memory_mode", "static"),
                               getattr(args, "check_memory", False), getattr(args, "kernels", "auto"), threads)
        self._check_parallel()
        self.products = _tiled_products(args)
        if self.products is not None:
            self.model.rt = self.model.rt.with_gemm(self.products)
        self.steps = replay.TrainSteps(self.model, why=_why_python_steps(args, self.products))
        self.path = args.params
        self.batch = self.model.batch_shape[0]
        self.resumed: ckpt.Checkpoint | None = None
        self.saved_iteration: int | None = None          # iteration of the checkpoint self.path holds for this run
        self.writing: int | None = None                  # iteration of the last checkpoint this run began to write
        self.probe = None                                # one test batch each checkpoint's state is tried on
        self.data = None                                 # the data set, once loaded
        self.sinks: list = []                            # --log and --tensorboard, open while training
        self.logged = (0, time.perf_counter(), 0.0)      # iteration, time and data wait of the last log entry
        self.batches_done = 0                            # batches of the compiled size trained on, over all ranks
        self.by_another = False                          # stopping for a signal another rank received
        self.watchdog = parallel.watchdog(self.ranks, 0, model_cls.name)    # started with the training
        self.choose_validation()
        if self.ranks.rank == 0:
            self.check_outputs(before_reading=True)
        if self.path and self.ranks.rank == 0:
            removed = ckpt.remove_stale_temporaries(self.path)
            if removed:
                _say(args, f"removed {len(removed)} temporary file(s) of an interrupted write of {self.path}")
        if self.path and os.path.exists(self.path) and not args.fresh:
            if args.init_from:
                raise RunError(f"--init-from starts a new run, but --params {self.path} exists and would be resumed; "
                               f"add --fresh to start over from {args.init_from} (replacing {self.path}), or choose "
                               "another --params")
            self.resumed = _resume(self.model, self.path)
            self.model.seed = self.resumed.seed
            self.saved_iteration = self.resumed.iteration
            self.batches_done = self.recorded("__batches__", self.resumed.iteration)
            self.best = self.recorded_best()
        self.data_spec = self.choose_data()
        self.augment = self.choose_augment()
        self.pipeline = None                             # the workers of images read from files
        # an unusable --init-from file is an error before anything else happens; what it holds is used at the start
        self.init_weights = ckpt.read_weights(args.init_from) if args.init_from and self.resumed is None else None
        if self.ranks.rank == 0:
            self.check_outputs()

    def choose_validation(self) -> None:
        """--eval-every, --eval-batches, --top-k and --keep-best, checked against each other and the network."""
        args, model = self.args, self.model
        try:
            self.eval_every = metrics.parse_every(getattr(args, "eval_every", None))
        except metrics.MetricsError as err:
            raise RunError(str(err)) from None
        if getattr(args, "eval_batches", None) is not None and self.eval_every is None:
            raise RunError(f"--eval-batches {args.eval_batches} says how much to validate on: add --eval-every "
                           "N|epoch")
        classes = model.classes if model.target_shape is None else 0
        top = getattr(args, "top_k", None)
        if top and not classes:
            raise RunError(f"--top-k {top}: {model.name} is no classifier (its accuracy is no D.precision)")
        if top and top > classes:
            raise RunError(f"--top-k {top}: {model.name} has {classes} classes; use at most {classes}")
        if top is None:
            top = 5 if classes >= 10 else 0
        self.top = (top,) if top > 1 else ()          # top-1 is the accuracy
        self.best: tuple[float, int] | None = None     # the best validation so far: (value, iteration)
        self.best_path = self.best_sense = None
        metric = getattr(args, "keep_best", None)
        if metric is None:
            return
        try:
            self.best_sense = metrics.metric_sense(metric, self.top)
        except metrics.MetricsError as err:
            raise RunError(str(err)) from None
        if self.eval_every is None:
            raise RunError(f"--keep-best {metric} keeps the checkpoint of the best validation: add --eval-every "
                           "N|epoch")
        if not self.path:
            raise RunError(f"--keep-best {metric} writes its checkpoint beside --params, which is empty")
        self.best_path = best_path(self.path)

    def recorded_best(self) -> tuple[float, int] | None:
        """The best validation a resumed checkpoint recorded for this run's --keep-best metric (None: none, or
        another metric, which is said)."""
        metric = getattr(self.args, "keep_best", None)
        found = self.resumed.extra.get("__best_metric__")
        if metric is None or found is None:
            return None
        if str(found) != metric:
            _say(self.args, f"the checkpoint kept the best {found}, this run keeps the best {metric}: "
                            f"{self.best_path} is written at its next validation")
            return None
        value, iteration = self.resumed.extra.get("__best_value__"), self.recorded("__best_iteration__", 0)
        if value is None or value.shape != () or value.dtype.kind != "f":
            raise ckpt.CheckpointError(f"{self.path}: field '__best_value__': expected a float")
        return float(value), iteration

    def _check_parallel(self) -> None:
        """The options of accumulation and data parallelism, and the same program and options on every rank."""
        args, model = self.args, self.model
        if getattr(args, "accumulate", 1) < 1:
            raise RunError(f"--accumulate must be >= 1, got {args.accumulate}")
        options = {f"--{k.replace('_', '-')}": v for k, v in sorted(vars(args).items()) if k not in _PER_RANK}
        self.ranks.agree({"network": model.name, "structure hash": model.structure_hash, "batch": model.batch_shape,
                          "kernels": model.kernels.split(",")[0].split(":")[0], **options})

    def choose_data(self) -> str:
        """--data, else the data a resumed checkpoint was trained on, else the network's dataset. Resuming on other
        data than the checkpoint's is refused unless --switch-data says so (the run is then no longer exact)."""
        args, given = self.args, getattr(self.args, "data", None)
        recorded = self.resumed.data if self.resumed is not None else ""
        if not recorded:
            return given or self.model.dataset
        if given is None or given == recorded or getattr(args, "switch_data", False):
            return given or recorded
        raise ckpt.CheckpointError(f"{self.path}: field '__data__': trained on '{recorded}', this run asks for "
                                   f"--data '{given}'; leave out --data to continue on '{recorded}', add "
                                   "--switch-data to continue on other data (no longer an exact resume), or --fresh")

    def choose_augment(self):
        """The augmentation for the data chosen: an `ImageTransform` for images read from files (its evaluation
        transform also without --augment), else the `Augment` of in-memory data."""
        spec = getattr(self.args, "augment", "none")
        if image_stream.is_image_spec(self.data_spec):
            from deepdsl_runtime.image_transforms import ImageTransform
            try:
                return ImageTransform.parse(spec)
            except datasets.DataError as err:
                raise RunError(str(err)) from None
        if not isinstance(self.augment, datasets.Augment):
            raise RunError(f"--augment {spec}: random-resized-crop, normalize and center-crop transform images read "
                           f"from files (folder:DIR, shards:PATTERN); '{self.data_spec}' is held in memory: use "
                           "crop:P and flip")
        return self.augment

    def check_outputs(self, before_reading: bool = False) -> None:
        """No output (--params, --report-json) is the network file, this program, its kernels' sources or another
        output (checked `before_reading` a checkpoint, which --params may name), nor an input (--init-from, the
        --data file); every output is writable."""
        args = self.args
        outputs = [("--params", self.path), ("--report-json", args.report_json), ("--log", getattr(args, "log", None)),
                   ("--keep-best's checkpoint", self.best_path), ("--tensorboard", getattr(args, "tensorboard", None))]
        program = self.model.program_file()
        kernels = [(f"this program's {suffix} kernels", os.path.splitext(program)[0] + suffix)
                   for suffix in (".c", ".cu")] if program else []
        networks = [("the network file", path) for path in _network_files(self.model.source, program)]
        inputs = [("this program", program), *kernels, *networks]
        if not before_reading:
            kind, _, data_file = self.data_spec.partition(":")
            inputs = [("--init-from", args.init_from), ("--data", data_file if kind == "npz" else None)]
        seen = {}
        for option, target in outputs:
            if not target:
                continue
            real = os.path.realpath(target)
            for what, source in inputs + list(seen.items()):
                if source and os.path.realpath(source) == real and not (what == "--init-from" and option ==
                                                                         "--params"):
                    raise RunError(f"{option} {target} is {what if not what.startswith('--') else what + ' too'}; "
                                   "choose another file")
            seen[option] = target
        if before_reading:
            return
        if self.path:
            ckpt.check_target(self.path, "--params", _checkpoint_bytes(self.model))
        if args.report_json:
            ckpt.check_target(args.report_json, "--report-json")
        if getattr(args, "log", None):
            ckpt.check_target(args.log, "--log")
        if self.best_path:
            ckpt.check_target(self.best_path, "--keep-best's checkpoint", _checkpoint_bytes(self.model))
        board = getattr(args, "tensorboard", None)
        if board:
            _check_directory(board, "--tensorboard")

    def kept(self) -> str:
        """What the checkpoint file holds now, said after a run stops early. A write interrupted after its rename
        (before this run noted it saved) has put the new checkpoint in place: the file says so."""
        if not self.path:
            return "nothing was saved (no --params)"
        if os.path.exists(self.path) and not os.path.isfile(self.path):
            return f"{self.path} is left as it is (not a regular file)"
        if self.writing is not None and ckpt.recorded_iteration(self.path) == self.writing:
            return f"{self.path} keeps the checkpoint of iteration {self.writing}"
        if self.saved_iteration is not None:
            return f"{self.path} keeps the checkpoint of iteration {self.saved_iteration}"
        if os.path.exists(self.path):
            return f"{self.path} keeps its previous contents"
        return "no checkpoint was written"

    def agreed_signal(self) -> int:
        """The signal any rank received (0: none), the same on every rank; this rank's `signals.received` becomes
        it (`interrupted` then says that another rank was signalled)."""
        stop = self.ranks.largest(self.signals.received or 0)
        if stop and self.signals.received is None:
            self.signals.received, self.by_another = stop, True
        return stop

    def interrupted(self, when: str, saved: bool = False) -> int:
        received = self.signals.received
        name = signal.Signals(received).name + (" to another rank" if self.by_another else "")
        rank = f"rank {self.ranks.rank}: " if self.ranks.size > 1 else ""
        _line(f"{self.model.name}: {rank}{name} {when}; " + (f"saved {self.path}" if saved else self.kept()))
        return 128 + received

    def execute(self) -> int:
        args, model = self.args, self.model
        if self.resumed is None and args.iters == 0 and getattr(args, "epochs", None) is None:
            return self.write_initial()
        if image_stream.is_image_spec(self.data_spec):
            data = self.image_data()
        else:
            data = datasets.load(self.data_spec, model.batch_shape[1:], model.classes, seed=model.seed,
                                 batch=self.batch, tokens=model.tokens, targets=model.target_shape,
                                 vocab=model.vocab, label_shape=model.label_shape)
            # every rank draws the same global batches; each trains on its share (parallel.Accumulation)
            self.stream = datasets.Batches(data.x_train, data.y_train, self.global_batch,
                                           seed=model.seed, augment=self.augment)
            self.probe = tuple(np.copy(a) for a in
                               datasets.Batches(data.x_test, data.y_test, self.batch, shuffle=False).next())
        self.data = data
        self.examples = len(data) if isinstance(data, image_stream.ImageData) else len(data.x_train)
        self.accumulation.start(model)
        if self.resumed is not None:
            model.load_tensors({k: self.resumed.tensors[k] for k in model.expected_shapes()})
            switched = self.resumed.data and self.resumed.data != self.data_spec
            if switched:
                _say(args, f"switching from '{self.resumed.data}' to '{self.data_spec}': its batches start from "
                           "the beginning")
            try:
                self.stream.position = (0, 0) if switched else self.resumed.data_position
            except ValueError:
                raise ckpt.CheckpointError(
                    f"{self.path}: fields '__data_epoch__', '__data_offset__': position {self.resumed.data_position} "
                    f"lies outside the {self.examples} training examples of '{self.data_spec}' (the data changed "
                    "since the checkpoint was written; --fresh starts over)") from None
            start = self.resumed.iteration
            _say(args, f"resuming from {self.path} at iteration {start}" + self.regrouped())
        else:
            self.fresh_start()
            start = 0
        self.count_epochs(start)
        model.prepare(self.hyper(0))
        self.ranks.agree({"start iteration": start, "batches trained on": self.batches_done,
                          "data position": self.stream.position})
        self.watchdog = parallel.watchdog(self.ranks, getattr(args, "rank_timeout", 0), model.name)
        if self.agreed_signal():
            return self.interrupted("before training started")
        iteration, loss, elapsed = start, None, 0.0
        if args.iters > start:
            self.open_logs(start)
            epochs = f" ({args.epochs} epoch{'s' if args.epochs > 1 else ''})" if getattr(args, "epochs", None) else ""
            _say(args, f"training {model.name} on {self.data_spec} ({self.examples} examples, batch "
                       f"{self.batch}{self.grouping()}) on {args.device} ({model.kernels}): iterations {start + 1} "
                       f"to {args.iters}{epochs}" + (f"; checkpoint {self.path}" if self.path else ""))
            if self.data_spec == "synthetic" and getattr(args, "data", None) is None:
                _say(args, f"warning: training on synthetic data (the default of a network file without dataset=): "
                           f"{self.examples} random examples with nothing to learn; --data SPEC chooses real data")
            try:
                iteration, loss, elapsed, stopped = self.train(start)
            finally:
                self.close_logs()
            if stopped is not None:
                return stopped
        else:
            _say(args, f"nothing to train: already at iteration {iteration} of {args.iters}")
        tested = None
        if args.test_iters:
            self.watchdog.beat()
            tested = self.validate(args.test_iters)
            if not math.isfinite(tested.loss):
                raise RunError(f"the test loss is {tested.loss} after iteration {iteration}", EXIT_DIVERGED,
                               collective=True)
            # the Loop's second value: a classifier's accuracy; of a network of float targets, whatever it computes
            metric = "accuracy" if model.classes else "metric (the Loop's second value)"
            tops = "".join(f", top-{k} {v:.4f}" for k, v in tested.top.items())
            _say(args, f"test {metric} {tested.accuracy:.4f}{tops}, test loss {tested.loss:.4f} ({tested.examples} "
                       f"examples in {tested.batches} batch{'es' if tested.batches != 1 else ''} of {self.batch})")
        if self.agreed_signal():
            return self.interrupted(f"after iteration {iteration}")
        done = iteration - start
        per_iter = elapsed / done if done else None
        if per_iter is not None:
            _say(args, f"{per_iter * 1000:.2f} ms per iteration ({done} iterations in {elapsed:.2f} s)")
        if self.products is not None:
            g = self.products.totals()
            _say(args, f"matrix products: {g['calls']} tiled GEMMs on {g['devices']} devices, "
                       f"{g['bytes_moved'] / 1e6:.2f} MB moved, output tiles per device {g['tasks_per_device']}")
        if done and not self.accumulation.split:
            _say(args, f"step replay: {self.steps.summary()}")
        figures = model.memory_report(self.accumulation.training_step)
        if figures["peak_bytes_measured"] is not None:
            _say(args, f"tensor memory ({figures['memory_mode']}): peak {figures['peak_bytes_measured'] / 1e6:.2f} MB "
                       f"measured, {figures['peak_bytes_planned'] / 1e6:.2f} MB planned; workspace "
                       f"{figures['workspace_bytes_measured'] / 1e6:.2f} MB")
        parallel_figures = self.parallel_report(elapsed)
        if self.ranks.size > 1 and done:
            _say(args, f"{self.ranks.size} ranks: {parallel_figures['bytes_reduced_per_step'] / 1e6:.2f} MB reduced a "
                       f"step ({self.ranks.mode}), {100 * parallel_figures['communication_share']:.1f} % of "
                       "the time in reductions")
        tops = {f"test_top{k}": v for k, v in tested.top.items()} if tested is not None else {}
        best = ({"best": {"metric": args.keep_best, "value": self.best[0], "iteration": self.best[1],
                          "path": self.best_path}} if self.best is not None else {})
        self.write_report(iterations=iteration, iterations_run=done, loss=loss,
                          test_accuracy=tested.accuracy if tested else None,
                          test_loss=tested.loss if tested else None, seconds_per_iter=per_iter, **tops,
                          test_examples=tested.examples if tested else None, epochs=self.epoch_now(),
                          **best, **parallel_figures, **figures, step_replay=self.steps.figures())
        return 0

    def count_epochs(self, start: int) -> None:
        """--epochs E: train to the iteration whose batch reaches the end of epoch E of the training data, counted
        from where the data stream is (so a resumed run stops where the uninterrupted one does); the learning-rate
        schedule's length follows."""
        args = self.args
        epochs = getattr(args, "epochs", None)
        if epochs is None:
            return
        epoch, offset = self.stream.position
        remaining = max(0, epochs * self.examples - (epoch * self.examples + offset))
        args.iters = start + -(-remaining // self.global_batch)
        try:
            self.schedule = Schedule.parse(getattr(args, "lr_schedule", "constant"), getattr(args, "warmup", 0),
                                           args.iters)
        except ScheduleError as err:
            raise RunError(str(err)) from None

    def epoch_now(self) -> float:
        """Passes over the training data so far: the epoch of the data stream's position and the fraction done."""
        epoch, offset = self.stream.position
        return epoch + offset / self.examples

    def validate(self, count: int | None = None):
        """The test step over the validation split: all of it, or its first `count` batches (a `program.Evaluation`).
        Images read from files: the training stream gives the ring's slots to the test batches, then goes on."""
        data, model = self.data, self.model
        if not isinstance(data, image_stream.ImageData):
            return model.evaluate(data.x_test, data.y_test, len(data.x_test) if count is None else count, self.top)
        self.stream.pause()
        batches, examples = datasets.evaluation_extent(len(data.test), self.batch, count)
        stream = image_stream.ImageBatches(self.pipeline, "test", self.batch, self.batch, 0, model.seed, train=False)
        try:
            return model.evaluate_batches(stream, batches, examples, self.top)
        except datasets.DataError as err:
            raise RunError(f"{err}; {self.kept()}", EXIT_DATA) from None
        finally:
            stream.close()

    def open_logs(self, start: int) -> None:
        """--log and --tensorboard, opened for a run that starts after iteration `start` (rank 0 writes them)."""
        args = self.args
        self.sinks = []
        self.logged = (start, time.perf_counter(), 0.0)       # iteration, time and data wait of the last entry
        if self.ranks.rank != 0:
            return
        try:
            if getattr(args, "log", None):
                self.sinks.append(metrics.MetricLog(args.log, start, bool(args.fresh)))
            if getattr(args, "tensorboard", None):
                self.sinks.append(metrics.Board(args.tensorboard, start))
        except metrics.MetricsError as err:
            self.close_logs()
            raise RunError(str(err)) from None

    def close_logs(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []

    def record(self, iteration: int, loss: float, evaluation) -> None:
        """The log entry of `iteration` to --log and --tensorboard: the iteration's loss and learning rate, where
        the data stream is, images a second and the share of time waiting for data since the last entry, the
        training step's measured peak, and the validation's figures where one ran."""
        now = time.perf_counter()
        last, then, waited = self.logged
        seconds = now - then
        stream_waited = getattr(self.stream, "waited", None) if self.pipeline is not None else None
        usage = self.model.mem.usage.get(self.accumulation.training_step)
        entry = {"iteration": iteration, "epoch": self.epoch_now(), "loss": loss,
                 "lr": self.schedule.lr(self.args.lr, iteration - 1),
                 "images_per_second": (iteration - last) * self.global_batch / seconds if seconds > 0 else None,
                 "data_wait": (stream_waited - waited) / seconds if stream_waited is not None and seconds > 0
                 else None,
                 "peak_bytes": usage.peak_bytes if usage else None, "time": time.time()}
        if evaluation is not None:
            entry.update(evaluation.figures())
        self.logged = (iteration, now, stream_waited or 0.0)
        try:
            for sink in self.sinks:
                sink.write(entry)
        except metrics.MetricsError as err:
            raise RunError(f"{err}; training stopped at iteration {iteration}, {self.kept()}", EXIT_SAVE) from None

    def validation(self, iteration: int, bar) -> object:
        """The validation after `iteration`: printed on its own line, the best checkpoint written when it
        improves (--keep-best); a non-finite loss stops the run."""
        args = self.args
        self.watchdog.beat()
        began = time.perf_counter()
        found = self.validate(getattr(args, "eval_batches", None))
        self.watchdog.beat()
        if not math.isfinite(found.loss):
            raise RunError(f"the validation loss is {found.loss} after iteration {iteration}; training stopped, "
                           f"{self.kept()}", EXIT_DIVERGED, collective=True)
        tops = "".join(f", top-{k} {v:.4f}" for k, v in found.top.items())
        text = (f"iteration {iteration} (epoch {self.epoch_now():.2f}): validation loss {found.loss:.4f}, accuracy "
                f"{found.accuracy:.4f}{tops} ({found.examples} examples, {time.perf_counter() - began:.1f} s)")
        if self.best_sense is not None:
            value = found.figures("")[args.keep_best]
            if metrics.improves(value, self.best[0] if self.best else None, self.best_sense):
                self.best = (value, iteration)
                self.save_best(iteration)
                text += f"; best {args.keep_best} so far: wrote {self.best_path}"
        if bar is not None:
            bar.write(text)
        else:
            _say(args, text)
        # the time validating is not the steps': images a second count from here
        self.logged = (self.logged[0], self.logged[1] + time.perf_counter() - began, self.logged[2])
        return found

    def save_best(self, iteration: int) -> None:
        """The checkpoint of `iteration` to --keep-best's file, atomically, with the metric, value and iteration
        (rank 0 writes; the ranks stop alike if it fails)."""
        def write() -> None:
            try:
                ckpt.write(self.best_path, self.checkpoint_state(iteration))
            except OSError as err:
                raise RunError(f"cannot write {self.best_path}: {err.strerror or err}; training stopped at iteration "
                               f"{iteration}, {self.kept()}", EXIT_SAVE) from None
        self._on_rank_zero(write)

    def _on_rank_zero(self, write):
        """`write()` on rank 0 and its result on every rank; a RunError it raises stops every rank alike."""
        outcome = None
        if self.ranks.rank == 0:
            try:
                outcome = (write(), "", 0)
            except RunError as err:
                outcome = (None, str(err), err.status)
        result, message, status = self.ranks.share(outcome) if self.ranks.size > 1 else outcome
        if message:
            raise RunError(message if self.ranks.rank == 0 else f"rank 0: {message}", status, collective=True)
        return result

    def image_data(self) -> image_stream.ImageData:
        """Images read from files: their manifests (the data set a resumed checkpoint was trained on), the
        workers and their ring, the training stream of this rank's rows and the probe batch."""
        args, model = self.args, self.model
        if model.tokens or model.target_shape is not None:
            raise RunError(f"--data {self.data_spec}: images and class labels read from files, and {model.name} "
                           f"takes {'tokens' if model.tokens else 'float targets'}")
        data = image_stream.load(self.data_spec, model.batch_shape[1:], model.classes, progress=not args.quiet,
                                 say=lambda text: _say(args, text))
        self.check_data_set(data)
        workers = getattr(args, "workers", None)
        if workers is None:                   # the cores this process may use, shared with the other ranks here
            from deepdsl_runtime.cpu.native import threads_available
            workers = max(1, threads_available() // self.ranks.local_size)
        rows = self.accumulation.accumulate * self.batch              # this rank's share of a global batch
        library = None
        if model.rt.native is not None:
            from deepdsl_runtime.cpu import native
            library = str(native.generic_library(os.path.splitext(os.path.abspath(model.program_file()))[0] + ".c"))
        try:
            self.pipeline = image_stream.Pipeline(data, self.augment, rows, getattr(args, "prefetch", 2) + 1,
                                                  workers, model.seed, library, getattr(args, "skip_bad", False))
        except OSError as err:
            raise RunError(f"cannot start the decoding workers: {err.strerror or err}") from None
        self.stream = image_stream.ImageBatches(self.pipeline, "train", rows, self.global_batch,
                                                self.ranks.rank * rows, model.seed, train=True, say=_line)
        x = np.empty(model.batch_shape, np.float32)
        y = np.empty(self.batch, np.int32)
        indices, epochs, _ = datasets.Order(len(data.test), shuffle=False).take(self.batch)
        try:
            self.pipeline.decoder().fill("test", indices, epochs, False, x, y)
        except image_stream.BadImage as err:
            raise RunError(str(err), EXIT_DATA) from None
        self.probe = (x, y)
        figures = self.pipeline.figures()
        _say(args, f"input: {len(data.train)} training and {len(data.test)} test images"
                   + (" (no validation split: testing on the training images)" if data.test_is_train else "")
                   + f", {data.channels}x{data.size[0]}x{data.size[1]}; "
                   + (f"{workers} decoding worker{'s' if workers > 1 else ''}" if workers else "decoded between steps")
                   + f" into {figures['slots']} slots of {rows} images ({figures['ring_bytes'] / 1e6:.2f} MB shared), "
                   f"manifests {figures['index_bytes'] / 1e6:.2f} MB")
        return data

    def check_data_set(self, data: image_stream.ImageData) -> None:
        """A resumed run continues on the data set its checkpoint recorded (the manifests' digest), decoded by the
        same decoders (else it says that pixels may differ)."""
        if self.resumed is None or (self.resumed.data and self.resumed.data != self.data_spec):
            return
        recorded = self.resumed.extra.get("__data_digest__")
        if recorded is not None and str(recorded) != data.digest:
            if not getattr(self.args, "switch_data", False):
                raise ckpt.CheckpointError(
                    f"{self.path}: field '__data_digest__': the files of '{self.data_spec}' changed since the "
                    "checkpoint was written (images added, removed, relabelled or rewritten); --switch-data continues "
                    "on them (no longer an exact resume), --fresh starts over")
            _say(self.args, f"the files of '{self.data_spec}' changed since the checkpoint (--switch-data): the run "
                            "continues, no longer an exact resume")
        decoder = self.resumed.extra.get("__decoder__")
        from deepdsl_runtime.image_transforms import decoder_versions
        if decoder is not None and str(decoder) != decoder_versions():
            _say(self.args, f"warning: the checkpoint's images were decoded by {decoder}, these by "
                            f"{decoder_versions()}: pixels may differ, so the resumed run may not be bit for bit")

    def recorded(self, field: str, default: int) -> int:
        """An integer field of how the resumed checkpoint was trained (`default` where it predates the field)."""
        value = self.resumed.extra.get(field)
        if value is None:
            return default
        if value.shape != () or value.dtype.kind not in "iu" or int(value) < 0:
            raise ckpt.CheckpointError(f"{self.path}: field '{field}': expected an integer >= 0, found {value.dtype} "
                                       f"{value.shape}")
        return int(value)

    @property
    def global_batch(self) -> int:
        """Examples of one iteration, over all ranks and accumulated batches."""
        return self.batch * self.accumulation.batches

    def grouping(self) -> str:
        """How the global batch is made, for the first line: '' for one batch of one process."""
        acc = self.accumulation
        if not acc.split:
            return ""
        ranks = f"{self.ranks.size} ranks x " if self.ranks.size > 1 else ""
        return f" x {ranks}{acc.accumulate} accumulated = global batch {self.global_batch}"

    def regrouped(self) -> str:
        """What changed since the checkpoint in how the global batch is made ('' if nothing)."""
        was = self.recorded("__global_batch__", self.batch)
        now = self.global_batch
        if was == now:
            return ""
        ranks = self.recorded("__ranks__", 1)
        return (f" (written with a global batch of {was} on {ranks} rank{'s' if ranks > 1 else ''}, now {now} on "
                f"{self.ranks.size}: the sample stream continues where it stopped)")

    def parallel_report(self, elapsed: float) -> dict:
        """The report's figures of accumulation and data parallelism."""
        acc, gradients = self.accumulation, self.accumulation.gradients
        reduced = gradients.nbytes if gradients is not None and self.ranks.size > 1 else 0
        usage = self.model.mem.usage.get(acc.training_step)
        return {"peak_bytes_measured_by_rank": self.ranks.gather([usage.peak_bytes if usage else None]),
                "ranks": self.ranks.size, "accumulate": acc.accumulate, "global_batch": self.global_batch,
                "reduce": self.ranks.mode if self.ranks.size > 1 else None, "bytes_reduced_per_step": reduced,
                "batch_norm": acc.batch_norm if self.model.batch_statistics else None,
                # the most any rank holds (the first receives nothing)
                "reduce_scratch_bytes": self.ranks.largest(self.ranks.scratch_bytes + acc.statistics_bytes),
                "overlapped": acc.overlap and gradients is not None and gradients.on_host,
                "buckets": len(gradients.buckets) if gradients is not None else 0,
                "accumulator_bytes": gradients.nbytes if gradients is not None else 0,
                "communication_seconds": self.ranks.waited,
                "communication_share": self.ranks.waited / elapsed if elapsed else 0.0}

    def write_report(self, **results) -> None:
        """The --report-json file (atomically), when one is asked for (by rank 0 of a job)."""
        args = self.args
        if not args.report_json or self.ranks.rank != 0:
            return
        report = {"network": self.model.name, "device": args.device, "data": self.data_spec, "batch": self.batch,
                  "params": self.path or None, **results,
                  "gemm": self.products.totals() if self.products is not None else None,
                  "input_pipeline": self.input_figures()}
        keys = ("network", "device", "data", "batch", "iterations", "iterations_run", "loss", "test_accuracy",
                "test_loss", "seconds_per_iter", "params")
        report = {**{k: report[k] for k in keys}, **{k: v for k, v in report.items() if k not in keys}}
        text = (json.dumps(report, indent=2) + "\n").encode()
        try:
            ckpt.atomic_write(args.report_json, lambda f: f.write(text))
        except OSError as err:
            raise RunError(f"cannot write --report-json {args.report_json}: {err.strerror or err}",
                           EXIT_SAVE) from None

    def hyper(self, iteration: int) -> dict:
        """The hyperparameters of iteration `iteration`: the learning rate as the schedule has it then."""
        args = self.args
        return self.model.hyper(self.schedule.lr(args.lr, iteration), getattr(args, "momentum", 0.0), args.decay,
                                iteration)

    def fresh_start(self) -> None:
        self.model.initialize(self.args.seed)
        if self.init_weights is not None:
            _init_from(self.model, self.args.init_from, self.init_weights, self.args)
            self.init_weights = None

    def write_initial(self) -> int:
        """--iters 0: the initial parameters go to --params."""
        if not self.path:
            raise RunError("--iters 0 writes the initial parameters to --params, which is empty")
        self.fresh_start()
        self.save(0)
        _say(self.args, f"wrote initial parameters to {self.path}")
        self.write_report(iterations=0, iterations_run=0, loss=None, test_accuracy=None, test_loss=None,
                          seconds_per_iter=None, **self.model.memory_report())
        return 0

    def save(self, iteration: int) -> bool:
        """Write the checkpoint of `iteration` to --params (False without one). A non-finite state, or one whose
        test loss on one batch is not finite, is not written: the run stops (diverged) and the previous checkpoint
        stays; so does a write that fails (a full disk). Ranks: all compare their parameters and state first, rank
        0 writes, all wait for the rename and stop alike if it failed."""
        if not self.path:
            return False
        if self.ranks.size == 1:
            return self._write(iteration)
        self.watchdog.beat()
        if not self.ranks.same(parallel.digest(self.model.host_tensors())):
            raise RunError(f"the ranks hold different parameters at iteration {iteration}; training stopped, "
                           f"{self.kept()}", EXIT_DIVERGED, collective=True)
        try:
            saved = self._on_rank_zero(lambda: self._write(iteration))
        finally:
            self.watchdog.beat()
        self.saved_iteration = iteration
        return saved

    def checkpoint_state(self, iteration: int) -> ckpt.Checkpoint:
        """What a checkpoint of `iteration` holds: the tensors, where the data stream is, how the global batch was
        made, the data set's digest and decoders (images read from files) and the best validation so far."""
        position = self.stream.position if self.probe is not None else (0, 0)
        state = _checkpoint(self.model, iteration, position, self.data_spec)
        state.extra.update({"__batches__": np.array(self.batches_done, dtype=np.int64),
                            "__ranks__": np.array(self.ranks.size, dtype=np.int64),
                            "__global_batch__": np.array(self.global_batch, dtype=np.int64)})
        if self.pipeline is not None:        # the data set and the decoders its pixels came from
            from deepdsl_runtime.image_transforms import decoder_versions
            state.extra.update({"__data_digest__": np.array(self.pipeline.data.digest),
                                "__decoder__": np.array(decoder_versions()),
                                "__augment__": np.array(getattr(self.args, "augment", "none")),
                                "__classes__": np.array(list(self.pipeline.data.train.classes) or [""])})
        if self.best is not None:
            state.extra.update({"__best_metric__": np.array(self.args.keep_best),
                                "__best_value__": np.array(self.best[0], dtype=np.float64),
                                "__best_iteration__": np.array(self.best[1], dtype=np.int64)})
        return state

    def _write(self, iteration: int) -> bool:
        state = self.checkpoint_state(iteration)
        bad = next((name for name, a in state.tensors.items() if not np.all(np.isfinite(a))), None)
        if bad is not None:
            raise RunError(f"NaN or infinite values in '{bad}' at iteration {iteration}; training stopped, "
                           f"{self.kept()}", EXIT_DIVERGED)
        if self.probe is not None:
            _, probe_loss, _ = self.model.test_step(*self.probe)
            if not math.isfinite(probe_loss):
                raise RunError(f"the loss is {probe_loss} on a test batch at iteration {iteration}; training stopped, "
                               f"{self.kept()}", EXIT_DIVERGED)
        self.writing = iteration
        try:
            ckpt.write(self.path, state)
        except OSError as err:
            raise RunError(f"cannot write {self.path}: {err.strerror or err}; training stopped at iteration "
                           f"{iteration}, {self.kept()}", EXIT_SAVE) from None
        self.saved_iteration = iteration
        return True

    def input_figures(self) -> dict | None:
        """The report's figures of images read from files: the pipeline's memory, images a second and the share of
        the training time spent waiting for them."""
        if self.pipeline is None:
            return None
        stream = self.stream
        rates = stream.rates()
        return {**self.pipeline.figures(), "images_per_second": rates[0] if rates else None,
                "data_wait_share": rates[1] if rates else None, "data_wait_seconds": stream.waited}

    def input_rates(self) -> str:
        """For the progress line, of images read from files: images a second and the share of the time the steps
        waited for them ('' otherwise)."""
        rates = self.stream.rates() if self.pipeline is not None else None
        return f", {rates[0]:.0f} img/s, data wait {100 * rates[1]:.0f} %" if rates else ""

    def follow_free_cores(self, bar) -> None:
        """Threads to the cores other processes leave free (without --threads), said when they change."""
        threads = self.model.follow_free_cores()
        if threads is not None:
            cores = self.model.free_cores
            text = (f"{threads} thread{'s' if threads > 1 else ''}: other processes keep {cores.others:.1f} of the "
                    f"{len(cores.cpus)} cores busy")
            if bar is not None:
                bar.write(text)
            else:
                _say(self.args, text)

    def train(self, start: int) -> tuple[int, float | None, float, int | None]:
        """Train from iteration `start` to --iters: (iteration reached, last loss, seconds, exit status if the
        run must stop here). The progress bar is closed before anything else is printed."""
        args, model = self.args, self.model
        iteration, loss, diverged = start, None, None
        bar = _progress(args, start)
        self.watchdog.bar_shown = bar is not None        # its line of stderr is open: a watchdog starts a new one
        began = time.perf_counter()
        acc, stop = self.accumulation, 0
        epoch, log_every = self.stream.position[0], getattr(args, "log_every", 10)
        self.steps.ahead = args.iters - start
        try:
            while iteration < args.iters:
                try:
                    xb, yb = self.stream.next()
                except datasets.DataError as err:        # a bad image, or a decoding worker that ended
                    raise RunError(f"{err}; {self.kept()}", EXIT_DATA) from None
                hyper = self.hyper(iteration)
                if acc.split:
                    value = acc.iterate(model, xb, yb, self.batches_done, hyper)
                else:
                    value = self.steps(xb, yb, step=self.batches_done, **hyper)
                self.batches_done += acc.batches
                self.follow_free_cores(bar)
                self.watchdog.beat()
                if not math.isfinite(value):
                    diverged = value
                    break
                iteration, loss = iteration + 1, value
                if bar is not None:
                    bar.set_postfix_str(f"loss {value:.4f}" + self.input_rates(), refresh=False)
                    bar.update(1)
                evaluation = None
                if self.eval_every is not None and (self.stream.position[0] > epoch if self.eval_every == metrics.EPOCH
                                                    else iteration % self.eval_every == 0):
                    evaluation = self.validation(iteration, bar)
                if self.sinks and (iteration % log_every == 0 or evaluation is not None or iteration == args.iters):
                    self.record(iteration, value, evaluation)
                epoch = self.stream.position[0]
                stop = self.agreed_signal()          # a signal to any rank stops them all here
                if stop:
                    break
                if args.save_every and iteration % args.save_every == 0 and iteration < args.iters:
                    self.save(iteration)
        finally:
            if bar is not None:
                bar.close()
            self.watchdog.bar_shown = False
        elapsed = time.perf_counter() - began
        if diverged is not None:
            raise RunError(f"the loss is {diverged} at iteration {iteration + 1}; training stopped, {self.kept()}",
                           EXIT_DIVERGED, collective=True)
        if stop:
            return iteration, loss, elapsed, self.interrupted(f"at iteration {iteration}", saved=self.save(iteration))
        saved = self.save(iteration)
        _say(args, f"trained to iteration {iteration}, last loss {loss:.4f}" + (f"; saved {self.path}" if saved else ""))
        return iteration, loss, elapsed, None


def _progress(args, start: int):
    if args.quiet:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=args.iters, initial=start, unit="it", dynamic_ncols=True, mininterval=0.5)
