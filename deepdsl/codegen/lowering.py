"""Per-op statement snippets: how one SSA statement becomes a call of the runtime backend `rt`.

The default rule covers most ops: `rt.<op>(<inputs>, out=<value>, <attributes>)`, the runtime function having
the op's name, its inputs in order and its attributes as keywords; ops with scratch memory also get
`workspace=`. Views (`Op.aliases`: no `out`) are the exception every op may make; the table below holds the others:
elementwise kernels and their sums, random masks, attention's dropout mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from deepdsl.ir import HIDDEN, Node
from deepdsl.ops import get_op


@dataclass(frozen=True)
class Site:
    """What a snippet knows about its statement: argument expressions, output name, workspace name or None,
    and for `ew` and `ew_sum` the name of the kernel function."""

    node: Node
    args: tuple[str, ...]
    out: str
    workspace: str | None = None
    kernel: str | None = None


def literal(value) -> str:
    """A Python literal for an attribute value (ints, floats, bools, tuples of those)."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, tuple):
        return "(" + ", ".join(literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, str):
        return repr(value)
    raise TypeError(f"attribute value {value!r} has no literal")


def _attrs(node: Node, skip: tuple[str, ...] = ()) -> str:
    return "".join(f", {k}={literal(v)}" for k, v in node.attrs if k not in skip and k not in HIDDEN)


def default(site: Site) -> str:
    args = "".join(f"{a}, " for a in site.args)
    ws = f", workspace={site.workspace}" if site.workspace else ""
    return f"rt.{site.node.op}({args}out={site.out}{_attrs(site.node)}{ws})"


def view(site: Site) -> str:
    """Views alias their input: the statement binds a name, there is no `out`."""
    return f"{site.out} = rt.{site.node.op}({', '.join(site.args)}{_attrs(site.node)})"


def elementwise(site: Site) -> str:
    return f"rt.ew({site.kernel}, {site.out}{''.join(', ' + a for a in site.args)})"


def elementwise_sum(site: Site) -> str:
    ws = f", workspace={site.workspace}" if site.workspace else ""
    return (f"rt.ew_sum({site.kernel}, {site.out}{''.join(', ' + a for a in site.args)}, "
            f"shape={literal(site.node.attr('shape'))}{ws})")


def elementwise_pair(first: Site, second: Site) -> str:
    """An `ew` statement and an `ew` (or `ew_sum`) statement reading its output in one pass
    (`passes.fuse_multi_output`): `rt.ew_pair` (or `rt.ew_and_sum`, with the sum's shape and workspace), each
    call as `rt.ew` takes it, kernel, output and arguments, one line each."""
    calls = [f"({site.kernel}, {site.out}{''.join(', ' + a for a in site.args)})" for site in (first, second)]
    if second.node.op == "ew":
        return f"rt.ew_pair({calls[0]},\n{' ' * len('rt.ew_pair(')}{calls[1]})"
    ws = f", workspace={second.workspace}" if second.workspace else ""
    indent = " " * len("rt.ew_and_sum(")
    return (f"rt.ew_and_sum({calls[0]},\n{indent}{calls[1]},\n{indent}"
            f"shape={literal(second.node.attr('shape'))}{ws})")


def elementwise_many(sites: list[Site]) -> str:
    """Statements of one elementwise kernel on operands of their own in one call (`passes.fuse_horizontal`):
    `rt.ew_many`, the kernel and then each statement's output and arguments, one line each."""
    indent = " " * len("rt.ew_many(")
    calls = [f"({site.out}{''.join(', ' + a for a in site.args)})" for site in sites]
    return f"rt.ew_many({sites[0].kernel},\n" + ",\n".join(indent + c for c in calls) + ")"


def bernoulli(site: Site) -> str:
    """Masks are drawn from (seed, step, key): the run's seed and the iteration number complete the attributes."""
    ws = f", workspace={site.workspace}" if site.workspace else ""
    return f"rt.bernoulli(out={site.out}{_attrs(site.node)}, seed=self.seed, step=step{ws})"


def attention(site: Site) -> str:
    """Attention and its gradient: a dropout mask (the last input, where the node keeps a fraction) by keyword."""
    if site.node.attr("keep") is None:
        return default(site)
    *args, mask = site.args
    ws = f", workspace={site.workspace}" if site.workspace else ""
    return f"rt.{site.node.op}({''.join(f'{a}, ' for a in args)}mask={mask}, out={site.out}{_attrs(site.node)}{ws})"


def max_pool_pair(site: Site, argmax: str) -> str:
    """A `max_pool` statement and the `max_pool_argmax` of the same windows in one call (see `steps`)."""
    ws = f", workspace={site.workspace}" if site.workspace else ""
    return f"rt.max_pool({site.args[0]}, out={site.out}, argmax={argmax}{_attrs(site.node)}{ws})"


def all_sum(site: Site) -> str:
    """A sum over the ranks of a data-parallel job: the model's ranks complete the call."""
    return f"rt.all_sum({site.args[0]}, out={site.out}, ranks=self.ranks)"


SNIPPETS: dict[str, Callable[[Site], str]] = {
    "all_sum": all_sum,
    "ew": elementwise,
    "ew_sum": elementwise_sum,
    "bernoulli": bernoulli,
    "attention": attention,
    "attention_grad": attention,
}

# ops that never reach a generated program: leaves are inputs or inline constants; `batch_norm` and `dropout`
# are rewritten by the `specialize` pass before any program exists
NOT_LOWERED = frozenset({"input", "param", "state", "batch_norm", "dropout"})


def lower(site: Site) -> str:
    """The statement's snippet: a view where its op says its output is one (`Op.aliases`: a reshape, a slice of a
    block), else the op's entry of SNIPPETS or the default."""
    if get_op(site.node.op).aliases(site.node):
        return view(site)
    return SNIPPETS.get(site.node.op, default)(site)
