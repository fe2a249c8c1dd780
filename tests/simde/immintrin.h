/* The engine's kernels on a CPU without their instructions (tests/simde/run.sh): every x86 intrinsic
 * through SIMDe's portable code, and where SIMDe's emulation is not the instruction's definition, the
 * definition here: fused multiply-adds with one rounding, masked stores that write only the masked
 * lanes, and the few intrinsics SIMDe lacks. AMX's tile instructions abort (the emulated tiles of
 * kernels_amx.c run instead). Never part of the package build. */
#ifndef SHIM_IMMINTRIN_H
#define SHIM_IMMINTRIN_H
#define SIMDE_ENABLE_NATIVE_ALIASES
#include <stdlib.h>
#include <string.h>
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>
#include <simde/x86/avx2.h>

#ifndef _MM_FROUND_NO_EXC
#define _MM_FROUND_NO_EXC SIMDE_MM_FROUND_NO_EXC
#define _MM_FROUND_TO_NEAREST_INT SIMDE_MM_FROUND_TO_NEAREST_INT
#endif
#ifndef _CMP_LT_OQ
#define _CMP_LT_OQ SIMDE_CMP_LT_OQ
#endif
#ifndef _MM_HINT_T0
#define _MM_HINT_T0 SIMDE_MM_HINT_T0
#endif
static inline __m512i shim_from_bytes(const void *p) { return _mm512_loadu_si512(p); }
static inline __m256i _mm512_cvtepi32_epi16(__m512i a) { int32_t v[16]; int16_t o[16]; _mm512_storeu_si512(v, a); for (int i = 0; i < 16; i++) o[i] = (int16_t)v[i]; return _mm256_loadu_si256((const void *)o); }
static inline __m128i _mm512_cvtepi32_epi8(__m512i a) { int32_t v[16]; int8_t o[16]; _mm512_storeu_si512(v, a); for (int i = 0; i < 16; i++) o[i] = (int8_t)v[i]; return _mm_loadu_si128((const void *)o); }
static inline __m512i _mm512_cvtepi8_epi32(__m128i a) { int8_t v[16]; int32_t o[16]; _mm_storeu_si128((void *)v, a); for (int i = 0; i < 16; i++) o[i] = v[i]; return _mm512_loadu_si512(o); }
static inline __m512i _mm512_cvtepu8_epi32(__m128i a) { uint8_t v[16]; int32_t o[16]; _mm_storeu_si128((void *)v, a); for (int i = 0; i < 16; i++) o[i] = v[i]; return _mm512_loadu_si512(o); }
static inline __m512i _mm512_cvtepu8_epi16(__m256i a) { uint8_t v[32]; int16_t o[32]; _mm256_storeu_si256((void *)v, a); for (int i = 0; i < 32; i++) o[i] = v[i]; return _mm512_loadu_si512(o); }
/* keyed_scan.h's AVX-512 scan: leading zero bits of 64-bit lanes (AVX512-CD) and 64-bit integers to float32 */
static inline __m512i _mm512_lzcnt_epi64(__m512i a) { uint64_t v[8]; _mm512_storeu_si512(v, a); for (int i = 0; i < 8; i++) v[i] = v[i] ? (uint64_t)__builtin_clzll(v[i]) : 64; return _mm512_loadu_si512(v); }
static inline __m256 _mm512_cvtepi64_ps(__m512i a) { int64_t v[8]; float o[8]; _mm512_storeu_si512(v, a); for (int i = 0; i < 8; i++) o[i] = (float)v[i]; return _mm256_loadu_ps(o); }
static inline int _mm512_reduce_add_epi32(__m512i a) { int32_t v[16]; _mm512_storeu_si512(v, a); int32_t s = 0; for (int i = 0; i < 16; i++) s += v[i]; return s; }
/* the instruction's order: halving (i + (i+8)), (i + (i+4)), ... as GCC's _mm512_reduce_add_ps */
static inline float _mm512_reduce_add_ps(__m512 a) { float v[16]; _mm512_storeu_ps(v, a); for (int w = 8; w >= 1; w /= 2) for (int i = 0; i < w; i++) v[i] = v[i] + v[i + w]; return v[0]; }
static inline uint16_t shim_bf16(float f) { uint32_t x; memcpy(&x, &f, 4); if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40); return (uint16_t)((x + 0x7fff + ((x >> 16) & 1)) >> 16); }
static inline __m512bh _mm512_cvtne2ps_pbh(__m512 hi, __m512 lo) { float a[16], b[16]; uint16_t o[32]; _mm512_storeu_ps(a, lo); _mm512_storeu_ps(b, hi); for (int i = 0; i < 16; i++) o[i] = shim_bf16(a[i]), o[16 + i] = shim_bf16(b[i]); __m512bh r; memcpy(&r, o, 64); return r; }
/* FMA with one rounding (SIMDe's portable fallback rounds twice) */
#include <math.h>
#undef _mm512_fmadd_ps
#undef _mm256_fmadd_ps
static inline __m512 _mm512_fmadd_ps(__m512 a, __m512 b, __m512 c) { float x[16], y[16], z[16]; _mm512_storeu_ps(x, a); _mm512_storeu_ps(y, b); _mm512_storeu_ps(z, c); for (int i = 0; i < 16; i++) z[i] = fmaf(x[i], y[i], z[i]); return _mm512_loadu_ps(z); }
static inline __m256 _mm256_fmadd_ps(__m256 a, __m256 b, __m256 c) { float x[8], y[8], z[8]; _mm256_storeu_ps(x, a); _mm256_storeu_ps(y, b); _mm256_storeu_ps(z, c); for (int i = 0; i < 8; i++) z[i] = fmaf(x[i], y[i], z[i]); return _mm256_loadu_ps(z); }
#undef _mm512_fmsub_ps
#undef _mm256_fmsub_ps
static inline __m512 _mm512_fmsub_ps(__m512 a, __m512 b, __m512 c) { float x[16], y[16], z[16]; _mm512_storeu_ps(x, a); _mm512_storeu_ps(y, b); _mm512_storeu_ps(z, c); for (int i = 0; i < 16; i++) z[i] = fmaf(x[i], y[i], -z[i]); return _mm512_loadu_ps(z); }
static inline __m256 _mm256_fmsub_ps(__m256 a, __m256 b, __m256 c) { float x[8], y[8], z[8]; _mm256_storeu_ps(x, a); _mm256_storeu_ps(y, b); _mm256_storeu_ps(z, c); for (int i = 0; i < 8; i++) z[i] = fmaf(x[i], y[i], -z[i]); return _mm256_loadu_ps(z); }
/* masked stores touch only the lanes asked for (SIMDe's write all 16) */
#undef _mm512_mask_storeu_ps
static inline void _mm512_mask_storeu_ps(void *p, __mmask16 k, __m512 a) { float v[16]; _mm512_storeu_ps(v, a); for (int i = 0; i < 16; i++) if (k >> i & 1) ((float *)p)[i] = v[i]; }
/* AMX: never run here (no tiles); present so the file compiles */
#define _tile_loadconfig(c) abort()
#define _tile_zero(t) abort()
#define _tile_loadd(t, p, s) abort()
#define _tile_stored(t, p, s) abort()
#define _tile_dpbf16ps(c, a, b) abort()
#define _tile_dpbsud(c, a, b) abort()
#define _tile_release() abort()
#endif
