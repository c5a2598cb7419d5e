/* The block pool's per-block loops, compiled: BlockPool's own loops (pool.py), step for step.
 *
 * pool.py holds the reference (each method's Python loop) and loops.py the contracts; the tests run
 * a pool of each on the same calls and compare the whole state. The pool's state stays Python
 * objects: refcounts are a list of ints, hashes a list of ints and None, the prefix index a dict
 * from hash to block. A loop that meets anything unusual (an id or hash that is not a plain int,
 * an id out of range, a refcount that would fail) leaves the state as it found it and returns its
 * sentinel: the caller's Python loop then runs, converting what it can and raising as it does.
 * No Python code runs inside a loop (ids and hashes are exact ints), so nothing else sees a
 * half-done state.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "_objects.h"

/* A list or tuple's items and count; 0 for anything else (nothing raised). */
static int
items_of(PyObject *seq, PyObject ***items, Py_ssize_t *count)
{
    if (!is_sequence(seq))
        return 0;
    *items = PySequence_Fast_ITEMS(seq);
    *count = PySequence_Fast_GET_SIZE(seq);
    return 1;
}

/* The pool's refcount and hash lists, of one size; 0 when they are not (nothing raised). */
static int
state_of(PyObject *ref, PyObject *hashes, Py_ssize_t *n)
{
    if (!PyList_CheckExact(ref) || (hashes != NULL && !PyList_CheckExact(hashes)))
        return 0;
    *n = PyList_GET_SIZE(ref);
    return hashes == NULL || PyList_GET_SIZE(hashes) == *n;
}

/* obj as a block id in [0, n), or -1 when it is no exact int in that range (nothing raised). */
static Py_ssize_t
block_id(PyObject *obj, Py_ssize_t n)
{
    if (!PyLong_CheckExact(obj))
        return -1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (overflow || v < 0 || v >= (long long)n)
        return -1;
    return (Py_ssize_t)v;
}

/* ref[b] as a count >= 0, or -1 when it is no exact int of that kind (nothing raised). */
static Py_ssize_t
count_at(PyObject *ref, Py_ssize_t b)
{
    PyObject *r = PyList_GET_ITEM(ref, b);
    if (!PyLong_CheckExact(r))
        return -1;
    int overflow;
    long long v = PyLong_AsLongLongAndOverflow(r, &overflow);
    if (overflow || v < 0 || v > PY_SSIZE_T_MAX - 1)
        return -1;
    return (Py_ssize_t)v;
}

/* A tuple of the n new references given, stolen (released too when the tuple cannot be made). */
static PyObject *
steal_tuple(Py_ssize_t n, PyObject **items)
{
    PyObject *t = PyTuple_New(n);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (t == NULL)
            Py_DECREF(items[i]);
        else
            PyTuple_SET_ITEM(t, i, items[i]);
    }
    return t;
}

static int
set_count(PyObject *ref, Py_ssize_t b, Py_ssize_t count)
{
    PyObject *v = PyLong_FromSsize_t(count);
    if (v == NULL)
        return -1;
    PyObject *old = PyList_GET_ITEM(ref, b);
    PyList_SET_ITEM(ref, b, v);
    Py_DECREF(old);
    return 0;
}

/* Undo the count changes of the first done ids (each by step), as the Python loop's roll-back does. */
static int
roll_back(PyObject *ref, PyObject **blocks, Py_ssize_t done, Py_ssize_t step)
{
    Py_ssize_t n = PyList_GET_SIZE(ref);
    for (Py_ssize_t i = 0; i < done; i++) {
        Py_ssize_t b = block_id(blocks[i], n);
        if (set_count(ref, b, count_at(ref, b) - step) < 0)
            return -1;
    }
    return 0;
}

/* incref's loop: the blocks that were evictable (refcount 0, ready), in order; None to take the Python path. */
static PyObject *
incref(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("incref(ref, hashes, blocks)", nargs, 3) < 0)
        return NULL;
    PyObject *ref = args[0], *hashes = args[1], **blocks;
    Py_ssize_t n, count, done = 0;
    if (!state_of(ref, hashes, &n) || !items_of(args[2], &blocks, &count))
        Py_RETURN_NONE;
    PyObject *pinned = PyList_New(0);
    if (pinned == NULL)
        return NULL;
    for (; done < count; done++) {
        Py_ssize_t b = block_id(blocks[done], n), r = b < 0 ? -1 : count_at(ref, b);
        if (r < 0 || (r == 0 && PyList_GET_ITEM(hashes, b) == Py_None))
            break; /* to convert, to refuse, or an empty block: the Python raises */
        if (r == 0 && PyList_Append(pinned, blocks[done]) < 0)
            goto fail;
        if (set_count(ref, b, r + 1) < 0)
            goto fail;
    }
    if (done == count)
        return pinned;
    Py_DECREF(pinned);
    if (roll_back(ref, blocks, done, 1) < 0)
        return NULL;
    Py_RETURN_NONE;
