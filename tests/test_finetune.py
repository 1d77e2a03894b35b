"""Chat fine-tuning end to end: a tiny random Qwen2 (ChatML template) imported from a Hugging Face folder,
fine-tuned on a chat JSONL on data=4 x tensor=2 (only assistant turns trained, conversations packed), exported,
and greedy replies of transformers (same template) and of ``python -m jaxpar.generate --chat`` equal."""

import json

import numpy as np
import pytest
from helpers import command_env
from test_chat import QWEN, SPECIAL

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

WORDS = "zero one two three four five six seven eight nine".split()


def conversations(n: int, seed: int) -> list[dict]:
    """Conversations a model can learn: the user counts from a number, the assistant goes on counting."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a = int(rng.integers(0, 6))
        turns = [{"role": "user", "content": " ".join(WORDS[a:a + 2])},
                 {"role": "assistant", "content": " ".join(WORDS[a + 2:a + 4])}]
        if rng.random() < 0.5:
            turns = [{"role": "system", "content": "Count on."}] + turns
        out.append({"messages": turns})
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A Qwen2 folder as transformers saves it: random weights, a BPE with ChatML's special tokens, the
    Qwen2.5 template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("qwen")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS) + " system user assistant Count on.\n"] * 20, trainer)
    tok.save(str(root / "tokenizer.json"))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_file=str(root / "tokenizer.json"),
                                                  bos_token="<|endoftext|>", eos_token="<|im_end|>")
    hf_tok.chat_template = QWEN
    hf_tok.save_pretrained(root)
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=256, tie_word_embeddings=True,
                                   eos_token_id=tok.token_to_id("<|im_end|>"), bos_token_id=None)
    transformers.Qwen2ForCausalLM(cfg).save_pretrained(root)
    return root


def test_chat_finetune_lowers_held_out_loss_and_generation_matches_transformers(model_dir, tmp_path, capsys):
    from jaxpar import generate, hf
    from jaxpar.config import load_config
    from jaxpar.data.sources import make_source
    from jaxpar.run import run

    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(c) + "\n" for c in conversations(120, 0)))
    out = tmp_path / "run"
    over = [f"model.init_from=hf:{model_dir}", "data.source=chat", f"data.path={data}", "data.packing=documents",
            "data.val_fraction=0.2", "model.seq_len=128", "parallel.data=4", "parallel.tensor=2",
            "train.batch_size=8", "train.steps=120", "train.lr=1e-2", "train.warmup_steps=5", "train.eval_every=0",
            "train.eval_batches=2", f"train.out_dir={out}", "sample.tokens=0", "data.prefetch=0"]
    cfg = load_config(None, over)
    trainer, params, _, tokenizer = hf.open_run(f"hf:{model_dir}", over[1:])
    source = make_source(cfg, trainer.local_rows(), lambda *_: None)
    val = source.val
    assert val and all(set(b) == {"inputs", "targets", "segment_ids", "positions", "weights"} for b in val)
    # only assistant turns trained: their tokens (content + <|im_end|>\n) are a minority of every row
    w = np.concatenate([b["weights"] for b in val])
    assert 0.1 < w.sum() / (w.size) < 0.6
    before = np.average([float(trainer.eval_loss(params, trainer.place_batch(b))) for b in val],
                        weights=[b["weights"].sum() for b in val])
    report = run(cfg, log=lambda *_: None)
    after = report["val_loss"]
    assert after < 0.5 * before, (before, after)

    export = tmp_path / "export"
    assert hf.main([str(out), str(export)]) == 0
    assert (export / "chat_template.jinja").is_file()  # the template travels with the model
    model = transformers.AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(export))
    prompts = ["two three", "four five"]
    want = []
    for p in prompts:
        ids = hf_tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
        got = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                             eos_token_id=hf_tok.convert_tokens_to_ids("<|im_end|>"))[0, len(ids):].tolist()
        want.append(hf_tok.decode([t for t in got if t != hf_tok.convert_tokens_to_ids("<|im_end|>")]))
    capsys.readouterr()
    args = [str(out), "--chat", "--temperature", "0", "--tokens", "6"] + sum((["--prompt", p] for p in prompts), [])
    assert generate.main(args) == 0
    replies = capsys.readouterr().out.split("---\n")[:-1]
    assert [r[:-1] for r in replies] == want  # (print's newline)
    assert want == ["four five", "six seven"]  # it learnt to count on, and to end its turn


def test_bad_chat_data_is_one_error_line_from_train_py(model_dir, tmp_path):
    """train.py with a conversation of an unknown role: exit 2 and one line naming the file, the line and the
    role (no traceback); a too-long conversation in the same data would be a counted skip (test_chat)."""
    import subprocess
    import sys
    from pathlib import Path

    data = tmp_path / "chat.jsonl"
    good = conversations(4, 1)
    bad = {"messages": [{"role": "user", "content": "one two"}, {"role": "bot", "content": "three four"}]}
    data.write_text("".join(json.dumps(c) + "\n" for c in good + [bad]))
    root = Path(__file__).resolve().parents[1]
    env = command_env(JAX_NUM_CPU_DEVICES=__import__("os").environ["JAX_NUM_CPU_DEVICES"])
    p = subprocess.run([sys.executable, str(root / "train.py"), f"model.init_from=hf:{model_dir}", "data.source=chat",
                        f"data.path={data}", "data.packing=documents", "model.seq_len=128", "train.steps=1",
                        f"train.out_dir={tmp_path / 'run'}", "data.prefetch=0"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 2, p.stderr[-2000:]
    err = p.stderr.strip().splitlines()
    assert err[-1].startswith("error: chat.jsonl line 5: ") and "'bot'" in err[-1], err[-3:]
    assert "Traceback" not in p.stderr
