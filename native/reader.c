/* expert_stream.native._reader: batch reads of byte ranges into caller-owned memory.
 *
 * Plain CPython C API. Two steps, so that a background submit can validate at once:
 *
 *   batch = plan(requests, nfiles, threads, max_span, min_span, iov_max)
 *       requests: sequence of (file, offset, length, dest) with dest a writable C-contiguous
 *       buffer of exactly `length` bytes. Validates (ValueError / TypeError), takes the buffers
 *       (kept until the batch dies), sorts by (file, offset), merges adjacent ranges into spans
 *       and cuts spans at `cap` bytes (the same rule as streaming/reader.py's Python path).
 *   pool = Pool(threads, bounce_bytes)
 *   nbytes, syscalls, err = pool.run(batch, fds, dfds, mode)
 *       fds / dfds: per-file buffered and O_DIRECT descriptors (-1 where not open).
 *       mode: 0 none, 1 fadvise (drop the pages after the read), 2 direct (O_DIRECT through an
 *       aligned bounce buffer), 3 nocache (the fd is already F_NOCACHE; plain buffered reads).
 *       The GIL is released for the whole batch; spans run on the pool's persistent pthreads
 *       plus the calling thread. err is None or (file, span_offset, span_length, errno, pos):
 *       errno 0 means end of file before the span ended (short read).
 *   ticket = pool.start(batch, fds, dfds, mode); ticket.wait() -> (nbytes, syscalls, err, seconds)
 *       The same batch read by the workers alone: start() returns once they are woken, so the
 *       reads begin at once, without a Python thread (and the GIL) between the caller and them.
 *
 *   raw_read(fds, offsets, block, threads) -> (bytes, seconds, errno, fail_index)
 *       A fio-like reference: each (fd, offset) read as one `block`-byte pread into an aligned
 *       per-thread buffer. Used by disk_bandwidth.measure_raw_bandwidth.
 *
 * Linux and macOS. Linux-only calls (posix_fadvise) are guarded.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#define ES_ALIGN 4096
#define ES_IOV_CAP 1024 /* at most this many destinations per span (Linux and macOS IOV_MAX) */

enum { MODE_NONE = 0, MODE_FADVISE = 1, MODE_DIRECT = 2, MODE_NOCACHE = 3 };

typedef struct {
    char *addr;
    int64_t len;
} Seg;

typedef struct {
    int file;
    int64_t off;
    int64_t len;
    int64_t limit; /* span may not grow past this file offset */
    int seg0;
    int nseg;
} Span;

static int64_t round_up(int64_t x, int64_t a) { return (x + a - 1) / a * a; }
static int64_t round_down(int64_t x, int64_t a) { return x / a * a; }

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* preadv where the OS has it; macOS before 11 falls back to the first iovec (the callers loop). */
static ssize_t es_preadv(int fd, struct iovec *iov, int cnt, int64_t off) {
#if defined(__APPLE__)
#if defined(__clang__)
    if (__builtin_available(macOS 11.0, *)) {
        return preadv(fd, iov, cnt, (off_t)off);
    }
#endif
    return pread(fd, iov[0].iov_base, iov[0].iov_len, (off_t)off);
#else
    return preadv(fd, iov, cnt, (off_t)off);
#endif
}

static void drop_pages(int fd, int64_t off, int64_t len) {
#if defined(POSIX_FADV_DONTNEED)
    int64_t a = round_down(off, ES_ALIGN);
    int64_t b = round_up(off + len, ES_ALIGN);
    (void)posix_fadvise(fd, (off_t)a, (off_t)(b - a), POSIX_FADV_DONTNEED);
#else
    (void)fd;
    (void)off;
    (void)len;
#endif
}

/* ------------------------------------------------------------------------------------------ */
/* Batch                                                                                      */

typedef struct {
    PyObject_HEAD
    Py_buffer *views;
    Py_ssize_t nviews; /* acquired views */
    Span *spans;
    int nspans;
    Seg *segs;
    int nsegs;
    int nfiles;
    int64_t nbytes;
    Py_ssize_t nrequests;
    unsigned char *used; /* nfiles flags: file touched by this batch */
    int running;
} BatchObject;

