"""The `deepdsl` command line: `ir`, `graph`, `compile`, `run`, `memory`, `data`, `refresh`.

Every error a user can cause (a network file that does not load, a shape mismatch, a bad option) is printed as one
line naming the file and line, with exit status 1; `--debug` shows the Python traceback instead. Outputs (`-o`,
`--plot`) are written after creating missing directories; one that would overwrite the network file, a program
whose kernels (`.c`, `.cu` beside it) would overwrite it, or whose location cannot be written, is such a one-line
error naming it. SIGINT, SIGTERM and SIGHUP stop a command with one line and exit status 128 + the signal.

`run` writes the program and its default checkpoint under `.deepdsl/`, named after the network file, the batch and
the structure hash (so different compilations never share a checkpoint), prints both paths, and runs the program
through `deepdsl.codegen.run_program`: SIGINT, SIGTERM and SIGHUP reach the program once, `run` waits while it
saves and exits with its status.
"""
from __future__ import annotations

import argparse
import contextlib
import fnmatch
import os
import sys
from pathlib import Path

from deepdsl.errors import DeepDSLError

STEP_NAMES = ("train", "test", "predict", "setup", "accumulate", "apply", "statistics")


def _image(text: str) -> tuple[int, int]:
    parts = text.lower().replace("x", ",").split(",")
    try:
        sizes = [int(p) for p in parts if p]
    except ValueError:
        raise argparse.ArgumentTypeError(f"image size must be H or H,W (got '{text}')") from None
    if len(sizes) == 1:
        sizes *= 2
    if len(sizes) != 2 or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"image size must be H or H,W (got '{text}')")
    return sizes[0], sizes[1]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got '{text}'")
    return value


