"""Each adapter driven by its framework's own runner, with a scripted model (no LLM), against
the real relay: a tool run twice across a simulated crash and resume is one effect."""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Any

from langchain_core.runnables import RunnableConfig
from langgraph.graph import MessagesState
from pydantic import BaseModel

from stack import Stack
from idem_client import Idem

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")


class EmailArgs(BaseModel):
    """Send one email to a customer."""

    to: str
    template: str
    subject: str = ""


EMAIL = {"to": "customer-1", "template": "refund_approved", "subject": "Your refund"}


# ------------------------------------------------------------------------ OpenAI Agents SDK


def test_openai_agents_a_rerun_of_the_agent_executes_nothing_again(
    stack: Stack, idem: Idem, run_id: str
) -> None:
    from agents import Agent, RunConfig, Runner
    from agents.items import ModelResponse, ToolCallOutputItem
    from agents.models.interface import Model
    from agents.usage import Usage
    from openai.types.responses import (
        ResponseFunctionToolCall,
        ResponseOutputMessage,
        ResponseOutputText,
    )

    from idem_client.openai_agents import idem_tool

    class Scripted(Model):
        """Calls send_email once, then answers."""

        async def get_response(self, system_instructions, input, *args: Any, **kwargs: Any) -> ModelResponse:
            items = input if isinstance(input, list) else []
            if any(isinstance(i, dict) and i.get("type") == "function_call_output" for i in items):
                text = ResponseOutputText(type="output_text", text="done", annotations=[])
                message = ResponseOutputMessage(
                    id="msg_1", type="message", role="assistant", status="completed", content=[text]
                )
                return ModelResponse(output=[message], usage=Usage(), response_id=None)
            call = ResponseFunctionToolCall(
                id="fc_1", call_id="call_1", type="function_call", name="send_email",
                arguments=json.dumps(EMAIL),
            )
            return ModelResponse(output=[call], usage=Usage(), response_id=None)

        def stream_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

    @dataclass
    class Run:
        run_id: str

    tool = idem_tool(
        idem, "send_email", EmailArgs,
        run_id=lambda ctx: ctx.context.run_id, business_id="order_oa",
    )
    agent = Agent(name="support", model=Scripted(), tools=[tool])

    def tool_output() -> str:
        result = Runner.run_sync(
            agent, "send the refund email", context=Run(run_id),
            run_config=RunConfig(tracing_disabled=True),
        )
        outputs = [i.output for i in result.new_items if isinstance(i, ToolCallOutputItem)]
        assert len(outputs) == 1, result.new_items
        return str(outputs[0])

    first = tool_output()
    # The process "crashed" and the run is resumed from the start, same run id.
    second = tool_output()
    assert "not repeated" not in first
    assert "not repeated" in second and "Do not retry" in second
    assert stack.effects(f"{run_id}:send_email:order_oa") == 1


# -------------------------------------------------------------------------------- LangGraph


def test_langgraph_a_resumed_thread_executes_nothing_again(
    stack: Stack, idem: Idem, run_id: str
) -> None:
    from langchain_core.messages import ToolMessage
    from langgraph.checkpoint.memory import InMemorySaver
    from langgraph.graph import END, START, StateGraph

    from idem_client.langgraph import idem_tool

    send_email = idem_tool(idem, "send_email", EmailArgs, business_id="order_lg")
    crashes = {"left": 1}

    async def act(state: MessagesState, config: RunnableConfig) -> dict:
        said = await send_email.ainvoke(EMAIL, config)
        if crashes["left"]:
            crashes["left"] -= 1
            raise RuntimeError("the worker died after the email went out")
        return {"messages": [ToolMessage(content=said, tool_call_id="call_1")]}

    graph = (
        StateGraph(MessagesState)
        .add_node("act", act)
        .add_edge(START, "act")
        .add_edge("act", END)
        .compile(checkpointer=InMemorySaver())
    )
    config = {"configurable": {"thread_id": run_id}}

    async def crash_then_resume() -> str:
        try:
            await graph.ainvoke({"messages": [("user", "send the refund email")]}, config)
            raise AssertionError("the first run was to crash")
        except RuntimeError:
            pass
        # Resumed from the checkpoint before `act`: the node runs again.
        final = await graph.ainvoke(None, config)
        return final["messages"][-1].content

    said = asyncio.run(crash_then_resume())
    assert "not repeated" in said
    assert stack.effects(f"{run_id}:send_email:order_lg") == 1


