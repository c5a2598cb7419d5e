/* The chain index's loops, compiled: FlatChains.add_many, remove_many, distinct_tracked, collect and
 * orphans_among, step for step.
 *
 * _chains.py holds the references (FlatChains.add_many_reference, remove_many_reference,
 * distinct_tracked_reference, collect_reference and orphans_among_reference) and the contract; the tests
 * run both on the same calls and compare the whole state, the kept walk included. The per-block links
 * (_up, _first, _next, _prev: array('i')) and the owner's pin marks (bytearray) are read through the buffer
 * protocol; the maps, the hash list, the kept walk and the orphans' ParkingQueue stay Python objects,
 * updated exactly as the reference updates them: the queue through the loops it runs (its _loops' add,
 * add_many and remove_many, called as C functions where they are compiled) and its remove method.
 * add_many hands the orphans it finds to the queue's add_many, in the order found, each with the flag the
 * reference's add gives it, the queue's state taken once for them: the queue holds them before any call
 * that can meet them (its remove of the orphans whose parent arrives) and when the call returns or raises,
 * and nothing in between reads it, so it ends in the reference's state. A fresh walk keeps its stack in C
 * while it runs and, stopped at its count, hands it over as the reference's kept walk (a list of (block,
 * bool) tuples); a call that may resume a kept walk runs the reference, which resumes it in place, O(1) a
 * step.
 *
 * Inputs the loops do not take at C speed (sequences other than lists and tuples, block ids that are
 * not ints inside the arrays, maps other than dicts, a hash list other than a list) run the reference
 * for the whole call: nothing is changed before that choice. Every index read from the arrays, the driver's index or the caller's leaving set is checked before use: one outside the
 * arrays raises IndexError and writes nothing (where the reference would index a negative one from the end).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_objects.h"
#include "_views.h"

/* The marks of _chains.py's _up: no block, an orphan, no block tracked, a parent that left this call. */
enum { NONE = -1, ORPHAN = -2, UNTRACKED = -3, LEFT = -4 };

/* One FlatChains for one call: its arrays, maps and queue (new references, NULL where not taken). */
typedef struct {
    View up_v, first_v, next_v, prev_v, parked_v;
    int32_t *up, *first, *nxt, *prv;
    const unsigned char *parked;
    Py_ssize_t size, parked_size;
    long mark;
    PyObject *own, *hashes, *waiting, *orphan_of, *orphans, *block_of, *walk, *held, *victims;
    PyObject *queue_add, *queue_add_many, *queue_remove_many; /* the orphan queue's own loops (its _loops') */
} Chains;

static void
drop(Chains *c)
{
    release(&c->up_v);
    release(&c->first_v);
    release(&c->next_v);
    release(&c->prev_v);
    release(&c->parked_v);
    Py_CLEAR(c->own);
    Py_CLEAR(c->hashes);
    Py_CLEAR(c->waiting);
    Py_CLEAR(c->orphan_of);
    Py_CLEAR(c->orphans);
    Py_CLEAR(c->block_of);
    Py_CLEAR(c->walk);
    Py_CLEAR(c->held);
    Py_CLEAR(c->victims);
    Py_CLEAR(c->queue_add);
    Py_CLEAR(c->queue_add_many);
    Py_CLEAR(c->queue_remove_many);
}

static int
array_view(PyObject *chains, const char *name, View *v, int32_t **out)
{
    PyObject *obj = PyObject_GetAttrString(chains, name);
    if (obj == NULL)
        return -1;
    int rc = view(obj, v, 4, name);
    Py_DECREF(obj);
    if (rc == 0)
        *out = (int32_t *)v->buf.buf;
    return rc;
}

/* Takes the state; 1: taken, 0: a part of other types (the reference runs, nothing taken), -1: an error. */
static int
take(PyObject *chains, Chains *c)
{
    memset(c, 0, sizeof *c);
    if ((c->own = PyObject_GetAttrString(chains, "_own")) == NULL
        || (c->hashes = PyObject_GetAttrString(chains, "_hash")) == NULL
        || (c->waiting = PyObject_GetAttrString(chains, "_waiting")) == NULL
        || (c->orphan_of = PyObject_GetAttrString(chains, "_orphan_of")) == NULL
        || (c->orphans = PyObject_GetAttrString(chains, "_orphans")) == NULL
        || (c->block_of = PyObject_GetAttrString(chains, "_block_of")) == NULL
        || (c->walk = PyObject_GetAttrString(chains, "_walk")) == NULL)
        return -1;
    PyObject *loops = PyObject_GetAttrString(c->orphans, "_loops");
    if (loops == NULL)
        return -1;
    c->queue_add = PyObject_GetAttrString(loops, "add");
    c->queue_add_many = c->queue_add == NULL ? NULL : PyObject_GetAttrString(loops, "add_many");
    c->queue_remove_many = c->queue_add_many == NULL ? NULL : PyObject_GetAttrString(loops, "remove_many");
    Py_DECREF(loops);
    if (c->queue_remove_many == NULL)
        return -1;
    if ((c->own != Py_None && !PyDict_CheckExact(c->own)) || !PyList_CheckExact(c->hashes)
        || !PyDict_CheckExact(c->waiting) || !PyDict_CheckExact(c->orphan_of))
        return 0;
    if (c->own == Py_None)
        Py_CLEAR(c->own);
    if (c->walk == Py_None)
        Py_CLEAR(c->walk);
    else if ((c->held = PyObject_GetAttrString(c->walk, "held")) == NULL
             || (c->victims = PyObject_GetAttrString(c->walk, "victims")) == NULL)
        return -1;
    else if (!PySet_Check(c->held) || !PySet_Check(c->victims))
        return 0;
    PyObject *mark = PyObject_GetAttrString(chains, "PARKED");
    if (mark == NULL)
        return -1;
    c->mark = PyLong_AsLong(mark);
    Py_DECREF(mark);
    if (c->mark == -1 && PyErr_Occurred())
        return -1;
    if (array_view(chains, "_up", &c->up_v, &c->up) < 0 || array_view(chains, "_first", &c->first_v, &c->first) < 0
        || array_view(chains, "_next", &c->next_v, &c->nxt) < 0
        || array_view(chains, "_prev", &c->prev_v, &c->prv) < 0)
        return -1;
    PyObject *parked = PyObject_GetAttrString(chains, "parked");
    if (parked == NULL)
        return -1;
    int rc = view(parked, &c->parked_v, 1, "parked");
    Py_DECREF(parked);
    if (rc < 0)
        return -1;
    c->parked = (const unsigned char *)c->parked_v.buf.buf;
    c->parked_size = c->parked_v.buf.len;
    c->size = c->up_v.buf.len / 4;
    if (c->first_v.buf.len / 4 != c->size || c->next_v.buf.len / 4 != c->size || c->prev_v.buf.len / 4 != c->size) {
        PyErr_SetString(PyExc_ValueError, "FlatChains: the link arrays differ in size");
        return -1;
    }
    return 1;
}

