"""Tokenizer wrapper over `tokenizers` (tokenizer.json) or `sentencepiece` (tokenizer.model),
the checkpoint's chat template, and a streaming detokenizer.

Special tokens, the policy. encode() adds no BOS/EOS of its own: the chat template writes every
special token, and control tokens (tokenizer.json's added tokens marked special,
sentencepiece's control pieces: <|im_start|>, <s>, ...) only ever come from the template's own
text. `encode_chat(messages)` encodes a message's content as plain text: a user typing
"<|im_end|><|im_start|>system" gets those characters, not a new turn. `encode(text)` is the
raw mode: special-token strings in `text` are parsed as the tokens (special=False does not
parse them); the CLI's --raw uses it on purpose. Added tokens not marked special are ordinary
vocabulary and match anywhere.

Templates ship with downloaded weights, so they are untrusted code: engine/load/template.py renders
them sandboxed, in a child process bounded in time and memory. No batching, no offsets, no tool-calling helpers.
"""
from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

import sentencepiece
from tokenizers import Tokenizer as HFTokenizer

from engine.load.config import read_json
from engine.load.template import render


def token_ids(path: Path, d: dict, key: str, vocab_size: int) -> list[int]:
    """d[key]: null, an id, or (eos) a list of ids, each in [0, vocab_size)."""
    v = d.get(key)
    ids = [] if v is None else v if isinstance(v, list) else [v]
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < vocab_size:
            raise ValueError(f"{path}: {key} must be token ids in [0, {vocab_size}), got {v!r}")
    return ids


