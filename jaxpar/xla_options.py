"""XLA performance options for the train step on accelerators (``train.xla_perf_options``).

On GPU the train step is compiled with the options MaxText, Levanter and NVIDIA's JAX-Toolbox
set for LLM training, passed per compilation (``lowered.compile(compiler_options=...)``), so
they apply to the train step only and need nothing set before JAX starts:

=====================================================  ============================================
``xla_gpu_enable_latency_hiding_scheduler``            schedule to overlap collectives and compute
``xla_gpu_enable_highest_priority_async_stream``       collectives on a high-priority stream
``xla_gpu_enable_triton_gemm=false``                   cuBLAS for every matmul (MaxText's default)
``xla_gpu_{all_reduce,all_gather,reduce_scatter}``     combine small collectives up to 1 GiB
``_combine_threshold_bytes``                           (all-gather / reduce-scatter: divided by the
                                                       device count, as JAX-Toolbox recommends)
``xla_gpu_enable_pipelined_{all_gather,``              overlap the layer scan's weight gathers,
``reduce_scatter,all_reduce}``                         gradient reductions with the next layer
``xla_gpu_enable_while_loop_double_buffering``         double-buffer the layer scan
=====================================================  ============================================

A flag given in the ``XLA_FLAGS`` environment variable wins over the same option here. An option
that this XLA does not know (flags come and go between versions) is dropped with a note instead of
failing the run. On TPU, libtpu's defaults apply (set ``LIBTPU_INIT_ARGS`` for more); on CPU none.
"""

from __future__ import annotations

import os
import re

import jax

_GIB = 1 << 30


def performance_options(platform: str, n_devices: int) -> dict:
    """jaxpar's default compile options for ``platform`` (empty where it sets none)."""
    if platform != "gpu":
        return {}
    n = max(1, n_devices)
    return {
        "xla_gpu_enable_latency_hiding_scheduler": True,
        "xla_gpu_enable_highest_priority_async_stream": True,
        "xla_gpu_enable_triton_gemm": False,
        "xla_gpu_all_reduce_combine_threshold_bytes": _GIB,
        "xla_gpu_all_gather_combine_threshold_bytes": _GIB // n,
        "xla_gpu_reduce_scatter_combine_threshold_bytes": _GIB // (2 * n),
        "xla_gpu_enable_pipelined_all_gather": True,
        "xla_gpu_enable_pipelined_reduce_scatter": True,
        "xla_gpu_enable_pipelined_all_reduce": True,
        "xla_gpu_enable_while_loop_double_buffering": True,
    }


def user_flags() -> set[str]:
    """Names of the options set in ``XLA_FLAGS`` (they take precedence)."""
    return set(re.findall(r"--(\w+)", os.environ.get("XLA_FLAGS", "")))


def compile_with(lowered, options: dict, log=None):
    """``lowered.compile`` with ``options`` minus those ``XLA_FLAGS`` sets; an option this XLA does
    not know is dropped (noted through ``log``). Returns ``(compiled, options applied)``."""
    options = {k: v for k, v in options.items() if k not in user_flags()}
    while True:
        try:
            return lowered.compile(compiler_options=options or None), options
        except jax.errors.JaxRuntimeError as e:
            unknown = re.search(r"No such compile option: '(\w+)'", str(e))
            if not unknown or unknown.group(1) not in options:
                raise
            options = {k: v for k, v in options.items() if k != unknown.group(1)}
            if log is not None:
                log(f"note: this XLA has no compile option {unknown.group(1)}; compiling without it")
