"""scripts/profile_top.py: the per-kernel view of a bench profile trace (synthetic traces, no GPU)."""

from __future__ import annotations

import importlib.util
import io
import json
import tarfile

import pytest

from tests.helpers import ROOT

spec = importlib.util.spec_from_file_location("profile_top", ROOT / "scripts" / "profile_top.py")
pt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pt)


def _trace():
    k = lambda name, ts, dur: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}  # noqa: E731
    return {"traceEvents": [
        k("nvjet_sm90_gemm", 0.0, 600.0), k("nvjet_sm90_gemm", 1000.0, 600.0),
        k("triton_red_fused_exp_gather_log_prepare_softmax_online", 500.0, 200.0),  # overlaps the first GEMM
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 5000.0},  # not a kernel: ignored
    ]}


def test_kernels_are_ranked_by_time_and_idle_is_the_gap_between_their_union():
    """Two GEMM calls (1.2 ms) rank above the CE kernel (0.2 ms); the span is 1.6 ms, the union of the kernel
    intervals 0.7 + 0.6 ms, so 0.3 ms (18.75%) idle; the overlap is not counted as busy twice."""
    s = pt.summarize(_trace())
    assert [(r["name"], r["calls"], r["category"]) for r in s["rows"]] == [
        ("nvjet_sm90_gemm", 2, "GEMM"),
        ("triton_red_fused_exp_gather_log_prepare_softmax_online", 1, "cross-entropy")]
    assert s["span_ms"] == pytest.approx(1.6) and s["kernel_ms"] == pytest.approx(1.4)
    assert s["idle_pct"] == pytest.approx(18.75)
    assert s["rows"][0]["mean_us"] == pytest.approx(600.0) and s["rows"][0]["pct"] == pytest.approx(100 * 12 / 14)


def test_a_tgz_from_a_device_call_is_read(tmp_path):
    data = json.dumps(_trace()).encode()
    path = tmp_path / "call_profile_B.tgz"
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("profile_forged.json")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    assert pt.summarize(pt.load_trace(path), top=1)["rows"][0]["name"] == "nvjet_sm90_gemm"


@pytest.mark.parametrize("content,why", [(None, "no such file"), ("{not json", "is not a trace"),
                                         (json.dumps({"traceEvents": []}), "no kernel events")])
def test_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, content, why):
    path = tmp_path / "t.json"
    if content is not None:
        path.write_text(content)
    assert pt.main([str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and why in err and err.count("\n") == 1
