"""Training data: the synthetic source, and (see submodules) real corpora and tokenizers."""

from jaxpar.data.synthetic import SyntheticSource

__all__ = ["SyntheticSource"]
