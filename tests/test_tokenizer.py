"""The tokenizer protocol: HF and SentencePiece backends, the factory, missing special tokens, and a SentencePiece
``.model`` through prepare, ``data.path`` and a 2-step training run."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from forgetrain.config import DataConfig
from forgetrain.data import load_tokenizer, prepare
from forgetrain.data import tokenizer as tokmod
from forgetrain.data.loader import open_indexed
from forgetrain.data.prepare import train_tokenizer
from forgetrain.data.tokenizer_hf import HFTokenizer
from forgetrain.data.tokenizer_sp import SentencePieceTokenizer
from forgetrain.errors import DataError
from tests.helpers import paragraphs as _paragraphs
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parents[1]
def paragraphs(n: int, seed: int = 0) -> list[str]:
    """``n`` distinct six-line paragraphs with non-ASCII text (tests.helpers' corpus)."""
    return _paragraphs(n, seed, lines=6)


def train_sp(path: Path, **kw) -> Path:
    """A tiny SentencePiece BPE (vocab 320, byte fallback, no normalization: text round-trips) saved to ``path``."""
    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(paragraphs(40, seed=3)), model_writer=buf, vocab_size=320,
                                   model_type="bpe", byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, minloglevel=2, **kw)
    path.write_bytes(buf.getvalue())
    return path


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return train_sp(tmp_path_factory.mktemp("sp") / "llama_like.model")


def jsonl(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return path


def stored_docs(prefix: str, eod: int) -> list[list[int]]:
    ds = open_indexed(prefix)
    out = []
    for i in range(len(ds)):
        ids = ds[i].tolist()
        assert ids[-1] == eod and eod not in ids[:-1]
        out.append(ids[:-1])
    return out


def run_cli(args, cwd, module="forgetrain", timeout=None):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, text=True, capture_output=True,
                          timeout=timeout or hang_s())


def one_error_line(p) -> str:
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (p.returncode, p.stderr)
    return lines[0]


# ------------------------------------------------------------------------------------------------ backends
def test_sentencepiece_backend(sp_model, tmp_path):
    import sentencepiece as spm
    import torch

    tok = load_tokenizer(sp_model)
    sp = spm.SentencePieceProcessor(model_file=str(sp_model))
    assert isinstance(tok, SentencePieceTokenizer) and tok.backend == "sentencepiece"
    assert tok.vocab_size == sp.get_piece_size() == 320
    assert tok.eod_id == sp.eos_id() == 2 and tok.eod_piece == "</s>"  # the model's own EOS ends a document
    for text in [*paragraphs(5, seed=9), "  two leading spaces", "trailing  ", "a\n\nb", "🌹 unseen ☃ bytes"]:
        ids = tok.encode(text)
        assert ids == sp.encode(text, out_type=int)
        assert sp.bos_id() not in ids and tok.eod_id not in ids  # nothing added
        assert tok.decode(ids) == text
    assert tok.encode_batch(["thou art", "may"]) == [tok.encode("thou art"), tok.encode("may")]
    a, b = tok.encode("thou art"), tok.encode("may")
    # the EOD is shown (SentencePiece alone drops control pieces); ids beyond the vocabulary are skipped, like HF
    assert tok.decode([*a, tok.eod_id, *b, 5000]) == "thou art</s>may"
    assert tok.decode(torch.tensor(a)) == tok.decode(np.array(a)) == "thou art"
    # a missing piece is None, not the <unk> id piece_to_id answers
    assert sp.piece_to_id("<|endoftext|>") == sp.unk_id() and tok.token_to_id("<|endoftext|>") is None
    assert tok.token_to_id("<unk>") == sp.unk_id() and tok.token_to_id("</s>") == 2
    assert tok.id_to_piece(2) == "</s>" and tok.id_to_piece(320) is None and tok.id_to_piece(-1) is None
    assert tok.fingerprint() == {"file_sha256": hashlib.sha256(sp_model.read_bytes()).hexdigest()}
    saved = tok.save(tmp_path)
    assert saved == str(tmp_path / "tokenizer.model") and Path(saved).read_bytes() == sp_model.read_bytes()


