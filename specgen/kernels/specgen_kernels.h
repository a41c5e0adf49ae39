// Functions shared between the kernel sources (linear.cc, cpu_ops.cc), compiled into one extension module.
#pragma once

#include <cstdint>

namespace specgen {

// y [m, n] = x [m, k] @ W, W packed as [panels, k, 32] (linear.cc; float32, each output one FMA chain over k).
void packed_linear(const float* x, int64_t m, int64_t k, const float* w, int64_t panels, float* y, int64_t n);

}  // namespace specgen
