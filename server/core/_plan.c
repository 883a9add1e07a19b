/* kvdepot.server.core._plan: the copy planner's per-page loops, in C.
 *
 * A 16-chunk job of Llama-3-8B's geometry is 512 pages. numpy builds its runs and
 * addresses in a dozen array operations, and each one over more than 500 elements
 * releases the GIL; on the daemon's event loop, a copy thread or gRPC's poller then
 * takes it, and every job paid several thread switches (planning cost four times
 * what it costs in a quiet process). These two loops hold the GIL, allocate
 * nothing, and write into arrays the caller owns. planner.py and dma.py keep the
 * numpy versions for installs without a C compiler; tests hold the two equal.
 *
 * Every column is a buffer of 64-bit integers (numpy int64/uint64, array('Q')):
 * 1-D and contiguous, or for the run table a 2-D (4, capacity) array whose rows
 * are contiguous (a column slice of a C-ordered array qualifies).
 *
 * plan_group(out, count, region, base, stride, page, slot_base, blocks, slots, subs)
 *   Appends one group's pages to the run table `out` (rows: region, region offset,
 *   pool offset, bytes), whose first `count` columns hold runs already planned.
 *   Per layer l (region[l], base[l], stride[l], page[l], slot_base[l]) and block i
 *   (blocks[i], slots[i], subs[i] or subs None): the page at region offset
 *   base[l] + blocks[i] * stride[l] goes to pool offset
 *   slot_base[l] + slots[i] + subs[i] * page[l]; a block whose slot is negative is
 *   skipped. Layer-major, blocks in order; a page contiguous on both sides with the
 *   run before it (the previous group's last included) extends that run.
 *   Returns (count, bytes added). Raises ValueError when `out` is too small.
 *
 * stride_period(dev, host, size, count, min_rows, base, split)
 *   Finds the strided shape of a job's address columns, for 2-D copies: the
 *   smallest period p (dividing count, with count / p >= min_rows) such that entry
 *   k + p lies the same distances d and h after entry k on the two sides for every
 *   k, with the same size, and d and h at least that size; with split > 0 each
 *   chain's host bytes must also lie in one split-sized piece of offsets from base
 *   (a page-locked range of the pool). Entry k then starts a
 *   chain k, k + p, k + 2p, ...: one 2-D copy of count / p rows. vLLM's layers are
 *   regions of one allocation at a constant stride, and a block's pages sit one
 *   after another in its pool row: p is the number of blocks. Returns 0 when no
 *   period fits.
 *
 * address_runs(runs, bases, pool_address, split, dev, host, size)
 *   Turns the run table `runs` (4, n) into address columns: dev = bases[region] +
 *   region offset, host = pool_address + pool offset, size = bytes; with split > 0
 *   a run is cut where its pool offset crosses a multiple of split. Returns the
 *   number of entries written. Raises ValueError on a run that moves no bytes, has
 *   a negative offset or names a region `bases` does not have, and when the
 *   output columns are too small; nothing is promised about them then.
 *
 * chain_starts(blocks, slots, subs, region_out, pool_out, width_out, base, stride,
 *              slot_base, page, region_pitch, pool_pitch)
 *   A group whose layers lie at one pitch on both sides (planner.py's chained groups:
 *   layer l's page of block i at region offset base + l * region_pitch +
 *   blocks[i] * stride and pool offset slot_base + l * pool_pitch + slots[i] +
 *   subs[i] * page) plans as chains, one per run of a layer: each kept block's page
 *   (negative slots skipped, blocks in order) starts a chain, or widens the one before
 *   when it follows it on both sides, as plan_group merges them in every layer alike.
 *   Writes each chain's first run (layer 0: its region and pool offsets, its width) to
 *   the outputs. Per block, not per page. Returns (chains, lowest region start, end of
 *   the highest region run, lowest pool start, end of the highest pool run, widest
 *   run, bytes of a layer), or None when plan_group would also merge a layer's last
 *   run with the next layer's first (the caller then plans page by page, so that both
 *   give the same runs).
 *
 * chain_dma(region_starts, pool_starts, widths, s_dev, s_host, s_width, d_dev, d_host,
 *           d_size, rows, region_pitch, pool_pitch, dev_base, pool_address, split)
 *   A plan of chains (chain_starts) as DMA: chain k's first run at dev_base +
 *   region_starts[k] and pool_address + pool_starts[k], widths[k] bytes. A chain whose
 *   pool bytes lie in one split-sized piece of offsets (split 0: every chain) becomes
 *   a 2-D copy, its start and width written to s_dev/s_host/s_width; the others' runs
 *   become descriptors in d_dev/d_host/d_size, chain by chain, each run cut where its
 *   pool offset crosses a multiple of split. Returns (2-D copies, descriptors). With
 *   d_dev None it writes no descriptors and returns the number it would write (to
 *   size them). Raises ValueError on a negative start or width and when an output is
 *   too small.
 *
 * run_bounds(runs, sizes, pool_size)
 *   Whether every run of the table `runs` (4, n) lies inside its region (sizes[r]
 *   bytes) and, with pool_size >= 0, inside the pool: True, or False for a run that
 *   moves no bytes, has a negative offset, names a region `sizes` lacks, or ends
 *   past its region or the pool. Overflow-safe (every value is compared before it is
 *   added). The copy engines' defence in depth (copy_engine.check_runs).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* A column of 64-bit integers: 1-D contiguous (ndim 1) or a (4, n) table whose
 * rows are contiguous (ndim 2). */
