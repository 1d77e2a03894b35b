"""Generation with a KV cache: prefill and decode in one jitted program, batched prompts of different
lengths, greedy / temperature / top-k / top-p sampling and stop tokens, on the training mesh.

    cache = {"k", "v"} per attention layer: [layers..., B, S, kv_heads, head_dim]     (S = model.seq_len)
    prefill: the prompts [B, P] (right-padded; row b has lengths[b] tokens) in one forward pass at
             positions 0..P-1, writing every layer's K and V into the cache
    decode:  a lax.scan of n steps; step i samples row b's token from its logits at position
             lengths[b] - 1 + i, feeds it back at that position + 1 (one token per row: its K and V are
             written into the cache, its query attends to the cached keys at positions <= its own)

The cache holds ``model.seq_len`` positions, the longest context the model was trained on (learned
positions have no more). A request longer than that slides: when a row's context is full, it
continues from its last ``seq_len // 2`` tokens (the next *segment*: one new prefill of every row; a
segment runs until the longest row is full, with no host round trip inside it). A prompt's padding
positions are written by the prefill but never seen: a query only sees keys at positions <= its
own, and the row's generated tokens overwrite them in order.

Placement: the parameters stay where training put them (heads and the cache's kv_heads over
``tensor``, experts over ``expert``, layers over ``pipe``) and the prompts are split over the batch
axes (``data`` x ``expert``) when their count divides; the layers run without the training layout's
activation rules (no pipeline microbatches, no sequence split of a 1-token step): XLA's partitioner
places them from the parameters' and the cache's shardings. So any training layout generates,
``pipe > 1`` included (the stacked layers are scanned over, not pipelined).

Works for the models of :mod:`jaxpar.models` (GPT-2 / Llama style GPT and the MoE decoder): their
blocks are decoded layer by layer through :meth:`jaxpar.layers.Attention.decode`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.config import ConfigError
from jaxpar.data.tokenizer import prompt_ids
from jaxpar.layers.embedding import vocab_logits
from jaxpar.partitioning import use_rules


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: ``temperature`` 0 = greedy (argmax); otherwise softmax(logits /
    temperature) restricted to the ``top_k`` most likely tokens (0 = all) and then to the smallest set
    whose probability reaches ``top_p`` (1 = all). ``stop``: token ids that end a row (the stop token is
    kept; the row's later tokens are ``pad``)."""

    temperature: float = 0.8
    top_k: int = 0
    top_p: float = 1.0
    stop: tuple[int, ...] = ()
    pad: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ConfigError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k} must be >= 0 (0 = all tokens)")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p} must be in (0, 1] (1 = all tokens)")


