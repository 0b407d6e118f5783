"""House rules for the product's files, the lab notebook kept apart.

- No line of code, config, README or docs narrates a past work period or a device run: no dates, no device-call
  numbers, no work periods, no work-log ordinals. Dated results live under ``experiments/``; a product line may
  name them only by a path or a link into ``experiments/``. Data files (JSON traces, seals, safetensors) are data.
- ``experiments/`` is a one-way dependency: nothing in the harness, the engines, the references or ``conf/``
  imports it or names a path in it from code.
- ``scripts/device/`` keeps the device helpers only, and every experiment and command the docs name exists.

One kind of product file is left out of the narration scan: a kernel module that a seal in
``forgetrain/kernels/registry.json`` vouches for, byte for byte. Editing it, a comment included, makes its seals
STALE until it is sealed again on every device (CUDA needs the GPU); its text waits for that reseal.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("forgetrain", "scenarios", "references", "tests", "conf", "docs", "scripts", ".ci", "README.md",
           "pyproject.toml")
TEXT = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".cfg", ".ini", ".txt", ".sbatch", ""}

DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
DEVICE_CALL = re.compile(r"\bcalls? ?\d+", re.I)
PERIOD = re.compile(r"(?<![\w.])sess" r"ions?\b", re.I)  # not start_new_..., request.<...>
PROCESS_GROUPS = re.compile(r"sess" r"ions? of (?:its|their) own", re.I)  # POSIX process groups
ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
WORK_LOG = re.compile(rf"\b(?:{ORDINALS}) (?:sess" rf"ion|lease|fix|attempt|device call)\b", re.I)
# a reference into the notebook: a markdown link whose target is under experiments/, or a bare path there
NOTEBOOK_REF = re.compile(r"\[[^\]]*\]\([^)]*experiments/[^)]*\)|\S*experiments/\S*")


def _sealed_sources() -> set[str]:
    """The kernel modules whose current bytes a seal vouches for (their sha256 is a seal's ``source_sha256``)."""
    reg = json.loads((ROOT / "forgetrain" / "kernels" / "registry.json").read_text())
    out = set()
    for devices in reg["kernels"].values():
        for seal in devices.values():
            f, sha = seal.get("source_file"), seal.get("source_sha256")
            if f and (ROOT / f).is_file() and hashlib.sha256((ROOT / f).read_bytes()).hexdigest() == sha:
                out.add(f)
    return out


def _product_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "--", *PRODUCT], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
        files = [ROOT / f for f in out]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: walk the tree
        files = [p for top in PRODUCT for p in ([ROOT / top] if (ROOT / top).is_file() else (ROOT / top).rglob("*"))]
    keep, sealed = [], _sealed_sources()
    for p in files:
        rel = p.relative_to(ROOT).as_posix()
        if not p.is_file() or "__pycache__" in rel or p.suffix not in TEXT or rel in sealed:
            continue
        if rel.startswith("references/goldens/") and p.name != "README.md":
            continue  # a golden's files are its data
        keep.append(p)
    return keep


def narration(text: str) -> list[tuple[int, str]]:
    """The lines of ``text`` that narrate a work period or a device run, with their numbers."""
    lines = text.splitlines()
    hits = []
    for n, line in enumerate(lines, 1):
        bare = NOTEBOOK_REF.sub(" ", line)
        # a POSIX process group's phrase may run on to the next line
        joined = bare + " " + (lines[n].strip() if n < len(lines) else "")
        periods = [m for m in PERIOD.finditer(bare) if not PROCESS_GROUPS.match(joined, m.start())]
        if DATE.search(bare) or DEVICE_CALL.search(bare) or periods or WORK_LOG.search(bare):
            hits.append((n, line.strip()[:160]))
    return hits


def test_no_product_line_narrates_history():
    """Every product file (code, tests, conf, README, docs, scripts, CI) is free of dates, device-call numbers,
    work periods and work-log ordinals, outside references into ``experiments/``."""
    found = {}
    files = _product_files()
    assert len(files) > 100, "the scan found too few files"
    for p in files:
        if hits := narration(p.read_text(errors="replace")):
            found[p.relative_to(ROOT).as_posix()] = hits
    assert found == {}, "\n".join(f"{f}:{n}: {line}" for f, hs in found.items() for n, line in hs)


