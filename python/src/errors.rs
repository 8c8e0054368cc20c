//! The Python exceptions of the module (`KleinError`, `InvalidInputError` with its `param`,
//! `CancelledError`) and klein's errors mapped to them.

use klein::error::chain;
use klein::pipeline::{Input, Rule, SpecError};
use klein::KleinError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

/// The exception classes, created when the module is first imported.
pub(crate) struct Exceptions {
    /// `klein.KleinError(Exception)`: every error of klein.
    pub(crate) base: Py<PyType>,
    /// `klein.InvalidInputError(KleinError, ValueError)`: what the caller gave is wrong.
    pub(crate) invalid_input: Py<PyType>,
    /// `klein.CancelledError(KleinError)`: the callback asked to stop.
    pub(crate) cancelled: Py<PyType>,
}

pub(crate) static EXCEPTIONS: PyOnceLock<Exceptions> = PyOnceLock::new();

/// Creates `name` (in module `klein_runtime`) with `bases`; several bases need `type()` itself, which
/// `create_exception!` does not offer.
pub(crate) fn exception_type<'py>(
    py: Python<'py>,
    name: &str,
    bases: Bound<'py, PyTuple>,
    doc: &str,
) -> PyResult<Py<PyType>> {
    let namespace = PyDict::new(py);
    namespace.set_item("__module__", "klein_runtime")?;
    namespace.set_item("__doc__", doc)?;
    // The argument at fault, where the error is one input's (set on the instance); else None.
    namespace.set_item("param", py.None())?;
    let class = py
        .get_type::<PyType>()
        .call1((name, bases, namespace))?
        .cast_into::<PyType>()?;
    Ok(class.unbind())
}

pub(crate) fn create_exceptions(py: Python<'_>) -> PyResult<Exceptions> {
    let exception = py.get_type::<pyo3::exceptions::PyException>();
    let value_error = py.get_type::<pyo3::exceptions::PyValueError>();
    let base = exception_type(
        py,
        "KleinError",
        PyTuple::new(py, [exception])?,
        "An error of klein (the message names the file, field or stage).",
    )?;
    let invalid_input = exception_type(
        py,
        "InvalidInputError",
        PyTuple::new(py, [base.bind(py).clone(), value_error])?,
        "What the caller gave cannot be used: a file, a bundle, a size, a count, an option.",
    )?;
    let cancelled = exception_type(
        py,
        "CancelledError",
        PyTuple::new(py, [base.bind(py).clone()])?,
        "The progress callback returned False.",
    )?;
    Ok(Exceptions {
        base,
        invalid_input,
        cancelled,
    })
}

pub(crate) fn exceptions(py: Python<'_>) -> PyResult<&Exceptions> {
    EXCEPTIONS.get_or_try_init(py, || create_exceptions(py))
}

/// A klein error as the Python exception of its kind, with klein's whole message.
pub(crate) fn to_py_err(py: Python<'_>, error: &KleinError) -> PyErr {
    let classes = match exceptions(py) {
        Ok(classes) => classes,
        Err(failed) => return failed,
    };
    let class = match error {
        KleinError::Cancelled => &classes.cancelled,
        e if e.is_user_error() => &classes.invalid_input,
        _ => &classes.base,
    };
    let raised = PyErr::from_type(class.bind(py).clone(), chain(error));
    match error.param() {
        Some(param) => named(py, raised, param),
        None => raised,
    }
}

/// `error` as [`to_py_err`] makes it, naming `param`, the native argument it comes from (the
/// Python side renames it to its own argument's name).
pub(crate) fn input_err(py: Python<'_>, error: &KleinError, param: &str) -> PyErr {
    named(py, to_py_err(py, error), param)
}

/// `raised` with its `param` attribute set to `param`.
pub(crate) fn named(py: Python<'_>, raised: PyErr, param: &str) -> PyErr {
    match raised.value(py).setattr("param", param) {
        Ok(()) => raised,
        Err(failed) => failed,
    }
}

/// A [`SpecError`] as the Python exception of its kind: the rules between arguments in the
/// native arguments' names, an error about one image naming its argument (`source`, `mask`,
/// `references`) as the exception's `param` (the Python side renames it to its own).
pub(crate) fn spec_err(py: Python<'_>, error: &SpecError) -> PyErr {
    match (error.rule, error.input) {
        (Some(Rule::NeedsSource), _) => to_py_err(
            py,
            &KleinError::request("a mask and a strength need a source image"),
        ),
        (Some(_), _) => to_py_err(
            py,
            &KleinError::request_about(
                "padding_mask_crop",
                "padding_mask_crop needs a mask_image: it crops to the mask's region",
            ),
        ),
        (None, Some(input)) => {
            let param = match input {
                Input::Source => "source",
                Input::Mask => "mask",
                Input::Reference(_) => "references",
            };
            input_err(py, &error.error, param)
        }
        (None, None) => to_py_err(py, &error.error),
    }
}

/// The error a generation ended with: the callback's own exception (or Ctrl-C's
/// `KeyboardInterrupt`) when it stopped the work, else klein's.
pub(crate) enum Failure {
    Klein(KleinError),
    /// klein's error about the request ([`spec_err`]).
    Spec(SpecError),
    Python(PyErr),
}
