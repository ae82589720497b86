/* A pool of spinning workers that share one product's output rows with the caller, and weights bound
 * once to the kernels (moespec/kernels/spin.py is the Python side).
 *
 * Shapes: T tokens, R rows (output features), C columns (input features), g group size, G groups.
 *
 * Why: the Python row pool (kernels/row_pool.py) wakes a sleeping thread for every split product,
 * ~50 us on this VM, more than a 1-5 MB GEMV gains from a second core. Here N workers spin on one
 * atomic ticket for SPIN_NS after their last chunk (a decode step's products come tens of us apart,
 * so during a step they never sleep), then sleep on a condition variable (an idle model costs no
 * core). A product is cut into chunks of rows (multiples of 8: every kernel's row block divides 8,
 * so a row's value does not depend on its chunk and a split product is bit-equal to the serial one);
 * the caller and the workers claim chunks from the ticket until none is left.
 *
 * The ticket is one 64-bit atomic: high 32 bits the job's generation, low 32 bits the next chunk. A
 * worker claims a chunk by compare-and-swap under the generation it read, so a worker late from the
 * previous job can never claim a chunk of the next one with the old job's pointers.
 *
 * Bound weights (bound_t): kind, data/scales/zeros pointers and sizes, made once per weight, so a
 * call passes one pointer instead of ten arguments built in Python.
 */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <time.h>

#include "avx512.h"

#define SPIN_NS 2000000L /* 2 ms of spinning after the last chunk, then sleep */
/* A chunk reads at least this many weight bytes (at least 8 rows); MOESPEC_SPIN_CHUNK_BYTES, read when
 * a pool starts, overrides it (benchmarks A/B it). 64 KB, not 16: since the float32 kernel reads one
 * sequential stream, small chunks cut it into pieces the prefetcher retrains on; measured (one
 * hold, decode_floor.py, 2 threads / 1 thread float32 all resident): 16 KB 0.95x, 64 KB 1.02x,
 * 256 KB 1.04x (16 KB also 0.93x, 0.93x in two earlier holds). */
#define CHUNK_MIN_BYTES 65536
/* Spinners yield the core every YIELD_NS: on a machine with more runnable threads than cores (another
 * model's pool still spinning, a host-pool worker, another process) a pure spin would hold a core
 * that the thread it waits for needs; measured on this 2-core VM with three models' pools in one
 * process, two threads decoded at 0.50x one thread before the yields. */
#define YIELD_NS 20000L
/* Products of fewer weight bytes than this are not split (spin_pool_set_split_min_bytes sets it;
 * kernels/spin.SPLIT_MIN_BYTES is the plan's). 0: every product of two chunks or more is split. */
#define SPLIT_MIN_BYTES 0
/* Read-ahead: while the caller runs the Python between two products (norms, attention, routing:
 * tens of us), an idle worker reads the next product's weight (the one that followed this one last
 * time: kernels/spin.py keeps that chain) into the caches, so the product reads it from L3 instead
 * of memory. A layer's dense weights (~13 MB on the default model) fit the 32 MB L3 here; a weight
 * bigger than PF_MAX_BYTES is read ahead only that far (lm_head: its first rows, which the split
 * claims first). The worker reads one word per cache line (real loads: prefetcht1 hints measured no
 * faster than none, a 2.2 MB product after them 107 us against 96 cold, while loads on the other
 * core brought it to 55, 46 when warm on the same core). Loads may fault on freed memory, so the
 * ranges' tensors are kept alive by kernels/spin.py while they may be read, and spin_quiet (the
 * end of every thread-plan step) returns only when no worker reads ahead any more. */
#define PF_RANGES 3
#define PF_MAX_BYTES (8L << 20)
#define PF_PIECE 4096L /* bytes read ahead between two looks at the ticket */

typedef struct {
    int kind;
    const void* w;
    const uint16_t* scales;
    const uint8_t* zeros;
    i64 R, C, g;
    i64 row_bytes; /* weight bytes per row (codes + scales + zeros) */
} bound_t;

/* A layer's decode experts as one job (spin_experts): chunk i is expert i, expert_swiglu's computation
 * on the row at base + rows[i] * stride, output y + i * T * H. */
typedef struct {
    int kind, a8, bf16_act;
    const float* x;
    i64 T;
    const uint8_t* base;
    i64 stride;
    const i64* rows;
    i64 ow1, os1, oz1, ow2, os2, oz2, H, I, g;
    float* y;
} experts_t;

typedef struct {
    const experts_t* ex; /* NULL: a product of the bound weight b */
    const bound_t* b;
    const float* x;
    const float* xs;
    float* y;
    i64 T, ldy, row0, chunk_rows, nchunks;
} job_t;

