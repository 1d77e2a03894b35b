"""python -m jaxpar.compile: the shipped GPT-3 175B and Mixtral 8x7B configs compile ahead of time for
1024 and 256 simulated devices without allocating a weight (each in seconds: the full scale is tested).

References: the parameter counts by hand from the published shapes, the per-device state as the total
over the devices, and the compiled collectives against the analytic model of jaxpar.comm.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30


def gpt3_params() -> int:
    """GPT-2 style layer: fused QKV 3d^2, out d^2 (+ bias d), MLP 8d^2 (+ biases 4d + d), two LayerNorms
    4d, query and value biases 2d (no key bias: softmax ignores it); the vocabulary padded to 50304
    (a multiple of 128 and of tensor=8); learned positions; final LayerNorm."""
    d, L = 12288, 96
    return L * (12 * d * d + 12 * d) + 50304 * d + 2048 * d + 2 * d


def mixtral_params() -> int:
    """Q and O d^2 each, K and V d x 1024 (8 KV heads of 128), two RMSNorms, router d x 8, 8 SwiGLU experts
    of 3 d x 14336; untied embedding and head of 32000; final RMSNorm."""
    d, L = 4096, 32
    return L * (2 * d * d + 2 * d * 1024 + 2 * d + 8 * d + 8 * 3 * d * 14336) + 2 * 32000 * d + d


@pytest.mark.parametrize("config,devices,params", [("gpt3_175b.yaml", 1024, gpt3_params()),
                                                   ("mixtral_8x7b.yaml", 256, mixtral_params())])
def test_large_configs_compile_ahead_of_time(tmp_path, config, devices, params):
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    p = subprocess.run([sys.executable, "-m", "jaxpar.compile", "--config", f"configs/{config}", "--hbm-gib", "80",
                        "--json", str(out)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "fits in 80 GiB per device" in p.stdout, p.stdout
    r = json.loads(out.read_text())
    assert r["devices"] == devices and r["parameters"] == params
    state = r["per_device"]["params"] + r["per_device"]["opt"]
    # ZeRO-3 over data x tensor: params and two moments (float32) split over every device, but for a few
    # small vectors (norms, biases) kept whole
    assert 1.0 <= state / (3 * 4 * params / devices) < 1.05
    assert r["per_device"]["total"] < 80 * GIB
    got, model = r["collectives"], r["collectives_model"]["cpu"]
    total = sum(v for by in got.values() for v in by.values())
    for kind in set(got) | set(model):
        for axes in set(got.get(kind, {})) | set(model.get(kind, {})):
            a, b = got.get(kind, {}).get(axes, 0.0), model.get(kind, {}).get(axes, 0.0)
            assert abs(a - b) <= 0.01 * max(a, b) or max(a, b) < 1e-4 * total, (kind, axes, a, b)


def test_bad_input_is_one_line():
    p = subprocess.run([sys.executable, "-m", "jaxpar.compile", "--config", "configs/llama_1b.yaml"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: a parallel size is -1: give --devices N"), p.stderr
