"""From a Loop to the graphs of one training step and one test step.

Training step outputs: `loss`, then for every parameter its new value and its new optimizer state, then the new
running statistics of batch-norm layers. Its leaves are the batch (`x`, `y`), parameters, optimizer and running
state, and the hyperparameters fed each step (`lr`, `momentum`, `decay`; Adam: `lr`, `bias1`, `bias2`).

Split in two (`build_step_graphs(..., split=True)`), the same step serves gradient accumulation and data-parallel
training: the accumulate step adds the batch's gradient of every parameter p to its accumulator `G_p` (outputs
`loss`, the new accumulators, the batch statistics of batch-norm layers, `B_`), the statistics step updates the
running statistics from the batch statistics (networks with batch norm), and the apply step updates the parameters
from the accumulated gradients scaled by the hyperparameter `scale` (1 / the number of batches added), as the
training step does from one batch's gradient. With one batch and scale 1 they compute what the training step
computes up to float32 rounding (the scale is fused into the update's expression, and the accumulate step's batch
statistics divide by a count summed over the ranks where the training step multiplies by its inverse); a program
runs its training step where nothing is accumulated.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import sympy

from deepdsl.autodiff import gradients
from deepdsl.dsl import Loop, Train
from deepdsl.errors import DeepDSLError
from deepdsl import provenance
from deepdsl.ir import FLOAT, Graph, Node, make, toposort
from deepdsl.ops.elementwise import add, elementwise, sum_to, sym
from deepdsl.ops.leaf import Init
from deepdsl.passes.specialize import is_batch_statistics, specialize, specialize_split


def number(value: float) -> sympy.Expr:
    """An exact sympy number: integers stay integers so `1*x` simplifies away."""
    return sympy.Integer(int(value)) if float(value).is_integer() else sympy.Float(value)


OPTIMIZER = "optimizer"      # the role of optimizer state (`optimizer_state`)
GRADIENT = "gradient"        # the role of gradient accumulators (`accumulator`)


def hyper(name: str) -> Node:
    return make("input", (), name=name, shape=(), dtype=FLOAT, role="hyper")


def optimizer_state(prefix: str, param: Node) -> Node:
    """The optimizer's buffer `prefix` of `param` (SGD's velocity `V`, Adam's moments `M` and `S`), zero at the
    start. It is marked by its role (`role="optimizer"`, see `is_optimizer_state`), not by its name: a layer may be
    named like one. Leaf attributes are not printed, so the role leaves program text and structure hashes as they
    are."""
    return make("state", (), name=f"{prefix}_{param.name}", shape=param.shape, dtype=FLOAT,
                init=Init("constant", value=0.0), role=OPTIMIZER)


def accumulator(param: Node) -> Node:
    """The gradient accumulator `G_<param>` of the split step (role "gradient": neither trained nor checkpointed;
    the program keeps it at zero between iterations)."""
    return make("state", (), name=f"G_{param.name}", shape=param.shape, dtype=FLOAT,
                init=Init("constant", value=0.0), role=GRADIENT)


def is_accumulator(node: Node) -> bool:
    return node.op == "state" and node.attr("role") == GRADIENT


def is_optimizer_state(node: Node) -> bool:
    """Whether `node` is an optimizer buffer made by `optimizer_state` (other state: running statistics)."""
    return node.op == "state" and node.attr("role") == OPTIMIZER


@dataclass(frozen=True)
class StepGraphs:
    train: Graph
    test: Graph
    params: tuple[Node, ...]           # trained parameters, in order of first use
    states: tuple[Node, ...]           # running statistics and optimizer buffers
    accumulate: Graph | None = None    # the split step (`split=True`): add a batch's gradients to the accumulators
    apply: Graph | None = None         # and update the parameters from them
    accumulators: tuple[Node, ...] = ()
    statistics: Graph | None = None    # running statistics from the batch statistics (None without batch norm)
    batch_statistics: tuple[Node, ...] = ()     # the accumulate step's batch statistics B_, by name
    predict: Graph | None = None       # the forward pass alone (`predict_graph`); None where nothing says what it is


def scores(loop: Loop) -> Node | None:
    """The scores a classifier's accuracy reads: the first input of the `precision` the Loop's accuracy is (None
    for another accuracy: a network of float targets reports what it computes)."""
    node = loop.accuracy.node
    return node.inputs[0] if node.op == "precision" else None


def test_graph(loop: Loop) -> Graph:
    """The test step: accuracy and loss of a batch, and for a classifier each row's `label_rank` (the rank of its
    label among its scores: top-k accuracy over any number of rows, counted exactly)."""
    outputs = (("accuracy", loop.accuracy.node), ("loss", loop.loss.node))
    found = scores(loop)
    if found is not None:
        ranks = make("label_rank", (found, loop.accuracy.node.inputs[1]))
        provenance.record_rest(ranks, "label_rank", "each row's rank of its label among its scores: top-k accuracy",
                               "label_ranks")
        outputs += (("ranks", ranks),)
    return specialize(Graph(f"{loop.name}_test", outputs), "test")


def predict_graph(loop: Loop) -> Graph | None:
    """The forward pass of a trained network (no labels, no gradients, no update): a classifier's probabilities
    (the softmax of the scores its accuracy reads), or the Loop's `prediction`; None where it has neither."""
    if loop.prediction is not None:
        output = ("outputs", loop.prediction.node)
    else:
        found = scores(loop)
        if found is None:
            return None
        probabilities = make("softmax", (found,))
        provenance.record_rest(probabilities, "predict", "the class probabilities", "probabilities")
        output = ("probabilities", probabilities)
    return specialize(Graph(f"{loop.name}_predict", (output,)), "test")