static void Batch_dealloc(BatchObject *self) {
    for (Py_ssize_t i = 0; i < self->nviews; i++) PyBuffer_Release(&self->views[i]);
    PyMem_Free(self->views);
    PyMem_Free(self->spans);
    PyMem_Free(self->segs);
    PyMem_Free(self->used);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *Batch_files(BatchObject *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int i = 0; i < self->nfiles; i++) {
        if (!self->used[i]) continue;
        PyObject *v = PyLong_FromLong(i);
        if (!v || PyList_Append(out, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}

static PyObject *Batch_span_list(BatchObject *self, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(self->nspans);
    if (!out) return NULL;
    for (int i = 0; i < self->nspans; i++) {
        Span *s = &self->spans[i];
        PyObject *t = Py_BuildValue("(iLLi)", s->file, (long long)s->off, (long long)s->len, s->nseg);
        if (!t) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static PyObject *Batch_get_nspans(BatchObject *self, void *c) { return PyLong_FromLong(self->nspans); }
static PyObject *Batch_get_nbytes(BatchObject *self, void *c) { return PyLong_FromLongLong(self->nbytes); }
static PyObject *Batch_get_nrequests(BatchObject *self, void *c) { return PyLong_FromSsize_t(self->nrequests); }

static PyMethodDef Batch_methods[] = {
    {"files", (PyCFunction)Batch_files, METH_NOARGS, "sorted indices of the files this batch reads"},
    {"span_list", (PyCFunction)Batch_span_list, METH_NOARGS, "[(file, offset, length, ndest)] per span"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Batch_getset[] = {
    {"nspans", (getter)Batch_get_nspans, NULL, "number of reads (spans) after merging", NULL},
    {"nbytes", (getter)Batch_get_nbytes, NULL, "bytes the batch reads", NULL},
    {"nrequests", (getter)Batch_get_nrequests, NULL, "number of requests", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "expert_stream.native._reader.Batch",
    .tp_basicsize = sizeof(BatchObject),
    .tp_dealloc = (destructor)Batch_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A validated, sorted and merged read batch holding its destination buffers.",
    .tp_methods = Batch_methods,
    .tp_getset = Batch_getset,
};

typedef struct {
    int file;
    int64_t off;
    int64_t len;
    char *addr;
    Py_ssize_t idx;
} Req;

static int req_cmp(const void *pa, const void *pb) {
    const Req *a = (const Req *)pa, *b = (const Req *)pb;
    if (a->file != b->file) return a->file < b->file ? -1 : 1;
    if (a->off != b->off) return a->off < b->off ? -1 : 1;
    if (a->idx != b->idx) return a->idx < b->idx ? -1 : 1;
    return 0;
}

static PyObject *es_plan(PyObject *mod, PyObject *args) {
    PyObject *requests;
    int nfiles, threads, iov_max;
    long long max_span, min_span;
    if (!PyArg_ParseTuple(args, "OiiLLi", &requests, &nfiles, &threads, &max_span, &min_span, &iov_max))
        return NULL;
    if (nfiles < 0 || threads < 1 || max_span < ES_ALIGN || min_span < 1 || iov_max < 1) {
        PyErr_SetString(PyExc_ValueError, "plan: bad nfiles/threads/max_span/min_span/iov_max");
        return NULL;
    }
    if (iov_max > ES_IOV_CAP) iov_max = ES_IOV_CAP;
    PyObject *seq = PySequence_Fast(requests, "requests must be a sequence of ReadRequest");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);

    BatchObject *b = PyObject_New(BatchObject, &BatchType);
    if (!b) {
        Py_DECREF(seq);
        return NULL;
    }
    b->views = NULL;
    b->nviews = 0;
    b->spans = NULL;
    b->nspans = 0;
    b->segs = NULL;
    b->nsegs = 0;
    b->nfiles = nfiles;
    b->nbytes = 0;
    b->nrequests = n;
    b->running = 0;
    b->used = PyMem_Calloc(nfiles > 0 ? nfiles : 1, 1);
    b->views = PyMem_Calloc(n > 0 ? n : 1, sizeof(Py_buffer));
    Req *reqs = PyMem_Calloc(n > 0 ? n : 1, sizeof(Req));
    if (!b->used || !b->views || !reqs) {
        PyErr_NoMemory();
        goto fail;
    }

    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        PyObject *it = PySequence_Fast(item, "each request must be a ReadRequest(file, offset, length, dest)");
        if (!it) goto fail;
        if (PySequence_Fast_GET_SIZE(it) != 4) {
            Py_DECREF(it);
            PyErr_Format(PyExc_ValueError, "request %zd: expected (file, offset, length, dest)", i);
            goto fail;
        }
        PyObject **f = PySequence_Fast_ITEMS(it);
        long file = PyLong_AsLong(f[0]);
        long long off = PyLong_AsLongLong(f[1]);
        long long len = PyLong_AsLongLong(f[2]);
        if (PyErr_Occurred()) {
            Py_DECREF(it);
            goto fail;
        }
        if (file < 0 || file >= nfiles) {
            Py_DECREF(it);
            PyErr_Format(PyExc_ValueError, "request %zd: file index %ld out of range (the reader has %d files)",
                         i, file, nfiles);
            goto fail;
        }
        if (off < 0 || len < 0) {
            Py_DECREF(it);
            PyErr_Format(PyExc_ValueError, "request %zd: negative offset (%lld) or length (%lld)", i, off, len);
            goto fail;
        }
        PyObject *dest = f[3];
        if (!PyObject_CheckBuffer(dest)) {
            Py_DECREF(it);
            PyErr_Format(PyExc_TypeError,
                         "request %zd: dest must be a writable buffer (memoryview, bytearray, numpy uint8 array), got %s",
                         i, Py_TYPE(dest)->tp_name);
            goto fail;
        }
        if (PyObject_GetBuffer(dest, &b->views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(it);
            PyErr_Clear();
            PyErr_Format(PyExc_ValueError, "request %zd: dest must be a writable C-contiguous buffer", i);
            goto fail;
        }
        b->nviews = i + 1;
        Py_DECREF(it);
        if ((long long)b->views[i].len != len) {
            PyErr_Format(PyExc_ValueError, "request %zd: dest holds %zd bytes but length is %lld (they must match)", i,
                         b->views[i].len, len);
            goto fail;
        }
        reqs[i].file = (int)file;
        reqs[i].off = off;
        reqs[i].len = len;
        reqs[i].addr = (char *)b->views[i].buf;
        reqs[i].idx = i;
        b->nbytes += len;
        if (len > 0) b->used[file] = 1;
    }
    Py_CLEAR(seq);

    if (n > 1) qsort(reqs, (size_t)n, sizeof(Req), req_cmp);

    int64_t cap = (b->nbytes + threads - 1) / threads;
    if (cap < min_span) cap = min_span;
    if (cap > max_span) cap = max_span;
    cap = round_up(cap, ES_ALIGN);

    int segcap = (int)(n + 16), spancap = (int)(n + 16);
    b->segs = PyMem_Malloc(sizeof(Seg) * segcap);
    b->spans = PyMem_Malloc(sizeof(Span) * spancap);
    if (!b->segs || !b->spans) {
        PyErr_NoMemory();
        goto fail;
    }
    Span *cur = NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Req *r = &reqs[i];
        int64_t pos = r->off, rem = r->len;
        char *a = r->addr;
        while (rem > 0) {
            if (!cur || cur->file != r->file || cur->off + cur->len != pos || cur->off + cur->len >= cur->limit ||
                cur->nseg >= iov_max) {
                if (b->nspans == spancap) {
                    spancap *= 2;
                    Span *ns = PyMem_Realloc(b->spans, sizeof(Span) * spancap);
                    if (!ns) {
                        PyErr_NoMemory();
                        goto fail;
                    }
                    b->spans = ns;
                }
                cur = &b->spans[b->nspans++];
                cur->file = r->file;
                cur->off = pos;
                cur->len = 0;
                cur->seg0 = b->nsegs;
                cur->nseg = 0;
                cur->limit = round_down(pos + cap, ES_ALIGN);
                if (cur->limit <= pos) cur->limit = pos + cap;
            }
            int64_t take = cur->limit - (cur->off + cur->len);
            if (take > rem) take = rem;
            if (b->nsegs == segcap) {
                segcap *= 2;
                Seg *ng = PyMem_Realloc(b->segs, sizeof(Seg) * segcap);
                if (!ng) {
                    PyErr_NoMemory();
                    goto fail;
                }
                b->segs = ng;
            }
            b->segs[b->nsegs].addr = a;
            b->segs[b->nsegs].len = take;
            b->nsegs++;
            cur->nseg++;
            cur->len += take;
            pos += take;
            a += take;
            rem -= take;
        }
    }
    PyMem_Free(reqs);
    return (PyObject *)b;

fail:
    Py_XDECREF(seq);
    PyMem_Free(reqs);
    Py_DECREF(b);
    return NULL;
}

/* ------------------------------------------------------------------------------------------ */
/* Pool and jobs                                                                              */

#define DROP_QUEUE 1024

typedef struct {
    int fd;
    int64_t off;
    int64_t len;
} Drop;

typedef struct Job {
    const Span *spans;
    int nspans;
    const Seg *segs;
    const int *fds;
    const int *dfds;
    int mode;
    int64_t bounce_bytes;
    /* under the pool mutex */
    int next;
    int done;
    int failed; /* also read without the lock as a hint (atomic) */
    int err_span;
    int err_errno;
    int64_t err_pos;
    int64_t syscalls;
    int64_t bytes;
    double t_first, t_last; /* first span taken, last span done (now_seconds) */
    pthread_cond_t cv;
    struct Job *qnext;
} Job;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv_work;
    Job *head;
    int threads; /* worker threads; a run() batch's caller reads with them */
    int nworkers;
    pthread_t *tids;
    int started;
    int stop;
    int closed;
    pid_t pid;
    int64_t bounce_bytes;
    void **spare;
    int nspare;
    int capspare;
    /* page drops (fadvise mode) run on their own thread, off the reads' critical path:
     * posix_fadvise(DONTNEED) costs ~0.5 ms per 4 MiB, a quarter of the read on a 2 GB/s SSD */
    pthread_cond_t cv_drop;
    Drop dq[DROP_QUEUE];
    int dq_head;
    int dq_count;
    int drop_started;
    pthread_t drop_tid;
} PoolObject;

typedef struct {
    int ok;
    int err;
    int64_t pos;
    int64_t syscalls;
    int64_t bytes;
    Drop drop; /* pages to drop (fd >= 0) */
} SpanResult;

static int get_bounce(PoolObject *p, void **bounce) {
    if (*bounce) return 0;
    void *m = NULL;
    if (posix_memalign(&m, ES_ALIGN, (size_t)p->bounce_bytes) != 0) return -1;
    *bounce = m;
    return 0;
}

/* Read [s->off, s->off + s->len) of fd into the span's destinations with preadv, resuming
 * after short reads. With stop_unaligned (O_DIRECT), a short read that ends off a block
 * boundary means the file ended. Returns 1 on success; on failure fills res and returns 0. */
static int preadv_span(int fd, const Job *j, const Span *s, int stop_unaligned, SpanResult *res) {
    struct iovec iov[ES_IOV_CAP];
    int n = s->nseg, i0 = 0;
    for (int i = 0; i < n; i++) {
        iov[i].iov_base = j->segs[s->seg0 + i].addr;
        iov[i].iov_len = (size_t)j->segs[s->seg0 + i].len;
    }
    int64_t pos = s->off, end = s->off + s->len;
    while (pos < end) {
        ssize_t r = es_preadv(fd, iov + i0, n - i0, pos);
        res->syscalls++;
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) { /* an error, or the end of the file (a truncated shard) */
            res->ok = 0;
            res->err = r < 0 ? errno : 0;
            res->pos = pos;
            return 0;
        }
        pos += r;
        if (stop_unaligned && pos < end && pos % ES_ALIGN) {
            res->ok = 0;
            res->err = 0;
            res->pos = pos;
            return 0;
        }
        size_t left = (size_t)r;
        while (left > 0 && i0 < n) {
            if (left >= iov[i0].iov_len) {
                left -= iov[i0].iov_len;
                i0++;
            } else {
                iov[i0].iov_base = (char *)iov[i0].iov_base + left;
                iov[i0].iov_len -= left;
                left = 0;
            }
        }
    }
    res->bytes = s->len;
    res->ok = 1;
    return 1;
}

static void span_buffered(const Job *j, const Span *s, SpanResult *res) {
    int fd = j->fds[s->file];
    if (preadv_span(fd, j, s, 0, res) && j->mode == MODE_FADVISE) {
        res->drop.fd = fd;
        res->drop.off = s->off;
        res->drop.len = s->len;
    }
}

static int span_aligned(const Job *j, const Span *s) {
    if (s->off % ES_ALIGN || s->len % ES_ALIGN) return 0;
    for (int i = 0; i < s->nseg; i++) {
        const Seg *g = &j->segs[s->seg0 + i];
        if (((uintptr_t)g->addr) % ES_ALIGN || g->len % ES_ALIGN) return 0;
    }
    return 1;
}

static void span_direct(PoolObject *p, const Job *j, const Span *s, void **bounce, SpanResult *res) {
    int fd = j->dfds[s->file];
    int64_t off = s->off, end = s->off + s->len;
    if (span_aligned(j, s)) {
        /* zero copy: every destination and the file range are block aligned */
        preadv_span(fd, j, s, 1, res);
        return;
    }
    if (get_bounce(p, bounce) < 0) {
        res->ok = 0;
        res->err = ENOMEM;
        res->pos = off;
        return;
    }
    char *buf = (char *)*bounce;
    int64_t a1 = round_up(end, ES_ALIGN);
    int64_t pos = round_down(off, ES_ALIGN);
    int k = 0;          /* current destination segment */
    int64_t kpos = off; /* file offset where segment k starts */
    while (pos < end) {
        int64_t want = a1 - pos;
        if (want > p->bounce_bytes) want = p->bounce_bytes;
        ssize_t r = pread(fd, buf, (size_t)want, (off_t)pos);
        res->syscalls++;
        if (r < 0) {
            if (errno == EINTR) continue;
            res->ok = 0;
            res->err = errno;
            res->pos = pos > off ? pos : off;
            return;
        }
        if (r == 0) {
            res->ok = 0;
            res->err = 0;
            res->pos = pos > off ? pos : off;
            return;
        }
        int64_t c0 = pos > off ? pos : off;
        int64_t c1 = pos + r < end ? pos + r : end;
        const char *src = buf + (c0 - pos);
        while (c0 < c1) {
            const Seg *g = &j->segs[s->seg0 + k];
            int64_t in = c0 - kpos;
            int64_t m = g->len - in;
            if (m > c1 - c0) m = c1 - c0;
            memcpy(g->addr + in, src, (size_t)m);
            src += m;
            c0 += m;
            if (in + m == g->len) {
                kpos += g->len;
                k++;
            }
        }
        pos += r;
        if (pos < end && pos % ES_ALIGN) {
            res->ok = 0;
            res->err = 0;
            res->pos = pos > off ? pos : off;
            return;
        }
    }
    res->bytes = s->len;
    res->ok = 1;
}

static void run_span(PoolObject *p, Job *j, int si, void **bounce, SpanResult *res) {
    memset(res, 0, sizeof(*res));
    res->ok = 1;
    res->drop.fd = -1;
    if (__atomic_load_n(&j->failed, __ATOMIC_RELAXED)) return; /* the batch already failed: skip */
    const Span *s = &j->spans[si];
    if (j->mode == MODE_DIRECT)
        span_direct(p, j, s, bounce, res);
    else
        span_buffered(j, s, res);
}

static void *dropper_main(void *arg) {
    PoolObject *p = (PoolObject *)arg;
    Drop batch[64];
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->dq_count && !p->stop) pthread_cond_wait(&p->cv_drop, &p->mu);
        if (!p->dq_count) break;
        int n = 0;
        while (p->dq_count && n < 64) {
            Drop d = p->dq[p->dq_head];
            p->dq_head = (p->dq_head + 1) % DROP_QUEUE;
            p->dq_count--;
            if (n && batch[n - 1].fd == d.fd && batch[n - 1].off + batch[n - 1].len == d.off)
                batch[n - 1].len += d.len; /* adjacent: one call */
            else
                batch[n++] = d;
        }
        pthread_mutex_unlock(&p->mu);
        for (int i = 0; i < n; i++) drop_pages(batch[i].fd, batch[i].off, batch[i].len);
        pthread_mutex_lock(&p->mu);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

/* under p->mu; returns 0 if queued, -1 if the caller must drop the pages itself */
static int queue_drop(PoolObject *p, const Drop *d) {
    if (p->stop || p->dq_count == DROP_QUEUE) return -1;
    if (!p->drop_started) {
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setstacksize(&attr, 128 * 1024);
        int rc = pthread_create(&p->drop_tid, &attr, dropper_main, p);
        pthread_attr_destroy(&attr);
        if (rc != 0) return -1;
        p->drop_started = 1;
    }
    p->dq[(p->dq_head + p->dq_count) % DROP_QUEUE] = *d;
    p->dq_count++;
    pthread_cond_signal(&p->cv_drop);
    return 0;
}

static void finish_span(Job *j, int si, const SpanResult *res);

/* under p->mu (released for a moment when the pages must be dropped inline) */
static void complete_span(PoolObject *p, Job *j, int si, const SpanResult *res) {
    int inline_drop = res->drop.fd >= 0 && queue_drop(p, &res->drop) < 0;
    finish_span(j, si, res); /* j may be gone once the lock is released */
    if (inline_drop) {
        pthread_mutex_unlock(&p->mu);
        drop_pages(res->drop.fd, res->drop.off, res->drop.len);
        pthread_mutex_lock(&p->mu);
    }
}

/* under p->mu */
static void finish_span(Job *j, int si, const SpanResult *res) {
    j->syscalls += res->syscalls;
    j->bytes += res->bytes;
    if (!res->ok && (!j->failed || si < j->err_span)) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
        j->err_span = si;
        j->err_errno = res->err;
        j->err_pos = res->pos;
    }
    j->done++;
    if (j->done == j->nspans) {
        j->t_last = now_seconds();
        pthread_cond_broadcast(&j->cv);
    }
}

/* under p->mu: claim the next span of job j (which must be queued); unlink it when exhausted */
static int claim(PoolObject *p, Job *j) {
    int si = j->next++;
    if (si == 0) j->t_first = now_seconds();
    if (j->next >= j->nspans) {
        Job **pp = &p->head;
        while (*pp && *pp != j) pp = &(*pp)->qnext;
        if (*pp) *pp = j->qnext;
        j->qnext = NULL;
    }
    return si;
}

static void *worker_main(void *arg) {
    PoolObject *p = (PoolObject *)arg;
    void *bounce = NULL;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->head && !p->stop) pthread_cond_wait(&p->cv_work, &p->mu);
        if (!p->head) break;
        Job *j = p->head;
        int si = claim(p, j);
        pthread_mutex_unlock(&p->mu);
        SpanResult res;
        run_span(p, j, si, &bounce, &res);
        pthread_mutex_lock(&p->mu);
        complete_span(p, j, si, &res);
    }
    pthread_mutex_unlock(&p->mu);
    free(bounce);
    return NULL;
}

/* under p->mu */
static void start_workers(PoolObject *p) {
    if (p->started || p->closed) return;
    p->started = 1;
    int want = p->threads; /* a started batch is read by the workers alone */
    p->tids = calloc((size_t)want, sizeof(pthread_t));
    if (!p->tids) return;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    for (int i = 0; i < want; i++) {
        if (pthread_create(&p->tids[i], &attr, worker_main, p) != 0) break;
        p->nworkers++;
    }
    pthread_attr_destroy(&attr);
}

static int Pool_init(PoolObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"threads", "bounce_bytes", NULL};
    int threads = 4;
    long long bounce = 4 << 20;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|iL", kwlist, &threads, &bounce)) return -1;
    if (threads < 1 || threads > 256) {
        PyErr_SetString(PyExc_ValueError, "threads must be in 1..256");
        return -1;
    }
    if (bounce < ES_ALIGN) bounce = ES_ALIGN;
    self->threads = threads;
    self->bounce_bytes = round_up(bounce, ES_ALIGN);
    return 0;
}

