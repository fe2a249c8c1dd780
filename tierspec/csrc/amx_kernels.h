/* The AMX tile kernels' bodies, included twice by kernels_amx.c: once over the real tile
 * instructions, once over their plain-C emulation (the reference of the tile math, which also lets
 * a CPU without AMX test the kernels' data layout). The includer defines:
 *   AMX_NAME(x)    the names of this copy's functions
 *   AMX_TARGET     its target attribute
 *   T_CONFIG(c), T_ZERO(t), T_LOAD(t, p, stride), T_STORE(t, p, stride), T_BF16(c, a, b),
 *   T_RELEASE()   the tile operations (tile numbers are constants)
 *
 * Tiles: 0 C (16 rows x 16 float32), 1 A bfloat16 (16 rows x 32 values), 2 B bfloat16 (16 pairs of k
 * x 16 outputs), 5 a second C: Q6_K's blocks have a scale per 16 inputs, so their two halves are two
 * products (each B holding one half's values, zeros in the other's places).
 *
 * Per (tile, block): the weights' values go into B as the instruction reads them (pairs of k per
 * output: the layout LAYOUT_BF16 already orders them so), 16 rows of x are A, C = A B is the block's
 * dot product of 16 rows x 16 outputs, then each row is scaled into its running sum in float32 as
 * kernels_avx512bf16.c does: acc += dot * d + (mn - 128 d) * sum x, the dot over (128 + u) for the
 * kinds with a minimum. The x rows are read 16 at a time: matmul.c pads them to a multiple of 16
 * (the padding rows' outputs are never stored). */

AMX_TARGET static void AMX_NAME(enter)(void) {
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    config.rows[0] = 16, config.colsb[0] = 64;
    config.rows[1] = 16, config.colsb[1] = 64;
    config.rows[2] = 16, config.colsb[2] = 64;
    config.rows[5] = 16, config.colsb[5] = 64;
    T_CONFIG(&config);
}

AMX_TARGET static void AMX_NAME(leave)(void) { T_RELEASE(); }

/* bfloat16 words of 16 small integers (exact: the float's top 16 bits) */
AMX_TARGET static inline __m256i AMX_NAME(bf16_words)(__m512i ints) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(ints)), 16));
}

AMX_TARGET static void AMX_NAME(tile_bf16)(const matmul_args *a, int t, int m0, int mt) {
    const packed_weight *w = a->w;
    int KB = w->K / QK, kind = w->kind;
    const uint16_t *x = (const uint16_t *)a->x;
    /* B: pair p of k, output r: words 32p + 2r, + 1; Q6_K: its halves in two Bs, zeros elsewhere */
    __attribute__((aligned(64))) uint16_t bt[2][16 * 32];
    __attribute__((aligned(64))) float c[2][16 * 16];
    __m512 acc[16];
    for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi16(0x0f), bias = _mm512_set1_epi16(0x4300);
    if (kind == KIND_Q6K) memset(bt, 0, sizeof bt);
    for (int b = 0; b < KB; b++) {
        int j;
        const uint8_t *cell = block_cell(w, t, b, &j);
        __m512 d[2], mn = _mm512_setzero_ps();
        avx512_block_scales(kind, cell, j, d, &mn);
        int products = 1;
        switch (kind) {
        case KIND_Q4: case KIND_Q4K: case KIND_Q5K: { /* 32 bytes per pair of pairs: low nibbles pair 2g, high pair 2g + 1 */
            const uint8_t *hi, *q = nibbles_of(kind, cell, j, &hi);
            const int bits = high_bits(kind);
            for (int g = 0; g < 8; g++) {
                __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * g)));
                __m512i u0 = avx512_bf16_high(bits, hi, 2 * g, _mm512_and_si512(raw, low));
                __m512i u1 = avx512_bf16_high(bits, hi, 2 * g + 1, _mm512_srli_epi16(raw, 4));
                _mm512_store_si512((void *)(bt[0] + 64 * g), _mm512_or_si512(u0, bias));
                _mm512_store_si512((void *)(bt[0] + 64 * g + 32), _mm512_or_si512(u1, bias));
            }
            mn = _mm512_fmadd_ps(d[0], _mm512_set1_ps(-128.0f), mn);
            break;
        }
        case KIND_Q6K: { /* q = u - 32; pairs 0-7 in bt[0], pairs 8-15 in bt[1] (the rest stays zero) */
            const uint8_t *hi, *q = nibbles_of(kind, cell, j, &hi);
            for (int g = 0; g < 8; g++) {
                __m512i raw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(q + 32 * g)));
                for (int e = 0; e < 2; e++) {
                    int p = 2 * g + e;
                    __m512i u = avx512_bf16_high(2, hi, p, e ? _mm512_srli_epi16(raw, 4) : _mm512_and_si512(raw, low));
                    u = _mm512_sub_epi16(u, _mm512_set1_epi16(32));
                    uint16_t *to = bt[p / 8] + 32 * p;
                    _mm256_store_si256((__m256i *)to, AMX_NAME(bf16_words)(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(u))));
                    _mm256_store_si256((__m256i *)(to + 16), AMX_NAME(bf16_words)(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(u, 1))));
                }
            }
            products = 2;
            break;
        }
        case KIND_Q8: { /* 32 bytes per pair: int8 values, exact in bfloat16 */
            const uint8_t *q = ((const cell_q8 *)cell)->q;
            for (int p = 0; p < 16; p++) {
                _mm256_store_si256((__m256i *)(bt[0] + 32 * p), AMX_NAME(bf16_words)(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p)))));
                _mm256_store_si256((__m256i *)(bt[0] + 32 * p + 16), AMX_NAME(bf16_words)(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 32 * p + 16)))));
            }
            break;
        }
        default: UNKNOWN_KIND();
        }
        T_ZERO(0);
        T_LOAD(1, x + (size_t)m0 * w->K + (size_t)b * QK, (size_t)w->K * 2);
        T_LOAD(2, bt[0], 64);
        T_BF16(0, 1, 2);
        T_STORE(0, c[0], 64);
        if (products == 2) {
            T_ZERO(5);
            T_LOAD(2, bt[1], 64);
            T_BF16(5, 1, 2);
            T_STORE(5, c[1], 64);
        }
        for (int i = 0; i < mt; i++) {
            acc[i] = _mm512_fmadd_ps(_mm512_load_ps(c[0] + 16 * i), d[0], acc[i]);
            if (products == 2) acc[i] = _mm512_fmadd_ps(_mm512_load_ps(c[1] + 16 * i), d[1], acc[i]);
            if (has_minimum(kind)) acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(a->sums[(size_t)(m0 + i) * KB + b]), acc[i]);
        }
    }
    float vals[TILE];
    for (int i = 0; i < mt; i++) {
        _mm512_storeu_ps(vals, acc[i]);
        store_tile(a, m0 + i, t, vals);
    }
}
