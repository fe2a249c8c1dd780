/* The AMX path: bfloat16 rows by tdpbf16ps and 8-bit rows by tdpbsud, 16 rows x 16 outputs x one
 * block per instruction (amx_kernels.h), after the permission and probe of cpu.c. bfloat16 products
 * take the tiles at every width (their sums' order is the instruction's own, so one kernel serves
 * every row count). 8-bit products take the tiles from AMX_INT8_ROWS rows and VNNI's kernel below,
 * which gives the same bits (integer dot products are exact, and both take the same float steps
 * after them).
 *
 * Why only from 64 rows, measured on a Xeon with AMX (family 6 model 207, a 2-core VM): a block's
 * scales need its 16 x 16 product stored and read back by vector loads, and a B tile made by vector
 * stores (the nibbles widened) waits for them to reach the cache before tileloadd (41.5 ns a block
 * against 16.5 loaded from memory, in a loop of those instructions), which a row's 8 vpdpbusd
 * undercut. Block by block over 16 rows (three arrangements tried) the tiles lost or tied at every
 * width. Made once for up to 64 rows (AMX_INT8_CALL_ROWS then), the Bs cost once: passes of 64 / 128 rows
 * 59.5 / 111.7 ms against VNNI's 59.9 / 124.2 and a 1,024-token prefill 0.87 s against 0.91
 * (benchmarks/isa_compare.py; docs/engine.md has the rest), nothing gained below 64 rows. A long pass
 * ran in chunks of 64 rows, so no call saw more; with the AMX path a long pass runs in chunks of
 * AMX_PASS_ROWS (``kernels.pass_rows``) and each call takes them all: a B made once for 256 rows. The
 * default model's 1,024-token prefill 0.570 / 0.569 -> 0.539 / 0.537 s (two rounds of
 * benchmarks/prefill.py, medians of 3; 128 rows read 0.552 / 0.527), float32 and bfloat16 rows no
 * slower (1.250 / 1.206 -> 1.206 / 1.179 s, 0.791 / 0.750 -> 0.749 / 0.743).
 *
 * The same kernels over a plain-C emulation of the tile instructions (``emulated``, tests only) are
 * the reference of the tile math and let a CPU without AMX check the kernels' layouts. */
#include <string.h>

#include "engine.h"

#if QE_X86
#include <immintrin.h>

#include "avx512_blocks.h"

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;
static_assert(sizeof(tile_config) == 64, "ldtilecfg reads 64 bytes");

/* 8-bit products take the tiles from AMX_INT8_ROWS rows (VNNI's kernel below: the same bits), up to
 * AMX_INT8_CALL_ROWS rows a call, each block's B made once for them all, and a long pass runs in chunks
 * of as many rows (above: why). */
#define AMX_INT8_ROWS 64
#define AMX_INT8_CALL_ROWS 256
#define AMX_PASS_ROWS AMX_INT8_CALL_ROWS

/* ---- the real tiles ----
 * The configuration and the tiles' loads and stores are written here as inline assembly, not taken
 * from <immintrin.h>: GCC 12's _tile_loadconfig declares that ldtilecfg reads 8 bytes of the 64-byte
 * configuration and _tile_loadd that tileloadd reads no memory at all, so GCC dropped the stores of
 * the configuration's rows and columns (ldtilecfg then faulted with SIGSEGV, found on a Xeon with
 * AMX) and may drop or sink the stores that fill a tile before it is loaded. These declare the whole
 * configuration read, and a load's or store's memory as touched (a "memory" clobber). */
