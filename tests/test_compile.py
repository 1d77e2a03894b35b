"""python -m jaxpar.compile: the shipped GPT-3 175B and Mixtral 8x7B configs compile ahead of time for
1024 and 256 simulated devices without allocating a weight (each in seconds: the full scale is tested),
the shipped one-node configs of today's dense families (Llama 3.1 8B, Qwen3-8B, Mistral 7B, Gemma 3 4B,
Qwen2.5-7B) for 8 devices of 80 GiB in their planned layouts, Qwen3-30B-A3B and GPT-OSS-20B for 64 and
32 devices, and DeepSeek-V3 (671B) for 2048.

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


def compiled(tmp_path, config: str) -> dict:
    """``python -m jaxpar.compile`` of a shipped config (its own simulated devices) for 80-GiB devices: it must
    say the step fits; returns its JSON report."""
    out = tmp_path / "report.json"
    env = {k: v for k, v in os.environ.items() if k != "JAX_NUM_CPU_DEVICES"}
    p = subprocess.run([sys.executable, "-m", "jaxpar.compile", "--config", f"configs/{config}", "--hbm-gib", "80",
                        "--json", str(out)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "fits in 80 GiB per device" in p.stdout, p.stdout
    return json.loads(out.read_text())


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
    r = compiled(tmp_path, config)
    assert r["devices"] == devices and r["parameters"] == params
    state = r["per_device"]["params"] + r["per_device"]["opt"]
    # ZeRO-3 over data x tensor: params and two moments (float32) split over every device, but for a few
    # small vectors (norms, biases) kept whole
    assert 1.0 <= state / (3 * 4 * params / devices) < 1.05
    assert r["per_device"]["total"] < 80 * GIB
    assert_collectives_match_model(r)


def assert_collectives_match_model(r: dict) -> None:
    """The compiled collectives of a report, by kind and mesh axes, within 1% of jaxpar.comm's model of
    XLA:CPU's (or negligible)."""
    got, model = r["collectives"], r["collectives_model"]["cpu"]
    total = sum(v for by in got.values() for v in by.values())
    for kind in set(got) | set(model):
        for axes in set(got.get(kind, {})) | set(model.get(kind, {})):
            a, b = got.get(kind, {}).get(axes, 0.0), model.get(kind, {}).get(axes, 0.0)
            assert abs(a - b) <= 0.01 * max(a, b) or max(a, b) < 1e-4 * total, (kind, axes, a, b)


def attention_params(d: int, heads: int, kv_heads: int, head_dim: int) -> int:
    """Q and O of d x heads*head_dim, K and V of d x kv_heads*head_dim (no biases)."""
    return 2 * d * heads * head_dim + 2 * d * kv_heads * head_dim


def llama31_8b_params() -> int:
    """Llama 3.1 8B: 32 layers of GQA attention (32 query, 8 KV heads of 128), two RMSNorms and a SwiGLU
    MLP 3 d x 14336; untied embedding and head of 128256 (a multiple of 128 and of tensor=2: no padding);
    final RMSNorm. Meta's published count: 8,030,261,248."""
    d, L = 4096, 32
    return L * (attention_params(d, 32, 8, 128) + 2 * d + 3 * d * 14336) + 2 * 128256 * d + d


def qwen3_8b_params() -> int:
    """Qwen3-8B: 36 layers of attention (32 query, 8 KV heads of head_dim 128) with QK-norm (one weight of
    head_dim for the queries, one for the keys), two RMSNorms, SwiGLU 3 d x 12288; untied embedding and head of
    151936 (a multiple of 128 and of 2); final RMSNorm."""
    d, L, hd = 4096, 36, 128
    return L * (attention_params(d, 32, 8, hd) + 2 * hd + 2 * d + 3 * d * 12288) + 2 * 151936 * d + d


def mistral_7b_params() -> int:
    """Mistral 7B v0.1: Llama's layer (32 query, 8 KV heads of 128, SwiGLU 3 d x 14336, two RMSNorms) x 32;
    untied embedding and head of 32000; final RMSNorm (sliding windows add no weight)."""
    d, L = 4096, 32
    return L * (attention_params(d, 32, 8, 128) + 2 * d + 3 * d * 14336) + 2 * 32000 * d + d