def pick(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """Next tokens ``[B]`` from float32 ``logits [B, V]`` by the rules of ``s``."""
    if s.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    z = logits / s.temperature
    if 0 < s.top_k < z.shape[-1]:
        kth = jax.lax.top_k(z, s.top_k)[0][:, -1:]
        z = jnp.where(z >= kth, z, -jnp.inf)
    if s.top_p < 1:
        order = jnp.argsort(-z, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(z, order, axis=-1), axis=-1)
        # keep a token while the probability of the tokens before it is below top_p (the first always)
        keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < s.top_p
        keep = jnp.zeros_like(keep_sorted).at[jnp.arange(z.shape[0])[:, None], order].set(keep_sorted)
        z = jnp.where(keep, z, -jnp.inf)
    return jax.random.categorical(key, z, axis=-1).astype(jnp.int32)


# -- the model, layer by layer, with a cache ------------------------------------------------------------

def _attention_layers(model) -> list[tuple[str, tuple[int, ...]]]:
    """The cache's layout: (name, leading stack dims) of each group of attention layers."""
    cfg = model.cfg
    moe = getattr(model, "moe_cfg", None)
    if moe is None:
        return [("blocks", (cfg.n_layers,))]
    groups = cfg.n_layers // moe.every
    return ([("dense", (groups, moe.every - 1))] if moe.every > 1 else []) + [("moe", (groups,))]


def empty_cache(model, batch: int, length: int, dtype=jnp.float32) -> dict:
    """Zeros for every attention layer's K and V: ``{name: {"k", "v": [stack..., B, S, KV, D]}}``."""
    cfg = model.cfg
    shape = (batch, length, cfg.n_kv_heads, cfg.head_dim)
    return {name: {"k": jnp.zeros(lead + shape, dtype), "v": jnp.zeros(lead + shape, dtype)}
            for name, lead in _attention_layers(model)}


def _block(block, x, positions, cache, window=None):
    """One block (dense or MoE) on ``x [B, T, d]`` with its layer's cache (``window``: the layer's own when
    the layers differ): the block's own residual structure, its attention reading and writing the cache."""
    new = {}

    def attend(h):
        out, new["cache"] = block.attn.decode(h, positions, cache, window)
        return out

    x = block.attn_residual(x, attend)
    x, _ = block.mlp_residual(x)  # a MoE layer's router statistics are not needed here
    return x, new["cache"]


def _scan(stack, x, positions, cache, layer, per_layer=None):
    graphdef, state = nnx.split(stack)

    def body(h, inp):
        layer_state, c, values = inp
        return layer(nnx.merge(graphdef, layer_state), h, positions, c, **values)

    values = {k: jnp.asarray(v) for k, v in (per_layer or {}).items()}
    return jax.lax.scan(body, x, (state, cache, values))


def forward(model, tokens: jax.Array, positions: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
    """float32 logits ``[B, T, vocab_padded]`` of ``tokens [B, T]`` at ``positions [B, T]``, reading and
    writing ``cache`` (:func:`empty_cache`)."""
    from jaxpar.models.gpt import embed_tokens

    x = embed_tokens(model.outer(), model.cfg, model.dtype, tokens, positions)
    if "blocks" in cache:  # the dense GPT: one stack of blocks
        x, c = _scan(model.blocks, x, positions, cache["blocks"], _block, model.per_layer())
        cache = {"blocks": c}
    else:  # the MoE decoder: groups of [dense..., MoE] blocks
        def group(g, h, pos, c):
            new = {}
            if g.dense is not None:
                h, new["dense"] = _scan(g.dense, h, pos, c["dense"], _block)
            h, new["moe"] = _block(g.moe, h, pos, c["moe"])
            return h, new

        x, cache = _scan(model.blocks, x, positions, cache, group)
    x = model.norm_f(x)
    w, layout = model.output_weight()
    return vocab_logits(x, w, layout, model.dtype), cache


def _segment(model, prompts, lengths, key, n: int, s: Sampling, vocab: int, cache_sharding):
    """Prefill ``prompts [B, P]`` (row b: ``lengths[b]`` tokens), then ``n`` decode steps: ``[B, n]`` tokens."""
    b, p = prompts.shape
    cache = empty_cache(model, b, model.cfg.seq_len, model.dtype)
    if cache_sharding is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding(cache))
    logits, cache = forward(model, prompts, jnp.broadcast_to(jnp.arange(p), (b, p)), cache)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0, :vocab]
    stop = jnp.asarray(s.stop or (-1,), jnp.int32)

    def step(carry, i):
        last, cache, done = carry
        tok = pick(last, jax.random.fold_in(key, i), s)
        tok = jnp.where(done, s.pad, tok)
        done = done | jnp.isin(tok, stop)
        logits, cache = forward(model, tok[:, None], (lengths + i)[:, None], cache)
        return (logits[:, 0, :vocab], cache, done), tok

    done = jnp.zeros((b,), bool)
    (_, _, done), toks = jax.lax.scan(step, (last, cache, done), jnp.arange(n))
    return toks.T


