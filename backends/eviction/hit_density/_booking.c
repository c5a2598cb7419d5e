/* The hit-density policy's per-block bookkeeping loops, compiled: booking.py's functions, step for step.
 *
 * booking.py holds the reference and the contracts; the tests run both on the same calls and
 * compare the whole state. The policy's per-block arrays are read through the buffer protocol
 * (bytearrays of bytes, array('i') links, array('q') clocks); maps, the class-list ends and the
 * dirty set stay Python objects, updated as the reference updates them. What the reference asks the chain
 * index for (FlatChains.links in book_accesses, pin_many and unpin_many in book_pins) is read from its
 * arrays and maps here, as those methods read them; its orphan queue is told through its own methods.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_ghost_map.h"
#include "_objects.h"
#include "_twin.h"
#include "_views.h"

#define REFERENCE "kvkit.backends.eviction.hit_density.booking"

enum { LEAF = 0, PARENT = 1, TIP = 2, KINDS = 3, NONE = -1, MAX_USES = 255, LISTED = 1, PARKED = 2 };
enum { ORPHAN = -2 }; /* FlatChains' _up mark of an orphan */

/* The policy's state for one call. */
typedef struct {
    View cls, where, uses, last, next, prev, key, ghost_cls, ghost_uses, ghost_last, ghost_live;
    PyObject *ends, *dirty;
} State;

/* The attribute names read and written, interned once at import: S(_clock) is "_clock". */
#define NAMES(X)                                                                                                    \
    X(_chains) X(_clock) X(_cls) X(_dirty) X(_ends) X(_evictions) X(_ghost_at) X(_ghost_base) X(_ghost_cls)         \
    X(_ghost_key) X(_ghost_last) X(_ghost_live) X(_ghost_recent) X(_ghost_uses) X(_hash) X(_key) X(_last) X(_last_removal) \
    X(_model) X(_next) X(_next_refresh) X(_orphan_of) X(_orphans) X(_prev) X(_recent) X(_reused) X(_reuses)        \
    X(_shift) X(_tip) X(_tracked) X(_turnover) X(_up) X(_uses) X(_where) X(first_ages) X(frombytes) X(note)        \
    X(pin_many) X(unpin_many)
#define S(name) str##name
#define DECLARE(name) static PyObject *S(name);
NAMES(DECLARE)

static PyObject *
attr(PyObject *obj, PyObject *name)
{
    return PyObject_GetAttr(obj, name);
}

/* 1 if the policy's ghost map is a GhostMap, 0 if it is another mapping (the reference runs: it takes any), -1
 * with an error. */
static int
ghost_map_is_compiled(PyObject *p)
{
    PyObject *m = attr(p, S(_ghost_at));
    if (m == NULL)
        return -1;
    int compiled = PyObject_TypeCheck(m, &GhostMapType);
    Py_DECREF(m);
    return compiled;
}

/* The class lists: each block's class, mark and links, the lists' ends and their dirty set. */
static int
open_lists(PyObject *p, State *s)
{
    if (view_attr(p, S(_cls), &s->cls, 1) < 0 || view_attr(p, S(_where), &s->where, 1) < 0
        || view_attr(p, S(_next), &s->next, 4) < 0 || view_attr(p, S(_prev), &s->prev, 4) < 0)
        return -1;
    if ((s->ends = attr(p, S(_ends))) == NULL || (s->dirty = attr(p, S(_dirty))) == NULL)
        return -1;
    if (!PyList_Check(s->ends) || !PySet_Check(s->dirty)) {
        PyErr_SetString(PyExc_TypeError, "booking: the policy's list ends are not a list, or its dirty set no set");
        return -1;
    }
    Py_ssize_t size = items(&s->where);
    if (items(&s->cls) < size || items(&s->next) < size || items(&s->prev) < size) {
        PyErr_SetString(PyExc_ValueError, "booking: the per-block arrays differ in size");
        return -1;
    }
    return 0;
}

static void
close_state(State *s)
{
    View *views[] = {&s->cls, &s->where, &s->uses, &s->last, &s->next, &s->prev, &s->key,
                     &s->ghost_cls, &s->ghost_uses, &s->ghost_last, &s->ghost_live};
    for (size_t k = 0; k < sizeof views / sizeof views[0]; k++)
        release(views[k]);
    Py_CLEAR(s->ends);
    Py_CLEAR(s->dirty);
}

static int
set_int_item(PyObject *list, Py_ssize_t index, long value)
{
    PyObject *v = PyLong_FromLong(value);
    if (v == NULL)
        return -1;
    return PyList_SetItem(list, index, v); /* steals v */
}

static int
mark_dirty(PyObject *dirty, long end)
{
    PyObject *v = PyLong_FromLong(end);
    if (v == NULL)
        return -1;
    int rc = PySet_Add(dirty, v);
    Py_DECREF(v);
    return rc;
}

