/* The hit-density policy's selection rounds, compiled: selection.py's select_rounds, step for step.
 *
 * selection.py holds the reference and the contract; the tests run both on the same calls and compare
 * what they return, the order of chosen and the policy's whole state. The policy's per-block arrays and
 * the chain index's rings are read through the buffer protocol; chosen stays the caller's dict, and
 * evictable and forget_walk are called as the reference calls them, collect as FlatChains.collect calls it
 * (its set's collect, with the index first: C to C where that is compiled). The orphans are walked from the
 * chain index's orphan queue's list where it has no side list (orphan_list), else by the generator
 * FlatChains.orphans() returns.
 *
 * The heads' keys (density, last access, block, stream) are C values compared in the tuples' order: the
 * model's table is read as the doubles it holds (the reference reads them as floats), checked on entry
 * to hold no NaN, so comparing them as doubles is comparing the floats. A head carries a serial, new each time a stream's head is set: a heap entry whose serial is no
 * longer its stream's is the reference's replaced tuple (stale). Age buckets come from the model's
 * first_ages (bucket(age) >= b exactly when age >= first_ages[b]), so no power is taken. A call whose
 * state is not what the policy keeps (another type, a clock past 64 bits, odd model tables) runs the
 * reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "_objects.h"
#include "_twin.h"
#include "_views.h"

#define REFERENCE "kvkit.backends.eviction.hit_density.selection"

enum { NONE = -1, PARKED = 2 }; /* no block (booking.NONE); a pinned block's mark (FlatChains.PARKED) */

typedef struct {
    double density;
    int64_t last, block;
    Py_ssize_t stream;
    uint64_t serial; /* 0: no head (the reference's None) */
} Key;

/* One call's state. */
typedef struct {
    View where, next, prev, last, cls, first, sibling;
    View table; /* the model's density table, held while the call runs; densities NULL before a refresh */
    const double *densities;
    PyObject *chains, *collect, *chosen, *evictable, *n_obj;
    Py_ssize_t n, streams, top;
    int64_t clock, *ends, *first_ages;
    Key *heads, *heap;
    Py_ssize_t heap_len, heap_cap;
    uint64_t serial;
    int dropped; /* the chain index's kept walk was dropped or replaced in this selection */
} Sel;

/* a's key is below b's: density, then last access, block, stream (the tuples' order). */
static inline int
below(const Key *a, const Key *b)
{
    if (a->density != b->density)
        return a->density < b->density;
    if (a->last != b->last)
        return a->last < b->last;
    if (a->block != b->block)
        return a->block < b->block;
    return a->stream < b->stream;
}

static int
heap_push(Sel *s, const Key *key)
{
    if (s->heap_len == s->heap_cap) {
        Py_ssize_t cap = s->heap_cap ? 2 * s->heap_cap : 64;
        Key *heap = PyMem_Realloc(s->heap, (size_t)cap * sizeof(Key));
        if (heap == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        s->heap = heap;
        s->heap_cap = cap;
    }
    Py_ssize_t i = s->heap_len++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (!below(key, &s->heap[up]))
            break;
        s->heap[i] = s->heap[up];
        i = up;
    }
    s->heap[i] = *key;
    return 0;
}

static void
heap_pop(Sel *s)
{
    Key last = s->heap[--s->heap_len];
    Py_ssize_t i = 0, n = s->heap_len;
    while (2 * i + 1 < n) {
        Py_ssize_t child = 2 * i + 1;
        if (child + 1 < n && below(&s->heap[child + 1], &s->heap[child]))
            child++;
        if (!below(&s->heap[child], &last))
            break;
        s->heap[i] = s->heap[child];
        i = child;
    }
    if (n)
        s->heap[i] = last;
}

/* The heap's entries of replaced heads popped: its least entry is a stream's head, or it is empty. */
static void
drop_stale(Sel *s)
{
    while (s->heap_len && s->heap[0].serial != s->heads[s->heap[0].stream].serial)
        heap_pop(s);
}

/* The slot of index i in a view as Python indexes a sequence (a negative one from the end), or -1 with
 * IndexError. */
