"""Bad states a user meets after the first run: a reused output directory, damaged checkpoints and pointers, a
resume past the end, a diverging run, and bad bench / verify requests. Each must end in one line and a non-zero
exit, and must never cost a good checkpoint."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import FAST, records, run, stand_in_task
from tests.limits import hang_s

ROOT = Path(__file__).resolve().parent.parent
SHORT = [*FAST, "train.eval_interval=0", "train.sample_tokens=0"]


def _last_line(p: subprocess.CompletedProcess) -> str:
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 6-step run with checkpoints at steps 3 and 6 (copied by each test that damages it)."""
    out = tmp_path_factory.mktemp("finished") / "run"
    p = run([*SHORT, f"train.out_dir={out}"])
    assert p.returncode == 0, p.stderr[-2000:]
    return out


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(src, dst)
    return dst


def test_fresh_run_refuses_a_used_out_dir(finished, tmp_path):
    out = _copy(finished, tmp_path)
    before = (out / "trace" / "trace.jsonl").read_bytes()
    p = run([*SHORT, "train.steps=4", f"train.out_dir={out}"])
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "already holds a run" in _last_line(p) and "train.resume=true" in _last_line(p)
    assert (out / "trace" / "trace.jsonl").read_bytes() == before
    assert sorted(d.name for d in (out / "checkpoints").glob("step_*")) == ["step_000003", "step_000006"]


