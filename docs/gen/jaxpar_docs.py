"""The generated parts of the documentation: tables and figures computed from jaxpar itself.

Every number on the concepts pages comes from here: a tiny Llama-style model is compiled for each
layout on 8 simulated XLA:CPU devices (``Trainer.compile()``), its collectives read from the optimised
HLO (``jaxpar.hlo.collectives``) beside the analytic model (``jaxpar.comm.traffic`` / ``summarize``),
its weights' placement read from the trainer's shardings, and its memory from ``memory_analysis()``.
The key reference is ``jaxpar.config.config_table()``, the CLI reference the ``--help`` of each entry
point, the layout advice ``python -m jaxpar.plan``'s output. A page asks for a part with a marker on a
line of its own, ``<!-- gen: NAME ARG -->`` (see :data:`GENERATORS`); ``hooks.py`` replaces it at
build time, so a change of behaviour changes the pages, and a failing generator fails the build.

Figures are PNG bytes; the hook adds them to the site as generated files (nothing is written into
``docs/``). Everything is cached per process: ``mkdocs serve`` recompiles nothing on a page edit.

Long by design: one module holds every generated part of the site (the layouts, the tables, the figures, the
commands and the marker registry), so that a page's marker and what it renders are read in one place.
"""

from __future__ import annotations

import functools
import io
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEVICES = 8
# what the tests set (tests/conftest.py): 8 simulated devices, XLA:CPU's backend optimisation and its MLIR fusion
# emitters off (the HLO passes, and with them the collectives and buffer sizes, are unchanged)
ENV = {"JAX_NUM_CPU_DEVICES": str(DEVICES), "JAX_PLATFORMS": "cpu",
       "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                    "--xla_cpu_use_fusion_emitters=false"}

# The model of every concepts page: Llama-style, 2 layers, d_model 64, 8 heads, MLP 128, vocabulary 256,
# 32-token sequences, 16 sequences per step, float32.
TINY = {"model.style": "llama", "model.n_layers": 2, "model.d_model": 64, "model.n_heads": 8, "model.n_kv_heads": 8,
        "model.d_ff": 128, "model.vocab_size": 256, "model.seq_len": 32, "train.batch_size": 16}
MOE = {"model.arch": "moe", "moe.n_experts": 4, "moe.top_k": 2}
LAYOUTS: dict[str, dict] = {
    "data": {"parallel.data": 8},
    "zero1": {"parallel.data": 8, "parallel.zero": 1},
    "zero3": {"parallel.data": 8, "parallel.zero": 3},
    "tensor": {"parallel.data": 2, "parallel.tensor": 4},
    "megatron_sp": {"parallel.data": 2, "parallel.tensor": 4, "parallel.megatron_sp": True},
    "gpipe": {"parallel.data": 4, "parallel.pipe": 2, "parallel.microbatches": 4, "model.n_layers": 4},
    "1f1b": {"parallel.data": 4, "parallel.pipe": 2, "parallel.microbatches": 4, "model.n_layers": 4,
             "parallel.pipeline_schedule": "1f1b"},
    "expert": {"parallel.data": 2, "parallel.expert": 4, **MOE},
    "expert_tensor": {"parallel.data": 2, "parallel.expert": 2, "parallel.tensor": 2, **MOE},
    "all_gather": {"parallel.data": 2, "parallel.seq": 4, "parallel.seq_attention": "all_gather"},
    "ring": {"parallel.data": 2, "parallel.seq": 4, "parallel.seq_attention": "ring"},
    "ulysses": {"parallel.data": 2, "parallel.seq": 4, "parallel.seq_attention": "ulysses"},
    "3d": {"parallel.data": 2, "parallel.pipe": 2, "parallel.tensor": 2, "parallel.microbatches": 4,
           "model.n_layers": 4, "parallel.zero": 1},
}
MIN_BYTES = 1024  # scalars and statistics (the loss, the gradient norm): left out of both sides, as in the tests


def _jax():
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    import jax

    from jaxpar.mesh import request_cpu_devices

    request_cpu_devices(DEVICES)  # raises, naming the count, when JAX has already started with another
    if jax.device_count() < DEVICES:
        raise RuntimeError(f"the docs need {DEVICES} simulated devices; JAX started with {jax.device_count()} "
                           f"(set JAX_NUM_CPU_DEVICES={DEVICES} before JAX starts)")
    return jax


def layout_overrides(name: str) -> dict:
    if name not in LAYOUTS:
        raise KeyError(f"unknown docs layout {name!r}; known: {', '.join(LAYOUTS)}")
    return {**TINY, **LAYOUTS[name]}


def layout_text(name: str) -> str:
    """The layout as train.py overrides (without the model's)."""
    return " ".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in LAYOUTS[name].items())


