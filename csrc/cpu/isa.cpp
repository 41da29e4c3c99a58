// The CPU kernels' path selection (see isa.h).
#include "isa.h"

#include <algorithm>
#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__)
#include <cpuid.h>
#endif

#include "bf16_gemm.h"

namespace chunkgen {
namespace {

const char* fp32_isa_name() {
#if defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#elif defined(__AVX__)
  return "avx";
#elif defined(__SSE__)
  return "sse";
#else
  return "generic";
#endif
}

// The best bf16 path this build has and this CPU/OS grants, asked once per process.
Isa best_isa() {
  static const Isa best = [] {
    Isa isa = Isa::Fp32;
#if defined(CHUNKGEN_HAVE_AVX512_BF16)
    unsigned a, b, c, d;
    if (__get_cpuid_count(7, 1, &a, &b, &c, &d) && (a & (1u << 5))) isa = Isa::Avx512Bf16;
#if defined(CHUNKGEN_HAVE_AMX) && defined(__linux__)
    // AMX-BF16 (EDX bit 22) and AMX-TILE (bit 24) in leaf 7, then the kernel's permission to use
    // the tile state (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA): a kernel or VM may refuse it.
    if (isa == Isa::Avx512Bf16 && __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 22)) && (d & (1u << 24)) &&
        syscall(SYS_arch_prctl, 0x1023, 18) == 0)
      isa = Isa::Amx;
#endif
#endif
    return isa;
  }();
  return best;
}

}  // namespace

Isa current_isa() {
  const Isa best = best_isa();
  const char* env = std::getenv("CHUNKGEN_CPU_ISA");
  if (env == nullptr || *env == '\0') return best;
  const std::string want(env);
  Isa w;
  if (want == "amx")
    w = Isa::Amx;
  else if (want == "avx512_bf16")
    w = Isa::Avx512Bf16;
  else if (want == "fp32" || want == fp32_isa_name())
    w = Isa::Fp32;
  else
    throw std::invalid_argument("CHUNKGEN_CPU_ISA=" + want + " is not one of amx, avx512_bf16, fp32, " +
                                fp32_isa_name());
  return std::min(w, best);
}

bool amx_int8_granted() {
  static const bool granted = [] {
#if defined(__x86_64__) && defined(__linux__)
    // AMX-TILE (EDX bit 24) and AMX-INT8 (bit 25) in leaf 7, then ARCH_REQ_XCOMP_PERM for
    // XFEATURE_XTILEDATA (asked again where the bf16 path asked already: it is granted once).
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d & (1u << 24)) && (d & (1u << 25)) &&
           syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return false;
#endif
  }();
  return granted;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Amx:
      return "amx";
    case Isa::Avx512Bf16:
      return "avx512_bf16";
    default:
      return fp32_isa_name();
  }
}

}  // namespace chunkgen