static int
end_of(PyObject *ends, Py_ssize_t index, long *out)
{
    PyObject *v = PyList_GetItem(ends, index); /* borrowed */
    if (v == NULL)
        return -1;
    *out = PyLong_AsLong(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* HitDensityPolicy._move: out of list old (NONE: in none), to the young end of list new (NONE: none). */
static int
move(State *s, long block, long old, long new)
{
    int32_t *nxt = (int32_t *)s->next.buf.buf, *prv = (int32_t *)s->prev.buf.buf;
    if (old != NONE) {
        long before = prv[block], after = nxt[block];
        if (before == NONE) {
            if (set_int_item(s->ends, 2 * old, after) < 0 || mark_dirty(s->dirty, 2 * old) < 0)
                return -1;
        }
        else
            nxt[before] = (int32_t)after;
        if (after == NONE) {
            if (set_int_item(s->ends, 2 * old + 1, before) < 0 || mark_dirty(s->dirty, 2 * old + 1) < 0)
                return -1;
        }
        else
            prv[after] = (int32_t)before;
    }
    if (new != NONE) {
        long young = 2 * new + 1, tail;
        if (end_of(s->ends, young, &tail) < 0)
            return -1;
        prv[block] = (int32_t)tail;
        nxt[block] = NONE;
        if (tail == NONE) {
            if (set_int_item(s->ends, young - 1, block) < 0 || mark_dirty(s->dirty, young - 1) < 0)
                return -1;
        }
        else
            nxt[tail] = (int32_t)block;
        if (set_int_item(s->ends, young, block) < 0 || mark_dirty(s->dirty, young) < 0)
            return -1;
    }
    return 0;
}

/* A tracked block's class becomes new (from old): a listed block moves to the young end of new's list, a parked
 * one enters it when unpinned. */
static int
reclass(State *s, long block, long old, long new)
{
    ((unsigned char *)s->cls.buf.buf)[block] = (unsigned char)new;
    return ((unsigned char *)s->where.buf.buf)[block] == LISTED ? move(s, block, old, new) : 0;
}

/* One of the density model's histograms (its reuses or its ends), held for one call: its cells (rows of
 * classes, buckets of age, as float64 in place) and each bucket's least age (HitDensityModel.first_ages). */
typedef struct {
    View cells;
    const long long *first;
    Py_ssize_t buckets, rows;
} Histogram;

/* The least ages of the last first_ages tuple read (held: a tuple never changes, so while it is the model's,
 * its values are these), converted once instead of on every call. */
static PyObject *ages_read;
static long long *ages;

/* first's values (a tuple of buckets ints), from the cache when first is the tuple read last. */
static const long long *
least_ages(PyObject *first, Py_ssize_t buckets)
{
    if (first == ages_read)
        return ages;
    long long *values = PyMem_New(long long, buckets);
    if (values == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t b = 0; b < buckets; b++)
        if ((values[b] = PyLong_AsLongLong(PyTuple_GET_ITEM(first, b))) == -1 && PyErr_Occurred()) {
            PyMem_Free(values);
            return NULL;
        }
    PyMem_Free(ages);
    ages = values;
    Py_INCREF(first);
    Py_XSETREF(ages_read, first);
    return ages;
}

static int
open_histogram(PyObject *p, PyObject *name, Histogram *r)
{
    PyObject *model = attr(p, S(_model)), *histogram = NULL, *first = NULL;
    int rc = -1;
    if (model == NULL || (histogram = attr(model, name)) == NULL || (first = attr(model, S(first_ages))) == NULL)
        goto done;
    if (PyObject_GetBuffer(histogram, &r->cells.buf, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        goto done;
    r->cells.held = 1;
    if (r->cells.buf.ndim != 2 || r->cells.buf.itemsize != 8 || strcmp(r->cells.buf.format, "d") != 0
        || !PyTuple_Check(first) || PyTuple_GET_SIZE(first) != r->cells.buf.shape[1] || r->cells.buf.shape[1] < 1) {
        PyErr_SetString(PyExc_TypeError, "booking: a histogram of the model is not rows of floats over its buckets");
        goto done;
    }
    r->rows = r->cells.buf.shape[0];
    r->buckets = r->cells.buf.shape[1];
    if ((r->first = least_ages(first, r->buckets)) == NULL)
        goto done;
    rc = 0;
done:
    Py_XDECREF(model);
    Py_XDECREF(histogram);
    Py_XDECREF(first);
    return rc;
}

static void
close_histogram(Histogram *r)
{
    release(&r->cells);
    r->first = NULL;
}

/* HitDensityModel.record_reuse (or record_end): one event of a class-cls block at age (>= 0) in its cell, the
 * bucket being the last one whose least age is at most age. */
static int
record(Histogram *r, long cls, long long age)
{
    if (cls < 0 || cls >= r->rows || age < 0) {
        PyErr_Format(PyExc_IndexError, "booking: an event of class %ld at age %lld is outside the histogram", cls, age);
        return -1;
    }
    Py_ssize_t lo = 0, hi = r->buckets - 1; /* first[lo] <= age (first[0] is 0) */
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi + 1) / 2;
        if (r->first[mid] <= age)
            lo = mid;
        else
            hi = mid - 1;
    }
    ((double *)r->cells.buf.buf)[cls * r->buckets + lo] += 1.0;
    return 0;
}

static int
checked_index(long long index, Py_ssize_t size, const char *what)
{
    if (index < 0 || index >= size) {
        PyErr_Format(PyExc_IndexError, "booking: %s %lld is outside 0..%zd", what, index, size - 1);
        return -1;
    }
    return 0;
}

/* obj as a block id if it is an int naming a block whose mark (in where, of size bytes) is not 0; else -1,
 * an error set only where reading it failed otherwise than by overflow (a block id the reference refuses). */
static long
tracked_id(PyObject *obj, const unsigned char *where, Py_ssize_t size)
{
    if (!PyLong_CheckExact(obj))
        return -1;
    long block = PyLong_AsLong(obj);
    if (block == -1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError))
            PyErr_Clear();
        return -1;
    }
    return block >= 0 && block < size && where[block] ? block : -1;
}

/* The class table (class_of[KINDS * min(uses, top) + kind]) and its top, the least count of the last reuse
 * level; NULL with a TypeError naming fn if class_of is no such bytes. */
static const unsigned char *
class_table_of(PyObject *class_of, const char *fn, long *top)
{
    if (!PyBytes_Check(class_of) || PyBytes_GET_SIZE(class_of) < KINDS) {
        PyErr_Format(PyExc_TypeError, "%s: class_of is bytes", fn);
        return NULL;
    }
    *top = (long)(PyBytes_GET_SIZE(class_of) / KINDS) - 1;
    return (const unsigned char *)PyBytes_AS_STRING(class_of);
}

