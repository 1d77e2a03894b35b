"""Tests run on 8 simulated XLA CPU devices (set before JAX starts its backend)."""

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("JAX_NUM_CPU_DEVICES", "8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# jaxpar's data cache (tokenizers, token stores of text sources): one per machine in the temp folder, shared
# by the tests and their subprocesses, never the user's ~/.cache/jaxpar
os.environ.setdefault("JAXPAR_CACHE", os.path.join(tempfile.gettempdir(), "jaxpar-test-cache"))

# The tests compile hundreds of small programs and run each a few steps: LLVM's optimisation of the CPU code
# costs more than it saves there (about half of the suite's time). XLA's HLO passes are unchanged, and with
# them the collectives, buffer sizes and numerics the tests check. XLA:CPU's newer fusion emitters (MLIR) take
# about half of what remains of a compile; its older LLVM IR emitters compile the same fusions in half the time
# (a compile: 13.9 s -> 7.2 s; test_sequence.py: 90 s -> 49 s). Subprocesses that copy this environment
# inherit the flags; flags of the user's XLA_FLAGS come first (a repeated flag: XLA takes the last).
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                  "--xla_cpu_use_fusion_emitters=false")
if TEST_XLA_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()

# Commands the tests run (train.py, python -m jaxpar....) get the same flags (tests/helpers.py, command_env)
os.environ["JAXPAR_TEST_XLA_FLAGS"] = TEST_XLA_FLAGS

# One compilation cache for the run, shared by the pytest-xdist workers and the commands they start: many tests
# compile a program another test compiled (the one-device references, the runs of train.py on one small config).
# It is new for each run (made by the first process, removed by it at the end), so nothing compiled by an
# earlier version of the code is reused; a JAX_COMPILATION_CACHE_DIR of the user's is used as it is.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jaxpar-test-xla-")
    os.environ["JAXPAR_TEST_XLA_CACHE_OWNER"] = str(os.getpid())
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", int(os.environ["JAX_NUM_CPU_DEVICES"]))

sys.path.insert(0, str(Path(__file__).resolve().parent))


# The longest tests go first, so that neither pytest-xdist worker is left alone with one of them at the end
# (the order inside each module is kept: some modules reuse references computed by their earlier tests).
FIRST = ("test_five_axes.py", "test_faults.py", "test_pipeline.py")
# ... and the tests that import torch last (XLA runs a few per cent slower in a process that imported it)
LAST = ("test_hf.py", "test_moe_families.py", "test_deepseek.py", "test_gpt_oss.py", "test_finetune.py")


# The quick tier (-m "not slow", DEVELOPERS.md): a test is slow when it took more than SLOW_SECONDS in the last
# full run (tests/durations.json, made by tools/tiers.py from a --durations=0 report) or is marked so by hand.
SLOW_SECONDS = 3.5
DURATIONS = json.loads((Path(__file__).resolve().parent / "durations.json").read_text())
# ... except these: each mechanism keeps a quick test whose expectation is independent of the code (one device,
# numpy), where its cheaper tests are all consistency checks (DEVELOPERS.md, section 4)
QUICK = {
    "tests/test_collectives.py::test_data_parallel_allreduces_gradients_once",
    "tests/test_pipeline.py::test_loss_and_grads_match_single_device[gpt2-pipe=2-pipeline_schedule=1f1b]",
    # gradient accumulation (and ZeRO-1) under 1F1B
    "tests/test_pipeline.py::test_loss_and_grads_match_single_device[llama_gqa-pipe=2-data=4-zero=1-d_accum=2-"
    "pipeline_schedule=1f1b]",
    "tests/test_sequence.py::test_loss_and_grads_match_single_device[llama_gqa-tensor=4-data=2-megatron_sp=True]",
    "tests/test_moe.py::test_expert_parallel_rounds_equal_one_device_under_skewed_routing[cpu]",
    "tests/test_moe.py::test_balance_loss_is_hf_mixtral_over_top_k_for_one_layer",
    "tests/test_untested_configs.py::test_adamw_steps_with_clipping_and_weight_decay_against_numpy",
    "tests/test_faults.py::test_a_failed_save_is_one_line_and_the_newest_checkpoint_stays",
    # packed documents through 1F1B (rows looked up per microbatch, each microbatch's share of the loss)
    "tests/test_documents.py::test_packed_rows_equal_each_document_alone[llama_gqa-pipe=2-pipeline_schedule=1f1b-"
    "microbatches=4]",
    # uneven pipeline stages (padded storage, padding slots passed over) under 1F1B with tensor
    "tests/test_uneven_stages.py::test_loss_and_grads_equal_one_device[1f1b-5-tensor]",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if DURATIONS.get(item.nodeid, 0.0) > SLOW_SECONDS and item.nodeid not in QUICK:
            item.add_marker(pytest.mark.slow)

    def order(item):
        name = item.path.name
        return FIRST.index(name) if name in FIRST else len(FIRST) + 1 + LAST.index(name) if name in LAST else len(FIRST)

    items.sort(key=order)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("JAXPAR_TEST_XLA_CACHE_OWNER") == str(os.getpid()):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
