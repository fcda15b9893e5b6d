"""Using a trained network: `deepdsl predict NET.py --params P.npz --data SPEC | FILES... [--top K] [--json]`, and
for a language model `--prompt TEXT --tokens N [--temperature T] [--seed S]`.

The forward pass runs in the program's own predict step (`predict_step`: no labels, no gradients, no optimizer
state; its memory plan is printed by `deepdsl memory NET.py --step predict`) over batches of the compiled size, the
last one completed with copies of its first example (their outputs dropped). What it reads:

- `--data SPEC`: the validation (test) split of a data spec (digits, mnist:DIR, folder:DIR, shards:...), with its
  labels (the accuracy is then counted too), or all of `x` of an `npz:PATH` (and its `y` where it has one);
- image files (JPEG, PNG, ...): decoded and given the evaluation transform of the run that trained the
  checkpoint (its `--augment` recorded there: resize, centre crop, normalization);
- a prompt: its bytes, continued token by token from the probabilities at its last position, sampled at a
  temperature from a generator seeded with `--seed` (0: the most probable byte), so a seed gives one text.
"""
from __future__ import annotations

import json
import math
import sys
import time

import numpy as np

from deepdsl_runtime import checkpoint as ckpt
from deepdsl_runtime import data as datasets
from deepdsl_runtime import image_stream
from deepdsl_runtime.frames import run_with_room
from deepdsl_runtime.run import RunError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
MOST_TOKENS = 1 << 20          # bytes a prompt is continued by at most


def load_parameters(model, path: str) -> str:
    """The parameters and model state (batch-norm statistics) the predict step reads, from a deepdsl checkpoint or
    a plain .npz / .safetensors of arrays by the network's names (or PyTorch's: `run.pytorch_name`); anything
    missing or of another shape is an error naming it. Returns the checkpoint's --augment ('' where it has none)."""
    from deepdsl_runtime.run import pytorch_name

    arrays = ckpt.read_weights(path)
    augment = ckpt.recorded_text(path, "__augment__")
    by_name = {}
    for name, array in arrays.items():
        target = name if name in model.params or name in model.states else pytorch_name(name)
        if target is not None:
            by_name.setdefault(target, array)
    needed = {**{k: p.shape for k, p in model.params.items()},
              **{k: s.shape for k, s in model.states.items() if not s.optimizer}}
    model.initialize(0)                     # optimizer state the predict step never reads
    for name, shape in needed.items():
        array = by_name.get(name)
        if array is None:
            raise RunError(f"--params {path}: no tensor '{name}' of {model.name} (a checkpoint of another network?)")
        if tuple(array.shape) != tuple(shape):
            raise RunError(f"--params {path}: tensor '{name}' has shape {'x'.join(map(str, array.shape))}, "
                           f"{model.name} needs {'x'.join(map(str, shape))}")
        if array.dtype.kind != "f" or not np.all(np.isfinite(array)):
            raise RunError(f"--params {path}: tensor '{name}' does not hold finite floats")
    model.load_tensors({name: by_name[name] for name in needed})
    return augment or ""


class Predictor:
    """The predict step of a model over examples of any number, in batches of the compiled size."""

    def __init__(self, model):
        self.model = model
        self.batch = model.batch_shape[0]
        model.prepare(model.hyper(1.0, 0.0, 0.0, 0))

    def outputs(self, x: np.ndarray) -> np.ndarray:
        """The predict step's outputs for the examples `x` (any number), one row group per example."""
        n = len(x)
        results = []
        buffer = np.empty(self.model.batch_shape, dtype=x.dtype)
        for a in range(0, n, self.batch):
            part = x[a:a + self.batch]
            buffer[:len(part)] = part
            buffer[len(part):] = part[:1]
            out = self.model.predict_step(buffer)
            rows = out.reshape(self.batch, -1, *out.shape[1:]) if out.shape[0] != self.batch else out
            results.append(rows[:len(part)])          # predict_step's own copy: no second one
        return np.concatenate(results) if results else np.empty((0,))


