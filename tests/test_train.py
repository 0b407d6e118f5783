"""The main job end to end: CLI in a subprocess, bitwise resume, sweeps, W&B offline, and every bad input."""

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FAST, records, run
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
NUMERIC = ("step", "loss", "grad_norm", "lr", "tokens", "val_loss", "digests")


def numeric(recs):
    return [{k: r[k] for k in NUMERIC if k in r} for r in recs]


def test_cli_trains_end_to_end(tmp_path):
    out = tmp_path / "run"
    p = run([*FAST, f"train.out_dir={out}"])
    assert p.returncode == 0, p.stderr[-2000:]
    recs = records(out)
    assert [r["step"] for r in recs] == list(range(1, 7))
    for key in ("loss", "grad_norm", "lr", "tokens", "step_s", "tokens_per_s", "mfu_pct"):
        assert key in recs[0]
    assert "val_loss" in recs[2] and "val_loss" in recs[5]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["sample"].startswith("ROMEO.")
    assert (out / "trace" / "final.safetensors").exists() and (out / "loss.png").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000006"
    assert "=== summary ===" in p.stderr and "measured CPU matmul peak" in p.stderr


def test_loss_falls_on_real_text(tmp_path):
    out = tmp_path / "run"
    p = run(["model=llama_micro", "train.steps=40", "train.lr_warmup_steps=4", "train.lr=1e-2", "train.min_lr=1e-3",
             "train.eval_interval=0", "train.sample_tokens=0", f"train.out_dir={out}"])
    assert p.returncode == 0, p.stderr[-2000:]
    recs = records(out)
    assert recs[0]["loss"] > 8.0  # ~ ln(4096) = 8.32
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.5


def test_resume_is_bitwise(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    assert run([*FAST, "train.digests=true", f"train.out_dir={full}"]).returncode == 0
    p1 = run([*FAST, "train.digests=true", "train.stop_after=3", f"train.out_dir={part}"])
    assert p1.returncode == 0, p1.stderr[-2000:]
    assert len(records(part)) == 3
    # the stop says how to go on: the whole command, with the run's own overrides (a resume given only
    # train.resume and train.out_dir would re-time the schedule with the defaults' train.steps)
    line = next(x for x in p1.stderr.splitlines() if x.startswith("stopped after step 3 of 6 (train.stop_after=3)"))
    assert "last checkpoint: step_000003 (continue with: python -m forgetrain " in line, line
    cmd = shlex.split(line.split("continue with: ", 1)[1].rstrip(")"))
    assert cmd[:3] == ["python", "-m", "forgetrain"] and cmd[-2:] == ["train.resume=true", f"train.out_dir={part}"]
    assert "train.stop_after=3" not in cmd and "train.steps=6" in cmd and "train.digests=true" in cmd, cmd
    p2 = run(cmd[3:])  # the printed command, as printed
    assert p2.returncode == 0, p2.stderr[-2000:]
    assert "resumed from" in p2.stderr and "already complete" not in p2.stderr
    assert "settings different from the checkpoint's" not in p2.stderr, p2.stderr[-2000:]
    assert numeric(records(part)) == numeric(records(full))
    p3 = run([*FAST, "train.digests=true", "train.resume=true", f"train.out_dir={part}"])  # nothing left to do
    assert p3.returncode == 0 and "the run is already complete (train.steps=6, " in p3.stderr, p3.stderr[-2000:]
    assert numeric(records(part)) == numeric(records(full))


def test_resume_with_another_config_names_what_changed(tmp_path):
    """A resume whose config hash differs from the checkpoint's says which settings changed, not only the hashes."""
    out = tmp_path / "run"
    base = ["model=llama_micro", "train.lr_warmup_steps=1", "train.micro_batch_size=4", "train.global_batch_size=8",
            "train.eval_interval=0", "train.sample_tokens=0", "train.save_interval=2", f"train.out_dir={out}"]
    p1 = run([*base, "train.steps=4", "train.stop_after=2"])
    assert p1.returncode == 0, p1.stderr[-2000:]
    p2 = run([*base, "train.steps=6", "train.lr=2e-3", "train.resume=true"])
    assert p2.returncode == 0, p2.stderr[-2000:]
    line = next(x for x in p2.stderr.splitlines() if "different from the checkpoint's" in x)
    assert line.startswith("warning: resuming step_000002 with settings")  # a console line, not a log record
    assert "train.lr " in line and "-> 0.002" in line and "train.steps 4 -> 6" in line, line
    assert "model." not in line  # only what differs


def test_config_changes_lists_only_the_differences():
    from forgetrain.train import config_changes

    old = {"train": {"lr": 1e-3, "steps": 6}, "model": {"h": 64}}
    new = {"train": {"lr": 1e-3, "steps": 9, "extra": 1}, "model": {"h": 64}}
    assert config_changes(old, new) == ["train.extra <absent> -> 1", "train.steps 6 -> 9"]
    assert config_changes(old, old) == []


def test_resume_without_checkpoint_is_one_line_error(tmp_path):
    p = run([*FAST, "train.resume=true", f"train.out_dir={tmp_path / 'none'}"])
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1].startswith("error: train.resume=true but no complete checkpoint")
    assert "train.overwrite=true" in p.stderr.strip().splitlines()[-1]  # the way out, not back to train.resume