@functools.lru_cache(maxsize=None)
def trainer(name: str):
    jax = _jax()
    from jaxpar.config import load_config
    from jaxpar.mesh import make_mesh
    from jaxpar.trainer import Trainer

    cfg = load_config(None, layout_overrides(name))
    return Trainer(cfg, mesh=make_mesh(cfg.parallel, jax.devices()[:DEVICES]))


@functools.lru_cache(maxsize=None)
def compiled(name: str) -> dict:
    """``Trainer.compile()``'s report of the layout's train step."""
    return trainer(name).compile()


def _kib(b: float) -> str:
    return f"{b / 1024:,.1f}"


# -- collectives ------------------------------------------------------------------------------------------------

def collective_rows(name: str, traffic=None) -> list[tuple]:
    """``(kind, axes, count, compiled wire bytes, model XLA:CPU, model GPU/TPU, what)`` per (kind, axes):
    the compiled step's collectives (``jaxpar.hlo.collectives`` of ``Trainer.compile()``'s report) and
    ``jaxpar.comm``'s model of them. ``traffic`` replaces ``jaxpar.comm.traffic`` (tests)."""
    from jaxpar import comm, hlo

    t = trainer(name)
    traffic = traffic or comm.traffic
    compiled(name)  # Trainer.compile(): the program hlo_text() reads
    got = hlo.collectives(t.hlo_text(), t.sizes, min_bytes=MIN_BYTES)
    leaves = comm.leaves_of(t)
    cpu_terms = [x for x in traffic(t.cfg, t.sizes, leaves, platform="cpu") if x.result_bytes >= MIN_BYTES]
    gpu = comm.summarize(traffic(t.cfg, t.sizes, leaves, platform="gpu"))
    cpu = comm.summarize(cpu_terms)
    rows = []
    for (kind, axes), (measured, model) in comm.compare(cpu, comm.measured(got)).items():
        what: list[str] = []
        for x in cpu_terms:
            if (x.kind, x.label) == (kind, axes) and x.what not in what:
                what.append(x.what)
        count = got.get(kind, {}).get("by_axes", {}).get(axes, {}).get("count", 0)
        rows.append((kind, axes, count, measured, model, gpu.get(kind, {}).get(axes, 0.0), "; ".join(what)))
    return rows


def collectives_table(name: str, traffic=None) -> str:
    rows = collective_rows(name, traffic)
    out = ["| collective | mesh axes | count | compiled KiB | model KiB (XLA:CPU) | model KiB (GPU/TPU) | what |",
           "|---|---|---:|---:|---:|---:|---|"]
    for kind, axes, count, measured, model, gpu, what in rows:
        out.append(f"| {kind} | `{axes}` | {count} | {_kib(measured)} | {_kib(model)} | {_kib(gpu)} | {what} |")
    tot = [sum(r[i] for r in rows) for i in (3, 4, 5)]
    out.append(f"| **total** | | | **{_kib(tot[0])}** | **{_kib(tot[1])}** | **{_kib(tot[2])}** | |")
    return (f"Collectives of one train step, per device, in wire bytes (`{layout_text(name)}`; collectives under "
            f"{MIN_BYTES} bytes left out):\n\n" + "\n".join(out))


# -- placement and memory ---------------------------------------------------------------------------------------

def _path_name(path) -> str:
    parts = []
    for p in path:
        k = getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))
        parts.append(str(k))
    return "/".join(parts)


def _spec_text(spec, ndim: int) -> str:
    dims = list(spec) + [None] * (ndim - len(spec))
    show = lambda e: "-" if e is None else e if isinstance(e, str) else "+".join(e)  # noqa: E731
    return "(" + ", ".join(show(e) for e in dims) + ")"


