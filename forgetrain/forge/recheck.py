"""The judge's own questions of a candidate's trace (escape class 5, replaying the reference).

Everything in a candidate's trace dir was written inside the candidate's process, where the engine runs: a trace
recorded from the reference in advance and written out by patched code says what the engine never computed.
The gate's secret values (:mod:`forgetrain.forge.secret`) make such a recording useless; these checks, run by the
ladder process before any verdict, name the attempt instead of leaving it to fail as a divergence:

* the trace's ``config_hash`` is the one of the run the judge asked for (the reference's golden of the same run
  carries it too);
* it holds exactly the steps the judge asked for, numbered 1..N;
* the weights the candidate saved (``final.safetensors``) are the ones its last step's digests describe: the
  ladder recomputes their digests (:func:`forgetrain.trace.tensor_digests`).
"""

from __future__ import annotations

import json
from pathlib import Path


def trace_problems(cand: Path, golden: Path | None, steps: int, config_hash: str | None = None) -> list[str]:
    """What is wrong with the candidate's trace dir ``cand`` as a record of the judge's run, whose golden trace
    dir is ``golden`` (same config; or, without one, whose config hash the judge computed: ``config_hash``) and
    whose length is ``steps``; empty when nothing is."""
    from forgetrain.trace import read_trace

    try:
        meta, recs = read_trace(cand)
        want = json.loads((golden / "meta.json").read_text()) if golden is not None else {"config_hash": config_hash}
    except (OSError, ValueError) as e:
        return [f"the candidate's trace cannot be read ({type(e).__name__}: {e})"]
    out = []
    if meta.get("config_hash") != want.get("config_hash"):
        out.append(f"the candidate's trace is of the run {meta.get('config_hash')}, the judge ran "
                   f"{want.get('config_hash')}: it describes another run than the one judged")
    got = [r.get("step") for r in recs]
    if got != list(range(1, steps + 1)):
        out.append(f"the candidate's trace holds steps {got[:3]}..{got[-2:]} ({len(got)}), the judge's run had "
                   f"{steps}")
    out += _final_problems(cand, recs[-1] if recs else {})
    return out


def _final_problems(cand: Path, last: dict) -> list[str]:
    """The saved final weights against the last step's parameter digests (when the trace has both)."""
    want = (last.get("digests") or {}).get("params")
    final = cand / "final.safetensors"
    if not want or not final.is_file():
        return []
    from safetensors.torch import load_file

    from forgetrain.trace import tensor_digests

    try:
        got = tensor_digests(load_file(str(final)))
    except Exception as e:  # noqa: BLE001 - an unreadable file is the finding
        return [f"the candidate's final.safetensors cannot be read ({type(e).__name__}: {e})"]
    bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    if bad:
        return [f"the weights the candidate saved are not the ones its trace's last step describes ({len(bad)} "
                f"tensors differ, first {bad[0]}): the trace was not computed from them"]
    return []