def gemma3_4b_params() -> int:
    """Gemma 3 4B (text): 34 layers of attention (8 query, 4 KV heads of head_dim 256) with QK-norm (2 x 256),
    the four norms of the sandwich layer (before and after attention and MLP), GeGLU 3 d x 10240; one tied
    embedding of 262208 padded to 262272 (a multiple of 128); final norm."""
    d, L, hd = 2560, 34, 256
    return L * (attention_params(d, 8, 4, hd) + 2 * hd + 4 * d + 3 * d * 10240) + 262272 * d + d


def qwen25_7b_params() -> int:
    """Qwen2.5-7B: 28 layers of attention (28 query, 4 KV heads of 128) with biases on Q (3584), K and V
    (512 each), two RMSNorms, SwiGLU 3 d x 18944; untied embedding and head of 152064 (a multiple of 128);
    final RMSNorm."""
    d, L = 3584, 28
    return (L * (attention_params(d, 28, 4, 128) + 28 * 128 + 2 * 4 * 128 + 2 * d + 3 * d * 18944)
            + 2 * 152064 * d + d)


@pytest.mark.parametrize("config,params", [("llama3_8b.yaml", llama31_8b_params()),
                                           ("qwen3_8b.yaml", qwen3_8b_params()),
                                           ("mistral_7b.yaml", mistral_7b_params()),
                                           ("gemma3_4b.yaml", gemma3_4b_params()),
                                           ("qwen2.5_7b.yaml", qwen25_7b_params())])
def test_family_configs_compile_for_one_node(tmp_path, config, params):
    """Each family's shipped config, in the layout planned for 8 x H100 80GB, compiles for its 8 devices
    (tens of seconds each) and fits 80 GiB per device, with the published parameter count."""
    r = compiled(tmp_path, config)
    assert r["devices"] == 8 and r["parameters"] == params
    assert r["per_device"]["total"] < 80 * GIB
    # ZeRO-1: float32 parameters split over tensor only, the two float32 moments over all 8 devices (but for a
    # few small vectors kept whole)
    state = r["per_device"]["params"] + r["per_device"]["opt"]
    assert 1.0 <= state / (4 * params / r["mesh"]["tensor"] + 2 * 4 * params / 8) < 1.01
    assert_collectives_match_model(r)


def qwen3_30b_a3b_params() -> int:
    """Qwen3-30B-A3B: 48 layers of attention (32 query, 4 KV heads of 128) with QK-norm (2 x 128), two RMSNorms, a
    router d x 128 and 128 SwiGLU experts of 3 d x 768; untied embedding and head of 151936 (a multiple of 128);
    final RMSNorm. Published: 30.5B."""
    d, L = 2048, 48
    return L * (attention_params(d, 32, 4, 128) + 2 * 128 + 2 * d + d * 128 + 128 * 3 * d * 768) + 2 * 151936 * d + d


def gpt_oss_20b_params() -> int:
    """GPT-OSS-20B: 24 layers of attention (64 query, 8 KV heads of 64) with biases on Q, K, V (4096 + 2 x 512) and
    O (d), a sink per head (64), two RMSNorms, a router d x 32 with its bias, 32 experts of 3 d x 2880 with their
    biases (2 x 2880 up, d down); untied embedding and head of 201088 (a multiple of 128); final RMSNorm.
    Published: 20.9B."""
    d, L, E, f = 2880, 24, 32, 2880
    attn = attention_params(d, 64, 8, 64) + 4096 + 2 * 512 + d + 64
    moe = d * E + E + E * (3 * d * f + 2 * f + d)
    return L * (attn + 2 * d + moe) + 2 * 201088 * d + d


@pytest.mark.parametrize("config,devices,params", [("qwen3_30b_a3b.yaml", 64, qwen3_30b_a3b_params()),
                                                   ("gpt_oss_20b.yaml", 32, gpt_oss_20b_params())])
def test_moe_family_configs_compile(tmp_path, config, devices, params):
    """The shipped Qwen3-MoE and GPT-OSS configs (expert x data, ZeRO-3, the sorted dropless dispatch) compile
    for their H100 clusters and fit 80 GiB per device, with the published parameter counts; the sorted
    dispatch's exchange rounds are the comm model's (two rounds in XLA:CPU's static count)."""
    r = compiled(tmp_path, config)
    assert r["devices"] == devices and r["parameters"] == params
    state = r["per_device"]["params"] + r["per_device"]["opt"]
    assert 1.0 <= state / (3 * 4 * params / devices) < 1.05  # ZeRO-3: everything split, but small vectors
    assert r["per_device"]["total"] < 80 * GIB
    assert "all-to-all" in r["collectives"]
    assert_collectives_match_model(r)


