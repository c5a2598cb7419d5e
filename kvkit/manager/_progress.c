/* OffloadManager.advance's items, compiled: the manager's own Python loop (manager.py), item for item.
 *
 * manager.py holds the reference; the tests drive a manager of each on the same items and compare every
 * request's state. The twin takes an item only in the shape an engine's decode step sends: an exact
 * 4-tuple, a str id of a running request with one KV group, at most one new block id (an exact int, in
 * range, not the null block, not in the table), hashes as a list of exact ints, a count as an exact
 * int within the item's blocks. It checks the whole item before it changes anything; at the first item
 * of another shape (a bad one included) it stops and returns that item's index, and the Python loop
 * goes on from there, converting or raising as it does. The only Python it runs is the manager's
 * confirm (the store policy's hook), after an item has applied, as the reference runs it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_objects.h"

static PyObject *S_state, *S_table, *S_ids, *S_hashes, *S_tokens, *S_computed, *S_confirmed;

/* What an item asks, checked: the block to append (NULL: none), the hashes (NULL: none), the count (-1: none). */
typedef struct {
    PyObject *block;
    PyObject *hashes;
    long long count;
} Ask;

/* The exact int obj in *out; 0 (nothing raised) where it is no exact int of a long long. */
static int
exact_ll(PyObject *obj, long long *out)
{
    int overflow;
    if (!PyLong_CheckExact(obj))
        return 0;
    *out = PyLong_AsLongLongAndOverflow(obj, &overflow);
    return !overflow;
}

/* The single block id of `rows` ((id,) of one group, a list or tuple of a list or tuple), if it is one this
 * twin appends; NULL otherwise. */
static PyObject *
single_block(PyObject *rows, long long limit, long long null)
{
    long long b;
    if (!is_sequence(rows) || PySequence_Fast_GET_SIZE(rows) != 1)
        return NULL;
    PyObject *group = PySequence_Fast_GET_ITEM(rows, 0);
    if (!is_sequence(group) || PySequence_Fast_GET_SIZE(group) != 1)
        return NULL;
    PyObject *block = PySequence_Fast_GET_ITEM(group, 0);
    if (!exact_ll(block, &b) || b < 0 || b == null || (limit >= 0 && b >= limit))
        return NULL;
    return block;
}

/* Whether `hashes` is a list of exact ints. */
static int
int_list(PyObject *hashes)
{
    if (!PyList_CheckExact(hashes))
        return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(hashes); i++)
        if (!PyLong_CheckExact(PyList_GET_ITEM(hashes, i)))
            return 0;
    return 1;
}

/* Apply a checked item to request r (its table's one group `group`, its ids `ids`, its hashes `known`). */
static int
apply(PyObject *r, PyObject *group, PyObject *ids, PyObject *known, const Ask *ask, long long bs,
      PyObject *confirm)
{
    long long tokens, computed, confirmed;
    if (ask->block != NULL && (PyList_Append(group, ask->block) < 0 || PySet_Add(ids, ask->block) < 0))
        return -1;
    if (attr_ll(r, S_tokens, &tokens) < 0)
        return -1;
    if (ask->hashes != NULL && PyList_GET_SIZE(ask->hashes) > 0) {
        Py_ssize_t n = PyList_GET_SIZE(known);
        if (PyList_SetSlice(known, n, n, ask->hashes) < 0)
            return -1;
        long long full = (long long)PyList_GET_SIZE(known) * bs;
        if (full > tokens) {
            tokens = full;
            if (set_attr_ll(r, S_tokens, tokens) < 0)
                return -1;
        }
    }
    if (ask->count >= 0) {
        if (set_attr_ll(r, S_computed, ask->count) < 0)
            return -1;
        if (ask->count > tokens && set_attr_ll(r, S_tokens, ask->count) < 0)
            return -1;
    }
    if (attr_ll(r, S_computed, &computed) < 0 || attr_ll(r, S_confirmed, &confirmed) < 0)
        return -1;
    if (computed / bs > confirmed) {  /* else no block can be newly confirmed */
        PyObject *done = PyObject_CallOneArg(confirm, r);
        if (done == NULL)
            return -1;
        Py_DECREF(done);
    }
    return 0;
}

