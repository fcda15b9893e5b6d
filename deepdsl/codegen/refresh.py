"""Regenerate the checked-in programs: every network file of `networks/` becomes `generated/<same name>.py` and its
CUDA kernels `generated/<same name>.cu`.

    python -m deepdsl.codegen.refresh            # rewrite generated/ from networks/
    python -m deepdsl.codegen.refresh --check    # only report stale or missing programs (exit status 1 if any)

Networks compile at the sizes they declare, with the default compiler and code generation options; the header of
each program names its network as `networks/<file>`, so the output does not depend on where the repository lives.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def expected_programs(networks: Path = ROOT / "networks") -> dict[str, str]:
    """File name in generated/ -> the text the current compiler writes for it (programs and their kernels)."""
    import deepdsl
    from deepdsl.codegen import CodegenOptions, generate
    from deepdsl.codegen.cuda import generate_cuda

    result = {}
    for path in sorted(Path(networks).glob("*.py")):
        if path.name.startswith("_"):
            continue
        compiled = deepdsl.compile(deepdsl.load(str(path)))
        options = CodegenOptions(source=f"networks/{path.name}")
        result[path.name] = generate(compiled, options)
        result[f"{path.stem}.cu"] = generate_cuda(compiled, options, program=path.name)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepdsl.codegen.refresh", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="report stale programs instead of rewriting them")
    parser.add_argument("--networks", type=Path, default=ROOT / "networks", help="directory of network files")
    parser.add_argument("--out", type=Path, default=ROOT / "generated", help="directory of generated programs")
    args = parser.parse_args(argv)
    from deepdsl.errors import DeepDSLError

    try:
        programs = expected_programs(args.networks)
    except DeepDSLError as err:
        print(f"refresh: error: {err}", file=sys.stderr)
        return 1
    stale = [name for name, text in programs.items()
             if not (args.out / name).exists() or (args.out / name).read_text() != text]
    if args.check:
        for name in stale:
            print(f"stale: {args.out / name}")
        return 1 if stale else 0
    args.out.mkdir(parents=True, exist_ok=True)
    for name in stale:
        (args.out / name).write_text(programs[name])
        print(f"wrote {args.out / name}")
    print(f"{len(programs)} files, {len(stale)} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
