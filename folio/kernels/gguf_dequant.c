/* GGUF's block quantizations -> float32, the same bits as gguf's numpy and folio/model/gguf_dequant.py's torch ops.
 *
 * Why in C: every engine start dequantizes the whole model, and torch's ops take several passes over the float32
 * output (widen, multiply, add): ~4 ns a weight on one core, a third of loading SmolLM2. One pass here writes each
 * value once. The arithmetic is gguf's: the float16 step (and offset) widened exactly, then d * q and + m as two
 * float32 roundings (Q4_1), never a fused multiply-add.
 * Blocks of 32 weights: Q4_0 (18 bytes) d | 16 bytes of nibbles, value (q - 8) * d; Q4_1 (20 bytes) d | m | nibbles,
 * value q * d + m; byte j holds element j in its low nibble and element j + 16 in its high one. Q8_0 (34 bytes)
 * d | 32 int8 q, value q * d. */

static inline float dequant_f16_to_f32(const uint8_t *p) { /* exact, on every tier (no F16C needed) */
    const uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    const uint32_t sign = (h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13); /* inf, NaN */
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else {
        const float subnormal = (float)mantissa * 5.9604644775390625e-08f; /* mantissa * 2^-24, exact */
        memcpy(&bits, &subnormal, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

#define DEQUANT_BLOCK 32
#define DEQUANT_PARALLEL_BLOCKS 4096 /* smaller tensors (norms, small models) in one thread */

/* One Q4_1 block's 32 values fl(fl(d q) + m), a vector at a time where the tier has vectors. */
static void dequant_q4_1_block(const uint8_t *block, float *out) {
    const float d = dequant_f16_to_f32(block), m = dequant_f16_to_f32(block + 2);
    const uint8_t *qs = block + 4;
#if GEMM_VEC_BITS > 0 /* codes4_widen_block's widening (gemm_codes4.h), from the block's 16 bytes */
    const gv_f32 dv = gv_set1(d), mv = gv_set1(m);
    for (int j = 0; j < DEQUANT_BLOCK / 2 / GV_LANES; ++j) {
        const gv_i32 bytes = CODES4_BYTES(qs, j);
        gv_f32 lo = gv_mul(CODES4_LOW(bytes), dv), hi = gv_mul(CODES4_HIGH(bytes), dv);
        gv_no_fma(lo); /* two roundings: no fused multiply-add */
        gv_no_fma(hi);
        gv_storeu(out + GV_LANES * j, gv_add(lo, mv));
        gv_storeu(out + DEQUANT_BLOCK / 2 + GV_LANES * j, gv_add(hi, mv));
    }
#else
    for (int j = 0; j < DEQUANT_BLOCK / 2; ++j) {
        out[j] = codes4_value(d, qs[j] & 15, m);
        out[j + 16] = codes4_value(d, qs[j] >> 4, m);
    }
#endif
}

/* Q4_0 and Q8_0 are one rounding each (q * d): plain loops, which the compiler vectorizes. */
static void dequant_q4_0_block(const uint8_t *block, float *out) {
    const float d = dequant_f16_to_f32(block);
    const uint8_t *qs = block + 2;
    for (int j = 0; j < DEQUANT_BLOCK / 2; ++j) {
        out[j] = (float)((int)(qs[j] & 15) - 8) * d;
        out[j + 16] = (float)((int)(qs[j] >> 4) - 8) * d;
    }
}

static void dequant_q8_0_block(const uint8_t *block, float *out) {
    const float d = dequant_f16_to_f32(block);
    const int8_t *qs = (const int8_t *)(block + 2);
    for (int j = 0; j < DEQUANT_BLOCK; ++j) out[j] = (float)qs[j] * d;
}

/* kind: 0 Q4_0, 1 Q4_1, 2 Q8_0. Writes num_blocks * 32 float32 values to out; returns 0, or -1 for another kind. */
int folio_dequantize_blocks(const uint8_t *blocks, int64_t num_blocks, int kind, float *out) {
    static const int64_t block_bytes[3] = {18, 20, 34};
    static void (*const dequant_block[3])(const uint8_t *, float *) = {dequant_q4_0_block, dequant_q4_1_block,
                                                                        dequant_q8_0_block};
    if (kind < 0 || kind > 2) return -1;
    const int64_t stride = block_bytes[kind];
    void (*const body)(const uint8_t *, float *) = dequant_block[kind];
#pragma omp parallel for schedule(static) if (num_blocks >= DEQUANT_PARALLEL_BLOCKS)
    for (int64_t i = 0; i < num_blocks; ++i) body(blocks + i * stride, out + i * DEQUANT_BLOCK);
    return 0;
}
