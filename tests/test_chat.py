"""Chat data (jaxpar.data.chat) against transformers' apply_chat_template: the rendered text and the ids of
real-world templates (Qwen2.5's ChatML, Llama 3, Mistral v0.1) saved by save_pretrained, the loss mask read
back as text, and the errors and skips of read_conversations. Offline: the tokenizer is trained here."""

import json

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

from jaxpar.data.chat import (  # noqa: E402
    ROLES, ChatError, ChatTemplate, encode_conversation, normalize, read_conversations)
from jaxpar.data.tokenizer import BPETokenizer  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<s>", "</s>"]

# Qwen2.5-Instruct's template as the model ships it, less its tool-calling branches
QWEN = """{%- if messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Meta-Llama-3-8B-Instruct's template, verbatim
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
          "'<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
          "{% endif %}")

# Mistral-7B-Instruct-v0.1's template, verbatim
MISTRAL = ("{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
           "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

# The template language's corners that transformers defines: tojson with arguments, namespace, loop controls,
# strftime_now, the {% generation %} tag, reasoning aliases, undefined tools
CORNERS = """{%- set ns = namespace(n=0) %}
{%- for m in messages %}
  {%- if m.role == 'tool' %}{% continue %}{% endif %}
  {%- set ns.n = ns.n + 1 %}
