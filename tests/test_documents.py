"""Packed documents (data.packing=documents): segment ids, per-document positions and loss weights on
every kernel and axis, against independent references: each document alone at the start of its own
row through the plain (stream) model's logits, and float64 numpy cross-entropy."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import assert_trees_close, config, rel_err, trainer

from jaxpar.layers import attention_ops, context_parallel
from jaxpar.layers.context_parallel import zigzag_order
from jaxpar.partitioning import use_rules

DOCS = {"data__packing": "documents"}


def packed_batch(cfg, seed: int = 0, max_len: int = 8, trained: float = 0.7):
    """A global batch of rows packed with random documents (some rows end in padding), each document's
    targets trained with probability ``trained`` (its first always). Returns the batch and the documents
    as ``(ids, mask)`` (mask over the targets ids[1:])."""
    rng = np.random.default_rng(seed)
    b, t, v = cfg.train.batch_size, cfg.model.seq_len, cfg.model.vocab_size
    batch = {k: np.zeros((b, t), np.int32) for k in ("inputs", "targets", "segment_ids", "positions")}
    batch["weights"] = np.zeros((b, t), np.float32)
    docs = []
    for r in range(b):
        at, seg = 0, 1
        while at < t and not (at and rng.random() < 0.15):  # the rest of the row: padding (segment 0, weight 0)
            n = int(min(rng.integers(2, max_len + 1), t - at))
            ids = rng.integers(1, v, n + 1).astype(np.int32)
            mask = (rng.random(n) < trained).astype(np.float32)
            mask[0] = 1
            batch["inputs"][r, at:at + n], batch["targets"][r, at:at + n] = ids[:-1], ids[1:]
            batch["segment_ids"][r, at:at + n], batch["positions"][r, at:at + n] = seg, np.arange(n)
            batch["weights"][r, at:at + n] = mask
            docs.append((ids, mask))
            at, seg = at + n, seg + 1
    return batch, docs


def alone_reference(t, params, docs):
    """Loss and gradients of the documents each alone at the start of its own row (padded after it),
    through the stream model's logits (no segment ids, no positions, no chunked loss): the weighted mean
    of float32 log-softmax cross-entropy over every document's trained targets."""
    n, seq = len(docs), t.cfg.model.seq_len
    rows, targets, w = np.zeros((n, seq), np.int32), np.zeros((n, seq), np.int32), np.zeros((n, seq), np.float64)
    for i, (ids, mask) in enumerate(docs):
        rows[i, :len(ids) - 1], targets[i, :len(ids) - 1], w[i, :len(ids) - 1] = ids[:-1], ids[1:], mask
    vocab = t.cfg.model.vocab_size

    def loss(p):
        logits = t.adapter.model(p)(jnp.asarray(rows))[..., :vocab].astype(jnp.float32)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(targets)[..., None], -1)[..., 0]
        return jnp.sum(ce * jnp.asarray(w, jnp.float32)) / np.sum(w)

    loss_value, grads = jax.jit(jax.value_and_grad(loss))(params)
    return float(loss_value), jax.device_get(grads)


@pytest.fixture(scope="module")
def references():
    """Per style: the 1-device trainer's initial parameters, a packed batch and its alone reference."""
    out = {}

    def get(style: str, **model):
        key = (style, tuple(sorted(model.items())))
        if key not in out:
            t = trainer(config(style, **DOCS, **model))
            params = t.init_state()["params"]
            batch, docs = packed_batch(t.cfg)
            out[key] = (batch, alone_reference(t, params, docs))
        return out[key]

    return get