static PyObject *Pool_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PoolObject *self = (PoolObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    pthread_mutex_init(&self->mu, NULL);
    pthread_cond_init(&self->cv_work, NULL);
    self->head = NULL;
    self->threads = 1;
    self->nworkers = 0;
    self->tids = NULL;
    self->started = 0;
    self->stop = 0;
    self->closed = 0;
    self->pid = getpid();
    self->bounce_bytes = 4 << 20;
    self->spare = NULL;
    self->nspare = self->capspare = 0;
    pthread_cond_init(&self->cv_drop, NULL);
    self->dq_head = self->dq_count = 0;
    self->drop_started = 0;
    return (PyObject *)self;
}

static void pool_shutdown(PoolObject *p) {
    pthread_mutex_lock(&p->mu);
    int n = p->nworkers;
    pthread_t *tids = p->tids;
    p->stop = 1;
    p->closed = 1;
    p->tids = NULL;
    p->nworkers = 0;
    pthread_cond_broadcast(&p->cv_work);
    pthread_cond_broadcast(&p->cv_drop);
    int dropper = p->drop_started;
    p->drop_started = 0;
    pthread_mutex_unlock(&p->mu);
    if (p->pid == getpid()) {
        for (int i = 0; i < n; i++) pthread_join(tids[i], NULL);
        if (dropper) pthread_join(p->drop_tid, NULL); /* it drains the queue first */
    }
    free(tids);
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < p->nspare; i++) free(p->spare[i]);
    p->nspare = 0;
    pthread_mutex_unlock(&p->mu);
}