static PyObject *
book_inserts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("book_inserts", nargs, 9) < 0)
        return NULL;
    PyObject *p = args[0], *blocks_in = args[1], *hashes_in = args[2], *parents_in = args[3];
    PyObject *parent_blocks_in = args[4], *had_children_in = args[5];
    long mark = PyLong_AsLong(args[6]);
    Py_ssize_t start = PyLong_AsSsize_t(args[7]);
    PyObject *class_of = args[8];
    if (PyErr_Occurred())
        return NULL;
    int compiled_map = ghost_map_is_compiled(p);
    if (compiled_map <= 0)
        return compiled_map < 0 ? NULL : run_reference(REFERENCE, "book_inserts", args, nargs);
    long top;
    const unsigned char *class_table = class_table_of(class_of, "book_inserts", &top);
    if (class_table == NULL)
        return NULL;

    State s;
    memset(&s, 0, sizeof s);
    Histogram r;
    memset(&r, 0, sizeof r);
    PyObject *blocks = NULL, *hashes = NULL, *parents = NULL, *parent_blocks = NULL, *had_children = NULL;
    PyObject *ghost_at = NULL, *ghost_recent = NULL, *recent = NULL, *shift = NULL;
    PyObject *note = NULL, *tip_obj = NULL, *reused = NULL, *result = NULL;
    long long clock, tracked, due, base;
    double turnover;
    Py_ssize_t i = start, n;

    blocks = PySequence_Fast(blocks_in, "book_inserts: blocks");
    hashes = blocks ? PySequence_Fast(hashes_in, "book_inserts: hashes") : NULL;
    parents = hashes ? PySequence_Fast(parents_in, "book_inserts: parents") : NULL;
    parent_blocks = parents ? PySequence_Fast(parent_blocks_in, "book_inserts: parent_blocks") : NULL;
    had_children = parent_blocks ? PySequence_Fast(had_children_in, "book_inserts: had_children") : NULL;
    if (had_children == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(parent_blocks);
    if (PySequence_Fast_GET_SIZE(blocks) < n || PySequence_Fast_GET_SIZE(hashes) < n
        || PySequence_Fast_GET_SIZE(parents) < n || PySequence_Fast_GET_SIZE(had_children) < n || start < 0) {
        PyErr_SetString(PyExc_ValueError, "book_inserts: a per-block sequence is shorter than parent_blocks");
        goto done;
    }

    if (open_lists(p, &s) < 0 || open_histogram(p, S(_reuses), &r) < 0)
        goto done;
    if (view_attr(p, S(_uses), &s.uses, 1) < 0 || view_attr(p, S(_last), &s.last, 8) < 0
        || view_attr(p, S(_key), &s.key, 8) < 0 || view_attr(p, S(_ghost_cls), &s.ghost_cls, 1) < 0 || view_attr(p, S(_ghost_uses), &s.ghost_uses, 1) < 0
        || view_attr(p, S(_ghost_last), &s.ghost_last, 8) < 0 || view_attr(p, S(_ghost_live), &s.ghost_live, 1) < 0)
        goto done;
    if ((ghost_at = attr(p, S(_ghost_at))) == NULL || (ghost_recent = attr(p, S(_ghost_recent))) == NULL
        || (recent = attr(p, S(_recent))) == NULL || (shift = attr(p, S(_shift))) == NULL
        || (note = attr(shift, S(note))) == NULL || (tip_obj = attr(p, S(_tip))) == NULL
        || (reused = attr(p, S(_reused))) == NULL)
        goto done;
    if (!PyObject_TypeCheck(ghost_at, &GhostMapType) || !PyDict_Check(ghost_recent) || !PyDict_Check(recent)) {
        PyErr_SetString(PyExc_TypeError, "book_inserts: the policy's maps, ends and dirty set have other types");
        goto done;
    }
    if (attr_ll(p, S(_clock), &clock) < 0 || attr_ll(p, S(_tracked), &tracked) < 0
        || attr_ll(p, S(_next_refresh), &due) < 0 || attr_ll(p, S(_ghost_base), &base) < 0)
        goto done;
    {
        PyObject *t = attr(p, S(_turnover));
        if (t == NULL)
            goto done;
        turnover = PyFloat_AsDouble(t);
        Py_DECREF(t);
        if (turnover == -1.0 && PyErr_Occurred())
            goto done;
    }
    long tip = NONE;
    if (tip_obj != Py_None && (tip = PyLong_AsLong(tip_obj)) == -1 && PyErr_Occurred())
        goto done;

    unsigned char *classes = (unsigned char *)s.cls.buf.buf, *where = (unsigned char *)s.where.buf.buf;
    unsigned char *uses_of = (unsigned char *)s.uses.buf.buf;
    int64_t *last_of = (int64_t *)s.last.buf.buf, *key_of = (int64_t *)s.key.buf.buf;
    Py_ssize_t size = items(&s.where);
    if (items(&s.uses) < size || items(&s.last) < size || items(&s.key) < size) {
        PyErr_SetString(PyExc_ValueError, "book_inserts: the per-block arrays differ in size");
        goto done;
    }
    Py_ssize_t ghosts = items(&s.ghost_live);
    if (items(&s.ghost_cls) < ghosts || items(&s.ghost_uses) < ghosts || items(&s.ghost_last) < ghosts
        || items(&s.ghost_live) < ghosts) {
        PyErr_SetString(PyExc_ValueError, "book_inserts: the ghost arrays differ in size");
        goto done;
    }
    unsigned char *g_cls = (unsigned char *)s.ghost_cls.buf.buf, *g_uses = (unsigned char *)s.ghost_uses.buf.buf;
    unsigned char *g_live = (unsigned char *)s.ghost_live.buf.buf;
    int64_t *g_last = (int64_t *)s.ghost_last.buf.buf;
    int listed = mark == LISTED;
    GhostMap *ghost_map = (GhostMap *)ghost_at;
    GhostAhead ahead;
    gm_ahead_start(&ahead, ghost_map, hashes, n, i);

    while (i < n) {
        PyObject *block_obj = PySequence_Fast_GET_ITEM(blocks, i);
        PyObject *block_hash = PySequence_Fast_GET_ITEM(hashes, i);
        PyObject *parent = PySequence_Fast_GET_ITEM(parents, i);
        long block = PyLong_AsLong(block_obj);
        long parent_block = PyLong_AsLong(PySequence_Fast_GET_ITEM(parent_blocks, i));
        int had = PyObject_IsTrue(PySequence_Fast_GET_ITEM(had_children, i));
        if (PyErr_Occurred() || had < 0 || checked_index(block, size, "block") < 0
            || (parent_block != NONE && checked_index(parent_block, size, "parent block") < 0))
            goto stop;
        i++;
        if (tip != NONE) {
            long old = classes[tip], cls = old - TIP + (parent_block == tip ? PARENT : LEAF);
            if (reclass(&s, tip, old, cls) < 0)
                goto stop;
        }
        clock += 1;
        long uses = 0;
        int64_t at, key = gm_ahead_step(&ahead, ghost_map, i - 1);
        if (key == -1 && PyErr_Occurred())
            goto stop;
        if (gm_pop(ghost_map, key, &at)) { /* a reuse the cache missed: learn from it, keep the history */
            long long g = at - base;
            if (checked_index(g, ghosts, "ghost") < 0)
                goto stop;
            long cls = g_cls[g];
            long long age = clock - g_last[g];
            g_live[g] = 0;
            if (record(&r, cls, age) < 0)
                goto stop;
            int starts = parent == Py_None;
            if (!starts && (starts = PyObject_RichCompareBool(parent, block_hash, Py_EQ)) < 0)
                goto stop;
            if (!starts && (starts = PyObject_RichCompareBool(parent, reused, Py_NE)) < 0)
                goto stop;
            if (starts) {
                PyObject *level = PyLong_FromLong(cls / KINDS);
                if (level == NULL)
                    goto stop;
                PyObject *r = PyObject_CallOneArg(note, level);
                Py_DECREF(level);
                if (r == NULL)
                    goto stop;
                Py_DECREF(r);
            }
            Py_INCREF(block_hash);
            Py_SETREF(reused, block_hash);
            long gained = 1 + ((double)age < turnover); /* back within a turnover: +1 more */
            long long before = 0;
            PyObject *key_obj = PyLong_FromLongLong(key);
            PyObject *had_recent = key_obj ? dict_pop(ghost_recent, key_obj) : NULL;
            Py_XDECREF(key_obj);
            if (had_recent == NULL && PyErr_Occurred())
                goto stop;
            if (had_recent != NULL) {
                before = PyLong_AsLongLong(had_recent);
                Py_DECREF(had_recent);
                if (before == -1 && PyErr_Occurred())
                    goto stop;
            }
            PyObject *count = PyLong_FromLongLong(before + gained);
            if (count == NULL)
                goto stop;
            int rc = PyDict_SetItem(recent, block_obj, count);
            Py_DECREF(count);
            if (rc < 0)
                goto stop;
            uses = g_uses[g] + gained;
            if (uses > MAX_USES)
                uses = MAX_USES;
        }
        long row = KINDS * (uses < top ? uses : top), cls;
        if (had) {
            cls = class_table[row + PARENT];
            tip = NONE;
        }
        else {
            cls = class_table[row + TIP];
            tip = block;
        }
        uses_of[block] = (unsigned char)uses;
        last_of[block] = clock;
        key_of[block] = key;
        classes[block] = (unsigned char)cls;
        where[block] = (unsigned char)mark; /* a parked block keeps its class and enters its list when unpinned */
        if (listed && move(&s, block, NONE, cls) < 0)
            goto stop;
        tracked += 1;
        if (parent_block != NONE) {
            long old = classes[parent_block], kind = old % KINDS;
            if (kind != PARENT) { /* its class's kind changes, its reuse level stays */
                if (reclass(&s, parent_block, old, old - kind + PARENT) < 0)
                    goto stop;
            }
        }
        if (clock >= due)
            break;
    }
stop:
    /* The counters of the blocks booked are written back, an error or not. */
    {
        PyObject *err_type, *err_value, *err_tb;
        PyErr_Fetch(&err_type, &err_value, &err_tb);
        PyObject *tip_now = tip == NONE ? Py_NewRef(Py_None) : PyLong_FromLong(tip);
        int rc = tip_now == NULL || set_attr_ll(p, S(_clock), clock) < 0
                 || set_attr_ll(p, S(_tracked), tracked) < 0 || PyObject_SetAttr(p, S(_tip), tip_now) < 0
                 || PyObject_SetAttr(p, S(_reused), reused) < 0;
        Py_XDECREF(tip_now);
        if (err_type != NULL)
            PyErr_Restore(err_type, err_value, err_tb);
        else if (!rc)
            result = PyLong_FromSsize_t(i);
    }
done:
    close_state(&s);
    close_histogram(&r);
    Py_XDECREF(blocks);
    Py_XDECREF(hashes);
    Py_XDECREF(parents);
    Py_XDECREF(parent_blocks);
    Py_XDECREF(had_children);
    Py_XDECREF(ghost_at);
    Py_XDECREF(ghost_recent);
    Py_XDECREF(recent);
    Py_XDECREF(shift);
    Py_XDECREF(note);
    Py_XDECREF(tip_obj);
    Py_XDECREF(reused);
    return result;
}

