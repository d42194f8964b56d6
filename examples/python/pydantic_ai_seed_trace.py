"""The seed trace with Pydantic AI and a scripted model (no API key needed).

    bash deploy/run-local.sh                           # in another terminal
    pip install -e 'clients/python[pydantic-ai]'
    python examples/python/pydantic_ai_seed_trace.py
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
from pydantic_ai.models.function import FunctionModel

from _seed import STEP_4, STEP_5, emails_sent, lose_the_next_reply
from idem_client import Idem
from idem_client.pydantic_ai import idem_tool


class Email(BaseModel):
    """Send an email to a customer."""

    to: str
    template: str
    subject: str


@dataclass
class Deps:
    run_id: str


def scripted(messages: list, info: Any) -> ModelResponse:
    """Step 4 sends the email; step 5 re-plans and sends it again, reworded; then it answers."""
    sent = sum(isinstance(p, ToolReturnPart) for m in messages for p in getattr(m, "parts", []))
    if sent < 2:
        args = [STEP_4, STEP_5][sent]
        return ModelResponse(parts=[ToolCallPart("send_email", {"args": args}, tool_call_id=f"call_{sent}")])
    return ModelResponse(parts=[TextPart("The customer has been told.")])


def main() -> None:
    deps = Deps(run_id=f"run_{uuid.uuid4().hex[:8]}")
    lose_the_next_reply()
    with Idem.from_env(source="example-pydantic-ai") as idem:
        tool = idem_tool(idem, "send_email", Email, run_id=lambda ctx: ctx.deps.run_id,
                         business_id="order_8812", timeout=120)
        agent = Agent(FunctionModel(scripted), deps_type=Deps, tools=[tool])
        result = agent.run_sync("Tell customer-1 their refund was approved.", deps=deps)
        said = [p.content for m in result.new_messages() for p in m.parts if isinstance(p, ToolReturnPart)]
        for step, text in enumerate(said, 4):
            print(f"step {step}: send_email said: {str(text).splitlines()[0]}")
    print("emails sent:", emails_sent(deps.run_id))


if __name__ == "__main__":
    main()
