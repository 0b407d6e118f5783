"""``python scripts/profile_top.py TRACE [--top N]``: the kernels of a ``bench.profile=true`` trace, by device time.

TRACE is the Chrome trace that ``forgetrain.bench`` writes (``profile_<side>.json``), or a ``.tgz`` holding one (the
device calls bring them back as ``<tag>_profile_B.tgz``). Prints the GPU's busy span, the kernels' summed time and
the idle share (span minus the union of kernel intervals, over the span), then the ``N`` kernels (default 25) with
the most summed time: ms, share of kernel time, calls, mean us per call and the :func:`forgetrain.bench.classify`
category the bench's per-category table puts them in. A per-kernel view is what a lever is chosen from: e.g. a
profile of the 8B proxy showed the compiled cross-entropy chunk at 1.56 ms per call.

Exits 2 with one ``error:`` line when TRACE is missing, not a trace, or holds no kernel events.
"""

from __future__ import annotations

import argparse
import json
import sys
import tarfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_trace(path: Path) -> dict:
    """The trace dict of ``path`` (a Chrome-trace JSON, or a .tgz/.tar.gz whose first .json member is one).
    Raises ValueError with the reason."""
    if not path.is_file():
        raise ValueError(f"no such file: {path}")
    try:
        if path.name.endswith((".tgz", ".tar.gz")):
            with tarfile.open(path) as tar:
                member = next((m for m in tar.getmembers() if m.name.endswith(".json")), None)
                if member is None:
                    raise ValueError(f"{path} holds no .json trace")
                return json.load(tar.extractfile(member))
        return json.loads(path.read_text())
    except (OSError, tarfile.TarError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a trace: {e}") from None


def summarize(trace: dict, top: int = 25) -> dict:
    """``{"span_ms", "kernel_ms", "idle_pct", "rows": [{"name", "ms", "pct", "calls", "mean_us", "category"}]}``
    over the ``cat == "kernel"`` events of ``trace`` (durations in us, as torch.profiler writes them). Raises
    ValueError when there are none."""
    from forgetrain.bench import classify

    ev = [e for e in trace.get("traceEvents", []) if isinstance(e, dict) and e.get("cat") == "kernel"]
    if not ev:
        raise ValueError("the trace holds no kernel events (a CPU profile, or not a torch.profiler trace)")
    agg: dict[str, list] = defaultdict(lambda: [0, 0.0])
    for e in ev:
        a = agg[e["name"]]
        a[0] += 1
        a[1] += float(e["dur"])
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ev)
    busy, (cur_s, cur_e) = 0.0, spans[0]
    for s, t in spans[1:]:  # union of the kernel intervals (streams may overlap)
        if s > cur_e:
            busy, cur_s, cur_e = busy + cur_e - cur_s, s, t
        else:
            cur_e = max(cur_e, t)
    busy += cur_e - cur_s
    span = spans[-1][1] - spans[0][0]
    total = sum(a[1] for a in agg.values())
    rows = [{"name": n, "ms": us / 1e3, "pct": 100.0 * us / total, "calls": c, "mean_us": us / c,
             "category": classify(n)} for n, (c, us) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:top]]
    return {"span_ms": span / 1e3, "kernel_ms": total / 1e3, "idle_pct": 100.0 * (span - busy) / span if span else 0.0,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=Path)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args(argv)
    try:
        if a.top <= 0:
            raise ValueError(f"--top must be positive, got {a.top}")
        s = summarize(load_trace(a.trace), a.top)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"span {s['span_ms']:.1f} ms, kernels {s['kernel_ms']:.1f} ms, GPU idle {s['idle_pct']:.1f}% of the span")
    print(f"{'ms':>9} {'%':>6} {'calls':>6} {'mean_us':>9}  {'category':<16} kernel")
    for r in s["rows"]:
        print(f"{r['ms']:9.2f} {r['pct']:6.1f} {r['calls']:6d} {r['mean_us']:9.1f}  {r['category']:<16} "
              f"{r['name'][:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
