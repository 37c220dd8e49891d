/* The loops of a save or load that must run without the GIL (each below says why).  POSIX only:
 * elsewhere this file is empty and gefen_ckpt/io/native.py binds the checksum alone. */
#include "native.h"
#if !defined(_WIN32)
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__linux__)
#include <sys/sendfile.h>
#endif

/* Read byte ranges of a file into their buffers (native.read_hashed), checksumming each chunk while
 * it is still in cache: one pass and one call (GIL released) per file.  `chunk`-byte reads keep the
 * kernel's readahead going.  Returns 0, or -errno. */
NATIVE_EXPORT int gefen_read_hashed(int fd, int64_t n, const int64_t *offsets, const int64_t *sizes,
                                 void *const *dests, int64_t chunk, int64_t *got, uint32_t *crcs) {
    if (chunk <= 0) return -EINVAL;
    for (int64_t i = 0; i < n; i++) {
        uint8_t *dst = dests[i];
        int64_t done = 0, size = sizes[i];
        uint32_t crc = 0;
        while (done < size) {
            size_t want = (size_t)(size - done < chunk ? size - done : chunk);
            ssize_t r = pread(fd, dst + done, want, (off_t)(offsets[i] + done));
            if (r < 0) {
                if (errno == EINTR) continue;
                return -errno;
            }
            if (r == 0) break;
            crc = gefen_crc32(crc, dst + done, (size_t)r);
            done += r;
        }
        got[i] = done;
        crcs[i] = crc;
    }
    return 0;
}

/* Append n buffers to a file (native.write_hashed), each chunk hashed then written while in cache,
 * in one call without the GIL: Python between writes waits up to a switch interval for the GIL
 * whenever another thread runs Python (docs/decisions.md).  Every `writeback_every` bytes the
 * kernel is asked to start writing out (posix_fadvise DONTNEED); progress = {written, handed to
 * writeback}.  Returns 0, or -errno of a failed write (the buffers before it are complete). */
NATIVE_EXPORT int gefen_write_hashed(int fd, int64_t n, const void *const *srcs, const int64_t *sizes, int64_t chunk,
                                  int64_t writeback_every, int64_t *progress, uint32_t *crcs) {
    if (chunk <= 0) return -EINVAL;
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *src = srcs[i];
        int64_t done = 0, size = sizes[i];
        uint32_t crc = 0;
        while (done < size) {
            size_t want = (size_t)(size - done < chunk ? size - done : chunk);
            crc = gefen_crc32(crc, src + done, want);
            for (size_t put = 0; put < want;) {
                ssize_t w = write(fd, src + done + put, want - put);
                if (w < 0) {
                    if (errno == EINTR) continue;
                    return -errno;
                }
                put += (size_t)w;
                progress[0] += w;
            }
            done += (int64_t)want;
#if defined(POSIX_FADV_DONTNEED) /* not on macOS: there the kernel decides alone */
            if (writeback_every > 0 && progress[0] - progress[1] >= writeback_every) {
                posix_fadvise(fd, (off_t)progress[1], (off_t)(progress[0] - progress[1]), POSIX_FADV_DONTNEED);
                progress[1] = progress[0];
            }
#else
            (void)writeback_every;
#endif
        }
        crcs[i] = crc;
    }
    return 0;
}

/* fsync a file on a thread of its own while the save builds its manifest: a Python thread would
 * wait for the GIL between its system calls (measured: the flush started ~4 ms late).  Start
 * returns a handle, or NULL when no thread could start; wait joins it: 0 or the errno. */
struct fsync_job {
    pthread_t thread;
    int result;
    char path[];
};

static void *fsync_path(void *arg) {
    struct fsync_job *job = arg;
    int fd = open(job->path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        job->result = errno;
        return NULL;
    }
    job->result = fsync(fd) ? errno : 0;
    close(fd);
    return NULL;
}

NATIVE_EXPORT void *gefen_fsync_start(const char *path) {
    size_t n = strlen(path) + 1;
    struct fsync_job *job = malloc(sizeof *job + n);
    if (job == NULL) return NULL;
    memcpy(job->path, path, n);
    job->result = 0;
    if (pthread_create(&job->thread, NULL, fsync_path, job) != 0) {
        free(job);
        return NULL;
    }
    return job;
}

NATIVE_EXPORT int gefen_fsync_wait(void *handle) {
    struct fsync_job *job = handle;
    pthread_join(job->thread, NULL);
    int result = job->result;
    free(job);
    return result;
}

/* Read files into the page cache, in order, on a thread of its own (storage.Prefetch), so a load's
 * reads overlap its manifest validation; the Python loop waited for the GIL per chunk (measured: a
 * cold load's first 4 MiB came ~9 ms late).  Positions count the files end to end; the thread
 * stays at most `lead` bytes past the furthest position waited for; a file that cannot be read is
 * skipped (its reader reports it).  Linux: sendfile to /dev/null (no copy); elsewhere pread. */
