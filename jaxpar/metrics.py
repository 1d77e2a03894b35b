"""What a run reports: ``metrics.jsonl`` and TensorBoard records, the console line and progress bar,
the loss plot, and the hooks that write them (:class:`MetricsHook`, :class:`EvalHook`).

A record per logged step: ``step`` (0-based index of the optimizer step whose batch gave ``loss``),
``loss``, ``lr``, ``grad_norm``, ``step_time`` (s, without evaluation and checkpoint time),
``tokens_per_sec``, ``model_tflops_per_sec`` (model flops per second per device, :mod:`jaxpar.flops`),
``mfu`` (that over the device's peak, when known), ``bubble_fraction`` (pipe > 1), ``val_loss`` at
evaluation steps, the model's own metrics (MoE: ``ce_loss``, ``moe_aux_loss``, ``moe_z_loss``,
``moe_drop_fraction``, ``moe_expert_load``), ``nonfinite`` and ``skipped_steps``.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def summary_writer():
    """tensorboardX's ``SummaryWriter``, imported without torch: where torch is installed, tensorboardX
    imports it at import time (seconds of start-up and ~1 GB of address space) only to recognise torch
    tensors, which jaxpar never writes. A process that already imported torch keeps it."""
    blocked = "torch" not in sys.modules
    if blocked:
        sys.modules["torch"] = None  # makes `import torch` an ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if blocked:
            del sys.modules["torch"]
    return SummaryWriter


class MetricsLog:
    """metrics.jsonl + TensorBoard on process 0. ``records`` (the earlier steps of a resumed run) are
    written first; non-finite values (a skipped step's loss) are written as null."""

    def __init__(self, out: Path, enabled: bool, records: list[dict] | None = None):
        self.records = list(records or [])
        self.file, self.tb = None, None
        if enabled:
            self.file = f = open(out / "metrics.jsonl", "w")
            self.tb = summary_writer()(str(out / "tb"))
            for rec in self.records:
                f.write(json.dumps(rec) + "\n")

    def write(self, rec: dict):
        rec = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in rec.items()}
        self.records.append(rec)
        if self.file is not None and self.tb is not None:
            self.file.write(json.dumps(rec) + "\n")
            self.file.flush()
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)):
                    self.tb.add_scalar(k, v, rec["step"])
                elif isinstance(v, list):  # a vector metric (e.g. MoE expert load): one scalar per entry
                    for i, x in enumerate(v):
                        self.tb.add_scalar(f"{k}/{i}", x, rec["step"])

    def close(self):
        if self.file is not None and self.tb is not None:
            self.file.close()
            self.tb.close()


