/* The density model's numeric kernels, compiled: the same float operations as the reference
 * (backends/eviction/hit_density/kernels.py, which states the contracts), in the same order, so the
 * same bits. Built with -ffp-contract=off: no multiply-add is fused.
 *
 * Each kernel takes C-contiguous float64 buffers; on an input outside its contract (another type or
 * shape, or a value the contract excludes) it writes nothing and runs the reference. Results go to a
 * scratch array first and to `out` only when all are computed, so `out` may alias an input.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "_objects.h"
#include "_twin.h"
#include "_views.h"

#define REFERENCE "kvkit.backends.eviction.hit_density.kernels"

/* Hold obj's buffer in a as a C-contiguous float64 array of ndim dimensions (writable if asked):
 * 0, or -1 with no error set (a buffer of another kind, or none: the kernel declines, the reference runs). */
static int
hold(PyObject *obj, View *a, int ndim, int writable)
{
    return hold_array(obj, a, ndim, (Py_ssize_t)sizeof(double), "d", writable);
}

static double *
data(const View *a)
{
    return (double *)a->buf.buf;
}

/* A count the density kernel takes: finite, non-negative and not -0.0. */
static int
count_ok(double x)
{
    return x >= 0.0 && x <= DBL_MAX && !signbit(x);
}

/* One row of densities (kernels.densities) into dst, from the row's histograms u (reuses) and e
 * (events) of b buckets; work holds 5 * b + 2 doubles. 0, or -1 if the row is outside the contract. */
static int
densities_row(const double *u, const double *e, const double *widths, const double *fades, Py_ssize_t b,
              double *work, double *dst)
{
    double *risk = work, *hazard = risk + b, *space = hazard + b, *cum_hits = space + b,
           *cum_space = cum_hits + b + 1;
    for (Py_ssize_t j = 0; j < b; j++)
        if (!count_ok(u[j]) || !count_ok(e[j]) || u[j] > e[j])
            return -1;
    /* at risk: the events at a bucket or later, summed from the oldest bucket down (numpy's cumsum
     * of the reversed row) */
    risk[b - 1] = e[b - 1];
    for (Py_ssize_t j = b - 2; j >= 0; j--)
        risk[j] = risk[j + 1] + e[j];
    /* counts are non-negative: the seen ages (at risk > 0) are a leading run of s buckets */
    Py_ssize_t s = 0;
    while (s < b && risk[s] > 0.0)
        s++;
    if (s == 0) {  /* no evidence at all: zeros */
        for (Py_ssize_t j = 0; j < b; j++)
            dst[j] = 0.0;
        return 0;
    }
    /* survival is a running product from 1.0, hits and space its products; the sums run from the
     * first bucket on (numpy's cumsum after a leading 0.0). Past the s seen ages the reference's
     * buckets add nothing (or NaN, which no ratio takes): its maxima are those over the seen ages. */
    double survive = 1.0;
    cum_hits[0] = 0.0;
    cum_space[0] = 0.0;
    for (Py_ssize_t j = 0; j < s; j++) {
        if (j > 0)
            survive = survive * (1.0 - hazard[j - 1]);
        hazard[j] = u[j] / risk[j];
        double hits = survive * hazard[j];
        space[j] = survive * widths[j];
        cum_hits[j + 1] = j == 0 ? hits : cum_hits[j] + hits;
        cum_space[j + 1] = j == 0 ? space[j] : cum_space[j] + space[j];
    }
    /* the best ratio of hits to space over the buckets a..t, t >= a, where that space is positive
     * (else 0); all ratios are non-negative numbers, so the plain maximum is numpy's. No space at
     * age a itself (no block survives to it): 0. */
    for (Py_ssize_t a = 0; a < s; a++) {
        const double hits_a = cum_hits[a], space_a = cum_space[a];
        double best = 0.0;
        for (Py_ssize_t t = a; t < s; t++) {
            double den = cum_space[t + 1] - space_a;
            if (den > 0.0) {
                double ratio = (cum_hits[t + 1] - hits_a) / den;
                if (ratio > best)
                    best = ratio;
            }
        }
        dst[a] = space[a] <= 0.0 ? 0.0 : best;
    }
    /* past the oldest seen age: its density, faded per bucket past it */
    const double last = dst[s - 1];
    for (Py_ssize_t j = s; j < b; j++)
        dst[j] = last * fades[j - (s - 1)];
    return 0;
}

