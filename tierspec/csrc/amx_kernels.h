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
 * int8 (8 quads of k x 16 outputs), 5 a second C: Q6_K's blocks have a scale per 16 inputs, so their
 * two halves are two products (each B holding one half's values, zeros in the other's places); 6
 * and 7 a second A and B int8, with 1 and 2 as their Cs (a C's shape): the int8 kernel's second set,
 * for the block after the one being scaled.
 *
 * Per (tile, block): the weights' values go into B as the instruction reads them (pairs of k per
 * output for bfloat16, quads for int8: the layouts LAYOUT_BF16 and LAYOUT_INT8 already order them
 * so), 16 rows of x are A, C = A B is the block's dot product of 16 rows x 16 outputs, then each row
 * is scaled into its running sum in float32 exactly as the vector kernels do:
 *   bfloat16: acc += dot * d + (mn - 128 d) * sum x, the dot over (128 + u) for the kinds with a minimum
 *             (as kernels_avx512bf16.c);
 *   int8:     as kernels_vnni.c (tile_int8_rows below),
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
    config.rows[5] = 16, config.colsb[5] = 64;
    config.rows[6] = 16, config.colsb[6] = 32;
    config.rows[7] = 8, config.colsb[7] = 64;
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

/* One block's weights of tile t as the int8 B tile reads them (quad g of k, output r: bytes 64g + 4r
 * .. + 3), into bt (Q6_K: its halves in bt and bt + 512, zeros in the other half's quads), and its
 * scales into d (16 floats; Q6_K's second half's at d + 16) and mn; returns where B is (a Q8 cell's
 * values are B as they are: q + 128 per byte). */
AMX_TARGET static KERNEL_INLINE const uint8_t *AMX_NAME(int8_block)(const packed_weight *w, int t, int b, const int kind, uint8_t *bt,
                                                                    float *d, float *mn) {
    const int KB = w->K / QK, per = cell_blocks(kind), j = b % per;
    const size_t block_bytes = cell_bytes(kind) / per;
    const uint8_t *cell = w->cells + ((size_t)t * (KB / per) + b / per) * cell_bytes(kind);
    const uint8_t *ahead = cell + block_bytes * (j + PREFETCH_CELLS);
    for (size_t line = 0; line < block_bytes; line += 64) _mm_prefetch((const char *)(ahead + line), _MM_HINT_T0);
    __m512 scale[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()}, minimum = _mm512_setzero_ps();
    avx512_block_scales(kind, cell, j, scale, &minimum);
    _mm512_store_ps(d, scale[0]);
    _mm512_store_ps(d + 16, scale[1]);
    _mm512_store_ps(mn, minimum);
    if (kind == KIND_Q8) return ((const cell_q8 *)cell)->q;
    const __m512i low = _mm512_set1_epi8(0x0f);
    const uint8_t *hi, *q = nibbles_of(kind, cell, j, &hi);
    const int bits = high_bits(kind);
    for (int g = 0; g < 8; g++) { /* 32 bytes per quad: values 0..31 low nibbles, 32..63 high */
        __m256i r = _mm256_loadu_si256((const __m256i *)(q + 32 * g));
        __m512i u = _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(r), _mm256_srli_epi16(r, 4), 1), low);
        /* Q6_K: quads 0-3 (its first half) in the first B, 4-7 in the second, zeros in the other's */
        _mm512_store_si512((void *)(bt + (kind == KIND_Q6K ? g / 4 * 512 : 0) + 64 * g), avx512_int8_high(bits, hi, g, u));
        if (kind == KIND_Q6K) _mm512_store_si512((void *)(bt + (1 - g / 4) * 512 + 64 * g), _mm512_setzero_si512());
    }
    return bt;
}

/* A block's products of 16 rows into c (Q6_K: its second half into c + 256), on one of two sets of
 * tiles (tile numbers are constants): the next block's product runs while this one's are scaled. */
#define AMX_INT8_PRODUCT(A, B, C, C2, x, stride, bq, c, halves)                                                \
    do {                                                                                                       \
        T_ZERO(C);                                                                                             \
        T_LOAD(A, x, stride);                                                                                  \
        T_LOAD(B, bq, 64);                                                                                     \
        T_BSUD(C, A, B);                                                                                       \
        T_STORE(C, c, 64);                                                                                     \
        if (halves) {                                                                                          \
            T_ZERO(C2);                                                                                        \
            T_LOAD(B, (bq) + 512, 64);                                                                         \
            T_BSUD(C2, A, B);                                                                                  \
            T_STORE(C2, (c) + 256, 64);                                                                        \
        }                                                                                                      \
    } while (0)

static _Thread_local scratch_t AMX_NAME(int8_scratch);

