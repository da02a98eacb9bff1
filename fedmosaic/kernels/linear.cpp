// Skinny-batch Linear layer with the plain-SGD update fused into its backward (AVX2 + FMA).
//
// forward:  y[B, O] = x[B, I] W[O, I]^T + b            (W streamed once, no packing)
// backward: dx[B, I] = dy[B, O] W   (the old W)         } one pass over W
//           W -= lr * dy^T x ;  b -= lr * sum_b dy      }
//
// Every output element is computed by one thread in a fixed order, so results do not depend on
// the number of threads: the same inputs give the same bits run to run.
//
// Two instruction sets, one arithmetic: where the CPU has AVX-512 (and the caller allows it:
// set_avx512), 16-lane versions run that perform, element by element, the same fused
// multiply-adds in the same order as the 8-lane AVX2 code (the backward vectorizes over columns
// of W, whose sums run over the batch and the rows of W, never across lanes; the forward keeps
// the 8-lane partial sums of two rows of W in one 16-lane register and reduces each half with the
// AVX2 tree), so both give the same bits.
//
// This unit includes ATen's tensor and per-operator headers only; the Python bindings are
// bindings.cpp's. torch/extension.h (the whole C++ frontend) was ~90% of the compile time, and
// the two units compile in parallel.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <memory>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lanes 0..rem-1 on (rem in 1..7).
inline __m256i tail_mask(int64_t rem) {
  alignas(32) static const int32_t m[16] = {-1, -1, -1, -1, -1, -1, -1, -1,
                                            0,  0,  0,  0,  0,  0,  0,  0};
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m + 8 - rem));
}

// f(std::integral_constant<int, k>{}) with k = min(n, N), n >= 1: a run-time count as the
// compile-time size of a register tile.
template <int N, typename F>
inline void with_size(int64_t n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_size<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// ---- forward ---------------------------------------------------------------------------------
// R rows of W (starting at w) against NB batch rows of x (row stride lx), columns [i0, i1) (i0 a
// multiple of 8; i1 = I or a multiple of 8): R * NB accumulators in registers. Lane l of
// accumulator (r, b) sums x[b, i] w[r, i] over i = l (mod 8) in increasing i, one fused
// multiply-add each; y = the 8-lane tree sum + bias. A pass over a part of the columns starts
// from the partial sums the previous part stored in part[(b * R + r) * 8 ...] (first: from 0)
// and stores them again (last: reduces them into y): the same operations in the same order as
// one pass, so the same bits.
template <int R, int NB>
void fwd_tile(const float* x, const float* w, int64_t I, int64_t lx, int64_t i0, int64_t i1,
              float* part, bool first, bool last, float* y, int64_t O, const float* bias) {
  __m256 acc[R][NB];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b)
      acc[r][b] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(part + (b * R + r) * 8);
  const auto chunk = [&](int64_t i) {  // columns [i, i + 8)
    __m256 wv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + r * I + i);
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      __m256 xv = _mm256_loadu_ps(x + b * lx + i);
      // one load of x per row of the batch: left to itself the compiler folds the load into
      // each of the R multiply-adds (R loads), and the loads, not the multiply-adds, then set
      // the pace
      __asm__("" : "+x"(xv));
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(wv[r], xv, acc[r][b]);
    }
  };
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {  // a cache line of each row per step
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)  // the next tile's rows (W is streamed once)
      _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * I + i), _MM_HINT_T0);
    chunk(i);
    chunk(i + 8);
  }
  if (i + 8 <= i1) {
    chunk(i);
    i += 8;
  }
  if (i < i1) {
    const __m256i m = tail_mask(i1 - i);
    __m256 wv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) wv[r] = _mm256_maskload_ps(w + r * I + i, m);
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      const __m256 xv = _mm256_maskload_ps(x + b * lx + i, m);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(wv[r], xv, acc[r][b]);
    }
  }
  if (!last) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
      for (int b = 0; b < NB; ++b) _mm256_storeu_ps(part + (b * R + r) * 8, acc[r][b]);
    return;
  }
  // hsum's tree for two accumulators at once (lanes 0 and 4)
  const auto put = [&](int k, float s) {
    const int r = k / NB, b = k % NB;
    y[b * O + r] = s + (bias ? bias[r] : 0.0f);
  };
#pragma GCC unroll 16
  for (int k = 0; k + 1 < R * NB; k += 2) {
    const __m256 a = acc[k / NB][k % NB], c = acc[(k + 1) / NB][(k + 1) % NB];
    __m256 t = _mm256_add_ps(_mm256_permute2f128_ps(a, c, 0x20),
                             _mm256_permute2f128_ps(a, c, 0x31));  // lo + hi of a, of c
    t = _mm256_add_ps(t, _mm256_permute_ps(t, 0x4E));  // lanes 0, 1: t0 + t2, t1 + t3
    t = _mm256_add_ps(t, _mm256_permute_ps(t, 0xB1));  // lane 0: (t0 + t2) + (t1 + t3)
    put(k, _mm256_cvtss_f32(t));
    put(k + 1, _mm_cvtss_f32(_mm256_extractf128_ps(t, 1)));
  }
  if constexpr ((R * NB) % 2 == 1) put(R * NB - 1, hsum(acc[R - 1][NB - 1]));
}

constexpr int FR = 2;  // rows of W per forward tile
constexpr int FB = 6;  // batch rows per forward tile (FR * FB = 12 accumulators of 16 registers)

