"""Analytic communication model: what each device sends per train step, by collective and mesh axes.

Every strategy's traffic as a list of :class:`Term` s (a collective kind over some mesh axes, a count and the size
of one instance's result on a device), in the byte convention of :mod:`jaxpar.hlo`: ``wire_bytes`` is what one
device sends with the bandwidth-optimal algorithms, all-reduce ``2 (g-1)/g S``, all-gather ``(g-1)/g S``,
reduce-scatter ``(g-1) S`` (S its shard), all-to-all ``(g-1)/g S``, collective-permute ``S``. :func:`compare`
holds a compiled program's collectives (``hlo.collectives``) to it.
Long by design: every strategy's terms in one place, in the order the tests count them in compiled programs.

Per strategy (``rows`` = sequences per device per microstep, or per pipeline microbatch; ``Tl`` =
``T / seq``; ``a`` = bytes per activation element; ``P_g`` = gradient bytes a device holds):

================  ================================================================================
data (+expert,    gradients: one reduction over every axis that splits the tokens and not the leaf
seq)              (data, expert, seq): all-reduce of ``P_g``; reduce-scatter into the optimizer's
                  shards under ZeRO >= 1, then (ZeRO-1) one all-gather of the updated parameters;
                  ZeRO-3: one all-gather of each layer weight per use (forward, and again for the
                  backward when ``model.remat`` is not none) in every accumulation microstep; the
                  embedding's and head's once per step (hoisted out of the accumulation loop)
tensor            Megatron: per layer 2 all-reduces of ``[rows, Tl, d]`` forward (attention-out,
                  MLP-down) and 2 backward (the column layers' input gradients); the vocab-parallel
                  lookup's all-reduce, the loss's 3 floats per token and its input gradient.
                  Megatron-SP: per layer 2 all-gathers + 2 reduce-scatters forward and the same
                  backward; gradients of weights not split over tensor all-reduced over tensor
pipe              GPipe / circular: per iteration (M R + S - 1 of them) one collective-permute of
                  ``[rows, Tl, d]`` forward and one backward; every layer collective runs on each
                  iteration, bubbles included (they compute on zeros). 1F1B: 2M + 3S - 3 permutes
                  (warm-up and steady forwards, steady backwards); a layer runs forward M + 2S - 2
                  times and again before each of its M + S - 1 backwards (interleaved, R chunks:
                  M R + R S + S - 2 iterations, M R + S - 1 of them with a backward, each running
                  one chunk of L / (S R) layers). Every schedule: the
                  embedding / head weight gradients summed over stages once per microstep (each
                  nonzero on one stage; under ZeRO-1 only the device's shard, after the reduction
                  over the batch axes); the head / loss / lookup collectives on the whole ``rows`` (every
                  stage runs them, lock-step). Zero-bubble (zb_h1, zb_v; :func:`_zero_bubble_runs`): a
                  device runs M R forwards and M R Bs of a chunk (the chunk's forward again and its
                  backward, the head's and lookup's collectives in each) and one collective-permute per
                  slot and direction that has senders; XLA:CPU's static count: every branch of all T slots
expert            per MoE layer 2 all-to-alls of the ``[E, C, d]`` capacity buffer forward and 2 backward;
                  sorted dispatch: exchange rounds of ``[ep, c, d]`` (``c = ceil(cf k rows Tl / ep)``), 2
                  all-to-alls a round forward, 3 backward (a round's rows again, and both transposed),
                  one round for balanced routing (XLA:CPU's static count: two, round 0 and the loop body)
seq               all_gather: per layer K and V all-gathered forward, reduce-scattered backward;
                  ring: per layer N-1 hops of K and V each way; ulysses: 4 all-to-alls each way
================  ================================================================================

Rematerialisation repeats the forward collectives that the backward's recompute needs: the
attention-out all-reduce unless ``out_proj`` is kept (the MLP-down one produces the layer's output,
which nothing recomputed reads), the column layers' input all-gathers under Megatron-SP, ZeRO-3's
weight gathers inside the layer scan, the K/V exchanges (and Ulysses' output all-to-all unless
``attention`` is kept), and the expert all-to-alls, under any policy but ``none``; not with 1F1B's
one-layer chunks, whose recompute for the backward already runs the layer's forward just before (no scan
between them: XLA merges the two, and with them their collectives and flops).

**XLA:CPU** lacks the collective optimisation passes that XLA's GPU and TPU compilers run after
SPMD partitioning (``ReduceScatterCreator``, ``AllReduceFolder``, ``AllReduceReassociate``,
``WhileLoopAllReduceCodeMotion``), so ``platform="cpu"`` predicts what it emits instead, at these
costs: a reduce-scatter is an all-reduce (+ a slice): 2x its wire bytes; a gradient reduced over
``seq`` and over ``data`` / ``expert`` is two all-reduces, one per split dim (``2(s-1)/s + 2(d-1)/d``
instead of ``2(sd-1)/sd``), unless the weight is used inside a ``shard_map`` (embedding, loss, MoE,
Megatron-SP's matmuls); a tied table's two gradient contributions are reduced apart (one more
table); a gradient inside a loop (gradient accumulation, pipeline iterations) is reduced in every
iteration (x the trip count, a circular pipeline's iteration holding 1/R of the stage).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from jaxpar.hlo import wire_bytes
from jaxpar.layers.moe import expert_capacity
from jaxpar.layers.moe_dispatch import round_rows
from jaxpar.layers.remat import KEPT
from jaxpar.mesh import AXES

TOKEN_AXES = ("data", "expert", "seq")


@dataclass
class Term:
    """``count`` collectives of ``kind`` over ``axes``, each with a ``result_bytes`` result on a device."""

    kind: str
    axes: tuple
    count: float
    result_bytes: float
    what: str
    group: int = 1
    label: str = ""  # the axes as one string (``data+expert``), :func:`_label`

    @property
    def wire_bytes(self) -> float:
        return self.count * wire_bytes(self.kind, self.result_bytes, self.group)



@dataclass
class Leaf:
    """A parameter as the model sees it: its shape, logical names and the three layouts' specs."""

    shape: tuple
    names: tuple
    params: object
    opt: object
    compute: object
    stage: bool  # stacked over layers (split over pipe, and run inside the pipeline's loop)


