/* Every CPU kernel of Folio, compiled as one translation unit (one shared library, built on first use by
 * folio/kernels/cpu_build.py): the fused decoder (llama_cpu.c) runs the other kernels' bodies inside a single
 * OpenMP region, so they must be visible to it, and their shared helpers (cpu_common.h) exist once. */
#include "cpu_common.h"

#include "cpu_ops.c"
#include "cpu_gemm.c"
#include "paged_attention_cpu.c"
#include "llama_cpu.c"
#include "kv_block_copy.c"
#include "gguf_dequant.c" /* after cpu_gemm.c: codes4_value */

/* The ISA tier this library was compiled for (folio/kernels/isa.py's IsaTier): decided by what the compiler was
 * allowed to emit, never by the CPU it runs on. 0 generic, 1 AVX2 + FMA + F16C, 2 AVX-512 (F/BW/DQ/VL),
 * 3 AVX-512 with AVX512-BF16, 4 that and AMX (tiles, bfloat16). */
int folio_isa_tier(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#if GEMM_AMX /* implies AVX512-BF16 */
    return 4;
#elif defined(__AVX512BF16__)
    return 3;
#else
    return 2;
#endif
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}