struct prefetch {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t changed;
    int64_t cached, wanted, lead, chunk;
    int stopped;
    int64_t n;
    int64_t *sizes;
    char **paths;
};

static void prefetch_advance(struct prefetch *p, int64_t position) {
    pthread_mutex_lock(&p->lock);
    if (position > p->cached) p->cached = position;
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
}

/* Wait until position `at` may be read (within the lead); 0 when the prefetch was stopped. */
static int prefetch_may_read(struct prefetch *p, int64_t at) {
    pthread_mutex_lock(&p->lock);
    while (!p->stopped && at >= p->wanted + p->lead) pthread_cond_wait(&p->changed, &p->lock);
    int go = !p->stopped;
    pthread_mutex_unlock(&p->lock);
    return go;
}

/* End the prefetch (within a chunk) and release waiters; gefen_prefetch_free joins and frees. */
NATIVE_EXPORT void gefen_prefetch_stop(void *handle) {
    struct prefetch *p = handle;
    pthread_mutex_lock(&p->lock);
    p->stopped = 1;
    pthread_cond_broadcast(&p->changed);
    pthread_mutex_unlock(&p->lock);
}

static void *prefetch_run(void *arg) {
    struct prefetch *p = arg;
#if defined(__linux__)
    int sink = open("/dev/null", O_WRONLY | O_CLOEXEC);
    char *scratch = NULL;
#else
    int sink = -1;
    char *scratch = malloc((size_t)p->chunk);
#endif
    int64_t base = 0;
    for (int64_t i = 0; i < p->n; i++) {
        int64_t size = p->sizes[i];
        int fd = (sink >= 0 || scratch != NULL) ? open(p->paths[i], O_RDONLY | O_CLOEXEC) : -1;
        int64_t offset = 0;
        int go = 1;
        while (fd >= 0 && offset < size && (go = prefetch_may_read(p, base + offset))) {
            size_t want = (size_t)(size - offset < p->chunk ? size - offset : p->chunk);
#if defined(__linux__)
            off_t at = (off_t)offset;
            ssize_t got = sendfile(sink, fd, &at, want);
#else
            ssize_t got = pread(fd, scratch, want, (off_t)offset);
#endif
            if (got < 0 && errno == EINTR) continue;
            if (got <= 0) break;
            offset += got;
            prefetch_advance(p, base + offset);
        }
        if (fd >= 0) close(fd);
        if (!go) break; /* stopped: what was not read stays uncounted */
        base += size;
        prefetch_advance(p, base);
    }
    if (sink >= 0) close(sink);
    free(scratch);
    gefen_prefetch_stop(p);
    return NULL;
}

static void prefetch_release(struct prefetch *p) {
    for (int64_t i = 0; i < p->n; i++) free(p->paths[i]);
    free(p->paths);
    free(p->sizes);
    pthread_mutex_destroy(&p->lock);
    pthread_cond_destroy(&p->changed);
    free(p);
}

/* Start prefetching n files (paths[i], sizes[i] bytes); NULL when no thread could be started. */
NATIVE_EXPORT void *gefen_prefetch_start(int64_t n, const char *const *paths, const int64_t *sizes, int64_t chunk,
                                      int64_t lead) {
    if (chunk <= 0) return NULL;
    struct prefetch *p = calloc(1, sizeof *p);
    if (p == NULL) return NULL;
    p->n = n;
    p->chunk = chunk;
    p->lead = lead;
    p->sizes = malloc(sizeof(int64_t) * (size_t)(n ? n : 1));
    p->paths = calloc((size_t)(n ? n : 1), sizeof(char *));
    pthread_mutex_init(&p->lock, NULL);
    pthread_cond_init(&p->changed, NULL);
    int ok = p->sizes != NULL && p->paths != NULL;
    for (int64_t i = 0; ok && i < n; i++) {
        p->sizes[i] = sizes[i];
        p->paths[i] = strdup(paths[i]);
        ok = p->paths[i] != NULL;
    }
    if (!ok || pthread_create(&p->thread, NULL, prefetch_run, p) != 0) {
        prefetch_release(p);
        return NULL;
    }
    return p;
}

/* Block until `position` is cached or the prefetch has ended; returns the bytes cached so far. */
NATIVE_EXPORT int64_t gefen_prefetch_wait(void *handle, int64_t position) {
    struct prefetch *p = handle;
    pthread_mutex_lock(&p->lock);
    if (position > p->wanted) {
        p->wanted = position;
        pthread_cond_broadcast(&p->changed);
    }
    while (!p->stopped && p->cached < position) pthread_cond_wait(&p->changed, &p->lock);
    int64_t cached = p->cached;
    pthread_mutex_unlock(&p->lock);
    return cached;
}

NATIVE_EXPORT void gefen_prefetch_free(void *handle) {
    struct prefetch *p = handle;
    gefen_prefetch_stop(p);
    pthread_join(p->thread, NULL);
    prefetch_release(p);
}
#endif
