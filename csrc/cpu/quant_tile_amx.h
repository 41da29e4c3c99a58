// The quantized linear layers' tile on AMX int8 (included by quant_linear.cpp, whose top comment
// gives the packed layout): one tile instruction multiplies 16 rows of x by 16 output channels over
// a block of 32 values (16 for Q6_K's halves), 8,192 multiply-adds that AVX512_VNNI spends 128
// vpdpbusd on. The block's int32 sums go through memory to the vector units, which apply the
// block's scales exactly as the VNNI tile does (quant_tile_vnni.h): the same integer sums, then the
// same fp32 operations in the same order, so a row has the same bits on either tile and a batch may
// put a row in either (batch-invariant numerics).
//
// The operands come from the layout as it is: x's int8 rows are the A tile (16 rows x 32 bytes,
// `k` apart); a unit of a signed kind's pair of groups (8 + 8 channels x 4 values, 64 bytes) is
// one row of the B tile, so a block's 8 units are B as packed. The unsigned kinds' nibbles (and
// U5's fifth bits) are spread to bytes first, a block at a time. Unsigned weights meet signed x
// (tdpbsud); signed weights meet x + 128 (tdpbusd), corrected by 128 sum(w) as on VNNI.
//
// Tiles is the instructions: AmxTiles (the CPU's, where the build targets AMX) or EmulatedTiles (the
// same operations in C++, so any AVX512_VNNI machine runs this tile's logic: the tests, and a check
// of a build for AMX on a CPU without it).
#pragma once

#include "aligned.h"
#include "quant_tile_vnni.h"

#if defined(CHUNKGEN_HAVE_AVX512_VNNI)
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define CHUNKGEN_HAVE_AMX_INT8 1
#endif

