"""Tokenizer wrapper over `tokenizers` (tokenizer.json) or `sentencepiece` (tokenizer.model),
the checkpoint's chat template, and a streaming detokenizer.

encode() adds no BOS/EOS of its own: the chat template writes every special token, and
special tokens written in the text ("<|im_start|>") are parsed as such.

But: no batching, no offsets, no tool-calling helpers beyond what the template does itself.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import sentencepiece
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


def read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


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
                raise ValueError(f"{d / 'tokenizer.json'}: not a readable tokenizer ({e})") from None
            self.vocab_size = self.hf.get_vocab_size(with_added_tokens=True)
            self.token_id = self.hf.token_to_id
        elif (d / "tokenizer.model").is_file():
            try:
                self.sp = sentencepiece.SentencePieceProcessor(model_file=str(d / "tokenizer.model"))
            except (OSError, RuntimeError) as e:
                raise ValueError(f"{d / 'tokenizer.model'}: not a readable tokenizer ({e})") from None
            self.vocab_size = self.sp.get_piece_size()
            self.token_id = self.sp.piece_to_id
            # subtle: sentencepiece never matches control pieces (<s>) in text: split them out
            specials = [self.sp.id_to_piece(i) for i in range(self.vocab_size)
                        if self.sp.is_control(i)]
            alts = "|".join(map(re.escape, sorted(specials, key=len, reverse=True)))
            self.special_re = re.compile(f"({alts or '(?!)'})")  # (?!) never matches
        else:
            raise FileNotFoundError(f"{d}: neither tokenizer.json nor tokenizer.model")
        tc = read_json(d / "tokenizer_config.json")
        ids = [read_json(d / "generation_config.json"), read_json(d / "config.json")]
        if self.sp is not None:  # the .model itself knows its <s> and </s>; -1 = none
            ids.append({k: v for k, v in [("bos_token_id", self.sp.bos_id()),
                                          ("eos_token_id", self.sp.eos_id())] if v >= 0})
        # tokenizer_config stores a token as a string or as {"content": ...}
        content = lambda t: t["content"] if isinstance(t, dict) else t
        self.bos_token, self.eos_token = content(tc.get("bos_token")), content(tc.get("eos_token"))
        by_name = lambda t: self.token_id(t) if t else None
        bos = [c.get("bos_token_id") for c in ids] + [by_name(self.bos_token)]
        self.bos_id = next((b for b in bos if b is not None), None)
        # every stop id counts: generation_config may list several (<|eot_id|>, <|end_of_text|>)
        eos = [c.get("eos_token_id") for c in ids] + [by_name(self.eos_token)]
        self.eos_ids = {i for e in eos if e is not None
                        for i in (e if isinstance(e, list) else [e])}
        template = d / "chat_template.jinja"  # wins over tokenizer_config, as in transformers
        self.chat_template = template.read_text() if template.is_file() else tc.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: [{"name", "template"}]
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default")

    @classmethod
    def load(cls, ckpt_dir: str | Path) -> Tokenizer:
        return cls(ckpt_dir)

    def encode(self, text: str) -> list[int]:
        if self.hf is not None:
            return self.hf.encode(text, add_special_tokens=False).ids
        parts = self.special_re.split(text)  # odd indices are the special tokens themselves
        return [i for k, p in enumerate(parts) if p
                for i in ([self.sp.piece_to_id(p)] if k % 2 else self.sp.encode(p))]

    def decode(self, ids: list[int]) -> str:
        if self.hf is not None:
            return self.hf.decode(list(ids), skip_special_tokens=False)
        return self.sp.decode(list(ids))

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise ValueError("this checkpoint has no chat template")
        try:  # a syntax error, or the template's own raise_exception() refusing the messages
            return chat_environment().from_string(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None


def chat_environment() -> jinja2.Environment:
    # the settings HF chat templates are written for; sandboxed because templates ship with weights
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])

    def raise_exception(message):
        raise jinja2.TemplateError(message)

    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    return env


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
