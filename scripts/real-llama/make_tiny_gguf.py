#!/usr/bin/env python3
"""Write a tiny, deterministic, random-weight LLaMA-architecture GGUF model.

The file is meant only as a *real* model for llama.cpp / llama-cpp-python so
that an OpenAI-compatible server can be started without downloading anything.
Its output is gibberish made of English words, but it goes through the whole
real stack (tokenizer, chat template, transformer forward pass, sampler).

Design:
  * architecture "llama": 2 blocks, n_embd 64, 4 heads (head dim 16), FFN 128,
    context 512, all tensors F32 (~0.5 MB in total);
  * a SentencePiece-style ("llama") vocab: <unk> <s> </s>, the 256 byte
    tokens <0x00>..<0xFF>, "▁", printable ASCII characters, and every prefix
    of "▁" + word for a list of common English words (so that the SPM
    tokenizer can merge its way up to whole words);
  * a tiny Jinja chat template ("<|role|>\\ncontent\\n ... <|assistant|>\\n");
  * a "bias" trick: residual dimension 0 is a constant (token embeddings put a
    constant there and no block writes to it), so column 0 of output.weight
    acts as a per-token logit bias.  It is used to make whole words likely,
    and byte tokens, <unk>, <s> (and by default </s>) practically impossible,
    so the generated text is printable ASCII words and generation runs until
    max_tokens / a stop string (finish_reason "length"/"stop") unless
    --eos-bias is raised.

Usage:  python make_tiny_gguf.py [--out tiny.gguf] [--seed 1234] [--eos-bias -30]
Needs the `gguf` and `numpy` packages (pip install gguf). build.sh beside it runs it from a
small venv holding them (the project's own venv does not need them); the same arguments
always write the same bytes.
"""

from __future__ import annotations

import argparse
import string
import sys

import gguf
import numpy as np

WORDS = """
the of and to in is it you that he was for on are with as his they be at one
have this from or had by hot word but what some we can out other were all there
when up use your how said an each she which do their time if will way about many
then them write would like so these her long make thing see him two has look more
day could go come did number sound no most people my over know water than call
first who may down side been now find any new work part take get place made live
where after back little only round man year came show every good me give our under
name very through just form sentence great think say help low line differ turn
cause much mean before move right boy old too same tell does set three want air
well also play small end put home read hand port large spell add even land here
must big high such follow act why ask men change went light kind off need house
picture try us again animal point mother world near build self earth father
hello proxy stream token model server test chunk request reply answer
""".split()  # noqa: SIM905 - a word list reads best as text

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

SPACE = "\u2581"  # SentencePiece's "▁"

# GGUF token types (gguf.TokenType): NORMAL=1 UNKNOWN=2 CONTROL=3 BYTE=6
T_NORMAL, T_UNKNOWN, T_CONTROL, T_BYTE = 1, 2, 3, 6


