/* Hot-path cost of kvcm_ring.h: ns per event, best of REPS, one thread, no reader running.
 *
 *   kvcm_bench RING EVENTS REPS    -> one JSON line
 *
 * Every 16384 events the bench moves the ring's head to its tail (what a reader's skip does,
 * two 8-byte accesses), so every measured call finds free slots: the cost of publishing, not
 * of dropping; the ring (default 65536 slots, 2 MiB) stays cache-warm as in a running engine.
 * Used by bench/hotpath_c.py, which also runs it under strace to count syscalls per event.
 */
#include "kvcm_ring.h"

#include <inttypes.h>

#define STEP 1024

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static void skip_to_tail(kvcm_ring *r) {
    uint64_t tail = __atomic_load_n(&r->hdr[KVCM_W_TAIL], __ATOMIC_ACQUIRE);
    __atomic_store_n(&r->hdr[KVCM_W_HEAD], tail, __ATOMIC_RELEASE);
}

#define SNAP_ENTRIES 1000000
static int64_t snap_keys[SNAP_ENTRIES];
static uint32_t snap_masks[SNAP_ENTRIES];

/* An engine that keeps its block table in arrays answers with one call. */
static int enumerate(void *ctx, kvcm_snapshot *snap) {
    (void)ctx;
    return kvcm_snapshot_add_many(snap, snap_keys, snap_masks, NULL, SNAP_ENTRIES);
}

/* ns of the poll() that answers a pending snapshot request of SNAP_ENTRIES entries. */
static double snapshot_stall_ns(kvcm_ring *r) {
    uint64_t resp = __atomic_load_n(&r->hdr[KVCM_W_SNAP_RESP], __ATOMIC_ACQUIRE);
    __atomic_store_n(&r->hdr[KVCM_W_SNAP_REQ], resp + 1, __ATOMIC_RELEASE); /* the reader's ask */
    double t0 = now_ns();
    kvcm_ring_poll(r);
    return now_ns() - t0;
}

int main(int argc, char **argv) {
    if (argc < 4) return 2;
    long events = atol(argv[2]), reps = atol(argv[3]);
    kvcm_descriptor d;
    kvcm_ring *r;
    kvcm_descriptor_init(&d);
    d.instance_id = "bench";
    d.ring_name = argv[1];
    d.ring_capacity_slots = KVCM_DEFAULT_CAPACITY_SLOTS; /* what an engine gets */
    d.n_groups = 2;
    d.group_block_bytes[1] = 4096;
    if (kvcm_ring_attach(&d, &r) != KVCM_OK) {
        fprintf(stderr, "attach: %s\n", kvcm_ring_reason(r));
        return 1;
    }
    static int64_t arr[STEP];
    for (int i = 0; i < STEP; i++) arr[i] = (int64_t)(i * 2654435761u);
    double best_single = 1e18, best_removed = 1e18, best_array = 1e18, best_poll = 1e18;
    for (long rep = 0; rep < reps; rep++) {
        skip_to_tail(r);
        double t0 = now_ns();
        for (long i = 0; i < events; i++) {
            int64_t k = i;
            kvcm_ring_stored(r, &k, 1, (int)(i & 1), 0);
            if ((i & 16383) == 16383) skip_to_tail(r);
        }
        double t1 = now_ns();
        skip_to_tail(r);
        double t2 = now_ns();
        for (long i = 0; i < events; i++) {
            int64_t k = i;
            kvcm_ring_removed(r, &k, 1, 0, 0);
            if ((i & 16383) == 16383) skip_to_tail(r);
        }
        double t3 = now_ns();
        skip_to_tail(r);
        long calls = events / STEP;
        double t4 = now_ns();
        for (long i = 0; i < calls; i++) {
            kvcm_ring_stored(r, arr, STEP, 1, 0);
            if ((i & 15) == 15) skip_to_tail(r);
        }
        double t5 = now_ns();
        double t6 = now_ns();
        for (long i = 0; i < 1000; i++) kvcm_ring_poll(r);
        double t7 = now_ns();
        if ((t1 - t0) / events < best_single) best_single = (t1 - t0) / events;
        if ((t3 - t2) / events < best_removed) best_removed = (t3 - t2) / events;
        if ((t5 - t4) / (calls * STEP) < best_array) best_array = (t5 - t4) / (calls * STEP);
        if ((t7 - t6) / 1000 < best_poll) best_poll = (t7 - t6) / 1000;
    }
    for (int i = 0; i < SNAP_ENTRIES; i++) {
        snap_keys[i] = i + 1;
        snap_masks[i] = 1;
    }
    kvcm_ring_set_snapshot(r, enumerate, NULL);
    double cold = snapshot_stall_ns(r), warm = 1e18;
    for (int i = 0; i < 3; i++) {
        double t = snapshot_stall_ns(r);
        if (t < warm) warm = t;
    }
    kvcm_stats s;
    kvcm_ring_stats(r, &s);
    printf("{\"c_snapshot_1m_first_ms\":%.2f,\"c_snapshot_1m_ms\":%.2f,\"snapshots\":%" PRIu64 ",",
           cold / 1e6, warm / 1e6, s.snapshots);
    printf("\"c_single_ns\":%.2f,\"c_removed_single_ns\":%.2f,\"c_array1024_ns_per_key\":%.3f,"
           "\"c_poll_ns\":%.1f,\"events_per_rep\":%ld,\"reps\":%ld,\"accepted\":%" PRIu64
           ",\"dropped\":%" PRIu64 "}\n",
           best_single, best_removed, best_array, best_poll, events, reps, s.last_seq, s.dropped);
    kvcm_ring_free(r);
    return 0;
}
