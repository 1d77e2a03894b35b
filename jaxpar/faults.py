"""What stops a run, and how it stops cleanly: non-finite steps, preemption (SIGTERM) and Ctrl-C, a
stuck or dead peer, running out of device memory. Each is one error line (exit status in
``train.py``'s docstring); the hooks here plug them into the loop (:mod:`jaxpar.loop`).
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import jax

from jaxpar.checkpoint import Checkpointer
from jaxpar.config import Config
from jaxpar.metrics import fmt_bytes


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many consecutive non-finite steps): one line, the cause."""


class Interrupted(TrainingError):
    """The run was stopped by a second Ctrl-C, without saving (exit status 130)."""


class PeerError(TrainingError):
    """A collective with the other processes of a multi-process run failed: a peer died or was killed.
    The process should exit at once (``os._exit``): waiting for the peers at shutdown would hang
    until the heartbeat timeout."""


class OutOfMemoryAsError:
    """Inside ``with``: an out-of-memory failure of the device (at initialisation, compilation or any
    step; under asynchronous dispatch a step's failure surfaces where its result is first read)
    becomes one :class:`TrainingError` line with what the step needs (``report``, once compiled) and
    what the device has."""

    def __init__(self, trainer):
        self.trainer, self.report = trainer, None

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if kind is not None and issubclass(kind, jax.errors.JaxRuntimeError) and is_out_of_memory(e):
            raise TrainingError(out_of_memory_message(e, self.trainer.mesh.devices.flat[0], self.report)) from None
        return False


def is_out_of_memory(e: BaseException) -> bool:
    """Whether a JAX runtime error is the device running out of memory (``RESOURCE_EXHAUSTED`` on
    GPU/TPU; XLA:CPU says "Out of memory allocating ...")."""
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def step_bytes(report: dict | None) -> int:
    """Bytes one device needs for the compiled step (a compile report's ``memory``): arguments,
    temporaries and the outputs that do not reuse a donated argument."""
    mem = (report or {}).get("memory", {})
    return mem.get("argument_size", 0) + mem.get("temp_size", 0) + mem.get("output_size", 0) - mem.get("alias_size", 0)


def out_of_memory_message(e: Exception, device, report: dict | None) -> str:
    need = step_bytes(report)
    stats = (device.memory_stats() or {}) if hasattr(device, "memory_stats") else {}
    have, holder = stats.get("bytes_limit"), getattr(device, "device_kind", "the device")
    if not have and getattr(device, "platform", "") == "cpu":  # simulated devices share the host's memory
        have, holder = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host (all its CPU devices)"
    first = str(e).strip().splitlines()[0][:200]
    return (f"out of device memory ({first})"
            + (f": the train step needs {fmt_bytes(need)} per device" if need else "")
            + (f" and {holder} has {fmt_bytes(have)}" if have else "")
            + "; lower the memory with model.remat=save_dots or full, shard more (parallel.zero=3, parallel.tensor, "
              "parallel.pipe), or lower train.batch_size / raise train.grad_accum")