typedef struct {
    int n;
    pthread_t* th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    _Atomic uint64_t ticket; /* gen << 32 | next chunk */
    _Atomic int64_t done;    /* chunks finished in this generation */
    _Atomic int sleepers;
    _Atomic int stop;
    _Atomic int rc;
    i64 chunk_bytes;
    i64 split_min_bytes; /* products of fewer weight bytes run on the caller alone */
    job_t job;
    /* The read-ahead request (spin_linear's pf_* arguments): up to PF_RANGES byte ranges the
     * workers read into the caches while the caller runs on. pf_seq is bumped after the ranges are
     * written; a worker that sees it change drops what it was reading and takes the new ranges
     * (a range torn by a concurrent write only costs a few useless prefetches: see read_ahead). */
    _Atomic uint64_t pf_seq;
    _Atomic int reading; /* workers inside read_ahead (spin_quiet waits for 0) */
    const char* pf_ptr[PF_RANGES];
    i64 pf_len[PF_RANGES];
} pool_t;

static i64 now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (i64)ts.tv_sec * 1000000000L + ts.tv_nsec;
}

void* spin_bind(int kind, const void* w, const uint16_t* scales, const uint8_t* zeros, i64 R, i64 C, i64 g) {
    bound_t* b = (bound_t*)malloc(sizeof(bound_t));
    if (!b) return NULL;
    b->kind = kind, b->w = w, b->scales = scales, b->zeros = zeros, b->R = R, b->C = C, b->g = g;
    const i64 G = g > 0 ? (C + g - 1) / g : 0;
    b->row_bytes = kind == KIND_F32 ? 4 * C : kind == KIND_BF16 ? 2 * C : (kind == KIND_Q8 ? C : C / 2) + 3 * G;
    return b;
}

void spin_unbind(void* b) { free(b); }

/* Rows [r0, r1) of one product of a bound weight (a dense linear): one token of int8 rows on
 * AVX-512 by avx512_dense.c's kernel (equal to linear_f32act's within float32 rounding), all else
 * by linear_f32act. */
static int bound_rows(const bound_t* b, const float* x, i64 T, const float* xs, float* y, i64 ldy, i64 r0,
                      i64 r1) {
    if (T == 1 && isa512_on() &&
        dense_t1_avx512(b->kind, x, xs, b->w, b->scales, b->zeros, b->C, b->g, y, r0, r1) == 0)
        return 0;
    return linear_f32act(b->kind, x, T, b->C, b->w, b->scales, b->zeros, xs, b->C, b->g, y, ldy, r0, r1);
}

/* Run chunks of the job of generation ``gen`` until none is left. */
static void work(pool_t* p, uint64_t gen) {
    const job_t* j = &p->job;
    for (;;) {
        uint64_t t = atomic_load(&p->ticket);
        if ((t >> 32) != gen) return;
        const i64 i = (i64)(t & 0xffffffffu);
        if (i >= j->nchunks) return;
        if (!atomic_compare_exchange_weak(&p->ticket, &t, t + 1)) continue;
        if (j->ex) {
            const experts_t* e = j->ex;
            int rc = expert_swiglu(e->kind, e->a8, e->bf16_act, e->x, e->T, e->base + e->rows[i] * e->stride,
                                   e->ow1, e->os1, e->oz1, e->ow2, e->os2, e->oz2, e->H, e->I, e->g,
                                   e->y + i * e->T * e->H);
            if (rc) atomic_store(&p->rc, rc);
            atomic_fetch_add(&p->done, 1);
            continue;
        }
        const bound_t* b = j->b;
        const i64 r0 = j->row0 + i * j->chunk_rows;
        const i64 r1 = r0 + j->chunk_rows < j->row0 + b->R ? r0 + j->chunk_rows : b->R;
        int rc = bound_rows(b, j->x, j->T, j->xs, j->y, j->ldy, r0, r1);
        if (rc) atomic_store(&p->rc, rc);
        atomic_fetch_add(&p->done, 1);
    }
}

/* The read-ahead a worker is doing: the ranges it took at pf_seq ``seq``, how far it got. */
typedef struct {
    uint64_t seq;
    const char* at[PF_RANGES];
    i64 left[PF_RANGES];
} ahead_t;

/* Take the pool's current read-ahead request (pf_seq read first: a later bump makes the worker
 * look again, so ranges written after this read are never missed for long). */
static void take_ahead(pool_t* p, ahead_t* a) {
    a->seq = atomic_load(&p->pf_seq);
    for (int r = 0; r < PF_RANGES; r++) {
        const i64 n = p->pf_len[r];
        a->at[r] = p->pf_ptr[r];
        a->left[r] = n < 0 ? 0 : n > PF_MAX_BYTES ? PF_MAX_BYTES : n;
    }
}

/* Prefetch the read-ahead ranges piece by piece until done, a job is posted (generation != gen),
 * a newer request comes or the pool stops. Returns 1 when the ranges are done. */
