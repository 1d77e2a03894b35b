"""Logical axis names -> mesh axes, derived from the parallel config in ONE place.

Model code names the dimensions of its weights and activations with logical names
(``embed``, ``mlp``, ``heads``, ``batch``, ``act_mlp`` ...). :func:`make_rules` turns a
:class:`~jaxpar.config.ParallelConfig` into :class:`Rules` that map each name to mesh axes:

=================  =======================================  ===================================
logical name       mesh axes                                why
=================  =======================================  ===================================
batch              data, expert (+ pipe, see below)         DP; ``expert`` is extra DP for dense
length             seq                                      sequence parallelism
res_length         seq (+ tensor with Megatron-SP)          residual stream outside attn / MLP
vocab, act_vocab   tensor                                   vocabulary-parallel embed / loss
heads, kv_heads    tensor                                   Megatron attention
mlp, act_mlp       tensor                                   Megatron MLP
embed              data, expert, seq under ZeRO-3 (params)  FSDP / sharded optimizer state over
                   and ZeRO>=1 (optimizer state)            every axis that splits the batch
expert_embed       data, seq (idem)                         an expert weight's embed dim (its
                                                            experts dim already uses expert)
experts            expert                                   expert parallelism
stages, layers     pipe                                     pipeline parallelism (stage weights;
                                                            ``sublayers``, a stack inside a layer: none)
=================  =======================================  ===================================

Two rule sets exist: ``params`` (weights and activations) and ``opt`` (optimizer state, which is
additionally split over the batch axes under ZeRO-1). A name with no rule, two dims of one array on
the same mesh axis, or a dim the mesh axes do not divide is an error.

Under a pipeline (``pipe > 1``) the batch is never split over ``pipe``: the model's embedding runs
on the first stage and its head and loss on the last, inside the schedule's ``shard_map`` manual
over ``pipe`` (:meth:`RuleSet.manual_pipe`), so that nothing of the batch but the stage shifts
crosses ``pipe`` (:mod:`jaxpar.layers.pipeline`).

ZeRO shards over every axis that splits the batch (``data``, ``expert``, ``seq``): all of them hold
replicas of the dense weights, so all of them share the weights' (ZeRO-3) and the optimizer
state's (ZeRO-1) bytes, and the gradient reduction over them is one reduce-scatter.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError, ModelConfig, ParallelConfig

if TYPE_CHECKING:
    from flax import nnx

@dataclass(frozen=True)
class Rules:
    """A logical-name -> mesh-axes table bound to a mesh."""

    table: dict
    mesh: Mesh | AbstractMesh | None = None  # abstract inside a shard_map manual over some axes
    name: str = "params"

    def axes(self, name: str | None) -> tuple[str, ...]:
        if name is None:
            return ()
        if name not in self.table:
            raise ConfigError(f"logical axis name {name!r} has no partitioning rule; known names: "
                              f"{', '.join(sorted(self.table))}")
        return self.table[name]

    def spec(self, names, shape=None, what: str = "array") -> P:
        """PartitionSpec for an array whose dims carry ``names``; checks collisions and divisibility."""
        used: dict[str, str] = {}
        out = []
        for i, n in enumerate(names):
            axes = tuple(a for a in self.axes(n) if self.mesh is None or self.mesh.shape[a] > 1)
            for a in axes:
                if a in used:
                    raise ConfigError(f"{what}: logical dims {used[a]!r} and {n!r} both map to mesh axis "
                                      f"{a!r} ({self.name} rules); an array may use a mesh axis once")
                used[a] = n
            if shape is not None and self.mesh is not None and axes:
                k = math.prod(self.mesh.shape[a] for a in axes)
                if shape[i] % k:
                    raise ConfigError(f"{what}: dim {i} ({n!r}, size {shape[i]}) is not divisible by mesh "
                                      f"axes {'x'.join(axes)} (size {k})")
            out.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        while out and out[-1] is None:
            out.pop()
        return P(*out)

    def sharding(self, names, shape=None, what: str = "array") -> NamedSharding:
        if self.mesh is None:
            raise ValueError("Rules without a mesh cannot build shardings")
        return NamedSharding(self.mesh, self.spec(names, shape, what))


@dataclass(frozen=True)
class RuleSet:
    """The three rule tables of a run (they differ only in where ``embed`` goes).

    ``params``: where parameters live, and all activations. ``opt``: optimizer state.
    ``compute``: the layout a weight is used in inside a layer, i.e. ``params`` without the ZeRO-3
    split; constraining a weight to it makes XLA all-gather it just before use (per layer inside
    the layer scan) and reduce-scatter its gradient.
    """

    params: Rules
    opt: Rules
    compute: Rules
    parallel: ParallelConfig | None = None  # strategy switches (seq attention, Megatron-SP)

    def axis_size(self, axis: str) -> int:
        return 1 if self.mesh is None else self.mesh.shape[axis]

    @property
    def seq_attention(self) -> str | None:
        """The context-parallel attention strategy, or None when the sequence is not split."""
        return self.parallel.seq_attention if self.parallel and self.axis_size("seq") > 1 else None

    @property
    def megatron_sp(self) -> bool:
        return bool(self.parallel and self.parallel.megatron_sp and self.axis_size("tensor") > 1)

    @property
    def mesh(self) -> Mesh | AbstractMesh | None:
        return self.params.mesh

    def manual_axes(self) -> set[str]:
        """The mesh axes of size > 1 that a layer's ``shard_map`` makes manual: all of them, less those
        already manual where it runs (``pipe`` inside a pipeline stage)."""
        mesh = self.mesh
        if mesh is None:
            return set()
        done = set(getattr(mesh, "manual_axes", ()))
        return {a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in done}

    def manual_pipe(self) -> RuleSet:
        """The rules inside a ``shard_map`` manual over ``pipe`` (a device's own pipeline stage): bound
        to the abstract mesh there (so that constraints and nested ``shard_map`` s see ``pipe`` as
        manual), with ``pipe`` dropped from every name: inside, each device holds its stage only."""
        mesh = jax.sharding.get_abstract_mesh()
        if "pipe" not in mesh.manual_axes:
            raise RuntimeError("RuleSet.manual_pipe is for use inside a shard_map manual over pipe")

        def local(r: Rules) -> Rules:
            return Rules({k: tuple(a for a in v if a != "pipe") for k, v in r.table.items()}, mesh, r.name)

        return RuleSet(local(self.params), local(self.opt), local(self.compute), self.parallel)

    def table(self) -> str:
        """Printable table: the logical names that map to a mesh axis of size > 1, for
        parameters/activations and optimizer state (every other name is replicated)."""
        def fmt(r, n):
            axes = [a for a in r.table[n] if r.mesh is None or r.mesh.shape[a] > 1]
            return ",".join(axes) if axes else "-"

        names = [n for n in sorted(self.params.table) if fmt(self.params, n) != "-" or fmt(self.opt, n) != "-"]
        if not names:
            return "logical axis rules: no name maps to a mesh axis of size > 1 (everything is replicated)"
        w = max(map(len, names + ["logical"]))
        lines = [f"{'logical':<{w}}  {'params/activations':<20} optimizer state", "-" * (w + 38)]
        lines += [f"{n:<{w}}  {fmt(self.params, n):<20} {fmt(self.opt, n)}" for n in names]
        lines.append("(other logical names: replicated)")
        return "\n".join(lines)


def make_rules(par: ParallelConfig, mesh: Mesh | None = None) -> RuleSet:
    """The rule tables for a parallel config (the only place rules are made)."""
    base = {
        "batch": ("data", "expert"), "length": ("seq",),
        # the residual stream's sequence dim: also split over tensor under Megatron sequence parallelism
        "res_length": ("seq", "tensor") if par.megatron_sp else ("seq",),
        "vocab": ("tensor",), "act_vocab": ("tensor",),
        "heads": ("tensor",), "act_heads": ("tensor",),
        "kv_heads": ("tensor",), "act_kv_heads": ("tensor",),
        "kv_rep": (),  # KV heads fewer than tensor devices: stored whole, copied per device (Attention)
        "mlp": ("tensor",), "act_mlp": ("tensor",),
        "head_dim": (), "act_head_dim": (), "fused": (), "act_embed": (), "positions": (), "norm": (),
        "layers": ("pipe",),
        "experts": ("expert",), "stages": ("pipe",), "router": (), "sublayers": (),
        "latent": (),  # MLA's latents (query and key/value): whole on every device, the heads they feed split
    }
    def zero(stage: int) -> dict:  # where `embed` goes at this ZeRO stage
        on = par.zero >= stage
        return {"embed": ZERO_AXES if on else (), "expert_embed": EXPERT_ZERO_AXES if on else ()}

    return RuleSet(params=Rules(dict(base, **zero(3)), mesh, "params"),
                   opt=Rules(dict(base, **zero(1)), mesh, "opt"),
                   compute=Rules(dict(base, **zero(99)), mesh, "compute"), parallel=par)


# the axes that split the batch, and so hold replicas of the dense weights: ZeRO shards over them
ZERO_AXES = ("data", "expert", "seq")
EXPERT_ZERO_AXES = ("data", "seq")  # expert weights: their experts dim is already split over expert


def layer_groups(n_layers: int, stages: int, repeats: int = 1, counts=(), moe: bool = False) -> tuple[int, ...]:
    """The layers of each of the S R groups of a pipelined stack, in layer order (group g is chunk
    g // S of stage g mod S; with R = 1, stage g's layers): ``counts`` when given (``parallel.stage_layers``),
    else L / (S R) each, or, when that does not divide, ceil(L / (S R)) each but one fewer on as many
    groups as needed, taken from the ends inwards (the first, the last, the second, ...: Llama 3 405B's
    126 layers on 16 stages are 7 + 14 x 8 + 7). A stage of fewer layers still runs max(counts) layer
    slots (the padding computes on zeros and is discarded: every stage runs the same program), so
    uneven stages make a layer count expressible, not a short stage faster. (``moe``: say that the layers
    are a MoE model's groups, in errors.)"""
    g = stages * repeats
    stacked = " (a MoE model: groups of moe.every layers)" if moe else ""
    what = f"parallel.pipe x parallel.pipeline_repeats = {g} layer groups" if repeats > 1 else \
        f"parallel.pipe = {g} stages"
    if counts:
        counts = tuple(int(c) for c in counts)
        if len(counts) != g or min(counts) < 1 or sum(counts) != n_layers:
            raise ConfigError(f"parallel.stage_layers={','.join(map(str, counts))}: give one count >= 1 per group of "
                              f"{what} (in layer order), summing to the {n_layers} stacked layers")
        return counts
    if n_layers < g:
        raise ConfigError(f"the model stacks {n_layers} layers{stacked}: fewer than the {what}; use a smaller pipeline")
    lg, short = -(-n_layers // g), -n_layers % g
    out = [lg] * g
    for i in range(short):
        out[i // 2 if i % 2 == 0 else g - 1 - i // 2] -= 1
    return tuple(out)


def stack_slots(n_layers: int, stages: int, repeats: int = 1, counts=()) -> int:
    """The stored length of a stack of ``n_layers`` pipelined over ``stages`` x ``repeats`` groups: S R
    max(:func:`layer_groups`), the uneven stages' groups padded to the longest; ``n_layers`` without a pipeline."""
    return n_layers if stages == 1 else stages * repeats * max(layer_groups(n_layers, stages, repeats, counts))


def check_model_fits(model: ModelConfig, par: ParallelConfig, sizes: dict[str, int], every: int = 1,
                     first_dense: int = 0) -> None:
    """Divisibility of the model by the mesh, with errors naming config keys (``every``, ``first_dense``: a MoE
    model's ``moe.every`` and ``moe.first_dense``)."""
    m = model.resolved()
    t = sizes["tensor"]
    for key, v in (("n_heads", m.n_heads), ("d_ff", m.d_ff)):
        if v % t:
            raise ConfigError(f"parallel.tensor={t} does not divide model.{key}={v}; choose tensor among "
                              f"{_divisors(v)} or change model.{key}")
    if m.n_kv_heads % t and t % m.n_kv_heads:  # fewer KV heads than tensor devices: each is copied (Attention)
        raise ConfigError(f"parallel.tensor={t} neither divides model.n_kv_heads={m.n_kv_heads} nor is a multiple of "
                          f"it (each KV head is then copied to tensor / n_kv_heads devices); choose tensor among "
                          f"{_divisors(m.n_kv_heads)} or a multiple of {m.n_kv_heads} that divides model.n_heads")
    n = sizes["seq"]
    if n > 1:
        need = n * (2 if par.seq_attention == "ring" and par.seq_zigzag else 1)
        if m.seq_len % need:
            why = " (the zig-zag layout cuts it into 2 x seq chunks)" if need > n else ""
            raise ConfigError(f"parallel.seq={n} does not divide model.seq_len={m.seq_len} into {need} equal "
                              f"chunks{why}; choose model.seq_len divisible by {need}")
        if par.seq_attention == "ulysses":
            for key, v in (("n_heads", m.n_heads), ("n_kv_heads", m.n_kv_heads)):
                if v % (n * t):
                    raise ConfigError(f"parallel.seq_attention=ulysses splits heads over seq x tensor = {n * t}: "
                                      f"it does not divide model.{key}={v}; use ring or all_gather, or change "
                                      f"parallel.seq / model.{key}")
    if par.megatron_sp and t > 1 and m.seq_len % (n * t):
        raise ConfigError(f"parallel.megatron_sp=true splits model.seq_len={m.seq_len} over seq x tensor = "
                          f"{n * t}, which does not divide it")
    s_, r_ = sizes["pipe"], par.pipeline_repeats
    if s_ > 1:
        groups = (m.n_layers - first_dense) // every  # a MoE model stacks groups of moe.every layers
        # uneven stages are padded; too few layers refused
        layer_groups(groups, s_, r_, par.stage_layer_list(), moe=every > 1 or first_dense > 0)
        mb = par.microbatches or s_
        if mb < s_:
            raise ConfigError(f"parallel.microbatches={mb} is fewer than the {s_} pipeline stages (parallel.pipe); "
                              f"use at least {s_}")
        if par.zero >= 3:
            raise ConfigError("parallel.zero=3 with parallel.pipe > 1 would all-gather every stage's weights on "
                              "every microbatch iteration; use parallel.zero=1 (optimizer state sharded)")
    zero = math.prod(sizes[a] for a in ZERO_AXES)
    if par.zero >= 1 and m.d_model % zero:
        shown = " x ".join(f"{a}={sizes[a]}" for a in ZERO_AXES if sizes[a] > 1)
        raise ConfigError(f"parallel.zero={par.zero} shards d_model over the axes that split the batch ({shown}): "
                          f"{zero} does not divide model.d_model={m.d_model}; choose data x expert x seq among "
                          f"{_divisors(m.d_model)}, or parallel.zero=0")


def check_batch_fits(batch_size: int, grad_accum: int, sizes: dict[str, int], microbatches: int = 0) -> None:
    dp = sizes["data"] * sizes["expert"]
    micro = batch_size // grad_accum
    if sizes["pipe"] > 1:
        m = microbatches or sizes["pipe"]
        if micro % m or (micro // m) % dp:
            fits = [k for k in range(sizes["pipe"], micro // dp + 1) if micro % k == 0 and (micro // k) % dp == 0]
            given = f"parallel.microbatches={m}" + ("" if microbatches else " (unset: one per stage)")
            fix = (f"set parallel.microbatches to {'one of ' * (len(fits) > 1)}{', '.join(map(str, fits))}" if fits else
                   f"make train.batch_size / train.grad_accum a multiple of {sizes['pipe'] * dp} "
                   f"(parallel.pipe x data x expert)")
            raise ConfigError(f"train.batch_size={batch_size} / train.grad_accum={grad_accum} = {micro} sequences "
                              f"must split into {given} microbatches, each divisible by the batch-parallel size "
                              f"data*expert={dp}; {fix}")
        return
    if micro % dp:
        raise ConfigError(f"train.batch_size={batch_size} / train.grad_accum={grad_accum} = {micro} sequences "
                          f"per microstep is not divisible by the batch-parallel size data*expert={dp}")


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


# ---------------------------------------------------------------------------------------------
# Activation constraints: layers call constrain(x, names); a no-op when no rules are active.

_ACTIVE: contextvars.ContextVar[RuleSet | None] = contextvars.ContextVar("jaxpar_rules", default=None)


@contextlib.contextmanager
def use_rules(rules: RuleSet | None):
    """Make ``rules`` (bound to a mesh) the target of :func:`constrain` / :func:`constrain_weight`."""
    token = _ACTIVE.set(rules)
    try:
        yield rules
    finally:
        _ACTIVE.reset(token)


def active_rules() -> RuleSet | None:
    return _ACTIVE.get()


def _without_rules(names) -> None:
    """No rules are active: fine on one device, an error inside a multi-device ``jax.set_mesh`` (a
    forgotten ``use_rules`` would silently drop every constraint of the model)."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and mesh.size > 1:
        raise RuntimeError(f"a jaxpar layer constrains {tuple(names)} inside a {mesh.size}-device jax.set_mesh, but no "
                           f"jaxpar rules are active: run it under `with layout:` (jaxpar.Layout), layout.jit / "
                           f"layout.train_step, or jaxpar.partitioning.use_rules(rules)")


def constrain(x: jax.Array, names) -> jax.Array:
    """``with_sharding_constraint`` of an activation by logical names (identity without active rules on
    one device; an error without rules inside a multi-device ``jax.set_mesh``)."""
    rules = _ACTIVE.get()
    if rules is None or rules.mesh is None:
        _without_rules(names)
        return x
    return jax.lax.with_sharding_constraint(x, rules.params.sharding(names, x.shape, "activation"))


def constrain_weight(w: jax.Array, names) -> jax.Array:
    """A weight in the layout it is computed in: gathers a ZeRO-3 shard just before use."""
    rules = _ACTIVE.get()
    if rules is None or rules.mesh is None:
        _without_rules(names)
        return w
    return jax.lax.with_sharding_constraint(w, rules.compute.sharding(names, w.shape, "weight"))


def param(value: jax.Array, names) -> nnx.Param:
    """An ``nnx.Param`` annotated with logical axis names (one per dim) for jaxpar's rules.

    Flax's eager sharding is switched off for it: placement is decided by :mod:`jaxpar.partitioning`
    when the state is created under ``jit`` with output shardings, never at construction.
    """
    from flax import nnx

    names = tuple(names)
    if len(names) != value.ndim:
        raise ValueError(f"{len(names)} logical names {names} for an array of rank {value.ndim}")
    return nnx.Param(value, out_sharding=names, eager_sharding=False)

