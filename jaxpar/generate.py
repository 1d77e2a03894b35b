"""Generation with a KV cache: prefill and decode in jitted programs, batched prompts of different
lengths, greedy / temperature / top-k / top-p sampling and stop tokens, on the training mesh.

    cache = {"k", "v"} per attention layer: [layers..., B, S, kv_heads, head_dim]     (S = the window)
            (MLA, model.kv_lora_rank: {"latent" [.., B, S, kv_lora_rank], "rope_key" [.., B, S, rope_head_dim]})
    prefill: the prompts [B, P] (right-padded; row b has lengths[b] tokens) in one forward pass at
             positions 0..P-1, writing every layer's K and V into the cache
    decode:  a lax.scan of n steps; step i samples row b's token from its logits at position
             lengths[b] - 1 + i, feeds it back at that position + 1 (one token per row: its K and V are
             written into the cache, its query attends to the cached keys at positions <= its own)

The window, the cache's positions, is what the model can attend to (:func:`window`): the learned
position table's rows (``model.max_positions``), or with RoPE the context it was trained on
(``model.seq_len``). A request longer than that slides: when a row's
context is full, it continues from its last ``S // 2`` tokens (the next *segment*: one new prefill of
every row; a segment runs until the longest row is full). A prompt's padding positions are written
by the prefill but never seen: a query only sees keys at positions <= its own, and the row's
generated tokens overwrite them in order.

A segment's decode steps run in *chunks* of ``Generator(chunk=)`` steps, one compiled call each (the
first with the prefill; the carry, logits, cache and stopped rows, donated from call to call): between
calls the host reads the new tokens, reports progress and stops once every row has hit a stop
token. Step i draws with the key ``fold_in(segment key, i)`` whatever the chunk, so the tokens do not
depend on it. The total length is not bounded (the window slides); the memory is: before anything
is compiled, :meth:`Generator.check` sets the KV cache (rows x window x layers x 2 x kv_heads x
head_dim, as split over the mesh) and the prefill's float32 logits against the devices' free memory
(simulated CPU devices: the host's available memory) and refuses, by the numbers, a request that
cannot fit.

Placement: the parameters stay where training put them (heads and the cache's kv_heads over
``tensor``, experts over ``expert``, layers over ``pipe``) and the prompts are split over the batch
axes (``data`` x ``expert``) when their count divides; the layers run without the training layout's
activation rules (no pipeline microbatches, no sequence split of a 1-token step): XLA's partitioner
places them from the parameters' and the cache's shardings. So any training layout generates,
``pipe > 1`` included (the stacked layers are scanned over, not pipelined).

Works for the models of :mod:`jaxpar.models` (GPT-2 / Llama style GPT and the MoE decoder): their
blocks are decoded layer by layer through :meth:`jaxpar.layers.Attention.decode` (or
:meth:`jaxpar.layers.LatentAttention.decode`, which reads the compressed cache).

Long by design: the decoding math, the driver that runs it in segments and chunks within the
devices' memory, and the command line that reports its progress are read together.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.cli import COUNT, SEED, ArgumentParser, Progress, command, number
from jaxpar.config import ConfigError, Range
from jaxpar.data.tokenizer import prompt_ids
from jaxpar.layers.embedding import vocab_logits
from jaxpar.metrics import fmt_bytes
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
    groups = moe.groups(cfg.n_layers)
    return (([("first", (moe.first_dense,))] if moe.first_dense else []) +
            ([("dense", (groups, moe.every - 1))] if moe.every > 1 else []) + [("moe", (groups,))])


def layer_cache(cfg, batch: int, length: int) -> dict[str, tuple[int, ...]]:
    """One attention layer's cache: ``{"k", "v": [B, S, KV, D]}``, or under MLA (``model.kv_lora_rank``) the
    latent and the rotated shared key, ``{"latent": [B, S, r], "rope_key": [B, S, p]}``."""
    if cfg.latent:
        return {"latent": (batch, length, cfg.kv_lora_rank), "rope_key": (batch, length, cfg.rope_head_dim)}
    return {"k": (batch, length, cfg.n_kv_heads, cfg.head_dim), "v": (batch, length, cfg.n_kv_heads, cfg.head_dim)}


def empty_cache(model, batch: int, length: int, dtype=jnp.float32) -> dict:
    """Zeros for every attention layer's cache (:func:`layer_cache`): ``{name: {entry: [stack..., *shape]}}``."""
    shapes = layer_cache(model.cfg, batch, length)
    return {name: {k: jnp.zeros(lead + shape, dtype) for k, shape in shapes.items()}
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
    else:  # the MoE decoder: its dense first layers, then groups of [dense..., MoE] blocks
        def group(g, h, pos, c, window=None):
            new = {}
            if g.dense is not None:
                h, new["dense"] = _scan(g.dense, h, pos, c["dense"], _block)
            h, new["moe"] = _block(g.moe, h, pos, c["moe"], window)
            return h, new

        first = {}
        if "first" in cache:
            x, first["first"] = _scan(model.first, x, positions, cache["first"], _block)
        x, groups = _scan(model.blocks, x, positions, {k: v for k, v in cache.items() if k != "first"}, group,
                          model.per_layer())
        cache = {**first, **groups}
    x = model.norm_f(x)
    w, layout = model.output_weight()
    return vocab_logits(x, w, layout, model.dtype), cache


def _decode(model, carry, lengths, key, steps: jax.Array, s: Sampling, vocab: int):
    """Decode steps ``steps`` (their indices in the segment) from ``carry`` = (the last logits, the cache, the
    rows that stopped): ``(carry, tokens [B, len(steps)])``."""
    stop = jnp.asarray(s.stop or (-1,), jnp.int32)

    def step(carry, i):
        last, cache, done = carry
        tok = pick(last, jax.random.fold_in(key, i), s)
        tok = jnp.where(done, s.pad, tok)
        done = done | jnp.isin(tok, stop)
        logits, cache = forward(model, tok[:, None], (lengths + i)[:, None], cache)
        return (logits[:, 0, :vocab], cache, done), tok

    carry, toks = jax.lax.scan(step, carry, steps)
    return carry, toks.T


def _segment(model, prompts, lengths, key, n: int, s: Sampling, vocab: int, window: int, cache_sharding):
    """Prefill ``prompts [B, P]`` (row b: ``lengths[b]`` tokens) into a cache of ``window`` positions, then
    decode steps ``0..n-1``: ``(carry, tokens [B, n])`` (the carry goes on in :func:`_decode`)."""
    b, p = prompts.shape
    cache = empty_cache(model, b, window, model.dtype)
    if cache_sharding is not None:
        cache = jax.lax.with_sharding_constraint(cache, cache_sharding(cache))
    logits, cache = forward(model, prompts, jnp.broadcast_to(jnp.arange(p), (b, p)), cache)
    last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0, :vocab]
    return _decode(model, (last, cache, jnp.zeros((b,), bool)), lengths, key, jnp.arange(n), s, vocab)