<{{ m.role }} n={{ ns.n }}>{{ m | tojson }}|{{ m.content | tojson(indent=2) }}|\
{{ {'k': m.role} | tojson(separators=(',', ':')) }}
  {%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% if m.thinking %}[{{ m.thinking }}]{% endif %}\
{% endgeneration %}{{ eos_token }}{% endif %}
  {%- if ns.n > 4 %}{% break %}{% endif %}
{%- endfor %}
{%- if tools is not none %}TOOLS{% endif %}{{ strftime_now('%Y') | length }}
{%- if add_generation_prompt %}<assistant>{% endif %}"""

TEMPLATES = {"qwen": (QWEN, "<|endoftext|>", "<|im_end|>"), "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>"),
             "mistral": (MISTRAL, "<s>", "</s>")}
# what each template puts after an assistant's (possibly trimmed) content to end its turn
END_OF_TURN = {"qwen": "<|im_end|>\n", "llama3": "<|eot_id|>", "mistral": "</s>"}
GENERATION_PROMPT = {"qwen": "<|im_start|>assistant\n", "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                     "mistral": " [/INST]"}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there!"}, {"role": "assistant", "content": "Hi. How are you?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fox."},
     {"role": "assistant", "content": "The quick brown fox."}, {"role": "user", "content": "And a dog, café ☕?"},
     {"role": "assistant", "content": "  The lazy dog jumps; naïve 日本 ✓  "}],
    [{"role": "user", "content": "one"}, {"role": "assistant", "content": "two"}, {"role": "user", "content": "three"},
     {"role": "assistant", "content": ""}, {"role": "user", "content": "five"},
     {"role": "assistant", "content": "six\nseven"}],
]


def _ok(name, msgs):
    """Whether the template accepts the conversation (Mistral v0.1 has no system role)."""
    return name != "mistral" or all(m["role"] != "system" for m in msgs)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> a folder written by transformers' save_pretrained (tokenizer.json, tokenizer_config.json,
    chat_template.jinja), and the transformers tokenizer that wrote it."""
    root = tmp_path_factory.mktemp("chat")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=True)
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = ["Hello there! How are you?", "The quick brown fox jumps over the lazy dog.", "system user assistant",
             "You are a helpful assistant. You are terse.", "[INST] one two three [/INST]"]
    tok.train_from_iterator(texts * 3, trainer)
    tok.save(str(root / "tokenizer.json"))
    # as Llama 3's tokenizer.json: the post-processor adds <|begin_of_text|>, which the template writes itself
    tok.post_processor = processors.Sequence([processors.ByteLevel(trim_offsets=False), processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", SPECIAL.index("<|begin_of_text|>"))])])
    tok.save(str(root / "llama3.json"))
    out = {}
    for name, (source, bos, eos) in TEMPLATES.items():
        file = root / ("llama3.json" if name == "llama3" else "tokenizer.json")
        hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(file), bos_token=bos, eos_token=eos)
        hf.chat_template = source
        hf.save_pretrained(root / name)
        out[name] = (root / name, hf)
    return out


def _hf_ids(hf, msgs):
    out = hf.apply_chat_template(msgs, tokenize=True)  # transformers 5: a BatchEncoding (return_dict=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _runs(mask):
    """[(start, end)] of the runs of ones in mask."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_render_and_ids_equal_transformers(folders, name):
    folder, hf = folders[name]
    assert (folder / "chat_template.jinja").is_file()  # as transformers 5 saves a template
    template = ChatTemplate.from_hf_dir(folder)
    for msgs in CONVERSATIONS:
        if not _ok(name, msgs):
            continue
        for gen in (False, True):
            assert template.render(msgs, add_generation_prompt=gen) == hf.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=gen)
        ids, mask = encode_conversation(hf.backend_tokenizer, template, msgs)
        assert ids[:2].tolist().count(SPECIAL.index(TEMPLATES[name][1])) == (name != "qwen")  # one BOS (not two)
        assert ids.dtype == np.int32 and mask.dtype == np.uint8 and ids.shape == mask.shape
        assert ids.tolist() == _hf_ids(hf, msgs)
        # a jaxpar BPETokenizer of the same file gives the same ids and mask
        ids2, mask2 = encode_conversation(BPETokenizer.load(folder / "tokenizer.json"), template, msgs)
        assert ids2.tolist() == ids.tolist() and mask2.tolist() == mask.tolist()


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_mask_is_the_assistant_contents_and_their_end_of_turn(folders, name):
    folder, hf = folders[name]
    template = ChatTemplate.from_hf_dir(folder)
    for msgs in CONVERSATIONS:
        if not _ok(name, msgs):
            continue
        ids, mask = encode_conversation(hf.backend_tokenizer, template, msgs)
        decode = lambda a, b, ids=ids: hf.backend_tokenizer.decode(ids[a:b].tolist(), skip_special_tokens=False)
        trimmed = name == "llama3"  # Llama 3's template trims the contents
        want = [(m["content"].strip() if trimmed else m["content"]) + END_OF_TURN[name]
                for m in msgs if m["role"] == "assistant"]
        assert [decode(a, b) for a, b in _runs(mask)] == want
        # and nothing else: the untrained runs between them are the rest of the text, each ending in the
        # generation prompt (the assistant header is not trained)
        runs = _runs(mask)
        cuts = [0] + [c for run in runs for c in run] + [len(ids)]
        untrained = [decode(a, b) for a, b in zip(cuts[::2], cuts[1::2])]
        assert "".join(u + w for u, w in zip(untrained, want + [""])) == hf.apply_chat_template(msgs, tokenize=False)
        assert all(u.endswith(GENERATION_PROMPT[name]) for u in untrained[:-1])
        rest = "".join(untrained)
        for m in msgs:
            if m["role"] != "assistant":
                assert m["content"].strip() in rest


def test_template_corners_equal_transformers(folders):
    _, hf = folders["qwen"]
    msgs = [{"role": "system", "content": "Be <b>bold</b> & \"quoted\" — ünïcode"},
            {"role": "user", "content": "q1"}, {"role": "tool", "content": "skipped"},
            {"role": "assistant", "content": "a1", "reasoning_content": "because"},
            {"role": "user", "content": "q2", "name": None}, {"role": "assistant", "content": "a2"},
            {"role": "user", "content": "q3"}, {"role": "assistant", "content": "a3"}]
    template = ChatTemplate(CORNERS, eos_token="<|im_end|>")
    for gen in (False, True):
        got = template.render(msgs, add_generation_prompt=gen)
        assert got == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen, chat_template=CORNERS)
    assert "\\u" not in got and "&amp;" not in got and "[because]" in got and "a3" not in got  # break after 5


def test_template_from_tokenizer_config_string_and_named_list(folders, tmp_path):
    _, hf = folders["llama3"]
    msgs = CONVERSATIONS[1]
    hf.save_pretrained(tmp_path / "legacy", save_jinja_files=False)  # the template inside tokenizer_config.json
    assert not (tmp_path / "legacy" / "chat_template.jinja").exists()
    assert isinstance(json.loads((tmp_path / "legacy" / "tokenizer_config.json").read_text())["chat_template"], str)
    want = hf.apply_chat_template(msgs, tokenize=False)
    assert ChatTemplate.from_hf_dir(tmp_path / "legacy" / "tokenizer.json").render(msgs) == want
    # a list of named templates: transformers takes "default"
    named = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "legacy")
    named.chat_template = {"tool_use": QWEN, "default": LLAMA3}
    named.save_pretrained(tmp_path / "named", save_jinja_files=False)
    config = json.loads((tmp_path / "named" / "tokenizer_config.json").read_text())
    assert [t["name"] for t in config["chat_template"]] == ["tool_use", "default"]
    reloaded = transformers.PreTrainedTokenizerFast.from_pretrained(tmp_path / "named")
    assert ChatTemplate.from_hf_dir(tmp_path / "named").render(msgs) == reloaded.apply_chat_template(
        msgs, tokenize=False) == want
    # special tokens written as dicts
    config["bos_token"] = {"content": "<|begin_of_text|>", "special": True}
    (tmp_path / "named" / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_hf_dir(tmp_path / "named").render(msgs) == want
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatError, match=r"no chat template in .*none.*chat_template\.jinja.*tokenizer_config\.json"):
        ChatTemplate.from_hf_dir(tmp_path / "none")


def _write(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def test_prompt_completion_forms_equal_messages(folders):
    folder, hf = folders["qwen"]
    template = ChatTemplate.from_hf_dir(folder)
    plain = normalize({"prompt": "Name a fox.", "completion": "The quick brown fox."}, "x line 1")
    assert plain == CONVERSATIONS[1][1:3]
    conv = normalize({"prompt": CONVERSATIONS[1][:4], "completion": CONVERSATIONS[1][4:]}, "x line 1")
    assert conv == normalize({"messages": CONVERSATIONS[1]}, "x line 1") == CONVERSATIONS[1]
    a = encode_conversation(hf.backend_tokenizer, template, conv)
    b = encode_conversation(hf.backend_tokenizer, template, CONVERSATIONS[1])
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


def test_read_conversations_skips_long_ones_and_reports(folders, tmp_path):
    folder, hf = folders["qwen"]
    template = ChatTemplate.from_hf_dir(folder)
    long = CONVERSATIONS[1]
    short = CONVERSATIONS[0]
    path = _write(tmp_path / "chat.jsonl", [{"messages": short}, {"messages": long}, "", "  ",
                                            {"prompt": "Hello", "completion": "there"}, {"messages": long}])
    n_short = len(encode_conversation(hf.backend_tokenizer, template, short)[0])
    n_long = len(encode_conversation(hf.backend_tokenizer, template, long)[0])
    assert n_short < n_long
    logged = []
    docs, report = read_conversations(path, max_tokens=n_long - 1, tok=hf.backend_tokenizer, template=template,
                                      log=logged.append, limit_name="model.seq_len + 1")
    assert len(docs) == 2 and docs[0][0].tolist() == _hf_ids(hf, short)
    assert report == {"conversations": 4, "kept": 2, "skipped_too_long": 2,
                      "first_skipped": ["chat.jsonl line 2", "chat.jsonl line 6"],
                      "tokens": sum(len(i) for i, _ in docs), "trained_tokens": sum(int(m.sum()) for _, m in docs)}
    assert logged == [f"chat data: skipped 2 of 4 conversations longer than {n_long - 1} tokens "
                      f"(model.seq_len + 1) (chat.jsonl lines 2, 6)"]
    logged.clear()
    docs, report = read_conversations(tmp_path, max_tokens=None, tok=hf.backend_tokenizer, template=template,
                                      log=logged.append)
    assert report["kept"] == 4 and report["skipped_too_long"] == 0 and not logged
    with pytest.raises(ChatError, match=f"all 4 conversations .* longer than 3 tokens .*longest has {n_long}"):
        read_conversations(path, max_tokens=3, tok=hf.backend_tokenizer, template=template, log=logged.append)


USER, ASSISTANT = {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}
BAD = [
    ("qwen", {"messages": [USER, {"role": "bot", "content": "a"}]},
     r"^chat\.jsonl line 2: message 2 has role 'bot'; the roles are system, user, assistant, tool$"),
    ("qwen", {"conversation": [USER, ASSISTANT], "id": 3},
     r"^chat\.jsonl line 2: expected \"messages\", or \"prompt\" and \"completion\"; found keys 'conversation', 'id'$"),
    ("qwen", {"prompt": "q"}, r"line 2: expected \"messages\", or \"prompt\" and \"completion\"; found keys 'prompt'"),
    ("qwen", '{"messages": [', r"^chat\.jsonl line 2: not valid JSON \(Expecting value at column 15\)$"),
    ("qwen", [USER, ASSISTANT], r"^chat\.jsonl line 2: expected a JSON object, got list$"),
    ("qwen", {"messages": [USER, {"role": "assistant", "content": None}]},
     r"^chat\.jsonl line 2: message 2 is not an object with a string \"role\" and a string \"content\""),
    ("qwen", {"messages": [USER, {"role": "user", "content": "r"}]},
     r"^chat\.jsonl line 2: the conversation has no assistant message"),
    ("qwen", {"prompt": "q", "completion": [ASSISTANT]}, r"must both be strings or both lists of messages"),
    ("mistral", {"messages": [USER, USER, ASSISTANT]},
     r"^chat\.jsonl line 2: the chat template failed to render: Conversation roles must alternate "
     r"user/assistant/user/assistant/\.\.\."),
    ("mistral", {"messages": [{"role": "system", "content": "s"}, USER, ASSISTANT]},
     r"line 2: the chat template failed to render: Conversation roles must alternate"),
]


@pytest.mark.parametrize("name,record,match", BAD, ids=range(len(BAD)))
def test_bad_records_raise_one_line_naming_the_line(folders, tmp_path, name, record, match):
    folder, hf = folders[name]
    path = _write(tmp_path / "chat.jsonl", [{"messages": [USER, ASSISTANT]}, record])
    with pytest.raises(ChatError, match=match) as e:
        read_conversations(path, max_tokens=None, tok=hf.backend_tokenizer, template=ChatTemplate.from_hf_dir(folder))
    assert "\n" not in str(e.value)


def test_template_problems_are_chat_errors(folders, tmp_path):
    _, hf = folders["qwen"]
    tok = hf.backend_tokenizer
    msgs = [USER, ASSISTANT, USER, ASSISTANT]
    # a template that renders the last message differently cannot be masked by prefixes: the contents are
    # located in the whole render instead (as for Qwen3's, which drops earlier turns' reasoning)
    unstable = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if loop.last %}!{% endif %}"
                            "{% endfor %}", eos_token="!")
    long_msgs = [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "general kenobi"},
                 {"role": "user", "content": "you are a bold one"}, {"role": "assistant", "content": "back away"}]
    ids, mask = encode_conversation(tok, unstable, long_msgs)
    assert tok.decode([int(i) for i, m in zip(ids, mask) if m]) == "general kenobiback away!"
    hidden = ChatTemplate("{% for m in messages %}{{ m.content | upper }}{% if loop.last %}!{% endif %}{% endfor %}")
    with pytest.raises(ChatError, match="is not prefix-stable.*message 1's content does not appear"):
        encode_conversation(tok, hidden, msgs)
    with pytest.raises(ChatError, match=r"^chat template is not a valid jinja template: .*\(line 1\)$"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatError, match="failed to render: .*has no attribute 'nope'"):
        ChatTemplate("{{ messages[0].nope.deeper }}").render(msgs)
    with pytest.raises(ChatError, match="failed to render: TypeError: unsupported operand"):
        ChatTemplate("{{ 1 + messages[0].content }}").render(msgs)
    # the sandbox: no Python internals, no mutation, no underscore names on a namespace (as transformers)
    with pytest.raises(ChatError, match="failed to render: access to attribute '__class__' of 'list' object is unsafe"):
        ChatTemplate("{{ messages.__class__.__mro__ }}").render(msgs)
    with pytest.raises(ChatError, match="failed to render: access to attribute 'append' of 'list' object is unsafe"):
        ChatTemplate("{{ messages.append(1) }}").render(msgs)
    with pytest.raises(ChatError, match="failed to render: namespace attribute '_x' starts with an underscore"):
        ChatTemplate("{% set ns = namespace(x=0) %}{% set ns._x = 1 %}").render(msgs)
    assert "system" in ROLES and "tool" in ROLES
    with pytest.raises(ChatError, match="does not exist"):
        read_conversations(tmp_path / "missing.jsonl", max_tokens=None, tok=tok, template=unstable)
    with pytest.raises(ChatError, match=r"^chat\.jsonl line 1: .*not prefix-stable"):
        read_conversations(_write(tmp_path / "chat.jsonl", [{"messages": msgs}]), max_tokens=None, tok=tok,
                           template=hidden)
