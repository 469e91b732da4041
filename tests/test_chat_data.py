"""Chat data with a real Hugging Face fast tokenizer (trained in the test, Qwen3-style template):
loss masks cover exactly the assistant-generated tokens, for single- and multi-turn chats, with
and without thinking; the rendered text round-trips; ShareGPT and messages rows agree; bad rows
are refused naming file:line; `dspark-jax data inspect`; chat data through `train`."""

import json

import pytest

from dspark_jax import cli
from dspark_jax.data import chat
from dspark_jax.data.chat import ChatRenderer, read_chat_jsonl, render_chat, to_messages
from dspark_jax.errors import InputError
from dspark_jax.tokenizer import ByteTokenizer, load_tokenizer
from tests.chat_tokenizer import NO_GENERATION_PROMPT_TEMPLATE, build_tokenizer

END = "<|im_end|>"
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
U1 = {"role": "user", "content": "hello world, how are you today?"}
A1 = {"role": "assistant", "content": "I am fine, thanks for asking.", "reasoning_content": "The user says hello."}
U2 = {"role": "user", "content": "What is 2 + 3?"}
A2 = {"role": "assistant", "content": "The answer is 5.", "reasoning_content": "Let me think: 2 + 3 = 5."}
A2_PLAIN = {"role": "assistant", "content": "The answer is 5."}
EMPTY_THINK = "<think>\n\n</think>\n\n"


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def tok_dir(tok, tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizer")
    tok.save_pretrained(str(d))
    return d


def trained_spans(tok, ids, mask) -> list[str]:
    """The decoded runs of consecutive loss_mask=1 tokens."""
    spans, run = [], []
    for t, m in zip(ids, mask):
        if m:
            run.append(t)
        elif run:
            spans.append(tok.decode(run))
            run = []
    if run:
        spans.append(tok.decode(run))
    return spans


def template_text(tok, messages, thinking):
    kw = {} if thinking is None else {"enable_thinking": thinking}
    return tok.apply_chat_template(messages, tokenize=False, **kw)


# thinking=None is the template's default (thinking on): the generation prompt is the header alone,
# so the last turn's think block (empty when it has no reasoning) is generated, hence trained.
# thinking=False puts the empty think block in the prompt: only the content is trained.
@pytest.mark.parametrize("thinking, last, expected", [
    (None, A2_PLAIN, EMPTY_THINK + "The answer is 5." + END),
    (True, A2_PLAIN, EMPTY_THINK + "The answer is 5." + END),
    (False, A2_PLAIN, "The answer is 5." + END),
    (None, A2, "<think>\nLet me think: 2 + 3 = 5.\n</think>\n\nThe answer is 5." + END),
    (False, A2, "<think>\nLet me think: 2 + 3 = 5.\n</think>\n\nThe answer is 5." + END),
])
def test_single_turn_mask_is_exactly_the_assistant_tokens(tok, thinking, last, expected):
    msgs = [SYSTEM, U2, last]
    ids, mask = render_chat(tok, msgs, thinking=thinking)
    assert trained_spans(tok, ids, mask) == [expected]
    text = template_text(tok, msgs, thinking)
    assert tok.decode(ids) == text  # round trip
    kw = {} if thinking is None else {"enable_thinking": thinking}
    assert ids == list(tok.apply_chat_template(msgs, tokenize=True, return_dict=True, **kw)["input_ids"])
    # the untrained remainder is the prompt (header included) and the newline after <|im_end|>
    first = mask.index(1.0)
    in_prompt = EMPTY_THINK if thinking is False and last is A2_PLAIN else ""
    assert tok.decode(ids[:first]).endswith("<|im_start|>assistant\n" + in_prompt)
    assert tok.decode(ids[len(ids) - mask[::-1].index(1.0):]) == "\n"


@pytest.mark.parametrize("thinking", [None, True, False])
def test_multi_turn_masks_with_reasoning_dropped_from_earlier_turns(tok, thinking):
    """The template drops A1's reasoning (an earlier turn) and shows A2's: not prefix-stable."""
    msgs = [SYSTEM, U1, A1, U2, A2]
    ids, mask = render_chat(tok, msgs, thinking=thinking)
    assert trained_spans(tok, ids, mask) == [
        "I am fine, thanks for asking." + END,
        "<think>\nLet me think: 2 + 3 = 5.\n</think>\n\nThe answer is 5." + END]
    assert tok.decode(ids) == template_text(tok, msgs, thinking)
    assert "The user says hello." not in tok.decode(ids)
    # the old incremental prefix difference fails on this template
    plain = [dict(m) for m in msgs]
    with pytest.raises(InputError, match="differently|prefix"):
        ChatRenderer(tok, thinking=thinking)._by_prefixes(plain, [2, 4], "x")


def test_multi_turn_without_thinking_and_inline_think_blocks(tok):
    msgs = [U1, {"role": "assistant", "content": "I am fine."}, U2, A2_PLAIN]
    ids, mask = render_chat(tok, msgs, thinking=False)
    assert trained_spans(tok, ids, mask) == ["I am fine." + END, "The answer is 5." + END]
    # reasoning given inline in the content == given as reasoning_content
    inline = [U1, A1, U2, {"role": "assistant",
                           "content": "<think>\nLet me think: 2 + 3 = 5.\n</think>\n\nThe answer is 5."}]
    assert render_chat(tok, inline) == render_chat(tok, [U1, A1, U2, A2])


def test_agentic_turns_after_the_last_user_message_keep_their_reasoning(tok):
    call = {"role": "assistant", "content": "Calling the calculator.", "reasoning_content": "I need a tool."}
    tool = {"role": "tool", "content": "5"}
    ids, mask = render_chat(tok, [U2, call, tool, A2_PLAIN], thinking=False)
    assert trained_spans(tok, ids, mask) == [
        "<think>\nI need a tool.\n</think>\n\nCalling the calculator." + END, "The answer is 5." + END]


def test_reasoning_is_inlined_for_a_template_without_reasoning_content():
    bt = ByteTokenizer()
    ids, mask = render_chat(bt, [{"role": "user", "content": "q"}, A2])
    assert trained_spans(bt, ids, mask) == ["<think>\nLet me think: 2 + 3 = 5.\n</think>\n\nThe answer is 5.<|eos|>"]
    # byte tokenizer (no offsets): token-level prefixes, multi-turn
    ids, mask = render_chat(bt, [U1, A2_PLAIN, U2, {"role": "assistant", "content": "ok"}])
    assert trained_spans(bt, ids, mask) == ["The answer is 5.<|eos|>", "ok<|eos|>"]


def test_generation_block_templates_use_transformers_assistant_mask():
    template = ("{%- for m in messages -%}{%- if m.role == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}"
                "{% generation %}{{- m.content + '<|im_end|>' -}}{% endgeneration %}{{- '\\n' -}}"
                "{%- else -%}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}{%- endif -%}"
                "{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
    t = build_tokenizer(template)
    r = ChatRenderer(t)
    assert r.mode == "generation"
    msgs = [U1, A2_PLAIN, U2, {"role": "assistant", "content": "I am fine."}]
    ids, mask = r(msgs)
    assert trained_spans(t, ids, mask) == ["The answer is 5." + END, "I am fine." + END]
    r.mode = "offsets"  # the offsets method agrees
    assert r(msgs) == (ids, mask)


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _sharegpt(msgs):
    names = {"user": "human", "assistant": "gpt", "system": "system"}
    return {"conversations": [{"from": names[m["role"]], "value": m["content"]} for m in msgs]}


def test_sharegpt_and_messages_rows_give_the_same_tokens(tok, tmp_path):
    convs = [[SYSTEM, U1, A2_PLAIN], [U1, {"role": "assistant", "content": "I am fine."}, U2, A2_PLAIN]]
    a = read_chat_jsonl(_write(tmp_path / "m.jsonl", [{"messages": c} for c in convs]), tok, 64)
    b = read_chat_jsonl(_write(tmp_path / "s.jsonl", [_sharegpt(c) for c in convs]), tok, 64)
    assert len(a) == len(b) == 2
    for i in range(2):
        assert a.raw(i) == b.raw(i)
        assert a.raw(i) == render_chat(tok, convs[i])
    assert to_messages(_sharegpt([U1]), "x") == [{"role": "user", "content": U1["content"]}]


@pytest.mark.parametrize("row, match", [
    ({"messages": [U1]}, "no assistant turn"),
    ({"conversations": [{"from": "human", "value": "hi"}]}, "no assistant turn"),
    ({"prompt": "hi"}, "holds a prompt but no reply"),
    ({"oops": 1}, "unknown format"),
    ({"messages": []}, "non-empty list"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "role 'robot' is not one of"),
    ({"conversations": [{"from": "alien", "value": "x"}]}, "'from' 'alien' is not one of"),
    ({"messages": [U1, {"role": "assistant", "content": 5}]}, "message 1: content must be a string"),
    ("[1, 2]", "expected a JSON object"),
])
def test_bad_rows_are_refused_naming_file_and_line(tok, tmp_path, row, match):
    path = _write(tmp_path / "bad.jsonl", [{"messages": [U1, A2_PLAIN]}, row])
    with pytest.raises(InputError, match=match) as e:
        read_chat_jsonl(path, tok, 64)
    assert str(e.value).startswith(f"{path}:2: ")


def test_a_template_without_generation_prompt_is_refused(tmp_path):
    t = build_tokenizer(NO_GENERATION_PROMPT_TEMPLATE)
    path = _write(tmp_path / "c.jsonl", [{"messages": [U1, A2_PLAIN]}])
    with pytest.raises(InputError, match=f"{path}:1: .*ignores add_generation_prompt"):
        read_chat_jsonl(path, t, 64)
    t.chat_template = None
    with pytest.raises(InputError, match="has no chat template"):
        read_chat_jsonl(path, t, 64)


def test_a_conversation_the_template_refuses_names_the_row(tmp_path):
    from tests.chat_tokenizer import QWEN3_STYLE_TEMPLATE
    t = build_tokenizer("{%- if messages[0].role == 'system' -%}{{- raise_exception('no system role') -}}"
                        "{%- endif -%}" + QWEN3_STYLE_TEMPLATE)
    path = _write(tmp_path / "c.jsonl", [{"messages": [U1, A2_PLAIN]}, {"messages": [SYSTEM, U1, A2_PLAIN]}])
    with pytest.raises(InputError, match=f"^{path}:2: the chat template refused this conversation: .*no system role"):
        read_chat_jsonl(path, t, 64)


def test_saved_tokenizer_loads_and_renders_the_same(tok, tok_dir):
    loaded = load_tokenizer(tok_dir, required=True)
    msgs = [SYSTEM, U1, A1, U2, A2]
    assert render_chat(loaded, msgs) == render_chat(tok, msgs)
    assert chat.chat_to_tokens(loaded, msgs) == render_chat(tok, msgs)


# ---------------------------------------------------------------- data inspect
def _run(capsys, *argv):
    rc = cli.main(["data", "inspect", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_data_inspect_tokens_file(tmp_path, capsys):
    path = _write(tmp_path / "t.jsonl", [{"input_ids": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1]},
                                         {"input_ids": [5, 6], "loss_mask": [0, 0]},
                                         {"input_ids": list(range(10))}])
    out_json = tmp_path / "stats.json"
    rc, out, err = _run(capsys, path, "--rows", 2, "--max-length", 4, "--json", out_json)
    assert rc == 0, err
    info = json.loads(out_json.read_text())
    assert (info["format"], info["rows"], info["tokens"], info["trained_tokens"]) == ("tokens", 3, 16, 12)
    assert info["trained_share"] == 0.75
    assert info["rows_without_trained"] == 1 and info["first_without_trained"] == [f"{path}:2"]
    assert (info["rows_over_max_length"], info["trained_tokens_cut"]) == (1, 6)
    assert info["length"]["min"] == 2 and info["length"]["max"] == 10
    assert "1 2 «3 4»" in out and "tokens: 16  trained (loss_mask > 0): 12 (75.0%)" in out
    assert len(info["sample"]) == 2
    rc, _, err = _run(capsys, path, "--json", out_json)  # no overwrite without --force
    assert rc == 2 and "--force" in err


def test_data_inspect_chat_file(tok, tok_dir, tmp_path, capsys):
    convs = [[U2, A2_PLAIN], [U1, {"role": "assistant", "content": "I am fine."}, U2, A2]]
    path = _write(tmp_path / "c.jsonl", [{"messages": convs[0]}, _sharegpt(convs[1][:2])])
    rc, out, err = _run(capsys, path, "--tokenizer", tok_dir, "--no-thinking", "--json", tmp_path / "s.json")
    assert rc == 0, err
    info = json.loads((tmp_path / "s.json").read_text())
    rows = [render_chat(tok, convs[0], thinking=False), render_chat(tok, convs[1][:2], thinking=False)]
    assert info["format"] == "chat" and info["rows"] == 2
    assert info["tokens"] == sum(len(i) for i, _ in rows)
    assert info["trained_tokens"] == sum(int(sum(m)) for _, m in rows)
    assert "«The answer is 5.<|im_end|>»" in out and "«I am fine.<|im_end|>»" in out
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n«The answer" in out


def test_data_inspect_token_ids_with_a_target_without_tokenizer(tmp_path, capsys):
    """Token-id rows need no tokenizer: a --target that has none reads them (ids shown as numbers);
    chat rows with that target are one line naming the file."""
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 64}))
    path = _write(tmp_path / "t.jsonl", [{"input_ids": [7, 8, 9], "loss_mask": [0, 1, 1]}])
    rc, out, err = _run(capsys, path, "--target", target)
    assert rc == 0, err
    assert "7 «8 9»" in out and "trained (loss_mask > 0): 2" in out
    chat_path = _write(tmp_path / "c.jsonl", [{"messages": [U1, A1]}])
    rc, _, err = _run(capsys, chat_path, "--target", target)
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert f"{chat_path}: chat data needs a tokenizer" in err


