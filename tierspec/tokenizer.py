"""A tokenizer read straight from ``tokenizer.json`` with the ``tokenizers`` library.

Why: transformers' tokenizer classes import most of transformers (about a second on a small
CPU machine), and a short ``tierspec generate`` should start in well under that. This class
covers what tierspec uses of a tokenizer — encode (with or without special tokens, with
offsets), decode, the vocabulary, the special tokens and the chat template — for the folders
whose tokenizer *is* its ``tokenizer.json`` (``fits`` checks that; others load through
transformers). Tests pin it against transformers' tokenizer of the same folder.
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path

# tokenizer_config.json keys that do not change how text is encoded or decoded.
_NEUTRAL_KEYS = {
    "backend", "tokenizer_class", "is_local", "local_files_only", "model_max_length", "added_tokens_decoder",
    "bos_token", "eos_token", "pad_token", "unk_token", "sep_token", "cls_token", "mask_token",
    "chat_template", "clean_up_tokenization_spaces",
    "model_input_names", "padding_side", "truncation_side", "name_or_path", "errors", "vocab_size",
}
_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast", "GPT2Tokenizer", "GPT2TokenizerFast"}
_SPECIAL = ("bos_token", "eos_token", "pad_token", "unk_token")


def fits(folder: Path) -> str | None:
    """Why the tokenizer in ``folder`` needs transformers (None: this class reproduces it)."""
    if not (folder / "tokenizer.json").is_file():
        return "no tokenizer.json"
    try:
        config = json.loads((folder / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return "no readable tokenizer_config.json"
    if config.get("tokenizer_class") not in _CLASSES:
        return f"tokenizer class {config.get('tokenizer_class')!r}"
    extra = sorted(key for key in set(config) - _NEUTRAL_KEYS if config[key] not in (None, [], {}))
    if extra:
        return f"tokenizer_config.json sets {extra}"
    if config.get("clean_up_tokenization_spaces"):
        return "clean_up_tokenization_spaces"
    if config.get("chat_template") is not None and not isinstance(config["chat_template"], str):
        return "named chat templates"
    return None


_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's, which Llama 3, Qwen and SmolLM vocabularies spell their
    pieces in): the character each byte is written as → the byte. Printable Latin-1 bytes are
    themselves; the others are shifted to U+0100 and up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    alphabet, shifted = {}, 0
    for byte in range(256):
        if byte in kept:
            alphabet[chr(byte)] = byte
        else:
            alphabet[chr(256 + shifted)] = byte
            shifted += 1
    return alphabet


def token_bytes(tokenizer, token: int, text: str) -> bytes:
    """The bytes of ``token``, whose text decoded alone is ``text``: that text's UTF-8 where it
    decodes whole; a token that holds part of a character (decoded alone it shows U+FFFD) is
    spelled from its vocabulary piece — a byte-fallback piece ``<0xNN>`` (SentencePiece), or a
    byte-level BPE piece (``_byte_level_alphabet``). Why not the text: four tokens of one emoji would
    each report the replacement character's three bytes, and their bytes would not add up to the
    emoji's (OpenAI's ``bytes`` field is there to rebuild such characters)."""
    if "\ufffd" not in text:
        return text.encode("utf-8")
    piece = tokenizer.convert_ids_to_tokens(token)
    if isinstance(piece, str):
        fallback = _BYTE_FALLBACK.fullmatch(piece)
        if fallback:
            return bytes([int(fallback.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if piece and all(char in alphabet for char in piece):
            return bytes(alphabet[char] for char in piece)
    return text.encode("utf-8")  # a piece in neither spelling: its text is all there is


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class FastTokenizer:
    """The subset of transformers' tokenizer interface tierspec uses, over ``tokenizers``."""

    def __init__(self, folder: Path):
        from tokenizers import Tokenizer

        self.folder = Path(folder)
        self.backend = Tokenizer.from_file(str(self.folder / "tokenizer.json"))
        config = json.loads((self.folder / "tokenizer_config.json").read_text())
        template_file = self.folder / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.is_file() else config.get("chat_template")
        self.special_tokens = {name: _token_text(config.get(name)) for name in _SPECIAL}
        for name, text in self.special_tokens.items():
            setattr(self, name, text)
            setattr(self, f"{name}_id", None if text is None else self.backend.token_to_id(text))
        self._template = None

    # -- encoding and decoding ----------------------------------------------------------------
    def __call__(self, text: str, add_special_tokens: bool = True, return_offsets_mapping: bool = False,
                 split_special_tokens: bool = False) -> dict:
        """``split_special_tokens``: special-token strings in ``text`` are tokenised as text (as
        transformers' flag of that name does)."""
        backend = self._text_backend if split_special_tokens else self.backend
        encoding = backend.encode(text, add_special_tokens=add_special_tokens)
        result = {"input_ids": list(encoding.ids), "attention_mask": [1] * len(encoding.ids)}
        if return_offsets_mapping:
            result["offset_mapping"] = [tuple(span) for span in encoding.offsets]
        return result

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        if isinstance(ids, int):
            ids = [ids]
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @functools.cached_property
    def _text_backend(self):
        """A copy of the backend that matches no special token in the text it encodes."""
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(self.backend.to_str())
        backend.encode_special_tokens = True
        return backend

    @property
    def added_tokens_decoder(self) -> dict:
        """Id → ``tokenizers.AddedToken`` (``content``, ``special``) of the added tokens."""
        return self.backend.get_added_tokens_decoder()

    def get_vocab(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def convert_ids_to_tokens(self, token: int) -> str | None:
        """The vocabulary's piece of one id (as transformers' method of that name, for an int)."""
        return self.backend.id_to_token(int(token))

    def __len__(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # -- chat ---------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False, tokenize: bool = True,
                            **extra):
        """The chat rendered by the folder's template (Jinja, sandboxed, with the settings and
        helpers transformers gives templates); token ids unless ``tokenize=False``."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        values = {name: text for name, text in self.special_tokens.items() if text is not None}
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     **values, **extra)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _compile(source: str):
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(source)
