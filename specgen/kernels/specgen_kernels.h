// Functions shared between the kernel sources (linear.cc, cpu_ops.cc), compiled into one extension module.
#pragma once

#include <cstdint>

#include "paddle/extension.h"

namespace specgen {

// A packed weight W [k, n] (linear.cc): float32 panels [panels, k, 32] (block_bytes 0), or block-quantized
// uint8 panels [panels, k / 32, block_bytes].
struct PackedWeight {
  const void* data;
  int64_t panels;
  int64_t block_bytes;
};

// Checks that w is a packed weight of k inputs and n outputs (errors name `name`) and describes it.
PackedWeight packed_weight(const paddle::Tensor& w, int64_t k, int64_t n, const char* name);

// y [m, n] = x [m, k] @ W (float32; each output one FMA chain over k, whatever the weight's storage).
void packed_linear(const float* x, int64_t m, int64_t k, const PackedWeight& w, float* y, int64_t n);

}  // namespace specgen
