"""Chat fine-tuning data: conversations rendered with a model's own chat template, with a loss mask.

**Format.** A ``.jsonl`` file (or a folder: its ``*.jsonl`` files in name order), one conversation per
non-blank line, in one of the forms Hugging Face and TRL use::

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}, ...]}
    {"prompt": "...", "completion": "..."}                  # = [user prompt, assistant completion]
    {"prompt": [messages...], "completion": [messages...]}  # TRL's conversational form, concatenated

Roles are those of :data:`ROLES`; contents are strings; other keys of a message (``name``,
``reasoning_content``, ...) are passed to the template as they are.

**Rendering.** :class:`ChatTemplate` renders a Hugging Face chat template (jinja) in the sandbox that
``transformers.apply_chat_template`` uses, with the same globals and filters, so the text and the ids
(encoded with ``add_special_tokens=False``) are the model's own.

**Masking.** A token is trained (mask 1) iff its first character lies in an assistant span. The span of
assistant message ``i`` runs from the end of ``render(messages[:i], add_generation_prompt=True)`` to the
end of ``render(messages[:i+1])``: the assistant's content and the end-of-turn text the template puts
after it (ChatML's ``<|im_end|>\\n``, Llama 3's ``<|eot_id|>``, Mistral's ``</s>``), but never the
``assistant`` header, which is the generation prompt. A template whose renders of a conversation's start
are not prefixes of the whole render (one that rewrites earlier turns, as Qwen3's drops their reasoning)
has its messages' contents located in the whole render instead, in order: an assistant's span is then its
content and the template's ``eos_token`` right after it.

**Errors and skips.** A conversation longer than ``max_tokens`` is skipped and counted in
:func:`read_conversations`' report (and one log line); it is not an error. Everything else wrong with
the data or the template (invalid JSON, a missing key, an unknown role, no assistant turn, a template
that fails or raises) is a :class:`ChatError`: one line naming the file and line.

**Stores.** ``python -m jaxpar.data.prepare --chat HF_DIR`` (:func:`prepare_store`) keeps conversations as
a token store's documents with their masks (:func:`prepare_tokenized`), for ``data.source=tokens
data.packing=documents`` at scale. Long by design: the chat data path, from the template to the store.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
import os
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from jaxpar.errors import ConfigError

ROLES = ("system", "user", "assistant", "tool")
# Where a Hugging Face model folder keeps its chat template (transformers >= 4.43 writes the first).
_TEMPLATE_FILE = "chat_template.jinja"
_CONFIG_FILE = "tokenizer_config.json"
# Keys of tokenizer_config.json that transformers passes to the template (its special_tokens_map).
_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Older names of a message's reasoning; transformers copies it to all of them (templates read different ones).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatError(ConfigError):
    """A problem with the user's chat data or chat template: one line, naming the file and line."""


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _token_text(value: Any) -> str:
    """A special token as tokenizer_config.json writes it: a string, or a dict with ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _environment():
    """The jinja environment of ``transformers.utils.chat_template_utils._cached_compile_jinja_template``."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
        import jinja2.utils
    except ImportError:
        raise ChatError("chat data needs jinja2 to render chat templates: pip install 'jinja2>=3.1.6'") from None
    if tuple(int(p) for p in jinja2.__version__.split(".")[:3] if p.isdigit()) < (3, 1, 6):
        raise ChatError(f"jinja2 {jinja2.__version__} has known sandbox escapes; pip install 'jinja2>=3.1.6'")

    def raise_exception(message):
        raise ChatError(_one_line(message))

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # as transformers: no HTML escaping, with indent/separators options
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class Namespace(jinja2.utils.Namespace):
        """``namespace()`` that refuses underscore names (transformers' guard against sandbox escapes)."""

        def __init__(*args, **kwargs):
            self, attrs = args[0], dict(*args[1:], **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} starts with an underscore")

    class Generation(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (TRL's assistant-mask markers) renders its body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=Namespace,
                       dict=lambda *args, **kwargs: dict(*args, **kwargs))
    return env, jinja2.TemplateError


class ChatTemplate:
    """A Hugging Face chat template (jinja), rendered in a sandbox as transformers does."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "", name: str = "chat template"):
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.name = name
        # what transformers passes besides the messages: the tokenizer's special tokens that are set
        self.variables: dict[str, str] = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token)) if v}
        env, self._template_error = _environment()
        try:
            self._template = env.from_string(source)
        except self._template_error as e:
            line = f" (line {e.lineno})" if getattr(e, "lineno", None) else ""
            raise ChatError(f"{name} is not a valid jinja template: {_one_line(e)}{line}") from None

    @classmethod
    def from_hf_dir(cls, path) -> "ChatTemplate":
        """The template of a Hugging Face model folder: ``chat_template.jinja`` if present, else the
        ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates: the one
        named ``default``, else the first), with the special tokens of ``tokenizer_config.json``. A file
        in the folder (its ``tokenizer.json``, say) stands for the folder."""
        folder = Path(path)
        if folder.is_file():  # a file of the folder (its tokenizer.json, say) stands for the folder
            folder = folder.parent
        if not folder.is_dir():
            raise ChatError(f"chat template folder {str(folder)!r} does not exist (expected a Hugging Face "
                            "model folder)")
        config: dict = {}
        config_path = folder / _CONFIG_FILE
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError) as e:
                raise ChatError(f"{config_path} is not valid JSON ({_one_line(e)})") from None
            if not isinstance(config, dict):
                raise ChatError(f"{config_path} is not a JSON object")
        source, name = None, str(folder / _TEMPLATE_FILE)
        if (folder / _TEMPLATE_FILE).is_file():
            source = (folder / _TEMPLATE_FILE).read_text(encoding="utf-8")
        else:
            found = config.get("chat_template")
            name = f"{config_path} chat_template"
            if isinstance(found, list):
                named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
                found = named.get("default", next(iter(named.values()), None))
            source = found if isinstance(found, str) else None
        if source is None:
            raise ChatError(f"no chat template in {str(folder)!r}: looked for {_TEMPLATE_FILE} and for "
                            f"\"chat_template\" in {_CONFIG_FILE}; choose a chat model's folder")
        tokens = {k: _token_text(config.get(k)) for k in _TOKEN_KEYS}
        if (folder / "special_tokens_map.json").is_file():  # older folders keep the special tokens there
            try:
                old = json.loads((folder / "special_tokens_map.json").read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError):
                old = {}
            if isinstance(old, dict):
                tokens = {k: v or _token_text(old.get(k)) for k, v in tokens.items()}
        out = cls(source, bos_token=tokens["bos_token"], eos_token=tokens["eos_token"], name=name)
        out.variables = {k: v for k, v in tokens.items() if v}
        return out

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        """The template's text for ``messages`` (as ``apply_chat_template(..., tokenize=False)`` gives)."""
        chat = []
        for m in messages:  # as transformers: keys set to None are dropped, reasoning is aliased
            m = {k: v for k, v in m.items() if v is not None}
            reasoning = next((m[k] for k in _REASONING_FIELDS if k in m), None)
            chat.append({"thinking": reasoning, **m, "reasoning_content": reasoning} if reasoning is not None else m)
        try:
            return self._template.render(messages=chat, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.variables)
        except ChatError as e:  # the template's raise_exception
            raise ChatError(f"the chat template failed to render: {e}") from None
        except Exception as e:  # the template is the user's code: any failure in it is the user's problem
            kind = "" if isinstance(e, self._template_error) else f"{type(e).__name__}: "
            raise ChatError(f"the chat template failed to render: {kind}{_one_line(e)}") from None


