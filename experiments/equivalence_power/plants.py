"""Planted regressions for measuring the loss-curve tier's power: deliberately wrong versions of a forged engine,
each a subclass of the scenario's engine class built by :func:`planted`; and the bench's peers (``peer_*``), judged
as candidates the same way.

Each plant names what it changes and the mode that can see it: ``paired`` (the candidate starts from each
reference seed's init, so only training-time changes are visible) or ``unpaired`` (the candidate's own init).
The ``bf16_*`` plants patch the Hopper engine's own functions (``scenarios/llama1b_h200``) for the lifetime of the
process, so a process judges one such plant.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import torch

PLANTS = {
    "default": ("the scenario default, unchanged", "paired"),
    "repeat": ("the scenario default again (the noise floor: the same candidate, repeated)", "paired"),
    "lr_x0.95": ("learning rate and its floor x0.95", "paired"),
    "bf16_grad_accum": ("fp32 main_grad rounded to bf16 after every weight-gradient accumulation", "paired"),
    "bf16_ce": ("cross-entropy (softmax, log-sum-exp, dlogits) in bf16 instead of fp32", "paired"),
    "fp8": ("engine.fp8=tensorwise (the opt-in switch, judged again)", "paired"),
    "fp8_lm_head": ("engine.fp8=tensorwise with engine.fp8_lm_head=true (the LM head's GEMMs in FP8 too)", "paired"),
    "default_unpaired": ("the scenario default from its own init and data order", "unpaired"),
    "no_output_scaling": ("attention output and fc2 initialised N(0, std) without Megatron's 1/sqrt(2L)", "unpaired"),
    # the bench's peers, judged as candidates: are they equivalent to the reference, and is FP8's departure in the
    # warm-up inherent to tensorwise FP8 (torchao's recipe on the same model) or a defect of ours?
    "peer_bf16": ("references/torch_compile, the strong plain-PyTorch script (a bench peer)", "paired"),
    "peer_torchao_fp8": ("references/torchao_float8_tensorwise: torchao float8 training, tensorwise", "paired"),
}
PEERS = {"peer_bf16": "references.torch_compile.engine",  # plant -> the module whose Engine it runs
         "peer_torchao_fp8": "references.torchao_float8_tensorwise.engine"}


def _bf16_ce_chunk(logits: torch.Tensor, labels: torch.Tensor, inv_n: float, block=None):
    """``forgetrain.kernels.torch_ops.ce_chunk`` with every step in bf16 (its loss returned as fp32)."""
    z = logits.to(torch.bfloat16)
    zmax = z.amax(dim=-1, keepdim=True)
    e = torch.exp(z - zmax)
    sumexp = e.sum(dim=-1, keepdim=True)
    loss = (torch.log(sumexp) + zmax - torch.gather(z, 1, labels[:, None])).squeeze(1)
    onehot = torch.arange(z.shape[1], device=z.device)[None, :] == labels[:, None]
    g = (e / sumexp - onehot.to(z.dtype)) * inv_n
    return loss.float(), g.to(logits.dtype)


def _patch_bf16_ce() -> None:
    from scenarios.llama1b_h200 import fast

    fast._ce_fn = lambda device, options=None, kernel="torch": _bf16_ce_chunk


def _patch_bf16_grad_accum() -> None:
    from scenarios.llama1b_h200 import wgrad

    orig = wgrad.gemm_accumulate
    if getattr(orig, "planted", False):
        return

    def rounded(main_grad, dy, x, overwrite, alpha, path):
        orig(main_grad, dy, x, overwrite, alpha, path)
        main_grad.copy_(main_grad.to(torch.bfloat16))

    rounded.planted = True
    wgrad.gemm_accumulate = rounded


def planted(name: str, base):
    """The engine class of plant ``name`` over ``base`` (the scenario's engine class), or ``base`` itself for
    the unchanged plants. Raises KeyError for an unknown plant."""
    if name not in PLANTS:
        raise KeyError(f"unknown plant {name!r}; known: {', '.join(PLANTS)}")
    if name in ("default", "repeat", "default_unpaired", "fp8", "fp8_lm_head"):
        return base
    if name in PEERS:  # not the forged engine at all: the peer's own engine class, from the same init and batches
        import importlib

        return importlib.import_module(PEERS[name]).Engine
    if name == "bf16_ce":
        _patch_bf16_ce()
        return base
    if name == "bf16_grad_accum":
        class RoundedGradAccum(base):
            def __init__(self, cfg, device):
                from scenarios.llama1b_h200 import wgrad

                # the GEMM path is chosen on the plain op first (cached per device type): the engine's own probe
                # would compare the planted rounding with fp64 and refuse every path
                wgrad.probe_path(torch.device(device))
                _patch_bf16_grad_accum()
                super().__init__(cfg, device)

        return RoundedGradAccum

    if name == "lr_x0.95":
        class LrScaled(base):
            def __init__(self, cfg, device):
                cfg = copy.deepcopy(cfg)
                cfg.train = dataclasses.replace(cfg.train, lr=cfg.train.lr * 0.95, min_lr=cfg.train.min_lr * 0.95)
                super().__init__(cfg, device)

        return LrScaled

    class NoOutputScaling(base):  # no_output_scaling
        def __init__(self, cfg, device):
            super().__init__(cfg, device)
            sd = self.export_hf_weights()
            f = math.sqrt(2.0 * cfg.model.num_layers)
            for k in sd:
                if k.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                    sd[k] = sd[k] * f
            self.load_hf_weights(sd)

    return NoOutputScaling


def run_config(name: str, rc):
    """The run config plant ``name`` runs with (``fp8`` turns on ``engine.fp8=tensorwise``, ``fp8_lm_head`` that
    and ``engine.fp8_lm_head=true``; a peer runs with the engine options and kernel switches at their defaults but
    the mode, since the scenario default's levers and forged Triton kernels are the forged engine's own)."""
    if name in PEERS:
        from forgetrain.config import EngineOptions, KernelsConfig

        rc = copy.deepcopy(rc)
        rc.engine, rc.kernels = EngineOptions(mode=rc.engine.mode), KernelsConfig()
        return rc
    if name in ("fp8", "fp8_lm_head"):
        rc = copy.deepcopy(rc)
        rc.engine = dataclasses.replace(rc.engine, fp8="tensorwise", fp8_lm_head=name == "fp8_lm_head")
    return rc