LAYOUTS = [
    ("llama_gqa", {}),
    ("llama_gqa", dict(parallel__data=2, parallel__tensor=2)),
    ("llama_gqa", dict(parallel__seq=2, parallel__tensor=2, parallel__seq_attention="ring")),
    ("llama_gqa", dict(parallel__seq=2, parallel__tensor=2, parallel__seq_attention="ulysses")),
    ("llama_gqa", dict(parallel__seq=4, parallel__tensor=2, parallel__seq_attention="all_gather")),
    ("gpt2", dict(parallel__seq=2, parallel__data=2, parallel__seq_attention="ring")),  # learned positions
    ("llama_gqa", dict(parallel__pipe=2, parallel__pipeline_schedule="1f1b", parallel__microbatches=4)),
    # ZB-H1 with the forwards' residuals kept: a microbatch's rows known again at its B (jaxpar.layers.residuals)
    ("llama_gqa", dict(parallel__pipe=2, parallel__pipeline_schedule="zb_h1", parallel__microbatches=4,
                       parallel__stage_remat=False)),
    ("gpt2", dict(parallel__pipe=2, parallel__data=2, parallel__microbatches=2)),  # GPipe, embedding in the pipeline
    ("llama_gqa", dict(model__n_layers=4, parallel__pipe=2, parallel__pipeline_schedule="1f1b",
                       parallel__pipeline_repeats=2, parallel__microbatches=2, parallel__tensor=2)),
    ("llama_gqa", dict(train__grad_accum=2, parallel__data=2, parallel__zero=1)),
    ("llama_gqa", dict(parallel__tensor=2, parallel__data=2, parallel__megatron_sp=True)),
    ("gemma3", dict(parallel__seq=2, parallel__tensor=2, parallel__seq_attention="ring")),  # windows + documents
]


def _id(style, layout):
    return style + "-" + ("-".join(f"{k.split('__')[1]}={v}" for k, v in layout.items()) or "1-device")


@pytest.mark.parametrize("style, layout", LAYOUTS, ids=[_id(s, lay) for s, lay in LAYOUTS])
def test_packed_rows_equal_each_document_alone(references, style, layout):
    """A packed row of documents gives the loss and gradients of each document alone in its own row
    (attention inside the document, positions from 0, untrained targets and padding weighing nothing), on
    one device and on every axis: data x tensor, seq (ring, ulysses, all_gather) x tensor, pipe (1F1B,
    GPipe, interleaved), gradient accumulation with ZeRO-1, Megatron-SP; RoPE and learned positions."""
    model = {k: v for k, v in layout.items() if k.startswith("model__")}
    batch, (ref_loss, ref_grads) = references(style, **model)
    t = trainer(config(style, **DOCS, **layout))
    loss, aux, grads = jax.jit(t.grads)(t.init_state()["params"], t.place_batch(batch))
    assert rel_err(loss, ref_loss) <= 2e-6, (float(loss), ref_loss)
    assert_trees_close(jax.device_get(grads), t.to_storage_order(ref_grads), 2e-5, "grads ")
    assert float(aux["trained_tokens"]) == float(np.sum(batch["weights"]))


