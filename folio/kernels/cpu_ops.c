/* Fused element-wise ops of a Llama layer on the CPU: RMSNorm (with the residual add), SiLU-and-multiply,
 * rotary embedding in place, and the K/V cache write.
 *
 * Why: in a decode step of 64 requests each torch element-wise op on a [64, 576] tensor costs 10-40 us of
 * dispatch and a pass over memory; a layer issued about 30 of them (RMSNorm alone is 8). One C call per fused
 * op, parallel over rows with OpenMP in torch's runtime, does the same work in one pass.
 *
 * Every op exists for float32 (_f32) and bfloat16 (_bf16) tensors. The maths is float32 and, for bfloat16,
 * rounds to bfloat16 (round-to-nearest-even) exactly where torch's unfused ops round, so both paths give the
 * same numbers up to float32 summation order (tests/kernels/test_cpu_ops.py checks against the torch ops).
 * Strides are in elements; the last dim of every tensor is contiguous.
 */
#include "cpu_common.h"

/* Below this many elements a single thread is faster than waking the OpenMP team. */
#define PARALLEL_MIN_ELEMENTS 16384

/* Where a K/V cache row goes: caches addressed by strides (elements)
 *   cache + block * block_stride + kv_head * head_stride + offset * pos_stride
 * (both the position-major and the head-major layout). */
typedef struct {
    int64_t block_size, block_stride, head_stride, pos_stride;
} KVLayout;

static inline float f32_identity(float f) { return f; }
static inline float round_through_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

#define ELEM_T float
#define SUFFIX f32
#define LOAD(x) (x)
#define STORE(f) (f)
#define ROUND(f) f32_identity(f)
#define VLOAD vf_load_f32
#define VSTORE vf_store_f32
#define VROUND vf_round_f32
#include "cpu_ops_impl.h"
#undef ELEM_T
#undef SUFFIX
#undef LOAD
#undef STORE
#undef ROUND
#undef VLOAD
#undef VSTORE
#undef VROUND

#define ELEM_T uint16_t
#define SUFFIX bf16
#define LOAD(x) bf16_to_f32(x)
#define STORE(f) f32_to_bf16(f)
#define ROUND(f) round_through_bf16(f)
#define VLOAD vf_load_bf16
#define VSTORE vf_store_bf16
#define VROUND vf_round_bf16
#include "cpu_ops_impl.h"
#undef ELEM_T
#undef SUFFIX
#undef LOAD
#undef STORE
#undef ROUND
#undef VLOAD
#undef VSTORE
#undef VROUND
