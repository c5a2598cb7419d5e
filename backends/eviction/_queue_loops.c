/* The parking queue's loops, compiled: ParkingQueue.add, add_many, add_pinned_many, pin_many, unpin_many,
 * remove_many, touch_many and first, step for step.
 *
 * _queue.py holds the references (the methods named *_reference) and the contract; the tests run both on
 * the same calls and compare the whole state. The per-block slots (prev, next: array('i'); stamp:
 * array('q'); state: array('b') or, shared, array('q')) are read through the buffer protocol, the
 * queue's scalars (_len, _head, _tail, _cut, _pending and the slots' clock) are taken at the start and
 * written back before any call of the queue's methods, at the end and on an error. The side list (_SortedKeys)
 * stays a Python object: its chunks and maxima are lists the loops change in place, step for step as its
 * methods would, while the clock is below 2**31 (every key fits a long long; past that, the reference).
 *
 * The loops run the common case of each block at C speed: the queue unwatched (_size 0, where a watched
 * window would move), a block an exact int inside the slots in the part the fast step expects. Any other
 * block runs the reference: for one block (add, add then pin, unpin, remove: the state written back first
 * and taken again after) or, where the reference batches its rest (pin_many, first), for the rest of the
 * call. The blocks (and add_many's flags) are read from a tuple of the caller's (its items outlive any call
 * back). Every index
 * read from the slots is checked: one outside them raises IndexError and writes nothing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "_objects.h"

/* A block's part in its queue (state = base | part) and the end of a list, as in _queue.py. */
enum { ABSENT = 0, MAIN = 1, PARKED = 2, BACK = 3 };
#define NIL (-1)
#define SHIFT 32
#define MASK ((1LL << SHIFT) - 1)
#define STAMP_LIMIT (1LL << 31) /* a clock below it: every side-list key (stamp << 32 | block) fits a long long */

static PyObject *s_slots, *s_prev, *s_next, *s_stamp, *s_state, *s_clock, *s_base, *s_len, *s_head, *s_tail,
    *s_size, *s_edge, *s_cut, *s_pending, *s_back, *s_add, *s_pin, *s_unpin, *s_remove, *s_pin_many_ref,
    *s_first_ref, *s_add_pinned_ref, *s_add_many_ref, *s_unpin_many_ref, *s_remove_many_ref, *s_touch,
    *s_touch_many_ref, *s_chunks, *s_maxes, *s_chunk;

/* One queue for one call: its slots' buffers and its scalars. */
typedef struct {
    PyObject *queue, *slots; /* borrowed queue, slots a new reference */
    Py_buffer prev_b, next_b, stamp_b, state_b;
    int held;  /* the four buffers are held (an entry's: the stamps and states) */
    int entry; /* taken by take_entry: the list's scalars and links are not */
    int32_t *prev, *next;
    int64_t *stamp;
    void *state;
    int wide; /* state items are 8 bytes (shared slots), else 1 */
    Py_ssize_t n;
    long long base, len, head, tail, size, edge, cut, pending, clock;
} Queue;

static long long
state_of(const Queue *q, Py_ssize_t block)
{
    return q->wide ? ((int64_t *)q->state)[block] : ((int8_t *)q->state)[block];
}

static void
set_state(Queue *q, Py_ssize_t block, long long value)
{
    if (q->wide)
        ((int64_t *)q->state)[block] = value;
    else
        ((int8_t *)q->state)[block] = (int8_t)value;
}

static void
release(Queue *q)
{
    if (q->held) {
        if (!q->entry) {
            PyBuffer_Release(&q->prev_b);
            PyBuffer_Release(&q->next_b);
        }
        PyBuffer_Release(&q->stamp_b);
        PyBuffer_Release(&q->state_b);
        q->held = 0;
    }
}

/* One slot array's buffer, its items itemsize (or either of two sizes: itemsize2) bytes long. */
static int
buffer(PyObject *slots, PyObject *name, Py_buffer *b, Py_ssize_t itemsize, Py_ssize_t itemsize2)
{
    PyObject *obj = PyObject_GetAttr(slots, name);
    if (obj == NULL)
        return -1;
    int rc = PyObject_GetBuffer(obj, b, PyBUF_WRITABLE | PyBUF_FORMAT);
    Py_DECREF(obj);
    if (rc < 0)
        return -1;
    if (b->ndim != 1 || (b->itemsize != itemsize && b->itemsize != itemsize2)) {
        PyErr_Format(PyExc_TypeError, "ParkingQueue: slots.%U holds items of %zd bytes", name, b->itemsize);
        PyBuffer_Release(b);
        return -1;
    }
    return 0;
}

