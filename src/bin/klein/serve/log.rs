//! The server's log on stderr: a line when it is ready, and one per request (its time, route,
//! status, job id and seconds), as servers are read by operators and log collectors.
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

tokio::task_local! {
    /// The job a request queued (set by `Queue::submit`), for its log line.
    pub(crate) static JOB_ID: Arc<Mutex<Option<String>>>;
}

/// One request's line: `2026-12-07T12:30:05Z POST /v1/images/generations 200 job klein-1f2e 1.234 s`.
pub(crate) fn request_line(
    method: &str,
    route: &str,
    status: u16,
    job: Option<&str>,
    start: Instant,
) -> String {
    format!(
        "klein serve: {} {method} {route} {status} job {} {:.3} s",
        utc_now(),
        job.unwrap_or("-"),
        start.elapsed().as_secs_f64()
    )
}

/// The time now in UTC, RFC 3339 to the second.
pub(crate) fn utc_now() -> String {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rest) = (seconds / 86_400, seconds % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rest / 3600,
        rest % 3600 / 60,
        rest % 60
    )
}

/// The proleptic Gregorian date of `days` since 1970-01-01 (Howard Hinnant's `civil_from_days`).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::civil_from_days;

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_794), (2026, 12, 7));
    }
}
