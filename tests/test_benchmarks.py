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
                        "--warmup", "1", "--peak-tflops", "2", "--depth", "1,2", "--json", str(out)],
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
