"""`data regenerate`: dataset formats, rows equal to the engine's own decode, determinism across
slots and meshes, SIGKILL + resume, refusals (templates without a generation prompt, existing
outputs, other-argument journals), top-p sampling, and `train` reading the output."""

import json
import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from scipy import stats as scipy_stats

from dspark_jax import sampling
from dspark_jax.commands import data_regenerate
from dspark_jax.convert.checkpoint import load_target
from dspark_jax.data.formats import read_conversations
from dspark_jax.data.sources import read_token_jsonl
from dspark_jax.decode import autoregressive_generate, engine
from dspark_jax.embedded.default import PACKAGED_DIR
from dspark_jax.errors import InputError
from dspark_jax.pipelines import regenerate as R
from dspark_jax.tokenizer import ByteTokenizer

warnings.filterwarnings("ignore", message="Some donated buffers were not usable")

ROOT = Path(__file__).resolve().parent.parent
TARGET = PACKAGED_DIR
MAX_NEW = 10
CHATS = [
    {"id": "a", "messages": [{"role": "system", "content": "be brief"},
                             {"role": "user", "content": "def f(x):"},
                             {"role": "assistant", "content": "    return x"},
                             {"role": "user", "content": "import os"},
                             {"role": "assistant", "content": "print(os.sep)"}]},
    {"id": "b", "messages": [{"role": "user", "content": "class A:"}]},
    {"messages": [{"role": "user", "content": "for i in range(3):"},
                  {"role": "assistant", "content": "    pass"}], "topic": "loops"},
    {"id": "d", "messages": [{"role": "user", "content": "x = ["},
                             {"role": "assistant", "content": "1, 2]"},
                             {"role": "user", "content": "y = {"}]},
]
SETTINGS = dict(turns="all", temperature=1.0, max_new_tokens=MAX_NEW, seed=7, progress=False,
                log=lambda s: None)


def _write(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("regen")
    _write(d / "chats.jsonl", CHATS)
    return d


@pytest.fixture(scope="module")
def reference_run(work):
    """The uninterrupted run (4 slots) every other run is compared with."""
    out = work / "ref.jsonl"
    summary = R.regenerate(TARGET, work / "chats.jsonl", out, slots=4, **SETTINGS)
    return out, summary


# ----------------------------------------------------------------------------- formats


def test_formats(tmp_path):
    sg = _write(tmp_path / "sg.jsonl", [
        {"id": 1, "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"},
                                    {"from": "gpt", "value": "a"}], "lang": "en"}])
    (c,) = read_conversations(sg)
    assert c.format == "sharegpt" and c.id == 1 and c.extra == {"lang": "en"}
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant"]
    assert c.generation_points() == [2] and c.where == f"{sg}:1"
    ds = _write(tmp_path / "ds.jsonl", [{"conversations": [{"role": "user", "content": "q"}]}])
    assert read_conversations(ds)[0].format == "deepspec"
    assert read_conversations(ds)[0].generation_points() == [1]
    ms = _write(tmp_path / "ms.jsonl", CHATS)
    convs = read_conversations(ms)
    assert [c.generation_points() for c in convs] == [[2, 4], [1], [1], [1, 3]]
    tu = _write(tmp_path / "tu.jsonl", [{"turns": ["first", "second"]}])
    assert read_conversations(tu)[0].messages == [{"role": "user", "content": "first"}]
    pr = _write(tmp_path / "pr.jsonl", [{"prompt": "p", "system": "s"}, {"text": "t"},
                                       {"question": "q", "answer": "42"}])
    convs = read_conversations(pr)
    assert [c.messages[-1]["content"] for c in convs] == ["p", "t", "q"]
    assert convs[0].messages[0] == {"role": "system", "content": "s"}
    assert convs[2].extra == {"answer": "42"}