@pytest.mark.parametrize("path", ["/r/x,y", "/r/run(1)", "/r/k=v", "/r/it's", "/r/a b", "/r/back\\slash",
                                  "/r/end\\", "/r/q\\'x", "/r/plain-dir_1.2"])
def test_the_resume_command_quotes_out_dir_for_the_shell_and_hydra(path):
    """The printed ``train.out_dir=`` token, split as a shell splits it and parsed as Hydra parses an override,
    gives the directory back (Hydra reads ``,`` ``(`` ``=`` ``'`` and spaces as grammar)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from forgetrain.run.resume import resume_command

    token = shlex.split(resume_command(Path(path)))[-1]
    assert OverridesParser.create().parse_override(token).value() == path


def test_a_refused_resume_leaves_no_directory_it_made(tmp_path):
    """The directory lock makes ``train.out_dir`` and its missing parents; a run refused before writing removes
    them all, and none of the parents that existed before."""
    p = run([*FAST, "train.resume=true", f"train.out_dir={tmp_path / 'a' / 'b' / 'c'}"])
    assert p.returncode == 2 and "no complete checkpoint" in p.stderr
    assert list(tmp_path.iterdir()) == []


def test_resume_without_checkpoint_is_refused_before_the_data_and_engine(tmp_path, monkeypatch):
    """The refusal comes before :func:`forgetrain.run.phases.setup` (data preparation, engine build) runs."""
    import forgetrain.train as train_mod
    from forgetrain.config import RunConfig, TrainConfig
    from forgetrain.errors import CheckpointError

    monkeypatch.setattr(train_mod, "setup", lambda *a, **k: pytest.fail("data and engine prepared first"))
    cfg = RunConfig(train=TrainConfig(resume=True, out_dir=str(tmp_path / "none")))
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        train_mod.train(cfg)
    assert not (tmp_path / "none").exists()  # nothing written


def test_sweep_runs_every_value(tmp_path):
    p = run(["-m", *FAST, "train.steps=2", "train.save_interval=0", "train.sample_tokens=0",
             "train.lr=1e-3,3e-3", f"hydra.sweep.dir={tmp_path}"])
    assert p.returncode == 0, p.stderr[-2000:]
    for job in ("0", "1"):
        assert (tmp_path / job / "trace" / "trace.jsonl").exists()
    from omegaconf import OmegaConf

    lrs = sorted(float(OmegaConf.load(tmp_path / j / ".hydra" / "config.yaml").train.lr) for j in "01")
    assert lrs == [1e-3, 3e-3]


def test_wandb_offline(tmp_path):
    out = tmp_path / "run"
    p = run([*FAST, "train.steps=2", "train.sample_tokens=0", "logger=wandb", f"train.out_dir={out}"])
    assert p.returncode == 0, p.stderr[-2000:]
    runs = list((out / "wandb").glob("offline-run-*"))
    assert runs, "W&B must log offline by default"
    where = [x for x in p.stderr.splitlines() if x.startswith("W&B run ")]  # where it went, and how to upload it
    assert len(where) == 1 and f"wandb sync {out / 'wandb'}/offline-run-*" in where[0], p.stderr[-2000:]


def _truncated(tmp_path, suffix):
    from forgetrain.config import DataConfig
    from forgetrain.data import prepare

    prep = prepare(DataConfig(), progress=False)
    dst = tmp_path / "data" / "train"
    dst.parent.mkdir()
    for ext in (".bin", ".idx"):
        data = Path(prep.train_prefix + ext).read_bytes()
        if ext == suffix:
            data = data[: len(data) // 2]
        (dst.parent / ("train" + ext)).write_bytes(data)
    return str(dst), prep.tokenizer_path


BAD = {
    "unknown_scenario": (["scenario=nope"], "unknown scenario 'nope'"),
    "heads_not_dividing_hidden": (["model.num_attention_heads=7"], "does not divide model.hidden_size"),
    "groups_not_dividing_heads": (["model.num_query_groups=3"], "does not divide model.num_attention_heads"),
    "global_batch": (["train.global_batch_size=12"], "is not a multiple of"),
    "missing_data": (["data.path=/nonexistent/ds"], "not found"),
    "unknown_key": (["train.foo=1"], "Key 'foo' not in 'TrainConfig'"),
    "log_interval": (["train.log_interval=0"], "train.log_interval must be positive"),
    "eval_iters": (["train.eval_iters=0"], "train.eval_iters must be positive"),
    "threads": (["train.threads=-1"], "train.threads must be positive"),
    "adam_eps": (["train.adam_eps=0"], "train.adam_eps > 0"),
    "adam_beta1": (["train.adam_beta1=2"], "train.adam_beta1"),
    "stop_after": (["train.stop_after=-2"], "train.stop_after must lie in"),
    "backend": (["parallel.backend=bogus"], "parallel.backend must be auto|gloo|nccl"),
    "nccl_on_cpu": (["parallel.backend=nccl"], "parallel.backend=nccl needs hardware.device=cuda"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_line(case, tmp_path):
    args, needle = BAD[case]
    out = tmp_path / "out"
    p = run([*args, f"train.out_dir={out}"], cwd=tmp_path)
    assert p.returncode == 2, (p.returncode, p.stderr[-1500:])
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], p.stderr
    assert not out.exists() and not (tmp_path / "outputs").exists(), "bad input must write nothing"


@pytest.mark.parametrize("suffix", [".idx", ".bin"])
def test_truncated_dataset_is_one_line(suffix, tmp_path):
    prefix, tok = _truncated(tmp_path, suffix)
    out = tmp_path / "out"
    p = run([*FAST, f"data.path={prefix}", f"data.tokenizer={tok}", f"train.out_dir={out}"], cwd=tmp_path)
    assert p.returncode == 2, p.stderr[-1500:]
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert lines[-1].startswith("error: ") and "Traceback" not in p.stderr
    assert suffix in lines[-1] or "truncated" in lines[-1] or "corrupt" in lines[-1], lines[-1]
    assert not (out / "trace").exists() and not (out / "checkpoints").exists()


def test_default_output_dir_is_hydras_run_dir(tmp_path):
    """The quick-start path: no train.out_dir, outputs land in outputs/<scenario>/<date>_<time>/."""
    p = run([*FAST, "train.steps=2", "train.sample_tokens=0", "train.eval_interval=0"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    runs = list((tmp_path / "outputs" / "llama_tiny_cpu").glob("*/trace/trace.jsonl"))
    assert len(runs) == 1 and len(runs[0].read_text().splitlines()) == 2


def test_wandb_resume_continues_the_same_run(tmp_path):
    """A resumed run continues its W&B run (the id is stored with the checkpoint), says where it logs and how to
    sync, and names the steps it redoes past the checkpoint."""
    out = tmp_path / "run"
    args = [*FAST, "train.sample_tokens=0", "train.eval_interval=0", "logger=wandb", f"train.out_dir={out}"]
    p1 = run([*args, "train.stop_after=3"], cwd=tmp_path)
    assert p1.returncode == 0, p1.stderr[-2000:]
    m = re.search(r"W&B run (\w+) \(new\): .*wandb sync", p1.stderr)
    assert m, p1.stderr[-2000:]
    trace = out / "trace" / "trace.jsonl"
    lines = trace.read_text().splitlines()
    trace.write_text("\n".join(lines + [lines[-1].replace('"step": 3', '"step": 4')]) + "\n")  # a step past it
    p2 = run([*args, "train.resume=true"], cwd=tmp_path)
    assert p2.returncode == 0, p2.stderr[-2000:]
    assert f"W&B run {m.group(1)} (resumed)" in p2.stderr, p2.stderr[-2000:]
    assert "steps 4-4 ran before the stop and are run again" in p2.stderr and m.group(1) in p2.stderr
    runs = sorted((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(m.group(1)) for r in runs), runs


@pytest.mark.parametrize("module,own", [
    ("forgetrain", ["train.steps=", "train.global_batch_size=", "train.resume="]),
    ("forgetrain.verify", ["verify.reference=", "verify.steps=", "tier: bitwise"]),
    ("forgetrain.bench", ["bench.against=", "bench.steps="]),
    ("forgetrain.forge", ["forge.max_rounds=", "forge.target_tier=", "agent.command="]),
])
def test_help_says_what_the_command_does(module, own, tmp_path):
    """--help: the command's own text (what it does, its options with their meaning, the config groups), not
    Hydra's generic dump; nothing written."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", module, "--help", "model=llama_micro"], cwd=tmp_path, env=env,
                       text=True, capture_output=True, timeout=hang_s())
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "powered by Hydra" not in p.stdout and p.stdout.startswith(f"python -m {module} "), p.stdout[:500]
    for key in own:
        assert key in p.stdout, (key, p.stdout)
    assert "model: llama1b, llama8b, llama_micro, llama_tiny" in p.stdout and "--hydra-help" in p.stdout
    assert "  mode: exact, fast_base" in p.stdout  # a @package _global_ group, listed from the defaults list
    options = [x for x in p.stdout.splitlines() if x.startswith("  ") and "=" in x.split()[0]]
    assert len(options) >= 4 and sum(len(x.split(None, 1)) == 2 for x in options) >= 3, options  # with meanings
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("config_name", ["config", "verify", "bench", "forge"])
def test_no_command_writes_an_empty_log_file(config_name):
    """Hydra's default job logging writes <run dir>/cli.log, which stays empty (ForgeTrain logs to the console):
    every command logs to the console only; training, verify and bench write .hydra/ themselves once the run is
    on (a rejected run writes nothing)."""
    from hydra import compose, initialize_config_dir

    from forgetrain.cli import CONF_DIR
    from forgetrain.config import register_configs

    register_configs()
    if config_name != "config":
        __import__(f"forgetrain.{config_name}", fromlist=["register"]).register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name=config_name, return_hydra_config=True)
    handlers = cfg.hydra.job_logging.handlers
    assert all("filename" not in h for h in handlers.values()), dict(handlers)
    if config_name != "forge":
        assert cfg.hydra.output_subdir is None


def test_a_busy_cpu_gets_a_one_thread_hint():
    """A multi-threaded CPU run on a machine loaded beyond its cores is told that train.threads=1 is faster; a
    single thread, an idle machine or a GPU run is told nothing."""
    from forgetrain.run.phases import busy_cpu_hint

    hint = busy_cpu_hint("cpu", 2, load=9.5, cores=2)
    assert hint.startswith("note:") and "train.threads=1" in hint and "9.5 on 2 cores" in hint
    assert busy_cpu_hint("cpu", 1, load=9.5, cores=2) is None
    assert busy_cpu_hint("cpu", 2, load=1.5, cores=2) is None
    assert busy_cpu_hint("cuda", 8, load=99.0, cores=2) is None