def window(cfg) -> int:
    """Positions of the KV cache: the context a row attends to before it slides (module docstring). Learned
    positions: the rows of the position table (``model.max_positions``, at least ``model.seq_len``; an
    imported GPT-2 keeps its 1024); RoPE has no table: the context the model was trained on,
    ``model.seq_len`` (an override sets another)."""
    return cfg.max_positions if cfg.positions == "learned" else cfg.seq_len


def cache_bytes(model, rows: int, positions: int) -> int:
    """Bytes of the KV cache (:func:`empty_cache`) of ``rows`` rows of ``positions`` positions, all devices'
    shards together."""
    per_row = sum(int(np.prod(shape)) for shape in layer_cache(model.cfg, 1, positions).values())
    per_row *= jnp.dtype(model.dtype).itemsize
    return sum(int(np.prod(lead)) * rows * per_row for _, lead in _attention_layers(model))


def free_memory(devices) -> tuple[int, str]:
    """``(bytes free on each of devices, a phrase saying so)``: an accelerator's memory limit less what is in
    use; simulated CPU devices share the host's available memory (``MemAvailable``) equally."""
    d = devices[0]
    stats = (d.memory_stats() or {}) if hasattr(d, "memory_stats") else {}
    if stats.get("bytes_limit"):
        free = stats["bytes_limit"] - stats.get("bytes_in_use", 0)
        return free, f"{d.device_kind} has {fmt_bytes(free)} free"
    from jaxpar.faults import host_memory

    avail = host_memory()[0]
    n = len(devices)
    return avail // n, (f"this host has {fmt_bytes(avail)} available for its {n} CPU device"
                        + (f"s ({fmt_bytes(avail // n)} each)" if n > 1 else ""))


