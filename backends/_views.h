/* Views of the flat per-block arrays (bytearray, array('i'), array('q')) that kvkit's compiled loops
 * read and write through the buffer protocol: one writable, one-dimensional buffer each, held for one call.
 *
 * A View starts zeroed (not held); view() holds it or sets an error; release() lets it go, held or not.
 */
#ifndef KVKIT_VIEWS_H
#define KVKIT_VIEWS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

typedef struct {
    Py_buffer buf;
    int held;
} View;

/* Hold obj's buffer in v: writable, one-dimensional, of itemsize-byte items (else TypeError naming it). */
static inline int
view(PyObject *obj, View *v, Py_ssize_t itemsize, const char *name)
{
    if (PyObject_GetBuffer(obj, &v->buf, PyBUF_WRITABLE | PyBUF_FORMAT) < 0)
        return -1;
    v->held = 1;
    if (v->buf.itemsize != itemsize || v->buf.ndim != 1) {
        PyErr_Format(PyExc_TypeError, "%s holds items of %zd bytes, not %zd", name, v->buf.itemsize, itemsize);
        return -1;
    }
    return 0;
}

/* Hold the buffer of obj's attribute name (an interned str) in v, as view() does, naming it in the error. */
static inline int
view_attr(PyObject *obj, PyObject *name, View *v, Py_ssize_t itemsize)
{
    PyObject *o = PyObject_GetAttr(obj, name);
    if (o == NULL)
        return -1;
    int rc = view(o, v, itemsize, PyUnicode_AsUTF8(name));
    Py_DECREF(o);
    return rc;
}

/* Hold obj's buffer in v if it is a C-contiguous array of ndim dimensions whose items are itemsize bytes of one
 * of the struct type codes in `codes`, in native order (x86-64 and the other little-endian hosts this builds on),
 * writable if asked: 0; else -1 with no error set (a buffer of another kind, or none: the caller declines and
 * its reference runs). */
static inline int
hold_array(PyObject *obj, View *v, int ndim, Py_ssize_t itemsize, const char *codes, int writable)
{
    if (PyObject_GetBuffer(obj, &v->buf, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0)) < 0) {
        PyErr_Clear();
        return -1;
    }
    v->held = 1;
    const char *code = v->buf.format;
    if (code[0] == '@' || code[0] == '=' || code[0] == '<')
        code++;
    if (v->buf.itemsize != itemsize || v->buf.ndim != ndim || strlen(code) != 1 || strchr(codes, code[0]) == NULL)
        return -1;
    return 0;
}

static inline void
release(View *v)
{
    if (v->held) {
        PyBuffer_Release(&v->buf);
        v->held = 0;
    }
}

/* The items the view holds. */
static inline Py_ssize_t
items(const View *v)
{
    return v->buf.len / v->buf.itemsize;
}

#endif