def build_vocab():
    """Return (tokens, scores, types, kinds) where kinds tags each token for the bias."""
    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    kinds: list[str] = []
    seen: set[str] = set()

    def add(tok: str, score: float, ttype: int, kind: str) -> None:
        if tok in seen:
            return
        seen.add(tok)
        tokens.append(tok)
        scores.append(score)
        types.append(ttype)
        kinds.append(kind)

    add("<unk>", 0.0, T_UNKNOWN, "unk")  # id 0
    add("<s>", 0.0, T_CONTROL, "bos")  # id 1
    add("</s>", 0.0, T_CONTROL, "eos")  # id 2
    for b in range(256):  # ids 3..258
        add(f"<0x{b:02X}>", 0.0, T_BYTE, "byte")
    # single characters (SPM merges start from characters)
    add(SPACE, -1000.0, T_NORMAL, "char")
    for ch in string.ascii_letters + string.digits + string.punctuation:
        kind = "punct" if ch in ".,!?" else "char"
        add(ch, -1000.0, T_NORMAL, kind)
    # every prefix of "▁word" of length >= 2; longer pieces score higher so
    # the SPM bigram merge climbs up to whole words
    words = sorted(set(WORDS))
    whole = {SPACE + w for w in words}
    for w in words:
        piece = SPACE + w
        for n in range(2, len(piece) + 1):
            p = piece[:n]
            add(p, -1000.0 + 10.0 * n, T_NORMAL, "word" if p in whole else "prefix")
    # (a piece shared by several words is added once; its score depends only
    # on its length, so the "longer is better" order still holds)
    return tokens, scores, types, kinds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="tiny.gguf", help="output path (default: tiny.gguf)")
    ap.add_argument("--seed", type=int, default=1234, help="RNG seed (default: 1234)")
    ap.add_argument("--n-embd", type=int, default=64)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--n-head-kv", type=int, default=4)
    ap.add_argument("--n-layer", type=int, default=2)
    ap.add_argument("--n-ff", type=int, default=128)
    ap.add_argument("--n-ctx", type=int, default=512, help="llama.context_length (default: 512)")
    ap.add_argument(
        "--eos-bias",
        type=float,
        default=-30.0,
        help="logit bias of </s> (default -30: the model never stops by itself, every "
        "reply runs to max_tokens or a stop string; measured with 64-token chat "
        "replies at temperature 0.8: 3 -> ~30%% end with finish_reason 'stop', "
        "6 -> all stop, mean ~16 tokens)",
    )
    args = ap.parse_args(argv)

    n_embd, n_head, n_head_kv, n_layer, n_ff = (
        args.n_embd,
        args.n_head,
        args.n_head_kv,
        args.n_layer,
        args.n_ff,
    )
    if n_embd % n_head or n_head % n_head_kv:
        ap.error("n_embd must be divisible by n_head, and n_head by n_head_kv")
    head_dim = n_embd // n_head

    tokens, scores, types, kinds = build_vocab()
    n_vocab = len(tokens)
    rng = np.random.default_rng(args.seed)

    def normal(shape, std):
        return (rng.standard_normal(shape) * std).astype(np.float32)

    # numpy shapes are the reverse of ggml's ne[]: a ggml {n_embd, n_vocab}
    # tensor is a numpy (n_vocab, n_embd) array.
    C0 = 3.0  # constant in residual dimension 0 (the "bias" channel)
    tensors: dict[str, np.ndarray] = {}
    emb = normal((n_vocab, n_embd), 1.0)
    emb[:, 0] = C0
    tensors["token_embd.weight"] = emb

    for i in range(n_layer):
        p = f"blk.{i}."
        tensors[p + "attn_norm.weight"] = np.ones(n_embd, dtype=np.float32)
        tensors[p + "attn_q.weight"] = normal((n_head * head_dim, n_embd), n_embd**-0.5)
        tensors[p + "attn_k.weight"] = normal((n_head_kv * head_dim, n_embd), n_embd**-0.5)
        tensors[p + "attn_v.weight"] = normal((n_head_kv * head_dim, n_embd), n_embd**-0.5)
        wo = normal((n_embd, n_head * head_dim), 0.5 * (n_head * head_dim) ** -0.5)
        wo[0, :] = 0.0  # never write into the bias channel
        tensors[p + "attn_output.weight"] = wo
        tensors[p + "ffn_norm.weight"] = np.ones(n_embd, dtype=np.float32)
        tensors[p + "ffn_gate.weight"] = normal((n_ff, n_embd), n_embd**-0.5)
        down = normal((n_embd, n_ff), 0.5 * n_ff**-0.5)
        down[0, :] = 0.0  # never write into the bias channel
        tensors[p + "ffn_down.weight"] = down
        tensors[p + "ffn_up.weight"] = normal((n_ff, n_embd), n_embd**-0.5)

    tensors["output_norm.weight"] = np.ones(n_embd, dtype=np.float32)
    out = normal((n_vocab, n_embd), 0.4)
    # After the final RMS norm, dimension 0 is roughly 2.4, so column 0 of
    # output.weight adds ~2.4 * value to each token's logit.
    bias_of_kind = {
        "word": 1.0,
        "punct": -0.3,
        "prefix": -1.5,
        "char": -2.5,
        "byte": -30.0,
        "unk": -30.0,
        "bos": -30.0,
    }
    out[:, 0] = [bias_of_kind.get(k, 0.0) for k in kinds]
    out[kinds.index("eos"), 0] = args.eos_bias / 2.4
    tensors["output.weight"] = out

    w = gguf.GGUFWriter(args.out, "llama")
    w.add_name("tiny-random-llama")
    w.add_description(
        "Random-weight test model; output is gibberish. Generated by make_tiny_gguf.py"
    )
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_vocab_size(n_vocab)
    w.add_context_length(args.n_ctx)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)

    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_unk_token_id(0)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    for name, arr in tensors.items():
        w.add_tensor(name, np.ascontiguousarray(arr))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    n_params = sum(a.size for a in tensors.values())
    print(
        f"wrote {args.out}: vocab={n_vocab} layers={n_layer} n_embd={n_embd} "
        f"params={n_params} seed={args.seed}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