/* A tracked block's hash and its parent hash (FlatChains.links): new references, the parent NULL for none. */
static int
links_of(PyObject *hashes, const int32_t *up, Py_ssize_t ups, PyObject *orphan_of, PyObject *block_obj, long block,
         PyObject **block_hash, PyObject **parent)
{
    Py_ssize_t known = PyList_GET_SIZE(hashes);
    if (block >= known || block >= ups) {
        PyErr_Format(PyExc_IndexError, "book_accesses: block %ld is outside the chain index", block);
        return -1;
    }
    long above = up[block];
    *block_hash = Py_NewRef(PyList_GET_ITEM(hashes, block));
    if (above >= 0) {
        if (above >= known) {
            Py_CLEAR(*block_hash);
            PyErr_Format(PyExc_IndexError, "book_accesses: parent block %ld is outside the chain index", above);
            return -1;
        }
        *parent = Py_NewRef(PyList_GET_ITEM(hashes, above));
        return 0;
    }
    PyObject *orphaned = PyDict_GetItemWithError(orphan_of, block_obj); /* borrowed */
    if (orphaned == NULL && PyErr_Occurred()) {
        Py_CLEAR(*block_hash);
        return -1;
    }
    *parent = orphaned == NULL ? NULL : Py_NewRef(orphaned);
    return 0;
}

