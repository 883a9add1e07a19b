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

static void release_columns(Py_buffer views[], int held) {
    while (held-- > 0) {
        PyBuffer_Release(&views[held]);
    }
}

/* Three columns of one length, the third of byte counts: `names` name them in errors,
 * `fn` the caller, and `negative` (a format of the entry's index and value) says what a
 * negative count is. Returns their length with every view held (release_columns(views,
 * 3)), or -1 with none held and an exception set. */
static Py_ssize_t get_columns(const char *fn, PyObject *const objs[3], const char *const names[3],
                              const char *negative, Py_buffer views[3]) {
    for (int c = 0; c < 3; c++) {
        if (PyObject_GetBuffer(objs[c], &views[c], PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            release_columns(views, c);
            return -1;
        }
        if (views[c].itemsize != 8 || views[c].ndim != 1) {
            PyErr_Format(PyExc_ValueError,
                         "%s: %s must be a 1-D array of 64-bit integers "
                         "(itemsize %zd, %d dimension(s))",
                         fn, names[c], views[c].itemsize, views[c].ndim);
            release_columns(views, c + 1);
            return -1;
        }
    }
    Py_ssize_t count = views[2].shape[0];
    if (views[0].shape[0] != count || views[1].shape[0] != count) {
        PyErr_Format(PyExc_ValueError, "%s: columns differ in length (%s %zd, %s %zd, %s %zd)",
                     fn, names[0], views[0].shape[0], names[1], views[1].shape[0], names[2],
                     count);
        release_columns(views, 3);
        return -1;
    }
    const int64_t *sizes = views[2].buf;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (sizes[i] < 0) {
            PyErr_Format(PyExc_ValueError, negative, i, (long long)sizes[i]);
            release_columns(views, 3);
            return -1;
        }
    }
    return count;
}

static PyObject *copy_runs(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "OOO:copy_runs", &objs[0], &objs[1], &objs[2])) {
        return NULL;
    }
    static const char *const names[3] = {"dst", "src", "nbytes"};
    Py_buffer views[3];
    Py_ssize_t count =
        get_columns("copy_runs", objs, names, "copy_runs: run %zd has %lld bytes", views);
    if (count < 0) {
        return NULL;
    }
    const int64_t *d = views[0].buf, *s = views[1].buf, *k = views[2].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < count; i++) {
        memcpy((void *)(uintptr_t)d[i], (const void *)(uintptr_t)s[i], (size_t)k[i]);
    }
    Py_END_ALLOW_THREADS
    release_columns(views, 3);
    Py_RETURN_NONE;
}

static PyObject *copy_chains(PyObject *self, PyObject *args) {
    unsigned long long dst_base, src_base;
    long long rows, dst_pitch, src_pitch;
    PyObject *objs[3];
    if (!PyArg_ParseTuple(args, "KKOOOLLL:copy_chains", &dst_base, &src_base, &objs[0],
                          &objs[1], &objs[2], &rows, &dst_pitch, &src_pitch)) {
        return NULL;
    }
    if (rows < 0) {
        PyErr_Format(PyExc_ValueError, "copy_chains: %lld rows", rows);
        return NULL;
    }
    static const char *const names[3] = {"dst_starts", "src_starts", "widths"};
    Py_buffer views[3];
    Py_ssize_t count = get_columns("copy_chains", objs, names,
                                   "copy_chains: chain %zd is %lld bytes wide", views);
    if (count < 0) {
        return NULL;
    }
    const int64_t *d = views[0].buf, *s = views[1].buf, *k = views[2].buf;
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
    release_columns(views, 3);
    Py_RETURN_NONE;
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