/* Takes the queue's state (slots' buffers held). */
static int
take(Queue *q)
{
    q->held = 0;
    if (q->slots == NULL && (q->slots = PyObject_GetAttr(q->queue, s_slots)) == NULL)
        return -1;
    if (attr_ll(q->queue, s_base, &q->base) < 0 || attr_ll(q->queue, s_len, &q->len) < 0
        || attr_ll(q->queue, s_head, &q->head) < 0 || attr_ll(q->queue, s_tail, &q->tail) < 0
        || attr_ll(q->queue, s_size, &q->size) < 0 || attr_ll(q->queue, s_edge, &q->edge) < 0
        || attr_ll(q->queue, s_cut, &q->cut) < 0 || attr_ll(q->queue, s_pending, &q->pending) < 0
        || attr_ll(q->slots, s_clock, &q->clock) < 0)
        return -1;
    if (buffer(q->slots, s_prev, &q->prev_b, 4, 4) < 0)
        return -1;
    if (buffer(q->slots, s_next, &q->next_b, 4, 4) < 0) {
        PyBuffer_Release(&q->prev_b);
        return -1;
    }
    if (buffer(q->slots, s_stamp, &q->stamp_b, 8, 8) < 0) {
        PyBuffer_Release(&q->prev_b);
        PyBuffer_Release(&q->next_b);
        return -1;
    }
    if (buffer(q->slots, s_state, &q->state_b, 1, 8) < 0) {
        PyBuffer_Release(&q->prev_b);
        PyBuffer_Release(&q->next_b);
        PyBuffer_Release(&q->stamp_b);
        return -1;
    }
    q->held = 1;
    q->prev = (int32_t *)q->prev_b.buf;
    q->next = (int32_t *)q->next_b.buf;
    q->stamp = (int64_t *)q->stamp_b.buf;
    q->state = q->state_b.buf;
    q->wide = q->state_b.itemsize == 8;
    q->n = q->state_b.len / q->state_b.itemsize;
    if (q->prev_b.len / 4 != q->n || q->next_b.len / 4 != q->n || q->stamp_b.len / 8 != q->n) {
        release(q);
        PyErr_SetString(PyExc_ValueError, "ParkingQueue: the slot arrays differ in size");
        return -1;
    }
    return 0;
}

/* What ParkingQueue.add reads and writes where no block is pending (it links none): the stamps and states
 * (held), the queue's base, length and window size and the clock. */
static int
take_entry(Queue *q)
{
    q->held = 0;
    q->entry = 1;
    q->pending = NIL;
    if ((q->slots = PyObject_GetAttr(q->queue, s_slots)) == NULL || attr_ll(q->queue, s_base, &q->base) < 0
        || attr_ll(q->queue, s_len, &q->len) < 0 || attr_ll(q->queue, s_size, &q->size) < 0
        || attr_ll(q->slots, s_clock, &q->clock) < 0 || buffer(q->slots, s_stamp, &q->stamp_b, 8, 8) < 0)
        return -1;
    if (buffer(q->slots, s_state, &q->state_b, 1, 8) < 0) {
        PyBuffer_Release(&q->stamp_b);
        return -1;
    }
    q->held = 1;
    q->stamp = (int64_t *)q->stamp_b.buf;
    q->state = q->state_b.buf;
    q->wide = q->state_b.itemsize == 8;
    q->n = q->state_b.len / q->state_b.itemsize;
    if (q->stamp_b.len / 8 != q->n) {
        release(q);
        PyErr_SetString(PyExc_ValueError, "ParkingQueue: the slot arrays differ in size");
        return -1;
    }
    return 0;
}

/* Writes the scalars the loops change back to the queue and releases the buffers. Where a write fails, the
 * state stays held: give_back writes them all again. */
static int
give(Queue *q)
{
    if (q->entry) { /* an add: no link changed */
        if (set_attr_ll(q->queue, s_len, q->len) < 0 || set_attr_ll(q->slots, s_clock, q->clock) < 0
            || (q->pending != NIL && set_attr_ll(q->queue, s_pending, q->pending) < 0))
            return -1;
    }
    else if (set_attr_ll(q->queue, s_len, q->len) < 0 || set_attr_ll(q->queue, s_head, q->head) < 0
             || set_attr_ll(q->queue, s_tail, q->tail) < 0 || set_attr_ll(q->queue, s_cut, q->cut) < 0
             || set_attr_ll(q->queue, s_pending, q->pending) < 0 || set_attr_ll(q->slots, s_clock, q->clock) < 0)
        return -1;
    release(q);
    return 0;
}

/* An index read from the slots: one outside them raises IndexError. */
static int
inside(const Queue *q, long long block)
{
    if (block < 0 || block >= q->n) {
        PyErr_Format(PyExc_IndexError, "ParkingQueue: block %lld is outside 0..%zd", block, q->n - 1);
        return 0;
    }
    return 1;
}

/* ParkingQueue._link: block at the list's young end. */
static int
link_block(Queue *q, long long block)
{
    if (!inside(q, block))
        return -1;
    long long tail = q->tail;
    if (tail != NIL && !inside(q, tail))
        return -1;
    q->prev[block] = (int32_t)tail;
    q->next[block] = NIL;
    if (tail == NIL)
        q->head = block;
    else
        q->next[tail] = (int32_t)block;
    q->tail = block;
    if (q->cut == NIL)
        q->cut = block;
    return 0;
}

/* ParkingQueue._unlink. */
static int
unlink_block(Queue *q, long long block)
{
    long long before = q->prev[block], after = q->next[block];
    if ((before != NIL && !inside(q, before)) || (after != NIL && !inside(q, after)))
        return -1;
    if (before == NIL)
        q->head = after;
    else
        q->next[before] = (int32_t)after;
    if (after == NIL)
        q->tail = before;
    else
        q->prev[after] = (int32_t)before;
    if (block == q->cut)
        q->cut = after;
    return 0;
}

/* ParkingQueue._flush: link the pending block. */
static int
flush(Queue *q)
{
    if (q->pending == NIL)
        return 0;
    long long block = q->pending;
    q->pending = NIL;
    return link_block(q, block);
}

/* The block an item names, where it is an exact int inside the slots; -1 otherwise (no error set). */
static Py_ssize_t
slot_of(const Queue *q, PyObject *item)
{
    if (!PyLong_CheckExact(item))
        return -1;
    int overflow;
    long long block = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow || block < 0 || block >= q->n) {
        PyErr_Clear();
        return -1;
    }
    return (Py_ssize_t)block;
}

/* On an error with the state taken: the scalars changed so far go back to the queue, as the reference's
 * would be there when it raised (the error kept). */
static void
give_back(Queue *q)
{
    if (q->held) {
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (give(q) < 0)
            PyErr_Clear();
        PyErr_Restore(type, value, traceback);
    }
}