static Py_ssize_t
slot(const View *v, int64_t i)
{
    Py_ssize_t size = items(v);
    if (i < 0)
        i += size;
    if (i < 0 || i >= size) {
        PyErr_SetString(PyExc_IndexError,
                        v->buf.itemsize == 1 ? "bytearray index out of range" : "array index out of range");
        return -1;
    }
    return (Py_ssize_t)i;
}

static int
get_u8(const View *v, int64_t i, int64_t *out)
{
    Py_ssize_t k = slot(v, i);
    if (k < 0)
        return -1;
    *out = ((const unsigned char *)v->buf.buf)[k];
    return 0;
}

static int
get_i32(const View *v, int64_t i, int64_t *out)
{
    Py_ssize_t k = slot(v, i);
    if (k < 0)
        return -1;
    *out = ((const int32_t *)v->buf.buf)[k];
    return 0;
}

static int
get_i64(const View *v, int64_t i, int64_t *out)
{
    Py_ssize_t k = slot(v, i);
    if (k < 0)
        return -1;
    *out = ((const int64_t *)v->buf.buf)[k];
    return 0;
}

/* block in chosen: 1, 0, or -1 with an error. */
static int
is_chosen(const Sel *s, int64_t block)
{
    PyObject *b = PyLong_FromLongLong(block);
    if (b == NULL)
        return -1;
    int rc = PyDict_Contains(s->chosen, b);
    Py_DECREF(b);
    return rc;
}

/* evictable(block_obj), as a bool: 1, 0, or -1 with its error. */
static int
ask(const Sel *s, PyObject *block_obj)
{
    PyObject *r = PyObject_CallOneArg(s->evictable, block_obj);
    if (r == NULL)
        return -1;
    int rc = PyObject_IsTrue(r);
    Py_DECREF(r);
    return rc;
}

/* not (block in chosen or not evictable(block)): 1, 0, or -1 with an error. */
static int
usable(const Sel *s, int64_t block)
{
    PyObject *b = PyLong_FromLongLong(block);
    if (b == NULL)
        return -1;
    int rc = PyDict_Contains(s->chosen, b);
    rc = rc < 0 ? -1 : rc ? 0 : ask(s, b);
    Py_DECREF(b);
    return rc;
}

/* chosen[block] = None. */
static int
choose(const Sel *s, int64_t block)
{
    PyObject *b = PyLong_FromLongLong(block);
    if (b == NULL)
        return -1;
    int rc = PyDict_SetItem(s->chosen, b, Py_None);
    Py_DECREF(b);
    return rc;
}

