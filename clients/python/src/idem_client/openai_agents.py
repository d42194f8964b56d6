"""OpenAI Agents SDK (``openai-agents``): a tool whose every call goes through idem.

    from idem_client.openai_agents import idem_tool

    send_email = idem_tool(idem, "send_email", EmailArgs,
                           run_id=lambda ctx: ctx.context.run_id,
                           business_id=lambda ctx, args: args.order_id)
    agent = Agent(name="support", tools=[send_email])

The model sees the outcome's note and result: a repeat says "Already done …; not repeated. Do
not retry.", and a key waiting for approval says so (the SDK's own ``needs_approval`` asks
before a call; idem's approval is decided afterwards, by ``idem approve``, and the note tells
the model to wait). A rerun of the agent with the same run id re-executes nothing.
"""

from __future__ import annotations

from typing import Any, Callable, Type, TypeVar

from agents import FunctionTool, RunContextWrapper
from pydantic import BaseModel

from ._answer import call, for_model
from ._client import Idem

P = TypeVar("P", bound=BaseModel)


def idem_tool(
    idem: Idem,
    tool: str,
    params_model: Type[P],
    *,
    run_id: Callable[[RunContextWrapper[Any]], str],
    business_id: "str | Callable[[RunContextWrapper[Any], P], str | None] | None" = None,
    name: str | None = None,
    description: str | None = None,
    timeout: float = 30.0,
) -> FunctionTool:
    """A ``FunctionTool`` named ``name`` (default: the idem tool's name) whose arguments are
    ``params_model``, published to idem as the action's ``args``."""

    async def invoke(ctx: RunContextWrapper[Any], input_json: str) -> str:
        args = params_model.model_validate_json(input_json or "{}")
        business = business_id(ctx, args) if callable(business_id) else business_id
        outcome = await call(
            idem, tool, args.model_dump(mode="json"), run_id=run_id(ctx), business_id=business, timeout=timeout
        )
        return outcome if isinstance(outcome, str) else for_model(outcome)

    return FunctionTool(
        name=name or tool,
        description=description or params_model.__doc__ or f"Runs {tool} once, through idem.",
        params_json_schema=params_model.model_json_schema(),
        on_invoke_tool=invoke,
        strict_json_schema=False,
    )