def test_hf_backend_keeps_todays_behaviour(tmp_path):
    tok = train_tokenizer(paragraphs(20), 300)
    assert isinstance(tok, HFTokenizer) and tok.eod_id == 0 and tok.eod_piece == "<|endoftext|>"
    path = Path(tok.save(tmp_path))
    assert path.name == "tokenizer.json"
    loaded = load_tokenizer(path)
    assert isinstance(loaded, HFTokenizer) and loaded.vocab_size == tok.vocab_size
    from tokenizers import Tokenizer as Raw

    raw = Raw.from_file(str(path))
    text = paragraphs(1, seed=5)[0]
    assert loaded.encode(text) == raw.encode(text, add_special_tokens=False).ids
    ids = loaded.encode(text)
    assert loaded.decode([*ids, 0, *ids]) == f"{text}<|endoftext|>{text}" == raw.decode([*ids, 0, *ids],
                                                                                       skip_special_tokens=False)
    assert loaded.token_to_id("</s>") is None and loaded.id_to_piece(10 ** 6) is None
    # the cache key's tokenizer part is the one HF files had before the protocol: existing caches stay valid
    assert loaded.fingerprint() == {"file_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def test_factory_picks_by_content_then_name_and_refuses_the_rest(sp_model, tmp_path):
    hf = Path(train_tokenizer(paragraphs(20), 300).save(tmp_path))
    # content wins over the name
    assert isinstance(load_tokenizer(_copy(hf, tmp_path / "odd.model")), HFTokenizer)
    assert isinstance(load_tokenizer(_copy(sp_model, tmp_path / "odd.json")), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(_copy(sp_model, tmp_path / "no_suffix")), SentencePieceTokenizer)
    cases = {
        "garbage.bin": (bytes(range(200, 256)) * 4, "is not a tokenizer file (expected an HF tokenizer.json or a "
                                                    "SentencePiece .model)"),
        "garbage.model": (b"not a model at all", "is not a SentencePiece .model (it does not parse"),
        "empty.model": (b"", "is not a SentencePiece .model (it holds no pieces)"),
        "broken.json": (b'{"version": "1.0", "model": ', "is not an HF tokenizer.json: "),
        "cut.model": (sp_model.read_bytes()[:1000], "is not a SentencePiece .model (it does not parse"),
    }
    for name, (data, needle) in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(DataError) as e:
            load_tokenizer(tmp_path / name)
        assert str(e.value).startswith(f"tokenizer '{tmp_path / name}' ") and needle in str(e.value), str(e.value)
        assert "\n" not in str(e.value)
    with pytest.raises(DataError, match=r"tokenizer '.*nope.model' not found \(expected an HF tokenizer.json or"):
        load_tokenizer(tmp_path / "nope.model")


def _copy(src: Path, dst: Path) -> Path:
    dst.write_bytes(src.read_bytes())
    return dst


# ------------------------------------------------------------------------------------- missing special tokens
def test_sentencepiece_without_eod_is_refused(tmp_path):
    import sentencepiece as spm

    no_eos = train_sp(tmp_path / "no_eos.model", eos_id=-1)
    sp = spm.SentencePieceProcessor(model_file=str(no_eos))
    assert sp.eos_id() == -1 and sp.piece_to_id("</s>") == sp.unk_id()  # the trap: a naive lookup finds <unk>
    with pytest.raises(DataError) as e:
        load_tokenizer(no_eos)
    msg = str(e.value)
    assert msg.startswith(f"tokenizer '{no_eos}' has no end-of-document token") and "eos_id=-1" in msg
    assert "<|endoftext|>" in msg and "\n" not in msg
    # without an EOS piece, a user-defined <|endoftext|> is the EOD (a real piece, not the <unk> answer)
    own = load_tokenizer(train_sp(tmp_path / "own.model", eos_id=-1, user_defined_symbols=["<|endoftext|>"]))
    assert own.eod_piece == "<|endoftext|>" and own.eod_id != own.token_to_id("<unk>")
    assert own.decode([*own.encode("may"), own.eod_id]) == "may<|endoftext|>"

    src = jsonl(tmp_path / "c.jsonl", paragraphs(12))
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="has no end-of-document token"):
        prepare(DataConfig(source=str(src), tokenizer=str(no_eos), cache_dir=str(cache)), progress=False)
    assert not cache.exists(), "a refused tokenizer must write nothing"


