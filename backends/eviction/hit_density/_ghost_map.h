/* GhostMap: the ghost's map from block hashes to eviction numbers, an open-addressing table.
 *
 * It keeps a mapping's contract (a dict's, for the methods it has): keys are hashable objects compared
 * by ==, values ints that fit in 64 bits. Layout: a power-of-two array of slots (the key's hash and
 * the value, 16 bytes) beside an array of key references, probed linearly from a slot picked by the
 * hash's top bits after a Fibonacci multiply. The ghost's churn (a key in and a key out per eviction)
 * leaves no tombstones: a removal shifts back the entries after it that would otherwise be cut off
 * from their home slot, so an absent key's probe ends at the first empty slot. The table doubles when
 * more than half of it would be in use and shrinks to a quarter in use when less than an eighth is, so
 * it never holds more than four slots per entry at its peak. A miss reads one run of adjacent slots
 * and never a key; a hit reads the one key whose hash matches.
 *
 * Invariants: every entry lies on the run of occupied slots that starts at its home slot; no two
 * entries hold equal keys; used <= slots / 2; a slot is empty exactly when its hash is EMPTY_HASH (-1,
 * which Python's hash never returns) and its key NULL.
 */
#ifndef KVKIT_GHOST_MAP_H
#define KVKIT_GHOST_MAP_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define EMPTY_HASH ((Py_hash_t)-1)
#define MIN_SLOTS 8

typedef struct {
    Py_hash_t hash;
    int64_t value;
} GhostSlot;

typedef struct {
    PyObject_HEAD
    GhostSlot *slots; /* NULL while empty and never grown */
    PyObject **keys;
    size_t mask;      /* slots - 1 */
    int shift;        /* 64 - log2(slots) */
    Py_ssize_t used;
    uint64_t version; /* bumped by every change: a comparison that changed the map is refused */
} GhostMap;

static PyTypeObject GhostMapType;

static inline size_t
gm_home(const GhostMap *m, Py_hash_t hash)
{
    return (size_t)(((uint64_t)hash * 0x9E3779B97F4A7C15ull) >> m->shift);
}

/* Empty arrays of `slots` slots (a power of two >= MIN_SLOTS) in m, the entries of the old ones moved in. */
static int
gm_resize(GhostMap *m, size_t slots)
{
    GhostSlot *fresh = PyMem_New(GhostSlot, slots);
    PyObject **keys = PyMem_New(PyObject *, slots);
    if (fresh == NULL || keys == NULL) {
        PyMem_Free(fresh);
        PyMem_Free(keys);
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i < slots; i++) {
        fresh[i].hash = EMPTY_HASH;
        keys[i] = NULL;
    }
    GhostSlot *old = m->slots;
    PyObject **old_keys = m->keys;
    size_t old_slots = old ? m->mask + 1 : 0;
    int bits = 0;
    while (((size_t)1 << bits) < slots)
        bits++;
    m->slots = fresh;
    m->keys = keys;
    m->mask = slots - 1;
    m->shift = 64 - bits;
    for (size_t j = 0; j < old_slots; j++) {
        if (old[j].hash == EMPTY_HASH)
            continue;
        size_t i = gm_home(m, old[j].hash);
        while (fresh[i].hash != EMPTY_HASH)
            i = (i + 1) & m->mask;
        fresh[i] = old[j];
        keys[i] = old_keys[j];
    }
    PyMem_Free(old);
    PyMem_Free(old_keys);
    m->version++;
    return 0;
}

/* The slot holding `key` (of hash `hash`), -1 if none, -2 with an error (a comparison raised, or changed m). */
static Py_ssize_t
gm_find(GhostMap *m, PyObject *key, Py_hash_t hash)
{
    if (m->slots == NULL)
        return -1;
    for (size_t i = gm_home(m, hash);; i = (i + 1) & m->mask) {
        Py_hash_t h = m->slots[i].hash;
        if (h == EMPTY_HASH)
            return -1;
        if (h != hash)
            continue;
        PyObject *k = m->keys[i];
        if (k == key)
            return (Py_ssize_t)i;
        uint64_t version = m->version;
        Py_INCREF(k);
        int eq = PyObject_RichCompareBool(k, key, Py_EQ);
        Py_DECREF(k);
        if (eq < 0)
            return -2;
        if (m->version != version) {
            PyErr_SetString(PyExc_RuntimeError, "GhostMap changed while a key was compared");
            return -2;
        }
        if (eq)
            return (Py_ssize_t)i;
    }
}

