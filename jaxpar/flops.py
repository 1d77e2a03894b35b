"""Model flops and device peaks: the two halves of MFU (model flops utilisation).

MFU = model flops per step / step time / (peak flops of one device x devices), the figure
MaxText, nanoGPT, Levanter and PaLM report. *Model* flops are the flops the model's math needs,
counted analytically from its shape, whatever the implementation executes: rematerialisation's
recompute, pipeline bubbles, padding and the optimizer are not counted (they lower MFU, as they
should). The compiled program's own counts (``compile_report.json``: ``flops``, ``matmul_flops``)
are the hardware side and are never used for MFU; on GPU they also miss the cuBLAS / cuDNN
custom calls.

Per token, training (forward + backward = 3 x forward, 2 flops per multiply-add):

    flops/token = 6 * N_matmul + 6 * L * T * H * D_head

``N_matmul`` is the number of weights each token multiplies: per layer the Q/K/V projection
``d (H + 2 KV) D_head``, the attention out-projection ``H D_head d``, the MLP ``2 d d_ff`` (GELU) or
``3 d d_ff`` (SwiGLU); a Mixture-of-Experts layer has the router ``d E`` and ``top_k`` experts'
MLPs instead of the MLP (the active experts only); and the head ``d V`` (V the real vocabulary;
tied or not, the head is one matmul). The embedding lookup, positions, norms and biases are not
matmuls. The second term is causal attention: ``QK^T`` and ``PV`` each cost ``2 T H D_head`` flops per
token and layer over the full ``T x T`` square, halved by the causal mask, times 3.

Multi-head Latent Attention (``model.kv_lora_rank``) multiplies ``d r_q + r_q H D_head`` (or ``d H D_head``)
for the queries, ``d (r + p)`` and ``r H (D_head - p + D_v)`` for the keys and values and ``H D_v d`` out, and
its ``PV`` runs at the value width: the attention term is ``3 L T H (D_head + D_v)``. Shared experts count
``shared_experts`` MLPs of ``moe.d_ff`` in every MoE layer; ``moe.first_dense`` layers are dense.
"""

from __future__ import annotations

from jaxpar.config import Config

# Dense bf16 peak flops per device, by device kind (first match wins: longer names first).
PEAK_FLOPS = (
    ("H100 PCIe", 756e12), ("H100", 989e12), ("H200", 989e12), ("H800", 989e12), ("A100", 312e12),
    ("TPU v4", 275e12), ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5p", 459e12), ("TPU v5", 459e12),
    ("TPU v6 lite", 918e12), ("TPU v6e", 918e12),
)


def peak_flops(device, override_tflops: float = 0.0) -> float | None:
    """Dense bf16 peak flops/s of ``device`` (``train.peak_tflops`` when set); None when unknown."""
    if override_tflops > 0:
        return override_tflops * 1e12
    kind = getattr(device, "device_kind", "").lower()
    return next((v for k, v in PEAK_FLOPS if k.lower() in kind), None)


def layer_matmul_params(cfg: Config, moe: bool) -> int:
    """The weights one token multiplies in one layer: attention and the MLP, or (``moe``) attention, the
    router and the ``top_k`` active experts."""
    m = cfg.model.resolved()
    d, hd, h = m.d_model, m.head_dim, m.n_heads
    if m.latent:
        q = d * m.q_lora_rank + m.q_lora_rank * h * hd if m.q_lora_rank else d * h * hd
        attn = (q + d * (m.kv_lora_rank + m.rope_head_dim) + m.kv_lora_rank * h * (hd - m.rope_head_dim + m.v_head_dim)
                + h * m.v_head_dim * d)
    else:
        attn = d * (h + 2 * m.n_kv_heads) * hd + h * hd * d
    per_mlp = 3 if m.gated else 2
    if not moe:
        return attn + per_mlp * d * m.d_ff
    experts = cfg.moe.top_k + cfg.moe.shared_experts
    return attn + d * cfg.moe.n_experts + experts * per_mlp * d * (cfg.moe.d_ff or m.d_ff)


def matmul_params(cfg: Config) -> int:
    """``N_matmul``: the weights one token multiplies (active experts only), the head included."""
    m = cfg.model.resolved()
    n_moe = cfg.moe.groups(m.n_layers) if m.arch == "moe" else 0
    return ((m.n_layers - n_moe) * layer_matmul_params(cfg, False) + n_moe * layer_matmul_params(cfg, True)
            + m.d_model * m.vocab_size)


def model_flops_per_token(cfg: Config) -> float:
    """Training flops per token: ``6 N_matmul + 3 L T H (D_head + D_v)`` (see the module docstring)."""
    m = cfg.model.resolved()
    return 6.0 * matmul_params(cfg) + 3.0 * m.n_layers * m.seq_len * m.n_heads * (m.head_dim + m.v_head_dim)


def model_flops_per_step(cfg: Config) -> float:
    """Training flops of one optimizer step (``train.batch_size`` sequences of ``model.seq_len``)."""
    return model_flops_per_token(cfg) * cfg.train.batch_size * cfg.model.seq_len
