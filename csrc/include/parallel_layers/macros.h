// Portability macros shared by the C++ (CPU) and CUDA translation units.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define PL_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define PL_HOST_DEVICE inline
#endif
