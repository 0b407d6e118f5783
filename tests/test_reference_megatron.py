"""The Megatron-core reference engine on CPU: build, train, lr semantics, numerics model, export/load, resume.

Tiny shapes (hidden 64, 2 layers, 4 heads / 2 groups, vocab 256, seq 32, micro-batch 2, global batch 4 -> 2
micro-batches). Megatron's parallel state is process-global; every test builds fresh engines in one process.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("megatron.core")

from forgetrain.config import ModelConfig, RunConfig, TrainConfig  # noqa: E402
from forgetrain.engine import TrainEngine, forward_names, hf_param_names  # noqa: E402
from forgetrain.schedule import lr_for_step  # noqa: E402
from references.megatron.engine import Engine  # noqa: E402
from tests.limits import hang_s  # noqa: E402

VOCAB, SEQ, MB = 256, 32, 2


def make_cfg(**train) -> RunConfig:
    model = ModelConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4, num_query_groups=2,
                        ffn_hidden_size=96, seq_length=SEQ)
    kw = dict(micro_batch_size=MB, global_batch_size=4, steps=10, lr=3e-3, min_lr=3e-4, lr_warmup_steps=2)
    kw.update(train)
    return RunConfig(model=model, train=TrainConfig(**kw))


def batches(n: int, seed: int = 0) -> list[list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [[torch.randint(0, VOCAB, (MB, SEQ + 1), generator=g) for _ in range(2)] for _ in range(n)]


def engine(**train) -> Engine:
    return Engine(make_cfg(**train), torch.device("cpu"))


def main_params(e: Engine) -> dict[str, torch.Tensor]:
    return {n: e._main_param(p).detach().clone() for n, p in e.gpt.named_parameters()}


def test_builds_and_trains_three_steps():
    e = engine(lr_warmup_steps=0, lr_decay_style="constant")
    assert isinstance(e, TrainEngine)
    fixed = batches(1)[0]
    results = [e.train_step(fixed) for _ in range(3)]
    for r in results:
        assert math.isfinite(r.loss) and math.isfinite(r.grad_norm)
        assert r.per_token_loss.shape == (2, MB, SEQ) and r.per_token_loss.dtype == torch.float32
        # loss = mean over micro-batches of each micro-batch's token mean
        assert r.loss == torch.stack([pt.mean() for pt in r.per_token_loss]).mean().item()
    assert results[-1].loss < results[0].loss  # same batch thrice: the loss must drop
    assert e.steps_done == 3


def test_bad_micro_batch_shape_raises():
    e = engine()
    with pytest.raises(ValueError):
        e.train_step([torch.zeros(MB, SEQ, dtype=torch.long)])
    with pytest.raises(ValueError):
        e.train_step([torch.zeros(MB, SEQ + 1, dtype=torch.int32)])


def test_init_is_deterministic_and_init_weights_resets():
    a, b = engine(), engine()
    wa, wb = a.export_hf_weights(), b.export_hf_weights()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    a.train_step(batches(1)[0])
    a.train_step(batches(1)[0])
    a.init_weights()
    w = a.export_hf_weights()
    assert all(torch.equal(w[k], wa[k]) for k in wa)
    assert a.steps_done == 0 and a.scheduler.num_steps == 0
    c = engine(seed=4321)
    wc = c.export_hf_weights()
    assert not torch.equal(wc["lm_head.weight"], wa["lm_head.weight"])


def test_lr_is_the_one_megatron_applies():
    e = engine(lr_warmup_steps=2)
    before = main_params(e)
    r1 = e.train_step(batches(1)[0])
    # The scheduler is built at num_steps=0: under warmup the first update uses lr = 0 ...
    assert r1.lr == 0.0 == lr_for_step(e.cfg.train, 0)
    after = main_params(e)
    assert all(torch.equal(before[n], after[n]) for n in before)  # ... and lr 0 leaves every weight unchanged
    for k, b in enumerate(batches(4, seed=1), start=2):
        r = e.train_step(b)
        assert r.lr == lr_for_step(e.cfg.train, k - 1)
    # Without warmup the first update already uses the peak lr.
    assert engine(lr_warmup_steps=0).train_step(batches(1)[0]).lr == 3e-3


def test_weight_decay_groups():
    e = engine(weight_decay=0.1)
    groups = e.param_groups_summary()
    assert len(groups) == 2
    decayed, not_decayed = groups
    assert decayed["weight_decay"] == 0.1 and not_decayed["weight_decay"] == 0.0
    assert all(n.endswith("layernorm.weight") for n in not_decayed["params"])
    assert len(not_decayed["params"]) == 2 * 2 + 1
    assert not any("layernorm" in n for n in decayed["params"])
    assert e.grad_norm_param_order() == decayed["params"] + not_decayed["params"]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_numerics_model_reproduces_megatron_bitwise(precision):
    """The README's recipe (grads -> norm in optimizer order -> clip -> torch AdamW single-tensor, per-group wd)
    reproduces the reference's grad norm and updated (main) weights to the bit, with clipping active."""
    t_cfg = make_cfg(precision=precision, lr_warmup_steps=1).train
    e = Engine(make_cfg(precision=precision, lr_warmup_steps=1), torch.device("cpu"))
    names = e.grad_norm_param_order()
    params = dict(e.gpt.named_parameters())
    emu = {n: e._main_param(params[n]).detach().clone() for n in names}
    opt = torch.optim.AdamW([{"params": [emu[n] for n in g["params"]], "weight_decay": g["weight_decay"]}
                             for g in e.param_groups_summary()],
                            lr=0.0, betas=(t_cfg.adam_beta1, t_cfg.adam_beta2), eps=t_cfg.adam_eps, foreach=False)
    clipped = 0
    for b in batches(3):
        r = e.train_step(b)
        grads = e._last_grads  # Megatron layout, pre-clip
        total = torch.norm(torch.tensor([float(torch.norm(grads[n])) for n in names]))
        norm = (torch.tensor([float(total)], dtype=torch.float) ** 2).item() ** 0.5
        assert norm == r.grad_norm
        coeff = t_cfg.clip_grad / (norm + 1.0e-6)
        clipped += coeff < 1.0
        for n in names:
            emu[n].grad = grads[n] * coeff if coeff < 1.0 else grads[n].clone()
        for g in opt.param_groups:
            g["lr"] = r.lr
        opt.step()
        for n in names:
            assert torch.equal(emu[n], e._main_param(params[n])), n
            if precision == "bf16":
                assert torch.equal(emu[n].bfloat16(), params[n]), n
    assert clipped  # the check covered the clipping branch


