"""Writes PLAN.json, the scripted agent's one round for the Qwen3 forge run: every engine file that differs from the
seed (the Hopper engine's package and its copy of scenarios/_llama, as the forge seeds them) as a ``write`` op, and
one ``python`` op that removes the fast-path files the exact-only engine drops.

    python experiments/forge_qwen3/make_plan.py SEED_ENGINE_DIR DRAFT_ENGINE_DIR [OUT]

OUT: where the plan goes (default: PLAN.json beside this script); experiments/forge_qwen3_moe uses it too.
"""

import filecmp
import json
import sys
from pathlib import Path

seed, draft = Path(sys.argv[1]), Path(sys.argv[2])
ops = []
for f in sorted(draft.rglob("*")):
    if f.is_file() and "__pycache__" not in f.parts:
        rel = f.relative_to(draft)
        if not (seed / rel).is_file() or not filecmp.cmp(seed / rel, f, shallow=False):
            ops.append({"op": "write", "path": f"engine/{rel}", "text": f.read_text()})
gone = sorted(str(f.relative_to(seed)) for f in seed.rglob("*")
              if f.is_file() and "__pycache__" not in f.parts and not (draft / f.relative_to(seed)).exists())
if gone:
    ops.append({"op": "python", "code": "import os\nfor f in %r:\n    os.remove('engine/' + f)\n" % gone})
out = Path(sys.argv[3]) if len(sys.argv) > 3 else Path(__file__).with_name("PLAN.json")
out.write_text(json.dumps({"rounds": {"1": ops}}, indent=1) + "\n")
print(f"{out}: {len(ops)} ops; removes {gone}")