/* The end of a loop that took the state: on an error (result NULL) the scalars changed so far go back to the
 * queue (give_back); the buffers and the slots are released; result passes through. */
static PyObject *
finish(Queue *q, PyObject *result)
{
    if (result == NULL)
        give_back(q);
    release(q);
    Py_CLEAR(q->slots);
    return result;
}

/* -- the side list ---------------------------------------------------------------------------------------- */

/* A side list (_SortedKeys) for one call: it, its chunks (lists of keys, ascending) and their maxima (new
 * references), and its chunk size. */
typedef struct {
    PyObject *back, *chunks, *maxes;
    long long half;
} Keys;

static void
keys_release(Keys *k)
{
    Py_CLEAR(k->back);
    Py_CLEAR(k->chunks);
    Py_CLEAR(k->maxes);
}

static int
keys_take(PyObject *back, Keys *k)
{
    k->chunks = k->maxes = NULL;
    k->back = Py_NewRef(back);
    if ((k->chunks = PyObject_GetAttr(back, s_chunks)) == NULL || (k->maxes = PyObject_GetAttr(back, s_maxes)) == NULL
        || attr_ll(back, s_chunk, &k->half) < 0) {
        keys_release(k);
        return -1;
    }
    if (!PyList_CheckExact(k->chunks) || !PyList_CheckExact(k->maxes) || k->half < 1) {
        keys_release(k);
        PyErr_SetString(PyExc_TypeError, "ParkingQueue: the side list's chunks, maxima or chunk size");
        return -1;
    }
    return 0;
}

/* The queue's side list, taken (0), or -1 with an error set. */
static int
keys_of(Queue *q, Keys *k)
{
    PyObject *back = PyObject_GetAttr(q->queue, s_back);
    if (back == NULL)
        return -1;
    int rc = keys_take(back, k);
    Py_DECREF(back);
    return rc;
}

