"""Every layout gives the numbers of a single device: identical initial weights, loss and gradients
within 1e-5 relative per leaf, and parameters after 3 AdamW steps within 1e-5 relative (float32;
see helpers.assert_params_close), for GPT-2-style and Llama-style models."""

import pytest

from helpers import assert_params_close, assert_trees_close, config, reference, rel_err, run

LAYOUTS = {
    # (plain data=8 is zero1_data8 without the optimizer-state split: the same forward and backward)
    # (data=2 x tensor=4 without ZeRO runs in zero3_data2_tensor4 with its weights gathered for use)
    "tensor8": dict(parallel__tensor=8),
    "zero1_data8": dict(parallel__data=8, parallel__zero=1),
    "zero3_data8": dict(parallel__data=8, parallel__zero=3),
    "zero3_data2_tensor4": dict(parallel__data=2, parallel__tensor=4, parallel__zero=3),
    "expert2_data4": dict(parallel__data=4, parallel__expert=2),  # expert axis = extra data parallelism
}


# pure data parallelism does not depend on the block's style: llama runs the layouts that split its weights
CASES = [(layout, style) for layout in LAYOUTS for style in ("gpt2", "llama")
         if style == "gpt2" or "tensor" in layout or "zero3" in layout]


@pytest.mark.parametrize("layout, style", CASES, ids=[f"{layout}-{style}" for layout, style in CASES])
def test_layout_matches_single_device(style, layout):
    got = run(config(style, **LAYOUTS[layout]))
    ref = reference(style)
    assert_trees_close(got["init_params"], ref["init_params"], 0.0, "initial params ")
    assert rel_err(got["loss0"], ref["loss0"]) <= 1e-5
    assert_trees_close(got["grads"], ref["grads"], 1e-5, "grads ")
    for a, b in zip(got["losses"], ref["losses"]):
        assert rel_err(a, b) <= 1e-5, (got["losses"], ref["losses"])
    assert_params_close(got["params"], ref["params"], "params after 3 steps ")


# (GQA with tensor parallelism: the pipeline's llama_gqa pipe x tensor x data case and the chunked loss's
# llama_gqa seq x tensor case)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_gradient_accumulation(style):
    """4 microsteps of batch b equal one step of batch 4b (same global batch), on data=2 x tensor=2."""
    accum = run(config(style, train__grad_accum=4, parallel__data=2, parallel__tensor=2))
    ref = reference(style)
    assert rel_err(accum["loss0"], ref["loss0"]) <= 1e-5
    assert_trees_close(accum["grads"], ref["grads"], 1e-5, "grads ")
    assert_params_close(accum["params"], ref["params"])
