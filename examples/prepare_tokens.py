"""Turn text files into token files for ``run.py --data`` / ``--eval-data``.

    python examples/prepare_tokens.py corpus.txt [more.txt ...] -o data/ [--val-fraction 0.1]
        [--tokenizer NAME] [--shard-size TOKENS [--name NAME]]

The last ``--val-fraction`` of the tokens is held out for validation. Tokens are the text's UTF-8 bytes
(vocabulary 256, what ``examples/gpt.py`` embeds) unless ``--tokenizer`` names a Hugging Face tokenizer (needs
``transformers``).

- Without ``--shard-size``: ``data/train.bin`` and ``data/val.bin`` in nanoGPT's format (flat uint16), or
  ``train.npy``/``val.npy`` of int32 when an id does not fit in 16 bits.
- With ``--shard-size N``: shards of at most N tokens in llm.c's format, as llm.c and modded-nanoGPT write
  FineWeb: ``data/NAME_val_000000.bin``, ``data/NAME_train_000000.bin``, ``..._000001.bin``, ... (NAME: the first
  text file's name, or ``--name``). Each is 256 int32 of header (magic 20240520, version 1, token count) and
  uint16 tokens, or magic 20240801, version 7 and uint32 tokens when the vocabulary exceeds 65,536 (Llama 3).
  Train on ``--data 'data/NAME_train_*.bin' --eval-data 'data/NAME_val_*.bin'``.
"""
import argparse
import os

import numpy as np

LLMC = {False: (20240520, 1, np.uint16), True: (20240801, 7, np.uint32)}  # wide -> magic, version, dtype


def tokenize(text: str, tokenizer):
    if tokenizer is None:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)
    return np.asarray(tokenizer(text)["input_ids"], dtype=np.int64)


def write_shard(path: str, tokens: np.ndarray, wide: bool) -> None:
    """One llm.c shard, written under a temporary name and renamed: a reader never sees half of it."""
    magic, version, dtype = LLMC[wide]
    header = np.zeros(256, dtype=np.int32)
    header[:3] = (magic, version, len(tokens))
    with open(path + ".tmp", "wb") as handle:
        handle.write(header.tobytes())
        handle.write(np.ascontiguousarray(tokens, dtype=dtype).tobytes())
    os.replace(path + ".tmp", path)


def write_shards(folder: str, name: str, split: str, tokens: np.ndarray, size: int, wide: bool) -> list:
    paths = []
    for index, begin in enumerate(range(0, max(len(tokens), 1), size)):
        path = os.path.join(folder, f"{name}_{split}_{index:06d}.bin")
        write_shard(path, tokens[begin:begin + size], wide)
        paths.append(path)
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("texts", nargs="+", help="UTF-8 text files, concatenated in this order")
    parser.add_argument("-o", "--out", required=True, help="folder for the token files")
    parser.add_argument("--val-fraction", type=float, default=0.1, help="share held out for validation (0.1)")
    parser.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer name (default: UTF-8 bytes)")
    parser.add_argument("--shard-size", type=int, default=None, metavar="TOKENS",
                        help="write llm.c-format shards of at most TOKENS tokens (default: train.bin and val.bin)")
    parser.add_argument("--name", default=None, help="with --shard-size: the shards' name (default: the first "
                                                     "text file's name)")
    args = parser.parse_args(argv)
    if args.shard_size is not None and not 0 < args.shard_size < 1 << 31:
        parser.error(f"--shard-size {args.shard_size}: llm.c's header counts tokens in an int32, use 1 .. 2^31-1")
    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    text = "".join(open(path, encoding="utf-8").read() for path in args.texts)
    tokens = tokenize(text, tokenizer)
    split = int(len(tokens) * (1 - args.val_fraction))
    os.makedirs(args.out, exist_ok=True)
    if args.shard_size is not None:
        vocab = len(tokenizer) if tokenizer is not None else 256
        wide = vocab > 1 << 16 or (tokens.size and int(tokens.max()) >= 1 << 16)
        name = args.name or os.path.splitext(os.path.basename(args.texts[0]))[0]
        for part, values in (("val", tokens[split:]), ("train", tokens[:split])):
            paths = write_shards(args.out, name, part, values, args.shard_size, wide)
            print(f"{os.path.join(args.out, f'{name}_{part}_*.bin')}: {len(values):,} tokens in {len(paths)} "
                  f"shard(s) ({'uint32' if wide else 'uint16'}, llm.c's format)")
        return
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