/* list[i] as a long long key (-1 with an error set where it is none). */
static int
key_at(PyObject *list, Py_ssize_t i, long long *out)
{
    PyObject *item = PyList_GET_ITEM(list, i);
    if (!PyLong_CheckExact(item)) {
        PyErr_SetString(PyExc_TypeError, "ParkingQueue: a side-list key is not an int");
        return -1;
    }
    *out = PyLong_AsLongLong(item);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

/* bisect.bisect_left (right: bisect_right) of key in a list of int keys, from lo; -1 with an error set. */
static Py_ssize_t
key_bisect(PyObject *list, long long key, Py_ssize_t lo, int right)
{
    Py_ssize_t hi = PyList_GET_SIZE(list);
    while (lo < hi) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        long long item;
        if (key_at(list, mid, &item) < 0)
            return -1;
        if (right ? key < item : !(item < key))
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* Whether one item more (grow) or less fits list's block as it is: then inserting or deleting it allocates
 * nothing and cannot fail (list_resize keeps a block that the new size fills at least half of). */
static int
fits(PyObject *list, int grow)
{
    Py_ssize_t size = PyList_GET_SIZE(list) + (grow ? 1 : -1), allocated = ((PyListObject *)list)->allocated;
    return allocated >= size && size >= (allocated >> 1);
}

/* A new list: list[:i] + items + list[i + drop:] (items: count new references' worth, borrowed). */
static PyObject *
spliced(PyObject *list, Py_ssize_t i, Py_ssize_t drop, PyObject *const *items, Py_ssize_t count)
{
    Py_ssize_t n = PyList_GET_SIZE(list), size = n - drop + count;
    PyObject *out = PyList_New(size);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t k = 0; k < size; k++) {
        PyObject *item = k < i ? PyList_GET_ITEM(list, k)
            : k < i + count ? items[k - i] : PyList_GET_ITEM(list, k - count + drop);
        PyList_SET_ITEM(out, k, Py_NewRef(item));
    }
    return out;
}

/* The side list takes new chunks and maxima lists (setting a slot allocates nothing). */
static int
keys_swap(Keys *k, PyObject *chunks, PyObject *maxes)
{
    if (PyObject_SetAttr(k->back, s_chunks, chunks) < 0 || PyObject_SetAttr(k->back, s_maxes, maxes) < 0)
        return -1;
    Py_SETREF(k->chunks, Py_NewRef(chunks));
    Py_SETREF(k->maxes, Py_NewRef(maxes));
    return 0;
}

/* Chunk i of the side list replaced by `count` chunks (their maxima beside them): in place where the lists'
 * blocks hold them (nothing to allocate), else new lists swapped in, built first. Either every change is
 * made or none (the new lists are built before any is). */
static int
keys_replace(Keys *k, Py_ssize_t i, PyObject *const *chunks, Py_ssize_t count)
{
    PyObject *tops[2];
    for (Py_ssize_t c = 0; c < count; c++)
        tops[c] = PyList_GET_ITEM(chunks[c], PyList_GET_SIZE(chunks[c]) - 1);
    if (count == 2 && fits(k->chunks, 1) && fits(k->maxes, 1)) {
        PyList_SetItem(k->chunks, i, Py_NewRef(chunks[0]));
        PyList_SetItem(k->maxes, i, Py_NewRef(tops[1]));
        return PyList_Insert(k->chunks, i + 1, chunks[1]) < 0 || PyList_Insert(k->maxes, i, tops[0]) < 0 ? -1 : 0;
    }
    if (count == 0 && fits(k->chunks, 0) && fits(k->maxes, 0))
        return PyList_SetSlice(k->chunks, i, i + 1, NULL) < 0 || PyList_SetSlice(k->maxes, i, i + 1, NULL) < 0
            ? -1 : 0;
    Py_ssize_t drop = i < PyList_GET_SIZE(k->chunks) ? 1 : 0;
    PyObject *new_chunks = spliced(k->chunks, i, drop, chunks, count);
    PyObject *new_maxes = new_chunks == NULL ? NULL : spliced(k->maxes, i, drop, tops, count);
    int rc = new_maxes == NULL ? -1 : keys_swap(k, new_chunks, new_maxes);
    Py_XDECREF(new_chunks);
    Py_XDECREF(new_maxes);
    return rc;
}

/* _SortedKeys.add(key): the same chunks and maxima; all or nothing under a failed allocation. */
static int
keys_add(Keys *k, long long key)
{
    PyObject *chunks = k->chunks, *maxes = k->maxes, *item = PyLong_FromLongLong(key), *parts[2] = {NULL, NULL};
    if (item == NULL)
        return -1;
    int rc = -1;
    Py_ssize_t n = PyList_GET_SIZE(maxes), i = key_bisect(maxes, key, 0, 0), j;
    if (i < 0 || PyList_GET_SIZE(chunks) != n) {
        if (i >= 0)
            PyErr_SetString(PyExc_ValueError, "ParkingQueue: the side list's chunks and maxima differ in number");
        goto done;
    }
    if (n == 0) { /* the first key: one chunk of it */
        if ((parts[0] = PyList_New(1)) == NULL)
            goto done;
        PyList_SET_ITEM(parts[0], 0, Py_NewRef(item));
        rc = keys_replace(k, 0, parts, 1);
        goto done;
    }
    int last = i == n; /* past every maximum: the last chunk's end, and its new maximum */
    if (last)
        i -= 1;
    PyObject *chunk = PyList_GET_ITEM(chunks, i);
    if (!PyList_CheckExact(chunk)) {
        PyErr_SetString(PyExc_TypeError, "ParkingQueue: a side-list chunk is not a list");
        goto done;
    }
    Py_ssize_t size = PyList_GET_SIZE(chunk) + 1;
    if ((j = last ? size - 1 : key_bisect(chunk, key, 0, 1)) < 0)
        goto done;
    if (size <= 2 * k->half) { /* one insertion: all or nothing */
        if (PyList_Insert(chunk, j, item) < 0)
            goto done;
        if (last)
            PyList_SetItem(maxes, i, Py_NewRef(item));
        rc = 0;
        goto done;
    }
    /* past twice the chunk size: the chunk with the key, split in two halves (the upper one after it) */
    PyObject *with = spliced(chunk, j, 0, &item, 1);
    if (with == NULL)
        goto done;
    parts[0] = PyList_GetSlice(with, 0, k->half);
    parts[1] = parts[0] == NULL ? NULL : PyList_GetSlice(with, k->half, size);
    Py_DECREF(with);
    if (parts[1] != NULL)
        rc = keys_replace(k, i, parts, 2);
done:
    Py_XDECREF(parts[0]);
    Py_XDECREF(parts[1]);
    Py_DECREF(item);
    return rc;
}

/* _SortedKeys.remove(key): the same chunks and maxima; all or nothing under a failed allocation. */
static int
keys_remove(Keys *k, long long key)
{
    PyObject *chunks = k->chunks, *maxes = k->maxes;
    Py_ssize_t i = key_bisect(maxes, key, 0, 0), j;
    if (i < 0)
        return -1;
    PyObject *chunk = i < PyList_GET_SIZE(chunks) ? PyList_GET_ITEM(chunks, i) : NULL;
    long long found = key + 1;
    if (chunk == NULL || !PyList_CheckExact(chunk) || (j = key_bisect(chunk, key, 0, 0)) < 0
        || (j < PyList_GET_SIZE(chunk) && key_at(chunk, j, &found) < 0) || found != key) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_AssertionError, "side-list key %lld is not listed", key);
        return -1;
    }
    Py_ssize_t left = PyList_GET_SIZE(chunk) - 1;
    if (!left) /* its last key: the chunk and its maximum leave */
        return keys_replace(k, i, NULL, 0);
    if (PyList_SetSlice(chunk, j, j + 1, NULL) < 0) /* one deletion: all or nothing */
        return -1;
    if (j == left)
        PyList_SetItem(maxes, i, Py_NewRef(PyList_GET_ITEM(chunk, left - 1)));
    return 0;
}

