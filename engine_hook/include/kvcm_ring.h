/* kvcm_ring.h: header-only C99 (and C++) producer for the kvcm-sidecar ring.
 *
 * The byte protocol is docs/ring.md (code twin: sidecar/shm_ring/layout.py); this file behaves
 * as the Python producer does (engine_hook.attach + Hook): same segment name, race-safe
 * create-or-attach, layout checks, incarnation seqlock, liveness stamp, drop-newest with exact
 * counters, per-slot seq written last, doorbell, descriptor JSON, gating, snapshot answers.
 * Nothing here blocks or fails the caller: every problem is a counter in kvcm_stats, and an
 * attach that cannot publish returns a code plus a message and a no-op handle.
 *
 * Build: cc -std=c99 ... -I$(kvcm-sidecar include-dir) -pthread (-lrt on glibc < 2.34).
 * Include this header before any system header, or define _GNU_SOURCE / _DEFAULT_SOURCE
 * yourself: it needs flock(2), shm_open(3) and sem_open(3). Everything is `static` (one private
 * copy per translation unit); names are prefixed kvcm_ (private ones kvcm__).
 *
 * Memory ordering uses the GCC/Clang __atomic builtins with the order stated at each store, so
 * it is correct on weakly ordered CPUs (aarch64) as well as x86-64 (where release/acquire
 * compile to plain moves).
 *
 * Use (docs/ring.md, "C and C++ producers", has a complete program):
 *   kvcm_descriptor d; kvcm_ring *ring;
 *   kvcm_descriptor_init(&d); kvcm_descriptor_from_env(&d); d.instance_id = "...";
 *   if (kvcm_ring_attach(&d, &ring) != KVCM_OK) log(kvcm_ring_reason(ring)); // keeps running
 *   kvcm_ring_set_snapshot(ring, enumerate_my_cache, ctx);  // C engines must enumerate
 *   kvcm_ring_start_thread(ring);                           // optional
 *   kvcm_ring_stored(ring, keys, n, group, medium);  kvcm_ring_removed(...);
 *   kvcm_ring_cleared(ring);
 *   kvcm_ring_poll(ring);                                   // once per engine step
 *   kvcm_ring_stats(ring, &stats);  kvcm_ring_close(ring);  kvcm_ring_free(ring);
 * Calls on one handle must not run concurrently (one engine thread, or the engine's lock);
 * poll and the helper thread may overlap with them.
 */
#ifndef KVCM_RING_H
#define KVCM_RING_H

#if !defined(_GNU_SOURCE) && !defined(_DEFAULT_SOURCE)
#define _DEFAULT_SOURCE 1
#endif
#if !defined(_GNU_SOURCE) && (!defined(_POSIX_C_SOURCE) || _POSIX_C_SOURCE < 200809L)
#undef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L
#endif

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <semaphore.h>
#include <signal.h>
#include <stddef.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- layout (sidecar/shm_ring/layout.py) ----------------------------------------------- */
#define KVCM_MAGIC 0x474E49524D43564BULL /* "KVCMRING" little-endian */
#define KVCM_LAYOUT_VERSION 1u
#define KVCM_OLDEST_READABLE_VERSION 1u
#define KVCM_SLOT_SIZE 32u
#define KVCM_HEADER_SIZE 4096u
#define KVCM_DESCRIPTOR_OFFSET 1024u
#define KVCM_DESCRIPTOR_MAX (KVCM_HEADER_SIZE - KVCM_DESCRIPTOR_OFFSET)
#define KVCM_DEFAULT_CAPACITY_SLOTS (1u << 16)
#define KVCM_MIN_CAPACITY 8u
#define KVCM_MAX_CAPACITY (1u << 26)
#define KVCM_MAX_GROUPS 32
#define KVCM_MAX_MEDIUMS 255

enum { /* header word indexes (byte offset = 8 * index) */
    KVCM_W_MAGIC = 0, KVCM_W_VERSION_SLOT = 1, KVCM_W_CAPACITY = 2, KVCM_W_HEADER_SIZE = 3,
    KVCM_W_CREATED_NS = 4,
    KVCM_W_TAIL = 8, KVCM_W_DROPPED = 9, KVCM_W_LAST_SEQ = 10, KVCM_W_LIVENESS_NS = 11,
    KVCM_W_ATTEMPTED = 12, KVCM_W_PRODUCER_STATE = 13, KVCM_W_HEAD_SEEN = 14,
    KVCM_W_HEAD = 16, KVCM_W_READER_PID = 17, KVCM_W_READER_INCARNATION = 18,
    KVCM_W_READER_LIVENESS_NS = 19, KVCM_W_SNAP_REQ = 20, KVCM_W_READER_IDLE = 21,
    KVCM_W_INC_GEN = 24, KVCM_W_BOOT_ID = 25, KVCM_W_PID = 26, KVCM_W_START_NS = 27,
    KVCM_W_INC_START_POS = 28, KVCM_W_PIDNS = 29, KVCM_W_DESCRIPTOR_LEN = 30,
    KVCM_W_SNAP_RESP = 32, KVCM_W_SNAP_SEQ = 33, KVCM_W_SNAP_COUNT = 34, KVCM_W_SNAP_DROPPED = 35,
    KVCM_W_SNAP_STATUS = 36, KVCM_W_SNAP_BOOT_ID = 37, KVCM_W_SNAP_BYTES = 38
};
enum { KVCM_PRODUCER_NONE = 0, KVCM_PRODUCER_ATTACHED = 1, KVCM_PRODUCER_CLOSED = 2 };
enum { KVCM_SNAP_OK = 0, KVCM_SNAP_FAILED = 1 };
enum { KVCM_KIND_STORED = 1, KVCM_KIND_REMOVED = 2, KVCM_KIND_CLEARED = 3 };
#define KVCM_SNAP_MAGIC 0x50414E534D43564BULL /* "KVCMSNAP" */
#define KVCM_SNAP_HEADER_SIZE 64u
#define KVCM_SNAP_ENTRY_BYTES 13u /* key i64 + group mask u32 + medium u8 */
#define KVCM_SNAP_FLAG_MEDIUMS 1u
enum { KVCM_SW_MAGIC = 0, KVCM_SW_REQ = 1, KVCM_SW_COUNT = 2, KVCM_SW_CAPACITY = 3,
       KVCM_SW_FLAGS = 4 };

/* ---- attach results ------------------------------------------------------------------- */
enum {
    KVCM_OK = 0,             /* publishing */
    KVCM_GATED = 1,          /* this rank does not publish (gating rule in the reason) */
    KVCM_E_CONFIG = -1,      /* a descriptor field is invalid (named in the reason) */
    KVCM_E_LAYOUT = -2,      /* the segment has another layout version or slot size */
    KVCM_E_CORRUPT = -3,     /* bad magic, header size, capacity or file size */
    KVCM_E_PERMISSION = -4,  /* shm_open/mmap refused (EACCES/EPERM) */
    KVCM_E_CONFLICT = -5,    /* another live producer is attached to this ring */
    KVCM_E_BUSY = -6,        /* another process is initialising the segment right now */
    KVCM_E_CAPACITY = -7,    /* the segment's capacity differs from ring_capacity_slots */
    KVCM_E_SYSTEM = -8       /* any other OS error (ENOMEM, EMFILE, ...) */
};

/* The replica descriptor: the same fields (and JSON) as engine_hook/descriptor.py. Fill it with
 * kvcm_descriptor_init() (the Python defaults), optionally kvcm_descriptor_from_env() (the
 * KV_CACHE_EVENT_* variables), then set what the engine knows: arguments win over the env. */
typedef struct kvcm_descriptor {
    const char *publisher_type; /* "kvcm" or "none" */
    const char *instance_id;
    int64_t dp_rank, tp_rank, tp_size, dp_size, pp_size;
    const char *model_name;
    const char *dtype;
    int use_mla;
    int64_t block_size_tokens;
    int64_t group_block_bytes[KVCM_MAX_GROUPS];
    int n_groups;
    int64_t required_groups[KVCM_MAX_GROUPS];
    int n_required;
    const char *medium;  /* the default medium: ring index 0 */
    const char *mediums; /* further mediums, comma-separated ("mem,disk"); "" for none */
    int cp_sharded_kv;
    int prefix_reuse;
    const char *ring_name; /* "" derives /kvcm.<id>.<sha1[:10]>.dp<rank> */
    uint64_t ring_capacity_slots; /* 0: the segment's (or the default when creating) */
    double max_stage_delay_ms;    /* helper-thread period (liveness stamp, snapshots) */
    const char *extra;            /* "k=v,k=v" */
    char error[256]; /* set by kvcm_descriptor_from_env; attach then refuses as invalid config */
} kvcm_descriptor;

/* Counters: every problem is counted here, none is raised. Read with kvcm_ring_stats(). */
typedef struct kvcm_stats {
    int enabled;      /* 1 while publishing */
    int code;         /* what kvcm_ring_attach returned */
    int closed;       /* kvcm_ring_close ran */
    int thread_alive; /* the helper thread runs */
    uint64_t boot_id;
    uint64_t last_seq;   /* seq of the last accepted record of this incarnation */
    uint64_t attempted;  /* records offered (segment lifetime, as the header word) */
    uint64_t dropped;    /* records dropped because the ring was full (segment lifetime) */
    uint64_t bells;      /* doorbell posts */
    uint64_t polls;      /* chores runs (kvcm_ring_poll or the helper thread) */
    uint64_t poll_busy;  /* chores skipped because another thread was running them */
    uint64_t snapshots;  /* snapshot requests answered with data */
    uint64_t snapshot_failed;      /* answered as failed (any reason, incl. the two below) */
    uint64_t snapshot_no_callback; /* failed because no snapshot callback is set */
    uint64_t snapshot_last_entries;
    uint64_t snapshot_last_stall_ns;
    uint64_t bad_group;   /* calls with a group outside the descriptor's groups (dropped) */
    uint64_t bad_medium;  /* calls or snapshot entries with a medium outside the table */
    uint64_t bad_key;     /* calls with keys == NULL and n > 0 */
    uint64_t after_close; /* calls after kvcm_ring_close */
    uint64_t bell_unavailable; /* the doorbell could not be opened (the sidecar then polls) */
    uint64_t internal;    /* OS errors after attach (snapshot segment, thread start) */
    const char *ring_name;
    const char *reason; /* why the handle does not publish; "" while it does */
} kvcm_stats;

