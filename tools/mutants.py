"""The mutants of ``tools/mutate.py``: realistic one-line bugs in jaxpar's math, grouped by mechanism.

Each entry is one bug a developer could plausibly write (an off-by-one in a shift, a wrong axis in a
collective, a missing ``1/n``, a transposed weight, a swapped argument), never a syntax error:

* ``id``: unique, ``<mechanism prefix>-<what>``;
* ``file`` / ``old`` / ``new``: ``old`` must occur exactly once in ``file`` (``python tools/mutate.py --check``
  refuses a stale mutant by its id); the mutant replaces it by ``new``;
* ``tests``: the pytest arguments that should kill it, fastest first (node ids, or ``-k`` expressions after
  a file), run with ``-x``;
* ``equivalent``: why the mutant computes what the original does (it is run, to check the argument, but
  kept out of the kill rate);
* ``note``: where a test gap is suspected (the mutant is expected to survive today), the test that would
  kill it.

Keep each ``old`` as short as uniqueness allows, so that unrelated edits do not make it stale.
"""

from __future__ import annotations

# Modules that must import from the scratch copy when the mutants run (checked before any mutant runs).
PROBE = ("jaxpar", "jaxpar.models")

MECHANISMS = {
    "data-parallel": "gradients and loss reduced over the batch axes (data, expert)",
    "tensor-parallel": "Megatron column/row layers, vocabulary-parallel embedding and loss, KV-head copies",
    "pipeline-gpipe": "GPipe and circular schedules (jaxpar/layers/pipeline.py: pipeline_loss, _pipeline)",
    "pipeline-1f1b": "the 1F1B schedule (one_f_one_b)",
    "pipeline-interleaved": "interleaved 1F1B (R chunks per stage: _f1b_slot, _f1b_unslot, _f1b_backward_at)",
    "moe-routing": "expert parallelism: top-k, capacity, choice-rank slots, dropless sorted dispatch, all-to-all",
    "moe-losses": "the router's balance loss, z-loss, their weights, and the bias balancing",
    "sequence-parallel": "context-parallel attention: all_gather, ring (zig-zag), ulysses",
    "megatron-sp": "Megatron sequence parallelism inside tensor (reduce-scatter / all-gather of the residual)",
    "zero": "ZeRO-1 (optimizer state) and ZeRO-3 (parameters) sharding rules",
    "loss": "the lean chunked head + cross-entropy and the vocabulary-parallel cross-entropy",
    "grad-accum": "gradient accumulation over microsteps",
    "generation": "KV-cache positions, segments, sampling rules",
    "checkpoint": "save / restore (layer order, step numbers) and the data iterator's state",
    "hf-mapping": "Hugging Face import / export: layouts, transposes, slices, config translation",
    "comm-model": "the analytic communication model (jaxpar/comm.py, hlo.wire_bytes)",
    "memory-model": "the planner's memory and time model, faults.step_bytes, model flops",
}


def M(id: str, mechanism: str, file: str, old: str, new: str, tests, equivalent: str | None = None,
      note: str | None = None) -> dict:
    """One entry (``tools/mutate.py`` makes its ``Mutant`` of it)."""
    return dict(id=id, mechanism=mechanism, file=file, old=old, new=new, tests=tests, equivalent=equivalent,
                note=note)


LOSS = "jaxpar/layers/loss.py"
EMBED = "jaxpar/layers/embedding.py"
PIPE = "jaxpar/layers/pipeline.py"
MOE = "jaxpar/layers/moe.py"
CP = "jaxpar/layers/context_parallel.py"
PART = "jaxpar/partitioning.py"

FUSED = "tests/test_model.py::test_fused_head_loss_equals_autodiff_of_the_unfused_loss"
PIPE_EQ = "tests/test_pipeline.py::test_loss_and_grads_match_single_device"
SEQ_EQ = "tests/test_sequence.py::test_loss_and_grads_match_single_device"
LAYER_REF = "tests/test_moe.py::test_layer_matches_per_token_reference"
DP8 = "tests/test_equivalence.py::test_layout_matches_single_device[zero1_data8-gpt2]"
GREEDY = "tests/test_generate.py::test_cached_greedy_equals_recomputation_for_prompts_of_different_lengths"

