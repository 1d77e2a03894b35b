"""All five axes at once (data=2 x pipe=2 x expert=2 x seq=2 x tensor=2 = 32 simulated devices) give
the loss and gradients of one device: the dense GPT (expert = extra data parallelism; ring
attention; the GPipe schedule) and the MoE model (experts split over `expert`; Ulysses attention; the 1F1B
schedule, and ZB-H1 with the forwards' residuals kept; router losses on: one device per microbatch). Runs in a subprocess that asks for 32 CPU devices.
Their collectives and memory against the analytic models: tests/test_plan.py's five-axes test."""

from helpers import run_script

SCRIPT = r"""
import jax, numpy as np
from helpers import (assert_trees_close, check_moe_against_reference, config, first_step, loss_grads,
                     per_microbatch_reference, rel_err)
over = dict(model__n_layers=4, train__batch_size=16)
ref = loss_grads(config("llama_gqa", **over))
got = loss_grads(config("llama_gqa", parallel__data=2, parallel__pipe=2, parallel__expert=2, parallel__seq=2,
                        parallel__tensor=2, parallel__seq_attention="ring", **over))
assert rel_err(got[0], ref[0]) <= 1e-5, (got[0], ref[0])
assert_trees_close(got[1], ref[1], 1e-5, "ring grads ")
print("ring loss", got[0], ref[0])
# the MoE model: experts split over `expert` (all-to-all), the rest as above, the router losses at their
# defaults (on, as in a real run). A pipeline adds each microbatch's router losses, averaged over the M = 2
# microbatches (the balance loss is a product of batch means): the reference is one device run on each
# microbatch alone, averaged by hand (helpers.per_microbatch_reference).
moe = dict(over, model__arch="moe", moe__n_experts=4, moe__top_k=2, moe__capacity_factor=2.0, moe__d_ff=64)
cfg = config("llama_gqa", parallel__data=2, parallel__pipe=2, parallel__expert=2, parallel__seq=2, parallel__tensor=2,
             parallel__seq_attention="ulysses", parallel__pipeline_schedule="1f1b", parallel__microbatches=2, **moe)
assert (cfg.moe.aux_loss_weight, cfg.moe.z_loss_weight) == (0.01, 0.001)
ref = per_microbatch_reference("llama_gqa", 2, **moe)
got = first_step(cfg)
check_moe_against_reference(cfg, got["loss"], got["aux"], got["grads"], ref)
print("moe loss", got["loss"], ref[0])
# the same under ZB-H1 with the forwards' residuals kept (B and W apart, no forward run twice)
cfg = config("llama_gqa", parallel__data=2, parallel__pipe=2, parallel__expert=2, parallel__seq=2, parallel__tensor=2,
             parallel__seq_attention="ulysses", parallel__pipeline_schedule="zb_h1", parallel__stage_remat=False,
             parallel__microbatches=2, **moe)
got = first_step(cfg)
check_moe_against_reference(cfg, got["loss"], got["aux"], got["grads"], ref)
print("moe zb_h1 kept loss", got["loss"], ref[0])
print("five axes ok")
"""


def test_five_axes_match_single_device():
    print(run_script(SCRIPT, devices=32, done="five axes ok"))