typedef struct kvcm_snapshot kvcm_snapshot;
/* The engine's snapshot callback: enumerate the cache into `snap` with kvcm_snapshot_add*();
 * return 0, or non-zero to answer the request as failed. With the helper thread it runs on
 * that thread, concurrently with the engine: take the engine's own lock. The engine must update
 * its own state before reporting a transition (docs/ring.md, "Snapshot exchange"). */
typedef int (*kvcm_snapshot_fn)(void *ctx, kvcm_snapshot *snap);

/* ---- internals ------------------------------------------------------------------------ */
#define KVCM__LOAD(p, o) __atomic_load_n((p), (o))
#define KVCM__STORE(p, v, o) __atomic_store_n((p), (v), (o))
#define KVCM__RLX __ATOMIC_RELAXED
#define KVCM__REL __ATOMIC_RELEASE
#define KVCM__ACQ __ATOMIC_ACQUIRE
/* A counter written by one thread and read by any (stats): a relaxed 8-byte store. */
#define KVCM__BUMP(field, n) KVCM__STORE(&(field), KVCM__LOAD(&(field), KVCM__RLX) + (n), KVCM__RLX)
/* A counter two threads write (the engine's calls and the snapshot answer): an atomic add. */
#define KVCM__BUMP_SHARED(field, n) (void)__atomic_fetch_add(&(field), (n), KVCM__RLX)

struct kvcm_snapshot {
    int64_t *keys;
    uint32_t *masks;
    uint8_t *mediums;
    size_t n, cap;
    int nmediums;
    int oom;
    uint64_t bad_medium;
};

typedef struct kvcm_ring {
    /* hot, engine thread only */
    uint64_t *hdr;   /* the 4096-byte header as u64 words */
    uint64_t *slots; /* capacity x 4 u64 words */
    uint64_t mask, cap, tail, head_cache, seq, dropped, attempted;
    int live; /* publishing (attached and not closed) */
    int ngroups, nmediums;
    sem_t *bell;
    int bell_retry; /* set by chores: the engine thread may try sem_open again */
    /* cold */
    int code, closed;
    uint64_t boot_id;
    size_t map_len;
    void *map;
    kvcm_snapshot_fn snap_fn;
    void *snap_ctx;
    kvcm_snapshot sink;
    void *snap_map;
    size_t snap_len;
    uint64_t snap_cap;
    pthread_mutex_t chores_mu;
    pthread_mutex_t wait_mu;
    pthread_cond_t wait_cv;
    pthread_t thread;
    int thread_started, stop;
    long delay_ns;
    kvcm_stats st;
    char mediums[KVCM_MAX_MEDIUMS][64]; /* the medium table; names longer than 63 are refused */
    char name[256];
    char reason[768];
} kvcm_ring;