/* chains.forget_walk(), the first time a root is taken alone before any walk. */
static int
drop_walk(Sel *s)
{
    if (s->dropped)
        return 0;
    s->dropped = 1;
    PyObject *r = PyObject_CallMethod(s->chains, "forget_walk", NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return 0;
}

/* chains.collect(root, evictable, chosen, n), called as that method calls it: the chain index's own set's
 * collect (C to C where the index runs the compiled set). A new reference to what it returned, or NULL
 * with its error. */
static PyObject *
walk(Sel *s, PyObject *root)
{
    s->dropped = 1; /* a walk left kept ends the selection */
    PyObject *args[] = {s->chains, root, s->evictable, s->chosen, s->n_obj};
    return PyObject_Vectorcall(s->collect, args, 5, NULL);
}

/* The root has no child to walk: none, or one only child already chosen (with its subtree). 1, 0, -1. */
static int
alone(const Sel *s, int64_t root)
{
    int64_t child, next;
    if (get_i32(&s->first, root, &child) < 0)
        return -1;
    if (child == NONE)
        return 1;
    if (get_i32(&s->sibling, child, &next) < 0)
        return -1;
    return next == child ? is_chosen(s, child) : 0;
}

/* ((clock - last + 1) ** per_octave).bit_length() - 1, capped at top: the largest b <= top with
 * |clock - last + 1| - 1 >= first_ages[b], or -1 where clock - last + 1 is 0. */
static Py_ssize_t
bucket(const Sel *s, int64_t last)
{
    uint64_t size; /* |clock - last + 1|, past every first age where it passes 64 bits */
    if (last <= s->clock) {
        uint64_t age = (uint64_t)s->clock - (uint64_t)last; /* exact: 0 <= clock - last < 2**64 */
        size = age == UINT64_MAX ? age : age + 1;
    }
    else
        size = (uint64_t)last - (uint64_t)s->clock - 1;
    if (size == 0)
        return -1;
    Py_ssize_t lo = 0, hi = s->top; /* first_ages[0] is 0 */
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo + 1) / 2;
        if (size - 1 >= (uint64_t)s->first_ages[mid])
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* table[cls, b], b as Python indexes it (-1: the last bucket); the table holds the numbers the entry
 * checked unless a callback wrote into it, which raises. */
static int
density_at(const Sel *s, int64_t cls, Py_ssize_t b, double *out)
{
    if (cls < 0 || cls >= s->table.buf.shape[0]) {
        PyErr_SetString(PyExc_IndexError, "select_rounds: a class outside the model's table");
        return -1;
    }
    double d = s->densities[cls * (s->top + 1) + (b < 0 ? b + s->top + 1 : b)];
    if (isnan(d)) {
        PyErr_SetString(PyExc_RuntimeError, "select_rounds: the model's table changed during the selection");
        return -1;
    }
    *out = d;
    return 0;
}

/* The density of a class-cls block last accessed at last (model.density at the clock): 0 before the
 * first refresh. */
static int
density_of(const Sel *s, int64_t cls, int64_t last, double *out)
{
    if (s->densities == NULL) {
        *out = 0.0;
        return 0;
    }
    Py_ssize_t b = bucket(s, last);
    return density_at(s, cls, b < s->top ? b : s->top, out);
}

/* Make block (usable) the head of stream. */
static void
set_head(Sel *s, Py_ssize_t stream, int64_t block, int64_t last, double density)
{
    Key *head = &s->heads[stream];
    head->density = density;
    head->last = last;
    head->block = block;
    head->stream = stream;
    head->serial = ++s->serial;
}

/* Walk stream from block to its first usable block and make that its head (none: it ends). 1: a head
 * (to push), 0: none, -1: an error. */
static int
advance(Sel *s, Py_ssize_t stream, int64_t block)
{
    const View *links = stream & 1 ? &s->prev : &s->next;
    while (block != NONE) {
        int rc = usable(s, block);
        if (rc < 0)
            return -1;
        if (rc)
            break;
        if (get_i32(links, block, &block) < 0)
            return -1;
    }
    if (block == NONE) {
        s->heads[stream].serial = 0;
        return 0;
    }
    int64_t last;
    double density;
    if (get_i64(&s->last, block, &last) < 0 || density_of(s, stream >> 1, last, &density) < 0)
        return -1;
    set_head(s, stream, block, last, density);
    return 1;
}

/* The streams a chosen block headed go on past it (the reference's loop over picked, one block). */
static int
move_on(Sel *s, PyObject *block_obj)
{
    Py_ssize_t block = PyNumber_AsSsize_t(block_obj, PyExc_IndexError);
    if (block == -1 && PyErr_Occurred())
        return -1;
    int64_t cls, after;
    if (get_u8(&s->cls, block, &cls) < 0)
        return -1;
    for (int side = 0; side < 2; side++) {
        Py_ssize_t end = 2 * (Py_ssize_t)cls + side;
        if (end >= s->streams) {
            PyErr_SetString(PyExc_IndexError, "list index out of range");
            return -1;
        }
        Key *head = &s->heads[end];
        if (!head->serial || head->block != block)
            continue;
        int rc;
        if (get_i32(side ? &s->prev : &s->next, block, &after) < 0 || (rc = advance(s, end, after)) < 0)
            return -1;
        if (rc && heap_push(s, &s->heads[end]) < 0)
            return -1;
    }
    return 0;
}

/* The run of stream after its root (taken alone, heading its stream only; twin_block: the other end's
 * head, NONE if none): its next usable blocks are roots in turn while they may be, the first that may
 * not heads the stream (the reference's run, in the same order). */
static int
run(Sel *s, Py_ssize_t stream, int64_t root, int64_t twin_block)
{
    heap_pop(s);
    drop_stale(s);
    int has_rival = s->heap_len > 0; /* the least other head */
    Key rival = has_rival ? s->heap[0] : s->heads[stream];
    int64_t block, last, child, next;
    const View *links = stream & 1 ? &s->prev : &s->next;
    /* The age bucket of the last density read: last accesses in (lo, hi]; before the first refresh
     * (every density 0) all of them. */
    double density = 0.0;
    int64_t lo = -1, hi = s->densities == NULL ? (int64_t)PY_SSIZE_T_MAX : -1;
    if (get_i32(links, root, &block) < 0)
        return -1;
    for (;;) {
        if (block == NONE) {
            s->heads[stream].serial = 0;
            return 0;
        }
        int rc = usable(s, block);
        if (rc < 0)
            return -1;
        if (!rc) {
            if (get_i32(links, block, &block) < 0)
                return -1;
            continue;
        }
        if (get_i64(&s->last, block, &last) < 0)
            return -1;
        if (!(lo < last && last <= hi)) {
            if (s->densities == NULL) {
                PyErr_SetNone(PyExc_AssertionError);
                return -1;
            }
            Py_ssize_t b = bucket(s, last);
            if (b < s->top) {
                if (density_at(s, stream >> 1, b, &density) < 0)
                    return -1;
                lo = s->clock - s->first_ages[b + 1];
                hi = s->clock - s->first_ages[b < 0 ? b + s->top + 1 : b];
            }
            else {
                if (density_at(s, stream >> 1, s->top, &density) < 0)
                    return -1;
                lo = -1;
                hi = s->clock - s->first_ages[s->top];
            }
        }
        Key key = {density, last, block, stream, 0};
        if (PyDict_GET_SIZE(s->chosen) < s->n && block != twin_block && (!has_rival || below(&key, &rival))) {
            if (get_i32(&s->first, block, &child) < 0)
                return -1;
            rc = 0;
            if (child == NONE)
                rc = 1;
            else if (get_i32(&s->sibling, child, &next) < 0 || (next == child && (rc = is_chosen(s, child)) < 0))
                return -1;
            if (rc) {
                if (choose(s, block) < 0 || get_i32(links, block, &block) < 0)
                    return -1;
                continue;
            }
        }
        set_head(s, stream, block, last, density);
        return heap_push(s, &s->heads[stream]);
    }
}

/* An exact int within low..limit: 1 with *out, 0 if not (no error). */
static int
small_int(PyObject *v, int64_t low, int64_t limit, int64_t *out)
{
    if (!PyLong_CheckExact(v))
        return 0;
    int overflow;
    long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow || x < low || x > limit)
        return 0;
    *out = x;
    return 1;
}