@pytest.mark.parametrize("rows, extra, match", [
    (['{"messages": [{"role": "user", "content": "hi"}]}'], ["--tokenizer"], ":1: no assistant turn"),
    (['{"text": "hi"}'], [], ":1: a 'prompt' row holds a prompt but no reply"),
    (['{"messages": [}'], ["--tokenizer"], ":1: malformed JSONL line"),
    (['{"messages": [{"role": "user", "content": "hi"}]}'], [], "needs a tokenizer"),
    ([], [], "has no rows"),
])
def test_data_inspect_bad_input_is_one_line_exit_2(tok_dir, tmp_path, capsys, rows, extra, match):
    path = _write(tmp_path / "bad.jsonl", rows)
    extra = [x for a in extra for x in (["--tokenizer", tok_dir] if a == "--tokenizer" else [a])]
    rc, out, err = _run(capsys, path, *extra)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and match in err, err
    assert err.startswith("dspark-jax data inspect: error: ")


# ------------------------------------------------------------------- training
def _chat_rows(n):
    rows = []
    for k in range(n):
        msgs = [U2, {"role": "assistant", "content": f"The answer is {k}.", "reasoning_content": "add"}]
        rows.append({"messages": msgs} if k % 2 else _sharegpt([U2, A2_PLAIN]))
    return rows


