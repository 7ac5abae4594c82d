"""A real ``WhisperTokenizer`` built offline for a small (or a padded-out) vocabulary.

Byte-level BPE as Whisper's: the 256 byte symbols, merges that make each given
word (with and without its leading space) one token, optionally more merges up
to ``text_vocab_size`` text tokens; then Whisper's special tokens in Whisper's
order and the 1501 timestamp tokens ``<|0.00|>`` .. ``<|30.00|>``:

    <|endoftext|> <|startoftranscript|> <|en|> ... <|translate|> <|transcribe|>
    <|startoflm|> <|startofprev|> <|nospeech|> <|notimestamps|> <|0.00|> ...

Used by the demo Whisper checkpoint (``tools/train_demo_whisper.py``) and by
``benchmarks/whisper.py --save-model`` for its random checkpoints.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

CONTROL = ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
TIMESTAMPS = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]


def build_whisper_tokenizer(words, languages=("en",), text_vocab_size: int | None = None):
    """A ``transformers.WhisperTokenizer`` over ``words`` (see the module docstring).

    ``text_vocab_size``: pad the BPE vocabulary with letter n-gram merges to exactly
    this many text tokens (50257 for multilingual Whisper's layout), so every text
    id decodes to something. Special ids follow the text ids without a gap."""
    from transformers import AddedToken, WhisperTokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: i for i, ch in enumerate(bytes_to_unicode().values())}  # "Ġ" is the space
    merges: list[tuple[str, str]] = []

    def merge(left: str, right: str) -> None:
        if left + right not in vocab:
            merges.append((left, right))
            vocab[left + right] = len(vocab)

    for word in words:
        for spelled in ("Ġ" + word, word):
            for i in range(1, len(spelled)):
                merge(spelled[:i], spelled[i])
    if text_vocab_size is not None:
        if text_vocab_size < len(vocab):
            raise ValueError(f"text_vocab_size={text_vocab_size} is below the {len(vocab)} tokens the words need")
        frontier = ["Ġ", *string.ascii_lowercase]
        while len(vocab) < text_vocab_size:
            grown = []
            for left in frontier:
                for ch in string.ascii_lowercase:
                    if len(vocab) == text_vocab_size:
                        break
                    merge(left, ch)
                    grown.append(left + ch)
            frontier = grown
    specials = ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in languages), *CONTROL]
    tok = WhisperTokenizer(vocab=vocab, merges=merges, model_max_length=448, errors="replace")
    tok.add_tokens([AddedToken(t, special=True, normalized=False) for t in specials], special_tokens=True)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TIMESTAMPS])
    ids = tok.convert_tokens_to_ids(specials + TIMESTAMPS)
    if ids != list(range(len(vocab), len(vocab) + len(ids))) or tok.eos_token_id != ids[0]:
        raise AssertionError("Whisper's special tokens must follow the text vocabulary in order")
    return tok


def save_whisper_tokenizer(tok, out_dir: str | Path) -> None:
    """``tok.save_pretrained`` plus the classic ``special_tokens_map.json`` and the
    ``WhisperTokenizer`` class name, so transformers 4.x loads it too."""
    out_dir = Path(out_dir)
    tok.save_pretrained(out_dir)
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "WhisperTokenizer"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    specials = [t for t in tok.all_special_tokens if t != "<|endoftext|>"]
    special = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "unk_token": "<|endoftext|>",
               "pad_token": "<|endoftext|>", "additional_special_tokens": specials}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
