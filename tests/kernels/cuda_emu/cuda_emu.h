// A thread-level CUDA emulator, just large enough to run the kernels of csrc/cuda/ on the CPU, so their
// indexing, masking, splitting and synchronisation are tested on machines without a GPU.
//
// Every CUDA thread is an OS thread (kept for later blocks); a block's threads run together and meet
// at real barriers (__syncthreads, __syncwarp, and the two halves of a shuffle), so a missing barrier
// shows up as a race, not as lockstep luck, and the sanitizer builds (make cuda-racecheck,
// cuda-memcheck) report it. Blocks run one after another (four at a time in the race check), in grid
// order and reversed in turn. WMMA fragments hold whole tiles: each lane loads and multiplies the
// full tile, lane 0 stores it. Loads check the alignment and leading dimension rules of the real
// API. Launches check dynamic shared memory against the 48 KiB default and the opt-in limit. A
// shuffle checks that the whole warp takes part. Errors are recorded and reported by the harness,
// not thrown across threads.
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <semaphore>
#include <source_location>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __align__(n) alignas(n)

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
};
struct uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned a, unsigned b, unsigned c, unsigned d) { return {a, b, c, d}; }

inline thread_local dim3 threadIdx, blockIdx, blockDim, gridDim;

// ---- 16-bit floats with the bit layouts torch uses -----------------------------------------
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
inline __half __float2half(float f) {
  const _Float16 h = static_cast<_Float16>(f);  // round to nearest even
  __half r;
  std::memcpy(&r.bits, &h, 2);
  return r;
}
inline float __half2float(__half h) {
  _Float16 x;
  std::memcpy(&x, &h.bits, 2);
  return static_cast<float>(x);
}
inline __nv_bfloat16 __float2bfloat16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  __nv_bfloat16 r;
  if (std::isnan(f)) {
    r.bits = 0x7fc0;
    return r;
  }
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  r.bits = static_cast<uint16_t>(u >> 16);
  return r;
}
inline float __bfloat162float(__nv_bfloat16 b) {
  const uint32_t u = static_cast<uint32_t>(b.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float __expf(float x) { return std::exp(x); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }

// ---- runtime ---------------------------------------------------------------------------------
enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
using cudaStream_t = void*;
enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount, cudaDevAttrMaxSharedMemoryPerBlockOptin };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };

namespace emu {

constexpr size_t kDefaultSmem = 48 * 1024;
// Blocks of a launch run this many at a time (the race check runs several, so that two blocks
// writing the same global memory meet under ThreadSanitizer), in grid order or reversed in turn:
// a block that depends on another block of its launch running first sees both orders.
#ifndef CHUNKGEN_EMU_BLOCKS_AT_ONCE
#define CHUNKGEN_EMU_BLOCKS_AT_ONCE 1
#endif
constexpr int kBlocksAtOnce = CHUNKGEN_EMU_BLOCKS_AT_ONCE;

struct Device {
  std::map<int, int> sms{{0, 132}};  // per device ordinal: the kernels cache limits per device
  int current = 0;
  int max_smem = 227 * 1024;  // H100
  std::map<const void*, size_t> smem_optin;
  cudaError_t last = cudaSuccess;
  std::mutex mu;
  std::string errors;  // misuse found while kernels ran
  void fail(const std::string& what) {
    std::lock_guard<std::mutex> g(mu);
    if (errors.size() < 4000) errors += what + "\n";
  }
};
inline Device& device() {
  static Device d;
  return d;
}

struct Warp {
  std::barrier<> sync{32};
  float slot[32];
  unsigned site[32];     // the source line of each lane's current shuffle
  bool exited[32] = {};  // lanes whose thread has returned
};

struct Block {
  explicit Block(int threads, size_t smem_bytes)
      : sync(threads),
        warps(static_cast<size_t>((threads + 31) / 32)),
        bytes(smem_bytes),
        storage(new (std::align_val_t{128}) unsigned char[smem_bytes]) {
    std::memset(storage.get(), 0xff, smem_bytes);  // unwritten shared memory reads as NaN, not zeros
  }
  struct AlignedDelete {
    void operator()(unsigned char* p) const { ::operator delete[](p, std::align_val_t{128}); }
  };
  std::barrier<> sync;
  std::vector<Warp> warps;
  size_t bytes;
  // aligned like a GPU's shared memory window, and exactly the launch's bytes: AddressSanitizer
  // (make cuda-memcheck) reports an access past them
  std::unique_ptr<unsigned char[], AlignedDelete> storage;
  unsigned char* data() { return storage.get(); }
};
inline thread_local Block* block = nullptr;

// A thread's asynchronous copies (__pipeline_memcpy_async, below) not yet landed.
struct Copy {
  void* dst;
  const void* src;
  size_t bytes;
};
inline thread_local std::vector<std::vector<Copy>> committed;  // oldest batch first
inline thread_local std::vector<Copy> uncommitted;
inline thread_local bool copies_at_issue = true;

inline Warp& my_warp() { return block->warps[threadIdx.x / 32]; }
inline unsigned lane() { return threadIdx.x & 31; }

inline void check_shared(const void* p, size_t bytes, const char* what) {
  const auto* b = static_cast<const unsigned char*>(p);
  if (b < block->data() || b + bytes > block->data() + block->bytes)
    device().fail(std::string(what) + ": access outside the block's dynamic shared memory");
}

// The OS threads that play CUDA threads, kept between blocks and launches: creating 128 threads a
// block cost more than running most blocks (about 5 ms a block, 85 ms under ThreadSanitizer).
class Workers {
 public:
  // Runs task(0), ..., task(n - 1) on n threads at once (a block's threads wait for each other at
  // barriers, so every one must be running) and returns when all have returned.
  void run(int n, const std::function<void(int)>& task) {
    std::lock_guard<std::mutex> one_launch_at_a_time(mu_);
    while (static_cast<int>(slots_.size()) < n) {
      auto& slot = slots_.emplace_back(std::make_unique<Slot>());
      std::thread([this, s = slot.get(), i = static_cast<int>(slots_.size()) - 1] { loop(*s, i); }).detach();
    }
    task_ = &task;
    remaining_.store(n);
    for (int i = 0; i < n; ++i) slots_[static_cast<size_t>(i)]->go.release();
    done_.acquire();
  }

