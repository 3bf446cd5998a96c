"""Tokenizer wrapper, chat template and streaming detokenizer.

Tests on the real SmolLM2 tokenizer skip when the converted checkpoint is absent; the stream
decoder and the template sandbox are also tested on a tiny tokenizer built here.
"""
import copy
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from engine.load.tokenizer import StreamDecoder, Tokenizer
from engine.load.weights import DEFAULT_CHECKPOINT

real = pytest.mark.skipif(not DEFAULT_CHECKPOINT.is_dir(), reason="run `make weights` first")
GOLDEN = json.loads((Path(__file__).parent / "golden.json").read_text())
MULTIBYTE = "naïve café 🙂 世界 👍🏽 done"


@pytest.fixture(scope="module")
def smol():
    return Tokenizer.load(DEFAULT_CHECKPOINT)


@pytest.fixture(scope="module")
def bytes_only(tmp_path_factory):
    # a byte-level tokenizer with no merges: every UTF-8 byte is its own token, so each
    # multibyte character is split across tokens: the worst case for streaming
    d = tmp_path_factory.mktemp("bytes")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = HFTokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "^",
        "chat_template": "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}"
                         "{% endif %}{{ bos_token }}{{ messages[0]['content'] }}"}))
    return Tokenizer.load(d)


def stream(tok, ids):
    sd = StreamDecoder(tok)
    return [sd.push(i) for i in ids] + [sd.flush()]


@pytest.mark.slow
@real
def test_encode_decode_round_trip_splits_digits_and_parses_specials(smol):
    # SmolLM2 tokenizes each digit alone, and "<|im_start|>" in text is the token, not 7 pieces
    text = "<|im_start|>user\nIn 2024, 12345 people said héllo 🙂<|im_end|>"
    ids = smol.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert [smol.decode([i]) for i in smol.encode("12345")] == ["1", "2", "3", "4", "5"]
    assert smol.decode(ids) == text
    assert smol.bos_id == 1 and smol.eos_ids == {2} and smol.vocab_size == 49152
    assert smol.encode("") == []


@pytest.mark.slow
@real
def test_chat_template_renders_chatml_with_the_default_system_prompt(smol):
    text = smol.render_chat([{"role": "user", "content": "Hi"}])
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained "
                    "by Hugging Face<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert not smol.render_chat([{"role": "user", "content": "Hi"}], add_generation_prompt=False) \
        .endswith("assistant\n")


@pytest.mark.slow
@real
def test_rendered_chat_ids_equal_hf_apply_chat_template(smol):
    # golden.json's input_ids come from transformers' AutoTokenizer.apply_chat_template
    for case in GOLDEN["cases"]:
        assert smol.encode(smol.render_chat([{"role": "user", "content": case["prompt"]}])) == \
            case["input_ids"]


@pytest.mark.slow
@real
def test_stream_decoder_on_real_tokens_never_shows_a_broken_character(smol):
    parts = stream(smol, smol.encode(MULTIBYTE))
    assert not any("\ufffd" in p for p in parts)
    assert "".join(parts) == MULTIBYTE


def test_stream_decoder_holds_back_partial_characters(bytes_only):
    # "🙂" is 4 bytes = 4 tokens here: nothing may be shown until the 4th arrives
    ids = bytes_only.encode("a🙂")
    assert len(ids) == 5
    assert stream(bytes_only, ids) == ["a", "", "", "", "🙂", ""]


@given(st.text(min_size=0, max_size=20).filter(lambda s: "\ufffd" not in s))
def test_stream_decoder_concatenation_equals_decode_all(bytes_only, text):
    # whatever the text, the stream shows exactly decode(all), and never a replacement char
    ids = bytes_only.encode(text)
    parts = stream(bytes_only, ids)
    assert "".join(parts) == bytes_only.decode(ids) == text
    assert not any("\ufffd" in p for p in parts)


def test_stream_decoder_flush_emits_a_dangling_partial_character(bytes_only):
    # a generation cut off mid-character still ends with what decode() would show
    ids = bytes_only.encode("é")[:1]
    assert stream(bytes_only, ids) == ["", "\ufffd"]


def test_chat_template_runs_sandboxed_with_raise_exception(bytes_only):
    # templates ship with downloaded weights: they may reject input, never reach Python internals
    assert bytes_only.render_chat([{"role": "user", "content": "x"}]) == "^x"
    with pytest.raises(ValueError, match="chat template: user first"):  # one CLI error line
        bytes_only.render_chat([{"role": "system", "content": "x"}])
    evil = copy.copy(bytes_only)
    evil.chat_template = "{{ messages.__class__.__mro__ }}"
    with pytest.raises(ValueError, match="unsafe"):                    # jinja2's SecurityError
        evil.render_chat([])
    evil.chat_template = "{% for %}"
    with pytest.raises(ValueError, match="chat template"):
        evil.render_chat([])


def test_sentencepiece_backend_parses_control_pieces_and_streams(tmp_path):
    # Llama-2-style checkpoints ship tokenizer.model; sentencepiece itself ignores "<s>" in text
    import sentencepiece
    corpus = ["hello world", "héllo wörld 🙂 世界", "the quick brown fox"] * 20
    with open(tmp_path / "tokenizer.model", "wb") as f:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(corpus), model_writer=f, vocab_size=300, model_type="bpe",
            byte_fallback=True, character_coverage=1.0, minloglevel=2)
    tok = Tokenizer.load(tmp_path)
    assert (tok.bos_id, tok.eos_ids) == (1, {2})
    ids = tok.encode("<s>hello wörld</s>")
    assert ids[0] == 1 and ids[-1] == 2 and tok.decode(ids[1:-1]) == "hello wörld"
    text = "hello 🙂 世界 Ω"  # Ω is unseen: byte-fallback pieces, cut mid-character
    parts = stream(tok, tok.encode(text))
    assert "".join(parts) == text and not any("\ufffd" in p for p in parts)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.load(tmp_path)


@pytest.mark.parametrize("name,text", [("tokenizer.json", "garbage"), ("tokenizer.model", "garbage"),
                                       ("tokenizer_config.json", "{"), ("config.json", "{")])
def test_a_corrupt_tokenizer_file_is_an_error_that_names_it(bytes_only, tmp_path, name, text):
    # the CLI turns ValueError into one line and exit 2; any other exception is a traceback
    d = tmp_path / "ckpt"
    d.mkdir()
    if name != "tokenizer.model":
        (d / "tokenizer.json").write_text(bytes_only.hf.to_str())
    (d / name).write_text(text)
    with pytest.raises(ValueError, match=name):
        Tokenizer.load(d)