// The B rows of x [B, I] (and of y [B, O]) in blocks of at most MAXB of near-equal size (10 rows:
// 5 + 5, not 6 + 4: the short block wastes less): tile(rows as a compile-time size, first row).
template <int MAXB, typename F>
inline void batch_blocks(int64_t B, F&& tile) {
  const int64_t blocks = (B + MAXB - 1) / MAXB, nb = (B + blocks - 1) / blocks;
  for (int64_t b0 = 0; b0 < B; b0 += nb)
    with_size<MAXB>(std::min<int64_t>(nb, B - b0), [&](auto n) { tile(n, b0); });
}

// Columns per pass of the forward: the B rows of x over that many columns (24 KB at most) stay in
// L1 (32 KB on the smallest x86 cores with AVX2) while the rows of W pass over them; all columns
// when they fit, else near-equal blocks, each a multiple of 8 (lane l keeps its columns
// i = l mod 8). Measured with --isa avx2 on an AVX-512 Xeon (48 KB L1), one thread, batch 10:
// 16 KB blocks were 0.83-0.87x MKL at 1024 x 1024 and 512 x 512 where 24 KB ones were 0.9-1.15x.
inline int64_t fwd_columns(int64_t B, int64_t I) {
  const int64_t most = std::max<int64_t>(64, (24576 / 4 / std::max<int64_t>(B, 1)) / 8 * 8);
  if (most >= I) return I;
  const int64_t blocks = (I + most - 1) / most;  // near-equal blocks: no short last one
  return (I + blocks * 8 - 1) / (blocks * 8) * 8;
}

// The partial sums one task keeps between column blocks (n floats, uninitialized: each block's
// first pass writes them before any read); none when the columns fit in one pass, which never
// touches them.
inline std::unique_ptr<float[]> partial_sums(bool blocked, int64_t n) {
  return blocked ? std::unique_ptr<float[]>(new float[n]) : nullptr;
}

// R rows of W against all B rows of x, columns [i0, i1): part holds the B * R partial sums
// (nullptr for one pass over all columns).
template <int R>
void fwd_rows(const float* x, int64_t B, const float* w, int64_t I, int64_t lx, int64_t i0,
              int64_t i1, float* part, float* y, int64_t O, const float* bias) {
  batch_blocks<FB>(B, [&](auto n, int64_t b0) {
    fwd_tile<R, decltype(n)::value>(x + b0 * lx, w, I, lx, i0, i1,
                                    part ? part + b0 * R * 8 : nullptr, i0 == 0,
                                    i1 == I, y + b0 * O, O, bias);
  });
}

// ---- fused backward + SGD ---------------------------------------------------------------------
// Columns [j, j + 8) of W (masked to I when TAIL) for R rows from row o: the SGD update of those
// W entries and, when DX, their contribution to dx. dyt is dy transposed, [O, B].
template <int R, bool DX, bool TAIL>
inline void bwd_chunk(const float* x, const float* d, int64_t B, float* wr, int64_t I, int64_t ld,
                      float* dx, int64_t j, __m256i m, __m256 lrv) {
  __m256 wv[R], u[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    wv[r] = TAIL ? _mm256_maskload_ps(wr + r * I + j, m) : _mm256_loadu_ps(wr + r * I + j);
    u[r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < B; ++b) {
    const float* xp = x + b * ld + j;
    const __m256 xv = TAIL ? _mm256_maskload_ps(xp, m) : _mm256_loadu_ps(xp);
    __m256 g[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      g[r] = _mm256_broadcast_ss(d + r * B + b);  // dy[b, o + r]
      u[r] = _mm256_fmadd_ps(g[r], xv, u[r]);     // (dy^T x)[o + r, j:j+8]
    }
    if (DX) {  // dx[b, j:j+8] += sum_r dy[b, o+r] W_old[o+r, j:j+8]
      float* dxp = dx + b * ld + j;
      __m256 dxv = TAIL ? _mm256_maskload_ps(dxp, m) : _mm256_loadu_ps(dxp);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) dxv = _mm256_fmadd_ps(g[r], wv[r], dxv);
      if (TAIL) _mm256_maskstore_ps(dxp, m, dxv); else _mm256_storeu_ps(dxp, dxv);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m256 nw = _mm256_fnmadd_ps(lrv, u[r], wv[r]);  // W - lr * (dy^T x)
    if (TAIL) _mm256_maskstore_ps(wr + r * I + j, m, nw); else _mm256_storeu_ps(wr + r * I + j, nw);
  }
}

// Columns [c0, c1) of W for R rows starting at row o.
template <int R, bool DX>
void bwd_rows(const float* x, const float* dyt, int64_t B, float* w, int64_t I, int64_t ld,
              float* dx, int64_t o, int64_t c0, int64_t c1, float lr) {
  const __m256 lrv = _mm256_set1_ps(lr);
  const float* d = dyt + o * B;
  float* wr = w + o * I;
  const __m256i all = _mm256_set1_epi32(-1);
  int64_t j = c0;
  for (; j + 8 <= c1; j += 8) {
    if (((j - c0) & 15) == 0)  // the next rows' same columns, one prefetch per cache line
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(wr + (R + r) * I + j), _MM_HINT_T0);
    bwd_chunk<R, DX, false>(x, d, B, wr, I, ld, dx, j, all, lrv);
  }
  if (j < c1) bwd_chunk<R, DX, true>(x, d, B, wr, I, ld, dx, j, tail_mask(c1 - j), lrv);
}

constexpr int BR = 4;  // rows of W per backward step

// ---- AVX-512: the same arithmetic, 16 lanes ------------------------------------------------
#define AVX512 __attribute__((target("avx512f,avx512dq,avx512vl,avx512bw")))