/* queue.<name>(arg), its result dropped: the state given back before and taken again after. */
static int
per_block(Queue *q, PyObject *name, PyObject *arg)
{
    if (give(q) < 0)
        return -1;
    PyObject *argv[2] = {q->queue, arg};
    PyObject *r = PyObject_VectorcallMethod(name, argv, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return take(q);
}

/* queue.<name>(arg, arg2), as per_block. */
static int
per_block2(Queue *q, PyObject *name, PyObject *arg, PyObject *arg2)
{
    if (give(q) < 0)
        return -1;
    PyObject *argv[3] = {q->queue, arg, arg2};
    PyObject *r = PyObject_VectorcallMethod(name, argv, 3 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
    if (r == NULL)
        return -1;
    Py_DECREF(r);
    return take(q);
}

/* queue.<name>(*args): the reference for the whole call, the queue untaken (a new reference). */
static PyObject *
reference(PyObject *queue, PyObject *name, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *argv[4] = {queue, NULL, NULL, NULL};
    for (Py_ssize_t i = 0; i < nargs && i < 3; i++)
        argv[i + 1] = args[i];
    return PyObject_VectorcallMethod(name, argv, (size_t)(nargs + 1) | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* A batch loop's arguments (queue, blocks): 0 where the loop runs them; else 1 and *answer what the call returns
 * (NULL with a wrong count refused, or the reference's result for blocks in neither a list nor a tuple). */
static int
batch_args(const char *name, PyObject *ref, PyObject *const *args, Py_ssize_t nargs, PyObject **answer)
{
    if (check_args(name, nargs, 2) < 0) {
        *answer = NULL;
        return 1;
    }
    if (!is_sequence(args[1])) {
        *answer = reference(args[0], ref, args + 1, 1);
        return 1;
    }
    return 0;
}

/* ParkingQueue.add_pinned_many_reference: add then pin each block. */
static PyObject *
add_pinned_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    PyObject *answer;
    if (batch_args("add_pinned_many", s_add_pinned_ref, args, nargs, &answer))
        return answer;
    Queue q = {.queue = args[0]};
    PyObject *blocks = NULL, *result = NULL;
    if (take(&q) < 0)
        goto done;
    if (q.size != 0) { /* watched: each add and pin may move the window */
        release(&q);
        result = reference(args[0], s_add_pinned_ref, args + 1, 1);
        goto done;
    }
    if ((blocks = PySequence_Tuple(args[1])) == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(blocks, i);
        Py_ssize_t block = slot_of(&q, item);
        if (block < 0 || state_of(&q, block) != ABSENT) { /* grown, refused or no id: the reference */
            if (per_block(&q, s_add, item) < 0 || per_block(&q, s_pin, item) < 0)
                goto done;
            continue;
        }
        if (flush(&q) < 0) /* add: the previous block was left pending; pin: this one is never linked */
            goto done;
        q.clock += 1;
        q.stamp[block] = q.clock;
        q.len += 1;
        set_state(&q, block, q.base | PARKED);
    }
    if (give(&q) == 0)
        result = Py_NewRef(Py_None);
done:
    result = finish(&q, result);
    Py_XDECREF(blocks);
    return result;
}

/* A block absent from the slots enters: the block pending is linked first, then it is stamped and parked
 * (pinned: Py_True) or, unpinned, left pending (the next call that needs the list links it). */
static int
enter(Queue *q, Py_ssize_t block, PyObject *pinned)
{
    if (flush(q) < 0)
        return -1;
    q->clock += 1;
    q->stamp[block] = q->clock;
    q->len += 1;
    if (pinned == Py_True)
        set_state(q, block, q->base | PARKED);
    else {
        set_state(q, block, q->base | MAIN);
        q->pending = block;
    }
    return 0;
}

/* ParkingQueue.add (its Python body is the reference): a block absent from the slots is stamped after the
 * block pending is linked, then parked or, unpinned on an unwatched queue, left pending (the next call that
 * needs the list links it); any other call (a block tracked, negative or past the slots, pinned other than
 * a bool, an unpinned block where a window is watched) runs the reference. With no block pending, only
 * what the entry changes is taken (take_entry). */
static PyObject *
add(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (nargs != 2 && check_args("add", nargs, 3) < 0)
        return NULL;
    PyObject *pinned = nargs == 3 ? args[2] : Py_False;
    if (!PyBool_Check(pinned))
        return reference(args[0], s_add, args + 1, nargs - 1);
    Queue q = {.queue = args[0]};
    PyObject *result = NULL;
    long long pending;
    if (attr_ll(q.queue, s_pending, &pending) < 0 || (pending == NIL ? take_entry(&q) : take(&q)) < 0)
        goto done;
    Py_ssize_t block = slot_of(&q, args[1]);
    if (block < 0 || state_of(&q, block) != ABSENT || (q.size != 0 && pinned == Py_False)) {
        release(&q);
        result = reference(args[0], s_add, args + 1, nargs - 1);
        goto done;
    }
    if (enter(&q, block, pinned) < 0) /* the block pending linked (none: taken as an entry) */
        goto done;
    if (give(&q) == 0)
        result = Py_NewRef(Py_None);
done:
    result = finish(&q, result);
    return result;
}

/* ParkingQueue.add_many_reference: add each block with its flag, the state taken once. A block absent from
 * the slots with a bool flag is stamped after the block pending is linked, then parked or, unpinned on an
 * unwatched queue, left pending (the next block links it), as add does; any other block (tracked, negative or
 * past the slots, its flag other than a bool, unpinned where a window is watched) runs the reference's add.
 * The blocks and flags are paired in order, to the shorter's end. */
static PyObject *
add_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("add_many", nargs, 3) < 0)
        return NULL;
    if (!is_sequence(args[1]) || !is_sequence(args[2]))
        return reference(args[0], s_add_many_ref, args + 1, 2);
    Queue q = {.queue = args[0]};
    PyObject *blocks = NULL, *flags = NULL, *result = NULL;
    if ((blocks = PySequence_Tuple(args[1])) == NULL || (flags = PySequence_Tuple(args[2])) == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(blocks);
    if (PyTuple_GET_SIZE(flags) < n)
        n = PyTuple_GET_SIZE(flags);
    if (n == 0) {
        result = Py_NewRef(Py_None);
        goto done;
    }
    if (take(&q) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(blocks, i), *pinned = PyTuple_GET_ITEM(flags, i);
        Py_ssize_t block = PyBool_Check(pinned) ? slot_of(&q, item) : -1;
        if (block < 0 || state_of(&q, block) != ABSENT || (q.size != 0 && pinned == Py_False)) {
            if (per_block2(&q, s_add, item, pinned) < 0)
                goto done;
            continue;
        }
        if (enter(&q, block, pinned) < 0) /* the block pending: the previous unpinned one, linked */
            goto done;
    }
    if (give(&q) == 0)
        result = Py_NewRef(Py_None);
done:
    result = finish(&q, result);
    Py_XDECREF(blocks);
    Py_XDECREF(flags);
    return result;
}

/* ParkingQueue.pin_many_reference, unwatched: a listed block is unlinked, one in the side list leaves it (one
 * key at a time leaves the chunks the reference's batch leaves); from the first other one, the reference runs
 * the rest. */
static PyObject *
pin_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    PyObject *answer;
    if (batch_args("pin_many", s_pin_many_ref, args, nargs, &answer))
        return answer;
    Queue q = {.queue = args[0]};
    Keys keys = {0};
    PyObject *blocks = NULL, *rest = NULL, *result = NULL;
    if (take(&q) < 0)
        goto done;
    if ((blocks = PySequence_Tuple(args[1])) == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(blocks), start = 0;
    if (q.size != 0 || (n && q.pending != NIL && !PyLong_CheckExact(PyTuple_GET_ITEM(blocks, 0)))) {
        release(&q);
        result = reference(args[0], s_pin_many_ref, args + 1, 1);
        goto done;
    }
    if (n && q.pending != NIL) { /* only a first block can still be the unlinked youngest */
        Py_ssize_t first = slot_of(&q, PyTuple_GET_ITEM(blocks, 0));
        if (first >= 0 && first == q.pending) {
            q.pending = NIL;
            set_state(&q, first, q.base | PARKED);
            start = 1;
        }
        else if (flush(&q) < 0)
            goto done;
    }
    for (Py_ssize_t i = start; i < n; i++) {
        Py_ssize_t block = slot_of(&q, PyTuple_GET_ITEM(blocks, i));
        long long state = block < 0 ? ABSENT : state_of(&q, block);
        if (state == (q.base | BACK) && q.clock < STAMP_LIMIT) { /* it leaves the side list */
            if ((keys.chunks == NULL && keys_of(&q, &keys) < 0)
                || keys_remove(&keys, q.stamp[block] << SHIFT | block) < 0)
                goto done;
            set_state(&q, block, q.base | PARKED);
            continue;
        }
        if (state != (q.base | MAIN)) {
            if (give(&q) < 0 || (rest = PyTuple_GetSlice(blocks, i, n)) == NULL)
                goto done;
            result = reference(args[0], s_pin_many_ref, &rest, 1);
            goto done;
        }
        if (unlink_block(&q, block) < 0)
            goto done;
        set_state(&q, block, q.base | PARKED);
    }
    if (give(&q) == 0)
        result = Py_NewRef(Py_None);
done:
    result = finish(&q, result);
    Py_XDECREF(blocks);
    keys_release(&keys);
    Py_XDECREF(rest);
    return result;
}

/* ParkingQueue.unpin_many_reference, unwatched: a parked block past the edge goes back to the list's end
 * (the youngest) or into the side list; any other block runs the reference's unpin. */
static PyObject *
unpin_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    PyObject *answer;
    if (batch_args("unpin_many", s_unpin_many_ref, args, nargs, &answer))
        return answer;
    Queue q = {.queue = args[0]};
    Keys keys = {0};
    PyObject *blocks = NULL, *result = NULL;
    if (take(&q) < 0)
        goto done;
    if (q.size != 0) { /* watched: a release may move the window */
        release(&q);
        result = reference(args[0], s_unpin_many_ref, args + 1, 1);
        goto done;
    }
    if ((blocks = PySequence_Tuple(args[1])) == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(blocks);
    if (n && flush(&q) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(blocks, i);
        Py_ssize_t block = slot_of(&q, item);
        long long stamp = block < 0 ? 0 : q.stamp[block];
        if (block < 0 || state_of(&q, block) != (q.base | PARKED) || stamp <= q.edge || q.clock >= STAMP_LIMIT) {
            keys_release(&keys); /* the reference may change the side list */
            if (per_block(&q, s_unpin, item) < 0)
                goto done;
            continue;
        }
        if (q.tail != NIL && !inside(&q, q.tail))
            goto done;
        if (q.tail == NIL || stamp > q.stamp[q.tail]) { /* the youngest unpinned block */
            set_state(&q, block, q.base | MAIN);
            if (link_block(&q, block) < 0)
                goto done;
            continue;
        }
        /* released out of order: the side list (its key first: a failed allocation leaves the block parked) */
        if ((keys.chunks == NULL && keys_of(&q, &keys) < 0) || keys_add(&keys, stamp << SHIFT | block) < 0)
            goto done;
        set_state(&q, block, q.base | BACK);
    }
    if (give(&q) == 0)
        result = Py_NewRef(Py_None);
done:
    result = finish(&q, result);
    keys_release(&keys);
    Py_XDECREF(blocks);
    return result;
}

/* ParkingQueue.touch_many_reference: a parked block takes the next stamp, a listed one past the edge (outside any
 * watched window) moves to the list's young end with it; any other block runs the reference's touch. */
static PyObject *
touch_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    PyObject *answer;
    if (batch_args("touch_many", s_touch_many_ref, args, nargs, &answer))
        return answer;
    Queue q = {.queue = args[0]};
    PyObject *blocks = NULL, *result = NULL;
    if (take(&q) < 0 || (blocks = PySequence_Tuple(args[1])) == NULL)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(blocks, i);
        if (flush(&q) < 0) /* each touch links the pending block first */
            goto done;
        Py_ssize_t block = slot_of(&q, item);
        long long state = block < 0 ? -1 : state_of(&q, block);
        if (state == (q.base | PARKED)) {
            q.stamp[block] = ++q.clock;
            continue;
        }
        if (state == (q.base | MAIN) && q.stamp[block] > q.edge) {
            if (unlink_block(&q, block) < 0)
                goto done;
            q.stamp[block] = ++q.clock;
            if (link_block(&q, block) < 0)
                goto done;
            continue;
        }
        if (per_block(&q, s_touch, item) < 0)
            goto done;
    }
    if (give(&q) == 0)
        result = Py_NewRef(Py_None);
done:
    result = finish(&q, result);
    Py_XDECREF(blocks);
    return result;
}

/* ParkingQueue.remove_many_reference: a listed block past the edge is unlinked, one in the side list past the
 * edge leaves it, a parked one is dropped; any other block runs the reference's remove. */
static PyObject *
remove_many(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    PyObject *answer;
    if (batch_args("remove_many", s_remove_many_ref, args, nargs, &answer))
        return answer;
    Queue q = {.queue = args[0]};
    Keys keys = {0};
    PyObject *blocks = NULL, *result = NULL;
    if (take(&q) < 0 || (blocks = PySequence_Tuple(args[1])) == NULL || flush(&q) < 0)
        goto done;
    Py_ssize_t n = PyTuple_GET_SIZE(blocks);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PyTuple_GET_ITEM(blocks, i);
        Py_ssize_t block = slot_of(&q, item);
        long long state = block < 0 ? ABSENT : state_of(&q, block);
        if (state == (q.base | PARKED)) { /* ParkingQueue.remove's parked block */
            set_state(&q, block, ABSENT);
            q.len -= 1;
            continue;
        }
        long long stamp = block < 0 ? 0 : q.stamp[block];
        if (state == (q.base | BACK) && stamp > q.edge && q.clock < STAMP_LIMIT) {
            if ((keys.chunks == NULL && keys_of(&q, &keys) < 0) || keys_remove(&keys, stamp << SHIFT | block) < 0)
                goto done;
            set_state(&q, block, ABSENT);
            q.len -= 1;
            continue;
        }
        if (block < 0 || state != (q.base | MAIN) || stamp <= q.edge) {
            keys_release(&keys); /* the reference may change the side list */
            if (per_block(&q, s_remove, item) < 0)
                goto done;
            continue;
        }
        if (unlink_block(&q, block) < 0)
            goto done;
        set_state(&q, block, ABSENT);
        q.len -= 1;
    }
    if (give(&q) == 0)
        result = Py_NewRef(Py_None);
done:
    result = finish(&q, result);
    keys_release(&keys);
    Py_XDECREF(blocks);
    return result;
}