static PyObject *Pool_close(PoolObject *self, PyObject *Py_UNUSED(ignored)) {
    Py_BEGIN_ALLOW_THREADS
    pool_shutdown(self);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static void Pool_dealloc(PoolObject *self) {
    Py_BEGIN_ALLOW_THREADS
    pool_shutdown(self);
    Py_END_ALLOW_THREADS
    free(self->spare);
    pthread_mutex_destroy(&self->mu);
    pthread_cond_destroy(&self->cv_work);
    pthread_cond_destroy(&self->cv_drop);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int parse_fds(PyObject *obj, int nfiles, int **out, const char *what) {
    PyObject *seq = PySequence_Fast(obj, "fds must be a sequence of ints");
    if (!seq) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != nfiles) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "%s: expected %d descriptors", what, nfiles);
        return -1;
    }
    int *a = PyMem_Malloc(sizeof(int) * (nfiles > 0 ? nfiles : 1));
    if (!a) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    for (int i = 0; i < nfiles; i++) {
        long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            PyMem_Free(a);
            return -1;
        }
        a[i] = (int)v;
    }
    Py_DECREF(seq);
    *out = a;
    return 0;
}

/* Parse and check (batch, fds, dfds, mode); on success *fds and *dfds are PyMem buffers. */
static int run_args(PyObject *args, BatchObject **b, int **fds, int **dfds, int *mode) {
    PyObject *fds_obj, *dfds_obj;
    if (!PyArg_ParseTuple(args, "O!OOi", &BatchType, b, &fds_obj, &dfds_obj, mode)) return -1;
    if (*mode < MODE_NONE || *mode > MODE_NOCACHE) {
        PyErr_SetString(PyExc_ValueError, "mode must be 0 (none), 1 (fadvise), 2 (direct) or 3 (nocache)");
        return -1;
    }
    if ((*b)->running) {
        PyErr_SetString(PyExc_RuntimeError, "this batch is already being read by another thread");
        return -1;
    }
    if (parse_fds(fds_obj, (*b)->nfiles, fds, "fds") < 0) return -1;
    if (parse_fds(dfds_obj, (*b)->nfiles, dfds, "dfds") < 0) {
        PyMem_Free(*fds);
        return -1;
    }
    for (int i = 0; i < (*b)->nspans; i++) {
        int f = (*b)->spans[i].file;
        int d = *mode == MODE_DIRECT ? (*dfds)[f] : (*fds)[f];
        if (d < 0) {
            PyMem_Free(*fds);
            PyMem_Free(*dfds);
            PyErr_Format(PyExc_ValueError, "file %d is not open (%s descriptor missing)", f,
                         *mode == MODE_DIRECT ? "O_DIRECT" : "buffered");
            return -1;
        }
    }
    return 0;
}