static inline uint64_t kvcm__now_ns(clockid_t clk) {
    struct timespec ts;
    clock_gettime(clk, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* ---- descriptor ----------------------------------------------------------------------- */
static inline void kvcm_descriptor_init(kvcm_descriptor *d) {
    memset(d, 0, sizeof *d);
    d->publisher_type = "kvcm";
    d->instance_id = "";
    d->tp_size = d->dp_size = d->pp_size = 1;
    d->model_name = "model";
    d->dtype = "fp16";
    d->block_size_tokens = 16;
    d->group_block_bytes[0] = 4096;
    d->n_groups = 1;
    d->required_groups[0] = 0;
    d->n_required = 1;
    d->medium = "hbm";
    d->mediums = "";
    d->prefix_reuse = 1;
    d->ring_name = "";
    d->max_stage_delay_ms = 5.0;
    d->extra = "";
}

static inline const char *kvcm__s(const char *s) { return s ? s : ""; }

static inline int kvcm__is_space(char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

/* Python int(): optional whitespace, sign, digits (underscores between digits allowed). */
static inline int kvcm__parse_i64(const char *s, int64_t *out) {
    char buf[64];
    size_t n = 0;
    while (kvcm__is_space(*s)) s++;
    const char *e = s + strlen(s);
    while (e > s && kvcm__is_space(e[-1])) e--;
    if (e == s) return -1;
    for (const char *p = s; p < e; p++) {
        if (*p == '_') {
            if (p == s || p + 1 == e || !(p[-1] >= '0' && p[-1] <= '9') ||
                !(p[1] >= '0' && p[1] <= '9'))
                return -1;
            continue;
        }
        if (!((*p >= '0' && *p <= '9') || ((*p == '-' || *p == '+') && p == s))) return -1;
        if (n + 1 >= sizeof buf) return -1;
        buf[n++] = *p;
    }
    buf[n] = 0;
    if (n == 0 || (n == 1 && (buf[0] == '-' || buf[0] == '+'))) return -1;
    errno = 0;
    long long v = strtoll(buf, NULL, 10);
    if (errno == ERANGE) return -1;
    *out = (int64_t)v;
    return 0;
}

static inline int kvcm__parse_bool(const char *s, int *out) {
    char low[16];
    size_t n = 0;
    while (kvcm__is_space(*s)) s++;
    const char *e = s + strlen(s);
    while (e > s && kvcm__is_space(e[-1])) e--;
    if ((size_t)(e - s) >= sizeof low) return -1;
    for (; s < e; s++) low[n++] = (char)((*s >= 'A' && *s <= 'Z') ? *s + 32 : *s);
    low[n] = 0;
    if (!strcmp(low, "1") || !strcmp(low, "true") || !strcmp(low, "yes") || !strcmp(low, "on")) {
        *out = 1;
        return 0;
    }
    if (!strcmp(low, "0") || !strcmp(low, "false") || !strcmp(low, "no") || !strcmp(low, "off")) {
        *out = 0;
        return 0;
    }
    return -1;
}

/* A comma-separated int list ("4096,1024"); empty items are skipped, as in descriptor._parse. */
static inline int kvcm__parse_list(const char *s, int64_t *out, int *n) {
    char item[64];
    int count = 0;
    while (*s) {
        const char *c = strchr(s, ',');
        size_t len = c ? (size_t)(c - s) : strlen(s);
        int blank = 1;
        for (const char *p = s; p < s + len; p++) blank &= kvcm__is_space(*p);
        if (!blank) {
            if (len >= sizeof item || count >= KVCM_MAX_GROUPS) return -1;
            memcpy(item, s, len);
            item[len] = 0;
            if (kvcm__parse_i64(item, &out[count]) != 0) return -1;
            count++;
        }
        s += len;
        if (*s == ',') s++;
    }
    *n = count;
    return 0;
}

/* Overlay the KV_CACHE_EVENT_<FIELD> variables on `d` (call after kvcm_descriptor_init and
 * before setting the engine's own values: arguments win over the environment). Returns 0, or
 * KVCM_E_CONFIG with the variable named in d->error (kvcm_ring_attach then returns a no-op
 * handle with "invalid config: ..."). The strings point into the environment: do not setenv()
 * them away meanwhile. */
static inline int kvcm_descriptor_from_env(kvcm_descriptor *d) {
    char *err = d->error;
    size_t errlen = sizeof d->error;
    static const struct {
        const char *env;
        char type; /* s string, i int, b bool, f float, l int list, u u64 */
        size_t off;
    } F[] = {
        {"KV_CACHE_EVENT_PUBLISHER_TYPE", 's', offsetof(kvcm_descriptor, publisher_type)},
        {"KV_CACHE_EVENT_INSTANCE_ID", 's', offsetof(kvcm_descriptor, instance_id)},
        {"KV_CACHE_EVENT_DP_RANK", 'i', offsetof(kvcm_descriptor, dp_rank)},
        {"KV_CACHE_EVENT_TP_RANK", 'i', offsetof(kvcm_descriptor, tp_rank)},
        {"KV_CACHE_EVENT_TP_SIZE", 'i', offsetof(kvcm_descriptor, tp_size)},
        {"KV_CACHE_EVENT_DP_SIZE", 'i', offsetof(kvcm_descriptor, dp_size)},
        {"KV_CACHE_EVENT_PP_SIZE", 'i', offsetof(kvcm_descriptor, pp_size)},
        {"KV_CACHE_EVENT_MODEL_NAME", 's', offsetof(kvcm_descriptor, model_name)},
        {"KV_CACHE_EVENT_DTYPE", 's', offsetof(kvcm_descriptor, dtype)},
        {"KV_CACHE_EVENT_USE_MLA", 'b', offsetof(kvcm_descriptor, use_mla)},
        {"KV_CACHE_EVENT_BLOCK_SIZE_TOKENS", 'i', offsetof(kvcm_descriptor, block_size_tokens)},
        {"KV_CACHE_EVENT_GROUP_BLOCK_BYTES", 'l', offsetof(kvcm_descriptor, group_block_bytes)},
        {"KV_CACHE_EVENT_REQUIRED_GROUPS", 'l', offsetof(kvcm_descriptor, required_groups)},
        {"KV_CACHE_EVENT_MEDIUM", 's', offsetof(kvcm_descriptor, medium)},
        {"KV_CACHE_EVENT_MEDIUMS", 's', offsetof(kvcm_descriptor, mediums)},
        {"KV_CACHE_EVENT_CP_SHARDED_KV", 'b', offsetof(kvcm_descriptor, cp_sharded_kv)},
        {"KV_CACHE_EVENT_PREFIX_REUSE", 'b', offsetof(kvcm_descriptor, prefix_reuse)},
        {"KV_CACHE_EVENT_RING_NAME", 's', offsetof(kvcm_descriptor, ring_name)},
        {"KV_CACHE_EVENT_RING_CAPACITY_SLOTS", 'u', offsetof(kvcm_descriptor, ring_capacity_slots)},
        {"KV_CACHE_EVENT_MAX_STAGE_DELAY_MS", 'f', offsetof(kvcm_descriptor, max_stage_delay_ms)},
        {"KV_CACHE_EVENT_EXTRA", 's', offsetof(kvcm_descriptor, extra)},
    };
    char *base = (char *)d;
    for (size_t i = 0; i < sizeof F / sizeof F[0]; i++) {
        const char *v = getenv(F[i].env);
        int ok = 0;
        if (!v) continue;
        switch (F[i].type) {
        case 's':
            memcpy(base + F[i].off, &v, sizeof v);
            ok = 1;
            break;
        case 'i':
            ok = kvcm__parse_i64(v, (int64_t *)(void *)(base + F[i].off)) == 0;
            break;
        case 'u': {
            int64_t x;
            ok = kvcm__parse_i64(v, &x) == 0 && x >= 0;
            if (ok) *(uint64_t *)(void *)(base + F[i].off) = (uint64_t)x;
            break;
        }
        case 'b':
            ok = kvcm__parse_bool(v, (int *)(void *)(base + F[i].off)) == 0;
            break;
        case 'f': {
            char *end;
            double x = strtod(v, &end);
            while (kvcm__is_space(*end)) end++;
            ok = end != v && *end == 0;
            if (ok) d->max_stage_delay_ms = x;
            break;
        }
        case 'l': {
            int n = 0;
            int64_t *dst = (int64_t *)(void *)(base + F[i].off);
            ok = kvcm__parse_list(v, dst, &n) == 0;
            if (ok && F[i].off == offsetof(kvcm_descriptor, group_block_bytes)) d->n_groups = n;
            if (ok && F[i].off == offsetof(kvcm_descriptor, required_groups)) d->n_required = n;
            break;
        }
        default:
            break;
        }
        if (!ok) {
            const char *t = F[i].type == 'l' ? "tuple[int, ...]" : F[i].type == 'b' ? "bool"
                          : F[i].type == 'f' ? "float" : "int";
            char field[40];
            size_t k = 0;
            for (const char *c = F[i].env + 15; *c && k + 1 < sizeof field; c++)
                field[k++] = (char)(*c >= 'A' && *c <= 'Z' ? *c + 32 : *c);
            field[k] = 0;
            snprintf(err, errlen, "env %s: %s='%s' is not a valid %s", F[i].env, field, v, t);
            return KVCM_E_CONFIG;
        }
    }
    return 0;
}

/* Split `csv` into stripped non-empty items (descriptor._parse for tuple[str, ...]). Calls
 * fn(item, len, ctx) per item; returns the first non-zero fn result. */
static inline int kvcm__each_item(const char *csv, int (*fn)(const char *, size_t, void *),
                                  void *ctx) {
    const char *s = kvcm__s(csv);
    while (*s) {
        const char *c = strchr(s, ',');
        const char *e = c ? c : s + strlen(s);
        const char *a = s, *b = e;
        while (a < b && kvcm__is_space(*a)) a++;
        while (b > a && kvcm__is_space(b[-1])) b--;
        if (b > a) {
            int rc = fn(a, (size_t)(b - a), ctx);
            if (rc) return rc;
        }
        s = c ? c + 1 : e;
    }
    return 0;
}

/* ---- JSON (byte-identical to json.dumps(asdict(d), separators=(",", ":"))) ------------ */
typedef struct kvcm__buf {
    char *p;
    size_t n, cap;
    int overflow;
} kvcm__buf;

static inline void kvcm__put(kvcm__buf *b, const char *s, size_t n) {
    if (b->n + n > b->cap) {
        b->overflow = 1;
        return;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}
static inline void kvcm__puts(kvcm__buf *b, const char *s) { kvcm__put(b, s, strlen(s)); }

static inline void kvcm__put_u16esc(kvcm__buf *b, unsigned v) {
    char t[16];
    snprintf(t, sizeof t, "\\u%04x", v & 0xFFFFu);
    kvcm__put(b, t, 6);
}

/* ensure_ascii: non-ASCII as \uXXXX (UTF-16 surrogate pairs), bytes that are not UTF-8 as
 * \udcXX (what Python's surrogateescape reads from the environment). */
static inline void kvcm__put_str(kvcm__buf *b, const char *s, size_t len) {
    const unsigned char *p = (const unsigned char *)s, *e = p + len;
    kvcm__put(b, "\"", 1);
    while (p < e) {
        unsigned c = *p;
        if (c == '"') kvcm__put(b, "\\\"", 2);
        else if (c == '\\') kvcm__put(b, "\\\\", 2);
        else if (c == '\n') kvcm__put(b, "\\n", 2);
        else if (c == '\r') kvcm__put(b, "\\r", 2);
        else if (c == '\t') kvcm__put(b, "\\t", 2);
        else if (c == '\b') kvcm__put(b, "\\b", 2);
        else if (c == '\f') kvcm__put(b, "\\f", 2);
        else if (c < 0x20) kvcm__put_u16esc(b, c);
        else if (c < 0x80) kvcm__put(b, (const char *)p, 1);
        else {
            int extra = c >= 0xF0 && c < 0xF5 ? 3 : c >= 0xE0 ? 2 : c >= 0xC2 && c < 0xE0 ? 1 : -1;
            if (c >= 0xF5) extra = -1;
            unsigned cp = extra == 1 ? c & 0x1F : extra == 2 ? c & 0x0F : c & 0x07;
            int ok = extra > 0 && (size_t)(e - p) > (size_t)extra;
            for (int i = 1; ok && i <= extra; i++) {
                if ((p[i] & 0xC0) != 0x80) ok = 0;
                else cp = (cp << 6) | (p[i] & 0x3F);
            }
            if (ok && ((extra == 2 && (cp < 0x800 || (cp >= 0xD800 && cp < 0xE000))) ||
                       (extra == 3 && (cp < 0x10000 || cp > 0x10FFFF))))
                ok = 0;
            if (!ok) {
                kvcm__put_u16esc(b, 0xDC00 | c);
                p++;
                continue;
            }
            if (cp >= 0x10000) {
                cp -= 0x10000;
                kvcm__put_u16esc(b, 0xD800 | (cp >> 10));
                kvcm__put_u16esc(b, 0xDC00 | (cp & 0x3FF));
            } else {
                kvcm__put_u16esc(b, cp);
            }
            p += extra;
        }
        p++;
    }
    kvcm__put(b, "\"", 1);
}

static inline void kvcm__put_i64(kvcm__buf *b, int64_t v) {
    char t[32];
    int n = snprintf(t, sizeof t, "%lld", (long long)v);
    kvcm__put(b, t, (size_t)n);
}

/* Python's repr(float): the shortest digits that round-trip, fixed notation for exponents in
 * [-4, 16), else d.ddde+XX. */
static inline void kvcm__put_f64(kvcm__buf *b, double v) {
    char t[64], digits[32], out[64];
    int p, n = 0, exp10 = 0;
    for (p = 0; p < 17; p++) {
        snprintf(t, sizeof t, "%.*e", p, v);
        if (strtod(t, NULL) == v) break;
    }
    const char *q = t;
    int neg = *q == '-';
    if (neg) q++;
    for (; *q && *q != 'e'; q++)
        if (*q != '.') digits[n++] = *q;
    digits[n] = 0;
    exp10 = atoi(q + 1);
    while (n > 1 && digits[n - 1] == '0') digits[--n] = 0;
    size_t o = 0;
    if (neg) out[o++] = '-';
    if (exp10 >= -4 && exp10 < 16) {
        if (exp10 < 0) {
            out[o++] = '0';
            out[o++] = '.';
            for (int i = 0; i < -exp10 - 1; i++) out[o++] = '0';
            for (int i = 0; i < n; i++) out[o++] = digits[i];
        } else {
            for (int i = 0; i <= exp10; i++) out[o++] = i < n ? digits[i] : '0';
            out[o++] = '.';
            if (n > exp10 + 1)
                for (int i = exp10 + 1; i < n; i++) out[o++] = digits[i];
            else
                out[o++] = '0';
        }
        out[o] = 0;
    } else {
        out[o++] = digits[0];
        if (n > 1) {
            out[o++] = '.';
            for (int i = 1; i < n; i++) out[o++] = digits[i];
        }
        snprintf(out + o, sizeof out - o, "e%c%02d", exp10 < 0 ? '-' : '+', abs(exp10));
    }
    kvcm__puts(b, out);
}

static inline int kvcm__json_medium(const char *s, size_t n, void *ctx) {
    kvcm__buf *b = (kvcm__buf *)ctx;
    if (b->n && b->p[b->n - 1] != '[') kvcm__put(b, ",", 1);
    kvcm__put_str(b, s, n);
    return 0;
}

/* extra "k=v,k=v" as dict(kv.split("=", 1) ...): first position of a key, its last value. */
static inline void kvcm__json_extra(kvcm__buf *b, const char *csv) {
    const char *items[64][4]; /* key start, key end, value start, value end */
    int n = 0;
    const char *s = kvcm__s(csv);
    while (*s && n < 64) {
        const char *c = strchr(s, ',');
        const char *e = c ? c : s + strlen(s);
        if (e > s) {
            const char *eq = (const char *)memchr(s, '=', (size_t)(e - s));
            int found = -1;
            for (int i = 0; i < n && eq; i++)
                if ((size_t)(items[i][1] - items[i][0]) == (size_t)(eq - s) &&
                    !memcmp(items[i][0], s, (size_t)(eq - s)))
                    found = i;
            if (eq && found >= 0) {
                items[found][2] = eq + 1;
                items[found][3] = e;
            } else if (eq) {
                items[n][0] = s;
                items[n][1] = eq;
                items[n][2] = eq + 1;
                items[n][3] = e;
                n++;
            }
        }
        s = c ? c + 1 : e;
    }
    kvcm__put(b, "{", 1);
    for (int i = 0; i < n; i++) {
        if (i) kvcm__put(b, ",", 1);
        kvcm__put_str(b, items[i][0], (size_t)(items[i][1] - items[i][0]));
        kvcm__put(b, ":", 1);
        kvcm__put_str(b, items[i][2], (size_t)(items[i][3] - items[i][2]));
    }
    kvcm__put(b, "}", 1);
}

static inline void kvcm__json_key(kvcm__buf *b, const char *k) {
    if (b->n > 1) kvcm__put(b, ",", 1);
    kvcm__put(b, "\"", 1);
    kvcm__puts(b, k);
    kvcm__put(b, "\":", 2);
}

static inline size_t kvcm__descriptor_json(const kvcm_descriptor *d, char *out, size_t cap) {
    kvcm__buf b = {out, 0, cap, 0};
    const char *strs[] = {d->publisher_type, d->instance_id};
    kvcm__put(&b, "{", 1);
    kvcm__json_key(&b, "publisher_type");
    kvcm__put_str(&b, kvcm__s(strs[0]), strlen(kvcm__s(strs[0])));
    kvcm__json_key(&b, "instance_id");
    kvcm__put_str(&b, kvcm__s(strs[1]), strlen(kvcm__s(strs[1])));
    kvcm__json_key(&b, "dp_rank"); kvcm__put_i64(&b, d->dp_rank);
    kvcm__json_key(&b, "tp_rank"); kvcm__put_i64(&b, d->tp_rank);
    kvcm__json_key(&b, "tp_size"); kvcm__put_i64(&b, d->tp_size);
    kvcm__json_key(&b, "dp_size"); kvcm__put_i64(&b, d->dp_size);
    kvcm__json_key(&b, "pp_size"); kvcm__put_i64(&b, d->pp_size);
    kvcm__json_key(&b, "model_name");
    kvcm__put_str(&b, kvcm__s(d->model_name), strlen(kvcm__s(d->model_name)));
    kvcm__json_key(&b, "dtype");
    kvcm__put_str(&b, kvcm__s(d->dtype), strlen(kvcm__s(d->dtype)));
    kvcm__json_key(&b, "use_mla"); kvcm__puts(&b, d->use_mla ? "true" : "false");
    kvcm__json_key(&b, "block_size_tokens"); kvcm__put_i64(&b, d->block_size_tokens);
    kvcm__json_key(&b, "group_block_bytes");
    kvcm__put(&b, "[", 1);
    for (int i = 0; i < d->n_groups && i < KVCM_MAX_GROUPS; i++) {
        if (i) kvcm__put(&b, ",", 1);
        kvcm__put_i64(&b, d->group_block_bytes[i]);
    }
    kvcm__put(&b, "]", 1);
    kvcm__json_key(&b, "required_groups");
    kvcm__put(&b, "[", 1);
    for (int i = 0; i < d->n_required && i < KVCM_MAX_GROUPS; i++) {
        if (i) kvcm__put(&b, ",", 1);
        kvcm__put_i64(&b, d->required_groups[i]);
    }
    kvcm__put(&b, "]", 1);
    kvcm__json_key(&b, "medium");
    kvcm__put_str(&b, kvcm__s(d->medium), strlen(kvcm__s(d->medium)));
    kvcm__json_key(&b, "mediums");
    kvcm__put(&b, "[", 1);
    kvcm__each_item(d->mediums, kvcm__json_medium, &b);
    kvcm__put(&b, "]", 1);
    kvcm__json_key(&b, "cp_sharded_kv"); kvcm__puts(&b, d->cp_sharded_kv ? "true" : "false");
    kvcm__json_key(&b, "prefix_reuse"); kvcm__puts(&b, d->prefix_reuse ? "true" : "false");
    kvcm__json_key(&b, "ring_name");
    kvcm__put_str(&b, kvcm__s(d->ring_name), strlen(kvcm__s(d->ring_name)));
    kvcm__json_key(&b, "ring_capacity_slots"); kvcm__put_i64(&b, (int64_t)d->ring_capacity_slots);
    kvcm__json_key(&b, "max_stage_delay_ms"); kvcm__put_f64(&b, d->max_stage_delay_ms);
    kvcm__json_key(&b, "extra"); kvcm__json_extra(&b, d->extra);
    kvcm__put(&b, "}", 1);
    return b.overflow ? (size_t)-1 : b.n;
}

/* ---- validation and gating (descriptor._validate, gating.gate_reason) ----------------- */
typedef struct kvcm__table {
    kvcm_ring *r;
    char *err;
    size_t errlen;
} kvcm__table;

static inline int kvcm__add_medium(const char *s, size_t n, void *ctx) {
    kvcm__table *t = (kvcm__table *)ctx;
    kvcm_ring *r = t->r;
    if (memchr(s, '#', n) || n >= sizeof r->mediums[0]) {
        snprintf(t->err, t->errlen, "medium '%.*s': must be a non-empty name without '#'%s",
                 (int)(n > 80 ? 80 : n), s,
                 n >= sizeof r->mediums[0] ? " (C: at most 63 bytes)" : "");
        return -1;
    }
    for (int i = 0; i < r->nmediums; i++)
        if (strlen(r->mediums[i]) == n && !memcmp(r->mediums[i], s, n)) return 0; /* dedup */
    if (r->nmediums >= KVCM_MAX_MEDIUMS) {
        snprintf(t->err, t->errlen, "mediums: at most %d mediums (a u8 index on the ring)",
                 KVCM_MAX_MEDIUMS);
        return -1;
    }
    memcpy(r->mediums[r->nmediums], s, n);
    r->mediums[r->nmediums][n] = 0;
    r->nmediums++;
    return 0;
}

static inline int kvcm__lower_eq(const char *s, const char *word) {
    while (kvcm__is_space(*s)) s++;
    size_t n = strlen(word);
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (c >= 'A' && c <= 'Z') c = (char)(c + 32);
        if (c != word[i]) return 0;
    }
    for (s += n; *s; s++)
        if (!kvcm__is_space(*s)) return 0;
    return 1;
}

static inline int kvcm__validate(const kvcm_descriptor *d, kvcm_ring *r, char *err, size_t len) {
    const char *pt = kvcm__s(d->publisher_type);
    int ispt_none = kvcm__lower_eq(pt, "none"), ispt_kvcm = kvcm__lower_eq(pt, "kvcm");
    if (!ispt_none && !ispt_kvcm) {
        snprintf(err, len, "publisher_type='%s': expected none or kvcm", pt);
        return -1;
    }
    if (ispt_kvcm && !*kvcm__s(d->instance_id)) {
        snprintf(err, len, "instance_id is required when publisher_type=kvcm");
        return -1;
    }
    if (d->dp_rank < 0 || d->tp_rank < 0) {
        snprintf(err, len, "%s must be >= 0", d->dp_rank < 0 ? "dp_rank" : "tp_rank");
        return -1;
    }
    const char *pos = d->tp_size <= 0             ? "tp_size"
                      : d->dp_size <= 0           ? "dp_size"
                      : d->pp_size <= 0           ? "pp_size"
                      : d->block_size_tokens <= 0 ? "block_size_tokens"
                                                  : NULL;
    if (pos) {
        snprintf(err, len, "%s must be > 0", pos);
        return -1;
    }
    int bad = d->n_groups <= 0;
    for (int i = 0; i < d->n_groups && i < KVCM_MAX_GROUPS; i++)
        bad |= d->group_block_bytes[i] <= 0;
    if (bad) {
        snprintf(err, len, "group_block_bytes must list one positive size per cache group");
        return -1;
    }
    if (d->n_groups > KVCM_MAX_GROUPS) {
        snprintf(err, len, "group_block_bytes: at most 32 cache groups");
        return -1;
    }
    bad = d->n_required <= 0 || d->n_required > KVCM_MAX_GROUPS;
    for (int i = 0; !bad && i < d->n_required; i++)
        bad |= d->required_groups[i] < 0 || d->required_groups[i] >= d->n_groups;
    if (bad) {
        snprintf(err, len, "required_groups must name existing cache groups");
        return -1;
    }
    kvcm__table t = {r, err, len};
    const char *m = kvcm__s(d->medium);
    r->nmediums = 0;
    if (!*m) {
        snprintf(err, len, "medium '': must be a non-empty name without '#'");
        return -1;
    }
    if (kvcm__add_medium(m, strlen(m), &t) || kvcm__each_item(d->mediums, kvcm__add_medium, &t))
        return -1;
    if (!(d->max_stage_delay_ms > 0) || !isfinite(d->max_stage_delay_ms)) {
        snprintf(err, len, "max_stage_delay_ms must be a finite number > 0");
        return -1;
    }
    return 0;
}

static inline const char *kvcm__gate(const kvcm_descriptor *d, char *buf, size_t len) {
    if (kvcm__lower_eq(kvcm__s(d->publisher_type), "none")) return "publisher_type is none";
    if (d->tp_rank != 0) {
        snprintf(buf, len, "tp_rank=%lld: only tp_rank 0 of each dp replica publishes",
                 (long long)d->tp_rank);
        return buf;
    }
    if (d->pp_size != 1) {
        snprintf(buf, len, "pp_size=%lld: pipeline-parallel KV is not published",
                 (long long)d->pp_size);
        return buf;
    }
    if (d->cp_sharded_kv) return "KV cache is sharded across context-parallel ranks";
    if (!d->prefix_reuse) return "prefix reuse is disabled, so no block can be reused";
    return NULL;
}

/* ---- segment name (layout.segment_name): /kvcm.<safe id[:64]>.<sha1(id)[:10]>.dp<rank> -- */
static inline uint32_t kvcm__rol(uint32_t x, int n) { return (x << n) | (x >> (32 - n)); }

static inline void kvcm__sha1_block(uint32_t h[5], const unsigned char *p) {
    uint32_t w[80], a = h[0], b = h[1], c = h[2], d = h[3], e = h[4];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
               (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 80; i++) w[i] = kvcm__rol(w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16], 1);
    for (int i = 0; i < 80; i++) {
        uint32_t f, k;
        if (i < 20) { f = (b & c) | (~b & d); k = 0x5A827999u; }
        else if (i < 40) { f = b ^ c ^ d; k = 0x6ED9EBA1u; }
        else if (i < 60) { f = (b & c) | (b & d) | (c & d); k = 0x8F1BBCDCu; }
        else { f = b ^ c ^ d; k = 0xCA62C1D6u; }
        uint32_t t = kvcm__rol(a, 5) + f + e + k + w[i];
        e = d; d = c; c = kvcm__rol(b, 30); b = a; a = t;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e;
}

static inline void kvcm__sha1_hex10(const char *s, char out[11]) {
    uint32_t h[5] = {0x67452301u, 0xEFCDAB89u, 0x98BADCFEu, 0x10325476u, 0xC3D2E1F0u};
    size_t n = strlen(s), i = 0;
    unsigned char blk[64];
    for (; i + 64 <= n; i += 64) kvcm__sha1_block(h, (const unsigned char *)s + i);
    size_t r = n - i;
    memset(blk, 0, sizeof blk);
    memcpy(blk, s + i, r);
    blk[r] = 0x80;
    if (r >= 56) {
        kvcm__sha1_block(h, blk);
        memset(blk, 0, sizeof blk);
    }
    uint64_t bits = (uint64_t)n * 8;
    for (int j = 0; j < 8; j++) blk[63 - j] = (unsigned char)(bits >> (8 * j));
    kvcm__sha1_block(h, blk);
    char hex[41];
    for (int j = 0; j < 5; j++) snprintf(hex + 8 * j, 9, "%08x", h[j]);
    memcpy(out, hex, 10);
    out[10] = 0;
}

/* Sanitise as re.sub(r"[^A-Za-z0-9_-]", "_", id)[:64]: one '_' per code point, not per byte. */
static inline void kvcm_segment_name(const char *instance_id, int64_t dp_rank, char *out,
                                     size_t len) {
    char safe[65], digest[11];
    size_t n = 0;
    const unsigned char *p = (const unsigned char *)kvcm__s(instance_id);
    for (; *p && n < 64; p++) {
        unsigned c = *p;
        if ((c & 0xC0) == 0x80) continue; /* a UTF-8 continuation byte: same code point */
        int ok = (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') ||
                 c == '_' || c == '-';
        safe[n++] = ok ? (char)c : '_';
    }
    safe[n] = 0;
    kvcm__sha1_hex10(kvcm__s(instance_id), digest);
    snprintf(out, len, "/kvcm.%s.%s.dp%lld", safe, digest, (long long)dp_rank);
}

/* ---- attach --------------------------------------------------------------------------- */
static inline uint64_t kvcm__random64(void) {
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, &v, sizeof v) != (ssize_t)sizeof v) v = 0;
        close(fd);
    }
    if (!v) v = kvcm__now_ns(CLOCK_REALTIME) * 0x9E3779B97F4A7C15ull ^ (uint64_t)getpid() << 32;
    return v | 1;
}

static inline uint64_t kvcm__pidns(void) {
    struct stat st;
    return stat("/proc/self/ns/pid", &st) == 0 ? (uint64_t)st.st_ino : 0;
}

static inline int kvcm__pid_alive(int64_t pid) {
    if (pid <= 0) return 0;
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

static inline int kvcm__valid_capacity(uint64_t c) {
    return c >= KVCM_MIN_CAPACITY && (c & (c - 1)) == 0 && c <= KVCM_MAX_CAPACITY;
}

__attribute__((format(printf, 3, 4))) static inline int kvcm__fail(kvcm_ring *r, int code,
                                                                   const char *fmt, ...) {
    char msg[400];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(r->reason, sizeof r->reason, "cannot attach ring %s: %s", r->name, msg);
    r->code = code;
    return code;
}

static inline int kvcm__errno_code(int e) {
    return e == EACCES || e == EPERM || e == EROFS ? KVCM_E_PERMISSION : KVCM_E_SYSTEM;
}

/* Map the ring segment, creating and initialising it if needed (segment.Segment). */
static inline int kvcm__map(kvcm_ring *r, uint64_t want_cap) {
    int fd = shm_open(r->name, O_RDWR | O_CREAT, 0600);
    if (fd < 0)
        return kvcm__fail(r, kvcm__errno_code(errno), "shm_open: %s", strerror(errno));
    int locked = 0;
    for (int i = 0; i < 100; i++) { /* ~50 ms: initialisation holds the lock for microseconds */
        if (flock(fd, LOCK_EX | LOCK_NB) == 0) {
            locked = 1;
            break;
        }
        if (errno != EWOULDBLOCK && errno != EINTR) break;
        struct timespec ts = {0, 500000};
        nanosleep(&ts, NULL);
    }
    if (!locked) {
        close(fd);
        return kvcm__fail(r, KVCM_E_BUSY, "ring segment %s is being initialised by another process",
                          r->name);
    }
    struct stat st;
    int rc = 0, created = 0;
    uint64_t *h = NULL;
    size_t size = 0;
    if (fstat(fd, &st) != 0) {
        rc = kvcm__fail(r, kvcm__errno_code(errno), "fstat: %s", strerror(errno));
        goto unlock;
    }
    size = (size_t)st.st_size;
    if (size == 0) {
        uint64_t cap = want_cap ? want_cap : KVCM_DEFAULT_CAPACITY_SLOTS;
        size = KVCM_HEADER_SIZE + (size_t)cap * KVCM_SLOT_SIZE;
        if (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)size) != 0) {
            rc = kvcm__fail(r, kvcm__errno_code(errno), "ftruncate: %s", strerror(errno));
            goto unlock;
        }
        created = 1;
    }
    if (size < KVCM_HEADER_SIZE) {
        rc = kvcm__fail(r, KVCM_E_CORRUPT, "ring segment %s: %zu bytes, shorter than the header",
                        r->name, size);
        goto unlock;
    }
    r->map = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (r->map == MAP_FAILED) {
        r->map = NULL;
        rc = kvcm__fail(r, kvcm__errno_code(errno), "mmap: %s", strerror(errno));
        goto unlock;
    }
    r->map_len = size;
    h = (uint64_t *)r->map;
    if (created || KVCM__LOAD(&h[KVCM_W_MAGIC], KVCM__ACQ) == 0) {
        /* Empty, or half-initialised by a creator that died inside this lock. */
        memset(h, 0, KVCM_HEADER_SIZE);
        h[KVCM_W_VERSION_SLOT] = KVCM_LAYOUT_VERSION | ((uint64_t)KVCM_SLOT_SIZE << 32);
        h[KVCM_W_CAPACITY] = (size - KVCM_HEADER_SIZE) / KVCM_SLOT_SIZE;
        h[KVCM_W_HEADER_SIZE] = KVCM_HEADER_SIZE;
        h[KVCM_W_CREATED_NS] = kvcm__now_ns(CLOCK_REALTIME);
        /* release: a non-zero magic means every header word above is visible */
        KVCM__STORE(&h[KVCM_W_MAGIC], KVCM_MAGIC, KVCM__REL);
    }
unlock:
    flock(fd, LOCK_UN);
    close(fd);
    if (rc) return rc;
    /* segment._validate */
    uint64_t magic = KVCM__LOAD(&h[KVCM_W_MAGIC], KVCM__ACQ);
    if (magic != KVCM_MAGIC)
        return kvcm__fail(r, KVCM_E_CORRUPT, "ring segment %s: bad magic %#llx", r->name,
                          (unsigned long long)magic);
    uint32_t version = (uint32_t)h[KVCM_W_VERSION_SLOT];
    uint32_t slot = (uint32_t)(h[KVCM_W_VERSION_SLOT] >> 32);
    if (version > KVCM_LAYOUT_VERSION)
        return kvcm__fail(r, KVCM_E_LAYOUT,
                          "ring layout v%u is newer than this side understands (max v%u): "
                          "upgrade the sidecar image first", version, KVCM_LAYOUT_VERSION);
    if (version < KVCM_OLDEST_READABLE_VERSION)
        return kvcm__fail(r, KVCM_E_LAYOUT,
                          "ring layout v%u is older than supported (min v%u): upgrade the "
                          "engine image", version, KVCM_OLDEST_READABLE_VERSION);
    if (slot != KVCM_SLOT_SIZE)
        return kvcm__fail(r, KVCM_E_LAYOUT, "ring slot size %u != %u: layout mismatch", slot,
                          KVCM_SLOT_SIZE);
    uint64_t cap = h[KVCM_W_CAPACITY];
    if (h[KVCM_W_HEADER_SIZE] != KVCM_HEADER_SIZE || !kvcm__valid_capacity(cap))
        return kvcm__fail(r, KVCM_E_CORRUPT, "ring segment %s: corrupt header (capacity %llu)",
                          r->name, (unsigned long long)cap);
    if (size < KVCM_HEADER_SIZE + cap * KVCM_SLOT_SIZE)
        return kvcm__fail(r, KVCM_E_CORRUPT, "ring segment %s: %zu bytes < capacity %llu",
                          r->name, size, (unsigned long long)cap);
    if (want_cap && want_cap != cap)
        return kvcm__fail(r, KVCM_E_CAPACITY,
                          "ring segment %s has capacity %llu, this side asked for %llu: set the "
                          "same ring capacity on both sides", r->name, (unsigned long long)cap,
                          (unsigned long long)want_cap);
    r->hdr = h;
    r->cap = cap;
    r->mask = cap - 1;
    r->slots = (uint64_t *)(void *)((char *)r->map + KVCM_HEADER_SIZE);
    if (created) memset(r->slots, 0, (size_t)cap * KVCM_SLOT_SIZE); /* fault the pages in now */
    return 0;
}