 private:
  struct Slot {
    std::binary_semaphore go{0};
  };
  void loop(Slot& slot, int i) {
    for (;;) {
      slot.go.acquire();
      (*task_)(i);
      if (remaining_.fetch_sub(1) == 1) done_.release();
    }
  }
  std::mutex mu_;
  std::vector<std::unique_ptr<Slot>> slots_;  // a thread each, detached: it waits until the process ends
  const std::function<void(int)>* task_ = nullptr;
  std::atomic<int> remaining_{0};
  std::binary_semaphore done_{0};
};
inline Workers& workers() {
  static Workers* w = new Workers;  // never destroyed: its threads outlive static destruction
  return *w;
}

template <typename... P, typename... A>
void launch(void (*kernel)(P...), int grid, int threads, size_t smem, A&&... args) {
  Device& dev = device();
  auto it = dev.smem_optin.find(reinterpret_cast<const void*>(kernel));
  const size_t limit = it == dev.smem_optin.end() ? kDefaultSmem : it->second;
  if (smem > limit || threads > 1024 || threads % 32 != 0 || grid <= 0) {
    dev.last = cudaErrorInvalidValue;
    dev.fail("launch rejected: grid " + std::to_string(grid) + ", " + std::to_string(threads) + " threads, " +
             std::to_string(smem) + " bytes of shared memory (limit " + std::to_string(limit) + ")");
    return;
  }
  static std::atomic<unsigned> launches{0};
  const unsigned n = launches++;
  const bool at_issue = n % 2 == 0;
  const bool reversed = n / 2 % 2 == 1;  // all four pairings of copy timing and block order occur
  for (int first = 0; first < grid; first += kBlocksAtOnce) {
    const int count = std::min(kBlocksAtOnce, grid - first);
    std::vector<std::unique_ptr<Block>> blocks;
    for (int j = 0; j < count; ++j) blocks.emplace_back(std::make_unique<Block>(threads, smem));
    workers().run(count * threads, [&](int i) {
      const int j = i / threads, t = i % threads;
      const int b = reversed ? grid - 1 - (first + j) : first + j;
      Block* blk = blocks[static_cast<size_t>(j)].get();
      threadIdx = dim3{static_cast<unsigned>(t), 1, 1};
      blockIdx = dim3{static_cast<unsigned>(b), 1, 1};
      blockDim = dim3{static_cast<unsigned>(threads), 1, 1};
      gridDim = dim3{static_cast<unsigned>(grid), 1, 1};
      block = blk;
      copies_at_issue = at_issue;
      committed.clear();  // a copy a kernel never waited for does not land in a later one
      uncommitted.clear();
      kernel(args...);
      // An exited thread no longer holds back its block's or its warp's barriers, as on a GPU.
      my_warp().exited[lane()] = true;
      my_warp().sync.arrive_and_drop();
      blk->sync.arrive_and_drop();
    });
  }
}

// Runs one host entry point, the error it throws and the misuse the emulator found into err.
template <typename F>
int run_checked(F&& call, char* err, int err_len) {
  emu::device().errors.clear();
  std::string message;
  try {
    call();
  } catch (const std::exception& e) {
    message = e.what();
  }
  message += emu::device().errors;
  std::snprintf(err, err_len, "%s", message.c_str());
  return message.empty() ? 0 : 1;
}

}  // namespace emu

