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
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

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

// ---- forward ---------------------------------------------------------------------------------
// R rows of W (starting at w) against NB batch rows of x: R * NB accumulators in registers.
template <int R, int NB>
void fwd_tile(const float* x, const float* w, int64_t I, float* y, int64_t O, const float* bias) {
  __m256 acc[R][NB];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    if ((i & 15) == 0)  // the next tile's rows, one prefetch per cache line (W is streamed once)
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * I + i), _MM_HINT_T0);
    __m256 wv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + r * I + i);
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      const __m256 xv = _mm256_loadu_ps(x + b * I + i);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(wv[r], xv, acc[r][b]);
    }
  }
  if (i < I) {
    const __m256i m = tail_mask(I - i);
    __m256 wv[R];
#pragma GCC unroll 16
    for (int r = 0; r < R; ++r) wv[r] = _mm256_maskload_ps(w + r * I + i, m);
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      const __m256 xv = _mm256_maskload_ps(x + b * I + i, m);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r) acc[r][b] = _mm256_fmadd_ps(wv[r], xv, acc[r][b]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) y[b * O + r] = hsum(acc[r][b]) + (bias ? bias[r] : 0.0f);
}

constexpr int FR = 2;  // rows of W per forward tile
constexpr int FB = 6;  // batch rows per forward tile (FR * FB = 12 accumulators of 16 registers)

template <int R>
void fwd_rows(const float* x, int64_t B, const float* w, int64_t I, float* y, int64_t O,
              const float* bias) {
  // Blocks of near-equal size (10 rows: 5 + 5, not 6 + 4): the short block wastes less.
  const int64_t blocks = (B + FB - 1) / FB, nb = (B + blocks - 1) / blocks;
  for (int64_t b0 = 0; b0 < B; b0 += nb) {
    const float* xb = x + b0 * I;
    float* yb = y + b0 * O;
    switch (std::min<int64_t>(nb, B - b0)) {
      case 1: fwd_tile<R, 1>(xb, w, I, yb, O, bias); break;
      case 2: fwd_tile<R, 2>(xb, w, I, yb, O, bias); break;
      case 3: fwd_tile<R, 3>(xb, w, I, yb, O, bias); break;
      case 4: fwd_tile<R, 4>(xb, w, I, yb, O, bias); break;
      case 5: fwd_tile<R, 5>(xb, w, I, yb, O, bias); break;
      default: fwd_tile<R, 6>(xb, w, I, yb, O, bias); break;
    }
  }
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

template <bool DX>
void bwd_tile(const float* x, const float* dyt, int64_t B, float* w, int64_t O, int64_t I,
              int64_t ld, float* dx, int64_t c0, int64_t c1, float lr) {
  int64_t o = 0;
  for (; o + BR <= O; o += BR) bwd_rows<BR, DX>(x, dyt, B, w, I, ld, dx, o, c0, c1, lr);
  switch (O - o) {
    case 1: bwd_rows<1, DX>(x, dyt, B, w, I, ld, dx, o, c0, c1, lr); break;
    case 2: bwd_rows<2, DX>(x, dyt, B, w, I, ld, dx, o, c0, c1, lr); break;
    case 3: bwd_rows<3, DX>(x, dyt, B, w, I, ld, dx, o, c0, c1, lr); break;
    default: break;
  }
}


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
template <int RP, int NB>
AVX512 void fwd_tile512(const float* x, const float* w, int64_t I, float* y, int64_t O,
                        const float* bias) {
  __m512 acc[RP][NB];
#pragma GCC unroll 16
  for (int r = 0; r < RP; ++r)
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) acc[r][b] = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= I; i += 8) {
    if ((i & 15) == 0)
#pragma GCC unroll 16
      for (int r = 0; r < 2 * RP; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (2 * RP + r) * I + i), _MM_HINT_T0);
    __m512 wv[RP];
#pragma GCC unroll 16
    for (int r = 0; r < RP; ++r) wv[r] = load_pair(w + 2 * r * I + i, w + (2 * r + 1) * I + i);
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_loadu_ps(x + b * I + i));
#pragma GCC unroll 16
      for (int r = 0; r < RP; ++r) acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);
    }
  }
  if (i < I) {
    const __m256i m = tail_mask(I - i);
    __m512 wv[RP];
#pragma GCC unroll 16
    for (int r = 0; r < RP; ++r)
      wv[r] = load_pair_masked(w + 2 * r * I + i, w + (2 * r + 1) * I + i, m);
#pragma GCC unroll 16
    for (int b = 0; b < NB; ++b) {
      const __m512 xv = _mm512_broadcast_f32x8(_mm256_maskload_ps(x + b * I + i, m));
#pragma GCC unroll 16
      for (int r = 0; r < RP; ++r) acc[r][b] = _mm512_fmadd_ps(wv[r], xv, acc[r][b]);
    }
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

// Rows [o0, o0 + 2 * FP512 * n) of W in tiles of 2 * FP512 rows, all batch rows.
AVX512 void fwd_rows512(const float* x, int64_t B, const float* w, int64_t I, float* y, int64_t O,
                        const float* bias) {
  const int64_t blocks = (B + FB512 - 1) / FB512, nb = (B + blocks - 1) / blocks;
  for (int64_t b0 = 0; b0 < B; b0 += nb) {
    const float* xb = x + b0 * I;
    float* yb = y + b0 * O;
    switch (std::min<int64_t>(nb, B - b0)) {
      case 1: fwd_tile512<FP512, 1>(xb, w, I, yb, O, bias); break;
      case 2: fwd_tile512<FP512, 2>(xb, w, I, yb, O, bias); break;
      case 3: fwd_tile512<FP512, 3>(xb, w, I, yb, O, bias); break;
      case 4: fwd_tile512<FP512, 4>(xb, w, I, yb, O, bias); break;
      case 5: fwd_tile512<FP512, 5>(xb, w, I, yb, O, bias); break;
      case 6: fwd_tile512<FP512, 6>(xb, w, I, yb, O, bias); break;
      case 7: fwd_tile512<FP512, 7>(xb, w, I, yb, O, bias); break;
      case 8: fwd_tile512<FP512, 8>(xb, w, I, yb, O, bias); break;
      case 9: fwd_tile512<FP512, 9>(xb, w, I, yb, O, bias); break;
      default: fwd_tile512<FP512, 10>(xb, w, I, yb, O, bias); break;
    }
  }
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

template <bool DX>
AVX512 void bwd_tile512(const float* x, const float* dyt, int64_t B, float* w, int64_t O,
                        int64_t I, int64_t ld, float* dx, int64_t c0, int64_t c1, float lr) {
  int64_t o = 0;
  for (; o + BR <= O; o += BR) bwd_rows512<BR, DX>(x, dyt, B, w, I, ld, dx, o, c0, c1, lr);
  switch (O - o) {
    case 1: bwd_rows512<1, DX>(x, dyt, B, w, I, ld, dx, o, c0, c1, lr); break;
    case 2: bwd_rows512<2, DX>(x, dyt, B, w, I, ld, dx, o, c0, c1, lr); break;
    case 3: bwd_rows512<3, DX>(x, dyt, B, w, I, ld, dx, o, c0, c1, lr); break;
    default: break;
  }
}

bool use512 = false;  // set_avx512: the caller checked the CPU (torch's capability)

void check(const torch::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32 && t.is_contiguous() &&
                  t.dim() == dim,
              name, ": expected a contiguous CPU float32 tensor of dimension ", dim);
}

}  // namespace

