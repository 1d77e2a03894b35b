"""Model options: rematerialisation policies and the chunked loss do not change the math and save
what they should, depth does not grow the program, bfloat16 compute stays close to float32, and the
padded vocabulary is masked."""

import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_trees_close, config, loss_grads, rel_err, trainer


@pytest.fixture(scope="module")
def no_remat():
    return loss_grads(config("llama", parallel__data=2))


# (save_dots_except_mlp and save_qkv_proj keep subsets of save_dots' names: their memory order is tested below)
@pytest.mark.parametrize("remat", ["full", "save_dots", "offload"])
def test_remat_same_loss_and_grads(no_remat, remat):
    got = loss_grads(config("llama", parallel__data=2, model__remat=remat))
    assert rel_err(got[0], no_remat[0]) <= 1e-6
    assert_trees_close(got[1], no_remat[1], 1e-5, f"remat={remat} grads ")


@pytest.mark.parametrize("pipe", [1, 2])
def test_remat_policies_order_the_memory(pipe):
    """Per-device temp bytes of the compiled step fall as the policy keeps less, with and without the
    pipeline (which used to turn every policy into full remat of whole iterations)."""
    # (under the pipeline the policies in between are the same per-layer policies as without it)
    policies = ("none", "save_dots", "save_dots_except_mlp", "save_qkv_proj", "full") if pipe == 1 else (
        "none", "save_dots", "full")
    temp = {r: trainer(config("llama", model__remat=r, model__seq_len=32, train__batch_size=8,
                              parallel__pipe=pipe)).compile()["memory"]["temp_size"] for r in policies}
    values = list(temp.values())
    assert all(a > b for a, b in zip(values, values[1:])), temp
    assert temp["full"] < temp["none"] / 2, temp


def test_remat_names_reach_every_matmul():
    """save_dots keeps exactly the five named outputs: the compiled step with save_dots has the same
    temp bytes as a hand-written policy saving every weight matmul without batch dims plus the
    attention output (the same residuals, found by jax's dot rule instead of by name)."""
    import jax
    from jaxpar.layers import remat as remat_mod

    named = trainer(config("llama", model__remat="save_dots")).compile()["memory"]["temp_size"]
    dots = jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
        jax.checkpoint_policies.save_only_these_names("attention"))
    original = remat_mod.policy
    try:
        remat_mod.policy = lambda name: dots
        by_dots = trainer(config("llama", model__remat="save_dots")).compile()["memory"]["temp_size"]
    finally:
        remat_mod.policy = original
    assert named == by_dots, (named, by_dots)


@pytest.mark.parametrize("style, layout", [
    ("llama", {}), ("gpt2", dict(parallel__data=2, parallel__tensor=2)),
    ("llama_gqa", dict(parallel__seq=2, parallel__tensor=2, parallel__megatron_sp=True))],
    ids=["llama", "gpt2-data2-tensor2", "llama-seq2-tensor2-megatron_sp"])
def test_chunked_loss_equals_whole_batch_loss(style, layout):
    """The head + cross-entropy over chunks of 16 tokens per device (4-16 chunks here) give the loss
    and gradients of the whole-batch computation (tied and untied heads, vocabulary split over
    tensor, zig-zag sequence order, Megatron-SP)."""
    from jaxpar.layers.loss import loss_chunks

    whole = loss_grads(config(style, model__loss_chunk_tokens=0, **layout))
    cfg = config(style, model__loss_chunk_tokens=16, **layout)
    t = trainer(cfg)
    rows = cfg.train.batch_size // (t.sizes["data"] * t.sizes["expert"])
    length = cfg.model.seq_len // (t.sizes["seq"] * (t.sizes["tensor"] if cfg.parallel.megatron_sp else 1))
    assert loss_chunks(rows, length, 16) >= 4
    chunked = loss_grads(cfg)
    assert rel_err(chunked[0], whole[0]) <= 1e-6
    assert_trees_close(chunked[1], whole[1], 1e-5, "chunked loss grads ")


