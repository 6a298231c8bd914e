#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (CI has none).
#
#   scripts/gpu_checks.sh --prepare   # here: pydantic wheels into .whl/, stories260K and SmolLM2's
#                                     # config + tokenizer into .devcarry/ (both git-ignored)
#   scripts/gpu_checks.sh OUT_DIR     # there, carrying .whl and .devcarry: the Triton kernel tests,
#                                     # the CUDA engine tests, both GPU benches, an NCCL probe
#   PARTS="kernels profile" scripts/gpu_checks.sh OUT_DIR   # some of: tests kernels engine profile nccl
#
# The GPU image has torch, triton and transformers but not pydantic; the real SmolLM2 weights are
# too large to travel, so the engine bench draws random weights for SmolLM2's config.
set -u
cd "$(dirname "$0")/.."

if [ "${1:-}" = "--prepare" ]; then
    set -e
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
        "pydantic==$(.venv/bin/python -c 'import pydantic; print(pydantic.VERSION)')" \
        "pydantic_core==$(.venv/bin/python -c 'import pydantic_core; print(pydantic_core.__version__)')" \
        annotated_types typing_inspection
    smol="${KEYSERVE_CACHE_DIR:-$HOME/.cache/keyserve}/models/SmolLM2-135M-Instruct"
    rm -rf .devcarry && mkdir -p .devcarry/smol
    cp -r "${KEYSERVE_STORIES260K:-../shared/models/stories260k}" .devcarry/stories260k
    cp "$smol"/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja,generation_config.json} .devcarry/smol/
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    grep -qx '/.devcarry/' .git/info/exclude 2>/dev/null || echo '/.devcarry/' >> .git/info/exclude
    exit 0
fi

out="${1:?an output folder}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export KEYSERVE_STORIES260K="$PWD/.devcarry/stories260k"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH="/tmp/site:$PWD/src:$PWD/tests"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/machine.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$out/machine.txt"
status=0
PARTS="${PARTS:-tests kernels engine nccl}"
part() { [[ " $PARTS " == *" $1 "* ]]; }
cp docs/BENCHMARKS.md "$out/BENCHMARKS.md"

part tests && { echo "== tests on the GPU"
# shellcheck disable=SC2086  # TESTS is a list of paths and globs
# Besides the GPU's own tests, the engine's CPU-designed tests: on a GPU machine the engine's
# default device is CUDA, so they run there (not the one that needs FastAPI, absent there).
timeout "${TESTS_S:-300}" python3 -m pytest -q -ra -p no:cacheprovider -n 14 -m "not slow" \
    --deselect tests/engine/test_speculative_kv_budget.py::test_cli_and_serve_flags_reach_the_spec_config \
    ${TESTS:-tests/kernels/test_triton_*.py tests/engine/test_cuda_engine.py tests/unit/test_kv_policy.py
    tests/unit/test_spec_decode.py tests/unit/test_sampler.py tests/unit/test_cuda_graphs.py
    tests/engine/test_decode_graph_buffers.py tests/engine/test_prefix_store_engine.py
    tests/engine/test_draft_chain.py::test_chained_drafts_on_stories260k
    tests/engine/test_adaptive_k_engine.py tests/engine/test_bad_input.py tests/engine/test_continuous_batching.py
    tests/engine/test_kv_budget_engine.py tests/engine/test_kv_budget_oracle.py tests/engine/test_kv_budget_replicas.py
    tests/engine/test_lost_step.py tests/engine/test_speculative_engine.py tests/engine/test_speculative_kv_budget.py
    tests/engine/test_speculative_target_budget.py} 2>&1 | tee "$out/pytest.log" | tail -25
[ "${PIPESTATUS[0]}" = 0 ] || status=1; }

part kernels && { echo "== Triton kernel bench"
timeout "${KERNEL_BENCH_S:-110}" python3 bench/gpu_kernel_bench.py --md "$out/BENCHMARKS.md" --out "$out" \
    2>&1 | grep -v "it/s]" | tail -40; }

part engine && { echo "== engine bench"
timeout "${ENGINE_BENCH_S:-170}" python3 bench/gpu_engine_bench.py --config-dir .devcarry/smol \
    --md "$out/BENCHMARKS.md" --json "$out/engine_gpu.json" --hf-budget "${HF_BUDGET_S:-30}" \
    2>&1 | grep -v "it/s]" | tail -30; }

part profile && { echo "== batch-1 decode step profile"
timeout "${PROFILE_S:-120}" python3 bench/gpu_engine_bench.py --config-dir .devcarry/smol --profile-only \
    --profile-steps 32 --json "$out/profile.json" 2>&1 | grep -v "it/s]" | head -120; }

part nccl || exit $status
echo "== NCCL: two ranks on this one GPU"
cat > /tmp/nccl_probe.py <<'EOF'
import os, torch, torch.distributed as dist, torch.multiprocessing as mp

def rank(r: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("nccl", rank=r, world_size=2, device_id=torch.device("cuda", 0))
    x = torch.full((4,), float(r + 1), device="cuda")
    dist.all_reduce(x)
    print(f"rank {r}: all_reduce -> {x.tolist()}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    try:
        mp.spawn(rank, nprocs=2)
    except Exception as e:  # NCCL refuses two ranks on one device
        print("NCCL, 2 ranks on 1 GPU:", type(e).__name__, str(e).splitlines()[-1][:300])
EOF
timeout 40 python3 /tmp/nccl_probe.py 2>&1 | grep -v "^\s*$" | tail -12
exit $status
