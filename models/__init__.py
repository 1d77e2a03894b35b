"""Model definitions built from :mod:`jaxpar.layers`."""

from models.gpt import GPT, Block, build_model

__all__ = ["GPT", "Block", "build_model"]
