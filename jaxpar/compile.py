"""Ahead-of-time compilation of a train step for a mesh of simulated devices, with no weight allocated:
the way to find an out-of-memory layout, or collectives on the wrong axes, before a cluster is booked.

    python -m jaxpar.compile --config configs/gpt3_175b.yaml                 # its 1024-device layout
    python -m jaxpar.compile --config configs/mixtral_8x7b.yaml --json report.json
    python -m jaxpar.compile --config configs/llama_1b.yaml --devices 64 parallel.data=16

The step is lowered from abstract arrays (``jax.ShapeDtypeStruct`` with the run's shardings: the
:class:`~jaxpar.trainer.Trainer` never initialises parameters) and compiled by XLA:CPU for as many
simulated devices as the mesh has (``--devices``, or the product of the ``parallel.*`` sizes). The
report: per-device parameter and optimizer bytes from the shardings, the compiled program's
``memory_analysis()`` (arguments + outputs + temporaries - aliased), and its collectives by kind and
mesh axes (wire bytes per device per step, :mod:`jaxpar.hlo`). ``--hbm-gib`` says whether that fits.

What XLA:CPU compiles is the GPU program's partitioning (the same SPMD partitioner, the same
collectives between the same devices), not its kernels: with ``model.attention=auto`` it uses the
reference attention, whose float32 scores the flash kernels of GPU/TPU never hold, and its buffer
assignment and fusion differ; read temporaries as an estimate of the GPU's, the sharded state as exact.
Beside the compiled collectives it prints :mod:`jaxpar.comm`'s analytic model of them, for XLA:CPU
(which also runs bfloat16 dots in float32, so its activation collectives carry 4-byte elements) and
for the GPU/TPU compilers (reduce-scatters, gradients reduced once per step, the compute dtype).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

from jaxpar.cli import COUNT, SIZE, ArgumentParser, command
from jaxpar.config import ConfigError

GIB = 2**30


def report(trainer, rep: dict, compile_seconds: float) -> dict:
    """The compile report ``rep`` of ``trainer``'s step in the form :func:`main` prints, with the
    analytic communication model (:mod:`jaxpar.comm`) of what XLA:CPU emits and of what the GPU/TPU
    compilers emit after their collective passes."""
    import jax.numpy as jnp

    from jaxpar import comm
    from jaxpar.layers.precision import compute_dtype

    m = trainer.cfg.model.resolved()
    leaves = comm.leaves_of(trainer)
    act = jnp.dtype(compute_dtype(m.compute_dtype, "gpu")).itemsize
    pb = jnp.dtype(m.param_dtype).itemsize
    # XLA:CPU runs bfloat16 dots in float32: its activation collectives carry 4-byte elements
    model = {p: comm.summarize(comm.traffic(trainer.cfg, trainer.sizes, leaves, platform=p, param_bytes=pb,
                                            act_bytes=4 if p == "cpu" else act)) for p in ("cpu", "gpu")}
    mem = rep.get("memory", {})
    total = mem.get("argument_size", 0) + mem.get("output_size", 0) + mem.get("temp_size", 0) - mem.get(
        "alias_size", 0)
    return {"mesh": dict(trainer.sizes), "devices": trainer.mesh.size, "parameters": trainer.param_count(),
            "per_device": {"params": trainer.per_device_bytes("params"), "opt": trainer.per_device_bytes("opt"),
                           **mem, "total": total},
            "collectives": comm.measured(rep["collectives"]), "collectives_model": model,
            "model_flops_per_device": rep["model_flops"]["per_step_per_device"],
            "compile_seconds": round(compile_seconds, 1)}


def format_report(r: dict, hbm_gib: float = 0.0) -> str:
    pd = r["per_device"]
    mesh = " x ".join(f"{a}={n}" for a, n in r["mesh"].items() if n > 1) or "one device"
    lines = [f"{r['parameters'] / 1e9:.2f}B parameters on {r['devices']} devices ({mesh}); compiled in "
             f"{r['compile_seconds']:.0f} s",
             "per device: " + ", ".join(f"{k} {pd[k] / GIB:.2f} GiB" for k in
                                        ("params", "opt", "argument_size", "output_size", "temp_size", "alias_size")
                                        if k in pd)
             + f"; total (arguments + outputs + temporaries - aliased) {pd['total'] / GIB:.2f} GiB"]
    if hbm_gib:
        fits = pd["total"] <= hbm_gib * GIB
        lines.append(f"{'fits' if fits else 'does NOT fit'} in {hbm_gib:g} GiB per device")
    lines.append("collectives per device per step, GiB on the wire: compiled | model of XLA:CPU's | model after "
                 "the GPU/TPU collective passes")
    cpu, gpu = r["collectives_model"]["cpu"], r["collectives_model"]["gpu"]
    keys = sorted({(k, a) for d in (r["collectives"], cpu, gpu) for k, by in d.items() for a in by})
    for kind, axes in keys:
        got, a, b = (d.get(kind, {}).get(axes, 0.0) / GIB for d in (r["collectives"], cpu, gpu))
        lines.append(f"  {kind:19s} {axes:22s} {got:12.3f} | {a:12.3f} | {b:12.3f}")
    lines.append(f"model flops per device per step: {r['model_flops_per_device'] / 1e12:.1f} TFLOP")
    return "\n".join(lines)


REPORT_KEYS = ("mesh", "devices", "parameters", "per_device", "collectives", "collectives_model")


def check_output(path: str) -> Path:
    """The ``--json`` file, checked before anything is compiled: its folder exists, and it is new or a
    previous report of this command (which is replaced; any other file the user has is never
    overwritten: a ConfigError names it)."""
    out = Path(path)
    if not out.parent.is_dir():
        raise ConfigError(f"--json {path}: the folder {str(out.parent)!r} does not exist")
    if out.is_dir():
        raise ConfigError(f"--json {path} is a folder; name a file (e.g. {out / 'report.json'})")
    if out.exists():
        try:
            old = json.loads(out.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            old = None
        if not (isinstance(old, dict) and all(k in old for k in REPORT_KEYS)):
            raise ConfigError(f"--json {path} exists and is not a report of python -m jaxpar.compile; it was left as "
                              "is: name a new file (a previous report is replaced)")
    return out


@command()
def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m jaxpar.compile", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True, help="a YAML config (its parallel.* keys are the mesh)")
    ap.add_argument("--devices", type=COUNT, default=None, help="simulated devices, >= 1 (default: the mesh's "
                                                                "product)")
    ap.add_argument("--hbm-gib", type=SIZE, default=None, help="memory per device (GiB, > 0) to check the total "
                                                               "against")
    ap.add_argument("--json", default="", help="also write the report to this file (new, or a previous report of "
                                               "this command, which is replaced; any other file is refused)")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.pipe=4")
    a = ap.parse_intermixed_args(argv)

    from jaxpar.config import load_config

    try:
        out = check_output(a.json) if a.json else None
        cfg = load_config(a.config, a.overrides)
        sizes = [getattr(cfg.parallel, k) for k in ("data", "pipe", "expert", "seq", "tensor")]
        n = a.devices or (math.prod(sizes) if -1 not in sizes else 0)
        if n <= 0:
            raise ConfigError("a parallel size is -1: give --devices N (the mesh size to compile for)")
        # XLA:CPU's AllReducePromotion computes bfloat16 all-reduces in float32, a CPU runtime's need that
        # GPU/TPU programs do not have; an AOT compile runs nothing, so it is left out (the collectives and
        # memory stay those of the program's own dtypes; the planner's XLA:CPU flavour is fitted to it)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   " --xla_disable_hlo_passes=all-reduce-promotion").strip()
        import jax

        jax.config.update("jax_platforms", "cpu")
        from jaxpar.mesh import request_cpu_devices

        try:
            request_cpu_devices(n)
        except RuntimeError as e:  # JAX already started (main called from a process that used JAX)
            raise ConfigError(str(e)) from None
        from jaxpar.trainer import Trainer

        trainer = Trainer(cfg)
        t0 = time.perf_counter()
        rep = trainer.compile()
        r = report(trainer, rep, time.perf_counter() - t0)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(r, a.hbm_gib or 0.0))
    if out is not None:
        tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
        try:  # beside, then renamed over: an interrupted write never leaves half a report
            tmp.write_text(json.dumps(r, indent=2))
            os.replace(tmp, out)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if not isinstance(e, OSError):
                raise
            print(f"error: cannot write --json {out}: {e.strerror or e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
