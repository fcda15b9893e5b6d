#!/usr/bin/env bash
# One-shot check of a machine with an NVIDIA GPU and many cores, in under 8 minutes, ending with one summary:
#
#   benchmarks/device_check.sh [OUT_DIR]        (the project installed: pip install -e ".[test,cuda]")
#
# 1. the machine: GPU, processor and its vector extensions, cores, load;
# 2. the GPU tests (tests/test_cuda_gpu.py: every op against the CPU backend, training steps in every memory mode,
#    LeNet learning the digits with --device cuda, data-parallel ranks on the GPU, the fat binary; the cuBLAS
#    binding against the real library; the multi-device GEMM's CUDA device against numpy, in and out of core);
# 3. benchmarks/cuda_vs_pytorch.py: LeNet and AlexNet steps on the GPU against PyTorch eager, and each side's GPU
#    busy time and longest kernels;
# 4. benchmarks/cpu_vs_peers.py: LeNet and the ViT on the CPU against PyTorch eager, at 1, 2, 4, 8 and 16 threads
#    (as many as the machine has), interleaved.
# Each part has its own time limit; a part that fails or runs out of time is reported and the next one runs. Every
# part's whole output is kept in OUT_DIR (default: a new temporary directory), the summary printed last.
set -u
cd "$(dirname "$0")/.."
out=${1:-$(mktemp -d)}
mkdir -p "$out"
summary=()

part() {            # part NAME SECONDS COMMAND...: run it, keep its output, note how it ended
    local name=$1 limit=$2
    shift 2
    local began=$SECONDS
    timeout "$limit" "$@" >"$out/$name.txt" 2>&1
    local rc=$?
    local how="ok"
    if [ "$rc" -eq 124 ]; then how="ran out of its ${limit} s"; elif [ "$rc" -ne 0 ]; then how="failed (exit $rc)"; fi
    summary+=("$name: $how in $((SECONDS - began)) s")
}

{
    echo "date: $(date -u +%FT%TZ)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    grep -m1 "model name" /proc/cpuinfo
    echo "vector extensions: $(grep -m1 -o -w -E 'avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
    echo "cores: $(nproc); load average: $(cut -d' ' -f1-3 /proc/loadavg)"
    python3 -c "import numpy, torch; print('numpy', numpy.__version__, '| torch', torch.__version__,
                                           '| torch sees CUDA:', torch.cuda.is_available())"
    python3 -c "import pycuda; print('pycuda', pycuda.VERSION_TEXT)" 2>&1 | tail -1
} >"$out/machine.txt" 2>&1

part gpu_tests 240 python3 -m pytest -q -n 0 -p no:cacheprovider tests/test_cuda_gpu.py tests/test_cublas_binding.py \
    tests/test_gemm.py::test_cuda_device_matches_numpy tests/test_gemm.py::test_cuda_out_of_core
if ! grep -q " passed" "$out/gpu_tests.txt"; then         # every test skipped: no GPU or no pycuda here
    summary[-1]="${summary[-1]}, but no GPU test ran (no GPU, or no pycuda)"
fi
part cuda_vs_pytorch 120 python3 benchmarks/cuda_vs_pytorch.py --warmup 3 --steps 10 --kernels 12 \
    --json "$out/cuda_vs_pytorch.json"
threads=()
for t in 1 2 4 8 16; do [ "$t" -le "$(nproc)" ] && threads+=("$t"); done
part cpu_vs_peers 150 python3 benchmarks/cpu_vs_peers.py lenet:64 vit:64 --threads "${threads[@]}" --rounds 1 \
    --warmup 1 --steps 3 --sides ours eager --markdown

echo "== device check ($out) =="
cat "$out/machine.txt"
for line in "${summary[@]}"; do echo "$line"; done
echo "== GPU tests =="
tail -n 3 "$out/gpu_tests.txt"
echo "== CUDA against PyTorch =="
grep -E '^\||^device|busy' "$out/cuda_vs_pytorch.txt" || tail -n 12 "$out/cuda_vs_pytorch.txt"
echo "== CPU against PyTorch eager =="
grep -E '^\||load average' "$out/cpu_vs_peers.txt" || tail -n 5 "$out/cpu_vs_peers.txt"
