/* kvdepot.server.cuda._dma: a whole DMA job in one call, without the GIL.
 *
 * Issued from Python, a job is a dozen or more driver calls (the worker's event
 * wait, one cuMemcpy2DAsync per block or a batch, the completion event), and the
 * copy thread takes the GIL back after each one. On a GPU machine the event loop
 * holds the GIL most of the time while jobs arrive, so each take-back waited for
 * it: measured on an H200, queueing a 16-block job cost the copy thread 0.5 ms in
 * the daemon against 0.06 ms in a quiet process, and that, not the DMA, set the
 * daemon's GB/s. Here the thread gives the GIL up once, makes every call of the
 * job, waits for the DMA, and takes it back once.
 *
 * The driver entry points come from the caller (kvdepot.server.cuda.driver, which
 * resolved them with their ABI), as addresses, so this file needs no CUDA headers
 * and links against nothing.
 *
 * run_job(fns, batch_abi, ctx, stream, done, waits, dsts, srcs, widths, rows,
 *         dst_pitch, src_pitch, batches, attrs, attr_idx) -> (step, code, issue_ns, wait_ns)
 *   fns: 64-bit addresses of cuCtxSetCurrent, cuStreamWaitEvent, cuMemcpy2DAsync_v2,
 *   cuMemcpyBatchAsync (0 when absent), cuEventRecord, cuEventSynchronize,
 *   cuStreamSynchronize. batch_abi: 2 (CUDA 13: no failIdx) or 1 (12.8).
 *   Makes `ctx` current, makes `stream` wait on each event in `waits`, queues the
 *   2-D copies (copy i: `rows` rows of widths[i] bytes from srcs[i] + r * src_pitch
 *   to dsts[i] + r * dst_pitch) and then each (dsts, srcs, sizes) batch with the
 *   attribute record at `attrs` / `attr_idx`, records `done` on the stream and
 *   waits for it. Whatever fails, work already queued is waited for before the
 *   call returns (the caller may unmap and reuse memory next).
 *   step: 0 when every call succeeded, else which call failed first (STEP_* below)
 *   with its CUresult in `code`. issue_ns / wait_ns: time spent queueing, waiting.
 *   Raises ValueError on arguments it cannot read (nothing is called then).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

enum { STEP_OK, STEP_CONTEXT, STEP_WAIT, STEP_2D, STEP_BATCH, STEP_RECORD, STEP_SYNC };
enum { F_CTX, F_WAIT, F_2D, F_BATCH, F_RECORD, F_EVSYNC, F_STREAMSYNC, N_FNS };

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

/* cuda.h's CUDA_MEMCPY2D (v2), field for field. */
typedef struct {
    size_t srcXInBytes, srcY;
    int srcMemoryType;
    const void *srcHost;
    CUdeviceptr srcDevice;
    void *srcArray;
    size_t srcPitch;
    size_t dstXInBytes, dstY;
    int dstMemoryType;
    void *dstHost;
    CUdeviceptr dstDevice;
    void *dstArray;
    size_t dstPitch;
    size_t WidthInBytes, Height;
} Memcpy2D;

#define MEMORYTYPE_UNIFIED 4

typedef CUresult (*ctx_fn)(void *);
typedef CUresult (*wait_fn)(void *, void *, unsigned int);
typedef CUresult (*m2d_fn)(const Memcpy2D *, void *);
typedef CUresult (*batch2_fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *,
                              size_t, void *);
typedef CUresult (*batch1_fn)(CUdeviceptr *, CUdeviceptr *, size_t *, size_t, void *, size_t *,
                              size_t, size_t *, void *);