static PyObject *
book_accesses(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("book_accesses", nargs, 4) < 0)
        return NULL;
    PyObject *p = args[0], *class_of = args[3];
    Py_ssize_t start = PyLong_AsSsize_t(args[2]);
    if (start == -1 && PyErr_Occurred())
        return NULL;
    long top;
    const unsigned char *class_table = class_table_of(class_of, "book_accesses", &top);
    if (class_table == NULL)
        return NULL;

    State s;
    memset(&s, 0, sizeof s);
    Histogram r;
    memset(&r, 0, sizeof r);
    View up = {0};
    PyObject *blocks = NULL, *recent = NULL, *chains = NULL, *hashes = NULL, *orphan_of = NULL, *shift = NULL;
    PyObject *note = NULL, *reused = NULL, *result = NULL;
    long long clock, due;
    Py_ssize_t i = start, n;

    if ((blocks = PySequence_Fast(args[1], "book_accesses: blocks")) == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(blocks);
    if (open_lists(p, &s) < 0 || open_histogram(p, S(_reuses), &r) < 0 || view_attr(p, S(_uses), &s.uses, 1) < 0 || view_attr(p, S(_last), &s.last, 8) < 0)
        goto done;
    if ((recent = attr(p, S(_recent))) == NULL || (chains = attr(p, S(_chains))) == NULL
        || (hashes = attr(chains, S(_hash))) == NULL || (orphan_of = attr(chains, S(_orphan_of))) == NULL
        || view_attr(chains, S(_up), &up, 4) < 0 || (shift = attr(p, S(_shift))) == NULL
        || (note = attr(shift, S(note))) == NULL || (reused = attr(p, S(_reused))) == NULL)
        goto done;
    if (!PyDict_Check(recent) || !PyList_Check(hashes) || !PyDict_Check(orphan_of)) {
        PyErr_SetString(PyExc_TypeError, "book_accesses: the policy's maps or the chain index's hashes have other types");
        goto done;
    }
    if (attr_ll(p, S(_clock), &clock) < 0 || attr_ll(p, S(_next_refresh), &due) < 0)
        goto done;
    unsigned char *classes = (unsigned char *)s.cls.buf.buf;
    unsigned char *uses_of = (unsigned char *)s.uses.buf.buf;
    int64_t *last_of = (int64_t *)s.last.buf.buf;
    const int32_t *ups = (const int32_t *)up.buf.buf;
    Py_ssize_t size = items(&s.where);
    if (items(&s.uses) < size || items(&s.last) < size) {
        PyErr_SetString(PyExc_ValueError, "book_accesses: the per-block arrays differ in size");
        goto done;
    }

    unsigned char *where = (unsigned char *)s.where.buf.buf;
    while (i < n) {
        PyObject *block_obj = PySequence_Fast_GET_ITEM(blocks, i);
        long block = tracked_id(block_obj, where, size);
        if (block == -1 && PyErr_Occurred())
            goto stop;
        if (block < 0) /* not tracked: the caller's to refuse */
            break;
        i++;
        long cls = classes[block];
        clock += 1;
        if (record(&r, cls, clock - last_of[block]) < 0)
            goto stop;
        PyObject *block_hash, *parent;
        if (links_of(hashes, ups, items(&up), orphan_of, block_obj, block, &block_hash, &parent) < 0)
            goto stop;
        int starts = parent == NULL;
        if (!starts)
            starts = PyObject_RichCompareBool(parent, reused, Py_NE);
        Py_XDECREF(parent);
        if (starts > 0) { /* it starts a reuse run */
            PyObject *level = PyLong_FromLong(cls / KINDS);
            PyObject *r = level ? PyObject_CallOneArg(note, level) : NULL;
            Py_XDECREF(level);
            if (r == NULL)
                starts = -1;
            Py_XDECREF(r);
        }
        Py_SETREF(reused, block_hash);
        if (starts < 0)
            goto stop;
        long uses = uses_of[block];
        if (uses < MAX_USES)
            uses_of[block] = (unsigned char)++uses;
        PyObject *had = PyDict_GetItemWithError(recent, block_obj); /* borrowed */
        long long before = 0;
        if (had == NULL && PyErr_Occurred())
            goto stop;
        if (had != NULL && (before = PyLong_AsLongLong(had)) == -1 && PyErr_Occurred())
            goto stop;
        PyObject *count = PyLong_FromLongLong(before + 1);
        int rc = count ? PyDict_SetItem(recent, block_obj, count) : -1;
        Py_XDECREF(count);
        if (rc < 0)
            goto stop;
        last_of[block] = clock;
        if (reclass(&s, block, cls, class_table[KINDS * (uses < top ? uses : top) + cls % KINDS]) < 0)
            goto stop;
        if (clock >= due)
            break;
    }
stop:
    /* The clock and the hash reused last are written back, an error or not. */
    {
        PyObject *err_type, *err_value, *err_tb;
        PyErr_Fetch(&err_type, &err_value, &err_tb);
        int rc = set_attr_ll(p, S(_clock), clock) < 0 || PyObject_SetAttr(p, S(_reused), reused) < 0;
        if (err_type != NULL)
            PyErr_Restore(err_type, err_value, err_tb);
        else if (!rc)
            result = PyLong_FromSsize_t(i);
    }
done:
    close_state(&s);
    close_histogram(&r);
    release(&up);
    Py_XDECREF(blocks);
    Py_XDECREF(recent);
    Py_XDECREF(chains);
    Py_XDECREF(hashes);
    Py_XDECREF(orphan_of);
    Py_XDECREF(shift);
    Py_XDECREF(note);
    Py_XDECREF(reused);
    return result;
}

static PyObject *
book_marks(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("book_marks", nargs, 3) < 0)
        return NULL;
    PyObject *p = args[0], *blocks = NULL, *result = NULL;
    long mark = PyLong_AsLong(args[2]);
    if (mark == -1 && PyErr_Occurred())
        return NULL;
    if (mark < 0 || mark > 255) {
        PyErr_Format(PyExc_ValueError, "book_marks: mark %ld is not a byte", mark);
        return NULL;
    }
    State s;
    memset(&s, 0, sizeof s);
    if ((blocks = PySequence_Fast(args[1], "book_marks: blocks")) == NULL || open_lists(p, &s) < 0)
        goto done;
    unsigned char *classes = (unsigned char *)s.cls.buf.buf, *where = (unsigned char *)s.where.buf.buf;
    Py_ssize_t size = items(&s.where), n = PySequence_Fast_GET_SIZE(blocks);
    int listed = mark == LISTED;
    for (Py_ssize_t i = 0; i < n; i++) {
        long block = PyLong_AsLong(PySequence_Fast_GET_ITEM(blocks, i));
        if ((block == -1 && PyErr_Occurred()) || checked_index(block, size, "block") < 0)
            goto done;
        long cls = classes[block];
        if (where[block] == LISTED && move(&s, block, cls, NONE) < 0) /* out of its list */
            goto done;
        if (listed && move(&s, block, NONE, cls) < 0) /* in at its young end */
            goto done;
        where[block] = (unsigned char)mark;
    }
    result = Py_NewRef(Py_None);
done:
    close_state(&s);
    Py_XDECREF(blocks);
    return result;
}