/* An index into the link arrays: one outside them raises IndexError. */
static int
inside(const Chains *c, long index)
{
    if (index < 0 || index >= c->size) {
        PyErr_Format(PyExc_IndexError, "FlatChains: block %ld is outside 0..%zd", index, c->size - 1);
        return 0;
    }
    return 1;
}

static int
is_parked(const Chains *c, long block, int *out)
{
    if (block >= c->parked_size) {
        PyErr_SetString(PyExc_IndexError, "bytearray index out of range");
        return -1;
    }
    *out = c->parked[block] == c->mark;
    return 0;
}

/* FlatChains._link: append block to the ring starting at first (NONE: a new ring); the ring's first. */
static int
link_ring(Chains *c, long block, long first, long *out)
{
    if (first == NONE) {
        c->nxt[block] = c->prv[block] = (int32_t)block;
        *out = block;
        return 0;
    }
    if (!inside(c, first))
        return -1;
    long last = c->prv[first];
    if (!inside(c, last))
        return -1;
    c->nxt[last] = (int32_t)block;
    c->prv[block] = (int32_t)last;
    c->nxt[block] = (int32_t)first;
    c->prv[first] = (int32_t)block;
    *out = first;
    return 0;
}

/* FlatChains._unlink: take block out of the ring starting at first; the ring's first (NONE: empty). */
static int
unlink_ring(Chains *c, long block, long first, long *out)
{
    long after = c->nxt[block];
    if (after == block) {
        *out = NONE;
        return 0;
    }
    long before = c->prv[block];
    if (!inside(c, after) || !inside(c, before))
        return -1;
    c->nxt[before] = (int32_t)after;
    c->prv[after] = (int32_t)before;
    *out = first == block ? after : first;
    return 0;
}

