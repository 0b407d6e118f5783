#!/usr/bin/env bash
# Sourced by the device calls that judge against the stored H200 goldens: the shapes those goldens were made at,
# written once.
#   L:    the surpass issue's loss-curve shape (llama1b_h200 at h 2048 x 8 layers, seq 2048, micro-batch 2 x
#         grad-accum 4, bf16, 300 steps): golden references/goldens/h200/llama1b_h200-loss_curve-127c6adc42ce.
#   T:    the tolerance shape (h 1024 x 4 layers, seq 512, micro-batch 2 x grad-accum 2, 8 steps, bf16,
#         deterministic); its golden (845 MB) is too large to bring back, so each call makes it first.
#   BASE: the fast base (batch-first layout + SDPA only) that each switch is added to.
#   FIVE: the golden's five Megatron-core seeds.
#   R1B:  the scenario's real width, vocabulary (128256), sequence (4096) and global batch (4) at 8 of 16 layers and
#         micro-batch 2 x grad-accum 2 (at micro-batch 4 Megatron-core's local spec runs out of memory even at 8
#         layers: [mb, 32, 4096, 4096] scores per layer plus fp32 logits). Golden
#         references/goldens/h200/llama1b_h200-loss_curve-17890fa97f85. LAYERS and MB change it (a new golden).
#   P8:   the llama8b_h100 proxy (full 8B width, 4 layers, seq 8192, micro-batch 1, global batch 1, 300 steps):
#         golden references/goldens/h200/llama8b_h100-loss_curve-24b726ebc7bf.
#   G:    the bitwise goldens (experiments/bitwise/goldens_h200.sh): llama_micro, exact mode, deterministic, 8 steps; add train.precision=bf16 or
#         fp32. Goldens references/goldens/h200/llama1b_h200-bitwise-{407c65b0ea05,6620e71f312d}.
L="scenario=llama1b_h200 model.hidden_size=2048 model.num_layers=8 model.num_attention_heads=16 \
model.num_query_groups=4 model.ffn_hidden_size=8192 model.vocab_size=32000 model.seq_length=2048 \
train.micro_batch_size=2 train.global_batch_size=8 train.precision=bf16 train.deterministic=false hardware=h200 \
verify.curve_steps=300 parallel.timeout_s=60"
T="scenario=llama1b_h200 model.hidden_size=1024 model.num_layers=4 model.num_attention_heads=16 \
model.num_query_groups=4 model.ffn_hidden_size=2816 model.vocab_size=32000 model.seq_length=512 \
train.micro_batch_size=2 train.global_batch_size=4 train.lr_warmup_steps=2 train.precision=bf16 \
train.deterministic=true hardware=h200 tier=tolerance verify.steps=8 parallel.timeout_s=60"
BASE="mode=fast_base"
FIVE="verify.seeds=[1234,1235,1236,1237,1238]"
R1B="scenario=llama1b_h200 model.num_layers=${LAYERS:-8} train.micro_batch_size=${MB:-2} train.global_batch_size=4 \
hardware=h200 verify.curve_steps=300 parallel.timeout_s=60"
P8="scenario=llama8b_h100 model.num_layers=4 train.micro_batch_size=1 train.global_batch_size=1 \
train.deterministic=false hardware=h200 verify.curve_steps=300 parallel.timeout_s=60"
G="scenario=llama1b_h200 model=llama_micro train.micro_batch_size=2 train.global_batch_size=4 \
train.lr_warmup_steps=2 mode=exact \
train.deterministic=true tier=bitwise verify.steps=8 hardware=h200 parallel.timeout_s=60"
