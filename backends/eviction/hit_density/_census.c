/* The hit-density policy's census, compiled: the same histogram as the reference
 * (backends/eviction/hit_density/census.py, which states the contract), the same float additions in
 * the same order, so the same bits. Built with -ffp-contract=off.
 *
 * On anything outside the contract (another kind of buffer or argument, a class the model has not, a
 * last access past the clock, a live index beyond the class or last-access buffers) it writes nothing
 * and runs the reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "_objects.h"
#include "_twin.h"
#include "_views.h"

#define REFERENCE "kvkit.backends.eviction.hit_density.census"

/* One census group: its live bytes, classes and last accesses. */
typedef struct {
    const uint8_t *live, *classes;
    const int64_t *lasts;
    Py_ssize_t entries, known;  /* live bytes; entries with a class and a last access */
} Group;

/* census.strided's sample of a group: every `stride`-th live entry from the `offset`-th, each of `weight`.
 * -1 if a limit below 1 (the reference divides by it). */
static int
sample(const Group *g, long long turn, long long limit, Py_ssize_t *offset, Py_ssize_t *stride, double *weight)
{
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < g->entries; i++)
        n += g->live[i] != 0;
    *offset = 0, *stride = 1, *weight = 1.0;
    if (n == 0)
        return 0;
    if (limit < 1)
        return -1;
    /* math.ceil(n / limit): Python's true division of ints this size is the double division */
    *stride = (Py_ssize_t)ceil((double)n / (double)limit);
    *offset = (Py_ssize_t)(turn % *stride);  /* turn and stride positive: Python's modulo */
    Py_ssize_t picked = (n - *offset + *stride - 1) / *stride;
    *weight = (double)n / (double)picked;
    return 0;
}

/* The bucket of `age` (>= 0): the last b with first_ages[b] <= age, found from b = per_octave *
 * floor(log2(age + 1)), which is at most it (HitDensityModel.bucket: floor(per_octave * log2(age + 1)),
 * capped at the last bucket). */
static Py_ssize_t
bucket(int64_t age, const int64_t *first_ages, Py_ssize_t buckets, Py_ssize_t per_octave)
{
    uint64_t x = (uint64_t)age + 1;
    Py_ssize_t b = per_octave * (Py_ssize_t)(63 - __builtin_clzll(x));
    if (b >= buckets)
        return buckets - 1;
    while (b + 1 < buckets && first_ages[b + 1] <= age)
        b++;
    return b;
}

/* Add the sampled entries of g to hist, in index order. -1 if one is outside the contract. */
static int
add_group(const Group *g, Py_ssize_t offset, Py_ssize_t stride, double weight, long long clock, double *hist,
          Py_ssize_t classes, const int64_t *first_ages, Py_ssize_t buckets, Py_ssize_t per_octave)
{
    Py_ssize_t k = 0;  /* live entries passed */
    for (Py_ssize_t i = 0; i < g->entries; i++) {
        if (!g->live[i])
            continue;
        if (k++ % stride != offset)
            continue;
        if (i >= g->known)
            return -1;
        Py_ssize_t cls = g->classes[i];
        int64_t last = g->lasts[i];
        if (cls >= classes || last > clock || (last < 0 && clock > INT64_MAX + last))
            return -1;
        hist[cls * buckets + bucket(clock - last, first_ages, buckets, per_octave)] += weight;
    }
    return 0;
}

/* An int of the long long range: 0, or -1 with no error set (the read declines). */
static int
as_long_long(PyObject *obj, long long *value)
{
    if (!PyLong_Check(obj))
        return -1;
    int overflow;
    *value = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || (*value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return -1;
    }
    return 0;
}