AVX512 inline __m512 load_pair(const float* r0, const float* r1) {  // 8 floats of two rows
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(r0)), _mm256_loadu_ps(r1), 1);
}

AVX512 inline __m512 load_pair_masked(const float* r0, const float* r1, __m256i m) {
  return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_maskload_ps(r0, m)),
                            _mm256_maskload_ps(r1, m), 1);
}

// Rows 2p and 2p+1 of the tile share a register: lanes 0-7 are fwd_tile's 8-lane accumulator of
// row 2p, lanes 8-15 that of row 2p+1, so each lane sums the same products in the same order.
// Columns [i, i + 8) of the 2 * RP rows (a function: a lambda would not inherit the target).
template <int RP, int NB>
AVX512 __attribute__((always_inline)) inline void fwd_chunk512(__m512 (&acc)[RP][NB],
                                                               const float* x, const float* w,
                                                               int64_t I, int64_t lx, int64_t i) {
  __m512 wv[RP];
#pragma GCC unroll 16
  for (int r = 0; r < RP; ++r) wv[r] = load_pair(w + 2 * r * I + i, w + (2 * r + 1) * I + i);
#pragma GCC unroll 16
  for (int b = 0; b < NB; ++b) {
    const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + b * lx + i));
#pragma GCC unroll 16
    for (int r = 0; r < RP; ++r) acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);
  }
}

// Columns [i0, i1) and the partial sums in part[(b * RP + r) * 16 ...] as in fwd_tile.
template <int RP, int NB>
AVX512 void fwd_tile512(const float* x, const float* w, int64_t I, int64_t lx, int64_t i0,
                        int64_t i1, float* part, bool first, bool last, float* y, int64_t O,
                        const float* bias) {
  __m512 acc[RP][NB];
#pragma GCC unroll 16
  for (int r = 0; r < RP; ++r)
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b)
      acc[r][b] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(part + (b * RP + r) * 16);
  int64_t i = i0;
  for (; i + 16 <= i1; i += 16) {
#pragma GCC unroll 16
    for (int r = 0; r < 2 * RP; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w + (2 * RP + r) * I + i), _MM_HINT_T0);
    fwd_chunk512(acc, x, w, I, lx, i);
    fwd_chunk512(acc, x, w, I, lx, i + 8);
  }
  if (i + 8 <= i1) {
    fwd_chunk512(acc, x, w, I, lx, i);
    i += 8;
  }
  if (i < i1) {
    const __m256i m = tail_mask(i1 - i);
    __m512 wv[RP];
#pragma GCC unroll 16
    for (int r = 0; r < RP; ++r)
      wv[r] = load_pair_masked(w + 2 * r * I + i, w + (2 * r + 1) * I + i, m);
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_maskload_ps(x + b * lx + i, m));
#pragma GCC unroll 16
      for (int r = 0; r < RP; ++r) acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);
    }
  }
  if (!last) {
#pragma GCC unroll 16
    for (int r = 0; r < RP; ++r)
#pragma GCC unroll 16
      for (int b = 0; b < NB; ++b) _mm512_storeu_ps(part + (b * RP + r) * 16, acc[r][b]);
    return;
  }
#pragma GCC unroll 16
  for (int r = 0; r < RP; ++r)
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      const int o = 2 * r;
      y[b * O + o] = hsum(_mm512_castps512_ps256(acc[r][b])) + (bias ? bias[o] : 0.0f);
      y[b * O + o + 1] =
          hsum(_mm512_extractf32x8_ps(acc[r][b], 1)) + (bias ? bias[o + 1] : 0.0f);
    }
}

constexpr int FP512 = 2;   // row pairs per forward tile (4 rows of W)
constexpr int FB512 = 10;  // batch rows per forward tile (2 * 10 = 20 of 32 registers)

// 2 * FP512 rows of W against all B rows of x, columns [i0, i1) (partial sums in part).
AVX512 void fwd_rows512(const float* x, int64_t B, const float* w, int64_t I, int64_t lx,
                        int64_t i0, int64_t i1, float* part, float* y, int64_t O,
                        const float* bias) {
  batch_blocks<FB512>(B, [&](auto n, int64_t b0) {
    fwd_tile512<FP512, decltype(n)::value>(x + b0 * lx, w, I, lx, i0, i1,
                                           part ? part + b0 * FP512 * 16 : nullptr,
                                           i0 == 0, i1 == I, y + b0 * O, O, bias);
  });
}

template <int R, bool DX, bool TAIL>
AVX512 inline void bwd_chunk512(const float* x, const float* d, int64_t B, float* wr, int64_t I,
                                int64_t ld, float* dx, int64_t j, __mmask16 m, __m512 lrv) {
  __m512 wv[R], u[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    wv[r] = TAIL ? _mm512_maskz_loadu_ps(m, wr + r * I + j) : _mm512_loadu_ps(wr + r * I + j);
    u[r] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < B; ++b) {
    const float* xp = x + b * ld + j;
    const __m512 xv = TAIL ? _mm512_maskz_loadu_ps(m, xp) : _mm512_loadu_ps(xp);
    __m512 g[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) {
      g[r] = _mm512_set1_ps(d[r * B + b]);
      u[r] = _mm512_fmadd_ps(g[r], xv, u[r]);
    }
    if (DX) {
      float* dxp = dx + b * ld + j;
      __m512 dxv = TAIL ? _mm512_maskz_loadu_ps(m, dxp) : _mm512_loadu_ps(dxp);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) dxv = _mm512_fmadd_ps(g[r], wv[r], dxv);
      if (TAIL) _mm512_mask_storeu_ps(dxp, m, dxv); else _mm512_storeu_ps(dxp, dxv);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) {
    const __m512 nw = _mm512_fnmadd_ps(lrv, u[r], wv[r]);
    if (TAIL) _mm512_mask_storeu_ps(wr + r * I + j, m, nw); else _mm512_storeu_ps(wr + r * I + j, nw);
  }
}

