// The CUDA half of the native decode path's landing (resolve.cpp): after a resolution's host
// function planned its copies (the call's slots, then each miss's rows from page-locked staging
// into its slot), this kernel makes them, in stream order before the expert gathers run. The
// plan's size is known only on the host, so the grid covers the most a call can need and the
// blocks beyond the plan's count return at once (a call whose experts all hit copies its slots
// alone).
#include <cstdint>

#include <cuda_runtime.h>

namespace {

struct Move {  // resolve.cpp's Move
  uint64_t dst, src, bytes;
};

constexpr unsigned BLOCKS_PER_MOVE = 32, THREADS = 256;

__global__ void land_rows(const Move* moves, const uint32_t* count) {
  if (blockIdx.y >= *count) return;
  const Move m = moves[blockIdx.y];
  const uint64_t first = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t step = uint64_t(gridDim.x) * blockDim.x;
  if (((m.dst | m.src | m.bytes) & 15) == 0) {
    auto* dst = reinterpret_cast<uint4*>(m.dst);
    const auto* src = reinterpret_cast<const uint4*>(m.src);
    for (uint64_t i = first; i < m.bytes / 16; i += step) dst[i] = src[i];
  } else {
    auto* dst = reinterpret_cast<unsigned char*>(m.dst);
    const auto* src = reinterpret_cast<const unsigned char*>(m.src);
    for (uint64_t i = first; i < m.bytes; i += step) dst[i] = src[i];
  }
}

}  // namespace

extern "C" cudaError_t expert_stream_land(const void* moves, const uint32_t* count, uint32_t max_moves,
                                          cudaStream_t stream) {
  land_rows<<<dim3(BLOCKS_PER_MOVE, max_moves), THREADS, 0, stream>>>(static_cast<const Move*>(moves), count);
  return cudaGetLastError();
}