typedef CUresult (*record_fn)(void *, void *);
typedef CUresult (*sync_fn)(void *);

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* A 1-D contiguous buffer of 64-bit integers (array('Q'), numpy uint64). */
static int get_words(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (view->itemsize != 8 || view->ndim != 1) {
        PyErr_Format(PyExc_ValueError, "run_job: %s must be a 1-D array of 64-bit integers",
                     name);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *run_job(PyObject *self, PyObject *args) {
    PyObject *fns_obj, *waits_obj, *dsts_obj, *srcs_obj, *widths_obj, *batches_obj;
    int abi;
    unsigned long long ctx, stream, done, attrs, attr_idx;
    Py_ssize_t rows, dst_pitch, src_pitch;
    if (!PyArg_ParseTuple(args, "OiKKKOOOOnnnOKK:run_job", &fns_obj, &abi, &ctx, &stream, &done,
                          &waits_obj, &dsts_obj, &srcs_obj, &widths_obj, &rows, &dst_pitch,
                          &src_pitch, &batches_obj, &attrs, &attr_idx)) {
        return NULL;
    }
    Py_buffer fv, wv, dv, sv, zv;
    Py_buffer *bv = NULL;
    int held = 0, nb = 0;
    Py_buffer *order[5] = {&fv, &wv, &dv, &sv, &zv};
    PyObject *objs[5] = {fns_obj, waits_obj, dsts_obj, srcs_obj, widths_obj};
    static const char *names[5] = {"fns", "waits", "dsts", "srcs", "widths"};
    PyObject *result = NULL;
    for (; held < 5; held++) {
        if (get_words(objs[held], order[held], names[held]) < 0) goto release;
    }
    Py_ssize_t n2d = dv.shape[0];
    if (fv.shape[0] != N_FNS || sv.shape[0] != n2d || zv.shape[0] != n2d || rows < 0 ||
        dst_pitch < 0 || src_pitch < 0) {
        PyErr_SetString(PyExc_ValueError, "run_job: 7 entry points, and equal 2-D columns");
        goto release;
    }
    PyObject *seq = PySequence_Fast(batches_obj, "run_job: batches must be a sequence");
    if (seq == NULL) goto release;
    Py_ssize_t nbatch = PySequence_Fast_GET_SIZE(seq);
    bv = PyMem_Calloc(3 * (size_t)nbatch + 1, sizeof(Py_buffer));
    if (bv == NULL) {
        PyErr_NoMemory();
        Py_DECREF(seq);
        goto release;
    }
    for (; nb < nbatch; nb++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, nb);
        PyObject *d, *s, *z;
        if (!PyArg_ParseTuple(t, "OOO:batch", &d, &s, &z)) break;
        if (get_words(d, &bv[3 * nb], "batch dsts") < 0) break;
        if (get_words(s, &bv[3 * nb + 1], "batch srcs") < 0) {
            PyBuffer_Release(&bv[3 * nb]);
            break;
        }
        if (get_words(z, &bv[3 * nb + 2], "batch sizes") < 0) {
            PyBuffer_Release(&bv[3 * nb]);
            PyBuffer_Release(&bv[3 * nb + 1]);
            break;
        }
        if (bv[3 * nb].shape[0] != bv[3 * nb + 2].shape[0] ||
            bv[3 * nb + 1].shape[0] != bv[3 * nb + 2].shape[0]) {
            PyErr_SetString(PyExc_ValueError, "run_job: a batch's columns differ in length");
            for (int k = 0; k < 3; k++) PyBuffer_Release(&bv[3 * nb + k]);
            break;
        }
    }
    Py_DECREF(seq);
    if (nb < nbatch) goto release;

    const uint64_t *fn = fv.buf;
    if ((nbatch && !fn[F_BATCH]) || (n2d && !fn[F_2D])) {
        PyErr_SetString(PyExc_ValueError, "run_job: a copy needs an entry point that is 0");
        goto release;
    }
    const uint64_t *waits = wv.buf, *dsts = dv.buf, *srcs = sv.buf, *widths = zv.buf;
    Py_ssize_t nwaits = wv.shape[0];
    int step = STEP_OK;
    CUresult code = 0;
    int64_t t0, t1, t2;
    void *st = (void *)(uintptr_t)stream, *ev = (void *)(uintptr_t)done;

    Py_BEGIN_ALLOW_THREADS;
    t0 = now_ns();
    code = ((ctx_fn)(uintptr_t)fn[F_CTX])((void *)(uintptr_t)ctx);
    if (code) {
        step = STEP_CONTEXT;
        t1 = t2 = now_ns();
    } else {
        for (Py_ssize_t i = 0; i < nwaits && !step; i++) {
            code = ((wait_fn)(uintptr_t)fn[F_WAIT])(st, (void *)(uintptr_t)waits[i], 0);
            if (code) step = STEP_WAIT;
        }
        Memcpy2D p;
        memset(&p, 0, sizeof p);
        p.srcMemoryType = p.dstMemoryType = MEMORYTYPE_UNIFIED;
        p.srcPitch = (size_t)src_pitch;
        p.dstPitch = (size_t)dst_pitch;
        p.Height = (size_t)rows;
        for (Py_ssize_t i = 0; i < n2d && !step; i++) {
            p.srcDevice = srcs[i];
            p.dstDevice = dsts[i];
            p.WidthInBytes = widths[i];
            code = ((m2d_fn)(uintptr_t)fn[F_2D])(&p, st);
            if (code) step = STEP_2D;
        }
        for (int b = 0; b < nb && !step; b++) {
            size_t count = (size_t)bv[3 * b + 2].shape[0];
            CUdeviceptr *d = bv[3 * b].buf, *s = bv[3 * b + 1].buf;
            size_t *z = bv[3 * b + 2].buf;
            if (abi == 2) {
                code = ((batch2_fn)(uintptr_t)fn[F_BATCH])(d, s, z, count, (void *)(uintptr_t)attrs,
                                                           (size_t *)(uintptr_t)attr_idx, 1, st);
            } else {
                size_t fail = 0;
                code = ((batch1_fn)(uintptr_t)fn[F_BATCH])(d, s, z, count, (void *)(uintptr_t)attrs,
                                                           (size_t *)(uintptr_t)attr_idx, 1, &fail,
                                                           st);
            }
            if (code) step = STEP_BATCH;
        }
        t1 = now_ns();
        /* Wait for what was queued, whatever failed: the event recorded behind it, or
         * the whole stream when even the record fails. */
        CUresult rc = ((record_fn)(uintptr_t)fn[F_RECORD])(ev, st);
        if (rc) {
            if (!step) {
                step = STEP_RECORD;
                code = rc;
            }
            ((sync_fn)(uintptr_t)fn[F_STREAMSYNC])(st);
        } else {
            rc = ((sync_fn)(uintptr_t)fn[F_EVSYNC])(ev);
            if (rc && !step) {
                step = STEP_SYNC;
                code = rc;
            }
        }
        t2 = now_ns();
    }
    Py_END_ALLOW_THREADS;
    result = Py_BuildValue("(iiLL)", step, code, (long long)(t1 - t0), (long long)(t2 - t1));
release:
    for (int b = 0; b < 3 * nb; b++) PyBuffer_Release(&bv[b]);
    PyMem_Free(bv);
    for (int k = 0; k < held; k++) PyBuffer_Release(order[k]);
    return result;
}

static PyMethodDef methods[] = {
    {"run_job", run_job, METH_VARARGS,
     "run_job(fns, batch_abi, ctx, stream, done, waits, dsts, srcs, widths, rows, dst_pitch, "
     "src_pitch, batches, attrs, attr_idx) -> (step, code, issue_ns, wait_ns): one DMA job's "
     "driver calls and the wait for it, with the GIL released (see the module's "
     "documentation)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_dma",
    "A DMA job's driver calls in one call, without the GIL (kvdepot's CUDA copy engine).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__dma(void) { return PyModule_Create(&module); }
