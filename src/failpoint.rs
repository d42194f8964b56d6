//! Named crash points for the crash tests (feature `failpoints`).

/// A named step boundary where crash tests kill the relay: with the `failpoints` feature and
/// `FAILPOINTS=name=return`, the process aborts there, as abruptly as `kill -9`.
macro_rules! crash_point {
    ($name:literal) => {
        fail::fail_point!($name, |_| {
            tracing::error!(failpoint = $name, "failpoint: aborting");
            std::process::abort()
        })
    };
}
pub(crate) use crash_point;
