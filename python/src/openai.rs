//! The OpenAI images API of `klein serve`, for Python hosts (the Ray Serve deployment): the same
//! request schema and checks ([`klein::api::openai`]), and the same answer.
use klein::api::openai::{self, EditForm, OpenAiRequest};
use klein::api::{FieldError, Output};
use klein::pipeline::SpecError;
use klein::KleinError;
use pyo3::prelude::*;

use crate::errors::{named, to_py_err};
use crate::{lock, PyPipeline};

/// A checked request of `POST /v1/images/generations` or `POST /v1/images/edits`.
#[pyclass(name = "OpenAiRequest", module = "klein_runtime", frozen)]
pub(crate) struct PyOpenAiRequest {
    inner: OpenAiRequest,
}

/// A refused request as `klein.InvalidInputError`, its `param` the request's field.
fn field_err(py: Python<'_>, error: FieldError) -> PyErr {
    let raised = to_py_err(py, &KleinError::request(error.message.clone()));
    // The message as klein serve answers it (without "invalid request: ").
    let raised = match raised.value(py).setattr("args", (error.message,)) {
        Ok(()) => raised,
        Err(failed) => return failed,
    };
    match error.param {
        Some(param) => named(py, raised, &param),
        None => raised,
    }
}

#[pymethods]
impl PyOpenAiRequest {
    /// The JSON body of `POST /v1/images/generations`, checked.
    #[staticmethod]
    fn generations(py: Python<'_>, body: &[u8]) -> PyResult<Self> {
        let inner = openai::generations(body).map_err(|e| field_err(py, e))?;
        Ok(PyOpenAiRequest { inner })
    }

    /// The multipart form of `POST /v1/images/edits` as `(field name, file name or None, bytes)`
    /// parts in order (text fields as UTF-8 bytes), checked.
    #[staticmethod]
    fn edits(py: Python<'_>, parts: Vec<(String, Option<String>, Vec<u8>)>) -> PyResult<Self> {
        let mut form = EditForm::default();
        for (name, file_name, bytes) in parts {
            form.add_part(&name, file_name.as_deref(), bytes)
                .map_err(|e| field_err(py, e))?;
        }
        let inner = form.finish().map_err(|e| field_err(py, e))?;
        Ok(PyOpenAiRequest { inner })
    }

    /// The LoRAs the request names (the host resolves them).
    #[getter]
    fn loras(&self) -> Vec<String> {
        self.inner.loras.clone()
    }
}

/// Why a generation of a request failed.
enum Failure {
    Spec(SpecError),
    Klein(KleinError),
}

/// Runs `request` on `pipe` with the GIL released: the answer's JSON, as `klein serve` answers.
pub(crate) fn answer(
    pipe: &PyPipeline,
    py: Python<'_>,
    request: &PyOpenAiRequest,
) -> PyResult<String> {
    let OpenAiRequest { job, loras, notes } = request.inner.clone();
    if !loras.is_empty() {
        return Err(field_err(
            py,
            FieldError::new(
                "loras",
                "this deployment applies the LoRAs it was started with (its loras setting); \
                 per-request LoRAs are klein serve's (--lora-dir)",
            ),
        ));
    }
    let made = py.detach(|| -> Result<Output, Failure> {
        let mut locked = pipe.locked().map_err(Failure::Klein)?;
        let pipeline = &mut *locked;
        let run = (|| {
            let request = pipeline.prepare(&job.request).map_err(Failure::Spec)?;
            let generation = pipeline.generate(&request, None).map_err(Failure::Klein)?;
            let hash = pipeline.bundle_sha256().map_err(Failure::Klein)?;
            job.output(pipeline, &generation, &hash, None)
                .map_err(Failure::Klein)
        })();
        *lock(&pipe.device_used) = pipeline.device_name();
        run
    });
    let error = match made {
        Ok(output) => return Ok(openai::answer(&output, notes).to_string()),
        Err(Failure::Spec(error)) => error,
        Err(Failure::Klein(error)) => SpecError::from(error),
    };
    let (param, message) = job.error_of(&error);
    let raised = match message {
        Some(message) => field_err(py, FieldError::body(message)),
        None => to_py_err(py, &error.error),
    };
    Err(match param {
        Some(param) => named(py, raised, &param),
        None => raised,
    })
}
