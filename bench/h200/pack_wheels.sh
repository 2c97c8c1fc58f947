#!/usr/bin/env bash
# Pack SGLang 0.5.17 and what it needs on top of the device image into .h200pack/ (about 48 MB),
# so that one device call carries everything (the device has no network; its python3 is 3.12
# with torch 2.11.0+cu130, which sglang 0.5.17 pins). Also trains and packs the tokenizer.
#
# Usage (repo root, this machine): bash bench/h200/pack_wheels.sh
# Then: pass ".h200pack" in the device tool's `carry`; bench/h200/run.py unpacks it there.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
WORK=${WORK:-/tmp/h200pack-build}
OUT=.h200pack
grep -qx '/.h200pack/' .git/info/exclude 2>/dev/null || echo '/.h200pack/' >> .git/info/exclude
mkdir -p "$WORK/whl" "$OUT"

PLAT=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 manylinux_2_5_x86_64 \
         manylinux_2_24_x86_64 manylinux_2_26_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64 \
         manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 any; do
  PLAT+=(--platform "$p")
done
PIPARGS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLAT[@]}")

# The pins are sglang 0.5.17's own (METADATA) where it pins; transformers 5.17 in the image
# breaks sglang 0.5.17 ("'qwen3_asr' is already used by a Transformers config").
PKGS=(
  sglang==0.5.17 sglang-kernel==0.4.5 flashinfer-python==0.6.15.post1 sgl-deep-gemm==0.1.5.post1
  transformers==5.12.1 tokenizers==0.22.2 apache-tvm-ffi==0.1.11 openai==2.6.1 xgrammar==0.2.1
  soundfile==0.13.1 typing_extensions==4.16.0
  orjson pybase64 starlette fastapi uvicorn pydantic pydantic_core annotated-types typing-inspection
  msgspec pyzmq ipython traitlets dill sniffio distro partial-json-parser opentelemetry-api
  compressed-tensors loguru gguf setproctitle jsonschema referencing rpds-py jsonschema-specifications
  cffi pycparser python-multipart
)
"$PY" -m pip download -q "${PIPARGS[@]}" -d "$WORK/whl" "${PKGS[@]}"
rm -rf "$WORK/site"
"$PY" -m pip install -q --no-compile "${PIPARGS[@]}" --target "$WORK/site" "$WORK"/whl/*.whl

# Drop what the run never loads: FA3 (1.1 GB), Blackwell kernels, InfLLM, xgrammar's static lib.
rm -f "$WORK"/site/sgl_kernel/flash_ops.abi3.so "$WORK"/site/sgl_kernel/infllm_ops*.so \
      "$WORK"/site/xgrammar/lib/libxgrammar.a
rm -rf "$WORK"/site/sgl_kernel/sm100
# Native libraries the HTTP server path never imports (its Rust server and gRPC cores, FlashMLA for
# MLA models): about 35 MB, so the pack and the repository travel together with room to spare.
rm -f "$WORK"/site/sglang/srt/server/_core.*.so "$WORK"/site/sglang/srt/grpc/_core.*.so \
      "$WORK"/site/sgl_kernel/flashmla_ops.abi3.so
# SGLang's diffusion runtime and test helpers: the LLM server never imports them, and without
# them the pack plus the repo stays under the device tool's 64 MiB per call.
rm -rf "$WORK"/site/sglang/multimodal_gen "$WORK"/site/sglang/test
# Headers and data that only compile or transform quantized models (DeepGEMM's JIT for fp8,
# compressed-tensors' Hadamard tables): the bf16 models never use them, and the tree grows with
# every call's results. (tvm-ffi's libtvm_ffi_testing.so looks like a test library, but its
# core links it: without it no server starts.)
rm -rf "$WORK"/site/deep_gemm/include \
       "$WORK"/site/compressed_tensors/transform/utils/hadamards.safetensors
tar -C "$WORK/site" -cf - . | xz -T0 -9 > "$OUT/site.tar.xz"

"$PY" bench/h200/make_tokenizer.py --out "$WORK/tokenizer"
tar -C "$WORK" -cJf "$OUT/tokenizer.tar.xz" tokenizer
ls -la "$OUT"