/* 8-bit rows: ``kind`` is a constant in each copy (AMX_INT8_KIND below). Every block's B of tile t
 * is made first (the nibbles widened by vector stores, which a tile load must wait for: once here,
 * not once a block), then for each 16 rows of the call, block by block: the tile product (the next
 * block's issued before this one's is scaled), then each row's float steps exactly as kernels_vnni.c
 * takes them, in block order: acc += dot * (d * s) (+ mn * (s * sum q) for the kinds with a minimum),
 * a Q8 dot less 128 * sum q, Q6_K's per half less 32 * the half's sum q. Integer dot products are
 * exact in any order, so this gives the VNNI kernel's (and the reference's) bits. */
AMX_TARGET static KERNEL_INLINE void AMX_NAME(tile_int8_rows)(const matmul_args *a, int t, int m0, int mt, const int kind) {
    const packed_weight *w = a->w;
    const int KB = w->K / QK, halves = kind == KIND_Q6K, parts = halves ? 2 : 1;
    const size_t stride = (size_t)w->K, bt_bytes = (size_t)KB * parts * 512, scale_bytes = (size_t)KB * 48 * 4;
    char *mem = scratch_get(&AMX_NAME(int8_scratch), bt_bytes + scale_bytes + (size_t)KB * sizeof(void *));
    uint8_t *bt = (uint8_t *)mem;
    float *scales = (float *)(mem + bt_bytes); /* per block: d (2 x 16), mn (16) */
    const uint8_t **bq = (const uint8_t **)(mem + bt_bytes + scale_bytes);
    for (int b = 0; b < KB; b++)
        bq[b] = AMX_NAME(int8_block)(w, t, b, kind, bt + (size_t)b * parts * 512, scales + 48 * b, scales + 48 * b + 32);
    __attribute__((aligned(64))) int32_t c[2][2 * 256];
    for (int g0 = 0; g0 < mt; g0 += 16) {
        const int rows = mt - g0 < 16 ? mt - g0 : 16, m = m0 + g0;
        const int8_t *x = (const int8_t *)a->x + (size_t)m * w->K;
        __m512 acc[16];
        for (int i = 0; i < 16; i++) acc[i] = _mm512_setzero_ps();
        AMX_INT8_PRODUCT(3, 4, 0, 5, x, stride, bq[0], c[0], halves);
        for (int b = 0; b < KB; b++) {
            const int slot = b & 1;
            if (b + 1 < KB) {
                if (slot) AMX_INT8_PRODUCT(3, 4, 0, 5, x + (size_t)(b + 1) * QK, stride, bq[b + 1], c[0], halves);
                else AMX_INT8_PRODUCT(6, 7, 1, 2, x + (size_t)(b + 1) * QK, stride, bq[b + 1], c[1], halves);
            }
            const int32_t *cs = c[slot];
            const __m512 d[2] = {_mm512_load_ps(scales + 48 * b), _mm512_load_ps(scales + 48 * b + 16)};
            const __m512 mn = _mm512_load_ps(scales + 48 * b + 32);
            for (int i = 0; i < rows; i++)
                acc[i] = avx512_int8_scaled(kind, acc[i], _mm512_load_si512((const void *)(cs + 16 * i)),
                                            _mm512_load_si512((const void *)(cs + 256 * halves + 16 * i)), d, mn, a, (size_t)(m + i) * KB + b,
                                            halves ? a->half_isums + (size_t)(m + i) * (2 * KB) + 2 * b : NULL);
        }
        float vals[TILE];
        for (int i = 0; i < rows; i++) {
            _mm512_storeu_ps(vals, acc[i]);
            store_tile(a, m + i, t, vals);
        }
    }
}
#undef AMX_INT8_PRODUCT

#define AMX_INT8_KIND(kind)                                                                                    \
    AMX_TARGET static void AMX_NAME(tile_int8_##kind)(const matmul_args *a, int t, int m0, int mt) {          \
        AMX_NAME(tile_int8_rows)(a, t, m0, mt, kind);                                                          \
    }
AMX_INT8_KIND(KIND_Q4)
AMX_INT8_KIND(KIND_Q8)
AMX_INT8_KIND(KIND_Q4K)
AMX_INT8_KIND(KIND_Q5K)
AMX_INT8_KIND(KIND_Q6K)
#undef AMX_INT8_KIND

/* The int8 tile kernel of each kind (a kind without one here would trap, never take another's). */
static tile_fn AMX_NAME(tile_int8)(int kind) {
    switch (kind) {
    case KIND_Q4: return AMX_NAME(tile_int8_KIND_Q4);
    case KIND_Q8: return AMX_NAME(tile_int8_KIND_Q8);
    case KIND_Q4K: return AMX_NAME(tile_int8_KIND_Q4K);
    case KIND_Q5K: return AMX_NAME(tile_int8_KIND_Q5K);
    case KIND_Q6K: return AMX_NAME(tile_int8_KIND_Q6K);
    default: UNKNOWN_KIND();
    }
}
