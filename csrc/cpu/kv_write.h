// The step's K/V rows written into one layer of the pool (the CPU side of the K/V write): row b's
// k, v [kv_heads, head_dim] go to (slot[b], off[b]); K is stored transposed ([head_dim, chunk]: a
// column per token), V as [chunk, head_dim] (a row per token). Rows are cast to the pool's dtype.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace chunkgen {

template <typename Dst, typename Src>
void write_rows(Dst* kc, Dst* vc, const Src* k, const Src* v, const int64_t* ks, const int64_t* vs, const int32_t* slot,
                const int32_t* off, int64_t rows, int64_t Hk, int64_t d, int64_t C) {
  const int64_t head = d * C, per_slot = Hk * head;
  for (int64_t b = 0; b < rows; ++b) {
    Dst* kb = kc + slot[b] * per_slot + off[b];      // K is [head_dim, chunk]: a column
    Dst* vb = vc + slot[b] * per_slot + off[b] * d;  // V is [chunk, head_dim]: a row
    for (int64_t h = 0; h < Hk; ++h) {
      const Src* kr = k + b * ks[0] + h * ks[1];
      const Src* vr = v + b * vs[0] + h * vs[1];
      if constexpr (std::is_same_v<Dst, Src>) {  // the model's dtype is the pool's: plain copies
        for (int64_t i = 0; i < d; ++i) kb[h * head + i * C] = kr[i * ks[2]];
        if (vs[2] == 1)
          std::memcpy(vb + h * head, vr, sizeof(Dst) * d);
        else
          for (int64_t i = 0; i < d; ++i) vb[h * head + i] = vr[i * vs[2]];
      } else {
        for (int64_t i = 0; i < d; ++i) {
          kb[h * head + i * C] = static_cast<Dst>(static_cast<float>(kr[i * ks[2]]));
          vb[h * head + i] = static_cast<Dst>(static_cast<float>(vr[i * vs[2]]));
        }
      }
    }
  }
}

}  // namespace chunkgen