#define AMX_ASM_CONFIG(c) __asm__ volatile("ldtilecfg %0" ::"m"(*(const tile_config *)(c)))
#define AMX_ASM_LOAD(t, p, stride) \
    __asm__ volatile("tileloadd (%0,%1,1), %%tmm" #t ::"r"((const void *)(p)), "r"((long)(stride)) : "memory")
#define AMX_ASM_STORE(t, p, stride) \
    __asm__ volatile("tilestored %%tmm" #t ", (%0,%1,1)" ::"r"((void *)(p)), "r"((long)(stride)) : "memory")
#define AMX_NAME(x) amx_##x
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define T_CONFIG(c) AMX_ASM_CONFIG(c)
#define T_ZERO(t) _tile_zero(t)
#define T_LOAD(t, p, stride) AMX_ASM_LOAD(t, p, stride)
#define T_STORE(t, p, stride) AMX_ASM_STORE(t, p, stride)
#define T_BF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define T_BSUD(c, a, b) _tile_dpbsud(c, a, b)
#define T_RELEASE() _tile_release()
#include "amx_kernels.h"
#undef AMX_NAME
#undef AMX_TARGET
#undef T_CONFIG
#undef T_ZERO
#undef T_LOAD
#undef T_STORE
#undef T_BF16
#undef T_BSUD
#undef T_RELEASE

/* ---- the emulated tiles: the instructions' definitions (Intel SDM, TDPBF16PS and TDPBSUD) ---- */
typedef struct {
    uint8_t data[16][64];
    int rows, colsb;
} emulated_tile;
static _Thread_local emulated_tile emulated_tiles[8];

static void emu_config(const tile_config *c) {
    for (int t = 0; t < 8; t++) emulated_tiles[t].rows = c->rows[t], emulated_tiles[t].colsb = c->colsb[t];
}
static void emu_zero(int t) { memset(emulated_tiles[t].data, 0, sizeof emulated_tiles[t].data); }
static void emu_load(int t, const void *p, size_t stride) {
    for (int r = 0; r < emulated_tiles[t].rows; r++) memcpy(emulated_tiles[t].data[r], (const uint8_t *)p + r * stride, (size_t)emulated_tiles[t].colsb);
}
static void emu_store(int t, void *p, size_t stride) {
    for (int r = 0; r < emulated_tiles[t].rows; r++) memcpy((uint8_t *)p + r * stride, emulated_tiles[t].data[r], (size_t)emulated_tiles[t].colsb);
}
static float bf16_at(const emulated_tile *t, int row, int word) {
    uint16_t h;
    memcpy(&h, t->data[row] + 2 * word, 2);
    return bf16_to_float(h);
}
/* C[m][n] += sum over pairs k of A[m][2k] B[k][2n] + A[m][2k+1] B[k][2n+1], float32 (each product exact) */
static void emu_bf16(int c, int a, int b) {
    for (int m = 0; m < emulated_tiles[c].rows; m++)
        for (int n = 0; n < emulated_tiles[c].colsb / 4; n++) {
            float acc;
            memcpy(&acc, emulated_tiles[c].data[m] + 4 * n, 4);
            for (int k = 0; k < emulated_tiles[a].colsb / 4; k++) {
                acc += bf16_at(&emulated_tiles[a], m, 2 * k) * bf16_at(&emulated_tiles[b], k, 2 * n);
                acc += bf16_at(&emulated_tiles[a], m, 2 * k + 1) * bf16_at(&emulated_tiles[b], k, 2 * n + 1);
            }
            memcpy(emulated_tiles[c].data[m] + 4 * n, &acc, 4);
        }
}
/* C[m][n] += sum over quads k, j of signed A[m][4k + j] * unsigned B[k][4n + j], int32 */
static void emu_bsud(int c, int a, int b) {
    for (int m = 0; m < emulated_tiles[c].rows; m++)
        for (int n = 0; n < emulated_tiles[c].colsb / 4; n++) {
            int32_t acc;
            memcpy(&acc, emulated_tiles[c].data[m] + 4 * n, 4);
            for (int k = 0; k < emulated_tiles[a].colsb / 4; k++)
                for (int j = 0; j < 4; j++) acc += (int8_t)emulated_tiles[a].data[m][4 * k + j] * (int32_t)emulated_tiles[b].data[k][4 * n + j];
            memcpy(emulated_tiles[c].data[m] + 4 * n, &acc, 4);
        }
}

#define AMX_NAME(x) emulated_##x
#define AMX_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))
#define T_CONFIG(c) emu_config(c)
#define T_ZERO(t) emu_zero(t)
#define T_LOAD(t, p, stride) emu_load(t, p, stride)
#define T_STORE(t, p, stride) emu_store(t, p, stride)
#define T_BF16(c, a, b) emu_bf16(c, a, b)
#define T_BSUD(c, a, b) emu_bsud(c, a, b)
#define T_RELEASE() ((void)0)
#include "amx_kernels.h"

/* ---- the probe's product -------------------------------------------------------------------- */

/* What the forked probe child runs: a configuration, then each tile product of small integers whose
 * exact results are known, compared. No allocation (the child of a threaded process). */
__attribute__((target("amx-tile,amx-bf16,amx-int8"))) int amx_selftest(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    config.rows[0] = 16, config.colsb[0] = 64;
    config.rows[1] = 16, config.colsb[1] = 64;
    config.rows[2] = 16, config.colsb[2] = 64;
    config.rows[3] = 16, config.colsb[3] = 32;
    config.rows[4] = 8, config.colsb[4] = 64;
    __attribute__((aligned(64))) uint16_t a[16 * 32], b[16 * 32];
    __attribute__((aligned(64))) int8_t ai[16 * 32];
    __attribute__((aligned(64))) uint8_t bi[8 * 64];
    __attribute__((aligned(64))) float c[16 * 16];
    __attribute__((aligned(64))) int32_t ci[16 * 16];
    for (int i = 0; i < 16 * 32; i++) {
        a[i] = float_to_bf16((float)(i % 7 - 3));
        b[i] = float_to_bf16((float)(i % 5 - 2));
        ai[i] = (int8_t)(i % 11 - 5);
    }
    for (int i = 0; i < 8 * 64; i++) bi[i] = (uint8_t)(i % 13 + 120);
    AMX_ASM_CONFIG(&config);
    _tile_zero(0);
    AMX_ASM_LOAD(1, a, 64);
    AMX_ASM_LOAD(2, b, 64);
    _tile_dpbf16ps(0, 1, 2);
    AMX_ASM_STORE(0, c, 64);
    _tile_zero(0);
    AMX_ASM_LOAD(3, ai, 32);
    AMX_ASM_LOAD(4, bi, 64);
    _tile_dpbsud(0, 3, 4);
    AMX_ASM_STORE(0, ci, 64);
    _tile_release();
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float expected = 0.0f;
            int32_t expected_int = 0;
            for (int k = 0; k < 32; k++) expected += bf16_to_float(a[32 * m + k]) * bf16_to_float(b[32 * (k / 2) + 2 * n + k % 2]);
            for (int k = 0; k < 32; k++) expected_int += ai[32 * m + k] * (int32_t)bi[64 * (k / 4) + 4 * n + k % 4];
            if (c[16 * m + n] != expected || ci[16 * m + n] != expected_int) return 0;
        }
    return 1;
}

void install_amx(kernel_set *k) {
    k->pass_rows = AMX_PASS_ROWS;
    for (int kind = 0; kind < KINDS; kind++) {
        k->tile[LAYOUT_BF16][kind] = (tile_kernel){amx_tile_bf16, 16, ISA_AMX, NULL, 0, 0, amx_enter, amx_leave};
        tile_kernel vnni = k->tile[LAYOUT_INT8][kind];
        k->tile[LAYOUT_INT8][kind] = (tile_kernel){amx_tile_int8(kind), AMX_INT8_CALL_ROWS, ISA_AMX, vnni.run, AMX_INT8_ROWS, vnni.rows,
                                                   amx_enter, amx_leave};
    }
}

int install_emulated_amx(kernel_set *k) {
    if (cpu.level < ISA_AVX512) return 0; /* the kernels' other steps are AVX-512 */
    for (int kind = 0; kind < KINDS; kind++) {
        k->tile[LAYOUT_BF16][kind] = (tile_kernel){emulated_tile_bf16, 16, ISA_AMX, NULL, 0, 0, emulated_enter, emulated_leave};
        /* the few rows' kernel: the one in use (the VNNI kernel, or the real tiles' own few-row kernel:
         * the real tile kernel would run unconfigured, SIGILL) */
        tile_kernel now = k->tile[LAYOUT_INT8][kind];
        tile_kernel few = now.isa == ISA_AMX ? (tile_kernel){now.few, now.few_rows} : now;
        k->tile[LAYOUT_INT8][kind] = (tile_kernel){emulated_tile_int8(kind), AMX_INT8_CALL_ROWS, ISA_AMX, few.run, AMX_INT8_ROWS, few.rows,
                                                   emulated_enter, emulated_leave};
    }
    return 1;
}

#else
int amx_selftest(void) { return 0; }
void install_amx(kernel_set *k) { (void)k; }
int install_emulated_amx(kernel_set *k) {
    (void)k;
    return 0;
}
#endif
