/* Every CPU kernel of Folio, compiled as one translation unit (one shared library, built on first use by
 * folio/kernels/cpu_build.py): the fused decoder (llama_cpu.c) runs the other kernels' bodies inside a single
 * OpenMP region, so they must be visible to it, and their shared helpers (cpu_common.h) exist once. */
#include "cpu_common.h"

#include "cpu_ops.c"
#include "cpu_gemm.c"
#include "paged_attention_cpu.c"
#include "llama_cpu.c"