def test_overwrite_replaces_the_old_run_and_keeps_its_own_checkpoints(finished, tmp_path):
    out = _copy(finished, tmp_path)
    p = run([*SHORT, "train.steps=4", "train.save_interval=1", "train.overwrite=true", f"train.out_dir={out}"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert [r["step"] for r in records(out)] == [1, 2, 3, 4]
    assert sorted(d.name for d in (out / "checkpoints").glob("step_*")) == ["step_000003", "step_000004"]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_000004"


@pytest.mark.parametrize("damage", ["garbage", "binary", "missing_dir", "deleted", "is_dir"])
def test_damaged_latest_pointer_falls_back_to_newest_complete_checkpoint(damage, finished, tmp_path):
    out = _copy(finished, tmp_path)
    ptr = out / "checkpoints" / "latest"
    if damage == "garbage":
        ptr.write_text("not a checkpoint\n")
    elif damage == "binary":
        ptr.write_bytes(os.urandom(64) + b"\xff\xfe")
    elif damage == "missing_dir":
        ptr.write_text("step_000099\n")
    elif damage == "deleted":
        ptr.unlink()
    else:
        ptr.unlink()
        ptr.mkdir()
    p = run([*SHORT, "train.steps=8", "train.resume=true", f"train.out_dir={out}"])
    assert p.returncode == 0, p.stderr[-2000:]
    assert "resumed from" in p.stderr and "step_000006" in p.stderr
    assert [r["step"] for r in records(out)] == list(range(1, 9))


def _damage(ck: Path, damage: str) -> None:
    if damage == "bad_harness":
        (ck / "harness.json").write_text("{}")
    elif damage == "random_metadata":
        (ck / ".metadata").write_bytes(os.urandom(300))
    else:
        shard = sorted(ck.glob("*.distcp"))[0]
        data = shard.read_bytes()
        shard.write_bytes(data[: len(data) // 2] if damage == "truncated_shard" else b"")


DAMAGES = ["truncated_shard", "empty_shard", "bad_harness", "random_metadata"]


@pytest.mark.parametrize("damage", DAMAGES)
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(damage, finished, tmp_path):
    """A damaged newest checkpoint with an intact older one: resume from the older one, with one warning line naming
    both (and why), and no library traceback (DCP logs one per metadata it fails to read)."""
    out = _copy(finished, tmp_path)
    _damage(out / "checkpoints" / "step_000006", damage)
    p = run([*SHORT, "train.steps=8", "train.resume=true", f"train.out_dir={out}"])
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    about = [x for x in p.stderr.splitlines() if "step_000006" in x]
    assert len(about) == 1, about
    assert about[0].startswith("warning: checkpoint step_000006 is damaged; resuming from step_000003 instead ("), about
    assert "resumed from" in p.stderr and "step_000003" in p.stderr
    assert [r["step"] for r in records(out)] == list(range(1, 9))


@pytest.mark.parametrize("damage", DAMAGES)
def test_every_checkpoint_corrupt_is_one_line(damage, finished, tmp_path):
    out = _copy(finished, tmp_path)
    for step in ("step_000003", "step_000006"):
        _damage(out / "checkpoints" / step, damage)
    p = run([*SHORT, "train.steps=8", "train.resume=true", f"train.out_dir={out}"])
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    line = _last_line(p)
    assert line.startswith("error: cannot load checkpoint") and "step_000006" in line, line
    assert "the 1 older checkpoint" in line and "does not load either" in line, line


def test_resume_with_another_model_shape_is_one_line(finished, tmp_path):
    out = _copy(finished, tmp_path)
    p = run([*SHORT, "train.steps=8", "model.num_layers=3", "train.resume=true", f"train.out_dir={out}"])
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert _last_line(p).startswith("error: cannot load checkpoint") and "match" in _last_line(p)


def test_resume_beyond_train_steps_is_one_line(finished, tmp_path):
    out = _copy(finished, tmp_path)
    p = run([*SHORT, "train.steps=4", "train.resume=true", f"train.out_dir={out}"])
    assert p.returncode == 2 and "beyond train.steps=4" in _last_line(p), p.stderr[-1500:]


def _snapshot(d: Path) -> dict:
    return {str(f.relative_to(d)): (f.read_bytes(), f.stat().st_mtime_ns) for f in sorted(d.rglob("*")) if f.is_file()}


def test_resuming_a_finished_run_changes_nothing(finished, tmp_path):
    """A resume of a run already at train.steps says so and exits 0 without writing anything: no config record, no
    W&B run, no second export, no summary.json rewritten (it had kept the old one with "val_loss": null)."""
    out = _copy(finished, tmp_path)
    before = _snapshot(out)
    p = run([*SHORT, "logger=wandb", "train.resume=true", f"train.out_dir={out}"], cwd=tmp_path)
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "the run is already complete (train.steps=6, checkpoint step_000006); nothing to do" in p.stderr, \
        p.stderr[-2000:]
    assert "=== summary ===" not in p.stderr and "W&B run" not in p.stderr, p.stderr[-2000:]
    assert _snapshot(out) == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["run"]  # nothing beside it either (Hydra's outputs/)


def test_divergence_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    from forgetrain.errors import DivergenceError
    from forgetrain.train import train
    from scenarios.llama_tiny_cpu.engine import Engine
    from tests.helpers import ladder_cfg as _cfg

    class DivergesAtStep3(Engine):
        def train_step(self, micro_batches):
            res = super().train_step(micro_batches)
            if self.completed_steps == 3:
                res.loss = math.nan
            return res

    import dataclasses

    c = _cfg()
    c = dataclasses.replace(c, train=dataclasses.replace(c.train, steps=6, save_interval=2, sample_tokens=0,
                                                         eval_interval=0, out_dir=str(tmp_path / "run")))
    with pytest.raises(DivergenceError, match="loss is nan at step 3.*last checkpoint: step_000002 "
                                              r"\(continue with: train.resume=true"):
        train(c, progress=False, engine_cls=DivergesAtStep3)
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000002"
    c = dataclasses.replace(c, train=dataclasses.replace(c.train, save_interval=100, overwrite=True))
    with pytest.raises(DivergenceError, match="no checkpoint was written yet .* nothing to resume"):
        train(c, progress=False, engine_cls=DivergesAtStep3)


def test_ctrl_c_checkpoints_the_step_it_stops_after_and_resumes_from_it(tmp_path):
    """A Ctrl-C between two due saves still leaves the step it stops after on disk (Megatron's exit signal handler
    saves before exiting): nothing finished is lost, and the printed command resumes from that step. Under
    train.save=false the hint says to start again with train.overwrite=true."""
    import dataclasses
    import signal

    from forgetrain.errors import Interrupted
    from forgetrain.train import train
    from scenarios.llama_tiny_cpu.engine import Engine
    from tests.helpers import ladder_cfg as _cfg

    class CtrlCAtStep3(Engine):
        def train_step(self, micro_batches):
            res = super().train_step(micro_batches)
            if self.completed_steps == 3:
                signal.raise_signal(signal.SIGINT)  # the training loop's handler: a request, read at the boundary
            return res

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        c = _cfg()
        c = dataclasses.replace(c, train=dataclasses.replace(c.train, steps=6, save_interval=100, sample_tokens=0,
                                                             eval_interval=0, out_dir=str(tmp_path / "run")))
        with pytest.raises(Interrupted, match=r"after step 3 \(Ctrl-C\); last checkpoint: step_000003 "):
            train(c, progress=False, engine_cls=CtrlCAtStep3)
        assert len(records(tmp_path / "run")) == 3
        train(dataclasses.replace(c, train=dataclasses.replace(c.train, resume=True)), progress=False)
        assert [r["step"] for r in records(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]
        c = dataclasses.replace(c, train=dataclasses.replace(c.train, save=False, overwrite=True))
        with pytest.raises(Interrupted, match="nothing to resume: start again, the same command with "
                                              "train.overwrite=true"):
            train(c, progress=False, engine_cls=CtrlCAtStep3)
    finally:
        signal.signal(signal.SIGINT, inherited)


def _module(mod: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", mod, *args], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=hang_s())


@pytest.mark.parametrize("args,needle", [
    (["bench.steps=0"], "bench.steps must be >= 1"),
    (["bench.warmup=-1"], "bench.warmup must be >= 0"),
    (["bench.interleave=bogus"], "bench.interleave must be auto|always|never"),
])
def test_bad_bench_request_is_one_line(args, needle, tmp_path):
    p = _module("forgetrain.bench", ["model=llama_micro", *args, f"bench.out_dir={tmp_path / 'b'}"], tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-1500:]
    assert needle in _last_line(p), _last_line(p)


@pytest.mark.parametrize("args,needle", [
    (["verify.reference=torch_compile"], "is a speed baseline for bench"),
    (["verify.digests=false", "tier=bitwise"], "tier=bitwise compares per-step digests"),
    (["verify.resume_at=4", "verify.steps=4"], "verify.resume_at=4 must lie in"),
])
def test_bad_verify_request_is_one_line_before_any_run(args, needle, tmp_path):
    out = tmp_path / "v"
    p = _module("forgetrain.verify", ["model=llama_micro", *args, f"verify.out_dir={out}"], tmp_path)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-1500:]
    assert needle in _last_line(p), _last_line(p)
    assert not (out / "reference").exists(), "the request must be refused before the reference runs"


@pytest.mark.parametrize("override,needle", [
    ("forge.out_dir={tmp}/a_file/run", "forge.out_dir={tmp}/a_file/run cannot be created: {tmp}/a_file is a file"),
    ("forge.max_round=3", "did you mean forge.max_rounds?"),
    ("forge.max_rounds=-1", "forge.max_rounds must be >= 0, got -1"),
])
def test_bad_forge_override_is_one_line(override, needle, tmp_path):
    """``python -m forgetrain.forge <bad override>``: one ``error:`` line (an unwritable forge.out_dir was a
    traceback), exit 2, nothing written."""
    (tmp_path / "a_file").write_text("")
    p = subprocess.run([sys.executable, "-m", "forgetrain.forge", "agent.command=echo", f"forge.out_dir={tmp_path / 'o'}",
                        override.format(tmp=tmp_path)], cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)),
                       text=True, capture_output=True, timeout=hang_s())
    lines = [x for x in (p.stdout + p.stderr).splitlines() if x.strip()]
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert [x for x in lines if x.startswith("error:")] == lines[-1:] and needle.format(tmp=tmp_path) in lines[-1], lines
    assert sorted(x.name for x in tmp_path.iterdir()) == ["a_file"]


def test_corrupt_golden_is_one_line(tmp_path, monkeypatch):
    from forgetrain.errors import ConfigError
    from forgetrain.verify import check_golden

    g = tmp_path / "golden"
    (g / "trace").mkdir(parents=True)
    (g / "trace" / "meta.json").write_text("{}")
    (g / "trace" / "trace.jsonl").write_text('{"step": 1}\n{"step": 2, "lo')  # truncated mid-record
    (g / "init.safetensors").write_bytes(b"")
    with pytest.raises(ConfigError, match="incomplete or corrupt"):
        check_golden(g)
    (g / "trace" / "trace.jsonl").write_text('{"step": 1}\n')
    (g / "init.safetensors").unlink()
    with pytest.raises(ConfigError, match="init.safetensors"):
        check_golden(g)


def test_ctrl_c_flushes_the_trace_and_names_the_checkpoint(tmp_path):
    import signal
    import time

    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # 2000 steps: long enough that the run is still going when the first checkpoint appears, even on a loaded
    # 2-core machine (a 400-step run once finished first under load, and the signal then reached no process)
    # SIGINT at its default in the child: a test run launched in the background (nohup, `cmd &` in a script) hands
    # its children SIGINT ignored, and a Python started so keeps ignoring it (that made this test fail in CI runs
    # started with `bash .ci/run &`: the run went on to the end)
    proc = subprocess.Popen([sys.executable, "-m", "forgetrain", *SHORT, "train.steps=2000", "train.save_interval=2",
                             f"train.out_dir={out}"], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + hang_s()
    while not (out / "checkpoints" / "latest").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert proc.poll() is None, "the run ended before its first checkpoint was seen: nothing to interrupt"
    if not (out / "checkpoints" / "latest").exists():
        proc.kill()
        pytest.fail(f"no checkpoint within 240 s: {proc.communicate()[1][-1500:]}")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=hang_s())
    assert proc.returncode == 130, err[-2000:]
    last = [x for x in err.strip().splitlines() if x.strip()][-1]
    # the first Ctrl-C finishes the step in hand, then stops (a flag read at the step boundary, not an exception
    # raised wherever the signal lands)
    assert last.startswith("error: interrupted after step ") and "(Ctrl-C)" in last, last
    assert "train.resume=true" in last and "Ctrl-C: stopping when this step is finished" in err, last
    assert "Traceback" not in err
    stopped = int(last.split("after step ")[1].split()[0])
    named = last.split("last checkpoint: ")[1].split()[0]
    assert (out / "checkpoints" / named / ".metadata").exists()
    # the step it stopped after is checkpointed (Megatron's exit signal handler saves too), whatever save_interval says
    assert named == f"step_{stopped:06d}", (named, stopped)
    assert len(records(out)) == stopped  # the trace holds every finished step


def _worker_pid(launcher_pid: int, rank: int) -> int:
    """The pid of torchrun's worker with ``RANK=rank`` (Linux /proc: a child of the launcher)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == launcher_pid and f"RANK={rank}".encode() in env:
            return int(d.name)
    raise AssertionError(f"no worker with RANK={rank} under pid {launcher_pid}")


def test_ctrl_c_under_torchrun_stops_every_rank_after_the_same_step(tmp_path):
    """A Ctrl-C (SIGINT) that reaches the ranks at different moments (torchrun passes it to its workers one by one)
    is agreed over the ranks at the step boundary: both stop after the same step with the one-line error, and
    neither is left waiting on the other's collectives (before that, the signalled rank stopped and the other died
    with a collective failure)."""
    import signal
    import time

    from tests.helpers import free_port as _free_port

    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(_free_port()),
           "-m", "forgetrain", *SHORT, "train.steps=4000", "train.save_interval=5", "train.threads=1",
           "train.micro_batch_size=2", "train.global_batch_size=4", "parallel=dp2", f"train.out_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True,  # a terminal's Ctrl-C goes to torchrun, which passes it on
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + hang_s()
    while not (out / "checkpoints" / "latest").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    if proc.poll() is not None or not (out / "checkpoints" / "latest").exists():
        proc.kill()
        pytest.fail(f"no checkpoint while the run was going: {proc.communicate()[1][-1500:]}")
    # the signal reaches rank 0 alone (as when the workers get it at different moments): rank 1 learns of it at
    # the step boundary
    os.kill(_worker_pid(proc.pid, rank=0), signal.SIGINT)
    _, err = proc.communicate(timeout=hang_s())
    assert proc.returncode != 0
    stops = [x for x in err.splitlines() if x.startswith("error: interrupted after step ")]
    # one line per rank, the same step and checkpoint named; torchrun ends the other workers once one has exited,
    # so on a loaded machine rank 1 can be ended before its own line is out
    assert stops and len(stops) <= 2 and len(set(stops)) == 1, err[-3000:]
    assert "a collective failed" not in err, err[-3000:]
    stopped = int(stops[0].split("after step ")[1].split()[0])
    assert len(records(out)) == stopped


def test_a_second_ctrl_c_stops_at_once_and_a_save_is_never_cut(tmp_path, monkeypatch):
    """In-process: the training loop's handler (``forgetrain.run.loop.CtrlC``) takes the first SIGINT as a request, the second
    as KeyboardInterrupt; a SIGINT during a checkpoint save waits for the save, then reaches that handler."""
    import signal

    from forgetrain import checkpoint
    from forgetrain.run.loop import CtrlC

    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)  # as an interactive Python starts
    try:
        c = CtrlC()
        try:
            assert signal.getsignal(signal.SIGINT) == c._on_sigint
            with checkpoint._deferred_sigint():  # a save in progress: the signal is held
                signal.raise_signal(signal.SIGINT)
                assert not c.requested
            assert c.requested  # handed over after the save
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        finally:
            c.restore()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(KeyboardInterrupt):  # no training loop: a save still ends with KeyboardInterrupt
            with checkpoint._deferred_sigint():
                signal.raise_signal(signal.SIGINT)
        # started with SIGINT ignored (nohup, a background job): neither installs a handler; it stays ignored
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        c = CtrlC()
        with checkpoint._deferred_sigint():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
        c.restore()
        assert not c.requested and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, inherited)


def test_short_run_needs_no_warmup_override_and_hydra_writes_into_out_dir(tmp_path):
    out = tmp_path / "run"
    p = run(["model=llama_micro", "train.steps=20", "train.eval_interval=0", "train.sample_tokens=0",
             f"train.out_dir={out}"], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert (out / ".hydra" / "config.yaml").exists() and not (tmp_path / "outputs").exists()
    from omegaconf import OmegaConf

    assert OmegaConf.load(out / ".hydra" / "config.yaml").train.lr_warmup_steps is None  # resolved at run time
    lrs = [r["lr"] for r in records(out)]
    assert lrs[0] == 0.0 and lrs[2] == lrs[1] * 2 > 0  # warmup = 20 // 10 = 2 steps (Megatron: lr(s) = lr*s/warmup)


@pytest.mark.parametrize("failure", ["enospc", "dcp_wrapped"])
def test_failed_save_is_one_line_and_keeps_the_last_good_checkpoint(failure, tmp_path, monkeypatch):
    """A save that fails half-way (a full disk; DCP's CheckpointException, a BaseException) ends the run with one
    CheckpointError line, removes its temp dir, and leaves the previous checkpoint and `latest` loadable."""
    import dataclasses
    import errno

    from torch.distributed.checkpoint.api import CheckpointException

    from forgetrain import checkpoint
    from forgetrain.errors import CheckpointError
    from forgetrain.train import train
    from scenarios.llama_tiny_cpu.engine import Engine
    from tests.helpers import ladder_cfg as _cfg

    real_save, calls = checkpoint.dcp.save, []

    def flaky_save(state, checkpoint_id):
        calls.append(checkpoint_id)
        if len(calls) == 2:  # the step-4 save: write part of it, then fail
            real_save({"part": next(iter(state["main"].values())) if "main" in state else 0},
                      checkpoint_id=checkpoint_id)
            err = OSError(errno.ENOSPC, "No space left on device")
            if failure == "enospc":
                raise err
            from torch.distributed.checkpoint.utils import _wrap_exception

            raise CheckpointException("save", {0: _wrap_exception(err)})
        return real_save(state, checkpoint_id=checkpoint_id)

    monkeypatch.setattr(checkpoint.dcp, "save", flaky_save)
    c = _cfg()
    out = tmp_path / "run"
    c = dataclasses.replace(c, train=dataclasses.replace(c.train, steps=6, save_interval=2, sample_tokens=0,
                                                         eval_interval=0, out_dir=str(out)))
    with pytest.raises(CheckpointError) as e:
        train(c, progress=False, engine_cls=Engine)
    msg = str(e.value)
    assert "\n" not in msg and "step-4" in msg and "step_000002" in msg, msg
    assert "No space left" in msg or "CheckpointException" in msg, msg
    ck = out / "checkpoints"
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_000002"]
    last = checkpoint.latest(ck)
    assert last.name == "step_000002"
    eng = Engine(c, "cpu")
    _, harness = checkpoint.load(last, checkpoint.to_cpu_tree(eng.state_dict()))
    assert harness["step"] == 2


def test_exported_weights_do_not_change_with_the_live_ones():
    """export_hf_weights() returns copies: a saved export must not move when the engine takes its next step."""
    import torch

    from scenarios.llama_tiny_cpu.engine import Engine
    from tests.helpers import ladder_cfg as _cfg

    eng = Engine(_cfg(), "cpu")
    before = eng.export_hf_weights()
    kept = {k: v.clone() for k, v in before.items()}
    torch.manual_seed(0)
    for _ in range(2):  # Megatron's schedule: the first update uses lr 0
        eng.train_step([torch.randint(0, 4096, (2, 33)) for _ in range(2)])
    after = eng.export_hf_weights()
    assert any(not torch.equal(after[k], kept[k]) for k in kept)  # the step changed the weights
    assert all(torch.equal(before[k], kept[k]) for k in kept)  # the earlier export did not move


def test_resume_with_another_global_batch_is_refused(finished, tmp_path):
    out = _copy(finished, tmp_path)
    p = run([*SHORT, "train.steps=8", "train.global_batch_size=16", "train.resume=true", f"train.out_dir={out}"])
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert "was trained with train.global_batch_size=" in _last_line(p) and "asks for 16" in _last_line(p), _last_line(p)


def test_killed_launcher_leaves_no_worker(tmp_path):
    """kill -9 of torchrun: its workers die with it (PR_SET_PDEATHSIG), within seconds, not at the run's end."""
    import signal
    import time

    psutil = pytest.importorskip("psutil")
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "forgetrain",
           "model=llama_micro", "parallel=dp2", "train.steps=100000", "train.micro_batch_size=2",
           "train.global_batch_size=4", "train.lr_warmup_steps=1", "train.threads=1", "train.eval_interval=0",
           "train.sample_tokens=0", "train.save_interval=0", "train.save=false", f"train.out_dir={out}"]
    launcher = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers = []
    try:
        deadline = time.time() + hang_s()
        while not (out / "trace" / "trace.jsonl").exists() and time.time() < deadline and launcher.poll() is None:
            time.sleep(1)
        assert (out / "trace" / "trace.jsonl").exists(), "the run never started"
        workers = [c for c in psutil.Process(launcher.pid).children(recursive=True)]
        assert len(workers) >= 2
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"workers still alive 10 s after the launcher died: {[p.pid for p in alive]}"
    finally:  # the workers too: when the test fails they are orphans, no longer children of this process
        for c in psutil.Process().children(recursive=True) + workers:
            try:
                c.kill()
            except psutil.NoSuchProcess:
                pass


def test_second_run_on_a_live_out_dir_is_refused(tmp_path):
    """While one run holds an out_dir, a second one (fresh, resume or overwrite) is refused with one line and
    changes nothing; once the first has ended, the directory is free again."""
    import time

    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    first = subprocess.Popen([sys.executable, "-m", "forgetrain", *SHORT, "train.steps=100000", "train.save=false",
                              f"train.out_dir={out}"], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + hang_s()
        while not (out / "trace" / "trace.jsonl").exists() and time.time() < deadline and first.poll() is None:
            time.sleep(0.5)
        assert (out / "trace" / "trace.jsonl").exists(), "the first run never started"
        for extra in ([], ["train.overwrite=true"], ["train.resume=true"]):
            p = run([*SHORT, *extra, f"train.out_dir={out}"])
            assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-1500:]
            assert f"is in use by another run (pid {first.pid})" in _last_line(p), _last_line(p)
        assert first.poll() is None and (out / "trace" / "trace.jsonl").exists()
    finally:
        first.kill()
        first.wait()
    p = run([*SHORT, "train.overwrite=true", f"train.out_dir={out}"])  # the dead run's lock is gone with it
    assert p.returncode == 0, p.stderr[-1500:]


def test_out_dir_lock_released_during_a_take_is_not_held_twice(tmp_path, monkeypatch):
    """The holder unlinks ``.lock`` and then lets go. A run that opened the file before the unlink and locks it just
    after holds an inode no path names; a third run creating a new ``.lock`` must still be refused, not lock too."""
    import fcntl

    from forgetrain.distributed import DistEnv
    from forgetrain.errors import ConfigError
    from forgetrain.run.outdir import lock_out_dir, unlock_out_dir

    out, env = tmp_path / "run", DistEnv()
    first = lock_out_dir(out, env)
    real, calls = fcntl.flock, []

    def flock(fd, op):  # the second run's first take: the first run ends between its open() and its flock()
        calls.append(op)
        if len(calls) == 1:
            unlock_out_dir(out, first)
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    second = lock_out_dir(out, env)
    monkeypatch.setattr(fcntl, "flock", real)
    assert len(calls) == 2, calls  # the stale inode was dropped and the lock taken again on the file that is there
    with pytest.raises(ConfigError, match=rf"is in use by another run \(pid {os.getpid()}\)"):
        lock_out_dir(out, env)
    assert (out / ".lock").read_text().strip() == str(os.getpid())
    unlock_out_dir(out, second)
    assert not (out / ".lock").exists()
    third = lock_out_dir(out, env)  # free again once the holder has let go
    unlock_out_dir(out, third)


def test_kernels_without_triton_is_one_line(tmp_path):
    """`python -m forgetrain.kernels list` after the quick-start install (no triton): one line naming the extra."""
    code = ("import sys; sys.modules['triton'] = None; sys.argv = ['kernels', 'list']; "
            "from forgetrain.kernels.__main__ import main; sys.exit(main())")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True, capture_output=True,
                       timeout=hang_s())
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-1500:]
    import tomllib

    pin = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["kernels"][0]
    assert pin.startswith("triton==")
    line = _last_line(p)
    assert line.startswith("error: ") and "pip install -e '.[kernels]'" in line and pin in line, line