/* is_evictable(block), as a truth value (-1: it raised). */
static int
ask(PyObject *is_evictable, long long block)
{
    PyObject *b = PyLong_FromLongLong(block);
    if (b == NULL)
        return -1;
    PyObject *r = PyObject_CallOneArg(is_evictable, b);
    Py_DECREF(b);
    if (r == NULL)
        return -1;
    int truth = PyObject_IsTrue(r);
    Py_DECREF(r);
    return truth;
}

/* block appended to result where is_evictable(block) is true: 1 (appended), 0 (not), -1 (an error). */
static int
choose(PyObject *is_evictable, long long block, PyObject *result)
{
    int yes = ask(is_evictable, block);
    if (yes <= 0)
        return yes;
    PyObject *b = PyLong_FromLongLong(block);
    if (b == NULL || PyList_Append(result, b) < 0) {
        Py_XDECREF(b);
        return -1;
    }
    Py_DECREF(b);
    return 1;
}

/* ParkingQueue._walk's first `want` blocks where the side list holds some: the list and the side list merged
 * by stamp, each block asked in that order, none asked once `want` are chosen (islice stops the walk). */
static PyObject *
merged(Queue *q, PyObject *back, long long want, PyObject *is_evictable)
{
    Keys keys;
    if (keys_take(back, &keys) < 0)
        return NULL;
    PyObject *result = PyList_New(0);
    Py_ssize_t c = 0, j = 0; /* the next key: chunk c, item j */
    long long key = 0, block = q->head;
    int have = 0; /* key holds the next key */
    if (result == NULL)
        goto fail;
    for (;;) {
        while (!have && c < PyList_GET_SIZE(keys.chunks)) {
            PyObject *chunk = PyList_GET_ITEM(keys.chunks, c);
            if (!PyList_CheckExact(chunk)) {
                PyErr_SetString(PyExc_TypeError, "ParkingQueue: a side-list chunk is not a list");
                goto fail;
            }
            if (j < PyList_GET_SIZE(chunk)) {
                if (key_at(chunk, j++, &key) < 0)
                    goto fail;
                have = 1;
            }
            else {
                c += 1;
                j = 0;
            }
        }
        if (block != NIL && !inside(q, block))
            goto fail;
        long long next;
        if (have && (block == NIL || key < q->stamp[block] << SHIFT)) { /* the side list's block comes first */
            next = key & MASK;
            have = 0;
        }
        else if (block != NIL) {
            next = block;
            block = q->next[block];
        }
        else
            break;
        int yes = choose(is_evictable, next, result);
        if (yes < 0)
            goto fail;
        if (yes && PyList_GET_SIZE(result) >= want)
            break;
    }
    keys_release(&keys);
    return result;
fail:
    keys_release(&keys);
    Py_XDECREF(result);
    return NULL;
}