def normalize(record: dict, where: str) -> list[dict]:
    """The messages of one parsed JSONL record (see the module docstring for the accepted forms)."""
    if not isinstance(record, dict):
        raise ChatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list):
            raise ChatError(f"{where}: \"messages\" must be a list of messages, got {type(messages).__name__}")
    elif "prompt" in record and "completion" in record:
        prompt, completion = record["prompt"], record["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        elif isinstance(prompt, list) and isinstance(completion, list):
            messages = prompt + completion
        else:
            raise ChatError(f"{where}: \"prompt\" and \"completion\" must both be strings or both lists of messages, "
                            f"got {type(prompt).__name__} and {type(completion).__name__}")
    else:
        found = ", ".join(repr(k) for k in record) or "none"
        raise ChatError(f"{where}: expected \"messages\", or \"prompt\" and \"completion\"; found keys {found}")
    out = []
    for k, m in enumerate(messages, 1):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ChatError(f"{where}: message {k} is not an object with a string \"role\" and a string "
                            f"\"content\": {_one_line(json.dumps(m, ensure_ascii=False))[:120]}")
        if m["role"] not in ROLES:
            raise ChatError(f"{where}: message {k} has role {m['role']!r}; the roles are {', '.join(ROLES)}")
        out.append({key: v for key, v in m.items() if v is not None})
    if not any(m["role"] == "assistant" for m in out):
        raise ChatError(f"{where}: the conversation has no assistant message (nothing to train on)")
    return out


def _raw(tok):
    """The ``tokenizers.Tokenizer`` behind ``tok`` (a jaxpar BPETokenizer, a transformers fast tokenizer, or itself)."""
    for attr in ("_tok", "backend_tokenizer"):
        inner = getattr(tok, attr, None)
        if inner is not None:
            return inner
    return tok


def encode_conversation(tok, template: ChatTemplate, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """The ids (int32) of the rendered conversation and its loss mask (uint8, 1 on assistant turns)."""
    text = template.render(messages)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            prefix = template.render(messages[:i], add_generation_prompt=True)
            full_i = template.render(messages[:i + 1])
        except ChatError as e:
            raise ChatError(f"{e} (rendering the conversation up to assistant message {i + 1}, "
                            f"to find its tokens)") from None
        if not (text.startswith(prefix) and text.startswith(full_i) and len(prefix) <= len(full_i)):
            spans = _located_spans(text, messages, template)
            break
        spans.append((len(prefix), len(full_i)))
    enc = _raw(tok).encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, dtype=np.int32)
    starts = np.asarray([o[0] for o in enc.offsets], dtype=np.int64)
    mask = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        mask |= (starts >= a) & (starts < b)
    return ids, mask.astype(np.uint8)


def _located_spans(text: str, messages: list[dict], template: ChatTemplate) -> list[tuple[int, int]]:
    """Assistant spans of a template that is not prefix-stable (one that rewrites earlier turns, as Qwen3's
    drops their reasoning): each message's content found in the whole render, in order, an assistant's
    span its content and the template's ``eos_token`` right after it (its end of turn)."""
    spans, at = [], 0
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        pos = text.find(content, at)
        if pos < 0:
            raise ChatError(f"{template.name} is not prefix-stable (its render of the conversation's start is not "
                            f"the start of the whole render), and message {i + 1}'s content does not appear in the "
                            "whole render in order, so the assistant's tokens cannot be located for the loss mask")
        end = pos + len(content)
        if m["role"] == "assistant":
            eot = template.eos_token
            if eot and text.startswith(eot, end):
                end += len(eot)
            spans.append((pos, end))
        at = end
    return spans


def _files(path) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted(f for f in p.glob("*.jsonl") if f.is_file())
        if not files:
            raise ChatError(f"chat data folder {str(p)!r} has no *.jsonl files")
        return files
    if not p.is_file():
        raise ChatError(f"chat data file {str(p)!r} does not exist (expected a .jsonl file or a folder of them)")
    return [p]


def _refs(refs: list[tuple[str, int]]) -> str:
    """``[("a.jsonl", 4), ("a.jsonl", 9), ("b.jsonl", 2)]`` -> ``"a.jsonl lines 4, 9, b.jsonl line 2"``."""
    parts: list[tuple[str, list[int]]] = []
    for name, line in refs:
        if parts and parts[-1][0] == name:
            parts[-1][1].append(line)
        else:
            parts.append((name, [line]))
    return ", ".join(f"{n} line{'s' if len(ls) > 1 else ''} {', '.join(map(str, ls))}" for n, ls in parts)


def read_conversations(path, *, max_tokens: int | None, tok, template, log: Callable[[str], Any] = print,
                       limit_name: str | None = None) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict]:
    """Every conversation of ``path`` as ``(ids, mask)``, in file and line order, and a report.

    Conversations of more than ``max_tokens`` ids (when given) are skipped and counted; ``limit_name``
    says in the log line where the limit comes from (e.g. ``"model.seq_len + 1"``). Any other problem is
    a :class:`ChatError` naming the file and line.
    """
    docs: list[tuple[np.ndarray, np.ndarray]] = []
    skipped: list[tuple[str, int]] = []
    n_read = longest = 0
    for f in _files(path):
        name = f.name
        with open(f, "rb") as fh:
            for n, raw in enumerate(fh, 1):
                where = f"{name} line {n}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ChatError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
                if not line.strip():
                    continue
                try:
                    record = json.loads(line.rstrip())  # (so that a truncated line's column is on it)
                except ValueError as e:
                    detail = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else str(e)
                    raise ChatError(f"{where}: not valid JSON ({detail})") from None
                messages = normalize(record, where)
                try:
                    ids, mask = encode_conversation(tok, template, messages)
                except ChatError as e:
                    raise ChatError(f"{where}: {e}") from None
                n_read += 1
                if max_tokens is not None and len(ids) > max_tokens:
                    skipped.append((name, n))
                    longest = max(longest, len(ids))
                    continue
                docs.append((ids, mask))
    if n_read == 0:
        raise ChatError(f"chat data {str(path)!r} holds no conversations (every line is blank)")
    report = {"conversations": n_read, "kept": len(docs), "skipped_too_long": len(skipped),
              "first_skipped": [f"{n} line {k}" for n, k in skipped[:5]],
              "tokens": int(sum(len(ids) for ids, _ in docs)),
              "trained_tokens": int(sum(int(m.sum()) for _, m in docs))}
    limit = f"{max_tokens} tokens" + (f" ({limit_name})" if limit_name else "")
    if not docs:
        raise ChatError(f"all {n_read} conversations of {str(path)!r} are longer than {limit} (the longest has "
                        f"{longest}); raise the limit or shorten the conversations")
    if skipped:
        more = ", ..." if len(skipped) > 5 else ""
        log(f"chat data: skipped {len(skipped)} of {n_read} conversations longer than {limit} "
            f"({_refs(skipped[:5])}{more})")
    return docs, report


