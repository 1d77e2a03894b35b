"""Throughput accounting: model flops against hand counts, device peaks, MFU in the metrics, the
XLA performance options, and the start-up report."""

import json
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import pytest

from helpers import config, trainer
from jaxpar import xla_options
from jaxpar.config import load_config
from jaxpar.flops import matmul_params, model_flops_per_step, model_flops_per_token, peak_flops
from jaxpar.mesh import make_mesh
from jaxpar.partitioning import make_rules

ROOT = Path(__file__).resolve().parents[1]


def test_gpt2_124m_hand_count():
    """GPT-2 small: per layer Q,K,V,O = 4 d^2 and the MLP 8 d^2; the tied head d V (the real 50257,
    not the padded 50304). Attention: 6 L T d per token (causal half of QK^T and PV, times 3)."""
    cfg = load_config(ROOT / "configs/gpt2_124m.yaml")
    L, d, V, T = 12, 768, 50257, 1024
    n = L * 12 * d * d + d * V
    assert matmul_params(cfg) == n == 123_532_032  # the familiar "124M" minus positions, norms, biases
    assert model_flops_per_token(cfg) == 6 * n + 6 * L * T * d
    assert model_flops_per_step(cfg) == (6 * n + 6 * L * T * d) * 256 * 1024


def test_llama_1b_hand_count():
    """Llama 1.1B: GQA 32 query / 8 KV heads of 64, SwiGLU 5632 (three matrices), untied head."""
    cfg = load_config(ROOT / "configs/llama_1b.yaml")
    L, d, H, KV, hd, F, V, T = 22, 2048, 32, 8, 64, 5632, 32000, 2048
    per_layer = d * (H + 2 * KV) * hd + H * hd * d + 3 * d * F
    assert matmul_params(cfg) == L * per_layer + d * V
    assert model_flops_per_token(cfg) == 6 * (L * per_layer + d * V) + 6 * L * T * H * hd


def test_moe_counts_active_experts_only():
    """8 experts, top-2, every 2nd layer MoE: a MoE layer multiplies the router and 2 experts' MLPs."""
    cfg = load_config(ROOT / "configs/moe.yaml", ["moe.every=2", "model.n_layers=4"])
    m = cfg.model.resolved()
    d, hd, H, KV, V, T = m.d_model, m.head_dim, m.n_heads, m.n_kv_heads, m.vocab_size, m.seq_len
    mult = 3 if m.mlp == "swiglu" else 2
    attn = d * (H + 2 * KV) * hd + H * hd * d
    ff_e = cfg.moe.d_ff or m.d_ff
    want = 2 * (attn + mult * d * m.d_ff) + 2 * (attn + d * cfg.moe.n_experts + 2 * mult * d * ff_e) + d * V
    assert matmul_params(cfg) == want
    assert model_flops_per_token(cfg) == 6 * want + 6 * 4 * T * H * hd


@pytest.mark.parametrize("kind, tflops", [
    ("NVIDIA H100 80GB HBM3", 989), ("NVIDIA H100 PCIe", 756), ("NVIDIA H200", 989), ("NVIDIA A100-SXM4-80GB", 312),
    ("TPU v4", 275), ("TPU v5 lite", 197), ("TPU v5", 459), ("TPU v5p", 459), ("TPU v6 lite", 918)])
def test_peak_by_device_kind(kind, tflops):
    assert peak_flops(SimpleNamespace(device_kind=kind)) == tflops * 1e12


def test_peak_unknown_and_override():
    cpu = jax.devices()[0]
    assert peak_flops(cpu) is None
    assert peak_flops(cpu, override_tflops=123.0) == 123e12


def test_rule_table_shows_only_split_names():
    one = make_rules(load_config(None).parallel, make_mesh(load_config(None).parallel, jax.devices()[:1]))
    assert "no name maps to a mesh axis of size > 1" in one.table()
    par = load_config(None, ["parallel.data=2", "parallel.tensor=2", "parallel.zero=1"]).parallel
    table = make_rules(par, make_mesh(par, jax.devices()[:4])).table()
    names = [line.split()[0] for line in table.splitlines()[2:-1]]
    assert set(names) == {"act_heads", "act_kv_heads", "act_mlp", "act_vocab", "batch", "embed", "expert_embed",
                          "heads", "kv_heads", "mlp", "vocab"}, names  # (expert_)embed: ZeRO-1's optimizer split


def test_gpu_options_are_known_to_this_xla():
    """Every default GPU option is a compile option this XLA knows (an unknown one fails the compile):
    compiling a CPU program with them works (they only steer the GPU compiler)."""
    opts = xla_options.performance_options("gpu", 8)
    assert opts["xla_gpu_enable_latency_hiding_scheduler"] is True
    assert opts["xla_gpu_all_gather_combine_threshold_bytes"] == (1 << 30) // 8
    lowered = jax.jit(lambda x: x @ x).lower(jnp.ones((4, 4)))
    compiled, applied = xla_options.compile_with(lowered, opts)
    assert applied == opts and compiled is not None
    assert xla_options.performance_options("cpu", 8) == {} and xla_options.performance_options("tpu", 8) == {}