/* Empty slot i (occupied), shifting back the entries after it, then drop its key (last: that may run code). */
static void
gm_remove_at(GhostMap *m, size_t i)
{
    PyObject *key = m->keys[i];
    for (size_t j = (i + 1) & m->mask; m->slots[j].hash != EMPTY_HASH; j = (j + 1) & m->mask) {
        size_t home = gm_home(m, m->slots[j].hash);
        if (((j - home) & m->mask) >= ((j - i) & m->mask)) { /* slot i lies on j's run from its home */
            m->slots[i] = m->slots[j];
            m->keys[i] = m->keys[j];
            i = j;
        }
    }
    m->slots[i].hash = EMPTY_HASH;
    m->keys[i] = NULL;
    m->used--;
    m->version++;
    if (m->mask + 1 > MIN_SLOTS && (size_t)m->used * 8 < m->mask + 1) {
        size_t slots = MIN_SLOTS;
        while (slots < (size_t)m->used * 4)
            slots *= 2;
        if (gm_resize(m, slots) < 0) /* keeps the larger table: still a valid one */
            PyErr_Clear();
    }
    Py_DECREF(key);
}

/* Start loading the slot (and key) where a lookup of a key of hash `hash` begins: a loop over many keys
 * asks for the key a few places ahead, so that its lookup finds the slot in cache (a table larger than
 * the caches costs a memory round trip per key otherwise). A hint: it changes nothing. */
static inline void
gm_prefetch(const GhostMap *m, Py_hash_t hash)
{
    if (m->slots != NULL) {
        size_t i = gm_home(m, hash);
        __builtin_prefetch(&m->slots[i]);
        __builtin_prefetch(&m->keys[i]);
    }
}

/* A loop over many keys looks each one up ahead of its turn, in two stages: AHEAD places ahead it hashes
 * the key, if an int (whose hash runs no code and never fails), and prefetches the key's slot; twice as far
 * ahead it prefetches the key object itself, which the hash reads (a block's hash object, made when the
 * block was stored, is rarely still in cache). gm_ahead_hash(r, k) is the k-th key's hash from the ring,
 * or -1 (not an int: the lookup hashes it at its turn). Hints only: they change nothing. */
enum { AHEAD = 8 };
typedef struct {
    Py_hash_t hash[AHEAD];
    Py_ssize_t key[AHEAD];
    PyObject *keys; /* a list or tuple (PySequence_Fast), borrowed; read afresh at each step */
    Py_ssize_t n;
} GhostAhead;

/* The k-th key, or NULL past the loop's end or the sequence's. */
static inline PyObject *
gm_ahead_key(const GhostAhead *r, Py_ssize_t k)
{
    return k < r->n && k < PySequence_Fast_GET_SIZE(r->keys) ? PySequence_Fast_GET_ITEM(r->keys, k) : NULL;
}

static inline void
gm_ahead_hash_key(GhostAhead *r, const GhostMap *m, Py_ssize_t k)
{
    PyObject *key = gm_ahead_key(r, k);
    if (key == NULL || !PyLong_CheckExact(key))
        return;
    if (!PyLong_CheckExact(key))
        return;
    Py_hash_t hash = PyObject_Hash(key);
    r->hash[k % AHEAD] = hash;
    r->key[k % AHEAD] = k;
    gm_prefetch(m, hash);
}

/* Start looking ahead over the keys start..n-1 of `keys` (a list or tuple, borrowed). */
static inline void
gm_ahead_start(GhostAhead *r, const GhostMap *m, PyObject *keys, Py_ssize_t n, Py_ssize_t start)
{
    r->keys = keys;
    r->n = n;
    for (int k = 0; k < AHEAD; k++)
        r->key[k] = -1;
    for (Py_ssize_t k = start; k < start + 2 * AHEAD; k++) {
        PyObject *key = gm_ahead_key(r, k);
        if (key != NULL)
            __builtin_prefetch(key);
    }
    for (Py_ssize_t k = start; k < start + AHEAD; k++)
        gm_ahead_hash_key(r, m, k);
}

/* The k-th key's turn: look further ahead. */
static inline void
gm_ahead_step(GhostAhead *r, const GhostMap *m, Py_ssize_t k)
{
    PyObject *far = gm_ahead_key(r, k + 2 * AHEAD);
    if (far != NULL)
        __builtin_prefetch(far);
    gm_ahead_hash_key(r, m, k + AHEAD);
}

static inline Py_hash_t
gm_ahead_hash(const GhostAhead *r, Py_ssize_t k)
{
    return r->key[k % AHEAD] == k ? r->hash[k % AHEAD] : -1;
}

/* m[key] = value, the key's hash given (or -1: computed here). */
static int
gm_set_hashed(GhostMap *m, PyObject *key, Py_hash_t hash, int64_t value)
{
    if (hash == -1 && (hash = PyObject_Hash(key)) == -1)
        return -1;
    Py_ssize_t at = gm_find(m, key, hash);
    if (at == -2)
        return -1;
    if (at >= 0) {
        m->slots[at].value = value;
        return 0;
    }
    if (m->slots == NULL || (size_t)(m->used + 1) * 2 > m->mask + 1) { /* doubled: a quarter in use */
        if (gm_resize(m, m->slots == NULL ? MIN_SLOTS : (m->mask + 1) * 2) < 0)
            return -1;
    }
    size_t i = gm_home(m, hash);
    while (m->slots[i].hash != EMPTY_HASH)
        i = (i + 1) & m->mask;
    m->slots[i].hash = hash;
    m->slots[i].value = value;
    m->keys[i] = Py_NewRef(key);
    m->used++;
    m->version++;
    return 0;
}

