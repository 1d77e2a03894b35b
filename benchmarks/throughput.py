#!/usr/bin/env python
"""Train-step throughput of jaxpar configs on the devices present, against a plain-JAX step.

    python benchmarks/throughput.py                        # the accelerator cases (gpt2_124m, llama_1b, Qwen3-MoE)
    python benchmarks/throughput.py CASE [CASE ...]         # CASE = config.yaml[:key=value,key=value...]
    python benchmarks/throughput.py --preset cpu            # tiny models, seconds on a CPU
    python benchmarks/throughput.py --depth 2,24            # compile time of the layer scan against depth

For each case: compile seconds, the median step time over ``--steps`` timed steps (after
``--warmup``), tokens/s, model TFLOP/s per device and MFU (:mod:`jaxpar.flops`: analytic model
flops / step time / peak; peak from the device kind or ``--peak-tflops``), peak device memory (the
allocator's peak after jaxpar's first step, before the plain step is built, where the platform
reports it: the process's peak so far, so cases run smallest first; else the compiled step's
argument + temp bytes),
and, on one device, the same for the plain-JAX step of ``plain_jax.py`` (same model math,
optimizer, shapes, dtype, attention kernel and remat) and the ratio jaxpar / plain-JAX step time.
The two steps are timed interleaved (jaxpar, plain, jaxpar, plain, ...), so that a machine whose
speed drifts during the run (a shared CPU) affects both alike.

Every case runs with synthetic data, no checkpoints and no sample. The table goes to stdout;
``--json FILE`` writes one JSON object per case. ``--profile DIR`` traces ``--profile-steps`` more steps
of each step with JAX's profiler (a TensorBoard / Perfetto trace per case under DIR) and prints the
device's kernel time per step against the wall time, and the kernels (by HLO op) that take most of it.
``--hlo DIR`` writes each case's optimised train-step HLO, to look those ops up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

COMMON = ["data.source=synthetic", "checkpoint.enabled=false", "sample.tokens=0", "train.steps=1000"]
PRESETS = {
    # the H200 comparison: one device, bf16 compute, fp32 master weights
    "gpu": ["configs/gpt2_124m.yaml:parallel.data=1,parallel.zero=0,train.batch_size=16,model.remat=none",
            "configs/llama_1b.yaml:parallel.data=1,parallel.tensor=1,parallel.zero=0,train.batch_size=8,"
            "train.grad_accum=1,model.remat=full",
            # MoE: Qwen3-30B-A3B's layers (128 experts, top 8), 4 of them, the sorted dispatch (51 GiB on an H200)
            "configs/qwen3_30b_a3b.yaml:parallel.data=1,parallel.expert=1,parallel.zero=0,model.n_layers=4,"
            "train.batch_size=4,model.seq_len=2048,model.remat=full"],
    # tiny shapes for a CPU (the test suite runs these)
    "cpu": ["configs/default.yaml:parallel.data=1,parallel.tensor=1,parallel.zero=0,train.batch_size=8,"
            "model.seq_len=64",
            "configs/default.yaml:model.style=llama,model.n_kv_heads=2,parallel.data=1,parallel.tensor=1,"
            "parallel.zero=0,train.batch_size=8,model.seq_len=64,model.remat=full"],
}
PLAIN_REMAT = {"none": "none", "full": "full", "save_dots": "save_dots", "minimal": "save_dots"}


def parse_case(case: str) -> tuple[str, list[str]]:
    path, _, over = case.partition(":")
    return str(ROOT / path) if not os.path.isabs(path) else path, [o for o in over.split(",") if o]


def _time_steps(steps: list, n_warmup: int, n_steps: int) -> list[list[float]]:
    """Wall time of each timed call of each of ``steps`` (each synchronised on its result). The
    steps are interleaved (a, b, a, b, ...) so that a change in the machine's speed during the run
    affects them alike and their ratio stays fair."""
    import jax

    for step in steps:
        for _ in range(n_warmup):
            jax.block_until_ready(step())
    times = [[] for _ in steps]
    for _ in range(n_steps):
        for step, out in zip(steps, times):
            t0 = time.perf_counter()
            jax.block_until_ready(step())
            out.append(time.perf_counter() - t0)
    return times


def _peak_memory(compiled_memory: dict) -> tuple[float, str]:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    if "peak_bytes_in_use" in stats:  # the process's peak so far: run the largest case last
        return float(stats["peak_bytes_in_use"]), "allocator peak"
    return float(compiled_memory.get("argument_size", 0) + compiled_memory.get("temp_size", 0)), "compiled args+temp"


def build_jaxpar(cfg) -> dict:
    """The compiled jaxpar step of ``cfg`` with its state and two batches: ``step()`` runs one."""
    from jaxpar.data import SyntheticSource
    from jaxpar.trainer import Trainer

    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    state = trainer.init_state()
    report = trainer.compile()
    compile_s = time.perf_counter() - t0
    src = SyntheticSource(cfg.train.seed, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size)
    batches = [trainer.place_batch(src.batch(i)) for i in range(2)]
    box = {"state": state, "i": 0}

    def step():
        box["state"], metrics = trainer.step(box["state"], batches[box["i"] % 2])
        box["i"] += 1
        return metrics["loss"]

    return {"step": step, "compile_s": compile_s, "report": report, "trainer": trainer}


# the model keys plain_jax.py implements (with their values), those that do not change the math, and the
# choices it has for the rest; every other key must keep its value for the config's style
PLAIN_MODEL = ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "vocab_multiple",
               "seq_len", "norm_eps", "rope_theta", "init_std", "bias", "tie_embeddings")
NOT_MATH = ("style", "init_from", "max_positions", "remat", "attention", "loss_chunk_tokens", "compute_dtype")
PLAIN_CHOICES = {"arch": ("gpt",), "positions": ("learned", "rope"), "norm": ("layernorm", "rmsnorm"),
                 "mlp": ("gelu", "swiglu"), "param_dtype": ("float32",)}


def plain_gap(cfg) -> str | None:
    """The first key of ``cfg`` whose math ``plain_jax.py`` does not have (``"model.arch=moe"``), or None:
    the plain step is only a reference where it computes the same model."""
    import dataclasses

    from jaxpar.config import ModelConfig

    m = cfg.model.resolved()
    kept = {k: getattr(m, k) for k in (*PLAIN_MODEL, *NOT_MATH, *PLAIN_CHOICES)}
    base = dataclasses.replace(ModelConfig(), **kept).resolved()  # every other key at the style's default
    for f in dataclasses.fields(m):
        value = getattr(m, f.name)
        if f.name in PLAIN_CHOICES:
            if value not in PLAIN_CHOICES[f.name]:
                return f"model.{f.name}={value}"
        elif f.name not in PLAIN_MODEL and f.name not in NOT_MATH and value != getattr(base, f.name):
            return f"model.{f.name}={value}"
    if cfg.train.grad_accum != 1:
        return f"train.grad_accum={cfg.train.grad_accum}"
    return None


def build_plain(cfg) -> dict:
    """The plain-JAX step (``plain_jax.py``) of the same model, dtype, attention kernel and remat."""
    import jax

    import plain_jax
    from jaxpar.data import SyntheticSource
    from jaxpar.layers.attention_ops import choose
    from jaxpar.layers.precision import compute_dtype

    gap = plain_gap(cfg)
    if gap:
        return {"skipped": f"the plain step has no {gap}"}
    m = cfg.model.resolved()
    dtype = compute_dtype(m.compute_dtype)
    kernel = choose(m.attention, dtype=dtype, head_dim=m.head_dim, n_heads=m.n_heads, n_kv_heads=m.n_kv_heads,
                    seq_len=m.seq_len)
    if kernel not in ("xla", "cudnn") or m.remat not in PLAIN_REMAT:
        return {"skipped": f"the plain step has no {kernel} attention / {m.remat} remat"}
    t0 = time.perf_counter()
    base = plain_jax.build(cfg.model, cfg.train, compute_dtype=dtype, attention=kernel, remat=PLAIN_REMAT[m.remat])
    params = jax.jit(base.init)(jax.random.key(cfg.train.seed))
    opt_state = jax.jit(base.opt.init)(params)
    src = SyntheticSource(cfg.train.seed, cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size)
    batches = [jax.device_put(src.batch(i)) for i in range(2)]
    box = {"p": params, "o": opt_state, "i": 0}
    jax.block_until_ready(base.step.lower(params, opt_state, batches[0]).compile())
    compile_s = time.perf_counter() - t0

    def step():
        box["p"], box["o"], loss = base.step(box["p"], box["o"], batches[box["i"] % 2])
        box["i"] += 1
        return loss

    return {"step": step, "compile_s": compile_s}


DERIVED_LINES = ("XLA Modules", "XLA Ops", "Steps", "Framework Name Scope", "Framework Ops", "Source code",
                 "TensorFlow Name Scope", "TensorFlow Ops", "Launch Stats")


def kernel_table(xplane: str, n_steps: int, top: int = 15) -> dict | None:
    """What the device ran in a profiler trace (an ``.xplane.pb`` file) of ``n_steps`` steps: see
    :func:`table_of`."""
    from jax.profiler import ProfileData

    return table_of(ProfileData.from_file(xplane).planes, n_steps, top)


def table_of(planes, n_steps: int, top: int = 15) -> dict | None:
    """Kernel milliseconds per step on the device planes (``/device:...``) of a trace's ``planes``, and the
    ``top`` HLO ops by time with their share and calls per step. A kernel counts under its ``hlo_op`` stat,
    else its name; the copy XLA makes of a loop body to double-buffer it (``.double_buffer_clone``)
    counts under the original. Lines the profiler derives from the kernels (``XLA Ops``, ``Steps``, ...)
    are not counted again. None when no device plane has kernels (XLA:CPU runs its ops on host threads)."""
    per_op: dict[str, list] = {}
    lines_seen = []
    for plane in planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = [ln for ln in plane.lines if ln.name not in DERIVED_LINES]
        lines_seen += [f"{plane.name}:{ln.name}" for ln in lines]
        for ln in lines:
            for ev in ln.events:
                stats = {name: value for name, value in ev.stats}
                key = str(stats.get("hlo_op") or ev.name).removesuffix(".double_buffer_clone")
                acc = per_op.setdefault(key, [0.0, 0])
                acc[0] += ev.duration_ns
                acc[1] += 1
    if not per_op:
        return None
    total = sum(v[0] for v in per_op.values())
    ranked = sorted(per_op.items(), key=lambda kv: -kv[1][0])[:top]
    return {"kernel_ms_per_step": total / n_steps / 1e6, "lines": lines_seen,
            "top": [{"op": k, "ms_per_step": v[0] / n_steps / 1e6, "share": v[0] / total,
                     "calls_per_step": v[1] / n_steps} for k, v in ranked]}


def profile_steps(steps: dict, out_dir: Path, n_steps: int) -> dict:
    """Trace ``n_steps`` calls of each named step into ``out_dir/<name>``; per name, the wall
    milliseconds per step and :func:`kernel_table` of its trace."""
    import glob

    import jax

    out = {}
    for name, step in steps.items():
        d = out_dir / name
        t0 = time.perf_counter()
        with jax.profiler.trace(str(d)):
            for _ in range(n_steps):
                jax.block_until_ready(step())
        wall_ms = (time.perf_counter() - t0) / n_steps * 1e3
        files = sorted(glob.glob(str(d / "**" / "*.xplane.pb"), recursive=True))
        table = kernel_table(files[-1], n_steps) if files else None
        out[name] = {"wall_ms_per_step": wall_ms, "trace": files[-1] if files else None, "kernels": table}
    return out


def _fmt_profile(prof: dict) -> str:
    """The profile of each step: its kernel time against the step's untraced median (``step_s``)."""
    rows = []
    for name, p in prof.items():
        k = p["kernels"]
        if k is None:
            rows.append(f"  profile {name}: {p['wall_ms_per_step']:.1f} ms/step traced; no device plane in the trace "
                        f"(CPU): open {p['trace']} in TensorBoard or Perfetto")
            continue
        ms = 1e3 * p["step_s"]
        rows.append(f"  profile {name}: device kernels {k['kernel_ms_per_step']:.1f} ms per step, "
                    f"{100 * k['kernel_ms_per_step'] / ms:.0f}% of the step's {ms:.1f} ms (traced: "
                    f"{p['wall_ms_per_step']:.1f} ms)")
        rows += [f"    {100 * t['share']:5.1f}%  {t['ms_per_step']:8.2f} ms  x{t['calls_per_step']:<6.0f} "
                 f"{t['op'][:90]}" for t in k["top"]]
    return "\n".join(rows)


