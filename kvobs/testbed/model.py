"""Build a tiny random-weight Llama, entirely offline, for the real P/D testbed.

The tokenizer is byte level with *no merges*: every byte is exactly one token, so any
ASCII text re-tokenizes to the same ids. Combined with ``allowed_token_ids`` (see
:func:`safe_token_ids`) the model's random output survives the round trip
text -> chat template -> token ids unchanged, which keeps D's retained KV a true prefix of
the next turn's prompt (DESIGN.md section 6).
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

# Printable ASCII letters and digits only: no whitespace (a chat template or a client may
# strip it) and no punctuation that could collide with the template's markers.
_SAFE_CHARS = string.ascii_letters + string.digits

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
VOCAB_SIZE = 320  # 256 bytes + 3 specials, padded

CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_MARKER = ".kvobs_tiny_model_ok"


def _byte_vocab() -> dict[str, int]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())  # the 256 printable stand-ins for bytes
    assert len(alphabet) == 256
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for j, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = 256 + j
    return vocab


def _build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = _byte_vocab()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=4096,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    path: str | os.PathLike,
    *,
    hidden_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    seed: int = 0,
) -> tuple[Path, list[int]]:
    """Create (once) a tiny random Llama + byte tokenizer under ``path``.

    Returns ``(path, safe_token_ids)``. Idempotent: if the marker file exists, only the
    safe token ids are recomputed from the saved tokenizer.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    path = Path(path)
    if (path / _MARKER).exists():
        return path, safe_token_ids(path)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path.mkdir(parents=True, exist_ok=True)
    tok = _build_tokenizer()
    cfg = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    # Older/newer transformers differ on where the template lands; make sure it is in
    # tokenizer_config.json, which is what vLLM reads.
    tc_path = path / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    if not tc.get("chat_template"):
        tc["chat_template"] = CHAT_TEMPLATE
        tc_path.write_text(json.dumps(tc, indent=2))
    ids = safe_token_ids(path)
    (path / _MARKER).write_text(json.dumps({"safe_token_ids": ids}))
    return path, ids


def safe_token_ids(path: str | os.PathLike | None = None) -> list[int]:
    """Token ids that decode to one ASCII letter/digit and re-tokenize to themselves."""
    vocab = _byte_vocab()
    from tokenizers.pre_tokenizers import ByteLevel  # noqa: F401  (same alphabet)

    # For ASCII letters/digits the ByteLevel stand-in is the character itself.
    ids = sorted(vocab[ch] for ch in _SAFE_CHARS)
    if path is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path))
        for i in ids:
            text = tok.decode([i])
            assert tok.encode(text, add_special_tokens=False) == [i], (i, text)
    return ids


if __name__ == "__main__":  # pragma: no cover
    import sys

    p, ids = build_tiny_model(sys.argv[1] if len(sys.argv) > 1 else ".testbed/tiny-llama")
    print(p, len(ids))
