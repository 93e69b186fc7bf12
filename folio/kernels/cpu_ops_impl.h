/* The fused ops for one element type, included once per type by cpu_ops.c with
 *   ELEM_T  the element type     SUFFIX  the name suffix (f32, bf16)
 *   LOAD    element -> float     STORE   float -> element (rounded)     ROUND  float -> float at ELEM_T precision
 *
 * Each op has a body (an orphaned `omp for`: it shares its rows among the threads of the enclosing parallel
 * region, or runs them all when called outside one) that the fused decoder (llama_cpu.c) calls inside its single
 * region, and an exported folio_<op>_<suffix> that opens a region of its own for the Python layers. */

/* out[t] = weight * round(s[t] / sqrt(mean(s[t]^2) + eps)) with s = x, or with a residual
 * s = round(x + residual), which is also stored to residual_out (vLLM's fused_add_rms_norm).
 * x [T, H] (row stride x_stride), residual / residual_out / out [T, H] contiguous; residual may be NULL. */
static void CAT(rms_norm_body_, SUFFIX)(const ELEM_T *x, int64_t x_stride, const ELEM_T *residual,
                                        const ELEM_T *weight, ELEM_T *out, ELEM_T *residual_out, int64_t num_rows,
                                        int64_t hidden, float eps) {
#pragma omp for
    for (int64_t t = 0; t < num_rows; ++t) {
        const ELEM_T *xr = x + t * x_stride;
        const ELEM_T *rr = residual != NULL ? residual + t * hidden : NULL;
        ELEM_T *ro = residual != NULL ? residual_out + t * hidden : NULL;
        const ELEM_T *src = residual != NULL ? ro : xr;
        float sum_sq = 0.0f;
        int64_t j = 0;
#ifdef VF_WIDTH
        /* a vector at a time (cpu_common.h's vf32: 16 lanes with AVX-512, 8 with AVX2), two sums: gcc's `omp simd
         * reduction` of this loop kept its partial sums in a stack array and ran 2.3x slower (13.3 against 5.7 us
         * for 64 x 576 bf16 rows, one thread, AVX-512) */
        vf32 sum0 = vf_zero(), sum1 = vf_zero();
        for (; j + 2 * VF_WIDTH <= hidden; j += 2 * VF_WIDTH) {
            vf32 s0 = VLOAD(xr + j), s1 = VLOAD(xr + j + VF_WIDTH);
            if (rr != NULL) {
                s0 = VROUND(vf_add(s0, VLOAD(rr + j)));
                s1 = VROUND(vf_add(s1, VLOAD(rr + j + VF_WIDTH)));
                VSTORE(ro + j, s0);
                VSTORE(ro + j + VF_WIDTH, s1);
            }
            sum0 = vf_fmadd(s0, s0, sum0);
            sum1 = vf_fmadd(s1, s1, sum1);
        }
        sum_sq = vf_reduce_add(vf_add(sum0, sum1));
#endif
        for (; j < hidden; ++j) {
            float v = LOAD(xr[j]);
            if (rr != NULL) {
                v = ROUND(v + LOAD(rr[j]));
                ro[j] = STORE(v);
            }
            sum_sq += v * v;
        }
        const float inv_rms = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
        ELEM_T *o = out + t * hidden;
        j = 0;
#ifdef VF_WIDTH
        const vf32 inv = vf_set1(inv_rms);
        for (; j + VF_WIDTH <= hidden; j += VF_WIDTH)
            VSTORE(o + j, vf_mul(VLOAD(weight + j), VROUND(vf_mul(VLOAD(src + j), inv))));
#endif
        for (; j < hidden; ++j) o[j] = STORE(LOAD(weight[j]) * ROUND(LOAD(src[j]) * inv_rms));
    }
}

void CAT(folio_rms_norm_, SUFFIX)(const ELEM_T *x, int64_t x_stride, const ELEM_T *residual, const ELEM_T *weight,
                                  ELEM_T *out, ELEM_T *residual_out, int64_t num_rows, int64_t hidden, float eps,
                                  int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_rows * hidden >= PARALLEL_MIN_ELEMENTS)
    CAT(rms_norm_body_, SUFFIX)(x, x_stride, residual, weight, out, residual_out, num_rows, hidden, eps);
}

/* gate_up [T, 2I] (row stride gu_stride; gate first) -> out [T, I] = round(silu(gate)) * up. */
static void CAT(silu_and_mul_body_, SUFFIX)(const ELEM_T *gate_up, int64_t gu_stride, ELEM_T *out,
                                            int64_t num_rows, int64_t inter) {
#pragma omp for
    for (int64_t t = 0; t < num_rows; ++t) {
        const ELEM_T *g = gate_up + t * gu_stride;
        const ELEM_T *u = g + inter;
        ELEM_T *o = out + t * inter;
        int64_t j = 0;
#ifdef VF_WIDTH
        /* a vector at a time: the scalar loop's expf call does not vectorize with bfloat16 rounding around it (it
         * cost 12% of a decode step) */
        for (; j + VF_WIDTH <= inter; j += VF_WIDTH) VSTORE(o + j, vf_mul(VROUND(vf_silu(VLOAD(g + j))), VLOAD(u + j)));
#endif
        for (; j < inter; ++j) o[j] = STORE(ROUND(silu_f32(LOAD(g[j]))) * LOAD(u[j]));
    }
}

void CAT(folio_silu_and_mul_, SUFFIX)(const ELEM_T *gate_up, int64_t gu_stride, ELEM_T *out, int64_t num_rows,
                                      int64_t inter, int num_threads) {
#pragma omp parallel num_threads(num_threads) if (num_rows * inter >= PARALLEL_MIN_ELEMENTS)
    CAT(silu_and_mul_body_, SUFFIX)(gate_up, gu_stride, out, num_rows, inter);
}

