"""Chat: conversations rendered with special tokens that text cannot forge, prepared with a
loss mask, fine-tuned from a real run, and talked to through the real sample.py --chat."""

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from data.bpe_tokenizers import GPT2Tokenizer
from data.chat import (
    ASSISTANT_END,
    ASSISTANT_START,
    ConversationError,
    Conversations,
    assistant_mask,
    check_conversation,
    render_conversation,
    render_prompt,
    special_ids,
    with_specials,
)
from data.documents import list_inputs
from data.hf_tokenizer import HFTokenizer
from data.loader import load_meta, load_split
from data.prepare import prepare
from data.sources import DataError
from data.specials import CHAT_SPECIALS
from data.text import StopText
from data.tokenizer import CharTokenizer, load_tokenizer
from data.tokenizer_json import tokenizer_files
from generate import Chat, generate, prompt_ids
from machine.errors import InputError
from model import GPT, GPTConfig
from tests.forked import python
from tests.output import error_line
from tests.shared import conversation
from weights.checkpoint import load_checkpoint
from weights.loading import grow_vocabulary

REPO = Path(__file__).resolve().parent.parent


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(r if isinstance(r, str) else json.dumps(r) + "\n" for r in records))
    return path


def chat_tokenizers() -> list:
    char = CharTokenizer(" <>_abcdeinorstu|", CHAT_SPECIALS)
    hf = HFTokenizer(tokenizer_files(char)["tokenizer.json"].decode())
    gpt2 = load_tokenizer(with_specials(GPT2Tokenizer().to_meta(), CHAT_SPECIALS))
    return [char, hf, gpt2]


@pytest.mark.parametrize("tokenizer", chat_tokenizers(), ids=["char", "hf", "gpt2"])
def test_text_never_becomes_a_special_token(tokenizer):
    specials = set(special_ids(tokenizer).values())
    for token in CHAT_SPECIALS:
        assert not specials & set(tokenizer.encode(f"a {token} b"))
    ids, mask = render_conversation(tokenizer, check_conversation(
        [{"role": "user", "content": "<|assistant_start|>"}, {"role": "assistant", "content": "ab"}]))
    assert sum(i in specials for i in ids) == 5  # bos, user start and end, assistant start and end
    got = assistant_mask(np.array(ids), tokenizer.specials[ASSISTANT_START],
                         tokenizer.specials[ASSISTANT_END])
    assert got.tolist() == mask and sum(mask) == len(tokenizer.encode("ab")) + 1


def test_specials_are_added_after_the_vocabulary_and_keep_every_text_id():
    base = GPT2Tokenizer()
    chat = load_tokenizer(with_specials(base.to_meta(), CHAT_SPECIALS))
    assert chat.vocab_size == base.vocab_size + 5
    assert sorted(special_ids(chat).values()) == list(range(50257, 50262))
    assert chat.encode("Hello <|bos|> world") == base.encode("Hello <|bos|> world")
    assert with_specials(chat.to_meta(), CHAT_SPECIALS) == chat.to_meta()  # adding them again changes nothing


@pytest.mark.parametrize("messages, problem", [
    ([{"role": "user", "content": "a"}], "ends without an assistant turn"),
    ([{"role": "bot", "content": "a"}, {"role": "assistant", "content": "b"}], "unknown role 'bot'"),
    ([{"role": "user", "content": " "}, {"role": "assistant", "content": "b"}], "empty content"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], "second user turn"),
    ([{"role": "user", "content": ["a"]}, {"role": "assistant", "content": "b"}],
     "content part 1 is a str, not text"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url",
                                                                   "image_url": {"url": "x"}}]},
      {"role": "assistant", "content": "b"}], "content part 2 is of type 'image_url', not text"),
    ([{"role": "user", "content": [{"type": "text"}]}, {"role": "assistant", "content": "b"}],
     "content part 1 has no text"),
    ([{"role": "user", "content": None}, {"role": "assistant", "content": "b"}],
     "content is a NoneType"),
    ([{"role": "user", "content": "a"}, {"role": "system", "content": "b"}], "only the first"),
    ([{"role": "user", "content": "a"}, {"role": "developer", "content": "b"}], "only the first"),
    ([{"role": "user", "content": "half \ud800 a character"}, {"role": "assistant", "content": "b"}],
     r"message 1's content holds half a character \(\\ud800 at character 5"),
    ({"role": "user"}, "not a non-empty list"),
])
def test_bad_conversations_are_named(messages, problem):
    with pytest.raises(ConversationError, match=problem):
        check_conversation(messages)