static int get_column(PyObject *obj, Py_buffer *view, const char *name, int ndim,
                      int writable) {
    int flags = PyBUF_STRIDES | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        return -1;
    }
    const char *fmt = view->format ? view->format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') {
        fmt++;
    }
    int is_int64 = view->itemsize == 8 && fmt[1] == '\0' && strchr("qQlL", fmt[0]) != NULL;
    if (!is_int64 || view->ndim != ndim || view->strides[ndim - 1] != 8 ||
        (ndim == 2 && (view->shape[0] != 4 || view->strides[0] % 8 != 0))) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a %s of 64-bit integers (got format '%s', %d dimension(s))",
                     name, ndim == 1 ? "contiguous 1-D array" : "(4, n) array with contiguous rows",
                     view->format ? view->format : "B", view->ndim);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static void release_all(Py_buffer *views, int n) {
    for (int i = 0; i < n; i++) {
        PyBuffer_Release(&views[i]);
    }
}

static PyObject *plan_group(PyObject *self, PyObject *args) {
    PyObject *objs[9], *subs_obj;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "OnOOOOOOOO:plan_group", &objs[0], &count, &objs[1], &objs[2],
                          &objs[3], &objs[4], &objs[5], &objs[6], &objs[7], &subs_obj)) {
        return NULL;
    }
    static const char *names[9] = {"out",    "region", "base",   "stride", "page",
                                   "slot_base", "blocks", "slots", "subs"};
    int has_subs = subs_obj != Py_None;
    objs[8] = subs_obj;
    int n_views = has_subs ? 9 : 8;
    Py_buffer v[9];
    for (int i = 0; i < n_views; i++) {
        if (get_column(objs[i], &v[i], names[i], i == 0 ? 2 : 1, i == 0) < 0) {
            release_all(v, i);
            return NULL;
        }
    }
    PyObject *result = NULL;
    Py_ssize_t layers = v[1].shape[0], nblocks = v[6].shape[0];
    Py_ssize_t cap = v[0].shape[1], row = v[0].strides[0] / 8;
    for (int i = 2; i <= 5; i++) {
        if (v[i].shape[0] != layers) {
            PyErr_Format(PyExc_ValueError, "plan_group: %s has %zd entries for %zd layers",
                         names[i], v[i].shape[0], layers);
            goto done;
        }
    }
    if (v[7].shape[0] != nblocks || (has_subs && v[8].shape[0] != nblocks)) {
        PyErr_Format(PyExc_ValueError, "plan_group: slots/subs differ in length from blocks (%zd)",
                     nblocks);
        goto done;
    }
    if (count < 0 || count > cap || layers * nblocks > cap - count) {
        PyErr_Format(PyExc_ValueError,
                     "plan_group: %zd run(s) after %zd do not fit a table of %zd", layers * nblocks,
                     count, cap);
        goto done;
    }
    int64_t *o_region = v[0].buf, *o_ro = o_region + row, *o_po = o_region + 2 * row,
            *o_n = o_region + 3 * row;
    const int64_t *region = v[1].buf, *base = v[2].buf, *stride = v[3].buf, *page = v[4].buf,
                  *slot_base = v[5].buf, *blocks = v[6].buf, *slots = v[7].buf;
    const int64_t *subs = has_subs ? v[8].buf : NULL;
    int64_t added = 0;
    Py_ssize_t n = count;
    for (Py_ssize_t l = 0; l < layers; l++) {
        int64_t r = region[l], b0 = base[l], st = stride[l], pg = page[l], sb = slot_base[l];
        for (Py_ssize_t i = 0; i < nblocks; i++) {
            int64_t slot = slots[i];
            if (slot < 0) {
                continue;
            }
            int64_t ro = b0 + blocks[i] * st;
            int64_t po = sb + slot + (subs ? subs[i] * pg : 0);
            added += pg;
            if (n > 0 && o_region[n - 1] == r && o_ro[n - 1] + o_n[n - 1] == ro &&
                o_po[n - 1] + o_n[n - 1] == po) {
                o_n[n - 1] += pg;
                continue;
            }
            o_region[n] = r;
            o_ro[n] = ro;
            o_po[n] = po;
            o_n[n] = pg;
            n++;
        }
    }
    result = Py_BuildValue("nL", n, (long long)added);