static int
as_block(PyObject *obj, long *out)
{
    *out = PyLong_AsLong(obj);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static int
set_long(PyObject *dict, PyObject *key, long value)
{
    PyObject *v = PyLong_FromLong(value);
    if (v == NULL)
        return -1;
    int rc = PyDict_SetItem(dict, key, v);
    Py_DECREF(v);
    return rc;
}

static int
append_long(PyObject *list, long value)
{
    PyObject *v = PyLong_FromLong(value);
    if (v == NULL)
        return -1;
    int rc = PyList_Append(list, v);
    Py_DECREF(v);
    return rc;
}

/* The names of the methods called back, interned at import. */
static PyObject *name_remove, *name_get;

/* obj.<name>(arg, *more): a new reference. */
static PyObject *
call(PyObject *obj, PyObject *name, PyObject *arg, PyObject *more)
{
    PyObject *argv[3] = {obj, arg, more};
    return PyObject_VectorcallMethod(name, argv, (more == NULL ? 2 : 3) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* queue.<name>(block, *more), its result dropped. */
static int
call_queue(PyObject *queue, PyObject *name, long block, PyObject *more)
{
    PyObject *b = PyLong_FromLong(block);
    if (b == NULL)
        return -1;
    PyObject *r = call(queue, name, b, more);
    Py_DECREF(b);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* loop(orphans, block, *more), one of the orphan queue's own loops (no method lookup, no Python frame where
 * they are compiled), its result dropped. */
static int
queue_loop(const Chains *c, PyObject *loop, PyObject *block, PyObject *more)
{
    PyObject *argv[3] = {c->orphans, block, more};
    PyObject *r = PyObject_Vectorcall(loop, argv, more == NULL ? 2 : 3, NULL);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* Whether value is in a set (or any container), by the value as a Python int. */
static int
holds(PyObject *container, long value)
{
    PyObject *v = PyLong_FromLong(value);
    if (v == NULL)
        return -1;
    int rc = PySet_Check(container) || PyFrozenSet_Check(container) ? PySet_Contains(container, v)
                                                                   : PySequence_Contains(container, v);
    Py_DECREF(v);
    return rc;
}

/* _common.<name>(*args): the error the reference builds for a refusal (a new reference). */
static PyObject *
refusal(const char *name, PyObject *args)
{
    if (args == NULL)
        return NULL;
    PyObject *common = PyImport_ImportModule("kvkit.backends.eviction._common"), *make = NULL, *error = NULL;
    if (common != NULL && (make = PyObject_GetAttrString(common, name)) != NULL)
        error = PyObject_CallObject(make, args);
    Py_XDECREF(common);
    Py_XDECREF(make);
    Py_DECREF(args);
    return error;
}

/* The walk drops at a block it holds (FlatChains.add_many's new child of a pushed block). */
static int
drop_walk(PyObject *chains, Chains *c)
{
    Py_CLEAR(c->walk);
    Py_CLEAR(c->held);
    Py_CLEAR(c->victims);
    return PyObject_SetAttrString(chains, "_walk", Py_None);
}

/* The orphans found so far, not yet in the queue: they enter it in one call of its add_many loop, in the
 * order found, each with its flag. */
typedef struct {
    PyObject *blocks, *flags; /* lists (new references), NULL before the first orphan */
} Found;

/* Enters the orphans found into the queue (once, raised or not: the lists are handed over). */
static int
enter_found(const Chains *c, Found *f)
{
    PyObject *blocks = f->blocks, *flags = f->flags;
    if (blocks == NULL)
        return 0;
    f->blocks = f->flags = NULL;
    PyObject *argv[3] = {c->orphans, blocks, flags};
    PyObject *r = PyObject_Vectorcall(c->queue_add_many, argv, 3, NULL);
    Py_DECREF(blocks);
    Py_DECREF(flags);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* Notes an orphan found (block and flag borrowed). */
static int
found(Found *f, PyObject *block, PyObject *flag)
{
    if (f->blocks == NULL) {
        PyObject *blocks = PyList_New(0), *flags = PyList_New(0);
        if (blocks == NULL || flags == NULL) {
            Py_XDECREF(blocks);
            Py_XDECREF(flags);
            return -1;
        }
        f->blocks = blocks;
        f->flags = flags;
    }
    return PyList_Append(f->blocks, block) < 0 || PyList_Append(f->flags, flag) < 0 ? -1 : 0;
}

static PyObject *
add_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("add_many", nargs, 6) < 0)
        return NULL;
    PyObject *chains = args[0], *owner = args[1], *pinned = args[5];
    PyObject *blocks = NULL, *hashes = NULL, *parents = NULL, *parent_blocks = NULL, *fresh = NULL;
    PyObject *refused = NULL, *result = NULL;
    Found orphans_found = {NULL, NULL};
    Chains c;
    int taken = -1;
    if (is_sequence(args[2]) && is_sequence(args[3]) && is_sequence(args[4])) {
        taken = take(chains, &c);
        if (taken < 0)
            goto done;
    }
    else
        memset(&c, 0, sizeof c);
    Py_ssize_t n = 0;
    if (taken == 1) {
        blocks = PySequence_Tuple(args[2]); /* tuples: the items outlive any callback */
        hashes = blocks ? PySequence_Tuple(args[3]) : NULL;
        parents = hashes ? PySequence_Tuple(args[4]) : NULL;
        if (parents == NULL)
            goto done;
        n = PyTuple_GET_SIZE(blocks);
        if (PyTuple_GET_SIZE(hashes) < n)
            n = PyTuple_GET_SIZE(hashes);
        if (PyTuple_GET_SIZE(parents) < n)
            n = PyTuple_GET_SIZE(parents);
        for (Py_ssize_t i = 0; i < n && taken; i++) { /* an id the reference would index otherwise */
            PyObject *b = PyTuple_GET_ITEM(blocks, i);
            if (!PyLong_CheckExact(b))
                taken = 0;
            else {
                long block = PyLong_AsLong(b);
                if (block == -1 && PyErr_Occurred())
                    PyErr_Clear();
                taken = block >= 0 && block < c.size;
            }
        }
    }
    if (taken != 1) {
        drop(&c);
        result = PyObject_CallMethod(chains, "add_many_reference", "OOOOO", owner, args[2], args[3], args[4],
                                     pinned);
        goto done;
    }
    int pinned_true = PyObject_IsTrue(pinned);
    if (pinned_true < 0 || (parent_blocks = PyList_New(0)) == NULL || (fresh = PyList_New(0)) == NULL)
        goto done;
    PyObject *last_hash = NULL, *last_obj = NULL; /* the block added last in this call and its hash (borrowed) */
    long last_block = NONE;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block_obj = PyTuple_GET_ITEM(blocks, i), *block_hash = PyTuple_GET_ITEM(hashes, i);
        PyObject *parent = PyTuple_GET_ITEM(parents, i);
        long block = PyLong_AsLong(block_obj);
        if (c.up[block] != UNTRACKED) {
            refused = refusal("already_tracked", PyTuple_Pack(2, owner, block_obj));
            goto answer;
        }
        if (c.own != NULL) {
            PyObject *other = PyDict_GetItemWithError(c.own, block_hash); /* borrowed */
            if (other == NULL && PyErr_Occurred())
                goto done;
            if (other != NULL) {
                long o;
                if (as_block(other, &o) < 0 || !inside(&c, o))
                    goto done;
                if (c.up[o] != UNTRACKED) {
                    refused = refusal("hash_already_tracked", PyTuple_Pack(4, owner, block_obj, block_hash, other));
                    goto answer;
                }
            }
            if (block >= PyList_GET_SIZE(c.hashes)) {
                PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
                goto done;
            }
            Py_INCREF(block_hash);
            if (PyList_SetItem(c.hashes, block, block_hash) < 0 || PyDict_SetItem(c.own, block_hash, block_obj) < 0)
                goto done;
        }
        long first = NONE;
        if (PyDict_GET_SIZE(c.waiting)) {
            PyObject *v = PyDict_GetItemWithError(c.waiting, block_hash);
            if (v == NULL && PyErr_Occurred())
                goto done;
            if (v != NULL) {
                if (as_block(v, &first) < 0 || !inside(&c, first) || PyDict_DelItem(c.waiting, block_hash) < 0)
                    goto done;
            }
        }
        if (first != NONE) { /* its children were orphans: their parent is back */
            if (enter_found(&c, &orphans_found) < 0) /* one may be among them */
                goto done;
            c.first[block] = (int32_t)first;
            long child = first;
            while (1) {
                if (call_queue(c.orphans, name_remove, child, NULL) < 0)
                    goto done;
                PyObject *key = PyLong_FromLong(child);
                if (key == NULL)
                    goto done;
                int rc = PyDict_DelItem(c.orphan_of, key);
                Py_DECREF(key);
                if (rc < 0)
                    goto done;
                c.up[child] = (int32_t)block;
                child = c.nxt[child];
                if (child == first)
                    break;
                if (!inside(&c, child))
                    goto done;
            }
        }
        if (PyList_Append(fresh, first != NONE ? Py_True : Py_False) < 0)
            goto done;
        PyObject *previous_hash = last_hash, *previous_obj = last_obj;
        long previous = last_block;
        last_hash = block_hash;
        last_obj = block_obj;
        last_block = block;
        int heads = parent == Py_None;
        if (!heads && (heads = PyObject_RichCompareBool(parent, block_hash, Py_EQ)) < 0)
            goto done;
        if (heads) {
            c.up[block] = NONE;
            if (append_long(parent_blocks, NONE) < 0)
                goto done;
            continue;
        }
        /* A chain stored in one call names the block added just before: tracked, no lookup needed. */
        long parent_block = NONE;
        PyObject *parent_obj = NULL; /* the parent's block, as the reference reports it */
        int same = previous_hash != NULL ? PyObject_RichCompareBool(parent, previous_hash, Py_EQ) : 0;
        if (same < 0)
            goto done;
        if (same) {
            parent_block = previous;
            parent_obj = Py_NewRef(previous_obj);
        }
        else {
            PyObject *v;
            if (PyDict_CheckExact(c.block_of))
                v = Py_XNewRef(PyDict_GetItemWithError(c.block_of, parent));
            else
                v = call(c.block_of, name_get, parent, NULL);
            if (v == NULL && PyErr_Occurred())
                goto done;
            if (v != NULL && v != Py_None) {
                if (as_block(v, &parent_block) < 0) {
                    Py_DECREF(v);
                    goto done;
                }
                if (parent_block < 0) {
                    Py_DECREF(v);
                    PyErr_Format(PyExc_IndexError, "FlatChains: the index maps a hash to block %ld", parent_block);
                    goto done;
                }
                if (parent_block < c.size && c.up[parent_block] != UNTRACKED)
                    parent_obj = v;
                else
                    Py_DECREF(v);
            }
            else
                Py_XDECREF(v);
        }
        if (parent_obj == NULL) { /* an orphan: its parent hash is not tracked */
            long ring;
            c.up[block] = ORPHAN;
            if (PyDict_SetItem(c.orphan_of, block_obj, parent) < 0)
                goto done;
            PyObject *w = PyDict_GetItemWithError(c.waiting, parent); /* borrowed */
            long waiting_first = NONE;
            if ((w == NULL && PyErr_Occurred()) || (w != NULL && as_block(w, &waiting_first) < 0)
                || link_ring(&c, block, waiting_first, &ring) < 0
                || (w == NULL && PyDict_SetItem(c.waiting, parent, block_obj) < 0)) /* (else its first stays) */
                goto done;
            int parked_too = 0;
            if (!pinned_true && is_parked(&c, block, &parked_too) < 0)
                goto done;
            if (found(&orphans_found, block_obj, pinned_true ? pinned : parked_too ? Py_True : Py_False) < 0)
                goto done;
            if (append_long(parent_blocks, NONE) < 0)
                goto done;
            continue;
        }
        c.up[block] = (int32_t)parent_block;
        long head = c.first[parent_block], ring;
        int rc = 0;
        if (head == NONE)
            c.nxt[block] = c.prv[block] = c.first[parent_block] = (int32_t)block;
        else
            rc = link_ring(&c, block, head, &ring);
        if (rc == 0 && c.held != NULL) {
            int in = PySet_Contains(c.held, parent_obj);
            rc = in < 0 || (in && drop_walk(chains, &c) < 0); /* a new child of a block the walk has passed */
        }
        rc = rc || PyList_Append(parent_blocks, parent_obj) < 0;
        Py_DECREF(parent_obj);
        if (rc)
            goto done;
    }
answer:
    if (PyErr_Occurred() || enter_found(&c, &orphans_found) < 0)
        goto done;
    result = PyTuple_Pack(3, parent_blocks, fresh, refused != NULL ? refused : Py_None);
done:
    if (result == NULL && orphans_found.blocks != NULL) {
        /* an error: the orphans found before it enter the queue, as the reference had entered them */
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (enter_found(&c, &orphans_found) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, traceback);
    }
    Py_XDECREF(orphans_found.blocks);
    Py_XDECREF(orphans_found.flags);
    drop(&c);
    Py_XDECREF(blocks);
    Py_XDECREF(hashes);
    Py_XDECREF(parents);
    Py_XDECREF(parent_blocks);
    Py_XDECREF(fresh);
    Py_XDECREF(refused);
    return result;
}

static PyObject *
remove_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("remove_many", nargs, 4) < 0)
        return NULL;
    PyObject *chains = args[0], *owner = args[1];
    PyObject *blocks = NULL, *leaving = NULL, *unqueued = NULL, *removed = NULL, *result = NULL;
    long *staying = NULL;
    Py_ssize_t room = 0;
    Chains c;
    memset(&c, 0, sizeof c);
    int taken = is_sequence(args[2]) ? take(chains, &c) : 0;
    if (taken < 0)
        goto done;
    if (taken == 0) {
        drop(&c);
        result = PyObject_CallMethod(chains, "remove_many_reference", "OOO", owner, args[2], args[3]);
        goto done;
    }
    if ((blocks = PySequence_Tuple(args[2])) == NULL)
        goto done;
    if (args[3] == Py_None)
        leaving = PyObject_CallMethod(chains, "distinct_tracked", "(O)", blocks);
    else
        leaving = Py_NewRef(args[3]);
    if (leaving == NULL)
        goto done;
    int checked = PyObject_IsTrue(leaving); /* every block tracked, each named once: none can be refused */
    /* How many leave, where that is known (-1: unknown); none: no block is looked up in it. */
    Py_ssize_t leaving_size = checked <= 0 ? 0 : PyAnySet_Check(leaving) ? PySet_GET_SIZE(leaving) : -1;
    if (checked < 0 || (unqueued = PyList_New(0)) == NULL || (removed = PyList_New(0)) == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *block_obj = PyTuple_GET_ITEM(blocks, i);
        long block = NONE;
        int tracked = PyLong_CheckExact(block_obj);
        if (tracked) {
            block = PyLong_AsLong(block_obj);
            if (block == -1 && PyErr_Occurred()) {
                if (!PyErr_ExceptionMatches(PyExc_OverflowError))
                    goto done;
                PyErr_Clear();
            }
            tracked = block >= 0 && block < c.size && c.up[block] != UNTRACKED;
        }
        if (checked) { /* the caller vouched for every block: it is only checked to be an index */
            if (!PyLong_CheckExact(block_obj)) {
                PyErr_SetString(PyExc_TypeError, "array indices must be integers");
                goto done;
            }
            if (!inside(&c, block))
                goto done;
        }
        else if (!tracked) {
            PyObject *error = refusal("not_tracked", PyTuple_Pack(2, owner, block_obj));
            if (error != NULL) {
                PyErr_SetObject((PyObject *)Py_TYPE(error), error);
                Py_DECREF(error);
            }
            goto done;
        }
        if (block >= PyList_GET_SIZE(c.hashes)) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            goto done;
        }
        PyObject *block_hash = PyList_GET_ITEM(c.hashes, block);
        if (block_hash == Py_None) {
            PyErr_SetNone(PyExc_AssertionError); /* the reference's assert */
            goto done;
        }
        if (PyList_Append(removed, block_hash) < 0) /* held by removed from here on */
            goto done;
        if (c.own != NULL) {
            Py_INCREF(Py_None);
            if (PyList_SetItem(c.hashes, block, Py_None) < 0 || PyDict_DelItem(c.own, block_hash) < 0)
                goto done;
        }
        long parent_block = c.up[block];
        c.up[block] = UNTRACKED;
        if (parent_block == ORPHAN) {
            PyObject *parent = dict_pop(c.orphan_of, block_obj);
            if (parent == NULL) {
                if (!PyErr_Occurred())
                    PyErr_SetObject(PyExc_KeyError, block_obj);
                goto done;
            }
            int rc;
            if (checked)
                rc = PyList_Append(unqueued, block_obj);
            else
                rc = call_queue(c.orphans, name_remove, block, NULL);
            PyObject *w = rc < 0 ? NULL : PyDict_GetItemWithError(c.waiting, parent);
            long first = NONE, rest = NONE;
            if (w == NULL && rc == 0 && !PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, parent);
            rc = w == NULL || as_block(w, &first) < 0 || unlink_ring(&c, block, first, &rest) < 0
                 || (rest == NONE ? PyDict_DelItem(c.waiting, parent) : set_long(c.waiting, parent, rest)) < 0;
            Py_DECREF(parent);
            if (rc)
                goto done;
        }
        else if (parent_block >= 0) { /* out of its parent's ring */
            if (!inside(&c, parent_block))
                goto done;
            long after = c.nxt[block];
            if (after == block)
                c.first[parent_block] = NONE;
            else {
                long before = c.prv[block];
                if (!inside(&c, after) || !inside(&c, before))
                    goto done;
                c.nxt[before] = (int32_t)after;
                c.prv[after] = (int32_t)before;
                if (c.first[parent_block] == block)
                    c.first[parent_block] = (int32_t)after;
            }
        }
        long first = c.first[block];
        if (first != NONE) {
            if (!inside(&c, first))
                goto done;
            c.first[block] = NONE;
            int only_leaving = c.nxt[first] == first && leaving_size != 0 ? holds(leaving, first) : 0;
            if (only_leaving < 0)
                goto done;
            if (only_leaving) /* an only child, leaving too (a chain's) */
                c.up[first] = LEFT;
            else { /* the children that stay wait for the hash now, as orphans */
                Py_ssize_t kept = 0;
                int left = 0;
                long child = first;
                while (1) {
                    int goes = leaving_size != 0 ? holds(leaving, child) : 0;
                    if (goes < 0)
                        goto done;
                    if (goes) {
                        c.up[child] = LEFT;
                        left = 1;
                    }
                    else {
                        if (kept == room) {
                            Py_ssize_t more = room ? 2 * room : 16;
                            long *grown = PyMem_Realloc(staying, (size_t)more * sizeof *staying);
                            if (grown == NULL) {
                                PyErr_NoMemory();
                                goto done;
                            }
                            staying = grown;
                            room = more;
                        }
                        staying[kept++] = child;
                    }
                    child = c.nxt[child];
                    if (child == first)
                        break;
                    if (!inside(&c, child))
                        goto done;
                }
                if (kept) {
                    long ring = first;
                    if (left) { /* the ring less the children leaving, in its order */
                        ring = NONE;
                        for (Py_ssize_t k = 0; k < kept; k++)
                            if (link_ring(&c, staying[k], ring, &ring) < 0)
                                goto done;
                    }
                    if (set_long(c.waiting, block_hash, ring) < 0)
                        goto done;
                    for (Py_ssize_t k = 0; k < kept; k++) {
                        long child_k = staying[k];
                        int parked_child;
                        if (is_parked(&c, child_k, &parked_child) < 0)
                            goto done;
                        PyObject *key = PyLong_FromLong(child_k);
                        if (key == NULL)
                            goto done;
                        int rc = queue_loop(&c, c.queue_add, key, parked_child ? Py_True : Py_False);
                        if (rc == 0)
                            rc = PyDict_SetItem(c.orphan_of, key, block_hash);
                        Py_DECREF(key);
                        if (rc < 0)
                            goto done;
                        c.up[child_k] = ORPHAN;
                    }
                }
            }
        }
        if (c.held != NULL) {
            int in = PySet_Contains(c.held, block_obj);
            if (in < 0)
                goto done;
            if (in) {
                int victim = PySet_Contains(c.victims, block_obj);
                if (victim < 0)
                    goto done;
                if (victim) { /* its id may come back as another block */
                    if (PySet_Discard(c.victims, block_obj) < 0 || PySet_Discard(c.held, block_obj) < 0)
                        goto done;
                }
                else if (drop_walk(chains, &c) < 0)
                    goto done;
            }
        }
    }
    if (queue_loop(&c, c.queue_remove_many, unqueued, NULL) < 0)
        goto done;
    result = removed;
    removed = NULL;
