// Attention of decode queries over K/V rows in host memory, on the host's cores: the building
// block of attention on the host (issue 14's lever for an 8B model on an 8 GB card: a streamed
// layer's K/V stays on the host and only a query and its output cross PCIe; Note [Attention on
// the host] in host_attention.cpp). Used by the binding's KVStore.host_attend (decode with
// RevivaConfig(decode_attention="host"), Note [Host-side appends] in append_blocks.cpp).
#pragma once

#include <reviva/export.h>

#include <cstddef>

namespace reviva {

// How the K/V rows' elements are stored. Fp8E4M3: the device store's fp8 rows (Note [fp8 K/V
// rows] in python/reviva/cache/fp8.py), each head's key or value head_dim e4m3 bytes (CUDA's
// __NV_E4M3) then its fp32 scale (4 bytes, little-endian), the element being the e4m3 value x
// the scale.
enum class RowType { BFloat16, Float32, Fp8E4M3 };

struct HostAttentionShape {
  std::size_t batch = 1;
  std::size_t kv_heads = 1;
  std::size_t heads = 1;  // query heads, a multiple of kv_heads (grouped-query attention)
  std::size_t head_dim = 1;
};

// One query per sequence and head attends to keys [first, last) of token-major rows: row t is
// [2][batch][kv_heads][head_dim] (its keys, then its values) of `type`, rows back to back from
// `rows`; for Fp8E4M3 [2][batch][kv_heads] of head_dim + 4 bytes (2 x batch x kv_heads x
// (head_dim + 4) bytes a token), head_dim a multiple of 4 (the store's scales 4-byte aligned).
// q: [batch][heads][head_dim] fp32 (scores are q.k * scale); out: the same shape, fp32.
// `threads` >= 1 share the keys, in chunks each takes as it comes free (their partial results
// merged by log-sum-exp, in key order): the calling thread and threads - 1 workers of a pool kept
// between calls; calls from several threads at once are
// safe, their parallel parts taking turns. Throws
// InvalidArgument naming a bad value (an empty range, heads not a multiple of kv_heads, null
// pointers, threads < 1, an fp8 head_dim not a multiple of 4).
REVIVA_API void host_decode_attention(const void* rows, RowType type,
                                      const HostAttentionShape& shape, std::size_t first,
                                      std::size_t last, const float* q, float scale, float* out,
                                      int threads);

}  // namespace reviva
