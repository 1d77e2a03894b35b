"""benchmarks/throughput.py at tiny sizes on the CPU: it runs, and what it prints is consistent."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_benchmark_on_cpu(tmp_path):
    out = tmp_path / "bench.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/throughput.py"), "--preset", "cpu", "--steps", "2",
                        "--warmup", "1", "--peak-tflops", "2", "--depth", "1,2", "--json", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cases, depth = rows[:-1], rows[-1]
    assert len(cases) == 2
    for r in cases:
        assert r["devices"] == 1 and r["compile_s"] > 0 and r["peak_memory_bytes"] > 0
        assert abs(r["tokens_per_sec"] * r["step_s"] - r["tokens_per_step"]) < 1e-6 * r["tokens_per_step"]
        assert abs(r["mfu"] - r["model_tflops_per_sec"] / 2) < 1e-12  # model flops / time / peak
        assert abs(r["ratio_to_plain"] - r["step_s"] / r["plain_step_s"]) < 1e-12
        assert abs(r["plain_mfu"] / r["mfu"] - r["ratio_to_plain"]) < 1e-9  # the same model flops, other time
        assert "attention kernel: xla (auto on cpu)" in r["compute"]
    assert "remat: full" in cases[1]["compute"]
    assert set(depth["depth_compile_s"]) == {"1", "2"} and depth["depth_ratio"] > 0
    assert "jaxpar / plain-JAX step time" in p.stdout and "compile seconds by depth" in p.stdout


def test_data_benchmark_on_a_small_corpus(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    out = tmp_path / "data.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/data.py"), "--tokens", "3e5", "--files", "2",
                        "--bpe-sample-mb", "1", "--batches", "20", "--step-steps", "2", "--workdir",
                        str(tmp_path / "work"), "--json", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["tokens"] >= 3e5 and r["documents"] > 0 and r["prepare_peak_rss_bytes"] > 0
    assert r["load_tokens_read"] == r["load_tokens_expected"] == [21 * 16 * 129] * 2  # only each process's rows
    assert abs(r["gather_share_of_step"] - r["gather_s_per_batch"] / r["cpu_step_s"]) < 1e-12
    assert abs(r["prepare_tokens_per_s"] - r["tokens"] / r["prepare_s"]) <= 0.01 * r["prepare_tokens_per_s"]
    assert "only their rows" in p.stdout


def test_generate_benchmark_on_cpu(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_NUM_CPU_DEVICES", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"
    out = tmp_path / "gen.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/generate.py"), "--layers", "2", "--d-model", "64",
                        "--vocab", "128", "--context", "48", "--tokens", "48", "--repeats", "3", "--json", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["same_greedy_tokens"] and r["window"] == 48 + 48 + 1
    assert abs(r["speedup"] - r["recompute_s_per_token"] / r["cached_s_per_token"]) < 1e-9
    assert r["speedup"] > 1  # the benchmark's point (README: 18x at 256 tokens of context)
    assert "KV cache" in p.stdout and "recompute" in p.stdout
