/* kvobs.sources._columns_native: span rows (dicts) spread into columns, the loop that
 * ``_frame.table_from_rows`` runs over every key of every row (~3.5 us a span in Python,
 * most of the span table's construction, which the live classifier does for every span
 * it takes). The same result as that loop; ``transpose`` answers None for a row that is
 * not a dict, which the Python loop then takes. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* transpose(rows: list, positions: dict[key, int], count: int)
 *   -> list of (rows at, values) per column position, or None
 * A row's value goes to its key's column when the key has a position and the value is
 * not None; ``at`` holds the row's index. */
static PyObject *transpose(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *rows, *positions;
    Py_ssize_t count;
    if (!PyArg_ParseTuple(args, "O!O!n:transpose", &PyList_Type, &rows, &PyDict_Type, &positions,
                          &count))
        return NULL;
    if (count < 0) {
        PyErr_SetString(PyExc_ValueError, "count must not be negative");
        return NULL;
    }
    PyObject *columns = PyList_New(count), *result = NULL;
    if (columns == NULL) return NULL;
    for (Py_ssize_t j = 0; j < count; j++) {
        PyObject *column = Py_BuildValue("(NN)", PyList_New(0), PyList_New(0));
        if (column == NULL) goto done;
        PyList_SET_ITEM(columns, j, column);
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(rows); i++) {
        PyObject *row = PyList_GET_ITEM(rows, i), *key, *value, *index = NULL;
        if (!PyDict_CheckExact(row)) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        Py_INCREF(row); /* a value's __eq__ could change the list */
        Py_ssize_t position = 0;
        int failed = 0;
        while (!failed && PyDict_Next(row, &position, &key, &value)) {
            if (value == Py_None) continue;
            PyObject *slot = PyDict_GetItemWithError(positions, key);
            if (slot == NULL) {
                failed = PyErr_Occurred() != NULL;
                continue;
            }
            Py_ssize_t j = PyLong_AsSsize_t(slot);
            if (j < 0 || j >= count) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_ValueError, "a position outside the columns");
                failed = 1;
                continue;
            }
            if (index == NULL && (index = PyLong_FromSsize_t(i)) == NULL) {
                failed = 1;
                continue;
            }
            PyObject *column = PyList_GET_ITEM(columns, j);
            failed = PyList_Append(PyTuple_GET_ITEM(column, 0), index) < 0 ||
                     PyList_Append(PyTuple_GET_ITEM(column, 1), value) < 0;
        }
        Py_XDECREF(index);
        Py_DECREF(row);
        if (failed) goto done;
    }
    result = Py_NewRef(columns);
done:
    Py_DECREF(columns);
    return result;
}

static PyMethodDef methods[] = {
    {"transpose", transpose, METH_VARARGS,
     "transpose(rows, positions, count) -> [(at, values), ...] | None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_columns_native", "span rows spread into columns (a fast path)", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__columns_native(void) { return PyModule_Create(&module_def); }
