// Which bf16 path the CPU kernels take: the best one this build has and this CPU (and, for AMX, the
// OS) grants, lowered by CHUNKGEN_CPU_ISA so tests can run every path the machine has.
#pragma once

namespace chunkgen {

enum class Isa { Fp32, Avx512Bf16, Amx };

// best_isa(), lowered by CHUNKGEN_CPU_ISA when it names a lower path (read on every call, so a
// test can switch paths inside one process); a name it does not know throws std::invalid_argument.
Isa current_isa();
const char* isa_name(Isa isa);  // "amx", "avx512_bf16", or the fp32 path's SIMD ISA

// Whether this CPU has AMX's int8 tiles and the OS lets this process use the tile state (the
// quantized products' AMX path; asked once per process).
bool amx_int8_granted();

}  // namespace chunkgen