# ------------------------------------------------------------------------------ Pydantic AI


@dataclass
class Deps:
    run_id: str


def _scripted_model(tool_name: str, args: dict) -> Any:
    from pydantic_ai.messages import ModelResponse, TextPart, ToolCallPart, ToolReturnPart
    from pydantic_ai.models.function import FunctionModel

    def script(messages: list, info: Any) -> ModelResponse:
        if any(isinstance(p, ToolReturnPart) for m in messages for p in getattr(m, "parts", [])):
            return ModelResponse(parts=[TextPart("done")])
        return ModelResponse(parts=[ToolCallPart(tool_name=tool_name, args={"args": args}, tool_call_id="call_1")])

    return FunctionModel(script)


def _tool_returns(result: Any) -> list[str]:
    from pydantic_ai.messages import ToolReturnPart

    return [
        str(p.content) for m in result.new_messages() for p in getattr(m, "parts", [])
        if isinstance(p, ToolReturnPart)
    ]


def test_pydantic_ai_a_rerun_executes_nothing_again(stack: Stack, idem: Idem, run_id: str) -> None:
    from pydantic_ai import Agent

    from idem_client.pydantic_ai import idem_tool

    tool = idem_tool(idem, "send_email", EmailArgs, run_id=lambda ctx: ctx.deps.run_id, business_id="order_pa")
    agent = Agent(_scripted_model("send_email", EMAIL), deps_type=Deps, tools=[tool])
    first = agent.run_sync("send the refund email", deps=Deps(run_id))
    second = agent.run_sync("send the refund email", deps=Deps(run_id))
    assert "not repeated" in _tool_returns(second)[0], _tool_returns(second)
    assert "not repeated" not in _tool_returns(first)[0]
    assert stack.effects(f"{run_id}:send_email:order_pa") == 1


class RefundArgs(BaseModel):
    """Refund an order."""

    order_id: str
    amount: int


def test_pydantic_ai_pending_approval_is_a_deferred_approval(
    stack: Stack, idem: Idem, run_id: str
) -> None:
    from pydantic_ai import Agent, DeferredToolRequests, DeferredToolResults

    from idem_client.pydantic_ai import idem_tool

    tool = idem_tool(idem, "refund", RefundArgs, run_id=lambda ctx: ctx.deps.run_id, business_id="ticket_pa")
    agent = Agent(
        _scripted_model("refund", {"order_id": "o-7", "amount": 40}),
        deps_type=Deps, tools=[tool], output_type=[str, DeferredToolRequests],
    )
    paused = agent.run_sync("refund order o-7", deps=Deps(run_id))
    assert isinstance(paused.output, DeferredToolRequests), paused.output
    [request] = paused.output.approvals
    key = paused.output.metadata[request.tool_call_id]["idempotency_key"]
    assert key == f"{run_id}:refund:ticket_pa"
    assert stack.effects(key) == 0
    stack.idem("approve", key, "--by", "pytest", "--reason", "checked")
    done = agent.run_sync(
        deps=Deps(run_id),
        message_history=paused.all_messages(),
        deferred_tool_results=DeferredToolResults(approvals={request.tool_call_id: True}),
    )
    assert done.output == "done"
    # The approved call is published again and answered from the record: the effect's result.
    [said] = _tool_returns(done)
    assert '"id": "eff_' in said, said
    assert stack.effects(key) == 1
