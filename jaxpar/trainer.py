"""The training engine: sharded state, the jitted train step, and its compiled report.

State is a plain pytree ``{"step", "params", "opt", "skipped"}``; ``params`` is a nested dict of
arrays (the model's ``nnx.Param`` leaves), ``opt`` the optax state, ``step`` the batches consumed and
``skipped`` how many of them were skipped because their loss or gradients were not finite (such a
step leaves ``params`` and ``opt`` bit-identical). Every leaf's sharding is computed
from the logical names the model declared and the rules of :mod:`jaxpar.partitioning`:

* parameters follow the ``params`` rules (ZeRO-3 adds ``data`` on ``embed``);
* optimizer moments follow the ``opt`` rules (ZeRO-1 and up add ``data`` on ``embed``);
* the batch is split over ``batch -> (data, expert)``.

The state is created inside ``jit`` with these output shardings, so no host ever holds the whole
model, and the step is compiled once, with the state donated. Long by design: state, layer order,
the step (gradient accumulation, loss weights, fault handling), compilation and batch placement meet here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar import flops, hlo, xla_options
from jaxpar.config import Config, ConfigError
from jaxpar.layers import attention_ops
from jaxpar.layers.loss import DOC_KEYS, loss_chunks
from jaxpar.layers.precision import compute_dtype
from jaxpar.layers.remat import check_supported as check_remat
from jaxpar.mesh import make_mesh
from jaxpar.optim import lr_schedule, make_optimizer
from jaxpar.partitioning import (check_batch_fits, check_model_fits, layer_groups, make_rules, stack_slots,
                                 use_rules)

BATCH_KEYS = ("inputs", "targets")


def batch_dtype(key: str):
    """A batch field's dtype: float32 loss weights, int32 ids otherwise."""
    return jnp.float32 if key == "weights" else jnp.int32


