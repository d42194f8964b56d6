"""Call tools through idem: every action executed once, repeats answered from the record.

    from idem_client import Idem

    with Idem(brokers="127.0.0.1:9092", source="my-agent") as idem:
        out = idem.call("send_email", {"to": "c-1", "template": "refund_approved"},
                        run_id="run_42", business_id="order_8812", step=4)
        print(out.note)   # "Done." or "Already done at …; not repeated. Do not retry."
"""

from ._client import Idem
from ._errors import (
    CallTimeout,
    Failed,
    IdemError,
    OutcomeUnknown,
    PendingApproval,
    Rejected,
)
from ._outcome import Outcome, OutcomeError, Status

__all__ = [
    "CallTimeout",
    "Failed",
    "Idem",
    "IdemError",
    "Outcome",
    "OutcomeError",
    "OutcomeUnknown",
    "PendingApproval",
    "Rejected",
    "Status",
]