done:
    drop(&c);
    PyMem_Free(staying);
    Py_XDECREF(blocks);
    Py_XDECREF(leaving);
    Py_XDECREF(unqueued);
    Py_XDECREF(removed);
    return result;
}

/* The names collect reads, interned at import, and the kept walk's class (_chains._Walk, imported at the
 * first walk kept). */
static PyObject *name_parked, *name_mark, *name_first, *name_next, *name_prev, *name_walk, *name_root, *name_victims,
    *walk_class;

/* One collect call: the index's child links and pin marks, and the caller's arguments (borrowed). */
typedef struct {
    View first_v, next_v, prev_v, parked_v;
    const int32_t *first, *nxt, *prv;
    const unsigned char *parked;
    Py_ssize_t size, n;
    long mark;
    PyObject *chains, *is_evictable, *chosen;
} Walker;

/* An entry of the walk's stack: a block, and whether its children are pushed above it. */
typedef struct {
    long block;
    int expanded;
} Entry;

static void
walker_drop(Walker *w)
{
    release(&w->first_v);
    release(&w->next_v);
    release(&w->prev_v);
    release(&w->parked_v);
}

/* The call's state: 1 if taken, 0 if the reference takes the call (other types, a root outside the
 * arrays, arrays of other sizes; nothing done), -1 with an error. */