def placement_table(name: str) -> str:
    """Each parameter: its global shape, logical names, the mesh axes of each dim for the parameter and for
    its AdamW moments, and the shape one device holds."""
    jax = _jax()
    t = trainer(name)
    params = t.abstract_state["params"]
    names = jax.tree.leaves(t.adapter.axes, is_leaf=lambda x: isinstance(x, tuple))
    opt_specs = jax.tree.leaves(t.grad_shardings)
    out = ["| parameter | shape | logical names | parameter split | AdamW moments split | per device |",
           "|---|---|---|---|---|---|"]
    for (path, a), logical, opt in zip(jax.tree_util.tree_leaves_with_path(params), names, opt_specs):
        shard = a.sharding.shard_shape(a.shape)
        out.append(f"| `{_path_name(path)}` | {tuple(a.shape)} | {tuple(logical)} | "
                   f"{_spec_text(a.sharding.spec, len(a.shape))} | {_spec_text(opt.spec, len(a.shape))} | "
                   f"{tuple(shard)} |")
    return (f"Where each weight lives (`{layout_text(name)}`; a split names the mesh axes of each dim, `-`: whole "
            "on every device; the layer stack is the leading `layers` dim):\n\n" + "\n".join(out))


def memory_rows(name: str) -> list[tuple[str, int]]:
    t = trainer(name)
    mem = compiled(name)["memory"]
    batch = sum(math.prod(b.sharding.shard_shape(b.shape)) * b.dtype.itemsize for b in t.abstract_batch.values())
    total = mem["argument_size"] + mem["output_size"] + mem["temp_size"] - mem["alias_size"]
    return [("parameters (float32)", t.per_device_bytes("params")),
            ("AdamW state (two moments and the count)", t.per_device_bytes("opt")),
            ("the step's batch (tokens and targets)", batch),
            ("temporaries: activations, gradients, collective buffers (compiled)", mem["temp_size"]),
            ("total: arguments + outputs + temporaries - aliased (compiled)", total)]


def memory_table(name: str) -> str:
    out = ["| part | KiB per device |", "|---|---:|"]
    out += [f"| {part} | {_kib(b)} |" for part, b in memory_rows(name)]
    return f"Memory per device (`{layout_text(name)}`; `memory_analysis()` of the compiled step):\n\n" + "\n".join(out)


def memory_compare(*names: str) -> str:
    """One memory table with a column per layout."""
    rows = {n: memory_rows(n) for n in names}
    parts = [p for p, _ in rows[names[0]]]
    out = ["| KiB per device | " + " | ".join(f"`{layout_text(n)}`" for n in names) + " |",
           "|---|" + "---:|" * len(names)]
    for i, part in enumerate(parts):
        out.append(f"| {part} | " + " | ".join(_kib(rows[n][i][1]) for n in names) + " |")
    return ("Memory per device (`memory_analysis()` of each compiled step; the state from the trainer's shardings):\n\n"
            + "\n".join(out))


def traffic_compare(*names: str) -> str:
    """Compiled wire bytes per device per step by mesh axes, one column per layout."""
    per = {}
    for n in names:
        by: dict = {}
        for kind, axes, _, measured, *_ in collective_rows(n):
            by[f"{kind} over `{axes}`"] = by.get(f"{kind} over `{axes}`", 0.0) + measured
        per[n] = by
    keys = sorted({k for by in per.values() for k in by})
    out = ["| KiB per device per step (compiled) | " + " | ".join(f"`{layout_text(n)}`" for n in names) + " |",
           "|---|" + "---:|" * len(names)]
    for k in keys:
        out.append(f"| {k} | " + " | ".join(_kib(per[n].get(k, 0.0)) if per[n].get(k) else "" for n in names) + " |")
    out.append("| **total** | " + " | ".join(f"**{_kib(sum(per[n].values()))}**" for n in names) + " |")
    return "\n".join(out)


PAGES = {"data": "data", "zero1": "data", "zero3": "data", "tensor": "tensor", "megatron_sp": "tensor",
         "gpipe": "pipeline", "1f1b": "pipeline", "expert": "expert", "expert_tensor": "expert",
         "all_gather": "sequence", "ring": "sequence", "ulysses": "sequence", "3d": "combining"}