template <int R, bool DX>
AVX512 void bwd_rows512(const float* x, const float* dyt, int64_t B, float* w, int64_t I,
                        int64_t ld, float* dx, int64_t o, int64_t c0, int64_t c1, float lr) {
  const __m512 lrv = _mm512_set1_ps(lr);
  const float* d = dyt + o * B;
  float* wr = w + o * I;
  int64_t j = c0;
  for (; j + 16 <= c1; j += 16) {
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(wr + (R + r) * I + j), _MM_HINT_T0);
    bwd_chunk512<R, DX, false>(x, d, B, wr, I, ld, dx, j, 0xFFFF, lrv);
  }
  if (j < c1)
    bwd_chunk512<R, DX, true>(x, d, B, wr, I, ld, dx, j,
                              static_cast<__mmask16>((1u << (c1 - j)) - 1u), lrv);
}

// Columns [c0, c1) of W, all its rows: blocks of BR rows, then the rest; WIDE: the 16-lane code.
template <bool DX, bool WIDE>
void bwd_tile(const float* x, const float* dyt, int64_t B, float* w, int64_t O, int64_t I,
              int64_t ld, float* dx, int64_t c0, int64_t c1, float lr) {
  const auto rows = [&](auto r, int64_t o) {
    if constexpr (WIDE)
      bwd_rows512<decltype(r)::value, DX>(x, dyt, B, w, I, ld, dx, o, c0, c1, lr);
    else
      bwd_rows<decltype(r)::value, DX>(x, dyt, B, w, I, ld, dx, o, c0, c1, lr);
  };
  int64_t o = 0;
  for (; o + BR <= O; o += BR) rows(std::integral_constant<int, BR>{}, o);
  if (o < O) with_size<BR - 1>(O - o, [&](auto r) { rows(r, o); });
}

bool use512 = false;  // set_avx512: the caller checked the CPU (torch's capability)

void check(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous() &&
                  t.dim() == dim,
              name, ": expected a contiguous CPU float32 tensor of dimension ", dim);
}

}  // namespace


// ---- the gray CNNs' first block: Conv2d(1 -> O, k x k) -> 2x2 max pool -> ReLU ---------------
// Vectorized over output channels (O % 8 == 0, groups of up to 32); the AVX-512 versions (16
// lanes) do the AVX2 code's arithmetic lane by lane (each output sums its terms in the same
// order), so every machine computes the same bits. Max pool as torch's CPU kernel: window scanned row by row, the first
// maximum kept, NaN wins; ReLU after it. The backward needs no input gradient (a first layer).

// One pooled position, channels [c0, c0 + 8 * NC): out = relu(max_q conv_q), arg = argmax q.
template <int NC>
void cpr_fwd_pos(const float* xb, int64_t W, const float* wt, int64_t O, int64_t c0,
                 const float* bias, int64_t k, int64_t cy, int64_t cx, float* out, uint8_t* arg) {
  __m256 v[4][NC];
  for (int pair = 0; pair < 2; ++pair) {  // window rows: positions (cy+pair, cx), (cy+pair, cx+1)
    __m256 a0[NC], a1[NC];
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      a0[c] = bias ? _mm256_loadu_ps(bias + c0 + 8 * c) : _mm256_setzero_ps();
      a1[c] = a0[c];
    }
    const float* row = xb + (cy + pair) * W + cx;
    for (int64_t ky = 0; ky < k; ++ky, row += W) {
      for (int64_t kx = 0; kx < k; ++kx) {
        const float* wr = wt + (ky * k + kx) * O + c0;
        const __m256 x0 = _mm256_broadcast_ss(row + kx), x1 = _mm256_broadcast_ss(row + kx + 1);
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
          const __m256 wv = _mm256_loadu_ps(wr + 8 * c);
          a0[c] = _mm256_fmadd_ps(wv, x0, a0[c]);
          a1[c] = _mm256_fmadd_ps(wv, x1, a1[c]);
        }
      }
    }
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      v[2 * pair][c] = a0[c];
      v[2 * pair + 1][c] = a1[c];
    }
  }
  const __m256 zero = _mm256_setzero_ps();
#pragma GCC unroll 8
  for (int c = 0; c < NC; ++c) {
    __m256 best = v[0][c], q = zero;
#pragma GCC unroll 4
    for (int j = 1; j < 4; ++j) {
      const __m256 take = _mm256_or_ps(_mm256_cmp_ps(v[j][c], best, _CMP_GT_OQ),
                                       _mm256_cmp_ps(v[j][c], v[j][c], _CMP_UNORD_Q));
      best = _mm256_blendv_ps(best, v[j][c], take);
      q = _mm256_blendv_ps(q, _mm256_set1_ps(static_cast<float>(j)), take);
    }
    _mm256_storeu_ps(out + c0 + 8 * c, _mm256_max_ps(zero, best));  // relu; NaN stays NaN
    const __m256i qi = _mm256_cvtps_epi32(q);
    alignas(32) int32_t qs[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(qs), qi);
    for (int l = 0; l < 8; ++l) arg[c0 + 8 * c + l] = static_cast<uint8_t>(qs[l]);
  }
}

