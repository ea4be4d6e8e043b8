"""The default model's card as the tools write it: train_default_model.py's evaluation (default_eval.write_card,
which names a fine-tune's base training) and mtp_acceptance.py's speculative-decoding section, which replaces
its own section, keeps the rest and sits before the EVAL-RATES marker the tests read."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))

import default_eval  # noqa: E402
import mtp_acceptance  # noqa: E402

SHIPPED = os.path.join(ROOT, "deepinfer_jax", "assets", "default-model")
ROWS = [dict(k=1, mean_acceptance_length=1.5, accepted_fraction=0.5, per_position=[0.5]),
        dict(k=2, mean_acceptance_length=2.25, accepted_fraction=0.625, per_position=[0.75, 0.5])]


def _model_dir(tmp_path, base: dict | None) -> str:
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(open(os.path.join(SHIPPED, "config.json")).read())
    log = dict(base=base, steps=7, seed=3, device_batch=8, tokens_per_step=2048, lr=1e-3, conversations=900,
               params=5_000_000, device="cpu", train_seconds=11, total_seconds=20,
               curve=[dict(step=6, main=0.25, mtp=0.5)])
    (d / "train_log.json").write_text(json.dumps(log))
    return str(d)


def test_card_names_a_fine_tunes_base_and_keeps_the_rates(tmp_path):
    base = dict(steps=8012, tokens_per_step=32768, conversations=300000, seed=0, train_seconds=300, device="H100")
    d = _model_dir(tmp_path, base)
    rates = {k: 0.5 for k in default_eval.SKILLS}
    card = str(tmp_path / "README.md")
    default_eval.write_card(card, d, {"n": 4, "rates": rates})
    text = open(card).read()
    at_base = text.index("- from 8012 steps of 32768 tokens (300000 conversations, seed 0, 300 s on H100), then fine-tuned:")
    assert at_base < text.index("- 7 steps of 2048 tokens, seed 3, 900 conversations")
    assert default_eval.read_eval(card) == {"n": 4, "rates": rates}


def test_mtp_section_replaces_its_own_and_keeps_the_rest(tmp_path):
    d = _model_dir(tmp_path, None)
    card = str(tmp_path / "README.md")
    default_eval.write_card(card, d, {"n": 4, "rates": {k: 1.0 for k in default_eval.SKILLS}})
    before = open(card).read()
    assert "fine-tuned" not in before and mtp_acceptance.SECTION not in before
    mtp_acceptance.write_section(card, ROWS, 3, 96)
    once = open(card).read()
    assert once.index("## Evaluation") < once.index(mtp_acceptance.SECTION) < once.index("<!-- EVAL-RATES")
    assert "| 2 | 2.25 | 0.62 | 0.75, 0.50 |" in once and "--n 3 --ks 1,2" in once
    mtp_acceptance.write_section(card, ROWS[:1], 5, 64)  # measured again: one section, the new figures
    twice = open(card).read()
    assert twice.count(mtp_acceptance.SECTION) == 1 and "| 2 | 2.25" not in twice and "--n 5 --ks 1`" in twice
    assert twice.replace(twice[twice.index(mtp_acceptance.SECTION):twice.index("<!-- EVAL-RATES")], "") == before
    assert default_eval.read_eval(card)["n"] == 4


def test_shipped_card_has_its_mtp_section():
    text = open(os.path.join(SHIPPED, "README.md")).read()
    assert text.count(mtp_acceptance.SECTION) == 1
    assert text.index(mtp_acceptance.SECTION) < text.index("<!-- EVAL-RATES")
