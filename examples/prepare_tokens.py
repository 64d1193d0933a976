"""Turn text files into token files for ``run.py --data`` / ``--eval-data`` (nanoGPT's format: flat uint16).

    python examples/prepare_tokens.py corpus.txt [more.txt ...] -o data/ [--val-fraction 0.1]
        [--tokenizer NAME]

Writes ``data/train.bin`` and ``data/val.bin`` (the last ``--val-fraction`` of the tokens, held out). Tokens
are the text's UTF-8 bytes (vocabulary 256, what ``examples/gpt.py`` embeds) unless ``--tokenizer`` names a
Hugging Face tokenizer (needs ``transformers``; its vocabulary must be below 65,536 for uint16, else an
``.npy`` of int32 is written).
"""
import argparse
import os

import numpy as np


def tokenize(text: str, tokenizer):
    if tokenizer is None:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return np.asarray(tokenizer(text)["input_ids"], dtype=np.int64)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", nargs="+", help="UTF-8 text files, concatenated in this order")
    parser.add_argument("-o", "--out", required=True, help="folder for train.bin and val.bin")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share held out for validation (0.1)")
    parser.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer name (default: UTF-8 bytes)")
    args = parser.parse_args(argv)
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    text = "".join(open(path, encoding="utf-8").read() for path in args.texts)
    tokens = tokenize(text, tokenizer)
    split = int(len(tokens) * (1 - args.val_fraction))
    os.makedirs(args.out, exist_ok=True)
    wide = tokens.size and int(tokens.max()) >= 1 << 16
    for name, part in (("train", tokens[:split]), ("val", tokens[split:])):
        path = os.path.join(args.out, f"{name}.npy" if wide else f"{name}.bin")
        if wide:
            np.save(path, part.astype(np.int32))
        else:
            part.astype(np.uint16).tofile(path)
        print(f"{path}: {len(part):,} tokens")


if __name__ == "__main__":
    main()