@functools.lru_cache(maxsize=4096)  # (the planner asks for the same few specs and axes a million times)
def _spec_axes(spec) -> frozenset:
    return frozenset(a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))


@functools.lru_cache(maxsize=256)
def _label(axes: tuple) -> str:
    return "+".join(a for a in AXES if a in axes)


def _shards(spec, sizes) -> int:
    return math.prod(sizes[a] for a in _spec_axes(spec))


def leaves_of(trainer) -> list[Leaf]:
    """The parameters of a :class:`~jaxpar.trainer.Trainer` with their layouts."""
    import jax

    out = []
    rules = trainer.rules
    for a, names in zip(jax.tree.leaves(trainer.stored_shapes(trainer.adapter.abstract)),
                        jax.tree.leaves(trainer.adapter.axes, is_leaf=lambda x: isinstance(x, tuple))):
        params, opt, compute = (r.spec(names, a.shape) for r in (rules.params, rules.opt, rules.compute))
        out.append(Leaf(tuple(a.shape), tuple(names), params, opt, compute, stage=bool(names) and names[0] == "layers"))
    return out


def stage_layers(cfg, sizes: dict) -> int:
    """The stacked layers one pipeline group (a stage's chunk) runs per iteration: L / (S R) (a MoE model's
    groups x moe.every, the dense first layers apart), or with uneven stages (``parallel.stage_layers``, a
    count the stages do not divide) the longest group's slots: every stage runs as many
    (:func:`jaxpar.partitioning.layer_groups`); all L without a pipeline."""
    from jaxpar.partitioning import layer_groups

    m, par = cfg.model, cfg.parallel
    s_, r_ = sizes["pipe"], par.pipeline_repeats
    moe = m.arch == "moe"
    stacked, every = (cfg.moe.groups(m.n_layers), cfg.moe.every) if moe else (m.n_layers, 1)
    if s_ == 1:
        return m.n_layers
    return max(layer_groups(stacked, s_, r_, par.stage_layer_list())) * every


