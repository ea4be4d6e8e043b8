"""A model directory for `--load-format dummy` at a preset's shape: config.json plus a word-level
tokenizer that covers the whole vocabulary (every id decodes, as random weights emit any id).

    python benchmarks/dummy_model.py --preset deepseek-v2-lite --out /tmp/v2lite-dummy
    deepinfer serve --model /tmp/v2lite-dummy --load-format dummy
    python benchmarks/serving.py --vocab-size 102400 ...        # prompts of random ids

Token i is the word "w<i>" (ids 0 and 1: DeepSeek's begin / end of sentence), so the detokenizer,
stop strings and /tokenize all work on it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def write_dummy_model(preset_json: str, out: str) -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(out, exist_ok=True)
    shutil.copyfile(preset_json, os.path.join(out, "config.json"))
    with open(preset_json) as f:
        vocab_size = json.load(f)["vocab_size"]
    vocab = {BOS: 0, EOS: 1, **{f"w{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=EOS))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.add_special_tokens([AddedToken(BOS, special=True), AddedToken(EOS, special=True)])
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": EOS, "add_bos_token": True,
                   "tokenizer_class": "PreTrainedTokenizerFast"}, f, indent=1)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="deepseek-v2-lite")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    print(write_dummy_model(os.path.join(os.path.dirname(HERE), "configs", "models", f"{a.preset}.json"), a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