static PyObject *
census_read(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("read(where, classes, lasts, ghost_live, ghost_classes, ghost_lasts, clock, turn, limit, model, "
                   "out)", nargs, 11) < 0)
        return NULL;
    View arrays[6], out = {0};
    memset(arrays, 0, sizeof arrays);
    int64_t *first_ages = NULL;
    double *hist = NULL;
    PyObject *ages = NULL, *per_octave_obj = NULL, *classes_obj = NULL,
             *result = Py_None;  /* None until computed: declined, the reference runs */
    long long clock, turn, limit, per_octave, model_classes;
    for (int a = 0; a < 6; a++)
        if (a % 3 == 2 ? hold_array(args[a], &arrays[a], 1, 8, "ql", 0) < 0 : hold_array(args[a], &arrays[a], 1, 1, "B", 0) < 0)
            goto done;
    if (as_long_long(args[6], &clock) < 0 || as_long_long(args[7], &turn) < 0 || as_long_long(args[8], &limit) < 0
        || turn < 0 || hold_array(args[10], &out, 2, 8, "d", 1) < 0)
        goto done;
    const Py_ssize_t classes = out.buf.shape[0], buckets = out.buf.shape[1];
    /* the model's buckets: its first ages, one per column of out, and its buckets per octave */
    ages = PyObject_GetAttrString(args[9], "first_ages");
    per_octave_obj = ages == NULL ? NULL : PyObject_GetAttrString(args[9], "per_octave");
    classes_obj = per_octave_obj == NULL ? NULL : PyObject_GetAttrString(args[9], "classes");
    if (classes_obj == NULL) {
        PyErr_Clear();
        goto done;
    }
    if (!PyTuple_Check(ages) || PyTuple_GET_SIZE(ages) != buckets || buckets < 1
        || as_long_long(classes_obj, &model_classes) < 0 || model_classes != classes || classes < 1
        || as_long_long(per_octave_obj, &per_octave) < 0 || per_octave < 1 || per_octave > buckets)
        goto done;
    first_ages = malloc((size_t)buckets * sizeof(int64_t));
    hist = calloc((size_t)classes * (size_t)buckets, sizeof(double));
    if (first_ages == NULL || hist == NULL) {
        result = PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t b = 0; b < buckets; b++) {
        long long age;
        if (as_long_long(PyTuple_GET_ITEM(ages, b), &age) < 0)
            goto done;
        first_ages[b] = age;
    }
    for (int g = 0; g < 2; g++) {
        const View *live = &arrays[3 * g], *cls = &arrays[3 * g + 1], *lasts = &arrays[3 * g + 2];
        Py_ssize_t known = items(cls) < items(lasts) ? items(cls) : items(lasts);
        Group group = {live->buf.buf, cls->buf.buf, lasts->buf.buf, items(live), known};
        Py_ssize_t offset, stride;
        double weight;
        if (sample(&group, turn, limit, &offset, &stride, &weight) < 0
            || add_group(&group, offset, stride, weight, clock, hist, classes, first_ages, buckets,
                         (Py_ssize_t)per_octave) < 0)
            goto done;
    }
    memcpy(out.buf.buf, hist, (size_t)classes * (size_t)buckets * sizeof(double));
    result = args[10];
done:
    free(first_ages);
    free(hist);
    Py_XDECREF(ages);
    Py_XDECREF(per_octave_obj);
    Py_XDECREF(classes_obj);
    for (int a = 0; a < 6; a++)
        release(&arrays[a]);
    release(&out);
    if (result == Py_None)  /* declined: nothing written */
        return run_reference(REFERENCE, "read", args, nargs);
    Py_XINCREF(result);
    return result;
}

static PyMethodDef methods[] = {
    {"read", (PyCFunction)(void (*)(void))census_read, METH_FASTCALL,
     "read(where, classes, lasts, ghost_live, ghost_classes, ghost_lasts, clock, turn, limit, model, out): "
     "fill and return out with the census's histogram (census.py)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_census", "The hit-density policy's census, compiled (census.py).", -1, methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__census(void)
{
    return PyModule_Create(&module_def);
}
