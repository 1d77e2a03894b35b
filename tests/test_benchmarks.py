"""The benchmarks at tiny sizes on the CPU: they run, and what they print agrees with counts written here by hand
from their command lines and configs (tokens per step, parameters, model flops) or made here from their
files (documents, corpus bytes), beside the consistency of their fields."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import command_env

ROOT = Path(__file__).resolve().parents[1]


def _gpt2_params(layers: int, d: int, vocab: int, positions: int) -> int:
    """GPT-2's weights: per layer a fused QKV d x 3d with Q and V biases (a K bias cancels in the softmax), the
    out-projection d x d + bias, a GELU MLP d x 4d and 4d x d with biases, two LayerNorms (scale + bias); the
    embedding (tied to the head), learned positions, the final LayerNorm."""
    ff = 4 * d
    per_layer = 3 * d * d + 2 * d + d * d + d + 2 * d * ff + ff + d + 2 * 2 * d
    return layers * per_layer + vocab * d + positions * d + 2 * d


def _preset_cpu_by_hand() -> list[tuple[int, int]]:
    """(parameters, model flops per token) of ``benchmarks/throughput.py --preset cpu``'s two cases, from
    configs/default.yaml (4 layers, d = 128, 4 heads of 32, vocabulary 512) and the cases' overrides (sequences
    of T = 64; the second: llama style, 2 KV heads, SwiGLU of d_ff = 8d/3 rounded up to 64 = 384).

    Training flops per token = 6 N + 6 L T d: 6 per weight a token multiplies (N: Q/K/V, out-projection, MLP,
    head; forward 2, backward 4), and the attention scores and their use on values, 2 x 2 T d per layer
    forward over the full T x T square (12 L T d for forward + backward), halved by the causal mask."""
    layers, d, heads, hd, vocab, t = 4, 128, 4, 32, 512, 64
    llama_ff, llama_kv = 384, 2
    attention = 6 * layers * t * d
    gpt2_n = layers * (4 * d * d + 2 * 4 * d * d) + d * vocab  # QKV + out, MLP up + down, the (tied) head
    # llama: QKV of (4 + 2 x 2) heads of 32, out-projection, gate / up / down, RMSNorm scales, an untied head
    llama_n = layers * (d * (heads + 2 * llama_kv) * hd + heads * hd * d + 3 * d * llama_ff) + d * vocab
    llama_params = llama_n - d * vocab + layers * 2 * d + d + 2 * vocab * d
    assert gpt2_n == llama_n == 851968  # the two cases do the same matmul work per token
    return [(_gpt2_params(layers, d, vocab, t), 6 * gpt2_n + attention), (llama_params, 6 * llama_n + attention)]


def test_throughput_benchmark_on_cpu(tmp_path):
    out = tmp_path / "bench.jsonl"
    env = command_env()
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/throughput.py"), "--preset", "cpu", "--steps", "2",
                        "--warmup", "1", "--peak-tflops", "2", "--depth", "1,2", "--json", str(out),
                        "--profile", str(tmp_path / "prof"), "--profile-steps", "1", "--hlo", str(tmp_path / "hlo")],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cases, depth = rows[:-1], rows[-1]
    assert len(cases) == 2
    hand = _preset_cpu_by_hand()
    for r, (params, flops_per_token) in zip(cases, hand):
        assert "train.batch_size=8" in r["case"] and "model.seq_len=64" in r["case"]  # the preset's flags
        assert r["devices"] == 1 and r["compile_s"] > 0
        assert r["tokens_per_step"] == 8 * 64  # batch x sequence
        assert r["params"] == params
        assert r["tokens_per_sec"] * r["step_s"] == pytest.approx(8 * 64, rel=1e-9)
        # the model flops of a step on the one device, from what the benchmark reports
        step_flops = flops_per_token * 8 * 64
        assert r["model_tflops_per_sec"] * 1e12 * r["step_s"] == pytest.approx(step_flops, rel=1e-9)
        assert r["mfu"] * 2e12 * r["step_s"] == pytest.approx(step_flops, rel=1e-9)  # --peak-tflops 2
        assert r["plain_mfu"] * 2e12 * r["plain_step_s"] == pytest.approx(step_flops, rel=1e-9)
        assert abs(r["ratio_to_plain"] - r["step_s"] / r["plain_step_s"]) < 1e-12
        # the compiled step holds at least the float32 parameters and Adam's two moments: 12 bytes per weight
        assert r["peak_memory_bytes"] >= 12 * params
        assert "attention kernel: xla (auto on cpu)" in r["compute"]
    assert "remat: full" in cases[1]["compute"]
    for i, r in enumerate(cases):
        # --hlo: each case's optimised train step; --profile: a trace per step, no device plane on a CPU
        assert (tmp_path / "hlo" / f"case{i}.hlo.txt").read_text().startswith("HloModule")
        assert set(r["profile"]) == {f"case{i}-jaxpar", f"case{i}-plain"}
        for prof in r["profile"].values():
            assert Path(prof["trace"]).is_file() and prof["kernels"] is None and prof["wall_ms_per_step"] > 0
    assert "no device plane in the trace" in p.stdout
    assert set(depth["depth_compile_s"]) == {"1", "2"} and depth["depth_ratio"] > 0
    assert "jaxpar / plain-JAX step time" in p.stdout and "compile seconds by depth" in p.stdout


def test_data_benchmark_on_a_small_corpus(tmp_path):
    env = command_env()
    out = tmp_path / "data.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/data.py"), "--tokens", "3e5", "--files", "2",
                        "--bpe-sample-mb", "1", "--batches", "20", "--step-steps", "2", "--workdir",
                        str(tmp_path / "work"), "--json", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["tokens"] >= 3e5 and r["documents"] > 0 and r["prepare_peak_rss_bytes"] > 0
    # counted here from the files it made: one document per JSONL line, its bytes, 2-byte token ids in the shards
    corpus, store = tmp_path / "work" / "corpus", tmp_path / "work" / "store"
    files = sorted(corpus.glob("*.jsonl"))
    assert len(files) == 2  # --files 2
    assert r["documents"] == sum(len(f.read_text().splitlines()) for f in files)
    assert r["corpus_text_bytes"] == sum(f.stat().st_size for f in files)
    shards = sorted(f for f in store.glob("*.bin") if f.name.count(".") == 1)  # not the .docs.bin beside them
    assert r["shards"] == len(shards) and r["tokens"] == sum(f.stat().st_size for f in shards) // 2
    assert r["load_tokens_read"] == r["load_tokens_expected"] == [21 * 16 * 129] * 2  # only each process's rows
    assert abs(r["gather_share_of_step"] - r["gather_s_per_batch"] / r["cpu_step_s"]) < 1e-12
    assert abs(r["prepare_tokens_per_s"] - r["tokens"] / r["prepare_s"]) <= 0.01 * r["prepare_tokens_per_s"]
    assert "only their rows" in p.stdout


def test_generate_benchmark_on_cpu(tmp_path):
    env = command_env()
    out = tmp_path / "gen.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/generate.py"), "--layers", "2", "--d-model", "64",
                        "--vocab", "128", "--context", "48", "--tokens", "48", "--repeats", "3", "--json", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["same_greedy_tokens"] and r["window"] == 48 + 48 + 1
    assert (r["layers"], r["d_model"], r["context"], r["tokens"]) == (2, 64, 48, 48)
    assert r["params"] == _gpt2_params(2, 64, 128, 48 + 48 + 1)  # positions for the whole window
    assert abs(r["speedup"] - r["recompute_s_per_token"] / r["cached_s_per_token"]) < 1e-9
    assert r["speedup"] > 1  # the benchmark's point (README: 18x at 256 tokens of context)
    assert "KV cache" in p.stdout and "recompute" in p.stdout


def test_kernel_table_counts_device_kernels_per_step():
    """``--profile``'s table from a trace's planes (hand-made: a host plane, a device plane with two streams,
    a derived line and a double-buffered copy of a loop op), against sums done here by hand."""
    from types import SimpleNamespace as NS

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import throughput

    def ev(name, us, op=None):
        return NS(name=name, duration_ns=us * 1000, stats=[("hlo_op", op)] if op else [])

    planes = [NS(name="/host:CPU", lines=[NS(name="python", events=[ev("step", 900)])]),
              NS(name="/device:GPU:0", lines=[
                  NS(name="Stream #1(Compute)", events=[ev("sm90_gemm", 300, "dot.1"), ev("sm90_gemm", 100, "dot.1"),
                                                        ev("fusion_kernel", 50, "fusion.2")]),
                  NS(name="Stream #2(Compute)", events=[ev("sm90_gemm", 250, "dot.1.double_buffer_clone"),
                                                        ev("memcpy", 100)]),
                  NS(name="XLA Ops", events=[ev("dot.1", 650)])])]    # derived from the kernels: not again
    t = throughput.table_of(planes, n_steps=2, top=2)
    assert t["kernel_ms_per_step"] == pytest.approx((300 + 100 + 50 + 250 + 100) / 2 / 1000)
    assert [r["op"] for r in t["top"]] == ["dot.1", "memcpy"]
    assert t["top"][0]["ms_per_step"] == pytest.approx(0.325) and t["top"][0]["calls_per_step"] == 1.5
    assert t["top"][0]["share"] == pytest.approx(650 / 800)
    assert throughput.table_of(planes[:1], 2) is None   # no device plane: a CPU trace


def test_plain_step_is_compared_only_where_it_computes_the_same_model():
    """The plain-JAX step implements dense GPT-2 / Llama blocks; a config with anything else (MoE layers,
    QK-norm, a Qwen-2.5 QKV bias, sliding windows, GeGLU, Llama 3's RoPE scaling, gradient accumulation)
    is timed without it, the reason named, rather than against a different model (an H200 run once
    reported a 4.5x "plain" speed-up for Qwen3-MoE: the plain step had built the dense model)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import throughput

    from jaxpar.config import load_config

    def gap(path, *over):
        return throughput.plain_gap(load_config(str(ROOT / path), throughput.COMMON + list(over)))

    gaps = []
    for case in throughput.PRESETS["gpu"] + throughput.PRESETS["cpu"]:
        path, over = throughput.parse_case(case)
        gaps.append(throughput.plain_gap(load_config(path, throughput.COMMON + over)))
    assert gaps == [None, None, "model.arch=moe", None, None]   # the dense presets are compared
    assert gap("configs/qwen3_30b_a3b.yaml") == "model.arch=moe"
    assert gap("configs/qwen3_8b.yaml") == "model.qk_norm=True"
    assert gap("configs/qwen2.5_7b.yaml") == "model.qkv_bias=True"
    assert gap("configs/mistral_7b.yaml") == "model.sliding_window=4096"
    assert gap("configs/gemma3_4b.yaml") == "model.mlp=geglu"
    assert gap("configs/llama3_8b.yaml") == "model.rope_scaling=llama3"
    assert gap("configs/default.yaml", "model.param_dtype=bfloat16") == "model.param_dtype=bfloat16"
    assert gap("configs/default.yaml", "train.grad_accum=2") == "train.grad_accum=2"
    assert gap("configs/default.yaml", "model.style=llama", "model.n_kv_heads=2", "model.rope_theta=5e5") is None
    cfg = load_config(str(ROOT / "configs/moe.yaml"), throughput.COMMON)
    assert throughput.build_plain(cfg) == {"skipped": "the plain step has no model.arch=moe"}


def test_moe_grouped_benchmark_on_cpu(tmp_path):
    """``benchmarks/moe_grouped.py`` at tiny sizes: the variants agree; the routed work's flops are
    6 x tokens x top_k x d_model x 3 d_ff (by hand: 256 x 2 assignments of 32 x 48); XLA:CPU's expansion of
    ragged_dot holds at least an [experts, assignments, 2 d_ff] float32 buffer, over twice the tiles'; a bad
    variant is one line naming it."""
    out = tmp_path / "mg.jsonl"
    cmd = [sys.executable, str(ROOT / "benchmarks/moe_grouped.py"), "--tokens", "256", "--experts", "8", "--top-k", "2",
           "--d-model", "32", "--d-ff", "16", "--variants", "tiles,tiles:8:4,ragged_dot", "--steps", "2",
           "--json", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, env=command_env(), cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["variant"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert list(rows) == ["tiles", "tiles:8:4", "ragged_dot"]
    for r in rows.values():
        assert r["max_rel_diff"] < 1e-5
        assert r["tflops"] * 1e12 * r["step_s"] == pytest.approx(6 * 256 * 2 * 32 * 3 * 16, rel=1e-9)
    assert rows["ragged_dot"]["temp_bytes"] >= max(8 * 512 * 32 * 4, 2 * rows["tiles"]["temp_bytes"])
    bad = subprocess.run(cmd[:2] + ["--variants", "tiles:x"], capture_output=True, text=True, env=command_env(),
                         cwd=ROOT, timeout=120)
    assert bad.returncode == 2 and "'tiles:x'" in bad.stderr and "Traceback" not in bad.stderr