def test_schedule_equals_plain_loop():
    """Megatron's forward_backward_no_pipelining == a plain loop of backward(mean(per_token) / n_micro)."""
    e = engine()
    mbs = batches(1)[0]
    e.model.zero_grad_buffer()
    for mb in mbs:
        out = e.model(mb[:, :-1].contiguous(), e._position_ids, e._mask, labels=mb[:, 1:].contiguous())
        (out.float().mean() / len(mbs)).backward()
    plain = {n: p.main_grad.clone() for n, p in e.gpt.named_parameters()}
    e.train_step(mbs)
    assert all(torch.equal(plain[n], e._last_grads[n]) for n in plain)


def test_export_hf_grads_are_pre_clip():
    e = engine(clip_grad=0.5)
    r = e.train_step(batches(1)[0])
    grads = e.export_hf_grads()
    assert set(grads) == set(hf_param_names(2))
    assert all(g.dtype == torch.float32 for g in grads.values())
    total = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
    assert r.grad_norm > 0.5
    assert abs(total - r.grad_norm) < 1e-5 * r.grad_norm  # the unclipped norm, not 0.5


def test_harness_derives_megatrons_clipped_grads_to_the_bit():
    """The reference exports pre-clip grads only (it is never edited); the harness's trace of it derives the
    clipped ones (forgetrain.train.clipped_grads). They equal, to the bit, the main_grad buffers Megatron's fp32
    optimizer clipped in place in step()."""
    from forgetrain.train import clipped_grads
    from references.megatron import convert

    e = engine(clip_grad=0.5)
    r = e.train_step(batches(1)[0])
    assert r.grad_norm > 0.5  # the clip applied
    pre = e.export_hf_grads()
    derived = clipped_grads(e, pre, r.grad_norm, 0.5)
    clipped = convert.megatron_to_hf({n: p.main_grad.detach().float().clone() for n, p in e._named_params().items()},
                                     e.cfg.model)
    assert set(derived) == set(clipped) == set(pre)
    assert all(torch.equal(derived[n], clipped[n]) for n in pre)
    assert not any(torch.equal(derived[n], pre[n]) for n in pre)  # and they are not the pre-clip ones


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_export_load_round_trip(precision):
    a = engine(precision=precision)
    a.train_step(batches(1)[0])
    a.train_step(batches(1, seed=3)[0])
    w = a.export_hf_weights()
    assert list(w) == hf_param_names(2) and all(v.dtype == torch.float32 for v in w.values())
    b = engine(precision=precision, seed=99)
    b.load_hf_weights(w)
    w2 = b.export_hf_weights()
    assert all(torch.equal(w[k], w2[k]) for k in w)
    pa, pb = dict(a.gpt.named_parameters()), dict(b.gpt.named_parameters())
    assert all(torch.equal(pa[n], pb[n]) for n in pa)  # bf16: the model params round identically
    tokens = batches(1)[0][0][:, :SEQ]
    la, lb = a.logits(tokens), b.logits(tokens)
    assert la.shape == (MB, SEQ, VOCAB) and torch.equal(la, lb)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_checkpoint_resume_is_bitwise(tmp_path, precision):
    import torch.distributed.checkpoint as dcp

    data = batches(5)
    ref = engine(precision=precision)
    ref_results = [ref.train_step(b) for b in data]
    ref_w = ref.export_hf_weights()

    first = engine(precision=precision)
    for b in data[:2]:
        first.train_step(b)
    dcp.save(first.state_dict(), checkpoint_id=str(tmp_path / "ckpt"))

    resumed = engine(precision=precision)
    state = resumed.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    resumed.load_state_dict(state)
    assert resumed.steps_done == 2 and resumed.scheduler.num_steps == 2
    for b, want in zip(data[2:], ref_results[2:]):
        got = resumed.train_step(b)
        assert (got.loss, got.grad_norm, got.lr) == (want.loss, want.grad_norm, want.lr)
        assert torch.equal(got.per_token_loss, want.per_token_loss)
    w = resumed.export_hf_weights()
    assert all(torch.equal(w[k], ref_w[k]) for k in w)