static PyObject *
densities(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("densities(reuses, events, widths, fades, out)", nargs, 5) < 0)
        return NULL;
    View reuses = {0}, events = {0}, widths = {0}, fades = {0}, out = {0};
    double *scratch = NULL;
    PyObject *result = Py_None;  /* None until computed: declined, the reference runs */
    if (hold(args[0], &reuses, 2, 0) < 0 || hold(args[1], &events, 2, 0) < 0 || hold(args[2], &widths, 1, 0) < 0
        || hold(args[3], &fades, 1, 0) < 0 || hold(args[4], &out, 2, 1) < 0)
        goto done;
    const Py_ssize_t rows = reuses.buf.shape[0], b = reuses.buf.shape[1];
    if (b < 1 || events.buf.shape[0] != rows || events.buf.shape[1] != b || out.buf.shape[0] != rows
        || out.buf.shape[1] != b || widths.buf.shape[0] != b || fades.buf.shape[0] != b)
        goto done;
    if ((size_t)rows > (SIZE_MAX / sizeof(double) - (size_t)(5 * b + 2)) / (size_t)b) {
        result = PyErr_NoMemory();
        goto done;
    }
    scratch = malloc(((size_t)rows * (size_t)b + (size_t)(5 * b + 2)) * sizeof(double));
    if (scratch == NULL) {
        result = PyErr_NoMemory();
        goto done;
    }
    double *work = scratch + rows * b;
    for (Py_ssize_t r = 0; r < rows; r++)
        if (densities_row(data(&reuses) + r * b, data(&events) + r * b, data(&widths), data(&fades), b, work,
                          scratch + r * b) < 0)
            goto done;
    memcpy(data(&out), scratch, (size_t)rows * (size_t)b * sizeof(double));
    result = args[4];
done:
    free(scratch);
    release(&reuses);
    release(&events);
    release(&widths);
    release(&fades);
    release(&out);
    if (result == Py_None)  /* declined: nothing written */
        return run_reference(REFERENCE, "densities", args, nargs);
    Py_XINCREF(result);
    return result;
}

/* A value or weight the fit takes: non-negative (not NaN) and not -0.0. */
static int
fit_ok(double x)
{
    return x >= 0.0 && !signbit(x);
}

/* The columns the fit takes at once: their n * n means stay in cache, and each step runs along them. */
#define COLUMNS 64

/* m columns of the fit (kernels.isotonic) of n rows, each row read and written `stride` doubles after the
 * one before; work holds (n * n + 3 * n + 4) * m doubles. Each column's values go through the steps of a
 * column on its own, in the same order (the loops over the columns are innermost). 0, or -1 if a
 * weighted mean is NaN. */
static int
isotonic_columns(const double *v, const double *w, Py_ssize_t n, Py_ssize_t stride, Py_ssize_t m, double *work,
                 double *dst)
{
    double *weights = work, *terms = weights + n * m, *lows = terms + n * m, *means = lows + n * m, /* [k][j][c] */
           *num = means + n * n * m, *den = num + m, *extra = den + m, *fit = extra + m;
    for (Py_ssize_t c = 0; c < m; c++)  /* numpy's sum down a column of a C-contiguous array: row after row */
        extra[c] = w[c];
    for (Py_ssize_t r = 1; r < n; r++)
        for (Py_ssize_t c = 0; c < m; c++)
            extra[c] = extra[c] + w[r * stride + c];
    for (Py_ssize_t c = 0; c < m; c++)
        extra[c] = 1e-9 * (extra[c] > 0.0 ? extra[c] : 1.0);
    for (Py_ssize_t r = 0; r < n; r++)
        for (Py_ssize_t c = 0; c < m; c++) {
            weights[r * m + c] = w[r * stride + c] + extra[c];
            terms[r * m + c] = v[r * stride + c] * weights[r * m + c];
        }
    /* means[k][j], j <= k: the sums of rows j..k, one row added at a time from row j */
    for (Py_ssize_t j = 0; j < n; j++) {
        double *mean = means + (j * n + j) * m;
        for (Py_ssize_t c = 0; c < m; c++) {
            num[c] = terms[j * m + c];
            den[c] = weights[j * m + c];
            mean[c] = num[c] / den[c];
        }
        for (Py_ssize_t k = j + 1; k < n; k++) {
            mean = means + (k * n + j) * m;
            for (Py_ssize_t c = 0; c < m; c++) {
                num[c] = num[c] + terms[k * m + c];
                den[c] = den[c] + weights[k * m + c];
                mean[c] = num[c] / den[c];
            }
        }
    }
    for (Py_ssize_t k = 0; k < n; k++)
        for (Py_ssize_t j = 0; j <= k; j++)
            for (Py_ssize_t c = 0; c < m; c++)
                if (isnan(means[(k * n + j) * m + c]))
                    return -1;
    /* no NaN and no -0.0: numpy's minimum and maximum are the plain ones */
    memcpy(lows, means + (n - 1) * n * m, (size_t)(n * m) * sizeof(double));
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        for (Py_ssize_t j = 0; j <= i; j++) {
            const double *mean = means + (i * n + j) * m;
            double *low = lows + j * m;
            for (Py_ssize_t c = 0; c < m; c++) {
                if (mean[c] < low[c])
                    low[c] = mean[c];
                if (j == 0 || low[c] > fit[c])
                    fit[c] = low[c];
            }
        }
        for (Py_ssize_t c = 0; c < m; c++)
            dst[i * stride + c] = fit[c];
    }
    return 0;
}

