/* kvdepot.server.memory._runcopy: a whole copy plan in one call, without the GIL.
 *
 * A vLLM job is hundreds of 64 KiB runs. Copied from Python (one memmove or one
 * numpy copy per group of runs), the copy thread takes the GIL back between runs
 * and waits for it while the event loop plans the next job; and grouping the runs
 * costs the loop about as much again. Here the thread takes the GIL once to start
 * and once to end, and the loop only computes the address columns.
 *
 * copy_runs(dst, src, nbytes): three C-contiguous buffers of equal length holding
 * 64-bit integers (numpy int64 arrays): run i copies nbytes[i] bytes from address
 * src[i] to address dst[i]. The caller vouches for the addresses: every run must
 * lie in memory that stays mapped for the call, and destination runs must not
 * overlap a source run. Raises ValueError on columns it cannot read.
 *
 * copy_chains(dst_base, src_base, dst_starts, src_starts, widths, rows, dst_pitch,
 * src_pitch): a plan of chains (kvdepot.server.core.planner.PageChains), vLLM's
 * layout, without a run table: chain i is `rows` runs of widths[i] bytes, row r from
 * src_base + src_starts[i] + r * src_pitch to dst_base + dst_starts[i] + r *
 * dst_pitch. The same vouching as copy_runs: the caller bounded every chain
 * (copy_engine.check_runs).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static int get_column(PyObject *obj, Py_buffer *view, const char *name) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        return -1;
    }
    if (view->itemsize != 8 || view->ndim != 1) {
        PyErr_Format(PyExc_ValueError,
                     "copy_runs: %s must be a 1-D array of 64-bit integers "
                     "(itemsize %zd, %d dimension(s))",
                     name, view->itemsize, view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static PyObject *copy_runs(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj, *n_obj;
    if (!PyArg_ParseTuple(args, "OOO:copy_runs", &dst_obj, &src_obj, &n_obj)) {
        return NULL;
    }
    Py_buffer dst, src, n;
    if (get_column(dst_obj, &dst, "dst") < 0) {
        return NULL;
    }
    if (get_column(src_obj, &src, "src") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (get_column(n_obj, &n, "nbytes") < 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t count = n.shape[0];
    if (dst.shape[0] != count || src.shape[0] != count) {
        PyErr_Format(PyExc_ValueError,
                     "copy_runs: columns differ in length (dst %zd, src %zd, nbytes %zd)",
                     dst.shape[0], src.shape[0], count);
        goto done;
    }
    const int64_t *d = dst.buf, *s = src.buf, *k = n.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (k[i] < 0) {
            PyErr_Format(PyExc_ValueError, "copy_runs: run %zd has %lld bytes", i,
                         (long long)k[i]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)k[i]);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&n);
    return result;
}

static PyObject *copy_chains(PyObject *self, PyObject *args) {
    unsigned long long dst_base, src_base;
    long long rows, dst_pitch, src_pitch;
    PyObject *dst_obj, *src_obj, *w_obj;
    if (!PyArg_ParseTuple(args, "KKOOOLLL:copy_chains", &dst_base, &src_base, &dst_obj,
                          &src_obj, &w_obj, &rows, &dst_pitch, &src_pitch)) {
        return NULL;
    }
    if (rows < 0) {
        PyErr_Format(PyExc_ValueError, "copy_chains: %lld rows", rows);
        return NULL;
    }
    Py_buffer dst, src, w;
    if (get_column(dst_obj, &dst, "dst_starts") < 0) {
        return NULL;
    }
    if (get_column(src_obj, &src, "src_starts") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (get_column(w_obj, &w, "widths") < 0) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return NULL;
    }
    PyObject *result = NULL;
    Py_ssize_t count = w.shape[0];
    if (dst.shape[0] != count || src.shape[0] != count) {
        PyErr_Format(PyExc_ValueError,
                     "copy_chains: columns differ in length (dst %zd, src %zd, widths %zd)",
                     dst.shape[0], src.shape[0], count);
        goto done;
    }
    const int64_t *d = dst.buf, *s = src.buf, *k = w.buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (k[i] < 0) {
            PyErr_Format(PyExc_ValueError, "copy_chains: chain %zd is %lld bytes wide", i,
                         (long long)k[i]);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        uintptr_t dc = (uintptr_t)dst_base + (uintptr_t)d[i];
        uintptr_t sc = (uintptr_t)src_base + (uintptr_t)s[i];
        for (long long r = 0; r < rows; r++) {
            memcpy((void *)(dc + (uintptr_t)(r * dst_pitch)),
                   (const void *)(sc + (uintptr_t)(r * src_pitch)), (size_t)k[i]);
        }
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    PyBuffer_Release(&w);
    return result;
}

static PyMethodDef methods[] = {
    {"copy_runs", copy_runs, METH_VARARGS,
     "copy_runs(dst, src, nbytes): copies run i, nbytes[i] bytes from address src[i] to "
     "address dst[i], for every i, with the GIL released. Columns: 1-D contiguous "
     "64-bit integer arrays of one length."},
    {"copy_chains", copy_chains, METH_VARARGS,
     "copy_chains(dst_base, src_base, dst_starts, src_starts, widths, rows, dst_pitch, "
     "src_pitch): copies chain i's rows r < rows, widths[i] bytes from src_base + "
     "src_starts[i] + r * src_pitch to dst_base + dst_starts[i] + r * dst_pitch, with the "
     "GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_runcopy",
    "A copy plan's runs copied in one call, without the GIL (kvdepot's CPU copy engine).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__runcopy(void) { return PyModule_Create(&module); }