def test_text_parts_join_and_the_developer_role_is_the_system():
    """What OpenAI's clients send: content as a list of text parts (joined by newlines, as
    vLLM joins them), and "developer", OpenAI's newer name for "system"."""
    parts = check_conversation([
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "you"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello."}]}])
    assert parts == check_conversation([{"role": "system", "content": "Be brief."},
                                        {"role": "user", "content": "Hi\nyou"},
                                        {"role": "assistant", "content": "Hello."}])


@pytest.mark.parametrize("tokenizer", chat_tokenizers(), ids=["char", "hf", "gpt2"])
def test_text_that_is_not_text_is_refused_before_any_tokenizer_sees_it(tokenizer):
    """A lone surrogate, which GPT-2's tiktoken would encode as U+FFFD and a character table
    would call a character it lacks. Every entry point refuses it the same way, naming the
    field."""
    half = "half \ud800 a character"
    with pytest.raises(InputError, match=r"^prompt holds half a character \(\\ud800 at character 5"):
        prompt_ids(tokenizer, half)
    with pytest.raises(InputError, match="half a character"):
        render_prompt(tokenizer, [("user", half)])
    with pytest.raises(InputError, match="half a character"):
        render_conversation(tokenizer, [("user", "a"), ("assistant", half)])
    with pytest.raises(InputError, match="^a stop string holds half a character"):
        StopText(tokenizer, ("\udc80",))


def test_the_system_message_opens_the_first_user_turn():
    turns = check_conversation([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": "Hello."}])
    assert turns == [("user", "Be brief.\n\nHi"), ("assistant", "Hello.")]
    tokenizer = CharTokenizer("\n .BHbefilory", CHAT_SPECIALS)
    ids, mask = render_conversation(tokenizer, turns)
    assert tokenizer.decode(ids) == ("<|bos|><|user_start|>Be brief.\n\nHi<|user_end|>"
                                     "<|assistant_start|>Hello.<|assistant_end|>")
    assert tokenizer.decode([i for i, learned in zip(ids, mask, strict=True) if learned]) == \
        "Hello.<|assistant_end|>"


def test_a_bad_line_stops_preparation_with_its_number_and_skip_bad_counts_it(tmp_path, char_data):
    rng = random.Random(1)
    good = [conversation(rng) for _ in range(40)]
    bad = [*good[:7], "{not json\n", *good[7:20],
           {"messages": [{"role": "user", "content": "ROMEO"}]}, *good[20:]]
    path = write_jsonl(tmp_path / "chats.jsonl", bad)
    command = ["-m", "data.prepare", "--input", str(path), "--chat", "--tokenizer", str(char_data),
               "--out", str(tmp_path / "out")]
    result = python(command)
    assert result.returncode == 1 and not (tmp_path / "out").exists()
    assert "chats.jsonl line 8 is not valid JSON" in error_line(result.stderr)
    result = python([*command, "--skip-bad"])
    assert result.returncode == 0, result.stderr
    assert "40 conversations (2 bad ones left out)" in result.stdout
    assert load_meta(tmp_path / "out")["skipped"] == 2


def test_a_conversation_that_ends_without_a_reply_is_named(tmp_path, char_data):
    path = write_jsonl(tmp_path / "c.jsonl", [conversation(random.Random(0)),
                                              {"messages": [{"role": "user", "content": "ROMEO"}]}])
    with pytest.raises(DataError, match=r"c.jsonl line 2: the conversation ends without an "
                                         r"assistant turn; fix it, or add --skip-bad"):
        prepare(list_inputs([path]), str(char_data), tmp_path / "out", "c", chat=True)


def conversations_of(split, specials: dict[str, int], block_size: int) -> Conversations:
    return Conversations(split[0:len(split)], split.where, specials, block_size)


def test_batches_hold_whole_conversations_and_learn_the_replies_only(chat_data, char_data):
    meta = load_meta(chat_data)
    tokenizer = load_tokenizer(meta["tokenizer"])
    assert meta["chat"] and meta["vocab_size"] == load_meta(char_data)["vocab_size"] + 5
    conversations = conversations_of(load_split(chat_data, "val", meta), tokenizer.specials, 64)
    x, y = conversations.batch(8, torch.Generator().manual_seed(0))
    bos = tokenizer.specials["<|bos|>"]
    assert (x[:, 0] == bos).all() and x.size(1) < 64  # padded to the longest conversation, not to block_size
    for row_x, row_y in zip(x.tolist(), y.tolist(), strict=True):
        length = row_x.index(bos, 1) if bos in row_x[1:] else len(row_x)
        assert set(row_x[length:]) <= {bos} and set(row_y[length:]) <= {-1}  # the padding
        text = tokenizer.decode(row_x[:length])
        name = text.split("<|user_start|>")[1].split("<|user_end|>")[0]
        learned = tokenizer.decode([t for t in row_y if t != -1])
        assert learned == f"{name.title()} loves.<|assistant_end|>{name}<|assistant_end|>"


def test_conversations_longer_than_the_context_are_cut_and_said(chat_data):
    meta = load_meta(chat_data)
    tokenizer = load_tokenizer(meta["tokenizer"])
    whole = conversations_of(load_split(chat_data, "val", meta), tokenizer.specials, 64)
    cut = conversations_of(load_split(chat_data, "val", meta), tokenizer.specials, 12)
    assert whole.note is None and len(cut.spans) == len(whole.spans)
    assert "are longer than block_size + 1 (13) tokens and are cut, 0 of them before" in cut.note
    assert max(end - start for start, end in cut.spans) == 13


def test_sft_grows_the_vocabulary_and_learns_from_the_replies(sft_run, trained_run):
    run, output = sft_run
    assert "the vocabulary grows from" in output and "<|bos|>" in output
    assert f"next: python sample.py --run {run} --chat" in output
    ckpt = load_checkpoint(run / "last.pt")
    base = load_checkpoint(trained_run / "best.pt")
    assert ckpt["model_args"]["vocab_size"] == base["model_args"]["vocab_size"] + 5
    assert ckpt["iter_num"] == 150 and ckpt["val_loss"] < 1.0  # the replies are easy to learn
    assert list(run.glob("events.out.tfevents.*"))


def test_a_bigram_table_grows_with_the_vocabulary_and_keeps_its_last_row_last(tiny_config,
                                                                               chat_data):
    # the README's chat fine-tuning of the quickstart, whose bigram table has a row for each
    # token and a last one for "no predecessor"
    from train import train
    base = train(tiny_config.updated(max_iters=4, eval_interval=4, bigram_embedding=True,
                                     sample_tokens=0, log_attention=False))
    model = GPT(GPTConfig(**load_checkpoint(base.run_dir / "last.pt")["model_args"]))
    with torch.no_grad():
        model.transformer.wtb.weight.normal_()
    old, V = model.transformer.wtb.weight, model.config.vocab_size
    new = grow_vocabulary(model, V + 5).transformer.wtb.weight
    assert new.shape == (V + 6, old.shape[1])
    torch.testing.assert_close(new[:V], old[:V], rtol=0, atol=0)
    torch.testing.assert_close(new[V:V + 5], old[:V].mean(0).expand(5, -1), rtol=0, atol=1e-6)
    torch.testing.assert_close(new[-1], old[-1], rtol=0, atol=0)
    sft = train(tiny_config.updated(init_from=str(base.run_dir), data_dir=str(chat_data),
                                    run_name="sft", max_iters=4, eval_interval=4,
                                    sample_tokens=0, log_attention=False))
    grown = load_checkpoint(sft.run_dir / "last.pt")["model"]["transformer.wtb.weight"]
    assert grown.shape == (V + len(CHAT_SPECIALS) + 1, old.shape[1])


def test_an_sft_run_resumes_from_its_last_checkpoint(sft_run, trained_run, chat_data, tmp_path):
    run, _ = sft_run
    copy = tmp_path / "chat_sft"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("*.lock"))
    result = python(["train.py", "--config", "config/chat_sft.toml", "--resume", "--init-from",
                     str(trained_run), "--data-dir", str(chat_data), "--out-dir", str(tmp_path),
                     "--max-iters", "160", "--batch-size", "16", "--dtype", "float32"])
    assert result.returncode == 0, result.stderr
    assert "grows" not in result.stdout + result.stderr  # the checkpoint already has the chat tokens
    assert load_checkpoint(copy / "last.pt")["iter_num"] == 160


def test_conversations_come_from_parquet_too(tmp_path, char_data):
    import pyarrow as pa
    import pyarrow.parquet as pq
    records = [conversation(random.Random(n)) for n in range(30)]
    pq.write_table(pa.table({"messages": [r["messages"] for r in records]}), tmp_path / "c.parquet")
    write_jsonl(tmp_path / "c.jsonl", records)
    metas = [prepare(list_inputs([tmp_path / name]), str(char_data), tmp_path / name.replace(".", "_"),
                     "c", chat=True) for name in ("c.parquet", "c.jsonl")]
    assert metas[0]["documents"] == 30 and metas[0]["shards"][0]["sha256"] == metas[1]["shards"][0]["sha256"]


def chat(run: Path, lines: str, *options: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "sample.py", "--run", str(run), "--chat",
                           "--temperature", "0", "--max-new-tokens", "20", *options],
                          input=lines.encode(), capture_output=True, cwd=REPO, timeout=120)


def test_chat_reads_turns_from_a_pipe_and_answers_each_on_a_line(sft_run):
    run, _ = sft_run
    result = chat(run, "JULIET\nthe name\n/reset\nTYBALT\n/quit\nROMEO\n")
    assert result.returncode == 0, result.stderr
    replies = result.stdout.decode().splitlines()
    assert len(replies) == 3  # /quit ends before the last line
    assert replies[0] == "Juliet loves." and replies[2] == "Tybalt loves."
    assert b"a new conversation" in result.stderr


def test_chat_refuses_a_base_model_in_one_line(trained_run):
    result = chat(trained_run, "ROMEO\n")
    assert result.returncode == 1
    assert "base model" in error_line(result.stderr)


def test_chat_answers_a_bad_line_and_goes_on(sft_run):
    run, _ = sft_run
    result = chat(run, "ROMEO?!\n\xff\nROMEO\n")
    assert result.returncode == 0
    assert result.stdout.decode().splitlines() == ["Romeo loves."]
    assert result.stderr.decode().count("error:") == 2


def reply_matches_a_fresh_prefill(model: GPT, conversation: Chat, text: str) -> int:
    """Add a turn, let the cached chat reply greedily, and check the reply against an
    uncached generation from the whole history. Returns the number of turns dropped."""
    dropped = conversation.add_user(text)
    history = list(conversation.ids)
    "".join(conversation.reply())
    reply = conversation.ids[len(history):]
    budget = min(conversation.max_new_tokens, model.config.block_size - len(history))
    # a reply one token past the budget ends with an added <|assistant_end|>
    sampled = budget if len(reply) == budget + 1 else len(reply)
    fresh = generate(model, torch.tensor([history]), sampled, temperature=0.0,
                     use_kv_cache=False)[0, len(history):].tolist()
    assert fresh == reply[:sampled]
    return dropped


def test_a_reply_without_a_user_turn_is_one_clear_error():
    tokenizer = CharTokenizer("\nabc ", CHAT_SPECIALS)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=32, n_layer=1,
                          n_head=2, n_embd=16)).eval()
    conversation = Chat(model, tokenizer, max_new_tokens=3, temperature=0.0, decode="eager")
    with pytest.raises(InputError, match="add one with add_user first"):
        next(conversation.reply())
    conversation.add_user("abc")
    assert isinstance("".join(conversation.reply()), str) and len(conversation.turns) == 1
    with pytest.raises(InputError, match="add one with add_user first"):  # the turn is answered already
        next(conversation.reply())


