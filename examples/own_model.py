"""Your own Flax NNX model from jaxpar's layers, trained on a simulated 8-device mesh (data=4 x tensor=2,
ZeRO-1), and the same training on one device: the losses agree.

    python examples/own_model.py [--steps 5]
"""

import argparse
import json

import jaxpar

jaxpar.simulate_devices(8)  # a CPU-only host: 8 simulated XLA devices (before any JAX computation)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.layers import MLP, Attention, RMSNorm, VocabParallelEmbed, vocab_parallel_cross_entropy  # noqa: E402

VOCAB = 100


class TinyLM(nnx.Module):
    """Embedding (vocabulary split over `tensor`), one GQA attention block, a SwiGLU MLP, tied head."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = VocabParallelEmbed(VOCAB, 64, vocab_multiple=8, rngs=rngs)
        self.norm1, self.norm2 = RMSNorm(64), RMSNorm(64)
        self.attn = Attention(64, 8, 4, 8, rope_theta=10000.0, use_bias=False, rngs=rngs)
        self.mlp = MLP(64, 128, kind="swiglu", use_bias=False, rngs=rngs)

    def __call__(self, ids):
        x = self.embed(ids)
        x = x + self.attn(self.norm1(x))
        x = x + self.mlp(self.norm2(x))
        return self.embed.attend(x)  # logits, vocabulary split over `tensor`


def loss_fn(model, inputs, targets):
    return jnp.mean(vocab_parallel_cross_entropy(model(inputs), targets, VOCAB))


def train(layout: jaxpar.Layout, tokens: np.ndarray, steps: int) -> list[float]:
    model = layout.shard(TinyLM(nnx.Rngs(0)))          # parameters placed by their logical names
    opt = layout.optimizer(model, optax.adamw(3e-3))   # AdamW state sharded as the layout says (ZeRO-1)
    step = layout.train_step(loss_fn)                  # jitted, under the layout's rules
    return [float(step(model, opt, *layout.batch(tokens[:, :-1], tokens[:, 1:]))) for _ in range(steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    tokens = np.random.default_rng(0).integers(0, VOCAB, (16, 33)).astype(np.int32)
    parallel = train(jaxpar.Layout(data=4, tensor=2, zero=1), tokens, args.steps)
    single = train(jaxpar.Layout(data=1), tokens, args.steps)
    print(json.dumps({"losses_8_devices": parallel, "losses_1_device": single,
                      "max_abs_diff": max(abs(a - b) for a, b in zip(parallel, single))}))


if __name__ == "__main__":
    main()