/* m[key] = value. */
static int
gm_set(GhostMap *m, PyObject *key, int64_t value)
{
    return gm_set_hashed(m, key, -1, value);
}

/* m.pop(key) into *value, the key's hash given (or -1: computed here): 1 if it was there, 0 if not (no
 * error), -1 with an error. */
static int
gm_pop_hashed(GhostMap *m, PyObject *key, Py_hash_t hash, int64_t *value)
{
    if (hash == -1 && (hash = PyObject_Hash(key)) == -1)
        return -1;
    Py_ssize_t at = gm_find(m, key, hash);
    if (at < 0)
        return at == -1 ? 0 : -1;
    *value = m->slots[at].value;
    gm_remove_at(m, (size_t)at);
    return 1;
}

/* m.pop(key) into *value: 1 if it was there, 0 if not (no error), -1 with an error. */
static int
gm_pop(GhostMap *m, PyObject *key, int64_t *value)
{
    return gm_pop_hashed(m, key, -1, value);
}

/* m[key] into *value: 1 if it is there, 0 if not (no error), -1 with an error. */
static int
gm_get(GhostMap *m, PyObject *key, int64_t *value)
{
    Py_hash_t hash = PyObject_Hash(key);
    if (hash == -1)
        return -1;
    Py_ssize_t at = gm_find(m, key, hash);
    if (at < 0)
        return at == -1 ? 0 : -1;
    *value = m->slots[at].value;
    return 1;
}

/* -- the Python type ---------------------------------------------------------------------------------- */

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

static int
gm_update_from(GhostMap *m, PyObject *other)
{
    if (PyDict_Check(other)) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        int64_t value;
        while (PyDict_Next(other, &pos, &k, &v)) {
            Py_INCREF(k);
            Py_INCREF(v);
            int rc = gm_value_of(v, &value) < 0 ? -1 : gm_set(m, k, value);
            Py_DECREF(k);
            Py_DECREF(v);
            if (rc < 0)
                return -1;
        }
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
        int64_t value;
        int rc = key == NULL || val == NULL || gm_value_of(val, &value) < 0 ? -1 : gm_set(m, key, value);
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
    m->keys = NULL;
    m->mask = 0;
    m->shift = 64;
    m->used = 0;
    m->version = 0;
    if (source != NULL && gm_update_from(m, source) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

static void
gm_dealloc(GhostMap *m)
{
    if (m->slots != NULL)
        for (size_t i = 0; i <= m->mask; i++)
            Py_XDECREF(m->keys[i]);
    PyMem_Free(m->slots);
    PyMem_Free(m->keys);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static Py_ssize_t
gm_len(GhostMap *m)
{
    return m->used;
}

static PyObject *
gm_subscript(GhostMap *m, PyObject *key)
{
    int64_t value;
    int found = gm_get(m, key, &value);
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
    int64_t v;
    if (value != NULL)
        return gm_value_of(value, &v) < 0 ? -1 : gm_set(m, key, v);
    int found = gm_pop(m, key, &v);
    if (found == 0)
        PyErr_SetObject(PyExc_KeyError, key);
    return found == 1 ? 0 : -1;
}

static int
gm_contains(GhostMap *m, PyObject *key)
{
    int64_t value;
    return gm_get(m, key, &value);
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
        if (m->slots[i].hash == EMPTY_HASH)
            continue;
        PyObject *item = what == 0 ? Py_NewRef(m->keys[i]) : PyLong_FromLongLong(m->slots[i].value);
        if (item != NULL && what == 2) {
            PyObject *pair = PyTuple_Pack(2, m->keys[i], item);
            Py_SETREF(item, pair);
        }
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
    int found = pop ? gm_pop(m, args[0], &value) : gm_get(m, args[0], &value);
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
        if (m->slots[i].hash == EMPTY_HASH)
            continue;
        PyObject *v = PyLong_FromLongLong(m->slots[i].value);
        if (v == NULL || PyDict_SetItem(d, m->keys[i], v) < 0)
            Py_CLEAR(d);
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
    return PyLong_FromSize_t(sizeof(GhostMap) + slots * (sizeof(GhostSlot) + sizeof(PyObject *)));
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
    {"__sizeof__", (PyCFunction)gm_sizeof, METH_NOARGS, "Bytes held: the object and its two arrays."},
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
    .tp_doc = "GhostMap([mapping or pairs]): a map from hashable keys to ints of 64 bits (a dict's contract for "
              "its methods), in an open-addressing table without tombstones: the hit-density ghost's map from "
              "block hashes to eviction numbers.",
    .tp_richcompare = (richcmpfunc)gm_richcompare,
    .tp_iter = (getiterfunc)gm_iter,
    .tp_methods = gm_methods,
    .tp_new = gm_new,
};

#endif
