/* A C engine for the tests: publishes through kvcm_ring.h, driven by lines on stdin.
 *
 *   kvcm_test_engine cache RING INSTANCE CAPACITY SEED THREAD   (end-to-end tests)
 *     stdin: {"op":"work","n":N} | {"op":"flood","n":N} | {"op":"truth"} | {"op":"exit"}
 *     stdout: {"ready":...} once attached, then one {"published":[...],"stats":{...}} per line
 *   kvcm_test_engine ops RING CAPACITY                (conformance with the Python hook)
 *     stdin: "stored G M K..." | "removed G M K..." | "cleared" | "poll" | "stats" | "close"
 *   kvcm_test_engine env                              (descriptor from KV_CACHE_EVENT_*)
 *
 * THREAD 1 runs the helper thread; 0 polls stdin with a 2 ms timeout and calls kvcm_ring_poll.
 * The cache holds (key -> group mask) for groups 0 and 1 in an open-addressing table; a key is
 * published when it holds both (required_groups 0,1), as engine_hook/block_cache.py does.
 */
#include "kvcm_ring.h"

#include <inttypes.h>
#include <poll.h>

/* ---- a tiny (key, medium) -> mask table ------------------------------------------------ */
typedef struct {
    int64_t key;
    uint32_t mask;
    uint8_t medium, used;
} entry;

typedef struct {
    entry *e;
    size_t cap, n;
    pthread_mutex_t mu; /* the snapshot callback may run on the helper thread */
} table;