static PyObject *
book_pins(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("book_pins", nargs, 3) < 0)
        return NULL;
    PyObject *p = args[0], *blocks = NULL, *chains = NULL, *orphan_of = NULL, *orphans = NULL, *moved = NULL;
    PyObject *told = NULL, *result = NULL;
    View up = {0};
    long mark = PyLong_AsLong(args[2]);
    if (mark != LISTED && mark != PARKED) { /* no int, or a mark out of contract: the reference */
        PyErr_Clear();
        return run_reference(REFERENCE, "book_pins", args, nargs);
    }
    State s;
    memset(&s, 0, sizeof s);
    if ((blocks = PySequence_Fast(args[1], "book_pins: blocks")) == NULL || open_lists(p, &s) < 0)
        goto done;
    unsigned char *classes = (unsigned char *)s.cls.buf.buf, *where = (unsigned char *)s.where.buf.buf;
    Py_ssize_t size = items(&s.where), n = PySequence_Fast_GET_SIZE(blocks), i = 0;
    long other = mark == LISTED ? PARKED : LISTED;
    for (; i < n; i++) {
        long block = tracked_id(PySequence_Fast_GET_ITEM(blocks, i), where, size);
        if (block == -1 && PyErr_Occurred())
            goto done;
        if (block < 0 || where[block] != other) /* the caller's to refuse */
            break;
        long cls = classes[block];
        if (move(&s, block, mark == LISTED ? NONE : cls, mark == LISTED ? cls : NONE) < 0)
            goto done;
        where[block] = (unsigned char)mark;
    }
    close_state(&s);
    /* The chain index hears of the blocks moved (FlatChains.pin_many or unpin_many, inlined): where some block
     * is an orphan, its orphan queue is told which of them are (an empty batch would change nothing there). */
    if (i && ((chains = attr(p, S(_chains))) == NULL || (orphan_of = attr(chains, S(_orphan_of))) == NULL))
        goto done;
    if (i && !PyDict_CheckExact(orphan_of)) {
        PyErr_SetString(PyExc_TypeError, "book_pins: the chain index's orphan map is no dict");
        goto done;
    }
    if (i && PyDict_GET_SIZE(orphan_of)) {
        if ((orphans = attr(chains, S(_orphans))) == NULL || view_attr(chains, S(_up), &up, 4) < 0
            || (moved = PyList_New(0)) == NULL)
            goto done;
        const int32_t *ups = (const int32_t *)up.buf.buf;
        for (Py_ssize_t k = 0; k < i; k++) {
            PyObject *block_obj = PySequence_Fast_GET_ITEM(blocks, k);
            long block = PyLong_AsLong(block_obj); /* an id booked above */
            if (checked_index(block, items(&up), "block") < 0)
                goto done;
            if (ups[block] == ORPHAN && PyList_Append(moved, block_obj) < 0)
                goto done;
        }
        release(&up);
        if (PyList_GET_SIZE(moved)
            && (told = PyObject_CallMethodOneArg(orphans, mark == LISTED ? S(unpin_many) : S(pin_many), moved)) == NULL)
            goto done;
    }
    result = PyLong_FromSsize_t(i);
done:
    close_state(&s);
    release(&up);
    Py_XDECREF(blocks);
    Py_XDECREF(chains);
    Py_XDECREF(orphan_of);
    Py_XDECREF(orphans);
    Py_XDECREF(moved);
    Py_XDECREF(told);
    return result;
}