/* One orphan of the walk: the next root where usable (the reference's loop body). 1 once n are chosen, 0 if
 * not, -1. */
static int
orphan(Sel *s, PyObject *root)
{
    int rc = PyDict_Contains(s->chosen, root);
    if (rc != 0)
        return rc < 0 ? -1 : 0;
    int64_t mark = 0;
    Py_ssize_t block = PyNumber_AsSsize_t(root, PyExc_IndexError);
    if ((block == -1 && PyErr_Occurred()) || get_u8(&s->where, block, &mark) < 0)
        return -1;
    if (mark == PARKED || (rc = ask(s, root)) <= 0)
        return rc;
    if ((rc = alone(s, block)) > 0)
        rc = drop_walk(s) < 0 || PyDict_SetItem(s->chosen, root, Py_None) < 0 ? -1 : 1;
    else if (rc == 0) {
        PyObject *picked = walk(s, root);
        rc = picked == NULL ? -1 : 1;
        Py_XDECREF(picked);
    }
    return rc < 0 ? -1 : PyDict_GET_SIZE(s->chosen) >= s->n;
}

/* The orphan queue's walk read from its slots: where it has no side list, FlatChains.orphans() walks
 * (ParkingQueue._walk with any_block) its list from its head, the block pending linked first (queue._flush(),
 * as the walk's first step calls it), each next link read after the block before it is done. 1 once n are
 * chosen, 0 if not, 2 where the queue has a side list (the generator walks it), -1. */