#define CHUNKGEN_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::emu::launch(kernel, static_cast<int>(grid), static_cast<int>(block), static_cast<size_t>(smem), __VA_ARGS__)

inline cudaError_t cudaGetDevice(int* d) {
  *d = emu::device().current;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int dev) {
  *v = a == cudaDevAttrMultiProcessorCount ? emu::device().sms.at(dev) : emu::device().max_smem;
  return cudaSuccess;
}
template <typename F>
cudaError_t cudaFuncSetAttribute(F* kernel, cudaFuncAttribute, int bytes) {
  if (bytes > emu::device().max_smem) return cudaErrorInvalidValue;
  emu::device().smem_optin[reinterpret_cast<const void*>(kernel)] = static_cast<size_t>(bytes);
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() {
  const cudaError_t e = emu::device().last;
  emu::device().last = cudaSuccess;
  return e;
}
inline const char* cudaGetErrorString(cudaError_t e) { return e == cudaSuccess ? "no error" : "invalid argument"; }

// ---- device functions -------------------------------------------------------------------------
inline unsigned char* shared_bytes_emu() { return emu::block->data(); }
#define shared_bytes shared_bytes_emu

inline void __syncthreads() { emu::block->sync.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { emu::my_warp().sync.arrive_and_wait(); }
// A shuffle of the full warp: every lane must take part, at the same shuffle (a lane that reached
// another shuffle, or returned, makes the exchange undefined on a GPU; here it is an error), and
// reads lane src's value (lanes past the warp's end keep their own).
namespace emu {
inline float exchange(unsigned mask, float v, unsigned src, const std::source_location& at) {
  Warp& w = my_warp();
  const unsigned me = lane();
  if (mask != 0xffffffffu) device().fail("shuffle with a partial mask: the emulator takes full warps only");
  w.slot[me] = v;
  w.site[me] = at.line();
  w.sync.arrive_and_wait();
  for (unsigned l = 0; l < 32; ++l)
    if (w.exited[l] || w.site[l] != at.line()) {
      device().fail(std::string("shuffle at line ") + std::to_string(at.line()) + ": lane " + std::to_string(l) +
                    (w.exited[l] ? " has returned" : " is at the shuffle of line " + std::to_string(w.site[l])));
      break;
    }
  const float r = src < 32 ? w.slot[src] : v;
  w.sync.arrive_and_wait();
  return r;
}
}  // namespace emu

inline float __shfl_sync(unsigned mask, float v, int src, std::source_location at = std::source_location::current()) {
  return emu::exchange(mask, v, static_cast<unsigned>(src) & 31, at);
}
inline float __shfl_down_sync(unsigned mask, float v, unsigned delta,
                              std::source_location at = std::source_location::current()) {
  return emu::exchange(mask, v, emu::lane() + delta, at);
}
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask,
                             std::source_location at = std::source_location::current()) {
  return emu::exchange(mask, v, emu::lane() ^ static_cast<unsigned>(lane_mask), at);
}

// ---- asynchronous copies (cuda_pipeline.h: cp.async on sm_80+) -------------------------------
// A thread's copies land at the latest by the __pipeline_wait_prior that covers their batch. The
// emulator makes them land at the issue in one launch and at that wait in the next, in turn: a read
// before the wait sees stale bytes in the second, a stage refilled while another warp still reads
// it races in the first.
inline void __pipeline_memcpy_async(void* dst, const void* src, size_t bytes) {
  emu::check_shared(dst, bytes, "__pipeline_memcpy_async");
  if ((bytes != 4 && bytes != 8 && bytes != 16) || reinterpret_cast<uintptr_t>(dst) % bytes != 0 ||
      reinterpret_cast<uintptr_t>(src) % bytes != 0)
    emu::device().fail("__pipeline_memcpy_async: 4, 8 or 16 bytes, aligned to their size");
  if (emu::copies_at_issue)
    std::memcpy(dst, src, bytes);
  else
    emu::uncommitted.push_back({dst, src, bytes});
}
inline void __pipeline_commit() {
  emu::committed.push_back(std::move(emu::uncommitted));
  emu::uncommitted.clear();
}
inline void __pipeline_wait_prior(size_t pending) {
  while (emu::committed.size() > pending) {
    for (const emu::Copy& c : emu::committed.front()) std::memcpy(c.dst, c.src, c.bytes);
    emu::committed.erase(emu::committed.begin());
  }
}

// ---- WMMA --------------------------------------------------------------------------------------
namespace nvcuda {
namespace wmma {
struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static constexpr int rows = std::is_same_v<Use, matrix_b> ? K : M;
  static constexpr int cols = std::is_same_v<Use, matrix_a> ? K : N;
  float x[rows * cols];  // the whole tile, row-major, in every lane
};

template <typename T>
inline float elem(const T& v) {
  if constexpr (std::is_same_v<T, __half>)
    return __half2float(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __bfloat162float(v);
  else
    return static_cast<float>(v);
}

template <typename T>
void check_tile(const T* p, unsigned ldm, const char* what) {
  if (reinterpret_cast<uintptr_t>(p) % 32 != 0) emu::device().fail(std::string(what) + ": pointer not 256-bit aligned");
  if ((ldm * sizeof(T)) % 16 != 0) emu::device().fail(std::string(what) + ": ldm not a multiple of 16 bytes");
}

// A store waits until every lane of the warp has arrived (the warp matrix functions do; CUDA C++
// Programming Guide). The emulator needs it for an accumulator loaded, multiplied and stored back
// in place: its lane 0 stores the whole tile, which other lanes may still be loading; on a GPU each
// lane stores the elements it loaded, so there is no race. Nothing else waits: whatever wrote a
// tile before a load, or reads it after a store, must synchronise, as it must on a GPU.
inline void arrive_all() { emu::my_warp().sync.arrive_and_wait(); }

template <typename Use, int M, int N, int K, typename T, typename L, typename S>
void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const S* p, unsigned ldm) {
  using F = fragment<Use, M, N, K, T, L>;
  static_assert(std::is_same_v<S, T>, "fragment and memory element types differ");
  check_tile(p, ldm, "load_matrix_sync");
  emu::check_shared(p, 0, "load_matrix_sync");
  constexpr bool col = std::is_same_v<L, col_major>;
  for (int r = 0; r < F::rows; ++r)
    for (int c = 0; c < F::cols; ++c) f.x[r * F::cols + c] = elem(col ? p[c * ldm + r] : p[r * ldm + c]);
  if (!col) emu::check_shared(p + (F::rows - 1) * ldm, F::cols * sizeof(S), "load_matrix_sync");
}

// An accumulator tile from float memory (row- or column-major), the starting point of mma_sync.
template <int M, int N, int K>
void load_matrix_sync(fragment<accumulator, M, N, K, float>& f, const float* p, unsigned ldm, layout_t layout) {
  check_tile(p, ldm, "load_matrix_sync");
  emu::check_shared(p, 0, "load_matrix_sync");
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) f.x[r * N + c] = layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
  if (layout == mem_row_major) emu::check_shared(p + (M - 1) * ldm, N * sizeof(float), "load_matrix_sync");
}

template <typename Use, int M, int N, int K, typename T, typename L>
void fill_fragment(fragment<Use, M, N, K, T, L>& f, float v) {
  for (float& e : f.x) e = v;
}

template <int M, int N, int K, typename T, typename La, typename Lb>
void mma_sync(fragment<accumulator, M, N, K, float>& d, const fragment<matrix_a, M, N, K, T, La>& a,
              const fragment<matrix_b, M, N, K, T, Lb>& b, const fragment<accumulator, M, N, K, float>& c) {
  float out[M * N];
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      float s = c.x[i * N + j];
      for (int k = 0; k < K; ++k) s += a.x[i * K + k] * b.x[k * N + j];
      out[i * N + j] = s;
    }
  std::memcpy(d.x, out, sizeof(out));
}

template <int M, int N, int K>
void store_matrix_sync(float* p, const fragment<accumulator, M, N, K, float>& f, unsigned ldm, layout_t layout) {
  arrive_all();
  check_tile(p, ldm, "store_matrix_sync");
  emu::check_shared(p, 0, "store_matrix_sync");
  if (emu::lane() != 0) return;
  for (int r = 0; r < M; ++r)
    for (int c = 0; c < N; ++c) (layout == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.x[r * N + c];
}
}  // namespace wmma
}  // namespace nvcuda
