"""``python -m jaxpar.plan``: choose the parallel layout of a config for a cluster, from an analytic model.

    python -m jaxpar.plan --config configs/llama_1b.yaml --cluster h200x8 --nodes 4
    python -m jaxpar.plan --config configs/default.yaml --cluster cpu --nodes 1 --check 3
    python -m jaxpar.plan --config configs/gpt3_175b.yaml --cluster h100x8 --nodes 128 --explain
    python -m jaxpar.plan --config configs/default.yaml --calibrate runs/default

The search space: every mesh of the cluster's devices over ``data x pipe x expert x seq x tensor``
(sizes dividing the device count), ZeRO 0/1/3, every remat policy, Megatron-SP, gradient accumulation
(the fewest microsteps that fit), with ``seq`` each context-parallel attention (ring, Ulysses, the K/V
all-gather) and, with a pipeline, GPipe or 1F1B, interleaved / circular repeats R and
microbatch counts M from S up to one sequence per microbatch (:func:`options`). A first pass tries a few
options on every mesh; the fastest meshes are then searched whole (:meth:`Planner.plan`). Each layout is
checked with train.py's own checks (divisibility of heads, layers, batch, ...), estimated, dropped when
it does not fit the device memory, and ranked by estimated step time. The model, per device:

* **state** (exact): each parameter's bytes over the mesh axes its ``params`` / ``opt`` layout splits
  it on (the rules of :mod:`jaxpar.partitioning`, the same as a run's), AdamW's two float32 moments;
  the gradient as the backward produces it (ZeRO-3: already reduce-scattered, layer by layer; XLA:CPU
  reduces and slices each layer's inside the backward's loop, under ZeRO-1 too: the optimizer's shard;
  a pipeline's whole, summed over its microbatches in its loop), and with ``grad_accum > 1`` their running
  sum in the optimizer's layout (ZeRO-3: and a microstep's embedding / head gradient, whole).
* **activations**: per layer and token, what the backward keeps. ``full`` remat (and ``offload``, on
  the device): the block input (``d``; ``d / t`` under Megatron-SP) in every layer, plus one layer's
  working set and its weights in the compute layout (its gradient before the reduction, under ZeRO-3 the
  gathered copy, in the sorted dispatch's exchange rounds the experts' gradient summed over rounds and its
  zeros, in the compute dtype);
  ``save_dots``, ``save_dots_except_mlp``, ``save_qkv_proj``: the input and the named matmul outputs the policy saves
  that the backward reads (``qkv_proj (H + 2 KV) hd / t``, ``attention H hd / t``, ``mlp_up
  (2|1) ff / t``; ``out_proj`` and ``mlp_down`` feed a residual add, whose backward does not read
  them; the exchange rounds of a sorted dispatch over ``expert`` run again in their backward, so they keep
  only their sorted rows, ``k d``, when ``mlp_down`` is kept); ``none``: the working set in every
  layer, and the layers' weights as their matmuls took them outside a pipeline (cast or annotated: a
  copy of the stack in the compute dtype):
  ``5 d`` (norm outputs, residuals, projections; ``/ t`` under Megatron-SP) + the QKV, rotated q/k
  and attention outputs ``(4 H + 3 KV) hd / t`` + the MLP's ``(2|3) ff / t`` hidden (MoE:
  its rows per token: ``top_k x capacity_factor`` capacity slots, ``n_experts`` for a dropless capacity
  dispatch, ``top_k`` sorted, ``top_k x capacity_factor`` in an exchange round; and ``moe.shared_experts``,
  one dense MLP of ``shared_experts x moe.d_ff`` on every token, kept as a dense layer's) +
  the attention probabilities ``2 H T_kv / t`` in float32 when the kernel materialises them
  (``xla``; flash kernels do not). The layer whose backward runs also holds its MLP hidden's
  gradient and, under tensor parallelism, ``2 d`` of partial sums beside their reduced results; in a
  sorted dispatch's exchange rounds, their backward's rows and the tiles' hidden as counted from XLA's
  live ranges (:meth:`Planner._exchange_working_set`).
  Tokens per device: ``B / grad_accum / (data x expert) x T / seq``;
  a GPipe pipeline keeps ``(M R + S - 1) / (M R)`` times its stage's share and its buffer of all
  microbatches with its gradient; 1F1B keeps the stage
  inputs of ``min(M, 2S - 1)`` microbatches (interleaved: ``min(M R, (R + 1) S - 1)`` chunk inputs; with
  ``parallel.stage_remat=false`` their residuals, held as traced: the compute dtype, with ``out_proj``'s
  output under a policy that keeps it) and one
  microbatch's stage (chunk) activations while its backward runs, and the first stage's input
  gradients of ``C`` microbatches (:func:`jaxpar.layers.pipeline.embed_chunk`: all M up to 2RS);
  a MoE model's dense first layers (``moe.first_dense``, on the first stage) keep one microbatch's
  activations under 1F1B (the larger of theirs and the stage's) and every iteration's under GPipe.
  Plus the loss chunk's float32 logits and their gradient (2 x ``chunk x vocab / t``; 3 x with a padded
  vocabulary); a pipeline's chunks are at most one microbatch. The loss runs between the layers' forward
  and backward: the total counts the larger of the logits and one layer's working set, not both (1F1B: both).
* **communication**: :func:`jaxpar.comm.traffic` (the analytic model that tests hold to the compiled
  HLO), per mesh-axis group; a group whose devices span nodes (the mesh fills the innermost axis,
  ``tensor``, first) moves at the inter-node bandwidth, else the intra-node one.
* **time**: :func:`jaxpar.steptime.step_time`, term by term: the model flops, the recompute (``full``: one
  more forward; the other policies the share of a layer's matmuls that produces what they drop,
  :func:`_recomputed`; 1F1B: one more, its stage recompute), the pipeline's bubble as its lock-step
  iterations run it, elementwise work at the HBM bandwidth, and each collective's exposed part (overlaps
  of gradient reductions, ZeRO-3 gathers, 1F1B's shifts and the ring's hops). ``--explain`` prints the
  budget of the first choice and the runner-up; ``--calibrate RUN_DIR`` fits the cluster to a real run.

``--check K`` compiles the train step of the K best layouts ahead of time on simulated CPU devices
(:mod:`jaxpar.compile`) and prints predicted against compiled memory and collective bytes, both for
XLA:CPU (``platform="cpu"``): float32 working sets, a layer's kept tensors at about 5 bytes per element
when the compute dtype is bfloat16 (stored, and for part of the layers converted), the reference
attention's three (short sequences) or four float32 ``[T, T]`` tensors per head, its collective passes.

Long by design: each quantity's formula sits beside the enumeration, the ranking and the CLI that use
it, so that the documented model and the code are read together.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import shlex
import sys
from dataclasses import dataclass, field
from types import SimpleNamespace

from jaxpar.cli import COUNT, ArgumentParser, command, number
from jaxpar.config import Config, ConfigError, ParallelConfig, Range, replaced, validate
from jaxpar.mesh import AXES
from jaxpar.plan_report import describe
from jaxpar.steptime import Hardware

GIB = 2**30
EFFICIENCY = Range(0, 1, lo_open=True)  # the fraction of peak the matmuls reach


CLUSTERS = {c.name: c for c in (
    # NVLink 4 (900 GB/s both ways), 400 Gb/s InfiniBand per GPU, HBM3 3.35 TB/s, PCIe 5 to the host
    # tile_us: the tiled MoE grouped matmul per tile, forward and backward, measured on one H200 (128 experts,
    # d_model 2048, expert width 768: 55.8 ms in 576 tiles of 128 rows, 43.6 ms in 320 of 256; the fixed part)
    Hardware("h100x8", 8, 80, 989, 360, 45, hbm_gbs=3350, host_gbs=50, tile_us=58, cudnn_head_dim=256),
    Hardware("h200x8", 8, 141, 989, 360, 45, hbm_gbs=4800, host_gbs=50, tile_us=58, cudnn_head_dim=256),
    # NVLink 3, 200 Gb/s HDR per GPU, HBM2e 2.0 TB/s, PCIe 4 (a tile's kernels: as on Hopper, not measured)
    Hardware("a100x8", 8, 80, 312, 235, 22, hbm_gbs=2039, host_gbs=25, tile_us=58),
    # per host of 4 chips: ICI inside the slice, DCN between
    Hardware("tpu-v4", 4, 32, 275, 150, 6.25, hbm_gbs=1200, intra_us=5, inter_us=50),
    Hardware("tpu-v5e", 4, 16, 197, 100, 6.25, hbm_gbs=819, intra_us=5, inter_us=50),
    Hardware("tpu-v5p", 4, 95, 459, 300, 6.25, hbm_gbs=2765, intra_us=5, inter_us=50),
    Hardware("tpu-v6e", 4, 32, 918, 224, 6.25, hbm_gbs=1640, intra_us=5, inter_us=50),
    # simulated devices on one host (for --check and --calibrate's CPU runs)
    Hardware("cpu", 8, 3, 0.05, 5, 5, hbm_gbs=20, host_gbs=5, intra_us=50, inter_us=50, efficiency=0.5),
)}
Cluster = Hardware  # the name the planner's callers know


@dataclass
class Estimate:
    overrides: dict
    memory: dict = field(default_factory=dict)      # bytes per device by part, and "total"
    comm: dict = field(default_factory=dict)        # {axes label: wire bytes per device per step}
    budget: dict = field(default_factory=dict)      # {term: seconds per step} (jaxpar.steptime), "step" their sum
    comm_seconds: float = 0.0
    compute_seconds: float = 0.0
    bubble: float = 1.0
    step_seconds: float = 0.0
    mfu: float = 0.0

    def args(self) -> list[str]:
        return [f"{k}={v}" for k, v in self.overrides.items()]


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def _factorizations(n: int, k: int):
    """Every ``k``-tuple of sizes whose product is ``n``, in lexicographic order."""
    if k == 1:
        yield (n,)
        return
    for d in _divisors(n):
        for rest in _factorizations(n // d, k - 1):
            yield (d, *rest)


@functools.lru_cache(maxsize=4096)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, ascending (the planner's microbatch and accumulation counts: a scan of every
    count up to the batch was a sixth of a large plan's time)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(small + [n // d for d in reversed(small) if d * d != n])


def meshes(n: int, moe: bool = False):
    """Every ``parallel.*`` axis size set for ``n`` devices (``expert`` only for a MoE model)."""
    for sizes in _factorizations(n, len(AXES)):
        if sizes[AXES.index("expert")] > 1 and not moe:
            continue
        yield dict(zip(AXES, sizes))


REMATS = ("none", "save_dots", "save_dots_except_mlp", "save_qkv_proj", "full", "offload")
# The [tokens, d_ff] tensors a layer's MLP (or an expert, per routed row) keeps for its backward without remat,
# by model.mlp: the up projection's output (gate and up), every intermediate of the nonlinearity and its output
# (the down projection's input), as JAX saves them (``saved_residuals`` of a block:
# tests/test_plan.py::test_none_keeps_every_intermediate_of_the_nonlinearity); the remat policies keep only
# named matmul outputs
# the keys a layout sets (:meth:`Planner.config`): the range checks of every other key pass once for the plan
PLANNED_KEYS = frozenset([("parallel", f.name) for f in dataclasses.fields(ParallelConfig)]
                         + [("train", "grad_accum"), ("model", "remat")])
NONE_KEPT_FF = {"gelu": 6, "swiglu": 6, "geglu": 8, "clamped_swiglu": 9}


SCHEDULES = ("gpipe", "1f1b", "zb_h1", "zb_v")


def options(sizes: dict, batch: int, n_layers: int, platform: str = "gpu", phase: str = "all",
            schedules: tuple = ("gpipe", "1f1b")):
    """The option sets of one mesh, each a list of overrides with ``train.grad_accum`` (k) left to the caller's
    search: ``parallel.zero`` 0/1/3 (1 and 3 with an axis that splits the batch), every ``model.remat`` policy
    (``offload`` off CPU), ``parallel.megatron_sp`` with ``tensor``; with a pipeline the GPipe or 1F1B schedule,
    ``pipeline_repeats`` R (divisors of the stage's layers up to 4) and, for each k, the microbatch counts M
    from S up to one sequence per microbatch (S 2^i and the largest). ``phase="first"``: the few a first pass
    over every mesh tries (every ZeRO stage, remat none and full, 1F1B, R = 1 and the largest, the smallest and
    largest M). ``schedules``: the pipeline schedules tried (``zb_h1`` with R = 1, ``zb_v`` with R = 2; the
    schedules other than GPipe with ``parallel.stage_remat`` true and, but in the first phase, false). With
    ``seq`` > 1, each context-parallel attention (``parallel.seq_attention``: ring, ulysses, all_gather) in
    both phases (a model whose heads ``seq`` does not split fails Ulysses' check)."""
    dp = sizes["data"] * sizes["expert"]
    s_ = sizes["pipe"]
    first = phase == "first"
    zeros = (0, 1, 3) if dp * sizes["seq"] > 1 else (0,)
    remats = ("none", "full") if first else tuple(r for r in REMATS if r != "offload" or platform != "cpu")
    sps = (False, True) if sizes["tensor"] > 1 and not first else (False,)
    per_stage = n_layers // s_ if s_ > 1 and n_layers % s_ == 0 else 1
    repeats = (1,) if s_ == 1 else tuple(r for r in (1, 2, 3, 4) if per_stage % r == 0)
    repeats = repeats[:1] + repeats[-1:][: len(repeats) > 1] if first else repeats  # first: 1 and the most
    scheds = ("gpipe",) if s_ == 1 else ((("1f1b",) if "1f1b" in schedules else schedules[:1]) if first
                                         else schedules)
    # the zero-bubble grids: ZB-H1 one chunk per stage, ZB-V two (a V)
    runs = [(sched, r_) for sched in scheds for r_ in
            (repeats if sched in ("gpipe", "1f1b") else (1,) if sched == "zb_h1" else (2,) if per_stage % 2 == 0
             else ())]
    from jaxpar.layers.context_parallel import STRATEGIES

    attns = STRATEGIES if sizes["seq"] > 1 else (None,)
    # a schedule that runs its own backward may keep its forwards' residuals (parallel.stage_remat=false; under
    # remat full each layer's input: the backward runs each layer's forward once, not the stage's and then each
    # layer's again inside it)
    keeps = (True, False) if s_ > 1 and not first else (True,)
    for zero, remat, sp, (sched, r_), attn, keep in itertools.product(zeros, remats, sps, runs, attns, keeps):
        if not keep and sched == "gpipe":
            continue
        base = {**{f"parallel.{a}": v for a, v in sizes.items()}, "parallel.zero": zero, "model.remat": remat,
                "parallel.megatron_sp": sp}
        if attn is not None:
            base["parallel.seq_attention"] = attn
        if s_ > 1:
            base.update({"parallel.pipeline_schedule": sched, "parallel.pipeline_repeats": r_})
        if sched != "gpipe":  # explicit both ways (the default, false, keeps them)
            base["parallel.stage_remat"] = keep

        def micro(k: int, base=base, r_=r_):
            """The microbatch counts of k accumulation microsteps."""
            if s_ == 1:
                return [0]
            rows = batch // k
            ms = [m for m in divisors(rows) if m >= s_ and (rows // m) % dp == 0 and (r_ == 1 or m % s_ == 0)]
            if not ms or first:
                return ms[:1] + ms[-1:][: len(ms) > 1]
            return sorted({ms[0], ms[-1], *(m for m in ms if m % s_ == 0 and (m // s_) & (m // s_ - 1) == 0)})

        yield base, micro


class Planner:
    """Estimates layouts of ``cfg``'s model and batch on ``nodes`` nodes of ``cluster``."""

    def __init__(self, cfg: Config, cluster: Hardware, nodes: int = 1, efficiency: float | None = None,
                 platform: str = "gpu", schedules: tuple = ("gpipe", "1f1b")):
        if efficiency is None:
            efficiency = cluster.efficiency
        if nodes < 1 or efficiency not in EFFICIENCY:
            raise ConfigError(f"Planner(nodes={nodes}, efficiency={efficiency}): nodes >= 1, efficiency in (0, 1]")
        bad = [x for x in schedules if x not in SCHEDULES]
        if bad or not schedules:
            raise ConfigError(f"--schedules {','.join(schedules)}: choose from {', '.join(SCHEDULES)}")
        self.schedules = tuple(schedules)
        self.cluster, self.nodes = cluster.with_(efficiency=efficiency), nodes
        self.cfg = cfg
        self.n = cluster.per_node * nodes
        self.efficiency, self.platform = efficiency, platform
        self._models: dict[int, tuple] = {}
        self._layouts: dict[tuple, tuple[list, dict]] = {}
        self._validated = False

    def config(self, overrides: dict) -> Config:
        """The config with a layout's ``parallel.*`` and ``model.remat`` overrides."""
        par = replaced(self.cfg.parallel, **{k.split(".")[1]: v for k, v in overrides.items()
                                             if k.startswith("parallel.")})
        model = replaced(self.cfg.model, remat=overrides.get("model.remat", self.cfg.model.remat))
        train = replaced(self.cfg.train, grad_accum=overrides.get("train.grad_accum", self.cfg.train.grad_accum))
        return replaced(self.cfg, parallel=par, model=model, train=train)

    def _model(self, cfg: Config, tensor: int) -> tuple:
        """(abstract params, logical names) of the model at this tensor size (the vocabulary padding)."""
        if tensor not in self._models:
            from jaxpar.models import build_model
            from jaxpar.trainer import ModelAdapter

            a = ModelAdapter(lambda: build_model(cfg, tensor=tensor))
            import jax

            self._models[tensor] = (jax.tree.leaves(a.abstract),
                                    jax.tree.leaves(a.axes, is_leaf=lambda x: isinstance(x, tuple)))
        return self._models[tensor]

    def check(self, cfg: Config, sizes: dict) -> None:
        """train.py's checks of a layout (ConfigError naming the reason)."""
        from jaxpar.partitioning import check_batch_fits, check_model_fits

        validate(cfg, PLANNED_KEYS if self._validated else None)  # (the rest as in the first config checked)
        self._validated = True
        check_model_fits(cfg.model, cfg.parallel, sizes, *cfg.moe.stacking(cfg.model.arch))
        check_batch_fits(cfg.train.batch_size, cfg.train.grad_accum, sizes, cfg.parallel.microbatches)

    def _leaves(self, cfg: Config, sizes: dict) -> tuple[list, dict]:
        """The parameters with their layouts at the mesh ``sizes`` (stacked layers as stored: uneven stages
        padded), and per layout each one's (elements, shards, in the layer stack, a MoE layer's routed
        experts); kept per layout (the rules read ``zero`` and ``megatron_sp``, the storage the stages)."""
        from jaxpar import comm
        from jaxpar.partitioning import make_rules, stack_slots

        par = cfg.parallel
        s_, r_ = sizes["pipe"], par.pipeline_repeats
        key = (tuple(sizes.items()), par.zero, par.megatron_sp, r_, tuple(par.stage_layer_list()))
        if key not in self._layouts:
            rules = make_rules(par, SimpleNamespace(shape=sizes))  # type: ignore[arg-type]  # only .shape is read
            shapes, names = self._model(cfg, sizes["tensor"])
            shapes = [SimpleNamespace(shape=(stack_slots(a.shape[0], s_, r_, par.stage_layer_list()), *a.shape[1:]))
                      if nm and nm[0] == "layers" else a for a, nm in zip(shapes, names)]
            leaves = [comm.Leaf(tuple(a.shape), tuple(nm), rules.params.spec(nm, a.shape),
                                rules.opt.spec(nm, a.shape), rules.compute.spec(nm, a.shape),
                                stage=bool(nm) and nm[0] == "layers") for a, nm in zip(shapes, names)]
            # elements per device in each layout: of every leaf, the layer stack's, a MoE layer's routed experts'
            local = {(layout, stage_only, experts): sum(
                math.prod(x.shape) / comm._shards(getattr(x, layout), sizes) for x in leaves
                if (x.stage or not stage_only) and ("experts" in x.names or not experts))
                for layout in ("params", "opt", "compute") for stage_only in (False, True) for experts in (False, True)}
            if len(self._layouts) > 20000:
                self._layouts.clear()
            self._layouts[key] = (leaves, local)
        return self._layouts[key]

    def estimate(self, overrides: dict) -> Estimate:
        import jax.numpy as jnp

        from jaxpar import comm, flops, steptime
        from jaxpar.layers.precision import compute_dtype

        cfg = self.config(overrides)
        par, m = cfg.parallel, cfg.model.resolved()
        sizes = {a: getattr(par, a) for a in AXES}
        self.check(cfg, sizes)
        leaves, local = self._leaves(cfg, sizes)
        pb = jnp.dtype(m.param_dtype).itemsize
        ab = jnp.dtype(compute_dtype(m.compute_dtype, self.platform)).itemsize
        est = Estimate(overrides)
        mem = est.memory

        def per_device(layout: str, nbytes: float, stage_only: bool = False, experts: bool = False) -> float:
            """Bytes per device of the leaves (``stage_only``: the layer stack's; ``experts``: a MoE layer's
            routed experts only) in ``layout``, at ``nbytes`` per element."""
            return nbytes * local[(layout, stage_only, experts)]

        mem["params"] = per_device("params", pb)
        mem["opt"] = per_device("opt", 2 * 4)
        # ZeRO-3 reduce-scatters each layer's gradient as the backward produces it; XLA:CPU all-reduces each
        # layer's inside the backward's loop and slices it there, under ZeRO-1 too
        scattered = (par.zero >= 3 or self.platform == "cpu") and sizes["pipe"] == 1
        mem["grads"] = per_device("opt" if scattered else "compute", pb)
        mb_grad = 0.0
        if sizes["pipe"] > 1:
            # a pipeline sums its stage's gradient over the microbatches in its loop, and a microbatch's gradient
            # of the stage is a buffer of its own (the transpose of the stage's loop over its layers writes it)
            # until the sum takes it in: both split as the optimizer's shard under ZeRO (the partitioner splits
            # the loop's carry as the update reads it), whole without; the embedding's and the head's whole
            mb_grad = per_device("opt" if par.zero >= 1 else "compute", pb, stage_only=True)
            mem["grads"] = per_device("compute", pb) - per_device("compute", pb, stage_only=True) + 2 * mb_grad
            if par.pipeline_schedule in ("zb_h1", "zb_v"):  # and W's kernel gradients, beside B's others
                mem["grads"] += mb_grad
        if cfg.train.grad_accum > 1:  # the sum over microsteps, in the optimizer's layout (ZeRO: its shard)
            mem["grads"] += per_device("opt", pb)
            if par.zero >= 3:  # and a microstep's gradient of the embedding and the head, whole before its
                # reduce-scatter (the loss runs after the layers' loop, outside it)
                mem["grads"] += per_device("compute", pb) - per_device("compute", pb, stage_only=True)
        mem["activations"], mem["logits"], apart, per_token = self._activations(cfg, sizes, ab)
        if m.remat == "none" and sizes["pipe"] == 1:  # the backward reads each layer's weights as its
            # matmuls took them, cast or annotated: a copy of the stack in the compute dtype (a pipeline
            # stage selects its layers again in the backward, jaxpar.layers.remat.select_remat)
            mem["activations"] += per_device("compute", ab, stage_only=True)
        # one layer's weights in the compute layout while its backward runs: its gradient before the reduction
        # (and the slice or reduce-scatter to the optimizer's shard), in a pipeline stage its weights selected
        # again too, under ZeRO-3 its gathered weights, and in the sorted dispatch's exchange rounds the
        # experts' gradient summed over rounds (a loop's carry in and out). A stage's are live after the
        # layer's activations are done with (its weight gradients come last): the larger of the two counts
        slots = next(x.shape[0] for x in leaves if x.stage) // sizes["pipe"]
        exchanged = m.arch == "moe" and cfg.moe.dispatch_path() == "sorted" and sizes["expert"] > 1
        layer = per_device("compute", pb, stage_only=True) / slots * (1 + (sizes["pipe"] > 1) + (par.zero >= 3))
        # (the rounds' sum of the experts' gradient and its zeros: the experts' weights as the rounds take them,
        # in the compute dtype; Mixtral 8x7B's compiled step, two bfloat16 copies)
        layer += 2 * exchanged * per_device("compute", ab, stage_only=True, experts=True) / slots
        if self.platform == "cpu" and ab < 4 and m.arch == "moe" and cfg.moe.dispatch_path() == "sorted":
            # XLA:CPU converts a layer's bfloat16 experts to float32 for the sorted dispatch's tile matmuls
            # outside the loop over tiles: all of them at once. In a pipeline stage that convert is the experts'
            # selection again (counted above at the parameters' width): one float32 copy, not two
            layer += per_device("compute", 4, stage_only=True, experts=True) / slots
            if sizes["pipe"] > 1:
                layer -= per_device("compute", pb, stage_only=True, experts=True) / slots
        mem["activations"] += max(0.0, layer - per_token["working"]) if sizes["pipe"] > 1 else layer
        # AdamW's update temporaries: half a float32 copy of the optimizer's shard (it runs in place, in a cond)
        mem["update"] = 0.5 * per_device("opt", 4)
        if sizes["pipe"] > 1:  # after a pipeline's loop, the update (and under ZeRO the stage's new weights
            # gathered whole) reuses what the loop held beyond the sum: the larger of the two counts
            after = mem["update"] + (per_device("compute", pb, stage_only=True) if par.zero >= 1 else 0.0)
            mem["update"] = max(0.0, after - (mb_grad + mem["activations"] + mem["logits"] - apart))
        elif self.platform != "cpu":  # on GPU the update reuses the backward's activations and logits too: the
            # larger of the two (one H200's allocator peak: Llama 1B 19.7 GiB with full remat, 19.9 so counted,
            # 22.0 summed; GPT-2 124M 13.8, 14.5 and 14.7); XLA:CPU's compiled steps hold both
            mem["update"] = max(0.0, mem["update"] - (mem["activations"] + mem["logits"] - apart))
        mem["total"] = sum(mem.values()) - apart
        terms = comm.traffic(cfg, sizes, leaves, platform=self.platform, act_bytes=ab, param_bytes=pb)
        for term in terms:  # wire bytes by mesh-axis group, whatever the collective
            est.comm[term.label] = est.comm.get(term.label, 0.0) + term.wire_bytes
        s_, mb = sizes["pipe"], par.microbatches or sizes["pipe"]
        r_ = par.pipeline_repeats
        est.bubble = (mb * r_ + s_ - 1) / (mb * r_) if s_ > 1 else 1.0
        if s_ > 1 and par.pipeline_schedule in ("zb_h1", "zb_v"):  # the grid's slots over a stage's busy ones
            from jaxpar.layers import zero_bubble as zb

            est.bubble = 1 / (1 - zb.idle_fraction(zb.schedule_zero_bubble(par.pipeline_schedule, s_, mb,
                                                                            zb.lengths_for(par.stage_remat))))
        est.budget = steptime.step_time(cfg, sizes, terms, comm.step_runs(cfg, sizes), self.cluster, self.nodes,
                                        recompute_share=_recomputed(cfg), kernel=per_token["kernel"],
                                        kept_bytes=per_token["kept"], saved_bytes=per_token["saved"],
                                        stored_bytes=per_token["stored"],
                                        opt_params=per_device("opt", 1), n_devices=self.n)
        est.step_seconds = est.budget["step"]
        est.comm_seconds = sum(v for k, v in est.budget.items() if k.startswith("comm "))
        est.compute_seconds = sum(est.budget[k] for k in ("compute", "recompute", "bubble", "overhead"))
        est.mfu = flops.model_flops_per_step(cfg) / self.n / (est.step_seconds * self.cluster.peak_tflops * 1e12)
        return est

    def _bandwidth(self, label: str, sizes: dict) -> float:
        """GB/s of a collective over the axes ``label`` (:func:`jaxpar.steptime.bandwidth`)."""
        from jaxpar.steptime import bandwidth

        return bandwidth(self.cluster, label, sizes, self.nodes)[0]

    def _activations(self, cfg: Config, sizes: dict, ab: int) -> tuple[float, float, float, dict]:
        """(activations, the loss chunk's logits, the bytes of the two that are never live together, per token
        and layer: ``kept`` the bytes a layer writes without remat, ``saved`` the matmul outputs ``offload``
        moves, and the attention ``kernel``)."""
        import jax.numpy as jnp

        from jaxpar import comm

        from jaxpar.layers.attention_ops import choose
        from jaxpar.layers.remat import KEPT

        m, par, tr, e = cfg.model.resolved(), cfg.parallel, cfg.train, cfg.moe
        t, n = sizes["tensor"], sizes["seq"]
        rows = tr.batch_size // tr.grad_accum // (sizes["data"] * sizes["expert"])
        tl = m.seq_len // n
        tokens = rows * tl
        d, hd, h, kv = m.d_model, m.head_dim, m.n_heads, m.n_kv_heads
        ff = (3 if m.gated else 2) * m.d_ff
        rounds = 0.0  # a sorted dispatch's exchange rounds: their backward beyond the routed MLP's count
        cpu = self.platform == "cpu"
        # XLA:CPU runs bfloat16 matmuls in float32: a layer's working set is float32 (wb), and its input, kept
        # for the backward, is kept as stored and, for part of the layers, converted too (sb: 4.8 to 6.4 bytes
        # per element measured on GPT-3 175B, 5 taken), as are the matmul outputs a policy saves
        wb, sb = (4, ab + 3 if ab < 4 else ab) if cpu else (ab, ab)
        up: float = (2 if m.gated else 1) * m.d_ff  # the up (gate-up) projection's output
        kept_ff = ff
        # without remat a layer keeps every intermediate of its nonlinearity (:data:`NONE_KEPT_FF`)
        none_ff = NONE_KEPT_FF[str(m.mlp)] * m.d_ff
        down = 0.0  # what keeping mlp_down keeps beyond mlp_up (dense: nothing the backward reads)
        if m.arch == "moe":  # the expert hidden and the dispatched rows in and out, per routed slot (capacity-padded)
            path, ep = e.dispatch_path(), sizes["expert"]
            # rows per token: capacity slots (dropless: every expert's, C = G), the sorted assignments, or one
            # exchange round's (capacity_factor x the balanced share per peer)
            slots = (e.top_k * (1 if ep == 1 else e.capacity_factor) if path == "sorted"
                     else e.n_experts if e.dropless else e.top_k * e.capacity_factor)
            ff = slots * ((3 if m.gated else 2) * (e.d_ff or m.d_ff) + 2 * d * t)
            up = slots * (2 if m.gated else 1) * (e.d_ff or m.d_ff)
            kept_ff = ff
            none_ff = slots * (NONE_KEPT_FF[str(m.mlp)] * (e.d_ff or m.d_ff) + 2 * d * t)
            if path == "sorted" and ep > 1:  # the exchange rounds' backward runs them again (sum_rounds): kept
                # are only the sorted rows (and, without remat, the combined results), k x d each, whole over
                # tensor; a policy that keeps mlp_down keeps the rounds' inputs, one that keeps mlp_up alone none
                kept_ff, up, down = 2 * e.top_k * d * t, 0.0, e.top_k * d * t
                none_ff = kept_ff
                # their backward's working set, counted as itself (:meth:`_exchange_working_set`) in place of
                # the routed MLP's hidden and rows beyond the sorted rows (kept)
                run = tokens // (par.microbatches or sizes["pipe"]) if sizes["pipe"] > 1 else tokens
                rounds = self._exchange_working_set(cfg, sizes, ab, wb, max(1, run)) - e.top_k * d - (
                    2 * ff - kept_ff) / t
            # the shared experts (moe.shared_experts): one dense MLP of their summed width beside the routed ones,
            # run on every token and split over tensor, kept as a dense layer's MLP is
            sh = e.shared_experts * (e.d_ff or m.d_ff)
            shared_ff = (3 if m.gated else 2) * sh
            ff, kept_ff = ff + shared_ff, kept_ff + shared_ff
            up += (2 if m.gated else 1) * sh
            none_ff += NONE_KEPT_FF[str(m.mlp)] * sh
        # ring attention rematerialises each hop's [T/N, T/N] block in its backward (none kept); the local block
        # and the last hop run outside its loop of hops, so two blocks' worth are live
        ring = n > 1 and par.seq_attention == "ring"
        t_kv = m.seq_len // n * 2 if ring else m.seq_len
        kernel = choose(m.attention, dtype=jnp.bfloat16 if ab == 2 else jnp.float32, head_dim=hd, n_heads=h,
                        n_kv_heads=kv, platform=self.platform, seq_len=m.seq_len,
                        cudnn_head_dim=self.cluster.cudnn_head_dim)
        # one float32 [T, T] tensor per head of the reference attention (in wb units): the scores and the
        # probabilities are kept; a backward holds them with their two gradients (XLA:CPU: three tensors at
        # short sequences, four from 1024 tokens; GPU: the two it keeps). With attention sinks, the scores
        # joined with the sink logits too: half a square more, measured on GPT-OSS 20B, whose scores XLA joins
        # in place in some of its layers
        square = h * t_kv / t * (4 / wb) if kernel == "xla" else 0.0
        sq_work = ((4 if t_kv >= 1024 else 3) if cpu else 2) + 0.5 * m.attn_sinks
        sq_kept = 0.0 if ring else 2 + 0.5 * m.attn_sinks
        heads = h // n if n > 1 and par.seq_attention == "ulysses" else h
        res = d / t if par.megatron_sp else d  # the residual stream's tensors (split over tensor under Megatron-SP)
        # what a layer keeps for its backward, per token
        kept_attn = 5 * res + (4 * heads + 3 * kv) * hd / t + sq_kept * square  # all but the MLP's
        kept = kept_attn + kept_ff / t
        # and, in the one layer whose backward runs: the MLP hidden's gradient, and under tensor parallelism
        # the partial sums reduced over tensor ([tokens, d]: a row-parallel layer's output, a column-parallel
        # layer's input gradient) beside their reduced results, and the attention's gradients
        working = kept + (ff + ff - kept_ff) / t + rounds + (2 * d if t > 1 else 0) + (sq_work - sq_kept) * square
        # what each layer keeps between its forward and its backward, in bytes: all of the above without remat
        # (its input at the stored width, the rest at the working width); with a policy, its input and the named
        # matmul outputs it saves that the backward reads (out_proj and mlp_down feed a residual add, whose
        # backward does not read them; the exchange rounds' inputs kept by mlp_down are one working-width copy)
        named = {"qkv_proj": (h + 2 * kv) * hd / t, "attention": h * hd / t, "mlp_up": up / t, "mlp_down": down / t}
        # (XLA:CPU, a pipeline stage without remat: its layers' kept tensors in bfloat16 and converted to float32
        # for the backward at once, the stage's stack of them, not a layer's at a time)
        kw = wb + ab if cpu and ab < 4 and sizes["pipe"] > 1 else wb
        stored = (res * sb + (kept + (none_ff - kept_ff) / t - res) * kw if m.remat == "none" else res * sb + sum(
            named.get(x, 0.0) * (wb if x == "mlp_down" else sb) for x in KEPT.get(m.remat, ())))
        # the same residuals kept in a 1F1B or zero-bubble stash (parallel.stage_remat=false) are held as traced:
        # in the compute dtype, the attention's squares in float32 (XLA:CPU's float32 copies are made as a
        # backward reads its slot; the GPU's widths are these), and with out_proj's output, which the second
        # norm's backward reads (its input, the residual stream plus it: read from the stash of GPT-3 175B's
        # compiled 1F1B step)
        squares = sq_kept * square  # in wb units
        traced = ((kept + (none_ff - kept_ff) / t - squares) * ab + squares * wb if m.remat == "none" else
                  res * ab + sum(dict(named, out_proj=d).get(x, 0.0) * ab for x in KEPT.get(m.remat, ())))
        s_ = sizes["pipe"]
        layers = comm.stage_layers(cfg, sizes) * par.pipeline_repeats  # a stage's layer slots
        # a pipeline stage runs each of its layers (M R + S - 1) / R times (bubble iterations included)
        mr = (par.microbatches or s_) * par.pipeline_repeats
        held = tokens * (mr + s_ - 1) / mr if s_ > 1 else tokens
        micro = tokens / (par.microbatches or s_) if s_ > 1 else tokens
        # plus one layer's working set: the backward's (and, under remat, its recompute's)
        act = layers * held * stored + micro * working * wb
        # a MoE model's dense first layers (moe.first_dense) run on the first stage of a pipeline, per microbatch:
        # what each of them keeps, with the dense MLP (1F1B: one microbatch's, while the lead-in's backward runs,
        # after the stage's chunk's; GPipe / circular: the scan keeps every iteration's beside the stage's)
        lead = e.first_dense if m.arch == "moe" and s_ > 1 else 0
        dense_named = dict(named, mlp_up=(2 if m.gated else 1) * m.d_ff / t, mlp_down=0.0)
        lead_stored = (res * sb + (kept_attn + NONE_KEPT_FF[str(m.mlp)] * m.d_ff / t - res) * wb
                       if m.remat == "none" else
                       res * sb + sum(dense_named.get(x, 0.0) * sb for x in KEPT.get(m.remat, ())))
        f1b = s_ > 1 and par.pipeline_schedule == "1f1b"
        # a chunk's (L / (S R) layers') share of a microbatch: what its forward run again keeps while its backward
        # runs (parallel.stage_remat), or the residuals a stash keeps for it (stage_remat=false)
        kept_chunk = layers // par.pipeline_repeats * micro * traced
        # (stage_remat=false: a forward's residuals, made before the pass writes them into their slot; measured
        # on XLA:CPU's programs without remat, 1F1B 0.80 -> 0.93 of the compiled step and ZB-H1 0.81 -> 0.94
        # with it; interleaved 1F1B 1.03 without it, 1.15 with: there XLA:CPU holds no such copy, not traced why)
        again = (layers // par.pipeline_repeats * micro * stored if par.stage_remat else
                 0.0 if f1b and par.pipeline_repeats > 1 else kept_chunk)
        if f1b:
            m_ = par.microbatches or s_
            r_ = par.pipeline_repeats  # interleaved: the stash holds chunk inputs, a backward recomputes a chunk
            from jaxpar.layers.pipeline import embed_chunk, stash_slots

            # the stash, one chunk's activations and working set, and the first stage's input gradients kept
            # for the embedding's weight gradient (C microbatches' of them)
            # (parallel.stage_remat=false: the stash holds each chunk's residuals, what model.remat keeps, and the
            # backward runs from them)
            slots = stash_slots(s_, r_, m_)
            stash = slots * micro * d * ab if par.stage_remat else slots * kept_chunk
            act = (stash + embed_chunk(s_, m_, r_) * micro * d * ab + max(again, lead * micro * lead_stored)
                   + micro * working * wb)
        elif s_ > 1 and par.pipeline_schedule in ("zb_h1", "zb_v"):
            act = self._zero_bubble_held(cfg, sizes, micro, ab, kept_chunk) + (
                max(again, lead * micro * lead_stored) + micro * working * wb)
        elif s_ > 1:  # the stage's buffer of all microbatches (the embedded batch on the first stage, the
            # outputs on the last) and its gradient (the embedding's output gradient is that buffer's)
            act += 2 * tokens * d * ab + lead * held * lead_stored
        # a pipeline's loss runs in chunks of at most one microbatch (1F1B: per microbatch)
        chunk = min(micro, m.loss_chunk_tokens or micro)
        vocab = -(-m.vocab_size // (m.vocab_multiple * t)) * m.vocab_multiple
        # the chunk's logits and their gradient, and the masked logits when the vocabulary is padded
        logits = (2 + (vocab * t > m.vocab_size)) * chunk * vocab * 4
        # the loss runs between the layers' forward and their backward, so its logits and one layer's
        # working set in the backward are never live together (1F1B: the loss and a stage's backward
        # share an iteration)
        apart = 0.0 if f1b or par.pipeline_schedule in ("zb_h1", "zb_v") else min(logits, micro * working * wb)
        from jaxpar.layers.remat import MATMULS

        per_token = {"kept": kept * ab, "saved": sum(named.get(x, 0.0) for x in MATMULS) * ab, "kernel": kernel,
                     "stored": stored,
                     "working": micro * working * wb}
        return act, logits, apart, per_token

    def _exchange_working_set(self, cfg: Config, sizes: dict, ab: int, wb: int, g: int) -> float:
        """Elements per token (at the working width) that the backward of a sorted dispatch's exchange round
        holds (:func:`jaxpar.layers.moe_dispatch.sum_rounds` runs the round's forward again and takes its
        VJP), for ``g`` tokens a layer run (a microbatch) on a device, ``ab`` / ``wb`` the stored and working
        widths: the round's ``R = expert x c`` received rows, padded to the tiles' ``P`` rows, and the layer's
        ``A = top_k x g`` sorted rows, ``d`` wide and whole over tensor, beside the tiles' hidden
        intermediates (``NONE_KEPT_FF`` of them, the experts' width split over tensor). Read from XLA's live
        ranges (``tools/xla_memory.py``) at the two peaks it has: at an exchange's all-to-all, three
        ``P``-row buffers (the tiles, their outputs, the cotangents scattered into them), four ``R``-row ones
        (the exchange's in and out, both ways) and three ``A``-row ones (the sorted rows, their cotangent and
        its sum over rounds), the hidden as stored (``configs/deepseek_moe.yaml``: ``d`` wide against experts
        of width 64); in a tile's backward, the hidden at the working width (XLA:CPU converts a stored
        bfloat16 one to float32 there, one still stored beside) with two ``P``-row, one ``R``-row and three
        ``A``-row buffers (Mixtral 8x7B, experts of width 14336). A layer's backward reaches the larger."""
        from jaxpar.layers.moe_dispatch import round_rows, tile_count, tile_rows

        m, e, t, ep = cfg.model.resolved(), cfg.moe, sizes["tensor"], sizes["expert"]
        a = e.top_k * g
        r = ep * round_rows(a, ep, e.capacity_factor)
        local = e.n_experts // ep
        rows = tile_rows(r, local, self.platform)
        p = tile_count(r, local, rows) * rows
        hidden = NONE_KEPT_FF[str(m.mlp)] * (e.d_ff or m.d_ff) / t * p / g
        at_exchange = hidden * ab / wb + (3 * p + 4 * r + 3 * a) / g * m.d_model
        in_tile = hidden * (1 + ab / wb / NONE_KEPT_FF[str(m.mlp)]) + (2 * p + r + 3 * a) / g * m.d_model
        return max(at_exchange, in_tile)

    def _zero_bubble_held(self, cfg: Config, sizes: dict, micro: float, ab: int, per_chunk: float) -> float:
        """What a zero-bubble grid's device holds between its passes (:func:`jaxpar.layers.zero_bubble.tables`'
        buffers, at their sizes for this S and M): chunk inputs (F to B), output cotangents (arrival to B) and
        the first chunk's input gradients kept for the embedding's weight gradient (C microbatches'), each a
        microbatch's ``[rows, T, d]``; and per microbatch between its B and its W every deferred matmul's input
        and output cotangent (:mod:`jaxpar.layers.wgrad`: the attention's and a dense MLP's projections; a MoE
        layer's experts and every kernel under Megatron-SP take their gradients in B), in the compute dtype (the
        taps are the matmuls' operands and cotangents as B makes them). With ``parallel.stage_remat=false``, in
        each chunk input's slot also the chunk's residuals (``per_chunk`` bytes: what the remat policy keeps of
        a microbatch's pass through the chunk) and its output; under a policy that keeps the matmuls' inputs
        (none, save_dots), held until W, which reads them there (the taps: the output cotangents alone)."""
        from jaxpar import comm
        from jaxpar.layers import zero_bubble as zb

        m, par = cfg.model.resolved(), cfg.parallel
        s_, m_ = sizes["pipe"], par.microbatches or sizes["pipe"]
        # kept residuals under a policy that keeps the matmuls' inputs (zero_bubble.INPUTS_KEPT): W reads them
        # there, kept until W; the taps are the output cotangents alone (zero_bubble.inputs_from_residuals)
        lengths, until = zb.passes_for(par.stage_remat, m.remat)
        from_residuals = until == "W"
        tab = zb.tables(par.pipeline_schedule, s_, m_, lengths=lengths, x_until=until)
        n = tab["sizes"]
        c_ = zb._embed_chunk(par.pipeline_schedule, s_, m_, lengths)
        d = m.d_model
        held = (n["x"] + n["g"] + c_) * micro * d * ab
        if not par.stage_remat:
            held += n["x"] * (per_chunk + micro * d * ab)
        if par.megatron_sp and sizes["tensor"] > 1:
            return held
        t, hd = sizes["tensor"], m.head_dim
        q, kv, o = m.n_heads * hd / t, m.n_kv_heads * hd / t, m.n_heads * (m.v_head_dim or hd) / t
        ff = (2 if m.gated else 1) * m.d_ff / t
        # per layer, the deferred matmuls' inputs and their output cotangents: qkv and out, up (gate-up) and down
        attn, mlp = (d + o, q + 2 * kv + d), (d + m.d_ff / t, ff + d)
        lpg = comm.stage_layers(cfg, sizes)
        dense = lpg - (lpg // cfg.moe.every if m.arch == "moe" else 0)  # a MoE layer's experts do not defer
        x_per, dy_per = lpg * attn[0] + dense * mlp[0], lpg * attn[1] + dense * mlp[1]
        # the taps of n["w"] microbatches in their buffer, and one more in flight (measured on XLA:CPU's
        # programs: the switch's output, B's taps or the slot as it was, written after it); with the inputs
        # read from the residuals, the taps are the cotangents, and a W's inputs are one microbatch's copy
        if from_residuals:
            return held + ((n["w"] + 1) * dy_per + x_per) * micro * ab
        return held + (n["w"] + 1) * micro * (x_per + dy_per) * ab

    def fitting(self, base: dict, micro, rejected: list) -> list[Estimate]:
        """The estimates of ``base`` (a mesh and its options) at the fewest accumulation microsteps k that fit
        (more only add time: ZeRO-3 gathers, a pipeline's bubble per microstep, a smaller overlap window), each
        of its microbatch counts M at that k; what does not fit or pass the checks goes to ``rejected``. Memory
        falls as k grows: k = 1 is tried first, then the most microsteps (none fits: done), then the fewest
        that fit are found by bisection."""
        limit = self.cluster.hbm_gib * GIB
        dp = base["parallel.data"] * base["parallel.expert"]
        batch = self.cfg.train.batch_size
        ks = [k for k in divisors(batch) if (batch // k) % dp == 0]
        tried: dict[int, tuple[list, bool]] = {}

        def at(k: int) -> tuple[list, bool]:
            """(the estimates that fit at k, whether any failed for its memory alone)."""
            if k not in tried:
                found, heavy = [], False
                for mb in micro(k):
                    ov = {**base, "parallel.microbatches": mb, "train.grad_accum": k}
                    try:
                        est = self.estimate(ov)
                    except ConfigError as e:
                        rejected.append((ov, str(e)))
                        continue
                    if est.memory["total"] > limit:
                        rejected.append((ov, f"needs {est.memory['total'] / GIB:.1f} GiB per device "
                                             f"(> {self.cluster.hbm_gib:g} GiB)"))
                        heavy = True
                    else:
                        found.append(est)
                tried[k] = (found, heavy)
            return tried[k]

        if not ks:
            return []
        if at(ks[0])[0] or not at(ks[0])[1]:  # fits at k = 1, or fails for another reason than memory
            return at(ks[0])[0]
        if not at(ks[-1])[0]:
            return []
        lo, hi = 0, len(ks) - 1  # ks[lo] does not fit, ks[hi] does
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if at(ks[mid])[0] else (mid, hi)
        return at(ks[hi])[0]

    def plan(self, expand: int = 6) -> tuple[list[Estimate], list[tuple[dict, str]]]:
        """(layouts that fit, fastest first; rejected layouts with the reason). A first pass tries a few
        options (:func:`options`, ``phase="first"``) on every mesh; the ``expand`` meshes fastest in it, and
        up to twice as many more within 10% of the fastest, then try every option: the search space is the
        product, the time spent the first pass (a few estimates per mesh) and the expanded meshes' products."""
        m = self.cfg.model
        batch, layers = self.cfg.train.batch_size, (self.cfg.moe.groups(m.n_layers) if m.arch == "moe"
                                                    else m.n_layers)
        ok: list[Estimate] = []
        rejected: list[tuple[dict, str]] = []
        best: dict[tuple, float] = {}
        for sizes in meshes(self.n, moe=m.arch == "moe"):
            try:  # the mesh's own checks (heads, layers, batch), once
                self.check_mesh(sizes)
            except ConfigError as e:
                # recorded as the mesh's plainest layout (the checks do not depend on the options)
                rejected.append(({**{f"parallel.{a}": v for a, v in sizes.items()}, "parallel.zero": 0,
                                  "model.remat": "none"}, str(e)))
                continue
            for base, micro in options(sizes, batch, layers, self.platform, "first", self.schedules):
                for est in self.fitting(base, micro, rejected):
                    ok.append(est)
                    key = tuple(sizes.values())
                    best[key] = min(best.get(key, math.inf), est.step_seconds)
        ranked = sorted(best, key=lambda x: best[x])
        top = min(best.values(), default=math.inf)
        seen = {_key(e.overrides) for e in ok}
        for key in [x for i, x in enumerate(ranked) if i < expand or (i < 3 * expand and best[x] <= 1.1 * top)]:
            sizes = dict(zip(AXES, key))
            for base, micro in options(sizes, batch, layers, self.platform, schedules=self.schedules):
                for est in self.fitting(base, micro, rejected):
                    if _key(est.overrides) not in seen:
                        seen.add(_key(est.overrides))
                        ok.append(est)
        ok.sort(key=lambda e: (e.step_seconds, e.memory["total"]))
        return ok, rejected

    def check_mesh(self, sizes: dict) -> None:
        """train.py's checks of the model on a mesh, whatever the options (ConfigError naming the reason): the
        model's divisibility, and the batch over the batch axes (one microstep, no pipeline's microbatches)."""
        from jaxpar.partitioning import check_batch_fits, check_model_fits

        cfg = self.config({f"parallel.{a}": v for a, v in sizes.items()})
        check_model_fits(cfg.model, cfg.parallel, sizes, *cfg.moe.stacking(cfg.model.arch))
        check_batch_fits(self.cfg.train.batch_size, 1, {**sizes, "pipe": 1})


def _key(ov: dict) -> tuple:
    return tuple(sorted(ov.items()))


def _recomputed(cfg: Config) -> float:
    """The forwards the backward recomputes under ``model.remat``: one for ``full``; none for ``none``
    and the policies that keep every matmul output the backward reads (``save_dots``, ``minimal``,
    ``offload``); else the share of a layer's matmul flops that produces what the policy drops:
    ``save_dots_except_mlp`` the MLP's up projection, ``save_qkv_proj`` that and attention's ``QK^T``
    and ``PV`` (the backward reads neither out-projection's nor down-projection's output)."""
    from jaxpar.flops import layer_matmul_params

    m = cfg.model.resolved()
    if m.remat in ("none", "save_dots", "minimal", "offload", "full"):
        return float(m.remat == "full")
    moe = m.arch == "moe"
    width = (cfg.moe.top_k * (cfg.moe.d_ff or m.d_ff)) if moe else m.d_ff
    up = (2 if m.gated else 1) * width * m.d_model
    core = m.seq_len * m.n_heads * m.head_dim  # QK^T and PV: 2 T H hd flops per token each, halved by the mask
    return (up + (core if m.remat == "save_qkv_proj" else 0)) / (layer_matmul_params(cfg, moe) + core)


LEGEND = """\
mem GiB: per-device memory estimate (state + activations + loss logits + update temporaries); state: parameters,
  gradients and AdamW moments as sharded; act: activations kept for the backward; bubble: the pipeline's idle
  fraction (S-1)/(M R+S-1), as the training log prints it; step s: estimated seconds per step (jaxpar.steptime:
  compute at --efficiency of peak, recompute, bubble, elementwise work, communication not overlapped; --explain
  prints the terms); MFU: model flops over peak at that step time; comm: GiB per device per step on the wire,
  by the mesh axes a collective spans; k: accumulation microsteps; M: microbatches; R: chunks per stage; kept:
  each backward runs from the residuals its forward kept, not the stage's forward again (parallel.stage_remat)."""


def table(ests: list[Estimate], width: int = 120) -> str:
    """The ranked layouts: one line of numbers with the layout last (never cut), then its communication by
    mesh axes, wrapped at ``width``; :data:`LEGEND` explains the columns."""
    import textwrap

    rows = [f"{'#':>3} {'mem GiB':>8} {'state':>6} {'act':>6} {'bubble':>6} {'step s':>8} {'MFU':>4}  layout"]
    for i, e in enumerate(ests, 1):
        mem = e.memory
        state = (mem["params"] + mem["opt"] + mem["grads"]) / GIB
        bubble = 1 - 1 / e.bubble  # the stretch (M + S - 1) / M as the idle fraction the training log prints
        rows.append(f"{i:3d} {mem['total'] / GIB:8.2f} {state:6.2f} {mem['activations'] / GIB:6.2f} "
                    f"{100 * bubble:5.1f}% {e.step_seconds:8.3f} {100 * e.mfu:3.0f}%  {describe(e.overrides)}")
        comm = " | ".join(f"{k} {v / GIB:.3g}" for k, v in sorted(e.comm.items()) if v > 0) or "none"
        rows += textwrap.wrap("comm GiB: " + comm, width, initial_indent=" " * 4, subsequent_indent=" " * 14)
    return "\n".join(rows)


@command()
def main(argv: list[str] | None = None) -> int:
    ap = ArgumentParser(prog="python -m jaxpar.plan", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="a YAML config (model, batch); its parallel keys are ignored")
    ap.add_argument("--cluster", default="h100x8", help=f"one of {', '.join(CLUSTERS)}")
    ap.add_argument("--nodes", type=COUNT, default=1, help="nodes of the cluster (>= 1)")
    ap.add_argument("--per-node", type=COUNT, default=None,
                    help="devices per node (>= 1; default: the cluster's, e.g. 8): 1 plans one GPU's remat and "
                         "accumulation")
    ap.add_argument("--top", type=COUNT, default=10, help="layouts to print (>= 1)")
    ap.add_argument("--efficiency", type=number(float, EFFICIENCY), default=None,
                    help="fraction of peak the matmuls reach, in (0, 1] (default: the cluster's, 0.68 on GPUs: "
                         "fitted to Megatron-LM's published runs)")
    ap.add_argument("--rejected", action="store_true", help="also print every rejected layout and why")
    ap.add_argument("--check", type=number(int, Range(0), "0 = none"), default=0,
                    help="compile the K best on simulated CPU devices and compare (0 = none)")
    ap.add_argument("--explain", action="store_true",
                    help="say why the first choice and the runner-up: what each axis splits, what fits only "
                         "because of ZeRO / remat / a pipeline, the collectives across nodes, the time by term")
    ap.add_argument("--calibrate", action="append", default=[], metavar="RUN_DIR",
                    help="fit the cluster's efficiency and bandwidths to a train.py run of it (repeatable: "
                         "one run fits one factor, three fit compute, memory and communication apart)")
    ap.add_argument("--schedules", default="gpipe,1f1b",
                    help="pipeline schedules to try, comma-separated, of " + ", ".join(SCHEDULES)
                    + " (default gpipe,1f1b; zb_h1 / zb_v: the zero-bubble grids)")
    ap.add_argument("overrides", nargs="*", help="config overrides of the model and batch")
    a = ap.parse_intermixed_args(argv)
    from jaxpar.config import load_config

    try:
        if a.cluster not in CLUSTERS:
            raise ConfigError(f"--cluster {a.cluster!r}: choose one of {', '.join(CLUSTERS)}")
        for o in a.overrides:  # the keys the planner chooses itself: an override of them would be dropped
            key = o.split("=", 1)[0]
            if key.startswith("parallel.") or key in ("model.remat", "train.grad_accum"):
                raise ConfigError(f"{o}: the planner chooses the parallel layout, model.remat and train.grad_accum "
                                  "itself; give overrides of the model and batch only")
        if a.check:  # before JAX starts: as many simulated devices as the cluster has
            import jax

            from jaxpar.mesh import request_cpu_devices

            jax.config.update("jax_platforms", "cpu")
            try:
                request_cpu_devices((a.per_node or CLUSTERS[a.cluster].per_node) * a.nodes)
            except RuntimeError as e:  # JAX already started (main called from a process that used JAX)
                raise ConfigError(f"--check: {e}") from None
        cfg = load_config(a.config, a.overrides)
        cfg = dataclasses.replace(cfg, parallel=type(cfg.parallel)())
        cluster, platform = CLUSTERS[a.cluster], "cpu" if a.cluster == "cpu" else "gpu"
        if a.per_node:
            cluster = cluster.with_(per_node=a.per_node, name=f"{cluster.name.split('x')[0]}x{a.per_node}")
        if a.calibrate:
            from jaxpar.plan_report import calibrate

            cluster, lines = calibrate(a.calibrate, cluster.with_(efficiency=a.efficiency or cluster.efficiency),
                                       platform, Planner)
            print("calibration:\n" + "\n".join(lines) + "\n")
        planner = Planner(cfg, cluster, a.nodes, None if a.calibrate else a.efficiency, platform=platform,
                          schedules=tuple(x.strip() for x in a.schedules.split(",") if x.strip()))
        ok, rejected = planner.plan()
        if not ok:
            need = min((r for r in rejected if "GiB per device" in r[1]), default=None,
                       key=lambda r: float(r[1].split("needs ")[1].split(" GiB")[0]))
            if need:
                raise ConfigError(f"no layout of {planner.n} devices fits {CLUSTERS[a.cluster].hbm_gib:g} GiB per "
                                  f"device: the smallest estimate is {need[1].split('needs ')[1].split(' per')[0]} "
                                  f"per device ({describe(need[0])})")
            # else the reason of the plainest layout (all devices on data, if that is one)
            plain = max(rejected, key=lambda r: (r[0]["parallel.data"], -r[0]["parallel.zero"]))
            raise ConfigError(f"no layout of {planner.n} devices passes the checks (e.g. {describe(plain[0])}: "
                              f"{plain[1]})")
        print(f"{len(ok)} layouts fit on {planner.n} device{'s' * (planner.n > 1)} ({a.nodes} x {cluster.name}), "
              f"{len(rejected)} rejected; "
              "fastest first:")
        print(table(ok[: a.top]))
        print(LEGEND)
        print("\nbest: python train.py " + " ".join(shlex.quote(w) for w in (
            [*(["--config", a.config] if a.config else []), *a.overrides, *ok[0].args()])))
        if a.rejected:
            print("\nrejected:")
            for ov, why in rejected:
                print(f"  {describe(ov)}: {why}")
        if a.explain:
            from jaxpar.plan_report import explain_plan

            print("\n" + explain_plan(planner, ok))
        if a.check:
            print("\n" + check(cfg, ok[: a.check]))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def check(cfg: Config, ests: list[Estimate]) -> str:
    """Compile each layout on the simulated CPU devices and compare with the model's XLA:CPU flavour
    (float32 activations, the reference attention, XLA:CPU's collectives)."""
    import jax

    from jaxpar import comm
    from jaxpar.trainer import Trainer

    cpu = Planner(cfg, CLUSTERS["cpu"], max(1, jax.device_count() // 8), platform="cpu")
    lines = ["predicted (XLA:CPU flavour) vs compiled, GiB per device: state | total memory | collectives"]
    for e in ests:
        pred = cpu.estimate(e.overrides)
        t = Trainer(cpu.config(e.overrides))
        rep = t.compile()
        mem = rep["memory"]
        total = mem["argument_size"] + mem["output_size"] + mem["temp_size"] - mem["alias_size"]
        state = (t.per_device_bytes("params") + t.per_device_bytes("opt")) / GIB
        p = pred.memory
        lines.append(f"  {describe(e.overrides):44s} {(p['params'] + p['opt']) / GIB:.4f} vs {state:.4f} | "
                     f"{p['total'] / GIB:.4f} vs {total / GIB:.4f} | {sum(pred.comm.values()) / GIB:.4f} vs "
                     f"{comm.total(comm.measured(rep['collectives'])) / GIB:.4f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