static PyObject *
isotonic(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("isotonic(values, weights, out)", nargs, 3) < 0)
        return NULL;
    View values = {0}, weights = {0}, out = {0};
    double *scratch = NULL;
    PyObject *result = Py_None;  /* None until computed: declined, the reference runs */
    if (hold(args[0], &values, 2, 0) < 0 || hold(args[1], &weights, 2, 0) < 0 || hold(args[2], &out, 2, 1) < 0)
        goto done;
    const Py_ssize_t n = values.buf.shape[0], columns = values.buf.shape[1];
    if (n < 1 || columns < 2 || weights.buf.shape[0] != n || weights.buf.shape[1] != columns
        || out.buf.shape[0] != n || out.buf.shape[1] != columns)
        goto done;
    const double *v = data(&values), *w = data(&weights);
    for (Py_ssize_t i = 0; i < n * columns; i++)
        if (!fit_ok(v[i]) || !fit_ok(w[i]))
            goto done;
    /* the fit (n * columns doubles) and one block's work ((n * n + 3 * n + 4) * COLUMNS) */
    const size_t limit = SIZE_MAX / sizeof(double) / 2;
    if ((size_t)n > limit / (size_t)columns || (size_t)n > limit / (size_t)(n + 4) / (COLUMNS * 2)) {
        result = PyErr_NoMemory();
        goto done;
    }
    scratch = malloc(((size_t)n * (size_t)columns + ((size_t)n * (size_t)(n + 3) + 4) * COLUMNS) * sizeof(double));
    if (scratch == NULL) {
        result = PyErr_NoMemory();
        goto done;
    }
    double *work = scratch + n * columns;
    for (Py_ssize_t c = 0; c < columns; c += COLUMNS) {
        const Py_ssize_t m = columns - c < COLUMNS ? columns - c : COLUMNS;
        if (isotonic_columns(v + c, w + c, n, columns, m, work, scratch + c) < 0)
            goto done;
    }
    memcpy(data(&out), scratch, (size_t)n * (size_t)columns * sizeof(double));
    result = args[2];
done:
    free(scratch);
    release(&values);
    release(&weights);
    release(&out);
    if (result == Py_None)  /* declined: nothing written */
        return run_reference(REFERENCE, "isotonic", args, nargs);
    Py_XINCREF(result);
    return result;
}

static PyMethodDef methods[] = {
    {"densities", (PyCFunction)(void (*)(void))densities, METH_FASTCALL,
     "densities(reuses, events, widths, fades, out): fill and return out with the densities (kernels.py)"},
    {"isotonic", (PyCFunction)(void (*)(void))isotonic, METH_FASTCALL,
     "isotonic(values, weights, out): fill and return out with the monotone fit (kernels.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_kernels", "The density model's numeric kernels, compiled (kernels.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__kernels(void)
{
    return PyModule_Create(&module_def);
}
