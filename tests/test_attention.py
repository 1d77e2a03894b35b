"""Attention kernels: each against a float64 formula, float32 scores from bfloat16 inputs, the
kernel choice and its errors, the Pallas kernels through the model on every attention layout, and
the cuDNN path lowered for CUDA (no GPU here: lowering needs none)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_trees_close, config, loss_grads, rel_err, trainer
from jaxpar.config import ConfigError
from jaxpar.layers import attention_ops
from jaxpar.layers.attention_ops import attention, choose, describe, splash_attention, triton_attention
from jaxpar.layers.precision import f32_einsum


def reference(q, k, v, q_offset=0, window=None, scale=None):
    """float64 causal attention: query i (global position q_offset + i) sees keys 0..q_offset + i (the last
    ``window`` of them with a sliding window); scores times ``scale`` (default 1/sqrt(D))."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, h, d = q.shape
    g = h // k.shape[2]
    scale = 1 / np.sqrt(d) if scale is None else scale
    out = np.zeros_like(q)
    for hi in range(h):
        for i in range(t):
            n = q_offset + i + 1
            lo = 0 if window is None else max(0, n - window)
            s = np.einsum("bd,bjd->bj", q[:, i, hi], k[:, lo:n, hi // g]) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[:, i, hi] = np.einsum("bj,bjd->bd", p / p.sum(-1, keepdims=True), v[:, lo:n, hi // g])
    return out


def qkv(b=2, t=32, s=None, h=4, kv=2, d=16, seed=0, dtype=jnp.float32, scale=1.0):
    rng = np.random.default_rng(seed)
    s = s or t
    return tuple(jnp.asarray(rng.normal(size=shape) * scale, dtype)
                 for shape in ((b, t, h, d), (b, s, kv, d), (b, s, kv, d)))


KERNELS = {
    "xla": lambda q, k, v, off: attention(q, k, v, "xla", q_offset=off),
    "splash": lambda q, k, v, off: splash_attention(q, k, v, off, interpret=True),
    "triton": lambda q, k, v, off: triton_attention(q, k, v, interpret=True),
}


@pytest.mark.parametrize("kernel, kv, t, offset", [
    ("xla", 4, 32, 0), ("xla", 2, 32, 0), ("xla", 1, 32, 32), ("splash", 4, 128, 0), ("splash", 2, 128, 0),
    ("splash", 2, 64, 64), ("triton", 4, 32, 0)])
def test_kernel_matches_float64_and_xla_gradients(kernel, kv, t, offset):
    """Values against float64; gradients against the xla kernel's (itself checked against float64).
    ``offset``: ``t`` local queries over ``t + offset`` keys, shifted as on the last seq device under
    all_gather (the splash kernel tiles keys in blocks of 128)."""
    q, k, v = qkv(kv=kv, t=t, s=t + offset)
    fn = KERNELS[kernel]
    np.testing.assert_allclose(np.asarray(fn(q, k, v, offset)), reference(q, k, v, offset), rtol=2e-5, atol=2e-5)
    def loss(f):
        return lambda q, k, v: jnp.sum(jnp.sin(f(q, k, v, offset)))
    got = jax.grad(loss(fn), (0, 1, 2))(q, k, v)
    want = jax.grad(loss(KERNELS["xla"]), (0, 1, 2))(q, k, v)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("kernel, traced", [("xla", False), ("xla", True), ("splash", False)])
def test_sliding_window_and_scale_match_float64(kernel, traced):
    """A sliding window (static, or traced as a per-layer value is) and a score scale other than
    1/sqrt(D), in the reference kernel and the splash kernel (a static window: its LocalMask)."""
    q, k, v = qkv(kv=2, t=128 if kernel == "splash" else 32)
    window, scale = 7, 0.3
    if kernel == "splash":
        fn = lambda q, k, v: splash_attention(q, k, v, 0, interpret=True, scale=scale, window=window)  # noqa: E731
    elif traced:
        fn = jax.jit(lambda q, k, v, w: attention(q, k, v, "xla", scale=scale, window=w))
        fn = functools.partial(fn, w=jnp.int32(window))
    else:
        fn = lambda q, k, v: attention(q, k, v, "xla", scale=scale, window=window)  # noqa: E731
    np.testing.assert_allclose(np.asarray(fn(q, k, v)), reference(q, k, v, window=window, scale=scale), rtol=2e-5,
                               atol=2e-5)


def test_traced_window_refused_by_the_static_pallas_masks():
    q, k, v = qkv(kv=2, t=128)
    with pytest.raises(ConfigError, match="model.attention=pallas: .*model.global_every"):
        jax.jit(lambda w: attention(q, k, v, "pallas", window=w))(jnp.int32(5))


def test_explicit_positions_mask():
    """Tokens in any order: the mask compares global positions (as the ring's zig-zag layout needs)."""
    q, k, v = qkv(t=16)
    perm = np.random.default_rng(3).permutation(16)
    got = attention(q[:, perm], k[:, perm], v[:, perm], "xla", q_pos=jnp.asarray(perm), k_pos=jnp.asarray(perm))
    np.testing.assert_allclose(np.asarray(got), reference(q, k, v)[:, perm], rtol=2e-5, atol=2e-5)


def test_bfloat16_scores_and_softmax_stay_float32():
    """bf16 q/k/v with large scores (|s| ~ 30): the output is the float64 attention of the same
    (bf16-rounded) inputs to bf16 output precision. Rounding the scores to bf16 first would move
    each by up to 30 * 2^-9 ~ 0.06 and the softmax weights by ~6%."""
    q, k, v = qkv(t=64, h=4, kv=4, d=16, dtype=jnp.bfloat16, scale=2.5)
    want = reference(q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32))
    got = np.asarray(attention(q, k, v, "xla").astype(jnp.float32))
    assert rel_err(got, want) < 1e-2
    rounded = jnp.einsum("btkd,bskd->bkts", q, k).astype(jnp.float32) / 4.0  # bf16 scores
    exact = jnp.einsum("btkd,bskd->bkts", q.astype(jnp.float32), k.astype(jnp.float32)) / 4.0
    assert float(jnp.max(jnp.abs(rounded - exact))) > 0.05  # the test's scores are big enough to tell


def test_f32_einsum_backward_runs_in_the_operand_dtype():
    """Forward: a float32 result accumulated in float32. Backward: both transposed matmuls take
    bfloat16 operands (a float32 x bfloat16 matmul would run at float32 speed)."""
    a, b = (jnp.ones((8, 16), jnp.bfloat16), jnp.ones((16, 32), jnp.bfloat16))
    jaxpr = jax.make_jaxpr(jax.grad(lambda a, b: jnp.sum(f32_einsum("ij,jk->ik", a, b) ** 2), (0, 1)))(a, b)
    dots = [e for e in _eqns(jaxpr.jaxpr) if e.primitive.name == "dot_general"]
    assert len(dots) == 3 and all(v.aval.dtype == jnp.bfloat16 for e in dots for v in e.invars), dots
    assert sorted(e.outvars[0].aval.dtype.name for e in dots) == ["bfloat16", "bfloat16", "float32"]
    x, y = (np.random.default_rng(0).normal(size=s) for s in ((4, 8), (8, 5)))
    g = jax.grad(lambda x, y: jnp.sum(jnp.sin(f32_einsum("ij,jk->ik", x, y))), (0, 1))(
        jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32))
    c = np.cos(x @ y)  # float64 gradient of sum(sin(x @ y))
    # float32 accumulation: each entry within a few float32 ulps of its terms' magnitude (an entry near 0 from
    # cancelling terms has no relative bound: -0.0249 came out 1.8e-5 off relatively, 4.4e-7 absolutely)
    ulps = 8 * 2.0**-23
    np.testing.assert_allclose(np.asarray(g[0]), c @ y.T, rtol=1e-5, atol=ulps * (np.abs(c) @ np.abs(y.T)).max())
    np.testing.assert_allclose(np.asarray(g[1]), x.T @ c, rtol=1e-5, atol=ulps * (np.abs(x.T) @ np.abs(c)).max())