fail:
    Py_DECREF(pinned);
    roll_back(ref, blocks, done, 1);
    return NULL;
}

/* decref's loop: (freed, unpinned), the blocks whose last reference went, not ready and ready, in
 * order; None to take the Python path. */
static PyObject *
decref(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("decref(ref, hashes, blocks)", nargs, 3) < 0)
        return NULL;
    PyObject *ref = args[0], *hashes = args[1], **blocks;
    Py_ssize_t n, count, done = 0;
    if (!state_of(ref, hashes, &n) || !items_of(args[2], &blocks, &count))
        Py_RETURN_NONE;
    PyObject *freed = PyList_New(0), *unpinned = PyList_New(0);
    if (freed == NULL || unpinned == NULL)
        goto fail;
    for (; done < count; done++) {
        Py_ssize_t b = block_id(blocks[done], n), r = b < 0 ? -1 : count_at(ref, b);
        if (r <= 0)
            break; /* to convert, to refuse, or below 0: the Python raises */
        if (r == 1
            && PyList_Append(PyList_GET_ITEM(hashes, b) == Py_None ? freed : unpinned, blocks[done]) < 0)
            goto fail;
        if (set_count(ref, b, r - 1) < 0)
            goto fail;
    }
    if (done == count)
        return steal_tuple(2, (PyObject *[]){freed, unpinned});
    Py_DECREF(freed);
    Py_DECREF(unpinned);
    if (roll_back(ref, blocks, done, -1) < 0)
        return NULL;
    Py_RETURN_NONE;
fail:
    Py_XDECREF(freed);
    Py_XDECREF(unpinned);
    roll_back(ref, blocks, done, -1);
    return NULL;
}

/* Whether every item is an exact int or None. */
static int
parents_plain(PyObject **parents, Py_ssize_t count)
{
    for (Py_ssize_t i = 0; i < count; i++)
        if (parents[i] != Py_None && !PyLong_CheckExact(parents[i]))
            return 0;
    return 1;
}

/* commit's loops for a batched policy: (result, added blocks, added hashes, added parents); None to
 * take the Python path (something to convert or refuse, a block named twice). */
static PyObject *
commit(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("commit(ref, hashes, index, blocks, block_hashes, parents)", nargs, 6) < 0)
        return NULL;
    PyObject *ref = args[0], *block_hash = args[1], *index = args[2];
    PyObject **blocks, **hashes, **parents = NULL;
    Py_ssize_t n, count, hash_count, parent_count;
    if (!state_of(ref, block_hash, &n) || !PyDict_CheckExact(index) || !items_of(args[3], &blocks, &count)
        || !items_of(args[4], &hashes, &hash_count) || hash_count != count)
        Py_RETURN_NONE;
    if (args[5] != Py_None
        && (!items_of(args[5], &parents, &parent_count) || parent_count != count || !parents_plain(parents, count)))
        Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t b = block_id(blocks[i], n);
        if (b < 0 || !PyLong_CheckExact(hashes[i]) || count_at(ref, b) <= 0
            || PyList_GET_ITEM(block_hash, b) != Py_None)
            Py_RETURN_NONE;
    }
    if (count > 1) {
        PyObject *distinct = PySet_New(args[3]);
        if (distinct == NULL)
            return NULL;
        Py_ssize_t size = PySet_GET_SIZE(distinct);
        Py_DECREF(distinct);
        if (size != count)
            Py_RETURN_NONE;
    }
    PyObject *result = PyList_New(count), *added_blocks = PyList_New(0), *added_hashes = PyList_New(0);
    PyObject *added_parents = PyList_New(0);
    if (result == NULL || added_blocks == NULL || added_hashes == NULL || added_parents == NULL)
        goto fail;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *b = blocks[i], *h = hashes[i], *p = parents == NULL ? Py_None : parents[i];
        PyObject *held = PyDict_SetDefault(index, h, b); /* borrowed */
        if (held == NULL)
            goto fail;
        int won = held == b ? 1 : PyObject_RichCompareBool(held, b, Py_EQ);
        if (won < 0)
            goto fail;
        if (won) {
            /* The block is not ready, so it can only already sit under h if it was just put there. */
            Py_ssize_t id = PyLong_AsSsize_t(b);
            PyObject *old = PyList_GET_ITEM(block_hash, id);
            Py_INCREF(h);
            PyList_SET_ITEM(block_hash, id, h);
            Py_DECREF(old);
            if (PyList_Append(added_blocks, b) < 0 || PyList_Append(added_hashes, h) < 0
                || PyList_Append(added_parents, p) < 0)
                goto fail;
        }
        PyObject *flag = won ? Py_True : Py_False; /* a loser stays not ready: the first block keeps the hash */
        Py_INCREF(flag);
        PyList_SET_ITEM(result, i, flag);
    }
    return steal_tuple(4, (PyObject *[]){result, added_blocks, added_hashes, added_parents});