// cpr_fwd_pos for 32 channels in two 16-lane registers, the four window positions at once.
AVX512 void cpr_fwd_pos512(const float* xb, int64_t W, const float* wt, int64_t O, int64_t c0,
                           const float* bias, int64_t k, int64_t cy, int64_t cx, float* out,
                           uint8_t* arg) {
  __m512 a[4][2];
  for (int c = 0; c < 2; ++c) {
    const __m512 b0 = bias ? _mm512_loadu_ps(bias + c0 + 16 * c) : _mm512_setzero_ps();
    for (int j = 0; j < 4; ++j) a[j][c] = b0;
  }
  const float* row = xb + cy * W + cx;
  for (int64_t ky = 0; ky < k; ++ky, row += W) {
    for (int64_t kx = 0; kx < k; ++kx) {
      const float* wr = wt + (ky * k + kx) * O + c0;
      const __m512 w0 = _mm512_loadu_ps(wr), w1 = _mm512_loadu_ps(wr + 16);
      const float* p = row + kx;
      const __m512 x0 = _mm512_set1_ps(p[0]), x1 = _mm512_set1_ps(p[1]);
      const __m512 x2 = _mm512_set1_ps(p[W]), x3 = _mm512_set1_ps(p[W + 1]);
      a[0][0] = _mm512_fmadd_ps(w0, x0, a[0][0]);
      a[0][1] = _mm512_fmadd_ps(w1, x0, a[0][1]);
      a[1][0] = _mm512_fmadd_ps(w0, x1, a[1][0]);
      a[1][1] = _mm512_fmadd_ps(w1, x1, a[1][1]);
      a[2][0] = _mm512_fmadd_ps(w0, x2, a[2][0]);
      a[2][1] = _mm512_fmadd_ps(w1, x2, a[2][1]);
      a[3][0] = _mm512_fmadd_ps(w0, x3, a[3][0]);
      a[3][1] = _mm512_fmadd_ps(w1, x3, a[3][1]);
    }
  }
  const __m512 zero = _mm512_setzero_ps();
  for (int c = 0; c < 2; ++c) {
    __m512 best = a[0][c];
    __m512i q = _mm512_setzero_si512();
    for (int j = 1; j < 4; ++j) {
      const __mmask16 take = _mm512_cmp_ps_mask(a[j][c], best, _CMP_GT_OQ) |
                             _mm512_cmp_ps_mask(a[j][c], a[j][c], _CMP_UNORD_Q);
      best = _mm512_mask_blend_ps(take, best, a[j][c]);
      q = _mm512_mask_blend_epi32(take, q, _mm512_set1_epi32(j));
    }
    _mm512_storeu_ps(out + c0 + 16 * c, _mm512_max_ps(zero, best));  // relu; NaN stays NaN
    _mm_storeu_si128(reinterpret_cast<__m128i*>(arg + c0 + 16 * c), _mm512_cvtepi32_epi8(q));
  }
}

template <int NC>
void cpr_fwd_group(const float* xb, int64_t W, const float* wt, int64_t O, int64_t c0,
                   const float* bias, int64_t k, int64_t py, int64_t Wo, float* out,
                   uint8_t* arg) {
  for (int64_t px = 0; px < Wo; ++px)
    cpr_fwd_pos<NC>(xb, W, wt, O, c0, bias, k, 2 * py, 2 * px, out + px * O, arg + px * O);
}

AVX512 void cpr_fwd_group512(const float* xb, int64_t W, const float* wt, int64_t O, int64_t c0,
                             const float* bias, int64_t k, int64_t py, int64_t Wo, float* out,
                             uint8_t* arg) {
  for (int64_t px = 0; px < Wo; ++px)
    cpr_fwd_pos512(xb, W, wt, O, c0, bias, k, 2 * py, 2 * px, out + px * O, arg + px * O);
}

// x [B, H, W] (padded), w [O, k*k], bias [O] or None -> (out [B, Ho, Wo, O], arg uint8 same)
std::vector<at::Tensor> conv_pool_relu_forward(const at::Tensor& x, const at::Tensor& w,
                                               const c10::optional<at::Tensor>& bias, int64_t k) {
  check(x, "x", 3);
  check(w, "weight", 2);
  const int64_t B = x.size(0), H = x.size(1), W = x.size(2), O = w.size(0);
  TORCH_CHECK(w.size(1) == k * k && O % 8 == 0 && k >= 1 && H >= k + 1 && W >= k + 1,
              "conv_pool_relu: weight [O % 8 == 0, k*k] and an input of at least k + 1");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check(*bias, "bias", 1);
    bp = bias->data_ptr<float>();
  }
  const int64_t Ho = (H - k + 1) / 2, Wo = (W - k + 1) / 2;
  const auto wt = w.t().contiguous();  // [k*k, O]: one row of O weights per tap
  auto out = at::empty({B, Ho, Wo, O}, x.options());
  auto arg = at::empty({B, Ho, Wo, O}, x.options().dtype(at::kByte));
  const float* xp = x.data_ptr<float>();
  const float* wp = wt.data_ptr<float>();
  float* op = out.data_ptr<float>();
  uint8_t* ap = arg.data_ptr<uint8_t>();
  at::parallel_for(0, B * Ho, 1, [&](int64_t s, int64_t e) {
    for (int64_t r = s; r < e; ++r) {
      const int64_t b = r / Ho, py = r % Ho;
      const float* xb = xp + b * H * W;
      float* orow = op + r * Wo * O;
      uint8_t* arow = ap + r * Wo * O;
      for (int64_t c0 = 0; c0 < O; c0 += 32) {
        if (use512 && O - c0 >= 32) {
          cpr_fwd_group512(xb, W, wp, O, c0, bp, k, py, Wo, orow, arow);
          continue;
        }
        with_size<4>((O - c0) / 8, [&](auto nc) {
          cpr_fwd_group<decltype(nc)::value>(xb, W, wp, O, c0, bp, k, py, Wo, orow, arow);
        });
      }
    }
  });
  return {out, arg};
}

