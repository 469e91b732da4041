"""STS calibration (per-position temperatures): held-out ECE drops, AUROC kept; metrics; logs; CLI."""

import json

import numpy as np
import pytest

from dspark_jax.pipelines import calibrate as C
from dspark_jax.errors import InputError

TRUE_T = np.array([2.0, 1.6, 2.5, 0.8])  # reported logits are (over/under)confident by these factors


def synthetic_rounds(n, seed, block=4):
    """Rounds from a known model: acceptance of position k given the prefix has probability
    sigmoid(z_k / TRUE_T[k]); the drafter reports z_k. Proposals vary; unverified positions
    get logits but no label."""
    rng = np.random.default_rng(seed)
    z = rng.normal(1.5, 2.0, size=(n, block))
    q = C.sigmoid(z / np.resize(TRUE_T, block))
    succ = rng.random((n, block)) < q
    proposal = rng.choice(np.arange(1, block + 1), size=n)
    proposal = np.where(rng.random(n) < 0.6, block, proposal)
    run = np.cumprod(succ, axis=1).sum(axis=1)
    accepted = np.minimum(run, proposal)
    return C.Rounds(z, accepted, proposal)


def test_sts_lowers_heldout_ece_and_keeps_auroc():
    fit, held = synthetic_rounds(6000, 0), synthetic_rounds(3000, 1)
    temps = C.fit_sts(fit)
    assert temps[0] == pytest.approx(TRUE_T[0], rel=0.25)
    before = C.position_metrics(held)
    after = C.position_metrics(held, temps)
    for b, a in zip(before, after):
        assert b["n"] == a["n"] > 100
        assert a["ece"] < b["ece"] - 0.01, (b, a)
        assert a["ece"] < 0.04
        assert a["brier"] <= b["brier"] + 1e-9
        assert a["cond_auroc"] == pytest.approx(b["cond_auroc"], abs=1e-12)  # order-preserving
        assert abs(a["auroc"] - b["auroc"]) < 0.02
    assert before[0]["auroc"] == pytest.approx(after[0]["auroc"], abs=1e-12)
    assert C.summary(after)["ece"] < 0.5 * C.summary(before)["ece"]


def test_unverified_positions_are_ignored():
    r = synthetic_rounds(2000, 2)
    temps = C.fit_sts(r)
    # scrambling the logits of positions that were never verified changes nothing
    z = r.logits.copy()
    unver = ~r.verified()
    z[unver] = np.random.default_rng(3).normal(0, 50, size=unver.sum())
    r2 = C.Rounds(z, r.accepted, r.proposal)
    np.testing.assert_array_equal(C.fit_sts(r2), temps)
    m1, m2 = C.position_metrics(r, temps), C.position_metrics(r2, temps)
    assert [m["n"] for m in m1] == [int(r.verified()[:, k].sum()) for k in range(4)]
    for a, b in zip(m1, m2):
        assert a["ece"] == pytest.approx(b["ece"]) and a["auroc"] == pytest.approx(b["auroc"])


def test_metric_values():
    assert C.auroc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert C.auroc([0.5, 0.5], [0, 1]) == pytest.approx(0.5)
    assert np.isnan(C.auroc([0.1, 0.2], [1, 1]))
    assert C.brier([1.0, 0.0, 0.5], [1, 1, 0]) == pytest.approx((0 + 1 + 0.25) / 3)
    # two bins: [0.2,0.2] vs labels [0,1] -> |0.4-1|; [0.9] vs [1] -> 0.1; over 3 samples
    assert C.ece([0.2, 0.2, 0.9], [0, 1, 1], n_bins=2) == pytest.approx((0.6 + 0.1) / 3)


def test_logs_roundtrip_and_errors(tmp_path):
    path = tmp_path / "decode.jsonl"
    lines = [{"confidence_logits": [1.0, 0.5, -1.0], "accepted": 1, "proposal": 3},
             {"rounds": [{"confidences": [0.9, 0.5, 0.2], "num_accepted": 0, "proposal_length": 2}]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    r = C.load_decode_logs(path)
    assert r.logits.shape == (2, 3) and list(r.accepted) == [1, 0] and list(r.proposal) == [3, 2]
    np.testing.assert_allclose(C.sigmoid(r.logits[1]), [0.9, 0.5, 0.2], rtol=1e-6)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"confidence_logits": [1.0, 2.0], "accepted": 3, "proposal": 2}) + "\n")
    with pytest.raises(InputError, match="accepted"):
        C.load_decode_logs(bad)
    bad.write_text(json.dumps({"accepted": 0, "proposal": 0}) + "\n")
    with pytest.raises(InputError, match=r"bad\.jsonl:1:"):
        C.load_decode_logs(bad)


