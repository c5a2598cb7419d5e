/* GhostMap: the ghost's map from keys to eviction numbers, an open-addressing table of ints.
 *
 * A key is an int of 64 bits other than -1: the ghost keys a block hash by Python's hash of it, which is
 * never -1. Values are ints of 64 bits. Layout: a power-of-two array of 16-byte slots (key, value),
 * probed linearly from a slot picked by the key's top bits after a Fibonacci multiply; no Python object
 * is held or read, so a lookup reads one run of adjacent slots and nothing else. The ghost's churn (a
 * key in and a key out per eviction) leaves no tombstones: a removal shifts back the entries after it
 * that would otherwise be cut off from their home slot, so an absent key's probe ends at the first empty
 * slot. The table doubles when more than half of it would be in use and shrinks to a quarter in use when
 * less than an eighth is, so it never holds more than four slots per entry at its peak.
 *
 * Invariants: every entry lies on the run of occupied slots that starts at its home slot; no two
 * entries hold equal keys; used <= slots / 2; a slot is empty exactly when its key is EMPTY_KEY (-1).
 */
#ifndef KVKIT_GHOST_MAP_H
#define KVKIT_GHOST_MAP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define EMPTY_KEY ((int64_t)-1)
#define MIN_SLOTS 8

typedef struct {
    int64_t key;
    int64_t value;
} GhostSlot;

typedef struct {
    PyObject_HEAD
    GhostSlot *slots; /* NULL while empty and never grown */
    size_t mask;      /* slots - 1 */
    int shift;        /* 64 - log2(slots) */
    Py_ssize_t used;
} GhostMap;

static PyTypeObject GhostMapType;

static inline size_t
gm_home(const GhostMap *m, int64_t key)
{
    return (size_t)(((uint64_t)key * 0x9E3779B97F4A7C15ull) >> m->shift);
}

/* An empty array of `slots` slots (a power of two >= MIN_SLOTS) in m, the entries of the old one moved in. */
static int
gm_resize(GhostMap *m, size_t slots)
{
    GhostSlot *fresh = PyMem_New(GhostSlot, slots);
    if (fresh == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < slots; i++)
        fresh[i].key = EMPTY_KEY;
    GhostSlot *old = m->slots;
    size_t old_slots = old ? m->mask + 1 : 0;
    int bits = 0;
    while (((size_t)1 << bits) < slots)
        bits++;
    m->slots = fresh;
    m->mask = slots - 1;
    m->shift = 64 - bits;
    for (size_t j = 0; j < old_slots; j++) {
        if (old[j].key == EMPTY_KEY)
            continue;
        size_t i = gm_home(m, old[j].key);
        while (fresh[i].key != EMPTY_KEY)
            i = (i + 1) & m->mask;
        fresh[i] = old[j];
    }
    PyMem_Free(old);
    return 0;
}

/* The slot holding `key`, or -1. */
static inline Py_ssize_t
gm_find(const GhostMap *m, int64_t key)
{
    if (m->slots == NULL)
        return -1;
    for (size_t i = gm_home(m, key);; i = (i + 1) & m->mask) {
        int64_t k = m->slots[i].key;
        if (k == key)
            return (Py_ssize_t)i;
        if (k == EMPTY_KEY)
            return -1;
    }
}

/* Empty slot i (occupied), shifting back the entries after it; shrink a table mostly empty. */
static void
gm_remove_at(GhostMap *m, size_t i)
{
    for (size_t j = (i + 1) & m->mask; m->slots[j].key != EMPTY_KEY; j = (j + 1) & m->mask) {
        size_t home = gm_home(m, m->slots[j].key);
        if (((j - home) & m->mask) >= ((j - i) & m->mask)) { /* slot i lies on j's run from its home */
            m->slots[i] = m->slots[j];
            i = j;
        }
    }
    m->slots[i].key = EMPTY_KEY;
    m->used--;
    if (m->mask + 1 > MIN_SLOTS && (size_t)m->used * 8 < m->mask + 1) {
        size_t slots = MIN_SLOTS;
        while (slots < (size_t)m->used * 4)
            slots *= 2;
        if (gm_resize(m, slots) < 0) /* keeps the larger table: still a valid one */
            PyErr_Clear();
    }
}

/* Start loading the slot where a lookup of `key` begins: a loop over many keys asks for the key a few
 * places ahead, so that its lookup finds the slot in cache (a table larger than the caches costs a memory
 * round trip per key otherwise). A hint: it changes nothing. */
