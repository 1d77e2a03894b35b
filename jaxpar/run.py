"""The training loop behind ``train.py``: build, report, compile, train, log.

Run directory contents (``train.out_dir``):

* ``config.yaml``          the resolved configuration;
* ``compile_report.json``  per-device memory, flops and collectives of the compiled train step;
* ``train_step.hlo.txt``   the optimised HLO (``debug.dump_hlo=true``);
* ``metrics.jsonl``        one JSON object per logged step: ``step`` (0-based index of the optimizer
  step whose batch gave ``loss``), ``loss``, ``lr``, ``grad_norm``, ``step_time`` (s),
  ``tokens_per_sec``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
import yaml

from jaxpar import mesh as meshlib
from jaxpar.config import Config
from jaxpar.data import SyntheticSource
from jaxpar.trainer import Trainer


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def startup_report(trainer: Trainer) -> str:
    t = trainer
    lines = [meshlib.describe(t.mesh), "", t.rules.table(), "",
             f"parameters: {t.param_count():,}",
             f"per device: parameters {_fmt_bytes(t.per_device_bytes('params'))}, "
             f"optimizer state {_fmt_bytes(t.per_device_bytes('opt'))}"]
    return "\n".join(lines)


def make_source(cfg: Config):
    if cfg.data.source == "synthetic":
        return SyntheticSource(cfg.train.seed, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size)
    raise ValueError(f"unknown data.source {cfg.data.source!r}")


def run(cfg: Config, mesh=None, log=print) -> dict:
    """Train ``cfg`` to completion; returns a summary dict (final loss, run directory)."""
    out = Path(cfg.train.out_dir)
    is_main = jax.process_index() == 0
    if is_main:
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    trainer = Trainer(cfg, mesh=mesh)
    log(startup_report(trainer))
    source = make_source(cfg)

    t0 = time.perf_counter()
    state = trainer.init_state()
    report = trainer.compile()
    report["compile_seconds"] = round(time.perf_counter() - t0, 3)
    if is_main:
        (out / "compile_report.json").write_text(json.dumps(report, indent=2))
        if cfg.debug.dump_hlo:
            (out / "train_step.hlo.txt").write_text(trainer.hlo_text())
    mem = report.get("memory", {})
    log(f"compiled train step in {report['compile_seconds']:.1f}s: {report['flops']:.3g} flops/step/device, "
        f"arguments {_fmt_bytes(mem.get('argument_size', 0))}, temp {_fmt_bytes(mem.get('temp_size', 0))} per device")

    tokens_per_step = cfg.train.batch_size * cfg.model.seq_len
    metrics_file = open(out / "metrics.jsonl", "w") if is_main else None
    last_time, last_step, loss = time.perf_counter(), 0, float("nan")
    try:
        for step in range(cfg.train.steps):
            batch = trainer.place_batch(source.batch(step))
            state, metrics = trainer.step(state, batch)
            if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1:
                m = {k: float(np.asarray(v)) for k, v in jax.device_get(metrics).items()}
                now = time.perf_counter()
                n = step + 1 - last_step
                dt = (now - last_time) / n
                last_time, last_step = now, step + 1
                loss = m["loss"]
                rec = {"step": step, **m, "step_time": dt, "tokens_per_sec": tokens_per_step / dt}
                if metrics_file:
                    metrics_file.write(json.dumps(rec) + "\n")
                    metrics_file.flush()
                log(f"step {step:5d}  loss {loss:.4f}  lr {m['lr']:.2e}  grad_norm {m['grad_norm']:.3f}  "
                    f"{rec['tokens_per_sec']:,.0f} tok/s")
    finally:
        if metrics_file:
            metrics_file.close()
    return {"final_loss": loss, "out_dir": str(out), "steps": cfg.train.steps}