def test_extra_pins_are_written_in_pyproject_only():
    """The optional extras' pins live in pyproject.toml; the code reads them (forgetrain.extras), never repeats them."""
    import re
    import tomllib

    from forgetrain.extras import install_hint, requirements

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for name in ("kernels", "deepspeed", "torchtitan"):
        assert requirements(name) == tuple(extras[name])
        assert install_hint(name) == f"pip install -e '.[{name}]' ({', '.join(extras[name])})"
    pins = [r for name in ("kernels", "deepspeed", "torchtitan") for r in extras[name]]
    for path in (ROOT / "forgetrain").rglob("*.py"):
        text = path.read_text()
        for pin in pins:
            assert not re.search(re.escape(pin) + r"\b", text), f"{path} repeats the pin {pin}"


def test_errors_found_after_hydra_started_write_nothing(finished, tmp_path):
    """Errors found inside the run (here: a tokenizer larger than the model's vocabulary) leave no run directory,
    no .hydra/ and no cli.log behind -- with train.out_dir and with Hydra's own timestamped directory; a refused
    second run on an existing run leaves that run's recorded config untouched."""
    out = tmp_path / "fresh"
    p = run([*SHORT, "model.vocab_size=100", f"train.out_dir={out}"], cwd=tmp_path)
    assert p.returncode == 2 and "exceeds model.vocab_size=100" in _last_line(p), p.stderr[-1500:]
    assert not out.exists() and not (tmp_path / "outputs").exists()
    p = run([*SHORT, "model.vocab_size=100"], cwd=tmp_path)
    assert p.returncode == 2 and not (tmp_path / "outputs").exists(), sorted(tmp_path.rglob("*"))
    mine = tmp_path / "mine"  # a directory the user made beforehand stays, empty as it was
    mine.mkdir()
    p = run([*SHORT, "model.vocab_size=100", f"train.out_dir={mine}"], cwd=tmp_path)
    assert p.returncode == 2 and mine.is_dir() and not list(mine.iterdir())
    done = _copy(finished, tmp_path)
    before = (done / ".hydra" / "config.yaml").read_text()
    p = run([*SHORT, "train.lr=1e-3", f"train.out_dir={done}"], cwd=tmp_path)  # refused: the dir holds a run
    assert p.returncode == 2 and "already holds a run" in _last_line(p), p.stderr[-1500:]
    assert (done / ".hydra" / "config.yaml").read_text() == before
    assert not list(done.glob("*.log"))


