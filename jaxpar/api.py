"""Parallelise your own Flax NNX model: a :class:`Layout` (the mesh and its rules), then shard the
model, shard its optimizer, and jit a train step that runs under the rules.

    jaxpar.simulate_devices(8)                       # CPU-only host: before any JAX computation
    layout = jaxpar.Layout(data=4, tensor=2)
    model = layout.shard(MyModel(nnx.Rngs(0)))
    opt = layout.optimizer(model, optax.adamw(1e-3))
    step = layout.train_step(loss_fn)                # loss_fn(model, *batch) -> scalar loss
    loss = step(model, opt, *layout.batch(inputs, targets))

A parameter is placed by its logical axis names: the ``out_sharding`` metadata that
:func:`jaxpar.partitioning.param` (and so every jaxpar layer) attaches, or ``names=`` for a model
whose parameters carry none (a dict from the parameter's path, ``"attn/qkv/kernel"``, or a callable
``(path, shape) -> names``). A parameter with neither is an error naming it; nothing is silently
replicated. Under ``with layout:`` (which :meth:`Layout.train_step` enters for you) jaxpar's layers
constrain their activations by the rules; a jaxpar constraint met inside a multi-device
``jax.set_mesh`` without rules is an error, not a silent no-op.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from jaxpar.config import ParallelConfig, load_config
from jaxpar.mesh import make_mesh, request_cpu_devices
from jaxpar.partitioning import RuleSet, make_rules, use_rules

Names = tuple  # one logical axis name (or None) per dimension


def simulate_devices(n: int) -> None:
    """Ask XLA:CPU for ``n`` simulated devices (a host without accelerators). Call it before any JAX
    computation; afterwards it raises ``RuntimeError`` naming the device count JAX started with."""
    request_cpu_devices(n)


def _path(p) -> str:
    return "/".join(str(k) for k in p)


class Layout:
    """A mesh of the five axes (``data``, ``pipe``, ``expert``, ``seq``, ``tensor``) and the rules that
    map logical names to it. Keyword arguments are ``parallel.*`` config keys (``zero=1``,
    ``megatron_sp=True``, ...), checked as ``train.py`` checks them; one axis may be -1 (the
    rest of the devices). ``devices`` defaults to all devices, cut to the mesh's size."""

    def __init__(self, *, devices=None, **parallel: Any):
        cfg = load_config(None, {f"parallel.{k}": v for k, v in parallel.items()})
        self.parallel: ParallelConfig = cfg.parallel
        given = devices is not None
        devices = list(jax.devices() if devices is None else devices)
        sizes = [getattr(self.parallel, a) for a in ("data", "pipe", "expert", "seq", "tensor")]
        if -1 not in sizes:
            n = int(np.prod(sizes))
            if n > len(devices):
                layout = dict(zip(("data", "pipe", "expert", "seq", "tensor"), sizes))
                raise ValueError(f"the layout {layout} needs {n} devices and " + (
                    f"devices= lists {len(devices)}" if given else
                    f"{len(devices)} are visible; on a CPU host call jaxpar.simulate_devices({n}) before any JAX "
                    "computation"))
            devices = devices[:n]
        self.mesh = make_mesh(self.parallel, devices)
        self.rules: RuleSet = make_rules(self.parallel, self.mesh)
        self._placed: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # object -> (names, shardings)

    # -- placement ---------------------------------------------------------------------------

    def _names(self, path: str, value, names) -> Names:
        given = None
        if callable(names):
            given = names(path, value.shape)
        elif names is not None:
            given = names.get(path)
        if given is None:
            given = value.get_metadata().get("out_sharding") if hasattr(value, "get_metadata") else None
        if given is None:
            raise TypeError(f"parameter {path!r} (shape {tuple(value.shape)}) has no logical axis names: build it "
                            f"with jaxpar.partitioning.param / jaxpar's layers, or pass names={{{path!r}: (...)}}")
        given = tuple(given)
        if len(given) != len(value.shape):
            raise ValueError(f"parameter {path!r} has rank {len(value.shape)} but names {given}")
        return given

    def param_shardings(self, model: nnx.Module, names: dict | Callable | None = None, which: str = "params"):
        """The ``NamedSharding`` of each ``nnx.Param`` of ``model``, as a state tree (``which`` =
        ``params`` for the parameters, ``opt`` for optimizer state of the parameter's shape)."""
        rules = getattr(self.rules, which)
        state = nnx.state(model, nnx.Param)
        flat = [(p, rules.sharding(self._names(_path(p), v, names), v.shape, f"parameter {_path(p)!r}"))
                for p, v in nnx.to_flat_state(state)]
        shapes = dict((tuple(p), v.shape) for p, v in nnx.to_flat_state(state))
        return nnx.from_flat_state(flat), {tuple(p): (s, shapes[tuple(p)]) for p, s in flat}

    def shard(self, model: nnx.Module, names: dict | Callable | None = None) -> nnx.Module:
        """Place every parameter of ``model`` by its logical names (in place; returns the model)."""
        shardings, _ = self.param_shardings(model, names)
        state = nnx.state(model, nnx.Param)
        nnx.update(model, jax.device_put(state, shardings))
        self._placed[model] = (names, shardings)
        return model

    def optimizer(self, model: nnx.Module, tx, names: dict | Callable | None = None) -> nnx.Optimizer:
        """``nnx.Optimizer(model, tx, wrt=nnx.Param)`` with every state array shaped like a parameter
        placed by that parameter's names under the optimizer rules (ZeRO-1/3 shard it over the batch
        axes), the rest (step counts) replicated."""
        names = names if names is not None else self._placed.get(model, (None, None))[0]
        _, by_path = self.param_shardings(model, names, which="opt")
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        state = nnx.state(opt, nnx.optimizer.OptState)
        replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
        flat = []
        for p, v in nnx.to_flat_state(state):
            p = tuple(p)
            match = next((m for k in range(len(p)) if (m := by_path.get(p[k:])) is not None), None)
            flat.append((p, match[0] if match is not None and match[1] == v.shape else replicated))
        shardings = nnx.from_flat_state(flat)
        nnx.update(opt, jax.device_put(state, shardings))
        self._placed[opt] = (names, shardings)
        return opt

    def batch(self, *arrays):
        """Arrays whose leading dimension is the batch, split over the batch axes (a tuple, or one array); a
        scalar, or a batch that the batch axes do not divide, is a ValueError naming the array and the split."""
        out = []
        for i, a in enumerate(arrays):
            if np.ndim(a) == 0:
                raise ValueError(f"batch: array {i} is a scalar; each array's leading dimension is the batch")
            sharding = self.rules.params.sharding(("batch",) + (None,) * (np.ndim(a) - 1))
            axes = sharding.spec[0] if len(sharding.spec) else None
            names = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
            split = int(np.prod([self.mesh.shape[n] for n in names]))
            if np.shape(a)[0] % split:
                raise ValueError(f"batch: array {i} has {np.shape(a)[0]} rows, which the batch axes "
                                 f"({' x '.join(f'{n}={self.mesh.shape[n]}' for n in names)}) cannot split; give a "
                                 f"multiple of {split}")
            out.append(jax.device_put(a, sharding))
        return out[0] if len(out) == 1 else tuple(out)

    # -- running ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _context(self):
        with jax.set_mesh(self.mesh), use_rules(self.rules):
            yield self

    def __enter__(self):
        self._stack = contextlib.ExitStack()
        return self._stack.enter_context(self._context())

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    def jit(self, fn: Callable) -> Callable:
        """``nnx.jit(fn)`` traced under this layout's mesh and rules."""
        def under_rules(*args, **kwargs):
            with use_rules(self.rules):
                return fn(*args, **kwargs)

        jitted = nnx.jit(under_rules)

        def call(*args, **kwargs):
            with jax.set_mesh(self.mesh):
                return jitted(*args, **kwargs)

        return call

    def train_step(self, loss_fn: Callable) -> Callable:
        """A jitted ``step(model, optimizer, *batch) -> loss``: the gradient of ``loss_fn(model, *batch)``
        applied by the optimizer, under this layout's rules. A model and optimizer placed by this layout
        keep their placement across steps (else XLA may leave parameters in the optimizer's shards)."""
        if not callable(loss_fn):
            raise TypeError(f"train_step(loss_fn): loss_fn must be a function (model, *batch) -> loss, not "
                            f"{type(loss_fn).__name__}")
        compiled: dict = {}

        def build(param_shardings, opt_shardings):
            def step(model, optimizer, *batch):
                loss, grads = nnx.value_and_grad(loss_fn)(model, *batch)
                optimizer.update(model, grads)
                for obj, kind, shardings in ((model, nnx.Param, param_shardings),
                                             (optimizer, nnx.optimizer.OptState, opt_shardings)):
                    if shardings is not None:
                        nnx.update(obj, jax.lax.with_sharding_constraint(nnx.state(obj, kind), shardings))
                return loss

            return self.jit(step)

        def call(model, optimizer, *batch):
            key = (id(model), id(optimizer))
            if key not in compiled:
                compiled[key] = build(self._placed.get(model, (None, None))[1],
                                      self._placed.get(optimizer, (None, None))[1])
            return compiled[key](model, optimizer, *batch)

        return call


def shard(model: nnx.Module, layout: Layout, names: dict | Callable | None = None) -> nnx.Module:
    """``layout.shard(model, names)``."""
    return layout.shard(model, names)