static int
walker_take(Walker *w, PyObject *const *args, long *root)
{
    memset(w, 0, sizeof *w);
    w->chains = args[0];
    w->is_evictable = args[2];
    w->chosen = args[3];
    if (!PyLong_CheckExact(args[1]) || !PyDict_CheckExact(args[3]) || !PyLong_CheckExact(args[4]))
        return 0;
    int overflow;
    long long r = PyLong_AsLongLongAndOverflow(args[1], &overflow);
    w->n = PyLong_AsSsize_t(args[4]);
    if (overflow || (w->n == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return 0;
    }
    PyObject *mark = PyObject_GetAttr(w->chains, name_mark);
    if (mark == NULL)
        return -1;
    w->mark = PyLong_AsLong(mark);
    Py_DECREF(mark);
    if ((w->mark == -1 && PyErr_Occurred()) || view_attr(w->chains, name_first, &w->first_v, 4) < 0
        || view_attr(w->chains, name_next, &w->next_v, 4) < 0 || view_attr(w->chains, name_prev, &w->prev_v, 4) < 0
        || view_attr(w->chains, name_parked, &w->parked_v, 1) < 0)
        return -1;
    w->size = items(&w->first_v);
    if (items(&w->next_v) != w->size || items(&w->prev_v) != w->size || items(&w->parked_v) < w->size || r < 0
        || r >= w->size)
        return 0;
    w->first = (const int32_t *)w->first_v.buf.buf;
    w->nxt = (const int32_t *)w->next_v.buf.buf;
    w->prv = (const int32_t *)w->prev_v.buf.buf;
    w->parked = (const unsigned char *)w->parked_v.buf.buf;
    *root = (long)r;
    return 1;
}

/* A block read from the link arrays, checked to be inside them. */
static int
walker_inside(const Walker *w, long block)
{
    if (block < 0 || block >= w->size) {
        PyErr_Format(PyExc_IndexError, "FlatChains: block %ld is outside 0..%zd", block, w->size - 1);
        return 0;
    }
    return 1;
}

/* block in chosen: 1, 0, -1. */
static int
is_chosen(const Walker *w, long block)
{
    PyObject *key = PyLong_FromLong(block);
    if (key == NULL)
        return -1;
    int rc = PyDict_Contains(w->chosen, key);
    Py_DECREF(key);
    return rc;
}

/* parked[block] != mark and is_evictable(block), as a bool: 1, 0, -1. */
static int
may_evict(const Walker *w, long block)
{
    if (w->parked[block] == w->mark)
        return 0;
    PyObject *key = PyLong_FromLong(block);
    if (key == NULL)
        return -1;
    PyObject *answer = PyObject_CallOneArg(w->is_evictable, key);
    Py_DECREF(key);
    if (answer == NULL)
        return -1;
    int rc = PyObject_IsTrue(answer);
    Py_DECREF(answer);
    return rc;
}

/* chosen[block] = None and block appended to picked (and added to victims where that is a set). */
static int
choose(const Walker *w, long block, PyObject *picked, PyObject *victims)
{
    PyObject *key = PyLong_FromLong(block);
    if (key == NULL)
        return -1;
    int rc = PyDict_SetItem(w->chosen, key, Py_None) < 0 || PyList_Append(picked, key) < 0
             || (victims != NULL && PySet_Add(victims, key) < 0);
    Py_DECREF(key);
    return rc ? -1 : 0;
}

/* Append block to a growable C array of *cap items (reallocated as it fills). */
static int
push_block(long **items, Py_ssize_t *count, Py_ssize_t *cap, long block)
{
    if (*count == *cap) {
        Py_ssize_t grown = *cap ? 2 * *cap : 64;
        long *more = PyMem_Resize(*items, long, grown);
        if (more == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *items = more;
        *cap = grown;
    }
    (*items)[(*count)++] = block;
    return 0;
}

/* FlatChains._collect_whole: 1 with *out the blocks picked, 0 if the walk might stop before its end
 * (nothing done), -1 with an error. */
static int
whole(const Walker *w, long root, PyObject **out)
{
    long *stack = NULL, *listed = NULL;
    Py_ssize_t stacked = 0, stack_cap = 0, count = 0, listed_cap = 0;
    PyObject *picked = NULL;
    int rc = -1;
    Py_ssize_t room = w->n - PyDict_GET_SIZE(w->chosen);
    if (room < 1) /* the walk stops before its root */
        return 0;
    /* The blocks the walk pushes, listed in the reverse of its post order (the reference's docstring). */
    Py_ssize_t pushed = 1;
    if (push_block(&stack, &stacked, &stack_cap, root) < 0)
        goto done;
    while (stacked) {
        long block = stack[--stacked];
        for (;;) {
            if (push_block(&listed, &count, &listed_cap, block) < 0)
                goto done;
            long head = w->first[block];
            if (head == NONE)
                break;
            if (!walker_inside(w, head))
                goto done;
            if (w->nxt[head] == head) { /* an only child: pushed and popped at once */
                int in = is_chosen(w, head);
                if (in < 0)
                    goto done;
                if (in || head == root)
                    break;
                if (++pushed > room) { /* the walk might stop before its end */
                    rc = 0;
                    goto done;
                }
                block = head;
                continue;
            }
            long child = head;
            do {
                int in = is_chosen(w, child);
                if (in < 0)
                    goto done;
                if (!in && child != root) {
                    if (push_block(&stack, &stacked, &stack_cap, child) < 0)
                        goto done;
                    pushed++;
                }
                child = w->nxt[child];
                if (!walker_inside(w, child))
                    goto done;
            } while (child != head);
            if (pushed > room) {
                rc = 0;
                goto done;
            }
            break;
        }
    }
    if (PyObject_SetAttr(w->chains, name_walk, Py_None) < 0 || (picked = PyList_New(0)) == NULL)
        goto done;
    for (Py_ssize_t k = count - 1; k >= 0; k--) { /* the walk's choices, in its post order */
        long block = listed[k];
        if (w->parked[block] == w->mark)
            continue;
        int in = is_chosen(w, block), usable = 0;
        if (in == 0 && (usable = may_evict(w, block)) > 0 && choose(w, block, picked, NULL) < 0)
            usable = -1;
        if (in < 0 || usable < 0)
            goto done;
    }
    *out = picked;
    picked = NULL;
    rc = 1;
done:
    Py_XDECREF(picked);
    PyMem_Free(stack);
    PyMem_Free(listed);
    return rc;
}

static int
push_entry(Entry **items, Py_ssize_t *count, Py_ssize_t *cap, long block, int expanded)
{
    if (*count == *cap) {
        Py_ssize_t grown = *cap ? 2 * *cap : 64;
        Entry *more = PyMem_Resize(*items, Entry, grown);
        if (more == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        *items = more;
        *cap = grown;
    }
    (*items)[*count].block = block;
    (*items)[(*count)++].expanded = expanded;
    return 0;
}

/* The walk FlatChains._walk keeps, as collect takes it: 1 if none is kept from root (none, or one from
 * another root: a fresh walk, its whole pass first), 2 if one is kept from root that has victims (a fresh
 * walk, as the reference walks afresh then), 0 if one kept from root may resume (the reference resumes it,
 * popping and pushing its stack list in place: O(1) a step, where loading the stack here would cost its
 * depth), -1 with an error. */
static int
kept_walk(const Walker *w, long root)
{
    PyObject *walk = PyObject_GetAttr(w->chains, name_walk), *walk_root = NULL, *victims = NULL;
    int rc = -1;
    if (walk == NULL)
        return -1;
    if (walk == Py_None)
        rc = 1;
    else if ((walk_root = PyObject_GetAttr(walk, name_root)) != NULL) {
        int overflow = 0;
        long long at = PyLong_CheckExact(walk_root) ? PyLong_AsLongLongAndOverflow(walk_root, &overflow) : root;
        if (overflow || at != root)
            rc = 1;
        else if ((victims = PyObject_GetAttr(walk, name_victims)) != NULL)
            rc = PySet_CheckExact(victims) && PySet_GET_SIZE(victims) ? 2 : 0;
    }
    Py_XDECREF(victims);
    Py_XDECREF(walk_root);
    Py_DECREF(walk);
    return rc;
}

/* A list of the stack's entries as the reference keeps them, (block, bool) tuples. */
static PyObject *
stack_list(const Entry *stack, Py_ssize_t count)
{
    PyObject *list = PyList_New(count);
    for (Py_ssize_t k = 0; list != NULL && k < count; k++) {
        PyObject *entry = Py_BuildValue("(lO)", stack[k].block, stack[k].expanded ? Py_True : Py_False);
        if (entry == NULL)
            Py_CLEAR(list);
        else
            PyList_SET_ITEM(list, k, entry);
    }
    return list;
}

/* A _Walk(root, stack, held, victims, skipped), its class imported at the first one. */
static PyObject *
new_walk(PyObject *root, PyObject *stack, PyObject *held, PyObject *victims, PyObject *skipped)
{
    if (walk_class == NULL) {
        PyObject *chains_module = PyImport_ImportModule("kvkit.backends.eviction._chains");
        if (chains_module == NULL)
            return NULL;
        walk_class = PyObject_GetAttrString(chains_module, "_Walk");
        Py_DECREF(chains_module);
        if (walk_class == NULL)
            return NULL;
    }
    PyObject *args[5] = {root, stack, held, victims, skipped};
    return PyObject_Vectorcall(walk_class, args, 5, NULL);
}

static PyObject *
collect(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("collect", nargs, 5) < 0)
        return NULL;
    Walker w;
    long root = NONE;
    PyObject *held = NULL, *victims = NULL, *skipped = NULL, *picked = NULL, *result = NULL;
    Entry *stack = NULL;
    Py_ssize_t count = 0, cap = 0;
    int rc = walker_take(&w, args, &root), kept = 0;
    if (rc > 0)
        rc = kept = kept_walk(&w, root);
    if (rc == 0) { /* other types, or a walk from root kept: the reference */
        walker_drop(&w);
        return PyObject_CallMethod(args[0], "collect_reference", "OOOO", args[1], args[2], args[3], args[4]);
    }
    if (rc < 0)
        goto done;
    if (w.first[root] == NONE && PyDict_GET_SIZE(w.chosen) < w.n) { /* a childless root: the root alone */
        if (PyObject_SetAttr(w.chains, name_walk, Py_None) < 0 || (picked = PyList_New(0)) == NULL)
            goto done;
        int in = is_chosen(&w, root), usable = 0;
        if (in == 0 && (usable = may_evict(&w, root)) > 0 && choose(&w, root, picked, NULL) < 0)
            usable = -1;
        if (in >= 0 && usable >= 0)
            result = Py_NewRef(picked);
        goto done;
    }
    if (kept == 1 && (rc = whole(&w, root, &result)) != 0) /* a fresh walk that runs to its end, short */
        goto done;
    /* a fresh walk that may stop at n (a _Walk only if it is kept) */
    if ((held = PySet_New(NULL)) == NULL || PySet_Add(held, args[1]) < 0 || (victims = PySet_New(NULL)) == NULL
        || (skipped = PyList_New(0)) == NULL || push_entry(&stack, &count, &cap, root, 0) < 0
        || (picked = PyList_New(0)) == NULL)
        goto done;
    while (count && PyDict_GET_SIZE(w.chosen) < w.n) {
        Entry top = stack[--count];
        long block = top.block;
        if (!top.expanded) {
            if (push_entry(&stack, &count, &cap, block, 1) < 0)
                goto done;
            long head = w.first[block];
            if (head == NONE)
                continue;
            if (!walker_inside(&w, head))
                goto done;
            long child = w.prv[head]; /* the last child first: the first one is walked first */
            for (;;) {
                if (!walker_inside(&w, child))
                    goto done;
                PyObject *key = PyLong_FromLong(child);
                if (key == NULL)
                    goto done;
                int in = PySet_Contains(held, key);
                if (in == 0 && (in = PySet_Add(held, key)) == 0) {
                    int chosen_already = PyDict_Contains(w.chosen, key); /* with its subtree, earlier */
                    in = chosen_already < 0 ? -1
                         : chosen_already ? PySet_Add(victims, key)
                                          : push_entry(&stack, &count, &cap, child, 0);
                }
                Py_DECREF(key);
                if (in < 0)
                    goto done;
                if (child == head)
                    break;
                child = w.prv[child];
            }
            continue;
        }
        int in = is_chosen(&w, block);
        if (in < 0)
            goto done;
        if (in) {
            PyObject *key = PyLong_FromLong(block);
            rc = key == NULL ? -1 : PySet_Add(victims, key);
            Py_XDECREF(key);
            if (rc < 0)
                goto done;
            continue;
        }
        rc = may_evict(&w, block);
        if (rc < 0 || (rc ? choose(&w, block, picked, victims) : append_long(skipped, block)) < 0)
            goto done;
    }
    if (!count)
        rc = PyObject_SetAttr(w.chains, name_walk, Py_None);
    else {
        PyObject *entries = stack_list(stack, count), *walk = NULL;
        if (entries != NULL)
            walk = new_walk(args[1], entries, held, victims, skipped);
        rc = walk == NULL ? -1 : PyObject_SetAttr(w.chains, name_walk, walk);
        Py_XDECREF(entries);
        Py_XDECREF(walk);
    }
    if (rc == 0)
        result = Py_NewRef(picked);
done:
    walker_drop(&w);
    Py_XDECREF(held);
    Py_XDECREF(victims);
    Py_XDECREF(skipped);
    Py_XDECREF(picked);
    PyMem_Free(stack);
    return result;
}

/* FlatChains.orphans_among_reference: the items of a list or tuple whose _up is ORPHAN, in their order; any
 * other sequence, or an item that is no exact int inside the arrays, runs the reference (it changes nothing). */
static PyObject *
orphans_among(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("orphans_among", nargs, 2) < 0)
        return NULL;
    PyObject *chains = args[0], *blocks = args[1], *result = NULL;
    View up_v = {0};
    int32_t *up;
    if (!is_sequence(blocks))
        return PyObject_CallMethod(chains, "orphans_among_reference", "(O)", blocks);
    if (array_view(chains, "_up", &up_v, &up) < 0 || (result = PyList_New(0)) == NULL)
        goto done;
    Py_ssize_t size = up_v.buf.len / 4, n = PySequence_Fast_GET_SIZE(blocks);
    PyObject **items = PySequence_Fast_ITEMS(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        long block = PyLong_CheckExact(items[i]) ? PyLong_AsLong(items[i]) : -1;
        if (block < 0 || block >= size) { /* (an overflow's error cleared) another id: the reference */
            PyErr_Clear();
            release(&up_v);
            Py_SETREF(result, PyObject_CallMethod(chains, "orphans_among_reference", "(O)", blocks));
            goto done;
        }
        if (up[block] == ORPHAN && PyList_Append(result, items[i]) < 0) {
            Py_CLEAR(result);
            goto done;
        }
    }
done:
    release(&up_v);
    return result;
}

static PyObject *
distinct_tracked(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("distinct_tracked", nargs, 2) < 0)
        return NULL;
    PyObject *chains = args[0], *blocks = args[1];
    if (!is_sequence(blocks)) /* another sequence: the reference */
        return PyObject_CallMethod(chains, "distinct_tracked_reference", "(O)", blocks);
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    PyObject **items = PySequence_Fast_ITEMS(blocks);
    if (n < 2)
        return PyFrozenSet_New(NULL);
    for (Py_ssize_t k = 0; k < n; k++)
        if (!PyLong_CheckExact(items[k])) /* a set of other items (or none: unhashable): the reference */
            return PyObject_CallMethod(chains, "distinct_tracked_reference", "(O)", blocks);
    View up_v = {0};
    int32_t *up;
    if (array_view(chains, "_up", &up_v, &up) < 0) {
        release(&up_v);
        return NULL;
    }
    Py_ssize_t size = up_v.buf.len / 4;
    int tracked = 1;
    for (Py_ssize_t k = 0; tracked && k < n; k++) {
        long block = PyLong_AsLong(items[k]);
        if (block == -1 && PyErr_Occurred()) {
            if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
                release(&up_v);
                return NULL;
            }
            PyErr_Clear(); /* past the arrays */
        }
        tracked = block >= 0 && block < size && up[block] != UNTRACKED;
    }
    release(&up_v);
    if (!tracked)
        return PyFrozenSet_New(NULL);
    PyObject *leaving = PyFrozenSet_New(blocks);
    if (leaving != NULL && PySet_GET_SIZE(leaving) != n) /* a block named twice */
        Py_SETREF(leaving, PyFrozenSet_New(NULL));
    return leaving;
}