struct CprTaps {
  const float* x;   // [B, H, W]
  const float* gq;  // [P, 4, O]
  float* dwt;       // [k*k, O]
  int64_t H, W, Ho, Wo, O, P, k, kk0, c0;
};

// dW^T rows [kk0, kk0 + NK), channels [c0, c0 + 8 * NC): NK x NC accumulators in registers over
// every (pooled position, window position) in order.
template <int NK, int NC>
void cpr_taps(const CprTaps& t) {
  __m256 acc[NK][NC];
#pragma GCC unroll 4
  for (int a = 0; a < NK; ++a)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c) acc[a][c] = _mm256_setzero_ps();
  int64_t off[NK];  // tap offsets in the image
  for (int a = 0; a < NK; ++a) off[a] = ((t.kk0 + a) / t.k) * t.W + (t.kk0 + a) % t.k;
  for (int64_t p = 0; p < t.P; ++p) {
    const int64_t b = p / (t.Ho * t.Wo), py = (p / t.Wo) % t.Ho, px = p % t.Wo;
    const float* xb = t.x + b * t.H * t.W + 2 * py * t.W + 2 * px;
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const float* xq = xb + (q / 2) * t.W + (q % 2);
      const float* g = t.gq + (p * 4 + q) * t.O + t.c0;
      __m256 gv[NC];
#pragma GCC unroll 4
      for (int c = 0; c < NC; ++c) gv[c] = _mm256_loadu_ps(g + 8 * c);
#pragma GCC unroll 4
      for (int a = 0; a < NK; ++a) {
        const __m256 xv = _mm256_broadcast_ss(xq + off[a]);
#pragma GCC unroll 4
        for (int c = 0; c < NC; ++c) acc[a][c] = _mm256_fmadd_ps(gv[c], xv, acc[a][c]);
      }
    }
  }
#pragma GCC unroll 4
  for (int a = 0; a < NK; ++a)
#pragma GCC unroll 4
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_ps(t.dwt + (t.kk0 + a) * t.O + t.c0 + 8 * c, acc[a][c]);
}

// cpr_taps for 32 channels in two 16-lane registers, NK taps (up to 6: 12 accumulators).
template <int NK>
AVX512 void cpr_taps512(const CprTaps& t) {
  __m512 acc[NK][2];
#pragma GCC unroll 8
  for (int a = 0; a < NK; ++a) acc[a][0] = acc[a][1] = _mm512_setzero_ps();
  int64_t off[NK];
  for (int a = 0; a < NK; ++a) off[a] = ((t.kk0 + a) / t.k) * t.W + (t.kk0 + a) % t.k;
  for (int64_t p = 0; p < t.P; ++p) {
    const int64_t b = p / (t.Ho * t.Wo), py = (p / t.Wo) % t.Ho, px = p % t.Wo;
    const float* xb = t.x + b * t.H * t.W + 2 * py * t.W + 2 * px;
#pragma GCC unroll 4
    for (int q = 0; q < 4; ++q) {
      const float* xq = xb + (q / 2) * t.W + (q % 2);
      const float* g = t.gq + (p * 4 + q) * t.O + t.c0;
      const __m512 g0 = _mm512_loadu_ps(g), g1 = _mm512_loadu_ps(g + 16);
#pragma GCC unroll 8
      for (int a = 0; a < NK; ++a) {
        const __m512 xv = _mm512_set1_ps(xq[off[a]]);
        acc[a][0] = _mm512_fmadd_ps(g0, xv, acc[a][0]);
        acc[a][1] = _mm512_fmadd_ps(g1, xv, acc[a][1]);
      }
    }
  }
#pragma GCC unroll 8
  for (int a = 0; a < NK; ++a) {
    _mm512_storeu_ps(t.dwt + (t.kk0 + a) * t.O + t.c0, acc[a][0]);
    _mm512_storeu_ps(t.dwt + (t.kk0 + a) * t.O + t.c0 + 16, acc[a][1]);
  }
}

void cpr_taps_dispatch(const CprTaps& taps, int64_t nk, int64_t nc) {  // nk <= 3, nc <= 4
  with_size<3>(nk, [&](auto k) {
    with_size<4>(nc, [&](auto c) { cpr_taps<decltype(k)::value, decltype(c)::value>(taps); });
  });
}