def test_calibrate_command(tmp_path):
    from dspark_jax.cli import main

    r = synthetic_rounds(1500, 4)
    logs = tmp_path / "decode.jsonl"
    with logs.open("w") as f:
        for z, a, p in zip(r.logits, r.accepted, r.proposal):
            f.write(json.dumps({"confidence_logits": z.tolist(), "accepted": int(a), "proposal": int(p)}) + "\n")
    out = tmp_path / "sts"
    assert main(["calibrate", "--logs", str(logs), "--out", str(out)]) == 0
    report = json.loads((out / "sts.json").read_text())
    assert len(report["temperatures"]) == 4
    assert report["heldout"]["after"]["summary"]["ece"] < report["heldout"]["before"]["summary"]["ece"]
    assert (out / "reliability.png").stat().st_size > 1000
    assert main(["calibrate", "--logs", str(logs), "--out", str(out)]) == 2  # no overwrite without --force


def test_calibrate_writes_draft_with_extras(tmp_path, tiny_dir):
    from dspark_jax.cli import main
    from dspark_jax.convert import checkpoint, formats

    r = synthetic_rounds(800, 5, block=7)
    logs = tmp_path / "decode.jsonl"
    rec = {"confidence_logits": r.logits.tolist(), "accepted_drafts": r.accepted.tolist(),
           "proposal_lengths": r.proposal.tolist(), "output_ids": []}
    logs.write_text(json.dumps(rec) + "\n")  # one generate-style request record
    out = tmp_path / "sts"
    assert main(["calibrate", "--logs", str(logs), "--out", str(out), "--draft",
                 str(tiny_dir / "draft"), "--write-draft"]) == 0
    temps = json.loads((out / "sts.json").read_text())["temperatures"]
    assert formats.read_extras(out / "draft")["sts_temperatures"] == temps
    cfg, _ = checkpoint.load_draft(out / "draft")
    assert cfg.block_size == 7 and len(temps) == 7


def test_reliability_plot_says_held_out_or_in_sample(tmp_path):
    many, few = synthetic_rounds(400, 6), synthetic_rounds(30, 7)
    info = C.reliability_plot(many, tmp_path / "held.png", title="drafter")
    assert info["sts"] == "held out"
    assert "held-out rounds" in info["title"] and info["title"].startswith("drafter: 200 ")
    labels = info["legend"]
    assert any(lab.startswith("STS held out (fit on 200 other rounds)") for lab in labels)
    assert any(lab.startswith("raw ECE") for lab in labels)
    assert "rounds per bin (raw, right axis)" in labels and "perfect calibration" in labels
    assert "rounds per bin (STS, right axis)" in labels
    assert f"hollow: bin of < {C.MIN_BIN_ROUNDS} rounds (not joined)" in labels
    assert info["histogram"] == "rounds per bin (raw)"
    assert (tmp_path / "held.png").read_bytes()[:4] == b"\x89PNG"
    info = C.reliability_plot(few, tmp_path / "few.png")
    assert info["sts"] == "in-sample" and any(lab.startswith("STS in-sample") for lab in info["legend"])


def test_calibrate_command_labels_its_plot(tmp_path):
    from dspark_jax.cli import main

    r = synthetic_rounds(600, 8)
    logs = tmp_path / "decode.jsonl"
    with logs.open("w") as f:
        for z, a, p in zip(r.logits, r.accepted, r.proposal):
            f.write(json.dumps({"confidence_logits": z.tolist(), "accepted": int(a), "proposal": int(p)}) + "\n")
    assert main(["calibrate", "--logs", str(logs), "--out", str(tmp_path / "a")]) == 0
    plot = json.loads((tmp_path / "a" / "sts.json").read_text())["reliability_plot"]
    assert plot["sts"] == "held out" and any(lab.startswith("STS held out") for lab in plot["legend"])
    assert "held-out rounds" in plot["title"]