def test_module_probes_and_eval():
    e = engine()
    probes = e.module_probes()
    assert list(probes) == list(forward_names(2))
    seen = {}
    hooks = [m.register_forward_hook(
        lambda mod, inp, out, name=name: seen.__setitem__(name, out[0] if isinstance(out, tuple) else out))
        for name, m in probes.items()]
    mbs = batches(1)[0]
    loss = e.eval_loss(mbs)
    for h in hooks:
        h.remove()
    assert set(seen) == set(probes)
    assert seen["embedding"].shape == (SEQ, MB, 64) and seen["layers.1.mlp"].shape == (SEQ, MB, 64)
    assert seen["output_layer"].shape == (SEQ, MB, VOCAB)
    r = e.train_step(mbs)  # the train loss of the same weights equals the eval loss
    assert loss == r.loss


def test_distributed_optimizer_dp1_fp32_matches_plain():
    from forgetrain.config import ParallelConfig

    data = batches(2)
    plain = engine()
    cfg = make_cfg()
    cfg.parallel = ParallelConfig(zero_stage=1)
    zero = Engine(cfg, torch.device("cpu"))
    assert type(zero.optimizer.chained_optimizers[0]).__name__ == "DistributedOptimizer"
    for b in data:
        rp, rz = plain.train_step(b), zero.train_step(b)
        assert rp.loss == rz.loss and rp.lr == rz.lr and torch.equal(rp.per_token_loss, rz.per_token_loss)
        assert abs(rp.grad_norm - rz.grad_norm) <= 1e-6 * rp.grad_norm  # order of the norm terms differs


def test_shim_is_scoped_idempotent_and_its_rng_tracker_forks():
    from references.megatron import shim

    shim.install()
    zeros = torch.zeros
    shim.install()
    assert torch.zeros is zeros and shim.installed()  # idempotent: nothing wrapped twice
    # Outside megatron nothing changes.
    assert torch.ones(2).type() == "torch.FloatTensor"
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")
    # Inside megatron code (judged by the caller's module name) CUDA placement means CPU.
    scope = {"__name__": "megatron.core.fake_module", "torch": torch}
    exec("dev = torch.zeros(1, device='cuda').device.type\n"
         "cur = torch.cuda.current_device()\n"
         "name = torch.ones(1, dtype=torch.bfloat16).type()\n"
         "x = torch.arange(3.0); same = x.cuda() is x", scope)
    assert scope["dev"] == "cpu" and scope["cur"] == torch.device("cpu")
    assert scope["name"] == "torch.cuda.BFloat16Tensor" and scope["same"]
    tracker = shim.CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 7)
    outer = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)  # the outer CPU generator is restored
    with tracker.fork():
        b = torch.rand(3)
    torch.manual_seed(7)
    want = torch.rand(6)
    assert torch.equal(torch.cat([a, b]), want)  # the named state advances across forks


_DEVICE_CONTEXT_PROBE = """
import sys, torch
sys.path.insert(0, {root!r})
from references.megatron import shim
{warm_guard}
shim.install()  # in a fresh process: torch's factory cache has not been filled yet
with torch.device("meta"):
    got = {{n: getattr(torch, n)(*a).device.type for n, a in
           (("empty", (2,)), ("zeros", (2,)), ("ones", (2,)), ("full", ((2,), 1.0)), ("tensor", ([1.0],)))}}
print(got)
sys.exit(0 if set(got.values()) == {{"meta"}} else 1)
"""


@pytest.mark.parametrize("warm", [True, False])
def test_shim_leaves_the_torch_device_context_manager_working(warm):
    """After install(), ``with torch.device("meta")`` still places every wrapped factory on meta (an HF model built
    on a device after a Megatron CPU step must land there). The rejection side: a shim that skips warming torch's
    factory cache first (``warm=False`` stubs it out) is caught."""
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    guard = "" if warm else "shim._warm_device_constructors = lambda: None"
    p = subprocess.run([sys.executable, "-c", _DEVICE_CONTEXT_PROBE.format(root=root, warm_guard=guard)],
                       capture_output=True, text=True, timeout=hang_s())
    assert (p.returncode == 0) == warm, p.stdout + p.stderr[-2000:]
