"""Multi-process (multi-host) runs: one JAX process per host (TPU) or per host/GPU, joined by
``jax.distributed.initialize`` (JAX's own multi-controller runtime).

Every process runs the same ``train.py`` with the same config. Where the coordinator address,
process count and process id come from, first match wins:

1. the ``distributed.*`` config keys (``distributed.coordinator=host:port`` ...);
2. the environment: ``JAXPAR_COORDINATOR``, ``JAXPAR_NUM_PROCESSES``, ``JAXPAR_PROCESS_ID``;
3. JAX's cluster auto-detection (SLURM, Open MPI, Cloud TPU pods), when the job is recognised as
   multi-process or ``distributed.initialize=on``.

Faults: each process sends heartbeats to the coordination service; when a process stops sending
them for ``distributed.heartbeat_timeout`` seconds (it crashed, was killed, or its host died), JAX
terminates every other process with an error naming the dead task, so a run never hangs in a
collective waiting for a peer that is gone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from jaxpar.config import ConfigError, DistributedConfig

ENV_COORDINATOR, ENV_NUM_PROCESSES, ENV_PROCESS_ID = "JAXPAR_COORDINATOR", "JAXPAR_NUM_PROCESSES", "JAXPAR_PROCESS_ID"


@dataclass
class Plan:
    """What :func:`initialize` will pass to ``jax.distributed.initialize`` (None = auto-detect)."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    heartbeat_timeout: int
    init_timeout: int

    def expected_processes(self) -> int:
        """The process count when known before start-up (explicit or from the scheduler), else 1."""
        return self.num_processes or _cluster_size() or 1


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {name}={raw!r} must be an integer") from None


def _cluster_size() -> int | None:
    """Process count of a recognised multi-process job (SLURM, Open MPI, TPU pod), else None."""
    for var in ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE"):
        n = _env_int(var)
        if n and n > 1:
            return n
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    if "," in hosts:
        return len(hosts.split(","))
    return None


def plan(d: DistributedConfig) -> Plan | None:
    """Decide whether and how to join a multi-process run; None = single process."""
    if d.initialize == "off":
        return None
    coordinator = d.coordinator or os.environ.get(ENV_COORDINATOR, "").strip() or None
    num = d.num_processes or _env_int(ENV_NUM_PROCESSES)
    pid = d.process_id if d.process_id >= 0 else _env_int(ENV_PROCESS_ID)
    explicit = coordinator is not None or num is not None or pid is not None
    if d.initialize == "auto" and not explicit and _cluster_size() is None:
        return None
    if coordinator is not None and (num is None or pid is None):
        raise ConfigError(f"distributed.coordinator={coordinator!r} also needs distributed.num_processes and "
                          f"distributed.process_id (or {ENV_NUM_PROCESSES} / {ENV_PROCESS_ID})")
    if num is not None and pid is not None and not 0 <= pid < num:
        raise ConfigError(f"distributed.process_id={pid} must be in [0, distributed.num_processes={num})")
    if coordinator is not None and ":" not in coordinator:
        raise ConfigError(f"distributed.coordinator={coordinator!r} must be host:port, e.g. 10.0.0.1:1234")
    return Plan(coordinator, num, pid, d.heartbeat_timeout, d.init_timeout)


class ClusterError(RuntimeError):
    """This process cannot join the multi-process run (one line: what it tried, for how long)."""


def wait_for_coordinator(address: str, timeout: float) -> None:
    """Until ``timeout`` seconds have passed, try to open a TCP connection to the coordinator at
    ``host:port``; raise :class:`ClusterError` if none succeeded. (JAX's own client aborts the
    process with a C++ fatal error when the coordinator cannot be reached.)"""
    import socket
    import time

    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=min(5.0, timeout)):
                return
        except OSError as e:
            last = e
        if time.monotonic() >= deadline:
            raise ClusterError(f"cannot reach the coordinator at {address} (distributed.coordinator) within "
                               f"distributed.init_timeout={timeout:g}s: {last}; start process 0 first, or check "
                               "the address and the network") from None
        time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def initialize(p: Plan) -> None:
    """Join the run (before the first JAX computation). Blocks until all processes have joined."""
    import jax

    if p.coordinator is not None and p.process_id not in (None, 0):  # process 0 hosts the coordinator
        wait_for_coordinator(p.coordinator, p.init_timeout)
    joined = _give_up_after(p)
    try:
        # JAX's own deadline comes later than ours: when it passes, its client aborts the process
        # with a C++ fatal error and a stack trace instead of raising
        jax.distributed.initialize(coordinator_address=p.coordinator, num_processes=p.num_processes,
                                   process_id=p.process_id, initialization_timeout=p.init_timeout + _GRACE,
                                   heartbeat_timeout_seconds=p.heartbeat_timeout)
    except (RuntimeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = p.coordinator or "the auto-detected coordinator"
        raise ConfigError(f"could not join the multi-process run at {where} (process "
                          f"{p.process_id if p.process_id is not None else '?'} of "
                          f"{p.num_processes or '?'}) within distributed.init_timeout={p.init_timeout}s: "
                          f"{first}") from None
    finally:
        joined.set()


_GRACE = 30  # seconds JAX's own start-up deadline comes after distributed.init_timeout


def _give_up_after(p: Plan):
    """A thread that ends the process with one line when not every process has joined within
    ``distributed.init_timeout`` (a peer that never starts); returns the event that stops it."""
    import sys
    import threading

    joined = threading.Event()

    def watch() -> None:
        if joined.wait(p.init_timeout):
            return
        n = p.num_processes
        print(f"error: process {p.process_id if p.process_id is not None else '?'} of {n or '?'}: not every "
              f"process joined the run at {p.coordinator or 'the auto-detected coordinator'} within "
              f"distributed.init_timeout={p.init_timeout}s; start all {n or 'the'} processes"
              + (f" (distributed.process_id 0..{n - 1})" if n else "")
              + " with the same distributed.coordinator and distributed.num_processes, or raise "
              "distributed.init_timeout", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="jaxpar-join-deadline", daemon=True).start()
    return joined