@dataclass
class Runs:
    """How often one train step runs each part of the model, per device (:func:`step_runs`): ``fwd`` / ``bwd`` /
    ``redo`` layer runs (forward, backward, and the forward again under remat) on ``layer_rows`` sequences
    each; ``moe_*`` the MoE layers' share; ``head`` / ``lookup`` the loss head's and the embedding lookup's runs
    on the whole ``rows`` (per microstep: times ``k``), as their collectives count them: in a pipeline every
    stage runs them (1F1B: in every iteration of its loops), on zeros where their matmuls and gathers do not
    run (:mod:`jaxpar.layers.onstage`); ``iters`` the pipeline's iterations per microstep."""

    k: int
    rows: int
    layer_rows: int
    tl: int
    pipelined: bool
    f1b: bool
    microbatches: int
    iters: int
    f1b_iters: int
    f1b_steady: int
    lpg: int
    lead: int
    fwd: float
    bwd: float
    redo: float
    moe_fwd: float
    moe_bwd: float
    moe_redo: float
    head: float
    lookup: float
    flushes: int = 1  # 1F1B: the embedding's weight gradients taken in the loops (embed_chunk), per microstep
    zb: bool = False  # a zero-bubble schedule (zb_h1, zb_v): ``iters`` are its slots, in one loop
    sends: float = 0.0  # zero-bubble: the collective-permutes over pipe per microstep (see step_runs)
    again: bool = True  # 1F1B / zero-bubble: a backward runs its chunk's forward again (parallel.stage_remat)


