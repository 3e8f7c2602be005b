// 16-byte vector units for the elementwise CUDA kernels (nvcc only).
//
// An elementwise kernel that moves one 2-byte element per thread and iteration issues eight
// times the load and store instructions of one that moves 16 bytes, and keeps fewer bytes in
// flight per thread; on an H200 the one-element SwiGLU forward reached ~1.5 TB/s of the ~4
// (bfloat16, 8192 x 14336). The kernels are therefore templates on V, the elements per access:
// V = kVecElems<T> (16 bytes) when every pointer is 16-byte aligned and the row width is a
// multiple of V, else V = 1, the same code one element at a time. A row of n elements is then n / V
// units, and the index helpers of the shared headers (RowColCursor, PackedGateUp) run in units.
#pragma once

#include <cstdint>

namespace parallel_layers::cuda {

template <typename T>
inline constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

template <typename T, int V>
struct alignas(sizeof(T) * V) Vec {
  T v[V];
};

inline bool aligned16(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 16 == 0; }

// Unit i of an array of T read / written as Vec<T, V>.
template <int V, typename T>
__device__ __forceinline__ Vec<T, V> load_unit(const T* p, int64_t i) {
  return reinterpret_cast<const Vec<T, V>*>(p)[i];
}
template <int V, typename T>
__device__ __forceinline__ void store_unit(T* p, int64_t i, const Vec<T, V>& u) {
  reinterpret_cast<Vec<T, V>*>(p)[i] = u;
}

// f.template operator()<V>() with V = kVecElems<T> when `vectorizable`, else V = 1.
template <typename T, typename F>
void dispatch_vec(bool vectorizable, F&& f) {
  if (vectorizable) {
    f.template operator()<kVecElems<T>>();
  } else {
    f.template operator()<1>();
  }
}

}  // namespace parallel_layers::cuda