static int
orphan_list(Sel *s, PyObject *queue)
{
    PyObject *back = NULL, *pending = NULL, *head = NULL, *slots = NULL, *next = NULL;
    View links = {0};
    int rc = -1;
    if ((back = PyObject_GetAttrString(queue, "_back")) == NULL || (rc = PyObject_IsTrue(back)) != 0) {
        rc = rc > 0 ? 2 : -1;
        goto done;
    }
    rc = -1;
    if ((pending = PyObject_GetAttrString(queue, "_pending")) == NULL)
        goto done;
    int64_t unlinked;
    PyObject *r = small_int(pending, NONE, NONE, &unlinked) ? Py_NewRef(Py_None) : PyObject_CallMethod(queue, "_flush", NULL);
    if (r == NULL)
        goto done;
    Py_DECREF(r);
    int64_t block;
    if ((head = PyObject_GetAttrString(queue, "_head")) == NULL)
        goto done;
    if (!small_int(head, NONE, INT64_MAX, &block)) { /* no block id: the generator, which raises as it does */
        rc = 2;
        goto done;
    }
    if ((slots = PyObject_GetAttrString(queue, "_slots")) == NULL
        || (next = PyObject_GetAttrString(slots, "next")) == NULL || view(next, &links, 4, "the orphans' links") < 0)
        goto done;
    rc = 0;
    while (rc == 0 && block != NONE) {
        PyObject *root = PyLong_FromLongLong(block);
        rc = root == NULL ? -1 : orphan(s, root);
        Py_XDECREF(root);
        if (rc == 0 && get_i32(&links, block, &block) < 0)
            rc = -1;
    }
done:
    release(&links);
    Py_XDECREF(back);
    Py_XDECREF(pending);
    Py_XDECREF(head);
    Py_XDECREF(slots);
    Py_XDECREF(next);
    return rc;
}

/* The orphans, in their order, each usable one the next root: 1 once n are chosen, 0 if not, -1. Where the
 * chain index has orphans (FlatChains.orphans() is not None), their list is read here (orphan_list), else
 * their walk's generator runs. */
static int
orphans(Sel *s)
{
    PyObject *queue = PyObject_GetAttrString(s->chains, "_orphans");
    if (queue == NULL)
        return -1;
    Py_ssize_t count = PyObject_Length(queue);
    int rc = count < 0 ? -1 : count == 0 ? 0 : orphan_list(s, queue);
    Py_DECREF(queue);
    if (rc != 2)
        return rc;
    PyObject *orphan_walk = PyObject_CallMethod(s->chains, "orphans", NULL);
    if (orphan_walk == NULL)
        return -1;
    if (orphan_walk == Py_None) {
        Py_DECREF(orphan_walk);
        return 0;
    }
    PyObject *it = PyObject_GetIter(orphan_walk);
    Py_DECREF(orphan_walk);
    if (it == NULL)
        return -1;
    PyObject *root;
    rc = 0;
    while (rc == 0 && (root = PyIter_Next(it)) != NULL) {
        rc = orphan(s, root);
        Py_DECREF(root);
    }
    Py_DECREF(it);
    return rc < 0 || PyErr_Occurred() ? -1 : rc;
}

/* The rounds over the streams: 1 once n are chosen, 0 when the streams run out first, -1. */
static int
streams(Sel *s, int verified)
{
    for (Py_ssize_t stream = 0; stream < s->streams; stream++) {
        int64_t block = s->ends[stream], last;
        int rc = 0;
        if (verified && block != NONE && (rc = is_chosen(s, block)) == 0) {
            double density;
            if (get_i64(&s->last, block, &last) < 0 || density_of(s, stream >> 1, last, &density) < 0)
                return -1;
            set_head(s, stream, block, last, density);
            rc = 1;
        }
        else if (rc < 0 || (rc = advance(s, stream, block)) < 0)
            return -1;
        if (rc && heap_push(s, &s->heads[stream]) < 0)
            return -1;
    }
    while (PyDict_GET_SIZE(s->chosen) < s->n) {
        drop_stale(s);
        if (!s->heap_len)
            return 0;
        int64_t root = s->heap[0].block;
        Py_ssize_t stream = s->heap[0].stream;
        PyObject *root_obj = PyLong_FromLongLong(root), *picked = NULL;
        if (root_obj == NULL)
            return -1;
        int rc = alone(s, root);
        if (rc == 0) {
            picked = walk(s, root_obj);
            rc = picked == NULL ? -1 : 0;
        }
        else if (rc > 0) { /* the root alone, as in the orphans' loop */
            const Key *twin = &s->heads[stream ^ 1]; /* the other end of the root's class list */
            if (drop_walk(s) < 0 || choose(s, root) < 0)
                rc = -1;
            else if (twin->serial && twin->block == root)
                rc = move_on(s, root_obj);
            else
                rc = run(s, stream, root, twin->serial ? twin->block : NONE);
        }
        Py_DECREF(root_obj);
        if (rc < 0)
            return -1;
        if (picked == NULL)
            continue;
        PyObject *it = PyObject_GetIter(picked), *block;
        Py_DECREF(picked);
        if (it == NULL)
            return -1;
        while ((block = PyIter_Next(it)) != NULL) { /* the streams they headed go on past them */
            rc = move_on(s, block);
            Py_DECREF(block);
            if (rc < 0)
                break;
        }
        Py_DECREF(it);
        if (PyErr_Occurred())
            return -1;
    }
    return 1;
}