static PyMethodDef methods[] = {
    {"add_many", (PyCFunction)(void (*)(void))add_many, METH_FASTCALL,
     "add_many(chains, owner, blocks, hashes, parents, pinned) -> (parent_blocks, fresh, refusal): "
     "FlatChains.add_many_reference, compiled."},
    {"remove_many", (PyCFunction)(void (*)(void))remove_many, METH_FASTCALL,
     "remove_many(chains, owner, blocks, leaving) -> hashes: FlatChains.remove_many_reference, compiled."},
    {"distinct_tracked", (PyCFunction)(void (*)(void))distinct_tracked, METH_FASTCALL,
     "distinct_tracked(chains, blocks) -> frozenset: FlatChains.distinct_tracked_reference, compiled."},
    {"collect", (PyCFunction)(void (*)(void))collect, METH_FASTCALL,
     "collect(chains, root, is_evictable, chosen, n) -> picked: FlatChains.collect_reference, compiled."},
    {"orphans_among", (PyCFunction)(void (*)(void))orphans_among, METH_FASTCALL,
     "orphans_among(chains, blocks) -> orphans: FlatChains.orphans_among_reference, compiled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_chains_loops", "The chain index's batch loops, compiled (see _chains.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

/* collect's names, interned at import. */
static int
intern_collect_names(void)
{
    struct {
        PyObject **name;
        const char *text;
    } names[] = {{&name_parked, "parked"}, {&name_mark, "PARKED"}, {&name_first, "_first"}, {&name_next, "_next"},
                 {&name_prev, "_prev"}, {&name_walk, "_walk"}, {&name_root, "root"},
                 {&name_victims, "victims"}};
    for (size_t k = 0; k < sizeof names / sizeof names[0]; k++)
        if ((*names[k].name = PyUnicode_InternFromString(names[k].text)) == NULL)
            return -1;
    return 0;
}

PyMODINIT_FUNC
PyInit__chains_loops(void)
{
    if ((name_remove = PyUnicode_InternFromString("remove")) == NULL
        || (name_get = PyUnicode_InternFromString("get")) == NULL || intern_collect_names() < 0)
        return NULL;
    return PyModule_Create(&module);
}