def _top(probabilities: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The k most probable classes of each row (ties: the lower class first) and their probabilities."""
    order = np.argsort(-probabilities, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(probabilities, order, axis=1)


def _read_npz(path: str, model) -> tuple[np.ndarray, np.ndarray | None]:
    """All of `x` (or `x_test`) of an .npz, and its labels `y` (`y_test`) where it has them, read as `npz:` data for
    training reads them (`data.npz_inputs`, `data.npz_labels`)."""
    spec = f"--data npz:{path}"
    shape = tuple(model.batch_shape[1:])
    tokens = (shape[0], model.vocab or model.classes, model.label_shape != ()) if model.tokens else None
    try:
        arrays = datasets.read_npz(spec, path)
        key = "x" if "x" in arrays else "x_test" if "x_test" in arrays else None
        if key is None:
            raise RunError(f"{spec}: no array 'x' (or 'x_test') in {path}")
        x = datasets.npz_inputs(spec, path, key, arrays[key], tokens)
        label_key = "y" if key == "x" else "y_test"
        y = None if label_key not in arrays else \
            datasets.npz_labels(spec, path, label_key, arrays[label_key], classes=model.classes, tokens=tokens)
    except datasets.DataError as err:
        raise RunError(str(err)) from None
    if x.shape[1:] != shape:
        raise RunError(f"{spec}: '{key}' holds {'tokens' if model.tokens else 'images'} of shape "
                       f"{'x'.join(map(str, x.shape[1:]))}, {model.name} takes {'x'.join(map(str, shape))}")
    if y is not None and len(y) != len(x):
        raise RunError(f"{spec}: {len(y)} labels in '{label_key}' for {len(x)} examples in '{key}'")
    return x, y


def _read_files(files: list[str], model, augment: str) -> np.ndarray:
    """Image files with the evaluation transform of the checkpoint's --augment."""
    from deepdsl_runtime import image_transforms as it

    transform = it.ImageTransform.parse(augment or "none")
    channels, h, w = model.batch_shape[1:]
    scale, bias = transform.scale_bias(channels)
    x = np.empty((len(files), channels, h, w), np.float32)
    for k, name in enumerate(files):
        try:
            with open(name, "rb") as f:
                image = it.decode(f.read(), channels)
        except OSError as err:
            raise RunError(f"{name}: cannot be read: {err.strerror or err}") from None
        except it.DecodeError as err:
            raise RunError(f"{name}: cannot be decoded as an image: {err}") from None
        plan = it.plan(transform, image.shape[0], image.shape[1], h, w, None, False)
        scratch = np.empty(it.scratch_size(image.shape, plan), np.float32)
        it.render(image, plan, scale, bias, x[k], scratch, None)
    return x


def _read_spec(spec: str, model, augment: str) -> tuple[np.ndarray, np.ndarray | None, list[str], list[str]]:
    """The validation split of a data spec: (x, labels, each example's name, class names or [])."""
    if spec.startswith("npz:"):
        x, y = _read_npz(spec[4:], model)
        return x, y, [f"{spec[4:]}[{k}]" for k in range(len(x))], []
    if image_stream.is_image_spec(spec):
        from deepdsl_runtime import image_transforms as it

        data = image_stream.load(spec, model.batch_shape[1:], model.classes)
        decoder = image_stream.Decoder({"train": data.train, "test": data.test},
                                       it.ImageTransform.parse(augment or "none"), data.channels, data.size, 0,
                                       spec=spec)
        n = len(data.test)
        x = np.empty((n, *model.batch_shape[1:]), np.float32)
        y = np.empty(n, np.int32)
        try:
            decoder.fill("test", np.arange(n), np.zeros(n, np.int64), False, x, y)
        except image_stream.BadImage as err:
            raise RunError(str(err)) from None
        return x, y, [data.test.name(i) for i in range(n)], list(data.test.classes)
    data = datasets.load(spec, model.batch_shape[1:], model.classes, seed=0, batch=model.batch_shape[0],
                         tokens=model.tokens, targets=model.target_shape, vocab=model.vocab,
                         label_shape=model.label_shape)
    return data.x_test, data.y_test, [f"{spec}[{k}]" for k in range(len(data.x_test))], []


def classify(model, args, augment: str) -> dict:
    """Class probabilities of the examples the options name: the result as a JSON-ready dict."""
    if args.data is not None and args.files:
        raise RunError("give --data SPEC or image files, not both")
    if args.data is not None:
        x, y, names, classes = _read_spec(args.data, model, augment)
    elif args.files:
        if model.tokens:
            raise RunError(f"{model.name} takes tokens: give --data npz:PATH (integer arrays) or --prompt")
        # by the class names of the images the checkpoint was trained on, where it records them
        classes = [c for c in ckpt.recorded_names(args.params, "__classes__") if c]
        classes = classes if len(classes) == model.classes else []
        x, y, names = _read_files(args.files, model, augment), None, list(args.files)
    else:
        raise RunError("nothing to predict: give --data SPEC, image files, or --prompt for a language model")
    if not len(x):
        raise RunError("no examples to predict")
    began = time.perf_counter()
    probabilities = Predictor(model).outputs(x)
    seconds = time.perf_counter() - began
    k = max(1, min(args.top or min(5, model.classes), model.classes))
    flat = probabilities.reshape(-1, model.classes)
    top, chance = _top(flat, k)
    positions = flat.shape[0] // len(x)            # a language model predicts every position of a sequence
    examples = []
    for i, name in enumerate(names):
        rows = range(i * positions, (i + 1) * positions)
        entry = {"input": name, "top": [[{"class": int(c), **({"name": classes[c]} if classes else {}),
                                          "probability": float(p)} for c, p in zip(top[r], chance[r])]
                                        for r in rows]}
        if positions == 1:
            entry["top"] = entry["top"][0]
        if y is not None:
            entry["label"] = y[i].tolist()
        examples.append(entry)
    result = {"network": model.name, "params": args.params, "examples": examples, "count": len(x),
              "seconds": seconds}
    if y is not None:
        labels = y.reshape(-1)
        result["accuracy"] = float(np.mean(top[:, 0] == labels)) if len(labels) == flat.shape[0] else None
    result.update(_memory(model))
    return result


def _memory(model) -> dict:
    usage, plan = model.mem.usage.get("predict_step"), model.memory_plans.get("predict_step")
    return {"peak_bytes_measured": usage.peak_bytes if usage else None,
            "peak_bytes_planned": plan.planned_peak(model.mem.mode) if plan else None}


def continue_prompt(model, args) -> dict:
    """A language model's continuation of --prompt by --tokens bytes."""
    if not model.tokens:
        raise RunError(f"--prompt: {model.name} takes images, not tokens")
    if args.data is not None or args.files:
        raise RunError("--prompt continues a text: leave out --data and files")
    tokens = list(args.prompt.encode())
    if not tokens:
        raise RunError("--prompt is empty: give at least one character to continue")
    if not 0 <= args.tokens <= MOST_TOKENS:
        raise RunError(f"--tokens must be in [0, {MOST_TOKENS}], got {args.tokens}")
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise RunError(f"--temperature must be a finite number >= 0, got {args.temperature}")
    if max(tokens) >= model.classes:
        raise RunError(f"--prompt holds bytes beyond the {model.classes} tokens of {model.name}")
    n, window = model.batch_shape
    Predictor(model)                        # the values computed once before the steps
    rng = np.random.default_rng(args.seed)
    x = np.zeros(model.batch_shape, np.int32)
    made = []
    for _ in range(args.tokens):
        context = (tokens + made)[-window:]
        x[0, :len(context)] = context
        probabilities = model.predict_step(x).reshape(n, window, -1)[0, len(context) - 1].astype(np.float64)
        if args.temperature == 0:
            token = int(np.argmax(probabilities))
        else:
            logits = np.log(np.maximum(probabilities, 1e-300)) / args.temperature
            weights = np.exp(logits - logits.max())
            token = int(rng.choice(len(weights), p=weights / weights.sum()))
        made.append(token)
    text = bytes(made).decode("utf-8", errors="replace")
    return {"network": model.name, "params": args.params, "prompt": args.prompt, "tokens": made, "text": text,
            "temperature": args.temperature, "seed": args.seed, **_memory(model)}


def _text(result: dict) -> str:
    """The result as lines for a terminal."""
    if "prompt" in result:
        return result["prompt"] + result["text"] + "\n"
    lines = []
    for entry in result["examples"]:
        top = entry["top"] if entry["top"] and isinstance(entry["top"][0], dict) else entry["top"][-1]
        shown = ", ".join(f"{c.get('name', c['class'])} {c['probability']:.4f}" for c in top)
        label = f"  (label {entry['label']})" if "label" in entry and not isinstance(entry["label"], list) else ""
        lines.append(f"{entry['input']}: {shown}{label}")
    if result.get("accuracy") is not None:
        lines.append(f"accuracy {result['accuracy']:.4f} over {result['count']} examples")
    return "\n".join(lines) + "\n"


def predict(model_cls, args) -> int:
    """`deepdsl predict` for a generated program's model class; returns the exit status."""
    try:
        if args.top is not None and args.top < 1:
            raise RunError(f"--top must be >= 1, got {args.top}")
        if args.out:
            ckpt.check_target(args.out, "-o")
        model = model_cls(args.device, 0, "static", False, args.kernels, args.threads)
        if "predict_step" not in model.memory_plans:
            model.predict_step(None)                      # says why there is none
        augment = load_parameters(model, args.params)
        result = run_with_room(continue_prompt, model, args) if args.prompt is not None else \
            run_with_room(classify, model, args, augment)          # the steps' calls on one frame chunk
    except (RunError, ckpt.CheckpointError, datasets.DataError) as err:
        sys.stderr.write(f"deepdsl predict: error: {err}\n")
        return 1
    text = json.dumps(result, indent=1) + "\n" if args.json else _text(result)
    if args.out:
        try:
            ckpt.atomic_write(args.out, lambda f: f.write(text.encode()))
        except OSError as err:
            sys.stderr.write(f"deepdsl predict: error: cannot write {args.out}: {err.strerror or err}\n")
            return 1
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(text)
    return 0


__all__ = ["Predictor", "classify", "continue_prompt", "load_parameters", "predict"]