def parameters(loss: Node) -> list[Node]:
    params = [n for n in toposort([loss]) if n.op == "param"]
    seen: dict[str, Node] = {}
    for p in params:
        other = seen.setdefault(p.name, p)
        if other is not p:
            raise DeepDSLError(f"two different parameters are named '{p.name}' ({other.shape} and {p.shape}, "
                               f"initializers {other.attr('init')} and {p.attr('init')}); give the layers distinct names")
    return params


def _distinct_names(tensors: list[Node]) -> None:
    """Parameters and state are stored by name (checkpoints, the program's tensors): a layer named like another's
    optimizer buffer (`V_fc` beside `fc`: `V_fc_W`) must not make two of one name."""
    seen: dict[str, Node] = {}
    for t in tensors:
        other = seen.setdefault(t.name, t)
        if other is not t:
            raise DeepDSLError(f"two tensors of the training step are named '{t.name}' (a {other.op} of shape "
                               f"{'x'.join(map(str, other.shape))} and a {t.op} of shape "
                               f"{'x'.join(map(str, t.shape))}): optimizer buffers are named V_, M_ or S_ and "
                               "the parameter's name (gradient accumulators G_); rename the layer")


def build_step_graphs(loop: Loop, forward: Callable[[Graph], Graph] | None = None, split: bool = False) -> StepGraphs:
    """The step graphs of `loop`; `forward` (e.g. simplification) rewrites the training forward graph before it is
    differentiated, so the gradients are derived from the rewritten forward computation; `split`: also the
    accumulate and apply steps (see the module's docstring)."""
    name = loop.name
    provenance.record_rest(loop.loss.node, "loss", "the loss the step minimizes", "total_loss")
    train = specialize(Graph(f"{name}_train", (("loss", loop.loss.node),)), "train")
    if forward is not None:
        train = forward(train)
    loss = train.outputs[0][1]
    params = parameters(loss)
    if not params:
        raise DeepDSLError("the loss depends on no parameter: nothing to train")
    grads = gradients(loss, params)
    update = _sgd if loop.solver.optimizer == "sgd" else _adam
    train_forward = train
    train = Graph(train.name, train.outputs[:1] + tuple(update(params, grads, loop.solver)) + train.outputs[1:])
    test = test_graph(loop)
    states = [n for n in toposort(node for _, node in train.outputs) if n.op == "state"]
    accumulate = apply = statistics = None
    batch = ()
    accumulators = tuple(accumulator(p) for p in params) if split else ()
    if split:
        # batch statistics over the batches of every rank (the identity in one process)
        synced, statistics = specialize_split(Graph(f"{name}_accumulate", (("loss", loop.loss.node),)),
                                              f"{name}_statistics")
        batch = tuple(sorted({n.name: n for n in toposort(v for _, v in statistics.outputs)
                              if is_batch_statistics(n)}.values(), key=lambda n: n.name))
        statistics = statistics if statistics.outputs else None
        if forward is not None:
            synced = forward(synced)
        # without batch norm the synced forward is the training step's (hash-consed: the same nodes), and so are
        # its gradients
        same = synced.outputs == train_forward.outputs
        synced_grads = grads if same else gradients(synced.outputs[0][1], params)
        sums = []
        for p, g in zip(params, accumulators):
            total = elementwise(sym(0) + sym(1), [g, synced_grads[p]])
            provenance.record_update(p, [(g.name, total)], synced_grads[p])
            sums.append((g.name, total))
        accumulate = Graph(f"{name}_accumulate", synced.outputs[:1] + tuple(sums) + synced.outputs[1:])
        scale = hyper("scale")
        scaled = {p: elementwise(sym(0) * sym(1), [g, scale]) for p, g in zip(params, accumulators)}
        for p in params:
            provenance.record_value(p, scaled[p], f"d_{p.name}")
        apply = Graph(f"{name}_apply", tuple(update(params, scaled, loop.solver)))
    _distinct_names([*params, *states, *accumulators, *batch])
    return StepGraphs(train, test, tuple(params), tuple(sorted(states, key=lambda s: s.name)), accumulate, apply,
                      accumulators, statistics, batch, predict_graph(loop))