def test_loss_chunks():
    """The fewest chunks (divisors of the length) within the token limit, and at least ``at_least``
    where the length allows (a pipeline asks for one chunk per microbatch at most)."""
    from jaxpar.layers.loss import loss_chunks

    assert loss_chunks(2, 256, 4096) == 1 and loss_chunks(2, 256, 0) == 1
    assert loss_chunks(2, 256, 256) == 2 and loss_chunks(2, 256, 100) == 8  # 2 x 32 tokens
    assert loss_chunks(2, 256, 4096, at_least=4) == 4 and loss_chunks(2, 256, 256, at_least=3) == 4
    assert loss_chunks(2, 6, 0, at_least=4) == 6 and loss_chunks(2, 7, 4096, at_least=2) == 7


def test_chunked_loss_bounds_the_logits_memory():
    """At 16 x 256 tokens and a 32000-word vocabulary the float32 logits alone are 524 MB: the loss
    over the whole batch at once holds them (and more); in chunks of 256 tokens the step's temp
    memory is smaller by more than those logits."""
    over = dict(model__vocab_size=32000, model__seq_len=256, train__batch_size=16, model__n_layers=1)
    whole = trainer(config("llama", model__loss_chunk_tokens=0, **over)).compile()["memory"]["temp_size"]
    chunked = trainer(config("llama", model__loss_chunk_tokens=256, **over)).compile()["memory"]["temp_size"]
    logits = 16 * 256 * 32000 * 4
    print(f"temp bytes: whole batch {whole / 2**20:.0f} MiB, 256-token chunks {chunked / 2**20:.0f} MiB")
    assert whole >= logits
    assert whole - chunked >= logits


def _head_loss_reference(x, w, targets, vocab, layout):
    """The unfused loss, differentiated by JAX: whole-batch float32 logits, then cross-entropy."""
    from jaxpar.layers.embedding import vocab_logits, vocab_parallel_cross_entropy

    return jnp.mean(vocab_parallel_cross_entropy(vocab_logits(x, w, layout, jnp.float32), targets, vocab))


@pytest.mark.parametrize("layout, mesh", [
    ("vd", {}), ("dv", dict(data=2, tensor=2)), ("vd", dict(data=2, seq=2, tensor=2)),
    ("dv", dict(data=2, tensor=4, megatron_sp=True)), ("vd", dict(expert=2, tensor=2))],
    ids=["tied-1", "untied-data2-tensor2", "tied-data2-seq2-tensor2", "untied-data2-tensor4-megatron_sp",
         "tied-expert2-tensor2"])
def test_fused_head_loss_equals_autodiff_of_the_unfused_loss(layout, mesh):
    """head_cross_entropy (chunks of 8 tokens per device, gradients computed in its forward) against
    JAX's gradient of the whole-batch logits + cross-entropy, on meshes that split the tokens
    (data, expert, seq) and the vocabulary (tensor), and under Megatron-SP."""
    _check_fused_head_loss(layout, mesh, chunk_tokens=8)


@pytest.mark.parametrize("layout, mesh", [("vd", {}), ("dv", dict(data=2, tensor=2))],
                         ids=["tied-1", "untied-data2-tensor2"])
def test_fused_head_loss_in_one_chunk_equals_autodiff_of_the_unfused_loss(layout, mesh):
    """The same with every token of a device in one chunk (no chunk limit; a pipeline's loss of one microbatch):
    no loop, the chunk's head gradient taken as the whole."""
    _check_fused_head_loss(layout, mesh, chunk_tokens=0)


def _check_fused_head_loss(layout, mesh, chunk_tokens):
    import jax
    from jaxpar.layers.loss import head_cross_entropy
    from jaxpar.mesh import make_mesh
    from jaxpar.partitioning import make_rules, use_rules

    cfg = config("gpt2", **{f"parallel__{k}": v for k, v in mesh.items()})
    m = make_mesh(cfg.parallel, jax.devices()[: max(1, int(np.prod([v for v in mesh.values() if v is not True])))])
    rules = make_rules(cfg.parallel, m)
    rng = np.random.default_rng(5)
    b, t, d, vp, vocab = 8, 32, 16, 64, 60
    x = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(vp, d) if layout == "vd" else (d, vp)) * 0.5, jnp.float32)
    targets = jnp.asarray(rng.integers(0, vocab, size=(b, t)), jnp.int32)

    def under_rules(f):
        def g(x, w):
            with use_rules(rules):
                return f(x, w, targets, vocab, layout)
        return jax.jit(jax.value_and_grad(g, (0, 1)))

    fused = under_rules(lambda *a: head_cross_entropy(*a[:4], layout=a[4], dtype=jnp.float32,
                                                      chunk_tokens=chunk_tokens))
    loss, grads = fused(x, w)
    ref_loss, ref_grads = under_rules(_head_loss_reference)(x, w)
    assert rel_err(loss, ref_loss) <= 1e-6
    for a, r in zip(grads, ref_grads):
        assert rel_err(a, r) <= 1e-5


