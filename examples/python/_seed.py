"""What every example shares: the seed trace's setup, and where things are.

The seed trace: at step 4 the agent sends a refund email and the call times out (the email
went out; the reply was lost). At step 5 the model re-plans and sends it again, reworded. Without
idem the customer gets two emails; with it, one: idem looked downstream after the timeout
(verify) instead of sending again, and answers step 5 from its record.

Runs against `bash deploy/run-local.sh` (the relay with deploy/idem.example.toml and the demo
downstream on 127.0.0.1:8787); the environment can point it elsewhere.
"""

from __future__ import annotations

import json
import os
import urllib.request

DOWNSTREAM = os.environ.get("IDEM_EXAMPLE_DOWNSTREAM", "http://127.0.0.1:8787")
STEP_4 = {"to": "customer-1", "template": "refund_approved", "subject": "Your refund is on its way"}
STEP_5 = {**STEP_4, "subject": "Re: your refund (resent)"}


def lose_the_next_reply() -> None:
    """The demo downstream performs the next call, then never answers it."""
    body = json.dumps({"steps": ["effect_then_timeout"]}).encode()
    req = urllib.request.Request(f"{DOWNSTREAM}/_script", data=body, headers={"content-type": "application/json"})
    urllib.request.urlopen(req, timeout=5).close()


def emails_sent(key_part: str) -> int:
    with urllib.request.urlopen(f"{DOWNSTREAM}/_counts", timeout=5) as r:
        by_key = json.load(r)["by_key"]
    return sum(n for key, n in by_key.items() if key_part in key)