/* One item on request r: 1 applied, 0 not this twin's (nothing changed, nothing raised), -1 raised. */
static int
item_of(PyObject *r, PyObject *item, PyObject *running, long long bs, long long limit, long long null,
        PyObject *confirm)
{
    PyObject *new_ids = PyTuple_GET_ITEM(item, 1), *new_hashes = PyTuple_GET_ITEM(item, 2);
    PyObject *count = PyTuple_GET_ITEM(item, 3);
    PyObject *state = NULL, *table = NULL, *ids = NULL, *known = NULL;
    Ask ask = {NULL, NULL, -1};
    long long computed;
    int out = -1;
    if ((state = PyObject_GetAttr(r, S_state)) == NULL || (table = PyObject_GetAttr(r, S_table)) == NULL
            || (ids = PyObject_GetAttr(r, S_ids)) == NULL || (known = PyObject_GetAttr(r, S_hashes)) == NULL)
        goto done;
    out = 0;
    if (state != running || !PyList_CheckExact(table) || PyList_GET_SIZE(table) != 1 || !PySet_CheckExact(ids)
            || !PyList_CheckExact(known))
        goto done;
    PyObject *group = PyList_GET_ITEM(table, 0);
    if (!PyList_CheckExact(group))
        goto done;
    if (new_ids != Py_None) {
        if ((ask.block = single_block(new_ids, limit, null)) == NULL)
            goto done;
        int taken = PySet_Contains(ids, ask.block);
        if (taken != 0) {
            out = taken < 0 ? -1 : 0;
            goto done;
        }
    }
    if (new_hashes != Py_None) {
        if (!int_list(new_hashes))
            goto done;
        ask.hashes = new_hashes;
    }
    if (count != Py_None) {
        long long capacity = (long long)PyList_GET_SIZE(group) + (ask.block != NULL);
        if (!exact_ll(count, &ask.count) || ask.count < 0)
            goto done;
        if (attr_ll(r, S_computed, &computed) < 0) {
            out = -1;
            goto done;
        }
        if (ask.count < computed || ask.count > capacity * bs)
            goto done;
    }
    out = apply(r, group, ids, known, &ask, bs, confirm) < 0 ? -1 : 1;
done:
    Py_XDECREF(state);
    Py_XDECREF(table);
    Py_XDECREF(ids);
    Py_XDECREF(known);
    return out;
}

/* advance(items, requests, running, block_size, limit, null_block, confirm) -> the index of the first item
 * not applied (len(items) when all were). */
static PyObject *
advance(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    long long bs, limit = -1, null;
    if (check_args("advance(items, requests, running, block_size, limit, null_block, confirm)", nargs, 7) < 0)
        return NULL;
    PyObject *items = args[0], *requests = args[1], *running = args[2], *confirm = args[6];
    Py_ssize_t i = 0;
    if (!PyList_CheckExact(items) || !PyDict_CheckExact(requests) || !exact_ll(args[3], &bs) || bs <= 0
            || !exact_ll(args[5], &null) || (args[4] != Py_None && !exact_ll(args[4], &limit)))
        return PyLong_FromSsize_t(0);
    for (; i < PyList_GET_SIZE(items); i++) {  /* confirm runs Python: the list is read afresh each item */
        PyObject *item = PyList_GET_ITEM(items, i);
        if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 4
                || !PyUnicode_CheckExact(PyTuple_GET_ITEM(item, 0)))
            break;
        Py_INCREF(item);
        PyObject *r = PyDict_GetItemWithError(requests, PyTuple_GET_ITEM(item, 0));
        int rc = 0;
        if (r != NULL) {
            Py_INCREF(r);
            rc = item_of(r, item, running, bs, limit, null, confirm);
            Py_DECREF(r);
        } else if (PyErr_Occurred()) {
            rc = -1;
        }
        Py_DECREF(item);
        if (rc < 0)
            return NULL;
        if (rc == 0)
            break;
    }
    return PyLong_FromSsize_t(i);
}

static PyMethodDef methods[] = {
    {"advance", (PyCFunction)(void (*)(void))advance, METH_FASTCALL,
     "advance(items, requests, running, block_size, limit, null_block, confirm) -> int: "
     "OffloadManager._advance's items of a decode step, compiled (manager.py holds the reference)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_progress", "OffloadManager.advance's items, compiled (see manager.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__progress(void)
{
    if ((S_state = PyUnicode_InternFromString("state")) == NULL
            || (S_table = PyUnicode_InternFromString("block_table")) == NULL
            || (S_ids = PyUnicode_InternFromString("block_ids")) == NULL
            || (S_hashes = PyUnicode_InternFromString("block_hashes")) == NULL
            || (S_tokens = PyUnicode_InternFromString("num_tokens")) == NULL
            || (S_computed = PyUnicode_InternFromString("num_computed_tokens")) == NULL
            || (S_confirmed = PyUnicode_InternFromString("num_confirmed_blocks")) == NULL)
        return NULL;
    return PyModule_Create(&module);
}
