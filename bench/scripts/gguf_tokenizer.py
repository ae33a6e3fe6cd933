#!/usr/bin/env python3
"""Writes a GGUF model's tokenizer as Hugging Face files (tokenizer.json, tokenizer_config.json).
Used by: bench/scripts/install-llama.sh (for docs/results/real-engines.md)

A GGUF file carries its model's byte-level BPE (tokens, merges) and chat template, which is all
`kvbench sim --tokenizer DIR` needs to count a prompt's tokens as the real engine does: the
simulator's llama.cpp stand-in then sees the prompts a real llama-server sees, at the same size.

Only GPT-2 style byte-level BPE models (`tokenizer.ggml.model` = gpt2) are supported, with
SmolLM2's pre-tokenizer (digits split one by one, then GPT-2's regex); anything else is refused.

Usage: gguf_tokenizer.py MODEL.gguf OUT_DIR    (needs the `gguf` package from PyPI)
"""
import json
import os
import sys

import gguf


def field(reader, key):
    f = reader.fields.get(key)
    if f is None:
        return None
    if f.types[0] == gguf.GGUFValueType.ARRAY:
        if f.types[-1] == gguf.GGUFValueType.STRING:
            return [bytes(f.parts[i]).decode("utf-8") for i in f.data]
        return [int(f.parts[i][0]) for i in f.data]
    if f.types[0] == gguf.GGUFValueType.STRING:
        return bytes(f.parts[f.data[0]]).decode("utf-8")
    return f.parts[f.data[0]][0].item()


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    path, out = sys.argv[1], sys.argv[2]
    r = gguf.GGUFReader(path)
    model, pre = field(r, "tokenizer.ggml.model"), field(r, "tokenizer.ggml.pre")
    if model != "gpt2" or pre != "smollm":
        sys.exit(f"{path}: tokenizer {model}/{pre} is not supported (gpt2/smollm only)")
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = field(r, "tokenizer.ggml.merges")
    # llama.cpp's token types: 3 is a control token (<|im_start|> and the like).
    added = [
        {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i, (t, ty) in enumerate(zip(tokens, types)) if ty == 3
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Digits", "individual_digits": True},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                 "use_regex": True},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None,
            "continuing_subword_prefix": None, "end_of_word_suffix": None,
            "fuse_unk": False, "byte_fallback": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    config = {"chat_template": field(r, "tokenizer.chat_template"),
              "bos_token": tokens[field(r, "tokenizer.ggml.bos_token_id")],
              "eos_token": tokens[field(r, "tokenizer.ggml.eos_token_id")]}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
    print(f"{out}: {len(tokens)} tokens, {len(merges)} merges, {len(added)} control tokens")


if __name__ == "__main__":
    main()
