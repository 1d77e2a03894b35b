"""The training loop: a generator of steps, and hooks that run after each step (Levanter's design).

    loop = TrainLoop(trainer, source, state, start=0, steps=1000)
    loop.add_hook(lambda info: print(info.step, float(info.metrics["loss"])), every=100)
    for info in loop:          # or loop.run()
        ...                    # info.step, info.state, info.metrics, info.last, info.values

Each iteration runs one train step on the source's next batch, then the hooks in the order they were
added (a hook added with ``every=N`` runs after steps N, 2N, ... counted from 1, and after the last
step), then yields a :class:`StepInfo`. A hook may stop the run after the current step
(``info.loop.request_stop(reason)``; the checkpoint hook then saves that step), leave a value for
the hooks after it (``info.values``, e.g. the validation loss), and do other work off the step's
clock (``with info.loop.off_the_clock(info): ...``: it first waits for the step to finish, so the
step's own device time stays step time, then excludes the hook's time).
``train.py``'s logging, evaluation, checkpointing, progress bar, preemption and watchdog are such
hooks (:mod:`jaxpar.metrics`, :mod:`jaxpar.faults`, :mod:`jaxpar.checkpoint`); ``jaxpar.run.run(cfg,
hooks=[(fn, every)])`` adds yours after the metrics and before the checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import jax


@dataclass
class StepInfo:
    """One finished step: ``step`` (0-based), the train ``state`` after it, its ``metrics`` (device
    arrays: read them with ``jax.device_get``, which waits for the step), ``last`` (the run's final
    step) and ``values`` that earlier hooks of this step left (``val_loss`` after an evaluation)."""

    step: int
    state: Any
    metrics: dict
    last: bool
    values: dict = field(default_factory=dict)
    loop: TrainLoop | None = field(default=None, repr=False)  # e.g. info.loop.request_stop("reason")


class TrainLoop:
    """Runs ``trainer.step`` on ``source.next()`` for steps ``start .. steps - 1``; see the module docstring."""

    def __init__(self, trainer, source, state, start: int, steps: int):
        self.trainer, self.source, self.state = trainer, source, state
        self.start, self.steps = int(start), int(steps)
        self.hooks: list[tuple[int, Callable[[StepInfo], Any]]] = []
        self.current = self.start  # the step in progress (for a watchdog's message)
        self.stop_reason: str | None = None
        self.excluded = 0.0  # seconds the hooks spent on other work (evaluation, saving): not step time

    def add_hook(self, fn: Callable[[StepInfo], Any], every: int = 1) -> Callable[[StepInfo], Any]:
        """Run ``fn(info)`` after every ``every``-th step and after the last step; returns ``fn``."""
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"a hook's every={every!r} must be a positive number of steps")
        self.hooks.append((every, fn))
        return fn

    def request_stop(self, reason: str) -> None:
        """Stop after the current step (its remaining hooks still run)."""
        self.stop_reason = self.stop_reason or reason

    def exclude(self, seconds: float) -> None:
        """Do not count ``seconds`` (spent by a hook on other work) as training time. The step runs
        asynchronously: time measured before its results are ready holds part of the step; use
        :meth:`off_the_clock`, which waits for them first."""
        self.excluded += seconds

    @contextlib.contextmanager
    def off_the_clock(self, info: StepInfo):
        """``with loop.off_the_clock(info): ...``: work of a hook (evaluation, saving) that is not step
        time. The step was only dispatched when the hooks start: it is waited for first, so that its
        device time is still counted as its own."""
        jax.block_until_ready(info.metrics)
        t = time.perf_counter()
        try:
            yield
        finally:
            self.exclude(time.perf_counter() - t)

    def __iter__(self) -> Iterator[StepInfo]:
        for step in range(self.start, self.steps):
            self.current = step
            self.state, metrics = self.trainer.step(self.state, self.trainer.place_batch(self.source.next()))
            info = StepInfo(step, self.state, metrics, step == self.steps - 1, loop=self)
            for every, fn in self.hooks:
                if info.last or (step + 1) % every == 0:
                    fn(info)
            yield info
            if self.stop_reason is not None:
                return

    def run(self) -> Any:
        """Iterate to the end (or a requested stop); returns the final state."""
        for _ in self:
            pass
        return self.state