/* ParkingQueue.first_reference: without a side list, the list's first n blocks when all are evictable, else the
 * list's evictable blocks, asked again from its head, until n; with one, the merged walk's first n. */
static PyObject *
first(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    (void)module;
    if (check_args("first", nargs, 3) < 0)
        return NULL;
    PyObject *is_evictable = args[2];
    if (!PyLong_CheckExact(args[1]))
        return reference(args[0], s_first_ref, args + 1, 2);
    int overflow;
    long long want = PyLong_AsLongLongAndOverflow(args[1], &overflow);
    if (overflow || (want == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return reference(args[0], s_first_ref, args + 1, 2);
    }
    if (want <= 0)
        return PyList_New(0);
    Queue q = {.queue = args[0]};
    PyObject *back = NULL, *head = NULL, *result = NULL;
    if (take(&q) < 0)
        goto done;
    if (q.pending != NIL && (flush(&q) < 0 || give(&q) < 0 || take(&q) < 0))
        goto done;
    if ((back = PyObject_GetAttr(q.queue, s_back)) == NULL)
        goto done;
    int some = PyObject_IsTrue(back);
    if (some < 0)
        goto done;
    if (some) { /* blocks released out of order: merged with the list */
        if (q.clock >= STAMP_LIMIT) {
            release(&q);
            result = reference(args[0], s_first_ref, args + 1, 2);
        }
        else
            result = merged(&q, back, want, is_evictable);
        goto done;
    }
    if ((head = PyList_New(0)) == NULL)
        goto done;
    int all = 1;
    long long block = q.head;
    while (block != NIL && PyList_GET_SIZE(head) < want) {
        if (!inside(&q, block))
            goto done;
        PyObject *b = PyLong_FromLongLong(block);
        if (b == NULL)
            goto done;
        int rc = PyList_Append(head, b);
        Py_DECREF(b);
        if (rc < 0)
            goto done;
        block = q.next[block];
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(head) && all; i++) {
        PyObject *r = PyObject_CallOneArg(is_evictable, PyList_GET_ITEM(head, i));
        if (r == NULL)
            goto done;
        all = PyObject_IsTrue(r);
        Py_DECREF(r);
        if (all < 0)
            goto done;
    }
    if (all) {
        result = head;
        head = NULL;
        goto done;
    }
    if ((result = PyList_New(0)) == NULL) /* the walk: the list's evictable blocks, oldest first */
        goto done;
    for (block = q.head; block != NIL && PyList_GET_SIZE(result) < want; block = q.next[block]) {
        if (!inside(&q, block))
            goto fail;
        if (choose(is_evictable, block, result) < 0)
            goto fail;
    }
    goto done;
fail:
    Py_CLEAR(result);
done:
    result = finish(&q, result);
    Py_XDECREF(back);
    Py_XDECREF(head);
    return result;
}

static PyMethodDef methods[] = {
    {"add_pinned_many", (PyCFunction)(void (*)(void))add_pinned_many, METH_FASTCALL,
     "add_pinned_many(queue, blocks): ParkingQueue.add_pinned_many_reference, compiled."},
    {"add", (PyCFunction)(void (*)(void))add, METH_FASTCALL,
     "add(queue, block, pinned=False): ParkingQueue.add, compiled."},
    {"add_many", (PyCFunction)(void (*)(void))add_many, METH_FASTCALL,
     "add_many(queue, blocks, pinned): ParkingQueue.add_many_reference, compiled."},
    {"pin_many", (PyCFunction)(void (*)(void))pin_many, METH_FASTCALL,
     "pin_many(queue, blocks): ParkingQueue.pin_many_reference, compiled."},
    {"unpin_many", (PyCFunction)(void (*)(void))unpin_many, METH_FASTCALL,
     "unpin_many(queue, blocks): ParkingQueue.unpin_many_reference, compiled."},
    {"remove_many", (PyCFunction)(void (*)(void))remove_many, METH_FASTCALL,
     "remove_many(queue, blocks): ParkingQueue.remove_many_reference, compiled."},
    {"touch_many", (PyCFunction)(void (*)(void))touch_many, METH_FASTCALL,
     "touch_many(queue, blocks): ParkingQueue.touch_many_reference, compiled."},
    {"first", (PyCFunction)(void (*)(void))first, METH_FASTCALL,
     "first(queue, n, is_evictable) -> blocks: ParkingQueue.first_reference, compiled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_queue_loops", "The parking queue's batch loops, compiled (see _queue.py).",
    -1, methods, NULL, NULL, NULL, NULL,
};

static int
intern(PyObject **name, const char *text)
{
    return (*name = PyUnicode_InternFromString(text)) == NULL ? -1 : 0;
}

PyMODINIT_FUNC
PyInit__queue_loops(void)
{
    if (intern(&s_slots, "_slots") < 0 || intern(&s_prev, "prev") < 0 || intern(&s_next, "next") < 0
        || intern(&s_stamp, "stamp") < 0 || intern(&s_state, "state") < 0 || intern(&s_clock, "clock") < 0
        || intern(&s_base, "_base") < 0 || intern(&s_len, "_len") < 0 || intern(&s_head, "_head") < 0
        || intern(&s_tail, "_tail") < 0 || intern(&s_size, "_size") < 0 || intern(&s_edge, "_edge") < 0
        || intern(&s_cut, "_cut") < 0 || intern(&s_pending, "_pending") < 0 || intern(&s_back, "_back") < 0
        || intern(&s_add, "add") < 0 || intern(&s_pin, "pin") < 0 || intern(&s_unpin, "unpin") < 0
        || intern(&s_remove, "remove") < 0 || intern(&s_pin_many_ref, "pin_many_reference") < 0
        || intern(&s_first_ref, "first_reference") < 0 || intern(&s_add_pinned_ref, "add_pinned_many_reference") < 0
        || intern(&s_add_many_ref, "add_many_reference") < 0
        || intern(&s_unpin_many_ref, "unpin_many_reference") < 0
        || intern(&s_remove_many_ref, "remove_many_reference") < 0 || intern(&s_touch, "touch") < 0
        || intern(&s_touch_many_ref, "touch_many_reference") < 0 || intern(&s_chunks, "_chunks") < 0
        || intern(&s_maxes, "_maxes") < 0 || intern(&s_chunk, "chunk") < 0)
        return NULL;
    return PyModule_Create(&module);
}