def host_memory() -> tuple[int, int]:
    """``(available, total)`` bytes of this host's memory (``MemAvailable`` of /proc/meminfo where it
    exists: free plus reclaimable caches)."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024, total
    except (OSError, KeyError, ValueError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES"), total


def check_host_memory(report: dict, mesh) -> None:
    """Simulated CPU devices share the host's memory: a compiled step that needs more than the host
    has free would allocate until the operating system kills the process. One line instead."""
    devices = list(mesh.devices.flat)
    if devices[0].platform != "cpu":
        return
    per_device = step_bytes(report)
    need = per_device * len(devices)
    available, total = host_memory()
    have = f"this host has {fmt_bytes(available)} free of {fmt_bytes(total)}"
    import resource

    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY and limit < available:
        available, have = limit, f"this process may use {fmt_bytes(limit)} (its address-space limit, ulimit -v)"
    if need > available:
        raise TrainingError(
            f"the compiled train step needs {fmt_bytes(need)} of host memory ({fmt_bytes(per_device)} on each of the "
            f"{len(devices)} simulated CPU devices) and {have}; lower train.batch_size, the model size or "
            "parallel.* device counts, or use model.remat=full, parallel.zero=3 (each simulated device holds its "
            "own replicas)")


class StartUpSignals:
    """Ctrl-C during start-up: the handler notes it before raising ``KeyboardInterrupt``, so that one
    swallowed on the way (by a library's ``except BaseException`` or a C++ callback) still stops the
    start at the next :meth:`check`. Installed only from the main thread; :meth:`close` restores the
    previous handler."""

    def __init__(self):
        import signal
        import threading

        self.seen, self.previous, self.hook, self.closed = False, None, None, False
        if (threading.current_thread() is threading.main_thread()
                and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN):  # e.g. started with nohup ... &
            self.previous = signal.signal(signal.SIGINT, self._interrupt)
            # one raised inside a callback Python cannot propagate from (JAX's gc callback) is reported as
            # "Exception ignored in ..." with a traceback: it is noted here, and honoured at the next check
            self.hook = sys.unraisablehook
            sys.unraisablehook = self._unraisable

    def _unraisable(self, unraisable) -> None:
        if self.closed or not isinstance(unraisable.exc_value, KeyboardInterrupt):
            (self.hook or sys.__unraisablehook__)(unraisable)

    def _interrupt(self, *_):
        self.seen = True
        raise KeyboardInterrupt

    def check(self) -> None:
        if self.seen:
            raise KeyboardInterrupt

    def close(self) -> None:
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)
            self.previous = None
        self.closed = True
        if self.hook is not None and sys.unraisablehook is self._unraisable:
            sys.unraisablehook = self.hook
            self.hook = None
        # else a hook installed since (the checkpoint reader's filter) wraps this one: it stays, and this
        # one passes everything on from now


class Preemption:
    """A request to stop: save a checkpoint after the current step, then stop.

    SIGTERM (a scheduler's preemption notice) and the first Ctrl-C (SIGINT) both ask for it; a
    second Ctrl-C stops at once without saving (``KeyboardInterrupt``, turned into
    :class:`Interrupted`). One process: handlers installed for the duration of the run (from the
    main thread) set a flag that the loop reads after each step. Several processes: JAX's
    preemption service, started by ``jax.distributed.initialize``, receives the SIGTERM of any host
    (a Ctrl-C is passed to it as a SIGTERM to this process) and lets every process agree on the
    same step to stop at (``reached_preemption_sync_point``)."""

    def __init__(self):
        import signal
        import threading

        self.flag, self.signal_name, self.previous = False, None, {}
        self.multi = jax.process_count() > 1
        if threading.current_thread() is threading.main_thread():
            if not self.multi:
                self.previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._notice)
            self.previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._interrupt)

    def _notice(self, *_):
        self.flag, self.signal_name = True, self.signal_name or "SIGTERM"

    def _interrupt(self, *_):
        import signal

        if self.signal_name == "SIGINT":
            raise KeyboardInterrupt
        self.signal_name = "SIGINT"
        print("\ninterrupted (Ctrl-C): finishing this step and saving a checkpoint; press Ctrl-C again to stop at once "
              "without saving", file=sys.stderr, flush=True)
        if self.multi:  # every process must stop at the same step: JAX's preemption service agrees on it
            os.kill(os.getpid(), signal.SIGTERM)
        else:
            self.flag = True

    def reached(self, steps_done: int) -> bool:
        if self.multi:
            from jax.experimental import multihost_utils

            try:
                return multihost_utils.reached_preemption_sync_point(steps_done)
            except RuntimeError:  # the preemption service is switched off (jax_enable_preemption_service)
                return False
        return self.flag

    def close(self):
        import signal

        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


class Watchdog:
    """Calls ``on_hang(seconds)`` from a background thread when :meth:`beat` has not been called for
    ``timeout`` seconds (0 = never). The training loop beats after each step, evaluation and save; a
    collective waiting for a stuck (alive, still heartbeating) peer never returns, so only a thread
    can notice."""

    def __init__(self, timeout: float, on_hang, poll: float | None = None):
        import threading

        self.timeout, self.on_hang = timeout, on_hang
        self.last = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        if timeout > 0:
            self.poll = poll or min(5.0, timeout / 10)
            self._thread = threading.Thread(target=self._watch, name="jaxpar-watchdog", daemon=True)
            self._thread.start()

    def beat(self) -> None:
        self.last = time.monotonic()

    def _watch(self) -> None:
        while not self._stop.wait(self.poll):
            idle = time.monotonic() - self.last
            if idle > self.timeout:
                self.on_hang(idle)
                return

    def close(self) -> None:
        self._stop.set()


def hang_exit(cfg: Config, ckpt: Checkpointer | None, current):
    """The watchdog's action in ``run``: one error line naming the step in progress (``current()``),
    then leave at once (the main thread is stuck)."""

    def on_hang(idle: float) -> None:
        print(f"error: process {jax.process_index()}: no training progress for {idle:.0f} s while running step "
              f"{current()} (train.step_timeout={cfg.train.step_timeout}); a peer process may be hung, or the step "
              f"is slower than the limit. Stopping; {newest_checkpoint(ckpt)}", file=sys.stderr, flush=True)
        os._exit(1)

    return on_hang


def newest_checkpoint(ckpt: Checkpointer | None) -> str:
    """How a stop message names the checkpoint to resume from."""
    if ckpt is None:
        return "checkpoints are disabled"
    latest = ckpt.latest()
    return (f"the newest complete checkpoint is {ckpt.path(latest)}" if latest is not None
            else "there is no checkpoint yet")


class FaultCounter:
    """Counts consecutive skipped (non-finite) steps from the step metrics, one step behind the
    device so that the host never waits for the step it just dispatched; raises
    :class:`TrainingError` after ``limit`` in a row."""

    def __init__(self, limit: int, ckpt: Checkpointer | None):
        self.limit, self.ckpt = limit, ckpt
        self.pending: tuple[int, Any] | None = None
        self.streak: list[int] = []
        self.total = 0

    def push(self, step: int, metrics: dict) -> None:
        self.flush()
        self.pending = (step, metrics["nonfinite"])

    def flush(self) -> None:
        if self.pending is None:
            return
        step, flag = self.pending
        self.pending = None
        if not int(flag):
            self.streak = []
            return
        self.total += 1
        self.streak.append(step)
        if len(self.streak) >= self.limit:
            if self.ckpt is not None:
                self.ckpt.wait()  # a save in flight holds weights from before the streak: let it complete
            raise TrainingError(f"{len(self.streak)} consecutive steps ({self.streak[0]}-{self.streak[-1]}) had a "
                                f"non-finite loss or gradients and were skipped (train.max_bad_steps={self.limit}); "
                                f"stopping; {newest_checkpoint(self.ckpt)}. Lower train.lr or raise "
                                "train.warmup_steps / train.grad_clip")


# ---------------------------------------------------------------------------------------------
# Hooks (jaxpar.loop).


class FaultHook:
    """After each step: count non-finite steps (one step behind the device), stop the run on a failed
    background save, and beat the watchdog."""

    def __init__(self, counter: FaultCounter, ckpt: Checkpointer | None, watchdog: Watchdog):
        self.counter, self.ckpt, self.watchdog = counter, ckpt, watchdog

    def __call__(self, info) -> None:
        self.counter.push(info.step, info.metrics)  # reads the previous step's flag: one step stays in flight
        if self.ckpt is not None:
            self.ckpt.check_for_errors()  # a background save that failed stops the run now
        self.watchdog.beat()


class PreemptionHook:
    """Stops the run after the step at which a SIGTERM / first Ctrl-C was noticed (every process at
    the same step); :class:`jaxpar.checkpoint.CheckpointHook` after it saves that step."""

    def __init__(self, loop, preemption: Preemption):
        self.loop, self.preemption = loop, preemption

    def __call__(self, info) -> None:
        if self.preemption.reached(info.step + 1):
            self.loop.request_stop(self.preemption.signal_name or "SIGTERM")