def check_args(args, cases: list[str]) -> list[int]:
    """Every argument and case checked before anything compiles (a ValueError naming the bad one);
    returns the ``--depth`` list."""
    from jaxpar.config import load_config

    if args.steps < 1:
        raise ValueError(f"--steps={args.steps} must be >= 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if args.profile_steps < 1:
        raise ValueError(f"--profile-steps={args.profile_steps} must be >= 1")
    if args.peak_tflops < 0:
        raise ValueError(f"--peak-tflops={args.peak_tflops} must be >= 0 (0 = by device kind)")
    try:
        depths = [int(d) for d in args.depth.split(",")] if args.depth else []
    except ValueError:
        raise ValueError(f"--depth={args.depth!r} must be comma-separated layer counts, e.g. 2,24") from None
    if any(d < 1 for d in depths):
        raise ValueError(f"--depth={args.depth!r}: every layer count must be >= 1")
    for case in cases:
        path, over = parse_case(case)
        try:
            load_config(path, COMMON + over)
        except ValueError as e:
            raise ValueError(f"case {case!r}: {e}") from None
    return depths


def run_case(case: str, args, index: int = 0) -> dict:
    import jax

    from jaxpar.config import load_config
    from jaxpar.flops import peak_flops

    path, over = parse_case(case)
    cfg = load_config(path, COMMON + over)
    j = build_jaxpar(cfg)
    trainer, report = j["trainer"], j["report"]
    jax.block_until_ready(j["step"]())  # one step, then jaxpar's memory (before the plain step's exists)
    mem, mem_kind = _peak_memory(report.get("memory", {}))
    plain = None
    if trainer.mesh.size > 1:
        note = "n/a: the plain-JAX step runs on one device"
    elif args.no_plain:
        note = "skipped (--no-plain)"
    else:
        plain = build_plain(cfg)
        note = plain.pop("skipped", None)
        plain = None if note else plain
    times = _time_steps([j["step"]] + ([plain["step"]] if plain else []), args.warmup, args.steps)
    step_s = statistics.median(times[0])
    tokens = cfg.train.batch_size * cfg.model.seq_len
    per_device = report["model_flops"]["per_step_per_device"]
    peak = peak_flops(jax.devices()[0], args.peak_tflops)
    out = {"case": case, "device": jax.devices()[0].device_kind, "devices": trainer.mesh.size,
           "params": trainer.param_count(), "tokens_per_step": tokens, "compile_s": round(j["compile_s"], 3),
           "step_s": step_s, "tokens_per_sec": tokens / step_s, "model_tflops_per_sec": per_device / step_s / 1e12,
           "mfu": per_device / step_s / peak if peak else None, "peak_memory_bytes": mem, "memory_kind": mem_kind,
           "compute": trainer.compute_report()[0]}
    if plain:
        plain_s = statistics.median(times[1])
        out.update(plain_step_s=plain_s, plain_compile_s=round(plain["compile_s"], 3),
                   plain_mfu=per_device / plain_s / peak if peak else None, ratio_to_plain=step_s / plain_s)
    else:
        out["plain"] = note
    tag = f"case{index}"
    if args.hlo:
        Path(args.hlo).mkdir(parents=True, exist_ok=True)
        (Path(args.hlo) / f"{tag}.hlo.txt").write_text(trainer.hlo_text())
    if args.profile:
        steps = {f"{tag}-jaxpar": j["step"], **({f"{tag}-plain": plain["step"]} if plain else {})}
        out["profile"] = profile_steps(steps, Path(args.profile), args.profile_steps)
        out["profile"][f"{tag}-jaxpar"]["step_s"] = step_s
        if plain:
            out["profile"][f"{tag}-plain"]["step_s"] = out["plain_step_s"]
    return out


def depth_scaling(depths: list[int], case: str) -> dict:
    """Compile seconds of the train step at several depths (the layer scan keeps them flat)."""
    from jaxpar.config import load_config
    from jaxpar.trainer import Trainer

    path, over = parse_case(case)
    out = {}
    for n in depths:
        cfg = load_config(path, COMMON + over + [f"model.n_layers={n}"])
        t = Trainer(cfg)
        t0 = time.perf_counter()
        t.compile()
        out[n] = time.perf_counter() - t0
    return out


def _fmt(r: dict) -> str:
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
    ratio = f"{r['ratio_to_plain']:.2f}" if "ratio_to_plain" in r else r.get("plain", "-")
    plain_mfu = f" (plain {100 * r['plain_mfu']:.1f}%)" if r.get("plain_mfu") is not None else ""
    return (f"{r['case']}\n  {r['devices']} x {r['device']}, {r['params'] / 1e6:.1f}M params, {r['tokens_per_step']} "
            f"tokens/step\n  {r['compute']}\n  compile {r['compile_s']:.1f} s | step {1e3 * r['step_s']:.1f} ms | "
            f"{r['tokens_per_sec']:,.0f} tokens/s | {r['model_tflops_per_sec']:.2f} model TFLOP/s/device | MFU {mfu}"
            f"{plain_mfu} | peak memory {r['peak_memory_bytes'] / 2**30:.2f} GiB ({r['memory_kind']}) | "
            f"jaxpar / plain-JAX step time: {ratio}")


def main(argv=None) -> int:
    from jaxpar.cli import ArgumentParser

    ap = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="config.yaml[:key=value,...] (default: --preset gpu)")
    ap.add_argument("--preset", choices=sorted(PRESETS), help="a named list of cases")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per case (median reported)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps after compiling")
    ap.add_argument("--peak-tflops", type=float, default=0.0, help="device peak for MFU (default: by device kind)")
    ap.add_argument("--no-plain", action="store_true", help="skip the plain-JAX comparison")
    ap.add_argument("--depth", default="", help="comma-separated depths: compile-time scaling of the first case")
    ap.add_argument("--profile", default="", help="trace more steps of each case into this folder and print "
                    "the device's kernel time and its top ops")
    ap.add_argument("--profile-steps", type=int, default=3, help="steps traced per case with --profile")
    ap.add_argument("--hlo", default="", help="write each case's optimised train-step HLO into this folder")
    ap.add_argument("--json", default="", help="write the results (one JSON object per line) to this file")
    args = ap.parse_args(argv)
    if args.cases and args.preset:
        ap.error("give cases or --preset, not both")
    cases = args.cases or PRESETS[args.preset or "gpu"]
    try:
        depths = check_args(args, cases)
    except ValueError as e:  # bad arguments and ConfigErrors: one line, nothing run
        print(f"error: {e}", file=sys.stderr)
        return 2

    results = []
    for i, case in enumerate(cases):
        try:
            r = run_case(case, args, i)
        except Exception as e:  # noqa: BLE001 - out of device memory: one line, the cases so far are printed
            from jaxpar.run import is_out_of_memory

            if not is_out_of_memory(e):
                raise
            print(f"error: {case}: out of device memory ({str(e).strip().splitlines()[0][:200]}); run a smaller "
                  "case (--preset cpu on a CPU host) or add remat / parallel.* keys to the case", file=sys.stderr)
            return 1
        results.append(r)
        print(_fmt(r), flush=True)
        if "profile" in r:
            print(_fmt_profile(r["profile"]), flush=True)
    if depths:
        comp = depth_scaling(depths, cases[0])
        ratio = comp[depths[-1]] / comp[depths[0]]
        print(f"compile seconds by depth ({cases[0]}): "
              + ", ".join(f"{n} layers {s:.2f}" for n, s in comp.items())
              + f"; {depths[-1]} / {depths[0]} = {ratio:.2f}", flush=True)
        results.append({"depth_compile_s": {str(k): v for k, v in comp.items()}, "depth_ratio": ratio})
    write_jsonl(args.json, results)
    return 0


def write_jsonl(path: str, rows: list[dict]) -> None:
    """``rows`` as JSON lines to ``path`` (``--json``; nothing when empty)."""
    if path:
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)


if __name__ == "__main__":
    sys.exit(main())
