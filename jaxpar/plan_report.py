"""What :mod:`jaxpar.plan` says beyond its table: ``--explain`` (why a layout, in the terms of the classic
strategy guides) and ``--calibrate`` (the cluster fitted to real runs).

:func:`explain` takes an estimate and says what each mesh axis splits, what fits only because of ZeRO,
remat, a pipeline or accumulation (the same layout estimated without each, against the device memory),
which collectives cross nodes and what they cost (bytes, link, seconds exposed), the bubble, and the
step's time by term (:mod:`jaxpar.steptime`), beside the rules of thumb users learn first
(single-device fit -> data parallelism, wide layers -> tensor, deep -> pipeline, long -> sequence, MoE ->
expert) and whether the choice follows them.

:func:`calibrate` reads run directories (``config.yaml``, ``metrics.jsonl``'s ``step_time``, the
compiled collectives of ``compile_report.json``) and fits the cluster's efficiency, HBM and link
bandwidths to their measured step times (:func:`jaxpar.steptime.fit`).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from jaxpar.config import ConfigError
from jaxpar.mesh import AXES

GIB = 2**30
SPLITS = {"data": "the batch", "expert": "the experts (and, for the dense layers, the batch)",
          "seq": "the sequence", "tensor": "each layer's weight matrices (heads, MLP columns, vocabulary)",
          "pipe": "the layers (consecutive stages)"}


def _what_fits(planner, est) -> list[str]:
    """What the layout needs its memory savers for: each undone (ZeRO to 0, remat to none, no accumulation)
    with its estimated memory against the device's."""
    limit = planner.cluster.hbm_gib * GIB
    ov = est.overrides
    out = []
    for key, plain, name in (("parallel.zero", 0, "ZeRO-{v}"), ("model.remat", "none", "remat={v}"),
                             ("train.grad_accum", 1, "{v} accumulation microsteps"),
                             ("parallel.megatron_sp", False, "Megatron-SP")):
        v = ov.get(key, plain)
        if v == plain:
            continue
        alt = {**ov, key: plain}
        if key == "train.grad_accum" and ov.get("parallel.microbatches"):
            alt["parallel.microbatches"] = ov["parallel.microbatches"] * v
        try:
            mem = planner.estimate(alt).memory["total"]
        except ConfigError as e:
            out.append(f"  {name.format(v=v)}: without it the layout fails a check ({e})")
            continue
        verdict = "needed: without it" if mem > limit else "not needed for memory: without it"
        out.append(f"  {name.format(v=v)}: {verdict} {mem / GIB:.1f} GiB per device "
                   f"(device {planner.cluster.hbm_gib:g} GiB, with it {est.memory['total'] / GIB:.1f})")
    if ov.get("parallel.pipe", 1) > 1:
        flat = {**ov, "parallel.pipe": 1, "parallel.data": ov["parallel.data"] * ov["parallel.pipe"],
                "parallel.microbatches": 0}
        flat.pop("parallel.pipeline_schedule", None)
        flat.pop("parallel.pipeline_repeats", None)
        flat.pop("parallel.stage_remat", None)
        try:
            mem = planner.estimate(flat).memory["total"]
            why = "needed for memory" if mem > limit else "not needed for memory"
            out.append(f"  pipe={ov['parallel.pipe']}: {why}: its devices as data parallelism instead would need "
                       f"{mem / GIB:.1f} GiB per device")
        except ConfigError as e:
            out.append(f"  pipe={ov['parallel.pipe']}: its devices as data parallelism fail a check ({e})")
    return out or ["  nothing: the model, its optimizer state and activations fit as laid out, without savers"]


def _rules(planner) -> list[str]:
    """The rules of thumb (the strategy guides') for this model and cluster."""
    cfg, m = planner.cfg, planner.cfg.model.resolved()
    single = None
    try:
        plain = {**{f"parallel.{a}": 1 for a in AXES}, "parallel.zero": 0, "model.remat": "none",
                 "parallel.microbatches": 0, "train.grad_accum": 1}
        plain["parallel.data"] = planner.n
        single = planner.estimate(plain).memory["total"]
    except ConfigError:
        pass
    out = []
    if single is not None and single <= planner.cluster.hbm_gib * GIB:
        out.append(f"  1. fits as plain data parallelism ({single / GIB:.1f} GiB): data parallelism first")
    else:
        out.append("  1-2. does not fit as plain data parallelism: shard state (ZeRO), then tensor for wide "
                   f"layers (d_model {m.d_model}), pipeline for deep stacks ({m.n_layers} layers)")
    if m.seq_len > 8192:
        out.append(f"  3. {m.seq_len} tokens per sequence (> 8k): sequence parallelism")
    if m.arch == "moe":
        out.append(f"  4. Mixture of Experts ({cfg.moe.n_experts} experts): expert parallelism")
    return out


