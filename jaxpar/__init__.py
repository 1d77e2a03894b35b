"""jaxpar: large-language-model training in JAX / Flax NNX over one mesh of five named axes.

The five parallelism strategies are axes of one device mesh, outermost to innermost ``data``,
``pipe``, ``expert``, ``seq``, ``tensor``. Models name the logical axes of their parameters and
activations (``"embed"``, ``"heads"``, ``"vocab"``, ``"batch"``, ...); the rules of a layout map
those names to mesh axes, and XLA inserts the collectives.

Use it from Python::

    import jaxpar
    jaxpar.simulate_devices(8)                       # on a CPU-only host, before any JAX work
    layout = jaxpar.Layout(data=4, tensor=2)         # the mesh and its rules
    model = layout.shard(MyModel(nnx.Rngs(0)))       # parameters placed by their logical names
    opt = layout.optimizer(model, optax.adamw(1e-3)) # optimizer state sharded like the parameters
    step = layout.train_step(loss_fn)                # jitted, under the layout's rules
    loss = step(model, opt, layout.batch(batch))

or train the shipped models with ``python train.py`` (:func:`jaxpar.run.run` behind it). The names
below are imported on first use, so ``import jaxpar`` itself does not start JAX.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import os
import sys

__version__ = "0.2.0"

# name -> module that defines it
_API = {
    # configuration
    "Config": "jaxpar.config", "ConfigError": "jaxpar.config", "load_config": "jaxpar.config",
    # mesh and rules
    "AXES": "jaxpar.mesh", "make_mesh": "jaxpar.mesh", "request_cpu_devices": "jaxpar.mesh",
    "Rules": "jaxpar.partitioning", "RuleSet": "jaxpar.partitioning", "make_rules": "jaxpar.partitioning",
    "use_rules": "jaxpar.partitioning", "constrain": "jaxpar.partitioning", "param": "jaxpar.partitioning",
    # parallelising your own model
    "Layout": "jaxpar.api", "simulate_devices": "jaxpar.api", "shard": "jaxpar.api",
    # training
    "Trainer": "jaxpar.trainer", "ModelAdapter": "jaxpar.trainer", "run": "jaxpar.run",
    # generation
    "Generator": "jaxpar.generate", "Sampling": "jaxpar.generate", "generate_text": "jaxpar.generate",
}
_SUBMODULES = ("layers", "models", "data", "config", "mesh", "partitioning", "trainer", "run", "api", "generate")

__all__ = ["__version__", *_API, *_SUBMODULES]


def __getattr__(name: str):
    if name in _API:
        value = getattr(importlib.import_module(_API[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        return importlib.import_module(f"jaxpar.{name}")
    raise AttributeError(f"module 'jaxpar' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))


class _CheckoutModels(importlib.abc.MetaPathFinder):
    """Run from a source checkout without installing, ``jaxpar.models`` is the top-level ``models/``
    folder (an install maps it there: see pyproject.toml). Consulted only when nothing else finds it."""

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "models")

    def find_spec(self, fullname, path=None, target=None):
        init = os.path.join(self.folder, "__init__.py")
        if fullname != "jaxpar.models" or not os.path.isfile(init):
            return None
        return importlib.util.spec_from_file_location(fullname, init, submodule_search_locations=[self.folder])


if not any(isinstance(f, _CheckoutModels) for f in sys.meta_path):
    sys.meta_path.append(_CheckoutModels())
