//! Where an intent stands: the `intents.status` column.

use crate::outcome::OutcomeStatus;

/// Where an intent stands. `pending` and `running` are the relay's own; the others are what
/// outcome events report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IntentStatus {
    /// Recorded, waiting for a claim.
    Pending,
    /// Claimed: a relay holds its lease and may be calling.
    Running,
    /// Parked until a person approves or denies it.
    PendingApproval,
    Succeeded,
    Failed,
    /// Parked: the effect may or may not have happened, and verification could not tell.
    Unknown,
    Rejected,
}

impl IntentStatus {
    pub const ALL: [IntentStatus; 7] = [
        IntentStatus::Pending,
        IntentStatus::Running,
        IntentStatus::PendingApproval,
        IntentStatus::Succeeded,
        IntentStatus::Failed,
        IntentStatus::Unknown,
        IntentStatus::Rejected,
    ];

    /// The statuses that wait for a person, as the `idem_parked` gauge counts them.
    pub const PARKED: [IntentStatus; 2] = [IntentStatus::Unknown, IntentStatus::PendingApproval];

    pub fn as_str(self) -> &'static str {
        match self {
            IntentStatus::Pending => "pending",
            IntentStatus::Running => "running",
            IntentStatus::PendingApproval => "pending_approval",
            IntentStatus::Succeeded => "succeeded",
            IntentStatus::Failed => "failed",
            IntentStatus::Unknown => "unknown",
            IntentStatus::Rejected => "rejected",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        IntentStatus::ALL.into_iter().find(|x| x.as_str() == s)
    }

    /// The status outcome events report, for the statuses they report.
    pub fn reported(self) -> Option<OutcomeStatus> {
        match self {
            IntentStatus::Pending | IntentStatus::Running => None,
            IntentStatus::PendingApproval => Some(OutcomeStatus::PendingApproval),
            IntentStatus::Succeeded => Some(OutcomeStatus::Succeeded),
            IntentStatus::Failed => Some(OutcomeStatus::Failed),
            IntentStatus::Unknown => Some(OutcomeStatus::Unknown),
            IntentStatus::Rejected => Some(OutcomeStatus::Rejected),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_status_reads_back_and_reports_under_its_own_name() {
        let names: Vec<&str> = IntentStatus::ALL.iter().map(|s| s.as_str()).collect();
        let back: Vec<IntentStatus> = names
            .iter()
            .filter_map(|n| IntentStatus::parse(n))
            .collect();
        assert_eq!(back, IntentStatus::ALL);
        // Reported statuses keep their name on the wire; the relay's own two have none.
        let unreported: Vec<&str> = IntentStatus::ALL
            .into_iter()
            .filter(|s| s.reported().map(OutcomeStatus::as_str) != Some(s.as_str()))
            .map(IntentStatus::as_str)
            .collect();
        assert_eq!(unreported, ["pending", "running"]);
        assert_eq!(IntentStatus::parse("changing"), None);
    }
}
