"""Tests run on 8 simulated XLA CPU devices (set before JAX starts its backend)."""

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# jaxpar's data cache (tokenizers, token stores of text sources): one per machine in the temp folder, shared
# by the tests and their subprocesses, never the user's ~/.cache/jaxpar
os.environ.setdefault("JAXPAR_CACHE", os.path.join(tempfile.gettempdir(), "jaxpar-test-cache"))

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

sys.path.insert(0, str(Path(__file__).resolve().parent))


# The longest tests go first, so that neither pytest-xdist worker is left alone with one of them at the end
# (the order inside each module is kept: some modules reuse references computed by their earlier tests).
FIRST = ("test_five_axes.py", "test_faults.py", "test_pipeline.py")
# ... and the tests that import torch last (XLA runs a few per cent slower in a process that imported it)
LAST = ("test_hf.py",)


def pytest_collection_modifyitems(config, items):
    def order(item):
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST) + 1 + LAST.index(name) if name in LAST else len(FIRST)

    items.sort(key=order)
