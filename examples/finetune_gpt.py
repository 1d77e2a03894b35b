"""The shipped GPT (jaxpar.models) trained from Python with your own loop and data: a Llama-style
model on a few lines of text, byte-level, on a simulated 8-device mesh (data=2 x tensor=4, ZeRO-3),
and the same on one device: the losses agree.

    python examples/finetune_gpt.py [--steps 5]

To start from the weights of a `train.py` run instead of random ones, restore its checkpoint with
`jaxpar.checkpoint.Checkpointer` and copy its parameters into the model before `layout.shard`.
"""

import argparse
import json

import jaxpar

jaxpar.simulate_devices(8)  # a CPU-only host: 8 simulated XLA devices (before any JAX computation)

import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from jaxpar.data.tokenizer import ByteTokenizer  # noqa: E402
from jaxpar.models import GPT  # noqa: E402

TEXT = """To be, or not to be, that is the question:
Whether 'tis nobler in the mind to suffer
The slings and arrows of outrageous fortune,
Or to take arms against a sea of troubles
And by opposing end them. To die: to sleep;
No more; and by a sleep to say we end
The heart-ache and the thousand natural shocks
That flesh is heir to, 'tis a consummation
Devoutly to be wish'd."""


def batches(seq_len: int, batch: int) -> np.ndarray:
    ids = ByteTokenizer().encode(TEXT)
    starts = np.arange(batch) * ((len(ids) - seq_len - 1) // batch)
    return np.stack([ids[s:s + seq_len + 1] for s in starts])


def loss_fn(model, inputs, targets):
    return model.loss(inputs, targets)[0]  # GPT.loss -> (mean cross-entropy, metrics)


def train(layout: jaxpar.Layout, steps: int) -> list[float]:
    cfg = jaxpar.load_config(None, {"model.style": "llama", "model.n_layers": 2, "model.d_model": 64,
                                    "model.n_heads": 4, "model.n_kv_heads": 4, "model.d_ff": 128,
                                    "model.vocab_size": 256, "model.seq_len": 32}).model
    model = layout.shard(GPT(cfg, tensor=layout.parallel.tensor, rngs=nnx.Rngs(0)))
    opt = layout.optimizer(model, optax.adamw(1e-3))
    step = layout.train_step(loss_fn)
    x = batches(cfg.seq_len, 8)
    return [float(step(model, opt, *layout.batch(x[:, :-1], x[:, 1:]))) for _ in range(steps)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    parallel = train(jaxpar.Layout(data=2, tensor=4, zero=3), args.steps)
    single = train(jaxpar.Layout(data=1), args.steps)
    print(json.dumps({"losses_8_devices": parallel, "losses_1_device": single,
                      "max_abs_diff": max(abs(a - b) for a, b in zip(parallel, single))}))


if __name__ == "__main__":
    main()