def layouts_table() -> str:
    """Every layout of the concepts pages: its page, the compiled step's collective bytes and memory."""
    out = ["| layout | page | collectives, KiB per device per step (compiled / model) | memory, KiB per device |",
           "|---|---|---:|---:|"]
    for n in LAYOUTS:
        rows = collective_rows(n)
        sent, model = sum(r[3] for r in rows), sum(r[4] for r in rows)
        out.append(f"| `{layout_text(n)}` | [{PAGES[n]}]({PAGES[n]}.md) | {_kib(sent)} / {_kib(model)} | "
                   f"{_kib(memory_rows(n)[-1][1])} |")
    return "\n".join(out)


# -- figures ----------------------------------------------------------------------------------------------------

def _png(fig) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


def mesh_figure(name: str) -> bytes:
    """The 8 devices of the layout's mesh, one box each, labelled with its device id and its coordinate on
    every axis of size > 1; the last such axis runs along a row, the others down the rows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    t = trainer(name)
    axes = [a for a in t.mesh.axis_names if t.sizes[a] > 1]
    devs = np.asarray(t.mesh.devices).reshape([t.sizes[a] for a in axes] or [1])
    cols = t.sizes[axes[-1]] if axes else 1
    grid = devs.reshape(-1, cols)
    rows = grid.shape[0]
    fig, ax = plt.subplots(figsize=(1.5 * cols + 0.6, 0.9 * rows + 0.8))
    cmap = plt.get_cmap("Pastel1")
    for r in range(rows):
        for c in range(cols):
            coord = np.unravel_index(r * cols + c, devs.shape)
            label = " ".join(f"{a[0]}{i}" for a, i in zip(axes, coord))
            ax.add_patch(plt.Rectangle((c, rows - 1 - r), 0.92, 0.85, facecolor=cmap(int(coord[0]) % 9),
                                       edgecolor="black", linewidth=0.6))
            ax.text(c + 0.46, rows - 1 - r + 0.42, f"device {grid[r, c].id}\n{label}", ha="center", va="center",
                    fontsize=8)
    ax.set_xlim(-0.05, cols)
    ax.set_ylim(-0.05, rows)
    ax.axis("off")
    ax.set_title(" x ".join(f"{a}={t.sizes[a]}" for a in axes) + f"  (row: {axes[-1] if axes else '-'})",
                 fontsize=9)
    fig.tight_layout()
    return _png(fig)


def placement_figure(name: str, count: int = 3) -> bytes:
    """The layout's ``count`` largest weights, each drawn as a matrix (its leading dims down, the others
    across), every element coloured by the set of devices that hold it: one colour per distinct piece."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.patches import Patch

    jax = _jax()
    t = trainer(name)
    names = jax.tree.leaves(t.adapter.axes, is_leaf=lambda x: isinstance(x, tuple))
    leaves = [(_path_name(p), a, n) for (p, a), n in
              zip(jax.tree_util.tree_leaves_with_path(t.abstract_state["params"]), names)]
    leaves = sorted(leaves, key=lambda x: -math.prod(x[1].shape))[:count]
    fig, axs = plt.subplots(1, len(leaves), figsize=(4.2 * len(leaves), 4.6))
    cmap = plt.get_cmap("tab20")
    for ax, (path, a, logical) in zip(np.atleast_1d(axs), leaves):
        owner = np.zeros(a.shape, dtype=np.int64)  # a bit per device holding the element
        for dev, index in a.sharding.devices_indices_map(tuple(a.shape)).items():
            owner[index] |= 1 << dev.id
        k = max(1, len(a.shape) // 2)
        grid = owner.reshape(math.prod(a.shape[:k]), -1)
        groups, codes = np.unique(grid, return_inverse=True)
        ax.imshow(codes.reshape(grid.shape), cmap=cmap, vmin=0, vmax=19, aspect="auto", interpolation="nearest")
        ax.set_title(f"{path}\n{tuple(a.shape)}", fontsize=8)
        ax.set_ylabel(" x ".join(str(n) for n in logical[:k]), fontsize=7)
        ax.set_xlabel(" x ".join(str(n) for n in logical[k:]), fontsize=7)
        ax.set_xticks([])
        ax.set_yticks([])
        held = [[d for d in range(DEVICES) if g >> d & 1] for g in groups]
        label = lambda ds: "every device" if len(ds) == DEVICES else "devices " + ",".join(map(str, ds))  # noqa
        shown = [Patch(facecolor=cmap(i % 20), label=label(ds)) for i, ds in enumerate(held)][:8]
        ax.legend(handles=shown, fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.08), ncol=2,
                  title=None if len(held) <= 8 else f"(8 of {len(held)} pieces shown)", title_fontsize=6)
    fig.suptitle(f"which devices hold each element ({layout_text(name)})", fontsize=9)
    fig.tight_layout()
    return _png(fig)


