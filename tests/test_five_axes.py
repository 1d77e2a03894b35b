"""All five axes at once (data=2 x pipe=2 x expert=2 x seq=2 x tensor=2 = 32 simulated devices) give
the loss and gradients of one device: the dense GPT (expert = extra data parallelism; ring
attention; the GPipe schedule) and the MoE model (experts split over `expert`; Ulysses attention; the 1F1B
schedule). Runs in a subprocess that asks for 32 CPU devices. Their collectives and memory against the
analytic models: tests/test_plan.py's five-axes test."""

from helpers import run_script

SCRIPT = r"""
import jax, numpy as np
from helpers import assert_trees_close, config, loss_grads, rel_err
over = dict(model__n_layers=4, train__batch_size=16)
ref = loss_grads(config("llama_gqa", **over))
got = loss_grads(config("llama_gqa", parallel__data=2, parallel__pipe=2, parallel__expert=2, parallel__seq=2,
                        parallel__tensor=2, parallel__seq_attention="ring", **over))
assert rel_err(got[0], ref[0]) <= 1e-5, (got[0], ref[0])
assert_trees_close(got[1], ref[1], 1e-5, "ring grads ")
print("ring loss", got[0], ref[0])
# the MoE model: experts split over `expert` (all-to-all), the rest as above. Router losses are
# weighted 0 here: the balance loss is a product of batch means, so a pipeline's microbatches
# change its value (the cross-entropy and its gradients are exact).
moe = dict(over, model__arch="moe", moe__n_experts=4, moe__top_k=2, moe__capacity_factor=2.0, moe__d_ff=64,
           moe__aux_loss_weight=0.0, moe__z_loss_weight=0.0)
ref = loss_grads(config("llama_gqa", **moe))
got = loss_grads(config("llama_gqa", parallel__data=2, parallel__pipe=2, parallel__expert=2, parallel__seq=2,
                        parallel__tensor=2, parallel__seq_attention="ulysses", parallel__pipeline_schedule="1f1b",
                        **moe))
assert rel_err(got[0], ref[0]) <= 1e-5, (got[0], ref[0])
assert_trees_close(got[1], ref[1], 1e-5, "moe grads ")
print("moe loss", got[0], ref[0])
print("five axes ok")
"""


def test_five_axes_match_single_device():
    print(run_script(SCRIPT, devices=32, done="five axes ok"))