def test_train_reads_chat_data_with_the_hf_tokenizer(tok, tok_dir, tmp_path):
    """load_source (what train reads) -> TokenSequences with the HF tokenizer's masks, then a
    one-step tiny run on it."""
    from dspark_jax.convert.checkpoint import load_target
    from dspark_jax.train.loop import load_source, train
    from tests.train_tiny import tiny_config

    data = _write(tmp_path / "chat.jsonl", _chat_rows(8))
    cfg = tiny_config(tmp_path / "run", data=str(data), data_format="chat", tokenizer=str(tok_dir),
                      chat_thinking=False, steps=1, max_length=48)
    tcfg, tparams = load_target(cfg.target)
    src = load_source(cfg, tcfg, cfg.draft_config(tcfg), tparams)
    assert len(src) == 8
    msgs = to_messages(_chat_rows(8)[1], "x")
    ids, mask = src.raw(1)
    assert (ids, mask) == render_chat(tok, msgs, thinking=False)
    assert trained_spans(tok, ids, mask) == ["<think>\nadd\n</think>\n\nThe answer is 1." + END]
    rec = src[1]
    assert rec["input_ids"].shape == (48,) and rec["loss_mask"].sum() == sum(mask)
    summary = train(cfg, fast_compile=True)
    assert summary["steps"] == 1 and len(summary["history"]) == 1
    import math
    assert math.isfinite(summary["final"]["loss"])
