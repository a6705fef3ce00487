#!/usr/bin/env bash
# Build the spike's primitive (host_lookup.cpp) against the
# installed MLX, its nanobind and, where MLX runs on CUDA, the CUDA runtime.
# Usage: bash build.sh NANOBIND_DIR [CUDA_HOME]
# (NANOBIND_DIR: an unpacked nanobind of the version MLX was built with: 3.1 for MLX 0.32).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
nb=$1
cuda=${2:-}
mlx=$(python3 -c "import mlx, os; print(list(mlx.__path__)[0])")
py=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['include'])")
ext=$(python3 -c "import sysconfig; print(sysconfig.get_config_var('EXT_SUFFIX'))")
flags=(-O2 -std=c++20 -fPIC -fvisibility=hidden -DNB_DOMAIN=mlx -I"$mlx/include" -I"$py" -I"$nb/include" -I"$nb/ext/robin_map/include")
libs=(-L"$mlx/lib" -lmlx -Wl,-rpath,"$mlx/lib")
if [ -n "$cuda" ]; then
  flags+=(-DSPIKE_CUDA -I"$cuda/include" -I"$mlx/include/cccl" -I"$here/../../../../native/cuda_shim")
  # the CUDA runtime libmlx itself loads: one runtime in the process
  cudart=$(ldd "$mlx/lib/libmlx.so" | awk '/libcudart/ && $3 ~ /^\// {print $3; exit}')
  libs+=("${cudart:-$cuda/lib64/libcudart.so}")
fi
out=${OUT_DIR:-$here/build}  # build/ is git-ignored
mkdir -p "$out"
g++ "${flags[@]}" -c "$nb/src/nb_combined.cpp" -o "$out/nb_combined.o"
for name in host_lookup; do
  g++ "${flags[@]}" -shared "$here/$name.cpp" "$out/nb_combined.o" "${libs[@]}" -o "$out/_$name$ext"
  echo "built $out/_$name$ext"
done