/* The policy's float attribute name set to value. */
static int
set_attr_double(PyObject *obj, PyObject *name, double value)
{
    PyObject *v = PyFloat_FromDouble(value);
    if (v == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

/* Append n bytes to a bytearray (as bytearray.extend would: refused while a view of it is held). */
static unsigned char *
grow_bytearray(PyObject *bytes, Py_ssize_t n)
{
    if (!PyByteArray_Check(bytes)) {
        PyErr_SetString(PyExc_TypeError, "book_removals: a ghost array is not a bytearray");
        return NULL;
    }
    Py_ssize_t size = PyByteArray_GET_SIZE(bytes);
    if (PyByteArray_Resize(bytes, size + n) < 0)
        return NULL;
    return (unsigned char *)PyByteArray_AS_STRING(bytes) + size;
}

static PyObject *
book_removals(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("book_removals", nargs, 3) < 0)
        return NULL;
    PyObject *p = args[0], *blocks = NULL, *recent = NULL, *ghost_recent = NULL;
    PyObject *ghost_at = NULL, *g_cls = NULL, *g_uses = NULL, *g_last = NULL, *g_live = NULL, *g_key = NULL;
    PyObject *packed = NULL, *result = NULL, *t = NULL;
    long long *ids = NULL;
    int64_t *keys = NULL;
    View cls = {0}, uses = {0}, last_of = {0}, key_of = {0}, live = {0};
    long long c = PyLong_AsLongLong(args[2]), clock, evictions, last, tracked, base;
    double turnover;
    int compiled_map = ghost_map_is_compiled(p);
    if (compiled_map < 0)
        return NULL;
    if (c < 1 || !compiled_map) { /* no int, a capacity out of contract or a map of another type: the reference */
        PyErr_Clear();
        return run_reference(REFERENCE, "book_removals", args, nargs);
    }
    if ((blocks = PySequence_Fast(args[1], "book_removals: blocks")) == NULL)
        goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(blocks);
    if (view_attr(p, S(_cls), &cls, 1) < 0 || view_attr(p, S(_uses), &uses, 1) < 0
        || view_attr(p, S(_last), &last_of, 8) < 0 || view_attr(p, S(_key), &key_of, 8) < 0)
        goto done;
    Py_ssize_t size = items(&cls);
    if (items(&uses) < size || items(&last_of) < size || items(&key_of) < size) {
        PyErr_SetString(PyExc_ValueError, "book_removals: the per-block arrays differ in size");
        goto done;
    }
    if ((ids = PyMem_New(long long, n ? n : 1)) == NULL || (keys = PyMem_New(int64_t, n ? n : 1)) == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int checked = 1;
    for (Py_ssize_t k = 0; checked && k < n; k++) {
        ids[k] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(blocks, k));
        if (ids[k] == -1 && PyErr_Occurred())
            PyErr_Clear();
        checked = ids[k] >= 0 && ids[k] < size;
    }
    if (!checked) { /* a block id outside the arrays, or no int: the reference's errors, in its order */
        release(&cls);
        release(&uses);
        release(&last_of);
        release(&key_of);
        result = run_reference(REFERENCE, "book_removals", args, nargs);
        goto done;
    }
    const int64_t *block_keys = (const int64_t *)key_of.buf.buf;
    for (Py_ssize_t k = 0; k < n; k++)
        keys[k] = block_keys[ids[k]];
    if ((recent = attr(p, S(_recent))) == NULL || (ghost_recent = attr(p, S(_ghost_recent))) == NULL
        || (ghost_at = attr(p, S(_ghost_at))) == NULL || (g_key = attr(p, S(_ghost_key))) == NULL
        || (g_cls = attr(p, S(_ghost_cls))) == NULL || (g_uses = attr(p, S(_ghost_uses))) == NULL
        || (g_last = attr(p, S(_ghost_last))) == NULL || (g_live = attr(p, S(_ghost_live))) == NULL)
        goto done;
    if (!PyDict_Check(recent) || !PyDict_Check(ghost_recent) || !PyObject_TypeCheck(ghost_at, &GhostMapType)) {
        PyErr_SetString(PyExc_TypeError, "book_removals: the policy's maps have other types");
        goto done;
    }
    if (attr_ll(p, S(_clock), &clock) < 0 || attr_ll(p, S(_evictions), &evictions) < 0
        || attr_ll(p, S(_last_removal), &last) < 0 || attr_ll(p, S(_tracked), &tracked) < 0
        || attr_ll(p, S(_ghost_base), &base) < 0)
        goto done;
    if ((t = attr(p, S(_turnover))) == NULL)
        goto done;
    turnover = PyFloat_AsDouble(t);
    if (turnover == -1.0 && PyErr_Occurred())
        goto done;
    long long first = evictions + 1; /* the first block's eviction number */

    if (PyDict_GET_SIZE(recent)) { /* a block's reuses since the last refresh go with its ghost */
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *reuses = dict_pop(recent, PySequence_Fast_GET_ITEM(blocks, k));
            if (reuses == NULL) {
                if (PyErr_Occurred())
                    goto done;
                continue;
            }
            int truth = PyObject_IsTrue(reuses);
            PyObject *key = truth > 0 ? PyLong_FromLongLong(keys[k]) : NULL;
            int rc = truth > 0 ? (key == NULL ? -1 : PyDict_SetItem(ghost_recent, key, reuses)) : truth;
            Py_XDECREF(key);
            Py_DECREF(reuses);
            if (rc < 0)
                goto done;
        }
    }
    if (n) {
        /* The mean gap between removals, one removal at a time: the first one starts the clock
         * (the fill before it is no gap), the rest of the call leave at the same tick (gap 0). */
        long long gone = n;
        if (evictions) {
            long long gap;
            double scaled;
            if (__builtin_mul_overflow(clock - last, c, &gap)) { /* Python's int, converted once */
                PyObject *a = PyLong_FromLongLong(clock - last), *b = a ? PyLong_FromLongLong(c) : NULL;
                PyObject *product = b ? PyNumber_Multiply(a, b) : NULL;
                Py_XDECREF(a);
                Py_XDECREF(b);
                if (product == NULL)
                    goto done;
                scaled = PyLong_AsDouble(product);
                Py_DECREF(product);
                if (scaled == -1.0 && PyErr_Occurred())
                    goto done;
            } else {
                scaled = (double)gap;
            }
            turnover += (scaled - turnover) / (double)(evictions < c ? evictions : c);
        }
        evictions += 1;
        while (evictions < c && evictions < first + gone - 1) {
            turnover -= turnover / (double)evictions;
            evictions += 1;
        }
        for (long long k = first + gone - 1 - evictions; k > 0; k--)
            turnover -= turnover / (double)c;
        evictions = first + gone - 1;
        last = clock;
    }
    /* The ghosts, appended in order (each one's index is its eviction number less _ghost_base): a block's
     * class and counters outlive it, under its key. */
    const unsigned char *classes = (const unsigned char *)cls.buf.buf, *uses_of = (const unsigned char *)uses.buf.buf;
    const int64_t *lasts = (const int64_t *)last_of.buf.buf;
    if ((packed = PyBytes_FromStringAndSize(NULL, n * (Py_ssize_t)sizeof(int64_t))) == NULL)
        goto done;
    int64_t *packed_last = (int64_t *)PyBytes_AS_STRING(packed);
    for (Py_ssize_t k = 0; k < n; k++)
        packed_last[k] = lasts[ids[k]];
    unsigned char *to;
    if ((to = grow_bytearray(g_cls, n)) == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < n; k++)
        to[k] = classes[ids[k]];
    if ((to = grow_bytearray(g_uses, n)) == NULL)
        goto done;
    for (Py_ssize_t k = 0; k < n; k++)
        to[k] = uses_of[ids[k]];
    PyObject *appended = PyObject_CallMethodOneArg(g_last, S(frombytes), packed);
    if (appended == NULL)
        goto done;
    Py_DECREF(appended);
    memcpy(packed_last, keys, (size_t)n * sizeof(int64_t));
    if ((appended = PyObject_CallMethodOneArg(g_key, S(frombytes), packed)) == NULL)
        goto done;
    Py_DECREF(appended);
    if ((to = grow_bytearray(g_live, n)) == NULL)
        goto done;
    memset(to, 1, (size_t)n);
    /* Each key now names its newest ghost: an older live ghost of the same key (two hashes that share it)
     * dies. */
    if (view_attr(p, S(_ghost_live), &live, 1) < 0)
        goto done;
    unsigned char *alive = (unsigned char *)live.buf.buf;
    Py_ssize_t ghosts = items(&live);
    GhostMap *map = (GhostMap *)ghost_at;
    for (Py_ssize_t k = 0; k < n && k < AHEAD; k++)
        gm_prefetch(map, keys[k]);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (k + AHEAD < n)
            gm_prefetch(map, keys[k + AHEAD]);
        int64_t old;
        int replaced = gm_put(map, keys[k], first + k, &old);
        if (replaced < 0)
            goto done;
        if (replaced && old - base >= 0 && old - base < ghosts)
            alive[old - base] = 0;
    }
    if (set_attr_ll(p, S(_tracked), tracked - n) < 0 || set_attr_ll(p, S(_evictions), evictions) < 0
        || set_attr_double(p, S(_turnover), turnover) < 0 || set_attr_ll(p, S(_last_removal), last) < 0)
        goto done;
    result = Py_NewRef(Py_None);
