"""Learning-rate schedules, computed as PyTorch's `torch.optim.lr_scheduler` computes them when stepped once per
iteration: the rate of iteration i (0-based) is a function of i alone, so a resumed run continues the schedule
exactly where it stopped.

Specs (`--lr-schedule`, `D.Train(schedule=...)`):
- `constant`: the base rate throughout;
- `step:SIZE:GAMMA`: the rate times GAMMA every SIZE iterations (`StepLR(step_size=SIZE, gamma=GAMMA)`);
- `cosine` or `cosine:MIN`: from the base rate down to MIN (default 0) along half a cosine over the iterations
  after the warm-up (`CosineAnnealingLR(T_max, eta_min=MIN)`, closed form).
A warm-up of W iterations (`--warmup W`) first raises the rate linearly from a third of it, as
`SequentialLR([LinearLR(start_factor=1/3, total_iters=W), main], milestones=[W])` does; the main schedule starts at
iteration W.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["Schedule", "ScheduleError", "WARMUP_START"]

WARMUP_START = 1.0 / 3.0          # PyTorch's LinearLR default start_factor


class ScheduleError(ValueError):
    """A schedule spec that cannot be used (one line, naming what is wrong)."""


@dataclass(frozen=True)
class Schedule:
    kind: str = "constant"
    step_size: int = 0
    gamma: float = 1.0
    min_lr: float = 0.0
    warmup: int = 0
    total: int = 0          # iterations of the whole run (cosine's length is total - warmup)

    @classmethod
    def parse(cls, spec: str, warmup: int = 0, total: int = 0) -> "Schedule":
        """The schedule of a spec (see the module); ScheduleError for a malformed one."""
        kind, *fields = str(spec).split(":")
        if warmup < 0:
            raise ScheduleError(f"--warmup must be >= 0, got {warmup}")
        try:
            if kind == "constant" and not fields:
                return cls("constant", warmup=warmup, total=total)
            if kind == "step" and len(fields) == 2:
                size, gamma = int(fields[0]), float(fields[1])
                if size < 1 or not (math.isfinite(gamma) and gamma > 0):
                    raise ValueError
                return cls("step", step_size=size, gamma=gamma, warmup=warmup, total=total)
            if kind == "cosine" and len(fields) <= 1:
                low = float(fields[0]) if fields else 0.0
                if not (math.isfinite(low) and low >= 0):
                    raise ValueError
                return cls("cosine", min_lr=low, warmup=warmup, total=total)
        except ValueError:
            pass
        raise ScheduleError(f"--lr-schedule {spec!r}: use constant, step:SIZE:GAMMA (SIZE >= 1, GAMMA > 0) or "
                            "cosine[:MIN] (MIN >= 0)")

    def lr(self, base: float, iteration: int) -> float:
        """The learning rate of iteration `iteration` (0-based) for base rate `base`."""
        if iteration < self.warmup:
            return base * (WARMUP_START + (1.0 - WARMUP_START) * iteration / self.warmup)
        t = iteration - self.warmup
        if self.kind == "step":
            return base * self.gamma ** (t // self.step_size)
        if self.kind == "cosine":
            length = max(self.total - self.warmup, 1)
            return self.min_lr + (base - self.min_lr) * (1.0 + math.cos(math.pi * t / length)) / 2.0
        return base

    def describe(self) -> str:
        main = {"constant": "constant", "step": f"step:{self.step_size}:{self.gamma:g}",
                "cosine": f"cosine:{self.min_lr:g}"}[self.kind]
        return main + (f" after {self.warmup} iterations of warm-up" if self.warmup else "")
