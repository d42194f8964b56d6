"""The seed trace with LangGraph: the thread id is the run id, so the step the model re-plans
(and a thread resumed from its checkpoint) is answered from idem's record.

    bash deploy/run-local.sh                           # in another terminal
    pip install -e 'clients/python[langgraph]'
    python examples/python/langgraph_seed_trace.py
"""

from __future__ import annotations

import asyncio
import uuid

from langchain_core.messages import AIMessage
from langgraph.graph import END, START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode
from pydantic import BaseModel

from _seed import STEP_4, STEP_5, emails_sent, lose_the_next_reply
from idem_client import Idem
from idem_client.langgraph import idem_tool


class Email(BaseModel):
    """Send an email to a customer."""

    to: str
    template: str
    subject: str


def scripted_model(state: MessagesState) -> dict:
    """Step 4 sends the email; step 5 re-plans and sends it again, reworded; then it answers."""
    sent = sum(1 for m in state["messages"] if m.type == "tool")
    if sent < 2:
        args = [STEP_4, STEP_5][sent]
        call = {"name": "send_email", "args": args, "id": f"call_{sent}", "type": "tool_call"}
        return {"messages": [AIMessage(content="", tool_calls=[call])]}
    return {"messages": [AIMessage(content="The customer has been told.")]}


async def main() -> None:
    thread = f"run_{uuid.uuid4().hex[:8]}"
    lose_the_next_reply()
    with Idem.from_env(source="example-langgraph") as idem:
        tools = ToolNode([idem_tool(idem, "send_email", Email, business_id="order_8812", timeout=120)])
        graph = (
            StateGraph(MessagesState)
            .add_node("model", scripted_model)
            .add_node("tools", tools)
            .add_edge(START, "model")
            .add_conditional_edges("model", lambda s: "tools" if s["messages"][-1].tool_calls else END)
            .add_edge("tools", "model")
            .compile()
        )
        final = await graph.ainvoke(
            {"messages": [("user", "Tell customer-1 their refund was approved.")]},
            {"configurable": {"thread_id": thread}},
        )
        for step, m in enumerate((m for m in final["messages"] if m.type == "tool"), 4):
            print(f"step {step}: send_email said: {str(m.content).splitlines()[0]}")
    print("emails sent:", emails_sent(thread))


if __name__ == "__main__":
    asyncio.run(main())