static inline void kvcm__unmap(kvcm_ring *r) {
    if (r->map) munmap(r->map, r->map_len);
    if (r->snap_map) munmap(r->snap_map, r->snap_len);
    r->map = r->snap_map = NULL;
    r->hdr = r->slots = NULL;
}

/* Attach this replica (instance_id + dp_rank in `d`) to its ring, creating the segment if the
 * sidecar has not. Always sets *out to a handle every kvcm_ring_* call accepts (NULL only if
 * malloc failed, and NULL is accepted too). Returns KVCM_OK when publishing, KVCM_GATED for a
 * rank the gating rules exclude, or a KVCM_E_* code; kvcm_ring_reason() says why. */
static inline int kvcm_ring_attach(const kvcm_descriptor *d, kvcm_ring **out) {
    kvcm_ring *r = (kvcm_ring *)calloc(1, sizeof *r);
    char err[400], gate[200], json[KVCM_DESCRIPTOR_MAX + 1];
    *out = r;
    if (!r) return KVCM_E_SYSTEM;
    pthread_mutex_init(&r->chores_mu, NULL);
    r->st.reason = r->reason;
    r->st.ring_name = r->name;
    if (!d) {
        snprintf(r->reason, sizeof r->reason, "invalid config: no descriptor");
        return r->code = KVCM_E_CONFIG;
    }
    if (d->error[0]) {
        snprintf(r->reason, sizeof r->reason, "invalid config: %s", d->error);
        return r->code = KVCM_E_CONFIG;
    }
    if (kvcm__validate(d, r, err, sizeof err)) {
        snprintf(r->reason, sizeof r->reason, "invalid config: %s", err);
        return r->code = KVCM_E_CONFIG;
    }
    const char *why = kvcm__gate(d, gate, sizeof gate);
    if (why) {
        snprintf(r->reason, sizeof r->reason, "%s", why);
        return r->code = KVCM_GATED;
    }
    if (*kvcm__s(d->ring_name))
        snprintf(r->name, sizeof r->name, "%s", d->ring_name);
    else
        kvcm_segment_name(d->instance_id, d->dp_rank, r->name, sizeof r->name);
    if (d->ring_capacity_slots && !kvcm__valid_capacity(d->ring_capacity_slots))
        return kvcm__fail(r, KVCM_E_CONFIG,
                          "ring capacity %llu must be a power of two in [8, 2^26]",
                          (unsigned long long)d->ring_capacity_slots);
    size_t jn = kvcm__descriptor_json(d, json, KVCM_DESCRIPTOR_MAX);
    if (jn == (size_t)-1)
        return kvcm__fail(r, KVCM_E_CONFIG, "descriptor is longer than max %u bytes",
                          KVCM_DESCRIPTOR_MAX);
    int rc = kvcm__map(r, d->ring_capacity_slots);
    if (rc) {
        kvcm__unmap(r);
        return rc;
    }
    uint64_t *h = r->hdr;
    int64_t other = (int64_t)h[KVCM_W_PID];
    uint64_t pidns = kvcm__pidns();
    if (KVCM__LOAD(&h[KVCM_W_PRODUCER_STATE], KVCM__ACQ) == KVCM_PRODUCER_ATTACHED &&
        other != (int64_t)getpid() && h[KVCM_W_PIDNS] == pidns && kvcm__pid_alive(other)) {
        kvcm__unmap(r);
        return kvcm__fail(r, KVCM_E_CONFLICT, "ring %s already has a live producer pid=%lld",
                          r->name, (long long)other);
    }
    r->boot_id = kvcm__random64();
    r->tail = KVCM__LOAD(&h[KVCM_W_TAIL], KVCM__RLX);
    r->head_cache = KVCM__LOAD(&h[KVCM_W_HEAD], KVCM__ACQ);
    /* A reader cursor outside [tail - capacity, tail] is garbage: take the ring as empty, as
     * the reader does when it starts (it skips to the tail). */
    if (r->tail - r->head_cache > r->cap) r->head_cache = r->tail;
    /* head_seen: the producer's cached head, in the header as the Python hook keeps it (no
     * reader looks at it; this producer reads its own copy in r) */
    KVCM__STORE(&h[KVCM_W_HEAD_SEEN], r->head_cache, KVCM__RLX);
    r->dropped = h[KVCM_W_DROPPED];
    r->attempted = h[KVCM_W_ATTEMPTED];
    r->seq = 0;
    r->ngroups = d->n_groups;
    memcpy((char *)r->map + KVCM_DESCRIPTOR_OFFSET, json, jn);
    KVCM__STORE(&h[KVCM_W_DESCRIPTOR_LEN], (uint64_t)jn, KVCM__REL); /* after the bytes */
    /* The incarnation under the seqlock: odd generation, release fence, the words, then the even
     * generation with release, so a reader that sees the same even value twice saw one whole
     * incarnation (it loads the generation with acquire before and after the words). */
    uint64_t gen = KVCM__LOAD(&h[KVCM_W_INC_GEN], KVCM__RLX) | 1;
    KVCM__STORE(&h[KVCM_W_INC_GEN], gen, KVCM__RLX);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    KVCM__STORE(&h[KVCM_W_BOOT_ID], r->boot_id, KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_PID], (uint64_t)getpid(), KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_START_NS], kvcm__now_ns(CLOCK_REALTIME), KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_INC_START_POS], r->tail, KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_PIDNS], pidns, KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_LAST_SEQ], (uint64_t)0, KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_INC_GEN], gen + 1, KVCM__REL);
    KVCM__STORE(&h[KVCM_W_LIVENESS_NS], kvcm__now_ns(CLOCK_MONOTONIC), KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_PRODUCER_STATE], (uint64_t)KVCM_PRODUCER_ATTACHED, KVCM__REL);
    r->delay_ns = (long)(d->max_stage_delay_ms * 1e6);
    if (r->delay_ns < 100000) r->delay_ns = 100000;
    r->sink.nmediums = r->nmediums;
    r->bell_retry = 1;
    r->live = 1;
    r->code = KVCM_OK;
    r->st.enabled = 1;
    r->st.code = KVCM_OK;
    return KVCM_OK;
}