def test_bad_tokenizers_on_the_command_line_are_one_line(tmp_path):
    no_eos = train_sp(tmp_path / "no_eos.model", eos_id=-1)
    (tmp_path / "garbage.bin").write_bytes(bytes(range(128, 256)))
    (tmp_path / "garbage.model").write_bytes(b"\x0a\xff\xff garbage")
    src = jsonl(tmp_path / "c.jsonl", paragraphs(12))
    cases = {"no_eos": (no_eos, "has no end-of-document token"),
             "garbage": (tmp_path / "garbage.bin", "is not a tokenizer file"),
             "garbage_model": (tmp_path / "garbage.model", "is not a SentencePiece .model"),
             "missing": (tmp_path / "nope.model", "not found (expected an HF tokenizer.json or a SentencePiece")}
    for name, (tok, needle) in cases.items():
        out, cache = tmp_path / f"out_{name}", tmp_path / f"cache_{name}"
        p = run_cli(["model=llama_micro", f"data.source={src}", f"data.tokenizer={tok}", f"data.cache_dir={cache}",
                     "train.steps=2", f"train.out_dir={out}"], cwd=tmp_path)
        line = one_error_line(p)
        assert needle in line and str(tok) in line, (name, line)
        assert not out.exists() and not cache.exists() and not (tmp_path / "outputs").exists(), name
    p = run_cli(["--source", str(src), "--tokenizer", str(no_eos), "--out", str(tmp_path / "cli_cache")],
                cwd=tmp_path, module="forgetrain.prepare")
    assert "has no end-of-document token" in one_error_line(p) and not (tmp_path / "cli_cache").exists()


# ------------------------------------------------------------------------------------------ through prepare
def test_prepare_with_a_sentencepiece_model(sp_model, tmp_path):
    docs = paragraphs(15, seed=1)
    src = jsonl(tmp_path / "c.jsonl", docs)
    c = DataConfig(source=str(src), tokenizer=str(sp_model), cache_dir=str(tmp_path / "cache"), valid_fraction=0.2)
    out = prepare(c, progress=False)
    tok = load_tokenizer(sp_model)
    assert Path(out.tokenizer_path).name == "tokenizer.model"
    assert Path(out.tokenizer_path).read_bytes() == sp_model.read_bytes()
    assert (out.vocab_size, out.eod_id) == (320, 2)
    manifest = json.loads((Path(out.train_prefix).parent / "manifest.json").read_text())
    assert (manifest["tokenizer_file"], manifest["tokenizer_backend"], manifest["eod_piece"]) == \
        ("tokenizer.model", "sentencepiece", "</s>")
    valid = manifest["valid_documents"]
    train = [i for i in range(len(docs)) if i not in valid]
    for ids, prefix in ((train, out.train_prefix), (valid, out.valid_prefix)):
        stored = stored_docs(prefix, out.eod_id)
        assert stored == [tok.encode(docs[i]) for i in ids]
        assert [tok.decode(s) for s in stored] == [docs[i] for i in ids]
    assert prepare(c, progress=False) == out  # a cache hit names the same tokenizer file
    # data.path mode finds tokenizer.model beside the prefix, and takes an explicit one too
    assert prepare(DataConfig(path=out.train_prefix), progress=False) == out
    assert prepare(DataConfig(path=out.train_prefix, tokenizer=str(sp_model)), progress=False).eod_id == 2