def explain(planner, est, rank: int = 1) -> str:
    """Why ``est`` (a :class:`jaxpar.plan.Estimate` of ``planner``): see the module docstring."""
    from jaxpar.steptime import bandwidth

    ov = est.overrides
    sizes = {a: ov.get(f"parallel.{a}", 1) for a in AXES}
    cfg = planner.config(ov)
    m = cfg.model.resolved()
    lines = [f"#{rank}: {describe(ov)}: {est.step_seconds:.3f} s per step, MFU {100 * est.mfu:.1f}%, "
             f"{est.memory['total'] / GIB:.1f} GiB per device"]
    lines.append("what each axis splits:")
    for a in AXES:
        if sizes[a] > 1:
            extra = {"data": f"{cfg.train.batch_size // cfg.train.grad_accum // (sizes['data'] * sizes['expert'])} "
                             "sequences per device per microstep",
                     "pipe": f"{m.n_layers} layers over {sizes['pipe']} stages"
                             + (f", {ov.get('parallel.pipeline_repeats', 1)} chunks each"
                                if ov.get("parallel.pipeline_repeats", 1) > 1 else ""),
                     "seq": f"{m.seq_len // sizes['seq']} tokens per device; "
                            + SEQ_ATTENTION_HOW[cfg.parallel.seq_attention],
                     "tensor": f"{m.n_heads // sizes['tensor']} heads per device",
                     "expert": f"{cfg.moe.n_experts // sizes['expert']} experts per device"}.get(a, "")
            lines.append(f"  {a}={sizes[a]}: {SPLITS[a]} ({extra})")
    lines.append("what fits only because of a memory saver:")
    lines += _what_fits(planner, est)
    lines.append("communication per step (wire GiB per device, link, seconds exposed after overlap):")
    for label, b in sorted(est.comm.items(), key=lambda x: -x[1]):
        gbs, _ = bandwidth(planner.cluster, label, sizes, planner.nodes)
        link = "across nodes" if gbs == planner.cluster.inter_gbs and planner.nodes > 1 else "inside a node"
        lines.append(f"  {label:16s} {b / GIB:9.2f} GiB  {link} at {gbs:g} GB/s  "
                     f"{est.budget.get(f'comm {label}', 0.0):.3f} s exposed")
    if sizes["pipe"] > 1:
        if est.overrides.get("parallel.pipeline_schedule") in ("zb_h1", "zb_v"):
            lines.append(f"bubble: {100 * (1 - 1 / est.bubble):.1f}% of the zero-bubble grid's slots idle (passes "
                         f"taken as equal; the time term below times them with B running the chunk's forward again)")
        else:
            lines.append(f"bubble: {100 * (1 - 1 / est.bubble):.1f}% of a pipeline's iterations idle "
                         "((S-1)/(M R+S-1))")
    lines.append("time by term (s per step, share):")
    step = est.budget["step"]
    for k, v in est.budget.items():
        if k != "step" and v > 0:
            lines.append(f"  {k:20s} {v:9.3f}  {100 * v / step:5.1f}%")
    return "\n".join(lines)


def explain_plan(planner, ok: list) -> str:
    """``--explain``: the rules of thumb, then the first choice and the runner-up explained."""
    out = ["rules of thumb (../shared/STRATEGY_GUIDE.md, the classic guides) for this model on "
           f"{planner.n} devices:", *_rules(planner), ""]
    for i, est in enumerate(ok[:2], 1):
        out += [explain(planner, est, i), ""]
    if len(ok) > 1:
        a, b = ok[0], ok[1]
        out.append(f"the first choice is {100 * (b.step_seconds / a.step_seconds - 1):.1f}% faster than the runner-up "
                   "by the model; the terms above say where")
    return "\n".join(out)


# how each context-parallel attention (parallel.seq_attention) works and what it costs, for --explain
SEQ_ATTENTION_HOW = {
    "ring": "ring attention: K/V blocks passed round the ring behind each block's attention, every block computed "
            "again in its backward (the recompute term)",
    "ulysses": "Ulysses: all-to-alls trade the sequence split for a head split around the local attention",
    "all_gather": "K/V all-gathered over seq for the local queries, their gradient reduce-scattered",
}


def describe(ov: dict) -> str:
    par = " x ".join(f"{k.split('.')[1]}={v}" for k, v in ov.items()
                     if k.split(".")[1] in AXES and v > 1) or "one device"
    extra = [f"zero={ov.get('parallel.zero', 0)}", f"remat={ov.get('model.remat', 'none')}"]
    if ov.get("parallel.megatron_sp"):
        extra.append("megatron_sp")
    if ov.get("parallel.seq", 1) > 1 and "parallel.seq_attention" in ov:
        extra.append(ov["parallel.seq_attention"])
    if ov.get("train.grad_accum", 1) > 1:
        extra.append(f"k={ov['train.grad_accum']}")
    if ov.get("parallel.microbatches"):
        extra.append(f"M={ov['parallel.microbatches']}")
    if ov.get("parallel.pipeline_schedule", "gpipe") != "gpipe":
        extra.append(ov["parallel.pipeline_schedule"])
    if ov.get("parallel.pipeline_repeats", 1) > 1:
        extra.append(f"R={ov['parallel.pipeline_repeats']}")
    if ov.get("parallel.stage_remat") is False:
        extra.append("kept")  # the forwards' residuals kept for the backwards (parallel.stage_remat=false)
    return f"{par} ({', '.join(extra)})"