done:
    release_all(v, n_views);
    return result;
}

static PyObject *address_runs(PyObject *self, PyObject *args) {
    PyObject *objs[5];
    unsigned long long pool;
    long long split;
    if (!PyArg_ParseTuple(args, "OOKLOOO:address_runs", &objs[0], &objs[1], &pool, &split,
                          &objs[2], &objs[3], &objs[4])) {
        return NULL;
    }
    static const char *names[5] = {"runs", "bases", "dev", "host", "size"};
    Py_buffer v[5];
    for (int i = 0; i < 5; i++) {
        if (get_column(objs[i], &v[i], names[i], i == 0 ? 2 : 1, i >= 2) < 0) {
            release_all(v, i);
            return NULL;
        }
    }
    PyObject *result = NULL;
    if (split < 0) {
        PyErr_SetString(PyExc_ValueError, "address_runs: split must not be negative");
        goto done;
    }
    Py_ssize_t runs = v[0].shape[1], row = v[0].strides[0] / 8, regions = v[1].shape[0];
    Py_ssize_t cap = v[2].shape[0];
    if (v[3].shape[0] < cap) cap = v[3].shape[0];
    if (v[4].shape[0] < cap) cap = v[4].shape[0];
    const int64_t *c_region = v[0].buf, *c_ro = c_region + row, *c_po = c_region + 2 * row,
                  *c_n = c_region + 3 * row;
    const uint64_t *bases = v[1].buf;
    uint64_t *dev = v[2].buf, *host = v[3].buf, *size = v[4].buf;
    Py_ssize_t out = 0;
    for (Py_ssize_t i = 0; i < runs; i++) {
        int64_t r = c_region[i], ro = c_ro[i], po = c_po[i], n = c_n[i];
        if (n <= 0 || ro < 0 || po < 0) {
            PyErr_Format(PyExc_ValueError, "bad run (%lld, %lld, %lld, %lld)", (long long)r,
                         (long long)ro, (long long)po, (long long)n);
            goto done;
        }
        if (r < 0 || r >= regions) {
            PyErr_Format(PyExc_ValueError, "run names region %lld; %zd mapped", (long long)r,
                         regions);
            goto done;
        }
        uint64_t d = bases[r] + (uint64_t)ro, h = (uint64_t)pool + (uint64_t)po;
        while (n > 0) {
            int64_t piece = n;
            if (split > 0 && po % split + n > split) {
                piece = split - po % split;
            }
            if (out >= cap) {
                PyErr_Format(PyExc_ValueError,
                             "address_runs: more than %zd entries; give larger columns", cap);
                goto done;
            }
            dev[out] = d;
            host[out] = h;
            size[out] = (uint64_t)piece;
            out++;
            d += (uint64_t)piece;
            h += (uint64_t)piece;
            po += piece;
            n -= piece;
        }
    }
    result = PyLong_FromSsize_t(out);
done:
    release_all(v, 5);
    return result;
}