done:
    release(&cls);
    release(&uses);
    release(&last_of);
    release(&key_of);
    release(&live);
    PyMem_Free(ids);
    PyMem_Free(keys);
    Py_XDECREF(blocks);
    Py_XDECREF(recent);
    Py_XDECREF(ghost_recent);
    Py_XDECREF(ghost_at);
    Py_XDECREF(g_key);
    Py_XDECREF(g_cls);
    Py_XDECREF(g_uses);
    Py_XDECREF(g_last);
    Py_XDECREF(g_live);
    Py_XDECREF(packed);
    Py_XDECREF(t);
    return result;
}

static PyObject *
forget_ghosts(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("forget_ghosts", nargs, 3) < 0)
        return NULL;
    PyObject *p = args[0], *ghost_at = NULL, *ghost_recent = NULL, *result = NULL;
    View live = {0}, g_cls = {0}, g_last = {0}, g_key = {0};
    Histogram ends;
    memset(&ends, 0, sizeof ends);
    long long clock;
    Py_ssize_t lo = PyLong_AsSsize_t(args[1]), hi = lo == -1 && PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[2]);
    int compiled_map = hi == -1 && PyErr_Occurred() ? 0 : ghost_map_is_compiled(p);
    if (compiled_map <= 0) { /* no int bounds, or a map of another type: the reference */
        if (compiled_map < 0)
            return NULL;
        PyErr_Clear();
        return run_reference(REFERENCE, "forget_ghosts", args, nargs);
    }
    if ((ghost_at = attr(p, S(_ghost_at))) == NULL || (ghost_recent = attr(p, S(_ghost_recent))) == NULL
        || attr_ll(p, S(_clock), &clock) < 0)
        goto done;
    if (!PyObject_TypeCheck(ghost_at, &GhostMapType) || !PyDict_Check(ghost_recent)) {
        PyErr_SetString(PyExc_TypeError, "forget_ghosts: the policy's ghost maps have other types");
        goto done;
    }
    if (view_attr(p, S(_ghost_live), &live, 1) < 0 || view_attr(p, S(_ghost_cls), &g_cls, 1) < 0
        || view_attr(p, S(_ghost_last), &g_last, 8) < 0 || view_attr(p, S(_ghost_key), &g_key, 8) < 0)
        goto done;
    Py_ssize_t size = items(&live);
    if (lo < 0 || lo > hi || hi > size || items(&g_cls) != size || items(&g_last) != size || items(&g_key) != size) {
        release(&live); /* a range the slices would clip, or arrays of other lengths */
        release(&g_cls);
        release(&g_last);
        release(&g_key);
        result = run_reference(REFERENCE, "forget_ghosts", args, nargs);
        goto done;
    }
    unsigned char *alive = (unsigned char *)live.buf.buf;
    const unsigned char *cls = (const unsigned char *)g_cls.buf.buf;
    const int64_t *lasts = (const int64_t *)g_last.buf.buf, *keys = (const int64_t *)g_key.buf.buf;
    if (open_histogram(p, S(_ends), &ends) < 0)
        goto done;
    GhostMap *map = (GhostMap *)ghost_at;
    for (Py_ssize_t g = lo; g < hi && g < lo + AHEAD; g++)
        if (alive[g])
            gm_prefetch(map, keys[g]);
    int recents = PyDict_GET_SIZE(ghost_recent) > 0;
    for (Py_ssize_t g = lo; g < hi; g++) { /* the live ones: forgotten unreused, censored at their ages */
        if (g + AHEAD < hi && alive[g + AHEAD])
            gm_prefetch(map, keys[g + AHEAD]);
        if (!alive[g])
            continue;
        alive[g] = 0;
        int64_t at;
        if (!gm_pop(map, keys[g], &at)) {
            PyObject *key = PyLong_FromLongLong(keys[g]);
            if (key != NULL)
                PyErr_SetObject(PyExc_KeyError, key);
            Py_XDECREF(key);
            goto done;
        }
        if (recents) {
            PyObject *key = PyLong_FromLongLong(keys[g]);
            PyObject *reuses = key ? dict_pop(ghost_recent, key) : NULL;
            Py_XDECREF(key);
            if (reuses == NULL && PyErr_Occurred())
                goto done;
            Py_XDECREF(reuses);
        }
        if (record(&ends, cls[g], (long long)((uint64_t)clock - (uint64_t)lasts[g])) < 0)
            goto done;
    }
    result = Py_NewRef(Py_None);
done:
    close_histogram(&ends);
    release(&live);
    release(&g_cls);
    release(&g_last);
    release(&g_key);
    Py_XDECREF(ghost_at);
    Py_XDECREF(ghost_recent);
    return result;
}

static PyMethodDef methods[] = {
    {"book_inserts", (PyCFunction)(void (*)(void))book_inserts, METH_FASTCALL,
     "book_inserts(policy, blocks, hashes, parents, parent_blocks, had_children, mark, start, class_of) -> int: "
     "booking.book_inserts, compiled."},
    {"book_accesses", (PyCFunction)(void (*)(void))book_accesses, METH_FASTCALL,
     "book_accesses(policy, blocks, start, class_of) -> int: booking.book_accesses, compiled."},
    {"book_marks", (PyCFunction)(void (*)(void))book_marks, METH_FASTCALL,
     "book_marks(policy, blocks, mark) -> None: booking.book_marks, compiled."},
    {"book_pins", (PyCFunction)(void (*)(void))book_pins, METH_FASTCALL,
     "book_pins(policy, blocks, mark) -> int: booking.book_pins, compiled."},
    {"book_removals", (PyCFunction)(void (*)(void))book_removals, METH_FASTCALL,
     "book_removals(policy, blocks, c) -> None: booking.book_removals, compiled."},
    {"forget_ghosts", (PyCFunction)(void (*)(void))forget_ghosts, METH_FASTCALL,
     "forget_ghosts(policy, lo, hi) -> None: booking.forget_ghosts, compiled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_booking", "The hit-density policy's per-block bookkeeping loops, compiled (see booking.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__booking(void)
{
#define INTERN(name)                                                                                               \
    if ((S(name) = PyUnicode_InternFromString(#name)) == NULL)                                                     \
        return NULL;
    NAMES(INTERN)
    if (PyType_Ready(&GhostMapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL || PyModule_AddObjectRef(m, "GhostMap", (PyObject *)&GhostMapType) < 0
        || PyModule_AddObjectRef(m, "ghost_map", (PyObject *)&GhostMapType) < 0) {
        Py_XDECREF(m);
        return NULL;
    }
    return m;
}