def step_runs(cfg, sizes: dict, platform: str = "gpu") -> Runs:
    """The layer, head and lookup runs of one train step of ``cfg`` on a mesh of ``sizes`` (see :class:`Runs`);
    ``platform`` matters for the zero-bubble schedules only (:func:`_zero_bubble_runs`)."""
    m = cfg.model.resolved()
    par, tr = cfg.parallel, cfg.train
    if sizes["pipe"] > 1 and par.pipeline_schedule in ("zb_h1", "zb_v"):
        return _zero_bubble_runs(cfg, sizes, platform)
    k = tr.grad_accum
    rows = tr.batch_size // k // (sizes["data"] * sizes["expert"])
    s_, r_ = sizes["pipe"], par.pipeline_repeats
    pipelined = s_ > 1
    f1b = pipelined and par.pipeline_schedule == "1f1b"
    mb_ = par.microbatches or s_
    iters = mb_ * r_ + s_ - 1 if pipelined else 1
    # a layer runs `layer_runs` times per step on `layer_rows` sequences
    layer_rows = rows // mb_ if pipelined else rows
    lpg = stage_layers(cfg, sizes)  # the layers of one pipeline group (a chunk of a stage)
    moe_model = m.arch == "moe"
    every, lead = (cfg.moe.every, cfg.moe.first_dense) if moe_model else (1, 0)
    layer_runs = k * (iters * lpg if pipelined else m.n_layers)
    # forward, backward and recompute runs of a layer (the layer collectives are counted per run)
    fwd_runs = bwd_runs = layer_runs
    # 1F1B: iterations, and those of the steady loop (a backward each); interleaved (R > 1) each runs a chunk
    f1b_iters, f1b_steady = mb_ * r_ + r_ * s_ + s_ - 2, mb_ * r_ + s_ - 1
    again = par.stage_remat  # (parallel.stage_remat=false: the forward's residuals kept instead)
    if f1b:  # warm-up and steady-loop forwards, and the steady loop's recompute of the chunk for its backward
        bwd_runs = k * f1b_steady * lpg
        fwd_runs = k * f1b_iters * lpg + (bwd_runs if again else 0)
    # remat's recompute of a layer in the backward; not with 1F1B's one-layer chunks run again: no scan separates
    # it from the chunk's own recompute before it, and XLA merges the two (jax.checkpoint's prevent_cse=False)
    redo_runs = bwd_runs if m.remat != "none" and not (f1b and again and lpg == 1) else 0
    # a MoE model's MoE-layer runs: one layer in `every` of the stack (all of it but the dense first layers)
    moe_runs = ((lambda runs: runs // every) if pipelined else
                (lambda runs: runs * cfg.moe.groups(m.n_layers) // m.n_layers) if moe_model else (lambda runs: 0))
    moe_fwd, moe_bwd, moe_redo = moe_runs(fwd_runs), moe_runs(bwd_runs), moe_runs(redo_runs)
    if pipelined and lead:  # the dense first layers (the lead-in): on every stage, per microbatch, in the loops:
        # GPipe's every iteration (forward, and the scan's transpose); 1F1B's every forward, and each steady
        # iteration's backward through them (their forward again, then their backward)
        lead_bwd = k * (f1b_steady if f1b else iters) * lead
        fwd_runs += k * (f1b_iters if f1b else iters) * lead + (lead_bwd if f1b else 0)
        bwd_runs += lead_bwd
        redo_runs += lead_bwd if m.remat != "none" else 0
    # the head / loss and the lookup run on the whole microstep batch, or per microbatch inside 1F1B's loops
    # (the loss in each steady iteration, the lookup in each forward)
    from jaxpar.layers.pipeline import embed_chunk

    return Runs(k, rows, layer_rows, m.seq_len // sizes["seq"], pipelined, f1b, mb_, iters, f1b_iters,
                f1b_steady, lpg, lead, fwd_runs, bwd_runs, redo_runs, moe_fwd, moe_bwd, moe_redo,
                f1b_steady / mb_ if f1b else 1.0, f1b_iters / mb_ if f1b else 1.0,
                mb_ // embed_chunk(s_, mb_, r_) if f1b else 1, again=f1b and again)


def _zero_bubble_runs(cfg, sizes: dict, platform: str) -> Runs:
    """The runs of ``zb_h1`` / ``zb_v`` (:mod:`jaxpar.layers.zero_bubble`): one loop over the grid's T slots, each
    a ``lax.switch`` over idle / F / B / W and, per direction of its sends, a ``switch`` over the slot's
    patterns of senders. A device runs M R forwards of a chunk (the first chunk's with the lookup and the
    lead-in, computed on every device and selected), M R Bs (the chunk's forward again, its backward, and the
    head and loss, whose matmuls run on the last chunk's device only) and M R Ws (local matmuls). On GPU and
    TPU only the branch taken runs: those counts, and one collective-permute per slot and direction that has
    senders. XLA:CPU's static count (``platform="cpu"``) holds every branch in every slot: T times F's, B's and
    W's collectives, and T times each direction's patterns."""
    from jaxpar.layers import zero_bubble as zb

    m = cfg.model.resolved()
    par, tr = cfg.parallel, cfg.train
    kind, s_, r_ = par.pipeline_schedule, sizes["pipe"], par.pipeline_repeats
    k = tr.grad_accum
    rows = tr.batch_size // k // (sizes["data"] * sizes["expert"])
    mb_ = par.microbatches or s_
    lengths = zb.lengths_for(par.stage_remat)
    tab = zb.tables(kind, s_, mb_, lengths=lengths)
    slots = tab["slots"]
    cpu = platform == "cpu"
    passes = slots if cpu else mb_ * r_  # of each kind (F, B, W), per microstep
    if cpu:
        sends = slots * sum(len(p) - 1 for p in tab["patterns"])
    else:
        sends = sum(int((p > 0).sum()) for p in tab["pattern"])
    lpg = stage_layers(cfg, sizes)
    every, lead = (cfg.moe.every, cfg.moe.first_dense) if m.arch == "moe" else (1, 0)
    bwd = k * passes * lpg
    fwd = k * passes * lpg + (bwd if par.stage_remat else 0)  # F's, and B's forward again
    redo = bwd if m.remat != "none" else 0
    moe_fwd, moe_bwd, moe_redo = fwd // every, bwd // every, redo // every
    if lead:  # the lead-in: in every F, and in every B (its forward again and its backward)
        fwd += 2 * k * passes * lead
        bwd += k * passes * lead
        redo += k * passes * lead if m.remat != "none" else 0
    return Runs(k, rows, rows // mb_, m.seq_len // sizes["seq"], True, False, mb_, slots, slots, slots, lpg, lead,
                fwd, bwd, redo, moe_fwd, moe_bwd, moe_redo, passes / mb_, passes / mb_,
                mb_ // zb._embed_chunk(kind, s_, mb_, lengths), zb=True, sends=k * sends, again=par.stage_remat)


def traffic(cfg, sizes: dict, leaves: list[Leaf], *, platform: str = "gpu", act_bytes: int = 4,
            param_bytes: int = 4) -> list[Term]:
    """Every collective of one train step of ``cfg`` on a mesh of ``sizes``, per device."""
    m = cfg.model.resolved()
    par = cfg.parallel
    big = lambda axes: tuple(a for a in axes if sizes[a] > 1)  # noqa: E731
    ru = step_runs(cfg, sizes, platform)
    k, layer_rows, head_rows, tl, d = ru.k, ru.layer_rows, ru.rows, ru.tl, m.d_model
    r_ = par.pipeline_repeats
    pipelined, f1b, iters, lpg, lead = ru.pipelined, ru.f1b, ru.iters, ru.lpg, ru.lead
    f1b_iters, f1b_steady = ru.f1b_iters, ru.f1b_steady  # (zero-bubble: its slots, every one a B's)
    fwd_runs, bwd_runs, redo_runs = ru.fwd, ru.bwd, ru.redo
    moe_fwd, moe_bwd, moe_redo = ru.moe_fwd, ru.moe_bwd, ru.moe_redo
    remat = m.remat
    head_runs, lookup_runs = ru.head, ru.lookup
    terms: list[Term] = []

    spans: dict[tuple, tuple[tuple, int, str]] = {}  # axes -> (those of more than one device, their devices, label)

    def add(kind, axes, count, result, what):
        if axes not in spans:
            spans[axes] = (big(axes), math.prod(sizes[a] for a in big(axes)), _label(big(axes)))
        axes, group, label = spans[axes]
        if axes and count and result:
            terms.append(Term(kind, axes, count, result, what, group, label))

    # -- gradients (data parallelism, ZeRO) --------------------------------------------------------
    tied = m.tie_embeddings
    for leaf in leaves:
        local = math.prod(leaf.shape) * param_bytes / _shards(leaf.compute, sizes)
        tied_table = tied and leaf.names == ("vocab", "embed")
        head = leaf.names in (("norm",), ("embed", "vocab")) or tied_table  # the final norm and the head
        leaf_axes = _spec_axes(leaf.compute)
        red = tuple(a for a in big(TOKEN_AXES) if a not in leaf_axes)
        scatter = tuple(a for a in red if a in _spec_axes(leaf.opt))
        loops, local_iter = 1, local
        if platform == "cpu":  # reduced inside every microstep, and every pipeline iteration
            loops = k * (iters if leaf.stage and pipelined else 1)
            if f1b and (leaf.stage or head):  # accumulated in 1F1B's steady loop (a tied table: once more,
                loops = k * (f1b_steady + tied_table)  # for the lookup after it)
            if ru.zb and head:  # in every B of a zero-bubble grid's slots
                loops = k * iters

            if pipelined and lead and leaf.names[:1] == ("sublayers",):  # the lead-in's: inside the loops,
                loops = k * (f1b_steady if f1b else iters)  # reduced in each iteration that takes its backward
            if leaf.stage and pipelined:
                local_iter = local / r_  # a circular iteration holds one of the stage's R groups
        lookup = leaf.names in (("vocab", "embed"), ("positions", "embed"))
        if (ru.flushes > 1 or (ru.zb and platform == "cpu")) and lookup:  # 1F1B with M > 2RS, or a zero-bubble
            # grid: the lookup's weight gradients taken (and reduced) in the loop every C microbatches
            # (jaxpar.layers.pipeline.embed_chunk; zero-bubble: in the first chunk's W), in a conditional, which a
            # static count (XLA:CPU's flavour) counts in every steady iteration (slot); a tied table's head part as
            # before (XLA:CPU: in each steady iteration or B; else once)
            loops = k * (f1b_steady if platform == "cpu" else ru.flushes) + tied_table * (
                k * f1b_steady if platform == "cpu" else 1)
        # a dot contracting batch and sequence dims reduces over each split apart on XLA:CPU; weights
        # used inside a shard_map (the table's lookup, the head's loss, MoE router and experts, the
        # tensor-split matmuls of Megatron-SP) are reduced over all the token axes at once by its transpose
        joint = bool({"vocab", "experts", "router"} & set(leaf.names)) or (
            par.megatron_sp and sizes["tensor"] > 1 and "tensor" in leaf_axes)
        split = platform == "cpu" and "seq" in red and len(red) > 1 and not joint
        groups = [(("seq",), ), (tuple(a for a in red if a != "seq"),)] if split else [(red,)]
        copies = 2 if (platform == "cpu" and tied_table and not (f1b or ru.zb)) else 1
        for (axes,) in groups:
            sc = tuple(a for a in axes if a in scatter)
            if sc and platform != "cpu":
                add("reduce-scatter", axes, copies * loops,
                    local_iter / math.prod(sizes[a] for a in sc), "gradient reduce-scatter")
            else:
                add("all-reduce", axes, copies * loops, local_iter, "gradient all-reduce")
        gathered_params = tuple(a for a in _spec_axes(leaf.opt) - _spec_axes(leaf.params) if sizes[a] > 1)
        if gathered_params:  # ZeRO-1: the updated shards gathered back into the replicated parameters
            add("all-gather", gathered_params, 1, local, "ZeRO-1 parameter all-gather")
        if pipelined and not leaf.stage:  # the embedding's (first stage) and head's (last stage) gradients;
            # under ZeRO-1 XLA reduces them over the batch axes first and sums only this device's shard
            add("all-reduce", ("pipe",), k, local / math.prod(sizes[a] for a in scatter),
                "embedding / head gradients summed over stages")
        zero3 = tuple(a for a in _spec_axes(leaf.params) - _spec_axes(leaf.compute) if sizes[a] > 1)
        if zero3:  # ZeRO-3: a layer's weights gathered before each use, in every gradient-accumulation
            # microstep; the embedding's and head's gathers do not depend on it (XLA hoists them out of the loop)
            regather = leaf.stage and remat != "none"  # the layer's recompute gathers its weights again
            add("all-gather", zero3, k * (1 + regather) if leaf.stage else 1, local, "ZeRO-3 weight all-gather")

    # -- tensor parallelism --------------------------------------------------------------------------
    tp = ("tensor",)
    act = layer_rows * tl * d * act_bytes
    head_act = head_rows * tl * d * act_bytes
    head_grad = head_rows * tl * d * 4  # the loss sums its input gradient over tensor in float32
    kept = () if remat == "none" else KEPT.get(remat, KEPT["save_dots"])  # offload keeps save_dots' (on host)
    # the backward's recompute of a layer redoes the attention-out all-reduce unless out_proj is kept
    # (its result feeds the MLP); the MLP-down one is the layer's output, which nothing recomputed needs
    recompute_ar = int("out_proj" not in kept)
    block_ar = 2 * fwd_runs + 2 * bwd_runs + recompute_ar * redo_runs  # attention-out and MLP-down, and transposes
    if f1b and ru.again and lpg == 1:  # 1F1B's recompute of a one-layer chunk (no scan): its MLP-down result,
        block_ar -= k * f1b_steady  # the chunk's output, is unused by the backward and XLA drops its all-reduce
    shared = int(m.arch == "moe" and cfg.moe.shared_experts > 0)  # one fused MLP, however many experts
    hk, lk = k * head_runs, k * lookup_runs
    # the lookup's backward: once per microstep, or in the loop with its weight gradients (see the gradients above)
    in_loop = ru.flushes > 1 or (ru.zb and platform == "cpu")
    lookup_bwd = k * ((iters if ru.zb else f1b_steady) if platform == "cpu" else ru.flushes) if in_loop else k
    if sizes["tensor"] > 1 and not par.megatron_sp:
        if m.kv_lora_rank:  # MLA: its head-split layers read the latents (kept whole), so the attention's input
            # gradient is reduced as the latents' (queries', keys' and values', the shared RoPE key's), not as x's
            latents = (m.q_lora_rank or d) + m.kv_lora_rank + m.rope_head_dim
            add("all-reduce", tp, block_ar - bwd_runs, act, "Megatron block all-reduces")
            add("all-reduce", tp, bwd_runs, act * latents / d, "MLA latents' gradient all-reduces")
        else:
            add("all-reduce", tp, block_ar, act, "Megatron block all-reduces")
        # the MoE layer's shared experts: one more row-parallel MLP (forward output, backward input gradient)
        add("all-reduce", tp, shared * (moe_fwd + moe_bwd), act, "shared experts' all-reduces")
        add("all-reduce", tp, lk, head_rows * tl * d * param_bytes, "vocab-parallel lookup")
        add("all-reduce", tp, hk, head_grad, "loss input gradient")
        add("all-reduce", tp, 3 * hk, head_rows * tl * 4, "loss max / sum / target over the vocabulary")
    if sizes["tensor"] > 1 and par.megatron_sp:
        t_ = sizes["tensor"]
        add("all-gather", tp, 2 * fwd_runs + 2 * bwd_runs + 2 * redo_runs, act,
            "Megatron-SP column-layer input all-gathers")
        add("reduce-scatter", tp, block_ar, act / t_, "Megatron-SP row-layer reduce-scatters")
        # the shared experts' input all-gathers are the routed experts' (the same gather of the same value, CSE'd)
        add("reduce-scatter", tp, shared * (moe_fwd + moe_bwd), act / t_, "Megatron-SP shared experts' reduce-scatters")
        add("reduce-scatter", tp, lk, head_act / t_, "Megatron-SP lookup reduce-scatter")
        add("all-gather", tp, lookup_bwd, head_act, "Megatron-SP lookup backward")
        add("all-gather", tp, hk, head_act, "Megatron-SP head input all-gather")
        add("reduce-scatter", tp, hk, head_grad / t_, "Megatron-SP head input gradient")
        add("all-reduce", tp, 3 * hk, head_rows * tl * 4, "loss max / sum / target over the vocabulary")
        for leaf in leaves:  # weights applied to sequence-split activations: partial sums over tensor
            if "tensor" not in _spec_axes(leaf.compute):
                add("all-reduce", tp, 1, math.prod(leaf.shape) * param_bytes / _shards(leaf.compute, sizes),
                    "Megatron-SP replicated-weight gradient")

    # -- pipeline --------------------------------------------------------------------------------------
    if pipelined:  # the residual stream: also split over tensor under Megatron-SP
        res = act / (sizes["tensor"] if par.megatron_sp else 1)
        if f1b:  # forward shifts in the warm-up and steady loops, backward shifts in the steady loop
            add("collective-permute", ("pipe",), k * (f1b_iters + f1b_steady), res, "1F1B stage shifts")
        elif ru.zb:  # the slots' sends (step_runs): each a microbatch's activations or their gradient
            add("collective-permute", ("pipe",), ru.sends, res, "zero-bubble stage shifts")
        else:
            add("collective-permute", ("pipe",), 2 * k * iters, res, "stage shift (forward, backward)")

    # -- expert parallelism ----------------------------------------------------------------------------
    if m.arch == "moe" and sizes["expert"] > 1:
        e = cfg.moe
        tokens = layer_rows * tl
        ep = sizes["expert"]
        if e.dispatch_path() == "sorted":
            # the exchange rounds of [ep, c, d], c = ceil(cf k tokens / ep): forward rows out and results back;
            # the backward (sum_rounds' VJP) redoes a round's rows-out exchange and transposes both. One round
            # when the routing is balanced; XLA:CPU's static count holds round 0 and the loop's body once (two)
            c = round_rows(e.top_k * tokens, ep, e.capacity_factor)
            rounds = 2 if platform == "cpu" else 1
            # a policy that keeps the experts' matmul outputs (save_dots) recomputes nothing behind the exchange
            redo = 0 if {"mlp_up", "mlp_down"} <= set(kept) else moe_redo
            runs = rounds * (2 * moe_fwd + 3 * moe_bwd + 2 * redo)
            add("all-to-all", ("expert",), runs, ep * c * d * act_bytes, "MoE sorted-dispatch exchange rounds")
        else:
            cap = expert_capacity(tokens, e.n_experts, e.top_k, e.capacity_factor, e.dropless)
            buf = e.n_experts * cap * d * act_bytes
            add("all-to-all", ("expert",), 2 * (moe_fwd + moe_bwd + moe_redo), buf, "MoE dispatch / combine")

    # -- sequence parallelism --------------------------------------------------------------------------
    n = sizes["seq"]
    if n > 1:
        hd, h_l, kv_l = m.head_dim, m.n_heads // sizes["tensor"], m.n_kv_heads // sizes["tensor"]
        kv_block = layer_rows * tl * kv_l * hd * act_bytes
        # redo_runs: the forward exchange again when the backward recomputes attention
        if par.seq_attention == "all_gather":
            add("all-gather", ("seq",), 2 * (fwd_runs + redo_runs), kv_block * n, "K/V all-gather")
            add("reduce-scatter", ("seq",), 2 * bwd_runs, kv_block, "K/V gradient reduce-scatter")
        elif par.seq_attention == "ring":
            add("collective-permute", ("seq",), 2 * (n - 1) * (fwd_runs + bwd_runs + redo_runs), kv_block,
                "ring K/V hops")
        else:
            q_block = layer_rows * tl * h_l * hd * act_bytes
            redo_out = int("attention" not in kept)  # a kept attention output is not sent back again
            add("all-to-all", ("seq",), 2 * fwd_runs + 2 * bwd_runs + (1 + redo_out) * redo_runs, q_block,
                "Ulysses q in, output back")
            add("all-to-all", ("seq",), 2 * (fwd_runs + bwd_runs + redo_runs), kv_block, "Ulysses k, v in")
    return terms


def summarize(terms: list[Term]) -> dict:
    """``{kind: {axes label: wire bytes}}``."""
    out: dict = {}
    for t in terms:
        by = out.setdefault(t.kind, {})
        by[t.label] = by.get(t.label, 0.0) + t.wire_bytes
    return out


def measured(collectives: dict) -> dict:
    """The same shape from ``hlo.collectives`` output."""
    return {k: {a: v["wire_bytes"] for a, v in c["by_axes"].items() if v["wire_bytes"]}
            for k, c in collectives.items() if isinstance(c, dict) and c.get("wire_bytes")}


def compare(model: dict, got: dict) -> dict:
    """``{(kind, axes): (measured, model)}`` over the union of both."""
    keys = {(k, a) for d in (model, got) for k, by in d.items() for a in by}
    return {key: (got.get(key[0], {}).get(key[1], 0.0), model.get(key[0], {}).get(key[1], 0.0))
            for key in sorted(keys)}


def total(summary: dict) -> float:
    return float(np.sum([v for by in summary.values() for v in by.values()]))
