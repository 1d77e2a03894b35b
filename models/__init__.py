"""Model definitions built from :mod:`jaxpar.layers`, and the ``model.arch`` registry."""

from flax import nnx

from jaxpar.config import Config
from jaxpar.models.gpt import GPT, Block
from jaxpar.models.moe import MoETransformer

ARCHS = {
    "gpt": lambda cfg, tensor, rngs: GPT(cfg.model, tensor=tensor, rngs=rngs),
    "moe": lambda cfg, tensor, rngs: MoETransformer(cfg.model, cfg.moe, tensor=tensor, rngs=rngs),
}


def build_model(cfg: Config, *, tensor: int = 1, seed: int = 0) -> nnx.Module:
    """The model ``cfg.model.arch`` names (``tensor`` pads the vocabulary; ``seed`` draws the weights)."""
    return ARCHS[cfg.model.arch](cfg, tensor, nnx.Rngs(seed))


__all__ = ["ARCHS", "GPT", "Block", "MoETransformer", "build_model"]
