/* The bfloat16 GEMM tile on AMX (the amx tier), included by cpu_gemm.c after its vector tiles: it uses their
 * Epilogue, store16, NextBlock / SidePrefetch and TILE_PREFETCH, and defines tile_bf16_amx, BF16_TILE_M and
 * AMX_FORGET for the driver (cpu_gemm_impl.h). A k pair of a packed block is STEP_BYTES long. */
#if GEMM_AMX
/* The AMX tile: tile registers 0 = A (rows x 32 bfloat16 of x), 1-3 = B (16 k pairs x 16 columns of the packed
 * block, 192 bytes apart), 4-6 = C (rows x 16 float32 sums). tdpbf16ps multiplies bfloat16 pairs exactly and sums
 * in float32 as vdpbf16ps does, 16 x 16 x 32 products per instruction. Each thread configures its tiles on its
 * first AMX tile of a GEMM (the configuration is per thread and others, oneDNN among them, set their own between
 * our calls), and again when a tile has another row count. */
#define AMX_K_STEP 32 /* k per A-tile row: 64 bytes */
typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxTileConfig;

/* gcc's tile intrinsics are asm statements that do not tell the compiler which memory they read or write: a
 * compiler barrier before the loads and after the stores keeps the buffers they use written and read in order. */
#define AMX_MEMORY_BARRIER() __asm__ volatile("" ::: "memory")

static _Thread_local int64_t amx_rows_configured; /* 0: this thread's tile configuration is not ours */
#define AMX_FORGET() (amx_rows_configured = 0)

/* Tiles 0..count-1 of 64 bytes a row: those in b_tiles (a bit mask) 16 k pairs high (B operands), the others
 * `rows` high. `key` names the layout (its row count and kind), so a thread loads it only when another was last. */
static void amx_configure_tiles(int64_t key, int64_t rows, unsigned b_tiles, int count) {
    if (amx_rows_configured == key) return;
    AmxTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < count; ++t) {
        cfg.rows[t] = (uint8_t)((b_tiles >> t) & 1u ? AMX_K_STEP / 2 : rows);
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
    amx_rows_configured = key;
}

static void amx_configure(int64_t rows) { amx_configure_tiles(rows, rows, 0xeu, 7); } /* B: tiles 1-3 */

/* One k step of 32: C[0..2] += A (rows x 32 of x, a_stride bytes apart) . B (the block's 16 k pairs at w) */
static inline __attribute__((always_inline)) void amx_step(const uint16_t *a, int64_t a_stride, const uint16_t *w) {
    _tile_loadd(0, a, a_stride);
    _tile_loadd(1, w, STEP_BYTES);
    _tile_loadd(2, w + 32, STEP_BYTES);
    _tile_loadd(3, w + 64, STEP_BYTES);
    _tile_dpbf16ps(4, 0, 1);
    _tile_dpbf16ps(5, 0, 2);
    _tile_dpbf16ps(6, 0, 3);
}

static void tile_bf16_amx(const uint16_t *x, int64_t lda, const uint16_t *wb, int64_t k, int64_t rows,
                          const Epilogue *e, int64_t row0, int64_t col0, NextBlock nb, SidePrefetch *side) {
    amx_configure(rows);
    AMX_MEMORY_BARRIER();
    SidePrefetch sp = side != NULL ? *side : (SidePrefetch){0};
    const int64_t full = k / AMX_K_STEP;
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    for (int64_t t = 0; t < full; ++t) {
        const uint16_t *w = wb + t * (AMX_K_STEP / 2) * BLOCK_N * 2;
        for (int64_t s = t * (AMX_K_STEP / 2); s < (t + 1) * (AMX_K_STEP / 2); ++s) {
            const uint16_t *ws = wb + s * BLOCK_N * 2;
            TILE_PREFETCH(ws, s)
        }
        amx_step(x + t * AMX_K_STEP, lda * (int64_t)sizeof(uint16_t), w);
    }
    const int64_t rest = k - full * AMX_K_STEP;
    if (rest > 0) { /* the last k < 32: x and the block's last pairs copied beside zeros, so nothing past them is read */
        uint16_t a_tail[AMX_TILE_M * AMX_K_STEP] __attribute__((aligned(64)));
        uint16_t b_tail[AMX_K_STEP / 2 * BLOCK_N * 2] __attribute__((aligned(64)));
        memset(a_tail, 0, sizeof a_tail);
        memset(b_tail, 0, sizeof b_tail);
        for (int64_t i = 0; i < rows; ++i)
            memcpy(a_tail + i * AMX_K_STEP, x + i * lda + full * AMX_K_STEP, sizeof(uint16_t) * rest);
        memcpy(b_tail, wb + full * (AMX_K_STEP / 2) * BLOCK_N * 2, (size_t)((rest + 1) / 2 * STEP_BYTES));
        AMX_MEMORY_BARRIER();
        amx_step(a_tail, AMX_K_STEP * (int64_t)sizeof(uint16_t), b_tail);
    }
    if (side != NULL) *side = sp;
    float c[AMX_TILE_M * BLOCK_N] __attribute__((aligned(64)));
    _tile_stored(4, c, BLOCK_N * (int64_t)sizeof(float));
    _tile_stored(5, c + 16, BLOCK_N * (int64_t)sizeof(float));
    _tile_stored(6, c + 32, BLOCK_N * (int64_t)sizeof(float));
    AMX_MEMORY_BARRIER();
    for (int64_t i = 0; i < rows; ++i)
        for (int j = 0; j < 3; ++j) store16(e, row0 + i, col0 + 16 * j, _mm512_load_ps(c + i * BLOCK_N + 16 * j));
}
#define BF16_TILE_M AMX_TILE_M
#endif /* GEMM_AMX */