def _clipped(params, grads, solver: Train) -> dict[Node, Node]:
    """Scale all gradients by min(1, clip / global L2 norm), as Caffe's clip_gradients and
    torch.nn.utils.clip_grad_norm_ do."""
    if not solver.clip:
        return grads
    squares = [sum_to(elementwise(sym(0) ** 2, [grads[p]]), ()) for p in params]
    norm = elementwise(sympy.sqrt(sym(0)), [add(*squares)])
    factor = elementwise(sympy.Min(1, solver.clip / (sym(0) + sympy.Float(1e-6))), [norm])
    clipped = {p: elementwise(sym(0) * sym(1), [grads[p], factor]) for p in params}
    for p in params:
        provenance.record_rest(clipped[p], "clip", "gradient clipping", f"d_{p.name}_clipped")
    return clipped


def _sgd(params, grads, solver: Train) -> list[tuple[str, Node]]:
    """PyTorch's SGD: g += decay * decay_mult * p;  v = momentum * v + g;  p -= lr * lr_mult * v (Nesterov:
    p -= lr * lr_mult * (g + momentum * v))."""
    grads = _clipped(params, grads, solver)
    lr, momentum, decay = hyper("lr"), hyper("momentum"), hyper("decay")
    out = []
    for p in params:
        v = optimizer_state("V", p)
        velocity, update = _sgd_exprs(p.attr("decay_mult"), p.attr("lr_mult"), solver.nesterov)
        new_v = elementwise(velocity, [v, momentum, grads[p], decay, p])
        extra = [momentum, grads[p], decay] if solver.nesterov else []
        new_p = elementwise(update, [p, lr, new_v, *extra])
        made = [(p.name, new_p), (v.name, new_v)]
        provenance.record_update(p, made, grads[p])
        out += made
    return out


@functools.lru_cache(maxsize=256)
def _sgd_exprs(decay_mult: float, lr_mult: float, nesterov: bool = False) -> tuple[sympy.Expr, sympy.Expr]:
    """The velocity and parameter updates for one pair of multipliers (built once: sympy is slow to build them)."""
    dm, lm = number(decay_mult), number(lr_mult)
    # v0: velocity, v1: momentum, v2: gradient, v3: decay, v4: parameter
    velocity = sym(1) * sym(0) + sym(2) + dm * sym(3) * sym(4)
    if nesterov:
        # v0: parameter, v1: learning rate, v2: new velocity, v3: momentum, v4: gradient, v5: decay
        return velocity, sym(0) - lm * sym(1) * (sym(4) + dm * sym(5) * sym(0) + sym(3) * sym(2))
    # v0: parameter, v1: learning rate, v2: new velocity
    return velocity, sym(0) - lm * sym(1) * sym(2)


def _adam(params, grads, solver: Train) -> list[tuple[str, Node]]:
    """PyTorch's Adam with L2 decay: g += decay*p; m = b1 m + (1-b1) g; s = b2 s + (1-b2) g^2;
    p -= lr * lr_mult / bias1 * m / (sqrt(s) / sqrt(bias2) + eps), bias_i = 1 - b_i^t fed each step. AdamW
    (PyTorch's): no decay in g; p *= 1 - lr * lr_mult * decay * decay_mult first."""
    grads = _clipped(params, grads, solver)
    lr, bias1, bias2, decay = hyper("lr"), hyper("bias1"), hyper("bias2"), hyper("decay")
    decoupled = solver.optimizer == "adamw"
    out = []
    for p in params:
        m, s = optimizer_state("M", p), optimizer_state("S", p)
        f = _adam_exprs(p.attr("decay_mult"), p.attr("lr_mult"), tuple(solver.betas), solver.eps, decoupled)
        g = grads[p] if decoupled else elementwise(f[0], [grads[p], decay, p])
        new_m = elementwise(f[1], [m, g])
        new_s = elementwise(f[2], [s, g])
        new_p = elementwise(f[3], [p, lr, bias1, new_m, new_s, bias2] + ([decay] if decoupled else []))
        made = [(p.name, new_p), (m.name, new_m), (s.name, new_s)]
        provenance.record_update(p, made, grads[p])
        out += made
    return out


@functools.lru_cache(maxsize=256)
def _adam_exprs(decay_mult: float, lr_mult: float, betas: tuple[float, float], eps: float,
                decoupled: bool = False) -> tuple[sympy.Expr, ...]:
    """Adam's gradient with decay, first and second moments and parameter update (built once per multipliers);
    `decoupled` (AdamW): the update shrinks the parameter by lr * decay (v6) instead."""
    b1, b2 = sympy.Float(betas[0]), sympy.Float(betas[1])
    dm, lm = number(decay_mult), number(lr_mult)
    # parameter, lr, bias1, new m, new s, bias2 (, decay)
    step = lm * sym(1) / sym(2) * sym(3) / (sympy.sqrt(sym(4)) / sympy.sqrt(sym(5)) + sympy.Float(eps))
    start = sym(0) * (1 - lm * sym(1) * dm * sym(6)) if decoupled else sym(0)
    return (sym(0) + dm * sym(1) * sym(2),                  # gradient, decay, parameter
            b1 * sym(0) + (1 - b1) * sym(1),                # m, gradient
            b2 * sym(0) + (1 - b2) * sym(1) ** 2,           # s, gradient
            start - step)