def schedule_figure(kind: str, stages: int, microbatches: int, repeats: int) -> bytes:
    """``jaxpar.plots.plot_schedule``'s chart (what a run writes as pipeline_schedule.png)."""
    import tempfile

    from jaxpar.plots import plot_schedule

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "s.png"
        plot_schedule(stages, microbatches, repeats, path, kind=kind)
        return path.read_bytes()


def bubble_table(stages: int) -> str:
    from jaxpar.layers.pipeline import bubble_fraction

    ms = [stages, 2 * stages, 4 * stages, 8 * stages]
    out = ["| R (repeats) | " + " | ".join(f"M = {m}" for m in ms) + " |", "|---|" + "---:|" * len(ms)]
    for r in (1, 2, 4):
        out.append(f"| {r} | " + " | ".join(f"{100 * bubble_fraction(stages, m, r):.1f}%" for m in ms) + " |")
    return (f"The bubble, (S-1)/(M R+S-1), at S = {stages} stages (`jaxpar.layers.pipeline.bubble_fraction`, what "
            "the training log prints):\n\n" + "\n".join(out))


# -- commands ---------------------------------------------------------------------------------------------------

def _run_now(args: tuple[str, ...]) -> str:
    env = {**os.environ, **ENV, "COLUMNS": "120"}
    p = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"python {' '.join(args)} failed ({p.returncode}): {p.stderr[-2000:]}")
    return p.stdout


_POOL = ThreadPoolExecutor(max_workers=2)
_RUNS: dict[tuple[str, ...], Future] = {}
_LOCK = threading.Lock()


def _submit(key: tuple[str, ...]) -> Future:
    with _LOCK:
        if key not in _RUNS:
            _RUNS[key] = _POOL.submit(_run_now, key)
        return _RUNS[key]


def _run(args: list[str]) -> str:
    """The stdout of ``python ARGS`` in the repository (run once per process, in a thread: see :func:`prefetch`)."""
    return _submit(tuple(args)).result()


ENTRY_POINTS = ("train.py", "jaxpar.plan", "jaxpar.compile", "jaxpar.generate", "jaxpar.hf", "jaxpar.plots",
                "jaxpar.data.prepare")


def command(entry: str) -> list[str]:
    return [entry] if entry.endswith(".py") else ["-m", entry]


def cli_help(entry: str) -> str:
    """``python ENTRY --help``, as printed."""
    if entry not in ENTRY_POINTS:
        raise KeyError(f"unknown entry point {entry!r}; known: {', '.join(ENTRY_POINTS)}")
    return _run([*command(entry), "--help"])


# The planner's command line. `python -m jaxpar.plan` grows `--explain` (a reasoned account of its choice):
# when it lands, add it here and every planner block of the docs carries it.
PLAN_FLAGS: tuple[str, ...] = ("--explain",)


def plan_output(args: str) -> str:
    """``python -m jaxpar.plan ARGS`` (with :data:`PLAN_FLAGS`), as printed."""
    return _run(["-m", "jaxpar.plan", *args.split(), *PLAN_FLAGS])


def plan_block(args: str) -> str:
    shown = " ".join(["python -m jaxpar.plan", args, *PLAN_FLAGS])
    return f"```console\n$ {shown}\n{plan_output(args).rstrip()}\n```"


def plan_first(args: str) -> str:
    """The planner's first choice for ``ARGS``: the layout of its table's row 1."""
    for line in plan_output(args).splitlines():
        if line.split()[:1] == ["1"] and "%" in line:
            return line.rsplit("%", 1)[1].strip()
    raise RuntimeError(f"python -m jaxpar.plan {args}: no ranked layout in its output")