MUTANTS = [
    # -- data parallelism --------------------------------------------------------------------------------
    M("dp-loss-sum-of-local-means", "data-parallel", LOSS,
      "loss = self._psum(loss, self.token_axes) / self.n_tokens",
      "loss = self._psum(loss / (b * t), self.token_axes)",
      [f"{FUSED}[untied-data2-tensor2]", DP8]),
    M("dp-grad-local-token-count", "data-parallel", LOSS,
      "- hit) / self.n_tokens)", "- hit) / (b * t))",
      [f"{FUSED}[untied-data2-tensor2]", DP8]),
    M("dp-head-grad-one-shard", "data-parallel", LOSS,
      "return loss, dx, jnp.sum(dw_parts, axis=0)", "return loss, dx, dw_parts[0]",
      [f"{FUSED}[untied-data2-tensor2]", DP8]),
    M("dp-expert-not-a-batch-axis", "data-parallel", PART,
      '"batch": ("data", "expert"), "length"', '"batch": ("data",), "length"',
      ["tests/test_moe.py::test_moe_model_matches_single_device[data2_expert4]",
       "tests/test_collectives.py::test_data_parallel_allreduces_gradients_once"]),

    # -- tensor parallelism ------------------------------------------------------------------------------
    M("tp-embed-shard-offset", "tensor-parallel", EMBED,
      'local_ids = ids - jax.lax.axis_index("tensor") * rows', 'local_ids = ids - jax.lax.axis_index("tensor")',
      ["tests/test_equivalence.py::test_layout_matches_single_device[tensor8-gpt2]"]),
    M("tp-embed-shard-bound", "tensor-parallel", EMBED,
      "ok = (local_ids >= 0) & (local_ids < rows)", "ok = (local_ids >= 0) & (local_ids <= rows)",
      ["tests/test_equivalence.py::test_layout_matches_single_device[tensor8-gpt2]"]),
    M("tp-loss-vocab-offset", "tensor-parallel", LOSS,
      "first = jax.lax.axis_index(self.vocab_axes) * local_vocab if", "first = jax.lax.axis_index(self.vocab_axes) if",
      [f"{FUSED}[untied-data2-tensor2]"]),
    # only layouts with tensor > n_kv_heads copy KV heads, and the one-device comparisons draw K and V from the same
    # distribution: the Hugging Face parity test (qwen2-t4; gemma3-t4sp too) is the one that sees the swap
    M("tp-kv-copy-swaps-k-v", "tensor-parallel", "jaxpar/layers/attention.py",
      "for i in (group, group + 1))", "for i in (group + 1, group))",
      ["tests/test_families.py::test_import_matches_transformers[qwen2-t4]"]),
    M("tp-mlp-rule-missing", "tensor-parallel", PART,
      '"mlp": ("tensor",), "act_mlp"', '"mlp": (), "act_mlp"',
      ["tests/test_memory.py::test_tensor8_matrices_are_an_eighth"]),

    # -- pipeline: GPipe and circular --------------------------------------------------------------------
    M("pp-bubble-off-by-one", "pipeline-gpipe", PIPE,
      "return (stages - 1) / (microbatches * repeats + stages - 1)",
      "return (stages - 1) / (microbatches * repeats + stages)",
      ["tests/test_pipeline.py::test_schedule_and_bubble"]),
    M("pp-microbatch-rows-contiguous", "pipeline-gpipe", PIPE,
      "a.reshape(a.shape[0] // m_, m_, *a.shape[1:]).swapaxes(0, 1)", "a.reshape(m_, a.shape[0] // m_, *a.shape[1:])",
      ["tests/test_pipeline.py::test_microbatches_not_a_multiple_of_stages"]),
    M("pp-last-stage-files-late", "pipeline-gpipe", PIPE,
      "(s == s_ - 1) & ok & (k >= m_ * (r_ - 1))", "(s == s_ - 1) & ok & (k > m_ * (r_ - 1))",
      ["tests/test_pipeline.py::test_microbatches_not_a_multiple_of_stages"]),
    M("pp-circular-no-wraparound", "pipeline-gpipe", PIPE,
      "    perm = [(s, (s + 1) % s_) for s in range(s_) if r_ > 1 or s + 1 < s_]",
      "    perm = [(s, (s + 1) % s_) for s in range(s_) if s + 1 < s_]",
      [f"{PIPE_EQ}[llama_gqa-pipe=2-pipeline_repeats=2-microbatches=2]"]),
    M("pp-circular-waiting-slot", "pipeline-gpipe", PIPE,
      'c["buf"] = _put(c["buf"], x, (t - s_) % m_,', 'c["buf"] = _put(c["buf"], x, (t - s_ + 1) % m_,',
      [f"{PIPE_EQ}[gpt2-pipe=2-pipeline_repeats=2-microbatches=4-data=2]"]),
    M("pp-circular-repeat-by-stages", "pipeline-gpipe", PIPE,
      "repeat = jnp.clip(k // m_, 0, r_ - 1)", "repeat = jnp.clip(k // s_, 0, r_ - 1)",
      [f"{PIPE_EQ}[gpt2-pipe=2-pipeline_repeats=2-microbatches=4-data=2]"]),
    M("pp-stage-major-order", "pipeline-gpipe", PIPE,
      "return np.array([(r * stages + s) * lg + j", "return np.array([(s * repeats + r) * lg + j",
      [f"{PIPE_EQ}[llama_gqa-pipe=2-pipeline_repeats=2-microbatches=2]"]),
    M("pp-forward-files-every-repeat", "pipeline-gpipe", PIPE,
      "done = (t >= s_ - 1) & (t - (s_ - 1) >= m_ * (r_ - 1))", "done = t >= s_ - 1",
      ["tests/test_library.py::test_a_users_stack_pipelines_like_one_device"],
      equivalent="the last stage files microbatch m of repeat r in slot m at t = r*M + m + S-1; the last repeat's "
                 "write comes later and overwrites the earlier ones, so the buffer ends the same"),

    # -- pipeline: 1F1B ----------------------------------------------------------------------------------
    M("f1b-head-grad-not-over-m", "pipeline-1f1b", PIPE,
      "d_last, dy = vjp(jnp.ones((), loss.dtype) / m_)", "d_last, dy = vjp(jnp.ones((), loss.dtype))",
      [f"{PIPE_EQ}[gpt2-pipe=2-pipeline_schedule=1f1b]"]),
    M("f1b-loss-not-over-m", "pipeline-1f1b", PIPE,
      "jnp.where(last_ok, loss.astype(jnp.float32) / m_, 0.0)", "jnp.where(last_ok, loss.astype(jnp.float32), 0.0)",
      [f"{PIPE_EQ}[gpt2-pipe=2-pipeline_schedule=1f1b]"]),
    M("f1b-backward-sent-forward", "pipeline-1f1b", PIPE,
      "bwd_perm = [(d, s) for s, d in fwd_perm]", "bwd_perm = fwd_perm",
      [f"{PIPE_EQ}[gpt2-pipe=2-pipeline_schedule=1f1b]"]),
    M("f1b-backward-slot-sign", "pipeline-1f1b", PIPE,
      "kb = t - warm - (s_ - 1 - s)", "kb = t - warm - (s_ - 1) - s",
      [f"{PIPE_EQ}[gpt2-pipe=2-pipeline_schedule=1f1b]"]),
    M("f1b-stash-one-short", "pipeline-1f1b", PIPE,
      "return 2 * repeats * stages - 1", "return 2 * repeats * stages - 2",
      ["tests/test_pipeline.py::test_1f1b_schedule", f"{PIPE_EQ}[gpt2-pipe=2-microbatches=8-pipeline_schedule=1f1b]"]),
    M("f1b-embed-grad-any-chunk", "pipeline-1f1b", PIPE,
      'c["dins"] = _put(c["dins"], dx, bmm, b_ok & (br == 0))', 'c["dins"] = _put(c["dins"], dx, bmm, b_ok)',
      [f"{PIPE_EQ}[gpt2-pipe=2-pipeline_repeats=2-pipeline_schedule=1f1b]"],
      equivalent="the slot is read after the loops only, and a microbatch's chunk-0 backward on stage 0 is the last "
                 "of its chunks (backwards run chunks R-1 .. 0), so the chunk-0 gradient is what stays"),

    # -- pipeline: interleaved 1F1B ----------------------------------------------------------------------
    M("il-slot-group-stride", "pipeline-interleaved", PIPE,
      "return (m // stages) * repeats * stages + r * stages + m % stages",
      "return (m // stages) * stages + r * stages + m % stages",
      ["tests/test_pipeline.py::test_interleaved_1f1b_schedule"]),
    M("il-backward-not-mirrored", "pipeline-interleaved", PIPE,
      "_f1b_slot(m, repeats - 1 - r, stages, repeats)", "_f1b_slot(m, r, stages, repeats)",
      ["tests/test_pipeline.py::test_interleaved_1f1b_schedule"]),
    M("il-unslot-group-stride", "pipeline-interleaved", PIPE,
      "return (k // rs) * stages + k % stages,", "return (k // rs) * rs + k % stages,",
      [f"{PIPE_EQ}[llama_gqa-pipe=2-pipeline_repeats=2-microbatches=4-data=2-tensor=2-pipeline_schedule=1f1b]"]),
    M("il-backward-chunk-order", "pipeline-interleaved", PIPE,
      "br = r_ - 1 - rr", "br = rr",
      [f"{PIPE_EQ}[gpt2-pipe=2-pipeline_repeats=2-pipeline_schedule=1f1b]"]),

    # -- expert parallelism and routing ------------------------------------------------------------------
    M("moe-slot-positions-from-one", "moe-routing", MOE,
      "(jnp.cumsum(by_rank, axis=0) - 1).reshape", "jnp.cumsum(by_rank, axis=0).reshape",
      ["tests/test_moe.py::test_first_choices_take_slots_before_second_choices"]),
    M("moe-slots-token-major", "moe-routing", MOE,
      "by_rank = jnp.swapaxes(onehot, 0, 1).reshape(top_k * g, e)", "by_rank = onehot.reshape(top_k * g, e)",
      # (the 2-token hand case happens to give the same slots token-major: the dropping reference decides)
      ["tests/test_moe.py::test_first_choices_take_slots_before_second_choices", f"{LAYER_REF}[one_device_drop]"]),
    M("moe-capacity-without-k", "moe-routing", MOE,
      "math.ceil(top_k * tokens * capacity_factor / n_experts", "math.ceil(tokens * capacity_factor / n_experts",
      ["tests/test_moe.py::test_capacity_formula"]),
    M("moe-capacity-one-extra", "moe-routing", MOE,
      "keep = pos < capacity", "keep = pos <= capacity",
      ["tests/test_moe.py::test_overflow_drops_the_last_tokens_of_the_group", f"{LAYER_REF}[one_device_drop]"]),
    M("moe-gates-not-renormalised", "moe-routing", MOE,
      "gates = gates / jnp.sum(gates, axis=-1, keepdims=True)",
      "gates = gates / jnp.sum(probs, axis=-1, keepdims=True)",
      [f"{LAYER_REF}[one_device_no_drop]"]),
    M("moe-gates-include-bias", "moe-routing", MOE,
      "gates = jnp.take_along_axis(probs, experts, axis=-1)",
      "gates = jnp.take_along_axis(probs + bias.astype(jnp.float32), experts, axis=-1)",
      [f"{LAYER_REF}[bias_one_device_no_drop]"]),
    M("moe-combine-all-to-all-axes", "moe-routing", MOE,
      "out = jax.lax.all_to_all(out, ax.expert, split_axis=1, concat_axis=0, tiled=True)",
      "out = jax.lax.all_to_all(out, ax.expert, split_axis=0, concat_axis=1, tiled=True)",
      [f"{LAYER_REF}[data2_expert2_tensor2_drop]"]),
    M("moe-sorted-tile-destination", "moe-routing", "jaxpar/layers/moe_dispatch.py",
      "- (jnp.cumsum(sizes) - sizes)[se]", "- jnp.cumsum(sizes)[se]",
      ["tests/test_moe.py::test_sorted_experts_equal_the_per_assignment_sum[tiles]"]),
    M("moe-rounds-one-row-too-many", "moe-routing", "jaxpar/layers/moe_dispatch.py",
      "valid = q[None, :] < count[:, None]", "valid = q[None, :] <= count[:, None]",
      ["tests/test_moe.py::test_expert_parallel_rounds_equal_one_device_under_skewed_routing"],
      equivalent="the extra position q = count reads the next peer's first row (or none: a), which the receiver "
                 "finds past its ends (local expert el: gated 0) and returns as zeros; their scatter lands on that "
                 "row before its own value in the same scatter (XLA:CPU writes duplicates in order) or adds 0 in "
                 "the sum over rounds. Not equivalent where duplicate scatter indices race (GPU): there only a "
                 "bit-reproducibility test on a GPU could see it"),
    M("moe-dropped-gate-kept", "moe-routing", MOE,
      "weights = jnp.where(r.keep, r.gates, 0.0).astype(self.dtype)", "weights = r.gates.astype(self.dtype)",
      [f"{LAYER_REF}[one_device_drop]"],
      equivalent="a dropped assignment's slot is E*C, which the combine's take (mode='fill') reads as zeros: its "
                 "gate multiplies zeros, and the gate's gradient there is zero too"),

    # -- router losses and bias balancing ----------------------------------------------------------------
    M("ml-balance-without-e", "moe-losses", MOE,
      '"aux_loss": e * jnp.sum(f * p_mean)', '"aux_loss": jnp.sum(f * p_mean)',
      ["tests/test_moe.py::test_balance_loss_is_hf_mixtral_over_top_k_for_one_layer"]),
    M("ml-balance-share-without-k", "moe-losses", MOE,
      "mean(counts / (g * k))", "mean(counts / g)",
      ["tests/test_moe.py::test_balance_loss_is_hf_mixtral_over_top_k_for_one_layer"]),
    M("ml-z-loss-square-of-mean", "moe-losses", MOE,
      "z = mean(jnp.mean(jnp.square(jax.nn.logsumexp(logits, axis=-1))))",
      "z = mean(jnp.square(jnp.mean(jax.nn.logsumexp(logits, axis=-1))))",
      [f"{LAYER_REF}[one_device_no_drop]"]),
    M("ml-bias-step-sign", "moe-losses", MOE,
      "jnp.sign(mean - load.astype(jnp.float32))", "jnp.sign(load.astype(jnp.float32) - mean)",
      ["tests/test_moe.py::test_trainer_moves_the_routing_bias_by_the_layer_loads",
       "tests/test_moe.py::test_bias_balancing_evens_out_a_skewed_router[softmax]"]),
    M("ml-z-loss-weighted-as-aux", "moe-losses", "models/moe.py",
      "total = ce + m.aux_loss_weight * aux + m.z_loss_weight * z",
      "total = ce + m.aux_loss_weight * aux + m.aux_loss_weight * z",
      ["tests/test_pipeline.py::test_pipelined_moe_with_router_losses_on_matches_one_device_per_microbatch[1f1b]"],
      note="tests that compare the MoE model with itself on one device weigh both sides the same; the pipelined "
           "router-loss test checks loss = ce_loss + the weighted router terms"),
    M("ml-pipeline-z-weight", "moe-losses", "models/moe.py",
      '"z_loss": m.z_loss_weight})', '"z_loss": m.aux_loss_weight})',
      ["tests/test_pipeline.py::test_pipelined_moe_with_router_losses_on_matches_one_device_per_microbatch[1f1b]"],
      note="the older pipeline tests run MoE with both router-loss weights 0; this one has them on, against one "
           "device per microbatch"),

    # -- sequence / context parallelism ------------------------------------------------------------------
    M("sp-ring-direction", "sequence-parallel", CP,
      "perm = [(r, (r + 1) % n) for r in range(n)]", "perm = [(r, (r - 1) % n) for r in range(n)]",
      ["tests/test_sequence.py::test_ring_skips_blocks_outside_the_sliding_window",
       f"{SEQ_EQ}[gpt2-seq=8-seq_attention=ring]"]),
    M("sp-ring-no-rescale", "sequence-parallel", CP,
      "l = l * corr + p.sum(-1)", "l = l + p.sum(-1)",
      ["tests/test_sequence.py::test_ring_skips_blocks_outside_the_sliding_window"]),
    M("sp-ring-positions-offset", "sequence-parallel", CP,
      'pos = jax.lax.axis_index("seq") * t + jnp.arange(t)', 'pos = jax.lax.axis_index("seq") + jnp.arange(t)',
      [f"{SEQ_EQ}[llama_gqa-seq=4-seq_attention=ring-seq_zigzag=False]"]),
    M("sp-allgather-query-offset", "sequence-parallel", CP,
      "q_offset=i * t, **kw)", "q_offset=i, **kw)",
      [f"{SEQ_EQ}[gpt2-seq=4-seq_attention=all_gather]"]),
    M("sp-ulysses-v-from-k", "sequence-parallel", CP,
      "to_heads(k), to_heads(v), kernel", "to_heads(k), to_heads(k), kernel",
      [f"{SEQ_EQ}[gpt2-seq=4-seq_attention=ulysses]"]),
    M("sp-zigzag-cond-inclusive", "sequence-parallel", CP,
      "return jax.lax.cond(j < i, low_keys, high_queries, carry)",
      "return jax.lax.cond(j <= i, low_keys, high_queries, carry)",
      ["tests/test_sequence.py::test_ring_skips_blocks_outside_the_sliding_window"],
      equivalent="j = (i - s) mod n differs from i at every ring step s = 1 .. n-1, where the cond runs"),

    M("sp-allgather-v-is-k", "sequence-parallel", CP,
      "v_all = jax.lax.all_gather(v,", "v_all = jax.lax.all_gather(k,",
      [f"{SEQ_EQ}[gpt2-seq=4-seq_attention=all_gather]"]),
    M("sp-allgather-drops-the-window", "sequence-parallel", CP,
      "kw = dict(scale=scale, window=window)", "kw = dict(scale=scale)",
      ["tests/test_families.py::test_import_matches_transformers[gemma3-sa]"]),
    M("sp-ulysses-drops-the-scale", "sequence-parallel", CP,
      "to_heads(v), kernel, q_pos=pos, k_pos=pos, scale=scale,", "to_heads(v), kernel, q_pos=pos, k_pos=pos,",
      ["tests/test_families.py::test_import_matches_transformers[gemma3-su]"]),
    M("sp-ulysses-drops-the-window", "sequence-parallel", CP,
      "window=window)\n    return jax.lax.all_to_all(out,", "window=None)\n    return jax.lax.all_to_all(out,",
      ["tests/test_families.py::test_import_matches_transformers[gemma3-su]"]),

    # -- Megatron sequence parallelism -------------------------------------------------------------------
    M("msp-residual-split-order", "megatron-sp", PART,
      '"res_length": ("seq", "tensor") if', '"res_length": ("tensor", "seq") if',
      ["tests/test_moe.py::test_moe_model_matches_single_device[seq2_tensor2_data2_sp]"]),
    M("msp-row-bias-before-scatter", "megatron-sp", "jaxpar/layers/linear.py",
      "psum_scatter(self._matmul(x, kernel, None),", "psum_scatter(self._matmul(x, kernel, bias),",
      [f"{SEQ_EQ}[gpt2-tensor=4-megatron_sp=True]"]),
    M("msp-embedding-all-reduce", "megatron-sp", EMBED,
      'return jax.lax.psum_scatter(x, "tensor", scatter_dimension=1, tiled=True)', 'return jax.lax.psum(x, "tensor")',
      [f"{SEQ_EQ}[gpt2-tensor=4-megatron_sp=True]"]),
    M("msp-head-grad-first-chunk", "megatron-sp", LOSS,
      'dx = jax.lax.psum_scatter(dx, "tensor", scatter_dimension=1, tiled=True)',
      'dx = jax.lax.psum(dx, "tensor")[:, : t // jax.lax.axis_size("tensor")]',
      [f"{FUSED}[untied-data2-tensor4-megatron_sp]"]),

    # -- ZeRO --------------------------------------------------------------------------------------------
    M("zero-skips-seq", "zero", PART,
      'ZERO_AXES = ("data", "expert", "seq")', 'ZERO_AXES = ("data", "expert")',
      ["tests/test_memory.py", "-k", "hand_count and seq"]),
    M("zero-stage-strict", "zero", PART,
      "on = par.zero >= stage", "on = par.zero > stage",
      ["tests/test_config.py::test_zero1_rules_split_optimizer_state_only"]),
    M("zero1-splits-parameters", "zero", PART,
      "params=Rules(dict(base, **zero(3))", "params=Rules(dict(base, **zero(1))",
      ["tests/test_config.py::test_zero1_rules_split_optimizer_state_only"]),
    M("zero1-opt-state-whole", "zero", PART,
      "opt=Rules(dict(base, **zero(1))", "opt=Rules(dict(base, **zero(3))",
      ["tests/test_memory.py::test_state_bytes_per_device_match_a_hand_count[zero1-data8]"]),
    M("zero3-computes-on-shards", "zero", PART,
      "compute=Rules(dict(base, **zero(99))", "compute=Rules(dict(base, **zero(3))",
      ["tests/test_collectives.py::test_zero3_gathers_weights_and_reduces_gradients_over_data"]),
    M("zero-expert-weights-on-expert", "zero", PART,
      'EXPERT_ZERO_AXES = ("data", "seq")', 'EXPERT_ZERO_AXES = ("data", "expert", "seq")',
      ["tests/test_memory.py::test_zero3_splits_dense_weights_over_data_and_expert"]),

    # -- the loss ----------------------------------------------------------------------------------------
    M("loss-padding-mask-off-by-one", "loss", EMBED,
      "logits = jnp.where(iota < vocab_size, logits, -1e30)", "logits = jnp.where(iota <= vocab_size, logits, -1e30)",
      ["tests/test_layers.py::test_cross_entropy_matches_numpy_and_masks_padding"]),
    M("loss-chunk-padding-mask", "loss", LOSS,
      "jnp.where(cols < self.vocab_size, logits, NEG)", "jnp.where(cols <= self.vocab_size, logits, NEG)",
      [f"{FUSED}[tied-1]", "tests/test_model.py::test_padded_vocabulary_is_masked"]),
    M("loss-softmax-grad-unshifted", "loss", LOSS,
      "lse = m + jnp.log(s)", "lse = jnp.log(s)",
      [f"{FUSED}[tied-1]"]),
    M("loss-target-first-column", "loss", LOSS,
      "mine = (local >= 0) & (local < local_vocab)", "mine = (local > 0) & (local < local_vocab)",
      [f"{FUSED}[tied-1]"]),
    M("loss-head-grad-last-chunk", "loss", LOSS,
      'dw = dw + f32_einsum(f"btd,btv->{self.layout}"', 'dw = f32_einsum(f"btd,btv->{self.layout}"',
      [f"{FUSED}[tied-1]"]),
    M("loss-vocab-max-per-shard", "loss", LOSS,
      "m = jax.lax.pmax(jnp.max(logits, -1), self.vocab_axes) if self.vocab_axes",
      "m = jnp.max(logits, -1) if self.vocab_axes",
      [f"{FUSED}[untied-data2-tensor2]"]),
    M("loss-max-not-stopped", "loss", EMBED,
      "m = jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True))",
      "m = jnp.max(logits, axis=-1, keepdims=True)",
      ["tests/test_layers.py::test_cross_entropy_matches_numpy_and_masks_padding"],
      equivalent="d/dm [log sum exp(l - m) + m] = 0: the shift cancels in the value and in the gradient"),

    # -- gradient accumulation ---------------------------------------------------------------------------
    M("ga-grads-not-averaged", "grad-accum", "jaxpar/trainer.py",
      "grads = jax.tree.map(lambda g: g / k, grads)", "grads = jax.tree.map(lambda g: g, grads)",
      ["tests/test_equivalence.py::test_gradient_accumulation[gpt2]"]),
    M("ga-loss-last-microstep", "grad-accum", "jaxpar/trainer.py",
      "return jnp.mean(losses), jax.tree.map", "return losses[-1], jax.tree.map",
      ["tests/test_equivalence.py::test_gradient_accumulation[gpt2]"]),
    M("ga-microbatch-rows-contiguous", "grad-accum", "jaxpar/trainer.py",
      "x.reshape(x.shape[0] // k, k, *x.shape[1:]).swapaxes(0, 1), batch)",
      "x.reshape(k, x.shape[0] // k, *x.shape[1:]), batch)",
      ["tests/test_moe.py::test_gradient_accumulation_adds_each_microsteps_router_losses"]),
    M("gen-decode-position", "generation", "jaxpar/generate.py",
      "(lengths + i)[:, None], cache)", "(lengths + i - 1)[:, None], cache)",
      [f"{GREEDY}[gpt2]"]),
    M("gen-prefill-last-logit", "generation", "jaxpar/generate.py",
      "(lengths - 1)[:, None, None], axis=1)", "lengths[:, None, None], axis=1)",
      [f"{GREEDY}[gpt2]"]),
    M("gen-segment-overflows-window", "generation", "jaxpar/generate.py",
      "n = min(n_tokens, w - p)", "n = min(n_tokens, w - p + 1)",
      [f"{GREEDY}[gpt2]"]),
    M("gen-top-p-excludes-crossing-token", "generation", "jaxpar/generate.py",
      "keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < s.top_p",
      "keep_sorted = jnp.cumsum(probs, axis=-1) < s.top_p",
      ["tests/test_generate.py::test_sampling_rules"]),
    M("gen-top-k-strict", "generation", "jaxpar/generate.py",
      "z = jnp.where(z >= kth, z, -jnp.inf)", "z = jnp.where(z > kth, z, -jnp.inf)",
      ["tests/test_generate.py::test_sampling_rules"]),
    M("gen-temperature-multiplies", "generation", "jaxpar/generate.py",
      "z = logits / s.temperature", "z = logits * s.temperature",
      ["tests/test_generate.py::test_sampling_rules"]),

    # -- checkpoints and the data state ------------------------------------------------------------------
    M("ck-layer-order-inverse-swapped", "checkpoint", "jaxpar/trainer.py",
      "return a[np.argsort(order) if inverse else order]", "return a[order if inverse else np.argsort(order)]",
      ["tests/test_untested_configs.py::test_circular_layout_imports_and_exports_hugging_face_in_layer_order",
       "tests/test_pipeline.py::test_circular_pipeline_whose_storage_order_is_not_its_own_inverse[interleaved_1f1b_moe]"],
      note="pipe=2 x pipeline_repeats=2 with 4 layers stores [0, 2, 1, 3], its own inverse (the checkpoint test's "
           "layout); pipe=2 x repeats=3 (6 layers: [0, 2, 4, 1, 3, 5]) is not"),
    M("ck-saved-under-the-step-index", "checkpoint", "jaxpar/checkpoint.py",
      "self.ckpt.save(info.step + 1, *self.save_args", "self.ckpt.save(info.step, *self.save_args",
      ["tests/test_faults.py::test_a_streak_of_nan_steps_stops_the_run_and_keeps_the_checkpoint"]),
    M("ck-every-off-by-one", "checkpoint", "jaxpar/checkpoint.py",
      "(info.step + 1) % self.every == 0", "info.step % self.every == 0",
      ["tests/test_faults.py::test_a_streak_of_nan_steps_stops_the_run_and_keeps_the_checkpoint"]),
    M("ck-data-state-swapped", "checkpoint", "jaxpar/data/pipeline.py",
      'epoch, position = int(state["epoch"]), int(state["position"])',
      'epoch, position = int(state["position"]), int(state["epoch"])',
      ["tests/test_data_pipeline.py::test_restore_continues_identically"]),
    M("ck-data-new-epoch-skips-a-batch", "checkpoint", "jaxpar/data/pipeline.py",
      "self.epoch, self.position = self.epoch + 1, 0", "self.epoch, self.position = self.epoch + 1, 1",
      ["tests/test_data_pipeline.py::test_single_process_order_and_epochs"]),

    # -- Hugging Face mapping ----------------------------------------------------------------------------
    M("hf-gpt2-qkv-layout", "hf-mapping", "jaxpar/hf.py",
      'reshape(d, 3, h, hd).transpose(0, 2, 1, 3)', 'reshape(d, h, 3, hd)',
      ["tests/test_hf.py::test_import_matches_transformers[gpt2-1]"]),
    M("hf-gpt2-v-bias-is-k-bias", "hf-mapping", "jaxpar/hf.py",
      't("attn.c_attn.bias")[2 * d:]', 't("attn.c_attn.bias")[d:2 * d]',
      ["tests/test_hf.py::test_import_matches_transformers[gpt2-1]"]),
    M("hf-llama-o-proj-untransposed", "hf-mapping", "jaxpar/hf.py",
      't("self_attn.o_proj.weight").T.reshape(h, hd, d)', 't("self_attn.o_proj.weight").reshape(h, hd, d)',
      ["tests/test_hf.py::test_import_matches_transformers[llama-1]"]),
    M("hf-mixtral-gate-up-swapped", "hf-mapping", "jaxpar/hf.py",
      '[expert(t, i, "w1"), expert(t, i, "w3")]', '[expert(t, i, "w3"), expert(t, i, "w1")]',
      ["tests/test_hf.py::test_import_matches_transformers[mixtral-1]"]),
    M("hf-export-gate-is-up", "hf-mapping", "jaxpar/hf.py",
      '"mlp.gate_proj.weight": lambda p: p(("mlp", "up", "kernel"))[:, 0].T',
      '"mlp.gate_proj.weight": lambda p: p(("mlp", "up", "kernel"))[:, 1].T',
      ["tests/test_families.py::test_export_is_bit_identical_and_trained_export_loads[llama3]"]),
    M("hf-export-layer-order-not-inverted", "hf-mapping", "jaxpar/hf.py",
      "inverse = np.argsort(trainer.layer_order(m.n_layers))", "inverse = trainer.layer_order(m.n_layers)",
      ["tests/test_untested_configs.py::test_circular_layout_imports_and_exports_hugging_face_in_layer_order"],
      note="tests/test_hf.py's circular export uses 4 layers on pipe=2 x repeats=2, whose storage order is its own "
           "inverse; this target round-trips pipe=2 x repeats=3 (6 layers)"),
    M("hf-gemma-score-scale-inverted", "hf-mapping", "jaxpar/families/gemma3.py",
      'float(hf.get("query_pre_attn_scalar", 256)) ** -0.5', 'float(hf.get("query_pre_attn_scalar", 256)) ** 0.5',
      ["tests/test_families.py::test_import_matches_transformers[gemma3-1]"]),
    M("hf-mixtral-aux-coef-inverted", "hf-mapping", "jaxpar/families/mixtral.py",
      'hf.get("router_aux_loss_coef", 0.001) * k / n', 'hf.get("router_aux_loss_coef", 0.001) * n / k',
      ["tests/test_hf_edges.py::test_mixtral_aux_loss_coefficient_maps_through_top_k_over_layers"]),
    M("hf-gpt2-positions-check-inclusive", "hf-mapping", "jaxpar/hf_config.py",
      'cfg.model.seq_len > hf["n_positions"]', 'cfg.model.seq_len >= hf["n_positions"]',
      ["tests/test_hf_edges.py::test_learned_table_is_max_positions_and_import_keeps_it"]),

    # -- communication model -----------------------------------------------------------------------------
    M("cm-ring-hops", "comm-model", "jaxpar/comm.py",
      '("seq",), 2 * (n - 1) * (fwd_runs', '("seq",), 2 * n * (fwd_runs',
      ["tests/test_comm.py::test_collectives_match_the_model[seq-ring]"]),
    M("cm-moe-every-layer", "comm-model", "jaxpar/comm.py",
      "2 * (fwd_runs + bwd_runs + redo_runs) // e.every, buf", "2 * (fwd_runs + bwd_runs + redo_runs), buf",
      ["tests/test_comm.py::test_collectives_match_the_model[expert-zero3-every2]"]),
    M("cm-pipe-shift-one-way", "comm-model", "jaxpar/comm.py",
      '("pipe",), 2 * k * iters, res', '("pipe",), k * iters, res',
      ["tests/test_comm.py::test_collectives_match_the_model[pipe-gpipe]"]),
    M("cm-reduce-scatter-whole", "comm-model", "jaxpar/comm.py",
      "local_iter / math.prod(sizes[a] for a in sc), \"gradient reduce-scatter\")",
      "local_iter, \"gradient reduce-scatter\")",
      ["tests/test_comm.py::test_zero1_moves_what_data_parallelism_moves"]),
    M("cm-remat-recompute-inverted", "comm-model", "jaxpar/comm.py",
      'recompute_ar = int("out_proj" not in kept)', 'recompute_ar = int("out_proj" in kept)',
      ["tests/test_comm.py::test_collectives_match_the_model[tp4-remat]"]),
    M("cm-all-gather-wire-bytes", "comm-model", "jaxpar/hlo.py",
      '"all-gather": (group - 1) / group,', '"all-gather": group - 1,',
      ["tests/test_comm.py::test_zero1_moves_what_data_parallelism_moves",
       "tests/test_collectives.py::test_hlo_reader_counts_loops_bytes_and_axes"]),

    # -- memory / planner / flops model ------------------------------------------------------------------
    M("mm-one-adam-moment", "memory-model", "jaxpar/plan.py",
      'mem["opt"] = per_device("opt", 2 * 4)', 'mem["opt"] = per_device("opt", 4)',
      ["tests/test_plan.py::test_model_matches_the_compiled_step[data8-zero1-gpt]"]),
    M("mm-activation-rows-without-expert", "memory-model", "jaxpar/plan.py",
      'rows = tr.batch_size // tr.grad_accum // (sizes["data"] * sizes["expert"])',
      'rows = tr.batch_size // tr.grad_accum // sizes["data"]',
      ["tests/test_plan.py::test_model_matches_the_compiled_step[data2-expert4-moe]"]),
    M("mm-bubble-off-by-one", "memory-model", "jaxpar/plan.py",
      "est.bubble = (mb + s_ - 1) / mb", "est.bubble = (mb + s_) / mb",
      ["tests/test_plan.py::test_planner_state_and_traffic_match_a_hand_count",
       "tests/test_plan.py::test_rules_of_thumb_fall_out_of_the_model"]),
    M("mm-step-bytes-alias-added", "memory-model", "jaxpar/faults.py",
      '- mem.get("alias_size", 0)', '+ mem.get("alias_size", 0)',
      ["tests/test_faults.py::test_out_of_memory_message_names_the_need_and_the_cure"]),
    M("mm-host-need-one-device", "memory-model", "jaxpar/faults.py",
      "need = per_device * len(devices)", "need = per_device",
      ["tests/test_faults.py::test_host_memory_need_is_every_simulated_device_s"]),
    M("mm-flops-one-kv-projection", "memory-model", "jaxpar/flops.py",
      "attn = d * (m.n_heads + 2 * m.n_kv_heads) * hd", "attn = d * (m.n_heads + m.n_kv_heads) * hd",
      ["tests/test_flops.py::test_llama_1b_hand_count"]),
    M("mm-flops-attention-not-halved", "memory-model", "jaxpar/flops.py",
      "+ 6.0 * m.n_layers * m.seq_len", "+ 12.0 * m.n_layers * m.seq_len",
      ["tests/test_flops.py::test_gpt2_124m_hand_count"]),
    M("mm-flops-all-experts", "memory-model", "jaxpar/flops.py",
      "cfg.moe.top_k * per_mlp * d", "cfg.moe.n_experts * per_mlp * d",
      ["tests/test_flops.py::test_moe_counts_active_experts_only"]),
]