static volatile uint64_t sink; /* keeps the read-ahead's loads */

static int read_ahead(pool_t* p, ahead_t* a, uint64_t gen) {
    int done = 1;
    uint64_t acc = 0;
    atomic_fetch_add(&p->reading, 1); /* seq_cst, before the first look at pf_seq: spin_quiet's pairing */
    for (int r = 0; r < PF_RANGES && done; r++) {
        while (a->left[r] > 0) {
            if ((atomic_load(&p->ticket) >> 32) != gen || atomic_load(&p->pf_seq) != a->seq || atomic_load(&p->stop)) {
                done = 0;
                break;
            }
            const i64 n = a->left[r] < PF_PIECE ? a->left[r] : PF_PIECE;
            for (i64 o = 0; o + 8 <= n; o += 64) acc ^= *(const uint64_t*)(a->at[r] + o);
            a->at[r] += n, a->left[r] -= n;
        }
    }
    sink = acc;
    atomic_fetch_sub(&p->reading, 1);
    return done;
}

static void* worker(void* arg) {
    pool_t* p = (pool_t*)arg;
    uint64_t seen = atomic_load(&p->ticket) >> 32;
    ahead_t ahead;
    take_ahead(p, &ahead);
    for (int r = 0; r < PF_RANGES; r++) ahead.left[r] = 0; /* nothing asked yet */
    while (!atomic_load(&p->stop)) {
        /* a read-ahead asked or left unfinished by a job: read it (a job or a newer request stops it) */
        if (atomic_load(&p->pf_seq) != ahead.seq) take_ahead(p, &ahead);
        read_ahead(p, &ahead, seen);
        const i64 start = now_ns(), until = start + SPIN_NS;
        i64 next_yield = start + YIELD_NS;
        uint64_t gen = seen;
        for (int k = 0; (gen = atomic_load(&p->ticket) >> 32) == seen && atomic_load(&p->pf_seq) == ahead.seq &&
                        !atomic_load(&p->stop);
             k++) {
            _mm_pause();
            if ((k & 63) == 63) {
                const i64 t = now_ns();
                if (t > until) break;
                if (t > next_yield) {
                    sched_yield();
                    next_yield = t + YIELD_NS;
                }
            }
        }
        if (gen == seen && atomic_load(&p->pf_seq) == ahead.seq) { /* spun out: sleep until a job, read-ahead, stop */
            pthread_mutex_lock(&p->mu);
            atomic_fetch_add(&p->sleepers, 1);
            while ((gen = atomic_load(&p->ticket) >> 32) == seen && atomic_load(&p->pf_seq) == ahead.seq &&
                   !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv, &p->mu);
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop)) break;
        if (gen != seen) {
            seen = gen;
            work(p, gen);
        }
    }
    return NULL;
}

void* spin_pool_new(int workers) {
    pool_t* p = (pool_t*)calloc(1, sizeof(pool_t));
    if (!p) return NULL;
    p->th = (pthread_t*)calloc(workers > 0 ? workers : 1, sizeof(pthread_t));
    if (!p->th) {
        free(p);
        return NULL;
    }
    const char* cb = getenv("MOESPEC_SPIN_CHUNK_BYTES");
    p->chunk_bytes = cb && atoll(cb) > 0 ? atoll(cb) : CHUNK_MIN_BYTES;
    p->split_min_bytes = SPLIT_MIN_BYTES;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    for (int i = 0; i < workers; i++) {
        if (pthread_create(&p->th[i], NULL, worker, p) != 0) break;
        p->n++;
    }
    return p;
}

void spin_pool_free(void* pv) {
    pool_t* p = (pool_t*)pv;
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n; i++) pthread_join(p->th[i], NULL);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    free(p->th);
    free(p);
}

void spin_pool_set_split_min_bytes(void* pv, i64 nbytes) {
    if (pv) ((pool_t*)pv)->split_min_bytes = nbytes < 0 ? 0 : nbytes;
}

/* Rows of a chunk: about chunk_bytes of weight, a multiple of 8, at least 8. */
static i64 chunk_rows(const bound_t* b, i64 chunk_bytes) {
    i64 rows = (chunk_bytes + b->row_bytes - 1) / b->row_bytes;
    return (rows + 7) / 8 * 8;
}

/* Wake sleeping workers (a job or a read-ahead was posted). */
static void wake(pool_t* p) {
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
    }
}

/* Ask the workers to read ranges ahead (pool_t's pf_* fields); n[r] <= 0: no range r. */
static void post_ahead(pool_t* p, const void* const* ptr, const i64* n) {
    for (int r = 0; r < PF_RANGES; r++) p->pf_ptr[r] = (const char*)ptr[r], p->pf_len[r] = n[r];
    atomic_fetch_add(&p->pf_seq, 1); /* seq_cst: after the ranges */
    wake(p);
}