/* In place, Hugging Face's half-split rotary on the num_heads heads of one row:
 *   x[i] <- x[i] * cos[i] - x[i + D/2] * sin[i],  x[i + D/2] <- x[i + D/2] * cos[i + D/2] + x[i] * sin[i + D/2]
 * with each product rounded as torch's x * cos + rotate_half(x) * sin rounds it. x: head h at x + h * head_dim;
 * cos / sin: the row's [head_dim]. */
static inline void CAT(rotary_row_, SUFFIX)(ELEM_T *x, const ELEM_T *c, const ELEM_T *s, int64_t num_heads,
                                            int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < num_heads; ++h) {
        ELEM_T *xh = x + h * head_dim;
        int64_t i = 0;
#ifdef VF_WIDTH
        /* a vector at a time, as rms_norm_body_: W1 bf16 rotary + K/V write phases 0.052 -> 0.034 s against gcc's
         * `omp simd` version of the loop below (AVX-512, docs/performance.md, session 7) */
        for (; i + VF_WIDTH <= half; i += VF_WIDTH) {
            const vf32 x1 = VLOAD(xh + i), x2 = VLOAD(xh + i + half);
            /* round(-x2 * s) = -round(x2 * s), and a + (-b) = a - b exactly */
            const vf32 lo = vf_sub(VROUND(vf_mul(x1, VLOAD(c + i))), VROUND(vf_mul(x2, VLOAD(s + i))));
            const vf32 hi = vf_add(VROUND(vf_mul(x2, VLOAD(c + i + half))), VROUND(vf_mul(x1, VLOAD(s + i + half))));
            VSTORE(xh + i, lo);
            VSTORE(xh + i + half, hi);
        }
#endif
        for (; i < half; ++i) {
            const float x1 = LOAD(xh[i]), x2 = LOAD(xh[i + half]);
            xh[i] = STORE(ROUND(x1 * LOAD(c[i])) + ROUND(-x2 * LOAD(s[i])));
            xh[i + half] = STORE(ROUND(x2 * LOAD(c[i + half])) + ROUND(x1 * LOAD(s[i + half])));
        }
    }
}

/* The rotary on every row t: x + t * row_stride; cos / sin [T, head_dim] contiguous. */
void CAT(folio_rotary_, SUFFIX)(ELEM_T *x, int64_t row_stride, const ELEM_T *cos, const ELEM_T *sin,
                                int64_t num_rows, int64_t num_heads, int64_t head_dim, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_rows * num_heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_rows; ++t)
        CAT(rotary_row_, SUFFIX)(x + t * row_stride, cos + t * head_dim, sin + t * head_dim, num_heads, head_dim);
}

/* Row t's key / value ([num_kv_heads, head_dim], heads packed) into slot `slot` (block slot / block_size, offset
 * slot % block_size). A negative slot (padding) is skipped. */
static inline void CAT(write_kv_row_, SUFFIX)(const ELEM_T *key, const ELEM_T *value, ELEM_T *key_cache,
                                              ELEM_T *value_cache, int64_t slot, const KVLayout *kv,
                                              int64_t num_kv_heads, int64_t head_dim) {
    if (slot < 0) return;
    const int64_t base = (slot / kv->block_size) * kv->block_stride + (slot % kv->block_size) * kv->pos_stride;
    for (int64_t h = 0; h < num_kv_heads; ++h) {
        const int64_t dst = base + h * kv->head_stride;
        memcpy(key_cache + dst, key + h * head_dim, sizeof(ELEM_T) * head_dim);
        memcpy(value_cache + dst, value + h * head_dim, sizeof(ELEM_T) * head_dim);
    }
}

/* The K/V cache write of every row t: key + t * key_stride, value + t * value_stride into slots[t]. */
void CAT(folio_write_kv_, SUFFIX)(const ELEM_T *key, int64_t key_stride, const ELEM_T *value, int64_t value_stride,
                                  ELEM_T *key_cache, ELEM_T *value_cache, const int64_t *slots, int64_t num_rows,
                                  int64_t block_size, int64_t block_stride, int64_t head_stride, int64_t pos_stride,
                                  int64_t num_kv_heads, int64_t head_dim) {
    const KVLayout kv = {block_size, block_stride, head_stride, pos_stride};
    for (int64_t t = 0; t < num_rows; ++t)
        CAT(write_kv_row_, SUFFIX)(key + t * key_stride, value + t * value_stride, key_cache, value_cache, slots[t],
                                   &kv, num_kv_heads, head_dim);
}

/* For the fused decoder: per row of a fused q|k|v output [T, (H + 2 KV) D] (row stride qkv_stride), the rotary
 * on its q and k heads, then k and v into the cache at slots[t]. */
static void CAT(rope_and_cache_body_, SUFFIX)(ELEM_T *qkv, int64_t qkv_stride, const ELEM_T *cos, const ELEM_T *sin,
                                              ELEM_T *key_cache, ELEM_T *value_cache, const int64_t *slots,
                                              const KVLayout *kv, int64_t num_rows, int64_t num_heads,
                                              int64_t num_kv_heads, int64_t head_dim) {
#pragma omp for
    for (int64_t t = 0; t < num_rows; ++t) {
        ELEM_T *q = qkv + t * qkv_stride, *k = q + num_heads * head_dim, *v = k + num_kv_heads * head_dim;
        CAT(rotary_row_, SUFFIX)(q, cos + t * head_dim, sin + t * head_dim, num_heads + num_kv_heads, head_dim);
        CAT(write_kv_row_, SUFFIX)(k, v, key_cache, value_cache, slots[t], kv, num_kv_heads, head_dim);
    }
}
