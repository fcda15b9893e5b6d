"""Regenerate checked-in programs (`deepdsl refresh`): every network file of a directory (default `networks/`)
becomes `<out>/<same name>.py`, its CUDA kernels `<out>/<same name>.cu` and its compiled CPU kernels' source
`<out>/<same name>.c` (default `generated/`).

    deepdsl refresh            # rewrite generated/ from networks/, both in the current directory
    deepdsl refresh --check    # only report stale or missing programs (exit status 1 if any)

Networks compile at the sizes they declare, with the default compiler and code generation options; the header of
each program names its network as `<directory name>/<file>` (`networks/lenet.py`), so the output does not depend on
where the directories live.
"""
from __future__ import annotations

import sys
from pathlib import Path

from deepdsl.errors import DeepDSLError


def expected_programs(networks: Path) -> dict[str, str]:
    """File name in the output directory -> the text the current compiler writes for it (programs and kernels)."""
    import deepdsl
    from deepdsl.codegen import CodegenOptions, render_program
    from deepdsl.codegen.cuda import render_cuda
    from deepdsl.codegen.description import describe
    from deepdsl.codegen.native import render_c

    networks = Path(networks)
    if not networks.is_dir():
        raise DeepDSLError(f"{networks}: no such directory of network files")
    result = {}
    for path in sorted(networks.glob("*.py")):
        if path.name.startswith("_"):
            continue
        compiled = deepdsl.compile(deepdsl.load(str(path)))
        options = CodegenOptions(source=f"{networks.resolve().name}/{path.name}")
        description = describe(compiled, options)
        result[path.name] = render_program(description)
        result[f"{path.stem}.cu"] = render_cuda(description, program=path.name)
        result[f"{path.stem}.c"] = render_c(description, program=path.name)
    return result


def stale_programs(networks: Path, out: Path) -> tuple[dict[str, str], list[str]]:
    """(every expected file by name, the names whose file in `out` is missing or differs)."""
    programs = expected_programs(networks)
    stale = [name for name, text in programs.items()
             if not (out / name).exists() or (out / name).read_text() != text]
    return programs, stale


def refresh(networks: Path, out: Path, check: bool = False) -> int:
    """Rewrite the stale programs of `out` (with `check`, only list them); returns the exit status."""
    from deepdsl.codegen import write_text_atomically

    programs, stale = stale_programs(Path(networks), Path(out))
    if check:
        for name in stale:
            print(f"stale: {Path(out) / name}")
        return 1 if stale else 0
    Path(out).mkdir(parents=True, exist_ok=True)
    for name in stale:
        write_text_atomically(Path(out) / name, programs[name])
        print(f"wrote {Path(out) / name}")
    print(f"{len(programs)} files, {len(stale)} rewritten")
    return 0


if __name__ == "__main__":          # the same as `deepdsl refresh`
    from deepdsl.cli import main

    sys.exit(main(["refresh", *sys.argv[1:]]))