@pytest.mark.parametrize("rows,fmt,match", [
    ([{"messages": [{"role": "user", "content": "q"}]}, {"prompt": "p"}], "auto",
     r"b\.jsonl:2: this row is in the prompt format but the file's first row \(.*b\.jsonl:1\) is messages"),
    ([{"prompt": "p"}, {"foo": 1}], "auto", r"b\.jsonl:2: unknown format"),
    (['{"prompt": "p"}', "{not json"], "auto", r"b\.jsonl:2: malformed JSONL"),
    ([{"messages": [{"role": "assistant", "content": "a"}]}], "auto",
     r"b\.jsonl:1: the conversation has no user message"),
    ([{"messages": [{"role": "system", "content": "s"}]}], "auto", r"b\.jsonl:1: .*no user message"),
    ([{"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "q"}]}],
     "auto", r"b\.jsonl:1: message 0 is an assistant message before any user message"),
    ([{"prompt": "p"}, {"messages": [{"role": "robot", "content": "q"}]}], "messages",
     r"b\.jsonl:1: this row is in the prompt format but --format is messages"),
    ([{"messages": [{"role": "robot", "content": "q"}]}], "auto", r"b\.jsonl:1: message 0: role 'robot'"),
    ([{"conversations": [{"from": "alien", "value": "q"}]}], "auto", r"b\.jsonl:1: message 0: 'from' 'alien'"),
    ([{"messages": [{"role": "user", "content": ["q"]}]}], "auto", r"b\.jsonl:1: message 0: content must be a string"),
    ([], "auto", "holds no rows"),
])
def test_format_errors_name_the_row(tmp_path, rows, fmt, match):
    path = _write(tmp_path / "b.jsonl", rows)
    with pytest.raises(InputError, match=match):
        read_conversations(path, fmt=fmt)


# ----------------------------------------------------------------------------- regeneration


def test_rows_equal_the_engine_and_train_reads_them(work, reference_run):
    out, summary = reference_run
    rows = _rows(out)
    tok = ByteTokenizer.load(TARGET)
    convs = read_conversations(work / "chats.jsonl")
    reqs = R.build_requests(convs, tok, turns="all", raw=False, thinking=False)
    assert [(r["id"], r["turn"]) for r in rows] == [("a", 0), ("a", 1), ("b", 0), (2, 0), ("d", 0), ("d", 1)]
    tc, tp = load_target(TARGET)
    res = engine.serve(tc, tp, None, None, [r.prompt_ids for r in reqs], max_new_tokens=MAX_NEW,
                       temperature=1.0, slots=3, stop_token_ids=[tok.eos_token_id],
                       request_keys=R.request_keys(7, range(len(reqs))))
    for row, req, r in zip(rows, reqs, res):
        n = row["prompt_tokens"]
        assert row["input_ids"][:n] == req.prompt_ids == tok.apply_chat_template(req.history)
        assert row["input_ids"][n:] == r.output_ids, row["id"]
        assert row["loss_mask"] == [0] * n + [1] * len(r.output_ids)
        assert row["generated_tokens"] == len(r.output_ids)
        assert row["finish_reason"] == ("stop" if r.output_ids[-1] == tok.eos_token_id else "length")
        # the REAL history, then the regenerated reply
        assert row["messages"][:-1] == req.history
        assert row["messages"][-1]["role"] == "assistant"
    assert rows[1]["messages"][:-1] == CHATS[0]["messages"][:4]  # turn 1 sees the real turn 0
    assert rows[3]["extra"] == {"topic": "loops"} and rows[3]["source"].endswith("chats.jsonl:3")
    assert summary["rows"] == 6 and summary["generated_tokens"] == sum(len(r.output_ids) for r in res)
    assert summary["truncations"] == summary["finish_reasons"].get("length", 0)
    assert sum(summary["finish_reasons"].values()) == 6 and summary["tokens_per_second"] > 0
    assert json.loads(Path(str(out) + ".summary.json").read_text()) == summary
    assert not Path(str(out) + ".partial").exists() and not Path(str(out) + ".partial.meta.json").exists()
    data = read_token_jsonl(out, max_length=512, vocab_size=tc.vocab_size)
    assert len(data) == 6
    ids, mask = data.raw(0)
    assert list(ids) == rows[0]["input_ids"] and list(mask) == rows[0]["loss_mask"]


def test_greedy_raw_prompts_equal_autoregressive_generate(tmp_path, capsys):
    data = _write(tmp_path / "p.jsonl", [{"text": "import sys\n"}, {"prompt": "def main():\n"},
                                        {"question": "class Foo(object):\n"}])
    out = tmp_path / "o.jsonl"
    assert data_regenerate.main(["--target", str(TARGET), "--data", str(data), "--out", str(out),
                                 "--raw-prompt", "--temperature", "0", "--max-new-tokens",
                                 str(MAX_NEW), "--slots", "2", "--no-progress"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["rows"] == 3 and printed["temperature"] == 0.0 and printed["stop_token_ids"] == [258]
    tok = ByteTokenizer.load(TARGET)
    prompts = [tok.encode(t, add_bos=True) for t in ("import sys\n", "def main():\n", "class Foo(object):\n")]
    tc, tp = load_target(TARGET)
    ref = autoregressive_generate(tc, tp, prompts, max_new_tokens=MAX_NEW, batch_size=3,
                                  stop_token_ids=[tok.eos_token_id])
    for row, p, r in zip(_rows(out), prompts, ref):
        assert row["input_ids"] == p + r.output_ids
        assert row["messages"][-1]["content"] == tok.decode(
            r.output_ids[:-1] if row["finish_reason"] == "stop" else r.output_ids, skip_special_tokens=True)


def test_deterministic_across_slots_and_mesh(work, reference_run):
    out, _ = reference_run
    other = work / "slots2.jsonl"
    R.regenerate(TARGET, work / "chats.jsonl", other, slots=2, mesh="data=2", **SETTINGS)
    assert _rows(other) == _rows(out)


def test_sigkill_mid_run_then_resume(work, reference_run):
    out, _ = reference_run
    killed = work / "killed.jsonl"
    script = (
        "import os, signal\n"
        "from dspark_jax.pipelines import regenerate as R\n"
        "def after(n):\n"
        "    if n == 2:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        f"R.regenerate({str(TARGET)!r}, {str(work / 'chats.jsonl')!r}, {str(killed)!r}, slots=1, "
        f"turns='all', temperature=1.0, max_new_tokens={MAX_NEW}, seed=7, progress=False, "
        "after_row=after)\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True,
                          timeout=600)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    journal = Path(str(killed) + ".partial")
    assert not killed.exists() and len(journal.read_text().splitlines()) == 2
    with journal.open("a") as f:  # a write the kill cut short
        f.write('{"index": 4, "row": {"id": "d", "tu')
    logs = []
    summary = R.regenerate(TARGET, work / "chats.jsonl", killed, slots=3,
                           **dict(SETTINGS, log=logs.append))
    assert any("resuming" in line and "2 of 6" in line for line in logs)
    assert summary["resumed_rows"] == 2 and summary["rows"] == 6
    assert _rows(killed) == _rows(out)
    assert not journal.exists()


def test_refusals_before_loading(work, reference_run, tmp_path):
    out, _ = reference_run
    before = out.read_bytes()
    with pytest.raises(InputError, match="finished run.*--force"):
        R.regenerate(TARGET, work / "chats.jsonl", out, **SETTINGS)
    assert out.read_bytes() == before
    # a journal written with other arguments: refused without --force, untouched
    fresh = tmp_path / "fresh.jsonl"

    class Stop(Exception):
        pass

    def stop(n):
        raise Stop

    with pytest.raises(Stop):
        R.regenerate(TARGET, work / "chats.jsonl", fresh, slots=2, after_row=stop, **SETTINGS)
    journal = Path(str(fresh) + ".partial")
    lines = journal.read_text()
    assert len(lines.splitlines()) == 1 and not fresh.exists()
    with pytest.raises(InputError, match=r"other arguments \(differs in: .*temperature"):
        R.regenerate(TARGET, work / "chats.jsonl", fresh, **dict(SETTINGS, temperature=0.5))
    assert journal.read_text() == lines
    with pytest.raises(InputError, match="top_p=0.9 .* drop --draft or pass --top-p 1"):
        R.regenerate(TARGET, work / "chats.jsonl", tmp_path / "x.jsonl", top_p=0.9,
                     draft=ROOT / "tests/fixtures/dspark_qwen3_tiny/draft", **SETTINGS)
    with pytest.raises(InputError, match=r"chats\.jsonl:1: --raw-prompt uses one user message"):
        R.regenerate(TARGET, work / "chats.jsonl", tmp_path / "x.jsonl", raw_prompt=True, **SETTINGS)
    with pytest.raises(InputError, match="--data .* does not exist"):
        R.regenerate(TARGET, tmp_path / "missing.jsonl", tmp_path / "x.jsonl", **SETTINGS)
    assert data_regenerate.main(["--target", str(TARGET), "--data", str(work / "chats.jsonl"),
                                 "--out", str(out)]) == 2


def _hf_target(tmp_path: Path, template: str) -> Path:
    """A target directory: the embedded weights with a Hugging Face WordLevel tokenizer (264
    ids, so every id the model emits decodes) and ``template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "[UNK]"]
    words = ["user", "assistant", "system"] + [f"w{i}" for i in range(264 - 3 - len(specials))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", unk_token="[UNK]")
    hf.chat_template = template
    d = tmp_path / "hf_target"
    hf.save_pretrained(str(d))
    for name in ("config.json", "model.safetensors"):
        os.symlink(TARGET / name, d / name)
    return d


QWEN_LIKE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> "
             "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant "
             "{% if not enable_thinking %}<think> </think> {% endif %}{% endif %}")


def test_hugging_face_template_and_thinking(tmp_path):
    target = _hf_target(tmp_path, QWEN_LIKE)
    data = _write(tmp_path / "sg.jsonl", [
        {"conversations": [{"from": "human", "value": "w1 w2"}, {"from": "gpt", "value": "w3"}]},
        {"conversations": [{"from": "human", "value": "w4"}]}])
    rows = {}
    for thinking in (False, True):
        out = tmp_path / f"t{thinking}.jsonl"
        R.regenerate(target, data, out, thinking=thinking, stop_token_ids=[1], **dict(SETTINGS, turns="last"))
        rows[thinking] = _rows(out)
    start, think, unthink, assistant = 0, 2, 3, 6
    p = rows[False][0]["input_ids"][:rows[False][0]["prompt_tokens"]]
    assert p[-4:] == [start, assistant, think, unthink]  # "<|im_start|> assistant <think> </think>"
    p = rows[True][1]["input_ids"][:rows[True][1]["prompt_tokens"]]
    assert p[-2:] == [start, assistant] and think not in p
    for r in rows[False] + rows[True]:
        assert r["loss_mask"][r["prompt_tokens"]:] == [1] * r["generated_tokens"]


def test_template_without_generation_prompt_is_refused(tmp_path):
    target = _hf_target(tmp_path, "{% for m in messages %}<|im_start|> {{ m['role'] }} "
                                  "{{ m['content'] }} <|im_end|> {% endfor %}")
    data = _write(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "w1"}]}])
    with pytest.raises(InputError, match=r"m\.jsonl:1: the target's chat template renders the same "
                                         r"tokens with and without add_generation_prompt"):
        R.regenerate(target, data, tmp_path / "o.jsonl", **SETTINGS)
    assert not (tmp_path / "o.jsonl").exists() and not (tmp_path / "o.jsonl.partial").exists()


def test_sampling_defaults_from_the_generation_config(tmp_path):
    d = tmp_path / "t"
    d.mkdir()
    (d / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "eos_token_id": [7, 3]}))
    assert R.resolve_sampling(d, None) == R.Sampling(0.6, 0.95, R.DEFAULT_MAX_NEW_TOKENS, [3, 7])
    assert R.resolve_sampling(d, None, temperature=1.0, top_p=1.0, max_new_tokens=5,
                              stop_token_ids=[]) == R.Sampling(1.0, 1.0, 5, [])
    (d / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.6,
                                                          "max_new_tokens": 9}))
    assert R.resolve_sampling(d, None) == R.Sampling(0.0, 1.0, 9, [])
    (d / "generation_config.json").unlink()
    assert R.resolve_sampling(d, None) == R.Sampling(R.DEFAULT_TEMPERATURE, 1.0,
                                                     R.DEFAULT_MAX_NEW_TOKENS, [])
    with pytest.raises(InputError, match="--top-p must be in"):
        R.resolve_sampling(d, None, top_p=0.0)


# ----------------------------------------------------------------------------- top-p


def test_top_p_filter_keeps_the_nucleus_and_samples_it():
    logits = np.log(np.asarray([0.5, 0.25, 0.15, 0.07, 0.03], np.float32))
    kept = np.isfinite(np.asarray(sampling.top_p_filter(jax.numpy.asarray(logits), 0.8)))
    assert kept.tolist() == [True, True, True, False, False]  # 0.5 + 0.25 < 0.8 <= 0.9
    assert np.isfinite(np.asarray(sampling.top_p_filter(jax.numpy.asarray(logits), 0.3))).sum() == 1
    assert sampling.top_p_filter(jax.numpy.asarray(logits), 1.0) is not None
    n = 20000
    keys = jax.random.split(jax.random.PRNGKey(0), n)
    draws = np.asarray(jax.vmap(lambda k: sampling.sample_logits(k, jax.numpy.asarray(logits), 1.0,
                                                                 False, 0.8))(keys))
    counts = np.bincount(draws, minlength=5)
    assert counts[3:].sum() == 0
    expected = np.asarray([0.5, 0.25, 0.15]) / 0.9 * n
    assert scipy_stats.chisquare(counts[:3], expected).pvalue > 1e-3


def test_top_p_in_the_engine_changes_only_when_below_one():
    tc, tp = load_target(TARGET)
    prompts = [[257, 105, 109], [257, 100, 101, 102]]
    keys = R.request_keys(1, range(2))
    base = engine.serve(tc, tp, None, None, prompts, max_new_tokens=MAX_NEW, temperature=1.0,
                        slots=2, request_keys=keys)
    same = engine.serve(tc, tp, None, None, prompts, max_new_tokens=MAX_NEW, temperature=1.0,
                        slots=2, request_keys=keys, top_p=1.0)
    assert [r.output_ids for r in base] == [r.output_ids for r in same]
    tiny = engine.serve(tc, tp, None, None, prompts, max_new_tokens=MAX_NEW, temperature=1.0,
                        slots=2, request_keys=keys, top_p=1e-6)  # nucleus = the argmax: greedy
    greedy = engine.serve(tc, tp, None, None, prompts, max_new_tokens=MAX_NEW, temperature=0.0, slots=2)
    assert [r.output_ids for r in tiny] == [r.output_ids for r in greedy]


# ----------------------------------------------------------------------------- speculative


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory, tiny_dir):
    """The tiny fixture target (vocab 512) with a byte tokenizer covering all 512 ids."""
    d = tmp_path_factory.mktemp("tiny_target")
    for f in (tiny_dir / "target").iterdir():
        os.symlink(f, d / f.name)
    extra = tuple(f"<|x{i}|>" for i in range(512 - 264))
    ByteTokenizer(ByteTokenizer().special_tokens + extra).save(d)
    return d, tiny_dir / "draft"


def test_speculative_regeneration_is_lossless_and_deterministic(tmp_path, tiny_with_tokenizer):
    target, draft = tiny_with_tokenizer
    data = _write(tmp_path / "p.jsonl", [{"text": "ab"}, {"text": "hello"}, {"text": "xyz1"}])
    run = dict(raw_prompt=True, max_new_tokens=MAX_NEW, seed=3, progress=False, log=lambda s: None)
    R.regenerate(target, data, tmp_path / "ar.jsonl", temperature=0.0, slots=2, **run)
    R.regenerate(target, data, tmp_path / "sd.jsonl", temperature=0.0, slots=2, draft=draft, **run)
    assert _rows(tmp_path / "sd.jsonl") == _rows(tmp_path / "ar.jsonl")  # greedy: lossless
    R.regenerate(target, data, tmp_path / "s2.jsonl", temperature=1.0, slots=2, draft=draft, **run)
    R.regenerate(target, data, tmp_path / "s3.jsonl", temperature=1.0, slots=3, draft=draft, **run)
    assert _rows(tmp_path / "s2.jsonl") == _rows(tmp_path / "s3.jsonl")
    summary = json.loads((tmp_path / "s3.jsonl.summary.json").read_text())
    assert summary["mode"] == "speculative" and summary["rows"] == 3
