// The x86 intrinsics, included through here alone. GCC 12's AVX-512 headers give the unmasked
// intrinsics an uninitialised pass-through operand (`__m512 __Y = __Y;` in _mm512_undefined_ps and
// its kin), so every inlined _mm512_max_ps, _mm512_scalef_ps, _mm512_cvtepi16_epi32, ... warns
// -Wmaybe-uninitialized from inside the header (GCC bug 105593, fixed in GCC 13): the operand is
// never read, the instructions have no mask. GCC reports it where the intrinsic is inlined, in the
// including file's functions, so a push/pop around the #include does not reach it: it is off for
// the rest of each file that includes this one (only on GCC < 13).
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>
#endif
