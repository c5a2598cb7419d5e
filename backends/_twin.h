/* What kvkit's compiled twins share: the Python reference each one runs on a call outside its contract.
 *
 * A compiled function that meets input it does not take (other types, values its contract excludes)
 * changes nothing and hands the whole call to the reference of the same name, which computes, or
 * raises, as the Python does.
 */
#ifndef KVKIT_TWIN_H
#define KVKIT_TWIN_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* module.name(*args), module the reference's dotted name: a new reference, or NULL with its error. */
static inline PyObject *
run_reference(const char *module, const char *name, PyObject *const *args, Py_ssize_t nargs)
{
    PyObject *mod = PyImport_ImportModule(module);
    if (mod == NULL)
        return NULL;
    PyObject *f = PyObject_GetAttrString(mod, name);
    Py_DECREF(mod);
    if (f == NULL)
        return NULL;
    PyObject *result = PyObject_Vectorcall(f, args, (size_t)nargs, NULL);
    Py_DECREF(f);
    return result;
}

#endif
