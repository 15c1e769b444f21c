#!/bin/sh
# Build the quantized-linear prototype in place: slotinfer/cpu/qkernel/_qkernel*.so.
#   sh slotinfer/cpu/qkernel/build.sh [python]
# Needs a C++20 compiler, CMake >= 3.24 and the mlx wheel in that Python.  nanobind (a build-time
# dependency only, headers and sources) is taken from that Python if it has it, else installed
# into build/qkernel-deps.  Its version must share mlx.core's nanobind ABI (nanobind 3.x for
# mlx 0.32.4), or mx.array will not pass between the two modules.
set -eu
PY=${1:-python3}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../../.." && pwd)
BUILD="$ROOT/build/qkernel"
if ! "$PY" -c "import nanobind" 2>/dev/null; then
  "$PY" -m pip install -q --target "$ROOT/build/qkernel-deps" "nanobind>=3,<4"
  PYTHONPATH="$ROOT/build/qkernel-deps${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONPATH
fi
PYEXE=$("$PY" -c "import sys; print(sys.executable)")
cmake -S "$HERE" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$PYEXE"
cmake --build "$BUILD" -j 2
cp "$BUILD"/_qkernel*.so "$HERE/"
echo "built $(ls "$HERE"/_qkernel*.so)"
