"""Hugging Face ``config.json`` -> jaxpar keys, for ``model.init_from=hf:DIR`` (applied by
:func:`jaxpar.config.load_config`; the weights are :mod:`jaxpar.hf`'s).

:func:`config_keys` turns a ``config.json`` of a supported family (:mod:`jaxpar.families`: GPT-2,
Llama 1-3.x, Mistral, Qwen2/2.5, Qwen3, Gemma 3, Mixtral, Qwen3-MoE, DeepSeek-V3, GPT-OSS) into the ``model.*`` (and
``moe.*``) keys of the same model: ``hard`` ones define the architecture, ``soft`` ones are defaults the
user may change. An option jaxpar does not implement is a :class:`ConfigError` naming the field.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from jaxpar.errors import ConfigError
from jaxpar.families import CLASSES, family  # noqa: F401  (CLASSES: the families' transformers classes)

PREFIX = "hf:"

def directory(init_from: str) -> Path:
    """The model directory of a ``model.init_from`` value (``hf:DIR``)."""
    if not init_from.startswith(PREFIX):
        raise ConfigError(f"model.init_from={init_from!r}: expected hf:/path/to/a/hugging/face/model/dir")
    if not init_from[len(PREFIX):].strip():
        raise ConfigError(f"{init_from} names no folder; give hf:DIR, a Hugging Face model directory")
    d = Path(init_from[len(PREFIX):]).expanduser()
    if not (d / "config.json").is_file():
        raise ConfigError(f"model.init_from={init_from!r}: {d} has no config.json (a local Hugging Face model "
                          "directory is needed; nothing is downloaded)")
    return d


def read_config(d: Path) -> dict:
    try:
        return json.loads((Path(d) / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{d}/config.json cannot be read: {e}") from None


def _arch(hf: dict, where: str) -> str:
    return family(hf, where).MODEL_TYPE


def config_keys(hf: dict, where: str = "config.json") -> tuple[dict[str, Any], dict[str, Any]]:
    """``(hard, soft)`` jaxpar keys of a Hugging Face ``config.json`` (its family's translation,
    :mod:`jaxpar.families`): ``hard`` define the architecture (a conflicting user value is an error),
    ``soft`` are defaults the user may change."""
    try:
        hard, soft = family(hf, where).config_keys(hf, where)
    except KeyError as e:
        raise ConfigError(f"{where}: field {e.args[0]!r} is missing (needed by its model_type "
                          f"{hf.get('model_type')!r})") from None
    if hard.get("model.positions") == "rope" and hf.get("max_position_embeddings"):
        # the context a RoPE model is made for: kept (it sizes nothing) and written back by the export
        soft = {"model.max_positions": int(hf["max_position_embeddings"]), **soft}
    return hard, soft


# ---------------------------------------------------------------------------------------------
# Config integration (called by jaxpar.config.load_config).

def apply(tree: dict, init_from: str, get, put, given: set[str]) -> dict[str, Any]:
    """Set the keys of ``init_from``'s ``config.json`` in the config ``tree`` (YAML values below the
    command line): architecture keys replace the file's, defaults fill what neither sets, and its
    ``tokenizer.json`` becomes ``data.tokenizer`` unless the command line names one. Returns the
    architecture keys, which a command-line override may not contradict."""
    d = directory(init_from)
    hard, soft = config_keys(read_config(d), f"{d}/config.json")
    for key, value in hard.items():
        put(tree, key, value)
    for key, value in soft.items():
        if get(tree, key) is None and key not in given:
            put(tree, key, value)
    if "data.tokenizer" not in given:
        if (d / "tokenizer.json").is_file():
            put(tree, "data.tokenizer", str(d / "tokenizer.json"))
        elif get(tree, "data.tokenizer") in (None, "bpe"):
            print(f"note: {d} has no tokenizer.json; data.tokenizer=bpe would train a new tokenizer whose ids mean "
                  "nothing to the imported weights (set data.tokenizer to the model's tokenizer.json)", file=sys.stderr)
    return hard


def check(cfg) -> None:
    """Checks of a config built with ``model.init_from`` that need its final values."""
    d = directory(cfg.model.init_from)
    hf = read_config(d)
    where = f"{d}/config.json"
    if hf.get("model_type") == "gpt2" and cfg.model.seq_len > hf["n_positions"]:
        raise ConfigError(f"model.seq_len={cfg.model.seq_len} exceeds the {hf['n_positions']} learned positions of "
                          f"{where} (n_positions); lower model.seq_len")
