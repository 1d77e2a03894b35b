"""Training data: the synthetic source, corpora and tokenizers, and token stores.

* :mod:`jaxpar.data.corpus`: the built-in Shakespeare corpus, user files (text, JSONL, JSON,
  Parquet), and the train/validation split;
* :mod:`jaxpar.data.tokenizer`: byte and byte-level BPE tokenizers;
* :mod:`jaxpar.data.prepare`: ``python -m jaxpar.data.prepare``, a corpus tokenised once into a
  token store;
* :mod:`jaxpar.data.store`: the token store's format, read by memory map;
* :mod:`jaxpar.data.pipeline`: rows, the global order, each process's share, resumable positions;
* :mod:`jaxpar.data.sources`: what ``data.source`` selects (mixtures and prefetching included).
"""

from jaxpar.data.synthetic import SyntheticSource

__all__ = ["SyntheticSource"]
