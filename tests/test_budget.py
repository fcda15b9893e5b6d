"""A memory budget: `--memory-budget` either gives a program whose planned total fits, measured exactly as planned and
training bit for bit as the program without a budget, or one line stating the least reachable, which then fits.

For networks at the test size and budgets between each one's total without a budget and its least reachable, the
generated program runs two training steps and a test step in every memory mode: its measured peak is the planned
one, its total within the budget, its results those of the program compiled without a budget (at the workspace
limit the budget chose). Monotone: a smaller budget never gives a larger plan or less recomputation. Infeasible
budgets give the one-line error (library and command line), whose stated minimum is then itself feasible, also on
random networks. The FLOPs the cost model counts agree with PyTorch's flop counter.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import deepdsl
from deepdsl.budget import BudgetError, Fit, flops, recomputed
from deepdsl.dsl import Overrides
from deepdsl.ir import make
from deepdsl.pipeline import compile_without_search
from tests.support.memory_programs import small_networks
from tests.support.program_helpers import NETWORKS, compile_program, import_program, model_class, run_cli
from tests.test_memory_modes import NETWORKS as NETWORKS_AT_TEST_SIZE, batches, planned_peak, run_steps

from deepdsl_runtime.memory import MODES

# network, image, batch: LeNet (no recomputation lowers its forward peak: its budgets are met by the workspace),
# ResNet-mini (batch norm: convolutions and batch statistics recomputed), Inception-mini (concatenations and
# dropout masks recomputed)
CASES = [("lenet", None, 8), ("resnet_mini", None, 4), ("inception_mini", None, 4)]
FRACTIONS = (0.0, 0.5)    # budgets: least + fraction x (total without a budget - least)


def load(name, batch, image=None):
    return deepdsl.load(str(NETWORKS / f"{name}.py"), Overrides(batch=batch, image=image))


def least_total(loop) -> int:
    with pytest.raises(BudgetError) as caught:
        compile_without_search(loop, deepdsl.CompileOptions(memory_budget=1))
    assert caught.value.step == "train"
    return caught.value.least.total_bytes


def budgets(loop, fractions=FRACTIONS) -> list[int]:
    """The budgets `fractions` of the way from the least reachable total to the total without a budget (which is
    compiled only where a fraction is not 0)."""
    least = least_total(loop)
    if not any(fractions):
        return [least] * len(fractions)
    unbudgeted = deepdsl.compile(loop).steps["train"].plan.total_bytes
    assert least <= unbudgeted
    return [int(least + f * (unbudgeted - least)) for f in fractions]


def build(network, directory, batch=None, image=None, options=None):
    """`compile_program` with the program's compiled CPU kernels built: the bitwise comparisons run those and numpy's
    (the kernels of the program without a compiler)."""
    from deepdsl.codegen.native import build_library

    compiled, path = compile_program(network, directory, batch, image, options)
    library, why = build_library(path.with_suffix(".c"))
    assert library is not None, why
    return compiled, path


KERNELS = ("compiled", "numpy")


def outputs(model_cls, data, mode="static", kernels="compiled"):
    """`test_memory_modes.run_steps` with the compiled kernels (or numpy's), and the tensors after them."""
    model, results = run_steps(model_cls, mode, data, kernels=kernels)
    assert model.kernels.startswith(kernels)
    return model, results, model.host_tensors()


def assert_same_training(got, want, context):
    """Two runs' (model, results, tensors): the same losses, accuracy and tensors, bit for bit."""
    (_, got_results, got_tensors), (_, want_results, want_tensors) = got, want
    assert got_results == want_results, context
    assert got_tensors.keys() == want_tensors.keys(), context
    for key, value in want_tensors.items():
        assert np.array_equal(got_tensors[key], value), (context, key)


def check_budgets(name, image, batch, tmp_path, fractions=FRACTIONS) -> int:
    """Budgets of a network (by default its least reachable and halfway to its total without a budget): every step
    within the budget, measured as planned in every memory mode, training bit for bit as the program without a
    budget at the workspace limit chosen, with the compiled kernels (every mode) and numpy's. Returns the
    recomputations."""
    loop = load(name, batch, image)
    sizes = budgets(loop, fractions)
    recomputing = 0
    plain_runs: dict[int, dict] = {}      # workspace limit -> the plain program's runs by kernels
    for k, budget in enumerate(sizes):
        compiled, path = build(name, tmp_path / f"b{k}", batch, image,
                                         deepdsl.CompileOptions(memory_budget=budget))
        fit = compiled.steps["train"].fit
        assert isinstance(fit, Fit) and fit.budget == budget
        for step in ("setup", "train", "test"):
            assert compiled.steps[step].plan.total_bytes <= budget, step
        recomputing += fit.recomputations
        model_cls = model_class(import_program(path))
        data = batches(model_cls, 2)
        train, test = compiled.steps["train"].plan, compiled.steps["test"].plan
        runs = {}
        for mode in MODES:
            run = runs[mode, "compiled"] = outputs(model_cls, data, mode)
            usage = run[0].mem.usage
            assert usage["train_step"].peak_bytes == planned_peak(train, mode), (budget, mode)
            assert usage["test_step"].peak_bytes == planned_peak(test, mode), (budget, mode)
            assert usage["train_step"].workspace_bytes == train.workspace_bytes, (budget, mode)
        runs["static", "numpy"] = outputs(model_cls, data, kernels="numpy")
        # the same training as the program without a budget, compiled at the workspace limit the budget chose (the
        # same program for budgets that chose the same limit: compiled, built and run once)
        if fit.workspace_limit not in plain_runs:
            _, plain = build(name, tmp_path / f"plain{k}", batch, image,
                             deepdsl.CompileOptions(workspace_limit=fit.workspace_limit))
            plain_cls = model_class(import_program(plain))
            plain_runs[fit.workspace_limit] = {kernels: outputs(plain_cls, data, kernels=kernels)
                                               for kernels in KERNELS}
        expected = plain_runs[fit.workspace_limit]
        for (mode, kernels), run in runs.items():
            assert_same_training(run, expected[kernels], (budget, mode, kernels))
    return recomputing


@pytest.mark.parametrize("name,image,batch", CASES, ids=[c[0] for c in CASES])
def test_budgets_fit_run_as_planned_and_train_bit_for_bit(name, image, batch, tmp_path):
    recomputing = check_budgets(name, image, batch, tmp_path)
    if name != "lenet":
        assert recomputing > 0, "no budget needed a recomputation: the test would not test it"


DROPOUT_NETWORK = """
from deepdsl import dsl as D

x = D.images("x", (4, 1, 16, 16), dataset="digits")
y = D.labels("y", 4, classes=10)
network = (D.full("fc", 10) @ D.flatten @ D.max_pool(2) @ D.dropout(0.3) @ D.relu
           @ D.conv("c2", kernel=3, channels=8, padding=1) @ D.dropout(0.5) @ D.relu
           @ D.conv("c1", kernel=3, channels=8, padding=1))
loss = (D.log_loss(y) @ D.softmax @ network)(x)
accuracy = (D.precision(y) @ network)(x)
loop = D.Loop(loss, accuracy, D.Train("dropnet", iters=10, lr=0.01, momentum=0.9))
"""


# the other networks; OverFeat and VGG16 reach their least budgets as AlexNet does, by the workspace alone (no
# recomputation: chains of convolutions, pooling and fully connected layers), and take longest to run: AlexNet
# stands for the three
LIKE_ALEXNET = {"overfeat", "vgg16"}
OTHERS = [(name, image) for name, image in NETWORKS_AT_TEST_SIZE
          if name not in {c[0] for c in CASES} | LIKE_ALEXNET]


@pytest.mark.parametrize("name,image", OTHERS, ids=[n for n, _ in OTHERS])
def test_every_network_fits_its_budgets(name, image, tmp_path):
    """Every other network at the test size, at its least reachable budget (`check_budgets`; the networks above
    check the budget halfway as well); AlexNet's way there, without recomputing, is OverFeat's and VGG16's too."""
    recomputing = check_budgets(name, image, 2, tmp_path, fractions=FRACTIONS[:1])
    if name == "alexnet":
        assert recomputing == 0
        for other in LIKE_ALEXNET:
            loop = load(other, 2, dict(NETWORKS_AT_TEST_SIZE)[other])
            fit = deepdsl.compile(loop, deepdsl.CompileOptions(memory_budget=least_total(loop))).steps["train"].fit
            assert fit.recomputations == 0, other


def test_a_recomputed_dropout_mask_is_the_same_mask(tmp_path):
    """At its least budget a network with dropout between convolutions draws its masks again before their late
    uses, from the counter-based stream (seed, step, mask): the same masks, so it trains bit for bit as without a
    budget."""
    network = tmp_path / "dropnet.py"
    network.write_text(DROPOUT_NETWORK)
    least = least_total(deepdsl.load(str(network)))
    compiled, path = build(network, tmp_path / "budget", options=deepdsl.CompileOptions(memory_budget=least))
    assert any(i.node.op == "bernoulli" for _, i in recomputed(compiled.train)), "no mask is recomputed"
    fit = compiled.steps["train"].fit
    _, plain = build(network, tmp_path / "plain",
                               options=deepdsl.CompileOptions(workspace_limit=fit.workspace_limit))
    got_cls, want_cls = model_class(import_program(path)), model_class(import_program(plain))
    data = batches(got_cls, 2)
    expected = {kernels: outputs(want_cls, data, kernels=kernels) for kernels in KERNELS}
    for mode in MODES:
        got = outputs(got_cls, data, mode)
        assert got[0].mem.usage["train_step"].peak_bytes == planned_peak(compiled.steps["train"].plan, mode)
        assert_same_training(got, expected["compiled"], mode)
    assert_same_training(outputs(got_cls, data, kernels="numpy"), expected["numpy"], "numpy")


def test_the_budget_is_monotone():
    loop = load("resnet_mini", 8)
    unbudgeted = deepdsl.compile(loop).steps["train"].plan.total_bytes
    least = least_total(loop)
    previous = None
    for budget in np.linspace(unbudgeted * 1.05, least, 9).astype(int).tolist():
        step = deepdsl.compile(loop, deepdsl.CompileOptions(memory_budget=budget)).steps["train"]
        total, extra = step.plan.total_bytes, flops(step.program)[0]
        assert total <= budget
        if previous is not None:      # a smaller budget: never a larger plan, never less recomputation
            assert total <= previous[0] and extra >= previous[1], (budget, total, extra, previous)
            assert step.fit.recomputations >= previous[2]
        previous = (total, extra, step.fit.recomputations)
    assert previous[1] > 0


def test_a_budget_above_the_total_changes_nothing():
    loop = load("resnet_mini", 4)
    plain = deepdsl.compile(loop)
    budgeted = deepdsl.compile(loop, deepdsl.CompileOptions(memory_budget=plain.steps["train"].plan.total_bytes))
    for step in ("setup", "train", "test"):
        assert budgeted.steps[step].program.text() == plain.steps[step].program.text()
        assert budgeted.steps[step].plan.total_bytes == plain.steps[step].plan.total_bytes
        assert budgeted.steps[step].fit.recomputations == 0


def test_an_infeasible_budget_is_one_line_and_its_minimum_fits():
    loop = load("resnet_mini", 8)
    least = least_total(loop)
    with pytest.raises(BudgetError) as caught:
        deepdsl.compile(loop, deepdsl.CompileOptions(memory_budget=least - 1))
    text = str(caught.value)
    assert "\n" not in text
    assert text.startswith(f"cannot fit resnet_mini (batch 8) in {(least - 1) / 1e6:.2f} MB: the least reachable "
                           f"is {least / 1e6:.2f} MB (persistent ")
    assert "binding statement " in text and "% FLOPs" in text
    largest = caught.value.largest_batch
    assert largest is not None and 1 <= largest < 8
    assert text.endswith(f"the largest batch that fits {(least - 1) / 1e6:.2f} MB is {largest}")
    # the stated minimum fits, and so does the largest batch stated, but not the next one
    assert deepdsl.compile(loop, deepdsl.CompileOptions(memory_budget=least)).steps["train"].plan.total_bytes <= least
    deepdsl.compile(load("resnet_mini", largest), deepdsl.CompileOptions(memory_budget=least - 1))
    with pytest.raises(BudgetError):
        compile_without_search(load("resnet_mini", largest + 1), deepdsl.CompileOptions(memory_budget=least - 1))


def test_the_stated_minimum_fits_a_test_step_that_needs_more_than_the_training_step():
    """A tiny network (found by the random networks below) whose test step needs more memory than its training
    step's minimum: the error names the test step, and its minimum fits every step."""
    from deepdsl import dsl as D

    x = D.images("x", (1, 1, 5, 5))
    y = D.labels("y", 1, classes=3)
    net = D.full("fc", 3) @ D.flatten @ D.max_pool(2, 1, 0, False) @ D.relu
    loop = D.Loop((D.log_loss(y) @ D.softmax @ net)(x), (D.precision(y) @ net)(x), D.Train("tiny"))
    with pytest.raises(BudgetError) as caught:
        compile_without_search(loop, deepdsl.CompileOptions(memory_budget=0))
    least = caught.value.least.total_bytes
    assert caught.value.step == "test" and "(test step)" in str(caught.value)
    compiled = compile_without_search(loop, deepdsl.CompileOptions(memory_budget=least))
    assert compiled.steps["train"].plan.total_bytes < least
    for step in compiled.steps.values():
        assert step.plan.total_bytes <= least
        step.plan.check()
    with pytest.raises(BudgetError):
        compile_without_search(loop, deepdsl.CompileOptions(memory_budget=least - 1))


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_networks(), st.floats(0.0, 1.0))
def test_random_networks_fit_or_state_a_minimum_that_fits(loop, fraction):
    unbudgeted = deepdsl.compile(loop).steps["train"].plan.total_bytes
    budget = int(fraction * unbudgeted)
    try:
        compiled = compile_without_search(loop, deepdsl.CompileOptions(memory_budget=budget))
    except BudgetError as err:
        least = err.least.total_bytes
        assert least > budget
        compiled = compile_without_search(loop, deepdsl.CompileOptions(memory_budget=least))
        budget = least
    for step in compiled.steps.values():
        assert step.plan.total_bytes <= budget
        step.plan.check()