/* Why the handle does not publish ("" while it does). */
static inline const char *kvcm_ring_reason(const kvcm_ring *r) {
    return r ? r->reason : "out of memory at attach";
}

/* The ring index of medium `name` (0 for NULL, "" or the default medium), or -1. */
static inline int kvcm_ring_medium(const kvcm_ring *r, const char *name) {
    if (!name || !*name) return 0;
    if (!r) return -1;
    for (int i = 0; i < r->nmediums; i++)
        if (!strcmp(r->mediums[i], name)) return i;
    return -1;
}

/* ---- hot path (engine thread; calls on one handle must not run concurrently) ---------- */
static inline void kvcm__ring_bell(kvcm_ring *r) {
    if (!r->bell) {
        /* A missing doorbell (an older sidecar): retry only once per chores run, so an idle
         * flag with no semaphore never costs a syscall per event. */
        if (!KVCM__LOAD(&r->bell_retry, KVCM__RLX)) return;
        KVCM__STORE(&r->bell_retry, 0, KVCM__RLX);
        char bell[300];
        snprintf(bell, sizeof bell, "%s.bell", r->name);
        sem_t *s = sem_open(bell, 0);
        if (s == SEM_FAILED) {
            KVCM__BUMP(r->st.bell_unavailable, 1);
            return;
        }
        r->bell = s;
    }
    int v = 1;
    /* At most one post pending: a reader killed while asleep costs a userspace read only. */
    if (sem_getvalue(r->bell, &v) == 0 && v == 0 && sem_post(r->bell) == 0)
        KVCM__BUMP(r->st.bells, 1);
}