static uint64_t mix(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static entry *slot(table *t, int64_t key, int medium, int insert) {
    size_t i = mix((uint64_t)key ^ (uint64_t)medium << 56) & (t->cap - 1);
    for (;; i = (i + 1) & (t->cap - 1)) {
        entry *e = &t->e[i];
        if (!e->used) {
            if (!insert) return NULL;
            e->used = 1;
            e->key = key;
            e->medium = (uint8_t)medium;
            e->mask = 0;
            t->n++;
            return e;
        }
        if (e->key == key && e->medium == medium) return e;
    }
}

static void table_init(table *t, size_t cap) {
    t->cap = cap;
    t->n = 0;
    t->e = (entry *)calloc(cap, sizeof *t->e);
    pthread_mutex_init(&t->mu, NULL);
}

/* Removed keys keep their entry with mask 0 (a snapshot treats those as not held). */
static void apply(table *t, int kind, int group, int medium, int64_t key) {
    if (kind == KVCM_KIND_CLEARED) {
        memset(t->e, 0, t->cap * sizeof *t->e);
        t->n = 0;
        return;
    }
    entry *e = slot(t, key, medium, kind == KVCM_KIND_STORED);
    if (!e) return;
    if (kind == KVCM_KIND_STORED) e->mask |= 1u << group;
    else e->mask &= ~(1u << group);
}

static int snapshot_cb(void *ctx, kvcm_snapshot *snap) {
    table *t = (table *)ctx;
    int rc = 0;
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->cap && rc == 0; i++)
        if (t->e[i].used && t->e[i].mask)
            rc = kvcm_snapshot_add(snap, t->e[i].key, t->e[i].mask, t->e[i].medium);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* ---- output ------------------------------------------------------------------------ */
static void print_stats(kvcm_ring *r) {
    kvcm_stats s;
    kvcm_ring_stats(r, &s);
    printf("{\"enabled\":%d,\"code\":%d,\"closed\":%d,\"boot_id\":%" PRIu64 ",\"last_seq\":%" PRIu64
           ",\"attempted\":%" PRIu64 ",\"dropped\":%" PRIu64 ",\"bells\":%" PRIu64
           ",\"polls\":%" PRIu64 ",\"snapshots\":%" PRIu64 ",\"snapshot_failed\":%" PRIu64
           ",\"snapshot_no_callback\":%" PRIu64 ",\"bad_group\":%" PRIu64 ",\"bad_medium\":%" PRIu64
           ",\"bad_key\":%" PRIu64 ",\"after_close\":%" PRIu64 ",\"internal\":%" PRIu64
           ",\"thread_alive\":%d,\"ring\":\"%s\",\"reason\":\"",
           s.enabled, s.code, s.closed, s.boot_id, s.last_seq, s.attempted, s.dropped, s.bells,
           s.polls, s.snapshots, s.snapshot_failed, s.snapshot_no_callback, s.bad_group,
           s.bad_medium, s.bad_key, s.after_close, s.internal, s.thread_alive, s.ring_name);
    for (const char *p = s.reason; *p; p++) printf(*p == '"' || *p == '\\' ? "\\%c" : "%c", *p);
    printf("\"}");
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static void print_published(table *t, kvcm_ring *r) {
    int64_t *keys = (int64_t *)malloc((t->n + 1) * sizeof *keys);
    size_t n = 0;
    pthread_mutex_lock(&t->mu);
    for (size_t i = 0; i < t->cap; i++)
        if (t->e[i].used && t->e[i].medium == 0 && (t->e[i].mask & 3u) == 3u)
            keys[n++] = t->e[i].key;
    pthread_mutex_unlock(&t->mu);
    qsort(keys, n, sizeof *keys, cmp_i64);
    printf("{\"published\":[");
    for (size_t i = 0; i < n; i++) printf(i ? ",%" PRId64 : "%" PRId64, keys[i]);
    printf("],\"stats\":");
    print_stats(r);
    printf("}\n");
    fflush(stdout);
    free(keys);
}

/* ---- line input that lets poll mode keep polling while waiting ---------------------- */
static char inbuf[1 << 20];
static size_t inlen;

static char *next_line(kvcm_ring *r, int polling) {
    for (;;) {
        char *nl = (char *)memchr(inbuf, '\n', inlen);
        if (nl) {
            static char line[1 << 20];
            size_t n = (size_t)(nl - inbuf);
            memcpy(line, inbuf, n);
            line[n] = 0;
            memmove(inbuf, nl + 1, inlen - n - 1);
            inlen -= n + 1;
            return line;
        }
        if (polling) {
            struct pollfd p = {0, POLLIN, 0};
            kvcm_ring_poll(r);
            if (poll(&p, 1, 2) <= 0) continue;
        }
        ssize_t got = read(0, inbuf + inlen, sizeof inbuf - inlen);
        if (got <= 0) return NULL;
        inlen += (size_t)got;
    }
}

static long json_int(const char *line, const char *field) {
    const char *p = strstr(line, field);
    if (!p) return 0;
    p = strchr(p + strlen(field), ':');
    return p ? strtol(p + 1, NULL, 10) : 0;
}

/* ---- modes ----------------------------------------------------------------------------- */
static uint64_t rng_state;
static uint64_t rnd(void) { return mix(rng_state++); }

static void report(kvcm_ring *r, table *t, int kind, int group, const int64_t *keys, size_t n) {
    pthread_mutex_lock(&t->mu); /* the engine's own state first, then the hook */
    for (size_t i = 0; i < n; i++) apply(t, kind, group, 0, keys[i]);
    pthread_mutex_unlock(&t->mu);
    if (kind == KVCM_KIND_STORED) kvcm_ring_stored(r, keys, n, group, 0);
    else kvcm_ring_removed(r, keys, n, group, 0);
}

static int cache_mode(char **argv) {
    kvcm_descriptor d;
    kvcm_ring *r;
    table t;
    kvcm_descriptor_init(&d);
    d.instance_id = argv[3];
    d.ring_name = argv[2];
    d.ring_capacity_slots = (uint64_t)strtoull(argv[4], NULL, 10);
    rng_state = (uint64_t)strtoull(argv[5], NULL, 10) * 1000003u;
    int threaded = atoi(argv[6]);
    d.block_size_tokens = 4;
    d.group_block_bytes[0] = 4096;
    d.group_block_bytes[1] = 1024;
    d.n_groups = 2;
    d.required_groups[0] = 0;
    d.required_groups[1] = 1;
    d.n_required = 2;
    d.max_stage_delay_ms = 2.0;
    int rc = kvcm_ring_attach(&d, &r);
    if (rc != KVCM_OK) {
        printf("{\"ready\":false,\"code\":%d}\n", rc);
        fflush(stdout);
        return 3;
    }
    table_init(&t, 1 << 16);
    kvcm_ring_set_snapshot(r, snapshot_cb, &t);
    if (threaded) kvcm_ring_start_thread(r);
    kvcm_stats s;
    kvcm_ring_stats(r, &s);
    printf("{\"ready\":true,\"boot_id\":%" PRIu64 ",\"pid\":%d}\n", s.boot_id, (int)getpid());
    fflush(stdout);
    /* Keys in 12 "prefixes" of 40 keys each, plus a private tail per request: over the whole
     * signed 64-bit range, so KVCM's signed pattern is exercised. */
    char *line;
    while ((line = next_line(r, !threaded)) != NULL) {
        long n = json_int(line, "\"n\"");
        if (strstr(line, "\"work\"")) {
            for (long i = 0; i < n; i++) {
                int64_t keys[64];
                size_t k = 0;
                if (rnd() % 20 == 0) { /* evict one published key from one or both groups */
                    int64_t key = (int64_t)mix(rnd() % 12 * 1000 + rnd() % 40);
                    int which = (int)(rnd() % 3);
                    if (which != 1) report(r, &t, KVCM_KIND_REMOVED, 0, &key, 1);
                    if (which != 0) report(r, &t, KVCM_KIND_REMOVED, 1, &key, 1);
                    continue;
                }
                uint64_t prefix = rnd() % 12, len = 8 + rnd() % 32, tail = rnd() % 8;
                for (uint64_t j = 0; j < len; j++) keys[k++] = (int64_t)mix(prefix * 1000 + j);
                for (uint64_t j = 0; j < tail; j++)
                    keys[k++] = (int64_t)mix(1u << 20 | (rnd() % 4000));
                report(r, &t, KVCM_KIND_STORED, 0, keys, k);
                report(r, &t, KVCM_KIND_STORED, 1, keys, k < 6 ? k : 6); /* a sliding window */
                if (k > 6) report(r, &t, KVCM_KIND_STORED, 1, keys + 6, k - 6);
            }
        } else if (strstr(line, "\"flood\"")) {
            /* One array call per group: far more records than the ring holds, at once. */
            int64_t *keys = (int64_t *)malloc((size_t)(n + 1) * sizeof *keys);
            for (long i = 0; i < n; i++) keys[i] = 1000000 + i * 7;
            report(r, &t, KVCM_KIND_STORED, 0, keys, (size_t)n);
            report(r, &t, KVCM_KIND_STORED, 1, keys, (size_t)n);
            free(keys);
        } else if (strstr(line, "\"exit\"")) {
            kvcm_ring_close(r);
            printf("{\"bye\":true,\"stats\":");
            print_stats(r);
            printf("}\n");
            fflush(stdout);
            kvcm_ring_free(r);
            free(t.e);
            return 0;
        }
        if (!threaded) kvcm_ring_poll(r);
        print_published(&t, r);
    }
    kvcm_ring_free(r);
    free(t.e);
    return 0;
}

static int ops_mode(char **argv) {
    kvcm_descriptor d;
    kvcm_ring *r;
    table t;
    kvcm_descriptor_init(&d);
    d.instance_id = "conformance";
    d.ring_name = argv[2];
    d.ring_capacity_slots = (uint64_t)strtoull(argv[3], NULL, 10);
    d.group_block_bytes[0] = 64;
    d.group_block_bytes[1] = 64;
    d.n_groups = 2;
    d.medium = "hbm";
    d.mediums = "mem,disk";
    d.max_stage_delay_ms = 1.0;
    d.extra = "role=test";
    int rc = kvcm_ring_attach(&d, &r);
    table_init(&t, 1 << 12);
    kvcm_ring_set_snapshot(r, snapshot_cb, &t);
    printf("{\"ready\":%s,\"code\":%d}\n", rc == KVCM_OK ? "true" : "false", rc);
    fflush(stdout);
    char *line;
    while ((line = next_line(r, 0)) != NULL) {
        char op[16] = {0};
        int group = 0, medium = 0, used = 0;
        sscanf(line, "%15s%n", op, &used);
        int kind = !strcmp(op, "stored")    ? KVCM_KIND_STORED
                   : !strcmp(op, "removed") ? KVCM_KIND_REMOVED
                                            : 0;
        if (kind) {
            int64_t keys[4096];
            size_t n = 0;
            const char *p = line + used;
            char *end;
            group = (int)strtol(p, &end, 10);
            medium = (int)strtol(end, &end, 10);
            for (p = end; n < 4096; p = end) {
                long long k = strtoll(p, &end, 10);
                if (end == p) break;
                keys[n++] = (int64_t)k;
            }
            pthread_mutex_lock(&t.mu);
            for (size_t i = 0; i < n && group >= 0 && group < 2 && medium >= 0 && medium < 3; i++)
                apply(&t, kind, group, medium, keys[i]);
            pthread_mutex_unlock(&t.mu);
            if (kind == KVCM_KIND_STORED)
                kvcm_ring_stored(r, keys, n, group, medium);
            else
                kvcm_ring_removed(r, keys, n, group, medium);
        } else if (!strcmp(op, "cleared")) {
            pthread_mutex_lock(&t.mu);
            apply(&t, KVCM_KIND_CLEARED, 0, 0, 0);
            pthread_mutex_unlock(&t.mu);
            kvcm_ring_cleared(r);
        } else if (!strcmp(op, "poll")) {
            kvcm_ring_poll(r);
        } else if (!strcmp(op, "nocallback")) {
            kvcm_ring_set_snapshot(r, NULL, NULL);
        } else if (!strcmp(op, "close")) {
            kvcm_ring_close(r);
        }
        print_stats(r);
        printf("\n");
        fflush(stdout);
    }
    kvcm_ring_free(r);
    free(t.e);
    return 0;
}

/* The descriptor from KV_CACHE_EVENT_*: attach and report the code, reason and ring name. */
static int env_mode(void) {
    kvcm_descriptor d;
    kvcm_ring *r;
    kvcm_descriptor_init(&d);
    kvcm_descriptor_from_env(&d); /* an error makes attach refuse: "invalid config: ..." */
    kvcm_ring_attach(&d, &r);
    print_stats(r);
    printf("\n");
    kvcm_ring_free(r);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 7 && !strcmp(argv[1], "cache")) return cache_mode(argv);
    if (argc >= 4 && !strcmp(argv[1], "ops")) return ops_mode(argv);
    if (argc >= 2 && !strcmp(argv[1], "env")) return env_mode();
    fprintf(stderr, "usage: see the comment at the top of kvcm_test_engine.c\n");
    return 2;
}