def test_the_command_line_budget_table_error_and_fit(tmp_path, capsys):
    from deepdsl.cli import main

    network = str(NETWORKS / "resnet_mini.py")
    loop = load("resnet_mini", 8)
    least = least_total(loop)
    budget = int(least * 1.02)
    assert main(["memory", network, "--batch", "8", "--memory-budget", str(budget)]) == 0
    table = capsys.readouterr().out
    assert f"memory budget:            {budget / 1e6:>14.6f} MB  (total fits;" in table
    assert "recomputed values (" in table and "MFLOP" in table
    extra, own = flops(deepdsl.compile(loop, deepdsl.CompileOptions(memory_budget=budget)).train)
    assert f"GFLOP = +{100 * extra / own:.2f} % of the step's" in table
    assert main(["memory", network, "--batch", "8", "--memory-budget", f"{(least - 1) / 1e6}MB"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("deepdsl: error: cannot fit resnet_mini (batch 8) in ") and "\n" not in err
    # --fit: the largest batch that fits, without and with recomputation
    assert main(["memory", network, "--fit", str(budget)]) == 0
    out = capsys.readouterr().out
    plain = int(out.split("without recomputation (the plan without a budget):")[1].split()[0])
    fitted = int(out.split("(--memory-budget):")[1].split()[0])
    assert 8 <= fitted and plain <= fitted
    for batch, fits in ((plain, True), (plain + 1, False)):
        total = deepdsl.compile(load("resnet_mini", batch)).steps["train"].plan.total_bytes
        assert (total <= budget) == fits
    with pytest.raises(BudgetError):
        compile_without_search(load("resnet_mini", fitted + 1), deepdsl.CompileOptions(memory_budget=budget))
    # compile and run: the program trains within the budget and says so in its report
    out_path = tmp_path / "resnet_mini.py"
    assert main(["compile", network, "--batch", "8", "--memory-budget", str(budget), "-o", str(out_path)]) == 0
    capsys.readouterr()
    done = run_cli(out_path, "--iters", "2", "--fresh", "--params", str(tmp_path / "p.npz"))
    assert done.returncode == 0, done.stderr
    assert "measured" in done.stdout + done.stderr


def _torch_flops(fn, *tensors) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn(*tensors)
    return counter.get_total_flops()


def test_flops_agree_with_pytorchs_flop_counter():
    from deepdsl.ops import get_op

    x = make("input", (), name="x", role="data", shape=(3, 4, 11, 9))
    w = make("param", (), name="w", shape=(6, 2, 3, 3))
    conv = make("conv2d", (x, w), stride=2, pad=1, groups=2)
    xt, wt = torch.zeros(3, 4, 11, 9), torch.zeros(6, 2, 3, 3)
    assert get_op("conv2d").flops(conv) == _torch_flops(
        lambda a, b: torch.nn.functional.conv2d(a, b, stride=2, padding=1, groups=2), xt, wt)
    # the gradients (without groups: PyTorch's counter leaves the groups out of its input-gradient formula)
    w = make("param", (), name="w1", shape=(6, 4, 3, 3))
    g = make("input", (), name="g", role="data", shape=make("conv2d", (x, w), stride=2, pad=1).shape)
    dx = make("conv2d_bwd_data", (g, w), stride=2, pad=1, size=(11, 9))
    dw = make("conv2d_bwd_filter", (g, x), stride=2, pad=1, kernel=(3, 3))
    xg, wg = xt.clone().requires_grad_(), torch.zeros(6, 4, 3, 3, requires_grad=True)
    out = torch.nn.functional.conv2d(xg, wg, stride=2, padding=1)
    backward = _torch_flops(lambda o: o.backward(torch.ones_like(o)), out)
    assert get_op("conv2d_bwd_data").flops(dx) + get_op("conv2d_bwd_filter").flops(dw) == backward
    a = make("input", (), name="a", role="data", shape=(2, 5, 7))
    b = make("param", (), name="b", shape=(2, 3, 7))
    product = make("matmul", (a, b), tb=True)
    assert get_op("matmul").flops(product) == _torch_flops(lambda p, q: p @ q.transpose(1, 2),
                                                           torch.zeros(2, 5, 7), torch.zeros(2, 3, 7))


def test_the_milp_oracle_fits_and_costs_no_more_than_its_model_allows():
    """The MILP over single-gap drop options (the benchmark's oracle): its program plans within the budget, passes
    the verifier, and recomputes only what it chose; at a budget the program already fits it chooses nothing."""
    pytest.importorskip("scipy")
    from deepdsl.passes.recompute_milp import solve
    from deepdsl.pipeline import CompileOptions, STAGES, run_stages, stage_index
    from deepdsl.verify import verify

    loop = load("resnet_mini", 8)
    compiled = deepdsl.compile(loop)
    before = run_stages({"train": compiled.steps["train"].unplanned},
                        STAGES[stage_index("schedule"):stage_index("inplace")], CompileOptions())["train"]

    def total(program):
        return run_stages({"train": program}, STAGES[stage_index("inplace"):], CompileOptions(workspace_limit=0)
                          )["train"].total_bytes

    unbudgeted, least = total(before), least_total(loop)
    assert solve(before, unbudgeted, total).chosen == 0
    budget = int(least + 0.3 * (unbudgeted - least))
    solution = solve(before, budget, total, time_limit=60)
    assert solution is not None and solution.chosen > 0
    assert total(solution.program) <= budget
    verify(solution.program)
    assert flops(solution.program)[0] - flops(before)[0] == solution.flops


def test_the_exact_solver_fits_costs_no_more_than_the_greedy_and_trains_the_same(tmp_path):
    pytest.importorskip("scipy")
    loop = load("resnet_mini", 4)
    sizes = budgets(loop)
    for budget in sizes[:1]:
        greedy = deepdsl.compile(loop, deepdsl.CompileOptions(memory_budget=budget))
        compiled, path = build("resnet_mini", tmp_path / str(budget), 4,
                                         options=deepdsl.CompileOptions(memory_budget=budget, memory_solver="exact"))
        step = compiled.steps["train"]
        assert step.plan.total_bytes <= budget and step.fit.solver in ("greedy", "exact", "exact, time limit")
        assert flops(step.program)[0] <= flops(greedy.train)[0]
        _, plain = build("resnet_mini", tmp_path / f"plain{budget}", 4,
                                   options=deepdsl.CompileOptions(workspace_limit=step.fit.workspace_limit))
        got_cls, want_cls = model_class(import_program(path)), model_class(import_program(plain))
        data = batches(got_cls, 2)
        got = outputs(got_cls, data)
        assert got[0].mem.usage["train_step"].peak_bytes == step.plan.peak_live_bytes
        assert_same_training(got, outputs(want_cls, data), budget)
    with pytest.raises(ValueError, match="memory_solver"):
        deepdsl.compile(loop, deepdsl.CompileOptions(memory_budget=sizes[0], memory_solver="optimal"))


def test_a_budget_no_batch_fits_says_so():
    loop = load("lenet", 4)
    with pytest.raises(BudgetError) as caught:
        deepdsl.compile(loop, deepdsl.CompileOptions(memory_budget=1_000_000))   # the parameters alone need more
    assert caught.value.largest_batch == 0
    assert str(caught.value).endswith("; not even batch 1 fits 1.00 MB")