static void init_job(Job *j, const BatchObject *b, const int *fds, const int *dfds, int mode, int64_t bounce_bytes) {
    memset(j, 0, sizeof(*j));
    j->spans = b->spans;
    j->nspans = b->nspans;
    j->segs = b->segs;
    j->fds = fds;
    j->dfds = dfds;
    j->mode = mode;
    j->bounce_bytes = bounce_bytes;
    j->err_span = -1;
    pthread_cond_init(&j->cv, NULL);
}

/* without the GIL: a forked child has none of the parent's workers; start afresh */
static void pool_after_fork(PoolObject *p) {
    if (p->pid == getpid()) return;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_drop, NULL);
    p->dq_head = p->dq_count = 0;
    p->drop_started = 0;
    p->head = NULL;
    p->tids = NULL;
    p->nworkers = 0;
    p->started = 0;
    p->nspare = 0;
    p->pid = getpid();
}

/* under p->mu: queue job j for the workers and wake as many as it has spans (minus `keep`, the
 * spans the caller reads itself); 0 when there are no workers to take it */
static int enqueue(PoolObject *p, Job *j, int keep) {
    start_workers(p);
    if (p->nworkers <= 0 || p->stop) return 0;
    Job **pp = &p->head;
    while (*pp) pp = &(*pp)->qnext;
    *pp = j;
    int wake = j->nspans - keep < p->nworkers ? j->nspans - keep : p->nworkers;
    for (int i = 0; i < wake; i++) pthread_cond_signal(&p->cv_work);
    return 1;
}

