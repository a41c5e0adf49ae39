"""GGUF SentencePiece vocabularies (tokenizer.ggml.model "llama": Llama 2, Mistral, ERNIE-4.5): a
SentencePiece BPE model trained here on GSM8K questions, written as llama.cpp's converter writes it (pieces,
scores, token types), tokenizes held-out text exactly as SentencePiece itself does, decodes back to it, and
follows llama.cpp around special tokens; a tiny ERNIE-4.5 GGUF carrying such a vocabulary loads and generates
from text."""
from __future__ import annotations

import io
import json

import gguf
import pytest
from conftest import DATA, TINY
from test_gguf_ernie import write_ernie_gguf

from specgen import SamplingParams, generate, load_model
from specgen.models.gguf_header import read_header
from specgen.models.gguf_loader import _build_tokenizer, _Metadata

spm = pytest.importorskip("sentencepiece")
pytestmark = pytest.mark.skipif(not (DATA / "gsm8k" / "train.jsonl").is_file(), reason="needs ../shared/data")

QUESTIONS = DATA / "gsm8k" / "train.jsonl"
EDGES = ["Hello  world", "  two leading spaces", "tabs\tand\nnewlines\n\n", "accents: é, ü; emoji 🙂; 中文",
         "a", "x" * 50, "The answer is 42.", " "]


def questions(lo: int, hi: int) -> list[str]:
    with QUESTIONS.open() as f:
        return [json.loads(line)["question"] for _, line in zip(range(hi), f)][lo:]


def train(vocab_size: int, byte_fallback: bool = True):
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(questions(0, 2000)), model_writer=model, vocab_size=vocab_size,
        model_type="bpe", byte_fallback=byte_fallback, character_coverage=0.995,
        user_defined_symbols=["<tool>"], control_symbols=["<ctl>"],
        normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    return spm.SentencePieceProcessor(model_proto=model.getvalue())


def add_vocabulary(w: gguf.GGUFWriter, sp) -> None:
    """The tokenizer keys of llama.cpp's convert_hf_to_gguf for a SentencePiece model."""
    n = sp.get_piece_size()
    T = gguf.TokenType

    def kind(i: int) -> int:
        if sp.is_unknown(i):
            return T.UNKNOWN
        if sp.is_control(i):
            return T.CONTROL
        if sp.is_byte(i):
            return T.BYTE
        return T.USER_DEFINED if sp.id_to_piece(i) == "<tool>" else T.NORMAL

    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i) for i in range(n)])
    w.add_token_scores([sp.get_score(i) for i in range(n)])
    w.add_token_types([kind(i) for i in range(n)])
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_add_bos_token(True)


@pytest.fixture(scope="module")
def vocab_1000(tmp_path_factory):
    sp = train(1000)
    path = tmp_path_factory.mktemp("spm") / "vocab.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    add_vocabulary(w, sp)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return sp, _build_tokenizer(_Metadata(read_header(path).fields, path), path)


def test_held_out_text_tokenizes_as_sentencepiece_does(vocab_1000):
    sp, tok = vocab_1000
    texts = questions(2000, 2200) + EDGES
    for text in texts:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == text
    # bytes' pieces where no piece covers the text
    assert any(sp.is_byte(i) for i in tok.encode("emoji 🙂", add_special_tokens=False))


def test_special_tokens_split_the_text_as_llama_cpp_does(vocab_1000):
    """A control token (the chat template's) and a user-defined one are one id each; the text after one starts
    with a space piece, as llama.cpp tokenizes it (a fresh start)."""
    sp, tok = vocab_1000
    ctl, tool = sp.piece_to_id("<ctl>"), sp.piece_to_id("<tool>")
    assert tok.encode("<ctl>Tom has 3 apples<tool> and", add_special_tokens=False) == \
        [ctl] + sp.encode("Tom has 3 apples") + [tool] + sp.encode(" and")


def test_a_gguf_model_with_a_sentencepiece_vocabulary_generates_from_text(tmp_path):
    sp = train(300, byte_fallback=False)  # the tiny fixture's 300 embedding rows: no room for 256 byte pieces
    path = tmp_path / "ernie-spm.gguf"
    assert sp.get_piece_size() <= json.loads((TINY / "ernie4_5" / "config.json").read_text())["vocab_size"]
    write_ernie_gguf(path, "ernie4_5", vocabulary=lambda w: add_vocabulary(w, sp))
    model = load_model(path, dtype="float64")
    text = "Natalia sold clips to 48 of her friends."
    assert model.tokenizer.encode(text) == [sp.bos_id()] + sp.encode(text)
    out = generate([text], model=model, sampling=SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.text == model.tokenizer.decode(out.token_ids)
