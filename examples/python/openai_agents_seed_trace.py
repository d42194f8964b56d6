"""The seed trace with the OpenAI Agents SDK and a scripted model (no API key needed).

    bash deploy/run-local.sh                           # in another terminal
    pip install -e 'clients/python[openai-agents]'
    python examples/python/openai_agents_seed_trace.py
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from typing import Any

from agents import Agent, RunConfig, Runner
from agents.items import ModelResponse
from agents.models.interface import Model
from agents.usage import Usage
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage, ResponseOutputText
from pydantic import BaseModel

from _seed import STEP_4, STEP_5, emails_sent, lose_the_next_reply
from idem_client import Idem
from idem_client.openai_agents import idem_tool


class Email(BaseModel):
    """Send an email to a customer."""

    to: str
    template: str
    subject: str


class ScriptedModel(Model):
    """Step 4 sends the email; step 5 re-plans and sends it again, reworded; then it answers."""

    async def get_response(self, system_instructions: Any, input: Any, *args: Any, **kwargs: Any) -> ModelResponse:
        done = sum(1 for i in input if isinstance(i, dict) and i.get("type") == "function_call_output")
        if done < 2:
            call = ResponseFunctionToolCall(
                id=f"fc_{done}", call_id=f"call_{done}", type="function_call", name="send_email",
                arguments=json.dumps([STEP_4, STEP_5][done]),
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)
        text = ResponseOutputText(type="output_text", text="The customer has been told.", annotations=[])
        message = ResponseOutputMessage(id="msg", type="message", role="assistant", status="completed", content=[text])
        return ModelResponse(output=[message], usage=Usage(), response_id=None)

    def stream_response(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError


@dataclass
class Run:
    run_id: str


def main() -> None:
    os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")
    run = Run(run_id=f"run_{uuid.uuid4().hex[:8]}")
    lose_the_next_reply()
    with Idem.from_env(source="example-openai-agents") as idem:
        tool = idem_tool(idem, "send_email", Email, run_id=lambda ctx: ctx.context.run_id,
                         business_id="order_8812", timeout=120)
        agent = Agent(name="support", model=ScriptedModel(), tools=[tool])
        result = Runner.run_sync(agent, "Tell customer-1 their refund was approved.", context=run,
                                 run_config=RunConfig(tracing_disabled=True))
        for step, item in enumerate((i for i in result.new_items if i.type == "tool_call_output_item"), 4):
            print(f"step {step}: send_email said: {str(item.output).splitlines()[0]}")
    print("emails sent:", emails_sent(run.run_id))


if __name__ == "__main__":
    main()