/* under p->mu: the caller reads the spans of j no worker has claimed yet, with a spare bounce
 * buffer (kept for the next batch) */
static void read_unclaimed(PoolObject *p, Job *j) {
    void *bounce = NULL;
    if (j->mode == MODE_DIRECT && p->nspare > 0) bounce = p->spare[--p->nspare];
    while (j->next < j->nspans) {
        Job **pp = &p->head;
        while (*pp && *pp != j) pp = &(*pp)->qnext;
        int si;
        if (*pp)
            si = claim(p, j);
        else if ((si = j->next++) == 0) /* not queued: claim() did not stamp the first span */
            j->t_first = now_seconds();
        pthread_mutex_unlock(&p->mu);
        SpanResult res;
        run_span(p, j, si, &bounce, &res);
        pthread_mutex_lock(&p->mu);
        complete_span(p, j, si, &res);
    }
    if (bounce) {
        if (p->nspare == p->capspare) {
            int nc = p->capspare ? p->capspare * 2 : 4;
            void **ns = realloc(p->spare, sizeof(void *) * nc);
            if (ns) {
                p->spare = ns;
                p->capspare = nc;
            }
        }
        if (p->nspare < p->capspare && !p->closed)
            p->spare[p->nspare++] = bounce;
        else
            free(bounce);
    }
}

/* (bytes, syscalls, err) of a finished job, err None or (file, off, len, errno, pos) */
static PyObject *job_result(const Job *j, const BatchObject *b) {
    if (j->failed) {
        const Span *s = &b->spans[j->err_span];
        return Py_BuildValue("(LL(iLLiL))", (long long)j->bytes, (long long)j->syscalls, s->file, (long long)s->off,
                             (long long)s->len, j->err_errno, (long long)j->err_pos);
    }
    return Py_BuildValue("(LLO)", (long long)j->bytes, (long long)j->syscalls, Py_None);
}