// grad [B, Ho, Wo, O] of the block's output; out, arg from the forward; x [B, H, W] (padded);
// w [O, k*k] and bias [O] updated in place: W -= lr dW, b -= lr db (no input gradient).
// g_q[b, p, o] = grad * (out > 0) where arg == q: the gradient of conv position q of window p;
// dW[o, (ky, kx)] = sum_{b, p, q} g_q[b, p, o] x[b, 2 py + q / 2 + ky, 2 px + q % 2 + kx],
// summed in that order per element (each element by one thread: any thread count, same bits).
void conv_pool_relu_backward_sgd(const at::Tensor& grad, const at::Tensor& out,
                                 const at::Tensor& arg, const at::Tensor& x,
                                 at::Tensor w, c10::optional<at::Tensor> bias, int64_t k,
                                 double lr) {
  check(grad, "grad", 4);
  check(out, "out", 4);
  check(x, "x", 3);
  check(w, "weight", 2);
  TORCH_CHECK(arg.is_contiguous() && arg.scalar_type() == at::kByte &&
                  arg.sizes() == out.sizes() && grad.sizes() == out.sizes(),
              "conv_pool_relu: grad, out and arg must match");
  const int64_t B = grad.size(0), Ho = grad.size(1), Wo = grad.size(2), O = grad.size(3);
  const int64_t H = x.size(1), W = x.size(2), KK = k * k;
  TORCH_CHECK(w.size(0) == O && w.size(1) == KK && O % 8 == 0, "conv_pool_relu: weight shape");
  const int64_t P = B * Ho * Wo;
  // gq [P, 4, O]: each pooled gradient (where the ReLU passed it) routed to its window position;
  // db summed over p in order, lane by lane
  auto gq = at::empty({P, 4, O}, grad.options());
  auto db = at::empty({O}, grad.options());  // every 8-channel group writes its sums
  const float* gp = grad.data_ptr<float>();
  const float* outp = out.data_ptr<float>();
  const uint8_t* ap = arg.data_ptr<uint8_t>();
  float* qp = gq.data_ptr<float>();
  float* dbp = db.data_ptr<float>();
  const __m256 zero = _mm256_setzero_ps();
  for (int64_t c = 0; c < O; c += 8) {
    __m256 bsum = zero;
    for (int64_t p = 0; p < P; ++p) {
      const int64_t i = p * O + c;
      const __m256 g = _mm256_and_ps(_mm256_loadu_ps(gp + i),
                                     _mm256_cmp_ps(_mm256_loadu_ps(outp + i), zero, _CMP_GT_OQ));
      bsum = _mm256_add_ps(bsum, g);
      const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ap + i)));
      for (int q = 0; q < 4; ++q) {
        const __m256 m = _mm256_castsi256_ps(_mm256_cmpeq_epi32(a, _mm256_set1_epi32(q)));
        _mm256_storeu_ps(qp + (p * 4 + q) * O + c, _mm256_and_ps(g, m));
      }
    }
    _mm256_storeu_ps(dbp + c, bsum);
  }
  auto dwt = at::empty({KK, O}, grad.options());  // dW transposed
  float* dp = dwt.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  // taps per register block: 3 x 4 accumulators for 32 channels (AVX2), 6 x 2 (AVX-512)
  const int64_t TK = use512 ? 6 : 3;
  const int64_t blocks = (KK + TK - 1) / TK, groups = (O + 31) / 32;
  at::parallel_for(0, blocks * groups, 1, [&](int64_t s, int64_t e) {
    for (int64_t t = s; t < e; ++t) {
      const int64_t kk0 = (t / groups) * TK, nk = std::min<int64_t>(TK, KK - kk0);
      const int64_t c0 = (t % groups) * 32, nc = std::min<int64_t>(4, (O - c0) / 8);
      const CprTaps taps{xp, qp, dp, H, W, Ho, Wo, O, P, k, kk0, c0};
      if (use512 && nc == 4) {
        with_size<6>(nk, [&](auto n) { cpr_taps512<decltype(n)::value>(taps); });
        continue;
      }
      if (nk > 3) {  // a block of 6 taps where the last channel group is narrow: 3 + rest
        const CprTaps rest{xp, qp, dp, H, W, Ho, Wo, O, P, k, kk0 + 3, c0};
        cpr_taps_dispatch(taps, 3, nc);
        cpr_taps_dispatch(rest, nk - 3, nc);
        continue;
      }
      cpr_taps_dispatch(taps, nk, nc);
    }
  });
  float* wp = w.data_ptr<float>();
  const float flr = static_cast<float>(lr);
  for (int64_t o = 0; o < O; ++o)
    for (int64_t kk = 0; kk < KK; ++kk) wp[o * KK + kk] -= flr * dp[kk * O + o];
  if (bias.has_value() && bias->defined()) {
    check(*bias, "bias", 1);
    float* bp = bias->data_ptr<float>();
    for (int64_t o = 0; o < O; ++o) bp[o] -= flr * dbp[o];
  }
}

