#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` for benchmarks/serve.py's anchor, from the source that
# the llama-cpp-python source distribution carries (vendor/llama.cpp), and installs its gguf
# package, which convert_hf_to_gguf.py needs. Never run by CI: 20-40 minutes on 2 cores.
#
# Usage: bash benchmarks/build_llama_server.sh [FOLDER]      (default ~/.cache/gptlab/llama.cpp)
# Then:  python -m benchmarks.serve --llama FOLDER ...
set -euo pipefail
dest="${1:-${GPTLAB_CACHE:-$HOME/.cache/gptlab}/llama.cpp}"
mkdir -p "$dest"
cd "$dest"
if ! ls llama_cpp_python-*.tar.gz >/dev/null 2>&1; then
    python -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python -d .
fi
sdist="$(ls llama_cpp_python-*.tar.gz | sort -V | tail -1)"
src="${sdist%.tar.gz}"
[ -d "$src" ] || tar xzf "$sdist"
llama="$src/vendor/llama.cpp"
# the server alone, for this CPU (GGML_NATIVE), without libcurl (it never downloads here)
cmake -S "$llama" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON >/dev/null
cmake --build build --target llama-server -j "$(nproc)"
python -m pip install --quiet "$llama/gguf-py"
ln -sfn "$llama/convert_hf_to_gguf.py" convert_hf_to_gguf.py
echo "built $dest/build/bin/llama-server; convert with $dest/convert_hf_to_gguf.py"