def test_layer_scan_keeps_program_size_flat_in_depth():
    def static_ops(n_layers):
        t = trainer(config("gpt2", parallel__tensor=2, model__n_layers=n_layers))
        c = t.compile()["collectives"]["all-reduce"]
        return c["static_count"], c["count"]

    (s2, c2), (s6, c6) = static_ops(2), static_ops(6)
    assert s2 == s6  # the same program text
    assert c6 > c2  # but the loop runs more iterations


def test_layers_that_differ_still_scan():
    """Gemma 3's interleaved local and global layers (a per-layer window scanned with the weights): the
    compiled program of 24 layers is the one of 2 (within the 24-entry window table), and it runs more
    iterations of the same loop."""
    def program(n_layers):
        t = trainer(config("gemma3", parallel__tensor=2, model__n_layers=n_layers))
        c = t.compile()["collectives"]["all-reduce"]
        return len(t.hlo_text().splitlines()), c["static_count"], c["count"]

    (lines2, s2, c2), (lines24, s24, c24) = program(2), program(24)
    assert s2 == s24 and c24 > c2
    assert lines24 <= 1.02 * lines2, (lines2, lines24)


def test_bfloat16_compute_is_close_to_float32():
    f32 = loss_grads(config("llama", parallel__tensor=2))[0]
    bf16 = loss_grads(config("llama", parallel__tensor=2, model__compute_dtype="bfloat16"))[0]
    assert abs(bf16 - f32) / f32 < 2e-2


@pytest.mark.parametrize("style", ["gpt2", "llama_gqa"])
def test_bfloat16_step_runs_every_matmul_in_bfloat16(style):
    """model.compute_dtype=bfloat16: every matmul of the train step (forward, backward, the fused
    loss; tensor-parallel and chunked too) takes two bfloat16 operands, although scores and logits
    come out in float32; a float32 x bfloat16 matmul would run at the float32 rate on a GPU."""
    import re

    t = trainer(config(style, model__compute_dtype="bfloat16", parallel__data=2, parallel__tensor=2,
                       model__loss_chunk_tokens=32))
    dots = re.findall(r"stablehlo.dot_general[^\n]*: \((tensor<[^>]*>), (tensor<[^>]*>)\) -> (tensor<[^>]*>)",
                      t.lower().as_text())
    assert len(dots) >= 18, len(dots)  # 6 per layer body forward and backward, the head's, attention's
    assert all("bf16" in a and "bf16" in b for a, b, _ in dots), [d for d in dots if "f32" in d[0] + d[1]]
    assert any("f32" in out for _, _, out in dots)  # scores / logits accumulate into float32


def test_padded_vocabulary_is_masked():
    """vocab 250 is padded to 256; the loss equals a float64 softmax over the 250 real columns."""
    t = trainer(config("gpt2"))
    assert t.adapter.abstract["embed"]["embedding"].shape[0] == 256
    state = t.init_state()
    rng = np.random.default_rng(0)
    toks = jnp.asarray(rng.integers(0, 250, size=(2, 16)), jnp.int32)
    logits = np.asarray(t.logits(state["params"], toks), np.float64)
    real = logits[..., :250]
    lse = np.log(np.exp(real - real.max(-1, keepdims=True)).sum(-1)) + real.max(-1)
    want = np.mean(lse - np.take_along_axis(real, np.asarray(toks)[..., None], -1)[..., 0])
    got = float(t.loss_fn(state["params"], {"inputs": toks, "targets": toks})[0])
    assert abs(got - want) / want < 1e-5
