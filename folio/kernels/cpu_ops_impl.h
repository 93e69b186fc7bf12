/* The fused ops for one element type, included once per type by cpu_ops.c with
 *   ELEM_T  the element type     SUFFIX  the name suffix (f32, bf16)
 *   LOAD    element -> float     STORE   float -> element (rounded)     ROUND  float -> float at ELEM_T precision */

/* out[t] = weight * round(s[t] / sqrt(mean(s[t]^2) + eps)) with s = x, or with a residual
 * s = round(x + residual), which is also stored to residual_out (vLLM's fused_add_rms_norm).
 * x [T, H] (row stride x_stride), residual / residual_out / out [T, H] contiguous; residual may be NULL. */
void CAT(folio_rms_norm_, SUFFIX)(const ELEM_T *x, int64_t x_stride, const ELEM_T *residual, const ELEM_T *weight,
                                  ELEM_T *out, ELEM_T *residual_out, int64_t num_rows, int64_t hidden, float eps,
                                  int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_rows * hidden >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_rows; ++t) {
        const ELEM_T *xr = x + t * x_stride;
        const ELEM_T *src = xr;
        float sum_sq = 0.0f;
        if (residual != NULL) {
            const ELEM_T *rr = residual + t * hidden;
            ELEM_T *ro = residual_out + t * hidden;
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t j = 0; j < hidden; ++j) {
                const float s = ROUND(LOAD(xr[j]) + LOAD(rr[j]));
                ro[j] = STORE(s);
                sum_sq += s * s;
            }
            src = ro;
        } else {
#pragma omp simd reduction(+ : sum_sq)
            for (int64_t j = 0; j < hidden; ++j) {
                const float s = LOAD(xr[j]);
                sum_sq += s * s;
            }
        }
        const float inv_rms = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
        ELEM_T *o = out + t * hidden;
#pragma omp simd
        for (int64_t j = 0; j < hidden; ++j) o[j] = STORE(LOAD(weight[j]) * ROUND(LOAD(src[j]) * inv_rms));
    }
}

/* gate_up [T, 2I] (row stride gu_stride; gate first) -> out [T, I] = round(silu(gate)) * up. */
void CAT(folio_silu_and_mul_, SUFFIX)(const ELEM_T *gate_up, int64_t gu_stride, ELEM_T *out, int64_t num_rows,
                                      int64_t inter, int num_threads) {
#pragma omp parallel for num_threads(num_threads) if (num_rows * inter >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_rows; ++t) {
        const ELEM_T *g = gate_up + t * gu_stride;
        const ELEM_T *u = g + inter;
        ELEM_T *o = out + t * inter;
#pragma omp simd
        for (int64_t j = 0; j < inter; ++j) {
            const float gf = LOAD(g[j]);
            o[j] = STORE(ROUND(gf / (1.0f + expf(-gf))) * LOAD(u[j]));
        }
    }
}

/* In place, Hugging Face's half-split rotary: for each of the first num_heads heads of row t,
 *   x[i] <- x[i] * cos[t, i] - x[i + D/2] * sin[t, i],  x[i + D/2] <- x[i + D/2] * cos[t, i + D/2] + x[i] * sin[t, i + D/2]
 * with each product rounded as torch's x * cos + rotate_half(x) * sin rounds it.
 * x: head h of row t at x + t * row_stride + h * head_dim; cos / sin [T, head_dim] contiguous. */
void CAT(folio_rotary_, SUFFIX)(ELEM_T *x, int64_t row_stride, const ELEM_T *cos, const ELEM_T *sin,
                                int64_t num_rows, int64_t num_heads, int64_t head_dim, int num_threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for num_threads(num_threads) if (num_rows * num_heads * head_dim >= PARALLEL_MIN_ELEMENTS)
    for (int64_t t = 0; t < num_rows; ++t) {
        const ELEM_T *c = cos + t * head_dim;
        const ELEM_T *s = sin + t * head_dim;
        for (int64_t h = 0; h < num_heads; ++h) {
            ELEM_T *xh = x + t * row_stride + h * head_dim;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float x1 = LOAD(xh[i]), x2 = LOAD(xh[i + half]);
                xh[i] = STORE(ROUND(x1 * LOAD(c[i])) + ROUND(-x2 * LOAD(s[i])));
                xh[i + half] = STORE(ROUND(x2 * LOAD(c[i + half])) + ROUND(x1 * LOAD(s[i + half])));
            }
        }
    }
}

/* The K/V cache write: row t of key / value ([num_kv_heads, head_dim], heads packed) goes to slot slots[t],
 * i.e. block slots[t] / block_size at offset slots[t] % block_size, of caches addressed by strides (elements)
 *   cache + block * block_stride + kv_head * head_stride + offset * pos_stride
 * (both the position-major and the head-major layout). A negative slot (padding) is skipped. */
void CAT(folio_write_kv_, SUFFIX)(const ELEM_T *key, int64_t key_stride, const ELEM_T *value, int64_t value_stride,
                                  ELEM_T *key_cache, ELEM_T *value_cache, const int64_t *slots, int64_t num_rows,
                                  int64_t block_size, int64_t block_stride, int64_t head_stride, int64_t pos_stride,
                                  int64_t num_kv_heads, int64_t head_dim) {
    for (int64_t t = 0; t < num_rows; ++t) {
        if (slots[t] < 0) continue;
        const int64_t base = (slots[t] / block_size) * block_stride + (slots[t] % block_size) * pos_stride;
        for (int64_t h = 0; h < num_kv_heads; ++h) {
            const int64_t dst = base + h * head_stride;
            memcpy(key_cache + dst, key + t * key_stride + h * head_dim, sizeof(ELEM_T) * head_dim);
            memcpy(value_cache + dst, value + t * value_stride + h * head_dim, sizeof(ELEM_T) * head_dim);
        }
    }
}