def test_replies_with_the_cache_kept_equal_a_fresh_prefill_of_the_history():
    torch.manual_seed(0)
    tokenizer = CharTokenizer("\nabcdefgh .", CHAT_SPECIALS)
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, block_size=96, n_layer=2,
                          n_head=2, n_embd=32)).eval()
    conversation = Chat(model, tokenizer, max_new_tokens=12, temperature=0.0, decode="eager",
                        system="be fab")
    assert [reply_matches_a_fresh_prefill(model, conversation, turn)
            for turn in ("abc", "de fa", "h.")] == [0, 0, 0]
    # once the context fills, the oldest turns go, and the cache is refilled from what is left
    dropped = [reply_matches_a_fresh_prefill(model, conversation, "abcdefgh" * 2)
               for _ in range(4)]
    assert sum(dropped) > 0 and len(conversation.ids) <= 97
    turns, ids = list(conversation.turns), list(conversation.ids)
    with pytest.raises(ValueError, match="the model's context holds 96; write a shorter one"):
        conversation.add_user("abc" * 40)
    assert conversation.turns == turns and conversation.ids == ids  # nothing lost
    assert conversation.ids[:3] == [tokenizer.specials["<|bos|>"], tokenizer.specials["<|user_start|>"],
                                    *tokenizer.encode("b")]  # the system text opens the first turn