def _axes_of(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry."""
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _without(entry, axis: str):
    rest = tuple(a for a in _axes_of(entry) if a != axis)
    return None if not rest else rest[0] if len(rest) == 1 else rest


def _get(tree: dict, path: tuple):
    for k in path:
        tree = tree[k]
    return tree


def _nest(items) -> dict:
    out: dict = {}
    for path, v in items:
        node = out
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = v
    return out


class ModelAdapter:
    """Converts between an NNX model and a plain nested dict of its parameters.

    ``build`` is a zero-argument callable creating the model (run abstractly here, for real
    inside the jitted initialiser). The model must hold only ``nnx.Param`` state.
    """

    def __init__(self, build):
        self.build = build
        abstract = nnx.eval_shape(build)
        self.abstract_model = abstract
        self.graphdef, state, rest = nnx.split(abstract, nnx.Param, ...)
        if jax.tree.leaves(rest):
            raise TypeError("jaxpar models may only hold nnx.Param state")
        self.treedef = jax.tree.structure(state)
        flat = list(nnx.to_flat_state(state))
        self.paths = [tuple(str(k) for k in p) for p, _ in flat]
        self.axes = _nest((p, tuple(v.get_metadata()["out_sharding"])) for p, (_, v) in zip(self.paths, flat))
        self.abstract = _nest((p, jax.ShapeDtypeStruct(v.shape, v.dtype)) for p, (_, v) in zip(self.paths, flat))

    def params_of(self, model: nnx.Module) -> dict:
        _, state, *_ = nnx.split(model, nnx.Param, ...)
        return _nest((tuple(str(k) for k in p), v[...]) for p, v in nnx.to_flat_state(state))

    def model(self, params: dict) -> nnx.Module:
        leaves = [_get(params, p) for p in self.paths]
        return nnx.merge(self.graphdef, jax.tree.unflatten(self.treedef, leaves))


class Trainer:
    """Builds mesh, rules, shardings, optimizer and the compiled train step for a :class:`Config`.

    ``build_model(cfg, tensor=, seed=)`` creates the model; by default the ``model.arch`` registry of
    :mod:`jaxpar.models`. Its ``loss(inputs, targets)`` returns ``(loss, metrics)``; a ``ce_loss`` metric, when
    present, is what evaluation reports (the loss may carry auxiliary terms). A model may define
    ``after_update(params, metrics) -> (params, metrics)``: a pure function run in the step after the
    optimizer update (skipped with it on a non-finite step), for parameters moved by a rule rather than
    a gradient (the MoE routing bias); its gradient-free parameters get zero gradients, which AdamW
    turns into zero updates (they are not weight-decayed: no ``embed`` dim).
    """

    def __init__(self, cfg: Config, mesh=None, build_model=None):
        self.cfg = cfg
        self.mesh = mesh if mesh is not None else make_mesh(cfg.parallel)
        self.sizes = dict(self.mesh.shape)
        self.platform = self.mesh.devices.flat[0].platform
        check_remat(cfg.model.remat, self.mesh.devices.flat[0])
        check_model_fits(cfg.model, cfg.parallel, self.sizes, *cfg.moe.stacking(cfg.model.arch))
        check_batch_fits(cfg.train.batch_size, cfg.train.grad_accum, self.sizes, cfg.parallel.microbatches)
        if build_model is None:
            from jaxpar.models import build_model as default_build

            build_model = default_build
        tensor, seed = self.sizes["tensor"], cfg.train.seed
        self.adapter = ModelAdapter(lambda: build_model(cfg, tensor=tensor, seed=seed))
        self.groups = self._layer_groups()
        # the rules carry the resolved uneven stages (parallel.stage_layers), which the model's Stack reads
        self.rules = make_rules(dataclasses.replace(cfg.parallel, stage_layers=",".join(map(str, self.groups or ()))),
                                self.mesh)
        axes = self.adapter.axes
        abstract = self.stored_shapes(self.adapter.abstract)  # the stacked layers padded for uneven stages

        def specs(rules):
            return jax.tree.map(lambda a, ax: rules.spec(ax, a.shape, f"parameter with dims {ax}"), abstract, axes)

        self.param_specs = specs(self.rules.params)
        opt_param_specs = specs(self.rules.opt)
        m = cfg.model.resolved()  # a position table longer than the context: its unused rows stay as they are
        longer = m.positions == "learned" and m.max_positions > m.seq_len
        self.tx = make_optimizer(cfg.train, axes, positions_used=m.seq_len if longer else None)
        self.schedule = lr_schedule(cfg.train)
        opt_abstract = jax.eval_shape(self.tx.init, abstract)
        self.opt_specs = optax.tree_map_params(self.tx, lambda _, s: s, opt_abstract, opt_param_specs,
                                               transform_non_params=lambda _: P(),
                                               is_leaf=lambda x: isinstance(x, P))
        ns = lambda s: NamedSharding(self.mesh, s)  # noqa: E731
        self.state_shardings = {
            "step": ns(P()), "skipped": ns(P()),
            "params": jax.tree.map(ns, self.param_specs, is_leaf=lambda x: isinstance(x, P)),
            "opt": jax.tree.map(ns, self.opt_specs, is_leaf=lambda x: isinstance(x, P)),
        }
        # gradients live where the optimizer state does: under ZeRO-1 they are reduce-scattered
        # straight into the optimizer's shards (no all-reduce of the whole gradient)
        self.grad_shardings = jax.tree.map(ns, opt_param_specs, is_leaf=lambda x: isinstance(x, P))
        self.abstract_state = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": abstract, "opt": opt_abstract,
             "skipped": jax.ShapeDtypeStruct((), jnp.int32)},
            self.state_shardings)
        # the state as checkpoints hold it (layers in layer order, no padding): abstract_state unless the
        # stages are uneven, whose unpadded layer dims cannot split over pipe (_layer_order_sharding)
        self.abstract_layer_state = self.abstract_state if self.groups is None else jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=self._layer_order_sharding(s, a.shape)),
            {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": self.adapter.abstract,
             "opt": jax.eval_shape(self.tx.init, self.adapter.abstract),
             "skipped": jax.ShapeDtypeStruct((), jnp.int32)},
            self.state_shardings)
        self._check_replication()
        seq = cfg.model.seq_len
        self.batch_sharding = self.rules.params.sharding(("batch", "length"))
        b = cfg.train.batch_size
        self.batch_keys = BATCH_KEYS + (DOC_KEYS if cfg.data.packing == "documents" else ())
        self.abstract_batch = {k: jax.ShapeDtypeStruct((b, seq), batch_dtype(k), sharding=self.batch_sharding)
                               for k in self.batch_keys}
        self._step_jit = jax.jit(self._step, in_shardings=(self.state_shardings, self.batch_sharding),
                                 out_shardings=(self.state_shardings, None), donate_argnums=0)
        self._compiled: jax.stages.Compiled | None = None  # set by compile()
        self._converters: dict = {}

    # -- sizes -----------------------------------------------------------------------------------
    def param_count(self) -> int:
        return sum(math.prod(a.shape) for a in jax.tree.leaves(self.adapter.abstract))

    def per_device_bytes(self, which: str) -> int:
        """Bytes of ``params`` or ``opt`` held by one device under the shardings."""
        tree = self.abstract_state[which]
        return sum(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(tree))

    def replication(self) -> dict:
        """Per-device bytes of parameters + optimizer state (``held``), what a layout sharding every
        byte over all devices would hold (``ideal`` = total / devices), and the ``fraction`` of the
        held bytes that are replicas beyond that (0: nothing replicated; data parallelism without
        ZeRO over N devices: 1 - 1/N)."""
        held = self.per_device_bytes("params") + self.per_device_bytes("opt")
        total = sum(math.prod(s.shape) * s.dtype.itemsize for w in ("params", "opt")
                    for s in jax.tree.leaves(self.abstract_state[w]))
        ideal = total / self.mesh.size
        return {"held": held, "ideal": ideal, "fraction": max(0.0, 1 - ideal / held) if held else 0.0}

    def _check_replication(self) -> None:
        limit = self.cfg.parallel.max_replicated_fraction
        rep = self.replication()
        if rep["fraction"] > limit:
            raise ConfigError(
                f"parallel.max_replicated_fraction={limit}: this layout keeps {100 * rep['fraction']:.1f}% of its "
                f"per-device parameter and optimizer bytes as replicas ({rep['held'] / 2**20:.1f} MiB per device where "
                f"sharding everything over the {self.mesh.size} devices would need {rep['ideal'] / 2**20:.1f} MiB); "
                "shard more (parallel.zero=1 or 3, tensor, pipe) or raise the limit")

    def compute_report(self) -> list[str]:
        """Start-up lines: compute dtype, attention kernel, remat policy and loss chunking of this run."""
        m, par = self.cfg.model.resolved(), self.cfg.parallel
        dtype = jnp.dtype(compute_dtype(m.compute_dtype, self.platform))
        n = self.sizes["seq"]
        strategy = par.seq_attention if n > 1 else None
        kernel = attention_ops.describe(m.attention, dtype=dtype, head_dim=m.head_dim, n_heads=m.n_heads,
                                        n_kv_heads=m.n_kv_heads, platform=self.platform,
                                        seq_len=m.seq_len if strategy in (None, "ulysses") else m.seq_len // n)
        if strategy:
            kernel += f"; context-parallel {strategy} over seq={n}" + (" (XLA blocks)" if strategy == "ring" else "")
        rows = self.cfg.train.batch_size // self.cfg.train.grad_accum // (self.sizes["data"] * self.sizes["expert"])
        s_ = self.sizes["pipe"]  # a pipeline's loss: in chunks of at most one microbatch (jaxpar.layers.loss)
        chunks = loss_chunks(rows, m.seq_len // n, m.loss_chunk_tokens, (par.microbatches or s_) if s_ > 1 else 1)
        return [f"compute: {dtype.name} matmuls, {m.param_dtype} parameters; attention kernel: {kernel}; "
                f"remat: {m.remat}; loss: head + cross-entropy in {chunks} chunk(s) of "
                f"{rows * m.seq_len // n // chunks} tokens per device"]

    # -- state -----------------------------------------------------------------------------------
    def init_state(self, params: dict | None = None) -> dict:
        """Parameters and optimizer state, created already sharded (inside jit); ``params`` (already
        placed with :attr:`state_shardings`, in storage order, e.g. from :func:`jaxpar.hf.load_params`)
        replace the model's initialisation."""

        def init(params):
            if params is None:
                with use_rules(self.rules):
                    params = self.to_storage_order(self.adapter.params_of(self.adapter.build()))
            zero = jnp.zeros((), jnp.int32)
            return {"step": zero, "params": params, "opt": self.tx.init(params), "skipped": zero}

        if params is None:
            return jax.jit(lambda: init(None), out_shardings=self.state_shardings)()
        return jax.jit(init, out_shardings=self.state_shardings)(params)

    def _layer_groups(self) -> tuple[int, ...] | None:
        """The layers of each pipeline group when the stages are uneven (``parallel.stage_layers``, or a
        layer count the stages do not divide: :func:`jaxpar.partitioning.layer_groups`), else None."""
        s_, r_ = self.sizes["pipe"], self.cfg.parallel.pipeline_repeats
        axes = jax.tree.leaves(self.adapter.axes, is_leaf=lambda x: isinstance(x, tuple))
        stacked = {a.shape[0] for a, ax in zip(jax.tree.leaves(self.adapter.abstract), axes)
                   if ax and ax[0] == "layers"}
        if s_ == 1 or not stacked:
            return None
        if len(stacked) > 1:
            raise ConfigError(f"the model has stacks of {sorted(stacked)} layers over pipe: a pipeline runs one "
                              "stack (the others: Stack.create(axis='sublayers'))")
        counts = layer_groups(stacked.pop(), s_, r_, self.cfg.parallel.stage_layer_list())
        return counts if len(set(counts)) > 1 else None

    def stored_shapes(self, tree: dict) -> dict:
        """``tree``'s shapes as the state stores them: the stacked layer dims padded to max(groups) slots per
        pipeline group when the stages are uneven."""
        if self.groups is None:
            return tree
        slots = stack_slots(sum(self.groups), self.sizes["pipe"], self.cfg.parallel.pipeline_repeats, self.groups)
        return jax.tree.map(lambda a, ax: jax.ShapeDtypeStruct((slots, *a.shape[1:]), a.dtype)
                            if ax and ax[0] == "layers" else a, tree, self.adapter.axes,
                            is_leaf=lambda x: isinstance(x, jax.ShapeDtypeStruct))

    def _layer_order_sharding(self, sharding: NamedSharding, shape: tuple) -> NamedSharding:
        """Where a leaf of the layer-order state lives (uneven stages): as ``sharding`` with ``pipe`` moved from
        a layer dim the stages do not divide to the first other dim it divides (kept split, not copied:
        each device holds 1/pipe of the layers' bytes), or dropped where none does."""
        spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
        if not spec or shape[0] % self.sizes["pipe"] == 0 or "pipe" not in _axes_of(spec[0]):
            return sharding
        spec[0] = _without(spec[0], "pipe")
        for i in range(1, len(shape)):
            k = math.prod(self.sizes[a] for a in _axes_of(spec[i])) * self.sizes["pipe"]
            if shape[i] % k == 0:
                spec[i] = (*_axes_of(spec[i]), "pipe")
                break
        return NamedSharding(self.mesh, P(*spec))

    def layer_order(self, n: int) -> np.ndarray:
        """``order[p]``: the layer a stack of ``n`` layers stores at position p on this layout, -1 for the
        padding of uneven stages (:func:`jaxpar.layers.stack.storage_order`)."""
        from jaxpar.layers.stack import storage_order, v_shaped

        return storage_order(n, self.sizes["pipe"], self.cfg.parallel.pipeline_repeats, self.groups,
                             v_shaped(self.cfg.parallel))

    def _restack(self, inverse: bool):
        """``(stacked, fn)``: which leaves are stacked layers, and ``fn(a, stacked)`` moving one from layer
        order to storage order (``inverse``: back); None when storage is layer order."""
        if self.sizes["pipe"] == 1 or (self.cfg.parallel.pipeline_repeats == 1 and self.groups is None):
            return None
        stacked = jax.tree.map(lambda ax: bool(ax) and ax[0] == "layers", self.adapter.axes,
                               is_leaf=lambda x: isinstance(x, tuple))
        n = sum(self.groups) if self.groups else None

        from jaxpar.layers.stack import restack as restack_rows

        def restack(a, is_stacked):
            return restack_rows(a, self.layer_order(n or a.shape[0]), inverse) if is_stacked else a

        return stacked, restack

    def to_storage_order(self, params: dict) -> dict:
        """Stacked layers in the layout's storage order (:func:`jaxpar.layers.stack.storage_order`; uneven
        stages' padding slots zero); the model builds them in layer order, so the same seed gives the same
        layers on every mesh."""
        perm = self._restack(inverse=False)
        return params if perm is None else jax.tree.map(perm[1], params, perm[0])

    def _convert_state(self, state: dict, inverse: bool) -> dict:
        if inverse not in self._converters:  # compiled once per direction (a save happens many times)
            perm = self._restack(inverse)
            if perm is None:
                self._converters[inverse] = None
            else:
                stacked, restack = perm

                def convert(st):
                    opt = optax.tree_map_params(self.tx, restack, st["opt"], stacked,
                                                transform_non_params=lambda x: x)
                    return {**st, "params": jax.tree.map(restack, st["params"], stacked), "opt": opt}

                out = self.abstract_layer_state if inverse else self.abstract_state
                self._converters[inverse] = jax.jit(convert, out_shardings=jax.tree.map(lambda a: a.sharding, out))
        convert = self._converters[inverse]
        return state if convert is None else convert(state)

    def state_to_layer_order(self, state: dict) -> dict:
        """The state with stacked layers (parameters and their optimizer moments) in layer order, as
        checkpoints hold them (:attr:`abstract_layer_state`); the identity unless the pipeline is circular
        or uneven."""
        return self._convert_state(state, inverse=True)

    def state_from_layer_order(self, state: dict) -> dict:
        """Inverse of :meth:`state_to_layer_order` (after restoring a checkpoint)."""
        return self._convert_state(state, inverse=False)

    def params_in_layer_order(self, params: dict) -> dict:
        """``params`` (storage order) with the stacked layers in layer order, unpadded (for generation, which
        scans the layers)."""
        perm = self._restack(inverse=True)
        if perm is None:
            return params
        if "params" not in self._converters:
            stacked, restack = perm
            out = jax.tree.map(lambda a: a.sharding, self.abstract_layer_state["params"])
            self._converters["params"] = jax.jit(lambda p: jax.tree.map(restack, p, stacked), out_shardings=out)
        return self._converters["params"](params)

    # -- the step --------------------------------------------------------------------------------
    def loss_fn(self, params: dict, batch: dict, denominator=None):
        """The model's loss and metrics of ``batch``; packed documents' fields (``data.packing=documents``)
        go to the model's loss as keywords, with ``denominator`` (the trained tokens the weighted loss is
        divided by; None: the batch's own)."""
        docs = {k: batch[k] for k in DOC_KEYS if k in batch}
        if docs and denominator is not None:
            docs["loss_denominator"] = denominator
        with use_rules(self.rules):
            model: Any = self.adapter.model(params)  # any nnx.Module with loss(inputs, targets) (class docstring)
            loss, aux = model.loss(batch["inputs"], batch["targets"], **docs)
        if docs:
            aux = {**aux, "trained_tokens": jnp.sum(batch["weights"])}
        return loss, aux

    def grads(self, params: dict, batch: dict):
        """Mean loss, aux metrics and gradients over the batch, accumulated over ``grad_accum`` microsteps.

        Microstep ``k`` takes rows ``k, k+K, k+2K ...`` so that every microbatch stays split over the
        batch axes without moving data. With loss weights (packed documents) each microstep divides its
        weighted loss by the whole batch's trained tokens / K, so that the mean over microsteps is the
        batch's weighted mean however the trained tokens fall into microsteps.
        """
        grad_fn = jax.value_and_grad(self.loss_fn, has_aux=True)
        k = self.cfg.train.grad_accum
        if k == 1:
            (loss, aux), grads = grad_fn(params, batch)
            return loss, aux, grads
        denominator = jnp.sum(batch["weights"].astype(jnp.float32)) / k if "weights" in batch else None
        rules = self.rules.params
        micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)
        micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
            x, rules.sharding((None, "batch", "length"), x.shape)), micro)

        def body(acc, mb):
            (loss, aux), g = grad_fn(params, mb, denominator)
            return jax.tree.map(jnp.add, acc, g), (loss, aux)

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, (losses, auxs) = jax.lax.scan(body, zeros, micro)
        grads = jax.tree.map(lambda g: g / k, grads)
        aux = jax.tree.map(lambda a: jnp.mean(a, axis=0), auxs)
        if "trained_tokens" in aux:  # a count: the sum over microsteps
            aux["trained_tokens"] = jnp.sum(auxs["trained_tokens"])
        return jnp.mean(losses), aux, grads

    def _step(self, state: dict, batch: dict):
        loss, aux, grads = self.grads(state["params"], batch)
        nan_steps = self.cfg.debug.nan_step_list()
        if nan_steps:  # fault injection (debug.nan_steps): this step's loss and gradients become NaN
            poison = jnp.where(jnp.isin(state["step"], jnp.asarray(nan_steps)), jnp.nan, 1.0)
            loss, grads = loss * poison, jax.tree.map(lambda g: g * poison.astype(g.dtype), grads)
        grads = jax.lax.with_sharding_constraint(grads, self.grad_shardings)
        grad_norm = optax.tree.norm(grads)
        # A non-finite loss or gradient (an inf/NaN in any leaf makes the norm non-finite) skips the
        # update: parameters and optimizer state (its step counts included) stay bit-identical. The
        # update runs inside a cond, so that it writes the (donated) state in place: a select between
        # the new and the old state would hold a second copy of all of it.
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        # a model's update of non-gradient parameters (class docstring)
        after = getattr(self.adapter.abstract_model, "after_update", None)

        def after_update(params, aux):  # under the rules: per-layer values go to storage order (Stack)
            with use_rules(self.rules):
                return after(params, aux)

        def update(params, opt, aux):
            updates, opt = self.tx.update(grads, opt, params)
            params = optax.apply_updates(params, updates)
            if after is not None:
                params, aux = after_update(params, aux)
            return params, opt, aux

        def skip(params, opt, aux):  # the same metrics (a hook may change their keys), the state unchanged
            return params, opt, (after_update(params, aux)[1] if after is not None else aux)

        params, opt, aux = jax.lax.cond(finite, update, skip, state["params"], state["opt"], aux)
        skipped = state["skipped"] + (~finite).astype(jnp.int32)
        metrics = {"loss": loss, "grad_norm": grad_norm, "lr": self.schedule(state["step"] - state["skipped"]),
                   "nonfinite": (~finite).astype(jnp.int32), "skipped_steps": skipped, **aux}
        new = {"step": state["step"] + 1, "params": params, "opt": opt, "skipped": skipped}
        return new, metrics

    def lower(self):
        return self._step_jit.lower(self.abstract_state, self.abstract_batch)

    def compile(self, log=None) -> dict:
        """Compile the step once (with :mod:`jaxpar.xla_options` on accelerators unless
        ``train.xla_perf_options=false``); returns the compile report: memory, the program's own flop
        counts and collectives (the hardware side), the applied XLA options, and the model flops
        MFU is computed from (:mod:`jaxpar.flops`)."""
        options = (xla_options.performance_options(self.platform, self.mesh.size)
                   if self.cfg.train.xla_perf_options else {})
        self._compiled, applied = xla_options.compile_with(self.lower(), options, log)
        rep = hlo.compile_report(self._compiled, self.sizes)
        rep["xla_options"] = applied
        per_step = flops.model_flops_per_step(self.cfg)
        rep["model_flops"] = {"per_token": flops.model_flops_per_token(self.cfg), "per_step": per_step,
                              "per_step_per_device": per_step / self.mesh.size,
                              "formula": "per token: 6 * N_matmul + 6 * n_layers * seq_len * n_heads * head_dim"}
        return rep

    def hlo_text(self) -> str:
        if self._compiled is None:
            self.compile()
        assert self._compiled is not None  # compile() sets it
        text = self._compiled.as_text()
        if text is None:
            raise RuntimeError("XLA gives no HLO text for the compiled train step on this backend")
        return text

    def step(self, state: dict, batch: dict):
        """One optimizer step; ``state`` is donated (do not reuse it)."""
        if self._compiled is None:
            self.compile()
        assert self._compiled is not None  # compile() sets it
        return self._compiled(state, batch)

    def logits(self, params: dict, tokens: jax.Array) -> jax.Array:
        """The model's logits for ``tokens`` (for sampling), under this run's rules."""
        with use_rules(self.rules):
            return self.adapter.model(params)(tokens)

    # -- evaluation ------------------------------------------------------------------------------
    def eval_loss(self, params: dict, batch: dict) -> jax.Array:
        """Mean loss (``ce_loss`` when the model reports it) of a batch, without gradients; compiled once."""
        def ce(p, b):
            loss, aux = self.loss_fn(p, b)
            return aux.get("ce_loss", loss)

        if not hasattr(self, "_eval_jit"):
            self._eval_jit = jax.jit(ce,
                                     in_shardings=(self.state_shardings["params"], self.batch_sharding))
        return self._eval_jit(params, batch)

    # -- data ------------------------------------------------------------------------------------
    def local_rows(self) -> slice:
        """The contiguous rows of the global batch that this process's devices hold."""
        shape = (self.cfg.train.batch_size, self.cfg.model.seq_len)
        idx = [i for i in self.batch_sharding.addressable_devices_indices_map(shape).values()
               if i is not None]  # None: a device that holds no slice
        starts = [i[0].start or 0 for i in idx]
        stops = [shape[0] if i[0].stop is None else i[0].stop for i in idx]
        return slice(min(starts), max(stops))

    def place_batch(self, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """This process's rows (see :meth:`local_rows`) -> global arrays split over the batch axes."""
        shape = (self.cfg.train.batch_size, self.cfg.model.seq_len)
        missing = [k for k in self.batch_keys if k not in local]
        if missing:
            raise ConfigError(f"the batch has no {', '.join(missing)}: data.packing={self.cfg.data.packing} needs "
                              f"{', '.join(self.batch_keys)} (a source of packed documents gives them)")
        return {k: jax.make_array_from_process_local_data(self.batch_sharding, np.asarray(local[k], batch_dtype(k)),
                                                          shape) for k in self.batch_keys}