class Generator:
    """Compiled generation for one model and its parameters' placement.

    ``Generator(model_of, mesh=None, batch_axes=(), chunk=128)``: ``model_of(params)`` builds the ``nnx``
    model (e.g. ``trainer.adapter.model``); ``mesh`` / ``batch_axes``: where the prompts and the cache are
    split (the cache's kv-heads dim over ``tensor`` when the mesh has one); ``prepare(params)``: run once per
    request before anything else (:func:`for_trainer`: the layers in layer order); ``chunk``: decode steps per
    compiled call (between calls the host reads the new tokens, reports progress and may stop: a long
    generation is several calls; the tokens are the same for any chunk). Call :meth:`__call__`.
    """

    def __init__(self, model_of, *, mesh=None, batch_axes: tuple = (), chunk: int = 128, prepare=None):
        if not isinstance(chunk, (int, np.integer)) or chunk < 1:
            raise ConfigError(f"chunk={chunk!r}: give decode steps per call >= 1")
        self.model_of, self.mesh, self.batch_axes, self.chunk = model_of, mesh, tuple(batch_axes), int(chunk)
        self.prepare = prepare
        self._fns: dict = {}

    def _split(self, rows: int) -> tuple:
        """(the batch axes the rows are split over, or None; how many ways)."""
        if self.mesh is None:
            return None, 1
        axes = tuple(a for a in self.batch_axes if self.mesh.shape[a] > 1)
        split = int(np.prod([self.mesh.shape[a] for a in axes])) if axes else 1
        if not axes or rows % split:
            return None, 1
        return (axes[0] if len(axes) == 1 else axes), split

    def _placement(self, rows: int):
        if self.mesh is None:
            return None, None
        batch, _ = self._split(rows)
        tensor = "tensor" if "tensor" in self.mesh.shape and self.mesh.shape["tensor"] > 1 else None
        rows_sharding = NamedSharding(self.mesh, P(batch, None))

        def cache_sharding(cache):
            def one(path, a):
                if path[-1].key not in ("k", "v"):  # MLA's latent and shared key: every head reads them
                    return NamedSharding(self.mesh, P(*(None,) * (a.ndim - 3), batch, None, None))
                lead = a.ndim - 4
                kv = tensor if tensor and a.shape[-2] % self.mesh.shape["tensor"] == 0 else None
                return NamedSharding(self.mesh, P(*(None,) * lead, batch, None, kv, None))
            return jax.tree_util.tree_map_with_path(one, cache)

        return rows_sharding, cache_sharding

    def _fn(self, rows: int, p: int, n: int, s: Sampling, vocab: int, more: bool = False):
        """The program of a segment's prefill and its first ``n`` decode steps (``more``: it also returns the
        carry, for :meth:`_more`)."""
        key = (rows, p, n, s, vocab, more)
        if key not in self._fns:
            rows_sharding, cache_sharding = self._placement(rows)

            def run(params, prompts, lengths, rng):
                with use_rules(None):  # the activations are placed by the partitioner (module docstring)
                    model = self.model_of(params)
                    carry, toks = _segment(model, prompts, lengths, rng, n, s, vocab, window(model.cfg),
                                           cache_sharding)
                    return (toks, carry) if more else toks

            self._fns[key] = (jax.jit(run), rows_sharding)
        return self._fns[key]

    def _more(self, rows: int, n: int, s: Sampling, vocab: int):
        """The program of ``n`` more decode steps of a segment, from step ``first`` (the carry is donated)."""
        key = ("more", rows, n, s, vocab)
        if key not in self._fns:
            _, cache_sharding = self._placement(rows)

            def run(params, carry, lengths, rng, first):
                with use_rules(None):
                    if cache_sharding is not None:
                        carry = (carry[0], jax.lax.with_sharding_constraint(carry[1], cache_sharding(carry[1])),
                                 carry[2])
                    carry, toks = _decode(self.model_of(params), carry, lengths, rng, first + jnp.arange(n), s,
                                          vocab)
                    return toks, carry

            self._fns[key] = jax.jit(run, donate_argnums=(1,))
        return self._fns[key]

    def check(self, params, prompts: list[list[int]], n_tokens: int, vocab: int | None = None) -> dict:
        """The request's checks (each a ConfigError naming the value), before anything is compiled or
        allocated: prompts of ids the model has, ``n_tokens`` an integer >= 0, ``vocab`` within the model's,
        and the KV cache and the prompts' logits within the devices' free memory. Returns what the request
        needs: ``{"window", "rows", "per_device", "cache", "logits"}`` (bytes per device)."""
        model = self.model_of(params)
        cfg = model.cfg
        vocab = cfg.vocab_size if vocab is None else vocab
        if not isinstance(vocab, (int, np.integer)) or not 1 <= vocab <= cfg.vocab_size:
            raise ConfigError(f"vocab={vocab!r}: draw from 1..model.vocab_size={cfg.vocab_size} ids")
        if not prompts or any(len(q) == 0 for q in prompts):
            raise ConfigError("every prompt needs at least one token")
        for i, q in enumerate(prompts):
            bad = [t for t in q if not (isinstance(t, (int, np.integer)) and 0 <= t < cfg.vocab_size)]
            if bad:
                raise ConfigError(f"prompt {i} has the id {bad[0]!r}, not one of the model's ids 0.."
                                  f"{cfg.vocab_size - 1}")
        if not isinstance(n_tokens, (int, np.integer)) or n_tokens < 0:
            raise ConfigError(f"n_tokens={n_tokens!r} must be an integer >= 0")
        w = window(cfg)
        if w < 2:  # the prompt's token fills it: no position is left for a new one
            raise ConfigError(f"the model attends to {w} position (model.seq_len / model.max_positions): generating "
                              "needs at least 2")
        rows, split = len(prompts), self._split(len(prompts))[1]
        t = self.mesh.shape.get("tensor", 1) if self.mesh is not None else 1
        cache = cache_bytes(model, rows, w) / split / (t if cfg.n_kv_heads % t == 0 and not cfg.latent else 1)
        longest = min(max(len(q) for q in prompts), w)
        logits = rows / split * longest * model.outer()["embed"].padded_size * 4  # the prefill's, float32
        need = {"window": w, "rows": rows, "cache": cache, "logits": logits, "per_device": cache + logits}
        free, holder = free_memory(list(self.mesh.devices.flat) if self.mesh is not None else jax.devices()[:1])
        if need["per_device"] > free:
            raise ConfigError(
                f"generating for {rows} prompt(s) needs {fmt_bytes(need['per_device'])} per device (the KV cache of "
                f"{rows} rows x {w} positions x {cfg.n_layers} layers: {fmt_bytes(cache)}; the prompts' float32 "
                f"logits: {fmt_bytes(logits)}) and {holder}; give fewer prompts, or split them over more devices "
                "(parallel.data) and the KV heads over parallel.tensor"
                + (", or a shorter window (model.seq_len=N)" if cfg.positions == "rope" else ""))
        return need

    def __call__(self, params, prompts: list[list[int]], n_tokens: int, sampling: Sampling = Sampling(),
                 seed: int = 0, vocab: int | None = None, progress=None) -> list[list[int]]:
        """``n_tokens`` new tokens for each prompt (lists of ids, any lengths >= 1), drawn from the first
        ``vocab`` ids (default ``model.vocab_size``); a row that hit a stop token is cut after it. The request
        is checked first (:meth:`check`). ``progress(done, total)``, if given, is called after each compiled
        call with the decode steps done so far (tokens per row) and ``n_tokens``."""
        if self.prepare is not None:  # once per request (e.g. a trainer's storage order -> layer order)
            params = self.prepare(params)
        cfg = self.model_of(params).cfg
        vocab = cfg.vocab_size if vocab is None else vocab
        self.check(params, prompts, n_tokens, vocab)
        w = window(cfg)
        keep = max(1, w // 2)  # context kept when the window is full
        rows = [list(q) if len(q) < w else list(q)[-keep:] for q in prompts]
        out: list[list[int]] = [[] for _ in prompts]
        done = [False] * len(prompts)
        key = jax.random.key(seed)
        segment, total, steps = 0, n_tokens, 0
        while n_tokens > 0 and not all(done):
            p = max(len(r) for r in rows)
            n = min(n_tokens, w - p)
            seg_key = jax.random.fold_in(key, segment)
            lengths = np.asarray([len(r) for r in rows], np.int32)
            carry, first = None, 0
            while first < n and not all(done):
                c = min(n - first, self.chunk)
                if first == 0:
                    fn, rows_sharding = self._fn(len(rows), p, c, sampling, vocab, more=c < n)
                    buf = np.zeros((len(rows), p), np.int32)
                    for i, r in enumerate(rows):
                        buf[i, :len(r)] = r
                    if rows_sharding is not None:
                        buf = jax.device_put(buf, rows_sharding)
                    res = fn(params, buf, lengths, seg_key)
                    toks, carry = res if c < n else (res, None)
                else:
                    toks, carry = self._more(len(rows), c, sampling, vocab)(params, carry, lengths, seg_key,
                                                                           np.int32(first))
                toks = np.asarray(jax.device_get(toks))
                for i in range(len(rows)):
                    if done[i]:
                        continue
                    new = [int(t) for t in toks[i]]
                    hit = [j for j, t in enumerate(new) if t in sampling.stop]
                    if hit:
                        new, done[i] = new[:hit[0] + 1], True
                    out[i] += new
                    rows[i] = rows[i] + new
                first += c
                steps += c
                if progress is not None:
                    progress(steps, total)
            for i in range(len(rows)):
                if len(rows[i]) >= w:  # this row's window is full: it continues from its last tokens
                    rows[i] = rows[i][-keep:]
            n_tokens -= n
            segment += 1
        return out


def for_trainer(trainer) -> Generator:
    """The :class:`Generator` of a :class:`~jaxpar.trainer.Trainer`'s model on its mesh (prompts over
    ``data`` x ``expert``)."""
    return Generator(trainer.adapter.model, mesh=trainer.mesh, batch_axes=("data", "expert"),
                     prepare=trainer.params_in_layer_order)


def generate_text(trainer, params, tokenizer, prompt: str, n_tokens: int, sampling: Sampling, rows: int = 1,
                  seed: int = 0, progress=None) -> list[str]:
    """``rows`` samples of ``n_tokens`` after ``prompt`` from a :class:`~jaxpar.trainer.Trainer`'s model. An
    empty prompt of a tokenizer that adds no BOS starts from id 0 (the model needs one token to start)."""
    if rows < 1:
        raise ConfigError(f"rows={rows}: generate at least one sample")
    ids = prompt_ids(tokenizer, prompt) or [0]
    out = for_trainer(trainer)(params, [ids] * rows, n_tokens, sampling, seed, vocab=tokenizer.vocab_size,
                               progress=progress)
    return [tokenizer.decode(np.asarray(o, np.int32)) for o in out]


@command("nothing was printed")
def main(argv: list[str] | None = None) -> int:
    """``python -m jaxpar.generate RUN_DIR|hf:DIR [--prompt TEXT ...] [key=value ...]``: completions from a
    run's newest checkpoint or a Hugging Face model directory, on the run's mesh (``parallel.*``
    overrides change it; on a host without accelerators it is simulated, as by ``train.py``). A long
    generation shows its progress on stderr (a bar on a terminal, else a line every 10 s); Ctrl-C stops it
    (exit 130). The KV cache must fit the devices: a request that cannot is refused before it starts."""
    ap = ArgumentParser(prog="python -m jaxpar.generate", description=main.__doc__)
    ap.add_argument("run", help="a run directory (train.out_dir): its config.yaml and checkpoints; or hf:DIR, a "
                                "Hugging Face model directory")
    ap.add_argument("--prompt", action="append", default=None,
                    help="a prompt; repeat for a batch of prompts (default: the run's sample.prompt)")
    ap.add_argument("--tokens", type=COUNT, default=None,
                    help="tokens to generate, >= 1 (default: the run's sample.tokens)")
    ap.add_argument("--temperature", type=number(float, Range(0), "0 = greedy"), default=None,
                    help=">= 0; 0 = greedy (default: the run's sample.temperature)")
    ap.add_argument("--top-k", type=number(int, Range(0), "0 = all tokens"), default=None,
                    help=">= 0; 0 = all tokens (default: the run's sample.top_k)")
    ap.add_argument("--top-p", type=number(float, Range(0, 1, lo_open=True), "1 = all tokens"), default=None,
                    help="in (0, 1]; 1 = all tokens (default: the run's sample.top_p)")
    ap.add_argument("--stop", action="append", default=[],
                    help="text of one token that ends a completion (repeatable)")
    ap.add_argument("--seed", type=SEED, default=0, help="in [0, 2^32 - 1] (default 0)")
    ap.add_argument("--chat", action="store_true",
                    help="each --prompt is a user message, rendered with the model's chat template (the run's "
                         "data.chat_template, else its model.init_from folder's, as fine-tuning rendered it) up to "
                         "the assistant's turn; the reply stops at the template's eos_token and is printed alone")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. parallel.data=1 parallel.tensor=2")
    a = ap.parse_intermixed_args(argv)

    from jaxpar.checkpoint import CheckpointError
    from jaxpar.hf import open_run

    run = a.run if a.run.startswith("hf:") else Path(a.run)
    try:
        if a.run == "hf:":
            raise ConfigError("hf: names no folder; give hf:DIR, a Hugging Face model directory")
        trainer, params, step, tokenizer = open_run(run, a.overrides)
        s = trainer.cfg.sample
        n = s.tokens if a.tokens is None else a.tokens
        if n < 1:
            raise ConfigError(f"sample.tokens={n} in the run's config: give --tokens N (>= 1)")
        if tokenizer is None:
            raise ConfigError(f"the run trained on data.source={trainer.cfg.data.source}, which has no tokenizer to "
                              "turn prompts into ids")
        template = None
        if a.chat:
            from jaxpar.data.chat import ChatTemplate, template_folder

            template = ChatTemplate.from_hf_dir(template_folder(trainer.cfg, run))
        stop = []
        stops = list(a.stop) + ([template.eos_token] if template is not None and template.eos_token else [])
        for text in stops:
            got = [int(i) for i in tokenizer.encode(text)]
            if len(got) != 1:
                raise ConfigError(f"--stop {text!r} is {len(got)} tokens {got} for this tokenizer; a stop is the text "
                                  "of one token (in bash, a newline is $'\\n')")
            stop += got
        greedy = (s.temperature if a.temperature is None else a.temperature) == 0
        for flag, value, all_ in (("--top-k", a.top_k, 0), ("--top-p", a.top_p, 1)):
            if greedy and value is not None and value != all_:
                raise ConfigError(f"{flag} {value} has no effect on greedy decoding (temperature 0); give a "
                                  "--temperature above 0 to sample, or drop it")
        sampling = Sampling(temperature=s.temperature if a.temperature is None else a.temperature,
                            top_k=s.top_k if a.top_k is None else a.top_k,
                            top_p=s.top_p if a.top_p is None else a.top_p, stop=tuple(stop))
        prompts = a.prompt or [s.prompt]
        if template is not None:  # the template writes the BOS it wants; the ids are the model's own
            texts = [template.render([{"role": "user", "content": p}], add_generation_prompt=True) for p in prompts]
            ids = [[int(i) for i in tokenizer.encode(t)] for t in texts]
        else:
            ids = [prompt_ids(tokenizer, p) for p in prompts]
        for p, q in zip(prompts, ids):
            if not q:
                raise ConfigError(f"{'--prompt' if a.prompt else 'sample.prompt'} {p!r} has no token to start from "
                                  "(this tokenizer adds no BOS); give some text")
        gen = for_trainer(trainer)
        need = gen.check(params, ids, n, vocab=tokenizer.vocab_size)
        w = need["window"]
        print(f"# {run}: {'step ' + str(step) if step is not None else 'Hugging Face weights'}, temperature "
              f"{sampling.temperature}, top-k {sampling.top_k}, top-p {sampling.top_p}", file=sys.stderr)
        longest = max(len(q) for q in ids)
        if longest + n > w:  # the cache holds the window: a longer request slides (module docstring)
            m = trainer.cfg.model.resolved()
            what = ("model.max_positions, the learned position table's rows" if m.positions == "learned" else
                    "model.seq_len, the trained context; RoPE takes model.seq_len=N for another")
            print(f"# the KV cache holds {w} positions ({what}): a completion longer than its window continues from "
                  f"its last {max(1, w // 2)} tokens" + (f" (a prompt has {longest} tokens)" if longest >= w else ""),
                  file=sys.stderr)
        unit = "tokens" if len(ids) == 1 else f"tokens of each of {len(ids)} completions"
        progress = Progress(n, "generating", unit, "tok/s", per=len(ids))
        try:
            with progress:
                out = gen(params, ids, n, sampling, a.seed, vocab=tokenizer.vocab_size, progress=progress)
        except KeyboardInterrupt:
            print(f"error: interrupted (Ctrl-C) after {progress.done:,} of {n:,} tokens; nothing was printed",
                  file=sys.stderr)
            return 130
    except (ConfigError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 1
    for p, o in zip(prompts, out):
        if template is not None:  # the reply alone, without its end-of-turn token
            o = o[:-1] if o and o[-1] in sampling.stop else o
            print(tokenizer.decode(np.asarray(o, np.int32)))
        else:
            print(p + tokenizer.decode(np.asarray(o, np.int32)))
        print("---")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
