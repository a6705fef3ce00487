"""A small byte-level BPE tokenizer, trained locally on `corpus.CORPUS`, written as the files
`mlx_lm.load` and `transformers.AutoTokenizer` read (tokenizer.json, tokenizer_config.json,
special_tokens_map.json). Byte-level means every id in the vocabulary decodes, so greedy output
of a random model always detokenizes."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from .corpus import CORPUS
from .errors import SyntheticError

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Byte alphabet (256) plus the special tokens: the smallest vocabulary a byte-level BPE can have.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

# ChatML as Qwen models use it (system/user/assistant turns, generation prompt).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


@lru_cache(maxsize=8)
def tokenizer_json(vocab_size: int) -> str:
    """The tokenizer.json text for a vocabulary of exactly `vocab_size` ids: BPE merges learned
    from the corpus, topped up with `<|reserved_N|>` special tokens when the corpus runs out of
    merges (as Llama 3 and Qwen reserve ids)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    if vocab_size < MIN_VOCAB_SIZE:
        raise SyntheticError(
            f"vocab_size={vocab_size} is too small: a byte-level tokenizer needs at least "
            f"{MIN_VOCAB_SIZE} ids (256 bytes + {len(SPECIAL_TOKENS)} special tokens)."
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer)
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(missing)])
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise AssertionError("tokenizer vocabulary does not match the requested size")
    return tok.to_str()


def special_token_ids(vocab_size: int) -> dict[str, int]:
    data = json.loads(tokenizer_json(vocab_size))
    return {t["content"]: t["id"] for t in data["added_tokens"] if t["content"] in SPECIAL_TOKENS}


def write_tokenizer(out_dir: Path, vocab_size: int) -> dict[str, int]:
    """Write the tokenizer files into `out_dir`; return the special token ids."""
    text = tokenizer_json(vocab_size)
    (out_dir / "tokenizer.json").write_text(text, encoding="utf-8")
    ids = special_token_ids(vocab_size)
    added = {
        str(t["id"]): {
            "content": t["content"],
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in json.loads(text)["added_tokens"]
    }
    tokenizer_config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": IM_END,
        "errors": "replace",
        "model_max_length": 32768,
        "pad_token": ENDOFTEXT,
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }
    _write_json(out_dir / "tokenizer_config.json", tokenizer_config)
    _write_json(
        out_dir / "special_tokens_map.json",
        {
            "additional_special_tokens": [IM_START, IM_END],
            "eos_token": IM_END,
            "pad_token": ENDOFTEXT,
        },
    )
    return ids


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