/* Publish the job in p->job (its fields set), run chunks here too, wait for the last one. */
static int run_job(pool_t* p, i64 nchunks) {
    atomic_store(&p->done, 0);
    atomic_store(&p->rc, 0);
    const uint64_t gen = (atomic_load(&p->ticket) >> 32) + 1;
    atomic_store(&p->ticket, gen << 32); /* publishes the job (seq_cst: ordered after its fields) */
    wake(p);
    work(p, gen);
    /* a chunk a worker still runs: microseconds, unless that worker lost its core (then yield it) */
    for (int k = 0; atomic_load(&p->done) < nchunks; k++) {
        _mm_pause();
        if ((k & 255) == 255) sched_yield();
    }
    return atomic_load(&p->rc);
}

/* y[T, ldy] (float32) = x[T, C] (float32, contiguous) @ W.T for the bound weight; rows split over the
 * pool's workers and the caller (pool NULL: the caller alone, the serial reference) when the weight
 * has at least the pool's split_min_bytes and two chunks. T <= 16. Then, with a pool, the workers
 * are asked to read ahead the ranges ahead_ptr[r], ahead_len[r] (r < 3; NULL arrays or length 0:
 * none): the next product's weight. Returns 0, or -1 when a kernel could not allocate its scratch rows. */
int spin_linear(void* pv, const void* bv, const float* x, i64 T, float* y, i64 ldy, const void* const* ahead_ptr,
                const i64* ahead_len) {
    pool_t* p = (pool_t*)pv;
    const bound_t* b = (const bound_t*)bv;
    const int lowbit = b->kind == KIND_Q8 || b->kind == KIND_Q4;
    const i64 G = lowbit ? (b->C + b->g - 1) / b->g : 1;
    float xs_buf[lowbit && T == 1 ? G : 1];
    const float* xs = NULL;
    if (lowbit && T == 1) { /* the activations' group sums once, not once per chunk */
        group_sums(x, 1, b->C, b->C, b->g, xs_buf);
        xs = xs_buf;
    }
    const i64 rows = chunk_rows(b, p ? p->chunk_bytes : CHUNK_MIN_BYTES);
    const i64 nchunks = (b->R + rows - 1) / rows;
    int rc;
    if (!p || p->n == 0 || nchunks < 2 || b->R * b->row_bytes < p->split_min_bytes) {
        rc = bound_rows(b, x, T, xs, y, ldy, 0, b->R);
    } else {
        job_t* j = &p->job;
        j->ex = NULL, j->b = b, j->x = x, j->xs = xs, j->y = y, j->T = T, j->ldy = ldy, j->row0 = 0;
        j->chunk_rows = rows;
        j->nchunks = nchunks;
        rc = run_job(p, nchunks);
    }
    if (p && p->n > 0 && ahead_ptr && ahead_len) post_ahead(p, ahead_ptr, ahead_len);
    return rc;
}

/* Stop the read-ahead: returns when no worker reads any range posted before (an empty request is
 * posted, then the workers inside read_ahead are waited for; each leaves within one PF_PIECE). */
void spin_quiet(void* pv) {
    pool_t* p = (pool_t*)pv;
    if (!p || p->n == 0) return;
    const void* none[PF_RANGES] = {0};
    const i64 zero[PF_RANGES] = {0};
    for (int r = 0; r < PF_RANGES; r++) p->pf_ptr[r] = (const char*)none[r], p->pf_len[r] = zero[r];
    atomic_fetch_add(&p->pf_seq, 1); /* seq_cst, before the look at reading */
    while (atomic_load(&p->reading) > 0) _mm_pause();
}

/* n SwiGLU experts of one decode layer (expert.c experts_swiglu's arguments), one expert per chunk,
 * claimed by the caller and the pool's workers (pool NULL, no worker or n < 2: the caller alone).
 * Each expert is computed by the same code on whichever thread: bit-equal to the serial call. */
int spin_experts(void* pv, int kind, int a8, int bf16_act, const float* x, i64 T, const uint8_t* base, i64 stride,
                 const i64* rows, i64 n, i64 ow1, i64 os1, i64 oz1, i64 ow2, i64 os2, i64 oz2, i64 H, i64 I,
                 i64 g, float* y) {
    pool_t* p = (pool_t*)pv;
    if (!p || p->n == 0 || n < 2)
        return experts_swiglu(kind, a8, bf16_act, x, T, base, stride, rows, n, ow1, os1, oz1, ow2, os2, oz2, H,
                              I, g, y);
    const experts_t e = {kind, a8, bf16_act, x, T, base, stride, rows, ow1, os1, oz1, ow2, os2, oz2, H, I, g, y};
    job_t* j = &p->job;
    j->ex = &e, j->b = NULL, j->nchunks = n;
    return run_job(p, n);
}