def test_unknown_option_is_dropped_and_xla_flags_win(monkeypatch):
    notes = []
    lowered = jax.jit(lambda x: x + 1).lower(jnp.ones(3))
    _, applied = xla_options.compile_with(lowered, {"xla_gpu_no_such_option_here": True,
                                                    "xla_gpu_enable_latency_hiding_scheduler": True}, notes.append)
    assert applied == {"xla_gpu_enable_latency_hiding_scheduler": True}
    assert notes == ["note: this XLA has no compile option xla_gpu_no_such_option_here; compiling without it"]
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_latency_hiding_scheduler=false --xla_dump_to=/tmp/x")
    _, applied = xla_options.compile_with(lowered, {"xla_gpu_enable_latency_hiding_scheduler": True,
                                                    "xla_gpu_enable_triton_gemm": False})
    assert applied == {"xla_gpu_enable_triton_gemm": False}


def test_trainer_applies_options_by_platform():
    t = trainer(config("gpt2"))
    assert t.compile()["xla_options"] == {}  # CPU: none
    t.platform = "gpu"  # the options a GPU run compiles with (accepted by this CPU compile too)
    rep = t.compile()
    assert rep["xla_options"] == xla_options.performance_options("gpu", 1)
    t2 = trainer(config("gpt2", train__xla_perf_options=False))
    t2.platform = "gpu"
    assert t2.compile()["xla_options"] == {}
    assert rep["model_flops"]["per_step"] == model_flops_per_step(t.cfg)


def test_compute_report_names_kernel_remat_and_chunks():
    t = trainer(config("llama_gqa", model__remat="save_dots", model__loss_chunk_tokens=32, parallel__data=2,
                       parallel__seq=2, parallel__seq_attention="ring"))
    line = t.compute_report()[0]
    assert "attention kernel: xla (auto on cpu); context-parallel ring over seq=2 (XLA blocks)" in line
    assert "remat: save_dots" in line
    assert "loss: head + cross-entropy in 2 chunk(s) of 32 tokens per device" in line  # 8 rows x 8 positions


def test_mfu_in_metrics_is_model_flops_over_time_and_peak(tmp_path):
    """train.py on data=2 x tensor=2 with train.peak_tflops set: every record's model_tflops_per_sec is
    the hand-counted model flops per step per device over its step time, and mfu that over the peak."""
    from test_cli import SMALL, metrics, train

    out = tmp_path / "m"
    p = train(*SMALL, "parallel.data=2", "parallel.tensor=2", "train.peak_tflops=0.5", f"train.out_dir={out}")
    L, d, V, T, B = 2, 64, 256, 32, 8  # SMALL: gpt2 style
    per_step_device = (6 * (L * 12 * d * d + d * V) + 6 * L * T * d) * B * T / 4
    for rec in metrics(out):
        assert abs(rec["model_tflops_per_sec"] * 1e12 * rec["step_time"] / per_step_device - 1) < 1e-9
        assert abs(rec["mfu"] - rec["model_tflops_per_sec"] / 0.5) < 1e-12
    rep = json.loads((out / "compile_report.json").read_text())
    assert rep["model_flops"]["per_step_per_device"] == per_step_device
    assert "MFU" in p.stdout and "attention kernel: xla (auto on cpu)" in p.stdout


def test_deepseek_v3_hand_count_is_its_published_37b_active():
    """DeepSeek-V3's shapes (MLA: q_lora_rank 1536, kv_lora_rank 512, RoPE 64 of a 192-wide query/key head, values
    of 128; 3 dense layers of 18432, then 58 MoE layers of 256 experts of 2048, top-8 and one shared expert):
    the hand count, and with the embedding the published 37B activated parameters (within 2%)."""
    cfg = load_config(None, [
        "model.arch=moe", "model.style=llama", "model.n_layers=61", "model.d_model=7168", "model.n_heads=128",
        "model.head_dim=192", "model.kv_lora_rank=512", "model.q_lora_rank=1536", "model.rope_head_dim=64",
        "model.v_head_dim=128", "model.d_ff=18432", "model.vocab_size=129280", "model.seq_len=4096",
        "moe.n_experts=256", "moe.top_k=8", "moe.d_ff=2048", "moe.shared_experts=1", "moe.first_dense=3"])
    d, h, V = 7168, 128, 129280
    attn = (d * 1536 + 1536 * h * 192) + d * (512 + 64) + 512 * h * (128 + 128) + h * 128 * d
    want = 3 * (attn + 3 * d * 18432) + 58 * (attn + d * 256 + 9 * 3 * d * 2048) + d * V
    assert matmul_params(cfg) == want
    assert abs((want + d * V) / 37e9 - 1) < 0.02
    assert model_flops_per_token(cfg) == 6 * want + 3 * 61 * 4096 * h * (192 + 128)