def test_an_exported_chat_model_renders_conversations_as_sft_did_in_transformers(sft_run, tmp_path):
    import transformers
    run, _ = sft_run
    result = python(["export.py", str(run), str(tmp_path / "hf")], timeout=120)
    assert result.returncode == 0, result.stderr
    assert "chat_template.jinja" in result.stdout
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    tokenizer = load_tokenizer(load_checkpoint(run / "best.pt")["tokenizer"])
    messages = [{"role": "system", "content": "TYBALT"}, *conversation(random.Random(5))["messages"]]
    turns = check_conversation(messages)
    def ids(messages: list[dict]) -> list[int]:
        return auto.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    assert ids(messages) == render_conversation(tokenizer, turns)[0]
    assert ids(messages[:-1]) == render_prompt(tokenizer, turns[:-1])


def test_evaluate_counts_the_right_last_replies_before_and_after_sft(sft_run, trained_run,
                                                                     tmp_path):
    run, _ = sft_run
    rng = random.Random(7)
    first_turns = [{"messages": conversation(rng)["messages"][:2]} for _ in range(20)]
    path = write_jsonl(tmp_path / "held_out.jsonl", first_turns)
    scores = {}
    for name, folder in (("base", trained_run), ("sft", run)):
        result = python(["evaluate.py", "--run", str(folder), "--answers", str(path), "--json",
                         str(tmp_path / f"{name}.json")], timeout=120)
        assert result.returncode == 0, result.stderr
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())
        assert f"{scores[name]['right']} of 20 last replies right" in result.stdout
    assert scores["base"]["right"] == 0 and scores["sft"]["right"] >= 15