def deepseek_v3_layer_parts() -> dict:
    """DeepSeek-V3's per-layer pieces (d = 7168, 128 heads; no biases): Multi-head Latent Attention's parts kept
    whole on every device (the query down-projection d x 1536 and its norm, the key/value down-projection d x
    (512 + 64 RoPE) and its norm of 512, the layer's two RMSNorms) and split by heads over tensor (query up
    1536 x 128 x 192, key/value up 512 x 128 x (128 + 128), output 128 x 128 x d); the dense MLP 3 d x 18432;
    the MoE layer's router d x 256 with its correction bias (256), 256 experts of 3 d x 2048 and one shared
    expert of 3 d x 2048."""
    d = 7168
    return {"attn_whole": d * 1536 + 1536 + d * 576 + 512 + 2 * d,
            "attn_heads": 1536 * 128 * 192 + 512 * 128 * 256 + 128 * 128 * d,
            "dense_mlp": 3 * d * 18432, "router": d * 256 + 256, "expert": 3 * d * 2048, "vocab": 129280 * d}


def deepseek_v3_params() -> int:
    """3 dense and 58 MoE layers, untied embedding and head of 129280 (a multiple of 128: no padding), final
    RMSNorm; the multi-token-prediction module is not part of the model. Published: 671B."""
    p, d = deepseek_v3_layer_parts(), 7168
    attn = p["attn_whole"] + p["attn_heads"]
    return 3 * (attn + p["dense_mlp"]) + 58 * (attn + p["router"] + 257 * p["expert"]) + 2 * p["vocab"] + d


def test_deepseek_v3_671b_compiles_for_2048_devices(tmp_path):
    """The shipped DeepSeek-V3 config at its real size (671B parameters, 61 layers, 256 experts) compiles for
    2048 devices (pipe=16 with the 58 MoE layers uneven, expert=32 x tensor=2 x data=2, ZeRO-1, 1F1B) and fits
    80 GiB per device. Each device holds, by hand: the embedding and the head (vocabulary over tensor=2), the
    final norm and the 3 dense first layers (heads and MLP over tensor), all on every stage; and 4 MoE layer
    slots (64 stored slots for 58 layers: 3 or 4 per stage, padded to 4), each with its attention, router and
    shared expert (over tensor) and 256 / 32 experts (their hidden units over tensor): float32, exactly."""
    r = compiled(tmp_path, "deepseek_v3.yaml")
    assert r["devices"] == 2048 and r["parameters"] == deepseek_v3_params() == 671_026_419_200
    p, d, t = deepseek_v3_layer_parts(), 7168, 2
    attn = p["attn_whole"] + p["attn_heads"] // t
    outer = 2 * p["vocab"] // t + d + 3 * (attn + p["dense_mlp"] // t)
    slot = attn + p["router"] + (256 // 32 + 1) * p["expert"] // t
    assert r["per_device"]["params"] == 4 * (outer + 4 * slot)
    assert r["per_device"]["total"] < 80 * GIB
    # every collective as jaxpar.comm models XLA:CPU's within 1%, but the tensor all-reduces within 2% (the model is
    # 1.6% under here: which all-reduces of the recomputed forwards XLA keeps under model.remat=full is not modelled
    # exactly; tests/test_comm.py holds them within 5% on small layouts, MLA's and the lead-in's included)
    got, model = r["collectives"], r["collectives_model"]["cpu"]
    total = sum(v for by in got.values() for v in by.values())
    for kind in set(got) | set(model):
        for axes in set(got.get(kind, {})) | set(model.get(kind, {})):
            a, b = got.get(kind, {}).get(axes, 0.0), model.get(kind, {}).get(axes, 0.0)
            tol = 0.02 if (kind, axes) == ("all-reduce", "tensor") else 0.01
            assert abs(a - b) <= tol * max(a, b) or max(a, b) < 1e-4 * total, (kind, axes, a, b)


def test_bad_input_is_one_line():
    p = subprocess.run([sys.executable, "-m", "jaxpar.compile", "--config", "configs/llama_1b.yaml"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert p.returncode == 2 and p.stderr.startswith("error: a parallel size is -1: give --devices N"), p.stderr