def test_device_out_of_memory_is_one_line(tmp_path):
    """A CUDA OOM (``torch.OutOfMemoryError``, raised here by a stand-in task) ends in one ``error:`` line with
    the allocator's figures and what to change, exit 1, no traceback (seen on the H200 when Megatron-core's local
    spec met llama1b_h200 at micro-batch 4)."""
    p = stand_in_task("raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a "
                      "total capacity of 139.80 GiB of which 3.94 GiB is free. See documentation for Memory "
                      "Management')", tmp_path)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    errs = [x for x in p.stderr.splitlines() if x.startswith("error:")]
    assert len(errs) == 1 and "out of GPU memory (CUDA out of memory. Tried to allocate 8.00 GiB." in errs[0]
    assert "train.micro_batch_size" in errs[0] and "See documentation" not in errs[0]
    assert not (tmp_path / "run").exists()


def test_progress_bar_shows_the_current_steps_metrics(tmp_path, monkeypatch, capsys):
    """Every redraw of the progress bar pairs the step count k with step k's loss (it showed step k-1's)."""
    import dataclasses
    import re

    import time

    from forgetrain.train import train
    from scenarios.llama_tiny_cpu.engine import Engine
    from tests.helpers import ladder_cfg as _cfg

    class Paced(Engine):  # tqdm redraws at most every 0.1 s (its TQDM_* env defaults are read once, at import)
        def train_step(self, micro_batches):
            time.sleep(0.15)
            return super().train_step(micro_batches)

    c = _cfg()
    c = dataclasses.replace(c, train=dataclasses.replace(c.train, steps=4, save=False, sample_tokens=0,
                                                         eval_interval=0, out_dir=str(tmp_path / "run")),
                            hardware=dataclasses.replace(c.hardware, peak_tflops=1.0))
    train(c, progress=True, engine_cls=Paced)
    err = capsys.readouterr().err
    losses = {r["step"]: r["loss"] for r in records(tmp_path / "run")}
    shown = [(int(m.group(1)), m.group(2)) for m in re.finditer(r"\| (\d+)/4 \[[^\]]*loss=([-\d.]+)", err)]
    assert {k for k, _ in shown} >= {1, 2, 3}, err[-2000:]
    for k, loss in shown:
        assert loss == f"{losses[k]:.4f}", (k, loss, losses)


