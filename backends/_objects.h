/* Python objects as kvkit's compiled loops read and write them: an attribute as a C integer, a dict entry
 * popped, the list or tuple a batch loop takes itself, the count of a call's arguments.
 *
 * Each reports a failure as CPython does: -1 (or NULL) with the Python error set.
 */
#ifndef KVKIT_OBJECTS_H
#define KVKIT_OBJECTS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* 0 if a compiled function named `name` (its signature, or just its name) got the `wanted` arguments; else -1 with
 * the TypeError that says so. */
static inline int
check_args(const char *name, Py_ssize_t nargs, Py_ssize_t wanted)
{
    if (nargs != wanted) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", name, wanted, nargs);
        return -1;
    }
    return 0;
}

/* obj.<name> (an interned str) as a long long in *out. */
static inline int
attr_ll(PyObject *obj, PyObject *name, long long *out)
{
    PyObject *v = PyObject_GetAttr(obj, name);
    if (v == NULL)
        return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* obj.<name> = value, as a Python int. */
static inline int
set_attr_ll(PyObject *obj, PyObject *name, long long value)
{
    PyObject *v = PyLong_FromLongLong(value);
    if (v == NULL)
        return -1;
    int rc = PyObject_SetAttr(obj, name, v);
    Py_DECREF(v);
    return rc;
}

/* dict.pop(key, None): a new reference; NULL with no error when key is absent, NULL with the error when
 * hashing or comparing it raised. */
static inline PyObject *
dict_pop(PyObject *dict, PyObject *key)
{
    PyObject *v = PyDict_GetItemWithError(dict, key);
    if (v == NULL)
        return NULL;
    Py_INCREF(v);
    if (PyDict_DelItem(dict, key) < 0)
        Py_CLEAR(v);
    return v;
}

/* Whether a batch loop walks obj itself: exactly a list or a tuple (another sequence goes to the reference). */
static inline int
is_sequence(PyObject *obj)
{
    return PyList_CheckExact(obj) || PyTuple_CheckExact(obj);
}

#endif