// x [B, I], w [O, I], bias [O] or None -> y [B, O]
at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& w,
                          const c10::optional<at::Tensor>& bias) {
  check(x, "x", 2);
  check(w, "weight", 2);
  const int64_t B = x.size(0), I = x.size(1), O = w.size(0);
  TORCH_CHECK(w.size(1) == I, "weight: ", w.size(1), " columns, x has ", I);
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    check(*bias, "bias", 1);
    TORCH_CHECK(bias->size(0) == O, "bias: size ", bias->size(0), ", weight has ", O, " rows");
    bp = bias->data_ptr<float>();
  }
  auto y = at::empty({B, O}, x.options());
  // Rows of x a multiple of 1 KB apart fall in the same L1 sets (with the rows of W): give them
  // a padded row stride, as the backward does.
  const int64_t lx = (I % 256 == 0 && B > 1) ? I + 16 : I;
  at::Tensor xs = x;
  if (lx != I) {
    xs = at::empty({B, lx}, x.options());
    xs.narrow(1, 0, I).copy_(x);
  }
  const float* xp = xs.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (use512) {  // tiles of 4 rows; the last O % 4 rows through the AVX2 code (same sums)
    const int64_t R4 = 2 * FP512, tiles = O / R4;
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, R4 * I));
    const int64_t cols = fwd_columns(B, I);
    at::parallel_for(0, tiles, grain, [&](int64_t s, int64_t e) {
      const auto part = partial_sums(cols < I, (e - s) * R4 * B * 8);
      for (int64_t i0 = 0; i0 < I; i0 += cols) {
        const int64_t i1 = std::min(I, i0 + cols);
        for (int64_t t = s; t < e; ++t)
          fwd_rows512(xp, B, wp + t * R4 * I, I, lx, i0, i1,
                      part ? part.get() + (t - s) * R4 * B * 8 : nullptr, yp + t * R4, O,
                      bp ? bp + t * R4 : nullptr);
      }
    });
    for (int64_t o = tiles * R4; o < O; ++o)  // one pass over all columns: no partial sums
      fwd_rows<1>(xp, B, wp + o * I, I, lx, 0, I, nullptr, yp + o, O, bp ? bp + o : nullptr);
    return y;
  }
  const int64_t pairs = (O + FR - 1) / FR;
  // grain: ~256 KB of W per task
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, FR * I));
  const int64_t cols = fwd_columns(B, I);
  at::parallel_for(0, pairs, grain, [&](int64_t s, int64_t e) {
    // every row pair of the task over one block of columns, then the next block
    const auto part = partial_sums(cols < I, (e - s) * FR * B * 8);
    for (int64_t i0 = 0; i0 < I; i0 += cols) {
      const int64_t i1 = std::min(I, i0 + cols);
      for (int64_t p = s; p < e; ++p) {
        const int64_t o = p * FR;
        const float* b = bp ? bp + o : nullptr;
        float* pp = part ? part.get() + (p - s) * FR * B * 8 : nullptr;
        if (o + FR <= O)
          fwd_rows<FR>(xp, B, wp + o * I, I, lx, i0, i1, pp, yp + o, O, b);
        else
          fwd_rows<1>(xp, B, wp + o * I, I, lx, i0, i1, pp, yp + o, O, b);
      }
    }
  });
  return y;
}

// dy [B, O], x [B, I]; updates w [O, I] and bias [O] in place; returns dx [B, I] (old weights)
// or an undefined tensor when need_dx is false.
at::Tensor linear_backward_sgd(const at::Tensor& dy, const at::Tensor& x, at::Tensor w,
                               c10::optional<at::Tensor> bias, double lr, bool need_dx) {
  check(dy, "dy", 2);
  check(x, "x", 2);
  check(w, "weight", 2);
  const int64_t B = x.size(0), I = x.size(1), O = w.size(0);
  TORCH_CHECK(w.size(1) == I && dy.size(0) == B && dy.size(1) == O, "shapes do not match");
  const auto dyt = dy.t().contiguous();  // [O, B]: the scalars broadcast per row of W
  // Rows of x and dx 1 KB-multiples apart fall in the same L1 sets (and alias 4 KB apart with
  // each other): give both a padded row stride then (not worth a copy for a few rows of W).
  const int64_t ld = (I % 256 == 0 && O > 32) ? I + 16 : I;
  at::Tensor xs = x, dxs;
  if (ld != I) {
    xs = at::empty({B, ld}, x.options());
    xs.narrow(1, 0, I).copy_(x);
  }
  if (need_dx) dxs = at::zeros({B, ld}, x.options());
  const float* xp = xs.data_ptr<float>();
  const float* dp = dyt.data_ptr<float>();
  float* wp = w.data_ptr<float>();
  float* dxp = need_dx ? dxs.data_ptr<float>() : nullptr;
  const float flr = static_cast<float>(lr);
  // Column tiles: the tile's x and dx columns (2 * B * T floats) stay in L1 while all rows of W
  // pass over them; each tile is independent (its own columns of W and dx).
  const int64_t T = std::max<int64_t>(16, std::min<int64_t>(I, (3072 / std::max<int64_t>(B, 1)) / 16 * 16));
  const int64_t tiles = (I + T - 1) / T;
  at::parallel_for(0, tiles, 1, [&](int64_t s, int64_t e) {
    for (int64_t t = s; t < e; ++t) {
      const int64_t c0 = t * T, c1 = std::min(I, c0 + T);
      if (use512 && need_dx)
        bwd_tile<true, true>(xp, dp, B, wp, O, I, ld, dxp, c0, c1, flr);
      else if (use512)
        bwd_tile<false, true>(xp, dp, B, wp, O, I, ld, nullptr, c0, c1, flr);
      else if (need_dx)
        bwd_tile<true, false>(xp, dp, B, wp, O, I, ld, dxp, c0, c1, flr);
      else
        bwd_tile<false, false>(xp, dp, B, wp, O, I, ld, nullptr, c0, c1, flr);
    }
  });
  at::Tensor dx;
  if (need_dx) dx = ld == I ? dxs : dxs.narrow(1, 0, I).contiguous();
  if (bias.has_value() && bias->defined()) {
    check(*bias, "bias", 1);
    float* bp = bias->data_ptr<float>();
    for (int64_t o = 0; o < O; ++o) {
      float s = 0.0f;
      for (int64_t b = 0; b < B; ++b) s += dp[o * B + b];
      bp[o] -= flr * s;
    }
  }
  return dx;
}

// Whether the CPU has the AVX-512 subsets the 16-lane code uses.
bool avx512_supported() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw");
}

// Turn the 16-lane code on (when supported) or off; returns whether it is on.
bool set_avx512(bool on) {
  use512 = on && avx512_supported();
  return use512;
}

// Whether the 16-lane code is in use.
bool avx512_enabled() { return use512; }