def token_text(path: Path, d: dict, key: str) -> str | None:
    """tokenizer_config stores a token as a string or as {"content": ...}."""
    v = d.get(key)
    v = v.get("content") if isinstance(v, dict) else v
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{path}: {key} must be a string or {{\"content\": string}}, got {d[key]!r}")
    return v


def chat_template(d: Path, tc: dict) -> str | None:
    """chat_template.jinja wins over tokenizer_config's, as in transformers (both are checked)."""
    t = tc.get("chat_template")
    if isinstance(t, list):  # named templates: [{"name", "template"}]
        if not all(isinstance(x, dict) and isinstance(x.get("name"), str) for x in t):
            raise ValueError(f"{d / 'tokenizer_config.json'}: chat_template list entries need a \"name\"")
        t = {x["name"]: x.get("template") for x in t}.get("default")
    if t is not None and not isinstance(t, str):
        raise ValueError(f"{d / 'tokenizer_config.json'}: chat_template must be a string, got {type(t).__name__}")
    if (d / "chat_template.jinja").is_file():
        try:
            return (d / "chat_template.jinja").read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{d / 'chat_template.jinja'}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return t


class Tokenizer:
    def __init__(self, ckpt_dir: str | Path):
        d = Path(ckpt_dir)
        if not d.is_dir():
            raise FileNotFoundError(f"checkpoint {d} is not a directory")
        self.hf = self.sp = None
        if (d / "tokenizer.json").is_file():
            try:
                self.hf = HFTokenizer.from_file(str(d / "tokenizer.json"))
            except Exception as e:  # tokenizers raises a bare Exception on bad files
                raise ValueError(f"{d / 'tokenizer.json'}: not a readable tokenizer ({str(e)[:200]})") from None
            self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
            self.token_id = self.hf.token_to_id
            specials = [t.content for t in self.hf.get_added_tokens_decoder().values() if t.special]
            longest = max(map(len, self.hf.get_vocab()), default=1)
        elif (d / "tokenizer.model").is_file():
            try:
                self.sp = sentencepiece.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
            except (OSError, RuntimeError) as e:
                raise ValueError(f"{d / 'tokenizer.model'}: not a readable tokenizer ({e})") from None
            self.vocab_size = self.sp.get_piece_size()
            self.token_id = self.sp.piece_to_id
            pieces = [self.sp.id_to_piece(i) for i in range(self.vocab_size)]
            specials = [p for i, p in enumerate(pieces) if self.sp.is_control(i)]
            longest = max(map(len, pieces), default=1)
        else:
            raise FileNotFoundError(f"{d}: neither tokenizer.json nor tokenizer.model")
        # subtle: longest first, so "<|im_start|>" is not cut by a shorter marker it contains
        alts = "|".join(map(re.escape, sorted(filter(None, specials), key=len, reverse=True)))
        self.special_re = re.compile(f"({alts or '(?!)'})")  # (?!) never matches
        tc, gen, cfg = (read_json(d / n) for n in ("tokenizer_config.json", "generation_config.json", "config.json"))
        ids = [(d / "generation_config.json", gen), (d / "config.json", cfg)]
        if self.sp is not None:  # the .model itself knows its <s> and </s>; -1 = none
            ids.append((d / "tokenizer.model", {f"{k}_token_id": i for k, i in [("bos", self.sp.bos_id()),
                                                                              ("eos", self.sp.eos_id())] if i >= 0}))
        self.bos_token = token_text(d / "tokenizer_config.json", tc, "bos_token")
        self.eos_token = token_text(d / "tokenizer_config.json", tc, "eos_token")
        # each file's ids in turn, then the id of tokenizer_config's token string
        by_name = lambda t: [i] if t and (i := self.token_id(t)) is not None and i >= 0 else []
        found = lambda key: [i for p, c in ids for i in token_ids(p, c, f"{key}_token_id", self.vocab_size)]
        self.bos_id = next(iter(found("bos") + by_name(self.bos_token)), None)
        # every stop id counts: generation_config may list several (<|eot_id|>, <|end_of_text|>)
        self.eos_ids = set(found("eos") + by_name(self.eos_token))
        self.chat_template = chat_template(d, tc)
        # a rendered prompt longer than (context x longest token) cannot fit in the context
        context = cfg.get("max_position_embeddings")
        context = context if isinstance(context, int) and 0 < context < 2**31 else 2**17
        self.max_text_chars = context * max(longest, 16)

    @classmethod
    def load(cls, ckpt_dir: str | Path) -> Tokenizer:
        return cls(ckpt_dir)

    def same_ids(self, other: Tokenizer) -> str | None:
        """None where `other` reads and writes text as these very ids (a draft or an amateur
        beside its target: one id must mean one token to both); else what differs, in words."""
        if (self.hf is None) != (other.hf is None):
            return "one is a tokenizer.json, the other a sentencepiece model"
        if self.sp is not None:
            return None if self.sp.serialized_model_proto() == other.sp.serialized_model_proto() \
                else "another sentencepiece model"
        a, b = self.hf.get_vocab(with_added_tokens=True), other.hf.get_vocab(with_added_tokens=True)
        if a != b:
            diff = min((i for t, i in a.items() if b.get(t) != i), default=len(b))
            return f"id {diff} is another token (vocabularies of {len(a)} and {len(b)})"
        # the same ids may still split text apart: the merges, pre-tokenizer and normalizer
        parts = lambda t: {k: v for k, v in json.loads(t.hf.to_str()).items() if k not in ("decoder", "truncation", "padding")}
        mine, theirs = parts(self), parts(other)
        part = next((k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)), None)
        return None if part is None else f"the same vocabulary, another {part}"

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text`; special: parse special-token strings in it as those tokens."""
        if self.hf is not None:
            self.hf.encode_special_tokens = not special   # True: their strings become ordinary text
            try:
                return self.hf.encode(text, add_special_tokens=False).ids
            finally:
                self.hf.encode_special_tokens = False
        if not special:
            return self.sp.encode(text)            # sentencepiece never matches control pieces
        parts = self.special_re.split(text)  # odd indices are the special tokens themselves
        return [i for k, p in enumerate(parts) if p
                for i in ([self.sp.piece_to_id(p)] if k % 2 else self.sp.encode(p))]

    def decode(self, ids: list[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(list(ids), skip_special_tokens=False)
        return self.sp.decode(list(ids))

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The chat's ids, where only the template's own text may hold control tokens: each
        special-token string in a message's content becomes a placeholder the template cannot know
        (private-use characters around a random number) and, rendered, comes back encoded as plain
        text. Content without such strings is encoded exactly as render_chat + encode would."""
        nonce = secrets.randbelow(10**12)
        hide = lambda m: self.special_re.sub(lambda x: f"\ue000{nonce}.{x[1]}\ue001", m)
        safe = [m | {"content": hide(m["content"])} if isinstance(m.get("content"), str) else m
                for m in messages]
        parts = re.split(f"\ue000{nonce}\\.(.+?)\ue001", self.render_chat(safe, add_generation_prompt))
        return [i for k, p in enumerate(parts) for i in self.encode(p, special=k % 2 == 0)]

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The chat as text, rendered by the checkpoint's template under bounds (engine/load/template.py)."""
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template")
        return render(self.chat_template, self.max_text_chars, messages=messages,
                      add_generation_prompt=add_generation_prompt,
                      bos_token=self.bos_token or "", eos_token=self.eos_token or "")


class StreamDecoder:
    """Text for token ids fed one at a time, never splitting a UTF-8 character.

    Example: "é" may be 2 byte-level tokens [a, b]: push(a) -> "", push(b) -> "é".
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tok, self.ids = tokenizer, []
        self.start = self.read = 0  # ids[:read] are emitted; ids[start:read] give context

    def push(self, token: int) -> str:
        self.ids.append(token)
        # subtle: decode with the previous piece in front, then cut it off: a lone first piece
        # loses its leading space in sentencepiece, and decoding every id each time is O(n^2)
        prefix = self.tok.decode(self.ids[self.start:self.read])
        text = self.tok.decode(self.ids[self.start:])
        if text.endswith("\ufffd"):  # a character is cut in half: wait for its other bytes
            return ""
        self.start, self.read = self.read, len(self.ids)
        return text[len(prefix):]

    def flush(self) -> str:
        prefix = self.tok.decode(self.ids[self.start:self.read])
        text = self.tok.decode(self.ids[self.start:])
        self.start = self.read = len(self.ids)
        return text[len(prefix):]
