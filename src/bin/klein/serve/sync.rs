//! The server's one locking rule, shared by the job queue and the metrics.
use std::sync::{Mutex, MutexGuard, PoisonError};

/// Locks `mutex`, also after a panic elsewhere (the data is counts and flags, always valid).
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}