static int
view_of(PyObject *obj, const char *name, View *v, Py_ssize_t itemsize)
{
    PyObject *o = PyObject_GetAttrString(obj, name);
    if (o == NULL)
        return -1;
    int rc = view(o, v, itemsize, name);
    Py_DECREF(o);
    return rc;
}

/* The model's tables as the compiled rounds take them: table None or a C-contiguous float64 array of
 * top + 1 columns and a row per class at least, no NaN in those rows; first_ages a tuple of top + 1
 * rising ints from 0. 1 if so (read into s), 0 if not, -1 with an error. */
static int
open_model(PyObject *p, Sel *s)
{
    PyObject *model = PyObject_GetAttrString(p, "_model"), *buckets = NULL, *first_ages = NULL, *table = NULL;
    int ok = -1;
    if (model == NULL || (table = PyObject_GetAttrString(model, "table")) == NULL
        || (buckets = PyObject_GetAttrString(model, "buckets")) == NULL
        || (first_ages = PyObject_GetAttrString(model, "first_ages")) == NULL)
        goto done;
    ok = 0;
    int64_t size;
    if (!small_int(buckets, 1, INT32_MAX, &size) || !PyTuple_CheckExact(first_ages)
        || PyTuple_GET_SIZE(first_ages) != size)
        goto done;
    s->top = (Py_ssize_t)size - 1;
    if ((s->first_ages = PyMem_Malloc((size_t)size * sizeof(int64_t))) == NULL) {
        PyErr_NoMemory();
        ok = -1;
        goto done;
    }
    for (Py_ssize_t b = 0; b < size; b++)
        if (!small_int(PyTuple_GET_ITEM(first_ages, b), b ? s->first_ages[b - 1] : 0, b ? INT64_MAX / 4 : 0,
                       &s->first_ages[b]))
            goto done;
    if (table != Py_None) {
        if (PyObject_GetBuffer(table, &s->table.buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
            PyErr_Clear();  /* not an array: the reference reads it */
            goto done;
        }
        s->table.held = 1;
        const char *format = s->table.buf.format;
        if (format[0] == '@' || format[0] == '=' || format[0] == '<')
            format++;  /* native float64 (x86-64 and the other little-endian hosts this builds on) */
        Py_ssize_t classes = (s->streams + 1) / 2;
        if (s->table.buf.itemsize != (Py_ssize_t)sizeof(double) || strcmp(format, "d") != 0
            || s->table.buf.ndim != 2 || s->table.buf.shape[0] < classes || s->table.buf.shape[1] != size)
            goto done;
        const double *densities = s->table.buf.buf;
        for (Py_ssize_t i = 0; i < classes * size; i++)
            if (isnan(densities[i]))
                goto done;
        s->densities = densities;
    }
    ok = 1;
done:
    Py_XDECREF(model);
    Py_XDECREF(table);
    Py_XDECREF(buckets);
    Py_XDECREF(first_ages);
    return ok;
}

/* The policy's state: 1 if read into s, 0 if it is not what the compiled rounds take, -1 with an error. */
static int
open_state(PyObject *p, Sel *s)
{
    PyObject *ends = NULL, *clock = NULL, *first = NULL, *sibling = NULL, *loops = NULL;
    int ok = -1;
    if (view_of(p, "_where", &s->where, 1) < 0 || view_of(p, "_next", &s->next, 4) < 0
        || view_of(p, "_prev", &s->prev, 4) < 0 || view_of(p, "_last", &s->last, 8) < 0
        || view_of(p, "_cls", &s->cls, 1) < 0 || (s->chains = PyObject_GetAttrString(p, "_chains")) == NULL
        || (loops = PyObject_GetAttrString(s->chains, "_loops")) == NULL
        || (s->collect = PyObject_GetAttrString(loops, "collect")) == NULL
        || (first = PyObject_GetAttrString(s->chains, "child_rings")) == NULL
        || (sibling = PyObject_GetAttrString(s->chains, "sibling_rings")) == NULL
        || view(first, &s->first, 4, "child_rings") < 0 || view(sibling, &s->sibling, 4, "sibling_rings") < 0
        || (clock = PyObject_GetAttrString(p, "_clock")) == NULL || (ends = PyObject_GetAttrString(p, "_ends")) == NULL)
        goto done;
    ok = 0;
    if (!small_int(clock, 0, INT64_MAX, &s->clock) || !PyList_CheckExact(ends))
        goto done;
    s->streams = PyList_GET_SIZE(ends);
    s->ends = PyMem_Malloc((size_t)(s->streams ? s->streams : 1) * sizeof(int64_t));
    s->heads = PyMem_Calloc((size_t)(s->streams ? s->streams : 1), sizeof(Key));
    if (s->ends == NULL || s->heads == NULL) {
        PyErr_NoMemory();
        ok = -1;
        goto done;
    }
    for (Py_ssize_t stream = 0; stream < s->streams; stream++)
        if (!small_int(PyList_GET_ITEM(ends, stream), INT64_MIN, INT64_MAX, &s->ends[stream]))
            goto done;
    ok = open_model(p, s);
done:
    Py_XDECREF(ends);
    Py_XDECREF(clock);
    Py_XDECREF(first);
    Py_XDECREF(sibling);
    Py_XDECREF(loops);
    return ok;
}

static void
close_state(Sel *s)
{
    View *views[] = {&s->where, &s->next, &s->prev, &s->last, &s->cls, &s->first, &s->sibling};
    for (size_t k = 0; k < sizeof views / sizeof views[0]; k++)
        release(views[k]);
    Py_CLEAR(s->chains);
    Py_CLEAR(s->collect);
    release(&s->table);
    PyMem_Free(s->ends);
    PyMem_Free(s->first_ages);
    PyMem_Free(s->heads);
    PyMem_Free(s->heap);
}

static PyObject *
select_rounds(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("select_rounds", nargs, 5) < 0)
        return NULL;
    Sel s;
    memset(&s, 0, sizeof s);
    s.n_obj = args[1];
    s.evictable = args[2];
    s.chosen = args[3];
    int64_t n;
    if (!small_int(s.n_obj, 0, PY_SSIZE_T_MAX, &n) || !PyDict_CheckExact(s.chosen) || !PyBool_Check(args[4]))
        return run_reference(REFERENCE, "select_rounds", args, nargs);
    s.n = (Py_ssize_t)n;
    PyObject *result = NULL;
    int rc = open_state(args[0], &s);
    if (rc == 0) {
        close_state(&s);
        return run_reference(REFERENCE, "select_rounds", args, nargs);
    }
    if (rc > 0 && (rc = orphans(&s)) == 0)
        rc = streams(&s, args[4] == Py_True);
    if (rc > 0)
        result = PySequence_List(s.chosen);
    else if (rc == 0)
        result = Py_NewRef(Py_None);
    close_state(&s);
    return result;
}

static PyMethodDef methods[] = {
    {"select_rounds", (PyCFunction)(void (*)(void))select_rounds, METH_FASTCALL,
     "select_rounds(policy, n, evictable, chosen, verified) -> list | None: selection.select_rounds, compiled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_selection", "The hit-density policy's selection rounds, compiled (see selection.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC
PyInit__selection(void)
{
    return PyModule_Create(&module);
}