fail:
    Py_XDECREF(result);
    Py_XDECREF(added_blocks);
    Py_XDECREF(added_hashes);
    Py_XDECREF(added_parents);
    return NULL;
}

/* allocate's loop: every block's refcount becomes 1; False to take the Python path (an id that is no
 * plain int in range; the Python loop writes them all again). */
static PyObject *
hand_out(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("hand_out(ref, blocks)", nargs, 2) < 0)
        return NULL;
    PyObject *ref = args[0], **blocks, *one = NULL;
    Py_ssize_t n, count;
    if (!state_of(ref, NULL, &n) || !items_of(args[1], &blocks, &count))
        Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t b = block_id(blocks[i], n);
        if (b < 0) {
            Py_XDECREF(one);
            Py_RETURN_FALSE;
        }
        if (one == NULL && (one = PyLong_FromLong(1)) == NULL)
            return NULL;
        PyObject *old = PyList_GET_ITEM(ref, b);
        Py_INCREF(one);
        PyList_SET_ITEM(ref, b, one);
        Py_DECREF(old);
    }
    Py_XDECREF(one);
    Py_RETURN_TRUE;
}

/* _evict's loop for a batched policy: each victim loses its hash, then its index entry (KeyError, as
 * the Python's, where the index lacks it); False to take the Python path (an id that is no plain int
 * in range, before anything changed). */
static PyObject *
drop(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("drop(hashes, index, victims, gone)", nargs, 4) < 0)
        return NULL;
    PyObject *block_hash = args[0], *index = args[1], **victims, **gone;
    Py_ssize_t n, count, gone_count;
    if (!state_of(block_hash, NULL, &n) || !PyDict_CheckExact(index) || !items_of(args[2], &victims, &count)
        || !items_of(args[3], &gone, &gone_count) || gone_count != count)
        Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < count; i++)
        if (block_id(victims[i], n) < 0 || !PyLong_CheckExact(gone[i]))
            Py_RETURN_FALSE;
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_ssize_t b = block_id(victims[i], n);
        PyObject *old = PyList_GET_ITEM(block_hash, b);
        Py_INCREF(Py_None);
        PyList_SET_ITEM(block_hash, b, Py_None);
        Py_DECREF(old);
        if (PyDict_DelItem(index, gone[i]) < 0)
            return NULL;
    }
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"incref", (PyCFunction)(void (*)(void))incref, METH_FASTCALL,
     "incref(ref, hashes, blocks) -> list | None: BlockPool.incref's loop, compiled (loops.py)."},
    {"decref", (PyCFunction)(void (*)(void))decref, METH_FASTCALL,
     "decref(ref, hashes, blocks) -> (freed, unpinned) | None: BlockPool.decref's loop, compiled (loops.py)."},
    {"commit", (PyCFunction)(void (*)(void))commit, METH_FASTCALL,
     "commit(ref, hashes, index, blocks, block_hashes, parents) -> (result, blocks, hashes, parents) | None: "
     "BlockPool.commit's loops for a batched policy, compiled (loops.py)."},
    {"hand_out", (PyCFunction)(void (*)(void))hand_out, METH_FASTCALL,
     "hand_out(ref, blocks) -> bool: BlockPool.allocate's loop, compiled (loops.py)."},
    {"drop", (PyCFunction)(void (*)(void))drop, METH_FASTCALL,
     "drop(hashes, index, victims, gone) -> bool: BlockPool._evict's loop for a batched policy, compiled "
     "(loops.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_pool_loops", "The block pool's per-block loops, compiled (see loops.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__pool_loops(void)
{
    return PyModule_Create(&module);
}
