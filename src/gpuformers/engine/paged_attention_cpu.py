"""The CPU decode kernel of paged attention: every decode of an engine step attended in one call per layer, each
row's keys read in place through its block table (no gathered copy, no padding), as the Triton decode kernel does on
a GPU.

    write_kv(key, value (total, kv_heads, head_dim), key_cache, value_cache, slot_mapping)   the step's new rows
    paged_decode_attention(query (nd, heads, head_dim), key_cache, value_cache (slots, kv_heads, head_dim),
                           block_tables (>= nd, max_blocks), context_lens (>= nd,), block_size, scale, out (nd, heads, head_dim))

Why a kernel of its own: torch has no ragged attention on the CPU, so the torch path (engine/paged_attention.py's
`_cpu_decodes`) calls SDPA once per sequence per layer, ~40-70 us each however short the context (its setup and
thread fork dominate): 1.4-1.7 ms per layer for 32 decodes of <= 256 tokens, 30% of a compiled engine step at 100M
parameters, where vLLM's CPU attention kernel takes 0.34 ms (benchmarks/bench_peer.py's workload, profiled). The
keys and values are what must be read (~10 MB per layer there), which this kernel does once, in parallel over
sequences, each block of a sequence's cache (block_size consecutive slots of all kv heads) streamed front to back:
memory order, which the hardware prefetches (a loop per kv head strode through 1 KB rows and ran 4x slower from DRAM).

It is C, built on first use and cached by kernels/cpu_c.py (the machine's C compiler, OpenMP on torch's runtime
and thread count). Without a compiler, or if the build fails, `available()` is False and the engine keeps the SDPA
loop. float32 only; each query head's output is the softmax over its row's keys (GQA: query head h reads kv head
h // (heads / kv_heads)), with online softmax over blocks of keys. Parity with SDPA:
tests/engine/test_paged_attention_cpu.py.

Offers: available, paged_decode_attention, write_kv, LIMITS, SOURCE.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from gpuformers.kernels import cpu_c

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEADS 256

/* One sequence: its heads' query rows against its keys first..len-1, read block by block through its block table,
   each key slot's row (all kv heads, kvh * d floats, contiguous) once and in order, so a block (bs consecutive rows)
   streams from memory front to back; online softmax per query head. q, out: (heads, d) rows of this sequence; kc,
   vc: the layer caches (slots, kvh, d); query head h reads kv head h / rep. acc: (heads, d), scores: (heads, bs). */
static inline __attribute__((always_inline)) void attend_sequence(const float *restrict q, const float *restrict kc, const float *restrict vc,
                            const int64_t *restrict table, int64_t len, int64_t first, int64_t heads, int64_t kvh,
                            int64_t d, int64_t bs, float scale, float *restrict out, float *restrict acc,
                            float *restrict scores, float *restrict m, float *restrict l) {
    const int64_t rep = heads / kvh, row = kvh * d;
    int64_t kv_offset[MAX_HEADS];  /* query head h's kv head within a slot's row, without a division per key */
    for (int64_t h = 0; h < heads; h++) { m[h] = -INFINITY; l[h] = 0.0f; kv_offset[h] = (h / rep) * d; }
    memset(acc, 0, sizeof(float) * heads * d);
    for (int64_t start = first - first % bs; start < len; start += bs) {
        const int64_t lo = start < first ? first - start : 0;
        const int64_t n = (len - start < bs ? len - start : bs);
        const float *restrict kb = kc + table[start / bs] * bs * row;
        const float *restrict vb = vc + table[start / bs] * bs * row;
        for (int64_t t = lo; t < n; t++) {
            const float *restrict krow = kb + t * row;
            for (int64_t h = 0; h < heads; h++) {
                const float *restrict k = krow + kv_offset[h], *restrict qh = q + h * d;
                float dot = 0.0f;
                for (int64_t i = 0; i < d; i++) dot += qh[i] * k[i];
                scores[h * bs + t] = dot * scale;
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            float *restrict s = scores + h * bs;
            float block_max = m[h];
            for (int64_t t = lo; t < n; t++) block_max = s[t] > block_max ? s[t] : block_max;
            float sum = 0.0f;
            for (int64_t t = lo; t < n; t++) { s[t] = expf(s[t] - block_max); sum += s[t]; }
            const float correction = expf(m[h] - block_max);
            float *restrict a = acc + h * d;
            for (int64_t i = 0; i < d; i++) a[i] *= correction;
            l[h] = l[h] * correction + sum;
            m[h] = block_max;
        }
        for (int64_t t = lo; t < n; t++) {
            const float *restrict vrow = vb + t * row;
            for (int64_t h = 0; h < heads; h++) {
                const float p = scores[h * bs + t];
                const float *restrict v = vrow + kv_offset[h];
                float *restrict a = acc + h * d;
                for (int64_t i = 0; i < d; i++) a[i] += p * v[i];
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        const float inv = l[h] > 0.0f ? 1.0f / l[h] : 0.0f;
        for (int64_t i = 0; i < d; i++) out[h * d + i] = acc[h * d + i] * inv;
    }
}

#define ATTEND_WITH(name, D)                                                                                     \
    static void name(const float *q, const float *kc, const float *vc, const int64_t *table, int64_t len,          \
                     int64_t first, int64_t heads, int64_t kvh, int64_t d, int64_t bs, float scale, float *out,     \
                     float *acc, float *scores, float *m, float *l) {                                               \
        attend_sequence(q, kc, vc, table, len, first, heads, kvh, D, bs, scale, out, acc, scores, m, l);         \
    }
ATTEND_WITH(attend_d64, 64)
ATTEND_WITH(attend_d128, 128)
ATTEND_WITH(attend_any, d)

/* q, out: (nd, heads, d) contiguous; kc, vc: (slots, kvh, d) contiguous; block_tables: (>= nd, table_stride) int64;
   lens: (>= nd,) int64, the keys each row sees (this step's included); window: keys at positions >= len - window
   only (0: all). Returns 0, or -1 when a sequence's rows do not fit the per-thread buffers (LIMITS). */
#define MAX_ACC 16384     /* heads * d */
#define MAX_SCORES 16384  /* heads * bs */
int paged_decode_f32(const float *q, const float *kc, const float *vc, const int64_t *block_tables,
                     int64_t table_stride, const int64_t *lens, int64_t nd, int64_t heads, int64_t kvh, int64_t d,
                     int64_t bs, float scale, int64_t window, float *out, int threads) {
    if (heads > MAX_HEADS || heads * d > MAX_ACC || heads * bs > MAX_SCORES || heads % kvh) return -1;
    /* head_dim 64 and 128 (most models) get copies of the loop with d a constant: unrolled, no remainder loops */
    void (*attend)(const float *, const float *, const float *, const int64_t *, int64_t, int64_t, int64_t,
                   int64_t, int64_t, int64_t, float, float *, float *, float *, float *, float *) =
        d == 64 ? attend_d64 : d == 128 ? attend_d128 : attend_any;
    #pragma omp parallel num_threads(threads)
    {
        static __thread float acc[MAX_ACC], scores[MAX_SCORES], m[MAX_HEADS], l[MAX_HEADS];
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < nd; i++) {
            const int64_t len = lens[i];
            const int64_t first = window > 0 && len > window ? len - window : 0;
            attend(q + i * heads * d, kc, vc, block_tables + i * table_stride, len, first, heads, kvh, d, bs, scale,
                   out + i * heads * d, acc, scores, m, l);
        }
    }
    return 0;
}

/* The step's new keys and values into their cache slots: token t's row of kvh * d floats at k + t * k_stride
   (v + t * v_stride: a view into a fused projection's output), slots (total,) each in [0, num_slots) (else -1 and
   nothing written). */
int paged_write_f32(const float *k, const float *v, float *kc, float *vc, const int64_t *slots, int64_t total,
                    int64_t row, int64_t k_stride, int64_t v_stride, int64_t num_slots) {
    for (int64_t t = 0; t < total; t++) if (slots[t] < 0 || slots[t] >= num_slots) return -1;
    for (int64_t t = 0; t < total; t++) {
        memcpy(kc + slots[t] * row, k + t * k_stride, sizeof(float) * row);
        memcpy(vc + slots[t] * row, v + t * v_stride, sizeof(float) * row);
    }
    return 0;
}
"""