def test_fine_tuning_keeps_the_base_context_unless_block_size_is_given(tmp_path, trained_run,
                                                                        chat_data, capsys):
    from train import train
    from training.config import ConfigError, load_config

    def sft(name: str, **settings) -> Path:
        cfg = load_config(REPO / "config" / "chat_sft.toml", {
            "init_from": str(trained_run), "data_dir": str(chat_data), "out_dir": str(tmp_path),
            "run_name": name, "max_iters": 2, "eval_interval": 2, "eval_iters": 1,
            "dtype": "float32", **settings})
        return train(cfg).run_dir / "last.pt"

    base = load_checkpoint(trained_run / "best.pt")["model_args"]["block_size"]  # 32
    assert load_checkpoint(sft("kept"))["model_args"]["block_size"] == base
    out = capsys.readouterr().out
    preset = load_config(REPO / "config" / "chat_sft.toml", {})
    tokens = preset.gradient_accumulation_steps * preset.batch_size * base  # the model's context
    assert "cropped" not in out and f" {tokens:,} tokens/iter, " in out
    assert load_checkpoint(sft("cropped", block_size=16))["model_args"]["block_size"] == 16
    assert (f"init_from: the context is cropped from {base} to 16 tokens (block_size); drop "
            f"block_size to keep the base's") in capsys.readouterr().out
    with pytest.raises(ConfigError, match=f"block_size 64 exceeds .*'s context of {base} tokens"):
        sft("longer", block_size=64)


def test_sampling_text_prefers_the_newest_base_model_and_says_what_it_loaded(tmp_path,
                                                                           trained_run, sft_run):
    # the README's own order: a base model, then its chat model; then sample.py --prompt
    runs = tmp_path / "runs"
    for name, run in (("base", trained_run), ("chat", sft_run[0])):
        (runs / name).mkdir(parents=True)
        shutil.copy(run / "best.pt", runs / name / "best.pt")
        time.sleep(0.01)  # so that the chat model is the newer one
    text = python([str(REPO / "sample.py"), "--prompt", "ROMEO:", "--max-new-tokens", "8"],
                  cwd=tmp_path)
    assert text.returncode == 0 and "<|" not in text.stdout, text.stderr
    assert text.stderr == (f"loaded {Path('runs') / 'base' / 'best.pt'} (the newest base model; "
                           f"the newest run, {Path('runs') / 'chat'}, is a chat model: name it "
                           f"with --run to use it)\n")
    talk = python([str(REPO / "sample.py"), "--chat"], cwd=tmp_path, input="ROMEO\n")
    assert talk.returncode == 0, talk.stderr
    assert f"loaded {Path('runs') / 'chat' / 'best.pt'} (the newest run)" in talk.stderr