class Generator:
    """Compiled generation for one model and its parameters' placement.

    ``Generator(model_of, mesh=None, batch_axes=())``: ``model_of(params)`` builds the ``nnx`` model
    (e.g. ``trainer.adapter.model``); ``mesh`` / ``batch_axes``: where the prompts and the cache are split
    (the cache's kv-heads dim over ``tensor`` when the mesh has one). Call :meth:`__call__`.
    """

    def __init__(self, model_of, *, mesh=None, batch_axes: tuple = ()):
        self.model_of, self.mesh, self.batch_axes = model_of, mesh, tuple(batch_axes)
        self._fns: dict = {}

    def _placement(self, rows: int):
        if self.mesh is None:
            return None, None
        axes = tuple(a for a in self.batch_axes if self.mesh.shape[a] > 1)
        split = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
        batch = (axes[0] if len(axes) == 1 else axes) if axes and rows % split == 0 else None
        tensor = "tensor" if "tensor" in self.mesh.shape and self.mesh.shape["tensor"] > 1 else None
        rows_sharding = NamedSharding(self.mesh, P(batch, None))

        def cache_sharding(cache):
            def one(a):
                lead = a.ndim - 4
                kv = tensor if tensor and a.shape[-2] % self.mesh.shape["tensor"] == 0 else None
                return NamedSharding(self.mesh, P(*(None,) * lead, batch, None, kv, None))
            return jax.tree.map(one, cache)

        return rows_sharding, cache_sharding

    def _fn(self, rows: int, p: int, n: int, s: Sampling, vocab: int):
        key = (rows, p, n, s, vocab)
        if key not in self._fns:
            rows_sharding, cache_sharding = self._placement(rows)

            def run(params, prompts, lengths, rng):
                with use_rules(None):  # the activations are placed by the partitioner (module docstring)
                    model = self.model_of(params)
                    return _segment(model, prompts, lengths, rng, n, s, vocab, cache_sharding)

            self._fns[key] = (jax.jit(run), rows_sharding)
        return self._fns[key]

    def __call__(self, params, prompts: list[list[int]], n_tokens: int, sampling: Sampling = Sampling(),
                 seed: int = 0, vocab: int | None = None) -> list[list[int]]:
        """``n_tokens`` new tokens for each prompt (lists of ids, any lengths >= 1), drawn from the first
        ``vocab`` ids (default ``model.vocab_size``); a row that hit a stop token is cut after it."""
        cfg = self.model_of(params).cfg
        seq_len, vocab = cfg.seq_len, vocab or cfg.vocab_size
        if not prompts or any(len(q) == 0 for q in prompts):
            raise ConfigError("every prompt needs at least one token")
        if n_tokens < 0:
            raise ConfigError(f"n_tokens={n_tokens} must be >= 0")
        keep = max(1, seq_len // 2)  # context kept when the window is full
        rows = [list(q) if len(q) < seq_len else list(q)[-keep:] for q in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        key = jax.random.key(seed)
        segment = 0
        while n_tokens > 0 and not all(done):
            p = max(len(r) for r in rows)
            n = min(n_tokens, seq_len - p)
            fn, rows_sharding = self._fn(len(rows), p, n, sampling, vocab)
            buf = np.zeros((len(rows), p), np.int32)
            for i, r in enumerate(rows):
                buf[i, :len(r)] = r
            lengths = np.asarray([len(r) for r in rows], np.int32)
            if rows_sharding is not None:
                buf = jax.device_put(buf, rows_sharding)
            toks = np.asarray(jax.device_get(fn(params, buf, lengths, jax.random.fold_in(key, segment))))
            for i in range(len(rows)):
                if done[i]:
                    continue
                new = [int(t) for t in toks[i]]
                hit = [j for j, t in enumerate(new) if t in sampling.stop]
                if hit:
                    new, done[i] = new[:hit[0] + 1], True
                out[i] += new
                rows[i] = rows[i] + new
                if len(rows[i]) >= seq_len:  # this row's window is full: it continues from its last tokens
                    rows[i] = rows[i][-keep:]
            n_tokens -= n
            segment += 1
        return out


def for_trainer(trainer) -> Generator:
    """The :class:`Generator` of a :class:`~jaxpar.trainer.Trainer`'s model on its mesh (prompts over
    ``data`` x ``expert``)."""
    return Generator(trainer.adapter.model, mesh=trainer.mesh, batch_axes=("data", "expert"))


def generate_text(trainer, params, tokenizer, prompt: str, n_tokens: int, sampling: Sampling, rows: int = 1,
                  seed: int = 0) -> list[str]:
    """``rows`` samples of ``n_tokens`` after ``prompt`` from a :class:`~jaxpar.trainer.Trainer`'s model."""
    ids = prompt_ids(tokenizer, prompt) or [0]
    out = for_trainer(trainer)(params, [ids] * rows, n_tokens, sampling, seed, vocab=tokenizer.vocab_size)
    return [tokenizer.decode(np.asarray(o, np.int32)) for o in out]


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxpar.generate RUN_DIR|hf:DIR [--prompt TEXT ...] [key=value ...]``: completions from a
    run's newest checkpoint or a Hugging Face model directory, on the run's mesh (``parallel.*``
    overrides change it; on a host without accelerators it is simulated, as by ``train.py``)."""
    import sys

    from jaxpar.cli import ArgumentParser

    ap = ArgumentParser(prog="python -m jaxpar.generate", description=main.__doc__)
    ap.add_argument("run", help="a run directory (train.out_dir): its config.yaml and checkpoints; or hf:DIR, a "
                                "Hugging Face model directory")
    ap.add_argument("--prompt", action="append", default=None,
                    help="a prompt; repeat for a batch of prompts (default: the run's sample.prompt)")
    ap.add_argument("--tokens", type=int, default=None, help="tokens to generate (default: the run's sample.tokens)")
    ap.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the run's)")
    ap.add_argument("--top-k", type=int, default=None, help="default: the run's sample.top_k")
    ap.add_argument("--top-p", type=float, default=None, help="default: the run's sample.top_p")
    ap.add_argument("--stop", action="append", default=[], help="text whose token ends a completion (repeatable)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.data=1 parallel.tensor=2")
    a = ap.parse_intermixed_args(argv)

    from jaxpar.checkpoint import CheckpointError
    from jaxpar.hf import open_run

    run = a.run if a.run.startswith("hf:") else Path(a.run)
    try:
        if a.tokens is not None and a.tokens < 1:
            raise ConfigError(f"--tokens {a.tokens}: generate at least one token")
        trainer, params, step, tokenizer = open_run(run, a.overrides)
        s = trainer.cfg.sample
        n = s.tokens if a.tokens is None else a.tokens
        if tokenizer is None:
            raise ConfigError(f"the run trained on data.source={trainer.cfg.data.source}, which has no tokenizer to "
                              "turn prompts into ids")
        sampling = Sampling(temperature=s.temperature if a.temperature is None else a.temperature,
                            top_k=s.top_k if a.top_k is None else a.top_k,
                            top_p=s.top_p if a.top_p is None else a.top_p,
                            stop=tuple(int(i) for text in a.stop for i in tokenizer.encode(text)[:1]))
        prompts = a.prompt or [s.prompt]
        ids = [prompt_ids(tokenizer, p) or [0] for p in prompts]
        out = for_trainer(trainer)(params, ids, n, sampling, a.seed, vocab=tokenizer.vocab_size)
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    print(f"# {run}: {'step ' + str(step) if step is not None else 'Hugging Face weights'}, temperature "
          f"{sampling.temperature}, top-k {sampling.top_k}, top-p {sampling.top_p}", file=sys.stderr)
    for p, o in zip(prompts, out):
        print(p + tokenizer.decode(np.asarray(o, np.int32)))
        print("---")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