static PyObject *stride_period(PyObject *self, PyObject *args) {
    PyObject *objs[3];
    Py_ssize_t count, min_rows;
    unsigned long long base, split;
    if (!PyArg_ParseTuple(args, "OOOnnKK:stride_period", &objs[0], &objs[1], &objs[2], &count,
                          &min_rows, &base, &split)) {
        return NULL;
    }
    static const char *names[3] = {"dev", "host", "size"};
    Py_buffer v[3];
    for (int i = 0; i < 3; i++) {
        if (get_column(objs[i], &v[i], names[i], 1, 0) < 0) {
            release_all(v, i);
            return NULL;
        }
    }
    PyObject *result = NULL;
    if (count < 0 || count > v[0].shape[0] || count > v[1].shape[0] || count > v[2].shape[0]) {
        PyErr_SetString(PyExc_ValueError, "stride_period: count exceeds the columns");
        goto done;
    }
    if (min_rows < 2) min_rows = 2;
    const uint64_t *dev = v[0].buf, *host = v[1].buf, *size = v[2].buf;
    Py_ssize_t found = 0;
    for (Py_ssize_t p = 1; p * min_rows <= count && !found; p++) {
        if (count % p) continue;
        /* Unsigned differences wrap like the addresses do; a pitch must be at least
         * the row's width, and the same for every row. */
        uint64_t d = dev[p] - dev[0], h = host[p] - host[0];
        Py_ssize_t k = 0;
        for (; k < count - p; k++) {
            if (size[k + p] != size[k] || dev[k + p] - dev[k] != d || host[k + p] - host[k] != h ||
                d < size[k] || h < size[k] || (int64_t)d < 0 || (int64_t)h < 0) {
                break;
            }
        }
        if (k < count - p) continue;
        /* Each chain's host bytes inside one split-sized piece (offsets from base). */
        uint64_t span = (uint64_t)(count / p - 1) * h;
        for (k = 0; split && k < p; k++) {
            uint64_t first = host[k] - base;
            if (first / split != (first + span + size[k] - 1) / split) break;
        }
        if (!split || k == p) found = p;
    }
    result = PyLong_FromSsize_t(found);
done:
    release_all(v, 3);
    return result;
}

static PyObject *run_bounds(PyObject *self, PyObject *args) {
    PyObject *objs[2];
    long long pool_size;
    if (!PyArg_ParseTuple(args, "OOL:run_bounds", &objs[0], &objs[1], &pool_size)) {
        return NULL;
    }
    static const char *names[2] = {"runs", "sizes"};
    Py_buffer v[2];
    for (int i = 0; i < 2; i++) {
        if (get_column(objs[i], &v[i], names[i], i == 0 ? 2 : 1, 0) < 0) {
            release_all(v, i);
            return NULL;
        }
    }
    Py_ssize_t runs = v[0].shape[1], row = v[0].strides[0] / 8, regions = v[1].shape[0];
    const int64_t *c_region = v[0].buf, *c_ro = c_region + row, *c_po = c_region + 2 * row,
                  *c_n = c_region + 3 * row;
    const int64_t *sizes = v[1].buf;
    int inside = 1;
    for (Py_ssize_t i = 0; i < runs && inside; i++) {
        int64_t r = c_region[i], ro = c_ro[i], po = c_po[i], n = c_n[i];
        if (n <= 0 || ro < 0 || po < 0 || r < 0 || r >= regions) {
            inside = 0;
        } else if (ro > sizes[r] || n > sizes[r] - ro) {
            inside = 0;
        } else if (pool_size >= 0 && (po > pool_size || n > pool_size - po)) {
            inside = 0;
        }
    }
    release_all(v, 2);
    return PyBool_FromLong(inside);
}