# -- calibration ----------------------------------------------------------------------------------------

def layout_of(cfg, devices: int | None = None) -> dict:
    """A config's own layout as planner overrides (a ``-1`` axis filled from ``devices``, as a run does:
    :func:`jaxpar.mesh.axis_sizes`)."""
    from jaxpar.mesh import axis_sizes

    par = cfg.parallel
    if devices is None and -1 in (getattr(par, a) for a in AXES):
        raise ConfigError("a parallel.* axis is -1: name the device count to plan for")
    sizes = axis_sizes(par, devices if devices is not None else math.prod(getattr(par, a) for a in AXES))
    ov = {**{f"parallel.{a}": v for a, v in sizes.items()}, "parallel.zero": par.zero, "model.remat": cfg.model.remat,
          "parallel.microbatches": par.microbatches, "parallel.megatron_sp": par.megatron_sp,
          "train.grad_accum": cfg.train.grad_accum}
    if sizes["pipe"] > 1:
        ov.update({"parallel.pipeline_schedule": par.pipeline_schedule,
                   "parallel.pipeline_repeats": par.pipeline_repeats})
        if par.pipeline_schedule != "gpipe":
            ov["parallel.stage_remat"] = par.stage_remat
    if sizes["seq"] > 1:
        ov["parallel.seq_attention"] = par.seq_attention
    return ov


def read_run(run_dir: str | Path) -> tuple:
    """(config, median measured step time, compiled collectives) of a run directory."""
    from jaxpar.config import load_config

    d = Path(run_dir)
    for f in ("config.yaml", "metrics.jsonl", "compile_report.json"):
        if not (d / f).is_file():
            raise ConfigError(f"--calibrate {run_dir}: no {f} there (a train.py run directory has config.yaml, "
                              "metrics.jsonl and compile_report.json)")
    cfg = load_config(d / "config.yaml")
    times = [r["step_time"] for r in map(json.loads, (d / "metrics.jsonl").read_text().splitlines())
             if r.get("step_time")]
    if len(times) < 2:
        raise ConfigError(f"--calibrate {run_dir}: metrics.jsonl has {len(times)} timed steps; run a few more")
    report = json.loads((d / "compile_report.json").read_text())
    return cfg, statistics.median(times[1:]), report.get("collectives", {})


def calibrate(run_dirs: list, cluster, platform: str, planner_cls):
    """``cluster`` fitted to the runs' measured step times: each run's layout estimated on its own mesh
    (the compiled collectives' wire bytes in place of the modelled ones, scaled by the model's exposed
    share), then :func:`jaxpar.steptime.fit`; ``planner_cls`` is :class:`jaxpar.plan.Planner` (passed: this
    module is imported by it). Returns (fitted cluster, lines to print)."""
    import dataclasses

    from jaxpar import comm
    from jaxpar.steptime import bandwidth, fit

    samples, lines = [], []
    for d in run_dirs:
        cfg, measured, collectives = read_run(d)
        par = cfg.parallel
        ov = layout_of(cfg)
        sizes = {a: ov[f"parallel.{a}"] for a in AXES}
        n = math.prod(sizes.values())
        hw = dataclasses.replace(cluster, per_node=min(cluster.per_node, n))
        planner = planner_cls(dataclasses.replace(cfg, parallel=type(par)(stage_layers=par.stage_layers)), hw,
                              max(1, n // hw.per_node), platform=platform)
        est = planner.estimate(ov)
        terms = dict(est.budget)
        got: dict[str, float] = {}
        for kind in comm.measured(collectives).values():
            for label, b in kind.items():
                got[label] = got.get(label, 0.0) + b
        for label, b in got.items():  # the model's exposed time of a label scaled to the compiled bytes
            key, model_b = f"comm {label}", est.comm.get(label, 0.0)
            gbs, _ = bandwidth(hw, label, sizes, planner.nodes)
            terms[key] = terms.get(key, 0.0) * b / model_b if model_b else b / (gbs * 1e9)
        terms["step"] = sum(v for k, v in terms.items() if k != "step")
        samples.append((terms, measured))
        lines.append(f"  {d}: {describe(ov)}: measured {measured:.3f} s, modelled {terms['step']:.3f} s at the "
                     f"{cluster.name} defaults")
    fitted = fit(samples, cluster)
    lines.append(f"fitted: efficiency {fitted.efficiency:.3g}, HBM {fitted.hbm_gbs:.3g} GB/s, links "
                 f"{fitted.intra_gbs:.3g} / {fitted.inter_gbs:.3g} GB/s (inside / across nodes)")
    return fitted, lines