// x [B, I], w [O, I], bias [O] or None -> y [B, O]
torch::Tensor linear_forward(const torch::Tensor& x, const torch::Tensor& w,
                             const c10::optional<torch::Tensor>& bias) {
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
  auto y = torch::empty({B, O}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (use512) {  // tiles of 4 rows; the last O % 4 rows through the AVX2 code (same sums)
    const int64_t R4 = 2 * FP512, tiles = O / R4;
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, R4 * I));
    at::parallel_for(0, tiles, grain, [&](int64_t s, int64_t e) {
      for (int64_t t = s; t < e; ++t)
        fwd_rows512(xp, B, wp + t * R4 * I, I, yp + t * R4, O, bp ? bp + t * R4 : nullptr);
    });
    for (int64_t o = tiles * R4; o < O; ++o)
      fwd_rows<1>(xp, B, wp + o * I, I, yp + o, O, bp ? bp + o : nullptr);
    return y;
  }
  const int64_t pairs = (O + FR - 1) / FR;
  // grain: ~256 KB of W per task
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, FR * I));
  at::parallel_for(0, pairs, grain, [&](int64_t s, int64_t e) {
    for (int64_t p = s; p < e; ++p) {
      const int64_t o = p * FR;
      const float* b = bp ? bp + o : nullptr;
      if (o + FR <= O)
        fwd_rows<FR>(xp, B, wp + o * I, I, yp + o, O, b);
      else
        fwd_rows<1>(xp, B, wp + o * I, I, yp + o, O, b);
    }
  });
  return y;
}

// dy [B, O], x [B, I]; updates w [O, I] and bias [O] in place; returns dx [B, I] (old weights)
// or an undefined tensor when need_dx is false.
torch::Tensor linear_backward_sgd(const torch::Tensor& dy, const torch::Tensor& x, torch::Tensor w,
                                  c10::optional<torch::Tensor> bias, double lr, bool need_dx) {
  check(dy, "dy", 2);
  check(x, "x", 2);
  check(w, "weight", 2);
  const int64_t B = x.size(0), I = x.size(1), O = w.size(0);
  TORCH_CHECK(w.size(1) == I && dy.size(0) == B && dy.size(1) == O, "shapes do not match");
  const auto dyt = dy.t().contiguous();  // [O, B]: the scalars broadcast per row of W
  // Rows of x and dx 1 KB-multiples apart fall in the same L1 sets (and alias 4 KB apart with
  // each other): give both a padded row stride then (not worth a copy for a few rows of W).
  const int64_t ld = (I % 256 == 0 && O > 32) ? I + 16 : I;
  torch::Tensor xs = x, dxs;
  if (ld != I) {
    xs = torch::empty({B, ld}, x.options());
    xs.narrow(1, 0, I).copy_(x);
  }
  if (need_dx) dxs = torch::zeros({B, ld}, x.options());
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
        bwd_tile512<true>(xp, dp, B, wp, O, I, ld, dxp, c0, c1, flr);
      else if (use512)
        bwd_tile512<false>(xp, dp, B, wp, O, I, ld, nullptr, c0, c1, flr);
      else if (need_dx)
        bwd_tile<true>(xp, dp, B, wp, O, I, ld, dxp, c0, c1, flr);
      else
        bwd_tile<false>(xp, dp, B, wp, O, I, ld, nullptr, c0, c1, flr);
    }
  });
  torch::Tensor dx;
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_avx512", &set_avx512, "use the AVX-512 code (same bits as AVX2) where supported");
  m.def("avx512_enabled", [] { return use512; }, "whether the AVX-512 code is in use");
  m.def("linear_forward", &linear_forward, "y = x W^T + b for a skinny batch");
  m.def("linear_backward_sgd", &linear_backward_sgd,
        "dx = dy W (old W); W -= lr dy^T x; b -= lr sum(dy) in one pass over W");
}
