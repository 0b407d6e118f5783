"""The forge's knowledge base: validated lessons (pitfall, evidence, fix) that persist across runs and scenarios.

A lesson is recorded only when the ladder proves it: a round moved from *failing* tier T with first divergence D
to *passing* T. Then ``pitfall`` describes D, ``fix`` is the diff between the failing and the passing engine
(files, line counts, the first changed lines) and ``evidence`` holds both verdicts' summaries.

Storage: one JSON object per line (``knowledge.jsonl``) at ``forge.kb_path``, by default
``$FORGETRAIN_CACHE/knowledge.jsonl`` or ``~/.cache/forgetrain/knowledge.jsonl``. Lessons are deduplicated by a
normalised pitfall key (tier, divergence kind and where, with numbers and digests folded), so the same pitfall
seen again bumps ``count`` and gains the new fix (up to 3 distinct fixes) instead of adding a line. The file is
rewritten atomically on every change.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

MAX_FIXES = 3


def default_path() -> Path:
    root = os.environ.get("FORGETRAIN_CACHE") or str(Path.home() / ".cache" / "forgetrain")
    return Path(root) / "knowledge.jsonl"


def normalize(text: str) -> str:
    """Lower-case, hex digests and numbers folded to ``#``, whitespace collapsed."""
    t = text.lower()
    t = re.sub(r"\b[0-9a-f]{8,}\b", "#", t)
    t = re.sub(r"[-+]?\d+(\.\d+)?(e[-+]?\d+)?", "#", t)
    return re.sub(r"\s+", " ", t).strip()


def pitfall_key(tier: str, divergence: dict | None, summary: str = "") -> str:
    """The dedup key: ``tier|kind|where`` from a first_divergence dict (summary text when there is none)."""
    if divergence:
        where = divergence.get("module") or divergence.get("tensor") or ""
        return normalize(f"{tier}|{divergence.get('kind', '')}|{where}")
    return normalize(f"{tier}|-|{summary}")


class KnowledgeBase:
    """Lessons in a JSONL file. ``add`` deduplicates; ``relevant`` ranks lessons for a brief."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path).expanduser() if path else default_path()

    def load(self) -> list[dict]:
        if not self.path.exists():
            return []
        out = []
        for line in self.path.read_text().splitlines():
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a damaged line loses one lesson, not the base
                continue
        return out

    def _save(self, lessons: list[dict]) -> None:
        from forgetrain.trace import atomic_write_bytes

        atomic_write_bytes(self.path, "".join(json.dumps(x, sort_keys=True) + "\n" for x in lessons).encode())

    def add(self, *, tier: str, divergence: dict | None, pitfall: str, fix: dict, evidence: dict,
            scenario: str, source: str = "") -> dict:
        """Record (or merge into an existing) lesson; returns the stored lesson."""
        key = pitfall_key(tier, divergence, pitfall)
        lessons = self.load()
        now = time.strftime("%Y-%m-%dT%H:%M:%S")
        fix_text = fix_line(fix)
        for x in lessons:
            if x.get("key") == key:
                x["count"] = int(x.get("count", 1)) + 1
                x["last_seen"] = now
                x["evidence"] = evidence
                if scenario not in x.setdefault("scenarios", []):
                    x["scenarios"].append(scenario)
                fixes = x.setdefault("fixes", [])
                if fix_text not in [fix_line(f) for f in fixes] and len(fixes) < MAX_FIXES:
                    fixes.append(fix)
                self._save(lessons)
                return x
        lesson = {"key": key, "tier": tier, "kind": (divergence or {}).get("kind"),
                  "where": (divergence or {}).get("module") or (divergence or {}).get("tensor"),
                  "pitfall": pitfall, "fixes": [fix], "evidence": evidence, "scenarios": [scenario],
                  "count": 1, "created": now, "last_seen": now, "source": source}
        lessons.append(lesson)
        self._save(lessons)
        return lesson

    def relevant(self, *, scenario: str, tiers: list[str], divergence: dict | None = None, k: int = 8) -> list[dict]:
        """Up to ``k`` lessons, best first: same divergence key, then same scenario, then the ladder's tiers."""
        cur = None
        if divergence:
            cur = (divergence.get("kind"), normalize(str(divergence.get("module") or divergence.get("tensor") or "")))

        def score(x: dict) -> tuple:
            same_div = cur is not None and (x.get("kind"), normalize(str(x.get("where") or ""))) == cur
            same_kind = cur is not None and x.get("kind") == cur[0]
            return (same_div, same_kind, scenario in x.get("scenarios", []), x.get("tier") in tiers,
                    int(x.get("count", 1)), x.get("last_seen", ""))

        ranked = sorted(self.load(), key=score, reverse=True)
        return [x for x in ranked if x.get("tier") in tiers or scenario in x.get("scenarios", [])][:k]


def fix_line(fix: dict) -> str:
    """One line for a fix dict (files changed, then the changed lines joined)."""
    files = ", ".join(fix.get("files", [])) or fix.get("stat", "")
    lines = " | ".join(s.strip() for s in fix.get("lines", [])[:6])
    return f"{files}: {lines}" if lines else files