def test_the_sample_shows_document_boundaries_readably(tmp_path):
    """The end-of-run sample renders an end-of-document token as a '[end of document]' line, never the raw
    <|endoftext|>."""
    import dataclasses

    import torch

    from forgetrain.config import DataConfig
    from forgetrain.data import DOCUMENT_BREAK, EOD_TOKEN, load_tokenizer, prepare
    from forgetrain.run.phases import sample_text
    from tests.helpers import ladder_cfg as _cfg

    tok = load_tokenizer(prepare(DataConfig(), progress=False).tokenizer_path)
    eod = tok.eod_id

    class EndsDocuments:  # every other token is the end-of-document token
        def logits(self, ctx):
            out = torch.full((1, ctx.shape[1], tok.vocab_size), -1e9)
            out[0, -1, eod if ctx[0, -1] != eod else tok.token_to_id("A")] = 0.0
            return out

    c = _cfg()
    c = dataclasses.replace(c, train=dataclasses.replace(c.train, sample_tokens=6, sample_prompt="ROMEO."))
    text = sample_text(EndsDocuments(), tok, c, "cpu")
    assert EOD_TOKEN not in text, text
    assert text.startswith("ROMEO.") and text.count(DOCUMENT_BREAK.strip()) == 3, text


def test_megatron_deprecation_warning_is_silenced_exactly(tmp_path):
    """megatron-core's "full scope is deprecated" warning (raised on every TransformerConfig) no longer prints once
    the reference is imported; the same text under another category, and any other megatron warning, still do."""
    code = """
import warnings
import references.megatron.engine
from megatron.core.transformer.transformer_config import TransformerConfig
TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2)
mod = "megatron.core.transformer.transformer_config"
warnings.warn_explicit("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.",
                       DeprecationWarning, "x.py", 1, module=mod)
warnings.warn_explicit("another megatron warning", UserWarning, "x.py", 2, module=mod)
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-W", "default", "-c", code], cwd=tmp_path, env=env, text=True,
                       capture_output=True, timeout=hang_s())
    assert p.returncode == 0, p.stderr[-2000:]
    assert "UserWarning: full scope is deprecated" not in p.stderr, p.stderr[-2000:]
    assert "DeprecationWarning: full scope is deprecated" in p.stderr, p.stderr[-2000:]
    assert "UserWarning: another megatron warning" in p.stderr, p.stderr[-2000:]


_MISMATCH_WORKER = """
import torch, torch.distributed as dist
from forgetrain.config import ParallelConfig
from forgetrain.distributed import collective_errors, init_distributed
from forgetrain.errors import one_line_errors

