// The one place a build's instruction set is chosen (CPU_CAPABILITY_*, set per library by backends/cpu/__init__.py).
// Each header defines the same interface in namespace qkvfuse_cpu::isa; the drivers (split_qkv_rmsnorm_rope.cpp,
// add_rmsnorm.cpp) call it and contain no ISA-specific code:
//
//   kName                         the specialisation's name ("none", "AVX2", "AVX-512")
//   SplitHeads<T>                 one split call: (const SplitPlan&, norm_mode) picks the specialised heads, if any,
//                                 and prepares their per-call tables (weights in lane order)
//     .copy(dst, src, bytes)      a V row or gate head, streamed when the outputs are
//     .fence()                    after a thread's last streamed store
//     ::Token                     one thread's tables: Token(call, cos, sin) with the thread's cos/sin rows;
//       .start(finite)            once per token, after cos/sin are gathered
//       .run(src, ss, dst, n, is_q, finite, generic)
//                                 up to n heads (ss values apart in src, D apart in dst) of one weight set; returns
//                                 how many it wrote (0: none, the driver takes the generic head); a head it
//                                 leaves to the generic path goes through generic(src_head, dst_head)
//   norm_rows_stored(p, dtype, weight, bias, gemma_w)
//                                 add_rmsnorm rows reading the weights as stored; returns whether they ran
//   norm_rows_fp32(p, dtype)      add_rmsnorm rows on fp32 weights (p.w, p.b); returns whether they ran
//   stream_cache_rows(bytes), stream_copy(dst, src, bytes), stream_fence()
//                                 whether a cache-writing split that writes `bytes` to its caches streams its
//                                 contiguous cache rows, the streamed copy, the fence after a thread's last
//   cache_transpose(elem, pair, dst, stride, src, src_stride, n, m, stream)
//                                 the tiled KV caches' K transpose of up to 16 token rows (cache.h transpose_rows);
//                                 returns how many columns it wrote (0: the portable loop writes them)
//   cache_amx_v_pair(elem, line, row0, row1, D, bs, stream), cache_amx_v_row(elem, dst, row, D, bs, odd)
//                                 two tokens' rows (one token's) into an amx V region; return whether they wrote
//   quantize_fp8<kMant, kBias, kTrunc, kMul>(x, n, scale, bound, out)
//                                 an FP8 cache row's bits (cache.h quantize_row_as); returns how many it wrote
//   kPackBlock, pack_rne_block    the specialised bf16 rounding on its own, for tests (0: none)
//
// Every specialisation gives each output a value that depends only on its own row or head, its token's cos/sin
// and the weights (never on the thread split or the batch); README.md lists each path's bit contract.
#pragma once

#if defined(CPU_CAPABILITY_AVX512)
#include "isa/avx512.h"
#elif defined(CPU_CAPABILITY_AVX2)
#include "isa/avx2.h"
#else
#include "isa/none.h"
#endif
