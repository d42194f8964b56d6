"""LangGraph: a tool whose run id is the graph's ``thread_id``, so a thread resumed from its
checkpoint re-executes nothing that already ran.

    from idem_client.langgraph import idem_tool

    send_email = idem_tool(idem, "send_email", EmailArgs, business_id=lambda a: a["order_id"])
    graph = ... ToolNode([send_email]) ...
    graph.invoke(state, {"configurable": {"thread_id": "ticket-7"}})

LangGraph checkpoints after each step: a step that failed after the tool ran is run again on
resume, and idem answers the second call from its record.
"""

from __future__ import annotations

from typing import Any, Callable, Type

from langchain_core.runnables import RunnableConfig
from langchain_core.tools import StructuredTool
from pydantic import BaseModel

from ._answer import call, for_model
from ._client import Idem


def idem_tool(
    idem: Idem,
    tool: str,
    args_schema: Type[BaseModel],
    *,
    business_id: "str | Callable[[dict[str, Any]], str | None] | None" = None,
    name: str | None = None,
    description: str | None = None,
    timeout: float = 30.0,
) -> StructuredTool:
    """A LangChain tool (what ``ToolNode`` runs) calling idem with the thread id as run id."""

    async def run(config: RunnableConfig, **args: Any) -> str:
        thread = (config.get("configurable") or {}).get("thread_id")
        if not thread:
            raise ValueError("idem tools need a thread_id in the graph's config (configurable.thread_id)")
        business = business_id(args) if callable(business_id) else business_id
        outcome = await call(idem, tool, args, run_id=str(thread), business_id=business, timeout=timeout)
        return outcome if isinstance(outcome, str) else for_model(outcome)

    def run_sync(config: RunnableConfig, **args: Any) -> str:
        import asyncio

        return asyncio.run(run(config, **args))

    return StructuredTool.from_function(
        func=run_sync,
        coroutine=run,
        name=name or tool,
        description=description or args_schema.__doc__ or f"Runs {tool} once, through idem.",
        args_schema=args_schema,
    )