static inline void
gm_prefetch(const GhostMap *m, int64_t key)
{
    if (m->slots != NULL)
        __builtin_prefetch(&m->slots[gm_home(m, key)]);
}

/* m[key] = value (key != EMPTY_KEY); *old: the value it replaces, if any. 1 if it replaced one, 0 if the key
 * is new, -1 with an error (no memory to grow: nothing changed). */
static int
gm_put(GhostMap *m, int64_t key, int64_t value, int64_t *old)
{
    Py_ssize_t at = gm_find(m, key);
    if (at >= 0) {
        *old = m->slots[at].value;
        m->slots[at].value = value;
        return 1;
    }
    if (m->slots == NULL || (size_t)(m->used + 1) * 2 > m->mask + 1) { /* doubled: a quarter in use */
        if (gm_resize(m, m->slots == NULL ? MIN_SLOTS : (m->mask + 1) * 2) < 0)
            return -1;
    }
    size_t i = gm_home(m, key);
    while (m->slots[i].key != EMPTY_KEY)
        i = (i + 1) & m->mask;
    m->slots[i].key = key;
    m->slots[i].value = value;
    m->used++;
    return 0;
}

/* m.pop(key) into *value: 1 if it was there, 0 if not. */
static inline int
gm_pop(GhostMap *m, int64_t key, int64_t *value)
{
    Py_ssize_t at = gm_find(m, key);
    if (at < 0)
        return 0;
    *value = m->slots[at].value;
    gm_remove_at(m, (size_t)at);
    return 1;
}

/* A block hash's key: Python's hash of it (never -1); -1 with an error (unhashable). */
static inline int64_t
gm_key_of_hash(PyObject *block_hash)
{
    return (int64_t)PyObject_Hash(block_hash);
}

/* A loop over many block hashes looks each one's key up ahead of its turn, in two stages: AHEAD places
 * ahead it computes the key, if the hash is an int (whose hash runs no code and never fails), and
 * prefetches the key's slot; twice as far ahead it prefetches the hash object itself, which the key's
 * computation reads (a block's hash object, made when the block was stored, is rarely still in cache).
 * gm_ahead_key(r, k) is the k-th hash's key from the ring, or -1 (not an int: the lookup computes it at
 * its turn). Hints only: they change nothing. */
enum { AHEAD = 8 };
typedef struct {
    int64_t key[AHEAD];
    Py_ssize_t index[AHEAD];
    PyObject *hashes; /* a list or tuple (PySequence_Fast), borrowed; read afresh at each step */
    Py_ssize_t n;
} GhostAhead;

/* The k-th hash, or NULL past the loop's end or the sequence's. */
static inline PyObject *
gm_ahead_hash(const GhostAhead *r, Py_ssize_t k)
{
    return k < r->n && k < PySequence_Fast_GET_SIZE(r->hashes) ? PySequence_Fast_GET_ITEM(r->hashes, k) : NULL;
}

static inline void
gm_ahead_compute(GhostAhead *r, const GhostMap *m, Py_ssize_t k)
{
    PyObject *block_hash = gm_ahead_hash(r, k);
    if (block_hash == NULL || !PyLong_CheckExact(block_hash))
        return;
    int64_t key = gm_key_of_hash(block_hash);
    r->key[k % AHEAD] = key;
    r->index[k % AHEAD] = k;
    gm_prefetch(m, key);
}

/* Start looking ahead over the hashes start..n-1 of `hashes` (a list or tuple, borrowed). */
static inline void
gm_ahead_start(GhostAhead *r, const GhostMap *m, PyObject *hashes, Py_ssize_t n, Py_ssize_t start)
{
    r->hashes = hashes;
    r->n = n;
    for (int k = 0; k < AHEAD; k++)
        r->index[k] = -1;
    for (Py_ssize_t k = start; k < start + 2 * AHEAD; k++) {
        PyObject *block_hash = gm_ahead_hash(r, k);
        if (block_hash != NULL)
            __builtin_prefetch(block_hash);
    }
    for (Py_ssize_t k = start; k < start + AHEAD; k++)
        gm_ahead_compute(r, m, k);
}