static PyObject *chain_starts(PyObject *self, PyObject *args) {
    PyObject *objs[6], *subs_obj;
    long long base, stride, slot_base, page, region_pitch, pool_pitch;
    if (!PyArg_ParseTuple(args, "OOOOOOLLLLLL:chain_starts", &objs[0], &objs[1], &subs_obj,
                          &objs[2], &objs[3], &objs[4], &base, &stride, &slot_base, &page,
                          &region_pitch, &pool_pitch)) {
        return NULL;
    }
    static const char *names[6] = {"blocks",    "slots",     "region_out",
                                   "pool_out",  "width_out", "subs"};
    int has_subs = subs_obj != Py_None;
    objs[5] = subs_obj;
    int n_views = has_subs ? 6 : 5;
    Py_buffer v[6];
    for (int i = 0; i < n_views; i++) {
        if (get_column(objs[i], &v[i], names[i], 1, i >= 2 && i <= 4) < 0) {
            release_all(v, i);
            return NULL;
        }
    }
    PyObject *result = NULL;
    Py_ssize_t nblocks = v[0].shape[0];
    if (v[1].shape[0] != nblocks || (has_subs && v[5].shape[0] != nblocks) ||
        v[2].shape[0] < nblocks || v[3].shape[0] < nblocks || v[4].shape[0] < nblocks) {
        PyErr_Format(PyExc_ValueError,
                     "chain_starts: slots/subs differ in length from blocks (%zd), or the "
                     "outputs are shorter",
                     nblocks);
        goto done;
    }
    const int64_t *blocks = v[0].buf, *slots = v[1].buf, *subs = has_subs ? v[5].buf : NULL;
    int64_t *ro = v[2].buf, *po = v[3].buf, *w = v[4].buf;
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < nblocks; i++) {
        if (slots[i] < 0) {
            continue;
        }
        int64_t r = base + blocks[i] * stride;
        int64_t p = slot_base + slots[i] + (subs ? subs[i] * page : 0);
        /* plan_group's order is layer-major: block after block in a layer, and a page
         * contiguous on both sides with the run before it extends that run. */
        if (n > 0 && r == ro[n - 1] + w[n - 1] && p == po[n - 1] + w[n - 1]) {
            w[n - 1] += page;
            continue;
        }
        ro[n] = r;
        po[n] = p;
        w[n] = page;
        n++;
    }
    /* A layer's last run, then the next layer's first: plan_group merges those too. */
    if (n > 0 && ro[0] + region_pitch == ro[n - 1] + w[n - 1] &&
        po[0] + pool_pitch == po[n - 1] + w[n - 1]) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    int64_t r_lo = 0, r_end = 0, p_lo = 0, p_end = 0, widest = 0, layer = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i == 0 || ro[i] < r_lo) r_lo = ro[i];
        if (i == 0 || ro[i] + w[i] > r_end) r_end = ro[i] + w[i];
        if (i == 0 || po[i] < p_lo) p_lo = po[i];
        if (i == 0 || po[i] + w[i] > p_end) p_end = po[i] + w[i];
        if (w[i] > widest) widest = w[i];
        layer += w[i];
    }
    result = Py_BuildValue("nLLLLLL", n, (long long)r_lo, (long long)r_end, (long long)p_lo,
                           (long long)p_end, (long long)widest, (long long)layer);
done:
    release_all(v, n_views);
    return result;
}

static PyObject *chain_dma(PyObject *self, PyObject *args) {
    PyObject *objs[9];
    Py_ssize_t rows;
    long long region_pitch, pool_pitch, split;
    unsigned long long dev_base, pool;
    if (!PyArg_ParseTuple(args, "OOOOOOOOOnLLKKL:chain_dma", &objs[0], &objs[1], &objs[2],
                          &objs[3], &objs[4], &objs[5], &objs[6], &objs[7], &objs[8], &rows,
                          &region_pitch, &pool_pitch, &dev_base, &pool, &split)) {
        return NULL;
    }
    static const char *names[9] = {"region_starts", "pool_starts", "widths", "s_dev", "s_host",
                                   "s_width",       "d_dev",       "d_host", "d_size"};
    int counting = objs[6] == Py_None; /* descriptors counted, not written */
    int n_views = counting ? 6 : 9;
    Py_buffer v[9];
    for (int i = 0; i < n_views; i++) {
        if (get_column(objs[i], &v[i], names[i], 1, i >= 3) < 0) {
            release_all(v, i);
            return NULL;
        }
    }
    PyObject *result = NULL;
    Py_ssize_t count = v[0].shape[0];
    Py_ssize_t s_cap = v[3].shape[0];
    if (v[4].shape[0] < s_cap) s_cap = v[4].shape[0];
    if (v[5].shape[0] < s_cap) s_cap = v[5].shape[0];
    Py_ssize_t d_cap = counting ? PY_SSIZE_T_MAX : v[6].shape[0];
    if (!counting && v[7].shape[0] < d_cap) d_cap = v[7].shape[0];
    if (!counting && v[8].shape[0] < d_cap) d_cap = v[8].shape[0];
    if (v[1].shape[0] != count || v[2].shape[0] != count || rows < 1 || split < 0) {
        PyErr_SetString(PyExc_ValueError,
                        "chain_dma: starts and widths of different lengths, no rows or a "
                        "negative split");
        goto done;
    }
    const int64_t *rs = v[0].buf, *ps = v[1].buf, *ws = v[2].buf;
    uint64_t *s_dev = v[3].buf, *s_host = v[4].buf, *s_width = v[5].buf;
    uint64_t *d_dev = counting ? NULL : v[6].buf, *d_host = counting ? NULL : v[7].buf;
    uint64_t *d_size = counting ? NULL : v[8].buf;
    Py_ssize_t kept = 0, out = 0;
    for (Py_ssize_t k = 0; k < count; k++) {
        if (rs[k] < 0 || ps[k] < 0 || ws[k] <= 0) {
            PyErr_Format(PyExc_ValueError,
                         "chain_dma: chain %zd starts at a negative offset or is empty", k);
            goto done;
        }
        int64_t span = (int64_t)(rows - 1) * pool_pitch + ws[k] - 1;
        if (!split || ps[k] / split == (ps[k] + span) / split) {
            if (kept >= s_cap) {
                PyErr_SetString(PyExc_ValueError, "chain_dma: the 2-D copy columns are too small");
                goto done;
            }
            s_dev[kept] = dev_base + (uint64_t)rs[k];
            s_host[kept] = pool + (uint64_t)ps[k];
            s_width[kept] = (uint64_t)ws[k];
            kept++;
            continue;
        }
        for (Py_ssize_t r = 0; r < rows; r++) {
            int64_t po = ps[k] + (int64_t)r * pool_pitch, n = ws[k];
            uint64_t d = dev_base + (uint64_t)(rs[k] + (int64_t)r * region_pitch);
            uint64_t h = pool + (uint64_t)po;
            while (n > 0) {
                int64_t piece = po % split + n > split ? split - po % split : n;
                if (out >= d_cap) {
                    PyErr_SetString(PyExc_ValueError,
                                    "chain_dma: the descriptor columns are too small");
                    goto done;
                }
                if (!counting) {
                    d_dev[out] = d;
                    d_host[out] = h;
                    d_size[out] = (uint64_t)piece;
                }
                out++;
                d += (uint64_t)piece;
                h += (uint64_t)piece;
                po += piece;
                n -= piece;
            }
        }
    }
    result = Py_BuildValue("nn", kept, out);
done:
    release_all(v, n_views);
    return result;
}

