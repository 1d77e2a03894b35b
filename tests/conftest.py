"""Tests run on 8 simulated XLA CPU devices (set before JAX starts its backend)."""

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

sys.path.insert(0, str(Path(__file__).resolve().parent))
