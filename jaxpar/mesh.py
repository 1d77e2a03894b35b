"""The device mesh: five named axes, outermost to innermost ``data, pipe, expert, seq, tensor``.

The innermost axis gets neighbouring devices (the fastest links), because tensor parallelism talks
the most. With several processes (hosts) or TPU slices the mesh is hybrid: the slow network (DCN)
is laid over the outermost axes that can absorb it, ICI over the rest.

On a CPU-only host a program may ask for N simulated XLA devices with :func:`request_cpu_devices`
before JAX starts its backend; asking after that is a clear error.
"""

from __future__ import annotations

import math
import os
import re

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from jaxpar.config import ConfigError, DistributedConfig, ParallelConfig

AXES = ("data", "pipe", "expert", "seq", "tensor")


def request_cpu_devices(n: int) -> None:
    """Ask XLA:CPU for ``n`` simulated devices. Must run before the first JAX computation."""
    if n <= 0:
        raise ConfigError(f"number of simulated CPU devices must be positive, got {n}")
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError as e:
        have = jax.local_device_count()
        if jax.default_backend() == "cpu" and have != n:
            raise RuntimeError(
                f"asked for {n} simulated CPU devices after JAX had already started with {have}: call "
                "jaxpar.mesh.request_cpu_devices (or set JAX_NUM_CPU_DEVICES) before any JAX computation"
            ) from e


def axis_sizes(par: ParallelConfig, n_devices: int) -> dict[str, int]:
    """Sizes of the five axes with a -1 filled in; the product must equal ``n_devices``."""
    sizes = {a: getattr(par, a) for a in AXES}
    known = math.prod(v for v in sizes.values() if v != -1)
    free = [a for a, v in sizes.items() if v == -1]
    if free:
        if n_devices % known:
            raise ConfigError(f"parallel.{free[0]}=-1: the other axes ({known} devices) do not divide the "
                              f"{n_devices} devices")
        sizes[free[0]] = n_devices // known
    total = math.prod(sizes.values())
    if total != n_devices:
        shape = " x ".join(f"{a}={v}" for a, v in sizes.items() if v != 1) or "all axes 1"
        raise ConfigError(f"the mesh ({shape}) needs {total} devices but {n_devices} are available; "
                          f"make the product of parallel.data/pipe/expert/seq/tensor equal {n_devices} "
                          "(or set one of them to -1)")
    return sizes


def _dcn_split(sizes: dict[str, int], n_granules: int) -> dict[str, int]:
    """Lay ``n_granules`` (hosts or slices) over the outermost axes, in AXES order."""
    dcn = {a: 1 for a in AXES}
    left = n_granules
    for a in AXES:
        g = math.gcd(left, sizes[a])
        dcn[a], left = g, left // g
    if left != 1:
        raise ConfigError(f"cannot lay {n_granules} hosts/slices over the mesh {sizes}: the outer axes "
                          "must be divisible by the number of hosts")
    return dcn


def make_mesh(par: ParallelConfig, devices=None) -> Mesh:
    """Build the 5-axis mesh (Auto axis types: GSPMD propagates shardings; shard_map may go manual)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = axis_sizes(par, len(devices))
    shape = tuple(sizes[a] for a in AXES)
    slices = {getattr(d, "slice_index", 0) for d in devices}
    n_proc = len({d.process_index for d in devices})
    if len(slices) > 1 or n_proc > 1:
        from jax.experimental import mesh_utils

        granules = len(slices) if len(slices) > 1 else n_proc
        dcn = _dcn_split(sizes, granules)
        ici = tuple(sizes[a] // dcn[a] for a in AXES)
        arr = mesh_utils.create_hybrid_device_mesh(
            ici, tuple(dcn[a] for a in AXES), devices, process_is_granule=len(slices) <= 1)
    elif devices[0].platform == "cpu":
        arr = np.array(devices).reshape(shape)
    else:
        from jax.experimental import mesh_utils

        arr = mesh_utils.create_device_mesh(shape, devices)
    return Mesh(arr, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def setup_devices(par: ParallelConfig, dist: DistributedConfig | None = None) -> list:
    """Before JAX starts: on a host without accelerators, simulate as many CPU devices per process as
    the mesh needs (``parallel.cpu_devices``, or the product of the axis sizes divided by the number
    of processes); then join the multi-process run when ``dist`` asks for one (see
    :mod:`jaxpar.distributed`). Returns the global devices."""
    from jaxpar import distributed

    plan = distributed.plan(dist) if dist is not None else None
    n = par.cpu_devices
    if n == 0:
        sizes = [getattr(par, a) for a in AXES]
        n = math.prod(sizes) if -1 not in sizes else 8
        procs = plan.expected_processes() if plan else 1
        if n % procs:
            raise ConfigError(f"the mesh needs {n} devices, which {procs} processes cannot share equally; "
                              "set parallel.cpu_devices (simulated devices per process)")
        n //= procs
    forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", os.environ.get("XLA_FLAGS", ""))
    if forced and int(forced.group(1)) != n and "JAX_NUM_CPU_DEVICES" not in os.environ:
        raise ConfigError(f"XLA_FLAGS sets --xla_force_host_platform_device_count={forced.group(1)}, but the mesh "
                          f"needs {n} simulated CPU devices per process (parallel.*); remove the flag (jaxpar sets the "
                          f"count from parallel.*) or set it to {n}")
    if "JAX_NUM_CPU_DEVICES" not in os.environ:
        request_cpu_devices(n)
    if plan is not None:
        distributed.initialize(plan)
    try:
        return jax.devices()
    except Exception as e:  # noqa: BLE001 - JAX raises RuntimeError, or AssertionError when no plugin exists
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        platforms = os.environ.get("JAX_PLATFORMS")
        hint = (f"JAX_PLATFORMS={platforms} names a platform this host cannot start; unset it or name one it has "
                "(cpu, cuda, tpu)" if platforms else "check the accelerator's drivers and the installed jax plugin")
        raise PlatformError(f"JAX could not start its backend ({first[:200]}); {hint}") from None


class PlatformError(RuntimeError):
    """JAX could not start a backend (one line: the cause and what to change)."""


def describe(mesh: Mesh) -> str:
    devs = mesh.devices.flat
    d0 = next(iter(devs))
    shape = " x ".join(f"{a}={s}" for a, s in mesh.shape.items())
    return (f"mesh {shape} on {mesh.size} {d0.platform} devices ({d0.device_kind}), "
            f"{jax.process_count()} process(es)")