static inline void kvcm__write(kvcm_ring *r, const int64_t *keys, size_t n, uint64_t meta,
                               int one_key) {
    uint64_t *h = r->hdr;
    uint64_t used = r->tail - r->head_cache;
    uint64_t free_ = r->cap - used;
    if (free_ < n) {
        /* The cached head is stale at worst: one acquire load refreshes it (acquire: the
         * reader's copies out of those slots happen before our overwrites). A cursor outside
         * [tail - capacity, tail] is garbage: keep the cached one. */
        uint64_t head = KVCM__LOAD(&h[KVCM_W_HEAD], KVCM__ACQ);
        if (r->tail - head <= r->cap) {
            r->head_cache = head;
            KVCM__STORE(&h[KVCM_W_HEAD_SEEN], head, KVCM__RLX);
        }
        free_ = r->cap - (r->tail - r->head_cache);
    }
    size_t m = n <= free_ ? n : (size_t)free_;
    uint64_t tail = r->tail, seq = r->seq, mask = r->mask;
    uint64_t *slots = r->slots;
    for (size_t i = 0; i < m; i++) {
        uint64_t *s = slots + ((tail & mask) << 2);
        KVCM__STORE(&s[1], one_key ? 0 : (uint64_t)keys[i], KVCM__RLX);
        KVCM__STORE(&s[2], meta, KVCM__RLX);
        KVCM__STORE(&s[3], (uint64_t)0, KVCM__RLX);
        /* release: the payload is visible before the seq that validates it */
        KVCM__STORE(&s[0], ++seq, KVCM__REL);
        tail++;
    }
    r->seq = seq;
    r->tail = tail;
    r->attempted += n;
    if (m < n) {
        r->dropped += n - m; /* drop-newest: the records after the m accepted ones */
        KVCM__STORE(&h[KVCM_W_DROPPED], r->dropped, KVCM__REL);
    }
    KVCM__STORE(&h[KVCM_W_ATTEMPTED], r->attempted, KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_LAST_SEQ], seq, KVCM__REL);
    /* release, the publishing store: every slot and counter above is visible before it */
    KVCM__STORE(&h[KVCM_W_TAIL], tail, KVCM__REL);
    /* Relaxed, no StoreLoad fence (the Python producer has none either): on a rare interleaving
     * both sides miss each other and the sidecar's poll interval bounds the delay. */
    if (m && KVCM__LOAD(&h[KVCM_W_READER_IDLE], KVCM__RLX)) kvcm__ring_bell(r);
}