def prepare_store(inputs: list[str], out: str, hf_dir: str, val_fraction: float, shard_tokens: int) -> dict:
    """``python -m jaxpar.data.prepare --chat HF_DIR``: the conversations of ``inputs`` (.jsonl files or
    folders) as a store of documents with loss masks (:func:`prepare_tokenized`),
    rendered and tokenised as the model of ``hf_dir`` does; the last ``val_fraction`` of the conversations
    is the validation split."""
    from jaxpar.data.tokenizer import BPETokenizer

    tokenizer = Path(hf_dir).expanduser() / "tokenizer.json"
    tok = BPETokenizer.load(tokenizer)
    template = ChatTemplate.from_hf_dir(hf_dir)
    docs: list = []
    for path in inputs:
        part, report = read_conversations(path, max_tokens=None, tok=tok, template=template)
        docs += part
        print(f"{path}: {report['conversations']:,} conversations, {report['trained_tokens']:,} of "
              f"{report['tokens']:,} tokens trained (assistant turns)")
    return prepare_tokenized(docs, out, str(tokenizer), val_fraction, shard_tokens=shard_tokens)


def prepare_tokenized(docs: Iterable[tuple[np.ndarray, np.ndarray]], out: str | os.PathLike,
                      tokenizer_path: str | os.PathLike, val_fraction: float = 0.01, shard_tokens: int = 1 << 28,
                      log=print) -> dict:
    """A token store at ``out`` of pre-tokenized documents ``(ids, mask)`` (``ids`` int, ``mask`` uint8 of
    the same length, 1 where the token is trained as a target), made with the tokenizer
    ``tokenizer_path`` (a tokenizer.json, or ``"byte"``), which the store keeps.

    The last ``val_fraction`` of the documents (at least one) is the validation split; each document is
    one document of the store (framed as given: nothing is added), its mask in the ``.mask.bin`` files.
    ``docs`` is read once, in order (an iterator is first read into a list, to count it). Like
    ``prepare``, this never overwrites: ``out`` is a new or empty folder; the store is written beside it
    and renamed into place, so it appears whole or not at all (an interrupted run leaves nothing to
    resume: run it again). Returns a summary (documents, tokens per split, trained tokens, shards)."""
    from jaxpar.data import store as st
    from jaxpar.data.tokenizer import BPETokenizer, ByteTokenizer

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"--out {str(out)!r} exists and is not an empty folder; prepare never overwrites a store: "
                          f"choose a new or empty folder")
    if not 0.0 < val_fraction <= 0.5:
        raise ConfigError(f"--val-fraction={val_fraction} must be in (0, 0.5]")
    tok = ByteTokenizer() if str(tokenizer_path) == "byte" else BPETokenizer.load(tokenizer_path)
    docs = docs if isinstance(docs, Sequence) else list(docs)
    n_val = max(1, int(round(val_fraction * len(docs))))
    if len(docs) <= n_val:
        raise ConfigError(f"{len(docs)} document(s) are too few to hold out --val-fraction={val_fraction} (at least "
                          f"one document) and train on the rest; add documents")
    trained = {"train": 0, "val": 0}

    def split_docs():
        for i, (ids, mask) in enumerate(docs):
            ids, mask = np.asarray(ids), np.asarray(mask)
            if ids.ndim != 1 or mask.shape != ids.shape:
                raise ConfigError(f"tokenized document {i}: ids of shape {ids.shape} and a mask of shape {mask.shape}; "
                                  f"give 1-D ids and one mask byte per id")
            if len(ids) and not 0 <= ids.min() <= ids.max() < tok.vocab_size:
                raise ConfigError(f"tokenized document {i}: ids in [{ids.min()}, {ids.max()}], outside the tokenizer's "
                                  f"{tok.vocab_size} ids; tokenize with {tokenizer_path}")
            split = "val" if i >= len(docs) - n_val else "train"
            trained[split] += int(np.count_nonzero(mask))
            yield split, ids, mask.astype(np.uint8), (0,)

    meta = {"source": "tokenized", "val_fraction": float(val_fraction)}
    index = st.write_store(out, tok, meta, split_docs(), int(shard_tokens), masks=True)
    if index is None:
        raise ConfigError(f"--out {str(out)!r}: another process wrote a token store there meanwhile; choose a new "
                          f"folder")
    sp = index["splits"]
    summary = {"documents": len(docs), "train_tokens": sp["train"]["tokens"], "val_tokens": sp["val"]["tokens"],
               "train_trained_tokens": trained["train"], "val_trained_tokens": trained["val"],
               "shards": sum(len(sp[s]["shards"]) for s in st.SPLITS)}
    log(f"prepared {out}: {len(docs):,} tokenized documents ({len(docs) - n_val:,} train / {n_val:,} validation), "
        f"{summary['train_tokens']:,} + {summary['val_tokens']:,} tokens, of which {trained['train']:,} + "
        f"{trained['val']:,} trained, in {summary['shards']} shard(s)")
    return summary


def template_folder(cfg, run=None) -> Path:
    """The folder whose chat template a run uses (:mod:`jaxpar.data.chat`): ``data.chat_template``, else the
    Hugging Face folder of ``model.init_from`` (of ``hf:DIR`` itself), else the folder of the run's
    ``data.tokenizer`` file."""
    if cfg.data.chat_template:
        return Path(cfg.data.chat_template).expanduser()
    if str(run).startswith("hf:"):
        return Path(str(run)[3:]).expanduser()
    if cfg.model.init_from:
        return Path(cfg.model.init_from[3:]).expanduser()
    if cfg.data.tokenizer not in ("bpe", "byte"):
        return Path(cfg.data.tokenizer).expanduser().parent
    raise ConfigError("--chat needs a chat template: set data.chat_template=DIR (a Hugging Face model folder with "
                      "one); this run has no model.init_from and a tokenizer trained here")



__all__ = ["ROLES", "ChatError", "ChatTemplate", "encode_conversation", "normalize", "prepare_store",
           "prepare_tokenized", "read_conversations", "template_folder"]
