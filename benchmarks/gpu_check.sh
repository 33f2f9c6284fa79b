#!/usr/bin/env bash
# Every GPU check in one run (< 8.5 minutes on one H200: the timeouts add up to 515 s). Results go under $OUT (default ./out).
# The lent machine is bare and offline: torch, transformers, peft, accelerate, tokenizers, pyyaml, rich,
# tqdm and setuptools are there; what slipstream needs beyond them travels as wheels in .whl/
# (benchmarks/gpu_wheels.sh downloads them here; the device call carries .whl). Nothing is fetched.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
(
  nvidia-smi || true
  if ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || { echo "gpu_check: the brought wheels in .whl/ did not install"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  python3 -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tail -2
  python3 benchmarks/gpu_env.py || exit 1
) > "$OUT/env.txt" 2>&1 || { tail -1 "$OUT/env.txt"; exit 1; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
# GPU_CHECK_INSTALL_ONLY=1: stop here (the install step's dry run on a machine without a GPU)
if [ "${GPU_CHECK_INSTALL_ONLY:-0}" = 1 ]; then cat "$OUT/env.txt"; exit 0; fi

# 0. slipstream doctor (issue 13): the device, versions, each fast path's backend and why, and each
#    fast path run against its stock arm on this GPU (parity, host syncs under sync debug, verdict).
timeout 40 slipstream doctor --json "$OUT/doctor.json" > "$OUT/doctor.txt" 2>&1
echo "doctor exit: $?" >> "$OUT/doctor.txt"

# 1. Packing (issue 2): no host sync in a packed step (sync debug "error"), varlen backend used.
#    Shared prefixes (issue 34): prefix groups on varlen (two calls merged by log-sum-exp, slipstream's
#    backward) against per-document SDPA, attention and a whole SFT step, no sync (test_gpu_groups.py).
timeout 55 python -m pytest -q -m gpu tests/packing/test_gpu.py tests/packing/test_gpu_groups.py tests/offload/test_gpu.py \
  -p no:cacheprovider > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests exit: $?" >> "$OUT/gpu_tests.txt"

# 2. The A/B harness (issues 2, 6, 9 and 13): the peers preset on a Qwen3-8B shape (4 layers, bf16,
#    LoRA, real vocabulary 151,936): trl, stock-packed, stock-offload (transformers' own offload),
#    liger (where installed), slipstream; unsloth is skipped on CUDA (CPU backend only here). Then
#    a GPT-OSS-20B shape (2 layers, bf16, LoRA, vocabulary 201,088). Records kept for `slipstream report`.
timeout 90 slipstream ab --model qwen3-8b --layers 4 --dtype bfloat16 --lora-rank 16 --max-seq-len 4096 \
  --steps 8 --warmup 2 --preset peers --out "$OUT/ab-qwen3-8b" > "$OUT/ab_qwen3_8b.txt" 2>&1
echo "ab qwen3-8b exit: $?" >> "$OUT/ab_qwen3_8b.txt"
timeout 40 slipstream ab --model gpt-oss-20b --layers 2 --dtype bfloat16 --lora-rank 16 --max-seq-len 4096 \
  --steps 10 --warmup 3 --arms stock-packed,slipstream --out "$OUT/ab-gpt-oss-20b" > "$OUT/ab_gpt_oss_20b.txt" 2>&1
echo "ab gpt-oss-20b exit: $?" >> "$OUT/ab_gpt_oss_20b.txt"

# 3. MoE (issue 3): sorted routing vs stock eager / grouped_mm in bf16 on GPT-OSS-20B and
#    Qwen3-30B-A3B layer shapes (2 layers, random init), and sync counts under CUDA's debugger.
timeout 45 python benchmarks/moe.py --shapes gpt-oss-20b,qwen3-30b-a3b --layers 2 --device cuda \
  --dtype bfloat16 --tokens 4096 --steps 4 --warmup 1 --out "$OUT/bench-moe" > "$OUT/bench_moe.txt" 2>&1
echo "moe bench exit: $?" >> "$OUT/bench_moe.txt"
timeout 25 python benchmarks/moe_sync_debug.py > "$OUT/moe_sync_debug.txt" 2>&1
echo "moe sync debug exit: $?" >> "$OUT/moe_sync_debug.txt"

# 4. Offloaded checkpointing (issue 4): off / recompute / offload / offload-double on a
#    Qwen3-8B shape (8 layers, bf16, LoRA), 8192-token packed batches.
timeout 50 python benchmarks/offload.py --layers 8 --tokens 8192 --steps 5 --warmup 2 \
  --out "$OUT/bench-offload" > "$OUT/bench_offload.txt" 2>&1
echo "offload bench exit: $?" >> "$OUT/bench_offload.txt"

# 5. The chunked LM head + loss (issue 9): Qwen3-8B shape (4 layers, bf16, LoRA, vocabulary 151,936),
#    16,384 packed tokens, every position labelled: step time and peak memory of the stock loss,
#    TRL's fused LM head and slipstream's chunked loss.
timeout 35 python benchmarks/chunked_loss.py --device cuda --model qwen3-8b --layers 4 --tokens 16384 \
  --dtypes bfloat16 --labelled 1.0 --steps 3 --warmup 1 --out "$OUT/bench-chunked-loss" > "$OUT/bench_chunked_loss.txt" 2>&1
echo "chunked loss bench exit: $?" >> "$OUT/bench_chunked_loss.txt"

# 5b. MFU at the limit (issue 20): the Qwen3-8B shape (4 layers, real vocabulary 151,936, LoRA r16,
#     bf16), 16,384-token packed rows of the demo data; the record's MFU is against the H200's bf16
#     matmul peak measured by the run itself (target >= 0.5); --profile-step adds where one more step's
#     device time went (matmul, attention, copies, ...) and the GEMM rate (its CUDA path's first run).
timeout 55 slipstream ab --model qwen3-8b --layers 4 --dtype bfloat16 --lora-rank 16 --max-seq-len 16384 \
  --rows 8000 --steps 5 --warmup 2 --profile-step --arms slipstream --out "$OUT/ab-qwen3-8b-16k" > "$OUT/ab_qwen3_8b_16k.txt" 2>&1
echo "ab qwen3-8b 16k exit: $?" >> "$OUT/ab_qwen3_8b_16k.txt"

# 6. Liger-Kernel's fused RMSNorm / SwiGLU / RoPE (issue 20, 4b): parity against the stock modules on
#    a packed batch and an exact undo (tests/fused/test_gpu.py), then the slipstream arm with and
#    without them on a Qwen3-8B shape (2 layers, bf16, LoRA). Only where liger-kernel imports here.
if python -c "import liger_kernel.transformers.monkey_patch" > /dev/null 2>&1; then
  timeout 30 python -m pytest -q -m gpu tests/fused/test_gpu.py -p no:cacheprovider > "$OUT/fused_kernels_tests.txt" 2>&1
  echo "fused kernels tests exit: $?" >> "$OUT/fused_kernels_tests.txt"
  timeout 30 slipstream ab --model qwen3-8b --layers 2 --dtype bfloat16 --lora-rank 16 --max-seq-len 4096 \
    --steps 6 --warmup 2 --fused-kernels liger --arms slipstream-no-fused-kernels,slipstream \
    --out "$OUT/ab-fused-kernels" > "$OUT/ab_fused_kernels.txt" 2>&1
  echo "ab fused kernels exit: $?" >> "$OUT/ab_fused_kernels.txt"
else
  echo "liger-kernel does not import on this machine: the fused-kernel checks were skipped" \
    | tee "$OUT/fused_kernels_tests.txt"
fi

# 7. grpo.engine vllm (issue 45): the real engine's tests (the policy's log-probs after each sync,
#    seeded sampling, a GRPO run on its rollouts) with the vllm package beside slipstream on the GPU.
#    Only where vllm imports here (the lent machine has none unless its wheel travels in .whl).
if python -c "import vllm" > /dev/null 2>&1; then
  SLIPSTREAM_VLLM_PYTHON="$(command -v python)" timeout 240 python -m pytest -q --runslow -m vllm tests/engines \
    -p no:cacheprovider > "$OUT/vllm_engine_tests.txt" 2>&1
  echo "vllm engine tests exit: $?" >> "$OUT/vllm_engine_tests.txt"
else
  echo "vllm does not import on this machine: the engine's checks were skipped" | tee "$OUT/vllm_engine_tests.txt"
fi

# 8. Agents (issue 46): a trajectory's turns continue from its kept KV cache on CUDA, each tool result
#    fed into its stopped row mid-batch, token for token what each whole sequence decoded alone gives.
timeout 20 python -m pytest -q -m gpu tests/test_rollouts.py -k cuda -p no:cacheprovider > "$OUT/agents_kept_cache.txt" 2>&1
echo "agents kept cache exit: $?" >> "$OUT/agents_kept_cache.txt"