@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    """The compiled kernel (kernels/cpu_c.py builds and caches it); None where it cannot be built."""
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    return cpu_c.build("paged_decode", SOURCE, {
        "paged_decode_f32": (ctypes.c_int, [p, p, p, p, i64, p, i64, i64, i64, i64, i64, ctypes.c_float, i64, p,
                                            ctypes.c_int]),
        "paged_write_f32": (ctypes.c_int, [p, p, p, p, p, i64, i64, i64, i64, i64])})


LIMITS = dict(heads=256, heads_times_head_dim=16384, heads_times_block_size=16384)  # per-thread buffers


def available(query: torch.Tensor, key_cache: torch.Tensor, block_size: int) -> bool:
    """Whether the kernel serves a layer's decodes: query (nd, heads, head_dim) and the cache (slots, kv_heads,
    head_dim) float32 on the CPU, the cache contiguous, the shapes within its buffers (LIMITS: query heads, times
    head_dim, times block_size), and the kernel built."""
    if query.device.type != "cpu" or query.dtype != torch.float32 or key_cache.dtype != torch.float32:
        return False
    if query.dim() != 3:
        raise ValueError(f"available() takes the decodes' queries as (decodes, heads, head_dim), not {tuple(query.shape)}")
    heads, head_dim = query.shape[1], key_cache.shape[2]
    fits = (heads <= LIMITS["heads"] and heads * head_dim <= LIMITS["heads_times_head_dim"]
            and heads * block_size <= LIMITS["heads_times_block_size"] and heads % key_cache.shape[1] == 0)
    return fits and key_cache.is_contiguous() and _library() is not None


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int, scale: float,
                           out: torch.Tensor, sliding_window: int | None = None) -> torch.Tensor:
    """query (nd, heads, head_dim); caches (slots, kv_heads, head_dim); block_tables (>= nd, max_blocks) and
    context_lens (>= nd,) int64 (the first nd rows are read); writes out (nd, heads, head_dim), contiguous, and
    returns it. Row i attends to its keys 0..context_lens[i]-1 (the last sliding_window of them when given)."""
    nd, heads, head_dim = query.shape
    kv_heads = key_cache.shape[1]
    query = query.contiguous()
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    assert out.is_contiguous() and out.shape == query.shape and value_cache.is_contiguous()
    assert block_tables.dtype == torch.int64 and context_lens.dtype == torch.int64 and context_lens.is_contiguous()
    status = _library().paged_decode_f32(
        query.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
        block_tables.stride(0), context_lens.data_ptr(), nd, heads, kv_heads, head_dim, block_size, scale,
        sliding_window or 0, out.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise ValueError(f"the CPU paged-attention kernel cannot take {heads} query heads over {kv_heads} kv heads "
                         f"with head_dim {head_dim} and blocks of {block_size} (its limits: {LIMITS}; `available` "
                         f"says so beforehand); set {cpu_c.DISABLE}=0 to use torch's SDPA")
    return out


def write_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> bool:
    """key, value (total, kv_heads, head_dim) into the caches (slots, kv_heads, head_dim) at slot_mapping (total,)
    int64, one row copy each: True, or False (nothing written) where the kernel does not serve these tensors
    (float32 CPU tensors, each token's (kv_heads, head_dim) contiguous, the caches contiguous; the caller's
    index_copy_ runs instead, ~40 us per call against ~5 here, twice per layer and step)."""
    if not (key.dtype == value.dtype == key_cache.dtype == torch.float32 and key.device.type == "cpu"
            and _rows_contiguous(key) and _rows_contiguous(value) and key_cache.is_contiguous()
            and value_cache.is_contiguous() and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()
            and _library() is not None):
        return False
    if key.shape[1:] != key_cache.shape[1:] or value.shape != key.shape or value_cache.shape != key_cache.shape:
        raise ValueError(f"keys {tuple(key.shape)} / values {tuple(value.shape)} do not fit the cache rows "
                         f"{tuple(key_cache.shape[1:])}")
    status = _library().paged_write_f32(key.data_ptr(), value.data_ptr(), key_cache.data_ptr(),
                                        value_cache.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
                                        key.shape[1] * key.shape[2], key.stride(0), value.stride(0),
                                        key_cache.shape[0])
    if status != 0:
        raise IndexError(f"a slot of {slot_mapping.tolist()} is outside the cache's {key_cache.shape[0]} slots")
    return True


def _rows_contiguous(t: torch.Tensor) -> bool:
    """(total, kv_heads, head_dim) whose every token's (kv_heads, head_dim) block is one run of floats."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]
