"""A tiny chat target for tests of the real-model path: the tiny synthetic target's
weights with a character-level tokenizer and a chat template, so ``prepare`` and
``evaluate`` run as they do on SmolLM2, in seconds."""

from __future__ import annotations

import shutil
import string
from pathlib import Path

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|pad|>", "<|im_start|>", "<|im_end|>", "<|unused|>"]


def tiny_chat_target(target_dir: Path, out: Path, template: str = TEMPLATE) -> Path:
    """``target_dir``'s model plus a char-level tokenizer (ids below the target's 256)."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if (out / "tokenizer.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in target_dir.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    chars = sorted(set(string.printable) - set("\x0b\x0c\r"))
    vocab = {t: i for i, t in enumerate(SPECIALS + ["<unk>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|pad|>",
                                   eos_token="<|im_end|>", additional_special_tokens=SPECIALS[1:])
    fast.chat_template = template
    fast.save_pretrained(out)
    return out
