/* The AMX tile kernels' bodies, included twice by kernels_amx.c: once over the real tile
 * instructions, once over their plain-C emulation (the reference of the tile math, which also lets
 * a CPU without AMX test the kernels' data layout). The includer defines:
 *   AMX_NAME(x)    the names of this copy's functions
 *   AMX_TARGET     its target attribute
 *   T_CONFIG(c), T_ZERO(t), T_LOAD(t, p, stride), T_STORE(t, p, stride), T_BF16(c, a, b),
 *   T_BSUD(c, a, b), T_RELEASE()   the tile operations (tile numbers are constants)
 *
 * Tiles (one configuration for both kernels): 0 C (16 rows x 16 float32 or int32), 1 A bfloat16 (16
 * rows x 32 values), 2 B bfloat16 (16 pairs of k x 16 outputs), 3 A int8 (16 rows x 32 values), 4 B
 * int8 (8 quads of k x 16 outputs).
 *
 * Per (tile, block): the weights' values go into B as the instruction reads them (pairs of k per
 * output for bfloat16, quads for int8: the layouts LAYOUT_BF16 and LAYOUT_INT8 already order them
 * so), 16 rows of x are A, C = A B is the block's dot product of 16 rows x 16 outputs, then each row
 * is scaled into its running sum in float32 exactly as the vector kernels do:
 *   bfloat16: acc += dot * d + (m - 128 d) * sum x, the dot over (128 + q) for Q4 (as kernels_avx512bf16.c);
 *   int8:     acc += dot * (d * s) (+ m * (s * sum q) for Q4), a Q8 dot less 128 * sum q (as kernels_vnni.c),
 * so the int8 kernel gives the VNNI kernel's (and the reference's) bits: integer dot products are
 * exact whatever their order. The x rows are read 16 at a time: matmul.c pads them to a multiple of
 * 16 (the padding rows' outputs are never stored). */

AMX_TARGET static void AMX_NAME(enter)(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    config.rows[0] = 16, config.colsb[0] = 64;
    config.rows[1] = 16, config.colsb[1] = 64;
    config.rows[2] = 16, config.colsb[2] = 64;
    config.rows[3] = 16, config.colsb[3] = 32;
    config.rows[4] = 8, config.colsb[4] = 64;
    T_CONFIG(&config);
}

AMX_TARGET static void AMX_NAME(leave)(void) { T_RELEASE(); }

AMX_TARGET static void AMX_NAME(tile_bf16)(const matmul_args *a, int t, int m0, int mt) {
    const packed_weight *w = a->w;
    int KB = w->K / QK;
    const uint16_t *x = (const uint16_t *)a->x;
    __attribute__((aligned(64))) uint16_t bt[16 * 32]; /* B: pair p of k, output r: words 32p + 2r, + 1 */
    __attribute__((aligned(64))) float c[16 * 16];
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi16(0x0f), bias = _mm512_set1_epi16(0x4300);
    for (int b = 0; b < KB; b++) {
        const uint8_t *cell = cell_at(w, t, b);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)cell));
        __m512 mn = _mm512_setzero_ps();
        if (w->kind == KIND_Q4) { /* 32 bytes per pair of pairs: low nibbles pair 2g, high pair 2g + 1 */
            const uint8_t *q = ((const cell_q4 *)cell)->q;
            for (int g = 0; g < 8; g++) {
                __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * g)));
                _mm512_store_si512((void *)(bt + 64 * g), _mm512_or_si512(_mm512_and_si512(raw, low), bias));
                _mm512_store_si512((void *)(bt + 64 * g + 32), _mm512_or_si512(_mm512_srli_epi16(raw, 4), bias));
            }
            mn = _mm512_fmadd_ps(d, _mm512_set1_ps(-128.0f), _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cell + 32))));
        } else { /* 32 bytes per pair: int8 values, exact in bfloat16 (the float's top 16 bits) */
            const uint8_t *q = ((const cell_q8 *)cell)->q;
            for (int p = 0; p < 16; p++) {
                __m512i lo = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p)))));
                __m512i hi = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p + 16)))));
                _mm256_store_si256((__m256i *)(bt + 32 * p), _mm512_cvtepi32_epi16(_mm512_srli_epi32(lo, 16)));
                _mm256_store_si256((__m256i *)(bt + 32 * p + 16), _mm512_cvtepi32_epi16(_mm512_srli_epi32(hi, 16)));
            }
        }
        T_ZERO(0);
        T_LOAD(1, x + (size_t)m0 * w->K + (size_t)b * QK, (size_t)w->K * 2);
        T_LOAD(2, bt, 64);
        T_BF16(0, 1, 2);
        T_STORE(0, c, 64);
        for (int i = 0; i < mt; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_load_ps(c + 16 * i), d, acc[i]);
            if (w->kind == KIND_Q4) acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sums[(size_t)(m0 + i) * KB + b]), acc[i]);
        }
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm512_storeu_ps(vals, acc[i]);
        store_tile(a, m0 + i, t, vals);
    }
}

AMX_TARGET static void AMX_NAME(tile_int8)(const matmul_args *a, int t, int m0, int mt) {
    const packed_weight *w = a->w;
    int KB = w->K / QK;
    const int8_t *x = (const int8_t *)a->x;
    __attribute__((aligned(64))) uint8_t bt[8 * 64]; /* B: quad g of k, output r: bytes 64g + 4r .. + 3 */
    __attribute__((aligned(64))) int32_t c[16 * 16];
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int b = 0; b < KB; b++) {
        const uint8_t *cell = cell_at(w, t, b);
        __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)cell));
        const void *bq;
        if (w->kind == KIND_Q4) { /* 32 bytes per quad: values 0..31 in the low nibbles, 32..63 in the high */
            const uint8_t *q = ((const cell_q4 *)cell)->q;
            for (int g = 0; g < 8; g++) {
                __m256i r = _mm256_loadu_si256((const __m256i *)(q + 32 * g));
                _mm512_store_si512((void *)(bt + 64 * g),
                                   _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(r), _mm256_srli_epi16(r, 4), 1), low));
            }
            bq = bt;
        } else { /* a Q8 cell's values are B as they are (q + 128 per byte, quads per output) */
            bq = ((const cell_q8 *)cell)->q;
        }
        T_ZERO(0);
        T_LOAD(3, x + (size_t)m0 * w->K + (size_t)b * QK, (size_t)w->K);
        T_LOAD(4, bq, 64);
        T_BSUD(0, 3, 4);
        T_STORE(0, c, 64);
        if (w->kind == KIND_Q4) {
            __m512 mn = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(cell + 32)));
            for (int i = 0; i < mt; i++) {
                float s = a->sums[(size_t)(m0 + i) * KB + b];
                __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)(c + 16 * i)));
                acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(s)), acc[i]);
                acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(s * (float)a->isums[(size_t)(m0 + i) * KB + b]), acc[i]);
            }
        } else {
            for (int i = 0; i < mt; i++) {
                float s = a->sums[(size_t)(m0 + i) * KB + b];
                __m512i offset = _mm512_set1_epi32(128 * a->isums[(size_t)(m0 + i) * KB + b]);
                __m512 dot = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512((const void *)(c + 16 * i)), offset));
                acc[i] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d, _mm512_set1_ps(s)), acc[i]);
            }
        }
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm512_storeu_ps(vals, acc[i]);
        store_tile(a, m0 + i, t, vals);
    }
}