def test_weighted_loss_is_the_global_mean_over_trained_tokens():
    """With trained tokens spread unevenly over data shards, pipeline microbatches and accumulation
    microsteps, the loss and gradients are the weighted mean over the whole global batch: a float64 numpy
    cross-entropy of the 1-device logits, and its gradient; a mean of per-shard means is far off."""
    layout = dict(parallel__data=2, parallel__pipe=2, parallel__pipeline_schedule="1f1b", parallel__microbatches=2,
                  train__grad_accum=2)
    cfg = config("llama_gqa", **DOCS, **layout)
    batch, _ = packed_batch(cfg, seed=3)
    b = cfg.train.batch_size
    # uneven: rows of the first half of the batch (data shard 0) train 1 target in 4, the rest all of theirs
    rng = np.random.default_rng(1)
    batch["weights"] = np.where(batch["segment_ids"] > 0, 1.0, 0.0).astype(np.float32)
    batch["weights"][: b // 2] *= rng.random((b // 2, cfg.model.seq_len)) < 0.25
    t1 = trainer(config("llama_gqa", **DOCS))
    # weights 4x their initial scale: CE that varies from token to token, so the formulas below differ
    # whatever the initialisation's draws (at the initial scale every token's CE is near log(vocab))
    params = jax.tree.map(lambda x: 4 * x, jax.device_get(t1.init_state()["params"]))
    vocab = cfg.model.vocab_size

    def segment_logits(p):  # the packed rows through the 1-device model with their documents
        with use_rules(t1.rules):
            m = t1.adapter.model(p)
            h = m.hidden(jnp.asarray(batch["inputs"]), segment_ids=jnp.asarray(batch["segment_ids"]),
                         doc_positions=jnp.asarray(batch["positions"]))
            w, layout_ = m.output_weight()
            return jnp.einsum("btd,vd->btv" if layout_ == "vd" else "btd,dv->btv", h, w)[..., :vocab]

    logits = np.asarray(jax.jit(segment_logits)(params), np.float64)
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, batch["targets"][..., None].astype(np.int64), -1)[..., 0]
    w = batch["weights"].astype(np.float64)
    want = float(np.sum(w * ce) / np.sum(w))
    shards = [slice(0, b // 2), slice(b // 2, b)]
    per_shard = float(np.mean([np.sum(w[s] * ce[s]) / np.sum(w[s]) for s in shards]))
    assert abs(per_shard - want) > 100 * 2e-6 * want  # a mean of per-shard means is far outside the tolerance

    def weighted(p):
        logits = segment_logits(p).astype(jnp.float32)
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(batch["targets"])[..., None], -1)
        return jnp.sum(ce[..., 0] * batch["weights"]) / np.sum(batch["weights"])

    ref_grads = jax.device_get(jax.jit(jax.grad(weighted))(params))
    t = trainer(cfg)
    loss, _, grads = jax.jit(t.grads)(t.init_state(t.to_storage_order(params))["params"], t.place_batch(batch))
    assert rel_err(loss, want) <= 2e-6, (float(loss), want)
    assert_trees_close(jax.device_get(grads), ref_grads, 2e-5, "grads ")


def test_ring_skips_blocks_that_share_no_document():
    """Ring attention over seq=4 (zig-zag) computes only the blocks in which some query shares a document
    with a visible key (counted as they run): with documents of 8 positions (one zig-zag chunk each) only
    the diagonal blocks, against all 16 for the same tokens as one stream; both equal the reference."""
    from jax.sharding import PartitionSpec as P

    from jaxpar.mesh import make_mesh

    mesh = make_mesh(config("llama", parallel__seq=4).parallel, jax.devices()[:4])
    t, n = 64, 4
    order = jnp.asarray(zigzag_order(t, n))
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(2, t, 4, 8)), jnp.float32) for _ in range(3))
    short = jnp.asarray(np.broadcast_to(np.arange(t) // 8 + 1, (2, t)), jnp.int32)  # documents of 8
    counted = []
    original = context_parallel._update

    def counting(carry, *a):  # a block that runs reports itself, with its data (see test_sequence's window test)
        jax.debug.callback(lambda i, first: counted.append((int(i), int(first))), jax.lax.axis_index("seq"),
                           jnp.min(a[3]))
        return original(carry, *a)

    def ring(seg):
        counted.clear()

        def local(q, k, v, p, *s):
            s = s[0] if s else None
            return context_parallel.ring_attention(q, k, v, p, p, axis="seq", zigzag=True, q_seg=s, k_seg=s)

        specs = (P(None, "seq"),) * 3 + (P("seq"),) + ((P(None, "seq"),) if seg is not None else ())
        f = jax.shard_map(local, mesh=mesh, in_specs=specs, out_specs=P(None, "seq"), check_vma=False)
        args = (q[:, order], k[:, order], v[:, order], order) + (() if seg is None else (seg[:, order],))
        out = f(*args)
        jax.effects_barrier()
        return np.asarray(out)[:, np.argsort(np.asarray(order))], len(counted)

    context_parallel._update = counting
    try:
        stream, blocks_stream = ring(None)
        packed, blocks_packed = ring(short)
    finally:
        context_parallel._update = original
    np.testing.assert_allclose(stream, np.asarray(attention_ops.attention(q, k, v, "xla")), atol=2e-5)
    np.testing.assert_allclose(packed, np.asarray(attention_ops.attention(q, k, v, "xla", q_seg=short, k_seg=short)),
                               atol=2e-5)
    assert blocks_stream == 4 + 12
    # by hand: a document is one chunk of 8, so only a device's own chunks see each other: the 4 local blocks
    assert blocks_packed == 4, blocks_packed


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_kernels_keep_attention_inside_documents(kernel):
    """Each kernel with segment ids equals every document's attention computed alone (xla; pallas: the TPU
    splash kernel's own segment ids, in interpret mode), gradients included."""
    rng = np.random.default_rng(0)
    b, t, h, kv, d = 2, 128, 4, 2, 8
    q = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(b, t, kv, d)), jnp.float32) for _ in range(2))
    seg = np.stack([np.searchsorted(np.sort(rng.choice(np.arange(1, t), 5, replace=False)), np.arange(t),
                                    side="right") + 1 for _ in range(b)]).astype(np.int32)
    want = np.zeros((b, t, h, d))
    for r in range(b):
        for s in np.unique(seg[r]):
            i = np.nonzero(seg[r] == s)[0]
            want[r, i] = np.asarray(attention_ops.attention(q[r:r + 1, i], k[r:r + 1, i], v[r:r + 1, i], "xla"))[0]
    s_ = jnp.asarray(seg)
    out = attention_ops.attention(q, k, v, kernel, q_seg=s_, k_seg=s_)
    np.testing.assert_allclose(np.asarray(out), want, atol=2e-6)
    g = jax.grad(lambda q: jnp.sum(attention_ops.attention(q, k, v, kernel, q_seg=s_, k_seg=s_) ** 2))(q)
    g_ref = jax.grad(lambda q: jnp.sum(attention_ops.attention(q, k, v, "xla", q_seg=s_, k_seg=s_) ** 2))(q)
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=2e-5)