/* The k-th hash's turn: look further ahead; return its key, -1 with an error (unhashable). */
static inline int64_t
gm_ahead_step(GhostAhead *r, const GhostMap *m, Py_ssize_t k)
{
    PyObject *far = gm_ahead_hash(r, k + 2 * AHEAD);
    if (far != NULL)
        __builtin_prefetch(far);
    gm_ahead_compute(r, m, k + AHEAD);
    if (r->index[k % AHEAD] == k)
        return r->key[k % AHEAD];
    PyObject *block_hash = gm_ahead_hash(r, k);
    if (block_hash == NULL) {
        PyErr_SetString(PyExc_IndexError, "GhostMap: a hash sequence changed size during a loop");
        return -1;
    }
    return gm_key_of_hash(block_hash);
}

/* -- the Python type ---------------------------------------------------------------------------------- */

/* obj as a key: 1 and *key if it is an int of 64 bits other than -1, 0 if it is none (no error), -1 with
 * an error. */
static int
gm_key_of(PyObject *obj, int64_t *key)
{
    if (!PyLong_Check(obj))
        return 0;
    int overflow;
    long long k = PyLong_AsLongLongAndOverflow(obj, &overflow);
    if (k == -1 && PyErr_Occurred())
        return -1;
    if (overflow || k == EMPTY_KEY)
        return 0;
    *key = k;
    return 1;
}

/* obj as a key to store: 0 and *key, or -1 with an error that quotes it. */
static int
gm_key_to_store(PyObject *obj, int64_t *key)
{
    int is_key = gm_key_of(obj, key);
    if (is_key == 0)
        PyErr_Format(PyLong_Check(obj) ? PyExc_ValueError : PyExc_TypeError,
                     "GhostMap keys are ints of 64 bits other than -1 (a hash's), got %R", obj);
    return is_key == 1 ? 0 : -1;
}

static int
gm_value_of(PyObject *obj, int64_t *value)
{
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "GhostMap values are ints, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    long long v = PyLong_AsLongLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    *value = v;
    return 0;
}

/* m[key] = value for Python objects: 0, or -1 with an error (nothing changed). */
static int
gm_set_objects(GhostMap *m, PyObject *key_obj, PyObject *value_obj)
{
    int64_t key, value, old;
    if (gm_key_to_store(key_obj, &key) < 0 || gm_value_of(value_obj, &value) < 0)
        return -1;
    return gm_put(m, key, value, &old) < 0 ? -1 : 0;
}

static int
gm_update_from(GhostMap *m, PyObject *other)
{
    if (PyDict_Check(other)) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(other, &pos, &k, &v))
            if (gm_set_objects(m, k, v) < 0)
                return -1;
        return 0;
    }
    int mapping = PyObject_HasAttrString(other, "keys"); /* a mapping: its keys, each looked up; else pairs */
    PyObject *it, *item;
    if (mapping) {
        PyObject *keys = PyObject_CallMethod(other, "keys", NULL);
        it = keys ? PyObject_GetIter(keys) : NULL;
        Py_XDECREF(keys);
    }
    else {
        it = PyObject_GetIter(other);
    }
    if (it == NULL)
        return -1;
    while ((item = PyIter_Next(it)) != NULL) {
        PyObject *key, *val;
        if (mapping) {
            key = Py_NewRef(item);
            val = PyObject_GetItem(other, item);
        }
        else {
            PyObject *pair = PySequence_Fast(item, "GhostMap.update: items are (key, value) pairs");
            if (pair != NULL && PySequence_Fast_GET_SIZE(pair) != 2) {
                PyErr_Format(PyExc_ValueError, "GhostMap.update: an item has %zd elements, not 2",
                             PySequence_Fast_GET_SIZE(pair));
                Py_CLEAR(pair);
            }
            key = pair ? Py_NewRef(PySequence_Fast_GET_ITEM(pair, 0)) : NULL;
            val = pair ? Py_NewRef(PySequence_Fast_GET_ITEM(pair, 1)) : NULL;
            Py_XDECREF(pair);
        }
        Py_DECREF(item);
        int rc = key == NULL || val == NULL ? -1 : gm_set_objects(m, key, val);
        Py_XDECREF(key);
        Py_XDECREF(val);
        if (rc < 0) {
            Py_DECREF(it);
            return -1;
        }
    }
    Py_DECREF(it);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *
gm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    PyObject *source = NULL;
    if (!PyArg_ParseTuple(args, "|O:GhostMap", &source))
        return NULL;
    if (kwargs != NULL && PyDict_GET_SIZE(kwargs)) {
        PyErr_SetString(PyExc_TypeError, "GhostMap takes no keyword arguments");
        return NULL;
    }
    GhostMap *m = (GhostMap *)type->tp_alloc(type, 0);
    if (m == NULL)
        return NULL;
    m->slots = NULL;
    m->mask = 0;
    m->shift = 64;
    m->used = 0;
    if (source != NULL && gm_update_from(m, source) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static void
gm_dealloc(GhostMap *m)
{
    PyMem_Free(m->slots);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t
gm_len(GhostMap *m)
{
    return m->used;
}

/* m[key] into *value for a Python key: 1 if it is there, 0 if not (no error), -1 with an error. */
static int
gm_get_object(GhostMap *m, PyObject *key_obj, int64_t *value)
{
    int64_t key;
    int is_key = gm_key_of(key_obj, &key);
    if (is_key <= 0)
        return is_key;
    Py_ssize_t at = gm_find(m, key);
    if (at < 0)
        return 0;
    *value = m->slots[at].value;
    return 1;
}

/* m.pop(key) into *value for a Python key: 1 if it was there, 0 if not (no error), -1 with an error. */
static int
gm_pop_object(GhostMap *m, PyObject *key_obj, int64_t *value)
{
    int64_t key;
    int is_key = gm_key_of(key_obj, &key);
    return is_key <= 0 ? is_key : gm_pop(m, key, value);
}

static PyObject *
gm_subscript(GhostMap *m, PyObject *key)
{
    int64_t value;
    int found = gm_get_object(m, key, &value);
    if (found < 0)
        return NULL;
    if (!found) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return PyLong_FromLongLong(value);
}

static int
gm_ass_subscript(GhostMap *m, PyObject *key, PyObject *value)
{
    if (value != NULL)
        return gm_set_objects(m, key, value);
    int64_t v;
    int found = gm_pop_object(m, key, &v);
    if (found == 0)
        PyErr_SetObject(PyExc_KeyError, key);
    return found == 1 ? 0 : -1;
}

static int
gm_contains(GhostMap *m, PyObject *key)
{
    int64_t value;
    return gm_get_object(m, key, &value);
}

/* A list of each entry's key (what 0), value (1) or (key, value) pair (2), in slot order. */
static PyObject *
gm_list(GhostMap *m, int what)
{
    PyObject *out = PyList_New(m->used);
    if (out == NULL)
        return NULL;
    Py_ssize_t k = 0;
    for (size_t i = 0; m->slots != NULL && i <= m->mask; i++) {
        if (m->slots[i].key == EMPTY_KEY)
            continue;
        PyObject *item;
        if (what == 2)
            item = Py_BuildValue("(LL)", (long long)m->slots[i].key, (long long)m->slots[i].value);
        else
            item = PyLong_FromLongLong(what == 0 ? m->slots[i].key : m->slots[i].value);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k++, item);
    }
    return out;
}

static PyObject *
gm_keys(GhostMap *m, PyObject *Py_UNUSED(ignored))
{
    return gm_list(m, 0);
}

static PyObject *
gm_values(GhostMap *m, PyObject *Py_UNUSED(ignored))
{
    return gm_list(m, 1);
}

static PyObject *
gm_items(GhostMap *m, PyObject *Py_UNUSED(ignored))
{
    return gm_list(m, 2);
}

static PyObject *
gm_iter(GhostMap *m)
{
    PyObject *keys = gm_list(m, 0);
    if (keys == NULL)
        return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

/* get(key, default=None) (pop 0) or pop(key[, default]) (pop 1), as a dict's. */
static PyObject *
gm_lookup(GhostMap *m, PyObject *const *args, Py_ssize_t nargs, int pop)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_Format(PyExc_TypeError, "GhostMap.%s takes 1 or 2 arguments, got %zd", pop ? "pop" : "get", nargs);
        return NULL;
    }
    int64_t value;
    int found = pop ? gm_pop_object(m, args[0], &value) : gm_get_object(m, args[0], &value);
    if (found < 0)
        return NULL;
    if (found)
        return PyLong_FromLongLong(value);
    if (nargs == 2 || !pop)
        return Py_NewRef(nargs == 2 ? args[1] : Py_None);
    PyErr_SetObject(PyExc_KeyError, args[0]);
    return NULL;
}

static PyObject *
gm_get_method(GhostMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    return gm_lookup(m, args, nargs, 0);
}

static PyObject *
gm_pop_method(GhostMap *m, PyObject *const *args, Py_ssize_t nargs)
{
    return gm_lookup(m, args, nargs, 1);
}

