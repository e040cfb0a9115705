"""Tiny random models of real architectures (llama, qwen3, gpt_oss) with a small local tokenizer.

Tests and quick checks run on these in milliseconds per op, offline: the weights are drawn from a
fixed seed, so every process on any machine with the same torch builds identical ones, and the
byte-level BPE tokenizer is learnt deterministically from a small built-in corpus (ChatML special
tokens, digits one per token).
"""

from __future__ import annotations

import pathlib
from collections import Counter

import torch

WINDOW = 4096  # the tiny llama's and qwen3's context window, unless their catalog entry names another
_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Merges are learnt from this small corpus so ordinary chat text and arithmetic take fewer tokens.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. You are a helpful assistant. The user asks a question
and the assistant gives the answer. What is the capital of France? The capital of France is Paris.
Please think step by step, then write the final answer. Let me think about this problem carefully.
This is a test of the model, and that is the result. In the beginning there was a small model that
learned to count, to add and to multiply numbers, then to answer questions with short sentences.
It is not what we want, so we should try again with another example; here is one more example.
system user assistant answer question reason reward correct wrong because therefore sum product
"""


def _arith_lines() -> str:
    ops = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b)]
    lines = []
    for i in range(60):
        a, b = (i * 37) % 100, (i * 53 + 11) % 100
        sym, fn = ops[i % 3]
        lines.append(f"What is {a} {sym} {b}? {a} {sym} {b} = {fn(a, b)}. The answer is {fn(a, b)}.")
    return "\n".join(lines)


def _byte_symbols() -> list[str]:
    # GPT-2's byte -> printable unicode map, in byte order, as the ByteLevel pre-tokenizer uses it.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def _learn_merges(words: Counter, n_merges: int) -> list[tuple[str, str]]:
    # A plain BPE learner: deterministic by construction (ties broken on the pair itself), unlike the
    # Rust trainer whose hash maps make tie order an implementation detail.
    seqs = {w: list(w) for w in words}
    merges: list[tuple[str, str]] = []
    for _ in range(n_merges):
        pairs: Counter = Counter()
        for w, f in words.items():
            s = seqs[w]
            for pair in zip(s, s[1:], strict=False):
                pairs[pair] += f
        if not pairs:
            break
        (a, b), count = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        if count < 2:
            break
        merges.append((a, b))
        for w, s in seqs.items():
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    return merges


def build_tiny_tokenizer(n_merges: int = 240, max_length: int = WINDOW):
    """A small byte-level BPE (lossless on any text, digits split one per token) with ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    words = Counter(
        piece
        for line in (_CORPUS + _arith_lines()).splitlines(True)
        for piece, _ in pre.pre_tokenize_str(line)
    )
    merges = _learn_merges(words, n_merges)
    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges))
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(_SPECIALS)
    specials = dict(bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|pad|>")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=max_length, **specials)
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _tiny_config(arch: str, tok, window: int):
    from transformers import GptOssConfig, LlamaConfig, Qwen3Config

    ids = {
        "vocab_size": len(tok),
        "bos_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
    }
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    common.update(head_dim=16, intermediate_size=128, tie_word_embeddings=False, **ids)
    if arch == "llama":
        return LlamaConfig(max_position_embeddings=window, **common)
    if arch == "qwen3":
        return Qwen3Config(max_position_embeddings=window, **common)
    if arch == "gpt_oss":
        # Keeps gpt-oss's own rope (yarn) and sliding/full layer alternation; only sizes shrink.
        return GptOssConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=32, **common)
    raise ValueError(f"no tiny recipe for arch {arch!r}")


def build_random(arch: str, out: pathlib.Path, window: int = WINDOW) -> None:
    """A tiny random model of architecture ``arch`` with the tiny tokenizer, saved into ``out``.

    ``window``: the context window of a llama or qwen3 (its ``max_position_embeddings`` and the
    tokenizer's ``model_max_length``); the weights do not depend on it, so a long-window tiny model
    computes what the 4,096-token one does on sequences both hold. gpt_oss keeps its own window."""
    from transformers import AutoModelForCausalLM

    window = window if arch in ("llama", "qwen3") else WINDOW
    tok = build_tiny_tokenizer(max_length=window)
    config = _tiny_config(arch, tok, window)
    # Seeded right before init so every process (any machine, same torch) builds identical weights.
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = [tok.eos_token_id, config.bos_token_id]
    model.save_pretrained(out)
    tok.save_pretrained(out)