def test_cudnn_train_step_with_documents_lowers_for_cuda(monkeypatch):
    """Packed documents through cuDNN lower for CUDA (platform and version checks patched, as
    test_attention does): the fused forward and backward once per layer scan, the documents' mask an input
    of each, and no score matrix."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    monkeypatch.setattr(attention_ops, "_platform", lambda: "gpu")
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91000)
    cfg = config("llama_gqa", **DOCS, model__attention="cudnn", model__compute_dtype="bfloat16", model__seq_len=256,
                 parallel__data=2, parallel__tensor=2)
    t = trainer(cfg)
    text = t._step_jit.trace(t.abstract_state, t.abstract_batch).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines()
             if "custom_call @CustomSPMDPartitioning" in line or "custom_call @__cudnn$fmha" in line]
    assert len(calls) == 2, calls
    assert all("256x256" in c for c in calls)  # the mask (a bias [B, 1, T, S]) goes into the kernel


# DeepSeek-V3's switches: MLA (low-rank queries), a dense first layer (run on the first stage after the
# embedding, per microbatch), sigmoid group-limited routing with a fixed routing bias, a shared expert
DEEPSEEK = dict(model__n_layers=3, model__head_dim=16, model__kv_lora_rank=12, model__q_lora_rank=20,
                model__rope_head_dim=8, model__v_head_dim=12, moe__first_dense=1, moe__score="sigmoid",
                moe__router_bias=True, moe__shared_experts=1, moe__n_group=2, moe__topk_group=1)


@pytest.mark.parametrize("kind", ["mixtral", "deepseek", "deepseek-gpipe"])
def test_moe_packed_documents_equal_one_device(kind):
    """The MoE model with packed documents on expert x data x pipe (1F1B; GPipe) equals one device on the same
    batch (capacity for every token; router losses off: they are per routing group, and a pipeline's groups
    are its microbatches, see test_moe); DeepSeek's dense first layer sees each microbatch's documents on the
    first stage."""
    over = dict(DOCS, model__n_layers=2, moe__n_experts=4, moe__capacity_factor=2.0, moe__aux_loss_weight=0.0,
                moe__z_loss_weight=0.0)
    over.update(DEEPSEEK if kind.startswith("deepseek") else {})
    ref = trainer(config("llama", model__arch="moe", **over))
    batch, _ = packed_batch(ref.cfg, seed=5)
    loss0, aux0, grads0 = jax.jit(ref.grads)(ref.init_state()["params"], ref.place_batch(batch))
    t = trainer(config("llama", model__arch="moe", **over, parallel__expert=2, parallel__data=2, parallel__pipe=2,
                       parallel__pipeline_schedule="gpipe" if kind.endswith("gpipe") else "1f1b",
                       parallel__microbatches=2))
    loss, aux, grads = jax.jit(t.grads)(t.init_state()["params"], t.place_batch(batch))
    assert rel_err(loss, loss0) <= 2e-6
    assert rel_err(aux["ce_loss"], aux0["ce_loss"]) <= 2e-6
    assert_trees_close(jax.device_get(grads), jax.device_get(grads0), 2e-5, "grads ")


def test_synthetic_documents_are_well_formed():
    """data.source=synthetic with data.packing=documents: full rows of documents, segment ids counting up,
    positions restarting with each document, every document a progression (learnable), weights 1."""
    from jaxpar.data import SyntheticSource

    b = SyntheticSource(0, 4, 32, 250, documents=True).batch(0)
    assert set(b) == {"inputs", "targets", "segment_ids", "positions", "weights"}
    for r in range(4):
        seg, pos = b["segment_ids"][r], b["positions"][r]
        assert seg[0] == 1 and np.all(np.diff(seg) >= 0) and np.all(np.diff(seg) <= 1)
        starts = np.r_[True, np.diff(seg) > 0]
        assert np.all(pos[starts] == 0) and np.all(np.diff(pos)[~starts[1:]] == 1)
        assert np.all(b["inputs"][r, 1:][~starts[1:]] == b["targets"][r, :-1][~starts[1:]])
    assert np.all(b["weights"] == 1.0)


def test_documents_need_their_fields():
    """A batch without the packed-document fields under data.packing=documents is one clear error naming
    them; a model call with part of them is refused by name."""
    from jaxpar.config import ConfigError

    t = trainer(config("llama", **DOCS))
    with pytest.raises(ConfigError, match=re.escape("the batch has no segment_ids, positions, weights: "
                                                    "data.packing=documents needs")):
        t.place_batch({"inputs": np.zeros((16, 16), np.int32), "targets": np.zeros((16, 16), np.int32)})
    from jaxpar.models.gpt import batch_docs

    with pytest.raises(TypeError, match="need segment_ids, positions, weights together; got only segment_ids"):
        batch_docs({"segment_ids": np.zeros((1, 4))})


def test_validation_loss_is_the_mean_over_trained_tokens():
    """The validation loss over several batches with different trained-token counts is the weighted mean
    over all their trained tokens: one evaluation of the batches joined into one (a mean of the batches'
    means would differ)."""
    from jaxpar.metrics import EvalHook

    t = trainer(config("llama", **DOCS))
    params = jax.tree.map(lambda x: 4 * x, t.init_state()["params"])  # CE varying by token (as above)
    first, _ = packed_batch(t.cfg, seed=7, trained=0.2)
    second, _ = packed_batch(t.cfg, seed=8, trained=1.0)
    got = EvalHook(None, t, [first, second], 0).evaluate(params)
    both = trainer(config("llama", **DOCS, train__batch_size=2 * t.cfg.train.batch_size))
    want = float(both.eval_loss(params, both.place_batch({k: np.concatenate([first[k], second[k]]) for k in first})))
    means = [float(t.eval_loss(params, t.place_batch(b))) for b in (first, second)]
    assert abs(np.mean(means) - want) > 100 * 1e-6 * want  # far above the tolerance below
    assert rel_err(got, want) <= 1e-6, (got, want)