def _eqns(jaxpr):
    """Every equation of a jaxpr, those of its sub-jaxprs (custom_vjp, pjit, ...) included."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_kernel_choice():
    facts = dict(head_dim=64, n_heads=8, n_kv_heads=2, seq_len=1024)
    assert choose("auto", dtype=jnp.float32, platform="cpu", **facts) == "xla"
    assert choose("auto", dtype=jnp.bfloat16, platform="gpu", **facts) == "cudnn"
    assert choose("auto", dtype=jnp.float32, platform="gpu", **facts) == "xla"  # cuDNN has no float32 kernel
    assert choose("auto", dtype=jnp.bfloat16, platform="gpu", **{**facts, "head_dim": 100}) == "xla"
    # heads wider than 128 (MLA's 192, Gemma 3's 256): cuDNN's kernel on Hopper, which a planner on another
    # machine names (this process's devices are CPUs: 128)
    wide = {**facts, "head_dim": 192}
    assert choose("auto", dtype=jnp.bfloat16, platform="gpu", **wide) == "xla"
    assert choose("auto", dtype=jnp.bfloat16, platform="gpu", cudnn_head_dim=256, **wide) == "cudnn"
    assert choose("auto", dtype=jnp.bfloat16, platform="gpu", cudnn_head_dim=256, **{**facts, "head_dim": 264}) == "xla"
    assert choose("auto", dtype=jnp.bfloat16, platform="tpu", **facts) == "pallas"
    assert choose("auto", dtype=jnp.bfloat16, platform="tpu", **{**facts, "seq_len": 1000}) == "xla"
    assert choose("pallas", dtype=jnp.float32, platform="cpu", **facts) == "pallas"  # interpret mode
    assert "cudnn does not fit: cuDNN flash attention has no float32 kernel" in describe(
        "auto", dtype=jnp.float32, platform="gpu", **facts)
    assert describe("auto", dtype=jnp.bfloat16, platform="gpu", **facts) == "cudnn (auto on gpu)"
    for choice, platform, dtype, needle in [
            ("cudnn", "cpu", jnp.bfloat16, "needs a GPU (this run is on cpu)"),
            ("cudnn", "gpu", jnp.float32, "needs model.compute_dtype=bfloat16"),
            ("pallas", "gpu", jnp.bfloat16, "multi-head only; model.n_kv_heads=2 != model.n_heads=8"),
            ("flash", "gpu", jnp.bfloat16, "choose one of auto, xla, cudnn, pallas")]:
        with pytest.raises(ConfigError, match=re.escape(needle)) as e:
            choose(choice, dtype=dtype, platform=platform, **facts)
        assert str(e.value).startswith(f"model.attention={choice}") or "flash" in str(e.value)


def test_explicit_cudnn_on_cpu_is_one_config_error():
    with pytest.raises(ConfigError, match=r"model.attention=cudnn: cuDNN flash attention needs a GPU"):
        trainer(config("llama", model__attention="cudnn"))


PALLAS = dict(model__n_layers=1, model__seq_len=128, train__batch_size=8)


@pytest.fixture(scope="module")
def single():
    return loss_grads(config("llama_gqa", **PALLAS))


@pytest.mark.parametrize("layout", [  # (heads split over tensor change nothing in the kernel's call: not repeated here)
    {}, dict(parallel__seq=2, parallel__seq_attention="all_gather"), dict(parallel__seq=2, parallel__seq_attention="ulysses")],
    ids=["1-device", "seq2-all_gather", "seq2-ulysses"])
def test_pallas_kernel_through_the_model(single, layout):
    """model.attention=pallas (the TPU splash kernel, in interpret mode on CPU) gives the xla kernel's
    loss and gradients on one device and on the layouts that run it per device (all_gather picks the
    device's shifted mask with lax.switch). The kernel tiles keys in blocks of 128."""
    loss, grads = loss_grads(config("llama_gqa", model__attention="pallas", **PALLAS, **layout))
    assert rel_err(loss, single[0]) <= 1e-5
    assert_trees_close(grads, single[1], 1e-5, "grads ")


@pytest.mark.parametrize("layout, local", [
    ({}, "(tensor<16x256x8x8xbf16>, tensor<16x256x4x8xbf16>, tensor<16x256x4x8xbf16>"),
    (dict(parallel__data=2, parallel__tensor=2), "(tensor<8x256x4x8xbf16>, tensor<8x256x2x8xbf16>, tensor<8x256x2x8xbf16>")],
    ids=["1-device", "data2-tensor2"])
def test_cudnn_train_step_lowers_for_cuda(monkeypatch, layout, local):
    """The whole train step with model.attention=cudnn lowers for CUDA (this host has no GPU, so the
    platform and cuDNN version checks are patched): cuDNN's fused forward and backward appear once
    per layer scan, take K/V with the KV heads (no copies for GQA), and nothing has the shape of a
    score matrix [.., T, T] (the xla kernel's program has them)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(attention_ops, "_platform", lambda: "gpu")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    cfg = config("llama_gqa", model__attention="cudnn", model__compute_dtype="bfloat16", model__seq_len=256, **layout)
    t = trainer(cfg)
    text = t._step_jit.trace(t.abstract_state, t.abstract_batch).lower(lowering_platforms=("cuda",)).as_text()
    # cuDNN's forward and backward (__cudnn$fmhaSoftmax, __cudnn$fmhaSoftmaxBackward; on several devices
    # custom-partitioned calls that become them when XLA partitions them) on the local q, k, v: batch 16 (/2),
    # heads 8 (/2), kv heads 4 (/2), T 256, head dim 8
    calls = [line for line in text.splitlines()
             if "custom_call @CustomSPMDPartitioning" in line or "custom_call @__cudnn$fmha" in line]
    assert len(calls) == 2 and all(local in c for c in calls), calls  # one forward, one backward (layer scan)
    assert not re.search(r"tensor<\d+x\d+x(\d+x)*256x256x(f32|bf16)>", text)  # no [B, heads.., T, T] scores


@pytest.mark.parametrize("sched", ["1f1b", "zb_h1"])
def test_cudnn_kept_residuals_lower_for_cuda(monkeypatch, sched):
    """A pipeline whose backwards run from the residuals their forwards kept (``parallel.stage_remat=false``)
    through cuDNN's attention lowers for CUDA (checks patched as above): the residual split
    (:mod:`jaxpar.layers.residuals`) goes through cuDNN's custom-partitioned calls, the program holds one fused
    backward (10 operands for a forward, 13 for a backward, as XLA partitions them) and fewer fused forwards
    than the same step running the stage's forward again in each backward (1F1B: its warm-up's, its steady
    loop's and its backward's; ZB-H1: F's and B's), no score matrix."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(attention_ops, "_platform", lambda: "gpu")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    operands = {}
    for keep in (True, False):
        cfg = config("llama_gqa", model__attention="cudnn", model__compute_dtype="bfloat16", model__seq_len=256,
                     parallel__pipe=2, parallel__pipeline_schedule=sched, parallel__stage_remat=keep,
                     model__remat="none")
        t = trainer(cfg)
        text = t._step_jit.trace(t.abstract_state, t.abstract_batch).lower(lowering_platforms=("cuda",)).as_text()
        calls = [line.split("custom_call @")[1].split(")")[0] for line in text.splitlines()
                 if "custom_call @CustomSPMDPartitioning" in line or "custom_call @__cudnn$fmha" in line]
        operands[keep] = sorted(c.count("%") for c in calls)
        assert not re.search(r"tensor<\d+x\d+x(\d+x)*256x256x(f32|bf16)>", text)
    assert operands[False].count(13) == 1 and set(operands[False]) == {10, 13}, operands
    assert operands[True].count(13) == 1 and operands[False].count(10) < operands[True].count(10), operands


@pytest.mark.parametrize("over", [dict(model__global_every=0), {}], ids=["one-window", "per-layer-windows"])
def test_cudnn_sliding_windows_lower_for_cuda(monkeypatch, over):
    """Sliding windows through cuDNN (lowered for CUDA; platform and version checks patched as above): a
    window shared by every layer as cuDNN's own local window, Gemma 3's per-layer windows (data scanned
    with the weights) as a mask; one fused forward and one backward per layer scan, no score matrix."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(attention_ops, "_platform", lambda: "gpu")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    cfg = config("gemma3", model__attention="cudnn", model__compute_dtype="bfloat16", model__seq_len=256,
                 parallel__data=2, parallel__tensor=2, **over)
    t = trainer(cfg)
    text = t._step_jit.trace(t.abstract_state, t.abstract_batch).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines()
             if "custom_call @CustomSPMDPartitioning" in line or "custom_call @__cudnn$fmha" in line]
    assert len(calls) == 2, calls
    assert not re.search(r"tensor<\d+x\d+x(\d+x)*256x256x(f32|bf16)>", text) or over == {}