static inline int kvcm__check(kvcm_ring *r, int group, int medium) {
    if (!r) return 0;
    if (__builtin_expect(!r->live, 0)) {
        if (r->closed) KVCM__BUMP(r->st.after_close, 1);
        return 0;
    }
    if (__builtin_expect((unsigned)medium >= (unsigned)r->nmediums, 0)) {
        KVCM__BUMP_SHARED(r->st.bad_medium, 1);
        return 0;
    }
    if (__builtin_expect((unsigned)group >= (unsigned)r->ngroups, 0)) {
        KVCM__BUMP(r->st.bad_group, 1);
        return 0;
    }
    return 1;
}

static inline void kvcm__report(kvcm_ring *r, uint64_t kind, const int64_t *keys, size_t n,
                                int group, int medium) {
    if (!kvcm__check(r, group, medium) || n == 0) return;
    if (__builtin_expect(!keys, 0)) {
        KVCM__BUMP(r->st.bad_key, 1);
        return;
    }
    kvcm__write(r, keys, n, kind | (uint64_t)group << 8 | (uint64_t)medium << 16, 0);
}

/* Blocks with these keys (KVCM's signed 64-bit pattern; a uint64_t array may be cast) now hold
 * `group`'s KV in `medium` (a ring index from kvcm_ring_medium(); 0 = the default medium).
 * n = 1 with &key for one key. Never blocks, never fails: problems are counted. */
static inline void kvcm_ring_stored(kvcm_ring *r, const int64_t *keys, size_t n, int group,
                                    int medium) {
    kvcm__report(r, KVCM_KIND_STORED, keys, n, group, medium);
}

/* Blocks with these keys no longer hold `group`'s KV in `medium` (evicted or freed). */
static inline void kvcm_ring_removed(kvcm_ring *r, const int64_t *keys, size_t n, int group,
                                     int medium) {
    kvcm__report(r, KVCM_KIND_REMOVED, keys, n, group, medium);
}

/* Every block of every group and medium is gone (cache reset). */
static inline void kvcm_ring_cleared(kvcm_ring *r) {
    if (!kvcm__check(r, 0, 0)) return;
    kvcm__write(r, NULL, 1, (uint64_t)KVCM_KIND_CLEARED, 1);
}

/* ---- snapshots ------------------------------------------------------------------------ */
static inline int kvcm__sink_grow(kvcm_snapshot *s, size_t want) {
    size_t cap = s->cap ? s->cap : 1024;
    while (cap < want) cap *= 2;
    int64_t *k = (int64_t *)realloc(s->keys, cap * sizeof *k);
    if (k) s->keys = k;
    uint32_t *m = (uint32_t *)realloc(s->masks, cap * sizeof *m);
    if (m) s->masks = m;
    uint8_t *d = (uint8_t *)realloc(s->mediums, cap);
    if (d) s->mediums = d;
    if (!k || !m || !d) {
        s->oom = 1;
        return -1;
    }
    s->cap = cap;
    return 0;
}

/* One snapshot entry: `key` holds the groups in `group_mask` (bit g = group g) in `medium`. A
 * (key, medium) may repeat (the bits are ORed); mask 0 means not held. Returns 0 or -1. */
static inline int kvcm_snapshot_add(kvcm_snapshot *s, int64_t key, uint32_t group_mask,
                                    int medium) {
    if ((unsigned)medium >= (unsigned)s->nmediums) {
        s->bad_medium++;
        return -1;
    }
    if (s->n == s->cap && kvcm__sink_grow(s, s->n + 1)) return -1;
    s->keys[s->n] = key;
    s->masks[s->n] = group_mask;
    s->mediums[s->n] = (uint8_t)medium;
    s->n++;
    return 0;
}

/* n entries at once; `mediums` may be NULL (all the default medium). Returns 0 or -1. */
static inline int kvcm_snapshot_add_many(kvcm_snapshot *s, const int64_t *keys,
                                         const uint32_t *masks, const uint8_t *mediums, size_t n) {
    if (s->n + n > s->cap && kvcm__sink_grow(s, s->n + n)) return -1;
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        int m = mediums ? mediums[i] : 0;
        if (m >= s->nmediums) {
            s->bad_medium++;
            rc = -1;
            continue;
        }
        s->keys[s->n] = keys[i];
        s->masks[s->n] = masks[i];
        s->mediums[s->n] = (uint8_t)m;
        s->n++;
    }
    return rc;
}

/* Set (or clear with NULL) the engine's snapshot callback. Without one, snapshot requests are
 * answered as failed and counted: a C engine must enumerate its own cache (there is no
 * resident-set fallback as in the Python hook). */
static inline void kvcm_ring_set_snapshot(kvcm_ring *r, kvcm_snapshot_fn fn, void *ctx) {
    if (!r) return;
    pthread_mutex_lock(&r->chores_mu);
    r->snap_fn = fn;
    r->snap_ctx = ctx;
    pthread_mutex_unlock(&r->chores_mu);
}

/* The companion segment <ring>.snap, grown (never shrunk) to hold `entries` (SnapshotWriter). */
static inline int kvcm__snap_ensure(kvcm_ring *r, uint64_t entries) {
    if (r->snap_map && entries <= r->snap_cap) return 0;
    uint64_t cap = entries;
    if (cap < 1024) cap = 1024;
    if (cap < r->snap_cap * 2) cap = r->snap_cap * 2;
    if (r->snap_map) munmap(r->snap_map, r->snap_len);
    r->snap_map = NULL;
    char name[300];
    snprintf(name, sizeof name, "%s.snap", r->name);
    int fd = shm_open(name, O_RDWR | O_CREAT, 0600);
    if (fd < 0) return -1;
    struct stat st;
    size_t want = KVCM_SNAP_HEADER_SIZE + (size_t)cap * KVCM_SNAP_ENTRY_BYTES;
    int ok = fchmod(fd, 0600) == 0 && fstat(fd, &st) == 0;
    if (ok && (size_t)st.st_size < want)
        ok = ftruncate(fd, (off_t)want) == 0 && fstat(fd, &st) == 0;
    void *m = MAP_FAILED;
    if (ok) m = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return -1;
    r->snap_map = m;
    r->snap_len = (size_t)st.st_size;
    r->snap_cap = (r->snap_len - KVCM_SNAP_HEADER_SIZE) / KVCM_SNAP_ENTRY_BYTES;
    return 0;
}

static inline void kvcm__snap_fail(kvcm_ring *r, uint64_t req) {
    KVCM__STORE(&r->hdr[KVCM_W_SNAP_STATUS], (uint64_t)KVCM_SNAP_FAILED, KVCM__RLX);
    KVCM__STORE(&r->hdr[KVCM_W_SNAP_RESP], req, KVCM__REL); /* release: status before resp */
    KVCM__BUMP(r->st.snapshot_failed, 1);
}

