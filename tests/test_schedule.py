"""Learning-rate schedules (deepdsl_runtime.schedule) against PyTorch's schedulers over 20 steps, their options in
the DSL and the generated program (bad specs are one line, before anything runs), and a resumed run continuing a
schedule exactly."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from deepdsl import dsl as D
from deepdsl.errors import DeepDSLError
from deepdsl_runtime.schedule import Schedule, ScheduleError
from tests.support.program_helpers import compile_program, run_cli

STEPS = 20


def torch_rates(make_scheduler, base: float = 0.1) -> list[float]:
    """The learning rate PyTorch's optimizer uses at each of STEPS steps, the scheduler stepped after each."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base, momentum=0.9)
    scheduler = make_scheduler(optimizer)
    rates = []
    for _ in range(STEPS):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


S = torch.optim.lr_scheduler
CASES = [
    ("constant", 0, lambda o: S.ConstantLR(o, factor=1.0)),
    ("step:5:0.5", 0, lambda o: S.StepLR(o, step_size=5, gamma=0.5)),
    ("step:3:2", 0, lambda o: S.StepLR(o, step_size=3, gamma=2.0)),
    ("cosine", 0, lambda o: S.CosineAnnealingLR(o, T_max=STEPS)),
    ("cosine:0.001", 0, lambda o: S.CosineAnnealingLR(o, T_max=STEPS, eta_min=0.001)),
    ("cosine:0.01", 4, lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=1 / 3, total_iters=4),
                                                     S.CosineAnnealingLR(o, T_max=STEPS - 4, eta_min=0.01)], [4])),
    ("step:4:0.1", 6, lambda o: S.SequentialLR(o, [S.LinearLR(o, start_factor=1 / 3, total_iters=6),
                                                    S.StepLR(o, step_size=4, gamma=0.1)], [6])),
    ("constant", 5, lambda o: S.LinearLR(o, start_factor=1 / 3, total_iters=5)),
]


@pytest.mark.parametrize("spec,warmup,make", CASES, ids=[f"{c[0]}+{c[1]}" for c in CASES])
def test_schedules_give_pytorchs_rates(spec, warmup, make):
    schedule = Schedule.parse(spec, warmup, STEPS)
    ours = [schedule.lr(0.1, i) for i in range(STEPS)]
    np.testing.assert_allclose(ours, torch_rates(make), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("spec", ["linear", "step:0:0.5", "step:3", "step:3:-1", "cosine:-1", "cosine:1:2",
                                  "step:a:b", ""])
def test_bad_schedules_are_refused(spec):
    with pytest.raises(ScheduleError, match="--lr-schedule"):
        Schedule.parse(spec)
    with pytest.raises(DeepDSLError, match="schedule"):
        D.Train("t", schedule=spec)


def test_the_program_follows_and_resumes_a_schedule_exactly(tmp_path):
    """A schedule changes training (step:1:0.5 halves the rate every iteration), a bad spec is one line before
    anything is written, and training 4 iterations equals training 2, stopping and resuming for 2 more, bit for bit
    (the rate of an iteration depends on its number only)."""
    _, lenet = compile_program("lenet", tmp_path / "p", batch=8)
    common = ["--data", "synthetic", "--test-iters", "1", "--quiet", "--lr", "0.05", "--warmup", "1"]
    straight, constant = tmp_path / "straight.npz", tmp_path / "constant.npz"
    assert run_cli(lenet, "--iters", "4", "--params", str(straight), "--lr-schedule", "step:1:0.5",
                   *common).returncode == 0
    assert run_cli(lenet, "--iters", "4", "--params", str(constant), *common).returncode == 0
    resumed = tmp_path / "resumed.npz"
    for iters in ("2", "4"):
        done = run_cli(lenet, "--iters", iters, "--params", str(resumed), "--lr-schedule", "step:1:0.5", *common)
        assert done.returncode == 0, done.stderr
    a, b, c = (np.load(p) for p in (straight, resumed, constant))
    assert all(np.array_equal(a[k], b[k]) for k in a.files if not k.startswith("__"))
    assert not np.array_equal(a["cv1_W"], c["cv1_W"])
    bad = run_cli(lenet, "--iters", "1", "--params", str(tmp_path / "bad.npz"), "--lr-schedule", "cosine:x")
    assert bad.returncode != 0 and bad.stderr.count("\n") == 1 and "--lr-schedule 'cosine:x'" in bad.stderr
    assert not (tmp_path / "bad.npz").exists()
