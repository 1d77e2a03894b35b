"""Rematerialisation policies by name (``model.remat``): what each block keeps for its backward.

jaxpar's layers name the outputs of their weight matmuls and of attention with
``jax.ad_checkpoint.checkpoint_name``:

===============  =============================================================
``qkv_proj``     the fused Q/K/V projection                 ``[B, T, KV, G+2, D]``
``attention``    the attention output (before out-proj)     ``[B, T, H, D]``
``out_proj``     the attention out-projection               ``[B, T, d_model]``
``mlp_up``       the MLP (or expert) up / gate-up projection ``[B, T, (2,) d_ff]``
``mlp_down``     the MLP (or expert) down-projection        ``[B, T, d_model]``
===============  =============================================================

A policy keeps some of these per layer and recomputes the rest (norms, activations, RoPE and
whatever is not kept) in the backward, from the layer's input, which the layer scan always keeps:

========================  ==========================================================  ==================
policy                    kept per layer                                              recomputed
========================  ==========================================================  ==================
``none``                  everything the backward reads (no rematerialisation)        nothing
``save_dots``             all five names (``minimal`` is MaxText's name for it)       elementwise work
``save_dots_except_mlp``  ``qkv_proj``, ``attention``, ``out_proj``                   the MLP
``save_qkv_proj``         ``qkv_proj``                                                attention, MLP
``full``                  nothing but the layer input                                 the whole layer
``offload``               as ``save_dots``, but in pinned host memory (GPU/TPU)       elementwise work
========================  ==========================================================  ==================

Memory falls and recompute grows down the table (``offload`` moves ``save_dots``' bytes off the
device at the cost of host transfers, which the scheduler overlaps with compute). A custom layer
takes part by naming its outputs the same way.
"""

from __future__ import annotations

import jax

from jaxpar.config import ConfigError

MATMULS = ("qkv_proj", "attention", "out_proj", "mlp_up", "mlp_down")
KEPT = {
    "save_dots": MATMULS,
    "minimal": MATMULS,
    "save_dots_except_mlp": ("qkv_proj", "attention", "out_proj"),
    "save_qkv_proj": ("qkv_proj",),
    "full": (),
}
POLICIES = ("none", "full", "save_dots", "minimal", "save_dots_except_mlp", "save_qkv_proj", "offload")


def policy(name: str):
    """The ``jax.checkpoint`` policy of ``name`` (None for ``none``: no rematerialisation)."""
    if name not in POLICIES:
        raise ConfigError(f"model.remat={name!r} is not a valid choice; choose one of {', '.join(POLICIES)}")
    if name == "none":
        return None
    if name == "offload":
        return jax.checkpoint_policies.save_and_offload_only_these_names(
            names_which_can_be_saved=(), names_which_can_be_offloaded=MATMULS, offload_src="device",
            offload_dst="pinned_host")
    return jax.checkpoint_policies.save_only_these_names(*KEPT[name])


def remat(fn, name: str):
    """``fn`` rematerialised with policy ``name`` (``fn`` itself for ``none``)."""
    if name == "none":
        return fn
    return jax.checkpoint(fn, policy=policy(name), prevent_cse=False)


# What ``none`` recomputes in a layer that selects its weights from a group inside a loop, as pipeline
# stages do: the outputs of the selection, of the weight's sharding annotation, of the cast to
# device-varying that a ``shard_map`` with ``check_vma`` applies to its replicated inputs (a MoE layer's
# weights: the cast's output, not the input, is what its backward reads), of casts to the compute dtype and
# of reshapes (the sorted dispatch's [E, d, (2) f] view of its cast experts). Kept, they are a copy of the
# layer's weights per loop iteration (a pipeline runs M R + S - 1 of them; under bfloat16 a GPipe stage
# kept its weights in bfloat16 and float32 per iteration: 3.6x the temporaries of float32 compute).
# Recomputing every cast and reshape, activations' too, measured no larger on activation-bound stages (an
# activation's bfloat16 cast is fused into the matmul that reads it; a reshape is free).
_SELECTION = frozenset({"dynamic_slice", "gather", "squeeze", "sharding_constraint", "pvary", "pcast",
                        "convert_element_type", "reshape"})


def keep_all_but_selection(prim, *_, **__) -> bool:
    """A ``jax.checkpoint`` policy: keep everything but weight selections (``_SELECTION``), which the backward
    redoes (pipeline stages; the sorted MoE dispatch's tiles, which select their expert's weights)."""
    return prim.name not in _SELECTION


def select_remat(fn, name: str):
    """``fn``, a layer that selects its weights from its group, rematerialised with policy ``name``.
    Under ``none`` it keeps everything the backward reads except the selected weights (``_SELECTION``),
    which the backward selects again. Only for that: a nested ``jax.checkpoint`` (ring attention's
    blocks) would keep what its own policy recomputes."""
    if name == "none":
        return jax.checkpoint(fn, policy=keep_all_but_selection, prevent_cse=False)
    return remat(fn, name)


def check_supported(name: str, device) -> None:
    """``offload`` needs a pinned host memory space on the device's platform."""
    policy(name)
    if name == "offload":
        kinds = {m.kind for m in device.addressable_memories()}
        if "pinned_host" not in kinds:
            raise ConfigError(f"model.remat=offload needs pinned host memory, which {device.platform} devices do not "
                              f"have (memories: {', '.join(sorted(kinds))}); choose save_dots or full")