static PyMethodDef methods[] = {
    {"plan_group", plan_group, METH_VARARGS,
     "plan_group(out, count, region, base, stride, page, slot_base, blocks, slots, subs) -> "
     "(count, bytes): appends one group's pages to a (4, capacity) int64 run table, merging "
     "runs contiguous on both sides (see the module's documentation)."},
    {"address_runs", address_runs, METH_VARARGS,
     "address_runs(runs, bases, pool_address, split, dev, host, size) -> entries: a (4, n) "
     "run table as address columns, runs cut at multiples of split in pool offsets."},
    {"stride_period", stride_period, METH_VARARGS,
     "stride_period(dev, host, size, count, min_rows, base, split) -> period: the smallest p "
     "such that the first count entries are p chains of count / p >= min_rows rows, each row "
     "p entries after the one before at the same (positive, at least the width) distances on "
     "both sides and of the same size, each chain's host bytes inside one split-sized piece "
     "of offsets from base (split 0: no such limit); 0 when there is none."},
    {"run_bounds", run_bounds, METH_VARARGS,
     "run_bounds(runs, sizes, pool_size) -> bool: every run of a (4, n) run table inside its "
     "region (sizes[region] bytes) and, with pool_size >= 0, inside the pool."},
    {"chain_starts", chain_starts, METH_VARARGS,
     "chain_starts(blocks, slots, subs, region_out, pool_out, width_out, base, stride, "
     "slot_base, page, region_pitch, pool_pitch) -> (chains, region_lo, region_end, pool_lo, "
     "pool_end, widest, layer_bytes) or None: a chained group's runs of layer 0, merged as "
     "plan_group merges them (see the module's documentation); None when plan_group would "
     "merge across layers."},
    {"chain_dma", chain_dma, METH_VARARGS,
     "chain_dma(region_starts, pool_starts, widths, s_dev, s_host, s_width, d_dev, d_host, "
     "d_size, rows, region_pitch, pool_pitch, dev_base, pool_address, split) -> (copies, "
     "descriptors): a plan of chains as 2-D copies and, for chains crossing a multiple of "
     "split, descriptors (d_dev None: only counted; see the module's documentation)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_plan",
    "The copy planner's per-page loops, holding the GIL (kvdepot.server.core.planner).",
    -1, methods,
};

PyMODINIT_FUNC PyInit__plan(void) { return PyModule_Create(&module); }