static PyObject *
gm_update(GhostMap *m, PyObject *other)
{
    return gm_update_from(m, other) < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *
gm_as_dict(GhostMap *m)
{
    PyObject *d = PyDict_New();
    for (size_t i = 0; d != NULL && m->slots != NULL && i <= m->mask; i++) {
        if (m->slots[i].key == EMPTY_KEY)
            continue;
        PyObject *k = PyLong_FromLongLong(m->slots[i].key);
        PyObject *v = k ? PyLong_FromLongLong(m->slots[i].value) : NULL;
        if (v == NULL || PyDict_SetItem(d, k, v) < 0)
            Py_CLEAR(d);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    return d;
}

static PyObject *
gm_reduce(GhostMap *m, PyObject *Py_UNUSED(ignored))
{
    PyObject *d = gm_as_dict(m);
    return d == NULL ? NULL : Py_BuildValue("(O(N))", (PyObject *)Py_TYPE(m), d);
}

static PyObject *
gm_sizeof(GhostMap *m, PyObject *Py_UNUSED(ignored))
{
    size_t slots = m->slots ? m->mask + 1 : 0;
    return PyLong_FromSize_t(sizeof(GhostMap) + slots * sizeof(GhostSlot));
}

static PyObject *
gm_repr(GhostMap *m)
{
    PyObject *d = gm_as_dict(m);
    if (d == NULL)
        return NULL;
    PyObject *r = PyUnicode_FromFormat("GhostMap(%R)", d);
    Py_DECREF(d);
    return r;
}

/* == and != against another GhostMap or a dict: the same keys with the same values. */
static PyObject *
gm_richcompare(GhostMap *m, PyObject *other, int op)
{
    if ((op != Py_EQ && op != Py_NE) || !(PyObject_TypeCheck(other, &GhostMapType) || PyDict_Check(other)))
        Py_RETURN_NOTIMPLEMENTED;
    PyObject *mine = gm_as_dict(m);
    PyObject *theirs = PyDict_Check(other) ? Py_NewRef(other) : gm_as_dict((GhostMap *)other);
    PyObject *r = mine && theirs ? PyObject_RichCompare(mine, theirs, op) : NULL;
    Py_XDECREF(mine);
    Py_XDECREF(theirs);
    return r;
}

static PyMappingMethods gm_as_mapping = {
    .mp_length = (lenfunc)gm_len,
    .mp_subscript = (binaryfunc)gm_subscript,
    .mp_ass_subscript = (objobjargproc)gm_ass_subscript,
};

static PySequenceMethods gm_as_sequence = {
    .sq_contains = (objobjproc)gm_contains,
};

static PyMethodDef gm_methods[] = {
    {"get", (PyCFunction)(void (*)(void))gm_get_method, METH_FASTCALL, "get(key, default=None): as dict.get."},
    {"pop", (PyCFunction)(void (*)(void))gm_pop_method, METH_FASTCALL, "pop(key[, default]): as dict.pop."},
    {"update", (PyCFunction)gm_update, METH_O, "update(mapping or (key, value) pairs): as dict.update."},
    {"keys", (PyCFunction)gm_keys, METH_NOARGS, "keys() -> list of the keys."},
    {"values", (PyCFunction)gm_values, METH_NOARGS, "values() -> list of the values."},
    {"items", (PyCFunction)gm_items, METH_NOARGS, "items() -> list of (key, value) pairs."},
    {"__reduce__", (PyCFunction)gm_reduce, METH_NOARGS, "Pickles as its entries."},
    {"__sizeof__", (PyCFunction)gm_sizeof, METH_NOARGS, "Bytes held: the object and its slots."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject GhostMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvkit.backends.eviction.hit_density._booking.GhostMap",
    .tp_basicsize = sizeof(GhostMap),
    .tp_dealloc = (destructor)gm_dealloc,
    .tp_repr = (reprfunc)gm_repr,
    .tp_as_sequence = &gm_as_sequence,
    .tp_as_mapping = &gm_as_mapping,
    .tp_hash = PyObject_HashNotImplemented,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_MAPPING,
    .tp_doc = "GhostMap([mapping or pairs]): a map from int keys of 64 bits other than -1 to ints of 64 bits (a "
              "dict's contract for its methods; any other key is absent, and storing one raises), in an "
              "open-addressing table without tombstones: the hit-density ghost's map from keys to eviction "
              "numbers.",
    .tp_richcompare = (richcmpfunc)gm_richcompare,
    .tp_iter = (getiterfunc)gm_iter,
    .tp_methods = gm_methods,
    .tp_new = gm_new,
};

#endif