namespace chunkgen {
namespace amx {

// The tile registers' shapes (ldtilecfg's 64 bytes), two slots of (C, A, B) so that one block's
// product runs while the vector units scale the one before it: a tile register is not renamed, so
// with one C the next block's product waited for the last one's sums to be stored. C: 16 x 16
// int32; A: 16 rows x 32 bytes of x (a block), B: 8 rows x 64 bytes (a block's units); for Q6_K
// (halves) A is 16 x 16 bytes and B 4 x 64.
enum Tile : int { kC0 = 0, kC1 = 1, kA0 = 2, kA1 = 3, kB0 = 4, kB1 = 5 };
struct alignas(64) TileConfig {
  uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  explicit TileConfig(int nh = 1) {
    const auto set = [&](int t, int r, int c) {
      rows[t] = static_cast<uint8_t>(r), colsb[t] = static_cast<uint16_t>(c);
    };
    for (int slot = 0; slot < 2; ++slot) {
      set(kC0 + slot, 16, 64);
      set(kA0 + slot, 16, 32 / nh);
      set(kB0 + slot, 8 / nh, 64);
    }
  }
};

#if defined(CHUNKGEN_HAVE_AMX_INT8)
// GCC's tile intrinsics paste their tile numbers into the instruction's text: each must be a
// literal, hence the cases.
#define CHUNKGEN_AMX_CASES(op, t, ...) \
  if constexpr (t == 0)                \
    op(0, ##__VA_ARGS__);              \
  else if constexpr (t == 1)           \
    op(1, ##__VA_ARGS__);              \
  else if constexpr (t == 2)           \
    op(2, ##__VA_ARGS__);              \
  else if constexpr (t == 3)           \
    op(3, ##__VA_ARGS__);              \
  else if constexpr (t == 4)           \
    op(4, ##__VA_ARGS__);              \
  else                                 \
    op(5, ##__VA_ARGS__)

struct AmxTiles {
  static void configure(const TileConfig& c) { _tile_loadconfig(&c); }
  static void release() { _tile_release(); }
  template <int t>
  static void zero() {
    CHUNKGEN_AMX_CASES(_tile_zero, t);
  }
  template <int t>
  static void load(const void* p, int64_t stride) {
    CHUNKGEN_AMX_CASES(_tile_loadd, t, p, stride);
  }
  template <int t>
  static void store(void* p, int64_t stride) {
    CHUNKGEN_AMX_CASES(_tile_stored, t, p, stride);
  }
  // Slot's C += A . B over 4-byte groups, A's bytes signed or not, B's signed or not.
#define CHUNKGEN_AMX_DOT(c, a, b)     \
  if constexpr (a_signed && b_signed) \
    _tile_dpbssd(c, a, b);            \
  else if constexpr (a_signed)        \
    _tile_dpbsud(c, a, b);            \
  else if constexpr (b_signed)        \
    _tile_dpbusd(c, a, b);            \
  else                                \
    _tile_dpbuud(c, a, b)
  template <int slot, bool a_signed, bool b_signed>
  static void dot() {
    static_assert(slot == 0 || slot == 1, "two slots");
    if constexpr (slot == 0) {
      CHUNKGEN_AMX_DOT(0, 2, 4);
    } else {
      CHUNKGEN_AMX_DOT(1, 3, 5);
    }
  }
#undef CHUNKGEN_AMX_DOT
};
#undef CHUNKGEN_AMX_CASES
#endif

// The same operations on a per-thread copy of the tile registers.
struct EmulatedTiles {
  struct Registers {
    TileConfig config;
    alignas(64) uint8_t t[8][16][64];
  };
  static Registers& regs() {
    thread_local Registers r;
    return r;
  }
  static void configure(const TileConfig& c) { regs().config = c; }
  static void release() {}
  template <int t>
  static void zero() {
    std::memset(regs().t[t], 0, sizeof regs().t[t]);
  }
  template <int t>
  static void load(const void* p, int64_t stride) {
    Registers& r = regs();
    for (int i = 0; i < r.config.rows[t]; ++i)
      std::memcpy(r.t[t][i], static_cast<const uint8_t*>(p) + i * stride, r.config.colsb[t]);
  }
  template <int t>
  static void store(void* p, int64_t stride) {
    Registers& r = regs();
    for (int i = 0; i < r.config.rows[t]; ++i)
      std::memcpy(static_cast<uint8_t*>(p) + i * stride, r.t[t][i], r.config.colsb[t]);
  }
  template <int slot, bool a_signed, bool b_signed>
  static void dot() {
    constexpr int c = kC0 + slot, a = kA0 + slot, b = kB0 + slot;
    Registers& r = regs();
    const int m_rows = r.config.rows[a], quads = r.config.colsb[a] / 4, n_cols = r.config.colsb[b] / 4;
    const auto byte = [](uint8_t v, bool is_signed) { return is_signed ? int32_t(int8_t(v)) : int32_t(v); };
    for (int m = 0; m < m_rows; ++m)
      for (int n = 0; n < n_cols; ++n) {
        int32_t sum;
        std::memcpy(&sum, &r.t[c][m][4 * n], 4);
        for (int q = 0; q < quads; ++q)
          for (int i = 0; i < 4; ++i)
            sum += byte(r.t[a][m][4 * q + i], a_signed) * byte(r.t[b][q][4 * n + i], b_signed);
        std::memcpy(&r.t[c][m][4 * n], &sum, 4);
      }
  }
};

constexpr int kRows = 16;  // rows of x a tile takes

// A block's units of the pair, bytes spread for the B tile: unsigned kinds from their nibbles (B
// row q: values 4q..4q+3 of the 16 channels; U5 with its fifth bits), into `dst`.
template <int kind>
inline void spread_unsigned(const uint8_t* a, const uint8_t* b, uint8_t* dst) {
  const __m512i mask = _mm512_set1_epi8(0x0f);
  const __m512i plane = kind == quant::kU5 ? vnni::load_pair<kind>(a, b, 4) : mask;
  for (int c = 0; c < 4; ++c) {
    const __m512i raw = vnni::load_pair<kind>(a, b, c);
    __m512i lo = _mm512_and_si512(raw, mask), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
    if constexpr (kind == quant::kU5) {
      lo = _mm512_or_si512(lo, vnni::fifth_bits(plane, 2 * c));
      hi = _mm512_or_si512(hi, vnni::fifth_bits(plane, 2 * c + 1));
    }
    _mm512_storeu_si512(dst + 64 * c, lo);
    _mm512_storeu_si512(dst + 64 * (4 + c), hi);
  }
}

// What every tile of rows reads of one pair, made once for all of them: the unsigned kinds' bytes
// spread (a block's B tile, 512 bytes), the signed kinds' correction 128 sum(w) of each block (or
// half), 16 int32. Spread per tile (and with one tile slot), the 4-bit kinds ran 0.55-0.77x the
// VNNI tile.
struct PreparedPair {
  AlignedVector<uint8_t> spread;
  AlignedVector<int32_t> corr;
};

template <int kind>
void prepare_pair(const vnni::GroupPair& pair, int64_t nb, PreparedPair& out) {
  constexpr int nh = quant::halves(kind);
  if constexpr (quant::is_unsigned(kind)) {
    static_assert(nh == 1, "the unsigned kinds take whole blocks");
    out.spread.resize(static_cast<size_t>(nb) * 8 * 64);
    for (int64_t b = 0; b < nb; ++b)
      spread_unsigned<kind>(pair.w0 + b * quant::block_stride(kind), pair.w1 + b * quant::block_stride(kind),
                            out.spread.data() + b * 8 * 64);
  } else {
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    out.corr.resize(static_cast<size_t>(nb) * nh * 16);
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* a0 = pair.w0 + b * quant::block_stride(kind);
      const uint8_t* a1 = pair.w1 + b * quant::block_stride(kind);
      for (int h = 0; h < nh; ++h) {
        __m512i corr = _mm512_setzero_si512();
        for (int s = 0; s < 8 / nh; ++s)
          corr = _mm512_dpbusd_epi32(corr, offset, vnni::load_pair<kind>(a0, a1, h * (8 / nh) + s));
        _mm512_storeu_si512(out.corr.data() + (b * nh + h) * 16, corr);
      }
    }
  }
}

// One tile: the 16 channels of `pair` (prepared by prepare_pair) x 16 rows of x over all nb
// blocks, into y's rows (ldy apart, the first `channels` lanes). xq, xs and xsum as for vnni::tile
// (x + 128 for the signed kinds). Step s (block s / nh, half s % nh) has its product in slot s % 2,
// issued before step s - 1's sums are scaled; the scales go on in step order, as on the VNNI tile.
// The caller has configured the tiles (TileConfig) on this thread.
template <typename Tiles, int kind, bool has_min, bool factored>
void tile(const vnni::GroupPair& pair, const PreparedPair& prep, int64_t nb, const uint8_t* xq, int64_t k,
          const float* xs, const float* xsum, const quant::Out& y, int64_t ldy, int channels) {
  constexpr int nh = quant::halves(kind);
  constexpr bool unsigned_w = quant::is_unsigned(kind);
  const int64_t steps = nb * nh;
  alignas(64) int32_t sums[2][kRows][16];
  __m512 acc[kRows];
  for (int r = 0; r < kRows; ++r) acc[r] = _mm512_setzero_ps();
  const auto issue = [&](int64_t s, auto slot_t) {
    constexpr int slot = decltype(slot_t)::value;
    const int64_t b = s / nh, h = s % nh;
    Tiles::template zero<kC0 + slot>();
    Tiles::template load<kA0 + slot>(xq + b * 32 + h * (32 / nh), k);
    if constexpr (unsigned_w) {
      Tiles::template load<kB0 + slot>(prep.spread.data() + b * 8 * 64, 64);
      Tiles::template dot<slot, true, false>();
    } else {
      // paired: a block's 8 units of the pair are B as packed (a half's 4 for Q6_K)
      const uint8_t* units = pair.w0 + b * quant::block_stride(kind) + h * (8 / nh) * quant::unit_stride(kind);
      Tiles::template load<kB0 + slot>(units, quant::unit_stride(kind));
      Tiles::template dot<slot, false, true>();
    }
  };
  const auto finish = [&](int64_t s, auto slot_t) {
    constexpr int slot = decltype(slot_t)::value;
    const int64_t b = s / nh;
    Tiles::template store<kC0 + slot>(sums[slot], 64);
    const __m512 sw = quant::scales16<factored>(pair.ws0, pair.ws1, s, b);
    __m512i corr = _mm512_setzero_si512();
    if constexpr (!unsigned_w) corr = _mm512_loadu_si512(prep.corr.data() + s * 16);
    for (int r = 0; r < kRows; ++r) {
      __m512i s32 = _mm512_load_si512(sums[slot][r]);
      if constexpr (!unsigned_w) s32 = _mm512_sub_epi32(s32, corr);
      acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(s32), _mm512_set1_ps(xs[r * nb + b])), sw, acc[r]);
    }
    if constexpr (has_min) {
      if (s % nh == nh - 1) {
        const __m512 mw = quant::scales16<factored>(pair.wm0, pair.wm1, b, b);
        for (int r = 0; r < kRows; ++r) acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xsum[r * nb + b]), acc[r]);
      }
    }
  };
  using Slot0 = std::integral_constant<int, 0>;
  using Slot1 = std::integral_constant<int, 1>;
  issue(0, Slot0{});
  for (int64_t s = 0; s < steps; s += 2) {
    if (s + 1 < steps) issue(s + 1, Slot1{});
    finish(s, Slot0{});
    if (s + 1 < steps) {
      if (s + 2 < steps) issue(s + 2, Slot0{});
      finish(s + 1, Slot1{});
    }
  }
  const __mmask16 keep = static_cast<__mmask16>((1u << channels) - 1);
  for (int r = 0; r < kRows; ++r) quant::store16(y.at(r * ldy), acc[r], keep);
}

}  // namespace amx
}  // namespace chunkgen
#endif