def test_data_path_without_a_tokenizer_beside_names_what_it_looked_for(tmp_path, sp_model):
    out = prepare(DataConfig(source=str(jsonl(tmp_path / "c.jsonl", paragraphs(10))), tokenizer=str(sp_model),
                             cache_dir=str(tmp_path / "cache")), progress=False)
    d = tmp_path / "bare"
    d.mkdir()
    for ext in (".bin", ".idx"):
        _copy(Path(out.train_prefix + ext), d / ("train" + ext))
    with pytest.raises(DataError, match=r"no tokenizer beside .* \(looked for tokenizer.json, tokenizer.model in"):
        prepare(DataConfig(path=str(d / "train")), progress=False)


def test_a_third_backend_needs_only_its_module_and_registration(tmp_path, monkeypatch):
    """The protocol is the only interface the pipeline uses: a backend the pipeline has never seen (a character
    tokenizer), added through the factory's registry alone, prepares, caches and is found beside data.path."""
    from forgetrain.data.tokenizer import Tokenizer

    class CharTokenizer(Tokenizer):
        backend, file_name, description, suffixes = "chars", "tokenizer.chars", "a chars file", (".chars",)

        def __init__(self, blob, where):
            super().__init__(blob, where)
            self.chars = ["<eod>"] + blob.decode()[len("CHARS\n"):].split("\n")

        @classmethod
        def sniff(cls, head):
            return head.startswith(b"CHARS\n")

        @classmethod
        def from_bytes(cls, blob, where):
            return cls(blob, where)

        vocab_size = property(lambda self: len(self.chars))
        eod_id = property(lambda self: 0)

        def encode(self, text):
            return [self.chars.index(ch) for ch in text]

        def _decode(self, ids):
            return "".join(self.chars[i] for i in ids if i < len(self.chars))

        def token_to_id(self, piece):
            return self.chars.index(piece) if piece in self.chars else None

        def id_to_piece(self, i):
            return self.chars[i] if 0 <= i < len(self.chars) else None

    registered = tokmod._backends()
    monkeypatch.setattr(tokmod, "_backends", lambda: (*registered, CharTokenizer))
    docs = [f"doc {i} ab ba" for i in range(10)]
    alphabet = sorted(set("".join(docs)))
    (tmp_path / "my.chars").write_text("CHARS\n" + "\n".join(alphabet))
    out = prepare(DataConfig(source=str(jsonl(tmp_path / "c.jsonl", docs)), tokenizer=str(tmp_path / "my.chars"),
                             cache_dir=str(tmp_path / "cache")), progress=False)
    assert Path(out.tokenizer_path).name == "tokenizer.chars" and out.vocab_size == len(alphabet) + 1
    assert stored_docs(out.train_prefix, 0)[0] == [alphabet.index(ch) + 1 for ch in docs[0]]
    assert prepare(DataConfig(path=out.train_prefix), progress=False) == out
    assert "a chars file" in tokmod.formats()


# ------------------------------------------------------------------------------------------- through train
def test_training_on_a_sentencepiece_model_end_to_end(sp_model, tmp_path):
    src = jsonl(tmp_path / "c.jsonl", paragraphs(30, seed=2))
    common = ["model=llama_micro", "train.steps=2", "train.lr_warmup_steps=1", "train.micro_batch_size=2",
              "train.global_batch_size=4", "train.eval_interval=2", "train.eval_iters=1", "train.save_interval=0",
              "train.sample_tokens=8", "train.sample_prompt=thou"]
    out = tmp_path / "run"
    p = run_cli([*common, f"data.source={src}", f"data.tokenizer={sp_model}", f"data.cache_dir={tmp_path / 'cache'}",
                 f"train.out_dir={out}"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    recs = [json.loads(x) for x in (out / "trace" / "trace.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [1, 2] and "val_loss" in recs[1]
    assert json.loads((out / "summary.json").read_text())["sample"].startswith("thou")
    prefix = next((tmp_path / "cache").glob("*/train.bin")).with_suffix("")
    out2 = tmp_path / "run_path"
    p = run_cli([*common, f"data.path={prefix}", f"data.tokenizer={sp_model}", f"train.out_dir={out2}"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    recs2 = [json.loads(x) for x in (out2 / "trace" / "trace.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in recs2] == [r["loss"] for r in recs]  # same tokens, same order, same run