@one_line_errors
def main():
    env = init_distributed(ParallelConfig(timeout_s=30))
    with collective_errors(30):
        dist.all_reduce(torch.ones(10 if env.rank == 0 else 12))  # rank 1 reduces 12 elements, rank 0 ten
main()
"""


def test_mismatched_collectives_name_the_op_and_the_sizes(tmp_path):
    """Two ranks all-reduce tensors of 10 and 12 elements. Where torch makes the sizes known
    (TORCH_DISTRIBUTED_DEBUG=DETAIL) each rank's one line names the op and both sizes, not a dead peer."""
    (tmp_path / "worker.py").write_text(_MISMATCH_WORKER)
    port = str(_free_port())
    ranks = []
    for rank in range(2):  # what torchrun sets up, with each rank's stderr apart
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TORCH_DISTRIBUTED_DEBUG="DETAIL",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
        ranks.append(subprocess.Popen([sys.executable, "worker.py"], cwd=tmp_path, env=env, text=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    errs = [r.communicate(timeout=hang_s())[1] for r in ranks]
    for rank, (r, err) in enumerate(zip(ranks, errs)):
        assert r.returncode == 1 and "Traceback" not in err, err[-3000:]
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(lines) == 1, err[-3000:]
        line = lines[0]
        assert line.startswith(f"error: rank {rank}/2: the ranks' collectives do not match"), line
        assert "rank 0 ran ALLREDUCE of shape [10]" in line and "rank 1 ran ALLREDUCE of shape [12]" in line, line
        assert "died" not in line, line


def test_a_dead_peer_says_how_to_name_a_mismatch():
    """Without DETAIL, a rank that sees its peer vanish says so, and how to have a size mismatch named."""
    from unittest import mock

    from forgetrain.distributed import CollectiveError, collective_errors, describe_mismatch

    assert describe_mismatch("Connection reset by peer") is None
    with mock.patch("torch.distributed.is_initialized", return_value=True), \
            mock.patch("torch.distributed.get_world_size", return_value=2), \
            mock.patch("torch.distributed.get_rank", return_value=1), \
            mock.patch.dict(os.environ, {"TORCH_DISTRIBUTED_DEBUG": "OFF"}):
        with pytest.raises(CollectiveError) as e:
            with collective_errors(30):
                raise RuntimeError("[pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")
    msg = str(e.value)
    assert msg.startswith("rank 1/2: a collective failed") and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in msg, msg


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_python_m_forgetrain_train_is_the_train_command(tmp_path):
    """``python -m forgetrain.train`` runs the training command (it exited 0 having done nothing): a bad override
    gets the command's one error line."""
    p = _module("forgetrain.train", ["train.lr=-1"], tmp_path)
    assert p.returncode == 2 and _last_line(p).startswith("error:") and "train.lr" in _last_line(p), p.stderr