def _bytes(text: str) -> int:
    """A byte count: `67108864`, `64MB`, `1.5GB`, `800k` (decimal units: 1 MB = 10^6 bytes, as in the tables),
    exactly, of any size (`_check_sizes` refuses one beyond `ir.MAX_BYTES`)."""
    import re
    from fractions import Fraction
    if text.strip().lower() in ("none", "unlimited"):
        return -1                        # no limit
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]?)b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"expected a number of bytes such as 67108864 or 64MB, got '{text}'")
    value = Fraction(match.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[match.group(2)]
    return int(value)


def _check_sizes(args: argparse.Namespace) -> None:
    """The byte options within what a plan may take (`ir.MAX_BYTES`: beyond any machine's memory)."""
    from deepdsl.ir import MAX_BYTES, bytes_text
    for option in ("--memory-budget", "--workspace-limit", "--fit"):
        value = getattr(args, option[2:].replace("-", "_"), None)
        if value is not None and value > MAX_BYTES:
            raise DeepDSLError(f"{option}: {bytes_text(value)} is more than any machine holds; give at most 2^48 "
                               f"= {MAX_BYTES} bytes ({MAX_BYTES // 10**9}GB)")


def _workspace_limit(args: argparse.Namespace) -> int | None:
    from deepdsl.pipeline import DEFAULT_WORKSPACE_LIMIT
    if args.workspace_limit is None:
        return DEFAULT_WORKSPACE_LIMIT
    return None if args.workspace_limit < 0 else args.workspace_limit


def _add_network_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("network", help="network file (a Python module defining a D.Loop)")
    p.add_argument("--batch", type=_positive, help="override the batch size the network file declares")
    p.add_argument("--image", type=_image, metavar="H[,W]", help="override the input image height and width")
    p.add_argument("--no-simplify", action="store_true", help="skip algebraic simplification")
    p.add_argument("--no-fuse", action="store_true", help="skip elementwise fusion")
    p.add_argument("--no-cse", action="store_true", help="skip common-subexpression elimination")
    p.add_argument("--no-code-motion", action="store_true", help="skip hoisting and sinking")
    p.add_argument("--workspace-limit", type=_bytes, metavar="BYTES",
                   help="scratch workspace limit (ops run over the batch in chunks to fit), e.g. 64MB; default "
                        "32 MiB; 'none' for no limit")
    p.add_argument("--memory-budget", type=_bytes, metavar="BYTES",
                   help="bytes every step's planned total (persistent + arena + workspace, as `deepdsl memory` "
                        "prints it) must fit, e.g. 300MB (MB = 10^6 bytes): values are recomputed and the workspace "
                        "limit lowered until it does, else a one-line error states the least reachable")
    p.add_argument("--memory-solver", choices=("greedy", "exact"), default="greedy",
                   help="how --memory-budget chooses recomputations: greedy (default: a fixed sequence, monotone in "
                        "the budget) or exact (also a MILP, needs scipy; taken where it costs fewer FLOPs)")
    p.add_argument("--data-parallel", action="store_true",
                   help="also compile the steps that accumulate gradients and apply them, which the program's "
                        "--accumulate K and --data-parallel (under mpiexec) run (`deepdsl run` adds it when those "
                        "options follow `--`)")


def _compile(args: argparse.Namespace):
    import deepdsl
    from deepdsl.dsl import Overrides

    loop = deepdsl.load(args.network, Overrides(batch=args.batch, image=args.image))
    return deepdsl.compile(loop, _options(args))


def _options(args: argparse.Namespace):
    from deepdsl import CompileOptions

    budget = args.memory_budget if args.memory_budget is not None and args.memory_budget >= 0 else None
    split = args.data_parallel or any(a.split("=")[0] in ("--accumulate", "--data-parallel")
                                      for a in getattr(args, "program_args", ()))
    return CompileOptions(simplify=not args.no_simplify, fuse=not args.no_fuse, cse=not args.no_cse,
                          code_motion=not args.no_code_motion, workspace_limit=_workspace_limit(args),
                          memory_budget=budget, memory_solver=None if args.memory_solver == "greedy" else "exact",
                          data_parallel=split)


def _compile_step(args: argparse.Namespace):
    """The compiled network with the step `--step` names (the accumulate, apply and statistics steps compile with
    --data-parallel, which naming them implies)."""
    if args.step in ("accumulate", "apply", "statistics"):
        args.data_parallel = True
    compiled = _compile(args)
    if args.step not in compiled.steps and args.step != "all":
        raise DeepDSLError(f"{compiled.name} has no {args.step} step (it updates the running statistics of batch "
                           "norm, which this network does not have)")
    return compiled


def cmd_ir(args: argparse.Namespace) -> int:
    compiled = _compile_step(args)
    steps = tuple(compiled.steps) if args.step == "all" else (args.step,)
    texts = [compiled.steps[s].program.text() for s in steps if compiled.steps[s].program.body or s == args.step]
    sys.stdout.write("\n".join(texts))
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    from deepdsl.graph import program_graph, write_dot

    output = None if args.output in (None, "-") else Path(args.output)
    if output is not None:
        _check_output(args.network, "-o", output)
    compiled = _compile_step(args)
    program = compiled.steps[args.step].program
    text = write_dot(program_graph(program), program.name)
    if output is None:
        sys.stdout.write(text)
    else:
        with _writing(output):
            output.parent.mkdir(parents=True, exist_ok=True)
            output.write_text(text)
        print(f"wrote {output} ({len(program.body)} statements)")
    return 0


def _default_output(network: str) -> Path:
    return Path("generated") / Path(network).name


@contextlib.contextmanager
def _writing(path: Path):
    """A failure to create `path` or its directories becomes a one-line error naming it."""
    try:
        yield
    except OSError as err:
        blocking = next((p for p in reversed(Path(path).parents) if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            reason = f"{blocking} is not a directory"
        else:
            reason = err.strerror or str(err)
            if err.filename and Path(err.filename) != Path(path):
                reason = f"{reason}: {err.filename}"
        raise DeepDSLError(f"cannot write {path}: {reason}") from None


def _check_output(network: str, option: str, output: Path, program: bool = False) -> None:
    """Refuse an output that would overwrite the network file: `output` itself or, for a program (`program`), the
    files written beside it (`<stem>.cu`, `<stem>.c`, `<stem>.<digest>.fatbin`, `<stem>.<digest>.so`), nor be one
    of those files itself, nor a directory."""
    # (os.path.realpath, not Path.resolve: a loop of symbolic links is a path like another here, and the loader
    # names it)
    source = Path(os.path.realpath(network))
    target = Path(os.path.realpath(output))
    if target == source:
        raise DeepDSLError(f"{option} {output} is the network file itself; choose another output")
    if not program:
        return
    if not target.name or target.is_dir():
        raise DeepDSLError(f"cannot write {output}: is a directory; name the program file ({option} "
                           f"{Path(output, Path(network).name)})")
    if target.suffix in (".c", ".cu"):
        raise DeepDSLError(f"{option} {output}: the program's kernels are written beside it as "
                           f"{output.with_suffix('.c')} and {output.with_suffix('.cu')}, which would replace it; "
                           "name the program <name>.py")
    beside = source in (target.with_suffix(".cu"), target.with_suffix(".c")) or (
        source.parent == target.parent and any(fnmatch.fnmatchcase(source.name, f"{target.stem}.*.{kind}*")
                                               for kind in ("fatbin", "so")))
    if beside:
        raise DeepDSLError(f"{option} {output} would overwrite the network file {network} (the program's "
                           f"{source.suffix} file); choose another output")


def _write(compiled, network: str, out: Path, options=None) -> Path:
    """Write the program of `compiled` and its kernels to `out` (directories are created); a location that cannot
    be written is a one-line error naming it."""
    from deepdsl.codegen import write_program

    _check_output(network, "-o", out, program=True)
    with _writing(out):
        return write_program(compiled, out, options)


def cmd_compile(args: argparse.Namespace) -> int:
    out = Path(args.output) if args.output else _default_output(args.network)
    _check_output(args.network, "-o", out, program=True)
    compiled = _compile(args)
    path = _write(compiled, args.network, out)
    print(f"wrote {path}, {path.with_suffix('.cu')}, {path.with_suffix('.c')}")
    from deepdsl.codegen.native import build_in_background
    print(build_in_background(path.with_suffix(".c")))
    if args.cuda_binary:
        _build_kernels(path)
    return 0


def _build_cpu_kernels(program: Path) -> None:
    """The library of the program's compiled CPU kernels, with a C compiler (else the program runs numpy's kernels
    and says so)."""
    from deepdsl.codegen.native import build_library, not_built

    built, why = build_library(program.with_suffix(".c"))
    if built is None:
        print(not_built(why))


def _build_kernels(program: Path) -> None:
    """With nvcc installed, the fat binary of the program's CUDA kernels (else the program compiles them when it
    runs with --device cuda)."""
    from deepdsl.codegen.cuda import build_fatbin, find_nvcc

    if find_nvcc():
        fatbin = build_fatbin(program.with_suffix(".cu"))
        if fatbin is not None:
            print(f"wrote {fatbin}")


def _runs_on_cuda(program_args: list[str]) -> bool:
    """Whether the program's own options ask for `--device cuda`."""
    pairs = zip(program_args, program_args[1:] + [""])
    return "--device=cuda" in program_args or any(a == "--device" and b == "cuda" for a, b in pairs)


def _program_params(program_args: list[str]) -> str | None:
    """The checkpoint the program's own options name (`--params PATH`, `--params=PATH` or an abbreviation of the
    option, as argparse accepts it), else None."""
    found = None
    for k, arg in enumerate(program_args):
        option, equals, value = arg.partition("=")
        if len(option) > 2 and option.startswith("--p") and "--params".startswith(option):
            if equals:
                found = value
            elif k + 1 < len(program_args):
                found = program_args[k + 1]
    return found


def _run_name(compiled, network: str) -> str:
    """`<network>-b<batch>-<structure hash prefix>`: the same for compilations whose checkpoints are interchangeable
    (same network file name, batch and training step), different otherwise."""
    from deepdsl.codegen import structure_hash

    data = [n for n in compiled.train.inputs if n.op == "input" and n.attr("role") == "data"]
    batch = f"-b{data[0].shape[0]}" if data else ""
    return f"{Path(network).stem}{batch}-{structure_hash(compiled)[:8]}"


def _prepare_run(args: argparse.Namespace) -> tuple[Path, str]:
    """Compile and write the program `run` starts: (its path, the checkpoint it will use, '' for none)."""
    from deepdsl.codegen import CodegenOptions

    if args.output:
        _check_output(args.network, "-o", Path(args.output), program=True)
    compiled = _compile(args)
    # a scratch copy: `run` may use overrides, so it never rewrites the checked-in generated/ programs
    out = Path(args.output) if args.output else Path(".deepdsl") / f"{_run_name(compiled, args.network)}.py"
    params = str(out.with_name(f"{out.stem}.params.npz"))
    path = _write(compiled, args.network, out, CodegenOptions(params_file=params))
    if _runs_on_cuda(args.program_args):
        _build_kernels(path)
    else:
        _build_cpu_kernels(path)
    chosen = _program_params(args.program_args)
    return path, params if chosen is None else chosen


def cmd_run(args: argparse.Namespace) -> int:
    from deepdsl.codegen import run_program

    if any(arg in ("-h", "--help") for arg in args.program_args):
        return _program_help(args)
    path, params = _prepare_run(args)
    print(f"wrote {path}; running it (" + (f"checkpoint: {params})" if params else "no checkpoint)"), flush=True)
    return run_program(path, args.program_args)


def _run_program_text(text: str, path: Path, name: str) -> dict:
    """The names a generated program's text defines, run as module `name` from `path` (where it finds its kernels'
    library), without importing it by its path."""
    program: dict = {"__name__": name, "__file__": str(path)}
    exec(compile(text, str(path), "exec"), program)
    return program


def _program_help(args: argparse.Namespace) -> int:
    """`deepdsl run NET.py -- --help`: the program's own help, from its text in memory (compiled as `run` compiles
    it, from the compile caches where they hold it); nothing is written, built or run."""
    from deepdsl.codegen import CodegenOptions, generate

    compiled = _compile(args)
    out = Path(args.output) if args.output else Path(".deepdsl") / f"{_run_name(compiled, args.network)}.py"
    text = generate(compiled, CodegenOptions(params_file=str(out.with_name(f"{out.stem}.params.npz"))))
    program = _run_program_text(text, out, "deepdsl_help")
    try:
        return program["main"](["--help"])
    except SystemExit as done:
        return done.code if isinstance(done.code, int) else 0


def _check_plot_format(path: Path) -> None:
    """A file name whose extension matplotlib cannot write is an error before anything is computed (without
    matplotlib, `memory_table.plot` says it is missing)."""
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        return
    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = path.suffix[1:].lower()
    if kind and kind not in kinds:
        raise DeepDSLError(f"--plot {path}: matplotlib cannot write .{kind} files (use one of "
                           f"{', '.join('.' + k for k in sorted(kinds))})")


def cmd_memory(args: argparse.Namespace) -> int:
    from deepdsl import memory_table

    plot = Path(args.plot) if args.plot else None
    if plot is not None:
        _check_output(args.network, "--plot", plot)
        _check_plot_format(plot)
    if args.fit is not None:
        return _fit(args)
    if args.accumulate < 1:
        raise DeepDSLError(f"--accumulate must be >= 1, got {args.accumulate}")
    compiled = _compile_step(args)
    report = memory_table.memory_report(compiled, args.step)
    pipeline = _input_pipeline(compiled, args) if args.data else None
    if plot is not None:
        with _writing(plot):
            plot.parent.mkdir(parents=True, exist_ok=True)
            memory_table.plot(report, args.plot)
    if args.json:
        text = memory_table.to_json(report)
        if pipeline is not None:
            import json
            text = json.dumps({**json.loads(text), "input_pipeline": pipeline[1]}, indent=2) + "\n"
        sys.stdout.write(text)
    else:
        sys.stdout.write(memory_table.format_table(report))
        if pipeline is not None:
            print()
            print("\n".join(pipeline[0]))
    if args.plot:
        print(f"wrote {args.plot}", file=sys.stderr)
    return 0


def _input_pipeline(compiled, args: argparse.Namespace) -> tuple[list[str], dict]:
    """The memory of the input pipeline `--data` (images read from files) would take beside the step: its lines and
    figures (`deepdsl_runtime.image_stream.planned`), for the batch of `--accumulate` compiled batches."""
    from deepdsl.ir import toposort
    from deepdsl_runtime import image_stream
    from deepdsl_runtime.data import DataError

    if not image_stream.is_image_spec(args.data):
        raise DeepDSLError(f"--data {args.data}: `deepdsl memory` states the pipeline of images read from files "
                           "(folder:DIR, shards:PATTERN); in-memory data sets take no memory beside the step's inputs")
    nodes = toposort([compiled.loop.loss.node])
    data = next(n for n in nodes if n.op == "input" and n.attr("role") == "data")
    label = next(n for n in nodes if n.op == "input" and n.attr("role") == "label")
    from deepdsl.codegen.description import _classes
    if len(data.shape) != 4 or len(label.shape) != 1:
        raise DeepDSLError(f"--data {args.data}: {compiled.name} takes {'x'.join(map(str, data.shape))} inputs, not "
                           "images and class labels")
    from deepdsl_runtime.cpu.native import threads_available
    workers = args.workers if args.workers is not None else threads_available()
    try:
        loaded = image_stream.load(args.data, tuple(data.shape[1:]), _classes(compiled), progress=True)
    except DataError as err:
        raise DeepDSLError(str(err)) from None
    figures = image_stream.planned(loaded, args.accumulate * data.shape[0], args.prefetch + 1, workers)
    return image_stream.describe(loaded, figures), figures


def _fit(args: argparse.Namespace) -> int:
    """`deepdsl memory NET.py --fit BYTES`: the largest batch whose steps fit, without and with recomputation."""
    import deepdsl
    from deepdsl.budget import largest_batch
    from deepdsl.dsl import Overrides

    if args.fit < 0:
        raise DeepDSLError("--fit needs a number of bytes, e.g. 16GB")
    loop = deepdsl.load(args.network, Overrides(batch=args.batch, image=args.image))
    options = _options(args).changed(memory_budget=args.fit)
    start = args.batch or _declared_batch(loop)
    plain = largest_batch(loop, options, recompute=False, start=start)
    budgeted = largest_batch(loop, options, recompute=True, start=plain or start)
    what = lambda b: "none (batch 1 does not fit)" if b is None else str(b)   # noqa: E731
    print(f"largest batch of {Path(args.network).stem} whose steps fit {args.fit / 1e6:.2f} MB (MB = 10^6 bytes):")
    print(f"  without recomputation (the plan without a budget):        {what(plain)}")
    print(f"  with recomputation and smaller workspaces (--memory-budget): {what(budgeted)}")
    return 0


def _declared_batch(loop) -> int | None:
    from deepdsl.ir import toposort

    data = [n for n in toposort([loop.loss.node]) if n.op == "input" and n.attr("role") == "data" and n.shape]
    return data[0].shape[0] if data else None


@contextlib.contextmanager
def _data_errors():
    """A data set's problem (`deepdsl_runtime.data.DataError`) as the command's one-line error."""
    from deepdsl_runtime.data import DataError
    try:
        yield
    except DataError as err:
        raise DeepDSLError(str(err)) from None


def _image_spec(spec: str) -> None:
    from deepdsl_runtime import image_stream
    if not image_stream.is_image_spec(spec):
        raise DeepDSLError(f"'{spec}' is not a data set of image files (use folder:DIR or shards:PATTERN)")


def cmd_data_index(args: argparse.Namespace) -> int:
    from deepdsl_runtime import image_index

    _image_spec(args.spec)
    with _data_errors():
        train_source, val_source = image_index.splits(args.spec)
        train = image_index.load_index(train_source, args.spec, "train", progress=True, rebuild=True)
        indexes = [train]
        if val_source is not None:
            indexes.append(image_index.load_index(val_source, args.spec, "val", progress=True, rebuild=True,
                                                  classes=train.classes))
    for index in indexes:
        print(f"{index.split}: {len(index)} images in {len(index.classes)} classes, "
              f"{int(index.sizes.sum()) / 1e6:.1f} MB; manifest {index.meta()['cache']} "
              f"({index.nbytes / 1e6:.2f} MB, digest {index.digest[:12]})")
    if val_source is None:
        print("no validation split: programs test on the training images")
    return 0


def cmd_data_check(args: argparse.Namespace) -> int:
    from deepdsl_runtime import image_index

    _image_spec(args.spec)
    from deepdsl_runtime.cpu.native import threads_available
    workers = args.workers or threads_available()
    with _data_errors():
        bad, total = image_index.check(args.spec, args.channels, workers, progress=True)
    for split, i, name, reason in bad:
        print(f"{name} ({split} split, sample {i}): {reason}")
    print(f"{len(bad)} of {total} images cannot be read or decoded" if bad else f"all {total} images decode")
    return 1 if bad else 0


def cmd_data_pack(args: argparse.Namespace) -> int:
    from deepdsl_runtime import image_index

    _image_spec(args.spec)
    out = Path(args.output)
    kind, _, source = args.spec.partition(":")
    if kind == "folder" or os.path.isdir(source):
        roots = [Path(source)]
    else:
        roots = [Path(p).parent for p in image_index.expand(source)[:1]]
    for root in roots:
        if out.resolve() == root.resolve() or root.resolve() in out.resolve().parents:
            raise DeepDSLError(f"-o {out} lies inside the data set {root}; choose a directory outside it")
    if out.exists() and not out.is_dir():
        raise DeepDSLError(f"-o {out} is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise DeepDSLError(f"-o {out} already holds files; add --force to write into it, or choose another")
    if args.shard_bytes < 1:
        raise DeepDSLError("--shard-bytes must be > 0")
    with _data_errors(), _writing(out):
        patterns = image_index.pack(args.spec, str(out), args.shard_bytes, progress=True)
    for split, pattern in patterns.items():
        print(f"{split}: {pattern}")
    print(f"train from them with --data shards:'{patterns['train']}'")
    return 0


def _add_predict_arguments(parser) -> None:
    """The options of `deepdsl predict` after the network's (`deepdsl_runtime.predict` reads them)."""
    parser.add_argument("files", nargs="*", help="image files to classify")
    parser.add_argument("--params", required=True, metavar="P.npz",
                        help="trained parameters: a checkpoint (or the --keep-best one), or an .npz/.safetensors "
                             "of arrays by the network's or PyTorch's names")
    parser.add_argument("--data", metavar="SPEC",
                        help="the validation split of a data spec (digits, folder:DIR, ...), or all of npz:PATH")
    parser.add_argument("--top", type=int, metavar="K", help="the K most probable classes (default: 5)")
    parser.add_argument("--json", action="store_true", help="write the result as JSON")
    parser.add_argument("-o", "--out", metavar="PATH", help="write to this file (atomically) instead of printing")
    parser.add_argument("--prompt", metavar="TEXT", help="a language model: the text to continue")
    parser.add_argument("--tokens", type=int, default=100, metavar="N", help="bytes to add to --prompt")
    parser.add_argument("--temperature", type=float, default=1.0, metavar="T",
                        help="sampling temperature of --prompt (0: always the most probable byte)")
    parser.add_argument("--seed", type=int, default=0, help="seed of --prompt's sampling")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the predict step runs")
    parser.add_argument("--threads", type=int, metavar="N", help="threads of the compiled kernels")
    parser.add_argument("--kernels", choices=("auto", "compiled", "numpy"), default="auto",
                        help="CPU kernels: the program's compiled library (built where missing), or numpy's")


def cmd_predict(args: argparse.Namespace) -> int:
    """Compile the network (as `run` does: its program in .deepdsl/, its CPU kernels built), then run its predict
    step over what the options name (`deepdsl_runtime.predict`); what is not the result goes to standard error."""
    from types import SimpleNamespace

    from deepdsl.codegen import CodegenOptions
    from deepdsl.codegen.native import build_library, not_built
    from deepdsl_runtime.predict import predict
    from deepdsl_runtime.program import model_class

    compiled = _compile(args)
    if "predict" not in compiled.steps:
        raise DeepDSLError(f"{compiled.name} has no predict step: its accuracy is no D.precision (a classifier's "
                           "predict step gives its class probabilities); give D.Loop a prediction= (the network's "
                           "output)")
    out = Path(".deepdsl") / f"{_run_name(compiled, args.network)}.py"
    path = _write(compiled, args.network, out, CodegenOptions(params_file=str(out.with_name(f"{out.stem}.params.npz"))))
    if args.device == "cpu" and args.kernels != "numpy":
        built, why = build_library(path.with_suffix(".c"))
        if built is None:
            print(not_built(why), file=sys.stderr)
    program = _run_program_text(path.read_text(), path, "deepdsl_predict")
    return predict(model_class(SimpleNamespace(**program)), args)


def cmd_import(args: argparse.Namespace) -> int:
    """`deepdsl import MODEL.py:FACTORY --input ...`: the network file and its weights (`deepdsl.torch_import`);
    every unsupported op one line on standard error, nothing written then."""
    from deepdsl import torch_import as ti

    inputs = [ti.InputSpec.parse(text) for text in args.input]
    if args.labels is not None and args.labels < 1:
        raise DeepDSLError(f"--labels must be >= 1, got {args.labels}")
    name = args.name or (Path(args.output).stem if args.output else None)
    out = Path(args.output) if args.output else Path(f"{name or ti._default_name(args.model)}.py")
    weights = out.with_name(f"{out.stem}.weights.npz")
    for option, path in (("-o", out), ("its weights", weights)):
        if path.exists() and not args.force:
            raise DeepDSLError(f"{option} {path} exists; choose another -o, or add --force to replace it")
        if path.is_dir():
            raise DeepDSLError(f"{option} {path} is a directory")
    try:
        imported = ti.import_module(args.model, inputs, args.labels, name or out.stem)
    except ti.UnsupportedOps as err:
        print(f"deepdsl: error: {err}", file=sys.stderr)
        for line in err.lines:
            print(f"  {line}", file=sys.stderr)
        return 1
    import numpy as np

    from deepdsl_runtime.checkpoint import atomic_write

    text = imported.text.replace(f"{imported.name}.weights.npz", weights.name)
    with _writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(str(weights), lambda f: np.savez(f, **imported.weights))
        atomic_write(str(out), lambda f: f.write(text.encode()))
    print(f"wrote {out} ({len(imported.weights)} tensors, {imported.parameters:,} parameters) and {weights}")
    print(f"train it: deepdsl run {out} -- --init-from {weights} --data SPEC")
    return 0


def cmd_refresh(args: argparse.Namespace) -> int:
    from deepdsl.codegen.refresh import refresh

    return refresh(Path(args.networks), Path(args.out), check=args.check)


def build_parser() -> argparse.ArgumentParser:
    from deepdsl import __version__

    parser = argparse.ArgumentParser(prog="deepdsl", description="Ahead-of-time compiler for deep learning.")
    parser.add_argument("--version", action="version", version=f"deepdsl {__version__}")
    parser.add_argument("--debug", action="store_true", help="show Python tracebacks for errors")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("ir", help="print the optimized SSA programs of a network")
    _add_network_options(p)
    p.add_argument("--step", choices=STEP_NAMES + ("all",), default="all",
                   help="which step's program to print: train, test, setup (values computed once), all; with "
                        "--data-parallel also accumulate, apply, statistics")
    p.set_defaults(func=cmd_ir)

    p = sub.add_parser("graph", help="write a step's dependency graph as Graphviz DOT")
    _add_network_options(p)
    p.add_argument("-o", "--output", help="DOT file to write (default: standard output)")
    p.add_argument("--step", choices=STEP_NAMES, default="train", help="the step whose graph to write")
    p.set_defaults(func=cmd_graph)

    p = sub.add_parser("compile", help="write the standalone training program of a network")
    _add_network_options(p)
    p.add_argument("-o", "--output", help="program to write (default: generated/<network>.py)")
    p.add_argument("--cuda-binary", action="store_true",
                   help="also build the fat binary of the CUDA kernels with nvcc (otherwise `--device cuda` compiles "
                        "them when the program starts; `deepdsl run ... -- --device cuda` builds it)")
    p.set_defaults(func=cmd_compile)

    p = sub.add_parser("run", help="compile a network, then run its training program",
                       description="Compile NET.py, then run the generated program; options after `--` go to it.")
    _add_network_options(p)
    p.add_argument("-o", "--output", help="program to write (default: .deepdsl/<network>-b<batch>-<hash>.py); its "
                                          "checkpoint defaults to <program>.params.npz beside it")
    p.set_defaults(func=cmd_run, program_args=[])

    p = sub.add_parser("memory", help="print the static memory table of a step (peak, arena, workspace, what-ifs)")
    _add_network_options(p)
    p.add_argument("--step", choices=STEP_NAMES, default="train", help="the step whose memory table to print")
    p.add_argument("--json", action="store_true", help="write the table as JSON")
    p.add_argument("--plot", metavar="PNG", help="also draw live memory over the statements (needs matplotlib)")
    p.add_argument("--fit", type=_bytes, metavar="BYTES",
                   help="print the largest batch whose steps fit BYTES (e.g. 16GB), without and with recomputation")
    p.add_argument("--data", metavar="SPEC",
                   help="also the memory of the input pipeline of these images read from files (folder:DIR, "
                        "shards:PATTERN): batch slots, manifests, each worker's bound")
    p.add_argument("--workers", type=int, metavar="N", help="with --data: decoding workers (default: the cores)")
    p.add_argument("--prefetch", type=_positive, default=2, metavar="N", help="with --data: batches decoded ahead")
    p.add_argument("--accumulate", type=int, default=1, metavar="K",
                   help="with --data: the program's --accumulate (a slot holds K batches)")
    p.set_defaults(func=cmd_memory)

    p = sub.add_parser("data", help="image data sets read from files: index, check, pack into shards",
                       description="folder:DIR (DIR/train/<class>/*.jpg, DIR/val/...) or shards:PATTERN (tar shards "
                                   "of KEY.jpg + KEY.cls); see docs/data.md")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    q = actions.add_parser("index", help="build the manifests of both splits again and cache them")
    q.add_argument("spec", metavar="SPEC")
    q.set_defaults(func=cmd_data_index)
    q = actions.add_parser("check", help="decode every image of both splits; list those that cannot be")
    q.add_argument("spec", metavar="SPEC")
    q.add_argument("--workers", type=_positive, metavar="N", help="decoding processes (default: the cores)")
    q.add_argument("--channels", type=int, choices=(1, 3), default=3, help="decode to grey (1) or RGB (3)")
    q.set_defaults(func=cmd_data_check)
    q = actions.add_parser("pack", help="write both splits as tar shards (KEY.<ext> + KEY.cls) and classes.txt")
    q.add_argument("spec", metavar="SPEC")
    q.add_argument("-o", "--output", required=True, metavar="DIR", help="directory of the shards")
    q.add_argument("--shard-bytes", type=_bytes, default=10**9, metavar="BYTES",
                   help="close a shard before it passes this size (default 1GB)")
    q.add_argument("--force", action="store_true", help="write into a directory that already holds files")
    q.set_defaults(func=cmd_data_pack)

    p = sub.add_parser("predict", help="run a trained network's forward pass over images, a data spec or a prompt",
                       description="Class probabilities of a trained classifier (its predict step) over image "
                                   "files, the validation split of --data SPEC or an npz; a language model's "
                                   "continuation of --prompt.")
    _add_network_options(p)
    _add_predict_arguments(p)
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("import", help="a PyTorch nn.Module as a network file and its weights (torch.export)",
                       description="Export MODEL.py:FACTORY's module with torch.export and write it as a deepdsl "
                                   "network file (one line per layer, named after the module paths) and its "
                                   "weights under deepdsl's names.")
    p.add_argument("model", metavar="MODEL.py:FACTORY", help="a file and the class or function in it that makes "
                                                              "the module (called with no arguments)")
    p.add_argument("--input", action="append", required=True, metavar="NxCxHxW[:DTYPE]",
                   help="the shape of the module's input (the first size the batch), e.g. 8x3x224x224, or 2x16:int64 "
                        "for tokens")
    p.add_argument("--labels", type=int, metavar="K", help="classes (checked against the module's output)")
    p.add_argument("--name", help="the network's name (default: -o's stem, else the factory's)")
    p.add_argument("-o", "--output", metavar="NET.py", help="network file to write (default: NAME.py); the "
                                                            "weights go beside it as NET.weights.npz")
    p.add_argument("--force", action="store_true", help="replace existing files")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("plot", help="training curves of metric logs (--log run.jsonl): loss, validation accuracy, "
                                    "learning rate",
                       description="Draw the curves of one or more runs' metric logs on one figure.")
    from deepdsl import plot
    plot.add_arguments(p)
    p.set_defaults(func=lambda args: plot.main(args))

    p = sub.add_parser("refresh", help="regenerate the programs of a directory of networks (generated/ from networks/)")
    p.add_argument("--check", action="store_true", help="only list stale or missing programs (exit status 1 if any)")
    p.add_argument("--networks", default="networks", metavar="DIR", help="directory of network files")
    p.add_argument("--out", default="generated", metavar="DIR", help="directory of the generated programs")
    p.set_defaults(func=cmd_refresh)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    program_args: list[str] = []
    if "--" in argv:                     # `deepdsl run NET.py [options] -- program options`
        cut = argv.index("--")
        argv, program_args = argv[:cut], argv[cut + 1:]
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command == "predict":       # image files may come after the options
        files = [a for a in extra if not a.startswith("-")]
        args.files, extra = args.files + files, [a for a in extra if a.startswith("-")]
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if program_args and args.command != "run":
        parser.error("options after `--` are for `deepdsl run` only")
    args.program_args = program_args
    with _stopping_on_signals() as received:
        return _main(args, received)


@contextlib.contextmanager
def _stopping_on_signals():
    """SIGTERM and SIGHUP stop a command as Ctrl-C does (a KeyboardInterrupt where it is; `deepdsl run` relays them
    to its program while that runs); yields the list the signals received are appended to."""
    import signal
    import threading

    received: list[int] = []

    def interrupt(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt

    old = {}
    if threading.current_thread() is threading.main_thread():
        for name in ("SIGTERM", "SIGHUP"):
            if hasattr(signal, name):
                old[name] = signal.signal(getattr(signal, name), interrupt)
    try:
        yield received
    finally:
        for name, handler in old.items():
            signal.signal(getattr(signal, name), handler)


def _load_compiler() -> None:
    """Import the compiler (sympy and numpy: a second or more) with the stopping signals held: one arriving inside
    an extension module's import would surface as a broken import; held, it stops the command just after, as one
    line."""
    import signal

    held = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP} if hasattr(signal, "pthread_sigmask") else set()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, held) if held else None
    try:
        import deepdsl.loader  # noqa: F401
        import deepdsl.pipeline  # noqa: F401
    finally:
        if held:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _main(args: argparse.Namespace, received: list[int]) -> int:
    import signal

    try:
        _load_compiler()
        _check_sizes(args)
        return args.func(args)
    except DeepDSLError as err:
        if args.debug:
            raise
        print(f"deepdsl: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        if not received:
            print("deepdsl: interrupted", file=sys.stderr)
            return 128 + signal.SIGINT
        print(f"deepdsl: interrupted by {signal.Signals(received[0]).name}", file=sys.stderr)
        return 128 + received[0]
    except Exception as err:   # noqa: BLE001 -- an internal error: one line unless --debug
        if args.debug:
            raise
        print(f"deepdsl: internal error: {type(err).__name__}: {err} (rerun with --debug for the traceback)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
