"""`dspark-jax eval` end to end on the embedded default target + a (random) drafter, and bad input."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from dspark_jax import cli
from dspark_jax.config import DraftConfig
from dspark_jax.convert.checkpoint import load_target, save_draft
from dspark_jax.data.eval_datasets import load_dataset
from dspark_jax.pipelines.demo import drafter_overrides, quick_config
from dspark_jax.draft import model as draft_model
from dspark_jax.embedded.default import default_target_dir
from dspark_jax.errors import InputError
from dspark_jax.pipelines.evaluate import evaluate
from dspark_jax.target import qwen3
from dspark_jax.tokenizer import encode_prompt

FIXTURE = Path(__file__).parent / "fixtures" / "dspark_qwen3_tiny"
MAX_NEW = quick_config().max_new_tokens  # the demo test's shapes: compiled rounds are shared


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    """A randomly initialised drafter for the default target, in the PyTorch format
    (same config as the quick demo's DSpark drafter)."""
    tdir = default_target_dir()
    tcfg, tparams = load_target(tdir)
    dcfg = DraftConfig.for_target(tcfg, **drafter_overrides(quick_config(), "dspark", tcfg))
    params = draft_model.init_params(dcfg, jax.random.PRNGKey(0), embed_tokens=tparams["embed_tokens"],
                                     lm_head=qwen3.lm_head_kernel(tparams))
    path = tmp_path_factory.mktemp("eval") / "draft"
    save_draft(path, dcfg, jax.tree.map(np.asarray, params))
    return tdir, path, dcfg


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Two datasets of held-out prompts, each holding the longest one (so both share shapes)."""
    held = load_dataset("stdlib-heldout", max_samples=3)
    longest = max(held, key=lambda p: len(p.text.encode()))
    others = [p for p in held if p is not longest]
    d = tmp_path_factory.mktemp("data")
    (d / "alpha.jsonl").write_text(json.dumps({"turns": [longest.text, "second turn ignored"]}) + "\n\n"
                                   + json.dumps({"turns": [others[0].text], "id": 7}) + "\n")
    (d / "beta_set.jsonl").write_text(json.dumps({"turns": [others[1].text]}) + "\n"
                                      + json.dumps({"turns": [longest.text]}) + "\n")
    return d


def test_eval_cli_end_to_end(drafter, data_dir, tmp_path, capsys):
    tdir, draft, dcfg = drafter
    out = tmp_path / "eval"
    rc = cli.main(["eval", "--target", str(tdir), "--draft", str(draft), "--datasets", "alpha,beta-set",
                   "--data-dir", str(data_dir), "--max-new-tokens", str(MAX_NEW), "--baseline",
                   "--out", str(out), "--no-progress"])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "alpha" in stdout and "beta-set" in stdout and "tau" in stdout and "ECE" in stdout
    report = json.loads((out / "eval.json").read_text())
    assert list(report["datasets"]) == ["alpha", "beta-set"]
    g = dcfg.block_size
    for name, s in report["datasets"].items():
        assert s["requests"] == 2
        assert 1.0 <= s["tau"] <= g + 1 and s["mean_proposal"] == g
        assert s["verify_rate"] == pytest.approx(s["tau"] / (g + 1))
        assert len(s["accept_rate"]) == len(s["conditional_accept"]) == g
        pp = s["calibration"]["per_position"]
        assert len(pp) == g and {"ece", "auroc", "brier"} <= set(pp[0])
        assert pp[0]["n"] == s["rounds"]  # position 1 is verified in every round
        assert s["speedup"] > 0 and s["autoregressive"]["output_tokens"] == s["output_tokens"]
        lines = (out / "results" / f"{name}.jsonl").read_text().splitlines()
        assert len(lines) == 2 and json.loads(lines[0])["dataset"] == name
        for png in (f"acceptance_{name}.png", f"reliability_{name}.png"):
            assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert json.loads((out / "results" / "alpha.jsonl").read_text().splitlines()[1])["line"] == 3
    assert any(p.name.startswith("events.out.tfevents") for p in (out / "tb").iterdir())
    assert report["config"]["thinking"] is False
    # an existing evaluation is not overwritten without --force
    with pytest.raises(InputError, match="--force"):
        evaluate(tdir, draft, "alpha", data_dir=data_dir, out=out, progress=False)


def test_unknown_dataset(drafter, capsys):
    tdir, draft, _ = drafter
    rc = cli.main(["eval", "--target", str(tdir), "--draft", str(draft), "--datasets", "stdlib-heldout,nope"])
    err = capsys.readouterr().err
    assert rc == 2 and "unknown dataset 'nope'" in err and "gsm8k" in err


def test_malformed_line_reports_line_number(drafter, tmp_path):
    tdir, draft, _ = drafter
    (tmp_path / "bad.jsonl").write_text('{"turns": ["ok"]}\n\n{"turns": ["x"\n')
    with pytest.raises(InputError, match=r"bad\.jsonl:3: malformed JSONL"):
        evaluate(tdir, draft, "bad", data_dir=tmp_path, progress=False)


def test_target_without_tokenizer(tmp_path, capsys):
    (tmp_path / "p.jsonl").write_text('{"turns": ["hello"]}\n')
    rc = cli.main(["eval", "--target", str(FIXTURE / "target"), "--draft", str(FIXTURE / "draft"),
                   "--datasets", "p", "--data-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "has no tokenizer" in err


def test_missing_draft_dir(tmp_path):
    with pytest.raises(InputError, match="--draft"):
        evaluate(default_target_dir(), tmp_path / "absent", "stdlib-heldout", progress=False)


def test_encode_prompt_chat_template_and_thinking_switch():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<u>", "<a>", "<think>", "hello", "world"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}<u> {{ m['content'] }} {% endfor %}"
                         "{% if add_generation_prompt %}<a>{% endif %}"
                         "{% if enable_thinking is defined and enable_thinking %} <think>{% endif %}")
    ids_off = encode_prompt(tok, "hello world")
    ids_on = encode_prompt(tok, "hello world", thinking=True)
    assert ids_off == [1, 4, 5, 2] and ids_on == [1, 4, 5, 2, 3]
    from dspark_jax.tokenizer import ByteTokenizer
    bt = ByteTokenizer()
    assert encode_prompt(bt, "hi", raw=True) == [bt.bos_token_id, ord("h"), ord("i")]
    assert encode_prompt(bt, "hi") == bt.chat_prompt("hi")  # chat format is the default
    assert encode_prompt(tok, "hello world", raw=True) == [4, 5]


class _Captured(Exception):
    pass


@pytest.mark.parametrize("raw", [False, True])
def test_generate_and_eval_encode_text_the_same(drafter, tmp_path, monkeypatch, raw):
    """The same {"text": ...} gives the same prompt ids in `generate` and `eval` (chat template by
    default, plain text with --raw-prompt). The decoders are replaced: nothing is compiled."""
    import dspark_jax.decode as decode

    tdir, draft, _ = drafter
    seen = {}

    def fake(name):
        def run(*args, **kwargs):
            seen[name] = [list(p) for p in next(a for a in args if isinstance(a, list))]
            raise _Captured
        return run

    monkeypatch.setattr(decode, "speculative_generate", fake("spec"))
    monkeypatch.setattr(decode, "autoregressive_generate", fake("ar"))
    text = "def parse(line):"
    (tmp_path / "p.jsonl").write_text(json.dumps({"text": text}) + "\n")
    (tmp_path / "ds.jsonl").write_text(json.dumps({"turns": [text]}) + "\n")
    flag = ["--raw-prompt"] if raw else []
    with pytest.raises(_Captured):
        cli.main(["generate", "--target", str(tdir), "--draft", str(draft), "--prompts",
                  str(tmp_path / "p.jsonl"), "--out", str(tmp_path / "o.jsonl")] + flag)
    generated = seen.pop("spec")
    with pytest.raises(_Captured):
        cli.main(["eval", "--target", str(tdir), "--draft", str(draft), "--datasets", "ds",
                  "--data-dir", str(tmp_path), "--no-progress"] + flag)
    evaluated = seen.pop("spec")
    assert generated[0] == evaluated[-1]
    from dspark_jax.tokenizer import load_tokenizer
    tok = load_tokenizer(tdir)
    expected = tok.encode(text, add_bos=True) if raw else tok.chat_prompt(text)
    assert generated[0] == expected


def _fake_decode(loop_marker: bytes):
    """A stand-in for ``timed_decode``: a space-and-underscore loop for prompts holding
    ``loop_marker``, varied text otherwise (no model run)."""
    from dspark_jax.decode import Result

    def fake(tcfg, tparams, prompts, *, draft_cfg=None, max_new_tokens=16, progress=None, **_):
        out = []
        for i, p in enumerate(prompts):
            if loop_marker in bytes(t for t in p if t < 256):
                ids = list(b" _" * (max_new_tokens // 2))
            else:
                ids = list(f"x{i} = compute({i}, y)\nz = x{i}"[:max_new_tokens].encode())
            out.append(Result(ids, [2] * (len(ids) // 2), [4] * (len(ids) // 2), [1] * (len(ids) // 2),
                              None, len(p), i, 0.01))
        if progress:
            progress(len(prompts))
        return out
    return fake


def test_eval_warns_and_counts_degenerate_outputs(drafter, tmp_path, monkeypatch):
    import dspark_jax.pipelines.evaluate as E

    tdir, draft, _ = drafter
    monkeypatch.setattr(E, "timed_decode", _fake_decode(b"LOOP"))
    (tmp_path / "loops.jsonl").write_text("".join(json.dumps({"turns": [f"LOOP {i}"]}) + "\n" for i in range(3)))
    (tmp_path / "fine.jsonl").write_text("".join(json.dumps({"turns": [f"def f{i}():"]}) + "\n" for i in range(4)))
    lines = []
    report = evaluate(tdir, draft, "loops,fine", data_dir=tmp_path, out=tmp_path / "out", progress=False,
                      printer=lines.append)
    deg = report["datasets"]["loops"]["degeneracy"]
    assert deg["num_degenerate"] == deg["num_outputs"] == 3 and deg["whitespace_fraction"] == pytest.approx(0.5)
    assert report["datasets"]["fine"]["degeneracy"]["num_degenerate"] == 0
    assert report["degenerate_outputs"] == {"num_degenerate": 3, "num_outputs": 7, "datasets_warned": ["loops"]}
    assert len(report["warnings"]) == 1 and report["warnings"][0].startswith("warning: loops: degenerate 3/3")
    text = "\n".join(lines)
    assert report["warnings"][0] in text and "warning: fine" not in text
    assert "degenerate outputs: 3/7" in text
    table = lines[0].splitlines()
    assert "degen" in table[0] and " ws" in table[0]
    assert "3/3" in next(r for r in table if r.startswith("loops")) and "0/4" in next(r for r in table if r.startswith("fine"))
    saved = json.loads((tmp_path / "out" / "eval.json").read_text())
    assert saved["degenerate_outputs"]["num_degenerate"] == 3 and saved["warnings"] == report["warnings"]


def test_default_datasets_of_the_embedded_target(drafter, tmp_path, monkeypatch, capsys):
    import dspark_jax.pipelines.evaluate as E

    tdir, draft, _ = drafter
    # the embedded target continues code; math word problems and chat prompts are not its defaults
    assert E.default_datasets(default_target_dir()) == ["stdlib-heldout"]
    assert not {"gsm8k", "math500", "mt-bench"} & set(E.EMBEDDED_DEFAULT_DATASETS)
    with pytest.raises(InputError, match="--datasets is required"):
        E.default_datasets(FIXTURE / "target")
    monkeypatch.setattr(E, "timed_decode", _fake_decode(b"LOOP"))
    assert cli.main(["eval", "--draft", str(draft), "--max-samples", "2", "--raw-prompt", "--no-progress",
                     "--out", str(tmp_path / "e")]) == 0
    assert list(json.loads((tmp_path / "e" / "eval.json").read_text())["datasets"]) == ["stdlib-heldout"]
    rc = cli.main(["eval", "--target", str(FIXTURE / "target"), "--draft", str(FIXTURE / "draft")])
    assert rc == 2 and "--datasets is required" in capsys.readouterr().err


def test_acceptance_plot_marks_degenerate_outputs_and_names_the_temperature(monkeypatch, tmp_path):
    """Loops inflate the acceptance curves: the label counts them and the curves without them are
    drawn dashed; the temperature is in the title; the legend is below the panels, off the data."""
    import matplotlib.pyplot as plt

    import dspark_jax.pipelines.evaluate as E

    figures = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: (figures.append(fig), close(fig)))
    prompts = [list(b"LOOP"), list(b"def a"), list(b"LOOP"), list(b"def b")]
    results = _fake_decode(b"LOOP")(None, None, prompts, max_new_tokens=24)
    summary = E.decode_summary(results, calibration=False)
    path = E.plot_acceptance({"dspark": summary}, tmp_path / "a.png", title="gsm8k", temperature=0.7,
                             results={"dspark": results})
    assert path.read_bytes()[:4] == b"\x89PNG"
    fig = figures[-1]
    assert fig._suptitle.get_text() == "gsm8k, temperature 0.7"
    (legend,) = fig.legends
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels[0].startswith("dspark (tau ") and "2/4 outputs degenerate" in labels[0]
    assert labels[1].startswith("dspark without the degenerate outputs") and "2 outputs" in labels[1]
    assert all(ax.get_legend() is None for ax in fig.axes)
    assert legend.get_window_extent().y1 <= min(ax.get_window_extent().y0 for ax in fig.axes)