static inline void kvcm__answer(kvcm_ring *r, uint64_t req) {
    uint64_t *h = r->hdr;
    uint64_t t0 = kvcm__now_ns(CLOCK_MONOTONIC);
    /* The fence: dropped first, then last_seq (acquire both: the engine stores them with
     * release). A drop after this load raises `dropped` above snap_dropped, so the reader asks
     * again; a transition before it is in the engine state the callback enumerates next. */
    uint64_t dropped = KVCM__LOAD(&h[KVCM_W_DROPPED], KVCM__ACQ);
    uint64_t fence = KVCM__LOAD(&h[KVCM_W_LAST_SEQ], KVCM__ACQ);
    kvcm_snapshot *s = &r->sink;
    s->n = 0;
    s->oom = 0;
    s->bad_medium = 0;
    if (!r->snap_fn) {
        KVCM__BUMP(r->st.snapshot_no_callback, 1);
        kvcm__snap_fail(r, req);
        return;
    }
    int rc = r->snap_fn(r->snap_ctx, s);
    if (s->bad_medium) KVCM__BUMP_SHARED(r->st.bad_medium, s->bad_medium);
    if (rc != 0 || s->oom) {
        if (s->oom) KVCM__BUMP(r->st.internal, 1);
        kvcm__snap_fail(r, req);
        return;
    }
    if (kvcm__snap_ensure(r, s->n) != 0) {
        KVCM__BUMP(r->st.internal, 1);
        kvcm__snap_fail(r, req);
        return;
    }
    uint64_t cap = r->snap_cap, n = s->n;
    unsigned char *base = (unsigned char *)r->snap_map;
    uint64_t *sh = (uint64_t *)r->snap_map;
    if (n) { /* an empty table has no arrays yet (memcpy from NULL is undefined even for 0) */
        memcpy(base + KVCM_SNAP_HEADER_SIZE, s->keys, n * 8);
        memcpy(base + KVCM_SNAP_HEADER_SIZE + 8 * cap, s->masks, n * 4);
        memcpy(base + KVCM_SNAP_HEADER_SIZE + 12 * cap, s->mediums, n);
    }
    KVCM__STORE(&sh[KVCM_SW_COUNT], n, KVCM__RLX);
    KVCM__STORE(&sh[KVCM_SW_CAPACITY], cap, KVCM__RLX);
    KVCM__STORE(&sh[KVCM_SW_FLAGS], (uint64_t)KVCM_SNAP_FLAG_MEDIUMS, KVCM__RLX);
    KVCM__STORE(&sh[KVCM_SW_REQ], req, KVCM__RLX);
    KVCM__STORE(&sh[KVCM_SW_MAGIC], KVCM_SNAP_MAGIC, KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_SNAP_SEQ], fence, KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_SNAP_COUNT], n, KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_SNAP_DROPPED], dropped, KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_SNAP_BOOT_ID], r->boot_id, KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_SNAP_BYTES], KVCM_SNAP_HEADER_SIZE + cap * KVCM_SNAP_ENTRY_BYTES,
                KVCM__RLX);
    KVCM__STORE(&h[KVCM_W_SNAP_STATUS], (uint64_t)KVCM_SNAP_OK, KVCM__RLX);
    /* release, last: the entries and every word above are visible before the answer */
    KVCM__STORE(&h[KVCM_W_SNAP_RESP], req, KVCM__REL);
    KVCM__BUMP(r->st.snapshots, 1);
    KVCM__STORE(&r->st.snapshot_last_entries, n, KVCM__RLX);
    KVCM__STORE(&r->st.snapshot_last_stall_ns, kvcm__now_ns(CLOCK_MONOTONIC) - t0, KVCM__RLX);
}

/* Liveness stamp and snapshot answers; returns 1 if a snapshot request was answered. */
static inline int kvcm__chores(kvcm_ring *r) {
    if (pthread_mutex_trylock(&r->chores_mu) != 0) {
        KVCM__BUMP(r->st.poll_busy, 1);
        return 0;
    }
    int answered = 0;
    if (r->live) {
        uint64_t *h = r->hdr;
        KVCM__STORE(&h[KVCM_W_LIVENESS_NS], kvcm__now_ns(CLOCK_MONOTONIC), KVCM__RLX);
        KVCM__STORE(&r->bell_retry, 1, KVCM__RLX);
        uint64_t req = KVCM__LOAD(&h[KVCM_W_SNAP_REQ], KVCM__ACQ);
        if (req > KVCM__LOAD(&h[KVCM_W_SNAP_RESP], KVCM__RLX)) {
            kvcm__answer(r, req);
            answered = 1;
        }
        KVCM__BUMP(r->st.polls, 1);
    }
    pthread_mutex_unlock(&r->chores_mu);
    return answered;
}

/* Run once per engine step (or let kvcm_ring_start_thread do it): stamps liveness (the sidecar
 * declares a producer dead after engine.stale_after_s without a stamp) and answers a pending
 * snapshot request through the callback. Never blocks: if the helper thread is busy it
 * returns at once. Returns 1 if it answered a snapshot request. */
static inline int kvcm_ring_poll(kvcm_ring *r) {
    if (!r || !r->live) return 0;
    return kvcm__chores(r);
}

static inline void *kvcm__thread_main(void *arg) {
    kvcm_ring *r = (kvcm_ring *)arg;
    pthread_mutex_lock(&r->wait_mu);
    while (!r->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        ts.tv_nsec += r->delay_ns;
        ts.tv_sec += ts.tv_nsec / 1000000000L;
        ts.tv_nsec %= 1000000000L;
        pthread_cond_timedwait(&r->wait_cv, &r->wait_mu, &ts);
        if (r->stop) break;
        pthread_mutex_unlock(&r->wait_mu);
        kvcm__chores(r);
        pthread_mutex_lock(&r->wait_mu);
    }
    pthread_mutex_unlock(&r->wait_mu);
    return NULL;
}

/* Start the optional helper thread: kvcm_ring_poll's work every max_stage_delay_ms, so an
 * engine that goes idle stays alive to the sidecar and still answers snapshots. Returns 0, or
 * -1 (counted as internal) if the thread could not start; the engine can then call poll. */
static inline int kvcm_ring_start_thread(kvcm_ring *r) {
    if (!r || !r->live) return -1;
    if (r->thread_started) return 0;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&r->wait_cv, &ca);
    pthread_condattr_destroy(&ca);
    pthread_mutex_init(&r->wait_mu, NULL);
    r->stop = 0;
    if (pthread_create(&r->thread, NULL, kvcm__thread_main, r) != 0) {
        pthread_cond_destroy(&r->wait_cv);
        pthread_mutex_destroy(&r->wait_mu);
        KVCM__BUMP(r->st.internal, 1);
        return -1;
    }
    r->thread_started = 1;
    return 0;
}

/* ---- introspection and shutdown ------------------------------------------------------- */
/* Copy the counters into *out (the strings stay owned by the handle). Call it where the
 * publishing calls are made (the engine thread or under its lock). */
static inline void kvcm_ring_stats(const kvcm_ring *r, kvcm_stats *out) {
    if (!r) {
        memset(out, 0, sizeof *out);
        out->code = KVCM_E_SYSTEM;
        out->reason = "out of memory at attach";
        out->ring_name = "";
        return;
    }
    const kvcm_stats *s = &r->st;
    memset(out, 0, sizeof *out);
#define KVCM__CP(f) out->f = KVCM__LOAD(&s->f, KVCM__RLX)
    KVCM__CP(bells); KVCM__CP(polls); KVCM__CP(poll_busy); KVCM__CP(snapshots);
    KVCM__CP(snapshot_failed); KVCM__CP(snapshot_no_callback); KVCM__CP(snapshot_last_entries);
    KVCM__CP(snapshot_last_stall_ns); KVCM__CP(bad_group); KVCM__CP(bad_medium);
    KVCM__CP(bad_key); KVCM__CP(after_close); KVCM__CP(bell_unavailable); KVCM__CP(internal);
#undef KVCM__CP
    out->enabled = r->live;
    out->code = r->code;
    out->closed = r->closed;
    out->thread_alive = r->thread_started;
    out->boot_id = r->boot_id;
    out->last_seq = r->seq;
    out->attempted = r->attempted;
    out->dropped = r->dropped;
    out->reason = r->reason;
    out->ring_name = r->name;
}

/* Clean close: stop the helper thread, mark the producer closed (the sidecar then withdraws
 * this replica's keys at once), unmap. The handle stays valid as a no-op that counts later
 * calls (after_close); kvcm_ring_free releases it. Idempotent. Call from the engine thread. */
static inline void kvcm_ring_close(kvcm_ring *r) {
    if (!r || r->closed || !r->live) return;
    if (r->thread_started) {
        pthread_mutex_lock(&r->wait_mu);
        r->stop = 1;
        pthread_cond_signal(&r->wait_cv);
        pthread_mutex_unlock(&r->wait_mu);
        pthread_join(r->thread, NULL);
        pthread_cond_destroy(&r->wait_cv);
        pthread_mutex_destroy(&r->wait_mu);
        r->thread_started = 0;
    }
    pthread_mutex_lock(&r->chores_mu); /* waits for a snapshot answer in progress, if any */
    uint64_t *h = r->hdr;
    if (KVCM__LOAD(&h[KVCM_W_BOOT_ID], KVCM__RLX) == r->boot_id)
        KVCM__STORE(&h[KVCM_W_PRODUCER_STATE], (uint64_t)KVCM_PRODUCER_CLOSED, KVCM__REL);
    r->live = 0;
    r->closed = 1;
    kvcm__unmap(r);
    if (r->bell) sem_close(r->bell);
    r->bell = NULL;
    free(r->sink.keys);
    free(r->sink.masks);
    free(r->sink.mediums);
    memset(&r->sink, 0, sizeof r->sink);
    snprintf(r->reason, sizeof r->reason, "closed");
    pthread_mutex_unlock(&r->chores_mu);
}

/* Close (if needed) and release the handle. */
static inline void kvcm_ring_free(kvcm_ring *r) {
    if (!r) return;
    kvcm_ring_close(r);
    kvcm__unmap(r);
    pthread_mutex_destroy(&r->chores_mu);
    free(r);
}

#ifdef __cplusplus
} /* extern "C" */
#endif
#endif /* KVCM_RING_H */