static PyObject *Pool_run(PoolObject *self, PyObject *args) {
    BatchObject *b;
    int *fds, *dfds, mode;
    if (run_args(args, &b, &fds, &dfds, &mode) < 0) return NULL;
    b->running = 1;
    Job j;
    init_job(&j, b, fds, dfds, mode, self->bounce_bytes);
    Py_BEGIN_ALLOW_THREADS
    PoolObject *p = self;
    pool_after_fork(p);
    pthread_mutex_lock(&p->mu);
    if (j.nspans > 1) enqueue(p, &j, 1);
    /* the calling thread works on its own batch too (so a batch progresses even when the
     * workers are busy with another one, or there are none) */
    read_unclaimed(p, &j);
    while (j.done < j.nspans) pthread_cond_wait(&j.cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
    Py_END_ALLOW_THREADS
    pthread_cond_destroy(&j.cv);
    b->running = 0;
    PyMem_Free(fds);
    PyMem_Free(dfds);
    return job_result(&j, b);
}

/* A batch started by Pool.start: the workers read it while the caller goes on. */
typedef struct {
    PyObject_HEAD
    PoolObject *pool;
    BatchObject *batch;
    Job *job; /* freed with the ticket */
    int *fds, *dfds;
    PyObject *result;
} TicketObject;

static PyTypeObject TicketType;

static PyObject *Pool_start(PoolObject *self, PyObject *args) {
    BatchObject *b;
    int *fds, *dfds, mode;
    if (run_args(args, &b, &fds, &dfds, &mode) < 0) return NULL;
    Job *j = PyMem_RawMalloc(sizeof(Job));
    TicketObject *t = j ? PyObject_New(TicketObject, &TicketType) : NULL;
    if (!t) { /* the job or the ticket could not be allocated */
        PyMem_RawFree(j);
        PyMem_Free(fds);
        PyMem_Free(dfds);
        return PyErr_NoMemory();
    }
    b->running = 1;
    init_job(j, b, fds, dfds, mode, self->bounce_bytes);
    Py_INCREF(self);
    Py_INCREF(b);
    t->pool = self;
    t->batch = b;
    t->job = j;
    t->fds = fds;
    t->dfds = dfds;
    t->result = NULL;
    Py_BEGIN_ALLOW_THREADS
    PoolObject *p = self;
    pool_after_fork(p);
    pthread_mutex_lock(&p->mu);
    if (j->nspans > 0 && !enqueue(p, j, 0)) read_unclaimed(p, j); /* no workers: read it now */
    pthread_mutex_unlock(&p->mu);
    Py_END_ALLOW_THREADS
    return (PyObject *)t;
}

/* without the GIL: wait until the ticket's job is done or `timeout` seconds (< 0: no limit) have
 * passed; 1 when it is done. The job lives as long as the ticket, so any thread may wait on it. */
static int ticket_wait_job(TicketObject *t, double timeout) {
    PoolObject *p = t->pool;
    Job *j = t->job;
    struct timespec until;
    if (timeout >= 0) {
        clock_gettime(CLOCK_REALTIME, &until); /* the condition variables' clock */
        time_t whole = (time_t)timeout;
        until.tv_sec += whole;
        until.tv_nsec += (long)((timeout - (double)whole) * 1e9);
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&p->mu);
    int rc = 0;
    while (j->done < j->nspans && rc != ETIMEDOUT)
        rc = timeout < 0 ? pthread_cond_wait(&j->cv, &p->mu) : pthread_cond_timedwait(&j->cv, &p->mu, &until);
    int done = j->done >= j->nspans;
    pthread_mutex_unlock(&p->mu);
    return done;
}

static PyObject *Ticket_wait(TicketObject *self, PyObject *args) {
    PyObject *limit = Py_None;
    if (!PyArg_ParseTuple(args, "|O:wait", &limit)) return NULL;
    if (!self->result) {
        double timeout = -1.0;
        if (limit != Py_None) {
            timeout = PyFloat_AsDouble(limit);
            if (timeout == -1.0 && PyErr_Occurred()) return NULL;
            if (!(timeout >= 0)) timeout = 0;     /* negative or NaN: only look */
            else if (timeout > 1e9) timeout = -1.0; /* past any time_t deadline: no limit */
        }
        int done;
        Py_BEGIN_ALLOW_THREADS
        done = ticket_wait_job(self, timeout);
        Py_END_ALLOW_THREADS
        if (!done) Py_RETURN_NONE;
    }
    if (!self->result) { /* another thread may have built it while this one waited */
        Job *j = self->job;
        PyObject *r = job_result(j, self->batch);
        if (!r) return NULL;
        double seconds = j->nspans ? j->t_last - j->t_first : 0.0;
        self->result = Py_BuildValue("(OOOd)", PyTuple_GET_ITEM(r, 0), PyTuple_GET_ITEM(r, 1), PyTuple_GET_ITEM(r, 2),
                                     seconds);
        Py_DECREF(r);
        if (!self->result) return NULL;
        self->batch->running = 0;
    }
    Py_INCREF(self->result);
    return self->result;
}

static void Ticket_dealloc(TicketObject *self) {
    /* a ticket never waited for: its reads still write the batch's destinations */
    Py_BEGIN_ALLOW_THREADS
    ticket_wait_job(self, -1.0);
    Py_END_ALLOW_THREADS
    pthread_cond_destroy(&self->job->cv);
    PyMem_RawFree(self->job);
    self->batch->running = 0;
    PyMem_Free(self->fds);
    PyMem_Free(self->dfds);
    Py_XDECREF(self->result);
    Py_DECREF(self->batch);
    Py_DECREF(self->pool);
    PyObject_Free(self);
}

static PyMethodDef Ticket_methods[] = {
    {"wait", (PyCFunction)Ticket_wait, METH_VARARGS,
     "wait(timeout=None) -> (bytes, syscalls, err, seconds), or None if the batch is not read within timeout "
     "seconds; blocks without the GIL; seconds from its first span taken to its last done"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TicketType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "expert_stream.native._reader.Ticket",
    .tp_basicsize = sizeof(TicketObject),
    .tp_dealloc = (destructor)Ticket_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A batch Pool.start began reading; wait() for its result.",
    .tp_methods = Ticket_methods,
};

static PyObject *Pool_get_threads(PoolObject *self, void *c) { return PyLong_FromLong(self->threads); }
static PyObject *Pool_get_workers(PoolObject *self, void *c) { return PyLong_FromLong(self->nworkers); }

static PyMethodDef Pool_methods[] = {
    {"run", (PyCFunction)Pool_run, METH_VARARGS,
     "run(batch, fds, dfds, mode) -> (bytes, syscalls, err); releases the GIL for the whole batch"},
    {"start", (PyCFunction)Pool_start, METH_VARARGS,
     "start(batch, fds, dfds, mode) -> Ticket: the workers read the batch; returns at once"},
    {"close", (PyCFunction)Pool_close, METH_NOARGS, "stop and join the worker threads"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Pool_getset[] = {
    {"threads", (getter)Pool_get_threads, NULL, "worker threads to start", NULL},
    {"workers", (getter)Pool_get_workers, NULL, "worker threads started", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject PoolType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "expert_stream.native._reader.Pool",
    .tp_basicsize = sizeof(PoolObject),
    .tp_dealloc = (destructor)Pool_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Pool(threads=4, bounce_bytes=4 MiB): persistent reader threads for batches.",
    .tp_methods = Pool_methods,
    .tp_getset = Pool_getset,
    .tp_init = (initproc)Pool_init,
    .tp_new = Pool_new,
};

/* ------------------------------------------------------------------------------------------ */
/* raw_read: the fio-like reference                                                           */

typedef struct {
    const int *fds;
    const int64_t *offs;
    Py_ssize_t n;
    int64_t block;
    Py_ssize_t next;
    pthread_mutex_t mu;
    int err;
    Py_ssize_t err_index;
    int64_t bytes;
} RawJob;

static void *raw_worker(void *arg) {
    RawJob *rj = (RawJob *)arg;
    void *buf = NULL;
    if (posix_memalign(&buf, ES_ALIGN, (size_t)rj->block) != 0) {
        pthread_mutex_lock(&rj->mu);
        if (!rj->err) rj->err = ENOMEM;
        pthread_mutex_unlock(&rj->mu);
        return NULL;
    }
    int64_t mine = 0;
    for (;;) {
        pthread_mutex_lock(&rj->mu);
        Py_ssize_t i = rj->err ? rj->n : rj->next++;
        pthread_mutex_unlock(&rj->mu);
        if (i >= rj->n) break;
        int64_t done = 0;
        while (done < rj->block) {
            ssize_t r = pread(rj->fds[i], (char *)buf + done, (size_t)(rj->block - done), (off_t)(rj->offs[i] + done));
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) {
                pthread_mutex_lock(&rj->mu);
                if (!rj->err) {
                    rj->err = r < 0 ? errno : -1;
                    rj->err_index = i;
                }
                pthread_mutex_unlock(&rj->mu);
                break;
            }
            done += r;
        }
        mine += done;
    }
    pthread_mutex_lock(&rj->mu);
    rj->bytes += mine;
    pthread_mutex_unlock(&rj->mu);
    free(buf);
    return NULL;
}

static PyObject *es_raw_read(PyObject *mod, PyObject *args) {
    PyObject *fds_obj, *offs_obj;
    long long block;
    int threads;
    if (!PyArg_ParseTuple(args, "OOLi", &fds_obj, &offs_obj, &block, &threads)) return NULL;
    if (block < 1 || threads < 1 || threads > 256) {
        PyErr_SetString(PyExc_ValueError, "raw_read: block >= 1 and threads in 1..256");
        return NULL;
    }
    PyObject *fs = PySequence_Fast(fds_obj, "fds must be a sequence");
    if (!fs) return NULL;
    PyObject *os_ = PySequence_Fast(offs_obj, "offsets must be a sequence");
    if (!os_) {
        Py_DECREF(fs);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fs);
    if (PySequence_Fast_GET_SIZE(os_) != n) {
        Py_DECREF(fs);
        Py_DECREF(os_);
        PyErr_SetString(PyExc_ValueError, "raw_read: fds and offsets differ in length");
        return NULL;
    }
    int *fds = PyMem_Malloc(sizeof(int) * (n ? n : 1));
    int64_t *offs = PyMem_Malloc(sizeof(int64_t) * (n ? n : 1));
    if (!fds || !offs) {
        PyMem_Free(fds);
        PyMem_Free(offs);
        Py_DECREF(fs);
        Py_DECREF(os_);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        fds[i] = (int)PyLong_AsLong(PySequence_Fast_GET_ITEM(fs, i));
        offs[i] = (int64_t)PyLong_AsLongLong(PySequence_Fast_GET_ITEM(os_, i));
    }
    Py_DECREF(fs);
    Py_DECREF(os_);
    if (PyErr_Occurred()) {
        PyMem_Free(fds);
        PyMem_Free(offs);
        return NULL;
    }
    RawJob rj;
    memset(&rj, 0, sizeof(rj));
    rj.fds = fds;
    rj.offs = offs;
    rj.n = n;
    rj.block = block;
    rj.err_index = -1;
    pthread_mutex_init(&rj.mu, NULL);
    double t0, t1;
    Py_BEGIN_ALLOW_THREADS
    pthread_t *tids = calloc((size_t)threads, sizeof(pthread_t));
    int started = 0;
    t0 = now_seconds();
    if (tids)
        for (int i = 1; i < threads; i++) {
            if (pthread_create(&tids[i], NULL, raw_worker, &rj) != 0) break;
            started++;
        }
    raw_worker(&rj);
    for (int i = 1; i <= started; i++) pthread_join(tids[i], NULL);
    t1 = now_seconds();
    free(tids);
    Py_END_ALLOW_THREADS
    pthread_mutex_destroy(&rj.mu);
    PyMem_Free(fds);
    PyMem_Free(offs);
    return Py_BuildValue("(Ldin)", (long long)rj.bytes, t1 - t0, rj.err, rj.err_index);
}

/* ------------------------------------------------------------------------------------------ */

static PyMethodDef module_methods[] = {
    {"plan", es_plan, METH_VARARGS,
     "plan(requests, nfiles, threads, max_span, min_span, iov_max) -> Batch (validated, sorted, merged)"},
    {"raw_read", es_raw_read, METH_VARARGS,
     "raw_read(fds, offsets, block, threads) -> (bytes, seconds, errno, fail_index): plain preads"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_reader", "Native batch reader for expert_stream (see native/reader.c).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit__reader(void) {
    if (PyType_Ready(&BatchType) < 0 || PyType_Ready(&PoolType) < 0 || PyType_Ready(&TicketType) < 0) return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    Py_INCREF(&BatchType);
    Py_INCREF(&PoolType);
    if (PyModule_AddObject(m, "Batch", (PyObject *)&BatchType) < 0 ||
        PyModule_AddObject(m, "Pool", (PyObject *)&PoolType) < 0 || PyModule_AddIntConstant(m, "ALIGN", ES_ALIGN) < 0 ||
        PyModule_AddIntConstant(m, "IOV_CAP", ES_IOV_CAP) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
