"""The bad-input sweep: every kind of mistake a user makes on the command line of ``python -m forgetrain`` (and of
``forgetrain.verify`` / ``forgetrain.bench`` where they have their own options) must end with

* exactly one line starting ``error:`` on stderr, naming the problem (``needle``),
* no ``Traceback``, a non-zero exit code,
* nothing written: the output directory does not exist afterwards (or, when it held a run before, is byte for byte
  unchanged), and the working directory stays empty (no ``outputs/``, ``multirun/``, ``.hydra/``, ``cli.log``).

The kinds: bad types, NaN / inf, negative or zero sizes, unknown keys, bad enum values, inconsistent batch sizes
and schedules, parallel layouts this process cannot run, missing or unusable paths, corrupt data and tokenizers,
corrupt or incompatible checkpoints, mistakes inside ``-m`` sweeps, override syntax, verify / bench requests, and
optional extras that are not installed.

Every case runs through the command's real entry point, in a child forked from one process that paid the imports
once (tests/cli_fork.py), so the table costs a second or so per case instead of an interpreter start and more.
The default run takes one or two cases of each kind (FAST_SUBSET, about a minute); ``-m slow`` runs the table.
``test_bad_input_through_python_m`` runs a few of them as plain ``python -m`` processes, so the process boundary
itself is covered too.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import FAST, run
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
SHORT = [*FAST, "train.eval_interval=0", "train.sample_tokens=0", "hardware.peak_tflops=1"]  # no CPU peak timing
T, V, B = "forgetrain", "forgetrain.verify", "forgetrain.bench"
# a tiny, short run: a case whose mistake went unnoticed costs seconds, not a 500-step training
M = ["model=llama_micro", "train.steps=3", "train.micro_batch_size=4", "train.global_batch_size=8",
     "train.eval_interval=0", "train.sample_tokens=0"]

# (id, module, argv, needle in the error line, setup). Placeholders: {out} the case's output directory, {tmp} its
# scratch directory. setup: None, or what is put in place before the command runs (see _setup).
CASES = [
    # bad types
    ("type_int", T, [*M, "train.steps=abc"], "could not be converted to Integer", None),
    ("type_float", T, [*M, "train.lr=fast"], "could not be converted to Float", None),
    ("type_bool", T, [*M, "train.deterministic=maybe"], "train.deterministic", None),
    ("type_float_for_int", T, [*M, "model.hidden_size=1.5"], "model.hidden_size", None),
    ("type_list", T, [*M, "train.micro_batch_size=[1,2]"], "train.micro_batch_size", None),
    ("type_null", T, [*M, "train.steps=null"], "train.steps", None),
    # NaN / inf
    ("nan_lr", T, [*M, "train.lr=nan"], "train.lr must be a finite number", None),
    ("nan_clip", T, [*M, "train.clip_grad=nan"], "train.clip_grad must be a finite number", None),
    ("inf_weight_decay", T, [*M, "train.weight_decay=inf"], "train.weight_decay must be a finite", None),
    ("nan_norm_eps", T, [*M, "model.norm_epsilon=nan"], "model.norm_epsilon must be a finite", None),
    ("inf_rope", T, [*M, "model.rotary_base=-inf"], "model.rotary_base must be a finite", None),
    ("nan_valid_fraction", T, [*M, "data.valid_fraction=nan"], "data.valid_fraction", None),
    ("nan_peak", T, [*M, "hardware.peak_tflops=nan"], "hardware.peak_tflops", None),
    # negative or zero sizes
    ("neg_hidden", T, [*M, "model.hidden_size=-8"], "model.hidden_size must be positive", None),
    ("zero_layers", T, [*M, "model.num_layers=0"], "model.num_layers must be positive", None),
    ("zero_vocab", T, [*M, "model.vocab_size=0"], "model.vocab_size must be positive", None),
    ("neg_seq", T, [*M, "model.seq_length=-1"], "model.seq_length must be positive", None),
    ("zero_micro_batch", T, [*M, "train.micro_batch_size=0"], "train.micro_batch_size must be positive", None),
    ("neg_steps", T, [*M, "train.steps=-5"], "train.steps must be positive", None),
    ("neg_init_std", T, [*M, "model.init_method_std=-0.02"], "model.init_method_std must be positive", None),
    ("neg_seed", T, [*M, "train.seed=-1"], "train.seed must lie in", None),
    ("huge_seed", T, [*M, "train.seed=100000000000000000000000"], "train.seed", None),
    ("zero_eval_iters", T, [*M, "train.eval_interval=1", "train.eval_iters=0"], "train.eval_iters must be positive", None),
    ("neg_save_interval", T, [*M, "train.save_interval=-1"], "train.save_interval must be >= 0", None),
    ("zero_threads", T, [*M, "train.threads=0"], "train.threads must be positive", None),
    ("zero_data_vocab", T, [*M, "data.vocab_size=0"], "data.vocab_size", None),
    ("neg_peak", T, [*M, "hardware.peak_tflops=-1"], "hardware.peak_tflops", None),
    ("zero_timeout", T, [*M, "parallel.timeout_s=0"], "parallel.timeout_s must be positive", None),
    # unknown keys
    ("unknown_key", T, [*M, "train.lrr=1e-3"], "did you mean train.lr?", None),
    ("appended_key", T, [*M, "+train.new=1"], "new", None),
    ("unknown_group_key", T, [*M, "modl.hidden_size=8"], "did you mean model?", None),
    # bad enum values
    ("enum_precision", T, [*M, "train.precision=fp16"], "train.precision must be fp32 or bf16", None),
    ("enum_decay", T, [*M, "train.lr_decay_style=step"], "train.lr_decay_style must be", None),
    ("enum_device", T, [*M, "hardware.device=tpu"], "hardware.device must be cpu or cuda", None),
    ("enum_backend", T, [*M, "parallel.backend=mpi"], "parallel.backend must be auto|gloo|nccl", None),
    ("enum_kernel", T, [*M, "kernels.rmsnorm=cuda"], "kernels.rmsnorm must be one of", None),
    ("enum_engine_mode", T, [*M, "engine.mode=turbo"], "engine.mode must be exact or fast", None),
    ("enum_logger", T, [*M, "logger.name=tensorboard"], "logger must be none or wandb", None),
    ("enum_logger_mode", T, [*M, "logger=wandb", "logger.mode=bogus"], "logger.mode", None),
    ("enum_report_loss", T, [*M, "parallel.report_loss=sum"], "parallel.report_loss must be", None),
    ("unknown_scenario", T, [*M, "scenario=nope"], "unknown scenario 'nope'", None),
    ("unknown_group_option", T, [*M[1:], "model=nope"], "unknown model 'nope' (known: ", None),
    # inconsistent batch sizes and schedules
    ("batch_not_multiple", T, [*M, "train.global_batch_size=10"], "is not a multiple of", None),
    ("batch_below_micro", T, [*M, "train.global_batch_size=2"], "is not a multiple of", None),
    ("warmup_past_decay", T, [*M, "train.lr_warmup_steps=600"],
     "train.lr_warmup_steps=600 must lie in [0, 3) (train.lr_decay_steps, default train.steps; Megatron requires warmup < decay): set train.lr_warmup_steps=2 or fewer, or raise train.steps", None),
    ("min_lr_above_lr", T, [*M, "train.min_lr=1"], "need 0 <= train.min_lr <= train.lr", None),
    ("stop_after_past_steps", T, [*M, "train.stop_after=9999"], "train.stop_after must lie in", None),
    ("stop_after_without_save", T, [*M, "train.stop_after=2", "train.save=false"], "needs train.save=true", None),
    ("neg_decay_steps", T, [*M, "train.lr_decay_steps=-1"], "train.lr_decay_steps", None),
    # parallel layouts this process cannot run
    ("layout_dp2_one_process", T, [*M, "parallel=dp2"], "does not match the world size 1", None),
    ("layout_tp3", T, [*M, "parallel.tensor_parallel_size=3"], "does not match the world size", None),
    ("layout_zero2", T, [*M, "parallel.zero_stage=2"], "parallel.zero_stage must be 0", None),
    ("layout_bucket", T, [*M, "parallel.bucket_size=0"], "parallel.bucket_size must be positive", None),
    ("layout_nccl_on_cpu", T, [*M, "parallel.backend=nccl"], "needs hardware.device=cuda", None),
    ("layout_cuda_without_gpu", T, [*M, "hardware.device=cuda"], "no CUDA device is visible", "no_gpu"),
    # missing or unusable paths
    ("missing_data", T, [*M, "data.path=/nonexistent/ds"], "not found", None),
    ("missing_tokenizer", T, [*M, "data.tokenizer=/nonexistent/tokenizer.json"], "not found", None),
    ("missing_source", T, [*M, "data.source=/nonexistent/corpus.txt"], "/nonexistent/corpus.txt", None),
    ("out_dir_under_a_file", T, [*M, "train.out_dir={tmp}/afile/run"], "is a file, not a directory", "file"),
    ("cache_dir_under_a_file", T, [*M, "data.cache_dir={tmp}/afile/cache"], "afile", "file"),
    ("garbage_tokenizer", T, [*M, "data.tokenizer={tmp}/tok.json"], "not a valid HF tokenizer.json", "tokenizer"),
    ("truncated_idx", T, [*SHORT, "data.path={tmp}/data/train"], "train.idx", "idx_truncated"),
    ("ids_beyond_vocab", T, [*SHORT, "data.path={tmp}/data/train"], "beyond the tokenizer's vocabulary", "bin_ids"),
    ("vocab_above_model", T, [*SHORT, "model.vocab_size=100"], "exceeds model.vocab_size=100", None),
    ("error_in_a_dir_made_before", T, [*SHORT, "model.vocab_size=100"], "exceeds model.vocab_size", "empty_out"),
    # corrupt or incompatible checkpoints (the output directory holds a finished run, which must not change)
    ("resume_without_checkpoint", T, [*SHORT, "train.resume=true"],
     "no complete checkpoint under", None),
    ("resume_garbage_metadata", T, [*SHORT, "train.steps=8", "train.resume=true"], "cannot load checkpoint",
     "run_metadata"),
    ("resume_empty_harness", T, [*SHORT, "train.steps=8", "train.resume=true"], "cannot load checkpoint",
     "run_harness"),
    ("resume_other_shape", T, [*SHORT, "train.steps=8", "model.num_layers=3", "train.resume=true"],
     "cannot load checkpoint", "run"),
    ("resume_other_global_batch", T, [*SHORT, "train.steps=8", "train.global_batch_size=16", "train.resume=true"],
     "asks for 16", "run"),
    ("resume_beyond_steps", T, [*SHORT, "train.steps=4", "train.resume=true"], "beyond train.steps=4", "run"),
    ("fresh_run_on_a_used_dir", T, [*SHORT], "already holds a run", "run"),
    # mistakes inside -m sweeps (nothing may be written: no multirun/ directory either)
    ("sweep_unknown_key", T, ["-m", *M, "train.lrr=1e-3,2e-3"], "did you mean train.lr?", "no_out_dir"),
    ("sweep_bad_value", T, ["-m", *M, "train.lr=1e-3,abc"], "sweep job #1 (train.lr=abc)", "no_out_dir"),
    ("sweep_invalid_job", T, ["-m", *M, "train.steps=2,0"], "train.steps must be positive", "no_out_dir"),
    ("sweep_shared_out_dir", T, ["-m", *M, "train.lr=1e-3,2e-3"], "would share the output directory", None),
    # override syntax
    ("syntax_no_equals", T, [*M, "train.lr"], "Error parsing override 'train.lr'", None),
    ("syntax_bad_value", T, [*M, "train.lr=("], "Error parsing override", None),
    # verify and bench requests
    ("verify_unknown_tier", V, [*M, "tier=nope"],
     "unknown tier 'nope' (known: bitwise, loss_curve, surpass, tolerance)", None),
    ("verify_unknown_reference", V, [*M, "verify.reference=nope"], "unknown reference 'nope'", None),
    ("verify_speed_baseline", V, [*M, "verify.reference=torch_compile"], "is a speed baseline for bench", None),
    ("verify_resume_at", V, [*M, "verify.resume_at=9", "verify.steps=4"], "verify.resume_at=9 must lie in", None),
    ("verify_negative_steps", V, [*M, "verify.steps=-3"], "verify.steps must be a positive integer", None),
    ("verify_zero_curve_steps", V, [*M, "tier=loss_curve", "verify.curve_steps=0"],
     "verify.curve_steps must be a positive integer", None),
    ("verify_too_few_seeds", V, [*M, "tier=loss_curve", "verify.seeds=[1]"], "needs >= 3 reference seeds", None),
    ("verify_bad_train_value", V, [*M, "train.lr=nan"], "train.lr must be a finite number", None),
    ("verify_missing_golden", V, [*M, "verify.golden=true", "train.seed=7"], "no golden at", None),
    ("verify_deepspeed_not_installed", V, [*M, "verify.reference=deepspeed"], "pip install -e '.[deepspeed]'",
     "block:deepspeed"),
    ("verify_torchtitan_not_installed", V, [*M, "verify.reference=torchtitan"], "pip install -e '.[torchtitan]'",
     "block:torchtitan"),
    # a forged kernel (the Hopper scenarios' fast default runs Triton kernels; the first one checked, the packed
    # SwiGLU since llama1b_h200 runs it, is named) without Triton installed
    ("train_triton_not_installed", T, [*M, "scenario=llama1b_h200", "hardware=cpu", "engine.compile=false",
                                       "train.lr_warmup_steps=1"],
     "kernels.swiglu=triton needs the optional 'kernels' extra", "block:triton"),
    ("bench_zero_steps", B, [*M, "bench.steps=0"], "bench.steps must be >= 1", None),
    ("bench_unknown_reference", B, [*M, "bench.against=[nope]"], "unknown reference 'nope'", None),
    ("bench_interleave", B, [*M, "bench.interleave=bogus"], "bench.interleave must be", None),
    ("bench_torchtitan_not_installed", B, [*M, "bench.against=[torchtitan]"], "pip install -e '.[torchtitan]'",
     "block:torchtitan"),
]

OUT_KEY = {T: "train.out_dir", V: "verify.out_dir", B: "bench.out_dir"}
# one or two of each kind, in the default run (about a minute); the whole table is marked slow
FAST_SUBSET = {"type_int", "nan_clip", "nan_peak", "neg_init_std", "huge_seed", "unknown_key", "enum_logger_mode",
               "batch_not_multiple", "neg_decay_steps", "layout_dp2_one_process", "out_dir_under_a_file",
               "missing_source", "ids_beyond_vocab", "resume_garbage_metadata", "fresh_run_on_a_used_dir",
               "sweep_bad_value", "syntax_no_equals", "verify_deepspeed_not_installed", "verify_torchtitan_not_installed",
               "verify_missing_golden", "verify_negative_steps", "bench_unknown_reference",
               "train_triton_not_installed"}


def _snapshot(path: Path) -> dict | None:
    """Every file under ``path`` (relative name -> size, mtime, sha256), or None when ``path`` does not exist."""
    if not path.exists():
        return None
    snap = {}
    for p in sorted(path.rglob("*")):
        if p.is_file():
            st = p.stat()
            snap[str(p.relative_to(path))] = (st.st_size, st.st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        else:
            snap[str(p.relative_to(path)) + "/"] = None
    return snap


def _damage(out: Path, how: str) -> None:
    for ck in sorted((out / "checkpoints").glob("step_*")):
        if how == "metadata":
            (ck / ".metadata").write_bytes(os.urandom(256))
        else:
            (ck / "harness.json").write_text("{}")


def _setup(setup: str | None, tmp: Path, out: Path, finished: Path) -> None:
    from forgetrain.config import DataConfig
    from forgetrain.data import prepare
    from tests.helpers import write_dataset

    if setup in ("run", "run_metadata", "run_harness"):
        shutil.copytree(finished, out)
        if setup != "run":
            _damage(out, setup.split("_")[1])
    elif setup == "empty_out":
        out.mkdir()
    elif setup == "file":
        (tmp / "afile").write_text("a file, not a directory\n")
    elif setup == "tokenizer":
        (tmp / "tok.json").write_text('{"model": {"type": "BPE", "vocab": ')
    elif setup in ("idx_truncated", "bin_ids"):
        prep = prepare(DataConfig(), progress=False)
        (tmp / "data").mkdir()
        shutil.copy(prep.tokenizer_path, tmp / "data" / "tokenizer.json")
        if setup == "bin_ids":
            ids = np.fromfile(prep.train_prefix + ".bin", dtype=np.uint16)
            ids[len(ids) // 2] = prep.vocab_size + 5
            write_dataset(tmp / "data" / "train", [ids])
        else:
            for ext in (".bin", ".idx"):
                data = Path(prep.train_prefix + ext).read_bytes()
                (tmp / "data" / f"train{ext}").write_bytes(data[: len(data) // 2] if ext == ".idx" else data)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 6-step run with checkpoints at steps 3 and 6 (copied by each case that needs one)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    p = run([*SHORT, f"train.out_dir={out}"])
    assert p.returncode == 0, p.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def swept(request, tmp_path_factory):
    """The selected cases of CASES, run once through tests/cli_fork.py. Returns {id: (needle, setup, out dir, working
    dir, snapshot of the out dir before, result)}."""
    if not hasattr(os, "fork"):
        pytest.skip("the batched runner forks")
    wanted = {it.callspec.params["cid"] for it in request.session.items
              if it.module is request.module and "cid" in getattr(getattr(it, "callspec", None), "params", {})}
    selected = [c for c in CASES if c[0] in wanted]
    finished = request.getfixturevalue("finished") if any((c[4] or "").startswith("run") for c in selected) else None
    base = tmp_path_factory.mktemp("sweep")
    cases, meta = [], {}
    for cid, module, argv, needle, setup in selected:
        tmp = base / cid
        cwd, out = tmp / "cwd", tmp / "out"
        cwd.mkdir(parents=True)
        _setup(setup, tmp, out, finished)
        argv = [a.format(tmp=tmp, out=out) for a in argv]
        if setup not in ("no_out_dir",) and not any(a.startswith(OUT_KEY[module] + "=") for a in argv):
            argv.append(f"{OUT_KEY[module]}={out}")
        blocked = setup.split(":", 1)[1].split(",") if setup and setup.startswith("block:") else []
        cases.append({"id": cid, "module": module, "argv": argv, "cwd": str(cwd), "block": blocked})
        meta[cid] = (needle, setup, out, cwd, _snapshot(out))
    (base / "cases.json").write_text(json.dumps(cases))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    if any(s == "no_gpu" for *_, s in selected):
        env["CUDA_VISIBLE_DEVICES"] = ""
    p = subprocess.run([sys.executable, str(ROOT / "tests" / "cli_fork.py"), str(base / "cases.json"),
                        str(base / "results.json")], env=env, cwd=base, capture_output=True, text=True,
                       timeout=hang_s())
    assert p.returncode == 0, p.stderr[-3000:]
    results = json.loads((base / "results.json").read_text())
    return {cid: (*meta[cid], results[cid]) for cid in meta}


def test_the_sweep_covers_at_least_44_kinds():
    assert len(CASES) >= 44 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("cid", [c[0] if c[0] in FAST_SUBSET else pytest.param(c[0], marks=pytest.mark.slow)
                                 for c in CASES])
def test_bad_input(swept, cid):
    needle, setup, out, cwd, before, res = swept[cid]
    err = res["stderr"]
    assert res["rc"] not in (0, "timeout"), (res["rc"], err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1, err[-3000:]
    assert needle in lines[0], lines[0]
    assert _snapshot(out) == before, f"{out} changed: {before and sorted(before)} -> {sorted(_snapshot(out) or [])}"
    assert not list(cwd.iterdir()), f"written into the working directory: {sorted(cwd.rglob('*'))}"


@pytest.mark.parametrize("args", [
    [*M, "train.clip_grad=nan"],
    ["-m", *M, "train.lrr=1e-3,2e-3"],
])
def test_bad_input_through_python_m(args, tmp_path):
    """The same checks on plain ``python -m forgetrain`` processes (the batched runner forks instead)."""
    out = tmp_path / "out"
    p = run([*args, f"train.out_dir={out}"] if "-m" not in args else args, cwd=tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert len([x for x in p.stderr.splitlines() if x.startswith("error:")]) == 1, p.stderr
    assert sorted(tmp_path.iterdir()) == [], sorted(tmp_path.rglob("*"))
