"""Typed run configuration: dataclasses, YAML files and dotted command-line overrides.

A run is configured by one :class:`Config` made of sections (``model``, ``moe``, ``parallel``,
``train``, ``data``, ``sample``, ``debug``). Values come, in order of precedence, from dotted overrides
(``parallel.tensor=4``), a YAML file, and the dataclass defaults. Unknown keys and bad values raise
:class:`ConfigError` naming the key and the valid choices, before anything is compiled.

Every field carries a ``help`` string in its metadata; :func:`config_table` renders all keys as a
Markdown table (the documentation's key reference, docs/reference/config.md, is generated from it, so it
cannot drift).

Long by design: every key of every section is declared here with its type, default, range and help
text, next to the checks across keys; splitting the sections would scatter that one reference.
"""

from __future__ import annotations

import dataclasses
import math
import difflib
import types
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from collections.abc import Collection

import yaml

from jaxpar import hf_config
from jaxpar.errors import ConfigError


def replaced(obj, **changes):
    """``dataclasses.replace`` of a config section without running its ``__init__`` (the sections have no
    ``__post_init__``): a shallow copy with ``changes``, ten times faster, for the planner's thousands of layouts."""
    unknown = set(changes) - obj.__dict__.keys()
    if unknown:
        raise TypeError(f"{type(obj).__name__} has no field {', '.join(sorted(unknown))}")
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    new.__dict__.update(changes)
    return new