@pytest.mark.parametrize("line, narrates", [
    ("measured on the H200 (20" "26-12-03)", True),
    ("`scripts/device/call" "16_llama8b_h200.sh`", True),
    ("the numbers of call" " 12", True),
    ("in this sess" "ion's first commit", True),
    ("the six" "th fix of the loop", True),
    ("raw JSON: experiments/fp8/results/2026-12-03_h200/call30_c8_bench.json", False),
    ("[2026-12-03](../experiments/fp8/results/2026-12-03_h200/README.md)", False),
    ("subprocess.Popen(cmd, start_new_sess" "ion=True)", False),
    ("for item in request.sess" "ion.items:", False),
    ("ends the sides it started in sess" "ions of their own", False),
    ("ends the sides it started in sess" "ions of\ntheir own", False),
    ("torchrun starts its workers in their own sess" "ions", True),
    ("the first micro-batch overwrites, the second call adds", False),
    ("32 calls of 0.60 ms each", False),
])
def test_the_scan_tells_narration_from_references(line, narrates):
    assert bool(narration(line)) is narrates


def test_only_sealed_kernel_modules_are_left_out():
    """The sealed-source exemption covers kernel modules only, and only while their seal holds."""
    sealed = _sealed_sources()
    assert sealed and all(f.startswith("forgetrain/kernels/") and f.endswith(".py") for f in sealed)


def _py_files(*tops: str) -> list[Path]:
    return [p for t in tops for p in sorted((ROOT / t).rglob("*.py")) if "__pycache__" not in p.parts]


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def test_experiments_is_a_one_way_dependency():
    """The harness, the engines and the references never import ``experiments`` nor name a path in it outside
    their docstrings; ``conf/`` names none."""
    found = []
    for p in _py_files("forgetrain", "scenarios", "references"):
        tree = ast.parse(p.read_text(), str(p))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            mods = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                mods = [node.module]
            if any(m == "experiments" or m.startswith("experiments.") for m in mods):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}: imports {mods}")
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
                    and "experiments" in node.value):
                found.append(f"{p.relative_to(ROOT)}:{node.lineno}: names {node.value[:80]!r}")
    for p in sorted((ROOT / "conf").rglob("*.yaml")):
        found += [f"{p.relative_to(ROOT)}:{n}" for n, line in enumerate(p.read_text().splitlines(), 1)
                  if "experiments" in line]
    assert found == [], "\n".join(found)


def test_the_scan_sees_an_import_of_the_notebook(tmp_path):
    tree = ast.parse("from experiments.fp8 import run\nPATH = 'experiments/fp8/run_h200.sh'\n")
    names = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module.startswith("experiments")]
    paths = [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and "experiments" in str(n.value)]
    assert names and paths and not _docstrings(tree)


def test_device_scripts_are_helpers_only():
    """``scripts/device/`` holds the helpers every device run sources; the runs themselves are experiments."""
    assert sorted(p.name for p in (ROOT / "scripts" / "device").iterdir() if p.is_file()) == \
        ["setup.sh", "shapes.sh", "wheels.sh"]


def test_every_experiment_has_a_readme_and_valid_scripts():
    """Each topic under ``experiments/`` has a README (claim, command, results), and its shell scripts parse."""
    topics = [p for p in sorted((ROOT / "experiments").iterdir()) if p.is_dir()]
    assert len(topics) >= 10
    for t in topics:
        if t.name != "equivalence_power":  # that topic's README is its docs page, docs/equivalence_power.md
            assert (t / "README.md").is_file(), t
        for sh in sorted(t.glob("*.sh")):
            p = subprocess.run(["bash", "-n", str(sh)], capture_output=True, text=True)
            assert p.returncode == 0, f"{sh}: {p.stderr}"


NAMED = re.compile(r"(?:bash|python3?) ((?:experiments|scripts)/[\w./-]+\.(?:sh|py))")
LINK = re.compile(r"\]\(([^)#\s]+)\)")


def test_every_named_experiment_and_raw_file_exists():
    """The scripts the docs and the README run (``bash experiments/...``, ``python3 scripts/...``) and the files
    their links point at exist, so a moved experiment cannot leave a stale command behind."""
    missing = []
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "experiments").glob("*/README.md")),
            ROOT / "references" / "goldens" / "README.md"]
    for doc in docs:
        text = doc.read_text()
        for m in NAMED.finditer(text):
            if not (ROOT / m.group(1)).is_file():
                missing.append(f"{doc.relative_to(ROOT)}: {m.group(1)}")
        for m in LINK.finditer(text):
            target = m.group(1)
            if "://" in target:
                continue
            if not (doc.parent / target).resolve().exists():
                missing.append(f"{doc.relative_to(ROOT)}: link {target}")
    assert missing == [], "\n".join(missing)


def test_readme_scenario_rows_are_short():
    """The README's scenario table has one row per scenario, each under 200 characters (the details live in the
    linked pages)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Scenarios", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    scenarios = sorted(p.stem for p in (ROOT / "conf" / "scenario").glob("*.yaml"))
    assert sorted(r.split("`")[1] for r in rows) == scenarios
    assert [r for r in rows if len(r) >= 200] == []