def plot_losses(records: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    tr = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    va = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    if tr:
        ax.plot(*zip(*tr), label="train")
    if va:
        ax.plot(*zip(*va), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def progress_bar(total: int, enabled: bool):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                    TextColumn("loss {task.fields[loss]}  {task.fields[tps]} tok/s"), TimeElapsedColumn(),
                    TextColumn("ETA"), TimeRemainingColumn(), disable=not enabled, transient=False)


def scalar_or_list(v):
    """A metric for JSON: int for integer counters (``nonfinite``, ``skipped_steps``), else float."""
    a = np.asarray(v)
    if a.ndim == 0:
        return int(a) if a.dtype.kind in "iub" else float(a)
    return a.astype(float).tolist()


def format_line(r: dict) -> str:
    if r.get("nonfinite"):
        return (f"step {r['step']:5d}  SKIPPED: loss {r['loss']}, grad_norm {r['grad_norm']} (not finite); "
                f"{r['skipped_steps']} skipped so far")
    s = (f"step {r['step']:5d}  loss {r['loss']:.4f}  lr {r['lr']:.2e}  grad_norm {r['grad_norm']:.3f}  "
         f"{r['tokens_per_sec']:,.0f} tok/s")
    if "mfu" in r:
        s += f"  MFU {100 * r['mfu']:.1f}%"
    if "moe_drop_fraction" in r:
        s += f"  moe aux {r['moe_aux_loss']:.3f} dropped {100 * r['moe_drop_fraction']:.1f}%"
    if "val_loss" in r:
        s += f"  val_loss {r['val_loss']:.4f}"
    return s


def previous_records(out: Path, before: int) -> list[dict]:
    """The metrics.jsonl records of steps before ``before`` (a resumed run rewrites the rest)."""
    path = out / "metrics.jsonl"
    if before == 0 or not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if isinstance(rec, dict) and rec.get("step", before) < before:
            records.append(rec)
    return records


# ---------------------------------------------------------------------------------------------
# Hooks (jaxpar.loop): evaluation, the metrics record, the progress bar.


class EvalHook:
    """The validation loss (``values["val_loss"]``) after every ``every``-th step and the last; its time
    is not step time. ``beat`` is called after it (the watchdog's sign of life)."""

    def __init__(self, loop, trainer, batches: list, every: int, beat=lambda: None):
        self.loop, self.trainer, self.batches, self.every, self.beat = loop, trainer, batches, every, beat
        self.val: float | None = None

    def evaluate(self, params) -> float:
        """The mean loss over the validation batches; with loss weights (packed documents) the mean over
        their trained tokens (each batch's weighted mean weighted by its trained tokens)."""
        placed = [self.trainer.place_batch(b) for b in self.batches]
        losses = np.asarray(jax.device_get([self.trainer.eval_loss(params, b) for b in placed]), np.float64)
        weighted = all("weights" in b for b in placed)  # the global batch's trained tokens (every process alike)
        weights = np.asarray(jax.device_get([jnp.sum(b["weights"]) for b in placed]), np.float64) if weighted else None
        self.val = float(np.average(losses, weights=weights) if weights is not None and weights.sum() > 0
                         else np.mean(losses))
        return self.val

    def __call__(self, info) -> None:
        if self.batches and (info.last or (self.every and (info.step + 1) % self.every == 0)):
            with self.loop.off_the_clock(info):
                info.values["val_loss"] = self.evaluate(info.state["params"])
            self.beat()


class ProgressHook:
    """The rich progress bar (on a terminal; else nothing): advanced after each step, its loss and
    tokens/s fields set by :class:`MetricsHook`, which prints record lines through :meth:`print`."""

    def __init__(self, total: int, start: int, enabled: bool, log=print):
        self.bar, self.total, self.start, self.log = progress_bar(total, enabled), total, start, log
        self.task = None

    def __enter__(self):
        self.bar.__enter__()
        self.task = self.bar.add_task("train", total=self.total, completed=self.start, loss="-", tps="-")
        return self

    def __exit__(self, *exc):
        return self.bar.__exit__(*exc)

    def show(self, rec: dict) -> None:
        self.bar.update(self.task, loss=f"{rec['loss']:.3f}", tps=f"{rec['tokens_per_sec']:,.0f}")
        if not self.bar.disable:
            self.bar.console.log(format_line(rec))
        else:
            self.log(format_line(rec))

    def __call__(self, info) -> None:
        self.bar.advance(self.task)


class MetricsHook:
    """The record of a step (see the module docstring) on step 0, every ``train.log_every``-th step,
    evaluation steps and the last: written to ``metrics.jsonl`` / TensorBoard (process 0) and shown."""

    def __init__(self, loop, cfg, report: dict, bubble: float | None, log: MetricsLog, progress: ProgressHook):
        from jaxpar import flops

        self.loop, self.cfg, self.bubble, self.out, self.progress = loop, cfg, bubble, log, progress
        self.tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
        self.peak = flops.peak_flops(jax.devices()[0], cfg.train.peak_tflops)
        self.model_flops = report["model_flops"]["per_step_per_device"]
        self.last_time, self.last_step, self.last_excluded = time.perf_counter(), loop.start, 0.0
        self.loss = float("nan")

    def __call__(self, info) -> None:
        step = info.step
        if not (step % self.cfg.train.log_every == 0 or info.last or "val_loss" in info.values):
            return
        m = {k: scalar_or_list(v) for k, v in jax.device_get(info.metrics).items()}
        now = time.perf_counter()
        busy = self.loop.excluded - self.last_excluded
        dt = (now - self.last_time - busy) / (step + 1 - self.last_step)
        self.last_time, self.last_step, self.last_excluded, self.loss = now, step + 1, self.loop.excluded, m["loss"]
        rec = {"step": step, **m, "step_time": dt, "tokens_per_sec": self.tokens_per_step / dt,
               "model_tflops_per_sec": self.model_flops / dt / 1e12}
        if "trained_tokens" in m:  # packed documents: the tokens the loss counts (this step's, over the step time)
            rec["trained_tokens_per_sec"] = m["trained_tokens"] / dt
        if self.peak:
            rec["mfu"] = self.model_flops / dt / self.peak
        if self.bubble is not None:
            rec["bubble_fraction"] = self.bubble
        if "val_loss" in info.values:
            rec["val_loss"] = info.values["val_loss"]
        self.out.write(rec)
        self.progress.show(rec)