# The rules of thumb of the classic tutorials (/work/shared/STRATEGY_GUIDE.md) and a real model each tests.
RULES = (
    ("If the model fits on one device, use data parallelism first.", "GPT-2 124M on one node of 8 H100s",
     "--config configs/gpt2_124m.yaml --cluster h100x8 --nodes 1 --top 5"),
    ("A layer too large (hidden sizes around 10k): add tensor parallelism; too many layers (around 100): add "
     "pipeline parallelism.", "GPT-3 175B (d_model 12288, 96 layers) on 128 nodes of 8 H100s",
     "--config configs/gpt3_175b.yaml --cluster h100x8 --nodes 128 --top 5"),
    ("Sequences beyond about 8k tokens: add sequence parallelism before attention memory explodes.",
     "Llama 3.1 8B at 32k tokens on one node of 8 H100s",
     "--config configs/llama3_8b.yaml --cluster h100x8 --nodes 1 --top 5 model.seq_len=32768"),
    ("An MoE architecture: expert parallelism is required, with tensor and data parallelism around it.",
     "Mixtral 8x7B on 32 nodes of 8 H100s", "--config configs/mixtral_8x7b.yaml --cluster h100x8 --nodes 32 --top 5"),
    ("(no rule: a mid-sized dense model on a few nodes)", "a Llama-style 1B model on 4 nodes of 8 H200s",
     "--config configs/llama_1b.yaml --cluster h200x8 --nodes 4 --top 5"),
)


def rules_table() -> str:
    out = ["| rule of thumb | case | `python -m jaxpar.plan`'s first choice |", "|---|---|---|"]
    out += [f"| {rule} | {case} | `{plan_first(args)}` |" for rule, case, args in RULES]
    return "\n".join(out)


def rules_outputs() -> str:
    return "\n\n".join(f"### {case}\n\nThe rule: {rule}\n\n{plan_block(args)}" for rule, case, args in RULES)


def keys_table() -> str:
    from jaxpar.config import config_table

    return config_table()


# -- the markers ------------------------------------------------------------------------------------------------

GENERATORS = {
    "collectives": lambda name: collectives_table(name),
    "placement": lambda name: placement_table(name),
    "memory": lambda name: memory_table(name),
    "memory-compare": lambda names: memory_compare(*names.split(",")),
    "traffic-compare": lambda names: traffic_compare(*names.split(",")),
    "bubble": lambda s: bubble_table(int(s)),
    "layouts": lambda _="": layouts_table(),
    "help": lambda entry: f"```text\n{cli_help(entry).rstrip()}\n```",
    "plan": plan_block,
    "rules": lambda _="": rules_table(),
    "rules-outputs": lambda _="": rules_outputs(),
    "keys": lambda _="": keys_table(),
    "model": lambda _="": ("The model of these tables: " + ", ".join(f"`{k}={v}`" for k, v in TINY.items())
                           + " (float32), compiled for 8 simulated XLA:CPU devices."),
}
# figures: the file name under gen/ -> the PNG
FIGURES = {
    **{f"mesh-{n}.png": functools.partial(mesh_figure, n) for n in LAYOUTS},
    **{f"placement-{n}.png": functools.partial(placement_figure, n) for n in LAYOUTS},
    "schedule-gpipe.png": functools.partial(schedule_figure, "gpipe", 4, 8, 1),
    "schedule-circular.png": functools.partial(schedule_figure, "gpipe", 4, 8, 2),
    "schedule-1f1b.png": functools.partial(schedule_figure, "1f1b", 4, 8, 1),
    "schedule-interleaved.png": functools.partial(schedule_figure, "1f1b", 4, 8, 2),
    "schedule-zb_h1.png": functools.partial(schedule_figure, "zb_h1", 4, 8, 1),
    "schedule-zb_v.png": functools.partial(schedule_figure, "zb_v", 4, 8, 1),
}


def prefetch() -> None:
    """Start every command the pages show (``--help``, the planner) in the background, so that they run
    while the main thread compiles the layouts."""
    for _, _, args in RULES:
        _submit(("-m", "jaxpar.plan", *args.split(), *PLAN_FLAGS))
    for entry in ENTRY_POINTS:
        _submit((*command(entry), "--help"))


def render(marker: str) -> str:
    """The markdown of one ``<!-- gen: NAME ARG -->`` marker's ``NAME ARG``."""
    name, _, arg = marker.strip().partition(" ")
    if name not in GENERATORS:
        raise KeyError(f"unknown docs generator {name!r}; known: {', '.join(GENERATORS)}")
    return GENERATORS[name](arg.strip()) if arg.strip() else GENERATORS[name]()