@dataclass(frozen=True)
class Range:
    """The values a numeric key accepts: ``lo`` .. ``hi`` (None: unbounded), each end open or closed."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __contains__(self, v) -> bool:
        if not math.isfinite(v):  # nan fails every comparison below; inf is no setting
            return False
        if self.lo is not None and (v < self.lo or (self.lo_open and v == self.lo)):
            return False
        return not (self.hi is not None and (v > self.hi or (self.hi_open and v == self.hi)))

    def __str__(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        return f"{'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


POSITIVE = Range(1)             # integers >= 1
NONNEGATIVE = Range(0)          # >= 0
ABOVE_ZERO = Range(0, lo_open=True)
FRACTION = Range(0, 1)
BETA = Range(0, 1, hi_open=True)


def _f(default: Any, help: str, choices: tuple | None = None, range: Range | None = None):
    meta: dict[str, Any] = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if range is not None:
        meta["range"] = range
    return field(default=default, metadata=meta)


@dataclass
class ParallelConfig:
    data: int = _f(1, "Data-parallel size (batch split). One axis may be -1: the rest of the devices.")
    tensor: int = _f(1, "Tensor-parallel size (Megatron column/row split of heads, MLP and vocabulary).")
    pipe: int = _f(1, "Pipeline-parallel size (stages of consecutive layers).")
    expert: int = _f(1, "Expert-parallel size; dense layers use it as extra data parallelism.")
    seq: int = _f(1, "Sequence/context-parallel size (sequence split of activations).")
    seq_attention: str = _f("ring", "Attention over a split sequence (seq > 1): all_gather (gather K/V), ring "
                                    "(K/V blocks around a ring, online softmax), ulysses (all-to-all to heads).",
                            ("all_gather", "ring", "ulysses"))
    seq_zigzag: bool = _f(True, "Zig-zag sequence layout for ring attention (balances causal work).")
    megatron_sp: bool = _f(False, "Megatron sequence parallelism: norms/residuals split along the sequence "
                                        "over `tensor` (needs tensor > 1).")
    microbatches: int = _f(0, "Pipeline microbatches M per (grad-accum) step; 0 = parallel.pipe. Needs M >= pipe.",
                           range=NONNEGATIVE)
    pipeline_repeats: int = _f(1, "Circular pipeline / interleaved 1F1B: each device holds this many non-adjacent "
                                  "layer groups (R).",
                               range=POSITIVE)
    pipeline_schedule: str = _f("gpipe", "Pipeline schedule: gpipe (all forwards, then the scan's backward; circular "
                                         "with pipeline_repeats > 1) or 1f1b (one forward, one backward: activations "
                                         "of at most 2*pipe - 1 microbatches per stage, not all M; interleaved with "
                                         "pipeline_repeats > 1, M a multiple of pipe) or zb_h1 (zero bubble: "
                                         "1F1B's order with each backward split into the input's gradient and the "
                                         "weights', which fills the cool-down; a third of 1F1B's bubble, "
                                         "pipeline_repeats 1) or zb_v (zero bubble with two chunks per stage in a "
                                         "V, stage s holding layer groups s and 2*pipe-1-s; pipeline_repeats 2, "
                                         "implied when unset).",
                                ("gpipe", "1f1b", "zb_h1", "zb_v"))
    stage_remat: bool = _f(False, "1f1b / zb_h1 / zb_v: a stage's backward runs from the residuals its forward "
                                  "kept under model.remat (false: the forward runs once, each in-flight "
                                  "microbatch's activations held as model.remat keeps them; with model.remat=full "
                                  "each layer's input) or, true, its forward again from the kept stage input (a "
                                  "stage keeps its inputs only, for about a third more compute; with "
                                  "model.remat=full the backward then runs each layer's forward twice).")
    stage_layers: str = _f("", "Uneven pipeline stages: comma-separated layers of each stage in layer order (with "
                               "pipeline_repeats > 1, of each of the pipe x pipeline_repeats groups; a MoE model "
                               "counts its stacked groups), e.g. 7,8,8,8,8,8,8,8,8,8,8,8,8,8,8,7. Empty = even, or "
                               "when the layers do not divide, one fewer on the first and last stages, then the "
                               "second and second-to-last... Every stage runs the longest stage's layer slots.")
    zero: int = _f(0, "ZeRO stage over the axes that split the batch (data, expert, seq): 0 replicated, 1 optimizer "
                      "state sharded, 3 parameters too (FSDP).",
                   (0, 1, 3))
    max_replicated_fraction: float = _f(1.0, "Refuse a layout whose per-device parameter + optimizer bytes are more "
                                             "than this fraction replicas (beyond an even split over all devices; data "
                                             "parallelism without ZeRO over N devices: 1 - 1/N); 1 = no limit.",
                                        range=FRACTION)
    cpu_devices: int = _f(0, "Simulated XLA CPU devices per process when no accelerator is present; 0 = the mesh "
                             "size divided by the number of processes.", range=NONNEGATIVE)

    def stage_layer_list(self) -> tuple[int, ...]:
        """``stage_layers`` as integers (empty: not given)."""
        try:
            return tuple(int(x) for x in self.stage_layers.split(",") if x.strip())
        except ValueError:
            raise ConfigError(f"parallel.stage_layers={self.stage_layers!r}: expected comma-separated layer counts, "
                              "e.g. 7,8,8,7") from None


_RESOLVED: dict = {}  # ModelConfig.resolved's results by field values


@dataclass
class ModelConfig:
    arch: str = _f("gpt", "Model family: gpt (dense decoder) or moe (Mixture-of-Experts decoder; see the moe "
                          "section).", ("gpt", "moe"))
    style: str = _f("gpt2", "Preset for the unset choices below: gpt2 (learned positions, LayerNorm, GELU, "
                            "tied embeddings, biases) or llama (RoPE, RMSNorm, SwiGLU, untied, no biases).",
                    ("gpt2", "llama"))
    n_layers: int = _f(4, "Transformer blocks.", range=POSITIVE)
    d_model: int = _f(128, "Residual stream width.", range=POSITIVE)
    n_heads: int = _f(4, "Query heads.", range=POSITIVE)
    n_kv_heads: int = _f(0, "Key/value heads (GQA); 0 = n_heads.", range=NONNEGATIVE)
    head_dim: int = _f(0, "Width of one head; 0 = d_model / n_heads.", range=NONNEGATIVE)
    d_ff: int = _f(0, "MLP hidden width; 0 = 4*d_model (gelu) or the Llama rule 8/3*d_model rounded to 64 (swiglu).",
                   range=NONNEGATIVE)
    vocab_size: int = _f(256, "Vocabulary size (padded internally to a multiple of vocab_multiple; pad masked).",
                         range=POSITIVE)
    vocab_multiple: int = _f(128, "Pad the vocabulary to a multiple of this (and of `tensor`).", range=POSITIVE)
    seq_len: int = _f(128, "Tokens per training sequence.", range=POSITIVE)
    max_positions: int = _f(0, "Rows of the learned position table (model.positions=learned): the longest sequence "
                               "the model takes, at least model.seq_len, which only limits the training context "
                               "(an imported GPT-2 keeps its n_positions). With RoPE (no table) the context the "
                               "model is made for, which sizes nothing: an import keeps the checkpoint's "
                               "max_position_embeddings and the export writes it (or model.seq_len if longer). "
                               "0 = model.seq_len.", range=NONNEGATIVE)
    init_from: str = _f("", "hf:DIR: start from the weights of a local Hugging Face model directory (GPT-2, Llama "
                            "1-3.x, Mistral, Qwen2.5, Qwen3, Gemma 3, Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS; "
                            "config.json + safetensors), whose config.json sets the architecture keys; a resumed run "
                            "continues from its checkpoint instead. See docs/guides/checkpoints.md.")
    positions: str | None = _f(None, "Position encoding: learned or rope (default from style).", ("learned", "rope"))
    norm: str | None = _f(None, "layernorm or rmsnorm (default from style).", ("layernorm", "rmsnorm"))
    mlp: str | None = _f(None, "gelu, swiglu (SiLU-gated), geglu (tanh-GELU-gated, Gemma) or clamped_swiglu (GPT-OSS: "
                               "(clamp(up, +-swiglu_limit) + 1) * g * sigmoid(swiglu_alpha * g), g = min(gate, "
                               "swiglu_limit)) (default from style).", ("gelu", "swiglu", "geglu", "clamped_swiglu"))
    swiglu_limit: float = _f(7.0, "model.mlp=clamped_swiglu: the clamp of the gate (above) and the up projection "
                                  "(both sides).", range=ABOVE_ZERO)
    swiglu_alpha: float = _f(1.702, "model.mlp=clamped_swiglu: the gate's sigmoid slope.", range=ABOVE_ZERO)
    tie_embeddings: bool | None = _f(None, "Share the input embedding with the output head (default from style).")
    bias: bool | None = _f(None, "Biases in linear layers and norms (default from style).")
    qkv_bias: bool | None = _f(None, "Biases on the Q, K and V projections (Qwen2.5) whatever model.bias says; "
                                     "default: model.bias. A key bias is kept only where it can matter (RoPE or "
                                     "QK-norm after it); with learned positions softmax ignores it.")
    qk_norm: bool = _f(False, "RMSNorm over each head's query and key before RoPE (Qwen3, Gemma 3), one weight "
                              "of head_dim shared by the heads.")
    attn_sinks: bool = _f(False, "A learned logit per head beside the scores in the softmax (GPT-OSS's sinks: the "
                                 "attention can go to nothing); the xla kernel and every parallel.seq_attention "
                                 "strategy take it, the fused kernels refuse it.")
    kv_lora_rank: int = _f(0, "Multi-head Latent Attention (DeepSeek-V2/V3) when > 0: each head's key and value "
                              "come up from one shared, RMS-normed latent of this width, beside one RoPE key of "
                              "model.rope_head_dim shared by the heads; generation caches only the latent and the "
                              "RoPE key ((kv_lora_rank + rope_head_dim) values per token and layer). 0 = off.",
                           range=NONNEGATIVE)
    q_lora_rank: int = _f(0, "MLA: the queries come up from an RMS-normed latent of this width (DeepSeek-V3: 1536); "
                             "0 = one query projection.", range=NONNEGATIVE)
    rope_head_dim: int = _f(0, "MLA: the rotary part of each query and key head (the last rope_head_dim of "
                               "model.head_dim, which is the query/key width; the rest has no position encoding; "
                               "DeepSeek-V3: 64 of 192).", range=NONNEGATIVE)
    v_head_dim: int = _f(0, "MLA: width of each value head; 0 = model.head_dim (DeepSeek-V3: 128).",
                         range=NONNEGATIVE)
    norm_placement: str = _f("pre", "pre: x + f(norm(x)); sandwich: x + norm(f(norm(x))), a second norm on each "
                                    "attention and MLP output (Gemma 2/3).", ("pre", "sandwich"))
    norm_plus_one: bool = _f(False, "RMSNorm scales by (1 + weight), the weight stored as such (Gemma).")
    embed_scale: bool = _f(False, "Multiply the token embeddings by sqrt(d_model) (Gemma).")
    attn_scale: float = _f(0.0, "Multiplier of the attention scores; 0 = 1/sqrt(head_dim) (Gemma 3: "
                                "query_pre_attn_scalar**-0.5).", range=NONNEGATIVE)
    norm_eps: float = _f(1e-5, "Epsilon of the normalisation layers.", range=ABOVE_ZERO)
    rope_theta: float = _f(10000.0, "RoPE base frequency (of the global layers when model.rope_local_theta is set).",
                           range=ABOVE_ZERO)
    rope_scaling: str = _f("none", "RoPE frequency scaling of the global layers: none, linear (positions / "
                                   "rope_factor), llama3 (Llama 3.1: low frequencies / rope_factor, a smooth "
                                   "band between rope_low_freq_factor and rope_high_freq_factor of "
                                   "rope_original_context) or yarn (YaRN: frequencies below rope_beta_slow "
                                   "rotations over rope_original_context / rope_factor, above rope_beta_fast "
                                   "kept, a ramp between; cos and sin times rope_attention_factor).",
                           ("none", "linear", "llama3", "yarn"))
    rope_factor: float = _f(8.0, "RoPE scaling factor (rope_scaling linear / llama3 / yarn).", range=Range(1))
    rope_beta_fast: float = _f(32.0, "yarn RoPE scaling: frequencies of more rotations than this over "
                                     "rope_original_context are kept.", range=ABOVE_ZERO)
    rope_beta_slow: float = _f(1.0, "yarn RoPE scaling: frequencies of fewer rotations than this are divided by "
                                    "rope_factor.", range=ABOVE_ZERO)
    rope_truncate: bool = _f(True, "yarn RoPE scaling: round the band between rope_beta_fast and rope_beta_slow "
                                   "outwards to whole frequencies (transformers' truncate; GPT-OSS: false).")
    rope_attention_factor: float = _f(0.0, "yarn RoPE scaling: RoPE's cos and sin times this (so the scores times "
                                           "its square); 0 = 0.1 ln(rope_factor) + 1.", range=NONNEGATIVE)
    rope_low_freq_factor: float = _f(1.0, "llama3 RoPE scaling: wavelengths above rope_original_context / this are "
                                          "divided by rope_factor.", range=ABOVE_ZERO)
    rope_high_freq_factor: float = _f(4.0, "llama3 RoPE scaling: wavelengths below rope_original_context / this are "
                                           "kept.", range=ABOVE_ZERO)
    rope_original_context: int = _f(8192, "llama3 / yarn RoPE scaling: the context the model was pre-trained at.",
                                    range=POSITIVE)
    sliding_window: int = _f(0, "Sliding-window attention: a query sees the last this many positions (itself "
                                "included); 0 = unlimited causal (Mistral: 4096; Gemma 3's local layers: 512-1024).",
                             range=NONNEGATIVE)
    global_every: int = _f(0, "With model.sliding_window: every this-many-th layer (the last of each group: layers "
                              "N-1, 2N-1, ...) attends globally, the others in the window (Gemma 3: 6); 0 = every "
                              "layer uses the window.", range=NONNEGATIVE)
    rope_local_theta: float = _f(0.0, "RoPE base of the sliding-window layers, without scaling (Gemma 3: 10000); "
                                      "0 = the same RoPE as the global layers.", range=NONNEGATIVE)
    init_std: float = _f(0.02, "Std of the normal initialiser (residual projections scaled by 1/sqrt(2*n_layers)).",
                         range=ABOVE_ZERO)
    remat: str = _f("none", "Rematerialisation policy of each block (what it keeps for the backward): none "
                            "(everything), save_dots (the weight-matmul and attention outputs; minimal is MaxText's "
                            "name for it), save_dots_except_mlp, save_qkv_proj, full (only the block input), offload "
                            "(as save_dots, in pinned host memory; GPU/TPU). See docs/guides/performance.md.",
                    ("none", "full", "save_dots", "minimal", "save_dots_except_mlp", "save_qkv_proj", "offload"))
    attention: str = _f("auto", "Attention kernel: auto (cudnn on GPU, pallas on TPU, xla on CPU, and xla where the "
                                "kernel does not fit), xla (reference, float32 scores), cudnn (cuDNN flash attention, "
                                "GPU, bfloat16), pallas (Pallas flash kernels: TPU splash attention, GPU Triton).",
                        ("auto", "xla", "cudnn", "pallas"))
    loss_chunk_tokens: int = _f(4096, "The head and cross-entropy run over chunks of at most this many tokens per "
                                      "device, so the float32 logits of the whole batch never exist; 0 = one chunk.",
                                range=NONNEGATIVE)
    param_dtype: str = _f("float32", "Dtype parameters are stored in.", ("float32", "bfloat16"))
    compute_dtype: str = _f("auto", "Dtype of matmuls: auto = float32 on CPU, bfloat16 on GPU/TPU.",
                            ("auto", "float32", "bfloat16"))

    def yarn_attention_factor(self) -> float:
        """YaRN's multiplier of RoPE's cos and sin: ``rope_attention_factor`` when set (> 0), else
        ``0.1 ln(rope_factor) + 1`` (1 for a factor <= 1), as transformers' default."""
        if self.rope_attention_factor > 0:
            return float(self.rope_attention_factor)
        return 1.0 if self.rope_factor <= 1 else 0.1 * math.log(self.rope_factor) + 1.0

    def resolved(self) -> "ModelConfig":
        """A copy with every style-dependent choice made explicit (worked out once per set of field values
        and copied: the planner asks for it tens of thousands of times per plan)."""
        values = tuple(self.__dict__.values())
        key = (values, tuple(map(type, values)))
        try:
            done = _RESOLVED.get(key)
        except TypeError:  # a field holds an unhashable value
            return self._resolve()
        if done is None:
            if len(_RESOLVED) > 4096:
                _RESOLVED.clear()
            done = _RESOLVED[key] = self._resolve()
        return replaced(done)

    def _resolve(self) -> "ModelConfig":
        llama = self.style == "llama"
        c = dataclasses.replace(self)
        c.positions = c.positions or ("rope" if llama else "learned")
        c.max_positions = c.max_positions or c.seq_len
        c.norm = c.norm or ("rmsnorm" if llama else "layernorm")
        c.mlp = c.mlp or ("swiglu" if llama else "gelu")
        c.tie_embeddings = (not llama) if c.tie_embeddings is None else c.tie_embeddings
        c.bias = (not llama) if c.bias is None else c.bias
        c.n_kv_heads = c.n_kv_heads or c.n_heads
        if c.head_dim == 0 and c.n_heads > 0:
            if c.d_model % c.n_heads:
                raise ConfigError(f"model.d_model={c.d_model} is not divisible by model.n_heads={c.n_heads}; "
                                  "set model.head_dim explicitly or choose n_heads dividing d_model")
            c.head_dim = c.d_model // c.n_heads
        if c.d_ff == 0:
            c.d_ff = 4 * c.d_model if c.mlp == "gelu" else 64 * -(-(8 * c.d_model // 3) // 64)
        c.qkv_bias = c.bias if c.qkv_bias is None else c.qkv_bias
        c.v_head_dim = c.v_head_dim or c.head_dim
        return c

    @property
    def latent(self) -> bool:
        """Multi-head Latent Attention (``model.kv_lora_rank`` > 0)."""
        return self.kv_lora_rank > 0

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates in each head: ``rope_head_dim`` under MLA, else the whole head."""
        return self.rope_head_dim if self.latent else self.head_dim

    @property
    def gated(self) -> bool:
        """A gated MLP (two up projections, fused: SwiGLU, GeGLU or the clamped SwiGLU)."""
        return self.mlp in ("swiglu", "geglu", "clamped_swiglu")


    def layer_windows(self) -> list[int]:
        """Each layer's attention window (0: global), from ``sliding_window`` and ``global_every``."""
        w, every = self.sliding_window, self.global_every
        return [0 if not w or (every and (i + 1) % every == 0) else w for i in range(self.n_layers)]


@dataclass
class TrainConfig:
    steps: int = _f(200, "Optimizer steps.", range=POSITIVE)
    seed: int = _f(0, "Seed of the initial weights and of the synthetic data / data order.", range=NONNEGATIVE)
    batch_size: int = _f(32, "Global batch, in sequences (summed over all devices and microsteps).", range=POSITIVE)
    grad_accum: int = _f(1, "Gradient-accumulation microsteps per optimizer step (splits batch_size).", range=POSITIVE)
    lr: float = _f(3e-3, "Peak learning rate.", range=ABOVE_ZERO)
    warmup_steps: int = _f(20, "Linear warm-up steps from 0 to lr.", range=NONNEGATIVE)
    min_lr_ratio: float = _f(0.1, "Cosine decay ends at lr*min_lr_ratio at the last step.", range=FRACTION)
    weight_decay: float = _f(0.1, "AdamW decoupled weight decay (matrices only; not norms, biases).", range=NONNEGATIVE)
    beta1: float = _f(0.9, "Adam beta1.", range=BETA)
    beta2: float = _f(0.95, "Adam beta2.", range=BETA)
    eps: float = _f(1e-8, "Adam epsilon.", range=ABOVE_ZERO)
    grad_clip: float = _f(1.0, "Clip gradients to this global L2 norm; 0 disables.", range=NONNEGATIVE)
    log_every: int = _f(10, "Write metrics every N steps (the first and last step are always logged).", range=POSITIVE)
    eval_every: int = _f(100, "Validation loss every N steps and at the end (0 = only at the end).", range=NONNEGATIVE)
    eval_batches: int = _f(4, "Global batches of validation text per evaluation.", range=POSITIVE)
    out_dir: str = _f("runs/default", "Run directory (resolved config, metrics.jsonl, compile_report.json, "
                                      "checkpoints/).")
    step_timeout: int = _f(1800, "Seconds without training progress (a step, or an evaluation or save between steps) "
                                 "after which the run is taken to hang, e.g. on a stuck peer process, and stops with "
                                 "an error; 0 = no limit.", range=NONNEGATIVE)
    peak_tflops: float = _f(0.0, "Dense bf16 peak TFLOP/s of one device, for MFU; 0 = from the device kind "
                                 "(H100/H200 989, A100 312, TPU v4 275, v5e 197, v5p 459, v6e 918; none on CPU: no "
                                 "MFU).", range=NONNEGATIVE)
    xla_perf_options: bool = _f(True, "Compile the train step with jaxpar's XLA performance options on GPU "
                                      "(latency-hiding scheduler, collective combining and pipelining; see "
                                      "docs/guides/performance.md). A flag set in XLA_FLAGS overrides the same option.")
    max_bad_steps: int = _f(5, "A step whose loss or gradients are not finite is skipped (no update); after this "
                               "many consecutive skipped steps the run stops with an error.", range=POSITIVE)


@dataclass
class DataConfig:
    source: str = _f("synthetic", "Training tokens: synthetic (a learnable function of seed and step), "
                                  "shakespeare (built-in corpus), files (data.path, tokenised at start, cached), "
                                  "tokens (a token store made by python -m jaxpar.data.prepare), or chat (data.path: "
                                  "a JSONL of conversations rendered with the model's chat template, only assistant "
                                  "turns trained; needs data.packing=documents).",
                     ("synthetic", "shakespeare", "files", "tokens", "chat"))
    path: str = _f("", "With source=files: a text file, a glob, or a folder of .txt/.md/.json/.jsonl/.parquet files; "
                       "with source=tokens: the token store's folder.")
    mix: str = _f("", "With source=tokens, instead of data.path: weighted token stores 'PATH:W,PATH:W'; every global "
                      "batch holds W/sum(W) of its rows from each (rounded by largest remainder).")
    packing: str = _f("stream", "How rows are made: stream (documents concatenated and cut into rows: attention and "
                                "positions run across documents, every token trained; GPT-2 style) or documents "
                                "(whole documents packed best-fit into rows, attention kept inside each document, "
                                "positions restarting per document, padding and untrained tokens weighted 0; the "
                                "loss is the mean over trained tokens of the global batch).", ("stream", "documents"))
    prefetch: int = _f(2, "Batches of a text or token source gathered ahead in a background thread (0 = in the loop).",
                       range=NONNEGATIVE)
    chat_template: str = _f("", "With source=chat (and python -m jaxpar.generate --chat): the Hugging Face model "
                                "folder whose chat template (chat_template.jinja or tokenizer_config.json) renders "
                                "conversations; empty = the folder of model.init_from, else of data.tokenizer.")
    jsonl_field: str = _f("text", "Field holding the document in .jsonl / .json records.")
    tokenizer: str = _f("bpe", "bpe (byte-level BPE trained on the training text, vocab model.vocab_size, "
                               "cached), byte (raw UTF-8 bytes), or the path of a tokenizer.json.")
    cache_dir: str = _f("", "Where trained tokenizers and the token stores of source=shakespeare/files are cached "
                            "(keyed by the text and tokenizer); empty = $JAXPAR_CACHE, else $XDG_CACHE_HOME/jaxpar, "
                            "else ~/.cache/jaxpar. Nothing is ever written beside the data.")
    val_fraction: float = _f(0.05, "Fraction of the text (its end) held out for validation.",
                             range=Range(0, 0.5, lo_open=True))


@dataclass
class SampleConfig:
    tokens: int = _f(200, "Tokens to generate after training (0 = no sample).", range=NONNEGATIVE)
    temperature: float = _f(0.8, "Sampling temperature (0 = greedy).", range=NONNEGATIVE)
    top_k: int = _f(40, "Sample among the k most likely tokens (0 = all).", range=NONNEGATIVE)
    top_p: float = _f(1.0, "Then among the smallest set of tokens whose probability reaches p (nucleus "
                           "sampling; 1 = all).", range=Range(0, 1, lo_open=True))
    prompt: str = _f("ROMEO:\n", "Text the sample starts from.")


@dataclass
class MoEConfig:
    """Mixture of Experts (used when ``model.arch=moe``)."""

    n_experts: int = _f(8, "Experts per MoE layer (split over parallel.expert, which must divide it).", range=POSITIVE)
    top_k: int = _f(2, "Experts each token is routed to (<= n_experts).", range=POSITIVE)
    capacity_factor: float = _f(1.25, "Expert capacity per group of tokens (one device's tokens) = "
                                      "ceil(top_k * tokens * capacity_factor / n_experts); overflow tokens are "
                                      "dropped. With moe.dispatch=sorted and parallel.expert > 1: the rows sent to "
                                      "each peer per exchange round, as a multiple of the balanced share.",
                                range=ABOVE_ZERO)
    dropless: bool = _f(False, "Capacity = all tokens of the group: no token is ever dropped (capacity_factor unused "
                               "by the capacity dispatch).")
    dispatch: str = _f("auto", "How tokens reach their experts: capacity (slots of every expert, E x capacity "
                           "rows, all-to-all over expert; dropless: every expert computes every token, E/top_k x "
                           "the expert flops), sorted (dropless only: assignments sorted by expert and run as a "
                           "grouped matmul, compute ~ top_k x tokens; over parallel.expert the rows move in "
                           "all-to-all rounds of capacity_factor x the balanced share; every pipeline schedule), "
                           "or auto (sorted when moe.dropless, else capacity).", ("auto", "capacity", "sorted"))
    grouped_matmul: str = _f("auto", "The sorted dispatch's grouped matmul: tiles (each expert's rows padded to "
                                     "tiles, a loop of one-expert matmuls), ragged_dot (jax.lax.ragged_dot: "
                                     "Mosaic's grouped GEMM on TPU; XLA:GPU and XLA:CPU expand it to a dense "
                                     "matmul over every expert, E/top_k x the flops and an [E, rows, d] "
                                     "temporary), or auto (ragged_dot on TPU, tiles elsewhere).",
                             ("auto", "tiles", "ragged_dot"))
    first_dense: int = _f(0, "The first this many layers are dense MLPs of model.d_ff (DeepSeek-V3's "
                             "first_k_dense_replace: 3), the moe.every pattern applying to the rest; under a "
                             "pipeline they run on the first stage after the embedding, per microbatch.",
                   range=NONNEGATIVE)
    every: int = _f(1, "Every n-th layer is MoE (layers n-1, 2n-1, ...), the others dense; 1 = all (Mixtral).",
                    range=POSITIVE)
    d_ff: int = _f(0, "Hidden width of one expert; 0 = model.d_ff.", range=NONNEGATIVE)
    renormalize: bool = _f(True, "Renormalise the top_k router probabilities of a token to sum to 1.")
    score: str = _f("softmax", "Router scores: softmax over the experts (Mixtral, Switch) or sigmoid per expert "
                               "(DeepSeek-V3; the chosen scores are the gates, renormalised if moe.renormalize).",
                    ("softmax", "sigmoid"))
    shared_experts: int = _f(0, "Always-on experts beside the routed ones (DeepSeek-MoE), each of width moe.d_ff; "
                                "run as one dense MLP of width shared_experts * moe.d_ff, tensor-parallel.",
                             range=NONNEGATIVE)
    bias_update_rate: float = _f(0.0, "Auxiliary-loss-free balancing (DeepSeek-V3): a per-expert routing bias "
                                      "(chooses experts, not part of the gates, no gradient) moved by this much "
                                      "after every step, down for experts above the mean load, up for those "
                                      "below; 0 = off. DeepSeek-V3 used 0.001 (with moe.aux_loss_weight ~ 0).",
                                 range=NONNEGATIVE)
    router_logit_bias: bool = _f(False, "A trained bias on the router's logits (GPT-OSS), unlike moe.router_bias "
                                        "part of the scores and the gates.")
    expert_bias: bool = _f(False, "Biases in the experts' up (gate and up) and down projections (GPT-OSS); the "
                                  "down bias is weighted by the gate like the rest of the expert's output.")
    router_bias: bool = _f(False, "A per-expert routing bias added to the scores to choose the experts but not "
                                  "in the gates, without gradient (DeepSeek-V3's e_score_correction_bias, kept as "
                                  "imported); moe.bias_update_rate > 0 has one and moves it.")
    n_group: int = _f(1, "Group-limited routing (DeepSeek-V3): the experts form this many equal groups, each "
                         "scored by the sum of its two best scores; 1 = off.", range=POSITIVE)
    topk_group: int = _f(1, "With moe.n_group > 1: a token chooses its experts among its topk_group best groups.",
                         range=POSITIVE)
    routed_scaling_factor: float = _f(1.0, "The routed experts' gates (renormalised if moe.renormalize) times this "
                                           "(DeepSeek-V3: 2.5).", range=ABOVE_ZERO)
    aux_loss_weight: float = _f(0.01, "Weight of the Switch load-balancing loss E * sum_i f_i P_i (summed over MoE "
                                      "layers).", range=NONNEGATIVE)
    z_loss_weight: float = _f(1e-3, "Weight of the router z-loss mean(logsumexp(logits)^2) (summed over MoE layers).",
                              range=NONNEGATIVE)

    def stacking(self, arch: str) -> tuple[int, int]:
        """``(every, first_dense)`` of a model of ``arch``: how its layers are stacked (``(1, 0)`` for a dense
        model, one stack)."""
        return (self.every, self.first_dense) if arch == "moe" else (1, 0)

    def groups(self, n_layers: int) -> int:
        """The stacked groups of ``every`` layers (``every - 1`` dense, one MoE) after the dense first ones."""
        return (n_layers - self.first_dense) // self.every

    def dispatch_path(self) -> str:
        """The dispatch ``moe.dispatch`` runs: ``auto`` is sorted when dropless, else capacity."""
        return ("sorted" if self.dropless else "capacity") if self.dispatch == "auto" else self.dispatch


@dataclass
class CheckpointConfig:
    enabled: bool = _f(True, "Save checkpoints (orbax) of parameters, optimizer state, step and data position.")
    dir: str = _f("", "Checkpoint directory; empty = <train.out_dir>/checkpoints.")
    every: int = _f(100, "Save every N steps, and always at the last step (0 = only at the last step).",
                    range=NONNEGATIVE)
    keep: int = _f(3, "Keep the newest K checkpoints.", range=POSITIVE)
    async_save: bool = _f(True, "Write in the background while training continues (arrays are copied to host "
                                "first).")
    resume: str = _f("auto", "auto: continue from the newest checkpoint in the directory if there is one; "
                             "required: fail if there is none; never: start fresh (fails if checkpoints exist, "
                             "rather than overwrite them).", ("auto", "required", "never"))


@dataclass
class DistributedConfig:
    """Multi-process (multi-host) runs through jax.distributed (one process per host or per GPU)."""

    initialize: str = _f("auto", "auto: call jax.distributed.initialize when a coordinator is given (key or "
                                 "JAXPAR_COORDINATOR) or a multi-process SLURM / Open MPI / TPU-pod job is detected; "
                                 "on: always (JAX auto-detects the cluster); off: single process.",
                         ("auto", "on", "off"))
    coordinator: str = _f("", "host:port of process 0's coordination service (else env JAXPAR_COORDINATOR, "
                              "else auto-detected).")
    num_processes: int = _f(0, "Number of processes (else env JAXPAR_NUM_PROCESSES, else auto-detected).",
                            range=NONNEGATIVE)
    process_id: int = _f(-1, "This process's index (else env JAXPAR_PROCESS_ID, else auto-detected).", range=Range(-1))
    heartbeat_timeout: int = _f(60, "Seconds without a heartbeat after which a peer counts as dead and every "
                                    "process stops with an error.", range=POSITIVE)
    init_timeout: int = _f(300, "Seconds to wait for all processes to join at start-up.", range=POSITIVE)


@dataclass
class DebugConfig:
    dump_hlo: bool = _f(False, "Also write the optimised HLO of the train step as train_step.hlo.txt.")
    nan_steps: str = _f("", "Fault injection: comma-separated 0-based steps whose loss and gradients are made NaN "
                            "(to test the skipping of non-finite steps).")

    def nan_step_list(self) -> list[int]:
        try:
            return sorted({int(x) for x in self.nan_steps.split(",") if x.strip()})
        except ValueError:
            raise ConfigError(f"debug.nan_steps={self.nan_steps!r}: expected comma-separated step numbers, "
                              "e.g. 3,4") from None


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    moe: MoEConfig = field(default_factory=MoEConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Building a Config from dictionaries, YAML and dotted overrides.


def _allowed_types(tp) -> tuple:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return typing.get_args(tp)
    return (tp,)


def _coerce(key: str, value: Any, tp, choices) -> Any:
    allowed = _allowed_types(tp)
    if value is None:
        if type(None) in allowed:
            return None
        raise ConfigError(f"{key}: null is not allowed (expected {tp.__name__})")
    out: Any = None
    for t in allowed:
        if t is type(None):
            continue
        if t is bool:
            if isinstance(value, bool):
                out = value
                break
        elif t is int:
            if isinstance(value, int) and not isinstance(value, bool):
                out = value
                break
        elif t is float:
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out = float(value)
                break
            if isinstance(value, str):  # YAML 1.1 reads "2e-4" (no dot) as a string
                try:
                    out = float(value)
                    break
                except ValueError:
                    pass
        elif t is str:
            if isinstance(value, str):
                out = value
                break
    if out is None:
        names = " or ".join(t.__name__ for t in allowed)
        hint = f"; choose one of {', '.join(map(str, choices))}" if choices else ""
        raise ConfigError(f"{key}={value!r}: expected {names}{hint}")
    if choices is not None and out not in choices:
        raise ConfigError(f"{key}={out!r} is not a valid choice; choose one of {', '.join(map(str, choices))}")
    return out


def _unknown(key: str, candidates) -> ConfigError:
    leaf = key.rsplit(".", 1)
    prefix = leaf[0] + "." if len(leaf) == 2 else ""
    full = [prefix + c for c in candidates]
    close = difflib.get_close_matches(key, full, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else f"; valid keys: {', '.join(full)}"
    return ConfigError(f"unknown config key {key!r}{hint}")


def _build(cls, values: dict, prefix: str = ""):
    if not isinstance(values, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {values!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in values.items():
        key = prefix + str(k)
        if k not in fields:
            raise _unknown(key, fields)
        tp = hints[k]
        if dataclasses.is_dataclass(tp):
            kwargs[k] = _build(tp, v, key + ".")
        else:
            kwargs[k] = _coerce(key, v, tp, fields[k].metadata.get("choices"))
    return cls(**kwargs)


# Old key -> new key. An old key still works for one release, with a note on stderr.
ALIASES = {"parallel.sequence_parallel": "parallel.megatron_sp"}


def _alias(key: str) -> str:
    new = ALIASES.get(key)
    if new is None:
        return key
    print(f"note: {key} is now called {new}; the old name works until the next release", file=sys.stderr)
    return new


def _apply_aliases(tree: dict) -> None:
    """Move old keys of a YAML tree to their new names."""
    for old in ALIASES:
        section, leaf = old.split(".")
        node = tree.get(section)
        if isinstance(node, dict) and leaf in node:
            new_section, new_leaf = _alias(old).split(".")
            tree.setdefault(new_section, {})[new_leaf] = node.pop(leaf)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    dotted = _alias(dotted)
    parts = dotted.split(".")
    node: dict = tree
    cls: Any = Config  # the section holding parts[i]: a dataclass type
    for i, p in enumerate(parts):
        names = {f.name: f for f in dataclasses.fields(cls)} if cls is not None else {}
        if p not in names:
            raise _unknown(".".join(parts[: i + 1]), names)
        tp = typing.get_type_hints(cls)[p]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(tp):
                raise ConfigError(f"{dotted} is a section; set one of its keys, e.g. {dotted}."
                                  f"{dataclasses.fields(tp)[0].name}=...")
            node[p] = value
        else:
            if not dataclasses.is_dataclass(tp):
                raise ConfigError(f"{'.'.join(parts[: i + 1])} is a value, not a section")
            node = node.setdefault(p, {})
            cls = tp


def parse_override(arg: str) -> tuple[str, Any]:
    """``"parallel.tensor=4"`` -> ``("parallel.tensor", 4)``; values are parsed as YAML scalars."""
    if "=" not in arg:
        raise ConfigError(f"override {arg!r} must look like section.key=value (e.g. parallel.tensor=4)")
    key, raw = arg.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(path: str | Path | None = None, overrides: list[str] | dict | None = None) -> Config:
    """Defaults <- YAML file <- overrides (``["train.steps=10"]`` or ``{"train.steps": 10}``)."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} " + ("is a folder; name a .yaml file in it" if p.is_dir()
                                                            else "does not exist"))
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:  # one line: where and what
            mark = getattr(e, "problem_mark", None)
            where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            raise ConfigError(f"config file {str(p)!r} is not valid YAML ({where}{what})") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config file {str(p)!r} cannot be read ({e})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {str(p)!r} must hold a mapping of sections")
        tree = loaded
        _apply_aliases(tree)
    items = overrides.items() if isinstance(overrides, dict) else [parse_override(o) for o in overrides or []]
    given = {ALIASES.get(k, k): v for k, v in items}
    init_from = given.get("model.init_from", _get_dotted(tree, "model.init_from"))
    fixed: dict = {}
    if init_from:  # a Hugging Face config.json sits between the YAML file and the command line
        fixed = hf_config.apply(tree, str(init_from), _get_dotted, _set_dotted, set(given))
    for key, value in items:
        want = fixed.get(ALIASES.get(key, key), value)
        if value != want and not (isinstance(value, (int, float)) and isinstance(want, float)
                                  and math.isclose(value, want)):
            raise ConfigError(f"{key}={value!r} contradicts model.init_from={init_from}, whose config.json has "
                              f"{key}={want!r}; drop the override")
        _set_dotted(tree, key, value)
    # zb_v runs two chunks per stage, nothing else: pipeline_repeats, when the file and the command line leave it
    # unset, is implied (the check below still names an explicit other value)
    if (_get_dotted(tree, "parallel.pipeline_schedule") == "zb_v" and _get_dotted(tree, "parallel.pipeline_repeats")
            is None and _get_dotted(tree, "parallel.pipe") not in (None, 1)):
        _set_dotted(tree, "parallel.pipeline_repeats", 2)
    cfg = _build(Config, tree)
    validate(cfg)
    if cfg.model.init_from:
        hf_config.check(cfg)
    return cfg


def _get_dotted(tree: dict, dotted: str) -> Any:
    """The value at ``section.key`` of a raw config tree, or None."""
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


_RANGED: list = []  # (section, field, Range) of every key that declares one: the planner checks thousands of configs
_RANGED_BY_KEYS: dict[frozenset, list] = {}  # those of a set of (section, key) pairs


def check_ranges(cfg: Config, keys: Collection[tuple[str, str]] | None = None) -> None:
    """Every numeric key (or those of ``keys``, ``(section, key)`` pairs) against the :class:`Range` its field
    declares."""
    if not _RANGED:
        _RANGED.extend((sec.name, f, f.metadata["range"]) for sec in dataclasses.fields(Config)
                       for f in dataclasses.fields(getattr(cfg, sec.name)) if f.metadata.get("range") is not None)
    ranged = _RANGED
    if keys is not None:
        keys = frozenset(keys)
        if keys not in _RANGED_BY_KEYS:
            _RANGED_BY_KEYS[keys] = [x for x in _RANGED if (x[0], x[1].name) in keys]
        ranged = _RANGED_BY_KEYS[keys]
    for name, f, rng in ranged:
        v = getattr(getattr(cfg, name), f.name)
        if v is not None and v not in rng:
            raise ConfigError(f"{name}.{f.name}={v!r} is out of range: it must be "
                              + ("a finite number " if not math.isfinite(v) else "") + f"{rng}"
                              + (f" ({f.metadata['help']})" if "=" not in str(rng) and len(f.metadata["help"]) < 90
                                 else ""))


def validate(cfg: Config, ranged: Collection[tuple[str, str]] | None = None) -> None:
    """Range checks that need no devices (of every numeric key, or of ``ranged`` alone: the keys a caller changed
    in a config that passed). Mesh/model divisibility is checked in partitioning."""
    check_ranges(cfg, ranged)
    par = cfg.parallel
    minus_one = [a for a in ("data", "tensor", "pipe", "expert", "seq") if getattr(par, a) == -1]
    for a in ("data", "tensor", "pipe", "expert", "seq"):
        v = getattr(par, a)
        if v != -1 and v <= 0:
            raise ConfigError(f"parallel.{a}={v} must be a positive integer, or -1 (the rest of the devices)")
    if len(minus_one) > 1:
        raise ConfigError(f"only one parallel axis may be -1 (the rest of the devices); got {', '.join(minus_one)}")
    if par.megatron_sp and par.tensor == 1:
        raise ConfigError("parallel.megatron_sp=true needs parallel.tensor > 1 (it splits the sequence over "
                          "the tensor axis); set parallel.tensor or parallel.megatron_sp=false")
    if par.pipe == 1 and (par.microbatches or par.pipeline_repeats != 1 or par.pipeline_schedule != "gpipe"):
        key = ("parallel.microbatches" if par.microbatches else
               "parallel.pipeline_repeats" if par.pipeline_repeats != 1 else "parallel.pipeline_schedule")
        raise ConfigError(f"{key}={getattr(par, key.split('.')[1])} has no effect with parallel.pipe=1 (it "
                          "configures the pipeline); remove it or set parallel.pipe > 1")
    if par.stage_remat and (par.pipe == 1 or par.pipeline_schedule == "gpipe"):
        raise ConfigError("parallel.stage_remat=true has no effect "
                          + ("with parallel.pipe=1" if par.pipe == 1 else "with parallel.pipeline_schedule=gpipe "
                             "(its backward is the scan's, which keeps what model.remat keeps)")
                          + ": it runs a stage's forward again for its backward in 1f1b, zb_h1 and zb_v; remove "
                          "it or set parallel.pipeline_schedule=1f1b")
    if par.stage_layers and par.pipe == 1:
        raise ConfigError(f"parallel.stage_layers={par.stage_layers} has no effect with parallel.pipe=1 (it splits "
                          "the layers over pipeline stages); remove it or set parallel.pipe > 1")
    par.stage_layer_list()  # parses
    if (par.pipeline_schedule == "1f1b" and par.pipeline_repeats > 1 and par.pipe > 1
            and (par.microbatches or par.pipe) % par.pipe):
        raise ConfigError(f"parallel.pipeline_schedule=1f1b with parallel.pipeline_repeats={par.pipeline_repeats} "
                          f"(interleaved 1F1B) needs parallel.microbatches to be a multiple of parallel.pipe="
                          f"{par.pipe}; got {par.microbatches}")
    if par.pipeline_schedule == "zb_h1" and par.pipeline_repeats != 1:
        raise ConfigError(f"parallel.pipeline_schedule=zb_h1 runs one chunk of layers per stage: it needs "
                          f"parallel.pipeline_repeats=1; got {par.pipeline_repeats} (for chunks, use 1f1b)")
    if par.pipeline_schedule == "zb_v" and par.pipeline_repeats != 2:
        raise ConfigError(f"parallel.pipeline_schedule=zb_v runs two chunks of layers per stage (down the stages "
                          f"and back up): it needs parallel.pipeline_repeats=2; got {par.pipeline_repeats}")
    if par.pipeline_schedule in ("zb_h1", "zb_v") and par.pipe > 1 and par.seq > 1 and par.seq_attention == "ring":
        raise ConfigError(f"parallel.pipeline_schedule={par.pipeline_schedule} with parallel.seq > 1 needs "
                          "parallel.seq_attention="
                          "all_gather or ulysses: ring attention's collective-permutes, run inside a stage's pass "
                          "while other stages run other passes, paired up across stages on XLA:CPU (wrong numbers)")
    m = cfg.model
    r = m.resolved()
    if r.n_heads % r.n_kv_heads:
        raise ConfigError(f"model.n_kv_heads={r.n_kv_heads} must divide model.n_heads={r.n_heads}")
    if r.positions == "rope" and r.head_dim % 2:
        raise ConfigError(f"RoPE needs an even head dim; got {r.head_dim} (model.head_dim / d_model/n_heads)")
    if r.global_every and not r.sliding_window:
        raise ConfigError(f"model.global_every={r.global_every} interleaves sliding-window and global layers: it needs "
                          "model.sliding_window > 0")
    if r.rope_local_theta and not (r.sliding_window and r.positions == "rope"):
        raise ConfigError(f"model.rope_local_theta={r.rope_local_theta:g} is the RoPE base of sliding-window layers: "
                          "it needs model.sliding_window > 0 and model.positions=rope")
    if r.positions == "learned" and r.max_positions < r.seq_len and not m.init_from:  # an import: hf_config.check
        raise ConfigError(f"model.seq_len={r.seq_len} exceeds model.max_positions={r.max_positions}, the rows of the "
                          "learned position table; raise model.max_positions (0 = model.seq_len) or lower seq_len")
    if r.rope_scaling != "none" and r.positions != "rope":
        raise ConfigError(f"model.rope_scaling={r.rope_scaling} scales RoPE: it needs model.positions=rope")
    if r.rope_scaling == "llama3" and r.rope_low_freq_factor >= r.rope_high_freq_factor:
        raise ConfigError(f"model.rope_low_freq_factor={r.rope_low_freq_factor:g} must be below "
                          f"model.rope_high_freq_factor={r.rope_high_freq_factor:g} (rope_scaling=llama3)")
    if r.norm_plus_one and r.norm != "rmsnorm":
        raise ConfigError("model.norm_plus_one=true is an RMSNorm form (Gemma): it needs model.norm=rmsnorm")
    if r.latent:
        if r.positions != "rope":
            raise ConfigError(f"model.kv_lora_rank={r.kv_lora_rank} (MLA) has a decoupled RoPE key: it needs "
                              "model.positions=rope")
        if not 0 < r.rope_head_dim < r.head_dim or r.rope_head_dim % 2:
            raise ConfigError(f"model.rope_head_dim={r.rope_head_dim} (MLA) must be even and between 0 and "
                              f"model.head_dim={r.head_dim} (exclusive), the query/key width it is part of")
        if r.n_kv_heads != r.n_heads:
            raise ConfigError(f"model.n_kv_heads={r.n_kv_heads}: MLA (model.kv_lora_rank > 0) gives every head its "
                              f"own key and value from the latent; set n_kv_heads=0 (= n_heads={r.n_heads})")
        for key in ("qkv_bias", "qk_norm", "rope_local_theta", "attn_sinks"):
            if getattr(r, key):
                raise ConfigError(f"model.{key}={getattr(r, key)} is not supported with MLA (model.kv_lora_rank > 0); "
                                  "leave it unset")
    else:
        for key in ("q_lora_rank", "rope_head_dim", "v_head_dim"):
            if getattr(m, key):
                raise ConfigError(f"model.{key}={getattr(m, key)} configures Multi-head Latent Attention: it needs "
                                  "model.kv_lora_rank > 0")
    if r.arch == "moe" and r.global_every and (cfg.moe.every > 1 or cfg.moe.first_dense):
        key = "moe.every" if cfg.moe.every > 1 else "moe.first_dense"
        raise ConfigError(f"model.global_every={r.global_every} (windows that differ by layer) with model.arch=moe "
                          f"needs every layer MoE (moe.every=1, moe.first_dense=0); got {key}="
                          f"{getattr(cfg.moe, key.split('.')[1])}")
    t = cfg.train
    if not t.out_dir.strip():
        raise ConfigError("train.out_dir is empty: name the run directory (e.g. runs/my_run)")
    d = cfg.data
    if d.source == "files" and not d.path:
        raise ConfigError("data.source=files needs data.path (a file, glob or folder)")
    if d.source == "tokens" and not (d.path or d.mix):
        raise ConfigError("data.source=tokens needs data.path (a token store folder) or data.mix")
    if d.mix and d.source != "tokens":
        raise ConfigError(f"data.mix mixes token stores: it needs data.source=tokens (got data.source={d.source})")
    if d.mix and d.path:
        raise ConfigError("data.mix and data.path both name the data; give one (data.mix lists every store)")
    if d.source == "chat":
        if not d.path:
            raise ConfigError("data.source=chat needs data.path (a .jsonl file of conversations, or a folder of them)")
        if d.packing != "documents":
            raise ConfigError("data.source=chat trains conversations as documents (attention inside each, only "
                              "assistant turns trained): it needs data.packing=documents")
    if d.packing == "documents" and d.mix:
        raise ConfigError("data.packing=documents with data.mix is not supported yet; pack one store (data.path)")
    if t.batch_size % t.grad_accum:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.grad_accum={t.grad_accum}")
    ds = cfg.distributed
    if ds.num_processes and ds.process_id >= ds.num_processes:
        raise ConfigError(f"distributed.process_id={ds.process_id} must be < distributed.num_processes="
                          f"{ds.num_processes}")
    cfg.debug.nan_step_list()
    validate_moe(cfg)


def check_groups(n_experts: int, top_k: int, groups: int, top_groups: int) -> None:
    """Group-limited routing's shapes (:func:`jaxpar.layers.moe.route`), or a :class:`ConfigError` naming the keys."""
    if groups < 1 or n_experts % groups:
        raise ConfigError(f"moe.n_group={groups} must divide moe.n_experts={n_experts}")
    if groups > 1 and n_experts // groups < 2:
        raise ConfigError(f"moe.n_group={groups}: each group needs at least 2 experts (it is scored by its best "
                          f"two); n_experts={n_experts} gives {n_experts // groups}")
    if not 1 <= top_groups <= groups:
        raise ConfigError(f"moe.topk_group={top_groups} must be between 1 and moe.n_group={groups}")
    if top_k > top_groups * (n_experts // groups):
        raise ConfigError(f"moe.top_k={top_k} is more than the {top_groups * (n_experts // groups)} experts of the "
                          f"moe.topk_group={top_groups} groups a token may choose from")


def validate_moe(cfg: Config) -> None:
    """MoE keys (checked only for ``model.arch=moe``)."""
    if cfg.model.arch != "moe":
        return
    e = cfg.moe
    if e.top_k > e.n_experts:
        raise ConfigError(f"moe.top_k={e.top_k} must be between 1 and moe.n_experts={e.n_experts}")
    ep = cfg.parallel.expert
    if ep > 0 and e.n_experts % ep:
        divisors = ", ".join(str(d) for d in range(1, e.n_experts + 1) if e.n_experts % d == 0)
        raise ConfigError(f"moe.n_experts={e.n_experts} is not divisible by parallel.expert={ep}; choose n_experts "
                          f"a multiple of {ep} or parallel.expert among {divisors}")
    n = cfg.model.n_layers - e.first_dense
    if n <= 0:
        raise ConfigError(f"moe.first_dense={e.first_dense} leaves no MoE layer of model.n_layers="
                          f"{cfg.model.n_layers}; choose first_dense < n_layers")
    if n % e.every:
        if not e.first_dense:
            raise ConfigError(f"moe.every={e.every} must divide model.n_layers={cfg.model.n_layers}")
        raise ConfigError(f"moe.every={e.every} must divide the {n} layers after the moe.first_dense={e.first_dense} "
                          f"dense ones (model.n_layers={cfg.model.n_layers})")
    check_groups(e.n_experts, e.top_k, e.n_group, e.topk_group)
    if e.grouped_matmul != "auto" and e.dispatch_path() != "sorted":
        raise ConfigError(f"moe.grouped_matmul={e.grouped_matmul} has no effect with moe.dispatch="
                          f"{e.dispatch_path()} (it is the sorted dispatch's matmul): remove it, or set "
                          "moe.dispatch=sorted with moe.dropless=true")
    if e.dispatch == "sorted" and not e.dropless:
        raise ConfigError("moe.dispatch=sorted is the dropless path (no capacity): set moe.dropless=true, or "
                          "moe.dispatch=capacity")


def config_table() -> str:
    """Markdown table of every key, its type, default and meaning (the docs' key reference, docs/reference/config.md,
    is generated from it)."""
    rows = ["| key | type | default | meaning |", "|---|---|---|---|"]
    hints_root = typing.get_type_hints(Config)
    for sec in dataclasses.fields(Config):
        cls = hints_root[sec.name]
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            tname = " or ".join("null" if t is type(None) else t.__name__ for t in _allowed_types(tp))
            choices = f.metadata.get("choices")
            if choices:
                tname += ": " + " / ".join(map(str, choices))
            if f.metadata.get("range") is not None:
                tname += f" {f.metadata['range']}"
            if f.default is not dataclasses.MISSING:
                default = f.default
            else:
                assert f.default_factory is not dataclasses.MISSING  # every key has a default or a factory
                default = f.default_factory()
            rows.append(f"| `{sec.name}.{f.name}` | {tname} | `{default!r}` | {f.metadata.get('help', '')} |")
    return "\n".join(rows)
