"""Parallel building blocks usable in any Flax NNX model.

Sharding is declared by logical axis names (see :mod:`jaxpar.partitioning`); under
``jaxpar.partitioning.use_rules(rules)`` the layers constrain their activations accordingly.
"""

from jaxpar.layers.attention import Attention
from jaxpar.layers.attention_ops import attention, causal_attention, rope
from jaxpar.layers.embedding import (VocabParallelEmbed, padded_init, padded_vocab, vocab_logits,
                                     vocab_parallel_cross_entropy)
from jaxpar.layers.latent_attention import LatentAttention
from jaxpar.layers.loss import head_cross_entropy
from jaxpar.layers.linear import ColumnParallelLinear, ParallelLinear, RowParallelLinear
from jaxpar.layers.mlp import MLP
from jaxpar.layers.moe import MoE, Routing, balance_bias, expert_capacity, route
from jaxpar.layers.norm import LayerNorm, RMSNorm, make_norm
from jaxpar.layers.stack import Stack

__all__ = [
    "Attention", "LatentAttention", "attention", "causal_attention", "rope", "VocabParallelEmbed", "padded_init",
    "padded_vocab",
    "vocab_logits", "vocab_parallel_cross_entropy", "head_cross_entropy", "ColumnParallelLinear", "ParallelLinear",
    "RowParallelLinear", "MLP", "LayerNorm", "RMSNorm", "make_norm", "MoE", "Routing", "balance_bias",
    "expert_capacity", "route", "Stack",
]
