//! The pure rule behind an NCCL join and a settle: what a poll saw, and whether to wait
//! again, stop as done, or abort with the cause (an error, or running past the limit).

use std::time::Duration;

/// What one poll of an outstanding NCCL operation saw.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Seen {
    /// Complete.
    Done,
    /// Still running, no error reported.
    Running,
    /// NCCL or the device reported this error.
    Failed(String),
}

/// What to do after a poll: the pure rule behind joins and settles.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Verdict {
    Done,
    Wait,
    Abort(Stop),
}

/// Why an operation is given up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Stop {
    /// NCCL or the device reported this error.
    Failed(String),
    /// Still running past its limit.
    TimedOut(Duration),
}

impl std::fmt::Display for Stop {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Failed(cause) => f.write_str(cause),
            Self::TimedOut(limit) => write!(
                f,
                "not done within {} s: a rank is lost, stuck or never started",
                limit.as_secs()
            ),
        }
    }
}

pub(super) fn verdict(seen: Seen, waited: Duration, limit: Duration) -> Verdict {
    match seen {
        Seen::Done => Verdict::Done,
        Seen::Failed(cause) => Verdict::Abort(Stop::Failed(cause)),
        Seen::Running if waited >= limit => Verdict::Abort(Stop::TimedOut(limit)),
        Seen::Running => Verdict::Wait,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poll_waits_while_running_and_aborts_on_an_error_or_past_the_limit() {
        let limit = Duration::from_secs(10);
        let early = Duration::from_secs(3);
        assert_eq!(verdict(Seen::Done, early, limit), Verdict::Done);
        // Done wins even past the limit: the work completed.
        assert_eq!(verdict(Seen::Done, limit * 2, limit), Verdict::Done);
        assert_eq!(verdict(Seen::Running, early, limit), Verdict::Wait);
        assert_eq!(
            verdict(Seen::Running, limit, limit),
            Verdict::Abort(Stop::TimedOut(limit))
        );
        assert_eq!(
            Stop::TimedOut(limit).to_string(),
            "not done within 10 s: a rank is lost, stuck or never started"
        );
        assert_eq!(
            verdict(Seen::Failed("remote process exited".into()), early, limit),
            Verdict::Abort(Stop::Failed("remote process exited".into()))
        );
    }
}
